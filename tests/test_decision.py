"""mmreuse.decision: the policies, and dispatch (what E and P get)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mmreuse import Availability, MMOccurrence, compute_demand
from mmreuse.decision import (
    POLICIES,
    Dispatch,
    Policy,
    dispatch,
    dispatch_all,
    dispatch_at_arrival,
    dispatch_demand,
    parse_policy,
)
from mmreuse.demand import ItemClass
from mmreuse.errors import InvalidArgument


def test_policies_say_what_they_read_and_ask():
    assert POLICIES == ("eager", "demand", "opportunistic", "index")
    assert [p for p in Policy if p.renders] == [Policy.DEMAND, Policy.OPPORTUNISTIC, Policy.INDEX]
    assert [p for p in Policy if p.reads_view] == [Policy.INDEX]
    assert [p for p in Policy if p.asks_p] == [Policy.DEMAND, Policy.OPPORTUNISTIC]
    assert [p for p in Policy if p.e_at_once] == [Policy.EAGER, Policy.OPPORTUNISTIC]
    assert parse_policy("index") is Policy.INDEX and parse_policy(Policy.EAGER) is Policy.EAGER
    with pytest.raises(InvalidArgument, match=r"^--policy must be one of .*got 'lazy'"):
        parse_policy("lazy", "--policy")


def test_a_kv_covered_first_occurrence_does_not_carry_the_delivery():
    """img at offset 0 is covered by KV; its repeat after C needs E: E gets the repeat's item,
    the covered one shares it (the proxy's index path and P's answers agree on this)."""
    occ = [MMOccurrence("img", 0, 8), MMOccurrence("txt-img", 10, 4), MMOccurrence("img", 40, 8)]
    demand = compute_demand(occ, 60, 32, Availability(p_local={"txt-img": 4}))
    assert demand.item_classes() == (
        ItemClass.KV_COVERED,
        ItemClass.KV_COVERED,
        ItemClass.E_COMPUTE,
    )
    d = dispatch_demand(demand, [2, 0, 1], 3)  # occurrence i is item occurrence_items[i]
    assert d.e_items == (1,)  # the third occurrence's item
    assert d.shares == {2: 1} and d.raw_items == {0}
    assert d.classes == (ItemClass.KV_COVERED, ItemClass.E_COMPUTE, ItemClass.KV_COVERED)


def test_duplicates_share_and_everything_else_goes_raw():
    occ = [MMOccurrence("a", 0, 4), MMOccurrence("b", 4, 4), MMOccurrence("a", 8, 4)]
    demand = compute_demand(occ, 20, 0, Availability(p_local={"b": 4}, e_cached={"a"}))
    d = dispatch_demand(demand, [0, 1, 2], 3)
    assert d.e_items == (0,) and d.shares == {2: 0} and d.raw_items == {1}
    assert d.classes == (ItemClass.E_CACHED, ItemClass.P_LOCAL, ItemClass.DUPLICATE)
    assert dispatch_all(2) == dispatch_all(2)
    assert dispatch_all(2).e_items == (0, 1)
    assert dispatch_all(2).classes == (ItemClass.UNCLASSIFIED,) * 2


def test_dispatch_refuses_inconsistent_input():
    with pytest.raises(InvalidArgument, match=r"^occurrences\[0\] must be an \(identifier, class"):
        dispatch([("a", ItemClass.E_COMPUTE)], [], 1)
    with pytest.raises(InvalidArgument, match=r"^e_demand names \['a'\], but no occurrence"):
        dispatch([("a", ItemClass.KV_COVERED, 0)], ["a"], 1)
    with pytest.raises(InvalidArgument, match=r"^occurrences\[0\] item must be an item index"):
        dispatch([("a", ItemClass.E_COMPUTE, 3)], ["a"], 1)
    with pytest.raises(
        InvalidArgument, match=r"^occurrence_items has 2 entries for the demand's 1"
    ):
        dispatch_demand(compute_demand([MMOccurrence("a", 0, 4)], 8, 0), [0, 1], 2)


@given(
    st.lists(
        st.tuples(st.sampled_from("abcd"), st.integers(1, 6), st.integers(0, 3)),
        min_size=0,
        max_size=8,
    ),
    st.integers(0, 60),
)
def test_each_identifier_e_delivers_is_sent_once_where_p_consumes_it(spec, c_hint):
    occs, offset = [], 0
    for ident, n, gap in spec:
        offset += gap
        occs.append(MMOccurrence(ident, offset, n))
        offset += n
    n_tokens = offset + 1
    sizes: dict[str, int] = {}
    occs = [o for o in occs if sizes.setdefault(o.identifier, o.length) == o.length]
    demand = compute_demand(occs, n_tokens, min(c_hint, n_tokens - 1), Availability())
    d = dispatch_demand(demand, list(range(len(occs))), len(occs))
    sent = [occs[i].identifier for i in d.e_items]
    assert sorted(sent) == sorted(ident for ident, _ in demand.e_demand)  # each once
    for i in d.e_items:  # at its first occurrence that needs E
        first = next(x.index for x in demand.decisions if x.identifier == occs[i].identifier
                     and x.klass.needs_e)  # fmt: skip
        assert first == i
    # every item is sent, shares a sent one, or goes raw: exactly one of the three
    for i in range(len(occs)):
        assert (i in d.e_items) + (i in d.shares) + (i in d.raw_items) == 1


def test_abandon_sends_p_raw_what_e_no_longer_delivers():
    """Opportunistic: E got every item; those abandoned there go to P raw, the rest E
    delivers each on its own (nothing shared), the classes stay the plan's."""
    classes = (ItemClass.E_COMPUTE, ItemClass.P_LOCAL, ItemClass.DUPLICATE)
    planned = Dispatch((0,), frozenset({1}), {2: 0}, classes)
    d = planned.abandon([1])
    assert d == Dispatch((0, 2), frozenset({1}), {}, classes)
    assert planned.abandon([]) == Dispatch((0, 1, 2), frozenset(), {}, classes)
    with pytest.raises(InvalidArgument, match=r"^items must be item indices in \[0, 3\), got 3"):
        planned.abandon([3])


def test_resend_sends_e_again_and_p_raw_as_well():
    classes = (ItemClass.E_COMPUTE, ItemClass.P_EXTERNAL, ItemClass.DUPLICATE)
    planned = Dispatch((0,), frozenset({1}), {2: 0}, classes)
    assert planned.resend({1}) == Dispatch((0, 1), frozenset({1}), {2: 0}, classes)
    assert planned.resend({0}) == Dispatch((0,), frozenset({0, 1}), {2: 0}, classes)
    with pytest.raises(InvalidArgument, match=r"^items must be item indices"):
        planned.resend({-1})


def test_with_sent_keeps_each_identifier_at_e_through_the_item_already_sent():
    """The arrival split sent item 0 ("a") to E; the plan, made on the whole request, has
    item 2 ("a" again) at E, item 1 ("b") raw, item 3 ("c") at E and item 4 ("c") sharing it:
    "a" stays E's through item 0 (item 2 shares it), "c" goes to E once, "b" stays raw."""
    uuids = ["a", "b", "a", "c", "c"]
    classes = (ItemClass.E_COMPUTE, ItemClass.P_LOCAL, ItemClass.DUPLICATE,
               ItemClass.E_COMPUTE, ItemClass.DUPLICATE)  # fmt: skip
    planned = Dispatch((2, 3), frozenset({1}), {4: 3}, (ItemClass.UNCLASSIFIED,) * 5)
    d = planned.with_sent([0], {}, uuids, classes)
    assert d == Dispatch((0, 3), frozenset({1}), {2: 0, 4: 3}, classes)
    # a share the plan made onto an item of a sent identifier points at the sent item
    planned = Dispatch((1, 2), frozenset(), {4: 2}, (ItemClass.UNCLASSIFIED,) * 5)
    d = planned.with_sent([0, 3], {}, ["x", "y", "c", "c", "c"], classes)
    assert d.e_items == (0, 1, 3) and d.shares == {2: 3, 4: 3}
    # the arrival's own duplicates are kept, and a raw item of a sent identifier is not raw
    planned = Dispatch((), frozenset({0, 1}), {}, (ItemClass.UNCLASSIFIED,) * 2)
    assert planned.with_sent([0], {1: 0}, ["a", "a"], classes[:2]) == Dispatch(
        (0,), frozenset(), {1: 0}, classes[:2]
    )


def test_a_request_decided_at_arrival_sends_e_now_and_p_the_rest_raw():
    classes = (ItemClass.E_COMPUTE, ItemClass.UNCLASSIFIED, ItemClass.DUPLICATE)
    assert dispatch_at_arrival((0,), [1], {2: 0}, list(classes)) == Dispatch(
        (0,), frozenset({1}), {2: 0}, classes
    )
