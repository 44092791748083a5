"""DemandScheduler against vLLM 0.33.0's real Scheduler (oracle venv:
tools/oracle/demand_scheduler_check.py runs both side by side on one multimodal stream with a
small KV pool and encoder cache): identical scheduling, side-effect-free answers that are exact
when nothing runs between answer and admission, sound proofs, and a residency index equal to
vLLM's prefix cache after every step."""

from __future__ import annotations

import json

import pytest

from tests.support.oracle import oracle_json, oracle_lines
from tests.support.paths import REPO


@pytest.mark.oracle
@pytest.mark.parametrize("seed, async_", [(0, 0), (5, 0), (0, 1)], ids=["s0", "s5", "async-s0"])
def test_demand_scheduler_against_vllms_scheduler(oracle_python, seed, async_):
    """Under async scheduling DemandScheduler is itself an AsyncScheduler (vLLM's base then)."""
    py = oracle_python
    c = oracle_json(
        py,
        str(REPO / "tools/oracle/demand_scheduler_check.py"),
        str(seed),
        "120",
        str(async_),
        timeout=600,
    )
    assert c["scheduler"] == ("AsyncDemandScheduler" if async_ else "DemandScheduler")
    assert c["output_mismatch"] == 0, c  # behaves exactly as vLLM's scheduler
    assert c["side_effects"] == 0, c  # answering changes nothing in P
    assert c["index_mismatch"] == 0 and c["stats"]["index_mismatches"] == 0, c
    assert c["exact_mismatch"] == 0 and c["exact_checked"] >= 30, c
    assert c["unsound"] == 0, c
    # the stream exercises what the answers are about
    assert c["kv_hits"] >= 20 and c["reused"] >= 20 and c["e_compute"] >= 100, c
    st = c["stats"]
    assert st["admitted"] >= 100 and sum(st["changed"].values()) >= 3, st
    assert st["proof_valid"] + sum(st["changed"].values()) == st["admitted"], st
    assert c["socket_answers"] == 2 and c["socket_errors"] == 1, c
    # admission records: one per admission, its C, the answer's classes, the items P encoded
    # (a preempted request is admitted again when it resumes: one more record)
    assert c["records"] >= st["admitted"] and c["record_c_mismatch"] == 0, c
    assert c["record_answer_mismatch"] == 0 and c["record_encoded_mismatch"] == 0, c


@pytest.mark.oracle
def test_rule_s_is_what_vllms_scheduler_does(oracle_python):
    """A request's own allocation evicts the freeable entry its later item would reuse: vLLM
    encodes that item again, and compute_demand says so with the cache's space (rule S)."""
    py = oracle_python
    lines = oracle_lines(py, str(REPO / "tools/oracle/self_eviction_check.py"))
    cases = {c["case"]: c for c in map(json.loads, lines[-2:])}
    evicted, kept = cases["X then C"], cases["X then D"]
    for c in (evicted, kept):
        assert c["cache_before"] == {"freeable": ["C", "D"], "free": 0}, c
        assert c["rule_s"]["needs_encoder"] == c["vllm_encoded"], c  # exact, both ways
    assert evicted["vllm_encoded"] == [0, 1] and evicted["rule_s"]["self_evicted"] == ["C", "D"]
    assert evicted["without_rule_s"]["needs_encoder"] == [0]  # what the rule corrects
    assert kept["vllm_encoded"] == [0] and kept["rule_s"]["classes"] == ["e_compute", "p_local"]


_HYBRID_CHECK = """
import json, types
from mmreuse.integrations.vllm_demand import DemandScheduler
ns = lambda **kw: types.SimpleNamespace(**kw)
out = {}
for groups in (1, 2):
    stand_in = ns(
        kv_cache_manager=ns(enable_caching=True, block_pool=ns(num_gpu_blocks=8)),
        kv_cache_config=ns(kv_cache_groups=[object()] * groups),
        block_size=16,
        _hook_pool=lambda pool, index: None,
    )
    index, note = DemandScheduler._make_index(stand_in)
    out[groups] = [index is not None, note]
print(json.dumps(out))
"""


@pytest.mark.oracle
def test_a_hybrid_attention_p_turns_its_index_off(oracle_python):
    """DemandScheduler's residency index follows one KV cache group: with two (hybrid
    attention) it would prove coverage another group evicted, so it is off, saying why."""
    got = oracle_json(oracle_python, "-c", _HYBRID_CHECK, timeout=300)
    assert got["1"][0] is True
    assert (
        got["2"] == [False, got["2"][1]] and "2 KV cache groups (hybrid attention)" in got["2"][1]
    )


@pytest.mark.oracle
@pytest.mark.parametrize("seed", [0, 5])
def test_a_snapshot_and_the_events_after_its_stamp_are_the_whole_stream(oracle_python, seed):
    """DemandScheduler's KV snapshot, taken after update_from_output and between schedule and
    update_from_output (the pool's events for the next batch undone), bootstraps a view that
    equals the view of every batch vLLM published from 0, at every later step."""
    c = oracle_json(
        oracle_python, str(REPO / "tools/oracle/snapshot_check.py"), str(seed), "120", timeout=600
    )
    assert c["mismatch"] == 0 and c["stamp_mismatch"] == 0, c
    # the stream exercises it: many snapshots, some with events pending, over several chunks
    assert c["snapshots"] >= 50 and c["pending_at_snapshot"] >= 2 and c["chunked"] >= 20, c
    assert c["batches"] >= 20 and c["max_blocks"] >= 20, c
    assert "publishes no KV events" in c["no_events_error"], c
    # the encoder cache's snapshot (EventfulEncoderCacheManager in the scheduler), 2 a chunk
    assert c["ec_mismatch"] == 0 and c["ec_snapshots"] >= 50 and c["ec_entries_max"] >= 3, c
    assert "publishes no events" in c["no_ec_events_error"], c
    # taking one holds the engine's lock: an unchanged P shares its last, a changed one waits
    assert c["unchanged_shared"] and c["changed"] and c["changed_limited"], c
