"""The residency ops called directly with hostile sizes and devices: they raise, never read or
write outside their tensors, and never silently skip the work on another device's kernel."""

import pytest

pytest.importorskip("torch")
import torch

from mmreuse import ops

HUGE = [2**63 - 1, 2**63 - 31, 2**63 - 32, 2**62 + 1, 33, 10**18]


def _state(num_blocks=64):
    words = (num_blocks + 31) // 32
    return torch.zeros(words, dtype=torch.int32), torch.zeros(num_blocks, dtype=torch.int64)


@pytest.mark.parametrize("num_blocks", HUGE)
@pytest.mark.parametrize("op", ["mark", "test", "prefix"])
def test_num_blocks_past_the_bitmap_raises_without_overflow(op, num_blocks):
    bitmap, _ = _state(32)  # one word: 32 blocks
    before = bitmap.clone()
    ids = torch.tensor([31, 32 * 5 + 7, 2**40], dtype=torch.int64)
    fn = getattr(ops, f"residency_{op}")
    with pytest.raises(RuntimeError, match="does not fit a bitmap"):
        fn(bitmap, ids, num_blocks)
    assert torch.equal(bitmap, before)


@pytest.mark.parametrize("num_blocks", [-1, -(2**63)])
def test_negative_num_blocks_raises(num_blocks):
    bitmap, _ = _state(32)
    with pytest.raises(RuntimeError, match="does not fit a bitmap"):
        ops.residency_mark(bitmap, torch.tensor([0]), num_blocks)


def test_exact_fit_is_accepted():
    bitmap, _ = _state(64)
    ops.residency_mark(bitmap, torch.tensor([63]), 64)
    assert bool(ops.residency_test(bitmap, torch.tensor([63]), 64)[0])


def test_generations_longer_than_the_bitmap_raise_on_evict_and_validate():
    bitmap = torch.zeros(1, dtype=torch.int32)  # 32 blocks
    gens = torch.zeros(2**10, dtype=torch.int64)  # claims 1024
    ids = torch.tensor([1000])
    with pytest.raises(RuntimeError, match="does not fit a bitmap"):
        ops.residency_evict(bitmap, gens, ids)
    with pytest.raises(RuntimeError, match="does not fit a bitmap"):
        ops.residency_validate(bitmap, gens, ids, torch.zeros(1, dtype=torch.int64))
    assert int(gens.sum()) == 0


def _meta(t):
    return torch.empty_like(t, device="meta")


MIXED = [
    ("mark", lambda b, g, i: ops.residency_mark(b, _meta(i), 64)),
    ("mark", lambda b, g, i: ops.residency_mark(_meta(b), i, 64)),
    ("test", lambda b, g, i: ops.residency_test(b, _meta(i), 64)),
    ("prefix", lambda b, g, i: ops.residency_prefix(b, _meta(i), 64)),
    ("evict", lambda b, g, i: ops.residency_evict(b, _meta(g), i)),
    ("evict", lambda b, g, i: ops.residency_evict(b, g, _meta(i))),
    ("validate", lambda b, g, i: ops.residency_validate(b, _meta(g), i, torch.zeros_like(i))),
    ("validate", lambda b, g, i: ops.residency_validate(b, g, i, _meta(torch.zeros_like(i)))),
    ("validate", lambda b, g, i: ops.residency_validate(b, g, _meta(i), _meta(i))),
]


@pytest.mark.parametrize(
    "case", range(len(MIXED)), ids=[f"{n}-{k}" for k, (n, _) in enumerate(MIXED)]
)
def test_mixed_devices_raise(case):
    _, call = MIXED[case]
    bitmap, gens = _state(64)
    ids = torch.tensor([1, 2**40], dtype=torch.int64)  # out of range too: must not be "accepted"
    with pytest.raises(RuntimeError, match="bitmap on"):
        call(bitmap, gens, ids)
