"""mmreuse.proxy.eside: the E side chosen once from the configuration, answering per
identifier (E's events, untenanted; or this process's sends, per tenant; or nothing)."""

from __future__ import annotations

import pytest

from mmreuse.availability import EmbeddingAvailability
from mmreuse.errors import InvalidArgument
from mmreuse.proxy.config import parse_args
from mmreuse.proxy.eside import SENT_LOCATION, ESide
from mmreuse.proxy.metrics import ProxyMetrics

BASE = ["--encode-servers-urls", "http://e0,http://e1", "--decode-servers-urls", "http://pd"]
EVENTS = ["--e-cache-events-endpoints", "tcp://127.0.0.1:1,tcp://127.0.0.1:2"]


def side(policy: str, *extra: str) -> tuple[ESide, EmbeddingAvailability]:
    config = parse_args([*BASE, "--policy", policy, *extra], env={})
    avail = EmbeddingAvailability()
    return ESide(config, avail, ProxyMetrics()), avail


def test_eager_plans_nothing_on_the_e_side():
    e, _ = side("eager")
    assert (e.kind, e.health(), e.views) == ("none", None, [])
    e.sent(["a"], None)
    assert e.cached(["a"]) == frozenset()


def test_sent_is_per_tenant_and_per_process():
    e, avail = side("index")
    assert (e.kind, e.health(), e.views) == ("sent", "per-replica", [])
    e.sent(["a", "b"], "t1")
    assert e.cached(["a", "b", "c"], "t1") == {"a", "b"}
    assert e.cached(["a"], "t2") == frozenset()  # another tenant: nothing at E for it
    assert e.cached(["a"]) == frozenset()
    assert avail.e_holds([SENT_LOCATION], ["a"], cache_salt="t1") == {"a"}


def test_events_answer_for_every_tenant_and_ignore_sends():
    e, avail = side("index", *EVENTS)
    assert (e.kind, e.health(), [v.name for v in e.views]) == ("events", "events", ["E0", "E1"])
    e.sent(["a"], "t1")  # E's own events say what it holds: a send records nothing
    assert e.cached(["a"], "t1") == frozenset()
    avail.update_e("E1", added=["b"])  # what E1's encoder-cache events tell
    assert e.cached(["a", "b"], "t1") == {"b"}
    assert e.cached(["b"]) == {"b"}


def test_e_holds_validates_its_input():
    avail = EmbeddingAvailability()
    with pytest.raises(InvalidArgument, match="identifiers"):
        avail.e_holds(["E0"], [None])  # type: ignore[list-item]
    with pytest.raises(InvalidArgument, match="e_instances"):
        avail.e_holds([3], ["a"])  # type: ignore[list-item]
