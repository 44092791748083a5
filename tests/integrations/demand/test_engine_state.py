"""mmreuse.integrations.demand.engine_state (the adapter the facade `integrations.vllm` exports):
on duck-typed stand-ins here, and on real vLLM objects in the oracle venv."""

import json
import types

import pytest

pytest.importorskip("torch")
import torch

from mmreuse import ItemClass, MMOccurrence
from mmreuse.errors import InvalidArgument, InvalidArgumentType
from mmreuse.integrations.demand.engine_state import (
    availability_from_engine,
    demand_for_request,
    occurrences_from_request,
)
from tests.support.oracle import oracle_run
from tests.support.paths import ORACLE_TOOLS


def feature(ident, offset, length, mask=None):
    pos = types.SimpleNamespace(
        offset=offset, length=length, is_embed=None if mask is None else torch.tensor(mask)
    )
    return types.SimpleNamespace(identifier=ident, modality="image", mm_position=pos)


def test_occurrences_from_request():
    req = types.SimpleNamespace(
        mm_features=[feature("A", 2, 3, [True, False, True])], num_tokens=10
    )
    assert occurrences_from_request(req) == [MMOccurrence("A", 2, 3, (True, False, True))]
    assert occurrences_from_request(types.SimpleNamespace(mm_features=None)) == []
    with pytest.raises(ValueError, match="mm_features"):
        occurrences_from_request(object())


def test_availability_from_engine_stand_ins():
    mgr = types.SimpleNamespace(
        cached={"A": {"r1"}, "B": set()}, num_embeds_by_hash={"A": 4, "B": 9}
    )
    conn = types.SimpleNamespace(has_cache_item=lambda i: i.startswith("x"))
    a = availability_from_engine(mgr, conn, ["x1", "y"], e_cached=["z"])
    assert a.p_local == {"A": 4, "B": 9} and a.p_local_freeable == {"B"}
    assert a.p_external == {"x1"} and a.e_cached == {"z"}
    with pytest.raises(ValueError, match="has_cache_item"):
        availability_from_engine(None, object(), ["x"])


def test_demand_for_request_stand_ins():
    req = types.SimpleNamespace(
        mm_features=[feature("A", 0, 16), feature("B", 20, 8)], num_tokens=40
    )
    mgr = types.SimpleNamespace(
        cached={"B": {"r"}}, num_embeds_by_hash={"B": 8}, num_free_slots=8, freeable={}
    )
    res = demand_for_request(req, 16, encoder_cache_manager=mgr)
    assert [d.klass for d in res.decisions] == [
        ItemClass.KV_COVERED,
        ItemClass.P_LOCAL,
    ] and res.skip_e
    with pytest.raises(InvalidArgumentType, match="num_free_slots and the ordered mapping"):
        demand_for_request(req, 16, encoder_cache_manager=types.SimpleNamespace(
            cached={}, num_embeds_by_hash={}))  # fmt: skip


def test_demand_for_request_applies_rule_s():
    """C (freeable, oldest) is what X's allocation evicts: the request's later C needs E."""
    req = types.SimpleNamespace(
        mm_features=[feature("X", 0, 8), feature("C", 10, 8)], num_tokens=30
    )
    mgr = types.SimpleNamespace(
        cached={"C": set(), "D": set()},
        num_embeds_by_hash={"C": 8, "D": 8},
        num_free_slots=0,
        freeable={"C": 8, "D": 8},  # oldest first
    )
    res = demand_for_request(req, 0, encoder_cache_manager=mgr)
    assert [d.klass for d in res.decisions] == [ItemClass.E_COMPUTE, ItemClass.E_COMPUTE]
    # X evicts C; C, encoded again, then evicts D (space this step counts what it schedules)
    assert res.self_evicted == ("C", "D") and not res.encoder_cache_short
    mgr.freeable = {"D": 8, "C": 8}  # D is the oldest: X evicts it, C is reused
    res = demand_for_request(req, 0, encoder_cache_manager=mgr)
    assert [d.klass for d in res.decisions] == [ItemClass.E_COMPUTE, ItemClass.P_LOCAL]
    assert res.self_evicted == ("D",)  # evicted, but this request does not need it


@pytest.mark.oracle
def test_adapter_on_real_vllm_objects(oracle_python):
    py = oracle_python
    out = oracle_run(py, str(ORACLE_TOOLS / "vllm_adapter_check.py"))
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["classes"] == ["KV_COVERED", "P_LOCAL", "P_EXTERNAL", "P_LOCAL", "E_COMPUTE"]
    assert got["num_embeds"] == [16, 10, 10, 6, 5]
    assert got["evictable"] == [False, False, False, True, False]
    assert got["e_demand"] == [["E", True]] and got["p_loads"] == ["C"]
    assert got["p_local_reuse"] == ["B", "F"]
    assert got["p_local"] == {"B": 10, "F": 6} and got["freeable"] == ["F"]
    assert got["p_external"] == ["C"]


# ---- hostile input (issue #11) -----------------------------------------------------------


@pytest.mark.parametrize(
    "manager",
    [
        {},
        "encoder-cache",
        object(),
        types.SimpleNamespace(cached={}),  # no num_embeds_by_hash
        types.SimpleNamespace(cached=["A"], num_embeds_by_hash={"A": 1}),
    ],
    ids=["dict", "str", "object", "no-counts", "cached-list"],
)
def test_a_wrong_encoder_cache_manager_is_not_read_as_empty(manager):
    with pytest.raises(InvalidArgumentType, match=r"^encoder_cache_manager must be vLLM's"):
        availability_from_engine(manager)
    req = types.SimpleNamespace(mm_features=[feature("A", 0, 4)], num_tokens=8)
    with pytest.raises(InvalidArgumentType, match=r"^encoder_cache_manager"):
        demand_for_request(req, 0, encoder_cache_manager=manager)


def test_encoder_cache_contents_are_checked():
    for counts, cls, match in (
        ({}, InvalidArgument, r"num_embeds_by_hash\['A'\] is missing"),
        ({"A": "3"}, InvalidArgumentType, r"num_embeds_by_hash\['A'\] must be an int, got str"),
        ({"A": 0}, InvalidArgument, r"num_embeds_by_hash\['A'\] must be >= 1, got 0"),
    ):
        mgr = types.SimpleNamespace(cached={"A": set()}, num_embeds_by_hash=counts)
        with pytest.raises(cls, match="^encoder_cache_manager." + match):
            availability_from_engine(mgr)


def test_encoder_decoder_cache_manager_keeps_no_reusable_cache():
    class EncoderCacheManager:
        pass

    class EncoderDecoderCacheManager(EncoderCacheManager):  # vLLM's: no `cached` at all
        def __init__(self):
            self.cache_size = 8

    assert availability_from_engine(EncoderDecoderCacheManager()).p_local == {}


@pytest.mark.parametrize("answer", [1, 0, "yes", None, [True]])
def test_a_non_bool_has_cache_item_is_not_trusted(answer):
    conn = types.SimpleNamespace(has_cache_item=lambda ident: answer)
    with pytest.raises(
        InvalidArgumentType, match=r"^ec_connector.has_cache_item\('img-1'\) must be a bool, got "
    ):
        availability_from_engine(None, conn, ["img-1"])


def test_identifiers_are_strs():
    conn = types.SimpleNamespace(has_cache_item=lambda ident: True)
    with pytest.raises(InvalidArgumentType, match=r"^identifiers\[1\] must be a str, got int 7"):
        availability_from_engine(None, conn, ["a", 7])
    with pytest.raises(InvalidArgumentType, match=r"^identifiers must be an iterable"):
        availability_from_engine(None, conn, 7)
    assert availability_from_engine(None, conn, (i for i in ["a"])).p_external == {"a"}
