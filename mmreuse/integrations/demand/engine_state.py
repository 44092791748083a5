"""What P's engine holds, read from vLLM's objects: a live `Request`'s occurrences, its encoder
cache (`EncoderCacheManager`) and EC connector, its prefix cache's hit and free queue, and
`plan_admission` over them. Every read of vLLM's internals the plug-in makes is here.

Duck-typed against vLLM 0.32.0 - 0.34.0 (no vLLM import): `Request.mm_features` / `.num_tokens`,
`EncoderCacheManager.cached` / `.num_embeds_by_hash` / `.freeable` / `.num_free_slots`,
`ECConnectorBase.has_cache_item(identifier)`, and the scheduler's `kv_cache_manager`
(`prefix_cache_lookup_enabled`, `coordinator.find_longest_cache_hit`, `block_pool`). Users
import the first ones from the facade `mmreuse.integrations.vllm`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from ...demand import Availability, CoverageRule, DemandResult, EncoderCacheSpace
from ...errors import InvalidArgument
from ...occurrence import MMOccurrence
from ...plan import GivenCoverage, plan_admission
from ...validate import check_int, check_str, fail_type, show

__all__ = [
    "MAX_FREE_QUEUE_WALK",
    "availability_from_engine",
    "demand_for_request",
    "encoder_cache_space",
    "occurrences_from_request",
    "plan_at",
]

MAX_FREE_QUEUE_WALK = 2048  # trust_kv_blocks is counted up to this: that value means "at least"


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


def encoder_cache_space(manager: Any) -> EncoderCacheSpace | None:
    """P's encoder-cache space for rule S (`compute_demand(encoder_cache=...)`): its free
    slots and its freeable entries, oldest first (vLLM evicts in that order). None without a
    reusable cache (encoder-decoder models, no manager)."""
    if manager is None or _no_reusable_cache(manager):
        return None
    free = getattr(manager, "num_free_slots", None)
    freeable = getattr(manager, "freeable", None)
    if not isinstance(freeable, Mapping) or type(free) is not int:
        fail_type(
            "encoder_cache_manager",
            "vLLM's EncoderCacheManager (with num_free_slots and the ordered mapping freeable)",
            manager,
        )
    return EncoderCacheSpace(free, tuple((ident, n) for ident, n in freeable.items()))


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
    (`num_computed_tokens`): `plan_admission` with C given, and rule S over the encoder
    cache's space when the manager is given."""
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
        coverage=GivenCoverage(num_computed_tokens, external_kv_tokens),
        coverage_rule=coverage_rule,
        is_encoder_decoder=is_encoder_decoder,
        encoder_cache=encoder_cache_space(encoder_cache_manager),
    ).demand


def plan_at(engine: Any, occs: list[MMOccurrence], n: int, c: int, e_cached: Any = ()) -> Any:
    """P's plan at C = `c` for a request of `n` tokens and occurrences `occs` (`plan_admission`
    with C given) over the encoder cache and EC connector of `engine` (vLLM's scheduler) and
    `e_cached`, with rule S (its encoder-cache space): the `DemandResult`."""
    ecm = engine.encoder_cache_manager
    avail = availability_from_engine(
        ecm, engine.ec_connector, {m.identifier for m in occs}, e_cached=e_cached
    )
    return plan_admission(
        num_prompt_tokens=n,
        occurrences=occs,
        availability=avail,
        coverage=GivenCoverage(c),
        is_encoder_decoder=bool(getattr(engine, "is_encoder_decoder", False)),
        encoder_cache=encoder_cache_space(ecm),
    ).demand


def prefix_hit(engine: Any, request: Any) -> tuple[int, list[Any]]:
    """vLLM's own longest prefix-cache hit for `request` (`coordinator.find_longest_cache_hit`:
    no allocation, no LRU touch, no stats), bounded as vLLM bounds its lookup (0.34 on: the
    request's `get_max_cache_hit_length`, else all tokens but the last): the hit's tokens and
    its blocks (the first KV group's). (0, []) where vLLM would not look the request up."""
    manager = engine.kv_cache_manager
    if not manager.prefix_cache_lookup_enabled(request):
        return 0, []
    bound = getattr(request, "get_max_cache_hit_length", None)
    found = manager.coordinator.find_longest_cache_hit(
        request.block_hashes, bound() if callable(bound) else request.num_tokens - 1
    )
    return int(found[1]), found[0][0] if found[0] else []


def kv_trust(engine: Any, hit_blocks: list[Any]) -> int | None:
    """New blocks P can allocate before a hit block may be evicted: its place in vLLM's free
    queue (evicted from the head), counted up to MAX_FREE_QUEUE_WALK; None when no hit block
    is in the queue."""
    free = {b.block_id for b in hit_blocks if b.ref_cnt == 0 and not b.is_null}
    if not free:
        return None
    queue = engine.kv_cache_manager.block_pool.free_block_queue
    node = queue.fake_free_list_head.next_free_block
    n = 0
    while node is not None and node is not queue.fake_free_list_tail:
        if node.block_id in free or n >= MAX_FREE_QUEUE_WALK:
            return n
        n += 1
        node = node.next_free_block
    return n


def encoder_trust(engine: Any, reused: tuple[str, ...]) -> int | None:
    """Encoder-cache space P can allocate before a reused freeable entry may be evicted (vLLM
    evicts `freeable` oldest first); None when no reused entry is freeable."""
    ecm = engine.encoder_cache_manager
    freeable = getattr(ecm, "freeable", None)
    if not freeable or not any(i in freeable for i in reused):
        return None
    room = int(getattr(ecm, "num_free_slots", 0))
    for ident, n in freeable.items():  # oldest first: vLLM evicts in this order
        if ident in reused:
            return room
        room += int(n)
    return room


def encoder_cached(engine: Any) -> Mapping[str, Any]:
    """The identifiers P's encoder cache holds now (`EncoderCacheManager.cached`)."""
    return getattr(engine.encoder_cache_manager, "cached", {})


def ec_snapshots(engine: Any) -> Any:
    """The encoder-cache manager's snapshots where it publishes events
    (`EventfulEncoderCacheManager`), else None."""
    ecm = engine.encoder_cache_manager
    snapshots = getattr(ecm, "snapshots", None)
    if snapshots is None or getattr(ecm, "publisher", None) is None:
        return None
    return snapshots


def engine_sizes(engine: Any) -> tuple[int, int, int]:
    """P's KV blocks, its block size and its encoder cache's size in embeddings."""
    return (
        int(engine.kv_cache_manager.block_pool.num_gpu_blocks),
        int(engine.block_size),
        int(getattr(engine.encoder_cache_manager, "cache_size", 0)),
    )


def kv_events_enabled(engine: Any) -> bool:
    """Whether P's block pool publishes KV events (`--kv-events-config`)."""
    return bool(getattr(engine.kv_cache_manager.block_pool, "enable_kv_cache_events", False))


def pending_kv_events(engine: Any) -> list[Any]:
    """The KV events the block pool holds, not yet handed to the publisher (in order)."""
    return engine.kv_cache_manager.block_pool.kv_event_queue
