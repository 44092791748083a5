"""`mmreuse.integrations.vllm`: the facade users name (adapter functions, and the plug-in
classes loaded only when named), and the import graph of `mmreuse.integrations` (no cycle)."""

from __future__ import annotations

import ast
import subprocess
import sys

import pytest

import mmreuse.integrations.vllm as facade
from mmreuse.integrations.demand import engine_state
from tests.support.paths import REPO


def test_the_facade_exports_the_adapter():
    for name in ("availability_from_engine", "demand_for_request", "encoder_cache_space"):
        assert getattr(facade, name) is getattr(engine_state, name)
    with pytest.raises(AttributeError, match="no attribute 'Nothing'"):
        facade.Nothing  # noqa: B018


def test_the_facade_loads_no_vllm():
    code = "import sys, mmreuse.integrations.vllm; print('vllm' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def _imports(path, package: str) -> set[str]:
    """The mmreuse.integrations modules `path` imports (at any depth of its code)."""
    tree = ast.parse(path.read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                mod = ".".join([*base, node.module] if node.module else base)
            else:
                mod = node.module or ""
            names = [f"{mod}.{a.name}" for a in node.names] + [mod]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        found |= {n for n in names if n.startswith("mmreuse.integrations")}
    return found


def test_no_import_cycle_in_integrations():
    root = REPO / "mmreuse" / "integrations"
    modules = {}
    for path in root.rglob("*.py"):
        rel = path.relative_to(REPO).with_suffix("")
        name = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        modules[name] = path, package
    graph = {
        name: {m for m in _imports(path, package) if m in modules and m != name}
        for name, (path, package) in modules.items()
    }
    state: dict[str, int] = {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                raise AssertionError(f"import cycle: {' -> '.join([*stack, node, nxt])}")
            if nxt not in state:
                visit(nxt, [*stack, node])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [])
    # the parts of DemandScheduler (and the EC manager) never import it: only the facade does
    users = {m for m in graph if "mmreuse.integrations.demand.scheduler" in graph[m]}
    assert users == {"mmreuse.integrations.vllm"}, users
    # the encoder cache's plug-in (E runs it without a scheduler plug-in) and the pieces both
    # plug-ins share take nothing from DemandScheduler's parts
    for name in (
        "mmreuse.integrations.vllm_ec",
        "mmreuse.integrations.control",
        "mmreuse.integrations.snapshots",
    ):
        demand = {m for m in graph[name] if m.startswith("mmreuse.integrations.demand")}
        assert not demand, (name, demand)
