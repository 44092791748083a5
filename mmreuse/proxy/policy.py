"""Which P/PD serves a request, and which of its media items E must encode.

`eager` is the reference proxy: a random P/PD, every item to E. `index` renders the request
(with the proxy's uuids, so identifiers are P's), hashes it as P does, looks the hashes up in
P's live view, and plans it with `mmreuse.plan.plan_admission`: E gets only `e_demand` (each
identifier once); every other item goes to P raw, with its uuid, so that if P's state changed
since the view, vLLM's own order (KV, encoder cache, EC connector, its encoder) still serves
it. `demand` renders too, but asks the chosen P's `DemandScheduler` (`mmreuse.demand_query`)
instead of a view: P's answer, from its true state, gives `e_demand` and the classes, and the
query id travels to P in `vllm_xargs` so that P checks the answer's proof at admission.
`opportunistic` makes the same decision while E already encodes everything (the app abandons
what the answer rules out). No usable answer: every item to E, as eager. `affine` routing picks
the P/PD with the longest live prefix hit.

Under `index` and `demand`, a request is first split at arrival (`arrival.ArrivalSplitter`, the
Planner's `arrivals`), before any render; the plan (or P's answer) for the items that wait is
`decide(..., arrival=)`, and the items E got at arrival are merged in (`Dispatch.with_arrival`).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from ..decision import (
    Policy,
    dispatch,
    dispatch_all,
    dispatch_demand,
)
from ..demand import Availability
from ..demand_query import query_for
from ..errors import InvalidArgument
from ..plan import GivenCoverage, KVLookup, plan_admission
from ..render import RENDER_PATH, RenderedPrompt, from_render_json, render_body
from .arrival import ArrivalSplitter
from .config import ProxyConfig
from .demand import DemandUnavailable
from .eside import ESide
from .failover import choose
from .ids import new_hex
from .media import MODALITY, item_uuid, rewrite_for_decode, with_uuids
from .records import NO_TRACE, Arrival, DecideTrace, Decision, Sources, unplannable
from .views import InstanceView

logger = logging.getLogger("mmreuse.proxy")


class Planner:
    """Makes each request's Decision from the config, the views, E-side availability and, under
    demand and opportunistic, each P's answer (`Sources`)."""

    def __init__(
        self,
        config: ProxyConfig,
        sources: Sources,
        post: Callable[[str, Any], Any],
        rng: random.Random,
    ) -> None:
        """`post`: async (url, body) -> (status, bytes), for the render; `rng`: the routing
        draws."""
        self.sources = sources
        self.store = sources.store
        self.references = sources.references
        self.config = config
        self.models = sources.models
        self.views = list(sources.views)
        self.availability = availability = sources.availability
        self._post = post  # async (url, body) -> (status, bytes)
        self._rng = rng
        self.demand = list(sources.demand)
        self.policy = Policy(config.planning.policy)
        self._asks = self.policy.asks_p
        if self.demand and len(self.demand) != len(config.prefill_instances):
            raise InvalidArgument(
                f"demand has {len(self.demand)} clients for "
                f"{len(config.prefill_instances)} P/PD instances"
            )
        # a request is rendered (and planned) at all: otherwise every decision is `eager`'s
        self.renders = self.policy.renders or config.planning.routing == "affine"
        e_side = sources.e_side
        self.e_side = e_side if e_side is not None else ESide(config, availability, None)
        self.arrivals = ArrivalSplitter(
            config, sources, self.e_side, rng, self._ask_instead, self.random_instance
        )

    def random_instance(self) -> int:
        """A P (or PD) at random, an ejected one only where every one is (`failover`)."""
        health = self.sources.p_health
        if health is None or not health.failing:  # every one up: the reference's draw
            return self._rng.randrange(len(self.config.prefill_instances))
        return choose(self._rng, len(self.config.prefill_instances), health)

    def eager(self, items: Sequence[Mapping[str, Any]], instance: int | None = None) -> Decision:
        inst = self.random_instance() if instance is None else instance
        return Decision(inst, dispatch_all(len(items)))

    @property
    def splits(self) -> bool:
        """Whether requests are split at arrival (`arrivals`): under the policies that hold a
        request for a render (index, demand)."""
        return self.policy.renders and not self.policy.e_at_once

    async def decide(
        self,
        request: Mapping[str, Any],
        items: Sequence[Mapping[str, Any]],
        uuids: Sequence[str] | None = None,
        *,
        instance: int | None = None,
        on_routed: Callable[[int], None] | None = None,
        arrival: Arrival | None = None,
    ) -> Decision:
        """`uuids`: the items' uuids when the caller has them (else computed here). `instance`:
        the random draw, when the caller made it. `on_routed(instance)` is called once, as soon
        as the instance is known (before render under random routing, after it under affine),
        so that a caller racing this decision can proceed without its answer. `arrival`: the
        split made at arrival (its instance is kept, its `now` items are E's whatever the plan
        says; requires `uuids`)."""
        fired = False

        def routed(i: int) -> None:
            nonlocal fired
            if on_routed is not None and not fired:
                fired = True
                on_routed(i)

        if arrival is not None:
            if uuids is None:
                raise InvalidArgument("decide: an arrival split needs the items' uuids")
            instance = arrival.instance
        decision = await self._decide(request, items, uuids, instance, routed, arrival)
        if arrival is not None:
            decision = _with_arrival(decision, arrival, uuids or ())
        routed(decision.instance)
        return decision

    async def _decide(
        self,
        request: Mapping[str, Any],
        items: Sequence[Mapping[str, Any]],
        uuids: Sequence[str] | None,
        instance: int | None,
        routed: Callable[[int], None],
        arrival: Arrival | None = None,
    ) -> Decision:
        if not self.renders or (not items and self.config.planning.routing == "random"):
            return self.eager(items, instance)
        if uuids is None:
            uuids = [item_uuid(item) for item in items]
        if instance is None:
            instance = self.random_instance()
        refused = unplannable(request, uuids) or await self._not_base(request, instance)
        if refused is not None:  # the proxy keeps no record of it: served as under eager
            return _fallback(self.eager(items, instance), f"plan: {refused}")
        if self.config.planning.routing == "random":
            routed(instance)
        t0 = time.perf_counter()
        try:
            rendered = await self._render(request, uuids, instance)
        except (_NoPlan, InvalidArgument) as e:
            return _fallback(self.eager(items, instance), f"render: {e}", t0)
        except Exception as e:  # a bug here costs the plan, never the request
            logger.exception("render answer not usable")
            why = f"render: {type(e).__name__}: {e}"
            return _fallback(self.eager(items, instance), why, t0)
        t1 = time.perf_counter()
        try:
            memo: dict = {}  # the hashes, per block size: affine routing's are the plan's
            rendered, occ_items, instance = self._route(
                rendered, items, instance, request, uuids, memo, reroute=arrival is None
            )
            routed(instance)
            early = frozenset(uuids[i] for i in arrival.now) if arrival else frozenset()
            if rendered.occurrences and (self._asks or self._ask_instead(instance)):
                decision = await self._ask(rendered, occ_items, items, instance, early)
            else:
                external = None if arrival is None else arrival.external
                if (
                    external is None
                    and self.store is not None
                    and rendered.occurrences
                    and self.policy.reads_view
                ):
                    external = await self.store.held(
                        {occ.identifier for occ in rendered.occurrences}
                    )
                decision = self._plan(rendered, occ_items, items, instance, memo, external)
        except (_NoPlan, InvalidArgument) as e:
            decision = _fallback(self.eager(items, instance), f"plan: {e}")
        except Exception as e:
            logger.exception("planning failed")
            decision = _fallback(self.eager(items, instance), f"plan: {type(e).__name__}: {e}")
        t2 = time.perf_counter()
        trace = replace(decision.trace, render_s=t1 - t0, decide_s=t2 - t1)
        return replace(decision, trace=trace)

    def _ask_instead(
        self, instance: int, *, usable: bool | None = None, complete: bool | None = None
    ) -> bool:
        """Under index: ask P rather than plan on its view while that view is incomplete (a
        late join, a gap), where the instance has a demand endpoint. `usable`, `complete`:
        the view's, when the caller has read them already."""
        if not (self.policy.reads_view and self.demand and self.demand[instance] is not None):
            return False
        view = self.views[instance]
        usable = view.usable if usable is None else usable
        complete = view.complete if complete is None else complete
        return usable and not complete

    def _renderer(self, instance: int) -> str:
        """The server that renders for `instance` (and whose models the catalog reads)."""
        return self.config.planning.render_url or self.config.prefill_instances[instance]

    async def _not_base(self, request: Mapping[str, Any], instance: int) -> str | None:
        """Why the request's `model` cannot be planned on (hashed as the base model), if so:
        a LoRA adapter keys its blocks with the adapter, so the view's hashes would not be
        the ones P looks up; a name P does not list is not planned on either."""
        model = request.get("model")
        if self.models is None or model is None:
            return None
        if not isinstance(model, str):
            return f"model is a {type(model).__name__}, not a string"
        server = self._renderer(instance)
        kind = await self.models.kind(server, model)
        if kind == "base":
            return None
        if kind == "adapter":
            return f"model {model[:80]!r} is a LoRA adapter (the view hashes for base models)"
        why = self.models.errors.get(server)
        listed = f"its model list could not be read: {why}" if why else "it does not list it"
        return f"model {model[:80]!r} is not known to {server} ({listed})"

    async def _render(
        self, request: Mapping[str, Any], uuids: Sequence[str], instance: int
    ) -> RenderedPrompt:
        named = with_uuids(request, uuids)
        if self.references is not None:
            # Each item E encoded before as E's reference (its placeholder metadata): P's
            # render lays it out alike without fetching, decoding or processing the media.
            # A modality with an item not kept stays raw (vLLM refuses the mix).
            kept = self.references.lookup(request, uuids, range(len(uuids)))
            if kept:
                named = dict(rewrite_for_decode(named, kept, frozenset(), uuids))
        body = render_body(named)
        base = self._renderer(instance)
        try:
            status, payload = await asyncio.wait_for(
                self._post(f"{base}{RENDER_PATH}", body),
                self.config.planning.render_timeout_s,
            )
        except TimeoutError as e:
            raise _NoPlan(f"no answer within {self.config.planning.render_timeout_s} s") from e
        except Exception as e:  # a render failure costs the plan, never the request
            raise _NoPlan(f"{type(e).__name__}: {e}") from e
        if status != 200:
            raise _NoPlan(f"HTTP {status}: {payload[:200].decode('utf-8', 'replace')}")
        return from_render_json(payload)  # InvalidArgument: no plan

    def _hashes(self, rendered: RenderedPrompt, view: InstanceView, memo: dict) -> list[bytes]:
        hasher = view.hasher
        if hasher is None:
            return []
        key = (hasher.block_size,)
        if key not in memo:
            memo[key] = hasher.hash_prompt(
                list(rendered.token_ids),
                mm=rendered.occurrences,
                **rendered.identity.hash_kwargs(),
            )
        return memo[key]

    def _route(
        self,
        rendered: RenderedPrompt,
        items: Sequence[Mapping[str, Any]],
        instance: int,
        request: Mapping[str, Any],
        uuids: Sequence[str],
        memo: dict,
        *,
        reroute: bool = True,
    ) -> tuple[RenderedPrompt, list[int], int]:
        """The render, checked against the request; each occurrence's item; the instance (the
        one with the longest live hit under affine routing, unless chosen at arrival)."""
        occ_items = _occurrence_items(rendered, items)
        rendered = _checked(rendered, uuids, occ_items, request)
        if reroute and self.config.planning.routing == "affine" and len(self.views) > 1:
            hits = []
            for view in self.views:
                hashes = self._hashes(rendered, view, memo)
                bs = view.hasher.block_size if view.hasher else 0
                hits.append(view.hit_blocks(hashes) * bs)
            instance = choose(self._rng, hits, self.sources.p_health)
        return rendered, occ_items, instance

    async def _ask(
        self,
        rendered: RenderedPrompt,
        occ_items: list[int],
        items: Sequence[Mapping[str, Any]],
        instance: int,
        early: frozenset[str] = frozenset(),
    ) -> Decision:
        """Ask the instance's P what it needs from E; its answer, as a Decision. No usable
        answer: every item to E (no_plan says why). `early`: identifiers sent to E at arrival,
        told to P as E's (so that it asks only about the rest)."""
        identifiers = _identifiers(rendered, occ_items, len(items))
        idents = {occ.identifier for occ in rendered.occurrences}
        # what E holds of this request only (looked up for its identifiers alone)
        e_cached = sorted(self.e_side.cached(idents, rendered.cache_salt) | (early & idents))
        query = query_for(rendered, new_hex(128), e_cached=e_cached)
        client = self.demand[instance]
        assert client is not None  # _ask_instead, or the policy asks every instance
        try:
            answer = await client.ask(query, self.config.views.demand_timeout_s)
        except DemandUnavailable as e:
            decision = replace(
                self.eager(items, instance), identifiers=identifiers, cache_salt=rendered.cache_salt
            )
            return _fallback(decision, f"demand: {e}")
        try:
            sent = dispatch(
                [
                    (occ.identifier, answered.item_class, item)
                    for occ, answered, item in zip(
                        rendered.occurrences, answer.items, occ_items, strict=True
                    )
                ],
                [ident for ident, _ in answer.e_demand],
                len(items),
            )
        except ValueError as e:  # InvalidArgument too; decode_answer checked it: a bug if here
            raise _NoPlan(f"demand: answer not usable: {e}") from e
        return Decision(
            instance,
            sent,
            identifiers=identifiers,
            cache_salt=rendered.cache_salt,
            demand_id=query.id,
            answer=answer,
        )

    def _plan(
        self,
        rendered: RenderedPrompt,
        occ_items: list[int],
        items: Sequence[Mapping[str, Any]],
        instance: int,
        memo: dict,
        external: frozenset[str] | None = None,
    ) -> Decision:
        """`external`: what the shared store holds of this request (None: not asked, or it
        did not answer)."""
        if not self.policy.reads_view:
            return replace(
                self.eager(items, instance),
                identifiers=_identifiers(rendered, occ_items, len(items)),
            )
        view = self.views[instance]
        n = len(rendered.token_ids)
        availability = self._availability(
            view, rendered.cache_salt, {occ.identifier for occ in rendered.occurrences}
        )
        if external is not None:  # the store's own answer, in place of any record of it
            availability = replace(availability, p_external=external)
        blind = False
        if view.usable and view.hasher is not None:
            blind = not view.complete
            lookup: KVLookup | GivenCoverage = KVLookup(
                view.index,
                block_hashes=self._hashes(rendered, view, memo),
                block_size=view.hasher.block_size,
            )
        else:
            lookup = _NOTHING_COMPUTED
        plan = plan_admission(
            num_prompt_tokens=n,
            occurrences=rendered.occurrences,
            availability=availability,
            coverage=lookup,
        )
        demand = plan.demand
        if demand.conflicts:  # vLLM rejects it: let P say so, as under eager
            raise _NoPlan(f"embed counts disagree for {list(demand.conflicts)}")
        return Decision(
            instance,
            dispatch_demand(demand, occ_items, len(items)),
            plan=plan,
            identifiers=_identifiers(rendered, occ_items, len(items)),
            cache_salt=rendered.cache_salt,
            in_store=availability.p_external,
            trace=DecideTrace(blind=blind) if blind else NO_TRACE,
        )

    def _availability(
        self, view: InstanceView, cache_salt: str | None, identifiers: set[str]
    ) -> Availability:
        """What `view`'s P, the external store and E hold of these identifiers, for a request
        of this salt (looked up one by one: the records hold thousands). P's encoder cache,
        from its events, is untenanted as vLLM's is; the store's records are per tenant; E's
        side answers for itself (`ESide`)."""
        avail, ids = self.availability, identifiers
        p_salt = None if view.ec_stream is not None else cache_salt
        p_side = avail.availability_for(view.name, cache_salt=p_salt, identifiers=ids)
        external = p_side.p_external
        if p_salt != cache_salt:
            external = avail.availability_for(
                view.name, cache_salt=cache_salt, identifiers=ids
            ).p_external
        return Availability(
            p_local=p_side.p_local,
            p_local_freeable=p_side.p_local_freeable,
            p_external=external,
            e_cached=self.e_side.cached(ids, cache_salt),
        )

    def record_e(self, decision: Decision) -> None:
        """E now holds what it was sent (where the E side is this process's record of it)."""
        e_items = decision.dispatch.e_items
        if decision.identifiers and e_items:
            self.e_side.sent([decision.identifiers[i] for i in e_items], decision.cache_salt)


_NOTHING_COMPUTED = GivenCoverage(0)  # a view that cannot be used: planned as holding nothing


class _NoPlan(Exception):
    """Planning is not possible for this request; it is served as under eager."""


def _fallback(decision: Decision, why: str, render_t0: float | None = None) -> Decision:
    """`decision` (as under eager) marked with why no plan was made, and the render's seconds
    where it was started at `render_t0`."""
    render_s = 0.0 if render_t0 is None else time.perf_counter() - render_t0
    return replace(decision, trace=replace(decision.trace, no_plan=why, render_s=render_s))


def _with_arrival(d: Decision, arrival: Arrival, uuids: Sequence[str]) -> Decision:
    """`d` (the plan, or P's answer, for the whole request) with the arrival's items kept at
    E (`Dispatch.with_arrival`)."""
    if not arrival.now:
        return d
    merged = d.dispatch.with_arrival(arrival.now, arrival.shares, uuids, arrival.e_cached)
    trace = replace(d.trace, blind=True) if arrival.blind and not d.trace.blind else d.trace
    return replace(d, dispatch=merged, trace=trace)


def _occurrence_items(rendered: RenderedPrompt, items: Sequence[Mapping[str, Any]]) -> list[int]:
    """Occurrence i (vLLM's order) -> its media item (request order): per modality both are in
    prompt order, so the k-th occurrence of a modality is its k-th item."""
    by_modality: dict[str, list[int]] = {}
    for idx, item in enumerate(items):
        by_modality.setdefault(MODALITY[item["type"]], []).append(idx)
    seen: dict[str, int] = {}
    out = []
    for occ in rendered.occurrences:
        k = seen.get(occ.modality, 0)
        seen[occ.modality] = k + 1
        slots = by_modality.get(occ.modality, [])
        if k >= len(slots):
            raise _NoPlan(f"render has more {occ.modality} items than the request")
        out.append(slots[k])
    for modality, slots in by_modality.items():
        if seen.get(modality, 0) != len(slots):
            raise _NoPlan(
                f"render has {seen.get(modality, 0)} {modality} items, the request {len(slots)}"
            )
    return out


def _checked(
    rendered: RenderedPrompt,
    uuids: Sequence[str],
    occ_items: list[int],
    request: Mapping[str, Any],
) -> RenderedPrompt:
    """Render's answer, held to what the proxy knows of the request: the request's cache salt
    (a render that dropped it would plan on another tenant's blocks), and identifiers that are
    the items' uuids (without processing kwargs, vLLM's identifier *is* the uuid) or at least
    in one-to-one correspondence with them (otherwise a dedup could give one item another's
    embedding). Anything else: no plan."""
    salt = request.get("cache_salt")
    if rendered.cache_salt is not None and rendered.cache_salt != salt:
        raise _NoPlan(f"render's cache_salt {rendered.cache_salt!r} is not the request's {salt!r}")
    rehashed = bool(request.get("mm_processor_kwargs") or request.get("media_io_kwargs"))
    by_ident: dict[str, str] = {}
    by_uuid: dict[str, str] = {}
    for occ, idx in zip(rendered.occurrences, occ_items, strict=True):
        uid = uuids[idx]
        if not rehashed and occ.identifier != uid:
            raise _NoPlan(f"render names item {idx} {occ.identifier!r}, not its uuid {uid!r}")
        if by_ident.setdefault(occ.identifier, uid) != uid or by_uuid.setdefault(uid, occ.identifier) != occ.identifier:  # fmt: skip
            raise _NoPlan(f"render's identifier {occ.identifier!r} names two different items")
    if salt != rendered.cache_salt:
        rendered = rendered.with_identity(replace(rendered.identity, cache_salt=salt))
    return rendered


def _identifiers(rendered: RenderedPrompt, occ_items: list[int], n: int) -> tuple[str, ...]:
    out = [""] * n
    for occ, idx in zip(rendered.occurrences, occ_items, strict=True):
        out[idx] = occ.identifier
    return tuple(out)


__all__ = ["Planner"]
