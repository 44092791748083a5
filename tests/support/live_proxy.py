"""The proxy's live tier, shared by its modules: `mmreuse proxy` flags for some of the cluster's
PDs, and one policy's run over a multi-turn workload with what the probe and /metrics counted."""

from __future__ import annotations

import json
import shutil
import time
import urllib.request

from mmreuse.cluster.client import post_json
from mmreuse.cluster.proxy import proxy_process
from mmreuse.cluster.workload import conversations
from mmreuse.proxy.metrics import sample_sum


def proxy_args(cluster, prefills):
    """`mmreuse proxy` flags for E0 and the PDs named (P0, P1, ...)."""
    args = cluster.proxy_args()
    out, i = [], 0
    names = [n for n in cluster.instances if n.startswith("P")]
    keep = [names.index(p) for p in prefills]
    while i < len(args):
        flag, value = args[i], args[i + 1]
        if flag in (
            "--decode-servers-urls",
            "--kv-events-endpoints",
            "--kv-events-replay-endpoints",
            "--encoder-cache-events-endpoints",
            "--encoder-cache-events-replay-endpoints",
            "--demand-endpoints",
        ):
            parts = value.split(",")
            value = ",".join(parts[k] for k in keep)
            if not any(parts[k].strip() for k in keep):  # none kept has one: the flag left out
                i += 2
                continue
        out += [flag, value]
        i += 2
    return out


def health(url: str) -> dict:
    with urllib.request.urlopen(url + "/health", timeout=30) as r:
        return json.loads(r.read())


def until_complete(url: str, timeout: float = 60.0) -> dict:
    """The proxy's /health once every view of P and of E it follows is complete."""
    end = time.monotonic() + timeout
    while True:
        got = health(url)
        m = got["mmreuse"]
        views = [*m["views"].values(), *m.get("e_views", {}).values()]
        if all(v["complete"] for v in views):
            return got
        assert time.monotonic() < end, m
        time.sleep(0.05)


def metrics_text(url: str) -> str:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        return r.read().decode()


def drive(url, requests, between_turns=None):
    """Send each request in order; returns [(session, turn, status, token ids, cached tokens)]."""
    out, last_turn = [], 0
    for s, t, body in requests:
        if t != last_turn and between_turns is not None:
            between_turns()
        last_turn = t
        reply = post_json(url + "/v1/chat/completions", body, timeout=300)
        details = (reply.get("usage") or {}).get("prompt_tokens_details") or {}
        out.append((s, t, reply["choices"][0]["token_ids"], details.get("cached_tokens")))
    return out


def run_policy(
    cluster, tmp_path, policy, prefills, *, sessions, turns, empty_store, routing="random"
):
    probe = cluster.probe()
    e_before = probe.count("E0").log_inputs
    p_before = {p: probe.count(p).log_inputs for p in prefills}
    run = f"{policy}{routing}{int(empty_store)}-{time.time_ns()}"
    args = [*proxy_args(cluster, prefills), "--policy", policy, "--routing", routing]

    def empty():
        time.sleep(0.5)  # let E and P finish writing / reading
        for child in cluster.ec_dir.iterdir():
            shutil.rmtree(child, ignore_errors=True)

    # Two images per E sub-request at most: E's 64-token encoder budget (SMALL_E) fits them.
    env = {"ENCODER_MAX_BATCH_SIZE": "2"}
    with proxy_process(args, tmp_path / f"proxy-{run}.log", env=env) as url:
        time.sleep(1.0)  # the subscribers connect (slow joiner)
        results = drive(url, conversations(run, sessions, turns), empty if empty_store else None)
        text = metrics_text(url)
    time.sleep(1.0)
    return {
        "results": results,
        "e_forwards": probe.count("E0").log_inputs - e_before,
        "p_forwards": {p: probe.count(p).log_inputs - p_before[p] for p in prefills},
        "e_items": sample_sum(text, "mmreuse_proxy_encoder_items_total", action="sent"),
        "e_skipped": sample_sum(text, "mmreuse_proxy_encoder_items_total", action="skipped"),
        "errors": sample_sum(text, "mmreuse_proxy_requests_total", outcome="server_error")
        + sample_sum(text, "mmreuse_proxy_requests_total", outcome="client_error"),
        "ok": sample_sum(text, "mmreuse_proxy_requests_total", outcome="ok"),
        "mismatches": sample_sum(text, "mmreuse_proxy_hash_config_mismatches"),
        "kv_covered": sample_sum(text, "mmreuse_proxy_occurrences_total", klass="kv_covered"),
        "arrival": {
            split: sample_sum(text, "mmreuse_proxy_arrival_requests_total", split=split)
            for split in ("all_new", "split", "none_new", "whole")
        },
        "renders": sample_sum(text, "mmreuse_proxy_stage_seconds_count", stage="render"),
    }


def tokens(run):
    return [(s, t, ids) for s, t, ids, _ in run["results"]]
