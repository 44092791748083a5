"""The simulator's request streams (`mmreuse.sim.workload`) as chat requests to the CPU cluster's
tiny model, so a real cluster can serve the very streams `mmreuse simulate` models.

Request k of a session resends its history, turns 0..k (`Session.turns`): each turn a user
message (text, then images), then, before the next turn, an assistant message. The tiny model's
tokenizer is byte-level BPE without merges, so a turn's N text tokens are N ASCII characters
(letters and digits: no special token can form), drawn from (run, session, turn). An image of N
tokens is a PNG of 28a x 28b pixels with a * b = N (Qwen2-VL merges 2x2 patches of 14 pixels),
which the image processor keeps as is only within its min/max pixels (4..16 tokens on the tiny
model): use `WorkloadConfig(image_tokens="fixed:16")` or a trace of such images. The PNG and its
uuid (`<run>-<image id>`) come from the image id alone, so an image shared by sessions is one
item to vLLM's caches, and the run's name keeps each run's caches cold (as `cache_salt` does for
the prefix cache). The chat template's own tokens (roles, the default system prompt, vision
markers) come on top of the simulator's counts: `text_tokens` and `image_tokens` are the
simulator's.

With `photos=True` every image is instead one of scikit-image's sample photographs
(`mmreuse.cluster.photos`: JPEG or PNG bytes as shipped, chosen from the image id), under the
same uuid: the image processor resizes it to its max pixels (16 tokens on the tiny model), so
the simulator's token counts (ServeGen's, in `servegen-photos`) are not the prompt's, and the
decode is a real photo's. With `answer_tokens=True` a request asks for its turn's answer
(`output_tokens`, at least 1 and at most `max_tokens`) instead of `max_tokens`."""

from __future__ import annotations

import base64
import hashlib
import json
import math
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache, lru_cache
from typing import Any

from ..errors import InvalidArgument
from ..sim.workload import SimRequest, Turn
from ..validate import check_bool, check_int, check_str, fail_type, fail_value, show
from .client import image_part
from .model import model_files
from .profile import TINY, ModelProfile

__all__ = ["ChatRequest", "chat_requests", "image_size", "image_url", "text"]

ALPHABET = b"abcdefghijklmnopqrstuvwxyz0123456789"
_TO_ALPHABET = bytes(ALPHABET[b % len(ALPHABET)] for b in range(256))
MAX_RATIO = 200  # Qwen2-VL's smart_resize refuses an aspect ratio above this
IMAGE_CACHE = 4096  # PNGs kept (each a few KiB): a stream's distinct images, across runs


@dataclass(frozen=True, slots=True)
class ChatRequest:
    """One SimRequest as a chat request: `body` for /v1/chat/completions; `uuids` its images'
    uuids in prompt order; `text_tokens` / `image_tokens` the simulator's prompt, split (the
    chat template adds its own tokens to the text)."""

    rid: int
    session: int
    turn: int
    arrival_s: float
    body: dict[str, Any]
    uuids: tuple[str, ...]
    text_tokens: int
    image_tokens: int


@cache
def _processor(profile: ModelProfile) -> tuple[int, int, int]:
    """(pixels per merged token's side, min pixels, max pixels) of `profile`'s processor,
    read from the preprocessor_config.json the cluster serves."""
    cfg = json.loads(model_files(profile)["preprocessor_config.json"])
    return cfg["patch_size"] * cfg["merge_size"], cfg["min_pixels"], cfg["max_pixels"]


def _token_range(profile: ModelProfile) -> tuple[int, int]:
    """The image token counts the processor keeps unresized: pixels within its min/max."""
    side, lo, hi = _processor(profile)
    return -(-lo // (side * side)), hi // (side * side)


def image_size(ident: str, tokens: int, profile: ModelProfile = TINY) -> tuple[int, int]:
    """(width, height) in pixels of an image of `tokens` tokens on `profile`'s model: 28b x 28a
    with a * b = tokens, as square as can be. InvalidArgument naming image `ident` for a count
    the image processor cannot produce (it would resize the image to another count)."""
    tokens = check_int(f"image {show(ident)} tokens", tokens, 1)
    side, _, _ = _processor(profile)
    lo, hi = _token_range(profile)
    rows = cols = 0
    if lo <= tokens <= hi:
        rows = max(d for d in range(1, math.isqrt(tokens) + 1) if tokens % d == 0)
        cols = tokens // rows
    if not rows or cols > MAX_RATIO * rows:
        fail_value(
            f"image {show(ident)} tokens",
            f"in [{lo}, {hi}], what the {profile.name} model's image processor keeps ({side}a x "
            f"{side}b pixels within its min/max pixels; WorkloadConfig.image_tokens='fixed:{hi}' "
            "fits)",
            tokens,
        )
    return cols * side, rows * side


def _chunk(kind: bytes, data: bytes) -> bytes:
    body = kind + data
    return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body) & 0xFFFFFFFF)


@lru_cache(maxsize=IMAGE_CACHE)
def image_url(ident: str, tokens: int, profile: ModelProfile = TINY) -> str:
    """A `data:image/png;base64,...` URL of image `ident` with `tokens` tokens (`image_size`):
    horizontal stripes, each row's colour drawn from the id, so distinct ids give distinct bytes
    and one id always the same bytes."""
    width, height = image_size(ident, tokens, profile)
    colours = hashlib.shake_256(ident.encode("utf-8", "surrogatepass")).digest(3 * height)
    raw = b"".join(b"\x00" + colours[3 * y : 3 * y + 3] * width for y in range(height))
    png = (
        b"\x89PNG\r\n\x1a\n"
        + _chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
        + _chunk(b"IDAT", zlib.compress(raw, 9))
        + _chunk(b"IEND", b"")
    )
    return "data:image/png;base64," + base64.b64encode(png).decode()


def text(run: str, session: int, turn: int, role: str, n: int) -> str:
    """`n` ASCII letters and digits (n tokens on the tiny model), drawn from (run, session,
    turn, role): the user's text or the assistant's answer of that turn."""
    if n == 0:
        return ""
    seed = json.dumps([run, session, turn, role]).encode()
    return hashlib.shake_256(seed).digest(n).translate(_TO_ALPHABET).decode("ascii")


def _check_run(run: Any) -> str:
    run = check_str("run", run, nonempty=True)
    try:
        run.encode("utf-8")
    except UnicodeEncodeError:
        fail_value("run", "valid Unicode (no lone surrogates)", run)
    return run


def _check_request(i: int, r: Any, sizes: dict[str, int]) -> list[Turn]:
    """Request i's turns, checked against its prompt (tokens, images and their ids), and its
    images' token counts against `sizes` (one id, one count: one uuid is one image)."""
    if not isinstance(r, SimRequest):
        fail_type(f"requests[{i}]", "a SimRequest", r)
    recorded = len(r.session.turns)
    if not 0 <= r.turn < recorded:
        fail_value(f"requests[{i}].turn", f"in [0, {recorded}) (its session's turns)", r.turn)
    turns = r.turns
    ids = [ident for t in turns for ident, _ in t.images]
    tokens = sum(t.text_tokens + sum(n for _, n in t.images) for t in turns)
    tokens += sum(t.output_tokens for t in turns[:-1])
    if tokens != r.num_tokens or ids != [m.identifier for m in r.mm]:
        raise InvalidArgument(
            f"requests[{i}]: its session's turns 0..{r.turn} hold {tokens} tokens and "
            f"{len(ids)} images, its prompt {r.num_tokens} tokens and {r.num_mm} images "
            "(or other image ids)"
        )
    for t in turns:
        for ident, n in t.images:
            if sizes.setdefault(ident, n) != n:
                raise InvalidArgument(
                    f"image {show(ident)} tokens: {sizes[ident]} in one place and {n} in "
                    f"another (requests[{i}]): one id must be one image, under one uuid"
                )
    return turns


def chat_requests(
    requests: Sequence[SimRequest],
    run: str,
    *,
    model: str = "tiny",
    max_tokens: int = 1,
    photos: bool = False,
    answer_tokens: bool = False,
    profile: ModelProfile = TINY,
) -> list[ChatRequest]:
    """Each request of a simulator stream, in order, as a chat request of run `run` (its
    `cache_salt`, and the prefix of its images' uuids) to `profile`'s model; the module
    docstring says how, and what `photos` and `answer_tokens` change."""
    if not isinstance(profile, ModelProfile):
        fail_type("profile", "a ModelProfile", profile)
    run = _check_run(run)
    model = check_str("model", model, nonempty=True)
    max_tokens = check_int("max_tokens", max_tokens, 1)
    photos = check_bool("photos", photos)
    answer_tokens = check_bool("answer_tokens", answer_tokens)
    if isinstance(requests, (str, bytes)) or not isinstance(requests, Sequence):
        fail_type("requests", "a sequence of SimRequest", requests)
    sizes: dict[str, int] = {}
    checked = [_check_request(i, r, sizes) for i, r in enumerate(requests)]
    if photos:
        from .photos import photo_for, photo_url

        def url(ident: str, n: int) -> str:
            return photo_url(photo_for(ident))
    else:

        def url(ident: str, n: int) -> str:
            return image_url(ident, n, profile)

        for ident, n in sizes.items():
            image_size(ident, n, profile)  # every image refused before any PNG is made
    texts: dict[tuple[int, int, str, int], str] = {}  # a session's texts, for all its requests

    def turn_text(sid: int, turn: int, role: str, n: int) -> str:
        key = (sid, turn, role, n)
        if key not in texts:
            texts[key] = text(run, sid, turn, role, n)
        return texts[key]

    out = []
    for r, turns in zip(requests, checked, strict=True):
        sid = r.session.sid
        messages: list[dict[str, Any]] = []
        uuids: list[str] = []
        text_tokens = image_tokens = 0
        for j, t in enumerate(turns):
            if j:
                answer = turns[j - 1].output_tokens
                messages.append(
                    {"role": "assistant", "content": turn_text(sid, j - 1, "assistant", answer)}
                )
                text_tokens += answer
            content: list[dict[str, Any]] = []
            if t.text_tokens or not t.images:
                content.append({"type": "text", "text": turn_text(sid, j, "user", t.text_tokens)})
            for ident, n in t.images:
                uuid = f"{run}-{ident}"
                content.append(image_part(url(ident, n), uuid))
                uuids.append(uuid)
                image_tokens += n
            messages.append({"role": "user", "content": content})
            text_tokens += t.text_tokens
        body = {
            "model": model,
            "messages": messages,
            "max_tokens": min(max_tokens, max(1, turns[-1].output_tokens))
            if answer_tokens
            else max_tokens,
            "temperature": 0,
            "return_token_ids": True,
            "cache_salt": run,
        }
        out.append(
            ChatRequest(
                r.rid,
                sid,
                r.turn,
                r.arrival_ms / 1000.0,
                body,
                tuple(uuids),
                text_tokens,
                image_tokens,
            )
        )
    return out
