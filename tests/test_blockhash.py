"""mmreuse.blockhash: the one bytes/int -> event id rule, and the C tables applying the same one."""

import hashlib

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

pytest.importorskip("torch")  # mmreuse.residency (BlockIndex) needs it

from mmreuse import _index
from mmreuse._table import HashTable
from mmreuse.blockhash import MIN_DIGEST_BYTES, check_block_hashes, to_event_id, to_event_ids
from mmreuse.errors import InvalidArgument, InvalidArgumentType
from mmreuse.events import RemoteKVIndex
from mmreuse.residency import BlockIndex
from tests.support.kv_publisher import batch, stored

IN_RANGE = r"an event id in \[0, 2\*\*64\)"


# ---- to_event_id / to_event_ids ------------------------------------------------------------


def test_bytes_give_their_low_64_bits_big_endian():
    d = hashlib.sha256(b"x").digest()
    assert to_event_id(d) == int.from_bytes(d[-8:], "big")
    assert to_event_id(bytearray(d)) == to_event_id(d)
    assert to_event_id(bytes(range(8))) == 0x0001020304050607
    assert MIN_DIGEST_BYTES == 8


@pytest.mark.parametrize("value", [0, 1, 2**63, 2**64 - 1])
def test_ints_in_range_are_event_ids_as_they_are(value):
    assert to_event_id(value) == value and type(to_event_id(value)) is int


@pytest.mark.parametrize(
    "bad,cls,msg",
    [
        (-1, InvalidArgument, r"block_hash must be an event id in \[0, 2\*\*64\), got -1"),
        (
            2**64,
            InvalidArgument,
            r"block_hash must be an event id in .*, got 18446744073709551616$",
        ),
        (
            b"1234567",
            InvalidArgument,
            r"block_hash must be a block hash of >= 8 bytes, got b'1234567'",
        ),
        (bytearray(), InvalidArgument, r">= 8 bytes, got bytearray\(b''\)"),
        (True, InvalidArgumentType, r"block_hash must be a block hash \(bytes\) .*, got bool True"),
        ("ab" * 8, InvalidArgumentType, r"got str 'abab"),
        (1.0, InvalidArgumentType, r"got float 1.0"),
        (None, InvalidArgumentType, r"got NoneType None"),
        (np.uint64(3), InvalidArgumentType, r"got uint64"),
    ],
)
def test_to_event_id_refuses(bad, cls, msg):
    with pytest.raises(cls, match=msg) as info:
        to_event_id(bad)
    assert type(info.value) is cls


def test_to_event_ids_names_the_refused_index():
    assert to_event_ids([b"\x00" * 7 + b"\x05", 7]) == [5, 7]
    assert to_event_ids(x for x in [1, 2]) == [1, 2]
    with pytest.raises(InvalidArgument, match=rf"^block_hashes\[3\] must be {IN_RANGE}, got -5$"):
        to_event_ids([1, 2, 3, -5])
    with pytest.raises(InvalidArgumentType, match=r"hs\[1\]"):
        to_event_ids([1, "x"], field="hs")
    for bad in (b"12345678", "abc", 5, None):
        with pytest.raises(InvalidArgumentType, match="block_hashes must be a sequence"):
            to_event_ids(bad)


def test_check_block_hashes_refuses_like_to_event_ids():
    assert check_block_hashes([b"\x00" * 7 + b"\x05", 7]) is None
    assert check_block_hashes((1, 2**64 - 1)) is None
    with pytest.raises(InvalidArgument, match=rf"^block_hashes\[3\] must be {IN_RANGE}, got -5$"):
        check_block_hashes((1, 2, 3, -5))
    with pytest.raises(InvalidArgumentType, match=r"^hs\[1\] must be a block hash"):
        check_block_hashes([1, "x"], field="hs")
    with pytest.raises(InvalidArgumentType, match=r"^field must be a str"):
        _index.check_event_ids([1], 5)
    with pytest.raises(TypeError, match=r"takes 1 or 2 arguments \(0 given\)"):
        _index.check_event_ids()
    for bad in (b"12345678", "abc", 5, None):
        with pytest.raises(InvalidArgumentType, match="block_hashes must be a sequence"):
            check_block_hashes(bad)


# ---- Python and C agree: same key, or the same refusal -------------------------------------


def _python(h):
    try:
        return ("ok", to_event_id(h))
    except Exception as exc:
        return (type(exc), str(exc))


def _c(fn, h):
    try:
        return ("ok", fn(h))
    except Exception as exc:
        return (type(exc), str(exc))


def _one_entry_table(key):
    t = HashTable()
    t.put_many([key], [42])
    return t


HASHES = st.one_of(
    st.integers(),  # negative and huge included
    st.integers(-(2**70), 2**70),
    st.sampled_from([0, 2**64 - 1, 2**64, -1, -(2**63), 2**63, True, False]),
    st.binary(min_size=0, max_size=40),
    st.binary(min_size=0, max_size=40).map(bytearray),
    st.none(),
    st.floats(allow_nan=False),
    st.text(max_size=10),
)


@given(HASHES)
def test_c_event_id_matches_python(h):
    assert _c(_index.event_id, h) == _python(h)


@given(HASHES)
def test_c_tables_key_like_python(h):
    """get and prefix of a one-entry table holding to_event_id(h) find it, or refuse like Python."""
    py = _python(h)
    table = _one_entry_table(py[1] if py[0] == "ok" else 12345)
    got = _c(table.get, h)
    assert got == (py if py[0] != "ok" else ("ok", 42))
    prefix = _c(lambda x: table.prefix([x])[0], h)
    if py[0] == "ok":
        assert prefix == ("ok", 1)
    else:  # the sequence form names the index
        assert prefix == (py[0], py[1].replace("block_hash ", "block_hashes[0] ", 1))


def test_c_messages_read_like_python():
    with pytest.raises(InvalidArgument, match=rf"^block_hashes\[3\] must be {IN_RANGE}, got -5$"):
        HashTable().prefix([1, 2, 3, -5])
    with pytest.raises(
        InvalidArgumentType,
        match=r"^block_hashes\[1\] must be a block hash "
        r"\(bytes\) or a 64-bit int event id, got str 'x'$",
    ):
        HashTable().add([1, "x"], 1)
    long_repr = b"\x00" * 3 + b"y" * 100
    with pytest.raises(InvalidArgumentType) as c_err:
        _index.event_id([long_repr])
    with pytest.raises(InvalidArgumentType) as py_err:
        to_event_id([long_repr])
    assert str(c_err.value) == str(py_err.value) and str(c_err.value).endswith("...")


# ---- the negative-int disagreement, fixed --------------------------------------------------


def test_negative_ids_are_refused_by_block_index_everywhere():
    idx = BlockIndex(8)
    idx.store(2**64 - 5, 1)
    with pytest.raises(InvalidArgument, match=r"block_hashes\[0\] must be an event id"):
        idx.lookup_prefix([-5])  # was 1: the C table wrapped -5 to 2**64 - 5
    with pytest.raises(InvalidArgument, match="event id"):
        idx.store(-5, 0)
    with pytest.raises(InvalidArgument, match="event id"):
        idx.block_id(-5)
    with pytest.raises(InvalidArgument, match="event id"):
        idx.match_prefix([2**64 - 5, -5])
    assert idx.lookup_prefix([2**64 - 5])[0] == 1


def test_negative_ids_are_refused_by_remote_index_everywhere():
    idx = RemoteKVIndex()
    idx.apply(batch(stored([2**64 - 5])))
    with pytest.raises(InvalidArgument, match=r"block_hashes\[0\] must be an event id"):
        idx.longest_prefix([-5])
    with pytest.raises(InvalidArgument, match="event id"):
        idx.contains(-5)
    with pytest.raises(InvalidArgument, match="event id"):
        idx.apply(batch(stored([-5])))
    assert idx.size() == 1 and idx.longest_prefix([2**64 - 5]) == 1


@given(st.lists(HASHES, max_size=6), st.sampled_from([list, tuple]))
def test_c_event_ids_match_python_one_by_one(hashes, kind):
    """to_event_ids (one C call for a list or tuple) = to_event_id of each, or the first refusal
    with its index, exactly as the generic Python loop reports it."""
    expected: object = ("ok", [])
    out = []
    for i, h in enumerate(hashes):
        one = _python(h)
        if one[0] != "ok":
            expected = (one[0], one[1].replace("block_hash ", f"block_hashes[{i}] ", 1))
            break
        out.append(one[1])
    else:
        expected = ("ok", out)
    assert _c(lambda x: to_event_ids(kind(x)), hashes) == expected
    assert _c(lambda x: to_event_ids(iter(x)), hashes) == expected  # the generic path
    # check_block_hashes: the same refusal (C for a list or tuple, Python otherwise), no ids
    checked = ("ok", None) if expected[0] == "ok" else expected
    assert _c(lambda x: check_block_hashes(kind(x)), hashes) == checked
    assert _c(lambda x: check_block_hashes(iter(x)), hashes) == checked
