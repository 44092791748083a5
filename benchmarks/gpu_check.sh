#!/usr/bin/env bash
# GPU check, for a machine with a CUDA GPU and a CUDA torch (the lent H200: torch 2.11 cu130,
# nvcc 13, Python 3.12, no internet). Builds the extension in place with the CUDA kernels, runs
# the CUDA tests and the residency benchmarks, and prints a short table last. ~3-5 minutes.
#
#   bash benchmarks/gpu_check.sh            # from the repository root
#
# Python packages the machine lacks (hypothesis, cbor2, cachetools, ...) travel as wheels in
# .whl/ (made here by tools/fetch_gpu_wheels.sh) and are installed into /tmp/site.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/mmreuse-gpu}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
"$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA GPU visible'; print('torch', torch.__version__, torch.cuda.get_device_name())"

echo "== build (CUDA kernels for sm_90)"
start=$(date +%s)
MMREUSE_CUDA=1 TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-16} \
  "$PY" setup.py -q build_ext --inplace 2>&1 | tail -5
echo "build: $(( $(date +%s) - start )) s"
"$PY" -c "import torch, mmreuse.ops; print(torch._C._dispatch_dump('mmreuse::residency_mark'))" | grep -E "CPU|CUDA|Meta" || true

echo "== CUDA tests"
set +e
"$PY" -m pytest -q -p no:cacheprovider tests/test_ops.py tests/test_residency.py 2>&1 | tee "$OUT/tests.log" | tail -5
tests_rc=${PIPESTATUS[0]}
echo "== residency benchmarks"
"$PY" -m pytest -q -p no:cacheprovider benchmarks/test_bench_residency.py --benchmark-enable \
  --benchmark-json "$OUT/bench.json" --benchmark-columns=median,iqr,rounds 2>&1 | tail -25
bench_rc=${PIPESTATUS[0]}
set -e

echo "== summary (median us)"
"$PY" - "$OUT/bench.json" "$tests_rc" "$bench_rc" <<'PYEOF'
import json, sys
doc = json.load(open(sys.argv[1]))
print(f"{'benchmark':<48} {'median us':>12}")
for b in sorted(doc["benchmarks"], key=lambda b: b["name"]):
    print(f"{b['name']:<48} {b['stats']['median'] * 1e6:>12.2f}")
print(f"tests rc={sys.argv[2]} benchmarks rc={sys.argv[3]}")
PYEOF
[ "$tests_rc" = 0 ] && [ "$bench_rc" = 0 ]
