"""Which KV blocks a Prefill instance holds: a residency bitmap with per-block generations.

`ResidencyMap` keeps one bit per KV block and an int64 generation per block, on the device
that holds the KV (updated by the `mmreuse` torch ops on the current stream, so residency
follows the stream that wrote or loaded the KV). vLLM reuses block ids after eviction, so a
bare bitmap is ABA-unsafe: eviction bumps the block's generation, and every coverage decision
carries a `CoverageProof` (block ids + generations) that is re-checked when the request
consumes it.

`BlockIndex` adds the map from block hash to block id (what vLLM's KV events describe), and
answers "how many leading blocks of this request are resident?" with a proof.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from . import ops
from ._table import HashTable
from .blockhash import EventBlockId, ExternalBlockHash, to_event_id, to_event_ids
from .errors import InvalidArgument, InvalidArgumentType
from .kvview import PrefixMatch
from .validate import check_int, fail_type, fail_value, show

BlockHashKey = EventBlockId  # the 64-bit event id form; bytes are converted with to_event_id

_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1
_INT_DTYPES = frozenset(
    {
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.uint8,
        torch.uint16,
        torch.uint32,
        torch.uint64,
    }
)
_IDS_EXPECTED = "a sequence of ints, or a 1-D integer tensor or array"


def _check_num_blocks(num_blocks: Any) -> int:
    return check_int("num_blocks", num_blocks, 1, _INT64_MAX)


def _check_device(device: Any) -> torch.device:
    """A cpu or cuda torch.device that exists here (a str or torch.device)."""
    if not isinstance(device, (str, torch.device)):
        fail_type("device", "a str or torch.device", device)
    try:
        dev = torch.device(device)
    except RuntimeError:
        fail_value("device", "a device name such as 'cpu' or 'cuda:0'", device)
    if dev.type not in ("cpu", "cuda"):
        fail_value("device", "cpu or cuda", device)
    if dev.type == "cuda" and (
        not torch.cuda.is_available()
        or (dev.index is not None and dev.index >= torch.cuda.device_count())
    ):
        fail_value("device", "a CUDA device present on this machine", device)
    return dev


def _out_of_range(field: str, i: int, value: int, num_blocks: int | None) -> InvalidArgument:
    if num_blocks is None:
        return InvalidArgument(f"{field}[{i}] must be a 64-bit int, got {value}")
    return InvalidArgument(f"{field}[{i}] = {value} is out of range [0, {num_blocks})")


def _one_id(field: str, i: int, value: Any, num_blocks: int | None) -> int:
    if isinstance(value, Tensor) and (value.dim() != 0 or value.dtype not in _INT_DTYPES):
        fail_type(f"{field}[{i}]", "an int", value)  # a bool tensor has __index__ too
    x = check_int(f"{field}[{i}]", value)
    if (num_blocks is not None and not 0 <= x < num_blocks) or not _INT64_MIN <= x <= _INT64_MAX:
        raise _out_of_range(field, i, x, num_blocks)
    return x


def _id_tensor(value: Any, field: str, num_blocks: int | None) -> Tensor:
    """`value` as a 1-D int64 tensor: a tensor stays on its device, the rest land on the CPU.

    Refuses (naming `field`) what is not a sequence of ints or a 1-D integer tensor/array:
    bools, floats, complex, sets, generators, 2-D. Python ints outside int64 (and uint64
    values >= 2**63) are refused with their real value; with `num_blocks`, every non-int64
    or non-plain-int input is range-checked here too (plain int64 ids by the ops)."""
    if isinstance(value, Tensor):
        if value.dtype not in _INT_DTYPES:
            raise InvalidArgumentType(
                f"{field} must be an integer tensor, got dtype {value.dtype}: {show(value)}"
            )
        if value.dim() != 1:
            raise InvalidArgument(f"{field} must be 1-D, got shape {tuple(value.shape)}")
        if value.device.type not in ("cpu", "cuda"):
            fail_value(f"{field}.device", "cpu or cuda", value.device)
        if value.dtype != torch.uint64:
            return value.to(torch.int64)
        ids = value.view(torch.int64)  # the same bits; values >= 2**63 read negative
        wrapped = (ids < 0).nonzero()
        if wrapped.numel():
            i = int(wrapped[0, 0])
            raise _out_of_range(field, i, int(ids[i]) + (1 << 64), num_blocks)
        return ids
    if isinstance(value, np.ndarray):
        if value.dtype.kind not in "iu":
            raise InvalidArgumentType(
                f"{field} must be an integer array, got dtype {value.dtype}: {show(value)}"
            )
        if value.ndim != 1:
            raise InvalidArgument(f"{field} must be 1-D, got shape {value.shape}")
        if value.dtype == np.uint64 and value.size and value.max() > _INT64_MAX:
            i = int(np.argmax(value > _INT64_MAX))
            raise _out_of_range(field, i, int(value[i]), num_blocks)
        return torch.from_numpy(np.ascontiguousarray(value, dtype=np.int64))
    if isinstance(value, (str, bytes, bytearray, memoryview)) or not isinstance(value, Sequence):
        fail_type(field, _IDS_EXPECTED, value)  # a set or dict has no order, a str is no ids
    if all(type(v) is int for v in value):  # the common case: numpy converts and range-fits
        try:
            return torch.from_numpy(np.array(value, dtype=np.int64))
        except OverflowError:
            pass  # outside int64: reported with its index below
    checked = [_one_id(field, i, v, num_blocks) for i, v in enumerate(value)]
    return torch.from_numpy(np.array(checked, dtype=np.int64))


class ResidencySnapshot:
    """A host copy of a ResidencyMap at one stream point.

    On CUDA the copy into pinned memory is asynchronous and recorded with an event; reading
    `bitmap` / `generations` waits on that event (only then). On CPU it is a plain copy.
    """

    __slots__ = ("_bitmap", "_event", "_generations", "num_blocks")

    def __init__(self, num_blocks: int, bitmap: Tensor, generations: Tensor, event: Any) -> None:
        self.num_blocks = num_blocks
        self._bitmap = bitmap
        self._generations = generations
        self._event = event

    def _wait(self) -> None:
        if self._event is not None:
            self._event.synchronize()
            self._event = None

    @property
    def ready(self) -> bool:
        """Whether the copy has landed (never blocks)."""
        return self._event is None or self._event.query()

    @property
    def bitmap(self) -> Tensor:
        self._wait()
        return self._bitmap

    @property
    def generations(self) -> Tensor:
        self._wait()
        return self._generations

    def is_resident(self, block_ids: Sequence[int] | Tensor) -> np.ndarray:
        """Host-side residency test against this snapshot (bool array)."""
        ids = _id_tensor(block_ids, "block_ids", self.num_blocks).cpu().numpy()
        _check_range(ids, self.num_blocks)
        words = self.bitmap.numpy().view(np.uint32)
        return ((words[ids >> 5] >> (ids & 31).astype(np.uint32)) & 1).astype(bool)


def _check_range(ids: np.ndarray | Tensor, num_blocks: int) -> None:
    """Every int64 id in [0, num_blocks), else InvalidArgument naming the first one out."""
    bad = (ids < 0) | (ids >= num_blocks)
    if isinstance(bad, np.ndarray):
        if bad.any():
            i = int(np.argmax(bad))
            raise _out_of_range("block_ids", i, int(ids[i]), num_blocks)
    elif bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise _out_of_range("block_ids", i, int(ids[i]), num_blocks)


class ResidencyMap:
    """Residency bits and generations of `num_blocks` KV blocks on `device`.

    Block ids (and a proof's generations) are a sequence of ints or a 1-D integer tensor or
    numpy array; anything else (bools, floats, complex, sets, 2-D, ints outside int64) raises
    InvalidArgument / InvalidArgumentType naming the field and showing the value."""

    def __init__(self, num_blocks: int, device: str | torch.device = "cpu") -> None:
        self.num_blocks = _check_num_blocks(num_blocks)
        self.device = _check_device(device)
        self.bitmap = torch.zeros((num_blocks + 31) // 32, dtype=torch.int32, device=self.device)
        self.generations = torch.zeros(num_blocks, dtype=torch.int64, device=self.device)

    def _ids(self, block_ids: Any, field: str = "block_ids") -> Tensor:
        return _id_tensor(block_ids, field, self.num_blocks).to(self.device)

    def _call(self, fn, *args):
        try:
            return fn(*args)
        except ValueError as exc:  # the op's bounds error, field first: the class is all we change
            raise InvalidArgument(*exc.args) from None

    def _mark(self, ids: Tensor) -> None:
        self._call(ops.residency_mark, self.bitmap, ids, self.num_blocks)

    def _evict(self, ids: Tensor) -> None:
        self._call(ops.residency_evict, self.bitmap, self.generations, ids)

    def mark_resident(self, block_ids: Sequence[int] | Tensor) -> None:
        """Mark blocks as holding valid KV (after the work that wrote or loaded it)."""
        self._mark(self._ids(block_ids))

    def evict(self, block_ids: Sequence[int] | Tensor) -> None:
        """Mark blocks as free and bump their generations: older proofs over them fail."""
        self._evict(self._ids(block_ids))

    def is_resident(self, block_ids: Sequence[int] | Tensor) -> Tensor:
        """Bool tensor (on the map's device)."""
        return self._call(ops.residency_test, self.bitmap, self._ids(block_ids), self.num_blocks)

    def generation(self, block_ids: Sequence[int] | Tensor) -> Tensor:
        """int64 tensor of the blocks' generations."""
        ids = self._ids(block_ids)
        _check_range(ids, self.num_blocks)
        return self.generations.index_select(0, ids)

    def count(self) -> int:
        """How many blocks are resident."""
        return int(ops.residency_count(self.bitmap))

    def longest_prefix(self, block_ids: Sequence[int] | Tensor) -> int:
        """Length of the leading resident run of an ordered chain of block ids."""
        return int(
            self._call(ops.residency_prefix, self.bitmap, self._ids(block_ids), self.num_blocks)
        )

    def validate(
        self, block_ids: Sequence[int] | Tensor, generations: Sequence[int] | Tensor
    ) -> bool:
        """Whether every block is still resident with the given generation."""
        ids = self._ids(block_ids)
        expected = _id_tensor(generations, "generations", None).to(self.device)
        if expected.shape != ids.shape:
            raise InvalidArgument(
                f"generations has {expected.numel()} entries for {ids.numel()} block ids"
            )
        ok = self._call(ops.residency_validate, self.bitmap, self.generations, ids, expected)
        return bool(ok.all())

    def snapshot(self) -> ResidencySnapshot:
        """A host view of the current state (asynchronous on CUDA: see ResidencySnapshot)."""
        if self.device.type == "cpu":
            return ResidencySnapshot(
                self.num_blocks, self.bitmap.clone(), self.generations.clone(), None
            )
        bitmap = torch.empty(self.bitmap.shape, dtype=torch.int32, pin_memory=True)
        gens = torch.empty(self.generations.shape, dtype=torch.int64, pin_memory=True)
        bitmap.copy_(self.bitmap, non_blocking=True)
        gens.copy_(self.generations, non_blocking=True)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return ResidencySnapshot(self.num_blocks, bitmap, gens, event)


@dataclass(frozen=True, slots=True)
class CoverageProof:
    """The blocks (and their generations) a coverage decision relied on."""

    block_ids: Tensor
    generations: Tensor

    @property
    def num_blocks(self) -> int:
        return int(self.block_ids.numel())


class BlockIndex:
    """Block hash -> block id, over a ResidencyMap: a Prefill instance's prefix cache, as seen
    from its KV events.

    Hashes are keyed by their 64-bit event id (`mmreuse.blockhash.to_event_id`; what vLLM's KV
    events carry by default), so bytes from `mmreuse.hashing` and ints from events meet. Storing a
    hash into a block that held another evicts the old content first (its generation changes).
    Implements `mmreuse.kvview.KVView` (`match_prefix`).
    """

    def __init__(self, num_blocks: int, device: str | torch.device = "cpu") -> None:
        self.residency = ResidencyMap(num_blocks, device)
        self._block_of: dict[BlockHashKey, int] = {}  # hash -> the block lookups use
        self._hash_in: list[BlockHashKey | None] = [None] * num_blocks  # block -> its hash
        self._holders: dict[BlockHashKey, set[int]] = {}  # hashes held by > 1 block
        # `_block_of` mirrored in a table that lookup_prefix walks in C.
        self._table = HashTable()

    def _sync_table(self, keys: list[BlockHashKey]) -> None:
        """Make the table agree with `_block_of` on `keys`, in two C calls."""
        if not keys:
            return
        block_of = self._block_of
        present = [k for k in keys if k in block_of]
        if len(present) != len(keys):
            self._table.delete_many([k for k in keys if k not in block_of])
        if present:
            self._table.put_many(present, [block_of[k] for k in present])

    @property
    def num_blocks(self) -> int:
        return self.residency.num_blocks

    def __len__(self) -> int:
        """Number of distinct hashes indexed."""
        return len(self._block_of)

    def _check_blocks(self, block_ids: Sequence[int], field: str = "block_ids") -> list[int]:
        """`_check_block` for a batch (a sequence: ids pair with hashes by position): one pass
        when all are in-range ints."""
        if isinstance(block_ids, Tensor | np.ndarray):
            return _id_tensor(block_ids, field, self.num_blocks).tolist()  # refuses 2-D, floats
        if isinstance(block_ids, (str, bytes, bytearray, memoryview)) or not isinstance(
            block_ids, Sequence
        ):
            fail_type(field, "a sequence of block ids", block_ids)
        blocks = list(block_ids)
        if (
            blocks
            and all(type(b) is int for b in blocks)
            and min(blocks) >= 0
            and max(blocks) < self.residency.num_blocks
        ):
            return blocks
        return [self._check_block(b, f"{field}[{i}]") for i, b in enumerate(blocks)]

    def _check_block(self, block_id: Any, field: str = "block_id") -> int:
        if type(block_id) is int and 0 <= block_id < self.residency.num_blocks:
            return block_id  # the common case, without the checks below
        return check_int(field, block_id, 0, self.num_blocks - 1)

    def _mark_resident(self, blocks: list[int]) -> None:
        """ResidencyMap.mark_resident for ids `_check_blocks` already accepted."""
        res = self.residency
        res._mark(torch.from_numpy(np.array(blocks, dtype=np.int64)).to(res.device))

    def _evict(self, blocks: list[int]) -> None:
        """ResidencyMap.evict for ids `_check_blocks` already accepted."""
        res = self.residency
        res._evict(torch.from_numpy(np.array(blocks, dtype=np.int64)).to(res.device))

    def store(self, block_hash: ExternalBlockHash, block_id: int) -> None:
        """Block `block_id` now holds the KV of `block_hash` (vLLM's BlockStored)."""
        self._store([to_event_id(block_hash)], [self._check_block(block_id)])

    def store_many(
        self, block_hashes: Sequence[ExternalBlockHash], block_ids: Sequence[int]
    ) -> None:
        """`store` for a batch, with one residency update (blocks that held other content are
        evicted first, so their generations change)."""
        if isinstance(block_hashes, (str, bytes, bytearray, memoryview)) or not isinstance(
            block_hashes, Sequence
        ):  # they pair with block_ids by position: a set or generator has no order
            fail_type("block_hashes", "a sequence of block hashes", block_hashes)
        keys = to_event_ids(block_hashes)
        blocks = self._check_blocks(block_ids)
        if len(keys) != len(blocks):
            raise InvalidArgument(
                f"block_ids has {len(blocks)} entries for {len(keys)} block_hashes"
            )
        self._store(keys, blocks)

    def _store(self, keys: list[BlockHashKey], blocks: list[int]) -> None:
        if len(set(blocks)) != len(blocks):
            raise InvalidArgument(
                f"block_ids must be distinct within one store_many call, got {show(blocks)}"
            )
        stale = [b for b, k in zip(blocks, keys, strict=True) if self._hash_in[b] not in (None, k)]
        if stale:
            self.evict_blocks(stale)
        touched = []
        for key, block_id in zip(keys, blocks, strict=True):
            if self._hash_in[block_id] == key:
                continue
            self._hash_in[block_id] = key
            current = self._block_of.get(key)
            if current is None:
                self._block_of[key] = block_id
                touched.append(key)
            else:
                self._holders.setdefault(key, {current}).add(block_id)
        self._sync_table(touched)
        if blocks:
            self._mark_resident(blocks)

    def evict_block(self, block_id: int) -> None:
        """Block `block_id` no longer holds its KV (vLLM's BlockRemoved); its generation changes."""
        self.evict_blocks([self._check_block(block_id)])

    def evict_blocks(self, block_ids: Sequence[int]) -> None:
        """`evict_block` for a batch, with one residency update."""
        blocks = self._check_blocks(block_ids)
        if not blocks:
            return
        self._evict(blocks)
        touched = []
        for block_id in blocks:
            key = self._hash_in[block_id]
            if key is None:
                continue
            self._hash_in[block_id] = None
            holders = self._holders.get(key)
            if holders is not None:
                holders.discard(block_id)
                if self._block_of[key] == block_id:
                    self._block_of[key] = next(iter(holders))
                    touched.append(key)
                if len(holders) == 1:
                    del self._holders[key]
            elif self._block_of.get(key) == block_id:
                del self._block_of[key]
                touched.append(key)
        self._sync_table(touched)

    def clear(self) -> None:
        """Forget every block (vLLM's AllBlocksCleared); every generation changes."""
        held = [b for b, k in enumerate(self._hash_in) if k is not None]
        if held:
            self._evict(held)
        self._block_of.clear()
        self._holders.clear()
        self._hash_in = [None] * self.num_blocks
        self._table.clear()

    def block_id(self, block_hash: ExternalBlockHash) -> int | None:
        """The block holding `block_hash`, if any."""
        return self._block_of.get(to_event_id(block_hash))

    def block_of_event_id(self, key: EventBlockId) -> int | None:
        """The block holding the hash whose event id is `key`, if any: `block_id` for a value
        already converted by `mmreuse.blockhash.to_event_id`, so not checked again (for hot
        loops; any other value finds nothing)."""
        return self._block_of.get(key)

    def counts(self) -> dict[EventBlockId, int]:
        """Every event id held and how many blocks hold it (a new dict: a KV snapshot's)."""
        counts = dict.fromkeys(self._block_of, 1)
        for h, blocks in self._holders.items():
            counts[h] = len(blocks)
        return counts

    def maps(self) -> tuple[Mapping[EventBlockId, int], Sequence[EventBlockId | None]]:
        """The live event id -> block and block -> event id maps, read-only (not copies: for
        loops that read them per block, where `block_id` / `hash_of` calls cost ~5 %)."""
        return self._block_of, self._hash_in

    def hash_of(self, block_id: int) -> EventBlockId | None:
        """The event id of the hash block `block_id` holds, None when it holds none."""
        if type(block_id) is int and 0 <= block_id < self.residency.num_blocks:
            return self._hash_in[block_id]  # the common case, inlined (hot in the simulator)
        return self._hash_in[self._check_block(block_id)]

    def lookup_prefix(self, block_hashes: Sequence[ExternalBlockHash]) -> tuple[int, CoverageProof]:
        """The leading run of `block_hashes` present and resident, with its proof. Every hash
        is validated (`to_event_id`'s rule), those after the first miss too."""
        if isinstance(block_hashes, (str, bytes, bytearray)) or not isinstance(
            block_hashes, Sequence
        ):
            fail_type("block_hashes", "a sequence of block hashes", block_hashes)
        keys = block_hashes if isinstance(block_hashes, (list, tuple)) else list(block_hashes)
        # the block ids land straight in the proof's tensor (no copy)
        out = torch.empty(len(keys), dtype=torch.int64)
        found, _ = self._table.prefix(keys, out.numpy())
        res = self.residency
        ids = out[:found].to(res.device)
        hit = int(ops.residency_prefix(res.bitmap, ids, res.num_blocks))
        ids = ids[:hit]
        return hit, CoverageProof(ids, res.generations.index_select(0, ids))

    def match_prefix(self, block_hashes: Sequence[ExternalBlockHash]) -> PrefixMatch:
        """`KVView.match_prefix`: `lookup_prefix`'s hit, with its CoverageProof as the proof."""
        hit, proof = self.lookup_prefix(block_hashes)
        return PrefixMatch(hit, proof)

    def validate(self, proof: CoverageProof) -> bool:
        """Whether every block of `proof` still holds the same content (resident, same generation)."""
        if not isinstance(proof, CoverageProof):
            fail_type("proof", "a CoverageProof", proof)
        return self.residency.validate(proof.block_ids, proof.generations)
