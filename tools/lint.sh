#!/usr/bin/env bash
# The project's static checks, run by .ci/run before the tests: ruff (lint + format), mypy on
# mmreuse/, clang-format on csrc/ (the vendored xxhash excluded). Needs tools/setup.sh first.
# `bash tools/lint.sh --fix` applies ruff's fixes and both formatters instead of checking.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=.venv/bin
mapfile -t CXX < <( (find csrc -path csrc/third_party -prune -o \( -name '*.cpp' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh' \) -print; find mmreuse -name '*.c') | sort)
if [ "${1:-}" = "--fix" ]; then
  "$BIN/ruff" check --fix .
  "$BIN/ruff" format .
  "$BIN/clang-format" -i "${CXX[@]}"
  exit 0
fi
echo "lint: ruff check";    "$BIN/ruff" check .
echo "lint: ruff format";   "$BIN/ruff" format --check .
echo "lint: mypy";          "$BIN/mypy"
echo "lint: clang-format";  "$BIN/clang-format" --dry-run --Werror "${CXX[@]}"
echo "lint: ok"
