"""`mmreuse proxy`'s process model: `run` serves in this process, or (`--workers N`) in N
worker processes on one port, each a replica.

Every worker binds `--port` with SO_REUSEPORT (the kernel spreads connections over them) and
runs the whole proxy: its own views of P and E, subscribers, snapshots and demand clients. They
share nothing per request: each decides from the same events as every other replica does. The
supervisor (this process) serves `--metrics-port`: `/metrics` is every worker's, each sample
labelled `worker="i"`, plus the supervisor's own; `/health` is each worker's detailed health,
503 unless every worker answers. A worker that exits is started again (at most once a second),
and rejoins as a late replica does: from P's and E's snapshots where they serve them. A worker
whose event loop stalls (its heartbeat, written by its loop into memory shared with the
supervisor, older than `--worker-stall-timeout`) would keep its share of the port's connections
unanswered: the supervisor SIGKILLs it, and it is started again as one that exited.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
from aiohttp import web
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    generate_latest,
)
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from ..lifetime import die_with_parent
from .config import ProxyConfig
from .server import StartupFailed, event_loop_runner, serve, setup_logging

logger = logging.getLogger("mmreuse.proxy")

START_TIMEOUT_S = 120.0  # a worker's views and clients start before it serves
RESTART_INTERVAL_S = 1.0  # a worker that keeps dying is started at most this often
SCRAPE_TIMEOUT_S = 5.0
STOP_TIMEOUT_S = 10.0  # then SIGKILL
HEARTBEAT_S = 0.25  # how often a worker's event loop stamps its heartbeat


async def _heartbeat(beats: Any, index: int) -> None:
    """Stamp `beats[index]` with the time now, for as long as this event loop turns (the clock is
    CLOCK_MONOTONIC, the same in every process)."""
    while True:
        beats[index] = time.monotonic()
        await asyncio.sleep(HEARTBEAT_S)


def _worker(config: ProxyConfig, index: int, path: str, conn: Any, beats: Any) -> None:
    """One worker: the proxy on the shared port, its metrics on `path`; tells `conn` "ready"
    once serving, or the one line why it could not start; stamps `beats[index]` while its
    event loop turns."""
    die_with_parent()  # SIGTERM when the supervisor dies
    setup_logging(config, prefix=f"[worker {index}] ")

    async def main() -> None:
        task = asyncio.current_task()
        assert task is not None
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):  # stop serving, then clean up
            loop.add_signal_handler(sig, task.cancel)
        beat = asyncio.create_task(_heartbeat(beats, index))
        try:
            with contextlib.suppress(asyncio.CancelledError):
                await serve(
                    config, reuse_port=True, metrics_path=path, ready=lambda: conn.send("ready")
                )
        finally:
            beat.cancel()

    try:
        event_loop_runner()(main())
    except StartupFailed as e:
        conn.send(str(e))


class _Merged:
    """A collector yielding the families given (what generate_latest renders)."""

    def __init__(self, families: Iterable[Metric]) -> None:
        self._families = list(families)

    def collect(self) -> Iterable[Metric]:
        return self._families


def merge_metrics(texts: dict[int, str]) -> list[Metric]:
    """The workers' exposition texts as one set of families, each sample labelled with its
    worker (a family's samples in worker order)."""
    merged: dict[str, Metric] = {}
    for index, text in sorted(texts.items()):
        for family in text_string_to_metric_families(text):
            out = merged.get(family.name)
            if out is None:
                out = merged[family.name] = Metric(
                    family.name, family.documentation, family.type, family.unit
                )
            for s in family.samples:
                out.samples.append(s._replace(labels={**s.labels, "worker": str(index)}))
    return list(merged.values())


class Supervisor:
    """Starts, watches and stops the workers; serves their merged metrics and health."""

    def __init__(self, config: ProxyConfig) -> None:
        self.config = config
        self._ctx = multiprocessing.get_context("spawn")  # no forked event loop or zmq context
        self._dir = tempfile.mkdtemp(prefix="mmreuse-proxy-")
        self._procs: dict[int, Any] = {}
        self._started: dict[int, float] = {}
        self.restarts: dict[int, int] = {}  # per worker, as /health reports them
        self._pipes: dict[int, Any] = {}  # a restarted worker's, until it says how it started
        # each worker's heartbeat (time.monotonic() its loop last stamped), in shared memory
        self._beats = self._ctx.RawArray("d", config.serving.workers)
        self._serving: dict[int, float] = {}  # a worker that said "ready": since when
        self._killed: set[int] = set()  # stalled workers SIGKILLed, not yet seen to exit
        self._stopping = False
        self.registry = CollectorRegistry()
        self._restarts = Counter(
            "mmreuse_proxy_worker_restarts",
            'workers started again: reason="exited" (it exited) or "stalled" (its event loop '
            "stalled past --worker-stall-timeout, so it was killed)",
            ["worker", "reason"],
            registry=self.registry,
        )
        self._up = Gauge("mmreuse_proxy_workers_up", "workers running now", registry=self.registry)

    def path(self, index: int) -> str:
        return str(Path(self._dir) / f"worker-{index}.sock")

    def _spawn(self, index: int) -> Any:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path(index))
        parent, child = self._ctx.Pipe(duplex=False)
        self._serving.pop(index, None)
        proc = self._ctx.Process(
            target=_worker,
            args=(self.config, index, self.path(index), child, self._beats),
            name=f"mmreuse-proxy-worker-{index}",
            daemon=False,
        )
        proc.start()
        child.close()
        self._procs[index] = proc
        self._started[index] = time.monotonic()
        return parent

    async def start(self) -> None:
        """Every worker serving, or StartupFailed (the first worker's reason) with all stopped."""
        pipes = {i: self._spawn(i) for i in range(self.config.serving.workers)}
        try:
            for i, conn in pipes.items():
                msg = await asyncio.to_thread(self._wait_ready, conn, i)
                if msg != "ready":
                    raise StartupFailed(f"worker {i}: {msg}")
        except BaseException:
            await self.stop()
            raise
        finally:
            for conn in pipes.values():
                conn.close()
        now = time.monotonic()
        self._serving = dict.fromkeys(self._procs, now)
        self._up.set(len(self._procs))

    def _wait_ready(self, conn: Any, index: int) -> str:
        proc = self._procs[index]
        end = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < end:
            if conn.poll(0.2):
                try:
                    return str(conn.recv())
                except EOFError:
                    break
            if not proc.is_alive():
                break
        if proc.is_alive():
            return f"not serving after {START_TIMEOUT_S:.0f} s"
        return f"exited (code {proc.exitcode}) before serving"

    def stalled_for(self, index: int, now: float | None = None) -> float | None:
        """How long worker `index`'s event loop has not turned (since its last heartbeat, or
        since it said it was serving, whichever is later); None while it is not serving yet."""
        since = self._serving.get(index)
        if since is None:
            return None  # starting: its views may load snapshots with the loop held
        now = time.monotonic() if now is None else now
        return max(0.0, now - max(since, self._beats[index]))

    def _kill_stalled(self, now: float) -> None:
        """SIGKILL (its own process only) a serving worker whose loop has not turned for
        `--worker-stall-timeout`; the exit watch then starts it again, once."""
        bound = self.config.serving.worker_stall_timeout
        if not bound:
            return
        for i, proc in self._procs.items():
            if i in self._killed or not proc.is_alive():
                continue
            stalled = self.stalled_for(i, now)
            if stalled is None or stalled < bound:
                continue
            logger.error(
                "worker %d (pid %s) has not turned its event loop for %.1f s "
                "(--worker-stall-timeout %g): killing it, to start it again",
                i, proc.pid, stalled, bound,
            )  # fmt: skip
            self._killed.add(i)
            proc.kill()

    async def watch(self) -> None:
        """Start again a worker that exited (its views rebuilt as a late replica's are), or that
        stalled (killed first)."""
        while not self._stopping:
            await asyncio.sleep(0.2)
            self._kill_stalled(time.monotonic())
            for i, proc in list(self._procs.items()):
                if proc.is_alive() or self._stopping:
                    continue
                wait = RESTART_INTERVAL_S - (time.monotonic() - self._started[i])
                if wait > 0:
                    continue
                # one restart per death: a killed stalled worker is started again here, as
                # one that exited is, once it has exited
                reason = "stalled" if i in self._killed else "exited"
                self._killed.discard(i)
                if reason == "exited":
                    logger.error("worker %d exited (code %s): starting it again", i, proc.exitcode)
                else:
                    logger.error("worker %d killed (stalled): starting it again", i)
                proc.join(0)
                self._restarts.labels(str(i), reason).inc()
                self.restarts[i] = self.restarts.get(i, 0) + 1
                old = self._pipes.pop(i, None)
                if old is not None:
                    old.close()
                self._pipes[i] = self._spawn(i)
            for i, conn in list(self._pipes.items()):
                with contextlib.suppress(EOFError, OSError):
                    if not conn.poll(0):
                        continue
                    msg = conn.recv()
                    if msg == "ready":
                        logger.info("worker %d serving again", i)
                        self._serving[i] = time.monotonic()
                    else:
                        logger.error("worker %d could not start again: %s", i, msg)
                conn.close()
                del self._pipes[i]
            self._up.set(sum(p.is_alive() for p in self._procs.values()))

    async def stop(self) -> None:
        self._stopping = True
        for conn in self._pipes.values():
            conn.close()
        for proc in self._procs.values():
            if proc.is_alive():
                proc.terminate()
        end = time.monotonic() + STOP_TIMEOUT_S
        for proc in self._procs.values():
            await asyncio.to_thread(proc.join, max(0.0, end - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                await asyncio.to_thread(proc.join, 5.0)
        with contextlib.suppress(OSError):
            for p in Path(self._dir).iterdir():
                p.unlink()
            os.rmdir(self._dir)

    # ---- the metrics port ---------------------------------------------------------------------

    async def _get(self, index: int, route: str) -> tuple[int, bytes] | None:
        """A worker's answer on its metrics socket (None: it does not answer now)."""
        try:
            conn = aiohttp.UnixConnector(path=self.path(index))
            async with (
                aiohttp.ClientSession(
                    connector=conn, timeout=aiohttp.ClientTimeout(SCRAPE_TIMEOUT_S)
                ) as s,
                s.get(f"http://worker{route}") as r,
            ):
                return r.status, await r.read()
        except (TimeoutError, aiohttp.ClientError, OSError):
            return None

    async def metrics(self, _request: web.Request) -> web.Response:
        got = await asyncio.gather(*(self._get(i, "/metrics") for i in self._procs))
        texts = {
            i: r[1].decode() for i, r in zip(self._procs, got, strict=True) if r and r[0] == 200
        }
        registry = CollectorRegistry()
        registry.register(_Merged(merge_metrics(texts)))
        body = generate_latest(self.registry) + generate_latest(registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def health(self, _request: web.Request) -> web.Response:
        got = await asyncio.gather(*(self._get(i, "/health") for i in self._procs))
        workers: dict[str, Any] = {}
        ok = True
        now = time.monotonic()
        for (i, proc), r in zip(self._procs.items(), got, strict=True):
            stalled = self.stalled_for(i, now)
            facts = {
                "pid": proc.pid,
                "restarts": self.restarts.get(i, 0),
                # seconds since its event loop last turned (None: starting)
                "loop_stalled_s": None if stalled is None else round(stalled, 1),
            }
            if r is None:
                workers[str(i)] = {"up": False, **facts}
                ok = False
                continue
            workers[str(i)] = {"up": True, **facts, **msgspec.json.decode(r[1] or b"{}")}
            ok = ok and r[0] == 200
        return web.json_response({"workers": workers}, status=200 if ok else 503)


def run_workers(config: ProxyConfig) -> None:
    """Serve `config` with `config.serving.workers` worker processes until interrupted."""
    setup_logging(config, prefix="[supervisor] ")

    async def main() -> None:
        sup = Supervisor(config)
        app = web.Application()
        app.router.add_get("/metrics", sup.metrics)
        app.router.add_get("/health", sup.health)
        runner = web.AppRunner(app, access_log=None)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        try:
            await sup.start()
            await runner.setup()
            host = config.serving.metrics_host or config.serving.host
            try:
                await web.TCPSite(runner, host, config.serving.metrics_port).start()
            except OSError as e:
                raise StartupFailed(
                    f"cannot listen on {host}:{config.serving.metrics_port}: {e.strerror or e}"
                ) from e
            logger.info(
                "%d workers on %s:%d, their metrics and health on %s:%d",
                config.serving.workers, config.serving.host, config.serving.port, host, config.serving.metrics_port,
            )  # fmt: skip
            watch = asyncio.create_task(sup.watch())
            await stop.wait()
            watch.cancel()
        finally:
            await runner.cleanup()
            await sup.stop()

    event_loop_runner()(main())


def run(config: ProxyConfig) -> None:
    """Serve `config` until interrupted, in this process or (`config.serving.workers` > 1) in that
    many workers; raises StartupFailed if the proxy cannot start, after stopping what had
    started."""
    if config.serving.workers > 1:
        run_workers(config)
        return
    setup_logging(config)
    with contextlib.suppress(KeyboardInterrupt):
        event_loop_runner()(serve(config))


__all__ = ["Supervisor", "merge_metrics", "run", "run_workers"]
