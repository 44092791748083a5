"""TTFT per request class for `mmreuse bench-cluster`: does a policy delay the requests whose
images are new (the RFC's Q3), and how much does it save on the others?

Each request of a stream is classed by its media items at arrival (`classify`): `new` (every
item's uuid is seen for the first time in the run), `mixed` (some are), `reused` (none are), and
`text` (no media). The stream is the same in every run, so the classes are too.

Runs are repeated and interleaved (`interleave`: eager, index, demand, reference, eager, ...),
each from cold caches; per policy and class (`summarize`): the median over runs of each run's
median TTFT, its spread (min-max over runs), the median over runs of each run's p90; and the
paired difference against a baseline policy (`eager`, vLLM's `reference`): per run r, the
median over the class's requests i of TTFT(policy, r, i) - TTFT(baseline, r, i), then its median
and spread over runs. Pairing request by request takes out what the stream itself varies (one
request has a long prompt, another many images), so a difference of a few ms shows where the
TTFTs themselves spread over hundreds. A class with a handful of requests a run makes each run's
median jumpy under load, so the pairs of every run are also pooled (`pooled_paired`): their
median and a distribution-free 95 % interval for it (binomial order statistics; pairs of one run
share its load, so the interval is a lower bound on the uncertainty, beside the spread over
runs). Also per class: how many items E got, and the proxy's render time (median per run), where
it rendered.

Pure functions on plain values: `mmreuse.cluster.bench` turns each run's outcomes into
`Observed` values.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import InvalidArgument
from ..validate import check_float, check_int, check_str, fail_type, fail_value

__all__ = [
    "BASELINES",
    "CLASSES",
    "MIXED",
    "NEW",
    "REUSED",
    "TEXT",
    "ClassRun",
    "Observed",
    "class_runs",
    "class_table",
    "classify",
    "interleave",
    "median_interval",
    "paired_median",
    "pooled_paired",
    "send_offsets",
    "summarize",
]

NEW, MIXED, REUSED, TEXT = "new", "mixed", "reused", "text"
CLASSES = (NEW, MIXED, REUSED, TEXT)
BASELINES = ("eager", "reference")  # what every policy is paired against, when it ran


def classify(uuids: Sequence[Sequence[str]]) -> list[str]:
    """Each request's class, the requests in arrival order, each given by its media items'
    uuids: `new` if none of its uuids came in an earlier request, `reused` if all did, `mixed`
    otherwise, `text` without media. (An item repeated within a request counts as its first
    occurrence's: the request brings it.)"""
    if isinstance(uuids, (str, bytes)) or not isinstance(uuids, Sequence):
        fail_type("uuids", "a sequence of uuid sequences", uuids)
    seen: set[str] = set()
    out = []
    for i, items in enumerate(uuids):
        if isinstance(items, (str, bytes)) or not isinstance(items, Sequence):
            fail_type(f"uuids[{i}]", "a sequence of uuids", items)
        for j, u in enumerate(items):
            check_str(f"uuids[{i}][{j}]", u, nonempty=True)
        if not items:
            out.append(TEXT)
            continue
        known = [u in seen for u in items]
        out.append(REUSED if all(known) else NEW if not any(known) else MIXED)
        seen.update(items)
    return out


def send_offsets(arrivals_s: Sequence[float]) -> list[float]:
    """When each request leaves (s, from the first): its arrival less the first's. Arrivals
    must be finite and non-decreasing (a stream sorted by arrival)."""
    if isinstance(arrivals_s, (str, bytes)) or not isinstance(arrivals_s, Sequence):
        fail_type("arrivals_s", "a sequence of numbers", arrivals_s)
    out: list[float] = []
    for i, a in enumerate(arrivals_s):
        a = check_float(f"arrivals_s[{i}]", a, 0)
        if out and a < arrivals_s[i - 1]:
            fail_value(f"arrivals_s[{i}]", f">= arrivals_s[{i - 1}] ({arrivals_s[i - 1]})", a)
        out.append(a)
    return [a - out[0] for a in out]


def interleave(policies: Sequence[str], repeats: int) -> list[tuple[int, str]]:
    """The runs in order, (repeat, policy): every policy once per round, in the given order,
    `repeats` rounds. Alternating spreads a drift of the machine (another job, a warming cache)
    over every policy instead of charging it to the one that ran last."""
    repeats = check_int("repeats", repeats, 1)
    if isinstance(policies, (str, bytes)) or not isinstance(policies, Sequence) or not policies:
        fail_value("policies", "a non-empty sequence of policy names", policies)
    for i, p in enumerate(policies):
        check_str(f"policies[{i}]", p, nonempty=True)
    if len(set(policies)) != len(policies):
        fail_value("policies", "distinct policy names", list(policies))
    return [(r, p) for r in range(repeats) for p in policies]


@dataclass(frozen=True, slots=True)
class Observed:
    """One request in one run: its TTFT (None: it failed, or streamed no token), its media
    items, how many of them E got, and the proxy's render of it (None: not rendered)."""

    ttft_ms: float | None
    items: int
    e_items: int
    render_ms: float | None = None


@dataclass(frozen=True, slots=True)
class ClassRun:
    """One class in one run: requests, those answered, their TTFT median and p90 (None when
    none answered), items and E's items in all, the median render (None: none rendered)."""

    requests: int
    answered: int
    ttft_median_ms: float | None
    ttft_p90_ms: float | None
    items: int
    e_items: int
    render_median_ms: float | None


def _p90(values: Sequence[float]) -> float:
    """The 90th percentile, linearly interpolated (numpy's default)."""
    xs = sorted(values)
    k = (len(xs) - 1) * 0.9
    lo = math.floor(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def _check_run(classes: Sequence[str], run: Sequence[Observed], field: str) -> None:
    if len(run) != len(classes):
        raise InvalidArgument(
            f"{field} must hold one observation per request ({len(classes)}), got {len(run)}"
        )
    for i, o in enumerate(run):
        if not isinstance(o, Observed):
            fail_type(f"{field}[{i}]", "an Observed", o)
    for i, c in enumerate(classes):
        if c not in CLASSES:
            fail_value(f"classes[{i}]", f"one of {CLASSES}", c)


def class_runs(classes: Sequence[str], run: Sequence[Observed]) -> dict[str, ClassRun]:
    """Per class (those with requests), what one run did to its requests."""
    _check_run(classes, run, "run")
    out = {}
    for cls in CLASSES:
        mine = [o for c, o in zip(classes, run, strict=True) if c == cls]
        if not mine:
            continue
        ttfts = [o.ttft_ms for o in mine if o.ttft_ms is not None]
        renders = [o.render_ms for o in mine if o.render_ms is not None]
        out[cls] = ClassRun(
            requests=len(mine),
            answered=len(ttfts),
            ttft_median_ms=statistics.median(ttfts) if ttfts else None,
            ttft_p90_ms=_p90(ttfts) if ttfts else None,
            items=sum(o.items for o in mine),
            e_items=sum(o.e_items for o in mine),
            render_median_ms=statistics.median(renders) if renders else None,
        )
    return out


def paired_median(
    classes: Sequence[str], run: Sequence[Observed], base: Sequence[Observed]
) -> dict[str, float | None]:
    """Per class (those with requests): the median over its requests i answered in both runs
    of run[i].ttft - base[i].ttft (None where no request was answered in both)."""
    _check_run(classes, run, "run")
    _check_run(classes, base, "base")
    out: dict[str, float | None] = {}
    for cls in CLASSES:
        diffs = [
            o.ttft_ms - b.ttft_ms
            for c, o, b in zip(classes, run, base, strict=True)
            if c == cls and o.ttft_ms is not None and b.ttft_ms is not None
        ]
        if cls in classes:
            out[cls] = statistics.median(diffs) if diffs else None
    return out


def median_interval(
    values: Sequence[float], confidence: float = 0.95
) -> tuple[float, float] | None:
    """A distribution-free interval for the median of `values` (independent draws): the k-th
    smallest and k-th largest, k the largest rank such that a Binomial(n, 1/2) falls below it
    with probability at most (1 - confidence) / 2 (None: too few values for it)."""
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        fail_type("values", "a sequence of numbers", values)
    xs = sorted(check_float(f"values[{i}]", v) for i, v in enumerate(values))
    confidence = check_float("confidence", confidence, 0.0)
    if not confidence < 1.0:
        fail_value("confidence", "in [0, 1)", confidence)
    n, tail = len(xs), (1.0 - confidence) / 2
    k, below = 0, 0.0  # below: P(Binomial(n, 1/2) < k + 1)
    while k < n:
        below += math.comb(n, k) / 2**n
        if below > tail:
            break
        k += 1
    if k == 0:
        return None
    return xs[k - 1], xs[n - k]


def pooled_paired(
    classes: Sequence[str], runs: Sequence[Sequence[Observed]], bases: Sequence[Sequence[Observed]]
) -> dict[str, dict[str, Any] | None]:
    """Per class (those with requests): the paired differences run[r][i] - base[r][i] of every
    run r and request i answered in both, pooled: {"median", "ci_low", "ci_high", "pairs"}
    (`median_interval`; None bounds: too few pairs), None where no pair exists."""
    out: dict[str, dict[str, Any] | None] = {}
    diffs: dict[str, list[float]] = {c: [] for c in CLASSES if c in classes}
    for r, (run, base) in enumerate(zip(runs, bases, strict=False)):
        _check_run(classes, run, f"runs[{r}]")
        _check_run(classes, base, f"bases[{r}]")
        for c, o, b in zip(classes, run, base, strict=True):
            if o.ttft_ms is not None and b.ttft_ms is not None:
                diffs[c].append(o.ttft_ms - b.ttft_ms)
    for c, xs in diffs.items():
        if not xs:
            out[c] = None
            continue
        ci = median_interval(xs)
        out[c] = {
            "median": round(statistics.median(xs), 3),
            "ci_low": None if ci is None else round(ci[0], 3),
            "ci_high": None if ci is None else round(ci[1], 3),
            "pairs": len(xs),
        }
    return out


def _spread(values: Sequence[float | None]) -> dict[str, Any] | None:
    """{"median", "min", "max"} over runs of the values that exist (None: none does)."""
    xs = [v for v in values if v is not None]
    if not xs:
        return None
    return {
        "median": round(statistics.median(xs), 3),
        "min": round(min(xs), 3),
        "max": round(max(xs), 3),
    }


def summarize(
    classes: Sequence[str], runs: Mapping[str, Sequence[Sequence[Observed]]]
) -> dict[str, dict[str, dict[str, Any]]]:
    """Per policy, per class: over the policy's runs (`runs[policy][r]`, run r of every policy
    paired with run r of each baseline), the median TTFT (median over runs of each run's median,
    and its min-max), the p90 likewise, the paired differences against each baseline of
    `BASELINES` that ran (`vs_eager_ms`, `vs_reference_ms`: each run's median paired difference,
    their median and min-max over runs; `vs_eager_pooled_ms`, ...: `pooled_paired`), items and
    E's items (median over runs), the render's median, failed requests over all runs.
    JSON-ready."""
    if not isinstance(runs, Mapping):
        fail_type("runs", "a mapping of policy -> runs", runs)
    per_run = {p: [class_runs(classes, r) for r in rs] for p, rs in runs.items()}
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for policy, rs in runs.items():
        paired = {
            b: [paired_median(classes, r, base) for r, base in zip(rs, runs[b], strict=False)]
            for b in BASELINES
            if b in runs and b != policy
        }
        pooled = {b: pooled_paired(classes, rs, runs[b]) for b in paired}
        out[policy] = {}
        for cls in CLASSES:
            stats = [r[cls] for r in per_run[policy] if cls in r]
            if not stats:
                continue

            def med(values: list[float | None]) -> float | None:
                xs = [v for v in values if v is not None]
                return round(statistics.median(xs), 3) if xs else None

            entry: dict[str, Any] = {
                "requests": stats[0].requests,
                "runs": len(stats),
                "failed": sum(s.requests - s.answered for s in stats),
                "ttft_median_ms": _spread([s.ttft_median_ms for s in stats]),
                "ttft_p90_ms": _spread([s.ttft_p90_ms for s in stats]),
                "items": stats[0].items,
                "e_items": med([float(s.e_items) for s in stats]),
                "render_median_ms": med([s.render_median_ms for s in stats]),
            }
            for b in BASELINES:
                entry[f"vs_{b}_ms"] = (
                    _spread([d.get(cls) for d in paired[b]]) if b in paired else None
                )
                entry[f"vs_{b}_pooled_ms"] = pooled[b].get(cls) if b in pooled else None
            out[policy][cls] = entry
    return out


def _fmt(x: float | None, width: int) -> str:
    return f"{'-' if x is None else f'{x:.1f}':>{width}}"


def _fmt_spread(s: dict[str, Any] | None, signed: bool = False) -> str:
    if s is None:
        return f"{'-':>22}"
    sign = "+" if signed else ""
    return f"{s['median']:{sign}.1f} [{s['min']:{sign}.1f}, {s['max']:{sign}.1f}]".rjust(22)


def _fmt_pooled(s: Mapping[str, Any] | None) -> str:
    if s is None:
        return f"{'-':>30}"
    ci = "" if s["ci_low"] is None else f" [{s['ci_low']:+.1f}, {s['ci_high']:+.1f}]"
    return f"{s['median']:+.1f}{ci} n={s['pairs']}".rjust(30)


def class_table(summary: Mapping[str, Mapping[str, Mapping[str, Any]]]) -> str:
    """`summarize`'s result as a text table: one line per class and policy, then the pooled
    paired differences with their 95 % intervals."""
    head = (
        f"{'class':<7} {'policy':<13} {'reqs':>4} {'TTFT median [min, max]':>22} "
        f"{'p90':>7} {'vs eager [min, max]':>22} {'vs reference [min, max]':>22} "
        f"{'items':>5} {'E':>5} {'render':>6}"
    )
    lines = [head, "-" * len(head)]
    for cls in CLASSES:
        for policy, per in summary.items():
            e = per.get(cls)
            if e is None:
                continue
            p90 = e["ttft_p90_ms"]["median"] if e["ttft_p90_ms"] else None
            lines.append(
                f"{cls:<7} {policy:<13} {e['requests']:>4} {_fmt_spread(e['ttft_median_ms'])} "
                f"{_fmt(p90, 7)} {_fmt_spread(e['vs_eager_ms'], True)} "
                f"{_fmt_spread(e['vs_reference_ms'], True)} {e['items']:>5} "
                f"{_fmt(e['e_items'], 5)} {_fmt(e['render_median_ms'], 6)}"
            )
    head = f"{'class':<7} {'policy':<13} {'vs eager, pooled [95 % CI]':>30} {'vs reference, pooled':>30}"
    lines += ["", head, "-" * len(head)]
    for cls in CLASSES:
        for policy, per in summary.items():
            e = per.get(cls)
            if e is None or (
                e.get("vs_eager_pooled_ms") is None and e.get("vs_reference_pooled_ms") is None
            ):
                continue
            lines.append(
                f"{cls:<7} {policy:<13} {_fmt_pooled(e.get('vs_eager_pooled_ms'))} "
                f"{_fmt_pooled(e.get('vs_reference_pooled_ms'))}"
            )
    return "\n".join(lines)
