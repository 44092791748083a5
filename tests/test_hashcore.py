"""mmreuse._hashcore: the HashSpec / RequestKeys objects, the exported tables, their checks;
token ids from a list or, in place, from an int32 / int64 buffer (vLLM 0.34's TokenBuffer)."""

import array
import random

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from mmreuse import BlockHasher, MMOccurrence
from mmreuse.errors import InvalidArgument, InvalidArgumentType
from mmreuse.hashing import SCHEMES
from mmreuse.hashing import hasher as hasher_module
from mmreuse.hashing.functions import HASH_FUNCTIONS

_hashcore = pytest.importorskip("mmreuse._hashcore")

NONE = b"\x01" * 32


def make_spec(**kw):
    args = dict(
        hash_fn="sha256",
        block_size=4,
        lookahead=0,
        none_hash=NONE,
        mm_key="tagged",
        mm_bounds="exclusive",
        lora_key="tagged",
        salt_key="tagged",
        embeds_key="tagged",
        incremental_mm="window",
        allow_any_token_id=False,
    )
    args.update(kw)
    return _hashcore.HashSpec(**args)


# ---- the tables: C's names are the Python API's names ------------------------------------------


def test_hash_function_table_is_the_python_one():
    assert _hashcore.HASH_FUNCTIONS == HASH_FUNCTIONS


@pytest.mark.parametrize("scheme", list(SCHEMES.values()), ids=list(SCHEMES))
def test_every_scheme_field_is_in_the_c_tables(scheme):
    assert scheme.mm_key in _hashcore.MM_KEYS
    assert scheme.mm_bounds in _hashcore.MM_BOUNDS
    assert scheme.lora_key in _hashcore.LORA_KEYS
    assert scheme.salt_key in _hashcore.SALT_KEYS
    assert scheme.embeds_key is None or scheme.embeds_key in _hashcore.EMBEDS_KEYS
    assert scheme.incremental_mm in _hashcore.INCREMENTAL_MM
    assert set(scheme.hash_fns) <= set(_hashcore.HASH_FUNCTIONS)


def test_python_defines_no_ids_of_its_own():
    for name in (
        "_FN_ID",
        "_MM_KEY_ID",
        "_LORA_KEY_ID",
        "_scheme_flags",
        "_identity_key",
        "_FAST_MAX_BLOCK_TOKENS",
    ):
        assert not hasattr(hasher_module, name), name


def test_limits_and_build_flags_are_exported():
    assert _hashcore.MAX_BLOCK_TOKENS >= 16 and _hashcore.MAX_LOOKAHEAD >= 1
    assert _hashcore.MAX_KEY_BYTES >= 1024
    assert isinstance(_hashcore.DEBUG_BUILD, bool)
    assert isinstance(_hashcore.simd_available(), bool)


# ---- HashSpec ----------------------------------------------------------------------------------


def test_spec_reads_back_what_it_was_built_with():
    s = make_spec(
        hash_fn="xxhash_cbor",
        block_size=16,
        lookahead=2,
        mm_key="pair",
        mm_bounds="inclusive",
        lora_key="int_id",
        salt_key="bare",
        embeds_key=None,
        incremental_mm="last",
        allow_any_token_id=True,
    )
    assert (s.hash_fn, s.block_size, s.lookahead, s.none_hash) == ("xxhash_cbor", 16, 2, NONE)
    assert (s.mm_key, s.mm_bounds, s.lora_key, s.salt_key, s.embeds_key, s.incremental_mm) == (
        "pair",
        "inclusive",
        "int_id",
        "bare",
        None,
        "last",
    )
    assert s.allow_any_token_id is True


def test_block_hasher_builds_one_spec_from_its_scheme():
    h = BlockHasher("sha256_cbor", 8, seed="0", scheme="vllm-0.18")
    scheme = SCHEMES["vllm-0.18"]
    assert h._spec.hash_fn == "sha256_cbor" and h._spec.block_size == 8
    assert h._spec.none_hash == h.none_hash
    assert (h._spec.mm_key, h._spec.mm_bounds, h._spec.lora_key) == (
        scheme.mm_key,
        scheme.mm_bounds,
        scheme.lora_key,
    )


@pytest.mark.parametrize(
    "kw,match,error",
    [
        ({"block_size": 0}, "block_size", InvalidArgument),
        ({"block_size": 4097}, "block_size", InvalidArgument),
        ({"block_size": True}, "block_size", InvalidArgumentType),
        ({"block_size": 4.0}, "block_size", InvalidArgumentType),
        ({"lookahead": -1}, "lookahead", InvalidArgument),
        ({"lookahead": 2**70}, "lookahead", InvalidArgument),
        ({"none_hash": b""}, "none_hash", InvalidArgument),
        ({"none_hash": b"x" * 65}, "none_hash", InvalidArgument),
        ({"none_hash": "abc"}, "none_hash", InvalidArgumentType),
        ({"hash_fn": "md5"}, "hash_fn", InvalidArgument),
        ({"mm_key": "pairs"}, "mm_key", InvalidArgument),
        ({"mm_key": None}, "mm_key", InvalidArgumentType),
        ({"embeds_key": "cooked"}, "embeds_key", InvalidArgument),
        ({"incremental_mm": 1}, "incremental_mm", InvalidArgumentType),
        ({"allow_any_token_id": 1}, "allow_any_token_id", InvalidArgumentType),
    ],
)
def test_spec_refuses_bad_fields(kw, match, error):
    with pytest.raises(error, match=match):
        make_spec(**kw)


def test_spec_requires_every_key_shape():
    with pytest.raises(TypeError, match="lora_key"):
        _hashcore.HashSpec(
            "sha256",
            4,
            0,
            NONE,
            mm_key="tagged",
            mm_bounds="exclusive",
            salt_key="tagged",
            embeds_key="tagged",
            incremental_mm="window",
            allow_any_token_id=False,
        )


def test_request_keys_are_not_built_directly():
    with pytest.raises(TypeError):
        _hashcore.RequestKeys()


# ---- HashSpec.request --------------------------------------------------------------------------


def test_request_keys_hash_like_the_reference():
    h = BlockHasher("sha256", 4, seed="0")
    mm = [MMOccurrence("img", 2, 7), MMOccurrence("b", 12, 3)]
    keys = h._spec.request(mm, ("L", "/p"), "salt")
    assert keys.num_mm == 2 and keys.spec is h._spec
    tokens = list(range(30))
    ref = BlockHasher("sha256", 4, seed="0", use_fast_path=False).hash_prompt(
        tokens, mm=mm, lora_name="L", lora_path="/p", cache_salt="salt"
    )
    assert keys.hash_blocks(tokens) == ref


@pytest.mark.parametrize(
    "mm,match",
    [
        ([MMOccurrence("a", 4, 4), MMOccurrence("b", 2, 1)], r"mm\[1\] offset 2"),
        ([object()], r"mm\[0\]"),
        (5, "mm must be a sequence"),
    ],
)
def test_request_refuses_bad_occurrences(mm, match):
    with pytest.raises(InvalidArgument, match=match):
        make_spec().request(mm, None, None)


def test_request_checks_occurrence_fields_it_reads():
    class Fake:
        identifier, offset, length = "x", 3, 0

    with pytest.raises(InvalidArgument, match=r"mm\[0\]\.length"):
        make_spec().request([Fake()], None, None)
    Fake.length, Fake.identifier = 1, b"x"
    with pytest.raises(InvalidArgumentType, match=r"mm\[0\]\.identifier"):
        make_spec().request([Fake()], None, None)


@pytest.mark.parametrize(
    "spec_kw,lora,salt,match",
    [
        ({}, "L", None, "lora"),
        ({}, ("L", 5), None, "lora"),
        ({"lora_key": "int_id"}, 0, None, "lora"),
        ({"lora_key": "int_id"}, ("L", "/p"), None, "lora"),
        ({}, None, 5, "salt"),
    ],
)
def test_request_refuses_bad_lora_and_salt(spec_kw, lora, salt, match):
    with pytest.raises(InvalidArgument, match=match):
        make_spec(**spec_kw).request([], lora, salt)


def test_request_leaves_what_one_frame_cannot_hold_to_the_reference():
    spec = make_spec()
    assert spec.request([MMOccurrence("\ud800", 0, 1)], None, None) is None  # lone surrogate
    big = "x" * (_hashcore.MAX_KEY_BYTES + 1)
    assert spec.request([MMOccurrence(big, 0, 1)], None, None) is None
    assert spec.request([], None, big) is None


def test_empty_salt_is_no_key():
    spec = make_spec()
    tokens = list(range(8))
    assert (
        spec.request([], None, "").hash_blocks(tokens)
        == spec.request([], None, None).hash_blocks(tokens)
        != spec.request([], None, "s").hash_blocks(tokens)
    )


# ---- RequestKeys.hash_blocks -------------------------------------------------------------------


def test_hash_blocks_continues_after_prior():
    keys = make_spec().request([MMOccurrence("img", 3, 9)], None, "s")
    tokens = list(range(21))
    full = keys.hash_blocks(tokens)
    assert len(full) == 5
    assert keys.hash_blocks(tokens, full[:2]) == full[2:]
    assert keys.hash_blocks(tokens, full) == []
    assert keys.hash_blocks(tokens, [], 0, None) == full


@pytest.mark.parametrize(
    "args,match,error",
    [
        (
            ((1, 2, 3, 4),),
            "tokens must be a list of int token ids or.*got tuple$",
            InvalidArgumentType,
        ),
        (([1] * 8, [b"x" * 32] * 3), "prior has 3", InvalidArgument),
        (([1] * 8, (b"x" * 32,)), "prior must be a list", InvalidArgumentType),
        (([1] * 8, ["x" * 32]), r"prior\[-1\]", InvalidArgumentType),
        (([1] * 8, [b""]), r"prior\[-1\]", InvalidArgument),
        (([1] * 8, None, 9), "validate_from", InvalidArgument),
        (([1] * 8, None, -1), "validate_from", InvalidArgument),
        (([1] * 8, None, 0, [b"d" * 32]), "embeds", InvalidArgumentType),
        (([1] * 8, None, 0, [b"d" * 32, b"d"]), r"embeds\[1\]", InvalidArgumentType),
    ],
)
def test_hash_blocks_refuses_bad_arguments(args, match, error):
    keys = make_spec().request([], None, None)
    with pytest.raises(error, match=match):
        keys.hash_blocks(*args)


@pytest.mark.parametrize("embeds_key", ["raw", None])
def test_hash_blocks_refuses_digests_the_scheme_does_not_hash(embeds_key):
    keys = make_spec(embeds_key=embeds_key).request([], None, None)
    with pytest.raises(InvalidArgument, match="embeds_key"):
        keys.hash_blocks([1] * 4, None, 0, [b"d" * 32])


def test_hash_blocks_argument_count():
    keys = make_spec().request([], None, None)
    with pytest.raises(TypeError):
        keys.hash_blocks()
    with pytest.raises(TypeError):
        keys.hash_blocks([1] * 4, None, 0, None, None)


# ---- token ids from a buffer: int32 / int64, read in place ---------------------------------------


class TokenBuffer(array.array):
    """vLLM 0.34's TokenBuffer as far as hash_blocks sees it: an array('i') subclass."""

    __slots__ = ()

    def __new__(cls, tokens=()):
        return super().__new__(cls, "i", tokens)


INT32 = {
    "array i": lambda t: array.array("i", t),
    "TokenBuffer": TokenBuffer,
    "numpy int32": lambda t: np.array(t, dtype=np.int32),
    "memoryview int32": lambda t: memoryview(np.array(t, dtype=np.int32)),
    "numpy <i4": lambda t: np.array(t, dtype="<i4"),
}
INT64 = {
    "array q": lambda t: array.array("q", t),
    "array l": lambda t: array.array("l", t),
    "numpy int64": lambda t: np.array(t, dtype=np.int64),
    "memoryview int64": lambda t: memoryview(array.array("q", t)),
    "numpy int64 slice": lambda t: np.array([7, *t, 7], dtype=np.int64)[1:-1],  # contiguous
}


@st.composite
def buffer_cases(draw):
    """A spec, a request's keys, tokens (in int32 or int64's range, negative ones where the
    spec allows any id), a prior prefix of the chain and a validate_from."""
    allow_any = draw(st.booleans())
    wide = draw(st.booleans())
    lo = (-(2**63) if wide else -(2**31)) if allow_any else 0
    hi = 2**63 - 1 if wide else 2**31 - 1
    bs = draw(st.integers(1, 20))
    la = draw(st.integers(0, 3))
    fn = draw(st.sampled_from(list(_hashcore.HASH_FUNCTIONS)))
    spec = make_spec(
        hash_fn=fn,
        block_size=bs,
        lookahead=la,
        allow_any_token_id=allow_any,
        mm_key=draw(st.sampled_from(list(_hashcore.MM_KEYS))),
        mm_bounds=draw(st.sampled_from(list(_hashcore.MM_BOUNDS))),
        incremental_mm=draw(st.sampled_from(list(_hashcore.INCREMENTAL_MM))),
    )
    n = draw(st.integers(0, 300))
    rng = random.Random(draw(st.integers(0, 2**32)))
    edges = [lo, hi, 0, 1, 255, 256, 65535, 65536, 2**31 - 1, -1, -(2**31), 2**32]
    edges = [e for e in edges if lo <= e <= hi]
    tokens = [
        rng.choice(edges) if rng.random() < 0.1 else rng.randrange(max(lo, -1000), 152_000)
        for _ in range(n)
    ]
    mm, pos = [], 0
    for i in range(draw(st.integers(0, 5))):
        pos += draw(st.sampled_from([0, 1, 3, 17]))
        length = draw(st.sampled_from([1, 2, 5, 16, 33]))
        if pos + length > n:
            break
        mm.append(MMOccurrence(f"img-{i % 3}", pos, length))
        pos += length
    lora = ("L", "/p") if draw(st.booleans()) else None
    salt = draw(st.sampled_from([None, "", "s", "tenant-ü"]))
    keys = spec.request(mm, lora, salt)
    full = keys.hash_blocks(list(tokens))
    nprior = draw(st.integers(0, len(full)))
    validate_from = draw(st.integers(0, n))
    return keys, tokens, full, nprior, validate_from, wide


@given(buffer_cases())
def test_a_buffer_hashes_exactly_as_the_list(case):
    keys, tokens, full, nprior, validate_from, wide = case
    prior = full[:nprior]
    want = keys.hash_blocks(list(tokens), prior, validate_from)  # ("last": not full[nprior:])
    makers = INT64 if wide else {**INT32, **INT64}
    for name, make in makers.items():
        buf = make(tokens)
        assert keys.hash_blocks(buf) == full, name
        assert keys.hash_blocks(buf, prior, validate_from) == want, name


@pytest.mark.parametrize(
    "name,make", list({**INT32, **INT64}.items()), ids=list({**INT32, **INT64})
)
@pytest.mark.parametrize("bs", [1, 16, 4096])
def test_a_long_buffer_hashes_as_the_list_across_chunks(name, make, bs):
    """More tokens than one read chunk (2,048), with negative ids far into it (allowed)."""
    rng = random.Random(bs)
    tokens = [rng.randrange(0, 152_000) for _ in range(9000)]
    for i in (5, 2047, 2048, 4100, 8999):
        tokens[i] = -i
    spec = make_spec(block_size=bs, lookahead=2, allow_any_token_id=True)
    keys = spec.request([MMOccurrence("img", 100, 3000)], None, "s")
    full = keys.hash_blocks(tokens)
    assert len(full) == (9000 - 2) // bs
    assert keys.hash_blocks(make(tokens)) == full
    assert keys.hash_blocks(make(tokens), full[:1], bs) == full[1:]


@pytest.mark.parametrize(
    "tokens,shown",
    [
        (np.zeros(8, dtype=np.float32), "numpy.ndarray of format 'f'"),
        (np.zeros(8, dtype=np.float64), "numpy.ndarray of format 'd'"),
        (np.zeros(8, dtype=np.uint8), "numpy.ndarray of format 'B'"),
        (np.zeros(8, dtype=np.uint32), "numpy.ndarray of format 'I'"),
        (np.zeros(8, dtype=np.int16), "numpy.ndarray of format 'h'"),
        (np.zeros(8, dtype=">i4"), "numpy.ndarray of format '>i'"),
        (np.zeros(8, dtype=np.bool_), "numpy.ndarray of format '?'"),
        (array.array("I", [0] * 8), "array.array of format 'I'"),
        (array.array("d", [0] * 8), "array.array of format 'd'"),
        (bytearray(8), "bytearray of format 'B'"),
        (b"abcdefgh", "bytes of format 'B'"),
        (np.zeros((2, 4), dtype=np.int32), r"numpy.ndarray of format 'i' \(itemsize 4, ndim 2\)"),
        (np.int64(3), r"numpy.int64 of format 'l' \(itemsize 8, ndim 0\)"),
        (np.zeros(16, dtype=np.int32)[::2], "numpy.ndarray of format 'i' .*not C-contiguous"),
        (
            memoryview(array.array("q", [0] * 16))[::2],
            "memoryview of format 'q' .*not C-contiguous",
        ),
        (np.zeros((4, 4), dtype=np.int64)[:, 0], "numpy.ndarray of format 'l' .*not C-contiguous"),
        ((1, 2, 3, 4), "tuple$"),
        ("abcd", "str$"),
        (range(8), "range$"),
        (None, "NoneType$"),
    ],
)
def test_other_token_containers_are_refused_naming_type_and_format(tokens, shown):
    keys = make_spec().request([], None, None)
    expected = "^tokens must be a list of int token ids or a 1-D C-contiguous buffer of signed 32-"
    with pytest.raises(InvalidArgumentType, match=f"{expected}.* got {shown}"):
        keys.hash_blocks(tokens)


@pytest.mark.parametrize("make", [list, *INT32.values(), *INT64.values()])
def test_negative_ids_are_refused_unless_any_id_is_allowed_as_for_a_list(make):
    tokens = [1, 2, 3, 4, 5, -6, 7, 8, 9]
    strict = make_spec().request([], None, None)
    expected = r"^tokens\[5\] must be a token id in \[0, 2\*\*63-1\], got -6 \(pass allow_any"
    with pytest.raises(InvalidArgument, match=expected):
        strict.hash_blocks(make(tokens))
    # outside the checked range (before validate_from, inside prior's blocks): not read
    full = make_spec(allow_any_token_id=True).request([], None, None).hash_blocks(tokens)
    assert strict.hash_blocks(make(tokens), full[:2], 8) == full[2:]
    with pytest.raises(InvalidArgument, match=r"tokens\[5\]"):
        strict.hash_blocks(make(tokens), full[:2], 5)
    loose = make_spec(allow_any_token_id=True).request([], None, None)
    assert loose.hash_blocks(make(tokens)) == full == loose.hash_blocks(tokens)


def test_the_buffer_is_released_on_every_path():
    """An array that exports a buffer cannot be resized: after each call, it can."""
    keys = make_spec().request([], None, None)
    tokens = array.array("i", range(9))
    keys.hash_blocks(tokens)
    tokens.append(9)
    with pytest.raises(InvalidArgument):
        keys.hash_blocks(tokens, [b"x" * 32] * 5)  # prior too long
    tokens.append(10)
    with pytest.raises(InvalidArgument):
        keys.hash_blocks(tokens, None, 99)  # validate_from past the end
    tokens.append(11)
    tokens[3] = -1
    with pytest.raises(InvalidArgument):
        keys.hash_blocks(tokens)  # a negative id
    tokens.append(12)
    with pytest.raises(InvalidArgumentType):
        keys.hash_blocks(tokens, None, 0, [b"d"])  # bad embeds
    tokens.append(13)
    assert len(tokens) == 14


def test_a_buffer_is_not_copied_into_a_list():
    """A TokenBuffer is read where it is: hashing it creates no Python int per token."""
    import tracemalloc

    keys = make_spec(block_size=16).request([], None, None)
    tokens = TokenBuffer(range(1000, 1000 + 32768))
    keys.hash_blocks(tokens)
    tracemalloc.start()
    try:
        keys.hash_blocks(tokens)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 32768 * 28  # a list of 32k ints would be ~1.2 MB; 2,048 digests are ~150 KB


# ---- without the fast path ---------------------------------------------------------------------


def test_reference_path_stands_alone_without_the_extension(monkeypatch):
    """What an MMREUSE_HASHCORE=0 build runs: no spec, the same hashes by name alone."""
    tokens, mm = list(range(40)), [MMOccurrence("img", 5, 9)]
    expected = BlockHasher("xxhash", 4, seed="0").hash_prompt(tokens, mm=mm, cache_salt="s")
    monkeypatch.setattr(hasher_module, "_hashcore", None)
    h = BlockHasher("xxhash", 4, seed="0")
    assert h._spec is None and not h.use_fast_path
    assert h.hash_prompt(tokens, mm=mm, cache_salt="s") == expected
    req = h.request(tokens[:14], mm=mm, cache_salt="s")
    req.append_output_token_ids(tokens[14:])
    assert req.block_hashes == expected


def test_blocks_beyond_the_c_limit_take_the_reference_path():
    bs = _hashcore.MAX_BLOCK_TOKENS + 1
    h = BlockHasher("sha256", bs, seed="0")
    assert h.use_fast_path and h._spec is None
    tokens = [7] * bs
    assert h.hash_prompt(tokens) == BlockHasher(
        "sha256", bs, seed="0", use_fast_path=False
    ).hash_prompt(tokens)
