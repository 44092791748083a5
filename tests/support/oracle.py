"""Talk to the real vLLM 0.33.0 through the oracle venv that tools/oracle/setup.sh builds.

Where it lives: MMREUSE_ORACLE_PYTHON (the venv's python, default
~/.cache/mmreuse/venv-oracle-0.33.0/bin/python) and MMREUSE_ORACLE_SCRIPT (the block-hash
oracle, default tools/oracle/hash_oracle.py in this repository).
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

DEFAULT_PYTHON = Path.home() / ".cache/mmreuse/venv-oracle-0.33.0/bin/python"
DEFAULT_SCRIPT = REPO / "tools/oracle/hash_oracle.py"


def oracle_paths() -> tuple[Path, Path]:
    py = Path(os.environ.get("MMREUSE_ORACLE_PYTHON", DEFAULT_PYTHON))
    script = Path(os.environ.get("MMREUSE_ORACLE_SCRIPT", DEFAULT_SCRIPT))
    return py, script


def require_oracle() -> tuple[Path, Path]:
    py, script = oracle_paths()
    if py.exists() and script.exists():
        return py, script
    msg = (
        f"vLLM oracle not found (python {py}, script {script}); build it with "
        "`bash tools/oracle/setup.sh` (or set MMREUSE_ORACLE_PYTHON / MMREUSE_ORACLE_SCRIPT)"
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
