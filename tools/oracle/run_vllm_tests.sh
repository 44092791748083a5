#!/usr/bin/env bash
# vLLM VERSION's own tests/v1/core/test_prefix_caching.py and test_kv_cache_utils.py (from its
# sdist, sha256-checked), and from 0.34.0 on test_prompt_block_hash_vectors.py too (with the
# Rust frontend's vector file it reads, rust/src/engine-core-client/src/tests/
# prompt_block_hash_vectors.json, at its place in the sdist), run twice in that version's oracle
# venv: with vLLM's own request block hasher and with mmreuse's (the pytest plugin
# tools/oracle/mmreuse_fast_hasher_plugin.py); the outcome of every test must be the same, and
# mmreuse's fast path must have served calls. pytest and einops go into a side folder (the
# oracle venv is left as its lock file says); --noconftest, HF offline (tests that need a model
# config fail in both). The sdist's files are kept in ~/.cache/mmreuse/vllm-VERSION-tests.
#   bash tools/oracle/run_vllm_tests.sh [VERSION [VENV]]   (default 0.33.0,
#                                                          ~/.cache/mmreuse/venv-oracle-VERSION)
set -euo pipefail
cd "$(dirname "$0")/../.."
VERSION="${1:-0.33.0}"
VENV="${2:-$HOME/.cache/mmreuse/venv-oracle-$VERSION}"
if [[ ! "$VERSION" =~ ^[0-9]+\.[0-9]+\.[0-9]+$ ]]; then
  echo "run_vllm_tests: VERSION must be a vLLM release such as 0.34.0, got '$VERSION'" >&2
  exit 2
fi
if [ ! -x "$VENV/bin/python" ]; then
  echo "run_vllm_tests: VENV must be a venv with vLLM $VERSION, got '$VENV' (no bin/python)" >&2
  exit 2
fi
GOT="$("$VENV/bin/python" -c 'import vllm; print(vllm.__version__)')"
if [ "${GOT%%+*}" != "$VERSION" ]; then
  echo "run_vllm_tests: VENV must hold vLLM $VERSION (its tests run against it), got $GOT in $VENV" >&2
  exit 2
fi
CACHE="$HOME/.cache/mmreuse/vllm-$VERSION-tests"
SITE="$CACHE/site"
VECTORS=rust/src/engine-core-client/src/tests/prompt_block_hash_vectors.json
STAMP=2  # what the cache holds: tests/ and the hash vectors
if [ "$(cat "$CACHE/.stamp" 2>/dev/null)" != "$STAMP" ]; then
  rm -rf "$CACHE"
  mkdir -p "$CACHE"
  .venv/bin/python - "$CACHE" "$VERSION" "$VECTORS" <<'PY'
import sys, tarfile
from pathlib import Path
from mmreuse.cluster import reference as R
dest, version, vectors = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
url, sha, size = R._sdist_entry(R.PYPI_SIMPLE_URL, version)
tarball = R._download(url, sha, size, dest)
try:
    with tarfile.open(tarball) as t:
        members = [
            m for m in t.getmembers()
            if m.name.split("/")[1:2] == ["tests"] or m.name.split("/", 1)[1:] == [vectors]
        ]
        t.extractall(dest, members=members, filter="data")
finally:
    tarball.unlink(missing_ok=True)
PY
  .venv/bin/pip install -q --disable-pip-version-check --target "$SITE" pytest==9.2.0 einops==0.8.1
  rm -rf "$SITE"/packaging "$SITE"/packaging-*   # the venv's own packaging stays in charge
  echo "$STAMP" > "$CACHE/.stamp"
fi
cd "$CACHE/vllm-$VERSION"
TESTS=(tests/v1/core/test_kv_cache_utils.py tests/v1/core/test_prefix_caching.py)
if [ -f tests/v1/core/test_prompt_block_hash_vectors.py ]; then  # 0.34.0 on
  [ -f "$VECTORS" ] || { echo "run_vllm_tests: $VECTORS missing from the sdist" >&2; exit 1; }
  TESTS+=(tests/v1/core/test_prompt_block_hash_vectors.py)
fi
run() {
  HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONPATH="$SITE:$OLDPWD:$OLDPWD/tools/oracle" \
    "$VENV/bin/python" -m pytest --noconftest -q -p no:cacheprovider --tb=no -rA "$@" \
    "${TESTS[@]}" || true
}
run > "$CACHE/vllm.log" 2>&1
run -p mmreuse_fast_hasher_plugin > "$CACHE/mmreuse.log" 2>&1
"$VENV/bin/python" - "$CACHE/vllm.log" "$CACHE/mmreuse.log" "$VERSION" <<'PY'
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
print(f"vLLM {sys.argv[3]}'s tests: {len(vllm)} run, {passed} pass with vLLM's hasher, "
      f"{sum(v == 'PASSED' for v in ours.values())} with mmreuse's; differing outcomes: {differ or 'none'}")
for name in sorted({k.split("::")[0] for k in vllm}):
    mine = {k: v for k, v in vllm.items() if k.startswith(name + "::")}
    print(f"  {name}: {len(mine)} run, {sum(v == 'PASSED' for v in mine.values())} pass")
print(stats[0] if stats else "mmreuse fast hasher: NOT ACTIVE")
fast = int(re.search(r"(\d+) calls hashed by mmreuse", stats[0]).group(1)) if stats else 0
sys.exit(1 if differ or not stats or fast == 0 or len(vllm) < 100 else 0)
PY
