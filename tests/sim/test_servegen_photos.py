"""The `servegen-photos` workload (mmreuse.sim.workload.servegen_photos): sessions that open with a
ServeGen request and ask follow-ups about the same images; its draws against the ServeGen table,
its arrival rate, its caps, and its config's refusals."""

from __future__ import annotations

import itertools
import statistics
from collections import Counter

import numpy as np
import pytest

pytest.importorskip("torch")  # mmreuse.sim's package imports the simulator (torch ops)

from mmreuse.errors import InvalidArgument, InvalidArgumentType
from mmreuse.sim import SimConfig, WorkloadConfig, generate, run
from mmreuse.sim.memory import Budget
from mmreuse.sim.servegen import shipped_table
from mmreuse.sim.workload import servegen_photos, servegen_rate_scale

KIND = "servegen-photos"


def stream(requests=300, seed=0, **kw):
    return generate(WorkloadConfig(kind=KIND, requests=requests, **kw), seed)


def test_sessions_open_with_images_and_follow_up_on_them():
    reqs = stream(400, mean_turns=3.0)
    assert len(reqs) == 400 and [r.rid for r in reqs] == list(range(400))
    assert all(a.arrival_ms <= b.arrival_ms for a, b in itertools.pairwise(reqs))
    assert reqs == stream(400, mean_turns=3.0)  # reproducible
    turns = Counter()
    for r in reqs:
        turns[r.session.sid] = max(turns[r.session.sid], r.turn + 1)
        own = r.session.turns[r.turn]
        if r.turn == 0:
            assert r.num_mm == len(own.images)
        else:  # a text-only follow-up, the history (and so every image) resent
            assert own.images == () and r.num_mm == len(r.session.turns[0].images)
            assert r.mm == r.session.mm[: r.num_mm]
        assert own.text_tokens >= 1
    # ids are unique per session: only its own turns share them
    owners = {m.identifier: r.session.sid for r in reqs for m in r.mm}
    assert all(owners[m.identifier] == r.session.sid for r in reqs for m in r.mm)
    assert statistics.mean(turns.values()) == pytest.approx(3.0, abs=0.5)


def test_openings_draw_the_tables_shapes():
    """Single-turn sessions are ServeGen's requests themselves: images per request, image,
    text and output tokens against the table's `all` entry."""
    dist = shipped_table().client("all")
    reqs = stream(6000, mean_turns=1.0)
    assert all(r.turn == 0 for r in reqs)
    images = Counter(len(r.session.turns[0].images) for r in reqs)
    for k, p in zip(dist.images_per_request.values[:4], dist.images_per_request.probs[:4], strict=True):  # fmt: skip
        assert images[k] / len(reqs) == pytest.approx(p, abs=0.015), k
    per_image = [n for r in reqs for _, n in r.session.turns[0].images]
    text = [r.session.turns[0].text_tokens for r in reqs]
    output = [r.session.turns[0].output_tokens for r in reqs]
    for values, q in (
        (per_image, dist.image_tokens_per_image),
        (text, dist.text_tokens),
        (output, dist.output_tokens),
    ):
        xs = np.asarray(values)
        for p in (0.25, 0.5, 0.9):  # the empirical CDF at the table's quantile
            assert np.mean(xs <= q.quantile(p) + 0.5) == pytest.approx(p, abs=0.03), p
        assert min(values) >= q.values[0] - 1 and max(values) <= q.values[-1]


def test_follow_ups_draw_the_tables_text_and_output():
    dist = shipped_table().client("all")
    reqs = stream(6000, mean_turns=4.0)
    follow = [r.session.turns[r.turn] for r in reqs if r.turn]
    assert len(follow) > 3000
    med_text = statistics.median(t.text_tokens for t in follow)
    med_out = statistics.median(t.output_tokens for t in follow)
    assert med_text == pytest.approx(dist.text_tokens.quantile(0.5), rel=0.08)
    assert med_out == pytest.approx(dist.output_tokens.quantile(0.5), rel=0.08)


def test_sessions_arrive_at_the_configured_rate_with_the_hours_cv():
    cfg = WorkloadConfig(kind=KIND, requests=1600, mean_turns=1.0, sessions_per_s=0.5)
    reqs = generate(cfg, 3)
    gaps = np.diff([r.arrival_ms / 1000.0 for r in reqs])
    # within the first hour (1800 sessions at 0.5/s): the hour's rate scaled to 0.5/s, CV 1
    early = gaps[:1500]
    assert 1.0 / early.mean() == pytest.approx(0.5, rel=0.08)
    assert early.std() / early.mean() == pytest.approx(1.0, rel=0.1)
    dist = shipped_table().client("all")
    assert servegen_rate_scale(cfg) == pytest.approx(0.5 / dist.hourly_rate[0])
    bursty = WorkloadConfig(kind=KIND, requests=1500, mean_turns=1.0, servegen_client="client-11")
    g = np.diff([r.arrival_ms for r in generate(bursty, 0)])
    assert g.std() / g.mean() > 2.0  # client-11 keeps its burstiness (CV 4-5)


def test_caps_clip_the_draws():
    reqs = stream(1500, mean_turns=3.0, max_images=2, max_text_tokens=64, max_output_tokens=8)
    turns = [r.session.turns[r.turn] for r in reqs]
    assert max(len(t.images) for t in turns) == 2
    assert max(t.text_tokens for t in turns) == 64 and max(t.output_tokens for t in turns) == 8
    assert min(t.text_tokens for t in turns) < 64  # clipped, not replaced
    uncapped = stream(1500, mean_turns=3.0)
    assert max(len(r.session.turns[0].images) for r in uncapped) > 2


def test_the_simulator_runs_it_with_servegens_image_tokens():
    cfg = SimConfig(workload=WorkloadConfig(kind=KIND, requests=120, mean_turns=3.0))
    rows, _ = run(cfg)
    assert {r["policy"] for r in rows} == {"eager", "demand", "opportunistic", "index"}
    assert all(r["wrong_skips"] == 0 for r in rows)
    eager = next(r for r in rows if r["policy"] == "eager")
    index = next(r for r in rows if r["policy"] == "index")
    assert index["encoder_forwards"] < eager["encoder_forwards"]  # follow-ups reuse the images
    tokens = {n for r in generate(cfg.workload, 0) for m in r.mm for n in [m.length]}
    assert len(tokens) > 10  # ServeGen's counts, not one fixed size


@pytest.mark.parametrize(
    ("kw", "error", "field"),
    [
        ({"servegen_client": "client-99"}, InvalidArgument, "servegen_client"),
        ({"servegen_client": ""}, InvalidArgument, "servegen_client"),
        ({"servegen_client": 3}, InvalidArgumentType, "servegen_client"),
        ({"servegen_hour": 24}, InvalidArgument, "servegen_hour"),
        ({"servegen_hour": -1}, InvalidArgument, "servegen_hour"),
        ({"max_images": -1}, InvalidArgument, "max_images"),
        ({"max_text_tokens": 1.5}, InvalidArgumentType, "max_text_tokens"),
        ({"max_output_tokens": True}, InvalidArgumentType, "max_output_tokens"),
    ],
)
def test_the_config_names_what_is_wrong(kw, error, field):
    with pytest.raises(error, match=rf"^WorkloadConfig.{field}"):
        WorkloadConfig(kind=KIND, **kw)


def test_a_config_file_reaches_the_fields():
    cfg = SimConfig.from_dict(
        {"workload": {"kind": KIND, "servegen_client": "client-12", "max_images": 3}}
    )
    assert cfg.workload.servegen_client == "client-12" and cfg.workload.max_images == 3
    with pytest.raises(InvalidArgument, match=r"^workload.servegen_client"):
        SimConfig.from_dict({"workload": {"kind": KIND, "servegen_client": "nobody"}})


def test_a_stream_too_big_for_the_budget_is_refused_while_drawn():
    cfg = WorkloadConfig(kind=KIND, requests=500)
    with pytest.raises(InvalidArgument, match=r"^WorkloadConfig.requests: the stream's first"):
        generate(cfg, 0, budget=Budget(200_000, 8.0))
    assert len(generate(cfg, 0, budget=Budget(1 << 30, 8.0))) == 500
    with pytest.raises(InvalidArgument, match=r"^WorkloadConfig.kind"):
        servegen_photos(WorkloadConfig(kind="chat"), 0)
