"""compute_demand / kv_coverage: every numbered case of demand-semantics.md §6.4, and bad input."""

import pytest

from mmreuse import Availability, ItemClass, MMOccurrence, compute_demand, kv_coverage

K = ItemClass


def occ(ident, start, end, mask=None):
    return MMOccurrence(ident, start, end - start, is_embed=mask)


def classes(res):
    return [d.klass for d in res.decisions]


# ---- §6.4 numbered cases ------------------------------------------------------------------------


def test_case_01_full_kv_coverage():
    c, ext = kv_coverage(64, cached_prefix_tokens=64, block_size=16)
    assert (c, ext) == (48, 0)
    res = compute_demand([occ("X", 10, 30)], 64, c)
    assert classes(res) == [K.KV_COVERED]
    assert res.e_demand == () and res.skip_e


def test_case_02_coverage_ends_mid_occurrence():
    d = compute_demand([occ("X", 10, 42)], 64, 32)
    m0 = d.decisions[0]
    assert (m0.klass, m0.num_embeds, m0.uncovered_embeds, m0.first_uncovered_pos, m0.partial) == (
        K.E_COMPUTE,
        32,
        10,
        32,
        True,
    )
    assert d.e_demand == (("X", True),)


MASK3 = [False] + [True] * 23 + [False] * 8  # embeds at 9..31 of [8, 40)


def test_case_03_all_embeds_covered_trailing_non_embeds_not():
    d = compute_demand([occ("X", 8, 40, MASK3)], 64, 32)
    m0 = d.decisions[0]
    assert m0.klass is K.KV_COVERED and m0.uncovered_embeds == 0 and m0.connector_gate_expects
    assert d.e_demand == ()


def test_case_03b_same_with_c16():
    m0 = compute_demand([occ("X", 8, 40, MASK3)], 64, 16).decisions[0]
    assert (m0.klass, m0.num_embeds, m0.uncovered_embeds, m0.partial) == (K.E_COMPUTE, 23, 16, True)


def test_case_03c_placeholder_rule_is_mooncake_safe():
    d = compute_demand([occ("X", 8, 40, MASK3)], 64, 32, coverage_rule="placeholder")
    m0 = d.decisions[0]
    assert (m0.klass, m0.uncovered_embeds, m0.partial) == (K.E_COMPUTE, 0, False)
    assert d.e_demand == (("X", True),)


def test_case_04_same_identifier_one_covered_one_not():
    d = compute_demand([occ("X", 4, 20), occ("X", 60, 76)], 96, 48)
    assert classes(d) == [K.KV_COVERED, K.E_COMPUTE]
    assert d.decisions[1].dedup_of is None
    assert d.e_demand == (("X", True),)


def test_case_04b_uncovered_copy_reuses_p_local():
    d = compute_demand([occ("X", 4, 20), occ("X", 60, 76)], 96, 48, Availability(p_local={"X": 16}))
    assert classes(d) == [K.KV_COVERED, K.P_LOCAL]
    assert d.e_demand == () and d.p_local_reuse == ("X",)


def test_case_05_same_identifier_both_uncovered():
    d = compute_demand([occ("X", 4, 20), occ("X", 60, 76)], 96, 0)
    assert classes(d) == [K.E_COMPUTE, K.E_COMPUTE]
    assert d.decisions[1].dedup_of == 0
    assert d.e_demand == (("X", True),)


def test_case_06_p_local_hit():
    d = compute_demand([occ("Y", 10, 30)], 64, 0, Availability(p_local={"Y": 20}))
    assert classes(d) == [K.P_LOCAL] and d.skip_e and not d.decisions[0].evictable


def test_case_06b_p_local_freeable_is_evictable():
    d = compute_demand(
        [occ("Y", 10, 30)],
        64,
        0,
        Availability(p_local={"Y": 20}, p_local_freeable=frozenset({"Y"})),
    )
    assert classes(d) == [K.P_LOCAL] and d.decisions[0].evictable


def test_case_06c_p_local_embed_count_mismatch_is_a_conflict():
    d = compute_demand([occ("Y", 10, 30)], 64, 0, Availability(p_local={"Y": 19}))
    assert d.conflicts == ("Y",)
    assert classes(d) == [K.E_COMPUTE]


def test_case_07_external_ec_hit():
    d = compute_demand([occ("Y", 10, 30)], 64, 0, Availability(p_external=frozenset({"Y"})))
    assert classes(d) == [K.P_EXTERNAL] and d.p_loads == ("Y",) and d.skip_e


def test_case_07b_local_is_checked_before_external():
    d = compute_demand(
        [occ("Y", 10, 30)], 64, 0, Availability(p_local={"Y": 20}, p_external=frozenset({"Y"}))
    )
    assert classes(d) == [K.P_LOCAL] and d.p_loads == ()


def test_case_08_e_cache_hit():
    d = compute_demand([occ("Y", 10, 30)], 64, 0, Availability(e_cached=frozenset({"Y"})))
    assert classes(d) == [K.E_CACHED]
    assert d.e_demand == (("Y", False),) and not d.skip_e


def test_case_09_nothing_available():
    d = compute_demand([occ("Y", 10, 30)], 64, 0)
    assert classes(d) == [K.E_COMPUTE] and d.e_demand == (("Y", True),)


def test_case_10_last_token_cap_when_image_is_last():
    c, _ = kv_coverage(32, cached_prefix_tokens=32, block_size=16)
    assert c == 16
    m0 = compute_demand([occ("Z", 16, 32)], 32, c).decisions[0]
    assert (m0.klass, m0.uncovered_embeds, m0.partial) == (K.E_COMPUTE, 16, False)


def test_case_10b_fine_grained_c31_still_needs_the_whole_item():
    c, _ = kv_coverage(32, cached_prefix_tokens=32, block_size=16, alignment_tokens=1)
    assert c == 31
    assert kv_coverage(32, cached_prefix_tokens=32, block_size=1)[0] == 31
    m0 = compute_demand([occ("Z", 16, 32)], 32, c).decisions[0]
    assert (m0.klass, m0.uncovered_embeds, m0.partial, m0.num_embeds) == (K.E_COMPUTE, 1, True, 16)


def test_case_10c_decode_after_full_remote_load():
    c, ext = kv_coverage(32, cached_prefix_tokens=0, block_size=16, external_tokens=32)
    assert (c, ext) == (31, 31)
    m0 = compute_demand([occ("Z", 16, 32)], 32, c, external_kv_tokens=ext).decisions[0]
    assert (m0.klass, m0.uncovered_embeds) == (K.E_COMPUTE, 1)


def test_case_10_invariant_c_equal_n_raises():
    with pytest.raises(ValueError, match="num_computed_tokens"):
        compute_demand([occ("Z", 16, 32)], 32, 32)


def test_case_11_block_aligned_coverage_stops_mid_image():
    c, _ = kv_coverage(100, cached_prefix_tokens=48, block_size=16)
    m0 = compute_demand([occ("W", 20, 60)], 100, c).decisions[0]
    assert (
        c,
        m0.klass,
        m0.num_embeds,
        m0.uncovered_embeds,
        m0.first_uncovered_pos,
        m0.partial,
    ) == (48, K.E_COMPUTE, 40, 12, 48, True)


def test_case_11b_connector_part_makes_coverage_conditional():
    c, ext = kv_coverage(100, cached_prefix_tokens=32, block_size=16, external_tokens=16)
    assert (c, ext) == (48, 16)
    assert (
        compute_demand([occ("W", 20, 60)], 100, c, external_kv_tokens=ext).decisions[0].klass
        is K.E_COMPUTE
    )
    m0 = compute_demand([occ("W", 20, 40)], 100, c, external_kv_tokens=ext).decisions[0]
    assert m0.klass is K.KV_COVERED and m0.coverage_conditional
    # covered by local KV alone: not conditional
    assert (
        not compute_demand([occ("W", 0, 20)], 100, c, external_kv_tokens=ext)
        .decisions[0]
        .coverage_conditional
    )


def test_case_12_eagle_drop():
    assert kv_coverage(100, cached_prefix_tokens=96, block_size=16)[0] == 96
    assert compute_demand([occ("V", 70, 90)], 100, 96).decisions[0].klass is K.KV_COVERED
    c, _ = kv_coverage(100, cached_prefix_tokens=96, block_size=16, eagle_drop=True)
    m0 = compute_demand([occ("V", 70, 90)], 100, c).decisions[0]
    assert (c, m0.klass, m0.uncovered_embeds, m0.partial) == (80, K.E_COMPUTE, 10, True)


def test_case_13_skip_reading_prefix_cache():
    c, ext = kv_coverage(
        100,
        cached_prefix_tokens=96,
        block_size=16,
        external_tokens=16,
        skip_reading_prefix_cache=True,
    )
    assert (c, ext) == (0, 0)
    assert classes(compute_demand([occ("A", 0, 10), occ("B", 50, 60)], 100, c)) == [
        K.E_COMPUTE,
        K.E_COMPUTE,
    ]


@pytest.mark.parametrize("c", [0, 8, 15, 16, 40, 63])
def test_case_14_zero_embed_occurrence(c):
    d = compute_demand([occ("Q", 8, 16, [False] * 8)], 64, c)
    assert classes(d) == [K.NO_EMBEDS] and d.e_demand == ()


def test_case_15_encoder_decoder():
    avail = Availability(
        p_local={"A": 10}, p_external=frozenset({"A", "B"}), e_cached=frozenset({"B"})
    )
    d = compute_demand([occ("A", 0, 10), occ("B", 0, 20)], 64, 0, avail, is_encoder_decoder=True)
    assert classes(d) == [K.E_COMPUTE, K.E_CACHED]
    d = compute_demand([occ("A", 0, 10), occ("B", 0, 20)], 64, 5, avail, is_encoder_decoder=True)
    assert classes(d) == [K.KV_COVERED, K.KV_COVERED] and d.skip_e


def test_case_16_swa_bounded_replay():
    c, _ = kv_coverage(100, cached_prefix_tokens=48, block_size=16, prefix_replay_tokens=32)
    assert c == 16
    m0 = compute_demand([occ("R", 20, 40)], 100, c).decisions[0]
    assert (m0.klass, m0.uncovered_embeds) == (K.E_COMPUTE, 20)
    assert kv_coverage(100, cached_prefix_tokens=32, block_size=16, prefix_replay_tokens=32)[0] == 0
    # a KV load that restores the window replays nothing
    assert kv_coverage(
        100,
        cached_prefix_tokens=0,
        block_size=16,
        external_tokens=48,
        prefix_replay_tokens=32,
        replay_window_loaded=True,
    ) == (48, 48)


def test_case_17_overlapping_occurrences_use_own_masks():
    video_mask = [(j % 2 == 0) and j <= 90 for j in range(100)]  # last video embed at 100
    audio_mask = [(j % 2 == 1) and j <= 47 for j in range(96)]  # last audio embed at 12+47=59
    video, audio = occ("vid", 10, 110, video_mask), occ("aud", 12, 108, audio_mask)
    assert video.last_embed_pos == 100 and audio.last_embed_pos == 59
    d = compute_demand([video, audio], 200, 64)
    assert classes(d) == [K.E_COMPUTE, K.KV_COVERED]


def test_case_18_embed_exactly_at_the_boundary():
    assert compute_demand([occ("B", 0, 32)], 64, 32).decisions[0].klass is K.KV_COVERED
    m0 = compute_demand([occ("B", 0, 32)], 64, 31).decisions[0]
    assert (m0.klass, m0.uncovered_embeds) == (K.E_COMPUTE, 1)


def test_case_19_several_identifiers_mixed():
    avail = Availability(p_local={"B": 10}, p_external=frozenset({"C"}), e_cached=frozenset({"D"}))
    mm = [occ("A", 0, 16), occ("B", 50, 60), occ("C", 70, 80), occ("D", 90, 99), occ("E", 99, 110)]
    d = compute_demand(mm, 120, 48, avail)
    assert classes(d) == [K.KV_COVERED, K.P_LOCAL, K.P_EXTERNAL, K.E_CACHED, K.E_COMPUTE]
    assert d.e_demand == (("D", False), ("E", True))
    assert d.p_loads == ("C",) and d.p_local_reuse == ("B",)


def test_case_20_proxy_uuid_never_matches_engine_identifier():
    d = compute_demand(
        [occ("lora1:h", 0, 16)],
        64,
        0,
        Availability(p_local={"u1": 16}, p_external=frozenset({"h"})),
    )
    assert classes(d) == [K.E_COMPUTE]


def test_case_21_duplicate_identifiers_with_inconsistent_counts():
    d = compute_demand([occ("X", 0, 16), occ("X", 20, 40)], 64, 0)
    assert d.conflicts == ("X",)


# ---- more behaviour -------------------------------------------------------------------------


def test_e_demand_is_in_first_uncovered_order_not_input_order():
    # overlapping items: the later-starting one has its first uncovered embed earlier
    a = occ("a", 0, 40, [j >= 35 for j in range(40)])
    b = occ("b", 5, 30)
    d = compute_demand([a, b], 64, 10)
    assert d.e_demand == (("b", True), ("a", True))


def test_needs_media_at_p_lists_racy_skips():
    avail = Availability(
        p_local={"B": 10}, p_local_freeable=frozenset({"B"}), p_external=frozenset({"C"})
    )
    mm = [
        occ("A", 20, 40),
        occ("T", 30, 50, [True] * 2 + [False] * 18),
        occ("B", 50, 60),
        occ("C", 70, 80),
    ]
    d = compute_demand(mm, 120, 48, avail, external_kv_tokens=16)
    assert d.skip_e
    assert d.decisions[0].coverage_conditional  # last embed 39 >= 48 - 16
    assert d.decisions[1].klass is K.KV_COVERED and d.decisions[1].connector_gate_expects
    assert d.needs_media_at_p() == (0, 1, 2, 3)
    assert d.needs_media_at_p(external_store_can_evict=False) == (0, 1, 2)


def test_covered_in_window_item_with_mismatched_cache_is_a_conflict():
    # vLLM checks the encoder cache for every item the window touches, embeds or not
    m = occ("X", 8, 40, MASK3)
    d = compute_demand([m], 64, 32, Availability(p_local={"X": 5}))
    assert d.decisions[0].klass is K.KV_COVERED and d.conflicts == ("X",)


def test_compute_demand_is_pure():
    mm = [occ("X", 4, 20), occ("X", 60, 76), occ("Y", 80, 90)]
    avail = Availability(p_local={"Y": 10})
    assert compute_demand(mm, 96, 16, avail) == compute_demand(mm, 96, 16, avail)


# ---- bad input ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args,kwargs,match",
    [
        (([], 64, -1), {}, "num_computed_tokens"),
        (([], 64, 64), {}, "num_computed_tokens"),
        (([], 0, 0), {}, "num_prompt_tokens"),
        (([], 64, 8.0), {}, "num_computed_tokens"),
        (([], 64, 8), {"external_kv_tokens": 9}, "external_kv_tokens"),
        (([], 64, 8), {"external_kv_tokens": -1}, "external_kv_tokens"),
        (([], 64, 8), {"coverage_rule": "blocks"}, "coverage_rule"),
        (([occ("A", 60, 70)], 64, 8), {}, "outside the prompt"),
        (([occ("A", 20, 30), occ("B", 10, 12)], 64, 8), {}, "sorted"),
        (([("A", 0, 4)], 64, 8), {}, r"occurrences\[0\]"),
        (("A", 64, 8), {}, "occurrences"),
        (([], 64, 8, {"A": 1}), {}, "availability"),
        (([], 64, 8), {"is_encoder_decoder": True, "external_kv_tokens": 4}, "encoder-decoder"),
    ],
)
def test_compute_demand_bad_input(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        compute_demand(*args, **kwargs)


def test_is_embed_length_mismatch_raises():
    with pytest.raises(ValueError, match="is_embed"):
        occ("A", 0, 4, [True])


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"p_local": {"A": 0}}, r"p_local\['A'\]"),
        ({"p_local": {1: 3}}, "p_local keys"),
        ({"p_local": {"A": 3}, "p_local_freeable": frozenset({"B"})}, "p_local_freeable"),
        ({"p_external": "AB"}, "p_external"),
        ({"e_cached": {1}}, "e_cached"),
    ],
)
def test_availability_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Availability(**kwargs)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"cached_prefix_tokens": 65}, "cached_prefix_tokens"),
        ({"cached_prefix_tokens": 0, "block_size": 0}, "block_size"),
        ({"cached_prefix_tokens": 0, "alignment_tokens": 5}, "alignment_tokens"),
        ({"cached_prefix_tokens": 0, "alignment_tokens": 32}, "alignment_tokens"),
        ({"cached_prefix_tokens": 0, "eagle_drop": True, "hash_lookahead": 1}, "eagle_drop"),
        ({"cached_prefix_tokens": 0, "max_cache_hit_length": 64}, "max_cache_hit_length"),
        ({"cached_prefix_tokens": 48, "external_tokens": 32}, "exceeds"),
        ({"cached_prefix_tokens": 0, "external_tokens": -1}, "external_tokens"),
    ],
)
def test_kv_coverage_bad_input(kwargs, match):
    kwargs.setdefault("block_size", 16)
    with pytest.raises(ValueError, match=match):
        kv_coverage(64, **kwargs)


def test_kv_coverage_connector_rule():
    # local 40 with fine alignment 8: tail 8; remote 24 > 8 -> drop the tail, take the remote
    assert kv_coverage(
        100, cached_prefix_tokens=40, block_size=16, alignment_tokens=8, external_tokens=24
    ) == (56, 24)
    # remote 8 does not beat the tail: keep the local tail, load nothing
    assert kv_coverage(
        100, cached_prefix_tokens=40, block_size=16, alignment_tokens=8, external_tokens=8
    ) == (40, 0)
    assert kv_coverage(100, cached_prefix_tokens=32, block_size=16, external_tokens=20) == (52, 20)
    assert kv_coverage(100, cached_prefix_tokens=96, block_size=16, hash_lookahead=8) == (80, 0)


# ---- rule S: the request's own allocations (docs/demand-semantics.md §1.8) ---------------------


def test_rule_s_self_evictions():
    from mmreuse.demand import EncoderCacheSpace

    occ = [MMOccurrence("X", 0, 8), MMOccurrence("C", 10, 8)]
    avail = Availability(p_local={"C": 8, "D": 8}, p_local_freeable=frozenset({"C", "D"}))
    plain = compute_demand(occ, 30, 0, avail)
    assert [d.klass for d in plain.decisions] == [ItemClass.E_COMPUTE, ItemClass.P_LOCAL]
    assert plain.self_evicted == () and not plain.encoder_cache_short
    # no free slot, C the oldest freeable: X evicts C, C is encoded again (and evicts D)
    res = compute_demand(
        occ, 30, 0, avail, encoder_cache=EncoderCacheSpace(0, (("C", 8), ("D", 8)))
    )
    assert [d.klass for d in res.decisions] == [ItemClass.E_COMPUTE, ItemClass.E_COMPUTE]
    assert res.e_demand == (("X", True), ("C", True)) and res.self_evicted == ("C", "D")
    # room enough: nothing evicted, the same as without the rule
    roomy = compute_demand(occ, 30, 0, avail, encoder_cache=EncoderCacheSpace(8, (("C", 8),)))
    assert roomy.decisions == plain.decisions and roomy.self_evicted == ()
    # a KV-covered X allocates nothing
    covered = compute_demand(occ, 30, 9, avail, encoder_cache=EncoderCacheSpace(0, (("C", 8),)))
    assert [d.klass for d in covered.decisions] == [ItemClass.KV_COVERED, ItemClass.P_LOCAL]
    # the cache cannot hold X at all: short (P spreads the items over steps)
    short = compute_demand(occ[:1], 30, 0, Availability(), encoder_cache=EncoderCacheSpace(4))
    assert short.encoder_cache_short and short.self_evicted == ()
    # encoder-decoder models keep no reusable cache: the rule does not apply
    ed = compute_demand(occ, 30, 0, avail, is_encoder_decoder=True,
                        encoder_cache=EncoderCacheSpace(0, (("C", 8),)))  # fmt: skip
    assert ed.self_evicted == ()


@pytest.mark.parametrize(
    "args, match",
    [
        ((-1,), r"^num_free_slots must be >= 0"),
        ((0, [("C", 8)]), None),
        ((0, (("C", 0),)), r"^freeable\[0\] num_embeds must be >= 1"),
        ((0, (("C", 8), ("C", 8))), r"^freeable\[1\] names 'C' twice"),
        ((0, ("C",)), r"^freeable\[0\] must be an \(identifier, num_embeds\) pair"),
        ((0, "C8"), r"^freeable must be a sequence"),
    ],
)
def test_encoder_cache_space_refuses(args, match):
    from mmreuse.demand import EncoderCacheSpace

    if match is None:
        assert EncoderCacheSpace(*args).freeable == (("C", 8),)  # a list, kept as a tuple
        return
    with pytest.raises(ValueError, match=match):
        EncoderCacheSpace(*args)
    with pytest.raises(ValueError, match=r"^encoder_cache must be an EncoderCacheSpace"):
        compute_demand([], 4, 0, encoder_cache=(0, ()))


def test_item_class_names_compute_demands_classes_and_the_wire_only_ones():
    """One enum: compute_demand's six classes, `duplicate` (an answer's, a record's) and
    `unclassified` (the proxy's, for an item it made no plan for)."""
    assert [c.value for c in ItemClass] == [
        "kv_covered", "no_embeds", "p_local", "p_external", "e_cached", "e_compute",
        "duplicate", "unclassified",
    ]  # fmt: skip
    assert [c for c in ItemClass if c.covered] == [ItemClass.KV_COVERED, ItemClass.NO_EMBEDS]
    assert [c for c in ItemClass if c.needs_e] == [ItemClass.E_CACHED, ItemClass.E_COMPUTE]
    occ = [MMOccurrence("a", 0, 4), MMOccurrence("b", 4, 4), MMOccurrence("a", 8, 4)]
    d = compute_demand(occ, 20, 0, Availability(p_local={"b": 4}))
    assert [x.klass for x in d.decisions] == [K.E_COMPUTE, K.P_LOCAL, K.E_COMPUTE]
    assert d.item_classes() == (K.E_COMPUTE, K.P_LOCAL, K.DUPLICATE)
