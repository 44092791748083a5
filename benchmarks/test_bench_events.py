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


def make_payloads(num_batches=64, seed=0):
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
