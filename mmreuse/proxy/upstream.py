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
"""

from __future__ import annotations

import asyncio
import collections
import functools
import re
import ssl
from collections.abc import Mapping

import aiohttp
import yarl

# Unread body bytes above which a connection stops reading (a stream forwarded to a slow
# client), and below which it reads again.
HIGH_WATER = 1 << 20
LOW_WATER = 1 << 18
MAX_HEAD = 1 << 16  # status line and headers: an answer with more is refused
_SMALL_BODY = 1 << 14  # joined with the head into one write below this; two writes above

# Parser states.
_HEAD, _LENGTH, _CHUNK_SIZE, _CHUNK_DATA, _CHUNK_END, _TRAILER, _UNTIL_CLOSE, _DONE = range(8)

Key = tuple[str, str, int]
_STATUS = re.compile(rb"HTTP/1\.[01] ([1-5][0-9][0-9])(?: .*)?")
_CHUNK_SIZE_LINE = re.compile(rb"([0-9A-Fa-f]{1,15})[ \t]*(?:;.*)?")


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
    the connection when the body was read to its end and closes it otherwise."""

    __slots__ = (
        "_body",
        "_buf",
        "_chunks",
        "_conn",
        "_error",
        "_head",
        "_left",
        "_paused",
        "_reusable",
        "_size",
        "_state",
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
        self._state = _HEAD
        self._left = 0  # bytes left: of the body (Content-Length) or of the current chunk
        self._buf = bytearray()  # received, not yet parsed
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
        while self._state != _DONE:
            if self._error is not None:
                raise self._error
            await self._wait()
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
            if self._state == _DONE:
                return b""
            if self._error is not None:
                raise self._error
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
        if conn is None:
            return
        conn.response = None
        if self._state == _DONE and self._reusable and self._error is None:
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
        if self._state == _LENGTH and not self._buf and len(data) <= self._left:
            self._push(data)  # the common case: body bytes, not past its end
            self._left -= len(data)
            if not self._left:
                self._finish()
            return
        self._buf += data
        try:
            self._parse()
        except (ValueError, UnicodeDecodeError) as e:
            self.fail(aiohttp.ClientPayloadError(f"invalid answer from the backend: {e}"))

    def _parse(self) -> None:
        buf = self._buf
        while buf:
            state = self._state
            if state == _HEAD:
                end = buf.find(b"\r\n\r\n")
                if end < 0:
                    if len(buf) > MAX_HEAD:
                        raise ValueError(f"a head over {MAX_HEAD} bytes")
                    return
                head = bytes(buf[:end])
                del buf[: end + 4]
                self._start(head)
            elif state in (_LENGTH, _CHUNK_DATA):
                n = min(self._left, len(buf))
                self._push(bytes(buf[:n]))
                del buf[:n]
                self._left -= n
                if not self._left:
                    if state == _LENGTH:
                        self._finish()
                    else:
                        self._state = _CHUNK_END
            elif state == _CHUNK_SIZE:
                end = buf.find(b"\r\n")
                if end < 0:
                    if len(buf) > 4096:
                        raise ValueError("a chunk size line over 4096 bytes")
                    return
                line = _CHUNK_SIZE_LINE.fullmatch(buf, 0, end)
                if line is None:
                    raise ValueError(f"chunk size line {bytes(buf[:end][:80])!r}")
                size = int(line.group(1), 16)
                del buf[: end + 2]
                self._state, self._left = (_CHUNK_DATA, size) if size else (_TRAILER, 0)
            elif state == _CHUNK_END:
                if len(buf) < 2:
                    return
                if buf[:2] != b"\r\n":
                    raise ValueError("no CRLF after a chunk")
                del buf[:2]
                self._state = _CHUNK_SIZE
            elif state == _TRAILER:
                end = buf.find(b"\r\n")
                if end < 0:
                    return
                del buf[: end + 2]
                if end == 0:
                    self._finish()
            elif state == _UNTIL_CLOSE:
                self._push(bytes(buf))
                buf.clear()
            else:  # bytes past the answer's end: the connection cannot be trusted again
                self._reusable = False
                buf.clear()

    def _start(self, head: bytes) -> None:
        """The status line and headers: how the body is framed."""
        lines = head.split(b"\r\n")
        match = _STATUS.fullmatch(lines[0])
        if match is None:
            raise ValueError(f"status line {lines[0][:80]!r}")
        version, status = lines[0][:8], int(match.group(1))
        if 100 <= status < 200 and status != 101:  # informational: the answer follows
            return
        headers = self.headers
        for line in lines[1:]:
            name, sep, value = line.partition(b":")
            if not sep:
                raise ValueError(f"header line {line[:80]!r}")
            headers[name.strip().lower().decode("latin-1")] = value.strip().decode("latin-1")
        self.status = status
        connection = headers.get("connection", "").lower()
        if connection == "close" or (version == b"HTTP/1.0" and connection != "keep-alive"):
            self._reusable = False
        encoding = headers.get("content-encoding", "identity").strip().lower()
        if encoding not in ("", "identity"):
            raise ValueError(f"a {encoding[:40]!r}-encoded body (no compression was asked for)")
        if "chunked" in headers.get("transfer-encoding", "").lower():
            self._state = _CHUNK_SIZE
        elif (length := headers.get("content-length")) is not None:
            if not length.isdigit():
                raise ValueError(f"Content-Length {length[:40]!r}")
            self._left = int(length)
            self._state = _LENGTH
            if not self._left:
                self._finish()
        elif status in (101, 204, 304):
            self._finish()
        else:
            self._state = _UNTIL_CLOSE
            self._reusable = False
        if not self._head.done():
            self._head.set_result(None)

    def _push(self, data: bytes) -> None:
        if data:
            self._chunks.append(data)
            self._size += len(data)
            if self._size > HIGH_WATER and not self._whole and not self._paused:
                conn = self._conn
                if conn is not None and conn.transport is not None:
                    self._paused = True
                    conn.transport.pause_reading()
            self._wake()

    def _finish(self) -> None:
        self._state = _DONE
        if self._buf:
            self._reusable = False
            self._buf.clear()
        self._wake()

    def ended(self, exc: BaseException | None) -> None:
        """The connection closed (or half-closed): the end of an until-close body, an error
        otherwise."""
        if self._state == _UNTIL_CLOSE:
            self._finish()
        elif self._state != _DONE:
            if not self._head.done():
                self.fail(aiohttp.ServerDisconnectedError())
            else:
                detail = f": {exc}" if exc is not None else ""
                self.fail(aiohttp.ClientPayloadError(f"Response payload is not completed{detail}"))

    def fail(self, error: BaseException) -> None:
        if self._error is None and self._state != _DONE:
            self._error = error
            self._reusable = False
            if not self._head.done():
                self._head.set_exception(error)
                self._head.exception()  # retrieved: a caller gone meanwhile leaves no warning
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
        self, url: yarl.URL, body: bytes, headers: Mapping[str, str]
    ) -> UpstreamResponse:
        """POST `body` to `url` with `headers` (and Host, Content-Length, and Connection: close
        without keep-alive: the bytes aiohttp's client writes); the answer once its
        status line and headers are in. Call its `release()` when done with it."""
        key, head = _target(url)
        lines = [head]
        for name, value in headers.items():
            if "\r" in value or "\n" in value:
                raise ValueError(f"header {name}: a line break in {value[:80]!r}")
            lines.append(f"{name}: {value}\r\n".encode("utf-8", "surrogateescape"))
        lines.append(self._end % len(body))
        conn = self._take(key)
        if conn is None:
            conn = await self._connect(key)
        loop = asyncio.get_running_loop()
        response = conn.response = UpstreamResponse(conn, loop)
        transport = conn.transport
        assert transport is not None
        try:
            if len(body) < _SMALL_BODY:
                lines.append(body)
                transport.write(b"".join(lines))
            else:
                transport.writelines([b"".join(lines), body])
            await response._head
        except BaseException:  # cancelled (the client left) or failed: never reused
            conn.response = None
            conn.close()
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
