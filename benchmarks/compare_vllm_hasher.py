"""vLLM's request_block_hasher vs mmreuse's one-shot hasher, in one process, same inputs.

Run inside the oracle venv (it has vLLM 0.33.0), with mmreuse importable:

    PYTHONPATH=. ~/.cache/mmreuse/venv-oracle-0.33.0/bin/python benchmarks/compare_vllm_hasher.py

For each row (32,768 tokens, block size 16; 0 or 16 images of 576 tokens; sha256 or xxhash) it
checks that the digests are identical, then prints the medians of --repeat rounds (each times
all three in turn, each after an untimed warm-up call) of: vLLM's hasher, mmreuse's
`BlockHasher.hash_prompt` (validation included), and the floor -- the digest calls alone over
the pre-serialized block preimages. Exits non-zero on any mismatch.
--portable times the C++ path with its scalar token writer (what CPUs without AVX-512 VBMI2 run).
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools" / "oracle"))

import hash_oracle  # noqa: E402  (tools/oracle/hash_oracle.py: builds real vLLM requests)
import xxhash  # noqa: E402
from hashing_workload import make_request  # noqa: E402  (this script's folder)

from mmreuse import BlockHasher, MMOccurrence, _hashcore  # noqa: E402


def make_case(num_tokens: int, num_images: int, image_tokens: int, fn: str, seed: int) -> dict:
    """The benchmarks' shared request (hashing_workload.py) as an oracle case."""
    tokens, mm = make_request(num_tokens, num_images, image_tokens, seed)
    return {
        "hash_fn": fn,
        "seed": "0",
        "block_size": 16,
        "lookahead": 0,
        "tokens": tokens,
        "mm": [{"identifier": m.identifier, "offset": m.offset, "length": m.length} for m in mm],
    }


def interleaved_medians(fns, repeat: int) -> list[float]:
    """Median seconds of each function, timed in turn within every round so that all of them
    see the same machine conditions (these shared 2-core machines drift by +-10 %). Each timed
    call follows an untimed one of the same function, so each runs with its own data in cache
    (as a hasher does on a request just built), not with whatever the previous one left."""
    times = [[] for _ in fns]
    for _ in range(repeat):
        for fn, ts in zip(fns, times, strict=True):
            fn()
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
    return [statistics.median(ts) for ts in times]


def run_row(case: dict, repeat: int) -> dict:
    V = hash_oracle.vllm_api()
    c = hash_oracle.parse_case(case)
    vfn = V.hashing.get_hash_fn_by_name(c.hash_fn)
    hash_oracle.init_none_hash(c.hash_fn, c.seed)
    ecr, _ = hash_oracle.engine_core_request(c, c.num_tokens)
    request = V.Request.from_engine_core_request(V.wire(ecr), block_hasher=None)
    vllm_hasher = V.kcu.get_request_block_hasher(c.block_size, vfn, 0)

    preimages = []
    recorder = V.kcu.get_request_block_hasher(
        c.block_size,
        lambda obj: preimages.append(hash_oracle.preimage(c.hash_fn, obj)) or vfn(obj),
        0,
    )
    expected = [bytes(h) for h in recorder(request)]

    ours = BlockHasher(c.hash_fn, c.block_size, seed=c.seed)
    mm = [MMOccurrence(p.identifier, p.offset, p.length) for p in c.mm]
    tokens = list(c.tokens or ())
    got = ours.hash_prompt(tokens, mm=mm)
    if got != expected:
        raise SystemExit(f"MISMATCH for {c.hash_fn} with {len(mm)} images")

    if c.hash_fn.startswith("sha256"):

        def floor():
            for b in preimages:
                hashlib.sha256(b).digest()
    else:

        def floor():
            d = xxhash.xxh3_128_digest
            for b in preimages:
                d(b)

    t_vllm, t_ours, t_floor = interleaved_medians(
        [lambda: vllm_hasher(request), lambda: ours.hash_prompt(tokens, mm=mm), floor], repeat
    )
    return {
        "fn": c.hash_fn,
        "images": len(mm),
        "blocks": len(expected),
        "vllm": t_vllm,
        "mmreuse": t_ours,
        "floor": t_floor,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--image-tokens", type=int, default=576)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument(
        "--portable",
        action="store_true",
        help="use the scalar token writer even where the CPU has AVX-512 VBMI2",
    )
    args = ap.parse_args()
    _hashcore.set_simd(not args.portable)
    simd = _hashcore.simd_available() and not args.portable
    print(
        f"vLLM {hash_oracle.vllm_api().vllm.__version__}, {args.tokens} tokens, block size 16, "
        f"median of {args.repeat}; digests checked identical; token writer: "
        f"{'AVX-512 VBMI2' if simd else 'scalar'}"
    )
    print(
        f"{'hash_fn':<8} {'images':>6} {'blocks':>6} {'vLLM ms':>9} {'mmreuse ms':>11} "
        f"{'floor ms':>9} {'speedup':>8} {'x floor':>8}"
    )
    for fn in ("sha256", "xxhash"):
        for images in (0, 16):
            r = run_row(
                make_case(args.tokens, images, args.image_tokens, fn, seed=images), args.repeat
            )
            print(
                f"{r['fn']:<8} {r['images']:>6} {r['blocks']:>6} {r['vllm'] * 1e3:>9.2f} "
                f"{r['mmreuse'] * 1e3:>11.3f} {r['floor'] * 1e3:>9.3f} "
                f"{r['vllm'] / r['mmreuse']:>7.1f}x {r['mmreuse'] / r['floor']:>7.2f}x"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
