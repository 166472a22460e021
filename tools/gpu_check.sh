#!/usr/bin/env bash
# On the device machine: every CUDA kernel test (fresh random inputs, NaN-poisoned outputs, relative error
# bounds, row invariance), the CPU kernel inventory, then a bench/decode.py run; logs and figures under $OUT
# (or ./gpu_check_out). Usage: tools/gpu_check.sh [--no-bench]
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-gpu_check_out}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1 TANDEM_CUDA_REPORT="$out/kernel_figures.jsonl"
rm -f "$TANDEM_CUDA_REPORT"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv | tee "$out/device.txt"
python3 -c "import cupy; print('cupy', cupy.__version__, 'nvrtc', cupy.cuda.nvrtc.getVersion())" | tee -a "$out/device.txt"
status=0
python3 -m pytest -q -p no:cacheprovider -rs tests/test_kernel_inventory.py tests/test_cuda_*.py 2>&1 \
  | tee "$out/tests.log" || status=1
if [ "${1:-}" != "--no-bench" ]; then
  timeout 300 python3 bench/decode.py --out "$out/cuda_decode_h200.json" 2>&1 | tee "$out/bench.log" || status=1
fi
python3 tools/gpu_check.py "$out" | tee "$out/summary.txt"
exit $status
