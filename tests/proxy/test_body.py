"""`mmreuse.proxy.body`: the request body scanned before it is decoded (mmreuse._jsonscan), its
long plain strings kept as bytes and spliced back, byte for byte, wherever the request is
encoded or hashed; the bounds refused before any decode."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mmreuse._jsonscan import scan
from mmreuse.errors import InvalidArgument, InvalidArgumentType
from mmreuse.proxy import body
from mmreuse.proxy.body import Blobs, BodyLimits, BodyRefused, Out, decode, encode_json
from mmreuse.proxy.content import content_name, embeds_name
from mmreuse.proxy.errors import ProxyError
from mmreuse.proxy.media import content_uuid, tenant_uuid

_enc = msgspec.json.Encoder().encode


def join(out: Out) -> bytes:
    """What a backend receives of `out` (one buffer, or several written in turn)."""
    return out if isinstance(out, bytes) else b"".join(out)


LIMITS = BodyLimits()


def values_of(x: Any) -> int:
    """The values `scan` counts: the root, then each array element and object member."""
    if isinstance(x, dict):
        return 1 + sum(values_of(v) for v in x.values())
    if isinstance(x, list):
        return 1 + sum(values_of(v) for v in x)
    return 1


def depth_of(x: Any) -> int:
    if isinstance(x, dict):
        return 1 + max((depth_of(v) for v in x.values()), default=0)
    if isinstance(x, list):
        return 1 + max((depth_of(v) for v in x), default=0)
    return 0


def empty_containers(x: Any) -> int:
    if isinstance(x, dict):
        return (not x) + sum(empty_containers(v) for v in x.values())
    if isinstance(x, list):
        return (not x) + sum(empty_containers(v) for v in x)
    return 0


PLAIN = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), min_size=0, max_size=40)
TEXT = st.one_of(PLAIN, st.text(max_size=20))  # any text: escapes, non-ASCII, controls
JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | TEXT,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(TEXT, inner, max_size=5),
    max_leaves=30,
)


@contextlib.contextmanager
def small_blobs(n: int = 4) -> Iterator[None]:
    """`decode` keeps strings of `n` bytes or more as blobs (tests reach them with short ones)."""
    old = body.PLAIN_MIN
    body.PLAIN_MIN = n
    try:
        yield
    finally:
        body.PLAIN_MIN = old


# ---- the scan -----------------------------------------------------------------------------------


@settings(max_examples=300)
@given(JSON)
def test_the_scan_counts_values_and_depth_as_the_decoded_body_has_them(doc):
    raw = _enc(doc)
    values, depth, text, spans = scan(raw, 1 << 30)
    assert values == values_of(doc) + empty_containers(doc)  # `[]` counts as if it held one
    assert depth == depth_of(doc)
    assert text == len(raw) and spans == []


@settings(max_examples=300)
@given(JSON, st.integers(1, 12))
def test_the_scan_finds_exactly_the_long_plain_strings(doc, plain_min):
    raw = _enc(doc)
    *_, text, spans = scan(raw, plain_min)
    found = [raw[spans[k] : spans[k + 1]].decode() for k in range(0, len(spans), 2)]
    expected: list[str] = []

    def walk(x: Any) -> None:
        if isinstance(x, str):
            plain = all(0x20 <= ord(c) <= 0x7E and c not in '"\\' for c in x)
            if plain and len(x) >= plain_min:
                expected.append(x)
        elif isinstance(x, dict):
            for k, v in x.items():
                walk(k)
                walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)

    walk(doc)
    assert sorted(found) == sorted(expected)
    assert text == len(raw) - sum(map(len, found))


def test_the_scan_refuses_what_is_not_a_buffer_and_a_bad_minimum():
    with pytest.raises(TypeError):
        scan("{}", 4)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="plain_min must be >= 1"):
        scan(b"{}", 0)


# ---- decode and splice --------------------------------------------------------------------------


@settings(max_examples=300)
@given(JSON)
def test_a_body_decoded_with_blobs_encodes_back_byte_for_byte(doc):
    raw = _enc(doc)
    with small_blobs():
        obj, blobs = decode(raw, LIMITS)
    token = body.CURRENT.set(blobs)
    try:
        assert join(encode_json(obj)) == raw  # what any backend receives: msgspec's bytes
    finally:
        body.CURRENT.reset(token)
    if not blobs:
        assert obj == doc


def test_long_plain_strings_are_not_decoded_and_reach_backends_as_they_came():
    media = "data:image/png;base64," + "QUJD" * (body.PLAIN_MIN // 2)
    text = "a normal prompt"
    raw = _enc({"messages": [{"content": [{"type": "text", "text": text},
                                           {"type": "image_url", "image_url": {"url": media}}]}]})  # fmt: skip
    obj, blobs = decode(bytearray(raw), LIMITS)
    assert blobs is not None and len(blobs) == 1
    url = obj["messages"][0]["content"][1]["image_url"]["url"]
    assert url != media and len(url) < 80  # a placeholder, not the media
    assert obj["messages"][0]["content"][0]["text"] == text
    assert blobs.length(url) == len(media) and blobs.head(url, 5) == "data:"
    token = body.CURRENT.set(blobs)
    try:
        out = encode_json(obj)
        assert isinstance(out, list) and join(out) == raw
        assert any(isinstance(p, memoryview) and p.nbytes == len(media) for p in out)  # no copy
    finally:
        body.CURRENT.reset(token)


def test_a_placeholder_is_never_sent_outside_its_request():
    blobs = Blobs()
    placeholder = blobs.add(b"A" * 10)
    with pytest.raises(RuntimeError, match="outside its request"):
        encode_json({"url": placeholder})  # no request's blobs current
    other = Blobs()
    token = body.CURRENT.set(other)
    try:
        with pytest.raises(RuntimeError, match="outside its request"):
            encode_json({"url": placeholder})  # another request's
    finally:
        body.CURRENT.reset(token)


def test_a_clients_text_that_looks_like_a_placeholder_is_forwarded_as_it_came():
    blobs = Blobs()  # a request with blobs is in flight
    blobs.add(b"A" * 10)
    lookalike = {"text": f"\x00mmreuse-blob:{'0' * 32}:0\x00", "u": "\x00mmreuse-blob:x"}
    token = body.CURRENT.set(blobs)
    try:
        assert encode_json(lookalike) == _enc(lookalike)
    finally:
        body.CURRENT.reset(token)


@settings(max_examples=100)
@given(
    st.text(
        st.characters(min_codepoint=0x20, max_codepoint=0x7E, exclude_characters='"\\'),
        min_size=16,
        max_size=60,
    )
)
def test_uuids_of_blobs_are_the_uuids_of_the_text_they_stand_for(url):
    item = {"type": "image_url", "image_url": {"url": url}}
    audio = {"type": "input_audio", "input_audio": {"data": url, "format": "wav"}}
    doc = {"messages": [{"content": [item, audio]}], "cache_salt": "t1"}
    with small_blobs(16):  # longer than every key and type: the urls only
        obj, blobs = decode(_enc(doc), LIMITS)
    assert blobs is not None
    got_item, got_audio = obj["messages"][0]["content"]
    assert content_uuid(got_item, blobs) == content_uuid(item)
    assert content_uuid(got_audio, blobs) == content_uuid(audio)  # its sorted JSON, spliced
    assert tenant_uuid(got_item, "t1", blobs) == tenant_uuid(item, "t1")
    ref = got_item["image_url"]["url"]
    assert content_name("t1", "image", ref, blobs) == content_name("t1", "image", url)
    assert embeds_name("t1", "image_embeds", got_audio["input_audio"], blobs) == embeds_name(
        "t1", "image_embeds", audio["input_audio"]
    )


def test_tenant_uuids_hash_the_salt_once_and_name_as_before():
    part = {"type": "image_url", "image_url": {"url": "http://i/a.png"}, "uuid": "cat-1"}
    expected = hashlib.sha256(
        json.dumps(["mmreuse-tenant-v1", "s1", "uuid", "cat-1"], separators=(",", ":")).encode()
    ).hexdigest()
    assert tenant_uuid(part, "s1") == expected


# ---- the bounds ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "doc, limits, words",
    [
        ([[[[1]]]], BodyLimits(max_depth=3), "nested too deeply (4 levels, more than the 3"),
        ([1] * 10, BodyLimits(max_values=10), "holds 11 JSON values, more than --max-body-values"),
        ({"t": "x\n" * 10}, BodyLimits(max_text_bytes=20), "more than --max-body-text-bytes 20"),
    ],
)
def test_a_body_over_a_bound_is_refused_before_it_is_decoded(doc, limits, words):
    with pytest.raises(BodyRefused) as e:
        decode(_enc(doc), limits)
    assert e.value.status == 400 and words in e.value.detail


def test_inline_media_is_not_text_for_the_bound():
    media = "A" * body.PLAIN_MIN
    obj, blobs = decode(_enc({"u": media}), BodyLimits(max_text_bytes=64))
    assert blobs is not None and blobs.length(obj["u"]) == len(media)


@pytest.mark.parametrize("raw", [b"{", b'{"a": "' + b"A" * (70 << 10), b"[1,]", b'"\\x"'])
def test_what_is_not_json_is_a_400(raw):
    with pytest.raises(ProxyError) as e:
        decode(raw, LIMITS)
    assert e.value.status == 400 and "Invalid JSON body" in e.value.detail


@pytest.mark.parametrize("field", ["max_bytes", "max_values", "max_text_bytes", "max_depth"])
def test_body_limits_are_checked(field):
    with pytest.raises(InvalidArgument, match=f"BodyLimits.{field} must be >= 1, got 0"):
        BodyLimits(**{field: 0})
    with pytest.raises(InvalidArgumentType, match=f"BodyLimits.{field} must be an int"):
        BodyLimits(**{field: 1.5})


# ---- reading ------------------------------------------------------------------------------------


@pytest.mark.parametrize("size", [10, 3 << 20])
@pytest.mark.parametrize("chunked", [False, True])
async def test_a_body_is_read_whole_in_pieces_and_bounded(size, chunked):
    from aiohttp import web
    from aiohttp.test_utils import TestClient, TestServer

    got: list[Any] = []

    async def handler(request: web.Request) -> web.Response:
        try:
            got.append(bytes(await body.read_body(request, 2 << 20)))
        except ProxyError as e:
            return web.Response(status=e.status, text=str(e.detail))
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_post("/", handler)
    payload = bytes(range(256)) * (size // 256 + 1)
    payload = payload[:size]

    async def pieces():
        for i in range(0, len(payload), 1 << 16):
            yield payload[i : i + (1 << 16)]
            await asyncio.sleep(0)

    async with TestClient(TestServer(app)) as client:
        r = await client.post("/", data=pieces() if chunked else payload)
        if size > 2 << 20:
            assert r.status == 413 and "--max-body-bytes" in await r.text()
            assert got == []
        else:
            assert r.status == 200 and got == [payload]
