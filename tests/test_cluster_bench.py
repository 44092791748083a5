"""bench-cluster's accounting (mmreuse.cluster.bench.attribute): P's admission records joined
with the proxy's decisions into the simulator's buckets, by the simulator's rules; and the
command's argument checks (before any cluster starts). The live run is in
tests/live_proxy/test_bench_live.py."""

from __future__ import annotations

from types import SimpleNamespace as NS

import pytest

pytest.importorskip("torch")  # mmreuse.cluster.bench loads mmreuse.sim, which needs it

from mmreuse import cli
from mmreuse.cluster.bench import RequestOutcome, attribute
from mmreuse.sim.accounting import Bucket


def req(rid, *uuids):
    return NS(rid=rid, uuids=tuple(uuids))


def out(rid, e_indices, idents, classes, encoded=(), status=200, ttft=10.0, raw=()):
    decision = NS(e_indices=tuple(e_indices), raw_with_uuid=frozenset(raw))
    rec = NS(identifiers=list(idents), classes=list(classes), encoded=list(encoded))
    return RequestOutcome(rid, status, ttft, decision, [rec])


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
    r = attribute("x", reqs, outs)
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
    r = attribute("x", reqs, outs)
    assert r.redundant_forwards == 1 and r.buckets[Bucket.FORWARD] == 2
    assert r.wrong_skips == 1
    assert r.ttft_reuse_ms == [10.0]  # a redundant forward is not a needed encoding


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--rate", "0"], "--rate: must be a finite number of requests/s > 0"),
        (["--rate", "nan"], "--rate"),
        (["--image-tokens", "fixed:0"], "image_tokens"),
        (["--requests", "0"], "--requests"),
        (
            ["--encode-urls", "http://e:1", "--pd-urls", "http://p:1"],
            "--demand-endpoints: 0 for 1 --pd-urls",
        ),
        (
            ["--pd-urls", "http://p:1", "--demand-endpoints", "tcp://p:2"],
            "--encode-urls and --pd-urls",
        ),
    ],
)
def test_bench_cluster_refuses_bad_arguments_before_starting(capsys, argv, words):
    assert cli.main(["bench-cluster", *argv]) == 2
    assert words in capsys.readouterr().err
