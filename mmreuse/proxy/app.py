"""The proxy's chat route: POST /v1/chat/completions (streaming or not), as the reference
serves it. `Proxy` wires the parts (views, planner, E's fan-out, the connections) and runs
each request as three numbered steps:

1. read (`request.RequestReader`): the client's request as one record (`ClientRequest`);
2. decide (`flows`: one flow per policy, picked at start): the `Decision`, and E's answers
   where E was sent its items already;
3. forward (`forward.Forwarder`): encode what is left for E, rewrite, prefill, decode, with
   the decode-500 and the lost-embedding retries.

The server is `proxy.server`, the other routes `proxy.health`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import random
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import yarl
from aiohttp import web
from prometheus_client import CollectorRegistry

from ..availability import EmbeddingAvailability
from ..decision import Policy
from . import body as bodies
from .body import encode_body
from .config import HeldItems, ProxyConfig, UuidPolicy
from .content import MediaFetcher, MediaLimits
from .demand import DemandClient
from .encoder import EncoderFanout
from .errors import ProxyError
from .eside import ESide
from .failover import HealthProbe, named_ejections
from .flows import EWork, flow_for
from .forward import Forwarder
from .metrics import ProxyMetrics
from .models import ModelCatalog
from .policy import Planner
from .records import Decision, Sources
from .references import HeldReferences
from .request import RequestReader
from .store import StoreTruth
from .upstream import Upstream
from .views import EncoderView, InstanceView

logger = logging.getLogger("mmreuse.proxy")

_JSON = {"Content-Type": "application/json"}


async def read_body(request: web.Request) -> bytes | bytearray:
    """The request's body as sent, at most --max-body-bytes (`proxy.body.read_body`)."""
    return await bodies.read_body(request, request.client_max_size)


AfterDecide = Callable[[Decision], Awaitable[None]]


class Proxy:
    """One proxy: its config, client session, views, planner and metrics."""

    def __init__(self, config: ProxyConfig, *, after_decide: AfterDecide | None = None) -> None:
        self.config = config
        self.registry = CollectorRegistry()
        self.metrics = ProxyMetrics(self.registry)  # its views' metrics too (metrics.views)
        self.session: aiohttp.ClientSession | None = None  # the backends' other routes
        self.media_session: aiohttp.ClientSession | None = None  # --uuid-policy content's
        # E's, P's and D's POSTs: kept alive for less than vLLM keeps an idle connection
        keep_alive = config.serving.backend_keep_alive_s
        self.upstream = Upstream(keep_alive / 2 if keep_alive > 0 else None)
        self.media = MediaFetcher(config.media.fetch or MediaLimits(), self._fetch_media)
        self.availability = EmbeddingAvailability(
            ttl_s=config.store.e_cache_ttl_s,
            max_entries=config.store.e_cache_items,
            metrics=self.metrics.views,
        )
        self.views = _instance_views(config, self.metrics, self.availability)
        self.e_side = ESide(config, self.availability, self.metrics)
        self.e_views: list[EncoderView] = self.e_side.views
        self.rng = random.Random(config.planning.seed)
        # --held-items reference: E's metadata per item, to send a P-held item as a reference
        self.references = (
            HeldReferences() if config.planning.held_items is HeldItems.REFERENCE else None
        )
        clients = _demand_clients(config, self.views, self.metrics)
        changed = self.metrics.instance_changed
        p_role = "P" if config.prefill_urls else "PD"
        p_health = named_ejections(p_role, config.prefill_instances, changed)
        d_health = (
            named_ejections("D", config.decode_urls, changed) if config.prefill_urls else p_health
        )
        self.demand = [c for c in clients if c is not None]
        self.store = (
            StoreTruth(
                config.store.url,
                config.store.namespace,
                self._session,
                timeout_s=config.store.timeout_s,
                on_outcome=lambda outcome: self.metrics.e_store_queries.labels(outcome).inc(),
            )
            if config.store.url is not None and config.store.namespace is not None
            else None
        )
        sources = Sources(
            self.views,
            self.availability,
            clients,
            models=ModelCatalog(self._get),
            store=self.store,
            e_side=self.e_side,
            references=self.references,
            p_health=p_health,
        )
        self.planner = Planner(config, sources, self._post_json, self.rng)
        e_health = named_ejections("E", config.encode_urls, self.metrics.instance_changed)
        # an ejected instance is asked for its health each second: back once it answers
        self.probe = HealthProbe((e_health, p_health, d_health), self._health_status)
        self._probing: asyncio.Task[None] | None = None
        self.encoders = EncoderFanout(
            config.encode_urls,
            lambda: self.upstream,
            max_batch_size=config.serving.encoder_max_batch_size,
            no_rewrite=config.serving.no_rewrite,
            health=e_health,
            on_failover=self.metrics.failovers.labels("E").inc,
            timeout_s=config.serving.encode_bound_s,
        )
        self.reader = RequestReader(config.media, self.encoders, self.media, self.metrics)
        e_work = EWork(self.encoders, self.planner, self.metrics)
        self.flow = flow_for(self.planner, e_work, self.metrics, self.views)
        self.forwarder = Forwarder(
            config, self.upstream, e_work, self.views, self.references, self.rng,
            (p_health, d_health),
        )  # fmt: skip
        self.after_decide = after_decide

    # ---- lifecycle ----------------------------------------------------------------------------

    async def start(self, _app: web.Application | None = None) -> None:
        # vLLM closes an idle keep-alive connection after VLLM_HTTP_TIMEOUT_KEEP_ALIVE seconds
        # (ProxyConfig.backend_keep_alive_s); reusing one it has closed fails the request.
        # Retire ours first.
        keep_alive = self.config.serving.backend_keep_alive_s
        connector = aiohttp.TCPConnector(
            limit=0,
            **({"keepalive_timeout": keep_alive / 2} if keep_alive > 0 else {"force_close": True}),
        )
        self.session = aiohttp.ClientSession(
            connector=connector,
            timeout=aiohttp.ClientTimeout(),  # none: the reference's 100,000 s, without timers
            skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding"),
        )
        if self.config.media.uuid_policy == UuidPolicy.CONTENT:
            from .content import media_session  # no cookies; only checked addresses

            self.media_session = media_session(self.media.limits)
        views: list[InstanceView | EncoderView] = [*self.views, *self.e_views]
        for view in views:
            await asyncio.to_thread(view.start)
        for client in self.demand:
            client.start()
        self.metrics.watch_runtime(asyncio.get_running_loop(), self.upstream.connections)
        self._probing = asyncio.ensure_future(self.probe.run())

    async def stop(self, _app: web.Application | None = None) -> None:
        if self._probing is not None:
            self._probing.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._probing
        for client in self.demand:
            await client.close()
        views: list[InstanceView | EncoderView] = [*self.views, *self.e_views]
        for view in views:
            await asyncio.to_thread(view.stop)
        if self.session is not None:
            await self.session.close()
        await self.forwarder.close()
        if self.media_session is not None:
            await self.media_session.close()

    def _session(self) -> aiohttp.ClientSession:
        assert self.session is not None, "Proxy.start() first"
        return self.session

    async def _get(self, url: str) -> tuple[int, bytes]:
        async with self._session().get(url, timeout=aiohttp.ClientTimeout(total=10)) as r:
            return r.status, await r.read()

    async def _health_status(self, url: str, timeout_s: float) -> int:
        """GET `url` (an instance's /health, `HealthProbe`): its status."""
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        async with self._session().get(url, timeout=timeout) as r:
            return r.status

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
        resp = await self.upstream.post(_url(url), await encode_body(body), _JSON)
        try:
            return resp.status, await resp.read()
        finally:
            resp.release()

    # ---- POST /v1/chat/completions ------------------------------------------------------------

    async def chat(self, request: web.Request) -> web.StreamResponse:
        t0 = time.perf_counter()
        m = self.metrics
        policy = self.config.planning.policy
        deadline = self.config.serving.request_timeout_s
        scope = None
        try:
            if deadline:
                async with asyncio.timeout(deadline) as scope:
                    response = await self._chat(request, scope)
            else:  # no deadline (the default, as the reference): no scope to enter
                response = await self._chat(request, None)
        except asyncio.CancelledError:  # the client hung up (aiohttp cancels the handler)
            m.request(policy, "client_gone").inc()
            raise
        except ProxyError as e:
            m.errors.labels(e.stage).inc()
            m.request(policy, _outcome(e.status)).inc()
            return web.json_response({"detail": e.detail}, status=e.status)
        except Exception as e:
            m.request(policy, "server_error").inc()
            if isinstance(e, TimeoutError) and scope is not None and scope.expired():
                # --request-timeout: what ran for the request was cancelled (its connections
                # to E, P and D closed, so vLLM aborts it), and nothing had reached the client
                m.errors.labels("deadline").inc()
                detail = f"the request was not answered within --request-timeout ({deadline:g} s)"
                return web.json_response({"detail": detail}, status=504)
            logger.exception("chat completion failed")  # what the reference answers: a 500
            m.errors.labels("proxy").inc()
            return web.json_response({"detail": f"Proxy error: {e}"}, status=500)
        finally:
            if bodies.CURRENT.get() is not None:  # set by `_chat` for a large body
                bodies.CURRENT.set(None)
        outcome = getattr(response, "mmreuse_outcome", None) or _outcome(response.status)
        m.request(policy, outcome).inc()
        m.stage["total"].observe(time.perf_counter() - t0)
        return response

    async def _chat(
        self, request: web.Request, scope: asyncio.Timeout | None
    ) -> web.StreamResponse:
        # 1. read: the client's request, its media items and their uuids
        client = await self.reader.read(request)
        if client.blobs is not None:  # a large body: its inline media spliced into, and its
            bodies.CURRENT.set(client.blobs)  # bodies built for E, P and D off the loop
        # 2. decide: the policy's flow (E may be at work already)
        decided = await self.flow.decide(client)
        if self.after_decide is not None:
            await self.after_decide(
                dataclasses.replace(decided.decision, request_id=client.request_id)
            )
        # 3. forward: encode the rest, rewrite, prefill, decode (and the retries)
        return await self.forwarder.forward(request, client, decided, scope)


@functools.lru_cache(maxsize=256)
def _url(url: str) -> yarl.URL:
    return yarl.URL(url)


def _outcome(status: int) -> str:
    return "ok" if status < 400 else "client_error" if status < 500 else "server_error"


def _instance_views(
    config: ProxyConfig, metrics: ProxyMetrics, availability: EmbeddingAvailability
) -> list[InstanceView]:
    """One view per P (or PD), named P<i> (PD<i>), from its events and snapshots."""
    prefix = "P" if config.prefill_urls else "PD"
    policy = Policy(config.planning.policy)
    return [
        InstanceView(
            f"{prefix}{i}",
            instance,
            hash_algo=config.views.hash_algo,
            hash_seed=config.views.hash_seed,
            block_size=config.views.block_size,
            metrics=metrics,
            availability=availability,
            # what the arrival-time split reads (index, demand)
            track_identifiers=policy.renders and not policy.e_at_once,
        )
        for i, instance in enumerate(config.instances)
    ]


def _demand_clients(
    config: ProxyConfig, views: list[InstanceView], metrics: ProxyMetrics
) -> list[DemandClient | None]:
    """One client per P (None where it has no demand endpoint), or none: P is asked under
    demand / opportunistic (the config holds an endpoint for each then), and under index
    while an instance's view is incomplete, where it has one."""
    asks = config.planning.policy.asks_p or (
        config.planning.policy.reads_view and any(i.demand for i in config.instances)
    )
    if not asks:
        return []
    return [
        None
        if instance.demand is None
        else DemandClient(
            instance.demand,
            name=view.name,
            observe=functools.partial(metrics.demand_outcome, view.name),
            drop=functools.partial(metrics.demand_drop, view.name),
        )
        for view, instance in zip(views, config.instances, strict=True)
    ]
