"""pytest-benchmark: compute_demand with 1, 8 and 64 occurrences (mixed classes, masks, duplicates).

.venv/bin/python -m pytest benchmarks/test_bench_demand.py --benchmark-enable
"""

import random

import pytest

from mmreuse import Availability, MMOccurrence, compute_demand


def make_request(k, seed=0):
    """k occurrences of 576-token images (a quarter with is_embed masks, a quarter repeated)."""
    rng = random.Random(seed)
    occs, offset = [], 0
    idents = [f"img-{i:04d}" for i in range(max(1, k * 3 // 4))]
    for i in range(k):
        offset += rng.randrange(8, 64)
        length = 576
        mask = [j % 4 != 3 for j in range(length)] if i % 4 == 1 else None
        ident = idents[i % len(idents)]
        occs.append(MMOccurrence(ident, offset, length, is_embed=mask))
        offset += length
    n = offset + 32
    avail = Availability(
        p_local={i: 576 for i in idents[1::4]},
        p_external=frozenset(idents[2::4]),
        e_cached=frozenset(idents[3::4]),
    )
    return occs, n, n // 3, avail


@pytest.mark.parametrize("k", [1, 8, 64])
def test_compute_demand(benchmark, k):
    occs, n, c, avail = make_request(k)
    res = benchmark(compute_demand, occs, n, c, avail)
    assert len(res.decisions) == k
