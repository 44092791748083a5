"""What admitting a request at a Prefill instance takes: the one composition of the library.

request -> block hashes -> KV view lookup (`KVView.match_prefix`) -> `kv_coverage` (C) ->
`compute_demand`. `plan_admission` does it once, top to bottom, and returns an `AdmissionPlan`;
the simulator, the vLLM adapter and docs/demand.md's recipe all go through it. C comes one way or
the other: looked up in a view (`BlockIndex`, `RemoteKVIndex`), or given (P's own scheduler).

Torch-free: views are passed in, never imported here.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .blockhash import ExternalBlockHash, to_event_ids
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

__all__ = ["AdmissionPlan", "KVView", "PrefixMatch", "plan_admission"]


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


# kv_coverage's keywords a caller may set through `coverage` (plan_admission supplies
# cached_prefix_tokens; block_size there is the KV block size, when finer hash blocks differ).
_COVERAGE_KEYS = frozenset(
    p.name
    for p in inspect.signature(kv_coverage).parameters.values()
    if p.kind is inspect.Parameter.KEYWORD_ONLY
) - {"cached_prefix_tokens"}


def plan_admission(
    *,
    num_prompt_tokens: int,
    occurrences: Sequence[MMOccurrence],
    availability: Availability,
    view: KVView | None = None,
    block_hashes: Sequence[ExternalBlockHash] | None = None,
    hasher: BlockHasher | None = None,
    token_ids: Sequence[int] | None = None,
    cache_salt: str | None = None,
    identity: RequestIdentity | None = None,
    block_size: int | None = None,
    coverage: Mapping[str, Any] | None = None,
    num_computed_tokens: int | None = None,
    external_kv_tokens: int = 0,
    coverage_rule: CoverageRule = "embed",
    is_encoder_decoder: bool = False,
    encoder_cache: EncoderCacheSpace | None = None,
) -> AdmissionPlan:
    """Plan a request's admission at P: its C, and what it needs from E at that C.

    Either C is looked up: `view` plus the request's hashes, as `block_hashes` (with
    `block_size`) or computed from `hasher` + `token_ids` (+ the request's `identity`, its
    cache salt and LoRA adapter, or only `cache_salt`; `block_size`
    defaults to `hasher.block_size`, `coverage["hash_lookahead"]` to `hasher.lookahead`); the
    hit, times `block_size`, goes through `kv_coverage(**coverage)`. Or C is given as
    `num_computed_tokens` (+ `external_kv_tokens`), as P's scheduler knows it; then no view,
    hasher, tokens, block size or coverage, and `block_hashes`, if given, are only recorded.

    `coverage` takes kv_coverage's keywords but `cached_prefix_tokens`; its `block_size` is the
    KV block size where it differs from the hash block size (hybrid models). `coverage_rule`,
    `is_encoder_decoder` and `encoder_cache` (P's encoder-cache space: rule S) go to
    `compute_demand`. Raises `InvalidArgument` for any other
    mix of arguments, naming them, and for any invalid value.
    """
    n = check_int("num_prompt_tokens", num_prompt_tokens, 1)
    _check_demand_inputs(occurrences, availability, coverage_rule, is_encoder_decoder)
    given_identity = identity
    identity = _identity(identity, cache_salt)
    if num_computed_tokens is not None:  # C given: record it, look nothing up
        _refuse_with_given_c(
            view=view,
            hasher=hasher,
            token_ids=token_ids,
            cache_salt=cache_salt,
            identity=given_identity,
            block_size=block_size,
            coverage=coverage,
        )
        c = check_int("num_computed_tokens", num_computed_tokens, 0, n - 1)
        ext = check_int("external_kv_tokens", external_kv_tokens, 0, c)
        hashes = () if block_hashes is None else _check_hashes(block_hashes)
        hit, proof = 0, None
    else:  # C looked up: hashes -> the view's hit -> kv_coverage
        view = _check_view(view, external_kv_tokens)
        hashes, bs = _request_hashes(
            n,
            occurrences,
            block_hashes,
            hasher,
            token_ids,
            identity,
            block_size,
            "cache_salt" if cache_salt is not None else "identity",
        )
        args = _coverage_args(coverage, bs, hasher)
        hit, proof = _match(view, hashes)
        c, ext = kv_coverage(n, cached_prefix_tokens=hit * bs, **args)
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


def _identity(identity: Any, cache_salt: Any) -> RequestIdentity | None:
    """The request's identity (None: no hashing argument given), from `identity` or the
    `cache_salt` shorthand; both at once is refused."""
    if identity is not None:
        if not isinstance(identity, RequestIdentity):
            fail_type("identity", "a RequestIdentity", identity)
        if cache_salt is not None:
            raise InvalidArgument(
                "identity with cache_salt: the identity carries the salt; pass one of them"
            )
        return identity
    return None if cache_salt is None else RequestIdentity(cache_salt=cache_salt)


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


def _refuse_with_given_c(**lookup_args: Any) -> None:
    """With C given, the arguments that would compute it must be absent."""
    given = [name for name, value in lookup_args.items() if value is not None]
    if given:
        raise InvalidArgument(
            f"num_computed_tokens (C given) with {', '.join(given)}: those compute C by a "
            "lookup and kv_coverage; pass either num_computed_tokens or view with the hashes"
        )


def _check_view(view: Any, external_kv_tokens: Any) -> KVView:
    """The view C is looked up in, which then also decides the external part."""
    if view is None:
        raise InvalidArgument(
            "neither num_computed_tokens nor view: pass num_computed_tokens (C known), or view "
            "with block_hashes (+ block_size) or hasher + token_ids"
        )
    # What isinstance(view, KVView) checks, without its ~7 us per call (typing's protocol walk).
    if not callable(getattr(view, "match_prefix", None)):
        fail_type("view", "a KVView (with match_prefix(block_hashes))", view)
    if type(external_kv_tokens) is not int or external_kv_tokens != 0:
        raise InvalidArgument(
            f"external_kv_tokens={external_kv_tokens!r} without num_computed_tokens: with a view "
            "kv_coverage computes it; pass the connector's offer as coverage={'external_tokens': n}"
        )
    return view


def _check_hashes(block_hashes: Any) -> tuple[ExternalBlockHash, ...]:
    """Given block hashes as a tuple, each a digest (>= 8 bytes) or a 64-bit event id."""
    if isinstance(block_hashes, (str, bytes, bytearray)) or not isinstance(block_hashes, Sequence):
        fail_type("block_hashes", "a sequence of block hashes", block_hashes)
    hashes = tuple(block_hashes)
    to_event_ids(hashes, "block_hashes")  # refuses a bad one, naming block_hashes[i]
    return hashes


def _request_hashes(
    n: int,
    occurrences: Sequence[MMOccurrence],
    block_hashes: Any,
    hasher: Any,
    token_ids: Any,
    identity: RequestIdentity | None,
    block_size: Any,
    identity_name: str,
) -> tuple[tuple[ExternalBlockHash, ...], int]:
    """The request's full-block hashes, given or computed here, and the block size they use."""
    if block_hashes is not None:
        both = [
            k
            for k, v in (("hasher", hasher), ("token_ids", token_ids), (identity_name, identity))
            if v is not None
        ]
        if both:
            raise InvalidArgument(
                f"block_hashes with {', '.join(both)}: give the hashes, or hasher + token_ids "
                "(+ identity or cache_salt) to compute them, not both"
            )
        if block_size is None:
            raise InvalidArgument(
                "block_hashes without block_size: the hit is counted in blocks, and C in tokens"
            )
        bs = check_int("block_size", block_size, 1)
        hashes = _check_hashes(block_hashes)
        if len(hashes) > n // bs:
            raise InvalidArgument(
                f"block_hashes has {len(hashes)} hashes, more than the {n // bs} full blocks of "
                f"num_prompt_tokens={n} at block_size={bs}"
            )
        return hashes, bs
    if hasher is None or token_ids is None:
        have = [
            k
            for k, v in (("hasher", hasher), ("token_ids", token_ids), (identity_name, identity))
            if v is not None
        ]
        got = f" (got only {', '.join(have)})" if have else ""
        raise InvalidArgument(
            f"view without the request's hashes{got}: pass block_hashes (+ block_size), or "
            "hasher + token_ids (+ identity or cache_salt)"
        )
    if not isinstance(hasher, BlockHasher):
        fail_type("hasher", "a BlockHasher", hasher)
    bs = hasher.block_size
    if block_size is not None and check_int("block_size", block_size, 1) != bs:
        raise InvalidArgument(
            f"block_size must be hasher.block_size={bs} (the hashes' block size), got {block_size}"
        )
    if isinstance(token_ids, (str, bytes)) or not isinstance(token_ids, Sequence):
        fail_type("token_ids", "a sequence of token ids", token_ids)
    if len(token_ids) != n:
        raise InvalidArgument(
            f"token_ids must hold num_prompt_tokens={n} tokens, got {len(token_ids)}"
        )
    tokens = token_ids if type(token_ids) is list else list(token_ids)
    keys = {} if identity is None else identity.hash_kwargs()
    return tuple(hasher.hash_prompt(tokens, mm=occurrences, **keys)), bs


def _match(view: KVView, hashes: tuple[ExternalBlockHash, ...]) -> tuple[int, Any]:
    """The view's leading hit on `hashes` and its proof; an answer beyond them is refused."""
    match = view.match_prefix(hashes)
    if not isinstance(match, PrefixMatch):
        fail_type("view.match_prefix(block_hashes)", "a PrefixMatch", match)
    hit = check_int("view.match_prefix(block_hashes).num_blocks", match.num_blocks, 0, len(hashes))
    return hit, match.proof


def _coverage_args(coverage: Any, block_size: int, hasher: BlockHasher | None) -> dict[str, Any]:
    """kv_coverage's keywords: `coverage`, block_size defaulting to the hashes' block size and,
    with a hasher, hash_lookahead to (and held equal to) the hasher's lookahead."""
    if coverage is None:
        args: dict[str, Any] = {}
    elif not isinstance(coverage, Mapping):
        fail_type("coverage", "a mapping of kv_coverage keywords", coverage)
    else:
        args = dict(coverage)
        unknown = sorted(map(repr, args.keys() - _COVERAGE_KEYS))
        if unknown:
            raise InvalidArgument(
                f"coverage keys must be kv_coverage keywords {sorted(_COVERAGE_KEYS)}, got "
                f"{', '.join(unknown)}"
            )
    args.setdefault("block_size", block_size)
    if hasher is not None:
        lookahead = args.setdefault("hash_lookahead", hasher.lookahead)
        if type(lookahead) is not int or lookahead != hasher.lookahead:
            raise InvalidArgument(
                f"coverage['hash_lookahead'] must be hasher.lookahead={hasher.lookahead} (the "
                f"hashes exist that far behind), got {lookahead!r}"
            )
    return args
