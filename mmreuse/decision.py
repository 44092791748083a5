"""The decision's one home: the policies, an item's class on the wire, and what E and P get.

`mmreuse.plan.plan_admission` answers "what does this request need from E?". This module turns
that answer into what the proxy sends (`dispatch`): which media items go to E (each identifier
E must deliver, once, through the occurrence P consumes it at), which items share another's
embedding, and which go to P raw with their uuid. Every path uses it: the proxy under each
policy (from its own plan, or from P's `DemandAnswer`), P's `DemandScheduler` (its answers'
classes), the simulator and bench-cluster (their accounting, `mmreuse.accounting`).

Torch-free and vLLM-free.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from .demand import DemandResult, Klass, OccurrenceDecision
from .errors import InvalidArgument
from .validate import check_int, fail_value, show

__all__ = [
    "ANSWER_CLASSES",
    "ITEM_CLASSES",
    "POLICIES",
    "ROUTINGS",
    "Dispatch",
    "ItemClass",
    "Policy",
    "Routing",
    "dispatch",
    "dispatch_all",
    "dispatch_demand",
    "item_class",
    "item_classes",
    "parse_item_class",
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


class ItemClass(StrEnum):
    """One occurrence's class as the wire, the metrics and the records name it: its `Klass`,
    `duplicate` (an uncovered occurrence whose identifier an earlier one already claims), or
    `unclassified` (no plan was made for it)."""

    KV_COVERED = Klass.KV_COVERED.value
    NO_EMBEDS = Klass.NO_EMBEDS.value
    P_LOCAL = Klass.P_LOCAL.value
    P_EXTERNAL = Klass.P_EXTERNAL.value
    E_CACHED = Klass.E_CACHED.value
    E_COMPUTE = Klass.E_COMPUTE.value
    DUPLICATE = "duplicate"
    UNCLASSIFIED = "unclassified"

    @property
    def klass(self) -> Klass | None:
        """The `Klass` it names (None for duplicate and unclassified)."""
        return _KLASS_OF.get(self)

    @property
    def covered(self) -> bool:
        """P never touches the encoder for it (KV-covered, or no embed positions)."""
        return (
            self is ItemClass.KV_COVERED or self is ItemClass.NO_EMBEDS
        )  # `is`: enums hash in Python

    @property
    def needs_e(self) -> bool:
        """E must deliver an embedding for it (e_cached, e_compute)."""
        return self is ItemClass.E_CACHED or self is ItemClass.E_COMPUTE


_KLASS_OF: dict[ItemClass, Klass] = {ItemClass(k.value): k for k in Klass}
# keyed by the Klass's value: a str hashes in C, an enum member in Python
_ITEM_OF: dict[str, ItemClass] = {k.value: c for c, k in _KLASS_OF.items()}
ITEM_CLASSES: frozenset[str] = frozenset(c.value for c in ItemClass)
# what a peer (P) may name: every class but unclassified, which only the proxy uses
ANSWER_CLASSES: frozenset[str] = ITEM_CLASSES - {ItemClass.UNCLASSIFIED.value}


def item_class(decision: OccurrenceDecision) -> ItemClass:
    """An occurrence decision's class on the wire."""
    if decision.dedup_of is not None:
        return ItemClass.DUPLICATE
    return _ITEM_OF[decision.klass._value_]


def item_classes(demand: DemandResult) -> tuple[ItemClass, ...]:
    """Every occurrence's class on the wire, in the demand's (vLLM's) order."""
    return tuple(item_class(d) for d in demand.decisions)


def parse_item_class(value: object, field: str) -> ItemClass:
    """A class named on the wire by a peer (P's answer or record); unclassified is not one."""
    if not isinstance(value, str) or value not in ANSWER_CLASSES:
        fail_value(field, f"one of {sorted(ANSWER_CLASSES)}", value)
    return ItemClass(value)


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


def dispatch_all(num_items: int) -> Dispatch:
    """Every item to E, unclassified: the reference proxy (eager), or no plan."""
    return _dispatch_all(check_int("num_items", num_items, 0))


@functools.lru_cache(maxsize=256)
def _dispatch_all(n: int) -> Dispatch:
    """One immutable Dispatch per count: eager builds one for every request."""
    return Dispatch(tuple(range(n)), shares=_NO_SHARES, classes=(ItemClass.UNCLASSIFIED,) * n)


_NO_SHARES: Mapping[int, int] = types.MappingProxyType({})


def dispatch(
    identifiers: Sequence[str],
    classes: Sequence[ItemClass],
    e_demand: Iterable[str],
    occurrence_items: Sequence[int],
    num_items: int,
) -> Dispatch:
    """What E and P get, from a request's occurrences (vLLM's order: their identifiers and
    classes), the identifiers E must deliver, and each occurrence's media item.

    Each identifier in `e_demand` goes to E once, through its first occurrence that needs E
    (the uncovered one P consumes the embedding at: `mmreuse.accounting` counts it there too);
    every other occurrence of it shares that embedding. An occurrence whose identifier E does
    not deliver goes to P raw with its uuid, so that vLLM's own order (KV, its encoder cache,
    its EC connector, its encoder) serves it if P's state changed. Raises InvalidArgument for
    inconsistent input (an identifier E must deliver with no occurrence that needs E).
    """
    n = check_int("num_items", num_items, 0)
    if not (len(identifiers) == len(classes) == len(occurrence_items)):
        raise InvalidArgument(
            f"identifiers, classes and occurrence_items must be aligned, got {len(identifiers)}, "
            f"{len(classes)} and {len(occurrence_items)} entries"
        )
    wanted = dict.fromkeys(e_demand)
    item_of: dict[str, int] = {}  # identifier -> the item sent to E for it
    out_classes = [ItemClass.UNCLASSIFIED] * n
    for i, (ident, klass, item) in enumerate(
        zip(identifiers, classes, occurrence_items, strict=True)
    ):
        if type(item) is not int or not 0 <= item < n:
            fail_value(f"occurrence_items[{i}]", f"an item index in [0, {n})", item)
        out_classes[item] = klass
        if ident in wanted and klass.needs_e and ident not in item_of:
            item_of[ident] = item
    missing = [ident for ident in wanted if ident not in item_of]
    if missing:
        raise InvalidArgument(
            f"e_demand names {show(missing)}, but no occurrence of it needs E (classes "
            f"{show([c.value for c in classes])})"
        )
    shares: dict[int, int] = {}
    raw: set[int] = set()
    for ident, item in zip(identifiers, occurrence_items, strict=True):
        first = item_of.get(ident)
        if first is None:
            raw.add(item)
        elif first != item:
            shares[item] = first
    return Dispatch(tuple(sorted(item_of.values())), frozenset(raw), shares, tuple(out_classes))


def dispatch_demand(
    demand: DemandResult, occurrence_items: Sequence[int], num_items: int
) -> Dispatch:
    """`dispatch` from a `compute_demand` result (the proxy's own plan)."""
    return dispatch(
        [d.identifier for d in demand.decisions],
        item_classes(demand),
        [ident for ident, _ in demand.e_demand],
        occurrence_items,
        num_items,
    )
