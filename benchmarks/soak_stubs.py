"""A soak of `mmreuse proxy` at saturation on instant stub backends: does anything the proxy
holds grow while it serves, and is any request lost?

It starts 2 E + 2 PD stubs (`stub_backends.py`, E + PD: `--prefill-servers-urls none`), one
in-script fakes process (per PD: a ZMQ KV-event publisher with vLLM's wire and replay,
`tests/support/kv_publisher.py`, and a fake `DemandScheduler` endpoint) and one `mmreuse proxy`
per policy, all running at once for the whole soak:

- `eager`: every item to E;
- `index`: `--kv-events-endpoints` (+ replay) on the fake publishers, `--hash-seed 0
  --block-size 16`. Each publisher holds the prompt of every pool image's canonical request (the
  BlockStored that P would publish, hashed as the stub PD renders it) and churns one pool image
  a tick (`--churn-s`: a batch that removes then stores its blocks), so the view keeps applying
  events and the plan finds real KV hits;
- `demand` and `opportunistic`: `--demand-endpoints` on the fake P endpoints, which answer at
  once with `plan_admission`'s demand: a request whose items are all pool images at P's longest
  possible prefix hit (held: E skipped, or abandoned in flight under opportunistic), any other
  at 0 (every item needed).

One load process (uvloop, raw HTTP/1.1 keep-alive) drives each proxy in a closed loop with
`--concurrency` connections for `--duration` seconds. Each request is a chat completion with 1
or 2 small PNG images as data: URLs, each drawn half the time from a pool of 64 (with a `uuid`;
a lone pool image comes in its canonical request) and half the time fresh; a quarter of the
requests stream. Every request ends as ok (200 with a whole answer), failed (by status; `bad`:
a 200 whose body is not a whole answer) or lost (no answer within `--request-timeout`, or the
connection dropped). At the end each proxy's `mmreuse_proxy_requests_total` (all outcomes) must
equal what was sent to it: no request lost.

Every `--sample-s` seconds, per proxy process group: RSS (VmRSS), open fds, threads (from
/proc), and from its /metrics, when exported: `mmreuse_proxy_tasks` (asyncio tasks alive) and
`mmreuse_proxy_upstream_connections{state="idle"|"busy"}` (pooled connections to E and PD;
`conns` is their sum, the pool's size).
Samples are taken once before the load (`before`), during it, and once 3 s after it drained
(`drained`). Per quantity: the first sample at or after `--warmup-s` (`warm`), the last one
under load (`end`), the max under load, the least-squares slope per minute over the samples
from `warm` to `end`, and `drained`.

Flat rule (the `flat` column):
- RSS: end <= 1.05 x warm, and the fitted growth over the post-warm-up window (slope x its
  minutes) <= 5 % of warm;
- fds, threads, conns (idle + busy): end <= W + C and drained <= W + C, where W is the max of
  the samples under load up to and including `warm` (the warm-up window), and C a small
  constant: 12 for fds, 2 for threads, 8 for conns;
- tasks: end <= W + 16, and drained <= before + 2 (every request's tasks gone);
- busy conns: end <= W + 8, and drained <= before (no connection stays busy once every
  request has ended);
- idle conns: shown, not judged on their own (they are the pool less the busy ones).
A quantity not exported reads n/a and is not judged. A policy is flat when every judged
quantity is, and "no request lost" when lost == 0 and its proxy counted every request sent.

Run from the repository root (10 minutes at the defaults, plus ~30 s of start and drain):

    .venv/bin/python benchmarks/soak_stubs.py [--duration 600] [--concurrency 8]
        [--sample-s 10] [--warmup-s 60] [--policies eager,index,demand,opportunistic]
        [--json /tmp/soak.json]
"""

from __future__ import annotations

import argparse
import array
import asyncio
import base64
import contextlib
import json
import os
import random
import re
import select
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO))

from proxy_overhead import (  # noqa: E402  (this script's folder)
    ClientProtocol,
    Proc,
    chat_post,
    cpu_model,
    free_port,
    group_stat,
    http_get,
    png,
    wait_healthy,
)

POLICIES = ("eager", "index", "demand", "opportunistic")
POOL = 64
BLOCK = 16
HASH_SEED = "0"
# The canonical request of a lone pool image: PRE, the image, POST. The stub PD renders a token
# per 4 bytes of text and 16 per image: 1 + 11 + 16 + 11 = 39 tokens, two full blocks that hold
# the whole image (offsets 12..27), so P's KV can cover it.
PRE = "Describe this image in one short sentence"
POST = "Answer plainly, without any preamble. OK?"
MODEL = "stub-model"
QUANTITIES = ("rss_mib", "fds", "threads", "tasks", "conns", "conn_idle", "conn_busy")
LABELS = {
    "rss_mib": "RSS MiB",
    "fds": "open fds",
    "threads": "threads",
    "tasks": "asyncio tasks",
    "conns": "upstream conns (idle + busy)",
    "conn_idle": "upstream conns idle",
    "conn_busy": "upstream conns busy",
}
# Slack C over the warm-up window's max (see the flat rule); a quantity absent is not judged.
SLACK = {"fds": 12, "threads": 2, "tasks": 16, "conns": 8, "conn_busy": 8}
# Drained values judged against the `before` sample plus this, instead of W + C.
DRAINED_OVER_BEFORE = {"tasks": 2, "conn_busy": 0}
RSS_GROWTH = 0.05
REQUESTS = "mmreuse_proxy_requests_total"


def pool_uuid(k: int) -> str:
    return f"pool-{k}"


def canonical_content(part: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"type": "text", "text": PRE}, part, {"type": "text", "text": POST}]


# --------------------------------------------------------------------------------------------
# The fakes process: KV-event publishers and demand endpoints (`--internal fakes`)
# --------------------------------------------------------------------------------------------


def pool_events(k: int) -> tuple[Any, Any]:
    """(BlockRemoved, BlockStored) of the full blocks of pool image k's canonical prompt, as
    the stub PD renders it and P would hash and publish it (vLLM 0.33's untagged extra keys)."""
    from stub_backends import render_answer

    from mmreuse.blockhash import to_event_id
    from mmreuse.events import BlockRemoved, BlockStored
    from mmreuse.hashing import BlockHasher, MMOccurrence

    part = {"type": "image_url", "image_url": {"url": "x"}, "uuid": pool_uuid(k)}
    body = {"model": MODEL, "messages": [{"role": "user", "content": canonical_content(part)}]}
    rendered = json.loads(render_answer(json.dumps(body).encode()))
    tokens = rendered["token_ids"]
    features = rendered["features"]
    occs = [
        MMOccurrence(ident, r["offset"], r["length"], modality="image")
        for ident, r in zip(
            features["mm_hashes"]["image"], features["mm_placeholders"]["image"], strict=True
        )
    ]
    blocks = len(tokens) // BLOCK
    hasher = BlockHasher("sha256", BLOCK, seed=HASH_SEED)
    hashes: list[bytes | int] = [
        to_event_id(h) for h in hasher.hash_prompt(tokens, mm=occs)[:blocks]
    ]
    keys = hasher.block_extra_keys(tokens, mm=occs)[:blocks]
    stored = BlockStored(
        block_hashes=hashes,
        parent_block_hash=None,
        token_ids=tokens[: blocks * BLOCK],
        block_size=BLOCK,
        lora_id=None,
        medium="GPU",
        lora_name=None,
        extra_keys=[
            None if key is None else tuple((x[1], x[2]) if x[0] == "mm" else x[1] for x in key)
            for key in keys
        ],
    )
    return BlockRemoved(block_hashes=list(hashes), medium="GPU"), stored


def demand_reply(query: Any) -> Any:
    """P's answer: a request whose items are all pool images at the longest prefix hit P could
    have (every full block but the last token's), any other at 0; compute_demand's plan."""
    from mmreuse.demand import Availability
    from mmreuse.demand_query import (
        DemandError,
        DemandQuery,
        DemandStats,
        StatsQuery,
        answer_for,
        occurrences_of,
    )
    from mmreuse.plan import GivenCoverage, plan_admission

    if isinstance(query, StatsQuery):
        return DemandStats(id=query.id)
    if not isinstance(query, DemandQuery):  # snapshots, records: a P that serves none
        return DemandError(query.id, "not served by this fake")
    occs = occurrences_of(query)
    n = len(query.token_ids)
    held = bool(occs) and all(o.identifier.startswith("pool-") for o in occs)
    c = (n - 1) // BLOCK * BLOCK if held else 0
    plan = plan_admission(
        num_prompt_tokens=n,
        occurrences=occs,
        availability=Availability(e_cached=frozenset(query.e_cached)),
        coverage=GivenCoverage(c),
    )
    return answer_for(query.id, c, plan.demand)


async def fakes_main(cfg: dict[str, Any]) -> None:
    import zmq
    import zmq.asyncio

    from mmreuse.demand_query import decode_query, encode
    from mmreuse.events import KVEventBatch
    from tests.support.kv_publisher import TestPublisher

    ctx = zmq.Context()
    actx = zmq.asyncio.Context()
    pubs = [TestPublisher(ctx) for _ in range(cfg["pds"])]
    routers = []
    for _ in range(cfg["pds"]):
        sock = actx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        routers.append((sock, sock.bind_to_random_port("tcp://127.0.0.1")))
    events = [pool_events(k) for k in range(POOL)]
    stats = {"queries": 0, "errors": 0, "batches": 0}

    def publish(evs: list[Any]) -> None:
        for pub in pubs:
            pub.publish(KVEventBatch(ts=time.time(), events=evs, data_parallel_rank=0))
        stats["batches"] += 1

    publish([stored for _, stored in events])  # batch 0: every pool prompt held

    async def serve(sock: Any) -> None:
        while True:
            ident, payload = await sock.recv_multipart()
            stats["queries"] += 1
            try:
                answer = demand_reply(decode_query(payload))
            except Exception as exc:  # a fake's own bug: say so, answer nothing
                stats["errors"] += 1
                print(f"demand fake: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
                continue
            await sock.send_multipart([ident, encode(answer)])

    async def churn() -> None:
        tick = 0
        while True:
            await asyncio.sleep(cfg["churn_s"])
            publish(list(events[tick % POOL]))
            tick += 1

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    tasks = [loop.create_task(serve(sock)) for sock, _ in routers]
    tasks.append(loop.create_task(churn()))
    print(
        json.dumps(
            {
                "kv": [p.endpoint for p in pubs],
                "replay": [p.replay_endpoint for p in pubs],
                "demand": [f"tcp://127.0.0.1:{port}" for _, port in routers],
            }
        ),
        flush=True,
    )
    await stop.wait()
    print(f"fakes: {json.dumps(stats)}", file=sys.stderr, flush=True)
    for t in tasks:
        t.cancel()
    for pub in pubs:
        pub.close()
    for sock, _ in routers:
        sock.close(0)


# --------------------------------------------------------------------------------------------
# The load process (`--internal driver`)
# --------------------------------------------------------------------------------------------


class Requests:
    """Chat requests, HTTP bytes: 1-2 images, half from the pool (with a uuid), a quarter
    streaming."""

    def __init__(self, seed: int) -> None:
        self.rnd = random.Random(seed)
        self.pool = [self._url(png(8, self.rnd)) for _ in range(POOL)]
        self.n = 0

    @staticmethod
    def _url(data: bytes) -> str:
        return "data:image/png;base64," + base64.b64encode(data).decode()

    def next(self, port: int) -> tuple[bytes, bool]:
        rnd = self.rnd
        self.n += 1
        parts: list[dict[str, Any]] = []
        for _ in range(rnd.choice((1, 2))):
            if rnd.random() < 0.5:
                k = rnd.randrange(POOL)
                parts.append(
                    {"type": "image_url", "image_url": {"url": self.pool[k]}, "uuid": pool_uuid(k)}
                )
            else:
                parts.append({"type": "image_url", "image_url": {"url": self._url(png(8, rnd))}})
        if len(parts) == 1 and "uuid" in parts[0]:
            content = canonical_content(parts[0])  # what P holds: a KV hit under index
        else:
            content = [{"type": "text", "text": f"#{self.n} {PRE}"}, *parts]
            content.append({"type": "text", "text": POST})
        stream = rnd.random() < 0.25
        body = {"model": MODEL, "messages": [{"role": "user", "content": content}],
                "max_tokens": 8, "stream": stream}  # fmt: skip
        return chat_post(port, body), stream


class Tally:
    """One target's outcomes, and its completions over time (seconds since the load began)."""

    def __init__(self) -> None:
        self.sent = self.ok = self.bad = self.lost = 0
        self.status: dict[str, int] = {}
        self.lost_why: dict[str, int] = {}
        self.first_error = ""
        self.t_end = array.array("d")
        self.lat = array.array("d")

    def summary(self, warmup_s: float, wall_s: float) -> dict[str, Any]:
        def window(lo: float, hi: float) -> dict[str, float]:
            lat = sorted(x for t, x in zip(self.t_end, self.lat, strict=True) if lo <= t < hi)
            span = max(1e-9, hi - lo)
            if not lat:
                return {"rps": 0.0, "p50_ms": float("nan"), "p99_ms": float("nan")}
            return {
                "rps": len(lat) / span,
                "p50_ms": 1e3 * lat[len(lat) // 2],
                "p99_ms": 1e3 * lat[min(len(lat) - 1, int(0.99 * len(lat)))],
            }

        return {
            "sent": self.sent,
            "ok": self.ok,
            "failed": sum(self.status.values()) + self.bad,
            "failed_by_status": dict(self.status, **({"bad": self.bad} if self.bad else {})),
            "lost": self.lost,
            "lost_why": self.lost_why,
            "first_error": self.first_error,
            "wall_s": wall_s,
            "rps": self.ok / max(1e-9, wall_s),
            "all": window(0.0, wall_s + 1e-9),
            "after_warmup": window(warmup_s, min(wall_s, warmup_s + 60.0)),
            "last_minute": window(max(0.0, wall_s - 60.0), wall_s + 1e-9),
        }


async def drive(cfg: dict[str, Any]) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    t0 = time.monotonic()
    stop_at = t0 + cfg["duration_s"]
    timeout = cfg["request_timeout_s"]
    tallies = {name: Tally() for name in cfg["ports"]}

    async def connect(port: int) -> ClientProtocol:
        _, proto = await loop.create_connection(ClientProtocol, "127.0.0.1", port)
        return proto

    async def worker(name: str, port: int, gen: Requests) -> None:
        tally = tallies[name]
        proto: ClientProtocol | None = None
        while time.monotonic() < stop_at:
            data, stream = gen.next(port)
            marker = b"data: [DONE]" if stream else b'"chat.completion"'
            tally.sent += 1
            start = time.monotonic()
            try:
                if proto is None or proto.closed or proto.close_after:
                    if proto is not None and proto.transport is not None:
                        proto.transport.close()
                    proto = await connect(port)
                status, body = await asyncio.wait_for(proto.request(data), timeout)
            except (TimeoutError, ConnectionError, OSError) as exc:
                why = "timeout" if isinstance(exc, asyncio.TimeoutError) else type(exc).__name__
                tally.lost += 1
                tally.lost_why[why] = tally.lost_why.get(why, 0) + 1
                if not tally.first_error:
                    tally.first_error = f"lost: {why}: {exc}"
                if proto is not None and proto.transport is not None:
                    proto.transport.close()
                proto = None
                continue
            end = time.monotonic()
            if status == 200 and marker in body:
                tally.ok += 1
                tally.t_end.append(end - t0)
                tally.lat.append(end - start)
            else:
                if status == 200:
                    tally.bad += 1
                else:
                    tally.status[str(status)] = tally.status.get(str(status), 0) + 1
                if not tally.first_error:
                    tally.first_error = f"HTTP {status}: {body[:300]!r}"
        if proto is not None and proto.transport is not None:
            proto.transport.close()

    jobs = []
    for i, (name, port) in enumerate(cfg["ports"].items()):
        for c in range(cfg["concurrency"]):
            gen = Requests(cfg["seed"] * 1000 + i * 100 + c)
            jobs.append(worker(name, port, gen))
    await asyncio.gather(*jobs)
    wall = time.monotonic() - t0
    return {name: t.summary(cfg["warmup_s"], wall) for name, t in tallies.items()}


def driver_main(cfg: dict[str, Any]) -> None:
    try:
        import uvloop

        targets = uvloop.run(drive(cfg))
    except ImportError:
        targets = asyncio.run(drive(cfg))
    out = {"targets": targets, "cpu_s": time.process_time()}
    sys.stdout.write(json.dumps(out) + "\n")
    sys.stdout.flush()


# --------------------------------------------------------------------------------------------
# Sampling
# --------------------------------------------------------------------------------------------

_METRIC_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_metrics(text: str) -> list[tuple[str, dict[str, str], float]]:
    out = []
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        m = _METRIC_LINE.match(line)
        if m is None:
            continue
        with contextlib.suppress(ValueError):
            out.append((m[1], dict(_LABEL.findall(m[2] or "")), float(m[3])))
    return out


def metric_sum(
    samples: list[tuple[str, dict[str, str], float]], name: str, **match: str
) -> float | None:
    """The sum of `name`'s samples whose labels include `match`; None when none is exported."""
    vals = [
        v
        for n, labels, v in samples
        if n == name and all(labels.get(k) == x for k, x in match.items())
    ]
    return sum(vals) if vals else None


def metrics_of(port: int) -> list[tuple[str, dict[str, str], float]]:
    status, body = http_get(port, "/metrics", timeout=5.0)
    return parse_metrics(body.decode(errors="replace")) if status == 200 else []


def proc_sample(proc: Proc) -> dict[str, Any]:
    """RSS, fds and threads summed over the proxy's process group (one process at --workers 1),
    and its CPU seconds so far."""
    assert proc.popen is not None
    rss_kib = threads = fds = 0
    pids = list(group_stat(proc.popen.pid))
    for pid in pids:
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    rss_kib += int(line.split()[1])
                elif line.startswith("Threads:"):
                    threads += int(line.split()[1])
            fds += len(os.listdir(f"/proc/{pid}/fd"))
    return {
        "pids": len(pids),
        "rss_mib": rss_kib / 1024,
        "fds": fds,
        "threads": threads,
        "cpu_s": proc.cpu_s(),
    }


def sample(proc: Proc, t: float, phase: str) -> dict[str, Any]:
    out: dict[str, Any] = {"t": round(t, 2), "phase": phase, **proc_sample(proc)}
    met = metrics_of(int(proc.port or 0))
    out["tasks"] = metric_sum(met, "mmreuse_proxy_tasks")
    out["conn_idle"] = metric_sum(met, "mmreuse_proxy_upstream_connections", state="idle")
    out["conn_busy"] = metric_sum(met, "mmreuse_proxy_upstream_connections", state="busy")
    idle, busy = out["conn_idle"], out["conn_busy"]
    out["conns"] = None if idle is None or busy is None else idle + busy
    out["requests_counted"] = metric_sum(met, "mmreuse_proxy_requests_total")
    return out


# --------------------------------------------------------------------------------------------
# Analysis
# --------------------------------------------------------------------------------------------


def slope_per_min(points: list[tuple[float, float]]) -> float | None:
    if len(points) < 2:
        return None
    mt = statistics.fmean(t for t, _ in points)
    mv = statistics.fmean(v for _, v in points)
    den = sum((t - mt) ** 2 for t, _ in points)
    if den == 0:
        return None
    return 60.0 * sum((t - mt) * (v - mv) for t, v in points) / den


def judge(samples: list[dict[str, Any]], warmup_s: float) -> dict[str, dict[str, Any]]:
    """Per quantity: before, warm, end, max, slope per minute, drained and the flat verdict."""
    load = [s for s in samples if s["phase"] == "load"]
    before = next((s for s in samples if s["phase"] == "before"), None)
    drained = next((s for s in samples if s["phase"] == "drained"), None)
    i_warm = next((i for i, s in enumerate(load) if s["t"] >= warmup_s), len(load) - 1)
    out: dict[str, dict[str, Any]] = {}
    for q in QUANTITIES:
        vals = [s[q] for s in load]
        row: dict[str, Any] = {"before": before[q] if before else None}
        if not load or any(v is None for v in vals):
            out[q] = {**row, "warm": None, "end": None, "max": None, "slope_per_min": None}
            out[q].update(drained=drained[q] if drained else None, flat=None)
            continue
        warm, end = vals[i_warm], vals[-1]
        post = [(s["t"], float(s[q])) for s in load[i_warm:]]
        slope = slope_per_min(post)
        drain = drained[q] if drained else None
        if q == "rss_mib":
            minutes = (post[-1][0] - post[0][0]) / 60.0
            growth = (slope or 0.0) * minutes
            flat = end <= (1 + RSS_GROWTH) * warm and growth <= RSS_GROWTH * warm
        elif q in SLACK:
            bound = max(vals[: i_warm + 1]) + SLACK[q]
            flat = end <= bound
            if q in DRAINED_OVER_BEFORE and before is not None and before[q] is not None:
                flat = flat and (drain is None or drain <= before[q] + DRAINED_OVER_BEFORE[q])
            else:
                flat = flat and (drain is None or drain <= bound)
        else:
            flat = None  # shown, not judged
        row.update(warm=warm, end=end, max=max(vals), slope_per_min=slope, drained=drain)
        row["flat"] = flat
        out[q] = row
    return out


def yes_no(v: bool | None) -> str:
    return "-" if v is None else "yes" if v else "NO"


def qfmt(q: str, v: Any) -> str:
    if v is None:
        return "n/a"
    if q == "rss_mib":
        return f"{v:.1f}"
    return f"{v:.0f}" if float(v).is_integer() else f"{v:.1f}"


def evidence(met: list[tuple[str, dict[str, str], float]]) -> str:
    """What shows the policy ran: its requests by policy label, E's items, the plan's classes,
    P's answers and opportunistic outcomes (non-zero counters only)."""
    parts = []
    by_policy: dict[str, float] = {}
    for n, labels, v in met:
        if n == "mmreuse_proxy_requests_total":
            key = labels.get("policy", "?")
            by_policy[key] = by_policy.get(key, 0.0) + v
    parts.append(
        "requests_total{policy}: " + ", ".join(f"{k}={v:.0f}" for k, v in by_policy.items())
    )
    families = (
        ("mmreuse_proxy_encoder_items_total", "action", "E items"),
        ("mmreuse_proxy_occurrences_total", "klass", "occurrences"),
        ("mmreuse_proxy_demand_answers_total", "outcome", "demand answers"),
        ("mmreuse_proxy_opportunistic_total", "outcome", "opportunistic"),
        ("mmreuse_proxy_arrival_requests_total", "split", "arrival"),
    )
    for name, label, title in families:
        acc: dict[str, float] = {}
        for n, labels, v in met:
            if n == name and v:
                acc[labels.get(label, "?")] = acc.get(labels.get(label, "?"), 0.0) + v
        if acc:
            parts.append(f"{title}: " + ", ".join(f"{k}={v:.0f}" for k, v in sorted(acc.items())))
    abandoned = metric_sum(met, "mmreuse_proxy_encoder_items_abandoned_total")
    if abandoned:
        parts.append(f"E items abandoned: {abandoned:.0f}")
    return "; ".join(parts)


def render(result: dict[str, Any]) -> str:
    lines = []
    c = result["conditions"]
    lines.append(
        f"Soak: {c['duration_s']:.0f} s, {c['concurrency']} connections per proxy, 2 E + 2 PD "
        f"stubs, all {len(c['policies'])} proxies at once, samples every {c['sample_s']:g} s, "
        f"warm-up {c['warmup_s']:g} s; {c['cpu']}, {c['cpus']} CPUs; the load process used "
        f"{100 * c['driver_cpu_s'] / c['duration_s']:.0f} % of a CPU"
    )
    lines.append("")
    lines.append(
        "| policy | sent | ok | failed | lost | proxy counted | req/s | req/s warm / last min "
        "| p50 ms warm / last min | proxy CPU | flat | no request lost |"
    )
    lines.append("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for pol in c["policies"]:
        r = result["policies"][pol]
        d = r["driver"]
        failed = ", ".join(f"{k}: {v}" for k, v in sorted(d["failed_by_status"].items()))
        lost = f"{d['lost']}" + (f" ({d['lost_why']})" if d["lost"] else "")
        aw, lm = d["after_warmup"], d["last_minute"]
        lines.append(
            f"| {pol} | {d['sent']} | {d['ok']} | {d['failed']}{f' ({failed})' if failed else ''} "
            f"| {lost} | {qfmt('', r['counted'])} | {d['rps']:.1f} | {aw['rps']:.1f} / "
            f"{lm['rps']:.1f} | {aw['p50_ms']:.1f} / {lm['p50_ms']:.1f} | {100 * r['cpu_share']:.0f} % "
            f"| {yes_no(r['flat'])} "
            f"| {yes_no(r['no_request_lost'])} |"
        )
    for pol in c["policies"]:
        r = result["policies"][pol]
        lines.append("")
        lines.append(f"**{pol}** ({r['evidence']})")
        lines.append("")
        lines.append(
            "| quantity | before | after warm-up | end | max | drained | slope /min | flat |"
        )
        lines.append("|---|---|---|---|---|---|---|---|")
        for q in QUANTITIES:
            j = r["judged"][q]
            slope = j["slope_per_min"]
            lines.append(
                f"| {LABELS[q]} | {qfmt(q, j['before'])} | {qfmt(q, j['warm'])} "
                f"| {qfmt(q, j['end'])} | {qfmt(q, j['max'])} | {qfmt(q, j['drained'])} "
                f"| {'n/a' if slope is None else f'{slope:+.2f}'} | {yes_no(j['flat'])} |"
            )
        if r["log_problems"]:
            lines.append("")
            lines.append(f"log: {r['log_problems']}")
    return "\n".join(lines)


def log_problems(proc: Proc) -> str:
    """Tracebacks and ERROR/CRITICAL lines in a proxy's log: their count and the first."""
    try:
        text = proc.log.read_text(errors="replace")
    except OSError:
        return ""
    bad = [
        ln for ln in text.splitlines() if "Traceback" in ln or " ERROR" in ln or "CRITICAL" in ln
    ]
    return f"{len(bad)} traceback/error lines, first: {bad[0][:200]}" if bad else ""


# --------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------


def read_line(proc: Proc, timeout_s: float) -> dict[str, Any]:
    popen = proc.popen
    assert popen is not None and popen.stdout is not None
    fd, buf = popen.stdout.fileno(), b""
    deadline = time.monotonic() + timeout_s
    while b"\n" not in buf:
        left = deadline - time.monotonic()
        if left <= 0 or (popen.poll() is not None and not select.select([fd], [], [], 0)[0]):
            raise RuntimeError(f"{proc.name}: no answer within {timeout_s:.0f} s:\n{proc.tail()}")
        if select.select([fd], [], [], min(left, 1.0))[0]:
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                raise RuntimeError(f"{proc.name} exited:\n{proc.tail()}")
            buf += chunk
    out: dict[str, Any] = json.loads(buf.split(b"\n", 1)[0])
    return out


def policy_flags(policy: str, ends: dict[str, list[str]]) -> list[str]:
    flags = ["--policy", policy]
    if policy == "index":
        flags += ["--hash-seed", HASH_SEED, "--block-size", str(BLOCK)]
        flags += ["--kv-events-endpoints", ",".join(ends["kv"])]
        flags += ["--kv-events-replay-endpoints", ",".join(ends["replay"])]
    elif policy in ("demand", "opportunistic"):
        flags += ["--demand-endpoints", ",".join(ends["demand"])]
    return flags


def wait_view_complete(proc: Proc, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        met = metrics_of(int(proc.port or 0))
        views = [v for n, _, v in met if n == "mmreuse_kv_event_view_complete"]
        if views and all(v == 1 for v in views):
            return
        time.sleep(0.5)
    raise RuntimeError(f"{proc.name}: its KV views never completed:\n{proc.tail()}")


def run(args: argparse.Namespace) -> dict[str, Any]:
    py, me, stub = sys.executable, str(Path(__file__).resolve()), str(HERE / "stub_backends.py")
    logdir = Path(tempfile.mkdtemp(prefix="mmreuse-soak-"))
    procs: dict[str, Proc] = {}
    print(f"logs: {logdir}", flush=True)
    try:
        for name, role in (("e0", "e"), ("e1", "e"), ("pd0", "pd"), ("pd1", "pd")):
            argv = [py, stub, "--role", role, "--port", str(free_port())]
            procs[name] = Proc(name, argv, logdir / f"{name}.log", int(argv[-1]))
            procs[name].start(None)
        fake_cfg = json.dumps({"pds": 2, "churn_s": args.churn_s})
        argv = [py, me, "--internal", "fakes", "--config", fake_cfg]
        procs["fakes"] = Proc("fakes", argv, logdir / "fakes.log", stdin_pipe=True)
        procs["fakes"].start(None)
        for name in ("e0", "e1", "pd0", "pd1"):
            wait_healthy(procs[name], 20)
        ends = read_line(procs["fakes"], 30)
        es = ",".join(f"http://127.0.0.1:{procs[n].port}" for n in ("e0", "e1"))
        pds = ",".join(f"http://127.0.0.1:{procs[n].port}" for n in ("pd0", "pd1"))
        mmreuse = str(Path(sys.executable).parent / "mmreuse")
        for pol in args.policies:
            port = free_port()
            argv = [
                mmreuse, "proxy", "--host", "127.0.0.1", "--port", str(port),
                "--encode-servers-urls", es, "--decode-servers-urls", pds,
                "--prefill-servers-urls", "none", *policy_flags(pol, ends),
            ]  # fmt: skip
            procs[pol] = Proc(f"proxy {pol}", argv, logdir / f"proxy-{pol}.log", port)
            procs[pol].start(None)
        for pol in args.policies:
            wait_healthy(procs[pol], 60)
            if pol == "index":
                wait_view_complete(procs[pol], 30)
        samples: dict[str, list[dict[str, Any]]] = {pol: [] for pol in args.policies}
        for pol in args.policies:
            samples[pol].append(sample(procs[pol], 0.0, "before"))
        cfg = {
            "ports": {pol: procs[pol].port for pol in args.policies},
            "concurrency": args.concurrency,
            "duration_s": args.duration,
            "warmup_s": args.warmup_s,
            "request_timeout_s": args.request_timeout,
            "seed": args.seed,
        }
        argv = [py, me, "--internal", "driver", "--config", json.dumps(cfg)]
        procs["driver"] = Proc("driver", argv, logdir / "driver.log", stdin_pipe=True)
        t0 = time.monotonic()
        procs["driver"].start(None)
        next_at = t0 + args.sample_s
        while procs["driver"].alive():
            now = time.monotonic()
            if now >= next_at and now - t0 <= args.duration + 1:
                for pol in args.policies:
                    samples[pol].append(sample(procs[pol], now - t0, "load"))
                elapsed = now - t0
                if round(elapsed / args.sample_s) % 6 == 0:
                    rss = ", ".join(
                        f"{p} {samples[p][-1]['rss_mib']:.0f} MiB" for p in args.policies
                    )
                    print(f"  t={elapsed:.0f} s: {rss}", flush=True)
                next_at += args.sample_s
            time.sleep(min(0.5, max(0.05, next_at - time.monotonic())))
            if time.monotonic() - t0 > args.duration + args.request_timeout + 60:
                raise RuntimeError(f"driver did not finish:\n{procs['driver'].tail()}")
        driven = read_line(procs["driver"], 30)
        time.sleep(3.0)
        result: dict[str, Any] = {
            "conditions": {
                "duration_s": args.duration,
                "concurrency": args.concurrency,
                "sample_s": args.sample_s,
                "warmup_s": args.warmup_s,
                "policies": list(args.policies),
                "cpu": cpu_model(),
                "cpus": os.cpu_count(),
                "logdir": str(logdir),
                "driver_cpu_s": driven["cpu_s"],
            },
            "policies": {},
        }
        for pol in args.policies:
            samples[pol].append(sample(procs[pol], time.monotonic() - t0, "drained"))
            met = metrics_of(int(procs[pol].port or 0))
            counted = metric_sum(met, REQUESTS)
            judged = judge(samples[pol], args.warmup_s)
            verdicts = [j["flat"] for j in judged.values() if j["flat"] is not None]
            d = driven["targets"][pol]
            load = [s for s in samples[pol] if s["phase"] == "load"]
            cpu = (load[-1]["cpu_s"] - samples[pol][0]["cpu_s"]) / max(1e-9, load[-1]["t"])
            if not any(lb.get("policy") == pol for n, lb, _ in met if n == REQUESTS):
                print(f"WARNING: proxy {pol} counted no request under policy {pol}", flush=True)
            result["policies"][pol] = {
                "driver": d,
                "counted": counted,
                "no_request_lost": d["lost"] == 0 and counted == d["sent"],
                "flat": all(verdicts),
                "cpu_share": cpu,
                "judged": judged,
                "samples": samples[pol],
                "evidence": evidence(met),
                "log_problems": log_problems(procs[pol]),
            }
        return result
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):  # a second Ctrl-C must not cut this short
            signal.signal(sig, signal.SIG_IGN)
        for proc in reversed(list(procs.values())):
            proc.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--duration", type=float, default=600.0, help="seconds of load")
    p.add_argument("--concurrency", type=int, default=8, help="connections per proxy")
    p.add_argument("--sample-s", type=float, default=10.0)
    p.add_argument("--warmup-s", type=float, default=60.0)
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--json", default=None, help="write the result and every sample here")
    p.add_argument("--request-timeout", type=float, default=30.0, help="a client's patience, s")
    p.add_argument("--churn-s", type=float, default=0.5, help="seconds between KV-event batches")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--internal", choices=("fakes", "driver"), help=argparse.SUPPRESS)
    p.add_argument("--config", default="{}", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.internal == "fakes":
        asyncio.run(fakes_main(json.loads(args.config)))
        return 0
    if args.internal == "driver":
        driver_main(json.loads(args.config))
        return 0
    args.policies = [x.strip() for x in args.policies.split(",") if x.strip()]
    unknown = set(args.policies) - set(POLICIES)
    if unknown or not args.policies:
        p.error(f"--policies: unknown {sorted(unknown)}; choose from {', '.join(POLICIES)}")
    if args.warmup_s >= args.duration:
        p.error("--warmup-s must be shorter than --duration")

    def terminate(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    for sig in (signal.SIGTERM, signal.SIGINT):  # SIGINT too where it came in ignored
        signal.signal(sig, terminate)
    try:
        result = run(args)
    except KeyboardInterrupt:
        print("interrupted: every process stopped", file=sys.stderr)
        return 130
    print(render(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
        print(f"\nwritten: {args.json}")
    ok = all(r["flat"] and r["no_request_lost"] for r in result["policies"].values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
