"""A fake P demand endpoint for the proxy's tests: a real ZMQ ROUTER in the test's event loop,
answering each query as scripted (by default with `mmreuse.plan.plan_admission` at a prefix hit
of 0 tokens), as `DemandScheduler` answers on `--demand-endpoints`."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

import zmq
import zmq.asyncio

from mmreuse.demand import Availability
from mmreuse.demand_query import (
    DemandAnswer,
    DemandError,
    DemandQuery,
    DemandStats,
    SnapshotQuery,
    StatsQuery,
    answer_for,
    decode_query,
    encode,
    occurrences_of,
)
from mmreuse.plan import GivenCoverage, plan_admission


def planned(c: int) -> Callable[[DemandQuery], DemandAnswer]:
    """P's answer with a prefix hit of `c` tokens: compute_demand's, via plan_admission."""

    def reply(q: DemandQuery) -> DemandAnswer:
        plan = plan_admission(
            num_prompt_tokens=len(q.token_ids),
            occurrences=occurrences_of(q),
            availability=Availability(e_cached=frozenset(q.e_cached)),
            coverage=GivenCoverage(c),
        )
        return answer_for(q.id, c, plan.demand)

    return reply


class FakeP:
    """A DemandScheduler's ROUTER: each query is recorded, then answered with `reply(query)`
    (an answer, raw bytes, a list of raw frames to send first, or None: no answer) once `gate`
    is set. A `SnapshotQuery` gets `snapshot(query)` when set, else a DemandError (a P that
    serves none)."""

    def __init__(self, ctx: zmq.asyncio.Context) -> None:
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.queries: list[Any] = []
        self.reply: Callable[[Any], Any] = planned(0)
        self.snapshot: Callable[[SnapshotQuery], Any] | None = None
        self.gate = asyncio.Event()
        self.gate.set()
        self._tasks: set[asyncio.Task] = set()
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            ident, payload = await self.sock.recv_multipart()
            query = decode_query(payload)
            self.queries.append(query)
            task = asyncio.get_running_loop().create_task(self._answer(ident, query))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _answer(self, ident: bytes, query: Any) -> None:
        await self.gate.wait()
        if isinstance(query, StatsQuery):
            out: Any = DemandStats(id=query.id, answers=len(self.queries))
        elif isinstance(query, SnapshotQuery):
            out = (
                DemandError(query.id, "no snapshot")
                if self.snapshot is None
                else self.snapshot(query)
            )
        else:
            out = self.reply(query)
        if out is None:
            return
        for frame in out if isinstance(out, list) else [out]:
            payload = frame if isinstance(frame, bytes) else encode(frame)
            await self.sock.send_multipart([ident, payload])

    async def close(self) -> None:
        for task in (self._task, *self._tasks):
            task.cancel()
        for task in (self._task, *self._tasks):
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self.sock.close(linger=0)
