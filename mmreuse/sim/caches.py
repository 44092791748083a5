"""The simulator's caches: P's KV prefix cache, P's encoder cache, E's and the external store."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

import cachetools

from ..residency import BlockIndex


class PrefixCache:
    """P's KV blocks, vLLM-like: hash -> block through a BlockIndex; blocks a running request
    holds are referenced; freed blocks join an LRU queue (a request's blocks in reverse order, so
    leaves go before their parents) and are evicted from its head when a new block is needed."""

    def __init__(self, num_blocks: int, on_change: Callable[[list[bytes], list[bytes]], None]):
        self.index = BlockIndex(num_blocks)
        self.num_blocks = num_blocks
        self._never_used = list(range(num_blocks - 1, -1, -1))
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._refs = [0] * num_blocks
        self._hash_of: list[bytes | None] = [None] * num_blocks
        self._block_of: dict[bytes, int] = {}  # what the index maps (a duplicate hash stays out)
        self._on_change = on_change  # (stored hashes, removed hashes) -> None

    def hit(self, hashes: Sequence[bytes]) -> tuple[int, list[int]]:
        """Leading blocks held (vLLM's find_longest_cache_hit, before the N-1 cap), and their ids."""
        if not hashes:
            return 0, []
        k, proof = self.index.lookup_prefix(hashes)
        return k, proof.block_ids.tolist()

    def admit(self, hashes: Sequence[bytes], hit: int, held: list[int]) -> list[int] | None:
        """Reference the `hit` cached blocks `held` and cache the rest; None if P has no room."""
        need = len(hashes) - hit
        room = len(self._never_used) + len(self._evictable)
        if need > room - sum(1 for b in held if self._refs[b] == 0):  # held ones leave the queue
            return None
        refs, evictable, never_used = self._refs, self._evictable, self._never_used
        hash_of, block_of = self._hash_of, self._block_of
        for b in held:
            refs[b] += 1
            evictable.pop(b, None)
        removed, evicted, new_hashes, new_blocks = [], [], [], []
        blocks = list(held)
        for h in hashes[hit:]:
            if never_used:
                b = never_used.pop()
            else:
                b, _ = evictable.popitem(last=False)
                old = hash_of[b]
                if old is not None:
                    evicted.append(b)
                    removed.append(old)
                    del block_of[old]
            if h not in block_of:  # a duplicate hash stays with its first block
                block_of[h] = b
                new_hashes.append(h)
                new_blocks.append(b)
                hash_of[b] = h
            else:
                hash_of[b] = None
            refs[b] += 1
            blocks.append(b)
        if evicted:
            self.index.evict_blocks(evicted)
        # an evicted hash can be re-stored into a fresh block in the same admission
        if new_hashes:
            self.index.store_many(new_hashes, new_blocks)
        if new_hashes or removed:
            self._on_change(new_hashes, removed)
        return blocks

    def release(self, blocks: list[int]) -> None:
        refs, hash_of = self._refs, self._hash_of
        for b in reversed(blocks):
            refs[b] -= 1
            if refs[b] == 0:
                if hash_of[b] is None:
                    self._never_used.append(b)
                else:
                    self._evictable[b] = None


class EncoderCache:
    """P's EncoderCacheManager: capacity in embeddings; referenced entries stay; unreferenced
    ones stay too (freeable) until room is needed, oldest first."""

    def __init__(self, capacity: int, on_change: Callable[[dict[str, int], list[str]], None]):
        self.capacity = capacity
        self.entries: dict[str, int] = {}
        self.refs: dict[str, int] = {}
        self.freeable: OrderedDict[str, None] = OrderedDict()
        self.used = 0
        self._on_change = on_change  # (added, removed) -> None

    def acquire(self, ident: str, n: int) -> bool:
        """Reference `ident` (allocating n slots if absent); False if it cannot fit."""
        if ident in self.entries:
            self.refs[ident] = self.refs.get(ident, 0) + 1
            self.freeable.pop(ident, None)
            return True
        if n > self.capacity:
            return False
        removed = []
        while self.used + n > self.capacity and self.freeable:
            old, _ = self.freeable.popitem(last=False)
            self.used -= self.entries.pop(old)
            self.refs.pop(old, None)
            removed.append(old)
        if self.used + n > self.capacity:
            if removed:
                self._on_change({}, removed)
            return False
        self.entries[ident] = n
        self.refs[ident] = 1
        self.used += n
        self._on_change({ident: n}, removed)
        return True

    def release(self, ident: str) -> None:
        if ident in self.refs:
            self.refs[ident] -= 1
            if self.refs[ident] == 0:
                del self.refs[ident]
                self.freeable[ident] = None


class EmbeddingStore:
    """E's encoder cache or an external embedding store: LRU, capacity in embeddings."""

    def __init__(self, capacity: int):
        self.enabled = capacity > 0
        self.cache: cachetools.LRUCache = cachetools.LRUCache(
            maxsize=max(capacity, 1), getsizeof=lambda n: n)

    def has(self, ident: str) -> bool:
        return self.enabled and ident in self.cache

    def get(self, ident: str) -> bool:
        """A read that refreshes recency."""
        return self.enabled and self.cache.get(ident) is not None

    def put(self, ident: str, n: int) -> None:
        if self.enabled and n <= self.cache.maxsize:
            self.cache[ident] = n
