"""compute_demand against a position-level model of vLLM's chunked prefill, and its invariants."""

from hypothesis import given
from hypothesis import strategies as st

from mmreuse import Availability, ItemClass, compute_demand
from tests.support.strategies import demand_requests

NEEDS = {ItemClass.P_LOCAL, ItemClass.P_EXTERNAL, ItemClass.E_CACHED, ItemClass.E_COMPUTE}


def features_in_window(occs, start, end):
    """vLLM's get_mm_features_in_window, re-written from its description: offset < end and
    offset + length > start (indices of the occurrences, in order)."""
    return [i for i, m in enumerate(occs) if m.offset < end and m.offset + m.length > start]


def embeds_in_range(m, start_rel, end_rel):
    """vLLM's PlaceholderRange.get_embeds_indices_in_range over the is_embed cumsum."""
    if m.is_embed is None:
        return start_rel, end_rel
    cumsum = []
    total = 0
    for e in m.is_embed:
        total += e
        cumsum.append(total)
    lo = cumsum[start_rel - 1] if start_rel > 0 else 0
    hi = cumsum[end_rel - 1] if end_rel > 0 else 0
    return lo, hi


def walk_chunked_prefill(occs, n, c, chunks):
    """Per occurrence, the embeddings P's chunked prefill consumes from C to N."""
    consumed = [0] * len(occs)
    pos = c
    for size in chunks:
        if pos >= n:
            break
        end = min(n, pos + size)
        for i in features_in_window(occs, pos, end):
            m = occs[i]
            start_rel = max(0, pos - m.offset)
            end_rel = min(m.length, end - m.offset)
            lo, hi = embeds_in_range(m, start_rel, end_rel)
            consumed[i] += hi - lo
        pos = end
    if pos < n:  # the last chunk reaches N
        for i in features_in_window(occs, pos, n):
            m = occs[i]
            lo, hi = embeds_in_range(m, max(0, pos - m.offset), min(m.length, n - m.offset))
            consumed[i] += hi - lo
    return consumed


@given(req=demand_requests(), chunks=st.lists(st.integers(1, 64), min_size=1, max_size=40))
def test_demanded_iff_the_chunked_prefill_touches_an_embed_at_or_after_c(req, chunks):
    occs, n, c, _ = req
    consumed = walk_chunked_prefill(occs, n, c, chunks)
    res = compute_demand(occs, n, c)
    for d, used, m in zip(res.decisions, consumed, occs, strict=True):
        assert (d.klass in NEEDS) == (used > 0)
        assert d.uncovered_embeds == used
        if d.klass in NEEDS:
            assert d.num_embeds == m.num_embeds
            assert d.first_uncovered_pos >= c and d.partial == (0 < used < m.num_embeds)
        else:
            assert d.klass in (ItemClass.KV_COVERED, ItemClass.NO_EMBEDS)
            assert (d.klass is ItemClass.NO_EMBEDS) == (m.num_embeds == 0)


@given(req=demand_requests(), more=st.integers(0, 300))
def test_more_coverage_never_adds_demand(req, more):
    occs, n, c, avail = req
    c2 = min(n - 1, c + more)
    a = Availability(**avail)
    low, high = compute_demand(occs, n, c, a), compute_demand(occs, n, c2, a)
    for d_low, d_high in zip(low.decisions, high.decisions, strict=True):
        if d_low.klass not in NEEDS:
            assert d_high.klass not in NEEDS
    if low.conflicts or high.conflicts:
        return  # vLLM rejects such a request; a count mismatch may re-route the uncovered copy
    assert {i for i, _ in high.e_demand} <= {i for i, _ in low.e_demand}
    assert set(high.p_loads) <= set(low.p_loads)
    assert set(high.p_local_reuse) <= set(low.p_local_reuse)


@given(req=demand_requests(), rule=st.sampled_from(["embed", "placeholder"]), encdec=st.booleans())
def test_result_invariants(req, rule, encdec):
    occs, n, c, avail = req
    res = compute_demand(
        occs, n, c, Availability(**avail), coverage_rule=rule, is_encoder_decoder=encdec
    )
    assert [d.index for d in res.decisions] == list(range(len(occs)))
    first = {}
    for d in res.decisions:
        if d.klass not in NEEDS:
            assert d.dedup_of is None
            continue
        if d.identifier in first:
            assert d.dedup_of == first[d.identifier].index
            assert d.klass is first[d.identifier].klass
        else:
            assert d.dedup_of is None
            first[d.identifier] = d
    assert res.skip_e == (res.e_demand == ())
    for seq in (res.e_demand, res.p_loads, res.p_local_reuse, res.conflicts):
        assert len(seq) == len(set(seq))
    assert {i for i, _ in res.e_demand} == {i for i, d in first.items() if d.klass.needs_e}
    assert dict(res.e_demand) == {
        i: d.klass is ItemClass.E_COMPUTE for i, d in first.items() if d.klass.needs_e
    }
    assert set(res.p_loads) == {i for i, d in first.items() if d.klass is ItemClass.P_EXTERNAL}
    assert set(res.p_local_reuse) == {i for i, d in first.items() if d.klass is ItemClass.P_LOCAL}
    if encdec:
        assert all(
            d.klass in (ItemClass.KV_COVERED, ItemClass.NO_EMBEDS) for d in res.decisions
        ) == (c > 0 or all(m.num_embeds == 0 for m in occs))


@given(req=demand_requests())
def test_placeholder_rule_demands_a_superset(req):
    occs, n, c, avail = req
    a = Availability(**avail)
    embed = compute_demand(occs, n, c, a)
    placeholder = compute_demand(occs, n, c, a, coverage_rule="placeholder")
    if embed.conflicts or placeholder.conflicts:
        return  # rejected by vLLM either way
    assert {i for i, _ in embed.e_demand} <= {i for i, _ in placeholder.e_demand}
