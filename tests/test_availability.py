"""EmbeddingAvailability: deltas, TTL staleness, LRU capacity, tenant isolation, metrics."""

import pytest
from prometheus_client import CollectorRegistry

from mmreuse import Availability, MMOccurrence, compute_demand
from mmreuse.availability import EmbeddingAvailability, Tenant
from mmreuse.errors import InvalidArgument, InvalidArgumentType
from mmreuse.metrics import Metrics


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


@pytest.fixture
def env():
    clock = Clock()
    metrics = Metrics(CollectorRegistry())
    return (
        EmbeddingAvailability(ttl_s=10, max_entries=3, timer=clock, metrics=metrics),
        clock,
        metrics,
    )


def value(metric, *labels):
    return metric.labels(*labels)._value.get()


def test_deltas_build_the_availability(env):
    av, _, metrics = env
    av.update_p("p0", added={"a": 16, "b": 8})
    av.update_p("p0", freeable=["b"])
    av.update_external(added=["c"])
    av.update_e("e0", added=["d"])
    got = av.availability_for("p0", "e0")
    assert got == Availability(
        p_local={"a": 16, "b": 8},
        p_local_freeable=frozenset({"b"}),
        p_external=frozenset({"c"}),
        e_cached=frozenset({"d"}),
    )
    av.update_p("p0", referenced=["b"], removed=["a"])
    av.update_external(removed=["c"])
    got = av.availability_for("p0", "e0")
    assert got.p_local == {"b": 8} and not got.p_local_freeable and not got.p_external
    assert av.availability_for("p1", "e1") == Availability()
    assert value(metrics.availability_entries, "p:p0") == 1


def test_several_es_are_what_any_of_them_holds(env):
    av, _, _ = env
    av.update_e("E0", added=["a", "b"])
    av.update_e("E1", added=["b", "c"])
    av.update_e("E1", removed=["b"])  # E0 still holds it
    assert av.availability_for("p0", ("E0", "E1")).e_cached == {"a", "b", "c"}
    assert av.availability_for("p0", ["E1"]).e_cached == {"c"}
    with pytest.raises(InvalidArgument, match=r"e_instance\[1\]"):
        av.availability_for("p0", ["E0", ""])


def test_a_requests_identifiers_are_looked_up_alone_as_the_whole_view_has_them(env):
    av, clock, _ = env
    av.update_p("p0", added={"a": 4, "b": 8})
    av.update_p("p0", freeable=["b"])
    av.update_e("e0", added=["c"])
    av.update_external(added=["d"])
    whole = av.availability_for("p0", "e0")
    for ids in (["a", "b", "c", "d"], ["b", "b", "x"], [], ["c"]):
        got = av.availability_for("p0", "e0", identifiers=ids)
        keep = set(ids)
        assert got.p_local == {k: v for k, v in whole.p_local.items() if k in keep}
        assert got.p_local_freeable == whole.p_local_freeable & keep
        assert got.p_external == whole.p_external & keep and got.e_cached == whole.e_cached & keep
    clock.t = 11  # expired entries are no answer either
    assert av.availability_for("p0", "e0", identifiers=["a", "c"]) == Availability()
    with pytest.raises(InvalidArgument, match=r"identifiers\[0\]"):
        av.availability_for("p0", identifiers=[""])


def test_a_lookup_is_not_an_update(env):
    # max_entries 3: the least recently *updated* goes first, however often it was read
    av, _, _ = env
    av.update_p("p0", added={"a": 4})
    av.update_p("p0", added={"b": 4})
    av.update_p("p0", added={"c": 4})
    assert av.availability_for("p0", identifiers=["a"]).p_local == {"a": 4}
    av.update_p("p0", added={"d": 4})
    assert set(av.availability_for("p0").p_local) == {"b", "c", "d"}


def test_entries_go_stale_after_the_ttl(env):
    av, clock, metrics = env
    av.update_p("p0", added={"a": 4})
    av.update_e("e0", added=["x"])
    clock.t = 5
    av.update_p("p0", added={"b": 4})  # refreshes only b
    clock.t = 11
    got = av.availability_for("p0", "e0")
    assert got.p_local == {"b": 4} and got.e_cached == frozenset()
    assert value(metrics.availability_expired, "p:p0") == 1
    assert value(metrics.availability_expired, "e:e0") == 1


def test_capacity_drops_the_least_recently_updated(env):
    av, _, metrics = env
    for ident in "abcd":
        av.update_e("e0", added=[ident])
    assert av.availability_for("p0", "e0").e_cached == frozenset("bcd")
    assert value(metrics.availability_evicted, "e:e0") == 1


def test_one_tenant_never_satisfies_another(env):
    av, _, _ = env
    av.update_p("p0", added={"img": 16}, cache_salt="tenant-a")
    av.update_external(added=["img"], lora_name="lora-a")
    av.update_e("e0", added=["img"], cache_salt="tenant-a")
    assert av.availability_for("p0", "e0", cache_salt="tenant-b") == Availability()
    assert av.availability_for("p0", "e0") == Availability()
    assert av.availability_for("p0", "e0", cache_salt="tenant-a").p_local == {"img": 16}
    assert av.availability_for("p0", "e0", lora_name="lora-a").p_external == {"img"}
    # compute_demand sees no reuse across tenants
    occ = [MMOccurrence("img", 0, 16)]
    other = compute_demand(occ, 32, 0, av.availability_for("p0", "e0", cache_salt="tenant-b"))
    assert other.e_demand == (("img", True),)


def test_forget_instance(env):
    av, _, _ = env
    av.update_p("p0", added={"a": 1}, cache_salt="s")
    av.update_p("p0", added={"b": 1})
    av.forget_instance("p", "p0")
    assert av.availability_for("p0").p_local == {}
    assert av.availability_for("p0", cache_salt="s").p_local == {}


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda av: av.update_p("", added={"a": 1}), "instance"),
        (lambda av: av.update_p("p0", added={"a": 0}), r"added\['a'\]"),
        (lambda av: av.update_p("p0", added=["a"]), "mapping"),
        (lambda av: av.update_p("p0", removed="abc"), "removed"),
        (lambda av: av.update_e("e0", added=[1]), "added"),
        (lambda av: av.update_external(store="", added=["a"]), "store"),
        (lambda av: av.update_p("p0", added={"a": 1}, cache_salt=3), "cache_salt"),
        (lambda av: av.availability_for(""), "p_instance"),
        (lambda av: av.forget_instance("x", "p0"), "kind"),
    ],
)
def test_bad_input(env, call, match):
    with pytest.raises(ValueError, match=match):
        call(env[0])


@pytest.mark.parametrize(
    "kwargs,match,cls",
    [
        ({"ttl_s": 0}, "ttl_s", InvalidArgument),
        ({"ttl_s": -1.5}, "ttl_s", InvalidArgument),
        ({"ttl_s": float("nan")}, "ttl_s", InvalidArgument),  # every entry would vanish at once
        ({"ttl_s": float("inf")}, "ttl_s", InvalidArgument),
        ({"ttl_s": True}, "ttl_s", InvalidArgumentType),
        ({"ttl_s": "60"}, "ttl_s", InvalidArgumentType),
        ({"max_entries": 0}, "max_entries", InvalidArgument),
        ({"max_entries": 2.0}, "max_entries", InvalidArgumentType),
        ({"max_entries": True}, "max_entries", InvalidArgumentType),
        ({"timer": 5}, "timer", InvalidArgumentType),
        ({"timer": "monotonic"}, "timer", InvalidArgumentType),
    ],
)
def test_bad_construction(kwargs, match, cls):
    with pytest.raises(cls, match=match):
        EmbeddingAvailability(**kwargs)


def test_tenant_is_a_frozen_value():
    assert Tenant("s", None) == Tenant("s")
    with pytest.raises(ValueError, match="lora_name"):
        Tenant(None, 5)


def test_p_holds_answers_the_p_local_keys_of_availability_for():
    avail = EmbeddingAvailability()
    avail.update_p("P0", added={"a": 4, "b": 8})
    avail.update_p("P0", added={"c": 2}, cache_salt="t")
    ids = ["a", "c", "z"]
    assert avail.p_holds("P0", ids) == set(avail.availability_for("P0", identifiers=ids).p_local)
    assert avail.p_holds("P0", ids) == {"a"}
    assert avail.p_holds("P0", ids, cache_salt="t") == {"c"}
    assert avail.p_holds("P1", ids) == frozenset()
    with pytest.raises(InvalidArgument, match="identifiers"):
        avail.p_holds("P0", [1])  # type: ignore[list-item]
