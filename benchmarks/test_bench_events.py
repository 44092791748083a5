"""pytest-benchmark: KV-event ingest (decode and apply separately) and RemoteKVIndex lookups.

.venv/bin/python -m pytest benchmarks/test_bench_events.py --benchmark-enable
"""

import random

import pytest

from mmreuse.events import (
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    RemoteKVIndex,
    decode_batch,
    encode_batch,
)

BATCH_EVENTS = 64  # events per published batch (a scheduler step's worth)
BLOCKS_PER_EVENT = 16


def _extra_keys(rng, keys):
    """Per-block extra keys as vLLM 0.33.0 publishes them: none (before 0.17), text only (all
    None), or mm: an image over blocks 4-11 of the event, its (identifier, offset) pair on each."""
    if keys == "none":
        return None
    if keys == "text":
        return [None] * BLOCKS_PER_EVENT
    ident = f"{rng.getrandbits(128):032x}"
    return [((ident, -16 * (i - 4) + 3),) if 4 <= i < 12 else None for i in range(BLOCKS_PER_EVENT)]


def make_payloads(num_batches=64, seed=0, keys="none"):
    rng = random.Random(seed)
    payloads = []
    for _ in range(num_batches):
        events = [
            BlockStored(
                block_hashes=[rng.getrandbits(64) for _ in range(BLOCKS_PER_EVENT)],
                parent_block_hash=rng.getrandbits(64),
                token_ids=[rng.randrange(150000) for _ in range(16 * BLOCKS_PER_EVENT)],
                block_size=16,
                lora_id=None,
                medium="GPU",
                lora_name=None,
                extra_keys=_extra_keys(rng, keys),
            )
            for _ in range(BATCH_EVENTS)
        ]
        payloads.append(encode_batch(KVEventBatch(ts=1.0, events=events, data_parallel_rank=0)))
    return payloads


def test_decode(benchmark):
    payloads = make_payloads()
    batches = benchmark(lambda: [decode_batch(p) for p in payloads])
    blocks = sum(len(e.block_hashes) for b in batches for e in b.events)
    benchmark.extra_info["blocks_per_round"] = blocks


def test_apply_stored(benchmark):
    batches = [decode_batch(p) for p in make_payloads()]
    blocks = sum(len(e.block_hashes) for b in batches for e in b.events)

    def run():
        idx = RemoteKVIndex()
        for b in batches:
            idx.apply(b)
        return idx

    idx = benchmark(run)
    assert idx.size() == blocks
    benchmark.extra_info["blocks_per_round"] = blocks


def test_apply_stored_then_removed(benchmark):
    batches = [decode_batch(p) for p in make_payloads(16)]
    removes = [
        KVEventBatch(
            ts=1.0,
            events=[BlockRemoved(block_hashes=e.block_hashes, medium="GPU") for e in b.events],
        )
        for b in batches
    ]

    def run():
        idx = RemoteKVIndex()
        for b in batches:
            idx.apply(b)
        for b in removes:
            idx.apply(b)
        return idx

    assert benchmark(run).size() == 0


@pytest.mark.parametrize("track", [False, True], ids=["untracked", "tracked"])
@pytest.mark.parametrize("keys", ["text", "mm"])
def test_apply_stored_extra_keys(benchmark, keys, track):
    """`test_apply_stored` with vLLM 0.33.0's extra keys (identifiers followed from them when
    tracked: `RemoteKVIndex(track_identifiers=True)`)."""
    batches = [decode_batch(p) for p in make_payloads(keys=keys)]
    blocks = sum(len(e.block_hashes) for b in batches for e in b.events)

    def run():
        idx = RemoteKVIndex(track_identifiers=track)
        for b in batches:
            idx.apply(b)
        return idx

    assert benchmark(run).size() == blocks


@pytest.mark.parametrize("track", [False, True], ids=["untracked", "tracked"])
@pytest.mark.parametrize("keys", ["text", "mm"])
def test_apply_stored_then_removed_extra_keys(benchmark, keys, track):
    batches = [decode_batch(p) for p in make_payloads(16, keys=keys)]
    removes = [
        KVEventBatch(
            ts=1.0,
            events=[BlockRemoved(block_hashes=e.block_hashes, medium="GPU") for e in b.events],
        )
        for b in batches
    ]

    def run():
        idx = RemoteKVIndex(track_identifiers=track)
        for b in batches:
            idx.apply(b)
        for b in removes:
            idx.apply(b)
        return idx

    assert benchmark(run).size() == 0


@pytest.mark.parametrize("kind", ["event_ids", "bytes"])
def test_longest_prefix_2048(benchmark, kind):
    rng = random.Random(1)
    idx = RemoteKVIndex()
    chain = [rng.getrandbits(64) for _ in range(2048)]
    other = [rng.getrandbits(64) for _ in range(100_000)]
    idx.apply(
        KVEventBatch(
            ts=0.0,
            events=[
                BlockStored(
                    block_hashes=chain + other,
                    parent_block_hash=None,
                    token_ids=[],
                    block_size=16,
                    lora_id=None,
                    medium="GPU",
                    lora_name=None,
                )
            ],
        )
    )
    query = chain if kind == "event_ids" else [bytes(24) + h.to_bytes(8, "big") for h in chain]
    assert benchmark(idx.longest_prefix, query) == 2048


def _published_batches(keys, num_batches=16, seed=0):
    """Store batches as P's scheduler publishes them (before encoding: extra keys as vLLM's
    tuples, int hashes), then the batches removing the same blocks."""
    rng = random.Random(seed)
    stores = []
    for _ in range(num_batches):
        events = []
        for _ in range(BATCH_EVENTS):
            extra = _extra_keys(rng, keys)
            events.append(
                BlockStored(
                    block_hashes=[rng.getrandbits(64) for _ in range(BLOCKS_PER_EVENT)],
                    parent_block_hash=None,
                    token_ids=[0] * (16 * BLOCKS_PER_EVENT),
                    block_size=16,
                    lora_id=None,
                    medium="GPU",
                    lora_name=None,
                    extra_keys=extra,
                )
            )
        stores.append(events)
    removes = [[BlockRemoved(block_hashes=e.block_hashes, medium="GPU") for e in b] for b in stores]
    return stores, removes


@pytest.mark.parametrize("keys", ["text", "mm"])
def test_p_follows_published_identifiers(benchmark, keys):
    """P's cost of following its blocks' identifiers for its KV snapshot
    (`events.identifiers.PublishedIdentifiers.follow`, under the scheduler's lock after each
    publish): 16 batches of 64 BlockStored (16 blocks each), then 16 of their BlockRemoved.
    Per event: the mean divided by `events_per_round`."""
    from mmreuse.events.identifiers import PublishedIdentifiers

    stores, removes = _published_batches(keys)
    events = sum(len(b) for b in stores + removes)

    def run():
        follower = PublishedIdentifiers(1 << 20)
        for b in stores:
            follower.follow(b)
        held = follower.carriers()
        for b in removes:
            follower.follow(b)
        return held, follower.carriers()

    held, after = benchmark(run)
    assert after == {} and (len(held) > 0) == (keys == "mm")
    benchmark.extra_info["events_per_round"] = events
