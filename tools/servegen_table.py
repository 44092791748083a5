"""Derive mmreuse's small table of real multimodal request shapes from Alibaba's ServeGen data.

ServeGen (https://github.com/alibaba/ServeGen, Apache-2.0) publishes, for its Qwen-VL image
workload (`data/multimodal/mm-image/`), one pair of files per anonymised client:
- `chunk-<id>-trace.csv`: 144 rows `ts,rate,cv,pattern,shape,scale`, one per 10-minute window
  of a day (ts 0..85800 s): the mean rate (requests/s), the coefficient of variation of the
  inter-arrival times and the fitted arrival law (Gamma or Weibull; empty when idle, rate 0);
- `chunk-<id>-dataset.json`: per 6-hour window (ts 0, 21600, 43200, 64800), one probability mass
  function per field, written as a Python dict literal {value: probability}: `image_count` and
  `text_tokens` / `output_tokens` per request, `image_tokens` per image (ServeGen's generator
  draws one per image), and audio / video fields (all zero in mm-image).

This script reduces them to a table of well under 100 KB:
- the clients ranked by requests per day (sum over windows of rate x 600 s); the top `--top`,
  and the aggregate of every client ("all");
- per entry, each field's day-level distribution: the mixture of the 6-hour windows' PMFs (and,
  for "all", of every client's), each weighted by the requests it governs (a window's
  requests: its 6 hours of trace; for `image_tokens`, requests x mean images per request, since
  it is a per-image law). `images_per_request` is kept exact (a PMF); the token fields as
  quantiles Q(p) = min{v : F(v) >= p} on a fixed grid of probabilities (QUANTILE_PROBS), the
  exact mean beside them;
- per entry, 24 hourly rates (req/s: the mean of the hour's six windows) and hourly CVs (the
  rate-weighted mean CV of the hour's fitted windows; 1.0 where none is fitted). For "all" the
  rate is the sum over every client and the CV is 1.0 (Poisson): the superposition of many
  independent clients, not any one client's burstiness;
- the source (repository, commit, paths), its licence and the attribution it asks for.

Usage (the path is the fetched repository: a bare git directory or a checkout):

    python tools/servegen_table.py /path/to/ServeGen [--top 8] [--out FILE]

The output is deterministic for a given ServeGen commit (plain Python arithmetic, math.fsum,
sorted keys; no randomness). It writes mmreuse/sim/data/servegen_mm_image.json by default.
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

DATA_DIR = "data/multimodal/mm-image"
REPO_URL = "https://github.com/alibaba/ServeGen"
FORMAT = "mmreuse.servegen/1"
WINDOW_S = 600
DAY_S = 86400
DATASET_SPAN_S = 21600  # the dataset windows' stride in mm-image (checked below)
# The quantile grid: fine in the tails, every percentile in between.
QUANTILE_PROBS = [0.0, 0.001, 0.005] + [i / 100 for i in range(1, 100)] + [0.995, 0.999, 1.0]
CITATION = (
    "Yuxing Xiang, Xue Li, Kun Qian, Wenyuan Yu, Ennan Zhai, Xin Jin. ServeGen: Workload "
    "Characterization and Generation of Large Language Model Serving in Production. "
    "arXiv:2505.09999, 2025."
)

Pmf = dict[int, float]


class Source:
    """Reads files of the fetched repository: a bare git directory (as `fetch` leaves it, read
    at `rev`) or a checkout (read from disk; its commit from git when it is a repository)."""

    def __init__(self, path: Path, rev: str):
        self.path = path
        self.git_dir: Path | None = None
        if (path / "objects").is_dir() and (path / "HEAD").is_file():
            self.git_dir = path
        elif not (path / DATA_DIR).is_dir():
            sys.exit(f"{path}: neither a git directory nor a checkout holding {DATA_DIR}/")
        self.rev = rev

    def _git(self, *args: str) -> bytes:
        assert self.git_dir is not None
        return subprocess.run(
            ["git", f"--git-dir={self.git_dir}", *args], check=True, capture_output=True
        ).stdout

    def commit(self) -> str | None:
        try:
            if self.git_dir is not None:
                out = self._git("rev-parse", f"{self.rev}^{{commit}}")
            else:
                out = subprocess.run(
                    ["git", "-C", str(self.path), "rev-parse", "HEAD"],
                    check=True,
                    capture_output=True,
                ).stdout
        except (subprocess.CalledProcessError, FileNotFoundError):
            return None
        return out.decode().strip()

    def names(self) -> list[str]:
        if self.git_dir is not None:
            out = self._git("ls-tree", "--name-only", f"{self.rev}:{DATA_DIR}")
            return sorted(out.decode().split())
        return sorted(p.name for p in (self.path / DATA_DIR).iterdir())

    def read(self, name: str) -> str:
        if self.git_dir is not None:
            return self._git("show", f"{self.rev}:{DATA_DIR}/{name}").decode()
        return (self.path / DATA_DIR / name).read_text()


def parse_pmf(text: str, where: str) -> Pmf:
    """A ServeGen PMF: a dict literal {int: probability} (read with literal_eval, never eval)."""
    pmf = ast.literal_eval(text)
    if not isinstance(pmf, dict) or not all(
        type(k) is int and k >= 0 and isinstance(p, (int, float)) and p >= 0 for k, p in pmf.items()
    ):
        sys.exit(f"{where}: not a dict of int -> probability")
    if pmf and abs(math.fsum(pmf.values()) - 1.0) > 1e-6:
        sys.exit(f"{where}: probabilities sum to {math.fsum(pmf.values())}, not 1")
    return pmf


def read_client(src: Source, cid: int) -> dict[str, Any]:
    trace_name, dataset_name = f"chunk-{cid}-trace.csv", f"chunk-{cid}-dataset.json"
    windows = []
    for line in src.read(trace_name).splitlines():
        ts, rate, cv, pattern, _shape, _scale = line.strip().split(",")
        windows.append((int(ts), float(rate), float(cv), pattern))
    if [w[0] for w in windows] != list(range(0, DAY_S, WINDOW_S)):
        sys.exit(f"{trace_name}: expected one row per 10 minutes of one day")
    for ts, rate, cv, pattern in windows:
        if rate < 0 or cv < 0 or (pattern == "" and rate != 0):
            sys.exit(f"{trace_name}: ts {ts}: rate {rate}, cv {cv}, pattern {pattern!r}")
    datasets: dict[int, dict[str, Pmf]] = {}
    for ts_text, fields in json.loads(src.read(dataset_name)).items():
        ts = int(ts_text)
        if ts % DATASET_SPAN_S:
            sys.exit(f"{dataset_name}: window {ts} is not on the {DATASET_SPAN_S} s grid")
        datasets[ts] = {
            name: parse_pmf(text, f"{dataset_name}: {ts}: {name}") for name, text in fields.items()
        }
    return {"id": cid, "windows": windows, "datasets": datasets}


def mean(pmf: Pmf) -> float:
    return math.fsum(v * p for v, p in pmf.items()) / math.fsum(pmf.values())


def mixture(parts: list[tuple[float, Pmf]]) -> Pmf:
    """sum_i w_i * pmf_i / sum_i w_i, over the parts with w_i > 0."""
    parts = [(w, pmf) for w, pmf in parts if w > 0]
    total = math.fsum(w for w, _ in parts)
    out: dict[int, list[float]] = {}
    for w, pmf in parts:
        norm = math.fsum(pmf.values())
        for v, p in pmf.items():
            if p > 0:
                out.setdefault(v, []).append(w * p / (norm * total))
    return {v: math.fsum(ps) for v, ps in sorted(out.items())}


def quantiles(pmf: Pmf) -> list[int]:
    """Q(p) = min{v : F(v) >= p} for each p of QUANTILE_PROBS (Q(0): the least value)."""
    values = sorted(pmf)
    cdf, acc = [], []
    for v in values:
        acc.append(pmf[v])
        cdf.append(math.fsum(acc))
    total = cdf[-1]
    out = []
    for q in QUANTILE_PROBS:
        i = next((i for i, c in enumerate(cdf) if c / total >= q - 1e-12), len(values) - 1)
        out.append(values[i])
    return out


def requests_in(client: dict[str, Any], start: int, end: int) -> float:
    return math.fsum(rate * WINDOW_S for ts, rate, _, _ in client["windows"] if start <= ts < end)


def field_parts(clients: list[dict[str, Any]], field: str) -> list[tuple[float, Pmf]]:
    """(weight, pmf) per 6-hour dataset window: its requests (x mean images, for image_tokens)."""
    parts = []
    for client in clients:
        for ts, fields in sorted(client["datasets"].items()):
            n = requests_in(client, ts, ts + DATASET_SPAN_S)
            if n <= 0:
                continue  # idle: its PMF (sometimes a placeholder {0: 1.0}) governs nothing
            if field == "image_tokens":
                n *= mean(fields["image_count"])
            parts.append((n, fields[field]))
    return parts


def hourly(clients: list[dict[str, Any]], aggregate: bool) -> tuple[list[float], list[float]]:
    rates, cvs = [], []
    for hour in range(24):
        lo, hi = hour * 3600, (hour + 1) * 3600
        total = math.fsum(requests_in(c, lo, hi) for c in clients)
        rates.append(round(total / 3600, 6))
        fitted = [
            (rate, cv)
            for c in clients
            for ts, rate, cv, pattern in c["windows"]
            if lo <= ts < hi and pattern and rate > 0
        ]
        weight = math.fsum(r for r, _ in fitted)
        if aggregate or weight == 0:
            cvs.append(1.0)
        else:
            cvs.append(round(math.fsum(r * cv for r, cv in fitted) / weight, 4))
    return rates, cvs


def entry(name: str, clients: list[dict[str, Any]], day_total: float) -> dict[str, Any]:
    per_day = math.fsum(requests_in(c, 0, DAY_S) for c in clients)
    counts = mixture(field_parts(clients, "image_count"))
    out: dict[str, Any] = {
        "name": name,
        "source_clients": sorted(c["id"] for c in clients),
        "requests_per_day": round(per_day, 1),
        "share": round(per_day / day_total, 6),
        "images_per_request": {
            "values": list(counts),
            "probs": [round(p, 9) for p in counts.values()],
            "mean": round(mean(counts), 4),
        },
    }
    for field, key in (
        ("image_tokens", "image_tokens_per_image"),
        ("text_tokens", "text_tokens"),
        ("output_tokens", "output_tokens"),
    ):
        pmf = mixture(field_parts(clients, field))
        out[key] = {"quantiles": quantiles(pmf), "mean": round(mean(pmf), 2)}
    out["hourly_rate"], out["hourly_cv"] = hourly(clients, aggregate=name == "all")
    return out


def dump(value: Any, indent: int = 0) -> str:
    """JSON with objects one key a line and lists of scalars on one line (small diffs)."""
    pad = " " * indent
    if isinstance(value, dict):
        items = [f"{pad} {json.dumps(k)}: {dump(v, indent + 1).lstrip()}" for k, v in value.items()]
        return pad + "{\n" + ",\n".join(items) + "\n" + pad + "}"
    if isinstance(value, list) and any(isinstance(v, (dict, list)) for v in value):
        return pad + "[\n" + ",\n".join(dump(v, indent + 1) for v in value) + "\n" + pad + "]"
    return pad + json.dumps(value, separators=(", ", ": "))


def build(src: Source, top: int, commit: str) -> dict[str, Any]:
    names = src.names()
    ids = sorted(int(n.split("-")[1]) for n in names if n.endswith("-dataset.json"))
    if not ids or any(f"chunk-{i}-trace.csv" not in names for i in ids):
        sys.exit(f"{DATA_DIR}: expected chunk-<id>-dataset.json and chunk-<id>-trace.csv pairs")
    clients = [read_client(src, i) for i in ids]
    for c in clients:  # mm-image is images only: refuse data this table cannot represent
        for ts, fields in c["datasets"].items():
            for field in ("audio_count", "video_count", "audio_tokens", "video_tokens"):
                if fields.get(field, {0: 1.0}) != {0: 1.0}:
                    sys.exit(f"chunk-{c['id']}-dataset.json: {ts}: {field} is not always 0")
    day_total = math.fsum(requests_in(c, 0, DAY_S) for c in clients)
    ranked = sorted(clients, key=lambda c: (-requests_in(c, 0, DAY_S), c["id"]))
    entries = [entry(f"client-{c['id']}", [c], day_total) for c in ranked[:top]]
    entries.append(entry("all", clients, day_total))
    return {
        "format": FORMAT,
        "source": {
            "repository": REPO_URL,
            "commit": commit,
            "paths": [
                f"{DATA_DIR}/chunk-<id>-trace.csv",
                f"{DATA_DIR}/chunk-<id>-dataset.json",
            ],
            "clients_in_source": len(ids),
            "licence": "Apache-2.0",
            "licence_url": "https://www.apache.org/licenses/LICENSE-2.0",
            "notice": (
                "Derived from ServeGen (https://github.com/alibaba/ServeGen), "
                f"{DATA_DIR}/ at commit {commit}, licensed under the Apache License, "
                "Version 2.0 (the same text as this package's LICENSE file). Modified: "
                "reduced by tools/servegen_table.py to day-level mixtures, quantiles and "
                "hourly rates. ServeGen ships no NOTICE file and its LICENSE names no "
                "copyright holder; the work is credited as its README asks, to: " + CITATION
            ),
            "citation": CITATION,
        },
        "derivation": (
            "tools/servegen_table.py: clients ranked by requests per day (sum of rate x 600 s "
            f"over the 10-minute windows); the top {top} and 'all' (every client). Each field is "
            "the mixture of the 6-hour windows' PMFs (and, for 'all', every client's), weighted "
            "by the requests each governs (x mean images per request for the per-image "
            "image_tokens). images_per_request: the exact PMF; token fields: Q(p) = "
            "min{v: F(v) >= p} at quantile_probs, and the exact mean. hourly_rate: req/s, the "
            "mean of the hour's six windows (ServeGen's published scale; its own generator "
            "uses the rates as relative weights). hourly_cv: the rate-weighted mean CV of the "
            "hour's fitted inter-arrival laws, 1.0 where none is fitted and for 'all' "
            "(a superposition of many independent clients). Fields are marginals: the data "
            "holds no joint law."
        ),
        "quantile_probs": QUANTILE_PROBS,
        "clients": entries,
    }


def main() -> None:
    root = Path(__file__).resolve().parent.parent
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("repo", type=Path, help="the fetched ServeGen: git directory or checkout")
    parser.add_argument("--rev", default="HEAD", help="the commit to read (a git directory)")
    parser.add_argument("--commit", help="the commit to record, for a checkout without git")
    parser.add_argument("--top", type=int, default=8, help="clients kept, by requests per day")
    parser.add_argument(
        "--out", type=Path, default=root / "mmreuse" / "sim" / "data" / "servegen_mm_image.json"
    )
    args = parser.parse_args()
    src = Source(args.repo, args.rev)
    commit = args.commit or src.commit()
    if commit is None:
        sys.exit("cannot tell the source's commit: pass --commit")
    table = build(src, args.top, commit)
    text = dump(table) + "\n"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(f"wrote {args.out} ({len(text.encode())} bytes, {len(table['clients'])} entries)")


if __name__ == "__main__":
    main()
