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

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from . import ops
from ._table import HashTable
from .blockhash import EventBlockId, ExternalBlockHash, to_event_id, to_event_ids
from .kvview import PrefixMatch
from .validate import check_int, fail_type

BlockHashKey = EventBlockId  # the 64-bit event id form; bytes are converted with to_event_id


def _check_num_blocks(num_blocks: Any) -> int:
    return check_int("num_blocks", num_blocks, lo=1)


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
        ids = np.asarray(block_ids, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= self.num_blocks):
            bad = int(ids[(ids < 0) | (ids >= self.num_blocks)][0])
            raise ValueError(f"block id {bad} is out of range [0, {self.num_blocks})")
        words = self.bitmap.numpy().view(np.uint32)
        return ((words[ids >> 5] >> (ids & 31).astype(np.uint32)) & 1).astype(bool)


class ResidencyMap:
    """Residency bits and generations of `num_blocks` KV blocks on `device`."""

    def __init__(self, num_blocks: int, device: str | torch.device = "cpu") -> None:
        self.num_blocks = _check_num_blocks(num_blocks)
        self.device = torch.device(device)
        if self.device.type not in ("cpu", "cuda"):
            raise ValueError(f"device must be cpu or cuda, got {device!r}")
        self.bitmap = torch.zeros((num_blocks + 31) // 32, dtype=torch.int32, device=self.device)
        self.generations = torch.zeros(num_blocks, dtype=torch.int64, device=self.device)

    def _ids(self, block_ids: Iterable[int] | Tensor) -> Tensor:
        if isinstance(block_ids, Tensor):
            if block_ids.dtype.is_floating_point or block_ids.dtype == torch.bool:
                raise ValueError(f"block_ids must be integers, got dtype {block_ids.dtype}")
            return block_ids.reshape(-1).to(device=self.device, dtype=torch.int64)
        if isinstance(block_ids, (str, bytes)):
            raise ValueError(f"block_ids must be ints, got {block_ids!r}")
        ids = np.asarray(list(block_ids) if not isinstance(block_ids, np.ndarray) else block_ids)
        if ids.size and ids.dtype.kind not in "iu":
            raise ValueError(f"block_ids must be ints, got {ids.dtype} values")
        return torch.from_numpy(ids.astype(np.int64, copy=False).reshape(-1)).to(self.device)

    def _call(self, fn, *args):
        try:
            return fn(*args)
        except IndexError as exc:  # the op's bounds error, named for the caller
            raise ValueError(str(exc).splitlines()[0]) from None

    def mark_resident(self, block_ids: Iterable[int] | Tensor) -> None:
        """Mark blocks as holding valid KV (after the work that wrote or loaded it)."""
        self._call(ops.residency_mark, self.bitmap, self._ids(block_ids), self.num_blocks)

    def evict(self, block_ids: Iterable[int] | Tensor) -> None:
        """Mark blocks as free and bump their generations: older proofs over them fail."""
        self._call(ops.residency_evict, self.bitmap, self.generations, self._ids(block_ids))

    def is_resident(self, block_ids: Iterable[int] | Tensor) -> Tensor:
        """Bool tensor (on the map's device)."""
        return self._call(ops.residency_test, self.bitmap, self._ids(block_ids), self.num_blocks)

    def generation(self, block_ids: Iterable[int] | Tensor) -> Tensor:
        """int64 tensor of the blocks' generations."""
        ids = self._ids(block_ids)
        if ids.numel():
            lo, hi = int(ids.min()), int(ids.max())
            if lo < 0 or hi >= self.num_blocks:
                bad = lo if lo < 0 else hi
                raise ValueError(f"block id {bad} is out of range [0, {self.num_blocks})")
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
        expected = self._ids(generations)
        if expected.shape != ids.shape:
            raise ValueError(
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

    def _check_blocks(self, block_ids: Sequence[int]) -> list[int]:
        """`_check_block` for a batch: one pass when all are in-range ints."""
        blocks = list(block_ids)
        if (
            blocks
            and all(type(b) is int for b in blocks)
            and min(blocks) >= 0
            and max(blocks) < self.residency.num_blocks
        ):
            return blocks
        return [self._check_block(b) for b in blocks]

    def _check_block(self, block_id: Any) -> int:
        if type(block_id) is int and 0 <= block_id < self.residency.num_blocks:
            return block_id  # the common case, without the checks below
        return check_int("block_id", block_id, 0, self.num_blocks - 1)

    def store(self, block_hash: ExternalBlockHash, block_id: int) -> None:
        """Block `block_id` now holds the KV of `block_hash` (vLLM's BlockStored)."""
        self._store([to_event_id(block_hash)], [self._check_block(block_id)])

    def store_many(
        self, block_hashes: Sequence[ExternalBlockHash], block_ids: Sequence[int]
    ) -> None:
        """`store` for a batch, with one residency update (blocks that held other content are
        evicted first, so their generations change)."""
        keys = to_event_ids(block_hashes)
        blocks = self._check_blocks(block_ids)
        if len(keys) != len(blocks):
            raise ValueError(f"{len(keys)} block_hashes for {len(blocks)} block_ids")
        self._store(keys, blocks)

    def _store(self, keys: list[BlockHashKey], blocks: list[int]) -> None:
        if len(set(blocks)) != len(blocks):
            raise ValueError("block_ids must be distinct within one store_many call")
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
            self.residency.mark_resident(blocks)

    def evict_block(self, block_id: int) -> None:
        """Block `block_id` no longer holds its KV (vLLM's BlockRemoved); its generation changes."""
        self.evict_blocks([block_id])

    def evict_blocks(self, block_ids: Sequence[int]) -> None:
        """`evict_block` for a batch, with one residency update."""
        blocks = self._check_blocks(block_ids)
        if not blocks:
            return
        self.residency.evict(blocks)
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
            self.residency.evict(held)
        self._block_of.clear()
        self._holders.clear()
        self._hash_in = [None] * self.num_blocks
        self._table.clear()

    def block_id(self, block_hash: ExternalBlockHash) -> int | None:
        """The block holding `block_hash`, if any."""
        return self._block_of.get(to_event_id(block_hash))

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
            raise ValueError(f"proof must be a CoverageProof, got {type(proof).__name__}")
        return self.residency.validate(proof.block_ids, proof.generations)
