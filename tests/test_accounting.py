"""mmreuse.accounting: the one accounting function the simulator and bench-cluster share."""

from __future__ import annotations

from mmreuse.accounting import (
    Bucket,
    Delivery,
    PolicyResult,
    account_request,
    accounting_occurrences,
    needed_from_e,
)
from mmreuse.demand import ItemClass as C


def test_the_first_uncovered_occurrence_accounts_for_an_identifier():
    occ = [("a", C.KV_COVERED), ("b", C.P_LOCAL), ("a", C.E_COMPUTE), ("a", C.DUPLICATE)]
    assert accounting_occurrences(occ) == {"a": 2, "b": 1}
    assert accounting_occurrences([("a", C.KV_COVERED), ("a", C.KV_COVERED)]) == {"a": 0}
    assert needed_from_e(occ) == {"a"}


def test_a_needed_forward_after_c_is_not_redundant():
    """The repeated-image case: covered at offset 0, needed after C, E forwarded it."""
    occ = [("a", C.KV_COVERED), ("a", C.P_LOCAL)]  # delivered: in P's encoder cache
    acct = account_request(
        occ, delivered={"a": Delivery.FORWARD}, would_need_e={"a"}, late=lambda *_: None
    )
    assert acct.buckets == [Bucket.DEDUP, Bucket.FORWARD]
    assert acct.redundant_forwards == 0 and acct.needs_encoding
    covered = account_request(
        [("a", C.KV_COVERED)], delivered={"a": Delivery.FORWARD}, would_need_e=set(),
        late=lambda *_: None,
    )  # fmt: skip
    assert covered.redundant_forwards == 1 and not covered.needs_encoding


def test_buckets_late_fallbacks_and_wrong_skips_in_order():
    calls = []

    def late(i, ident, cls):
        calls.append(("late", i, ident, cls))
        return Delivery.E_CACHE if ident == "c" else None

    def on_external(i, ident):
        calls.append(("external", i, ident))

    occ = [("x", C.P_EXTERNAL), ("c", C.E_CACHED), ("d", C.E_COMPUTE), ("n", C.NO_EMBEDS)]
    acct = account_request(occ, delivered={}, would_need_e=set(), late=late,
                           on_external=on_external)  # fmt: skip
    assert acct.buckets == [Bucket.EXTERNAL, Bucket.E_CACHE, Bucket.FORWARD, Bucket.KV]
    assert calls == [
        ("external", 0, "x"),
        ("late", 1, "c", C.E_CACHED),
        ("late", 2, "d", C.E_COMPUTE),
    ]
    assert (acct.external_loads, acct.late_fallbacks, acct.wrong_skips) == (1, 1, 1)
    assert not acct.needs_encoding  # E's cache served the fallback; d was never served
    r = PolicyResult("index")
    r.add(acct)
    assert r.occurrences == 4 and sum(r.buckets.values()) == 4 and r.wrong_skips == 1


def test_partial_coverage_counts_accounting_occurrences_only():
    """An item whose leading embed positions are cached and tail not: counted once per
    identifier (its accounting occurrence), whatever bucket it lands in."""
    occ = [("a", C.P_LOCAL), ("a", C.DUPLICATE), ("b", C.E_COMPUTE), ("c", C.KV_COVERED)]
    acct = account_request(
        occ, delivered={"b": Delivery.FORWARD}, would_need_e={"b"}, late=lambda *_: None,
        partial={0, 1, 2},
    )  # fmt: skip
    assert acct.partial_coverage == 2  # a (its first occurrence) and b; a's duplicate is not
    assert acct.buckets == [Bucket.P_EMBEDDING, Bucket.DEDUP, Bucket.FORWARD, Bucket.KV]
    r = PolicyResult("demand")
    r.add(acct)
    r.add(account_request(occ, delivered={}, would_need_e=set(), late=lambda *_: None))
    assert r.partial_coverage == 2
