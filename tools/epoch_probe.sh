# Session 18: the residual + norm ticket as a 64-bit count never reset (RESNORM_EPOCH 1, the default) against the
# session-16 form (RESNORM_EPOCH=0): GPU tests of the residual + norm GEMV and the engine, then two alternations of
# bench/decode.py. Run on the device machine from the repository root.
compile='from tandem.backend.cuda import loader; loader.load_module("gemv")'
(TANDEM_CUDA_DEFINES="RESNORM_EPOCH=0" python3 -c "$compile") &
python3 -m pytest -q -p no:cacheprovider tests/test_cuda_gemv.py -k "residual" tests/test_cuda_engine.py 2>&1 | tail -2
wait
run() { TANDEM_CUDA_DEFINES="$1" python3 bench/decode.py --shapes 27b,9b --formats nvfp4,fp8 --rows '' --ttft 0 2>&1 \
  | grep -E 'engine' | cut -c1-100 | sed "s/^/[$2 r$3] /"; }
for r in 1 2; do run "" epoch $r; run "RESNORM_EPOCH=0" reset $r; done
