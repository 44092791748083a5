"""Step 1 of the chat route: read the client's request into one record (`ClientRequest`).

The body is read within --max-body-*, the fields only the proxy may set are stripped, the media
parts are found as vLLM classifies them and named by --uuid-policy, all before any per-item
work; a body over OFF_LOOP_BYTES is scanned, decoded and named off the event loop.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, NamedTuple

from aiohttp import web

from ..demand_query import DEMAND_ID_KEY  # P reads it from vllm_xargs
from . import body as bodies
from .body import Blobs, BodyLimits
from .config import MediaConfig, UuidPolicy
from .content import MediaFetcher, name_by_content
from .encoder import E_COPIED_KEYS, EncoderFanout
from .errors import ProxyError
from .ids import new_uuid4
from .media import check_cache_salt, item_uuid, namespace_uuids, scan_parts
from .metrics import ProxyMetrics

# The proxy's own channel to P and D: a client's values would reach them verbatim (a connector
# handle naming a host of its choosing, an embedding cached under an identifier others share).
CLIENT_FIELDS_STRIPPED = ("ec_transfer_params", "kv_transfer_params")
_ABSENT = object()
# A body larger than this is scanned, decoded, walked and named off the event loop (a thread;
# its inline media is never decoded: `proxy.body`). Smaller ones cost less than the thread hop.
OFF_LOOP_BYTES = 1 << 20


class ClientRequest(NamedTuple):
    """What the client sent, read once (`RequestReader.read`); never changed afterwards, so a
    retry starts from the original media (a NamedTuple: one per request, on the hot path).

    Attributes:
        body: the request, without the fields only the proxy sets.
        items: its media parts, request order (the parts themselves, named in place).
        uuids: each item's uuid (--uuid-policy).
        request_id: the client's x-request-id, else a fresh uuid4 (as the reference).
        blobs: a large body's inline media, kept out of `body` (`proxy.body`), else None.
        stream: the client asked for a stream.
    """

    body: dict[str, Any]
    items: list[dict[str, Any]]
    uuids: list[str]
    request_id: str
    blobs: Blobs | None = None
    stream: bool = False


_Parsed = tuple[dict[str, Any], list[dict[str, Any]], list[str] | None, Blobs | None]


class RequestReader:
    """Reads a client's request under the proxy's limits and --uuid-policy."""

    def __init__(
        self,
        config: MediaConfig,
        encoders: EncoderFanout,
        media: MediaFetcher,
        metrics: ProxyMetrics,
    ) -> None:
        """`config`: the media section (naming, bounds); `encoders`: E's fan-out, which
        bounds what a request's copied fields may add to E's traffic; `media`: the fetcher
        --uuid-policy content names items with."""
        self.limits = BodyLimits(
            config.max_body_bytes, config.max_body_values, config.max_body_text_bytes
        )
        self.uuid_policy = config.uuid_policy
        self.limit_mm_per_prompt = config.limit_mm_per_prompt
        self.encoders = encoders
        self.media = media
        self.metrics = metrics

    async def read(self, request: web.Request) -> ClientRequest:
        """The client's request, its media parts and their uuids (`parse`, named by
        --uuid-policy), and its inline media."""
        raw = await bodies.read_body(request, self.limits.max_bytes)
        big = len(raw) > OFF_LOOP_BYTES  # its scan, decode, walk and hashes: in a thread
        req, items, uuids, blobs = (
            await asyncio.to_thread(self.parse, raw) if big else self.parse(raw)
        )
        del raw
        if uuids is None:  # --uuid-policy content
            tm = time.perf_counter()
            fetched, blobs = await name_by_content(req, self.media, blobs, off_loop=big)
            self.metrics.stage["media"].observe(time.perf_counter() - tm)
            if fetched:
                self.metrics.media_fetched.inc(fetched)
            uuids = [item_uuid(item) for item in items]  # each named by its bytes now
        req_id = request.headers.get("x-request-id")
        if req_id is None:  # as the reference: an empty header stays empty
            req_id = new_uuid4()
        return ClientRequest(req, items, uuids, req_id, blobs, bool(req.get("stream", False)))

    def parse(self, body: bytes | bytearray) -> _Parsed:
        """The client's request (`proxy.body.decode`, within --max-body-*), without the fields
        only the proxy may set, its media parts as vLLM classifies them (`scan_parts`: the
        parts themselves, so the naming is in place) and, unless --uuid-policy content names
        them by their fetched bytes, their uuids; a 400 for what cannot be passed on, before
        any per-item work."""
        req, blobs = bodies.decode(body, self.limits, keep=len(body) > OFF_LOOP_BYTES)
        if not isinstance(req, dict):
            raise ProxyError(400, "The body must be a JSON object", stage="proxy")
        for key in CLIENT_FIELDS_STRIPPED:
            if req.pop(key, _ABSENT) is not _ABSENT:
                self.metrics.stripped(key).inc()
        xargs = req.get("vllm_xargs")
        if isinstance(xargs, dict) and DEMAND_ID_KEY in xargs:  # the proxy's channel to P
            req["vllm_xargs"] = {k: v for k, v in xargs.items() if k != DEMAND_ID_KEY}
            self.metrics.stripped(f"vllm_xargs.{DEMAND_ID_KEY}").inc()
        if "cache_salt" in req:  # vLLM refuses a bad one: before naming hashes it per item
            check_cache_salt(req)
        items = scan_parts(req, self.limit_mm_per_prompt)
        if items and not req.keys().isdisjoint(E_COPIED_KEYS):
            self.encoders.check_shared(req, items, len(body), blobs)
        if self.uuid_policy == UuidPolicy.CONTENT:
            return req, items, None, blobs  # named by their bytes (`read`)
        if self.uuid_policy == UuidPolicy.TENANT:
            namespace_uuids(req, blobs)
        return req, items, [item_uuid(item, blobs) for item in items], blobs
