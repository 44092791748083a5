"""EventStream: follow one publisher's event batches over ZMQ, reliably, into an `EventSink`.

The stream owns the transport, the sequence numbers, gap replay, resync and the snapshot
bootstrap; the sink owns the view: `KVIndexSink` (`events.kv_sink`, vLLM's KV events into a
`RemoteKVIndex`) or `EncoderCacheSink` (`events.ec_sink`, encoder-cache events into
`EmbeddingAvailability`). What follows is the KV stream's spec; the encoder-cache stream keeps
it with its own payload and view. The bounds are one record, `StreamLimits`.

vLLM's ZmqEventPublisher (kv_events.py) sends each batch as a PUB multipart message
`(topic, seq as 8 bytes big-endian, msgpack payload)`, seq counting from 0 per publisher
process, and serves a ROUTER replay socket: a request `(b"", start_seq)` from a DEALER gets
`(b"", topic, seq, payload)` for every buffered batch with seq >= start_seq, then the end
marker `(b"", b"", (-1 as 8 signed bytes), b"")` (vLLM < 0.26 sends no topic frame in replies;
both are accepted). The buffer holds the last `buffer_steps`. Frames and request never changed
from 0.9.0 to 0.33.0.

The view is what a proxy trusts to skip encoder work, so the one rule is: the index may miss
blocks P holds (a late fallback), never hold a block P removed (a wrong skip). Hence a *resync*
(the instance's view reset, `mmreuse_kv_event_resyncs_total`) whenever a batch may be lost:

- a gap in seq that the replay does not fill completely and in order (the bounds are
  `StreamLimits`'): no replay endpoint, a gap longer than `max_replay_batches`, a replay that
  stalls (`replay_timeout_s` of silence), runs past `replay_deadline_s`, exceeds
  `max_replay_bytes`, ends early, skips or repeats a seq, or names a seq outside [requested
  start, live seq], or `stop()` during it;
- a malformed frame set or payload (`MalformedBatch`, nesting bound included), a batch that
  names more than the index's `max_media` media (or a medium name over
  `index.MAX_MEDIUM_CHARS`): the index refuses it whole; or any
  unexpected error handling a batch (`mmreuse_kv_event_errors_total`): the loop survives;
- a dropped connection to the publisher: the view resets and is replayed from seq 0 (a
  restart whose new seqs overtook the old ones shows only as that); a publisher restart (seq
  going back, or not continuing after a reconnect) is counted: a new process starts empty.

The view is *complete* (`complete`, `mmreuse_kv_event_view_complete`) once it holds everything
the publisher has said since it started: its seq 0 applied on an empty view, or a batch that
clears everything (`AllBlocksCleared`) applied. Any reset makes it incomplete again, and a
subscriber that joined after the publisher's first batch left its replay buffer stays
incomplete: what was stored before is never published again, so the view may miss blocks P
holds (never the reverse), and a caller should treat a miss from it as unknown.

With a `snapshot_endpoint` (P's demand endpoint, where `DemandScheduler` serves its KV
snapshot), an incomplete view bootstraps itself: it fetches the snapshot (`events.snapshot`),
puts it in place of the view, and applies the batches from the snapshot's stamp on (replayed
when it had applied past the stamp); it is then complete. A snapshot stamped ahead of the
stream (P answered before its last batches arrived here) is only a claim until the stream gets
there: it is held aside, unloaded, while the live batches apply to the (incomplete) view as
ever, and is put in place of the view only once the stream reaches `stamp - 1` (the batches
below the stamp are then in it, none applied twice, none dropped). So the view is never
complete, nor ever holds what such a snapshot says, on its word alone. The stream's
incarnation is that of the first snapshot put in place since the publisher (re)connected: a
snapshot of another (another P process behind the demand endpoint) is refused. A snapshot
refused, malformed, past its deadline or its bounds, of another incarnation, stamped more than
`max_stamp_ahead` past the stream or not reached by it within `snapshot_deadline_s`, or whose
stamp the replay cannot reach, leaves the view incomplete (reset if it had been loaded),
counted in `mmreuse_kv_event_snapshots_total{outcome}` (`incarnation`, `stamp`, ...), and is
asked again after `snapshot_retry_s`. A snapshot carries the mm identifiers its blocks carry
where P follows them (`KVSnapshot.identifiers_followed`): a view tracking identifiers then
knows them as if it had applied every batch from 0 (one held aside keeps them until it is put
in place); from a P that does not, they stay unknown until the next reset. Identifiers that do
not fit the snapshot's blocks refuse the snapshot whole (`malformed`).

Should the loop itself die (its socket failing), the view is reset too, `error` holds the cause,
`is_alive` is False, `mmreuse_kv_event_subscriber_up` drops to 0, and `check()` on the stream
(and so `longest_prefix()` and `match_prefix()` on its `KVIndexSink`) raises `StreamDied`.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import zmq

from ..errors import InvalidArgument
from ..metrics import Metrics
from ..validate import (
    check_bool,
    check_callable,
    check_float,
    check_int,
    check_str,
    fail_type,
    fail_value,
    show,
)
from .snapshot import Snapshot, SnapshotRefused, fetch_snapshot

logger = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)


class StreamDied(RuntimeError):
    """The stream's loop is not running (stopped, or died on the error in `__cause__`): its
    view is no longer followed, so it must not be trusted."""


def _ms(seconds: float) -> int:
    """A poll timeout in ZMQ's milliseconds, never 0 (0 would turn a wait into a busy loop)."""
    return max(1, math.ceil(seconds * 1000))


def _check_endpoint(field: str, value: object) -> str:
    endpoint = check_str(field, value)
    if "://" not in endpoint:
        fail_value(field, "a ZMQ endpoint like tcp://host:5557", endpoint)
    return endpoint


class _ReplayAborted(Exception):
    """A replay that cannot fill the gap; `reason` is a fixed metric label."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class StreamLimits:
    """The bounds of one `EventStream`, checked here (errors name the field and the value).

    `poll_interval_s`: how often the thread looks at `stop()` (rounded up to whole ms).
    `replay_timeout_s`: the longest silence within a replay; `replay_deadline_s`: the longest a
    whole replay may take; `max_replay_batches`: the longest gap asked of the replay (vLLM
    buffers 10,000 steps by default); `max_replay_bytes`: the payload a replay may deliver;
    `max_message_bytes`: the largest frame either socket takes (ZMQ drops a peer that sends
    more: a gap, then a resync). Snapshots: `snapshot_deadline_s` for a whole fetch (and for the
    stream to reach a snapshot stamped ahead of it), `snapshot_retry_s` between attempts,
    `max_stamp_ahead` the furthest ahead a stamp may be, `max_snapshot_items` (blocks or
    entries) and `max_snapshot_bytes` (None: the sink's own bounds, `EventSink.snapshot_items`
    and `snapshot_bytes`); a KV snapshot's identifiers are bounded in all by `fetch_snapshot`
    (2 references a block of `max_snapshot_items`, 64 MiB of identifiers).
    """

    poll_interval_s: float = 0.05
    replay_timeout_s: float = 2.0
    replay_deadline_s: float = 30.0
    max_replay_batches: int = 10_000
    max_replay_bytes: int = 512 << 20
    max_message_bytes: int = 64 << 20
    snapshot_deadline_s: float = 30.0
    snapshot_retry_s: float = 5.0
    max_stamp_ahead: int = 10_000
    max_snapshot_items: int | None = None
    max_snapshot_bytes: int | None = None

    def __post_init__(self) -> None:
        for field in ("poll_interval_s", "replay_timeout_s", "replay_deadline_s"):
            check_float(field, getattr(self, field), 0, lo_open=True)
        check_float("snapshot_deadline_s", self.snapshot_deadline_s, 0, lo_open=True)
        check_float("snapshot_retry_s", self.snapshot_retry_s, 0)
        check_int("max_replay_batches", self.max_replay_batches, 1)
        check_int("max_replay_bytes", self.max_replay_bytes, 1)
        check_int("max_message_bytes", self.max_message_bytes, 1, 2**62)
        check_int("max_stamp_ahead", self.max_stamp_ahead, 0)
        if self.max_snapshot_items is not None:
            check_int("max_snapshot_items", self.max_snapshot_items, 0)
        if self.max_snapshot_bytes is not None:
            check_int("max_snapshot_bytes", self.max_snapshot_bytes, 1)


class EventSink(Protocol):
    """The view an `EventStream` feeds. Every call comes from the stream's thread; a batch or a
    snapshot applies whole or not at all (ValueError: nothing changed), so the stream can reset
    the view whenever it may have missed something."""

    instance: str  # the instance followed: the stream's metric label
    events: str  # the `events` label of the completeness gauge ("kv", "encoder_cache")
    snapshot_kind: str  # what the snapshot endpoint is asked for ("kv", "ec": events.snapshot)
    snapshot_items: int  # the snapshot's blocks or entries, unless StreamLimits bounds them
    snapshot_bytes: int | None  # its answers in all (None: unbounded), unless StreamLimits does

    def attach(self, check: Callable[[], None]) -> None:
        """The one stream that feeds this sink: `check()` raises StreamDied unless it runs."""
        ...

    def apply(self, payload: bytes) -> Any:
        """Decode one batch's payload and apply it whole; the decoded batch (for `on_batch`)."""
        ...

    def clears(self, batch: Any) -> bool:
        """Whether an applied batch empties the view whole (it is then exact from there on)."""
        ...

    def reset(self) -> None:
        """Forget everything (a resync: what the view may have missed is unknown)."""
        ...

    def load(self, snap: Snapshot) -> None:
        """Put a whole snapshot in place of the view (ValueError: refused, nothing changed)."""
        ...

    def update_gauges(self, metrics: Metrics) -> None:
        """After a change: the sink's own gauges, if it keeps any in `metrics`."""
        ...


class EventStream:
    """A background thread: SUB on `endpoint`, DEALER to `replay_endpoint`, into `sink`, within
    `limits` (module doc). `on_batch(batch)` observes each batch applied (its errors cost the
    observation, never the view); `snapshot_endpoint` is where an incomplete view bootstraps
    from (P's demand endpoint, or E's).

    Socket modes: vLLM's publisher *binds* a wildcard or ipc endpoint (`tcp://*:5557`) and
    *connects* to a concrete tcp address (`tcp://127.0.0.1:5557`). For the first the stream
    connects (the default); for the second pass `bind=True`: the SUB socket binds `endpoint` and
    the publisher connects to it. The replay ROUTER is always bound by vLLM, so the replay side
    always connects.
    """

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        *,
        sink: EventSink,
        limits: StreamLimits | None = None,
        topic: str = "",
        bind: bool = False,
        context: zmq.Context | None = None,
        metrics: Metrics | None = None,
        snapshot_endpoint: str | None = None,
        on_batch: Callable[[Any], None] | None = None,
    ) -> None:
        self.endpoint = _check_endpoint("endpoint", endpoint)
        self.bind = check_bool("bind", bind)
        self.replay_endpoint = (
            None if replay_endpoint is None else _check_endpoint("replay_endpoint", replay_endpoint)
        )
        self.topic = check_str("topic", topic).encode("utf-8")
        if not all(
            callable(getattr(sink, m, None))
            for m in ("attach", "apply", "clears", "reset", "load", "update_gauges")
        ):
            fail_type("sink", "an EventSink (KVIndexSink, EncoderCacheSink)", sink)
        if limits is None:
            limits = StreamLimits()
        elif not isinstance(limits, StreamLimits):
            fail_type("limits", "a StreamLimits", limits)
        if metrics is not None and not isinstance(metrics, Metrics):
            fail_type("metrics", "a Metrics", metrics)
        if context is not None and not isinstance(context, zmq.Context):
            fail_type("context", "a zmq.Context", context)
        if on_batch is not None:
            check_callable("on_batch", on_batch)
        self.limits = limits
        self.on_batch = on_batch
        self.metrics = metrics if metrics is not None else Metrics.default()
        self.snapshot_endpoint = (
            None
            if snapshot_endpoint is None
            else _check_endpoint("snapshot_endpoint", snapshot_endpoint)
        )
        # The snapshot's bounds: the limits', else the sink's (what its view can hold).
        self.max_snapshot_items = (
            sink.snapshot_items if limits.max_snapshot_items is None else limits.max_snapshot_items
        )
        self.max_snapshot_bytes = (
            sink.snapshot_bytes if limits.max_snapshot_bytes is None else limits.max_snapshot_bytes
        )
        sink.attach(self.check)  # refuses a sink another stream feeds
        self.sink = sink
        self._next_snapshot = 0.0  # monotonic time of the next snapshot attempt
        # A snapshot stamped ahead of the stream, unloaded until the stream reaches its stamp
        # (then put in place of the view), dropped at `_pending_until` (monotonic) if it never does.
        self._pending: Snapshot | None = None
        self._pending_until = 0.0
        # The incarnation of the snapshot last put in place since the publisher (re)connected:
        # the stream's, as far as the view knows; a snapshot of another is refused.
        self._incarnation: str | None = None
        self._ctx = context or zmq.Context.instance()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._started = threading.Event()
        self._start_error: BaseException | None = None
        self.error: BaseException | None = None  # what killed the loop, if it died
        self.applied_seq: int | None = None  # last seq applied (or skipped as lost)
        self.live_seq: int | None = None  # last seq received on the SUB socket
        self._label = sink.instance
        self._who = f"{sink.events} events {sink.instance}"  # what the log names
        self._reconnected = False  # a disconnect since the last frame
        # Everything published since the publisher started is applied (see the module doc).
        self.complete = False

    # ---- lifecycle ----------------------------------------------------------------------------

    def start(self) -> EventStream:
        """Connect and start the thread; returns once the sockets are connected.

        Raises InvalidArgument naming the endpoint if ZMQ refuses `endpoint` or
        `replay_endpoint` (`tcp://host:notaport`, an unknown transport).
        """
        if self._thread is not None:
            raise RuntimeError("EventStream already started")
        self._stop.clear()
        self._started.clear()
        self._start_error = self.error = None
        self._reconnected = False
        name = f"{self.sink.events}-events-{self._label}"
        thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread = thread
        thread.start()
        self._started.wait()  # _run always sets it, on failure too
        if self._start_error is not None:
            thread.join()
            self._thread = None
            raise self._start_error
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the thread and close its sockets (within about `poll_interval_s`, a replay in
        progress included); the sink keeps its last state."""
        timeout_s = check_float("timeout_s", timeout_s, 0)
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                raise RuntimeError("EventStream thread did not stop")
            self._thread = None

    def __enter__(self) -> EventStream:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def is_alive(self) -> bool:
        """Whether the loop is running (False before start, after stop, and once it died)."""
        return self._thread is not None and self._thread.is_alive()

    def check(self) -> None:
        """Raise StreamDied unless the loop is running (its error as the cause)."""
        if self.error is not None:
            raise StreamDied(
                f"{self.sink.events} event stream for {self._label} died: "
                f"{type(self.error).__name__}: {self.error}"
            ) from self.error
        if not self.is_alive:
            raise StreamDied(f"{self.sink.events} event stream for {self._label} is not running")

    # ---- the loop -----------------------------------------------------------------------------

    def _connect(self) -> zmq.Socket:
        """The SUB socket, connected; the replay endpoint tried once. InvalidArgument if ZMQ
        refuses either endpoint."""
        sub = self._ctx.socket(zmq.SUB)
        try:
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.RCVHWM, 100_000)  # vLLM's publisher hwm; bursts beyond replay
            sub.setsockopt(zmq.MAXMSGSIZE, self.limits.max_message_bytes)
            # reconnect fast (backing off to 1 s): a restarted publisher is seen while its seq
            # is still below the old one, and fewer live batches are lost to a blip
            sub.setsockopt(zmq.RECONNECT_IVL, 10)
            sub.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
            sub.setsockopt(zmq.SUBSCRIBE, self.topic)
            if self.bind:
                self._bind_to(sub, "endpoint", self.endpoint)
            else:
                self._connect_to(sub, "endpoint", self.endpoint)
            if self.replay_endpoint is not None:
                probe = self._ctx.socket(zmq.DEALER)
                try:
                    probe.setsockopt(zmq.LINGER, 0)
                    self._connect_to(probe, "replay_endpoint", self.replay_endpoint)
                finally:
                    probe.close(0)
        except BaseException:
            sub.close(0)
            raise
        return sub

    @staticmethod
    def _bind_to(sock: zmq.Socket, field: str, endpoint: str) -> None:
        try:
            sock.bind(endpoint)
        except zmq.ZMQError as exc:
            raise InvalidArgument(
                f"{field} must be a ZMQ endpoint this process can bind (bind=True), got "
                f"{show(endpoint)}: {exc}"
            ) from None

    @staticmethod
    def _connect_to(sock: zmq.Socket, field: str, endpoint: str) -> None:
        try:
            sock.connect(endpoint)
        except zmq.ZMQError as exc:
            raise InvalidArgument(
                f"{field} must be a ZMQ endpoint ZMQ can connect to, got {show(endpoint)}: {exc}"
            ) from None

    def _run(self) -> None:
        m = self.metrics
        try:
            sub = self._connect()
        except BaseException as exc:
            self._start_error = exc
            self._started.set()
            return
        # A dropped connection may be a publisher restart whose new seqs already overtook the
        # old ones (no seq going back to see): reset on every disconnect, replay from 0.
        monitor = sub.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        poller = zmq.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        m.subscriber_up.labels(self._label).set(1)
        m.complete.labels(self._label, self.sink.events).set(int(self.complete))
        self._started.set()
        if self.replay_endpoint is not None:
            self._initial_replay()
        timeout_ms = _ms(self.limits.poll_interval_s)
        stop = self._stop
        try:
            while not stop.is_set():
                ready = dict(poller.poll(timeout_ms))
                if self.snapshot_endpoint is not None:
                    self._snapshot_duties()
                if not ready:
                    continue
                if monitor in ready:
                    self._on_monitor(monitor)
                while not stop.is_set():  # drain what is queued; a flood still sees stop()
                    try:
                        frames = sub.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._handle(frames)
        except BaseException as exc:  # the socket failed: never die silently, never stale
            self.error = exc
            m.subscriber_failures.labels(self._label).inc()
            logger.exception("%s: the stream died; its view is reset", self._who)
            try:
                self._resync()
            except BaseException:
                logger.exception("%s: reset after the loop died failed", self._who)
        finally:
            m.subscriber_up.labels(self._label).set(0)
            try:
                sub.disable_monitor()
            finally:
                monitor.close(0)
                sub.close(0)

    def _on_monitor(self, monitor: zmq.Socket) -> None:
        while True:
            try:
                monitor.recv_multipart(zmq.NOBLOCK)  # only EVENT_DISCONNECTED is subscribed
            except zmq.Again:
                return
            logger.warning("%s: publisher disconnected; resetting the view", self._who)
            self._resync(count=self.applied_seq is not None)
            self.applied_seq = None  # replay from 0; live_seq kept to tell a restart
            self._reconnected = True
            self._forget_publisher("a disconnect")

    def _handle(self, frames: list[bytes]) -> None:
        """One message; whatever goes wrong in it costs a resync, never the loop."""
        try:
            self._on_frames(frames)
        except Exception:
            self.metrics.errors.labels(self._label).inc()
            logger.exception("%s: error handling a batch; resetting the view", self._who)
            self._resync()
            if self.live_seq is not None:
                self.applied_seq = self.live_seq  # the batch in hand is lost with the rest

    def _on_frames(self, frames: list[bytes]) -> None:
        m = self.metrics
        if len(frames) != 3 or len(frames[1]) != 8:
            m.malformed.labels(self._label).inc()
            logger.warning("%s: malformed frames (%d parts)", self._who, len(frames))
            return
        _topic, seq_bytes, payload = frames
        seq = int.from_bytes(seq_bytes, "big")
        reconnected, self._reconnected = self._reconnected, False
        if self.live_seq is not None and (
            seq <= self.live_seq or (reconnected and seq != self.live_seq + 1)
        ):
            m.restarts.labels(self._label).inc()
            logger.warning(
                "%s: seq %d after %d%s: publisher restart",
                self._who,
                seq,
                self.live_seq,
                " and a reconnect" if reconnected else "",
            )
            self._resync(count=self.applied_seq is not None)  # not twice after a disconnect
            self.applied_seq = None
            self._forget_publisher("a publisher restart")
        self.live_seq = seq
        if self.applied_seq is not None and seq <= self.applied_seq:
            return  # already applied from a replay
        expected = 0 if self.applied_seq is None else self.applied_seq + 1
        if seq > expected:
            m.gaps.labels(self._label).inc()
            self._recover(expected, seq)
        self._apply(seq, payload)

    def _apply(self, seq: int, payload: bytes) -> None:
        """Decode and apply one batch, all or nothing; a bad one is lost, so the view resets."""
        m = self.metrics
        try:
            batch = self.sink.apply(payload)
        except ValueError as exc:  # MalformedBatch, or what the index refuses
            m.malformed.labels(self._label).inc()
            logger.warning("%s: batch %d dropped (%s); resetting the view", self._who, seq, exc)
            self._resync()  # what it would have told is lost
            self.applied_seq = seq
            if self._pending is not None and seq == self._pending.stamp - 1:
                self._reach_stamp()
            return
        self.applied_seq = seq
        if (seq == 0 or self.sink.clears(batch)) and not self.complete:
            self.complete = True
            m.complete.labels(self._label, self.sink.events).set(1)
        m.batches.labels(self._label).inc()
        counts: dict[str, int] = {}
        for e in batch.events:
            kind = type(e).__name__
            counts[kind] = counts.get(kind, 0) + 1
        for kind, n in counts.items():
            m.events.labels(self._label, kind).inc(n)
        self.sink.update_gauges(self.metrics)
        if self.on_batch is not None:
            try:
                self.on_batch(batch)
            except Exception:  # an observer's bug costs its observation, never the view
                m.errors.labels(self._label).inc()
                logger.exception("%s: on_batch raised", self._who)
        if self._pending is not None and seq == self._pending.stamp - 1:
            self._reach_stamp()

    def _resync(self, count: bool = True) -> None:
        if count:
            self.metrics.resyncs.labels(self._label).inc()
        self.complete = False
        self.metrics.complete.labels(self._label, self.sink.events).set(0)
        self.sink.reset()
        self.sink.update_gauges(self.metrics)

    def _initial_replay(self) -> None:
        """At start, whatever the replay buffer holds, from seq 0: a view that joins while P is
        idle learns at once whether it is complete (the buffer starts at 0, or is empty: P has
        published nothing) instead of at P's next batch."""
        resynced = [False]
        try:
            self._replay(0, None, resynced)
        except _ReplayAborted as exc:
            logger.warning("%s: no initial replay (%s)", self._who, exc)
            self._resync(count=False)
            self.applied_seq = None
            return
        if self.applied_seq is None:  # an empty buffer: P has published nothing yet
            self.complete = True
            self.metrics.complete.labels(self._label, self.sink.events).set(1)

    # ---- snapshots ----------------------------------------------------------------------------

    def _snapshot_duties(self) -> None:
        """Between messages: settle a snapshot held aside; bootstrap an incomplete view when it
        is time."""
        now = time.monotonic()
        if self._pending is not None:
            self._pending_duties(now)
        if not self.complete and self._pending is None and now >= self._next_snapshot:
            self._bootstrap()

    def _pending_duties(self, now: float) -> None:
        """A snapshot held aside: dropped if the view became complete without it (a clear);
        put in place (and the batches past its stamp replayed) once the stream passed its stamp
        by a way `_apply` did not see (batches lost on the way); refused at its deadline."""
        snap = self._pending
        assert snap is not None
        if self.complete:
            self._pending = None
            logger.info(
                "%s events %s: the view became complete before the stream reached the snapshot's "
                "stamp %d (a clear); the snapshot is not needed",
                self.sink.events,
                self._label,
                snap.stamp,
            )
        elif self._position() >= snap.stamp - 1:
            self._pending = None
            self._install(snap)
        elif now >= self._pending_until:
            self._pending = None
            self._snapshot_failed(
                SnapshotRefused(
                    "stamp",
                    f"the stream stayed at {self._position()}, never reaching the snapshot's "
                    f"stamp {snap.stamp} within snapshot_deadline_s={self.limits.snapshot_deadline_s}",
                ),
                reset=False,  # never loaded: the view is as it was, incomplete
            )

    def _reach_stamp(self) -> None:
        """The stream just applied `stamp - 1` of the snapshot held aside: put it in place (it
        holds every batch so far, exactly)."""
        snap, self._pending = self._pending, None
        assert snap is not None
        self._install(snap)

    def _forget_publisher(self, why: str) -> None:
        """Another publisher process, perhaps: its incarnation is unknown again, and a snapshot
        held aside (of the old one's stream) is refused."""
        self._incarnation = None
        if self._pending is not None:
            snap, self._pending = self._pending, None
            self._snapshot_failed(
                SnapshotRefused(
                    "stamp", f"{why} before the stream reached the snapshot's stamp {snap.stamp}"
                ),
                reset=False,
            )

    def _position(self) -> int:
        """The last seq the stream has accounted for (-1: none): every batch up to it applied,
        or lost with a reset. Only ever a seq the publisher sent (live or replayed)."""
        return -1 if self.applied_seq is None else self.applied_seq

    def _bootstrap(self) -> None:
        """Fetch P's snapshot and use it (`_use_snapshot`)."""
        assert self.snapshot_endpoint is not None
        try:
            snap = fetch_snapshot(
                self.snapshot_endpoint,
                context=self._ctx,
                deadline_s=self.limits.snapshot_deadline_s,
                quiet_s=self.limits.replay_timeout_s * 2.5,
                max_blocks=self.max_snapshot_items,
                max_bytes=self.max_snapshot_bytes,
                cancelled=self._stop.is_set,
                kind=self.sink.snapshot_kind,
            )
        except SnapshotRefused as e:
            self._snapshot_failed(e, reset=False)
            return
        self._use_snapshot(snap)

    def _use_snapshot(self, snap: Snapshot) -> None:
        """Refuse a snapshot of another incarnation or stamped too far ahead; hold one stamped
        ahead of the stream aside until the stream reaches it; put any other in place."""
        if self._incarnation is not None and snap.incarnation != self._incarnation:
            self._snapshot_failed(
                SnapshotRefused(
                    "incarnation",
                    f"snapshot of incarnation {snap.incarnation!r}, the stream's is "
                    f"{self._incarnation!r} (another P process behind the demand endpoint?)",
                ),
                reset=False,
            )
            return
        at = self._position()
        if snap.stamp - 1 <= at:
            self._install(snap)
            return
        if snap.stamp - 1 - at > self.limits.max_stamp_ahead:
            self._snapshot_failed(
                SnapshotRefused(
                    "stamp",
                    f"snapshot stamped {snap.stamp}, the stream is at {at} "
                    f"(max_stamp_ahead={self.limits.max_stamp_ahead})",
                ),
                reset=False,
            )
            return
        self._pending = snap
        self._pending_until = time.monotonic() + self.limits.snapshot_deadline_s
        logger.info(
            "%s events %s: snapshot stamped %d, the stream at %d: held until the stream gets "
            "there (the view stays incomplete)",
            self.sink.events,
            self._label,
            snap.stamp,
            at,
        )

    def _install(self, snap: Snapshot) -> None:
        """Put a snapshot the stream has reached in place of the view and replay the batches
        the view applied past its stamp; the view is then complete."""
        stamp, applied = snap.stamp, self.applied_seq
        try:
            self.sink.load(snap)
        except ValueError as e:
            self._snapshot_failed(SnapshotRefused("malformed", f"snapshot: {e}"), reset=False)
            return
        self.applied_seq = stamp - 1 if stamp > 0 else None
        if applied is not None and applied >= stamp:  # the view had gone past the stamp
            resynced = [False]
            try:
                if self.replay_endpoint is None:
                    raise _ReplayAborted("unavailable", "no replay endpoint")
                self._replay(stamp, applied + 1, resynced)
            except _ReplayAborted as e:
                self.applied_seq = applied
                self._snapshot_failed(
                    SnapshotRefused("replay", f"batches {stamp}..{applied} after the stamp: {e}"),
                    reset=True,
                )
                return
            if resynced[0]:
                self.applied_seq = applied
                self._snapshot_failed(
                    SnapshotRefused("replay", f"the replay buffer no longer holds batch {stamp}"),
                    reset=True,
                )
                return
        self._incarnation = snap.incarnation
        self.complete = True
        m = self.metrics
        m.complete.labels(self._label, self.sink.events).set(1)
        m.snapshots.labels(self._label, "ok").inc()
        self.sink.update_gauges(self.metrics)
        logger.info(
            "%s events %s: view bootstrapped from P's snapshot (%d entries, stamp %d)",
            self.sink.events,
            self._label,
            len(snap.block_ids) + len(snap.entries),
            stamp,
        )

    def _snapshot_failed(self, e: SnapshotRefused, *, reset: bool) -> None:
        self.metrics.snapshots.labels(self._label, e.reason).inc()
        logger.warning("%s: no snapshot (%s): %s", self._who, e.reason, e)
        if reset:
            self._resync()
        self._next_snapshot = time.monotonic() + self.limits.snapshot_retry_s

    # ---- gaps ---------------------------------------------------------------------------------

    def _recover(self, start: int, upto: int) -> None:
        """Fill [start, upto) from the replay socket, completely and in order, or reset the view;
        either way `applied_seq` ends at `upto - 1`, so the live batch `upto` applies next."""
        resynced = [False]
        try:
            if self.replay_endpoint is None:
                raise _ReplayAborted("unavailable", "no replay endpoint")
            if upto - start > self.limits.max_replay_batches:
                raise _ReplayAborted(
                    "bound",
                    f"gap of {upto - start} batches > max_replay_batches={self.limits.max_replay_batches}",
                )
            self._replay(start, upto, resynced)
        except _ReplayAborted as exc:
            if exc.reason != "unavailable":
                self.metrics.replay_aborts.labels(self._label, exc.reason).inc()
            logger.warning(
                "%s: batches %d..%d lost (%s); resetting the view",
                self._who,
                start,
                upto - 1,
                exc,
            )
            self._resync(count=not resynced[0])
            self.applied_seq = upto - 1

    def _replay(self, start: int, upto: int | None, resynced: list[bool]) -> None:
        """Ask for seq >= start and apply the replies as they come, until `upto - 1` is applied
        (`upto` None: until the publisher's end marker, whatever its buffer holds).

        A first reply after `start` is vLLM's buffer having moved on: the view resets, then the
        rest applies (`resynced[0]` set). Raises _ReplayAborted on anything else short of the
        whole gap; the caller resets the view.
        """
        m = self.metrics
        m.replays.labels(self._label).inc()
        dealer = self._ctx.socket(zmq.DEALER)
        try:
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.setsockopt(zmq.MAXMSGSIZE, self.limits.max_message_bytes)
            assert self.replay_endpoint is not None
            try:
                dealer.connect(self.replay_endpoint)
                dealer.send_multipart([b"", start.to_bytes(8, "big")])
            except zmq.ZMQError as exc:
                raise _ReplayAborted("error", f"replay request failed: {exc}") from None
            now = time.monotonic()
            deadline = now + self.limits.replay_deadline_s
            quiet_until = now + self.limits.replay_timeout_s
            expected, nbytes = start, 0
            while upto is None or expected < upto:
                if self._stop.is_set():
                    raise _ReplayAborted("stop", "stopped during the replay")
                now = time.monotonic()
                if now >= deadline:
                    raise _ReplayAborted(
                        "deadline", f"replay ran past {self.limits.replay_deadline_s}s"
                    )
                if now >= quiet_until:
                    raise _ReplayAborted(
                        "timeout", f"replay silent for {self.limits.replay_timeout_s}s"
                    )
                wait = min(deadline, quiet_until, now + self.limits.poll_interval_s) - now
                if not dealer.poll(_ms(wait)):
                    continue
                frames = dealer.recv_multipart()
                quiet_until = time.monotonic() + self.limits.replay_timeout_s
                # vLLM >= 0.26: (b"", topic, seq, payload); before: (b"", seq, payload)
                if len(frames) == 4:
                    seq_bytes, payload = frames[2], frames[3]
                elif len(frames) == 3:
                    seq_bytes, payload = frames[1], frames[2]
                else:
                    seq_bytes, payload = b"", b""
                if len(seq_bytes) != 8:
                    m.malformed.labels(self._label).inc()
                    raise _ReplayAborted("malformed", f"malformed reply ({len(frames)} parts)")
                if seq_bytes == END_SEQ and upto is None:
                    return  # the buffer's end: everything it held is applied
                if seq_bytes == END_SEQ:
                    raise _ReplayAborted("short", f"replay ended at {expected}, short of {upto}")
                seq = int.from_bytes(seq_bytes, "big")
                if not start <= seq <= (seq if upto is None else upto):
                    raise _ReplayAborted(
                        "out_of_range", f"replayed seq {seq} outside [{start}, {upto}]"
                    )
                if seq != expected:
                    if expected != start or seq < start:
                        raise _ReplayAborted("order", f"replayed seq {seq}, expected {expected}")
                    self._resync()  # the buffer starts after `start`: what came before is lost
                    resynced[0] = True
                    self.applied_seq = seq - 1
                    if upto is not None and seq == upto:
                        return
                nbytes += len(payload)
                if nbytes > self.limits.max_replay_bytes:
                    raise _ReplayAborted(
                        "bytes", f"replay past max_replay_bytes={self.limits.max_replay_bytes}"
                    )
                self._apply(seq, payload)
                expected = seq + 1
        finally:
            dealer.close(0)
