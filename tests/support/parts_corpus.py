"""Content parts in every combination of type, uuid and media keys that matters to vLLM's
parser: the corpus the proxy's part classification is checked on against vLLM's own."""

from __future__ import annotations

import itertools
from typing import Any

TYPES: tuple[Any, ...] = (
    None, "text", "input_text", "thinking", "refusal", "image_url", "input_image",
    "image_embeds", "audio_embeds", "video_embeds", "prompt_embeds", "image_pil", "audio_url",
    "input_audio", "video_url", "tool_reference", "not-a-type", 5,
)  # fmt: skip
UUIDS: tuple[Any, ...] = ("-", "u", "", None)  # "-": no uuid key at all
URL = "http://media.invalid/a.png"
META = {"image_grid_thw": [1, 2, 2]}
KEYS: tuple[dict[str, Any], ...] = (
    {},
    {"text": "hi"},
    {"image_url": {"url": URL}},
    {"image_url": URL},
    {"image_url": None},
    {"image_url": URL, "detail": "auto"},
    {"text": "hi", "image_url": {"url": URL}},
    {"image_embeds": META},
    {"image_embeds": "AAAA"},
    {"audio_embeds": "AAAA"},
    {"video_embeds": "AAAA", "audio_embeds": META},
    {"image_url": {"url": URL}, "image_embeds": META},
    {"audio_url": {"url": URL}},
    {"input_audio": {"data": "AAAA", "format": "wav"}},
    {"video_url": {"url": URL}},
    {"image_pil": None},
    {"prompt_embeds": "AAAA", "data": "AAAA"},
    {"tool_reference": "t", "name": "t"},
)


def parts() -> list[dict[str, Any]]:
    out = []
    for kind, uuid, keys in itertools.product(TYPES, UUIDS, KEYS):
        part: dict[str, Any] = {} if kind is None else {"type": kind}
        part.update(keys)
        if uuid != "-":
            part["uuid"] = uuid
        out.append(part)
    return out
