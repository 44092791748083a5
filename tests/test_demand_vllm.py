"""compute_demand vs vLLM's own Scheduler._try_schedule_encoder_inputs (oracle venvs: 0.33.0,
0.34.0)."""

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from mmreuse import Availability, ItemClass, MMOccurrence, compute_demand
from tests.support.strategies import demand_requests

pytestmark = pytest.mark.oracle

COVERED = {ItemClass.KV_COVERED, ItemClass.NO_EMBEDS}


def vllm_outcome(vllm_scheduler, occs, n, c, avail, encdec):
    return vllm_scheduler.compute(
        {
            "occurrences": [
                {
                    "identifier": m.identifier,
                    "offset": m.offset,
                    "length": m.length,
                    "is_embed": None if m.is_embed is None else list(m.is_embed),
                }
                for m in occs
            ],
            "num_prompt_tokens": n,
            "num_computed_tokens": c,
            "p_local": avail["p_local"],
            "p_local_freeable": sorted(avail["p_local_freeable"]),
            "p_external": sorted(avail["p_external"]),
            "is_encoder_decoder": encdec,
        }
    )


def vllm_classes(out, occs):
    """What vLLM does with each occurrence: encode / load / reuse / nothing."""
    by_item = {}
    for i in out["encode"]:
        by_item[i] = "encode"
    for i in out["load"]:
        by_item[i] = "load"
    for i in out["duplicate"]:  # same as the scheduled occurrence of that identifier
        first = next(
            j for j in out["encode"] + out["load"] if occs[j].identifier == occs[i].identifier
        )
        by_item[i] = by_item[first]
    for i in out["cache_hit"]:  # a P-local reference; a reuse only if P consumes embeddings
        by_item[i] = "reuse" if out["embeds_in_window"][i] else "nothing"
    return [by_item.get(i, "nothing") for i in range(len(occs))]


EXPECT = {
    ItemClass.E_COMPUTE: "encode",
    ItemClass.E_CACHED: "encode",
    ItemClass.P_EXTERNAL: "load",
    ItemClass.P_LOCAL: "reuse",
    ItemClass.KV_COVERED: "nothing",
    ItemClass.NO_EMBEDS: "nothing",
}


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(req=demand_requests(max_tokens=400), encdec=st.integers(0, 9))
def test_classes_equal_vllm_scheduler(vllm_scheduler, req, encdec):
    occs, n, c, avail = req
    # vLLM's window bisects on offset + length, assuming it sorted (true unless overlapping
    # items end out of order, where vLLM itself can skip or mis-schedule an item).
    ends = [m.end for m in occs]
    assume(ends == sorted(ends))
    encdec = encdec == 0
    if encdec:  # encoder inputs sit at position 0 in encoder-decoder models
        occs = [MMOccurrence(m.identifier, 0, m.length, m.is_embed) for m in occs]
        c = min(c, 3)
    res = compute_demand(occs, n, c, Availability(**avail), is_encoder_decoder=encdec)
    out = vllm_outcome(vllm_scheduler, occs, n, c, avail, encdec)
    assert bool(res.conflicts) == out["rejected"]
    if out["rejected"]:
        return
    assert [EXPECT[d.klass] for d in res.decisions] == vllm_classes(out, occs)
    for d, k in zip(res.decisions, out["embeds_in_window"], strict=True):
        assert d.uncovered_embeds == (k if not encdec or c == 0 else 0)


def test_oracle_sees_the_spec_cases(vllm_scheduler):
    """A few §6.4 cases, end to end through vLLM."""
    X = [MMOccurrence("X", 4, 16), MMOccurrence("X", 60, 16)]
    empty = {
        "p_local": {},
        "p_local_freeable": frozenset(),
        "p_external": frozenset(),
        "e_cached": frozenset(),
    }
    out = vllm_outcome(vllm_scheduler, X, 96, 48, empty, False)
    assert vllm_classes(out, X) == ["nothing", "encode"]
    out = vllm_outcome(vllm_scheduler, X, 96, 0, empty, False)
    assert vllm_classes(out, X) == ["encode", "encode"] and out["duplicate"] == [1]
    local = dict(empty, p_local={"X": 16})
    assert vllm_classes(vllm_outcome(vllm_scheduler, X, 96, 48, local, False), X) == [
        "nothing",
        "reuse",
    ]
    bad = dict(empty, p_local={"X": 15})
    assert vllm_outcome(vllm_scheduler, X, 96, 48, bad, False)["rejected"]
