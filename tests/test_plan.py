"""plan_admission: the hand composition (hash_prompt -> lookup -> kv_coverage -> compute_demand)
on generated requests and both real views, the given-C path, and every misuse refused."""

import dataclasses
import random
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("torch")  # mmreuse.residency (BlockIndex) needs it

from mmreuse import (
    AdmissionPlan,
    Availability,
    BlockHasher,
    MMOccurrence,
    compute_demand,
    kv_coverage,
    plan_admission,
    to_event_id,
)
from mmreuse.errors import InvalidArgument, InvalidArgumentType
from mmreuse.events import RemoteKVIndex
from mmreuse.events.wire import KVEventBatch
from mmreuse.identity import RequestIdentity
from mmreuse.plan import GivenCoverage, KVLookup, KVView, PrefixMatch
from mmreuse.residency import BlockIndex
from tests.support.kv_publisher import stored
from tests.support.strategies import demand_requests

HASHERS = {
    "sha256": BlockHasher("sha256", block_size=16),
    "sha256-bs4": BlockHasher("sha256", block_size=4),
    "xxhash-bs8": BlockHasher("xxhash", block_size=8, seed="0"),
    "sha256-la3": BlockHasher("sha256", block_size=8, lookahead=3),
}


def held_hashes(hashes, rng):
    """What a view holds of a request: a leading run, sometimes more blocks after a gap."""
    k = rng.randint(0, len(hashes))
    tail = hashes[k + 1 :] if rng.random() < 0.3 else []
    return hashes[:k] + tail


def block_index_with(hashes, rng):
    index = BlockIndex(max(1, len(hashes)))
    held = held_hashes(hashes, rng)
    index.store_many(held, list(range(len(held))))
    return index


def remote_index_with(hashes, rng):
    index = RemoteKVIndex("p0")
    index.apply(
        KVEventBatch(
            ts=0.0, events=[stored([to_event_id(h) for h in held_hashes(hashes, rng)], medium=None)]
        )
    )
    return index


def lookup(view, hasher, tokens, salt, coverage):
    """The KVLookup of a request hashed here, keyed by its salt (if any)."""
    identity = None if salt is None else RequestIdentity(cache_salt=salt)
    return KVLookup(
        view, hasher=hasher, token_ids=tokens, identity=identity, kv_coverage_args=coverage
    )


def by_hand(view, hasher, tokens, occs, n, avail, salt, coverage, rule):
    """The composition plan_admission replaces, written out."""
    hashes = hasher.hash_prompt(tokens, mm=occs, cache_salt=salt)
    if isinstance(view, BlockIndex):
        hit, proof = view.lookup_prefix(hashes)
    else:
        hit, proof = view.longest_prefix(hashes), None
    c, ext = kv_coverage(
        n,
        cached_prefix_tokens=hit * hasher.block_size,
        block_size=hasher.block_size,
        hash_lookahead=hasher.lookahead,
        **coverage,
    )
    demand = compute_demand(occs, n, c, avail, external_kv_tokens=ext, coverage_rule=rule)
    return hashes, hit, proof, c, ext, demand


def assert_same_proof(got, want):
    if want is None:
        assert got is None
    else:
        assert got.block_ids.tolist() == want.block_ids.tolist()
        assert got.generations.tolist() == want.generations.tolist()


@st.composite
def plan_cases(draw):
    occs, n, _, avail = draw(demand_requests(overlap=False))
    rng = random.Random(draw(st.integers(0, 2**32)))
    tokens = [rng.randrange(152000) for _ in range(n)]
    hasher = HASHERS[draw(st.sampled_from(sorted(HASHERS)))]
    salt = draw(st.sampled_from([None, "tenant-a"]))
    coverage = draw(
        st.sampled_from(
            [
                {},
                {"external_tokens": rng.randint(0, n // 2)},
                {"max_cache_hit_length": rng.randint(0, n - 1)},
                {"alignment_tokens": 1},
                {"prefix_replay_tokens": rng.randint(1, 64)},
            ]
        )
    )
    rule = draw(st.sampled_from(["embed", "placeholder"]))
    return occs, n, Availability(**avail), tokens, hasher, salt, coverage, rule, rng


@settings(max_examples=150, deadline=None)
@given(case=plan_cases(), which=st.sampled_from(["block_index", "remote"]))
def test_plan_equals_the_hand_composition_with_a_hasher(case, which):
    occs, n, avail, tokens, hasher, salt, coverage, rule, rng = case
    hashes = hasher.hash_prompt(tokens, mm=occs, cache_salt=salt)
    view = (block_index_with if which == "block_index" else remote_index_with)(hashes, rng)
    try:
        want = by_hand(view, hasher, tokens, occs, n, avail, salt, coverage, rule)
    except ValueError as e:  # e.g. external_tokens beyond the prompt: the plan refuses it too
        with pytest.raises(ValueError, match=str(e).split(" ", 1)[0]):
            plan_admission(
                num_prompt_tokens=n,
                occurrences=occs,
                availability=avail,
                coverage=lookup(view, hasher, tokens, salt, coverage),
                coverage_rule=rule,
            )
        return
    plan = plan_admission(
        num_prompt_tokens=n,
        occurrences=occs,
        availability=avail,
        coverage=lookup(view, hasher, tokens, salt, coverage),
        coverage_rule=rule,
    )
    w_hashes, w_hit, w_proof, w_c, w_ext, w_demand = want
    assert plan.block_hashes == tuple(w_hashes)
    assert (plan.hit_blocks, plan.num_computed_tokens, plan.external_kv_tokens) == (
        w_hit,
        w_c,
        w_ext,
    )
    assert plan.demand == w_demand
    assert_same_proof(plan.proof, w_proof)
    if which == "block_index":
        assert view.validate(plan.proof)


@settings(max_examples=100, deadline=None)
@given(case=plan_cases(), which=st.sampled_from(["block_index", "remote"]), as_ids=st.booleans())
def test_plan_equals_the_hand_composition_with_given_hashes(case, which, as_ids):
    occs, n, avail, tokens, hasher, salt, _, rule, rng = case
    bs = hasher.block_size
    hashes = BlockHasher("sha256", block_size=bs).hash_prompt(tokens, mm=occs, cache_salt=salt)
    view = (block_index_with if which == "block_index" else remote_index_with)(hashes, rng)
    given_hashes = [to_event_id(h) for h in hashes] if as_ids else hashes
    plan = plan_admission(
        num_prompt_tokens=n,
        occurrences=occs,
        availability=avail,
        coverage=KVLookup(view, block_hashes=given_hashes, block_size=bs),
        coverage_rule=rule,
    )
    match = view.match_prefix(given_hashes)
    c, ext = kv_coverage(n, cached_prefix_tokens=match.num_blocks * bs, block_size=bs)
    assert plan.block_hashes == tuple(given_hashes)
    assert (plan.hit_blocks, plan.num_computed_tokens, plan.external_kv_tokens) == (
        match.num_blocks,
        c,
        ext,
    )
    assert plan.demand == compute_demand(occs, n, c, avail, coverage_rule=rule)
    assert_same_proof(plan.proof, match.proof)


@given(
    req=demand_requests(), ext_frac=st.floats(0, 1), rule=st.sampled_from(["embed", "placeholder"])
)
def test_given_c_equals_compute_demand(req, ext_frac, rule):
    occs, n, c, avail = req
    a = Availability(**avail)
    ext = int(c * ext_frac)
    plan = plan_admission(
        num_prompt_tokens=n,
        occurrences=occs,
        availability=a,
        coverage=GivenCoverage(c, ext),
        coverage_rule=rule,
    )
    assert plan == AdmissionPlan(
        block_hashes=(),
        hit_blocks=0,
        proof=None,
        num_computed_tokens=c,
        external_kv_tokens=ext,
        demand=compute_demand(occs, n, c, a, external_kv_tokens=ext, coverage_rule=rule),
    )


def test_given_c_records_given_hashes_and_passes_is_encoder_decoder():
    occs = [MMOccurrence("A", 0, 8)]
    plan = plan_admission(
        num_prompt_tokens=32,
        occurrences=occs,
        availability=Availability(),
        coverage=GivenCoverage(1, block_hashes=(b"\x01" * 32, 7)),
        is_encoder_decoder=True,
    )
    assert plan.block_hashes == (b"\x01" * 32, 7) and plan.hit_blocks == 0 and plan.proof is None
    assert plan.demand == compute_demand(occs, 32, 1, is_encoder_decoder=True)
    assert plan.demand.skip_e  # encoder-decoder: covered as soon as C > 0


def test_stale_proof_fails_validation_after_eviction():
    hasher = HASHERS["sha256"]
    tokens = list(range(64))
    occs = [MMOccurrence("A", 40, 20)]
    hashes = hasher.hash_prompt(tokens, mm=occs)
    index = BlockIndex(8)
    index.store_many(hashes, [0, 1, 2, 3])
    plan = plan_admission(
        num_prompt_tokens=64,
        occurrences=occs,
        availability=Availability(),
        coverage=KVLookup(index, hasher=hasher, token_ids=tokens),
    )
    assert (plan.hit_blocks, plan.num_computed_tokens) == (4, 48)  # the N-1 cap: 63 -> 48
    assert plan.demand.e_demand == (("A", True),) and index.validate(plan.proof)
    index.evict_block(1)
    assert not index.validate(plan.proof)


def test_lookahead_and_hybrid_block_sizes_follow_kv_coverage():
    la = HASHERS["sha256-la3"]
    tokens = list(range(100))
    idx = RemoteKVIndex("p0")
    idx.apply(KVEventBatch(ts=0.0, events=[stored(la.hash_prompt(tokens), medium=None)]))
    plan = plan_admission(
        num_prompt_tokens=100,
        occurrences=[],
        availability=Availability(),
        coverage=KVLookup(idx, hasher=la, token_ids=tokens),
    )
    assert plan.hit_blocks == 12
    assert (
        plan.num_computed_tokens
        == kv_coverage(100, cached_prefix_tokens=96, block_size=8, hash_lookahead=3)[0]
    )
    # hash blocks of 8 inside KV blocks of 16: the hit probes into the next KV block
    fine = BlockHasher("sha256", block_size=8)
    idx.apply(KVEventBatch(ts=0.0, events=[stored(fine.hash_prompt(tokens)[:5], medium=None)]))
    plan = plan_admission(
        num_prompt_tokens=100,
        occurrences=[],
        availability=Availability(),
        coverage=KVLookup(
            idx, hasher=fine, token_ids=tokens,
            kv_coverage_args={"block_size": 16, "alignment_tokens": 8},
        ),
    )  # fmt: skip
    assert (plan.hit_blocks, plan.num_computed_tokens) == (5, 40)
    assert kv_coverage(100, cached_prefix_tokens=40, block_size=16, alignment_tokens=8) == (40, 0)


def test_plan_is_frozen_and_module_is_torch_free():
    plan = plan_admission(
        num_prompt_tokens=4, occurrences=[], availability=Availability(), coverage=GivenCoverage(0)
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.hit_blocks = 3
    code = "import sys, mmreuse.plan; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
    assert isinstance(BlockIndex(1), KVView) and isinstance(RemoteKVIndex("p"), KVView)


def test_kv_lookup_is_a_frozen_record_with_its_defaults_filled():
    """KVLookup's written-out __init__ keeps the dataclass's contract: frozen, equal by value,
    `dataclasses.replace` re-checks, and the coverage arguments hold block_size's default."""
    view = BlockIndex(16)
    lookup = KVLookup(view, block_hashes=[1, 2], block_size=16)
    assert lookup.block_hashes == (1, 2) and lookup.kv_coverage_args == {"block_size": 16}
    assert lookup == KVLookup(view, block_hashes=(1, 2), block_size=16)
    with pytest.raises(dataclasses.FrozenInstanceError):
        lookup.block_size = 8  # type: ignore[misc]
    wider = dataclasses.replace(lookup, kv_coverage_args={"block_size": 32})
    assert wider.kv_coverage_args == {"block_size": 32} and wider.block_hashes == (1, 2)
    with pytest.raises(InvalidArgument, match=r"block_hashes\[0\] must be an event id"):
        dataclasses.replace(lookup, block_hashes=[-1])
    hashed = KVLookup(view, hasher=BlockHasher("sha256", block_size=16), token_ids=[1] * 20)
    assert hashed.kv_coverage_args == {"block_size": 16, "hash_lookahead": 0}


# ---- misuse -----------------------------------------------------------------------------------


class Spy:
    """A KVView that records whether it was asked, and answers what it is told to."""

    def __init__(self, answer=None):
        self.calls = 0
        self.answer = answer

    def match_prefix(self, block_hashes):
        self.calls += 1
        return PrefixMatch(0) if self.answer is None else self.answer


H16 = BlockHasher("sha256", block_size=16)
TOKENS = list(range(64))
HASHES = H16.hash_prompt(TOKENS)
BASE = dict(
    num_prompt_tokens=64, occurrences=[MMOccurrence("A", 0, 8)], availability=Availability()
)


SALTED = RequestIdentity(cache_salt="s")


@pytest.mark.parametrize(
    "record,kwargs,match",
    [
        (GivenCoverage, {"num_computed_tokens": -1}, "num_computed_tokens must be >= 0"),
        (GivenCoverage, {"num_computed_tokens": 8, "external_kv_tokens": 9}, "external_kv_tokens must be in"),
        (GivenCoverage, {"num_computed_tokens": 8, "block_hashes": [b"short"]}, r"block_hashes\[0\]"),
        (KVLookup, {"view": "SPY"}, "a lookup without the request's hashes"),
        (KVLookup, {"view": "SPY", "hasher": H16}, r"got only hasher\)"),
        (KVLookup, {"view": "SPY", "token_ids": TOKENS, "identity": SALTED}, r"got only token_ids, identity"),
        (KVLookup, {"view": "SPY", "block_hashes": HASHES, "block_size": 16, "hasher": H16, "token_ids": TOKENS},
         "block_hashes with hasher, token_ids: .*not both"),
        (KVLookup, {"view": "SPY", "block_hashes": HASHES, "block_size": 16, "identity": SALTED}, "block_hashes with identity"),
        (KVLookup, {"view": "SPY", "block_hashes": HASHES}, "block_hashes without block_size"),
        (KVLookup, {"view": "SPY", "block_hashes": HASHES, "block_size": 0}, "block_size must be >= 1"),
        (KVLookup, {"view": "SPY", "block_hashes": [HASHES[0], -1], "block_size": 16}, r"block_hashes\[1\]"),
        (KVLookup, {"view": "SPY", "block_hashes": b"x" * 32, "block_size": 16}, "block_hashes must be a seq"),
        (KVLookup, {"view": "SPY", "block_hashes": iter(HASHES), "block_size": 16}, "block_hashes must be a seq"),
        (KVLookup, {"view": "SPY", "hasher": "sha256", "token_ids": TOKENS}, "hasher must be a BlockHasher"),
        (KVLookup, {"view": "SPY", "hasher": H16, "token_ids": TOKENS, "block_size": 8},
         "block_size must be hasher.block_size=16"),
        (KVLookup, {"view": "SPY", "hasher": H16, "token_ids": "abc"}, "token_ids must be a sequence"),
        (KVLookup, {"view": object(), "hasher": H16, "token_ids": TOKENS}, "view must be a KVView"),
        (KVLookup, {"view": "SPY", "hasher": H16, "token_ids": TOKENS, "identity": "s"},
         "identity must be a RequestIdentity"),
        (KVLookup, {"view": "SPY", "hasher": H16, "token_ids": TOKENS, "kv_coverage_args": {"cached_prefix_tokens": 3}},
         "kv_coverage_args keys must be kv_coverage keywords.*'cached_prefix_tokens'"),
        (KVLookup, {"view": "SPY", "hasher": H16, "token_ids": TOKENS, "kv_coverage_args": {"eagle": True}},
         "kv_coverage_args keys .*'eagle'"),
        (KVLookup, {"view": "SPY", "hasher": H16, "token_ids": TOKENS, "kv_coverage_args": [("eagle_drop", True)]},
         "kv_coverage_args must be a mapping"),
        (KVLookup, {"view": "SPY", "hasher": H16, "token_ids": TOKENS, "kv_coverage_args": {"hash_lookahead": 2}},
         r"kv_coverage_args\['hash_lookahead'\] must be hasher.lookahead=0"),
    ],
)  # fmt: skip
def test_a_record_refuses_misuse_naming_the_field(record, kwargs, match):
    spy = Spy()
    with pytest.raises(InvalidArgument, match=match):
        record(**{k: spy if isinstance(v, str) and v == "SPY" else v for k, v in kwargs.items()})
    assert spy.calls == 0


@pytest.mark.parametrize(
    "coverage,kwargs,match",
    [
        (lambda spy: GivenCoverage(64), {}, "num_computed_tokens must be in"),
        (lambda spy: KVLookup(spy, block_hashes=HASHES + HASHES[:1], block_size=16), {}, "4 full blocks"),
        (lambda spy: KVLookup(spy, hasher=H16, token_ids=TOKENS[:-1]), {}, "token_ids must hold .*64 tokens, got 63"),
        (lambda spy: KVLookup(spy, hasher=H16, token_ids=TOKENS, kv_coverage_args={"eagle_drop": 1}), {},
         "eagle_drop must be a bool"),
        (lambda spy: GivenCoverage(0), {"num_prompt_tokens": 0}, "num_prompt_tokens must be >= 1"),
        (lambda spy: GivenCoverage(8), {"availability": {"A": 1}}, "availability must be an Availability"),
        (lambda spy: GivenCoverage(8), {"occurrences": "A"}, "occurrences must be a sequence"),
        (lambda spy: GivenCoverage(8), {"coverage_rule": "blocks"}, "coverage_rule must be"),
        (lambda spy: GivenCoverage(8), {"is_encoder_decoder": 1}, "is_encoder_decoder must be a bool"),
        (lambda spy: KVLookup(spy, hasher=H16, token_ids=TOKENS), {"availability": None},
         "availability must be an Availability"),
        (lambda spy: None, {}, "coverage must be a KVLookup or a GivenCoverage, got None"),
        (lambda spy: {"num_computed_tokens": 8}, {}, "coverage must be a KVLookup or a GivenCoverage"),
    ],
)  # fmt: skip
def test_misuse_raises_naming_the_arguments(coverage, kwargs, match):
    spy = Spy()
    with pytest.raises(InvalidArgument, match=match):
        plan_admission(**{**BASE, "coverage": coverage(spy), **kwargs})
    assert spy.calls == 0 or "eagle_drop" in match  # refused before any lookup


@pytest.mark.parametrize(
    "answer,match,cls",
    [
        (
            (0, None),
            r"view.match_prefix\(block_hashes\) must be a PrefixMatch",
            InvalidArgumentType,
        ),
        (PrefixMatch(5), r"num_blocks must be in \[0, 4\], got 5", InvalidArgument),
        (PrefixMatch(-1), r"num_blocks must be in \[0, 4\]", InvalidArgument),
        (PrefixMatch(True), "num_blocks must be an int", InvalidArgumentType),
    ],
)
def test_a_broken_view_answer_is_refused(answer, match, cls):
    with pytest.raises(cls, match=match):
        plan_admission(**BASE, coverage=KVLookup(Spy(answer), hasher=H16, token_ids=TOKENS))


def test_type_errors_are_typed_and_arguments_keyword_only():
    with pytest.raises(InvalidArgumentType):
        KVLookup(object(), hasher=H16, token_ids=TOKENS)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        plan_admission(64, [], Availability(), GivenCoverage(0))  # type: ignore[misc]
