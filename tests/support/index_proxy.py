"""`mmreuse proxy --policy index` in process, for tests: fake E / PD servers
(tests/support/proxy_fakes.py; each PD renders requests as vLLM's `/v1/chat/completions/render`
would) and a real view fed by vLLM-shaped KV events (BlockStored with token ids and untagged extra
keys) from a local ZMQ publisher (tests/support/kv_publisher.py), hashed with mmreuse's own
BlockHasher, as P would publish them with PYTHONHASHSEED=0."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import zmq
import zmq.asyncio
from aiohttp import web
from aiohttp.test_utils import TestClient

from mmreuse.blockhash import to_event_id
from mmreuse.events import BlockStored, KVEventBatch
from mmreuse.hashing import BlockHasher, MMOccurrence
from mmreuse.proxy.config import parse_args
from mmreuse.proxy.server import build_app

from .demand_p import FakeP
from .kv_publisher import TestPublisher
from .proxy_config import seeded
from .proxy_fakes import Fake, ProxyHandle, proxy_client, sha
from .waiting import async_wait_for

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
        if part.get("type") in ("image_url", "image_embeds")  # raw, or E's reference
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
    ps: list[FakeP] = dataclasses.field(default_factory=list)  # demand endpoints, if asked

    async def publish(self, i: int, events: list[Any], until: Callable[[], bool]) -> None:
        """Publish `events` on PD i's publisher and wait until `until()` holds. Empty batches
        follow until then: a subscriber that joined late sees a gap and replays from seq 0."""
        self.pubs[i].publish(KVEventBatch(ts=time.time(), events=events, data_parallel_rank=0))

        def applied_or_nudged() -> bool:
            if until():
                return True
            self.pubs[i].publish(KVEventBatch(ts=time.time(), events=[], data_parallel_rank=0))
            return False

        assert await async_wait_for(applied_or_nudged), "the proxy's view never applied the events"

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
    before: Sequence[Sequence[Any]] = (),
    buffer_steps: int = 10_000,
    demand: bool = False,
    pd_class: type[Fake] = Fake,
) -> AsyncIterator[Setup]:
    """E + PD (or E + P + D with `prefill`: then `pd` are the P fakes, `d` the decode one).
    `before`: event batches each publisher sent before the proxy started (a late join, with
    replay buffers of `buffer_steps`); `demand`: each PD has a fake demand endpoint (`ps`);
    `pd_class`: the PD (or P) fakes' class."""
    ctx = zmq.Context()
    pubs = [TestPublisher(ctx, buffer_steps=buffer_steps) for _ in range(n_pd)] if events else []
    for pub in pubs:
        for events_ in before:
            pub.publish(KVEventBatch(ts=time.time(), events=list(events_), data_parallel_rank=0))
    actx = zmq.asyncio.Context() if demand else None
    ps = [FakeP(actx) for _ in range(n_pd)] if actx is not None else []
    e = await Fake("e").start()
    role = "p" if prefill else "pd"
    pds = [await pd_class(role, render=render if renders else None).start() for _ in range(n_pd)]
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
    if ps:
        argv += ["--demand-endpoints", ",".join(p.endpoint for p in ps)]
    if events:
        argv += [
            "--kv-events-endpoints", ",".join(p.endpoint for p in pubs),
            "--kv-events-replay-endpoints", ",".join(p.replay_endpoint for p in pubs),
        ]  # fmt: skip
    config = parse_args(argv, env={})
    app = build_app(config if seed is None else seeded(config, seed))
    try:
        async with proxy_client(app) as client:
            yield Setup(client, app, e, pds, pubs, d, ps)
    finally:
        for fake in (e, *pds, *d):
            await fake.close()
        for pub in pubs:
            pub.close()
        for p in ps:
            await p.close()
        ctx.term()
        if actx is not None:
            actx.term()


def e_sent(s: Setup) -> list[str]:
    """The uuids E was sent, over every sub-request, in order."""
    return [p["uuid"] for x in s.e.chats() for p in x.body["messages"][0]["content"]]


def pd_content(s: Setup, i: int = 0, k: int = -1) -> list[dict[str, Any]]:
    return s.pd[i].chats()[k].body["messages"][0]["content"]


def embeds(url: str) -> dict[str, Any]:
    """What the fake E's metadata makes of an image: a metadata-only reference."""
    return {"type": "image_embeds", "image_embeds": {"image_grid_thw": [1, 2, 2]}, "uuid": sha(url)}
