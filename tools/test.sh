#!/usr/bin/env bash
# Set everything up and run the whole test suite, the differential tests against the real vLLM
# included: they need the vLLM 0.33.0 oracle venv, built (or re-checked) here from
# ../shared/vllm-oracle into ~/.cache/mmreuse (outside the clone, re-used between runs).
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh

SHARED=${MMREUSE_SHARED:-$(cd .. && pwd)/shared}
ORACLE_VENV=${MMREUSE_ORACLE_VENV:-$HOME/.cache/mmreuse/venv-oracle-0.33.0}
bash "$SHARED/vllm-oracle/setup.sh" "$ORACLE_VENV"
export MMREUSE_ORACLE_PYTHON="$ORACLE_VENV/bin/python"
export MMREUSE_ORACLE_SCRIPT="$SHARED/vllm-oracle/oracle.py"
export MMREUSE_REQUIRE_ORACLE=1                 # a missing oracle fails, never skips
export HYPOTHESIS_PROFILE=${HYPOTHESIS_PROFILE:-ci}   # thousands of examples per property

.venv/bin/python -m pytest -p no:cacheprovider "$@"
