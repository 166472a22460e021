set -e
run() { TANDEM_CUDA_DEFINES="$1" python3 bench/decode.py --shapes 27b,9b --formats nvfp4,fp8 --rows '' --ttft 0 --out $OUT/minb_$2_$3.json 2>&1 | grep -E '^(27b|9b)|ms' | grep -v Warning | head -12 | sed "s/^/[$2 r$3] /"; }
for r in 1 2; do run "" base $r; run "GEMV_GLU_MINB=5" m5 $r; run "GEMV_GLU_MINB=6" m6 $r; done
