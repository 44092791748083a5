"""The arrival-time split (index, demand): what is decided when a request arrives, before any
render. Every item whose identifier the chosen P provably cannot use (no KV block of it
carries the identifier, not in its encoder cache, not in the shared store) goes to E at once;
only the others wait for the render and the plan (or P's answer), and a request with no such
other item is not rendered at all. Under `affine` routing the P is chosen here, from the same
identifier index. Acting early only on "held nowhere" keeps the safe direction: it can cost an
encode, never a skip.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from ..decision import arrival_classes, dispatch_at_arrival
from ..demand import ItemClass
from .config import EncodeOnP, MixedPlan, ProxyConfig
from .eside import ESide
from .failover import choose
from .records import NO_TRACE, Arrival, DecideTrace, Decision, Sources, unplannable


class ArrivalSplitter:
    """Splits requests at arrival for one Planner: from its `sources` (the views, what E and
    each P hold, the store, the kept references) and E's side, with the Planner's routing
    draws (`rng` for affine's choice, `random_instance` for a P at random), asking P instead
    of reading an instance's view where `ask_instead(instance, usable=, complete=)` says so."""

    def __init__(
        self,
        config: ProxyConfig,
        sources: Sources,
        e_side: ESide,
        rng: random.Random,
        ask_instead: Callable[..., bool],
        random_instance: Callable[[], int],
    ) -> None:
        self.config, self.sources, self.e_side = config, sources, e_side
        self.views, self.availability = sources.views, sources.availability  # read per request
        self._rng, self._ask_instead = rng, ask_instead
        self._random_instance = random_instance  # the Planner's draw (its one home)
        self.policy = config.planning.policy
        self._asks = self.policy.asks_p

    async def arrival(
        self,
        request: Mapping[str, Any],
        items: Sequence[Mapping[str, Any]],
        uuids: Sequence[str],
    ) -> Arrival | None:
        """The arrival-time split (see the module's docstring), or None where the request takes
        the whole path (no media; processor kwargs, which rehash identifiers so that they cannot
        be known without P; uuids or a salt the proxy does not plan on). With a shared store,
        it is asked about the request's identifiers first, unless no item could go to E now."""
        split = self.split(request, items, uuids)
        if split is None or self.sources.store is None:
            return split
        external = None
        if split.now:
            external = await self.sources.store.held(set(uuids))
            if external is None and not self.policy.reads_view:  # demand: no answer, no proof
                return Arrival(split.instance, rest=tuple(range(len(items))))
            split = self.split(request, items, uuids, instance=split.instance, external=external)
            if split is None or split.now:
                return split
        return await self._by_reference(request, uuids, split, external)

    async def _by_reference(
        self,
        request: Mapping[str, Any],
        uuids: Sequence[str],
        split: Arrival,
        external: frozenset[str] | None,
    ) -> Arrival:
        """--held-items reference: a request with no new item whose every item has E's
        reference kept and is in the shared store goes to P at arrival, each item as that
        reference (`Arrival.stored`): P's KV or its EC connector serves each, so nothing
        needs the render, the plan or (demand) P's answer: the store's own word is what P's
        connector loads. Otherwise `split` as it is (the items wait). `external`: the
        store's answer if it was asked already."""
        if self.sources.references is None or not self.sources.references.keeps_all(request, uuids):
            return split
        if external is None:
            assert self.sources.store is not None
            external = await self.sources.store.held(set(uuids))
        if external is None or not external.issuperset(uuids):
            return split
        return replace(split, external=external, stored=True)

    def split(
        self,
        request: Mapping[str, Any],
        items: Sequence[Mapping[str, Any]],
        uuids: Sequence[str],
        *,
        instance: int | None = None,
        external: frozenset[str] | None = None,
    ) -> Arrival | None:
        """`arrival` from what the proxy knows without asking anyone: its views of P (KV
        blocks by identifier, P's encoder cache) and `external` (the store's answer, if any).
        `instance`: the P already chosen (else chosen here)."""
        if (
            not items
            or request.get("mm_processor_kwargs")
            or request.get("media_io_kwargs")
            or unplannable(request, uuids) is not None
        ):
            return None
        distinct = set(uuids)
        if instance is None:
            instance = self._instance(distinct)
        view = self.views[instance]
        usable, complete = view.usable, view.complete
        if (self._asks and not (usable and complete)) or self._ask_instead(
            instance, usable=usable, complete=complete
        ):  # P is asked (demand; index on an incomplete view): only a complete view proves
            new: set[str] = set()
        else:
            # P's encoder cache, from its events (untenanted, as vLLM's cache is)
            salt = None if view.ec_stream is not None else request.get("cache_salt")
            new = distinct - self.availability.p_holds(view.name, distinct, cache_salt=salt)
            if external:
                new -= external
            if usable:  # unusable: planned under index as holding nothing (demand: above)
                unheld = view.kv_unheld(new)  # incomplete: planned blind on what it knows
                new = set() if unheld is None else unheld
        first: dict[str, int] = {}
        for i, u in enumerate(uuids):  # one uuid on two different items: render judges it
            if u in new and items[first.setdefault(u, i)] != items[i]:
                new.discard(u)
        now: list[int] = []
        first.clear()
        shares: dict[int, int] = {}
        rest: list[int] = []
        for i, u in enumerate(uuids):
            if u not in new:
                rest.append(i)
            elif u in first:
                shares[i] = first[u]
            else:
                first[u] = i
                now.append(i)
        blind = bool(now) and usable and not complete
        e_cached = self.e_side.cached(first, request.get("cache_salt")) if now else frozenset()
        return Arrival(instance, tuple(now), shares, tuple(rest), external, blind, e_cached)

    def _instance(self, identifiers: set[str]) -> int:
        """Random routing: a random P. Affine: the P whose view knows a block carrying the most
        of these identifiers (ties at random), instead of a render and a prefix match."""
        if self.config.planning.routing != "affine" or len(self.views) == 1:
            return self._random_instance()
        scores = [sum(map(view.holds_identifier, identifiers)) for view in self.views]
        return choose(self._rng, scores, self.sources.p_health)

    def on_p(self, arrival: Arrival) -> Arrival:
        """`arrival` as --encode-on-p has it: single sends a request's one item, new, to P
        raw instead of E (`rest`, decided at arrival: P's encoder encodes it)."""
        if (
            self.config.planning.encode_on_p is EncodeOnP.SINGLE
            and len(arrival.now) == 1
            and not arrival.shares
            and not arrival.rest
        ):
            return replace(arrival, now=(), rest=arrival.now, on_p=True)
        return arrival

    def at_once(self, arrival: Arrival) -> bool:
        """Whether `arrival` is the whole decision (no render, no plan): nothing waits, P
        encodes the new item (--encode-on-p), or --mixed-plan arrival with an item at E."""
        return (
            not arrival.rest
            or arrival.on_p
            or arrival.stored
            or (bool(arrival.now) and self.config.planning.mixed_plan is MixedPlan.ARRIVAL)
        )

    def at_arrival(
        self, request: Mapping[str, Any], uuids: Sequence[str], arrival: Arrival
    ) -> Decision:
        """The Decision of a request decided at arrival (`at_once`): no render, no plan; E gets
        `now` (e_cached where E's side says it holds the identifier), P gets `rest` raw with
        their uuid (vLLM's own order serves each, or P's encoder encodes it)."""
        unclassified = (ItemClass.UNCLASSIFIED,) * len(uuids)
        classes = arrival_classes(
            unclassified, arrival.now, arrival.shares, uuids, arrival.e_cached
        )
        return Decision(
            arrival.instance,
            dispatch_at_arrival(arrival.now, arrival.rest, arrival.shares, classes),
            identifiers=tuple(uuids),
            cache_salt=request.get("cache_salt"),
            trace=DecideTrace(blind=True) if arrival.blind else NO_TRACE,
            in_store=arrival.external if arrival.stored and arrival.external else frozenset(),
        )
