"""The residency torch ops: opcheck, a plain-torch reference, bounds errors that write nothing."""

import pytest

pytest.importorskip("torch")
import torch

from mmreuse import ops

DEVICES = [
    "cpu",
    pytest.param(
        "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
    ),
]


# ---- plain-torch reference ----------------------------------------------------------------


def ref_bits(bitmap, num_blocks):
    words = bitmap.to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(32, device=bitmap.device)
    return ((words[:, None] >> shifts) & 1).reshape(-1)[:num_blocks].bool()


def ref_bitmap(bits):
    n = bits.numel()
    padded = torch.zeros((n + 31) // 32 * 32, dtype=torch.int64, device=bits.device)
    padded[:n] = bits.to(torch.int64)
    words = (padded.reshape(-1, 32) << torch.arange(32, device=bits.device)).sum(1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def random_state(device, num_blocks=300, seed=0):
    g = torch.Generator().manual_seed(seed)
    bits = torch.rand(num_blocks, generator=g) < 0.5
    gens = torch.randint(0, 5, (num_blocks,), generator=g)
    ids = torch.randint(0, num_blocks, (200,), generator=g)  # duplicates included
    return ref_bitmap(bits).to(device), gens.to(device), ids.to(device), bits.to(device)


@pytest.mark.parametrize("device", DEVICES)
def test_reference_roundtrip(device):
    bitmap, _, _, bits = random_state(device)
    assert torch.equal(ref_bits(bitmap, bits.numel()), bits)


@pytest.mark.parametrize("device", DEVICES)
def test_mark_matches_reference(device):
    bitmap, _, ids, bits = random_state(device)
    ops.residency_mark(bitmap, ids, bits.numel())
    bits[ids] = True
    assert torch.equal(ref_bits(bitmap, bits.numel()), bits)


@pytest.mark.parametrize("device", DEVICES)
def test_evict_matches_reference(device):
    bitmap, gens, ids, bits = random_state(device)
    expected_gens = gens.clone()
    expected_gens.index_add_(0, ids, torch.ones_like(ids))  # once per occurrence
    ops.residency_evict(bitmap, gens, ids)
    bits[ids] = False
    assert torch.equal(ref_bits(bitmap, bits.numel()), bits)
    assert torch.equal(gens, expected_gens)


@pytest.mark.parametrize("device", DEVICES)
def test_queries_match_reference(device):
    bitmap, gens, ids, bits = random_state(device)
    n = bits.numel()
    assert torch.equal(ops.residency_test(bitmap, ids, n), bits[ids])
    assert int(ops.residency_count(bitmap)) == int(bits.sum())
    misses = (~bits[ids]).nonzero()
    assert int(ops.residency_prefix(bitmap, ids, n)) == (
        int(misses[0]) if misses.numel() else ids.numel()
    )
    expected = gens[ids].clone()
    expected[::3] += 1
    assert torch.equal(
        ops.residency_validate(bitmap, gens, ids, expected), bits[ids] & (gens[ids] == expected)
    )


@pytest.mark.parametrize("device", DEVICES)
def test_empty_batches(device):
    bitmap, gens, _, bits = random_state(device)
    empty = torch.empty(0, dtype=torch.int64, device=device)
    before = bitmap.clone()
    ops.residency_mark(bitmap, empty, bits.numel())
    ops.residency_evict(bitmap, gens, empty)
    assert torch.equal(bitmap, before)
    assert ops.residency_test(bitmap, empty, bits.numel()).numel() == 0
    assert int(ops.residency_prefix(bitmap, empty, bits.numel())) == 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bad", [-1, 300, 2**40])
def test_out_of_range_raises_and_writes_nothing(device, bad):
    bitmap, gens, ids, bits = random_state(device)
    ids = ids.clone()
    ids[57] = bad
    n = bits.numel()
    before_bitmap, before_gens = bitmap.clone(), gens.clone()
    for call in (
        lambda: ops.residency_mark(bitmap, ids, n),
        lambda: ops.residency_evict(bitmap, gens, ids),
        lambda: ops.residency_test(bitmap, ids, n),
        lambda: ops.residency_prefix(bitmap, ids, n),
        lambda: ops.residency_validate(bitmap, gens, ids, gens[:1].expand(ids.numel()).clone()),
    ):
        with pytest.raises(
            ValueError, match=rf"^block_ids\[57\] = {bad} is out of range \[0, 300\)"
        ):
            call()
        assert torch.equal(bitmap, before_bitmap) and torch.equal(gens, before_gens)


def test_bad_dtypes_and_shapes():
    bitmap, gens, ids, _ = random_state("cpu")
    with pytest.raises(RuntimeError, match="int64"):
        ops.residency_mark(bitmap, ids.to(torch.int32), 300)
    with pytest.raises(RuntimeError, match="int32"):
        ops.residency_mark(bitmap.to(torch.int64), ids, 300)
    with pytest.raises(RuntimeError, match="num_blocks"):
        ops.residency_mark(bitmap, ids, 10_000)
    with pytest.raises(RuntimeError, match="expected"):
        ops.residency_validate(bitmap, gens, ids, gens[:3])


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_every_op(device):
    bitmap, gens, ids, bits = random_state(device)
    n = bits.numel()
    m = torch.ops.mmreuse
    for op, args in [
        (m.residency_mark.default, (bitmap, ids, n)),
        (m.residency_evict.default, (bitmap, gens, ids)),
        (m.residency_test.default, (bitmap, ids, n)),
        (m.residency_count.default, (bitmap,)),
        (m.residency_prefix.default, (bitmap, ids, n)),
        (m.residency_validate.default, (bitmap, gens, ids, gens[ids].clone())),
    ]:
        torch.library.opcheck(op, args)
