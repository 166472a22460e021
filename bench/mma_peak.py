"""Throughput of the tensor-core instruction the GEMV kernels use (mma.sync m16n8k16, fp16 in, fp32 accumulate) on
this GPU, with nothing else in the loop: the ceiling for the verify GEMMs, whose MMA count is fixed by the weights
and the token columns (weights / 256 · 2 columns per token / 8).

python3 bench/mma_peak.py [--chains 8] — prints MMAs per clock per SM and TFLOPS at the measured time.
"""

from __future__ import annotations

import argparse

import cupy as cp

SRC = r"""
extern "C" __global__ void mma_loop(float* out, int iters) {
  unsigned a0 = threadIdx.x * 0x00010001u, a1 = a0 ^ 0x3c003c00u, a2 = a0 + 7u, a3 = a0 * 3u;
  unsigned b0 = a0 ^ 0x1234u, b1 = a1 ^ 0x4321u;
  float d[CHAINS][4];
  #pragma unroll
  for (int k = 0; k < CHAINS; ++k) d[k][0] = d[k][1] = d[k][2] = d[k][3] = 0.0f;
  for (int it = 0; it < iters; ++it) {
    #pragma unroll
    for (int k = 0; k < CHAINS; ++k)
      asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                   "{%0,%1,%2,%3};\n"
                   : "+f"(d[k][0]), "+f"(d[k][1]), "+f"(d[k][2]), "+f"(d[k][3])
                   : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
  float s = 0.0f;
  #pragma unroll
  for (int k = 0; k < CHAINS; ++k) s += d[k][0] + d[k][1] + d[k][2] + d[k][3];
  if (s == 1234.5f) out[0] = s;
}
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--chains", type=int, default=8, help="independent accumulators a warp")
    ap.add_argument("--iters", type=int, default=4096)
    args = ap.parse_args()
    dev = cp.cuda.Device()
    sms = dev.attributes["MultiProcessorCount"]
    clock_khz = dev.attributes["ClockRate"]
    fn = cp.RawKernel(SRC.replace("CHAINS", str(args.chains)), "mma_loop")
    out = cp.zeros((1,), dtype=cp.float32)
    for warps in (4, 8, 16, 32):
        grid, block = (sms * max(1, warps // 8),), (min(warps, 8) * 32,)
        fn(grid, block, (out, args.iters))
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        fn(grid, block, (out, args.iters))
        stop.record()
        stop.synchronize()
        s = cp.cuda.get_elapsed_time(start, stop) / 1e3
        mmas = grid[0] * block[0] // 32 * args.iters * args.chains
        print(f"warps/SM {warps:2d} chains {args.chains}: {mmas / s / sms / (clock_khz * 1e3):.3f} MMA/clk/SM at "
              f"{clock_khz / 1e3:.0f} MHz, {mmas * 4096 / s / 1e12:.0f} TFLOPS")


if __name__ == "__main__":
    main()
