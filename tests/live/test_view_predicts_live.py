"""Issue 12, live test 2: the live view predicts P's real prefix-cache hits, request by request.

A P with a KV cache small enough to evict (`--num-gpu-blocks-override`) serves interleaved
multi-turn conversations that resend their history. An EventStream + KVIndexSink follow
it. Before each request the view predicts P's hit (`longest_prefix` -> `kv_coverage`); after it,
P's actual hit is the growth of `vllm:prefix_cache_hits_total`. They must be equal for every
request. Event lag is ruled out, not tolerated: before each prediction the subscriber must be
caught up (every seq received applied, no new batch for a settle interval) and never resynced.
Skipped unless MMREUSE_LIVE=1.
"""

import os
import time

import pytest
from prometheus_client import CollectorRegistry

from mmreuse import BlockHasher, kv_coverage
from mmreuse.cluster import Cluster
from mmreuse.cluster.client import get_text, image_part, png_data_url, post_json
from mmreuse.events import EventStream, KVIndexSink, Metrics, RemoteKVIndex
from mmreuse.render import from_render

pytestmark = [
    pytest.mark.live,
    pytest.mark.skipif(os.environ.get("MMREUSE_LIVE") != "1", reason="set MMREUSE_LIVE=1"),
]

BLOCK, KV_BLOCKS = 32, 24  # 736 usable tokens of KV: three growing conversations do not fit


@pytest.fixture(scope="module")
def small_p(tmp_path_factory):
    extra = ("--num-gpu-blocks-override", str(KV_BLOCKS), "--max-model-len", "640")
    with Cluster(tmp_path_factory.mktemp("small"), encoders=0, prefills=1, extra_args=extra) as c:
        yield c.instances["P0"].spec


def _hits(url):
    for line in get_text(url + "/metrics").splitlines():
        if line.startswith("vllm:prefix_cache_hits_total"):
            return int(float(line.rsplit(" ", 1)[1]))
    raise AssertionError("no vllm:prefix_cache_hits_total in /metrics")


def _settled(sub, quiet=0.6, timeout=15.0):
    """Wait until no batch arrived for `quiet` seconds and every one received was applied."""
    deadline = time.monotonic() + timeout
    last, since = sub.live_seq, time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.05)
        if sub.live_seq != last:
            last, since = sub.live_seq, time.monotonic()
        elif time.monotonic() - since >= quiet and sub.applied_seq == sub.live_seq:
            return True
    return False


def test_live_view_predicts_every_hit(small_p):
    p = small_p
    metrics = Metrics(CollectorRegistry())
    idx = RemoteKVIndex("P-small")
    sub = EventStream(
        p.kv_events_endpoint, p.replay_endpoint, sink=KVIndexSink(idx), metrics=metrics
    )
    sub.start()
    hasher = BlockHasher("sha256", BLOCK, seed="0")
    histories = {s: [] for s in ("a", "b", "c")}
    rows, evicting = [], 0
    last_n = dict.fromkeys(histories, 0)
    try:
        time.sleep(1.0)
        for turn in range(10):
            for s, history in histories.items():
                content = [{"type": "text", "text": f"{s}{turn} " + "w " * (4 + turn)}]
                if turn % 3 == 0:
                    content.append(image_part(png_data_url(84, 84, (turn * 20, 9, 9)), uuid=f"v-{s}-{turn}"))  # fmt: skip
                history.append({"role": "user", "content": content})
                body = {"model": "tiny", "messages": list(history)}
                if last_n[s] > 520:
                    continue  # this conversation is done: it would outgrow the 640-token context
                r = from_render(post_json(p.url + "/v1/chat/completions/render", {**body, "mm_payload": "none"}))  # fmt: skip
                n = last_n[s] = len(r.token_ids)
                hashes = hasher.hash_prompt(list(r.token_ids), mm=list(r.occurrences))
                assert _settled(sub), "the view did not catch up: a lag this test cannot explain"
                before_hits, held = _hits(p.url), idx.size()
                predicted, _ = kv_coverage(n, cached_prefix_tokens=idx.longest_prefix(hashes) * BLOCK, block_size=BLOCK)  # fmt: skip
                post_json(p.url + "/v1/chat/completions", {**body, "max_tokens": 1, "temperature": 0})  # fmt: skip
                actual = _hits(p.url) - before_hits
                rows.append((s, turn, n, predicted, actual))
                evicting += held + len(hashes) > KV_BLOCKS
                history.append({"role": "assistant", "content": f"ok {s} {turn}"})
        wrong = [row for row in rows if row[3] != row[4]]
        assert not wrong, f"(session, turn, tokens, predicted, actual): {wrong}"
        assert len(rows) >= 24 and sum(r[4] > 0 for r in rows) >= 10  # hits happened
        assert evicting >= 5  # the cache was too small to keep everything,
        removed = metrics.events.labels("P-small", "BlockRemoved")._value.get()
        assert removed > 0  # and P evicted, as its BlockRemoved events say
        resyncs = metrics.resyncs.labels("P-small")._value.get()
        assert resyncs == 0 and sub.is_alive
    finally:
        sub.stop()
