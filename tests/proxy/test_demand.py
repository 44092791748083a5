"""`mmreuse proxy --policy demand | opportunistic`: the proxy asks each P's DemandScheduler
(`mmreuse.demand_query`) what a request needs from E. Fake E / PD servers (tests/support/proxy_fakes.py,
the PD rendering as vLLM's `/v1/chat/completions/render`, tests/support/index_proxy.py) and a fake
P demand endpoint: a real ZMQ ROUTER in the test's event loop, answering each query as scripted
(by default with `mmreuse.plan.plan_admission` at a chosen prefix hit C)."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
import zmq
import zmq.asyncio
from aiohttp import web
from aiohttp.test_utils import TestClient

from mmreuse.demand import ItemClass as K
from mmreuse.demand_query import (
    AnswerItem,
    DemandAnswer,
    DemandError,
    DemandQuery,
    DemandStats,
    QueryItem,
    encode,
)
from mmreuse.proxy.config import parse_args
from mmreuse.proxy.demand import DemandClient, DemandUnavailable
from mmreuse.proxy.server import build_app
from tests.support.demand_p import FakeP, planned
from tests.support.index_proxy import TEXT, A, B, C, prompt, render
from tests.support.proxy_fakes import Fake, ProxyHandle, chat, img, proxy_client, sha
from tests.support.waiting import async_wait_for

WAIT_S = 15.0  # a bound on waiting for something to happen (a hang guard, not a timing check)
KEY = "mmreuse_demand_id"


# ---- P's demand endpoint ------------------------------------------------------------------------


class HoldingE(Fake):
    """An E that holds each sub-request carrying an item whose uuid is in `hold` (recording
    its uuids in `held`) until `release` is set or its client hangs up (counted in `hung_up`;
    such a sub-request is not in `seen`)."""

    def __init__(self, role: str, hold: set[str]) -> None:
        super().__init__(role)
        self.hold = hold
        self.held: list[str] = []

    async def handle(self, request: web.Request) -> web.StreamResponse:
        if request.path == "/v1/chat/completions":
            body = await request.json()  # cached: Fake reads it again
            uuids = [p.get("uuid") for p in body["messages"][0]["content"]]
            if set(uuids) & self.hold:
                self.held += uuids
            if set(uuids) & self.hold and not await self._stall(request):
                return web.Response(status=499)
        return await super().handle(request)


# ---- the proxy ----------------------------------------------------------------------------------


@dataclass
class Setup(ProxyHandle):
    client: TestClient
    app: web.Application
    e: Fake
    pd: list[Fake]
    ps: list[FakeP]
    d: list[Fake] = field(default_factory=list)


@asynccontextmanager
async def demand_proxy(
    n_pd: int = 1,
    *,
    policy: str = "demand",
    timeout: float = 10.0,
    prefill: bool = False,
    e: Fake | None = None,
    batch: int = 0,
    flags: tuple[str, ...] = (),
) -> AsyncIterator[Setup]:
    """E + PD (or E + P + D with `prefill`: then `pd` are the P fakes), each P/PD with a fake
    demand endpoint. `batch`: ENCODER_MAX_BATCH_SIZE (1: a sub-request per image)."""
    ctx = zmq.asyncio.Context()
    ps = [FakeP(ctx) for _ in range(n_pd)]
    e = await (e or Fake("e")).start()
    pds = [await Fake("p" if prefill else "pd", render=render).start() for _ in range(n_pd)]
    d = [await Fake("d").start()] if prefill else []
    argv = [
        "--encode-servers-urls", e.url,
        "--decode-servers-urls", ",".join(f.url for f in (d or pds)),
        "--policy", policy,
        "--demand-endpoints", ",".join(p.endpoint for p in ps),
        "--demand-timeout", str(timeout),
        *flags,
    ]  # fmt: skip
    if prefill:
        argv += ["--prefill-servers-urls", ",".join(f.url for f in pds)]
    app = build_app(parse_args(argv, env={"ENCODER_MAX_BATCH_SIZE": str(batch)}))
    try:
        async with proxy_client(app) as client:
            yield Setup(client, app, e, pds, ps, d)
    finally:
        for fake in (e, *pds, *d):
            await fake.close()
        for p in ps:
            await p.close()
        ctx.term()


def e_sent(s: Setup) -> list[str]:
    return [p["uuid"] for x in s.e.chats() for p in x.body["messages"][0]["content"]]


def pd_body(s: Setup, i: int = 0, k: int = -1) -> dict[str, Any]:
    return s.pd[i].chats()[k].body


def embeds(url: str) -> dict[str, Any]:
    return {"type": "image_embeds", "image_embeds": {"image_grid_thw": [1, 2, 2]}, "uuid": sha(url)}


async def until(cond: Callable[[], bool]) -> None:
    assert await async_wait_for(cond, WAIT_S), "never happened"


# ---- demand -------------------------------------------------------------------------------------


async def test_demand_sends_e_only_what_p_needs():
    # P's hit covers [0, 64): A at [40, 56) is kv_covered, B at [56, 72) needs E. E gets B
    # only; A reaches PD raw with its uuid (and B too: vLLM refuses raw and embeds images in one
    # request, so PD gets B's embedding by uuid through the EC connector).
    async with demand_proxy() as s:
        s.ps[0].reply = planned(64)
        r = await s.post(chat(TEXT, img(A), img(B), cache_salt="tenant-a"))
        assert r.status == 200
        assert e_sent(s) == [sha(B)]
        [query] = s.ps[0].queries
        tokens, occs = prompt([sha(A), sha(B)])
        assert query.token_ids == tokens
        assert query.items == [
            QueryItem(o.identifier, o.offset, o.length, "image", None) for o in occs
        ]
        assert (query.cache_salt, query.e_cached, query.remember) == ("tenant-a", [], True)
        body = pd_body(s)
        assert body["messages"][0]["content"] == [
            TEXT,
            {**img(A), "uuid": sha(A)},
            {**img(B), "uuid": sha(B)},
        ]
        assert body["vllm_xargs"] == {KEY: query.id}
        assert [x["mm_hash"] for x in body["ec_transfer_params"]["ec_items"]] == [sha(B)]
        assert KEY not in str(s.e.chats()[0].body)
        assert s.sample("mmreuse_proxy_occurrences_total", klass="kv_covered") == 1
        assert s.sample("mmreuse_proxy_occurrences_total", klass="e_compute") == 1
        assert s.sample("mmreuse_proxy_encoder_items_total", action="skipped") == 1
        assert s.sample("mmreuse_proxy_demand_answers_total", instance="PD0", outcome="ok") == 1
        assert s.sample("mmreuse_proxy_demand_rtt_seconds_count", instance="PD0") == 1
        assert s.sample("mmreuse_proxy_fallbacks_total", instance="PD0", kind="no_plan") == 0

        # Again: E now holds B for this tenant (the proxy sent it there): the query says so.
        assert (await s.post(chat(TEXT, img(A), img(B), cache_salt="tenant-a"))).status == 200
        assert s.ps[0].queries[1].e_cached == [sha(B)]
        assert s.ps[0].queries[1].id != query.id
        assert pd_body(s)["vllm_xargs"] == {KEY: s.ps[0].queries[1].id}
        # Another tenant: nothing at E for it.
        assert (await s.post(chat(TEXT, img(A), img(B), cache_salt="tenant-b"))).status == 200
        assert s.ps[0].queries[2].e_cached == []


async def test_nothing_needed_means_no_e_at_all():
    # A covered, B in P's encoder cache: E gets nothing, every item raw with its uuid.
    def reply(q: DemandQuery) -> DemandAnswer:
        return DemandAnswer(id=q.id, num_computed_tokens=56,
                            items=[AnswerItem(K.KV_COVERED), AnswerItem(K.P_LOCAL)],
                            e_demand=[], p_local_reuse=[sha(B)])  # fmt: skip

    async with demand_proxy() as s:
        s.ps[0].reply = reply
        assert (await s.post(chat(TEXT, img(A), img(B)))).status == 200
        assert s.e.chats() == []
        content = pd_body(s)["messages"][0]["content"]
        assert content[1:] == [{**img(A), "uuid": sha(A)}, {**img(B), "uuid": sha(B)}]
        assert s.sample("mmreuse_proxy_occurrences_total", klass="kv_covered") == 1
        assert s.sample("mmreuse_proxy_occurrences_total", klass="p_local") == 1
        assert s.sample("mmreuse_proxy_encoder_items_total", action="skipped") == 2


async def test_a_duplicate_is_sent_once_under_demand():
    async with demand_proxy() as s:
        assert (await s.post(chat(TEXT, img(C), img(C)))).status == 200
        assert e_sent(s) == [sha(C)]
        assert pd_body(s)["messages"][0]["content"] == [TEXT, embeds(C), embeds(C)]
        assert s.sample("mmreuse_proxy_occurrences_total", klass="duplicate") == 1


async def test_the_client_vllm_xargs_are_kept_and_its_demand_id_replaced():
    async with demand_proxy() as s:
        body = chat(TEXT, img(A), vllm_xargs={"foo": 1, KEY: "the-client's"})
        assert (await s.post(body)).status == 200
        [query] = s.ps[0].queries
        assert pd_body(s)["vllm_xargs"] == {"foo": 1, KEY: query.id}


async def test_e_p_d_only_p_carries_the_demand_id():
    async with demand_proxy(prefill=True) as s:
        s.ps[0].reply = planned(64)
        client_xargs = {"foo": "bar"}
        assert (await s.post(chat(TEXT, img(A), img(B), vllm_xargs=client_xargs))).status == 200
        [query] = s.ps[0].queries
        assert e_sent(s) == [sha(B)]
        assert pd_body(s)["vllm_xargs"] == {"foo": "bar", KEY: query.id}
        [d] = s.d[0].chats()
        assert d.body["vllm_xargs"] == client_xargs  # D: the client's own, untouched
        assert d.body["kv_transfer_params"]["remote_engine_id"] == "p-engine"
        assert all(KEY not in str(x.body) for x in s.e.chats())


async def test_text_only_request_asks_nothing():
    async with demand_proxy() as s:
        body = chat(TEXT, max_tokens=3)
        assert (await s.post(body)).status == 200
        assert s.ps[0].queries == [] and s.e.chats() == []
        assert pd_body(s) == body


def _wrong_id(q: DemandQuery) -> DemandAnswer:
    return DemandAnswer(id="not-" + q.id, num_computed_tokens=0,
                        items=[AnswerItem(K.E_COMPUTE)] * 2, e_demand=[])  # fmt: skip


def _wrong_count(q: DemandQuery) -> DemandAnswer:
    return DemandAnswer(id=q.id, num_computed_tokens=0, items=[AnswerItem(K.E_COMPUTE)],
                        e_demand=[])  # fmt: skip


def _stranger(q: DemandQuery) -> DemandAnswer:
    return DemandAnswer(id=q.id, num_computed_tokens=0, items=[AnswerItem(K.E_COMPUTE)] * 2,
                        e_demand=[("someone-else", True)])  # fmt: skip


@pytest.mark.parametrize(
    "reply, outcome, dropped",
    [
        (lambda q: None, "timeout", None),
        (lambda q: DemandError(id=q.id, error="token_ids is empty"), "error", None),
        (_wrong_count, "malformed", None),
        (_stranger, "malformed", None),
        (lambda q: DemandStats(id=q.id), "malformed", None),
        (_wrong_id, "timeout", "unknown_id"),
        (lambda q: b"\x93garbage", "timeout", "malformed"),
    ],
    ids=["silent", "error", "class_count", "unknown_identifier", "stats", "wrong_id", "garbage"],
)
@pytest.mark.parametrize("policy", ["demand", "opportunistic"])
async def test_no_usable_answer_costs_the_plan_not_the_request(policy, reply, outcome, dropped):
    # E holds every sub-request until the query's outcome is in (so that under opportunistic
    # the answer is not late); then the request is eager's: every item to E and rewritten, no
    # demand id, counted.
    e = HoldingE("e", hold={sha(A), sha(B)})
    async with demand_proxy(policy=policy, timeout=0.3, e=e) as s:
        s.ps[0].reply = reply
        posted = asyncio.ensure_future(s.post(chat(TEXT, img(A), img(B))))
        labels = {"instance": "PD0", "outcome": outcome}
        await until(lambda: s.sample("mmreuse_proxy_demand_answers_total", **labels) == 1)
        e.release.set()
        r = await posted
        assert r.status == 200
        assert len(s.ps[0].queries) == 1
        assert sorted(e_sent(s)) == sorted([sha(A), sha(B)])
        body = pd_body(s)
        assert body["messages"][0]["content"] == [TEXT, embeds(A), embeds(B)]
        assert "vllm_xargs" not in body
        assert s.sample("mmreuse_proxy_demand_answers_total", instance="PD0", outcome="ok") == 0
        assert s.sample("mmreuse_proxy_fallbacks_total", instance="PD0", kind="no_plan") == 1
        assert s.sample("mmreuse_proxy_errors_total", stage="demand") == 1
        assert s.sample("mmreuse_proxy_requests_total", policy=policy, outcome="ok") == 1
        if policy == "opportunistic":
            assert s.sample("mmreuse_proxy_opportunistic_total", outcome="answer_failed") == 1
            assert e.hung_up == 0
        if dropped is not None:
            assert s.sample(
                "mmreuse_proxy_demand_frames_dropped_total", instance="PD0", reason=dropped
            ) == 1  # fmt: skip
        health = (await (await s.client.get("/health")).json())["mmreuse"]
        assert health["demand"]["PD0"]["answers"][outcome] == 1
        assert health["status"] == "degraded"
        assert any(p.startswith(f"PD0: last demand query {outcome}") for p in health["problems"])


async def test_stray_frames_do_not_stop_the_reader():
    # Before the answer P sends garbage, a frame of another query and a map whose id is not a
    # str: each is counted and dropped, and the answer that follows is used.
    async with demand_proxy() as s:
        good = planned(64)

        def noisy(q: DemandQuery) -> list[Any]:
            return [b"\xc1", encode(_wrong_id(q)), b"\x81\xa2id\x01", good(q)]

        s.ps[0].reply = noisy
        assert (await s.post(chat(TEXT, img(A), img(B)))).status == 200
        assert e_sent(s) == [sha(B)]
        dropped = {
            reason: s.sample(
                "mmreuse_proxy_demand_frames_dropped_total", instance="PD0", reason=reason
            )
            for reason in ("malformed", "unknown_id")
        }
        assert dropped == {"malformed": 2, "unknown_id": 1}
        assert (await s.post(chat(TEXT, img(A), img(B)))).status == 200
        assert s.sample("mmreuse_proxy_demand_answers_total", instance="PD0", outcome="ok") == 2
        health = (await (await s.client.get("/health")).json())["mmreuse"]
        assert health["demand"]["PD0"]["running"] is True
        assert health["status"] == "ok"


async def test_affine_routing_asks_the_routed_instance():
    # Two PDs, no views: affine ties, picked at random; the query goes where the request goes.
    async with demand_proxy(2, flags=("--routing", "affine")) as s:
        for _ in range(4):
            assert (await s.post(chat(TEXT, img(A)))).status == 200
        for i in range(2):
            ids = [q.id for q in s.ps[i].queries]
            assert [x.body["vllm_xargs"][KEY] for x in s.pd[i].chats()] == ids
        assert len(s.ps[0].queries) + len(s.ps[1].queries) == 4


# ---- opportunistic ------------------------------------------------------------------------------


async def test_opportunistic_abandons_what_the_answer_rules_out():
    # One sub-request per image. E holds A's; B's answers at once. P's answer (A covered)
    # rules A out: its sub-request is abandoned (E sees its client hang up), A goes to PD raw
    # with its uuid, B as E produced it (raw with uuid too: no mixing raw and embeds).
    e = HoldingE("e", hold={sha(A)})
    async with demand_proxy(policy="opportunistic", e=e, batch=1) as s:
        s.ps[0].reply = planned(64)
        r = await s.post(chat(TEXT, img(A), img(B)))
        assert r.status == 200
        assert (await r.json())["choices"][0]["message"]["content"] == "hi"
        assert e.held == [sha(A)]  # both dispatched at once; A's never answered
        assert e_sent(s) == [sha(B)]
        await until(lambda: e.hung_up == 1)
        [query] = s.ps[0].queries
        body = pd_body(s)
        assert body["messages"][0]["content"] == [
            TEXT,
            {**img(A), "uuid": sha(A)},
            {**img(B), "uuid": sha(B)},
        ]
        assert [x["mm_hash"] for x in body["ec_transfer_params"]["ec_items"]] == [sha(B)]
        assert body["vllm_xargs"] == {KEY: query.id}
        assert s.sample("mmreuse_proxy_opportunistic_total", outcome="answer_won") == 1
        assert s.sample("mmreuse_proxy_encoder_items_abandoned_total") == 1
        assert s.sample("mmreuse_proxy_encoder_items_total", action="sent") == 2
        assert s.sample("mmreuse_proxy_occurrences_total", klass="kv_covered") == 1
        # E's availability: only B was delivered.
        assert (await s.post(chat(TEXT, img(A), img(B)))).status == 200
        assert s.ps[0].queries[1].e_cached == [sha(B)]


async def test_opportunistic_keeps_a_sub_request_with_an_item_still_needed():
    # A and B share one sub-request (no batch limit): B is needed, so nothing is abandoned.
    e = HoldingE("e", hold={sha(A)})
    async with demand_proxy(policy="opportunistic", e=e) as s:
        s.ps[0].reply = planned(64)
        posted = asyncio.ensure_future(s.post(chat(TEXT, img(A), img(B))))
        await until(lambda: len(s.ps[0].queries) == 1)
        await until(
            lambda: (
                s.sample("mmreuse_proxy_demand_answers_total", instance="PD0", outcome="ok") == 1
            )
        )
        assert not posted.done()
        e.release.set()
        r = await posted
        assert r.status == 200
        assert e.hung_up == 0
        body = pd_body(s)
        assert body["messages"][0]["content"] == [TEXT, embeds(A), embeds(B)]
        assert body["vllm_xargs"] == {KEY: s.ps[0].queries[0].id}
        assert s.sample("mmreuse_proxy_opportunistic_total", outcome="answer_no_gain") == 1
        assert s.sample("mmreuse_proxy_encoder_items_abandoned_total") == 0


async def test_a_late_answer_is_eager():
    # P answers only once E is done: the request is exactly eager's (no demand id), and the
    # answer that comes afterwards names no query in flight.
    e = HoldingE("e", hold={sha(A), sha(B)})
    async with demand_proxy(policy="opportunistic", batch=1, e=e) as s:
        s.ps[0].gate.clear()
        s.ps[0].reply = planned(64)
        posted = asyncio.ensure_future(s.post(chat(TEXT, img(A), img(B))))
        await until(lambda: len(s.ps[0].queries) == 1)  # asked; E holds both
        e.release.set()
        r = await posted
        assert r.status == 200
        assert e.hung_up == 0
        body = pd_body(s)
        assert body["messages"][0]["content"] == [TEXT, embeds(A), embeds(B)]
        assert "vllm_xargs" not in body
        assert s.sample("mmreuse_proxy_opportunistic_total", outcome="answer_late") == 1
        assert s.sample("mmreuse_proxy_encoder_items_abandoned_total") == 0
        assert s.sample("mmreuse_proxy_fallbacks_total", instance="PD0", kind="no_plan") == 0
        s.ps[0].gate.set()
        await until(
            lambda: (
                s.sample(
                    "mmreuse_proxy_demand_frames_dropped_total", instance="PD0", reason="unknown_id"
                )
                == 1
            )
        )


async def test_a_failed_answer_under_opportunistic_waits_for_e():
    # P's error arrives while E holds A: nothing is abandoned, the request is eager's.
    e = HoldingE("e", hold={sha(A)})
    async with demand_proxy(policy="opportunistic", e=e, batch=1) as s:
        s.ps[0].reply = lambda q: DemandError(id=q.id, error="no")
        posted = asyncio.ensure_future(s.post(chat(TEXT, img(A), img(B))))
        await until(
            lambda: (
                s.sample("mmreuse_proxy_demand_answers_total", instance="PD0", outcome="error") == 1
            )
        )
        assert not posted.done()
        e.release.set()
        assert (await posted).status == 200
        assert e.hung_up == 0
        assert pd_body(s)["messages"][0]["content"] == [TEXT, embeds(A), embeds(B)]
        assert s.sample("mmreuse_proxy_opportunistic_total", outcome="answer_failed") == 1


async def test_a_client_that_hangs_up_abandons_e_and_the_query():
    # The client leaves while E holds both sub-requests and P has not answered: the proxy
    # cancels them all (E sees both connections close) and gives up its query.
    e = HoldingE("e", hold={sha(A), sha(B)})
    async with demand_proxy(policy="opportunistic", e=e, batch=1) as s:
        s.ps[0].gate.clear()
        with pytest.raises(TimeoutError):
            await s.client.post(
                "/v1/chat/completions",
                json=chat(TEXT, img(A), img(B)),
                timeout=aiohttp.ClientTimeout(total=0.5),
            )
        await until(lambda: e.hung_up == 2)
        await until(
            lambda: s.sample("mmreuse_proxy_requests_total", policy="opportunistic",
                             outcome="client_gone") == 1
        )  # fmt: skip
        assert s.pd[0].chats() == []
        await until(lambda: s.proxy.demand[0].in_flight == 0)  # the ask was cancelled too
        s.ps[0].gate.set()


async def test_opportunistic_e_wire_is_eagers():
    # The E sub-requests opportunistic sends are eager's: the same bodies, one per image, each
    # child id naming its first item.
    def wire(s: Setup) -> list[tuple[str, str]]:
        return sorted((x.headers["x-request-id"].split(":")[1], str(x.body)) for x in s.e.chats())

    request = chat(TEXT, img(A), img(B), img(C))
    async with _eager_proxy() as s:
        assert (await s.post(request)).status == 200
        eager = wire(s)
    async with demand_proxy(policy="opportunistic", batch=1) as s:
        assert (await s.post(request)).status == 200
        assert wire(s) == eager
    assert [i for i, _ in eager] == ["0", "1", "2"]


@asynccontextmanager
async def _eager_proxy() -> AsyncIterator[Setup]:
    e = await Fake("e").start()
    pd = await Fake("pd").start()
    argv = ["--encode-servers-urls", e.url, "--decode-servers-urls", pd.url]
    app = build_app(parse_args(argv, env={"ENCODER_MAX_BATCH_SIZE": "1"}))
    try:
        async with proxy_client(app) as client:
            yield Setup(client, app, e, [pd], [])
    finally:
        await e.close()
        await pd.close()


# ---- DemandClient -------------------------------------------------------------------------------


def _query(qid: str = "q1") -> DemandQuery:
    return DemandQuery(id=qid, token_ids=[1, 2, 3])


async def test_demand_client_caps_in_flight_and_closes():
    ctx = zmq.asyncio.Context()
    p = FakeP(ctx)
    p.gate.clear()
    client = DemandClient(p.endpoint, max_in_flight=1).start()
    try:
        first = asyncio.ensure_future(client.ask(_query("q1"), 10.0))
        await until(lambda: len(p.queries) == 1)
        with pytest.raises(DemandUnavailable) as refused:
            await client.ask(_query("q2"), 10.0)
        assert refused.value.outcome == "refused" and "in flight" in str(refused.value)
        p.gate.set()
        answer = await first
        assert answer.id == "q1" and answer.e_demand == []
        stats = await client.stats()
        assert stats.answers == 2
        assert client.counts == {"ok": 2, "timeout": 0, "error": 0, "malformed": 0, "refused": 1}
        p.gate.clear()
        pending = asyncio.ensure_future(client.ask(_query("q3"), 10.0))
        await until(lambda: len(p.queries) == 3)
    finally:
        await client.close()
    with pytest.raises(DemandUnavailable, match="refused: the demand client closed"):
        await pending
    with pytest.raises(DemandUnavailable, match="not running"):
        await client.ask(_query("q4"), 1.0)
    await p.close()
    ctx.term()


async def test_demand_client_timeout_before_connecting():
    # Nothing listens: the query is never sent (IMMEDIATE), the ask times out, saying so.
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    client = DemandClient(f"tcp://127.0.0.1:{port}").start()
    try:
        with pytest.raises(DemandUnavailable) as e:
            await client.ask(_query(), 0.2)
        assert e.value.outcome == "timeout" and "not sent" in e.value.detail
        assert client.in_flight == 0
    finally:
        await client.close()


@pytest.mark.parametrize(
    "kwargs, field_name",
    [
        ({"endpoint": "127.0.0.1:5"}, "endpoint"),
        ({"endpoint": ""}, "endpoint"),
        ({"endpoint": "tcp://a:1", "max_in_flight": 0}, "max_in_flight"),
    ],
)
def test_demand_client_validates(kwargs, field_name):
    from mmreuse.errors import InvalidArgument

    endpoint = kwargs.pop("endpoint")
    with pytest.raises(InvalidArgument, match=field_name):
        DemandClient(endpoint, **kwargs)


async def test_a_flooding_p_never_freezes_the_event_loop():
    # recv_multipart returns a queued frame without yielding: 503,000 frames from a hostile P
    # froze every coroutine for seconds. The reader yields every READ_BATCH frames.
    from mmreuse.proxy.demand import READ_BATCH

    ctx = zmq.asyncio.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.setsockopt(zmq.SNDHWM, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    client = DemandClient(f"tcp://127.0.0.1:{port}").start()
    asked = asyncio.ensure_future(client.ask(_query("q1"), 30.0))
    ident, _ = await asyncio.wait_for(router.recv_multipart(), 10.0)
    flood = 20_000
    junk = encode(DemandStats(id="never-asked", answers=0))
    for _ in range(flood):
        await router.send_multipart([ident, junk])
    # Under test, so a sleep: the loop blocked (as by a long request) while the frames queue
    # up at the client.
    time.sleep(0.5)
    try:
        seen = [client.dropped["unknown_id"]]  # frames dropped, each time this coroutine ran
        # Not a wait but a sampling loop: one sample per turn of the loop (sleep(0)), which is
        # what bounds the gaps below; the deadline is a hang guard, not a timing check.
        end = time.monotonic() + 30.0
        while seen[-1] < flood:
            assert time.monotonic() < end, client.dropped
            await asyncio.sleep(0)
            seen.append(client.dropped["unknown_id"])
        gaps = [b - a for a, b in itertools.pairwise(seen)]
        assert max(gaps) <= READ_BATCH, max(gaps)  # every coroutine ran between batches
        assert not asked.done()  # its answer never came; the flood cost nothing else
    finally:
        asked.cancel()
        await client.close()
        router.close(linger=0)
        ctx.term()


async def test_a_frame_larger_than_any_answer_is_never_read():
    from mmreuse.demand_query import MAX_ANSWER_BYTES

    ctx = zmq.asyncio.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    client = DemandClient(f"tcp://127.0.0.1:{port}").start()
    try:
        asked = asyncio.ensure_future(client.ask(_query("q1"), 2.0))
        ident, _ = await asyncio.wait_for(router.recv_multipart(), 10.0)
        await router.send_multipart([ident, b"\x00" * (MAX_ANSWER_BYTES + 1)])
        with pytest.raises(DemandUnavailable) as e:
            await asked
        assert e.value.outcome == "timeout"  # ZMQ dropped the connection, the frame unread
        assert client.dropped == {"unknown_id": 0, "malformed": 0}
    finally:
        await client.close()
        router.close(linger=0)
        ctx.term()
