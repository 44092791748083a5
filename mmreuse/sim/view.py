"""The proxy's lagging view of the cluster, which the `index` policy decides from.

P's KV changes reach a `RemoteKVIndex` per P as KV event batches, and every cache's deltas
reach an `EmbeddingAvailability`, each `view_lag_ms` after they happened: a change is queued
when it happens and applied by `catch_up` once it is old enough. Policies that do not read the
view get `NO_VIEW`, which drops every change.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from ..availability import EmbeddingAvailability
from ..blockhash import EventBlockId, ExternalBlockHash
from ..events import BlockRemoved, BlockStored, KVEventBatch, Metrics, RemoteKVIndex
from ..events.wire import KVCacheEventType


class ClusterView:
    """What the proxy knows, `lag_ms` behind the caches (`now_ms` is the simulation clock)."""

    def __init__(
        self, num_prefills: int, block_size: int, lag_ms: float, now_ms: Callable[[], float]
    ) -> None:
        self.kv = [RemoteKVIndex(prefill_name(i)) for i in range(num_prefills)]
        self.embeddings = EmbeddingAvailability(
            ttl_s=1e9,
            max_entries=10**7,
            timer=lambda: now_ms() / 1000.0,
            metrics=Metrics(_registry()),
        )
        self._block_size = block_size
        self._lag_ms = lag_ms
        self._now_ms = now_ms
        self._pending: deque[tuple[float, Callable[[], object]]] = deque()

    def catch_up(self) -> None:
        """Apply every change at least `lag_ms` old."""
        horizon = self._now_ms() - self._lag_ms
        pending = self._pending
        while pending and pending[0][0] <= horizon:
            pending.popleft()[1]()

    def _later(self, apply: Callable[[], object]) -> None:
        self._pending.append((self._now_ms(), apply))

    def kv_changed(self, p: int, stored: list[EventBlockId], removed: list[EventBlockId]) -> None:
        """P's KV events for one admission: BlockStored, then BlockRemoved."""
        events: list[KVCacheEventType] = []
        if stored:
            events.append(
                BlockStored(
                    block_hashes=list[ExternalBlockHash](stored),
                    parent_block_hash=None,
                    token_ids=[],
                    block_size=self._block_size,
                    lora_id=None,
                    medium="GPU",
                    lora_name=None,
                )
            )
        if removed:
            events.append(BlockRemoved(block_hashes=list[ExternalBlockHash](removed), medium="GPU"))
        batch = KVEventBatch(ts=self._now_ms() / 1000.0, events=events)
        index = self.kv[p]
        self._later(lambda: index.apply(batch))

    def encoder_cache_changed(self, p: int, added: dict[str, int], removed: list[str]) -> None:
        name = prefill_name(p)
        self._later(lambda: self.embeddings.update_p(name, added=added, removed=removed))

    def e_cache_changed(self, e: int, added: list[str], removed: list[str]) -> None:
        name = encoder_name(e)
        self._later(lambda: self.embeddings.update_e(name, added=added, removed=removed))

    def external_changed(self, added: list[str], removed: list[str]) -> None:
        self._later(lambda: self.embeddings.update_external(added=added, removed=removed))


class _NoView:
    """The view of a policy that never reads it: every change is dropped."""

    def catch_up(self) -> None:
        pass

    def kv_changed(self, p: int, stored: list[EventBlockId], removed: list[EventBlockId]) -> None:
        pass

    def encoder_cache_changed(self, p: int, added: dict[str, int], removed: list[str]) -> None:
        pass

    def e_cache_changed(self, e: int, added: list[str], removed: list[str]) -> None:
        pass

    def external_changed(self, added: list[str], removed: list[str]) -> None:
        pass


NO_VIEW = _NoView()


def prefill_name(p: int) -> str:
    return f"p{p}"


def encoder_name(e: int) -> str:
    return f"e{e}"


def _registry():
    """A private Prometheus registry: the view's gauges must not collide across runs."""
    from prometheus_client import CollectorRegistry

    return CollectorRegistry()
