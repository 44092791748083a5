"""A proxy that starts after P has served, and one restarted mid-run, still know what P holds.

P0's KV-event replay buffer is 2 batches here (conftest), so no late subscriber can replay from
P's first batch: what P cached before is never published again. `--policy index` with
`--demand-endpoints` bootstraps its view from P's own state (DemandScheduler's snapshot, stamped
with the batch it is true at) and plans on it: every history image P holds is KV-covered,
without asking P per request. Skipped unless MMREUSE_LIVE=1.
"""

from __future__ import annotations

import json
import time
import urllib.request

import pytest

from mmreuse.cluster.client import post_json
from mmreuse.cluster.proxy import proxy_process
from mmreuse.cluster.workload import conversations
from mmreuse.proxy.metrics import sample_sum
from tests.support.live_proxy import metrics_text

pytestmark = pytest.mark.live

SESSIONS = 2


def _health(url: str) -> dict:
    with urllib.request.urlopen(url + "/health", timeout=30) as r:
        return json.loads(r.read())


def _until_complete(url: str, timeout: float = 60.0) -> dict:
    end = time.monotonic() + timeout
    while True:
        health = _health(url)
        if health["mmreuse"]["views"]["PD0"]["complete"]:
            return health
        assert time.monotonic() < end, health["mmreuse"]
        time.sleep(0.05)


def _turn(url: str, requests, turn: int) -> None:
    for _s, t, body in requests:
        if t == turn:
            assert post_json(url + "/v1/chat/completions", body, timeout=300)["choices"]


def test_a_late_and_a_restarted_proxy_plan_on_what_p_cached_before_them(
    cluster, proxy_flags, tmp_path
):
    run = f"late-{time.time_ns()}"
    requests = conversations(run, SESSIONS, 4)
    flags = proxy_flags(["P0"])
    with proxy_process([*flags, "--policy", "eager"], tmp_path / "eager.log") as url:
        for turn in (0, 1):  # P caches two turns of history (many more than 2 batches)
            _turn(url, requests, turn)
    for turn, name in ((2, "late"), (3, "restarted")):
        args = [*flags, "--policy", "index"]
        t0 = time.monotonic()
        with proxy_process(args, tmp_path / f"index-{name}.log") as url:
            up = time.monotonic() - t0
            health = _until_complete(url)
            done = time.monotonic() - t0
            print(f"{name} proxy: up in {up:.2f} s, its view complete {done:.2f} s after start")
            assert not any("incomplete" in p for p in health["mmreuse"]["problems"]), health
            _turn(url, requests, turn)
            text = metrics_text(url)
        got = {
            "snapshots": sample_sum(text, "mmreuse_kv_event_snapshots_total", outcome="ok"),
            "kv_covered": sample_sum(text, "mmreuse_proxy_occurrences_total", klass="kv_covered"),
            "blind": sample_sum(text, "mmreuse_proxy_blind_decisions_total"),
            "asked": sample_sum(text, "mmreuse_proxy_demand_answers_total"),
            "no_plan": sample_sum(text, "mmreuse_proxy_fallbacks_total", kind="no_plan"),
            "errors": sample_sum(text, "mmreuse_proxy_requests_total", outcome="server_error"),
        }
        # Its view came from P's snapshot, and every decision was planned on it (none blind,
        # none asked of P): each session's history images (turns 0..turn-1) are KV-covered.
        assert got["snapshots"] >= 1 and got["blind"] == 0 and got["asked"] == 0, (name, got)
        assert got["kv_covered"] >= SESSIONS * turn and got["no_plan"] == 0, (name, got)
        assert got["errors"] == 0, (name, got)
