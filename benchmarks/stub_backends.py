"""Instant stub vLLM servers (E and PD) for the proxy overhead benchmark.

They answer as fast as a raw asyncio HTTP/1.1 keep-alive server on uvloop can, so that the proxy
in front of them is the bottleneck. The E stub reads the encoder sub-request and answers the
`ec_transfer_params` vLLM 0.33's encoder reports: one entry per media item, keyed by the item's
`uuid`, with its position in the sub-request and a placeholder grid. The PD stub answers a fixed
chat.completion, or a few SSE chunks and `data: [DONE]` when the request streams, and renders
(POST /v1/chat/completions/render, for `--policy index`). Both answer
GET /health, GET /v1/models, GET /stats (counters the benchmark uses to check that each proxy
did the same work: encoder items, raw vs. rewritten images reaching PD) and GET /last (the last
chat body received, to compare what each proxy sends on the wire).

    python benchmarks/stub_backends.py --role e|pd --port N [--host 127.0.0.1]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import re
import signal
import sys
import time
from collections.abc import Callable
from typing import Any, cast

try:
    import msgspec

    _decode: Callable[[bytes], Any] = msgspec.json.decode
    _encode: Callable[[Any], bytes] = msgspec.json.encode
except ImportError:  # pragma: no cover - the project venv has msgspec
    _decode = json.loads

    def _encode(obj: Any) -> bytes:
        return json.dumps(obj, separators=(",", ":")).encode()


MM_TYPES = frozenset({"image_url", "audio_url", "input_audio", "video_url"})
MODEL = "stub-model"
GRID = [1, 8, 8]
_STREAM_RE = re.compile(rb'"stream"\s*:\s*true')
_RAW_IMAGE_RE = re.compile(rb'"type"\s*:\s*"image_url"')
_EMBEDS_RE = re.compile(rb'"type"\s*:\s*"image_embeds"')
_MAX_HEAD = 64 * 1024
_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed"}


def _response(status: int, body: bytes, ctype: bytes = b"application/json") -> bytes:
    head = (
        f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}\r\n"
        f"content-length: {len(body)}\r\n"
        "connection: keep-alive\r\n"
    ).encode()
    return head + b"content-type: " + ctype + b"\r\n\r\n" + body


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def _completion() -> bytes:
    return _encode(
        {
            "id": "chatcmpl-stub",
            "object": "chat.completion",
            "created": 1700000000,
            "model": MODEL,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "A stub answer."},
                    "logprobs": None,
                    "finish_reason": "stop",
                }
            ],
            "usage": {"prompt_tokens": 16, "completion_tokens": 4, "total_tokens": 20},
        }
    )


def _stream_body() -> bytes:
    """A whole SSE answer (role chunk, three content chunks, finish, [DONE]), chunk-encoded."""
    deltas: list[dict[str, Any]] = [{"role": "assistant", "content": ""}]
    deltas += [{"content": word} for word in ("A ", "stub ", "answer.")]
    events = []
    for i, delta in enumerate([*deltas, {}]):
        finish = "stop" if i == len(deltas) else None
        chunk = {
            "id": "chatcmpl-stub",
            "object": "chat.completion.chunk",
            "created": 1700000000,
            "model": MODEL,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
        }
        events.append(b"data: " + _encode(chunk) + b"\n\n")
    events.append(b"data: [DONE]\n\n")
    return b"".join(_chunk(e) for e in events) + b"0\r\n\r\n"


COMPLETION = _completion()
COMPLETION_RESPONSE = _response(200, COMPLETION)
STREAM_RESPONSE = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
    b"transfer-encoding: chunked\r\nconnection: keep-alive\r\n\r\n" + _stream_body()
)
HEALTH_RESPONSE = _response(200, b"", b"text/plain")
MODELS_RESPONSE = _response(
    200,
    _encode(
        {
            "object": "list",
            "data": [{"id": MODEL, "object": "model", "created": 1700000000, "owned_by": "stub"}],
        }
    ),
)


class Stats:
    """What one stub has seen, for GET /stats."""

    def __init__(self) -> None:
        self.requests = 0
        self.chat = 0
        self.stream = 0
        self.items = 0
        self.raw_images = 0
        self.embeds = 0
        self.bytes_in = 0
        self.errors = 0
        self.last_chat = b"{}"  # the last chat body, for GET /last (not a counter)

    def as_json(self) -> bytes:
        return _encode({k: v for k, v in vars(self).items() if k != "last_chat"})


def encoder_answer(body: bytes, stats: Stats) -> bytes:
    """The E answer to an encoder sub-request: `ec_transfer_params` keyed by each item's uuid
    (sha256 of its URL when the proxy sent none, as with --no-rewrite)."""
    req = _decode(body)
    params: dict[str, Any] = {}
    index = 0
    for msg in req.get("messages", ()):
        content = msg.get("content")
        if not isinstance(content, list):
            continue
        for item in content:
            kind = item.get("type")
            if kind not in MM_TYPES:
                continue
            key = item.get("uuid")
            if not key:
                url = (item.get(kind) or {}).get("url") or ""
                key = hashlib.sha256(url.encode()).hexdigest()
            modality = "image" if kind == "image_url" else kind.split("_")[0]
            params[key] = {
                "modality": "audio" if kind == "input_audio" else modality,
                "item_indices": [index],
                "metadata": {"image_grid_thw": GRID},
            }
            index += 1
    stats.items += index
    return _encode(
        {
            "id": "chatcmpl-stub-e",
            "object": "chat.completion",
            "created": 1700000000,
            "model": req.get("model") or MODEL,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": "length",
                }
            ],
            "usage": {"prompt_tokens": 64 * index, "completion_tokens": 0, "total_tokens": 0},
            "ec_transfer_params": params,
        }
    )


IMAGE_TOKENS = 16  # Qwen2-VL's grid [1, 8, 8] merged 2x2
IMAGE_PAD = 151655


def render_answer(body: bytes) -> bytes:
    """vLLM's render (`"mm_payload": "none"`) of a chat request, as a PD started with
    --enable-scale-out answers it: one token per 4 bytes of text, IMAGE_TOKENS placeholders
    per image, each image named by its uuid (the proxy sends them filled in)."""
    req = _decode(body)
    tokens: list[int] = [1]
    ids, ranges = [], []
    for msg in req.get("messages", ()):
        content = msg.get("content")
        parts = [{"type": "text", "text": content}] if isinstance(content, str) else content or []
        for part in parts:
            if part.get("type") == "text":
                text = part.get("text") or ""
                tokens += [100 + (b % 1000) for b in text.encode()[::4]]
            elif part.get("type") in MM_TYPES:
                ids.append(part["uuid"])
                ranges.append({"offset": len(tokens), "length": IMAGE_TOKENS})
                tokens += [IMAGE_PAD] * IMAGE_TOKENS
    features = {"mm_hashes": {"image": ids}, "mm_placeholders": {"image": ranges}}
    out: dict[str, Any] = {"request_id": "render-stub", "token_ids": tokens}
    out["features"] = features if ids else None
    if req.get("cache_salt") is not None:
        out["cache_salt"] = req["cache_salt"]
    return _encode(out)


def dechunk(buf: bytearray, start: int) -> tuple[bytes, int] | None:
    """Decode a chunked body starting at `start`: (body, end offset), or None if incomplete."""
    out = bytearray()
    pos = start
    while True:
        eol = buf.find(b"\r\n", pos)
        if eol < 0:
            return None
        size = int(bytes(buf[pos:eol]).split(b";", 1)[0], 16)
        pos = eol + 2
        if size == 0:
            end = buf.find(b"\r\n\r\n", pos - 2)  # trailers end with an empty line
            return (bytes(out), end + 4) if end >= 0 else None
        if len(buf) < pos + size + 2:
            return None
        out += buf[pos : pos + size]
        pos += size + 2


class StubProtocol(asyncio.Protocol):
    """One keep-alive connection: parse pipelined HTTP/1.1 requests, answer each at once."""

    def __init__(self, role: str, stats: Stats) -> None:
        self.role = role
        self.stats = stats
        self.buf = bytearray()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while self.transport is not None:
            head_end = self.buf.find(b"\r\n\r\n")
            if head_end < 0:
                if len(self.buf) > _MAX_HEAD:
                    self._fail()
                return
            lines = bytes(self.buf[:head_end]).split(b"\r\n")
            try:
                method, target, version = lines[0].split(b" ", 2)
            except ValueError:
                self._fail()
                return
            length = 0
            chunked = close = False
            for line in lines[1:]:
                name, _, value = line.partition(b":")
                name = name.strip().lower()
                if name == b"content-length":
                    length = int(value)
                elif name == b"transfer-encoding" and b"chunked" in value.lower():
                    chunked = True
                elif name == b"connection":
                    close = value.strip().lower() == b"close"
            close = close or version == b"HTTP/1.0"
            start = head_end + 4
            if chunked:
                parsed = dechunk(self.buf, start)
                if parsed is None:
                    return
                body, end = parsed
            else:
                if len(self.buf) < start + length:
                    return
                end = start + length
                body = bytes(self.buf[start:end])
            del self.buf[:end]
            self.stats.requests += 1
            self.stats.bytes_in += end
            self.transport.write(self.answer(method, target.split(b"?", 1)[0], body))
            if close:
                self.transport.close()
                self.transport = None

    def answer(self, method: bytes, path: bytes, body: bytes) -> bytes:
        if path == b"/v1/chat/completions/render" and self.role == "pd" and method == b"POST":
            try:
                return _response(200, render_answer(body))
            except Exception as exc:
                self.stats.errors += 1
                return _response(400, _encode({"error": str(exc)}))
        if path == b"/v1/chat/completions":
            if method != b"POST":
                return _response(405, b'{"error":"method"}')
            self.stats.chat += 1
            self.stats.last_chat = body
            if self.role == "e":
                try:
                    return _response(200, encoder_answer(body, self.stats))
                except Exception as exc:
                    self.stats.errors += 1
                    return _response(400, _encode({"error": str(exc)}))
            self.stats.raw_images += len(_RAW_IMAGE_RE.findall(body))
            self.stats.embeds += len(_EMBEDS_RE.findall(body))
            if _STREAM_RE.search(body):
                self.stats.stream += 1
                return STREAM_RESPONSE
            return COMPLETION_RESPONSE
        if method == b"GET":
            if path == b"/health":
                return HEALTH_RESPONSE
            if path == b"/v1/models":
                return MODELS_RESPONSE
            if path == b"/stats":
                return _response(200, self.stats.as_json())
            if path == b"/last":
                return _response(200, self.stats.last_chat)
        return _response(404, b'{"error":"not found"}')

    def _fail(self) -> None:
        self.stats.errors += 1
        if self.transport is not None:
            self.transport.write(_response(400, b'{"error":"bad request"}'))
            self.transport.close()
            self.transport = None

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None


async def serve(role: str, host: str, port: int) -> None:
    """Serve until SIGTERM/SIGINT."""
    stats = Stats()
    loop = asyncio.get_running_loop()
    server = await loop.create_server(
        lambda: StubProtocol(role, stats), host, port, reuse_address=True, backlog=1024
    )
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(f"stub {role} listening on {host}:{port} at {time.time():.3f}", flush=True)
    async with server:
        await stop.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--role", choices=("e", "pd"), required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--no-uvloop", action="store_true", help="use asyncio's default loop")
    args = parser.parse_args(argv)
    run: Callable[[Any], Any] = asyncio.run
    if not args.no_uvloop:
        try:
            import uvloop

            run = uvloop.run
        except ImportError:
            print("uvloop not installed; using asyncio's loop", file=sys.stderr)
    run(serve(args.role, args.host, args.port))
    return 0


if __name__ == "__main__":
    sys.exit(main())
