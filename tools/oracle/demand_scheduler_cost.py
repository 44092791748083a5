"""Run in a vLLM oracle venv (0.33.0, 0.34.0; PYTHONPATH = the mmreuse checkout): what DemandScheduler
adds to vLLM's Scheduler per engine step (schedule + update_from_output: the lock, the residency
index fed by the block pool, proof checks at admission), and what one answer costs, idle and
while the engine thread steps.

Both schedulers get the same multi-turn multimodal stream (tools/oracle/demand_scheduler_check.py's),
one demand query answered per request for DemandScheduler (as the proxy's `demand` policy asks);
rounds alternate which runs first; per-step times are the best round's mean (busy and
idle steps together). Prints JSON."""

from __future__ import annotations

import importlib.util
import json
import random
import statistics
import sys
import threading
import time
from pathlib import Path

from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler

from mmreuse.demand_query import encode
from mmreuse.integrations.vllm import DemandScheduler

_spec = importlib.util.spec_from_file_location(
    "demand_check", Path(__file__).with_name("demand_scheduler_check.py")
)
check = importlib.util.module_from_spec(_spec)  # type: ignore[arg-type]
_spec.loader.exec_module(check)  # type: ignore[union-attr]


def workload(seed: int, turns: int) -> list[list[tuple[list[int], list]]]:
    stream = check.Stream(random.Random(seed))
    rng = random.Random(seed + 1)
    return [[stream.next() for _ in range(rng.choice([1, 2]))] for _ in range(turns)]


def drive(cls, model, batches, hasher, ask: bool) -> tuple[list[float], list[float]]:
    """Per-step seconds (schedule + update) and per-answer seconds."""
    s = check.make_scheduler(cls, model, num_blocks=256, cache_size=192)
    steps, answers, rid = [], [], 0
    for turn, batch in enumerate(batches):
        for tokens, items in batch:
            qid = f"q{turn}-{rid}"
            if ask:
                t0 = time.perf_counter()
                s._answers.handle(encode(check.query(qid, tokens, items)))
                answers.append(time.perf_counter() - t0)
            s.add_request(check.request(f"r{rid}", tokens, items, hasher, qid if ask else None))
            rid += 1
        for _ in range(4):
            t0 = time.perf_counter()
            out = s.schedule()
            s.update_from_output(out, check.runner_output(out))
            steps.append(time.perf_counter() - t0)
    return steps, answers


def busy_answers(model, batches, hasher) -> list[float]:
    """Answer latency while another thread steps the scheduler without pause."""
    s = check.make_scheduler(DemandScheduler, model, num_blocks=256, cache_size=192)
    stop = threading.Event()
    rid = 0

    def engine() -> None:
        nonlocal rid
        while not stop.is_set():
            for tokens, items in batches[rid % len(batches)]:
                s.add_request(check.request(f"b{rid}", tokens, items, hasher))
                rid += 1
            for _ in range(4):
                out = s.schedule()
                s.update_from_output(out, check.runner_output(out))

    t = threading.Thread(target=engine, daemon=True)
    t.start()
    lat = []
    for k in range(300):
        tokens, items = batches[k % len(batches)][0]
        t0 = time.perf_counter()
        s._answers.handle(encode(check.query(f"busy-{k}", tokens, items)))
        lat.append(time.perf_counter() - t0)
    stop.set()
    t.join()
    return lat


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] * 1e6


def main(turns: int = 150, rounds: int = 8) -> dict:
    init_none_hash(sha256)
    hasher = get_request_block_hasher(check.BLOCK, sha256)
    model = check.tiny_model_dir()
    batches = workload(0, turns)
    med = {"vllm": [], "demand": []}
    idle: list[float] = []
    for r in range(rounds):
        order = [("vllm", Scheduler, False), ("demand", DemandScheduler, True)]
        for name, cls, ask in order if r % 2 == 0 else order[::-1]:
            steps, answers = drive(cls, model, batches, hasher, ask)
            med[name].append(statistics.fmean(steps))
            idle += answers
    busy = busy_answers(model, batches, hasher)
    best = {k: min(v) * 1e6 for k, v in med.items()}
    return {
        "steps_per_run": turns * 4,
        "step_mean_us": best,
        "step_added_us": best["demand"] - best["vllm"],
        "answer_idle_us": {"p50": pct(idle, 0.5), "p99": pct(idle, 0.99), "n": len(idle)},
        "answer_busy_us": {"p50": pct(busy, 0.5), "p99": pct(busy, 0.99), "n": len(busy)},
    }


if __name__ == "__main__":
    print(json.dumps(main(*[int(a) for a in sys.argv[1:]])))
