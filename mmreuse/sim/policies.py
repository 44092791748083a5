"""The proxy's coordination policies: what it does with a request that has multimodal items.

- eager: sends every multimodal item of the resent history to a round-robin E, then P;
- demand: asks the chosen P first (one RTT), then sends E only the `e_demand`;
- opportunistic: dispatches E at once; E skips an item whose forward has not started when
  P's answer (one RTT) says it is not needed;
- index: decides from a lagging view (RemoteKVIndex fed with P's KV events, and an
  EmbeddingAvailability fed with cache deltas); P re-decides at admission and fetches what the
  view missed (a late fallback: E's cache, else an encoder forward).

Every policy but eager renders the request at P before it plans (`CostModel.render_ms`: a fixed
part and each image P's processor cache has not seen). index and demand split it at arrival as
the proxy does (`mmreuse.proxy.policy.Planner.split`): the items the view says nobody holds go
to E at once, without waiting for the render; the others wait for it and the plan (or P's
answer), and what that adds for E follows; P gets the request once both E jobs are done. A
request whose every item is new is not rendered.

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
    from .cluster import EncodeJob, Join, Simulation


def _needed(demand: DemandResult) -> set[str]:
    """The identifiers P's answer asks E for."""
    return {ident for ident, _ in demand.e_demand}


class Policy:
    """How the proxy routes a request with multimodal items (P is already chosen)."""

    name: ClassVar[PolicyName]

    @property
    def reads_view(self) -> bool:
        """Whether the cluster must feed the lagging view (the plan reads it, or the split)."""
        return self.name.reads_view or self.splits

    @property
    def splits(self) -> bool:
        """Whether requests are split at arrival (the policies that wait for a render to plan:
        index and demand; `Planner.splits`)."""
        return self.name.renders and not self.name.e_at_once

    def __init__(self, sim: Simulation) -> None:
        self.sim = sim

    def arrive(self, request: SimRequest, p: int) -> None:
        """The split at arrival (where the policy splits), then `plan` after the render."""
        sim = self.sim
        if not self.splits:
            self.plan(request, p, None)
            return
        new = sim.new_at_arrival(request, p)
        distinct = {m.identifier for m in request.mm}
        if new == distinct:  # every item to E at once: no render, no plan
            sim.send_to_encoder(sim.job(request, p, new))
            return
        join = sim.join(request, p, new) if new else None
        if join is not None:
            sim.send_to_encoder(sim.job(request, p, new, join=join))
        sim.at(sim.now + sim.render(request, p), self.plan, request, p, join)

    def plan(self, request: SimRequest, p: int, join: Join | None) -> None:
        """Decide what E gets for `request` (after its render, where the policy renders);
        `join`: the request's arrival job is out, whose items E has already."""
        raise NotImplementedError

    def dispatch(self, request: SimRequest, p: int, needed: set[str], join: Join | None) -> None:
        """E gets `needed` (less what went at arrival), then P the request."""
        sim = self.sim
        if join is not None:
            needed = needed - join.sent
            if needed:
                sim.send_to_encoder(sim.job(request, p, needed, join=join))
            else:
                join.done(sim, {}, sim.now)
        elif needed:
            sim.send_to_encoder(sim.job(request, p, needed))
        else:
            sim.send_to_prefill(request, p, {})


class Eager(Policy):
    """The reference E-first proxy: every item to E, then P."""

    name = PolicyName.EAGER

    def plan(self, request: SimRequest, p: int, join: Join | None) -> None:
        self.sim.send_to_encoder(self.sim.job(request, p))


class Demand(Policy):
    """Ask P first (half an RTT each way), then send E only what P's answer needs."""

    name = PolicyName.DEMAND

    def plan(self, request: SimRequest, p: int, join: Join | None) -> None:
        sim = self.sim
        sim.at(sim.now + sim.cost.demand_rtt_ms / 2, self._prefill_answers, request, p, join)

    def _prefill_answers(self, request: SimRequest, p: int, join: Join | None) -> None:
        sim = self.sim
        needed = _needed(sim.plan_at_prefill(request, p).demand)
        sim.at(sim.now + sim.cost.demand_rtt_ms / 2, self.dispatch, request, p, needed, join)


class Opportunistic(Policy):
    """E starts at once; P's answer, once back, lets E skip items whose forward has not started."""

    name = PolicyName.OPPORTUNISTIC

    def plan(self, request: SimRequest, p: int, join: Join | None) -> None:
        sim = self.sim
        job = sim.job(request, p)
        # P is asked once the request is rendered; E starts at once
        asked = sim.now + sim.render(request, p) + sim.cost.demand_rtt_ms / 2
        sim.at(asked, self._prefill_answers, job)
        sim.send_to_encoder(job)

    def _prefill_answers(self, job: EncodeJob) -> None:
        sim = self.sim
        job.answer = _needed(sim.plan_at_prefill(job.request, job.prefill).demand)
        job.answer_at = sim.now + sim.cost.demand_rtt_ms / 2


class Index(Policy):
    """Decide at once from the lagging view of P's KV and of every embedding cache."""

    name = PolicyName.INDEX

    def plan(self, request: SimRequest, p: int, join: Join | None) -> None:
        sim = self.sim
        view = sim.view
        assert isinstance(view, ClusterView)  # reads_view: the simulation built one
        view.catch_up()
        e = sim.peek_next_encoder()
        availability = view.embeddings.availability_for(prefill_name(p), encoder_name(e))
        needed = _needed(sim.plan(request, availability, view=view.kv[p]).demand)
        self.dispatch(request, p, needed, join)


POLICY_CLASSES: dict[PolicyName, type[Policy]] = {
    c.name: c for c in (Eager, Demand, Opportunistic, Index)
}


def make_policy(name: str, sim: Simulation) -> Policy:
    """The policy called `name` (one of `mmreuse.decision.POLICIES`), bound to `sim`."""
    return POLICY_CLASSES[parse_policy(name)](sim)
