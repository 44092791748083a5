"""docs/findings.md is what tools/findings.py makes of docs/findings.in.md and the JSON under
docs/results/: every figure in it comes from the JSON it cites. The placeholders' grammar and
its errors, on a results folder of the test's own."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _tool():
    spec = importlib.util.spec_from_file_location("findings_tool", ROOT / "tools" / "findings.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_findings_are_what_their_json_gives(capsys):
    assert _tool().main(["--check"]) == 0, capsys.readouterr().err


@pytest.fixture
def tool(tmp_path, monkeypatch):
    t = _tool()
    doc = {
        "config": {"seed": 7, "cluster": {"block_size": 16}},
        "policies": [
            {"policy": "eager", "forwards": 30, "ttft": 12.345, "sim": {"forwards": 28}},
            {"policy": "index", "forwards": 12, "ttft": 4.0, "sim": {"forwards": 12}},
        ],
    }
    (tmp_path / "run.json").write_text(json.dumps(doc))
    monkeypatch.setattr(t, "RESULTS", tmp_path)
    t._load.cache_clear()
    return t


@pytest.mark.parametrize(
    ("template", "want"),
    [
        ("{{run:eager.forwards}}", "30"),
        ("{{run:eager.ttft}}", "12.3"),
        ("{{run:eager.ttft:.2f}} ms", "12.35 ms"),
        ("{{run:index.sim.forwards}}", "12"),
        ("seed {{run:@config.seed}}, block {{run:@config.cluster.block_size}}", "seed 7, block 16"),
        ("{{pct run:index.forwards / run:eager.forwards}}", "40 %"),
        ("{{fewer run:index.forwards / run:eager.forwards}}", "60 %"),
        ("{{pct run:index.forwards + run:index.sim.forwards / run:eager.forwards}}", "80 %"),
        ("{{sum run:index.forwards + run:eager.forwards}}", "42"),
    ],
)
def test_placeholders(tool, template, want):
    assert tool.render(template) == tool.HEADER + want


@pytest.mark.parametrize(
    ("template", "says"),
    [
        ("{{nofile:eager.forwards}}", "no results file"),
        ("{{run:random.forwards}}", "0 rows of policy 'random'"),
        ("{{run:eager.nokey}}", "has no 'nokey'"),
        ("{{run}}", "is not FILE:ROW.KEY"),
        ("{{pct run:eager.forwards}}", "is not A / B"),
        ("{{table nope}}", "no table 'nope'"),
    ],
)
def test_a_placeholder_that_does_not_resolve_says_what_is_missing(tool, template, says):
    with pytest.raises(tool.FindingsError, match=says):
        tool.render(template)


def test_check_fails_on_a_hand_edited_figure(tool, tmp_path, monkeypatch, capsys):
    template, output = tmp_path / "in.md", tmp_path / "out.md"
    template.write_text("forwards: {{run:eager.forwards}}\n")
    monkeypatch.setattr(tool, "TEMPLATE", template)
    monkeypatch.setattr(tool, "OUTPUT", output)
    monkeypatch.setattr(tool, "ROOT", tmp_path)
    assert tool.main([]) == 0 and output.read_text().endswith("forwards: 30\n")
    assert tool.main(["--check"]) == 0
    output.write_text(output.read_text().replace("30", "31"))
    assert tool.main(["--check"]) == 1
    assert "not what its JSON gives" in capsys.readouterr().err
