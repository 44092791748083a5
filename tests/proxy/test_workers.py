"""`mmreuse proxy --workers N`: N processes on one port (SO_REUSEPORT), each a replica; the
supervisor's --metrics-port has every worker's metrics and health, and restarts a worker that
dies. Run as in production (a subprocess) against the fake E and PD."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from mmreuse.proxy.workers import merge_metrics
from tests.support.proxy_fakes import chat, img

A = "http://media/a.png"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _spawn(*argv: str) -> subprocess.Popen:
    code = "import sys; from mmreuse.cli import main; sys.exit(main())"
    return subprocess.Popen(
        [sys.executable, "-c", code, "proxy", "--host", "127.0.0.1", *argv],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )


@contextlib.asynccontextmanager
async def workers(n: int, *argv: str):
    port, metrics = _free_port(), _free_port()
    proc = _spawn("--port", str(port), "--metrics-port", str(metrics), "--workers", str(n), *argv)
    base, mbase = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{metrics}"
    try:
        await _until_healthy(proc, mbase, n)
        yield proc, base, mbase
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=20)


async def _health(mbase: str) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as s, s.get(f"{mbase}/health") as r:
        return r.status, await r.json()


async def _until_healthy(proc, mbase: str, n: int, timeout: float = 60.0) -> dict:
    end = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
        with contextlib.suppress(aiohttp.ClientError):
            status, body = await _health(mbase)
            if status == 200 and len(body["workers"]) == n:
                return body
        assert time.monotonic() < end, "the workers never came up"
        await asyncio.sleep(0.1)


async def _served_by(mbase: str) -> dict[str, float]:
    async with aiohttp.ClientSession() as s, s.get(f"{mbase}/metrics") as r:
        text = await r.text()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "mmreuse_proxy_requests_total":
                w = sample.labels["worker"]
                out[w] = out.get(w, 0.0) + sample.value
    return out


async def _requests(base: str, n: int) -> None:
    for _ in range(n):  # a new connection each: the kernel picks a worker per connection
        connector = aiohttp.TCPConnector(force_close=True)
        async with (
            aiohttp.ClientSession(connector=connector) as s,
            s.post(f"{base}/v1/chat/completions", json=chat(img(A))) as r,
        ):
            assert r.status == 200, await r.text()


async def test_workers_share_one_port_and_report_together(fakes):
    e, pd = await fakes("e"), await fakes("pd")
    async with workers(2, "--encode-servers-urls", e.url, "--decode-servers-urls", pd.url) as (
        proc, base, mbase,
    ):  # fmt: skip
        await _requests(base, 24)
        served = await _served_by(mbase)
        assert sum(served.values()) == 24 and set(served) == {"0", "1"}, served
        assert all(v >= 1 for v in served.values()), served  # 2**-23 to fail by chance
        # a worker killed is started again, and the port keeps serving meanwhile (once it has
        # exited: connections the kernel queued at its socket while it died are reset, as with
        # any SO_REUSEPORT server)
        _, health = await _health(mbase)
        os.kill(health["workers"]["0"]["pid"], signal.SIGKILL)
        end = time.monotonic() + 30
        while (await _health(mbase))[1]["workers"]["0"]["restarts"] < 1:
            assert time.monotonic() < end, "the supervisor never saw worker 0 exit"
            await asyncio.sleep(0.05)
        await _requests(base, 4)
        while True:
            status, health = await _health(mbase)
            w0 = health["workers"]["0"]
            if status == 200 and w0["up"] and w0["restarts"] == 1:
                break
            assert time.monotonic() < end, health
            await asyncio.sleep(0.1)
        async with aiohttp.ClientSession() as s, s.get(f"{mbase}/metrics") as r:
            text = await r.text()
        assert 'mmreuse_proxy_worker_restarts_total{worker="0"} 1.0' in text
        assert "mmreuse_proxy_workers_up 2.0" in text
        # the serving port's /health is the reference's (what a balancer probes)
        async with aiohttp.ClientSession() as s, s.get(f"{base}/health") as r:
            assert r.status == 200 and "mmreuse" not in await r.json()
    assert proc.returncode == 0 or proc.returncode == -signal.SIGTERM


async def test_a_worker_that_cannot_bind_stops_them_all(fakes):
    e, pd = await fakes("e"), await fakes("pd")
    held = socket.socket()
    held.bind(("127.0.0.1", 0))  # no SO_REUSEPORT: no worker can share it
    held.listen()
    port = held.getsockname()[1]
    try:
        proc = _spawn("--port", str(port), "--metrics-port", str(_free_port()), "--workers", "2",
                      "--encode-servers-urls", e.url, "--decode-servers-urls", pd.url)  # fmt: skip
        _, err = await asyncio.to_thread(proc.communicate, timeout=60)
    finally:
        held.close()
    assert proc.returncode == 2, err  # as a single proxy that cannot listen
    assert f"worker 0: cannot listen on 127.0.0.1:{port}" in err.decode()


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--workers", "2"], "--workers=2 needs --metrics-port"),
        (["--workers", "0"], "--workers=0 must be in 1..64"),
    ],
)
def test_workers_flags_refused(argv, words):
    proc = _spawn("--encode-servers-urls", "http://e:1", "--decode-servers-urls", "http://d:2",
                  *argv)  # fmt: skip
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 2 and words in err.decode(), err


def test_merged_metrics_label_each_workers_samples():
    text = (
        '# HELP x_total things\n# TYPE x_total counter\nx_total{a="1"} 3.0\n'
        "# HELP g a gauge\n# TYPE g gauge\ng 7.0\n"
    )
    fams = {f.name: f for f in merge_metrics({0: text, 1: text.replace("3.0", "5.0")})}
    xs = [(s.labels, s.value) for s in fams["x"].samples if s.name == "x_total"]
    assert xs == [({"a": "1", "worker": "0"}, 3.0), ({"a": "1", "worker": "1"}, 5.0)]
    assert [s.labels["worker"] for s in fams["g"].samples] == ["0", "1"]


def test_a_config_built_in_code_checks_its_workers():
    from mmreuse.errors import InvalidArgument
    from mmreuse.proxy.config import ProxyConfig

    base = {"encode_urls": ("http://e",), "decode_urls": ("http://d",)}
    with pytest.raises(InvalidArgument, match="needs metrics_port"):
        ProxyConfig(**base, workers=2)
    with pytest.raises(InvalidArgument, match="workers=0"):
        ProxyConfig(**base, workers=0, metrics_port=9000)
    assert ProxyConfig(**base, workers=3, metrics_port=9000).workers == 3
