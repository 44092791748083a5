"""A request P fails because the embedding store lost what it had only as E's reference
(MooncakeStoreConnector's `take_unavailable_requests`: vLLM finishes it with FinishReason.ERROR)
is retried once, with E encoding the items again under a fresh uuid and P getting them raw
(P's processor cache may hold the old uuid as the reference), under every mmreuse policy: the
client never sees it. vLLM 0.32 / 0.33 answer such a request with
"Internal server error" (`_raise_if_error`): a 500 when not streaming, and in a 200 stream an
error event right after the role's first event (what these fakes answer)."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from aiohttp import web

from tests.support.epd_proxy import epd
from tests.support.proxy_fakes import chat, img, sha

# vLLM's ErrorResponse for GenerationError("Internal server error")
VLLM_ERROR = {
    "error": {
        "message": "Internal server error",
        "type": "InternalServerError",
        "param": None,
        "code": 500,
    }
}
ROLE = {
    "id": "chatcmpl-x",
    "object": "chat.completion.chunk",
    "created": 1,
    "model": "tiny",
    "choices": [
        {
            "index": 0,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
    ],
}
OK_CHUNKS = (
    b"data: " + json.dumps(ROLE).encode() + b"\n\n",
    b'data: {"choices":[{"index":0,"delta":{"content":"he"}}]}\n\n',
    b'data: {"choices":[{"index":0,"delta":{"content":"llo"}}]}\n\n',
    b"data: [DONE]\n\n",
)
# what vLLM streams for a request its scheduler failed before the first token
LOST_STREAM = (
    b"data: " + json.dumps(ROLE).encode() + b"\n\n"
    b"data: " + json.dumps(VLLM_ERROR).encode() + b"\n\n"
    b"data: [DONE]\n\n"
)
URL = "http://img/a.png"


def lost_once(n: int = 1, *, stream: bool = False, error: Any = VLLM_ERROR):
    """A chat answer that is vLLM's request-level error for the first `n` calls, then None
    (the fake's default answer)."""
    calls = {"n": 0}

    def answer(body: dict) -> Any:
        calls["n"] += 1
        if calls["n"] > n:
            return None
        if body.get("stream") and stream:
            return web.Response(body=LOST_STREAM, content_type="text/event-stream")
        return web.json_response(error, status=500)

    return answer


def default_then(answer):
    """Wrap `answer` so that None falls through to what the fake would answer by default."""

    def wrapped(body: dict) -> Any:
        out = answer(body)
        if out is not None:
            return out
        if body.get("stream"):
            return web.Response(body=b"".join(OK_CHUNKS), content_type="text/event-stream")
        return {
            "id": "chatcmpl-pd",
            "object": "chat.completion",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}}],
            "kv_transfer_params": {"remote_engine_id": "p-engine", "remote_block_ids": [1]},
        }

    return wrapped


def parts(seen) -> list[dict]:
    return seen.body["messages"][0]["content"]


def retried(part: dict) -> None:
    """`part` is the item raw, under its uuid made fresh for the retry."""
    assert {k: v for k, v in part.items() if k != "uuid"} == {
        "type": "image_url",
        "image_url": {"url": URL},
    }
    assert re.fullmatch(sha(URL) + ":lost-[0-9a-f]{8}", part["uuid"]), part


@pytest.mark.parametrize("stream", [False, True])
async def test_a_lost_reference_is_retried_once_with_the_item_raw(stream):
    async with epd() as s:
        s.pd.answer = default_then(lost_once(stream=stream))
        r = await s.post(chat(img(URL), {"type": "text", "text": "x"}, stream=stream))
        assert r.status == 200
        if stream:
            assert await r.read() == b"".join(OK_CHUNKS)  # nothing of the failed attempt
        else:
            assert (await r.json())["choices"][0]["message"]["content"] == "hi"
        first, second = s.pd.chats()
        assert parts(first)[0] == {
            "type": "image_embeds",
            "image_embeds": {"image_grid_thw": [1, 2, 2]},
            "uuid": sha(URL),
        }
        # E encodes it again, and P gets it raw: if the store loses it again, P encodes it
        e1, e2 = s.e[0].chats()
        assert parts(e1)[0]["uuid"] == sha(URL)
        retried(parts(second)[0])
        assert parts(e2)[0]["uuid"] == parts(second)[0]["uuid"]
        stage = "stream" if stream else "decode"
        assert (
            s.sample("mmreuse_proxy_embedding_lost_retries_total", instance="PD0", stage=stage) == 1
        )
        assert s.sample("mmreuse_proxy_fallbacks_total", instance="PD0", kind="retry") == 0
        assert s.sample("mmreuse_proxy_requests_total", policy="eager", outcome="ok") == 1


async def test_e_p_d_a_lost_reference_at_prefill_is_retried():
    async with epd(n_p=1) as s:
        s.p[0].answer = default_then(lost_once())
        r = await s.post(chat(img(URL)))
        assert r.status == 200
        p1, p2 = s.p[0].chats()
        assert parts(p1)[0]["type"] == "image_embeds"
        retried(parts(p2)[0])
        assert len(s.e[0].chats()) == 2 and len(s.d[0].chats()) == 1
        assert (
            s.sample("mmreuse_proxy_embedding_lost_retries_total", instance="P0", stage="prefill")
            == 1
        )


@pytest.mark.parametrize("stream", [False, True])
async def test_retried_once_even_with_decode_retries_zero_and_bounded(stream):
    async with epd(flags=("--decode-retries", "0")) as s:
        s.pd.answer = default_then(lost_once(stream=stream))
        assert (await s.post(chat(img(URL), stream=stream))).status == 200
        # failed again on the retry (here: the fake fails it whatever P got): not retried
        # again, P's answer is the client's (P had the item raw: not a lost reference)
        s.pd.answer = default_then(lost_once(5, stream=stream))
        r = await s.post(chat(img(URL), stream=stream))
        if stream:
            assert r.status == 200 and await r.read() == LOST_STREAM
        else:
            assert r.status == 500
            assert json.loads((await r.json())["detail"]) == VLLM_ERROR
        assert len(s.pd.chats()) == 4  # two attempts each
        stage = "stream" if stream else "decode"
        assert (
            s.sample("mmreuse_proxy_embedding_lost_retries_total", instance="PD0", stage=stage) == 2
        )


async def test_other_500s_are_not_taken_for_a_lost_reference():
    # another 500 body, or vLLM's request-level error for a request that carried no reference
    # (the item went raw: nothing the store could lose): the decode retry's rules, unchanged
    other = {"error": {"message": "boom", "type": "InternalServerError", "code": 500}}
    async with epd(flags=("--decode-retries", "0")) as s:
        s.pd.answer = default_then(lost_once(error=other))
        assert (await s.post(chat(img(URL)))).status == 500
    async with epd(flags=("--decode-retries", "0", "--no-rewrite")) as s:
        s.pd.answer = default_then(lost_once())
        assert (await s.post(chat(img(URL)))).status == 500
        assert (
            s.sample("mmreuse_proxy_embedding_lost_retries_total", instance="PD0", stage="decode")
            == 0
        )


async def test_a_stream_is_held_only_until_its_first_token():
    # the role's event, then a token: forwarded byte for byte, no retry
    async with epd() as s:
        s.pd.chunks = OK_CHUNKS
        r = await s.post(chat(img(URL), stream=True))
        assert r.status == 200 and await r.read() == b"".join(OK_CHUNKS)
        assert len(s.pd.chats()) == 1
        # an error event after a token is the stream's, not a lost reference: forwarded
        late = (OK_CHUNKS[0], OK_CHUNKS[1], b"data: " + json.dumps(VLLM_ERROR).encode() + b"\n\n")
        s.pd.chunks = late
        r = await s.post(chat(img(URL), stream=True))
        assert r.status == 200 and await r.read() == b"".join(late)
        assert len(s.pd.chats()) == 2
        assert (
            s.sample("mmreuse_proxy_embedding_lost_retries_total", instance="PD0", stage="stream")
            == 0
        )


@pytest.mark.parametrize("stream", [False, True])
async def test_an_item_planned_as_held_is_retried_when_p_cannot_find_it(stream):
    # Under index an item P is planned to hold goes raw with its uuid; P's processor cache may
    # map that uuid to E's reference from an earlier request, so a store that lost the
    # embedding fails the request just the same: retried, E encodes it under a fresh uuid.
    from tests.support.index_proxy import TEXT, B, index_proxy

    async with index_proxy() as s:
        await s.hold(0, [sha(URL), sha(B)], 4)  # P's prefix cache covers the first image
        s.pd[0].answer = default_then(lost_once(stream=stream))
        r = await s.post(chat(TEXT, img(URL), img(B), stream=stream))
        assert r.status == 200
        if stream:
            assert await r.read() == b"".join(OK_CHUNKS)
        first, second = s.pd[0].chats()
        assert parts(first)[1] == {**img(URL), "uuid": sha(URL)}  # planned as held: no E
        assert parts(first)[2] == {**img(B), "uuid": sha(B)}  # B: from E, raw (no mix)
        e1, e2 = s.e.chats()
        assert [p["uuid"] for p in parts(e1)] == [sha(B)]
        retried(parts(second)[1])
        assert [p["uuid"] for p in parts(e2)] == [p["uuid"] for p in parts(second)[1:]]
        stage = "stream" if stream else "decode"
        assert (
            s.sample("mmreuse_proxy_embedding_lost_retries_total", instance="PD0", stage=stage) == 1
        )
