"""`mmreuse proxy` as a process in front of a cluster: for the live tests and benchmarks."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

from .instance import HOST, free_ports


@contextlib.contextmanager
def proxy_process(
    args: Sequence[str],
    log_path: Path,
    *,
    env: Mapping[str, str] | None = None,
    timeout: float = 30.0,
    port: int | None = None,
) -> Iterator[str]:
    """`mmreuse proxy ARGS` on `port` (default: a free one) on loopback, in its own process
    group (stopped by it), logging to `log_path`, with `env` added to this process's
    environment; yields its URL once /health answers. Raises RuntimeError with the log's tail
    if it exits or stays down."""
    if port is None:
        (port,) = free_ports(1)
    cmd = [sys.executable, "-m", "mmreuse.cli", "proxy", "--host", HOST, "--port", str(port), *args]
    log_path = Path(log_path)
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            cmd,
            start_new_session=True,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
        )
        url = f"http://{HOST}:{port}"
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
                    raise RuntimeError(f"mmreuse proxy did not become healthy: {log_path}")
                time.sleep(0.2)
            yield url
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)
