"""The mm identifiers KV blocks carry, followed in one place: how a published block's extra keys
name them (`entry_identifiers`, which `RemoteKVIndex` follows per medium on the proxy's side),
P's own follower of the blocks it publishes (`PublishedIdentifiers`, so that P's KV snapshot
can carry them), and a snapshot chunk's identifiers on the wire (`identifier_chunk` cuts one
within the wire's bounds, `chunk_identifiers` reads one back). vLLM-free, so tested and
measured without vLLM.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ..blockhash import to_event_ids
from ..demand_query import (
    MAX_IDENT_CHARS,
    MAX_SNAPSHOT_IDENT_BYTES,
    MAX_SNAPSHOT_IDENT_REFS,
    MAX_SNAPSHOT_IDENTS,
    MAX_SNAPSHOT_IDENTS_PER_BLOCK,
    KVSnapshot,
)
from ..validate import check_int
from .wire import MEDIUM_GPU

logger = logging.getLogger("mmreuse.events.snapshot")


def entry_identifiers(entry: list[Any] | tuple[Any, ...]) -> tuple[tuple[str, ...], int] | None:
    """The distinct identifiers of one block's extra keys, in order (vLLM 0.33.0's untagged
    items: an mm key `(identifier, offset)`; LoRA names, salts, digests ignored) and how many
    were over MAX_IDENT_CHARS (not followed); None if malformed. Linear in the entry."""
    idents: dict[str, None] = {}
    long = 0
    for k in entry:
        kind = type(k)
        if kind is list or kind is tuple:  # an mm key, (identifier, offset)
            if len(k) != 2:
                return None
            ident, off = k
            if type(ident) is not str or type(off) is not int or not ident:
                return None
            if len(ident) > MAX_IDENT_CHARS:
                long += 1
            else:
                idents[ident] = None
        elif kind is not str and kind is not bytes:  # not a LoRA name, salt, digest
            return None
    return tuple(idents), long


def chunk_identifiers(chunk: KVSnapshot) -> dict[int, tuple[str, ...]]:
    """A KVSnapshot chunk's identifiers, per block id (the chunk as `decode_answer` checked it:
    every index in range)."""
    table, named = chunk.identifiers, chunk.block_ids
    return {named[block]: tuple([table[r] for r in refs]) for block, refs in chunk.carried}


class PublishedIdentifiers:
    """Which mm identifiers each block P holds carries, followed from the KV-event batches P
    publishes (vLLM's block pool keeps a block's hash, not the extra keys that made it), so
    that P's KVSnapshot can carry them (`DemandScheduler`, `"snapshot_identifiers"`).

    Fed the batches as P publishes them, in order (`follow`, right after each publish, under
    the lock the snapshot is taken under), its `carriers` are what `RemoteKVIndex.carriers`
    gives a view that applied every batch from 0, as of the last batch published: the
    snapshot's stamp. Only the GPU medium (the prefix cache's; a snapshot holds no other).

    Leaner than a RemoteKVIndex, because it runs in P's engine: it counts only the hashes that
    carry identifiers (how many blocks hold each, so that one leaves with its last
    BlockRemoved), so a text-only store costs one scan of its extra keys and a removal one C
    call while no hash carries any. That relies on vLLM's rule that a block hash includes its
    extra keys: a hash is stored with its identifiers every time, never without them.

    Bounded by P's block count: past `max_hashes` such hashes (events that over-report, such
    as re-announced blocks never removed twice) it stops following, until the next
    AllBlocksCleared; stopped, or where the identifiers are unknown (a store without
    `extra_keys`, malformed ones), `carriers` is None and P's snapshot says it did not follow
    them. `follow` never raises: P's engine calls it.
    """

    def __init__(self, max_hashes: int) -> None:
        self.max_hashes = check_int("max_hashes", max_hashes, 0)
        # event id -> [blocks holding it, the identifiers it carries], for those carrying any
        self._held: dict[int, list[Any]] = {}
        self.stopped: str | None = None  # why it stopped following, until a clear

    def follow(self, events: Iterable[Any]) -> None:
        """One published batch's events (vLLM's BlockStored / BlockRemoved / AllBlocksCleared,
        or this package's: read by field), in order."""
        try:
            for e in events:
                self._follow(e)
        except Exception as e:  # never into P's engine: stop following, say why
            self._stop(f"{type(e).__name__}: {e}")

    def _follow(self, e: Any) -> None:
        kind = type(e).__name__
        if kind == "AllBlocksCleared":
            self._held.clear()
            self.stopped = None  # a fresh start: follow again from here
            return
        if self.stopped is not None:
            return
        if kind not in ("BlockStored", "BlockRemoved"):
            self._stop(f"an unexpected KV event {kind}")
            return
        medium = e.medium
        if medium is not None and medium != MEDIUM_GPU:
            return  # a connector's media: no snapshot holds them
        held, hashes = self._held, e.block_hashes
        if kind == "BlockRemoved":
            if held:
                ids = to_event_ids(hashes)
                hit = held.keys() & ids  # in C, over the event's ids: mostly text blocks
                if hit:
                    repeats = len(set(ids)) != len(ids)  # a hash twice in one event: rare
                    for eid in hit:
                        entry = held[eid]
                        entry[0] -= ids.count(eid) if repeats else 1
                        if entry[0] <= 0:
                            del held[eid]
            return
        keys, n = e.extra_keys, len(hashes)
        if not n:
            return
        if keys is None:
            self._stop("a BlockStored without extra keys")
            return
        if (type(keys) is not list and type(keys) is not tuple) or len(keys) != n:
            self._stop("a BlockStored with malformed extra keys")
            return
        if keys.count(None) == n:  # text only: the common case, one C call
            return
        ids = to_event_ids(hashes)
        last: tuple[str, ...] = ()  # the previous block's: an item spans many blocks
        idents: tuple[str, ...]
        for i, entry in enumerate(keys):
            if entry is None:
                continue
            shape = type(entry)
            if (shape is not list and shape is not tuple) or len(
                entry
            ) > MAX_SNAPSHOT_IDENTS_PER_BLOCK:
                self._stop("a BlockStored with malformed extra keys")
                return
            k = entry[0] if len(entry) == 1 else None
            if (
                (type(k) is tuple or type(k) is list)  # vLLM's usual entry: one mm key
                and len(k) == 2
                and len(last) == 1
                and k[0] == last[0]
                and type(k[0]) is str
                and type(k[1]) is int
            ):
                idents = last  # the previous block's identifier: checked already
            else:
                found = entry_identifiers(entry)
                if found is None:
                    self._stop("a BlockStored with malformed extra keys")
                    return
                idents = last = found[0]
            if not idents:
                continue
            was = held.get(ids[i])
            if was is None:
                held[ids[i]] = [1, idents]
                continue
            was[0] += 1
            if idents is was[1] or idents == was[1]:  # vLLM's rule: same hash, same keys
                continue
            have = set(was[1])
            extra = tuple(x for x in idents if x not in have)
            if extra:  # not vLLM's rule: the union, bounded
                was[1] += extra
                if len(was[1]) > MAX_SNAPSHOT_IDENTS_PER_BLOCK:
                    self._stop("a hash named with ever new identifiers")
                    return
        if len(held) > self.max_hashes:
            self._stop(f"{len(held)} hashes held, more than P's {self.max_hashes} blocks")

    def _stop(self, why: str) -> None:
        if self.stopped is None:
            logger.warning("mmreuse: KV snapshots carry no identifiers until a reset: %s", why)
        self.stopped = why
        self._held.clear()

    def carriers(self) -> dict[int, tuple[str, ...]] | None:
        """Every held event id that carries identifiers, and which; None where not known."""
        if self.stopped is not None:
            return None
        return {eid: entry[1] for eid, entry in self._held.items()}


def identifier_chunk(
    block_ids: Sequence[int],
    carried: Mapping[int, Sequence[str]],
    offset: int,
    limit: int,
) -> tuple[int, list[str], list[tuple[int, list[int]]]]:
    """A KVSnapshot chunk's identifiers: the chunk of `block_ids` from `offset` (at most `limit`
    ids) ends early where its identifier table would pass MAX_SNAPSHOT_IDENTS entries or
    MAX_SNAPSHOT_IDENT_BYTES, or its references MAX_SNAPSHOT_IDENT_REFS (a block names at most
    MAX_SNAPSHOT_IDENTS_PER_BLOCK: every chunk holds a block at least). Returns (end, the table,
    the `carried` pairs). An identifier the wire cannot carry (over MAX_IDENT_CHARS, never held
    by `PublishedIdentifiers`) is left out: a view never follows one."""
    table: dict[str, int] = {}
    pairs: list[tuple[int, list[int]]] = []
    nbytes = refs = 0
    end = min(len(block_ids), offset + limit)
    for i in range(offset, end):
        idents = carried.get(block_ids[i])
        if not idents:
            continue
        wanted = [x for x in dict.fromkeys(idents) if 0 < len(x) <= MAX_IDENT_CHARS]
        new = [x for x in wanted if x not in table]
        grow = sum(len(x.encode()) for x in new)
        if i > offset and (
            len(table) + len(new) > MAX_SNAPSHOT_IDENTS
            or nbytes + grow > MAX_SNAPSHOT_IDENT_BYTES
            or refs + len(wanted) > MAX_SNAPSHOT_IDENT_REFS
        ):
            return i, list(table), pairs
        for x in new:
            table[x] = len(table)
        nbytes += grow
        refs += len(wanted)
        if wanted:
            pairs.append((i - offset, [table[x] for x in wanted]))
    return end, list(table), pairs
