"""The long multimodal request the hashing benchmarks share (test_bench_hashing.py and
compare_vllm_hasher.py), so both sides of every comparison hash the same input."""

import hashlib
import random

from mmreuse import MMOccurrence

IMAGE_TOKEN = 151655


def make_request(num_tokens=32768, num_images=0, image_tokens=576, seed=0):
    """Random text token ids in [0, 152000) with `num_images` images of `image_tokens`
    placeholder tokens, one at a random place in each equal stretch of the prompt."""
    rng = random.Random(seed)
    tokens = [rng.randrange(152000) for _ in range(num_tokens)]
    mm = []
    if num_images:
        stride = num_tokens // num_images
        for i in range(num_images):
            off = i * stride + rng.randrange(stride - image_tokens)
            tokens[off : off + image_tokens] = [IMAGE_TOKEN] * image_tokens
            mm.append(
                MMOccurrence(hashlib.sha256(f"image-{i}".encode()).hexdigest(), off, image_tokens)
            )
    return tokens, mm
