"""Time to a complete view for a P of N cached blocks: P taking the snapshot, the chunks over
ZMQ on loopback, and the proxy's view loading it (issue 22's goal: <= 1 s for 1M blocks).

P's side is `DemandScheduler._take_snapshot`'s work without vLLM: a `BlockIndex` of N blocks
(one distinct hash each) counted (`BlockIndex.counts`), then chunked and encoded as
`KVSnapshot`s by a ROUTER thread; the proxy's side is `events.snapshot.fetch_snapshot` and
`RemoteKVIndex.load`. Each phase is timed over `--repeat` runs (best and median printed).

    .venv/bin/python benchmarks/snapshot_bootstrap.py [--blocks 1000000] [--repeat 5]
"""

from __future__ import annotations

import argparse
import platform
import random
import statistics
import sys
import threading
import time
from pathlib import Path

import zmq

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mmreuse.demand_query import (
    MAX_SNAPSHOT_BLOCKS,
    KVSnapshot,
    SnapshotQuery,
    decode_query,
    encode,
)
from mmreuse.events import RemoteKVIndex
from mmreuse.events.snapshot import fetch_snapshot
from mmreuse.residency import BlockIndex


def take(index: BlockIndex) -> tuple[list[int], list[int]]:
    """What `_take_snapshot` does with the index (no pending events here)."""
    counts = index.counts()
    return list(counts), list(counts.values())


def serve(sock: zmq.Socket, index: BlockIndex, timings: dict, stop: threading.Event) -> None:
    held: dict[str, tuple[list[int], list[int]]] = {}
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    while not stop.is_set():
        if not poller.poll(50):
            continue
        ident, payload = sock.recv_multipart()
        q = decode_query(payload)
        assert isinstance(q, SnapshotQuery)
        if q.offset == 0:
            t0 = time.perf_counter()
            held[q.id] = take(index)
            timings.setdefault("take", []).append(time.perf_counter() - t0)
        ids, counts = held[q.id]
        end = q.offset + MAX_SNAPSHOT_BLOCKS
        chunk = KVSnapshot(q.id, 7, "bench", len(ids), q.offset, len(ids) + 1,
                           ids[q.offset:end], counts[q.offset:end])  # fmt: skip
        sock.send_multipart([ident, encode(chunk)])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--blocks", type=int, default=1_000_000)
    p.add_argument("--repeat", type=int, default=5)
    args = p.parse_args(argv)
    n = args.blocks
    rng = random.Random(0)
    index = BlockIndex(n, "cpu")
    hashes = [rng.getrandbits(64) for _ in range(n)]
    for start in range(0, n, 65536):
        index.store_many(hashes[start : start + 65536], list(range(start, min(n, start + 65536))))
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    timings: dict[str, list[float]] = {}
    stop = threading.Event()
    thread = threading.Thread(target=serve, args=(sock, index, timings, stop), daemon=True)
    thread.start()
    for _ in range(args.repeat):
        view = RemoteKVIndex("bench")
        t0 = time.perf_counter()
        snap = fetch_snapshot(f"tcp://127.0.0.1:{port}", context=ctx, max_blocks=n + 1)
        t1 = time.perf_counter()
        view.load(snap.block_ids, snap.counts)
        t2 = time.perf_counter()
        assert view.size() == n
        timings.setdefault("fetch", []).append(t1 - t0)
        timings.setdefault("load", []).append(t2 - t1)
        timings.setdefault("total", []).append(t2 - t0)
    stop.set()
    thread.join()
    sock.close(0)
    ctx.term()
    print(f"{n} blocks, {args.repeat} runs, {platform.processor() or platform.machine()}")
    for name, label in (
        ("take", "P: take the snapshot (count the index)"),
        ("fetch", "fetch: take + chunks over ZMQ + decode"),
        ("load", "proxy: load into the view"),
        ("total", "start to a complete view"),
    ):
        xs = timings[name]
        print(f"  {label:42s} best {min(xs):.3f} s  median {statistics.median(xs):.3f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
