"""mmreuse.proxy.store: the shared embedding store asked what it holds (a Mooncake master's
`/batch_query_keys`), here a server that answers as the master does (its answers copied from
mooncake_master 0.3.13), then slowly, with junk, with errors, or not at all; and
`mmreuse proxy --policy index --e-store-url` planning with it."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time

import aiohttp
import pytest
from aiohttp import web

from mmreuse.embedding_store import embedding_key
from mmreuse.errors import InvalidArgument
from mmreuse.proxy.config import parse_args
from mmreuse.proxy.store import MAX_KEYS_PER_QUERY, StoreTruth
from tests.support.index_proxy import e_sent, index_proxy, pd_content
from tests.support.proxy_fakes import chat, img, sha

NS = "embedding@model:tiny@revision:default@encoder:abc@dtype:torch.bfloat16@protocol:v3"
TEXT = {"type": "text", "text": "what changed between these?"}
A, B = "http://img/a.png", "http://img/b.png"


class Master:
    """`/batch_query_keys` as mooncake_master answers it, over `held`; `mode` breaks it."""

    def __init__(self) -> None:
        self.held: set[str] = set()
        self.mode = "ok"
        self.asked: list[list[str]] = []
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def handle(self, request: web.Request) -> web.Response:
        keys = request.query.get("keys", "").split(",")
        self.asked.append(keys)
        if self.mode == "slow":
            await asyncio.sleep(5)  # a slow store: what the query timeout is tested against
        if self.mode == "junk":
            return web.Response(text="<html>not json</html>")
        if self.mode == "partial":
            return web.json_response({"success": True, "data": {}})
        if self.mode == "500":
            return web.Response(status=500, text="boom")
        if self.mode == "huge":
            return web.Response(body=b" " * (2 << 20))
        if self.mode == "deep":  # 4 KB of nested arrays: deeper than any decoder recurses
            return web.Response(body=b"[" * 4096 + b"]" * 4096)
        if self.mode == "deep_field":  # the same, in a field the answer's reader skips
            deep = b"[" * 4096 + b"]" * 4096
            entry = b'{"ok": true, "values": ' + deep + b"}"
            return web.Response(
                body=b'{"success": true, "data": {"%s": %s}}' % (keys[0].encode(), entry)
            )
        data = {
            k: {"ok": True, "error": None, "values": [{"size_": 1000}]}
            if k in self.held
            else {"ok": False, "error": "OBJECT_NOT_FOUND", "values": None}
            for k in keys
        }
        return web.json_response({"success": True, "data": data})

    async def start(self) -> Master:
        app = web.Application()
        app.router.add_get("/batch_query_keys", self.handle)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def close(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()


@pytest.fixture
async def master():
    m = await Master().start()
    yield m
    await m.close()


@pytest.fixture
async def session():
    s = aiohttp.ClientSession()
    yield s
    await s.close()


async def test_held_is_the_masters_answer_for_these_identifiers(master, session):
    master.held = {embedding_key(NS, "a"), embedding_key(NS, "we@ird/ id")}
    seen = []
    truth = StoreTruth(master.url, NS, lambda: session, on_outcome=seen.append)
    assert await truth.held(["a", "b", "we@ird/ id"]) == {"a", "we@ird/ id"}
    assert sorted(master.asked[0]) == sorted(embedding_key(NS, i) for i in ("a", "b", "we@ird/ id"))
    assert seen == ["ok"] and truth.health()["last_outcome"] == "ok"
    assert await truth.held([]) == frozenset() and len(master.asked) == 1  # nothing to ask


async def test_many_items_are_asked_in_chunks_at_once(master, session):
    ids = [f"i{n}" for n in range(MAX_KEYS_PER_QUERY * 2 + 1)]
    master.held = {embedding_key(NS, i) for i in ids[::2]}
    truth = StoreTruth(master.url, NS, lambda: session)
    assert await truth.held(ids) == set(ids[::2])
    assert [len(a) for a in master.asked] == [MAX_KEYS_PER_QUERY, MAX_KEYS_PER_QUERY, 1]


async def test_an_identifier_with_a_comma_is_not_held_nor_asked(master, session):
    master.held = {embedding_key(NS, "x,y")}
    truth = StoreTruth(master.url, NS, lambda: session)
    assert await truth.held(["x,y"]) == frozenset() and master.asked == []


@pytest.mark.parametrize(
    ("mode", "outcome", "says"),
    [
        ("slow", "timeout", "no answer in 0.2 s"),
        ("junk", "junk", "not JSON"),
        ("partial", "junk", "no answer for key"),
        ("500", "http_error", "HTTP 500"),
        ("huge", "junk", "an answer over"),
        ("deep", "junk", "not an answer"),
        ("deep_field", "junk", "nested too deep"),
    ],
)
async def test_a_bad_master_is_no_answer_counted_and_said(master, session, mode, outcome, says):
    master.mode = mode
    seen = []
    truth = StoreTruth(master.url, NS, lambda: session, timeout_s=0.2, on_outcome=seen.append)
    t0 = time.monotonic()
    assert await truth.held(["a"]) is None
    assert time.monotonic() - t0 < 0.2 + 0.1  # within the timeout, whatever the answer
    assert seen == [outcome] and says in truth.health()["last_error"]
    master.mode = "ok"
    assert await truth.held(["a"]) == frozenset()
    assert truth.health()["last_error"] is None and truth.outcomes[outcome] == 1


async def test_an_identifier_that_makes_no_key_is_not_held_nor_asked(master, session):
    truth = StoreTruth(master.url, NS, lambda: session)
    assert await truth.held(["", "a"]) == frozenset() and master.asked == [[embedding_key(NS, "a")]]
    assert truth.health()["unkeyable"] == 1 and truth.last_outcome == "ok"


async def test_an_unreachable_master_is_no_answer(session):
    truth = StoreTruth("http://127.0.0.1:9", NS, lambda: session)
    assert await truth.held(["a"]) is None
    assert truth.last_outcome == "unreachable"


def test_the_flags_go_together_and_are_checked(capsys):
    base = ["--encode-servers-urls", "http://e", "--decode-servers-urls", "http://d"]
    cfg = parse_args([*base, "--e-store-url", "http://m:1/", "--e-store-namespace", NS], env={})
    assert (cfg.store.url, cfg.store.namespace, cfg.store.timeout_s) == (
        "http://m:1",
        NS,
        0.25,
    )
    for extra, says in (
        (["--e-store-url", "http://m:1"], "give both"),
        (["--e-store-namespace", NS], "give both"),
        (["--e-store-url", "m:1", "--e-store-namespace", NS], "must be an http:// URL"),
        (["--e-store-url", "http://m", "--e-store-namespace", NS, "--e-store-timeout", "0"], "> 0"),
    ):
        with pytest.raises(SystemExit):
            parse_args([*base, *extra], env={})
        assert says in capsys.readouterr().err
    with pytest.raises(InvalidArgument, match="give both"):
        dataclasses.replace(cfg.store, namespace=None)


async def test_index_skips_e_for_what_the_store_holds(master):
    master.held = {embedding_key(NS, sha(A))}
    flags = ("--e-store-url", master.url, "--e-store-namespace", NS)
    async with index_proxy(flags=flags) as s:
        assert (await s.post(chat(TEXT, img(A), img(B)))).status == 200
        assert e_sent(s) == [sha(B)]  # A: P's connector loads it from the store
        assert pd_content(s)[1] == {**img(A), "uuid": sha(A)}
        assert s.sample("mmreuse_proxy_occurrences_total", klass="p_external") == 1
        assert s.sample("mmreuse_proxy_occurrences_total", klass="e_compute") == 1
        assert s.sample("mmreuse_proxy_e_store_queries_total", outcome="ok") == 1
        health = json.loads(await (await s.client.get("/health")).text())["mmreuse"]
        assert health["e_store"]["last_outcome"] == "ok"
        assert not [p for p in health["problems"] if p.startswith("e store")]

        master.mode = "500"  # the store gone bad: planned as without it, and said so
        assert (await s.post(chat(TEXT, img(A)))).status == 200
        assert e_sent(s) == [sha(B), sha(A)]
        assert s.sample("mmreuse_proxy_e_store_queries_total", outcome="http_error") == 1
        health = json.loads(await (await s.client.get("/health")).text())["mmreuse"]
        assert any(p.startswith("e store: last query http_error") for p in health["problems"])
