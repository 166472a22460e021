#!/usr/bin/env bash
# On the H200: the prefix cache's benchmarks at the synthetic 27B shape, within a fixed wall-clock budget.
# 1. bench/cache_gpu.py, NVFP4 then FP8 at 32k: cold cache off / on alternated (NVFP4 twice, FP8 once), resend,
#    turns, host-tier and disk-tier restores, the disk's read bandwidth on a fresh file, the sizing table;
# 2. bench/conversation.py through the server (bench/synthetic_server.py) up to 32k tokens, cache off on the first
#    and last turns: NVFP4 with a restart before turn 5 served from --cache-dir, then FP8 (no disk tier).
# PARTS (default "gpu conv_nvfp4 conv_fp8") picks the parts and their order, CACHE_FORMATS (default nvfp4,fp8) and
# COLD_REPS (default 2,1) the cache_gpu formats and cold pairs. Each part gets what is left of BUDGET_S (default
# 520 s; a part cut short stops its server within ~35 s) and writes its results as it goes, under $OUT (cache_gpu_h200.json, conversation_27b_{nvfp4,fp8}.json and .png,
# run.log). Needs the server's and the openai client's wheels on PYTHONPATH (the device lacks them).
# Usage: OUT=dir bash bench/cache_h200.sh
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-cache_h200_out}"
mkdir -p "$out"
budget="${BUDGET_S:-520}"
export PYTHONUNBUFFERED=1
left() { echo $(( budget - SECONDS )); }
conversation() {  # FORMAT SECONDS [extra conversation.py options]
  local fmt=$1 t=$2
  shift 2
  if [ "$t" -lt 60 ]; then echo "conversation $fmt: skipped (${t} s left)"; return; fi
  timeout -s INT -k 20 "$t" python3 bench/conversation.py --synthetic "27b:$fmt" --context 32768 \
    --system-tokens 4000 --turn-min 2000 --turn-max 4000 --max-tokens 16 --cache-gb 8 --cache-host-gb 16 \
    --prefix-chunk 1024 --off-every 100 --out "$out/conversation_27b_$fmt.json" "$@"
  echo "conversation $fmt: exit $? at ${SECONDS} s"
}
gpu() {  # SECONDS
  if [ "$1" -lt 60 ]; then echo "cache_gpu: skipped (${1} s left)"; return; fi
  timeout -s INT -k 20 "$1" python3 bench/cache_gpu.py --formats "$formats" --shape 27b \
    --context 32768 --add 256,4096 --cold-reps "$reps" --no-turn-refs --out "$out/cache_gpu_h200.json"
  echo "cache_gpu: exit $? at ${SECONDS} s"
}
formats="${CACHE_FORMATS:-nvfp4,fp8}"
reps="${COLD_REPS:-2,1}"
parts="${PARTS:-gpu conv_nvfp4 conv_fp8}"
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  df -h /tmp | tail -1
  for part in $parts; do
    rest=$(( $(left) - 40 ))
    case "$part" in
      gpu) [[ "$parts" == *conv* ]] && rest=$(( rest - 200 )); gpu "$rest" ;;
      conv_nvfp4) rm -rf /tmp/conv27; [[ "$parts" == *conv_fp8* ]] && rest=$(( rest * 3 / 5 ))
                  conversation nvfp4 "$rest" --cache-dir /tmp/conv27 --restart-at 5; rm -rf /tmp/conv27 ;;
      conv_fp8) conversation fp8 "$rest" ;;
    esac
  done
} 2>&1 | tee "$out/run.log"
