"""Real multimodal request shapes: the table derived from Alibaba's ServeGen (Apache-2.0).

`mmreuse/sim/data/servegen_mm_image.json` holds, for the busiest clients of ServeGen's Qwen-VL
image workload and for all of them together ("all"), the day-level distributions of images per
request, image tokens per image, text (input) tokens and output tokens, and 24 hourly arrival
rates with the inter-arrival CV. `tools/servegen_table.py` derives it from the ServeGen
repository (source, commit, licence and attribution are in the table's `source`);
docs/simulator.md says how to regenerate it.

    table = load_table()
    requests = sample_requests(table.client("client-12"), 1000, seed=0)

The sampler draws each field independently from its marginal (the data holds no joint law),
token counts by linear interpolation of the quantile table, rounded; arrivals per hour as a
Gamma renewal process with the hour's rate and CV, restarted at each hour (as ServeGen's own
generator does per window), the day repeating. The simulator's `servegen-photos` workload
(`mmreuse.sim.workload`) draws its sessions from it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

import numpy as np

from ..errors import InvalidArgument
from ..validate import check_float, check_int, check_str, fail_type, fail_value, show

__all__ = [
    "FORMAT",
    "TABLE_NAME",
    "ClientDistribution",
    "Pmf",
    "Quantiles",
    "ServeGenRequest",
    "ServeGenTable",
    "load_table",
    "parse_table",
    "sample_requests",
    "shipped_table",
]

FORMAT = "mmreuse.servegen/1"
TABLE_NAME = "servegen_mm_image.json"
HOURS = 24
_PROB_TOL = 1e-6
_MAX_HOURS = 24 * 366 * 10  # a sampler that finds no arrivals in ten years has a broken table


@dataclass(frozen=True, slots=True)
class Pmf:
    """An exact distribution over ints: `values` strictly increasing, `probs` summing to 1."""

    values: tuple[int, ...]
    probs: tuple[float, ...]
    mean: float  # as the table records it (the source's exact mean)

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        cdf = np.cumsum(self.probs)
        idx = np.searchsorted(cdf / cdf[-1], rng.random(n), side="right")
        return np.asarray(self.values, dtype=np.int64)[np.minimum(idx, len(self.values) - 1)]


@dataclass(frozen=True, slots=True)
class Quantiles:
    """A distribution over ints given by its quantile function on a grid: `values[i]` is
    Q(probs[i]) = min{v : F(v) >= probs[i]}, probs from 0 to 1, values non-decreasing."""

    probs: tuple[float, ...]
    values: tuple[int, ...]
    mean: float  # the source's exact mean (the interpolating sampler's differs slightly)

    def quantile(self, p: float) -> float:
        """The piecewise-linear quantile function the sampler draws from, at p in [0, 1]."""
        return float(np.interp(p, self.probs, self.values))

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        x = np.interp(rng.random(n), self.probs, self.values)
        return np.floor(x + 0.5).astype(np.int64)


@dataclass(frozen=True, slots=True)
class ClientDistribution:
    """One entry of the table: a ServeGen client (or "all"), its request shapes and arrivals."""

    name: str
    source_clients: tuple[int, ...]  # ServeGen's client ids (the chunk-<id> files)
    requests_per_day: float
    share: float  # of all mm-image requests in the day
    images_per_request: Pmf
    image_tokens_per_image: Quantiles
    text_tokens: Quantiles
    output_tokens: Quantiles
    hourly_rate: tuple[float, ...]  # 24 values, req/s (ServeGen's published scale)
    hourly_cv: tuple[float, ...]  # 24 values, > 0: the inter-arrival times' CV

    @property
    def mean_rate(self) -> float:
        """The day's mean rate, req/s."""
        return math.fsum(self.hourly_rate) / HOURS


@dataclass(frozen=True, slots=True)
class ServeGenTable:
    format: str
    source: Mapping[str, Any]  # repository, commit, paths, licence, notice, citation
    derivation: str
    quantile_probs: tuple[float, ...]
    clients: tuple[ClientDistribution, ...]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.clients)

    def client(self, name: str) -> ClientDistribution:
        for c in self.clients:
            if c.name == name:
                return c
        raise InvalidArgument(f"client must be one of {', '.join(self.names)}, got {show(name)}")


@dataclass(frozen=True, slots=True)
class ServeGenRequest:
    """One sampled request: when it arrives and its shape."""

    arrival_s: float  # from the start of the stream
    image_tokens: tuple[int, ...]  # one entry per image, in order
    text_tokens: int
    output_tokens: int

    @property
    def images(self) -> int:
        return len(self.image_tokens)


# --- validation --------------------------------------------------------------------------------


def _object(field: str, value: Any, keys: tuple[str, ...]) -> Mapping[str, Any]:
    """A JSON object with exactly `keys`."""
    if not isinstance(value, dict):
        fail_type(field, "an object", value)
    missing = [k for k in keys if k not in value]
    if missing:
        raise InvalidArgument(f"{field} is missing {', '.join(missing)}")
    unknown = sorted(set(value) - set(keys), key=str)
    if unknown:
        raise InvalidArgument(f"{field} has unknown fields {', '.join(map(show, unknown))}")
    return value


def _list(field: str, value: Any, length: int | None = None, nonempty: bool = True) -> list[Any]:
    if not isinstance(value, list):
        fail_type(field, "a list", value)
    if length is not None and len(value) != length:
        fail_value(field, f"a list of {length} values (got {len(value)})", value)
    if nonempty and not value:
        fail_value(field, "a non-empty list", value)
    return value


def _probs_sum(field: str, probs: list[float]) -> None:
    total = math.fsum(probs)
    if abs(total - 1.0) > _PROB_TOL:
        raise InvalidArgument(f"{field} must sum to 1, got {total!r}")


def _grid(field: str, value: Any) -> tuple[float, ...]:
    items = _list(field, value)
    probs = [check_float(f"{field}[{i}]", p, 0.0, 1.0) for i, p in enumerate(items)]
    if len(probs) < 2 or probs[0] != 0.0 or probs[-1] != 1.0:
        fail_value(field, "probabilities from 0.0 to 1.0 (at least two)", value)
    for i in range(1, len(probs)):
        if probs[i] <= probs[i - 1]:
            fail_value(f"{field}[{i}]", f"> {field}[{i - 1}] ({probs[i - 1]!r})", items[i])
    return tuple(probs)


def _pmf(field: str, value: Any) -> Pmf:
    obj = _object(field, value, ("values", "probs", "mean"))
    values = [
        check_int(f"{field}.values[{i}]", v, 0)
        for i, v in enumerate(_list(f"{field}.values", obj["values"]))
    ]
    for i in range(1, len(values)):
        if values[i] <= values[i - 1]:
            fail_value(f"{field}.values[{i}]", f"> {values[i - 1]} (increasing)", values[i])
    raw = _list(f"{field}.probs", obj["probs"], len(values))
    probs = [check_float(f"{field}.probs[{i}]", p, 0.0, 1.0) for i, p in enumerate(raw)]
    _probs_sum(f"{field}.probs", probs)
    mean = check_float(f"{field}.mean", obj["mean"], values[0], values[-1])
    return Pmf(tuple(values), tuple(probs), mean)


def _quantiles(field: str, value: Any, grid: tuple[float, ...], lo: int) -> Quantiles:
    obj = _object(field, value, ("quantiles", "mean"))
    raw = _list(f"{field}.quantiles", obj["quantiles"], len(grid))
    values = [check_int(f"{field}.quantiles[{i}]", v, lo) for i, v in enumerate(raw)]
    for i in range(1, len(values)):
        if values[i] < values[i - 1]:
            fail_value(f"{field}.quantiles[{i}]", f">= {values[i - 1]} (non-decreasing)", values[i])
    mean = check_float(f"{field}.mean", obj["mean"], values[0], values[-1])
    return Quantiles(grid, tuple(values), mean)


_CLIENT_KEYS = (
    "name",
    "source_clients",
    "requests_per_day",
    "share",
    "images_per_request",
    "image_tokens_per_image",
    "text_tokens",
    "output_tokens",
    "hourly_rate",
    "hourly_cv",
)


def _client(field: str, value: Any, grid: tuple[float, ...]) -> ClientDistribution:
    obj = _object(field, value, _CLIENT_KEYS)
    name = check_str(f"{field}.name", obj["name"], nonempty=True)
    ids = _list(f"{field}.source_clients", obj["source_clients"])
    rates = _list(f"{field}.hourly_rate", obj["hourly_rate"], HOURS)
    cvs = _list(f"{field}.hourly_cv", obj["hourly_cv"], HOURS)
    hourly_rate = tuple(
        check_float(f"{field}.hourly_rate[{h}]", r, 0.0) for h, r in enumerate(rates)
    )
    if not any(hourly_rate):
        fail_value(f"{field}.hourly_rate", "some rate > 0", rates)
    return ClientDistribution(
        name=name,
        source_clients=tuple(
            check_int(f"{field}.source_clients[{i}]", c, 0) for i, c in enumerate(ids)
        ),
        requests_per_day=check_float(f"{field}.requests_per_day", obj["requests_per_day"], 0.0),
        share=check_float(f"{field}.share", obj["share"], 0.0, 1.0),
        images_per_request=_pmf(f"{field}.images_per_request", obj["images_per_request"]),
        image_tokens_per_image=_quantiles(
            f"{field}.image_tokens_per_image", obj["image_tokens_per_image"], grid, 1
        ),
        text_tokens=_quantiles(f"{field}.text_tokens", obj["text_tokens"], grid, 0),
        output_tokens=_quantiles(f"{field}.output_tokens", obj["output_tokens"], grid, 0),
        hourly_rate=hourly_rate,
        hourly_cv=tuple(
            check_float(f"{field}.hourly_cv[{h}]", c, 0.0, lo_open=True) for h, c in enumerate(cvs)
        ),
    )


def parse_table(obj: Any, where: str = TABLE_NAME) -> ServeGenTable:
    """The table from its JSON object, checked field by field: InvalidArgument (or
    InvalidArgumentType) naming `where`, the field and the value for anything wrong."""
    try:
        top = _object("table", obj, ("format", "source", "derivation", "quantile_probs", "clients"))
        if top["format"] != FORMAT:
            fail_value("table.format", repr(FORMAT), top["format"])
        source = _object(
            "table.source",
            top["source"],
            (
                "repository",
                "commit",
                "paths",
                "clients_in_source",
                "licence",
                "licence_url",
                "notice",
                "citation",
            ),
        )
        for key in ("repository", "commit", "licence", "licence_url", "notice", "citation"):
            check_str(f"table.source.{key}", source[key], nonempty=True)
        for i, path in enumerate(_list("table.source.paths", source["paths"])):
            check_str(f"table.source.paths[{i}]", path, nonempty=True)
        check_int("table.source.clients_in_source", source["clients_in_source"], 1)
        if source["licence"] != "Apache-2.0":
            fail_value("table.source.licence", "'Apache-2.0'", source["licence"])
        derivation = check_str("table.derivation", top["derivation"], nonempty=True)
        grid = _grid("table.quantile_probs", top["quantile_probs"])
        items = _list("table.clients", top["clients"])
        clients = tuple(_client(f"table.clients[{i}]", c, grid) for i, c in enumerate(items))
        seen: set[str] = set()
        for i, c in enumerate(clients):
            if c.name in seen:
                fail_value(f"table.clients[{i}].name", "unique", c.name)
            seen.add(c.name)
    except InvalidArgument as exc:
        raise type(exc)(f"{where}: {exc}") from None
    return ServeGenTable(FORMAT, dict(source), derivation, grid, clients)


def load_table() -> ServeGenTable:
    """The table shipped in the package (mmreuse/sim/data/servegen_mm_image.json), checked."""
    text = resources.files("mmreuse.sim").joinpath("data").joinpath(TABLE_NAME).read_text("utf-8")
    return parse_table(json.loads(text))


@cache
def shipped_table() -> ServeGenTable:
    """`load_table()`, read and checked once per process: the shipped file does not change, and
    every servegen-photos WorkloadConfig and stream asks for it."""
    return load_table()


# --- sampling ----------------------------------------------------------------------------------


def _arrivals(
    dist: ClientDistribution, n: int, rng: np.random.Generator, start_hour: int, rate_scale: float
) -> np.ndarray:
    """The first n arrival times (s): per hour a Gamma renewal process with the hour's rate
    (x rate_scale) and CV, restarted at the hour's start; the day repeats."""
    out: list[np.ndarray] = []
    have, hour = 0, 0
    while have < n:
        if hour >= _MAX_HOURS:
            raise InvalidArgument(f"{dist.name}: no arrivals in {_MAX_HOURS} hours")
        h = (start_hour + hour) % HOURS
        rate = dist.hourly_rate[h] * rate_scale
        if rate > 0:
            shape = 1.0 / dist.hourly_cv[h] ** 2  # mean 1/rate, CV cv: Gamma(1/cv^2, cv^2/rate)
            scale = 1.0 / (rate * shape)
            times = np.empty(0)
            t = 0.0
            while t < 3600.0:  # draw until the hour is covered (usually once)
                batch = np.cumsum(rng.gamma(shape, scale, int(rate * 3600 * 1.2) + 16)) + t
                times = np.concatenate([times, batch])
                t = float(batch[-1])
            times = times[times < 3600.0]
            out.append(times + hour * 3600.0)
            have += len(times)
        hour += 1
    return np.concatenate(out)[:n]


def sample_requests(
    dist: ClientDistribution,
    n: int,
    seed: int,
    *,
    start_hour: int = 0,
    rate_scale: float = 1.0,
) -> list[ServeGenRequest]:
    """n requests drawn from `dist`, sorted by arrival, the same for the same arguments.

    `start_hour` is the hour of ServeGen's day the stream starts at; `rate_scale` multiplies
    every hourly rate (ServeGen's published scale is ~9.5 req/s for all clients together).
    Images per request from its PMF; each image's tokens, the text and the output tokens from
    their quantile tables (linear interpolation, rounded); every draw independent."""
    n = check_int("n", n, 0)
    seed = check_int("seed", seed, 0)
    start_hour = check_int("start_hour", start_hour, 0, HOURS - 1)
    rate_scale = check_float("rate_scale", rate_scale, 0.0, lo_open=True)
    if not isinstance(dist, ClientDistribution):
        fail_type("dist", "a ClientDistribution", dist)
    if n == 0:
        return []
    rng = np.random.default_rng(seed)
    arrivals = _arrivals(dist, n, rng, start_hour, rate_scale)
    images = dist.images_per_request.sample(rng, n)
    per_image = dist.image_tokens_per_image.sample(rng, int(images.sum()))
    text = dist.text_tokens.sample(rng, n)
    output = dist.output_tokens.sample(rng, n)
    ends = np.cumsum(images)
    starts = ends - images
    return [
        ServeGenRequest(
            float(arrivals[i]),
            tuple(per_image[starts[i] : ends[i]].tolist()),
            int(text[i]),
            int(output[i]),
        )
        for i in range(n)
    ]
