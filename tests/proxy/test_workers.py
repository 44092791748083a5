"""`mmreuse proxy --workers N`: N processes on one port (SO_REUSEPORT), each a replica; the
supervisor's --metrics-port has every worker's metrics and health, and restarts a worker that
dies or whose event loop stalls. Run as in production (a subprocess) against the fake E and PD."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from mmreuse.cluster.instance import free_ports
from mmreuse.proxy.workers import merge_metrics
from tests.support.proxy_fakes import chat, img
from tests.support.waiting import async_wait_until

A = "http://media/a.png"
JSON_TYPE = {"Content-Type": "application/json"}


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
    port, metrics = free_ports(2)
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
    async def healthy() -> dict | None:
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
        with contextlib.suppress(aiohttp.ClientError):
            status, body = await _health(mbase)
            if status == 200 and len(body["workers"]) == n:
                return body
        return None

    return await _until(healthy, "the workers never came up", timeout)


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


def _restarts(text: str) -> dict[tuple[str, str], float]:
    """The supervisor's restart counts, by (worker, reason)."""
    return {
        (s.labels["worker"], s.labels["reason"]): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "mmreuse_proxy_worker_restarts_total"
    }


async def _until(pred, what: str, timeout: float = 30.0):
    """The async `pred()`'s first truthy value, or fail naming `what` (a hang guard, not a
    timing check)."""
    got = await async_wait_until(pred, timeout)
    assert got, what
    return got


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

        async def exited() -> bool:
            return (await _health(mbase))[1]["workers"]["0"]["restarts"] >= 1

        await _until(exited, "the supervisor never saw worker 0 exit")
        await _requests(base, 4)

        async def back() -> bool:
            status, health = await _health(mbase)
            w0 = health["workers"]["0"]
            return status == 200 and w0["up"] and w0["restarts"] == 1

        await _until(back, "worker 0 never came back")
        async with aiohttp.ClientSession() as s, s.get(f"{mbase}/metrics") as r:
            text = await r.text()
        assert _restarts(text) == {("0", "exited"): 1.0}, text
        assert "mmreuse_proxy_workers_up 2.0" in text
        # the serving port's /health is the reference's (what a balancer probes)
        async with aiohttp.ClientSession() as s, s.get(f"{base}/health") as r:
            assert r.status == 200 and "mmreuse" not in await r.json()
    assert proc.returncode == 0 or proc.returncode == -signal.SIGTERM


async def test_a_worker_whose_loop_stalls_is_killed_and_started_again(fakes):
    # SIGSTOP freezes worker 0 as a loop stuck in one request's work does: it stays alive (the
    # exit watch sees nothing) and its share of the port's connections go unanswered
    e, pd = await fakes("e"), await fakes("pd")
    argv = ("--encode-servers-urls", e.url, "--decode-servers-urls", pd.url)
    async with workers(2, *argv, "--worker-stall-timeout", "2") as (proc, base, mbase):
        _, health = await _health(mbase)
        pid0, pid1 = health["workers"]["0"]["pid"], health["workers"]["1"]["pid"]
        assert health["workers"]["0"]["loop_stalled_s"] < 2, health
        os.kill(pid0, signal.SIGSTOP)
        try:

            async def restarted():
                status, health = await _health(mbase)
                w0 = health["workers"]["0"]
                return status == 200 and w0["up"] and w0["pid"] != pid0 and health

            health = await _until(restarted, "the supervisor never restarted stalled worker 0")
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid0, signal.SIGCONT)  # let it end, had it not been killed
        w0, w1 = health["workers"]["0"], health["workers"]["1"]
        assert w0["restarts"] == 1 and w1["restarts"] == 0 and w1["pid"] == pid1, health
        with pytest.raises(ProcessLookupError):  # killed, and reaped by the supervisor
            os.kill(pid0, 0)
        async with aiohttp.ClientSession() as s, s.get(f"{mbase}/metrics") as r:
            text = await r.text()
        assert _restarts(text) == {("0", "stalled"): 1.0}, text  # one restart for one death
        assert "mmreuse_proxy_workers_up 2.0" in text
        await _requests(base, 8)  # the port serves from both again
    err = proc.stderr.read().decode()  # the supervisor has stopped
    assert f"worker 0 (pid {pid0}) has not turned its event loop" in err, err[-3000:]
    assert "worker 0 killed (stalled): starting it again" in err, err[-3000:]
    assert "worker 0 exited" not in err, err[-3000:]


async def test_a_worker_busy_for_less_than_the_bound_is_not_killed(fakes):
    # stopped long enough for the supervisor to see its loop still (a scrape of its /health
    # waits for it), then let go: well under the default bound, so it is the same worker after
    e, pd = await fakes("e"), await fakes("pd")
    argv = ("--encode-servers-urls", e.url, "--decode-servers-urls", pd.url)
    async with workers(2, *argv) as (_, _, mbase):
        _, health = await _health(mbase)
        pid0 = health["workers"]["0"]["pid"]
        os.kill(pid0, signal.SIGSTOP)
        try:

            async def seen_stalled():
                status, health = await _health(mbase)
                w0 = health["workers"]["0"]
                return status == 503 and not w0["up"] and w0["loop_stalled_s"] >= 1

            await _until(seen_stalled, "the supervisor never saw worker 0's loop stand still")
        finally:
            os.kill(pid0, signal.SIGCONT)

        async def recovered():
            status, health = await _health(mbase)
            w0 = health["workers"]["0"]
            return status == 200 and w0["up"] and w0["loop_stalled_s"] < 1 and health

        health = await _until(recovered, "worker 0 never answered again")
        assert health["workers"]["0"]["pid"] == pid0, health
        assert health["workers"]["0"]["restarts"] == 0, health
        async with aiohttp.ClientSession() as s, s.get(f"{mbase}/metrics") as r:
            assert _restarts(await r.text()) == {}


def _hostile_bodies() -> list[bytes]:
    """The largest requests of the kinds that held a worker's loop for seconds (the third
    hostile review): a 4 MiB cache_salt on 999 images (naming hashed it per image), 999 audio
    items with 1 MiB of processor kwargs (copied into each E sub-request), an audio part with
    1,000,000 extra keys (its content key, its sorted JSON), 64 MiB of inline media."""
    images = [img(f"http://media/{i}.png") for i in range(999)]
    audio = [
        {"type": "input_audio", "input_audio": {"data": f"UklGR{i:03d}", "format": "wav"}}
        for i in range(999)
    ]
    keys = b",".join(b'"k%d":0' % i for i in range(1_000_000))
    inline = "data:image/png;base64," + "QUJD" * (16 << 20)
    return [
        json.dumps(chat(*images, cache_salt="s" * (4 << 20))).encode(),
        json.dumps(chat(*audio, mm_processor_kwargs={"pad": "p" * (1 << 20)})).encode(),
        b'{"model":"tiny","messages":[{"role":"user","content":[{"type":"input_audio",'
        b'"input_audio":{"data":"UklGRg==","format":"wav",' + keys + b"}}]}]}",
        json.dumps(chat(img(inline))).encode(),
    ]


async def test_no_clients_request_gets_a_worker_killed(fakes):
    # Each of these once held a worker's loop past --worker-stall-timeout: the watchdog killed
    # it, and the other clients' requests on it were lost. Now each is refused or served
    # within its bound, and every request of the other clients meanwhile is answered.
    e, pd = await fakes("e"), await fakes("pd")
    argv = ("--encode-servers-urls", e.url, "--decode-servers-urls", pd.url)
    async with workers(2, *argv, "--uuid-policy", "tenant", "--worker-stall-timeout", "2") as (
        _, base, mbase,
    ):  # fmt: skip
        done = asyncio.Event()
        answered: list[int] = []

        async def others() -> None:
            async with aiohttp.ClientSession() as s:
                while not done.is_set():
                    body = chat(img(A), cache_salt="other")
                    async with s.post(f"{base}/v1/chat/completions", json=body) as r:
                        answered.append(r.status)

        canary = asyncio.create_task(others())
        statuses = []
        for body in _hostile_bodies():
            connector = aiohttp.TCPConnector(force_close=True)  # a worker picked per connection
            async with (
                aiohttp.ClientSession(connector=connector) as s,
                s.post(f"{base}/v1/chat/completions", data=body, headers=JSON_TYPE) as r,
            ):
                statuses.append(r.status)
        await asyncio.sleep(2.5)  # past the stall bound: a watchdog kill would have happened
        done.set()
        await canary
        assert statuses == [400, 400, 400, 200], statuses
        assert answered and set(answered) == {200}, answered
        async with aiohttp.ClientSession() as s, s.get(f"{mbase}/metrics") as r:
            assert _restarts(await r.text()) == {}


async def test_a_worker_that_cannot_bind_stops_them_all(fakes):
    e, pd = await fakes("e"), await fakes("pd")
    held = socket.socket()
    held.bind(("127.0.0.1", 0))  # no SO_REUSEPORT: no worker can share it
    held.listen()
    port = held.getsockname()[1]
    try:
        proc = _spawn("--port", str(port), "--metrics-port", str(free_ports(1)[0]), "--workers", "2",
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
        (["--worker-stall-timeout", "0.5"], "--worker-stall-timeout=0.5 must be 0 (never) or"),
        (["--worker-stall-timeout", "-1"], "--worker-stall-timeout=-1 must be 0 (never) or"),
        (["--worker-stall-timeout", "nan"], "--worker-stall-timeout=nan must be 0 (never) or"),
        (["--worker-stall-timeout", "inf"], "--worker-stall-timeout=inf must be 0 (never) or"),
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
    from mmreuse.proxy.config import ServingConfig

    with pytest.raises(InvalidArgument, match=r"needs serving\.metrics_port"):
        ServingConfig(workers=2)
    with pytest.raises(InvalidArgument, match="workers=0"):
        ServingConfig(workers=0, metrics_port=9000)
    assert ServingConfig(workers=3, metrics_port=9000).workers == 3
    assert ServingConfig().worker_stall_timeout == 30.0
    for bad in (0.5, -1, float("nan"), float("inf"), True, "30"):
        with pytest.raises(InvalidArgument, match=r"worker_stall_timeout=.* must be 0 \(never\)"):
            ServingConfig(worker_stall_timeout=bad)
    assert ServingConfig(worker_stall_timeout=0).worker_stall_timeout == 0  # never


async def test_what_start_up_made_is_out_of_the_collectors_reach(fakes):
    # a full collection then walks a request's objects only, not the started proxy's ~50,000
    import gc

    from mmreuse.proxy.config import parse_args
    from mmreuse.proxy.server import serve

    e, pd = await fakes("e"), await fakes("pd")
    [port] = free_ports(1)
    config = parse_args(
        ["--host", "127.0.0.1", "--port", str(port), "--encode-servers-urls", e.url,
         "--decode-servers-urls", pd.url],
        env={},
    )  # fmt: skip
    gc.unfreeze()
    frozen: list[int] = []
    ready = asyncio.Event()
    task = asyncio.ensure_future(
        serve(config, ready=lambda: (frozen.append(gc.get_freeze_count()), ready.set()))
    )
    try:
        await asyncio.wait_for(ready.wait(), 30)  # a hang guard
        assert frozen and frozen[0] > 10_000, frozen
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        gc.unfreeze()
