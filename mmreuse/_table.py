"""A uint64 -> int64 open-addressing hash table in two numpy arrays, walked by C helpers.

Keys are 64-bit event ids, made from block hashes by `mmreuse.blockhash`'s rule (the C side,
`mmreuse._index`, applies the same rule and raises the same `mmreuse.errors` classes).
BlockIndex stores block ids in it, RemoteKVIndex reference counts. No torch here: the
extension is plain CPython, so `mmreuse.events` imports without libtorch.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ._index import chain_prefix, table_add, table_del_many, table_get, table_put_many, table_rehash
from .blockhash import EventBlockId, ExternalBlockHash

__all__ = ["HashTable"]


class HashTable:
    """Grows at half load; deletions leave tombstones, cleared by the next rehash."""

    __slots__ = ("_buf", "keys", "live", "used", "vals")

    def __init__(self, capacity: int = 64) -> None:
        self.keys, self.vals = self._arrays(capacity)
        self.used = 0  # live + tombstone slots
        self.live = 0
        self._buf = np.empty(0, dtype=np.int64)

    @staticmethod
    def _arrays(capacity: int) -> tuple[np.ndarray, np.ndarray]:
        cap = 64
        while cap < capacity:
            cap *= 2
        return np.zeros(cap, dtype=np.uint64), np.full(cap, -1, dtype=np.int64)

    def _reserve(self, extra: int) -> None:
        if 2 * (self.used + extra) > self.keys.size:
            keys, vals = self._arrays(4 * (self.live + extra))
            self.live = table_rehash(self.keys, self.vals, keys, vals)
            self.keys, self.vals, self.used = keys, vals, self.live

    def put_many(self, keys: list[EventBlockId], values: list[int]) -> None:
        """Set keys[i] -> values[i] (values >= 0) for a batch, in one call."""
        self._reserve(len(keys))
        inserted = table_put_many(self.keys, self.vals, keys, values)
        self.used += inserted  # may reuse a tombstone: over-counting only rehashes earlier
        self.live += inserted

    def delete_many(self, keys: list[EventBlockId]) -> None:
        self.live -= table_del_many(self.keys, self.vals, keys)

    def add(self, hashes: Sequence[ExternalBlockHash], delta: int) -> int:
        """Add `delta` to each hash's count (validating all first); returns entries removed."""
        if delta > 0:
            self._reserve(len(hashes))
        new_slots, added, removed = table_add(self.keys, self.vals, hashes, delta)
        self.used += new_slots
        self.live += added - removed
        return removed

    def get(self, h: ExternalBlockHash) -> int | None:
        return table_get(self.keys, self.vals, h)

    def prefix(
        self, hashes: Sequence[ExternalBlockHash], out: np.ndarray | None = None
    ) -> tuple[int, np.ndarray]:
        """How many leading hashes are present (every hash is validated), and a buffer holding
        their values (`out`, an int64 array of len(hashes) or more, or an internal scratch
        buffer)."""
        if out is None:
            n = len(hashes)
            if self._buf.size < n:
                self._buf = np.empty(max(n, 2 * self._buf.size), dtype=np.int64)
            out = self._buf
        return chain_prefix(self.keys, self.vals, hashes, out), out

    def clear(self) -> None:
        self.keys, self.vals = self._arrays(64)
        self.used = self.live = 0
