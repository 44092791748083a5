"""pytest-benchmark: loading a 100k-line trace (`mmreuse.sim.workload`, both passes: checking every
line, then building every session's tokens). The loader is linear; the goal is about a second.

.venv/bin/python -m pytest benchmarks/test_bench_sim.py --benchmark-enable
"""

import itertools
import json
import random

import pytest

pytest.importorskip("torch")  # mmreuse.sim needs it

from mmreuse.sim import WorkloadConfig, generate

LINES = 100_000


def write_trace(path, lines=LINES, seed=0):
    """`lines` turns of multi-turn chat: ~8 turns a session, 1 in 4 turns with an image (a third
    of them shared across sessions), sessions interleaved, each session's turns in order."""
    rng = random.Random(seed)
    records, t, session = [], 0.0, 0
    while len(records) < lines:
        t += rng.expovariate(2.0)
        arrival = t
        for turn in range(rng.randint(1, 15)):
            images = []
            if rng.random() < 0.25:
                ident = (
                    f"shared-{rng.randrange(500)}"
                    if rng.random() < 1 / 3
                    else f"own-{session}-{turn}"
                )
                images.append({"id": ident, "tokens": 576})
            records.append(
                (
                    arrival,
                    {
                        "session": f"s{session}",
                        "arrival_s": round(arrival, 3),
                        "text_tokens": rng.randint(30, 150),
                        "images": images,
                        "output_tokens": rng.randint(50, 300),
                    },
                )
            )
            arrival += rng.expovariate(1 / 8.0)
        session += 1
    records.sort(key=lambda r: r[0])
    path.write_text("".join(json.dumps(rec) + "\n" for _, rec in records[:lines]))
    return path


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    return write_trace(tmp_path_factory.mktemp("trace") / "trace.jsonl")


def test_load_100k_line_trace(benchmark, trace):
    cfg = WorkloadConfig(kind="trace", trace_path=str(trace), requests=LINES)
    requests = benchmark.pedantic(generate, args=(cfg, 0), rounds=3, iterations=1)
    assert len(requests) == LINES
    assert all(a.arrival_ms <= b.arrival_ms for a, b in itertools.pairwise(requests))
