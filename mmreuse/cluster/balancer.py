"""HAProxy (Debian's, installed by `mmreuse cluster install`) round-robin in front of proxy
replicas, as an operator runs several `mmreuse proxy` behind one balancer: for the live tests
and benchmarks. Health-checked on each replica's `/health`, so a replica that is down or
restarting is out of the rotation; a refused connection is retried on another one."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from ..errors import InvalidArgument
from .instance import HOST, free_ports, stop_group, wait_http

CONFIG = """\
global
    maxconn 256
defaults
    mode http
    timeout connect 2s
    timeout client 600s
    timeout server 600s
    timeout check 10s
    retries 3
    option redispatch 1
frontend replicas
    bind {host}:{port}
    default_backend replicas
backend replicas
    balance roundrobin
    option httpchk GET /health
    default-server inter 200ms fall 2 rise 1
{servers}
"""


def haproxy_binary() -> str:
    """HAProxy's path, or an error saying how to install it."""
    found = shutil.which("haproxy") or next(
        (p for p in ("/usr/sbin/haproxy", "/usr/bin/haproxy") if Path(p).exists()), None
    )
    if found is None:
        raise InvalidArgument("HAProxy is not installed: run `mmreuse cluster install`")
    return found


def haproxy_config(backends: Sequence[str], port: int) -> str:
    """The config balancing round-robin over `backends` (http://HOST:PORT each)."""
    if not backends:
        raise InvalidArgument("backends must name at least one replica")
    lines = []
    for i, url in enumerate(backends):
        hostport = url.removeprefix("http://").rstrip("/")
        if "/" in hostport or ":" not in hostport:
            raise InvalidArgument(f"backends[{i}] must be http://HOST:PORT, got {url!r}")
        lines.append(f"    server r{i} {hostport} check")
    return CONFIG.format(host=HOST, port=port, servers="\n".join(lines))


@contextlib.contextmanager
def haproxy(backends: Sequence[str], run_dir: Path, *, timeout: float = 10.0) -> Iterator[str]:
    """HAProxy in its own process group on a free loopback port, over `backends`; yields its
    URL once it listens (the backends may still be down: they join the rotation when their
    /health answers). Stopped by its process group."""
    (port,) = free_ports(1)
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg = run_dir / "haproxy.cfg"
    cfg.write_text(haproxy_config(backends, port))
    log = (run_dir / "haproxy.log").open("wb")
    proc = subprocess.Popen(
        [haproxy_binary(), "-db", "-f", str(cfg)],
        start_new_session=True,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://{HOST}:{port}"
    try:
        wait_http(
            url + "/", proc, time.monotonic() + timeout, name="haproxy",
            log=run_dir / "haproxy.log", any_status=True, poll_s=0.05,
        )  # fmt: skip
        yield url
    finally:
        stop_group(proc.pid, timeout=5.0, leader=proc)
        log.close()
