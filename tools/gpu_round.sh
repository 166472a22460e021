#!/usr/bin/env bash
# One device round: the CUDA tests, the GEMV tuning bench, the engine decode bench.
# Usage on the device machine: bash tools/gpu_round.sh [pytest-timeout-s] [decode-bench args...]
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-gpu_round_out}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1 TANDEM_CUDA_REPORT="$out/kernel_figures.jsonl"
t_tests="${1:-300}"; shift || true
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee "$out/device.txt"
start=$(date +%s)
timeout "$t_tests" python3 -m pytest -q -p no:cacheprovider -rs tests/test_kernel_inventory.py tests/test_cuda_*.py \
  > "$out/tests.log" 2>&1
echo "tests rc=$? in $(( $(date +%s) - start )) s"; tail -25 "$out/tests.log" | grep -v "^$"
if [ -n "${GEMV_BENCH:-}" ]; then
  timeout 150 python3 bench/gemv.py --formats "$GEMV_BENCH" --out "$out/gemv.json" 2>&1 | tail -80
fi
if [ "$#" -gt 0 ]; then
  timeout "${DECODE_TIMEOUT:-240}" python3 bench/decode.py --out "$out/decode.json" "$@" 2>&1 | tail -20
fi
echo "total $(( $(date +%s) - start )) s"
