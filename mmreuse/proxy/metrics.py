"""The proxy's Prometheus metrics, in one registry per app (GET /metrics serves it): its own,
defined here, and its views' (KV-event and encoder-cache subscribers, E-side availability),
defined once in `mmreuse.metrics` and registered here alongside (`ProxyMetrics.views`)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector

from ..metrics import Metrics

# Stage latencies span sub-millisecond decisions to multi-second CPU prefills.
_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)  # fmt: skip

STAGES = ("media", "arrival", "render", "decide", "encode", "prefill", "decode", "total")


class ProxyMetrics:
    """Requests, occurrences by class, E traffic, stage latencies, views, fallbacks, errors,
    demand queries and opportunistic outcomes; `views`: the subscribers' and availability's
    metrics (`mmreuse.metrics.Metrics`) in the same registry."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = r = registry if registry is not None else CollectorRegistry()
        self.views = Metrics(r)
        self._traffic(r)
        self._view_facts(r)
        self._inputs(r)
        self._demand_and_arrival(r)
        self._instances(r)
        self._runtime(r)
        # Children bound once: a `.labels()` lookup per use costs more than the update.
        self.stage = {stage: self.stage_seconds.labels(stage) for stage in STAGES}
        self.e_sent = self.e_items.labels("sent")
        self.e_skipped = self.e_items.labels("skipped")
        self._children: dict[tuple[str, ...], Any] = {}

    def _traffic(self, r: CollectorRegistry) -> None:
        """Requests, occurrences by class, E traffic and stage latencies."""
        self.requests = Counter(
            "mmreuse_proxy_requests_total",
            "chat requests, by policy and outcome (ok, client_error, server_error, stream_broken: "
            "decode's stream broke after it started, client_gone: the client hung up)",
            ["policy", "outcome"],
            registry=r,
        )
        self.occurrences = Counter(
            "mmreuse_proxy_occurrences_total",
            "multimodal occurrences by class: kv_covered, p_local, p_external, e_cached, "
            "e_compute, duplicate, no_embeds; unclassified (eager, or no plan)",
            ["klass"],
            registry=r,
        )
        self.e_subrequests = Counter(
            "mmreuse_proxy_encoder_subrequests_total", "sub-requests sent to E", registry=r
        )
        self.e_items = Counter(
            "mmreuse_proxy_encoder_items_total",
            "media items: sent to E, or skipped (not sent: covered at P, reusable there, or a duplicate "
            "of an item sent)",
            ["action"],
            registry=r,
        )
        self.stage_seconds = Histogram(
            "mmreuse_proxy_stage_seconds",
            "per-stage latency: media (--uuid-policy content: fetch and name), arrival (index / demand: the split before E gets its new items), render, decide, encode, prefill, decode (to the first byte when "
            "streaming), total",
            ["stage"],
            buckets=_BUCKETS,
            registry=r,
        )

    def _view_facts(self, r: CollectorRegistry) -> None:
        """What the views tell and what a wrong plan cost: lag, hash checks, fallbacks, retries."""
        self.view_lag = Gauge(
            "mmreuse_proxy_view_lag_seconds",
            "age of the last KV-event batch applied, when it was applied (publisher clock)",
            ["instance"],
            registry=r,
        )
        self.hash_verified = Gauge(
            "mmreuse_proxy_hash_blocks_verified",
            "P's BlockStored blocks re-hashed by the proxy and found equal",
            ["instance"],
            registry=r,
        )
        self.hash_mismatches = Gauge(
            "mmreuse_proxy_hash_config_mismatches",
            "P's BlockStored blocks the proxy hashes differently: its --hash-algo, --hash-seed "
            "or --block-size differs from P's (the view is then not used)",
            ["instance"],
            registry=r,
        )
        self.fallbacks = Counter(
            "mmreuse_proxy_fallbacks_total",
            "fallbacks: kv_short (P's prefix hit was shorter than planned: it used its own "
            "encoder cache, connector or encoder for a skipped item), retry (a decode 500, "
            "everything re-encoded), no_plan (render, planning or the demand query failed: E "
            "got everything)",
            ["instance", "kind"],
            registry=r,
        )
        self.embedding_lost_retries = Counter(
            "mmreuse_proxy_embedding_lost_retries_total",
            "requests P (or PD) failed because the embedding store lost an item P had only as "
            "E's reference (vLLM's request-level error; MooncakeStoreConnector's "
            "take_unavailable_requests), retried once: E encodes it again and P gets it raw "
            "with its uuid. stage: where the failure showed (prefill: E + P + D's P; decode: "
            "a 500; stream: the error event of a 200 stream before its first token)",
            ["instance", "stage"],
            registry=r,
        )
        self.blind_decisions = Counter(
            "mmreuse_proxy_blind_decisions_total",
            "index decisions planned on a view that was not complete (the proxy joined late or "
            "lost batches its replay could not fill): what P cached before is unknown to it",
            ["instance"],
            registry=r,
        )

    def _instances(self, r: CollectorRegistry) -> None:
        """Which backends are up, as their requests found them (`proxy.failover`)."""
        self.instance_up = Gauge(
            "mmreuse_proxy_instance_up",
            "1 while an instance takes requests, 0 while it is ejected (its connection was "
            "refused or reset, or it stalled; back once its /health answers), by role and instance",
            ["role", "instance"],
            registry=r,
        )
        self.ejections = Counter(
            "mmreuse_proxy_ejections_total",
            "times an instance was ejected after a failed connection, by role and instance",
            ["role", "instance"],
            registry=r,
        )
        self.failovers = Counter(
            "mmreuse_proxy_failovers_total",
            "sub-requests sent to another instance of their role after theirs failed",
            ["role"],
            registry=r,
        )

    def _runtime(self, r: CollectorRegistry) -> None:
        """The process (memory, descriptors, CPU: prometheus_client's standard names, as vLLM
        exports them), its asyncio tasks and its pooled connections, read at each scrape:
        what a soak watches stay flat. `watch_runtime` binds the last two."""
        ProcessCollector(registry=r)
        self.tasks = Gauge(
            "mmreuse_proxy_tasks", "asyncio tasks alive in the proxy's event loop", registry=r
        )
        self.upstream_connections = Gauge(
            "mmreuse_proxy_upstream_connections",
            "the proxy's connections to E, P and D for requests: idle (pooled) or busy",
            ["state"],
            registry=r,
        )

    def watch_runtime(
        self, loop: asyncio.AbstractEventLoop, connections: Callable[[], tuple[int, int]]
    ) -> None:
        """Read `loop`'s task count and `connections()` (idle, busy) at each scrape."""
        self.tasks.set_function(lambda: len(asyncio.all_tasks(loop)))
        self.upstream_connections.labels("idle").set_function(lambda: connections()[0])
        self.upstream_connections.labels("busy").set_function(lambda: connections()[1])

    def instance_changed(self, role: str, instance: str, up: bool) -> None:
        """An instance ejected (`up` False) or back."""
        self._child(self.instance_up, role, instance).set(int(up))
        if not up:
            self._child(self.ejections, role, instance).inc()

    def _inputs(self, r: CollectorRegistry) -> None:
        """What the proxy stripped, fetched or failed on, and its embedding-store queries."""
        self.client_fields_stripped = Counter(
            "mmreuse_proxy_client_fields_stripped_total",
            "requests whose client-sent field was removed before E, P and D saw it "
            "(ec_transfer_params, kv_transfer_params: the proxy's own channel to P and D)",
            ["field"],
            registry=r,
        )
        self.media_fetched = Counter(
            "mmreuse_proxy_media_fetched_bytes_total",
            "bytes of http(s) media fetched by the proxy and forwarded inline (--uuid-policy "
            "content)",
            registry=r,
        )
        self.errors = Counter(
            "mmreuse_proxy_errors_total",
            "errors by stage (media, arrival, render, plan, demand, encode, prefill, decode, "
            "deadline: --request-timeout passed, proxy)",
            ["stage"],
            registry=r,
        )
        self.e_store_queries = Counter(
            "mmreuse_proxy_e_store_queries_total",
            "queries to the shared embedding store (--e-store-url) by outcome: ok, timeout, "
            "unreachable, http_error, junk (an answer that is not one); all but ok plan the "
            "request without the store",
            ["outcome"],
            registry=r,
        )

    def _demand_and_arrival(self, r: CollectorRegistry) -> None:
        """Demand queries, opportunistic outcomes and the split at arrival."""
        self.demand_answers = Counter(
            "mmreuse_proxy_demand_answers_total",
            "demand queries (demand, opportunistic) by instance and outcome: ok, timeout, error "
            "(P's DemandError), malformed (an answer not valid for its query), refused (too "
            "many in flight, or the client closed)",
            ["instance", "outcome"],
            registry=r,
        )
        self.demand_rtt = Histogram(
            "mmreuse_proxy_demand_rtt_seconds",
            "a demand query's round trip, from sending it to P's answer (answered queries)",
            ["instance"],
            buckets=_BUCKETS,
            registry=r,
        )
        self.demand_dropped = Counter(
            "mmreuse_proxy_demand_frames_dropped_total",
            "frames from P's demand endpoint dropped: unknown_id (no query in flight by that "
            "id: late, or never asked), malformed (not an answer)",
            ["instance", "reason"],
            registry=r,
        )
        self.opportunistic_outcomes = Counter(
            "mmreuse_proxy_opportunistic_total",
            "opportunistic requests by outcome: answer_won (P's answer abandoned >= 1 E "
            "sub-request in flight), answer_no_gain (in time, but every sub-request in flight "
            "was needed), answer_late (E was done first), answer_failed (no usable answer)",
            ["outcome"],
            registry=r,
        )
        self.e_abandoned = Counter(
            "mmreuse_proxy_encoder_items_abandoned_total",
            "media items sent to E whose sub-request was abandoned in flight (opportunistic: "
            "P's answer ruled them out); also counted as sent",
            registry=r,
        )
        self.arrival_items = Counter(
            "mmreuse_proxy_arrival_items_total",
            "index / demand: media items at arrival, before any render: e_now (held nowhere the "
            "chosen P could use: sent to E at once, or sharing one so sent), waited (waited for "
            "the render and the plan, or P's answer), p_raw (sent to P raw at arrival beside new "
            "ones: --mixed-plan arrival), p_encodes (a request's one new item sent to P's "
            "encoder instead of E: --encode-on-p single), p_stored (a request with no new item, "
            "every one in the store, sent as E's kept references: --held-items reference)",
            ["action"],
            registry=r,
        )
        self.held_items = Counter(
            "mmreuse_proxy_held_items_total",
            "--held-items reference: media items sent to P as held (planned, or P's answer), "
            "by instance and form: reference (E's metadata kept from the request that had it "
            "encoded), raw (the media with its uuid: no metadata kept, or not placed where P "
            "serves a reference: its KV or the store)",
            ["instance", "form"],
            registry=r,
        )
        self.arrival_requests = Counter(
            "mmreuse_proxy_arrival_requests_total",
            "index / demand: requests with media by their split at arrival: all_new (every "
            "item went to E at once; not rendered), split (some did), none_new (every item "
            "waited), whole (not split: processor kwargs, or unplannable uuids / salt)",
            ["split"],
            registry=r,
        )

    def request(self, policy: str, outcome: str) -> Any:
        return self._child(self.requests, policy, outcome)

    def blind(self, instance: str) -> Any:
        return self._child(self.blind_decisions, instance)

    def stripped(self, field: str) -> Any:
        return self._child(self.client_fields_stripped, field)

    def occurrence(self, klass: str) -> Any:
        return self._child(self.occurrences, klass)

    def arrival_split(self, split: str) -> Any:
        return self._child(self.arrival_requests, split)

    def opportunistic(self, outcome: str) -> Any:
        return self._child(self.opportunistic_outcomes, outcome)

    def demand_outcome(self, instance: str, outcome: str, rtt_s: float | None) -> None:
        """A DemandClient's `observe`: one query's outcome, and its round trip if answered."""
        self._child(self.demand_answers, instance, outcome).inc()
        if rtt_s is not None:
            self._child(self.demand_rtt, instance).observe(rtt_s)

    def demand_drop(self, instance: str, reason: str) -> None:
        self._child(self.demand_dropped, instance, reason).inc()

    def _child(self, metric: Any, *labels: str) -> Any:
        key = (metric._name, *labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child


def sample_sum(text: str, name: str, **labels: str) -> float:
    """The sum of `name`'s samples whose labels include `labels`, in a /metrics exposition."""
    from prometheus_client.parser import text_string_to_metric_families

    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items())
    )
