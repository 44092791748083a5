"""How much memory a simulation will allocate, estimated from its config before anything is built,
so that a config no machine can run is refused with a message instead of dying in an allocator.

The estimate (bytes; constants measured on CPython 3.11 / x86-64, rounded up):
- each P instance: `INSTANCE` plus, per KV block, `BLOCK_FIXED` allocated up front (the
  BlockIndex's generations, 8, and bitmap, 1/8; its block -> hash list, 8; the reference counts,
  8; the never-used pool, 8 + a 32-byte int: 65 measured) and `BLOCK_FILLED` per block that
  fills (the index's dict and C table entries, the LRU queue's entry: 290 measured), for at most
  min(blocks, the workload's history blocks) blocks;
- each E instance: `INSTANCE`;
- each request: `REQUEST` (its SimRequest, its entry while the stream is sorted, its arrival
  event) and `TURN` (its session's `Turn` record: 56, its list slot, its ints, its images
  tuple) plus `REQUEST_PER_POLICY` per policy (TTFT samples, every policy's result is kept);
  each session `SESSION`; each multimodal occurrence `OCCURRENCE` (MMOccurrence, identifier)
  and `TURN_IMAGE` (its (id, tokens) pair in its Turn: 56, its int, its tuple slot);
- each token of a session's final history: `TOKEN` (an int64) plus, per full block, its hash
  (`HASH`: a 32-byte bytes object and its list slot).
History tokens of a generated workload are expected values from the config (means of the spans;
the fixed count of `image_tokens` or, for `qwen2vl`, 784 tokens per image; the last session may
run past `requests`); a trace's are counted exactly while it is read (`Budget`). The interpreter,
torch and numpy, already loaded, are not counted: "available" below is what is left with them
loaded. The estimate is meant to be within a factor of about 2: it refuses what cannot fit, not
what fits tightly.

Available memory: the least of /proc/meminfo's MemAvailable (else SC_PHYS_PAGES x
SC_PAGE_SIZE), the cgroup v2 limit less its usage, and RLIMIT_AS less the address space in use.
"""

from __future__ import annotations

import os
import resource
from dataclasses import dataclass, fields
from pathlib import Path

from .config import ClusterConfig, ConfigError, SimConfig, WorkloadConfig

INSTANCE = 64 << 10
BLOCK_FIXED = 72
BLOCK_FILLED = 320
REQUEST = 512
TURN = 128
REQUEST_PER_POLICY = 64
SESSION = 512
OCCURRENCE = 256
TURN_IMAGE = 96
TOKEN = 8
HASH = 96
QWEN2VL_IMAGE_TOKENS_MEAN = 784  # 28 x 28 patches on average


@dataclass(frozen=True, slots=True)
class Budget:
    """What a trace may still allocate (`available` bytes) and what each part of it costs."""

    available: int
    per_token: float
    per_request: int = REQUEST + TURN
    per_session: int = SESSION
    per_occurrence: int = OCCURRENCE + TURN_IMAGE


def token_bytes(cluster: ClusterConfig) -> float:
    """Bytes per history token: its int64, and a share of its block's hash and index entry."""
    per_block = HASH + (BLOCK_FILLED if cluster.prefix_caching else 0)
    return TOKEN + per_block / cluster.block_size


def available_bytes() -> int:
    """Memory this process can still allocate (the module docstring says how it is read)."""
    limits = []
    try:
        text = Path("/proc/meminfo").read_text()
        limits += [
            int(line.split()[1]) * 1024 for line in text.splitlines() if "MemAvailable:" in line
        ]
    except (OSError, ValueError, IndexError):
        pass
    if not limits:
        limits.append(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    try:
        cgroup = Path("/sys/fs/cgroup")
        limit = (cgroup / "memory.max").read_text().strip()
        if limit != "max":
            limits.append(int(limit) - int((cgroup / "memory.current").read_text()))
    except (OSError, ValueError):
        pass
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        try:
            in_use = int(Path("/proc/self/statm").read_text().split()[0]) * os.sysconf(
                "SC_PAGE_SIZE"
            )
        except (OSError, ValueError, IndexError):
            in_use = 0
        limits.append(soft - in_use)
    return max(0, min(limits))


def _mean(value: int | float | tuple[int, int]) -> float:
    return sum(value) / 2 if isinstance(value, tuple) else float(value)


def _image_tokens(w: WorkloadConfig) -> int:
    """An image's tokens under `w.image_tokens`: the fixed count, or qwen2vl's mean."""
    fixed = w.fixed_image_tokens
    return QWEN2VL_IMAGE_TOKENS_MEAN if fixed is None else fixed


@dataclass(frozen=True, slots=True)
class _Part:
    """One term of the estimate, and the config fields it grows with."""

    what: str
    bytes: float
    fields: tuple[str, ...]


def _workload_parts(cfg: SimConfig) -> list[_Part]:
    w, c = cfg.workload, cfg.cluster
    if w.kind == "trace":
        return []  # counted while the trace is read
    extra = 3 if w.kind == "fanout" else w.mean_turns  # the last session runs past `requests`
    turns = w.requests + extra
    turn_text = _mean(w.text_tokens) + _mean(w.output_tokens)
    image = _image_tokens(w)
    if w.kind == "chat":
        sessions = turns / w.mean_turns
        occurrences = sessions * _mean(w.images_per_session)
    elif w.kind == "agentic":
        sessions, occurrences = turns / w.mean_turns, turns
    else:  # fanout: 2 turns per session on average, one image
        sessions = occurrences = turns / 2
    tokens = turns * turn_text + occurrences * image
    blocks = tokens / c.block_size
    filled = min(blocks, c.num_prefills * c.p_kv_blocks) if c.prefix_caching else 0
    history: tuple[str, ...] = (
        "workload.requests",
        "workload.text_tokens",
        "workload.output_tokens",
        "workload.image_tokens",
    )
    if w.kind == "chat":
        history += ("workload.images_per_session",)
    if w.kind != "fanout":
        history += ("workload.mean_turns",)
    return [
        _Part(
            f"{turns:.0f} requests",
            turns * (REQUEST + TURN + REQUEST_PER_POLICY * len(cfg.policies)) + sessions * SESSION,
            ("workload.requests",),
        ),
        _Part(
            f"{tokens:.3g} tokens of history",
            tokens * TOKEN
            + blocks * HASH
            + filled * BLOCK_FILLED
            + occurrences * (OCCURRENCE + TURN_IMAGE),
            history,
        ),
    ]


def estimate(cfg: SimConfig) -> list[_Part]:
    """The estimate's terms for `cfg` (a trace's history is not among them)."""
    c = cfg.cluster
    return [
        _Part(
            f"{c.num_prefills} P x {c.p_kv_blocks} KV blocks",
            c.num_prefills * (INSTANCE + c.p_kv_blocks * BLOCK_FIXED),
            ("cluster.p_kv_blocks", "cluster.num_prefills"),
        ),
        _Part(f"{c.num_encoders} E", c.num_encoders * INSTANCE, ("cluster.num_encoders",)),
        *_workload_parts(cfg),
    ]


_DEFAULTS = {
    f"{section}.{f.name}": getattr(kind(), f.name)
    for section, kind in (("cluster", ClusterConfig), ("workload", WorkloadConfig))
    for f in fields(kind)
}


def _growth(cfg: SimConfig, name: str) -> float:
    """How far a field is above its default (what an oversized config most likely got wrong)."""
    if name == "workload.image_tokens":
        return _image_tokens(cfg.workload) / _image_tokens(WorkloadConfig())
    section, key = name.split(".")
    value, default = _mean(getattr(getattr(cfg, section), key)), _mean(_DEFAULTS[name])
    return value / default if default else 0.0


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if n < 1024 or unit == "PiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n:.0f} B"
        n /= 1024
    raise AssertionError  # unreachable


def check(cfg: SimConfig, available: int | None = None) -> Budget:
    """Refuse `cfg` (ConfigError naming the field most likely at fault) if its estimate exceeds
    `available` (default: `available_bytes()`); returns what a trace may still allocate."""
    avail = available_bytes() if available is None else available
    parts = estimate(cfg)
    total = sum(p.bytes for p in parts)
    if total > avail:
        worst = max(parts, key=lambda p: p.bytes)
        field = max(worst.fields, key=lambda name: _growth(cfg, name))
        raise ConfigError.on(
            field,
            f"the run would need about {fmt_bytes(total)} of memory ({fmt_bytes(worst.bytes)} "
            f"for {worst.what}), more than the {fmt_bytes(avail)} available",
        )
    return Budget(int(avail - total), token_bytes(cfg.cluster))
