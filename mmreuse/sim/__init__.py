"""mmreuse simulate: an EPD cluster simulator answering RFC #55639's questions."""

from .accounting import BUCKETS, Bucket, Delivery, PolicyResult
from .cluster import Simulation
from .config import POLICIES, WORKLOADS, ClusterConfig, CostModel, SimConfig, WorkloadConfig
from .report import summarize, table
from .workload import SimRequest, generate

__all__ = [
    "BUCKETS",
    "POLICIES",
    "WORKLOADS",
    "Bucket",
    "ClusterConfig",
    "CostModel",
    "Delivery",
    "PolicyResult",
    "SimConfig",
    "SimRequest",
    "Simulation",
    "WorkloadConfig",
    "generate",
    "run",
    "summarize",
    "table",
]


def run(cfg: SimConfig, progress: bool = False) -> tuple[list[dict], list[PolicyResult]]:
    """Run every policy of `cfg` on the same request stream; returns (summaries, results)."""
    requests = generate(cfg.workload, cfg.seed)
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
    finally:
        if bar is not None:
            bar.close()
    return [summarize(r) for r in results], results
