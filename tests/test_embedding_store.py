"""mmreuse.embedding_store: vLLM's key and object format for embeddings in the Mooncake Store,
and calls into a store that stalls, fails or answers junk, each bounded in time."""

from __future__ import annotations

import struct
import threading
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mmreuse.embedding_store import (
    HEADER,
    MAGIC,
    StoreCalls,
    StoreObjectError,
    embedding_key,
    pack_embedding,
    unpack_embedding,
)
from mmreuse.errors import InvalidArgument


def test_key_is_vllms():
    # vLLM's make_embedding_key: f"{namespace}@id:{identifier}"
    assert embedding_key("embedding@model:m@protocol:v3", "abc") == (
        "embedding@model:m@protocol:v3@id:abc"
    )
    with pytest.raises(InvalidArgument, match="identifier"):
        embedding_key("ns", "")


@pytest.mark.parametrize(("dtype", "code"), [("float32", 0), ("float16", 11), ("bfloat16", 12)])
def test_header_is_vllms(dtype, code):
    torch = pytest.importorskip("torch")  # the library's torch-free tier runs the rest
    t = torch.arange(12, dtype=getattr(torch, dtype)).view(3, 4)
    raw = t.view(torch.uint8).numpy().tobytes()
    data = pack_embedding(dtype, 3, 4, raw)
    assert data[: HEADER.size] == struct.pack("<IIQQ", 0x4D4F4F4E, code, 3, 4)
    back = unpack_embedding(data, tokens=3)
    assert (back.dtype, back.tokens, back.hidden, back.payload) == (dtype, 3, 4, raw)
    again = torch.frombuffer(bytearray(back.payload), dtype=t.dtype).view(3, 4)
    assert torch.equal(again, t)


@given(st.binary(max_size=64))
def test_junk_is_refused_by_name(data):
    try:
        unpack_embedding(data)
    except StoreObjectError:
        return
    # the only bytes that decode are a well-formed object
    magic, _, n, h = HEADER.unpack_from(data)
    assert magic == MAGIC and len(data) == HEADER.size + n * h * 2


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (b"", "shorter than its header"),
        (HEADER.pack(1, 12, 1, 1) + b"xx", "magic"),
        (HEADER.pack(MAGIC, 7, 1, 1) + b"xx", "dtype code 7"),
        (HEADER.pack(MAGIC, 12, 0, 4), "empty"),
        (HEADER.pack(MAGIC, 12, 2, 2) + b"x" * 7, "its header says 32"),
        (HEADER.pack(MAGIC, 12, 3, 1) + b"x" * 6, "3 tokens, the request expects 2"),
    ],
)
def test_each_bad_object_says_why(data, match):
    with pytest.raises(StoreObjectError, match=match):
        unpack_embedding(data, tokens=2)


@pytest.mark.parametrize(
    ("expect", "match"),
    [
        ({"tokens": 2, "hidden": 4, "dtype": "bfloat16"}, "object has 3 tokens"),  # the guard
        ({"tokens": 3, "hidden": 8, "dtype": "bfloat16"}, "hidden size is 4, the model expects 8"),
        ({"tokens": 3, "hidden": 4, "dtype": "float16"}, "dtype is bfloat16, the model expects"),
    ],
)
def test_an_object_of_another_shape_or_dtype_is_refused(expect, match):
    # vLLM's _validate_mooncake_tensor_metadata: dtype and (num_tokens, hidden_dim) both
    data = pack_embedding("bfloat16", 3, 4, b"x" * 24)
    with pytest.raises(StoreObjectError, match=match):
        unpack_embedding(data, **expect)
    assert unpack_embedding(data, tokens=3, hidden=4, dtype="bfloat16").hidden == 4


def test_pack_checks_its_input():
    with pytest.raises(InvalidArgument, match="dtype"):
        pack_embedding("int8", 1, 1, b"x")
    with pytest.raises(InvalidArgument, match="payload must be 8 bytes"):
        pack_embedding("bfloat16", 2, 2, b"x" * 7)


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_a_stalled_store_is_a_bounded_miss_then_left_alone():
    release = threading.Event()
    clock = Clock()
    calls = StoreCalls(lambda: "client", timeout=0.05, backoff=5.0, clock=clock)
    t0 = time.monotonic()
    assert calls.call("is_exist", lambda c: release.wait(), "miss") == "miss"
    assert time.monotonic() - t0 < 2.0
    assert calls.misses["timeout"] == 1 and "is_exist: no answer" in calls.last_error
    # still stuck: an answer at once, not a second stuck thread
    clock.now = 10.0
    assert calls.call("is_exist", lambda c: 1, "miss") == "miss"
    assert calls.misses["busy"] == 1
    release.set()
    time.sleep(0.05)
    clock.now = 2.0  # within the backoff (from the timeout at 0.0)
    assert calls.call("is_exist", lambda c: 1, "miss") == "miss"
    assert calls.misses["backing_off"] == 1
    clock.now = 10.0
    assert calls.call("is_exist", lambda c: 1, "miss") == 1
    calls.close()


def test_a_failing_connect_is_retried_after_the_backoff():
    clock = Clock()
    tries = []

    def connect():
        tries.append(clock.now)
        if len(tries) == 1:
            raise ConnectionError("master down")
        return {"k": 1}

    calls = StoreCalls(connect, timeout=1.0, backoff=3.0, clock=clock)
    assert calls.call("get", lambda c: c["k"], 0) == 0
    assert calls.misses["error"] == 1 and "master down" in calls.last_error
    clock.now = 1.0
    assert calls.call("get", lambda c: c["k"], 0) == 0 and tries == [0.0]
    clock.now = 4.0
    assert calls.call("get", lambda c: c["k"], 0) == 1 and calls.connected
    calls.close()


def test_warm_connects_without_waiting():
    started = threading.Event()
    calls = StoreCalls(lambda: started.set() or "c", timeout=1.0)
    calls.warm()
    assert started.wait(2.0)
    assert calls.call("x", lambda c: c, None) == "c"
    calls.close()


def test_settings_are_checked():
    with pytest.raises(InvalidArgument, match="timeout"):
        StoreCalls(lambda: None, timeout=0)
