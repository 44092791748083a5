"""KVEventSubscriber: follow one vLLM instance's KV events over ZMQ into a RemoteKVIndex.

vLLM's ZmqEventPublisher (kv_events.py) sends each batch as a PUB multipart message
`(topic, seq as 8 bytes big-endian, msgpack payload)`, seq counting from 0 per publisher
process, and serves a ROUTER replay socket: a request `(b"", start_seq)` from a DEALER gets
`(b"", topic, seq, payload)` for every buffered batch with seq >= start_seq, then the end
marker `(b"", b"", (-1 as 8 signed bytes), b"")` (vLLM < 0.26 sends no topic frame in replies;
both are accepted). The buffer holds the last `buffer_steps`. Frames and request never changed
from 0.9.0 to 0.33.0.

The subscriber applies batches in order. On a gap it asks for a replay; if the replay cannot
cover the gap (the buffer moved on, no replay endpoint, a timeout) or a batch is lost to a
malformed payload, the instance's view is reset (a resync): missing a BlockRemoved would make
the index claim blocks P no longer holds. A publisher restart (seq going back) also resets
the view: the new process starts with an empty prefix cache.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator

import zmq

from .index import RemoteKVIndex
from .metrics import Metrics
from .wire import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, MalformedBatch, decode_batch

logger = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)


class KVEventSubscriber:
    """A background thread: SUB on `endpoint`, DEALER to `replay_endpoint`, into `index`."""

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        topic: str = "",
        index: RemoteKVIndex | None = None,
        *,
        metrics: Metrics | None = None,
        poll_interval_s: float = 0.05,
        replay_timeout_s: float = 2.0,
        context: zmq.Context | None = None,
    ) -> None:
        if not isinstance(endpoint, str) or "://" not in endpoint:
            raise ValueError(f"endpoint must be a ZMQ endpoint like tcp://host:5557, got {endpoint!r}")
        if replay_endpoint is not None and (not isinstance(replay_endpoint, str)
                                            or "://" not in replay_endpoint):
            raise ValueError(f"replay_endpoint must be a ZMQ endpoint or None, got {replay_endpoint!r}")
        if not isinstance(topic, str):
            raise ValueError(f"topic must be a str, got {topic!r}")
        for name, value in (("poll_interval_s", poll_interval_s), ("replay_timeout_s", replay_timeout_s)):
            if not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"{name} must be > 0, got {value!r}")
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic.encode("utf-8")
        self.index = index if index is not None else RemoteKVIndex()
        if not isinstance(self.index, RemoteKVIndex):
            raise ValueError(f"index must be a RemoteKVIndex, got {type(index).__name__}")
        self.metrics = metrics if metrics is not None else Metrics.default()
        self.poll_interval_s = float(poll_interval_s)
        self.replay_timeout_s = float(replay_timeout_s)
        self._ctx = context or zmq.Context.instance()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._started = threading.Event()
        self.applied_seq: int | None = None  # last seq applied (or skipped as lost)
        self.live_seq: int | None = None  # last seq received on the SUB socket
        self._label = self.index.instance

    # ---- lifecycle ----------------------------------------------------------------------------

    def start(self) -> KVEventSubscriber:
        """Connect and start the thread; returns once the sockets are connected."""
        if self._thread is not None:
            raise RuntimeError("KVEventSubscriber already started")
        self._thread = threading.Thread(target=self._run, name=f"kv-events-{self._label}",
                                        daemon=True)
        self._thread.start()
        self._started.wait()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the thread and close its sockets."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                raise RuntimeError("KVEventSubscriber thread did not stop")
            self._thread = None

    def __enter__(self) -> KVEventSubscriber:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---- the loop -----------------------------------------------------------------------------

    def _run(self) -> None:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, 100_000)  # vLLM's publisher hwm; bursts beyond are replayed
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        sub.connect(self.endpoint)
        poller = zmq.Poller()
        poller.register(sub, zmq.POLLIN)
        self._started.set()
        try:
            while not self._stop.is_set():
                if not dict(poller.poll(int(self.poll_interval_s * 1000))):
                    continue
                while True:  # drain what is queued
                    try:
                        frames = sub.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._on_frames(frames)
        except Exception:  # never die silently
            logger.exception("KV-event subscriber for %s stopped on an error", self._label)
            raise
        finally:
            sub.close(0)

    def _on_frames(self, frames: list[bytes]) -> None:
        m = self.metrics
        if len(frames) != 3 or len(frames[1]) != 8:
            m.malformed.labels(self._label).inc()
            logger.warning("KV events %s: malformed frames (%d parts)", self._label, len(frames))
            return
        topic, seq_bytes, payload = frames
        seq = int.from_bytes(seq_bytes, "big")
        if self.live_seq is not None and seq <= self.live_seq:
            m.restarts.labels(self._label).inc()
            logger.warning("KV events %s: seq went back %d -> %d: publisher restart", self._label,
                           self.live_seq, seq)
            self._resync()
            self.applied_seq = None
        self.live_seq = seq
        if self.applied_seq is not None and seq <= self.applied_seq:
            return  # already applied from a replay
        expected = 0 if self.applied_seq is None else self.applied_seq + 1
        if seq > expected:
            m.gaps.labels(self._label).inc()
            self._recover(expected, seq)
            if self.applied_seq is not None and seq <= self.applied_seq:
                return
        self._apply(seq, payload)

    def _apply(self, seq: int, payload: bytes) -> None:
        m = self.metrics
        try:
            batch = decode_batch(payload)
            self.index.apply(batch)
        except (MalformedBatch, ValueError) as exc:
            m.malformed.labels(self._label).inc()
            logger.warning("KV events %s: batch %d dropped (%s); resetting the view", self._label,
                           seq, exc)
            self._resync()  # what it would have told is lost
            self.applied_seq = seq
            return
        self.applied_seq = seq
        self._count(batch)

    def _count(self, batch: KVEventBatch) -> None:
        m = self.metrics
        m.batches.labels(self._label).inc()
        stored = removed = cleared = 0
        for e in batch.events:
            if isinstance(e, BlockStored):
                stored += 1
            elif isinstance(e, BlockRemoved):
                removed += 1
            elif isinstance(e, AllBlocksCleared):
                cleared += 1
        for kind, n in (("BlockStored", stored), ("BlockRemoved", removed),
                        ("AllBlocksCleared", cleared)):
            if n:
                m.events.labels(self._label, kind).inc(n)
        for medium in self.index.media() or ("GPU",):
            m.index_size.labels(self._label, medium).set(self.index.size(medium))

    def _resync(self) -> None:
        self.metrics.resyncs.labels(self._label).inc()
        self.index.clear()

    def _recover(self, start: int, upto: int) -> None:
        """Fill [start, upto) from the replay socket, or reset the view."""
        replayed = list(self._replay(start)) if self.replay_endpoint else []
        batches = [(s, p) for s, p in replayed if s >= start]
        if not batches or batches[0][0] != start:
            logger.warning("KV events %s: batches %d..%d lost (replay %s); resetting the view",
                           self._label, start, upto - 1,
                           "unavailable" if not self.replay_endpoint else
                           f"starts at {batches[0][0] if batches else 'nothing'}")
            self._resync()
            self.applied_seq = (batches[0][0] - 1) if batches else upto - 1
        for s, p in batches:
            if self.applied_seq is None or s == self.applied_seq + 1:
                self._apply(s, p)

    def _replay(self, start: int) -> Iterator[tuple[int, bytes]]:
        m = self.metrics
        m.replays.labels(self._label).inc()
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.replay_endpoint)
        try:
            dealer.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                if not dealer.poll(int(self.replay_timeout_s * 1000)):
                    logger.warning("KV events %s: replay timed out", self._label)
                    return
                frames = dealer.recv_multipart()
                # vLLM >= 0.26: (b"", topic, seq, payload); before: (b"", seq, payload)
                if len(frames) == 4:
                    _, _topic, seq_bytes, payload = frames
                elif len(frames) == 3:
                    _, seq_bytes, payload = frames
                else:
                    seq_bytes = b""
                if len(seq_bytes) != 8:
                    m.malformed.labels(self._label).inc()
                    return
                if seq_bytes == END_SEQ:
                    return
                yield int.from_bytes(seq_bytes, "big"), payload
        finally:
            dealer.close(0)
