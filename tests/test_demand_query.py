"""The demand-query wire: round trips, and refusal of malformed queries and answers (a hostile
client costs P one DemandError; a hostile P costs the proxy its plan)."""

from __future__ import annotations

import contextlib
import re

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from mmreuse.demand import ItemClass
from mmreuse.demand_query import (
    MAX_ID_CHARS,
    MAX_IDENT_CHARS,
    MAX_ITEMS,
    MAX_MODALITY_CHARS,
    MAX_OVERLAP,
    MAX_SALT_CHARS,
    AdmissionRecord,
    AdmissionRecords,
    AnswerItem,
    DemandAnswer,
    DemandError,
    DemandQuery,
    DemandStats,
    MalformedAnswer,
    MalformedQuery,
    QueryItem,
    RecordItem,
    StatsQuery,
    decode_answer,
    decode_query,
    encode,
    max_query_bytes,
    occurrences_of,
    query_for,
)
from mmreuse.errors import InvalidArgument


def q(**kw):
    base = dict(id="q1", token_ids=[1, 2, 3, 9, 9, 9, 4],
                items=[QueryItem("img-a", 3, 3)], cache_salt=None)  # fmt: skip
    base.update(kw)
    return DemandQuery(**base)


def ans(**kw):
    base = dict(id="q1", num_computed_tokens=0, items=[AnswerItem(ItemClass.E_COMPUTE)],
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
        (ans(items=[]), "answer has 0 items for the query's 1"),
        (ans(items=[AnswerItem("bogus")]), "Invalid enum value 'bogus' - at `$.items[0][0]`"),
        (ans(items=[AnswerItem("P_LOCAL")]), "Invalid enum value 'P_LOCAL' - at `$.items[0][0]`"),
        (ans(items=[AnswerItem(3)]), "Expected `str`, got `int` - at `$.items[0][0]`"),
        (ans(items=[AnswerItem(ItemClass.UNCLASSIFIED)]), "items[0].item_class = 'unclassified'"),
        (ans(items=[AnswerItem(ItemClass.DUPLICATE, 0)]), "items[0].dedup_of = 0"),
        (ans(items=[AnswerItem(ItemClass.DUPLICATE, -1)]), "Expected `int` >= 0"),
        (ans(num_computed_tokens=7), "num_computed_tokens 7"),
        (ans(e_demand=[("img-z", True)]), "e_demand names"),
        (ans(p_local_reuse=["img-z"]), "p_local_reuse names"),
        (ans(proof_blocks=[1]), "proof_blocks"),
    ],
)
def test_malformed_answers_are_refused(answer, why):
    with pytest.raises(MalformedAnswer, match=re.escape(why)):
        decode_answer(encode(answer), q())


def _records(*items, encoded=()):
    rec = AdmissionRecord(0, "r", 8, 0, [RecordItem(i, c) for i, c in items], list(encoded))
    return AdmissionRecords("x", [rec], 1)


def test_records_carry_one_item_per_occurrence_and_refuse_what_a_peer_may_not_send():
    recs = _records(("a", ItemClass.E_COMPUTE), ("a", ItemClass.DUPLICATE), encoded=[0])
    assert decode_answer(encode(recs)) == recs
    for bad, why in [
        (
            _records(("a", ItemClass.UNCLASSIFIED)),
            "records[0].items[0].item_class = 'unclassified'",
        ),
        (_records(("a", "bogus")), "Invalid enum value 'bogus' - at `$.records[0].items[0][1]`"),
        (_records(("a", ItemClass.E_COMPUTE), encoded=[1]), "records[0].encoded = [1] names items"),
    ]:
        with pytest.raises(MalformedAnswer, match=re.escape(why)):
            decode_answer(encode(bad))


@given(st.binary(max_size=64))
def test_no_frame_escapes_as_another_exception(blob):
    for decode in (decode_query, lambda b: decode_answer(b, q())):
        with contextlib.suppress(MalformedQuery, MalformedAnswer):
            decode(blob)


# ---- the wire's limits: what one query may cost P is bounded by P's max_model_len ------------


def _raw(**kw):
    """A query frame as a raw map (any field, any value)."""
    base = {"type": "DemandQuery", "id": "q1", "token_ids": [1, 2, 3, 9, 9, 9, 4],
            "items": [{"identifier": "img-a", "offset": 3, "length": 3}]}  # fmt: skip
    base.update(kw)
    return msgspec.msgpack.encode(base)


def _items(**kw):
    return [{"identifier": "img-a", "offset": 3, "length": 3, **kw}]


@pytest.mark.parametrize(
    "field, at_limit, over_limit",
    [
        ("$.items[0].identifier", _items(identifier="i" * MAX_IDENT_CHARS),
         _items(identifier="i" * (MAX_IDENT_CHARS + 1))),
        ("$.items[0].modality", _items(modality="m" * MAX_MODALITY_CHARS),
         _items(modality="m" * (MAX_MODALITY_CHARS + 1))),
    ],
)  # fmt: skip
def test_item_strings_are_bounded(field, at_limit, over_limit):
    decode_query(_raw(items=at_limit))
    with pytest.raises(MalformedQuery, match=re.escape(field)):
        decode_query(_raw(items=over_limit))


@pytest.mark.parametrize(
    "field, limit, make",
    [
        ("cache_salt", MAX_SALT_CHARS, lambda k: "s" * k),
        ("lora_name", MAX_IDENT_CHARS, lambda k: "l" * k),
        ("e_cached", MAX_ITEMS, lambda k: [f"e{i}" for i in range(k)]),
        ("e_cached", MAX_IDENT_CHARS, lambda k: ["e" * k]),
        (
            "items",
            MAX_ITEMS,
            lambda k: [{"identifier": f"i{i}", "offset": 0, "length": 1} for i in range(k)],
        ),
        ("id", MAX_ID_CHARS, lambda k: "i" * k),
    ],
)
def test_query_fields_are_bounded(field, limit, make):
    tokens = [5] * (MAX_ITEMS + 1)
    decode_query(_raw(token_ids=tokens, **{field: make(limit)}))
    with pytest.raises(MalformedQuery, match=re.escape(f"$.{field}")):
        decode_query(_raw(token_ids=tokens, **{field: make(limit + 1)}))


def test_e_cached_entries_are_identifiers():
    with pytest.raises(MalformedQuery, match=re.escape("$.e_cached[0]")):
        decode_query(_raw(e_cached=[""]))


def test_a_mask_of_the_wrong_length_is_refused_before_its_flags_are_read():
    # a million flags for one placeholder: refused by its length (flags not even bools here)
    with pytest.raises(MalformedQuery, match=re.escape("items[0]: is_embed has 1000000 entries")):
        occurrences_of(q(items=[QueryItem("a", 3, 1, is_embed=[0] * 1_000_000)]))  # type: ignore[list-item]


def test_placeholders_in_all_are_bounded_by_the_token_ids():
    """Two items over one range (use_audio_in_video) are vLLM's; a third over it is not."""
    n = 8
    tokens = list(range(n))
    full = [True] * n
    two = [QueryItem("audio", 0, n, is_embed=full), QueryItem("video", 0, n, is_embed=full)]
    assert len(occurrences_of(DemandQuery("q", tokens, two))) == 2
    three = [*two, QueryItem("more", 0, 1)]
    why = f"items cover {MAX_OVERLAP * n + 1} placeholder positions in all"
    with pytest.raises(MalformedQuery, match=re.escape(why)):
        occurrences_of(DemandQuery("q", tokens, three))
    with pytest.raises(MalformedQuery, match=re.escape(why)):
        decode_query(encode(DemandQuery("q", tokens, three)))


def test_the_largest_well_formed_query_fits_max_query_bytes():
    """Every field at its limit, every token id at its largest: the frame P's ROUTER accepts."""
    n = MAX_ITEMS  # MAX_ITEMS items of MAX_OVERLAP placeholders each, all with masks
    ident = lambda i: f"{i:08d}".ljust(MAX_IDENT_CHARS, "x")  # noqa: E731
    items = [
        QueryItem(ident(i), min(i, n - MAX_OVERLAP), MAX_OVERLAP, "m" * MAX_MODALITY_CHARS,
                  [True] * MAX_OVERLAP)
        for i in range(MAX_ITEMS)
    ]  # fmt: skip
    query = DemandQuery(
        id="i" * MAX_ID_CHARS,
        token_ids=[2**63 - 1] * n,
        items=items,
        cache_salt="s" * MAX_SALT_CHARS,
        lora_name="l" * MAX_IDENT_CHARS,
        e_cached=[ident(i) for i in range(MAX_ITEMS)],
        remember=False,
    )
    frame = encode(query)
    assert decode_query(frame) == query
    assert len(frame) <= max_query_bytes(n)
    assert max_query_bytes(n + 1) > max_query_bytes(n)


@pytest.mark.parametrize("bad", [0, -1, 1.5, "2048", None, True])
def test_max_query_bytes_checks_max_model_len(bad):
    with pytest.raises(InvalidArgument, match="max_model_len"):
        max_query_bytes(bad)


def test_query_for_a_rendered_request():
    from mmreuse.identity import RequestIdentity
    from mmreuse.occurrence import MMOccurrence
    from mmreuse.render import RenderedPrompt

    rendered = RenderedPrompt(
        (1, 2, 9, 9, 9, 4),
        (MMOccurrence("img-a", 2, 3, (True, False, True), "video"),),
        RequestIdentity(cache_salt="salt", lora_name="sql-lora", lora_path="/a"),
    )
    q = query_for(rendered, "q7", e_cached=["img-a"], remember=False)
    assert (q.id, q.token_ids, q.cache_salt, q.e_cached, q.remember) == ("q7", [1, 2, 9, 9, 9, 4], "salt", ["img-a"], False)  # fmt: skip
    assert q.lora_name == "sql-lora"  # P resolves the adapter's path from those it served
    assert q.items == [QueryItem("img-a", 2, 3, "video", [True, False, True])]
    assert decode_query(encode(q)) == q  # a well-formed query


# ---- KVSnapshot's identifiers ------------------------------------------------------------------


def _kv(**kw):
    from mmreuse.demand_query import KVSnapshot

    base = dict(id="s", stamp=3, incarnation="inc", total=3, offset=0, blocks=10,
                block_ids=[7, 8, 9], counts=[1, 2, 1])  # fmt: skip
    base.update(kw)
    return KVSnapshot(**base)


def test_a_snapshot_without_identifiers_is_the_old_format():
    """An older P's chunk (no identifier fields) decodes as not followed; a new P's chunk that
    follows none sends the old bytes plus one flag."""
    from mmreuse.demand_query import KVSnapshot

    class OldKVSnapshot(msgspec.Struct, tag="KVSnapshot", omit_defaults=True):
        id: str
        stamp: int
        incarnation: str
        total: int
        offset: int
        blocks: int
        block_ids: list[int] = []
        counts: list[int] = []

    old = msgspec.msgpack.encode(OldKVSnapshot("s", 3, "inc", 3, 0, 10, [7, 8, 9], [1, 2, 1]))
    got = decode_answer(old)
    assert isinstance(got, KVSnapshot) and not got.identifiers_followed
    assert got.identifiers == [] and got.carried == [] and got.block_ids == [7, 8, 9]
    assert encode(_kv()) == old  # not followed: the old format, byte for byte


def test_a_snapshot_with_identifiers_round_trips():
    chunk = _kv(identifiers_followed=True, identifiers=["img-a", "img-b"],
                carried=[(0, [0]), (2, [1, 0])])  # fmt: skip
    got = decode_answer(encode(chunk))
    assert got == chunk and got.carried == [(0, [0]), (2, [1, 0])]
    followed_none = decode_answer(encode(_kv(identifiers_followed=True)))
    assert followed_none.identifiers_followed and followed_none.carried == []


BAD_IDENTIFIERS = [
    ("carried, not followed", dict(identifiers=["a"], carried=[(0, [0])]), "did not follow"),
    ("a table, not followed", dict(identifiers=["a"]), "did not follow"),
    ("block past the chunk", dict(carried=[(3, [0])]), "below 3"),
    ("blocks out of order", dict(carried=[(1, [0]), (0, [0])]), "not after 1"),
    ("a block twice", dict(carried=[(1, [0]), (1, [0])]), "not after 1"),
    ("index past the table", dict(carried=[(0, [1])]), "below 1"),
    ("an index twice", dict(identifiers=["a", "b"], carried=[(0, [1, 1])]), "distinct"),
    ("a table repeating", dict(identifiers=["a", "a"]), "repeat"),
    ("no identifiers for a block", dict(carried=[(0, [])]), "length"),
    ("a negative index", dict(carried=[(0, [-1])]), ">= 0"),
    ("an empty identifier", dict(identifiers=[""]), "length"),
    ("an identifier too long", dict(identifiers=["x" * (MAX_IDENT_CHARS + 1)]), "length"),
]


@pytest.mark.parametrize(
    "name, fields, match", BAD_IDENTIFIERS, ids=[b[0] for b in BAD_IDENTIFIERS]
)
def test_a_snapshot_with_malformed_identifiers_is_refused(name, fields, match):
    fields = {"identifiers_followed": "not followed" not in name, "identifiers": ["a"], **fields}
    payload = msgspec.msgpack.encode(_kv(**fields))  # the Struct does not check on build
    with pytest.raises(MalformedAnswer, match=match):
        decode_answer(payload)


def test_a_snapshot_bounds_its_identifiers(monkeypatch):
    from mmreuse import demand_query as dq

    too_many = _kv(identifiers_followed=True, identifiers=[f"i{n}" for n in range(4097)])
    with pytest.raises(MalformedAnswer, match="length"):
        decode_answer(msgspec.msgpack.encode(too_many))
    refs = _kv(identifiers_followed=True, identifiers=["a", "b"],
               carried=[(0, [0, 1]), (1, [0, 1])])  # fmt: skip
    assert decode_answer(encode(refs)) == refs
    monkeypatch.setattr(dq, "MAX_SNAPSHOT_IDENT_REFS", 3)  # past it in all, not per block
    with pytest.raises(MalformedAnswer, match="more than 3 identifiers in all"):
        decode_answer(encode(refs))
    per_block = dq.MAX_SNAPSHOT_IDENTS_PER_BLOCK
    wide = _kv(identifiers_followed=True, identifiers=[f"i{n}" for n in range(per_block + 1)],
               carried=[(0, list(range(per_block + 1)))])  # fmt: skip
    with pytest.raises(MalformedAnswer, match="length"):
        decode_answer(msgspec.msgpack.encode(wide))


def test_the_snapshot_bound_per_block_is_the_index_s():
    from mmreuse.demand_query import MAX_SNAPSHOT_IDENTS_PER_BLOCK
    from mmreuse.events.index import MAX_EXTRA_KEYS_PER_BLOCK

    assert MAX_SNAPSHOT_IDENTS_PER_BLOCK == MAX_EXTRA_KEYS_PER_BLOCK
