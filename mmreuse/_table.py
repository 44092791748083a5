"""A uint64 -> int64 open-addressing hash table in two numpy arrays, walked by C helpers.

Keys are 64-bit event ids; bytes hashes are keyed by their low 64 bits (big-endian), as vLLM's
KV events publish them. BlockIndex stores block ids in it, RemoteKVIndex reference counts.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch  # noqa: F401  (loads libtorch, which the _C extension links against)

from ._C import (
    chain_prefix,
    table_add,
    table_del,
    table_del_many,
    table_get,
    table_put,
    table_put_many,
    table_rehash,
)


class HashTable:
    """Grows at half load; deletions leave tombstones, cleared by the next rehash."""

    __slots__ = ("keys", "vals", "used", "live", "_buf")

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

    def put(self, key: int, value: int) -> None:
        """Set key -> value (value >= 0)."""
        if 2 * (self.used + 1) > self.keys.size:
            self._reserve(1)
        if table_put(self.keys, self.vals, key, value):
            self.used += 1  # may reuse a tombstone: over-counting only rehashes earlier
            self.live += 1

    def put_many(self, keys: list[int], values: list[int]) -> None:
        """`put` for a batch, in one call."""
        if 2 * (self.used + len(keys)) > self.keys.size:
            self._reserve(len(keys))
        inserted = table_put_many(self.keys, self.vals, keys, values)
        self.used += inserted
        self.live += inserted

    def delete_many(self, keys: list[int]) -> None:
        self.live -= table_del_many(self.keys, self.vals, keys)

    def delete(self, key: int) -> None:
        if table_del(self.keys, self.vals, key):
            self.live -= 1

    def add(self, hashes: Sequence[bytes | int], delta: int) -> int:
        """Add `delta` to each hash's count (validating all first); returns entries removed."""
        if delta > 0:
            self._reserve(len(hashes))
        new_slots, added, removed = table_add(self.keys, self.vals, hashes, delta)
        self.used += new_slots
        self.live += added - removed
        return removed

    def get(self, h: bytes | int) -> int | None:
        return table_get(self.keys, self.vals, h)

    def prefix(self, hashes: Sequence[bytes | int], out: np.ndarray | None = None) -> tuple[int, np.ndarray]:
        """How many leading hashes are present, and a buffer holding their values (`out`, an
        int64 array of len(hashes) or more, or an internal scratch buffer)."""
        if out is None:
            n = len(hashes)
            if self._buf.size < n:
                self._buf = np.empty(max(n, 2 * self._buf.size), dtype=np.int64)
            out = self._buf
        return chain_prefix(self.keys, self.vals, hashes, out), out

    def clear(self) -> None:
        self.keys, self.vals = self._arrays(64)
        self.used = self.live = 0
