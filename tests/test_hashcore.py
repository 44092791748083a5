"""mmreuse._hashcore: the HashSpec / RequestKeys objects, the exported tables, their checks."""

import pytest

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
        (((1, 2, 3, 4),), "tokens must be a list", InvalidArgumentType),
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
