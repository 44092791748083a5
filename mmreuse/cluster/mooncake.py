"""The Mooncake Store under the harness: its master (with its HTTP metadata server) in its own
process group, on loopback only, and what a client needs to join it.

    with MooncakeStore(run_dir) as store:          # starts, waits for the master's /health
        env = store.client_env()                    # for every process that loads the client
        cfg = store.client_config(segment_bytes)    # vLLM's MooncakeStoreConfig, as JSON

Every endpoint binds and advertises 127.0.0.1: the master's RPC, metrics and metadata server
by their flags, and every process that loads Mooncake (the master, and each client) runs with
`LD_PRELOAD` of the loopback shim (`loopback_bind.c`: Mooncake's transfer engine binds its
listeners to the wildcard address whatever it advertises) and `MC_TCP_BIND_ADDRESS=127.0.0.1`
(the address it advertises). `listeners` and `connections` read what a process really has
open, for the test that checks it. Capacity is what the clients mount (`global_segment_size`
each); the master evicts at its high watermark.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from ..errors import InvalidArgument
from ..validate import check_float, check_int
from .install import loopback_shim, require_venv
from .instance import HOST, StartupError, free_ports, stop_group

MOONCAKE_PROTOCOL = "tcp"


@dataclass(frozen=True, slots=True)
class StoreSpec:
    """The master's ports and eviction settings."""

    rpc_port: int
    metrics_port: int
    metadata_port: int
    high_watermark: float = 0.9  # used / capacity at which the master evicts
    eviction_ratio: float = 0.2  # of the objects, each time it evicts

    def __post_init__(self) -> None:
        for name in ("rpc_port", "metrics_port", "metadata_port"):
            check_int(name, getattr(self, name), 1, 65535)
        check_float("high_watermark", self.high_watermark, 0, 1, lo_open=True)
        check_float("eviction_ratio", self.eviction_ratio, 0, 1, lo_open=True)

    @property
    def master_address(self) -> str:
        return f"{HOST}:{self.rpc_port}"

    @property
    def metadata_server(self) -> str:
        return f"http://{HOST}:{self.metadata_port}/metadata"

    @property
    def health_url(self) -> str:
        return f"http://{HOST}:{self.metrics_port}/health"


def master_argv(spec: StoreSpec, venv: Path) -> list[str]:
    """The master's command line (the wheel's `mooncake_master`)."""
    return [
        str(venv / "bin" / "mooncake_master"),
        f"--rpc_address={HOST}", f"--rpc_port={spec.rpc_port}",
        f"--metrics_host={HOST}", f"--metrics_port={spec.metrics_port}",
        "--enable_http_metadata_server=true",
        f"--http_metadata_server_host={HOST}", f"--http_metadata_server_port={spec.metadata_port}",
        f"--eviction_high_watermark_ratio={spec.high_watermark}",
        f"--eviction_ratio={spec.eviction_ratio}",
    ]  # fmt: skip


def loopback_env(venv: Path | None = None) -> dict[str, str]:
    """The environment that keeps a Mooncake process on loopback (binds and advertises)."""
    shim = loopback_shim(venv)
    if not shim.exists():
        raise InvalidArgument(f"no loopback shim at {shim}: run `mmreuse cluster install`")
    return {"LD_PRELOAD": str(shim), "MC_TCP_BIND_ADDRESS": HOST}


class MooncakeStore:
    """One Mooncake master for a cluster (see the module docstring)."""

    def __init__(
        self,
        run_dir: Path,
        *,
        venv: Path | None = None,
        spec: StoreSpec | None = None,
        startup_timeout: float = 30.0,
    ) -> None:
        self.run_dir = Path(run_dir).absolute()
        self.venv = venv
        self.spec = spec if spec is not None else StoreSpec(*free_ports(3))
        self.startup_timeout = check_float("startup_timeout", startup_timeout, 0, lo_open=True)
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def log_path(self) -> Path:
        return self.run_dir / "logs" / "mooncake_master.log"

    def start(self) -> MooncakeStore:
        python = require_venv(self.venv)
        venv = python.parent.parent
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **loopback_env(venv)}
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                master_argv(self.spec, venv),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=env,
                cwd=self.run_dir,
            )
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_healthy(self) -> None:
        end = time.monotonic() + self.startup_timeout
        assert self.process is not None
        while True:
            if self.process.poll() is not None:
                raise StartupError(f"mooncake_master exited: {self._tail()}")
            try:
                with urllib.request.urlopen(self.spec.health_url, timeout=2) as r:
                    body = json.loads(r.read())
                if body.get("status") == "ok" and body.get("service_ready"):
                    return
            except (urllib.error.URLError, OSError, ValueError):
                pass
            if time.monotonic() > end:
                raise StartupError(f"mooncake_master not ready after {self.startup_timeout} s")
            time.sleep(0.1)

    def _tail(self) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-20:])
        except OSError:
            return ""

    def stop(self) -> None:
        if self.process is not None:
            stop_group(self.process.pid, timeout=10.0, leader=self.process)
            self.process = None

    def client_config(self, segment_bytes: int, buffer_bytes: int = 64 << 20) -> dict[str, object]:
        """vLLM's MooncakeStoreConfig for a client that mounts `segment_bytes` (its share of
        the store's capacity) and stages through `buffer_bytes`."""
        check_int("segment_bytes", segment_bytes, 1 << 20)
        check_int("buffer_bytes", buffer_bytes, 1 << 20)
        return {
            "metadata_server": self.spec.metadata_server,
            "master_server_address": self.spec.master_address,
            "protocol": MOONCAKE_PROTOCOL,
            "device_name": "",
            "global_segment_size": segment_bytes,
            "local_buffer_size": buffer_bytes,
        }

    def client_env(self) -> dict[str, str]:
        return loopback_env(require_venv(self.venv).parent.parent)

    def record(self) -> dict[str, object]:
        return {
            "pid": None if self.process is None else self.process.pid,
            "master": self.spec.master_address,
            "metadata_server": self.spec.metadata_server,
            "health": self.spec.health_url,
            "log": str(self.log_path),
        }

    def __enter__(self) -> MooncakeStore:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


# ---- what a process really has open (/proc) ---------------------------------------------------


def _socket_inodes(pid: int) -> set[int]:
    out: set[int] = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return out
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            out.add(int(target[8:-1]))
    return out


def _address(hex_addr: str) -> tuple[str, int]:
    """/proc/net/tcp{,6}'s "ADDR:PORT" (hex, host byte order words) as (ip, port)."""
    addr, port = hex_addr.split(":")
    raw = bytes.fromhex(addr)
    words = [raw[i : i + 4][::-1] for i in range(0, len(raw), 4)]  # each 32-bit word is LE
    flat = b"".join(words)
    if len(flat) == 4:
        return ".".join(str(b) for b in flat), int(port, 16)
    if flat[:12] == b"\0" * 10 + b"\xff\xff":
        return "::ffff:" + ".".join(str(b) for b in flat[12:]), int(port, 16)
    groups = [flat[i : i + 2].hex() for i in range(0, 16, 2)]
    return ":".join(groups), int(port, 16)


def _sockets(pids: Iterable[int], state: str) -> list[tuple[int, str, int, str, int]]:
    """(pid, local ip, local port, remote ip, remote port) of the pids' TCP sockets in `state`
    (0A listening, 01 established), read from /proc/<pid>/net/tcp{,6}."""
    out = []
    for pid in pids:
        inodes = _socket_inodes(pid)
        for table in ("tcp", "tcp6"):
            try:
                lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
            except OSError:
                continue
            for line in lines:
                f = line.split()
                if f[3] != state or int(f[9]) not in inodes:
                    continue
                (lip, lport), (rip, rport) = _address(f[1]), _address(f[2])
                out.append((pid, lip, lport, rip, rport))
    return out


def listeners(pids: Iterable[int]) -> list[tuple[int, str, int]]:
    """(pid, ip, port) of every TCP socket these processes listen on."""
    return [(p, ip, port) for p, ip, port, _, _ in _sockets(pids, "0A")]


def connections(pids: Iterable[int]) -> list[tuple[int, str, int]]:
    """(pid, remote ip, remote port) of every established TCP connection of these processes."""
    return [(p, rip, rport) for p, _, _, rip, rport in _sockets(pids, "01")]


def is_loopback(ip: str) -> bool:
    return ip.startswith("127.") or ip in ("::1", "0:0:0:0:0:0:0:1") or ip.startswith("::ffff:127.")
