"""The proxy's coordination policies: what it does with a request that has multimodal items.

- eager: sends every multimodal item of the resent history to a round-robin E, then P;
- demand: asks the chosen P first (one RTT), then sends E only the `e_demand`;
- opportunistic: dispatches E at once; E skips an item whose forward has not started when
  P's answer (one RTT) says it is not needed;
- index: decides from a lagging view (RemoteKVIndex fed with P's KV events, and an
  EmbeddingAvailability fed with cache deltas); P re-decides at admission and fetches what the
  view missed (a late fallback: E's cache, else an encoder forward).

A policy is chosen once, when the simulation is built (`make_policy`); P's own re-check at
admission is the same for every policy (`mmreuse.accounting`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from ..decision import Policy as PolicyName
from ..decision import parse_policy
from ..demand import DemandResult
from .view import ClusterView, encoder_name, prefill_name
from .workload import SimRequest

if TYPE_CHECKING:
    from .cluster import EncodeJob, Simulation


def _needed(demand: DemandResult) -> set[str]:
    """The identifiers P's answer asks E for."""
    return {ident for ident, _ in demand.e_demand}


class Policy:
    """How the proxy routes a request with multimodal items (P is already chosen)."""

    name: ClassVar[PolicyName]

    @property
    def reads_view(self) -> bool:
        """Whether the cluster must feed the lagging view."""
        return self.name.reads_view

    def __init__(self, sim: Simulation) -> None:
        self.sim = sim

    def arrive(self, request: SimRequest, p: int) -> None:
        raise NotImplementedError


class Eager(Policy):
    """The reference E-first proxy: every item to E, then P."""

    name = PolicyName.EAGER

    def arrive(self, request: SimRequest, p: int) -> None:
        self.sim.send_to_encoder(self.sim.job(request, p))


class Demand(Policy):
    """Ask P first (half an RTT each way), then send E only what P's answer needs."""

    name = PolicyName.DEMAND

    def arrive(self, request: SimRequest, p: int) -> None:
        sim = self.sim
        sim.at(sim.now + sim.cost.demand_rtt_ms / 2, self._prefill_answers, request, p)

    def _prefill_answers(self, request: SimRequest, p: int) -> None:
        sim = self.sim
        needed = _needed(sim.plan_at_prefill(request, p).demand)
        back = sim.now + sim.cost.demand_rtt_ms / 2
        if needed:
            sim.at(back, sim.send_to_encoder, sim.job(request, p, needed))
        else:
            sim.at(back, sim.send_to_prefill, request, p, {})


class Opportunistic(Policy):
    """E starts at once; P's answer, once back, lets E skip items whose forward has not started."""

    name = PolicyName.OPPORTUNISTIC

    def arrive(self, request: SimRequest, p: int) -> None:
        sim = self.sim
        job = sim.job(request, p)
        sim.at(sim.now + sim.cost.demand_rtt_ms / 2, self._prefill_answers, job)
        sim.send_to_encoder(job)

    def _prefill_answers(self, job: EncodeJob) -> None:
        sim = self.sim
        job.answer = _needed(sim.plan_at_prefill(job.request, job.prefill).demand)
        job.answer_at = sim.now + sim.cost.demand_rtt_ms / 2


class Index(Policy):
    """Decide at once from the lagging view of P's KV and of every embedding cache."""

    name = PolicyName.INDEX

    def arrive(self, request: SimRequest, p: int) -> None:
        sim = self.sim
        view = sim.view
        assert isinstance(view, ClusterView)  # reads_view: the simulation built one
        view.catch_up()
        e = sim.peek_next_encoder()
        availability = view.embeddings.availability_for(prefill_name(p), encoder_name(e))
        needed = _needed(sim.plan(request, availability, view=view.kv[p]).demand)
        if needed:
            sim.send_to_encoder(sim.job(request, p, needed))
        else:
            sim.send_to_prefill(request, p, {})


POLICY_CLASSES: dict[PolicyName, type[Policy]] = {
    c.name: c for c in (Eager, Demand, Opportunistic, Index)
}


def make_policy(name: str, sim: Simulation) -> Policy:
    """The policy called `name` (one of `mmreuse.decision.POLICIES`), bound to `sim`."""
    return POLICY_CLASSES[parse_policy(name)](sim)
