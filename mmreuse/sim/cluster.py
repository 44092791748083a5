"""A discrete-event simulation of an EPD cluster: proxy, encoders (E), prefills (P).

Every reuse decision goes through `compute_demand` (P's true state at admission; the proxy's
view for the `index` policy), coverage through `kv_coverage`, KV lookups through `BlockIndex`,
hashes from `mmreuse.hashing`. Requests arrive open-loop (the same stream for every policy).

Per request the proxy, by policy:
- eager: sends every multimodal item of the resent history to a round-robin E, then P;
- demand: asks the chosen P first (one RTT), then sends E only the `e_demand`;
- opportunistic: dispatches E at once; E skips an item whose forward has not started when
  P's answer (one RTT) says it is not needed;
- index: decides from a lagging view (RemoteKVIndex fed with P's KV events, and an
  EmbeddingAvailability fed with cache deltas); P re-decides at admission and fetches what the
  view missed (a late fallback: E's cache, else an encoder forward).

Each occurrence lands in one bucket: an encoder forward, or avoided by KV coverage, by a
P-side embedding, by the external store, by E's cache, or as a duplicate within its request.
"""

from __future__ import annotations

import heapq
import random
from collections import deque
from dataclasses import dataclass, field
from itertools import count

import cachetools

from ..availability import EmbeddingAvailability
from ..demand import Availability, Klass, compute_demand, kv_coverage
from ..events import BlockRemoved, BlockStored, KVEventBatch, Metrics, RemoteKVIndex
from ..hashing import BlockHasher, to_event_id
from .caches import EncoderCache, PrefixCache
from .config import SimConfig
from .workload import SimRequest

BUCKETS = ("forward", "kv", "p_embedding", "external", "e_cache", "dedup")
NEEDS_E = (Klass.E_CACHED, Klass.E_COMPUTE)


class _Store(cachetools.LRUCache):
    """E's cache / the external store: LRU in embeddings, reporting additions and evictions."""

    def __init__(self, capacity: int, on_change):
        super().__init__(maxsize=max(capacity, 1), getsizeof=lambda n: n)
        self.enabled = capacity > 0
        self._on_change = on_change

    def popitem(self):
        key, value = super().popitem()
        self._on_change([], [key])
        return key, value

    def put(self, ident: str, n: int) -> None:
        if self.enabled and n <= self.maxsize and ident not in self:
            self[ident] = n
            self._on_change([ident], [])

    def hit(self, ident: str) -> bool:
        return self.enabled and self.get(ident) is not None


@dataclass(slots=True)
class _P:
    prefix: PrefixCache
    enc: EncoderCache
    queue: deque = field(default_factory=deque)
    busy: bool = False


@dataclass(slots=True)
class _E:
    store: _Store
    queue: deque = field(default_factory=deque)
    busy_until: float = 0.0
    busy: bool = False


@dataclass(slots=True)
class _Job:
    """What E was asked to do for a request."""

    req: SimRequest
    p: int
    items: list[tuple[str, int]]
    answer: dict | None = None  # opportunistic: P's answer, once it exists
    answer_at: float = float("inf")
    delivered: dict[str, str] = field(default_factory=dict)  # ident -> "forward" | "e_cache"


@dataclass(slots=True)
class PolicyResult:
    policy: str
    requests: int = 0
    occurrences: int = 0
    buckets: dict[str, int] = field(default_factory=lambda: dict.fromkeys(BUCKETS, 0))
    redundant_forwards: int = 0
    e_requests: int = 0
    transfers: int = 0
    transfer_bytes: int = 0
    external_loads: int = 0
    late_fallbacks: int = 0
    wrong_skips: int = 0
    ttft_ms: list[float] = field(default_factory=list)
    ttft_encode_ms: list[float] = field(default_factory=list)
    ttft_reuse_ms: list[float] = field(default_factory=list)


class Simulation:
    """One policy over one request stream."""

    def __init__(self, cfg: SimConfig, requests: list[SimRequest], policy: str,
                 progress=None) -> None:
        self.cfg = cfg
        self.cost = cfg.cost
        self.cl = cfg.cluster
        self.requests = requests
        self.policy = policy
        self.progress = progress
        self.res = PolicyResult(policy)
        self.bs = self.cl.block_size
        self.hasher = BlockHasher("sha256", self.bs, seed="0")
        self.rng = random.Random(f"{cfg.seed}-routing")
        self.now = 0.0
        self._heap: list = []
        self._seq = count()
        self._rr = 0
        # the index policy's lagging view
        self._lagged: deque = deque()
        self.view_kv = [RemoteKVIndex(f"p{i}") for i in range(self.cl.num_prefills)]
        self.view_avail = EmbeddingAvailability(ttl_s=1e9, max_entries=10**7,
                                                timer=lambda: self.now / 1000.0,
                                                metrics=Metrics(_registry()))
        self.ps = [self._make_p(i) for i in range(self.cl.num_prefills)]
        self.es = [_E(_Store(self.cl.e_cache_embeds, self._view_e(i)))
                   for i in range(self.cl.num_encoders)]
        self.external = _Store(self.cl.external_store_embeds, self._view_ext)

    # ---- the view fed to the index policy (with lag) ----------------------------------------

    def _lag(self, fn) -> None:
        if self.policy == "index":
            self._lagged.append((self.now, fn))

    def _make_p(self, i: int) -> _P:
        view = self.view_kv[i]

        def on_kv(stored, removed, view=view):
            if self.policy != "index":
                return
            events = []
            if stored:
                events.append(BlockStored(block_hashes=[to_event_id(h) for h in stored],
                                          parent_block_hash=None, token_ids=[], block_size=self.bs,
                                          lora_id=None, medium="GPU", lora_name=None))
            if removed:
                events.append(BlockRemoved(block_hashes=[to_event_id(h) for h in removed], medium="GPU"))
            batch = KVEventBatch(ts=self.now / 1000.0, events=events)
            self._lag(lambda: view.apply(batch))

        def on_enc(added, removed, name=f"p{i}"):
            self._lag(lambda: self.view_avail.update_p(name, added=added, removed=removed))

        return _P(PrefixCache(self.cl.p_kv_blocks, on_kv), EncoderCache(self.cl.p_encoder_cache_embeds, on_enc))

    def _view_e(self, i: int):
        def on_change(added, removed, name=f"e{i}"):
            self._lag(lambda: self.view_avail.update_e(name, added=added, removed=removed))
        return on_change

    def _view_ext(self, added, removed) -> None:
        self._lag(lambda: self.view_avail.update_external(added=added, removed=removed))

    def _catch_up_view(self) -> None:
        horizon = self.now - self.cl.view_lag_ms
        while self._lagged and self._lagged[0][0] <= horizon:
            self._lagged.popleft()[1]()

    # ---- event loop ---------------------------------------------------------------------------

    def _at(self, t: float, fn, *args) -> None:
        heapq.heappush(self._heap, (t, next(self._seq), fn, args))

    def run(self) -> PolicyResult:
        for req in self.requests:
            self._at(req.arrival_ms, self._arrive, req)
        while self._heap:
            t, _, fn, args = heapq.heappop(self._heap)
            self.now = t
            fn(*args)
        return self.res

    # ---- helpers ------------------------------------------------------------------------------

    def _hashes(self, req: SimRequest) -> list[bytes]:
        if not self.cl.prefix_caching:
            return []
        s = req.session
        if s.hashes is None:
            s.hashes = self.hasher.hash_prompt(s.tokens, mm=s.mm)
        return s.hashes[: req.num_tokens // self.bs]

    def _coverage(self, req: SimRequest, hit_blocks: int) -> int:
        return kv_coverage(req.num_tokens, cached_prefix_tokens=hit_blocks * self.bs,
                           block_size=self.bs)[0]

    def _items(self, req: SimRequest, idents=None) -> list[tuple[str, int]]:
        seen, items = set(), []
        for m in req.mm:
            if m.identifier not in seen and (idents is None or m.identifier in idents):
                seen.add(m.identifier)
                items.append((m.identifier, m.num_embeds))
        return items

    def _route(self, req: SimRequest) -> int:
        if self.cl.routing == "affine":
            return req.session.sid % self.cl.num_prefills
        return self.rng.randrange(self.cl.num_prefills)

    def _next_e(self) -> int:
        self._rr = (self._rr + 1) % self.cl.num_encoders
        return self._rr

    def _p_demand(self, req: SimRequest, p: int, extra_local: dict[str, int] | None = None,
                  not_external: frozenset[str] = frozenset(), c: int | None = None):
        """P's true demand now (its KV, encoder cache, the external store)."""
        P = self.ps[p]
        if c is None:
            c = self._coverage(req, P.prefix.hit(self._hashes(req))[0])
        local = P.enc.entries if not extra_local else {**P.enc.entries, **extra_local}
        idents = {m.identifier for m in req.mm}
        ext = frozenset(i for i in idents if self.external.enabled and i in self.external
                        and i not in not_external)
        avail = Availability(p_local={i: local[i] for i in idents if i in local},
                             p_external=ext)
        return compute_demand(req.mm, req.num_tokens, c, avail), c

    # ---- proxy --------------------------------------------------------------------------------

    def _arrive(self, req: SimRequest) -> None:
        p = self._route(req)
        rtt = self.cost.demand_rtt_ms
        if not req.mm:
            self._to_p(req, p, {})
        elif self.policy == "eager":
            self._to_e(_Job(req, p, self._items(req)))
        elif self.policy == "demand":
            self._at(self.now + rtt / 2, self._p_answers_demand, req, p)
        elif self.policy == "opportunistic":
            job = _Job(req, p, self._items(req))
            self._at(self.now + rtt / 2, self._p_answers_opportunistic, job)
            self._to_e(job)
        else:  # index
            self._catch_up_view()
            view = self.view_kv[p]
            hit = view.longest_prefix(self._hashes(req))
            c = self._coverage(req, hit)
            e = (self._rr + 1) % self.cl.num_encoders
            avail = self.view_avail.availability_for(f"p{p}", f"e{e}")
            res = compute_demand(req.mm, req.num_tokens, c, avail)
            needed = {i for i, _ in res.e_demand}
            if needed:
                self._to_e(_Job(req, p, self._items(req, needed)))
            else:
                self._to_p(req, p, {})

    def _p_answers_demand(self, req: SimRequest, p: int) -> None:
        res, _ = self._p_demand(req, p)
        needed = {i for i, _ in res.e_demand}
        rtt = self.cost.demand_rtt_ms
        if needed:
            self._at(self.now + rtt / 2, lambda: self._to_e(_Job(req, p, self._items(req, needed))))
        else:
            self._at(self.now + rtt / 2, self._to_p, req, p, {})

    def _p_answers_opportunistic(self, job: _Job) -> None:
        res, _ = self._p_demand(job.req, job.p)
        job.answer = {i for i, _ in res.e_demand}
        job.answer_at = self.now + self.cost.demand_rtt_ms / 2

    # ---- E --------------------------------------------------------------------------------------

    def _to_e(self, job: _Job) -> None:
        self.res.e_requests += 1
        e = self._next_e()
        E = self.es[e]
        E.queue.append(job)
        if not E.busy:
            E.busy = True
            self._at(self.now, self._e_item, e, 0)

    def _e_item(self, e: int, i: int) -> None:
        E = self.es[e]
        job = E.queue[0]
        if i < len(job.items):
            ident, n = job.items[i]
            if job.answer is not None and self.now >= job.answer_at and ident not in job.answer:
                dur = 0.0  # P said it is not needed before the forward started
            elif E.store.hit(ident):
                job.delivered[ident] = "e_cache"
                dur = self.cost.e_cache_hit_ms
            else:
                job.delivered[ident] = "forward"
                dur = self.cost.encoder_ms_per_token * n
                E.store.put(ident, n)
                self.external.put(ident, n)
            self._at(self.now + dur, self._e_item, e, i + 1)
            return
        E.queue.popleft()
        tokens = sum(n for ident, n in job.items if ident in job.delivered)
        if job.delivered:
            self.res.transfers += 1
            self.res.transfer_bytes += tokens * self.cost.embedding_bytes_per_token
        sizes = dict(job.items)
        delivered = {ident: (how, sizes[ident]) for ident, how in job.delivered.items()}
        self._at(self.now + (self.cost.transfer_ms(tokens) if job.delivered else 0.0),
                 self._to_p, job.req, job.p, delivered)
        if E.queue:
            self._at(self.now, self._e_item, e, 0)
        else:
            E.busy = False

    def _fallback(self, ident: str, n: int) -> tuple[str, float]:
        """P fetches what it needs and lacks: E's cache, else a forward; returns the delay."""
        e = self._next_e()
        E = self.es[e]
        start = max(self.now, E.busy_until)
        if E.store.hit(ident):
            how, dur = "e_cache", self.cost.e_cache_hit_ms
        else:
            how, dur = "forward", self.cost.encoder_ms_per_token * n
            E.store.put(ident, n)
            self.external.put(ident, n)
        E.busy_until = start + dur
        return how, start + dur + self.cost.transfer_ms(n) - self.now

    # ---- P --------------------------------------------------------------------------------------

    def _to_p(self, req: SimRequest, p: int, delivered: dict) -> None:
        P = self.ps[p]
        P.queue.append((req, delivered))
        if not P.busy:
            P.busy = True
            self._at(self.now, self._p_start, p)

    def _p_start(self, p: int) -> None:
        P = self.ps[p]
        req, delivered = P.queue.popleft()
        res = self.res
        # What P would need without this request's deliveries (for the redundancy count; what
        # this request's own forwards just wrote to the external store does not count) ...
        hashes = self._hashes(req)
        hit, held = P.prefix.hit(hashes)
        c = self._coverage(req, hit)
        fresh = frozenset(i for i, (how, _) in delivered.items() if how == "forward")
        would, _ = self._p_demand(req, p, not_external=fresh, c=c)
        # ... and what it needs with them: delivered embeddings sit in its encoder cache.
        demand = would if not delivered else self._p_demand(
            req, p, {i: n for i, (_, n) in delivered.items()}, c=c)[0]
        delay = 0.0
        acquired: list[str] = []
        would_class = {d.identifier: d.klass for d in would.decisions if d.dedup_of is None
                       and d.klass not in (Klass.KV_COVERED, Klass.NO_EMBEDS)}
        needs_encoding = False
        covered = (Klass.KV_COVERED, Klass.NO_EMBEDS)
        primary: dict[str, int] = {}  # ident -> the occurrence that accounts for it
        for d in demand.decisions:
            if d.identifier not in primary or (d.dedup_of is None and d.klass not in covered
                                               and demand.decisions[primary[d.identifier]].klass in covered):
                primary[d.identifier] = d.index
        for d in demand.decisions:
            ident = d.identifier
            if primary[ident] != d.index:
                res.buckets["dedup"] += 1
                continue
            n = d.num_embeds
            if ident in delivered:
                bucket = delivered[ident][0]
                if bucket == "forward":
                    if would_class.get(ident) not in NEEDS_E:
                        res.redundant_forwards += 1
                    else:
                        needs_encoding = True
            elif d.klass in covered:
                bucket = "kv"
            elif d.klass is Klass.P_LOCAL:
                bucket = "p_embedding"
            elif d.klass is Klass.P_EXTERNAL:
                bucket = "external"
                res.external_loads += 1
                self.external.hit(ident)
                delay += self.cost.external_ms(n)
            else:  # P needs it and nobody sent it: fetch now
                res.late_fallbacks += 1
                bucket, wait = self._fallback(ident, n)
                delay = max(delay, wait)
                needs_encoding |= bucket == "forward"
            if d.klass not in covered:
                if d.klass in NEEDS_E and ident not in delivered and bucket not in ("forward", "e_cache"):
                    res.wrong_skips += 1  # consumed without an embedding in hand
                if P.enc.acquire(ident, n):
                    acquired.append(ident)
            res.buckets[bucket] += 1
        res.occurrences += len(demand.decisions)
        blocks = P.prefix.admit(hashes, hit, held) or []
        dur = delay + self.cost.prefill_fixed_ms + self.cost.prefill_ms_per_token * (req.num_tokens - c)
        self._at(self.now + dur, self._p_done, p, req, blocks, acquired, needs_encoding)

    def _p_done(self, p: int, req: SimRequest, blocks, acquired, needs_encoding: bool) -> None:
        P = self.ps[p]
        P.prefix.release(blocks)
        for ident in acquired:
            P.enc.release(ident)
        ttft = self.now - req.arrival_ms
        r = self.res
        r.requests += 1
        r.ttft_ms.append(ttft)
        (r.ttft_encode_ms if needs_encoding else r.ttft_reuse_ms).append(ttft)
        if self.progress is not None:
            self.progress.update(1)
        if P.queue:
            self._at(self.now, self._p_start, p)
        else:
            P.busy = False


def _registry():
    from prometheus_client import CollectorRegistry

    return CollectorRegistry()
