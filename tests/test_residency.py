"""ResidencyMap and BlockIndex: API, ABA safety of proofs, a stateful model, bad input."""

import hashlib

import numpy as np
import pytest

pytest.importorskip("torch")
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from mmreuse.errors import InvalidArgument, InvalidArgumentType
from mmreuse.hashing import to_event_id
from mmreuse.residency import BlockIndex, CoverageProof, ResidencyMap

DEVICES = [
    "cpu",
    pytest.param(
        "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
    ),
]


def h(i: int) -> bytes:
    return hashlib.sha256(f"block-{i}".encode()).digest()


@pytest.mark.parametrize("device", DEVICES)
def test_residency_map_basics(device):
    r = ResidencyMap(100, device)
    r.mark_resident([1, 2, 2, 99])
    assert r.is_resident([0, 1, 2, 99]).tolist() == [False, True, True, True]
    assert r.count() == 3
    assert r.longest_prefix([1, 2, 3, 99]) == 2
    g = r.generation([1, 2])
    assert g.tolist() == [0, 0]
    r.evict([2])
    assert r.generation([2]).tolist() == [1]
    assert not r.validate([1, 2], g) and r.validate([1], g[:1])
    snap = r.snapshot()
    r.mark_resident([5])  # after the snapshot: not in it
    assert snap.is_resident([1, 2, 5]).tolist() == [True, False, False]
    assert snap.generations.tolist()[2] == 1 and snap.ready


@pytest.mark.parametrize("device", DEVICES)
def test_bounds_errors_leave_state_unchanged(device):
    r = ResidencyMap(64, device)
    r.mark_resident([3])
    for call in (
        lambda: r.mark_resident([1, 64]),
        lambda: r.evict([3, -1]),
        lambda: r.is_resident([70]),
        lambda: r.generation([64]),
        lambda: r.longest_prefix([3, 99]),
        lambda: r.validate([3, 65], [0, 0]),
    ):
        with pytest.raises(ValueError, match="out of range"):
            call()
    assert r.count() == 1 and r.generation([3]).tolist() == [0]


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"num_blocks": 0}, "num_blocks"),
        ({"num_blocks": 2.5}, "num_blocks"),
        ({"num_blocks": 8, "device": "meta"}, "device"),
    ],
)
def test_residency_map_bad_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ResidencyMap(**kwargs)


def test_residency_map_bad_ids():
    r = ResidencyMap(8)
    for bad in ([1.5], torch.tensor([1.0]), "12", [True, 1.0]):
        with pytest.raises(ValueError, match="block_ids"):
            r.mark_resident(bad)
    with pytest.raises(ValueError, match="generations"):
        r.validate([1, 2], [0])


@pytest.mark.parametrize("device", DEVICES)
def test_block_index_prefix_and_proof(device):
    idx = BlockIndex(16, device)
    for i in range(6):
        idx.store(h(i), i + 3)
    k, proof = idx.lookup_prefix([h(i) for i in range(8)])
    assert k == 6 and proof.block_ids.tolist() == [3, 4, 5, 6, 7, 8]
    assert idx.validate(proof)
    # event ids and bytes meet
    assert idx.lookup_prefix([to_event_id(h(i)) for i in range(3)])[0] == 3
    idx.evict_block(5)
    assert idx.lookup_prefix([h(i) for i in range(8)])[0] == 2
    assert not idx.validate(proof)


def test_aba_reused_block_id_fails_old_proofs():
    idx = BlockIndex(8)
    idx.store(h(0), 2)
    idx.store(h(1), 3)
    k, proof = idx.lookup_prefix([h(0), h(1)])
    assert k == 2 and idx.validate(proof)
    idx.evict_block(3)
    idx.store(h(1), 3)  # the same content comes back into the same block: still a new generation
    assert idx.lookup_prefix([h(0), h(1)])[0] == 2
    assert not idx.validate(proof)
    # storing other content over a block without an explicit eviction also retires old proofs
    k, proof = idx.lookup_prefix([h(0)])
    idx.store(h(9), 2)
    assert not idx.validate(proof) and idx.lookup_prefix([h(0)])[0] == 0


def test_duplicate_holders_and_clear():
    idx = BlockIndex(8)
    idx.store(h(0), 1)
    idx.store(h(0), 4)  # the same hash computed twice (two requests at once)
    idx.evict_block(1)
    assert idx.lookup_prefix([h(0)])[0] == 1 and idx.block_id(h(0)) == 4
    idx.evict_block(4)
    assert idx.block_id(h(0)) is None
    idx.store(h(1), 1)
    _, proof = idx.lookup_prefix([h(1)])
    idx.clear()
    assert len(idx) == 0 and idx.lookup_prefix([h(1)])[0] == 0 and not idx.validate(proof)


def test_block_index_bad_input():
    idx = BlockIndex(8)
    for call, match in [
        (lambda: idx.store(h(0), 8), "block_id"),
        (lambda: idx.store(h(0), -1), "block_id"),
        (lambda: idx.store("abc", 1), "block_hash"),
        (lambda: idx.store(-5, 1), "block_hash"),
        (lambda: idx.store(2**64, 1), "block_hash"),
        (lambda: idx.store(b"123", 1), "block_hash"),
        (lambda: idx.evict_block(9), "block_id"),
        (lambda: idx.lookup_prefix(h(0)), "block_hashes"),
        (lambda: idx.lookup_prefix([-(2**63) - 1]), r"block_hashes\[0\]"),
        (lambda: idx.lookup_prefix([1.5]), r"block_hashes\[0\]"),
        (lambda: idx.validate((1, 2)), "CoverageProof"),
    ]:
        with pytest.raises(ValueError, match=match):
            call()


def test_many_stores_grow_the_table():
    idx = BlockIndex(5000)
    for i in range(5000):
        idx.store(h(i), i)
    for i in range(0, 5000, 2):
        idx.evict_block(i)
    for i in range(0, 5000, 2):
        idx.store(h(10_000 + i), i)
    assert len(idx) == 5000
    assert idx.lookup_prefix([h(1), h(3), h(10_000), h(10_002), h(2)])[0] == 4


class IndexModel(RuleBasedStateMachine):
    """Random store / evict / reuse / lookup / validate against a plain Python model."""

    NUM_BLOCKS = 12
    HASHES = 10

    def __init__(self):
        super().__init__()
        self.idx = BlockIndex(self.NUM_BLOCKS)
        self.block_hash = {}  # block -> hash index
        self.gen = [0] * self.NUM_BLOCKS
        self.proofs = []  # (proof, {block: gen} at the time)

    def model_prefix(self, chain):
        held = {}
        for b, hi in sorted(self.block_hash.items()):
            held.setdefault(hi, b)
        k = 0
        for hi in chain:
            if hi not in held:
                break
            k += 1
        return k

    @rule(hi=st.integers(0, HASHES - 1), block=st.integers(0, NUM_BLOCKS - 1))
    def store(self, hi, block):
        old = self.block_hash.get(block)
        if old is not None and old != hi:
            self.gen[block] += 1
        self.block_hash[block] = hi
        self.idx.store(h(hi), block)

    @rule(block=st.integers(0, NUM_BLOCKS - 1))
    def evict(self, block):
        self.gen[block] += 1
        self.block_hash.pop(block, None)
        self.idx.evict_block(block)

    @rule(chain=st.lists(st.integers(0, HASHES - 1), max_size=8))
    def lookup(self, chain):
        k, proof = self.idx.lookup_prefix([h(i) for i in chain])
        assert k == self.model_prefix(chain)
        assert proof.num_blocks == k
        for b, hi in zip(proof.block_ids.tolist(), chain[:k], strict=True):
            assert self.block_hash[b] == hi
        assert proof.generations.tolist() == [self.gen[b] for b in proof.block_ids.tolist()]
        self.proofs.append(proof)

    @precondition(lambda self: self.proofs)
    @rule(data=st.data())
    def validate(self, data):
        proof = data.draw(st.sampled_from(self.proofs))
        ok = all(
            b in self.block_hash and self.gen[b] == g
            for b, g in zip(proof.block_ids.tolist(), proof.generations.tolist(), strict=True)
        )
        assert self.idx.validate(proof) == ok

    @invariant()
    def residency_matches(self):
        assert self.idx.residency.count() == len(self.block_hash)
        assert self.idx.residency.generation(list(range(self.NUM_BLOCKS))).tolist() == self.gen


TestIndexModel = IndexModel.TestCase
TestIndexModel.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)


def test_coverage_proof_is_a_frozen_value():
    p = CoverageProof(torch.tensor([1]), torch.tensor([0]))
    with pytest.raises(AttributeError):
        p.block_ids = torch.tensor([2])


# ---- the KVView protocol and hash validation -------------------------------------------------


def test_block_index_match_prefix_is_lookup_prefix():
    from mmreuse.kvview import KVView, PrefixMatch

    idx = BlockIndex(8)
    idx.store_many([h(0), h(1), h(3)], [5, 2, 7])
    m = idx.match_prefix([h(0), to_event_id(h(1)), h(2), h(3)])
    hit, proof = idx.lookup_prefix([h(0), to_event_id(h(1)), h(2), h(3)])
    assert isinstance(idx, KVView) and isinstance(m, PrefixMatch)
    assert m.num_blocks == hit == 2
    assert m.proof.block_ids.tolist() == proof.block_ids.tolist() == [5, 2]
    assert idx.validate(m.proof)
    idx.evict_block(2)
    assert not idx.validate(m.proof) and idx.match_prefix([h(0), h(1)]).num_blocks == 1
    assert idx.match_prefix([]).num_blocks == 0


def test_block_index_validates_every_hash():
    from mmreuse.errors import InvalidArgument, InvalidArgumentType

    idx = BlockIndex(8)
    idx.store(1, 0)
    for hashes, cls, match in [
        ([99, "x"], InvalidArgumentType, r"block_hashes\[1\]"),  # after the first miss too
        ([1, 2, "x"], InvalidArgumentType, r"block_hashes\[2\]"),
        ([1, 99, 2, -1], InvalidArgument, r"block_hashes\[3\] must be an event id in .*, got -1"),
        ([99, b"short"], InvalidArgument, r"block_hashes\[1\] must be a block hash of >= 8 bytes"),
        ([True], InvalidArgumentType, r"block_hashes\[0\]"),
        (bytearray(b"12345678"), InvalidArgumentType, "block_hashes must be a sequence"),
    ]:
        for call in (idx.lookup_prefix, idx.match_prefix):
            with pytest.raises(cls, match=match):
                call(hashes)
    with pytest.raises(InvalidArgument, match=r"block_hashes\[1\]"):
        idx.store_many([2, -3], [1, 2])
    assert len(idx) == 1 and idx.block_id(bytearray(b"\x00" * 7 + b"\x01")) == 0


# ---- hostile input (issue #11) -----------------------------------------------------------

NOT_IDS = [
    ([1, True], InvalidArgumentType, r"\[1\] must be an int, got bool True"),
    ([1, np.bool_(True)], InvalidArgumentType, r"\[1\] must be an int"),
    ([torch.tensor(True)], InvalidArgumentType, r"\[0\] must be an int"),
    (
        torch.tensor([1 + 0j]),
        InvalidArgumentType,
        " must be an integer tensor, got dtype torch.complex64",
    ),
    (torch.tensor([True]), InvalidArgumentType, " must be an integer tensor, got dtype torch.bool"),
    (torch.tensor([[1, 2], [3, 4]]), InvalidArgument, r" must be 1-D, got shape \(2, 2\)"),
    (torch.tensor(3), InvalidArgument, r" must be 1-D, got shape \(\)"),
    (np.array([[1, 2]]), InvalidArgument, r" must be 1-D, got shape \(1, 2\)"),
    (np.array([1.0]), InvalidArgumentType, " must be an integer array, got dtype float64"),
    ({1, 2}, InvalidArgumentType, " must be a sequence of ints"),
    ({1: 2}, InvalidArgumentType, " must be a sequence of ints"),
    ((i for i in [1]), InvalidArgumentType, " must be a sequence of ints"),
    (bytearray(b"\x01"), InvalidArgumentType, " must be a sequence of ints"),
    (np.int64(3), InvalidArgumentType, " must be a sequence of ints"),
    (3, InvalidArgumentType, " must be a sequence of ints"),
    (None, InvalidArgumentType, " must be a sequence of ints"),
    ([float("nan")], InvalidArgumentType, r"\[0\] must be an int, got float nan"),
]


@pytest.mark.parametrize("bad,cls,match", NOT_IDS)
def test_residency_map_refuses_what_is_not_block_ids(bad, cls, match):
    r = ResidencyMap(64)
    calls = (r.mark_resident, r.evict, r.is_resident, r.generation, r.longest_prefix)
    for call in (*calls, lambda ids: r.validate(ids, [0]), r.snapshot().is_resident):
        if isinstance(bad, type(i for i in [])):
            bad = (i for i in [1])  # a fresh generator each time
        with pytest.raises(cls, match="^block_ids" + match):
            call(bad)
    assert r.count() == 0 and r.generations.sum().item() == 0


@pytest.mark.parametrize("bad,cls,match", NOT_IDS)
def test_residency_map_validate_names_generations(bad, cls, match):
    r = ResidencyMap(64)
    with pytest.raises(cls, match="^generations" + match):
        r.validate([1], bad)


@pytest.mark.parametrize(
    "ids,shown",
    [
        ([2**63], 2**63),
        ([1, 2**64 + 1], 2**64 + 1),
        (np.array([2**63 + 5], dtype=np.uint64), 2**63 + 5),
        (torch.tensor([1, 2**63 + 5], dtype=torch.uint64), 2**63 + 5),
        ([np.uint64(2**63)], 2**63),
    ],
)
def test_ids_beyond_int64_are_shown_with_their_real_value(ids, shown):
    r = ResidencyMap(64)
    for call in (r.mark_resident, r.evict, r.is_resident, r.generation, r.longest_prefix):
        with pytest.raises(InvalidArgument, match=rf"^block_ids\[\d\] = {shown} is out of range"):
            call(ids)
    with pytest.raises(
        InvalidArgument, match=rf"^generations\[\d\] must be a 64-bit int, got {shown}"
    ):
        r.validate([1] * len(ids), ids)
    assert r.count() == 0


def test_accepted_id_forms_are_kept():
    r = ResidencyMap(64)
    for ids in (
        [1, 2],
        (1, 2),
        range(1, 3),
        np.array([1, 2], dtype=np.uint8),
        torch.tensor([1, 2]),
    ):
        assert r.is_resident(ids).tolist() == [False, False]
    r.mark_resident([np.int64(1), np.int32(2), torch.tensor(3)])  # integer scalars, by value
    assert r.count() == 3 and r.validate(np.array([1, 2]), torch.tensor([0, 0], dtype=torch.int32))
    assert r.is_resident(np.arange(4)[::-1]).tolist() == [True, True, True, False]


@pytest.mark.parametrize(
    "device,cls,match",
    [
        (3, InvalidArgumentType, "device must be a str or torch.device, got int 3"),
        (None, InvalidArgumentType, "device must be a str or torch.device"),
        ("bogus", InvalidArgument, "device must be a device name"),
        ("xla", InvalidArgument, "device must be cpu or cuda"),
        pytest.param(
            "cuda:0",
            InvalidArgument,
            "device must be a CUDA device present",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present"),
        ),
    ],
)
def test_residency_map_bad_device(device, cls, match):
    with pytest.raises(cls, match=match):
        ResidencyMap(8, device)
    with pytest.raises(InvalidArgument, match="num_blocks"):
        ResidencyMap(2**70)


def test_block_index_hostile_block_ids():
    idx = BlockIndex(8)
    for bad, cls, match in [
        ({1, 2}, InvalidArgumentType, "block_ids must be a sequence"),  # pairs by position
        ("12", InvalidArgumentType, "block_ids must be a sequence"),
        ([1, True], InvalidArgumentType, r"block_ids\[1\] must be an int, got bool True"),
        (np.array([[1, 2]]), InvalidArgument, "block_ids must be 1-D"),
        (torch.tensor([1.0, 2.0]), InvalidArgumentType, "block_ids must be an integer tensor"),
        ([1, 1], InvalidArgument, r"block_ids must be distinct .* got \[1, 1\]"),
    ]:
        with pytest.raises(cls, match=match):
            idx.store_many([h(1), h(2)], bad)
    with pytest.raises(InvalidArgumentType, match="block_hashes must be a sequence"):
        idx.store_many({h(1), h(2)}, [1, 2])
    with pytest.raises(InvalidArgument, match=r"^block_ids has 2 entries for 1 block_hashes"):
        idx.store_many([h(1)], [1, 2])
    with pytest.raises(InvalidArgumentType, match=r"block_ids\[0\] must be an int"):
        idx.evict_blocks(["1"])
    with pytest.raises(InvalidArgumentType, match=r"^proof must be a CoverageProof, got dict"):
        idx.validate({})
    assert len(idx) == 0 and idx.residency.count() == 0
    idx.store_many([h(1), h(2)], np.array([1, 2]))
    idx.evict_blocks(torch.tensor([2]))
    assert idx.block_id(h(1)) == 1 and idx.block_id(h(2)) is None


def test_block_index_hash_of_and_block_of_event_id():
    idx = BlockIndex(8)
    idx.store(h(1), 3)
    key = to_event_id(h(1))
    assert idx.hash_of(3) == key and idx.hash_of(np.int64(3)) == key and idx.hash_of(4) is None
    assert idx.block_of_event_id(key) == 3 and idx.block_of_event_id(key + 1) is None
    for bad, cls in ((True, InvalidArgumentType), (-1, InvalidArgument), (8, InvalidArgument)):
        with pytest.raises(cls, match=r"^block_id"):
            idx.hash_of(bad)
    idx.evict_block(3)
    assert idx.hash_of(3) is None and idx.block_of_event_id(key) is None
    with pytest.raises(InvalidArgumentType, match=r"^block_id must be an int"):
        idx.evict_block([3])


def test_maps_are_the_live_read_only_views():
    idx = BlockIndex(8)
    idx.store_many([b"\x00" * 24 + (5).to_bytes(8, "big"), 7], [3, 4])
    block_of, hash_in = idx.maps()
    assert dict(block_of) == {5: 3, 7: 4} and list(hash_in) == [None] * 3 + [5, 7] + [None] * 3
    idx.evict_block(3)
    assert 5 not in block_of and hash_in[3] is None  # live, not a copy


def test_block_index_counts_each_hash_by_the_blocks_holding_it():
    idx = BlockIndex(8)
    idx.store_many([10, 11, 10, 12], [0, 1, 2, 3])  # hash 10 in two blocks
    assert idx.counts() == {10: 2, 11: 1, 12: 1}
    idx.evict_blocks([0, 3])
    assert idx.counts() == {10: 1, 11: 1}
    counts = idx.counts()
    counts[11] = 5  # a copy: the index is unchanged
    assert idx.counts() == {10: 1, 11: 1}
