"""pytest-benchmark: residency ops and BlockIndex lookups (figures in BENCHMARKS.md).

    .venv/bin/python -m pytest benchmarks/test_bench_residency.py --benchmark-enable
CUDA rows run only where a GPU is visible (benchmarks/gpu_check.sh).
"""

import hashlib

import pytest

pytest.importorskip("torch")
import torch

from mmreuse import ops
from mmreuse.hashing import to_event_id
from mmreuse.residency import BlockIndex, ResidencyMap

DEVICES = [
    "cpu",
    pytest.param(
        "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
    ),
]


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n", [64 * 1024, 1024 * 1024])
def test_mark_ids(benchmark, device, n):
    num_blocks = 1 << 20
    r = ResidencyMap(num_blocks, device)
    ids = torch.randint(0, num_blocks, (n,), device=device)

    def run():
        ops.residency_mark(r.bitmap, ids, num_blocks)
        _sync(device)

    benchmark(run)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n", [64 * 1024, 1024 * 1024])
def test_evict_ids(benchmark, device, n):
    num_blocks = 1 << 20
    r = ResidencyMap(num_blocks, device)
    ids = torch.randint(0, num_blocks, (n,), device=device)

    def run():
        ops.residency_evict(r.bitmap, r.generations, ids)
        _sync(device)

    benchmark(run)


@pytest.mark.parametrize("device", DEVICES)
def test_op_dispatch_overhead(benchmark, device):
    """One id: what a call costs beyond its work (dispatch, checks; on CUDA the error-flag sync)."""
    r = ResidencyMap(1024, device)
    ids = torch.tensor([7], device=device)
    benchmark(ops.residency_mark, r.bitmap, ids, 1024)


def test_op_dispatch_overhead_query(benchmark):
    r = ResidencyMap(1024)
    ids = torch.tensor([7])
    benchmark(ops.residency_test, r.bitmap, ids, 1024)


def _index(device, chain_len=2048, num_blocks=1 << 20, filler=100_000):
    idx = BlockIndex(num_blocks, device)
    hashes = [hashlib.sha256(f"b{i}".encode()).digest() for i in range(filler)]
    for i, hh in enumerate(hashes):
        idx.store(hh, i)
    return idx, hashes[5000 : 5000 + chain_len]


@pytest.mark.parametrize("device", DEVICES)
def test_lookup_prefix_2048_event_ids(benchmark, device):
    idx, chain = _index(device)
    ev = [to_event_id(hh) for hh in chain]
    k, _ = benchmark(idx.lookup_prefix, ev)
    assert k == 2048


def test_lookup_prefix_2048_bytes(benchmark):
    idx, chain = _index("cpu")
    k, _ = benchmark(idx.lookup_prefix, chain)
    assert k == 2048


def test_validate_proof_2048(benchmark):
    idx, chain = _index("cpu")
    _, proof = idx.lookup_prefix(chain)
    assert benchmark(idx.validate, proof)


@pytest.mark.parametrize("device", DEVICES)
def test_snapshot_1m_blocks(benchmark, device):
    r = ResidencyMap(1 << 20, device)

    def run():
        snap = r.snapshot()
        return snap.bitmap  # waits for the copy

    benchmark(run)
