"""`KVIndexSink`: vLLM's KV events, as an `EventStream` delivers them, into a `RemoteKVIndex`.

The proxy's prefix view of one P: a batch applies to the index whole or not at all (a bad hash,
more media than the index's `max_media`: refused, then the stream resyncs), a snapshot replaces
it whole (`RemoteKVIndex.load`), and the reads (`longest_prefix`, `match_prefix`) raise
`StreamDied` while no running stream feeds the index: a view no longer followed is not trusted.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

from ..errors import InvalidArgument
from ..kvview import PrefixMatch
from ..metrics import Metrics
from ..validate import check_callable, fail_type
from .index import RemoteKVIndex
from .snapshot import Snapshot
from .stream import StreamDied
from .wire import MEDIUM_GPU, AllBlocksCleared, KVEventBatch, decode_batch

# A KV snapshot's blocks unless StreamLimits.max_snapshot_items says otherwise (4M blocks).
DEFAULT_SNAPSHOT_BLOCKS = 1 << 22


class KVIndexSink:
    """An `EventSink` over `index` (its `instance` labels the stream's metrics): the KV view
    the proxy reads, and its `index_size` gauge per medium held."""

    events = "kv"
    snapshot_kind = "kv"
    snapshot_items = DEFAULT_SNAPSHOT_BLOCKS
    # Ids and counts are bounded by the blocks; the identifiers the snapshot carries in all by
    # `fetch_snapshot` (2 references a block of `snapshot_items`, 64 MiB of identifiers).
    snapshot_bytes: int | None = None

    def __init__(self, index: RemoteKVIndex) -> None:
        if not isinstance(index, RemoteKVIndex):
            fail_type("index", "a RemoteKVIndex", index)
        self.index = index
        self.instance = index.instance
        self._check: Callable[[], None] | None = None
        self._gauge_media: set[str] = set()  # media with an index_size label

    def attach(self, check: Callable[[], None]) -> None:
        check_callable("check", check)
        if self._check is not None:
            raise InvalidArgument(
                f"the KVIndexSink of {self.instance!r} is already fed by a stream: two streams "
                "into one index would interleave two publishers' batches"
            )
        self._check = check

    # ---- the read side ------------------------------------------------------------------------

    def check(self) -> None:
        """Raise StreamDied unless a running stream feeds this view."""
        if self._check is None:
            raise StreamDied(f"no event stream feeds the KV view of {self.instance}")
        self._check()

    def longest_prefix(self, block_hashes: Sequence[bytes | int], medium: str = MEDIUM_GPU) -> int:
        """`index.longest_prefix`, after `check()`: a view no longer followed raises."""
        self.check()
        return self.index.longest_prefix(block_hashes, medium)

    def match_prefix(self, block_hashes: Sequence[bytes | int]) -> PrefixMatch:
        """The KVView protocol over the GPU view, after `check()`."""
        return PrefixMatch(self.longest_prefix(block_hashes))

    # ---- the stream's side --------------------------------------------------------------------

    def apply(self, payload: bytes) -> KVEventBatch:
        batch = decode_batch(payload)
        self.index.apply(batch)  # refuses it whole: a bad hash, too many media
        return batch

    def clears(self, batch: Any) -> bool:
        return any(type(e) is AllBlocksCleared for e in batch.events)

    def reset(self) -> None:
        self.index.clear()

    def load(self, snap: Snapshot) -> None:
        """The snapshot's blocks in place of the index, with the identifiers they carry where P
        followed them."""
        self.index.load(snap.block_ids, snap.counts, identifiers=snap.identifiers)

    def update_gauges(self, metrics: Metrics) -> None:
        """index_size per medium held (GPU always); labels of media gone are removed, so the
        label set stays within max_media + 1."""
        gauge = metrics.index_size
        present = set(self.index.media()) | {MEDIUM_GPU}
        for medium in self._gauge_media - present:
            with contextlib.suppress(KeyError):  # never labelled
                gauge.remove(self.instance, medium)
        for medium in present:
            gauge.labels(self.instance, medium).set(self.index.size(medium))
        self._gauge_media = present
