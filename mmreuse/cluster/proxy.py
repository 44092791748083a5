"""`mmreuse proxy` as a process in front of a cluster: for the live tests and benchmarks."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

from .instance import HOST, free_ports, stop_group, wait_http


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
    environment; yields its URL once /health answers. Raises StartupError (`wait_http`) with
    the log's tail if it exits or stays down."""
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
            wait_http(
                url + "/health", proc, time.monotonic() + timeout, name="mmreuse proxy",
                log=log_path,
            )  # fmt: skip
            yield url
        finally:
            stop_group(proc.pid, timeout=10.0, leader=proc)
