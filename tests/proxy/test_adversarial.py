"""`mmreuse proxy` against hostile peers: a render answer that disagrees with the request, an E
whose `ec_transfer_params` are garbage, a decode stream that stalls or breaks, clients that
mint tenants, and concurrent requests sharing the round-robin cursor. The invariant most tests
check: an item P receives as an embeds reference (no media) is one E was sent, under the same
uuid (else P can neither find its embedding nor encode it). Tests marked xfail(strict) pin real
bugs; the rest pin hostile inputs the proxy already survives."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import zlib
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from mmreuse.cluster.instance import free_ports
from mmreuse.proxy.records import Decision
from tests.support.epd_proxy import epd
from tests.support.index_proxy import (
    TEXT,
    A,
    B,
    C,
    Setup,
    e_sent,
    index_proxy,
    pd_content,
    render,
)
from tests.support.proxy_fakes import chat, img, proxy_client, sha
from tests.support.waiting import async_wait_for, async_wait_until

HANG_GUARD_S = 3.0  # a bound on a wait that must end at once (a hang guard, not a timing check)
STREAM = (b"data: 1\n\n", b"data: 2\n\n", b"data: [DONE]\n\n")


def orphans(s: Setup) -> list[str]:
    """uuids P received as embeds references (no media) that E was never sent."""
    sent = set(e_sent(s))
    return [
        part["uuid"]
        for x in s.pd[0].chats()
        for part in x.body["messages"][0]["content"]
        if part.get("type", "").endswith("_embeds") and part.get("uuid") not in sent
    ]


def capture(s: Setup) -> list[Decision]:
    """The decisions the proxy makes from now on (its after_decide hook)."""
    out: list[Decision] = []

    async def hook(decision: Decision) -> None:
        out.append(decision)

    s.proxy.after_decide = hook
    return out


async def until(cond: Any, what: str) -> None:
    assert await async_wait_for(cond, HANG_GUARD_S), f"hung: {what}"


# ---- render's answer disagrees with the request -------------------------------------------------


async def test_render_naming_two_different_items_alike_never_orphans_one():
    def one_identifier(body: dict[str, Any]) -> dict[str, Any]:
        out = render(body)
        ids = out["features"]["mm_hashes"]["image"]
        out["features"]["mm_hashes"]["image"] = [ids[0]] * len(ids)
        return out

    async with index_proxy() as s:
        s.pd[0].render = one_identifier
        assert (await s.post(chat(TEXT, img(A), img(B)))).status == 200
        assert orphans(s) == []  # B is sent to E, or reaches P raw


async def test_placeholders_out_of_item_order_keep_each_item_its_identifier():
    # [A, B, A]: render lists the identifiers in item order, but puts item 2's placeholders
    # (A) before item 1's (B).
    def reordered(body: dict[str, Any]) -> dict[str, Any]:
        out = render(body)
        places = out["features"]["mm_placeholders"]["image"]
        places[1], places[2] = places[2], places[1]
        return out

    async with index_proxy() as s:
        decisions = capture(s)
        s.pd[0].render = reordered
        assert (await s.post(chat(TEXT, img(A), img(B), img(A)))).status == 200
        [d] = decisions
        assert d.trace.no_plan is not None or d.identifiers == (sha(A), sha(B), sha(A))
        assert orphans(s) == []


async def test_a_deeply_nested_render_answer_costs_the_plan_not_the_request():
    deep = b'{"token_ids":[1],"features":' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    async with index_proxy() as s:
        await s.hold(0, [sha(A)], 3)  # P may hold A: the request waits for its render
        s.pd[0].render = lambda body: deep
        r = await s.post(chat(TEXT, img(A)))
        assert r.status == 200, await r.text()
        assert e_sent(s) == [sha(A)]
        assert s.sample("mmreuse_proxy_fallbacks_total", instance="PD0", kind="no_plan") == 1


@pytest.mark.parametrize(
    "features",
    [
        # one image more than the request
        {
            "mm_hashes": {"image": ["x", "y", "z"]},
            "mm_placeholders": {"image": [{"offset": 40 + 16 * k, "length": 16} for k in range(3)]},
        },
        # a modality the request does not have
        {
            "mm_hashes": {"image": ["x", "y"], "audio": ["z"]},
            "mm_placeholders": {
                "image": [{"offset": 40, "length": 16}, {"offset": 56, "length": 16}],
                "audio": [{"offset": 72, "length": 8}],
            },
        },
        # overlapping placeholders
        {
            "mm_hashes": {"image": ["x", "y"]},
            "mm_placeholders": {"image": [{"offset": 40, "length": 16}] * 2},
        },
        # a modality render cannot say which tokens are embeds of (video)
        {
            "mm_hashes": {"video": ["x", "y"]},
            "mm_placeholders": {"video": [{"offset": 40, "length": 16}] * 2},
        },
    ],
)
async def test_render_disagreeing_with_the_request_sends_everything(features):
    def answer(body: dict[str, Any]) -> dict[str, Any]:
        return {"token_ids": [1] * 100, "features": features}

    async with index_proxy() as s:
        await s.hold(0, [sha(A), sha(B)], 4)  # P may hold A and B: both wait for the render
        s.pd[0].render = answer
        assert (await s.post(chat(TEXT, img(A), img(B)))).status == 200
        assert e_sent(s) == [sha(A), sha(B)]
        assert orphans(s) == []
        assert s.sample("mmreuse_proxy_fallbacks_total", instance="PD0", kind="no_plan") == 1


async def test_audio_in_video_under_index_sends_everything():
    # use_audio_in_video: one video item, two features (video and audio) in render: no plan,
    # E gets the video, as under eager.
    video = {"type": "video_url", "video_url": {"url": "http://v/1.mp4"}}

    def answer(body: dict[str, Any]) -> dict[str, Any]:
        uid = body["messages"][0]["content"][1]["uuid"]
        return {
            "token_ids": [1] * 100,
            "features": {
                "mm_hashes": {"video": [uid], "audio": [uid]},
                "mm_placeholders": {
                    "video": [{"offset": 40, "length": 16}],
                    "audio": [{"offset": 56, "length": 8}],
                },
            },
        }

    async with index_proxy() as s:
        s.pd[0].render = answer
        body = chat(TEXT, video, mm_processor_kwargs={"use_audio_in_video": True})
        assert (await s.post(body)).status == 200
        assert e_sent(s) == [sha("http://v/1.mp4")]
        assert s.sample("mmreuse_proxy_fallbacks_total", instance="PD0", kind="no_plan") == 1


async def test_modalities_in_another_order_than_the_request_map_per_modality():
    # The request is [image A, audio X]; render places X's placeholders first. Occurrences map
    # per modality, so each item keeps its identifier.
    x_url = "http://a/x.wav"
    audio = {"type": "audio_url", "audio_url": {"url": x_url}}

    def answer(body: dict[str, Any]) -> dict[str, Any]:
        parts = body["messages"][0]["content"]
        return {
            "token_ids": [1] * 100,
            "features": {
                "mm_hashes": {"image": [parts[1]["uuid"]], "audio": [parts[2]["uuid"]]},
                "mm_placeholders": {
                    "image": [{"offset": 60, "length": 16}],
                    "audio": [{"offset": 40, "length": 8}],
                },
            },
        }

    async with index_proxy() as s:
        decisions = capture(s)
        s.pd[0].render = answer
        assert (await s.post(chat(TEXT, img(A), audio))).status == 200
        assert [d.identifiers for d in decisions] == [(sha(A), sha(x_url))]
        assert sorted(e_sent(s)) == sorted([sha(A), sha(x_url)])
        assert orphans(s) == []


async def test_processor_kwargs_change_identifiers_consistently():
    # With mm_processor_kwargs vLLM's identifier is a hash of the uuid and the kwargs, not the
    # uuid. The plan uses render's identifiers (P's KV keys); E and P get the uuid and the same
    # kwargs, so they derive the same identifier.
    def kw(uid: str) -> str:
        return "kw-" + uid

    def answer(body: dict[str, Any]) -> dict[str, Any]:
        out = render(body)
        out["features"]["mm_hashes"]["image"] = [
            kw(u) for u in out["features"]["mm_hashes"]["image"]
        ]
        return out

    kwargs = {"max_pixels": 1000}
    async with index_proxy() as s:
        decisions = capture(s)
        s.pd[0].render = answer
        await s.hold(0, [kw(sha(A)), kw(sha(B))], 4)
        assert (await s.post(chat(TEXT, img(A), img(B), mm_processor_kwargs=kwargs))).status == 200
        assert e_sent(s) == [sha(B)]
        assert s.e.chats()[0].body["mm_processor_kwargs"] == kwargs
        body = s.pd[0].chats()[0].body
        assert body["mm_processor_kwargs"] == kwargs
        assert pd_content(s)[1] == {**img(A), "uuid": sha(A)}
        assert decisions[0].identifiers == (kw(sha(A)), kw(sha(B)))
        assert orphans(s) == []


# ---- tenants ------------------------------------------------------------------------------------


async def test_the_request_cache_salt_scopes_the_plan_whatever_render_says():
    def no_salt(body: dict[str, Any]) -> dict[str, Any]:
        out = render(body)
        out.pop("cache_salt", None)
        return out

    async with index_proxy() as s:
        await s.hold(0, [sha(A), sha(B)], 4)  # blocks of the unsalted tenant
        s.pd[0].render = no_salt
        assert (await s.post(chat(TEXT, img(A), img(B), cache_salt="tenant-b"))).status == 200
        assert e_sent(s) == [sha(A), sha(B)]  # tenant-b holds nothing
        assert s.sample("mmreuse_proxy_occurrences_total", klass="kv_covered") == 0


async def test_client_cache_salts_do_not_grow_e_side_memory_past_e_cache_items():
    async with index_proxy(flags=("--e-cache-items", "2")) as s:
        for i in range(6):
            assert (await s.post(chat(TEXT, img(A), cache_salt=f"tenant-{i}"))).status == 200
        assert e_sent(s) == [sha(A)] * 6
        assert s.sample("mmreuse_availability_entries", location="e:E") <= 2


async def test_salted_e_side_entries_do_not_serve_another_tenant():
    # E-side availability is per tenant: what tenant a sent E is e_cached for a only.
    async with index_proxy() as s:
        assert (await s.post(chat(TEXT, img(A), cache_salt="a"))).status == 200
        assert (await s.post(chat(TEXT, img(A), cache_salt="b"))).status == 200
        assert (await s.post(chat(TEXT, img(A)))).status == 200
        assert s.sample("mmreuse_proxy_occurrences_total", klass="e_cached") == 0
        assert (await s.post(chat(TEXT, img(A), cache_salt="a"))).status == 200
        assert s.sample("mmreuse_proxy_occurrences_total", klass="e_cached") == 1


# ---- E answers garbage --------------------------------------------------------------------------


def _entry(**kw: Any) -> dict[str, Any]:
    return {"modality": "image", "metadata": {"image_grid_thw": [1, 2, 2]}, **kw}


@pytest.mark.parametrize(
    "answer, statuses",
    [
        ({"ec_transfer_params": [1, 2]}, {502}),
        ({"ec_transfer_params": "abc"}, {502}),
        ({"ec_transfer_params": {"h": 5}}, {502}),
        ({"ec_transfer_params": {"h": _entry(item_indices=5)}}, {500, 502}),
        ({"ec_transfer_params": {"h": _entry(item_indices=[0, 0])}}, {502}),
        ({"ec_transfer_params": {"h": _entry(item_indices=[True])}}, {502}),
        ({"ec_transfer_params": {"h": _entry(item_indices=[2**70])}}, {502}),
        ({"ec_transfer_params": {"h": {**_entry(item_indices=[0, 1]), "metadata": "x"}}}, {500}),
        ({"ec_transfer_params": {"h": {**_entry(item_indices=[0, 1]), "modality": 5}}}, {500}),
        ({"ec_transfer_params": {f"h{i}": _entry() for i in range(20_000)}}, {502}),
        ([1, 2, 3], {200}),  # not an object: no metadata, items stay raw
        ({"ec_transfer_params": None}, {200}),
    ],
)
async def test_hostile_encoder_metadata_is_an_error_or_raw_never_a_hang(answer, statuses):
    # The reference does the same (its fanout_encoder_primer, line for line); what matters is
    # that the proxy answers, never orphans an item, and serves the next request.
    async with epd() as s:
        s.e[0].answer = lambda body: answer
        r = await asyncio.wait_for(s.post(chat(TEXT, img(A), img(B))), HANG_GUARD_S)
        assert r.status in statuses, await r.text()
        for x in s.pd.chats():
            assert all(p.get("type") != "image_embeds" for p in x.body["messages"][0]["content"])
        s.e[0].answer = None
        assert (await s.post(chat(TEXT, img(C)))).status == 200


# ---- concurrency --------------------------------------------------------------------------------


async def test_concurrent_requests_keep_their_own_embeddings_and_a_fair_rotation():
    # 16 requests x 3 images over 2 encoders answering in random order: each item's metadata
    # at P is the one E computed for its own uuid, and the shared cursor splits the items evenly.
    rng = random.Random(7)

    def grid(uid: str) -> list[int]:
        return [1, 2 + int(uid[:2], 16), 2 + int(uid[2:4], 16)]

    def e_answer(body: dict[str, Any]) -> dict[str, Any]:
        params = {
            p["uuid"]: {
                "modality": "image",
                "item_indices": [i],
                "metadata": {"image_grid_thw": grid(p["uuid"])},
            }
            for i, p in enumerate(body["messages"][0]["content"])
        }
        return {"ec_transfer_params": params}

    async with epd(n_e=2) as s:
        for e in s.e:
            e.answer = e_answer
            e.delay = lambda body: rng.random() * 0.02
        urls = [[f"http://img/{r}-{k}.png" for k in range(3)] for r in range(16)]
        replies = await asyncio.gather(
            *(s.post(chat(TEXT, *map(img, u)), request_id=f"r{n}") for n, u in enumerate(urls))
        )
        assert [r.status for r in replies] == [200] * 16
        by_id = {x.headers["x-request-id"]: x.body for x in s.pd.chats()}
        for n, u in enumerate(urls):
            content = by_id[f"r{n}"]["messages"][0]["content"]
            assert [p["uuid"] for p in content[1:]] == [sha(x) for x in u]
            for p in content[1:]:
                assert p["image_embeds"] == {"image_grid_thw": grid(p["uuid"])}
        counts = [sum(len(x.body["messages"][0]["content"]) for x in e.chats()) for e in s.e]
        assert counts == [24, 24]


# ---- decode streams -----------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def served_proxy(*argv: str):
    """`mmreuse proxy` as run in production (workers.run -> server.serve: its own AppRunner), in a subprocess."""
    (port,) = free_ports(1)
    code = "import sys; from mmreuse.cli import main; sys.exit(main())"
    proc = subprocess.Popen(
        [sys.executable, "-c", code, "proxy", "--host", "127.0.0.1", "--port", str(port), *argv],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as session:
            await until_up(session, f"{base}/metrics", proc)
        yield base
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=10)


async def test_a_client_hanging_up_releases_a_stalled_decode_stream(fakes):
    e = await fakes("e")
    pd = await fakes("pd", chunks=STREAM, stall_after=1)
    async with served_proxy(
        "--encode-servers-urls", e.url, "--decode-servers-urls", pd.url
    ) as base:
        async with aiohttp.ClientSession() as client:
            r = await client.post(f"{base}/v1/chat/completions", json=chat(img(A), stream=True))
            assert r.status == 200
            assert await asyncio.wait_for(r.content.readany(), HANG_GUARD_S) == STREAM[0]
            r.close()  # the client hangs up
        await until(lambda: pd.hung_up == 1, "decode's request outlived its client")


async def _metric(session: aiohttp.ClientSession, base: str, name: str, **labels: str) -> float:
    async with session.get(f"{base}/metrics") as r:
        text = await r.text()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return sample.value
    return 0.0


_ENDED = ("ok", "client_gone")


async def test_a_client_hanging_up_is_not_a_decode_error(fakes):
    e = await fakes("e")
    pd = await fakes("pd", chunks=STREAM, stall_after=1)
    async with (
        served_proxy("--encode-servers-urls", e.url, "--decode-servers-urls", pd.url) as base,
        aiohttp.ClientSession() as client,
    ):
        r = await client.post(f"{base}/v1/chat/completions", json=chat(img(A), stream=True))
        assert await asyncio.wait_for(r.content.readany(), HANG_GUARD_S) == STREAM[0]
        r.close()  # the client hangs up
        pd.release.set()  # decode speaks again (if the proxy still listens)
        name = "mmreuse_proxy_requests_total"

        # the request ends one of three ways: decode's request closed, decode's stream all
        # forwarded before the proxy noticed (ok), or a write to the gone client (client_gone)
        async def ended() -> bool:
            return pd.hung_up > 0 or any(
                [await _metric(client, base, name, policy="eager", outcome=o) for o in _ENDED]
            )

        assert await async_wait_until(ended, HANG_GUARD_S), "hung: the request never ended"
        assert await _metric(client, base, "mmreuse_proxy_errors_total", stage="decode") == 0


async def test_a_broken_decode_stream_ends_with_an_error_event_not_counted_ok():
    async with epd() as s:
        s.pd.chunks, s.pd.abort_after = STREAM, 1
        r = await s.post(chat(img(A), stream=True))
        got = await asyncio.wait_for(r.read(), HANG_GUARD_S)  # ended, not cut
        assert got.startswith(STREAM[0])
        *_, error, done, tail = got.split(b"\n\n")
        assert (done, tail) == (b"data: [DONE]", b"")
        assert json.loads(error.removeprefix(b"data: "))["error"]["code"] == 502

        def ended() -> bool:
            return s.sample("mmreuse_proxy_errors_total", stage="decode") == 1

        await until(ended, "the request never ended")
        assert s.sample("mmreuse_proxy_requests_total", policy="eager", outcome="ok") == 0
        broken = s.sample("mmreuse_proxy_requests_total", policy="eager", outcome="stream_broken")
        assert broken == 1


# ---- metrics ------------------------------------------------------------------------------------


def _label_sets(text: str) -> set[tuple[str, tuple[tuple[str, str], ...]]]:
    return {
        (sample.name, tuple(sorted(sample.labels.items())))
        for family in text_string_to_metric_families(text)
        if family.name.startswith("mmreuse_")
        for sample in family.samples
    }


async def test_clients_cannot_mint_metric_label_values():
    # Salts, uuids, request ids, models, modalities and broken bodies vary per request; the
    # label sets on /metrics after a second round of fresh values are those of the first.
    rng = random.Random(3)

    def fresh() -> str:
        return hashlib.sha256(str(rng.random()).encode()).hexdigest()[:12]

    async def round_() -> set:
        bodies: list[Any] = [
            chat(TEXT, img(A), img(A), cache_salt=fresh(), model=fresh()),
            chat(TEXT, img(f"http://img/{fresh()}", uuid=fresh()), stream=True),
            chat(
                TEXT,
                {"type": "audio_url", "audio_url": {"url": fresh()}},
                {"type": fresh(), "x": 1},
            ),
            chat(TEXT, {"type": "image_url", "image_url": fresh()}),
            [fresh()],
        ]
        for body in bodies:
            r = await s.client.post(
                "/v1/chat/completions", json=body, headers={"x-request-id": fresh()}
            )
            await r.read()
        r = await s.client.post("/v1/chat/completions", data=fresh())
        await r.read()
        return _label_sets(await (await s.client.get("/metrics")).text())

    async with index_proxy() as s:
        await s.hold(0, [sha(A), sha(B)], 4)
        first = await round_()
        assert await round_() == first


# ---- KV events ----------------------------------------------------------------------------------


async def test_a_publisher_claiming_blocks_never_orphans_an_item():
    # Whatever the view believes (here: all of [A, B, C]'s prompt held), a skipped item reaches
    # P with its media and uuid; only items sent to E become embeds references.
    async with index_proxy() as s:
        await s.hold(0, [sha(A), sha(B), sha(C)], 5)
        assert (await s.post(chat(TEXT, img(A), img(B), img(C)))).status == 200
        assert orphans(s) == []
        for part in pd_content(s)[1:]:
            assert part["type"] == "image_url" and "uuid" in part


# ---- compressed bodies and a client's own connector fields (issue: hostile clients) -----------


@pytest.mark.parametrize("encoding", ["gzip", "deflate", "br", "GZIP "])
async def test_a_compressed_body_is_refused_before_it_is_inflated(encoding):
    # aiohttp inflates gzip / deflate bodies and applies its size limit after: 64 KiB of gzip
    # became 64 MiB sent to E. The proxy refuses any Content-Encoding with a 415.
    payload = json.dumps(chat(img(A), {"type": "text", "text": "x" * (1 << 20)})).encode()
    squeezed = gzip.compress(payload) if "gzip" in encoding.lower() else zlib.compress(payload)
    headers = {"Content-Encoding": encoding, "Content-Type": "application/json"}
    async with epd() as s:
        r = await s.client.post("/v1/chat/completions", data=squeezed, headers=headers)
        assert r.status == 415
        assert "Content-Encoding" in (await r.json())["detail"]
        assert s.e[0].seen == [] and s.pd.seen == []
        assert s.sample("mmreuse_proxy_requests_total", policy="eager", outcome="client_error") == 1
        r = await s.client.post("/start_profile", data=gzip.compress(b"{}"), headers=headers)
        assert r.status == 415 and s.e[0].seen == []


async def test_an_uncompressed_body_is_served_whatever_it_says_it_is():
    async with epd() as s:
        for encoding in ("identity", ""):
            r = await s.client.post(
                "/v1/chat/completions",
                data=json.dumps(chat(img(A))).encode(),
                headers={"Content-Encoding": encoding, "Content-Type": "application/json"},
            )
            assert r.status == 200


CLIENT_HANDLES = {
    "ec_transfer_params": {
        "forged": {"peer_host": "10.9.9.9", "peer_port": 1, "item_indices": [0]}
    },
    "kv_transfer_params": {
        "do_remote_prefill": True,
        "remote_host": "10.9.9.9",
        "remote_block_ids": [7],
    },
}


@pytest.mark.parametrize("n_p", [0, 1], ids=["E+PD", "E+P+D"])
async def test_a_clients_connector_fields_never_reach_e_p_or_d(n_p):
    async with epd(n_p=n_p) as s:
        r = await s.post(chat(img(A), {"type": "text", "text": "hi"}, **CLIENT_HANDLES))
        assert r.status == 200
        for backend in (*s.e, *s.p, *s.d):
            for seen in backend.chats():
                body = json.dumps(seen.body)
                assert "10.9.9.9" not in body and "forged" not in body, (backend.role, body)
        final = s.d[0].chats()[-1].body
        assert set(final["ec_transfer_params"]) == {sha(A), "ec_items"}  # E's handle only
        if n_p:  # D gets P's kv_transfer_params, P the proxy's (remote decode)
            assert s.p[0].chats()[-1].body["kv_transfer_params"]["do_remote_decode"] is True
            assert final["kv_transfer_params"] == {
                "remote_engine_id": "p-engine",
                "remote_block_ids": [1],
            }
        else:
            assert "kv_transfer_params" not in final
        for field in CLIENT_HANDLES:
            assert s.sample("mmreuse_proxy_client_fields_stripped_total", field=field) == 1


async def test_the_served_proxy_never_inflates_a_body(fakes):
    # In production (server.serve's own AppRunner) the parser must not inflate at all: a gzip bomb
    # is refused unread, and 'br' (no Brotli here) is a 415 too, not the parser's 400.
    e, pd = await fakes("e"), await fakes("pd")
    bomb = gzip.compress(b'{"messages": [' + b" " * (64 << 20) + b"]}")  # 64 MiB -> ~64 KiB
    async with (
        served_proxy("--encode-servers-urls", e.url, "--decode-servers-urls", pd.url) as base,
        aiohttp.ClientSession(auto_decompress=False) as client,
    ):
        for encoding, data in (("gzip", bomb), ("br", b"\x0b\x02\x80{}\x03")):
            headers = {"Content-Encoding": encoding, "Content-Type": "application/json"}
            async with client.post(f"{base}/v1/chat/completions", data=data, headers=headers) as r:
                assert r.status == 415, (encoding, r.status, await r.text())
    assert e.seen == [] and pd.seen == []


def _record_sizes(proxy) -> tuple[int, int]:
    """The longest identifier and the longest salt the proxy's E-side records hold."""
    caches = proxy.availability._caches
    idents = [len(i) for cache in caches.values() for i in cache]
    salts = [len(t.cache_salt or "") for _, _, t in caches]
    return max(idents, default=0), max(salts, default=0)


async def test_oversized_identifiers_are_served_but_never_recorded(caplog):
    # 40 requests with 4 MiB uuids left +194 MiB in the proxy's E-side records: what the proxy
    # records is bounded as the demand wire is (1,024 characters); beyond, no plan, as eager.
    # (A cache_salt over vLLM's 128 characters is refused: test_body_limits.py.)
    reason = "item 1's uuid has 5000 characters"
    async with index_proxy() as s:
        r = await s.post(chat(TEXT, img(A), img(B, uuid="u" * 5000)))
        assert r.status == 200
        assert len(e_sent(s)) == 2  # everything to E, as the reference does
        assert s.sample("mmreuse_proxy_fallbacks_total", instance="PD0", kind="no_plan") == 1
        assert [x.path for x in s.pd[0].seen] == ["/v1/chat/completions"]  # not even rendered
        assert any(reason in m for m in caplog.messages)
        r = await s.post(chat(TEXT, img(A), img(C)))  # an honest one is planned and recorded
        assert r.status == 200
        assert _record_sizes(s.proxy)[0] == len(sha(C)) and _record_sizes(s.proxy)[1] == 0


@pytest.mark.parametrize(
    "body", [b"[" * 100_000 + b"]" * 100_000, b'{"a":' * 100_000 + b"1" + b"}" * 100_000]
)
async def test_json_nested_past_the_decoders_depth_is_a_400(body):
    async with epd() as s:
        r = await s.client.post(
            "/v1/chat/completions", data=body, headers={"Content-Type": "application/json"}
        )
        assert r.status == 400
        assert "nested too deeply" in (await r.json())["detail"]
        assert s.sample("mmreuse_proxy_errors_total", stage="proxy") == 1  # counted, not a crash


# ---- --uuid-policy tenant: identifiers a tenant cannot forge ------------------------------------


def _uuids_at(backend) -> list[str]:
    return [
        p["uuid"] for x in backend.chats() for p in x.body["messages"][0]["content"] if "uuid" in p
    ]


async def test_under_tenant_one_tenant_cannot_name_anothers_embedding():
    # Tenant B sends its own image under the uuid tenant A's image has: under the reference's
    # rule both reach E and P as "a-photo" (P's encoder cache and the EC store are keyed by
    # it, across salts); under tenant each is its salt's.
    forged = img("http://img/b-other.png", uuid="a-photo")
    async with epd(flags=("--uuid-policy", "reference")) as s:
        await s.post(chat(img(A, uuid="a-photo"), cache_salt="tenant-a"))
        await s.post(chat(forged, cache_salt="tenant-b"))
        assert _uuids_at(s.e[0]) == ["a-photo", "a-photo"]  # the collision
    async with epd(flags=("--uuid-policy", "tenant")) as s:
        await s.post(chat(img(A, uuid="a-photo"), cache_salt="tenant-a"))
        await s.post(chat(forged, cache_salt="tenant-b"))
        await s.post(chat(img(A, uuid="a-photo"), cache_salt="tenant-a"))  # A again
        at_e = _uuids_at(s.e[0])
        assert at_e[0] != at_e[1] and at_e[0] == at_e[2]  # B's is its own; A's reuse is kept
        assert "a-photo" not in at_e and all(len(u) == 64 for u in at_e)
        at_p = [p["uuid"] for x in s.pd.chats() for p in x.body["messages"][0]["content"]]
        assert at_p == at_e  # P keys each as E did


async def test_under_tenant_the_same_url_is_two_items_for_two_salts_one_for_none():
    async with epd(flags=("--uuid-policy", "tenant")) as s:
        for salt in ("s1", "s2", None, None):
            await s.post(chat(img(A), **({} if salt is None else {"cache_salt": salt})))
        u1, u2, n1, n2 = _uuids_at(s.e[0])
        assert len({u1, u2, n1}) == 3 and n1 == n2 and sha(A) not in (u1, u2, n1)


async def test_under_tenant_a_clients_embeds_uuid_is_namespaced():
    # A client's own *_embeds part is a vLLM input and is forwarded, but the uuid it carries
    # would cache its embedding under a name other tenants share: it is namespaced too.
    part = {"type": "image_embeds", "image_embeds": "AAAA", "uuid": "shared-name"}
    async with epd(flags=("--uuid-policy", "tenant")) as s:
        assert (
            await s.post(chat(part, {"type": "text", "text": "x"}, cache_salt="t"))
        ).status == 200
        [sent] = [
            p
            for p in s.pd.chats()[-1].body["messages"][0]["content"]
            if p["type"] == "image_embeds"
        ]
        assert sent["uuid"] != "shared-name" and len(sent["uuid"]) == 64
        assert sent["image_embeds"] == "AAAA"  # the input itself is forwarded as is


@pytest.mark.parametrize("policy", ["reference", "tenant", "content"])
async def test_a_clients_metadata_only_embeds_part_is_refused(policy):
    # A *_embeds part of metadata only is the proxy's reference to E's output: P takes the
    # embedding from its EC connector, and where there is none vLLM's engine dies (seen on the
    # real cluster: tests/live_proxy/test_tenant_collisions_live.py). Refused before any backend.
    forged = {"type": "image_embeds", "image_embeds": {"image_grid_thw": [1, 2, 2]}, "uuid": "u"}
    async with epd(flags=("--uuid-policy", policy)) as s:
        r = await s.post(chat(TEXT, forged))
        assert r.status == 400
        assert "messages[0].content[1]: an embeds part must carry" in (await r.json())["detail"]
        assert s.e[0].chats() == [] and s.pd.chats() == []


@pytest.mark.parametrize(
    "payload", ["AAAA", {"image_embeds": "AAAA", "image_grid_thw": "AAAA"}, None]
)
async def test_embeds_parts_that_carry_their_tensor_are_forwarded(payload):
    part = {"type": "image_embeds", "image_embeds": payload, "uuid": "u"}
    async with epd() as s:
        assert (await s.post(chat(TEXT, part))).status == 200
        assert s.pd.chats()[-1].body["messages"][0]["content"][1] == part


def test_uuid_policy_is_refused_with_no_rewrite(capsys):
    from mmreuse.proxy.config import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--encode-servers-urls", "http://e:1", "--decode-servers-urls", "http://d:2",
                    "--uuid-policy", "tenant", "--no-rewrite"], env={})  # fmt: skip
    assert "--no-rewrite with --uuid-policy tenant" in capsys.readouterr().err


async def test_under_tenant_the_index_plans_on_the_tenants_own_names():
    from mmreuse.proxy.media import tenant_uuid

    async with index_proxy(flags=("--uuid-policy", "tenant")) as s:
        a1, b1 = tenant_uuid(img(A), "t1"), tenant_uuid(img(B), "t1")
        await s.hold(0, [a1, b1], 4, cache_salt="t1")  # P holds tenant t1's prompt
        assert (await s.post(chat(TEXT, img(A), img(B), cache_salt="t1"))).status == 200
        assert e_sent(s) == [b1]  # t1's A is KV-covered: reuse within a tenant is kept
        assert (await s.post(chat(TEXT, img(A), img(B), cache_salt="t2"))).status == 200
        assert e_sent(s)[1:] == [tenant_uuid(img(A), "t2"), tenant_uuid(img(B), "t2")]


# ---- /metrics and the detailed /health on their own port --------------------------------------


async def test_with_a_metrics_port_the_cache_facts_leave_the_serving_port():
    from mmreuse.proxy.server import PROXY_KEY, build_metrics_app

    async with epd(flags=("--metrics-port", "9")) as s:
        assert (await s.client.get("/metrics")).status == 404
        r = await s.client.get("/health")
        assert r.status == 200 and "mmreuse" not in await r.json()  # the reference's fields only
        assert set(await r.json()) == {
            "proxy",
            "encode_cluster",
            "prefill_cluster",
            "decode_cluster",
        }
        assert (await s.post(chat(img(A)))).status == 200
        async with proxy_client(build_metrics_app(s.app[PROXY_KEY])) as metrics:
            text = await (await metrics.get("/metrics")).text()
            assert 'mmreuse_proxy_requests_total{outcome="ok",policy="eager"} 1.0' in text
            assert "mmreuse" in await (await metrics.get("/health")).json()


async def test_the_served_proxy_binds_its_metrics_port():
    e_port, m_port = free_ports(2)
    code = "import sys; from mmreuse.cli import main; sys.exit(main())"
    proc = subprocess.Popen(
        [sys.executable, "-c", code, "proxy", "--host", "127.0.0.1", "--port", str(e_port),
         "--metrics-port", str(m_port), "--encode-servers-urls", "http://127.0.0.1:1",
         "--decode-servers-urls", "http://127.0.0.1:2"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    try:
        async with aiohttp.ClientSession() as session:
            await until_up(session, f"http://127.0.0.1:{m_port}/metrics", proc)
            async with session.get(f"http://127.0.0.1:{e_port}/metrics") as r:
                assert r.status == 404
            async with session.get(f"http://127.0.0.1:{m_port}/health") as r:
                assert "mmreuse" in await r.json()
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=10)


async def until_up(session, url, proc):
    async def up() -> bool:
        assert proc.poll() is None, "the proxy exited"
        with contextlib.suppress(aiohttp.ClientError):
            async with session.get(url) as r:
                return r.status == 200
        return False

    assert await async_wait_until(up, 20.0), "the proxy never came up"  # a hang guard


# ---- parts vLLM reads as media by their keys ----------------------------------------------------

META_ONLY = {"image_grid_thw": [1, 2, 2]}  # an embeds payload of metadata only: E's reference

DATA_A = "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR4nGNgYGD4DwABBAEAwS2OUAAAAABJRU5ErkJggg=="
DATA_B = "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR4nGP4z8DwHwAFAAH/iZk9HQAAAABJRU5ErkJggg=="
# Each is media to vLLM (its parser probes the keys of a part with a uuid or without a type),
# whatever its `type` says: the proxy used to pass them to P unseen.
DISGUISED = {
    "embeds_typed_text": {"type": "text", "text": "hi", "image_embeds": META_ONLY, "uuid": "v"},
    "embeds_untyped": {"image_embeds": META_ONLY, "uuid": "victim"},
    "embeds_typed_input_text": {"type": "input_text", "text": "hi", "image_embeds": META_ONLY,
                                "uuid": "victim"},
    "image_typed_text": {"type": "text", "text": "hi", "image_url": {"url": A}, "uuid": "cat-1"},
    "image_untyped": {"image_url": {"url": A}, "uuid": "cat-1"},
    "uuid_only_typed_text": {"type": "text", "image_url": None, "uuid": "cat-1"},
    "video_typed_image": {"type": "image_url", "video_url": {"url": A}, "uuid": "cat-1"},
    "image_pil_by_uuid": {"type": "image_pil", "image_pil": None, "uuid": "cat-1"},
}  # fmt: skip


@pytest.mark.parametrize("policy", ["reference", "tenant", "content"])
@pytest.mark.parametrize("name", sorted(DISGUISED))
async def test_a_part_vllm_reads_as_media_is_named_or_refused(policy, name):
    async with epd(flags=("--uuid-policy", policy)) as s:
        r = await s.post(chat(TEXT, DISGUISED[name], cache_salt="t"))
        assert r.status == 400, await r.text()
        assert (await r.json())["detail"].startswith("messages[0].content[1]: ")
        assert s.e[0].chats() == [] and s.pd.chats() == []


@pytest.mark.parametrize("policy", ["tenant", "content"])
async def test_an_input_image_part_is_named_as_the_image_it_is(policy):
    # vLLM parses the Responses API's image part as an image: it goes to E and P as one, named
    # by the uuid policy, never under the client's raw uuid.
    part = {"type": "input_image", "image_url": DATA_A, "detail": "auto", "uuid": "cat-1"}
    async with epd(flags=("--uuid-policy", policy)) as s:
        assert (await s.post(chat(TEXT, part, cache_salt="t"))).status == 200
        [at_e] = _uuids_at(s.e[0])
        assert at_e != "cat-1" and len(at_e) == 64
        sent = s.pd.chats()[-1].body["messages"][0]["content"][1]
        assert sent["type"] in ("image_url", "image_embeds") and sent["uuid"] == at_e


async def test_under_content_a_name_cannot_be_planted_through_another_part_form():
    from mmreuse.proxy.content import content_name

    victim = content_name(None, "image", DATA_A)  # anyone can compute a public image's name
    planted = {"type": "input_image", "image_url": DATA_B, "uuid": victim}
    async with epd(flags=("--uuid-policy", "content")) as s:
        assert (await s.post(chat(TEXT, planted))).status == 200
        assert (await s.post(chat(TEXT, img(DATA_A)))).status == 200
        attacker, real = _uuids_at(s.e[0])
        assert attacker == content_name(None, "image", DATA_B) and real == victim


async def test_under_tenant_an_empty_embeds_uuid_is_namespaced():
    part = {"type": "image_embeds", "image_embeds": "AAAA", "uuid": ""}
    async with epd(flags=("--uuid-policy", "tenant")) as s:
        assert (await s.post(chat(TEXT, part, cache_salt="t"))).status == 200
        sent = s.pd.chats()[-1].body["messages"][0]["content"][1]
        assert sent["uuid"] != "" and len(sent["uuid"]) == 64


# ---- bounds on one request -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flags", "n", "limit"),
    [((), 1000, 999), (("--limit-mm-per-prompt", '{"image": 2}'), 3, 2),
     (("--limit-mm-per-prompt", '{"image": {"count": 1}}'), 2, 1)],
    ids=["vllm-default", "flag", "flag-object"],
)  # fmt: skip
async def test_media_items_per_request_are_bounded_before_any_work(flags, n, limit):
    # loopback literals: refused by the fetcher's address check before any DNS or connection
    items = [img(f"http://127.0.0.1:9/{i}.png") for i in range(n)]
    async with epd(flags=("--uuid-policy", "content", *flags)) as s:
        r = await s.post(chat(TEXT, *items))
        assert r.status == 400
        detail = (await r.json())["detail"]
        assert f"messages[0].content[{limit + 1}]: at most {limit} image item(s)" in detail
        assert s.e[0].chats() == [] and s.pd.chats() == []
        r = await s.post(chat(TEXT, *items[:limit], {"type": "input_audio", "input_audio": {
            "data": "AAAA", "format": "wav"}}))  # fmt: skip
        assert r.status != 400 or "at most" not in (await r.json())["detail"]


async def test_a_body_over_max_body_bytes_is_a_413():
    async with epd(flags=("--max-body-bytes", "4096")) as s:
        r = await s.post(chat(TEXT, img("data:image/png;base64," + "A" * 8192)))
        assert r.status == 413
        assert "--max-body-bytes" in (await r.json())["detail"]
        assert s.e[0].chats() == [] and s.pd.chats() == []


def test_bad_mm_limits_and_body_bounds_are_refused_naming_the_flag(capsys):
    from mmreuse.proxy.config import parse_args

    base = ["--encode-servers-urls", "http://e:1", "--decode-servers-urls", "http://d:2"]
    for flags in (["--limit-mm-per-prompt", "{"], ["--limit-mm-per-prompt", '{"image": -1}'],
                  ["--limit-mm-per-prompt", "[1]"], ["--max-body-bytes", "0"]):  # fmt: skip
        with pytest.raises(SystemExit):
            parse_args([*base, *flags], env={})
        assert flags[0] in capsys.readouterr().err


# ---- the proxy's own channel to P ----------------------------------------------------------------


@pytest.mark.parametrize("n_p", [0, 1], ids=["E+PD", "E+P+D"])
async def test_a_clients_demand_id_never_reaches_p(n_p):
    async with epd(n_p=n_p) as s:
        body = chat(img(A), vllm_xargs={"mmreuse_demand_id": "forged-id", "other": 1})
        assert (await s.post(body)).status == 200
        for backend in (*s.p, *s.d):
            for seen in backend.chats():
                assert seen.body["vllm_xargs"] == {"other": 1}
        field = "vllm_xargs.mmreuse_demand_id"
        assert s.sample("mmreuse_proxy_client_fields_stripped_total", field=field) == 1
