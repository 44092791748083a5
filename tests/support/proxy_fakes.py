"""In-process fake E, P and D backends for the proxy's protocol tests (the pattern of vLLM's
tests/v1/ec_connector/unit/test_epd_proxy*.py): aiohttp servers on loopback that record every
request (path, headers, JSON body) and answer as vLLM 0.33 does, with scriptable failures, a
scriptable chat answer (`answer`), an optional render answer (`render`) and gzip on request."""

from __future__ import annotations

import asyncio
import hashlib
import json
import socket
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer


@dataclass
class Seen:
    path: str
    headers: dict[str, str]
    body: Any


@dataclass
class Fake:
    """One backend. `role`: "e" answers with ec_transfer_params per item; "pd"/"p"/"d" with a
    chat completion (SSE when streaming); "p" adds kv_transfer_params. `fail` maps a path to a
    list of statuses to answer first (consumed in order). `answer`, when set, makes the JSON (or
    the `web.StreamResponse`) a chat completion answers, from its request body, instead of the
    role's default. `gzip`: compress every answer when the client accepts it (a compressing
    front end). `abort_after`: a streaming answer drops its connection after that many chunks.
    `render` may return bytes (sent as the raw JSON body). `delay`, when set, makes a chat
    completion wait that many seconds (from its request body) before answering. `stall_after`: a
    streaming answer goes silent after that many chunks until `release` is set or its client
    hangs up (counted in `hung_up`)."""

    role: str
    seen: list[Seen] = field(default_factory=list)
    fail: dict[str, list[int]] = field(default_factory=dict)
    grid: list[int] = field(default_factory=lambda: [1, 2, 2])
    render: Callable[[dict], dict] | None = None
    server: TestServer | None = None
    chunks: tuple[bytes, ...] = (
        b'data: {"choices":[{"delta":{"content":"he"}}]}\n\n',
        b'data: {"choices":[{"delta":{"content":"llo"}}]}\n\n',
        b"data: [DONE]\n\n",
    )
    usage: dict | None = None
    answer: Callable[[dict], Any] | None = None
    gzip: bool = False
    abort_after: int | None = None  # streaming: drop the connection after this many chunks
    delay: Callable[[dict], float] | None = None
    stall_after: int | None = None  # streaming: go silent after this many chunks
    release: asyncio.Event = field(default_factory=asyncio.Event)
    hung_up: int = 0  # stalled streams whose client closed the connection
    models: list[dict[str, Any]] | None = None  # GET /v1/models' entries (None: one base, tiny)

    @property
    def url(self) -> str:
        assert self.server is not None
        return str(self.server.make_url("")).rstrip("/")

    def chats(self) -> list[Seen]:
        return [s for s in self.seen if s.path == "/v1/chat/completions"]

    async def handle(self, request: web.Request) -> web.StreamResponse:
        resp = await self._answer(request)
        if self.gzip and not resp.prepared:
            resp.enable_compression()
        return resp

    async def _answer(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        body = json.loads(raw) if raw else None
        self.seen.append(
            Seen(request.path, {k.lower(): v for k, v in request.headers.items()}, body)
        )
        pending = self.fail.get(request.path)
        if pending:
            status = pending.pop(0)
            return web.Response(status=status, text=f"injected {status}")
        if request.path == "/health":
            return web.Response(text="")
        if request.path == "/v1/models":
            data = self.models if self.models is not None else [{"id": "tiny"}]
            return web.json_response({"object": "list", "data": data})
        if request.path == "/v1/chat/completions/render":
            if self.render is None:
                return web.Response(status=403, text="render disabled")
            rendered = self.render(body)
            if isinstance(rendered, bytes):
                return web.Response(body=rendered, content_type="application/json")
            return web.json_response(rendered)
        if request.path.endswith("_profile"):
            return web.json_response({"ok": self.role})
        if self.delay is not None and request.path == "/v1/chat/completions":
            await asyncio.sleep(self.delay(body))
        if self.answer is not None and request.path == "/v1/chat/completions":
            out = self.answer(body)
            return out if isinstance(out, web.StreamResponse) else web.json_response(out)
        if self.role == "e":
            params = {}
            content = body["messages"][0]["content"]
            for i, part in enumerate(content):
                key = part.get("uuid") or f"hash-{i}"
                entry = params.setdefault(
                    key,
                    {
                        "modality": "image",
                        "item_indices": [],
                        "metadata": {"image_grid_thw": self.grid},
                    },
                )
                entry["item_indices"].append(i)
            return web.json_response({"id": "e", "choices": [], "ec_transfer_params": params})
        if body.get("stream"):
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            if self.gzip:
                resp.enable_compression()
            await resp.prepare(request)
            for n, chunk in enumerate(self.chunks[: self.abort_after]):
                if n == self.stall_after and not await self._stall(request):
                    return resp  # the client hung up while the stream was silent
                await resp.write(chunk)
            if self.abort_after is not None:
                assert request.transport is not None
                request.transport.abort()  # mid-stream: no terminating chunk
                return resp
            await resp.write_eof()
            return resp
        out: dict[str, Any] = {
            "id": f"chatcmpl-{self.role}",
            "object": "chat.completion",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}}],
        }
        if self.usage is not None:
            out["usage"] = self.usage
        if self.role == "p":
            out["kv_transfer_params"] = {"remote_engine_id": "p-engine", "remote_block_ids": [1]}
        return web.json_response(out)

    async def _stall(self, request: web.Request) -> bool:
        """Stay silent until `release` (True) or until the client hangs up (False, or the
        server cancelling this handler: TestServer runs with handler_cancellation)."""
        try:
            while not self.release.is_set():
                if request.transport is None or request.transport.is_closing():
                    self.hung_up += 1
                    return False
                await asyncio.sleep(0.01)
        except asyncio.CancelledError:
            self.hung_up += 1
            raise
        return True

    async def start(self) -> Fake:
        app = web.Application(client_max_size=1 << 28)
        app.router.add_route("*", "/{tail:.*}", self.handle)
        self.server = TestServer(app, host="127.0.0.1")
        await self.server.start_server()
        return self

    async def close(self) -> None:
        self.release.set()  # a stalled stream ends, so that the server can close
        if self.server is not None:
            await self.server.close()


class ProxyHandle:
    """What a test setup holding an in-process proxy (`app`, its aiohttp `client`) offers:
    the proxy, a metric's value, a chat completion."""

    app: web.Application
    client: Any

    @property
    def proxy(self):
        from mmreuse.proxy.server import PROXY_KEY

        return self.app[PROXY_KEY]

    def sample(self, name: str, **labels: str) -> float:
        value = self.proxy.registry.get_sample_value(name, labels)
        return 0.0 if value is None else value

    async def post(self, body: Any) -> Any:
        return await self.client.post("/v1/chat/completions", json=body)


async def start_fakes(*roles: str) -> list[Fake]:
    return list(await asyncio.gather(*(Fake(r).start() for r in roles)))


_REFUSING: list[socket.socket] = []  # held for the session: their ports are never reused


def refused_url() -> str:
    """An http URL on loopback that refuses connections: a port bound and never listened on,
    and kept bound, so that no other server (of this process or of a parallel test worker)
    can take it while a test counts on its refusal."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    _REFUSING.append(s)
    return f"http://127.0.0.1:{s.getsockname()[1]}"


def sha(s: str) -> str:
    """The reference proxy's uuid of an item whose URL is `s`."""
    return hashlib.sha256(s.encode()).hexdigest()


def img(url: str, **extra: Any) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}, **extra}


def chat(*content: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"model": "tiny", "messages": [{"role": "user", "content": list(content)}], **extra}


@asynccontextmanager
async def proxy_client(app: web.Application) -> AsyncIterator[TestClient]:
    """A test client of the proxy's `app`, served as `mmreuse proxy` serves it
    (`mmreuse.proxy.server.SERVER_SETTINGS`; TestServer sets handler_cancellation itself)."""
    from mmreuse.proxy.server import SERVER_SETTINGS

    server = TestServer(app)
    await server.start_server(
        **{k: v for k, v in SERVER_SETTINGS.items() if k != "handler_cancellation"}
    )
    async with TestClient(server) as client:
        yield client
