"""The pure helpers of benchmarks/live_render_cost.py (no server): image headers, the
photograph picker, the interleaved schedule, the paired differences, the /metrics counters,
P's frontend time from its histograms and a process's CPU time from /proc."""

from __future__ import annotations

import base64
import importlib.util
import os
import struct
import sys
from pathlib import Path

import pytest

from mmreuse.cluster.client import png_data_url

ROOT = Path(__file__).resolve().parents[2]


def _load():
    spec = importlib.util.spec_from_file_location(
        "live_render_cost", ROOT / "benchmarks" / "live_render_cost.py"
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses resolve their module
    spec.loader.exec_module(mod)
    return mod


m = _load()


def _png(w: int, h: int) -> bytes:
    return base64.b64decode(png_data_url(w, h, (1, 2, 3)).split(",", 1)[1])


def _jpeg(w: int, h: int, sof: int = 0xC0) -> bytes:
    app0 = b"\xff\xe0" + struct.pack(">H", 16) + b"JFIF\x00\x01\x01\x00\x00\x01\x00\x01\x00\x00"
    frame = b"\xff" + bytes([sof]) + struct.pack(">HBHHB", 11, 8, h, w, 1) + b"\x01\x11\x00"
    return b"\xff\xd8" + app0 + b"\xff\xff" + frame + b"\xff\xda\x00\x02" + b"\xff\xd9"


def test_image_dims_png_and_jpeg():
    assert m.image_dims(_png(37, 11)) == (37, 11)
    assert m.image_dims(_jpeg(640, 427)) == (640, 427)
    assert m.image_dims(_jpeg(1411, 1411, sof=0xC2)) == (1411, 1411)  # progressive
    with pytest.raises(ValueError, match="neither"):
        m.image_dims(b"GIF89a....")
    with pytest.raises(ValueError, match="no frame header"):
        m.image_dims(b"\xff\xd8\xff\xda\x00\x02")


def test_photographs_filters_by_name_size_and_folder_order(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    big = _jpeg(8, 6) + b"\x00" * 30_000  # trailing bytes after EOI: the header still parses
    (a / "rocket.jpg").write_bytes(big)
    (b / "rocket.jpg").write_bytes(_jpeg(1, 1) + b"\x00" * 30_000)  # shadowed by a's
    (a / "coffee.png").write_bytes(_png(4, 4))  # too small
    (b / "chelsea.png").write_bytes(_png(5, 3) + b"\x00" * 25_000)
    (a / "notlisted.png").write_bytes(_png(5, 3) + b"\x00" * 25_000)
    got = m.photographs([a, b])
    assert [(p.name, p.width, p.height) for p in got] == [("chelsea.png", 5, 3), ("rocket.jpg", 8, 6)]  # fmt: skip
    assert got[0].data_url.startswith("data:image/png;base64,")
    assert got[1].data_url.startswith("data:image/jpeg;base64,")
    assert base64.b64decode(got[1].data_url.split(",", 1)[1]) == big
    assert got[1].licence == m.PHOTOGRAPHS["rocket.jpg"]


def test_schedule_rotates_pairs_and_names():
    ts = m.schedule("run", 8, 5, multi_every=4)
    rounds: dict[int, list] = {}
    for t in ts:
        rounds.setdefault(t.round, []).append(t)
    assert len(rounds) == 8
    firsts = [rs[0].variant for rs in rounds.values()]
    assert firsts[:3] == ["a", "b", "c"]  # the order rotates
    sizes = [len(rs[0].images) for rs in rounds.values()]
    assert sizes == [1, 1, 1, 2, 1, 1, 1, 3]
    for rs in rounds.values():
        by = {t.variant: t for t in rs}
        assert [t.variant for t in rs][3:] == ["d", "e"]
        assert len({t.images for t in rs}) == 1  # one image set per round: paired
        assert by["a"].render_uuids is None
        assert by["b"].render_uuids == by["b"].real_uuids
        assert by["c"].render_uuids is not None
        assert set(by["c"].render_uuids).isdisjoint(by["c"].real_uuids)
        assert by["d"].real_uuids == by["a"].real_uuids
        assert by["e"].render_uuids == by["b"].render_uuids and by["e"].real_uuids is None
    fresh = [u for t in ts if t.variant in "abc" for u in (t.real_uuids or ())]
    fresh += [u for t in ts if t.variant in "bc" for u in (t.render_uuids or ())]
    b_uuids = {u for t in ts if t.variant == "b" for u in t.real_uuids}
    assert len(set(fresh)) == len(fresh) - len(b_uuids)  # only b's render and real share
    assert {i for t in ts for i in t.images} == set(range(5))


def test_schedule_checks():
    with pytest.raises(ValueError):
        m.schedule("r", 0, 3)
    with pytest.raises(ValueError, match="needs a"):
        m.schedule("r", 2, 3, variants=("b", "d"))
    with pytest.raises(ValueError, match="variants"):
        m.schedule("r", 2, 3, variants=("x",))
    assert {t.variant for t in m.schedule("r", 3, 1, variants=("a", "b"))} == {"a", "b"}
    assert all(len(t.images) == 1 for t in m.schedule("r", 8, 1))  # capped by the images


def test_paired_and_quantiles():
    rows = [
        {"round": 0, "variant": "a", "ttft_ms": 100.0},
        {"round": 0, "variant": "b", "ttft_ms": 110.0, "render_ms": 20.0},
        {"round": 1, "variant": "a", "ttft_ms": 90.0},
        {"round": 1, "variant": "b", "ttft_ms": 85.0, "render_ms": 30.0},
        {"round": 2, "variant": "b", "ttft_ms": 1.0, "render_ms": 1.0},  # no a: unpaired
        {"round": 3, "variant": "a", "ttft_ms": None},
        {"round": 3, "variant": "b", "ttft_ms": 5.0},
    ]
    assert m.paired(rows, "b", "a", "ttft_ms") == [10.0, -5.0]
    assert m.paired(rows, "b", "a", "ttft_ms", extra_x="render_ms") == [30.0, 25.0]
    assert m.quantiles([3.0]) == (3.0, 3.0, 3.0)
    assert m.quantiles([1.0, 2.0, 3.0, 4.0, 5.0]) == (2.0, 3.0, 4.0)
    with pytest.raises(ValueError):
        m.quantiles([])


METRICS = """# HELP vllm:mm_cache_queries Multi-modal cache queries.
# TYPE vllm:mm_cache_queries counter
vllm:mm_cache_queries_total{engine="0",model_name="tiny"} 7.0
vllm:mm_cache_queries_created{engine="0",model_name="tiny"} 1.7e+09
vllm:mm_cache_hits_total{engine="0",model_name="tiny"} 3.0
vllm:prefix_cache_hits_total{engine="0",model_name="tiny"} 64.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.5",model_name="tiny"} 2.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="tiny"} 0.5
vllm:time_to_first_token_seconds_count{engine="0",model_name="tiny"} 2.0
vllm:request_queue_time_seconds_sum{engine="0",model_name="tiny"} 0.01
vllm:request_queue_time_seconds_count{engine="0",model_name="tiny"} 2.0
vllm:request_prefill_time_seconds_sum{engine="0",model_name="tiny"} 0.3
vllm:request_prefill_time_seconds_count{engine="0",model_name="tiny"} 2.0
vllm:request_prefill_time_seconds_count{engine="1",model_name="tiny"} 1.0
"""


def test_counters_and_frontend_ms():
    c = m.counters(METRICS)
    assert c["mm_queries"] == 7.0 and c["mm_hits"] == 3.0 and c["prefix_hits"] == 64.0
    assert c["ttft_sum"] == 0.5 and c["ttft_count"] == 2.0
    assert c["prefill_count"] == 3.0  # summed over label sets
    before = dict.fromkeys(c, 0.0)
    after = {**before, "ttft_sum": 0.2, "queue_sum": 0.01, "prefill_sum": 0.15}
    after.update(ttft_count=1.0, queue_count=1.0, prefill_count=1.0)
    assert m.frontend_ms(before, after) == pytest.approx(40.0)
    assert m.frontend_ms(before, {**after, "prefill_count": 2.0}) is None  # two requests
    assert m.frontend_ms(before, {**after, "queue_count": 0.0}) is None  # not yet recorded


def test_process_cpu_ns_sums_threads(tmp_path):
    for tid, ns in (("10", 1_000), ("11", 2_500), ("12", None)):
        d = tmp_path / "10" / "task" / tid
        d.mkdir(parents=True)
        if ns is not None:
            (d / "schedstat").write_text(f"{ns} 77 5\n")  # a thread gone: no file, skipped
    assert m.process_cpu_ns(10, tmp_path) == 3_500
    with pytest.raises(RuntimeError, match="no task list"):
        m.process_cpu_ns(99, tmp_path)
    if Path(f"/proc/{os.getpid()}/task").is_dir():
        assert m.process_cpu_ns(os.getpid()) > 0


def test_chat_body_and_report():
    photos = [m.Photo("x.png", "data:image/png;base64,AA==", 1, 1, 1, "CC0")] * 3
    body = m.chat_body(photos, (0, 2), ("u0", "u1"))
    parts = body["messages"][0]["content"]
    assert [p.get("uuid") for p in parts] == ["u0", "u1", None]
    assert parts[-1]["type"] == "text" and body["max_tokens"] >= 1
    rows = []
    for r in range(3):
        common = {"round": r, "images": 1, "mm_queries": 1.0}
        rows.append({**common, "variant": "a", "ttft_ms": 100.0 + r, "frontend_ms": 20.0, "frontend_cpu_ms": 20.0, "prefill_ms": 70.0, "mm_hits": 0.0})  # fmt: skip
        rows.append({**common, "variant": "b", "render_ms": 15.0, "render_cpu_ms": 12.0, "render_mm_queries": 0.0, "ttft_ms": 101.0 + r, "frontend_ms": 20.0, "frontend_cpu_ms": 20.0, "prefill_ms": 70.0, "mm_hits": 0.0})  # fmt: skip
        rows.append({**common, "variant": "d", "ttft_ms": 60.0, "frontend_ms": 16.0, "frontend_cpu_ms": 16.0, "prefill_ms": 30.0, "mm_hits": 1.0})  # fmt: skip
    lines, summary = m.report(rows)
    assert summary["variants"]["d"]["mm_hits"] == 3.0
    assert summary["variants"]["b"]["render_mm_queries"] == 0.0
    assert summary["paired"]["b - a: TTFT (a render before it)"]["p50"] == 1.0
    hit = summary["paired"]["d - a: P frontend CPU (a processor-cache hit)"]
    assert hit["p50"] == -4.0 and hit["of_second_median"] == pytest.approx(-0.2)
    assert "b - c: TTFT (render's uuids reused or not)" not in summary["paired"]  # no c rows
    assert any(line.startswith("| render + b - a") and "| 3 | 16.0" in line for line in lines)
