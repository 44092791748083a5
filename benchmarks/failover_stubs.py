"""What a dead instance costs each proxy, on instant stub backends: `mmreuse proxy` (eager) and
vLLM's reference proxy, side by side, in front of the same 2 E + 2 PD stubs
(`stub_backends.py`).

For each fault (one E killed, one PD killed: SIGKILL of that stub's process group; one E
stopped: SIGSTOP, with `mmreuse proxy --encode-timeout 2`; one PD stopped, with
`--request-timeout 4`), fresh stubs and proxies are
started, a few requests warm them up, the fault is made, and then requests go one at a time
through each proxy in turn (so both see the same faulty instance): `--requests` of them, or
`--stall-requests` for a stopped one, each client giving up after `--timeout` seconds (status
0). It prints, per fault and proxy, how many requests failed and their statuses, and how long
the slowest took. Run from the repository root:

    .venv/bin/python benchmarks/failover_stubs.py [--requests 40] [--no-reference]

The reference is fetched by `mmreuse.cluster.reference` (its own venv: `--reference-python`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from proxy_overhead import Proc, free_port, png, wait_healthy  # noqa: E402


def _request(port: int, index: int, rnd: random.Random, timeout_s: float) -> tuple[int, float]:
    """One chat request with one small distinct image: its status (0: no answer) and seconds."""
    import base64

    url = "data:image/png;base64," + base64.b64encode(png(8, rnd)).decode()
    body = json.dumps(
        {
            "model": "stub-model",
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": f"Describe #{index}"},
                        {"type": "image_url", "image_url": {"url": url}},
                    ],
                }
            ],
            "max_tokens": 4,
        }
    ).encode()
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions",
        data=body,
        headers={"content-type": "application/json", "x-request-id": f"f{index}"},
    )
    t0 = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            r.read()
            status = r.status
    except urllib.error.HTTPError as e:
        status = e.code
    except (urllib.error.URLError, OSError):
        status = 0
    return status, time.perf_counter() - t0


def _kill(proc: Proc) -> None:
    assert proc.popen is not None
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.popen.pid, signal.SIGKILL)
    proc.popen.wait(5)


def run_fault(
    fault: str, args: argparse.Namespace, reference: tuple[Path, Path] | None, logdir: Path
) -> dict[str, Any]:
    py, stub = sys.executable, str(HERE / "stub_backends.py")
    procs: dict[str, Proc] = {}
    try:
        for name, role in (("e0", "e"), ("e1", "e"), ("pd0", "pd"), ("pd1", "pd")):
            port = free_port()
            argv = [py, stub, "--role", role, "--port", str(port)]
            procs[name] = Proc(name, argv, logdir / f"{fault}-{name}.log", port)
            procs[name].start(None)
        for name in ("e0", "e1", "pd0", "pd1"):
            wait_healthy(procs[name], 20)
        es = ",".join(f"http://127.0.0.1:{procs[n].port}" for n in ("e0", "e1"))
        pds = ",".join(f"http://127.0.0.1:{procs[n].port}" for n in ("pd0", "pd1"))

        def flags(port: int) -> list[str]:
            return [
                "--host", "127.0.0.1", "--port", str(port),
                "--encode-servers-urls", es, "--decode-servers-urls", pds,
                "--prefill-servers-urls", "none",
            ]  # fmt: skip

        proxies = ["mmreuse"]
        port = free_port()
        stall = fault.endswith("stopped")
        bounds = {"E stopped": ["--encode-timeout", "2"], "PD stopped": ["--request-timeout", "4"]}
        timeout = bounds.get(fault, [])
        argv = [str(Path(sys.executable).parent / "mmreuse"), "proxy", *flags(port), *timeout]
        procs["mmreuse"] = Proc("mmreuse proxy", argv, logdir / f"{fault}-mmreuse.log", port)
        if reference is not None:
            port = free_port()
            ref_py, ref = reference
            argv = [str(ref_py), str(ref), *flags(port)]
            procs["reference"] = Proc("reference", argv, logdir / f"{fault}-reference.log", port)
            proxies.append("reference")
        for name in proxies:
            procs[name].start(None)
        for name in proxies:
            wait_healthy(procs[name], 60)
        rnd = random.Random(0)
        for i in range(4):  # warm: every instance used once by each
            for name in proxies:
                _request(int(procs[name].port or 0), i, rnd, args.timeout)
        faulty = procs["pd1" if fault.startswith("PD") else "e1"]
        if stall:
            assert faulty.popen is not None
            os.killpg(faulty.popen.pid, signal.SIGSTOP)
        else:
            _kill(faulty)
        out: dict[str, Any] = {
            name: {"failed": 0, "statuses": {}, "slowest_s": 0.0} for name in proxies
        }
        for i in range(args.stall_requests if stall else args.requests):
            for name in proxies:
                status, took = _request(int(procs[name].port or 0), 100 + i, rnd, args.timeout)
                row = out[name]
                row["failed"] += status != 200
                row["statuses"][str(status)] = row["statuses"].get(str(status), 0) + 1
                row["slowest_s"] = max(row["slowest_s"], took)
        return out
    finally:
        for proc in procs.values():
            if proc.popen is not None and proc.popen.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.popen.pid, signal.SIGCONT)
            proc.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=40)
    p.add_argument("--stall-requests", type=int, default=6)
    p.add_argument("--timeout", type=float, default=10.0, help="a client's patience, seconds")
    p.add_argument("--no-reference", action="store_true")
    p.add_argument("--reference-python", default=None)
    args = p.parse_args(argv)
    reference = None
    if not args.no_reference:
        from mmreuse.cluster.reference import fetch_reference, reference_python

        ref_py = Path(args.reference_python) if args.reference_python else reference_python()
        reference = (ref_py, fetch_reference())
    logdir = Path(tempfile.mkdtemp(prefix="mmreuse-failover-"))
    print(
        f"2 E + 2 PD stubs, {args.requests} sequential requests after a kill, "
        f"{args.stall_requests} after a stop, clients patient for {args.timeout:g} s "
        f"(logs: {logdir})"
    )
    print("| fault | proxy | failed | statuses | slowest s |")
    print("|---|---|---|---|---|")
    for fault in ("E killed", "PD killed", "E stopped", "PD stopped"):
        for name, row in run_fault(fault, args, reference, logdir).items():
            statuses = ", ".join(f"{k}: {v}" for k, v in sorted(row["statuses"].items()))
            print(f"| {fault} | {name} | {row['failed']} | {statuses} | {row['slowest_s']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
