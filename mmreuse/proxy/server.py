"""The proxy's HTTP server: the aiohttp application (`build_app`: the chat route of
`app.Proxy` and the operations routes of `health.Operations`), the --metrics-port one, and
`serve`, which binds them and turns a start-up error into `StartupFailed`'s one line."""

from __future__ import annotations

import asyncio
import functools
import gc
import logging
from collections.abc import Callable
from typing import Any

from aiohttp import web

from ..errors import InvalidArgument
from .app import AfterDecide, Proxy
from .config import ProxyConfig
from .health import Operations

logger = logging.getLogger("mmreuse.proxy")

# How the proxy's HTTP server runs (`serve`, and the tests' servers): a client that hangs up
# cancels its handler, which closes the backend request (as Starlette on uvicorn does for the
# reference; aiohttp's default keeps it running); request bodies are never inflated.
SERVER_SETTINGS: dict[str, Any] = {"handler_cancellation": True, "auto_decompress": False}
PROXY_KEY: web.AppKey[Proxy] = web.AppKey("proxy")


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
        middlewares=[_log_requests] if config.serving.log_requests else [],
        client_max_size=config.media.max_body_bytes,  # multi-image requests carry base64 media
    )
    app[PROXY_KEY] = proxy
    app.on_startup.append(proxy.start)
    app.on_cleanup.append(proxy.stop)
    app.router.add_post("/v1/chat/completions", proxy.chat)
    ops = Operations(proxy)
    app.router.add_get("/v1/models", ops.models)
    separate = config.serving.metrics_port is not None  # then the facts are on the metrics app only
    app.router.add_get("/health", functools.partial(ops.health, detail=not separate))
    if not separate:
        app.router.add_get("/metrics", ops.metrics)
    app.router.add_post("/start_profile", ops.profile)
    app.router.add_post("/stop_profile", ops.profile)
    return app


def build_metrics_app(proxy: Proxy) -> web.Application:
    """GET /metrics and the detailed GET /health of `proxy`, for --metrics-port."""
    ops = Operations(proxy)
    app = web.Application()
    app.router.add_get("/metrics", ops.metrics)
    app.router.add_get("/health", ops.health)
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
        level=logging.DEBUG if config.serving.log_requests else logging.INFO,
        format=f"%(asctime)s {prefix}%(levelname)s: %(message)s",
    )


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
                app_runner,
                config.serving.host,
                config.serving.port,
                backlog=4096,
                reuse_port=reuse_port or None,
            )
            await site.start()
            serving = True
            if metrics_path is not None:
                await metrics_runner.setup()
                await web.UnixSite(metrics_runner, metrics_path).start()
            elif config.serving.metrics_port is not None:
                host = config.serving.metrics_host or config.serving.host
                await metrics_runner.setup()
                await web.TCPSite(metrics_runner, host, config.serving.metrics_port).start()
        except InvalidArgument as e:
            raise StartupFailed(str(e)) from e
        except OSError as e:  # the port is taken, the host does not resolve, ...
            where = (
                f"{config.serving.host}:{config.serving.port}"
                if not serving
                else metrics_path
                or f"{config.serving.metrics_host or config.serving.host}:{config.serving.metrics_port}"
            )
            raise StartupFailed(f"cannot listen on {where}: {e.strerror or e}") from e
        # What start-up made lives as long as the process: out of the cyclic collector's reach,
        # a full collection (on whichever thread, the loop's too) walks a request's objects only
        # (~20 ms for the ~50,000 objects of a started proxy, every such collection, otherwise).
        gc.collect()
        gc.freeze()
        logger.info(
            "mmreuse proxy on %s:%d (policy %s, routing %s): E %s, P %s, D %s",
            config.serving.host, config.serving.port, config.planning.policy, config.planning.routing,
            list(config.encode_urls), list(config.prefill_urls), list(config.decode_urls),
        )  # fmt: skip
        if ready is not None:
            ready()
        await asyncio.Event().wait()
    finally:
        await metrics_runner.cleanup()
        await app_runner.cleanup()  # what started is stopped, the client session closed
