#!/usr/bin/env bash
# vLLM 0.33.0's own tests/v1/core/test_prefix_caching.py and test_kv_cache_utils.py (from the
# sdist, sha256-checked), run twice in the oracle venv: with vLLM's own request block hasher and
# with mmreuse's (the pytest plugin tools/oracle/mmreuse_fast_hasher_plugin.py); the outcome of
# every test must be the same. pytest and einops go into a side folder (the oracle venv is left
# as its lock file says); --noconftest, HF offline (tests that need a model config fail in both).
#   bash tools/oracle/run_vllm_tests.sh [ORACLE_VENV]
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV="${1:-$HOME/.cache/mmreuse/venv-oracle-0.33.0}"
CACHE="$HOME/.cache/mmreuse/vllm-0.33.0-tests"
SITE="$CACHE/site"
if [ ! -f "$CACHE/.stamp" ]; then
  mkdir -p "$CACHE"
  .venv/bin/python - "$CACHE" <<'PY'
import sys, tarfile
from pathlib import Path
from mmreuse.proxy import reference as R
dest = Path(sys.argv[1])
url, sha, size = R._sdist_entry(R.PYPI_SIMPLE_URL, "0.33.0")
tarball = R._download(url, sha, size, dest)
try:
    with tarfile.open(tarball) as t:
        members = [m for m in t.getmembers() if m.name.split("/")[1:2] == ["tests"]]
        t.extractall(dest, members=members, filter="data")
finally:
    tarball.unlink(missing_ok=True)
PY
  .venv/bin/pip install -q --disable-pip-version-check --target "$SITE" pytest==9.2.0 einops==0.8.1
  rm -rf "$SITE"/packaging "$SITE"/packaging-*   # the venv's own packaging stays in charge
  touch "$CACHE/.stamp"
fi
cd "$CACHE/vllm-0.33.0"
run() {
  HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONPATH="$SITE:$OLDPWD:$OLDPWD/tools/oracle" \
    "$VENV/bin/python" -m pytest --noconftest -q -p no:cacheprovider --tb=no -rA "$@" \
    tests/v1/core/test_kv_cache_utils.py tests/v1/core/test_prefix_caching.py || true
}
run > "$CACHE/vllm.log" 2>&1
run -p mmreuse_fast_hasher_plugin > "$CACHE/mmreuse.log" 2>&1
"$VENV/bin/python" - "$CACHE/vllm.log" "$CACHE/mmreuse.log" <<'PY'
import re, sys
def outcomes(path):
    out = {}
    for line in open(path):
        m = re.match(r"^(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS) (\S+)", line)
        if m:
            out[m.group(2)] = m.group(1)
    return out
vllm, ours = outcomes(sys.argv[1]), outcomes(sys.argv[2])
stats = [l.strip() for l in open(sys.argv[2]) if l.startswith("mmreuse fast hasher")]
differ = sorted(k for k in vllm.keys() | ours.keys() if vllm.get(k) != ours.get(k))
passed = sum(v == "PASSED" for v in vllm.values())
print(f"vLLM's tests: {len(vllm)} run, {passed} pass with vLLM's hasher, "
      f"{sum(v == 'PASSED' for v in ours.values())} with mmreuse's; differing outcomes: {differ or 'none'}")
print(stats[0] if stats else "mmreuse fast hasher: NOT ACTIVE")
sys.exit(1 if differ or not stats or len(vllm) < 100 else 0)
PY
