"""Snapshots a late proxy bootstraps from, as any plug-in serves them: taken at offset 0, held
for their later chunks (`HeldSnapshots`), and an encoder cache's in chunks (`ECSnapshots`,
served by `EventfulEncoderCacheManager` on its own endpoint and through a `DemandScheduler`'s
demand endpoint; P's KV snapshots: `integrations.demand.snapshots`). Imports no vLLM.

Taking a snapshot holds the lock the engine waits on and copies what the cache holds, so while
the cache changes at most one is taken per `SNAPSHOT_MIN_INTERVAL_S`; a query within it gets a
DemandError naming when to ask again (`retry_after_s`: `fetch_snapshot` waits it out within
its deadline). While nothing was published since the last one, that copy serves every query
(replicas starting together share it) at no cost to the engine. A snapshot served is always a fresh one: stamped at the stream's last batch, it never
needs the replay endpoint to catch up. Thread-safe: any number of answer threads may serve the
same snapshots (a process with both a demand and an encoder-cache snapshot endpoint).
"""

from __future__ import annotations

import os
import secrets
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Generic, TypeVar

import cachetools

from ..demand_query import (
    MAX_RETRY_AFTER_S,
    MAX_SNAPSHOT_ENTRIES,
    DemandError,
    ECEntry,
    ECSnapshot,
    ECSnapshotQuery,
)

__all__ = [
    "SNAPSHOTS_KEPT",
    "SNAPSHOT_MIN_INTERVAL_S",
    "ECSnapshots",
    "HeldSnapshots",
    "Paced",
    "incarnation",
]

SNAPSHOTS_KEPT = 2  # snapshots held for their later chunks (a new id beyond: the oldest goes)
# Taking a snapshot holds the lock the engine waits on (a KV one: ~0.14 s for 1M blocks): at
# most one per interval while the cache changes (replicas starting together share one while it
# does not).
SNAPSHOT_MIN_INTERVAL_S = 1.0

T = TypeVar("T")


class Paced:
    """No snapshot now: the last was taken under `SNAPSHOT_MIN_INTERVAL_S` ago and the cache
    changed since. `after_s`: when asking again will be answered; `reason`: for the error."""

    __slots__ = ("after_s", "reason")

    def __init__(self, after_s: float, reason: str) -> None:
        self.after_s = after_s
        self.reason = reason

    def error(self, ident: str) -> DemandError:
        """The answer saying so, with when to ask again."""
        # (a hint, capped where the wire's bound is: the interval is a second in practice)
        after = min(self.after_s, MAX_RETRY_AFTER_S)
        return DemandError(ident, f"snapshot: {self.reason}", retry_after_s=after)


def incarnation() -> str:
    """This process's name on the snapshots it serves (a restarted server has another)."""
    return f"{os.getpid()}-{secrets.token_hex(8)}"


class HeldSnapshots(Generic[T]):
    """Snapshots taken at offset 0 and held by id (the last `SNAPSHOTS_KEPT`), at most one taken
    per `SNAPSHOT_MIN_INTERVAL_S` while the cache changes. `lock`: the cache's own lock (the
    one the engine takes), held while asking whether the cache changed and while taking; the
    held snapshots have a lock of their own, so a later chunk never waits on the engine."""

    def __init__(self, lock: AbstractContextManager[Any], changing: str) -> None:
        self._lock = lock
        self._changing = changing  # what changes, for the error: "P", "the encoder cache"
        self._guard = threading.Lock()  # _held: any answer thread
        self._last: tuple[float, T] | None = None  # (when, what): read and set under _lock
        self._held: cachetools.LRUCache[str, T] = cachetools.LRUCache(SNAPSHOTS_KEPT)

    def open(
        self, ident: str, take: Callable[[], T | str], unchanged: Callable[[T], bool]
    ) -> T | str | Paced:
        """Snapshot `ident`, held for its later chunks: the last one taken while `unchanged`
        says nothing was published since it (both called holding the cache's lock), else a new
        one from `take`; or why there is none (`take`'s reason, or `Paced`)."""
        with self._lock:
            last = self._last
            now = time.monotonic()
            if last is not None and unchanged(last[1]):
                taken = last[1]  # nothing changed since: the same copy serves
            elif last is not None and now - last[0] < SNAPSHOT_MIN_INTERVAL_S:
                return Paced(
                    SNAPSHOT_MIN_INTERVAL_S - (now - last[0]),
                    f"one per {SNAPSHOT_MIN_INTERVAL_S} s while {self._changing} changes; ask again",
                )
            else:
                fresh = take()
                if isinstance(fresh, str):
                    return fresh
                taken = fresh
                self._last = (now, taken)
        with self._guard:
            self._held[ident] = taken
        return taken

    def get(self, ident: str) -> T | None:
        """Snapshot `ident` as opened, or None when no longer held."""
        with self._guard:
            return self._held.get(ident)

    def for_query(
        self,
        ident: str,
        offset: int,
        take: Callable[[], T | str],
        unchanged: Callable[[T], bool],
    ) -> T | DemandError:
        """The snapshot a chunk query asks for: opened at offset 0 (`open`), held after; or the
        answer saying why there is none (paced: when to ask again)."""
        if offset == 0:
            opened = self.open(ident, take, unchanged)
            if isinstance(opened, Paced):
                return opened.error(ident)
            if isinstance(opened, str):
                return DemandError(ident, f"snapshot: {opened}")
        held = self.get(ident)
        if held is None:
            return DemandError(ident, "snapshot: no longer held (ask again from offset 0)")
        return held


# An encoder cache as taken: (stamp, [(identifier, num_embeds, freeable)]).
ECTaken = tuple[int, list[tuple[str, int, bool]]]


class ECSnapshots:
    """An encoder cache's snapshots, in chunks. `take`: (stamp, entries), true as of the events
    published (`EventfulEncoderCacheManager.snapshot`); `published`: the stamp a snapshot taken
    now would have, or None while events are pending; `lock`: the cache's lock (held by both,
    and by `HeldSnapshots` around them)."""

    def __init__(
        self,
        take: Callable[[], ECTaken],
        published: Callable[[], int | None],
        lock: AbstractContextManager[Any],
    ) -> None:
        self._take = take
        self._published = published
        self._snapshots: HeldSnapshots[ECTaken] = HeldSnapshots(lock, "the encoder cache")
        self.incarnation = incarnation()
        self.chunk = MAX_SNAPSHOT_ENTRIES  # entries per ECSnapshot (tests: fewer)

    def answer(self, query: ECSnapshotQuery) -> ECSnapshot | DemandError:
        """Chunk `offset` of encoder-cache snapshot `id` (taken at offset 0). Any thread."""
        held = self._snapshots.for_query(
            query.id, query.offset, self._take, lambda last: last[0] == self._published()
        )
        if isinstance(held, DemandError):
            return held
        stamp, entries = held
        if query.offset > len(entries):
            return DemandError(query.id, f"snapshot: offset {query.offset} > total {len(entries)}")
        part = entries[query.offset : query.offset + self.chunk]
        return ECSnapshot(
            query.id, stamp, self.incarnation, len(entries), query.offset,
            [ECEntry(h, n, f) for h, n, f in part],
        )  # fmt: skip
