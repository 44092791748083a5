"""The longest a single request holds `mmreuse proxy`'s event loop, under each --uuid-policy.

One run starts instant stub backends (1 E, 1 PD; `stub_backends.py`), a media origin on loopback
(Python's http.server over a folder of 32 MiB files, for --uuid-policy content's fetches) and
`mmreuse proxy` (eager, its default limits, one process), each in its own process group. A canary
process sends tiny text-only requests back to back over one keep-alive connection, stamping each
(CLOCK_MONOTONIC, shared by every process here), and a probe on the proxy's own event loop
stamps every wake-up more than 2 ms late. Then each shape below is sent once, on its own: its
loop stall is the latest the probe woke while it was served (how long the loop could run
nothing), and "others waited" the longest canary request that overlapped it, less the canary's
median latency when nothing else runs (what every other client saw; on 2 cores it also counts
the stubs' own CPU, E decoding the media it is sent).

The shapes are the worst the defaults allow of each kind, and the review's (docs: serving-review
3): a 4 MiB cache_salt on 999 images (H1), 999 audio items with 1 MiB of mm_processor_kwargs
(H2), an input_audio part with 5,000,000 extra keys (M1), ~250 MiB of inline media (one image,
one audio, 999 images), the most JSON values, 8 MiB of escaped and of CJK text, the deepest
nesting, and under content 8 fetched 32 MiB images (256 MiB, its per-request budget).

    .venv/bin/python benchmarks/proxy_loop_stall.py [--policies reference,tenant,content]
        [--shapes ...] [--pythonpath OTHER_TREE] [--json out.json]

`--pythonpath` runs the proxy from another tree (e.g. a `git worktree` of an older commit with its
built extensions), for a before/after on the same machine.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import http.client
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
POLICIES = ("reference", "tenant", "content")
MiB = 1 << 20


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def chat(*content: Any, **extra: Any) -> dict[str, Any]:
    return {
        "model": "stub-model",
        "messages": [{"role": "user", "content": list(content)}],
        **extra,
    }


TEXT = {"type": "text", "text": "what is in these?"}


def data_image(nbytes: int, seed: int) -> dict[str, Any]:
    raw = seed.to_bytes(8, "big") * (nbytes // 8 + 1)
    url = "data:image/png;base64," + base64.b64encode(raw[:nbytes]).decode()
    return {"type": "image_url", "image_url": {"url": url}}


def audio_part(nbytes: int, seed: int) -> dict[str, Any]:
    raw = seed.to_bytes(8, "big") * (nbytes // 8 + 1)
    data = base64.b64encode(raw[:nbytes]).decode()
    return {"type": "input_audio", "input_audio": {"data": data, "format": "wav"}}


def _dump(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def _url_image(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def salt_on_999_images(_: str) -> bytes:
    images = (_url_image(f"http://i.invalid/{i}.png") for i in range(999))
    return _dump(chat(TEXT, *images, cache_salt="s" * (4 * MiB)))


def audio_999_kwargs(_: str) -> bytes:
    audio = (audio_part(64, i) for i in range(999))
    return _dump(chat(TEXT, *audio, mm_processor_kwargs={"pad": "p" * MiB}))


def part_5m_keys(_: str) -> bytes:
    keys = b",".join(b'"k%d":0' % i for i in range(5_000_000))
    return (
        b'{"model":"stub-model","messages":[{"role":"user","content":[{"type":"input_audio",'
        b'"input_audio":{"data":"UklGRg==","format":"wav",' + keys + b"}}]}]}"
    )


def cjk_text(_: str) -> bytes:
    body = chat({"type": "text", "text": "\u4e2d" * (8 * MiB // 3 - 4096)})
    return json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()


def nested(_: str) -> bytes:
    head = b'{"model":"stub-model","messages":[{"role":"user","content":"hi"}],"x":'
    return head + b"[" * 122 + b"]" * 122 + b"}"


def fetched(origin: str) -> bytes:
    return _dump(chat(TEXT, *(_url_image(f"{origin}/m{i}.png") for i in range(8))))


# Each shape: name -> (policies it runs under, builder of the body's bytes: origin URL -> bytes).
Shape = tuple[tuple[str, ...], Callable[[str], bytes]]
SHAPES: dict[str, Shape] = {
    "salt-4MiB-999-images": (POLICIES, salt_on_999_images),
    "audio-999-kwargs-1MiB": (POLICIES, audio_999_kwargs),
    "part-5M-keys": (POLICIES, part_5m_keys),
    "one-image-250MiB": (POLICIES, lambda _: _dump(chat(TEXT, data_image(187 * MiB, 1)))),
    "one-audio-250MiB": (POLICIES, lambda _: _dump(chat(TEXT, audio_part(187 * MiB, 2)))),
    "999-images-250MiB": (
        POLICIES,
        lambda _: _dump(chat(TEXT, *(data_image(192 << 10, 10 + i) for i in range(999)))),
    ),
    "text-parts-max-values": (
        POLICIES,
        lambda _: _dump(chat(*({"type": "text", "text": "x" * 60} for _ in range(43_600)))),
    ),
    "values-max": (POLICIES, lambda _: _dump(chat(TEXT, extra=[0] * 131_000))),
    "escaped-text-8MiB": (
        POLICIES,
        lambda _: _dump(chat({"type": "text", "text": "\n" * (4 * MiB - 4096)})),
    ),
    "cjk-text-8MiB": (POLICIES, cjk_text),
    "nested-127": (POLICIES, nested),
    "fetched-8x32MiB": (("content",), fetched),
}


# ---- the proxy, probed (its own process) ----------------------------------------------------------


def serve_probed(lagfile: str, argv: list[str]) -> None:
    """`mmreuse proxy ARGV` (one process), with a task on its event loop that wakes every 1 ms
    and notes each time it woke more than 2 ms late: (CLOCK_MONOTONIC, lateness), written to
    `lagfile` by a thread (a write on the loop can itself block it for 0.1 s here). The
    lateness is how long the loop could not run anything: the stall itself."""
    from mmreuse.proxy.config import parse_args
    from mmreuse.proxy.server import event_loop_runner, serve

    config = parse_args(argv)
    lags: list[tuple[float, float]] = []

    def flush() -> None:
        with Path(lagfile).open("w", buffering=1) as out:
            done = 0
            while True:
                time.sleep(0.2)
                n = len(lags)
                out.writelines(f"{at:.6f} {late:.6f}\n" for at, late in lags[done:n])
                done = n

    threading.Thread(target=flush, daemon=True).start()

    async def main() -> None:
        async def probe() -> None:
            loop = asyncio.get_running_loop()
            before = loop.time()
            while True:
                await asyncio.sleep(0.001)
                now = loop.time()
                late = now - before - 0.001
                if late > 0.002:
                    lags.append((time.monotonic(), late))
                before = now

        task = asyncio.ensure_future(probe())
        try:
            await serve(config)
        finally:
            task.cancel()

    event_loop_runner()(main())


# ---- the canary (its own process) -----------------------------------------------------------------


def canary(port: int, out: str) -> None:
    """Tiny requests back to back until SIGTERM; (start, end) of each, written to `out`."""
    stamps: list[tuple[float, float]] = []
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    body = _dump(chat({"type": "text", "text": "ping"}))
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    while not stop.is_set():
        t0 = time.monotonic()
        try:
            conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
            conn.getresponse().read()
        except (OSError, http.client.HTTPException):
            conn.close()
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
            continue
        stamps.append((t0, time.monotonic()))
    Path(out).write_text(json.dumps(stamps))


# ---- the driver ------------------------------------------------------------------------------------


def wait_http(port: int, path: str, proc: subprocess.Popen[Any], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"a process exited while starting: {proc.args}")
        with contextlib.suppress(OSError, http.client.HTTPException):
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", path)
            if conn.getresponse().status < 500:
                return
        time.sleep(0.2)
    raise SystemExit(f"not up in {timeout} s: {proc.args}")


@contextlib.contextmanager
def started(
    argv: list[str], log: Path, env: dict[str, str] | None = None, cpus: set[int] | None = None
) -> Iterator[Any]:
    pin = None if cpus is None else (lambda: os.sched_setaffinity(0, cpus))
    with log.open("wb") as out:
        proc = subprocess.Popen(
            argv,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=env,
            preexec_fn=pin,
        )
    try:
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def post(port: int, body: bytes) -> tuple[int, str, float, float]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    t0 = time.monotonic()
    conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    text = resp.read()[:300].decode("utf-8", "replace")
    t1 = time.monotonic()
    conn.close()
    return resp.status, text, t0, t1


def run_policy(
    policy: str,
    shapes: list[str],
    ports: dict[str, int],
    origin: str,
    logdir: Path,
    env: Any,
    cpus: set[int] | None,
) -> list[dict[str, Any]]:
    port = free_port()
    lagfile = logdir / f"lag-{policy}.txt"
    argv = [
        sys.executable, __file__, "--serve-probed", str(lagfile), "--",
        "--host", "127.0.0.1", "--port", str(port),
        "--encode-servers-urls", f"http://127.0.0.1:{ports['e']}",
        "--decode-servers-urls", f"http://127.0.0.1:{ports['pd']}",
        "--uuid-policy", policy,
    ]  # fmt: skip
    if policy == "content":
        argv += ["--allow-private-media-networks", "127.0.0.0/8"]
    rows = []
    with started(argv, logdir / f"proxy-{policy}.log", env, cpus) as proxy:
        wait_http(port, "/health", proxy)
        stamps_file = logdir / f"canary-{policy}.json"
        canary_argv = [sys.executable, __file__, "--canary", str(port), str(stamps_file)]
        with started(canary_argv, logdir / f"canary-{policy}.log"):
            time.sleep(2.0)  # the canary's quiet latency first
            spans: list[tuple[str, int, str, float, float, int]] = []
            for name in shapes:
                if policy not in SHAPES[name][0]:
                    continue
                body = SHAPES[name][1](origin)
                time.sleep(0.5)
                status, text, t0, t1 = post(port, body)
                spans.append((name, status, text, t0, t1, len(body)))
                del body
            time.sleep(0.5)  # the probe's thread writes what it noted each 0.2 s
        stamps = json.loads(stamps_file.read_text())
    lags = [tuple(map(float, line.split())) for line in lagfile.read_text().splitlines()]
    quiet_end = spans[0][3] if spans else float("inf")
    quiet = [b - a for a, b in stamps if b < quiet_end]
    base = statistics.median(quiet) if quiet else 0.0
    for name, status, text, t0, t1, size in spans:
        during = [b - a for a, b in stamps if a < t1 and b > t0]
        worst = max(during, default=0.0)
        # a late wake-up is stamped when the stall ends: within the request, or just after it
        loop_worst = max((late for at, late in lags if t0 < at < t1 + 0.25 + late), default=0.0)
        rows.append(
            {
                "policy": policy,
                "shape": name,
                "body_mib": round(size / MiB, 1),
                "status": status,
                "answer_s": round(t1 - t0, 3),
                "canary_requests": len(during),
                "loop_stall_ms": round(loop_worst * 1000, 1),
                "stall_ms": round(max(0.0, worst - base) * 1000, 1),
                "canary_p50_ms": round(base * 1000, 2),
                "detail": text if status != 200 else "",
            }
        )
        print(
            f"{policy:9} {name:24} {size / MiB:7.1f} MiB  HTTP {status}  answered in "
            f"{t1 - t0:6.2f} s  loop stall {rows[-1]['loop_stall_ms']:7.1f} ms  others waited "
            f"{rows[-1]['stall_ms']:7.1f} ms",
            flush=True,
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--pythonpath", default=None, help="run the proxy from this tree")
    ap.add_argument("--json", default=None)
    ap.add_argument(
        "--pin",
        default="auto",
        choices=("auto", "none"),
        help="auto: the proxy alone on the first CPU, everything else on the others (>= 2 CPUs)",
    )
    ap.add_argument("--canary", nargs=2, help=argparse.SUPPRESS)
    ap.add_argument("--serve-probed", default=None, help=argparse.SUPPRESS)
    if "--serve-probed" in sys.argv:  # the proxy's own process: its flags follow "--"
        cut = sys.argv.index("--")
        serve_probed(sys.argv[sys.argv.index("--serve-probed") + 1], sys.argv[cut + 1 :])
        return
    args = ap.parse_args()
    if args.canary:
        canary(int(args.canary[0]), args.canary[1])
        return
    policies = [p for p in args.policies.split(",") if p]
    shapes = [s for s in args.shapes.split(",") if s]
    unknown = [s for s in shapes if s not in SHAPES] + [p for p in policies if p not in POLICIES]
    if unknown:
        raise SystemExit(f"unknown: {unknown}")
    env = dict(os.environ)
    if args.pythonpath:
        env["PYTHONPATH"] = str(Path(args.pythonpath).resolve())
    cpus = sorted(os.sched_getaffinity(0))
    proxy_cpus = None
    if args.pin == "auto" and len(cpus) >= 2:
        proxy_cpus = {cpus[0]}
        os.sched_setaffinity(0, set(cpus[1:]))  # this driver and what it starts, but the proxy
    logdir = Path(tempfile.mkdtemp(prefix="mmreuse-loop-stall-"))
    media = logdir / "media"
    media.mkdir()
    for i in range(8):
        (media / f"m{i}.png").write_bytes(os.urandom(1 << 16) * 512)  # 32 MiB
    ports = {"e": free_port(), "pd": free_port(), "origin": free_port()}
    stub = str(HERE / "stub_backends.py")
    rows: list[dict[str, Any]] = []
    try:
        e_argv = [sys.executable, stub, "--role", "e", "--port", str(ports["e"])]
        pd_argv = [sys.executable, stub, "--role", "pd", "--port", str(ports["pd"])]
        origin_argv = [sys.executable, "-m", "http.server", "--bind", "127.0.0.1"]
        origin_argv += ["--directory", str(media), str(ports["origin"])]
        with (
            started(e_argv, logdir / "e.log") as e,
            started(pd_argv, logdir / "pd.log") as pd,
            started(origin_argv, logdir / "origin.log") as origin,
        ):
            wait_http(ports["e"], "/health", e)
            wait_http(ports["pd"], "/health", pd)
            wait_http(ports["origin"], "/", origin)
            url = f"http://127.0.0.1:{ports['origin']}"
            for policy in policies:
                rows += run_policy(policy, shapes, ports, url, logdir, env, proxy_cpus)
    finally:
        shutil.rmtree(media, ignore_errors=True)
    cpu = platform.processor() or platform.machine()
    pinned = f"proxy on CPU {sorted(proxy_cpus)}" if proxy_cpus else "not pinned"
    print(f"\n{len(rows)} rows; logs in {logdir}; {len(cpus)} CPUs ({cpu}), {pinned}")
    for policy in policies:
        mine = [r for r in rows if r["policy"] == policy]
        if mine:
            worst = max(mine, key=lambda r: r["loop_stall_ms"])
            print(
                f"longest loop stall under {policy}: {worst['loop_stall_ms']} ms "
                f"({worst['shape']}); others waited at most "
                f"{max(r['stall_ms'] for r in mine)} ms"
            )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
