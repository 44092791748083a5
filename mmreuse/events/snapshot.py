"""Fetch a P's KV snapshot (`demand_query.SnapshotQuery` -> `KVSnapshot` chunks) or its
encoder-cache snapshot (`ECSnapshotQuery` -> `ECSnapshot`) over its demand endpoint, whole or
not at all, bounded against a hostile P.

`fetch_snapshot` connects a DEALER of its own, asks for chunk after chunk, and returns the
snapshot (stamp, incarnation, ids, counts) or raises `SnapshotRefused` with a named reason:
`error` (P's DemandError: no KV events, index off, ...), `timeout` (past the deadline),
`malformed` (a frame that is no answer, a chunk that does not continue the last one or changes
its stamp / incarnation / total), `bound` (more ids or entries than `max_blocks`, refused at
the first chunk from its `total`, answers past `max_bytes` in all, or a KV snapshot's
identifiers past theirs in all: the wire bounds them per chunk only), `stop`.

A KV snapshot's identifiers, P's side and the wire's, are `events.identifiers`'.
"""

from __future__ import annotations

import logging
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
from .identifiers import chunk_identifiers

logger = logging.getLogger(__name__)

# A KV snapshot's identifiers in all (`demand_query` bounds them per chunk only, so 4M blocks of
# 256 would be ~1G references, ~8 GB held): references, SNAPSHOT_IDENT_REFS_PER_BLOCK a block
# of `max_blocks` on average (vLLM's block carries the one or two items it overlaps: P's own
# snapshot stays below one), and the chunks' identifier tables, DEFAULT_SNAPSHOT_IDENT_BYTES of
# UTF-8 in all (as the encoder-cache snapshot's answers; a P's real tables are a few MB).
SNAPSHOT_IDENT_REFS_PER_BLOCK = 2
DEFAULT_SNAPSHOT_IDENT_BYTES = 64 << 20


@dataclass(frozen=True, slots=True)
class Snapshot:
    """A whole snapshot as of event batch `stamp`: P's prefix cache (`block_ids`, `counts`,
    and `identifiers`: the mm identifiers of the block ids that carry any, None where P did not
    follow them), or its encoder cache (`entries`)."""

    stamp: int
    incarnation: str
    block_ids: list[int]
    counts: list[int]
    entries: list[ECEntry]
    identifiers: dict[int, tuple[str, ...]] | None = None


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
    max_identifier_refs: int | None = None,
    max_identifier_bytes: int = DEFAULT_SNAPSHOT_IDENT_BYTES,
) -> Snapshot:
    """P's whole KV snapshot from its demand endpoint, within `deadline_s` in all, each chunk
    within `quiet_s` of its ask (a snapshot P paces, `DemandError.retry_after_s`, is asked for
    again after that long, within the deadline), `max_blocks` and `max_bytes` (the answers' frames in all, None:
    unbounded; a chunk at most `MAX_ANSWER_BYTES` past it); `cancelled()` (checked every 50 ms)
    ends it (reason `stop`). `kind`: "kv" (KVSnapshot) or "ec" (ECSnapshot; `max_blocks` bounds
    its entries). A KV snapshot's identifiers in all: at most `max_identifier_refs` references
    (None: SNAPSHOT_IDENT_REFS_PER_BLOCK x `max_blocks`) and `max_identifier_bytes` of tables."""
    if kind not in ("kv", "ec"):
        raise ValueError(f"kind must be 'kv' or 'ec', got {kind!r}")
    ask = SnapshotQuery if kind == "kv" else ECSnapshotQuery
    want = KVSnapshot if kind == "kv" else ECSnapshot
    check_float("deadline_s", deadline_s, 0, lo_open=True)
    check_float("quiet_s", quiet_s, 0, lo_open=True)
    check_int("max_blocks", max_blocks, 0)
    if max_bytes is not None:
        check_int("max_bytes", max_bytes, 1)
    if max_identifier_refs is None:
        max_identifier_refs = SNAPSHOT_IDENT_REFS_PER_BLOCK * max_blocks
    check_int("max_identifier_refs", max_identifier_refs, 0)
    check_int("max_identifier_bytes", max_identifier_bytes, 0)
    ctx = context or zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_ANSWER_BYTES)
    sid = f"snapshot-{secrets.token_hex(8)}"
    end = time.monotonic() + deadline_s
    ids: list[int] = []
    counts: list[int] = []
    entries: list[ECEntry] = []
    carried: dict[int, tuple[str, ...]] = {}  # the KV snapshot's identifiers, per block id
    first: KVSnapshot | ECSnapshot | None = None
    nbytes = refs = ident_bytes = 0
    try:
        sock.connect(endpoint)
        while True:
            have = len(ids) + len(entries)
            sock.send(encode(ask(sid, have)))
            try:
                chunk, size = _receive(
                    sock, sid, min(end, time.monotonic() + quiet_s), cancelled, want
                )
            except _Paced as paced:
                if have or time.monotonic() + paced.after_s >= end:
                    raise SnapshotRefused("error", str(paced)) from None
                _pause(paced.after_s, cancelled)
                sid = (
                    f"snapshot-{secrets.token_hex(8)}"  # a new ask: the old one's frames are strays
                )
                continue
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
            elif (chunk.stamp, chunk.incarnation, chunk.total, _followed(chunk)) != (
                first.stamp,
                first.incarnation,
                first.total,
                _followed(first),
            ):
                raise SnapshotRefused(
                    "malformed",
                    f"chunk at {chunk.offset} is of another snapshot (stamp {chunk.stamp}, "
                    f"incarnation {chunk.incarnation!r}, total {chunk.total}, identifiers "
                    f"{_followed(chunk)}; the first: {first.stamp}, {first.incarnation!r}, "
                    f"{first.total}, {_followed(first)})",
                )
            if chunk.offset != have:
                raise SnapshotRefused(
                    "malformed", f"chunk at offset {chunk.offset}, expected {have}"
                )
            if isinstance(chunk, KVSnapshot):
                refs += sum([len(named) for _, named in chunk.carried])
                ident_bytes += sum([len(x.encode()) for x in chunk.identifiers])
                if refs > max_identifier_refs or ident_bytes > max_identifier_bytes:
                    raise SnapshotRefused(
                        "bound",
                        f"snapshot's identifiers past max_identifier_refs={max_identifier_refs} "
                        f"references or max_identifier_bytes={max_identifier_bytes} at offset "
                        f"{chunk.offset} ({refs} references, {ident_bytes} bytes so far)",
                    )
                ids += chunk.block_ids
                counts += chunk.counts
                got = len(chunk.block_ids)
                carried.update(chunk_identifiers(chunk))
            else:
                entries += chunk.entries
                got = len(chunk.entries)
            if have + got >= first.total:
                followed = carried if _followed(first) else None
                return Snapshot(first.stamp, first.incarnation, ids, counts, entries, followed)
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
            if answer.retry_after_s is not None:
                raise _Paced(answer.retry_after_s, f"P paced the snapshot: {answer.error}")
            raise SnapshotRefused("error", f"P refused the snapshot: {answer.error}")
        if not isinstance(answer, want):
            raise SnapshotRefused("malformed", f"a {type(answer).__name__} for a snapshot")
        assert isinstance(answer, KVSnapshot | ECSnapshot)
        return answer, len(frame)


class _Paced(Exception):
    """P will answer this snapshot query after `after_s` (it paces snapshots)."""

    def __init__(self, after_s: float, detail: str) -> None:
        super().__init__(detail)
        self.after_s = after_s


def _pause(seconds: float, cancelled: Callable[[], bool]) -> None:
    """Wait `seconds`, or less if `cancelled()` (checked every 50 ms) says stop."""
    end = time.monotonic() + seconds
    while (left := end - time.monotonic()) > 0:
        if cancelled():
            raise SnapshotRefused("stop", "stopped while fetching the snapshot")
        time.sleep(min(left, 0.05))


def _followed(chunk: KVSnapshot | ECSnapshot) -> bool:
    return isinstance(chunk, KVSnapshot) and chunk.identifiers_followed
