"""Simulator output: per-policy summary (table, JSON) and plots."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ..accounting import Bucket, PolicyResult


def percentile(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)), 3) if values else None


def summarize(r: PolicyResult) -> dict:
    """One JSON object per policy (stable key order, rounded floats: byte-identical per seed)."""
    b = r.buckets
    avoided = sum(b[k] for k in Bucket if k is not Bucket.FORWARD)
    return {
        "policy": r.policy,
        "requests": r.requests,
        "occurrences": r.occurrences,
        "encoder_forwards": b[Bucket.FORWARD],
        "redundant_forwards": r.redundant_forwards,
        "avoided_by_kv": b[Bucket.KV],
        "avoided_by_p_embedding": b[Bucket.P_EMBEDDING],
        "avoided_by_external": b[Bucket.EXTERNAL],
        "avoided_by_e_cache": b[Bucket.E_CACHE],
        "avoided_by_dedup": b[Bucket.DEDUP],
        "avoided_total": avoided,
        "e_requests": r.e_requests,
        "transfers": r.transfers,
        "transfer_bytes": r.transfer_bytes,
        "external_loads": r.external_loads,
        "late_fallbacks": r.late_fallbacks,
        "wrong_skips": r.wrong_skips,
        "partial_coverage": r.partial_coverage,
        "ttft_p50_ms": percentile(r.ttft_ms, 50),
        "ttft_p99_ms": percentile(r.ttft_ms, 99),
        "ttft_encode_p50_ms": percentile(r.ttft_encode_ms, 50),
        "ttft_encode_p99_ms": percentile(r.ttft_encode_ms, 99),
        "ttft_reuse_p50_ms": percentile(r.ttft_reuse_ms, 50),
        "ttft_reuse_p99_ms": percentile(r.ttft_reuse_ms, 99),
        "requests_needing_encoding": len(r.ttft_encode_ms),
    }


def table(rows: list[dict]) -> str:
    """The summaries as an aligned text table, one row per policy."""
    cols = [
        ("policy", "policy"),
        ("encoder_forwards", "fwd"),
        ("redundant_forwards", "redund"),
        ("avoided_by_kv", "av.kv"),
        ("avoided_by_p_embedding", "av.P-emb"),
        ("avoided_by_external", "av.ext"),
        ("avoided_by_e_cache", "av.E$"),
        ("avoided_by_dedup", "av.dup"),
        ("e_requests", "E reqs"),
        ("transfers", "xfers"),
        ("late_fallbacks", "late fb"),
        ("wrong_skips", "wrong"),
        ("ttft_p50_ms", "TTFT p50"),
        ("ttft_p99_ms", "p99"),
        ("ttft_encode_p50_ms", "enc p50"),
        ("ttft_reuse_p50_ms", "reuse p50"),
    ]

    def fmt(value: object) -> str:
        if value is None:
            return "-"
        return f"{value:.1f}" if isinstance(value, float) else str(value)

    cells = [[header for _, header in cols]] + [[fmt(r[key]) for key, _ in cols] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(cols))]
    lines = [
        "  ".join(
            cell.rjust(w) if i else cell.ljust(w)
            for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        )
        for row in cells
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def write_json(rows: list[dict], meta: dict, path: str | Path) -> None:
    """`{"config": meta, "policies": rows}`, indented, keys in order (byte-stable per seed)."""
    doc = {"config": meta, "policies": rows}
    Path(path).write_text(json.dumps(doc, indent=1, sort_keys=False) + "\n")


def plot(results: list[PolicyResult], rows: list[dict], path: str | Path, title: str) -> None:
    """A PNG: the TTFT CDF per policy, and how each occurrence was served."""
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
    causes = [
        ("encoder_forwards", "encoder forward"),
        ("avoided_by_kv", "P KV coverage"),
        ("avoided_by_p_embedding", "P embedding"),
        ("avoided_by_external", "external store"),
        ("avoided_by_e_cache", "E cache"),
        ("avoided_by_dedup", "duplicate"),
    ]
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
