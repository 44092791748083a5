"""A chat request's body: read in pieces, bounded before it is decoded, and decoded with its
inline media left as the bytes it came in.

A request's bulk is its inline media (base64 in data: URLs and `input_audio`), up to
`--max-body-bytes`. Decoding it into Python strings, and encoding it again for E, P and D, are C
calls that hold the GIL for as long as they run (~0.1 s per 16-64 MiB here, with the page faults
of fresh buffers), so one request's media would hold every other client, in a thread too. Here
the body is first scanned in C with the GIL released (`mmreuse._jsonscan`): its values, depth
and the bytes that are not inline media are bounded before anything is decoded (`BodyLimits`: a
400 naming the bound, and the flag), and each string of PLAIN_MIN bytes or more of plain ASCII
(0x20-0x7e, no quote or backslash) becomes a blob. In the decoded request a placeholder string
stands for it; the bytes it came as are spliced back wherever the request is encoded for a
backend (`encode_json`) or hashed (`Blobs.update`, the uuids). Plain ASCII is its own JSON and
its own text, so a backend receives byte for byte what encoding the decoded string would give,
and a uuid is what hashing it would give.

A placeholder is `\\x00mmreuse-blob:<nonce>:<k>\\x00`, the nonce fresh from os.urandom for each
request's `Blobs`: no client can write one of another request's (a client's own text that looks
like one is forwarded as it came), and `encode_json` refuses to send a live request's placeholder
from anywhere but that request (a bug, never bytes silently sent in place of media).
"""

from __future__ import annotations

import asyncio
import contextvars
import os
import weakref
from dataclasses import dataclass
from typing import Any, NoReturn, Protocol

import msgspec
from aiohttp import web

from .._jsonscan import scan
from ..errors import InvalidArgument, InvalidArgumentType
from .errors import ProxyError

# In a body kept off the event loop, a plain-ASCII string at least this long is kept as the
# bytes it came in: every inline image (the smallest PNG is ~100 bytes of base64; a thumbnail a
# few KB), and any long plain text, which needs no decoding either.
PLAIN_MIN = 1 << 10

_enc = msgspec.json.Encoder()
_MARK = "\x00mmreuse-blob:"  # a placeholder's start, as text
_MARK_JSON = b"\\u0000mmreuse-blob:"  # ... and as JSON writes it (msgspec and json.dumps alike)
_END = "\x00"
_END_JSON = b"\\u0000"

Buffer = bytes | bytearray | memoryview
Out = bytes | list[Buffer]  # what a backend is sent: one buffer, or several to write in turn


class Hasher(Protocol):
    def update(self, data: Buffer, /) -> None: ...


@dataclass(frozen=True, slots=True)
class BodyLimits:
    """What one request body may hold: bytes in all (`--max-body-bytes`), JSON values (an
    object's member counting as one; `--max-body-values`), bytes that are not inline media
    (strings of PLAIN_MIN bytes or more of plain ASCII; `--max-body-text-bytes`) and nesting.
    Each bounds what a request costs the proxy's event loop before any of it is spent."""

    max_bytes: int = 256 << 20
    max_values: int = 1 << 17
    max_text_bytes: int = 8 << 20
    max_depth: int = 128

    def __post_init__(self) -> None:
        for name in ("max_bytes", "max_values", "max_text_bytes", "max_depth"):
            value = getattr(self, name)
            if type(value) is not int:
                raise InvalidArgumentType(f"BodyLimits.{name} must be an int, got {value!r}")
            if value < 1:
                raise InvalidArgument(f"BodyLimits.{name} must be >= 1, got {value!r}")


class Blobs:
    """One request's inline media: the bytes of each long plain string, by placeholder."""

    __slots__ = ("__weakref__", "_json_mark", "_parts", "_text_mark", "nonce")  # weakref: finalize

    def __init__(self) -> None:
        self.nonce = os.urandom(16).hex()
        self._text_mark = f"{_MARK}{self.nonce}:"
        self._json_mark = self._text_mark.replace("\x00", "\\u0000").encode()
        self._parts: list[tuple[Buffer, ...]] = []
        _LIVE.add(self.nonce)
        weakref.finalize(self, _LIVE.discard, self.nonce)

    def __len__(self) -> int:
        return len(self._parts)

    def add(self, *parts: Buffer) -> str:
        """A placeholder for the plain-ASCII text that `parts` are, in order."""
        self._parts.append(parts)
        return f"{self._text_mark}{len(self._parts) - 1}{_END}"

    def json_placeholder(self, k: int) -> bytes:
        """Placeholder k as the contents of a JSON string."""
        return self._json_mark + b"%d" % k + _END_JSON

    def size(self, k: int) -> int:
        return sum(memoryview(p).nbytes for p in self._parts[k])

    def length(self, s: str) -> int:
        """`s`'s length with each of this request's blobs counted whole (a placeholder is short)."""
        n, at = len(s), 0
        while (i := s.find(self._text_mark, at)) >= 0:
            end = s.find(_END, i + 1)
            k = _index(s[i + len(self._text_mark) : end])
            if k is None or k >= len(self._parts):
                at = i + 1
                continue
            n += self.size(k) - (end + 1 - i)
            at = end + 1
        return n

    def head(self, s: str, n: int) -> str:
        """`s[:n]`, read through a blob that `s` starts with."""
        k = self._starts_with(s)
        if k is None:
            return s[:n]
        text = b"".join(bytes(memoryview(p)[:n]) for p in self._parts[k])[:n].decode("ascii")
        if len(text) < n:
            text += s[s.find(_END, 1) + 1 :]
        return text[:n]

    def _starts_with(self, s: str) -> int | None:
        if not s.startswith(self._text_mark):
            return None
        k = _index(s[len(self._text_mark) : s.find(_END, 1)])
        return k if k is not None and k < len(self._parts) else None

    def splice(self, out: bytes, *, json: bool = True) -> Out:
        """`out` (JSON, or text with `json=False`) with this request's placeholders replaced by
        their bytes: `out` itself when it has none, else the buffers to write in turn."""
        mark = self._json_mark if json else self._text_mark.encode()
        end_mark = _END_JSON if json else b"\x00"
        at = out.find(mark)
        if at < 0:
            return out
        view = memoryview(out)
        pieces: list[Buffer] = []
        start = 0
        while at >= 0:
            end = out.find(end_mark, at + len(mark))
            k = _index(out[at + len(mark) : end].decode("ascii", "replace")) if end > 0 else None
            if k is None or k >= len(self._parts):
                at = out.find(mark, at + 1)
                continue
            pieces.append(view[start:at])
            pieces.extend(self._parts[k])
            start = end + len(end_mark)
            at = out.find(mark, start)
        pieces.append(view[start:])
        return pieces

    def update(self, h: Hasher, data: bytes | str, *, json: bool = False) -> None:
        """Feed `data` (text, or JSON with `json=True`) to `h`, this request's blobs spliced
        in: what hashing the decoded request's real text gives."""
        raw = data.encode() if isinstance(data, str) else data
        out = self.splice(raw, json=json)
        if isinstance(out, bytes):
            h.update(out)
            return
        for piece in out:
            h.update(piece)


def _index(digits: str) -> int | None:
    return int(digits) if digits.isascii() and digits.isdigit() and len(digits) < 12 else None


# The nonce of every request's Blobs while it is alive (`encode_json`'s check), and the Blobs of
# the large request the current task serves (set by the chat route for the request's lifetime):
# while it is set, what grows with the body (walking, encoding, splicing it) runs in a thread.
_LIVE: set[str] = set()
CURRENT: contextvars.ContextVar[Blobs | None] = contextvars.ContextVar(
    "mmreuse_request_blobs", default=None
)


async def encode_body(obj: Any) -> Out:
    """`encode_json`, in a thread while the current task serves a large request (`CURRENT`)."""
    if not _LIVE:  # no large request in flight: nothing to splice (the common path)
        return _enc.encode(obj)
    if CURRENT.get() is None:
        return encode_json(obj)
    return await asyncio.to_thread(encode_json, obj)


def encode_json(obj: Any) -> Out:
    """`obj` as JSON for a backend, the current request's blobs spliced in (msgspec's bytes
    when no request with blobs is in flight). A live request's placeholder met anywhere else
    raises RuntimeError: never sent in place of the media it stands for."""
    out = _enc.encode(obj)
    if not _LIVE or out.find(_MARK_JSON) < 0:
        return out
    blobs = CURRENT.get()
    at = out.find(_MARK_JSON)
    while at >= 0:  # a client's own text may look like a placeholder: only live nonces count
        nonce = out[at + len(_MARK_JSON) : at + len(_MARK_JSON) + 32].decode("ascii", "replace")
        if nonce in _LIVE and (blobs is None or nonce != blobs.nonce):
            raise RuntimeError(
                "a request's inline-media placeholder was about to be sent outside its request"
            )
        at = out.find(_MARK_JSON, at + 1)
    return out if blobs is None else blobs.splice(out)


def size_of(out: Out) -> int:
    """How many bytes `out` is."""
    if isinstance(out, bytes):
        return len(out)
    return sum(memoryview(p).nbytes for p in out)


# ---- reading and decoding ------------------------------------------------------------------------


class BodyRefused(ProxyError):
    """A body over one of `BodyLimits`, or not JSON: refused before it is decoded."""

    def __init__(self, status: int, why: str) -> None:
        super().__init__(status, why, stage="proxy")


async def read_body(request: web.Request, max_bytes: int) -> bytes | bytearray:
    """The request's body as sent, at most `max_bytes` (a 413 past it): a compressed one is
    refused (415), never inflated (aiohttp's default inflates, and its size limit applies to the
    inflated bytes: a decompression bomb). A large body is read in pieces into one buffer, so
    no copy of it is made on the event loop at once (aiohttp's `read()` makes one at the end,
    and `bytearray(n)` zeroes n bytes); reading stops at the first piece past `max_bytes`."""
    encoding = request.headers.get("Content-Encoding")
    if encoding is not None and encoding.strip().lower() not in ("", "identity"):
        raise ProxyError(
            415,
            f"Content-Encoding {encoding[:40]!r} is not accepted: send the body uncompressed",
            stage="proxy",
        )
    content = request.content
    first = await content.readany()  # a small body is one piece: returned as it came
    more = await content.readany() if first else b""
    if not more:
        if len(first) > max_bytes:
            raise _too_big(max_bytes)
        return first
    buf = bytearray(first)  # grown as bytes arrive (realloc moves no bytes at this size: mremap)
    while more:
        if len(buf) + len(more) > max_bytes:
            raise _too_big(max_bytes)
        buf += more
        more = await content.readany()
    return buf


def _too_big(max_bytes: int) -> ProxyError:
    return ProxyError(
        413, f"the request body is over {max_bytes} bytes (--max-body-bytes)", stage="proxy"
    )


_decode = msgspec.json.Decoder()
_NEVER = 1 << 62  # a `plain_min` no string reaches: a small body keeps none as a blob


def _refuse(values: int, depth: int, text: int, limits: BodyLimits) -> NoReturn:
    if depth > limits.max_depth:
        raise BodyRefused(
            400,
            f"Invalid JSON body: nested too deeply ({depth} levels, more than the "
            f"{limits.max_depth} the proxy reads)",
        )
    if values > limits.max_values:
        raise BodyRefused(
            400,
            f"the request body holds {values} JSON values, more than --max-body-values "
            f"{limits.max_values}",
        )
    raise BodyRefused(
        400,
        f"the request body has {text} bytes that are not inline media (strings of "
        f"{PLAIN_MIN} bytes or more of plain ASCII), more than --max-body-text-bytes "
        f"{limits.max_text_bytes}",
    )


def decode(
    raw: bytes | bytearray, limits: BodyLimits, *, keep: bool = True
) -> tuple[Any, Blobs | None]:
    """`raw` decoded, its long plain strings kept as blobs (`keep`, a large body: its Blobs,
    empty where it has none; else None: a small body, decoded whole on the event loop); refused
    (a 400 naming the bound) when over `limits`, before any of it is decoded. Holds the GIL only
    for the decode of what is not inline media, which `limits` bound (`max_text_bytes` counts,
    unless `keep`, every byte)."""
    values, depth, text, spans = scan(raw, PLAIN_MIN if keep else _NEVER)
    if values > limits.max_values or depth > limits.max_depth or text > limits.max_text_bytes:
        _refuse(values, depth, text, limits)
    if not keep:
        return _decoded(raw), None
    blobs = Blobs()
    small: Buffer = raw
    if spans:
        view = memoryview(raw)
        pieces: list[Buffer] = []
        at = 0
        for k in range(0, len(spans), 2):
            start, end = spans[k], spans[k + 1]
            pieces.append(view[at:start])
            blobs.add(view[start:end])
            pieces.append(blobs.json_placeholder(k // 2))
            at = end
        pieces.append(view[at:])
        small = b"".join(pieces)
    return _decoded(small), blobs


def _decoded(raw: Buffer) -> Any:
    try:
        return _decode.decode(raw)
    except msgspec.DecodeError as e:
        raise BodyRefused(400, f"Invalid JSON body: {e}") from e
    except RecursionError:  # msgspec's own depth limit
        raise BodyRefused(400, "Invalid JSON body: nested too deeply") from None
