"""The proxy's HTTP side: aiohttp serves the reference proxy's routes and calls E, P and D.

Routes: POST /v1/chat/completions (streaming or not), GET /v1/models, GET /health,
POST /start_profile, POST /stop_profile (as the reference), and GET /metrics (Prometheus).
Per request: decide (policy.Planner) -> encode what E must (encoder.EncoderFanout) -> rewrite
(media.rewrite_for_decode) -> prefill (E + P + D) -> decode, retrying a decode 500 by
re-encoding everything, and retrying once a request whose E embedding the store lost (E encodes
it again, P gets it raw). Under `opportunistic` E gets everything at once while the decision is
made, and the sub-requests P's answer rules out are abandoned if still in flight. Unlike the
reference, a streaming client gets its status line only once the decode instance has accepted
the request, so an E, P or D failure is an HTTP error, not a broken 200 stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import os
import random
import time
import uuid as uuidlib
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import aiohttp
import msgspec
from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from ..availability import EmbeddingAvailability
from ..decision import Policy
from ..demand_query import DEMAND_ID_KEY  # P reads it from vllm_xargs
from ..errors import InvalidArgument
from .config import PrefillInstance, ProxyConfig
from .content import MediaFetcher, name_by_content
from .demand import DemandClient
from .encoder import EMPTY, EncodeResult, EncoderFanout, Encoding, chat_url, new_hex
from .errors import ProxyError
from .eside import ESide
from .media import (
    EMBEDS_PARTS,
    item_uuid,
    namespace_uuids,
    rewrite_for_decode,
    scan_parts,
)
from .metrics import ProxyMetrics
from .models import ModelCatalog
from .policy import Decision, Planner
from .store import StoreTruth
from .views import EncoderView, InstanceView

logger = logging.getLogger("mmreuse.proxy")

_decode = msgspec.json.Decoder()
_encode = msgspec.json.Encoder()
_JSON = {"Content-Type": "application/json"}
# The proxy's own channel to P and D: a client's values would reach them verbatim (a connector
# handle naming a host of its choosing, an embedding cached under an identifier others share).
CLIENT_FIELDS_STRIPPED = ("ec_transfer_params", "kv_transfer_params")
_ABSENT = object()
# A body larger than this is decoded and walked off the event loop (a thread): a request of
# many parts then stalls no other request. Smaller ones cost less than the thread hop.
OFF_LOOP_BYTES = 1 << 20
# How the proxy's HTTP server runs (`run`, and the tests' servers): a client that hangs up
# cancels its handler, which closes the backend request (as Starlette on uvicorn does for the
# reference; aiohttp's default keeps it running); request bodies are never inflated.
SERVER_SETTINGS: dict[str, Any] = {"handler_cancellation": True, "auto_decompress": False}


async def read_body(request: web.Request) -> bytes:
    """The request's body as sent: a compressed one is refused, never inflated (aiohttp's
    default inflates, and its size limit applies to the inflated bytes: a decompression bomb)."""
    encoding = request.headers.get("Content-Encoding")
    if encoding is not None and encoding.strip().lower() not in ("", "identity"):
        raise ProxyError(
            415,
            f"Content-Encoding {encoding[:40]!r} is not accepted: send the body uncompressed",
            stage="proxy",
        )
    try:
        return await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise ProxyError(
            413,
            f"the request body is over {request.client_max_size} bytes (--max-body-bytes)",
            stage="proxy",
        ) from None


PROXY_KEY: web.AppKey[Proxy] = web.AppKey("proxy")
AfterDecide = Callable[[Decision], Awaitable[None]]


def _demand_endpoint(instance: PrefillInstance) -> str:
    if instance.demand is None:  # ProxyConfig refuses it under the demand policies
        raise InvalidArgument(f"{instance.url}: no demand endpoint")
    return instance.demand


def _kv_params() -> dict[str, Any]:
    return {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }


class Proxy:
    """One proxy: its config, client session, views, planner and metrics."""

    def __init__(self, config: ProxyConfig, *, after_decide: AfterDecide | None = None) -> None:
        self.config = config
        self.registry = CollectorRegistry()
        self.metrics = ProxyMetrics(self.registry)  # its views' metrics too (metrics.views)
        self.session: aiohttp.ClientSession | None = None
        self.media_session: aiohttp.ClientSession | None = None  # --uuid-policy content's
        self.media = MediaFetcher(config.media, self._fetch_media)
        self.availability = EmbeddingAvailability(
            ttl_s=config.e_cache_ttl_s, max_entries=config.e_cache_items, metrics=self.metrics.views
        )
        prefix = "P" if config.prefill_urls else "PD"
        self.views = [
            InstanceView(
                f"{prefix}{i}",
                instance,
                hash_algo=config.hash_algo,
                hash_seed=config.hash_seed,
                block_size=config.block_size,
                metrics=self.metrics,
                availability=self.availability,
                # what the arrival-time split reads (index, demand)
                track_identifiers=Policy(config.policy).renders
                and not Policy(config.policy).e_at_once,
            )
            for i, instance in enumerate(config.instances)
        ]
        self.e_side = ESide(config, self.availability, self.metrics)
        self.e_views: list[EncoderView] = self.e_side.views
        self.rng = random.Random(config.seed)
        # Asked only under demand / opportunistic (the config holds an endpoint for each then).
        # Asked under demand / opportunistic (the config holds an endpoint for each then), and
        # under index while an instance's view is incomplete, where it has one.
        asks = config.policy.asks_p or (
            config.policy.reads_view and any(i.demand for i in config.instances)
        )
        clients = (
            [
                None
                if instance.demand is None
                else DemandClient(
                    _demand_endpoint(instance),
                    name=view.name,
                    observe=functools.partial(self.metrics.demand_outcome, view.name),
                    drop=functools.partial(self.metrics.demand_drop, view.name),
                )
                for view, instance in zip(self.views, config.instances, strict=True)
            ]
            if asks
            else []
        )
        self.demand = [c for c in clients if c is not None]
        self.store = (
            StoreTruth(
                config.e_store_url,
                config.e_store_namespace,
                self._session,
                timeout_s=config.e_store_timeout_s,
                on_outcome=lambda outcome: self.metrics.e_store_queries.labels(outcome).inc(),
            )
            if config.e_store_url is not None and config.e_store_namespace is not None
            else None
        )
        self.planner = Planner(
            config,
            self.views,
            self.availability,
            self._post_json,
            self.rng,
            clients,
            models=ModelCatalog(self._get),
            store=self.store,
            e_side=self.e_side,
        )
        self.encoders = EncoderFanout(
            config.encode_urls,
            self._session,
            max_batch_size=config.encoder_max_batch_size,
            no_rewrite=config.no_rewrite,
        )
        self.after_decide = after_decide

    # ---- lifecycle ----------------------------------------------------------------------------

    async def start(self, _app: web.Application | None = None) -> None:
        # vLLM closes an idle keep-alive connection after VLLM_HTTP_TIMEOUT_KEEP_ALIVE seconds
        # (5 by default); reusing one it has closed fails the request. Retire ours first.
        keep_alive = float(os.getenv("VLLM_HTTP_TIMEOUT_KEEP_ALIVE", "5"))
        connector = aiohttp.TCPConnector(
            limit=0,
            **({"keepalive_timeout": keep_alive / 2} if keep_alive > 0 else {"force_close": True}),
        )
        self.session = aiohttp.ClientSession(
            connector=connector,
            timeout=aiohttp.ClientTimeout(),  # none: the reference's 100,000 s, without timers
            skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding"),
        )
        if self.config.uuid_policy == "content":
            from .content import media_session  # no cookies; only checked addresses

            self.media_session = media_session(self.config.media)
        views: list[InstanceView | EncoderView] = [*self.views, *self.e_views]
        for view in views:
            await asyncio.to_thread(view.start)
        for client in self.demand:
            client.start()

    async def stop(self, _app: web.Application | None = None) -> None:
        for client in self.demand:
            await client.close()
        views: list[InstanceView | EncoderView] = [*self.views, *self.e_views]
        for view in views:
            await asyncio.to_thread(view.stop)
        if self.session is not None:
            await self.session.close()
        if self.media_session is not None:
            await self.media_session.close()

    def _session(self) -> aiohttp.ClientSession:
        assert self.session is not None, "Proxy.start() first"
        return self.session

    async def _get(self, url: str) -> tuple[int, bytes]:
        async with self._session().get(url, timeout=aiohttp.ClientTimeout(total=10)) as r:
            return r.status, await r.read()

    async def _fetch_media(
        self, url: str, cap: int, timeout_s: float, charge: Callable[[int], None]
    ) -> tuple[int, dict[str, str], bytes]:
        """One hop of a media fetch (`MediaFetcher`; `content.fetch_hop`): no redirect
        followed, at most `cap` bytes (decompressed) read, each chunk charged."""
        from .content import fetch_hop

        assert self.media_session is not None, "Proxy.start() first"
        return await fetch_hop(self.media_session, url, cap, timeout_s, charge)

    async def _post_json(self, url: str, body: Any) -> tuple[int, bytes]:
        async with self._session().post(url, data=_encode.encode(body), headers=_JSON) as r:
            return r.status, await r.read()

    # ---- POST /v1/chat/completions ------------------------------------------------------------

    async def chat(self, request: web.Request) -> web.StreamResponse:
        t0 = time.perf_counter()
        m = self.metrics
        policy = self.config.policy
        try:
            response = await self._chat(request, t0)
        except asyncio.CancelledError:  # the client hung up (aiohttp cancels the handler)
            m.request(policy, "client_gone").inc()
            raise
        except ProxyError as e:
            m.errors.labels(e.stage).inc()
            m.request(policy, _outcome(e.status)).inc()
            return web.json_response({"detail": e.detail}, status=e.status)
        except Exception as e:  # what the reference answers: 500 with the error
            logger.exception("chat completion failed")
            m.errors.labels("proxy").inc()
            m.request(policy, "server_error").inc()
            return web.json_response({"detail": f"Proxy error: {e}"}, status=500)
        outcome = getattr(response, "mmreuse_outcome", None) or _outcome(response.status)
        m.request(policy, outcome).inc()
        m.stage["total"].observe(time.perf_counter() - t0)
        return response

    def _parse(self, body: bytes) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """The client's request, without the fields only the proxy may set, and its media
        parts as vLLM classifies them (`scan_parts`: the parts themselves, so the naming below
        is in place); a 400 for what cannot be passed on."""
        try:
            req = _decode.decode(body)
        except msgspec.DecodeError as e:
            raise ProxyError(400, f"Invalid JSON body: {e}", stage="proxy") from e
        except RecursionError:  # msgspec's own depth limit
            raise ProxyError(400, "Invalid JSON body: nested too deeply", stage="proxy") from None
        if not isinstance(req, dict):
            raise ProxyError(400, "The body must be a JSON object", stage="proxy")
        for key in CLIENT_FIELDS_STRIPPED:
            if req.pop(key, _ABSENT) is not _ABSENT:
                self.metrics.stripped(key).inc()
        xargs = req.get("vllm_xargs")
        if isinstance(xargs, dict) and DEMAND_ID_KEY in xargs:  # the proxy's channel to P
            req["vllm_xargs"] = {k: v for k, v in xargs.items() if k != DEMAND_ID_KEY}
            self.metrics.stripped(f"vllm_xargs.{DEMAND_ID_KEY}").inc()
        return req, scan_parts(req, self.config.limit_mm_per_prompt)

    async def _chat(self, request: web.Request, t0: float) -> web.StreamResponse:
        raw = await read_body(request)
        if len(raw) > OFF_LOOP_BYTES:  # its decode and walk stall no other request
            req, items = await asyncio.to_thread(self._parse, raw)
        else:
            req, items = self._parse(raw)
        del raw
        if self.config.uuid_policy == "tenant":
            namespace_uuids(req)
        elif self.config.uuid_policy == "content":
            tm = time.perf_counter()
            fetched = await name_by_content(req, self.media)
            self.metrics.stage["media"].observe(time.perf_counter() - tm)
            if fetched:
                self.metrics.media_fetched.inc(fetched)
        req_id = request.headers.get("x-request-id")
        if req_id is None:  # as the reference: an empty header stays empty
            req_id = str(uuidlib.UUID(new_hex(128), version=4))
        cfg, m = self.config, self.metrics
        uuids = [item_uuid(item) for item in items]  # once: E, the rewrite and render use them
        encoded: EncodeResult | None = None  # E's answers, when already in (opportunistic)
        if cfg.policy is Policy.OPPORTUNISTIC and items:
            decision, encoded = await self._opportunistic(req, items, uuids, req_id)
        elif items and self.planner.splits:
            decision, encoded = await self._split(req, items, uuids, req_id)
        else:
            decision = await self.planner.decide(req, items, uuids)
        if decision.render_s:
            m.stage["render"].observe(decision.render_s)
        if decision.decide_s:
            m.stage["decide"].observe(decision.decide_s)
        view = self.views[decision.instance]
        if decision.no_plan is not None:
            m.fallbacks.labels(view.name, "no_plan").inc()
            m.errors.labels(decision.no_plan.split(":", 1)[0]).inc()
            logger.warning("[%s] no plan, E gets everything: %s", req_id, decision.no_plan)
        if decision.blind:
            m.blind(view.name).inc()
        if decision.klasses:
            for klass in set(decision.klasses):
                m.occurrence(klass).inc(decision.klasses.count(klass))
        if self.after_decide is not None:
            await self.after_decide(dataclasses.replace(decision, request_id=req_id))
        if cfg.prefill_urls:
            p_url: str | None = cfg.prefill_urls[decision.instance]
            d_url = cfg.decode_urls[self.rng.randrange(len(cfg.decode_urls))]
        else:
            p_url, d_url = None, cfg.decode_urls[decision.instance]
        stream = bool(req.get("stream", False))
        current, ready = decision, encoded  # E's answers serve the first attempt only
        attempt = 0  # decode 500s retried so far (--decode-retries)
        relost = False  # the one retry of a request whose reference the store lost
        sent = uuids  # the items' uuids at E and P (a lost item's is fresh on its retry)
        while True:
            try:
                body = await self._prepare(req, items, sent, current, req_id, p_url, ready)
                ready = None
                # PD may have items only as E's reference, or raw under a uuid its processor
                # cache may hold as one (an item planned as held): its connector fails the
                # request if the store lost one (E + P + D: `_prefill` checks P's answer)
                refs = (
                    p_url is None
                    and bool(current.e_indices or current.raw_with_uuid)
                    and not cfg.no_rewrite
                )
                # (on the retry nothing is taken for lost: P's answer is the client's)
                held_raw = frozenset() if relost else _uuids_at(sent, current.raw_with_uuid)
                td = time.perf_counter()
                resp = await self._session().post(
                    chat_url(d_url),
                    data=_encode.encode(body),
                    headers={"x-request-id": req_id, "Content-Type": "application/json"},
                )
                try:
                    if resp.status == 500 and refs:
                        detail = await resp.text()
                        if _request_error(detail) and (lost := _reference_uuids(body, held_raw)):
                            raise _EmbeddingLost("decode", lost, detail)
                    if resp.status == 500 and attempt < cfg.decode_retries:
                        detail = await resp.text()
                        attempt += 1
                        logger.warning(
                            "[%s] decode returned 500, re-encoding and retrying (attempt %d/%d): %s",
                            req_id, attempt, cfg.decode_retries, detail[:200],
                        )  # fmt: skip
                        m.fallbacks.labels(view.name, "retry").inc()
                        current = self.planner.eager(items, decision.instance)
                        continue
                    if resp.status >= 400:
                        detail = await resp.text()
                        logger.error("[%s] decode returned %s: %s", req_id, resp.status, detail)
                        raise ProxyError(resp.status, detail, stage="decode")
                    if stream:
                        held = b""
                        if refs:  # vLLM fails it inside the 200 stream: hold the status line
                            held, error = await self._hold(resp)
                            lost = _reference_uuids(body, held_raw) if error else frozenset()
                            if lost:
                                raise _EmbeddingLost("stream", lost, error or "")
                        return await self._stream(request, resp, td, held)
                    out = await resp.read()
                    m.stage["decode"].observe(time.perf_counter() - td)
                    if current.raw_with_uuid and (current.plan or current.answer) is not None:
                        self._observe_fallback(out, current, view)
                    return web.Response(
                        body=out,
                        status=resp.status,
                        headers={
                            "Content-Type": resp.headers.get("Content-Type", "application/json")
                        },
                    )
                finally:
                    resp.release()
            except _EmbeddingLost as lost:
                stage = "prefill" if lost.stage == "prefill" else "decode"
                if relost:  # lost again, though P got each such item raw: not retried twice
                    logger.error(
                        "[%s] %s failed again after the store lost an embedding: %s",
                        req_id, lost.stage, lost.detail[:200],
                    )  # fmt: skip
                    raise ProxyError(500, lost.detail, stage=stage) from None
                relost = True
                m.embedding_lost_retries.labels(view.name, lost.stage).inc()
                again = frozenset(i for i, u in enumerate(sent) if u in lost.uuids)
                logger.warning(
                    "[%s] %s failed: the embedding store lost what P was to load (%d item(s): "
                    "%s); retrying once, E encodes them again under a fresh uuid and P gets "
                    "them raw",
                    req_id, lost.stage, len(again), ", ".join(sorted(lost.uuids))[:200],
                )  # fmt: skip
                # A fresh uuid: P's processor cache may hold the old one as the reference
                # (metadata only), which it would give P's connector again in place of the
                # media. P then finds E's new put in the store, or encodes the item itself if
                # the store loses it again. No demand id (its proof was for the first plan).
                fresh = f":lost-{new_hex(32)}"
                sent = [u + fresh if i in again else u for i, u in enumerate(sent)]
                current = dataclasses.replace(
                    current,
                    e_indices=tuple(sorted({*current.e_indices, *again})),
                    raw_with_uuid=current.raw_with_uuid | again,
                    demand_id=None,
                )

    async def _prepare(
        self,
        req: dict[str, Any],
        items: list[dict[str, Any]],
        uuids: list[str],
        decision: Decision,
        req_id: str,
        p_url: str | None,
        encoded: EncodeResult | None = None,
    ) -> Mapping[str, Any]:
        """Encode (unless `encoded` holds E's answers already), rewrite and prefill: the body
        for decode. `req` is never mutated, so a retry starts from the original media."""
        result = encoded
        if result is None:
            result = await self._encode(req, items, uuids, decision, req_id)
        item_meta = result.item_meta
        if decision.dup_of:
            item_meta = dict(item_meta)
            for dup, first in decision.dup_of.items():
                if first in item_meta:  # shares the first's embedding: one transfer
                    item_meta[dup] = [{**f, "transfer_id": None} for f in item_meta[first]]
        if self.config.no_rewrite:
            prepared: Mapping[str, Any] = req
        else:
            prepared = rewrite_for_decode(req, item_meta, decision.raw_with_uuid, uuids, items)
        if result.ec_params:
            handles = dict(prepared.get("ec_transfer_params") or {})
            handles.update(result.ec_params)
            prepared = {**prepared, "ec_transfer_params": handles}
        if p_url is None:
            return self._with_demand_id(prepared, decision.demand_id)
        held_raw = _uuids_at(uuids, decision.raw_with_uuid)
        return await self._prefill(prepared, p_url, req_id, decision.demand_id, held_raw)

    async def _encode(
        self,
        req: dict[str, Any],
        items: list[dict[str, Any]],
        uuids: list[str],
        decision: Decision,
        req_id: str,
    ) -> EncodeResult:
        """E encodes decision.e_indices (the counts: sent, skipped, sub-requests)."""
        m = self.metrics
        te = time.perf_counter()
        result = EncodeResult({}, {}, 0)
        if decision.e_indices:
            result = await self.encoders.encode(req, items, decision.e_indices, req_id, uuids)
            m.stage["encode"].observe(time.perf_counter() - te)
            m.e_subrequests.inc(result.subrequests)
            self.planner.record_e(decision)
        if decision.e_indices:
            m.e_sent.inc(len(decision.e_indices))
        skipped = len(items) - len(decision.e_indices)
        if skipped:
            m.e_skipped.inc(skipped)
        return result

    async def _split(
        self, req: dict[str, Any], items: list[dict[str, Any]], uuids: list[str], req_id: str
    ) -> tuple[Decision, EncodeResult | None]:
        """Index / demand: the items held nowhere the chosen P could use go to E at arrival;
        the render and the plan (or P's answer) for the others run while E works, and what
        they add for E follows. None for the E result where the request was not split."""
        m, planner = self.metrics, self.planner
        ta = time.perf_counter()
        try:
            arrival = await planner.arrival(req, items, uuids)
        except Exception:  # a bug here costs the split, never the request
            logger.exception("[%s] arrival split failed; the request takes the whole path", req_id)
            m.errors.labels("arrival").inc()
            arrival = None
        if arrival is None:
            m.arrival_split("whole").inc()
            return await planner.decide(req, items, uuids), None
        early = self.encoders.start(req, items, arrival.now, req_id, uuids) if arrival.now else None
        te = time.perf_counter()
        m.stage["arrival"].observe(te - ta)
        now = len(arrival.now) + len(arrival.dup_of)
        m.arrival_items.labels("e_now").inc(now)
        m.arrival_items.labels("waited").inc(len(arrival.rest))
        m.arrival_split("none_new" if not now else "split" if arrival.rest else "all_new").inc()
        try:
            if arrival.rest:
                decision = await planner.decide(req, items, uuids, arrival=arrival)
            else:
                decision = planner.at_arrival(req, uuids, arrival)
            sent = set(arrival.now)
            later = [i for i in decision.e_indices if i not in sent]
            rest = await self.encoders.encode(req, items, later, req_id, uuids)
            first = EMPTY if early is None else await early.finish()
        except BaseException:
            if early is not None:
                early.cancel()
            raise
        result = EncodeResult(
            {**first.item_meta, **rest.item_meta},
            {**first.ec_params, **rest.ec_params},
            first.subrequests + rest.subrequests,
        )
        if decision.e_indices:
            m.stage["encode"].observe(time.perf_counter() - te)
            m.e_subrequests.inc(result.subrequests)
            m.e_sent.inc(len(decision.e_indices))
            planner.record_e(decision)
        skipped = len(items) - len(decision.e_indices)
        if skipped:
            m.e_skipped.inc(skipped)
        return decision, result

    async def _opportunistic(
        self, req: dict[str, Any], items: list[dict[str, Any]], uuids: list[str], req_id: str
    ) -> tuple[Decision, EncodeResult]:
        """E gets every item at once, as under eager, while the planner renders and asks P.
        An answer that comes while sub-requests are in flight abandons each one all of whose
        items the answer rules out (they go to P raw with their uuid); one that fails, or comes
        once E is done, changes nothing (eager)."""
        m, planner = self.metrics, self.planner
        n = len(items)
        loop = asyncio.get_running_loop()
        te = time.perf_counter()
        encoding = self.encoders.start(req, items, range(n), req_id, uuids)
        routed: asyncio.Future[int] = loop.create_future()
        first = planner.random_instance()
        deciding = asyncio.ensure_future(
            planner.decide(
                req,
                items,
                uuids,
                instance=first,
                on_routed=lambda i: None if routed.done() else routed.set_result(i),
            )
        )
        try:
            pending: list[asyncio.Future[Any]] = list(encoding.tasks)
            while pending and not deciding.done():
                await asyncio.wait([*pending, deciding], return_when=asyncio.FIRST_COMPLETED)
                pending = [t for t in pending if not t.done()]
            if not deciding.done():  # E is done first: as eager, where routing sends it
                either: list[asyncio.Future[Any]] = [routed, deciding]
                await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
                instance = routed.result() if routed.done() else first
                deciding.cancel()
                outcome = "answer_late"
                decision = planner.eager(items, instance)
            else:
                try:
                    decision = deciding.result()
                except Exception as e:  # decide handles its failures: a bug costs the plan only
                    logger.exception("[%s] opportunistic decision failed", req_id)
                    decision = dataclasses.replace(
                        planner.eager(items, first), no_plan=f"plan: {type(e).__name__}: {e}"
                    )
                outcome, decision = self._abandon(encoding, decision)
            result = await encoding.finish()
        except BaseException:
            encoding.cancel()
            deciding.cancel()
            raise
        m.opportunistic(outcome).inc()
        m.stage["encode"].observe(time.perf_counter() - te)
        m.e_subrequests.inc(result.subrequests)
        m.e_sent.inc(n)
        abandoned = len(decision.raw_with_uuid)
        if abandoned:
            m.e_abandoned.inc(abandoned)
        planner.record_e(decision)
        return decision, result

    def _abandon(self, encoding: Encoding, decision: Decision) -> tuple[str, Decision]:
        """Abandon the in-flight sub-requests `decision`'s answer rules out entirely; the
        outcome, and the decision as it now stands (E: what was not abandoned)."""
        answer = decision.answer
        if answer is None:
            return "answer_failed", decision
        wanted = {ident for ident, _ in answer.e_demand}
        ids = decision.identifiers
        dropped: list[int] = []
        for g, (_, batch) in enumerate(encoding.groups):
            if all(ids[i] not in wanted for i in batch) and encoding.abandon(g):
                dropped.extend(batch)
        gone = frozenset(dropped)
        kept = tuple(i for i in range(len(ids)) if i not in gone)
        decision = dataclasses.replace(decision, e_indices=kept, raw_with_uuid=gone, dup_of=None)
        return ("answer_won" if dropped else "answer_no_gain"), decision

    def _with_demand_id(self, body: Mapping[str, Any], demand_id: str | None) -> Mapping[str, Any]:
        """The P (or PD) body carrying `vllm_xargs.mmreuse_demand_id`, merged with the
        client's vllm_xargs (from which `_parse` removed any such id: it is the proxy's)."""
        if demand_id is None:
            return body
        xargs = body.get("vllm_xargs")
        if xargs is None:
            xargs = {}
        elif not isinstance(xargs, dict):  # vLLM refuses it: let P say so, unchanged
            return body
        return {**body, "vllm_xargs": {**xargs, DEMAND_ID_KEY: demand_id}}

    async def _prefill(
        self,
        req: Mapping[str, Any],
        p_url: str,
        req_id: str,
        demand_id: str | None = None,
        held_raw: frozenset[str] = frozenset(),
    ) -> Mapping[str, Any]:
        """E + P + D: P prefills (max_tokens 1, remote decode); D gets P's kv_transfer_params
        (and never the demand id: only P checks the answer). `held_raw`: the uuids of items
        sent raw because P was planned to hold them (`_reference_uuids`)."""
        tp = time.perf_counter()
        body = dict(self._with_demand_id(req, demand_id))
        body["kv_transfer_params"] = _kv_params()
        body["stream"] = False
        body["max_tokens"] = 1
        if "max_completion_tokens" in body:
            body["max_completion_tokens"] = 1
        body.pop("stream_options", None)
        try:
            async with self._session().post(
                chat_url(p_url),
                data=_encode.encode(body),
                headers={"x-request-id": req_id, "Content-Type": "application/json"},
            ) as resp:
                payload = await resp.read()
                status = resp.status
        except aiohttp.ClientError as e:
            raise ProxyError(
                502, {"error": "Prefill processing error", "message": str(e)}, stage="prefill"
            ) from e
        self.metrics.stage["prefill"].observe(time.perf_counter() - tp)
        if status != 200:
            text = payload.decode("utf-8", "replace")
            lost = _reference_uuids(body, held_raw) if status == 500 else frozenset()
            if lost and _request_error(payload):
                raise _EmbeddingLost("prefill", lost, text)  # P's connector: the store lost one
            logger.error("[%s] prefill returned %d: %s", req_id, status, text)
            raise ProxyError(
                status, {"error": "Prefill request failed", "message": text}, stage="prefill"
            )
        try:
            params = _decode.decode(payload).get("kv_transfer_params") or {}
        except Exception:
            params = {}
        if params:
            return {**req, "kv_transfer_params": params}
        return req

    async def _hold(self, resp: aiohttp.ClientResponse) -> tuple[bytes, str | None]:
        """Read a 200 stream up to its first token (vLLM's first events carry only the role),
        at most HOLD_BYTES: the bytes read, and vLLM's request-level error event (its data)
        when that is what came instead. Nothing has reached the client yet."""
        held = bytearray()
        start = 0  # where the first event not yet looked at begins
        while len(held) <= HOLD_BYTES:
            try:
                chunk = await resp.content.readany()
            except (TimeoutError, aiohttp.ClientError, ConnectionError):
                return bytes(held), None  # `_stream` forwards what came, then breaks as it did
            if not chunk:
                return bytes(held), None
            held += chunk
            while (end := _event_end(held, start)) is not None:
                event = held[start:end]
                start = end
                # Byte searches, no JSON, on this per-stream path: a comment or keep-alive has
                # no data; vLLM's preamble (every choice's first event) names the role, which
                # no token event does (the model's text is escaped); the error names its type.
                if b"data:" not in event or b'"role"' in event:
                    continue
                if b"InternalServerError" in event:
                    data = _event_data(event)
                    if data is not None and _request_error(data):
                        return bytes(held), data.decode("utf-8", "replace")
                return bytes(held), None
        return bytes(held), None

    async def _stream(
        self, request: web.Request, resp: aiohttp.ClientResponse, td: float, held: bytes = b""
    ) -> web.StreamResponse:
        """Forward decode's bytes as they come (no SSE parsing), after `held` (what `_hold`
        read); the status line goes out only now that decode has accepted the request."""
        out = web.StreamResponse(
            status=resp.status,
            headers={"Content-Type": resp.headers.get("Content-Type", "text/event-stream")},
        )
        await out.prepare(request)
        first = True
        chunk = held  # what `_hold` read goes out first, as one chunk
        while True:
            if not chunk:
                try:
                    chunk = await resp.content.readany()
                except (TimeoutError, aiohttp.ClientError, ConnectionError) as e:
                    # The status line is out: the one honest signal left is a broken stream
                    # (no terminating chunk), never a second response.
                    logger.error("decode stream broke after it started: %s", e)
                    self.metrics.errors.labels("decode").inc()
                    out.force_close()
                    if request.transport is not None:
                        request.transport.close()
                    out.mmreuse_outcome = "stream_broken"  # type: ignore[attr-defined]
                    return out
                if not chunk:
                    break
            if first:
                self.metrics.stage["decode"].observe(time.perf_counter() - td)
                first = False
            try:
                await out.write(chunk)
            except (ConnectionError, RuntimeError) as e:  # the client went away: not decode's
                logger.info("client left mid-stream: %s", e)
                out.mmreuse_outcome = "client_gone"  # type: ignore[attr-defined]
                return out
            chunk = b""
        try:
            await out.write_eof()
        except (ConnectionError, RuntimeError):
            out.mmreuse_outcome = "client_gone"  # type: ignore[attr-defined]
        return out

    def _observe_fallback(self, out: bytes, decision: Decision, view: InstanceView) -> None:
        """P's own count of cached prompt tokens (vLLM: --enable-prompt-tokens-details) below
        the plan's (or P's answer's) means a skipped item was served by P's cache, connector or
        encoder."""
        try:
            usage = _decode.decode(out).get("usage") or {}
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        except Exception:
            return
        known = decision.plan or decision.answer  # the C the decision counted on
        if isinstance(cached, int) and known is not None and cached < known.num_computed_tokens:
            self.metrics.fallbacks.labels(view.name, "kv_short").inc()

    # ---- the other routes ---------------------------------------------------------------------

    async def models(self, request: web.Request) -> web.Response:
        try:
            async with self._session().get(f"{self.config.decode_urls[0]}/v1/models") as resp:
                body = await resp.read()
                return web.Response(
                    body=body,
                    status=resp.status,
                    headers={"Content-Type": resp.headers.get("Content-Type", "application/json")},
                )
        except aiohttp.ClientError as e:
            return web.json_response({"detail": f"Proxy error: {e}"}, status=502)

    async def health(self, request: web.Request, *, detail: bool = True) -> web.Response:
        """The reference's fields (proxy, encode/prefill/decode cluster) and, with `detail`,
        mmreuse's: policy, problems, each view's and demand client's state."""

        async def cluster(urls: tuple[str, ...]) -> str:
            if not urls:
                return "empty"
            results = await asyncio.gather(*(self._probe(u) for u in urls))
            return "healthy" if all(results) else "unhealthy"

        cfg = self.config
        e, p, d = await asyncio.gather(
            cluster(cfg.encode_urls), cluster(cfg.prefill_urls), cluster(cfg.decode_urls)
        )
        ok = all(s != "unhealthy" for s in (e, p, d))
        views = {v.name: v.health() for v in self.views}
        e_views = {v.name: v.health() for v in self.e_views}
        problems = [
            f"{name}: {p}"
            for name, h in (*views.items(), *e_views.items())
            for p in h["problems"]  # type: ignore[attr-defined]
        ]
        if not cfg.policy.reads_view and cfg.routing == "random":
            problems = [p for p in problems if not p.endswith("no KV events endpoint")]
        store = self.store.health() if self.store is not None else None
        if store is not None and store["last_outcome"] not in (None, "ok"):
            problems.append(
                f"e store: last query {store['last_outcome']}: {store['last_error']} "
                "(planned with this proxy's own record meanwhile)"
            )
        demand = {c.name: c.health() for c in self.demand}
        for name, h in demand.items():
            if not h["running"]:
                problems.append(f"{name}: demand client not running ({h['endpoint']})")
            elif h["last_outcome"] not in (None, "ok"):
                problems.append(
                    f"{name}: last demand query {h['last_outcome']}: {h['last_detail']}"
                )
        body = {
            "proxy": "healthy",
            "encode_cluster": e,
            "prefill_cluster": p,
            "decode_cluster": d,
            "mmreuse": {
                "policy": cfg.policy,
                "routing": cfg.routing,
                "status": "degraded" if problems else "ok",
                "problems": problems,
                "e_side": self.e_side.health(),  # events, per-replica, or None (eager)
                "views": views,
                **({"e_views": e_views} if e_views else {}),
                **({"e_store": store} if store is not None else {}),
                **({"demand": demand} if demand else {}),
            },
        }
        if not detail:
            del body["mmreuse"]
        return web.json_response(body, status=200 if ok else 503)

    async def _probe(self, url: str) -> bool:
        try:
            async with self._session().get(
                f"{url}/health", timeout=aiohttp.ClientTimeout(total=5)
            ) as resp:
                return resp.status < 400
        except (TimeoutError, aiohttp.ClientError):
            return False

    async def metrics_route(self, request: web.Request) -> web.Response:
        return web.Response(
            body=generate_latest(self.registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )

    async def profile(self, request: web.Request) -> web.Response:
        """POST /start_profile, /stop_profile: to one random E, P and D; 404 = disabled."""
        cmd = request.path.strip("/").removesuffix("_profile")
        try:
            payload = await read_body(request)
        except ProxyError as err:
            return web.json_response({"detail": err.detail}, status=err.status)
        cfg = self.config
        headers = {"Authorization": f"Bearer {os.getenv('OPENAI_API_KEY', '')}"}

        async def one(urls: tuple[str, ...]) -> Any:
            if not urls:
                return None
            url = f"{random.choice(urls)}/{cmd}_profile"
            async with self._session().post(url, data=payload, headers={**headers, **_JSON}) as r:
                if r.status == 404:
                    return None
                if r.status >= 400:
                    raise ProxyError(r.status, await r.text(), stage="proxy")
                return msgspec.json.decode(await r.read() or b"null")

        try:
            e, p, d = await asyncio.gather(
                one(cfg.encode_urls), one(cfg.prefill_urls), one(cfg.decode_urls)
            )
        except ProxyError as err:
            return web.json_response({"detail": err.detail}, status=err.status)
        if e is None and p is None and d is None:
            return web.json_response(
                {"detail": "Profiling endpoints are disabled on all clusters"}, status=503
            )
        return web.json_response({"encode": e, "prefill": p, "decode": d})


def _outcome(status: int) -> str:
    return "ok" if status < 400 else "client_error" if status < 500 else "server_error"


# vLLM's answer to a request its scheduler finished with FinishReason.ERROR (`_raise_if_error`,
# 0.32 and 0.33): this error, as a 500's body or as an event of a 200 stream. An EC connector
# fails a request so when it can no longer obtain an encoder input (`take_unavailable_requests`:
# MooncakeStoreConnector, for an item P had only as E's reference that the store lost); vLLM
# carries no finer reason to the client.
_REQUEST_ERROR = {"message": "Internal server error", "type": "InternalServerError", "code": 500}
HOLD_BYTES = 1 << 20  # a stream held for its first token: at most this much, then forwarded


class _EmbeddingLost(Exception):
    """P (or PD) failed a request that carried E's references (`uuids`), with vLLM's
    request-level error: the store lost one between E's put and P's load. `stage`: prefill
    (E + P + D's P), decode (a 500) or stream (the error event of a 200 stream)."""

    def __init__(self, stage: str, uuids: frozenset[str], detail: str) -> None:
        super().__init__(stage, detail)
        self.stage, self.uuids, self.detail = stage, uuids, detail


def _request_error(payload: bytes | str) -> bool:
    """Whether `payload` (a JSON body, or one event's data) is vLLM's request-level error."""
    try:
        error = _decode.decode(payload).get("error")
    except Exception:
        return False
    return isinstance(error, dict) and all(error.get(k) == v for k, v in _REQUEST_ERROR.items())


def _uuids_at(uuids: Sequence[str], indices: frozenset[int]) -> frozenset[str]:
    return frozenset(uuids[i] for i in indices if isinstance(uuids[i], str))


def _reference_uuids(
    body: Mapping[str, Any], held_raw: frozenset[str] = frozenset()
) -> frozenset[str]:
    """The uuids of the items P may find only by their uuid: a metadata-only `*_embeds` part
    in `body` (E's reference, the rewrite's: a client's is refused), which P cannot encode if
    the store lost it, and `held_raw`, the items sent raw because P was planned to hold them,
    whose uuid P's processor cache may map to such a reference from an earlier request."""
    out: set[str] = set(held_raw)
    for msg in body.get("messages") or ():
        content = msg.get("content") if isinstance(msg, dict) else None
        for part in content if isinstance(content, list) else ():
            kind = part.get("type") if isinstance(part, dict) else None
            payload = part.get(kind) if kind in EMBEDS_PARTS else None
            if isinstance(payload, dict) and not any(type(v) is str for v in payload.values()):
                uuid = part.get("uuid")
                if isinstance(uuid, str):
                    out.add(uuid)
    return frozenset(out)


def _event_end(buf: bytearray, start: int) -> int | None:
    """The end (past its blank line) of the SSE event starting at `start`, None if incomplete."""
    lf, crlf = buf.find(b"\n\n", start), buf.find(b"\r\n\r\n", start)
    if lf < 0 and crlf < 0:
        return None
    return lf + 2 if crlf < 0 or 0 <= lf < crlf else crlf + 4


def _event_data(event: bytes | bytearray) -> bytes | None:
    """An SSE event's data (its `data:` lines joined), None when it has none."""
    lines = [
        line[5:].removeprefix(b" ")
        for line in bytes(event).splitlines()
        if line.startswith(b"data:")
    ]
    return b"\n".join(lines) if lines else None


@web.middleware
async def _log_requests(request: web.Request, handler: Any) -> web.StreamResponse:
    req_id = request.headers.get("x-request-id", "-")
    logger.info(">>> [%s] %s %s from %s", req_id, request.method, request.path, request.remote)
    response = await handler(request)
    logger.info("<<< [%s] %s %s completed with status %d", req_id, request.method, request.path, response.status)  # fmt: skip
    return response


def build_app(config: ProxyConfig, *, after_decide: AfterDecide | None = None) -> web.Application:
    """The aiohttp application for `config` (its proxy at `app[PROXY_KEY]`)."""
    proxy = Proxy(config, after_decide=after_decide)
    app = web.Application(
        middlewares=[_log_requests] if config.log_requests else [],
        client_max_size=config.max_body_bytes,  # multi-image requests carry base64 media
    )
    app[PROXY_KEY] = proxy
    app.on_startup.append(proxy.start)
    app.on_cleanup.append(proxy.stop)
    app.router.add_post("/v1/chat/completions", proxy.chat)
    app.router.add_get("/v1/models", proxy.models)
    separate = config.metrics_port is not None  # then the facts are on the metrics app only
    app.router.add_get("/health", functools.partial(proxy.health, detail=not separate))
    if not separate:
        app.router.add_get("/metrics", proxy.metrics_route)
    app.router.add_post("/start_profile", proxy.profile)
    app.router.add_post("/stop_profile", proxy.profile)
    return app


def build_metrics_app(proxy: Proxy) -> web.Application:
    """GET /metrics and the detailed GET /health of `proxy`, for --metrics-port."""
    app = web.Application()
    app.router.add_get("/metrics", proxy.metrics_route)
    app.router.add_get("/health", proxy.health)
    return app


class StartupFailed(Exception):
    """The proxy could not start (a flag that parsed but cannot be used, a port in use): its
    message is the one line `mmreuse proxy` prints."""


def event_loop_runner() -> Callable[[Any], Any]:
    """uvloop.run when installed (as the reference's uvicorn does), else asyncio.run."""
    try:
        import uvloop

        return uvloop.run
    except ImportError:  # pragma: no cover - uvloop is in the [proxy] extra
        return asyncio.run


def setup_logging(config: ProxyConfig, prefix: str = "") -> None:
    logging.basicConfig(
        level=logging.DEBUG if config.log_requests else logging.INFO,
        format=f"%(asctime)s {prefix}%(levelname)s: %(message)s",
    )


def run(config: ProxyConfig) -> None:
    """Serve until interrupted; raises StartupFailed if the proxy cannot start, after
    stopping what had started. `config.workers` > 1: that many worker processes
    (`mmreuse.proxy.workers`)."""
    if config.workers > 1:
        from .workers import run_workers

        run_workers(config)
        return
    setup_logging(config)
    with contextlib.suppress(KeyboardInterrupt):
        event_loop_runner()(serve(config))


async def serve(
    config: ProxyConfig,
    *,
    reuse_port: bool = False,
    metrics_path: str | None = None,
    ready: Callable[[], None] | None = None,
) -> None:
    """Serve `config` until cancelled. `reuse_port`: bind --port with SO_REUSEPORT (a worker);
    `metrics_path`: /metrics and the detailed /health on that unix socket instead of
    --metrics-port (what a worker's supervisor reads); `ready`: called once serving."""
    app = build_app(config)
    app_runner = web.AppRunner(app, access_log=None, **SERVER_SETTINGS)
    metrics_runner = web.AppRunner(build_metrics_app(app[PROXY_KEY]), access_log=None)
    serving = False  # the serving port is bound
    try:
        try:
            await app_runner.setup()  # the proxy's start: views, subscribers, clients
            site = web.TCPSite(
                app_runner, config.host, config.port, backlog=4096, reuse_port=reuse_port or None
            )
            await site.start()
            serving = True
            if metrics_path is not None:
                await metrics_runner.setup()
                await web.UnixSite(metrics_runner, metrics_path).start()
            elif config.metrics_port is not None:
                host = config.metrics_host or config.host
                await metrics_runner.setup()
                await web.TCPSite(metrics_runner, host, config.metrics_port).start()
        except InvalidArgument as e:
            raise StartupFailed(str(e)) from e
        except OSError as e:  # the port is taken, the host does not resolve, ...
            where = (
                f"{config.host}:{config.port}"
                if not serving
                else metrics_path or f"{config.metrics_host or config.host}:{config.metrics_port}"
            )
            raise StartupFailed(f"cannot listen on {where}: {e.strerror or e}") from e
        logger.info(
            "mmreuse proxy on %s:%d (policy %s, routing %s): E %s, P %s, D %s",
            config.host, config.port, config.policy, config.routing,
            list(config.encode_urls), list(config.prefill_urls), list(config.decode_urls),
        )  # fmt: skip
        if ready is not None:
            ready()
        await asyncio.Event().wait()
    finally:
        await metrics_runner.cleanup()
        await app_runner.cleanup()  # what started is stopped, the client session closed
