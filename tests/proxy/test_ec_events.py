"""`--policy index` with P's encoder-cache events (`--encoder-cache-events-endpoints`): an item
P holds in its encoder cache is not sent to E (class p_local) and reaches P raw with its uuid;
the events come over real ZMQ (tests/support/kv_publisher.TestPublisher), the render from a fake PD."""

from __future__ import annotations

import asyncio
import time

from mmreuse.events.ec_wire import (
    EncoderCacheEventBatch,
    EncoderCacheEvicted,
    EncoderCacheStored,
    encode_ec_batch,
)
from mmreuse.proxy.app import PROXY_KEY, build_app
from mmreuse.proxy.config import parse_args
from tests.support.index_proxy import TEXT, A, B, render
from tests.support.proxy_fakes import chat, img, proxy_client, sha


async def _wait(cond, timeout=10.0):
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "the encoder-cache events never applied"
        await asyncio.sleep(0.01)


async def test_an_item_in_ps_encoder_cache_is_not_sent_to_e(fakes, publisher):
    pub = publisher()
    e = await fakes("e")
    pd = await fakes("pd", render=render)
    argv = ["--encode-servers-urls", e.url, "--decode-servers-urls", pd.url, "--policy", "index",
            "--encoder-cache-events-endpoints", pub.endpoint,
            "--encoder-cache-events-replay-endpoints", pub.replay_endpoint]  # fmt: skip
    app = build_app(parse_args(argv, env={}))
    async with proxy_client(app) as client:
        proxy = app[PROXY_KEY]
        await asyncio.sleep(0.3)
        pub.publish(encode_ec_batch(EncoderCacheEventBatch(time.time(), [EncoderCacheStored(sha(B), 16)], 0)))  # fmt: skip
        await _wait(lambda: sha(B) in proxy.availability.availability_for("PD0").p_local)
        r = await client.post("/v1/chat/completions", json=chat(TEXT, img(A), img(B)))
        assert r.status == 200
        sent = [p["uuid"] for x in e.chats() for p in x.body["messages"][0]["content"]]
        assert sent == [sha(A)]  # B is P-local
        content = pd.chats()[-1].body["messages"][0]["content"]
        assert content[2] == {**img(B), "uuid": sha(B)}  # raw, with its uuid
        sample = proxy.registry.get_sample_value
        assert sample("mmreuse_proxy_occurrences_total", {"klass": "p_local"}) == 1
        # Evicted at P: E gets it again.
        pub.publish(encode_ec_batch(EncoderCacheEventBatch(time.time(), [EncoderCacheEvicted([sha(B)])], 0)))  # fmt: skip
        await _wait(lambda: sha(B) not in proxy.availability.availability_for("PD0").p_local)
        r = await client.post("/v1/chat/completions", json=chat(TEXT, img(B)))
        assert r.status == 200
        assert [p["uuid"] for p in e.chats()[-1].body["messages"][0]["content"]] == [sha(B)]
        health = await (await client.get("/health")).json()
        assert health["mmreuse"]["views"]["PD0"]["encoder_cache_events"] == pub.endpoint
