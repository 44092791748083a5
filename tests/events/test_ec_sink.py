"""EncoderCacheSink: a P's (or an E's) encoder-cache events into EmbeddingAvailability, fed by
an EventStream over real ZMQ (tests/support/kv_publisher.TestPublisher), with the KV view's gap,
replay and resync rules."""

from __future__ import annotations

import time

import pytest
import zmq
from prometheus_client import CollectorRegistry

from mmreuse.availability import EmbeddingAvailability
from mmreuse.errors import InvalidArgument, InvalidArgumentType
from mmreuse.events.ec_sink import EncoderCacheSink
from mmreuse.events.ec_wire import (
    EncoderCacheCleared,
    EncoderCacheEventBatch,
    EncoderCacheEvicted,
    EncoderCacheFreeable,
    EncoderCacheReferenced,
    EncoderCacheStored,
    encode_ec_batch,
)
from mmreuse.events.stream import EventStream, StreamLimits
from mmreuse.metrics import Metrics
from tests.support.kv_publisher import TestPublisher
from tests.support.waiting import wait_for


def ec_stream(endpoint, replay=None, *, availability, instance, side="p", limits=None, **kw):
    """An EventStream into an EncoderCacheSink of `availability`."""
    sink = EncoderCacheSink(availability, instance=instance, side=side)
    return EventStream(endpoint, replay, sink=sink, limits=limits, **kw)


def _batch(*events):
    return encode_ec_batch(EncoderCacheEventBatch(time.time(), list(events), 0))


@pytest.fixture
def setup():
    ctx = zmq.Context()
    pub = TestPublisher(ctx)
    metrics = Metrics(CollectorRegistry())
    avail = EmbeddingAvailability(ttl_s=3600, metrics=metrics)
    sub = ec_stream(
        pub.endpoint, pub.replay_endpoint, availability=avail, instance="P0", metrics=metrics
    ).start()
    assert pub.wait_joined(replays=1)  # the slow joiner
    yield pub, sub, avail, metrics
    sub.stop()
    pub.close()
    ctx.term()


def _p(avail):
    a = avail.availability_for("P0")
    return dict(a.p_local), set(a.p_local_freeable)


def test_events_become_p_local_entries(setup):
    pub, sub, avail, _ = setup
    pub.publish(_batch(EncoderCacheStored("a", 16), EncoderCacheStored("b", 4)))
    assert wait_for(lambda: _p(avail)[0] == {"a": 16, "b": 4})
    pub.publish(_batch(EncoderCacheFreeable(["a", "b"]), EncoderCacheReferenced(["b"])))
    assert wait_for(lambda: _p(avail) == ({"a": 16, "b": 4}, {"a"}))
    pub.publish(_batch(EncoderCacheEvicted(["a"])))
    assert wait_for(lambda: _p(avail) == ({"b": 4}, set()))
    pub.publish(_batch(EncoderCacheCleared()))
    assert wait_for(lambda: _p(avail) == ({}, set()))
    assert sub.is_alive


def test_a_gap_is_filled_from_the_replay(setup):
    pub, _sub, avail, metrics = setup
    pub.publish(_batch(EncoderCacheStored("a", 16)))
    pub.publish(_batch(EncoderCacheStored("b", 4)), drop=True)  # lost on the PUB stream
    pub.publish(_batch(EncoderCacheStored("c", 9)))
    assert wait_for(lambda: _p(avail)[0] == {"a": 16, "b": 4, "c": 9})
    assert metrics.registry.get_sample_value("mmreuse_kv_event_gaps_total", {"instance": "P0"}) == 1


def test_a_malformed_batch_forgets_the_instance(setup):
    pub, sub, avail, _metrics = setup
    pub.publish(_batch(EncoderCacheStored("a", 16)))
    assert wait_for(lambda: _p(avail)[0] == {"a": 16})
    pub.publish(b"\x93\xcb garbage")
    assert wait_for(lambda: _p(avail)[0] == {})  # never a stale "cached"
    pub.publish(_batch(EncoderCacheStored("d", 4)))
    assert wait_for(lambda: _p(avail)[0] == {"d": 4})
    assert sub.is_alive


def test_the_sink_refuses_what_is_no_availability_and_a_second_stream(setup):
    pub, sub, _avail, _ = setup
    with pytest.raises(InvalidArgumentType, match="availability"):
        EncoderCacheSink(object(), instance="P0")
    with pytest.raises(InvalidArgument, match="already fed by a stream"):
        EventStream(pub.endpoint, sink=sub.sink)
    assert not hasattr(sub.sink, "match_prefix")  # no KV view to refuse: it never had one


def test_a_late_join_is_incomplete_until_p_clears_its_encoder_cache():
    # Joined after P's first batch left its (tiny) buffer: the entries stored before are never
    # published again, so the view says it may miss some, until P clears its encoder cache.
    ctx = zmq.Context()
    pub = TestPublisher(ctx, buffer_steps=1)
    metrics = Metrics(CollectorRegistry())
    avail = EmbeddingAvailability(ttl_s=3600, metrics=metrics)
    for i in range(3):
        pub.publish(_batch(EncoderCacheStored(f"old{i}", 16)))
    sub = ec_stream(
        pub.endpoint, pub.replay_endpoint, availability=avail, instance="P0", metrics=metrics
    ).start()
    try:
        assert pub.wait_joined(replays=1)
        pub.publish(_batch(EncoderCacheStored("new", 16)))
        assert wait_for(lambda: sub.applied_seq == 3)
        assert "new" in _p(avail)[0] and not sub.complete
        pub.publish(_batch(EncoderCacheCleared(), EncoderCacheStored("after", 16)))
        assert wait_for(lambda: sub.applied_seq == 4)
        assert sub.complete and _p(avail)[0] == {"after": 16}
    finally:
        sub.stop()
        pub.close()
        ctx.term()


@pytest.mark.parametrize("side", ["p", "e"])
def test_a_late_join_bootstraps_from_the_encoder_cache_snapshot(side):
    # P's encoder cache held old0 (in use), old1 and old2 (freeable, old1 the oldest) before the
    # subscriber came; its buffer (1 batch) holds none of that: the snapshot does.
    import threading

    from mmreuse.demand_query import ECEntry, ECSnapshot, decode_query, encode

    ctx = zmq.Context()
    pub = TestPublisher(ctx, buffer_steps=1)
    for i in range(3):
        pub.publish(_batch(EncoderCacheStored(f"old{i}", 16)))
    pub.publish(_batch(EncoderCacheFreeable(["old1", "old2"])))
    pub.publish(_batch())
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    entries = [ECEntry("old0", 16, False), ECEntry("old1", 16, True), ECEntry("old2", 16, True)]
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            if router.poll(50):
                ident, payload = router.recv_multipart()
                q = decode_query(payload)
                part = entries[q.offset : q.offset + 2]  # two a chunk
                router.send_multipart(
                    [ident, encode(ECSnapshot(q.id, 5, "inc", 3, q.offset, part))]
                )

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    metrics = Metrics(CollectorRegistry())
    avail = EmbeddingAvailability(ttl_s=3600, metrics=metrics)
    sub = ec_stream(
        pub.endpoint, pub.replay_endpoint, availability=avail, instance="P0", metrics=metrics,
        snapshot_endpoint=f"tcp://127.0.0.1:{port}", side=side,
    ).start()  # fmt: skip

    def held():  # an E's entries are the E side (freeable or not), a P's its P-local ones
        if side == "e":
            return set(avail.availability_for("X", "P0").e_cached), set()
        local, freeable = _p(avail)
        return set(local), freeable

    try:
        assert wait_for(lambda: sub.complete)
        everything = {"old0", "old1", "old2"}
        assert held() == (everything, {"old1", "old2"} if side == "p" else set())
        if side == "p":
            assert _p(avail)[0] == {"old0": 16, "old1": 16, "old2": 16}
        pub.publish(_batch(EncoderCacheEvicted(["old1"])))  # seq 5: the stamp, applied on top
        assert wait_for(lambda: "old1" not in held()[0])
        assert sub.complete and held()[0] == {"old0", "old2"}
    finally:
        sub.stop()
        stop.set()
        thread.join()
        router.close(0)
        pub.close()
        ctx.term()


def test_an_es_events_become_e_side_entries_freeable_or_not():
    # side="e": what E holds is what it serves without a forward, in use or freeable alike.
    ctx = zmq.Context()
    pub = TestPublisher(ctx)
    metrics = Metrics(CollectorRegistry())
    avail = EmbeddingAvailability(ttl_s=3600, metrics=metrics)
    sub = ec_stream(
        pub.endpoint, pub.replay_endpoint, availability=avail, instance="E0", side="e",
        metrics=metrics,
    ).start()  # fmt: skip

    def e_side():
        a = avail.availability_for("P0", "E0")
        assert not a.p_local  # nothing of P's
        return set(a.e_cached)

    try:
        assert pub.wait_joined(replays=1)
        pub.publish(_batch(EncoderCacheStored("a", 16), EncoderCacheStored("b", 4)))
        assert wait_for(lambda: e_side() == {"a", "b"})
        pub.publish(_batch(EncoderCacheFreeable(["a"]), EncoderCacheEvicted(["b"])))
        assert wait_for(lambda: e_side() == {"a"})
        pub.publish(b"\x93\xcb garbage")  # a hostile or broken E: forgotten, never kept stale
        assert wait_for(lambda: e_side() == set())
        pub.publish(_batch(EncoderCacheStored("d", 4)))
        assert wait_for(lambda: e_side() == {"d"})
        pub.publish(_batch(EncoderCacheCleared()))
        assert wait_for(lambda: e_side() == set())
        assert sub.is_alive and sub.complete
    finally:
        sub.stop()
        pub.close()
        ctx.term()


def test_side_is_checked():
    with pytest.raises(ValueError, match="side"):
        EncoderCacheSink(EmbeddingAvailability(), instance="E0", side="x")


class ECSnapshotServer:
    """A demand endpoint answering `ECSnapshotQuery` with `total` generated entries of
    `ident_chars` characters, `chunk` a chunk; records the highest offset asked for."""

    def __init__(self, ctx, total: int, *, chunk: int = 2, ident_chars: int = 8) -> None:
        import threading

        self.total, self.chunk, self.ident_chars = total, chunk, ident_chars
        self.offsets: list[int] = []
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.endpoint = f"tcp://127.0.0.1:{self.sock.bind_to_random_port('tcp://127.0.0.1')}"
        self.running = True
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        from mmreuse.demand_query import ECEntry, ECSnapshot, decode_query, encode

        while self.running:
            if not self.sock.poll(50):
                continue
            ident, payload = self.sock.recv_multipart()
            q = decode_query(payload)
            self.offsets.append(q.offset)
            n = min(self.chunk, self.total - q.offset)
            part = [ECEntry(f"{q.offset + i:0{self.ident_chars}d}", 16, False) for i in range(n)]
            self.sock.send_multipart([ident, encode(ECSnapshot(q.id, 0, "inc", self.total,
                                                               q.offset, part))])  # fmt: skip

    def close(self) -> None:
        self.running = False
        self.thread.join()
        self.sock.close(0)


def _snapshot_outcome(metrics, outcome):
    return metrics.registry.get_sample_value(
        "mmreuse_kv_event_snapshots_total", {"instance": "P0", "outcome": outcome}
    )


@pytest.mark.parametrize(
    "total, max_entries, kwargs, furthest",
    [
        # 4M entries announced to a view that holds 4: refused from `total`, at offset 0
        (4_194_304, 4, {}, 0),
        (5, 4, {}, 0),
        # 1,000-character identifiers, 10 a chunk (~10 KB): past 15 KB at the second chunk
        (50, 100, {"max_snapshot_bytes": 15_000}, 10),
    ],
    ids=["4M entries", "one past the view", "bytes"],
)
def test_an_encoder_cache_snapshot_is_bounded_by_what_the_view_holds(
    total, max_entries, kwargs, furthest
):
    ctx = zmq.Context()
    pub = TestPublisher(ctx)
    chunk, chars = (10, 1000) if "max_snapshot_bytes" in kwargs else (2, 8)
    server = ECSnapshotServer(ctx, total, chunk=chunk, ident_chars=chars)
    metrics = Metrics(CollectorRegistry())
    avail = EmbeddingAvailability(ttl_s=3600, max_entries=max_entries, metrics=metrics)
    pub.publish(_batch(EncoderCacheStored("gone", 16)))  # the view joins past seq 0: incomplete
    pub.publish(_batch())
    sub = ec_stream(
        pub.endpoint, None, availability=avail, instance="P0", metrics=metrics,
        snapshot_endpoint=server.endpoint, limits=StreamLimits(snapshot_retry_s=0.2, **kwargs),
    ).start()  # fmt: skip
    try:
        assert wait_for(lambda: (_snapshot_outcome(metrics, "bound") or 0) >= 2)
        assert max(server.offsets) == furthest  # never read on past the bound
        assert not sub.complete and not _snapshot_outcome(metrics, "ok")
        assert _p(avail) == ({}, set())
    finally:
        sub.stop()
        server.close()
        pub.close()
        ctx.term()


def test_the_snapshot_bound_defaults_to_what_the_view_holds():
    def make(availability, **limits):
        sink = EncoderCacheSink(availability, instance="P0")
        return EventStream("tcp://127.0.0.1:1", sink=sink, limits=StreamLimits(**limits))

    assert make(EmbeddingAvailability(max_entries=7)).max_snapshot_items == 7
    sub = make(EmbeddingAvailability(), max_snapshot_items=3, max_snapshot_bytes=9)
    assert (sub.max_snapshot_items, sub.max_snapshot_bytes) == (3, 9)
    assert make(EmbeddingAvailability()).max_snapshot_bytes == 64 << 20
    with pytest.raises(ValueError, match="max_snapshot_bytes"):
        make(EmbeddingAvailability(), max_snapshot_bytes=0)
