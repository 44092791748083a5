"""mmreuse._table / mmreuse._index: the C hash tables, against a dict model and bad arguments."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from mmreuse import _index
from mmreuse._table import HashTable
from mmreuse.errors import InvalidArgument, InvalidArgumentType


def arrays(cap=64):
    return np.zeros(cap, dtype=np.uint64), np.full(cap, -1, dtype=np.int64)


@given(
    st.lists(
        st.tuples(
            st.sampled_from(["put", "del", "add"]), st.lists(st.integers(0, 40), max_size=12)
        ),
        max_size=40,
    )
)
def test_table_matches_a_dict(ops):
    t, put, counts = HashTable(), HashTable(), {}
    model = {}
    for op, keys in ops:
        if op == "put":
            put.put_many(keys, [k * 10 for k in keys])
            model.update({k: k * 10 for k in keys})
        elif op == "del":
            put.delete_many(keys)
            for k in keys:
                model.pop(k, None)
        else:
            t.add(keys, 1)
            for k in keys:
                counts[k] = counts.get(k, 0) + 1
        assert put.live == len(model) and t.live == len(counts)
    for k in range(41):
        assert put.get(k) == model.get(k) and t.get(k) == counts.get(k)
    for k in list(counts):
        t.add([k] * counts[k], -1)
    assert t.live == 0 and all(t.get(k) is None for k in range(41))


def test_growth_keeps_every_entry():
    t = HashTable()
    keys = list(range(0, 10_000, 3))
    t.put_many(keys, list(range(len(keys))))
    t.delete_many(keys[::2])
    t.put_many([1, 2], [7, 8])
    assert t.live == len(keys) - len(keys[::2]) + 2 and t.keys.size >= 2 * t.used
    assert t.get(keys[1]) == 1 and t.get(keys[0]) is None and t.get(2) == 8


def test_prefix_validates_every_hash_after_a_miss():
    t = HashTable()
    t.put_many([1, 2], [10, 20])
    n, out = t.prefix([1, 2, 3, 1])
    assert n == 2 and out[:2].tolist() == [10, 20]
    with pytest.raises(InvalidArgumentType, match=r"block_hashes\[1\]"):
        t.prefix([99, "x", 1])
    with pytest.raises(InvalidArgument, match=r"block_hashes\[3\]"):
        t.prefix([1, 7, 2, -1])


def test_add_is_all_or_nothing():
    t = HashTable()
    with pytest.raises(InvalidArgument, match=r"block_hashes\[2\] must be a block hash of >= 8"):
        t.add([1, 2, b"short"], 1)
    assert t.live == 0 and t.get(1) is None


IDX = _index
E, T = InvalidArgument, InvalidArgumentType
I64, I32 = np.int64, np.int32


@pytest.mark.parametrize(
    "call,cls,match",
    [
        (lambda k, v: IDX.table_put_many(k, v, [1, 2], [1]), E, "val_list has 1 values for 2 keys"),
        (lambda k, v: IDX.table_put_many(k, v, [1], [-1]), E, r"val_list\[0\] must be in \[0, "),
        (lambda k, v: IDX.table_put_many(k, v, [1], [True]), T, r"val_list\[0\] must be an int"),
        (lambda k, v: IDX.table_put_many(k, v, [-1], [1]), E, r"key_list\[0\] must be an event id"),
        (lambda k, v: IDX.table_put_many(k, v, {1}, [1]), T, "key_list must be a list or tuple"),
        (lambda k, v: IDX.table_del_many(k, v, [2**64]), E, r"key_list\[0\]"),
        (lambda k, v: IDX.table_add(k, v, [1], 2**40), E, "delta must be in"),
        (lambda k, v: IDX.table_add(k, v, [1], 1.0), T, "delta must be an int"),
        (lambda k, v: IDX.table_add(k, v, "ab", 1), T, "block_hashes must be a list or tuple"),
        (lambda k, v: IDX.table_get(k, v, -3), E, "block_hash must be an event id"),
        (lambda k, v: IDX.chain_prefix(k, v, [1, 2], np.empty(1, I64)), E, "out has 1 slots for 2"),
        (lambda k, v: IDX.chain_prefix(k, v, [1], np.empty(4, I32)), T, "out must be"),
        (lambda k, v: IDX.chain_prefix(k, v, [1], np.empty(4, I64)[::2]), T, "out must be"),
        (lambda k, v: IDX.table_get(v, v, 1), T, "keys must be a writable contiguous uint64"),
        (lambda k, v: IDX.table_get(k, b"x" * 512, 1), T, "vals must be"),
        (lambda k, v: IDX.table_get(k[:3], v[:3], 1), E, "power-of-two length"),
        (lambda k, v: IDX.table_get(k, v[:32], 1), E, "power-of-two length, got 64 and 32"),
        (lambda k, v: IDX.table_get(k, v), T, "table_get takes 3 arguments, got 2"),
        (lambda k, v: IDX.table_rehash(k, v, k), T, "table_rehash takes 4 arguments, got 3"),
    ],
)
def test_bad_arguments_raise_mmreuse_errors(call, cls, match):
    k, v = arrays()
    with pytest.raises(cls, match=match):
        call(k, v)
    assert (v == -1).all()  # nothing written


def test_rehash_refuses_a_target_without_room():
    k, v = arrays(64)
    _index.table_put_many(k, v, list(range(40)), list(range(40)))
    small_k, small_v = arrays(32)
    with pytest.raises(InvalidArgument, match="new_vals has no empty slot left after 32"):
        _index.table_rehash(k, v, small_k, small_v)
    used_k, used_v = arrays(64)
    used_v[:] = 0  # not fresh: no empty slot at all
    with pytest.raises(InvalidArgument, match="no empty slot left after 0 entries"):
        _index.table_rehash(k, v, used_k, used_v)
    big_k, big_v = arrays(128)
    assert _index.table_rehash(k, v, big_k, big_v) == 40
    assert [_index.table_get(big_k, big_v, i) for i in range(41)] == [*range(40), None]


def test_a_full_table_raises_instead_of_looping():
    k, v = arrays(64)
    _index.table_put_many(k, v, list(range(64)), [0] * 64)
    with pytest.raises(RuntimeError, match="full"):
        _index.table_put_many(k, v, [100], [1])
    assert _index.table_get(k, v, 100) is None and _index.table_get(k, v, 63) == 0
