"""The proxy's live view of each prefill instance: its KV events (an `EventStream` into a
`KVIndexSink` over a `RemoteKVIndex`), the check that the proxy hashes as that instance does,
and the view's lag."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any

from ..availability import EmbeddingAvailability
from ..events.hashcheck import HashConfigCheck
from ..events.index import MAX_EXTRA_KEYS_PER_BLOCK, RemoteKVIndex
from ..events.wire import BlockStored, KVEventBatch
from ..hashing import BlockHasher
from .config import EncodeInstance, PrefillInstance
from .metrics import ProxyMetrics

logger = logging.getLogger("mmreuse.proxy")


class InstanceView:
    """One P (or PD) as the proxy sees it. Usable only while its event stream runs and its hash
    check has found no mismatch; otherwise the proxy plans as if it held nothing (E gets
    everything for it), and says why in /health and /metrics."""

    def __init__(
        self,
        name: str,
        instance: PrefillInstance,
        *,
        hash_algo: str,
        hash_seed: str | None,
        block_size: int | None,
        metrics: ProxyMetrics,
        availability: EmbeddingAvailability | None = None,
        track_identifiers: bool = False,
    ) -> None:
        """`instance`: its URL and endpoints (`ProxyConfig.instances`); the encoder-cache events
        feed `availability` (none given: not followed). `track_identifiers`: follow which mm
        identifiers P's blocks carry (`may_hold`; what the arrival-time split reads)."""
        self.name, self.instance = name, instance
        self.hash_algo, self.hash_seed = hash_algo, hash_seed
        self.configured_block_size = block_size
        # A block of `block_size` tokens overlaps at most that many mm items, so it names at
        # most that many identifiers (more: P's events are not vLLM's, its identifiers are
        # unknown). Only the configured size bounds it: one learned from P's events is P's word.
        per_block = MAX_EXTRA_KEYS_PER_BLOCK if block_size is None else block_size
        self.index = RemoteKVIndex(
            name,
            track_identifiers=track_identifiers,
            max_identifiers_per_block=min(per_block, MAX_EXTRA_KEYS_PER_BLOCK),
        )
        self._metrics = metrics
        self._lock = threading.Lock()
        self.hasher: BlockHasher | None = None
        self.check: HashConfigCheck | None = None
        self._reported_mismatch = False
        self.stream: Any = None  # its KV EventStream once started (pyzmq loads lazily)
        self.availability = availability
        self.ec_stream: Any = None  # its encoder-cache EventStream, when configured
        # Set once P publishes a second KV cache group (hybrid attention): the view follows
        # block hashes, not groups, so it would over-estimate hits; it is then off, saying why.
        self.hybrid: str | None = None
        if block_size is not None:
            self._configure(block_size)

    def _configure(self, block_size: int) -> None:
        hasher = BlockHasher(self.hash_algo, block_size, seed=self.hash_seed)
        self.check = HashConfigCheck(hasher, instance=self.name)
        self.hasher = hasher

    @property
    def url(self) -> str:
        return self.instance.url

    # ---- lifecycle ----------------------------------------------------------------------------

    def start(self) -> None:
        inst = self.instance
        if inst.ec_events is not None and self.availability is not None:
            from ..events.ec_sink import EncoderCacheSink
            from ..events.stream import EventStream  # pyzmq: only where a view is asked

            self.ec_stream = EventStream(
                inst.ec_events,
                inst.ec_replay,
                sink=EncoderCacheSink(self.availability, instance=self.name),
                metrics=self._metrics.views,
                snapshot_endpoint=inst.demand,  # DemandScheduler's, where P runs it
            ).start()
        if inst.kv_events is None:
            return
        from ..events.kv_sink import KVIndexSink
        from ..events.stream import EventStream  # pyzmq: only where a view is asked

        self.stream = EventStream(
            inst.kv_events,
            inst.kv_replay,
            sink=KVIndexSink(self.index),
            metrics=self._metrics.views,
            on_batch=self._on_batch,
            snapshot_endpoint=inst.demand,  # DemandScheduler's snapshot, where P runs it
        ).start()

    def stop(self) -> None:
        for sub in (self.stream, self.ec_stream):
            if sub is not None:
                sub.stop()

    # ---- the event streams' threads -------------------------------------------------------------

    def _on_batch(self, batch: KVEventBatch) -> None:
        self._metrics.view_lag.labels(self.name).set(max(0.0, time.time() - batch.ts))
        for event in batch.events:
            if not isinstance(event, BlockStored):
                continue
            if self.hybrid is None and event.group_idx not in (None, 0):
                kind = f" ({event.kv_cache_spec_kind})" if event.kv_cache_spec_kind else ""
                self.hybrid = (
                    f"P publishes KV cache group {event.group_idx}{kind}: a hybrid-attention "
                    "model's KV cache is not followed (the view would count a block one group "
                    "evicted as a hit); this view is off"
                )
                logger.error("view %s: %s", self.name, self.hybrid)
            if self.check is None:
                with self._lock:
                    if (
                        self.check is None
                        and isinstance(event.block_size, int)
                        and event.block_size > 0
                    ):
                        self._configure(event.block_size)
                        logger.info(
                            "view %s: block size %d (from its events)", self.name, event.block_size
                        )
            if self.check is not None:
                self.check.observe(event)
        self._report()

    def _report(self) -> None:
        if self.check is None:
            return
        status = self.check.status
        self._metrics.hash_verified.labels(self.name).set(status.verified)
        if status.mismatches and not self._reported_mismatch:
            self._reported_mismatch = True
            logger.error(
                "view %s: HASH CONFIGURATION MISMATCH: %s", self.name, status.first_mismatch
            )
        self._metrics.hash_mismatches.labels(self.name).set(status.mismatches)

    # ---- the read side ------------------------------------------------------------------------

    @property
    def problems(self) -> list[str]:
        """Why this view cannot be trusted now (empty: it can)."""
        out = []
        if self.instance.kv_events is None:
            out.append("no KV events endpoint")
        elif self.stream is None or not self.stream.is_alive:
            err = getattr(self.stream, "error", None)
            out.append(f"KV-event subscriber not running{f': {err}' if err else ''}")
        if self.instance.ec_events is not None and (
            self.ec_stream is None or not self.ec_stream.is_alive
        ):
            out.append("encoder-cache event subscriber not running")
        if self.check is not None and not self.check.status.ok:
            out.append(f"hash configuration mismatch: {self.check.status.first_mismatch}")
        if self.hybrid is not None:
            out.append(self.hybrid)
        if self.usable and not self.complete:
            out.append(self.incomplete)
        return out

    @property
    def complete(self) -> bool:
        """Whether the view holds everything P's publishers said since they started (the KV
        events, and the encoder-cache events when followed): a late join or a gap the replay
        could not fill leaves it missing what was stored before, which is never published
        again, so a miss in it is unknown rather than a miss at P."""
        kv, ec = self.stream, self.ec_stream
        return (
            kv is not None
            and bool(getattr(kv, "complete", False))
            and (self.instance.ec_events is None or bool(getattr(ec, "complete", False)))
        )

    @property
    def incomplete(self) -> str:
        """What an operator is told while the view is not complete."""
        which = [
            name
            for name, sub in (("KV", self.stream), ("encoder-cache", self.ec_stream))
            if sub is not None and not sub.complete
        ]
        return (
            f"view incomplete ({' and '.join(which) or 'KV'} events: the proxy joined after P's "
            "first events left its replay buffer, or lost batches the replay could not fill): "
            "what P cached before is unknown, so decisions from this view are blind "
            "(mmreuse_proxy_blind_decisions_total); with --demand-endpoints it bootstraps from "
            "P's snapshot (mmreuse_kv_event_snapshots_total) and asks P meanwhile; without, it "
            "is complete again when P clears its cache or restarts"
        )

    @property
    def usable(self) -> bool:
        return (
            self.hasher is not None
            and self.stream is not None
            and self.stream.is_alive
            and self.check is not None
            and self.check.status.ok
            and self.hybrid is None
        )

    def kv_unheld(self, identifiers: Iterable[str]) -> set[str] | None:
        """Which of `identifiers` no KV block in the view carries, on any medium (an incomplete
        view answers from what it knows: less, so it names more); None where it cannot tell
        (identifiers not followed). The caller checks `usable` and `complete`."""
        index = self.index
        if not index.track_identifiers:
            return None
        media = index.media()
        return {u for u in identifiers if not any(index.may_hold(u, m) for m in media)}

    def holds_identifier(self, identifier: str) -> bool:
        """Whether a block P holds is known to carry mm `identifier` (affine routing's score:
        what the view positively knows, complete or not)."""
        if not self.usable or not self.index.track_identifiers:
            return False
        index = self.index
        return any(
            index.identifiers_known(medium) and index.may_hold(identifier, medium)
            for medium in index.media()
        )

    def hit_blocks(self, hashes: Sequence[bytes]) -> int:
        """Leading blocks of `hashes` this instance holds, as its events tell (0 if unusable)."""
        return self.index.longest_prefix(hashes) if self.usable else 0

    def health(self) -> dict[str, object]:
        status = self.check.status if self.check is not None else None
        return {
            "url": self.instance.url,
            "kv_events": self.instance.kv_events,
            "encoder_cache_events": self.instance.ec_events,
            "usable": self.usable,
            "complete": self.complete,
            "block_size": self.hasher.block_size if self.hasher else None,
            "blocks": self.index.size(),
            "hash_check": None
            if status is None
            else {
                "verified": status.verified,
                "mismatches": status.mismatches,
                "unverifiable": status.unverifiable,
                "first_mismatch": status.first_mismatch,
            },
            "problems": self.problems,
        }


class EncoderView:
    """One E as the proxy sees it, from its encoder-cache events (`--e-cache-events-endpoints`):
    what it serves without a forward, the same for every replica that follows it. Bootstraps
    from E's snapshot (`--e-snapshot-endpoints`) when it joins late; an incomplete view only
    misses entries (an item E holds planned as `e_compute`: E still gets it)."""

    def __init__(
        self,
        name: str,
        instance: EncodeInstance,
        *,
        availability: EmbeddingAvailability,
        metrics: ProxyMetrics,
    ) -> None:
        self.name, self.instance = name, instance
        self.availability = availability
        self._metrics = metrics
        self.stream: Any = None  # its encoder-cache EventStream once started

    def start(self) -> None:
        from ..events.ec_sink import EncoderCacheSink
        from ..events.stream import EventStream

        inst = self.instance
        assert inst.ec_events is not None, "an E view follows E's encoder-cache events"
        self.stream = EventStream(
            inst.ec_events,
            inst.ec_replay,
            sink=EncoderCacheSink(self.availability, instance=self.name, side="e"),
            metrics=self._metrics.views,
            snapshot_endpoint=inst.snapshot,
        ).start()

    def stop(self) -> None:
        if self.stream is not None:
            self.stream.stop()

    @property
    def complete(self) -> bool:
        return bool(getattr(self.stream, "complete", False))

    @property
    def problems(self) -> list[str]:
        sub = self.stream
        if sub is None or not sub.is_alive:
            err = getattr(sub, "error", None)
            return [f"encoder-cache event subscriber not running{f': {err}' if err else ''}"]
        if not sub.complete:
            return [
                "E view incomplete (the proxy joined after E's first encoder-cache events left "
                "its replay buffer, or lost batches): items E holds from before may be planned "
                "as e_compute (E still gets them); with --e-snapshot-endpoints it bootstraps "
                "from E's snapshot"
            ]
        return []

    def health(self) -> dict[str, object]:
        return {
            "url": self.instance.url,
            "encoder_cache_events": self.instance.ec_events,
            "complete": self.complete,
            "problems": self.problems,
        }
