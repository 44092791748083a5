"""`EventfulEncoderCacheManager`: vLLM's `EncoderCacheManager`, unchanged in behaviour, that
also publishes what changes in it (`mmreuse.events.ec_wire`) with vLLM's own ZMQ publisher.

Switched on in a P/PD with
`--ec-manager-config '{"encoder_cache_manager_cls": "mmreuse.integrations.vllm.EventfulEncoderCacheManager"}'`
and its endpoint through `--additional-config '{"mmreuse": {"encoder_cache_events_endpoint":
"tcp://*:PORT", "encoder_cache_events_replay_endpoint": "tcp://*:PORT2"}}'` (without an
endpoint it behaves as vLLM's and publishes nothing; the settings: `plugin_config`). Imports
vLLM: load it only inside vLLM.

Snapshots. `snapshot()` is the cache as its events describe it, stamped with the batch it is
true as of; `snapshots` (`integrations.snapshots.ECSnapshots`) serves it in chunks
(`ECSnapshotQuery`), through a `DemandScheduler`'s demand endpoint or, with
`"encoder_cache_snapshot_endpoint"`, on the manager's own ROUTER (E, which needs no scheduler
plug-in); both may be set (a cluster's E keeps admission records): the two answer threads share
the same held snapshots and rate limit. `snapshot()` first publishes what is pending and holds
the manager's lock: it sees the cache between two of the manager's calls, never in the middle
of one, and is true as of the last batch published (`stamp - 1`). Where the manager serves its
own endpoint, each of vLLM's calls into it holds that lock too (`create_manager` builds the
locked variant), and a snapshot may land inside a scheduler step (say between `can_allocate`'s
eviction and `allocate`): that step's events then come in two batches, each the truth as of
its seq, so the snapshot plus the batches from its stamp is the cache exactly, and a view
bootstrapped from it never holds what the cache removed (tools/oracle/ec_events_check.py takes
snapshots at such points). Otherwise only a `DemandScheduler`'s answer thread takes snapshots,
holding the engine lock that vLLM's calls hold: no lock per call (it cost +27 % of the
manager's instructions per call, BENCHMARKS.md).

Each vLLM method runs first, as it is; the subclass then records what it changed, from facts
it read before and after (O(1) per call, O(evicted) for an eviction). Events are flushed once
per scheduler step (vLLM calls `get_freed_mm_hashes` in every `schedule()`) and when a request
is freed, so that a P going idle still publishes its last changes.

Which vLLM. Its events are only as true as its reading of vLLM's manager, so `create_manager`
first compares vLLM's `EncoderCacheManager` with what was recorded for that vLLM version
(`vllm_versions.EC_VERIFIED`: its public methods and their signatures, its `__init__`, the
attributes an instance starts with). On a vLLM not verified it degrades instead of stopping
P: a WARNING names the version and what differs, and vLLM gets its own `EncoderCacheManager`
(no events; a proxy reading them sees no encoder cache at this P). The override
(`MMREUSE_ALLOW_UNVERIFIED_VLLM=1`, or `"allow_unverified_vllm": true` in its
`additional_config` entry) runs it fully, with a warning.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from vllm.v1.core.encoder_cache_manager import EncoderCacheManager

from ..demand_query import DemandError, ECSnapshotQuery, decode_query, encode
from ..events.ec_wire import (
    EncoderCacheCleared,
    EncoderCacheEventBatch,
    EncoderCacheEvicted,
    EncoderCacheFreeable,
    EncoderCacheReferenced,
    EncoderCacheStored,
)
from .control import ControlServer, id_of
from .plugin_config import PluginSettings, read_config
from .snapshots import ECSnapshots
from .vllm_versions import check_running_encoder_cache

# under vLLM's "vllm" logger: its handler and format, so these lines appear in vLLM's log
logger = logging.getLogger(f"vllm.{__name__}")

MAX_SNAPSHOT_QUERY_BYTES = 65536  # a larger frame is no ECSnapshotQuery: dropped unread


def _publisher(settings: PluginSettings, vllm_config: Any) -> Any:
    """vLLM's ZMQ publisher where P's settings name an events endpoint (else None)."""
    endpoint = settings.encoder_cache_events_endpoint
    if endpoint is None:
        return None
    from vllm.distributed.kv_events import ZmqEventPublisher

    parallel = getattr(vllm_config, "parallel_config", None)
    rank = getattr(parallel, "data_parallel_rank", 0) or 0
    publisher = ZmqEventPublisher(
        rank,
        endpoint=endpoint,
        replay_endpoint=settings.encoder_cache_events_replay_endpoint,
        topic=settings.encoder_cache_events_topic,
    )
    logger.info("mmreuse: encoder-cache events on %s", endpoint)
    return publisher


class EventfulEncoderCacheManager(EncoderCacheManager):
    """vLLM's encoder cache manager, publishing its changes (see the module docstring)."""

    @classmethod
    def create_manager(cls, *, cache_size: int, vllm_config: Any) -> EncoderCacheManager:
        """vLLM's hook (`--ec-manager-config`). On a vLLM whose EncoderCacheManager this was
        verified with (`vllm_versions.EC_VERIFIED`), or with the override set, this manager,
        publishing where P's settings say; otherwise vLLM's own EncoderCacheManager, which
        publishes nothing, and a warning naming the version and what differs (P keeps
        serving: see `vllm_versions.encoder_cache_verdict`)."""
        settings = read_config(vllm_config)  # a mistyped setting stops vLLM here
        own_endpoint = settings.encoder_cache_snapshot_endpoint is not None
        try:
            manager = (_LockedEventfulEncoderCacheManager if own_endpoint else cls)(
                cache_size=cache_size
            )
        except Exception as exc:  # vLLM's __init__ changed: nothing of ours can run on it
            import vllm

            logger.warning(
                "mmreuse: EventfulEncoderCacheManager is off, P runs vLLM's own "
                "EncoderCacheManager and publishes no encoder-cache events: it cannot be built "
                "on vLLM %s (%s: %s)",
                getattr(vllm, "__version__", "unknown"),
                type(exc).__name__,
                exc,
                exc_info=True,
            )
            return EncoderCacheManager.create_manager(
                cache_size=cache_size, vllm_config=vllm_config
            )
        allow = settings.allow_unverified_vllm
        if not check_running_encoder_cache(cls, manager._vllm_attributes, allow):
            return EncoderCacheManager.create_manager(
                cache_size=cache_size, vllm_config=vllm_config
            )
        manager.publisher = _publisher(settings, vllm_config)
        if settings.encoder_cache_snapshot_endpoint is not None:
            manager.serve_snapshots(settings.encoder_cache_snapshot_endpoint)
        return manager

    def __init__(self, cache_size: int) -> None:
        super().__init__(cache_size)
        # what vLLM's __init__ gave the instance (the start-up check compares them)
        self._vllm_attributes = tuple(vars(self))
        self.publisher: Any = None
        self._pending: list[Any] = []
        self.published = 0  # batches handed to the publisher: the seq of the next one
        # held by every method that changes the cache, and by snapshot(): see the module doc
        self._lock = threading.RLock()
        self.snapshots = ECSnapshots(self.snapshot, self._settled, self._lock)
        self._server: ControlServer | None = None

    # ---- vLLM's methods, then what they changed (`_Locked...` holds the lock around each) ------

    def check_and_update_cache(self, request: Any, input_id: int) -> bool:
        mm_hash = request.mm_features[input_id].identifier
        was_freeable = mm_hash in self.freeable
        hit = super().check_and_update_cache(request, input_id)
        if hit and was_freeable and mm_hash not in self.freeable:
            self._pending.append(EncoderCacheReferenced([mm_hash]))
        return hit

    def can_allocate(
        self, request: Any, input_id: int, encoder_compute_budget: int, num_embeds_to_schedule: int
    ) -> bool:
        n = len(self.freed)
        ok = super().can_allocate(request, input_id, encoder_compute_budget, num_embeds_to_schedule)
        if len(self.freed) > n:
            self._pending.append(EncoderCacheEvicted(list(self.freed[n:])))
        return ok

    def allocate(self, request: Any, input_id: int) -> None:
        mm_hash = request.mm_features[input_id].identifier
        new = mm_hash not in self.num_embeds_by_hash
        super().allocate(request, input_id)
        if new:
            self._pending.append(EncoderCacheStored(mm_hash, self.num_embeds_by_hash[mm_hash]))

    def free_encoder_input(self, request: Any, input_id: int) -> None:
        mm_hash = request.mm_features[input_id].identifier
        was_freeable = mm_hash in self.freeable
        super().free_encoder_input(request, input_id)
        if not was_freeable and mm_hash in self.freeable:
            self._pending.append(EncoderCacheFreeable([mm_hash]))

    def free(self, request: Any) -> None:
        super().free(request)
        if self._pending:
            self._publish()

    def reset(self) -> None:
        super().reset()
        self._pending.append(EncoderCacheCleared())
        self._publish()

    def get_freed_mm_hashes(self) -> list[str]:
        freed = super().get_freed_mm_hashes()
        if self._pending:
            self._publish()
        return freed

    # ---- publishing ---------------------------------------------------------------------------

    def take_events(self) -> list[Any]:
        """The events recorded since the last flush (and forget them)."""
        with self._lock:
            events, self._pending = self._pending, []
            return events

    def flush(self) -> None:
        """Publish what changed since the last flush as one batch (nothing when unchanged)."""
        with self._lock:
            if self._pending:
                self._publish()

    def _publish(self) -> None:
        """`flush`'s work, the lock held by the caller (vLLM's methods above call it there, so
        that a step's free and flush take the lock once, not three times)."""
        events, self._pending = self._pending, []
        if self.publisher is None:
            return
        try:
            self.publisher.publish(EncoderCacheEventBatch(time.time(), events))
        except Exception:  # a publisher problem must never reach vLLM's scheduler
            logger.exception("mmreuse: encoder-cache events not published")
            return
        self.published += 1

    def snapshot(self) -> tuple[int, list[tuple[str, int, bool]]]:
        """(stamp, entries): the cache as its events describe it, after publishing what is
        pending, so that it is true as of batch `stamp - 1`; entries not freeable first, then
        the freeable ones oldest first (vLLM's eviction order). Holds the manager's lock, so
        that no method of vLLM's changes the cache meanwhile (callable from any thread)."""
        with self._lock:
            self.flush()
            freeable = self.freeable
            held = [(h, n, False) for h, n in self.num_embeds_by_hash.items() if h not in freeable]
            held += [(h, self.num_embeds_by_hash.get(h, n), True) for h, n in freeable.items()]
            return self.published, held

    def _settled(self) -> int | None:
        """The stamp `snapshot()` would give now, or None while events are pending (the cache
        changed since the last batch)."""
        with self._lock:
            return None if self._pending else self.published

    # ---- the snapshot endpoint (E) ------------------------------------------------------------

    def serve_snapshots(self, endpoint: str) -> None:
        """Answer `ECSnapshotQuery` on `endpoint` (a ZMQ ROUTER, its own thread)."""
        self._server = ControlServer(
            endpoint, self.handle, MAX_SNAPSHOT_QUERY_BYTES, name="mmreuse-ec-snapshot"
        ).start()
        logger.info("mmreuse: encoder-cache snapshots on %s", endpoint)

    def handle(self, payload: bytes) -> bytes:
        """One frame -> one answer frame: an `ECSnapshot` chunk, or a `DemandError` for
        anything else. Never raises."""
        try:
            query = decode_query(payload)
            if not isinstance(query, ECSnapshotQuery):
                return encode(
                    DemandError(
                        query.id,
                        f"this endpoint answers ECSnapshotQuery only, got {type(query).__name__}",
                    )
                )
            if self.publisher is None:
                return encode(DemandError(query.id, "snapshot: no encoder-cache events"))
            return encode(self.snapshots.answer(query))
        except Exception as e:  # a malformed frame, or a bug: this answer only
            return encode(DemandError(id_of(payload), f"{type(e).__name__}: {e}"))


class _LockedEventfulEncoderCacheManager(EventfulEncoderCacheManager):
    """The manager where it serves snapshots on its own endpoint (E): each of vLLM's calls
    holds the manager's lock, so that a snapshot, taken by the endpoint's thread under it, sees
    the cache between two calls. Elsewhere no other thread reads the cache but a
    `DemandScheduler`'s, under the engine lock vLLM's calls already hold: no lock per call."""

    def check_and_update_cache(self, request: Any, input_id: int) -> bool:
        with self._lock:
            return super().check_and_update_cache(request, input_id)

    def can_allocate(
        self, request: Any, input_id: int, encoder_compute_budget: int, num_embeds_to_schedule: int
    ) -> bool:
        with self._lock:
            return super().can_allocate(
                request, input_id, encoder_compute_budget, num_embeds_to_schedule
            )

    def allocate(self, request: Any, input_id: int) -> None:
        with self._lock:
            super().allocate(request, input_id)

    def free_encoder_input(self, request: Any, input_id: int) -> None:
        with self._lock:
            super().free_encoder_input(request, input_id)

    def free(self, request: Any) -> None:
        with self._lock:
            super().free(request)

    def reset(self) -> None:
        with self._lock:
            super().reset()

    def get_freed_mm_hashes(self) -> list[str]:
        with self._lock:
            return super().get_freed_mm_hashes()
