"""mmreuse's live-view metrics, in one torch-free home: the KV-event and encoder-cache-event
subscribers (`mmreuse.events`) and the embedding-availability index (`mmreuse.availability`).

Both sides import this module and neither imports the other. The proxy's own metrics
(`mmreuse.proxy.metrics.ProxyMetrics`) add to these in the proxy's registry.
"""

from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, Counter, Gauge


class Metrics:
    """One set of the live view's metrics, labelled by instance (or location), in one registry.

    `Metrics.default()` registers once in prometheus_client's default registry; tests and
    embedders may pass their own registry.
    """

    _default: Metrics | None = None
    _default_lock = threading.Lock()

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.batches = Counter(
            "mmreuse_kv_event_batches_total", "KV-event batches applied", ["instance"], registry=r
        )
        self.events = Counter(
            "mmreuse_kv_events_total",
            "KV events applied, by type",
            ["instance", "type"],
            registry=r,
        )
        self.gaps = Counter(
            "mmreuse_kv_event_gaps_total", "Sequence gaps detected", ["instance"], registry=r
        )
        self.replays = Counter(
            "mmreuse_kv_event_replays_total",
            "Replay requests sent to the publisher",
            ["instance"],
            registry=r,
        )
        self.resyncs = Counter(
            "mmreuse_kv_event_resyncs_total",
            "Index resets after a loss replay could not cover",
            ["instance"],
            registry=r,
        )
        self.complete = Gauge(
            "mmreuse_kv_event_view_complete",
            "1 when the view holds everything the publisher has said since it started (seq 0 "
            "applied, or a clear since), 0 when it may miss what was published before it "
            "subscribed or in a gap replay could not fill (decisions from it are blind); "
            "events: kv or encoder_cache",
            ["instance", "events"],
            registry=r,
        )
        self.snapshots = Counter(
            "mmreuse_kv_event_snapshots_total",
            "Snapshots of P's prefix cache asked for an incomplete view, by outcome: ok, or why "
            "not (error: P refused, timeout, malformed, bound, stamp, incarnation: another P "
            "process, replay)",
            ["instance", "outcome"],
            registry=r,
        )
        self.restarts = Counter(
            "mmreuse_kv_event_publisher_restarts_total",
            "Publisher restarts detected (sequence going back, or not "
            "continuing after a reconnect)",
            ["instance"],
            registry=r,
        )
        self.malformed = Counter(
            "mmreuse_kv_event_malformed_total",
            "Malformed frames or payloads",
            ["instance"],
            registry=r,
        )
        self.errors = Counter(
            "mmreuse_kv_event_errors_total",
            "Unexpected errors handling a batch (survived by a resync)",
            ["instance"],
            registry=r,
        )
        self.replay_aborts = Counter(
            "mmreuse_kv_event_replay_aborts_total",
            "Replays cut short or refused (timeout, deadline, bound, "
            "hole, a seq out of range, stop)",
            ["instance", "reason"],
            registry=r,
        )
        self.subscriber_up = Gauge(
            "mmreuse_kv_event_subscriber_up",
            "1 while the subscriber loop runs, 0 once it has stopped or died",
            ["instance"],
            registry=r,
        )
        self.subscriber_failures = Counter(
            "mmreuse_kv_event_subscriber_failures_total",
            "Subscriber loops that died on an error",
            ["instance"],
            registry=r,
        )
        self.index_size = Gauge(
            "mmreuse_kv_index_blocks",
            "Distinct block hashes held, per instance and medium",
            ["instance", "medium"],
            registry=r,
        )
        self.availability_entries = Gauge(
            "mmreuse_availability_entries",
            "Embedding-availability entries, per location",
            ["location"],
            registry=r,
        )
        self.availability_expired = Counter(
            "mmreuse_availability_expired_total",
            "Availability entries dropped for staleness (TTL)",
            ["location"],
            registry=r,
        )
        self.availability_evicted = Counter(
            "mmreuse_availability_evicted_total",
            "Availability entries dropped for capacity (LRU)",
            ["location"],
            registry=r,
        )

    @classmethod
    def default(cls) -> Metrics:
        """The process-wide metrics in prometheus_client's default registry."""
        with cls._default_lock:
            if cls._default is None:
                from prometheus_client import REGISTRY

                cls._default = cls(REGISTRY)
            return cls._default
