"""Older vLLM hash generations, checked against vectors made by those vLLM versions' own code."""

from pathlib import Path

import pytest

pytest.importorskip("torch")  # tests/support/vectors.py needs it

from mmreuse.hashing import SCHEMES, BlockHasher, MMOccurrence, get_scheme
from tests.support.vectors import DATA, case_hasher, hash_case, load_vectors

FILES = sorted(p.name for p in Path(DATA).glob("vllm-*-scheme-vectors.json"))
CASES = [(f, v) for f in FILES for v in load_vectors(f)["vectors"]]


def test_every_older_scheme_has_vectors():
    covered = {load_vectors(f)["scheme"] for f in FILES}
    assert covered == set(SCHEMES)


@pytest.mark.parametrize("path", ["fast", "reference"])
@pytest.mark.parametrize("fname,vec", CASES, ids=[f"{f[:-20]}:{v['id']}" for f, v in CASES])
def test_scheme_vector(fname, vec, path):
    doc = load_vectors(fname)
    case, expected = vec["case"], vec["expected"]
    fast = path == "fast"
    hasher = case_hasher(case, doc["scheme"], use_fast_path=fast)
    assert hasher.none_hash.hex() == expected["none_hash"]
    assert hash_case(case, doc["scheme"], use_fast_path=fast) == expected["hashes"]


def test_text_only_hashes_agree_across_schemes():
    tokens = list(range(100, 200))
    results = {
        name: BlockHasher("sha256", 16, seed="0", scheme=name).hash_prompt(tokens)
        for name in SCHEMES
    }
    assert len({tuple(v) for v in results.values()}) == 1


def test_multimodal_hashes_differ_across_key_shapes():
    tokens = [1] * 64
    mm = [MMOccurrence("img", 8, 20)]
    shapes = {}
    for name, scheme in SCHEMES.items():
        shapes.setdefault(
            scheme.mm_key,
            BlockHasher("sha256", 16, seed="0", scheme=name).hash_prompt(tokens, mm=mm)[0],
        )
    assert len(set(shapes.values())) == 3


def test_old_schemes_keep_vllms_incremental_shortcut():
    # Two images end inside the prompt's partial last block; a later decode step completes it.
    # vLLM <= 0.30 keys only the last image there (curr_mm_idx = -1); 0.31+ keys both.
    prompt = [5] * 30
    mm = [MMOccurrence("aa", 17, 3), MMOccurrence("bb", 22, 4)]
    for name in ("vllm-0.30", "vllm-0.33"):
        h = BlockHasher("sha256", 16, seed="0", scheme=name)
        req = h.request(prompt, mm=mm)
        req.append_output_token_ids([7, 7])
        one_shot = h.hash_prompt([*prompt, 7, 7], mm=mm)
        assert (req.block_hashes == one_shot) == (get_scheme(name).incremental_mm == "window")


def test_scheme_limits():
    with pytest.raises(ValueError, match="lookahead"):
        BlockHasher("sha256", 16, seed="0", lookahead=1, scheme="vllm-0.30")
    with pytest.raises(ValueError, match="xxhash"):
        BlockHasher("xxhash", 16, seed="0", scheme="vllm-0.10")
    with pytest.raises(ValueError, match="prompt_embeds"):
        import torch

        BlockHasher("sha256", 16, seed="0", scheme="vllm-0.10").hash_prompt(
            [0] * 4, prompt_embeds=torch.zeros(4, 2)
        )
    with pytest.raises(ValueError, match="lora_int_id"):
        BlockHasher("sha256", 16, seed="0", scheme="vllm-0.10").hash_prompt([0] * 4, lora_name="L")
    with pytest.raises(ValueError, match="random"):
        BlockHasher("sha256", 16, seed=None, scheme="vllm-0.28")
