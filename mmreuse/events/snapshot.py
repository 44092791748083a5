"""Fetch a P's KV snapshot (`demand_query.SnapshotQuery` -> `KVSnapshot` chunks) or its
encoder-cache snapshot (`ECSnapshotQuery` -> `ECSnapshot`) over its demand endpoint, whole or
not at all, bounded against a hostile P.

`fetch_snapshot` connects a DEALER of its own, asks for chunk after chunk, and returns the
snapshot (stamp, incarnation, ids, counts) or raises `SnapshotRefused` with a named reason:
`error` (P's DemandError: no KV events, index off, ...), `timeout` (past the deadline),
`malformed` (a frame that is no answer, a chunk that does not continue the last one or changes
its stamp / incarnation / total), `bound` (more ids or entries than `max_blocks`, refused at
the first chunk from its `total`, or answers past `max_bytes` in all), `stop`.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

import zmq

from ..demand_query import (
    MAX_ANSWER_BYTES,
    DemandError,
    ECEntry,
    ECSnapshot,
    ECSnapshotQuery,
    KVSnapshot,
    MalformedAnswer,
    SnapshotQuery,
    decode_answer,
    encode,
)
from ..validate import check_float, check_int


@dataclass(frozen=True, slots=True)
class Snapshot:
    """A whole snapshot as of event batch `stamp`: P's prefix cache (`block_ids`, `counts`),
    or its encoder cache (`entries`)."""

    stamp: int
    incarnation: str
    block_ids: list[int]
    counts: list[int]
    entries: list[ECEntry]


class SnapshotRefused(Exception):
    """No usable snapshot; `reason` is a short label (metrics), the message says more."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


def fetch_snapshot(
    endpoint: str,
    *,
    context: zmq.Context | None = None,
    deadline_s: float = 30.0,
    quiet_s: float = 5.0,
    max_blocks: int = 1 << 22,
    max_bytes: int | None = None,
    cancelled: Callable[[], bool] = lambda: False,
    kind: str = "kv",
) -> Snapshot:
    """P's whole KV snapshot from its demand endpoint, within `deadline_s` in all, each chunk
    within `quiet_s` of its ask, `max_blocks` and `max_bytes` (the answers' frames in all, None:
    unbounded; a chunk at most `MAX_ANSWER_BYTES` past it); `cancelled()` (checked every 50 ms)
    ends it (reason `stop`). `kind`: "kv" (KVSnapshot) or "ec" (ECSnapshot; `max_blocks` bounds
    its entries)."""
    if kind not in ("kv", "ec"):
        raise ValueError(f"kind must be 'kv' or 'ec', got {kind!r}")
    ask = SnapshotQuery if kind == "kv" else ECSnapshotQuery
    want = KVSnapshot if kind == "kv" else ECSnapshot
    check_float("deadline_s", deadline_s, 0, lo_open=True)
    check_float("quiet_s", quiet_s, 0, lo_open=True)
    check_int("max_blocks", max_blocks, 0)
    if max_bytes is not None:
        check_int("max_bytes", max_bytes, 1)
    ctx = context or zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_ANSWER_BYTES)
    sid = f"snapshot-{secrets.token_hex(8)}"
    end = time.monotonic() + deadline_s
    ids: list[int] = []
    counts: list[int] = []
    entries: list[ECEntry] = []
    first: KVSnapshot | ECSnapshot | None = None
    nbytes = 0
    try:
        sock.connect(endpoint)
        while True:
            have = len(ids) + len(entries)
            sock.send(encode(ask(sid, have)))
            chunk, size = _receive(sock, sid, min(end, time.monotonic() + quiet_s), cancelled, want)
            nbytes += size
            if max_bytes is not None and nbytes > max_bytes:
                raise SnapshotRefused(
                    "bound", f"snapshot past max_bytes={max_bytes} at offset {chunk.offset}"
                )
            if first is None:
                if chunk.total > max_blocks:
                    what = "blocks" if kind == "kv" else "entries"
                    raise SnapshotRefused(
                        "bound", f"snapshot of {chunk.total} {what} > max_blocks={max_blocks}"
                    )
                first = chunk
            elif (chunk.stamp, chunk.incarnation, chunk.total) != (
                first.stamp,
                first.incarnation,
                first.total,
            ):
                raise SnapshotRefused(
                    "malformed",
                    f"chunk at {chunk.offset} is of another snapshot (stamp {chunk.stamp}, "
                    f"incarnation {chunk.incarnation!r}, total {chunk.total}; the first: "
                    f"{first.stamp}, {first.incarnation!r}, {first.total})",
                )
            if chunk.offset != have:
                raise SnapshotRefused(
                    "malformed", f"chunk at offset {chunk.offset}, expected {have}"
                )
            if isinstance(chunk, KVSnapshot):
                ids += chunk.block_ids
                counts += chunk.counts
                got = len(chunk.block_ids)
            else:
                entries += chunk.entries
                got = len(chunk.entries)
            if have + got >= first.total:
                return Snapshot(first.stamp, first.incarnation, ids, counts, entries)
            if got == 0:
                raise SnapshotRefused("malformed", f"an empty chunk at {have} of {first.total}")
    except zmq.ZMQError as e:
        raise SnapshotRefused("error", f"snapshot socket: {e}") from None
    finally:
        sock.close(0)


def _receive(
    sock: zmq.Socket, sid: str, end: float, cancelled: Callable[[], bool], want: type
) -> tuple[KVSnapshot | ECSnapshot, int]:
    """This fetch's next answer and its frame's size in bytes (strays skipped)."""
    while True:
        if cancelled():
            raise SnapshotRefused("stop", "stopped while fetching the snapshot")
        left = end - time.monotonic()
        if left <= 0:
            raise SnapshotRefused("timeout", "P's snapshot did not come in time")
        if not sock.poll(max(1, int(min(left, 0.05) * 1000))):
            continue
        frame = sock.recv()
        try:
            answer = decode_answer(frame)
        except MalformedAnswer as e:
            raise SnapshotRefused("malformed", f"snapshot answer: {e}") from None
        if getattr(answer, "id", None) != sid:
            continue  # not this fetch's (a stray frame): keep waiting within the deadline
        if isinstance(answer, DemandError):
            raise SnapshotRefused("error", f"P refused the snapshot: {answer.error}")
        if not isinstance(answer, want):
            raise SnapshotRefused("malformed", f"a {type(answer).__name__} for a snapshot")
        assert isinstance(answer, KVSnapshot | ECSnapshot)
        return answer, len(frame)
