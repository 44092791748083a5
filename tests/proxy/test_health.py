"""The operations routes (`mmreuse.proxy.health`) as the reference serves them: GET /v1/models
(`list_models`), GET /health (`health_check`), POST /start_profile and /stop_profile
(`_profile_cmd`), and mmreuse's GET /metrics, over HTTP against recording fake E / P / D / PD
servers (tests/support/proxy_fakes.py)."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.epd_proxy import epd
from tests.support.proxy_fakes import chat, img, refused_url


async def test_models_proxied_from_the_first_decode_url():
    # list_models: GET {d_urls[0]}/v1/models.
    async with epd(n_d=2) as s:
        r = await s.client.get("/v1/models")
        assert r.status == 200
        assert await r.json() == {"object": "list", "data": [{"id": "tiny"}]}
        assert [x.path for x in s.d[0].seen] == ["/v1/models"]
        assert s.d[1].seen == []


async def test_health_e_pd():
    # health_check: each cluster "healthy", "unhealthy" (any instance's /health >= 400 or
    # unreachable) or "empty"; 503 as soon as one cluster is unhealthy.
    async with epd(n_e=2) as s:
        r = await s.client.get("/health")
        body = await r.json()
        assert r.status == 200
        assert {k: body[k] for k in ("proxy", "encode_cluster", "prefill_cluster")} == {
            "proxy": "healthy",
            "encode_cluster": "healthy",
            "prefill_cluster": "empty",
        }
        assert body["decode_cluster"] == "healthy"
        assert body["mmreuse"]["status"] == "ok" and body["mmreuse"]["problems"] == []
        assert body["mmreuse"]["e_side"] is None  # eager keeps no E-side record
        s.e[1].fail["/health"] = [500]
        r = await s.client.get("/health")
        body = await r.json()
        assert r.status == 503
        assert (body["proxy"], body["encode_cluster"], body["decode_cluster"]) == (
            "healthy",
            "unhealthy",
            "healthy",
        )
        assert (await s.client.get("/health")).status == 200  # it recovered


async def test_health_e_p_d_and_unreachable_decode():
    # health_check: an unreachable instance is "unhealthy"; E + P + D reports the P cluster.
    async with epd(n_p=1, d_urls=[refused_url()]) as s:
        r = await s.client.get("/health")
        body = await r.json()
        assert r.status == 503
        assert (body["encode_cluster"], body["prefill_cluster"], body["decode_cluster"]) == (
            "healthy",
            "healthy",
            "unhealthy",
        )
        s.p[0].fail["/health"] = [503]
        body = await (await s.client.get("/health")).json()
        assert body["prefill_cluster"] == "unhealthy"


async def test_metrics_exposition():
    # Not in the reference: Prometheus text exposition of the proxy's counters.
    async with epd() as s:
        await s.post(chat(img("http://img/a.png"), img("http://img/b.png")))
        r = await s.client.get("/metrics")
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/plain")
        samples = {
            (x.name, tuple(sorted(x.labels.items()))): x.value
            for family in text_string_to_metric_families(await r.text())
            for x in family.samples
        }
        ok = ("mmreuse_proxy_requests_total", (("outcome", "ok"), ("policy", "eager")))
        assert samples[ok] == 1
        assert samples[("mmreuse_proxy_encoder_items_total", (("action", "sent"),))] == 2
        assert samples[("mmreuse_proxy_encoder_subrequests_total", ())] == 1
        assert samples[("mmreuse_proxy_occurrences_total", (("klass", "unclassified"),))] == 2
        for stage in ("encode", "decode", "total"):
            assert samples[("mmreuse_proxy_stage_seconds_count", (("stage", stage),))] == 1
        assert samples[("mmreuse_proxy_stage_seconds_count", (("stage", "prefill"),))] == 0


@pytest.mark.parametrize("n_p", [0, 1])
async def test_start_and_stop_profile(n_p):
    # start_profile / stop_profile -> _profile_cmd: one E, P (if any) and D; a 404 is None.
    async with epd(n_p=n_p, env={"OPENAI_API_KEY": "k-1"}) as s:
        for cmd in ("start", "stop"):
            r = await s.client.post(f"/{cmd}_profile", json={"steps": 3})
            assert r.status == 200
            assert await r.json() == {
                "encode": {"ok": "e"},
                "prefill": {"ok": "p"} if n_p else None,
                "decode": {"ok": "d" if n_p else "pd"},
            }
        for fake in (*s.e, *s.p, *s.d):
            assert [(x.path, x.body) for x in fake.seen] == [
                ("/start_profile", {"steps": 3}),
                ("/stop_profile", {"steps": 3}),
            ]
            assert fake.seen[0].headers["authorization"] == "Bearer k-1"
        s.e[0].fail["/start_profile"] = [404]
        r = await s.client.post("/start_profile", json={})
        assert (await r.json())["encode"] is None
        for fake in (*s.e, *s.p, *s.d):
            fake.fail["/stop_profile"] = [404]
        r = await s.client.post("/stop_profile", json={})
        assert r.status == 503
        assert await r.json() == {"detail": "Profiling endpoints are disabled on all clusters"}
