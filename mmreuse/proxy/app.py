"""The proxy's chat route: POST /v1/chat/completions (streaming or not), as the reference
serves it, calling E, P and D over `upstream.Upstream`'s keep-alive connections (the other
backend calls: aiohttp's client; the server is `proxy.server`, the other routes `proxy.health`).

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
import dataclasses
import functools
import logging
import random
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import aiohttp
import msgspec
import yarl
from aiohttp import web
from prometheus_client import CollectorRegistry

from ..availability import EmbeddingAvailability
from ..decision import ItemClass, Policy
from ..demand_query import DEMAND_ID_KEY  # P reads it from vllm_xargs
from . import body as bodies
from .body import Blobs, BodyLimits, encode_body
from .config import HeldItems, ProxyConfig, UuidPolicy
from .content import MediaFetcher, MediaLimits, name_by_content
from .demand import DemandClient
from .encoder import (
    E_COPIED_KEYS,
    EMPTY,
    EncodeResult,
    EncoderFanout,
    Encoding,
    chat_url,
    new_hex,
    new_uuid4,
)
from .errors import ProxyError
from .eside import ESide
from .media import (
    EMBEDS_PARTS,
    check_cache_salt,
    item_uuid,
    namespace_uuids,
    rewrite_for_decode,
    scan_parts,
)
from .metrics import ProxyMetrics
from .models import ModelCatalog
from .policy import Decision, Planner
from .references import HeldReferences
from .store import StoreTruth
from .upstream import Upstream, UpstreamResponse
from .views import EncoderView, InstanceView

logger = logging.getLogger("mmreuse.proxy")

_decode = msgspec.json.Decoder()
_JSON = {"Content-Type": "application/json"}
# The proxy's own channel to P and D: a client's values would reach them verbatim (a connector
# handle naming a host of its choosing, an embedding cached under an identifier others share).
CLIENT_FIELDS_STRIPPED = ("ec_transfer_params", "kv_transfer_params")
_ABSENT = object()
# A body larger than this is scanned, decoded, walked and named off the event loop (a thread;
# its inline media is never decoded: `proxy.body`). Smaller ones cost less than the thread hop.
OFF_LOOP_BYTES = 1 << 20


async def read_body(request: web.Request) -> bytes | bytearray:
    """The request's body as sent, at most --max-body-bytes (`proxy.body.read_body`)."""
    return await bodies.read_body(request, request.client_max_size)


AfterDecide = Callable[[Decision], Awaitable[None]]


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
        self.upstream: Upstream | None = None  # E's, P's and D's POSTs (the rest: session)
        self.media_session: aiohttp.ClientSession | None = None  # --uuid-policy content's
        self.media = MediaFetcher(config.media or MediaLimits(), self._fetch_media)
        self.limits = BodyLimits(
            config.max_body_bytes, config.max_body_values, config.max_body_text_bytes
        )
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
        # --held-items reference: E's metadata per item, to send a P-held item as a reference
        self.references = HeldReferences() if config.held_items is HeldItems.REFERENCE else None
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
                    instance.demand,
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
            references=self.references,
        )
        self.encoders = EncoderFanout(
            config.encode_urls,
            self._upstream,
            max_batch_size=config.encoder_max_batch_size,
            no_rewrite=config.no_rewrite,
        )
        self.after_decide = after_decide

    # ---- lifecycle ----------------------------------------------------------------------------

    async def start(self, _app: web.Application | None = None) -> None:
        # vLLM closes an idle keep-alive connection after VLLM_HTTP_TIMEOUT_KEEP_ALIVE seconds
        # (ProxyConfig.backend_keep_alive_s); reusing one it has closed fails the request.
        # Retire ours first.
        keep_alive = self.config.backend_keep_alive_s
        connector = aiohttp.TCPConnector(
            limit=0,
            **({"keepalive_timeout": keep_alive / 2} if keep_alive > 0 else {"force_close": True}),
        )
        self.session = aiohttp.ClientSession(
            connector=connector,
            timeout=aiohttp.ClientTimeout(),  # none: the reference's 100,000 s, without timers
            skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding"),
        )
        self.upstream = Upstream(keep_alive / 2 if keep_alive > 0 else None)
        if self.config.uuid_policy == UuidPolicy.CONTENT:
            from .content import media_session  # no cookies; only checked addresses

            self.media_session = media_session(self.media.limits)
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
        if self.upstream is not None:
            await self.upstream.close()
        if self.media_session is not None:
            await self.media_session.close()

    def _session(self) -> aiohttp.ClientSession:
        assert self.session is not None, "Proxy.start() first"
        return self.session

    def _upstream(self) -> Upstream:
        assert self.upstream is not None, "Proxy.start() first"
        return self.upstream

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
        """POST `body` (a request's, its inline media spliced in) as JSON: status, answer."""
        resp = await self._upstream().post(_url(url), await encode_body(body), _JSON)
        try:
            return resp.status, await resp.read()
        finally:
            resp.release()

    # ---- POST /v1/chat/completions ------------------------------------------------------------

    async def chat(self, request: web.Request) -> web.StreamResponse:
        t0 = time.perf_counter()
        m = self.metrics
        policy = self.config.policy
        try:
            response = await self._chat(request)
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
        finally:
            if bodies.CURRENT.get() is not None:  # set by `_chat` for a large body
                bodies.CURRENT.set(None)
        outcome = getattr(response, "mmreuse_outcome", None) or _outcome(response.status)
        m.request(policy, outcome).inc()
        m.stage["total"].observe(time.perf_counter() - t0)
        return response

    def _parse(self, body: bytes | bytearray) -> _Read:
        """The client's request (`proxy.body.decode`, within --max-body-*), without the fields
        only the proxy may set, its media parts as vLLM classifies them (`scan_parts`: the
        parts themselves, so the naming is in place) and, unless --uuid-policy content names
        them by their fetched bytes, their uuids; a 400 for what cannot be passed on, before
        any per-item work."""
        req, blobs = bodies.decode(body, self.limits, keep=len(body) > OFF_LOOP_BYTES)
        if not isinstance(req, dict):
            raise ProxyError(400, "The body must be a JSON object", stage="proxy")
        for key in CLIENT_FIELDS_STRIPPED:
            if req.pop(key, _ABSENT) is not _ABSENT:
                self.metrics.stripped(key).inc()
        xargs = req.get("vllm_xargs")
        if isinstance(xargs, dict) and DEMAND_ID_KEY in xargs:  # the proxy's channel to P
            req["vllm_xargs"] = {k: v for k, v in xargs.items() if k != DEMAND_ID_KEY}
            self.metrics.stripped(f"vllm_xargs.{DEMAND_ID_KEY}").inc()
        if "cache_salt" in req:  # vLLM refuses a bad one: before naming hashes it per item
            check_cache_salt(req)
        items = scan_parts(req, self.config.limit_mm_per_prompt)
        if items and not req.keys().isdisjoint(E_COPIED_KEYS):
            self.encoders.check_shared(req, items, len(body), blobs)
        if self.config.uuid_policy == UuidPolicy.CONTENT:
            return req, items, None, blobs  # named by their bytes (`_read`)
        if self.config.uuid_policy == UuidPolicy.TENANT:
            namespace_uuids(req, blobs)
        return req, items, [item_uuid(item, blobs) for item in items], blobs

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        """Read, decide, then encode, prefill and decode (`_forward`)."""
        req, items, uuids, blobs = await self._read(request)
        if blobs is not None:  # a large body: its inline media spliced into, and its bodies
            bodies.CURRENT.set(blobs)  # built for E, P and D off the loop (`bodies.CURRENT`)
        req_id = request.headers.get("x-request-id")
        if req_id is None:  # as the reference: an empty header stays empty
            req_id = new_uuid4()
        decision, encoded = await self._decide(req, items, uuids, req_id)
        if self.after_decide is not None:
            await self.after_decide(dataclasses.replace(decision, request_id=req_id))
        return await self._forward(request, req, items, uuids, decision, encoded, req_id)

    async def _read(
        self, request: web.Request
    ) -> tuple[dict[str, Any], list[dict[str, Any]], list[str], Blobs | None]:
        """The client's request, its media parts and their uuids (`_parse`, named by
        --uuid-policy), and its inline media."""
        raw = await bodies.read_body(request, self.limits.max_bytes)
        big = len(raw) > OFF_LOOP_BYTES  # its scan, decode, walk and hashes: in a thread
        req, items, uuids, blobs = (
            await asyncio.to_thread(self._parse, raw) if big else self._parse(raw)
        )
        del raw
        if uuids is None:  # --uuid-policy content
            tm = time.perf_counter()
            fetched, blobs = await name_by_content(req, self.media, blobs, off_loop=big)
            self.metrics.stage["media"].observe(time.perf_counter() - tm)
            if fetched:
                self.metrics.media_fetched.inc(fetched)
            uuids = [item_uuid(item) for item in items]  # each named by its bytes now
        return req, items, uuids, blobs

    async def _decide(
        self, req: dict[str, Any], items: list[dict[str, Any]], uuids: list[str], req_id: str
    ) -> tuple[Decision, EncodeResult | None]:
        """The policy's decision, and E's answers when they are already in (opportunistic, the
        arrival split); its facts counted."""
        m = self.metrics
        encoded: EncodeResult | None = None
        if self.config.policy is Policy.OPPORTUNISTIC and items:
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
        classes = decision.dispatch.classes
        if classes:
            for item_class in set(classes):
                m.occurrence(item_class).inc(classes.count(item_class))
        return decision, encoded

    async def _forward(
        self,
        request: web.Request,
        req: dict[str, Any],
        items: list[dict[str, Any]],
        uuids: list[str],
        decision: Decision,
        encoded: EncodeResult | None,
        req_id: str,
    ) -> web.StreamResponse:
        """Encode, prefill and decode as decided; a decode 500 retried by re-encoding
        everything (--decode-retries), a lost embedding once (`_after_loss`)."""
        cfg = self.config
        if cfg.prefill_urls:
            p_url: str | None = cfg.prefill_urls[decision.instance]
            d_url = cfg.decode_urls[self.rng.randrange(len(cfg.decode_urls))]
        else:
            p_url, d_url = None, cfg.decode_urls[decision.instance]
        view = self.views[decision.instance]
        current, ready = decision, encoded  # E's answers serve the first attempt only
        attempt = 0  # decode 500s retried so far (--decode-retries)
        relost = False  # the one retry of a request whose reference the store lost
        sent = uuids  # the items' uuids at E and P (a lost item's is fresh on its retry)
        stream = bool(req.get("stream", False))
        while True:
            try:
                body = await self._prepare(req, items, sent, current, req_id, p_url, ready)
                ready = None
                # PD may have items only as E's reference, or raw under a uuid its processor
                # cache may hold as one (an item planned as held): its connector fails the
                # request if the store lost one (E + P + D: `_prefill` checks P's answer)
                refs = (
                    p_url is None
                    and bool(current.dispatch.e_items or current.dispatch.raw_items)
                    and not cfg.no_rewrite
                )
                # (on the retry nothing is taken for lost: P's answer is the client's)
                held_raw = frozenset() if relost else _uuids_at(sent, current.dispatch.raw_items)
                td = time.perf_counter()
                resp = await self._upstream().post(
                    chat_url(d_url),
                    await encode_body(body),
                    {"x-request-id": req_id, "Content-Type": "application/json"},
                )
                try:
                    if resp.status == 500:
                        detail = await resp.text()
                        lost: frozenset[str] = frozenset()
                        if refs and _request_error(detail):
                            lost = _reference_uuids(body, held_raw)
                        if lost:
                            raise _EmbeddingLost("decode", lost, detail)
                        if attempt < cfg.decode_retries:
                            attempt += 1
                            logger.warning(
                                "[%s] decode returned 500, re-encoding and retrying (attempt "
                                "%d/%d): %s",
                                req_id, attempt, cfg.decode_retries, detail[:200],
                            )  # fmt: skip
                            self.metrics.fallbacks.labels(view.name, "retry").inc()
                            current = self.planner.eager(items, decision.instance)
                            continue
                    return await self._answer(
                        request, resp, body, refs, held_raw, current, view, td, req_id, stream
                    )
                finally:
                    resp.release()
            except _EmbeddingLost as lost:
                sent, current = self._after_loss(lost, relost, sent, current, view, req_id)
                relost = True

    async def _answer(
        self,
        request: web.Request,
        resp: UpstreamResponse,
        body: Mapping[str, Any],
        refs: bool,
        held_raw: frozenset[str],
        decision: Decision,
        view: InstanceView,
        td: float,
        req_id: str,
        stream: bool,
    ) -> web.StreamResponse:
        """The client's answer from decode's (not a retried 500): its error, its stream (held
        for its first token where it may carry vLLM's error for a lost reference: `refs`), or
        its JSON."""
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
        self.metrics.stage["decode"].observe(time.perf_counter() - td)
        if decision.dispatch.raw_items and (decision.plan or decision.answer) is not None:
            self._observe_fallback(out, decision, view)
        return web.Response(
            body=out,
            status=resp.status,
            headers={"Content-Type": resp.headers.get("content-type", "application/json")},
        )

    def _after_loss(
        self,
        lost: _EmbeddingLost,
        relost: bool,
        sent: list[str],
        current: Decision,
        view: InstanceView,
        req_id: str,
    ) -> tuple[list[str], Decision]:
        """The uuids and decision of the one retry of a request whose embedding the store
        lost: E encodes the lost items again under a fresh uuid, P gets them raw. A 500 if
        this was the retry already (`relost`)."""
        stage = "prefill" if lost.stage == "prefill" else "decode"
        if relost:  # lost again, though P got each such item raw: not retried twice
            logger.error(
                "[%s] %s failed again after the store lost an embedding: %s",
                req_id, lost.stage, lost.detail[:200],
            )  # fmt: skip
            raise ProxyError(500, lost.detail, stage=stage) from None
        self.metrics.embedding_lost_retries.labels(view.name, lost.stage).inc()
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
            current, dispatch=current.dispatch.resend(again), demand_id=None
        )
        return sent, current

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
        shares = decision.dispatch.shares
        raw_items = decision.dispatch.raw_items
        if shares:
            item_meta = dict(item_meta)
            for dup, first in shares.items():
                if first in item_meta:  # shares the first's embedding: one transfer
                    item_meta[dup] = [{**f, "transfer_id": None} for f in item_meta[first]]
        if self.references is not None:
            item_meta, raw_items = self._held_references(req, uuids, item_meta, decision)
        if self.config.no_rewrite:
            prepared: Mapping[str, Any] = req
        else:
            args = (req, item_meta, raw_items, uuids, items)
            if bodies.CURRENT.get() is None:  # a small body: on the loop (`bodies.CURRENT`)
                prepared = rewrite_for_decode(*args)
            else:
                prepared = await asyncio.to_thread(rewrite_for_decode, *args)
        if result.ec_params:
            handles = dict(prepared.get("ec_transfer_params") or {})
            handles.update(result.ec_params)
            prepared = {**prepared, "ec_transfer_params": handles}
        if p_url is None:
            return self._with_demand_id(prepared, decision.demand_id)
        held_raw = _uuids_at(uuids, decision.dispatch.raw_items)
        return await self._prefill(prepared, p_url, req_id, decision.demand_id, held_raw)

    def _held_references(
        self,
        req: Mapping[str, Any],
        uuids: list[str],
        item_meta: Mapping[int, list[dict[str, Any]]],
        decision: Decision,
    ) -> tuple[dict[int, list[dict[str, Any]]], frozenset[int]]:
        """--held-items reference: E's metadata kept for what E just encoded, and each item P
        is to hold sent as the reference kept for it (no longer raw): the features to rewrite
        and the items still raw. An item E encodes again (a retry) stays as E answered; so
        does one the decision did not place where P's order finds it without media
        (`_servable`)."""
        assert self.references is not None
        self.references.record(req, uuids, item_meta)
        classes = decision.dispatch.classes
        held = frozenset(
            i
            for i in decision.dispatch.raw_items - item_meta.keys()
            if i < len(classes) and _servable(classes[i], uuids[i], decision.in_store)
        )
        found = self.references.lookup(req, uuids, held) if held else {}
        view = self.views[decision.instance].name
        if found:
            self.metrics.held_items.labels(view, "reference").inc(len(found))
        raw = len(decision.dispatch.raw_items - item_meta.keys()) - len(found)
        if raw:
            self.metrics.held_items.labels(view, "raw").inc(raw)
        if not found:
            return dict(item_meta), decision.dispatch.raw_items
        return {**item_meta, **found}, decision.dispatch.raw_items - found.keys()

    async def _encode(
        self,
        req: dict[str, Any],
        items: list[dict[str, Any]],
        uuids: list[str],
        decision: Decision,
        req_id: str,
    ) -> EncodeResult:
        """E encodes the decision's e_items (the counts: sent, skipped, sub-requests)."""
        m = self.metrics
        te = time.perf_counter()
        result = EncodeResult({}, {}, 0)
        e_items = decision.dispatch.e_items
        if e_items:
            result = await self.encoders.encode(req, items, e_items, req_id, uuids)
            m.stage["encode"].observe(time.perf_counter() - te)
            m.e_subrequests.inc(result.subrequests)
            self.planner.record_e(decision)
        if e_items:
            m.e_sent.inc(len(e_items))
        skipped = len(items) - len(e_items)
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
        arrival = planner.on_p(arrival)
        if arrival.on_p:
            m.arrival_items.labels("p_encodes").inc()
        early = self.encoders.start(req, items, arrival.now, req_id, uuids) if arrival.now else None
        te = time.perf_counter()
        m.stage["arrival"].observe(te - ta)
        now = len(arrival.now) + len(arrival.shares)
        m.arrival_items.labels("e_now").inc(now)
        at_once = planner.at_once(arrival)  # decided here: no render, no plan
        if not at_once:
            m.arrival_items.labels("waited").inc(len(arrival.rest))
        elif arrival.stored:  # --held-items reference: each as E's reference, from the store
            m.arrival_items.labels("p_stored").inc(len(arrival.rest))
        elif arrival.rest and not arrival.on_p:  # --mixed-plan arrival
            m.arrival_items.labels("p_raw").inc(len(arrival.rest))
        m.arrival_split("none_new" if not now else "split" if arrival.rest else "all_new").inc()
        try:
            if at_once:
                decision = planner.at_arrival(req, uuids, arrival)
            else:
                decision = await planner.decide(req, items, uuids, arrival=arrival)
            sent = set(arrival.now)
            later = [i for i in decision.dispatch.e_items if i not in sent]
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
        e_items = decision.dispatch.e_items
        if e_items:
            m.stage["encode"].observe(time.perf_counter() - te)
            m.e_subrequests.inc(result.subrequests)
            m.e_sent.inc(len(e_items))
            planner.record_e(decision)
        skipped = len(items) - len(e_items)
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
        abandoned = len(decision.dispatch.raw_items)
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
        decision = dataclasses.replace(decision, dispatch=decision.dispatch.abandon(dropped))
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
            resp = await self._upstream().post(
                chat_url(p_url),
                await encode_body(body),
                {"x-request-id": req_id, "Content-Type": "application/json"},
            )
            try:
                payload = await resp.read()
                status = resp.status
            finally:
                resp.release()
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

    async def _hold(self, resp: UpstreamResponse) -> tuple[bytes, str | None]:
        """Read a 200 stream up to its first token (vLLM's first events carry only the role),
        at most HOLD_BYTES: the bytes read, and vLLM's request-level error event (its data)
        when that is what came instead. Nothing has reached the client yet."""
        held = bytearray()
        start = 0  # where the first event not yet looked at begins
        while len(held) <= HOLD_BYTES:
            try:
                chunk = await resp.readany()
            except (TimeoutError, aiohttp.ClientError, ConnectionError):
                return bytes(held), None  # `_stream` forwards what came, then breaks as it did
            if not chunk:
                return bytes(held), None
            held += chunk
            while (end := _event_end(held, start)) is not None:
                event = held[start:end]
                start = end
                # Byte searches, no JSON, on this per-stream path: a comment or keep-alive has
                # no data; vLLM's preamble (every choice's first event) is a delta that starts
                # with the role (DeltaMessage's first field), which no token event is (a token
                # "role" is `"delta":{"content":"role"}`; the model's text is escaped); the
                # error names its type.
                if b"data:" not in event or _PREAMBLE in event or _PREAMBLE_SPACED in event:
                    continue
                if b"InternalServerError" in event:
                    data = _event_data(event)
                    if data is not None and _request_error(data):
                        return bytes(held), data.decode("utf-8", "replace")
                return bytes(held), None
        return bytes(held), None

    async def _stream(
        self, request: web.Request, resp: UpstreamResponse, td: float, held: bytes = b""
    ) -> web.StreamResponse:
        """Forward decode's bytes as they come (no SSE parsing), after `held` (what `_hold`
        read); the status line goes out only now that decode has accepted the request."""
        out = web.StreamResponse(
            status=resp.status,
            headers={"Content-Type": resp.headers.get("content-type", "text/event-stream")},
        )
        await out.prepare(request)
        first = True
        chunk = held  # what `_hold` read goes out first, as one chunk
        while True:
            if not chunk:
                try:
                    chunk = await resp.readany()
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


_Read = tuple[dict[str, Any], list[dict[str, Any]], list[str] | None, Blobs | None]


@functools.lru_cache(maxsize=256)
def _url(url: str) -> yarl.URL:
    return yarl.URL(url)


def _outcome(status: int) -> str:
    return "ok" if status < 400 else "client_error" if status < 500 else "server_error"


# vLLM's answer to a request its scheduler finished with FinishReason.ERROR (`_raise_if_error`,
# 0.32 and 0.33): this error, as a 500's body or as an event of a 200 stream. An EC connector
# fails a request so when it can no longer obtain an encoder input (`take_unavailable_requests`:
# MooncakeStoreConnector, for an item P had only as E's reference that the store lost); vLLM
# carries no finer reason to the client.
_REQUEST_ERROR = {"message": "Internal server error", "type": "InternalServerError", "code": 500}
HOLD_BYTES = 1 << 20  # a stream held for its first token: at most this much, then forwarded
_PREAMBLE = b'"delta":{"role"'  # vLLM's first event of a choice (pydantic's compact JSON)
_PREAMBLE_SPACED = b'"delta": {"role"'  # ... as Python's json.dumps spaces it


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


def _servable(item_class: ItemClass, uuid: str, in_store: frozenset[str]) -> bool:
    """Whether P serves an item of `item_class` sent as a reference (no media): from its KV
    (kv_covered, no_embeds) or its EC connector (p_external; p_local where the store holds it
    too, since MooncakeStoreConnector fails a reference the store lost before P's encoder
    cache is looked at). An unclassified item (decided at arrival, no plan) only where the
    store was seen to hold it."""
    if item_class.covered or item_class is ItemClass.P_EXTERNAL:
        return True
    return item_class in _STORE_PROVEN and uuid in in_store


# the classes a reference may be sent for where the store was seen to hold the item: p_local
# (P's encoder cache holds it, but the connector asks the store first) and unclassified (decided
# at arrival on the store's word alone: `Arrival.stored`)
_STORE_PROVEN = frozenset((ItemClass.P_LOCAL, ItemClass.UNCLASSIFIED))


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
