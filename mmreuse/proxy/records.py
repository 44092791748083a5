"""The records of a request's path between the flows, the planner and the forward loop: the
`Decision` (where it goes, what E gets; its `DecideTrace` apart) and the `Arrival` (what was
decided when it arrived, before any render); and the `Sources` a planner decides from."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..decision import Dispatch
from ..demand_query import MAX_IDENT_CHARS, MAX_SALT_CHARS, DemandAnswer
from ..plan import AdmissionPlan

if TYPE_CHECKING:
    from ..availability import EmbeddingAvailability
    from .demand import DemandClient
    from .eside import ESide
    from .failover import Ejections
    from .models import ModelCatalog
    from .references import HeldReferences
    from .store import StoreTruth
    from .views import InstanceView


@dataclass(frozen=True, slots=True)
class DecideTrace:
    """How a Decision was made, for the metrics and the logs, apart from what it decided.

    Attributes:
        render_s, decide_s: seconds spent rendering, and deciding (hash + view + plan, or the
            demand query's round trip).
        no_plan: why a demand-aware decision fell back to sending everything (None if it did not).
        blind: planned on a view that was not complete (it may miss what P holds).
    """

    render_s: float = 0.0
    decide_s: float = 0.0
    no_plan: str | None = None
    blind: bool = False


NO_TRACE = DecideTrace()


@dataclass(frozen=True, slots=True)
class Decision:
    """Where a request goes and what E gets.

    Attributes:
        instance: index of the P (or PD) chosen, into `ProxyConfig.prefill_instances`.
        dispatch: what E and P get, and each item's class (`mmreuse.decision.Dispatch`).
        plan: the admission plan it follows (None under eager, or when no plan could be made).
        identifiers: per item, vLLM's identifier (from render), when rendered.
        cache_salt: the request's cache salt, when rendered.
        demand_id: the demand query whose answer this follows: P (or PD) gets it as
            `vllm_xargs.mmreuse_demand_id`, to check the answer's proof at admission.
        answer: that answer (demand and opportunistic; index too while the view is
            incomplete and the instance has a demand endpoint).
        request_id: the request's x-request-id (filled for `after_decide` hooks).
        in_store: the identifiers the plan took the shared store (P's EC connector) to hold.
        trace: how it was made (timings, fallbacks), apart from what it decided.
    """

    instance: int
    dispatch: Dispatch
    plan: AdmissionPlan | None = None
    identifiers: tuple[str, ...] = ()
    cache_salt: str | None = None
    demand_id: str | None = None
    answer: DemandAnswer | None = None
    request_id: str = ""
    in_store: frozenset[str] = frozenset()
    trace: DecideTrace = NO_TRACE


@dataclass(frozen=True, slots=True)
class Arrival:
    """What is decided when a request arrives, before any render (`ArrivalSplitter.arrival`).

    Attributes:
        instance: the P (or PD) chosen (random, or from the identifier index under affine).
        now: items E gets at once, one per identifier (request order): no place the chosen P
            could use holds it.
        shares: every other item of those identifiers -> the item sent (it shares its embedding).
        rest: items that wait for the render and the plan (or P's answer).
        external: what the shared store said it holds of the request (None: not asked, or no
            answer), for the plan to reuse.
        blind: split on a view that was not complete (it may miss what P holds).
        e_cached: the identifiers of `now` E held when they were sent (their class is
            e_cached, the others' e_compute: what E's side said then, not once E has them).
        on_p: `rest` is the request's one new item, sent to P for its encoder (`ArrivalSplitter.on_p`).
        stored: every item is `rest`, in the store and sent as E's kept reference, decided
            here (`ArrivalSplitter.arrival` under --held-items reference).
    """

    instance: int
    now: tuple[int, ...] = ()
    shares: Mapping[int, int] = field(default_factory=dict)
    rest: tuple[int, ...] = ()
    external: frozenset[str] | None = None
    blind: bool = False
    e_cached: frozenset[str] = frozenset()
    on_p: bool = False  # `rest` is P's to encode (--encode-on-p), not to plan
    stored: bool = False  # `rest` is in the store, each as E's kept reference (no plan)


@dataclass(frozen=True, slots=True)
class Sources:
    """What a Planner decides from.

    Attributes:
        views: one per P (or PD), config order.
        availability: what E and each P hold, by identifier.
        demand: one DemandClient per instance (under index, None for those without a demand
            endpoint: asked while that instance's view is incomplete), or none.
        models: what each P/PD serves, so that a request naming a LoRA adapter is not planned
            on the base model's blocks (None: every request's model is taken as base).
        store: the shared embedding store, asked what it holds of each request planned on the
            view (what P's EC connector loads: `p_external`).
        e_side: what E holds (None: one made from the config, without E views).
        references: E's metadata kept per item (--held-items reference), which the render is
            given in place of the media.
        p_health: which P's (or PD's) are up (`failover.Ejections`): an ejected one is chosen
            only where every one is (None: all taken as up).
    """

    views: Sequence[InstanceView]
    availability: EmbeddingAvailability
    demand: Sequence[DemandClient | None] = ()
    models: ModelCatalog | None = None
    store: StoreTruth | None = None
    e_side: ESide | None = None
    references: HeldReferences | None = None
    p_health: Ejections | None = None


def unplannable(request: Mapping[str, Any], uuids: Sequence[Any]) -> str | None:
    """Why a request is not planned on, if it is not: the proxy's records (E-side
    availability, demand queries) take identifiers and salts within the demand wire's bounds,
    so that a client cannot make them hold megabytes per entry."""
    for i, uid in enumerate(uuids):
        if not isinstance(uid, str):
            return f"item {i}'s uuid is a {type(uid).__name__}, not a string"
        if len(uid) > MAX_IDENT_CHARS:
            return f"item {i}'s uuid has {len(uid)} characters (at most {MAX_IDENT_CHARS} are planned on)"
    salt = request.get("cache_salt")
    if salt is not None and not isinstance(salt, str):
        return f"cache_salt is a {type(salt).__name__}, not a string"
    if salt is not None and len(salt) > MAX_SALT_CHARS:
        return f"cache_salt has {len(salt)} characters (at most {MAX_SALT_CHARS} are planned on)"
    return None
