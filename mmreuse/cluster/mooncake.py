"""The Mooncake Store under the harness: its master (with its HTTP metadata server) and, when
the store is given a capacity, the client that holds it, each in its own process group, on
loopback only; and what a client needs to join it.

    with MooncakeStore(run_dir, capacity_bytes=1 << 20) as store:   # master, holder, ballast
        env = store.client_env()                # for every process that loads the client
        cfg = store.client_config(0)            # vLLM's MooncakeStoreConfig, as JSON

**Capacity.** With `capacity_bytes`, one `mooncake_client` process (the wheel's; vLLM's
"standalone-store" topology) mounts the store's only segment, and E and P join it without one,
so that a restarted E or P loses nothing. Mooncake's smallest segment is 16 MiB, far more
than this harness's tiny embeddings fill (4 KiB an image), so the rest of the segment is a
hard-pinned *ballast* (objects the master never evicts): the master, which evicts at its high
watermark of the segment, then evicts once the embeddings reach `capacity_bytes`
(`store_layout`). Without a capacity there is no holder: clients mount their own segments.

**Loopback.** Every endpoint binds and advertises 127.0.0.1: the master's RPC, metrics and
metadata server by their flags, the holder by its `--host`, and every process that loads
Mooncake (master, holder and each client) runs with `LD_PRELOAD` of the loopback shim
(`loopback_bind.c`: Mooncake's transfer engine binds its listeners to the wildcard address
whatever it advertises) and `MC_TCP_BIND_ADDRESS=127.0.0.1` (the address it advertises).
`listeners` and `connections` read what a process really has open, for the tests that check it.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from types import TracebackType

from ..errors import InvalidArgument
from ..lifetime import die_with_parent
from ..validate import check_float, check_int
from .install import loopback_shim, require_venv
from .instance import (
    HOST,
    StartupError,
    free_ports,
    process_cmdline,
    process_start_time,
    stop_group,
)
from .netshape import StoreLink, pace

MOONCAKE_PROTOCOL = "tcp"
MIN_SEGMENT_BYTES = 16 << 20  # Mooncake: "Total size must be at least 16777216"
MIN_CAPACITY_BYTES = 16 << 10
BALLAST_PREFIX = "mmreuse-ballast@"
_BALLAST_CHUNK = 1 << 20

# Run in the side venv by `_client_script`: joins without a segment, does one thing.
_JOIN = """
import json, sys
from mooncake.store import MooncakeDistributedStore, ReplicateConfig
cfg = json.loads(sys.argv[1])
s = MooncakeDistributedStore()
rc = s.setup("127.0.0.1", cfg["metadata_server"], 0, cfg["local_buffer_size"], "tcp", "",
             cfg["master_server_address"])
if rc != 0:
    sys.exit(f"setup returned {rc}")
"""
_PUT_BALLAST = (
    _JOIN
    + """
pin = ReplicateConfig()
pin.with_hard_pin = True
sizes, out = json.loads(sys.argv[2]), []
for i, n in enumerate(sizes):
    key = f"{sys.argv[3]}{i}"
    out.append(s.put(key, b"\\0" * n, pin) if s.is_exist(key) != 1 else 0)
print(json.dumps(out))
"""
)
_CLEAR = (
    _JOIN
    + """
print(json.dumps(s.remove_by_regex(".*@id:.*", True)))
"""
)


def store_layout(capacity: int, high_watermark: float) -> tuple[int, int]:
    """(segment bytes, ballast bytes) for a store that evicts once `capacity` bytes of objects
    are in it: the smallest whole-MiB segment of Mooncake's (16 MiB at least) whose high
    watermark is above `capacity`, and the part of that watermark the ballast fills."""
    check_int("capacity", capacity, MIN_CAPACITY_BYTES)
    check_float("high_watermark", high_watermark, 0, 1, lo_open=True)
    segment = max(MIN_SEGMENT_BYTES, math.ceil(capacity / high_watermark / (1 << 20)) << 20)
    return segment, max(int(segment * high_watermark) - capacity, 0)


@dataclass(frozen=True, slots=True)
class StoreSpec:
    """The master's ports and eviction settings, and the holder's port."""

    rpc_port: int
    metrics_port: int
    metadata_port: int
    holder_port: int
    high_watermark: float = 0.9  # used / capacity at which the master evicts
    eviction_ratio: float = 0.2  # of the objects, each time it evicts
    # How long a lookup protects an object from eviction. Long enough for P's scheduler to
    # look an item up and its worker to load it (one engine step); short, because the master
    # evicts only objects no lease protects: with Mooncake's default (10 s) a full store
    # keeps everything looked up in the last 10 s and evicts what was just put instead.
    lease_ttl_ms: int = 2000

    def __post_init__(self) -> None:
        for name in ("rpc_port", "metrics_port", "metadata_port", "holder_port"):
            check_int(name, getattr(self, name), 1, 65535)
        check_int("lease_ttl_ms", self.lease_ttl_ms, 100)
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

    @property
    def http_url(self) -> str:
        """The master's HTTP server (health, metrics, `/batch_query_keys`): what
        `mmreuse proxy --e-store-url` asks."""
        return f"http://{HOST}:{self.metrics_port}"


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
        f"--default_kv_lease_ttl={spec.lease_ttl_ms}",
    ]  # fmt: skip


def holder_argv(spec: StoreSpec, venv: Path, segment: int) -> list[str]:
    """The holder's command line (the wheel's `mooncake_client`, mounting `segment` bytes)."""
    return [
        str(venv / "bin" / "mooncake_client"),
        f"--host={HOST}", f"--port={spec.holder_port}",
        f"--global_segment_size={segment >> 20}MB", "--local_buffer_size=16MB",
        f"--master_server_address={spec.master_address}",
        f"--metadata_server={spec.metadata_server}",
        f"--protocol={MOONCAKE_PROTOCOL}",
    ]  # fmt: skip


def loopback_env(venv: Path | None = None) -> dict[str, str]:
    """The environment that keeps a Mooncake process on loopback (binds and advertises)."""
    shim = loopback_shim(venv)
    if not shim.exists():
        raise InvalidArgument(f"no loopback shim at {shim}: run `mmreuse cluster install`")
    return {"LD_PRELOAD": str(shim), "MC_TCP_BIND_ADDRESS": HOST}


@dataclass(slots=True)
class _Proc:
    """A started process of the store: its Popen and start time (field 22 of /proc stat)."""

    name: str
    process: subprocess.Popen[bytes]
    start_time: int | None

    def record(self, port: int) -> dict[str, object]:
        pid = self.process.pid
        return {"pid": pid, "pgid": pid, "start_time": self.start_time, "port": port}


class MooncakeStore:
    """One Mooncake master (and the holder of its capacity) for a cluster (see the module
    docstring)."""

    def __init__(
        self,
        run_dir: Path,
        *,
        venv: Path | None = None,
        spec: StoreSpec | None = None,
        capacity_bytes: int | None = None,
        startup_timeout: float = 30.0,
        link: StoreLink | None = None,
    ) -> None:
        self.run_dir = Path(run_dir).absolute()
        self.venv = venv
        self.spec = spec if spec is not None else StoreSpec(*free_ports(4))
        self.capacity_bytes = capacity_bytes
        self.layout = (
            None
            if capacity_bytes is None
            else store_layout(capacity_bytes, self.spec.high_watermark)
        )
        self.startup_timeout = check_float("startup_timeout", startup_timeout, 0, lo_open=True)
        if link is not None and not isinstance(link, StoreLink):
            raise InvalidArgument(f"link must be a netshape.StoreLink or None, got {link!r}")
        if link is not None and capacity_bytes is None:
            raise InvalidArgument(
                "link paces the traffic of the store's holder: give capacity_bytes"
            )
        self.link = link
        self.master: _Proc | None = None
        self.holder: _Proc | None = None
        self._die_with_parent = False

    @property
    def process(self) -> subprocess.Popen[bytes] | None:
        """The master's process."""
        return None if self.master is None else self.master.process

    def log_path(self, name: str = "mooncake_master") -> Path:
        return self.run_dir / "logs" / f"{name}.log"

    def _venv(self) -> Path:
        return require_venv(self.venv).parent.parent

    def _spawn(self, name: str, argv: list[str]) -> _Proc:
        self.log_path(name).parent.mkdir(parents=True, exist_ok=True)
        with self.log_path(name).open("ab") as log:
            proc = subprocess.Popen(
                argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env={**os.environ, **loopback_env(self._venv())},
                cwd=self.run_dir,
                preexec_fn=die_with_parent if self._die_with_parent else None,
            )
        return _Proc(name, proc, process_start_time(proc.pid))

    def start(self, *, die_with_parent: bool = False) -> MooncakeStore:
        """Start the master (and, with a capacity, the holder and its ballast), each in a
        session of its own, and wait until the store is ready. `die_with_parent`: they get
        SIGTERM when the calling thread exits."""
        self._die_with_parent = die_with_parent
        try:
            self.start_master()
            if self.layout is not None:
                segment, _ = self.layout
                self.holder = self._spawn(
                    "mooncake_holder", holder_argv(self.spec, self._venv(), segment)
                )
                self._wait_ballast()
                if self.link is not None:  # after the ballast: only embeddings are paced
                    pace((port for _, _, port in listeners([self.holder.process.pid])), self.link)
        except BaseException:
            self.stop()
            raise
        return self

    def start_master(self) -> None:
        """Start the master (again, after it died: the holder mounts its segment again by
        itself, and the ballast is put back)."""
        self.master = self._spawn("mooncake_master", master_argv(self.spec, self._venv()))
        self._wait_healthy()
        if self.holder is not None:
            self._wait_ballast()

    def _wait_healthy(self) -> None:
        end = time.monotonic() + self.startup_timeout
        assert self.master is not None
        while True:
            if self.master.process.poll() is not None:
                raise StartupError(f"mooncake_master exited: {self._tail('mooncake_master')}")
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

    def _wait_ballast(self) -> None:
        """Wait until the holder's segment is mounted, then put the ballast (idempotent)."""
        assert self.layout is not None and self.holder is not None
        end = time.monotonic() + self.startup_timeout
        while True:
            if self.holder.process.poll() is not None:
                raise StartupError(f"mooncake_client exited: {self._tail('mooncake_holder')}")
            try:
                with urllib.request.urlopen(
                    f"{self.spec.http_url}/get_all_segments", timeout=2
                ) as r:
                    if r.read().strip():
                        break
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > end:
                raise StartupError(
                    f"the holder's segment not mounted after {self.startup_timeout} s"
                )
            time.sleep(0.1)
        _, ballast = self.layout
        sizes = [_BALLAST_CHUNK] * (ballast // _BALLAST_CHUNK)
        if ballast % _BALLAST_CHUNK:
            sizes.append(ballast % _BALLAST_CHUNK)
        if sizes:
            got = self._client_script(_PUT_BALLAST, json.dumps(sizes), BALLAST_PREFIX)
            if got != [0] * len(sizes):
                raise StartupError(f"the store's ballast was not put: {got}")

    def _client_script(self, script: str, *args: str) -> object:
        """Run `script` as a short-lived client of the store in the side venv; its JSON."""
        cfg = self.client_config(0, 4 << 20)
        out = subprocess.run(
            [str(require_venv(self.venv)), "-c", script, json.dumps(cfg), *args],
            capture_output=True, text=True, timeout=120, env={**os.environ, **self.client_env()},
        )  # fmt: skip
        if out.returncode != 0:
            raise RuntimeError(f"a Mooncake client failed: {out.stderr[-1500:]}")
        return json.loads(out.stdout.strip().splitlines()[-1])

    def clear(self) -> int:
        """Remove every embedding (every `...@id:...` key; the ballast stays), leases or not;
        the count removed."""
        removed = self._client_script(_CLEAR)
        if not isinstance(removed, int) or removed < 0:
            raise RuntimeError(f"the store could not be cleared: {removed}")
        return removed

    def _tail(self, name: str) -> str:
        try:
            return "\n".join(self.log_path(name).read_text(errors="replace").splitlines()[-20:])
        except OSError:
            return ""

    def stop(self) -> None:
        for proc in (self.holder, self.master):
            if proc is not None:
                stop_group(proc.process.pid, timeout=10.0, leader=proc.process)
        self.holder = self.master = None

    def client_config(self, segment_bytes: int, buffer_bytes: int = 64 << 20) -> dict[str, object]:
        """vLLM's MooncakeStoreConfig for a client that mounts `segment_bytes` (0 joins
        without one, as every instance does when the store has a holder) and stages through
        `buffer_bytes`."""
        if segment_bytes != 0:
            check_int("segment_bytes", segment_bytes, MIN_SEGMENT_BYTES)
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
        return loopback_env(self._venv())

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def record(self) -> dict[str, object]:
        """What the cluster's state file keeps, so another process can find and stop it."""
        master = self.master.record(self.spec.rpc_port) if self.master else {}
        return {
            **{k: master.get(k) for k in ("pid", "pgid", "start_time")},
            "rpc_port": self.spec.rpc_port,
            "holder": None if self.holder is None else self.holder.record(self.spec.holder_port),
            "capacity_bytes": self.capacity_bytes,
            "link_mibps": None if self.link is None else asdict(self.link),
            "segment_bytes": None if self.layout is None else self.layout[0],
            "ballast_bytes": None if self.layout is None else self.layout[1],
            "master": self.spec.master_address,
            "metadata_server": self.spec.metadata_server,
            "health": self.spec.health_url,
            "http": self.spec.http_url,
            "log": str(self.log_path()),
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


def is_our_master(record: dict[str, object]) -> bool:
    """Whether a state file's store record still names the master we started: same start
    time, and `mooncake_master` on the recorded RPC port."""
    return _is_ours(
        record.get("pid"),
        record.get("start_time"),
        "mooncake_master",
        f"--rpc_port={record.get('rpc_port')}",
    )


def is_our_holder(record: object) -> bool:
    """The same for the store's holder (`mooncake_client` on the recorded port)."""
    if not isinstance(record, dict):
        return False
    return _is_ours(
        record.get("pid"),
        record.get("start_time"),
        "mooncake_client",
        f"--port={record.get('port')}",
    )


def _is_ours(pid: object, start: object, program: str, flag: str) -> bool:
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 1:
        return False
    if start is None or process_start_time(pid) != start:
        return False
    cmd = process_cmdline(pid) or []
    return any(a.endswith(program) for a in cmd) and flag in cmd


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
