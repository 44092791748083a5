"""The decision's one home: the policies, and what E and P get (each item's `ItemClass`).

`mmreuse.plan.plan_admission` answers "what does this request need from E?". This module turns
that answer into what the proxy sends (`dispatch`): which media items go to E (each identifier
E must deliver, once, through the occurrence P consumes it at), which items share another's
embedding, and which go to P raw with their uuid: the proxy under each policy, from its own
plan or from P's `DemandAnswer`. A dispatch changes only here: `Dispatch.abandon` (E's work
abandoned, opportunistic) and `Dispatch.resend` (E's embedding lost, a retry).

Torch-free and vLLM-free.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from .demand import DemandResult, ItemClass
from .errors import InvalidArgument
from .validate import check_int, fail_type, fail_value, show

__all__ = [
    "POLICIES",
    "ROUTINGS",
    "Dispatch",
    "ItemClass",
    "Policy",
    "Routing",
    "dispatch",
    "dispatch_all",
    "dispatch_at_arrival",
    "dispatch_demand",
    "parse_policy",
]


class Policy(StrEnum):
    """How the proxy coordinates E and P for a request with media (its value is the flag's).

    - eager: the reference E-first proxy: every item to E, then P;
    - demand: ask the chosen P first (its `DemandScheduler`), E gets only what P needs;
    - opportunistic: E gets every item at once while P is asked; what P's answer rules out
      before E is done is abandoned;
    - index: decide from the proxy's live view of P (KV events, encoder-cache events) and its
      record of E; P re-checks at admission and falls back along vLLM's own order.
    """

    EAGER = "eager"
    DEMAND = "demand"
    OPPORTUNISTIC = "opportunistic"
    INDEX = "index"

    @property
    def renders(self) -> bool:
        """Whether the proxy renders the request to plan it (every policy but eager)."""
        return self is not Policy.EAGER

    @property
    def reads_view(self) -> bool:
        """Whether it plans from the proxy's live views of P and E (index)."""
        return self is Policy.INDEX

    @property
    def asks_p(self) -> bool:
        """Whether it asks each P's `DemandScheduler` (`--demand-endpoints`)."""
        return self in (Policy.DEMAND, Policy.OPPORTUNISTIC)

    @property
    def e_at_once(self) -> bool:
        """Whether E gets every item as soon as the request arrives (eager, opportunistic)."""
        return self in (Policy.EAGER, Policy.OPPORTUNISTIC)


POLICIES: tuple[str, ...] = tuple(p.value for p in Policy)


def parse_policy(name: object, field: str = "policy") -> Policy:
    """The policy called `name`; anything else raises InvalidArgument naming `field`."""
    if isinstance(name, Policy):
        return name
    if not isinstance(name, str) or name not in POLICIES:
        fail_value(field, f"one of {POLICIES}", name)
    return Policy(name)


class Routing(StrEnum):
    """Which P/PD serves a request (the proxy's `--routing`, the simulator's `routing`):
    random (the reference's choice) or affine (the longest live prefix hit, ties at random)."""

    RANDOM = "random"
    AFFINE = "affine"


ROUTINGS: tuple[str, ...] = tuple(r.value for r in Routing)


@dataclass(frozen=True, slots=True)
class Dispatch:
    """What E and P get for one request's media items (request order).

    Attributes:
        e_items: the items sent to E, ascending: one per identifier E must deliver.
        raw_items: the items P gets raw, with their uuid (E does not see them).
        shares: item -> the item sent to E for the same identifier (P gets that embedding).
        classes: per item, its class (unclassified where no plan was made).
    """

    e_items: tuple[int, ...]
    raw_items: frozenset[int] = frozenset()
    shares: Mapping[int, int] = field(default_factory=dict)
    classes: tuple[ItemClass, ...] = ()

    def abandon(self, items: Iterable[int]) -> Dispatch:
        """This dispatch's classes for a request whose every item E got at once
        (opportunistic), once E's work for `items` was abandoned: E delivers every other item
        (each its own: nothing is shared) and P gets `items` raw with their uuid."""
        n = len(self.classes)
        gone = frozenset(items)
        for i in gone:
            if type(i) is not int or not 0 <= i < n:
                fail_value("items", f"item indices in [0, {n})", i)
        kept = tuple(i for i in range(n) if i not in gone)
        return Dispatch(kept, gone, _NO_SHARES, self.classes)

    def resend(self, items: Iterable[int]) -> Dispatch:
        """This dispatch with `items` sent to E again and to P raw with their uuid as well
        (E's embedding of them was lost: P encodes them itself if it is lost again)."""
        n = len(self.classes)
        again = frozenset(items)
        for i in again:
            if type(i) is not int or not 0 <= i < n:
                fail_value("items", f"item indices in [0, {n})", i)
        e_items = tuple(sorted({*self.e_items, *again}))
        return Dispatch(e_items, self.raw_items | again, self.shares, self.classes)

    def with_sent(
        self,
        sent: Sequence[int],
        sent_shares: Mapping[int, int],
        uuids: Sequence[str],
        classes: Sequence[ItemClass],
    ) -> Dispatch:
        """This dispatch (a plan, or P's answer, for the whole request) with the items E got
        at arrival (`sent`, and `sent_shares`: their duplicates) kept at E: each identifier
        (`uuids`, per item) goes to E once, through the item already sent when there is one,
        and every other item of it shares that embedding. `classes`: the result's."""
        first = {uuids[i]: i for i in sent}
        e = set(sent)
        dup: dict[int, int] = dict(sent_shares)
        for i in self.e_items:
            at = first.get(uuids[i])
            if at is None:
                e.add(i)
            elif at != i:
                dup[i] = at
        for k, v in self.shares.items():
            if k not in dup and k not in e:
                dup[k] = first.get(uuids[v], v)
        raw = frozenset(i for i in self.raw_items if i not in dup and i not in e)
        return Dispatch(tuple(sorted(e)), raw, dup, tuple(classes))

    def with_arrival(
        self,
        now: Sequence[int],
        shares: Mapping[int, int],
        uuids: Sequence[str],
        e_cached: frozenset[str],
    ) -> Dispatch:
        """This dispatch (a plan, or P's answer) merged with what E got at arrival
        (`with_sent`), those items classed as they were when sent (`arrival_classes`)."""
        if not now:
            return self
        classes = self.classes or (ItemClass.UNCLASSIFIED,) * len(uuids)
        merged = arrival_classes(classes, now, shares, uuids, e_cached)
        return self.with_sent(now, shares, uuids, merged)


def arrival_classes(
    classes: Sequence[ItemClass],
    now: Sequence[int],
    shares: Mapping[int, int],
    uuids: Sequence[str],
    e_cached: frozenset[str],
) -> tuple[ItemClass, ...]:
    """`classes` with the items sent to E at arrival (`now`) classed as they were then:
    e_cached where E held the identifier (`e_cached`), else e_compute, and their duplicates
    (`shares`) `duplicate` (a plan made while E encodes them would see them cached at E)."""
    out = list(classes)
    for i in now:
        out[i] = ItemClass.E_CACHED if uuids[i] in e_cached else ItemClass.E_COMPUTE
    for i in shares:
        out[i] = ItemClass.DUPLICATE
    return tuple(out)


def dispatch_at_arrival(
    now: Sequence[int], rest: Iterable[int], shares: Mapping[int, int], classes: Sequence[ItemClass]
) -> Dispatch:
    """A request decided at arrival, with no plan: E gets `now` (one item per identifier;
    `shares`: the other items of those identifiers), P gets `rest` raw with their uuid."""
    return Dispatch(tuple(now), frozenset(rest), shares, tuple(classes))


def dispatch_all(num_items: int) -> Dispatch:
    """Every item to E, unclassified: the reference proxy (eager), or no plan."""
    return _dispatch_all(check_int("num_items", num_items, 0))


@functools.lru_cache(maxsize=256)
def _dispatch_all(n: int) -> Dispatch:
    """One immutable Dispatch per count: eager builds one for every request."""
    return Dispatch(tuple(range(n)), shares=_NO_SHARES, classes=(ItemClass.UNCLASSIFIED,) * n)


_NO_SHARES: Mapping[int, int] = types.MappingProxyType({})


def dispatch(
    occurrences: Iterable[tuple[str, ItemClass, int]],
    e_demand: Iterable[str],
    num_items: int,
) -> Dispatch:
    """What E and P get, from a request's occurrences (vLLM's order: each its identifier, its
    class and its media item, request order) and the identifiers E must deliver.

    Each identifier in `e_demand` goes to E once, through its first occurrence that needs E
    (the uncovered one P consumes the embedding at: `mmreuse.accounting` counts it there too);
    every other occurrence of it shares that embedding. An occurrence whose identifier E does
    not deliver goes to P raw with its uuid, so that vLLM's own order (KV, its encoder cache,
    its EC connector, its encoder) serves it if P's state changed. Raises InvalidArgument for
    inconsistent input (an identifier E must deliver with no occurrence that needs E).
    """
    n = check_int("num_items", num_items, 0)
    wanted = dict.fromkeys(e_demand)
    item_of: dict[str, int] = {}  # identifier -> the item sent to E for it
    out_classes = [ItemClass.UNCLASSIFIED] * n
    occs = list(occurrences)
    for i, occ in enumerate(occs):
        try:
            ident, item_class, item = occ
        except (TypeError, ValueError):
            fail_type(f"occurrences[{i}]", "an (identifier, class, item) triple", occ)
        if type(item) is not int or not 0 <= item < n:
            fail_value(f"occurrences[{i}] item", f"an item index in [0, {n})", item)
        out_classes[item] = item_class
        if ident in wanted and item_class.needs_e and ident not in item_of:
            item_of[ident] = item
    missing = [ident for ident in wanted if ident not in item_of]
    if missing:
        raise InvalidArgument(
            f"e_demand names {show(missing)}, but no occurrence of it needs E (classes "
            f"{show([c.value for _, c, _ in occs])})"
        )
    shares: dict[int, int] = {}
    raw: set[int] = set()
    for ident, _, item in occs:
        first = item_of.get(ident)
        if first is None:
            raw.add(item)
        elif first != item:
            shares[item] = first
    return Dispatch(tuple(sorted(item_of.values())), frozenset(raw), shares, tuple(out_classes))


def dispatch_demand(
    demand: DemandResult, occurrence_items: Sequence[int], num_items: int
) -> Dispatch:
    """`dispatch` from a `compute_demand` result (the proxy's own plan): occurrence i is media
    item `occurrence_items[i]`."""
    decisions = demand.decisions
    if len(occurrence_items) != len(decisions):
        raise InvalidArgument(
            f"occurrence_items has {len(occurrence_items)} entries for the demand's "
            f"{len(decisions)} occurrences"
        )
    return dispatch(
        [
            (d.identifier, d.item_class, item)
            for d, item in zip(decisions, occurrence_items, strict=True)
        ],
        [ident for ident, _ in demand.e_demand],
        num_items,
    )
