"""BlockHasher: seeds, event ids, incremental form, fast path == reference, bad input."""

import array
import hashlib
import pickle
import warnings

import numpy as np
import pytest

pytest.importorskip("torch")
import torch
from hypothesis import given
from hypothesis import strategies as st

from mmreuse import BlockHasher, MMOccurrence, to_event_id
from mmreuse.errors import InvalidArgument, InvalidArgumentType
from mmreuse.hashing import DEFAULT_NONE_HASH_SEED, HASH_FUNCTIONS, fast_path_available, get_hash_fn
from tests.support.strategies import cases
from tests.support.vectors import case_tokens, hash_case, token_writer


def test_fast_path_is_built():
    assert fast_path_available(), "mmreuse._hashcore missing: install libssl-dev and rebuild"


# ---- NONE_HASH seeds ---------------------------------------------------------------------------


@pytest.mark.parametrize("fn", ["sha256", "sha256_cbor"])
def test_unset_seed_uses_vllms_default_for_sha256(fn):
    assert BlockHasher(fn).none_hash == get_hash_fn(fn)(DEFAULT_NONE_HASH_SEED)


def test_seed_is_hashed_as_a_string():
    h = BlockHasher("sha256", seed="0")
    expected = hashlib.sha256(pickle.dumps("0", protocol=5)).digest()
    assert h.none_hash == expected != BlockHasher("sha256", seed="1").none_hash


@pytest.mark.parametrize("fn", ["xxhash", "xxhash_cbor"])
def test_unset_seed_with_xxhash_raises(fn):
    with pytest.raises(ValueError, match="seed=None"):
        BlockHasher(fn)


def test_random_seed_opt_in_warns_and_differs():
    with pytest.warns(UserWarning, match="random NONE_HASH"):
        a = BlockHasher("xxhash", allow_random_seed=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        b = BlockHasher("xxhash", allow_random_seed=True)
    assert len(a.none_hash) == 16 and a.none_hash != b.none_hash


# ---- event ids ---------------------------------------------------------------------------------


def test_to_event_id_is_low_64_bits_big_endian():
    h = bytes(range(32))
    assert to_event_id(h) == int.from_bytes(h, "big") & (2**64 - 1) == int.from_bytes(h[24:], "big")
    assert to_event_id(bytes(range(16))) == int.from_bytes(bytes(range(8, 16)), "big")


@pytest.mark.parametrize("bad", [b"1234567", "x" * 32, None, -7])
def test_to_event_id_rejects_non_hashes(bad):
    with pytest.raises(ValueError, match="block_hash"):
        to_event_id(bad)


# ---- one-shot, incremental, fast vs reference --------------------------------------------------


@given(case=cases(max_tokens=300))
def test_fast_path_equals_reference(case):
    assert hash_case(case) == hash_case(case, use_fast_path=False)


# Where the encodings of a token id change length: CBOR 24, both 2**8 and 2**16, pickle's BININT
# limit 2**31, CBOR's 4-byte limit 2**32, and pickle LONG1 / CBOR 8-byte ids beyond.
BOUNDARY_IDS = [
    0,
    1,
    23,
    24,
    25,
    255,
    256,
    257,
    65535,
    65536,
    65537,
    151655,
    2**24,
    2**30 - 1,
    2**30,
    2**31 - 1,
    2**31,
    2**32 - 1,
    2**32,
    2**40,
    2**60,
    2**63 - 1,
]


@st.composite
def boundary_tokens(draw):
    """Token ids below a drawn ceiling, half of them at encoding boundaries: the ceiling lets
    whole 8-id groups stay within the SIMD writer's range (one larger id sends its group to
    the scalar writer)."""
    ceiling = draw(st.sampled_from([2**8, 2**16 + 2, 2**31, 2**31 + 1, 2**32 + 1, 2**63]))
    ids = [t for t in BOUNDARY_IDS if t < ceiling]
    return draw(
        st.lists(
            st.one_of(st.sampled_from(ids), st.integers(0, ceiling - 1)), min_size=8, max_size=300
        )
    )


@given(
    tokens=boundary_tokens(),
    hash_fn=st.sampled_from(["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"]),
    block_size=st.one_of(st.integers(1, 40), st.sampled_from([8, 16, 17, 32])),
)
def test_token_writers_equal_reference_at_encoding_boundaries(tokens, hash_fn, block_size):
    """The AVX-512 token writer (where the CPU has it) and the scalar one write what pickle /
    cbor2 write, for ids at every encoding-length boundary and any block tail."""
    ref = BlockHasher(hash_fn, block_size, seed="0", use_fast_path=False).hash_prompt(tokens)
    fast = BlockHasher(hash_fn, block_size, seed="0")
    for simd in (True, False):
        with token_writer(simd):
            assert fast.hash_prompt(tokens) == ref


def test_token_writer_switch_reports_the_previous_setting():
    from mmreuse import _hashcore

    available = _hashcore.simd_available()
    with token_writer(True):
        assert _hashcore.set_simd(False) is available
        assert _hashcore.set_simd(True) is False


@given(case=cases(max_tokens=300), chunks=st.lists(st.integers(1, 40), min_size=1, max_size=30))
def test_incremental_equals_one_shot(case, chunks):
    case = {k: v for k, v in case.items() if k not in ("steps", "prompt_embeds")}
    tokens = case_tokens(case)
    prompt_len = max(
        (m["end"] if "end" in m else m["offset"] + m["length"] for m in case.get("mm", [])),
        default=0,
    )
    one_shot = hash_case(case, incremental=False)
    from tests.support.vectors import case_hasher, case_request

    hasher = case_hasher(case)
    req = hasher.request(tokens[:prompt_len], **case_request(case))
    pos, seen = prompt_len, list(req.block_hashes)
    for n in chunks:
        seen += req.append_output_token_ids(tokens[pos : pos + n])
        pos += n
    seen += req.append_output_token_ids(tokens[pos:])
    assert [h.hex() for h in seen] == [h.hex() for h in req.block_hashes] == one_shot
    assert req.num_tokens == len(tokens)


def test_single_decode_token_append():
    h = BlockHasher("sha256", 4, seed="0")
    req = h.request([1, 2, 3])
    assert req.block_hashes == []
    new = req.append_output_token_ids(4)
    assert new == req.block_hashes == h.hash_prompt([1, 2, 3, 4])


def test_extra_keys_shape_vllm_0_33():
    h = BlockHasher("sha256", 4, seed="0")
    keys = h.block_extra_keys(
        [9] * 12, mm=[MMOccurrence("img", 2, 5)], cache_salt="s", lora_name="L", lora_path="/l"
    )
    assert keys[0] == (("lora", "L", "/l"), ("mm", "img", 2), ("cache_salt", "s"))
    assert keys[1] == (("lora", "L", "/l"), ("mm", "img", -2))
    assert keys[2] == (("lora", "L", "/l"),)
    assert BlockHasher("sha256", 4, seed="0").block_extra_keys([9] * 8) == [None, None]


def test_prompt_embeds_shorter_than_tokens_hash_the_prefix():
    h = BlockHasher("sha256", 4, seed="0")
    emb = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    keys = h.block_extra_keys([0] * 8, prompt_embeds=emb)
    assert keys[0] == (("prompt_embeds", hashlib.sha256(emb[:4].numpy().tobytes()).digest()),)
    assert keys[1] == (("prompt_embeds", hashlib.sha256(emb[4:6].numpy().tobytes()).digest()),)


def test_hash_prompt_does_not_touch_the_callers_tokens():
    tokens = [1, 2, 3, 4, 5]
    h = BlockHasher("sha256", 2, seed="0")
    req = h.request(tokens)
    req.append_output_token_ids([6])
    assert tokens == [1, 2, 3, 4, 5]


def test_digest_sizes():
    for fn in HASH_FUNCTIONS:
        h = BlockHasher(fn, 2, seed="0")
        assert {len(x) for x in h.hash_prompt([1, 2, 3, 4])} == {h.digest_size}


# ---- bad input ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"hash_fn": "md5"}, "hash_fn"),
        ({"scheme": "vllm-9.9"}, "scheme"),
        ({"block_size": 0}, "block_size"),
        ({"block_size": 2.0}, "block_size"),
        ({"block_size": True}, "block_size"),
        ({"lookahead": -1}, "lookahead"),
        ({"seed": 0}, "seed"),
    ],
)
def test_bad_hasher_arguments(kwargs, field):
    kwargs.setdefault("seed", "0")
    with pytest.raises(ValueError, match=field):
        BlockHasher(**kwargs)


@pytest.mark.parametrize("fast", [True, False])
@pytest.mark.parametrize(
    "tokens,where,what",
    [
        ([1, -1, 3], r"tokens\[1\]", "-1"),
        ([1, 2, 2**63], r"tokens\[2\]", str(2**63)),
        ([1, 2.0], r"tokens\[1\]", "2.0"),
        ([True, 1], r"tokens\[0\]", "True"),
        ([1, 2, 3, 4, 5, "6"], r"tokens\[5\]", "'6'"),  # in the partial last block too
    ],
)
def test_bad_token_ids(fast, tokens, where, what):
    h = BlockHasher("sha256", 2, seed="0", use_fast_path=fast)
    with pytest.raises(ValueError, match=where) as e:
        h.hash_prompt(tokens)
    assert what in str(e.value)


def test_bad_token_in_appended_tokens():
    req = BlockHasher("sha256", 2, seed="0").request([1, 2, 3])
    with pytest.raises(ValueError, match=r"tokens\[4\]"):
        req.append_output_token_ids([4, -5])


def test_allow_any_token_id_hashes_like_vllm():
    h = BlockHasher("sha256", 2, seed="0", allow_any_token_id=True)
    ref = BlockHasher("sha256", 2, seed="0", allow_any_token_id=True, use_fast_path=False)
    tokens = [-1, 2**64 - 1, 2**70, 5]
    assert h.hash_prompt(tokens) == ref.hash_prompt(tokens)


@pytest.mark.parametrize(
    "mm,match",
    [
        ([MMOccurrence("a", 8, 4)], "outside the prompt"),
        ([MMOccurrence("a", 4, 4), MMOccurrence("b", 2, 1)], "sorted"),
        ([MMOccurrence("a", 2, 4), MMOccurrence("b", 5, 1)], "overlapping"),
        (["not an occurrence"], r"mm\[0\]"),
    ],
)
def test_bad_occurrences(mm, match):
    with pytest.raises(ValueError, match=match):
        BlockHasher("sha256", 2, seed="0").hash_prompt([0] * 10, mm=mm)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"identifier": 5, "offset": 0, "length": 1}, "identifier"),
        ({"identifier": "a", "offset": -1, "length": 1}, "offset"),
        ({"identifier": "a", "offset": 0, "length": 0}, "length"),
        ({"identifier": "a", "offset": 0, "length": 2, "is_embed": [True]}, "is_embed"),
        ({"identifier": "a", "offset": 0, "length": 2, "is_embed": [1, 0]}, r"is_embed\[0\]"),
        ({"identifier": "a", "offset": 0, "length": 1, "modality": ""}, "modality"),
    ],
)
def test_bad_occurrence_fields(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MMOccurrence(**kwargs)


@pytest.mark.parametrize(
    "embeds,match",
    [
        (torch.zeros(5, 2), "5 rows"),
        (torch.zeros(4, 2, dtype=torch.int32), "floating"),
        (torch.zeros(8), "2-D"),
        ([[0.0]], "torch.Tensor"),
    ],
)
def test_bad_prompt_embeds(embeds, match):
    with pytest.raises(ValueError, match=match):
        BlockHasher("sha256", 2, seed="0").hash_prompt([0] * 4, prompt_embeds=embeds)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"lora_name": "L"}, "lora_path"),
        ({"lora_name": "", "lora_path": "/p"}, "lora_name"),
        ({"lora_path": "/p"}, "without lora_name"),
        ({"cache_salt": 5}, "cache_salt"),
    ],
)
def test_bad_request_fields(kwargs, match):
    with pytest.raises(ValueError, match=match):
        BlockHasher("sha256", 2, seed="0").hash_prompt([0] * 4, **kwargs)


def test_occurrence_from_vllm_feature():
    class Pos:
        offset, length, is_embed = 3, 2, torch.tensor([True, False])

    class Feature:
        identifier, modality, mm_position = "abc", "audio", Pos()

    occ = MMOccurrence.from_vllm(Feature())
    assert occ == MMOccurrence("abc", 3, 2, (True, False), "audio")
    assert occ.num_embeds == 1 and occ.end == 5
    with pytest.raises(ValueError, match="MultiModalFeatureSpec"):
        MMOccurrence.from_vllm(object())


@pytest.mark.parametrize("fast", [True, False])
def test_allow_any_token_id_still_refuses_non_ints_past_a_huge_id(fast):
    # A token >= 2**63 sends the fast path to the reference path; the tokens after it must
    # still be checked there (a float was once hashed).
    h = BlockHasher("sha256", 4, allow_any_token_id=True, use_fast_path=fast)
    for tokens, where in (([2**64, 1, 2, 3, 4.5, 6, 7, 8], 4), ([2**64, 1, 2, 3, 4, 6, 7, 8.5], 7)):
        with pytest.raises(TypeError, match=rf"tokens\[{where}\]"):
            h.hash_prompt(tokens)
    assert len(h.hash_prompt([2**64, -1, 2, 3])) == 1


@pytest.mark.parametrize("fast", [True, False])
def test_rejected_append_leaves_the_request_unchanged(fast):
    h = BlockHasher("sha256", 4, use_fast_path=fast)
    req = h.request([1, 2, 3])
    for bad in (-1, [5, "x"], [6, 7, 2**63], 2.0):
        with pytest.raises(ValueError, match="tokens"):
            req.append_output_token_ids(bad)
        assert req.num_tokens == 3 and req.block_hashes == []
    assert req.append_output_token_ids([4, 5]) == h.hash_prompt([1, 2, 3, 4, 5])
    assert req.num_tokens == 5


# ---- hostile input (issue #11) -----------------------------------------------------------


@pytest.mark.parametrize("fast", [True, False])
@pytest.mark.parametrize(
    "tokens",
    [{1, 2, 3, 4}, {1: 1, 2: 2}, bytearray(b"\x01\x02"), memoryview(b"\x01\x02"), torch.tensor(3)],
    ids=["set", "dict", "bytearray", "memoryview", "0-d tensor"],
)
def test_token_non_sequences_are_refused(fast, tokens):
    h = BlockHasher("sha256", 2, use_fast_path=fast)
    for call in (
        h.hash_prompt,
        lambda t: h.request(t),
        lambda t: h.request([]).append_output_token_ids(t),
    ):
        with pytest.raises(
            InvalidArgumentType,
            match=r"^tokens must be (a sequence of ints|an int token id or a sequence of them)",
        ):
            call(tokens)


@pytest.mark.parametrize("fast", [True, False])
def test_token_sequences_accepted_today_still_are(fast):
    h = BlockHasher("sha256", 2, use_fast_path=fast)
    want = h.hash_prompt([1, 2, 3, 4])
    for tokens in ((1, 2, 3, 4), range(1, 5), np.array([1, 2, 3, 4]), torch.tensor([1, 2, 3, 4])):
        assert h.hash_prompt(tokens) == want == h.request(tokens).block_hashes
    assert h.hash_prompt(array.array("q", [1, 2, 3, 4])) == want


@pytest.mark.parametrize("fast", [True, False])
@pytest.mark.parametrize("scalar", [np.int64(3), torch.tensor(3), True, 3.0])
def test_appending_a_non_int_scalar_names_it(fast, scalar):
    req = BlockHasher("sha256", 2, use_fast_path=fast).request([1])
    with pytest.raises(InvalidArgumentType, match=r"^tokens must be an int token id or a sequence"):
        req.append_output_token_ids(scalar)
    assert req.num_tokens == 1
    assert req.append_output_token_ids(3) != [] and req.num_tokens == 2


@pytest.mark.parametrize("fast", [True, False])
def test_bad_token_element_is_named_by_index_and_value(fast):
    h = BlockHasher("sha256", 2, use_fast_path=fast)
    for tokens, match in (
        ([1, 2, np.int64(3)], r"^tokens\[2\] must be an int token id, got \S*int64"),
        ((1, True), r"^tokens\[1\] must be an int token id, got bool True"),
        (np.array([1.0, 2.0]), r"^tokens\[0\] must be an int token id, got float 1.0"),
    ):
        with pytest.raises(InvalidArgumentType, match=match):
            h.hash_prompt(tokens)


LONE = "a\ud800b"


@pytest.mark.parametrize("fn", ["sha256_cbor", "xxhash_cbor"])
@pytest.mark.parametrize("fast", [True, False])
def test_strs_cbor_cannot_encode_raise_naming_the_field(fn, fast):
    with pytest.raises(InvalidArgument, match=r"^seed must be encodable as UTF-8.*index 1"):
        BlockHasher(fn, 2, seed=LONE, use_fast_path=fast)
    h = BlockHasher(fn, 2, seed="0", use_fast_path=fast)
    for kwargs, field in (
        ({"cache_salt": LONE}, "cache_salt"),
        ({"lora_name": LONE, "lora_path": "/p"}, "lora_name"),
        ({"lora_name": "n", "lora_path": LONE}, "lora_path"),
        ({"mm": [MMOccurrence(LONE, 0, 2)]}, r"mm\[0\].identifier"),
    ):
        for call in (h.hash_prompt, h.request, h.block_extra_keys):
            with pytest.raises(InvalidArgument, match=f"^{field} must be encodable as UTF-8"):
                call([1, 2, 3, 4], **kwargs)


def test_pickle_hashes_lone_surrogates_as_vllm_would():
    # pickle writes str with surrogatepass: these hash (fast path == reference), as before
    for fast in (True, False):
        h = BlockHasher("sha256", 2, seed=LONE, use_fast_path=fast)
        got = h.hash_prompt([1, 2], cache_salt=LONE, mm=[MMOccurrence(LONE, 0, 2)])
        assert got == BlockHasher("sha256", 2, seed=LONE, use_fast_path=False).hash_prompt(
            [1, 2], cache_salt=LONE, mm=[MMOccurrence(LONE, 0, 2)]
        )
