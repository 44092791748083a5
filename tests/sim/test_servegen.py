"""The ServeGen table (mmreuse/sim/data/servegen_mm_image.json): it ships, loads and is checked
field by field; the sampler is reproducible and draws what the table says; and
tools/servegen_table.py derives such a table from ServeGen-shaped data, deterministically."""

from __future__ import annotations

import copy
import importlib.util
import json
import re
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")  # mmreuse.sim's package imports the simulator (torch ops)

from mmreuse.errors import InvalidArgument, InvalidArgumentType
from mmreuse.sim import servegen
from mmreuse.sim.servegen import (
    ClientDistribution,
    load_table,
    parse_table,
    sample_requests,
)

ROOT = Path(__file__).resolve().parents[2]
TABLE = ROOT / "mmreuse" / "sim" / "data" / servegen.TABLE_NAME


@pytest.fixture(scope="module")
def table():
    return load_table()


@pytest.fixture
def raw():
    return json.loads(TABLE.read_text())


# --- the shipped table -------------------------------------------------------------------------


def test_the_table_is_small_and_ships_as_package_data():
    assert TABLE.stat().st_size < 100_000
    assert '"sim/data/*.json"' in (ROOT / "pyproject.toml").read_text()


def test_the_table_loads_with_its_source_and_licence(table):
    src = table.source
    assert src["repository"] == "https://github.com/alibaba/ServeGen"
    assert re.fullmatch(r"[0-9a-f]{40}", src["commit"])
    assert src["licence"] == "Apache-2.0"
    assert "Apache License, Version 2.0" in src["notice"] and "ServeGen" in src["citation"]
    assert table.names[-1] == "all" and len(table.names) >= 6
    assert table.client("all").share == 1.0
    shares = [c.share for c in table.clients[:-1]]
    assert shares == sorted(shares, reverse=True) and sum(shares) < 1.0
    for c in table.clients:
        assert len(c.hourly_rate) == 24 and len(c.hourly_cv) == 24
        assert c.image_tokens_per_image.values[0] >= 1
        assert len(c.text_tokens.values) == len(table.quantile_probs)
    # the aggregate's rate is the sum of every client's, so at least the listed ones'
    for h in range(24):
        assert (
            table.client("all").hourly_rate[h]
            >= sum(c.hourly_rate[h] for c in table.clients[:-1]) - 1e-3
        )


def test_an_unknown_client_is_named(table):
    with pytest.raises(InvalidArgument, match=r"client must be one of client-.*, got 'nope'"):
        table.client("nope")


# --- the sampler -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["all", "client-12"])
def test_the_sampler_is_reproducible_per_seed(table, name):
    dist = table.client(name)
    a = sample_requests(dist, 500, seed=3)
    assert a == sample_requests(dist, 500, seed=3)
    assert a != sample_requests(dist, 500, seed=4)
    assert a[:100] != sample_requests(dist, 100, seed=3, start_hour=5)
    arrivals = [r.arrival_s for r in a]
    assert arrivals == sorted(arrivals) and arrivals[0] >= 0
    assert sample_requests(dist, 0, seed=3) == []


def _check_quantiles(samples: np.ndarray, q: servegen.Quantiles, eps: float) -> None:
    """For each grid point p, r = round(Q(p)): P(X <= r) >= p and P(X < r) <= p (up to eps),
    which holds for the rounded interpolating sampler whatever atoms the law has."""
    for p in (0.05, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95):
        r = np.floor(q.quantile(p) + 0.5)
        assert np.mean(samples <= r) >= p - eps, (p, r)
        assert np.mean(samples < r) <= p + eps, (p, r)
    assert abs(samples.mean() - q.mean) <= 0.05 * q.mean + 1


@pytest.mark.parametrize("name", ["all", "client-12", "client-11"])
def test_sampled_marginals_match_the_table(table, name):
    dist = table.client(name)
    reqs = sample_requests(dist, 4000, seed=11)
    images = np.array([r.images for r in reqs])
    pmf = dist.images_per_request
    freq = np.array([np.mean(images == v) for v in pmf.values])
    assert np.abs(freq - np.array(pmf.probs)).sum() / 2 < 0.03  # total variation
    assert set(images.tolist()) <= set(pmf.values)
    per_image = np.array([t for r in reqs for t in r.image_tokens])
    _check_quantiles(per_image, dist.image_tokens_per_image, 0.025)
    _check_quantiles(np.array([r.text_tokens for r in reqs]), dist.text_tokens, 0.025)
    _check_quantiles(np.array([r.output_tokens for r in reqs]), dist.output_tokens, 0.025)


def test_arrivals_follow_the_hourly_rates(table):
    dist = table.client("all")  # CV 1: Poisson per hour
    scale = 0.02
    n = int(sum(dist.hourly_rate) * 3600 * scale)
    arrivals = np.array([r.arrival_s for r in sample_requests(dist, n, seed=5, rate_scale=scale)])
    counts = np.bincount((arrivals // 3600).astype(int), minlength=24)[:24]
    expected = np.array(dist.hourly_rate) * 3600 * scale
    assert np.all(np.abs(counts[:23] - expected[:23]) <= 0.2 * expected[:23] + 5)
    # start_hour shifts the day (the first 180 s of hour 16), rate_scale scales it
    for scale in (1.0, 0.5):
        reqs = sample_requests(dist, 3000, seed=5, start_hour=16, rate_scale=scale)
        want = dist.hourly_rate[16] * 180 * scale
        assert abs(sum(r.arrival_s < 180 for r in reqs) - want) <= 0.1 * want


def test_a_bursty_client_keeps_its_cv(table):
    dist = table.client("client-11")  # the hourly CVs are 4-5
    arrivals = np.array([r.arrival_s for r in sample_requests(dist, 2000, seed=2, start_hour=8)])
    gaps = np.diff(arrivals[arrivals < 3600])
    assert gaps.std() / gaps.mean() > 2


def test_idle_hours_are_skipped(table):
    dist = table.client("client-1")  # idle for hours each day
    idle = [h for h in range(24) if dist.hourly_rate[h] == 0]
    assert idle
    arrivals = np.array(
        [r.arrival_s for r in sample_requests(dist, 3000, seed=1, start_hour=idle[0])]
    )
    assert arrivals[0] >= 3600  # nothing in the idle hour


@pytest.mark.parametrize(
    ("kwargs", "exc", "field"),
    [
        ({"n": -1}, InvalidArgument, "n"),
        ({"n": 2.0}, InvalidArgumentType, "n"),
        ({"seed": True}, InvalidArgumentType, "seed"),
        ({"start_hour": 24}, InvalidArgument, "start_hour"),
        ({"rate_scale": 0}, InvalidArgument, "rate_scale"),
        ({"dist": "all"}, InvalidArgumentType, "dist"),
    ],
)
def test_sampler_arguments_are_checked(table, kwargs, exc, field):
    args = {"dist": table.client("all"), "n": 5, "seed": 0, **kwargs}
    with pytest.raises(exc, match=rf"^{field} must be"):
        sample_requests(**args)


# --- a corrupted table -------------------------------------------------------------------------


def _corrupt(raw, path, value):
    doc = copy.deepcopy(raw)
    *head, last = path
    node = doc
    for key in head:
        node = node[key]
    if value is KeyError:
        del node[last]
    else:
        node[last] = value
    return doc


@pytest.mark.parametrize(
    ("path", "value", "exc", "message"),
    [
        (["format"], "other/2", InvalidArgument, r"table\.format must be 'mmreuse\.servegen/1'"),
        (["source", "licence"], "MIT", InvalidArgument, r"table\.source\.licence must be"),
        (["source", "commit"], KeyError, InvalidArgument, r"table\.source is missing commit"),
        (
            ["clients", 0, "extra"],
            1,
            InvalidArgument,
            r"table\.clients\[0\] has unknown fields 'extra'",
        ),
        (["quantile_probs", 3], 0.0, InvalidArgument, r"table\.quantile_probs\[3\] must be >"),
        (
            ["clients", 0, "text_tokens", "quantiles", 50],
            0,
            InvalidArgument,
            r"table\.clients\[0\]\.text_tokens\.quantiles\[50\] must be >= \d+ \(non-decreasing\), got 0",
        ),
        (
            ["clients", 1, "image_tokens_per_image", "quantiles", 0],
            0,
            InvalidArgument,
            r"table\.clients\[1\]\.image_tokens_per_image\.quantiles\[0\] must be >= 1, got 0",
        ),
        (
            ["clients", 2, "output_tokens", "quantiles", 4],
            "12",
            InvalidArgumentType,
            r"table\.clients\[2\]\.output_tokens\.quantiles\[4\] must be an int, got str '12'",
        ),
        (
            ["clients", 0, "images_per_request", "probs", 0],
            0.9,
            InvalidArgument,
            r"table\.clients\[0\]\.images_per_request\.probs must sum to 1, got",
        ),
        (
            ["clients", 3, "hourly_rate", 7],
            -0.5,
            InvalidArgument,
            r"table\.clients\[3\]\.hourly_rate\[7\] must be >= 0\.0, got -0\.5",
        ),
        (
            ["clients", 3, "hourly_rate"],
            [1.0] * 23,
            InvalidArgument,
            r"table\.clients\[3\]\.hourly_rate must be a list of 24 values \(got 23\)",
        ),
        (
            ["clients", 3, "hourly_rate"],
            [0.0] * 24,
            InvalidArgument,
            r"table\.clients\[3\]\.hourly_rate must be some rate > 0",
        ),
        (
            ["clients", 4, "hourly_cv", 0],
            0,
            InvalidArgument,
            r"table\.clients\[4\]\.hourly_cv\[0\] must be > 0\.0, got 0",
        ),
        (
            ["clients", 4, "hourly_cv", 0],
            float("nan"),
            InvalidArgument,
            r"table\.clients\[4\]\.hourly_cv\[0\] must be a finite number",
        ),
        (
            ["clients", 1, "name"],
            "client-12",
            InvalidArgument,
            r"table\.clients\[1\]\.name must be unique",
        ),
        (["clients"], [], InvalidArgument, r"table\.clients must be a non-empty list"),
    ],
)
def test_a_corrupted_table_names_the_field_and_value(table, raw, path, value, exc, message):
    assert parse_table(raw).clients == table.clients  # the uncorrupted copy is fine
    doc = _corrupt(raw, path, value)
    with pytest.raises(exc, match=rf"^{servegen.TABLE_NAME}: {message}"):
        parse_table(doc)


def test_a_table_that_is_not_an_object_is_refused():
    with pytest.raises(InvalidArgumentType, match=r"table must be an object, got list"):
        parse_table([], where="x.json")


# --- the derivation ----------------------------------------------------------------------------


def _tool():
    spec = importlib.util.spec_from_file_location(
        "servegen_table", ROOT / "tools" / "servegen_table.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _fake_servegen(root: Path) -> None:
    """Two ServeGen-shaped clients: 0 busy (2 req/s all day), 1 at 1 req/s in hour 0 only."""
    d = root / "data" / "multimodal" / "mm-image"
    d.mkdir(parents=True)
    zero = {
        "audio_tokens": "{0: 1.0}",
        "video_tokens": "{0: 1.0}",
        "audio_count": "{0: 1.0}",
        "video_count": "{0: 1.0}",
    }
    for cid, rate_of in ((0, lambda ts: 2.0), (1, lambda ts: 1.0 if ts < 3600 else 0.0)):
        rows = []
        for ts in range(0, 86400, 600):
            rate = rate_of(ts)
            pat = "Gamma,1.0,0.5" if rate else ",0,0"
            rows.append(f"{ts},{rate},{1.5 if cid == 0 else 0.5},{pat}")
        (d / f"chunk-{cid}-trace.csv").write_text("\n".join(rows) + "\n")
        windows = {}
        for ts in (0, 21600, 43200, 64800):
            if cid == 0:
                fields = {
                    "image_count": "{1: 0.5, 3: 0.5}",
                    "image_tokens": "{100: 1.0}",
                    "text_tokens": "{10: 0.25, 20: 0.75}",
                    "output_tokens": "{5: 1.0}",
                }
            elif ts == 0:
                fields = {
                    "image_count": "{1: 1.0}",
                    "image_tokens": "{400: 1.0}",
                    "text_tokens": "{30: 1.0}",
                    "output_tokens": "{7: 1.0}",
                }
            else:  # idle windows carry a placeholder, which must weigh nothing
                fields = {
                    "image_count": "{0: 1.0}",
                    "image_tokens": "{0: 1.0}",
                    "text_tokens": "{0: 1.0}",
                    "output_tokens": "{0: 1.0}",
                }
            windows[str(ts)] = {**fields, **zero}
        (d / f"chunk-{cid}-dataset.json").write_text(json.dumps(windows))


def test_the_derivation_on_servegen_shaped_data(tmp_path, monkeypatch):
    tool = _tool()
    _fake_servegen(tmp_path / "sg")
    out = tmp_path / "table.json"
    argv = [
        "servegen_table.py",
        str(tmp_path / "sg"),
        "--commit",
        "a" * 40,
        "--top",
        "1",
        "--out",
        str(out),
    ]
    monkeypatch.setattr("sys.argv", argv)
    tool.main()
    first = out.read_bytes()
    tool.main()
    assert out.read_bytes() == first  # deterministic
    t = parse_table(json.loads(first))
    assert t.names == ("client-0", "all")
    busy, agg = t.client("client-0"), t.client("all")
    assert busy.requests_per_day == 2.0 * 86400 and busy.share == pytest.approx(172800 / 176400)
    assert busy.images_per_request.values == (1, 3) and busy.images_per_request.probs == (0.5, 0.5)
    assert busy.text_tokens.quantile(0.2) == 10 and busy.text_tokens.quantile(0.5) == 20
    assert busy.hourly_rate == (2.0,) * 24 and busy.hourly_cv == (1.5,) * 24
    # all: client 1's 3600 requests weigh 3600 / 176400; its idle placeholders weigh nothing
    w1 = 3600 / 176400
    assert agg.images_per_request.values == (1, 3)
    assert agg.images_per_request.probs == pytest.approx(
        (0.5 * (1 - w1) + w1, 0.5 * (1 - w1)), abs=1e-8
    )
    # image tokens are per image: client 0 has 2 images a request, client 1 one
    per_image_w1 = w1 / (w1 + 2 * (1 - w1))
    assert agg.image_tokens_per_image.mean == pytest.approx(
        400 * per_image_w1 + 100 * (1 - per_image_w1), abs=0.01
    )
    assert agg.hourly_rate[0] == 3.0 and agg.hourly_rate[1] == 2.0 and agg.hourly_cv == (1.0,) * 24
    assert "a" * 40 in t.source["notice"]


def test_the_derivation_refuses_non_image_modalities(tmp_path, monkeypatch):
    tool = _tool()
    _fake_servegen(tmp_path / "sg")
    path = tmp_path / "sg" / "data" / "multimodal" / "mm-image" / "chunk-0-dataset.json"
    doc = json.loads(path.read_text())
    doc["0"]["video_count"] = "{0: 0.5, 1: 0.5}"
    path.write_text(json.dumps(doc))
    argv = [
        "servegen_table.py",
        str(tmp_path / "sg"),
        "--commit",
        "b" * 40,
        "--out",
        str(tmp_path / "t.json"),
    ]
    monkeypatch.setattr("sys.argv", argv)
    with pytest.raises(SystemExit, match="video_count is not always 0"):
        tool.main()


def test_client_distribution_is_frozen_and_slotted(table):
    dist = table.client("all")
    assert isinstance(dist, ClientDistribution) and not hasattr(dist, "__dict__")
    with pytest.raises(AttributeError):
        dist.name = "x"  # type: ignore[misc]
