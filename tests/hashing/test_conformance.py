"""All golden vectors made by the real vLLM 0.33.0 (tests/data) must hash identically."""

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
