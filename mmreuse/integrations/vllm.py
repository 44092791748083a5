"""vLLM adapter: plan_admission on a live vLLM `Request`, its encoder cache and EC connector.

Duck-typed against vLLM 0.33.0 (no vLLM import): `Request.mm_features` / `.num_tokens`,
`EncoderCacheManager.cached` / `.num_embeds_by_hash` / `.freeable`, and
`ECConnectorBase.has_cache_item(identifier)`.

    from mmreuse.integrations.vllm import demand_for_request
    result = demand_for_request(request, num_computed_tokens,
                                encoder_cache_manager=scheduler.encoder_cache_manager,
                                ec_connector=scheduler.ec_connector)

And on the proxy side, `from_render` turns vLLM's render output (`/v1/chat/completions/render`
with `"mm_payload": "none"`) into the token ids and occurrences mmreuse hashes and plans.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Annotated, Any

import msgspec

from ..demand import Availability, CoverageRule, DemandResult
from ..errors import InvalidArgument
from ..occurrence import MMOccurrence
from ..plan import plan_admission
from ..validate import check_int, check_str, fail_type, show
from .vllm_hasher import fast_request_block_hasher

__all__ = [  # and EventfulEncoderCacheManager, DemandScheduler: loaded on access (__getattr__)
    "DENSE_MODALITIES",
    "RenderedPrompt",
    "availability_from_engine",
    "demand_for_request",
    "fast_request_block_hasher",
    "from_render",
    "from_render_json",
    "occurrences_from_request",
]


def occurrences_from_request(request: Any) -> list[MMOccurrence]:
    """The request's `mm_features` as MMOccurrences, in vLLM's order (sorted by offset)."""
    features = getattr(request, "mm_features", None)
    if features is None and not hasattr(request, "mm_features"):
        fail_type("request", "vLLM's Request (with mm_features)", request)
    return [MMOccurrence.from_vllm(f) for f in features or ()]


def _no_reusable_cache(manager: Any) -> bool:
    """vLLM's EncoderDecoderCacheManager (an EncoderCacheManager without `cached`) keeps no
    reusable encoder outputs: its cache reads as empty."""
    return any(c.__name__ == "EncoderDecoderCacheManager" for c in type(manager).__mro__)


def _encoder_cache(manager: Any) -> tuple[dict[str, int], set[str]]:
    """(identifier -> num_embeds, the unreferenced ones) of an EncoderCacheManager."""
    if _no_reusable_cache(manager):
        return {}, set()
    cached = getattr(manager, "cached", None)
    counts = getattr(manager, "num_embeds_by_hash", None)
    if not isinstance(cached, Mapping) or not isinstance(counts, Mapping):
        fail_type(
            "encoder_cache_manager",
            "vLLM's EncoderCacheManager (with the mappings cached and num_embeds_by_hash)",
            manager,
        )
    p_local: dict[str, int] = {}
    freeable: set[str] = set()
    for ident, refs in cached.items():
        field = f"encoder_cache_manager.num_embeds_by_hash[{show(ident)}]"
        if ident not in counts:
            raise InvalidArgument(f"{field} is missing for an identifier in .cached")
        p_local[check_str("encoder_cache_manager.cached keys", ident)] = check_int(
            field, counts[ident], 1
        )
        if not refs:  # no referencing request: in `freeable`, evictable
            freeable.add(ident)
    return p_local, freeable


def availability_from_engine(
    encoder_cache_manager: Any = None,
    ec_connector: Any = None,
    identifiers: Iterable[str] = (),
    *,
    e_cached: Iterable[str] = (),
) -> Availability:
    """What P's engine holds now: its encoder cache, and which `identifiers` its EC connector has.

    The EC connector can only be asked per identifier (`has_cache_item`), so pass the
    identifiers of interest (`demand_for_request` passes the request's own). E's cache is not
    visible from P: pass `e_cached` from the proxy's view, if any.
    """
    for name, ids in (("identifiers", identifiers), ("e_cached", e_cached)):
        if isinstance(ids, (str, bytes)) or not isinstance(ids, Iterable):  # str: characters
            fail_type(name, "an iterable of identifiers", ids)
    wanted = list(identifiers)
    for i, ident in enumerate(wanted):
        check_str(f"identifiers[{i}]", ident)
    p_local: dict[str, int] = {}
    freeable: set[str] = set()
    if encoder_cache_manager is not None:
        p_local, freeable = _encoder_cache(encoder_cache_manager)
    p_external: set[str] = set()
    if ec_connector is not None:
        has_item = getattr(ec_connector, "has_cache_item", None)
        if not callable(has_item):
            fail_type(
                "ec_connector",
                "an EC connector with has_cache_item(identifier), like ECConnectorBase",
                ec_connector,
            )
        for ident in dict.fromkeys(wanted):  # each asked once, in order
            held = has_item(ident)
            if not isinstance(held, bool):  # a truthy non-bool would be trusted as "held"
                fail_type(f"ec_connector.has_cache_item({ident!r})", "a bool", held)
            if held:
                p_external.add(ident)
    return Availability(
        p_local=p_local,
        p_local_freeable=frozenset(freeable),
        p_external=frozenset(p_external),
        e_cached=frozenset(e_cached),
    )


def demand_for_request(
    request: Any,
    num_computed_tokens: int,
    *,
    encoder_cache_manager: Any = None,
    ec_connector: Any = None,
    e_cached: Iterable[str] = (),
    external_kv_tokens: int = 0,
    is_encoder_decoder: bool = False,
    coverage_rule: CoverageRule = "embed",
) -> DemandResult:
    """The demand of a live vLLM Request at its admission, where P's scheduler knows C
    (`num_computed_tokens`): `plan_admission` with C given."""
    occs = occurrences_from_request(request)
    if not hasattr(request, "num_tokens"):
        fail_type("request", "vLLM's Request (with num_tokens)", request)
    avail = availability_from_engine(
        encoder_cache_manager, ec_connector, {m.identifier for m in occs}, e_cached=e_cached
    )
    return plan_admission(
        num_prompt_tokens=request.num_tokens,
        occurrences=occs,
        availability=avail,
        num_computed_tokens=num_computed_tokens,
        external_kv_tokens=external_kv_tokens,
        coverage_rule=coverage_rule,
        is_encoder_decoder=is_encoder_decoder,
    ).demand


# ---- vLLM's render output ---------------------------------------------------------------------

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
        cache_salt: the request's `cache_salt`, or None.
    """

    token_ids: tuple[int, ...]
    occurrences: tuple[MMOccurrence, ...]
    cache_salt: str | None = None


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
        return RenderedPrompt(token_ids, (), salt)
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
    return RenderedPrompt(token_ids, tuple(occs), salt)


def __getattr__(name: str) -> Any:
    """The vLLM plug-in classes import vLLM, so they load only when vLLM asks for them (by
    qualname, e.g. `--ec-manager-config`), never with this module."""
    if name == "EventfulEncoderCacheManager":
        from .vllm_ec import EventfulEncoderCacheManager

        return EventfulEncoderCacheManager
    if name in ("DemandScheduler", "AsyncDemandScheduler"):
        from . import vllm_demand

        return getattr(vllm_demand, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
