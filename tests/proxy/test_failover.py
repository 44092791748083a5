"""mmreuse.proxy.failover: an E whose connection fails is ejected and its sub-requests go to a
live E, once; the rotation is the reference's while every E is up. The request's deadline
(--request-timeout) and the active probe that brings an instance back."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from mmreuse.errors import InvalidArgument
from mmreuse.proxy.failover import Ejections, HealthProbe, named_ejections
from tests.support.epd_proxy import epd
from tests.support.proxy_fakes import Fake, chat, img, refused_url

A, B, C, D = "http://e0", "http://e1", "http://e2", "http://e3"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_rotation_is_the_references_while_every_instance_is_up():
    h = Ejections("E", [A, B, C])
    assert h.assign(2) + h.assign(2) + h.assign(1) == [A, B, C, A, B]  # contiguous across calls


def test_an_ejected_instance_is_skipped_until_its_back_off_is_over_then_tried_again():
    clock, changes = Clock(), []
    h = Ejections("E", [A, B, C], clock=clock, on_change=lambda *c: changes.append(c))
    h.eject(B)
    assert changes == [("E", B, False)] and h.down() == [B] and not h.up(B)
    assert h.assign(4) == [A, C, A, C]
    clock.now += 1.0  # MIN_BACKOFF_S
    assert h.up(B) and h.down() == []
    h.eject(B)  # it failed again: twice as long
    clock.now += 1.5
    assert not h.up(B)
    clock.now += 0.5
    assert h.up(B)
    h.ok(B)  # it answered: clear, and said once
    assert changes[-1] == ("E", B, True)
    h.eject(B)  # failing again soon after it came back (flapping): twice as long again
    clock.now += 3.0
    assert not h.up(B)
    clock.now += 1.0
    assert h.up(B)
    h.ok(B)
    clock.now += 31.0  # up for longer than the longest back-off: its history forgotten
    h.eject(B)
    clock.now += 1.0
    assert h.up(B)


def test_with_a_probe_an_ejected_instance_is_out_until_the_probe_finds_it():
    clock = Clock()
    h = Ejections("E", [A, B], clock=clock)
    h.probed = True
    h.eject(B)
    assert h.due() == []  # the back-off first
    clock.now += 100.0
    assert not h.up(B) and h.down() == [B] and h.due() == [B]
    assert h.assign(3) == [A, A, A]
    h.ok(B)
    assert h.up(B) and h.due() == [] and h.assign(2) == [B, A]


def test_the_back_off_is_capped():
    clock = Clock()
    h = Ejections("E", [A, B], clock=clock, max_backoff_s=4.0)
    for _ in range(10):
        h.eject(A)
    clock.now += 4.0
    assert h.up(A)


def test_with_every_instance_ejected_all_are_tried_in_rotation():
    h = Ejections("E", [A, B], clock=Clock())
    h.eject(A)
    h.eject(B)
    assert h.assign(3) == [A, B, A] and h.instead_of(A) is None


def test_instead_of_is_the_next_live_instance_after_the_failed_one():
    h = Ejections("E", [A, B, C, D], clock=Clock())
    h.eject(C)
    assert h.instead_of(B) == D and h.instead_of(D) == A
    assert Ejections("E", [A]).instead_of(A) is None


def test_named_ejections_report_each_instance_by_name():
    changes = []
    h = named_ejections("E", [A, B], lambda *c: changes.append(c))
    assert changes == [("E", "E0", True), ("E", "E1", True)]
    h.eject(B)
    assert changes[-1] == ("E", "E1", False)


@pytest.mark.parametrize("kw", [{"min_backoff_s": -1.0}, {"max_backoff_s": 0.5}])
def test_bad_back_offs_are_refused_by_name(kw):
    with pytest.raises(InvalidArgument, match=next(iter(kw))):
        Ejections("E", [A], **kw)


# ---- through the proxy --------------------------------------------------------------------


async def test_a_dead_e_costs_no_request_and_is_ejected(fakes):
    dead, live = refused_url(), await fakes("e")
    async with epd(e_urls=[dead, live.url]) as s:
        for i in range(6):
            r = await s.post(chat(img(f"http://x/{i}.png")), request_id=f"r{i}")
            assert r.status == 200, await r.text()
        assert len(live.chats()) == 6  # one failed over, then the dead one skipped
        assert s.sample("mmreuse_proxy_failovers_total", role="E") == 1
        assert s.sample("mmreuse_proxy_ejections_total", role="E", instance="E0") == 1
        assert s.sample("mmreuse_proxy_instance_up", role="E", instance="E0") == 0
        assert s.sample("mmreuse_proxy_instance_up", role="E", instance="E1") == 1
        body = await (await s.client.get("/health")).json()
        assert body["mmreuse"]["ejected"] == {"E": [dead], "PD": []}
        assert any("E ejected" in p for p in body["mmreuse"]["problems"])


async def test_an_e_that_comes_back_takes_requests_again():
    async with epd(n_e=2) as s:
        gone = s.e[1]
        port = gone.server.port
        await gone.close()
        for i in range(4):
            assert (await s.post(chat(img(f"http://x/{i}.png")), request_id=f"a{i}")).status == 200
        assert s.sample("mmreuse_proxy_instance_up", role="E", instance="E1") == 0
        back = Fake("e")
        back.server = TestServer(_app(back), host="127.0.0.1", port=port)
        await back.server.start_server()
        try:
            # the probe asks it once its back-off (1 s) is over, once a second: back in
            assert await until_true(
                lambda: s.sample("mmreuse_proxy_instance_up", role="E", instance="E1") == 1, 5.0
            )
            assert not back.chats()  # no request was risked to find out
            for i in range(4):
                r = await s.post(chat(img(f"http://y/{i}.png")), request_id=f"b{i}")
                assert r.status == 200
            assert back.chats(), "the E that came back got sub-requests again"
            assert s.sample("mmreuse_proxy_instance_up", role="E", instance="E1") == 1
        finally:
            await back.close()


async def test_with_its_only_e_dead_a_request_fails_as_before():
    async with epd(e_urls=[refused_url()]) as s:
        r = await s.post(chat(img("http://x/0.png")))
        assert r.status == 502
        assert s.sample("mmreuse_proxy_failovers_total", role="E") == 0


def _proxy(s):
    from mmreuse.proxy.server import PROXY_KEY

    return s.app[PROXY_KEY]


def _app(fake: Fake):
    from aiohttp import web

    app = web.Application(client_max_size=1 << 28)
    app.router.add_route("*", "/{tail:.*}", fake.handle)
    return app


async def test_a_dead_pd_costs_no_request_the_next_goes_where_it_is_up(fakes):
    # E + PD, the first draw the dead PD's (seed 1): the request goes to the other as eager
    # (E encodes every item: the plan, if any, was the dead one's), then the dead one is not
    # drawn while ejected.
    live = await fakes("pd")
    async with epd(d_urls=[refused_url(), live.url], seed=1) as s:
        for i in range(5):
            r = await s.post(chat(img(f"http://x/{i}.png")), request_id=f"r{i}")
            assert r.status == 200, await r.text()
        assert len(live.chats()) == 5
        assert s.sample("mmreuse_proxy_failovers_total", role="PD") == 1
        assert s.sample("mmreuse_proxy_instance_up", role="PD", instance="PD0") == 0
        assert len(s.e[0].chats()) == 6  # the failed-over request's item encoded again


async def test_a_dead_d_costs_no_request_p_prefills_again_for_the_other():
    async with epd(n_p=1, n_d=2, seed=1) as s:
        await s.d[0].close()  # D0 is the first drawn (seed 1)
        r = await s.post(chat(img("http://x/0.png")))
        assert r.status == 200, await r.text()
        assert len(s.d[1].chats()) == 1 and len(s.p[0].chats()) == 2  # prefilled again
        assert s.sample("mmreuse_proxy_failovers_total", role="D") == 1
        assert s.sample("mmreuse_proxy_instance_up", role="D", instance="D0") == 0
        r = await s.post(chat(img("http://x/1.png")), request_id="r2")
        assert r.status == 200 and len(s.d[1].chats()) == 2  # D0 skipped now


async def test_a_dead_p_costs_no_request_the_other_p_takes_it_as_eager():
    async with epd(n_p=2, n_d=1, seed=1) as s:
        await s.p[0].close()  # P0 is the first drawn (seed 1)
        r = await s.post(chat(img("http://x/0.png")))
        assert r.status == 200, await r.text()
        assert len(s.p[1].chats()) == 1 and len(s.pd.chats()) == 1
        assert s.sample("mmreuse_proxy_failovers_total", role="P") == 1
        assert s.sample("mmreuse_proxy_instance_up", role="P", instance="P0") == 0


async def test_one_failover_a_request_then_its_error():
    # Both PDs dead: the request tries the second once, then fails as it did before.
    async with epd(d_urls=[refused_url(), refused_url()], seed=1) as s:
        r = await s.post(chat(img("http://x/0.png")))
        assert r.status >= 500
        assert s.sample("mmreuse_proxy_failovers_total", role="PD") == 1
        assert s.sample("mmreuse_proxy_ejections_total", role="PD", instance="PD1") == 1


async def test_a_stalled_e_costs_its_timeout_once_then_is_skipped(fakes):
    stalled = await fakes("e", delay=lambda body: 30.0)
    live = await fakes("e")
    flags = ("--encode-timeout", "0.2")
    async with epd(e_urls=[stalled.url, live.url], flags=flags) as s:
        for i in range(4):
            r = await s.post(chat(img(f"http://x/{i}.png")), request_id=f"r{i}")
            assert r.status == 200, await r.text()
        assert len(live.chats()) == 4 and len(stalled.chats()) == 1
        assert s.sample("mmreuse_proxy_failovers_total", role="E") == 1
        assert s.sample("mmreuse_proxy_instance_up", role="E", instance="E0") == 0


async def test_a_lone_e_slow_past_the_bound_is_waited_for_not_ejected(fakes):
    # no other E to take it: the bound would only turn a slow answer into an error
    slow = await fakes("e", delay=lambda body: 0.6)
    async with epd(e_urls=[slow.url], flags=("--encode-timeout", "0.2")) as s:
        t0 = time.monotonic()
        r = await s.post(chat(img("http://x/0.png")))
        assert r.status == 200 and time.monotonic() - t0 >= 0.6
        assert s.sample("mmreuse_proxy_instance_up", role="E", instance="E0") == 1


async def test_with_its_only_e_stalled_a_request_ends_with_504_at_its_deadline(fakes):
    stalled = await fakes("e", delay=lambda body: 30.0)
    flags = ("--encode-timeout", "0.2", "--request-timeout", "1")
    async with epd(e_urls=[stalled.url], flags=flags) as s:
        t0 = time.monotonic()
        r = await s.post(chat(img("http://x/0.png")))
        assert r.status == 504 and "--request-timeout" in await r.text()
        assert 0.9 < time.monotonic() - t0 < 3.0


def test_the_encode_timeout_is_checked():
    from mmreuse.proxy.config import ServingConfig

    assert ServingConfig().encode_timeout_s == 0.0  # none, as the reference
    for bad in (-1.0, float("inf"), float("nan"), "5"):
        with pytest.raises(InvalidArgument, match="encode_timeout_s"):
            ServingConfig(encode_timeout_s=bad)


async def test_a_stalled_p_costs_its_prefill_timeout_once_then_is_skipped():
    async with epd(n_p=2, n_d=1, seed=1, flags=("--prefill-timeout", "0.2")) as s:
        s.p[0].delay = lambda body: 30.0  # P0, the first drawn (seed 1), stalls
        for i in range(3):
            r = await s.post(chat(img(f"http://x/{i}.png")), request_id=f"r{i}")
            assert r.status == 200, await r.text()
        assert len(s.p[1].chats()) == 3 and len(s.p[0].chats()) == 1
        assert s.sample("mmreuse_proxy_failovers_total", role="P") == 1
        assert s.sample("mmreuse_proxy_instance_up", role="P", instance="P0") == 0


async def test_with_its_only_p_stalled_it_is_waited_for_until_the_deadline():
    flags = ("--prefill-timeout", "0.2", "--request-timeout", "1")
    async with epd(n_p=1, n_d=1, flags=flags) as s:
        s.p[0].delay = lambda body: 30.0
        t0 = time.monotonic()
        r = await s.post(chat(img("http://x/0.png")))
        assert r.status == 504 and "--request-timeout" in await r.text()
        assert 0.9 < time.monotonic() - t0 < 3.0
        assert s.sample("mmreuse_proxy_instance_up", role="P", instance="P0") == 1


def test_the_prefill_timeout_is_checked():
    from mmreuse.proxy.config import ServingConfig

    assert ServingConfig().prefill_timeout_s == 0.0  # none, as the reference
    with pytest.raises(InvalidArgument, match="prefill_timeout_s"):
        ServingConfig(prefill_timeout_s=-1.0)


# ---- --request-timeout: one clear ending in bounded time ------------------------------------

STREAM = (b"data: 1\n\n", b"data: 2\n\n", b"data: [DONE]\n\n")


async def test_a_decode_past_the_deadline_ends_with_504_in_bounded_time():
    async with epd(flags=("--request-timeout", "0.5")) as s:
        s.pd.delay = lambda body: 30.0  # a stalled PD (its JSON answer never comes)
        t0 = time.monotonic()
        r = await s.post(chat(img("http://x/0.png")))
        assert r.status == 504 and "--request-timeout" in await r.text()
        assert time.monotonic() - t0 < 5.0
        assert s.sample("mmreuse_proxy_errors_total", stage="deadline") == 1
        assert s.sample("mmreuse_proxy_requests_total", policy="eager", outcome="server_error") == 1


async def test_a_pd_silent_past_the_deadline_is_ejected_the_next_requests_go_to_the_other():
    # PD stalls (alive, silent, its /health too, as a stopped process): the request in flight
    # on it ends with a 504 at the deadline, and the ones after it go to the live PD
    async with epd(n_d=2, flags=("--request-timeout", "0.5")) as s:
        stalled: list[int] = []

        def stall_first(i: int):
            def delay(body) -> float:
                if not stalled:
                    stalled.append(i)
                return 30.0 if stalled == [i] else 0.0

            return delay

        for i, pd in enumerate(s.d):
            pd.delay = stall_first(i)
            pd.fail["/health"] = [503] * 100
        r = await s.post(chat(img("http://x/0.png")), request_id="r0")
        assert r.status == 504
        for i in range(1, 5):
            r = await s.post(chat(img(f"http://x/{i}.png")), request_id=f"r{i}")
            assert r.status == 200, await r.text()
        (bad,) = stalled
        assert len(s.d[bad].chats()) == 1 and len(s.d[1 - bad].chats()) == 4
        assert s.sample("mmreuse_proxy_instance_up", role="PD", instance=f"PD{bad}") == 0


async def test_a_stream_held_for_its_first_token_past_the_deadline_is_a_504_and_hung_up():
    # E's reference: the stream is held for its first token (nothing reached the client yet),
    # so the deadline is still a status; the PD's connection is closed (vLLM aborts on it)
    async with epd(flags=("--request-timeout", "0.5")) as s:
        s.pd.chunks, s.pd.stall_after = STREAM, 0
        r = await s.post(chat(img("http://x/0.png"), stream=True))
        assert r.status == 504
        assert await until_true(lambda: s.pd.hung_up == 1)


async def test_a_stream_cut_by_the_deadline_ends_with_an_error_event_and_done():
    async with epd(flags=("--request-timeout", "0.5", "--no-rewrite")) as s:
        s.pd.chunks, s.pd.stall_after = STREAM, 1
        r = await s.post(chat(img("http://x/0.png"), stream=True))
        assert r.status == 200
        got = await asyncio.wait_for(r.read(), 5.0)
        first, error, done, tail = got.split(b"\n\n")
        assert (first + b"\n\n", done, tail) == (STREAM[0], b"data: [DONE]", b"")
        assert json.loads(error.removeprefix(b"data: "))["error"]["code"] == 504
        assert await until_true(lambda: s.pd.hung_up == 1)
        assert s.sample("mmreuse_proxy_requests_total", policy="eager", outcome="stream_broken")


async def test_the_deadline_derives_e_s_bound_so_a_stalled_e_leaves_time_to_fail_over(fakes):
    stalled = await fakes("e", delay=lambda body: 30.0)
    live = await fakes("e")
    async with epd(e_urls=[stalled.url, live.url], flags=("--request-timeout", "1")) as s:
        t0 = time.monotonic()
        r = await s.post(chat(img("http://x/0.png")))
        assert r.status == 200, await r.text()
        assert 0.4 < time.monotonic() - t0 < 1.0  # E's bound: half the deadline
        assert s.sample("mmreuse_proxy_failovers_total", role="E") == 1


def test_the_request_timeout_is_checked_and_gives_the_stage_bounds():
    from mmreuse.proxy.config import ServingConfig

    assert ServingConfig().request_timeout_s == 0.0  # none, as the reference
    with pytest.raises(InvalidArgument, match="request_timeout_s"):
        ServingConfig(request_timeout_s=-1.0)
    c = ServingConfig(request_timeout_s=10.0)
    assert (c.encode_bound_s, c.prefill_bound_s) == (5.0, 5.0)
    c = ServingConfig(request_timeout_s=10.0, encode_timeout_s=2.0, prefill_timeout_s=3.0)
    assert (c.encode_bound_s, c.prefill_bound_s) == (2.0, 3.0)
    assert (ServingConfig().encode_bound_s, ServingConfig().prefill_bound_s) == (0.0, 0.0)


# ---- the active probe ----------------------------------------------------------------------


async def test_the_probe_brings_back_an_instance_that_answers_health():
    asked: list[str] = []
    answers = {A: 200, B: 503}

    async def get(url: str, timeout_s: float) -> int:
        asked.append(url)
        return answers[url.removesuffix("/health")]

    clock = Clock()
    h = Ejections("E", [A, B, C], clock=clock)
    probe = HealthProbe([h, h], get)  # a role given twice is asked once
    await probe.once()
    assert asked == []  # nothing ejected: nothing asked
    h.eject(A)
    h.eject(B)
    await probe.once()
    assert asked == []  # their back-off first
    clock.now += 1.0
    await probe.once()
    assert sorted(asked) == [A + "/health", B + "/health"]
    assert h.ejected() == [B] and h.failing == 1


@pytest.mark.parametrize("failure", ["refused", "timeout"])
async def test_a_probe_that_fails_or_hangs_leaves_the_instance_out(failure):
    async def get(url: str, timeout_s: float) -> int:
        if failure == "refused":
            raise aiohttp.ClientConnectionError("refused")
        await asyncio.sleep(30)
        return 200

    clock = Clock()
    h = Ejections("E", [A, B], clock=clock)
    h.eject(A)
    clock.now += 1.0
    t0 = time.monotonic()
    await HealthProbe([h], get, timeout_s=0.1).once()
    assert h.ejected() == [A] and time.monotonic() - t0 < 2.0


async def test_a_stalled_e_is_back_once_it_answers_health_without_a_request_risked(fakes):
    slow = {"s": 30.0}
    stalled = await fakes("e", delay=lambda body: slow["s"])
    live = await fakes("e")
    async with epd(e_urls=[stalled.url, live.url], flags=("--encode-timeout", "0.2")) as s:
        r = await s.post(chat(img("http://x/0.png")))
        assert r.status == 200
        assert s.sample("mmreuse_proxy_instance_up", role="E", instance="E0") == 0
        slow["s"] = 0.0  # it answers again: the probe (once a second) finds it
        assert await until_true(
            lambda: s.sample("mmreuse_proxy_instance_up", role="E", instance="E0") == 1, 5.0
        )
        assert len(stalled.chats()) == 1  # no request was sent to find out


async def test_metrics_show_the_process_its_tasks_and_its_connections():
    async with epd() as s:
        r = await s.post(chat(img("http://x/0.png")))
        assert r.status == 200
        text = await (await s.client.get("/metrics")).text()
        assert s.sample("mmreuse_proxy_tasks") >= 1
        idle = s.sample("mmreuse_proxy_upstream_connections", state="idle")
        busy = s.sample("mmreuse_proxy_upstream_connections", state="busy")
        assert (idle, busy) == (2, 0)  # E's and the PD's, pooled
        assert "process_open_fds" in text and "process_resident_memory_bytes" in text


async def until_true(check, timeout_s: float = 5.0) -> bool:
    end = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > end:
            return False
        await asyncio.sleep(0.02)
    return True
