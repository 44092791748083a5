"""Run in a vLLM oracle venv (0.33.0 or 0.34.0; PYTHONPATH = the mmreuse checkout): mmreuse's
`fast_request_block_hasher` against vLLM's own `get_request_block_hasher` on real `Request`
objects (on 0.34 they hold their token ids in a `TokenBuffer`, an int32 array), prompt and
decode steps, every hash function, lookahead 0-2, multimodal features, cache salt, LoRA and
negative / int32-edge token ids; prints one JSON line of counts (and timings with --time).
A request counts as "fast" when every hasher call on it was served by mmreuse's fast path,
"fallback" when vLLM's own hasher served one (the reasons are in "fallbacks").

    PYTHONHASHSEED=0 PYTHONPATH=. VENV/bin/python tools/oracle/fast_hasher_check.py [--time]
"""

from __future__ import annotations

import json
import random
import sys
import time

import vllm
from vllm.lora.request import LoRARequest
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256, sha256_cbor, xxhash, xxhash_cbor
from vllm.v1.core import kv_cache_utils as K
from vllm.v1.request import Request

from mmreuse import _hashcore
from mmreuse.integrations.vllm_hasher import STATS, fallbacks, fast_request_block_hasher

FNS = {"sha256": sha256, "sha256_cbor": sha256_cbor, "xxhash": xxhash, "xxhash_cbor": xxhash_cbor}


def fresh(s: str) -> str:
    return "".join(list(s))  # a new str object, as after vLLM's msgpack wire


def feature(ident: str, offset: int, length: int) -> MultiModalFeatureSpec:
    return MultiModalFeatureSpec(
        data=None, modality="image", identifier=ident, mm_position=PlaceholderRange(offset, length)
    )


def make_request(rng: random.Random, n: int, k: int, salt: bool, lora: bool, shared: bool, hasher):
    tokens = [rng.randrange(0, 150_000) for _ in range(n)]
    if n % 11 == 0:  # negative placeholder ids (vLLM's tests use them) and int32's edges
        for i in rng.sample(range(n), min(n, 8)):
            tokens[i] = rng.choice((-1, -7, -(2**31), 2**31 - 1, 2**15, 2**30))
    feats, pos = [], 0
    ids = [fresh(f"img-{rng.randrange(4)}") for _ in range(k)]
    if shared and k >= 2:
        ids[1] = ids[0]  # one object twice: pickle memoizes it
    for ident in ids:
        pos += rng.randrange(1, 40)
        length = rng.randrange(1, 70)
        if pos + length > n:
            break
        feats.append(feature(ident, pos, length))
        pos += length
    return Request(
        request_id=fresh("r"),
        prompt_token_ids=tokens,
        sampling_params=SamplingParams(max_tokens=64),
        pooling_params=None,
        mm_features=feats,
        cache_salt=fresh("tenant-x") if salt else None,
        lora_request=LoRARequest(fresh("ad"), 1, fresh("/p/ad")) if lora else None,
        block_hasher=hasher,
    )


def check(seed: int = 0) -> dict:
    rng = random.Random(seed)
    counts = {"requests": 0, "blocks": 0, "fast": 0, "fallback": 0, "mismatch": 0}
    tokens_types = set()
    for fn in FNS.values():
        K.init_none_hash(fn)
        for la in (0, 1, 2, True):
            for bs in (16, 32):
                ref = K.get_request_block_hasher(bs, fn, la)
                ours = fast_request_block_hasher(bs, fn, la)
                for case in range(12):
                    args = (rng.randrange(1, 400), rng.randrange(0, 4), case % 3 == 0, case % 5 == 0, case % 7 == 0)  # fmt: skip
                    state = rng.getstate()
                    r1 = make_request(rng, *args, ref)
                    rng.setstate(state)
                    before = dict(STATS)
                    r2 = make_request(rng, *args, ours)
                    tokens_types.add(type(r2._all_token_ids).__name__)
                    for _ in range(rng.randrange(0, 40)):
                        t = rng.randrange(0, 150_000)
                        r1.append_output_token_ids(t)
                        r2.append_output_token_ids(t)
                    counts["requests"] += 1
                    counts["blocks"] += len(r1.block_hashes)
                    if r1.block_hashes != r2.block_hashes:
                        counts["mismatch"] += 1
                    fell_back = STATS["vllm"] > before["vllm"]
                    assert fell_back or STATS["fast"] > before["fast"], "the hasher never ran"
                    counts["fallback" if fell_back else "fast"] += 1
    counts["vllm"] = vllm.__version__
    counts["tokens"] = sorted(tokens_types)
    counts["fallbacks"] = {k: v for k, v in fallbacks().items() if v}
    counts["stats"] = dict(STATS)
    return counts


def timing(repeat: int = 20) -> dict:
    """Engine-core time per request: the initial hashing of a new prompt, vLLM's vs mmreuse's."""
    out = {}
    rng = random.Random(1)
    for label, n, k, size in (
        ("512 tokens, 1 image", 512, 1, 64),
        ("32k text", 32768, 0, 0),
        ("32k, 16 images", 32768, 16, 576),
    ):
        for name in ("sha256", "xxhash"):
            fn = FNS[name]
            K.init_none_hash(fn)
            ref = K.get_request_block_hasher(16, fn, 0)
            ours = fast_request_block_hasher(16, fn, 0)
            tokens = [rng.randrange(0, 150_000) for _ in range(n)]
            feats = []
            if k:
                gap = (n - k * size) // (k + 1)
                feats = [feature(fresh(f"img-{i}"), gap + i * (gap + size), size) for i in range(k)]
            best: dict = {}
            for who, h in (("vllm", ref), ("mmreuse", ours)) * repeat:
                r = Request(request_id="r", prompt_token_ids=list(tokens), sampling_params=SamplingParams(), pooling_params=None, mm_features=list(feats))  # fmt: skip
                fast = STATS["fast"]
                t0 = time.perf_counter()
                hashes = h(r)
                dt = time.perf_counter() - t0
                if who == "mmreuse":  # a fallback timed as "mmreuse" would be vLLM's own
                    assert STATS["fast"] == fast + 1, (label, name, fallbacks())
                best[who] = min(best.get(who, dt), dt)
                best.setdefault("hashes", hashes)
                assert hashes == best["hashes"] and len(hashes) == n // 16, (label, name)
            out[f"{label} {name}"] = {
                "vllm_ms": best["vllm"] * 1e3,
                "mmreuse_ms": best["mmreuse"] * 1e3,
                "speedup": best["vllm"] / best["mmreuse"],
            }
            out["tokens"] = type(r._all_token_ids).__name__
    out["vllm"] = vllm.__version__
    out["simd"] = _hashcore.simd_available()  # the AVX-512 VBMI2 token writer, else the scalar
    out["repeat"] = repeat
    return out


if __name__ == "__main__":
    result = {"check": check()}
    if "--time" in sys.argv:
        result["timing"] = timing(int(sys.argv[sys.argv.index("--repeat") + 1]) if "--repeat" in sys.argv else 20)  # fmt: skip
    print(json.dumps(result))
