"""`mmreuse proxy` flags: the reference proxy's static-mode flags (same names, defaults and
meaning) plus the demand-aware ones. One frozen `ProxyConfig` is what the app runs on."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import NoReturn

from ..decision import POLICIES, Policy, parse_policy
from ..errors import InvalidArgument
from ..hashing.functions import HASH_FUNCTIONS
from .content import MediaLimits, parse_networks
from .media import DEFAULT_MM_LIMIT

ROUTINGS = ("random", "affine")
MAX_WORKERS = 64
MIN_WORKER_STALL_S = 1.0  # --worker-stall-timeout: below this, a busy loop is no stall
# The largest request body (--max-body-bytes): vLLM's per-request media budget
# (VLLM_MAX_MEDIA_REQUEST_DOWNLOAD_SIZE_MB=256), since inline media is what makes a body large.
DEFAULT_MAX_BODY_BYTES = 256 << 20
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
# --uuid-policy: reference (the reference proxy's rule), tenant (namespaced by cache_salt) or
# content (named by the media bytes, namespaced by cache_salt)
UUID_POLICIES = ("reference", "tenant", "content")
# The flags that bound what --uuid-policy content fetches (refused under the other policies).
_MEDIA_FLAGS = (
    "--allowed-media-domains",
    "--allow-private-media-networks",
    "--media-max-bytes",
    "--media-fetch-timeout",
    "--media-request-timeout",
    "--media-max-redirects",
)
# The flags aligned with the instances that prefill: each fills one PrefillInstance field.
_ALIGNED = (
    "--kv-events-endpoints",
    "--kv-events-replay-endpoints",
    "--encoder-cache-events-endpoints",
    "--encoder-cache-events-replay-endpoints",
    "--demand-endpoints",
)
# The flags aligned with the encoders: each fills one EncodeInstance field.
_E_ALIGNED = (
    "--e-cache-events-endpoints",
    "--e-cache-events-replay-endpoints",
    "--e-snapshot-endpoints",
)


def _flag_dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def _dest(flag: str) -> str:
    return "unsupported_" + _flag_dest(flag)


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


@dataclass(frozen=True, slots=True)
class EncodeInstance:
    """One E and its mmreuse endpoints, from the flags aligned with its URL: its encoder-cache
    events (EventfulEncoderCacheManager in E) make the E side a fact every proxy replica that
    follows them shares; its DemandScheduler's endpoint serves their snapshot."""

    url: str
    ec_events: str | None = None  # --e-cache-events-endpoints
    ec_replay: str | None = None  # --e-cache-events-replay-endpoints
    snapshot: str | None = None  # --e-snapshot-endpoints: E's DemandScheduler endpoint


@dataclass(frozen=True, slots=True)
class ProxyConfig:
    """Everything the proxy runs on. `prefill_urls` empty = E + PD (the decode URLs prefill).

    `instances`: one record per instance that prefills, in the order of its URLs (the P URLs,
    or the PD URLs in E + PD); left empty, the URLs alone (no view, no demand endpoint).
    `encoders`: one record per E, in the order of `encode_urls` (left empty: the URLs alone, and
    the E side is the proxy's own record of what it sent).
    """

    encode_urls: tuple[str, ...]
    decode_urls: tuple[str, ...]
    prefill_urls: tuple[str, ...] = ()
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
    decode_retries: int = 1
    no_rewrite: bool = False
    uuid_policy: str = "reference"  # --uuid-policy: how items are named for E and P
    media: MediaLimits = field(default_factory=MediaLimits)  # what --uuid-policy content fetches
    log_requests: bool = False
    encoder_max_batch_size: int = 0
    policy: Policy = Policy.EAGER
    routing: str = "random"
    render_url: str | None = None
    render_timeout_s: float = (
        10.0  # a slow render costs the plan (E gets everything), not the request
    )
    instances: tuple[PrefillInstance, ...] = ()
    encoders: tuple[EncodeInstance, ...] = ()
    hash_algo: str = "sha256"
    hash_seed: str | None = None
    block_size: int | None = None  # None: learned from each instance's BlockStored events
    e_cache_items: int = 4096
    e_cache_ttl_s: float = 3600.0
    seed: int | None = None  # the routing RNG's seed (tests); None = system entropy
    # a demand query (demand, opportunistic) not answered within it costs the plan
    demand_timeout_s: float = 1.0
    # --e-store-url / --e-store-namespace: the shared embedding store (a Mooncake master's
    # HTTP address) asked what it holds, per request (mmreuse.proxy.store); None: not asked
    e_store_url: str | None = None
    e_store_namespace: str | None = None
    e_store_timeout_s: float = 0.25
    # --limit-mm-per-prompt: the media items of a modality one request may carry (vLLM's flag
    # and default: 999 for a modality not named), refused before any per-item work
    limit_mm_per_prompt: Mapping[str, int] = field(default_factory=dict)
    # --max-body-bytes: the largest request body read (inline base64 media included)
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    # VLLM_HTTP_TIMEOUT_KEEP_ALIVE (vLLM's env, 5 s by default): how long E, P and D keep an idle
    # connection; the proxy retires its own sooner (0: no pooling)
    backend_keep_alive_s: float = 5.0
    # OPENAI_API_KEY: the bearer token /start_profile and /stop_profile send E, P and D
    api_key: str = field(default="", repr=False)
    # The URLs of `instances`, in order (derived: what policy.Planner indexes by instance).
    prefill_instances: tuple[str, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "policy", parse_policy(self.policy))
        urls = self.prefill_urls or self.decode_urls
        instances = self.instances or tuple(PrefillInstance(u) for u in urls)
        if tuple(i.url for i in instances) != urls:
            raise InvalidArgument(
                f"instances are for {[i.url for i in instances]} but the instances that "
                f"prefill are {list(urls)} (the "
                f"{'prefill' if self.prefill_urls else 'decode'} URLs): one record each, in order"
            )
        if self.policy.asks_p:
            for i in instances:
                if i.demand is None:
                    raise InvalidArgument(
                        f"policy {self.policy!r} asks every P/PD: {i.url} has no demand endpoint"
                    )
        object.__setattr__(self, "instances", instances)
        object.__setattr__(self, "prefill_instances", urls)
        encoders = self.encoders or tuple(EncodeInstance(u) for u in self.encode_urls)
        if tuple(e.url for e in encoders) != self.encode_urls:
            raise InvalidArgument(
                f"encoders are for {[e.url for e in encoders]} but the encode URLs are "
                f"{list(self.encode_urls)}: one record each, in order"
            )
        if len({e.ec_events is None for e in encoders}) > 1:
            raise InvalidArgument(
                "encoder-cache events from some encoders only: give every E's "
                "(--e-cache-events-endpoints) or none (the E side is then this proxy's own "
                "record of what it sent)"
            )
        object.__setattr__(self, "encoders", encoders)
        if not (isinstance(self.workers, int) and 1 <= self.workers <= MAX_WORKERS):
            raise InvalidArgument(f"workers={self.workers!r} must be an int in 1..{MAX_WORKERS}")
        if self.workers > 1 and self.metrics_port is None:
            raise InvalidArgument(f"workers={self.workers} needs metrics_port (--metrics-port)")
        stall = self.worker_stall_timeout
        if not (
            isinstance(stall, (int, float))
            and not isinstance(stall, bool)
            and (stall == 0 or MIN_WORKER_STALL_S <= stall < math.inf)
        ):
            raise InvalidArgument(
                f"worker_stall_timeout={stall!r} must be 0 (never) or seconds, at least "
                f"{MIN_WORKER_STALL_S:g}"
            )
        if (self.e_store_url is None) != (self.e_store_namespace is None):
            raise InvalidArgument(
                f"e_store_url={self.e_store_url!r} and e_store_namespace="
                f"{self.e_store_namespace!r}: give both (--e-store-url, --e-store-namespace) "
                "or neither"
            )
        if self.e_store_url is not None and not self.e_store_url.startswith(
            ("http://", "https://")
        ):
            raise InvalidArgument(f"e_store_url={self.e_store_url!r} must be an http:// URL")
        if self.e_store_namespace is not None and not self.e_store_namespace:
            raise InvalidArgument("e_store_namespace must not be empty")
        t = self.e_store_timeout_s
        if not (isinstance(t, (int, float)) and math.isfinite(t) and t > 0):
            raise InvalidArgument(f"e_store_timeout_s={t!r} must be a finite number > 0")
        for modality, limit in self.limit_mm_per_prompt.items():
            if not (isinstance(modality, str) and type(limit) is int and limit >= 0):
                raise InvalidArgument(
                    f"limit_mm_per_prompt[{modality!r}]={limit!r} must be an int >= 0 per "
                    "modality name (--limit-mm-per-prompt)"
                )
        object.__setattr__(self, "limit_mm_per_prompt", dict(self.limit_mm_per_prompt))
        if not (type(self.max_body_bytes) is int and self.max_body_bytes >= 1):
            raise InvalidArgument(
                f"max_body_bytes={self.max_body_bytes!r} must be an int >= 1 (--max-body-bytes)"
            )

    @property
    def e_events(self) -> bool:
        """Whether the E side comes from E's encoder-cache events (shared by every replica)."""
        return bool(self.encoders) and self.encoders[0].ec_events is not None


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


def _urls(value: str) -> tuple[str, ...]:
    return tuple(u.strip().rstrip("/") for u in value.split(",") if u.strip())


def _check_endpoint(flag: str, ep: str) -> None:
    """A ZMQ endpoint the subscribers and the demand client can use: tcp://HOST:PORT (PORT a
    number, or * to bind any), ipc://PATH or inproc://NAME; refused here, not at start-up."""
    if not ep.startswith(_ZMQ):
        raise InvalidArgument(f"{flag}: {ep!r} is not a ZMQ endpoint ({', '.join(_ZMQ)})")
    scheme, _, rest = ep.partition("://")
    if scheme != "tcp":
        if not rest:
            raise InvalidArgument(f"{flag}: {ep!r} names no {scheme} address")
        return
    host, colon, port = rest.rpartition(":")
    if not colon or not host or not (port == "*" or (port.isdigit() and 0 < int(port) < 65536)):
        raise InvalidArgument(f"{flag}: {ep!r} is not tcp://HOST:PORT with PORT in 1..65535")


def _aligned(value: str | None) -> tuple[str | None, ...]:
    """Comma-separated and aligned with the prefill instances; an empty slot = none there."""
    if value is None:
        return ()
    return tuple((s.strip() or None) for s in value.split(","))


def _instances(
    urls: Sequence[str], given: Mapping[str, tuple[str | None, ...]]
) -> tuple[PrefillInstance, ...]:
    """One record per instance from the aligned flags (already checked: each given flag has
    one slot per URL)."""

    def slot(flag: str, i: int) -> str | None:
        eps = given[flag]
        return eps[i] if eps else None

    return tuple(
        PrefillInstance(
            url,
            kv_events=slot("--kv-events-endpoints", i),
            kv_replay=slot("--kv-events-replay-endpoints", i),
            ec_events=slot("--encoder-cache-events-endpoints", i),
            ec_replay=slot("--encoder-cache-events-replay-endpoints", i),
            demand=slot("--demand-endpoints", i),
        )
        for i, url in enumerate(urls)
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mmreuse proxy",
        description=(
            "A demand-aware EPD proxy, a drop-in for vLLM's reference disagg_epd_proxy.py "
            "(static mode): the same flags, routes and wire behaviour, plus --policy index, demand "
            "and opportunistic (send E only what the chosen P/PD still needs) and Prometheus "
            "/metrics."
        ),
    )
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve GET /metrics and the detailed GET /health (per-instance cache facts) on this "
        "port only; --port keeps a /health with the reference's fields. Default: both on --port",
    )
    p.add_argument(
        "--metrics-host", default=None, help="the address --metrics-port binds (default --host)"
    )
    p.add_argument(
        "--workers",
        type=int,
        default=1,
        help="worker processes sharing --port (SO_REUSEPORT; the kernel spreads connections), "
        "each a replica with its own views: how a proxy node uses its cores. A worker that "
        "dies is restarted and rejoins as a late replica does. Needs --metrics-port, where "
        '/metrics and /health are every worker\'s, labelled worker="i"',
    )
    p.add_argument(
        "--worker-stall-timeout",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="with --workers > 1: a worker whose event loop has not turned for this long (a "
        "stalled worker keeps its share of --port's connections unanswered) is killed "
        f"(SIGKILL) and restarted. 0: never. At least {MIN_WORKER_STALL_S:g}; default 30",
    )
    p.add_argument(
        "--log-requests",
        action="store_true",
        help="Log every request in and out, and raise the log level to DEBUG.",
    )
    p.add_argument(
        "--uuid-policy",
        choices=UUID_POLICIES,
        default="reference",
        help="how items are named for E and P (vLLM keys its encoder cache and EC store by "
        "uuid, across tenants): reference (the client's uuid, else sha256 of the URL: the "
        "reference proxy's rule), tenant (those namespaced by the request's cache_salt, a "
        "client's *_embeds uuids too: no tenant can reach another's embeddings) or content "
        "(sha256 of the media bytes, namespaced by cache_salt; http(s) media fetched by the "
        "proxy and forwarded inline, so a URL whose content changed is a new item)",
    )
    p.add_argument(
        "--allowed-media-domains",
        nargs="+",
        default=None,
        help="--uuid-policy content: the only hosts media (and each redirect) may be fetched "
        "from, as vLLM's flag of that name (default: any)",
    )
    p.add_argument(
        "--media-max-bytes",
        type=int,
        default=None,
        help="--uuid-policy content: the most bytes one fetched item may have (default 32 MiB; "
        "a request's fetched media in all: 256 MiB, vLLM's "
        "VLLM_MAX_MEDIA_REQUEST_DOWNLOAD_SIZE_MB)",
    )
    p.add_argument(
        "--media-fetch-timeout",
        type=float,
        default=None,
        help="--uuid-policy content: seconds one media fetch (each redirect hop) may take "
        "(default 5, vLLM's VLLM_IMAGE_FETCH_TIMEOUT)",
    )
    p.add_argument(
        "--media-request-timeout",
        type=float,
        default=None,
        help="--uuid-policy content: seconds all of one request's media fetches may take "
        "(default 30)",
    )
    p.add_argument(
        "--media-max-redirects",
        type=int,
        default=None,
        help="--uuid-policy content: redirects followed per item, each hop checked as the "
        "first URL (default 5; 0: none, as vLLM's VLLM_MEDIA_URL_ALLOW_REDIRECTS=0)",
    )
    p.add_argument(
        "--allow-private-media-networks",
        nargs="+",
        default=None,
        metavar="CIDR",
        help="--uuid-policy content: non-public networks media may be fetched from (default "
        "none: a host that is or resolves to a loopback, private, link-local, shared, "
        "reserved, multicast or unspecified address is refused; '0.0.0.0/0 ::/0' allows all)",
    )
    p.add_argument(
        "--limit-mm-per-prompt",
        type=_mm_limits,
        default={},
        help="the media items of each modality one request may carry, as vLLM's flag of that "
        """name ('{"image": 16, "video": 2}', or {"video": {"count": 2}}; 999 for a modality """
        "not named, vLLM's default): a request over it is refused before any per-item work",
    )
    p.add_argument(
        "--max-body-bytes",
        type=int,
        default=DEFAULT_MAX_BODY_BYTES,
        help="the largest request body read, inline base64 media included (default 256 MiB, "
        "vLLM's per-request media download budget)",
    )
    p.add_argument(
        "--no-rewrite",
        action="store_true",
        help="Forward media to the decoder unchanged and send E no uuid (stage-timing A/B).",
    )
    p.add_argument(
        "--encode-servers-urls",
        default="",
        help='Comma-separated encode URLs ("http://e1:8001,http://e2:8001")',
    )
    p.add_argument(
        "--prefill-servers-urls",
        default="none",
        help='Comma-separated prefill URLs to enable E->P->D; "disable" or "none" for E->PD',
    )
    p.add_argument(
        "--decode-servers-urls",
        default="",
        help='Comma-separated decode URLs ("http://d1:8005,http://d2:8006")',
    )
    p.add_argument(
        "--decode-retries",
        type=int,
        default=1,
        help="Re-encode and re-send when decode returns 500 (its retryable error). 0 disables.",
    )
    # The reference's dynamic-registration and Mooncake-push flags: recognised, and refused
    # with the reason (docs/proxy.md, "Not covered").
    for flag in _UNSUPPORTED:
        p.add_argument(
            flag, dest=_dest(flag), nargs="?", const=True, default=None, help=argparse.SUPPRESS
        )
    g = p.add_argument_group("mmreuse (not in the reference)")
    g.add_argument(
        "--policy",
        choices=POLICIES,
        default="eager",
        help="eager: every item to E (the reference); index: E gets only what the chosen "
        "P/PD still needs, from its live KV view; demand: E gets only what the chosen P/PD "
        "says it needs (asked over --demand-endpoints); opportunistic: E gets everything at "
        "once, and what P's answer rules out is abandoned while still in flight",
    )
    g.add_argument(
        "--routing",
        choices=ROUTINGS,
        default="random",
        help="random: the reference's choice of P/PD; affine: the one with the longest live "
        "prefix hit (ties at random)",
    )
    g.add_argument(
        "--render-url",
        default=None,
        help="where to render requests (POST /v1/chat/completions/render, mm_payload none); "
        "default: the chosen P/PD (started with --enable-scale-out)",
    )
    g.add_argument(
        "--render-timeout",
        type=float,
        default=10.0,
        help="seconds a render may take; past it the request is served as under eager",
    )
    g.add_argument(
        "--kv-events-endpoints",
        default=None,
        help="comma-separated ZMQ endpoints of the P (or PD) instances' KV events, aligned "
        "with their URLs (an empty slot: no view of that one)",
    )
    g.add_argument(
        "--kv-events-replay-endpoints",
        default=None,
        help="their replay endpoints, aligned the same way (optional)",
    )
    g.add_argument(
        "--encoder-cache-events-endpoints",
        default=None,
        help="comma-separated ZMQ endpoints of the P (or PD) instances' encoder-cache events "
        "(mmreuse's EventfulEncoderCacheManager), aligned with their URLs",
    )
    g.add_argument(
        "--encoder-cache-events-replay-endpoints",
        default=None,
        help="their replay endpoints, aligned the same way (optional)",
    )
    g.add_argument(
        "--demand-endpoints",
        default=None,
        help="comma-separated ZMQ endpoints of the P (or PD) instances' DemandScheduler "
        "(additional_config mmreuse.demand_endpoint), aligned with their URLs, one for each; "
        "required by --policy demand and opportunistic",
    )
    g.add_argument(
        "--demand-timeout",
        type=float,
        default=1.0,
        help="seconds P may take to answer a demand query; past it the request is served as "
        "under eager",
    )
    g.add_argument(
        "--hash-algo",
        choices=sorted(HASH_FUNCTIONS),
        default="sha256",
        help="P's --prefix-caching-hash-algo (vLLM's default: sha256)",
    )
    g.add_argument(
        "--hash-seed",
        default=None,
        help="P's PYTHONHASHSEED (default: unset, as vLLM without it; required for xxhash*)",
    )
    g.add_argument(
        "--block-size",
        type=int,
        default=None,
        help="P's KV block size (default: learned from its BlockStored events)",
    )
    g.add_argument(
        "--e-cache-events-endpoints",
        default=None,
        help="comma-separated ZMQ endpoints of every E's encoder-cache events (mmreuse's "
        "EventfulEncoderCacheManager in E), aligned with --encode-servers-urls: what E holds "
        "then comes from E itself, the same for every proxy replica, in place of this "
        "process's record of what it sent",
    )
    g.add_argument(
        "--e-cache-events-replay-endpoints",
        default=None,
        help="their replay endpoints, aligned the same way (optional)",
    )
    g.add_argument(
        "--e-snapshot-endpoints",
        default=None,
        help="each E's DemandScheduler endpoint (additional_config mmreuse.demand_endpoint), "
        "aligned the same way (optional): a proxy started late, restarted or replicated "
        "completes its E view from E's snapshot",
    )
    g.add_argument(
        "--e-store-url",
        default=None,
        help="the shared embedding store's HTTP address (a Mooncake master's metrics port, "
        "e.g. http://127.0.0.1:9003): asked per request which items it holds, so that every "
        "replica sees the same store and an item P's EC connector loads skips E (needs "
        "--e-store-namespace)",
    )
    g.add_argument(
        "--e-store-namespace",
        default=None,
        help="the key namespace P's EC connector uses (it logs it: 'MooncakeStoreConnector "
        "(...), namespace NS'); keys are NS@id:IDENTIFIER, as in vLLM's Mooncake backend",
    )
    g.add_argument(
        "--e-store-timeout",
        type=float,
        default=0.25,
        help="seconds a store query may take; later, the request is planned without it",
    )
    g.add_argument(
        "--e-cache-items",
        type=int,
        default=4096,
        help="how many items the proxy keeps of what each E holds (E-side reuse), LRU",
    )
    g.add_argument(
        "--e-cache-ttl",
        type=float,
        default=3600.0,
        help="seconds the proxy trusts that E still holds an item no event or send has "
        "mentioned since",
    )
    return p


def parse_args(
    argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None
) -> ProxyConfig:
    """Parse flags (and ENCODER_MAX_BATCH_SIZE from `env`) into a ProxyConfig; usage errors
    exit 2 with `mmreuse proxy: error: ...`, as argparse does."""
    parser = build_parser()
    args = parser.parse_args(argv)
    env = os.environ if env is None else env
    try:
        return config_from_args(args, env)
    except InvalidArgument as e:
        _fail(parser, str(e))


def _fail(parser: argparse.ArgumentParser, message: str) -> NoReturn:
    parser.error(message)


def config_from_args(args: argparse.Namespace, env: Mapping[str, str]) -> ProxyConfig:
    for flag, what in _UNSUPPORTED.items():
        if getattr(args, _dest(flag)) is not None:
            raise InvalidArgument(
                f"{flag}: {what} is not supported by mmreuse proxy (static mode only; see the "
                "docs/proxy.md: the demand-aware policies need each P/PD's KV-event endpoint, which "
                "registration does not carry, and Mooncake push cannot be tested here)"
            )
    if not args.encode_servers_urls or not args.decode_servers_urls:
        raise InvalidArgument(
            "Static routing requires --encode-servers-urls and --decode-servers-urls"
        )
    raw_batch = env.get("ENCODER_MAX_BATCH_SIZE", "0")
    try:
        batch = int(raw_batch)
    except ValueError:
        raise InvalidArgument(f"ENCODER_MAX_BATCH_SIZE={raw_batch!r} is not an integer") from None
    if batch < 0:
        raise InvalidArgument(f"ENCODER_MAX_BATCH_SIZE={batch} must be non-negative")
    raw_keep_alive = env.get("VLLM_HTTP_TIMEOUT_KEEP_ALIVE", "5")
    try:
        keep_alive = float(raw_keep_alive)
    except ValueError:
        raise InvalidArgument(
            f"VLLM_HTTP_TIMEOUT_KEEP_ALIVE={raw_keep_alive!r} is not a number"
        ) from None
    if args.decode_retries < 0:
        raise InvalidArgument(f"--decode-retries={args.decode_retries} must be >= 0")
    if not 0 < args.port < 65536:
        raise InvalidArgument(f"--port={args.port} is not a TCP port")
    if args.metrics_port is not None:
        if not 0 < args.metrics_port < 65536:
            raise InvalidArgument(f"--metrics-port={args.metrics_port} is not a TCP port")
        if args.metrics_port == args.port:
            raise InvalidArgument(f"--metrics-port={args.metrics_port} is --port's: give another")
    elif args.metrics_host is not None:
        raise InvalidArgument("--metrics-host without --metrics-port: give the port too")
    if not 1 <= args.workers <= MAX_WORKERS:
        raise InvalidArgument(f"--workers={args.workers} must be in 1..{MAX_WORKERS}")
    if args.workers > 1 and args.metrics_port is None:
        raise InvalidArgument(
            f"--workers={args.workers} needs --metrics-port: a scrape of --port would reach one "
            "worker; --metrics-port serves every worker's /metrics and /health"
        )
    stall = args.worker_stall_timeout
    if not (stall == 0 or MIN_WORKER_STALL_S <= stall < math.inf):
        raise InvalidArgument(
            f"--worker-stall-timeout={stall:g} must be 0 (never) or seconds, at least "
            f"{MIN_WORKER_STALL_S:g}: a worker busy for less is not stalled"
        )
    prefill = (
        () if args.prefill_servers_urls.lower() in _NO_PREFILL else _urls(args.prefill_servers_urls)
    )
    cfg_urls = {
        "--encode-servers-urls": _urls(args.encode_servers_urls),
        "--decode-servers-urls": _urls(args.decode_servers_urls),
        "--prefill-servers-urls": prefill,
    }
    for flag, urls in cfg_urls.items():
        for u in urls:
            if not u.startswith(("http://", "https://")):
                raise InvalidArgument(f"{flag}: {u!r} is not an http(s) URL")
    if not cfg_urls["--encode-servers-urls"] or not cfg_urls["--decode-servers-urls"]:
        raise InvalidArgument(
            "Static routing requires --encode-servers-urls and --decode-servers-urls"
        )
    urls = prefill or cfg_urls["--decode-servers-urls"]
    which = "--prefill-servers-urls" if prefill else "--decode-servers-urls"
    given = {flag: _aligned(getattr(args, _flag_dest(flag))) for flag in _ALIGNED}
    for flag, eps in given.items():
        if flag == "--demand-endpoints":
            continue
        if eps and len(eps) != len(urls):
            raise InvalidArgument(
                f"{flag} has {len(eps)} entries but {which} has {len(urls)}: align them "
                "(leave a slot empty for an instance without one)"
            )
        for ep in eps:
            if ep is not None:
                _check_endpoint(flag, ep)
    demand = given["--demand-endpoints"]
    if Policy(args.policy).asks_p and not demand:
        raise InvalidArgument(
            f"--policy {args.policy} needs --demand-endpoints (each P/PD's DemandScheduler "
            "endpoint, aligned with " + which + ")"
        )
    if demand and len(demand) != len(urls):
        raise InvalidArgument(
            f"--demand-endpoints has {len(demand)} entries but {which} has "
            f"{len(urls)}: give one for each"
        )
    for i, ep in enumerate(demand):  # given under any policy (one flag set for a cluster)
        if ep is None:
            if Policy(args.policy).asks_p:
                raise InvalidArgument(
                    f"--demand-endpoints: entry {i} (for {urls[i]}) is empty: --policy "
                    f"{args.policy} asks every P/PD"
                )
        else:
            _check_endpoint("--demand-endpoints", ep)
    if not (math.isfinite(args.demand_timeout) and args.demand_timeout > 0):
        raise InvalidArgument(f"--demand-timeout={args.demand_timeout} must be a finite number > 0")
    for replay, events in (
        ("--kv-events-replay-endpoints", "--kv-events-endpoints"),
        ("--encoder-cache-events-replay-endpoints", "--encoder-cache-events-endpoints"),
    ):
        if given[replay] and not given[events]:
            raise InvalidArgument(f"{replay} needs {events}")
    e_urls = cfg_urls["--encode-servers-urls"]
    e_given = {flag: _aligned(getattr(args, _flag_dest(flag))) for flag in _E_ALIGNED}
    for flag, eps in e_given.items():
        if eps and len(eps) != len(e_urls):
            raise InvalidArgument(
                f"{flag} has {len(eps)} entries but --encode-servers-urls has {len(e_urls)}: "
                "align them"
            )
        for i, ep in enumerate(eps):
            if ep is None and flag == "--e-cache-events-endpoints":
                raise InvalidArgument(
                    f"{flag}: entry {i} (for {e_urls[i]}) is empty: give every E's events, or "
                    "none (the E side is then this proxy's own record of what it sent)"
                )
            if ep is not None:
                _check_endpoint(flag, ep)
    for flag in ("--e-cache-events-replay-endpoints", "--e-snapshot-endpoints"):
        if e_given[flag] and not e_given["--e-cache-events-endpoints"]:
            raise InvalidArgument(f"{flag} needs --e-cache-events-endpoints")
    encoders = tuple(
        EncodeInstance(
            url,
            *(e_given[f][i] if e_given[f] else None for f in _E_ALIGNED),
        )
        for i, url in enumerate(e_urls)
    )
    if args.block_size is not None and args.block_size < 1:
        raise InvalidArgument(f"--block-size={args.block_size} must be >= 1")
    if args.hash_seed is not None and args.hash_algo.endswith("_cbor"):
        try:  # a non-UTF-8 argv byte arrives as a lone surrogate, which CBOR cannot hash
            args.hash_seed.encode("utf-8")
        except UnicodeEncodeError as e:
            try:  # the bytes given, where argv's decoding escaped them
                shown = repr(args.hash_seed.encode("utf-8", "surrogateescape"))
            except UnicodeEncodeError:
                shown = ascii(args.hash_seed)
            raise InvalidArgument(
                f"--hash-seed {shown} is not UTF-8 (at character {e.start}): --hash-algo "
                f"{args.hash_algo} hashes the seed as UTF-8 text, as vLLM does PYTHONHASHSEED"
            ) from None
    if args.hash_algo.startswith("xxhash") and args.hash_seed is None:
        raise InvalidArgument(
            f"--hash-algo {args.hash_algo} needs --hash-seed: without PYTHONHASHSEED vLLM "
            "seeds xxhash randomly per process, so no proxy can reproduce its hashes"
        )
    if args.no_rewrite and args.uuid_policy != "reference":
        raise InvalidArgument(
            f"--no-rewrite with --uuid-policy {args.uuid_policy}: --no-rewrite sends E no uuid, "
            "so the tenant's namespace would not reach P"
        )
    media = MediaLimits()
    for flag in _MEDIA_FLAGS:
        if getattr(args, _flag_dest(flag)) is not None and args.uuid_policy != "content":
            raise InvalidArgument(
                f"{flag} bounds what --uuid-policy content fetches: it does nothing under "
                f"--uuid-policy {args.uuid_policy}"
            )
    if args.media_max_bytes is not None:
        if args.media_max_bytes < 1:
            raise InvalidArgument(f"--media-max-bytes={args.media_max_bytes} must be >= 1")
        media = dataclasses.replace(media, max_item_bytes=args.media_max_bytes)
    if args.media_fetch_timeout is not None:
        t = args.media_fetch_timeout
        if not (math.isfinite(t) and t > 0):
            raise InvalidArgument(f"--media-fetch-timeout={t} must be a finite number > 0")
        media = dataclasses.replace(media, timeout_s=t)
    if args.media_request_timeout is not None:
        t = args.media_request_timeout
        if not (math.isfinite(t) and t > 0):
            raise InvalidArgument(f"--media-request-timeout={t} must be a finite number > 0")
        media = dataclasses.replace(media, request_timeout_s=t)
    if args.media_max_redirects is not None:
        if args.media_max_redirects < 0:
            raise InvalidArgument(f"--media-max-redirects={args.media_max_redirects} must be >= 0")
        media = dataclasses.replace(media, max_redirects=args.media_max_redirects)
    if args.allow_private_media_networks is not None:
        nets = parse_networks("--allow-private-media-networks", args.allow_private_media_networks)
        media = dataclasses.replace(media, private_networks=nets)
    if args.allowed_media_domains is not None:
        domains = frozenset(d.strip().lower() for d in args.allowed_media_domains)
        if not all(domains) or any("/" in d or ":" in d for d in domains):
            raise InvalidArgument(
                f"--allowed-media-domains: {args.allowed_media_domains!r} must be host names "
                "(no scheme, port or path)"
            )
        media = dataclasses.replace(media, allowed_domains=domains)
    if args.no_rewrite and args.policy != Policy.EAGER:
        raise InvalidArgument(
            f"--no-rewrite with --policy {args.policy}: P would get every item raw without its "
            "uuid, so its keys would not be the ones the plan used; use --policy eager"
        )
    if args.e_cache_items < 1:
        raise InvalidArgument(f"--e-cache-items={args.e_cache_items} must be >= 1")
    if not (math.isfinite(args.e_cache_ttl) and args.e_cache_ttl > 0):
        raise InvalidArgument(f"--e-cache-ttl={args.e_cache_ttl} must be a finite number > 0")
    if not args.render_timeout > 0:
        raise InvalidArgument(f"--render-timeout={args.render_timeout} must be > 0")
    if args.render_url is not None and not args.render_url.startswith(("http://", "https://")):
        raise InvalidArgument(f"--render-url: {args.render_url!r} is not an http(s) URL")
    return ProxyConfig(
        encode_urls=cfg_urls["--encode-servers-urls"],
        decode_urls=cfg_urls["--decode-servers-urls"],
        prefill_urls=prefill,
        host=args.host,
        metrics_port=args.metrics_port,
        metrics_host=args.metrics_host,
        workers=args.workers,
        worker_stall_timeout=args.worker_stall_timeout,
        port=args.port,
        decode_retries=args.decode_retries,
        no_rewrite=args.no_rewrite,
        uuid_policy=args.uuid_policy,
        media=media,
        log_requests=args.log_requests,
        encoder_max_batch_size=batch,
        policy=args.policy,
        routing=args.routing,
        render_url=args.render_url.rstrip("/") if args.render_url else None,
        render_timeout_s=args.render_timeout,
        instances=_instances(urls, given),
        encoders=encoders,
        hash_algo=args.hash_algo,
        hash_seed=args.hash_seed,
        block_size=args.block_size,
        e_cache_items=args.e_cache_items,
        e_cache_ttl_s=args.e_cache_ttl,
        demand_timeout_s=args.demand_timeout,
        e_store_url=args.e_store_url.rstrip("/") if args.e_store_url else None,
        e_store_namespace=args.e_store_namespace,
        e_store_timeout_s=args.e_store_timeout,
        limit_mm_per_prompt=args.limit_mm_per_prompt,
        max_body_bytes=args.max_body_bytes,
        backend_keep_alive_s=keep_alive,
        api_key=env.get("OPENAI_API_KEY", ""),
    )
