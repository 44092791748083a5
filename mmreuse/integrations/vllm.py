"""vLLM adapter: plan_admission on a live vLLM `Request`, its encoder cache and EC connector.

Duck-typed against vLLM 0.33.0 (no vLLM import): `Request.mm_features` / `.num_tokens`,
`EncoderCacheManager.cached` / `.num_embeds_by_hash` / `.freeable`, and
`ECConnectorBase.has_cache_item(identifier)`.

    from mmreuse.integrations.vllm import demand_for_request
    result = demand_for_request(request, num_computed_tokens,
                                encoder_cache_manager=scheduler.encoder_cache_manager,
                                ec_connector=scheduler.ec_connector)
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ..demand import Availability, CoverageRule, DemandResult
from ..occurrence import MMOccurrence
from ..plan import plan_admission
from ..validate import fail_type


def occurrences_from_request(request: Any) -> list[MMOccurrence]:
    """The request's `mm_features` as MMOccurrences, in vLLM's order (sorted by offset)."""
    features = getattr(request, "mm_features", None)
    if features is None and not hasattr(request, "mm_features"):
        fail_type("request", "vLLM's Request (with mm_features)", request)
    return [MMOccurrence.from_vllm(f) for f in features or ()]


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
        if isinstance(ids, (str, bytes)):  # would read as a set of characters
            fail_type(name, "an iterable of identifiers", ids)
    p_local: dict[str, int] = {}
    freeable: set[str] = set()
    if encoder_cache_manager is not None:
        try:
            cached = encoder_cache_manager.cached
            counts = encoder_cache_manager.num_embeds_by_hash
        except AttributeError:
            # EncoderDecoderCacheManager keeps no reusable cache.
            cached, counts = {}, {}
        for ident in cached:
            p_local[ident] = counts[ident]
            if not cached[ident]:  # no referencing request: in `freeable`, evictable
                freeable.add(ident)
    p_external: set[str] = set()
    if ec_connector is not None:
        if not callable(getattr(ec_connector, "has_cache_item", None)):
            fail_type(
                "ec_connector",
                "an EC connector with has_cache_item(identifier), like ECConnectorBase",
                ec_connector,
            )
        p_external = {i for i in set(identifiers) if ec_connector.has_cache_item(i)}
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
