"""Run in a vLLM oracle venv (0.33.0, 0.34.0; PYTHONPATH = the mmreuse checkout): `DemandScheduler`'s
KV snapshots against vLLM's own KV events, on the multi-turn multimodal stream of
`demand_scheduler_check.py` (a small KV pool, so that blocks are evicted and re-stored).

vLLM's scheduler publishes KV events (`enable_kv_cache_events`, a recording publisher). At
random points (after `update_from_output`, and between `schedule` and `update_from_output`,
when the block pool holds events not yet published) a snapshot is taken over the query path;
the view it bootstraps (`RemoteKVIndex.load`, then every batch from its stamp on) must equal the
view of every batch from 0, at the end and at every later step. Printed as one JSON line.
"""

from __future__ import annotations

import json
import random
import sys

import msgspec
from demand_scheduler_check import (
    BLOCK,
    Stream,
    make_scheduler,
    request,
    runner_output,
    tiny_model_dir,
)
from vllm.config import KVEventsConfig
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

from mmreuse.demand_query import (
    ECSnapshot,
    ECSnapshotQuery,
    KVSnapshot,
    SnapshotQuery,
    decode_answer,
    encode,
)
from mmreuse.events import RemoteKVIndex
from mmreuse.events.ec_wire import apply_ec_batch
from mmreuse.events.wire import decode_batch
from mmreuse.integrations import snapshots
from mmreuse.integrations.vllm import DemandScheduler, EventfulEncoderCacheManager


def table(index: RemoteKVIndex) -> dict[int, int]:
    return index.counts()


def snapshot(sched, sid: str) -> KVSnapshot:
    chunks, offset = [], 0
    while True:
        chunk = decode_answer(sched._answers.handle(encode(SnapshotQuery(sid, offset))))
        assert isinstance(chunk, KVSnapshot), chunk
        chunks.append(chunk)
        offset += len(chunk.block_ids)
        if offset >= chunk.total:
            break
    first = chunks[0]
    ids = [i for c in chunks for i in c.block_ids]
    counts = [n for c in chunks for n in c.counts]
    return KVSnapshot(
        sid, first.stamp, first.incarnation, first.total, 0, first.blocks, ids, counts
    )


def ec_snapshot(handle, sid: str) -> tuple[int, dict]:
    """The whole ECSnapshot over a query path (`handle`: P's demand endpoint's, or the encoder
    cache manager's own, as E serves it), as the state it bootstraps."""
    state, offset = {}, 0
    while True:
        chunk = decode_answer(handle(encode(ECSnapshotQuery(sid, offset))))
        assert isinstance(chunk, ECSnapshot), chunk
        for e in chunk.entries:
            state[e.identifier] = [e.num_embeds, e.freeable]
        offset += len(chunk.entries)
        if offset >= chunk.total:
            return chunk.stamp, state


class Recorder:
    """An encoder-cache event publisher that keeps every batch (seq = position)."""

    def __init__(self) -> None:
        self.batches: list = []

    def publish(self, batch) -> None:
        self.batches.append(batch)


def main(seed: int = 0, turns: int = 120) -> dict:
    rng = random.Random(seed)
    snapshots.SNAPSHOT_MIN_INTERVAL_S = 0.0  # a snapshot at any step (the limit: below)
    init_none_hash(sha256)
    hasher = get_request_block_hasher(BLOCK, sha256)
    sched = make_scheduler(DemandScheduler, tiny_model_dir(), num_blocks=40, cache_size=96,
                           kv_events=KVEventsConfig(enable_kv_cache_events=True,
                                                    publisher="null"))  # fmt: skip
    batches: list[bytes] = []  # what vLLM published, in order (seq = position)
    counted = sched.kv_event_publisher.publish

    def record(batch) -> None:
        batches.append(encode_batch(batch))
        counted(batch)

    sched.kv_event_publisher.publish = record
    sched._kv_snapshots.chunk = 7  # several chunks per snapshot
    ecm = EventfulEncoderCacheManager(cache_size=96)  # the scheduler's encoder cache, eventful
    ecm.publisher = Recorder()
    sched.encoder_cache_manager = ecm
    ecm.snapshots.chunk = 2
    ec_boots: list[tuple[int, dict]] = []
    stream = Stream(rng)
    taken: list[tuple[KVSnapshot, RemoteKVIndex]] = []  # each snapshot's bootstrapped view
    c = {"snapshots": 0, "pending_at_snapshot": 0, "mismatch": 0, "stamp_mismatch": 0,
         "max_blocks": 0, "batches": 0}  # fmt: skip

    def take(where: str) -> None:
        pending = len(sched.kv_cache_manager.block_pool.kv_event_queue)
        snap = snapshot(sched, f"s{len(taken)}-{where}")
        if snap.stamp != len(batches):
            c["stamp_mismatch"] += 1
        view = RemoteKVIndex("boot")
        view.load(snap.block_ids, snap.counts)
        taken.append((snap, view))
        c["snapshots"] += 1
        c["pending_at_snapshot"] += pending > 0
        # alternately through P's demand endpoint and the manager's own (E's)
        handle = ecm.handle if len(ec_boots) % 2 else sched._answers.handle
        ec_boots.append(ec_snapshot(handle, f"e{len(ec_boots)}-{where}"))
        c["ec_entries_max"] = max(c.get("ec_entries_max", 0), len(ec_boots[-1][1]))
        c["max_blocks"] = max(c["max_blocks"], snap.total)

    applied = 0
    full = RemoteKVIndex("full")

    def catch_up() -> None:  # every view applies the batches published since
        nonlocal applied
        for seq in range(applied, len(batches)):
            batch = decode_batch(batches[seq])
            full.apply(batch)
            for snap, view in taken:
                if seq >= snap.stamp:
                    view.apply(batch)
        applied = len(batches)
        want = table(full)
        c["mismatch"] += sum(1 for _, view in taken if table(view) != want)

    rid = 0
    for _turn in range(turns):
        for _ in range(rng.choice([1, 1, 2, 3])):
            tokens, items = stream.next()
            sched.add_request(request(f"r{rid}", tokens, items, hasher))
            rid += 1
        for _ in range(4):
            out = sched.schedule()
            if rng.random() < 0.15:
                take("mid")  # the pool holds this step's events, not yet published
            sched.update_from_output(out, runner_output(out))
            if rng.random() < 0.15:
                take("after")
            catch_up()
    c["batches"] = len(batches)
    c["chunked"] = sum(1 for snap, _ in taken if snap.total > 7)
    # the rate limit: an unchanged P shares its last snapshot; a changed one waits the interval
    snapshots.SNAPSHOT_MIN_INTERVAL_S = 1000.0
    first = snapshot(sched, "limit-1")
    again = snapshot(sched, "limit-2")  # nothing changed: the same copy, no error
    c["unchanged_shared"] = (again.stamp, again.block_ids) == (first.stamp, first.block_ids)
    sched._kv_snapshots.published += (
        1  # as if P had published a batch since (its stream may be stuck)
    )
    c["changed"] = True
    limited = decode_answer(sched._answers.handle(encode(SnapshotQuery("limit-3"))))
    c["changed_limited"] = "one per" in getattr(limited, "error", "")
    ecm.flush()
    real = {h: [n, h in ecm.freeable] for h, n in ecm.num_embeds_by_hash.items()}
    for stamp, boot in ec_boots:
        for batch in ecm.publisher.batches[stamp:]:
            apply_ec_batch(boot, batch)
    c["ec_snapshots"] = len(ec_boots)
    c["ec_mismatch"] = sum(1 for _, boot in ec_boots if boot != real)
    c["ec_batches"] = len(ecm.publisher.batches)
    # a P without KV events has no snapshot to give: a DemandError that says why
    quiet = make_scheduler(DemandScheduler, tiny_model_dir(), num_blocks=40, cache_size=96)
    err = decode_answer(quiet._answers.handle(encode(SnapshotQuery("q"))))
    c["no_events_error"] = getattr(err, "error", None)
    err = decode_answer(quiet._answers.handle(encode(ECSnapshotQuery("q"))))
    c["no_ec_events_error"] = getattr(err, "error", None)
    # the manager's own endpoint answers encoder-cache snapshots only
    err = decode_answer(ecm.handle(encode(SnapshotQuery("kv"))))
    c["ec_endpoint_kv_error"] = getattr(err, "error", None)
    # the encoder cache's snapshot is paced as P's, whichever endpoint asks: one taken now...
    snapshots.SNAPSHOT_MIN_INTERVAL_S = 0.0
    first = ec_snapshot(sched._answers.handle, "ec-limit-1")
    snapshots.SNAPSHOT_MIN_INTERVAL_S = 1000.0
    again = ec_snapshot(ecm.handle, "ec-limit-2")  # ...shared while nothing changed
    c["ec_unchanged_shared"] = again == first
    ecm.published += 1  # as if the manager had published a batch since
    limited = decode_answer(ecm.handle(encode(ECSnapshotQuery("ec-limit-3"))))
    c["ec_changed_limited"] = "one per" in getattr(limited, "error", "")
    return c


def encode_batch(batch) -> bytes:
    """vLLM's batch as its ZMQ publisher sends it (msgpack of the struct)."""
    return msgspec.msgpack.encode(batch)


if __name__ == "__main__":
    print(json.dumps(main(*[int(a) for a in sys.argv[1:]])))
