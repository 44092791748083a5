"""Tiny stdlib HTTP helpers for the cluster: a solid-colour PNG data URL (pure Python, zlib) and
JSON POST/GET, so tests and people need neither pillow nor requests in mmreuse's venv."""

from __future__ import annotations

import base64
import json
import struct
import urllib.error
import urllib.request
import zlib
from typing import Any

from ..validate import check_int

__all__ = ["get_text", "image_part", "png_data_url", "post_json"]


def _chunk(kind: bytes, data: bytes) -> bytes:
    body = kind + data
    return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body) & 0xFFFFFFFF)


def png_data_url(width: int, height: int, rgb: tuple[int, int, int]) -> str:
    """A `data:image/png;base64,...` URL of a solid `rgb` image."""
    check_int("width", width, 1, 4096)
    check_int("height", height, 1, 4096)
    if len(rgb) != 3:
        raise ValueError(f"rgb must be 3 ints in [0, 255], got {rgb!r}")
    for i, c in enumerate(rgb):
        check_int(f"rgb[{i}]", c, 0, 255)
    row = b"\x00" + bytes(rgb) * width
    png = (
        b"\x89PNG\r\n\x1a\n"
        + _chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
        + _chunk(b"IDAT", zlib.compress(row * height))
        + _chunk(b"IEND", b"")
    )
    return "data:image/png;base64," + base64.b64encode(png).decode()


def image_part(url: str, uuid: str | None = None) -> dict[str, Any]:
    """An OpenAI chat `image_url` content part (with vLLM's `uuid` when given)."""
    part: dict[str, Any] = {"type": "image_url", "image_url": {"url": url}}
    if uuid is not None:
        part["uuid"] = uuid
    return part


def post_json(url: str, body: dict[str, Any], timeout: float = 120.0) -> dict[str, Any]:
    """POST `body` as JSON; the decoded JSON reply. An HTTP error raises urllib's HTTPError
    with the server's answer (vLLM says what it refused) in its message."""
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            reply: dict[str, Any] = json.loads(r.read())
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode(errors="replace")[:2000]
        raise urllib.error.HTTPError(
            exc.url, exc.code, f"{exc.reason}: {detail}", exc.headers, None
        ) from None
    return reply


def get_text(url: str, timeout: float = 30.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return str(r.read().decode())


def render(url: str, body: dict[str, Any], timeout: float = 60.0) -> Any:
    """vLLM's render of a chat request on the server at `url` (`mmreuse.render.render_body`:
    token ids, placeholders and identifiers, no encoder), as a `mmreuse.render.RenderedPrompt`."""
    from ..render import RENDER_PATH, from_render_json, render_body

    data = json.dumps(render_body(body)).encode()
    req = urllib.request.Request(f"{url}{RENDER_PATH}", data, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return from_render_json(r.read())
