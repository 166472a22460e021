"""Does wgmma (Hopper's warpgroup MMA) give the bits of mma.sync m16n8k16? And is mma.sync's k16 sum invariant
under a permutation of k applied to A and B alike? Random fp16 A [64, 16], B [16, 64] with spread exponents, random
fp32 C: D = A B + C by (1) mma.sync per 16-row warp tile and 8-column tile, (2) one wgmma m64n64k16 with A from
registers and B from shared memory (no-swizzle K-major core matrices), (3) mma.sync with k permuted in A and B.
Prints how many of the outputs differ in bits. Needs sm_90a.

python3 tools/wgmma_bits.py [--trials 200]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile

import cupy as cp
import numpy as np

SRC = r"""
typedef unsigned int u32;
typedef unsigned short u16;
__device__ __forceinline__ void mma16816(float (&d)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
               "{%0,%1,%2,%3};\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
__device__ __forceinline__ u32 pair(const u16* p, int i, int j) { return (u32)p[i] | ((u32)p[j] << 16); }

// A [T][64][16] u16, Bt [T][64 n][16 k] u16, C [T][64][64] f32 -> D1 (mma.sync), D2 (wgmma), D3 (mma.sync, k perm).
// perm [16]: mma k index kappa takes physical k perm[kappa] (A and B alike).
extern "C" __global__ void __launch_bounds__(128) bits(const u16* A, const u16* Bt, const float* C, const int* perm,
                                                       float* D1, float* D2, float* D3, int lbo, int sbo, int kb_major) {
  __shared__ __align__(128) u16 bs[64 * 16];
  const int t = blockIdx.x, warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
  const u16* a = A + t * 64 * 16;
  const u16* b = Bt + t * 64 * 16;
  const float* cc = C + (size_t)t * 64 * 64;
  const int r0 = 16 * warp + g, r1 = r0 + 8;
  // core-matrix layout: (nb, kb) at nb * sbo + kb * lbo bytes, row n % 8 at 16 (n % 8), k % 8 within
  for (int idx = threadIdx.x; idx < 64 * 16; idx += 128) {
    const int n = idx / 16, k = idx % 16;
    const int off = (n / 8) * sbo + (k / 8) * lbo + (n % 8) * 16 + (k % 8) * 2;
    bs[off / 2] = b[n * 16 + k];
  }
  __syncthreads();
  for (int variant = 0; variant < 2; ++variant) {
    int p[16];
    for (int i = 0; i < 16; ++i) p[i] = variant ? perm[i] : i;
    const u32 a0 = pair(a, r0 * 16 + p[2 * c], r0 * 16 + p[2 * c + 1]);
    const u32 a1 = pair(a, r1 * 16 + p[2 * c], r1 * 16 + p[2 * c + 1]);
    const u32 a2 = pair(a, r0 * 16 + p[2 * c + 8], r0 * 16 + p[2 * c + 9]);
    const u32 a3 = pair(a, r1 * 16 + p[2 * c + 8], r1 * 16 + p[2 * c + 9]);
    float* D = variant ? D3 : D1;
    for (int j = 0; j < 8; ++j) {
      const int n = 8 * j + g;
      const u32 b0 = pair(b, n * 16 + p[2 * c], n * 16 + p[2 * c + 1]);
      const u32 b1 = pair(b, n * 16 + p[2 * c + 8], n * 16 + p[2 * c + 9]);
      float d[4];
      const int col = 8 * j + 2 * c;
      d[0] = cc[r0 * 64 + col]; d[1] = cc[r0 * 64 + col + 1]; d[2] = cc[r1 * 64 + col]; d[3] = cc[r1 * 64 + col + 1];
      mma16816(d, a0, a1, a2, a3, b0, b1);
      D[(size_t)t * 4096 + r0 * 64 + col] = d[0]; D[(size_t)t * 4096 + r0 * 64 + col + 1] = d[1];
      D[(size_t)t * 4096 + r1 * 64 + col] = d[2]; D[(size_t)t * 4096 + r1 * 64 + col + 1] = d[3];
    }
  }
  // wgmma m64n64k16, A from registers (mma.sync's fragment layout per warp), B by descriptor
  const u32 a0 = pair(a, r0 * 16 + 2 * c, r0 * 16 + 2 * c + 1);
  const u32 a1 = pair(a, r1 * 16 + 2 * c, r1 * 16 + 2 * c + 1);
  const u32 a2 = pair(a, r0 * 16 + 2 * c + 8, r0 * 16 + 2 * c + 9);
  const u32 a3 = pair(a, r1 * 16 + 2 * c + 8, r1 * 16 + 2 * c + 9);
  float d[32];
  for (int j = 0; j < 8; ++j) {
    const int col = 8 * j + 2 * c;
    d[4 * j] = cc[r0 * 64 + col]; d[4 * j + 1] = cc[r0 * 64 + col + 1];
    d[4 * j + 2] = cc[r1 * 64 + col]; d[4 * j + 3] = cc[r1 * 64 + col + 1];
  }
  const unsigned long long addr = (unsigned long long)__cvta_generic_to_shared(bs);
  const unsigned long long desc = ((addr & 0x3FFFF) >> 4) | ((unsigned long long)((lbo >> 4) & 0x3FFF) << 16) |
                                  ((unsigned long long)((sbo >> 4) & 0x3FFF) << 32);
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
      "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,"
      "%29,%30,%31}, {%32,%33,%34,%35}, %36, p, 1, 1, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),
        "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]),
        "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),
        "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc), "r"(1));
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
  asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
  for (int j = 0; j < 8; ++j) {
    const int col = 8 * j + 2 * c;
    D2[(size_t)t * 4096 + r0 * 64 + col] = d[4 * j]; D2[(size_t)t * 4096 + r0 * 64 + col + 1] = d[4 * j + 1];
    D2[(size_t)t * 4096 + r1 * 64 + col] = d[4 * j + 2]; D2[(size_t)t * 4096 + r1 * 64 + col + 1] = d[4 * j + 3];
  }
}
"""


def load() -> tuple[object, str]:
    """The kernel through NVRTC with sm_90a if CuPy lets it through, else nvcc's cubin; and which it was."""
    try:
        mod = cp.RawModule(code=SRC, options=("--gpu-architecture=sm_90a", "-std=c++17"))
        return mod.get_function("bits"), "nvrtc sm_90a"
    except Exception as exc:  # noqa: BLE001
        err = str(exc).splitlines()[0][:200]
    d = tempfile.mkdtemp()
    with open(os.path.join(d, "k.cu"), "w") as f:
        f.write(SRC)
    subprocess.run(["nvcc", "-arch=sm_90a", "-cubin", "-o", os.path.join(d, "k.cubin"), os.path.join(d, "k.cu")],
                   check=True)
    return cp.RawModule(path=os.path.join(d, "k.cubin")).get_function("bits"), f"nvcc cubin (nvrtc: {err})"


def rand_f16(rng: np.random.Generator, shape: tuple[int, ...], spread: int) -> np.ndarray:
    m = rng.uniform(1, 2, shape) * rng.choice([-1, 1], shape) * np.exp2(rng.integers(-spread, spread + 1, shape))
    return m.astype(np.float16)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trials", type=int, default=200)
    args = ap.parse_args()
    fn, how = load()
    print("compiled by", how)
    rng = np.random.default_rng(1)
    t = args.trials
    for spread in (0, 4, 10):
        A = cp.asarray(rand_f16(rng, (t, 64, 16), spread).view(np.uint16))
        B = cp.asarray(rand_f16(rng, (t, 64, 16), spread).view(np.uint16))
        C = cp.asarray((rng.standard_normal((t, 64, 64)) * np.exp2(rng.integers(-spread, spread + 1, (t, 64, 64))))
                       .astype(np.float32))
        perm = cp.asarray(rng.permutation(16).astype(np.int32))
        for lbo, sbo, label in ((1024, 128, "kb-major"), (128, 256, "nb-major")):
            D1, D2, D3 = (cp.full((t, 64, 64), np.nan, dtype=cp.float32) for _ in range(3))
            fn((t,), (128,), (A, B, C, perm, D1, D2, D3, np.int32(lbo), np.int32(sbo), np.int32(0)))
            cp.cuda.Device().synchronize()
            ref = (cp.asnumpy(A).view(np.float16).astype(np.float64) @
                   cp.asnumpy(B).view(np.float16).astype(np.float64).transpose(0, 2, 1)) + cp.asnumpy(C)
            d1, d2, d3 = (cp.asnumpy(x) for x in (D1, D2, D3))
            close = np.abs(d1 - ref).max() / max(1e-30, np.abs(ref).max())
            print(f"spread {spread:2d} {label}: mma vs ref max rel {close:.2e}; wgmma != mma: "
                  f"{int((d2.view(np.uint32) != d1.view(np.uint32)).sum())} of {d1.size} "
                  f"(max |diff| {np.nanmax(np.abs(d2 - d1)):.3e}); permuted-k mma != mma: "
                  f"{int((d3.view(np.uint32) != d1.view(np.uint32)).sum())}")


if __name__ == "__main__":
    main()
