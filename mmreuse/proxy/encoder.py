"""E fan-out: group the items to encode per encoder, send them, read E's metadata back.

The reference proxy's `fanout_encoder_primer`, wire for wire: images assigned to the same
encoder share one sub-request (up to ENCODER_MAX_BATCH_SIZE), audio and video go one per
sub-request, the child request id is `<req_id>:<first item index>:<6 hex>`, the round-robin
cursor carries on across requests, and results are matched by `item_indices`. The additions:
`indices` names the items to send, so a demand-aware policy sends E only what P still needs;
`start` sends the same sub-requests as separate tasks, so that `opportunistic` can abandon
those P's answer rules out while they are in flight.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import yarl

from .body import Blobs, encode_body, size_of
from .errors import ProxyError
from .failover import FAILED_CONNECTION, Ejections
from .ids import new_hex
from .media import EMBEDS_TYPES, item_uuid, uses_audio_in_video
from .upstream import Upstream

logger = logging.getLogger("mmreuse.proxy")

# Copied from the client request onto each E sub-request when present (E processes and loads
# the media as P will, and schedules it as asked).
E_COPIED_KEYS = ("mm_processor_kwargs", "media_io_kwargs", "priority", "session_id")
# What those copies may add to E's traffic for one request, in all: this much, or the request's
# own size where larger. Audio and video go one item per sub-request, so a request of many
# small items and a large copied field would otherwise multiply that field into E (999 x it).
E_COPIES_FLOOR = 1 << 20

_decode = msgspec.json.Decoder()
_encode = msgspec.json.Encoder()


@functools.lru_cache(maxsize=256)
def chat_url(base: str) -> yarl.URL:
    """`<base>/v1/chat/completions`, parsed once (aiohttp would parse the string each call)."""
    return yarl.URL(f"{base}/v1/chat/completions")


@dataclass(frozen=True, slots=True)
class EncodeResult:
    """What E reported: per item index its features, and the connector handles for P."""

    item_meta: dict[int, list[dict[str, Any]]]
    ec_params: dict[str, Any]
    subrequests: int


EMPTY = EncodeResult({}, {}, 0)


class EncoderFanout:
    """The encoders, the shared round-robin cursor and the batching rule."""

    def __init__(
        self,
        urls: Sequence[str],
        upstream: Any,
        *,
        max_batch_size: int = 0,
        no_rewrite: bool = False,
        health: Ejections | None = None,
        on_failover: Callable[[], None] | None = None,
        timeout_s: float = 0.0,
    ) -> None:
        """`health`: which E's are up (`failover.Ejections`; made here where not given);
        `on_failover()`: called for each sub-request sent to another E after its own failed;
        `timeout_s`: how long an E may take to answer a sub-request (0: no bound)."""
        self.urls = list(urls)
        self._upstream = upstream  # () -> Upstream (created on startup)
        self.max_batch_size = max_batch_size
        self.no_rewrite = no_rewrite
        self.health = health if health is not None else Ejections("E", self.urls)
        self._on_failover = on_failover
        self.timeout_s = timeout_s

    def subrequests_bound(self, items: Sequence[Mapping[str, Any]]) -> int:
        """The most sub-requests `items` can take (`groups`, whichever E gets them): one per
        audio or video item, one per encoder batch of images."""
        images = sum(1 for item in items if item["type"] == "image_url")
        batches = images // self.max_batch_size if self.max_batch_size else 0
        return len(items) - images + min(images, len(self.urls)) + batches

    def check_shared(
        self,
        request: Mapping[str, Any],
        items: Sequence[Mapping[str, Any]],
        request_bytes: int,
        blobs: Blobs | None = None,
    ) -> None:
        """Refuse (a 400 naming the field) a request whose E_COPIED_KEYS, copied into each of
        its sub-requests, would send E more than E_COPIES_FLOOR or `request_bytes` in all:
        checked when the request is read, before anything is sent."""
        if not items or request.keys().isdisjoint(E_COPIED_KEYS):
            return
        present = [key for key in E_COPIED_KEYS if key in request]
        sizes = {}
        for key in present:
            out = _encode.encode(request[key])
            sizes[key] = len(out) if blobs is None else size_of(blobs.splice(out))
        subs = self.subrequests_bound(items)
        total = sum(sizes.values()) * subs
        allowed = max(E_COPIES_FLOOR, request_bytes)
        if total > allowed:
            largest = max(present, key=sizes.__getitem__)
            raise ProxyError(
                400,
                f"{largest} ({sizes[largest]} bytes) is copied into each encoder sub-request, "
                f"and this request takes up to {subs} (one per audio or video item): "
                f"{total} bytes in all, over the {allowed} allowed (the request's own size, "
                f"at least {E_COPIES_FLOOR}); send fewer such items per request, or a smaller "
                f"{largest}",
                stage="proxy",
            )

    def groups(self, items: Sequence[Mapping[str, Any]], indices: Sequence[int]):
        """(encoder url, item indices) per sub-request."""
        groups: list[tuple[str, list[int]]] = []
        image_groups: dict[str, list[int]] = {}
        # the next encoders in the rotation (contiguous across requests), the ejected skipped
        for idx, target in zip(indices, self.health.assign(len(indices)), strict=True):
            if items[idx]["type"] == "image_url":
                batch = image_groups.get(target)
                if batch is None or (self.max_batch_size and len(batch) >= self.max_batch_size):
                    batch = image_groups[target] = []
                    groups.append((target, batch))
                batch.append(idx)
            else:
                groups.append((target, [idx]))
        return groups

    async def encode(
        self,
        request: Mapping[str, Any],
        items: Sequence[Mapping[str, Any]],
        indices: Sequence[int],
        req_id: str,
        uuids: Sequence[str] | None = None,
    ) -> EncodeResult:
        """Send items[indices] to E; raise ProxyError (E's status, or 502) if any fails.
        `uuids`: the items' uuids when already computed."""
        if not indices:
            return EMPTY
        subs = self._build(request, items, indices, req_id, uuids)
        upstream = self._upstream()
        posts = [self._post(upstream, req, req_id) for req in subs.requests]
        if len(posts) == 1:  # the common case: no gather (a task per sub-request) needed
            try:
                results: list[Any] = [await posts[0]]
            except Exception as e:
                results = [e]
        else:
            results = await asyncio.gather(*posts, return_exceptions=True)
        return _collect(subs, items, results, req_id)

    def start(
        self,
        request: Mapping[str, Any],
        items: Sequence[Mapping[str, Any]],
        indices: Sequence[int],
        req_id: str,
        uuids: Sequence[str] | None = None,
    ) -> Encoding:
        """What `encode` sends (the same groups, ids and bodies), each sub-request as its own
        task, so that some can be abandoned while in flight (`Encoding`)."""
        subs = self._build(request, items, indices, req_id, uuids)
        upstream = self._upstream()
        tasks = [asyncio.ensure_future(self._post(upstream, req, req_id)) for req in subs.requests]
        return Encoding(subs, items, req_id, tasks)

    async def _post(self, upstream: Upstream, req: _SubRequest, req_id: str) -> tuple[int, bytes]:
        """One sub-request to its E (`target`); where its connection fails, or it stalls past
        the bound while another E is up, that E is ejected and the sub-request goes once to the
        next live E (it encodes the items again: E's embedding is the items', whichever E makes
        it)."""
        target, url, body, headers = req
        try:
            # the bound only where another E could take the sub-request: a lone E stalled is
            # waited for (as the reference waits), bounded by the request's deadline alone
            if (bound := self.health.bound(target, self.timeout_s)) is not None:
                async with asyncio.timeout(bound):
                    result = await _post(upstream, url, body, headers)
            else:  # `_post`, inline: one coroutine less per sub-request
                resp = await upstream.post(url, await encode_body(body), headers)
                try:
                    result = resp.status, await resp.read()
                finally:
                    resp.release()
        except (*FAILED_CONNECTION, TimeoutError) as e:
            return await self._fail_over(upstream, target, req, req_id, e)
        if self.health.failing:
            self.health.ok(target)
        return result

    async def _fail_over(
        self,
        upstream: Upstream,
        target: str,
        req: _SubRequest,
        req_id: str,
        error: BaseException,
    ) -> tuple[int, bytes]:
        """`target` failed with `error`: eject it, and send the sub-request once to the next
        live E (or raise `error` where there is none)."""
        health = self.health
        health.eject(target)
        other = health.instead_of(target)
        if other is None:
            raise _timed_out(error, target)
        logger.warning(
            "[%s] encoder %s failed (%s: %s); ejected, the sub-request goes to %s",
            req_id, target, type(error).__name__, error, other,
        )  # fmt: skip
        if self._on_failover is not None:
            self._on_failover()
        _, _, body, headers = req
        try:
            async with asyncio.timeout(health.bound(other, self.timeout_s)):
                result = await _post(upstream, chat_url(other), body, headers)
        except (*FAILED_CONNECTION, TimeoutError) as e:
            health.eject(other)
            raise _timed_out(e, other) from e
        health.ok(other)
        return result

    def _build(
        self,
        request: Mapping[str, Any],
        items: Sequence[Mapping[str, Any]],
        indices: Sequence[int],
        req_id: str,
        uuids: Sequence[str] | None,
    ) -> _SubRequests:
        groups = self.groups(items, indices)
        audio_in_video = uses_audio_in_video(request)
        item_uuids: dict[int, str] = {}
        transfer_ids: dict[int, list[str]] = {}
        requests = []
        for target, batch in groups:
            headers = {
                "x-request-id": f"{req_id}:{batch[0]}:{new_hex(24)}",
                "Content-Type": "application/json",
            }
            content = []
            for idx in batch:
                item = items[idx]
                uid = (
                    None
                    if self.no_rewrite
                    else uuids[idx]
                    if uuids is not None
                    else item_uuid(item)
                )
                if uid is not None:
                    item_uuids[idx] = uid
                n = 1 + int(item["type"] == "video_url" and audio_in_video)
                transfer_ids[idx] = [new_hex(128) for _ in range(n)]
                content.append(item if uid is None else {**item, "uuid": uid})
            body: dict[str, Any] = {
                "model": request.get("model"),
                "messages": [{"role": "user", "content": content}],
                "stream": False,
            }
            for key in E_COPIED_KEYS:
                if key in request:
                    body[key] = request[key]
            requests.append((target, chat_url(target), body, headers))
        return _SubRequests(groups, requests, item_uuids, transfer_ids)


_SubRequest = tuple[str, yarl.URL, dict[str, Any], dict[str, str]]  # E, its URL, body, headers


@dataclass(frozen=True, slots=True)
class _SubRequests:
    """One request's E sub-requests: (encoder, item indices) and (encoder, url, body,
    headers) each."""

    groups: list[tuple[str, list[int]]]
    requests: list[_SubRequest]
    item_uuids: dict[int, str]
    transfer_ids: dict[int, list[str]]


class Encoding:
    """E sub-requests in flight, one task each (`EncoderFanout.start`). `abandon(g)` cancels
    sub-request g while it runs (its connection is closed; vLLM aborts a request whose
    client went away); `finish()` waits for the others and reads them as `encode` does."""

    def __init__(
        self,
        subs: _SubRequests,
        items: Sequence[Mapping[str, Any]],
        req_id: str,
        tasks: list[asyncio.Task[tuple[int, bytes]]],
    ) -> None:
        self._subs, self._items, self._req_id = subs, items, req_id
        self.tasks = tasks
        self.abandoned: set[int] = set()
        for task in tasks:  # an abandoned or unread sub-request's error is not "never retrieved"
            task.add_done_callback(_retrieve)

    @property
    def groups(self) -> list[tuple[str, list[int]]]:
        return self._subs.groups

    def abandon(self, g: int) -> bool:
        """Cancel sub-request g if it is still in flight; whether it was."""
        task = self.tasks[g]
        if task.done():
            return False
        task.cancel()
        self.abandoned.add(g)
        return True

    def cancel(self) -> None:
        """Abandon every sub-request still in flight (the request is gone)."""
        for g in range(len(self.tasks)):
            self.abandon(g)

    async def finish(self) -> EncodeResult:
        """The sub-requests not abandoned, read as `encode` reads them (ProxyError if one
        failed); the abandoned ones have no item_meta."""
        kept = [t for g, t in enumerate(self.tasks) if g not in self.abandoned]
        try:
            if kept:
                await asyncio.wait(kept)
        except asyncio.CancelledError:
            self.cancel()
            raise
        results = [
            None if g in self.abandoned else (t.exception() or t.result())
            for g, t in enumerate(self.tasks)
        ]
        return _collect(self._subs, self._items, results, self._req_id, self.abandoned)


def _timed_out(error: BaseException, url: str) -> BaseException:
    """A timed-out sub-request as the client's error (504, naming the E); any other error as
    it is."""
    if isinstance(error, TimeoutError):
        return ProxyError(504, f"Encoder {url} did not answer in time", stage="encode")
    return error


def _retrieve(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()


def _collect(
    subs: _SubRequests,
    items: Sequence[Mapping[str, Any]],
    results: Sequence[Any],
    req_id: str,
    skip: set[int] | frozenset[int] = frozenset(),
) -> EncodeResult:
    """E's answers, matched to their items; raise ProxyError at the first that failed
    (sub-requests in `skip` were abandoned: not read)."""
    item_meta: dict[int, list[dict[str, Any]]] = {}
    ec_params: dict[str, Any] = {}
    for g, ((_, batch), result) in enumerate(zip(subs.groups, results, strict=True)):
        if g in skip:
            continue
        first = batch[0]
        if isinstance(result, ProxyError):  # a sub-request's own status (504: timed out)
            raise result
        if isinstance(result, BaseException):
            logger.error("[%s] encoder request #%d raised: %s", req_id, first, result)
            raise ProxyError(502, f"Encoder request failed: {result}", stage="encode")
        status, payload = result
        if status != 200:
            detail = payload.decode("utf-8", "replace")
            logger.error("[%s] encoder request #%d: %s %s", req_id, first, status, detail)
            raise ProxyError(status, f"Encoder request failed: {detail}", stage="encode")
        try:
            params = _decode.decode(payload).get("ec_transfer_params") or {}
        except Exception:
            logger.warning("[%s] could not read encoder metadata #%d", req_id, first)
            params = {}
        if params:
            _match(params, batch, items, subs.item_uuids, subs.transfer_ids, item_meta, ec_params)
    return EncodeResult(item_meta, ec_params, len(subs.groups))


async def _post(
    upstream: Upstream, url: yarl.URL, body: Any, headers: dict[str, str]
) -> tuple[int, bytes]:
    resp = await upstream.post(url, await encode_body(body), headers)
    try:
        return resp.status, await resp.read()
    finally:
        resp.release()


def _match(
    params: dict[str, Any],
    batch: list[int],
    items: Sequence[Mapping[str, Any]],
    item_uuids: dict[int, str],
    transfer_ids: dict[int, list[str]],
    item_meta: dict[int, list[dict[str, Any]]],
    ec_params: dict[str, Any],
) -> None:
    """The reference's matching of E's `ec_transfer_params` entries to the batch's items."""
    if not isinstance(params, dict) or not all(isinstance(v, dict) for v in params.values()):
        raise ProxyError(502, "Invalid encoder metadata", stage="encode")
    by_index: dict[int, tuple[str, dict[str, Any]]] = {}
    if len(batch) > 1:
        for mm_hash, reported in params.items():
            for local in reported.get("item_indices", []):
                if type(local) is not int or not 0 <= local < len(batch):
                    raise ProxyError(502, "Invalid encoder item index", stage="encode")
                if local in by_index:
                    raise ProxyError(502, "Duplicate encoder item index", stage="encode")
                by_index[local] = (mm_hash, reported)
    for local, idx in enumerate(batch):
        audio_in_video = (
            len(transfer_ids[idx]) == 2
            and len(params) == 2
            and {entry.get("modality") for entry in params.values()} == {"video", "audio"}
        )
        if audio_in_video:
            features = sorted(params.items(), key=lambda pair: pair[1]["modality"] != "video")
            positions = [entry.get("item_indices") for _, entry in features]
            if positions not in ([[0], [1]], [[1], [0]]):
                raise ProxyError(502, "Invalid encoder audio/video indices", stage="encode")
        else:
            matched = by_index.get(local)
            if matched is None:
                uid = item_uuids.get(idx)
                if uid is not None and uid in params:
                    matched = (uid, params[uid])
                elif len(batch) == 1 and len(params) == 1:
                    matched = next(iter(params.items()))
                else:
                    raise ProxyError(502, "Encoder metadata cannot be matched", stage="encode")
            features = [matched]
        item_meta[idx] = []
        for mm_hash, reported in features:
            feature_index = reported["item_indices"][0] if audio_in_video else 0
            transfer_id = reported.get("transfer_id") or transfer_ids[idx][feature_index]
            item_meta[idx].append(
                {
                    "metadata": reported.get("metadata") or {},
                    "modality": reported.get("modality")
                    or EMBEDS_TYPES[items[idx]["type"]].removesuffix("_embeds"),
                    "mm_hash": mm_hash,
                    "transfer_id": transfer_id,
                }
            )
        ec_params.update(features)
