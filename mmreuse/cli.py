"""The `mmreuse` command line."""

from __future__ import annotations

import argparse
import hashlib
import sys

from .hashing import HASH_FUNCTIONS, SCHEMES, BlockHasher, MMOccurrence, to_event_id
from .hashing.schemes import DEFAULT_SCHEME

IMAGE_TOKEN = 151655  # Qwen2-VL's <|image_pad|>


def _demo_request() -> tuple[list[int], list[MMOccurrence]]:
    """A two-turn chat: system text, one 64-token image, a question, a second image, a question."""
    tokens: list[int] = list(range(1000, 1020))
    mm = []
    for name, n_img in (("cat.png", 64), ("dog.png", 40)):
        ident = hashlib.sha256(name.encode()).hexdigest()
        mm.append(MMOccurrence(ident, offset=len(tokens), length=n_img))
        tokens += [IMAGE_TOKEN] * n_img
        tokens += list(range(2000 + len(tokens), 2000 + len(tokens) + 13))
    return tokens, mm


def _fmt_key(key: object) -> str:
    if isinstance(key, bytes):
        return key.hex()[:16] + "…"
    if isinstance(key, str) and len(key) > 20:
        return repr(key[:12] + "…")
    if isinstance(key, tuple):
        return "(" + ", ".join(_fmt_key(k) for k in key) + ("," if len(key) == 1 else "") + ")"
    return repr(key)


def hash_demo(args: argparse.Namespace) -> int:
    hasher = BlockHasher(args.hash_fn, args.block_size, seed=args.seed, scheme=args.scheme)
    tokens, mm = _demo_request()
    kwargs = {"mm": mm, "cache_salt": args.cache_salt}
    hashes = hasher.hash_prompt(tokens, **kwargs)
    extra = hasher.block_extra_keys(tokens, **kwargs)
    print(
        f"mmreuse hash-demo: {len(tokens)} tokens, {len(mm)} images, scheme {hasher.scheme.name} "
        f"(vLLM {hasher.scheme.vllm_versions}), hash_fn {args.hash_fn}, block_size {args.block_size}, "
        f"seed {args.seed!r}"
    )
    for m in mm:
        print(f"  image {m.identifier[:12]}… at [{m.offset}, {m.end})")
    print(f"  NONE_HASH {hasher.none_hash.hex()}")
    print(f"{'block':>5}  {'tokens':>11}  {'event id (64-bit)':>20}  {'block hash':<{2 * hasher.digest_size}}  extra keys")
    bs = args.block_size
    for i, (h, keys) in enumerate(zip(hashes, extra)):
        span = f"[{i * bs}, {(i + 1) * bs})"
        print(f"{i:>5}  {span:>11}  {to_event_id(h):>20}  {h.hex()}  {_fmt_key(keys) if keys else '-'}")
    tail = len(tokens) - len(hashes) * bs
    print(f"({tail} trailing tokens form no full block and get no hash)")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mmreuse", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("hash-demo", help="hash an example multimodal request, print each block")
    demo.add_argument("--hash-fn", choices=HASH_FUNCTIONS, default="sha256")
    demo.add_argument("--block-size", type=int, default=16)
    demo.add_argument("--seed", default=None, help="the PYTHONHASHSEED string of the vLLM process")
    demo.add_argument("--scheme", choices=sorted(SCHEMES), default=DEFAULT_SCHEME)
    demo.add_argument("--cache-salt", default=None)
    demo.set_defaults(func=hash_demo)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ValueError as exc:
        print(f"mmreuse: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
