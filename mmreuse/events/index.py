"""RemoteKVIndex: one vLLM instance's resident block hashes, per medium, fed by its KV events."""

from __future__ import annotations

import threading
from collections.abc import Sequence

from .._table import HashTable
from ..blockhash import ExternalBlockHash, to_event_id, to_event_ids
from ..kvview import PrefixMatch
from ..validate import check_str, fail_type
from .wire import MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch


class RemoteKVIndex:
    """The block hashes an instance holds, as its KV events tell (per medium: GPU, CPU, ...).

    Hashes are keyed by their 64-bit event id (`mmreuse.blockhash.to_event_id`'s rule, applied
    in C): ints from events as they are, digest bytes (from events with
    VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0, or from `mmreuse.hashing`) by their low 64 bits,
    big-endian. A hash stored by several blocks is counted once per block, so it stays until its
    last BlockRemoved. Thread-safe: a subscriber thread applies while others read.

    Caveat: with vLLM's per-request `kv_cache_report_mode="full"`, reused prefix blocks are
    re-announced with BlockStored but never removed twice; such counts only ever over-report,
    which P's consume-time validation catches (a late fallback, never a wrong skip).

    Implements `mmreuse.kvview.KVView` (`match_prefix`, on the GPU medium).
    """

    def __init__(self, instance: str = "default") -> None:
        self.instance = check_str("instance", instance, nonempty=True)
        self._media: dict[str, HashTable] = {}
        self._lock = threading.Lock()

    def _table(self, medium: str | None) -> HashTable:
        key = MEDIUM_GPU if medium is None else medium
        table = self._media.get(key)
        if table is None:
            table = self._media[key] = HashTable()
        return table

    def apply(self, batch: KVEventBatch) -> int:
        """Apply a decoded batch, whole or not at all; returns the number of events applied.

        Raises InvalidArgument (a ValueError; InvalidArgumentType for a wrong type) and changes
        nothing if any hash is not bytes >= 8 long or an int in [0, 2**64) (negative ints too).
        """
        if not isinstance(batch, KVEventBatch):
            fail_type("batch", "a KVEventBatch", batch)
        events = batch.events
        with self._lock:
            probe = HashTable(1)
            for e in events:  # validate every hash before changing anything
                if isinstance(e, (BlockStored, BlockRemoved)):
                    probe.add(e.block_hashes, 0)
            for e in events:
                if isinstance(e, BlockStored):
                    self._table(e.medium).add(e.block_hashes, 1)
                elif isinstance(e, BlockRemoved):
                    table = self._media.get(MEDIUM_GPU if e.medium is None else e.medium)
                    if table is not None:
                        table.add(e.block_hashes, -1)
                elif isinstance(e, AllBlocksCleared):
                    self._media.clear()
        return len(events)

    @staticmethod
    def _hash_list(block_hashes: Sequence[ExternalBlockHash]) -> Sequence[ExternalBlockHash]:
        if isinstance(block_hashes, (str, bytes, bytearray)) or not isinstance(
            block_hashes, Sequence
        ):
            fail_type("block_hashes", "a sequence of block hashes", block_hashes)
        return block_hashes if isinstance(block_hashes, (list, tuple)) else list(block_hashes)

    def longest_prefix(
        self, block_hashes: Sequence[ExternalBlockHash], medium: str = MEDIUM_GPU
    ) -> int:
        """How many leading hashes of a request are held (what vLLM's prefix cache would hit,
        up to the events not received yet, before its num_tokens-1 cap: see kv_coverage).
        Every hash is validated, those after the first miss too."""
        hashes = self._hash_list(block_hashes)
        check_str("medium", medium)
        with self._lock:
            table = self._media.get(medium)
            if table is not None:
                return table.prefix(hashes)[0]
        to_event_ids(hashes)  # nothing held there: still validate
        return 0

    def match_prefix(self, block_hashes: Sequence[ExternalBlockHash]) -> PrefixMatch:
        """`KVView.match_prefix`: `longest_prefix` on the GPU medium; no proof (events carry
        hashes, not block generations)."""
        return PrefixMatch(self.longest_prefix(block_hashes, MEDIUM_GPU))

    def contains(self, block_hash: ExternalBlockHash, medium: str = MEDIUM_GPU) -> bool:
        check_str("medium", medium)
        with self._lock:
            table = self._media.get(medium)
            if table is not None:
                return table.get(block_hash) is not None
        to_event_id(block_hash)  # nothing held there: still validate
        return False

    def size(self, medium: str = MEDIUM_GPU) -> int:
        """Distinct hashes held on `medium`."""
        with self._lock:
            table = self._media.get(medium)
            return 0 if table is None else table.live

    def media(self) -> tuple[str, ...]:
        with self._lock:
            return tuple(sorted(m for m, t in self._media.items() if t.live))

    def clear(self) -> None:
        """Forget everything (AllBlocksCleared, a publisher restart, an unrecoverable gap)."""
        with self._lock:
            self._media.clear()
