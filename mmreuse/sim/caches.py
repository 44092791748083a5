"""The simulator's caches: P's KV prefix cache, P's encoder cache, E's cache and the external store.

Each reports its changes through an `on_change` callback (what P's KV events, P's encoder-cache
deltas and the stores' deltas would publish), which the `index` policy's lagging view follows.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

import cachetools

from ..blockhash import EventBlockId, ExternalBlockHash, to_event_ids
from ..demand import EncoderCacheSpace
from ..kvview import PrefixMatch
from ..residency import BlockIndex

KVChange = Callable[[list[EventBlockId], list[EventBlockId]], None]  # (stored, removed)


class PrefixCache:
    """P's KV blocks, vLLM-like, over one `BlockIndex` (the only hash <-> block map): blocks a
    running request holds are referenced; freed blocks join an LRU queue (a request's blocks in
    reverse order, so leaves go before their parents) and are evicted from its head when a new
    block is needed. A hash already indexed stays with its first block; the duplicate block
    holds no content."""

    def __init__(self, num_blocks: int, on_change: KVChange):
        self.index = BlockIndex(num_blocks)
        self._never_used = list(range(num_blocks - 1, -1, -1))
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._refs = [0] * num_blocks
        self._on_change = on_change

    def match_prefix(self, block_hashes: Sequence[ExternalBlockHash]) -> PrefixMatch:
        """Leading blocks held (vLLM's find_longest_cache_hit, before the N-1 cap), with the
        `CoverageProof` naming them (None for an empty request): a `mmreuse.kvview.KVView`."""
        if not block_hashes:
            return PrefixMatch(0, None)
        num_blocks, proof = self.index.lookup_prefix(block_hashes)
        return PrefixMatch(num_blocks, proof)

    def admit(
        self, block_hashes: Sequence[bytes], num_hit: int, hit_blocks: list[int]
    ) -> list[int] | None:
        """Reference the `num_hit` cached blocks `hit_blocks` and cache the rest of
        `block_hashes`; returns every block the request holds, or None if P has no room."""
        num_new = len(block_hashes) - num_hit
        room = len(self._never_used) + len(self._evictable)
        refs, evictable, never_used = self._refs, self._evictable, self._never_used
        if num_new > room - sum(1 for b in hit_blocks if refs[b] == 0):  # those leave the queue
            return None
        for b in hit_blocks:
            refs[b] += 1
            evictable.pop(b, None)
        block_of, hash_in = self.index.maps()
        # New blocks come from the never-used pool first (last in, first out), then from the
        # head of the LRU queue; this admission's changes reach the index in two batched calls.
        keys = to_event_ids(block_hashes[num_hit:])  # in one C call
        fresh = min(len(keys), len(never_used))
        new_blocks = never_used[len(never_used) - fresh :][::-1]  # as pop() would take them
        del never_used[len(never_used) - fresh :]
        evicted = [evictable.popitem(last=False)[0] for _ in range(len(keys) - fresh)]
        new_blocks += evicted
        removed: list[EventBlockId] = [hash_in[b] for b in evicted]  # type: ignore[misc]
        assert None not in removed  # an evictable block always holds content
        removed_at: dict[EventBlockId, int] = {}  # an old hash -> the new block that evicted it
        for j, old in enumerate(removed, fresh):
            removed_at.setdefault(old, j)
        stored: dict[EventBlockId, None] = {}
        stored_blocks: list[int] = []
        for i, key in enumerate(keys):
            if key in stored:
                continue
            if key in block_of:  # still indexed unless a block up to this one evicted it
                at = removed_at.get(key)
                if at is None or at > i:
                    continue
            stored[key] = None  # an evicted hash can be re-stored into a fresh block here
            stored_blocks.append(new_blocks[i])
        for b in new_blocks:
            refs[b] += 1
        blocks = [*hit_blocks, *new_blocks]
        if evicted:
            self.index.evict_blocks(evicted)
        if stored:
            self.index.store_many(list(stored), stored_blocks)  # event ids are block hashes too
        if stored or removed:
            self._on_change(list(stored), removed)
        return blocks

    def release(self, blocks: list[int]) -> None:
        """Drop a finished request's references; unreferenced blocks with content become
        evictable (leaves first), empty ones go back to the never-used pool."""
        refs, hash_in = self._refs, self.index.maps()[1]
        for b in reversed(blocks):
            refs[b] -= 1
            if refs[b] == 0:
                if hash_in[b] is None:
                    self._never_used.append(b)
                else:
                    self._evictable[b] = None


class EncoderCache:
    """P's EncoderCacheManager: capacity in embeddings; referenced entries stay; unreferenced
    ones stay too (freeable) until room is needed, oldest first."""

    def __init__(self, capacity: int, on_change: Callable[[dict[str, int], list[str]], None]):
        self.capacity = capacity
        self.entries: dict[str, int] = {}  # identifier -> num_embeds
        self.refs: dict[str, int] = {}
        self.freeable: OrderedDict[str, None] = OrderedDict()
        self.used = 0
        self._on_change = on_change  # (added, removed) -> None

    def acquire(self, ident: str, num_embeds: int) -> bool:
        """Reference `ident` (allocating `num_embeds` slots if absent); False if it cannot fit."""
        if ident in self.entries:
            self.refs[ident] = self.refs.get(ident, 0) + 1
            self.freeable.pop(ident, None)
            return True
        if num_embeds > self.capacity:
            return False
        removed = []
        while self.used + num_embeds > self.capacity and self.freeable:
            old, _ = self.freeable.popitem(last=False)
            self.used -= self.entries.pop(old)
            self.refs.pop(old, None)
            removed.append(old)
        if self.used + num_embeds > self.capacity:
            if removed:
                self._on_change({}, removed)
            return False
        self.entries[ident] = num_embeds
        self.refs[ident] = 1
        self.used += num_embeds
        self._on_change({ident: num_embeds}, removed)
        return True

    def space(self) -> EncoderCacheSpace:
        """Its free slots and freeable entries, oldest first: what rule S reads."""
        return EncoderCacheSpace(
            self.capacity - self.used, tuple((i, self.entries[i]) for i in self.freeable)
        )

    def release(self, ident: str) -> None:
        """Drop one reference; the last one leaves the entry freeable (still reusable)."""
        if ident in self.refs:
            self.refs[ident] -= 1
            if self.refs[ident] == 0:
                del self.refs[ident]
                self.freeable[ident] = None


class EmbeddingLRU(cachetools.LRUCache):
    """E's cache or the external store: LRU, capacity in embeddings (0 disables it), reporting
    additions and evictions."""

    def __init__(self, capacity: int, on_change: Callable[[list[str], list[str]], None]):
        super().__init__(maxsize=max(capacity, 1), getsizeof=lambda n: n)
        self.enabled = capacity > 0
        self._on_change = on_change  # (added, removed) -> None

    def popitem(self):
        key, value = super().popitem()
        self._on_change([], [key])
        return key, value

    def put(self, ident: str, num_embeds: int) -> None:
        """Store an embedding just computed (a no-op if present, disabled or too big)."""
        if self.enabled and num_embeds <= self.maxsize and ident not in self:
            self[ident] = num_embeds
            self._on_change([ident], [])

    def holds(self, ident: str) -> bool:
        """Presence, without touching recency (what a has_cache_item probe sees)."""
        return self.enabled and ident in self

    def hit(self, ident: str) -> bool:
        """A read: True if held, and it becomes the most recently used."""
        return self.enabled and self.get(ident) is not None
