"""EventStream (into a KVIndexSink) against a hostile publisher (issue #11): garbage, nesting, lying or endless
replays, restarts, floods. After each scenario the view holds no block the publisher removed
(it equals the truth, or is a subset of it after a counted resync), the thread is alive, and
`stop()` returns within its timeout. Plus a fuzz of `decode_batch` and `RemoteKVIndex.apply`."""

from __future__ import annotations

import dataclasses
import math
import time
from collections import Counter

import msgspec
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from mmreuse.blockhash import to_event_id
from mmreuse.errors import InvalidArgument
from mmreuse.events import (
    END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventStream,
    KVEventBatch,
    KVIndexSink,
    MalformedBatch,
    RemoteKVIndex,
    StreamDied,
    StreamLimits,
    decode_batch,
    encode_batch,
)
from mmreuse.events.wire import MAX_EXTRA_KEY_DEPTH
from tests.support.kv_publisher import TestPublisher, batch, stored
from tests.support.waiting import wait_for

STOP_TIMEOUT_S = 5.0
LIMITS = {f.name for f in dataclasses.fields(StreamLimits)}


def stream(endpoint, replay_endpoint=None, *, index=None, **kw):
    """An EventStream into a KVIndexSink over `index` (a new one: "p0"); the keywords that are
    StreamLimits fields go to its limits, the others to the stream."""
    limits = StreamLimits(**{k: kw.pop(k) for k in list(kw) if k in LIMITS})
    sink = KVIndexSink(RemoteKVIndex("p0") if index is None else index)
    return EventStream(endpoint, replay_endpoint, sink=sink, limits=limits, **kw)


def removed(hashes, medium="GPU"):
    return BlockRemoved(block_hashes=list(hashes), medium=medium)


def value(metric, *labels):
    return metric.labels(*labels)._value.get()


class Truth:
    """What the publisher's prefix cache holds: block -> count, as the index counts."""

    def __init__(self):
        self.counts: Counter[int] = Counter()
        self.seen: set[int] = set()

    def apply(self, b: KVEventBatch) -> None:
        for e in b.events:
            if isinstance(e, BlockStored):
                for x in e.block_hashes:
                    self.counts[x] += 1
                    self.seen.add(x)
            elif isinstance(e, BlockRemoved):
                for x in e.block_hashes:
                    if self.counts[x] > 0:
                        self.counts[x] -= 1
            else:
                self.counts.clear()

    def held(self) -> set[int]:
        return {x for x, n in self.counts.items() if n > 0}


class Scenario:
    """A publisher, a subscriber on it, and the truth; `publish` keeps all three in step."""

    def __init__(self, ctx, metrics, **kw):
        self.pub = TestPublisher(ctx, buffer_steps=kw.pop("buffer_steps", 10_000))
        self.idx = RemoteKVIndex("p0", max_media=kw.pop("max_media", 8))
        self.metrics = metrics
        self.truth = Truth()
        replay = kw.pop("replay", self.pub.replay_endpoint)
        kw.setdefault("replay_timeout_s", 0.3)
        kw.setdefault("replay_deadline_s", 5.0)
        self.sub = stream(
            self.pub.endpoint, replay, index=self.idx, metrics=metrics, context=ctx, **kw
        ).start()
        # the SUB joins late (slow joiner): wait for its subscription (and its start-up replay,
        # where it asks this publisher for one), then a live batch
        assert self.pub.wait_joined(replays=int(replay == self.pub.replay_endpoint))
        self.publish(batch(stored([10_000])))
        assert wait_for(lambda: self.sub.applied_seq == self.last)

    def publish(self, b, *, drop=False):
        self.truth.apply(b)
        self.last = self.pub.publish(b, drop=drop)
        return self.last

    def settle(self):
        assert wait_for(lambda: self.sub.applied_seq == self.last), (
            self.sub.applied_seq,
            self.last,
        )

    def assert_sound(self, *, exact=None):
        """No stale block; equal to the truth unless a resync was counted; thread alive."""
        view = {x for x in self.truth.seen if self.idx.contains(x)}
        held = self.truth.held()
        assert view <= held, f"stale blocks in the view: {sorted(view - held)[:10]}"
        resyncs = value(self.metrics.resyncs, "p0")
        if exact is True or (exact is None and resyncs == 0):
            assert view == held
        if exact is False:
            assert resyncs >= 1
        assert self.sub.is_alive
        self.sub.check()

    def close(self):
        try:
            self.sub.stop(STOP_TIMEOUT_S)  # raises if the thread did not stop in time
            assert not self.sub.is_alive
        finally:
            self.pub.close()


@pytest.fixture
def scenario(ctx, metrics):
    made = []

    def make(**kw):
        s = Scenario(ctx, metrics, **kw)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


def frame(seq, payload, topic=b""):
    return [topic, seq.to_bytes(8, "big"), payload]


def end_marker():
    return [b"", END_SEQ, b""]


def lose_then_live(s, n_lost=2):
    """Block 1 is held; then `n_lost` batches that remove it are lost; then a live batch."""
    s.publish(batch(stored([1])))
    s.settle()
    first = s.last + 1
    for i in range(n_lost):
        s.publish(
            batch(removed([1]), stored([100 + i])) if i == 0 else batch(stored([100 + i])),
            drop=True,
        )
    s.publish(batch(stored([200])))
    return first


# ---- start() and construction ---------------------------------------------------------------


@pytest.mark.parametrize(
    "field,endpoint",
    [
        ("endpoint", "tcp://127.0.0.1:notaport"),
        ("endpoint", "foo://bar"),
        ("replay_endpoint", "tcp://127.0.0.1:notaport"),
        ("replay_endpoint", "foo://bar"),
    ],
)
def test_start_refuses_an_endpoint_zmq_refuses(ctx, metrics, field, endpoint):
    kw = {"endpoint": "tcp://127.0.0.1:5999", "replay_endpoint": None, field: endpoint}
    sub = stream(**kw, metrics=metrics, context=ctx)
    with pytest.raises(InvalidArgument, match=f"^{field} .*notaport|^{field} .*foo://bar"):
        sub.start()
    assert not sub.is_alive and sub._thread is None
    with pytest.raises(StreamDied, match="not running"):
        sub.check()
    sub.stop(STOP_TIMEOUT_S)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"poll_interval_s": math.nan}, "poll_interval_s"),
        ({"poll_interval_s": math.inf}, "poll_interval_s"),
        ({"poll_interval_s": True}, "poll_interval_s"),
        ({"poll_interval_s": 0}, "poll_interval_s"),
        ({"poll_interval_s": "0.1"}, "poll_interval_s"),
        ({"replay_timeout_s": math.nan}, "replay_timeout_s"),
        ({"replay_timeout_s": -1.0}, "replay_timeout_s"),
        ({"replay_deadline_s": math.inf}, "replay_deadline_s"),
        ({"max_replay_batches": 0}, "max_replay_batches"),
        ({"max_replay_bytes": 1.5}, "max_replay_bytes"),
        ({"max_media": True}, "max_media"),
        ({"max_message_bytes": 0}, "max_message_bytes"),
        ({"replay_endpoint": 5}, "replay_endpoint"),
        ({"metrics": object()}, "metrics"),
    ],
)
def test_constructor_refuses_bad_values(kwargs, match):
    with pytest.raises(InvalidArgument, match=f"^{match}"):
        if "max_media" in kwargs:  # the index's bound, kept by the index
            stream("tcp://127.0.0.1:5999", index=RemoteKVIndex(**kwargs))
        else:
            stream("tcp://127.0.0.1:5999", **kwargs)


# ---- garbage and nesting on the live stream -----------------------------------------------


def nested_payload(depth, where="extra_keys"):
    """A BlockStored whose `where` field holds `depth` nested arrays (inside extra_keys' own
    list: one entry that deep); msgspec cannot encode it, so the bytes are spliced."""
    ev = {
        "type": "BlockStored",
        "block_hashes": [7],
        "parent_block_hash": None,
        "token_ids": [],
        "block_size": 16,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        where: None,
    }
    base = msgspec.msgpack.encode([1.0, [ev], 0])
    i = base.rfind(where.encode()) + len(where)
    assert base[i] == 0xC0
    head = b"\x91" if where == "extra_keys" else b""
    return base[:i] + head + b"\x91" * depth + b"\x01" + base[i + 1 :]


@pytest.mark.parametrize(
    "payload",
    [
        nested_payload(1000),
        nested_payload(100_000),
        nested_payload(1000, "unknown_field"),
        nested_payload(MAX_EXTRA_KEY_DEPTH + 1),
        b"\xdd\xff\xff\xff\xff",
        b"\xc1",
        b"",
        bytes(range(256)),
        msgspec.msgpack.encode([1.0, [{"type": "BlockStored"}], 0]),
        msgspec.msgpack.encode([math.nan, [], -1]),
    ],
)
def test_decode_batch_raises_only_malformed(payload):
    try:
        b = decode_batch(payload)
    except MalformedBatch:
        return
    assert isinstance(b, KVEventBatch)  # a payload it accepts decodes to a batch


def test_deep_nesting_is_malformed_not_recursion():
    for p in (
        nested_payload(1000),
        nested_payload(100_000),
        nested_payload(5000, "zzz"),
        nested_payload(MAX_EXTRA_KEY_DEPTH + 1),
    ):
        with pytest.raises(MalformedBatch):
            decode_batch(p)
    ok = decode_batch(nested_payload(MAX_EXTRA_KEY_DEPTH))
    assert ok.events[0].block_hashes == [7]


def test_garbage_and_nested_payloads_resync_and_survive(scenario, metrics):
    s = scenario()
    s.publish(batch(stored([1, 2])))
    s.settle()
    before = value(metrics.malformed, "p0")
    s.pub.send_raw([b""])
    s.pub.send_raw([b"", b"\x00" * 7, b"x"])
    s.pub.send_raw([b"", b"\x00" * 8, b"x", b"extra"])
    bad = [
        nested_payload(1000),
        nested_payload(50_000, "zzz"),
        nested_payload(MAX_EXTRA_KEY_DEPTH + 1),
        b"\xc1garbage",
        b"\xdd\xff\xff\xff\xff",
    ]
    for p in bad:
        s.last = s.pub.publish(p)  # a lost batch: it might have removed anything
    s.truth.apply(batch(removed([1, 2])))  # say it did
    s.publish(batch(stored([3])))
    s.settle()
    assert value(metrics.malformed, "p0") - before == 3 + len(bad)
    assert value(metrics.resyncs, "p0") >= 1
    assert not s.idx.contains(1) and s.idx.contains(3)
    s.assert_sound(exact=False)


def test_an_unexpected_error_in_a_batch_costs_a_resync_not_the_loop(ctx, metrics):
    class FlakyIndex(RemoteKVIndex):
        fail = False

        def apply(self, b):
            if self.fail:
                self.fail = False
                raise RuntimeError("boom")
            return super().apply(b)

    pub = TestPublisher(ctx)
    idx = FlakyIndex("p0")
    sub = stream(pub.endpoint, pub.replay_endpoint, index=idx, metrics=metrics, context=ctx)
    sub.start()
    try:
        assert wait_for(lambda: (pub.publish(batch(stored([1]))), sub.applied_seq)[1] is not None)
        idx.fail = True
        seq = pub.publish(batch(removed([1])))
        last = pub.publish(batch(stored([2])))
        assert wait_for(lambda: sub.applied_seq == last)
        assert seq < last and value(metrics.errors, "p0") == 1
        assert value(metrics.resyncs, "p0") == 1
        assert not idx.contains(1) and idx.contains(2) and sub.is_alive
    finally:
        sub.stop(STOP_TIMEOUT_S)
        pub.close()


def test_a_dead_loop_is_visible_and_resets_the_view(scenario, metrics):
    s = scenario()
    s.publish(batch(stored([1])))
    s.settle()
    assert value(metrics.subscriber_up, "p0") == 1

    def boom(frames):
        raise OSError("socket gone")

    s.sub._handle = boom  # an error outside the per-batch guard: the loop dies
    s.publish(batch(removed([1])))
    assert wait_for(lambda: not s.sub.is_alive)
    assert isinstance(s.sub.error, OSError)
    assert value(metrics.subscriber_failures, "p0") == 1
    assert value(metrics.subscriber_up, "p0") == 0
    assert not s.idx.contains(1) and s.idx.size() == 0  # not left stale
    with pytest.raises(StreamDied, match="socket gone"):
        s.sub.check()
    with pytest.raises(StreamDied, match="socket gone"):
        s.sub.sink.longest_prefix([1])
    with pytest.raises(StreamDied):
        s.sub.sink.match_prefix([1])


# ---- replays that do not fill the gap -----------------------------------------------------


def test_a_complete_replay_needs_no_resync(scenario, metrics):
    s = scenario()
    lose_then_live(s, 3)
    s.settle()
    assert value(metrics.replays, "p0") >= 1 and value(metrics.resyncs, "p0") == 0
    assert s.sub.sink.match_prefix([1]).num_blocks == 0 and s.sub.sink.longest_prefix([100]) == 1
    s.assert_sound(exact=True)


@pytest.mark.parametrize(
    "kind",
    [
        "partial_then_end",
        "hole_then_end",
        "stall",
        "absent",
        "duplicate",
        "lying_high",
        "lying_low",
        "endless_garbage",
        "bad_frames",
    ],
)
def test_a_short_or_lying_replay_resyncs(scenario, metrics, kind):
    s = scenario()

    def script(start, items):
        by_seq = dict(items)
        if kind == "partial_then_end":
            yield frame(start, by_seq[start])
            yield end_marker()
        elif kind == "hole_then_end":
            yield frame(start, by_seq[start])
            yield frame(start + 2, by_seq[start + 2])
            yield end_marker()
        elif kind == "stall":
            yield frame(start, by_seq[start])  # then silence, no end marker
        elif kind == "absent":
            return
        elif kind == "duplicate":
            for _ in range(3):
                yield frame(start, by_seq[start])
        elif kind == "lying_high":
            yield frame(2**64 - 2, by_seq[start])
            yield end_marker()
        elif kind == "lying_low":
            yield frame(start - 1, by_seq[start])
        elif kind == "endless_garbage":
            while True:
                yield frame(start, b"\xc1" * 64)
        elif kind == "bad_frames":
            yield [b"only-one-frame"]

    s.pub.replay_script = script
    first = lose_then_live(s, 3)
    s.settle()
    assert first > 0 and value(metrics.resyncs, "p0") >= 1
    assert not s.idx.contains(1)  # removed in a lost batch: must not survive
    assert s.idx.contains(200)  # the live batch after the gap is applied
    # later live batches are not dropped as "already applied" (a lying seq moved nothing)
    s.publish(batch(stored([300])))
    s.settle()
    assert s.idx.contains(300) and s.sub.applied_seq == s.last
    s.assert_sound(exact=False)


def test_a_replay_tail_after_a_moved_buffer_resyncs_then_applies(scenario, metrics):
    s = scenario(buffer_steps=3)
    s.publish(batch(stored([1])))
    s.settle()
    for i in range(6):
        s.publish(batch(removed([1]) if i == 0 else stored([100 + i])), drop=True)
    s.publish(batch(stored([200])))
    s.settle()
    assert value(metrics.resyncs, "p0") == 1
    assert not s.idx.contains(1) and s.idx.contains(105) and s.idx.contains(200)
    s.assert_sound(exact=False)


def test_a_slow_endless_replay_hits_the_deadline_and_live_removals_apply(scenario, metrics):
    s = scenario(replay_timeout_s=2.0, replay_deadline_s=0.5)

    def drip(start, items):
        for seq, payload in items:  # in order and in range, but far too slowly
            time.sleep(0.1)  # the thing under test: a replay slower than its deadline
            yield frame(seq, payload)

    s.pub.replay_script = drip
    lose_then_live(s, 40)
    s.publish(batch(stored([2])))
    s.publish(batch(removed([2])))  # live, queued behind the replay
    s.settle()
    assert value(metrics.replay_aborts, "p0", "deadline") == 1
    assert not s.idx.contains(1) and not s.idx.contains(2) and s.idx.contains(200)
    s.assert_sound(exact=False)


def test_a_replay_beyond_the_byte_or_batch_bound_resyncs(scenario, metrics):
    s = scenario(max_replay_bytes=200, max_replay_batches=50)
    lose_then_live(s, 20)  # 20 batches of ~60 bytes > 200 bytes
    s.settle()
    assert value(metrics.replay_aborts, "p0", "bytes") == 1
    replays = value(metrics.replays, "p0")
    lose_then_live(s, 60)  # longer than max_replay_batches: not even asked
    s.settle()
    assert value(metrics.replay_aborts, "p0", "bound") == 1
    assert value(metrics.replays, "p0") == replays
    assert not s.idx.contains(1)
    s.assert_sound(exact=False)


def test_stop_interrupts_an_endless_replay(scenario, metrics):
    s = scenario(replay_timeout_s=30.0, replay_deadline_s=60.0)

    def slow_forever(start, items):
        while True:  # never a reply: the stream would wait replay_timeout_s
            time.sleep(0.05)  # the thing under test: a replay server that never answers
            yield from ()

    s.pub.replay_script = slow_forever
    replays = value(metrics.replays, "p0")
    lose_then_live(s, 2)
    assert wait_for(lambda: value(metrics.replays, "p0") == replays + 1)
    s.sub.stop(STOP_TIMEOUT_S)  # raises if the replay held the thread
    assert not s.sub.is_alive and s.sub.error is None
    assert not s.idx.contains(1)  # the unfinished replay reset the view
    assert value(metrics.replay_aborts, "p0", "stop") == 1


def test_no_replay_server_at_all_resyncs(ctx, metrics, scenario):
    probe = ctx.socket(zmq.ROUTER)
    port = probe.bind_to_random_port("tcp://127.0.0.1")
    probe.close(0)  # nothing listens there now
    s = scenario(replay=f"tcp://127.0.0.1:{port}")
    lose_then_live(s, 2)
    s.settle()
    assert value(metrics.replay_aborts, "p0", "timeout") >= 1
    assert not s.idx.contains(1)
    s.assert_sound(exact=False)


# ---- restarts, floods, media --------------------------------------------------------------


def test_publisher_restart_forgets_the_old_process(ctx, metrics):
    s = Scenario(ctx, metrics)
    try:
        s.publish(batch(stored([1, 2, 3])))
        s.settle()
        endpoint, replay = s.pub.endpoint, s.pub.replay_endpoint
        s.pub.close()
        s.pub = TestPublisher(ctx, pub_endpoint=endpoint, replay_endpoint=replay)
        s.truth = Truth()  # a new process: an empty prefix cache
        s.truth.seen |= {1, 2, 3}
        s.publish(batch(stored([50])))  # seq 0 of the new process; the SUB may miss it
        assert s.pub.wait_joined()  # the SUB has reconnected: the next batch reaches it
        s.publish(batch(stored([51])))
        s.settle()
        # seen as a seq going back, or as the dropped connection (new seqs may overtake old)
        assert value(metrics.resyncs, "p0") >= 1
        assert not s.idx.contains(1) and s.idx.contains(50)
        s.assert_sound(exact=False)
    finally:
        s.close()


def test_a_flood_is_applied_and_stop_still_returns(scenario, metrics):
    s = scenario()
    n = 20_000
    for i in range(n):
        s.publish(batch(stored([i]), removed([i - 1])) if i else batch(stored([i])))
    s.settle()
    s.assert_sound()
    assert s.idx.contains(n - 1) and not s.idx.contains(n - 2)
    for i in range(n):  # a second flood, stopped in the middle of its drain
        s.pub.publish(batch(stored([n + i])))
    s.sub.stop(STOP_TIMEOUT_S)
    assert not s.sub.is_alive


def test_media_beyond_the_bound_are_refused_and_labels_stay_bounded(scenario, metrics):
    s = scenario(max_media=3)
    s.publish(batch(stored([1]), stored([2], medium="CPU")))
    s.settle()
    assert s.idx.contains(1) and s.idx.contains(2, medium="CPU")
    before = value(metrics.malformed, "p0")
    for k in range(30):  # each batch names 4 fresh media, more than max_media: refused
        s.last = s.pub.publish(batch(*[stored([k], medium=f"m{k}-{j}") for j in range(4)]))
    s.last = s.pub.publish(batch(stored([3], medium="x" * 65)))  # a name too long
    s.publish(batch(stored([4])))
    s.settle()
    assert value(metrics.malformed, "p0") - before == 31
    assert s.idx.media() == ("GPU",) and s.idx.contains(4) and not s.idx.contains(1)
    # media within the bound, cycled through resets: the gauge's labels do not pile up
    for k in range(20):
        s.publish(batch(stored([500 + k], medium=f"n{k}")))
        s.last = s.pub.publish(b"\xc1")  # a resync
    s.settle()
    labels = {
        smp.labels["medium"]
        for mf in metrics.registry.collect()
        if mf.name == "mmreuse_kv_index_blocks"
        for smp in mf.samples
    }
    assert len(labels) <= 3 + 1, labels
    s.truth = Truth()
    s.assert_sound(exact=True)


# ---- fuzz: decode_batch and RemoteKVIndex.apply over arbitrary msgpack ----------------------

scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=True)
    | st.binary(max_size=40)
    | st.text(max_size=12)
)
trees = st.recursive(
    scalars,
    lambda kids: (
        st.lists(kids, max_size=5) | st.dictionaries(st.text(max_size=8), kids, max_size=5)
    ),
    max_leaves=40,
)
hashes = st.integers(-(2**63), 2**64 - 1) | st.binary(min_size=0, max_size=40) | trees
media = st.sampled_from([None, "GPU", "CPU", "STORAGE"]) | trees
events = st.one_of(
    st.fixed_dictionaries(
        {
            "type": st.just("BlockStored"),
            "block_hashes": st.lists(hashes, max_size=6),
            "parent_block_hash": st.none() | hashes,
            "token_ids": st.lists(st.integers(0, 10), max_size=4) | trees,
            "block_size": st.integers(0, 64) | trees,
            "lora_id": st.none(),
            "medium": media,
            "lora_name": st.none(),
        },
        optional={"extra_keys": trees, "group_idx": trees, "junk": trees},
    ),
    st.fixed_dictionaries(
        {
            "type": st.just("BlockRemoved"),
            "block_hashes": st.lists(hashes, max_size=6),
            "medium": media,
        }
    ),
    st.fixed_dictionaries({"type": st.sampled_from(["AllBlocksCleared", "Nope"])}),
    trees,
)
batches = st.tuples(
    st.floats() | trees, st.lists(events, max_size=5), st.none() | st.integers(0, 3) | trees
).map(list)


def model_apply(model: dict, b: KVEventBatch) -> None:
    for e in b.events:
        if isinstance(e, BlockStored):
            table = model.setdefault("GPU" if e.medium is None else e.medium, Counter())
            for x in e.block_hashes:
                table[to_event_id(x)] += 1
        elif isinstance(e, BlockRemoved):
            table = model.get("GPU" if e.medium is None else e.medium)
            if table is not None:
                for x in e.block_hashes:
                    k = to_event_id(x)
                    if table[k] > 0:
                        table[k] -= 1
        elif isinstance(e, AllBlocksCleared):
            model.clear()


def check_decode_and_apply(payload: bytes) -> None:
    try:
        b = decode_batch(payload)
    except MalformedBatch:
        return
    assert isinstance(b, KVEventBatch)
    idx = RemoteKVIndex("fuzz")
    idx.apply(batch(stored([123]), stored([b"\x00" * 31 + b"\x07"], medium="CPU")))
    model: dict = {}
    model_apply(model, batch(stored([123]), stored([7], medium="CPU")))
    snapshot = {m: Counter(t) for m, t in model.items()}
    try:
        idx.apply(b)
    except ValueError:  # a hash the index refuses: nothing changed (all or nothing)
        model = snapshot
    else:
        model_apply(model, b)
    for medium, table in model.items():
        held = {k for k, n in table.items() if n > 0}
        assert idx.size(medium) == len(held)
        assert all(idx.contains(k, medium) for k in held)
    assert set(idx.media()) == {m for m, t in model.items() if any(n > 0 for n in t.values())}


@settings(max_examples=300, deadline=None)
@given(batches)
def test_fuzz_structured_msgpack(tree):
    check_decode_and_apply(msgspec.msgpack.encode(tree))


@settings(max_examples=300, deadline=None)
@given(trees)
def test_fuzz_arbitrary_msgpack(tree):
    check_decode_and_apply(msgspec.msgpack.encode(tree))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_fuzz_raw_bytes(raw):
    check_decode_and_apply(raw)


def test_fuzz_finds_valid_batches_too():
    """The structured strategy reaches real applies (the fuzz is not all MalformedBatch)."""
    p = encode_batch(batch(stored([1, 2]), removed([1]), AllBlocksCleared(), stored([3])))
    check_decode_and_apply(p)
    assert decode_batch(p).events[-1].block_hashes == [3]
