"""Talk to the real vLLMs (0.33.0, 0.34.0) through the oracle venvs tools/oracle/setup.sh builds.

Every oracle test runs once per version (the `oracle_version` fixture). Where the venvs live:
~/.cache/mmreuse/venv-oracle-VERSION by default; MMREUSE_ORACLE_PYTHON_0_34_0 (and so on) names
one version's python; MMREUSE_ORACLE_PYTHON alone (one venv, its version from the venv's name
or MMREUSE_ORACLE_VERSION) runs the oracle tests on that venv only. MMREUSE_ORACLE_SCRIPT is
the block-hash oracle, default tools/oracle/hash_oracle.py in this repository.
Under CI (CI=true) or MMREUSE_REQUIRE_ORACLE=1 a missing oracle fails the run instead of skipping.
"""

from __future__ import annotations

import json
import os
import subprocess
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


def oracle_lines(python: Path | str, *args: str, timeout: float = 600) -> list[str]:
    """Run `python ARGS` (the oracle venv's, with this checkout on PYTHONPATH and no model
    hub) and return its stdout's lines; a non-zero exit fails with its output."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    out = subprocess.run(
        [str(python), *args], capture_output=True, text=True, check=True, timeout=timeout, env=env
    )
    return out.stdout.strip().splitlines()


def oracle_json(python: Path | str, *args: str, timeout: float = 600) -> Any:
    """`oracle_lines`' last line, a JSON value (what the tools/oracle checks print)."""
    return json.loads(oracle_lines(python, *args, timeout=timeout)[-1])
