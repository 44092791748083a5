"""mmreuse.sim.cluster's shortcut for rule S: it skips the encoder cache's space only where
`compute_demand` with that space would evict nothing the request uses."""

from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st

pytest.importorskip("torch")  # the simulator's caches are residency ops

from mmreuse.demand import Availability, compute_demand
from mmreuse.occurrence import MMOccurrence
from mmreuse.sim.caches import EncoderCache
from mmreuse.sim.cluster import _rule_s_can_apply

IDS = [f"i{k}" for k in range(8)]


@st.composite
def cache_and_request(draw):
    cache = EncoderCache(draw(st.integers(4, 40)), lambda *_: None)
    sizes = {i: draw(st.integers(1, 12)) for i in IDS}
    for ident in draw(st.lists(st.sampled_from(IDS), max_size=12)):  # acquire, maybe release
        if cache.acquire(ident, sizes[ident]) and draw(st.booleans()):
            cache.release(ident)
    picks = draw(st.lists(st.sampled_from(IDS), min_size=1, max_size=5))
    offset, mm = 4, []
    for ident in picks:
        mm.append(MMOccurrence(ident, offset, sizes[ident]))
        offset += sizes[ident] + 2
    delivered = draw(st.lists(st.sampled_from(picks), max_size=2, unique=True))
    return cache, SimpleNamespace(mm=mm, num_tokens=offset + 2), delivered, sizes


@given(cache_and_request(), st.integers(0, 3))
def test_the_shortcut_skips_rule_s_only_where_it_evicts_nothing_of_the_request(case, c):
    cache, request, delivered, sizes = case
    local = {**cache.entries, **{i: sizes[i] for i in delivered}}
    idents = {m.identifier for m in request.mm}
    availability = Availability(p_local={i: local[i] for i in idents if i in local})
    plain = compute_demand(request.mm, request.num_tokens, c, availability)
    exact = compute_demand(
        request.mm, request.num_tokens, c, availability, encoder_cache=cache.space()
    )
    if idents & set(exact.self_evicted):  # the test can fail: such cases occur
        assert _rule_s_can_apply(cache, request, local)
    if not _rule_s_can_apply(cache, request, local):
        assert not idents & set(exact.self_evicted)
        assert exact.decisions == plain.decisions
