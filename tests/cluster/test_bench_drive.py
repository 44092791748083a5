"""bench-cluster's runs (mmreuse.cluster.bench_drive): records joined to their request, a
stream read as the client sees it, and a run's own argument checks. The live run is in
tests/live_proxy/test_bench_live.py."""

from __future__ import annotations

from types import SimpleNamespace as NS

import pytest

pytest.importorskip("torch")  # mmreuse.cluster.bench_drive loads mmreuse.sim, which needs it

from mmreuse.cluster.bench import RequestOutcome
from mmreuse.cluster.bench_drive import _by_tag, _send, run_policy


def req(rid, *uuids):
    return NS(rid=rid, uuids=tuple(uuids))


def test_records_are_joined_to_the_client_request_by_its_tag():
    p = [NS(request_id="chatcmpl-run-3-1a2b3c4d"), NS(request_id="chatcmpl-run-3-99999999")]
    e = [NS(request_id="chatcmpl-run-3:0:ab12cd-1a2b3c4d"), NS(request_id="chatcmpl-run-4:1:ff-0")]
    assert {k: len(v) for k, v in _by_tag(p, False).items()} == {"run-3": 2}  # a retry too
    assert {k: len(v) for k, v in _by_tag(e, True).items()} == {"run-3": 1, "run-4": 1}


CHUNK_A = b'data: {"choices":[{"delta":{"content":"a"}}]}'
CHUNK_B = b'data: {"choices":[{"delta":{"content":"b"}}]}'
ERROR = b'data: {"error":{"code":500}}'
DONE = b"data: [DONE]"


@pytest.mark.parametrize(
    ("lines", "status", "text"),
    [
        ([CHUNK_A, CHUNK_B, DONE], 200, "ab"),
        ([CHUNK_A, ERROR, DONE], -2, "a"),  # vLLM failed it after its 200 went out
        ([CHUNK_A], -2, "a"),  # broken off: no [DONE]
    ],
)
async def test_a_stream_that_fails_after_its_200_is_a_failed_request(lines, status, text):
    import aiohttp
    from aiohttp import web

    async def chat(request):
        resp = web.StreamResponse()
        await resp.prepare(request)
        for line in lines:
            await resp.write(line + b"\n\n")
        return resp

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        out = RequestOutcome(0)
        async with aiohttp.ClientSession() as session:
            await _send(session, f"http://127.0.0.1:{port}", NS(body={}), "t-0", out)
        assert (out.status, out.text) == (status, text) and out.ttft_ms is not None
    finally:
        await runner.cleanup()


def test_a_run_refuses_offsets_that_do_not_match_the_stream():
    with pytest.raises(ValueError, match=r"^offsets must hold one time per request \(2\), got 1"):
        run_policy(NS(), "eager", [req(0), req(1)], rate=1.0, run="r", offsets=[0.0])
