"""The parts that do not need torch import without it (libtorch costs seconds and hundreds of MB):
only `mmreuse.residency` / `mmreuse.ops` (the torch ops) may load it."""

import importlib.util
import subprocess
import sys

import pytest

TORCH_FREE = [
    "mmreuse",
    "mmreuse.events",
    "mmreuse.availability",
    "mmreuse.demand",
    "mmreuse.hashing",
    "mmreuse.blockhash",
    "mmreuse.kvview",
    "mmreuse.plan",
    "mmreuse._table",
    "mmreuse.cluster",
    "mmreuse.integrations.vllm",
    "mmreuse.cli",
    "mmreuse.events.hashcheck",
    "mmreuse.events.ec_wire",
    "mmreuse.proxy",
    "mmreuse.proxy.app",
    "mmreuse.proxy.policy",
    "mmreuse.proxy.reference",
]


def _imports_torch(module: str) -> bool:
    code = f"import sys, {module}; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip() == "True"


@pytest.mark.parametrize("module", TORCH_FREE)
def test_imports_without_torch(module):
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} does not exist yet")
    assert not _imports_torch(module)


def test_the_check_can_fail():
    assert _imports_torch("mmreuse.residency")
