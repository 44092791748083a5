"""CPU per request of `mmreuse proxy --policy index` as one replica, as three replicas behind
HAProxy (round-robin) against one behind it, and as `--workers 3`, in one run on the instant stub backends
(`stub_backends.py`: E, and a PD that renders). Replicas share nothing per request, so the CPU
a request costs should not grow with their number. What they cost idle (their subscribers'
wake-ups, and above all the balancer's health checks: each `/health` probes E and P) is
measured first, for `IDLE_S` seconds with no load, and taken out of the per-request figure;
both are printed.

Each replica follows a stub P's KV events (a ZMQ publisher in this process that answers
replay from seq 0, so every view is complete) and plans every request. The CPU counted is
every proxy process's user + system time (HAProxy's and the stubs' excluded), read from
/proc before and after the timed requests; the load is `--clients` keep-alive connections
sending serially, the same for every setup.

    .venv/bin/python benchmarks/replica_cpu.py [--requests 3000] [--images 2] [--clients 3]
    .venv/bin/python benchmarks/replica_cpu.py --instructions --requests 300 --clients 1

CPU time on a 2-core machine moves with everything else running and with each process's
caches (three replicas that take turns each run cold); instructions under callgrind do not,
so they are the figure that says whether a replica does more work per request.
"""

from __future__ import annotations

import argparse
import glob
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from benchmarks.proxy_instructions import (  # noqa: E402
    HOST,
    bodies,
    free_port,
    process,
    send,
    totals,
    wait_health,
)
from mmreuse.cluster.balancer import haproxy  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")
IDLE_S = 20.0


def cpu_seconds(pgids: set[int]) -> float:
    """User + system seconds of every live process in these process groups."""
    total = 0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            fields = Path(entry.path, "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) in pgids:  # field 5: pgrp
            total += int(fields[11]) + int(fields[12])  # fields 14, 15: utime, stime
    return total / TICK


@contextmanager
def kv_publisher() -> Iterator[tuple[str, str]]:
    """A P's KV-event endpoints that publish one empty batch (seq 0) and replay it."""
    import zmq

    from mmreuse.events import END_SEQ, KVEventBatch, encode_batch

    ctx = zmq.Context()
    pub, router = ctx.socket(zmq.PUB), ctx.socket(zmq.ROUTER)
    pub_port = pub.bind_to_random_port(f"tcp://{HOST}")
    rep_port = router.bind_to_random_port(f"tcp://{HOST}")
    payload = encode_batch(KVEventBatch(time.time(), [], 0))
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            if router.poll(50):
                ident = router.recv_multipart()[0]
                router.send_multipart([ident, b"", b"kv", (0).to_bytes(8, "big"), payload])
                router.send_multipart([ident, b"", b"", END_SEQ, b""])

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"tcp://{HOST}:{pub_port}", f"tcp://{HOST}:{rep_port}"
    finally:
        stop.set()
        thread.join()
        pub.close(0)
        router.close(0)
        ctx.term()


def load(port: int, reqs: list[bytes], clients: int) -> None:
    parts = [reqs[i::clients] for i in range(clients)]
    errors: list[BaseException] = []

    def one(part: list[bytes]) -> None:
        try:
            send(port, part)
        except BaseException as e:  # re-raised below
            errors.append(e)

    threads = [threading.Thread(target=one, args=(p,)) for p in parts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=3000)
    p.add_argument("--warmup", type=int, default=60)
    p.add_argument("--images", type=int, default=2)
    p.add_argument("--clients", type=int, default=3)
    p.add_argument(
        "--instructions",
        action="store_true",
        help="count instructions under valgrind's callgrind instead of CPU time (not moved by "
        "the machine's load or cache; slow: use --requests 300)",
    )
    args = p.parse_args(argv)
    if min(args.requests, args.warmup, args.clients) < 1 or args.images < 0:
        p.error("--requests, --warmup and --clients must be >= 1, --images >= 0")
    work = Path(tempfile.mkdtemp(prefix="mmreuse-replicas-"))
    e_port, pd_port = free_port(), free_port()
    stub = [sys.executable, str(HERE / "stub_backends.py")]
    reqs = [  # the model the PD stub lists: the proxy plans only on a model P serves
        b.replace(b'"model": "tiny"', b'"model": "stub-model"')
        for b in bodies(args.warmup + args.requests, args.images, stream=False)
    ]
    warm, timed = reqs[: args.warmup], reqs[args.warmup :]
    results = {}
    with ExitStack() as stack:
        e = stack.enter_context(process([*stub, "--role", "e", "--port", str(e_port)], work / "e.log"))  # fmt: skip
        pd = stack.enter_context(process([*stub, "--role", "pd", "--port", str(pd_port)], work / "pd.log"))  # fmt: skip
        wait_health(e_port, 30, e)
        wait_health(pd_port, 30, pd)
        kv, replay = stack.enter_context(kv_publisher())
        flags = [
            "--encode-servers-urls", f"http://{HOST}:{e_port}",
            "--decode-servers-urls", f"http://{HOST}:{pd_port}",
            "--policy", "index", "--block-size", "16",
            "--kv-events-endpoints", kv, "--kv-events-replay-endpoints", replay,
        ]  # fmt: skip

        def proxy(port: int, *extra: str, log: str) -> int:
            cmd = [sys.executable, "-m", "mmreuse.cli", "proxy", "--host", HOST,
                   "--port", str(port), *flags, *extra]  # fmt: skip
            if args.instructions:
                out = work / f"callgrind.{port}"
                cmd = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}.%p",
                       "--dump-instr=no", *cmd]  # fmt: skip
            proc = stack.enter_context(process(cmd, work / log, {"PYTHONHASHSEED": "0"}))
            return proc.pid

        def instructions(pids: set[int], action: str) -> int:
            """Zero (-z) or dump (-d) each proxy's callgrind counters; the dumps' total."""
            total = 0
            for pid in pids:
                subprocess.run(["callgrind_control", action, str(pid)], check=True, capture_output=True)  # fmt: skip
                if action == "-d":
                    dumps = sorted(glob.glob(str(work / f"callgrind.*.{pid}.*")), key=os.path.getmtime)  # fmt: skip
                    total += totals(dumps[-1])
            return total

        def planned(metric_ports: list[int]) -> tuple[float, float]:
            """(occurrences planned, no_plan fallbacks) over these proxies' /metrics."""
            import urllib.request

            from mmreuse.proxy.metrics import sample_sum

            occ = fallbacks = 0.0
            for q in metric_ports:
                with urllib.request.urlopen(f"http://{HOST}:{q}/metrics", timeout=10) as r:
                    text = r.read().decode()
                occ += sample_sum(text, "mmreuse_proxy_occurrences_total")
                occ -= sample_sum(text, "mmreuse_proxy_occurrences_total", klass="unclassified")
                fallbacks += sample_sum(text, "mmreuse_proxy_fallbacks_total")
            return occ, fallbacks

        def measure(name: str, port: int, pgids: set[int], metric_ports: list[int]) -> None:
            load(port, warm, args.clients)
            if args.instructions:
                # what the replicas execute idle (their subscribers' and event loops' wake-ups),
                # per second: under callgrind a run lasts minutes, so it is taken out
                instructions(pgids, "-z")
                time.sleep(IDLE_S)
                idle = instructions(pgids, "-d") / IDLE_S
                instructions(pgids, "-z")
                t0 = time.monotonic()
                load(port, timed, args.clients)
                wall = time.monotonic() - t0
                total = instructions(pgids, "-d")
                results[name] = (total - idle * wall) / args.requests
                print(
                    f"{name}: {results[name] / 1e3:.1f} k instructions per request "
                    f"({total / args.requests / 1e3:.1f} k with the {idle / 1e6:.1f} M/s the "
                    f"replicas execute idle, over {wall:.0f} s)",
                    flush=True,
                )
            else:
                before = cpu_seconds(pgids)
                time.sleep(IDLE_S)
                idle = (cpu_seconds(pgids) - before) / IDLE_S  # CPU seconds a second, idle
                before = cpu_seconds(pgids)
                t0 = time.monotonic()
                load(port, timed, args.clients)
                wall = time.monotonic() - t0
                cpu = cpu_seconds(pgids) - before
                results[name] = (cpu - idle * wall) / args.requests
                print(
                    f"{name}: {results[name] * 1e3:.2f} ms CPU per request "
                    f"({cpu * 1e3 / args.requests:.2f} ms with the {idle * 100:.1f} % of a core "
                    f"the replicas use idle; {args.requests} requests in {wall:.1f} s)",
                    flush=True,
                )
            occ, fallbacks = planned(metric_ports)
            want = args.images * len(reqs)
            if occ != want or fallbacks:
                raise RuntimeError(f"{name}: {occ} items planned of {want}, {fallbacks} fallbacks")

        up = 600 if args.instructions else 60  # valgrind starts a proxy in a minute or so
        one = free_port()
        pgid = proxy(one, log="one.log")
        wait_health(one, up, e)  # e: any live process (the proxy's own exit shows in its log)
        measure("1 replica", one, {pgid}, [one])
        # the balancer's own cost to a replica (its connections), to compare 3 behind it with
        solo = free_port()
        spg = proxy(solo, log="solo.log")
        wait_health(solo, up, e)
        lb1 = stack.enter_context(haproxy([f"http://{HOST}:{solo}"], work / "lb1"))
        wait_health(int(lb1.rsplit(":", 1)[1]), up, e)  # the balancer has it in rotation
        measure("1 replica behind HAProxy", int(lb1.rsplit(":", 1)[1]), {spg}, [solo])

        ports = [free_port() for _ in range(3)]
        pgids = {proxy(q, log=f"r{i}.log") for i, q in enumerate(ports)}
        for q in ports:
            wait_health(q, up, e)
        lb = stack.enter_context(haproxy([f"http://{HOST}:{q}" for q in ports], work / "lb"))
        time.sleep(5.0 if args.instructions else 1.0)  # every replica's health check passed
        measure("3 replicas behind HAProxy", int(lb.rsplit(":", 1)[1]), pgids, ports)

        if not args.instructions:  # callgrind would follow the supervisor only
            port, metrics = free_port(), free_port()
            wpg = proxy(port, "--workers", "3", "--metrics-port", str(metrics), log="w.log")
            wait_health(port, 120, e)
            time.sleep(1.0)  # every worker serving
            measure("--workers 3", port, {wpg}, [metrics])
    unit = "instructions" if args.instructions else "CPU"
    pairs = (
        *((("--workers 3", "1 replica"),) if "--workers 3" in results else ()),
        ("3 replicas behind HAProxy", "1 replica behind HAProxy"),
        ("1 replica behind HAProxy", "1 replica"),
    )
    for name, base in pairs:
        print(f"{name} / {base}: {results[name] / results[base]:.3f}x {unit} per request")
    print(f"({args.images} images a request, {args.clients} client connections)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
