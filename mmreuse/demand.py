"""Which multimodal occurrences of a request still need an embedding from the Encoder.

`compute_demand` is the RFC's needs_embedding_from_E(m) = !KV_covered_P(m) &&
!reusable_embedding_available_P(m), made exact to vLLM 0.33.0's scheduler
(`Scheduler._try_schedule_encoder_inputs`) for partial coverage, `is_embed` masks,
duplicates and several occurrences. Normative spec: docs/demand-semantics.md §6.

`kv_coverage` turns a prefix-cache hit into the effective `num_computed_tokens` (C) that
vLLM admits a waiting request with (the num_tokens-1 cap, block alignment, EAGLE drop,
the KV-connector rule, SWA replay).

Not modelled (callers must handle them; §6.5): time and races (P's encoder cache and KV
blocks can be evicted between this decision and P's scheduling, and vLLM publishes no
encoder-cache events), connector-specific admission gates (only flagged, see
`connector_gate_expects`), and E-side costs other than the encoder forward.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Literal, NamedTuple

from .errors import InvalidArgument
from .occurrence import MMOccurrence
from .validate import check_bool, check_int, fail_type, fail_value

CoverageRule = Literal["embed", "placeholder"]


def _check_id_set(name: str, value: object) -> frozenset[str]:
    """A set (any iterable but a str/bytes) of str identifiers, as a frozenset."""
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        fail_type(name, "a set of identifiers", value)
    out = frozenset(value)
    for ident in out:
        if not isinstance(ident, str):
            fail_type(f"{name} identifiers", "str", ident)
    return out


@dataclass(frozen=True, slots=True)
class Availability:
    """Where embeddings of identifiers are available, as seen when a request is admitted.

    All keys are engine identifiers (`MultiModalFeatureSpec.identifier`), never proxy UUIDs.

    Attributes:
        p_local: identifier -> num_embeds held in P's EncoderCacheManager (referenced or freeable).
        p_local_freeable: the subset of `p_local` with no references (evictable at the next
            `can_allocate` that needs room).
        p_external: identifiers for which P's EC connector `has_cache_item` is True.
        e_cached: identifiers E can serve without an encoder forward (its cache or a shared store).
    """

    p_local: Mapping[str, int] = field(default_factory=dict)
    p_local_freeable: frozenset[str] = frozenset()
    p_external: frozenset[str] = frozenset()
    e_cached: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        if not isinstance(self.p_local, Mapping):
            fail_type("p_local", "a mapping identifier -> num_embeds", self.p_local)
        local = {}
        for ident, n in self.p_local.items():
            if not isinstance(ident, str):
                fail_type("p_local keys", "str identifiers", ident)
            local[ident] = check_int(f"p_local[{ident!r}]", n, 1)
        object.__setattr__(self, "p_local", local)
        for name in ("p_local_freeable", "p_external", "e_cached"):
            object.__setattr__(self, name, _check_id_set(name, getattr(self, name)))
        stray = self.p_local_freeable - local.keys()
        if stray:
            raise InvalidArgument(
                f"p_local_freeable holds identifiers not in p_local: {sorted(stray)}"
            )


class ItemClass(StrEnum):
    """One occurrence's class: what it needs, first match wins in this order for uncovered
    ones (`compute_demand` gives the first six). The wire (P's answers and admission records),
    the metrics and the proxy's decision name it by its value.

    `duplicate`: an uncovered occurrence whose identifier an earlier one already claims (its
    `OccurrenceDecision.klass` is that earlier one's); `unclassified`: no plan was made for it
    (the proxy's only: a peer never sends it).
    """

    KV_COVERED = "kv_covered"  # all embed positions < C: P never touches the encoder for it
    NO_EMBEDS = "no_embeds"  # zero embed positions: never needs an embedding
    P_LOCAL = "p_local"  # uncovered; reusable from P's encoder cache (no transfer, no forward)
    P_EXTERNAL = "p_external"  # uncovered; P's EC connector has it (load; no E, no forward)
    E_CACHED = "e_cached"  # uncovered; E has it: delivery from E, no forward
    E_COMPUTE = "e_compute"  # uncovered; nowhere: E must run the encoder
    DUPLICATE = "duplicate"  # uncovered; shares an earlier occurrence's embedding
    UNCLASSIFIED = "unclassified"  # no plan was made for it

    @property
    def needs_e(self) -> bool:
        """Whether E must deliver an embedding for this class (e_cached, e_compute)."""
        # `is`: an enum member hashes in Python, a set lookup would cost more
        return self is ItemClass.E_CACHED or self is ItemClass.E_COMPUTE

    @property
    def covered(self) -> bool:
        """Whether P never touches the encoder for it (KV-covered, or no embed positions)."""
        return self is ItemClass.KV_COVERED or self is ItemClass.NO_EMBEDS


@dataclass(frozen=True, slots=True)
class EncoderCacheSpace:
    """P's encoder cache as its own admission sees it: free slots, and the freeable
    (unreferenced) entries in vLLM's eviction order (oldest first), each with its embed count.

    With it, `compute_demand` applies rule S (docs/demand-semantics.md §1.8): an item that
    needs space evicts the oldest freeable entries, possibly one a later item of the same
    request would have reused, which then needs an embedding after all.
    """

    num_free_slots: int
    freeable: tuple[tuple[str, int], ...] = ()

    def __post_init__(self) -> None:
        check_int("num_free_slots", self.num_free_slots, 0)
        if isinstance(self.freeable, (str, bytes)) or not isinstance(self.freeable, Sequence):
            fail_type("freeable", "a sequence of (identifier, num_embeds)", self.freeable)
        entries = tuple(self.freeable)
        seen: set[str] = set()
        for i, entry in enumerate(entries):
            if not isinstance(entry, tuple) or len(entry) != 2:
                fail_type(f"freeable[{i}]", "an (identifier, num_embeds) pair", entry)
            ident, n = entry
            if not isinstance(ident, str):
                fail_type(f"freeable[{i}] identifier", "str", ident)
            check_int(f"freeable[{i}] num_embeds", n, 1)
            if ident in seen:
                raise InvalidArgument(f"freeable[{i}] names {ident!r} twice")
            seen.add(ident)
        object.__setattr__(self, "freeable", entries)


class OccurrenceDecision(NamedTuple):
    """The decision for one occurrence (input order).

    A NamedTuple rather than a frozen dataclass: compute_demand builds one per occurrence on
    the admission path, and a frozen dataclass costs 4x as much to build (1.2 vs 0.26 us).
    """

    index: int  # type: ignore[assignment]  # shadows tuple.index, as the field name it is
    identifier: str
    klass: ItemClass  # never duplicate or unclassified: see `item_class`
    # Rows that must exist (the whole item) if the class needs an embedding.
    num_embeds: int
    # |{p in pos(m) : p >= C}|: the rows P will actually consume.
    uncovered_embeds: int
    first_uncovered_pos: int | None
    # 0 < uncovered_embeds < num_embeds.
    partial: bool
    # Earlier occurrence index that already claims this identifier's embedding.
    dedup_of: int | None
    # KV_COVERED only thanks to external_kv_tokens (a promise: a failed load shrinks C).
    coverage_conditional: bool
    # offset + length > C: Mooncake / CPU-NIXL EC admission gates still wait for this item.
    connector_gate_expects: bool
    # P_LOCAL through a freeable (unreferenced) entry, which the next allocation may evict.
    evictable: bool

    @property
    def item_class(self) -> ItemClass:
        """Its class as the wire, the metrics and the records name it: `duplicate` where it
        shares an earlier occurrence's embedding (`dedup_of`), else `klass`."""
        return self.klass if self.dedup_of is None else ItemClass.DUPLICATE


@dataclass(frozen=True, slots=True)
class DemandResult:
    """What a request needs from E, and what P reuses, loads or rejects."""

    decisions: tuple[OccurrenceDecision, ...]
    # Unique (identifier, needs_forward), in the order P first needs them.
    e_demand: tuple[tuple[str, bool], ...]
    # Unique identifiers P loads through its EC connector, same order.
    p_loads: tuple[str, ...]
    # Unique identifiers P reuses from its own encoder cache, same order.
    p_local_reuse: tuple[str, ...]
    # The proxy may omit E for this request (e_demand is empty). See `needs_media_at_p`.
    skip_e: bool
    # Identifiers whose embed counts disagree: vLLM rejects the request
    # (_reject_on_encoder_cache_embed_mismatch).
    conflicts: tuple[str, ...]
    # Rule S (given an `EncoderCacheSpace`): P-local entries this request's own admission
    # evicts before it reaches them; they are classified as if absent.
    self_evicted: tuple[str, ...] = ()
    # The encoder cache cannot hold this request's new embeddings at once: P spreads them over
    # steps, and the answer holds for the first one only.
    encoder_cache_short: bool = False

    def item_classes(self) -> tuple[ItemClass, ...]:
        """Every occurrence's `item_class`, in vLLM's order (P's answers and records)."""
        return tuple(d.item_class for d in self.decisions)

    def needs_media_at_p(self, *, external_store_can_evict: bool = True) -> tuple[int, ...]:
        """Indices whose skip of E races with state P may lose; send P real media for them
        (§6.3.9)."""
        out = []
        for d in self.decisions:
            if (
                d.coverage_conditional
                or d.evictable
                or (d.klass is ItemClass.P_EXTERNAL and external_store_can_evict)
                or (d.klass is ItemClass.KV_COVERED and d.connector_gate_expects)
            ):
                out.append(d.index)
        return tuple(out)


_KV_COVERED, _NO_EMBEDS, _P_LOCAL = ItemClass.KV_COVERED, ItemClass.NO_EMBEDS, ItemClass.P_LOCAL
_P_EXTERNAL, _E_CACHED, _E_COMPUTE = ItemClass.P_EXTERNAL, ItemClass.E_CACHED, ItemClass.E_COMPUTE
_EMPTY_MAP: Mapping[str, int] = {}
_EMPTY_SET: frozenset[str] = frozenset()


def compute_demand(
    occurrences: Sequence[MMOccurrence],
    num_prompt_tokens: int,
    num_computed_tokens: int,
    availability: Availability = Availability(),
    *,
    external_kv_tokens: int = 0,
    is_encoder_decoder: bool = False,
    coverage_rule: CoverageRule = "embed",
    encoder_cache: EncoderCacheSpace | None = None,
) -> DemandResult:
    """Classify every occurrence of a request and collect what E must deliver (§6.3).

    Args:
        occurrences: the request's mm_features, sorted by offset (overlaps allowed:
            use_audio_in_video); each is judged on its own is_embed mask.
        num_prompt_tokens: N, after placeholder expansion.
        num_computed_tokens: C, the effective computed prefix at admission (see `kv_coverage`);
            0 <= C <= N-1, since vLLM always recomputes the last prompt token.
        availability: where embeddings are available.
        external_kv_tokens: the part of C loaded by a KV connector (coverage it gives is
            conditional on the load succeeding).
        is_encoder_decoder: encoder-decoder model (no encoder-cache reuse; covered iff C > 0).
        coverage_rule: "embed" (vLLM's scheduler: covered iff every embed position < C) or
            "placeholder" (covered iff offset + length <= C, what the Mooncake / CPU-NIXL EC
            admission gates use; choose it when P runs ECMooncakeConnector).
        encoder_cache: P's encoder-cache space (free slots, freeable entries oldest first);
            given, rule S applies (§1.8): entries the request's own allocations evict before
            a later item reuses them count as absent. None: capacity is not modelled.

    Returns:
        A `DemandResult`; pure and deterministic.
    """
    n, c, ext = _validate(
        occurrences,
        num_prompt_tokens,
        num_computed_tokens,
        availability,
        external_kv_tokens,
        is_encoder_decoder,
        coverage_rule,
    )
    placeholder = coverage_rule == "placeholder"
    decisions, conflicts, first_of, need_at = _classify(
        occurrences, n, c, ext, availability, is_encoder_decoder, placeholder
    )
    if encoder_cache is None or is_encoder_decoder:
        return _collect(decisions, conflicts, first_of, need_at)
    if type(encoder_cache) is not EncoderCacheSpace:
        fail_type("encoder_cache", "an EncoderCacheSpace", encoder_cache)
    evicted, short = self_evictions(occurrences, decisions, availability, encoder_cache)
    if evicted:  # P's own allocations for this request evict them first: classify again
        left = Availability(
            p_local={k: v for k, v in availability.p_local.items() if k not in evicted},
            p_local_freeable=availability.p_local_freeable - evicted,
            p_external=availability.p_external,
            e_cached=availability.e_cached,
        )
        decisions, conflicts, first_of, need_at = _classify(
            occurrences, n, c, ext, left, is_encoder_decoder, placeholder
        )
    result = _collect(decisions, conflicts, first_of, need_at)
    if evicted or short:
        result = replace(result, self_evicted=tuple(sorted(evicted)), encoder_cache_short=short)
    return result


def self_evictions(
    occurrences: Sequence[MMOccurrence],
    decisions: Sequence[OccurrenceDecision],
    availability: Availability,
    space: EncoderCacheSpace,
) -> tuple[frozenset[str], bool]:
    """Rule S: the freeable entries a request's own admission evicts, and whether the cache is
    short for it (§1.8).

    vLLM's `_try_schedule_encoder_inputs` walks the uncovered items in order: one P holds is
    referenced (no longer evictable); another reserves its embeds, and `can_allocate` evicts
    the oldest freeable entries while the free slots are short, possibly one a later item of
    the request would reuse. When even all freeable entries cannot make room, vLLM stops this
    step's encoder inputs there (short: the rest waits for a later step).
    """
    queue = dict(space.freeable)  # insertion order: oldest first, as vLLM evicts
    free = space.num_free_slots
    cached = set(availability.p_local)
    scheduled: set[str] = set()
    to_schedule = 0
    evicted: set[str] = set()
    room = sum(queue.values())  # the freeable space left in `queue`, kept as it shrinks
    for occ, d in zip(occurrences, decisions, strict=True):
        ident = occ.identifier
        if d.klass.covered or ident in scheduled:
            continue
        if ident in cached:
            room -= queue.pop(ident, 0)  # referenced now
            continue
        need = occ.num_embeds + to_schedule
        if need > free + room:
            return frozenset(evicted), True
        while need > free:
            victim = next(iter(queue))
            size = queue.pop(victim)
            free += size
            room -= size
            cached.discard(victim)
            evicted.add(victim)
        to_schedule += occ.num_embeds
        scheduled.add(ident)
    return frozenset(evicted), False


def _validate(
    occurrences: object,
    num_prompt_tokens: object,
    num_computed_tokens: object,
    availability: object,
    external_kv_tokens: object,
    is_encoder_decoder: object,
    coverage_rule: object,
) -> tuple[int, int, int]:
    """compute_demand's request-level checks; returns (N, C, external part of C)."""
    n = check_int("num_prompt_tokens", num_prompt_tokens, 1)
    c = check_int("num_computed_tokens", num_computed_tokens, 0, n - 1)
    ext = check_int("external_kv_tokens", external_kv_tokens, 0, c)
    if coverage_rule != "embed" and coverage_rule != "placeholder":
        fail_value("coverage_rule", "'embed' or 'placeholder'", coverage_rule)
    if type(availability) is not Availability and not isinstance(availability, Availability):
        fail_type("availability", "an Availability", availability)
    if is_encoder_decoder is not False:
        check_bool("is_encoder_decoder", is_encoder_decoder)
        if ext:
            raise InvalidArgument(
                f"external_kv_tokens={ext} with is_encoder_decoder=True: vLLM's KV connectors "
                "do not support encoder-decoder models"
            )
    if isinstance(occurrences, (str, bytes)) or not isinstance(occurrences, Sequence):
        fail_type("occurrences", "a sequence of MMOccurrence", occurrences)
    return n, c, ext


# `OccurrenceDecision(**kw)` goes through type.__call__, which builds a kwargs dict (2x the
# positional cost: 0.65 vs 0.29 us, measured again for issue 33); the tuple's __new__ called
# directly takes keywords without one.
_decision = OccurrenceDecision.__new__


def _classify(
    occurrences: Sequence[MMOccurrence],
    n: int,
    c: int,
    ext: int,
    availability: Availability,
    is_encoder_decoder: bool,
    placeholder: bool,
) -> tuple[
    list[OccurrenceDecision], dict[str, None], dict[str, tuple[int, ItemClass, int]], dict[str, int]
]:
    """Decide each occurrence (checking it) as vLLM's `_try_schedule_encoder_inputs` walks it;
    also returns, for `_collect`, the conflicting identifiers, ident -> (first uncovered index,
    class, num_embeds), ident -> where P needs it."""
    p_local = _EMPTY_MAP if is_encoder_decoder else availability.p_local
    p_external = _EMPTY_SET if is_encoder_decoder else availability.p_external
    e_cached = availability.e_cached
    freeable = availability.p_local_freeable
    check_counts = not is_encoder_decoder  # the encoder-decoder manager keeps no cache
    new, D = _decision, OccurrenceDecision

    decisions: list[OccurrenceDecision] = []
    conflicts: dict[str, None] = {}
    first_of: dict[str, tuple[int, ItemClass, int]] = {}
    need_at: dict[str, int] = {}
    prev_offset = 0

    for i, m in enumerate(occurrences):
        if type(m) is not MMOccurrence and not isinstance(m, MMOccurrence):
            fail_type(f"occurrences[{i}]", "an MMOccurrence", m)
        # MMOccurrence.end / .num_embeds / .last_embed_pos's slots: no property call (hot)
        offset, end, num_embeds, ident = m.offset, m._end, m._num_embeds, m.identifier
        if end > n or offset < prev_offset:
            _refuse_placement(i, m, n, prev_offset)
        prev_offset = offset
        gate = end > c
        # vLLM checks embed counts for every item its window [C, N) touches, whether or not
        # the item has embeddings there (_try_schedule_encoder_inputs, before the skip below).
        # It is rejected where the count differs from the one this step already schedules for
        # the identifier, else from P's encoder cache's (`_reject_on_encoder_cache_embed_
        # mismatch`); an identifier P reuses is checked against its cache entry. Inline (hot:
        # a call here cost compute_demand 2.8 % with 64 occurrences).
        if gate and check_counts and (ident in first_of or ident in p_local):
            prior = first_of.get(ident)
            if prior is not None and prior[1] is not _P_LOCAL:
                if prior[2] != num_embeds:
                    conflicts[ident] = None
            elif ident in p_local and p_local[ident] != num_embeds:
                conflicts[ident] = None
        if num_embeds == 0:  # vLLM: nothing to encode for it
            decisions.append(
                new(
                    D, index=i, identifier=ident, klass=_NO_EMBEDS, num_embeds=0,
                    uncovered_embeds=0, first_uncovered_pos=None, partial=False, dedup_of=None,
                    coverage_conditional=False, connector_gate_expects=gate, evictable=False,
                )
            )  # fmt: skip
            continue
        # num_embeds > 0 here, so the item has a last embed position
        last: int = end - 1 if placeholder else m._last_embed  # type: ignore[assignment]
        # vLLM: an item whose embeds all lie before C is skipped (encoder-decoder: any C > 0)
        if (c > 0) if is_encoder_decoder else last < c:
            decisions.append(
                new(
                    D, index=i, identifier=ident, klass=_KV_COVERED, num_embeds=num_embeds,
                    uncovered_embeds=0, first_uncovered_pos=None, partial=False, dedup_of=None,
                    coverage_conditional=ext > 0 and last >= c - ext,
                    connector_gate_expects=gate, evictable=False,
                )
            )  # fmt: skip
            continue

        first_pos: int | None
        if m.is_embed is None:  # every placeholder position is an embed
            k = c - offset if c > offset else 0
            uncovered, first_pos = num_embeds - k, offset + k
        else:
            uncovered, first_pos = m.embeds_from(c)
        prior = first_of.get(ident)
        if prior is not None:  # vLLM: scheduled earlier in this step (mm_hashes_to_schedule)
            dedup_of: int | None = prior[0]
            klass = prior[1]
        else:
            dedup_of = None
            # vLLM's order: P's encoder cache (`check_and_update_cache`, at the same count), P's
            # EC connector (`has_cache_item`), else E: its cache, or its encoder. Inline (hot).
            klass = (
                _P_LOCAL if ident in p_local and p_local[ident] == num_embeds
                else _P_EXTERNAL if ident in p_external
                else _E_CACHED if ident in e_cached
                else _E_COMPUTE
            )  # fmt: skip
            first_of[ident] = (i, klass, num_embeds)
        # Where P's window first reaches the item: its first uncovered embed, or (placeholder
        # rule, all embeds before C) the first placeholder position at or after C.
        at = first_pos if first_pos is not None else (offset if offset > c else c)
        if at < need_at.get(ident, at + 1):
            need_at[ident] = at
        decisions.append(
            new(
                D,
                index=i,
                identifier=ident,
                klass=klass,
                num_embeds=num_embeds,
                uncovered_embeds=uncovered,
                first_uncovered_pos=first_pos,
                partial=0 < uncovered < num_embeds,
                dedup_of=dedup_of,
                coverage_conditional=False,
                connector_gate_expects=gate,
                evictable=klass is _P_LOCAL and ident in freeable,
            )
        )
    return decisions, conflicts, first_of, need_at


def _refuse_placement(i: int, m: MMOccurrence, n: int, prev_offset: int) -> None:
    """Raise for an occurrence outside the prompt, or before the previous one."""
    if m.end > n:
        raise InvalidArgument(
            f"occurrences[{i}] ({m.identifier!r}) spans [{m.offset}, {m.end}) outside the "
            f"prompt of num_prompt_tokens={n}"
        )
    raise InvalidArgument(
        f"occurrences[{i}] offset {m.offset} < occurrences[{i - 1}] offset {prev_offset}: "
        "occurrences must be sorted by offset, as request.mm_features is"
    )


def _collect(
    decisions: list[OccurrenceDecision],
    conflicts: dict[str, None],
    first_of: dict[str, tuple[int, ItemClass, int]],
    need_at: dict[str, int],
) -> DemandResult:
    """Split the uncovered identifiers by where they come from, in the order P first needs them."""
    e_demand, p_loads, p_local_reuse = [], [], []
    order = (
        sorted(first_of, key=lambda x: (need_at[x], first_of[x][0]))
        if len(first_of) > 1
        else first_of
    )
    for ident in order:
        klass = first_of[ident][1]
        if klass is _E_COMPUTE or klass is _E_CACHED:
            e_demand.append((ident, klass is _E_COMPUTE))
        elif klass is _P_EXTERNAL:
            p_loads.append(ident)
        else:
            p_local_reuse.append(ident)
    return DemandResult(  # positional: this runs once per plan
        tuple(decisions),
        tuple(e_demand),
        tuple(p_loads),
        tuple(p_local_reuse),
        not e_demand,
        tuple(conflicts),
    )


def kv_coverage(
    num_prompt_tokens: int,
    *,
    cached_prefix_tokens: int,
    block_size: int,
    alignment_tokens: int | None = None,
    eagle_drop: bool = False,
    hash_lookahead: int = 0,
    max_cache_hit_length: int | None = None,
    skip_reading_prefix_cache: bool = False,
    external_tokens: int = 0,
    prefix_replay_tokens: int = 0,
    replay_window_loaded: bool = False,
) -> tuple[int, int]:
    """The effective num_computed_tokens C vLLM admits a waiting request with, and its external
    part.

    Mirrors Scheduler.schedule's waiting path and KVCacheManager.get_computed_blocks (§1.1-1.2):

    Args:
        num_prompt_tokens: N.
        cached_prefix_tokens: how many leading prompt tokens P's prefix cache holds (whole hash
            units; e.g. a `BlockIndex.lookup_prefix` hit count times the hash block size).
        block_size: the KV block size B.
        alignment_tokens: A, what hits are floored to (B for single-group models; the hash block
            size with partial hash hits, which then probe inside the next block).
        eagle_drop: EAGLE/MTP block drop (use_eagle_block_drop without lookahead hashing).
        hash_lookahead: num_hash_lookahead_tokens L (hashes exist only L tokens behind).
        max_cache_hit_length: an aux connector's cap, <= N-1 (the default: vLLM always
            recomputes the last prompt token).
        skip_reading_prefix_cache: prompt_logprobs requests read no cache at all.
        external_tokens: what the KV connector's get_num_new_matched_tokens offered.
        prefix_replay_tokens: DSV4.1 SWA bounded replay window (0: none).
        replay_window_loaded: the connector's load restores the replay window.

    Returns:
        (C, external_part) with 0 <= external_part <= C <= N-1.
    """
    n = check_int("num_prompt_tokens", num_prompt_tokens, 1)
    cached = check_int("cached_prefix_tokens", cached_prefix_tokens, 0, n)
    b = check_int("block_size", block_size, 1)
    a = b if alignment_tokens is None else check_int("alignment_tokens", alignment_tokens, 1, b)
    if b % a:
        raise InvalidArgument(f"alignment_tokens={a} must divide block_size={b}")
    la = check_int("hash_lookahead", hash_lookahead, 0, n)
    check_bool("eagle_drop", eagle_drop)
    check_bool("skip_reading_prefix_cache", skip_reading_prefix_cache)
    check_bool("replay_window_loaded", replay_window_loaded)
    if eagle_drop and la:
        raise InvalidArgument(
            "eagle_drop=True with hash_lookahead > 0: vLLM turns the EAGLE block "
            "drop off when lookahead hashing is on"
        )
    ext = check_int("external_tokens", external_tokens, 0, n)
    replay = check_int("prefix_replay_tokens", prefix_replay_tokens, 0)
    cap = (
        n - 1
        if max_cache_hit_length is None
        else check_int("max_cache_hit_length", max_cache_hit_length, 0, n - 1)
    )
    if skip_reading_prefix_cache:
        return 0, 0
    cap = min(cap, n - la)
    # Local hit: whole blocks within the cap; with finer alignment, probe into the next block.
    local = min(cached // b * b, cap // b * b)
    if a < b:
        local = max(local, min(cached, cap) // a * a)
    if eagle_drop and local > 0:
        local -= min(a, b)
    local -= local % a
    # The connector is asked with the block-aligned local hit.
    if replay and not (ext and replay_window_loaded):
        ext -= ext % b
    tail = local % b
    if tail and ext > tail:
        local -= tail
    elif tail:
        ext = 0
    if local + ext > n:
        raise InvalidArgument(
            f"external_tokens={external_tokens} on top of a local hit of {local} exceeds "
            f"num_prompt_tokens={n} (vLLM asserts num_computed_tokens <= num_tokens)"
        )
    if local + ext == n:  # an async load of everything: vLLM recomputes the last token
        ext -= 1
    c = local + ext
    window_loaded = bool(ext) and replay_window_loaded
    if replay and not window_loaded:
        if 0 < c <= replay:
            return 0, 0
        rewind = min(replay, c)
        ext_rewind = min(ext, rewind)
        ext -= ext_rewind
        local -= rewind - ext_rewind
        c = local + ext
    return c, ext
