"""Where encoder embeddings are available: P's encoder caches, external stores, E's caches.

vLLM itself publishes no encoder-cache events, so this index is fed by deltas from whatever
observes those caches: `update_p` and `update_e` from the encoder-cache events of mmreuse's
`EventfulEncoderCacheManager` in P and E (`events.ec_sink.EncoderCacheSink`) and from what the
proxy sent E (`proxy.eside`); `update_external` from the simulator's store (`sim.view`: the
proxy asks the real store per request instead, `proxy.store`). Every entry has a staleness bound
(TTL, refreshed by each delta that mentions it) and every location a capacity bound (LRU), both
via cachetools. Entries are scoped by tenant (cache salt, LoRA name): an identifier one tenant
made available never satisfies another's request. `availability_for` turns the view into
`compute_demand`'s `Availability`.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import cachetools

from .demand import Availability
from .metrics import Metrics
from .validate import check_callable, check_float, check_int, check_str, fail_type, fail_value


@dataclass(frozen=True, slots=True)
class Tenant:
    """The isolation scope of an entry: vLLM's cache salt and LoRA name of the request."""

    cache_salt: str | None = None
    lora_name: str | None = None

    def __post_init__(self) -> None:
        for name in ("cache_salt", "lora_name"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, str):
                fail_type(name, "a str or None", v)


class _Entries(cachetools.TTLCache):
    """A TTL + LRU cache that reports what it drops."""

    def __init__(
        self,
        maxsize: int,
        ttl: float,
        timer: Callable[[], float],
        on_drop: Callable[[str, int], None],
    ) -> None:
        super().__init__(maxsize, ttl, timer)
        self._on_drop = on_drop

    def expire(self, time: float | None = None):
        expired = super().expire(time)
        if expired:
            self._on_drop("expired", len(expired))
        return expired

    def popitem(self):
        item = super().popitem()
        self._on_drop("evicted", 1)
        return item


def _check_name(field: str, value: Any) -> str:
    return check_str(field, value, nonempty=True)


def _check_ids(field: str, ids: Any) -> list[str]:
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Iterable):
        fail_type(field, "an iterable of identifiers", ids)
    out = list(ids)
    for k, i in enumerate(out):
        check_str(f"{field}[{k}]", i, nonempty=True)
    return out


class EmbeddingAvailability:
    """Embedding availability per P instance, external store and E instance, per tenant.

    Args:
        ttl_s: seconds an entry stays without a delta mentioning it.
        max_entries: entries per location, over all its tenants (the least recently updated
            tenant's oldest dropped first).
        max_tenants: tenants per location (the least recently updated one dropped first).
        timer: the clock (monotonic seconds); injectable for tests and the simulator.
        metrics: Prometheus metrics (default: the process-wide ones).
    """

    def __init__(
        self,
        *,
        ttl_s: float = 60.0,
        max_entries: int = 100_000,
        max_tenants: int = 64,
        timer: Callable[[], float] = time.monotonic,
        metrics: Metrics | None = None,
    ) -> None:
        self.ttl_s = check_float("ttl_s", ttl_s, 0, lo_open=True)
        self.max_entries = check_int("max_entries", max_entries, 1)
        self.max_tenants = check_int("max_tenants", max_tenants, 1)
        # Per location, its tenants in least-recently-updated order: a client that invents cache
        # salts cannot grow this past max_tenants * max_entries entries a location.
        self._tenants: dict[tuple[str, str], OrderedDict[Tenant, None]] = {}
        self._timer = check_callable("timer", timer)
        self._metrics = metrics if metrics is not None else Metrics.default()
        self._caches: dict[tuple[str, str, Tenant], _Entries] = {}
        self._lock = threading.Lock()

    def _cache(self, kind: str, name: str, tenant: Tenant) -> _Entries:
        key = (kind, name, tenant)
        order = self._tenants.setdefault((kind, name), OrderedDict())
        order[tenant] = None
        order.move_to_end(tenant)
        while len(order) > self.max_tenants:
            oldest, _ = order.popitem(last=False)
            dropped = self._caches.pop((kind, name, oldest), None)
            if dropped is not None and len(dropped):
                self._metrics.availability_evicted.labels(f"{kind}:{name}").inc(len(dropped))
        cache = self._caches.get(key)
        if cache is None:
            location = f"{kind}:{name}"

            def on_drop(reason: str, n: int, location: str = location) -> None:
                counter = (
                    self._metrics.availability_expired
                    if reason == "expired"
                    else self._metrics.availability_evicted
                )
                counter.labels(location).inc(n)

            cache = self._caches[key] = _Entries(self.max_entries, self.ttl_s, self._timer, on_drop)
        return cache

    def _bound(self, kind: str, name: str) -> None:
        """At most max_entries a location over all its tenants: the least recently updated
        tenant gives up its oldest entries first (a tenant left empty is dropped)."""
        order = self._tenants.get((kind, name))
        if not order:
            return
        caches = [
            (t, self._caches[(kind, name, t)]) for t in order if (kind, name, t) in self._caches
        ]
        total = sum(len(c) for _, c in caches)
        for tenant, cache in caches:  # least recently updated first
            while total > self.max_entries and len(cache):
                cache.popitem()
                total -= 1
            if not len(cache) and len(order) > 1:
                del self._caches[(kind, name, tenant)]
                del order[tenant]
            if total <= self.max_entries:
                break

    def _gauge(self, kind: str, name: str) -> None:
        total = sum(len(c) for (k, n, _), c in self._caches.items() if k == kind and n == name)
        self._metrics.availability_entries.labels(f"{kind}:{name}").set(total)

    # ---- deltas -------------------------------------------------------------------------------

    def update_p(
        self,
        instance: str,
        *,
        added: Mapping[str, int] | None = None,
        removed: Iterable[str] = (),
        freeable: Iterable[str] = (),
        referenced: Iterable[str] = (),
        cache_salt: str | None = None,
        lora_name: str | None = None,
    ) -> None:
        """P's encoder cache changed: `added` (identifier -> num_embeds, referenced), `freeable`
        (no references left, still cached), `referenced` (in use again), `removed` (evicted)."""
        _check_name("instance", instance)
        added = {} if added is None else added
        if not isinstance(added, Mapping):
            fail_type("added", "a mapping identifier -> num_embeds", added)
        for ident, n in added.items():
            _check_ids("added", [ident])
            check_int(f"added[{ident!r}]", n, 1)
        removed_ids, freeable_ids, referenced_ids = (
            _check_ids("removed", removed),
            _check_ids("freeable", freeable),
            _check_ids("referenced", referenced),
        )
        tenant = Tenant(cache_salt, lora_name)
        with self._lock:
            cache = self._cache("p", instance, tenant)
            for ident, n in added.items():
                cache[ident] = (n, False)
            for ident, flag in ((i, True) for i in freeable_ids):
                if ident in cache:
                    cache[ident] = (cache[ident][0], flag)
            for ident in referenced_ids:
                if ident in cache:
                    cache[ident] = (cache[ident][0], False)
            for ident in removed_ids:
                cache.pop(ident, None)
            self._bound("p", instance)
            self._gauge("p", instance)

    def update_external(
        self,
        *,
        store: str = "default",
        added: Iterable[str] = (),
        removed: Iterable[str] = (),
        cache_salt: str | None = None,
        lora_name: str | None = None,
    ) -> None:
        """An external embedding store (what P's EC connector can load) changed."""
        self._update_set(
            "ext", _check_name("store", store), added, removed, Tenant(cache_salt, lora_name)
        )

    def update_e(
        self,
        instance: str,
        *,
        added: Iterable[str] = (),
        removed: Iterable[str] = (),
        cache_salt: str | None = None,
        lora_name: str | None = None,
    ) -> None:
        """E's cache changed (it can serve these without an encoder forward)."""
        self._update_set(
            "e", _check_name("instance", instance), added, removed, Tenant(cache_salt, lora_name)
        )

    def _update_set(
        self, kind: str, name: str, added: Iterable[str], removed: Iterable[str], tenant: Tenant
    ) -> None:
        added_ids, removed_ids = _check_ids("added", added), _check_ids("removed", removed)
        with self._lock:
            cache = self._cache(kind, name, tenant)
            for ident in added_ids:
                cache[ident] = True
            for ident in removed_ids:
                cache.pop(ident, None)
            self._bound(kind, name)
            self._gauge(kind, name)

    def forget_instance(self, kind: str, name: str) -> None:
        """Drop everything known about a location (e.g. the instance restarted)."""
        if kind not in ("p", "ext", "e"):
            fail_value("kind", "'p', 'ext' or 'e'", kind)
        with self._lock:
            for key in [k for k in self._caches if k[0] == kind and k[1] == name]:
                del self._caches[key]
            self._tenants.pop((kind, name), None)
            self._gauge(kind, name)

    # ---- the view -----------------------------------------------------------------------------

    def availability_for(
        self,
        p_instance: str,
        e_instance: str | Sequence[str] | None = None,
        *,
        store: str | None = "default",
        cache_salt: str | None = None,
        lora_name: str | None = None,
        identifiers: Iterable[str] | None = None,
    ) -> Availability:
        """compute_demand's Availability for a request of this tenant, P instance and E
        instance (several: what any of them holds, E's that share one store). `identifiers`:
        the request's, to look up only those (O(items), not O(entries): what the proxy does
        per request); None: every entry."""
        _check_name("p_instance", p_instance)
        if e_instance is None:
            e_names: list[str] = []
        elif isinstance(e_instance, str):
            e_names = [_check_name("e_instance", e_instance)]
        else:
            e_names = _check_ids("e_instance", e_instance)
        ids = None if identifiers is None else _check_ids("identifiers", identifiers)
        tenant = Tenant(cache_salt, lora_name)
        with self._lock:
            p_local: dict[str, int] = {}
            freeable: set[str] = set()
            cache = self._caches.get(("p", p_instance, tenant))
            if cache is not None:
                cache.expire()
                for ident, (n, is_freeable) in _entries(cache, ids):
                    p_local[ident] = n
                    if is_freeable:
                        freeable.add(ident)
            external = self._ids("ext", store, tenant, ids) if store is not None else frozenset()
            e_cached = frozenset().union(*(self._ids("e", e, tenant, ids) for e in e_names))
        return Availability(
            p_local=p_local,
            p_local_freeable=frozenset(freeable),
            p_external=external,
            e_cached=e_cached,
        )

    def p_holds(
        self, p_instance: str, identifiers: Iterable[str], *, cache_salt: str | None = None
    ) -> frozenset[str]:
        """Which of `identifiers` P `p_instance`'s encoder cache holds for this tenant: the
        `p_local` keys of `availability_for`, without building an Availability (the proxy's
        arrival-time split asks it for every request)."""
        ids = _check_ids("identifiers", identifiers)
        with self._lock:
            cache = self._caches.get(
                ("p", _check_name("p_instance", p_instance), Tenant(cache_salt, None))
            )
            if cache is None:
                return frozenset()
            cache.expire()
            return frozenset(i for i in ids if i in cache)

    def e_holds(
        self,
        e_instances: Sequence[str],
        identifiers: Iterable[str],
        *,
        cache_salt: str | None = None,
    ) -> frozenset[str]:
        """Which of `identifiers` any of `e_instances` holds for this tenant: the `e_cached` of
        `availability_for`, without a P instance (the proxy's E side asks it)."""
        names = _check_ids("e_instances", e_instances)
        ids = _check_ids("identifiers", identifiers)
        tenant = Tenant(cache_salt, None)
        with self._lock:
            return frozenset().union(*(self._ids("e", e, tenant, ids) for e in names))

    def _ids(self, kind: str, name: str, tenant: Tenant, ids: list[str] | None) -> frozenset[str]:
        cache = self._caches.get((kind, name, tenant))
        if cache is None:
            return frozenset()
        cache.expire()
        if ids is None:
            return frozenset(cache.keys())
        return frozenset(i for i in ids if i in cache)


def _entries(cache: _Entries, ids: list[str] | None) -> Iterable[tuple[str, Any]]:
    """The entries of `cache` (expired ones already dropped), or those among `ids`; read
    without touching the LRU order (a lookup is not an update)."""
    if ids is None:
        return cache.items()
    get = cachetools.Cache.__getitem__
    return [(i, get(cache, i)) for i in dict.fromkeys(ids) if i in cache]
