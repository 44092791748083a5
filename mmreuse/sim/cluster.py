"""A discrete-event simulation of an EPD cluster: proxy, encoders (E), prefills (P).

Built from the library's parts: block hashes from `mmreuse.hashing`, P's prefix cache over a
`BlockIndex`, and every reuse decision from `mmreuse.plan.plan_admission` (KV lookup ->
`kv_coverage` -> `compute_demand`), on P's true state at admission or, for the `index` policy,
on the proxy's lagging view. Requests arrive open-loop (the same stream for every policy); the
proxy handles them by policy (`mmreuse.sim.policies`), P accounts for every occurrence at
admission (`mmreuse.accounting`, the rules bench-cluster shares).
"""

from __future__ import annotations

import heapq
import random
from collections import deque
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from itertools import count
from typing import Any, cast

from ..accounting import (
    Bucket,
    Delivery,
    PolicyResult,
    account_request,
    needed_from_e,
    occurrences_of,
)
from ..blockhash import EventBlockId, to_event_ids
from ..demand import Availability, EncoderCacheSpace, ItemClass
from ..hashing import BlockHasher
from ..kvview import KVView
from ..plan import AdmissionPlan, GivenCoverage, KVLookup, plan_admission
from .caches import EmbeddingLRU, EncoderCache, PrefixCache
from .config import SimConfig
from .policies import make_policy
from .view import NO_VIEW, ClusterView, prefill_name
from .workload import SimRequest

__all__ = ["Deliveries", "EncodeJob", "Encoder", "Join", "Prefill", "Simulation"]


def _rule_s_can_apply(cache: EncoderCache, request: SimRequest, local: dict[str, int]) -> bool:
    """Whether rule S can change a class: the embeds the request's items P does not hold need
    beyond the free slots would evict, oldest first, a freeable entry the request itself uses.
    An upper bound (each occurrence counted, none referenced first): `compute_demand` with the
    cache's space then decides exactly."""
    freeable = cache.freeable
    if not freeable:
        return False
    mm = request.mm
    deficit = cache.used - cache.capacity
    for m in mm:
        if m.identifier not in local:
            deficit += m.num_embeds
    if deficit <= 0:
        return False
    mine = {m.identifier for m in mm}
    entries = cache.entries
    for ident in freeable:  # oldest first: the order P's allocations evict in
        if ident in mine:
            return True
        deficit -= entries[ident]
        if deficit <= 0:
            return False
    return False


# identifier -> (how E produced it, num_embeds): what an E job hands P with the request
Deliveries = dict[str, tuple[Delivery, int]]


@dataclass(slots=True)
class Prefill:
    """One P instance: its caches and the FIFO of requests waiting for admission."""

    kv: PrefixCache
    encoder_cache: EncoderCache
    queue: deque[tuple[SimRequest, Deliveries]] = field(default_factory=deque)
    busy: bool = False


@dataclass(slots=True)
class Encoder:
    """One E instance: its cache, the FIFO of jobs, and when its late-fallback work ends."""

    cache: EmbeddingLRU
    queue: deque[EncodeJob] = field(default_factory=deque)
    busy_until: float = 0.0  # late fallbacks queue behind each other (not behind jobs)
    busy: bool = False


@dataclass(slots=True)
class Join:
    """A request split at arrival: its E jobs (the arrival's, then what the plan adds), whose
    deliveries P gets together once the last one is done."""

    request: SimRequest
    prefill: int
    sent: set[str]  # what went to E at arrival
    parts: int = 2
    delivered: Deliveries = field(default_factory=dict)
    ready_at: float = 0.0

    def done(self, sim: Simulation, delivered: Deliveries, at: float) -> None:
        """One part is done (its deliveries reach P at `at`); after the last, P gets them all."""
        self.delivered.update(delivered)
        self.ready_at = max(self.ready_at, at)
        self.parts -= 1
        if self.parts == 0:
            sim.at(self.ready_at, sim.send_to_prefill, self.request, self.prefill, self.delivered)


@dataclass(slots=True)
class EncodeJob:
    """What E was asked to do for a request: its distinct items, in order."""

    request: SimRequest
    prefill: int
    items: list[tuple[str, int]]  # (identifier, num_embeds)
    answer: set[str] | None = None  # opportunistic: P's answer, once it exists
    answer_at: float = float("inf")  # ... and when it reaches E
    delivered: dict[str, Delivery] = field(default_factory=dict)
    join: Join | None = None  # a part of a request split at arrival

    def ruled_out(self, ident: str, now: float) -> bool:
        """Whether P's answer reached E by `now` and does not need `ident`."""
        return self.answer is not None and now >= self.answer_at and ident not in self.answer


class Simulation:
    """One policy over one request stream."""

    def __init__(
        self, cfg: SimConfig, requests: list[SimRequest], policy: str, progress: Any = None
    ) -> None:
        self.cost = cfg.cost
        self.cluster = cluster = cfg.cluster
        self.requests = requests
        self.policy = make_policy(policy, self)
        self.progress = progress  # a tqdm bar, or None
        self.result = PolicyResult(policy)
        self.block_size = cluster.block_size
        self.hasher = BlockHasher("sha256", self.block_size, seed="0")
        self.rng = random.Random(f"{cfg.seed}-routing")
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[..., None], tuple]] = []
        self._seq = count()
        self._last_encoder = 0  # round robin over E
        self.view = (
            ClusterView(
                cluster.num_prefills, self.block_size, cluster.view_lag_ms, lambda: self.now
            )
            if self.policy.reads_view
            else NO_VIEW
        )
        self.prefills = [self._make_prefill(p) for p in range(cluster.num_prefills)]
        self.encoders = [
            Encoder(EmbeddingLRU(cluster.e_cache_embeds, self._e_cache_changed(e)))
            for e in range(cluster.num_encoders)
        ]
        self.external = EmbeddingLRU(cluster.external_store_embeds, self.view.external_changed)
        self.e_reads_external = cluster.e_reads_external_store
        # identifier -> the first full KV block (event id) its latest admission put it in: how
        # the split tells, at arrival, whether a block P holds carries an item (the proxy's view
        # follows every carrier; vLLM evicts a request's blocks tail first, so the first carrier
        # is the last to go, and one id an item keeps a 100k-request run's memory flat)
        self._carriers: dict[str, EventBlockId] = {}
        # per P, the identifiers its processor cache has seen (a render of those costs no
        # image processing; vLLM's cache is GBs: unbounded here)
        self._processed: list[set[str]] = [set() for _ in range(cluster.num_prefills)]

    def _make_prefill(self, p: int) -> Prefill:
        view = self.view
        return Prefill(
            PrefixCache(
                self.cluster.p_kv_blocks,
                lambda stored, removed: view.kv_changed(p, stored, removed),
            ),
            EncoderCache(
                self.cluster.p_encoder_cache_embeds,
                lambda added, removed: view.encoder_cache_changed(p, added, removed),
            ),
        )

    def _e_cache_changed(self, e: int) -> Callable[[list[str], list[str]], None]:
        view = self.view
        return lambda added, removed: view.e_cache_changed(e, added, removed)

    # ---- event loop ---------------------------------------------------------------------------

    def at(self, t: float, fn: Callable[..., None], *args: Any) -> None:
        """Run `fn(*args)` at time `t` (ms); ties run in scheduling order."""
        heapq.heappush(self._heap, (t, next(self._seq), fn, args))

    def run(self) -> PolicyResult:
        for request in self.requests:
            self.at(request.arrival_ms, self._arrive, request)
        heap = self._heap
        while heap:
            t, _, fn, args = heapq.heappop(heap)
            self.now = t
            fn(*args)
        return self.result

    # ---- what policies use --------------------------------------------------------------------

    def block_hashes(self, request: SimRequest) -> list[bytes]:
        """The request's full-block hashes (none with prefix caching off); a session's are
        hashed once, for its final history, and every turn takes its prefix."""
        if not self.cluster.prefix_caching:
            return []
        session = request.session
        if session.hashes is None:
            session.hashes = self.hasher.hash_prompt(session.tokens, mm=session.mm)
        return session.hashes[: request.num_tokens // self.block_size]

    def plan(
        self,
        request: SimRequest,
        availability: Availability,
        *,
        view: KVView | None = None,
        num_computed_tokens: int | None = None,
        encoder_cache: EncoderCacheSpace | None = None,
    ) -> AdmissionPlan:
        """`plan_admission` for `request`: C looked up in `view`, or given; rule S over
        `encoder_cache` (P's encoder-cache space) when given."""
        if num_computed_tokens is not None:
            return plan_admission(
                num_prompt_tokens=request.num_tokens,
                occurrences=request.mm,
                availability=availability,
                coverage=GivenCoverage(num_computed_tokens),
                encoder_cache=encoder_cache,
            )
        return plan_admission(
            num_prompt_tokens=request.num_tokens,
            occurrences=request.mm,
            availability=availability,
            coverage=KVLookup(
                view,  # type: ignore[arg-type]  # None is refused by KVLookup, naming view
                block_hashes=self.block_hashes(request),
                block_size=self.block_size,
            ),
            encoder_cache=encoder_cache,
        )

    def plan_at_prefill(
        self,
        request: SimRequest,
        p: int,
        *,
        delivered: Deliveries | None = None,
        not_external: Collection[str] = (),
        num_computed_tokens: int | None = None,
    ) -> AdmissionPlan:
        """P's true plan now: its KV (unless C is given), its encoder cache plus `delivered`,
        and the external store less `not_external`."""
        prefill = self.prefills[p]
        cache = prefill.encoder_cache
        local = cache.entries
        if delivered:
            local = {**local, **{ident: n for ident, (_, n) in delivered.items()}}
        idents = {m.identifier for m in request.mm}
        external = self.external
        in_store = (
            frozenset(i for i in idents if i in external and i not in not_external)
            if external.enabled
            else frozenset()
        )
        availability = Availability(
            p_local={i: local[i] for i in idents if i in local}, p_external=in_store
        )
        return self.plan(
            request,
            availability,
            view=prefill.kv,
            num_computed_tokens=num_computed_tokens,
            encoder_cache=cache.space() if _rule_s_can_apply(cache, request, local) else None,
        )

    def job(
        self,
        request: SimRequest,
        p: int,
        idents: set[str] | None = None,
        *,
        join: Join | None = None,
    ) -> EncodeJob:
        """An E job for the request's distinct items (only `idents` when given), in order."""
        seen: set[str] = set()
        items = []
        for m in request.mm:
            if m.identifier not in seen and (idents is None or m.identifier in idents):
                seen.add(m.identifier)
                items.append((m.identifier, m.num_embeds))
        return EncodeJob(request, p, items, join=join)

    def join(self, request: SimRequest, p: int, sent: set[str]) -> Join:
        """The join of a request split at arrival, `sent` to E at once."""
        return Join(request, p, sent)

    def render(self, request: SimRequest, p: int) -> float:
        """P renders `request` (the proxy's render, to plan it): how long it takes. Its images
        P's processor cache has not seen cost image processing, the rest only the fixed part;
        P's cache holds them all from now on."""
        seen = self._processed[p]
        idents = {m.identifier for m in request.mm}
        fresh = len(idents - seen)
        seen |= idents
        return self.cost.render_ms(fresh)

    def new_at_arrival(self, request: SimRequest, p: int) -> set[str]:
        """The identifiers of `request` that go to E at arrival: those the lagging view says
        neither P's encoder cache, nor the store, nor any KV block of P holds (the proxy's
        `Planner.split`; the store is asked, so its answer is current)."""
        view = self.view
        assert isinstance(view, ClusterView)  # the splitting policies read it
        view.catch_up()
        distinct = {m.identifier for m in request.mm}
        new = set(distinct - view.embeddings.p_holds(prefill_name(p), distinct))
        external = self.external
        new = {i for i in new if not external.holds(i)}
        kv, carriers = view.kv[p], self._carriers
        return {i for i in new if i not in carriers or not kv.contains(carriers[i])}

    def peek_next_encoder(self) -> int:
        """The E the next job or fallback goes to."""
        return (self._last_encoder + 1) % self.cluster.num_encoders

    def _next_encoder(self) -> int:
        self._last_encoder = self.peek_next_encoder()
        return self._last_encoder

    # ---- proxy --------------------------------------------------------------------------------

    def _route(self, request: SimRequest) -> int:
        if self.cluster.routing == "affine":
            return request.session.sid % self.cluster.num_prefills
        return self.rng.randrange(self.cluster.num_prefills)

    def _arrive(self, request: SimRequest) -> None:
        p = self._route(request)
        if request.mm:
            self.policy.arrive(request, p)
        else:
            self.send_to_prefill(request, p, {})

    # ---- E ------------------------------------------------------------------------------------

    def send_to_encoder(self, job: EncodeJob) -> None:
        if job.join is None or not job.join.sent.isdisjoint(i for i, _ in job.items):
            self.result.e_requests += 1  # one per request (its arrival job, if split)
        e = self._next_encoder()
        encoder = self.encoders[e]
        encoder.queue.append(job)
        if not encoder.busy:
            encoder.busy = True
            self.at(self.now, self._encode_item, e, 0)

    def _encode_item(self, e: int, i: int) -> None:
        """E works on item `i` of its head job; past the last item, sends the job's result."""
        encoder = self.encoders[e]
        job = encoder.queue[0]
        if i < len(job.items):
            ident, n = job.items[i]
            if job.ruled_out(ident, self.now):
                duration = 0.0  # P said it is not needed before the forward started
            elif self._e_holds(encoder, ident):
                job.delivered[ident] = Delivery.E_CACHE
                duration = self.cost.e_cache_hit_ms
            else:
                job.delivered[ident] = Delivery.FORWARD
                duration = self.cost.encoder_ms_per_token * n
                encoder.cache.put(ident, n)
                self.external.put(ident, n)
            self.at(self.now + duration, self._encode_item, e, i + 1)
            return
        encoder.queue.popleft()
        sizes = dict(job.items)
        delivered = {ident: (how, sizes[ident]) for ident, how in job.delivered.items()}
        tokens = sum(n for _, n in delivered.values())
        transfer_ms = 0.0
        if delivered:
            # one transfer per request: a split request's second part adds only bytes
            join = job.join
            if join is None or not join.delivered:
                self.result.transfers += 1
            self.result.transfer_bytes += tokens * self.cost.embedding_bytes_per_token
            transfer_ms = self.cost.transfer_ms(tokens)
        if job.join is not None:
            job.join.done(self, delivered, self.now + transfer_ms)
        else:
            self.at(
                self.now + transfer_ms, self.send_to_prefill, job.request, job.prefill, delivered
            )
        if encoder.queue:
            self.at(self.now, self._encode_item, e, 0)
        else:
            encoder.busy = False

    def _e_holds(self, encoder: Encoder, ident: str) -> bool:
        """E serves `ident` without a forward: its cache, else (where E reads it) the store."""
        if encoder.cache.hit(ident):
            return True
        return self.e_reads_external and self.external.hit(ident)

    def _fallback(self, ident: str, n: int) -> tuple[Delivery, float]:
        """P fetches what it needs and lacks: E's cache, else a forward; returns the delay."""
        encoder = self.encoders[self._next_encoder()]
        start = max(self.now, encoder.busy_until)
        if self._e_holds(encoder, ident):
            how, duration = Delivery.E_CACHE, self.cost.e_cache_hit_ms
        else:
            how, duration = Delivery.FORWARD, self.cost.encoder_ms_per_token * n
            encoder.cache.put(ident, n)
            self.external.put(ident, n)
        encoder.busy_until = start + duration
        return how, start + duration + self.cost.transfer_ms(n) - self.now

    # ---- P ------------------------------------------------------------------------------------

    def send_to_prefill(self, request: SimRequest, p: int, delivered: Deliveries) -> None:
        prefill = self.prefills[p]
        prefill.queue.append((request, delivered))
        if not prefill.busy:
            prefill.busy = True
            self.at(self.now, self._admit, p)

    def _admit(self, p: int) -> None:
        """P admits its next request: accounts for each occurrence (`mmreuse.accounting`),
        loads or fetches what it lacks, caches the KV, and schedules the prefill's end."""
        prefill = self.prefills[p]
        request, delivered = prefill.queue.popleft()
        result = self.result
        forwarded = frozenset(i for i, (how, _) in delivered.items() if how is Delivery.FORWARD)
        would = self.plan_at_prefill(request, p, not_external=forwarded)
        c = would.num_computed_tokens
        demand = (
            would.demand
            if not delivered
            else self.plan_at_prefill(request, p, delivered=delivered, num_computed_tokens=c).demand
        )
        decisions = demand.decisions
        delay = 0.0

        def late(i: int, ident: str, cls: ItemClass) -> Delivery:
            nonlocal delay  # P needs it and nobody sent it: fetch now
            how, wait = self._fallback(ident, decisions[i].num_embeds)
            delay = max(delay, wait)
            return how

        def on_external(i: int, ident: str) -> None:
            nonlocal delay
            self.external.hit(ident)
            delay += self.cost.external_ms(decisions[i].num_embeds)

        occurrences = occurrences_of(demand)
        acct = account_request(
            occurrences,
            delivered={ident: how for ident, (how, _) in delivered.items()},
            would_need_e=needed_from_e(
                occurrences if demand is would.demand else occurrences_of(would.demand)
            ),
            late=late,
            on_external=on_external,
            partial={i for i, d in enumerate(decisions) if d.partial},
        )
        result.add(acct)
        acquired: list[str] = []
        for d, bucket in zip(decisions, acct.buckets, strict=True):
            if (
                bucket is not Bucket.DEDUP
                and not d.klass.covered
                and prefill.encoder_cache.acquire(d.identifier, d.num_embeds)
            ):
                acquired.append(d.identifier)
        needs_encoding = acct.needs_encoding
        hit_blocks = would.proof.block_ids.tolist() if would.proof is not None else []
        hashes = cast("tuple[bytes, ...]", would.block_hashes)  # ours, from mmreuse.hashing
        blocks = prefill.kv.admit(hashes, would.hit_blocks, hit_blocks) or []
        self._processed[p].update(m.identifier for m in request.mm)
        if self.policy.splits:
            self._note_carriers(request, hashes)
        duration = (
            delay
            + self.cost.prefill_fixed_ms
            + self.cost.prefill_ms_per_token * (request.num_tokens - c)
        )
        self.at(
            self.now + duration, self._prefill_done, p, request, blocks, acquired, needs_encoding
        )

    def _note_carriers(self, request: SimRequest, hashes: tuple[bytes, ...]) -> None:
        """The first full block that carries each of the request's items (vLLM's KV events
        name the identifiers a block carries)."""
        n, bs = len(hashes), self.block_size
        for m in request.mm:
            first = m.offset // bs
            if first < n:
                self._carriers[m.identifier] = to_event_ids(hashes[first : first + 1])[0]

    def _prefill_done(
        self,
        p: int,
        request: SimRequest,
        blocks: list[int],
        acquired: list[str],
        needs_encoding: bool,
    ) -> None:
        prefill = self.prefills[p]
        prefill.kv.release(blocks)
        for ident in acquired:
            prefill.encoder_cache.release(ident)
        ttft = self.now - request.arrival_ms
        result = self.result
        result.requests += 1
        result.ttft_ms.append(ttft)
        (result.ttft_encode_ms if needs_encoding else result.ttft_reuse_ms).append(ttft)
        if self.progress is not None:
            self.progress.update(1)
        if prefill.queue:
            self.at(self.now, self._admit, p)
        else:
            prefill.busy = False
