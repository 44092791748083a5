"""Step 3 of the chat route: forward. Encode what E must (unless the flow did), rewrite the
body for P (`media.rewrite_for_decode`), prefill (E + P + D), decode, and answer the client.

Two retries live here, each over a fresh `Attempt`: a decode 500 is retried by re-encoding
everything (--decode-retries), and a request whose E embedding the store lost is retried once
(E encodes it again under a fresh uuid, P gets it raw). Unlike the reference, a streaming client
gets its status line only once the decode instance has accepted the request, so an E, P or D
failure is an HTTP error, not a broken 200 stream; a stream that breaks later, or that the
request's deadline cuts, ends with an error event. The instances a decision is sent to are
chosen in one place (`Forwarder.route`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import time
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import aiohttp
import msgspec
from aiohttp import web

from ..decision import ItemClass
from ..demand_query import DEMAND_ID_KEY  # P reads it from vllm_xargs
from . import body as bodies
from .body import encode_body
from .config import ProxyConfig
from .encoder import EncodeResult, chat_url
from .errors import ProxyError
from .failover import FAILED_CONNECTION, Ejections, choose
from .flows import Decided, EWork
from .ids import new_hex
from .media import EMBEDS_PARTS, rewrite_for_decode
from .records import Decision
from .references import HeldReferences
from .request import ClientRequest
from .upstream import Upstream, UpstreamResponse
from .views import InstanceView

logger = logging.getLogger("mmreuse.proxy")

_decode = msgspec.json.Decoder()


def _kv_params() -> dict[str, Any]:
    return {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }


class Attempt(NamedTuple):
    """One try at P and D (a NamedTuple: one per request, on the hot path).

    Attributes:
        decision: what E and P get this time (the flow's, then a retry's).
        uuids: the items' uuids at E and P (a lost item's is fresh on its retry).
        encoded: E's answers already in (the first attempt only; None: encode now).
        retries: decode 500s retried so far (--decode-retries).
        relost: this is the one retry of a request whose embedding the store lost.
        failed_over: this is the one try on another instance after one's connection failed.
    """

    decision: Decision
    uuids: list[str]
    encoded: EncodeResult | None = None
    retries: int = 0
    relost: bool = False
    failed_over: bool = False


class Sent(NamedTuple):
    """What decode was sent in an attempt, to read its answer by.

    Attributes:
        body: decode's body.
        refs: P may have items only as E's reference (a lost one fails the request).
        held_raw: the uuids of items sent raw because P was planned to hold them.
        decision: the attempt's decision.
        started: when decode was sent (perf_counter).
    """

    body: Mapping[str, Any]
    refs: bool
    held_raw: frozenset[str]
    decision: Decision
    started: float


class Forwarder:
    """The forward loop: owns the connections to E, P and D (`upstream`), and the retries."""

    def __init__(
        self,
        config: ProxyConfig,
        upstream: Upstream,
        e_work: EWork,
        views: Sequence[InstanceView],
        references: HeldReferences | None,
        rng: random.Random,
        health: tuple[Ejections, Ejections],
    ) -> None:
        """`health`: which P's (or PD's) and D's are up (`failover.Ejections`; in E + PD the
        same one twice)."""
        self.config = config
        self.p_health, self.d_health = health
        self.upstream = upstream
        self.e_work = e_work
        self.planner = e_work.planner
        self.metrics = e_work.metrics
        self.views = views
        self.references = references
        self.rng = rng

    async def close(self) -> None:
        await self.upstream.close()

    def route(self, decision: Decision) -> tuple[str | None, str]:
        """Where the decision goes: its P (None where the PD does both) and a D at random
        (E + P + D). The one place an instance is chosen per role."""
        cfg = self.config
        if cfg.prefill_urls:
            d_url = cfg.decode_urls[choose(self.rng, len(cfg.decode_urls), self.d_health)]
            return cfg.prefill_urls[decision.instance], d_url
        return None, cfg.decode_urls[decision.instance]

    async def forward(
        self,
        request: web.Request,
        client: ClientRequest,
        decided: Decided,
        deadline: asyncio.Timeout | None = None,
    ) -> web.StreamResponse:
        """Encode, prefill and decode as decided; a decode 500 retried by re-encoding
        everything (--decode-retries), a lost embedding once (`_after_loss`). `deadline`: the
        request's (--request-timeout), which a stream takes over once its status line is out
        (`_stream`)."""
        p_url, d_url = self.route(decided.decision)
        attempt = Attempt(decided.decision, client.uuids, decided.encoded)
        no_rewrite = self.config.serving.no_rewrite
        while True:
            decision = attempt.decision
            dispatch = decision.dispatch
            try:
                body = await self._prepare(client, attempt, p_url)
                # PD may have items only as E's reference, or raw under a uuid its processor
                # cache may hold as one (an item planned as held): its connector fails the
                # request if the store lost one (E + P + D: `_prefill` checks P's answer)
                refs = p_url is None and bool(dispatch.e_items or dispatch.raw_items)
                refs = refs and not no_rewrite
                # (on the retry nothing is taken for lost: P's answer is the client's)
                held_raw = (
                    frozenset() if attempt.relost else _uuids_at(attempt.uuids, dispatch.raw_items)
                )
                sent = Sent(body, refs, held_raw, decision, time.perf_counter())
                try:
                    resp = await self.upstream.post(
                        chat_url(d_url),
                        await encode_body(body),
                        {"x-request-id": client.request_id, "Content-Type": "application/json"},
                    )
                except FAILED_CONNECTION as e:  # nothing reached the client yet
                    raise _InstanceFailed("decode", d_url, e) from e
                except asyncio.CancelledError:
                    self._if_stalled(deadline, d_url, client.request_id)
                    raise
                if self.d_health.failing:
                    self.d_health.ok(d_url)
                try:
                    if resp.status == 500:
                        retry = await self._after_500(resp, sent, attempt, client)
                        if retry is not None:
                            attempt = retry
                            continue
                    return await self._answer(request, resp, sent, client, deadline)
                except asyncio.CancelledError:
                    self._if_stalled(deadline, d_url, client.request_id)
                    raise
                finally:
                    resp.release()
            except _EmbeddingLost as lost:
                attempt = self._after_loss(lost, attempt, client.request_id)
            except _InstanceFailed as failed:
                attempt, p_url, d_url = self._fail_over(failed, attempt, client, p_url, d_url)

    def _if_stalled(self, deadline: asyncio.Timeout | None, d_url: str, req_id: str) -> None:
        """The request's deadline passed while decode (a PD or D) had not answered, or not
        begun its stream: that instance is ejected as stalled, so the next requests go to a
        live one. One that is only busy answers the probe's /health and is back within a
        second (`failover.HealthProbe`)."""
        if deadline is not None and deadline.expired():
            logger.warning(
                "[%s] decode at %s did not answer by the deadline; ejected", req_id, d_url
            )
            self.d_health.eject(d_url)

    def _fail_over(
        self,
        failed: _InstanceFailed,
        attempt: Attempt,
        client: ClientRequest,
        p_url: str | None,
        d_url: str,
    ) -> tuple[Attempt, str | None, str]:
        """The one try on another instance after `failed`'s connection failed (it is ejected):
        another D keeps the decision (P prefills again); another P (or PD) gets eager's (E
        encodes every item: the plan was that P's). `failed`'s error where there is no
        other, or this was the try already."""
        to_d = failed.stage == "decode" and p_url is not None
        health = self.d_health if to_d else self.p_health
        health.eject(failed.url)
        other = None if attempt.failed_over else health.instead_of(failed.url)
        if other is None:
            error = failed.error
            if isinstance(error, ProxyError):
                raise error
            # decode's connection, with no other instance: the reference's answer (a 500,
            # "Proxy error: ..."), logged in a line, not a traceback per request
            logger.error(
                "[%s] %s at %s failed (%s: %s); no other instance is up",
                client.request_id, failed.stage, failed.url, type(error).__name__, error,
            )  # fmt: skip
            raise ProxyError(500, f"Proxy error: {error}", stage=failed.stage) from error
        self.metrics.failovers.labels(health.role).inc()
        logger.warning(
            "[%s] %s at %s failed (%s: %s); ejected, the request goes to %s",
            client.request_id, failed.stage, failed.url, type(failed.error).__name__,
            failed.error, other,
        )  # fmt: skip
        if to_d:
            return attempt._replace(failed_over=True), p_url, other
        eager = self.planner.eager(client.items, health.urls.index(other))
        attempt = attempt._replace(decision=eager, encoded=None, failed_over=True)
        return (attempt, other, d_url) if p_url is not None else (attempt, None, other)

    async def _after_500(
        self, resp: UpstreamResponse, sent: Sent, attempt: Attempt, client: ClientRequest
    ) -> Attempt | None:
        """Decode's 500: a lost embedding (raised), a retry re-encoding everything (the next
        attempt), or None (the client gets it)."""
        detail = await resp.text()
        lost: frozenset[str] = frozenset()
        if sent.refs and _request_error(detail):
            lost = _reference_uuids(sent.body, sent.held_raw)
        if lost:
            raise _EmbeddingLost("decode", lost, detail)
        retries = self.config.serving.decode_retries
        if attempt.retries >= retries:
            return None
        logger.warning(
            "[%s] decode returned 500, re-encoding and retrying (attempt %d/%d): %s",
            client.request_id, attempt.retries + 1, retries, detail[:200],
        )  # fmt: skip
        view = self.views[attempt.decision.instance]
        self.metrics.fallbacks.labels(view.name, "retry").inc()
        instance = attempt.decision.instance
        eager = self.planner.eager(client.items, instance)
        return attempt._replace(decision=eager, encoded=None, retries=attempt.retries + 1)

    async def _answer(
        self,
        request: web.Request,
        resp: UpstreamResponse,
        sent: Sent,
        client: ClientRequest,
        deadline: asyncio.Timeout | None,
    ) -> web.StreamResponse:
        """The client's answer from decode's (not a retried 500): its error, its stream (held
        for its first token where it may carry vLLM's error for a lost reference: `refs`), or
        its JSON."""
        if resp.status >= 400:
            detail = await resp.text()
            logger.error("[%s] decode returned %s: %s", client.request_id, resp.status, detail)
            raise ProxyError(resp.status, detail, stage="decode")
        if client.stream:
            held = b""
            if sent.refs:  # vLLM fails it inside the 200 stream: hold the status line
                held, error = await self._hold(resp)
                lost = _reference_uuids(sent.body, sent.held_raw) if error else frozenset()
                if lost:
                    raise _EmbeddingLost("stream", lost, error or "")
            return await self._stream(request, resp, sent.started, held, deadline)
        out = await resp.read()
        self.metrics.stage["decode"].observe(time.perf_counter() - sent.started)
        decision = sent.decision
        if decision.dispatch.raw_items and (decision.plan or decision.answer) is not None:
            self._observe_fallback(out, decision, self.views[decision.instance])
        return web.Response(
            body=out,
            status=resp.status,
            headers={"Content-Type": resp.headers.get("content-type", "application/json")},
        )

    def _after_loss(self, lost: _EmbeddingLost, attempt: Attempt, req_id: str) -> Attempt:
        """The one retry of a request whose embedding the store lost: E encodes the lost items
        again under a fresh uuid, P gets them raw. A 500 if this was the retry already."""
        stage = "prefill" if lost.stage == "prefill" else "decode"
        if attempt.relost:  # lost again, though P got each such item raw: not retried twice
            logger.error(
                "[%s] %s failed again after the store lost an embedding: %s",
                req_id, lost.stage, lost.detail[:200],
            )  # fmt: skip
            raise ProxyError(500, lost.detail, stage=stage) from None
        view = self.views[attempt.decision.instance]
        self.metrics.embedding_lost_retries.labels(view.name, lost.stage).inc()
        again = frozenset(i for i, u in enumerate(attempt.uuids) if u in lost.uuids)
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
        uuids = [u + fresh if i in again else u for i, u in enumerate(attempt.uuids)]
        current = attempt.decision
        decision = dataclasses.replace(
            current, dispatch=current.dispatch.resend(again), demand_id=None
        )
        return attempt._replace(decision=decision, uuids=uuids, encoded=None, relost=True)

    async def _prepare(
        self, client: ClientRequest, attempt: Attempt, p_url: str | None
    ) -> Mapping[str, Any]:
        """Encode (unless the attempt holds E's answers already), rewrite and prefill: the
        body for decode. The client's body is never mutated, so a retry starts from the
        original media."""
        decision, uuids, req = attempt.decision, attempt.uuids, client.body
        result = attempt.encoded
        if result is None:
            result = await self.e_work.encode(client, decision, uuids)
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
        if self.config.serving.no_rewrite:
            prepared: Mapping[str, Any] = req
        else:
            args = (req, item_meta, raw_items, uuids, client.items)
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
        return await self._prefill(prepared, p_url, client.request_id, decision.demand_id, held_raw)

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
            # the bound only where another P could take the request (a lone P is waited for)
            async with asyncio.timeout(
                self.p_health.bound(p_url, self.config.serving.prefill_bound_s)
            ):
                resp = await self.upstream.post(
                    chat_url(p_url),
                    await encode_body(body),
                    {"x-request-id": req_id, "Content-Type": "application/json"},
                )
                try:
                    payload = await resp.read()
                    status = resp.status
                finally:
                    resp.release()
        except TimeoutError as e:  # a stalled P (--prefill-timeout)
            stalled = ProxyError(504, f"Prefill {p_url} did not answer in time", stage="prefill")
            raise _InstanceFailed("prefill", p_url, stalled) from e
        except aiohttp.ClientError as e:
            error = ProxyError(
                502, {"error": "Prefill processing error", "message": str(e)}, stage="prefill"
            )
            if isinstance(e, FAILED_CONNECTION):
                raise _InstanceFailed("prefill", p_url, error) from e
            raise error from e
        if self.p_health.failing:
            self.p_health.ok(p_url)
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
        self,
        request: web.Request,
        resp: UpstreamResponse,
        td: float,
        held: bytes = b"",
        deadline: asyncio.Timeout | None = None,
    ) -> web.StreamResponse:
        """Forward decode's bytes as they come (no SSE parsing), after `held` (what `_hold`
        read); the status line goes out only now that decode has accepted the request. From
        here the request's `deadline` is this loop's: a stream it cuts, or one decode breaks,
        ends with an error event and [DONE] (as vLLM ends a stream it fails), never silently."""
        out = web.StreamResponse(
            status=resp.status,
            headers={"Content-Type": resp.headers.get("content-type", "text/event-stream")},
        )
        when = None
        if deadline is not None and (when := deadline.when()) is not None:
            deadline.reschedule(None)  # a 504 is no longer possible: the cut is an event
        await out.prepare(request)
        try:
            if when is None:  # no deadline: no scope to enter on this per-stream path
                return await self._pipe(out, resp, td, held)
            async with asyncio.timeout_at(when):
                return await self._pipe(out, resp, td, held)
        except TimeoutError:
            logger.error("decode stream cut at the request's deadline (--request-timeout)")
            self.metrics.errors.labels("deadline").inc()
            return await _end_with_error(request, out, 504, "the request's deadline passed")
        except (aiohttp.ClientError, ConnectionError) as e:
            logger.error("decode stream broke after it started: %s", e)
            self.metrics.errors.labels("decode").inc()
            return await _end_with_error(request, out, 502, f"the decode stream broke: {e}")

    async def _pipe(
        self, out: web.StreamResponse, resp: UpstreamResponse, td: float, chunk: bytes
    ) -> web.StreamResponse:
        """Decode's bytes to the client (what `_hold` read, `chunk`, first) until decode's
        end; decode's failure raised, the client's leaving marked on `out`."""
        first = True
        while True:
            if not chunk:
                chunk = await resp.readany()
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


# vLLM's answer to a request its scheduler finished with FinishReason.ERROR (`_raise_if_error`,
# 0.32 and 0.33): this error, as a 500's body or as an event of a 200 stream. An EC connector
# fails a request so when it can no longer obtain an encoder input (`take_unavailable_requests`:
# MooncakeStoreConnector, for an item P had only as E's reference that the store lost); vLLM
# carries no finer reason to the client.
_REQUEST_ERROR = {"message": "Internal server error", "type": "InternalServerError", "code": 500}
HOLD_BYTES = 1 << 20  # a stream held for its first token: at most this much, then forwarded
ERROR_WRITE_S = 5.0  # a stream's closing error event: the client's time to take it
_PREAMBLE = b'"delta":{"role"'  # vLLM's first event of a choice (pydantic's compact JSON)
_PREAMBLE_SPACED = b'"delta": {"role"'  # ... as Python's json.dumps spaces it


class _InstanceFailed(Exception):
    """The connection to an instance failed before anything reached the client: `stage`
    prefill (E + P + D's P) or decode (the PD, or D), `url` the instance, `error` what the
    client gets where no other instance takes the request."""

    def __init__(self, stage: str, url: str, error: BaseException) -> None:
        super().__init__(stage, url, error)
        self.stage, self.url, self.error = stage, url, error


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


async def _end_with_error(
    request: web.Request, out: web.StreamResponse, code: int, message: str
) -> web.StreamResponse:
    """End a stream whose status line is out with an error event and [DONE], as vLLM ends a
    stream it fails (`create_streaming_error_response`), so the client's SDK raises rather
    than taking a cut answer for a whole one. A client that does not take them within
    ERROR_WRITE_S is cut off."""
    kind = "GatewayTimeoutError" if code == 504 else "BadGatewayError"
    error = {"message": message, "type": kind, "param": None, "code": code}
    event = b"data: " + msgspec.json.encode({"error": error}) + b"\n\ndata: [DONE]\n\n"
    out.mmreuse_outcome = "stream_broken"  # type: ignore[attr-defined]
    try:
        async with asyncio.timeout(ERROR_WRITE_S):
            await out.write(event)
            await out.write_eof()
    except (TimeoutError, ConnectionError, RuntimeError):
        out.force_close()
        if request.transport is not None:
            request.transport.close()
    return out


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
