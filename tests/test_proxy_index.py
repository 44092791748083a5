"""`mmreuse proxy --policy index`: E gets only what the chosen PD still needs, decided from a
live KV view. Fake E / PD servers (tests/proxy_fakes.py; each PD renders requests as vLLM's
`/v1/chat/completions/render` would) and a real view: vLLM-shaped KV events (BlockStored with
token ids and untagged extra keys) from a local ZMQ publisher (tests/kv_publisher.py), hashed
with mmreuse's own BlockHasher, as P would publish them with PYTHONHASHSEED=0."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import pytest
import zmq
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from mmreuse.blockhash import to_event_id
from mmreuse.events import BlockStored, KVEventBatch
from mmreuse.hashing import BlockHasher, MMOccurrence
from mmreuse.proxy.app import PROXY_KEY, build_app
from mmreuse.proxy.config import parse_args

from .kv_publisher import TestPublisher
from .proxy_fakes import Fake, ProxyHandle, arun, chat, img, sha

BLOCK = 16
TEXT_TOKENS = list(range(1, 41))  # the rendered prompt: 40 text tokens, then each image
IMAGE_TOKEN = 268  # 16 placeholder tokens per image
IMAGE_LEN = 16
WAIT_S = 15.0  # a bound on waiting for the view (a hang guard, not a timing check)


A, B, C = "http://img/a.png", "http://img/b.png", "http://img/c.png"
TEXT = {"type": "text", "text": "what changed between these?"}


# ---- what P renders, hashes and publishes -------------------------------------------------------


def prompt(uuids: Sequence[str]) -> tuple[list[int], list[MMOccurrence]]:
    """The token ids and image occurrences the fake render gives for images `uuids`."""
    tokens = TEXT_TOKENS + [IMAGE_TOKEN] * (IMAGE_LEN * len(uuids))
    occs = [
        MMOccurrence(u, len(TEXT_TOKENS) + IMAGE_LEN * k, IMAGE_LEN, modality="image")
        for k, u in enumerate(uuids)
    ]
    return tokens, occs


def render(body: dict[str, Any]) -> dict[str, Any]:
    """vLLM's render answer (`"mm_payload": "none"`): token ids and, per modality, the
    identifiers (the uuids the request carries) and placeholder ranges."""
    uuids = [
        part["uuid"]  # KeyError (a 500) if the proxy did not name each item
        for msg in body["messages"]
        if isinstance(msg.get("content"), list)
        for part in msg["content"]
        if part.get("type") == "image_url"
    ]
    tokens, occs = prompt(uuids)
    features = {
        "mm_hashes": {"image": [o.identifier for o in occs]},
        "mm_placeholders": {"image": [{"offset": o.offset, "length": o.length} for o in occs]},
    }
    out = {"request_id": "render-1", "token_ids": tokens, "features": features if occs else None}
    if body.get("cache_salt") is not None:
        out["cache_salt"] = body["cache_salt"]
    return out


def stored(
    uuids: Sequence[str], blocks: int, *, seed: str = "0", cache_salt: str | None = None
) -> BlockStored:
    """P's BlockStored event for the first `blocks` blocks of the prompt of `uuids`: event ids,
    token ids and the extra keys as vLLM 0.33 publishes them (untagged)."""
    tokens, occs = prompt(uuids)
    hasher = BlockHasher("sha256", BLOCK, seed=seed)
    hashes = hasher.hash_prompt(tokens, mm=occs, cache_salt=cache_salt)[:blocks]
    keys = hasher.block_extra_keys(tokens, mm=occs, cache_salt=cache_salt)[:blocks]
    assert len(hashes) == blocks
    return BlockStored(
        block_hashes=[to_event_id(h) for h in hashes],
        parent_block_hash=None,
        token_ids=tokens[: blocks * BLOCK],
        block_size=BLOCK,
        lora_id=None,
        medium="GPU",
        lora_name=None,
        extra_keys=[
            None if k is None else tuple((x[1], x[2]) if x[0] == "mm" else x[1] for x in k)
            for k in keys
        ],
    )


# ---- the proxy ----------------------------------------------------------------------------------


@dataclass
class Setup(ProxyHandle):
    client: TestClient
    app: web.Application
    e: Fake
    pd: list[Fake]
    pubs: list[TestPublisher]
    d: list[Fake]

    async def publish(self, i: int, events: list[Any], until: Callable[[], bool]) -> None:
        """Publish `events` on PD i's publisher and wait until `until()` holds. Empty batches
        follow until then: a subscriber that joined late sees a gap and replays from seq 0."""
        self.pubs[i].publish(KVEventBatch(ts=time.time(), events=events, data_parallel_rank=0))
        end = time.monotonic() + WAIT_S
        while not until():
            assert time.monotonic() < end, "the proxy's view never applied the events"
            self.pubs[i].publish(KVEventBatch(ts=time.time(), events=[], data_parallel_rank=0))
            await asyncio.sleep(0.01)

    async def hold(self, i: int, uuids: Sequence[str], blocks: int, **kw: Any) -> None:
        """PD i's prefix cache holds the first `blocks` blocks of the prompt of `uuids`."""
        view = self.proxy.views[i]
        want = view.index.size() + blocks

        def applied() -> bool:
            check = view.check
            return view.index.size() == want and check is not None and check.status.verified > 0

        await self.publish(i, [stored(uuids, blocks, **kw)], applied)
        assert view.usable


@asynccontextmanager
async def index_proxy(
    n_pd: int = 1,
    *,
    flags: tuple[str, ...] = (),
    renders: bool = True,
    events: bool = True,
    seed: int | None = None,
    prefill: bool = False,
    block_size: int | None = BLOCK,
) -> AsyncIterator[Setup]:
    """E + PD (or E + P + D with `prefill`: then `pd` are the P fakes, `d` the decode one)."""
    ctx = zmq.Context()
    pubs = [TestPublisher(ctx) for _ in range(n_pd)] if events else []
    e = await Fake("e").start()
    role = "p" if prefill else "pd"
    pds = [await Fake(role, render=render if renders else None).start() for _ in range(n_pd)]
    d = [await Fake("d").start()] if prefill else []
    argv = [
        "--encode-servers-urls", e.url,
        "--decode-servers-urls", ",".join(f.url for f in (d or pds)),
        "--policy", "index",
        "--hash-seed", "0",
        *(["--block-size", str(block_size)] if block_size is not None else []),
        *flags,
    ]  # fmt: skip
    if prefill:
        argv += ["--prefill-servers-urls", ",".join(f.url for f in pds)]
    if events:
        argv += [
            "--kv-events-endpoints", ",".join(p.endpoint for p in pubs),
            "--kv-events-replay-endpoints", ",".join(p.replay_endpoint for p in pubs),
        ]  # fmt: skip
    config = parse_args(argv, env={})
    if seed is not None:
        config = dataclasses.replace(config, seed=seed)
    app = build_app(config)
    try:
        async with TestClient(TestServer(app)) as client:
            yield Setup(client, app, e, pds, pubs, d)
    finally:
        for fake in (e, *pds, *d):
            await fake.close()
        for pub in pubs:
            pub.close()
        ctx.term()


def e_sent(s: Setup) -> list[str]:
    """The uuids E was sent, over every sub-request, in order."""
    return [p["uuid"] for x in s.e.chats() for p in x.body["messages"][0]["content"]]


def pd_content(s: Setup, i: int = 0, k: int = -1) -> list[dict[str, Any]]:
    return s.pd[i].chats()[k].body["messages"][0]["content"]


def embeds(url: str) -> dict[str, Any]:
    """What the fake E's metadata makes of an image: a metadata-only reference."""
    return {"type": "image_embeds", "image_embeds": {"image_grid_thw": [1, 2, 2]}, "uuid": sha(url)}


# ---- tests --------------------------------------------------------------------------------------


@arun
async def test_covered_image_is_not_sent_to_e():
    # PD holds the first 4 blocks of [A, B] (tokens 0-63): A at [40, 56) is covered, B at
    # [56, 72) is not. E gets only B; A reaches PD raw with its uuid (PD keys it as E would).
    async with index_proxy() as s:
        await s.hold(0, [sha(A), sha(B)], 4)
        r = await s.post(chat(TEXT, img(A), img(B)))
        assert r.status == 200
        assert e_sent(s) == [sha(B)]
        content = pd_content(s)
        assert content[0] == TEXT
        assert content[1] == {**img(A), "uuid": sha(A)}
        # B was encoded, but vLLM refuses raw and embeds images in one request: B goes raw
        # with its uuid too, and PD gets E's embedding by that uuid (the EC connector).
        assert content[2] == {**img(B), "uuid": sha(B)}
        params = s.pd[0].chats()[0].body["ec_transfer_params"]
        assert [x["mm_hash"] for x in params["ec_items"]] == [sha(B)]
        assert sha(B) in params and sha(A) not in params
        assert s.sample("mmreuse_proxy_occurrences_total", klass="kv_covered") == 1
        assert s.sample("mmreuse_proxy_occurrences_total", klass="e_compute") == 1
        assert s.sample("mmreuse_proxy_encoder_items_total", action="sent") == 1
        assert s.sample("mmreuse_proxy_encoder_items_total", action="skipped") == 1
        assert s.sample("mmreuse_proxy_fallbacks_total", instance="PD0", kind="no_plan") == 0

        # Again: A still covered; B is now held by E (sent there once): e_cached, still sent.
        assert (await s.post(chat(TEXT, img(A), img(B)))).status == 200
        assert e_sent(s) == [sha(B), sha(B)]
        assert s.sample("mmreuse_proxy_occurrences_total", klass="kv_covered") == 2
        assert s.sample("mmreuse_proxy_occurrences_total", klass="e_cached") == 1
        assert s.sample("mmreuse_proxy_encoder_items_total", action="sent") == 2
        assert s.sample("mmreuse_proxy_encoder_items_total", action="skipped") == 2


@arun
async def test_uncovered_images_are_sent_and_rewritten():
    # Nothing of [A, C] is held (PD holds [B]'s prefix only): both to E, both rewritten.
    async with index_proxy() as s:
        await s.hold(0, [sha(B)], 3)
        assert (await s.post(chat(TEXT, img(A), img(C)))).status == 200
        assert e_sent(s) == [sha(A), sha(C)]
        assert len(s.e.chats()) == 1  # one encoder: the images share one sub-request
        assert pd_content(s) == [TEXT, embeds(A), embeds(C)]
        assert s.sample("mmreuse_proxy_occurrences_total", klass="e_compute") == 2
        assert s.sample("mmreuse_proxy_encoder_items_total", action="sent") == 2
        assert s.sample("mmreuse_proxy_encoder_items_total", action="skipped") == 0


@arun
async def test_a_duplicate_identifier_is_sent_once():
    # [C, C]: one identifier, one E item; both occurrences reference its embedding.
    async with index_proxy() as s:
        assert (await s.post(chat(TEXT, img(C), img(C)))).status == 200
        assert e_sent(s) == [sha(C)]
        assert pd_content(s) == [TEXT, embeds(C), embeds(C)]
        items = s.pd[0].chats()[0].body["ec_transfer_params"]["ec_items"]
        assert [x["mm_hash"] for x in items] == [sha(C)]  # one transfer
        assert s.sample("mmreuse_proxy_occurrences_total", klass="e_compute") == 1
        assert s.sample("mmreuse_proxy_occurrences_total", klass="duplicate") == 1
        assert s.sample("mmreuse_proxy_encoder_items_total", action="sent") == 1
        assert s.sample("mmreuse_proxy_encoder_items_total", action="skipped") == 1


@arun
async def test_render_failure_sends_everything_to_e():
    # Render answers 403 (PD started without --enable-scale-out): no plan, E gets every item,
    # the request still succeeds, as under eager.
    async with index_proxy(renders=False) as s:
        await s.hold(0, [sha(A), sha(B)], 4)  # a view that would have covered A
        r = await s.post(chat(TEXT, img(A), img(B)))
        assert r.status == 200
        assert e_sent(s) == [sha(A), sha(B)]
        assert pd_content(s) == [TEXT, embeds(A), embeds(B)]
        assert [x.path for x in s.pd[0].seen][:1] == ["/v1/chat/completions/render"]
        assert s.sample("mmreuse_proxy_fallbacks_total", instance="PD0", kind="no_plan") == 1
        assert s.sample("mmreuse_proxy_errors_total", stage="render") == 1
        assert s.sample("mmreuse_proxy_occurrences_total", klass="unclassified") == 2
        assert s.sample("mmreuse_proxy_requests_total", policy="index", outcome="ok") == 1
        text = await (await s.client.get("/metrics")).text()
        assert 'mmreuse_proxy_fallbacks_total{instance="PD0",kind="no_plan"} 1.0' in text


@arun
async def test_render_request_carries_the_proxys_uuids():
    # The render body: the request with every item's uuid (the client's kept, else sha256 of
    # its URL), "mm_payload": "none", and no stream / stream_options.
    body = chat(
        TEXT,
        img(A, uuid="client-a"),
        img(B),
        stream=True,
        stream_options={"include_usage": True},
        max_tokens=9,
    )
    async with index_proxy() as s:
        r = await s.post(body)
        assert r.status == 200
        await r.read()
        [req] = [x for x in s.pd[0].seen if x.path == "/v1/chat/completions/render"]
        sent = req.body
        assert sent["mm_payload"] == "none"
        assert "stream" not in sent and "stream_options" not in sent
        assert sent["messages"][0]["content"] == [
            TEXT,
            img(A, uuid="client-a"),
            img(B, uuid=sha(B)),
        ]
        assert (sent["model"], sent["max_tokens"]) == ("tiny", 9)
        assert e_sent(s) == ["client-a", sha(B)]
        assert s.pd[0].chats()[0].body["stream"] is True  # decode still streams


@arun
async def test_hash_configuration_mismatch_disables_the_view():
    # P publishes hashes the proxy cannot reproduce (another PYTHONHASHSEED): /health names
    # the mismatch, the gauge counts it, and the view is not used, even for blocks it holds.
    async with index_proxy() as s:
        view = s.proxy.views[0]
        events = [stored([sha(C)], 3, seed="1"), stored([sha(A), sha(B)], 4)]
        await s.publish(
            0,
            events,
            lambda: (
                view.index.size() == 7
                and view.check is not None
                and view.check.status.mismatches > 0
            ),
        )
        assert not view.usable
        r = await s.client.get("/health")
        assert r.status == 200  # the clusters are healthy; the view is degraded
        health = (await r.json())["mmreuse"]
        assert health["status"] == "degraded"
        assert any(p.startswith("PD0: hash configuration mismatch") for p in health["problems"])
        assert health["views"]["PD0"]["usable"] is False
        assert health["views"]["PD0"]["hash_check"]["mismatches"] > 0
        assert s.sample("mmreuse_proxy_hash_config_mismatches", instance="PD0") > 0
        assert (await s.post(chat(TEXT, img(A), img(B)))).status == 200
        assert e_sent(s) == [sha(A), sha(B)]  # A would be covered by the view's blocks
        assert pd_content(s) == [TEXT, embeds(A), embeds(B)]


@arun
async def test_a_matching_configuration_verifies():
    async with index_proxy() as s:
        await s.hold(0, [sha(A), sha(B)], 4)
        health = (await (await s.client.get("/health")).json())["mmreuse"]
        assert (health["status"], health["problems"]) == ("ok", [])
        view = health["views"]["PD0"]
        assert (view["usable"], view["blocks"], view["block_size"]) == (True, 4, BLOCK)
        assert view["hash_check"]["verified"] == 4 and view["hash_check"]["mismatches"] == 0
        assert s.sample("mmreuse_proxy_hash_blocks_verified", instance="PD0") == 4
        assert s.sample("mmreuse_proxy_hash_config_mismatches", instance="PD0") == 0


@arun
async def test_affine_routing_picks_the_pd_holding_the_prefix():
    # Two PDs; only PD1's view holds [A, B]'s prefix. Every request goes to PD1, although the
    # routing RNG (which picks where to render) lands on PD0 for some of them.
    async with index_proxy(2, flags=("--routing", "affine"), seed=3) as s:
        await s.hold(1, [sha(A), sha(B)], 4)
        for _ in range(6):
            assert (await s.post(chat(TEXT, img(A), img(B)))).status == 200
        assert len(s.pd[1].chats()) == 6 and s.pd[0].chats() == []
        renders = [f for f in s.pd for x in f.seen if x.path.endswith("/render")]
        assert s.pd[0] in renders and len(renders) == 6
        assert e_sent(s) == [sha(B)] * 6  # A is covered at PD1
        assert s.sample("mmreuse_proxy_occurrences_total", klass="kv_covered") == 6


@arun
async def test_random_routing_ignores_the_views():
    # The control for the test above: with the same RNG seed and --routing random, PD0 serves
    # some of the requests (and E then gets A too, PD0 holding nothing).
    async with index_proxy(2, seed=3) as s:
        await s.hold(1, [sha(A), sha(B)], 4)
        for _ in range(6):
            assert (await s.post(chat(TEXT, img(A), img(B)))).status == 200
        assert s.pd[0].chats() and s.pd[1].chats()
        assert e_sent(s).count(sha(A)) == len(s.pd[0].chats())


@arun
async def test_decode_500_retry_re_encodes_everything():
    # A decode 500 re-runs the request as under eager: E gets every item, each rewritten.
    async with index_proxy() as s:
        await s.hold(0, [sha(A), sha(B)], 4)
        s.pd[0].fail["/v1/chat/completions"] = [500]
        assert (await s.post(chat(TEXT, img(A), img(B)))).status == 200
        assert e_sent(s) == [sha(B), sha(A), sha(B)]
        assert pd_content(s, k=0)[1] == {**img(A), "uuid": sha(A)}
        assert pd_content(s, k=1) == [TEXT, embeds(A), embeds(B)]
        assert s.sample("mmreuse_proxy_fallbacks_total", instance="PD0", kind="retry") == 1


@pytest.mark.parametrize("cached, short", [(0, 1), (64, 0)])
@arun
async def test_kv_short_fallback_from_the_usage(cached, short):
    # PD reports fewer cached prompt tokens than the plan counted on (64): a skipped item was
    # served by PD's own cache, connector or encoder.
    async with index_proxy() as s:
        await s.hold(0, [sha(A), sha(B)], 4)
        s.pd[0].usage = {"prompt_tokens": 72, "prompt_tokens_details": {"cached_tokens": cached}}
        assert (await s.post(chat(TEXT, img(A), img(B)))).status == 200
        assert s.sample("mmreuse_proxy_fallbacks_total", instance="PD0", kind="kv_short") == short


@arun
async def test_index_without_kv_events_sends_everything():
    # No view at all: every item is uncovered (E gets it), and /health says why.
    async with index_proxy(events=False) as s:
        assert (await s.post(chat(TEXT, img(A), img(B)))).status == 200
        assert e_sent(s) == [sha(A), sha(B)]
        assert s.sample("mmreuse_proxy_occurrences_total", klass="e_compute") == 2
        health = (await (await s.client.get("/health")).json())["mmreuse"]
        assert health["status"] == "degraded"
        assert health["problems"] == ["PD0: no KV events endpoint"]


@arun
async def test_text_only_request_under_index():
    async with index_proxy() as s:
        body = chat(TEXT, max_tokens=3)
        assert (await s.post(body)).status == 200
        assert s.e.chats() == []
        assert s.pd[0].chats()[0].body == body


@arun
async def test_e_p_d_under_index():
    # E + P + D: the view is P's; render goes to P; P gets the covered item raw with its uuid,
    # D gets P's kv_transfer_params.
    async with index_proxy(prefill=True) as s:
        await s.hold(0, [sha(A), sha(B)], 4)
        assert s.proxy.views[0].name == "P0"
        assert (await s.post(chat(TEXT, img(A), img(B)))).status == 200
        assert e_sent(s) == [sha(B)]
        assert [x.path for x in s.pd[0].seen] == [
            "/v1/chat/completions/render",
            "/v1/chat/completions",
        ]
        p_body = s.pd[0].chats()[0].body
        assert p_body["messages"][0]["content"][1] == {**img(A), "uuid": sha(A)}
        assert p_body["max_tokens"] == 1
        [d] = s.d[0].chats()
        assert d.body["kv_transfer_params"]["remote_engine_id"] == "p-engine"
        assert [x.path for x in s.d[0].seen] == ["/v1/chat/completions"]  # no render at D
        assert s.sample("mmreuse_proxy_occurrences_total", klass="kv_covered") == 1


@arun
async def test_cache_salt_is_part_of_the_key():
    # P's blocks were made under cache_salt "tenant-a": only a request with that salt hits.
    async with index_proxy() as s:
        await s.hold(0, [sha(A), sha(B)], 4, cache_salt="tenant-a")
        assert (await s.post(chat(TEXT, img(A), img(B)))).status == 200
        assert e_sent(s) == [sha(A), sha(B)]
        assert (await s.post(chat(TEXT, img(A), img(B), cache_salt="tenant-b"))).status == 200
        assert e_sent(s)[2:] == [sha(A), sha(B)]
        assert (await s.post(chat(TEXT, img(A), img(B), cache_salt="tenant-a"))).status == 200
        assert e_sent(s)[4:] == [sha(B)]
        assert s.pd[0].chats()[-1].body["cache_salt"] == "tenant-a"


@pytest.mark.parametrize(
    "answer",
    [
        lambda body: [1, 2],
        lambda body: None,
        lambda body: {"token_ids": "abc"},
        lambda body: {"token_ids": [1] * 50, "features": None},  # fewer images than sent
        lambda body: {
            "token_ids": [1] * 50,
            "features": {
                "mm_hashes": {"image": ["x", "y"]},
                "mm_placeholders": {"image": [{"offset": 40, "length": 16}] * 2},  # past the end
            },
        },
    ],
)
@arun
async def test_a_garbled_render_costs_the_plan_not_the_request(answer):
    async with index_proxy() as s:
        s.pd[0].render = answer
        assert (await s.post(chat(TEXT, img(A), img(B)))).status == 200
        assert e_sent(s) == [sha(A), sha(B)]
        assert s.sample("mmreuse_proxy_fallbacks_total", instance="PD0", kind="no_plan") == 1


@arun
async def test_render_url_is_used_and_its_failure_costs_the_plan():
    renderer = await Fake("pd", render=render).start()
    try:
        async with index_proxy(renders=False, flags=("--render-url", renderer.url)) as s:
            await s.hold(0, [sha(A), sha(B)], 4)
            assert (await s.post(chat(TEXT, img(A), img(B)))).status == 200
            assert e_sent(s) == [sha(B)]
            assert [x.path for x in renderer.seen] == ["/v1/chat/completions/render"]
            assert [x.path for x in s.pd[0].seen] == ["/v1/chat/completions"]
            await renderer.close()  # unreachable now
            assert (await s.post(chat(TEXT, img(A), img(B)))).status == 200
            assert e_sent(s)[1:] == [sha(A), sha(B)]
            assert s.sample("mmreuse_proxy_fallbacks_total", instance="PD0", kind="no_plan") == 1
    finally:
        await renderer.close()


@arun
async def test_a_covered_occurrence_shares_the_embedding_sent_for_a_later_one():
    # [A, B, A] with [A, B]'s first 4 blocks held: A#0 is covered, A#2 ([72, 88)) is not and
    # needs E. A is sent once (for A#2); A#0 references that embedding; one transfer per item
    # sent.
    async with index_proxy() as s:
        await s.hold(0, [sha(A), sha(B)], 4)
        assert (await s.post(chat(TEXT, img(A), img(B), img(A)))).status == 200
        assert e_sent(s) == [sha(B), sha(A)]
        assert pd_content(s) == [TEXT, embeds(A), embeds(B), embeds(A)]
        items = s.pd[0].chats()[0].body["ec_transfer_params"]["ec_items"]
        assert [x["mm_hash"] for x in items] == [sha(B), sha(A)]
        assert s.sample("mmreuse_proxy_occurrences_total", klass="kv_covered") == 1
        assert s.sample("mmreuse_proxy_occurrences_total", klass="e_compute") == 2


@arun
async def test_affine_routing_under_eager():
    # --routing affine without --policy index: routed by the views, every item still to E.
    async with index_proxy(2, flags=("--routing", "affine", "--policy", "eager"), seed=3) as s:
        await s.hold(1, [sha(A), sha(B)], 4)
        for _ in range(4):
            assert (await s.post(chat(TEXT, img(A), img(B)))).status == 200
        assert len(s.pd[1].chats()) == 4 and s.pd[0].chats() == []
        assert e_sent(s) == [sha(A), sha(B)] * 4
        assert s.sample("mmreuse_proxy_occurrences_total", klass="unclassified") == 8


@arun
async def test_block_size_learned_from_the_events():
    # Without --block-size the view takes P's from its first BlockStored event.
    async with index_proxy(block_size=None) as s:
        view = s.proxy.views[0]
        assert view.hasher is None and not view.usable
        await s.hold(0, [sha(A), sha(B)], 4)
        assert view.hasher is not None and view.hasher.block_size == BLOCK
        assert (await s.post(chat(TEXT, img(A), img(B)))).status == 200
        assert e_sent(s) == [sha(B)]


@arun
async def test_a_block_size_mismatch_disables_the_view():
    async with index_proxy(block_size=2 * BLOCK) as s:
        view = s.proxy.views[0]
        await s.publish(
            0,
            [stored([sha(A), sha(B)], 4)],
            lambda: view.check is not None and view.check.status.mismatches > 0,
        )
        assert not view.usable
        health = (await (await s.client.get("/health")).json())["mmreuse"]
        assert any("block size" in p for p in health["problems"])
        assert (await s.post(chat(TEXT, img(A), img(B)))).status == 200
        assert e_sent(s) == [sha(A), sha(B)]


@arun
async def test_conflicting_embed_counts_fall_back_to_eager():
    # One identifier rendered with two lengths: vLLM rejects the request, so the proxy makes no
    # plan and lets P say so, as under eager (E gets every item).
    def conflicting(body: dict[str, Any]) -> dict[str, Any]:
        out = render(body)
        out["features"]["mm_placeholders"]["image"][1]["length"] = 8
        return out

    async with index_proxy() as s:
        s.pd[0].render = conflicting
        assert (await s.post(chat(TEXT, img(C), img(C)))).status == 200
        assert e_sent(s) == [sha(C), sha(C)]
        assert s.sample("mmreuse_proxy_fallbacks_total", instance="PD0", kind="no_plan") == 1
        assert s.sample("mmreuse_proxy_errors_total", stage="plan") == 1


class _SlowRender(Fake):
    """A PD whose render answers only after `delay_s`."""

    delay_s = 5.0

    async def handle(self, request):
        if request.path == "/v1/chat/completions/render":
            await asyncio.sleep(self.delay_s)
        return await super().handle(request)


@arun
async def test_a_render_past_its_timeout_costs_the_plan_not_the_request():
    # A render that does not answer within --render-timeout: E gets everything, as under eager,
    # and the client is answered once the timeout has passed, not when render would have.
    e = await Fake("e").start()
    pd = await _SlowRender("pd", render=render).start()
    argv = ["--encode-servers-urls", e.url, "--decode-servers-urls", pd.url,
            "--policy", "index", "--render-timeout", "0.2"]  # fmt: skip
    app = build_app(parse_args(argv, env={}))
    try:
        async with TestClient(TestServer(app)) as client:
            t0 = time.monotonic()
            r = await client.post("/v1/chat/completions", json=chat(TEXT, img(A)))
            assert r.status == 200 and time.monotonic() - t0 < 3.0
            assert [p["uuid"] for x in e.chats() for p in x.body["messages"][0]["content"]] == [
                sha(A)
            ]
            registry = app[PROXY_KEY].registry
            labels = {"instance": "PD0", "kind": "no_plan"}
            assert registry.get_sample_value("mmreuse_proxy_fallbacks_total", labels) == 1
    finally:
        await e.close()
        await pd.close()
