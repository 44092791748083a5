"""Talk to the real vLLMs (0.33.0, 0.34.0) through the oracle venvs tools/oracle/setup.sh builds.

Every oracle test runs once per version (the `oracle_version` fixture). Where the venvs live:
~/.cache/mmreuse/venv-oracle-VERSION by default; MMREUSE_ORACLE_PYTHON_0_34_0 (and so on) names
one version's python; MMREUSE_ORACLE_PYTHON alone (one venv, its version from the venv's name
or MMREUSE_ORACLE_VERSION) runs the oracle tests on that venv only. MMREUSE_ORACLE_SCRIPT is
the block-hash oracle, default tools/oracle/hash_oracle.py in this repository.
Under CI (CI=true) or MMREUSE_REQUIRE_ORACLE=1 a missing oracle fails the run instead of skipping.

`oracle_run` runs a script in an oracle venv as `subprocess.run` would, in a fork of a process
that imported vLLM once (tools/oracle/forkserver.py): importing vLLM's scheduler costs ~12 s a
script (the suite outside the live tiers: 18.4 min without, 10.3 with). MMREUSE_ORACLE_FORK=0
starts each in a fresh interpreter instead (what a fork server that cannot serve falls back to
by itself).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import select
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

from .paths import REPO

ORACLE_VERSIONS = ("0.33.0", "0.34.0")  # tools/oracle/setup.sh VERSION builds each
DEFAULT_SCRIPT = REPO / "tools/oracle/hash_oracle.py"


def _default_python(version: str) -> Path:
    return Path.home() / f".cache/mmreuse/venv-oracle-{version}/bin/python"


def oracle_pythons() -> dict[str, Path]:
    """vLLM version -> its oracle venv's python, for every version the oracle tests run on."""
    one = os.environ.get("MMREUSE_ORACLE_PYTHON")
    if one:
        named = next((v for v in ORACLE_VERSIONS if f"venv-oracle-{v}" in one), "custom")
        return {os.environ.get("MMREUSE_ORACLE_VERSION", named): Path(one)}
    return {
        v: Path(os.environ.get("MMREUSE_ORACLE_PYTHON_" + v.replace(".", "_"), _default_python(v)))
        for v in ORACLE_VERSIONS
    }


def token_id_bound(version: str) -> int | None:
    """The bound on the token ids a vLLM `Request` of `version` holds: None (any int) before
    0.34, 2**31 from 0.34 on (its int32 TokenBuffer; a larger id raises OverflowError)."""
    return None if version == "0.33.0" else 2**31


def oracle_paths(version: str = ORACLE_VERSIONS[0]) -> tuple[Path, Path]:
    pythons = oracle_pythons()
    py = pythons.get(version) or next(iter(pythons.values()))
    script = Path(os.environ.get("MMREUSE_ORACLE_SCRIPT", DEFAULT_SCRIPT))
    return py, script


def require_oracle(version: str = ORACLE_VERSIONS[0]) -> tuple[Path, Path]:
    py, script = oracle_paths(version)
    if py.exists() and script.exists():
        return py, script
    msg = (
        f"vLLM {version} oracle not found (python {py}, script {script}); build it with "
        f"`bash tools/oracle/setup.sh {version}` (or set MMREUSE_ORACLE_PYTHON / "
        "MMREUSE_ORACLE_SCRIPT)"
    )
    if os.environ.get("CI") or os.environ.get("MMREUSE_REQUIRE_ORACLE"):
        pytest.fail(msg)
    pytest.skip(msg)


class Oracle:
    """A long-lived JSON-lines process in the oracle venv: one case in, one result out."""

    def __init__(self, python: Path, script: Path, args: tuple[str, ...] = ("--jsonl",)):
        self.proc = subprocess.Popen(
            [str(python), str(script), *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
        )

    def compute(self, case: dict) -> dict:
        assert self.proc.stdin and self.proc.stdout
        self.proc.stdin.write(json.dumps(case) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"oracle exited (rc={self.proc.poll()})")
        return json.loads(line)

    def close(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        self.proc.wait(timeout=30)


FORKSERVER = REPO / "tools/oracle/forkserver.py"
# what the fork server imports once: what the oracle scripts spend their start-up on
PRELOAD = ("vllm.v1.core.sched.scheduler", "vllm.v1.engine.core")
# variables read when an interpreter starts (or vLLM is imported): a job runs in a server
# started with the same ones
_START_VARS = ("PYTHON", "VLLM_", "HF_", "TRANSFORMERS_", "OMP_", "MKL_", "TORCH", "LD_")


class _ForkServer:
    """One tools/oracle/forkserver.py process: `run` is `subprocess.run` in a fork of it."""

    def __init__(
        self, python: str, env: dict[str, str], preload: tuple[str, ...] = PRELOAD
    ) -> None:
        self.proc = subprocess.Popen(
            [python, str(FORKSERVER), *preload],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
            cwd=REPO,
        )
        self._buf = b""
        try:
            first = json.loads(self._line(300))
        except (EOFError, TimeoutError, ValueError):
            first = {"ready": False}
        self.ready = bool(first.get("ready"))
        if not self.ready:
            self.close()

    def _line(self, timeout: float) -> bytes:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise TimeoutError
            chunk = os.read(fd, 65536)
            if not chunk:
                raise EOFError
            self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        return line

    def run(
        self, args: list[str], env: dict[str, str], cwd: str, stdin: str | None, timeout: float
    ) -> tuple[int, str, str]:
        """(exit code, stdout, stderr) of `python ARGS`; TimeoutExpired after `timeout` s (the
        job's session killed); EOFError if the server died."""
        assert self.proc.stdin is not None
        with tempfile.TemporaryDirectory(prefix="oracle-job-") as d:
            paths = {k: str(Path(d) / k) for k in ("stdin", "stdout", "stderr")}
            if stdin is not None:
                Path(paths["stdin"]).write_text(stdin)
            job = {"args": args, "env": env, "cwd": cwd, **paths}
            job["stdin"] = paths["stdin"] if stdin is not None else None
            try:
                self.proc.stdin.write((json.dumps(job) + "\n").encode())
                self.proc.stdin.flush()
            except OSError as e:
                raise EOFError from e
            pid = json.loads(self._line(60))["pid"]
            try:
                rc = json.loads(self._line(timeout))["rc"]
            except TimeoutError:
                with contextlib.suppress(OSError):
                    os.killpg(pid, signal.SIGKILL)
                self._line(60)
                raise subprocess.TimeoutExpired(args, timeout) from None
            return rc, Path(paths["stdout"]).read_text(), Path(paths["stderr"]).read_text()

    def close(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


_SERVERS: dict[tuple, _ForkServer | None] = {}


@atexit.register
def _close_servers() -> None:
    for server in _SERVERS.values():
        if server is not None:
            server.close()
    _SERVERS.clear()


def _key(python: str, env: dict[str, str]) -> tuple:
    return (python, tuple(sorted((k, v) for k, v in env.items() if k.startswith(_START_VARS))))


def _server(key: tuple, env: dict[str, str]) -> _ForkServer | None:
    """The server of `key` (`_key`), started on first use; None where it cannot serve."""
    if key not in _SERVERS:
        server = _ForkServer(key[0], env)
        _SERVERS[key] = server if server.ready else None
    return _SERVERS[key]


def oracle_run(
    python: Path | str,
    *args: str,
    input: str | None = None,
    env: dict[str, str] | None = None,
    cwd: Path | str | None = None,
    timeout: float = 600,
    check: bool = True,
) -> subprocess.CompletedProcess:
    """`subprocess.run([python, *args], capture_output=True, text=True, ...)` for an oracle
    venv's python, run in a fork of a process that imported vLLM already (the module's
    docstring). `env`: the whole environment (default: `oracle_env()`)."""
    env = oracle_env() if env is None else dict(env)
    cmd = [str(python), *args]
    cwd = str(cwd or os.getcwd())
    key = _key(str(python), env)
    server = None if os.environ.get("MMREUSE_ORACLE_FORK") == "0" else _server(key, env)
    result = None
    if server is not None and args and (args[0] in ("-c", "-m") or not args[0].startswith("-")):
        try:
            result = server.run(list(args), env, cwd, input, timeout)
        except EOFError:  # the server died: this job and the next run on their own
            _SERVERS[key] = None
    if result is None:
        return subprocess.run(
            cmd, input=input, capture_output=True, text=True, check=check, timeout=timeout,
            env=env, cwd=cwd,
        )  # fmt: skip
    rc, out, err = result
    if check and rc != 0:
        raise subprocess.CalledProcessError(rc, cmd, out, err)
    return subprocess.CompletedProcess(cmd, rc, out, err)


def oracle_env(**extra: str) -> dict[str, str]:
    """An oracle script's environment: this process's, with this checkout on PYTHONPATH and no
    model hub, and `extra` (the same variables make the same fork server serve every job)."""
    return {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", **extra}


def oracle_lines(python: Path | str, *args: str, timeout: float = 600) -> list[str]:
    """Run `python ARGS` (the oracle venv's, in `oracle_env()`) and return its stdout's lines;
    a non-zero exit fails with its output."""
    out = oracle_run(python, *args, timeout=timeout)
    return out.stdout.strip().splitlines()


def oracle_json(python: Path | str, *args: str, timeout: float = 600) -> Any:
    """`oracle_lines`' last line, a JSON value (what the tools/oracle checks print)."""
    return json.loads(oracle_lines(python, *args, timeout=timeout)[-1])
