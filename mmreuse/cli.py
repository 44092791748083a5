"""The `mmreuse` command line: `mmreuse simulate` (the main job) and `mmreuse hash-demo`."""

from __future__ import annotations

import argparse
import hashlib
import sys
from typing import TYPE_CHECKING

from .hashing import HASH_FUNCTIONS, SCHEMES, BlockHasher, MMOccurrence, to_event_id
from .hashing.schemes import DEFAULT_SCHEME

if TYPE_CHECKING:
    from .sim import SimConfig

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
    print(
        f"{'block':>5}  {'tokens':>11}  {'event id (64-bit)':>20}  {'block hash':<{2 * hasher.digest_size}}  extra keys"
    )
    bs = args.block_size
    for i, (h, keys) in enumerate(zip(hashes, extra, strict=True)):
        span = f"[{i * bs}, {(i + 1) * bs})"
        print(
            f"{i:>5}  {span:>11}  {to_event_id(h):>20}  {h.hex()}  {_fmt_key(keys) if keys else '-'}"
        )
    tail = len(tokens) - len(hashes) * bs
    print(f"({tail} trailing tokens form no full block and get no hash)")
    return 0


def _sim_config(args: argparse.Namespace) -> SimConfig:
    """The `--config` file (or the defaults), with the command line's overrides applied."""
    import dataclasses

    from .sim import SimConfig

    cfg = SimConfig.from_file(args.config) if args.config else SimConfig()
    workload = cfg.workload
    if args.workload:
        workload = dataclasses.replace(workload, kind=args.workload)
    if args.trace:
        workload = dataclasses.replace(workload, kind="trace", trace_path=args.trace)
    if args.requests is not None:
        workload = dataclasses.replace(workload, requests=args.requests)
    cfg = dataclasses.replace(cfg, workload=workload)
    if args.seed is not None:
        cfg = dataclasses.replace(cfg, seed=args.seed)
    if args.policy:
        cfg = dataclasses.replace(cfg, policies=tuple(args.policy))
    if args.routing:
        cluster = dataclasses.replace(cfg.cluster, routing=args.routing)
        cfg = dataclasses.replace(cfg, cluster=cluster)
    return cfg


def simulate(args: argparse.Namespace) -> int:
    """Run every policy on one request stream; print the table, write JSON / a plot if asked."""
    import time

    from .sim import run, table
    from .sim.report import plot, write_json

    cfg = _sim_config(args)
    workload, cluster = cfg.workload, cfg.cluster
    t0 = time.perf_counter()
    rows, results = run(cfg, progress=not args.no_progress)
    elapsed = time.perf_counter() - t0
    print(
        f"mmreuse simulate: workload {workload.kind}, {workload.requests} requests, "
        f"seed {cfg.seed}, {cluster.num_encoders} E / {cluster.num_prefills} P, "
        f"routing {cluster.routing}, E cache {cluster.e_cache_embeds}, "
        f"external store {cluster.external_store_embeds or 'off'} ({elapsed:.1f} s)"
    )
    print(table(rows))
    occurrences = rows[0]["occurrences"]
    eager = next((r for r in rows if r["policy"] == "eager"), None)
    if eager and eager["encoder_forwards"]:
        redundant, forwards = eager["redundant_forwards"], eager["encoder_forwards"]
        print(
            f"eager: {redundant} of {forwards} encoder forwards "
            f"({100 * redundant / forwards:.0f} %) were for items "
            f"P did not need; {occurrences} multimodal occurrences in all"
        )
    if args.json:
        write_json(rows, cfg.to_dict(), args.json)
        print(f"wrote {args.json}")
    if args.plot:
        plot(
            results,
            rows,
            args.plot,
            f"{workload.kind}, {workload.requests} requests, seed {cfg.seed}",
        )
        print(f"wrote {args.plot}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mmreuse", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    from .sim.config import POLICIES, ROUTINGS, WORKLOADS

    sim = sub.add_parser("simulate", help="simulate an EPD cluster under each coordination policy")
    sim.add_argument("--workload", choices=[w for w in WORKLOADS if w != "trace"])
    sim.add_argument(
        "--trace", metavar="JSONL", help="replay a trace (schema: mmreuse/sim/workload.py)"
    )
    sim.add_argument("--policy", choices=POLICIES, action="append", help="repeatable; default: all")
    sim.add_argument("--requests", type=int)
    sim.add_argument("--seed", type=int)
    sim.add_argument("--routing", choices=ROUTINGS)
    sim.add_argument("--json", metavar="PATH")
    sim.add_argument("--plot", metavar="PATH")
    sim.add_argument(
        "--config", metavar="FILE", help="JSON: {seed, policies, cost, cluster, workload}"
    )
    sim.add_argument("--no-progress", action="store_true")
    sim.set_defaults(func=simulate)
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
