"""An incomplete view bootstrapped from P's KV snapshot (`mmreuse.events.snapshot`, the
stream's `snapshot_endpoint`): a P here is a TestPublisher whose every batch is also applied
to a true view, and a ROUTER answering `SnapshotQuery` from that truth (as `DemandScheduler`
does, checked against vLLM in tests/integrations/demand/test_scheduler.py), or as scripted by a
hostile test. The view joins late, past its replay buffer."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import msgspec
import pytest
import zmq
from prometheus_client import CollectorRegistry

from mmreuse.demand_query import DemandError, KVSnapshot, SnapshotQuery, decode_query, encode
from mmreuse.events import (
    AllBlocksCleared,
    BlockRemoved,
    EventStream,
    KVIndexSink,
    RemoteKVIndex,
    StreamLimits,
)
from mmreuse.events.identifiers import identifier_chunk
from mmreuse.events.snapshot import SnapshotRefused, fetch_snapshot
from mmreuse.metrics import Metrics
from tests.support.kv_publisher import TestPublisher, batch, stored
from tests.support.waiting import wait_for


class SnapshotP:
    """A P's publisher and its demand endpoint's snapshot answers. `script(query, truthful)`,
    when set, answers instead (a list of answers or raw frames; [] answers nothing). Its
    snapshots carry the identifiers its blocks carry while it knows them (`identifiers`:
    False answers as an older P does)."""

    def __init__(self, ctx: zmq.Context, buffer_steps: int = 2) -> None:
        self.pub = TestPublisher(ctx, buffer_steps=buffer_steps)
        self.truth = RemoteKVIndex("truth", track_identifiers=True)
        self.identifiers = True
        self.published = 0
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.script: Callable[[SnapshotQuery, KVSnapshot], list[Any]] | None = None
        self.chunk = 3
        self.asked = 0
        self.lock = threading.Lock()
        self.running = True
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def publish(self, *events: Any, drop: bool = False) -> int:
        with self.lock:
            b = batch(*events)
            self.truth.apply(b)
            self.published += 1
            return self.pub.publish(b, drop=drop)

    def truthful(self, query: SnapshotQuery) -> KVSnapshot:
        with self.lock:
            held = sorted(self.truth.counts().items())
            stamp = self.published
            carried = self.truth.carriers() if self.identifiers else None
        part = held[query.offset : query.offset + self.chunk]
        table, pairs = [], []
        if carried is not None:
            ids = [i for i, _ in held]
            end, table, pairs = identifier_chunk(ids, carried, query.offset, self.chunk)
            assert end == query.offset + len(part)
        return KVSnapshot(query.id, stamp, "inc-1", len(held), query.offset, 1000,
                          [i for i, _ in part], [n for _, n in part], carried is not None,
                          table, pairs)  # fmt: skip

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        while self.running:
            if not dict(poller.poll(50)):
                continue
            ident, payload = self.sock.recv_multipart()
            query = decode_query(payload)
            assert isinstance(query, SnapshotQuery)
            self.asked += 1
            answers = (
                [self.truthful(query)]
                if self.script is None
                else self.script(query, self.truthful(query))
            )
            for a in answers:
                self.sock.send_multipart([ident, a if isinstance(a, bytes) else encode(a)])

    def close(self) -> None:
        self.running = False
        self.thread.join()
        self.sock.close(0)
        self.pub.close()


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.term()


@pytest.fixture
def p(ctx):
    made = SnapshotP(ctx)
    yield made
    made.close()


@pytest.fixture
def metrics():
    return Metrics(CollectorRegistry())


def subscribe(ctx, p, metrics, track=False, **kw) -> tuple[RemoteKVIndex, EventStream]:
    """A late view of `p`: an EventStream into a KVIndexSink; `snapshot_endpoint` (default:
    p's) goes to the stream, the other keywords to its StreamLimits."""
    idx = RemoteKVIndex("p0", track_identifiers=track)
    endpoint = kw.pop("snapshot_endpoint", p.endpoint)
    limits = StreamLimits(**{"snapshot_retry_s": 0.2, "snapshot_deadline_s": 2.0, **kw})
    sub = EventStream(
        p.pub.endpoint,
        p.pub.replay_endpoint,
        sink=KVIndexSink(idx),
        limits=limits,
        metrics=metrics,
        context=ctx,
        snapshot_endpoint=endpoint,
    )
    return idx, sub.start()


def outcome(metrics, name) -> float:
    return metrics.snapshots.labels("p0", name)._value.get()


def served_before(p, n=8) -> None:
    """P cached blocks 0..n-1 (and dropped block 0 again) before anyone subscribed, then served
    two batches of nothing: its buffer (2) holds none of it."""
    for i in range(n):
        p.publish(stored([i]))
    p.publish(BlockRemoved(block_hashes=[0], medium="GPU"))
    p.publish()
    p.publish()


# ---- the bootstrap ------------------------------------------------------------------------------


def test_a_late_join_bootstraps_from_the_snapshot_and_follows_the_events(ctx, p, metrics):
    served_before(p)
    idx, sub = subscribe(ctx, p, metrics)
    try:
        assert wait_for(lambda: sub.complete)
        assert idx.counts() == p.truth.counts() and idx.contains(7) and not idx.contains(0)
        assert outcome(metrics, "ok") == 1
        p.publish(BlockRemoved(block_hashes=[3], medium="GPU"), stored([20]))
        assert wait_for(lambda: idx.contains(20))
        assert idx.counts() == p.truth.counts() and sub.complete
    finally:
        sub.stop()


def test_without_a_snapshot_endpoint_the_late_view_stays_incomplete(ctx, p, metrics):
    served_before(p)
    idx, sub = subscribe(ctx, p, metrics, snapshot_endpoint=None)
    try:
        assert p.pub.wait_joined(replays=1)
        p.publish(stored([20]))
        assert wait_for(lambda: idx.contains(20))
        assert not sub.complete and not idx.contains(7)  # what P held before: unknown
        assert p.asked == 0
    finally:
        sub.stop()


@pytest.mark.parametrize("lag", [1, 3])
def test_a_snapshot_stamped_before_batches_the_view_applied_replays_them(ctx, metrics, lag):
    # The view lost a gap it could not replay (max_replay_batches=1) and applied on; the
    # snapshot it then gets is stamped `lag` batches before the last it applied: those are
    # replayed on top of it, from the replay buffer.
    p = SnapshotP(ctx, buffer_steps=100)
    armed = threading.Event()

    def stale(q, truth):
        if not armed.is_set():
            return [DemandError(q.id, "not yet")]
        held = {i: 1 for i in range(6 - lag)}  # P as of batch 6 - lag: blocks 0..5-lag
        return [KVSnapshot(q.id, 6 - lag, "inc-1", len(held), 0, 1000, list(held),
                           list(held.values()))]  # fmt: skip

    p.script = stale
    idx, sub = subscribe(ctx, p, metrics, max_replay_batches=1)
    try:
        assert p.pub.wait_joined(replays=1)
        for i in range(6):
            p.publish(stored([i]), drop=i in (3, 4))  # a gap of 2: not replayed
        assert wait_for(lambda: sub.applied_seq == 5) and not sub.complete
        assert not idx.contains(1)  # reset by the gap
        armed.set()
        assert wait_for(lambda: sub.complete)
        assert idx.counts() == p.truth.counts() == {i: 1 for i in range(6)}
        assert outcome(metrics, "ok") == 1
    finally:
        sub.stop()
        p.close()


def test_a_snapshot_ahead_of_the_stream_skips_the_batches_it_holds(ctx, p, metrics):
    served_before(p)
    ahead = p.truthful(SnapshotQuery("x", 0))
    p.publish(stored([30]), drop=True)  # published, not yet delivered: in the snapshot
    p.publish(stored([31]), drop=True)
    idx, sub = subscribe(ctx, p, metrics)
    try:
        assert wait_for(lambda: sub.complete) and idx.contains(30) and idx.contains(31)
        p.publish(stored([32]))  # the next live batch applies; the two before are not re-applied
        assert wait_for(lambda: idx.contains(32))
        assert idx.counts() == p.truth.counts() and ahead.stamp < sub.applied_seq
    finally:
        sub.stop()


def test_an_honest_snapshot_racing_the_stream_completes(ctx, p, metrics):
    # P publishes a batch as it answers: the snapshot holds it, the view has not seen it yet.
    # Held aside until that batch arrives, then put in place of the view: complete, no batch
    # below its stamp needed again.
    served_before(p)
    p.chunk = 100
    raced: list[int] = []

    def racing(q, truth):
        if not raced:
            raced.append(p.publish(stored([50])))  # on the PUB stream before the answer
        return [p.truthful(q)]

    p.script = racing
    idx, sub = subscribe(ctx, p, metrics)
    try:
        assert wait_for(lambda: sub.complete)
        assert idx.contains(50) and idx.counts() == p.truth.counts()
        assert sub.applied_seq == raced[0] and outcome(metrics, "ok") == 1
        p.publish(BlockRemoved(block_hashes=[50], medium="GPU"))
        assert wait_for(lambda: not idx.contains(50)) and sub.complete
    finally:
        sub.stop()


def test_a_snapshot_ahead_of_the_stream_is_not_trusted(ctx, p, metrics):
    # Stamped 6 batches past the stream, naming a block P never stored: never the view, never
    # complete, and the live batches below its stamp (a real BlockRemoved) still apply.
    served_before(p)
    p.publish(stored([60]))  # seq 11: in the replay buffer, so the view holds block 60
    p.chunk = 100
    p.script = lambda q, t: [_replace(t, stamp=t.stamp + 6, total=t.total + 1,
                                      block_ids=[*t.block_ids, 999], counts=[*t.counts, 1])]  # fmt: skip
    idx, sub = subscribe(ctx, p, metrics)
    try:
        assert wait_for(lambda: p.asked >= 1)  # the loop handles no batch while it fetches
        seq = p.publish(BlockRemoved(block_hashes=[60], medium="GPU"))
        assert wait_for(lambda: sub.applied_seq == seq or sub.complete)
        assert not sub.complete and not idx.contains(999) and not idx.contains(60)
        assert outcome(metrics, "ok") == 0
        assert wait_for(lambda: outcome(metrics, "stamp") >= 1)  # the stream never got there
        assert not sub.complete and not idx.contains(999) and outcome(metrics, "ok") == 0
        p.script = None
        assert wait_for(lambda: sub.complete)
        assert idx.counts() == p.truth.counts() and not idx.contains(60)
    finally:
        sub.stop()


def test_a_snapshot_of_another_incarnation_is_refused(ctx, p, metrics):
    # The stream's incarnation is that of the first snapshot the view took from it: another
    # P process answering on the demand endpoint (a misaligned or load-balanced one) is refused.
    served_before(p)
    p.chunk = 100
    idx, sub = subscribe(ctx, p, metrics, max_replay_batches=1)
    try:
        assert wait_for(lambda: sub.complete) and outcome(metrics, "ok") == 1
        p.script = lambda q, t: [_replace(t, incarnation="inc-2")]
        p.publish(stored([40]), drop=True)  # a gap of 2 > max_replay_batches: a reset
        p.publish(stored([41]), drop=True)
        seq = p.publish(stored([42]))
        assert wait_for(lambda: sub.applied_seq == seq)
        assert wait_for(lambda: outcome(metrics, "incarnation") >= 1)
        assert not sub.complete and not idx.contains(7) and outcome(metrics, "ok") == 1
        p.script = None  # its own process again
        assert wait_for(lambda: sub.complete)
        assert idx.counts() == p.truth.counts() and outcome(metrics, "ok") == 2
    finally:
        sub.stop()


# ---- hostile or broken snapshots: refused by name, the view incomplete rather than wrong --------


def _chunks(mutate):
    """A script answering truthfully, then `mutate(query, answer)` (None: no answer)."""

    def script(q, truth):
        out = mutate(q, truth)
        return [] if out is None else [out]

    return script


def _replace(s: KVSnapshot, **kw) -> KVSnapshot:
    fields = {f: getattr(s, f) for f in KVSnapshot.__struct_fields__}
    fields.update(kw)
    return KVSnapshot(**fields)


BAD = [
    ("truncated", lambda q, t: t if q.offset == 0 else None, "timeout"),
    ("too large", lambda q, t: _replace(t, total=10**6, blocks=10**7), "bound"),
    ("out of order", lambda q, t: _replace(t, offset=q.offset + 1) if q.offset else t, "malformed"),
    ("another incarnation", lambda q, t: _replace(t, incarnation="inc-2") if q.offset else t,
     "malformed"),
    ("stamped past the stream", lambda q, t: _replace(t, stamp=t.stamp + 50_000), "stamp"),
    ("refused by P", lambda q, t: DemandError(q.id, "P publishes no KV events"), "error"),
    ("not an answer", lambda q, t: b"\x00garbage", "malformed"),
]  # fmt: skip


@pytest.mark.parametrize("name, mutate, reason", BAD, ids=[b[0] for b in BAD])
def test_a_bad_snapshot_is_refused_and_the_view_stays_incomplete(
    ctx, p, metrics, name, mutate, reason
):
    served_before(p)
    p.script = _chunks(mutate)
    idx, sub = subscribe(ctx, p, metrics, max_snapshot_items=1000)
    try:
        assert wait_for(lambda: outcome(metrics, reason) >= 1), name
        p.publish(stored([20]))
        assert wait_for(lambda: idx.contains(20))
        assert not sub.complete and not idx.contains(7), name  # never a view from a bad one
        assert outcome(metrics, "ok") == 0
        p.script = None  # P answers truthfully again: the next attempt completes the view
        assert wait_for(lambda: sub.complete), name
        assert idx.counts() == p.truth.counts()
    finally:
        sub.stop()


def test_a_stamp_the_stream_never_reaches_is_never_loaded(ctx, p, metrics):
    served_before(p)
    p.script = lambda q, t: [_replace(t, stamp=t.stamp + 3)]  # within max_stamp_ahead
    idx, sub = subscribe(ctx, p, metrics)
    try:
        # held aside, never in the view, refused once snapshot_deadline_s passed
        assert wait_for(lambda: outcome(metrics, "stamp") >= 1)
        assert outcome(metrics, "ok") == 0 and not sub.complete and not idx.contains(7)
        p.script = None
        assert wait_for(lambda: outcome(metrics, "ok") >= 1 and sub.complete)
        assert wait_for(lambda: idx.counts() == p.truth.counts())
    finally:
        sub.stop()


def test_stop_ends_a_fetch_in_progress(ctx, p, metrics):
    served_before(p)  # a late view: it asks for a snapshot
    p.script = lambda q, t: []  # P never answers
    _, sub = subscribe(ctx, p, metrics, snapshot_deadline_s=60.0, replay_timeout_s=30.0)
    assert wait_for(lambda: p.asked >= 1)  # the fetch is in progress: a minute unless stopped
    sub.stop(timeout_s=5.0)  # raises unless the thread ended: no timing assert, a hang guard
    assert not sub.is_alive and outcome(metrics, "stop") == 1


def test_a_paced_snapshot_is_asked_for_again_after_the_time_p_names(ctx, p):
    # P paces snapshots while its cache changes: the fetch waits what P says, then asks again
    # (a new ask: the paced one's id is done), within its deadline.
    served_before(p)
    asked: list[str] = []

    def paced_once(q, truth):
        asked.append(q.id)
        if len(asked) == 1:
            return [DemandError(q.id, "snapshot: one per 1.0 s; ask again", retry_after_s=0.2)]
        return [truth]

    p.script = paced_once
    snap = fetch_snapshot(p.endpoint, context=ctx, deadline_s=30.0)
    assert dict(zip(snap.block_ids, snap.counts, strict=True)) == p.truth.counts()
    assert asked[0] != asked[1]  # the second ask is another snapshot's
    # Paced past the deadline: refused now, not waited out.
    p.script = lambda q, t: [DemandError(q.id, "snapshot: later", retry_after_s=50.0)]
    with pytest.raises(SnapshotRefused) as e:
        fetch_snapshot(p.endpoint, context=ctx, deadline_s=5.0)
    assert e.value.reason == "error" and "paced" in str(e.value)
    # A wait past the wire's bound (a hostile or broken P) is a malformed answer, not waited.
    p.script = lambda q, t: [msgspec.msgpack.encode(
        {"type": "DemandError", "id": q.id, "error": "later", "retry_after_s": 1e9})]  # fmt: skip
    with pytest.raises(SnapshotRefused) as e:
        fetch_snapshot(p.endpoint, context=ctx, deadline_s=5.0)
    assert e.value.reason == "malformed" and "retry_after_s" in str(e.value)


def test_fetch_snapshot_validates_its_arguments():
    from mmreuse.errors import InvalidArgument

    with pytest.raises(InvalidArgument, match="deadline_s"):
        fetch_snapshot("tcp://127.0.0.1:1", deadline_s=0)
    with pytest.raises(SnapshotRefused) as e:
        fetch_snapshot("tcp://127.0.0.1:1", deadline_s=0.2, quiet_s=0.1)
    assert e.value.reason == "timeout"


# ---- identifiers: a late view learns which ones P holds ---------------------------------------


def mm(ident: str) -> tuple:
    return ((ident, 0),)


def served_mm_before(p) -> None:
    """`served_before`, the blocks carrying images: 0, 3 and 6 img-0 or img-1, 4 both."""
    keys = {0: mm("img-0"), 3: mm("img-1"), 4: (("img-0", -16), ("img-1", 0)), 6: mm("img-0")}
    for i in range(8):
        p.publish(stored([i], extra_keys=[keys.get(i)]))
    p.publish(BlockRemoved(block_hashes=[0], medium="GPU"))
    p.publish()
    p.publish()


def test_a_late_join_learns_the_identifiers_p_holds(ctx, p, metrics):
    served_mm_before(p)
    idx, sub = subscribe(ctx, p, metrics, track=True)
    try:
        assert wait_for(lambda: sub.complete)
        assert idx.identifiers_known() and idx.identifiers() == {"img-0": 2, "img-1": 2}
        assert idx.identifiers() == p.truth.identifiers() and not idx.may_hold("img-2")
        p.publish(
            BlockRemoved(block_hashes=[3, 4], medium="GPU"), stored([20], extra_keys=[mm("img-2")])
        )
        assert wait_for(lambda: idx.contains(20))
        assert idx.identifiers() == p.truth.identifiers() == {"img-0": 1, "img-2": 1}
        assert not idx.may_hold("img-1") and idx.identifiers_known() and sub.complete
    finally:
        sub.stop()


def test_an_older_p_s_snapshot_leaves_identifiers_unknown(ctx, p, metrics):
    served_mm_before(p)
    p.identifiers = False  # a P that does not follow them: its chunks as before
    idx, sub = subscribe(ctx, p, metrics, track=True)
    try:
        assert wait_for(lambda: sub.complete) and idx.counts() == p.truth.counts()
        assert not idx.identifiers_known() and idx.may_hold("img-9") and idx.identifiers() == {}
        p.publish(AllBlocksCleared(), stored([30], extra_keys=[mm("img-3")]))
        assert wait_for(lambda: idx.contains(30))
        assert idx.identifiers_known() and idx.identifiers() == {"img-3": 1}
    finally:
        sub.stop()


def test_a_snapshot_held_aside_keeps_its_identifiers(ctx, p, metrics):
    served_mm_before(p)
    p.publish(stored([30], extra_keys=[mm("img-5")]), drop=True)  # in the snapshot only
    p.publish(stored([31], extra_keys=[mm("img-6")]), drop=True)
    p.chunk = 100
    raced: list[int] = []

    def racing(q, truth):  # stamped ahead of the stream: held until it gets there
        if not raced:
            raced.append(p.publish(stored([32], extra_keys=[mm("img-7")])))
        return [p.truthful(q)]

    p.script = racing
    idx, sub = subscribe(ctx, p, metrics, track=True)
    try:
        assert wait_for(lambda: sub.complete)
        assert sub.applied_seq == raced[0] and idx.identifiers_known()
        assert idx.identifiers() == p.truth.identifiers()
        assert idx.may_hold("img-5") and idx.may_hold("img-6") and idx.may_hold("img-7")
    finally:
        sub.stop()


BAD_IDENTIFIERS = [
    ("the flag flips", lambda q, t: _replace(t, identifiers_followed=False, identifiers=[],
                                             carried=[]) if q.offset else t),
    ("past the table", lambda q, t: _replace(t, carried=[(0, [len(t.identifiers)])])),
    ("past the chunk", lambda q, t: _replace(t, carried=[(len(t.block_ids), [0])])),
    ("not followed, yet named", lambda q, t: _replace(t, identifiers_followed=False)
     if t.carried else t),
    ("a table too long", lambda q, t: _replace(t, identifiers=[f"i{n}" for n in range(4097)])),
    ("an identifier too long", lambda q, t: _replace(t, identifiers=["x" * 1025])),
]  # fmt: skip


@pytest.mark.parametrize("name, mutate", BAD_IDENTIFIERS, ids=[b[0] for b in BAD_IDENTIFIERS])
def test_bad_identifiers_refuse_the_snapshot(ctx, p, metrics, name, mutate):
    # never a view with identifiers it cannot trust: refused whole, the view incomplete (its
    # identifiers unknown) until P answers well
    served_mm_before(p)
    p.script = _chunks(lambda q, t: msgspec.msgpack.encode(mutate(q, t)))
    idx, sub = subscribe(ctx, p, metrics, track=True)
    try:
        assert wait_for(lambda: outcome(metrics, "malformed") >= 1), name
        # incomplete: what the index knows is the stream's since it joined, never the snapshot's
        assert not sub.complete and idx.identifiers() == {} and not idx.contains(4)
        assert outcome(metrics, "ok") == 0
        p.script = None
        assert wait_for(lambda: sub.complete), name
        assert idx.identifiers_known() and idx.identifiers() == p.truth.identifiers()
    finally:
        sub.stop()


def test_a_block_named_in_two_chunks_refuses_the_snapshot_with_its_identifiers(ctx, p, metrics):
    # each chunk's identifiers name its own blocks only (by index), so the one inconsistency
    # left is across chunks: a block (and what it carries) twice. Well formed chunk by chunk;
    # `load` refuses it whole
    served_mm_before(p)
    p.script = _chunks(lambda q, t: _replace(t, offset=q.offset, block_ids=[4, 4, 4][: len(t.block_ids)],
                                             counts=t.counts))  # fmt: skip
    idx, sub = subscribe(ctx, p, metrics, track=True)
    try:
        assert wait_for(lambda: outcome(metrics, "malformed") >= 1)
        assert not sub.complete and idx.identifiers() == {} and not idx.contains(4)
    finally:
        sub.stop()


def test_a_snapshot_s_identifiers_are_bounded_in_all(ctx, p, metrics):
    # Review 3, L3: every chunk within the wire's bounds, but its references in all past 2 a
    # block of max_snapshot_items (10 here: 20): refused as over its bound, as an encoder-cache
    # snapshot past its bytes is; the view incomplete, never the snapshot's identifiers
    served_mm_before(p)
    four = ["img-0", "img-1", "img-2", "img-3"]
    p.script = lambda q, t: [_replace(t, identifiers=four,
                                      carried=[(i, [0, 1, 2, 3]) for i in range(len(t.block_ids))])]  # fmt: skip
    idx, sub = subscribe(ctx, p, metrics, track=True, max_snapshot_items=10)
    try:
        assert wait_for(lambda: outcome(metrics, "bound") >= 1)
        assert not sub.complete and idx.identifiers() == {} and not idx.contains(4)
        assert outcome(metrics, "ok") == 0
        p.script = None  # P's own snapshot: 4 references
        assert wait_for(lambda: sub.complete)
        assert idx.identifiers_known() and idx.identifiers() == p.truth.identifiers()
    finally:
        sub.stop()


def test_fetch_snapshot_bounds_the_identifiers_bytes_in_all(ctx, p):
    from mmreuse.errors import InvalidArgument

    served_mm_before(p)  # chunks of 3 blocks: tables ["img-1"], ["img-0", "img-1"], 4 references
    with pytest.raises(SnapshotRefused) as e:
        fetch_snapshot(p.endpoint, context=ctx, max_identifier_bytes=14)
    assert e.value.reason == "bound" and "max_identifier_bytes=14" in str(e.value)
    with pytest.raises(SnapshotRefused) as e:
        fetch_snapshot(p.endpoint, context=ctx, max_identifier_refs=3)
    assert e.value.reason == "bound" and "max_identifier_refs=3" in str(e.value)
    snap = fetch_snapshot(p.endpoint, context=ctx, max_identifier_refs=4, max_identifier_bytes=20)
    assert snap.identifiers == p.truth.carriers()
    for field, value in [("max_identifier_refs", -1), ("max_identifier_bytes", 1.5)]:
        with pytest.raises(InvalidArgument if value == -1 else TypeError, match=field):
            fetch_snapshot(p.endpoint, context=ctx, **{field: value})
