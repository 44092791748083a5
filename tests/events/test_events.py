"""KV events: vLLM 0.33.0's wire fixtures, the legacy layout, RemoteKVIndex, and a real ZMQ
EventStream into a KVIndexSink over loopback against a publisher with vLLM's frames and replay
protocol."""

import base64
import gc
import hashlib
import json
import time

import msgspec
import pytest
import zmq
from prometheus_client import CollectorRegistry

from mmreuse.errors import InvalidArgument, InvalidArgumentType
from mmreuse.events import (
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
    to_builtins,
)
from mmreuse.events.wire import GC_PAUSE_BYTES
from mmreuse.hashing import to_event_id
from mmreuse.metrics import Metrics
from tests.support.kv_publisher import batch, stored
from tests.support.oracle import oracle_run
from tests.support.paths import KV_EVENT_FIXTURES, ORACLE_TOOLS
from tests.support.waiting import wait_for

FIXTURES = json.loads(KV_EVENT_FIXTURES.read_text())


@pytest.mark.parametrize("fx", FIXTURES["fixtures"], ids=[f["id"] for f in FIXTURES["fixtures"]])
def test_vllm_fixture_decodes_exactly(fx):
    payload = base64.b64decode(fx["payload_b64"])
    batch = decode_batch(payload)
    assert to_builtins(batch) == fx["decoded"]
    assert encode_batch(batch) == payload  # and re-encodes byte for byte
    assert bytes.fromhex(fx["seq_frame_hex"]) == fx["seq"].to_bytes(8, "big")
    for e in batch.events:
        if isinstance(e, (BlockStored, BlockRemoved)):
            kind = {bytes: "bytes32", int: "int64"}[type(e.block_hashes[0])]
            assert kind == fx["hash_mode"]


def test_legacy_array_layout_decodes():
    class LegacyEvent(msgspec.Struct, array_like=True, tag=True):
        pass

    class BlockStoredOld(LegacyEvent, tag="BlockStored"):
        block_hashes: list
        parent_block_hash: object
        token_ids: list
        block_size: int
        lora_id: object
        medium: object

    class BlockRemovedOld(LegacyEvent, tag="BlockRemoved"):
        block_hashes: list
        medium: object

    class AllClearedOld(LegacyEvent, tag="AllBlocksCleared"):
        pass

    payload = msgspec.msgpack.encode(
        [
            2.0,
            [
                BlockStoredOld([7, 8], None, [1, 2], 16, None, "GPU"),
                BlockRemovedOld([7], "GPU"),
                AllClearedOld(),
            ],
            3,
        ]
    )
    assert msgspec.msgpack.decode(payload)[1][0][0] == "BlockStored"  # really arrays
    b = decode_batch(payload)
    assert b.data_parallel_rank == 3 and b.ts == 2.0
    assert (
        b.events[0] == stored([7, 8], token_ids=None)
        if False
        else b.events[0].block_hashes == [7, 8]
    )
    assert isinstance(b.events[1], BlockRemoved) and isinstance(b.events[2], AllBlocksCleared)


@pytest.mark.parametrize(
    "payload", [b"", b"\x93\x01", b"not msgpack", msgspec.msgpack.encode([1.0, [{"type": "Nope"}]])]
)
def test_malformed_payloads_raise(payload):
    with pytest.raises(MalformedBatch):
        decode_batch(payload)
    with pytest.raises(MalformedBatch, match="bytes"):
        decode_batch("text")


# ---- RemoteKVIndex ------------------------------------------------------------------------


def h(i):
    return hashlib.sha256(f"blk{i}".encode()).digest()


def test_a_big_payload_decodes_with_the_gc_paused():
    """msgspec decodes a batch in one C call, holding the GIL; the cyclic collections its
    containers set off ran inside it (370 for this 1.8 MB batch of 256k identifier pairs, the
    call 4-5x longer; review 3, M2). Paused for a big payload: the one collection left runs
    after it; the GC is as it was found after."""
    keys = tuple((f"i{j}", 0) for j in range(256))
    events = [stored([b], extra_keys=[keys]) for b in range(1000)]
    payload = encode_batch(KVEventBatch(ts=0.0, events=events))
    assert len(payload) >= GC_PAUSE_BYTES
    runs: list[int] = []

    def seen(phase: str, info: dict) -> None:
        if phase == "start":
            runs.append(info["generation"])

    gc.callbacks.append(seen)
    try:
        assert len(decode_batch(payload).events) == 1000
    finally:
        gc.callbacks.remove(seen)
    assert len(runs) <= 1 and gc.isenabled()
    gc.disable()  # a caller's choice is kept
    try:
        decode_batch(payload)
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_index_prefix_media_and_clear():
    idx = RemoteKVIndex("p0")
    idx.apply(batch(stored([to_event_id(h(i)) for i in range(5)]), stored([h(9)], medium="CPU")))
    assert idx.longest_prefix([h(0), h(1), h(2), h(7)]) == 3  # bytes meet ints
    assert idx.longest_prefix([to_event_id(h(0))]) == 1
    assert idx.contains(h(9), medium="CPU") and not idx.contains(h(9))
    assert idx.media() == ("CPU", "GPU") and idx.size() == 5
    idx.apply(batch(BlockRemoved(block_hashes=[to_event_id(h(1))], medium="GPU")))
    assert idx.longest_prefix([h(0), h(1), h(2)]) == 1
    idx.apply(batch(AllBlocksCleared()))
    assert idx.size() == 0 and idx.size("CPU") == 0


def test_index_duplicate_blocks_need_two_removals():
    idx = RemoteKVIndex()
    idx.apply(batch(stored([1]), stored([1])))
    idx.apply(batch(BlockRemoved(block_hashes=[1], medium="GPU")))
    assert idx.contains(1)
    idx.apply(
        batch(
            BlockRemoved(block_hashes=[1], medium="GPU"),
            BlockRemoved(block_hashes=[1], medium="GPU"),
        )
    )
    assert not idx.contains(1)


def test_index_batch_is_all_or_nothing():
    idx = RemoteKVIndex()
    with pytest.raises(ValueError, match="8 bytes"):
        idx.apply(batch(stored([1, 2]), BlockRemoved(block_hashes=[b"short"], medium="GPU")))
    assert idx.size() == 0
    for bad in ([-(2**63) - 1], [2**64], [1.5]):
        with pytest.raises(ValueError, match="block_hashes"):
            idx.longest_prefix(bad)
    with pytest.raises(ValueError, match="instance"):
        RemoteKVIndex("")
    with pytest.raises(ValueError, match="KVEventBatch"):
        idx.apply([1])


# ---- the subscriber over loopback ZMQ -----------------------------------------------------


def value(metric, *labels):
    return metric.labels(*labels)._value.get()


def run(ctx, metrics, pub, **kw):
    idx = RemoteKVIndex("p0")
    sub = EventStream(
        pub.endpoint,
        kw.pop("replay", pub.replay_endpoint),
        sink=KVIndexSink(idx),
        metrics=metrics,
        context=ctx,
        **kw,
    )
    return idx, sub.start()


def test_late_subscriber_replays_from_zero(ctx, publisher, metrics):
    pub = publisher()
    for i in range(20):
        pub.publish(batch(stored([i])))
    idx, sub = run(ctx, metrics, pub)
    try:
        assert pub.wait_joined(replays=1)  # the SUB's subscription arrived (slow joiner)
        pub.publish(batch(stored([20])))
        assert wait_for(lambda: sub.applied_seq == 20)
        assert idx.longest_prefix(list(range(21))) == 21
        assert value(metrics.replays, "p0") >= 1 and value(metrics.resyncs, "p0") == 0
    finally:
        sub.stop()


def test_dropped_batches_are_replayed(ctx, publisher, metrics):
    pub = publisher()
    idx, sub = run(ctx, metrics, pub)
    try:
        assert pub.wait_joined(replays=1)
        pub.publish(batch(stored([0])))
        assert wait_for(lambda: sub.applied_seq == 0)
        pub.publish(batch(stored([1])), drop=True)
        pub.publish(batch(BlockRemoved(block_hashes=[0], medium="GPU")), drop=True)
        pub.publish(batch(stored([3])))
        assert wait_for(lambda: sub.applied_seq == 3)
        assert not idx.contains(0) and idx.contains(1) and idx.contains(3)
        # the replay at start (from 0: the buffer then empty), and the gap's
        assert value(metrics.gaps, "p0") == 1 and value(metrics.replays, "p0") == 2
        assert value(metrics.resyncs, "p0") == 0
    finally:
        sub.stop()


def test_gap_beyond_the_replay_buffer_resets_the_view(ctx, publisher, metrics):
    pub = publisher(buffer_steps=2)
    idx, sub = run(ctx, metrics, pub)
    try:
        assert pub.wait_joined(replays=1)
        pub.publish(batch(stored([100])))
        assert wait_for(lambda: sub.applied_seq == 0)
        for i in range(1, 6):  # lost, and the buffer keeps only the last 2
            pub.publish(
                batch(BlockRemoved(block_hashes=[100], medium="GPU"), stored([i])), drop=True
            )
        pub.publish(batch(stored([6])))
        assert wait_for(lambda: sub.applied_seq == 6)
        assert value(metrics.resyncs, "p0") == 1
        # the stale block 100 is gone (the view was reset); what the replay held is back
        assert not idx.contains(100) and idx.contains(5) and idx.contains(6) and not idx.contains(1)
    finally:
        sub.stop()


def test_no_replay_endpoint_resets_on_a_gap(ctx, publisher, metrics):
    pub = publisher()
    idx, sub = run(ctx, metrics, pub, replay=None)
    try:
        assert pub.wait_joined()
        pub.publish(batch(stored([1])))
        assert wait_for(lambda: sub.applied_seq == 0)
        pub.publish(batch(stored([2])), drop=True)
        pub.publish(batch(stored([3])))
        assert wait_for(lambda: sub.applied_seq == 2)
        assert value(metrics.resyncs, "p0") == 1 and not idx.contains(1) and idx.contains(3)
    finally:
        sub.stop()


def test_publisher_restart_resets_the_view(ctx, publisher, metrics):
    pub = publisher()
    idx, sub = run(ctx, metrics, pub)
    try:
        assert pub.wait_joined(replays=1)
        for i in range(5):
            pub.publish(batch(stored([i])))
        assert wait_for(lambda: sub.applied_seq == 4)
        endpoint, replay = pub.endpoint, pub.replay_endpoint
        pub.close()
        pub = publisher(pub_endpoint=endpoint, replay_endpoint=replay)
        pub.publish(batch(stored([50])))  # seq 0 of the new process; the SUB may miss it
        assert pub.wait_joined()  # the SUB has reconnected: the next batch reaches it
        pub.publish(batch(stored([51])))
        assert wait_for(lambda: idx.contains(50))  # replayed from 0 if missed live
        assert value(metrics.restarts, "p0") == 1
        assert not idx.contains(0)
    finally:
        sub.stop()


# ---- completeness: a view that knows what it may miss --------------------------------------------


def test_a_subscriber_from_the_first_batch_is_complete(ctx, publisher, metrics):
    pub = publisher()
    for i in range(5):  # before the subscriber: replayed from seq 0
        pub.publish(batch(stored([i])))
    _, sub = run(ctx, metrics, pub)
    try:
        assert not sub.complete and value(metrics.complete, "p0", "kv") == 0
        assert pub.wait_joined(replays=1)
        pub.publish(batch(stored([5])))
        assert wait_for(lambda: sub.applied_seq == 5)
        assert sub.complete and value(metrics.complete, "p0", "kv") == 1
    finally:
        sub.stop()


@pytest.mark.parametrize("published, complete", [(0, True), (3, True), (30, False)])
def test_a_view_knows_at_once_whether_it_is_complete_while_p_is_idle(
    ctx, publisher, metrics, published, complete
):
    # No live batch needed: at start the subscriber replays whatever the buffer holds from 0.
    pub = publisher(buffer_steps=5)
    for i in range(published):
        pub.publish(batch(stored([i])))
    idx, sub = run(ctx, metrics, pub)
    try:
        want = None if published == 0 else published - 1
        assert wait_for(lambda: sub.applied_seq == want and (sub.complete or not complete))
        assert sub.complete is complete
        assert idx.size() == min(published, 5)
    finally:
        sub.stop()


def test_a_late_join_the_buffer_no_longer_covers_is_incomplete_until_a_clear(
    ctx, publisher, metrics
):
    # What P stored before the buffer's oldest batch is never published again: the view holds
    # what came since, and says it may miss the rest, until P clears its cache.
    pub = publisher(buffer_steps=2)
    for i in range(20):
        pub.publish(batch(stored([i])))
    idx, sub = run(ctx, metrics, pub)
    try:
        assert pub.wait_joined(replays=1)
        pub.publish(batch(stored([20])))
        assert wait_for(lambda: sub.applied_seq == 20)
        assert idx.contains(19) and idx.contains(20) and not idx.contains(0)
        assert not sub.complete and value(metrics.complete, "p0", "kv") == 0
        pub.publish(batch(AllBlocksCleared(), stored([21])))
        assert wait_for(lambda: sub.applied_seq == 21)
        assert sub.complete and value(metrics.complete, "p0", "kv") == 1
        assert not idx.contains(20) and idx.contains(21)
    finally:
        sub.stop()


def test_a_gap_replay_cannot_fill_makes_the_view_incomplete(ctx, publisher, metrics):
    pub = publisher()
    _, sub = run(ctx, metrics, pub, replay=None)
    try:
        assert pub.wait_joined()
        pub.publish(batch(stored([1])))
        assert wait_for(lambda: sub.complete)
        pub.publish(batch(stored([2])), drop=True)
        pub.publish(batch(stored([3])))
        assert wait_for(lambda: sub.applied_seq == 2)
        assert not sub.complete and value(metrics.complete, "p0", "kv") == 0
    finally:
        sub.stop()


def test_a_restarted_publisher_makes_the_view_complete_from_its_seq_zero(ctx, publisher, metrics):
    pub = publisher(buffer_steps=2)
    for i in range(10):
        pub.publish(batch(stored([i])))
    idx, sub = run(ctx, metrics, pub)
    try:
        assert pub.wait_joined(replays=1)
        pub.publish(batch(stored([10])))
        assert wait_for(lambda: sub.applied_seq == 10) and not sub.complete
        endpoint, replay = pub.endpoint, pub.replay_endpoint
        pub.close()
        pub = publisher(pub_endpoint=endpoint, replay_endpoint=replay)
        pub.publish(batch(stored([50])))  # seq 0 of a new process: its cache started empty
        assert pub.wait_joined()  # the SUB has reconnected: the next batch reaches it
        pub.publish(batch(stored([51])))
        assert wait_for(lambda: sub.complete) and idx.contains(50) and not idx.contains(10)
    finally:
        sub.stop()


def test_burst_is_applied_in_order(ctx, publisher, metrics):
    pub = publisher()
    idx, sub = run(ctx, metrics, pub)
    try:
        assert pub.wait_joined(replays=1)
        n = 3000
        for i in range(n):
            pub.publish(
                batch(
                    stored([i * 16 + j for j in range(16)]),
                    BlockRemoved(block_hashes=[i * 16], medium="GPU"),
                )
            )
        assert wait_for(lambda: sub.applied_seq == n - 1, timeout=30)
        assert idx.size() == n * 15
        assert value(metrics.batches, "p0") == n
        assert value(metrics.events, "p0", "BlockStored") == n
    finally:
        sub.stop()


def test_malformed_frames_and_payloads_are_counted_and_survived(ctx, publisher, metrics):
    pub = publisher()
    idx, sub = run(ctx, metrics, pub)
    try:
        assert pub.wait_joined(replays=1)
        pub.publish(batch(stored([1])))
        assert wait_for(lambda: sub.applied_seq == 0)
        pub.send_raw([b"", b"\x00\x01"])  # wrong frame count / seq width
        pub.publish(b"\xc1garbage")  # seq 1: undecodable, lost -> the view resets
        pub.publish(batch(stored([2])))
        assert wait_for(lambda: sub.applied_seq == 2)
        assert value(metrics.malformed, "p0") == 2
        assert value(metrics.resyncs, "p0") == 1
        assert idx.contains(2) and not idx.contains(1)
    finally:
        sub.stop()


def test_topic_filter_and_clean_idle(ctx, publisher, metrics):
    pub = publisher(topic="kv")
    idx = RemoteKVIndex("p1")
    sink = KVIndexSink(idx)
    sub = EventStream(
        pub.endpoint, pub.replay_endpoint, sink=sink, topic="kv", metrics=metrics, context=ctx
    ).start()
    try:
        assert pub.wait_joined(replays=1)
        pub.publish(batch(stored([9])))
        assert wait_for(lambda: idx.contains(9))
        t0 = time.process_time()
        time.sleep(0.5)  # the thing under test: idle, the thread waits in poll, no busy loop
        assert time.process_time() - t0 < 0.2
    finally:
        sub.stop()
    with pytest.raises(RuntimeError, match="started"):
        sub._thread = object()
        sub.start()


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"endpoint": "localhost:5557"}, "endpoint"),
        ({"endpoint": "tcp://127.0.0.1:1", "replay_endpoint": "x"}, "replay_endpoint"),
        ({"endpoint": "tcp://127.0.0.1:1", "topic": 3}, "topic"),
        ({"endpoint": "tcp://127.0.0.1:1", "sink": {}}, "sink"),
        ({"endpoint": "tcp://127.0.0.1:1", "limits": {"replay_timeout_s": 1}}, "limits"),
    ],
)
def test_stream_bad_arguments(kwargs, match):
    kwargs.setdefault("sink", KVIndexSink(RemoteKVIndex()))
    with pytest.raises(ValueError, match=match):
        EventStream(**kwargs)


@pytest.mark.parametrize(
    "field,bad",
    [
        ("poll_interval_s", 0),
        ("replay_timeout_s", 0),
        ("replay_deadline_s", -1.0),
        ("max_replay_batches", 0),
        ("max_replay_bytes", 0),
        ("max_message_bytes", 2**63),
        ("snapshot_deadline_s", 0),
        ("snapshot_retry_s", -1),
        ("max_stamp_ahead", -1),
        ("max_snapshot_items", -1),
        ("max_snapshot_bytes", 0),
        ("max_replay_batches", 1.5),
    ],
)
def test_stream_limits_name_the_field_and_the_value(field, bad):
    with pytest.raises(ValueError, match=f"^{field} .*{bad}"):
        StreamLimits(**{field: bad})


def test_a_kv_sink_is_fed_by_one_stream_and_keeps_its_index_bound(ctx):
    sink = KVIndexSink(RemoteKVIndex("p", max_media=4))
    with pytest.raises(InvalidArgumentType, match="index"):
        KVIndexSink({})
    with pytest.raises(StreamDied, match="no event stream feeds"):  # never followed: untrusted
        sink.longest_prefix([1])
    sub = EventStream("tcp://127.0.0.1:1", sink=sink, context=ctx)
    assert sub.sink is sink and sink.index.max_media == 4
    with pytest.raises(StreamDied, match="not running"):  # its stream not started
        sink.match_prefix([1])
    with pytest.raises(InvalidArgument, match="already fed by a stream"):
        EventStream("tcp://127.0.0.1:1", sink=sink, context=ctx)


# ---- against vLLM's own prefix cache ------------------------------------------------------


@pytest.mark.oracle
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_longest_prefix_equals_vllm_block_pool_hits(oracle_python, seed):
    """Replay vLLM's real BlockPool events (0.33.0, 0.34.0); at every admission, RemoteKVIndex fed by them
    hits as many leading blocks as vLLM's prefix cache, with the query hashed by mmreuse."""
    from mmreuse import BlockHasher

    py = oracle_python
    out = oracle_run(py, str(ORACLE_TOOLS / "vllm_blockpool_oracle.py"), str(seed))
    steps = json.loads(out.stdout.strip().splitlines()[-1])
    hasher = BlockHasher("sha256", 16, seed="0")
    idx = RemoteKVIndex("vllm")
    queries = hits = 0
    for step in steps:
        if "batch" in step:
            idx.apply(decode_batch(base64.b64decode(step["batch"])))
        else:
            hashes = hasher.hash_prompt(step["tokens"])
            assert idx.longest_prefix([to_event_id(x) for x in hashes]) == step["expected"]
            assert idx.longest_prefix(hashes) == step["expected"]
            queries += 1
            hits += step["expected"] > 0
    assert queries > 100 and hits > 30  # the scenario exercises real reuse and eviction


# ---- the KVView protocol and hash validation -------------------------------------------------


def test_index_match_prefix_is_the_gpu_longest_prefix():
    from mmreuse.kvview import KVView, PrefixMatch

    idx = RemoteKVIndex()
    idx.apply(batch(stored([1, 2, 3]), stored([1, 2, 3, 4], medium="CPU")))
    m = idx.match_prefix([1, 2, h(0), 3])
    assert isinstance(idx, KVView) and m == PrefixMatch(2, None)
    assert idx.longest_prefix([1, 2, 3, 4], medium="CPU") == 4
    assert idx.match_prefix([1, 2, 3, 4]).num_blocks == 3
    assert RemoteKVIndex().match_prefix([1]) == PrefixMatch(0)


def test_index_validates_every_hash():
    from mmreuse.errors import InvalidArgument, InvalidArgumentType

    idx = RemoteKVIndex()
    idx.apply(batch(stored([1, 2])))
    for hashes, cls, match in [
        ([99, "x"], InvalidArgumentType, r"block_hashes\[1\]"),  # was 0: stopped at the miss
        ([1, 2, "x"], InvalidArgumentType, r"block_hashes\[2\]"),
        ([1, 9, -1], InvalidArgument, r"block_hashes\[2\] must be an event id in .*, got -1"),
    ]:
        for call in (
            idx.longest_prefix,
            idx.match_prefix,
            RemoteKVIndex().longest_prefix,
            lambda x: idx.longest_prefix(x, medium="CPU"),
        ):
            with pytest.raises(cls, match=match):
                call(hashes)
    with pytest.raises(InvalidArgument, match="event id"):
        RemoteKVIndex().contains(-1)
    with pytest.raises(InvalidArgumentType, match="medium"):
        idx.longest_prefix([1], medium=None)


def test_index_apply_refuses_negative_ids_and_changes_nothing():
    from mmreuse.errors import InvalidArgument

    idx = RemoteKVIndex()
    idx.apply(batch(stored([5])))
    for bad in (-1, -(2**63)):
        with pytest.raises(InvalidArgument, match=r"block_hashes\[1\] must be an event id"):
            idx.apply(batch(stored([6]), stored([7, bad])))
        with pytest.raises(InvalidArgument, match="event id"):
            idx.apply(batch(BlockRemoved(block_hashes=[5, bad], medium="GPU")))
    assert idx.size() == 1 and idx.contains(5) and not idx.contains(6)


# ---- hostile input to RemoteKVIndex (issue #11) -------------------------------------------


def test_index_bounds_media_and_refuses_the_whole_batch():
    idx = RemoteKVIndex(max_media=2)
    assert idx.apply(batch(stored([1]), stored([2], "CPU"))) == 2
    with pytest.raises(InvalidArgument, match=r"batch names 3 media, more than max_media=2"):
        idx.apply(batch(stored([3]), stored([4], "DISK")))
    assert not idx.contains(3) and idx.media() == ("CPU", "GPU")  # nothing applied
    # AllBlocksCleared resets the count, within the same batch too
    assert idx.apply(batch(AllBlocksCleared(), stored([5], "A"), stored([6], "B"))) == 3
    assert idx.media() == ("A", "B")
    with pytest.raises(InvalidArgument, match=r"batch.events\[1\].medium must be at most 64"):
        idx.apply(batch(AllBlocksCleared(), stored([7], "x" * 65)))
    assert idx.media() == ("A", "B")
    idx.clear()  # a reset frees the media
    idx.apply(batch(stored([8], "C"), stored([9], "D")))
    assert idx.media() == ("C", "D")


@pytest.mark.parametrize(
    "events,match",
    [
        ([stored([1], 5)], r"batch.events\[0\].medium must be a str or None, got int 5"),
        ([BlockRemoved(block_hashes=[1], medium=[1])], r"batch.events\[0\].medium"),
        ([stored([1]), 3], r"batch.events\[1\] must be a BlockStored, BlockRemoved or"),
        ("ab", r"batch.events must be a list"),
    ],
)
def test_index_refuses_malformed_events(events, match):
    idx = RemoteKVIndex()
    with pytest.raises(InvalidArgumentType, match=match):
        idx.apply(KVEventBatch(ts=1.0, events=events))
    assert idx.size() == 0 and idx.media() == ()


@pytest.mark.parametrize("bad", [0, True, 2.0, "8", None])
def test_index_bad_max_media(bad):
    with pytest.raises(ValueError, match="max_media"):
        RemoteKVIndex(max_media=bad)


def test_index_medium_arguments_are_strs():
    idx = RemoteKVIndex()
    for call in (
        lambda: idx.size(3),
        lambda: idx.contains(1, 3),
        lambda: idx.longest_prefix([1], 3),
    ):
        with pytest.raises(InvalidArgumentType, match="medium must be a str"):
            call()


def _free_tcp_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_bind_mode_receives_from_a_connecting_publisher():
    """vLLM's publisher connects to a concrete tcp address: the subscriber then binds."""
    endpoint = f"tcp://127.0.0.1:{_free_tcp_port()}"
    idx = RemoteKVIndex("p-bind")
    sink, metrics = KVIndexSink(idx), Metrics(CollectorRegistry())
    sub = EventStream(endpoint, sink=sink, bind=True, metrics=metrics)
    sub.start()
    pub = zmq.Context.instance().socket(zmq.PUB)
    try:
        pub.connect(endpoint)
        seq = 0

        def sent_and_seen():
            nonlocal seq
            pub.send_multipart(
                [b"", seq.to_bytes(8, "big"), encode_batch(batch(stored([seq + 1])))]
            )
            seq += 1
            return idx.size() > 0  # the first ones may be lost (a gap, then a resync)

        assert wait_for(sent_and_seen)  # the first batches may go before the connection is up
        assert sub.is_alive
    finally:
        pub.close(0)
        sub.stop()


def test_bind_mode_refuses_an_endpoint_it_cannot_bind():
    with pytest.raises(InvalidArgument, match="bind"):
        EventStream(
            "ipc:///nonexistent-dir/mmreuse/kv.sock", sink=KVIndexSink(RemoteKVIndex()), bind=True
        ).start()
    with pytest.raises(InvalidArgumentType, match="bind"):
        EventStream("tcp://127.0.0.1:5557", sink=KVIndexSink(RemoteKVIndex()), bind="yes")


# ---- RemoteKVIndex.load: a snapshot in place of the history -------------------------------------


def test_load_replaces_the_view_with_a_snapshot_and_events_apply_on_top():
    idx = RemoteKVIndex("p0")
    idx.apply(batch(stored([1, 2]), stored([3], medium="CPU")))
    idx.load([2, 5, 7], [1, 2, 1])
    assert idx.counts() == {2: 1, 5: 2, 7: 1} and idx.media() == ("GPU",)  # CPU gone too
    idx.apply(batch(BlockRemoved(block_hashes=[5], medium="GPU")))
    assert idx.contains(5) and idx.counts()[5] == 1  # a second block still holds it
    idx.apply(batch(BlockRemoved(block_hashes=[5, 7], medium="GPU")))
    assert idx.counts() == {2: 1}
    idx.load([], [])
    assert idx.size() == 0


@pytest.mark.parametrize(
    "ids, counts, why",
    [
        ([1, 2], [1], "2 block_ids but 1 counts"),
        ([1, 1], [1, 1], "repeat an id"),
        ([1], [0], "counts[0] must be an int >= 1"),
        ([1], [True], "counts[0] must be an int >= 1"),
        ([-1], [1], "block_ids[0]"),
        ([2**64], [1], "block_ids[0]"),
    ],
)
def test_load_refuses_a_malformed_snapshot_whole(ids, counts, why):
    idx = RemoteKVIndex("p0")
    idx.apply(batch(stored([9])))
    with pytest.raises(InvalidArgument, match=why.replace("[", r"\[").replace("]", r"\]")):
        idx.load(ids, counts)
    assert idx.counts() == {9: 1}  # unchanged
