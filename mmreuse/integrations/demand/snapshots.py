"""P's KV snapshots (`KVSnapshots`, served by `DemandScheduler`): what a late proxy bootstraps
its KV view from (held and paced as every snapshot: `integrations.snapshots`).

A `SnapshotQuery` gets P's prefix cache as a KV-event view holds it, stamped with the
KV-event batch it is consistent with (`demand_query.KVSnapshot`). vLLM's publisher numbers
batches in the order `publish` is called, and the scheduler calls it from `update_from_output`,
holding the demand lock: counting the calls gives the stamp. The block counts come from the
residency index; the block pool's events not yet published (queued by `schedule` for the next
batch) are undone on the copy, so the snapshot is P as of the last batch published. With
`"snapshot_identifiers": true` it also carries the mm identifiers its blocks carry: the block
pool keeps no extra keys per block, so P follows them from the batches it publishes
(`events.identifiers.PublishedIdentifiers`, fed right after each publish, under the lock: as of the
same stamp), bounded by its block count. Opt-in: under the engine's lock it costs about 15 ns
per block of a text-only store, but about 1 us per block stored that carries an identifier and
0.4 us per block removed while any is held (on a slow 2-core machine:
benchmarks/test_bench_events.py), and about 100 bytes per such block held.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from ...blockhash import to_event_id
from ...demand_query import MAX_SNAPSHOT_BLOCKS, DemandError, KVSnapshot, SnapshotQuery
from ...events.identifiers import PublishedIdentifiers, identifier_chunk
from ..snapshots import HeldSnapshots, incarnation
from .engine_state import engine_sizes, kv_events_enabled, pending_kv_events
from .index_feed import IndexFeed

# under vLLM's "vllm" logger: its handler and format, so these lines appear in vLLM's log
logger = logging.getLogger(f"vllm.{__name__}")

__all__ = ["KVSnapshots"]

# A snapshot as taken: (stamp, event ids, block counts, the ids' identifiers or None where P
# does not follow them).
_Taken = tuple[int, list[int], list[int], dict[int, tuple[str, ...]] | None]


def _base_take_events() -> Any:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    return KVConnectorBase_V1.take_events


class KVSnapshots:
    """P's KV snapshots. `engine`: vLLM's scheduler (its block pool, KV connector and event
    publisher); `feed`: its residency index; `lock`: the demand lock; `follow_identifiers`:
    "snapshot_identifiers"."""

    def __init__(
        self, engine: Any, feed: IndexFeed, lock: threading.RLock, follow_identifiers: bool
    ) -> None:
        self._engine = engine
        self._feed = feed
        self.published = 0  # KV-event batches published so far: the stamp of a snapshot
        self.incarnation = incarnation()
        self.chunk = MAX_SNAPSHOT_BLOCKS  # block ids per KVSnapshot (tests: fewer)
        self._snapshots: HeldSnapshots[_Taken] = HeldSnapshots(lock, "P")
        self.identifiers = self._make_identifiers(follow_identifiers)
        self._count_published()

    def _make_identifiers(self, follow: bool) -> PublishedIdentifiers | None:
        """P's follower of its blocks' identifiers, where asked and a snapshot can be taken."""
        if not follow:
            return None
        events = kv_events_enabled(self._engine)
        if self._feed.index is None or not events:
            logger.warning(
                "mmreuse: snapshot_identifiers is set, but P takes no KV snapshots (index %s, "
                "KV events %s)",
                self._feed.note,
                "on" if events else "off",
            )
            return None
        return PublishedIdentifiers(engine_sizes(self._engine)[0])

    def _count_published(self) -> None:
        """Count the KV-event batches handed to vLLM's publisher (it numbers them in this order:
        the n-th call's batch is seq n-1). Called from update_from_output, under the lock."""
        publisher = getattr(self._engine, "kv_event_publisher", None)
        if publisher is None:
            return
        publish = publisher.publish
        identifiers = self.identifiers

        def counted(batch: Any) -> None:
            publish(batch)
            self.published += 1
            if identifiers is not None:  # as of the same batch: what a snapshot's stamp says
                identifiers.follow(batch.events)

        publisher.publish = counted

    def answer(self, query: SnapshotQuery) -> KVSnapshot | DemandError:
        """Chunk `offset` of snapshot `id` (taken at offset 0, under the lock)."""
        engine = self._engine
        held = self._snapshots.for_query(
            query.id,
            query.offset,
            self._take,
            lambda last: last[0] == self.published and not pending_kv_events(engine),
        )
        if isinstance(held, DemandError):
            return held
        stamp, ids, counts, carried = held
        if query.offset > len(ids):
            return DemandError(query.id, f"snapshot: offset {query.offset} > total {len(ids)}")
        end = query.offset + self.chunk
        table: list[str] = []
        pairs: list[tuple[int, list[int]]] = []
        if carried is not None:  # a chunk ends early where its identifiers reach their bounds
            end, table, pairs = identifier_chunk(ids, carried, query.offset, self.chunk)
        return KVSnapshot(
            id=query.id,
            stamp=stamp,
            incarnation=self.incarnation,
            total=len(ids),
            offset=query.offset,
            blocks=engine_sizes(engine)[0],
            block_ids=ids[query.offset : end],
            counts=counts[query.offset : end],
            identifiers_followed=carried is not None,
            identifiers=table,
            carried=pairs,
        )

    def _take(self) -> _Taken | str:
        """(stamp, event ids, block counts, their identifiers) of the prefix cache as of the
        last KV-event batch published, or why there is none. Holding the lock."""
        from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

        index = self._feed.sync()
        if index is None:
            return f"the residency index is {self._feed.note}"
        if not kv_events_enabled(self._engine):
            return "P publishes no KV events (--kv-events-config enable_kv_cache_events)"
        connector = getattr(self._engine, "connector", None)
        if connector is not None and type(connector).take_events is not _base_take_events():
            return (
                f"P's KV connector {type(connector).__name__} publishes events of its own "
                "(other media), which a snapshot of the prefix cache does not hold"
            )
        counts = index.counts()  # event id -> the blocks holding it
        # undo what the next batch will tell: the copy is P as of the last batch published
        for event in reversed(pending_kv_events(self._engine)):
            if isinstance(event, AllBlocksCleared):
                return "a prefix-cache reset is being published; ask again"
            step = -1 if isinstance(event, BlockStored) else 1
            if not isinstance(event, BlockStored | BlockRemoved):
                return f"an unexpected pending event {type(event).__name__}"
            for h in event.block_hashes:
                ident = to_event_id(h)
                n = counts.get(ident, 0) + step
                if n < 0:
                    return "the pending events do not match the index (a bug); ask again"
                if n:
                    counts[ident] = n
                else:
                    counts.pop(ident, None)
        # the identifiers as of the same batch (followed from the batches published); None
        # where not followed or not known
        carried = None if self.identifiers is None else self.identifiers.carriers()
        return self.published, list(counts), list(counts.values()), carried
