"""The proxy's backend connections (`mmreuse.proxy.upstream`): framing, pooling, errors."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
import struct
from collections.abc import AsyncIterator, Callable

import aiohttp
import pytest
import yarl

from mmreuse.proxy import upstream as upstream_mod
from mmreuse.proxy.upstream import Upstream
from tests.support.waiting import WAIT_S, async_wait_for


async def wait_for(cond: Callable[[], object]) -> None:
    """Until `cond()` holds (a hang guard, not a timing check)."""
    assert await async_wait_for(cond), "the condition never held"


Reply = Callable[[bytes], list[bytes]]  # request bytes -> the chunks to write back


@contextlib.asynccontextmanager
async def server(
    reply: Reply, *, close_after: bool = False, tls: ssl.SSLContext | None = None
) -> AsyncIterator[tuple[str, dict]]:
    """A raw HTTP/1.1 server (HTTPS with `tls`) answering each request with `reply(request)`'s
    chunks; `seen` counts the connections and requests."""
    seen = {"connections": 0, "requests": [], "closed": 0}

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen["connections"] += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    int(line.split(b":", 1)[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length:")
                )
                request = head + await reader.readexactly(length)
                seen["requests"].append(request)
                for chunk in reply(request):
                    writer.write(chunk)
                    await writer.drain()
                if close_after:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            seen["closed"] += 1
            writer.close()

    srv = await asyncio.start_server(handle, "127.0.0.1", 0, ssl=tls)
    port = srv.sockets[0].getsockname()[1]
    scheme = "https" if tls else "http"
    try:
        yield f"{scheme}://127.0.0.1:{port}/v1/chat/completions", seen
    finally:
        srv.close()


def fixed(*chunks: bytes) -> Reply:
    return lambda _request: list(chunks)


def ok_with(body: bytes) -> bytes:
    """A 200 answer framed by Content-Length, carrying `body`."""
    return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body


OK = b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 11\r\n\r\n{"a": true}'


async def post(up: Upstream, url: str, body: bytes = b"{}") -> tuple[int, dict[str, str], bytes]:
    resp = await up.post(yarl.URL(url), body, {"x-request-id": "r1", "Content-Type": "x/y"})
    try:
        return resp.status, resp.headers, await resp.read()
    finally:
        resp.release()


async def test_the_request_on_the_wire():
    async with server(fixed(OK)) as (url, seen):
        up = Upstream(2.0)
        status, headers, body = await post(up, url, b'{"q": 1}')
        assert (status, body) == (200, b'{"a": true}')
        assert headers["content-type"] == "application/json"
        port = yarl.URL(url).port
        assert seen["requests"][0] == (
            b"POST /v1/chat/completions HTTP/1.1\r\n"
            + f"Host: 127.0.0.1:{port}\r\n".encode()
            + b'x-request-id: r1\r\nContent-Type: x/y\r\nContent-Length: 8\r\n\r\n{"q": 1}'
        )
        await up.close()


async def test_a_large_body_is_sent_whole():
    body = b"x" * (3 << 20)
    async with server(fixed(OK)) as (url, seen):
        up = Upstream(2.0)
        assert (await post(up, url, body))[0] == 200
        assert seen["requests"][0].endswith(b"\r\n\r\n" + body)
        await up.close()


@pytest.mark.parametrize("split", [1, 3, 1000])
async def test_chunked_answers_are_decoded_however_they_arrive(split):
    wire = (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"5;ext=1\r\nhello\r\n6\r\n world\r\n0\r\nX-Trailer: 1\r\n\r\n"
    )
    pieces = [wire[i : i + split] for i in range(0, len(wire), split)]
    async with server(fixed(*pieces)) as (url, seen):
        up = Upstream(2.0)
        assert await post(up, url) == (200, {"transfer-encoding": "chunked"}, b"hello world")
        assert await post(up, url) == (200, {"transfer-encoding": "chunked"}, b"hello world")
        assert seen["connections"] == 1  # read to its end: pooled, used again
        await up.close()


async def test_readany_returns_the_body_as_it_comes_then_empty():
    wire = [b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n"]

    async with server(lambda _r: wire) as (url, _seen):
        up = Upstream(2.0)
        resp = await up.post(yarl.URL(url), b"{}", {})
        try:
            assert await resp.readany() == b"abc"
            reader = asyncio.ensure_future(resp.readany())
            await asyncio.sleep(0)
            assert not reader.done()
            reader.cancel()
        finally:
            resp.release()  # not read to its end: closed, not pooled
        assert not up._idle.get(("http", "127.0.0.1", yarl.URL(url).port))
        await up.close()


async def test_an_answer_until_close_and_a_connection_close_are_not_pooled():
    async with server(fixed(b"HTTP/1.1 200 OK\r\n\r\nall of it"), close_after=True) as (url, seen):
        up = Upstream(2.0)
        assert await post(up, url) == (200, {}, b"all of it")
        assert await post(up, url) == (200, {}, b"all of it")
        assert seen["connections"] == 2
        await up.close()
    close = b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nok"
    async with server(fixed(close), close_after=True) as (url, seen):
        up = Upstream(2.0)
        assert (await post(up, url))[2] == b"ok"
        assert (await post(up, url))[2] == b"ok"
        assert seen["connections"] == 2
        await up.close()


async def test_idle_connections_are_retired_after_keepalive_s(monkeypatch):
    async with server(fixed(OK)) as (url, seen):
        up = Upstream(30.0)
        await post(up, url)
        await post(up, url)
        assert seen["connections"] == 1
        up.keepalive_s = 1e-9  # every pooled connection is now too old to be used again
        await post(up, url)
        assert seen["connections"] == 2
        await wait_for(lambda: seen["closed"] == 1)  # the retired one was closed
        await up.close()


async def test_no_keepalive_means_a_connection_per_request():
    async with server(fixed(OK)) as (url, seen):
        up = Upstream(None)
        await post(up, url)
        await post(up, url)
        assert seen["connections"] == 2
        assert seen["requests"][0].endswith(b"Content-Length: 2\r\nConnection: close\r\n\r\n{}")
        await up.close()


async def test_a_backend_that_hangs_up_before_answering():
    async with server(lambda _r: [], close_after=True) as (url, _seen):
        up = Upstream(2.0)
        with pytest.raises(aiohttp.ServerDisconnectedError):
            await post(up, url)
        await up.close()


async def test_a_body_cut_short_is_a_payload_error():
    cut = b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly this"
    async with server(fixed(cut), close_after=True) as (url, _seen):
        up = Upstream(2.0)
        with pytest.raises(aiohttp.ClientPayloadError, match="not completed"):
            await post(up, url)
        await up.close()


@pytest.mark.parametrize(
    "wire",
    [
        b"SPDY 200 OK\r\n\r\n",
        b"HTTP/1.1 2000 OK\r\nContent-Length: 0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0x5\r\nhello\r\n0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n+5\r\nhello\r\n0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Encoding: gzip\r\nContent-Length: 1\r\n\r\nx",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
        b"HTTP/1.1 200 OK\r\nbroken header\r\n\r\n",
    ],
)
async def test_an_invalid_answer_is_refused(wire):
    async with server(fixed(wire)) as (url, _seen):
        up = Upstream(2.0)
        with pytest.raises(aiohttp.ClientPayloadError, match="invalid answer"):
            await post(up, url)
        await up.close()


async def test_an_informational_answer_is_skipped():
    """1xx answers before the real one are skipped, as aiohttp skips them: their headers are
    not the answer's, and the connection stays reusable."""
    early = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </x>\r\n\r\n"
    async with server(fixed(early + OK)) as (url, seen):
        up = Upstream(2.0)
        status, headers, body = await post(up, url)
        assert (status, body) == (200, b'{"a": true}')
        assert "link" not in headers
        assert await post(up, url) == (status, headers, body)
        assert seen["connections"] == 1
        await up.close()


async def test_no_server_is_a_client_error_naming_the_host():
    up = Upstream(2.0)
    async with server(fixed(OK)) as (url, _seen):
        pass  # closed: nothing listens there now
    with pytest.raises(aiohttp.ClientOSError, match=r"Cannot connect to host 127\.0\.0\.1"):
        await post(up, url)


async def test_a_cancelled_request_closes_its_connection():
    async with server(lambda _r: []) as (url, seen):  # never answers
        up = Upstream(2.0)
        task = asyncio.ensure_future(post(up, url))
        await wait_for(lambda: len(seen["requests"]) == 1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await wait_for(lambda: seen["closed"] == 1)  # the backend sees the client go
        await up.close()


async def test_a_slow_reader_pauses_the_backend(monkeypatch):
    monkeypatch.setattr(upstream_mod, "HIGH_WATER", 1000)
    big = b"y" * 100_000
    async with server(fixed(ok_with(big))) as (url, _seen):
        up = Upstream(2.0)
        resp = await up.post(yarl.URL(url), b"{}", {})
        try:
            await wait_for(lambda: resp._paused)
            got = b""
            while chunk := await resp.readany():
                got += chunk
            assert got == big
        finally:
            resp.release()
        await up.close()


async def test_an_answer_that_ended_while_its_reader_lagged_is_pooled_reading(monkeypatch):
    # The whole answer arrived while reading was paused (more unread than HIGH_WATER) and the
    # caller let go of it unread (a streaming client that left): the pooled connection must read
    # again, or the next request on it waits for an answer it never reads.
    monkeypatch.setattr(upstream_mod, "HIGH_WATER", 1000)
    body = b"z" * 5000
    async with server(fixed(ok_with(body))) as (url, seen):
        up = Upstream(2.0)
        resp = await up.post(yarl.URL(url), b"{}", {})
        await wait_for(lambda: resp._done)
        assert resp._paused
        resp.release()  # unread
        again = await asyncio.wait_for(up.post(yarl.URL(url), b"{}", {}), WAIT_S)
        try:
            assert await asyncio.wait_for(again.read(), WAIT_S) == body
        finally:
            again.release()
        assert seen["connections"] == 1  # the same connection, reused
        await up.close()


async def test_an_answer_until_close_cut_by_a_reset_is_not_whole():
    # No length, no chunking: the body ends when the connection does. A clean close ends it;
    # a reset says nothing of what was lost, so the body is refused.
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\n\r\npartial")
        await writer.drain()
        await asyncio.sleep(0.05)  # under test: the body's first bytes are read before the reset
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort()  # an RST, not a FIN

    srv = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    up = Upstream(2.0)
    try:
        resp = await up.post(yarl.URL(f"http://127.0.0.1:{port}/x"), b"{}", {})
        try:
            with pytest.raises(aiohttp.ClientPayloadError):
                await asyncio.wait_for(resp.read(), WAIT_S)
        finally:
            resp.release()
        assert not up._idle  # never pooled
    finally:
        await up.close()
        srv.close()
        await srv.wait_closed()


def test_settings_are_checked():
    with pytest.raises(ValueError, match="keepalive_s"):
        Upstream(0.0)


async def test_header_values_cannot_inject_lines():
    up = Upstream(2.0)
    with pytest.raises(ValueError, match="line break"):
        await up.post(yarl.URL("http://127.0.0.1:1/x"), b"", {"x-request-id": "a\r\nX: y"})


# ---- hostile backends: each answer refused with aiohttp's error, its connection closed and never
# pooled, and the next request on the same pool served by a fresh connection ---------------------

OK_HEADERS = {"content-type": "application/json", "content-length": "11"}


def first_then_ok(*chunks: bytes) -> Reply:
    """`chunks` for the first request the server sees, OK for every later one."""
    calls = [0]

    def reply(_request: bytes) -> list[bytes]:
        calls[0] += 1
        return list(chunks) if calls[0] == 1 else [OK]

    return reply


async def refused_then_served(
    reply: Reply, error: type[BaseException], match: str | None, *, close_after: bool = False
) -> None:
    async with server(reply, close_after=close_after) as (url, seen):
        up = Upstream(2.0)
        key = ("http", "127.0.0.1", yarl.URL(url).port)
        with pytest.raises(error, match=match):
            await post(up, url)
        assert not up._idle.get(key)  # not pooled
        await wait_for(lambda: seen["closed"] == 1)  # closed, by one end or the other
        assert not up._open
        assert await post(up, url) == (200, OK_HEADERS, b'{"a": true}')
        assert seen["connections"] == 2
        await up.close()


BAD_FRAMING = {
    "status line without a code": b"HTTP/1.1 OK\r\nContent-Length: 0\r\n\r\n",
    "status line of another protocol": b"HTTP/2 200 OK\r\nContent-Length: 0\r\n\r\n",
    "a negative chunk size": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n-5\r\nhello\r\n",
    "a chunk size over 64 bits": (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n1" + b"f" * 16 + b"\r\nab\r\n"
    ),
    "no CRLF after a chunk": (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nabc\r\n0\r\n\r\n"
    ),
    "Content-Length and Transfer-Encoding": (
        b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"5\r\nhello\r\n0\r\n\r\n"
    ),
    "two differing Content-Lengths": (
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 5\r\n\r\nhello"
    ),
    "a Content-Length over 64 bits": (
        b"HTTP/1.1 200 OK\r\nContent-Length: 99999999999999999999999\r\n\r\nx"
    ),
    "a transfer coding other than chunked": (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\nxyz"
    ),
    "two Transfer-Encodings": (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"0\r\n\r\n"
    ),
    "a folded header": b"HTTP/1.1 200 OK\r\nX: a\r\n b\r\nContent-Length: 0\r\n\r\n",
    "a bare LF": b"HTTP/1.1 200 OK\nContent-Length: 0\n\n",
    "101 Switching Protocols": (
        b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: h2c\r\nConnection: Upgrade\r\n\r\n"
    ),
}


@pytest.mark.parametrize("wire", BAD_FRAMING.values(), ids=BAD_FRAMING.keys())
async def test_a_badly_framed_answer_is_refused(wire):
    await refused_then_served(first_then_ok(wire), aiohttp.ClientPayloadError, "invalid answer")


@pytest.mark.parametrize("pieces", [1, 64])
async def test_a_head_over_the_limit_is_refused(pieces):
    """Whole in one write, or in pieces that never end it: refused once over MAX_HEAD, not
    held in memory until the backend stops."""
    head = b"HTTP/1.1 200 OK\r\nX-Big: " + b"a" * upstream_mod.MAX_HEAD
    wire = head + b"\r\nContent-Length: 0\r\n\r\n" if pieces == 1 else head
    step = -(-len(wire) // pieces)
    chunks = [wire[i : i + step] for i in range(0, len(wire), step)]
    await refused_then_served(first_then_ok(*chunks), aiohttp.ClientPayloadError, "head over")


async def test_endless_chunk_framing_is_refused():
    """Chunk extensions or trailers that never end carry no body byte: bounded like a head."""
    wire = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n1;" + b"e" * 70_000
    await refused_then_served(first_then_ok(wire), aiohttp.ClientPayloadError, "chunk framing")


@pytest.mark.parametrize(
    "after",
    [
        b"GARBAGE",  # a body longer than its Content-Length
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nno",  # two answers to one request
    ],
    ids=["garbage", "a second answer"],
)
async def test_bytes_after_the_answer_are_refused_and_never_read_as_the_next(after):
    await refused_then_served(
        first_then_ok(OK + after), aiohttp.ClientPayloadError, "after its end"
    )


async def test_bytes_after_a_connection_close_answer_are_refused():
    wire = b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nokEXTRA"
    await refused_then_served(first_then_ok(wire), aiohttp.ClientPayloadError, "after its end")


async def test_bytes_after_a_released_answer_close_its_pooled_connection():
    """What comes after the answer, once released, is an answer to nothing: the idle connection
    is closed, and the next request gets a fresh one."""
    async with server(first_then_ok(OK)) as (url, seen):
        up = Upstream(2.0)
        assert (await post(up, url))[0] == 200
        (conn,) = up._open
        conn.data_received(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
        assert conn.closed and not up._open
        assert (await post(up, url))[0] == 200
        assert seen["connections"] == 2
        await up.close()


EOF_CASES = {
    "mid-head": (b"HTTP/1.1 200 OK\r\nContent-Le", aiohttp.ServerDisconnectedError, None),
    "mid-body": (
        b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc",
        aiohttp.ClientPayloadError,
        "not completed",
    ),
    "mid-chunk": (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhel",
        aiohttp.ClientPayloadError,
        "not completed",
    ),
    "before the last chunk": (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n",
        aiohttp.ClientPayloadError,
        "not completed",
    ),
    "after an informational answer": (
        b"HTTP/1.1 100 Continue\r\n\r\n",
        aiohttp.ServerDisconnectedError,
        None,
    ),
}


@pytest.mark.parametrize("case", EOF_CASES.values(), ids=EOF_CASES.keys())
async def test_a_backend_that_hangs_up_mid_answer(case):
    wire, error, match = case
    await refused_then_served(first_then_ok(wire), error, match, close_after=True)


async def test_an_answer_that_never_ends_is_closed_when_its_caller_cancels():
    """The caller's cancel (its timeout, the client gone) closes the connection: no hang, no
    connection left open on either end."""
    wire = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n"
    async with server(first_then_ok(wire)) as (url, seen):
        up = Upstream(2.0)
        got = []

        async def stream() -> None:
            resp = await up.post(yarl.URL(url), b"{}", {})
            try:
                while chunk := await resp.readany():
                    got.append(chunk)
            finally:
                resp.release()

        task = asyncio.ensure_future(stream())
        await wait_for(lambda: got == [b"abc"])
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not up._open and not any(up._idle.values())
        await wait_for(lambda: seen["closed"] == 1)
        assert await post(up, url) == (200, OK_HEADERS, b'{"a": true}')
        await up.close()
        await wait_for(lambda: seen["closed"] == 2)


# ---- https ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ca():
    trustme = pytest.importorskip("trustme")
    return trustme.CA()


def tls_server_context(ca) -> ssl.SSLContext:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(context)
    return context


async def test_https_backends_are_verified_against_the_default_trust_store(
    ca, tmp_path, monkeypatch
):
    """`https://` backend URLs (the config accepts them) go over TLS with the default
    verification, whose trust store SSL_CERT_FILE points at the test CA; pooled as plain ones."""
    pem = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(pem))
    monkeypatch.setenv("SSL_CERT_FILE", str(pem))
    async with server(fixed(OK), tls=tls_server_context(ca)) as (url, seen):
        assert url.startswith("https://")
        up = Upstream(2.0)
        assert await post(up, url) == (200, OK_HEADERS, b'{"a": true}')
        assert await post(up, url) == (200, OK_HEADERS, b'{"a": true}')
        assert seen["connections"] == 1
        await up.close()


async def test_https_with_an_untrusted_certificate_is_a_client_error(ca):
    async with server(fixed(OK), tls=tls_server_context(ca)) as (url, seen):
        up = Upstream(2.0)
        with pytest.raises(aiohttp.ClientOSError, match=r"ssl:default.*CERTIFICATE_VERIFY_FAILED"):
            await post(up, url)
        assert not up._open and not seen["requests"]
        await up.close()
