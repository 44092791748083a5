"""`mmreuse proxy` flags: the reference proxy's static-mode flags (same names, defaults and
meaning) plus the demand-aware ones. One frozen `ProxyConfig` is what the app runs on.

Every rule is checked once, by the records (`ProxyConfig`, `PrefillInstance`, `EncodeInstance`),
so a configuration built in code is held to the same rules as one from flags. A broken rule
raises `ConfigError`, whose message names fields; the parser only maps flags to fields (the
tables below, one per section: serving, media, the reference's own, planning, views, store) and
reports a record's error naming the flags instead (`FLAGS`, field -> flag). It refuses itself
only what the records cannot see: a flag's entries that do not align with the URLs or are all
empty, and a blank `--allowed-media-domains` entry (shown as written)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, NoReturn

from ..decision import POLICIES, ROUTINGS, Policy, Routing, parse_policy
from ..errors import ConfigError, InvalidArgument, field_name
from ..hashing.functions import HASH_FUNCTIONS
from .content import MediaLimits, parse_networks
from .media import DEFAULT_MM_LIMIT

MAX_WORKERS = 64
MIN_WORKER_STALL_S = 1.0  # --worker-stall-timeout: below this, a busy loop is no stall
# The largest request body (--max-body-bytes): vLLM's per-request media budget
# (VLLM_MAX_MEDIA_REQUEST_DOWNLOAD_SIZE_MB=256), since inline media is what makes a body large.
DEFAULT_MAX_BODY_BYTES = 256 << 20
# What of a body is decoded (proxy.body): its JSON values (an object's member counting as one)
# and its bytes that are not inline media. At these, the decode of the worst body holds the
# event loop well under 0.1 s (BENCHMARKS.md, "The longest loop stall one request causes").
DEFAULT_MAX_BODY_VALUES = 1 << 17
DEFAULT_MAX_BODY_TEXT_BYTES = 8 << 20
_NO_PREFILL = ("disable", "none", "")
_UNSUPPORTED = {
    "--dynamic-registration": "dynamic registration (POST /instances)",
    "--probe-interval": "dynamic registration's probing",
    "--probe-timeout": "dynamic registration's probing",
    "--fail-threshold": "dynamic registration's probing",
    "--evicted-ttl": "dynamic registration's probing",
    "--ec-consumer-zmq-addrs": "Mooncake EC push",
    "--ec-consumer-dp-size": "Mooncake EC push with data-parallel consumers",
}
_ZMQ = ("tcp://", "ipc://", "inproc://")
_HTTP = ("http://", "https://")


class UuidPolicy(StrEnum):
    """--uuid-policy: how items are named for E and P. reference (the reference proxy's rule),
    tenant (namespaced by cache_salt) or content (named by the media bytes, namespaced by
    cache_salt)."""

    REFERENCE = "reference"
    TENANT = "tenant"
    CONTENT = "content"


UUID_POLICIES: tuple[str, ...] = tuple(p.value for p in UuidPolicy)


class MixedPlan(StrEnum):
    """--mixed-plan (index, demand): a request that sends some items to E at arrival and may
    hold the others (a later chat turn with a new image). render: the others wait for the
    render and the plan (or P's answer), which run while E encodes; arrival: decided at
    arrival, the others go to P raw with their uuid (vLLM's own order serves each, or P
    encodes it itself): no render on the request's path."""

    RENDER = "render"
    ARRIVAL = "arrival"


class EncodeOnP(StrEnum):
    """--encode-on-p (index, demand): never (every item to encode goes to E); single: a request
    whose one item, new, would go to E at arrival goes to P raw instead, and P's encoder
    encodes it (as SGLang's --enable-adaptive-dispatch-to-encoder): no E visit, no transfer."""

    NEVER = "never"
    SINGLE = "single"


class HeldItems(StrEnum):
    """--held-items (index, demand, opportunistic): how P gets an item it was planned to hold.
    raw: the media with its uuid (P fetches and decodes it again; any EC connector);
    reference: E's metadata from the request that had it encoded (`HeldReferences`), as the
    reference proxy sends every item, so P does no media work for it. A reference P cannot
    serve must fail its request (mmreuse's MooncakeStoreConnector does), which the proxy
    retries with the media; an EC connector that would encode nothing instead must not be
    used with it."""

    RAW = "raw"
    REFERENCE = "reference"


# Each field's flag (or environment variable), for the CLI's messages. `instances.demand`:
# the `demand` field of every PrefillInstance (`instances[i].demand`); `media.fetch.*`:
# MediaLimits'; the others a section's field (`serving.port`).
FLAGS: Mapping[str, str] = {
    "encode_urls": "--encode-servers-urls",
    "decode_urls": "--decode-servers-urls",
    "prefill_urls": "--prefill-servers-urls",
    "serving.host": "--host",
    "serving.port": "--port",
    "serving.metrics_port": "--metrics-port",
    "serving.metrics_host": "--metrics-host",
    "serving.workers": "--workers",
    "serving.worker_stall_timeout": "--worker-stall-timeout",
    "serving.encode_timeout_s": "--encode-timeout",
    "serving.prefill_timeout_s": "--prefill-timeout",
    "serving.request_timeout_s": "--request-timeout",
    "serving.decode_retries": "--decode-retries",
    "serving.no_rewrite": "--no-rewrite",
    "media.uuid_policy": "--uuid-policy",
    "serving.log_requests": "--log-requests",
    "serving.encoder_max_batch_size": "ENCODER_MAX_BATCH_SIZE",
    "planning.policy": "--policy",
    "planning.routing": "--routing",
    "planning.mixed_plan": "--mixed-plan",
    "planning.encode_on_p": "--encode-on-p",
    "planning.held_items": "--held-items",
    "planning.render_url": "--render-url",
    "planning.render_timeout_s": "--render-timeout",
    "views.hash_algo": "--hash-algo",
    "views.hash_seed": "--hash-seed",
    "views.block_size": "--block-size",
    "store.e_cache_items": "--e-cache-items",
    "store.e_cache_ttl_s": "--e-cache-ttl",
    "views.demand_timeout_s": "--demand-timeout",
    "store.url": "--e-store-url",
    "store.namespace": "--e-store-namespace",
    "store.timeout_s": "--e-store-timeout",
    "media.limit_mm_per_prompt": "--limit-mm-per-prompt",
    "media.max_body_bytes": "--max-body-bytes",
    "media.max_body_values": "--max-body-values",
    "media.max_body_text_bytes": "--max-body-text-bytes",
    "serving.backend_keep_alive_s": "VLLM_HTTP_TIMEOUT_KEEP_ALIVE",
    "serving.api_key": "OPENAI_API_KEY",
    "instances.kv_events": "--kv-events-endpoints",
    "instances.kv_replay": "--kv-events-replay-endpoints",
    "instances.ec_events": "--encoder-cache-events-endpoints",
    "instances.ec_replay": "--encoder-cache-events-replay-endpoints",
    "instances.demand": "--demand-endpoints",
    "encoders.ec_events": "--e-cache-events-endpoints",
    "encoders.ec_replay": "--e-cache-events-replay-endpoints",
    "encoders.snapshot": "--e-snapshot-endpoints",
    "media.fetch.max_item_bytes": "--media-max-bytes",
    "media.fetch.timeout_s": "--media-fetch-timeout",
    "media.fetch.request_timeout_s": "--media-request-timeout",
    "media.fetch.max_redirects": "--media-max-redirects",
    "media.fetch.allowed_domains": "--allowed-media-domains",
    "media.fetch.private_networks": "--allow-private-media-networks",
}
# A record's own name in a field path: PrefillInstance.demand is `instances.demand` in FLAGS.
_RECORDS = {
    "PrefillInstance": "instances",
    "EncodeInstance": "encoders",
    "MediaLimits": "media.fetch",
}


def _flag_name(key: str, flags: Mapping[str, str] = FLAGS) -> str:
    """A field path as the CLI reads it: its flag (`flags`), with `: entry i` for one
    instance's slot in an aligned flag; the field's own name where it has no flag."""
    parts = key.split("/")
    name = ".".join(_RECORDS.get(p, p) for p in parts if p != "*" and not p.isdigit())
    flag = flags.get(name)
    if flag is None:
        return field_name(key)
    index = [p for p in parts if p.isdigit()]
    return f"{flag}: entry {index[0]}" if index else flag


def in_flags(error: InvalidArgument, flags: Mapping[str, str] = FLAGS) -> str:
    """`error`'s message naming the CLI's flags: a ConfigError's own, and MediaLimits'
    (`MediaLimits.max_item_bytes must be >= 1, got 0`) as `--media-max-bytes=0 must be >= 1`."""
    if isinstance(error, ConfigError):
        return error.named(lambda key: _flag_name(key, flags))

    def media(m: re.Match[str]) -> str:
        flag = FLAGS.get(f"media.fetch.{m[1]}")
        return m[0] if flag is None else f"{flag}={m[3]} must be {m[2]}"

    return re.sub(r"MediaLimits\.(\w+) must be (.*), got (.*)", media, str(error))


def _g(x: object) -> str:
    """A number as the CLI shows it (`-1`, `0.5`, `inf`); anything else as its repr."""
    return f"{x:g}" if type(x) is float else repr(x)


def _is_number(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


def _positive(x: object) -> bool:
    """A finite number > 0."""
    return _is_number(x) and math.isfinite(x) and x > 0  # type: ignore[arg-type,operator]


def _at_least(x: object, least: int) -> bool:
    """An int (not a bool) >= `least`."""
    return type(x) is int and x >= least


def _check_endpoint(key: str, ep: object) -> None:
    """A ZMQ endpoint the subscribers and the demand client can use: tcp://HOST:PORT (PORT a
    number, or * to bind any), ipc://PATH or inproc://NAME; refused here, not at start-up."""
    if not isinstance(ep, str) or not ep.startswith(_ZMQ):
        raise ConfigError(f"{{{key}}}: {{ep!r}} is not a ZMQ endpoint ({', '.join(_ZMQ)})", ep=ep)
    scheme, _, rest = ep.partition("://")
    if scheme != "tcp":
        if not rest:
            raise ConfigError(f"{{{key}}}: {{ep!r}} names no {scheme} address", ep=ep)
        return
    host, colon, port = rest.rpartition(":")
    if not colon or not host or not (port == "*" or (port.isdigit() and 0 < int(port) < 65536)):
        raise ConfigError(
            f"{{{key}}}: {{ep!r}} is not tcp://HOST:PORT with PORT in 1..65535", ep=ep
        )


def _check_endpoints(record: Any, name: str, pairs: Sequence[tuple[str, str]]) -> None:
    """Every endpoint field of `record` (a ZMQ endpoint or None), and each (replay, events)
    pair: a replay endpoint without the events it replays is refused."""
    for f in dataclasses.fields(record):
        ep = getattr(record, f.name)
        if f.name != "url" and ep is not None:
            _check_endpoint(f"{name}/{f.name}", ep)
    for needs, given in pairs:
        if getattr(record, needs) is not None and getattr(record, given) is None:
            raise ConfigError(
                f"{{{name}/{needs}}} needs {{{name}/{given}}} (for {{url}})", url=record.url
            )


def _choice(kind: type[StrEnum], key: str, value: object) -> Any:
    """`value` as a member of `kind`, or a ConfigError naming `key`."""
    if isinstance(value, str) and value in {m.value for m in kind}:
        return kind(value)
    raise ConfigError(
        f"{{{key}}}={{v!r}} must be one of {', '.join(m.value for m in kind)}", v=value
    )


@dataclass(frozen=True, slots=True)
class PrefillInstance:
    """One instance that prefills (a P, or a PD in E + PD) and its mmreuse endpoints, from the
    flags aligned with its URL (`--kv-events-endpoints` etc.; None: an empty slot, or the flag
    not given)."""

    url: str
    kv_events: str | None = None  # --kv-events-endpoints: its live KV view
    kv_replay: str | None = None  # --kv-events-replay-endpoints
    ec_events: str | None = None  # --encoder-cache-events-endpoints: P-local reuse
    ec_replay: str | None = None  # --encoder-cache-events-replay-endpoints
    demand: str | None = None  # --demand-endpoints: its DemandScheduler (demand, opportunistic)

    def __post_init__(self) -> None:
        _check_endpoints(
            self, "PrefillInstance", (("kv_replay", "kv_events"), ("ec_replay", "ec_events"))
        )


@dataclass(frozen=True, slots=True)
class EncodeInstance:
    """One E and its mmreuse endpoints, from the flags aligned with its URL: its encoder-cache
    events (EventfulEncoderCacheManager in E) make the E side a fact every proxy replica that
    follows them shares; its DemandScheduler's endpoint serves their snapshot."""

    url: str
    ec_events: str | None = None  # --e-cache-events-endpoints
    ec_replay: str | None = None  # --e-cache-events-replay-endpoints
    snapshot: str | None = None  # --e-snapshot-endpoints: E's encoder-cache snapshot endpoint

    def __post_init__(self) -> None:
        _check_endpoints(
            self, "EncodeInstance", (("ec_replay", "ec_events"), ("snapshot", "ec_events"))
        )


@dataclass(frozen=True, slots=True)
class ServingConfig:
    """How the proxy serves and calls its backends (`_SERVING`, the reference's own flags, and
    vLLM's environment)."""

    host: str = "0.0.0.0"
    port: int = 8000
    # --metrics-port / --metrics-host: /metrics and the detailed /health on their own address
    # (they expose per-instance cache facts); None: both on --port, as before
    metrics_port: int | None = None
    metrics_host: str | None = None
    # --workers: processes sharing --port (SO_REUSEPORT), each a replica with its own views
    workers: int = 1
    # --worker-stall-timeout: a worker whose event loop has not turned for this long is killed
    # and started again (0: never)
    worker_stall_timeout: float = 30.0
    # --encode-timeout: an E sub-request not answered within it ejects its E and goes once to
    # another (0: none, as the reference)
    encode_timeout_s: float = 0.0
    # --prefill-timeout: E + P + D's prefill not answered within it ejects its P and goes once
    # to another (0: none, as the reference)
    prefill_timeout_s: float = 0.0
    # --request-timeout: a request not answered within it ends with a 504 (a stream already
    # begun: with an error event); E's and P's bounds default to half of it (0: none)
    request_timeout_s: float = 0.0
    log_requests: bool = False
    decode_retries: int = 1
    no_rewrite: bool = False
    encoder_max_batch_size: int = 0  # ENCODER_MAX_BATCH_SIZE
    # VLLM_HTTP_TIMEOUT_KEEP_ALIVE (vLLM's env, 5 s by default): how long E, P and D keep an idle
    # connection; the proxy retires its own sooner (0: no pooling)
    backend_keep_alive_s: float = 5.0
    # OPENAI_API_KEY: the bearer token /start_profile and /stop_profile send E, P and D
    api_key: str = field(default="", repr=False)

    def __post_init__(self) -> None:
        if not (_at_least(self.port, 1) and self.port < 65536):
            raise ConfigError("{serving/port}={v!r} is not a TCP port", v=self.port)
        if self.metrics_port is not None:
            if not (_at_least(self.metrics_port, 1) and self.metrics_port < 65536):
                raise ConfigError(
                    "{serving/metrics_port}={v!r} is not a TCP port", v=self.metrics_port
                )
            if self.metrics_port == self.port:
                raise ConfigError(
                    "{serving/metrics_port}={v!r} is {serving/port}'s: give another", v=self.port
                )
        elif self.metrics_host is not None:
            raise ConfigError(
                "{serving/metrics_host} without {serving/metrics_port}: give the port too"
            )
        if not (_at_least(self.workers, 1) and self.workers <= MAX_WORKERS):
            raise ConfigError(
                "{serving/workers}={v!r} must be in 1..{n}, an int", v=self.workers, n=MAX_WORKERS
            )
        if self.workers > 1 and self.metrics_port is None:
            raise ConfigError(
                "{serving/workers}={v!r} needs {serving/metrics_port}: a scrape of "
                "{serving/port} would reach one worker; {serving/metrics_port} serves every "
                "worker's /metrics and /health",
                v=self.workers,
            )
        stall = self.worker_stall_timeout
        if not (_is_number(stall) and (stall == 0 or MIN_WORKER_STALL_S <= stall < math.inf)):
            raise ConfigError(
                "{serving/worker_stall_timeout}={v} must be 0 (never) or seconds, at least "
                "{least}: a worker busy for less is not stalled",
                v=_g(stall),
                least=f"{MIN_WORKER_STALL_S:g}",
            )
        if not _at_least(self.decode_retries, 0):
            raise ConfigError(
                "{serving/decode_retries}={v!r} must be an int >= 0", v=self.decode_retries
            )
        for key in ("encode_timeout_s", "prefill_timeout_s", "request_timeout_s"):
            timeout = getattr(self, key)
            if not (_is_number(timeout) and math.isfinite(timeout) and timeout >= 0):
                raise ConfigError(
                    f"{{serving/{key}}}={{v}} must be seconds >= 0 (0: none)", v=_g(timeout)
                )
        if not _at_least(self.encoder_max_batch_size, 0):
            raise ConfigError(
                "{serving/encoder_max_batch_size}={v!r} must be non-negative",
                v=self.encoder_max_batch_size,
            )
        keep = self.backend_keep_alive_s
        if not (_is_number(keep) and math.isfinite(keep) and keep >= 0):
            raise ConfigError("{serving/backend_keep_alive_s}={v!r} must be seconds >= 0", v=keep)

    @property
    def encode_bound_s(self) -> float:
        """How long an E may take to answer a sub-request before it is taken for stalled:
        --encode-timeout, else half of --request-timeout (room for the failover try), else
        0 (no bound)."""
        return self.encode_timeout_s or self.request_timeout_s / 2

    @property
    def prefill_bound_s(self) -> float:
        """As `encode_bound_s`, for E + P + D's prefill (--prefill-timeout)."""
        return self.prefill_timeout_s or self.request_timeout_s / 2
        if not isinstance(self.api_key, str):
            raise ConfigError(
                "{serving/api_key} must be a str, got a {t}", t=type(self.api_key).__name__
            )


@dataclass(frozen=True, slots=True)
class MediaConfig:
    """How items are named, what --uuid-policy content fetches, and what one request may carry
    (`_MEDIA`)."""

    uuid_policy: UuidPolicy = UuidPolicy.REFERENCE  # --uuid-policy: how items are named for E and P
    # What --uuid-policy content fetches. None: not set, MediaLimits' defaults under content; under
    # another policy nothing is fetched, and limits set anyway (even to the defaults) are refused.
    fetch: MediaLimits | None = None
    # --limit-mm-per-prompt: the media items of a modality one request may carry (vLLM's flag
    # and default: 999 for a modality not named), refused before any per-item work
    limit_mm_per_prompt: Mapping[str, int] = field(default_factory=dict)
    # --max-body-bytes: the largest request body read (inline base64 media included)
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    # --max-body-values / --max-body-text-bytes: what of a body may be decoded (its JSON values;
    # its bytes other than inline media), refused with a 400 before anything is decoded
    max_body_values: int = DEFAULT_MAX_BODY_VALUES
    max_body_text_bytes: int = DEFAULT_MAX_BODY_TEXT_BYTES

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "uuid_policy", _choice(UuidPolicy, "media/uuid_policy", self.uuid_policy)
        )
        for key in ("max_body_bytes", "max_body_values", "max_body_text_bytes"):
            if not _at_least(getattr(self, key), 1):
                raise ConfigError(
                    f"{{media/{key}}}={{v!r}} must be an int >= 1", v=getattr(self, key)
                )
        for modality, limit in self.limit_mm_per_prompt.items():
            if not (isinstance(modality, str) and _at_least(limit, 0)):
                raise ConfigError(
                    "{media/limit_mm_per_prompt}[{m!r}]={v!r} must be an int >= 0 per "
                    "modality name",
                    m=modality,
                    v=limit,
                )
        object.__setattr__(self, "limit_mm_per_prompt", dict(self.limit_mm_per_prompt))
        self._check_fetch()

    def _check_fetch(self) -> None:
        """What --uuid-policy content fetches (its defaults where not set): bounds set under
        another policy do nothing, whatever their values, so they are refused."""
        fetch = self.fetch
        if fetch is not None and not isinstance(fetch, MediaLimits):
            raise ConfigError("{media/fetch} must be a MediaLimits or None, got {v!r}", v=fetch)
        if self.uuid_policy != UuidPolicy.CONTENT:
            if fetch is not None:
                raise ConfigError(
                    "{media/fetch} bounds what {media/uuid_policy} content fetches: it does "
                    "nothing under {media/uuid_policy} {p}",
                    p=self.uuid_policy.value,
                )
            return
        if fetch is None:
            fetch = MediaLimits()
            object.__setattr__(self, "fetch", fetch)
        domains = fetch.allowed_domains
        if domains is not None and any("/" in d or ":" in d for d in domains):
            raise ConfigError(
                "{media/fetch/allowed_domains}: {v!r} must be host names (no scheme, port or path)",
                v=sorted(domains),
            )


@dataclass(frozen=True, slots=True)
class PlanningConfig:
    """What decides each request (`_PLANNING`): the policy and its options, the render."""

    policy: Policy = Policy.EAGER
    routing: Routing = Routing.RANDOM
    mixed_plan: MixedPlan = MixedPlan.RENDER
    encode_on_p: EncodeOnP = EncodeOnP.NEVER
    held_items: HeldItems = HeldItems.RAW
    render_url: str | None = None
    # a slow render costs the plan (E gets everything), not the request
    render_timeout_s: float = 10.0
    seed: int | None = None  # the routing RNG's seed (tests); None = system entropy

    def __post_init__(self) -> None:
        object.__setattr__(self, "policy", parse_policy(self.policy, "planning.policy"))
        for key, kind in (
            ("routing", Routing),
            ("mixed_plan", MixedPlan),
            ("encode_on_p", EncodeOnP),
            ("held_items", HeldItems),
        ):
            object.__setattr__(self, key, _choice(kind, f"planning/{key}", getattr(self, key)))
        splits = self.policy in (Policy.INDEX, Policy.DEMAND)
        for key, value in (("mixed_plan", MixedPlan.RENDER), ("encode_on_p", EncodeOnP.NEVER)):
            if getattr(self, key) is not value and not splits:
                raise ConfigError(
                    f"{{planning/{key}}} {{v}} acts on the split at arrival: {{planning/policy}} "
                    "index or demand, got {p}",
                    v=getattr(self, key).value,
                    p=self.policy.value,
                )
        if self.render_url is not None and not (
            isinstance(self.render_url, str) and self.render_url.startswith(_HTTP)
        ):
            raise ConfigError(
                "{planning/render_url}: {u!r} is not an http(s) URL", u=self.render_url
            )
        if not (_is_number(self.render_timeout_s) and self.render_timeout_s > 0):
            raise ConfigError(
                "{planning/render_timeout_s}={v!r} must be > 0", v=self.render_timeout_s
            )
        if self.seed is not None and type(self.seed) is not int:
            raise ConfigError("{planning/seed}={v!r} must be an int or None", v=self.seed)


@dataclass(frozen=True, slots=True)
class ViewsConfig:
    """How the proxy follows P (`_VIEWS`, less the per-instance endpoints): P's hashing as the
    proxy reproduces it, and how long P's answer may take."""

    hash_algo: str = "sha256"
    hash_seed: str | None = None
    block_size: int | None = None  # None: learned from each instance's BlockStored events
    # a demand query (demand, opportunistic) not answered within it costs the plan
    demand_timeout_s: float = 1.0

    def __post_init__(self) -> None:
        algo, seed = self.hash_algo, self.hash_seed
        if algo not in HASH_FUNCTIONS:
            raise ConfigError(
                "{views/hash_algo}={v!r} must be one of {names}",
                v=algo,
                names=", ".join(sorted(HASH_FUNCTIONS)),
            )
        if seed is not None and not isinstance(seed, str):
            raise ConfigError("{views/hash_seed}={v!r} must be a str (PYTHONHASHSEED)", v=seed)
        if seed is not None and algo.endswith("_cbor"):
            try:  # a non-UTF-8 argv byte arrives as a lone surrogate, which CBOR cannot hash
                seed.encode("utf-8")
            except UnicodeEncodeError as e:
                try:  # the bytes given, where argv's decoding escaped them
                    shown = repr(seed.encode("utf-8", "surrogateescape"))
                except UnicodeEncodeError:
                    shown = ascii(seed)
                raise ConfigError(
                    "{views/hash_seed} {shown} is not UTF-8 (at character {at}): "
                    "{views/hash_algo} {algo} hashes the seed as UTF-8 text, as vLLM does "
                    "PYTHONHASHSEED",
                    shown=shown,
                    at=e.start,
                    algo=algo,
                ) from None
        if algo.startswith("xxhash") and seed is None:
            raise ConfigError(
                "{views/hash_algo} {algo} needs {views/hash_seed}: without PYTHONHASHSEED vLLM "
                "seeds xxhash randomly per process, so no proxy can reproduce its hashes",
                algo=algo,
            )
        if self.block_size is not None and not _at_least(self.block_size, 1):
            raise ConfigError("{views/block_size}={v!r} must be an int >= 1", v=self.block_size)
        if not _positive(self.demand_timeout_s):
            raise ConfigError(
                "{views/demand_timeout_s}={v!r} must be a finite number > 0",
                v=self.demand_timeout_s,
            )


@dataclass(frozen=True, slots=True)
class StoreConfig:
    """What E and the shared store hold, as the proxy learns it (`_STORE`): the store asked per
    request, and the proxy's own record of what E holds."""

    # --e-store-url / --e-store-namespace: the shared embedding store (a Mooncake master's
    # HTTP address) asked what it holds, per request (mmreuse.proxy.store); None: not asked
    url: str | None = None
    namespace: str | None = None
    timeout_s: float = 0.25
    e_cache_items: int = 4096
    e_cache_ttl_s: float = 3600.0

    def __post_init__(self) -> None:
        url, ns = self.url, self.namespace
        if (url is None) != (ns is None):
            raise ConfigError(
                "{store/url}={u!r} and {store/namespace}={n!r}: give both or neither", u=url, n=ns
            )
        if url is not None and not (isinstance(url, str) and url.startswith(_HTTP)):
            raise ConfigError("{store/url}={u!r} must be an http:// URL", u=url)
        if ns is not None and not (isinstance(ns, str) and ns):
            raise ConfigError("{store/namespace}={n!r} must be a non-empty str", n=ns)
        if not _positive(self.timeout_s):
            raise ConfigError(
                "{store/timeout_s}={v!r} must be a finite number > 0", v=self.timeout_s
            )
        if not _at_least(self.e_cache_items, 1):
            raise ConfigError(
                "{store/e_cache_items}={v!r} must be an int >= 1", v=self.e_cache_items
            )
        if not _positive(self.e_cache_ttl_s):
            raise ConfigError(
                "{store/e_cache_ttl_s}={v!r} must be a finite number > 0", v=self.e_cache_ttl_s
            )


@dataclass(frozen=True, slots=True)
class ProxyConfig:
    """Everything the proxy runs on: the instances, and one record per section, each checking
    itself; the rules across sections are checked here. `prefill_urls` empty = E + PD (the
    decode URLs prefill).

    `instances`: one record per instance that prefills, in the order of its URLs (the P URLs,
    or the PD URLs in E + PD); left empty, the URLs alone (no view, no demand endpoint).
    `encoders`: one record per E, in the order of `encode_urls` (left empty: the URLs alone, and
    the E side is the proxy's own record of what it sent).
    """

    encode_urls: tuple[str, ...]
    decode_urls: tuple[str, ...]
    prefill_urls: tuple[str, ...] = ()
    instances: tuple[PrefillInstance, ...] = ()
    encoders: tuple[EncodeInstance, ...] = ()
    serving: ServingConfig = field(default_factory=ServingConfig)
    media: MediaConfig = field(default_factory=MediaConfig)
    planning: PlanningConfig = field(default_factory=PlanningConfig)
    views: ViewsConfig = field(default_factory=ViewsConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    # The URLs of `instances`, in order (derived: what policy.Planner indexes by instance).
    prefill_instances: tuple[str, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for key, kind in _SECTIONS.items():
            if not isinstance(getattr(self, key), kind):
                raise ConfigError(
                    f"{{{key}}} must be a {kind.__name__}, got {{v!r}}", v=getattr(self, key)
                )
        self._check_urls()
        self._check_across()
        self._check_instances()
        self._check_encoders()

    def _check_urls(self) -> None:
        """E and D given, every URL http(s) (a P's too)."""
        if not self.encode_urls or not self.decode_urls:
            raise ConfigError("Static routing requires {encode_urls} and {decode_urls}")
        for key in ("encode_urls", "decode_urls", "prefill_urls"):
            for u in getattr(self, key):
                if not (isinstance(u, str) and u.startswith(_HTTP)):
                    raise ConfigError(f"{{{key}}}: {{u!r}} is not an http(s) URL", u=u)

    def _check_across(self) -> None:
        """The rules across sections: --no-rewrite and --held-items reference against the
        policy and the naming."""
        policy, no_rewrite = self.planning.policy, self.serving.no_rewrite
        if self.planning.held_items is HeldItems.REFERENCE and (
            policy is Policy.EAGER or no_rewrite
        ):
            raise ConfigError(
                "{planning/held_items} reference acts on the items a policy plans as held and "
                "on the rewrite: {planning/policy} index, demand or opportunistic without "
                "{serving/no_rewrite}, got {p}{nr}",
                p=policy.value,
                nr=" with --no-rewrite" if no_rewrite else "",
            )
        if no_rewrite and self.media.uuid_policy != UuidPolicy.REFERENCE:
            raise ConfigError(
                "{serving/no_rewrite} with {media/uuid_policy} {p}: {serving/no_rewrite} sends "
                "E no uuid, so the tenant's namespace would not reach P",
                p=self.media.uuid_policy.value,
            )
        if no_rewrite and policy != Policy.EAGER:
            raise ConfigError(
                "{serving/no_rewrite} with {planning/policy} {p}: P would get every item raw "
                "without its uuid, so its keys would not be the ones the plan used; use "
                "{planning/policy} eager",
                p=policy.value,
            )

    def _check_instances(self) -> None:
        """One record per instance that prefills, in order; each with its demand endpoint
        under the policies that ask P."""
        urls = self.prefill_urls or self.decode_urls
        instances = self.instances or tuple(PrefillInstance(u) for u in urls)
        if tuple(i.url for i in instances) != urls:
            raise ConfigError(
                "{instances} are for {have} but the instances that prefill are {urls} (the "
                "{which} URLs): one record each, in order",
                have=[i.url for i in instances],
                urls=list(urls),
                which="prefill" if self.prefill_urls else "decode",
            )
        if self.planning.policy.asks_p:
            for i, inst in enumerate(instances):
                if inst.demand is None:
                    raise ConfigError(
                        f"{{instances/{i}/demand}} (for {{url}}) is empty: {{planning/policy}} {{p}} "
                        "needs {instances/*/demand}, each P/PD's DemandScheduler endpoint; "
                        "{url} has no demand endpoint",
                        url=inst.url,
                        p=self.planning.policy.value,
                    )
        object.__setattr__(self, "instances", instances)
        object.__setattr__(self, "prefill_instances", urls)

    def _check_encoders(self) -> None:
        """One record per E, in order; E's encoder-cache events from every E or from none."""
        encoders = self.encoders or tuple(EncodeInstance(u) for u in self.encode_urls)
        if tuple(e.url for e in encoders) != self.encode_urls:
            raise ConfigError(
                "{encoders} are for {have} but the encode URLs are {urls}: one record each, "
                "in order",
                have=[e.url for e in encoders],
                urls=list(self.encode_urls),
            )
        if len({e.ec_events is None for e in encoders}) > 1:
            i = next(i for i, e in enumerate(encoders) if e.ec_events is None)
            raise ConfigError(
                f"{{encoders/{i}/ec_events}} (for {{url}}) is empty: encoder-cache events from "
                "some encoders only; give every E's {encoders/*/ec_events} or none (the E side "
                "is then this proxy's own record of what it sent)",
                url=encoders[i].url,
            )
        object.__setattr__(self, "encoders", encoders)

    @property
    def e_events(self) -> bool:
        """Whether the E side comes from E's encoder-cache events (shared by every replica)."""
        return bool(self.encoders) and self.encoders[0].ec_events is not None


# ProxyConfig's sections: field -> record.
_SECTIONS: Mapping[str, type] = {
    "serving": ServingConfig,
    "media": MediaConfig,
    "planning": PlanningConfig,
    "views": ViewsConfig,
    "store": StoreConfig,
}


def _mm_limits(value: str) -> dict[str, int]:
    """`--limit-mm-per-prompt`'s JSON, as vLLM reads it: per modality a count, or an object
    with its `count` (vLLM's configurable form; the dummy-data options are vLLM's own)."""
    try:
        raw = json.loads(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not JSON") from None
    if not isinstance(raw, dict):
        raise argparse.ArgumentTypeError(f"{value!r} must be a JSON object of modality -> count")
    out: dict[str, int] = {}
    for modality, limit in raw.items():
        count = limit.get("count", DEFAULT_MM_LIMIT) if isinstance(limit, dict) else limit
        if type(count) is not int or count < 0:
            raise argparse.ArgumentTypeError(f"{modality!r}: {limit!r} is not a count >= 0")
        out[modality] = count
    return out


_Flag = tuple[str, dict[str, Any]]  # a flag and its add_argument keywords

# How the proxy serves: its addresses, processes and logging.
_SERVING: tuple[_Flag, ...] = (
    ("--host", {"default": "0.0.0.0"}),
    ("--port", {"type": int, "default": 8000}),
    (
        "--metrics-port",
        {
            "type": int,
            "default": None,
            "help": "serve GET /metrics and the detailed GET /health (per-instance cache facts) on this "
            "port only; --port keeps a /health with the reference's fields. Default: both on --port",
        },
    ),
    (
        "--metrics-host",
        {"default": None, "help": "the address --metrics-port binds (default --host)"},
    ),
    (
        "--workers",
        {
            "type": int,
            "default": 1,
            "help": "worker processes sharing --port (SO_REUSEPORT; the kernel spreads connections), "
            "each a replica with its own views: how a proxy node uses its cores. A worker that "
            "dies is restarted and rejoins as a late replica does. Needs --metrics-port, where "
            '/metrics and /health are every worker\'s, labelled worker="i"',
        },
    ),
    (
        "--encode-timeout",
        {
            "type": float,
            "default": 0.0,
            "metavar": "SECONDS",
            "help": "an E sub-request not answered within this long (a stalled E) ejects that E "
            "and goes once to another E; it applies only while another E is up (a lone E is "
            "waited for). 0 (the default): no bound, as the reference",
        },
    ),
    (
        "--prefill-timeout",
        {
            "type": float,
            "default": 0.0,
            "metavar": "SECONDS",
            "help": "E + P + D: a prefill (max_tokens 1) not answered within this long (a stalled "
            "P) ejects that P and the request goes once to another P, as eager; it applies "
            "only while another P is up (a lone P is waited for). 0 (the default): no bound, "
            "as the reference",
        },
    ),
    (
        "--request-timeout",
        {
            "type": float,
            "default": 0.0,
            "metavar": "SECONDS",
            "help": "an end-to-end deadline per request: one not answered within this long ends "
            "with a 504 (a stream already begun ends with an error event, then [DONE]), and "
            "what still runs for it on E, P and D is cancelled (their connections closed: vLLM "
            "aborts the request). Where --encode-timeout or --prefill-timeout is not given, it "
            "is half of this, so a stalled E or P leaves time to fail over. 0 (the default): "
            "none, as the reference",
        },
    ),
    (
        "--worker-stall-timeout",
        {
            "type": float,
            "default": 30.0,
            "metavar": "SECONDS",
            "help": "with --workers > 1: a worker whose event loop has not turned for this long (a "
            "stalled worker keeps its share of --port's connections unanswered) is killed "
            f"(SIGKILL) and restarted. 0: never. At least {MIN_WORKER_STALL_S:g}; default 30",
        },
    ),
    (
        "--log-requests",
        {
            "action": "store_true",
            "help": "Log every request in and out, and raise the log level to DEBUG.",
        },
    ),
)
# How items are named, and what --uuid-policy content fetches; what one request may carry.
_MEDIA: tuple[_Flag, ...] = (
    (
        "--uuid-policy",
        {
            "choices": UUID_POLICIES,
            "default": "reference",
            "help": "how items are named for E and P (vLLM keys its encoder cache and EC store by "
            "uuid, across tenants): reference (the client's uuid, else sha256 of the URL: the "
            "reference proxy's rule), tenant (those namespaced by the request's cache_salt, a "
            "client's *_embeds uuids too: no tenant can reach another's embeddings) or content "
            "(sha256 of the media bytes, namespaced by cache_salt; http(s) media fetched by the "
            "proxy and forwarded inline, so a URL whose content changed is a new item)",
        },
    ),
    (
        "--allowed-media-domains",
        {
            "nargs": "+",
            "default": None,
            "help": "--uuid-policy content: the only hosts media (and each redirect) may be fetched "
            "from, as vLLM's flag of that name (default: any)",
        },
    ),
    (
        "--media-max-bytes",
        {
            "type": int,
            "default": None,
            "help": "--uuid-policy content: the most bytes one fetched item may have (default 32 MiB; "
            "a request's fetched media in all: 256 MiB, vLLM's "
            "VLLM_MAX_MEDIA_REQUEST_DOWNLOAD_SIZE_MB)",
        },
    ),
    (
        "--media-fetch-timeout",
        {
            "type": float,
            "default": None,
            "help": "--uuid-policy content: seconds one media fetch (each redirect hop) may take "
            "(default 5, vLLM's VLLM_IMAGE_FETCH_TIMEOUT)",
        },
    ),
    (
        "--media-request-timeout",
        {
            "type": float,
            "default": None,
            "help": "--uuid-policy content: seconds all of one request's media fetches may take "
            "(default 30)",
        },
    ),
    (
        "--media-max-redirects",
        {
            "type": int,
            "default": None,
            "help": "--uuid-policy content: redirects followed per item, each hop checked as the "
            "first URL (default 5; 0: none, as vLLM's VLLM_MEDIA_URL_ALLOW_REDIRECTS=0)",
        },
    ),
    (
        "--allow-private-media-networks",
        {
            "nargs": "+",
            "default": None,
            "metavar": "CIDR",
            "help": "--uuid-policy content: non-public networks media may be fetched from (default "
            "none: a host that is or resolves to a loopback, private, link-local, shared, "
            "reserved, multicast or unspecified address is refused; '0.0.0.0/0 ::/0' allows all)",
        },
    ),
    (
        "--limit-mm-per-prompt",
        {
            "type": _mm_limits,
            "default": {},
            "help": "the media items of each modality one request may carry, as vLLM's flag of that "
            """name ('{"image": 16, "video": 2}', or {"video": {"count": 2}}; 999 for a modality """
            "not named, vLLM's default): a request over it is refused before any per-item work",
        },
    ),
    (
        "--max-body-bytes",
        {
            "type": int,
            "default": DEFAULT_MAX_BODY_BYTES,
            "help": "the largest request body read, inline base64 media included (default 256 MiB, "
            "vLLM's per-request media download budget)",
        },
    ),
    (
        "--max-body-values",
        {
            "type": int,
            "default": DEFAULT_MAX_BODY_VALUES,
            "help": "the most JSON values a request body may hold, an object's member counting as "
            f"one (default {DEFAULT_MAX_BODY_VALUES}): a larger one is refused before it is decoded",
        },
    ),
    (
        "--max-body-text-bytes",
        {
            "type": int,
            "default": DEFAULT_MAX_BODY_TEXT_BYTES,
            "help": "the most bytes of a request body that are not inline media (default 8 MiB); "
            "inline media, any string of 64 KiB or more of plain ASCII (base64, data: URLs), is "
            "forwarded as it came and not counted: a larger one is refused before it is decoded",
        },
    ),
)
# The reference proxy's own flags (names, defaults and meaning).
_REFERENCE: tuple[_Flag, ...] = (
    (
        "--no-rewrite",
        {
            "action": "store_true",
            "help": "Forward media to the decoder unchanged and send E no uuid (stage-timing A/B).",
        },
    ),
    (
        "--encode-servers-urls",
        {"default": "", "help": 'Comma-separated encode URLs ("http://e1:8001,http://e2:8001")'},
    ),
    (
        "--prefill-servers-urls",
        {
            "default": "none",
            "help": 'Comma-separated prefill URLs to enable E->P->D; "disable" or "none" for E->PD',
        },
    ),
    (
        "--decode-servers-urls",
        {"default": "", "help": 'Comma-separated decode URLs ("http://d1:8005,http://d2:8006")'},
    ),
    (
        "--decode-retries",
        {
            "type": int,
            "default": 1,
            "help": "Re-encode and re-send when decode returns 500 (its retryable error). 0 disables.",
        },
    ),
)
# What E gets and which P/PD serves: the policy, its render and its question to P.
_PLANNING: tuple[_Flag, ...] = (
    (
        "--policy",
        {
            "choices": POLICIES,
            "default": "eager",
            "help": "eager: every item to E (the reference); index: E gets only what the chosen "
            "P/PD still needs, from its live KV view; demand: E gets only what the chosen P/PD "
            "says it needs (asked over --demand-endpoints); opportunistic: E gets everything at "
            "once, and what P's answer rules out is abandoned while still in flight",
        },
    ),
    (
        "--routing",
        {
            "choices": ROUTINGS,
            "default": "random",
            "help": "random: the reference's choice of P/PD; affine: the one with the longest live "
            "prefix hit (ties at random)",
        },
    ),
    (
        "--mixed-plan",
        {
            "choices": tuple(m.value for m in MixedPlan),
            "default": "render",
            "help": "index / demand, a request with new items and maybe-held ones: render (the "
            "maybe-held wait for the render and the plan, run while E encodes the new) or "
            "arrival (decided at arrival: the maybe-held go to P raw, P serves or encodes them)",
        },
    ),
    (
        "--encode-on-p",
        {
            "choices": tuple(m.value for m in EncodeOnP),
            "default": "never",
            "help": "index / demand: single sends a request whose one item, new, would go to E "
            "to P raw instead (P encodes it: no E visit, no transfer); never: E encodes",
        },
    ),
    (
        "--held-items",
        {
            "choices": tuple(m.value for m in HeldItems),
            "default": "raw",
            "help": "index / demand / opportunistic, an item the chosen P holds: raw (the media "
            "with its uuid; P decodes it again) or reference (E's metadata from the request that "
            "had it encoded: no media work on P; needs an EC connector that fails a reference it "
            "cannot load, as mmreuse's MooncakeStoreConnector does; such a request is retried "
            "with the media)",
        },
    ),
    (
        "--render-url",
        {
            "default": None,
            "help": "where to render requests (POST /v1/chat/completions/render, mm_payload none); "
            "default: the chosen P/PD (started with --enable-scale-out)",
        },
    ),
    (
        "--render-timeout",
        {
            "type": float,
            "default": 10.0,
            "help": "seconds a render may take; past it the request is served as under eager",
        },
    ),
)
# The proxy's views of P and E: their events, snapshots, P's hashing and E's record.
_VIEWS: tuple[_Flag, ...] = (
    (
        "--kv-events-endpoints",
        {
            "default": None,
            "help": "comma-separated ZMQ endpoints of the P (or PD) instances' KV events, aligned "
            "with their URLs (an empty slot: no view of that one)",
        },
    ),
    (
        "--kv-events-replay-endpoints",
        {"default": None, "help": "their replay endpoints, aligned the same way (optional)"},
    ),
    (
        "--encoder-cache-events-endpoints",
        {
            "default": None,
            "help": "comma-separated ZMQ endpoints of the P (or PD) instances' encoder-cache events "
            "(mmreuse's EventfulEncoderCacheManager), aligned with their URLs",
        },
    ),
    (
        "--encoder-cache-events-replay-endpoints",
        {"default": None, "help": "their replay endpoints, aligned the same way (optional)"},
    ),
    (
        "--demand-endpoints",
        {
            "default": None,
            "help": "comma-separated ZMQ endpoints of the P (or PD) instances' DemandScheduler "
            "(additional_config mmreuse.demand_endpoint), aligned with their URLs, one for each; "
            "required by --policy demand and opportunistic",
        },
    ),
    (
        "--demand-timeout",
        {
            "type": float,
            "default": 1.0,
            "help": "seconds P may take to answer a demand query; past it the request is served as "
            "under eager",
        },
    ),
    (
        "--hash-algo",
        {
            "choices": sorted(HASH_FUNCTIONS),
            "default": "sha256",
            "help": "P's --prefix-caching-hash-algo (vLLM's default: sha256)",
        },
    ),
    (
        "--hash-seed",
        {
            "default": None,
            "help": "P's PYTHONHASHSEED (default: unset, as vLLM without it; required for xxhash*)",
        },
    ),
    (
        "--block-size",
        {
            "type": int,
            "default": None,
            "help": "P's KV block size (default: learned from its BlockStored events)",
        },
    ),
    (
        "--e-cache-events-endpoints",
        {
            "default": None,
            "help": "comma-separated ZMQ endpoints of every E's encoder-cache events (mmreuse's "
            "EventfulEncoderCacheManager in E), aligned with --encode-servers-urls: what E holds "
            "then comes from E itself, the same for every proxy replica, in place of this "
            "process's record of what it sent",
        },
    ),
    (
        "--e-cache-events-replay-endpoints",
        {"default": None, "help": "their replay endpoints, aligned the same way (optional)"},
    ),
    (
        "--e-snapshot-endpoints",
        {
            "default": None,
            "help": "each E's encoder-cache snapshot endpoint (additional_config "
            "mmreuse.encoder_cache_snapshot_endpoint, served by EventfulEncoderCacheManager; "
            "a DemandScheduler's demand_endpoint serves it too), aligned the same way "
            "(optional): a proxy started late, restarted or replicated completes its E view "
            "from E's snapshot",
        },
    ),
)
# The shared embedding store, and how long the E side is trusted.
_STORE: tuple[_Flag, ...] = (
    (
        "--e-store-url",
        {
            "default": None,
            "help": "the shared embedding store's HTTP address (a Mooncake master's metrics port, "
            "e.g. http://127.0.0.1:9003): asked per request which items it holds, so that every "
            "replica sees the same store and an item P's EC connector loads skips E (needs "
            "--e-store-namespace)",
        },
    ),
    (
        "--e-store-namespace",
        {
            "default": None,
            "help": "the key namespace P's EC connector uses (it logs it: 'MooncakeStoreConnector "
            "(...), namespace NS'); keys are NS@id:IDENTIFIER, as in vLLM's Mooncake backend",
        },
    ),
    (
        "--e-store-timeout",
        {
            "type": float,
            "default": 0.25,
            "help": "seconds a store query may take; later, the request is planned without it",
        },
    ),
    (
        "--e-cache-items",
        {
            "type": int,
            "default": 4096,
            "help": "how many items the proxy keeps of what each E holds (E-side reuse), LRU",
        },
    ),
    (
        "--e-cache-ttl",
        {
            "type": float,
            "default": 3600.0,
            "help": "seconds the proxy trusts that E still holds an item no event or send has "
            "mentioned since",
        },
    ),
)
# The media flags, and the MediaLimits field each sets (FLAGS' `media.*`).
_MEDIA_FIELDS = {
    flag: key.removeprefix("media.fetch.")
    for key, flag in FLAGS.items()
    if key.startswith("media.fetch.")
}
# The flags aligned with the instances that prefill, and the PrefillInstance field each fills.
_ALIGNED = {
    "--kv-events-endpoints": "kv_events",
    "--kv-events-replay-endpoints": "kv_replay",
    "--encoder-cache-events-endpoints": "ec_events",
    "--encoder-cache-events-replay-endpoints": "ec_replay",
    "--demand-endpoints": "demand",
}
# The flags aligned with the encoders, and the EncodeInstance field each fills.
_E_ALIGNED = {
    "--e-cache-events-endpoints": "ec_events",
    "--e-cache-events-replay-endpoints": "ec_replay",
    "--e-snapshot-endpoints": "snapshot",
}


def _flag_dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def _dest(flag: str) -> str:
    return "unsupported_" + _flag_dest(flag)


def build_parser() -> argparse.ArgumentParser:
    """`mmreuse proxy`'s parser: the reference's flags, then mmreuse's, section by section."""
    p = argparse.ArgumentParser(
        prog="mmreuse proxy",
        description=(
            "A demand-aware EPD proxy, a drop-in for vLLM's reference disagg_epd_proxy.py "
            "(static mode): the same flags, routes and wire behaviour, plus --policy index, demand "
            "and opportunistic (send E only what the chosen P/PD still needs) and Prometheus "
            "/metrics."
        ),
    )
    for flag, options in (*_SERVING, *_MEDIA, *_REFERENCE):
        p.add_argument(flag, **options)
    # The reference's dynamic-registration and Mooncake-push flags: recognised, and refused
    # with the reason (docs/proxy.md, "Not covered").
    for flag in _UNSUPPORTED:
        p.add_argument(
            flag, dest=_dest(flag), nargs="?", const=True, default=None, help=argparse.SUPPRESS
        )
    g = p.add_argument_group("mmreuse (not in the reference)")
    for flag, options in (*_PLANNING, *_VIEWS, *_STORE):
        g.add_argument(flag, **options)
    return p


def parse_args(
    argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None
) -> ProxyConfig:
    """Parse flags (and ENCODER_MAX_BATCH_SIZE, VLLM_HTTP_TIMEOUT_KEEP_ALIVE and OPENAI_API_KEY
    from `env`) into a ProxyConfig; usage errors exit 2 with `mmreuse proxy: error: ...`, as
    argparse does, naming the flags."""
    parser = build_parser()
    args = parser.parse_args(argv)
    env = os.environ if env is None else env
    try:
        return config_from_args(args, env)
    except InvalidArgument as e:
        given = [flag for flag in _MEDIA_FIELDS if getattr(args, _flag_dest(flag)) is not None]
        _fail(parser, in_flags(e, {**FLAGS, "media.fetch": given[0]} if given else FLAGS))


def _fail(parser: argparse.ArgumentParser, message: str) -> NoReturn:
    parser.error(message)


def _urls(value: str) -> tuple[str, ...]:
    return tuple(u.strip().rstrip("/") for u in value.split(",") if u.strip())


def _aligned(value: str | None) -> tuple[str | None, ...]:
    """Comma-separated and aligned with the instances; an empty slot = none there."""
    if value is None:
        return ()
    return tuple((s.strip() or None) for s in value.split(","))


def _slots(
    args: argparse.Namespace, flags: Mapping[str, str], urls: Sequence[str], which: str
) -> list[dict[str, str | None]]:
    """Each instance's fields from the flags aligned with `urls` (`which` names their flag):
    a flag given has one slot per URL, else it is refused naming both counts."""
    slots: list[dict[str, str | None]] = [{} for _ in urls]
    for flag, name in flags.items():
        eps = _aligned(getattr(args, _flag_dest(flag)))
        if eps and len(eps) != len(urls):
            raise InvalidArgument(
                f"{flag} has {len(eps)} entries but {which} has {len(urls)}: align them "
                "(leave a slot empty for an instance without one)"
            )
        for slot, ep in zip(slots, eps, strict=False):
            slot[name] = ep
    return slots


def _check_some_slot_set(args: argparse.Namespace, flags: Mapping[str, str], which: str) -> None:
    """An aligned flag given with every slot empty (`,`) is refused: it reads as no endpoint
    at all, which leaving the flag out says; the records see only the empty slots."""
    for flag in flags:
        value = getattr(args, _flag_dest(flag))
        if value is not None and not any(_aligned(value)):
            raise InvalidArgument(
                f"{flag}: {value!r} has no endpoint in any entry: give at least one (aligned "
                f"with {which}), or leave the flag out"
            )


def _env_number(env: Mapping[str, str], name: str, default: str, kind: type) -> Any:
    raw = env.get(name, default)
    try:
        return kind(raw)
    except ValueError:
        what = "an integer" if kind is int else "a number"
        raise InvalidArgument(f"{name}={raw!r} is not {what}") from None


def _media(args: argparse.Namespace) -> MediaLimits | None:
    """MediaLimits from the media flags given (the others: MediaLimits' defaults); None where
    none is given, so that the record tells a flag given (refused under a policy that does not
    fetch, whatever its value) from one left out."""
    given = {
        name: getattr(args, _flag_dest(flag))
        for flag, name in _MEDIA_FIELDS.items()
        if getattr(args, _flag_dest(flag)) is not None
    }
    if not given:
        return None
    if "private_networks" in given:
        nets = given["private_networks"]
        given["private_networks"] = parse_networks("--allow-private-media-networks", nets)
    if "allowed_domains" in given:
        domains = given["allowed_domains"]
        if not all(d.strip() for d in domains):  # as the user wrote them, not MediaLimits' view
            raise InvalidArgument(
                f"--allowed-media-domains: {domains!r} must be host names (no scheme, port or path)"
            )
        given["allowed_domains"] = frozenset(d.strip().lower() for d in domains)
    return MediaLimits(**given)


def _section(kind: type[Any], args: argparse.Namespace, **given: Any) -> Any:
    """The section `kind` from the flags named as its fields (`--block-size` -> block_size)
    and `given` for the others; a field with neither (`planning.seed`) keeps its default."""
    names = [f.name for f in dataclasses.fields(kind) if f.name not in given]
    return kind(**{n: getattr(args, n) for n in names if hasattr(args, n)}, **given)


def config_from_args(args: argparse.Namespace, env: Mapping[str, str]) -> ProxyConfig:
    """The ProxyConfig the flags (and `env`) say: flags mapped to fields, the record checks."""
    for flag, what in _UNSUPPORTED.items():
        if getattr(args, _dest(flag)) is not None:
            raise InvalidArgument(
                f"{flag}: {what} is not supported by mmreuse proxy (static mode only; see the "
                "docs/proxy.md: the demand-aware policies need each P/PD's KV-event endpoint, which "
                "registration does not carry, and Mooncake push cannot be tested here)"
            )
    prefill = (
        () if args.prefill_servers_urls.lower() in _NO_PREFILL else _urls(args.prefill_servers_urls)
    )
    e_urls, d_urls = _urls(args.encode_servers_urls), _urls(args.decode_servers_urls)
    urls = prefill or d_urls
    which = "--prefill-servers-urls" if prefill else "--decode-servers-urls"
    slots = _slots(args, _ALIGNED, urls, which)
    e_slots = _slots(args, _E_ALIGNED, e_urls, "--encode-servers-urls")
    config = ProxyConfig(
        encode_urls=e_urls,
        decode_urls=d_urls,
        prefill_urls=prefill,
        instances=tuple(PrefillInstance(u, **s) for u, s in zip(urls, slots, strict=True)),
        encoders=tuple(EncodeInstance(u, **s) for u, s in zip(e_urls, e_slots, strict=True)),
        serving=_section(
            ServingConfig,
            args,
            encode_timeout_s=args.encode_timeout,
            prefill_timeout_s=args.prefill_timeout,
            request_timeout_s=args.request_timeout,
            encoder_max_batch_size=_env_number(env, "ENCODER_MAX_BATCH_SIZE", "0", int),
            backend_keep_alive_s=_env_number(env, "VLLM_HTTP_TIMEOUT_KEEP_ALIVE", "5", float),
            api_key=env.get("OPENAI_API_KEY", ""),
        ),
        media=_section(MediaConfig, args, fetch=_media(args)),
        planning=_section(
            PlanningConfig,
            args,
            render_url=args.render_url.rstrip("/") if args.render_url else None,
            render_timeout_s=args.render_timeout,
        ),
        views=_section(ViewsConfig, args, demand_timeout_s=args.demand_timeout),
        store=StoreConfig(
            url=args.e_store_url.rstrip("/") if args.e_store_url else None,
            namespace=args.e_store_namespace,
            timeout_s=args.e_store_timeout,
            e_cache_items=args.e_cache_items,
            e_cache_ttl_s=args.e_cache_ttl,
        ),
    )
    # After the records: where they refuse an empty slot (a policy that asks every P/PD) they
    # name it; what is left is a flag that names nothing.
    _check_some_slot_set(args, _ALIGNED, which)
    _check_some_slot_set(args, _E_ALIGNED, "--encode-servers-urls")
    return config
