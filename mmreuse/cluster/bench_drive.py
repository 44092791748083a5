"""bench-cluster's runs: one policy's run of a request stream on a cluster (`run_policy`),
through `mmreuse proxy` in this process or vLLM's reference proxy in front of the same
servers; the caches reset before it and the servers' admission records fetched after it, for
the accounting (`mmreuse.cluster.bench`).

Per policy: the caches are reset (P's prefix and encoder caches, E's encoder cache, through
vLLM's dev endpoints; E's EC store emptied) and every image uuid and the cache salt are scoped
to the policy's run, so nothing carries over. The stream (`mmreuse.cluster.simchat`) is sent
open-loop: request i leaves at i / rate seconds (or at the stream's own arrival times, as
`servegen-photos` has them), whether or not earlier ones are done. TTFT per request class
(every item new, some, none; `mmreuse.cluster.classes`) comes from `bench.observe`.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from typing import Any

from ..decision import parse_policy
from ..demand import ItemClass
from ..errors import InvalidArgument
from ..proxy.metrics import sample_sum
from ..sim.report import percentile, summarize
from ..validate import check_float, check_str
from .bench import REFERENCE, STREAM_ERROR, RequestOutcome, attribute
from .instance import free_ports, stop_group, wait_http
from .simchat import ChatRequest


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

    from ..proxy.config import parse_args
    from ..proxy.server import PROXY_KEY, build_app

    outcomes = [RequestOutcome(r.rid) for r in requests]
    by_tag = {f"{run}-{r.rid}": o for r, o in zip(requests, outcomes, strict=True)}

    async def after_decide(decision: Any) -> None:
        out = by_tag.get(decision.request_id)
        if out is not None:
            out.decision = decision

    (port,) = free_ports(1)
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

    from .reference import fetch_reference, reference_python

    es = [i.spec.url for i in cluster.instances.values() if i.spec.role == "encoder"]
    ps = [i.spec.url for i in cluster.instances.values() if i.spec.role == "prefill"]
    (port,) = free_ports(1)
    argv = [
        str(reference_python()), str(fetch_reference()), "--host", "127.0.0.1", "--port", str(port),
        "--encode-servers-urls", ",".join(es), "--decode-servers-urls", ",".join(ps),
    ]  # fmt: skip
    log_dir = getattr(cluster, "log_dir", None)
    log_path = None if log_dir is None else log_dir / "reference_proxy.log"
    log = open(os.devnull, "wb") if log_path is None else open(log_path, "ab")  # noqa: SIM115
    with log:
        proc = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **env},
            start_new_session=True,
        )  # fmt: skip
        try:
            url = f"http://127.0.0.1:{port}"
            wait_http(
                url + "/health", proc, time.monotonic() + 60, name="vLLM's reference proxy",
                log=log_path,
            )  # fmt: skip
            outcomes = [RequestOutcome(r.rid) for r in requests]
            asyncio.run(_open_loop(url, requests, outcomes, offsets, run, progress))
        finally:
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


__all__ = ["record_heads", "reset_caches", "run_policy"]
