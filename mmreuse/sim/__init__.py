"""mmreuse simulate: an EPD cluster simulator answering RFC #55639's questions."""

import gc

from ..accounting import BUCKETS, Bucket, Delivery, PolicyResult
from .cluster import Simulation
from .config import (
    POLICIES,
    WORKLOADS,
    ClusterConfig,
    ConfigError,
    CostModel,
    SimConfig,
    WorkloadConfig,
)
from .memory import check as check_memory
from .report import summarize, table
from .workload import SimRequest, generate

__all__ = [
    "BUCKETS",
    "POLICIES",
    "WORKLOADS",
    "Bucket",
    "ClusterConfig",
    "ConfigError",
    "CostModel",
    "Delivery",
    "PolicyResult",
    "SimConfig",
    "SimRequest",
    "Simulation",
    "WorkloadConfig",
    "check_memory",
    "generate",
    "run",
    "summarize",
    "table",
]


def run(
    cfg: SimConfig, progress: bool = False, requests: list[SimRequest] | None = None
) -> tuple[list[dict], list[PolicyResult]]:
    """Run every policy of `cfg` on the same request stream (`requests`, else generated from
    `cfg` after `mmreuse.sim.memory.check` finds room for it); returns (summaries, results)."""
    if requests is None:
        requests = generate(cfg.workload, cfg.seed, budget=check_memory(cfg))
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(
            total=len(requests) * len(cfg.policies),
            unit="req",
            mininterval=0.5,
            leave=False,
            disable=None,
        )
    results = []
    try:
        for policy in cfg.policies:  # block hashes are cached per session, shared by the runs
            results.append(Simulation(cfg, requests, policy, progress=bar).run())
            # a Simulation is a reference cycle (its policy, its callbacks): free its caches
            # now, or every policy's would be alive at once (`mmreuse.sim.memory` counts one)
            gc.collect()
    finally:
        if bar is not None:
            bar.close()
    return [summarize(r) for r in results], results
