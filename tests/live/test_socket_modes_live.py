"""Issue 12, live test 3: an EventStream into a KVIndexSink follows a live P in both of vLLM's socket modes.

vLLM's publisher binds a wildcard endpoint (`tcp://*:PORT`: the subscriber connects) and
connects to a concrete tcp address (`tcp://127.0.0.1:PORT`: the subscriber binds, `bind=True`).
For each mode: a request's block hashes, computed by mmreuse from P's render, all appear in the
subscriber's RemoteKVIndex, and `longest_prefix` of the request equals its block count.
Skipped unless MMREUSE_LIVE=1.
"""

import os
import time

import pytest
from prometheus_client import CollectorRegistry

from mmreuse import BlockHasher
from mmreuse.cluster import Cluster
from mmreuse.cluster.client import image_part, png_data_url, post_json
from mmreuse.events import EventStream, KVIndexSink, Metrics, RemoteKVIndex
from mmreuse.render import from_render

pytestmark = [
    pytest.mark.live,
    pytest.mark.skipif(os.environ.get("MMREUSE_LIVE") != "1", reason="set MMREUSE_LIVE=1"),
]


@pytest.fixture(scope="module")
def connecting_p(tmp_path_factory):
    """A second P whose publisher connects (kv_events_bind=False); 1 E + 2 P at most."""
    with Cluster(
        tmp_path_factory.mktemp("bind"), encoders=0, prefills=1, kv_events_bind=False
    ) as c:
        yield c.instances["P0"].spec


def _follow_one_request(p, bind, tag):
    idx = RemoteKVIndex(f"P-{tag}")
    sub = EventStream(
        p.kv_events_endpoint, p.replay_endpoint, sink=KVIndexSink(idx), bind=bind,
        metrics=Metrics(CollectorRegistry()),
    )  # fmt: skip
    sub.start()
    try:
        time.sleep(1.0)  # the publisher's (re)connect and the slow joiner
        content = [
            {"type": "text", "text": f"{tag} {time.time_ns()} " * 6},
            image_part(png_data_url(112, 112, (5, 150, 5)), uuid=f"live-mode-{tag}"),
            {"type": "text", "text": "describe it " * 8},
        ]
        body = {"model": "tiny", "messages": [{"role": "user", "content": content}]}
        r = from_render(post_json(p.url + "/v1/chat/completions/render", {**body, "mm_payload": "none"}))  # fmt: skip
        hashes = BlockHasher("sha256", 32, seed="0").hash_prompt(list(r.token_ids), mm=list(r.occurrences))  # fmt: skip
        assert len(hashes) >= 3
        post_json(p.url + "/v1/chat/completions", {**body, "max_tokens": 1, "temperature": 0})
        deadline = time.monotonic() + 20
        while idx.longest_prefix(hashes) < len(hashes) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert sub.sink.match_prefix(hashes).num_blocks == len(hashes)
        assert sub.is_alive
    finally:
        sub.stop()


def test_connect_mode_follows_a_binding_publisher(cluster):
    p = cluster.instances["P0"].spec
    assert p.kv_events_bind
    _follow_one_request(p, bind=False, tag="connect")


def test_bind_mode_follows_a_connecting_publisher(connecting_p):
    assert not connecting_p.kv_events_bind
    _follow_one_request(connecting_p, bind=True, tag="bind")
