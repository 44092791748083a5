"""Simulator configuration: cost model, cluster, workload (frozen values, JSON-loadable).

Cost-model defaults (`COSTS["gpu"]`) are a GPU deployment's published figures (Qwen2.5-VL-7B
on an H100, vLLM with the Mooncake Store; BENCHMARKS.md, "Stage costs of the serving profile"):
- encoder: 167 ms for a 2,691-token 1080p image (vLLM #41267): 0.062 ms per embedding token;
- prefill: 126 ms for 2,718 tokens (#41267): 0.046 ms per token, plus 5 ms per step (assumed);
- embedding rows: hidden 3584 x bf16 = 7,168 bytes per embedding token;
- E -> store -> P: the Store's TCP rates (#47302), 694 MiB/s in and 912 MiB/s out, one after
  the other (0.413 GB/s); P's load from the store alone at 912 MiB/s (0.956 GB/s); 0.2 ms each;
- P's render of a request: 1.7 ms (Mooncake #2836's render-cache hit) plus 12.2 ms for each
  image P's processor cache has not seen (Qwen2VLImageProcessor at 1024x1024 on CPU, #50411);
- a demand query proxy -> P -> proxy: 1 ms round trip; an E cache hit costs 0.5 ms to serve
  (assumptions: neither is published).
`COSTS["serving-bed"]` is the 2-core bed's `serving` profile as measured, its store paced.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from ..decision import POLICIES, ROUTINGS
from ..errors import ConfigError, ConfigTypeError, InvalidArgument
from ..validate import check_bool, check_float, check_int, check_str, fail_type, fail_value, show

WORKLOADS = ("chat", "fanout", "agentic", "servegen-photos", "trace")
IMAGE_TOKENS = ("fixed576", "qwen2vl")  # and "fixed:N" (`parse_image_tokens`)
MAX_FIXED_IMAGE_TOKENS = 1 << 20  # "fixed:N": far past any model's image, and a bounded int
MAX_MEAN_TURNS = 500.0
SERVEGEN_HOURS = 24  # ServeGen's day (mmreuse.sim.servegen.HOURS)


def _field(obj: Any, name: str) -> str:
    return f"{type(obj).__name__}.{name}"


def _check_numbers(obj: Any, *names: str, positive: bool = False) -> None:
    """Each field a real number (not NaN) >= 0, or > 0 with `positive`; ints stay ints."""
    for name in names:
        check_float(_field(obj, name), getattr(obj, name), 0, finite=False, lo_open=positive)


def _check_ints(obj: Any, *names: str, lo: int) -> None:
    """Each field an int >= lo (numpy integers become plain ints)."""
    for name in names:
        object.__setattr__(obj, name, check_int(_field(obj, name), getattr(obj, name), lo))


def _check_choice(obj: Any, name: str, choices: tuple[str, ...], what: str) -> None:
    value = getattr(obj, name)
    if not isinstance(value, str) or value not in choices:
        fail_value(_field(obj, name), what, value)


def _check_span(obj: Any, name: str) -> None:
    """A (lo, hi) pair of ints with 0 <= lo <= hi."""
    value = getattr(obj, name)
    if not (
        isinstance(value, tuple)
        and len(value) == 2
        and all(type(v) is int for v in value)
        and 0 <= value[0] <= value[1]
    ):
        fail_value(_field(obj, name), "(lo, hi) ints with 0 <= lo <= hi", value)


def parse_image_tokens(field: str, value: Any) -> int | None:
    """The tokens of every image under `WorkloadConfig.image_tokens` = `value`: 576 for
    "fixed576", N for "fixed:N", None for "qwen2vl" (drawn per image); InvalidArgument naming
    `field` for anything else."""
    what = "'fixed576', 'qwen2vl' or 'fixed:N' (N an int >= 1, as in 'fixed:16')"
    if not isinstance(value, str):
        fail_type(field, what, value)
    if value == "qwen2vl":
        return None
    if value == "fixed576":
        return 576
    digits = value.removeprefix("fixed:")
    # canonical decimal only: int() would also take "+16", " 16", "1_6", "016" or "١٦"
    if digits == value or not (digits.isascii() and digits.isdigit()) or digits[0] == "0":
        fail_value(field, what, value)
    if len(digits) > len(str(MAX_FIXED_IMAGE_TOKENS)) or int(digits) > MAX_FIXED_IMAGE_TOKENS:
        fail_value(field, f"'fixed:N' with N <= {MAX_FIXED_IMAGE_TOKENS}", value)
    return int(digits)


@dataclass(frozen=True, slots=True)
class CostModel:
    """What each step costs (ms, bytes, GB/s); defaults in the module docstring."""

    encoder_ms_per_token: float = 0.062
    prefill_ms_per_token: float = 0.046
    prefill_fixed_ms: float = 5.0
    embedding_bytes_per_token: int = 7168
    e_to_p_gb_per_s: float = 0.413
    e_to_p_latency_ms: float = 0.2
    external_gb_per_s: float = 0.956
    external_latency_ms: float = 0.2
    demand_rtt_ms: float = 1.0
    e_cache_hit_ms: float = 0.5
    render_fixed_ms: float = 1.7
    render_ms_per_image: float = 12.2

    def __post_init__(self) -> None:
        rates = ("e_to_p_gb_per_s", "external_gb_per_s")
        _check_ints(self, "embedding_bytes_per_token", lo=0)
        _check_numbers(
            self,
            *(
                f.name
                for f in fields(self)
                if f.name not in rates and f.name != "embedding_bytes_per_token"
            ),
        )
        _check_numbers(self, *rates, positive=True)

    def transfer_ms(self, tokens: int) -> float:
        """E -> P transfer time of `tokens` embedding rows."""
        return self.e_to_p_latency_ms + tokens * self.embedding_bytes_per_token / (
            self.e_to_p_gb_per_s * 1e6
        )

    def render_ms(self, images: int) -> float:
        """P's render of a request with `images` images its processor cache has not seen."""
        return self.render_fixed_ms + images * self.render_ms_per_image

    def external_ms(self, tokens: int) -> float:
        """P's load time of `tokens` embedding rows from the external store."""
        return self.external_latency_ms + tokens * self.embedding_bytes_per_token / (
            self.external_gb_per_s * 1e6
        )


# The cost models `SimConfig`'s "cost" may name: a GPU deployment's (the defaults, above), and
# the 2-core bed's `serving` profile with its store paced (BENCHMARKS.md, "Stage costs of the
# serving profile": encode 0.85 ms a token without the put, prefill 0.95 ms a token (the text
# prompt's whole time, so no fixed part), 2,048 bytes a token through 14.5 then 18.2 MiB/s,
# render 46 ms for a one-image request (fixed and per-image parts not told apart), E's cache
# hit its frontend's 24 ms; the demand round trip and P's step are not measured: kept).
COSTS: dict[str, CostModel] = {
    "gpu": CostModel(),
    "serving-bed": CostModel(
        encoder_ms_per_token=0.85,
        prefill_ms_per_token=0.95,
        prefill_fixed_ms=0.0,
        embedding_bytes_per_token=2048,
        e_to_p_gb_per_s=0.00846,
        e_to_p_latency_ms=0.0,
        external_gb_per_s=0.01908,
        external_latency_ms=0.0,
        demand_rtt_ms=1.0,
        e_cache_hit_ms=24.0,
        render_fixed_ms=0.0,
        render_ms_per_image=46.0,
    ),
}


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    """The instances, their cache sizes, routing and the `index` policy's view lag."""

    num_encoders: int = 2
    num_prefills: int = 2
    block_size: int = 16
    p_kv_blocks: int = 8192  # per P instance (131k tokens at block size 16)
    p_encoder_cache_embeds: int = 16384  # vLLM's encoder_cache_size, in embeddings
    e_cache_embeds: int = 32768  # per E instance; 0 disables E's cache
    external_store_embeds: int = 0  # shared by P instances; 0 disables it
    # E reads the external store too before a forward (a shared store E writes and every
    # instance's EC connector asks, as the Mooncake Store is): a hit there is an E-cache hit
    e_reads_external_store: bool = False
    prefix_caching: bool = True
    routing: str = "affine"  # "affine" (session -> P) | "random"
    view_lag_ms: float = 50.0  # how far behind the index policy's view runs

    def __post_init__(self) -> None:
        _check_ints(self, "num_encoders", "num_prefills", "block_size", "p_kv_blocks", lo=1)
        _check_ints(self, "p_encoder_cache_embeds", "e_cache_embeds", "external_store_embeds", lo=0)
        check_bool(_field(self, "prefix_caching"), self.prefix_caching)
        check_bool(_field(self, "e_reads_external_store"), self.e_reads_external_store)
        _check_choice(self, "routing", ROUTINGS, "'affine' or 'random'")
        _check_numbers(self, "view_lag_ms")


@dataclass(frozen=True, slots=True)
class WorkloadConfig:
    """The request stream (`mmreuse.sim.workload.generate`). `image_tokens`, the tokens of each
    generated image: "fixed576" (576), "fixed:N" (N, an int in [1, MAX_FIXED_IMAGE_TOKENS]
    written in plain decimal: "fixed:16" fits the CPU cluster's tiny model), or "qwen2vl" (a
    random resolution per image, 64..2304 tokens). A trace's images carry their own counts,
    and so do servegen-photos' (ServeGen's image tokens, `mmreuse.sim.workload`)."""

    kind: str = "chat"
    requests: int = 2000  # turns in total
    sessions_per_s: float = 2.0  # Poisson session arrivals
    mean_turns: float = 9.0  # chat: 1 + Poisson(mean - 1), after MMDU-45k
    images_per_session: tuple[int, int] = (2, 5)  # chat: uniform in [lo, hi]
    image_tokens: str = "fixed576"  # "fixed576" | "fixed:N" | "qwen2vl" (see above)
    text_tokens: tuple[int, int] = (30, 150)  # per user turn
    output_tokens: tuple[int, int] = (50, 300)  # per assistant turn, resent in history
    think_time_s: float = 8.0  # mean, exponential
    fanout_pool: int = 50  # fanout: distinct images, Zipf-popular
    trace_path: str | None = None
    # servegen-photos (mmreuse.sim.workload): request shapes and arrivals from this entry of
    # the ServeGen table, its arrival process starting at this hour of ServeGen's day
    servegen_client: str = "all"
    servegen_hour: int = 0
    # servegen-photos: caps for a small server (0: none); a draw above one is clipped to it
    max_images: int = 0  # per request
    max_text_tokens: int = 0  # per user turn
    max_output_tokens: int = 0  # per assistant turn

    def __post_init__(self) -> None:
        _check_choice(self, "kind", WORKLOADS, f"one of {WORKLOADS}")
        _check_ints(self, "requests", "fanout_pool", lo=1)
        _check_numbers(self, "sessions_per_s", "think_time_s", positive=True)
        # Knuth's Poisson sampler underflows e^-lam past ~745: larger means would come out wrong
        check_float(_field(self, "mean_turns"), self.mean_turns, 1, MAX_MEAN_TURNS)
        parse_image_tokens(_field(self, "image_tokens"), self.image_tokens)
        for name in ("images_per_session", "text_tokens", "output_tokens"):
            _check_span(self, name)
        if self.trace_path is not None:
            check_str(_field(self, "trace_path"), self.trace_path)
            try:  # what open() would refuse, refused here with the field's name
                if b"\0" in os.fsencode(self.trace_path):
                    raise ValueError
            except (UnicodeError, ValueError):
                fail_value(
                    _field(self, "trace_path"), "a file path (no NUL, valid UTF-8)", self.trace_path
                )
        if self.kind == "trace" and not self.trace_path:
            raise InvalidArgument("WorkloadConfig.trace_path is required with kind='trace'")
        check_str(_field(self, "servegen_client"), self.servegen_client, nonempty=True)
        _check_ints(self, "max_images", "max_text_tokens", "max_output_tokens", lo=0)
        object.__setattr__(
            self,
            "servegen_hour",
            check_int(_field(self, "servegen_hour"), self.servegen_hour, 0, SERVEGEN_HOURS - 1),
        )
        if self.kind == "servegen-photos":
            from .servegen import shipped_table

            names = shipped_table().names
            if self.servegen_client not in names:
                fail_value(_field(self, "servegen_client"), f"one of {names}", self.servegen_client)

    @property
    def fixed_image_tokens(self) -> int | None:
        """Every image's tokens under `image_tokens`; None for "qwen2vl" (drawn per image)."""
        return parse_image_tokens(_field(self, "image_tokens"), self.image_tokens)


@dataclass(frozen=True, slots=True)
class SimConfig:
    """One simulation: a seed, the policies to compare, and the three sections above."""

    seed: int = 0
    policies: tuple[str, ...] = POLICIES
    cost: CostModel = field(default_factory=CostModel)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)

    def __post_init__(self) -> None:
        object.__setattr__(self, "seed", check_int("SimConfig.seed", self.seed))
        if not isinstance(self.policies, tuple):
            fail_type("SimConfig.policies", "a tuple of policy names", self.policies)
        for p in self.policies:
            if not isinstance(p, str) or p not in POLICIES:
                fail_value("policy", f"one of {POLICIES}", p)
        if not self.policies:
            raise InvalidArgument("SimConfig.policies must not be empty")
        if len(set(self.policies)) != len(self.policies):
            fail_value("SimConfig.policies", "distinct policy names", list(self.policies))
        for name, kind in (
            ("cost", CostModel),
            ("cluster", ClusterConfig),
            ("workload", WorkloadConfig),
        ):
            if not isinstance(getattr(self, name), kind):
                fail_type(f"SimConfig.{name}", f"a {kind.__name__}", getattr(self, name))

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Any) -> SimConfig:
        """A config from JSON-like values: every key optional, unknown keys refused; a bad value
        raises ConfigError naming its dotted field (`cluster.num_prefills`). "cost" is an object
        of CostModel's fields, or the name of one of `COSTS`."""
        if not isinstance(d, dict):
            raise config_error("config", f"must be an object, got {_shown(d)}", True)
        _refuse_unknown("", d, TOP_KEYS)
        policies = d.get("policies", list(POLICIES))
        if not isinstance(policies, (list, tuple)):
            raise config_error(
                "policies", f"must be a list of policy names, got {_shown(policies)}", True
            )
        for i, p in enumerate(policies):
            if not isinstance(p, str) or p not in POLICIES:
                raise ConfigError.on(
                    f"policies[{i}]", f"must be a policy name, one of {POLICIES}, got {show(p)}"
                )
        cost = d.get("cost")
        if isinstance(cost, str):  # a cost model by name
            if cost not in COSTS:
                raise ConfigError.on(
                    "cost", f"must be an object or one of {sorted(COSTS)}, got {show(cost)}"
                )
            d = {**d, "cost": asdict(COSTS[cost])}
        sections = {name: _build(name, kind, d.get(name, {})) for name, kind in SECTIONS.items()}
        try:
            return cls(seed=d.get("seed", 0), policies=tuple(policies), **sections)
        except InvalidArgument as exc:
            raise _located(exc, "SimConfig.", "") from None

    @classmethod
    def from_file(cls, path: str | Path) -> SimConfig:
        """`from_dict` of a JSON file; every error reads `<path>: <field>: <what is wrong>`."""
        try:
            return cls.from_dict(load_json(path))
        except ConfigError as exc:
            raise exc.located(str(path)) from None


SECTIONS: dict[str, type[CostModel] | type[ClusterConfig] | type[WorkloadConfig]] = {
    "cost": CostModel,
    "cluster": ClusterConfig,
    "workload": WorkloadConfig,
}
TOP_KEYS = ("seed", "policies", *SECTIONS)
MAX_CONFIG_BYTES = 1 << 20  # a config is a few hundred bytes; this bounds reading /dev/zero


def config_error(field: str, problem: str, wrong_type: bool = False) -> ConfigError:
    return (ConfigTypeError if wrong_type else ConfigError).on(field, problem)


def _shown(value: Any) -> str:
    """A JSON value for a message: its type and value (`null` for None)."""
    return "null" if value is None else f"{type(value).__name__} {show(value)}"


def _refuse_unknown(prefix: str, values: dict, known: tuple[str, ...]) -> None:
    for key in values:
        if key not in known:
            name = key if isinstance(key, str) and key.isidentifier() else show(key)
            raise ConfigError.on(f"{prefix}{name}", f"unknown key (known: {', '.join(known)})")


def _located(exc: InvalidArgument, prefix: str, section: str) -> ConfigError:
    """A section's own error ("ClusterConfig.routing must be ...") as a ConfigError on the
    dotted field ("cluster.routing")."""
    message, wrong_type = str(exc), isinstance(exc, TypeError)
    if message.startswith(prefix):
        name, _, problem = message[len(prefix) :].partition(" ")
        return config_error(f"{section}{name}", problem, wrong_type)
    return config_error(section.rstrip(".") or "config", message, wrong_type)


def _build(name: str, kind: Any, values: Any) -> Any:
    if not isinstance(values, dict):
        raise config_error(name, f"must be an object, got {_shown(values)}", True)
    _refuse_unknown(f"{name}.", values, tuple(f.name for f in fields(kind)))
    values = {k: tuple(v) if isinstance(v, list) else v for k, v in values.items()}
    try:
        return kind(**values)
    except InvalidArgument as exc:
        raise _located(exc, f"{kind.__name__}.", f"{name}.") from None


def load_json(path: str | Path) -> Any:
    """A config file's JSON value; ConfigError on field `config file` if it cannot be read, is
    too big, is not UTF-8 or is not JSON."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise ConfigError.on("config file", f"cannot be read ({exc.strerror or exc})") from None
    except ValueError as exc:  # an embedded NUL in the path
        raise ConfigError.on("config file", f"cannot be read ({exc})") from None
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError.on("config file", f"is larger than {MAX_CONFIG_BYTES} bytes")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError.on("config file", f"is not UTF-8 (byte {exc.start})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError.on(
            "config file", f"invalid JSON at line {exc.lineno} column {exc.colno} ({exc.msg})"
        ) from None
    except (ValueError, RecursionError) as exc:  # a 5000-digit int, [[[[...]]]] nested too deep
        reason = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
        raise ConfigError.on("config file", f"invalid JSON ({reason})") from None
