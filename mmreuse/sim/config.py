"""Simulator configuration: cost model, cluster, workload (frozen values, JSON-loadable).

Cost-model defaults are order-of-magnitude figures for a Qwen2-VL-7B-class model on H100/H200
class GPUs; they are assumptions to vary, not measurements:
- encoder: ~23 ms for a 576-token image (0.04 ms per embedding token), in line with the
  20-50 ms per image ViT forwards reported for EPD setups (shared/docs/anchors.md §6-7);
- prefill: ~20k tokens/s (0.05 ms per token) plus 5 ms per scheduling step;
- embedding rows: hidden 3584 x bf16 = 7,168 bytes per embedding token;
- E->P transfer: 25 GB/s (200 Gb/s RDMA) plus 0.05 ms; external store loads 10 GB/s + 0.2 ms;
- a demand query proxy->P->proxy: 1 ms round trip; an E cache hit costs 0.5 ms to serve.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

POLICIES = ("eager", "demand", "opportunistic", "index")
WORKLOADS = ("chat", "fanout", "agentic", "trace")


def _check_positive(obj: Any, *names: str, allow_zero: bool = True) -> None:
    for name in names:
        v = getattr(obj, name)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0 or (not allow_zero and v == 0):
            raise ValueError(f"{type(obj).__name__}.{name} must be a number {'>=' if allow_zero else '>'} 0, got {v!r}")


@dataclass(frozen=True, slots=True)
class CostModel:
    encoder_ms_per_token: float = 0.04
    prefill_ms_per_token: float = 0.05
    prefill_fixed_ms: float = 5.0
    embedding_bytes_per_token: int = 7168
    e_to_p_gb_per_s: float = 25.0
    e_to_p_latency_ms: float = 0.05
    external_gb_per_s: float = 10.0
    external_latency_ms: float = 0.2
    demand_rtt_ms: float = 1.0
    e_cache_hit_ms: float = 0.5

    def __post_init__(self) -> None:
        _check_positive(self, *(f.name for f in fields(self)))
        _check_positive(self, "e_to_p_gb_per_s", "external_gb_per_s", allow_zero=False)

    def transfer_ms(self, tokens: int) -> float:
        return self.e_to_p_latency_ms + tokens * self.embedding_bytes_per_token / (self.e_to_p_gb_per_s * 1e6)

    def external_ms(self, tokens: int) -> float:
        return self.external_latency_ms + tokens * self.embedding_bytes_per_token / (self.external_gb_per_s * 1e6)


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    num_encoders: int = 2
    num_prefills: int = 2
    block_size: int = 16
    p_kv_blocks: int = 8192  # per P instance (131k tokens at block size 16)
    p_encoder_cache_embeds: int = 16384  # vLLM's encoder_cache_size, in embeddings
    e_cache_embeds: int = 32768  # per E instance; 0 disables E's cache
    external_store_embeds: int = 0  # shared by P instances; 0 disables it
    prefix_caching: bool = True
    routing: str = "affine"  # "affine" (session -> P) | "random"
    view_lag_ms: float = 50.0  # how far behind the index policy's view runs

    def __post_init__(self) -> None:
        _check_positive(self, "p_encoder_cache_embeds", "e_cache_embeds", "external_store_embeds",
                        "view_lag_ms")
        for name in ("num_encoders", "num_prefills", "block_size", "p_kv_blocks"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"ClusterConfig.{name} must be an int >= 1, got {v!r}")
        if self.routing not in ("affine", "random"):
            raise ValueError(f"ClusterConfig.routing must be 'affine' or 'random', got {self.routing!r}")


@dataclass(frozen=True, slots=True)
class WorkloadConfig:
    kind: str = "chat"
    requests: int = 2000  # turns in total
    sessions_per_s: float = 2.0  # Poisson session arrivals
    mean_turns: float = 9.0  # chat: 1 + Poisson(mean - 1), after MMDU-45k
    images_per_session: tuple[int, int] = (2, 5)  # chat: uniform in [lo, hi]
    image_tokens: str = "fixed576"  # "fixed576" | "qwen2vl" (resolution-dependent)
    text_tokens: tuple[int, int] = (30, 150)  # per user turn
    output_tokens: tuple[int, int] = (50, 300)  # per assistant turn, resent in history
    think_time_s: float = 8.0  # mean, exponential
    fanout_pool: int = 50  # fanout: distinct images, Zipf-popular
    trace_path: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in WORKLOADS:
            raise ValueError(f"WorkloadConfig.kind must be one of {WORKLOADS}, got {self.kind!r}")
        if isinstance(self.requests, bool) or not isinstance(self.requests, int) or self.requests < 1:
            raise ValueError(f"WorkloadConfig.requests must be an int >= 1, got {self.requests!r}")
        _check_positive(self, "sessions_per_s", "think_time_s", allow_zero=False)
        if self.mean_turns < 1:
            raise ValueError(f"WorkloadConfig.mean_turns must be >= 1, got {self.mean_turns!r}")
        if self.image_tokens not in ("fixed576", "qwen2vl"):
            raise ValueError(f"WorkloadConfig.image_tokens must be 'fixed576' or 'qwen2vl', got {self.image_tokens!r}")
        for name in ("images_per_session", "text_tokens", "output_tokens"):
            lo, hi = getattr(self, name)
            if not (isinstance(lo, int) and isinstance(hi, int) and 0 <= lo <= hi):
                raise ValueError(f"WorkloadConfig.{name} must be (lo, hi) ints with 0 <= lo <= hi, got {(lo, hi)!r}")
        if self.kind == "trace" and not self.trace_path:
            raise ValueError("WorkloadConfig.trace_path is required with kind='trace'")


@dataclass(frozen=True, slots=True)
class SimConfig:
    seed: int = 0
    policies: tuple[str, ...] = POLICIES
    cost: CostModel = field(default_factory=CostModel)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)

    def __post_init__(self) -> None:
        for p in self.policies:
            if p not in POLICIES:
                raise ValueError(f"policy must be one of {POLICIES}, got {p!r}")
        if not self.policies:
            raise ValueError("policies must not be empty")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> SimConfig:
        unknown = set(d) - {"seed", "policies", "cost", "cluster", "workload"}
        if unknown:
            raise ValueError(f"unknown config keys: {sorted(unknown)}")

        def build(kind, values):
            if not isinstance(values, dict):
                raise ValueError(f"config section for {kind.__name__} must be an object")
            names = {f.name for f in fields(kind)}
            bad = set(values) - names
            if bad:
                raise ValueError(f"unknown {kind.__name__} keys: {sorted(bad)}")
            values = {k: tuple(v) if isinstance(v, list) else v for k, v in values.items()}
            return kind(**values)

        base = cls()
        return replace(
            base,
            seed=d.get("seed", base.seed),
            policies=tuple(d.get("policies", base.policies)),
            cost=build(CostModel, d.get("cost", {})),
            cluster=build(ClusterConfig, d.get("cluster", {})),
            workload=build(WorkloadConfig, d.get("workload", {})),
        )

    @classmethod
    def from_file(cls, path: str | Path) -> SimConfig:
        try:
            return cls.from_dict(json.loads(Path(path).read_text()))
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"config file {str(path)!r}: {exc}") from None
