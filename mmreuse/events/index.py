"""RemoteKVIndex: one vLLM instance's resident block hashes, per medium, fed by its KV events."""

from __future__ import annotations

import threading
from collections.abc import Sequence

from .._table import HashTable
from .wire import MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch


class RemoteKVIndex:
    """The block hashes an instance holds, as its KV events tell (per medium: GPU, CPU, ...).

    Hashes are keyed by their 64-bit event id: ints from events as they are, digest bytes (from
    events with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0, or from `mmreuse.hashing`) by their low 64
    bits, big-endian. A hash stored by several blocks is counted once per block, so it stays
    until its last BlockRemoved. Thread-safe: a subscriber thread applies while others read.

    Caveat: with vLLM's per-request `kv_cache_report_mode="full"`, reused prefix blocks are
    re-announced with BlockStored but never removed twice; such counts only ever over-report,
    which P's consume-time validation catches (a late fallback, never a wrong skip).
    """

    def __init__(self, instance: str = "default") -> None:
        if not isinstance(instance, str) or not instance:
            raise ValueError(f"instance must be a non-empty str, got {instance!r}")
        self.instance = instance
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

        Raises ValueError (and changes nothing) if any hash is not bytes >= 8 long or an int in
        [0, 2**64).
        """
        if not isinstance(batch, KVEventBatch):
            raise ValueError(f"batch must be a KVEventBatch, got {type(batch).__name__}")
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

    def longest_prefix(self, block_hashes: Sequence[bytes | int], medium: str = MEDIUM_GPU) -> int:
        """How many leading hashes of a request are held (what vLLM's prefix cache would hit,
        up to the events not received yet, before its num_tokens-1 cap: see kv_coverage)."""
        if isinstance(block_hashes, (str, bytes)) or not isinstance(block_hashes, Sequence):
            raise ValueError(f"block_hashes must be a sequence of hashes, got {block_hashes!r}")
        hashes = block_hashes if isinstance(block_hashes, (list, tuple)) else list(block_hashes)
        with self._lock:
            table = self._media.get(medium)
            if table is None:
                HashTable(1).prefix(hashes[:1])  # still validate
                return 0
            return table.prefix(hashes)[0]

    def contains(self, block_hash: bytes | int, medium: str = MEDIUM_GPU) -> bool:
        with self._lock:
            table = self._media.get(medium)
            if table is None:
                HashTable(1).get(block_hash)  # validates
                return False
            return table.get(block_hash) is not None

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
