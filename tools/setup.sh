#!/usr/bin/env bash
# Set up mmreuse from scratch in ./.venv: CPU torch 2.13.0, the package (editable, built against
# that torch without build isolation) and its test extras. Idempotent; safe to re-run.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ ! -f /usr/include/openssl/sha.h ] && command -v apt-get >/dev/null 2>&1; then
  echo "setup: installing libssl-dev (OpenSSL headers for the hashing fast path)"
  (apt-get install -y -q libssl-dev >/dev/null 2>&1 || { apt-get update -q && apt-get install -y -q libssl-dev; })
fi
[ -x .venv/bin/python ] || python3 -m venv .venv
PIP=(.venv/bin/python -m pip --disable-pip-version-check -q)
# The CPU wheel: an unpinned torch would pull a multi-GB CUDA build.
.venv/bin/python -c "import torch" 2>/dev/null || "${PIP[@]}" install torch==2.13.0
"${PIP[@]}" install setuptools wheel
"${PIP[@]}" install --no-build-isolation -e '.[test]'
echo "setup: ok ($(.venv/bin/python -c 'import torch, mmreuse; from mmreuse.hashing import fast_path_available as f; print(f"mmreuse {mmreuse.__version__}, torch {torch.__version__}, hashing fast path {f()}")'))"
