"""The arrival-time split under `index` and `demand` (`Planner.arrival`): items held nowhere the
chosen P could use go to E at once, before any render; the others wait for the render and the
plan (or P's answer), which run while E works. Fake E / PD servers and a real KV view, as in
test_index.py."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, ClassVar

from aiohttp import web

from mmreuse.demand_query import SnapshotQuery
from tests.support.demand_p import planned
from tests.support.index_proxy import TEXT, A, B, C, e_sent, embeds, index_proxy, pd_content
from tests.support.proxy_fakes import Fake, chat, img, sha

RENDER = "/v1/chat/completions/render"
GATE_S = 5.0  # how long a gated render waits for E to see the new item


def renders(s: Any, i: int = 0) -> int:
    return sum(x.path == RENDER for x in s.pd[i].seen)


class _GatedRender(Fake):
    """A PD whose render answers only once `gate` is set (or after GATE_S): a render that
    could only complete if E received the new item while it was pending."""

    gate: ClassVar[asyncio.Event | None] = None
    opened: ClassVar[list[bool]] = []  # per render: whether E opened the gate (False: it timed out)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        if request.path == RENDER and _GatedRender.gate is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(_GatedRender.gate.wait(), GATE_S)
            _GatedRender.opened.append(_GatedRender.gate.is_set())
        return await super().handle(request)


def _open_gate_on(s: Any, uuid: str, gate: asyncio.Event) -> None:
    """E opens `gate` as soon as a sub-request naming `uuid` reaches it."""

    def delay(body: dict[str, Any]) -> float:
        if any(p.get("uuid") == uuid for p in body["messages"][0]["content"]):
            gate.set()
        return 0.0

    s.e.delay = delay


async def test_new_items_go_to_e_without_a_render():
    # Nothing is held anywhere: every item is new, E gets both at once, P renders nothing.
    async with index_proxy() as s:
        assert (await s.post(chat(TEXT, img(A), img(B)))).status == 200
        assert e_sent(s) == [sha(A), sha(B)]
        assert len(s.e.chats()) == 1  # one sub-request, as under eager
        assert renders(s) == 0
        assert pd_content(s) == [TEXT, embeds(A), embeds(B)]
        assert s.sample("mmreuse_proxy_arrival_requests_total", split="all_new") == 1
        assert s.sample("mmreuse_proxy_arrival_items_total", action="e_now") == 2
        assert s.sample("mmreuse_proxy_arrival_items_total", action="waited") == 0
        assert s.sample("mmreuse_proxy_occurrences_total", klass="e_compute") == 2
        assert s.sample("mmreuse_proxy_encoder_items_total", action="sent") == 2
        assert s.sample("mmreuse_proxy_fallbacks_total", instance="PD0", kind="no_plan") == 0


async def test_a_new_item_reaches_e_while_the_render_is_pending():
    # P holds [A, B]'s first 4 blocks (A covered, B not): A and B may be held, so they wait
    # for the render; C is new and reaches E first. The render answers only once E has C.
    gate = asyncio.Event()
    _GatedRender.gate, _GatedRender.opened = gate, []
    try:
        async with index_proxy(pd_class=_GatedRender) as s:
            await s.hold(0, [sha(A), sha(B)], 4)
            _open_gate_on(s, sha(C), gate)
            assert (await s.post(chat(TEXT, img(A), img(B), img(C)))).status == 200
            assert _GatedRender.opened == [True]  # E had C while the render was pending
            assert renders(s) == 1
            assert s.sample("mmreuse_proxy_fallbacks_total", instance="PD0", kind="no_plan") == 0
            assert e_sent(s) == [sha(C), sha(B)]  # C at arrival, B after the plan
            assert pd_content(s)[1] == {**img(A), "uuid": sha(A)}  # covered: raw, its uuid
            items = s.pd[0].chats()[0].body["ec_transfer_params"]["ec_items"]
            assert sorted(x["mm_hash"] for x in items) == sorted([sha(B), sha(C)])
            assert s.sample("mmreuse_proxy_arrival_requests_total", split="split") == 1
            assert s.sample("mmreuse_proxy_arrival_items_total", action="e_now") == 1
            assert s.sample("mmreuse_proxy_arrival_items_total", action="waited") == 2
            assert s.sample("mmreuse_proxy_occurrences_total", klass="kv_covered") == 1
    finally:
        _GatedRender.gate = None


async def test_identical_new_items_are_encoded_once():
    async with index_proxy() as s:
        assert (await s.post(chat(TEXT, img(C), img(C)))).status == 200
        assert e_sent(s) == [sha(C)]
        assert renders(s) == 0
        assert pd_content(s) == [TEXT, embeds(C), embeds(C)]
        items = s.pd[0].chats()[0].body["ec_transfer_params"]["ec_items"]
        assert [x["mm_hash"] for x in items] == [sha(C)]  # one transfer
        assert s.sample("mmreuse_proxy_occurrences_total", klass="duplicate") == 1


async def test_one_uuid_on_two_different_items_waits_for_the_render():
    # A client's uuid names two different images: not deduplicated at arrival (P's render
    # and vLLM judge it), never one image's embedding given to the other.
    async with index_proxy() as s:
        body = chat(TEXT, img(A, uuid="same"), img(B, uuid="same"))
        assert (await s.post(body)).status == 200
        assert renders(s) == 1
        assert s.sample("mmreuse_proxy_arrival_requests_total", split="none_new") == 1


async def test_a_held_item_waits_and_a_new_one_sent_with_it_is_not_sent_twice():
    # [A, B, A]: P holds A's and B's blocks; nothing new. Then [C, A]: C new, A waits.
    async with index_proxy() as s:
        await s.hold(0, [sha(A), sha(B)], 4)
        assert (await s.post(chat(TEXT, img(A), img(B), img(A)))).status == 200
        assert s.sample("mmreuse_proxy_arrival_requests_total", split="none_new") == 1
        assert e_sent(s) == [sha(B), sha(A)]  # the plan's, as before the split
        assert (await s.post(chat(TEXT, img(C), img(A)))).status == 200
        assert e_sent(s)[2:] == [sha(C), sha(A)]  # C at arrival; A: not covered at this offset
        assert renders(s) == 2


async def test_processor_kwargs_keep_the_whole_path():
    # Processor kwargs rehash identifiers: they cannot be known without P, so nothing is
    # sent at arrival; render and plan decide, as before.
    async with index_proxy() as s:
        body = chat(TEXT, img(A), mm_processor_kwargs={"max_pixels": 4096})
        assert (await s.post(body)).status == 200
        assert renders(s) == 1
        assert s.sample("mmreuse_proxy_arrival_requests_total", split="whole") == 1
        assert s.sample("mmreuse_proxy_arrival_items_total", action="e_now") == 0


async def test_affine_routing_chooses_from_the_identifier_index_without_a_render():
    # PD1 holds blocks carrying A; [A, C] goes to PD1 (A waits, C is new there); [C] alone is
    # new everywhere: sent at arrival, never rendered.
    async with index_proxy(2, flags=("--routing", "affine"), seed=3) as s:
        await s.hold(1, [sha(A)], 3)
        for _ in range(3):
            assert (await s.post(chat(TEXT, img(A), img(C)))).status == 200
        assert len(s.pd[1].chats()) == 3 and s.pd[0].chats() == []
        assert renders(s, 1) == 3 and renders(s, 0) == 0
        assert (await s.post(chat(TEXT, img(B)))).status == 200
        assert renders(s, 0) + renders(s, 1) == 3


async def test_demand_sends_new_items_at_arrival_and_tells_p():
    # demand with a complete view: C is new (sent at arrival); P is asked about the request
    # with C named as E's, and its answer decides A and B.
    async with index_proxy(demand=True, flags=("--policy", "demand")) as s:
        await s.hold(0, [sha(A), sha(B)], 4)
        s.ps[0].reply = planned(64)
        assert (await s.post(chat(TEXT, img(A), img(B), img(C)))).status == 200
        [query] = [q for q in s.ps[0].queries if not isinstance(q, SnapshotQuery)]
        assert sha(C) in query.e_cached
        assert e_sent(s) == [sha(C), sha(B)]
        xargs = s.pd[0].chats()[-1].body["vllm_xargs"]
        assert xargs["mmreuse_demand_id"] == query.id
        assert s.sample("mmreuse_proxy_arrival_items_total", action="e_now") == 1


async def test_demand_on_an_incomplete_view_sends_nothing_early():
    # demand without KV events (its view is not usable): no proof, every item waits for P.
    async with index_proxy(events=False, demand=True, flags=("--policy", "demand")) as s:
        s.ps[0].reply = planned(0)
        assert (await s.post(chat(TEXT, img(A), img(C)))).status == 200
        assert s.sample("mmreuse_proxy_arrival_items_total", action="e_now") == 0
        assert s.sample("mmreuse_proxy_arrival_requests_total", split="none_new") == 1
        assert e_sent(s) == [sha(A), sha(C)]  # P's answer: both needed


async def test_a_failing_split_costs_the_split_not_the_request(monkeypatch):
    # A bug in the split (here: the view raising) is logged and counted; the request takes the
    # whole path (render and plan) and is served.
    async with index_proxy() as s:
        await s.hold(0, [sha(A), sha(B)], 4)

        def broken(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("a bug in the split")

        monkeypatch.setattr(s.proxy.planner.arrivals, "split", broken)
        assert (await s.post(chat(TEXT, img(A), img(B)))).status == 200
        assert s.sample("mmreuse_proxy_errors_total", stage="arrival") == 1
        assert s.sample("mmreuse_proxy_arrival_requests_total", split="whole") == 1
        assert renders(s) == 1 and e_sent(s) == [sha(B)]  # the plan's, as before the split


def test_items_sent_at_arrival_keep_the_class_they_had_when_sent():
    # The plan runs while E encodes the new item: by then E's events may say E holds it, but
    # it was sent as e_compute (and what E already held when it was sent, as e_cached).
    from mmreuse.decision import Dispatch
    from mmreuse.demand import ItemClass as K
    from mmreuse.proxy.policy import _with_arrival
    from mmreuse.proxy.records import Arrival, Decision

    uuids = ["x", "y", "x", "z"]
    classes = (K.E_CACHED, K.E_CACHED, K.DUPLICATE, K.KV_COVERED)
    planned = Decision(0, Dispatch((0, 1), frozenset({3}), {2: 0}, classes))
    arrival = Arrival(0, now=(0, 1), shares={2: 0}, rest=(3,), e_cached=frozenset({"y"}))
    merged = _with_arrival(planned, arrival, uuids).dispatch
    assert merged.classes == (K.E_COMPUTE, K.E_CACHED, K.DUPLICATE, K.KV_COVERED)
    assert (merged.e_items, dict(merged.shares), merged.raw_items) == (
        (0, 1), {2: 0}, frozenset({3}),
    )  # fmt: skip


async def test_mixed_plan_arrival_sends_the_maybe_held_to_p_without_a_render():
    # --mixed-plan arrival: C is new (to E at once); A and B may be held: they go to P raw
    # with their uuid, nothing is rendered, and P's own order serves them.
    async with index_proxy(flags=("--mixed-plan", "arrival")) as s:
        await s.hold(0, [sha(A), sha(B)], 4)
        assert (await s.post(chat(TEXT, img(A), img(B), img(C)))).status == 200
        assert renders(s) == 0
        assert e_sent(s) == [sha(C)]
        # raw and embeds never mix in one modality (vLLM refuses it): C goes raw with its
        # uuid too, and P loads E's embedding of it by that uuid
        raw = [{**img(x), "uuid": sha(x)} for x in (A, B, C)]
        assert pd_content(s) == [TEXT, *raw]
        items = s.pd[0].chats()[0].body["ec_transfer_params"]["ec_items"]
        assert [x["mm_hash"] for x in items] == [sha(C)]
        assert s.sample("mmreuse_proxy_arrival_items_total", action="p_raw") == 2
        assert s.sample("mmreuse_proxy_arrival_items_total", action="waited") == 0
        # a request with nothing new still waits for the render and the plan
        assert (await s.post(chat(TEXT, img(A), img(B)))).status == 200
        assert renders(s) == 1


async def test_encode_on_p_single_sends_a_lone_new_item_to_p_raw():
    # --encode-on-p single: [C] alone, new: P gets it raw with its uuid (its encoder runs),
    # E gets nothing; [A, C] (two new items) still goes to E as before.
    async with index_proxy(flags=("--encode-on-p", "single")) as s:
        assert (await s.post(chat(TEXT, img(C)))).status == 200
        assert e_sent(s) == [] and renders(s) == 0
        assert pd_content(s) == [TEXT, {**img(C), "uuid": sha(C)}]
        assert s.sample("mmreuse_proxy_arrival_items_total", action="p_encodes") == 1
        assert (await s.post(chat(TEXT, img(A), img(C)))).status == 200
        assert e_sent(s) == [sha(A), sha(C)]


def test_the_arrival_options_need_a_policy_that_splits():
    import pytest

    from mmreuse.proxy.config import ConfigError, PlanningConfig

    for key, value in (("mixed_plan", "arrival"), ("encode_on_p", "single")):
        with pytest.raises(ConfigError, match=f"{value} acts on the split at arrival"):
            PlanningConfig(**{key: value})
        with pytest.raises(ConfigError, match="must be one of"):
            PlanningConfig(policy="index", **{key: "sometimes"})
        assert PlanningConfig(policy="index", **{key: value})
