"""Step 2 of the chat route: decide. One flow per policy, picked once when the proxy starts
(`flow_for`):

- `WholeFlow` (eager, and any request without media): the planner's decision; E is sent its
  items later, by the forward step.
- `SplitFlow` (index, demand): the items held nowhere the chosen P could use go to E at
  arrival (`ArrivalSplitter.arrival`); the render and the plan (or P's answer) for the others run
  while E works, and what they add for E follows.
- `OpportunisticFlow`: E gets every item at once, as under eager, while the planner renders
  and asks P; sub-requests P's answer rules out are abandoned if still in flight.

E's bookkeeping (the counts, and `Planner.record_e`) is `EWork.account`, for every flow.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

from ..decision import Policy
from .encoder import EMPTY, EncodeResult, EncoderFanout, Encoding
from .metrics import ProxyMetrics
from .policy import Planner
from .records import DecideTrace, Decision
from .request import ClientRequest
from .views import InstanceView

logger = logging.getLogger("mmreuse.proxy")


class Decided(NamedTuple):
    """A flow's result: the decision, and E's answers where E was sent its items already
    (the arrival split, opportunistic; None: the forward step encodes)."""

    decision: Decision
    encoded: EncodeResult | None = None


class EWork:
    """E's sub-requests for a request, and their bookkeeping, written once."""

    def __init__(self, encoders: EncoderFanout, planner: Planner, metrics: ProxyMetrics) -> None:
        self.encoders = encoders
        self.planner = planner
        self.metrics = metrics

    async def encode(
        self, client: ClientRequest, decision: Decision, uuids: list[str]
    ) -> EncodeResult:
        """E encodes the decision's e_items under `uuids` (the client's, or a retry's fresh
        ones), and the counts: sent, skipped, sub-requests."""
        te = time.perf_counter()
        e_items = decision.dispatch.e_items
        result = EMPTY
        if e_items:
            result = await self.encoders.encode(
                client.body, client.items, e_items, client.request_id, uuids
            )
        self.account(decision, result, te, len(client.items), len(e_items))
        return result

    def account(
        self,
        decision: Decision,
        result: EncodeResult,
        started: float,
        items: int,
        sent: int,
        abandoned: int = 0,
    ) -> None:
        """Count E's work for `decision` (`sent` of the request's `items` sent since
        `started`, the others skipped; `abandoned` in flight), and record what E now holds."""
        m = self.metrics
        if sent:
            m.stage["encode"].observe(time.perf_counter() - started)
            m.e_subrequests.inc(result.subrequests)
            m.e_sent.inc(sent)
            self.planner.record_e(decision)
        skipped = items - sent
        if skipped:
            m.e_skipped.inc(skipped)
        if abandoned:
            m.e_abandoned.inc(abandoned)


class WholeFlow:
    """The planner's decision for the whole request; E encodes at the forward step."""

    def __init__(
        self, planner: Planner, e_work: EWork, metrics: ProxyMetrics, views: Sequence[InstanceView]
    ) -> None:
        self.planner = planner
        self.e_work = e_work
        self.encoders = e_work.encoders
        self.metrics = metrics
        self.views = views

    # whether a request with media items is decided its own way (`_decide_media`)
    by_media = False

    async def decide(self, client: ClientRequest) -> Decided:
        """The decision (and E's answers where already in), its facts counted."""
        if client.items and self.by_media:
            decided = await self._decide_media(client)
        else:
            planner = self.planner
            if planner.renders:
                decision = await planner.decide(client.body, client.items, client.uuids)
            else:  # eager, random routing: no render, no plan (what decide would answer)
                decision = planner.eager(client.items)
            decided = Decided(decision)
        self.observe(decided.decision, client.request_id)
        return decided

    async def _decide_media(self, client: ClientRequest) -> Decided:
        raise NotImplementedError

    def observe(self, decision: Decision, req_id: str) -> None:
        m, trace = self.metrics, decision.trace
        if trace.render_s:
            m.stage["render"].observe(trace.render_s)
        if trace.decide_s:
            m.stage["decide"].observe(trace.decide_s)
        view = self.views[decision.instance]
        if trace.no_plan is not None:
            m.fallbacks.labels(view.name, "no_plan").inc()
            m.errors.labels(trace.no_plan.split(":", 1)[0]).inc()
            logger.warning("[%s] no plan, E gets everything: %s", req_id, trace.no_plan)
        if trace.blind:
            m.blind(view.name).inc()
        classes = decision.dispatch.classes
        if classes:
            for item_class in set(classes):
                m.occurrence(item_class).inc(classes.count(item_class))


class SplitFlow(WholeFlow):
    """Index / demand: split at arrival, then plan (or ask P) for what waits."""

    by_media = True

    async def _decide_media(self, client: ClientRequest) -> Decided:
        m, planner = self.metrics, self.planner
        req, items, uuids, req_id = client.body, client.items, client.uuids, client.request_id
        ta = time.perf_counter()
        try:
            arrival = await planner.arrivals.arrival(req, items, uuids)
        except Exception:  # a bug here costs the split, never the request
            logger.exception("[%s] arrival split failed; the request takes the whole path", req_id)
            m.errors.labels("arrival").inc()
            arrival = None
        if arrival is None:
            m.arrival_split("whole").inc()
            return Decided(await planner.decide(req, items, uuids))
        arrival = planner.arrivals.on_p(arrival)
        if arrival.on_p:
            m.arrival_items.labels("p_encodes").inc()
        early = self.encoders.start(req, items, arrival.now, req_id, uuids) if arrival.now else None
        te = time.perf_counter()
        m.stage["arrival"].observe(te - ta)
        now = len(arrival.now) + len(arrival.shares)
        m.arrival_items.labels("e_now").inc(now)
        at_once = planner.arrivals.at_once(arrival)  # decided here: no render, no plan
        if not at_once:
            m.arrival_items.labels("waited").inc(len(arrival.rest))
        elif arrival.stored:  # --held-items reference: each as E's reference, from the store
            m.arrival_items.labels("p_stored").inc(len(arrival.rest))
        elif arrival.rest and not arrival.on_p:  # --mixed-plan arrival
            m.arrival_items.labels("p_raw").inc(len(arrival.rest))
        m.arrival_split("none_new" if not now else "split" if arrival.rest else "all_new").inc()
        try:
            if at_once:
                decision = planner.arrivals.at_arrival(req, uuids, arrival)
            else:
                decision = await planner.decide(req, items, uuids, arrival=arrival)
            sent = set(arrival.now)
            later = [i for i in decision.dispatch.e_items if i not in sent]
            rest = await self.encoders.encode(req, items, later, req_id, uuids) if later else EMPTY
            first = EMPTY if early is None else await early.finish()
        except BaseException:
            if early is not None:
                early.cancel()
            raise
        result = _merged(first, rest)
        e_items = decision.dispatch.e_items
        self.e_work.account(decision, result, te, len(items), len(e_items))
        return Decided(decision, result)


class OpportunisticFlow(WholeFlow):
    """E gets every item at once while the planner renders and asks P. An answer that comes
    while sub-requests are in flight abandons each one all of whose items the answer rules out
    (they go to P raw with their uuid); one that fails, or comes once E is done, changes
    nothing (eager)."""

    by_media = True

    async def _decide_media(self, client: ClientRequest) -> Decided:
        m, planner = self.metrics, self.planner
        req, items, uuids, req_id = client.body, client.items, client.uuids, client.request_id
        n = len(items)
        loop = asyncio.get_running_loop()
        te = time.perf_counter()
        encoding = self.encoders.start(req, items, range(n), req_id, uuids)
        routed: asyncio.Future[int] = loop.create_future()
        first = planner.random_instance()
        deciding = asyncio.ensure_future(
            planner.decide(
                req,
                items,
                uuids,
                instance=first,
                on_routed=lambda i: None if routed.done() else routed.set_result(i),
            )
        )
        try:
            pending: list[asyncio.Future[Any]] = list(encoding.tasks)
            while pending and not deciding.done():
                await asyncio.wait([*pending, deciding], return_when=asyncio.FIRST_COMPLETED)
                pending = [t for t in pending if not t.done()]
            if not deciding.done():  # E is done first: as eager, where routing sends it
                either: list[asyncio.Future[Any]] = [routed, deciding]
                await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
                instance = routed.result() if routed.done() else first
                deciding.cancel()
                outcome = "answer_late"
                decision = planner.eager(items, instance)
            else:
                try:
                    decision = deciding.result()
                except Exception as e:  # decide handles its failures: a bug costs the plan only
                    logger.exception("[%s] opportunistic decision failed", req_id)
                    why = f"plan: {type(e).__name__}: {e}"
                    decision = dataclasses.replace(
                        planner.eager(items, first), trace=DecideTrace(no_plan=why)
                    )
                outcome, decision = _abandon(encoding, decision)
            result = await encoding.finish()
        except BaseException:
            encoding.cancel()
            deciding.cancel()
            raise
        m.opportunistic(outcome).inc()
        abandoned = len(decision.dispatch.raw_items)
        self.e_work.account(decision, result, te, n, n, abandoned)
        return Decided(decision, result)


def _merged(first: EncodeResult, rest: EncodeResult) -> EncodeResult:
    """E's answers to the sub-requests sent at arrival (`first`) and after the plan (`rest`)."""
    if rest is EMPTY:
        return first
    if first is EMPTY:
        return rest
    return EncodeResult(
        {**first.item_meta, **rest.item_meta},
        {**first.ec_params, **rest.ec_params},
        first.subrequests + rest.subrequests,
    )


def _abandon(encoding: Encoding, decision: Decision) -> tuple[str, Decision]:
    """Abandon the in-flight sub-requests `decision`'s answer rules out entirely; the
    outcome, and the decision as it now stands (E: what was not abandoned)."""
    answer = decision.answer
    if answer is None:
        return "answer_failed", decision
    wanted = {ident for ident, _ in answer.e_demand}
    ids = decision.identifiers
    dropped: list[int] = []
    for g, (_, batch) in enumerate(encoding.groups):
        if all(ids[i] not in wanted for i in batch) and encoding.abandon(g):
            dropped.extend(batch)
    decision = dataclasses.replace(decision, dispatch=decision.dispatch.abandon(dropped))
    return ("answer_won" if dropped else "answer_no_gain"), decision


def flow_for(
    planner: Planner, e_work: EWork, metrics: ProxyMetrics, views: Sequence[InstanceView]
) -> WholeFlow:
    """The flow of the proxy's policy, picked once."""
    if planner.policy is Policy.OPPORTUNISTIC:
        cls: type[WholeFlow] = OpportunisticFlow
    elif planner.splits:
        cls = SplitFlow
    else:
        cls = WholeFlow
    return cls(planner, e_work, metrics, views)
