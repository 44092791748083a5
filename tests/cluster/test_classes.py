"""TTFT per request class (mmreuse.cluster.classes): the classes at arrival, the send times, the
interleaved order of runs, per-run class statistics, the request-by-request pairing against a
baseline (per run and pooled over runs, with an interval for the median), and the summary over
runs."""

from __future__ import annotations

import pytest

from mmreuse.cluster.classes import (
    MIXED,
    NEW,
    REUSED,
    TEXT,
    Observed,
    class_runs,
    class_table,
    classify,
    interleave,
    median_interval,
    paired_median,
    pooled_paired,
    send_offsets,
    summarize,
)
from mmreuse.errors import InvalidArgument, InvalidArgumentType


def test_requests_are_classed_by_their_items_at_arrival():
    uuids = [["a"], ["a"], [], ["a", "b"], ["c", "c"], ["b", "c"], ["d", "a"], ["e"]]
    assert classify(uuids) == [NEW, REUSED, TEXT, MIXED, NEW, REUSED, MIXED, NEW]


def test_an_item_repeated_within_its_first_request_is_new():
    assert classify([["x", "x"], ["x"]]) == [NEW, REUSED]


@pytest.mark.parametrize(
    ("uuids", "field"),
    [("ab", "uuids"), ([["a"], "b"], r"uuids\[1\]"), ([["a", ""]], r"uuids\[0\]\[1\]")],
)
def test_classify_names_what_is_wrong(uuids, field):
    with pytest.raises(InvalidArgument, match=rf"^{field}"):
        classify(uuids)


def test_requests_leave_at_their_arrivals_less_the_first():
    assert send_offsets([2.5, 2.5, 3.0, 7.25]) == [0.0, 0.0, 0.5, 4.75]
    assert send_offsets([]) == []
    with pytest.raises(InvalidArgument, match=r"^arrivals_s\[2\] must be >= arrivals_s\[1\]"):
        send_offsets([0.0, 2.0, 1.0])
    with pytest.raises(InvalidArgument, match=r"^arrivals_s\[0\]"):
        send_offsets([float("nan")])


def test_runs_alternate_policies_round_by_round():
    order = interleave(["eager", "index", "demand", "reference"], 3)
    assert [p for _, p in order] == ["eager", "index", "demand", "reference"] * 3
    assert [r for r, _ in order] == [0] * 4 + [1] * 4 + [2] * 4
    assert interleave(["index"], 1) == [(0, "index")]


@pytest.mark.parametrize(
    ("policies", "repeats", "error", "field"),
    [
        (["eager"], 0, InvalidArgument, "repeats"),
        (["eager"], True, InvalidArgumentType, "repeats"),
        ([], 2, InvalidArgument, "policies"),
        (["eager", "eager"], 2, InvalidArgument, "policies"),
        (["eager", ""], 2, InvalidArgument, r"policies\[1\]"),
    ],
)
def test_interleave_refuses_bad_arguments(policies, repeats, error, field):
    with pytest.raises(error, match=rf"^{field}"):
        interleave(policies, repeats)


def obs(ttft, items=1, e=1, render=None):
    return Observed(ttft, items, e, render)


CLASSES = [NEW, REUSED, REUSED, TEXT, NEW]


def test_one_run_per_class():
    run = [obs(100.0, 2, 2, 5.0), obs(20.0, 2, 0, 4.0), obs(None, 2, 0), obs(9.0, 0, 0), obs(300.0)]
    got = class_runs(CLASSES, run)
    assert set(got) == {NEW, REUSED, TEXT}  # no mixed request: no entry
    new = got[NEW]
    assert (new.requests, new.answered, new.items, new.e_items) == (2, 2, 3, 3)
    assert new.ttft_median_ms == 200.0 and new.ttft_p90_ms == pytest.approx(280.0)
    assert new.render_median_ms == 5.0
    reused = got[REUSED]
    assert (reused.requests, reused.answered, reused.ttft_median_ms) == (2, 1, 20.0)
    assert got[TEXT].render_median_ms is None


def test_pairing_is_request_by_request_within_a_class():
    base = [obs(100.0), obs(50.0), obs(40.0), obs(10.0), obs(200.0)]
    run = [obs(110.0), obs(45.0), obs(None), obs(10.0), obs(260.0)]
    d = paired_median(CLASSES, run, base)
    # new: +10 and +60 -> 35; reused: only request 1 answered in both -> -5; text: 0
    assert d == {NEW: 35.0, REUSED: -5.0, TEXT: 0.0}
    # the medians of the runs' own TTFTs would say +35 too here, but not in general:
    # the pairing is what takes a slow request out of both sides
    assert paired_median([NEW, NEW], [obs(None), obs(5.0)], [obs(1.0), obs(None)]) == {NEW: None}


def test_class_runs_refuse_mismatched_runs():
    with pytest.raises(InvalidArgument, match=r"^run must hold one observation per request"):
        class_runs(CLASSES, [obs(1.0)])
    with pytest.raises(InvalidArgument, match=r"^classes\[0\] must be one of"):
        class_runs(["newish"], [obs(1.0)])
    with pytest.raises(InvalidArgumentType, match=r"^run\[0\]"):
        class_runs([NEW], [1.0])
    with pytest.raises(InvalidArgument, match=r"^base must hold"):
        paired_median([NEW], [obs(1.0)], [])


def test_summary_over_runs_pairs_run_r_with_the_baselines_run_r():
    classes = [NEW, REUSED]
    runs = {
        "eager": [[obs(100.0), obs(50.0)], [obs(200.0), obs(60.0)], [obs(150.0), obs(55.0)]],
        "index": [
            [obs(110.0, e=1, render=3.0), obs(30.0, e=0, render=2.0)],
            [obs(230.0, e=1, render=5.0), obs(35.0, e=0, render=2.0)],
            [obs(150.0, e=1, render=4.0), obs(40.0, e=0, render=2.0)],
        ],
        "reference": [[obs(90.0), obs(55.0)], [obs(210.0), obs(65.0)], [obs(160.0), obs(50.0)]],
    }
    s = summarize(classes, runs)
    new = s["index"][NEW]
    assert new["requests"] == 1 and new["runs"] == 3 and new["failed"] == 0
    assert new["ttft_median_ms"] == {"median": 150.0, "min": 110.0, "max": 230.0}
    # paired: run by run, +10, +30, 0 against eager; +20, +20, -10 against the reference
    assert new["vs_eager_ms"] == {"median": 10.0, "min": 0.0, "max": 30.0}
    assert new["vs_reference_ms"] == {"median": 20.0, "min": -10.0, "max": 20.0}
    assert new["e_items"] == 1.0 and new["render_median_ms"] == 4.0
    reused = s["index"][REUSED]
    assert reused["vs_eager_ms"] == {"median": -20.0, "min": -25.0, "max": -15.0}
    assert reused["e_items"] == 0.0
    # a baseline is not paired with itself; eager against the reference is
    assert s["eager"][NEW]["vs_eager_ms"] is None
    assert s["eager"][NEW]["vs_reference_ms"] == {"median": -10.0, "min": -10.0, "max": 10.0}
    assert s["reference"][NEW]["vs_reference_ms"] is None
    assert s["eager"][NEW]["render_median_ms"] is None
    # pooled over the runs: +10, +30, 0 -> +10 (3 pairs: no 95 % interval exists)
    assert new["vs_eager_pooled_ms"] == {
        "median": 10.0,
        "ci_low": None,
        "ci_high": None,
        "pairs": 3,
    }
    assert s["eager"][NEW]["vs_eager_pooled_ms"] is None
    table = class_table(s)
    assert table.splitlines()[2].startswith("new     eager")
    assert "+10.0 [+0.0, +30.0]" in table
    assert "+10.0 n=3" in table


def test_summary_without_baselines_reports_no_pairing():
    s = summarize([NEW], {"index": [[obs(5.0)]], "demand": [[obs(6.0)]]})
    assert s["index"][NEW]["vs_eager_ms"] is None and s["index"][NEW]["vs_reference_ms"] is None
    assert s["demand"][NEW]["failed"] == 0
    with pytest.raises(InvalidArgumentType, match=r"^runs"):
        summarize([NEW], [[obs(5.0)]])


def test_median_interval_is_binomial_order_statistics():
    xs = list(range(1, 21))  # n = 20: P(Bin(20, 1/2) <= 5) = 0.0207 <= 0.025 < P(<= 6) = 0.0577
    assert median_interval(xs) == (6.0, 15.0)
    assert median_interval(list(reversed(xs))) == (6.0, 15.0)  # order does not matter
    # n = 6: only min and max qualify (P(Bin(6, 1/2) = 0) = 1/64); n = 5 has no 95 % interval
    assert median_interval([3, 1, 2, 6, 5, 4]) == (1.0, 6.0)
    assert median_interval([1, 2, 3, 4, 5]) is None
    assert median_interval([1, 2, 3, 4, 5], confidence=0.9) == (1.0, 5.0)
    assert median_interval([]) is None


@pytest.mark.parametrize(
    ("values", "confidence", "field"),
    [
        ("12", 0.95, "values"),
        ([1.0, float("nan")], 0.95, r"values\[1\]"),
        ([1.0], 1.0, "confidence"),
        ([1.0], -0.1, "confidence"),
        ([True], 0.95, r"values\[0\]"),
    ],
)
def test_median_interval_names_what_is_wrong(values, confidence, field):
    with pytest.raises(InvalidArgument, match=rf"^{field}"):
        median_interval(values, confidence)


def test_pooled_pairs_come_from_every_run():
    classes = [NEW, NEW, REUSED]
    base = [[obs(100.0), obs(100.0), obs(10.0)]] * 4
    runs = [
        [obs(101.0), obs(102.0), obs(5.0)],
        [obs(103.0), obs(104.0), obs(None)],
        [obs(105.0), obs(106.0), obs(6.0)],
        [obs(107.0), obs(108.0), obs(7.0)],
    ]
    p = pooled_paired(classes, runs, base)
    # new: +1..+8, n = 8: P(Bin(8, 1/2) = 0) = 1/256 <= 0.025 < P(<= 1) = 9/256
    assert p[NEW] == {"median": 4.5, "ci_low": 1.0, "ci_high": 8.0, "pairs": 8}
    assert p[REUSED] == {"median": -4.0, "ci_low": None, "ci_high": None, "pairs": 3}
    assert pooled_paired([NEW], [[obs(None)]], [[obs(1.0)]]) == {NEW: None}
    with pytest.raises(InvalidArgument, match=r"^runs\[1\] must hold"):
        pooled_paired(classes, [runs[0], runs[1][:2]], base)
