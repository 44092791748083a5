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
import re
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urljoin, urlsplit

import msgspec

from .errors import ProxyError
from .media import EMBEDS_PARTS, MM_TYPES, MODALITY

# A media type as forwarded in a data: URL (RFC 2045 token chars; parameters dropped): one a
# fetched item's Content-Type gives, else application/octet-stream.
_MEDIA_TYPE = re.compile(r"[A-Za-z0-9!#$&^_.+-]+/[A-Za-z0-9!#$&^_.+-]+")
_REDIRECTS = frozenset({301, 302, 303, 307, 308})
_json = msgspec.json.Encoder().encode
_canonical = msgspec.json.Encoder(order="sorted").encode  # keys sorted, compact


@dataclass(frozen=True, slots=True)
class MediaLimits:
    """What the proxy may fetch for one request: bytes per item and in all, seconds per item,
    redirects per item, fetches at once, and the hosts it may fetch from (None: any, as vLLM's
    `--allowed-media-domains` unset)."""

    max_item_bytes: int = 32 << 20
    max_request_bytes: int = 1 << 30  # what a client body may carry (the same base64 inline)
    timeout_s: float = 10.0
    max_redirects: int = 5
    concurrency: int = 8
    allowed_domains: frozenset[str] | None = None


class MediaRefused(ProxyError):
    """A media part that cannot be named by its content: the client's request is refused."""

    def __init__(self, where: str, why: str) -> None:
        super().__init__(400, f"{where}: {why} (--uuid-policy content)", stage="media")


# One hop: get(url, max bytes, timeout s, charge) -> (status, its Location and Content-Type
# headers, body); `charge(n)` as n bytes arrive (OverflowError past either bound).
Fetch = Callable[
    [str, int, float, Callable[[int], None]], Awaitable[tuple[int, Mapping[str, str], bytes]]
]


def content_name(salt: Any, modality: str, media: str) -> str:
    """The uuid of media as forwarded: sha256 of the salt and the modality (a JSON array, which
    ends itself), then `media`, the text that carries the bytes (a data: URL, an
    `input_audio`'s canonical JSON). That text determines every byte vLLM decodes, so one name
    is never two contents."""
    h = hashlib.sha256(_json(["mmreuse-content-v1", salt, modality]))
    h.update(media.encode())
    return h.hexdigest()


def embeds_name(salt: Any, kind: str, value: Any) -> str:
    """The uuid of a client's `*_embeds` part: its payload's canonical JSON, named as media."""
    return content_name(salt, kind, _canonical(value).decode())


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
    against the allowed hosts before it is requested, bytes counted as they arrive."""

    def __init__(self, limits: MediaLimits, get: Fetch) -> None:
        self.limits = limits
        self._get = get

    def check_host(self, url: str, where: str) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise MediaRefused(where, f"{url[:200]!r} is not an http(s), data: or input_audio item")
        allowed = self.limits.allowed_domains
        if allowed is not None and parts.hostname not in allowed:
            raise MediaRefused(
                where, f"{parts.hostname!r} is not in --allowed-media-domains {sorted(allowed)}"
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
            try:
                status, headers, body = await self._get(
                    url, lim.max_item_bytes, lim.timeout_s, charge
                )
            except TimeoutError:
                raise MediaRefused(
                    where, f"fetching {url[:200]!r} took over {lim.timeout_s} s"
                ) from None
            except OverflowError:
                raise MediaRefused(
                    where,
                    f"{url[:200]!r} is over {lim.max_item_bytes} bytes (--media-max-bytes), or "
                    f"the request's media over {lim.max_request_bytes} in all",
                ) from None
            except ProxyError:
                raise
            except Exception as e:  # unreachable, refused, reset: the client's URL, a 400
                raise MediaRefused(where, f"fetching {url[:200]!r} failed: {e}") from None
            if status in _REDIRECTS and "Location" in headers:
                charge(-len(body))
                url = urljoin(url, headers["Location"])
                continue
            if status != 200:
                raise MediaRefused(where, f"fetching {url[:200]!r} answered HTTP {status}")
            ctype = headers.get("Content-Type", "").partition(";")[0].strip()
            # vLLM decodes fetched bytes as a file whatever their type; inline, video/jpeg alone
            # would be read as comma-separated frames instead
            if not _MEDIA_TYPE.fullmatch(ctype) or ctype.lower() == "video/jpeg":
                ctype = "application/octet-stream"
            return ctype, body
        raise MediaRefused(where, f"over {lim.max_redirects} redirects from the item's URL")


async def name_by_content(request: dict[str, Any], fetcher: MediaFetcher) -> int:
    """Give every media part its content uuid, in place, fetching http(s) media and inlining it
    as a data: URL; every `*_embeds` part that carries a uuid gets its payload's. Returns how
    many bytes were fetched. Raises `MediaRefused` (a 400) for a part that cannot be named."""
    salt = request.get("cache_salt")
    fetches: list[tuple[str, dict[str, Any], Any, str]] = []
    for where, part in media_parts(request):
        kind = part["type"]
        if kind in EMBEDS_PARTS:
            if part.get(kind) is None:  # "cached by uuid": nothing to check the name against
                raise MediaRefused(
                    where, "the part names no embedding (a uuid alone cannot be checked)"
                )
            if part.get("uuid"):
                part["uuid"] = embeds_name(salt, kind, part.get(kind))
            continue
        modality = MODALITY[kind]
        if kind == "input_audio":
            audio = part.get("input_audio")
            if not isinstance(audio, Mapping) or not isinstance(audio.get("data"), str):
                raise MediaRefused(where, "input_audio carries no data")
            text = _canonical(audio).decode()
            part["uuid"] = content_name(salt, modality, text)
            continue
        ref, url = _url_of(part)
        if not isinstance(url, str) or not url:
            raise MediaRefused(
                where, "the part names no media (a uuid alone cannot be checked against it)"
            )
        if url[:5].lower() == "data:":
            part["uuid"] = content_name(salt, modality, url)  # vLLM refuses a malformed one
        else:
            fetcher.check_host(url, where)  # every refusal before any fetch
            fetches.append((where, part, ref, url))
    if not fetches:
        return 0
    budget = [fetcher.limits.max_request_bytes]
    gate = asyncio.Semaphore(fetcher.limits.concurrency)

    async def one(where: str, url: str) -> tuple[str, bytes]:
        async with gate:
            return await fetcher.fetch(url, where, budget)

    try:
        async with asyncio.TaskGroup() as tasks:  # the first refusal cancels the others
            got = [tasks.create_task(one(where, url)) for where, _, _, url in fetches]
    except* MediaRefused as group:
        raise group.exceptions[0] from None
    fetched = 0
    for (_, part, ref, _), task in zip(fetches, got, strict=True):
        media_type, body = task.result()
        inline = f"data:{media_type};base64,{base64.b64encode(body).decode()}"
        kind = part["type"]
        part[kind] = {**ref, "url": inline} if isinstance(ref, Mapping) else {"url": inline}
        part["uuid"] = content_name(salt, MODALITY[kind], inline)
        fetched += len(body)
    return fetched
