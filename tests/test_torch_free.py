"""The parts that do not need torch import without it (libtorch costs seconds and hundreds of MB):
only `mmreuse.residency` / `mmreuse.ops` (the torch ops) may load it. And the layers that must
not import each other do not: each module imported alone, in a fresh interpreter."""

import importlib.util
import json
import subprocess
import sys

import pytest

TORCH_FREE = [
    "mmreuse",
    "mmreuse.events",
    "mmreuse.events.stream",
    "mmreuse.events.kv_sink",
    "mmreuse.events.ec_sink",
    "mmreuse.metrics",
    "mmreuse.availability",
    "mmreuse.demand",
    "mmreuse.hashing",
    "mmreuse.blockhash",
    "mmreuse.kvview",
    "mmreuse.plan",
    "mmreuse._table",
    "mmreuse.cluster",
    "mmreuse.integrations.vllm",
    "mmreuse.integrations.plugin_config",
    "mmreuse.cli",
    "mmreuse.events.hashcheck",
    "mmreuse.events.ec_wire",
    "mmreuse.proxy",
    "mmreuse.proxy.app",
    "mmreuse.proxy.health",
    "mmreuse.proxy.server",
    "mmreuse.proxy.workers",
    "mmreuse.proxy.config",
    "mmreuse.proxy.metrics",
    "mmreuse.proxy.models",
    "mmreuse.proxy.policy",
    "mmreuse.cluster.reference",
]


def _loaded(module: str) -> set[str]:
    """The modules that importing `module` alone loads, in a fresh interpreter."""
    code = f"import json, sys, {module}; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


def _imports_torch(module: str) -> bool:
    return "torch" in _loaded(module)


@pytest.mark.parametrize("module", TORCH_FREE)
def test_imports_without_torch(module):
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} does not exist yet")
    assert not _imports_torch(module)


def test_the_check_can_fail():
    assert _imports_torch("mmreuse.residency")


# module -> the packages it must not load: the live view's metrics are one home
# (mmreuse.metrics) that both the event streams and availability import, so that neither imports
# the other; the plug-ins' additional_config reader loads neither vLLM nor the rest of mmreuse.
LAYERS = {
    "mmreuse.metrics": ("mmreuse.events", "mmreuse.availability", "mmreuse.proxy"),
    "mmreuse.availability": ("mmreuse.events",),
    "mmreuse.events": ("mmreuse.availability",),
    "mmreuse.events.stream": ("mmreuse.availability",),
    "mmreuse.events.kv_sink": ("mmreuse.availability",),
    "mmreuse.events.ec_sink": ("mmreuse.availability",),
    "mmreuse.integrations.plugin_config": ("vllm", "torch", "mmreuse.events", "mmreuse.proxy"),
}


@pytest.mark.parametrize("module, forbidden", sorted(LAYERS.items()))
def test_layers_do_not_import_each_other(module, forbidden):
    loaded = _loaded(module)
    assert module in loaded
    bad = sorted(m for m in loaded for f in forbidden if m == f or m.startswith(f + "."))
    assert not bad, f"importing {module} loads {bad}"
