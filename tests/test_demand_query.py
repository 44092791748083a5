"""The demand-query wire: round trips, and refusal of malformed queries and answers (a hostile
client costs P one DemandError; a hostile P costs the proxy its plan)."""

from __future__ import annotations

import contextlib
import re

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from mmreuse.demand_query import (
    DemandAnswer,
    DemandError,
    DemandQuery,
    DemandStats,
    MalformedAnswer,
    MalformedQuery,
    QueryItem,
    StatsQuery,
    decode_answer,
    decode_query,
    encode,
    occurrences_of,
)


def q(**kw):
    base = dict(id="q1", token_ids=[1, 2, 3, 9, 9, 9, 4],
                items=[QueryItem("img-a", 3, 3)], cache_salt=None)  # fmt: skip
    base.update(kw)
    return DemandQuery(**base)


def ans(**kw):
    base = dict(id="q1", num_computed_tokens=0, classes=["e_compute"], dedup_of=[None],
                e_demand=[("img-a", True)])  # fmt: skip
    base.update(kw)
    return DemandAnswer(**base)


def test_round_trips():
    query = q(e_cached=["img-b"], lora_name="l", remember=False)
    assert decode_query(encode(query)) == query
    assert decode_query(encode(StatsQuery("s", check_index=True))) == StatsQuery("s", True)
    a = ans(proof_blocks=[3], proof_generations=[1], trust_kv_blocks=7)
    assert decode_answer(encode(a), query) == a
    for other in (DemandError("q1", "bad"), DemandStats("s", answers=3, changed={"eviction": 1})):
        assert decode_answer(encode(other)) == other
    occ = occurrences_of(query)[0]
    assert (occ.identifier, occ.offset, occ.length, occ.num_embeds) == ("img-a", 3, 3, 3)


@pytest.mark.parametrize(
    "query, field",
    [
        (dict(token_ids=[]), "token_ids is empty"),
        (dict(items=[QueryItem("a", 5, 3)]), "items[0] = [5, 8) is past the 7 token ids"),
        (dict(items=[QueryItem("a", 4, 1), QueryItem("b", 3, 1)]), "items[1].offset 3"),
        (dict(items=[QueryItem("a", 3, 3, is_embed=[True])]), "items[0]"),
    ],
)
def test_malformed_queries_name_the_field(query, field):
    with pytest.raises(MalformedQuery, match=re.escape(field)):
        decode_query(encode(q(**query)))


@pytest.mark.parametrize(
    "payload",
    [
        b"",
        b"\xc1",
        msgspec.msgpack.encode({"type": "DemandQuery", "id": "x"}),
        msgspec.msgpack.encode({"type": "DemandQuery", "id": "x", "token_ids": [-1]}),
        msgspec.msgpack.encode({"type": "DemandQuery", "id": "x" * 200, "token_ids": [1]}),
        msgspec.msgpack.encode({"type": "Nope", "id": "x"}),
        msgspec.msgpack.encode([[[[[]]]]] * 3),
        "not bytes",
    ],
)
def test_garbage_is_a_malformed_query(payload):
    with pytest.raises(MalformedQuery):
        decode_query(payload)


@pytest.mark.parametrize(
    "answer, why",
    [
        (ans(id="q2"), "answer id"),
        (ans(classes=[]), "classes"),
        (ans(classes=["bogus"]), "classes[0]"),
        (ans(dedup_of=[0]), "dedup_of[0]"),
        (ans(num_computed_tokens=7), "num_computed_tokens 7"),
        (ans(e_demand=[("img-z", True)]), "e_demand names"),
        (ans(p_local_reuse=["img-z"]), "p_local_reuse names"),
        (ans(proof_blocks=[1]), "proof_blocks"),
    ],
)
def test_malformed_answers_are_refused(answer, why):
    with pytest.raises(MalformedAnswer, match=re.escape(why)):
        decode_answer(encode(answer), q())


@given(st.binary(max_size=64))
def test_no_frame_escapes_as_another_exception(blob):
    for decode in (decode_query, lambda b: decode_answer(b, q())):
        with contextlib.suppress(MalformedQuery, MalformedAnswer):
            decode(blob)
