"""A test publisher with vLLM 0.33.0's ZmqEventPublisher frames and replay protocol.

PUB (an XPUB, so that a test can wait until a subscriber's subscription has arrived:
`wait_joined`, ZMQ's slow joiner waited out on a condition): (topic, seq 8-byte big-endian,
msgpack payload); ROUTER replay: a request
(identity, b"", start_seq) gets (identity, b"", topic, seq, payload) per buffered batch with
seq >= start_seq, then (identity, b"", b"", END_SEQ, b""). Extra knobs for tests: drop a batch
from the PUB stream while keeping it in the replay buffer, send raw payloads, restart, and a
`replay_script` that answers a replay request with any frames (a hostile replay server), sent
until the script ends, the publisher closes, or MAX_SCRIPTED_FRAMES / MAX_SCRIPTED_S.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from itertools import count

import zmq

from mmreuse.events import END_SEQ, BlockStored, KVEventBatch, encode_batch
from tests.support.waiting import WAIT_S, wait_for


def _bind(sock: zmq.Socket, endpoint: str, timeout_s: float = 5.0) -> None:
    """Bind, retrying while a just-closed socket still holds the port (a restart)."""
    end = time.monotonic() + timeout_s
    while True:
        try:
            sock.bind(endpoint)
            return
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EADDRINUSE or time.monotonic() > end:
                raise
            time.sleep(0.05)


# A scripted (hostile) replay: the frames after (identity, b"") for a request of `start`, given
# the buffered (seq, payload) pairs >= start.
ReplayScript = Callable[[int, list[tuple[int, bytes]]], Iterable[list[bytes]]]
MAX_SCRIPTED_FRAMES = 200_000
MAX_SCRIPTED_S = 10.0


class TestPublisher:
    __test__ = False  # not a pytest class

    def __init__(
        self,
        ctx: zmq.Context,
        topic: str = "",
        buffer_steps: int = 10_000,
        pub_endpoint: str = "tcp://127.0.0.1:*",
        replay_endpoint: str = "tcp://127.0.0.1:*",
    ):
        self.ctx = ctx
        self.topic = topic.encode()
        self.pub = ctx.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.XPUB_VERBOSE, 1)  # every subscription, a repeated one too
        self.pub.setsockopt(zmq.SNDHWM, 100_000)
        self.subscriptions = 0  # subscriptions received (`joined`)
        self.pub.setsockopt(zmq.LINGER, 0)
        _bind(self.pub, pub_endpoint)
        self.endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay = ctx.socket(zmq.ROUTER)
        self.replay.setsockopt(zmq.LINGER, 0)
        self.replay.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a gone client raises, not blocks
        _bind(self.replay, replay_endpoint)
        self.replay_endpoint = self.replay.getsockopt_string(zmq.LAST_ENDPOINT)
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self.seq = count()
        self.lock = threading.Lock()
        self.running = True
        self.replays_served = 0
        self.replay_script: ReplayScript | None = None
        self.thread = threading.Thread(target=self._serve_replay, daemon=True)
        self.thread.start()

    def publish(self, batch: KVEventBatch | bytes, *, drop: bool = False) -> int:
        """Publish one batch (or raw payload bytes); `drop` keeps it out of the PUB stream only."""
        payload = batch if isinstance(batch, bytes) else encode_batch(batch)
        with self.lock:
            seq = next(self.seq)
            self.buffer.append((seq, payload))
            if not drop:
                self.pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload))
        return seq

    def joined(self, n: int = 1) -> bool:
        """Whether `n` subscriptions have reached the PUB socket (a subscriber counts once per
        (re)connect): every batch published from then on reaches it."""
        with self.lock:
            while True:
                try:
                    msg = self.pub.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                self.subscriptions += msg[:1] == b"\x01"
            return self.subscriptions >= n

    def wait_joined(self, n: int = 1, *, replays: int = 0, timeout: float = WAIT_S) -> bool:
        """Wait until `joined(n)` and `replays` replay requests are served (instead of sleeping
        out the slow joiner). A stream with a replay endpoint asks for one as it starts: with
        `replays=1`, no batch published from then on can land in that replay."""
        return wait_for(lambda: self.joined(n) and self.replays_served >= replays, timeout)

    def send_raw(self, frames: list[bytes]) -> None:
        with self.lock:
            self.pub.send_multipart(frames)

    def _serve_replay(self) -> None:
        poller = zmq.Poller()
        poller.register(self.replay, zmq.POLLIN)
        while self.running:
            if not dict(poller.poll(50)):
                continue
            frame = self.replay.recv_multipart()
            if len(frame) != 3:
                continue
            client_id, _, start_bytes = frame
            start = int.from_bytes(start_bytes, "big")
            with self.lock:
                items = [(s, p) for s, p in self.buffer if s >= start]
            if self.replay_script is not None:
                self._serve_script(client_id, self.replay_script(start, items))
                self.replays_served += 1
                continue
            try:
                for s, p in items:
                    self.replay.send_multipart(
                        (client_id, b"", self.topic, s.to_bytes(8, "big"), p)
                    )
                self.replay.send_multipart((client_id, b"", b"", END_SEQ, b""))
            except zmq.ZMQError:  # the client went away
                continue
            self.replays_served += 1

    def _serve_script(self, client_id: bytes, frames: Iterable[list[bytes]]) -> None:
        end = time.monotonic() + MAX_SCRIPTED_S
        for i, f in enumerate(frames):
            if not self.running or i >= MAX_SCRIPTED_FRAMES or time.monotonic() > end:
                return
            try:
                self.replay.send_multipart([client_id, b"", *f], zmq.NOBLOCK)
            except zmq.Again:  # the client is not reading: wait a little
                time.sleep(0.001)
            except zmq.ZMQError:  # the client went away
                return

    def close(self) -> None:
        self.running = False
        self.thread.join(2)
        self.pub.close(0)
        self.replay.close(0)


def stored(hashes, medium="GPU", **kw) -> BlockStored:
    """A BlockStored of `hashes` (no tokens, no parent), as a fixture event."""
    return BlockStored(
        block_hashes=list(hashes),
        parent_block_hash=None,
        token_ids=[],
        block_size=16,
        lora_id=None,
        medium=medium,
        lora_name=None,
        **kw,
    )


def batch(*events, ts=1.0):
    return KVEventBatch(ts=ts, events=list(events), data_parallel_rank=0)
