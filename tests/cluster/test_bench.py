"""bench-cluster's accounting (mmreuse.cluster.bench.attribute): P's admission records joined
with the proxy's decisions into the simulator's buckets, by the simulator's rules; torch-free.
The live run is in tests/live_proxy/test_bench_live.py."""

from __future__ import annotations

from types import SimpleNamespace as NS

import pytest

from mmreuse.accounting import Bucket
from mmreuse.cluster.bench import RequestOutcome, attribute
from mmreuse.decision import Dispatch
from mmreuse.demand import ItemClass
from mmreuse.demand_query import AdmissionRecord, RecordItem


def req(rid, *uuids):
    return NS(rid=rid, uuids=tuple(uuids))


def record(rid, idents, classes, encoded=()):
    """An admission record (P's, or E's with `rid` None): each item's identifier and class."""
    items = [RecordItem(i, ItemClass(c)) for i, c in zip(idents, classes, strict=True)]
    return AdmissionRecord(0, f"r{rid}", 8, 0, items, list(encoded))


def out(rid, e_items, idents, classes, encoded=(), status=200, ttft=10.0, raw=()):
    decision = NS(dispatch=Dispatch(tuple(e_items), frozenset(raw)), trace=NS(render_s=0.0))
    return RequestOutcome(rid, status, ttft, decision, [record(rid, idents, classes, encoded)])


def test_deliveries_win_then_ps_classes():
    reqs = [req(0, "a", "b"), req(1, "a", "b", "c", "d", "d"), req(2, "a", "e")]
    outs = [
        out(0, [0, 1], "ab", ["p_external", "p_external"], ttft=50.0),  # E computes a and b
        # b again at E (its store serves it); a skipped, KV-covered; c P's encoder cache;
        # d loaded from the store (not sent), then its duplicate
        out(
            1,
            [1],
            "abcdd",
            ["kv_covered", "p_external", "p_local", "p_external", "duplicate"],
            ttft=5.0,
        ),
        # a sent again although covered (E's store: no forward); e skipped, P encodes it
        out(2, [0], "ae", ["kv_covered", "e_compute"], encoded=[1], ttft=40.0, raw=[1]),
    ]
    r = attribute("index", reqs, outs)
    b = r.buckets
    assert (r.requests, r.occurrences) == (3, 9)
    assert b[Bucket.FORWARD] == 3  # a, b (E) and e (P itself)
    assert b[Bucket.E_CACHE] == 2 and b[Bucket.KV] == 1 and b[Bucket.P_EMBEDDING] == 1
    assert b[Bucket.EXTERNAL] == 1 and b[Bucket.DEDUP] == 1
    assert r.external_loads == 1 and r.late_fallbacks == 1 and r.wrong_skips == 0
    assert r.redundant_forwards == 0
    assert r.ttft_encode_ms == [50.0, 40.0] and r.ttft_reuse_ms == [5.0]


def test_a_forward_p_did_not_need_is_redundant_and_a_failed_skip_is_wrong():
    reqs = [req(0, "a"), req(1, "b")]
    outs = [
        out(0, [0], "a", ["kv_covered"]),  # E computed what P's KV covers
        out(1, [], "b", ["e_compute"], status=500, raw=[0]),
    ]
    outs[1].records = []  # P never admitted it
    r = attribute("index", reqs, outs)
    assert r.redundant_forwards == 1 and r.buckets[Bucket.FORWARD] == 2
    assert r.wrong_skips == 1
    assert r.ttft_reuse_ms == [10.0]  # a redundant forward is not a needed encoding


def test_an_image_kv_covered_then_repeated_after_c_is_accounted_where_p_consumes_it():
    """The image at offset 0 is KV-covered, its repeat after C is not: E's forward serves the
    repeat, which accounts for it (the simulator's rule), so the forward is needed, not
    redundant (bench-cluster once let the first, covered, occurrence account for it)."""
    reqs = [req(0, "a", "a")]
    outs = [out(0, [1], "aa", ["kv_covered", "p_external"])]
    r = attribute("index", reqs, outs)
    assert r.buckets[Bucket.FORWARD] == 1 and r.buckets[Bucket.DEDUP] == 1
    assert r.redundant_forwards == 0 and r.ttft_encode_ms == [10.0]


def test_an_unknown_policy_is_named():
    # (an unknown class in a record never gets here: decode_answer refuses the records frame,
    # naming the field; tests/test_demand_query.py)
    outs = [out(0, [], "a", ["kv_covered"])]
    with pytest.raises(ValueError, match=r"^policy must be one of"):
        attribute("x", [req(0, "a")], outs)


def e_rec(idents, classes, encoded=()):
    """E's admission record of one sub-request: what its encoder ran (`encoded`), what its
    encoder cache (`p_local`) or the store (`p_external`) served."""
    return record(None, idents, classes, encoded)


def test_es_own_records_say_which_deliveries_were_forwards():
    """With a store that forgets, the same item sent twice can be two forwards: E's records
    say so (the first-time rule would call the second a store hit), and an item the store
    still had is no forward however new it is to the run."""
    reqs = [req(0, "a"), req(1, "a"), req(2, "b")]
    outs = [
        out(0, [0], "a", ["p_external"]),
        out(1, [0], "a", ["p_external"]),
        out(2, [0], "b", ["p_external"]),
    ]
    outs[0].e_records = [e_rec("a", ["e_compute"], [0])]
    outs[1].e_records = [e_rec("a", ["e_compute"], [0])]  # evicted meanwhile: encoded again
    outs[2].e_records = [e_rec("b", ["p_external"])]  # another proxy's forward put it there
    r = attribute("index", reqs, outs)
    assert r.buckets[Bucket.FORWARD] == 2 and r.buckets[Bucket.E_CACHE] == 1
    without = attribute(
        "index", reqs, [out(i, [0], x, ["p_external"]) for i, x in enumerate("aab")]
    )
    assert without.buckets[Bucket.FORWARD] == 2 and without.buckets[Bucket.E_CACHE] == 1  # a, b


def test_the_reference_proxy_is_attributed_from_es_records_alone():
    """vLLM's reference proxy makes no decisions here: what E got is what E's records say,
    and every request with images is an E request."""
    reqs = [req(0, "a", "b"), req(1, "a")]
    outs = [RequestOutcome(0, 200, 30.0, None, []), RequestOutcome(1, 200, 20.0, None, [])]
    outs[0].records = [record(0, "ab", ["p_external"] * 2)]
    outs[1].records = [record(1, "a", ["kv_covered"])]
    outs[0].e_records = [e_rec("ab", ["e_compute", "e_compute"], [0, 1])]
    outs[1].e_records = [e_rec("a", ["p_local"])]  # E's encoder cache
    r = attribute("reference", reqs, outs)
    assert r.e_requests == 2 and r.transfers == 2
    assert r.buckets[Bucket.FORWARD] == 2 and r.buckets[Bucket.E_CACHE] == 1


def test_observe_reads_ttft_items_e_and_render():
    from mmreuse.cluster.bench import observe
    from mmreuse.cluster.classes import Observed

    r = req(0, "a", "b", "c")
    o = out(0, [0, 2], "abc", ["p_external"] * 3, ttft=42.0)
    o.decision.trace.render_s = 0.0125
    assert observe(r, o) == Observed(42.0, 3, 2, 12.5)
    o.e_records = [e_rec("ab", ["e_compute"] * 2, [0, 1]), e_rec("c", ["p_local"])]
    assert observe(r, o).e_items == 3  # E's own account wins over the decision
    failed = out(0, [0], "abc", ["p_external"] * 3, status=-2, ttft=5.0)
    failed.decision.trace.render_s = 0.0
    assert observe(r, failed) == Observed(None, 3, 1, None)  # failed: no TTFT; not rendered
    assert observe(r, RequestOutcome(0, 200, 7.0)) == Observed(7.0, 3, 0, None)  # no decision


def test_every_profile_has_a_simulator_cost_model():
    pytest.importorskip("torch")  # mmreuse.sim's caches are residency ops
    from mmreuse.cluster.bench_run import SIM_COSTS
    from mmreuse.cluster.profile import PROFILES
    from mmreuse.sim.config import COSTS

    assert set(SIM_COSTS) == set(PROFILES) and set(SIM_COSTS.values()) <= set(COSTS)
