"""vLLM's render of a chat request: what mmreuse hashes and plans, and the body that asks for it.

`POST /v1/chat/completions/render` with `"mm_payload": "none"` (a P/PD started with
`--enable-scale-out`) answers the prompt after placeholder expansion, each multimodal item's
identifier and placeholder, and the cache salt, without running the encoder. `render_body`
builds that request from a client's chat request; `from_render` / `from_render_json` turn the
answer into a `RenderedPrompt`. Torch-free and vLLM-free: the proxy, the cluster client and the
tools all use it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Annotated, Any

import msgspec

from .errors import InvalidArgument
from .identity import BASE, RequestIdentity
from .occurrence import MMOccurrence
from .validate import check_int, check_str, fail_type

__all__ = [
    "DENSE_MODALITIES",
    "RENDER_PATH",
    "RenderedPrompt",
    "from_render",
    "from_render_json",
    "render_body",
]

RENDER_PATH = "/v1/chat/completions/render"

# What a render request must not carry: streaming, and the connectors' handles (render runs no
# engine step, and a handle is the proxy's channel to P, never render's input).
_NOT_FOR_RENDER = ("stream", "stream_options", "kv_transfer_params", "ec_transfer_params")


def render_body(request: Mapping[str, Any]) -> dict[str, Any]:
    """The render request for a chat request: the same body without streaming or connector
    handles, and `"mm_payload": "none"` (token ids, placeholders and identifiers only)."""
    if not isinstance(request, Mapping):
        fail_type("request", "a chat request body (a mapping)", request)
    body = {k: v for k, v in request.items() if k not in _NOT_FOR_RENDER}
    body["mm_payload"] = "none"
    return body


# Modalities whose placeholders vLLM fills densely (every placeholder position gets an embedding)
# in the models mmreuse is used with. Render drops `is_embed` (vLLM 0.33's TODO in
# `PlaceholderRangeInfo`): for a sparse modality (Qwen-VL video with interleaved timestamps) the
# caller must say which token ids receive embeddings, or it is refused.
DENSE_MODALITIES = frozenset({"image", "audio"})


@dataclass(frozen=True, slots=True)
class RenderedPrompt:
    """A chat request as vLLM's renderer sees it: what mmreuse hashes and plans.

    Attributes:
        token_ids: the prompt after placeholder expansion (`prompt_token_ids`).
        occurrences: the multimodal items in vLLM's order (by offset, as `argsort_mm_positions`),
            each identified as vLLM's `mm_hashes` does: the content part's `uuid` when given,
            else vLLM's content hash.
        identity: the request's cache salt (render's `cache_salt`) and LoRA adapter (render
            does not say: the caller sets it with `with_identity`).
    """

    token_ids: tuple[int, ...]
    occurrences: tuple[MMOccurrence, ...]
    identity: RequestIdentity = BASE

    @property
    def cache_salt(self) -> str | None:
        return self.identity.cache_salt

    def with_identity(self, identity: RequestIdentity) -> RenderedPrompt:
        if not isinstance(identity, RequestIdentity):
            fail_type("identity", "a RequestIdentity", identity)
        return replace(self, identity=identity)


def from_render(
    render: Any,
    *,
    embed_token_ids: Mapping[str, int] | None = None,
    dense_modalities: Iterable[str] = DENSE_MODALITIES,
) -> RenderedPrompt:
    """Turn the body of `POST /v1/chat/completions/render` (`"mm_payload": "none"`), or a
    `GenerateRequest`, into a `RenderedPrompt`.

    Render carries no `is_embed` mask. Hashes do not need it (vLLM 0.33 does not hash it), but
    coverage and embed counts do, so each modality present must be either in `dense_modalities`
    (every placeholder position is an embed) or in `embed_token_ids` (the positions holding that
    token id are the embeds, as in Qwen-VL's `<|video_pad|>`); any other modality raises
    `InvalidArgument` rather than guess. With tower-connector LoRA, vLLM's identifier is
    "<lora_name>:<mm_hash>": pass such requests' identifiers through yourself.
    """
    body = render.model_dump() if hasattr(render, "model_dump") else render
    if not isinstance(body, Mapping):
        fail_type("render", "a render response (a mapping or a pydantic model)", render)
    tokens = body.get("token_ids")
    if not isinstance(tokens, list | tuple):
        fail_type("render.token_ids", "a list of token ids", tokens)
    token_ids = tuple(check_int(f"render.token_ids[{i}]", t, 0) for i, t in enumerate(tokens))
    return _rendered(body, token_ids, embed_token_ids, dense_modalities)


class _RenderBody(msgspec.Struct):
    """The render answer's fields mmreuse reads; msgspec checks the token ids in C."""

    token_ids: list[Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]]
    features: Any = None
    cache_salt: str | None = None


_render_body = msgspec.json.Decoder(_RenderBody)


def from_render_json(
    payload: bytes,
    *,
    embed_token_ids: Mapping[str, int] | None = None,
    dense_modalities: Iterable[str] = DENSE_MODALITIES,
) -> RenderedPrompt:
    """`from_render` on the raw JSON bytes of a render answer, with the same checks and errors,
    the token ids validated while decoding (the proxy's path: ~10x faster for long prompts)."""
    if not isinstance(payload, bytes | bytearray | memoryview):
        fail_type("payload", "the render answer's JSON bytes", payload)
    try:
        body = _render_body.decode(payload)
    except msgspec.ValidationError as e:
        hint = " (token ids are ints in [0, 2**63-1])" if "token_ids" in str(e) else ""
        raise InvalidArgument(f"render: {e}{hint}") from None
    except msgspec.DecodeError as e:
        raise InvalidArgument(f"render: not JSON: {e}") from None
    except RecursionError:
        raise InvalidArgument("render: nested too deeply to be vLLM's render answer") from None
    as_map = {"token_ids": body.token_ids, "features": body.features, "cache_salt": body.cache_salt}
    return _rendered(as_map, tuple(body.token_ids), embed_token_ids, dense_modalities)


def _rendered(
    body: Mapping[str, Any],
    token_ids: tuple[int, ...],
    embed_token_ids: Mapping[str, int] | None,
    dense_modalities: Iterable[str],
) -> RenderedPrompt:
    salt = body.get("cache_salt")
    if salt is not None:
        check_str("render.cache_salt", salt)
    embed_ids = dict(embed_token_ids or {})
    for modality, tid in embed_ids.items():
        check_str("embed_token_ids key", modality, nonempty=True)
        check_int(f"embed_token_ids[{modality!r}]", tid, 0)
    dense = frozenset(check_str("dense_modalities[]", m, nonempty=True) for m in dense_modalities)
    features = body.get("features")
    if features is None:
        return RenderedPrompt(token_ids, (), _identity(salt))
    if not isinstance(features, Mapping):
        fail_type("render.features", "a mapping (vLLM's MultiModalFeatures)", features)
    hashes, places = features.get("mm_hashes"), features.get("mm_placeholders")
    if not isinstance(hashes, Mapping) or not isinstance(places, Mapping):
        fail_type("render.features", "mm_hashes and mm_placeholders mappings", features)
    if set(hashes) != set(places):
        raise InvalidArgument(
            f"render.features: mm_hashes has modalities {sorted(hashes)} but mm_placeholders "
            f"{sorted(places)}"
        )
    items = []  # (offset, modality, index, identifier, length)
    for modality in places:
        ids, ranges = hashes[modality], places[modality]
        where = f"render.features.mm_placeholders[{modality!r}]"
        if not isinstance(ids, list | tuple) or not isinstance(ranges, list | tuple):
            fail_type(f"render.features[{modality!r}]", "lists of hashes and ranges", ids)
        if len(ids) != len(ranges):
            raise InvalidArgument(
                f"render.features: {len(ids)} mm_hashes but {len(ranges)} mm_placeholders "
                f"for {modality!r}"
            )
        if ranges and modality not in dense and modality not in embed_ids:
            raise InvalidArgument(
                f"{where}: render gives no is_embed mask and {modality!r} is neither in "
                f"dense_modalities {sorted(dense)} nor in embed_token_ids: say which token id "
                "receives its embeddings (embed_token_ids), or that it is dense"
            )
        for k, (ident, r) in enumerate(zip(ids, ranges, strict=True)):
            if not isinstance(r, Mapping):
                fail_type(f"{where}[{k}]", "a mapping with offset and length", r)
            offset = check_int(f"{where}[{k}].offset", r.get("offset"), 0)
            length = check_int(f"{where}[{k}].length", r.get("length"), 1)
            if offset + length > len(token_ids):
                raise InvalidArgument(
                    f"{where}[{k}] = [{offset}, {offset + length}) is past the "
                    f"{len(token_ids)} token ids"
                )
            check_str(f"render.features.mm_hashes[{modality!r}][{k}]", ident, nonempty=True)
            items.append((offset, modality, k, ident, length))
    items.sort(key=lambda it: it[0])  # vLLM's argsort_mm_positions: a stable sort by offset
    occs = []
    for offset, modality, _, ident, length in items:
        mask = None
        if modality in embed_ids:
            tid = embed_ids[modality]
            flags = tuple(t == tid for t in token_ids[offset : offset + length])
            mask = None if all(flags) else flags
        occs.append(MMOccurrence(ident, offset, length, is_embed=mask, modality=modality))
    return RenderedPrompt(token_ids, tuple(occs), _identity(salt))


def _identity(salt: str | None) -> RequestIdentity:
    return BASE if salt is None else RequestIdentity(cache_salt=salt)
