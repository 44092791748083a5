#!/usr/bin/env bash
# Download, here, the wheels the lent GPU machine (Python 3.12, no internet) lacks for
# benchmarks/gpu_check.sh into .whl/ (git-ignored); carry .whl with the device run.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
for spec in hypothesis==6.155.2 sortedcontainers==2.4.0 attrs==26.1.0 cbor2==6.3.0 cachetools==8.0.2; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform any -d .whl "$spec"
done
ls -la .whl
