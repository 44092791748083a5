"""What admitting a request at a Prefill instance takes: the one composition of the library.

request -> block hashes -> KV view lookup (`KVView.match_prefix`) -> `kv_coverage` (C) ->
`compute_demand`. `plan_admission` does it once, top to bottom, and returns an `AdmissionPlan`;
the simulator, the vLLM adapter and docs/demand.md's recipe all go through it. C comes one way or
the other, one record each (SGLang's `MatchPrefixParams` idiom): looked up in a view
(`KVLookup`: `BlockIndex`, `RemoteKVIndex`), or given (`GivenCoverage`: P's own scheduler).

Torch-free: views are passed in, never imported here.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .blockhash import ExternalBlockHash, check_block_hashes
from .demand import (
    Availability,
    CoverageRule,
    DemandResult,
    EncoderCacheSpace,
    compute_demand,
    kv_coverage,
)
from .errors import InvalidArgument
from .hashing import BlockHasher
from .identity import RequestIdentity
from .kvview import KVView, PrefixMatch
from .occurrence import MMOccurrence
from .validate import check_bool, check_int, fail_type, fail_value

__all__ = [
    "AdmissionPlan",
    "GivenCoverage",
    "KVLookup",
    "KVView",
    "PrefixMatch",
    "plan_admission",
]


@dataclass(frozen=True, slots=True)
class AdmissionPlan:
    """Everything one admission decided, and what it was decided from.

    Attributes:
        block_hashes: the request's full-block hashes (as given or computed; () when C was
            given without them).
        hit_blocks: leading blocks the view holds (0 when C was given).
        proof: the view's CoverageProof when it gives one (`BlockIndex`), else None; check it
            with `BlockIndex.validate` at consume time.
        num_computed_tokens: C, from `kv_coverage` (or as given).
        external_kv_tokens: the part of C a KV connector loads, from `kv_coverage` (or as given).
        demand: `compute_demand`'s result at that C.
    """

    block_hashes: tuple[ExternalBlockHash, ...]
    hit_blocks: int
    proof: Any | None
    num_computed_tokens: int
    external_kv_tokens: int
    demand: DemandResult


# kv_coverage's keywords a caller may set through `KVLookup.kv_coverage_args` (plan_admission supplies
# cached_prefix_tokens; block_size there is the KV block size, when finer hash blocks differ).
_COVERAGE_KEYS = frozenset(
    p.name
    for p in inspect.signature(kv_coverage).parameters.values()
    if p.kind is inspect.Parameter.KEYWORD_ONLY
) - {"cached_prefix_tokens"}


@dataclass(frozen=True, slots=True)
class GivenCoverage:
    """C as P's own scheduler knows it: nothing is looked up.

    Attributes:
        num_computed_tokens: C (at most num_prompt_tokens - 1, checked by `plan_admission`).
        external_kv_tokens: the part of C a KV connector loads.
        block_hashes: the request's hashes, only recorded in the plan.
    """

    num_computed_tokens: int
    external_kv_tokens: int = 0
    block_hashes: tuple[ExternalBlockHash, ...] = ()

    def __post_init__(self) -> None:
        c = check_int("num_computed_tokens", self.num_computed_tokens, 0)
        check_int("external_kv_tokens", self.external_kv_tokens, 0, c)
        hashes = self.block_hashes
        if type(hashes) is not tuple or hashes:  # P's scheduler passes none: () needs no check
            object.__setattr__(self, "block_hashes", _check_hashes(hashes))


@dataclass(frozen=True, slots=True, init=False)
class KVLookup:
    """C looked up in a view of P's prefix cache (`BlockIndex`, `RemoteKVIndex`): the request's
    hashes, given (`block_hashes` + `block_size`) or computed (`hasher` + `token_ids`, keyed
    by `identity`: its cache salt and LoRA adapter), matched in `view`; the hit, in tokens,
    goes through `kv_coverage(**kv_coverage_args)`.

    Attributes:
        view: the view of P's prefix cache.
        block_hashes, block_size: the request's full-block hashes (a tuple once checked) and
            their block size.
        hasher, token_ids, identity: what computes them instead (`block_size`, if given, must
            be `hasher.block_size`).
        kv_coverage_args: kv_coverage's keywords but `cached_prefix_tokens`: its `block_size` is
            the KV block size where it differs from the hash block size (hybrid models);
            `block_size` defaults to the hashes', `hash_lookahead` to `hasher.lookahead`.
    """

    view: KVView
    block_hashes: Sequence[ExternalBlockHash] | None
    block_size: int | None
    hasher: BlockHasher | None
    token_ids: Sequence[int] | None
    identity: RequestIdentity | None
    kv_coverage_args: Mapping[str, Any]

    def __init__(
        self,
        view: KVView,
        block_hashes: Sequence[ExternalBlockHash] | None = None,
        block_size: int | None = None,
        hasher: BlockHasher | None = None,
        token_ids: Sequence[int] | None = None,
        identity: RequestIdentity | None = None,
        kv_coverage_args: Mapping[str, Any] | None = None,
    ) -> None:
        # Written out, not dataclass-made: every plan builds one, and a frozen dataclass's
        # __init__ pays an object.__setattr__ call per field (here one bound setter).
        # What isinstance(view, KVView) checks, without its ~7 us (typing's protocol walk).
        if not callable(getattr(view, "match_prefix", None)):
            fail_type("view", "a KVView (with match_prefix(block_hashes))", view)
        if identity is not None and not isinstance(identity, RequestIdentity):
            fail_type("identity", "a RequestIdentity", identity)
        if block_hashes is not None:
            if hasher is not None or token_ids is not None or identity is not None:
                _refuse_both(hasher, token_ids, identity)
            if block_size is None:
                raise InvalidArgument(
                    "block_hashes without block_size: the hit is counted in blocks, and C in tokens"
                )
            bs = check_int("block_size", block_size, 1)
            block_hashes = _check_hashes(block_hashes)
        else:
            bs = _check_hasher(hasher, token_ids, identity, block_size)
        set_field = object.__setattr__.__get__(self)
        set_field("view", view)
        set_field("block_hashes", block_hashes)
        set_field("block_size", block_size)
        set_field("hasher", hasher)
        set_field("token_ids", token_ids)
        set_field("identity", identity)
        set_field("kv_coverage_args", _coverage_args(kv_coverage_args, hasher, bs))


def _given(hasher: Any, token_ids: Any, identity: Any) -> list[str]:
    """Which of the arguments that compute a request's hashes were given."""
    named = (("hasher", hasher), ("token_ids", token_ids), ("identity", identity))
    return [name for name, value in named if value is not None]


def _refuse_both(hasher: Any, token_ids: Any, identity: Any) -> None:
    """Given hashes with what would compute them: refused, naming those given."""
    raise InvalidArgument(
        f"block_hashes with {', '.join(_given(hasher, token_ids, identity))}: give the hashes, "
        "or hasher + token_ids (+ identity) to compute them, not both"
    )


def _check_hasher(hasher: Any, token_ids: Any, identity: Any, block_size: Any) -> int:
    """A lookup's hasher + token_ids (its hashes computed); the hashes' block size."""
    if hasher is None or token_ids is None:
        have = _given(hasher, token_ids, identity)
        got = f" (got only {', '.join(have)})" if have else ""
        raise InvalidArgument(
            f"a lookup without the request's hashes{got}: pass block_hashes (+ block_size), "
            "or hasher + token_ids (+ identity)"
        )
    if not isinstance(hasher, BlockHasher):
        fail_type("hasher", "a BlockHasher", hasher)
    bs: int = hasher.block_size
    if block_size is not None and check_int("block_size", block_size, 1) != bs:
        raise InvalidArgument(
            f"block_size must be hasher.block_size={bs} (the hashes' block size), got {block_size}"
        )
    if isinstance(token_ids, (str, bytes)) or not isinstance(token_ids, Sequence):
        fail_type("token_ids", "a sequence of token ids", token_ids)
    return bs


def plan_admission(
    *,
    num_prompt_tokens: int,
    occurrences: Sequence[MMOccurrence],
    availability: Availability,
    coverage: KVLookup | GivenCoverage,
    coverage_rule: CoverageRule = "embed",
    is_encoder_decoder: bool = False,
    encoder_cache: EncoderCacheSpace | None = None,
) -> AdmissionPlan:
    """Plan a request's admission at P: its C, and what it needs from E at that C.

    C is looked up (`KVLookup`: a view of P's prefix cache and the request's hashes) or given
    (`GivenCoverage`, as P's scheduler knows it). `coverage_rule`, `is_encoder_decoder` and
    `encoder_cache` (P's encoder-cache space: rule S) go to `compute_demand`. Raises
    `InvalidArgument` naming the field for any invalid value (the records check their own).
    """
    n = check_int("num_prompt_tokens", num_prompt_tokens, 1)
    _check_demand_inputs(occurrences, availability, coverage_rule, is_encoder_decoder)
    if type(coverage) is GivenCoverage:  # C given: record it, look nothing up
        c = check_int("num_computed_tokens", coverage.num_computed_tokens, 0, n - 1)
        ext = coverage.external_kv_tokens
        hashes = coverage.block_hashes
        hit, proof = 0, None
    elif type(coverage) is KVLookup:  # C looked up: hashes -> the view's hit -> kv_coverage
        hashes, bs = _request_hashes(n, occurrences, coverage)
        hit, proof = _match(coverage.view, hashes)
        c, ext = kv_coverage(n, cached_prefix_tokens=hit * bs, **coverage.kv_coverage_args)
    else:
        fail_type("coverage", "a KVLookup or a GivenCoverage", coverage)
    demand = compute_demand(
        occurrences,
        n,
        c,
        availability,
        external_kv_tokens=ext,
        is_encoder_decoder=is_encoder_decoder,
        coverage_rule=coverage_rule,
        encoder_cache=encoder_cache,
    )
    return AdmissionPlan(
        block_hashes=hashes,
        hit_blocks=hit,
        proof=proof,
        num_computed_tokens=c,
        external_kv_tokens=ext,
        demand=demand,
    )


def _check_demand_inputs(
    occurrences: Any, availability: Any, coverage_rule: Any, is_encoder_decoder: Any
) -> None:
    """compute_demand's argument types, checked before any hashing or lookup."""
    if isinstance(occurrences, (str, bytes)) or not isinstance(occurrences, Sequence):
        fail_type("occurrences", "a sequence of MMOccurrence", occurrences)
    if not isinstance(availability, Availability):
        fail_type("availability", "an Availability", availability)
    if coverage_rule != "embed" and coverage_rule != "placeholder":
        fail_value("coverage_rule", "'embed' or 'placeholder'", coverage_rule)
    check_bool("is_encoder_decoder", is_encoder_decoder)


def _check_hashes(block_hashes: Any) -> tuple[ExternalBlockHash, ...]:
    """Given block hashes as a tuple, each a digest (>= 8 bytes) or a 64-bit event id."""
    if isinstance(block_hashes, (str, bytes, bytearray)) or not isinstance(block_hashes, Sequence):
        fail_type("block_hashes", "a sequence of block hashes", block_hashes)
    hashes = tuple(block_hashes)
    check_block_hashes(hashes)  # refuses a bad one, naming block_hashes[i]
    return hashes


def _request_hashes(
    n: int, occurrences: Sequence[MMOccurrence], lookup: KVLookup
) -> tuple[tuple[ExternalBlockHash, ...], int]:
    """The request's full-block hashes, given or computed here, and the block size they use
    (what depends on num_prompt_tokens: the records checked the rest)."""
    if lookup.block_hashes is not None:
        bs: int = lookup.block_size  # type: ignore[assignment]  # KVLookup requires it
        hashes: tuple[ExternalBlockHash, ...] = lookup.block_hashes  # type: ignore[assignment]
        if len(hashes) > n // bs:
            raise InvalidArgument(
                f"block_hashes has {len(hashes)} hashes, more than the {n // bs} full blocks of "
                f"num_prompt_tokens={n} at block_size={bs}"
            )
        return hashes, bs
    hasher: BlockHasher = lookup.hasher  # type: ignore[assignment]  # KVLookup requires it
    token_ids: Sequence[int] = lookup.token_ids  # type: ignore[assignment]
    if len(token_ids) != n:
        raise InvalidArgument(
            f"token_ids must hold num_prompt_tokens={n} tokens, got {len(token_ids)}"
        )
    tokens = token_ids if type(token_ids) is list else list(token_ids)
    keys = {} if lookup.identity is None else lookup.identity.hash_kwargs()
    return tuple(hasher.hash_prompt(tokens, mm=occurrences, **keys)), hasher.block_size


def _match(view: KVView, hashes: tuple[ExternalBlockHash, ...]) -> tuple[int, Any]:
    """The view's leading hit on `hashes` and its proof; an answer beyond them is refused."""
    match = view.match_prefix(hashes)
    if not isinstance(match, PrefixMatch):
        fail_type("view.match_prefix(block_hashes)", "a PrefixMatch", match)
    hit = check_int("view.match_prefix(block_hashes).num_blocks", match.num_blocks, 0, len(hashes))
    return hit, match.proof


def _coverage_args(coverage: Any, hasher: BlockHasher | None, block_size: int) -> dict[str, Any]:
    """kv_coverage's keywords: `coverage`, checked, its block_size defaulting to the hashes'
    and, with a hasher, its hash_lookahead defaulting to (and held equal to) the lookahead."""
    if coverage is None:
        args: dict[str, Any] = {"block_size": block_size}
    elif not isinstance(coverage, Mapping):
        fail_type("kv_coverage_args", "a mapping of kv_coverage keywords", coverage)
    else:
        args = dict(coverage)
        unknown = sorted(map(repr, args.keys() - _COVERAGE_KEYS))
        if unknown:
            raise InvalidArgument(
                f"kv_coverage_args keys must be kv_coverage keywords {sorted(_COVERAGE_KEYS)}, got "
                f"{', '.join(unknown)}"
            )
        args.setdefault("block_size", block_size)
    if hasher is not None:
        lookahead = args.setdefault("hash_lookahead", hasher.lookahead)
        if type(lookahead) is not int or lookahead != hasher.lookahead:
            raise InvalidArgument(
                f"kv_coverage_args['hash_lookahead'] must be hasher.lookahead={hasher.lookahead} (the "
                f"hashes exist that far behind), got {lookahead!r}"
            )
    return args
