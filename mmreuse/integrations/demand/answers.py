"""Demand answers: a query frame in, an answer frame out, from P's state between two scheduler
calls; and the proofs of the answers, checked when their requests are admitted.

What an answer reads, without side effects: the prefix-cache hit of vLLM's own lookup
(`coordinator.find_longest_cache_hit`: no allocation, no LRU touch, no stats), the encoder cache
(`cached`, `freeable`), the EC connector's `has_cache_item`; `compute_demand` turns them into
the demand. The hashes are the request's, from a `Request` built as vLLM builds it, outside the
demand lock (the work that grows with the query); the answer itself is computed holding it.
Every answer carries the hit's `CoverageProof`; when a request sent with
`vllm_xargs.mmreuse_demand_id` is admitted, the proof is validated and a change since the answer
is counted by cause.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import cachetools

from ...demand_query import (
    DemandAnswer,
    DemandError,
    DemandQuery,
    DemandStats,
    ECSnapshotQuery,
    MalformedQuery,
    RecordsQuery,
    SnapshotQuery,
    StatsQuery,
    answer_for,
    decode_query,
    encode,
    max_query_bytes,
    occurrences_of,
)
from ..control import id_of
from .engine_state import (
    ec_snapshots,
    encoder_cached,
    encoder_trust,
    engine_sizes,
    kv_trust,
    plan_at,
    prefix_hit,
)
from .index_feed import IndexFeed
from .records import demand_id_of

if TYPE_CHECKING:
    from .records import AdmissionLog
    from .snapshots import KVSnapshots

# under vLLM's "vllm" logger: its handler and format, so these lines appear in vLLM's log
logger = logging.getLogger(f"vllm.{__name__}")

__all__ = ["REMEMBERED_ANSWERS", "Answers"]

REMEMBERED_ANSWERS = 4096  # answers whose proofs wait for their request (LRU beyond)
NO_EC_EVENTS = (
    "snapshot: P's encoder cache publishes no events (EventfulEncoderCacheManager with an "
    "encoder_cache_events_endpoint)"
)


@dataclass(slots=True)
class _Remembered:
    """An answered query, waiting for its request's admission."""

    proof: Any
    proof_keys: list[int]  # the event ids the proof's blocks held
    num_computed_tokens: int
    reused: tuple[str, ...]  # encoder-cache entries the answer relied on
    last_check: tuple[bool, str | None, int] | None = None  # (valid, cause, C at lookup)


@dataclass(slots=True)
class Counters:
    """What `StatsQuery` reports of the answers and their proofs."""

    answers: int = 0
    errors: int = 0
    admitted: int = 0
    proof_valid: int = 0
    hit_differs: int = 0
    valid_hit_shorter: int = 0
    forgotten: int = 0
    index_disagrees: int = 0
    changed: dict[str, int] = field(default_factory=dict)


class Answers:
    """P's answers. `engine`: vLLM's scheduler (read, never changed); `lock`: the demand lock;
    `hasher`: the block hasher of a query's `Request` (None without prefix caching)."""

    def __init__(
        self,
        engine: Any,
        lock: threading.RLock,
        feed: IndexFeed,
        records: AdmissionLog,
        kv_snapshots: KVSnapshots,
        hasher: Callable[[Any], list[Any]] | None,
    ) -> None:
        self._engine = engine
        self._lock = lock
        self._feed = feed
        self._records = records
        self._kv_snapshots = kv_snapshots
        self._hasher = hasher
        self.counters = Counters()
        self._remembered: cachetools.LRUCache[str, _Remembered] = cachetools.LRUCache(
            REMEMBERED_ANSWERS
        )
        self._pending: dict[str, _Remembered] = {}  # engine request id -> its answer
        self._lora_by_name: cachetools.LRUCache[str, Any] = cachetools.LRUCache(256)
        # a larger frame is no well-formed query for this P: refused unread (and by the ROUTER)
        self.max_query_bytes = max_query_bytes(engine.max_model_len)

    # ---- the answer thread --------------------------------------------------------------------

    def handle(self, payload: bytes) -> bytes:
        """One query frame -> one answer frame. Never raises."""
        query: Any = None  # the decoded query, once it is one
        try:
            # refused before it is decoded: decoding costs the answer thread per byte
            if isinstance(payload, bytes | bytearray) and len(payload) > self.max_query_bytes:
                raise MalformedQuery(
                    f"payload has {len(payload)} bytes, more than {self.max_query_bytes} (the "
                    "largest well-formed query for this P's max_model_len)"
                )
            query = decode_query(payload)
            if isinstance(query, StatsQuery):
                with self._lock:
                    return encode(self.stats(query))
            if isinstance(query, RecordsQuery):
                with self._lock:
                    return encode(self._records.since(query))
            if isinstance(query, SnapshotQuery):
                return encode(self._kv_snapshots.answer(query))
            if isinstance(query, ECSnapshotQuery):
                return encode(self._ec_snapshot(query))
            assert isinstance(query, DemandQuery)
            occs, request = self.request_for(query)
            t0 = time.perf_counter()
            with self._lock:
                t1 = time.perf_counter()
                answer = self.answer(query, occs, request)
                t2 = time.perf_counter()
        except MalformedQuery as e:
            self.counters.errors += 1
            return encode(DemandError(id_of(payload) if query is None else query.id, str(e)))
        except Exception as e:  # a bug here costs this answer, never P's engine
            logger.exception("mmreuse: demand query not answered")
            self.counters.errors += 1
            ident = id_of(payload) if query is None else query.id
            return encode(DemandError(ident, f"{type(e).__name__}: {e}"))
        answer.lock_wait_us = (t1 - t0) * 1e6
        answer.answer_us = (t2 - t1) * 1e6
        self.counters.answers += 1
        return encode(answer)

    def _ec_snapshot(self, query: ECSnapshotQuery) -> Any:
        """P's encoder-cache snapshot, where its manager publishes events (the manager's own
        snapshots). Taken (offset 0) holding the engine lock, which every one of vLLM's calls
        into the manager holds too: it sees the cache between two scheduler calls (a later
        chunk is the held copy's)."""
        snapshots = ec_snapshots(self._engine)
        if snapshots is None:
            return DemandError(query.id, NO_EC_EVENTS)
        if query.offset:
            return snapshots.answer(query)
        with self._lock:
            return snapshots.answer(query)

    def request_for(self, query: DemandQuery) -> tuple[list[Any], Any]:
        """The query's occurrences, and the query as the `Request` vLLM would build for it (its
        block hashes included). Called without the lock (it takes it for the adapter only)."""
        import torch
        from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        max_len = self._engine.max_model_len
        if len(query.token_ids) > max_len:
            raise MalformedQuery(
                f"token_ids has {len(query.token_ids)} tokens, more than P's max_model_len "
                f"{max_len}"
            )
        lora = None
        if query.lora_name is not None:
            with self._lock:  # add_request updates the adapters
                lora = self._lora_by_name.get(query.lora_name)
            if lora is None:
                raise MalformedQuery(
                    f"lora_name {query.lora_name!r} is not an adapter P has served (its hashes "
                    "need the adapter's path)"
                )
        features = []
        occs = occurrences_of(query)
        for occ in occs:
            mask = None if occ.is_embed is None else torch.tensor(occ.is_embed, dtype=torch.bool)
            features.append(
                MultiModalFeatureSpec(
                    data=None,
                    modality=occ.modality,
                    identifier=occ.identifier,
                    mm_position=PlaceholderRange(occ.offset, occ.length, is_embed=mask),
                )
            )
        try:
            request = Request(
                request_id=f"mmreuse-demand-{query.id}",
                prompt_token_ids=list(query.token_ids),
                sampling_params=SamplingParams(max_tokens=1),
                pooling_params=None,
                mm_features=features or None,
                lora_request=lora,
                cache_salt=query.cache_salt,
                block_hasher=self._hasher,
            )
        except OverflowError as e:  # vLLM 0.34 on: token ids in an int32 buffer
            raise MalformedQuery(
                f"token_ids holds an id this vLLM's Request cannot hold ({e}); no request P "
                "serves has one"
            ) from None
        return occs, request

    def answer(self, query: DemandQuery, occs: list[Any], request: Any) -> DemandAnswer:
        """The answer, from P's state now (called holding the lock): `occs` are the request's
        occurrences (occurrences_of(query): the same as its features, without re-reading them)."""
        engine = self._engine
        hit_tokens, hit_blocks = 0, list[Any]()
        if self._hasher is not None:
            hit_tokens, hit_blocks = prefix_hit(engine, request)
        demand = plan_at(engine, occs, request.num_tokens, hit_tokens, query.e_cached)
        proof, keys = None, []
        index = self._feed.sync()
        if index is not None:
            nblocks = hit_tokens // engine.block_size
            found_blocks, proof = index.lookup_prefix(request.block_hashes[:nblocks])
            if found_blocks != nblocks:
                self.counters.index_disagrees += 1
            _, hash_in = index.maps()
            keys = [hash_in[b] for b in proof.block_ids.tolist()]
        reused = demand.p_local_reuse
        if query.remember:
            self._remembered[query.id] = _Remembered(proof, keys, hit_tokens, reused)
        return answer_for(
            query.id,
            hit_tokens,
            demand,
            proof_blocks=[] if proof is None else proof.block_ids.tolist(),
            proof_generations=[] if proof is None else proof.generations.tolist(),
            trust_kv_blocks=kv_trust(engine, hit_blocks),
            trust_encoder_embeds=encoder_trust(engine, reused),
            external_kv="none" if engine.connector is None else "not_consulted",
            step=int(getattr(engine, "current_step", 0)),
        )

    def stats(self, query: StatsQuery) -> DemandStats:
        """P's counters (called holding the lock)."""
        c, engine = self.counters, self._engine
        index = self._feed.sync()
        kv_blocks, block_size, ec_embeds = engine_sizes(engine)
        return DemandStats(
            id=query.id,
            answers=c.answers,
            errors=c.errors,
            admitted=c.admitted,
            proof_valid=c.proof_valid,
            changed=dict(c.changed),
            hit_differs=c.hit_differs,
            valid_hit_shorter=c.valid_hit_shorter,
            index_blocks=0 if index is None else sum(1 for k in index.maps()[1] if k is not None),
            index_mismatches=(
                self._feed.mismatches(engine.kv_cache_manager.block_pool)
                if query.check_index
                else None
            ),
            index_device=self._feed.note,
            forgotten=c.forgotten,
            kv_blocks=kv_blocks,
            block_size=block_size,
            encoder_cache_embeds=ec_embeds,
        )

    # ---- the engine thread: proofs at admission (holding the lock) ----------------------------

    def note_request(self, request: Any) -> None:
        """A request added: its adapter kept (for later queries' hashes), and the answer it
        follows (`vllm_xargs.mmreuse_demand_id`) waiting for its admission."""
        lora = getattr(request, "lora_request", None)
        if lora is not None:
            self._lora_by_name[lora.lora_name] = lora
        demand_id = demand_id_of(request)
        if demand_id is not None:
            entry = self._remembered.pop(demand_id, None)
            if entry is None:
                self.counters.forgotten += 1
            else:
                self._pending[request.request_id] = entry

    def check_at_lookup(self, request: Any, lookup: Callable[[], Any]) -> Any:
        """vLLM's prefix-cache lookup for `request` (`lookup`), with the state its answer saw
        checked just before it: what the lookup returns."""
        entry = self._pending.get(request.request_id)
        valid, cause = (True, None) if entry is None else self._check(entry)
        result = lookup()
        if entry is not None:
            entry.last_check = (valid, cause, int(result[1]))
        return result

    def _check(self, entry: _Remembered) -> tuple[bool, str | None]:
        """Whether the answer's state still holds; if not, the first cause found."""
        index = self._feed.sync()
        if index is not None and entry.proof is not None and not index.validate(entry.proof):
            _, hash_in = index.maps()
            for block_id, key in zip(entry.proof.block_ids.tolist(), entry.proof_keys, strict=True):
                now = hash_in[block_id]
                if now != key:
                    return False, "eviction" if now is None else "block_reuse"
            return False, "eviction"  # the same content again, after an eviction
        cached = encoder_cached(self._engine)
        for ident in entry.reused:
            if ident not in cached:
                return False, "encoder_eviction"
        return True, None

    def count_admissions(self, output: Any, checked: dict[str, bool] | None) -> None:
        """The answered requests `output` admits, counted by whether their proofs held (and
        noted in `checked`, for their admission records, where P records)."""
        if not self._pending:
            return
        c = self.counters
        for new in getattr(output, "scheduled_new_reqs", ()):
            entry = self._pending.pop(new.req_id, None)
            if entry is None or entry.last_check is None:
                continue
            valid, cause, hit = entry.last_check
            if checked is not None:
                checked[new.req_id] = valid
            c.admitted += 1
            if valid:
                c.proof_valid += 1
            else:
                c.changed[cause or "unknown"] = c.changed.get(cause or "unknown", 0) + 1
            if hit != entry.num_computed_tokens:
                c.hit_differs += 1
                c.valid_hit_shorter += valid and hit < entry.num_computed_tokens

    def forget(self, request_id: str) -> None:
        """A finished request: its answer no longer waits."""
        self._pending.pop(request_id, None)
