"""One request's cost is linear in its own bytes and bounded before it is spent: the third
hostile review's client cases (a cache salt vLLM refuses, request-wide fields copied into every
E sub-request, a media part carrying more than its media, parts nested near the depth limit, a
stream whose text is "role") and inline media forwarded as the bytes it came in."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import os
from typing import Any

import pytest

from mmreuse.proxy.body import PLAIN_MIN
from mmreuse.proxy.errors import ProxyError
from mmreuse.proxy.media import MAX_PART_VALUES, check_cache_salt
from tests.support.epd_proxy import epd
from tests.support.index_proxy import TEXT, B, e_sent, index_proxy
from tests.support.oracle import oracle_run
from tests.support.proxy_fakes import Fake, chat, img, sha

HANG_GUARD_S = 5.0  # a bound on a wait that must end at once (a hang guard, not a timing check)
POLICIES = ("reference", "tenant", "content")
JSON_TYPE = {"Content-Type": "application/json"}
VLLM_SALT_WORDS = "Parameter 'cache_salt' must be at most 128 characters"


def audio(i: int) -> dict[str, Any]:
    data = base64.b64encode(b"RIFF" + i.to_bytes(4, "big")).decode()
    return {"type": "input_audio", "input_audio": {"data": data, "format": "wav"}}


def nothing_sent(s: Any) -> bool:
    return all(f.chats() == [] for f in (*s.e, *s.p, *s.d))


# ---- H1: a cache salt vLLM refuses ---------------------------------------------------------------

REFUSED_SALTS = {
    "129-chars": "s" * 129,
    "4-MiB": "s" * (4 << 20),  # the review's: hashed once per image, it held every client 5-9 s
    "slash": "tenant/a",
    "at": "tenant@a",
    "backslash": "tenant\\a",
    "nul": "tenant\x00a",
    "empty": "",
    "int": 7,
    "list": ["a"],
}


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("name", sorted(REFUSED_SALTS))
async def test_a_cache_salt_vllm_refuses_is_refused_before_any_work(policy, name):
    images = [img(f"http://img.invalid/{i}.png") for i in range(999 if name == "4-MiB" else 3)]
    async with epd(flags=("--uuid-policy", policy)) as s:
        r = await s.post(chat(TEXT, *images, cache_salt=REFUSED_SALTS[name]))
        assert r.status == 400, await r.text()
        detail = (await r.json())["detail"]
        assert detail.startswith("Parameter 'cache_salt' must be"), detail
        assert nothing_sent(s)


@pytest.mark.parametrize("policy", POLICIES)
async def test_a_cache_salt_vllm_takes_is_served(policy):
    async with epd(flags=("--uuid-policy", policy)) as s:
        r = await s.post(chat(TEXT, img("data:image/png;base64,QUJD"), cache_salt="t" * 128))
        assert r.status == 200, await r.text()


SALT_CORPUS = ["", "a", "t" * 128, "t" * 129, "a/b", "a@b", "a\\b", "a\x00b", "é" * 128,
               "é" * 129, "a b", "a:b", "a#b", 7, 1.5, True, ["a"], {"a": 1}]  # fmt: skip

_VLLM_SALTS = """
import json, sys
from pydantic import ValidationError
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.exceptions import VLLMValidationError
out = []
for salt in json.load(sys.stdin):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    if salt is not None:
        body["cache_salt"] = salt
    try:
        ChatCompletionRequest.model_validate(body)
        out.append(True)
    except (ValidationError, VLLMValidationError):  # a 400 from vLLM's API server
        out.append(False)
print(json.dumps(out))
"""


def vllm_salt_verdicts(python: Any) -> list[bool]:
    """Whether `python`'s vLLM takes each salt of SALT_CORPUS (its chat request model)."""
    out = oracle_run(python, "-c", _VLLM_SALTS, input=json.dumps(SALT_CORPUS), timeout=300)
    return json.loads(out.stdout.strip().splitlines()[-1])


def check_salts(vllm: list[bool]) -> None:
    """The proxy refuses exactly the salts vLLM refuses (and the corpus has both)."""
    for salt, accepted in zip(SALT_CORPUS, vllm, strict=True):
        try:
            check_cache_salt({"cache_salt": salt})
            ours = True
        except ProxyError as e:
            assert e.status == 400
            ours = False
        assert ours == accepted, (salt, accepted)
    assert not all(vllm) and any(vllm)


def test_the_proxys_cache_salt_rule_is_vllms(oracle_python):
    check_salts(vllm_salt_verdicts(oracle_python))


# ---- H2: request-wide fields copied into each E sub-request ---------------------------------------


@pytest.mark.parametrize("key", ["mm_processor_kwargs", "media_io_kwargs", "session_id"])
async def test_fields_copied_into_each_e_subrequest_cannot_multiply_the_request(key):
    # Audio goes one item per sub-request: 64 items x a 64 KiB field would send E 4 MiB for a
    # request of ~70 KB (the review's 999 x 1 MiB: 999 MiB and 1 GB of proxy memory).
    field: Any = {"pad": "p" * (64 << 10)} if key != "session_id" else "p" * (64 << 10)
    async with epd() as s:
        r = await s.post(chat(TEXT, *(audio(i) for i in range(64)), **{key: field}))
        assert r.status == 400, await r.text()
        detail = (await r.json())["detail"]
        assert detail.startswith(f"{key} ({len(json.dumps(field, separators=(',', ':')))} bytes)")
        assert "up to 64 (one per audio or video item)" in detail
        assert nothing_sent(s)


async def test_copied_fields_within_the_bound_reach_every_e_subrequest():
    kwargs = {"pad": "p" * 1000}
    async with epd() as s:
        r = await s.post(chat(TEXT, *(audio(i) for i in range(64)), mm_processor_kwargs=kwargs))
        assert r.status == 200, await r.text()
        subs = s.e[0].chats()
        assert len(subs) == 64 and all(x.body["mm_processor_kwargs"] == kwargs for x in subs)


async def test_images_share_their_sub_request_so_a_field_is_copied_once_per_encoder():
    kwargs = {"pad": "p" * (256 << 10)}  # 256 KiB, 999 images, one E: one sub-request
    images = [img(f"http://img.invalid/{i}.png") for i in range(999)]
    async with epd() as s:
        r = await s.post(chat(TEXT, *images, mm_processor_kwargs=kwargs))
        assert r.status == 200, await r.text()
        assert len(s.e[0].chats()) == 1


# ---- M1: what a media part may carry; what a body may hold ----------------------------------------


@pytest.mark.parametrize("policy", POLICIES)
async def test_a_media_part_carrying_more_than_its_media_is_refused(policy):
    # The review's: one input_audio part with 5,000,000 extra keys held every client 4-8 s while
    # its content key (its sorted JSON) was taken; a part may hold MAX_PART_VALUES values.
    part = audio(0)
    part["input_audio"].update({f"k{i}": i for i in range(MAX_PART_VALUES)})
    async with epd(flags=("--uuid-policy", policy)) as s:
        r = await s.post(chat(TEXT, part, cache_salt="t"))
        assert r.status == 400, await r.text()
        assert (await r.json())["detail"].startswith("the input_audio part: a media part named")
        assert nothing_sent(s)


@pytest.mark.parametrize(
    "flags, body, words",
    [
        (
            ("--max-body-values", "1000"),
            chat(*({"type": "text", "text": "x"} for _ in range(1000))),
            "JSON values, more than --max-body-values 1000",
        ),
        (
            ("--max-body-text-bytes", "4096"),
            chat({"type": "text", "text": "é\n" * 2048}),
            "more than --max-body-text-bytes 4096",
        ),
        (
            (),
            chat({"type": "text", "text": "x"}, extra=[{"k": i} for i in range(1 << 17)]),
            "more than --max-body-values 131072",
        ),
    ],
)
async def test_a_body_over_what_may_be_decoded_is_a_400(flags, body, words):
    async with epd(flags=flags) as s:
        r = await s.post(body)
        assert r.status == 400, await r.text()
        assert words in (await r.json())["detail"]
        assert nothing_sent(s)


def nested(depth: int) -> bytes:
    """A chat request whose image part carries a key nested `depth` levels below the part (as
    bytes: Python's json cannot write what is nested deepest)."""
    chain = b"[" * (depth - 2) + b"1" + b"]" * (depth - 2)
    part = b'{"type":"image_url","image_url":{"url":"http://img.invalid/a.png"},"extra":%s}' % chain
    return b'{"model":"tiny","messages":[{"role":"user","content":[%s]}]}' % part


@pytest.mark.parametrize("depth", [40, 100, 124, 125, 126, 127, 500, 975, 980, 984])
async def test_a_part_nested_near_any_depth_limit_is_a_client_error(depth):
    # At 975-984 levels msgspec decoded the body, then the proxy's own re-encoding for E failed
    # a level or two deeper: a 502 blaming E, or a 500 with a traceback. Now a body nests at
    # most 128 levels, well under what the proxy re-encodes: served, or a 400.
    async with epd() as s:
        r = await s.client.post("/v1/chat/completions", data=nested(depth), headers=JSON_TYPE)
        if depth + 3 <= 128:  # the body's object, messages, message and content hold the part
            assert r.status == 200, await r.text()
            assert [len(x.body["messages"][0]["content"]) for x in s.e[0].chats()] == [1]
            return
        assert r.status == 400, await r.text()
        assert nothing_sent(s)


@pytest.mark.parametrize("policy", POLICIES)
async def test_large_inline_media_reaches_e_and_p_as_it_came(policy):
    # 2 MiB of base64 (a body over OFF_LOOP_BYTES): never decoded, spliced into E's body and
    # (mixed with a raw item of the same modality) P's, named by the text it is.
    media = "data:image/png;base64," + base64.b64encode(os.urandom(3 << 19)).decode()
    audio_data = base64.b64encode(os.urandom(PLAIN_MIN)).decode()
    part = {"type": "input_audio", "input_audio": {"data": audio_data, "format": "wav"}}
    async with epd(flags=("--uuid-policy", policy)) as s:
        r = await s.post(chat(TEXT, img(media), part, cache_salt="t"))
        assert r.status == 200, await r.text()
        at_e = sorted(
            (p for x in s.e[0].chats() for p in x.body["messages"][0]["content"]),
            key=lambda p: p["type"] != "image_url",  # sent at once: in any order
        )
        assert at_e[0]["image_url"]["url"] == media
        assert at_e[1]["input_audio"]["data"] == audio_data
        if policy == "reference":
            assert at_e[0]["uuid"] == sha(media)
            sorted_json = json.dumps(part, sort_keys=True)
            assert at_e[1]["uuid"] == hashlib.sha256(sorted_json.encode()).hexdigest()
        sent = s.pd.chats()[-1].body["messages"][0]["content"]
        assert [p.get("uuid") for p in sent[1:]] == [p["uuid"] for p in at_e]


async def test_large_inline_media_is_rendered_and_planned_under_index():
    media = "data:image/png;base64," + base64.b64encode(os.urandom(3 << 19)).decode()
    async with index_proxy() as s:
        await s.hold(0, [sha(media), sha(B)], 4)  # P's prefix cache covers the first image
        r = await s.post(chat(TEXT, img(media), img(B)))
        assert r.status == 200, await r.text()
        [rendered] = [x for x in s.pd[0].seen if x.path.endswith("/render")]
        assert rendered.body["messages"][0]["content"][1]["image_url"]["url"] == media
        assert e_sent(s) == [sha(B)]  # the held one is skipped, sent to P raw with its uuid
        sent = s.pd[0].chats()[-1].body["messages"][0]["content"][1]
        assert sent["image_url"]["url"] == media and sent["uuid"] == sha(media)


# ---- L1: a stream whose text is "role" -----------------------------------------------------------

ROLE = b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n'
TOKEN_ROLE = b'data: {"choices":[{"index":0,"delta":{"content":"role"}}]}\n\n'


@pytest.mark.parametrize("logprobs", [False, True])
async def test_a_stream_whose_text_is_role_is_not_held(logprobs):
    # A stream that may carry vLLM's lost-embedding error (E's references went to PD) is held
    # for its first token: the token "role" is one, though its event names `"role"` too.
    token = TOKEN_ROLE
    if logprobs:
        token = (b'data: {"choices":[{"index":0,"delta":{"content":"role"},"logprobs":'
                 b'{"content":[{"token":"role","logprob":-0.1}]}}]}\n\n')  # fmt: skip
    pd = Fake("pd", chunks=(ROLE, token, TOKEN_ROLE, b"data: [DONE]\n\n"), stall_after=2)
    async with epd(d_urls=[(await pd.start()).url]) as s:
        try:
            r = await s.post(chat(TEXT, img("http://img.invalid/a.png"), stream=True))
            assert r.status == 200
            got = b""
            while b'"content":"role"' not in got:  # the first token, while PD is silent
                got += await asyncio.wait_for(r.content.readany(), HANG_GUARD_S)
            pd.release.set()
            got += await r.read()
            assert got == ROLE + token + TOKEN_ROLE + b"data: [DONE]\n\n"
        finally:
            await pd.close()
