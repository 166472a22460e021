"""Throughput of the warpgroup MMA the verify GEMMs issue (wgmma.mma_async m64n64k16, fp16 in, fp32 accumulate), with
nothing else in the loop, in the verify kernel's shape: blocks of 8 warps (2 warpgroups), 1 or 2 blocks an SM, 8
wgmmas a round on one accumulator. Modes: 0 = A from registers (RS, as cuda/gemv.cu gemv_mma_wg), the round's
wgmmas then wait_group 0 (the kernel's chunk); 1 = RS, one wait at the end; 2 = A and B from shared memory (SS).
The ceiling for the verify GEMMs' tensor work (docs/kernels.md). Hopper (sm_90) only.

python3 bench/wgmma_peak.py [--iters 2000] [--out FILE.json] — prints, per mode and blocks an SM, the time, HGMMA
instructions a clock an SM, FMA a clock an SM at the nominal clock and TFLOPS at the measured time (`peak_tflops`:
the best, which bench/decode.py and bench/prefill_gemm.py report next to their figures) (the H200's dense fp16 peak: 2048 FMA a clock
an SM: 989 TFLOPS at 1.83 GHz on 132 SMs).
"""

from __future__ import annotations

import argparse
import json

import cupy as cp

SRC = r'''
typedef unsigned int u32;
__device__ __forceinline__ void wg64(float (&d)[32], const u32 (&a)[4], unsigned long long desc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
      "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,"
      "%29,%30,%31}, {%32,%33,%34,%35}, %36, p, 1, 1, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),
        "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]),
        "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),
        "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1));
}
__device__ __forceinline__ void wg64ss(float (&d)[32], unsigned long long da, unsigned long long desc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
      "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,"
      "%29,%30,%31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),
        "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]),
        "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),
        "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "l"(da), "l"(desc), "r"(1));
}
// MODE 0: RS, 8 wgmma then wait 0 per round (the verify kernel's chunk); MODE 1: RS, wait only at the end;
// MODE 2: SS (A from shared memory), 8 then wait 0.
template <int MODE>
__device__ void body(float* out, int iters) {
  extern __shared__ __align__(128) unsigned char sm[];
  for (int i = threadIdx.x; i < 40960 / 4; i += blockDim.x) reinterpret_cast<u32*>(sm)[i] = 0x3c003c00u * (i & 1);
  __syncthreads();
  const u32 base = (u32)__cvta_generic_to_shared(sm) + (threadIdx.x >> 7) * 16384;
  const unsigned long long desc0 = (unsigned long long)((base & 0x3FFFF) >> 4) | ((unsigned long long)(1024 >> 4) << 16) |
                                   ((unsigned long long)(128 >> 4) << 32);
  const u32 abase = (u32)__cvta_generic_to_shared(sm) + 32768;
  const unsigned long long da0 = (unsigned long long)((abase & 0x3FFFF) >> 4) | ((unsigned long long)(1024 >> 4) << 16) |
                                   ((unsigned long long)(128 >> 4) << 32);
  float d[32];
  for (int i = 0; i < 32; ++i) d[i] = 0.f;
  u32 a[4] = {threadIdx.x, 0x3c00u, 0x3c003c00u, 1u};
  for (int it = 0; it < iters; ++it) {
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      if (MODE == 2) wg64ss(d, da0 + i * 2, desc0 + i * 130);
      else wg64(d, a, desc0 + i * 130);
    }
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
    if (MODE != 1) asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
  }
  asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
  float s = 0.f;
  for (int i = 0; i < 32; ++i) s += d[i];
  out[blockIdx.x * blockDim.x + threadIdx.x] = s;
}
extern "C" __global__ void __launch_bounds__(256, 2) peak0(float* o, int n) { body<0>(o, n); }
extern "C" __global__ void __launch_bounds__(256, 2) peak1(float* o, int n) { body<1>(o, n); }
extern "C" __global__ void __launch_bounds__(256, 2) peak2(float* o, int n) { body<2>(o, n); }
'''


def measure(iters: int = 2000, verbose: bool = False) -> list[dict[str, float]]:
    """Time every mode at 1 and 2 blocks an SM (5 launches after a warm-up, events). Returns one row each:
    blocks_per_sm, mode, us, hgmma_per_clk_sm, fma_per_clk_sm (at the nominal clock) and TFLOPS (measured time:
    2 flops an FMA, 64·64·16 FMA an HGMMA)."""
    mod = cp.RawModule(code=SRC, options=("-std=c++17", "--gpu-architecture=sm_90a"))
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    clock = cp.cuda.runtime.getDeviceProperties(0)["clockRate"] * 1e3
    rows: list[dict[str, float]] = []
    for blocks_per_sm in (1, 2):
        for mode in (0, 1, 2):
            k = mod.get_function(f"peak{mode}")
            grid = sms * blocks_per_sm
            out = cp.empty(grid * 256, dtype=cp.float32)
            k((grid,), (256,), (out, cp.int32(iters)), shared_mem=49152)
            cp.cuda.Device().synchronize()
            ev0, ev1 = cp.cuda.Event(), cp.cuda.Event()
            ev0.record()
            for _ in range(5):
                k((grid,), (256,), (out, cp.int32(iters)), shared_mem=49152)
            ev1.record()
            ev1.synchronize()
            s = cp.cuda.get_elapsed_time(ev0, ev1) / 1e3 / 5
            hgmma = grid * 2 * iters * 8  # 2 warpgroups a block
            per_clk_sm = hgmma / (s * clock * sms)
            tflops = hgmma * 64 * 64 * 16 * 2 / s / 1e12
            if verbose:
                print(f"blocks/SM {blocks_per_sm} mode {mode}: {s * 1e6:.1f} us, {per_clk_sm:.4f} HGMMA 64x64x16 "
                      f"/clk/SM = {per_clk_sm * 65536:.0f} FMA/clk/SM (clock {clock / 1e9:.2f} GHz nominal), "
                      f"{tflops:.0f} TFLOPS")
            rows.append({"blocks_per_sm": blocks_per_sm, "mode": mode, "us": round(s * 1e6, 1),
                         "hgmma_per_clk_sm": round(per_clk_sm, 5), "fma_per_clk_sm": round(per_clk_sm * 65536),
                         "tflops": round(tflops, 1)})
    return rows


def peak_tflops(iters: int = 2000) -> float:
    """The dense fp16 / bf16 tensor-core peak of this GPU as measured now: the best mode's TFLOPS."""
    return max(r["tflops"] for r in measure(iters))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iters", type=int, default=2000, help="rounds of 8 wgmmas a warpgroup")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    clock = cp.cuda.runtime.getDeviceProperties(0)["clockRate"] * 1e3
    rows = measure(args.iters, verbose=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"command": "python3 bench/wgmma_peak.py", "clock_GHz_nominal": clock / 1e9, "rows": rows}, f,
                      indent=1)


if __name__ == "__main__":
    main()
