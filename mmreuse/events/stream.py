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
import threading
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
from .bootstrap import SnapshotBootstrap
from .replay import initial_replay, ms, recover
from .snapshot import Snapshot

logger = logging.getLogger(__name__)


class StreamDied(RuntimeError):
    """The stream's loop is not running (stopped, or died on the error in `__cause__`): its
    view is no longer followed, so it must not be trusted."""


def _check_endpoint(field: str, value: object) -> str:
    endpoint = check_str(field, value)
    if "://" not in endpoint:
        fail_value(field, "a ZMQ endpoint like tcp://host:5557", endpoint)
    return endpoint


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
        self.bootstrap = SnapshotBootstrap(self)  # the snapshot state (`events.bootstrap`)
        self.context = context or zmq.Context.instance()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._started = threading.Event()
        self._start_error: BaseException | None = None
        self.error: BaseException | None = None  # what killed the loop, if it died
        self.applied_seq: int | None = None  # last seq applied (or skipped as lost)
        self.live_seq: int | None = None  # last seq received on the SUB socket
        self.label = sink.instance
        self.who = f"{sink.events} events {sink.instance}"  # what the log names
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
        name = f"{self.sink.events}-events-{self.label}"
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
                f"{self.sink.events} event stream for {self.label} died: "
                f"{type(self.error).__name__}: {self.error}"
            ) from self.error
        if not self.is_alive:
            raise StreamDied(f"{self.sink.events} event stream for {self.label} is not running")

    def stopping(self) -> bool:
        """Whether `stop()` was asked (a replay or a snapshot fetch in progress gives up)."""
        return self._stop.is_set()

    # ---- the loop -----------------------------------------------------------------------------

    def _connect(self) -> zmq.Socket:
        """The SUB socket, connected; the replay endpoint tried once. InvalidArgument if ZMQ
        refuses either endpoint."""
        sub = self.context.socket(zmq.SUB)
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
                probe = self.context.socket(zmq.DEALER)
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
        m.subscriber_up.labels(self.label).set(1)
        m.complete.labels(self.label, self.sink.events).set(int(self.complete))
        self._started.set()
        if self.replay_endpoint is not None:
            initial_replay(self)
        timeout_ms = ms(self.limits.poll_interval_s)
        stop = self._stop
        try:
            while not stop.is_set():
                ready = dict(poller.poll(timeout_ms))
                if self.snapshot_endpoint is not None:
                    self.bootstrap.duties()
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
            m.subscriber_failures.labels(self.label).inc()
            logger.exception("%s: the stream died; its view is reset", self.who)
            try:
                self.resync()
            except BaseException:
                logger.exception("%s: reset after the loop died failed", self.who)
        finally:
            m.subscriber_up.labels(self.label).set(0)
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
            logger.warning("%s: publisher disconnected; resetting the view", self.who)
            self.resync(count=self.applied_seq is not None)
            self.applied_seq = None  # replay from 0; live_seq kept to tell a restart
            self._reconnected = True
            self.bootstrap.forget_publisher("a disconnect")

    def _handle(self, frames: list[bytes]) -> None:
        """One message; whatever goes wrong in it costs a resync, never the loop."""
        try:
            self._on_frames(frames)
        except Exception:
            self.metrics.errors.labels(self.label).inc()
            logger.exception("%s: error handling a batch; resetting the view", self.who)
            self.resync()
            if self.live_seq is not None:
                self.applied_seq = self.live_seq  # the batch in hand is lost with the rest

    def _on_frames(self, frames: list[bytes]) -> None:
        m = self.metrics
        if len(frames) != 3 or len(frames[1]) != 8:
            m.malformed.labels(self.label).inc()
            logger.warning("%s: malformed frames (%d parts)", self.who, len(frames))
            return
        _topic, seq_bytes, payload = frames
        seq = int.from_bytes(seq_bytes, "big")
        reconnected, self._reconnected = self._reconnected, False
        if self.live_seq is not None and (
            seq <= self.live_seq or (reconnected and seq != self.live_seq + 1)
        ):
            m.restarts.labels(self.label).inc()
            logger.warning(
                "%s: seq %d after %d%s: publisher restart",
                self.who,
                seq,
                self.live_seq,
                " and a reconnect" if reconnected else "",
            )
            self.resync(count=self.applied_seq is not None)  # not twice after a disconnect
            self.applied_seq = None
            self.bootstrap.forget_publisher("a publisher restart")
        self.live_seq = seq
        if self.applied_seq is not None and seq <= self.applied_seq:
            return  # already applied from a replay
        expected = 0 if self.applied_seq is None else self.applied_seq + 1
        if seq > expected:
            m.gaps.labels(self.label).inc()
            recover(self, expected, seq)
        self.apply(seq, payload)

    def apply(self, seq: int, payload: bytes) -> None:
        """Decode and apply one batch, all or nothing; a bad one is lost, so the view resets."""
        m = self.metrics
        try:
            batch = self.sink.apply(payload)
        except ValueError as exc:  # MalformedBatch, or what the index refuses
            m.malformed.labels(self.label).inc()
            logger.warning("%s: batch %d dropped (%s); resetting the view", self.who, seq, exc)
            self.resync()  # what it would have told is lost
            self.applied_seq = seq
            self.bootstrap.applied(seq)
            return
        self.applied_seq = seq
        if (seq == 0 or self.sink.clears(batch)) and not self.complete:
            self.complete = True
            m.complete.labels(self.label, self.sink.events).set(1)
        m.batches.labels(self.label).inc()
        counts: dict[str, int] = {}
        for e in batch.events:
            kind = type(e).__name__
            counts[kind] = counts.get(kind, 0) + 1
        for kind, n in counts.items():
            m.events.labels(self.label, kind).inc(n)
        self.sink.update_gauges(self.metrics)
        if self.on_batch is not None:
            try:
                self.on_batch(batch)
            except Exception:  # an observer's bug costs its observation, never the view
                m.errors.labels(self.label).inc()
                logger.exception("%s: on_batch raised", self.who)
        self.bootstrap.applied(seq)

    def resync(self, count: bool = True) -> None:
        if count:
            self.metrics.resyncs.labels(self.label).inc()
        self.complete = False
        self.metrics.complete.labels(self.label, self.sink.events).set(0)
        self.sink.reset()
        self.sink.update_gauges(self.metrics)
