"""mmreuse.sim.policies: what the proxy's path costs in the simulator: P's render before a plan
(its processor cache remembering images) and the split at arrival (new items to E at once)."""

import json

import pytest

pytest.importorskip("torch")  # the simulator's caches are residency ops

from mmreuse.sim import ClusterConfig, ConfigError, SimConfig, WorkloadConfig, run
from mmreuse.sim.config import COSTS, CostModel

RENDER = 1000.0  # ms an image: far above every other cost, so that its place shows in TTFT


def _trace(tmp_path, turns):
    """One session: each turn (arrival s, its images), 64-token images."""
    lines = [
        json.dumps(
            {
                "session": "s",
                "arrival_s": t,
                "text_tokens": 40,
                "images": [{"id": i, "tokens": 64} for i in imgs],
                "output_tokens": 8,
            }
        )
        for t, imgs in turns
    ]
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def _ttfts(tmp_path, turns, policy, **cost):
    cfg = SimConfig(
        policies=(policy,),
        cost=CostModel(render_fixed_ms=0.0, render_ms_per_image=RENDER, **cost),
        cluster=ClusterConfig(num_encoders=1, num_prefills=1, external_store_embeds=0),
        workload=WorkloadConfig(kind="trace", requests=10, trace_path=str(_trace(tmp_path, turns))),
    )
    rows, results = run(cfg)
    return results[0].ttft_ms, rows[0]


@pytest.mark.parametrize("policy", ["index", "demand"])
def test_a_request_of_new_items_goes_to_e_at_arrival_unrendered(tmp_path, policy):
    eager, _ = _ttfts(tmp_path, [(0.0, ["a", "b"])], "eager")
    split, row = _ttfts(tmp_path, [(0.0, ["a", "b"])], policy)
    assert split == eager and split[0] < RENDER  # no render on its path, no round trip
    assert (row["e_requests"], row["transfers"], row["wrong_skips"]) == (1, 1, 0)


@pytest.mark.parametrize("policy", ["index", "demand"])
def test_a_mixed_request_waits_for_the_render_of_its_history_only(tmp_path, policy):
    """Turn 2 resends a (held: P's KV and encoder cache) and brings c: c goes to E at arrival,
    while P renders the request; P's processor cache saw a in turn 1, so only c costs image
    processing. One E request and one transfer for the turn, as the real proxy counts them."""
    turns = [(0.0, ["a"]), (60.0, ["c"])]
    ttft, row = _ttfts(tmp_path, turns, policy)
    assert RENDER <= ttft[1] < 2 * RENDER  # c's render, not a's
    assert (row["e_requests"], row["transfers"], row["wrong_skips"]) == (2, 2, 0)
    eager, _ = _ttfts(tmp_path, turns, "eager")
    assert eager[1] < RENDER  # eager never renders


def test_a_render_costs_its_fixed_part_and_each_unseen_image():
    cost = CostModel(render_fixed_ms=2.0, render_ms_per_image=3.0)
    assert cost.render_ms(0) == 2.0 and cost.render_ms(4) == 14.0


def test_a_cost_model_by_name(tmp_path):
    assert SimConfig.from_dict({"cost": "serving-bed"}).cost == COSTS["serving-bed"]
    assert SimConfig.from_dict({"cost": "gpu"}).cost == CostModel()
    with pytest.raises(ConfigError, match=r"cost: must be an object or one of \['gpu', 'serving-bed'\], got 'h100'"):  # fmt: skip
        SimConfig.from_dict({"cost": "h100"})
    with pytest.raises(ConfigError, match="render_ms_per_image"):
        SimConfig.from_dict({"cost": {"render_ms_per_image": -1}})
