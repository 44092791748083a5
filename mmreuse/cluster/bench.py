"""`mmreuse bench-cluster`: the simulator's request streams through `mmreuse proxy` on a real
vLLM EPD cluster, once per policy, each from cold caches; the simulator's table and JSON schema,
from what the real cluster did.

Per policy: the caches are reset (P's prefix and encoder caches, E's encoder cache, through
vLLM's dev endpoints; E's EC store emptied) and every image uuid and the cache salt are scoped
to the policy's run, so nothing carries over. The stream (`mmreuse.cluster.simchat`) is sent
open-loop: request i leaves at i / rate seconds (or at the stream's own arrival times, as
`servegen-photos` has them), whether or not earlier ones are done. TTFT per request class
(every item new, some, none; `mmreuse.cluster.classes`) comes from `observe`.

Where each occurrence's embedding came from, per request (the simulator's buckets and rules,
`mmreuse.sim.accounting`): P's admission record (`DemandScheduler` with `admission_records`:
each item's class at admission, with the C vLLM admitted it with, whatever the policy) joined
with the proxy's decision (which items E got; the proxy runs in this process, its
`after_decide` hook records it). A delivery wins:
- `forward`: E got the identifier for the first time in the run (E's store is empty at the
  start and keeps what it wrote), or P encoded the item itself;
- `e_cache`: E got it again (its store or encoder cache serves it, no forward);
- otherwise P's class: `kv` (`kv_covered`, `no_embeds`), `p_embedding` (`p_local`),
  `external` (P loaded it from the store), `dedup` (`duplicate`).
`redundant_forwards`: E forwards of items P then found `kv_covered` or `p_local`;
`late_fallbacks`: items P encoded itself that the policy had kept from E; `wrong_skips`: failed
requests with skipped items (0 when P's own order serves what was skipped). E's real forwards
(its iteration log, `e_forwards_probe`) are reported next to the attributed ones. Latencies are
CPU-scale on the tiny local model: the counts are real, the milliseconds are not a GPU's.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..accounting import Bucket, Delivery, PolicyResult, account_request
from ..decision import parse_policy
from ..demand import ItemClass
from ..errors import InvalidArgument
from ..proxy.metrics import sample_sum
from ..sim.report import percentile, summarize
from ..validate import check_float, check_str
from .classes import Observed
from .client import render
from .simchat import ChatRequest

REFERENCE = "reference"  # bench-cluster's name for vLLM's reference proxy, run as a policy
STREAM_ERROR = -2  # a request answered 200 whose stream then failed or broke off


@dataclass(slots=True)
class RequestOutcome:
    """One request as the client and the cluster saw it."""

    rid: int
    status: int = 0
    ttft_ms: float | None = None
    decision: Any = None
    records: list[Any] = field(default_factory=list)  # P's admission records
    e_records: list[Any] = field(default_factory=list)  # E's, one per sub-request it admitted
    text: str = ""  # the streamed answer


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _post(url: str, timeout: float = 30.0) -> int:
    req = urllib.request.Request(url, data=b"", method="POST")
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return int(r.status)


def reset_caches(cluster: Any) -> None:
    """P's prefix and encoder caches, E's encoder cache (vLLM's dev endpoints: the harness
    starts every server with VLLM_SERVER_DEV_MODE=1) and the embedding store (the Mooncake
    Store's embeddings, or ECExampleConnector's folder), emptied."""
    for inst in cluster.instances.values():
        spec = inst.spec
        try:
            if spec.role == "prefill":
                for _ in range(50):  # refused while a request still holds blocks: retry
                    req = urllib.request.Request(f"{spec.url}/reset_prefix_cache", b"", method="POST")  # fmt: skip
                    with urllib.request.urlopen(req, timeout=30) as r:
                        if json.loads(r.read()).get("success"):
                            break
                    time.sleep(0.2)
                else:
                    raise RuntimeError(f"{spec.name}: its prefix cache could not be reset")
            _post(f"{spec.url}/reset_encoder_cache")
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                raise RuntimeError(
                    f"{spec.name} ({spec.url}) has no /reset_* endpoints: start it with "
                    "VLLM_SERVER_DEV_MODE=1, so that each policy starts from cold caches"
                ) from None
            raise
    store = getattr(cluster, "store", None)
    if store is not None:  # the Mooncake Store: every embedding removed, leases or not
        store.clear()
    elif cluster.ec_dir is not None:  # a remote deployment's store is its own to manage
        for child in cluster.ec_dir.iterdir():
            shutil.rmtree(child, ignore_errors=True)


def _records_since(endpoints: Sequence[str], since: Sequence[int]) -> list[list[Any]]:
    """Every P's admission records from `since` on (DemandScheduler's RecordsQuery)."""
    import zmq

    from ..demand_query import AdmissionRecords, RecordsQuery, decode_answer, encode

    out = []
    ctx: Any = zmq.Context.instance()
    for ep, start in zip(endpoints, since, strict=True):
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(ep)
        got: list[Any] = []
        nxt = start
        try:
            while True:
                dealer.send(encode(RecordsQuery(f"bench-{nxt}", nxt, 4096)))
                if not dealer.poll(30_000):
                    raise RuntimeError(f"{ep}: no admission records within 30 s")
                ans = decode_answer(dealer.recv())
                if not isinstance(ans, AdmissionRecords) or not ans.enabled:
                    raise RuntimeError(f"{ep}: P keeps no admission records ({ans})")
                got += ans.records
                if not ans.records or ans.next == nxt:
                    break
                nxt = ans.next
        finally:
            dealer.close(0)
        out.append(got)
    return out


def record_heads(endpoints: Sequence[str]) -> list[int]:
    """Where each P's admission records stand now (the next seq)."""
    heads = []
    for recs in _records_since(endpoints, [0] * len(endpoints)):
        heads.append(recs[-1].seq + 1 if recs else 0)
    return heads


def _e_sent(req: ChatRequest, out: RequestOutcome) -> tuple[set[str], dict[str, Delivery] | None]:
    """What E was sent for this request, and how it produced each item when E's own records
    say (None: no E records to go by). E's records are the truth under any proxy (the
    reference's included): an item E encoded is a forward, one its encoder cache or the store
    served is not."""
    if out.e_records:
        how: dict[str, Delivery] = {}
        for rec in out.e_records:
            for i, item in enumerate(rec.items):
                if i in rec.encoded:
                    how[item.identifier] = Delivery.FORWARD
                else:
                    how.setdefault(item.identifier, Delivery.E_CACHE)
        return set(how), how
    decision = out.decision
    if decision is not None:
        return {req.uuids[i] for i in decision.dispatch.e_items}, None
    return set(), None


def observe(req: ChatRequest, out: RequestOutcome) -> Observed:
    """One request's outcome as `mmreuse.cluster.classes` reads it: its TTFT (None unless
    answered), its items, how many items E got for it (E's own records where it keeps them,
    else the proxy's decision), and the proxy's render of it (None: not rendered)."""
    if out.e_records:
        e_items = sum(len(rec.items) for rec in out.e_records)
    elif out.decision is not None:
        e_items = len(out.decision.dispatch.e_items)
    else:
        e_items = 0
    render_s = getattr(out.decision, "render_s", 0.0) if out.decision is not None else 0.0
    return Observed(
        ttft_ms=out.ttft_ms if out.status == 200 else None,
        items=len(req.uuids),
        e_items=e_items,
        render_ms=render_s * 1e3 if render_s else None,
    )


def attribute(
    policy: str, requests: Sequence[ChatRequest], outcomes: Sequence[RequestOutcome]
) -> PolicyResult:
    """The simulator's accounting (`mmreuse.accounting.account_request`, the same function)
    from what the real cluster did (the module docstring). `policy` "reference" is vLLM's
    reference proxy (it sends E every item)."""
    reference = policy == REFERENCE
    e_at_once = True if reference else parse_policy(policy).e_at_once
    r = PolicyResult(policy if reference else parse_policy(policy).value)
    sent_before: set[str] = set()
    for req, out in zip(requests, outcomes, strict=True):
        r.requests += 1
        sent, how = _e_sent(req, out)
        rec = out.records[0] if out.records else None
        needs_encoding = False
        if rec is None:  # no record (a failed request): count its items as unknown forwards
            r.occurrences += len(req.uuids)
            r.buckets[Bucket.FORWARD] += len(req.uuids)
        else:
            acct = account_request(**_record_account(rec, sent, sent_before, how))
            r.add(acct)
            needs_encoding = acct.needs_encoding
        sent_before |= sent
        # E requests and transfers as the simulator counts them: one per client request that
        # E was asked for something (opportunistic and the reference ask for everything), and
        # one per request E delivered something for
        if sent or (e_at_once and req.uuids):
            r.e_requests += 1
        if sent:
            r.transfers += 1
        decision = out.decision
        if out.status != 200 and decision is not None and decision.dispatch.raw_items:
            r.wrong_skips += 1
        if out.ttft_ms is not None and out.status == 200:
            r.ttft_ms.append(out.ttft_ms)
            (r.ttft_encode_ms if needs_encoding else r.ttft_reuse_ms).append(out.ttft_ms)
    return r


def _record_account(
    rec: Any, sent: set[str], sent_before: set[str], how: dict[str, Delivery] | None = None
) -> dict[str, Any]:
    """`account_request`'s arguments from P's admission record and what E was sent.

    How E produced a delivery: E's own record (`how`) where there is one; else the first time
    E gets an identifier in the run is a forward (E's store starts empty and keeps what it
    wrote, as ECExampleConnector's does) and later ones its store serves. `would`: P's class
    at admission, where a delivered item's `p_external` is the copy E just wrote (the
    simulator's `would` leaves forwarded items out of the store): an E need. A late fallback
    is an item P encoded itself that nobody delivered.
    """
    occurrences = [(item.identifier, item.item_class) for item in rec.items]
    delivered = {
        ident: how[ident]
        if how is not None and ident in how
        else (Delivery.E_CACHE if ident in sent_before else Delivery.FORWARD)
        for ident, _ in occurrences
        if ident in sent
    }
    would_need_e = {
        ident for ident, cls in occurrences if cls.needs_e or cls is ItemClass.P_EXTERNAL
    }
    encoded = {rec.items[i].identifier for i in rec.encoded}

    def late(i: int, ident: str, cls: ItemClass) -> Delivery | None:
        return Delivery.FORWARD if ident in encoded else None

    return {
        "occurrences": occurrences,
        "delivered": delivered,
        "would_need_e": would_need_e,
        "late": late,
    }


def _delta_text(line: bytes) -> str:
    """The text of one streamed chunk (`data: {...}`), "" when it has none."""
    try:
        chunk = json.loads(line[6:])
        return str(chunk["choices"][0]["delta"].get("content") or "")
    except (ValueError, KeyError, IndexError, TypeError, AttributeError):
        return ""


async def _send(session: Any, url: str, req: ChatRequest, tag: str, out: RequestOutcome) -> None:
    body = {**req.body, "stream": True}
    t0 = time.perf_counter()
    async with session.post(
        f"{url}/v1/chat/completions", json=body, headers={"x-request-id": tag}
    ) as resp:
        out.status = resp.status
        done = False
        async for line in resp.content:
            if line.startswith(b"data: [DONE]"):
                done = True
            if not line.startswith(b"data: ") or b'"content"' not in line:
                if line.startswith(b"data: {") and b'"error"' in line:
                    out.status = STREAM_ERROR  # vLLM failed it after the 200 went out
                continue
            if out.ttft_ms is None:
                out.ttft_ms = (time.perf_counter() - t0) * 1e3
            out.text += _delta_text(line)
        if out.status == 200 and not done:
            out.status = STREAM_ERROR  # the stream ended without vLLM's [DONE]


async def _open_loop(
    url: str,
    requests: Sequence[ChatRequest],
    outcomes: Sequence[RequestOutcome],
    offsets: Sequence[float],
    run: str,
    progress: Callable[[int, int], None] | None,
) -> None:
    """Send the stream to the proxy at `url`, request i at offsets[i] s (open loop)."""
    import aiohttp

    t0 = time.perf_counter()
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        tasks = []
        for i, (req, out) in enumerate(zip(requests, outcomes, strict=True)):
            delay = t0 + offsets[i] - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.ensure_future(_send(session, url, req, f"{run}-{req.rid}", out)))
            if progress is not None:
                progress(i + 1, len(requests))
        results = await asyncio.gather(*tasks, return_exceptions=True)
    for res, out in zip(results, outcomes, strict=True):
        if isinstance(res, BaseException):
            out.status = -1


async def _drive(
    proxy_args: list[str],
    env: dict[str, str],
    requests: Sequence[ChatRequest],
    offsets: Sequence[float],
    run: str,
    progress: Callable[[int, int], None] | None,
) -> tuple[list[RequestOutcome], str]:
    """Send the stream through an in-process `mmreuse proxy`; the outcomes and its /metrics."""
    from aiohttp import web
    from prometheus_client import generate_latest

    from ..proxy.app import PROXY_KEY, build_app
    from ..proxy.config import parse_args

    outcomes = [RequestOutcome(r.rid) for r in requests]
    by_tag = {f"{run}-{r.rid}": o for r, o in zip(requests, outcomes, strict=True)}

    async def after_decide(decision: Any) -> None:
        out = by_tag.get(decision.request_id)
        if out is not None:
            out.decision = decision

    port = _free_port()
    config = parse_args([*proxy_args, "--port", str(port), "--host", "127.0.0.1"], env=env)
    app = build_app(config, after_decide=after_decide)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        await asyncio.sleep(1.0)  # the proxy's subscribers connect (slow joiner)
        await _open_loop(f"http://127.0.0.1:{port}", requests, outcomes, offsets, run, progress)
        metrics = generate_latest(app[PROXY_KEY].metrics.registry).decode()
    finally:
        await runner.cleanup()
    return outcomes, metrics


def _drive_reference(
    cluster: Any,
    env: dict[str, str],
    requests: Sequence[ChatRequest],
    offsets: Sequence[float],
    run: str,
    progress: Callable[[int, int], None] | None,
) -> list[RequestOutcome]:
    """Send the stream through vLLM 0.33.0's reference proxy (`disagg_epd_proxy.py`, run by
    the side venv's python) in front of the same servers; the outcomes."""
    import os
    import subprocess

    from ..proxy.reference import fetch_reference, reference_python

    es = [i.spec.url for i in cluster.instances.values() if i.spec.role == "encoder"]
    ps = [i.spec.url for i in cluster.instances.values() if i.spec.role == "prefill"]
    port = _free_port()
    argv = [
        str(reference_python()), str(fetch_reference()), "--host", "127.0.0.1", "--port", str(port),
        "--encode-servers-urls", ",".join(es), "--decode-servers-urls", ",".join(ps),
    ]  # fmt: skip
    log_dir = getattr(cluster, "log_dir", None)
    log = open(os.devnull, "wb") if log_dir is None else open(log_dir / "reference_proxy.log", "ab")  # noqa: SIM115
    with log:
        proc = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **env},
            start_new_session=True,
        )  # fmt: skip
        try:
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 60
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"vLLM's reference proxy exited ({proc.returncode})")
                try:
                    with urllib.request.urlopen(url + "/health", timeout=5) as r:
                        if r.status == 200:
                            break
                except (urllib.error.URLError, OSError):
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError("vLLM's reference proxy did not become healthy in 60 s")
                time.sleep(0.2)
            outcomes = [RequestOutcome(r.rid) for r in requests]
            asyncio.run(_open_loop(url, requests, outcomes, offsets, run, progress))
        finally:
            from .instance import stop_group

            stop_group(proc.pid, timeout=10.0, leader=proc)
    return outcomes


def _by_tag(records: Sequence[Any], sub_requests: bool) -> dict[str, list[Any]]:
    """Admission records by the client request's tag. vLLM's id is "chatcmpl-<x-request-id>-
    <8 random>"; a proxy's E sub-request's x-request-id is "<tag>:<item>:<hex>" (the
    reference's and mmreuse's alike)."""
    out: dict[str, list[Any]] = {}
    for rec in records:
        rid = rec.request_id.removeprefix("chatcmpl-").rsplit("-", 1)[0]
        tag = rid.split(":", 1)[0] if sub_requests else rid
        out.setdefault(tag, []).append(rec)
    return out


def run_policy(
    cluster: Any,
    policy: str,
    requests: Sequence[ChatRequest],
    *,
    rate: float,
    run: str,
    progress: Callable[[int, int], None] | None = None,
    proxy_args: Sequence[str] | None = None,
    offsets: Sequence[float] | None = None,
) -> dict[str, Any]:
    """One policy's run on `cluster` (a started `mmreuse.cluster.Cluster`): its summary row
    (the simulator's keys, plus what only a real run has), its PolicyResult, the answers and
    each request's outcome. `proxy_args`: the proxy's cluster flags (default
    `cluster.proxy_args()`, every P/PD). `policy` "reference": vLLM's reference proxy in front
    of the same servers, in place of mmreuse's. Request i leaves at `offsets[i]` s
    (`send_offsets`), or at i / rate s without them."""
    reference = policy == REFERENCE
    policy = REFERENCE if reference else parse_policy(policy).value
    check_str("run", run, nonempty=True)
    rate = check_float("rate", rate, 0, lo_open=True)
    if offsets is None:
        offsets = [i / rate for i in range(len(requests))]
    elif len(offsets) != len(requests):
        raise InvalidArgument(
            f"offsets must hold one time per request ({len(requests)}), got {len(offsets)}"
        )
    reset_caches(cluster)
    ps = [i.spec for i in cluster.instances.values() if i.spec.role == "prefill"]
    es = [i.spec for i in cluster.instances.values() if i.spec.role == "encoder"]
    endpoints = [str(p.demand_endpoint) for p in ps]
    e_endpoints = [str(e.demand_endpoint) for e in es if getattr(e, "demand_endpoint", None)]
    if len(e_endpoints) != len(es):
        e_endpoints = []  # E keeps no records here: E's work is attributed by the old rule
    heads, e_heads = record_heads(endpoints), record_heads(e_endpoints)
    probe = cluster.probe()
    env = {"ENCODER_MAX_BATCH_SIZE": "2"}  # the tiny E's 64-token budget fits 2 images
    t0 = time.perf_counter()
    if reference:
        outcomes, metrics = _drive_reference(cluster, env, requests, offsets, run, progress), ""
    else:
        base = list(cluster.proxy_args() if proxy_args is None else proxy_args)
        args = [*base, "--policy", policy]
        outcomes, metrics = asyncio.run(_drive(args, env, requests, offsets, run, progress))
    wall = time.perf_counter() - t0
    time.sleep(1.0)  # the last records and log lines land
    p_recs = _by_tag([r for recs in _records_since(endpoints, heads) for r in recs], False)
    e_recs = _by_tag([r for recs in _records_since(e_endpoints, e_heads) for r in recs], True)
    for req, out in zip(requests, outcomes, strict=True):
        out.records = p_recs.get(f"{run}-{req.rid}", [])
        out.e_records = e_recs.get(f"{run}-{req.rid}", [])
    result = attribute(policy, requests, outcomes)
    counts = probe.counts() if probe is not None else None
    row = summarize(result)
    loads = sum(  # P's loads through its EC connector: items it found there at admission
        1
        for out in outcomes
        for rec in out.records[:1]
        for k, item in enumerate(rec.items)
        if item.item_class is ItemClass.P_EXTERNAL
        and all(x.identifier != item.identifier for x in rec.items[:k])
    )
    e_classes = [x.item_class for out in outcomes for rec in out.e_records for x in rec.items]

    def forwards(prefix: str) -> int | None:
        if counts is None:
            return None
        return sum(c.forwards for n, c in counts.items() if n.startswith(prefix))

    row.update(
        {
            "e_subrequests": sum(len(o.e_records) for o in outcomes)
            if reference
            else int(sample_sum(metrics, "mmreuse_proxy_encoder_subrequests_total")),
            "connector_loads": loads,
            "proxy_fallbacks": None
            if reference
            else int(sample_sum(metrics, "mmreuse_proxy_fallbacks_total")),
            # from the servers' own logs (None for a remote deployment: no logs here): what
            # their encoders ran, the connector's load fallbacks included
            "e_forwards_probe": forwards("E"),
            "p_forwards_probe": forwards("P"),
            "e_items_sent": sum(len(r.items) for o in outcomes for r in o.e_records)
            if reference
            else int(sample_sum(metrics, "mmreuse_proxy_encoder_items_total", action="sent")),
            "e_items_abandoned": None
            if reference
            else int(sample_sum(metrics, "mmreuse_proxy_encoder_items_abandoned_total")),
            # E's own account of the items it admitted (None without E's records)
            "e_store_hits": e_classes.count(ItemClass.P_EXTERNAL) if e_endpoints else None,
            "e_cache_hits": e_classes.count(ItemClass.P_LOCAL) if e_endpoints else None,
            "ttft_p90_ms": percentile(result.ttft_ms, 90),
            # the proxy's render stage (mmreuse_proxy_stage_seconds{stage="render"}): P's
            # processor on every image of the requests it rendered (None: the reference's)
            "renders": None
            if reference
            else int(sample_sum(metrics, "mmreuse_proxy_stage_seconds_count", stage="render")),
            "render_s_sum": None
            if reference
            else round(sample_sum(metrics, "mmreuse_proxy_stage_seconds_sum", stage="render"), 6),
            "failed_requests": sum(1 for o in outcomes if o.status != 200),
            "unrecorded_requests": sum(1 for o in outcomes if not o.records),
            "wall_s": round(wall, 3),
            "cpu_scale_latencies": True,
        }
    )
    return {
        "row": row,
        "result": result,
        "outputs": [o.text for o in outcomes],
        "outcomes": outcomes,
    }


@dataclass(frozen=True, slots=True)
class RemoteSpec:
    name: str
    role: str
    url: str
    demand_endpoint: str | None = None


@dataclass(frozen=True, slots=True)
class RemoteInstance:
    spec: RemoteSpec


class Unreachable(RuntimeError):
    """A deployment given by URLs does not answer: the message names the server."""


class RemoteCluster:
    """A deployment given by URLs (`bench-cluster --encode-urls ... --pd-urls ...`), in the
    shape `run_policy` uses: every PD runs DemandScheduler with admission records and serves
    vLLM's dev reset endpoints (VLLM_SERVER_DEV_MODE=1); E's store and the servers' logs are
    not reachable from here, so no store is emptied and the real forwards are not read
    (`e_forwards_probe` None: the attributed ones stand)."""

    ec_dir = None

    def __init__(
        self,
        encode_urls: Sequence[str],
        pd_urls: Sequence[str],
        demand_endpoints: Sequence[str],
        proxy_flags: Sequence[str] = (),
    ) -> None:
        if not encode_urls or not pd_urls:
            raise ValueError("--encode-urls and --pd-urls: at least one URL each")
        if len(demand_endpoints) != len(pd_urls):
            raise ValueError(
                f"--demand-endpoints: {len(demand_endpoints)} for {len(pd_urls)} --pd-urls, "
                "one each (their DemandScheduler endpoints, aligned)"
            )
        self.instances: dict[str, RemoteInstance] = {}
        for i, url in enumerate(encode_urls):
            self.instances[f"E{i}"] = RemoteInstance(
                RemoteSpec(f"E{i}", "encoder", url.rstrip("/"))
            )
        for i, (url, ep) in enumerate(zip(pd_urls, demand_endpoints, strict=True)):
            self.instances[f"P{i}"] = RemoteInstance(
                RemoteSpec(f"P{i}", "prefill", url.rstrip("/"), ep)
            )
        self._flags = list(proxy_flags)

    def check_reachable(self, timeout: float = 10.0) -> None:
        """Each server answers GET /health; else an Unreachable naming the instance, its URL
        and what to check, before any policy runs."""
        for inst in self.instances.values():
            spec = inst.spec
            try:
                with urllib.request.urlopen(f"{spec.url}/health", timeout=timeout) as r:
                    r.read()
            except urllib.error.HTTPError as exc:
                raise Unreachable(
                    f"{spec.name} at {spec.url}: GET /health answered {exc.code}: is it a vLLM "
                    "server, and healthy?"
                ) from None
            except (urllib.error.URLError, OSError) as exc:
                reason = getattr(exc, "reason", exc)
                raise Unreachable(
                    f"{spec.name} at {spec.url} does not answer (GET /health: {reason}): check "
                    "the URL, that the server is up and that this machine can reach it"
                ) from None

    def proxy_args(self) -> list[str]:
        es = [i.spec.url for i in self.instances.values() if i.spec.role == "encoder"]
        ps = [i.spec for i in self.instances.values() if i.spec.role == "prefill"]
        return [
            "--encode-servers-urls", ",".join(es),
            "--decode-servers-urls", ",".join(p.url for p in ps),
            "--demand-endpoints", ",".join(str(p.demand_endpoint) for p in ps),
            *self._flags,
        ]  # fmt: skip

    def probe(self) -> None:
        return None


STORE_EMBEDS = 10**9  # ECExampleConnector's store: unbounded, E skips a forward it holds


def p_sizes(endpoints: Sequence[str]) -> list[Any]:
    """Each P's DemandStats (its KV blocks, block size and encoder cache size)."""
    import zmq

    from ..demand_query import DemandStats, StatsQuery, decode_answer, encode

    out = []
    ctx: Any = zmq.Context.instance()
    for ep in endpoints:
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(ep)
        try:
            dealer.send(encode(StatsQuery("bench-sizes")))
            if not dealer.poll(30_000):
                raise RuntimeError(f"{ep}: no stats within 30 s")
            ans = decode_answer(dealer.recv())
            if not isinstance(ans, DemandStats):
                raise RuntimeError(f"{ep}: not stats: {ans}")
            out.append(ans)
        finally:
            dealer.close(0)
    return out


def simulate_like(
    stream: Sequence[Any],
    workload: Any,
    policies: Sequence[str],
    *,
    rate: float,
    sizes: Sequence[Any],
    e_cache_embeds: int = STORE_EMBEDS,
    seed: int = 0,
    store: tuple[int, int] | None = None,
    offsets: Sequence[float] | None = None,
) -> list[dict[str, Any]]:
    """`mmreuse simulate` on the same stream, configured like the real cluster: the same
    arrivals (request i at i / rate s), P's real KV blocks, block size and encoder cache (its
    DemandStats), random routing as the proxy's default, and the store. `store` None:
    ECExampleConnector's, unbounded, as both E's cache and the external store P loads from.
    `store` (E's encoder cache, the store's capacity), in embeddings: the Mooncake Store's,
    E's own cache beside a bounded store that E reads before a forward and P loads from. The
    simulator's summary rows. `offsets`: when each request left (s), where not i / rate."""
    import dataclasses

    from ..sim import run
    from ..sim.config import ClusterConfig, SimConfig

    if offsets is None:
        offsets = [i / rate for i in range(len(stream))]
    timed = [
        dataclasses.replace(r, arrival_ms=t * 1000.0) for r, t in zip(stream, offsets, strict=True)
    ]
    p = sizes[0]
    cluster = ClusterConfig(
        num_encoders=1,
        num_prefills=len(sizes),
        block_size=p.block_size,
        p_kv_blocks=min(s.kv_blocks for s in sizes),
        p_encoder_cache_embeds=min(s.encoder_cache_embeds for s in sizes),
        e_cache_embeds=e_cache_embeds if store is None else store[0],
        external_store_embeds=STORE_EMBEDS if store is None else store[1],
        e_reads_external_store=store is not None,
        routing="random",
    )
    cfg = SimConfig(seed=seed, policies=tuple(policies), cluster=cluster, workload=workload)
    rows, _ = run(cfg, requests=list(timed))
    return rows


COMPARED = (
    "encoder_forwards",
    "e_requests",
    "transfers",
    "avoided_by_kv",
    "avoided_by_p_embedding",
    "avoided_by_external",
    "avoided_by_e_cache",
    "avoided_by_dedup",
    "late_fallbacks",
    "wrong_skips",
)


def comparison(
    real: Sequence[dict[str, Any]], sim: Sequence[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Per policy and per bucket: (real, simulated)."""
    by = {r["policy"]: r for r in sim}
    return [
        {"policy": r["policy"], **{k: (r[k], by[r["policy"]][k]) for k in COMPARED}}
        for r in real
        if r["policy"] in by
    ]


def rendered_stream(
    p_url: str, requests: Sequence[ChatRequest], stream: Sequence[Any]
) -> list[Any]:
    """The simulator's stream with the real prompts: each request rendered by P
    (`/v1/chat/completions/render`: vLLM's chat template, placeholders and identifiers), so the
    simulator sees exactly the token layout P schedules (the template's tokens around every
    message and image, which move block boundaries). A session's history is its last turn's
    prompt; every earlier turn's prompt must be a prefix of it (checked)."""
    from array import array

    from ..sim.workload import Session, SimRequest

    rendered = [render(p_url, req.body) for req in requests]
    last: dict[int, Any] = {}
    for sim, rp in zip(stream, rendered, strict=True):
        cur = last.get(sim.session.sid)
        if cur is None or len(rp.token_ids) > len(cur.token_ids):
            last[sim.session.sid] = rp
    sessions = {
        sid: Session(sid, array("q", rp.token_ids), list(rp.occurrences), [])
        for sid, rp in last.items()
    }
    out = []
    for sim, rp in zip(stream, rendered, strict=True):
        session = sessions[sim.session.sid]
        n = len(rp.token_ids)
        if list(session.tokens[:n]) != list(rp.token_ids) or session.mm[: len(rp.occurrences)] != list(rp.occurrences):  # fmt: skip
            raise RuntimeError(
                f"request {sim.rid}: its rendered prompt is not a prefix of its session's last"
            )
        out.append(SimRequest(sim.rid, session, sim.turn, sim.arrival_ms, n, len(rp.occurrences)))
    return out


__all__ = [
    "RemoteCluster",
    "RequestOutcome",
    "attribute",
    "comparison",
    "observe",
    "p_sizes",
    "rendered_stream",
    "reset_caches",
    "run_policy",
    "simulate_like",
]
