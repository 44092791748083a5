#!/usr/bin/env bash
# Compile-check every csrc/cuda/*.cu with nvcc against the installed torch's headers (no GPU,
# no CUDA torch needed), as C++20 (torch >= 2.13) and C++17 (torch <= 2.12, e.g. the GPU
# machine's 2.11), so that a CUDA error fails CI. Nothing is linked or run.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
NVCC=${NVCC:-nvcc}
ARCH=${ARCH:-sm_90}
command -v "$NVCC" >/dev/null || { echo "check_cuda_compile: nvcc not found" >&2; exit 1; }
INC=$("$PY" -c "import sysconfig, torch.utils.cpp_extension as c; print(' '.join('-I' + p for p in c.include_paths() + [sysconfig.get_paths()['include']]))")
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
for f in csrc/cuda/*.cu; do
  for std in c++20 c++17; do
    echo "check_cuda_compile: nvcc -c $f ($ARCH, $std)"
    "$NVCC" -c -std=$std -arch="$ARCH" -O2 -Xcompiler -fPIC \
      -DC10_CUDA_NO_CMAKE_CONFIGURE_FILE \
      -D__CUDA_NO_HALF_OPERATORS__ -D__CUDA_NO_HALF_CONVERSIONS__ \
      -D__CUDA_NO_BFLOAT16_CONVERSIONS__ -D__CUDA_NO_HALF2_OPERATORS__ \
      --expt-relaxed-constexpr $([ "$std" = c++20 ] && echo "-Werror all-warnings") \
      $INC -Icsrc "$f" -o "$out/$(basename "$f").$std.o"
  done
done
echo "check_cuda_compile: ok"
