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

The P side of a KV snapshot's identifiers is here too (vLLM-free, so tested and measured
without vLLM): `PublishedIdentifiers` follows the mm identifiers of the blocks P holds from the
KV-event batches P publishes, and `identifier_chunk` cuts a snapshot's chunk so that its
identifiers stay within the wire's bounds.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import zmq

from ..blockhash import to_event_ids
from ..demand_query import (
    MAX_ANSWER_BYTES,
    MAX_IDENT_CHARS,
    MAX_SNAPSHOT_IDENT_BYTES,
    MAX_SNAPSHOT_IDENT_REFS,
    MAX_SNAPSHOT_IDENTS,
    MAX_SNAPSHOT_IDENTS_PER_BLOCK,
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
from .index import entry_identifiers
from .wire import MEDIUM_GPU

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


def chunk_identifiers(chunk: KVSnapshot) -> dict[int, tuple[str, ...]]:
    """A KVSnapshot chunk's identifiers, per block id (the chunk as `decode_answer` checked it:
    every index in range)."""
    table, named = chunk.identifiers, chunk.block_ids
    return {named[block]: tuple([table[r] for r in refs]) for block, refs in chunk.carried}


def _followed(chunk: KVSnapshot | ECSnapshot) -> bool:
    return isinstance(chunk, KVSnapshot) and chunk.identifiers_followed


# ---- P's side: the identifiers of a KV snapshot ------------------------------------------------


class PublishedIdentifiers:
    """Which mm identifiers each block P holds carries, followed from the KV-event batches P
    publishes (vLLM's block pool keeps a block's hash, not the extra keys that made it), so
    that P's KVSnapshot can carry them (`DemandScheduler`, `"snapshot_identifiers"`).

    Fed the batches as P publishes them, in order (`follow`, right after each publish, under
    the lock the snapshot is taken under), its `carriers` are what `RemoteKVIndex.carriers`
    gives a view that applied every batch from 0, as of the last batch published: the
    snapshot's stamp. Only the GPU medium (the prefix cache's; a snapshot holds no other).

    Leaner than a RemoteKVIndex, because it runs in P's engine: it counts only the hashes that
    carry identifiers (how many blocks hold each, so that one leaves with its last
    BlockRemoved), so a text-only store costs one scan of its extra keys and a removal one C
    call while no hash carries any. That relies on vLLM's rule that a block hash includes its
    extra keys: a hash is stored with its identifiers every time, never without them.

    Bounded by P's block count: past `max_hashes` such hashes (events that over-report, such
    as re-announced blocks never removed twice) it stops following, until the next
    AllBlocksCleared; stopped, or where the identifiers are unknown (a store without
    `extra_keys`, malformed ones), `carriers` is None and P's snapshot says it did not follow
    them. `follow` never raises: P's engine calls it.
    """

    def __init__(self, max_hashes: int) -> None:
        self.max_hashes = check_int("max_hashes", max_hashes, 0)
        # event id -> [blocks holding it, the identifiers it carries], for those carrying any
        self._held: dict[int, list[Any]] = {}
        self.stopped: str | None = None  # why it stopped following, until a clear

    def follow(self, events: Iterable[Any]) -> None:
        """One published batch's events (vLLM's BlockStored / BlockRemoved / AllBlocksCleared,
        or this package's: read by field), in order."""
        try:
            for e in events:
                self._follow(e)
        except Exception as e:  # never into P's engine: stop following, say why
            self._stop(f"{type(e).__name__}: {e}")

    def _follow(self, e: Any) -> None:
        kind = type(e).__name__
        if kind == "AllBlocksCleared":
            self._held.clear()
            self.stopped = None  # a fresh start: follow again from here
            return
        if self.stopped is not None:
            return
        if kind not in ("BlockStored", "BlockRemoved"):
            self._stop(f"an unexpected KV event {kind}")
            return
        medium = e.medium
        if medium is not None and medium != MEDIUM_GPU:
            return  # a connector's media: no snapshot holds them
        held, hashes = self._held, e.block_hashes
        if kind == "BlockRemoved":
            if held:
                ids = to_event_ids(hashes)
                hit = held.keys() & ids  # in C, over the event's ids: mostly text blocks
                if hit:
                    repeats = len(set(ids)) != len(ids)  # a hash twice in one event: rare
                    for eid in hit:
                        entry = held[eid]
                        entry[0] -= ids.count(eid) if repeats else 1
                        if entry[0] <= 0:
                            del held[eid]
            return
        keys, n = e.extra_keys, len(hashes)
        if not n:
            return
        if keys is None:
            self._stop("a BlockStored without extra keys")
            return
        if (type(keys) is not list and type(keys) is not tuple) or len(keys) != n:
            self._stop("a BlockStored with malformed extra keys")
            return
        if keys.count(None) == n:  # text only: the common case, one C call
            return
        ids = to_event_ids(hashes)
        last: tuple[str, ...] = ()  # the previous block's: an item spans many blocks
        idents: tuple[str, ...]
        for i, entry in enumerate(keys):
            if entry is None:
                continue
            shape = type(entry)
            if (shape is not list and shape is not tuple) or len(
                entry
            ) > MAX_SNAPSHOT_IDENTS_PER_BLOCK:
                self._stop("a BlockStored with malformed extra keys")
                return
            k = entry[0] if len(entry) == 1 else None
            if (
                (type(k) is tuple or type(k) is list)  # vLLM's usual entry: one mm key
                and len(k) == 2
                and len(last) == 1
                and k[0] == last[0]
                and type(k[0]) is str
                and type(k[1]) is int
            ):
                idents = last  # the previous block's identifier: checked already
            else:
                found = entry_identifiers(entry)
                if found is None:
                    self._stop("a BlockStored with malformed extra keys")
                    return
                idents = last = found[0]
            if not idents:
                continue
            was = held.get(ids[i])
            if was is None:
                held[ids[i]] = [1, idents]
                continue
            was[0] += 1
            if idents is was[1] or idents == was[1]:  # vLLM's rule: same hash, same keys
                continue
            have = set(was[1])
            extra = tuple(x for x in idents if x not in have)
            if extra:  # not vLLM's rule: the union, bounded
                was[1] += extra
                if len(was[1]) > MAX_SNAPSHOT_IDENTS_PER_BLOCK:
                    self._stop("a hash named with ever new identifiers")
                    return
        if len(held) > self.max_hashes:
            self._stop(f"{len(held)} hashes held, more than P's {self.max_hashes} blocks")

    def _stop(self, why: str) -> None:
        if self.stopped is None:
            logger.warning("mmreuse: KV snapshots carry no identifiers until a reset: %s", why)
        self.stopped = why
        self._held.clear()

    def carriers(self) -> dict[int, tuple[str, ...]] | None:
        """Every held event id that carries identifiers, and which; None where not known."""
        if self.stopped is not None:
            return None
        return {eid: entry[1] for eid, entry in self._held.items()}


def identifier_chunk(
    block_ids: Sequence[int],
    carried: Mapping[int, Sequence[str]],
    offset: int,
    limit: int,
) -> tuple[int, list[str], list[tuple[int, list[int]]]]:
    """A KVSnapshot chunk's identifiers: the chunk of `block_ids` from `offset` (at most `limit`
    ids) ends early where its identifier table would pass MAX_SNAPSHOT_IDENTS entries or
    MAX_SNAPSHOT_IDENT_BYTES, or its references MAX_SNAPSHOT_IDENT_REFS (a block names at most
    MAX_SNAPSHOT_IDENTS_PER_BLOCK: every chunk holds a block at least). Returns (end, the table,
    the `carried` pairs). An identifier the wire cannot carry (over MAX_IDENT_CHARS, never held
    by `PublishedIdentifiers`) is left out: a view never follows one."""
    table: dict[str, int] = {}
    pairs: list[tuple[int, list[int]]] = []
    nbytes = refs = 0
    end = min(len(block_ids), offset + limit)
    for i in range(offset, end):
        idents = carried.get(block_ids[i])
        if not idents:
            continue
        wanted = [x for x in dict.fromkeys(idents) if 0 < len(x) <= MAX_IDENT_CHARS]
        new = [x for x in wanted if x not in table]
        grow = sum(len(x.encode()) for x in new)
        if i > offset and (
            len(table) + len(new) > MAX_SNAPSHOT_IDENTS
            or nbytes + grow > MAX_SNAPSHOT_IDENT_BYTES
            or refs + len(wanted) > MAX_SNAPSHOT_IDENT_REFS
        ):
            return i, list(table), pairs
        for x in new:
            table[x] = len(table)
        nbytes += grow
        refs += len(wanted)
        if wanted:
            pairs.append((i - offset, [table[x] for x in wanted]))
    return end, list(table), pairs
