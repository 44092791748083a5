"""`--uuid-policy content`: every media item named by the bytes the proxy forwards.

vLLM keys P's encoder cache and the EC store by an item's uuid, unscoped by tenant and
unchecked against the media. Under `content` the proxy names each item by its bytes (those a
data: URL or `input_audio` carries, or those it fetched from an http(s) URL and forwards inline,
so that E and P encode exactly what was named), namespaced by the request's cache salt. A
client's uuid is then only a hint: it never names an item, and a part carrying a uuid but no
media (vLLM's "reuse my cached item") is refused, since nothing can check what it names.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import inspect
import ipaddress
import logging
import math
import re
import socket
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urljoin, urlsplit

import aiohttp
import msgspec
import yarl
from aiohttp.abc import AbstractResolver, ResolveResult

from ..errors import InvalidArgument, InvalidArgumentType
from .errors import ProxyError
from .media import EMBEDS_PARTS, MM_TYPES, MODALITY, check_named_by_json

if TYPE_CHECKING:
    from .body import Blobs

logger = logging.getLogger("mmreuse.proxy")

# A media type as forwarded in a data: URL (RFC 2045 token chars; parameters dropped): one a
# fetched item's Content-Type gives, else application/octet-stream.
_MEDIA_TYPE = re.compile(r"[A-Za-z0-9!#$&^_.+-]+/[A-Za-z0-9!#$&^_.+-]+")
_REDIRECTS = frozenset({301, 302, 303, 307, 308})
_json = msgspec.json.Encoder().encode
_canonical = msgspec.json.Encoder(order="sorted").encode  # keys sorted, compact

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")  # RFC 6052: an IPv4 address in its last 32 bits


@dataclass(frozen=True, slots=True)
class MediaLimits:
    """What the proxy may fetch for one request: bytes per item and in all, seconds per hop and
    for the request's media in all, redirects per item, fetches at once, the hosts it may fetch
    from (None: any, as vLLM's `--allowed-media-domains` unset) and the non-public networks it
    may connect to (none: only public addresses; `--allow-private-media-networks`).

    The defaults are vLLM 0.33's: 256 MiB per request (VLLM_MAX_MEDIA_REQUEST_DOWNLOAD_SIZE_MB),
    5 s per fetch (VLLM_IMAGE_FETCH_TIMEOUT)."""

    max_item_bytes: int = 32 << 20
    max_request_bytes: int = 256 << 20
    timeout_s: float = 5.0
    request_timeout_s: float = 30.0
    max_redirects: int = 5
    concurrency: int = 8
    allowed_domains: frozenset[str] | None = None
    private_networks: tuple[IPNetwork, ...] = ()

    def __post_init__(self) -> None:
        for name, least in (
            ("max_item_bytes", 1),
            ("max_request_bytes", 1),
            ("max_redirects", 0),
            ("concurrency", 1),
        ):
            value = getattr(self, name)
            if type(value) is not int:
                raise InvalidArgumentType(f"MediaLimits.{name} must be an int, got {value!r}")
            if value < least:
                raise InvalidArgument(f"MediaLimits.{name} must be >= {least}, got {value!r}")
        for name in ("timeout_s", "request_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise InvalidArgumentType(f"MediaLimits.{name} must be a number, got {value!r}")
            if not (math.isfinite(value) and value > 0):
                raise InvalidArgument(
                    f"MediaLimits.{name} must be a finite number > 0, got {value!r}"
                )
        domains = self.allowed_domains
        if domains is not None and (
            not isinstance(domains, frozenset) or not all(isinstance(d, str) and d for d in domains)
        ):
            raise InvalidArgumentType(
                f"MediaLimits.allowed_domains must be None or a frozenset of host names, got "
                f"{domains!r}"
            )
        nets = self.private_networks
        if not isinstance(nets, tuple) or not all(
            isinstance(n, ipaddress.IPv4Network | ipaddress.IPv6Network) for n in nets
        ):
            raise InvalidArgumentType(
                f"MediaLimits.private_networks must be a tuple of ipaddress networks, got {nets!r}"
            )


class MediaRefused(ProxyError):
    """A media part that cannot be named by its content: the client's request is refused."""

    def __init__(self, where: str, why: str) -> None:
        super().__init__(400, f"{where}: {why} (--uuid-policy content)", stage="media")


# One hop: get(url, max bytes, timeout s, charge) -> (status, its Location and Content-Type
# headers, body); `charge(n)` as n bytes arrive (OverflowError past either bound).
Fetch = Callable[
    [str, int, float, Callable[[int], None]], Awaitable[tuple[int, Mapping[str, str], bytes]]
]


# ---- which addresses the proxy connects to -------------------------------------------------------


def parse_networks(flag: str, values: Iterable[str]) -> tuple[IPNetwork, ...]:
    """`values` as networks (`10.0.0.0/8`, `fd00::/8`, or one address): InvalidArgument naming
    `flag` and the value for one that is not."""
    nets: list[IPNetwork] = []
    for v in values:
        try:
            nets.append(ipaddress.ip_network(v.strip(), strict=False))
        except ValueError:
            raise InvalidArgument(
                f"{flag}: {v!r} is not an IP network (10.0.0.0/8, fd00::/8, 127.0.0.1)"
            ) from None
    return tuple(nets)


def _public(ip: IPAddress) -> bool:
    """A globally reachable unicast address, and so is any IPv4 address it embeds (6to4,
    Teredo, NAT64): never loopback, private, link-local, shared (100.64/10), reserved,
    multicast or unspecified."""
    if (
        not ip.is_global
        or ip.is_multicast
        or ip.is_reserved
        or ip.is_unspecified
        or ip.is_loopback
        or ip.is_link_local
        or ip.is_private
    ):
        return False
    if isinstance(ip, ipaddress.IPv6Address):
        inner: list[ipaddress.IPv4Address] = []
        if ip.sixtofour is not None:
            inner.append(ip.sixtofour)
        if ip.teredo is not None:
            inner.extend(ip.teredo)
        if ip in _NAT64:
            inner.append(ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF))
        return all(_public(x) for x in inner)
    return True


def address_allowed(address: str, networks: Iterable[IPNetwork] = ()) -> bool:
    """Whether the media fetcher may connect to `address`: an IP address (anything else, a
    name or a legacy form such as `2130706433`, is not) that is public or in `networks` (the
    operator's `--allow-private-media-networks`). An IPv4-mapped IPv6 address is its IPv4."""
    try:
        ip: IPAddress = ipaddress.ip_address(address)
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if any(ip.version == net.version and ip in net for net in networks):
        return True
    return _public(ip)


def _looks_like_an_address(host: str) -> bool:
    """What aiohttp connects to without resolving (its `is_ip_address` heuristic)."""
    return ":" in host or host.replace(".", "").isdigit()


class AddressRefused(OSError):
    """A media host resolves to (or is) an address the proxy may not connect to."""


class GuardedResolver(AbstractResolver):
    """Resolves as `inner` does (aiohttp's default resolver unless given) and refuses the host
    when any address it resolves to is not allowed (`address_allowed`), so the connection is
    made only to addresses checked here: the check and the connect use one answer (no DNS
    rebinding between them), and every redirect hop is resolved, so checked, again."""

    def __init__(
        self, networks: Iterable[IPNetwork] = (), inner: AbstractResolver | None = None
    ) -> None:
        self.networks = tuple(networks)
        self._inner = inner if inner is not None else aiohttp.DefaultResolver()

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        answers = await self._inner.resolve(host, port, family)
        refused = [a["host"] for a in answers if not address_allowed(a["host"], self.networks)]
        if refused:
            raise AddressRefused(f"{host!r} resolves to {refused} (not public)")
        return answers

    async def close(self) -> None:
        await self._inner.close()


def _guarded_socket(networks: tuple[IPNetwork, ...]) -> Callable[[Any], socket.socket]:
    """aiohttp's socket factory (aiohttp >= 3.12): the last check, on the address itself."""

    def factory(addr_info: Any) -> socket.socket:
        family, type_, proto, _, sockaddr = addr_info
        if not address_allowed(str(sockaddr[0]), networks):
            raise AddressRefused(f"{sockaddr[0]!r} is not public")
        return socket.socket(family=family, type=type_, proto=proto)

    return factory


def media_session(
    limits: MediaLimits, *, resolver: AbstractResolver | None = None
) -> aiohttp.ClientSession:
    """The client session media is fetched with (call in the event loop): no cookie state
    (`DummyCookieJar`: nothing one tenant's fetch is told reaches another's), no proxy from
    the environment, every address checked before it is connected to (`GuardedResolver`, and
    the socket factory where aiohttp has one) unless `limits.private_networks` allows it, and
    no shared connection limit: aiohttp's timeout counts the wait for a pooled connection, so
    one client's slow origins must not hold connections other tenants queue for (a request
    has at most `limits.concurrency` fetches at once). `resolver`: the one names are resolved
    with (tests), guarded as aiohttp's own."""
    guarded = GuardedResolver(limits.private_networks, resolver)
    kwargs: dict[str, Any] = {}
    if "socket_factory" in inspect.signature(aiohttp.TCPConnector).parameters:
        kwargs["socket_factory"] = _guarded_socket(limits.private_networks)
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, resolver=guarded, **kwargs)
    return aiohttp.ClientSession(
        connector=connector,
        cookie_jar=aiohttp.DummyCookieJar(),
        timeout=aiohttp.ClientTimeout(),  # each hop's own (`fetch_hop`)
        trust_env=False,
    )


async def fetch_hop(
    session: aiohttp.ClientSession,
    url: str,
    cap: int,
    timeout_s: float,
    charge: Callable[[int], None],
) -> tuple[int, dict[str, str], bytes]:
    """One hop of a media fetch (`MediaFetcher`'s `Fetch`): no redirect followed, at most `cap`
    bytes (decompressed) read, each chunk charged, else OverflowError."""
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with session.get(url, allow_redirects=False, timeout=timeout) as r:
        if r.content_length is not None and r.content_length > cap:
            raise OverflowError(r.content_length)
        body = bytearray()
        async for chunk in r.content.iter_chunked(1 << 16):
            body += chunk
            charge(len(chunk))
            if len(body) > cap:
                raise OverflowError(len(body))
        headers = {k: r.headers[k] for k in ("Location", "Content-Type") if k in r.headers}
        return r.status, headers, bytes(body)


def content_name(
    salt: Any, modality: str, media: str | bytes, blobs: Blobs | None = None, *, json: bool = False
) -> str:
    """The uuid of media as forwarded: sha256 of the salt and the modality (a JSON array, which
    ends itself), then `media`, the text that carries the bytes (a data: URL, an
    `input_audio`'s canonical JSON: `json=True`, bytes). That text determines every byte vLLM
    decodes, so one name is never two contents. `blobs`: the request's inline media, hashed as
    the text it stands for."""
    h = hashlib.sha256(_json(["mmreuse-content-v1", salt, modality]))
    data = media.encode() if isinstance(media, str) else media
    if blobs is None:
        h.update(data)
    else:
        blobs.update(h, data, json=json)
    return h.hexdigest()


def embeds_name(salt: Any, kind: str, value: Any, blobs: Blobs | None = None) -> str:
    """The uuid of a client's `*_embeds` part: its payload's canonical JSON, named as media."""
    check_named_by_json(value)
    return content_name(salt, kind, _canonical(value), blobs, json=True)


def _url_of(part: Mapping[str, Any]) -> tuple[Any, Any]:
    """(the part's media reference, its URL string or None): `{"image_url": {"url": u}}` or
    vLLM's short form `{"image_url": u}`."""
    ref = part.get(part["type"])
    if isinstance(ref, str):
        return ref, ref
    if isinstance(ref, Mapping):
        return ref, ref.get("url")
    return ref, None


def media_parts(request: Mapping[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """Every media or `*_embeds` part, with where it is (`messages[i].content[j]`)."""
    for i, msg in enumerate(request.get("messages") or ()):
        content = msg.get("content") if isinstance(msg, Mapping) else None
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            if isinstance(part, dict) and part.get("type") in MM_TYPES | EMBEDS_PARTS:
                yield f"messages[{i}].content[{j}]", part


class MediaFetcher:
    """Fetches http(s) media for `--uuid-policy content`, bounded: each hop of a redirect checked
    against the allowed hosts and addresses before it is requested, bytes counted as they
    arrive. What a client is told is fixed per class (invalid URL, host or address refused,
    HTTP status, timeout, too big, too many redirects, "could not fetch"): never the peer's
    bytes, and never which of DNS, a closed port or a broken answer failed."""

    def __init__(self, limits: MediaLimits, get: Fetch) -> None:
        self.limits = limits
        self._get = get

    def check_host(self, url: str, where: str) -> None:
        """Refuse (MediaRefused, naming `where`) a URL that does not parse, is not http(s), has
        no host, names a host outside `--allowed-media-domains`, or an IP address that is not
        public (unless in `--allow-private-media-networks`). A name is checked when resolved
        (`GuardedResolver`)."""
        shown = f"{url[:200]!r}"
        try:
            parts = urlsplit(url)
            hostname = parts.hostname
            host = yarl.URL(url).host  # what aiohttp connects to
            if "[" in parts.netloc:  # an IP literal, and only IPv6 (RFC 3986's IPvFuture not)
                ipaddress.IPv6Address(hostname or "")
        except (ValueError, TypeError):  # "Invalid IPv6 URL", an NFKC-invalid netloc, ...
            raise MediaRefused(where, f"{shown} is not a valid URL") from None
        if parts.scheme not in ("http", "https") or not hostname:
            raise MediaRefused(where, f"{shown} is not an http(s), data: or input_audio item")
        allowed = self.limits.allowed_domains
        if allowed is not None and hostname not in allowed:
            raise MediaRefused(
                where, f"{hostname!r} is not in --allowed-media-domains {sorted(allowed)}"
            )
        for h in {hostname, host or ""}:
            if _looks_like_an_address(h) and not address_allowed(h, self.limits.private_networks):
                raise MediaRefused(
                    where,
                    f"{h[:100]!r} is not a public address (--allow-private-media-networks)",
                )

    async def fetch(self, url: str, where: str, budget: list[int]) -> tuple[str, bytes]:
        """(media type, bytes) of `url`; `budget`: the request's bytes left, charged as bytes
        arrive (so fetches at once never hold more than the request may)."""
        lim = self.limits

        def charge(n: int) -> None:
            budget[0] -= n
            if budget[0] < 0:
                raise OverflowError(n)

        for _ in range(lim.max_redirects + 1):
            self.check_host(url, where)
            shown = f"{url[:200]!r}"
            try:
                status, headers, body = await self._get(
                    url, lim.max_item_bytes, lim.timeout_s, charge
                )
            except TimeoutError:
                raise MediaRefused(
                    where, f"fetching {shown} took over {lim.timeout_s} s (--media-fetch-timeout)"
                ) from None
            except OverflowError:
                raise MediaRefused(
                    where,
                    f"{shown} is over {lim.max_item_bytes} bytes (--media-max-bytes), or "
                    f"the request's media over {lim.max_request_bytes} in all",
                ) from None
            except ProxyError:
                raise
            except Exception as e:  # refused, reset, DNS, not HTTP, not public: one answer
                cause = getattr(e, "os_error", None) or e.__cause__ or e
                log = logger.info if isinstance(cause, AddressRefused) else logger.debug
                log("media fetch of %s for %s failed: %r", shown, where, cause)
                raise MediaRefused(where, f"could not fetch media from {shown}") from None
            if status in _REDIRECTS and "Location" in headers:
                charge(-len(body))
                try:
                    url = urljoin(url, headers["Location"])
                except ValueError:
                    raise MediaRefused(
                        where, f"fetching {shown} answered a redirect to an invalid URL"
                    ) from None
                continue
            if status != 200:
                raise MediaRefused(
                    where, f"failed to fetch media from {shown}: HTTP {int(status)} error"
                )
            ctype = headers.get("Content-Type", "").partition(";")[0].strip()
            # vLLM decodes fetched bytes as a file whatever their type; inline, video/jpeg alone
            # would be read as comma-separated frames instead
            if not _MEDIA_TYPE.fullmatch(ctype) or ctype.lower() == "video/jpeg":
                ctype = "application/octet-stream"
            return ctype, body
        raise MediaRefused(
            where, f"over {lim.max_redirects} redirects from the item's URL (--media-max-redirects)"
        )


# Fetched media up to this many bytes is inlined as a string; larger, as inline media kept as
# bytes (`proxy.body.Blobs`), base64-encoded and hashed in a thread in pieces: never one long
# GIL-holding call on the event loop.
_INLINE_FETCHED = 48 << 10
_B64_PIECE = 3 << 20  # bytes base64-encoded per call (a multiple of 3: no padding between)


async def name_by_content(
    request: dict[str, Any],
    fetcher: MediaFetcher,
    blobs: Blobs | None = None,
    *,
    off_loop: bool = False,
) -> tuple[int, Blobs | None]:
    """Give every media part its content uuid, in place, fetching http(s) media and inlining it
    as a data: URL; every `*_embeds` part that carries a uuid gets its payload's. Returns how
    many bytes were fetched, and the request's inline media (`blobs`, or new ones for large
    fetched media). `off_loop`: hash the request's own media in a thread (a large body). Raises
    `MediaRefused` (a 400) for a part that cannot be named."""
    salt = request.get("cache_salt")
    if off_loop:
        fetches = await asyncio.to_thread(_name_inline, request, fetcher, salt, blobs)
    else:
        fetches = _name_inline(request, fetcher, salt, blobs)
    if not fetches:
        return 0, blobs
    lim = fetcher.limits
    budget = [lim.max_request_bytes]
    gate = asyncio.Semaphore(lim.concurrency)  # a request's fetches at once
    got: list[asyncio.Task[tuple[str, bytes]]] = []

    async def one(where: str, url: str) -> tuple[str, bytes]:
        async with gate:
            return await fetcher.fetch(url, where, budget)

    try:
        async with asyncio.timeout(lim.request_timeout_s):  # the request's media in all
            async with asyncio.TaskGroup() as tasks:  # the first refusal cancels the others
                got += [tasks.create_task(one(where, url)) for where, _, _, url in fetches]
    except* MediaRefused as group:
        raise group.exceptions[0] from None
    except* TimeoutError:
        pending = (w for (w, *_), t in zip(fetches, got, strict=True) if t.cancelled())
        late = next(pending, fetches[0][0])
        raise MediaRefused(
            late,
            f"the request's media took over {lim.request_timeout_s} s in all "
            "(--media-request-timeout)",
        ) from None
    fetched = 0
    for (_, part, ref, _), task in zip(fetches, got, strict=True):
        media_type, body = task.result()
        kind = part["type"]
        if len(body) <= _INLINE_FETCHED:
            inline = f"data:{media_type};base64,{base64.b64encode(body).decode()}"
            uuid = content_name(salt, MODALITY[kind], inline, blobs)
        else:
            if blobs is None:
                from .body import Blobs

                blobs = Blobs()
            inline, uuid = await asyncio.to_thread(
                _inline_fetched, blobs, salt, MODALITY[kind], media_type, body
            )
        part[kind] = {**ref, "url": inline} if isinstance(ref, Mapping) else {"url": inline}
        part["uuid"] = uuid
        fetched += len(body)
    return fetched, blobs


def _inline_fetched(
    blobs: Blobs, salt: Any, modality: str, media_type: str, body: bytes
) -> tuple[str, str]:
    """(a placeholder for the data: URL of `body`, its content name): base64 in pieces."""
    pieces = [base64.b64encode(body[i : i + _B64_PIECE]) for i in range(0, len(body), _B64_PIECE)]
    inline = blobs.add(f"data:{media_type};base64,".encode(), *pieces)
    return inline, content_name(salt, modality, inline, blobs)


def _name_inline(
    request: dict[str, Any], fetcher: MediaFetcher, salt: Any, blobs: Blobs | None
) -> list[tuple[str, dict[str, Any], Any, str]]:
    """Name every part whose media the request carries, in place; the http(s) ones to fetch
    (where, part, its reference, URL), each host checked before any fetch."""
    fetches: list[tuple[str, dict[str, Any], Any, str]] = []
    for where, part in media_parts(request):
        kind = part["type"]
        if kind in EMBEDS_PARTS:
            if part.get(kind) is None:  # "cached by uuid": nothing to check the name against
                raise MediaRefused(
                    where, "the part names no embedding (a uuid alone cannot be checked)"
                )
            if part.get("uuid"):
                part["uuid"] = embeds_name(salt, kind, part.get(kind), blobs)
            continue
        modality = MODALITY[kind]
        if kind == "input_audio":
            audio = part.get("input_audio")
            if not isinstance(audio, Mapping) or not isinstance(audio.get("data"), str):
                raise MediaRefused(where, "input_audio carries no data")
            check_named_by_json(part)
            part["uuid"] = content_name(salt, modality, _canonical(audio), blobs, json=True)
            continue
        ref, url = _url_of(part)
        if not isinstance(url, str) or not url:
            raise MediaRefused(
                where, "the part names no media (a uuid alone cannot be checked against it)"
            )
        head = url[:5] if blobs is None else blobs.head(url, 5)
        if head.lower() == "data:":
            part["uuid"] = content_name(salt, modality, url, blobs)  # vLLM refuses a malformed one
        elif blobs is not None and blobs.length(url) != len(url):
            raise MediaRefused(where, f"an http(s) URL of {blobs.length(url)} characters")
        else:
            fetcher.check_host(url, where)  # every refusal before any fetch
            fetches.append((where, part, ref, url))
    return fetches
