"""The proxy's operations routes, as the reference serves them: GET /v1/models (D's),
GET /health (each cluster probed; with `detail`, mmreuse's views, demand clients and store),
POST /start_profile and /stop_profile (to one E, P and D), and GET /metrics (Prometheus)."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import aiohttp
import msgspec
from aiohttp import web
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from ..decision import Routing
from .app import Proxy, read_body
from .errors import ProxyError

_JSON = {"Content-Type": "application/json"}


class Operations:
    """The operations routes of one `Proxy` (its session, config, views and registry)."""

    def __init__(self, proxy: Proxy) -> None:
        self.proxy = proxy

    def _session(self) -> aiohttp.ClientSession:
        assert self.proxy.session is not None, "Proxy.start() first"
        return self.proxy.session

    async def models(self, request: web.Request) -> web.Response:
        try:
            async with self._session().get(f"{self.proxy.config.decode_urls[0]}/v1/models") as resp:
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

        cfg = self.proxy.config
        e, p, d = await asyncio.gather(
            cluster(cfg.encode_urls), cluster(cfg.prefill_urls), cluster(cfg.decode_urls)
        )
        ok = all(s != "unhealthy" for s in (e, p, d))
        views = {v.name: v.health() for v in self.proxy.views}
        e_views = {v.name: v.health() for v in self.proxy.e_views}
        problems = [
            f"{name}: {p}"
            for name, h in (*views.items(), *e_views.items())
            for p in h["problems"]  # type: ignore[attr-defined]
        ]
        if not cfg.planning.policy.reads_view and cfg.planning.routing == Routing.RANDOM:
            problems = [p for p in problems if not p.endswith("no KV events endpoint")]
        store = self.proxy.store.health() if self.proxy.store is not None else None
        if store is not None and store["last_outcome"] not in (None, "ok"):
            problems.append(
                f"e store: last query {store['last_outcome']}: {store['last_error']} "
                "(planned with this proxy's own record meanwhile)"
            )
        fwd = self.proxy.forwarder
        roles = {h.role: h for h in (self.proxy.encoders.health, fwd.p_health, fwd.d_health)}
        ejected = {role: h.down() for role, h in roles.items()}
        for role, down in ejected.items():
            if down:
                problems.append(
                    f"{role} ejected (connection failed or stalled; back once its /health answers): {down}"
                )
        demand = {c.name: c.health() for c in self.proxy.demand}
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
                "policy": cfg.planning.policy,
                "routing": cfg.planning.routing,
                "status": "degraded" if problems else "ok",
                "problems": problems,
                "e_side": self.proxy.e_side.health(),  # events, per-replica, or None (eager)
                "ejected": ejected,
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

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(
            body=generate_latest(self.proxy.registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )

    async def profile(self, request: web.Request) -> web.Response:
        """POST /start_profile, /stop_profile: to one random E, P and D; 404 = disabled."""
        cmd = request.path.strip("/").removesuffix("_profile")
        try:
            payload = await read_body(request)
        except ProxyError as err:
            return web.json_response({"detail": err.detail}, status=err.status)
        cfg = self.proxy.config
        headers = {"Authorization": f"Bearer {cfg.serving.api_key}"}

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
