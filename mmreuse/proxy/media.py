"""The media items of a chat request, their uuids, and the rewrite P/PD receives.

Byte-for-byte the rules of vLLM's reference EPD proxy (0.33.0 and 0.34.0,
`disagg_epd_proxy.py`): the uuid of an item is the client's `uuid`, else sha256 of its URL (or
of its JSON); P's KV block keys and the EC connector's files are keyed by it, so it must be the
same here.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import msgspec

from .errors import ProxyError

if TYPE_CHECKING:
    from .body import Blobs

MM_TYPES = frozenset({"image_url", "audio_url", "input_audio", "video_url"})

# The content type each media item becomes once E has published its embedding.
EMBEDS_TYPES = {
    "image_url": "image_embeds",
    "audio_url": "audio_embeds",
    "input_audio": "audio_embeds",
    "video_url": "video_embeds",
}

# vLLM's modality of each content type (the keys of render's `mm_hashes`).
MODALITY = {
    "image_url": "image",
    "audio_url": "audio",
    "input_audio": "audio",
    "video_url": "video",
}


def content_uuid(item: Mapping[str, Any], blobs: Blobs | None = None) -> str:
    """The reference's content key: sha256 of the item's URL string, else of its sorted JSON.
    `blobs`: the request's inline media (`proxy.body`), hashed as the text it stands for."""
    ref = item.get("image_url") or item.get("audio_url") or item.get("video_url") or {}
    url = ref.get("url") if type(ref) is dict or isinstance(ref, Mapping) else None
    if not url:
        check_named_by_json(item)
    if blobs is None:
        return hashlib.sha256((url or json.dumps(item, sort_keys=True)).encode()).hexdigest()
    h = hashlib.sha256()
    if url:
        blobs.update(h, url)
    else:
        blobs.update(h, json.dumps(item, sort_keys=True).encode(), json=True)
    return h.hexdigest()


def check_named_by_json(part: Any) -> None:
    """Refuse (a 400) a part to be named by its JSON (no URL: its sorted JSON is hashed, in one
    C call) that holds more than MAX_PART_VALUES values, before that JSON is written."""
    if _values_over(part, MAX_PART_VALUES):
        kind = part.get("type") if isinstance(part, Mapping) else None
        raise PartRefused(
            f"the {kind[:40]} part" if isinstance(kind, str) else "a media part",
            f"a media part named by its JSON (no URL) may hold at most {MAX_PART_VALUES} JSON "
            "values (its type, media, uuid and the few keys vLLM reads)",
        )


# The content types of a `*_embeds` part (a client's input, or the proxy's reference to E's).
EMBEDS_PARTS = frozenset(EMBEDS_TYPES.values())
_json = msgspec.json.Encoder().encode  # compact JSON: an unambiguous key, in C


def tenant_uuid(part: Mapping[str, Any], cache_salt: Any, blobs: Blobs | None = None) -> str:
    """`--uuid-policy tenant`: the part's uuid (the client's, else the reference's content key)
    namespaced by the request's cache salt, so that no tenant can name, or be served, another
    tenant's embedding (vLLM keys P's encoder cache and the EC store by uuid, unscoped):
    sha256 of `["mmreuse-tenant-v1", cache_salt, "uuid", <client uuid>]` (or `"content",
    <content key>`) as compact JSON."""
    return _tenant_prefix(cache_salt)(part, blobs)


def _tenant_prefix(cache_salt: Any) -> Any:
    """`tenant_uuid` for one salt, the salt hashed once: (part, blobs) -> uuid."""
    head = _json(["mmreuse-tenant-v1", cache_salt])
    prefix = hashlib.sha256(head[:-1] + b",")  # `["mmreuse-tenant-v1",<salt>,` then the key

    def name(part: Mapping[str, Any], blobs: Blobs | None) -> str:
        client = part.get("uuid")
        key = ["uuid", client] if client else ["content", content_uuid(part, blobs)]
        h = prefix.copy()
        rest = _json(key)[1:]
        if blobs is None:
            h.update(rest)
        else:
            blobs.update(h, rest, json=True)
        return h.hexdigest()

    return name


def namespace_uuids(request: dict[str, Any], blobs: Blobs | None = None) -> int:
    """Give every media part its tenant uuid, and every `*_embeds` part that carries a uuid
    (even `""`, which vLLM keeps as the item's identifier) its namespaced one, in place;
    returns how many parts changed. Parts are those `scan_parts` let through: their type says
    what vLLM takes them for. The salt is hashed once for the request."""
    name = _tenant_prefix(request.get("cache_salt"))
    n = 0
    for msg in request.get("messages") or ():
        content = msg.get("content") if isinstance(msg, Mapping) else None
        if not isinstance(content, list):
            continue
        for part in content:
            if not isinstance(part, dict):
                continue
            kind = part.get("type")
            if kind in MM_TYPES or (kind in EMBEDS_PARTS and part.get("uuid") is not None):
                part["uuid"] = name(part, blobs)
                n += 1
    return n


def item_uuid(item: Mapping[str, Any], blobs: Blobs | None = None) -> str:
    """The identifier the proxy gives an item: the client's `uuid`, else `content_uuid`."""
    return item.get("uuid") or content_uuid(item, blobs)


# vLLM's rule for a request's cache_salt (0.32-0.34 `validate_cache_salt`): a non-empty string of
# at most 128 characters, none of them '@', '/', '\' or NUL (the EC connectors' key separators).
MAX_CACHE_SALT_CHARS = 128
_SALT_FORBIDDEN = frozenset("@/\\\x00")


def check_cache_salt(request: Mapping[str, Any]) -> None:
    """Refuse (a 400, vLLM's words) a `cache_salt` every vLLM the proxy fronts refuses, before
    any work that reads it (naming hashes it per item). A salt long enough to be kept as inline
    media (`proxy.body`) is refused too: its placeholder holds a NUL."""
    salt = request.get("cache_salt")
    if salt is None:
        return
    if not isinstance(salt, str) or not salt:
        raise ProxyError(
            400, "Parameter 'cache_salt' must be a non-empty string if provided.", stage="proxy"
        )
    if len(salt) > MAX_CACHE_SALT_CHARS or not _SALT_FORBIDDEN.isdisjoint(salt):
        raise ProxyError(
            400,
            "Parameter 'cache_salt' must be at most 128 characters and must not contain '@', "
            "'/', '\\\\', or NUL.",
            stage="proxy",
        )


def extract_mm_items(request: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Every media part of `messages[*].content[*]`, in order (what E and render see)."""
    return scan_parts(request)


# vLLM's content-part parser (0.32 `_parse_chat_message_content_mm_part`, 0.33
# `parse_chat_message_content_mm_part`): the part types it knows, and, for a part with a `uuid`
# or without a `type`, the keys it probes, in its order, to decide what the part is.
VLLM_PART_TYPES = frozenset(
    {
        "text", "thinking", "input_text", "output_text", "input_image", "image_url",
        "image_embeds", "audio_embeds", "video_embeds", "prompt_embeds", "image_pil",
        "audio_url", "input_audio", "refusal", "video_url", "tool_reference",
    }
)  # fmt: skip
_PROBED_KEYS = (
    "image_url", "image_pil", "image_embeds", "audio_embeds", "video_embeds", "prompt_embeds",
    "audio_url", "input_audio", "video_url", "tool_reference",
)  # fmt: skip
# The kinds vLLM parses as media, each with its modality (what `--limit-mm-per-prompt` counts;
# prompt_embeds are not an encoder's item and are not counted).
MEDIA_KINDS: dict[str, str | None] = {
    **MODALITY,
    "input_image": "image",
    "image_pil": "image",
    "image_embeds": "image",
    "audio_embeds": "audio",
    "video_embeds": "video",
    "prompt_embeds": None,
}
# A part type vLLM reads as another kind when it carries a uuid (`input_image`, the Responses
# API's image part, is probed as `image_url`).
_KIND_OF_TYPE = {"input_image": "image_url"}
_DETAILS = ("low", "high", "auto")  # what vLLM's `input_image` part may say of its detail
DEFAULT_MM_LIMIT = 999  # vLLM's --limit-mm-per-prompt default, per modality
# The JSON values one media part named by its JSON may hold (no URL: `input_audio`, `*_embeds`),
# itself included: vLLM reads a type, the media (an audio's data and format), a detail and a
# uuid. Such a part's content key is its sorted JSON (`content_uuid`, `content.embeds_name`), one
# C call: bounded here, it cannot hold the event loop.
MAX_PART_VALUES = 64


def vllm_part_kind(part: Mapping[str, Any]) -> str | None:
    """What vLLM's parser takes a content part to be: its `type` when it knows that type and
    the part has no `uuid`, else (a uuid, or no type) the first media key the part carries,
    whatever its type. None where vLLM refuses the part ("Missing 'type' field").

    This is vLLM 0.32's reading. 0.33 reads one form otherwise: a `video_embeds` part with a
    uuid and an `audio_embeds` key is its video (the audio its track) to 0.33 and audio to 0.32.
    Read as audio here, such a part disagrees with its type and is refused (without a uuid both
    take it for the video), so no vLLM the proxy fronts sees media the proxy did not name."""
    kind = part.get("type")
    uuid = part.get("uuid")
    if uuid is None and type(kind) is str and kind in VLLM_PART_TYPES:
        return kind
    if kind is None or uuid is not None:
        for key in _PROBED_KEYS:
            if key in part:
                return key
        return None
    return kind if type(kind) is str else None


class PartRefused(ProxyError):
    """A content part the proxy cannot pass on safely: the client's request is refused."""

    def __init__(self, where: str, why: str) -> None:
        super().__init__(400, f"{where}: {why}", stage="proxy")


def scan_parts(
    request: Mapping[str, Any], limits: Mapping[str, int] | None = None
) -> list[dict[str, Any]]:
    """The request's media parts, in order, classified as vLLM classifies them; raises
    `PartRefused` (a 400 naming the part) for one the proxy would otherwise not see.

    vLLM decides that a part is media by its keys whenever it carries a `uuid` or has no `type`
    (`{"type": "text", "image_url": ..., "uuid": ...}` is an image to vLLM). Such a part, whose
    keys disagree with its type, would reach P unnamed and unchecked, so it is refused: media
    says what it is in `type`. A Responses-API `input_image` part is rewritten, in place, as the
    `image_url` part vLLM takes it for. Also refused:
    - more media items of a modality than `limits` allows (default 999, vLLM's), before any
      per-item work;
    - an `*_embeds` payload that is metadata only (a dict without a base64 tensor), wherever
      it sits: that is the proxy's own reference to E's output, and when P does not hold that
      embedding vLLM's engine dies (0.32: "Expected number of multimodal embeddings to match
      number of input items"), for every tenant. A payload of None (vLLM's "cached by uuid")
      is not one: P answers it from its processor cache or with a 400.
    """
    items: list[dict[str, Any]] = []
    counts: dict[str, int] = {}
    for i, msg in enumerate(request.get("messages") or ()):
        content = msg.get("content") if _is_mapping(msg) else None
        if type(content) is not list:
            continue
        for j, part in enumerate(content):
            if type(part) is not dict and not isinstance(part, Mapping):
                continue
            kind: Any = part.get("type")
            if part.get("uuid") is None and type(kind) is str and kind in VLLM_PART_TYPES:
                seen: str | None = kind  # vllm_part_kind's first case, inline: the common one
            else:
                seen = vllm_part_kind(part)
            if seen is None or seen not in MEDIA_KINDS:
                continue
            if seen != kind and seen != _KIND_OF_TYPE.get(kind):
                raise PartRefused(
                    f"messages[{i}].content[{j}]",
                    f"vLLM reads this part as {seen!r} by its keys, but its type is {kind!r}: "
                    "a media part must say what it is in 'type'",
                )
            if kind == "image_pil":  # over HTTP only `image_pil: null` + uuid, named by nobody
                raise PartRefused(
                    f"messages[{i}].content[{j}]",
                    "image_pil is not accepted over HTTP: an image cached by uuid is "
                    '{"type": "image_url", "image_url": null, "uuid": ...}',
                )
            if kind == "input_image":
                if seen == "input_image" and part.get("detail") not in _DETAILS:
                    continue  # vLLM refuses it (its Responses image part needs a detail)
                part = content[j] = _as_image_url(part)
                kind = "image_url"
            modality = MEDIA_KINDS[kind]
            if modality is not None:
                n = counts[modality] = counts.get(modality, 0) + 1
                limit = limits.get(modality, DEFAULT_MM_LIMIT) if limits else DEFAULT_MM_LIMIT
                if n > limit:
                    raise PartRefused(
                        f"messages[{i}].content[{j}]",
                        f"at most {limit} {modality} item(s) may be provided in one prompt "
                        "(--limit-mm-per-prompt)",
                    )
            if kind in MM_TYPES:
                items.append(part)
            elif kind in EMBEDS_PARTS:
                _check_embeds(part, kind, f"messages[{i}].content[{j}]")
                if kind == "video_embeds" and "audio_embeds" in part:
                    _check_embeds(part, "audio_embeds", f"messages[{i}].content[{j}]")
    return items


def _values_over(x: Any, budget: int) -> bool:
    """Whether `x` holds more than `budget` JSON values (itself included); visits at most
    `budget` + 1 of them."""
    stack = [x]
    while stack:
        v = stack.pop()
        budget -= 1
        if type(v) is dict:
            budget -= len(v)  # each key a value more
            if budget < len(v):
                return True
            stack.extend(v.values())
        elif type(v) is list:
            if budget < len(v):
                return True
            stack.extend(v)
        if budget < 0:
            return True
    return False


def _check_embeds(part: Mapping[str, Any], key: str, where: str) -> None:
    payload = part.get(key)
    if isinstance(payload, Mapping) and not any(type(v) is str for v in payload.values()):
        raise PartRefused(
            where,
            f"an embeds part must carry its embedding (a base64 tensor): {key} of metadata "
            "only is the proxy's reference to E's output, and when P does not hold that "
            "embedding vLLM's engine dies",
        )


def _as_image_url(part: Mapping[str, Any]) -> dict[str, Any]:
    """An `input_image` part as the `image_url` part vLLM parses it as (its URL a string)."""
    ref = part.get("image_url")
    out: dict[str, Any] = {
        "type": "image_url",
        "image_url": ref if _is_mapping(ref) else {"url": ref},
    }
    if "uuid" in part:
        out["uuid"] = part["uuid"]
    return out


def _is_mapping(x: Any) -> bool:
    return type(x) is dict or isinstance(x, Mapping)  # decoded JSON: dict, without the ABC's cost


def uses_audio_in_video(request: Mapping[str, Any]) -> bool:
    """Whether videos carry their audio track (one item, two features)."""
    kwargs = request.get("mm_processor_kwargs")
    return bool(isinstance(kwargs, Mapping) and kwargs.get("use_audio_in_video"))


def with_uuids(request: Mapping[str, Any], uuids: Sequence[str]) -> dict[str, Any]:
    """The request with media part i carrying `uuids[i]` (what render must see, so that its
    identifiers are those P will key by)."""
    return _map_items(request, lambda idx, part: {**part, "uuid": uuids[idx]})


def _map_items(request: Mapping[str, Any], fn: Any) -> dict[str, Any]:
    idx = 0
    messages = []
    for msg in request.get("messages") or ():
        content = msg.get("content") if isinstance(msg, Mapping) else None
        if not isinstance(content, list):
            messages.append(msg)
            continue
        new_content = []
        for part in content:
            if isinstance(part, Mapping) and part.get("type") in MM_TYPES:
                new_content.append(fn(idx, part))
                idx += 1
            else:
                new_content.append(part)
        messages.append({**msg, "content": new_content})
    return {**request, "messages": messages}


def rewrite_for_decode(
    request: Mapping[str, Any],
    item_meta: Mapping[int, list[dict[str, Any]]],
    raw_items: frozenset[int] = frozenset(),
    uuids: Sequence[str] | None = None,
    items: Sequence[Mapping[str, Any]] | None = None,
) -> dict[str, Any] | Mapping[str, Any]:
    """The body P/PD receives: each item E produced becomes a metadata-only reference
    (`{"type": "image_embeds", "image_embeds": {<E's metadata>}, "uuid": ...}`).

    `item_meta` is, per item index, the features E reported (modality, metadata, mm_hash,
    transfer_id), as the reference's `fanout_encoder_primer` returns. An item without metadata
    stays raw (P preprocesses it), as in the reference; an item in `raw_items` (skipped for E
    by a demand-aware policy) stays raw *with* its uuid, so P keys it as E would have and vLLM's
    own order applies (KV, encoder cache, EC connector, its own encoder). `uuids`: the items'
    uuids when already computed (else computed here), `items` its media parts likewise. Audio
    requests with an item lacking metadata stay raw entirely (the reference's rule: audio
    processors may consume other modalities' placeholders). vLLM refuses raw and embeds items of one modality in one
    request, so a modality that would mix goes raw with uuids (the reference sends the mix and
    P answers 400). Returns `request` itself when nothing changes.
    """
    if items is None:
        items = extract_mm_items(request)
    if uuids is None:
        uuids = [item_uuid(item) for item in items]
    raw_audio = any(
        item["type"] in ("audio_url", "input_audio")
        or (item["type"] == "video_url" and uses_audio_in_video(request))
        for item in items
    ) and any(
        not item_meta.get(i) or any(not f["metadata"] for f in item_meta[i])
        for i in range(len(items))
    )
    # Per item: "embeds" (E's metadata), "uuid" (raw, with its uuid) or "raw" (untouched).
    how: list[str] = []
    for i in range(len(items)):
        features = item_meta.get(i, [])
        if raw_audio or i in raw_items:
            how.append("uuid")
        elif not features or any(not f["metadata"] for f in features):
            how.append("raw")
        else:
            how.append("embeds")
    # vLLM refuses a request mixing raw and embeds inputs of one modality ("Mixing raw image
    # and embedding inputs is not allowed"): such a modality goes raw, each item with its uuid,
    # so P still finds E's embeddings by uuid (its encoder cache, then its EC connector).
    for modality in {MODALITY[item["type"]] for item in items}:
        kinds = {how[i] for i, item in enumerate(items) if MODALITY[item["type"]] == modality}
        if "embeds" in kinds and len(kinds) > 1:
            for i, item in enumerate(items):
                if MODALITY[item["type"]] == modality:
                    how[i] = "uuid"
    changed = 0
    transfer_items: list[dict[str, str]] = []

    def rewrite(idx: int, part: Mapping[str, Any]) -> Mapping[str, Any]:
        nonlocal changed
        features = item_meta.get(idx, [])
        for feature in features:
            if transfer_id := feature.get("transfer_id"):
                transfer_items.append({"mm_hash": feature["mm_hash"], "transfer_id": transfer_id})
        if how[idx] == "uuid":
            changed += 1
            return {**part, "uuid": uuids[idx]}
        if how[idx] == "raw":
            return part
        metadata = {
            f["modality"] + "_embeds": {
                k: [x for v in values for x in (v if isinstance(v, list) else [v])]
                for k, values in f["metadata"].items()
            }
            for f in features
        }
        changed += 1
        return {"type": EMBEDS_TYPES[part["type"]], **metadata, "uuid": uuids[idx]}

    rewritten = _map_items(request, rewrite)
    if not changed:
        return request
    if transfer_items:
        params = dict(request.get("ec_transfer_params") or {})
        params["ec_items"] = transfer_items
        rewritten["ec_transfer_params"] = params
    return rewritten
