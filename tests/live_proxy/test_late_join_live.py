"""A proxy that starts after P has served, and one restarted mid-run, still know what P holds.

P0's KV-event replay buffer is 2 batches here (conftest), so no late subscriber can replay from
P's first batch: what P cached before is never published again. `--policy index` with
`--demand-endpoints` bootstraps its view from P's own state (DemandScheduler's snapshot, stamped
with the batch it is true at) and plans on it: every history image P holds is KV-covered,
without asking P per request. Skipped unless MMREUSE_LIVE=1.
"""

from __future__ import annotations

import time

import pytest

from mmreuse.cluster.client import post_json
from mmreuse.cluster.proxy import proxy_process
from mmreuse.cluster.workload import conversations
from mmreuse.proxy.metrics import sample_sum
from tests.support.live_proxy import metrics_text, until_complete

pytestmark = pytest.mark.live

SESSIONS = 2


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
            health = until_complete(url)
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
            "split": sample_sum(text, "mmreuse_proxy_arrival_requests_total", split="split"),
            "e_now": sample_sum(text, "mmreuse_proxy_arrival_items_total", action="e_now"),
        }
        # P's snapshot carried the identifiers its blocks carry (snapshot_identifiers): each
        # request's new image went to E at arrival, its history waited for the plan.
        assert got["split"] == SESSIONS and got["e_now"] == SESSIONS, (name, got)
        # Its view came from P's snapshot, and every decision was planned on it (none blind,
        # none asked of P): each session's history images (turns 0..turn-1) are KV-covered.
        assert got["snapshots"] >= 1 and got["blind"] == 0 and got["asked"] == 0, (name, got)
        assert got["kv_covered"] >= SESSIONS * turn and got["no_plan"] == 0, (name, got)
        assert got["errors"] == 0, (name, got)


def test_p_restarted_under_a_running_proxy_costs_no_request_and_no_stale_skip(
    cluster, proxy_flags, tmp_path
):
    # An index proxy follows P0 through two turns; P0 is restarted (its caches empty, its
    # events from seq 0 again) while the proxy runs. The proxy forgets the old P0 (the
    # disconnect resets the view), completes its view from the new one, and plans turn 2 on
    # it: nothing is skipped on the old P0's word, so P0 never runs its own encoder, and no
    # request fails.
    run = f"restart-{time.time_ns()}"
    requests = conversations(run, SESSIONS, 3)
    probe = cluster.probe()
    with proxy_process([*proxy_flags(["P0"]), "--policy", "index"], tmp_path / "p.log") as url:
        until_complete(url)
        for turn in (0, 1):
            _turn(url, requests, turn)
        before = metrics_text(url)
        took = cluster.restart("P0")
        health = until_complete(url, timeout=120)
        print(
            f"P0 restarted in {took:.1f} s; the proxy's view: {health['mmreuse']['views']['PD0']}"
        )
        p_before = probe.count("P0").log_inputs
        _turn(url, requests, 2)  # every one must answer: _turn asserts it
        after = metrics_text(url)
        p_forwards = probe.count("P0").log_inputs - p_before

    def delta(name: str, **labels: str) -> float:
        return sample_sum(after, name, **labels) - sample_sum(before, name, **labels)

    got = {
        "kv_covered": delta("mmreuse_proxy_occurrences_total", klass="kv_covered"),
        "kv_short": delta("mmreuse_proxy_fallbacks_total", kind="kv_short"),
        "errors": delta("mmreuse_proxy_requests_total", outcome="server_error")
        + delta("mmreuse_proxy_requests_total", outcome="client_error"),
        "restarts": delta("mmreuse_kv_event_publisher_restarts_total")
        + delta("mmreuse_kv_event_resyncs_total"),
        "p_forwards": p_forwards,
    }
    assert got["errors"] == 0 and got["restarts"] >= 1, got  # it saw the restart, lost nothing
    # the new P0 holds none of the history: nothing planned as covered, no stale skip
    assert got["kv_covered"] == 0 and got["kv_short"] == 0 and got["p_forwards"] == 0, got
