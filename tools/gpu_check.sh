#!/usr/bin/env bash
# On the device machine: every CUDA test (kernels vs their NumPy references on fresh random inputs, NaN-poisoned
# outputs, row invariance, tree == decode bit for bit; the engine on the GPU: greedy parity with the CPU engine on
# the embedded model, speculative == plain, verify/commit == plain decodes, flat device memory), the CPU kernel
# inventory, then the benchmarks (bench/decode.py: the engine's CUDA model on synthetic 9B / 27B checkpoints;
# bench/gemv.py: the GEMV alone; bench/sample.py: the device sampler alone; bench/prefill.py: the tensor-core
# prefill). Logs and figures under $OUT (or
# ./gpu_check_out).
# Usage: tools/gpu_check.sh [--no-bench]
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
  timeout 500 python3 bench/decode.py --out "$out/cuda_decode_h200.json" 2>&1 | tee "$out/bench.log" || status=1
  timeout 200 python3 bench/gemv.py --out "$out/cuda_gemv_h200.json" 2>&1 | tee -a "$out/bench.log" || status=1
  timeout 100 python3 bench/sample.py --out "$out/cuda_sample_h200.json" 2>&1 | tee -a "$out/bench.log" || status=1
  timeout 300 python3 bench/prefill.py --shapes 27b --formats nvfp4 --prompts 4096,8192 --weights auto \
    --out "$out/cuda_prefill.json" 2>&1 | tee -a "$out/bench.log" || status=1
fi
python3 tools/gpu_check.py "$out" | tee "$out/summary.txt"
exit $status
