"""`DemandScheduler`: vLLM's scheduler, unchanged in behaviour, that also answers demand queries
(`mmreuse.demand_query`) from P's true state, and keeps P's residency index.

Switched on in a P/PD with `--scheduler-cls mmreuse.integrations.vllm.DemandScheduler` and its
endpoint through `--additional-config '{"mmreuse": {"demand_endpoint": "tcp://*:PORT"}}'`
(without an endpoint it answers nothing but still keeps its index and counters; the settings:
`integrations.plugin_config`). Imports vLLM: load it only inside vLLM.

This class keeps vLLM's overrides and the demand lock; the jobs are its parts (`index_feed`,
`answers`, `records`, `snapshots`, `server`: see the package docstring).

How answers stay consistent and prompt. vLLM's engine core runs the scheduler on one thread and
blocks when idle. An answer thread owns the ROUTER socket; every scheduler method that changes
state (`_LOCKED`) runs holding one lock, and an answer is computed holding it too. So an answer
sees P between two scheduler calls, never in the middle of one (no torn reads); when P is idle
the lock is free and the answer is immediate; when P is busy it waits at most for the scheduler
call in progress (the model's forward pass runs outside the lock, and releases the GIL). What
grows with the query (decoding it, building its `Request` and block hashes) is done before
taking the lock, and the wire bounds a query by P's max_model_len
(`demand_query.max_query_bytes`), so a hostile client costs the answer thread bounded work and
the engine one short wait per scheduler call.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from ..control import ControlServer
from ..plugin_config import read_config
from .answers import Answers
from .index_feed import SYNC_INDEX_AFTER, IndexFeed
from .records import AdmissionLog
from .snapshots import KVSnapshots

# under vLLM's "vllm" logger: its handler and format, so these lines appear in vLLM's log
logger = logging.getLogger(f"vllm.{__name__}")

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
        settings = read_config(vllm_config)  # a mistyped setting stops P here
        _check_vllm(type(self), settings.allow_unverified_vllm)  # refuses an unverified vLLM
        super().__init__(vllm_config, *args, **kwargs)
        self._demand_lock = threading.RLock()
        self._feed = IndexFeed(self)
        self._kv_snapshots = KVSnapshots(
            self, self._feed, self._demand_lock, settings.snapshot_identifiers
        )
        self._records = AdmissionLog(self, settings.admission_records)
        self._answers = Answers(
            self,
            self._demand_lock,
            self._feed,
            self._records,
            self._kv_snapshots,
            _query_hasher(self, vllm_config),
        )
        self._server: ControlServer | None = None
        if settings.demand_endpoint is not None:
            self._server = ControlServer(
                settings.demand_endpoint, self._answers.handle, self._answers.max_query_bytes
            ).start()
            logger.info(
                "mmreuse: demand answers on %s (index: %s)",
                settings.demand_endpoint,
                self._feed.note,
            )

    # ---- vLLM's methods, holding the lock, feeding the parts ----------------------------------

    def add_request(self, request: Any) -> None:
        with self._demand_lock:
            super().add_request(request)
            self._answers.note_request(request)

    def _get_local_prefix_cache_hit(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        lookup = super()._get_local_prefix_cache_hit
        result = self._answers.check_at_lookup(request, lambda: lookup(request, *args, **kwargs))
        if self._records.enabled:
            self._records.note_lookup(request, int(result[1]))
        return result

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        with self._demand_lock:
            output = super().schedule(*args, **kwargs)
            records = self._records
            self._answers.count_admissions(output, records.checked if records.enabled else None)
            if records.enabled:
                records.record(output, self.requests)
            if len(self._feed.ops) > SYNC_INDEX_AFTER:
                self._feed.sync()
            return output

    def finish_requests(self, request_ids: Any, *args: Any, **kwargs: Any) -> Any:
        with self._demand_lock:
            out = super().finish_requests(request_ids, *args, **kwargs)
            ids = [request_ids] if isinstance(request_ids, str) else list(request_ids or ())
            for rid in ids:
                self._answers.forget(rid)
                self._records.forget(rid)
            return out

    def shutdown(self) -> None:
        if self._server is not None:
            self._server.stop()
        super().shutdown()


def _query_hasher(scheduler: Any, vllm_config: Any) -> Callable[[Any], list[Any]] | None:
    """The block hasher of a query's `Request`: P's own (None without prefix caching)."""
    cache = vllm_config.cache_config
    if not cache.enable_prefix_caching:
        return None
    from vllm.utils.hashing import get_hash_fn_by_name

    from ..vllm_hasher import fast_request_block_hasher

    hash_block_size: Any = getattr(scheduler, "hash_block_size", None) or scheduler.block_size
    return fast_request_block_hasher(
        hash_block_size,
        get_hash_fn_by_name(cache.prefix_caching_hash_algo),
        getattr(vllm_config, "num_hash_lookahead_tokens", 0),
    )


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


def _check_vllm(cls: type, allow_unverified: bool) -> None:
    """Before the scheduler serves: the running vLLM's scheduler is one this was verified with
    (its methods as recorded, each locked or known read-only), or InvalidArgument naming what
    differs; `allow_unverified_vllm` / MMREUSE_ALLOW_UNVERIFIED_VLLM=1 start anyway, warned."""
    from ..vllm_versions import check_running_scheduler

    check_running_scheduler(cls, allow_unverified, _LOCKED)


class AsyncDemandScheduler(DemandScheduler, AsyncScheduler):
    """`DemandScheduler` over vLLM's AsyncScheduler (picked by DemandScheduler itself)."""


__all__ = ["AsyncDemandScheduler", "DemandScheduler"]
