"""The proxy's side of the demand wire (`mmreuse.demand_query`): one ZMQ DEALER per P/PD.

`DemandClient.ask(query, timeout)` sends a `DemandQuery` to that P's `DemandScheduler` and
returns its `DemandAnswer`, checked against the query (`decode_answer`); every way of not
getting one (no answer in time, P's `DemandError`, a malformed answer, too many queries in
flight, a closed client) raises `DemandUnavailable`, which costs the request its plan, never the
request. One reader task routes answers to their askers by query id (P answers in any order); a
frame that names no pending query, or is not an answer at all, is counted and dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

import msgspec

from ..demand_query import (
    MAX_ANSWER_BYTES,
    Answer,
    DemandAnswer,
    DemandError,
    DemandQuery,
    DemandStats,
    MalformedAnswer,
    StatsQuery,
    decode_answer,
    encode,
)
from ..validate import check_float, check_int, check_str, fail_value
from .ids import new_hex

logger = logging.getLogger("mmreuse.proxy")

# Why no answer came: the outcome label of `mmreuse_proxy_demand_answers_total` ("ok" aside).
OUTCOMES = ("ok", "timeout", "error", "malformed", "refused")
DROPS = ("unknown_id", "malformed")  # frames the reader dropped
ZMQ_SCHEMES = ("tcp://", "ipc://", "inproc://")
DEFAULT_MAX_IN_FLIGHT = 1024
READ_BATCH = 32  # frames the reader takes before it yields to the event loop


class DemandUnavailable(Exception):
    """No usable answer. `outcome`: "timeout", "error" (P's DemandError), "malformed" (an
    answer `decode_answer` refused, or of the wrong kind) or "refused" (too many queries in
    flight, or the client is closed); the message is "<outcome>: <detail>"."""

    def __init__(self, outcome: str, detail: str) -> None:
        super().__init__(f"{outcome}: {detail}")
        self.outcome = outcome
        self.detail = detail


class _Named(msgspec.Struct):
    """Any frame's `id`, read before the whole answer is (to find its query)."""

    id: str


_named = msgspec.msgpack.Decoder(_Named)


class DemandClient:
    """One P's demand endpoint. `start()` inside the event loop that will use it; `close()` on
    proxy stop. `observe(outcome, seconds)`, when given, is told each query's outcome and its
    round trip (from send to answer; None for a timeout or a refusal)."""

    def __init__(
        self,
        endpoint: str,
        *,
        name: str = "P0",
        max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
        observe: Any = None,
        drop: Any = None,
    ) -> None:
        check_str("endpoint", endpoint, nonempty=True)
        if not endpoint.startswith(ZMQ_SCHEMES):
            fail_value("endpoint", f"a ZMQ endpoint ({', '.join(ZMQ_SCHEMES)})", endpoint)
        self.endpoint = endpoint
        self.name = check_str("name", name, nonempty=True)
        self.max_in_flight = check_int("max_in_flight", max_in_flight, 1)
        self._observe = observe  # (outcome, rtt_s | None) -> None
        self._drop = drop  # (reason) -> None
        self._pending: dict[str, tuple[DemandQuery | StatsQuery, asyncio.Future[Answer]]] = {}
        self._ctx: Any = None
        self._sock: Any = None
        self._reader: asyncio.Task[None] | None = None
        self._closed = False
        self.counts = dict.fromkeys(OUTCOMES, 0)
        self.dropped = dict.fromkeys(DROPS, 0)
        self.last_outcome: str | None = None
        self.last_detail: str | None = None

    # ---- lifecycle ----------------------------------------------------------------------------

    def start(self) -> DemandClient:
        """Connect (ZMQ connects in the background and reconnects on its own)."""
        if self._sock is not None or self._closed:
            raise RuntimeError(f"demand client {self.name} already started or closed")
        import zmq
        import zmq.asyncio

        self._ctx = zmq.asyncio.Context()
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IMMEDIATE, 1)  # no queueing for a P not connected: its queries wait
        # A hostile or broken P: a frame larger than any answer drops the connection, and past a
        # few answers per query in flight ZMQ stops reading from P (backpressure), never queues.
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_ANSWER_BYTES)
        sock.setsockopt(zmq.RCVHWM, 2 * self.max_in_flight + 16)
        sock.connect(self.endpoint)
        self._sock = sock
        self._reader = asyncio.get_running_loop().create_task(self._read())
        return self

    async def close(self) -> None:
        """Stop reading, fail every pending query ("refused: closed") and close the socket."""
        self._closed = True
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
            self._reader = None
        for _, fut in self._pending.values():
            if not fut.done():
                fut.set_exception(DemandUnavailable("refused", "the demand client closed"))
        self._pending.clear()
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    # ---- queries ------------------------------------------------------------------------------

    @property
    def in_flight(self) -> int:
        return len(self._pending)

    async def ask(self, query: DemandQuery, timeout: float) -> DemandAnswer:
        """P's answer to `query`, validated against it; raises DemandUnavailable."""
        if not isinstance(query, DemandQuery):
            fail_value("query", "a DemandQuery", query)
        answer = await self._request(query, timeout)
        assert isinstance(answer, DemandAnswer)
        return answer

    async def stats(self, check_index: bool = False, timeout: float = 5.0) -> DemandStats:
        """P's demand counters (with `check_index`, its residency index checked block by block
        against vLLM's prefix cache, which takes P's lock for as long)."""
        answer = await self._request(StatsQuery(new_hex(128), check_index=check_index), timeout)
        assert isinstance(answer, DemandStats)
        return answer

    async def _request(self, query: DemandQuery | StatsQuery, timeout: float) -> Answer:
        timeout = check_float("timeout", timeout, 0.0, lo_open=True)
        if self._closed or self._sock is None:
            raise self._failed(DemandUnavailable("refused", "the demand client is not running"))
        if len(self._pending) >= self.max_in_flight:
            raise self._failed(
                DemandUnavailable("refused", f"{self.max_in_flight} queries already in flight")
            )
        if query.id in self._pending:
            fail_value("query.id", "not the id of a query in flight", query.id)
        fut: asyncio.Future[Answer] = asyncio.get_running_loop().create_future()
        self._pending[query.id] = (query, fut)
        t0 = time.perf_counter()
        sent = False
        try:
            async with asyncio.timeout(timeout):
                await self._sock.send(encode(query))
                sent = True
                answer = await fut
        except TimeoutError:
            where = "answer" if sent else "connection to P (the query was not sent)"
            raise self._failed(
                DemandUnavailable("timeout", f"no {where} within {timeout} s")
            ) from None
        except DemandUnavailable as e:
            raise self._failed(e, time.perf_counter() - t0) from None
        finally:
            self._pending.pop(query.id, None)
        self._count("ok", None, time.perf_counter() - t0)
        return answer

    def _failed(self, error: DemandUnavailable, rtt_s: float | None = None) -> DemandUnavailable:
        self._count(error.outcome, error.detail, rtt_s)
        return error

    def _count(self, outcome: str, detail: str | None, rtt_s: float | None) -> None:
        self.counts[outcome] += 1
        self.last_outcome, self.last_detail = outcome, detail
        if self._observe is not None:
            self._observe(outcome, rtt_s)

    # ---- the reader ---------------------------------------------------------------------------

    async def _read(self) -> None:
        sock = self._sock
        read = 0
        while True:
            read += 1
            if read % READ_BATCH == 0:  # a queued frame is returned without yielding: let
                await asyncio.sleep(0)  # the rest of the proxy run between batches
            try:
                frames = await sock.recv_multipart(copy=True)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the socket closed under us, or a ZMQ error: stop reading
                if not self._closed:
                    logger.error("demand client %s stopped reading: %s", self.name, e)
                return
            try:
                self._route(frames)
            except Exception:  # a bug here must not stop the reader
                logger.exception("demand client %s: frame not handled", self.name)
                self._dropped("malformed")

    def _route(self, frames: list[bytes]) -> None:
        if len(frames) != 1:
            self._dropped("malformed")
            return
        payload = frames[0]
        try:
            ident = _named.decode(payload).id
        except (msgspec.DecodeError, RecursionError):
            self._dropped("malformed")
            return
        entry = self._pending.get(ident)
        if entry is None or entry[1].done():  # late (its asker gave up), or never asked
            self._dropped("unknown_id")
            return
        query, fut = entry
        try:
            answer = decode_answer(payload, query if isinstance(query, DemandQuery) else None)
        except MalformedAnswer as e:
            fut.set_exception(DemandUnavailable("malformed", str(e)))
            return
        want = DemandAnswer if isinstance(query, DemandQuery) else DemandStats
        if isinstance(answer, DemandError):
            fut.set_exception(DemandUnavailable("error", answer.error))
        elif not isinstance(answer, want):
            fut.set_exception(
                DemandUnavailable(
                    "malformed", f"a {type(answer).__name__} for a {type(query).__name__}"
                )
            )
        else:
            fut.set_result(answer)

    def _dropped(self, reason: str) -> None:
        self.dropped[reason] += 1
        if self._drop is not None:
            self._drop(reason)

    def health(self) -> dict[str, object]:
        return {
            "endpoint": self.endpoint,
            "running": self._reader is not None and not self._reader.done(),
            "in_flight": len(self._pending),
            "answers": dict(self.counts),
            "dropped": dict(self.dropped),
            "last_outcome": self.last_outcome,
            "last_detail": self.last_detail,
        }


__all__ = ["DROPS", "OUTCOMES", "DemandClient", "DemandUnavailable"]
