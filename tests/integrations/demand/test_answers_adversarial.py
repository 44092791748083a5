"""DemandScheduler under a hostile demand client (oracle venv:
tools/oracle/demand_adversarial_check.py drives it side by side with vLLM's Scheduler and
throws malformed, oversized and out-of-range frames at `_handle` and over the real ROUTER socket
between steps, then a burst of 2,000 unread queries while the engine steps): nothing escapes,
every answer is a DemandError or a valid answer of the expected kind, answers change nothing in
P, scheduling stays vLLM's, the index stays exact and the answer thread survives."""

from __future__ import annotations

import json

import pytest

from tests.support.oracle import oracle_run
from tests.support.paths import REPO

HANG_S = 2.0  # a hang guard, not a timing bound: answers take milliseconds


@pytest.mark.oracle
def test_hostile_client_cannot_break_p(oracle_python):
    py = oracle_python
    out = oracle_run(py, str(REPO / "tools/oracle/demand_adversarial_check.py"))
    c = json.loads(out.stdout.strip().splitlines()[-1])
    assert c["findings"] == [], c["findings"]
    # every kind of hostile frame thrown, directly and over the socket
    assert c["frames_direct"] > c["hostile_kinds"] >= 60, c
    assert c["frames_socket"] >= c["hostile_kinds"], c
    assert c["raised"] == 0 and c["no_reply"] == 0, c  # _handle never raises, always answers
    assert c["invalid"] == 0, c  # each answer a DemandError or a valid answer to its query
    assert c["unexpected"] == 0 and c["unexpected_names"] == {}, c  # of the kind expected
    assert c["wrong_error_id"] == 0, c  # a DemandError names the frame's id when it has one
    assert c["errors"] > 0 and c["answers"] > 0 and c["stats"] > 0, c
    assert c["side_effects"] == 0, c  # answering changed nothing in P
    assert c["output_mismatch"] == 0 and c["steps"] >= 100, c  # vLLM's scheduling, each step
    assert c["index_mismatch"] == 0 and c["final_index_mismatches"] == 0, c
    # the answer thread: alive after every frame a DEALER should not send, and after a bug
    assert c["thread_alive"] and c["survives_handler_error"], c
    for k in ("three_parts", "empty_frame", "empty_parts", "tcp_garbage", "oversize", "burst"):
        assert c[f"alive_after_{k}"], (k, c)
    assert not c["oversize_answered"], c  # a frame over the limit is dropped unread
    # the burst: every query handled while the engine stepped on
    assert c["burst_answered"] == 2000 and c["burst_steps"] >= 8, c
    assert c["burst_answers_read"] > 0, c
    assert c["slowest_s"] < HANG_S and c["slowest_step_s"] < HANG_S, c
    assert c["max_lock_held_s"] < HANG_S, c
