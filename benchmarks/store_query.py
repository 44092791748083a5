"""What `mmreuse proxy --e-store-url` adds to an `index` request: one `/batch_query_keys` to a
real Mooncake master on loopback (`mmreuse.proxy.store.StoreTruth`), timed for a request of
1, 4 and 16 items, half of them held.

    .venv/bin/mmreuse cluster install        # once: the Mooncake Store in the side venv
    .venv/bin/python benchmarks/store_query.py [--queries 2000]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mmreuse.cluster.mooncake import MooncakeStore
from mmreuse.embedding_store import embedding_key
from mmreuse.proxy.store import StoreTruth
from tests.support.mooncake_client import Client

NS = "embedding@model:bench@revision:default@encoder:x@dtype:torch.bfloat16@protocol:v3"


async def _time(truth: StoreTruth, idents: list[str], n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        got = await truth.held(idents)
        out.append((time.perf_counter() - t0) * 1e3)
        assert got == frozenset(idents[::2])  # the even ones are held
    return out


async def _run(store: MooncakeStore, queries: int) -> None:
    async with aiohttp.ClientSession() as session:
        truth = StoreTruth(store.spec.http_url, NS, lambda: session, timeout_s=1.0)
        for items in (1, 4, 16):
            idents = [f"img-{i}" for i in range(items)]
            ms = await _time(truth, idents, queries)
            p50, p99 = np.percentile(ms, 50), np.percentile(ms, 99)
            print(f"  {items:>2} items: p50 {p50:.3f} ms, p99 {p99:.3f} ms ({queries} queries)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--queries", type=int, default=2000)
    args = parser.parse_args()
    with (
        tempfile.TemporaryDirectory() as tmp,
        MooncakeStore(Path(tmp), capacity_bytes=1 << 20) as store,
    ):
        writer = Client(store, 0)
        try:
            held = [embedding_key(NS, f"img-{i}") for i in range(0, 16, 2)]
            assert writer.ask("put", *[[k, 4120] for k in held]) == [0] * len(held)
        finally:
            writer.close()
        print("mmreuse.proxy.store.StoreTruth.held against mooncake_master on loopback:")
        asyncio.run(_run(store, args.queries))
    return 0


if __name__ == "__main__":
    sys.exit(main())
