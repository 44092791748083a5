"""Simulator output: per-policy summary (table, JSON) and plots."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from .cluster import BUCKETS, PolicyResult


def _pct(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)), 3) if values else None


def summarize(r: PolicyResult) -> dict:
    """One JSON object per policy (stable key order, rounded floats: byte-identical per seed)."""
    b = r.buckets
    avoided = sum(b[k] for k in BUCKETS if k != "forward")
    return {
        "policy": r.policy,
        "requests": r.requests,
        "occurrences": r.occurrences,
        "encoder_forwards": b["forward"],
        "redundant_forwards": r.redundant_forwards,
        "avoided_by_kv": b["kv"],
        "avoided_by_p_embedding": b["p_embedding"],
        "avoided_by_external": b["external"],
        "avoided_by_e_cache": b["e_cache"],
        "avoided_by_dedup": b["dedup"],
        "avoided_total": avoided,
        "e_requests": r.e_requests,
        "transfers": r.transfers,
        "transfer_bytes": r.transfer_bytes,
        "external_loads": r.external_loads,
        "late_fallbacks": r.late_fallbacks,
        "wrong_skips": r.wrong_skips,
        "ttft_p50_ms": _pct(r.ttft_ms, 50),
        "ttft_p99_ms": _pct(r.ttft_ms, 99),
        "ttft_encode_p50_ms": _pct(r.ttft_encode_ms, 50),
        "ttft_encode_p99_ms": _pct(r.ttft_encode_ms, 99),
        "ttft_reuse_p50_ms": _pct(r.ttft_reuse_ms, 50),
        "ttft_reuse_p99_ms": _pct(r.ttft_reuse_ms, 99),
        "requests_needing_encoding": len(r.ttft_encode_ms),
    }


def table(rows: list[dict]) -> str:
    cols = [("policy", "policy"), ("encoder_forwards", "fwd"), ("redundant_forwards", "redund"),
            ("avoided_by_kv", "av.kv"), ("avoided_by_p_embedding", "av.P-emb"),
            ("avoided_by_external", "av.ext"), ("avoided_by_e_cache", "av.E$"),
            ("avoided_by_dedup", "av.dup"), ("e_requests", "E reqs"), ("transfers", "xfers"),
            ("late_fallbacks", "late fb"), ("wrong_skips", "wrong"),
            ("ttft_p50_ms", "TTFT p50"), ("ttft_p99_ms", "p99"),
            ("ttft_encode_p50_ms", "enc p50"), ("ttft_reuse_p50_ms", "reuse p50")]
    fmt = lambda v: "-" if v is None else (f"{v:.1f}" if isinstance(v, float) else str(v))
    cells = [[h for _, h in cols]] + [[fmt(r[k]) for k, _ in cols] for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(cols))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths)))
             for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def write_json(rows: list[dict], meta: dict, path: str | Path) -> None:
    Path(path).write_text(json.dumps({"config": meta, "policies": rows}, indent=1, sort_keys=False) + "\n")


def plot(results: list[PolicyResult], rows: list[dict], path: str | Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for r in results:
        if r.ttft_ms:
            x = np.sort(np.asarray(r.ttft_ms))
            ax1.plot(x, np.arange(1, len(x) + 1) / len(x), label=r.policy)
    ax1.set_xscale("log")
    ax1.set_xlabel("TTFT (ms)")
    ax1.set_ylabel("fraction of requests")
    ax1.set_title("TTFT CDF")
    ax1.legend()
    ax1.grid(True, alpha=0.3)
    causes = [("encoder_forwards", "encoder forward"), ("avoided_by_kv", "P KV coverage"),
              ("avoided_by_p_embedding", "P embedding"), ("avoided_by_external", "external store"),
              ("avoided_by_e_cache", "E cache"), ("avoided_by_dedup", "duplicate")]
    bottom = np.zeros(len(rows))
    for key, label in causes:
        vals = np.asarray([r[key] for r in rows], dtype=float)
        ax2.bar([r["policy"] for r in rows], vals, bottom=bottom, label=label)
        bottom += vals
    ax2.set_ylabel("multimodal occurrences")
    ax2.set_title("How each occurrence was served")
    ax2.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
