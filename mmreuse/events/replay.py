"""Gap replay for an `EventStream`: ask the publisher's replay ROUTER for every batch from a
seq on, and apply the replies completely and in order, or abort (`ReplayAborted`) so that the
stream resets its view (the rules: `events.stream`'s module doc).
"""

from __future__ import annotations

import logging
import math
import time
from typing import TYPE_CHECKING

import zmq

if TYPE_CHECKING:
    from .stream import EventStream

logger = logging.getLogger("mmreuse.events.stream")

END_SEQ = (-1).to_bytes(8, "big", signed=True)


class ReplayAborted(Exception):
    """A replay that cannot fill the gap; `reason` is a fixed metric label."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


def ms(seconds: float) -> int:
    """A poll timeout in ZMQ's milliseconds, never 0 (0 would turn a wait into a busy loop)."""
    return max(1, math.ceil(seconds * 1000))


def initial_replay(s: EventStream) -> None:
    """At start, whatever the replay buffer holds, from seq 0: a view that joins while P is
    idle learns at once whether it is complete (the buffer starts at 0, or is empty: P has
    published nothing) instead of at P's next batch."""
    resynced = [False]
    try:
        replay(s, 0, None, resynced)
    except ReplayAborted as exc:
        logger.warning("%s: no initial replay (%s)", s.who, exc)
        s.resync(count=False)
        s.applied_seq = None
        return
    if s.applied_seq is None:  # an empty buffer: P has published nothing yet
        s.complete = True
        s.metrics.complete.labels(s.label, s.sink.events).set(1)


def recover(s: EventStream, start: int, upto: int) -> None:
    """Fill [start, upto) from the replay socket, completely and in order, or reset the view;
    either way `applied_seq` ends at `upto - 1`, so the live batch `upto` applies next."""
    resynced = [False]
    try:
        if s.replay_endpoint is None:
            raise ReplayAborted("unavailable", "no replay endpoint")
        if upto - start > s.limits.max_replay_batches:
            raise ReplayAborted(
                "bound",
                f"gap of {upto - start} batches > max_replay_batches={s.limits.max_replay_batches}",
            )
        replay(s, start, upto, resynced)
    except ReplayAborted as exc:
        if exc.reason != "unavailable":
            s.metrics.replay_aborts.labels(s.label, exc.reason).inc()
        logger.warning(
            "%s: batches %d..%d lost (%s); resetting the view",
            s.who,
            start,
            upto - 1,
            exc,
        )
        s.resync(count=not resynced[0])
        s.applied_seq = upto - 1


def replay(s: EventStream, start: int, upto: int | None, resynced: list[bool]) -> None:
    """Ask for seq >= start and apply the replies as they come, until `upto - 1` is applied
    (`upto` None: until the publisher's end marker, whatever its buffer holds).

    A first reply after `start` is vLLM's buffer having moved on: the view resets, then the
    rest applies (`resynced[0]` set). Raises ReplayAborted on anything else short of the
    whole gap; the caller resets the view.
    """
    m = s.metrics
    m.replays.labels(s.label).inc()
    dealer = s.context.socket(zmq.DEALER)
    try:
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.MAXMSGSIZE, s.limits.max_message_bytes)
        assert s.replay_endpoint is not None
        try:
            dealer.connect(s.replay_endpoint)
            dealer.send_multipart([b"", start.to_bytes(8, "big")])
        except zmq.ZMQError as exc:
            raise ReplayAborted("error", f"replay request failed: {exc}") from None
        now = time.monotonic()
        deadline = now + s.limits.replay_deadline_s
        quiet_until = now + s.limits.replay_timeout_s
        expected, nbytes = start, 0
        while upto is None or expected < upto:
            if s.stopping():
                raise ReplayAborted("stop", "stopped during the replay")
            now = time.monotonic()
            if now >= deadline:
                raise ReplayAborted("deadline", f"replay ran past {s.limits.replay_deadline_s}s")
            if now >= quiet_until:
                raise ReplayAborted("timeout", f"replay silent for {s.limits.replay_timeout_s}s")
            wait = min(deadline, quiet_until, now + s.limits.poll_interval_s) - now
            if not dealer.poll(ms(wait)):
                continue
            frames = dealer.recv_multipart()
            quiet_until = time.monotonic() + s.limits.replay_timeout_s
            # vLLM >= 0.26: (b"", topic, seq, payload); before: (b"", seq, payload)
            if len(frames) == 4:
                seq_bytes, payload = frames[2], frames[3]
            elif len(frames) == 3:
                seq_bytes, payload = frames[1], frames[2]
            else:
                seq_bytes, payload = b"", b""
            if len(seq_bytes) != 8:
                m.malformed.labels(s.label).inc()
                raise ReplayAborted("malformed", f"malformed reply ({len(frames)} parts)")
            if seq_bytes == END_SEQ and upto is None:
                return  # the buffer's end: everything it held is applied
            if seq_bytes == END_SEQ:
                raise ReplayAborted("short", f"replay ended at {expected}, short of {upto}")
            seq = int.from_bytes(seq_bytes, "big")
            if not start <= seq <= (seq if upto is None else upto):
                raise ReplayAborted("out_of_range", f"replayed seq {seq} outside [{start}, {upto}]")
            if seq != expected:
                if expected != start or seq < start:
                    raise ReplayAborted("order", f"replayed seq {seq}, expected {expected}")
                s.resync()  # the buffer starts after `start`: what came before is lost
                resynced[0] = True
                s.applied_seq = seq - 1
                if upto is not None and seq == upto:
                    return
            nbytes += len(payload)
            if nbytes > s.limits.max_replay_bytes:
                raise ReplayAborted(
                    "bytes", f"replay past max_replay_bytes={s.limits.max_replay_bytes}"
                )
            s.apply(seq, payload)
            expected = seq + 1
    finally:
        dealer.close(0)
