#!/usr/bin/env bash
# The library tier on Python 3.12, torch-free: a second venv (.venv-py312) with the core and the
# [test-core] extra (events, proxy, pytest, hypothesis, pytest-benchmark; no torch: its 3.12
# wheel would be a multi-GB CUDA download), the torch-free extensions built (mmreuse._index,
# mmreuse._jsonscan, mmreuse._hashcore; setup.py skips mmreuse._C without torch), then the tests
# that need neither torch nor the vLLM oracle. Modules that need torch skip themselves
# (pytest.importorskip); the oracle and live tiers are deselected. .ci/run runs it after the main tests.
#   bash tools/test_py312.sh [PYTEST ARGS]
#   env: MMREUSE_PY312 (a python3.12 to use), MMREUSE_PY312_VENV (default .venv-py312)
# Fails, loudly, when no Python 3.12 is found: on PATH, in pyenv, or in MMREUSE_PY312.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${MMREUSE_PY312_VENV:-.venv-py312}

is_py312() { [ -n "$1" ] && "$1" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; }
find_py312() {
  local c
  # pyenv's shim exists for every version it knows, installed or not: run each candidate.
  for c in "${MMREUSE_PY312:-}" "$(command -v python3.12 || true)"; do
    if is_py312 "$c"; then echo "$c"; return; fi
  done
  local root
  root=$(pyenv root 2>/dev/null || echo "${PYENV_ROOT:-$HOME/.pyenv}")
  for c in $(ls -d "$root"/versions/3.12*/bin/python3.12 2>/dev/null | sort -V -r); do
    if is_py312 "$c"; then echo "$c"; return; fi
  done
  return 1
}
PY=$(find_py312) || {
  echo "test_py312: FAILED: no Python 3.12 found (not on PATH, not in pyenv's versions;" \
    "set MMREUSE_PY312=/path/to/python3.12)" >&2
  exit 1
}
echo "test_py312: $("$PY" -VV | head -1) ($PY)"

if ! is_py312 "$VENV/bin/python"; then rm -rf "$VENV"; "$PY" -m venv "$VENV"; fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
"${PIP[@]}" install setuptools wheel
# No build isolation, as in tools/setup.sh; without torch in this venv setup.py skips mmreuse._C.
# Editable: the cp312 extensions are built next to the sources, where pytest imports them from.
"${PIP[@]}" install --no-build-isolation -e '.[test-core]'
"$VENV/bin/python" - <<'EOF'
import importlib.util, sys
import mmreuse, mmreuse._index, mmreuse._jsonscan
from mmreuse.hashing import fast_path_available
assert importlib.util.find_spec("torch") is None, "torch must not be installed in the 3.12 venv"
assert fast_path_available(), "mmreuse._hashcore (the hashing fast path) was not built"
print(f"test_py312: mmreuse {mmreuse.__version__} on Python {sys.version.split()[0]}, no torch")
EOF

# Tests in otherwise torch-free modules that need torch all the same (a module that needs it
# throughout skips itself with pytest.importorskip("torch")):
DESELECT=(
  # `mmreuse cluster ...` on the command line: mmreuse.cli loads mmreuse.sim for it
  tests/cluster/test_cluster.py::test_cli_argument_errors
  tests/cluster/test_cluster.py::test_cli_cluster_too_many_encoders
  tests/cluster/test_cluster.py::test_up_without_venv_names_the_step
  # it shows that importing mmreuse.residency loads torch
  tests/test_torch_free.py::test_the_check_can_fail
)

# The oracle venv is a 3.11 venv with torch: its tests belong to tools/test.sh. Under CI its
# absence fails (tests/support/oracle.py): here it must skip, so CI's variables are not passed.
env -u CI -u MMREUSE_REQUIRE_ORACLE -u MMREUSE_ORACLE_PYTHON -u MMREUSE_ORACLE_SCRIPT \
  HYPOTHESIS_PROFILE="${HYPOTHESIS_PROFILE:-dev}" \
  "$VENV/bin/python" -m pytest -p no:cacheprovider -q -n 2 --dist worksteal -m "not oracle and not live" \
  --ignore=tests/live --ignore=tests/live_proxy --ignore=tests/live_store "${DESELECT[@]/#/--deselect=}" "$@"
