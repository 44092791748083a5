"""mmreuse.proxy.models: a request naming a LoRA adapter is never planned on the base model's
blocks (the proxy hashes as the base model; vLLM keys an adapter's blocks with the adapter)."""

import pytest

from mmreuse.proxy.models import REFRESH_S, ModelCatalog
from tests.support.index_proxy import TEXT, A, B, e_sent, index_proxy
from tests.support.proxy_fakes import chat, img, sha

VLLM_MODELS = [  # vLLM's /v1/models with one adapter loaded (--lora-modules sql=/adapters/sql)
    {"id": "tiny", "object": "model", "root": "/models/tiny", "parent": None},
    {"id": "sql", "object": "model", "root": "/adapters/sql", "parent": "tiny"},
]


class Server:
    def __init__(self, status=200, body=b""):
        self.status, self.body, self.reads = status, body, 0

    async def get(self, url):
        self.reads += 1
        assert url == "http://pd/v1/models"
        return self.status, self.body


async def test_requests_that_come_during_the_first_read_wait_for_it():
    # The first requests after start arrive together: each must get the list being read,
    # not "unknown" (which cost the plan of every request but the first).
    import asyncio
    import json

    gate = asyncio.Event()

    class Slow(Server):
        async def get(self, url):
            self.reads += 1
            await gate.wait()
            return self.status, self.body

    server = Slow(body=json.dumps({"data": VLLM_MODELS}).encode())
    catalog = ModelCatalog(server.get)
    asks = [asyncio.ensure_future(catalog.kind("http://pd", m)) for m in ("tiny", "sql", "tiny")]
    await asyncio.sleep(0)
    gate.set()
    assert await asyncio.gather(*asks) == ["base", "adapter", "base"]
    assert server.reads == 1


async def test_base_adapter_and_unknown_names():
    import json

    server, now = Server(body=json.dumps({"data": VLLM_MODELS}).encode()), [0.0]
    catalog = ModelCatalog(server.get, clock=lambda: now[0])
    assert await catalog.kind("http://pd", "tiny") == "base"
    assert await catalog.kind("http://pd", "sql") == "adapter"
    assert server.reads == 1  # read once, then answered from what it listed
    assert await catalog.kind("http://pd", "made-up") == "unknown"
    assert await catalog.kind("http://pd", "made-up-2") == "unknown"
    assert server.reads == 1  # an unknown name re-reads at most every REFRESH_S
    now[0] += REFRESH_S
    server.body = json.dumps({"data": [*VLLM_MODELS, {"id": "made-up", "parent": "tiny"}]}).encode()
    assert await catalog.kind("http://pd", "made-up") == "adapter"  # P loaded it since
    assert server.reads == 2


@pytest.mark.parametrize(
    "status, body, why",
    [(500, b"", "answered 500"), (200, b"[]", "not a model list"), (200, b"{", "DecodeError")],
)
async def test_an_unreadable_list_makes_every_name_unknown(status, body, why):
    catalog = ModelCatalog(Server(status, body).get)
    assert await catalog.kind("http://pd", "tiny") == "unknown"
    assert why in catalog.errors["http://pd"]


async def test_an_adapter_request_is_served_as_eager_and_a_base_one_planned(caplog):
    async with index_proxy() as s:
        s.pd[0].models = VLLM_MODELS
        await s.hold(0, [sha(A), sha(B)], 4)  # the base model's blocks covering A
        assert (await s.post(chat(TEXT, img(A), img(B), model="sql"))).status == 200
        assert e_sent(s) == [sha(A), sha(B)]  # not planned on the base model's blocks
        assert s.sample("mmreuse_proxy_fallbacks_total", instance="PD0", kind="no_plan") == 1
        assert any("'sql' is a LoRA adapter" in m for m in caplog.messages)
        assert (await s.post(chat(TEXT, img(A), img(B), model="tiny"))).status == 200
        assert e_sent(s)[2:] == [sha(B)]  # the base model's request: A is KV-covered
        assert (await s.post(chat(TEXT, img(A), model="elsewhere"))).status == 200
        assert e_sent(s)[3:] == [sha(A)]
        assert any("'elsewhere' is not known" in m for m in caplog.messages)
        assert [x.path for x in s.pd[0].seen].count("/v1/models") == 1  # once in REFRESH_S
