"""`DemandScheduler`: vLLM's scheduler, unchanged in behaviour, that also answers demand queries
(`mmreuse.demand_query`) from P's true state, and keeps P's residency index.

Switched on in a P/PD with `--scheduler-cls mmreuse.integrations.vllm.DemandScheduler` and its
endpoint through `--additional-config '{"mmreuse": {"demand_endpoint": "tcp://*:PORT"}}'`
(without an endpoint it answers nothing but still keeps its index and counters). Imports vLLM:
load it only inside vLLM.

How answers stay consistent and prompt. vLLM's engine core runs the scheduler on one thread and
blocks when idle. An answer thread owns the ROUTER socket; every scheduler method that changes
state (`schedule`, `update_from_output`, `add_request`, `finish_requests`, the resets) runs
holding one lock, and an answer is computed holding it too. So an answer sees P between two
scheduler calls, never in the middle of one (no torn reads); when P is idle the lock is free
and the answer is immediate; when P is busy it waits at most for the scheduler call in
progress (the model's forward pass runs outside the lock, and releases the GIL). What grows with
the query (decoding it, building its `Request` and block hashes) is done before taking the lock,
and the wire bounds a query by P's max_model_len (`demand_query.max_query_bytes`), so a hostile
client costs the answer thread bounded work and the engine one short wait per scheduler call.

What an answer reads, without side effects: the prefix-cache hit of vLLM's own lookup
(`coordinator.find_longest_cache_hit`: no allocation, no LRU touch, no stats), the encoder
cache (`cached`, `freeable`), the EC connector's `has_cache_item`; `compute_demand` turns them
into the demand. The hashes are the request's, from a `Request` built as vLLM builds it.

P's residency. A `BlockIndex` (on the KV cache's device) is fed by P's block pool itself: the
pool's two choke points for prefix-cache entries (`_insert_block_hash`,
`_remove_cached_block_hashes`) and `reset_prefix_cache`, which are exactly where vLLM emits its
`BlockStored` / `BlockRemoved` / `AllBlocksCleared`. Every answer carries the hit's
`CoverageProof`; when a request sent with `vllm_xargs.mmreuse_demand_id` is admitted, the proof
is validated and a change since the answer is counted by cause.

Snapshots. A `SnapshotQuery` gets P's prefix cache as a KV-event view holds it, stamped with the
KV-event batch it is consistent with, so that a proxy that joined late is complete again
(`demand_query.KVSnapshot`). vLLM's publisher numbers batches in the order `publish` is called,
and the scheduler calls it from `update_from_output`, holding the lock: counting the calls gives
the stamp. The block counts come from the residency index; the block pool's events not yet
published (queued by `schedule` for the next batch) are undone on the copy, so the snapshot is
P as of the last batch published. With `"snapshot_identifiers": true` the snapshot also carries
the mm identifiers its blocks carry: the block pool keeps no extra keys per block, so P follows
them from the batches it publishes (`events.snapshot.PublishedIdentifiers`, fed right after
each publish, under the lock: as of the same stamp), bounded by its block count. Opt-in: under
the engine's lock it costs about 15 ns per block of a text-only store, but about 1 us per block
stored that carries an identifier and 0.4 us per block removed while any is held (on a slow
2-core machine: benchmarks/test_bench_events.py), and about 100 bytes per such block held, for
proxies that ask for identifiers.
"""

from __future__ import annotations

import collections
import logging
import os
import secrets
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import cachetools
import msgspec
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from ..demand_query import (
    MAX_ID_CHARS,
    MAX_SNAPSHOT_BLOCKS,
    MAX_SNAPSHOT_ENTRIES,
    AdmissionRecord,
    AdmissionRecords,
    DemandAnswer,
    DemandError,
    DemandQuery,
    DemandStats,
    ECEntry,
    ECSnapshot,
    ECSnapshotQuery,
    KVSnapshot,
    MalformedQuery,
    RecordItem,
    RecordsQuery,
    SnapshotQuery,
    StatsQuery,
    answer_for,
    decode_query,
    encode,
    max_query_bytes,
    occurrences_of,
    record_items,
)
from ..events.snapshot import PublishedIdentifiers, identifier_chunk
from ..plan import GivenCoverage, plan_admission
from ..residency import BlockIndex
from .plugin_config import DEMAND_ID_KEY, read_config, read_flag
from .vllm import availability_from_engine, encoder_cache_space, occurrences_from_request

# under vLLM's "vllm" logger: its handler and format, so these lines appear in vLLM's log
logger = logging.getLogger(f"vllm.{__name__}")

REMEMBERED_ANSWERS = 4096  # answers whose proofs wait for their request (LRU beyond)
SNAPSHOTS_KEPT = 2  # snapshots held for their later chunks (a new id beyond: the oldest goes)
# Taking a KV snapshot holds the lock the engine waits on (~0.14 s for 1M blocks): at most one
# per interval while P changes (replicas starting together share one while it does not).
SNAPSHOT_MIN_INTERVAL_S = 1.0
MAX_RECORDS = 65536  # admission records kept (a ring: RecordsQuery says how many were lost)
SYNC_INDEX_AFTER = 512  # pending block-pool changes that make a step apply them (bounded memory)
MAX_FREE_QUEUE_WALK = 2048  # trust_kv_blocks is counted up to this: that value means "at least"

# Scheduler methods that change state: each runs holding the demand lock. The one list of
# them: at start-up `_check_vllm` refuses a vLLM whose scheduler has a public method neither
# here nor in `vllm_versions.UNLOCKED`, or differs from the one verified (`VERIFIED`).
_LOCKED = (
    "schedule",
    "update_from_output",
    "add_request",
    "finish_requests",
    "update_draft_token_ids",
    "update_draft_token_ids_in_output",
    "reset_prefix_cache",
    "reset_encoder_cache",
    "reset_connector_cache",
    "set_pause_state",
)


# A snapshot as taken: (stamp, event ids, block counts, the ids' identifiers or None where P
# does not follow them).
_Taken = tuple[int, list[int], list[int], dict[int, tuple[str, ...]] | None]


@dataclass(slots=True)
class _Remembered:
    """An answered query, waiting for its request's admission."""

    proof: Any
    proof_keys: list[int]  # the event ids the proof's blocks held
    num_computed_tokens: int
    reused: tuple[str, ...]  # encoder-cache entries the answer relied on
    last_check: tuple[bool, str | None, int] | None = None  # (valid, cause, C at lookup)


@dataclass(slots=True)
class _Counters:
    answers: int = 0
    errors: int = 0
    admitted: int = 0
    proof_valid: int = 0
    hit_differs: int = 0
    valid_hit_shorter: int = 0
    forgotten: int = 0
    index_disagrees: int = 0
    changed: dict[str, int] = field(default_factory=dict)


class DemandScheduler(Scheduler):
    """vLLM's scheduler answering demand queries (see the module docstring). Under async
    scheduling it is vLLM's AsyncScheduler with the same additions."""

    def __new__(cls, vllm_config: Any = None, *args: Any, **kwargs: Any) -> DemandScheduler:
        if cls is DemandScheduler and getattr(
            getattr(vllm_config, "scheduler_config", None), "async_scheduling", False
        ):
            cls = AsyncDemandScheduler
        return super().__new__(cls)

    def __init__(self, vllm_config: Any, *args: Any, **kwargs: Any) -> None:
        _check_vllm(type(self), vllm_config)  # refuses a vLLM it was not verified with
        super().__init__(vllm_config, *args, **kwargs)
        self._demand_lock = threading.RLock()
        self._counters = _Counters()
        self._remembered: cachetools.LRUCache[str, _Remembered] = cachetools.LRUCache(
            REMEMBERED_ANSWERS
        )
        self._pending: dict[str, _Remembered] = {}  # engine request id -> its answer
        self._lora_by_name: cachetools.LRUCache[str, Any] = cachetools.LRUCache(256)
        self._query_hasher = self._make_query_hasher(vllm_config)
        # admission records (`"admission_records": true`): what P did with every request
        self._recording = bool(read_config(vllm_config).get("admission_records", False))
        self._records: collections.deque[AdmissionRecord] = collections.deque(maxlen=MAX_RECORDS)
        self._next_record = 0
        self._admitting: dict[str, list[RecordItem]] = {}  # the record's items, at the lookup
        self._prefilling: dict[str, AdmissionRecord] = {}  # admitted, prefill not done
        # the requests recorded, by id (the Request itself, held weakly: gone with it). A
        # preempted request that resumes is not recorded again: vLLM 0.34 (and 0.33 on Model
        # Runner V2) lists it among the new requests, 0.33 on V1 among the resumed ones
        self._recorded: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()
        self._checked: dict[str, bool] = {}  # admitted this step: its proof held
        # a larger frame is no well-formed query for this P: refused unread (and by the ROUTER)
        self._max_query_bytes = max_query_bytes(self.max_model_len)
        # the block pool's stores (hash, block) and removals (None, block), in order, applied to
        # the index in batches before it is read (one residency update per run of a kind)
        self._index_ops: list[tuple[bytes | None, int]] = []
        self._index, self._index_note = self._make_index()
        # KV-event batches published so far: the stamp of a snapshot (see the module doc)
        self._kv_published = 0
        self._incarnation = f"{os.getpid()}-{secrets.token_hex(8)}"
        self._snapshot_chunk = MAX_SNAPSHOT_BLOCKS  # block ids per KVSnapshot (tests: fewer)
        self._ec_snapshot_chunk = MAX_SNAPSHOT_ENTRIES  # entries per ECSnapshot
        self._last_snapshot: tuple[float, _Taken] | None = None
        self._ec_snapshots: cachetools.LRUCache[str, tuple[int, list[Any]]] = cachetools.LRUCache(
            SNAPSHOTS_KEPT
        )
        self._snapshots: cachetools.LRUCache[str, _Taken] = cachetools.LRUCache(SNAPSHOTS_KEPT)
        # the identifiers of P's blocks, for its snapshots ("snapshot_identifiers": opt-in)
        self._identifiers = self._make_identifiers(vllm_config)
        self._count_published()
        self._server: _DemandServer | None = None
        endpoint = read_config(vllm_config).get("demand_endpoint")
        if endpoint:
            self._server = _DemandServer(str(endpoint), self._handle, self._max_query_bytes)
            self._server.start()
            logger.info("mmreuse: demand answers on %s (index: %s)", endpoint, self._index_note)

    # ---- construction -------------------------------------------------------------------------

    def _count_published(self) -> None:
        """Count the KV-event batches handed to vLLM's publisher (it numbers them in this order:
        the n-th call's batch is seq n-1). Called from update_from_output, under the lock."""
        publisher = getattr(self, "kv_event_publisher", None)
        if publisher is None:
            return
        publish = publisher.publish
        identifiers = self._identifiers

        def counted(batch: Any) -> None:
            publish(batch)
            self._kv_published += 1
            if identifiers is not None:  # as of the same batch: what a snapshot's stamp says
                identifiers.follow(batch.events)

        publisher.publish = counted

    def _make_identifiers(self, vllm_config: Any) -> PublishedIdentifiers | None:
        """P's follower of its blocks' identifiers, where asked and a snapshot can be taken."""
        if not read_flag(vllm_config, "snapshot_identifiers"):
            return None
        pool = self.kv_cache_manager.block_pool
        if self._index is None or not getattr(pool, "enable_kv_cache_events", False):
            logger.warning(
                "mmreuse: snapshot_identifiers is set, but P takes no KV snapshots (index %s, "
                "KV events %s)",
                self._index_note,
                "on" if getattr(pool, "enable_kv_cache_events", False) else "off",
            )
            return None
        return PublishedIdentifiers(int(pool.num_gpu_blocks))

    def _make_query_hasher(self, vllm_config: Any) -> Callable[[Any], list[Any]] | None:
        cache = vllm_config.cache_config
        if not cache.enable_prefix_caching:
            return None
        from vllm.utils.hashing import get_hash_fn_by_name

        from .vllm_hasher import fast_request_block_hasher

        hash_block_size: Any = getattr(self, "hash_block_size", None) or self.block_size
        return fast_request_block_hasher(
            hash_block_size,
            get_hash_fn_by_name(cache.prefix_caching_hash_algo),
            getattr(vllm_config, "num_hash_lookahead_tokens", 0),
        )

    def _make_index(self) -> tuple[BlockIndex | None, str]:
        """P's residency index, on the KV cache's device, hooked into the block pool."""
        manager = self.kv_cache_manager
        pool = manager.block_pool
        if not getattr(manager, "enable_caching", False):
            return None, "off: prefix caching is disabled"
        if getattr(self, "hash_block_size", self.block_size) != self.block_size:
            return None, "off: hash blocks differ from KV blocks"
        groups = getattr(getattr(self, "kv_cache_config", None), "kv_cache_groups", None) or ()
        if len(groups) > 1:  # hybrid attention: a block can leave one group and stay in another
            return None, (
                f"off: {len(groups)} KV cache groups (hybrid attention); the index follows "
                "one group and would prove coverage another group has evicted"
            )
        device = "cpu"
        try:
            from vllm.platforms import current_platform

            if current_platform.device_type == "cuda":
                import torch

                if torch.cuda.is_available():
                    device = f"cuda:{torch.cuda.current_device()}"
        except Exception:  # the CPU index answers the same; say where it is
            logger.exception("mmreuse: residency index on the CPU")
        index = BlockIndex(pool.num_gpu_blocks, device)
        self._hook_pool(pool, index)
        return index, device

    def _hook_pool(self, pool: Any, index: BlockIndex) -> None:
        from vllm.v1.core.kv_cache_utils import get_block_hash, get_group_id

        insert, remove, reset = (
            pool._insert_block_hash,
            pool._remove_cached_block_hashes,
            pool.reset_prefix_cache,
        )

        ops = self._index_ops

        def _insert_block_hash(key: Any, block: Any, *args: Any, **kwargs: Any) -> None:
            primary = block.block_hash is None
            insert(key, block, *args, **kwargs)
            if primary and block.block_hash == key and get_group_id(key) == 0:
                ops.append((get_block_hash(key), block.block_id))

        def _remove_cached_block_hashes(block: Any) -> Any:
            removed = remove(block)
            if removed:
                ops.append((None, block.block_id))
            return removed

        def reset_prefix_cache(*args: Any, **kwargs: Any) -> bool:
            ok = reset(*args, **kwargs)
            if ok:
                ops.clear()
                index.clear()
            return ok

        pool._insert_block_hash = _insert_block_hash
        pool._remove_cached_block_hashes = _remove_cached_block_hashes
        pool.reset_prefix_cache = reset_prefix_cache

    def _sync_index(self) -> BlockIndex | None:
        """The index, with the block pool's changes since the last read applied in order."""
        index, ops = self._index, self._index_ops
        if index is None or not ops:
            return index
        _, hash_in = index.maps()
        i = 0
        while i < len(ops):
            j, blocks, hashes = i, [], list[Any]()
            if ops[i][0] is None:  # a run of removals
                while j < len(ops) and ops[j][0] is None:
                    blocks.append(ops[j][1])
                    j += 1
                index.evict_blocks([b for b in dict.fromkeys(blocks) if hash_in[b] is not None])
            else:  # a run of stores, each block once per call
                seen: set[int] = set()
                while j < len(ops) and ops[j][0] is not None and ops[j][1] not in seen:
                    hashes.append(ops[j][0])
                    blocks.append(ops[j][1])
                    seen.add(ops[j][1])
                    j += 1
                index.store_many(hashes, blocks)
            i = j
        ops.clear()
        return index

    # ---- admission: check the answer's proof -------------------------------------------------

    def add_request(self, request: Any) -> None:
        with self._demand_lock:
            super().add_request(request)
            self._note_request(request)

    def _note_request(self, request: Any) -> None:
        lora = getattr(request, "lora_request", None)
        if lora is not None:
            self._lora_by_name[lora.lora_name] = lora
        params = getattr(request, "sampling_params", None)
        extra = getattr(params, "extra_args", None) or {}
        demand_id = extra.get(DEMAND_ID_KEY) if isinstance(extra, dict) else None
        if isinstance(demand_id, str):
            entry = self._remembered.pop(demand_id, None)
            if entry is None:
                self._counters.forgotten += 1
            else:
                self._pending[request.request_id] = entry

    def _get_local_prefix_cache_hit(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        entry = self._pending.get(request.request_id)
        valid, cause = (True, None) if entry is None else self._check(entry)
        result = super()._get_local_prefix_cache_hit(request, *args, **kwargs)
        if entry is not None:
            entry.last_check = (valid, cause, int(result[1]))
        if self._recording:
            self._note_admission(request, int(result[1]))
        return result

    def _note_admission(self, request: Any, hit: int) -> None:
        """The classes of `request`'s items at this lookup (kept if it is admitted now). A
        request already recorded is resuming after a preemption: its record stays the one
        of its first admission (and, while that prefill is not done, gets the items encoded
        for it from now on too)."""
        rid = request.request_id
        held = self._recorded.get(rid)
        if held is not None and held is request:
            self._admitting.pop(rid, None)
            return
        try:
            c = min(hit, request.num_tokens - 1)
            occs = occurrences_from_request(request)
            demand = self._demand_at(occs, request.num_tokens, c)
        except Exception:  # a record is never worth a scheduling step
            logger.exception("mmreuse: admission of %s not recorded", request.request_id)
            return
        self._admitting[request.request_id] = record_items(demand)

    def _record_admissions(self, output: Any) -> None:
        for new in getattr(output, "scheduled_new_reqs", ()):
            noted = self._admitting.pop(new.req_id, None)
            request = self.requests.get(new.req_id)
            if noted is None or request is None:
                continue
            entry = self._checked.pop(new.req_id, None)
            extra = getattr(request.sampling_params, "extra_args", None) or {}
            demand_id = extra.get(DEMAND_ID_KEY) if isinstance(extra, dict) else None
            rec = AdmissionRecord(
                seq=self._next_record,
                request_id=new.req_id,
                num_prompt_tokens=request.num_prompt_tokens,
                num_computed_tokens=int(new.num_computed_tokens),
                items=noted,
                demand_id=demand_id if isinstance(demand_id, str) else None,
                proof_valid=entry,
            )
            self._next_record += 1
            self._records.append(rec)
            self._prefilling[new.req_id] = rec
            self._recorded[new.req_id] = request
        for req_id, inputs in getattr(output, "scheduled_encoder_inputs", {}).items():
            open_rec = self._prefilling.get(req_id)
            if open_rec is not None:
                open_rec.encoded = sorted(set(open_rec.encoded) | set(inputs))
        for req_id in list(self._prefilling):
            request = self.requests.get(req_id)
            if request is None or request.num_computed_tokens >= request.num_prompt_tokens:
                del self._prefilling[req_id]

    def _check(self, entry: _Remembered) -> tuple[bool, str | None]:
        """Whether the answer's state still holds; if not, the first cause found."""
        index = self._sync_index()
        if index is not None and entry.proof is not None and not index.validate(entry.proof):
            _, hash_in = index.maps()
            for block_id, key in zip(entry.proof.block_ids.tolist(), entry.proof_keys, strict=True):
                now = hash_in[block_id]
                if now != key:
                    return False, "eviction" if now is None else "block_reuse"
            return False, "eviction"  # the same content again, after an eviction
        cached = getattr(self.encoder_cache_manager, "cached", {})
        for ident in entry.reused:
            if ident not in cached:
                return False, "encoder_eviction"
        return True, None

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        with self._demand_lock:
            output = super().schedule(*args, **kwargs)
            if self._pending:
                self._count_admissions(output)
            if self._recording:
                self._record_admissions(output)
            if len(self._index_ops) > SYNC_INDEX_AFTER:
                self._sync_index()
            return output

    def _count_admissions(self, output: Any) -> None:
        c = self._counters
        for new in getattr(output, "scheduled_new_reqs", ()):
            entry = self._pending.pop(new.req_id, None)
            if entry is None or entry.last_check is None:
                continue
            valid, cause, hit = entry.last_check
            if self._recording:
                self._checked[new.req_id] = valid
            c.admitted += 1
            if valid:
                c.proof_valid += 1
            else:
                c.changed[cause or "unknown"] = c.changed.get(cause or "unknown", 0) + 1
            if hit != entry.num_computed_tokens:
                c.hit_differs += 1
                c.valid_hit_shorter += valid and hit < entry.num_computed_tokens

    def finish_requests(self, request_ids: Any, *args: Any, **kwargs: Any) -> Any:
        with self._demand_lock:
            out = super().finish_requests(request_ids, *args, **kwargs)
            ids = [request_ids] if isinstance(request_ids, str) else list(request_ids or ())
            for rid in ids:
                self._pending.pop(rid, None)
                self._admitting.pop(rid, None)
                self._prefilling.pop(rid, None)
            return out

    def shutdown(self) -> None:
        if self._server is not None:
            self._server.stop()
        super().shutdown()

    # ---- answers (the answer thread) -----------------------------------------------------------

    def _handle(self, payload: bytes) -> bytes:
        """One query frame -> one answer frame. Never raises."""
        query: Any = None  # the decoded query, once it is one
        try:
            # refused before it is decoded: decoding costs the answer thread per byte
            if isinstance(payload, bytes | bytearray) and len(payload) > self._max_query_bytes:
                raise MalformedQuery(
                    f"payload has {len(payload)} bytes, more than {self._max_query_bytes} (the "
                    "largest well-formed query for this P's max_model_len)"
                )
            query = decode_query(payload)
            if isinstance(query, StatsQuery):
                with self._demand_lock:
                    return encode(self._stats(query))
            if isinstance(query, RecordsQuery):
                with self._demand_lock:
                    return encode(self._records_since(query))
            if isinstance(query, SnapshotQuery):
                return encode(self._snapshot(query))
            if isinstance(query, ECSnapshotQuery):
                return encode(self._ec_snapshot(query))
            # the Request and its block hashes (the work that grows with the query) are built
            # outside the lock: they depend on the query alone, and the engine waits on the lock
            assert isinstance(query, DemandQuery)
            occs, request = self._request_for(query)
            t0 = time.perf_counter()
            with self._demand_lock:
                t1 = time.perf_counter()
                answer = self._answer(query, occs, request)
                t2 = time.perf_counter()
        except MalformedQuery as e:
            self._counters.errors += 1
            return encode(DemandError(_id_of(payload) if query is None else query.id, str(e)))
        except Exception as e:  # a bug here costs this answer, never P's engine
            logger.exception("mmreuse: demand query not answered")
            self._counters.errors += 1
            ident = _id_of(payload) if query is None else query.id
            return encode(DemandError(ident, f"{type(e).__name__}: {e}"))
        answer.lock_wait_us = (t1 - t0) * 1e6
        answer.answer_us = (t2 - t1) * 1e6
        self._counters.answers += 1
        return encode(answer)

    def _request_for(self, query: DemandQuery) -> tuple[list[Any], Any]:
        """The query's occurrences, and the query as the `Request` vLLM would build for it (its
        block hashes included). Called without the lock (it takes it for the adapter only)."""
        import torch
        from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        max_len = self.max_model_len
        if len(query.token_ids) > max_len:
            raise MalformedQuery(
                f"token_ids has {len(query.token_ids)} tokens, more than P's max_model_len "
                f"{max_len}"
            )
        lora = None
        if query.lora_name is not None:
            with self._demand_lock:  # add_request updates the adapters
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
                block_hasher=self._query_hasher,
            )
        except OverflowError as e:  # vLLM 0.34 on: token ids in an int32 buffer
            raise MalformedQuery(
                f"token_ids holds an id this vLLM's Request cannot hold ({e}); no request P "
                "serves has one"
            ) from None
        return occs, request

    def _demand_at(self, occs: list[Any], n: int, c: int, e_cached: Any = ()) -> Any:
        """P's plan at C = `c` (`plan_admission` with C given) over its encoder cache, its EC
        connector and `e_cached`, with rule S (its encoder-cache space): the `DemandResult`."""
        ecm = self.encoder_cache_manager
        avail = availability_from_engine(
            ecm, self.ec_connector, {m.identifier for m in occs}, e_cached=e_cached
        )
        return plan_admission(
            num_prompt_tokens=n,
            occurrences=occs,
            availability=avail,
            coverage=GivenCoverage(c),
            is_encoder_decoder=bool(getattr(self, "is_encoder_decoder", False)),
            encoder_cache=encoder_cache_space(ecm),
        ).demand

    def _answer(self, query: DemandQuery, occs: list[Any], request: Any) -> DemandAnswer:
        """The answer, from P's state now (called holding the lock): `occs` are the request's
        occurrences (occurrences_of(query): the same as its features, without re-reading them)."""
        manager = self.kv_cache_manager
        hit_tokens, hit_blocks = 0, list[Any]()
        if self._query_hasher is not None and manager.prefix_cache_lookup_enabled(request):
            # the longest hit vLLM's lookup allows: its own bound where it has one (0.34 on:
            # the request's prefix_cache_hit_limit too), else all tokens but the last
            bound = getattr(request, "get_max_cache_hit_length", None)
            found = manager.coordinator.find_longest_cache_hit(
                request.block_hashes, bound() if callable(bound) else request.num_tokens - 1
            )
            hit_tokens, hit_blocks = int(found[1]), found[0][0] if found[0] else []
        demand = self._demand_at(occs, request.num_tokens, hit_tokens, query.e_cached)
        proof, keys = None, []
        index = self._sync_index()
        if index is not None:
            nblocks = hit_tokens // self.block_size
            found_blocks, proof = index.lookup_prefix(request.block_hashes[:nblocks])
            if found_blocks != nblocks:
                self._counters.index_disagrees += 1
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
            trust_kv_blocks=self._trust_kv(hit_blocks),
            trust_encoder_embeds=self._trust_encoder(reused),
            external_kv="none" if self.connector is None else "not_consulted",
            step=int(getattr(self, "current_step", 0)),
        )

    def _trust_kv(self, hit_blocks: list[Any]) -> int | None:
        """New blocks P can allocate before a hit block may be evicted: its place in vLLM's
        free queue (evicted from the head); None when no hit block is in the queue."""
        free = {b.block_id for b in hit_blocks if b.ref_cnt == 0 and not b.is_null}
        if not free:
            return None
        queue = self.kv_cache_manager.block_pool.free_block_queue
        node = queue.fake_free_list_head.next_free_block
        n = 0
        while node is not None and node is not queue.fake_free_list_tail:
            if node.block_id in free or n >= MAX_FREE_QUEUE_WALK:
                return n
            n += 1
            node = node.next_free_block
        return n

    def _trust_encoder(self, reused: tuple[str, ...]) -> int | None:
        """Encoder-cache space P can allocate before a reused freeable entry may be evicted."""
        ecm = self.encoder_cache_manager
        freeable = getattr(ecm, "freeable", None)
        if not freeable or not any(i in freeable for i in reused):
            return None
        room = int(getattr(ecm, "num_free_slots", 0))
        for ident, n in freeable.items():  # oldest first: vLLM evicts in this order
            if ident in reused:
                return room
            room += int(n)
        return room

    def _stats(self, query: StatsQuery) -> DemandStats:
        c = self._counters
        index = self._sync_index()
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
            index_mismatches=self._index_mismatches() if query.check_index else None,
            index_device=self._index_note,
            forgotten=c.forgotten,
            kv_blocks=int(self.kv_cache_manager.block_pool.num_gpu_blocks),
            block_size=int(self.block_size),
            encoder_cache_embeds=int(getattr(self.encoder_cache_manager, "cache_size", 0)),
        )

    def _snapshot(self, query: SnapshotQuery) -> KVSnapshot | DemandError:
        """Chunk `offset` of snapshot `id` (taken at offset 0, under the lock)."""
        if query.offset == 0:
            with self._demand_lock:
                last = self._last_snapshot
                now = time.monotonic()
                pending = self.kv_cache_manager.block_pool.kv_event_queue
                if last is not None and last[1][0] == self._kv_published and not pending:
                    taken: Any = last[1]  # nothing changed since: the same copy serves
                elif last is not None and now - last[0] < SNAPSHOT_MIN_INTERVAL_S:
                    return DemandError(
                        query.id,
                        f"snapshot: one per {SNAPSHOT_MIN_INTERVAL_S} s while P changes; ask again",
                    )
                else:
                    taken = self._take_snapshot()
                    if not isinstance(taken, str):
                        self._last_snapshot = (now, taken)
            if isinstance(taken, str):
                return DemandError(query.id, f"snapshot: {taken}")
            self._snapshots[query.id] = taken
        held = self._snapshots.get(query.id)
        if held is None:
            return DemandError(query.id, "snapshot: no longer held (ask again from offset 0)")
        stamp, ids, counts, carried = held
        if query.offset > len(ids):
            return DemandError(query.id, f"snapshot: offset {query.offset} > total {len(ids)}")
        end = query.offset + self._snapshot_chunk
        table: list[str] = []
        pairs: list[tuple[int, list[int]]] = []
        if carried is not None:  # a chunk ends early where its identifiers reach their bounds
            end, table, pairs = identifier_chunk(ids, carried, query.offset, self._snapshot_chunk)
        return KVSnapshot(
            id=query.id,
            stamp=stamp,
            incarnation=self._incarnation,
            total=len(ids),
            offset=query.offset,
            blocks=int(self.kv_cache_manager.block_pool.num_gpu_blocks),
            block_ids=ids[query.offset : end],
            counts=counts[query.offset : end],
            identifiers_followed=carried is not None,
            identifiers=table,
            carried=pairs,
        )

    def _ec_snapshot(self, query: ECSnapshotQuery) -> ECSnapshot | DemandError:
        """Chunk `offset` of encoder-cache snapshot `id` (taken at offset 0, under the lock)."""
        if query.offset == 0:
            ecm = self.encoder_cache_manager
            if not callable(getattr(ecm, "snapshot", None)) or ecm.publisher is None:
                return DemandError(
                    query.id,
                    "snapshot: P's encoder cache publishes no events (EventfulEncoderCacheManager "
                    "with an encoder_cache_events_endpoint)",
                )
            with self._demand_lock:
                self._ec_snapshots[query.id] = ecm.snapshot()
        held = self._ec_snapshots.get(query.id)
        if held is None:
            return DemandError(query.id, "snapshot: no longer held (ask again from offset 0)")
        stamp, entries = held
        if query.offset > len(entries):
            return DemandError(query.id, f"snapshot: offset {query.offset} > total {len(entries)}")
        part = entries[query.offset : query.offset + self._ec_snapshot_chunk]
        return ECSnapshot(
            query.id, stamp, self._incarnation, len(entries), query.offset,
            [ECEntry(h, n, f) for h, n, f in part],
        )  # fmt: skip

    def _take_snapshot(self) -> _Taken | str:
        """(stamp, event ids, block counts, their identifiers) of the prefix cache as of the
        last KV-event batch published, or why there is none. Holding the lock."""
        from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

        from ..blockhash import to_event_id

        index = self._sync_index()
        if index is None:
            return f"the residency index is {self._index_note}"
        pool = self.kv_cache_manager.block_pool
        if not getattr(pool, "enable_kv_cache_events", False):
            return "P publishes no KV events (--kv-events-config enable_kv_cache_events)"
        connector = getattr(self, "connector", None)
        if connector is not None and type(connector).take_events is not _base_take_events():
            return (
                f"P's KV connector {type(connector).__name__} publishes events of its own "
                "(other media), which a snapshot of the prefix cache does not hold"
            )
        counts = index.counts()  # event id -> the blocks holding it
        # undo what the next batch will tell: the copy is P as of the last batch published
        for event in reversed(pool.kv_event_queue):
            if isinstance(event, AllBlocksCleared):
                return "a prefix-cache reset is being published; ask again"
            step = -1 if isinstance(event, BlockStored) else 1
            if not isinstance(event, BlockStored | BlockRemoved):
                return f"an unexpected pending event {type(event).__name__}"
            for h in event.block_hashes:
                ident = to_event_id(h)
                n = counts.get(ident, 0) + step
                if n < 0:
                    return "the pending events do not match the index (a bug); ask again"
                if n:
                    counts[ident] = n
                else:
                    counts.pop(ident, None)
        # the identifiers as of the same batch (followed from the batches published); None
        # where not followed or not known
        carried = None if self._identifiers is None else self._identifiers.carriers()
        return self._kv_published, list(counts), list(counts.values()), carried

    def _records_since(self, query: RecordsQuery) -> AdmissionRecords:
        held = self._records
        first = held[0].seq if held else self._next_record
        start = max(query.since, first)
        out = [r for r in held if r.seq >= start][: query.limit]
        nxt = out[-1].seq + 1 if out else max(start, min(query.since, self._next_record))
        dropped = max(0, first - query.since) if query.since < first else 0
        return AdmissionRecords(query.id, out, nxt, dropped, self._recording)

    def _index_mismatches(self) -> int:
        """Blocks where the index differs from vLLM's prefix cache (group 0, primary hashes):
        the hash a block holds, and whether vLLM's map finds that block under it."""
        from vllm.v1.core.kv_cache_utils import get_block_hash, get_group_id

        from ..blockhash import to_event_id

        index = self._sync_index()
        if index is None:
            return 0
        pool = self.kv_cache_manager.block_pool
        _, hash_in = index.maps()
        bad = 0
        for block in pool.blocks:
            key = block.block_hash
            want = None
            if (
                key is not None
                and get_group_id(key) == 0
                and pool.cached_block_hash_to_block.contain(key, block.block_id)
            ):
                want = to_event_id(get_block_hash(key))
            if hash_in[block.block_id] != want:
                bad += 1
        return bad


def _base_take_events() -> Any:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    return KVConnectorBase_V1.take_events


def _locked(name: str) -> Callable[..., Any]:
    def method(self: DemandScheduler, *args: Any, **kwargs: Any) -> Any:
        with self._demand_lock:
            return getattr(super(DemandScheduler, self), name)(*args, **kwargs)

    method.__name__ = name
    method.__doc__ = f"vLLM's `{name}`, holding the demand lock."
    return method


for _name in _LOCKED:
    if hasattr(Scheduler, _name) and _name not in DemandScheduler.__dict__:
        setattr(DemandScheduler, _name, _locked(_name))


def _check_vllm(cls: type, vllm_config: Any) -> None:
    """Before the scheduler serves: the running vLLM's scheduler is one this was verified with
    (its methods as recorded, each locked or known read-only), or InvalidArgument naming what
    differs; `allow_unverified_vllm` / MMREUSE_ALLOW_UNVERIFIED_VLLM=1 start anyway, warned."""
    from .vllm_versions import check_running_scheduler

    check_running_scheduler(cls, read_config(vllm_config), _LOCKED)


class AsyncDemandScheduler(DemandScheduler, AsyncScheduler):
    """`DemandScheduler` over vLLM's AsyncScheduler (picked by DemandScheduler itself)."""


class _Named(msgspec.Struct):
    """Any frame's `id`, to name it in a DemandError when the frame is not a query."""

    id: str = ""


# only the id: the other fields are skipped, not built (a generic decode of a hostile frame
# builds every object in it: seconds for a few MB of small maps)
_named = msgspec.msgpack.Decoder(_Named)


def _id_of(payload: bytes) -> str:
    """The query's id, if a malformed frame still names one (else "")."""
    try:
        ident = _named.decode(payload).id
    except Exception:
        return ""
    return ident if len(ident) <= MAX_ID_CHARS else ""


class _DemandServer:
    """The answer thread: a ZMQ ROUTER, one answer frame per query frame."""

    def __init__(
        self, endpoint: str, handler: Callable[[bytes], bytes], max_bytes: int | None = None
    ) -> None:
        import zmq

        self._zmq = zmq
        self._ctx: Any = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        if max_bytes is not None:  # libzmq drops a peer sending a larger frame, unread
            self._sock.setsockopt(zmq.MAXMSGSIZE, max_bytes)
        self._sock.bind(endpoint)  # a taken port fails P's start, loudly
        self._handler = handler
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mmreuse-demand", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)

    def _run(self) -> None:
        zmq = self._zmq
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                if not poller.poll(100):
                    continue
                frames = self._sock.recv_multipart()
                if len(frames) != 2:  # a DEALER sends [payload]; anything else is not ours
                    continue
                try:
                    answer = self._handler(frames[1])
                except Exception:  # a frame the handler fails on costs that frame only
                    logger.exception("mmreuse: demand frame not answered")
                    continue
                self._sock.send_multipart([frames[0], answer])
        except Exception:  # the socket itself failed
            logger.exception("mmreuse: demand answer thread stopped")
        finally:
            self._sock.close(0)


__all__ = ["AsyncDemandScheduler", "DemandScheduler"]
