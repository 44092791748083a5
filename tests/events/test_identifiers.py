"""RemoteKVIndex's identifiers: which mm identifiers a held block carries, from extra_keys."""

import base64
import json
import threading
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mmreuse.demand_query import MAX_IDENT_CHARS
from mmreuse.errors import InvalidArgumentType
from mmreuse.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    MalformedBatch,
    RemoteKVIndex,
    decode_batch,
    encode_batch,
)
from mmreuse.events import index as index_module
from mmreuse.events.index import (
    MAX_EXTRA_KEYS_PER_BLOCK,
    SKIP_LONG_IDENT,
    SKIP_MALFORMED,
    SKIP_NOT_PUBLISHED,
    SKIP_SNAPSHOT,
)
from mmreuse.events.wire import MEDIUM_GPU
from tests.support.kv_publisher import stored as stored_event
from tests.support.paths import KV_EVENT_FIXTURES

FIXTURES = json.loads(KV_EVENT_FIXTURES.read_text())


def stored(hashes, keys=None, medium="GPU"):
    return stored_event(hashes, medium, extra_keys=keys)


def removed(hashes, medium="GPU"):
    return BlockRemoved(block_hashes=list(hashes), medium=medium)


def apply(idx, *events):
    return idx.apply(KVEventBatch(ts=0.0, events=list(events)))


def mm(*idents):
    """One block's extra keys naming `idents` (offsets as vLLM's: block-relative, may be < 0)."""
    return tuple((ident, -5 * i) for i, ident in enumerate(idents))


def test_stored_then_removed():
    idx = RemoteKVIndex(track_identifiers=True)
    assert idx.identifiers_known() and not idx.may_hold("a")
    apply(idx, stored([1, 2, 3], [None, mm("a"), mm("a", "b")]))
    assert idx.may_hold("a") and idx.may_hold("b") and not idx.may_hold("c")
    assert idx.identifiers() == {"a": 2, "b": 1}
    apply(idx, removed([3]))
    assert idx.identifiers() == {"a": 1}
    assert not idx.may_hold("b")
    apply(idx, removed([1, 2]))
    assert idx.identifiers() == {} and not idx.may_hold("a")
    assert idx.identifiers_known() and idx.identifier_skips() == {}


def test_several_offsets_count_once_per_block():
    idx = RemoteKVIndex(track_identifiers=True)
    apply(idx, stored([7], [(("a", -30), ("b", -2), ("a", 4))]))
    assert idx.identifiers() == {"a": 1, "b": 1}
    apply(idx, removed([7]))
    assert idx.identifiers() == {}


def test_lora_salt_and_embeds_digest_are_not_identifiers():
    idx = RemoteKVIndex(track_identifiers=True)
    apply(idx, stored([1, 2], [("adapter-1", ("a", 0), "salt-3"), ("salt", bytes(32))]))
    assert idx.identifiers() == {"a": 1}
    assert not idx.may_hold("adapter-1") and not idx.may_hold("salt-3")
    assert idx.identifiers_known()


def test_hash_stored_twice_stays_until_its_last_removal():
    idx = RemoteKVIndex(track_identifiers=True)
    apply(idx, stored([5], [mm("a")]), stored([5], [mm("a")]))
    assert idx.counts() == {5: 2} and idx.identifiers() == {"a": 1}
    apply(idx, removed([5]))
    assert idx.may_hold("a")
    apply(idx, removed([5]))
    assert not idx.may_hold("a") and idx.counts() == {}
    apply(idx, removed([5]))  # not held: nothing happens
    assert not idx.may_hold("a")


def test_duplicate_hashes_in_one_event():
    idx = RemoteKVIndex(track_identifiers=True)
    apply(idx, stored([5, 5], [mm("a"), None]))
    apply(idx, removed([5]))
    assert idx.may_hold("a")  # a block still holds hash 5
    apply(idx, removed([5, 5]))
    assert not idx.may_hold("a")


def test_hash_carries_the_union_of_its_stores():
    idx = RemoteKVIndex(track_identifiers=True)
    apply(idx, stored([5], [None]), stored([5], [mm("a")]), stored([5], [mm("b")]))
    assert idx.identifiers() == {"a": 1, "b": 1}
    apply(idx, removed([5, 5]))
    assert idx.identifiers() == {"a": 1, "b": 1}  # one block still holds 5: safe side
    apply(idx, removed([5]))
    assert idx.identifiers() == {}


def test_bytes_hashes_and_int_ids_are_one_block():
    idx = RemoteKVIndex(track_identifiers=True)
    digest = bytes(24) + (9).to_bytes(8, "big")
    apply(idx, stored([digest], [mm("a")]))
    apply(idx, removed([9]))
    assert not idx.may_hold("a")


def test_media_are_separate():
    idx = RemoteKVIndex(track_identifiers=True)
    apply(idx, stored([1], [mm("a")], medium="CPU"), stored([1], [mm("b")], medium=None))
    assert idx.may_hold("a", "CPU") and not idx.may_hold("a")
    assert idx.may_hold("b", MEDIUM_GPU) and not idx.may_hold("b", "CPU")
    apply(idx, removed([1], medium="CPU"))
    assert not idx.may_hold("a", "CPU") and idx.may_hold("b")


def test_all_blocks_cleared_and_clear():
    idx = RemoteKVIndex(track_identifiers=True)
    apply(idx, stored([1], [mm("a")]), stored([2], None, medium="CPU"))
    assert not idx.identifiers_known("CPU")
    apply(idx, AllBlocksCleared(), stored([3], [mm("b")]))
    assert idx.identifiers() == {"b": 1} and idx.identifiers_known("CPU")
    assert not idx.may_hold("a")
    idx.clear()
    assert idx.identifiers() == {} and not idx.may_hold("b")


def test_stored_without_extra_keys_makes_identifiers_unknown():
    idx = RemoteKVIndex(track_identifiers=True)
    apply(idx, stored([1], [mm("a")]), stored([2, 3]))  # vLLM < 0.17: no extra_keys
    assert not idx.identifiers_known()
    assert idx.may_hold("a") and idx.may_hold("never-seen")
    assert idx.identifiers() == {}  # forgotten: nothing to follow until a reset
    assert idx.identifier_skips() == {SKIP_NOT_PUBLISHED: 2}
    apply(idx, removed([1, 2, 3]))
    assert idx.may_hold("never-seen")  # sticky until a reset
    apply(idx, AllBlocksCleared())
    assert idx.identifiers_known() and not idx.may_hold("never-seen")


def test_empty_store_changes_nothing():
    idx = RemoteKVIndex(track_identifiers=True)
    apply(idx, stored([], None))
    assert idx.identifiers_known()


def test_load_cannot_know_identifiers():
    idx = RemoteKVIndex(track_identifiers=True)
    apply(idx, stored([1], [mm("a")]))
    idx.load([4, 5], [1, 2])
    assert not idx.identifiers_known() and idx.may_hold("zzz")
    assert idx.identifiers() == {} and idx.identifier_skips() == {SKIP_SNAPSHOT: 2}
    apply(idx, stored([6], [mm("b")]))
    assert not idx.identifiers_known()  # still unknown: 4 and 5 carry what they carry
    idx.clear()
    assert idx.identifiers_known() and not idx.may_hold("zzz")
    idx.load([], [])  # an empty snapshot: nothing held, nothing unknown
    assert idx.identifiers_known()


def test_may_hold_arguments():
    idx = RemoteKVIndex(track_identifiers=True)
    with pytest.raises(InvalidArgumentType):
        idx.may_hold(b"a")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentType):
        idx.may_hold("a", None)  # type: ignore[arg-type]
    assert idx.may_hold("x" * (MAX_IDENT_CHARS + 1))  # never followed: unknown


def test_long_identifier_is_skipped_and_counted():
    idx = RemoteKVIndex(track_identifiers=True)
    long = "x" * (MAX_IDENT_CHARS + 1)
    apply(idx, stored([1, 2], [((long, 0), ("a", 3)), ((long, 0),)]))
    assert idx.identifiers() == {"a": 1} and idx.identifiers_known()
    assert idx.identifier_skips() == {SKIP_LONG_IDENT: 2}
    assert idx.may_hold(long)
    assert idx.may_hold("x" * MAX_IDENT_CHARS) is False  # at the bound: followed


JUNK = {
    "not a list": "abc",
    "too short": [mm("a")],
    "too long": [mm("a"), None, None],
    "entry an int": [7, None],
    "entry a dict": [{"a": 0}, None],
    "item an int": [(3,), None],
    "item a triple": [(("mm", "a", 0),), None],
    "item a dict": [({"a": 0},), None],
    "item a single": [(("a",),), None],
    "ident an int": [((1, 0),), None],
    "ident empty": [(("", 0),), None],
    "ident bytes": [((b"a", 0),), None],
    "offset a float": [(("a", 0.5),), None],
    "offset a bool": [(("a", True),), None],
    "offset None": [(("a", None),), None],
    "too many items": [tuple(("a", i) for i in range(MAX_EXTRA_KEYS_PER_BLOCK + 1)), None],
    "nested": [((("a", 0), 0),), None],
}


@pytest.mark.parametrize("keys", list(JUNK.values()), ids=list(JUNK))
def test_junk_extra_keys_never_raise_and_make_identifiers_unknown(keys):
    idx = RemoteKVIndex(track_identifiers=True)
    apply(idx, stored([100], [mm("before")]))
    assert apply(idx, stored([1, 2], keys)) == 1
    assert idx.counts() == {100: 1, 1: 1, 2: 1}  # the hashes are followed as ever
    assert not idx.identifiers_known()
    assert idx.may_hold("before") and idx.may_hold("a")
    assert idx.identifiers() == {}
    assert set(idx.identifier_skips()) == {SKIP_MALFORMED}
    apply(idx, stored([3], [mm("c")]), removed([1, 2, 3, 100]))  # and stays harmless
    assert not idx.identifiers_known()
    apply(idx, AllBlocksCleared(), stored([4], [mm("d")]))
    assert idx.identifiers_known() and idx.identifiers() == {"d": 1}


def test_junk_through_the_wire_never_raises():
    """What the decoder lets through (it refuses some shapes whole: MalformedBatch)."""
    idx = RemoteKVIndex(track_identifiers=True)
    passed = 0
    for keys in JUNK.values():
        payload = encode_batch(KVEventBatch(ts=0.0, events=[stored([1, 2], keys)]))
        try:
            batch = decode_batch(payload)
        except MalformedBatch:
            continue
        apply(idx, *batch.events)
        passed += 1
    assert passed >= len(JUNK) - 3
    assert not idx.identifiers_known() and idx.counts() == {1: passed, 2: passed}


# ---- against a brute-force model --------------------------------------------------------

HASHES = st.integers(0, 7)
IDENTS = st.sampled_from(["a", "b", "c", "d"])
# (op, hashes, salted): stores (some with a salt or adapter key), removes and clears
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("store"), st.lists(HASHES, max_size=5), st.booleans()),
        st.tuples(st.just("remove"), st.lists(HASHES, max_size=5), st.just(False)),
        st.tuples(st.just("clear"), st.just([]), st.just(False)),
    ),
    max_size=30,
)


@settings(max_examples=300, deadline=None)
@given(
    carries=st.dictionaries(HASHES, st.frozensets(IDENTS, max_size=3)),
    ops=OPS,
    data=st.data(),
)
def test_may_hold_matches_a_brute_force_model(carries, ops, data):
    """vLLM's rule: a hash names its extra keys, so a block hash carries a fixed set of
    identifiers; `may_hold(x)` is whether some held hash carries x."""
    idx = RemoteKVIndex(track_identifiers=True)
    held: dict[int, int] = {}
    for op, hashes, salted in ops:
        if op == "store":
            keys = []
            for h in hashes:
                idents = sorted(carries.get(h, ()))
                if not idents and not salted:
                    keys.append(None)
                    continue
                # several offsets per identifier, a LoRA name and a salt around them
                items = ["adapter-1"] if salted else []
                for ident in idents:
                    items += [(ident, -7)] * data.draw(st.integers(1, 2))
                if salted:
                    items.append("salt")
                keys.append(tuple(items))
            apply(idx, stored(hashes, keys))
            for h in hashes:
                held[h] = held.get(h, 0) + 1
        elif op == "remove":
            apply(idx, removed(hashes))
            for h in hashes:
                if held.get(h):
                    held[h] -= 1
        else:
            apply(idx, AllBlocksCleared())
            held.clear()
        live = [h for h, n in held.items() if n]
        assert idx.counts() == {h: held[h] for h in live}
        expected = {}
        for h in live:
            for ident in carries.get(h, ()):
                expected[ident] = expected.get(ident, 0) + 1
        assert idx.identifiers() == expected
        for ident in "abcde":
            assert idx.may_hold(ident) == (ident in expected)
    assert idx.identifiers_known() and idx.identifier_skips() == {}


def _model_apply(model, batch):
    """What the identifiers of a vLLM-encoded batch should be, by brute force: per medium, the
    held hashes' counts and identifiers, or None once a store without extra keys was seen."""
    for e in batch.events:
        if isinstance(e, AllBlocksCleared):
            model.clear()
            continue
        medium = e.medium or MEDIUM_GPU
        held, carried, known = model.setdefault(medium, ({}, {}, [True]))
        ids = [h if type(h) is int else int.from_bytes(h[-8:], "big") for h in e.block_hashes]
        if isinstance(e, BlockStored):
            if e.extra_keys is None and ids:
                known[0] = False
            for i, h in enumerate(ids):
                held[h] = held.get(h, 0) + 1
                entry = e.extra_keys[i] if e.extra_keys else None
                for k in entry or ():
                    if isinstance(k, (list, tuple)):
                        carried.setdefault(h, set()).add(k[0])
        else:
            for h in ids:
                if held.get(h):
                    held[h] -= 1
                    if not held[h]:
                        del held[h]
                        carried.pop(h, None)


def test_vllm_encoded_events_match_the_model():
    """Batches encoded by vLLM 0.33.0's own structs (mm pairs, LoRA names, salts, both hash
    modes, CPU and GPU media), applied in order to one index."""
    idx = RemoteKVIndex(track_identifiers=True)
    model: dict = {}
    seen: set[str] = set()
    mm_blocks = 0
    for fx in FIXTURES["fixtures"]:
        batch = decode_batch(base64.b64decode(fx["payload_b64"]))
        idx.apply(batch)
        _model_apply(model, batch)
        for e in batch.events:
            for entry in getattr(e, "extra_keys", None) or ():
                idents = {k[0] for k in entry or () if isinstance(k, list)}
                seen |= idents
                mm_blocks += bool(idents)
        for medium in ("GPU", "CPU"):
            _held, carried, known = model.get(medium, ({}, {}, [True]))
            assert idx.identifiers_known(medium) == known[0]
            for ident in seen:
                expect = not known[0] or any(ident in c for c in carried.values())
                assert idx.may_hold(ident, medium) == expect
    assert mm_blocks > 20 and len(seen) > 20
    assert set(idx.identifier_skips()) <= {SKIP_NOT_PUBLISHED}


def test_vllm_encoded_mm_blocks_are_followed_then_removed():
    """Each vLLM-encoded BlockStored with mm keys, alone: its identifiers, then none."""
    checked = 0
    for fx in FIXTURES["fixtures"]:
        for e in decode_batch(base64.b64decode(fx["payload_b64"])).events:
            if not isinstance(e, BlockStored) or not e.extra_keys:
                continue
            idents = {k[0] for entry in e.extra_keys for k in entry or () if isinstance(k, list)}
            if not idents:
                continue
            idx = RemoteKVIndex(track_identifiers=True)
            idx.apply(KVEventBatch(ts=0.0, events=[e]))
            medium = e.medium or MEDIUM_GPU
            assert idx.identifiers_known(medium)
            assert set(idx.identifiers(medium)) == idents
            idx.apply(KVEventBatch(ts=0.0, events=[removed(e.block_hashes, e.medium)]))
            assert idx.identifiers(medium) == {} and not any(map(idx.may_hold, idents))
            checked += 1
    assert checked > 10


def test_a_hash_named_with_ever_new_identifiers_is_bounded():
    idx = RemoteKVIndex(track_identifiers=True)
    for i in range(MAX_EXTRA_KEYS_PER_BLOCK):
        apply(idx, stored([1], [mm(f"id-{i}")]))
    assert idx.identifiers_known() and len(idx.identifiers()) == MAX_EXTRA_KEYS_PER_BLOCK
    apply(idx, stored([1], [mm("one-more")]))
    assert not idx.identifiers_known() and idx.identifiers() == {}
    assert idx.identifier_skips() == {SKIP_MALFORMED: 1}


def test_an_item_over_many_blocks_then_another():
    """vLLM's usual shape: one (identifier, offset) per block, an item over several blocks."""
    idx = RemoteKVIndex(track_identifiers=True)
    keys = [(["a", -16 * i],) for i in range(4)] + [None] + [(["b", 3 - 16 * i],) for i in range(3)]
    apply(idx, stored(range(10, 18), keys))
    assert idx.identifiers() == {"a": 4, "b": 3}
    apply(idx, removed([10, 11, 12, 15]))
    assert idx.identifiers() == {"a": 1, "b": 2}
    apply(idx, removed([13, 14, 16, 17]))
    assert idx.identifiers() == {}


def test_identifiers_are_not_followed_unless_asked():
    idx = RemoteKVIndex()
    assert not idx.identifiers_known() and idx.may_hold("anything")
    with pytest.raises(TypeError, match="track_identifiers"):
        RemoteKVIndex(track_identifiers="yes")  # type: ignore[arg-type]


# ---- loaded from a snapshot that carries them -------------------------------------------------


def test_load_with_identifiers_knows_them():
    idx = RemoteKVIndex(track_identifiers=True)
    apply(idx, stored([1], [mm("old")]))
    idx.load([4, 5, 6], [1, 2, 1], identifiers={5: ("a", "b"), 6: ["a"]})
    assert idx.identifiers_known() and idx.identifiers() == {"a": 2, "b": 1}
    assert idx.may_hold("a") and not idx.may_hold("old") and not idx.may_hold("c")
    assert idx.carriers() == {5: ("a", "b"), 6: ("a",)} and idx.identifier_skips() == {}
    apply(idx, removed([5]))  # held by two blocks: still carries a and b
    assert idx.identifiers() == {"a": 2, "b": 1}
    apply(idx, removed([5, 6]), stored([7], [mm("c")]))
    assert idx.identifiers() == {"c": 1} and not idx.may_hold("a")
    idx.load([8], [1], identifiers={})  # followed, and no block carries any
    assert idx.identifiers_known() and idx.identifiers() == {} and not idx.may_hold("c")
    assert idx.carriers("CPU") == {}


def test_load_identifiers_by_digest_and_other_media():
    idx = RemoteKVIndex(track_identifiers=True)
    digest = bytes(24) + (9).to_bytes(8, "big")
    idx.load([digest], [1], medium="CPU", identifiers={9: ["a"]})
    assert idx.identifiers("CPU") == {"a": 1} and idx.identifiers_known("CPU")
    assert not idx.may_hold("a") and idx.identifiers_known()  # GPU: nothing held


def test_load_without_tracking_ignores_identifiers():
    idx = RemoteKVIndex()
    idx.load([4], [1], identifiers={4: ["a"]})
    assert not idx.identifiers_known() and idx.may_hold("zzz") and idx.carriers() is None
    with pytest.raises(ValueError, match="not in block_ids"):
        idx.load([4], [1], identifiers={5: ["a"]})  # still checked: junk is junk


LOAD_JUNK = [
    ("not a mapping", [4], "identifiers must be a mapping"),
    ("a block not held", {6: ["a"]}, "names block 6, not in block_ids"),
    ("more blocks than held", {4: ["a"], 5: ["a"], 6: ["a"]}, "more than the 2 block_ids"),
    ("a block twice", {4: ["a"], bytes(24) + (4).to_bytes(8, "big"): ["b"]}, "block .* twice"),
    ("a bad block id", {-1: ["a"]}, r"identifiers \(a block id\)"),
    ("a str, not a list", {4: "a"}, r"identifiers\[4\] must be a list"),
    ("no identifiers", {4: []}, r"identifiers\[4\] has 0 identifiers"),
    ("too many", {4: [f"i{n}" for n in range(257)]}, r"identifiers\[4\] has 257"),
    ("an empty one", {4: [""]}, r"identifiers\[4\] holds ''"),
    ("not a str", {4: [3]}, r"identifiers\[4\] holds 3"),
    ("too long", {4: ["x" * (MAX_IDENT_CHARS + 1)]}, r"identifiers\[4\] holds"),
    ("repeated", {4: ["a", "a"]}, r"identifiers\[4\] repeats"),
]


@pytest.mark.parametrize("name, junk, match", LOAD_JUNK, ids=[j[0] for j in LOAD_JUNK])
def test_load_refuses_junk_identifiers_whole(name, junk, match):
    idx = RemoteKVIndex(track_identifiers=True)
    apply(idx, stored([1], [mm("a")]))
    with pytest.raises(ValueError, match=match):
        idx.load([4, 5], [1, 1], identifiers=junk)
    assert idx.counts() == {1: 1} and idx.identifiers() == {"a": 1}, name  # unchanged


# ---- P's side: following the batches it publishes, chunking them for its snapshot ------------


def test_p_follows_the_identifiers_it_publishes():
    from mmreuse.events.identifiers import PublishedIdentifiers

    p = PublishedIdentifiers(max_hashes=8)
    assert p.carriers() == {}
    # as P publishes them: vLLM's tuples, a connector's medium (not followed)
    p.follow([stored([1, 2], [None, (("a", 0),)]), stored([3], [(("b", 0),)], medium="CPU")])
    p.follow([stored([2, 4], [(("a", 0),), (("a", -16), ("c", 0))])])
    assert p.carriers() == {2: ("a",), 4: ("a", "c")} and p.stopped is None
    p.follow([removed([2])])
    assert p.carriers() == {2: ("a",), 4: ("a", "c")}  # stored twice: held still
    p.follow([removed([2, 4]), removed([3], medium="CPU")])
    assert p.carriers() == {}
    p.follow([stored([5], None)])  # no extra keys published: unknown, until a clear
    assert p.carriers() is None
    p.follow([AllBlocksCleared(), stored([6], [mm("d")])])
    assert p.carriers() == {6: ("d",)}


def test_p_stops_following_past_its_blocks_until_a_clear():
    from mmreuse.events.identifiers import PublishedIdentifiers

    p = PublishedIdentifiers(max_hashes=2)  # counts the hashes carrying identifiers only
    p.follow([stored([1, 2, 3], [mm("a"), None, mm("b")])])
    assert p.carriers() == {1: ("a",), 3: ("b",)}
    p.follow([stored([4], [mm("c")])])  # a third such hash: events over-report, not followed
    assert p.carriers() is None and "more than P's 2 blocks" in p.stopped
    p.follow([removed([3])])
    assert p.carriers() is None  # stays stopped: what it forgot is not known again
    p.follow([stored([9], [mm("x")]), AllBlocksCleared(), stored([4], [mm("c")])])
    assert p.carriers() == {4: ("c",)} and p.stopped is None


@pytest.mark.parametrize(
    "junk",
    [
        [object()],
        [stored([-1], [mm("a")])],
        [BlockRemoved(block_hashes="nope", medium="GPU")],
        [stored([1], [mm("a")], medium="X" * 100)],
    ],
    ids=["not an event", "a negative hash", "hashes not a list", "a medium too long"],
)
def test_p_following_junk_never_raises(junk):
    from mmreuse.events.identifiers import PublishedIdentifiers

    p = PublishedIdentifiers(max_hashes=8)
    p.follow([stored([1], [mm("a")])])
    p.follow(junk)
    assert p.carriers() in (None, {1: ("a",)})
    if p.carriers() is None:
        assert p.stopped


def _chunks_of(ids, counts, carried, limit):
    """A snapshot's chunks as P serves them (`identifier_chunk`), through the wire."""
    from mmreuse.demand_query import KVSnapshot, decode_answer, encode
    from mmreuse.events.identifiers import identifier_chunk

    out, offset = [], 0
    while offset < len(ids) or not out:
        end, table, pairs = identifier_chunk(ids, carried, offset, limit)
        chunk = KVSnapshot("s", 1, "inc", len(ids), offset, 1 << 20, ids[offset:end],
                           counts[offset:end], True, table, pairs)  # fmt: skip
        out.append(decode_answer(encode(chunk)))
        if end == offset:
            break
        offset = end
    return out


def test_identifier_chunks_end_early_within_their_bounds(monkeypatch):
    from mmreuse.events import identifiers as snap

    ids = list(range(100, 120))
    carried = {i: (f"x{i % 7}", f"y{i % 3}") for i in ids if i % 4}
    monkeypatch.setattr(snap, "MAX_SNAPSHOT_IDENTS", 5)
    monkeypatch.setattr(snap, "MAX_SNAPSHOT_IDENT_REFS", 6)
    chunks = _chunks_of(ids, [1] * 20, carried, limit=8)
    assert len(chunks) > 3 and all(c.block_ids for c in chunks)
    assert [i for c in chunks for i in c.block_ids] == ids
    for c in chunks:
        assert len(c.identifiers) <= 5 and sum(len(r) for _, r in c.carried) <= 6
    merged = {}
    for c in chunks:
        merged.update(snap.chunk_identifiers(c))
    assert merged == carried


def test_identifier_chunks_fit_the_answer_frame():
    """Every block carrying its own identifier of MAX_IDENT_CHARS 4-byte characters: the chunk
    ends at MAX_SNAPSHOT_IDENT_BYTES, and its frame fits what a client accepts."""
    from mmreuse.demand_query import MAX_ANSWER_BYTES, MAX_SNAPSHOT_IDENT_BYTES, encode
    from mmreuse.events.identifiers import identifier_chunk

    ids = list(range(3000))
    carried = {i: (f"{i:08d}" + "\U0001f600" * (MAX_IDENT_CHARS - 8),) for i in ids}
    end, table, _ = identifier_chunk(ids, carried, 0, 262_144)
    size = sum(len(x.encode()) for x in table)
    assert 0 < end < 3000 and size <= MAX_SNAPSHOT_IDENT_BYTES
    assert size + len(table[0].encode()) > MAX_SNAPSHOT_IDENT_BYTES  # full, not short
    chunks = _chunks_of(ids, [1] * 3000, carried, 262_144)
    assert len(chunks) == 3 and all(len(encode(c)) < MAX_ANSWER_BYTES for c in chunks)


def test_identifier_chunks_leave_out_what_no_view_follows():
    from mmreuse.events.identifiers import identifier_chunk

    long = "x" * (MAX_IDENT_CHARS + 1)
    end, table, pairs = identifier_chunk([1, 2, 3], {1: (long,), 2: (long, "a"), 9: ("z",)}, 0, 9)
    assert (end, table, pairs) == (3, ["a"], [(1, [0])])


# ---- a snapshot, then live events: what every event from 0 gives ------------------------------


def _vllm_events(op, hashes, salted, carries, data):
    """One op as P publishes it (vLLM's tuples) -- the decoded form is what a view gets."""
    if op == "clear":
        return [AllBlocksCleared()]
    if op == "remove":
        return [removed(hashes)]
    keys = []
    for h in hashes:
        idents = sorted(carries.get(h, ()))
        if not idents and not salted:
            keys.append(None)
            continue
        items = ["adapter-1"] if salted else []
        for ident in idents:
            items += [(ident, -7)] * data.draw(st.integers(1, 2))
        keys.append(tuple(items))
    return [stored(hashes, keys)]


@settings(max_examples=200, deadline=None)
@given(
    carries=st.dictionaries(HASHES, st.frozensets(IDENTS, max_size=3)),
    ops=OPS,
    limit=st.integers(1, 4),
    data=st.data(),
)
def test_a_snapshot_then_live_events_is_every_event_from_0(carries, ops, limit, data):
    """P follows its published batches (`PublishedIdentifiers`); at any batch a snapshot is
    taken, chunked and sent over the wire, loaded into a fresh view, which then applies the
    batches after it: its identifiers, counts and `may_hold` equal those of the view that
    applied every batch from 0, after every batch."""
    from mmreuse.events.identifiers import PublishedIdentifiers, chunk_identifiers

    p = PublishedIdentifiers(max_hashes=1000)
    full = RemoteKVIndex(track_identifiers=True)
    booted: RemoteKVIndex | None = None
    cut = data.draw(st.integers(0, len(ops)))
    for i in range(len(ops) + 1):
        if i == cut:  # the snapshot: P as of the batches published so far (its blocks: as
            held = full.counts()  # every batch from 0 has them, P's residency index in vLLM)
            ids = list(held)
            carried = p.carriers()
            assert carried is not None
            chunks = _chunks_of(ids, [held[x] for x in ids], carried, limit)
            merged = {}
            for c in chunks:
                merged.update(chunk_identifiers(c))
            booted = RemoteKVIndex(track_identifiers=True)
            booted.load(ids, [held[x] for x in ids], identifiers=merged)
        if i == len(ops):
            break
        op, hashes, salted = ops[i]
        events = _vllm_events(op, hashes, salted, carries, data)
        p.follow(events)
        wire = decode_batch(encode_batch(KVEventBatch(ts=0.0, events=events)))
        full.apply(wire)
        if booted is not None:
            booted.apply(wire)
            assert booted.counts() == full.counts()
            assert booted.identifiers() == full.identifiers()
            assert booted.identifiers_known() and full.identifiers_known()
            for ident in "abcde":
                assert booted.may_hold(ident) == full.may_hold(ident)
    assert booted is not None and booted.identifiers() == full.identifiers()
    assert p.carriers() == full.carriers()


# ---- big batches: linear work, in slices, bounded by the block size (review 3, M2) ------------


def many_identifiers(blocks=2000, idents=256, events=True):
    """The review's batch, smaller: `blocks` blocks each naming `idents` distinct short
    identifiers ("i0", ..., offset 0), one BlockStored each (`events`) or all in one."""
    keys = tuple((f"i{j}", 0) for j in range(idents))
    if events:
        return KVEventBatch(ts=0.0, events=[stored([b + 1], [keys]) for b in range(blocks)])
    return KVEventBatch(ts=0.0, events=[stored(range(1, blocks + 1), [keys] * blocks)])


@pytest.mark.parametrize("events", [True, False], ids=["block per event", "one event"])
def test_readers_get_the_lock_while_a_big_batch_applies(events):
    """A reader thread's lookups are served between slices of the batch: it sees the batch in
    part (0 < size < all), which it never could while the batch held the lock whole (the
    proxy's request path waited seconds). What it sees is a prefix: every block held carries
    the identifiers it was stored with."""
    n = 2000
    batch = many_identifiers(n, events=events)
    idx = RemoteKVIndex(track_identifiers=True)
    seen: list[tuple[int, bool]] = []
    started, stop = threading.Event(), threading.Event()

    def reader():
        while not stop.is_set():
            seen.append((idx.size(), idx.may_hold("i255")))
            started.set()

    thread = threading.Thread(target=reader)
    thread.start()
    started.wait()
    try:
        idx.apply(batch)
    finally:
        stop.set()
        thread.join()
    part = [(size, held) for size, held in seen if 0 < size < n]
    assert part, "no read was served while the batch applied"
    assert all(held for _, held in part)
    assert idx.size() == n and idx.identifiers() == {f"i{j}": n for j in range(256)}


def test_a_big_batch_s_identifiers_are_kept_once():
    """Memory linear in what was published, not x24 (a tuple and strings per block): blocks
    naming what the block before them named share its tuple."""
    payload = encode_batch(many_identifiers(500))
    idx = RemoteKVIndex(track_identifiers=True)
    idx.apply(decode_batch(payload))
    carried = idx.carriers()
    assert carried is not None and len(carried) == 500
    assert len({id(idents) for idents in carried.values()}) == 1


def test_identifiers_published_again_keep_the_medium_s_strings():
    """Batch after batch naming the same identifiers (new hashes each): one string each."""
    keys = tuple((f"i{j}", 0) for j in range(16))
    idx = RemoteKVIndex(track_identifiers=True)
    for b in range(3):  # decoded: new string objects each time
        idx.apply(decode_batch(encode_batch(KVEventBatch(ts=0.0, events=[stored([b], [keys])]))))
    carried = idx.carriers()
    assert carried is not None and len(carried) == 3
    first = carried[0]
    assert all(x is y for t in carried.values() for x, y in zip(t, first, strict=True))


def test_a_block_naming_more_identifiers_than_its_tokens_makes_them_unknown():
    """A block of `block_size` tokens overlaps at most that many items: more identifiers (or a
    hash stored again with new ones past it) is not vLLM's, and the medium's identifiers are
    unknown (as for over-256), never silently skipped."""
    idx = RemoteKVIndex(track_identifiers=True, max_identifiers_per_block=4)
    apply(idx, stored([1], [mm("a", "b", "c", "d")]), stored([2], [mm(*"aaaaaa")]))
    assert idx.identifiers_known() and idx.identifiers() == {"a": 2, "b": 1, "c": 1, "d": 1}
    apply(idx, stored([3], [mm("a", "b", "c", "d", "e")]))
    assert not idx.identifiers_known() and idx.identifiers() == {} and idx.may_hold("zzz")
    assert idx.identifier_skips() == {SKIP_MALFORMED: 1} and idx.counts() == {1: 1, 2: 1, 3: 1}
    apply(idx, AllBlocksCleared(), stored([5], [mm("a", "b")]), stored([5], [mm("c", "d")]))
    assert idx.identifiers_known() and idx.carriers() == {5: ("a", "b", "c", "d")}
    apply(idx, stored([5], [mm("b", "e")]))  # the union: 5 identifiers
    assert not idx.identifiers_known()
    assert idx.identifier_skips() == {SKIP_MALFORMED: 2}
    with pytest.raises(ValueError, match=r"identifiers\[4\] has 5 .*max_identifiers_per_block=4"):
        idx.load([4], [1], identifiers={4: list("abcde")})


@pytest.mark.parametrize(
    "value, error",
    [(0, ValueError), (MAX_EXTRA_KEYS_PER_BLOCK + 1, ValueError), (True, TypeError),
     (16.0, TypeError), ("16", TypeError), (None, TypeError)],
)  # fmt: skip
def test_max_identifiers_per_block_is_validated(value, error):
    with pytest.raises(error, match=f"max_identifiers_per_block.*{value!r}"):
        RemoteKVIndex(max_identifiers_per_block=value)
    assert RemoteKVIndex().max_identifiers_per_block == MAX_EXTRA_KEYS_PER_BLOCK


# A block's extra-key items: mm keys (a long identifier among them), LoRA names and salts, and,
# rarely, junk the index must not follow (`JUNK`'s kinds).
LONG = "x" * (MAX_IDENT_CHARS + 1)
ITEMS = st.one_of(
    st.tuples(st.sampled_from(["a", "b", "c", "d", "e", LONG]), st.integers(-40, 40)),
    st.sampled_from(["adapter-1", "salt", b"digest"]),
    st.sampled_from([3, ("a",), ("mm", "a", 0), ("", 0), ("a", True), (1, 0)]),
)
ENTRIES = st.one_of(st.none(), st.lists(ITEMS, max_size=6).map(tuple), st.just([("a", 0)]))
MEDIA = st.sampled_from(["GPU", "CPU", None])


@st.composite
def kv_events(draw):
    kind = draw(st.sampled_from(["store"] * 6 + ["remove"] * 3 + ["clear", "bad keys"]))
    if kind == "clear":
        return AllBlocksCleared()
    hashes = draw(st.lists(HASHES, max_size=5))
    medium = draw(MEDIA)
    if kind == "remove":
        return removed(hashes, medium)
    if kind == "bad keys":  # not published (vLLM < 0.17), or not one entry a block
        return stored(hashes, draw(st.sampled_from([None, [mm("a")] * (len(hashes) + 1)])), medium)
    return stored(hashes, [draw(ENTRIES) for _ in hashes], medium)


class ReferenceIndex:
    """The identifiers' rules, by brute force: per medium the held counts, each held hash's
    identifiers in the order first named (the union of its stores), whether they are known,
    and the skips by reason."""

    def __init__(self, bound):
        self.bound = bound
        self.held: dict[str, dict[int, int]] = {}
        self.carried: dict[str, dict[int, list[str]]] = {}
        self.unknown: set[str] = set()
        self.skips: dict[str, int] = {}

    def skip(self, medium, reason, n):
        self.skips[reason] = self.skips.get(reason, 0) + n
        self.unknown.add(medium)
        self.carried.pop(medium, None)

    def entry(self, entry):
        """(identifiers in order, how many too long) or None if malformed."""
        if not isinstance(entry, (list, tuple)) or len(entry) > MAX_EXTRA_KEYS_PER_BLOCK:
            return None
        idents, long = [], 0
        for k in entry:
            if isinstance(k, (list, tuple)):
                if len(k) != 2 or type(k[0]) is not str or type(k[1]) is not int or not k[0]:
                    return None
                if len(k[0]) > MAX_IDENT_CHARS:
                    long += 1
                elif k[0] not in idents:
                    idents.append(k[0])
            elif not isinstance(k, (str, bytes)):
                return None
        return idents, long

    def apply(self, events):
        for e in events:
            if isinstance(e, AllBlocksCleared):
                self.held.clear()
                self.carried.clear()
                self.unknown.clear()
                continue
            medium = e.medium or MEDIUM_GPU
            held = self.held.setdefault(medium, {})
            if isinstance(e, BlockRemoved):
                for h in e.block_hashes:
                    if held.get(h):
                        held[h] -= 1
                        if not held[h]:
                            del held[h]
                            self.carried.get(medium, {}).pop(h, None)
                continue
            for h in e.block_hashes:
                held[h] = held.get(h, 0) + 1
            self.store(medium, e)

    def store(self, medium, e):
        n = len(e.block_hashes)
        if not n or medium in self.unknown:
            return
        keys = e.extra_keys
        if keys is None:
            return self.skip(medium, SKIP_NOT_PUBLISHED, n)
        if len(keys) != n:
            return self.skip(medium, SKIP_MALFORMED, n)
        carried = self.carried.setdefault(medium, {})
        for h, entry in zip(e.block_hashes, keys, strict=True):
            if entry is None:
                continue
            found = self.entry(entry)
            if found is None or len(found[0]) > self.bound:
                return self.skip(medium, SKIP_MALFORMED, 1)
            idents, long = found
            if long:
                self.skips[SKIP_LONG_IDENT] = self.skips.get(SKIP_LONG_IDENT, 0) + long
            if not idents:
                continue
            union = carried.setdefault(h, [])
            union += [x for x in idents if x not in union]
            if len(union) > self.bound:
                return self.skip(medium, SKIP_MALFORMED, 1)

    def check(self, idx):
        for medium in ("GPU", "CPU"):
            assert idx.counts(medium) == {h: n for h, n in self.held.get(medium, {}).items()}
            known = medium not in self.unknown
            assert idx.identifiers_known(medium) == known
            carried = {h: tuple(x) for h, x in self.carried.get(medium, {}).items()}
            assert idx.carriers(medium) == (carried if known else None)
            expected: dict[str, int] = {}
            for idents in carried.values():
                for x in idents:
                    expected[x] = expected.get(x, 0) + 1
            assert idx.identifiers(medium) == (expected if known else {})
            for x in "abcdef":
                assert idx.may_hold(x, medium) == (not known or x in expected)
        assert idx.identifier_skips() == self.skips


@settings(max_examples=300, deadline=None)
@given(
    batches=st.lists(st.lists(kv_events(), max_size=6), max_size=8),
    bound=st.sampled_from([MAX_EXTRA_KEYS_PER_BLOCK, 3, 1]),
    sliced=st.booleans(),
)
def test_batches_match_a_reference_model_in_any_slices(batches, bound, sliced):
    """Whatever the extra keys (vLLM's, unions of stores, junk, long identifiers, over the
    block's bound) and however `apply` slices a batch (here down to a block a slice), the
    hashes, identifiers, carriers, skips and `may_hold` are the reference's after each batch."""
    kw = {} if bound == MAX_EXTRA_KEYS_PER_BLOCK else {"max_identifiers_per_block": bound}
    idx = RemoteKVIndex(track_identifiers=True, **kw)
    model = ReferenceIndex(bound)
    with mock.patch.object(index_module, "SLICE_WORK", 1 if sliced else index_module.SLICE_WORK):
        for events in batches:
            idx.apply(KVEventBatch(ts=0.0, events=events))
            model.apply(events)
            model.check(idx)
