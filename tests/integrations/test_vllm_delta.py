"""tools/oracle/vllm_delta.py: which watched vLLM files differ between two wheels."""

from __future__ import annotations

import importlib.util
import zipfile

from tests.support.paths import ORACLE_TOOLS

_spec = importlib.util.spec_from_file_location("vllm_delta", ORACLE_TOOLS / "vllm_delta.py")
assert _spec and _spec.loader
delta = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(delta)


def _wheel(path, files):
    with zipfile.ZipFile(path, "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
    return zipfile.ZipFile(path)


def test_each_watched_file_is_same_changed_new_gone_or_absent(tmp_path):
    same, changed, new, gone = list(delta.WATCHED)[:4]
    old = _wheel(tmp_path / "old.whl", {same: "a\n", changed: "x\ny\n", gone: "g\n"})
    cur = _wheel(tmp_path / "new.whl", {same: "a\n", changed: "x\nz\nw\n", new: "n\n"})
    rows = {name: (state, diff) for name, state, diff in delta.compare(old, cur)}
    assert list(rows) == list(delta.WATCHED)
    assert rows[same] == ("same", [])
    assert rows[changed][0] == "changed (+2 -1 lines)"
    assert "+z\n" in rows[changed][1] and "-y\n" in rows[changed][1]
    assert rows[new][0] == "new" and rows[gone][0] == "gone"
    assert {rows[n][0] for n in list(delta.WATCHED)[4:]} == {"absent in both"}


def test_every_watched_file_names_what_in_mmreuse_reads_it():
    assert all(path.startswith("vllm/") and owner for path, owner in delta.WATCHED.items())
