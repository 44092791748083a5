"""`EventfulEncoderCacheManager`: vLLM's `EncoderCacheManager`, unchanged in behaviour, that
also publishes what changes in it (`mmreuse.events.ec_wire`) with vLLM's own ZMQ publisher.

Switched on in a P/PD with
`--ec-manager-config '{"encoder_cache_manager_cls": "mmreuse.integrations.vllm.EventfulEncoderCacheManager"}'`
and its endpoint through `--additional-config '{"mmreuse": {"encoder_cache_events_endpoint":
"tcp://*:PORT", "encoder_cache_events_replay_endpoint": "tcp://*:PORT2"}}'` (without an
endpoint it behaves as vLLM's and publishes nothing). Imports vLLM: load it only inside vLLM.

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
import time
from typing import Any

from vllm.v1.core.encoder_cache_manager import EncoderCacheManager

from ..events.ec_wire import (
    EncoderCacheCleared,
    EncoderCacheEventBatch,
    EncoderCacheEvicted,
    EncoderCacheFreeable,
    EncoderCacheReferenced,
    EncoderCacheStored,
)
from ..validate import check_str
from .plugin_config import CONFIG_KEY, read_config
from .vllm_versions import check_running_encoder_cache

# under vLLM's "vllm" logger: its handler and format, so these lines appear in vLLM's log
logger = logging.getLogger(f"vllm.{__name__}")


def _settings(vllm_config: Any) -> tuple[str, str | None, str] | None:
    """(endpoint, replay endpoint, topic) from P's settings, or None without an endpoint; a
    mistyped one is refused (it must stop P at start-up, not switch the events off)."""
    ours = read_config(vllm_config)
    field = f"additional_config[{CONFIG_KEY!r}]"
    endpoint = ours.get("encoder_cache_events_endpoint")
    if not endpoint:
        return None
    endpoint = check_str(f"{field}['encoder_cache_events_endpoint']", endpoint)
    replay = ours.get("encoder_cache_events_replay_endpoint")
    if replay is not None:
        replay = check_str(f"{field}['encoder_cache_events_replay_endpoint']", replay)
    topic = check_str(
        f"{field}['encoder_cache_events_topic']", ours.get("encoder_cache_events_topic", "ec")
    )
    return endpoint, replay, topic


def _publisher(settings: tuple[str, str | None, str] | None, vllm_config: Any) -> Any:
    if settings is None:
        return None
    from vllm.distributed.kv_events import ZmqEventPublisher

    endpoint, replay, topic = settings
    parallel = getattr(vllm_config, "parallel_config", None)
    rank = getattr(parallel, "data_parallel_rank", 0) or 0
    publisher = ZmqEventPublisher(rank, endpoint=endpoint, replay_endpoint=replay, topic=topic)
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
        settings = _settings(vllm_config)
        try:
            manager = cls(cache_size=cache_size)
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
        if not check_running_encoder_cache(cls, manager._vllm_attributes, read_config(vllm_config)):
            return EncoderCacheManager.create_manager(
                cache_size=cache_size, vllm_config=vllm_config
            )
        manager.publisher = _publisher(settings, vllm_config)
        return manager

    def __init__(self, cache_size: int) -> None:
        super().__init__(cache_size)
        # what vLLM's __init__ gave the instance (the start-up check compares them)
        self._vllm_attributes = tuple(vars(self))
        self.publisher: Any = None
        self._pending: list[Any] = []
        self.published = 0  # batches handed to the publisher: the seq of the next one

    # ---- vLLM's methods, then what they changed -----------------------------------------------

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
        self.flush()

    def reset(self) -> None:
        super().reset()
        self._pending.append(EncoderCacheCleared())
        self.flush()

    def get_freed_mm_hashes(self) -> list[str]:
        freed = super().get_freed_mm_hashes()
        self.flush()
        return freed

    # ---- publishing ---------------------------------------------------------------------------

    def take_events(self) -> list[Any]:
        """The events recorded since the last flush (and forget them)."""
        events, self._pending = self._pending, []
        return events

    def flush(self) -> None:
        """Publish what changed since the last flush as one batch (nothing when unchanged)."""
        if not self._pending:
            return
        events = self.take_events()
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
        the freeable ones oldest first (vLLM's eviction order). Call it where vLLM's scheduler
        methods cannot run (DemandScheduler holds its lock)."""
        self.flush()
        freeable = self.freeable
        held = [(h, n, False) for h, n in self.num_embeds_by_hash.items() if h not in freeable]
        held += [(h, self.num_embeds_by_hash.get(h, n), True) for h, n in freeable.items()]
        return self.published, held
