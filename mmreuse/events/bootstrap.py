"""An incomplete `EventStream` view bootstrapped from the instance's snapshot, and a snapshot
stamped ahead of the stream held aside until the stream reaches its stamp (the rules:
`events.stream`'s module doc).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from .replay import ReplayAborted, replay
from .snapshot import Snapshot, SnapshotRefused, fetch_snapshot

if TYPE_CHECKING:
    from .stream import EventStream

logger = logging.getLogger("mmreuse.events.stream")


class SnapshotBootstrap:
    """One stream's snapshot state: the snapshot held aside (`pending`, dropped at
    `pending_until`, monotonic), the incarnation of the one last put in place since the
    publisher (re)connected (a snapshot of another is refused), and when to try next."""

    def __init__(self, stream: EventStream) -> None:
        self.stream = stream
        self.next_at = 0.0  # monotonic time of the next snapshot attempt
        self.pending: Snapshot | None = None
        self.pending_until = 0.0
        self.incarnation: str | None = None

    def applied(self, seq: int) -> None:
        """The stream applied (or lost) `seq`: a snapshot held aside whose stamp follows it
        goes in place now."""
        if self.pending is not None and seq == self.pending.stamp - 1:
            self._reach_stamp()

    def duties(self) -> None:
        """Between messages: settle a snapshot held aside; bootstrap an incomplete view when it
        is time."""
        now = time.monotonic()
        if self.pending is not None:
            self._pending_duties(now)
        if not self.stream.complete and self.pending is None and now >= self.next_at:
            self._bootstrap()

    def _pending_duties(self, now: float) -> None:
        """A snapshot held aside: dropped if the view became complete without it (a clear);
        put in place (and the batches past its stamp replayed) once the stream passed its stamp
        by a way `_apply` did not see (batches lost on the way); refused at its deadline."""
        snap = self.pending
        assert snap is not None
        if self.stream.complete:
            self.pending = None
            logger.info(
                "%s events %s: the view became complete before the stream reached the snapshot's "
                "stamp %d (a clear); the snapshot is not needed",
                self.stream.sink.events,
                self.stream.label,
                snap.stamp,
            )
        elif self._position() >= snap.stamp - 1:
            self.pending = None
            self._install(snap)
        elif now >= self.pending_until:
            self.pending = None
            self._failed(
                SnapshotRefused(
                    "stamp",
                    f"the stream stayed at {self._position()}, never reaching the snapshot's "
                    f"stamp {snap.stamp} within snapshot_deadline_s={self.stream.limits.snapshot_deadline_s}",
                ),
                reset=False,  # never loaded: the view is as it was, incomplete
            )

    def _reach_stamp(self) -> None:
        """The stream just applied `stamp - 1` of the snapshot held aside: put it in place (it
        holds every batch so far, exactly)."""
        snap, self.pending = self.pending, None
        assert snap is not None
        self._install(snap)

    def forget_publisher(self, why: str) -> None:
        """Another publisher process, perhaps: its incarnation is unknown again, and a snapshot
        held aside (of the old one's stream) is refused."""
        self.incarnation = None
        if self.pending is not None:
            snap, self.pending = self.pending, None
            self._failed(
                SnapshotRefused(
                    "stamp", f"{why} before the stream reached the snapshot's stamp {snap.stamp}"
                ),
                reset=False,
            )

    def _position(self) -> int:
        """The last seq the stream has accounted for (-1: none): every batch up to it applied,
        or lost with a reset. Only ever a seq the publisher sent (live or replayed)."""
        return -1 if self.stream.applied_seq is None else self.stream.applied_seq

    def _bootstrap(self) -> None:
        """Fetch P's snapshot and use it (`_use_snapshot`)."""
        assert self.stream.snapshot_endpoint is not None
        try:
            snap = fetch_snapshot(
                self.stream.snapshot_endpoint,
                context=self.stream.context,
                deadline_s=self.stream.limits.snapshot_deadline_s,
                quiet_s=self.stream.limits.replay_timeout_s * 2.5,
                max_blocks=self.stream.max_snapshot_items,
                max_bytes=self.stream.max_snapshot_bytes,
                cancelled=self.stream.stopping,
                kind=self.stream.sink.snapshot_kind,
            )
        except SnapshotRefused as e:
            self._failed(e, reset=False)
            return
        self._use_snapshot(snap)

    def _use_snapshot(self, snap: Snapshot) -> None:
        """Refuse a snapshot of another incarnation or stamped too far ahead; hold one stamped
        ahead of the stream aside until the stream reaches it; put any other in place."""
        if self.incarnation is not None and snap.incarnation != self.incarnation:
            self._failed(
                SnapshotRefused(
                    "incarnation",
                    f"snapshot of incarnation {snap.incarnation!r}, the stream's is "
                    f"{self.incarnation!r} (another P process behind the demand endpoint?)",
                ),
                reset=False,
            )
            return
        at = self._position()
        if snap.stamp - 1 <= at:
            self._install(snap)
            return
        if snap.stamp - 1 - at > self.stream.limits.max_stamp_ahead:
            self._failed(
                SnapshotRefused(
                    "stamp",
                    f"snapshot stamped {snap.stamp}, the stream is at {at} "
                    f"(max_stamp_ahead={self.stream.limits.max_stamp_ahead})",
                ),
                reset=False,
            )
            return
        self.pending = snap
        self.pending_until = time.monotonic() + self.stream.limits.snapshot_deadline_s
        logger.info(
            "%s events %s: snapshot stamped %d, the stream at %d: held until the stream gets "
            "there (the view stays incomplete)",
            self.stream.sink.events,
            self.stream.label,
            snap.stamp,
            at,
        )

    def _install(self, snap: Snapshot) -> None:
        """Put a snapshot the stream has reached in place of the view and replay the batches
        the view applied past its stamp; the view is then complete."""
        stamp, applied = snap.stamp, self.stream.applied_seq
        try:
            self.stream.sink.load(snap)
        except ValueError as e:
            self._failed(SnapshotRefused("malformed", f"snapshot: {e}"), reset=False)
            return
        self.stream.applied_seq = stamp - 1 if stamp > 0 else None
        if applied is not None and applied >= stamp:  # the view had gone past the stamp
            resynced = [False]
            try:
                if self.stream.replay_endpoint is None:
                    raise ReplayAborted("unavailable", "no replay endpoint")
                replay(self.stream, stamp, applied + 1, resynced)
            except ReplayAborted as e:
                self.stream.applied_seq = applied
                self._failed(
                    SnapshotRefused("replay", f"batches {stamp}..{applied} after the stamp: {e}"),
                    reset=True,
                )
                return
            if resynced[0]:
                self.stream.applied_seq = applied
                self._failed(
                    SnapshotRefused("replay", f"the replay buffer no longer holds batch {stamp}"),
                    reset=True,
                )
                return
        self.incarnation = snap.incarnation
        self.stream.complete = True
        m = self.stream.metrics
        m.complete.labels(self.stream.label, self.stream.sink.events).set(1)
        m.snapshots.labels(self.stream.label, "ok").inc()
        self.stream.sink.update_gauges(self.stream.metrics)
        logger.info(
            "%s events %s: view bootstrapped from P's snapshot (%d entries, stamp %d)",
            self.stream.sink.events,
            self.stream.label,
            len(snap.block_ids) + len(snap.entries),
            stamp,
        )

    def _failed(self, e: SnapshotRefused, *, reset: bool) -> None:
        self.stream.metrics.snapshots.labels(self.stream.label, e.reason).inc()
        logger.warning("%s: no snapshot (%s): %s", self.stream.who, e.reason, e)
        if reset:
            self.stream.resync()
        self.next_at = time.monotonic() + self.stream.limits.snapshot_retry_s
