"""Golden vectors made by the real vLLM 0.33.0 and 0.34.0 (tests/data) must hash identically."""

import pytest

pytest.importorskip("torch")  # tests/support/vectors.py needs it

from mmreuse.hashing import fast_path_available
from tests.support.vectors import case_hasher, hash_case, load_vectors, token_writer

VECTORS = load_vectors("vllm-0.33.0-vectors.json")["vectors"]


def test_vector_count():
    assert len(VECTORS) == 364


@pytest.mark.parametrize("path", ["fast", "fast-portable", "reference"])
@pytest.mark.parametrize("vec", VECTORS, ids=[v["id"] for v in VECTORS])
def test_vllm_0_33_vector(vec, path):
    """fast: the C++ path as it runs here (AVX-512 token writer where the CPU has it);
    fast-portable: the C++ path with its scalar token writer; reference: plain Python."""
    if path != "reference" and not fast_path_available():
        pytest.fail("the C++ hashing fast path is not built")
    case, expected = vec["case"], vec["expected"]
    fast = path != "reference"
    with token_writer(simd=path == "fast"):
        assert case_hasher(case, use_fast_path=fast).none_hash.hex() == expected["none_hash"]
        assert hash_case(case, use_fast_path=fast) == expected["hashes"]
        if case.get("steps"):  # incremental == one-shot under vLLM 0.33
            assert hash_case(case, incremental=False, use_fast_path=fast) == expected["hashes"]


VECTORS_0_34 = load_vectors("vllm-0.34.0-vectors.json")["vectors"]


def test_vllm_0_34_vectors_are_the_0_33_cases_it_narrowed():
    """vLLM 0.34.0 takes token ids in int32 only: its file re-makes exactly the 0.33.0 cases
    outside that domain, folded into it."""
    narrowed = {
        v["id"] + "/int32"
        for v in VECTORS
        if any(not -(2**31) <= t < 2**31 for t in v["case"].get("tokens") or [])
    }
    assert {v["id"] for v in VECTORS_0_34} == narrowed and len(narrowed) == 127
    for vec in VECTORS_0_34:
        assert all(-(2**31) <= t < 2**31 for t in vec["case"]["tokens"]), vec["id"]


@pytest.mark.parametrize("path", ["fast", "fast-portable", "reference"])
@pytest.mark.parametrize("vec", VECTORS_0_34, ids=[v["id"] for v in VECTORS_0_34])
def test_vllm_0_34_vector(vec, path):
    """The 0.34.0 oracle's answers on int32 token ids, on the same three paths."""
    case, expected = vec["case"], vec["expected"]
    fast = path != "reference"
    with token_writer(simd=path == "fast"):
        assert case_hasher(case, use_fast_path=fast).none_hash.hex() == expected["none_hash"]
        assert hash_case(case, use_fast_path=fast) == expected["hashes"]


# vLLM 0.34.0's own published vectors (rust/src/engine-core-client/src/tests/
# prompt_block_hash_vectors.json in its sdist, Apache-2.0), which its Rust frontend and its
# engine are both pinned to: the default NONE_HASH seed, sha256 and sha256_cbor, LoRA, salt,
# lookahead 0 / 1 / 3, token ids at every pickle and CBOR width boundary up to 2**31-1.
PUBLISHED = load_vectors("vllm-0.34.0-prompt-block-hash-vectors.json")


def test_published_vectors_are_the_whole_file():
    assert len(PUBLISHED["cases"]) == 34
    assert set(PUBLISHED["none_hashes"]) == {"sha256", "sha256_cbor"}


@pytest.mark.parametrize("path", ["fast", "fast-portable", "reference"])
@pytest.mark.parametrize(
    "case",
    PUBLISHED["cases"],
    ids=[f"{c['hash_algo']}-{c['name']}" for c in PUBLISHED["cases"]],
)
def test_vllm_0_34_published_vector(case, path):
    lora = case["lora"]
    ours = {
        "hash_fn": case["hash_algo"],
        "seed": None,  # the engine's default seed: PYTHONHASHSEED unset
        "block_size": case["block_size"],
        "lookahead": case["num_lookahead_tokens"],
        "tokens": case["prompt_token_ids"],
        "lora": None if lora is None else {"name": lora["name"], "path": lora["path"]},
        "cache_salt": case["cache_salt"],
    }
    fast = path != "reference"
    with token_writer(simd=path == "fast"):
        hasher = case_hasher(ours, use_fast_path=fast)
        assert hasher.none_hash.hex() == PUBLISHED["none_hashes"][case["hash_algo"]]
        assert hash_case(ours, use_fast_path=fast) == case["block_hashes"]
