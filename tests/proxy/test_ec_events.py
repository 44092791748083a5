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
from mmreuse.proxy.config import parse_args
from mmreuse.proxy.server import PROXY_KEY, build_app
from tests.support.index_proxy import TEXT, A, B, render
from tests.support.proxy_fakes import chat, img, proxy_client, sha
from tests.support.waiting import async_wait_for


async def _wait(cond):
    assert await async_wait_for(cond), "the encoder-cache events never applied"


async def _joined(pub, n=1):
    """Every subscriber's subscription reached `pub` and its start-up replay was served: from
    then on a batch published reaches each of them live (no slow-joiner sleep)."""
    assert await asyncio.to_thread(pub.wait_joined, n, replays=n), "the proxy never subscribed"


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
        await _joined(pub)
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


async def test_replicas_share_the_e_side_from_es_own_events(fakes, publisher):
    # Two replicas follow E's encoder-cache events (--e-cache-events-endpoints): what E holds
    # is the same fact for both, whoever sent E what; neither records its own sends.
    pub = publisher()
    e = await fakes("e")
    pd = await fakes("pd", render=render)
    argv = ["--encode-servers-urls", e.url, "--decode-servers-urls", pd.url, "--policy", "index",
            "--e-cache-events-endpoints", pub.endpoint,
            "--e-cache-events-replay-endpoints", pub.replay_endpoint]  # fmt: skip
    apps = [build_app(parse_args(argv, env={})) for _ in range(2)]
    async with proxy_client(apps[0]) as one, proxy_client(apps[1]) as two:
        proxies = [app[PROXY_KEY] for app in apps]
        await _joined(pub, 2)
        pub.publish(encode_ec_batch(EncoderCacheEventBatch(time.time(), [EncoderCacheStored(sha(B), 16)], 0)))  # fmt: skip
        for proxy in proxies:
            await _wait(lambda p=proxy: sha(B) in p.availability.availability_for("PD0", ("E0",)).e_cached)  # fmt: skip
        for client, salt in ((one, None), (two, "tenant-1")):
            body = chat(TEXT, img(A), img(B))
            if salt:
                body["cache_salt"] = salt  # E's cache is not salted: B is still there
            r = await client.post("/v1/chat/completions", json=body)
            assert r.status == 200, await r.text()
        for proxy in proxies:
            sample = proxy.registry.get_sample_value
            assert sample("mmreuse_proxy_occurrences_total", {"klass": "e_cached"}) == 1
            assert sample("mmreuse_proxy_occurrences_total", {"klass": "e_compute"}) == 1
            # A was sent to E by one of them: only E's events could say E holds it now
            assert sha(A) not in proxy.availability.availability_for("PD0", ("E0",)).e_cached
        health = await (await two.get("/health")).json()
        assert health["mmreuse"]["e_side"] == "events"
        assert health["mmreuse"]["e_views"]["E0"]["complete"] is True
        # E gets both items either way: e_cached only says no forward is needed there
        assert [p["uuid"] for p in e.chats()[-1].body["messages"][0]["content"]] == [sha(A), sha(B)]


async def test_without_es_events_the_e_side_is_per_replica(fakes):
    e = await fakes("e")
    pd = await fakes("pd", render=render)
    argv = ["--encode-servers-urls", e.url, "--decode-servers-urls", pd.url, "--policy", "index"]
    app = build_app(parse_args(argv, env={}))
    async with proxy_client(app) as client:
        health = await (await client.get("/health")).json()
        assert health["mmreuse"]["e_side"] == "per-replica" and "e_views" not in health["mmreuse"]
