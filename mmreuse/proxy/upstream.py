"""The proxy's keep-alive HTTP/1.1 connections to its backends, for the POSTs of every request:
E's sub-requests, P's prefill and D's decode.

aiohttp's `ClientSession` costs about as much CPU per request as the rest of the proxy together
(`ClientSession._request`: cookies, tracing, auto headers, redirects, timers, payload objects);
here a request is written in one call and its answer parsed in the connection's protocol. The
errors are aiohttp's client errors (`ClientOSError`, `ServerDisconnectedError`,
`ClientPayloadError`), so a caller maps them as it mapped aiohttp's. What the backends need and
no more: a POST of a body in memory; an answer's body by Content-Length, chunked or until close;
no redirect followed, no cookie kept, no compression (none is asked for: a compressed answer is
refused). The other calls (health, models, render, demand, the store, media) stay on aiohttp.

The answers are framed by llhttp (Node.js's parser, through MagicStack's `httptools`, as uvicorn
does), strictly: anything it or this module refuses (a malformed head, Content-Length with
Transfer-Encoding, a bad chunk size, bytes after the answer's end, a head over MAX_HEAD) fails
the answer with `ClientPayloadError` and closes the connection, which is never pooled again.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import ssl
from collections.abc import Mapping

import aiohttp
import httptools
import yarl

# Unread body bytes above which a connection stops reading (a stream forwarded to a slow
# client); the next read takes every unread byte and reads again.
HIGH_WATER = 1 << 20
MAX_HEAD = 1 << 16  # status line and headers: an answer with more is refused
_SMALL_BODY = 1 << 14  # joined with the head into one write below this; two writes above

Key = tuple[str, str, int]
Buffer = bytes | bytearray | memoryview


@functools.lru_cache(maxsize=256)
def _target(url: yarl.URL) -> tuple[Key, bytes]:
    """The pool key and the request line + Host header of a POST to `url`."""
    if url.scheme not in ("http", "https") or not url.raw_host or url.port is None:
        raise ValueError(f"not an http(s) URL with a host: {url}")
    head = f"POST {url.raw_path_qs} HTTP/1.1\r\nHost: {url.host_port_subcomponent}\r\n"
    return (url.scheme, url.raw_host, url.port), head.encode("ascii")


class UpstreamResponse:
    """One answer: `status` and `headers` (lower-case names) once its head is in; its body read
    whole (`read`) or as it comes (`readany`); `release()` after, in a `finally`, which pools
    the connection when the body was read to its end and closes it otherwise.

    Framed by llhttp (`httptools.HttpResponseParser`, one per answer): the `on_*` methods are
    its callbacks, not for callers."""

    __slots__ = (
        "_body",
        "_chunks",
        "_conn",
        "_done",
        "_error",
        "_framing",
        "_head",
        "_head_size",
        "_informational",
        "_parser",
        "_paused",
        "_received",
        "_reusable",
        "_size",
        "_until_close",
        "_waiter",
        "_whole",
        "headers",
        "status",
    )  # fmt: skip

    def __init__(self, conn: _Connection, loop: asyncio.AbstractEventLoop) -> None:
        self.status = 0
        self.headers: dict[str, str] = {}
        self._conn: _Connection | None = conn
        self._head: asyncio.Future[None] = loop.create_future()
        self._parser: httptools.HttpResponseParser | None = httptools.HttpResponseParser(self)
        self._received = 0  # body bytes parsed
        self._framing = 0  # bytes fed since the last body byte (heads, chunk sizes, trailers)
        self._head_size = 0  # the head's bytes, as the parser reports them
        self._informational = False  # a 1xx answer is being parsed: the real one follows
        self._until_close = False  # the body ends when the connection does
        self._done = False  # the answer was read to its end
        self._chunks: collections.deque[bytes] = collections.deque()  # body, not yet read
        self._size = 0  # bytes in _chunks
        self._waiter: asyncio.Future[None] | None = None
        self._error: BaseException | None = None
        self._paused = False
        self._whole = False  # read() is collecting the body: never pause then
        self._reusable = True
        self._body: bytes | None = None  # what read() returned: it returns it again

    # ---- reading (the caller) -----------------------------------------------------------------

    async def read(self) -> bytes:
        """The whole body (what `readany` has not returned yet), the same on each call."""
        if self._body is not None:
            return self._body
        self._whole = True
        if self._paused:
            self._resume()
        while not self._done:
            if self._error is not None:
                raise self._error
            await self._wait()
        if self._error is not None:  # bytes after the answer's end
            raise self._error
        data = self._body = b"".join(self._chunks)
        self._chunks.clear()
        self._size = 0
        return data

    async def text(self) -> str:
        """The whole body as text (UTF-8, undecodable bytes replaced)."""
        return (await self.read()).decode("utf-8", "replace")

    async def readany(self) -> bytes:
        """The body bytes received and not yet read, once there are some; b"" at its end."""
        while not self._chunks:
            if self._error is not None:
                raise self._error
            if self._done:
                return b""
            await self._wait()
        chunks = self._chunks
        data = chunks.popleft() if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        self._size = 0
        if self._paused:
            self._resume()
        return data

    def release(self) -> None:
        """Give the connection back: pooled if the body was read to its end, closed if not."""
        conn, self._conn = self._conn, None
        self._parser = None  # it refers back to this answer: no cycle left for the collector
        if conn is None:
            return
        conn.response = None
        if self._done and self._reusable and self._error is None:
            if self._paused:  # the answer ended while its reader lagged: the socket reads again
                self._paused = False
                if conn.transport is not None:
                    conn.transport.resume_reading()
            conn.pool.put(conn)
        else:
            conn.close()

    async def _wait(self) -> None:
        waiter = self._waiter = self._head.get_loop().create_future()
        try:
            await waiter
        finally:
            self._waiter = None

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _resume(self) -> None:
        self._paused = False
        conn = self._conn
        if conn is not None and conn.transport is not None:
            conn.transport.resume_reading()

    # ---- parsing (the connection) -------------------------------------------------------------

    def feed(self, data: bytes) -> None:
        """Bytes from the backend, to the parser; any it refuses fail the answer."""
        parser = self._parser
        if parser is None or self._error is not None:
            return
        received = self._received
        try:
            parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as e:
            # a callback's refusal is the error's context: its words, not "callback error"
            reason = e.__context__ if isinstance(e, httptools.HttpParserCallbackError) else e
            if self._done:
                self._after_end(f"{reason or type(e).__name__}")
            else:
                self.fail(aiohttp.ClientPayloadError(f"invalid answer from the backend: {reason}"))
            return
        if self._received != received or self._done:
            self._framing = 0
            return
        # no body byte in these: a head, chunk framing or trailers, which the parser holds
        # whole until they end, so bounded here
        self._framing += len(data)
        if self._framing > MAX_HEAD:
            what = "trailers or chunk framing" if self._head.done() else "a head"
            error = f"invalid answer from the backend: {what} over {MAX_HEAD} bytes"
            self.fail(aiohttp.ClientPayloadError(error))

    def on_message_begin(self) -> None:
        if self._done:  # a second answer to one request: the backend and the proxy disagree
            raise ValueError("another answer begins")

    def on_status(self, reason: bytes) -> None:
        self._head_size += len(reason) + 15  # "HTTP/1.1 200 " and CRLF

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._head.done():  # a trailer: nothing the proxy reads
            return
        self._head_size += len(name) + len(value) + 4  # ": " and CRLF
        key = name.decode("latin-1").lower()
        headers = self.headers
        if key == "transfer-encoding" and (key in headers or value.lower() != b"chunked"):
            # chunked is all the backends send; anything else is a coding not asked for, or
            # a framing another parser on the way may read differently
            raise ValueError(f"Transfer-Encoding {value[:40]!r} (only one, chunked, is read)")
        headers[key] = value.decode("latin-1").strip()

    def on_headers_complete(self) -> None:
        parser = self._parser
        assert parser is not None
        if self._head_size > MAX_HEAD:
            raise ValueError(f"a head over {MAX_HEAD} bytes")
        status = parser.get_status_code()
        if 100 <= status < 200:
            if status == 101:
                raise ValueError("101 Switching Protocols: no upgrade was asked for")
            self._informational = True  # skipped, as aiohttp does: the answer follows
            self.headers.clear()
            return
        headers = self.headers
        encoding = headers.get("content-encoding", "identity").lower()
        if encoding not in ("", "identity"):
            raise ValueError(f"a {encoding[:40]!r}-encoded body (no compression was asked for)")
        self.status = status
        self._until_close = (
            "content-length" not in headers
            and "transfer-encoding" not in headers
            and status not in (204, 304)
        )
        self._head.set_result(None)

    def on_body(self, body: bytes) -> None:
        self._received += len(body)
        self._chunks.append(body)
        self._size += len(body)
        if self._size > HIGH_WATER and not self._whole and not self._paused:
            conn = self._conn
            if conn is not None and conn.transport is not None:
                self._paused = True
                conn.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        if self._informational:
            self._informational = False
            return
        parser = self._parser
        assert parser is not None
        self._reusable = self._reusable and parser.should_keep_alive()
        self._done = True
        self._wake()

    def ended(self, exc: BaseException | None) -> None:
        """The connection closed (or half-closed): the end of an until-close body when it closed
        cleanly, an error otherwise (a reset: nothing says the body was whole)."""
        if self._done or self._error is not None:
            return
        if self._head.done() and self._until_close and exc is None:
            self._reusable = False
            self._done = True
            self._wake()
        elif not self._head.done():
            self.fail(aiohttp.ServerDisconnectedError())
        else:
            detail = f": {exc}" if exc is not None else ""
            self.fail(aiohttp.ClientPayloadError(f"Response payload is not completed{detail}"))

    def fail(self, error: BaseException) -> None:
        if self._error is None and not self._done:
            self._error = error
            self._reusable = False
            if not self._head.done():
                self._head.set_exception(error)
                self._head.exception()  # retrieved: a caller gone meanwhile leaves no warning
            self._wake()
            conn = self._conn
            if conn is not None:
                conn.close()

    def _after_end(self, reason: str) -> None:
        """Bytes after the answer's end: the connection is closed, never pooled; a body not yet
        returned to the caller is not trusted either."""
        self._reusable = False
        if self._error is None:
            self._error = aiohttp.ClientPayloadError(
                f"invalid answer from the backend: bytes after its end ({reason})"
            )
        self._wake()
        conn = self._conn
        if conn is not None:
            conn.close()


class _Connection(asyncio.Protocol):
    """One keep-alive connection: at most one request on it at a time."""

    def __init__(self, pool: Upstream, key: Key) -> None:
        self.pool, self.key = pool, key
        self.transport: asyncio.Transport | None = None
        self.response: UpstreamResponse | None = None
        self.closed = False
        self.idle_since = 0.0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        response = self.response
        if response is None:  # bytes while idle: an answer to nothing, not to be trusted
            self.close()
            return
        response.feed(data)

    def eof_received(self) -> bool:
        if self.response is not None:
            self.response.ended(None)
        return False  # close the transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.transport = None
        if self.response is not None:
            self.response.ended(exc)
        self.pool.forget(self)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            if self.transport is not None:
                self.transport.close()
            self.pool.forget(self)


class Upstream:
    """Keep-alive connections per backend (scheme, host, port), most recently used first.
    `keepalive_s`: an idle connection is not used again after that long (vLLM closes its idle
    ones after VLLM_HTTP_TIMEOUT_KEEP_ALIVE seconds); None: one connection per request."""

    def __init__(self, keepalive_s: float | None) -> None:
        if keepalive_s is not None and not keepalive_s > 0:
            raise ValueError(f"keepalive_s must be > 0 or None, got {keepalive_s!r}")
        self.keepalive_s = keepalive_s
        # the head's end, as aiohttp writes it (`Connection: close` when nothing is pooled)
        self._end = b"Content-Length: %d\r\n" + (
            b"\r\n" if keepalive_s else b"Connection: close\r\n\r\n"
        )
        self._idle: dict[Key, list[_Connection]] = {}
        self._open: set[_Connection] = set()
        self._ssl: ssl.SSLContext | None = None

    async def post(
        self, url: yarl.URL, body: bytes | list[Buffer], headers: Mapping[str, str]
    ) -> UpstreamResponse:
        """POST `body` (bytes, or buffers written in turn: a request's inline media as it came,
        `proxy.body`) to `url` with `headers` (and Host, Content-Length, and Connection: close
        without keep-alive: the bytes aiohttp's client writes); the answer once its
        status line and headers are in. Call its `release()` when done with it."""
        key, head = _target(url)
        lines = [head]
        for name, value in headers.items():
            if "\r" in value or "\n" in value:
                raise ValueError(f"header {name}: a line break in {value[:80]!r}")
            lines.append(f"{name}: {value}\r\n".encode("utf-8", "surrogateescape"))
        size = len(body) if isinstance(body, bytes) else sum(memoryview(b).nbytes for b in body)
        lines.append(self._end % size)
        conn = self._take(key)
        if conn is None:
            conn = await self._connect(key)
        loop = asyncio.get_running_loop()
        response = conn.response = UpstreamResponse(conn, loop)
        transport = conn.transport
        assert transport is not None
        try:
            if not isinstance(body, bytes):
                transport.writelines([b"".join(lines), *body])
            elif len(body) < _SMALL_BODY:
                lines.append(body)
                transport.write(b"".join(lines))
            else:
                transport.writelines([b"".join(lines), body])
            await response._head
        except BaseException:  # cancelled (the client left) or failed: never reused
            response.release()  # not read to its end: closed
            raise
        return response

    def _take(self, key: Key) -> _Connection | None:
        idle = self._idle.get(key)
        if not idle:
            return None
        now = asyncio.get_running_loop().time()
        keepalive = self.keepalive_s or 0.0
        while idle:
            conn = idle.pop()
            if conn.closed:
                continue
            if now - conn.idle_since < keepalive:
                return conn
            conn.close()  # the ones below are older still
        return None

    async def _connect(self, key: Key) -> _Connection:
        scheme, host, port = key
        loop = asyncio.get_running_loop()
        context = None
        if scheme == "https":
            if self._ssl is None:
                self._ssl = ssl.create_default_context()
            context = self._ssl
        try:
            _, conn = await loop.create_connection(
                lambda: _Connection(self, key), host, port, ssl=context
            )
        except OSError as e:
            raise aiohttp.ClientOSError(
                e.errno,
                f"Cannot connect to host {host}:{port} ssl:{'default' if context else False} "
                f"[{e.strerror or e}]",
            ) from e
        self._open.add(conn)
        return conn

    def put(self, conn: _Connection) -> None:
        """Pool a connection whose answer was read to its end (closed without keep-alive)."""
        if self.keepalive_s is None or conn.closed:
            conn.close()
            return
        conn.idle_since = asyncio.get_running_loop().time()
        self._idle.setdefault(conn.key, []).append(conn)

    def connections(self) -> tuple[int, int]:
        """How many connections are open: idle (pooled) and busy (a request on them)."""
        idle = sum(len(conns) for conns in self._idle.values())
        return idle, len(self._open) - idle

    def forget(self, conn: _Connection) -> None:
        self._open.discard(conn)
        idle = self._idle.get(conn.key)
        if idle and conn in idle:
            idle.remove(conn)

    async def close(self) -> None:
        """Close every connection."""
        for conn in list(self._open):
            conn.close()
        self._idle.clear()
