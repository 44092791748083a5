"""bench-cluster against the simulator: `mmreuse simulate` on the same stream, configured like
the real cluster (P's sizes, the store, the prompts as P rendered them), and the two side by
side per policy and bucket."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .client import render
from .simchat import ChatRequest

STORE_EMBEDS = 10**9  # ECExampleConnector's store: unbounded, E skips a forward it holds


def p_sizes(endpoints: Sequence[str]) -> list[Any]:
    """Each P's DemandStats (its KV blocks, block size and encoder cache size)."""
    import zmq

    from ..demand_query import DemandStats, StatsQuery, decode_answer, encode

    out = []
    ctx: Any = zmq.Context.instance()
    for ep in endpoints:
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(ep)
        try:
            dealer.send(encode(StatsQuery("bench-sizes")))
            if not dealer.poll(30_000):
                raise RuntimeError(f"{ep}: no stats within 30 s")
            ans = decode_answer(dealer.recv())
            if not isinstance(ans, DemandStats):
                raise RuntimeError(f"{ep}: not stats: {ans}")
            out.append(ans)
        finally:
            dealer.close(0)
    return out


def simulate_like(
    stream: Sequence[Any],
    workload: Any,
    policies: Sequence[str],
    *,
    rate: float,
    sizes: Sequence[Any],
    e_cache_embeds: int = STORE_EMBEDS,
    seed: int = 0,
    store: tuple[int, int] | None = None,
    offsets: Sequence[float] | None = None,
    costs: str = "gpu",
) -> list[dict[str, Any]]:
    """`mmreuse simulate` on the same stream, configured like the real cluster: the same
    arrivals (request i at i / rate s), P's real KV blocks, block size and encoder cache (its
    DemandStats), random routing as the proxy's default, and the store. `store` None:
    ECExampleConnector's, unbounded, as both E's cache and the external store P loads from.
    `store` (E's encoder cache, the store's capacity), in embeddings: the Mooncake Store's,
    E's own cache beside a bounded store that E reads before a forward and P loads from. The
    simulator's summary rows. `offsets`: when each request left (s), where not i / rate.
    `costs`: the simulator's cost model (`mmreuse.sim.config.COSTS`): the bed's own, where the
    profile has one measured, so that requests overlap in the simulator as they did here."""
    import dataclasses

    from ..sim import run
    from ..sim.config import COSTS, ClusterConfig, SimConfig

    if offsets is None:
        offsets = [i / rate for i in range(len(stream))]
    timed = [
        dataclasses.replace(r, arrival_ms=t * 1000.0) for r, t in zip(stream, offsets, strict=True)
    ]
    p = sizes[0]
    cluster = ClusterConfig(
        num_encoders=1,
        num_prefills=len(sizes),
        block_size=p.block_size,
        p_kv_blocks=min(s.kv_blocks for s in sizes),
        p_encoder_cache_embeds=min(s.encoder_cache_embeds for s in sizes),
        e_cache_embeds=e_cache_embeds if store is None else store[0],
        external_store_embeds=STORE_EMBEDS if store is None else store[1],
        e_reads_external_store=store is not None,
        routing="random",
    )
    cfg = SimConfig(
        seed=seed, policies=tuple(policies), cost=COSTS[costs], cluster=cluster, workload=workload
    )
    rows, _ = run(cfg, requests=list(timed))
    return rows


COMPARED = (
    "encoder_forwards",
    "e_requests",
    "transfers",
    "avoided_by_kv",
    "avoided_by_p_embedding",
    "avoided_by_external",
    "avoided_by_e_cache",
    "avoided_by_dedup",
    "late_fallbacks",
    "wrong_skips",
    "partial_coverage",
)


def comparison(
    real: Sequence[dict[str, Any]], sim: Sequence[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Per policy and per bucket: (real, simulated)."""
    by = {r["policy"]: r for r in sim}
    return [
        {"policy": r["policy"], **{k: (r[k], by[r["policy"]][k]) for k in COMPARED}}
        for r in real
        if r["policy"] in by
    ]


def rendered_stream(
    p_url: str, requests: Sequence[ChatRequest], stream: Sequence[Any]
) -> list[Any]:
    """The simulator's stream with the real prompts: each request rendered by P
    (`/v1/chat/completions/render`: vLLM's chat template, placeholders and identifiers), so the
    simulator sees exactly the token layout P schedules (the template's tokens around every
    message and image, which move block boundaries). A session's history is its last turn's
    prompt; every earlier turn's prompt must be a prefix of it (checked)."""
    from array import array

    from ..sim.workload import Session, SimRequest

    rendered = [render(p_url, req.body) for req in requests]
    last: dict[int, Any] = {}
    for sim, rp in zip(stream, rendered, strict=True):
        cur = last.get(sim.session.sid)
        if cur is None or len(rp.token_ids) > len(cur.token_ids):
            last[sim.session.sid] = rp
    sessions = {
        sid: Session(sid, array("q", rp.token_ids), list(rp.occurrences), [])
        for sid, rp in last.items()
    }
    out = []
    for sim, rp in zip(stream, rendered, strict=True):
        session = sessions[sim.session.sid]
        n = len(rp.token_ids)
        if list(session.tokens[:n]) != list(rp.token_ids) or session.mm[: len(rp.occurrences)] != list(rp.occurrences):  # fmt: skip
            raise RuntimeError(
                f"request {sim.rid}: its rendered prompt is not a prefix of its session's last"
            )
        out.append(SimRequest(sim.rid, session, sim.turn, sim.arrival_ms, n, len(rp.occurrences)))
    return out


__all__ = ["COMPARED", "comparison", "p_sizes", "rendered_stream", "simulate_like"]
