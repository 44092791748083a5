"""pytest-benchmark microbenchmarks of mmreuse.hashing (figures in BENCHMARKS.md).

.venv/bin/python -m pytest benchmarks/test_bench_hashing.py --benchmark-enable
"""

import array

import pytest
from hashing_workload import make_request

from mmreuse import BlockHasher, MMOccurrence, _hashcore


@pytest.mark.parametrize("hash_fn", ["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"])
@pytest.mark.parametrize("images", [0, 16])
def test_hash_prompt_32k(benchmark, hash_fn, images):
    tokens, mm = make_request(num_images=images)
    hasher = BlockHasher(hash_fn, 16, seed="0")
    hashes = benchmark(hasher.hash_prompt, tokens, mm=mm)
    assert len(hashes) == 2048


@pytest.mark.parametrize("hash_fn", ["sha256", "xxhash"])
@pytest.mark.parametrize("images", [0, 16])
def test_hash_prompt_32k_portable_writer(benchmark, hash_fn, images):
    """The same with the scalar token writer (CPUs without AVX-512 VBMI2 run this one)."""
    tokens, mm = make_request(num_images=images)
    hasher = BlockHasher(hash_fn, 16, seed="0")
    before = _hashcore.set_simd(False)
    try:
        hashes = benchmark(hasher.hash_prompt, tokens, mm=mm)
    finally:
        _hashcore.set_simd(before)
    assert len(hashes) == 2048


@pytest.mark.parametrize("hash_fn", ["sha256", "xxhash"])
def test_reference_path_32k(benchmark, hash_fn):
    tokens, mm = make_request(num_images=16)
    hasher = BlockHasher(hash_fn, 16, seed="0", use_fast_path=False)
    benchmark.pedantic(hasher.hash_prompt, args=(tokens,), kwargs={"mm": mm}, rounds=3)


def test_decode_step_completing_a_block(benchmark):
    """One decode token that completes a block of a 4k-token multimodal request."""
    tokens, mm = make_request(num_tokens=4096, num_images=2)
    hasher = BlockHasher("sha256", 16, seed="0")

    def setup():
        return (hasher.request(tokens[:4095], mm=mm),), {}

    def step(req):
        return req.append_output_token_ids(tokens[4095])

    benchmark.pedantic(step, setup=setup, rounds=200)


def test_short_prompt_overhead(benchmark):
    """Fixed cost of a call: a 64-token prompt with one image."""
    hasher = BlockHasher("sha256", 16, seed="0")
    tokens = [1] * 64
    mm = [MMOccurrence("img", 8, 20)]
    benchmark(hasher.hash_prompt, tokens, mm=mm)


@pytest.mark.parametrize("hash_fn", ["sha256", "xxhash"])
@pytest.mark.parametrize("container", ["list", "int32 array"])
def test_hash_blocks_int32_array_vs_list_32k(benchmark, hash_fn, container):
    """`RequestKeys.hash_blocks` on the same 32k tokens (16 images) as a list of ints (vLLM 0.33's
    `Request._all_token_ids`) and as an int32 `array.array` (0.34's `TokenBuffer`), read in
    place: what `fast_request_block_hasher` calls in vLLM's engine core."""
    tokens, mm = make_request(num_images=16)
    hasher = BlockHasher(hash_fn, 16, seed="0")
    keys = hasher._spec.request(mm, None, None)
    source = tokens if container == "list" else array.array("i", tokens)
    hashes = benchmark(keys.hash_blocks, source)
    assert hashes == hasher.hash_prompt(tokens, mm=mm)
