"""The media items of a chat request, their uuids, and the rewrite P/PD receives.

Byte-for-byte the rules of vLLM's reference EPD proxy (0.33.0, `disagg_epd_proxy.py`): the uuid
of an item is the client's `uuid`, else sha256 of its URL (or of its JSON); P's KV block keys
and the EC connector's files are keyed by it, so it must be the same here.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

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


def content_uuid(item: Mapping[str, Any]) -> str:
    """The reference's content key: sha256 of the item's URL string, else of its sorted JSON."""
    ref = item.get("image_url") or item.get("audio_url") or item.get("video_url") or {}
    url = ref.get("url") if isinstance(ref, Mapping) else None
    payload = url or json.dumps(item, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()


# The content types of a `*_embeds` part (a client's input, or the proxy's reference to E's).
EMBEDS_PARTS = frozenset(EMBEDS_TYPES.values())
_json = msgspec.json.Encoder().encode  # compact JSON: an unambiguous key, in C


def tenant_uuid(part: Mapping[str, Any], cache_salt: Any) -> str:
    """`--uuid-policy tenant`: the part's uuid (the client's, else the reference's content key)
    namespaced by the request's cache salt, so that no tenant can name, or be served, another
    tenant's embedding (vLLM keys P's encoder cache and the EC store by uuid, unscoped)."""
    client = part.get("uuid")
    key = ["uuid", client] if client else ["content", content_uuid(part)]
    return hashlib.sha256(_json(["mmreuse-tenant-v1", cache_salt, *key])).hexdigest()


def namespace_uuids(request: dict[str, Any]) -> int:
    """Give every media part its tenant uuid, and every `*_embeds` part that carries a uuid
    its namespaced one, in place; returns how many parts changed."""
    salt = request.get("cache_salt")
    n = 0
    for msg in request.get("messages") or ():
        content = msg.get("content") if isinstance(msg, Mapping) else None
        if not isinstance(content, list):
            continue
        for part in content:
            if not isinstance(part, dict):
                continue
            kind = part.get("type")
            if kind in MM_TYPES or (kind in EMBEDS_PARTS and part.get("uuid")):
                part["uuid"] = tenant_uuid(part, salt)
                n += 1
    return n


def item_uuid(item: Mapping[str, Any]) -> str:
    """The identifier the proxy gives an item: the client's `uuid`, else `content_uuid`."""
    return item.get("uuid") or content_uuid(item)


def extract_mm_items(request: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Every media part of `messages[*].content[*]`, in order (what E and render see)."""
    return scan_parts(request)[0]


def scan_parts(request: Mapping[str, Any]) -> tuple[list[dict[str, Any]], str | None]:
    """In one walk of the request: its media parts, in order (`extract_mm_items`), and where
    the first `*_embeds` part whose payload is metadata only is (`messages[i].content[j]`), or
    None. Such a part (a dict without a base64 tensor) is the proxy's own reference to what E
    produced: P takes the embedding from its EC connector, and when it is not there vLLM's
    engine dies (0.32: "Expected number of multimodal embeddings to match number of input
    items"), for every tenant. A payload of None (vLLM's "cached by uuid") is not one: P
    answers it from its processor cache or with a 400."""
    items: list[dict[str, Any]] = []
    where: str | None = None
    for i, msg in enumerate(request.get("messages") or ()):
        content = msg.get("content") if _is_mapping(msg) else None
        if type(content) is not list:
            continue
        for j, part in enumerate(content):
            if not _is_mapping(part):
                continue
            kind = part.get("type")
            if kind in MM_TYPES:
                items.append(part)
            elif where is None and kind in EMBEDS_PARTS:
                payload = part.get(kind)
                if _is_mapping(payload) and not any(type(v) is str for v in payload.values()):
                    where = f"messages[{i}].content[{j}]"
    return items, where


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
    raw_with_uuid: frozenset[int] = frozenset(),
    uuids: Sequence[str] | None = None,
    items: Sequence[Mapping[str, Any]] | None = None,
) -> dict[str, Any] | Mapping[str, Any]:
    """The body P/PD receives: each item E produced becomes a metadata-only reference
    (`{"type": "image_embeds", "image_embeds": {<E's metadata>}, "uuid": ...}`).

    `item_meta` is, per item index, the features E reported (modality, metadata, mm_hash,
    transfer_id), as the reference's `fanout_encoder_primer` returns. An item without metadata
    stays raw (P preprocesses it), as in the reference; an item in `raw_with_uuid` (skipped for E
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
        if raw_audio or i in raw_with_uuid:
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
