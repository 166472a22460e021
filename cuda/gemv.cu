// gemv.cu: y[t, o] = Σ_j x[t, j] · W[o, j] for 1..64 rows of x (GEMV and skinny GEMM), weights in BF16,
// FP8 E4M3 with 128×128 block scales, or NVFP4 (E2M1 low nibble first, E4M3 scale per 16, fp32 global scale).
// fp32 activations and fp32 accumulation; weights decoded to the exact float32 the NumPy reference
// dequantizes to (tandem/formats/linear.py, nvfp4.py): FP8 w = f32(code)·scale, NVFP4 w = (e2m1·e4m3)·global
// (or / global for compressed-tensors), each one float32 product as in the reference.
//
// Launch: grid (ceil(out / 16), ceil(T / TT)), block 256 = 8 warps; a warp owns 2 output rows, TT rows of x.
// Each lane reads 16-byte weight vectors v = lane, lane + 32, ... of its two rows (coalesced, read once per
// row tile of x) and accumulates with fmaf in j order; then a butterfly warp sum.
// Row invariance: the j-partition over lanes, the per-lane order and the warp sum depend only on `in`, so row
// t of y has the same bits for any T and any TT (TT only picks how many rows share one weight read).
// Layout: x [T, in] fp32 row-major, y [T, out] fp32; BF16 W [out, in] u16; FP8 W [out, in] u8 + scale
// [ceil(out/128), ceil(in/128)] fp32; NVFP4 W [out, in/2] u8 + scale [out, in/16] u8 (E4M3 bits) + global.
// Needs: in % 8 (BF16), in % 16 (FP8), in % 32 (NVFP4) == 0, 16-byte aligned rows.
// History: v1 one warp per 2 rows, TT ∈ {1, 2, 4, 8}, rows beyond TT by grid.y (weights re-read per tile).
#include "common.cuh"

#define GEMV_WARPS 8
#define GEMV_ROWS 2  // output rows per warp: each x load serves two weight rows

// acc[i][r] += Σ_e w[i][e] · x[r][j0 + e], e in order; x read as float4.
template <int TT, int EPV>
__device__ __forceinline__ void fma_vec(float (&acc)[GEMV_ROWS][TT], const float (&w)[GEMV_ROWS][EPV],
                                        const float* const (&xr)[TT], int j0) {
#pragma unroll
  for (int r = 0; r < TT; ++r) {
    const float4* xv = reinterpret_cast<const float4*>(xr[r] + j0);
#pragma unroll
    for (int q = 0; q < EPV / 4; ++q) {
      const float4 a = __ldg(xv + q);
#pragma unroll
      for (int i = 0; i < GEMV_ROWS; ++i) {
        acc[i][r] = fmaf(w[i][4 * q + 0], a.x, acc[i][r]);
        acc[i][r] = fmaf(w[i][4 * q + 1], a.y, acc[i][r]);
        acc[i][r] = fmaf(w[i][4 * q + 2], a.z, acc[i][r]);
        acc[i][r] = fmaf(w[i][4 * q + 3], a.w, acc[i][r]);
      }
    }
  }
}

template <int TT>
__device__ __forceinline__ void store_rows(float (&acc)[GEMV_ROWS][TT], float* __restrict__ y, int out_dim,
                                           int num_rows, int row0, int o0) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int i = 0; i < GEMV_ROWS; ++i)
#pragma unroll
    for (int r = 0; r < TT; ++r) acc[i][r] = warp_sum(acc[i][r]);
#pragma unroll
  for (int i = 0; i < GEMV_ROWS; ++i)
#pragma unroll
    for (int r = 0; r < TT; ++r)
      if (lane == i * TT + r && o0 + i < out_dim && row0 + r < num_rows)
        y[(size_t)(row0 + r) * out_dim + o0 + i] = acc[i][r];
}

// Shared prologue: this warp's output rows (clamped for loads) and x row pointers (clamped to the last row).
#define GEMV_PROLOGUE                                                                   \
  PDL_ENTER                                                                             \
  const int o0 = (blockIdx.x * GEMV_WARPS + (threadIdx.x >> 5)) * GEMV_ROWS;            \
  if (o0 >= out_dim) return;                                                            \
  const int lane = threadIdx.x & 31;                                                    \
  const int row0 = blockIdx.y * TT;                                                     \
  int orow[GEMV_ROWS];                                                                  \
  _Pragma("unroll") for (int i = 0; i < GEMV_ROWS; ++i) orow[i] = min(o0 + i, out_dim - 1); \
  const float* xr[TT];                                                                  \
  _Pragma("unroll") for (int r = 0; r < TT; ++r)                                        \
    xr[r] = x + (size_t)min(row0 + r, num_rows - 1) * in_dim;                           \
  float acc[GEMV_ROWS][TT];                                                             \
  _Pragma("unroll") for (int i = 0; i < GEMV_ROWS; ++i)                                 \
    _Pragma("unroll") for (int r = 0; r < TT; ++r) acc[i][r] = 0.0f;

template <int TT>
__device__ __forceinline__ void gemv_bf16(const uint4* __restrict__ w, const float* __restrict__ x,
                                          float* __restrict__ y, int out_dim, int in_dim, int num_rows) {
  GEMV_PROLOGUE
  const int num_vec = in_dim / 8;
#pragma unroll 2
  for (int v = lane; v < num_vec; v += 32) {
    float wf[GEMV_ROWS][8];
#pragma unroll
    for (int i = 0; i < GEMV_ROWS; ++i) {
      const uint4 p = __ldg(w + (size_t)orow[i] * num_vec + v);
      const u32 words[4] = {p.x, p.y, p.z, p.w};
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        wf[i][2 * q] = bf16_lo(words[q]);
        wf[i][2 * q + 1] = bf16_hi(words[q]);
      }
    }
    fma_vec<TT, 8>(acc, wf, xr, v * 8);
  }
  store_rows<TT>(acc, y, out_dim, num_rows, row0, o0);
}

template <int TT>
__device__ __forceinline__ void gemv_fp8(const uint4* __restrict__ w, const float* __restrict__ scale,
                                         const float* __restrict__ x, float* __restrict__ y, int out_dim,
                                         int in_dim, int num_rows) {
  GEMV_PROLOGUE
  const int num_vec = in_dim / 16;
  const int scale_cols = (in_dim + 127) / 128;
#pragma unroll 2
  for (int v = lane; v < num_vec; v += 32) {
    float wf[GEMV_ROWS][16];
#pragma unroll
    for (int i = 0; i < GEMV_ROWS; ++i) {
      const uint4 p = __ldg(w + (size_t)orow[i] * num_vec + v);
      const float s = __ldg(scale + (size_t)(orow[i] / 128) * scale_cols + (v * 16) / 128);
      const u32 words[4] = {p.x, p.y, p.z, p.w};
#pragma unroll
      for (int e = 0; e < 16; ++e) wf[i][e] = __fmul_rn(e4m3_to_f32((words[e / 4] >> (8 * (e % 4))) & 0xFFu), s);
    }
    fma_vec<TT, 16>(acc, wf, xr, v * 16);
  }
  store_rows<TT>(acc, y, out_dim, num_rows, row0, o0);
}

template <int TT>
__device__ __forceinline__ void gemv_nvfp4(const uint4* __restrict__ w, const u16* __restrict__ scale,
                                           float global_scale, int divide, const float* __restrict__ x,
                                           float* __restrict__ y, int out_dim, int in_dim, int num_rows) {
  GEMV_PROLOGUE
  const int num_vec = in_dim / 32;  // 16 bytes = 32 codes = 2 scale groups
#pragma unroll 1
  for (int v = lane; v < num_vec; v += 32) {
    float wf[GEMV_ROWS][32];
#pragma unroll
    for (int i = 0; i < GEMV_ROWS; ++i) {
      const uint4 p = __ldg(w + (size_t)orow[i] * num_vec + v);
      const u32 sc = __ldg(scale + (size_t)orow[i] * num_vec + v);  // two E4M3 codes, group 2v low byte
      const float s0 = e4m3_to_f32(sc & 0xFFu), s1 = e4m3_to_f32(sc >> 8);
      const u32 words[4] = {p.x, p.y, p.z, p.w};
#pragma unroll
      for (int e = 0; e < 32; ++e) {
        const float m = __fmul_rn(e2m1_to_f32((words[e / 8] >> (4 * (e % 8))) & 0xFu), e < 16 ? s0 : s1);
        wf[i][e] = divide ? __fdiv_rn(m, global_scale) : __fmul_rn(m, global_scale);
      }
    }
    fma_vec<TT, 32>(acc, wf, xr, v * 32);
  }
  store_rows<TT>(acc, y, out_dim, num_rows, row0, o0);
}

#define GEMV_INSTANCES(TT)                                                                                     \
  extern "C" __global__ void __launch_bounds__(256) gemv_bf16_t##TT(                                           \
      const uint4* w, const float* x, float* y, int out_dim, int in_dim, int num_rows) {                      \
    gemv_bf16<TT>(w, x, y, out_dim, in_dim, num_rows);                                                         \
  }                                                                                                            \
  extern "C" __global__ void __launch_bounds__(256) gemv_fp8_t##TT(                                            \
      const uint4* w, const float* scale, const float* x, float* y, int out_dim, int in_dim, int num_rows) {  \
    gemv_fp8<TT>(w, scale, x, y, out_dim, in_dim, num_rows);                                                   \
  }                                                                                                            \
  extern "C" __global__ void __launch_bounds__(256) gemv_nvfp4_t##TT(                                          \
      const uint4* w, const u16* scale, float global_scale, int divide, const float* x, float* y, int out_dim, \
      int in_dim, int num_rows) {                                                                              \
    gemv_nvfp4<TT>(w, scale, global_scale, divide, x, y, out_dim, in_dim, num_rows);                           \
  }

GEMV_INSTANCES(1)
GEMV_INSTANCES(2)
GEMV_INSTANCES(4)
GEMV_INSTANCES(8)

// ============================================================================================================
// v2: tensor-core GEMV / skinny GEMM (mma.sync m16n8k16, fp32 accumulators), the decode and verify path.
//
// Why: a CUDA-core GEMV spends ~8 integer/float instructions per weight element decoding FP8 / NVFP4, which
// caps it far below the memory bandwidth (v1, docs/performance.md). Here a weight element costs ≤ 2 integer
// instructions and the multiply-adds run on the tensor cores, so 1..64 rows of x cost about one weight read.
//
// Operands. A = 16 weight rows × 16 k, decoded EXACTLY into the MMA input type: BF16 as stored; FP8 E4M3 →
// fp16 (cvt.rn.f16x2.e4m3x2, exact); NVFP4 → fp16 e2m1 · e4m3 · 2^-14 (the E2M1 nibble placed at fp16 bits
// 9..12 is e2m1 · 2^-14; times the E4M3 group scale in fp16 is exact: products are multiples of 2^-24 and
// ≤ 0.165; each output row is then multiplied by row_scale = 2^14 · global, or 2^14 / global for the
// compressed-tensors divisor, per row so that projections with different global scales can share a launch).
// FP8 block scales come expanded to one row per 8 output rows [ceil(out/8), ceil(in/128)] for the same reason
// (and so that gate / up rows interleaved in 8-row groups keep their own scales).
// B = x split into parts that sum to x: fp16 hi + lo (22 significant bits; |x| < 65504) for FP8 and
// NVFP4, bf16 hi + mid + lo (24 bits, any range) for BF16, written once per call by gemv_prep_* into xs
// [T, P, in] (fp16 / bf16 bits). Column n of an MMA = token (n / P), part (n % P).
// The k order. An m16n8k16 fragment gives lane (g = lane/4, c = lane%4) k slots {2c, 2c+1, 2c+8, 2c+9}. Any
// bijection between slots and real k is fine if A and B use the same one: lane c of a quad reads ONE 16-byte
// weight vector per row (E = 8 / 16 / 32 elements) and its MMA i takes vector elements 4i..4i+3 (NVFP4: a fixed
// permutation of each 32-element segment that makes nibble pairs (k, k+4) one fp16x2; gemv_prep writes xs in
// the same order). A quad covers one chunk of 4E consecutive k.
// Storage (weight_ptrs): codes tile-major (gemv.py _tile): per 16-row tile and chunk (64 bytes of each of the 16
// rows) one contiguous kilobyte, rows 0-7 then 8-15, lane (g, c)'s vector at 16 (4 g + c), so each warp load is 512
// contiguous bytes (row-major rows, 8 scattered 64-byte pieces a load, measured slower); NVFP4 words hold their
// nibbles in the pair layout (e2m1_pair). NVFP4 scale codes tile-major too (gemv.py _tile_scales: a tile's chunk 128
// contiguous bytes; row-major, a warp's scale load took 8 sectors for 64 bytes).
// Launch: grid (ceil(out / 16), ceil(T / (NTB · TPT))), block 256 = 8 warps. The block owns 16 output rows and
// NTB MMA column tiles (TPT tokens each: 4 for fp16, 2 for bf16); warp w takes chunks w, w + 8, ... (U chunks'
// weight vectors loaded before the first MMA). The 8 warps' partial sums are added in warp order in shared
// memory, then the parts in order (hi + lo (+ lo2)), then the format's scale.
// Row invariance: a token's column holds its own data only, and the k split, the chunk order, the warp order and
// the part order depend only on `in`, so row t has the same bits for any T (tests check it on the device).
// Needs: in % (4E) == 0 (BF16 32, FP8 64, NVFP4 128); rows 16-byte aligned.
// Versions: v2 mma.sync path next to v1 (v1 kept for shapes v2 does not take); v2.1 U = 2 for FP8/NVFP4;
// v2.2 the SiLU·mul epilogue (gate|up interleaved), FP8 scales per 8 rows, prefetching variants (_pf); v2.3 the
// residual + RMSNorm epilogue replaces a RMSNorm prologue that every block recomputed (60 KB of L2 reads a block);
// v2.4 the wide verify kernels (gemv_mma_wide), programmatic dependent launch, tile-major weights; v2.5 the NVFP4
// pair layout (e2m1_pair: 11 integer instructions a word instead of 15), NVFP4 tile-major too; v2.6 the staged verify
// kernels (gemv_mma_staged: cp.async rings in shared memory); v2.7 the warpgroup verify kernels (gemv_mma_wg,
// sm_90a: class-major blocks, wgmma with the mma.sync bits); v2.8 the residual + norm epilogue's norm spread over the
// last ceil(out / 256) blocks from per-tile sums of squares (resnorm_tail); v2.9 weight vectors and NVFP4 scale codes
// loaded evict-first (ld_weight). What each step measured: docs/performance.md.
// ============================================================================================================

#define MMA_WARPS 8
#define MMA_U 2  // chunks whose weight vectors are in flight per warp before the first MMA, every format (the
                 // fastest of U = 1, 2, 4, 8 in bench/gemv.py for every 27B / 9B shape with tile-major storage)

__device__ __forceinline__ void mma_f16(float (&d)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
               "{%0,%1,%2,%3};\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// D = A B + 0 (the first MMA of a chunk's partial sum: the same instruction as mma_f16 on zeroed accumulators).
__device__ __forceinline__ void mma_f16_c0(float (&d)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
               "{%10,%10,%10,%10};\n"
               : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1), "f"(0.0f));
}

__device__ __forceinline__ void mma_bf16(float (&d)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
               "{%0,%1,%2,%3};\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Two E4M3 codes (low byte first) -> fp16x2, exact.
__device__ __forceinline__ u32 e4m3x2_to_f16x2(u32 two) {
  u32 r;
  const u16 v = (u16)two;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(r) : "h"(v));
  return r;
}

__device__ __forceinline__ u32 hmul2_bits(u32 a, u32 b) {
  u32 r;
  asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
}

// Pair k (0..3: the checkpoint word's nibbles k and k + 4, E2M1 with bit 3 the sign) of a 32-bit word in the pair
// layout -> fp16x2 (low = nibble k) of e2m1 · 2^-14, exact: the 3 magnitude bits at fp16 bits 9..11 (exponent 2
// bits + top mantissa bit, subnormal 0.5 included), the sign at 15 (and 25..27, 31 for the high half).
// The pair layout (gemv.py _pair_layout, applied when the weights are uploaded) puts, in each 16-bit half (low:
// nibbles 0-3, high: nibbles 4-7), pair 0's magnitude at bits 9-11 and sign at 15, pair 1's at 6-8 and 12, pair 2's
// at 0-2 and 13, pair 3's at 3-5 and 14: then pairs 0 and 1 are one mask after at most one shift, and the word's
// four pairs cost 11 integer instructions (5 shifts, 6 masks / merges) where the checkpoint's nibble order cost 15
// (v2.5; a search over all layouts found none cheaper for shift + mask decoding).
__device__ __forceinline__ u32 e2m1_pair(u32 w, int k) {
  constexpr u32 MAG = 0x0E000E00u, SIGN = 0x80008000u;
  if (k == 0) return w & (MAG | SIGN);
  if (k == 1) return (w << 3) & (MAG | SIGN);
  if (k == 2) return ((w << 9) & MAG) | ((w << 2) & SIGN);
  return ((w << 6) & MAG) | ((w << 1) & SIGN);
}

template <int FMT> struct MmaFmt;
template <> struct MmaFmt<0> { enum { E = 8, P = 3, TPT = 2 }; };   // BF16
template <> struct MmaFmt<1> { enum { E = 16, P = 2, TPT = 4 }; };  // FP8 block-scaled
template <> struct MmaFmt<2> { enum { E = 32, P = 2, TPT = 4 }; };  // NVFP4

// A fragments of MMA i (a compile-time constant after unrolling) from the lane's two weight vectors v0 (row g)
// and v1 (row g + 8) -> a[0..3]. NVFP4: sc = fp16x2 (s, s) {row g group 0, row g group 1, row g+8 group 0, 1}.
template <int FMT>
__device__ __forceinline__ void make_a(int i, const uint4& v0, const uint4& v1, const u32 (&sc)[4], u32 (&a)[4]) {
  const u32 w0[4] = {v0.x, v0.y, v0.z, v0.w};
  const u32 w1[4] = {v1.x, v1.y, v1.z, v1.w};
  if constexpr (FMT == 0) {  // bf16 pairs as stored: elements 4i, 4i+1 | 4i+2, 4i+3
    a[0] = w0[2 * i]; a[1] = w1[2 * i]; a[2] = w0[2 * i + 1]; a[3] = w1[2 * i + 1];
  } else if constexpr (FMT == 1) {  // word i = elements 4i..4i+3
    a[0] = e4m3x2_to_f16x2(w0[i]); a[1] = e4m3x2_to_f16x2(w1[i]);
    a[2] = e4m3x2_to_f16x2(w0[i] >> 16); a[3] = e4m3x2_to_f16x2(w1[i] >> 16);
  } else {  // word i/2, nibble pairs (k0, k0+4) and (k0+1, k0+5), k0 = 2 (i % 2); words 0-1: group 0
    const int wd = i / 2, k0 = 2 * (i % 2), gr = wd / 2;
    a[0] = hmul2_bits(e2m1_pair(w0[wd], k0), sc[gr]);
    a[1] = hmul2_bits(e2m1_pair(w1[wd], k0), sc[2 + gr]);
    a[2] = hmul2_bits(e2m1_pair(w0[wd], k0 + 1), sc[gr]);
    a[3] = hmul2_bits(e2m1_pair(w1[wd], k0 + 1), sc[2 + gr]);
  }
}

// Position within a 32-element NVFP4 segment of the j-th k slot the lane feeds (j = 4 I + s, s: the order
// b0.lo, b0.hi, b1.lo, b1.hi): 8 (I/2) + 2 (I%2) + {0, 4, 1, 5}[s]. gemv_prep writes xs in this order.
__device__ __forceinline__ int nvfp4_perm(int j) {
  const int i = j >> 2, s = j & 3;
  return 8 * (i >> 1) + 2 * (i & 1) + ((s & 1) << 2) + (s >> 1);
}

// Epilogue: MMA_Y_F32 writes y [T, out] fp32. MMA_Y_GLU: the weight holds gate and up rows interleaved in
// 8-row groups (tile b = gate rows 8b..8b+7, then up rows 8b..8b+7; gemv.glu_pair builds it), and the block
// writes silu(gate) · up for its 8 columns (common.cuh silu_times, the bits of silu_mul_rows) as the next
// GEMV's operand xs_out [T, P', out/2] in split `kind` (0: fp32 into y [T, out/2]).
// MMA_Y_RESNORM (T ≤ TPT rows, one column tile: a decode row, or the rows of a small verify; out = E): the residual
// add and the next RMSNorm. Each block adds its rows into the residual stream in place (resid[t, o] += y[t, o]: only
// this block touches row o), writes its tile's sum of squares for each token to a slot (common.cuh tile_sumsq_lanes;
// slot t · n + tile of the n tiles), then counts itself done (common.cuh ticket_acq_rel on counter words 0-1, a
// 64-bit count); the last T · k (k = ceil(out / 256)) blocks to count norm the rows, 256 columns of one token each
// (resnorm_tail below: the token's slots summed in add_rms_norm's tile order, so the bits equal add_rms_norm), as the
// next GEMV's operand xs_out [T, P', out] (kind > 0) or fp32 y [T, out] (kind 0), the fp32 normed rows to normed_out
// if given. counter: uint32 [RESNORM_SLOT0 + T · out / 16] (gemv.py _counter: one buffer per tile count), the count a
// multiple of the tile count before the launch (zero when made), the slots (fp32) from word RESNORM_SLOT0 on. ROWS
// (template): false for the decode's one-row instances (..._n1_resnorm[_pf]: T = 1 folded at compile time, their SASS
// the plain one-row kernel's: the rows form's index arithmetic measured slower for one row),
// true for ..._n1_resnorm_rows[_pf] (any T ≤ TPT).
// PF: the next round's weight loads are issued before this round's MMAs (register double buffer); the
// arithmetic and its order are unchanged, so PF never changes a bit.
// MMA_Y_CONV (one row, decode; the GDN layer's fused qkv|z|a|b projection): rows o < conv_channels are the conv
// channels: y[o] = silu(causal conv of [tail column o; the row's value]) with the tail column shifted in place
// (common.cuh conv_silu_shift: gdn_seq.cu gdn_decode_conv's bits), the other rows as MMA_Y_F32.
#define MMA_Y_F32 0
#define MMA_Y_GLU 1
#define MMA_Y_RESNORM 2
#define MMA_Y_CONV 3
#define RESNORM_SLOT0 32  // MMA_Y_RESNORM: counter word where the tile slots start (the count in the words before)

#define GEMV_MMA_PARAMS                                                                                        \
  const uint4 *__restrict__ w, const void *__restrict__ scale_ptr, const float *__restrict__ row_scale,       \
      const u16 *__restrict__ xs, float *__restrict__ y, int out_dim, int in_dim, int num_rows,               \
      float *__restrict__ resid, const float *__restrict__ norm_w, float *__restrict__ normed_out, float eps,  \
      u16 *__restrict__ xs_out, int kind, unsigned int *__restrict__ counter, float *__restrict__ tail,          \
      const float *__restrict__ conv_w, int conv_channels, int taps
#define GEMV_MMA_PASS                                                                                          \
  w, scale_ptr, row_scale, xs, y, out_dim, in_dim, num_rows, resid, norm_w, normed_out, eps, xs_out, kind, counter, \
      tail, conv_w, conv_channels, taps

// The lane's B operand rows: for each of the NTB column tiles, the row of xs [T, P, in] its column g takes (token
// tok0 + j TPT + g / P, part g % P; rows past the last token clamped, has[j] false: they load zeros) at the lane's
// first slot c E. gemv_mma and gemv_mma_wide share it.
template <int FMT, int NTB>
__device__ __forceinline__ void x_slots(const u16* xs, int tok0, int g, int c, int in_dim, int num_rows,
                                        const u16* (&xb)[NTB], bool (&has)[NTB]) {
  constexpr int E = MmaFmt<FMT>::E, P = MmaFmt<FMT>::P, TPT = MmaFmt<FMT>::TPT;
#pragma unroll
  for (int j = 0; j < NTB; ++j) {
    const int t = tok0 + j * TPT + g / P, part = g % P;
    has[j] = g < TPT * P && t < num_rows;
    xb[j] = xs + ((size_t)min(t, num_rows - 1) * P + part) * in_dim + (size_t)c * E;
  }
}

// The lane's pointers to its two weight rows (g, g + 8) of 16-row tile `tile` at chunk 0, and the uint4 step from
// one chunk to the next, in the tile-major storage (gemv.py _tile: the tile's chunk is one kilobyte, rows 0-7 then
// 8-15, lane (g, c) at vector 4 g + c, so a warp's load is 512 contiguous bytes).
template <int FMT>
__device__ __forceinline__ int weight_ptrs(const uint4* w, int tile, int g, int c, int in_dim, const uint4*& wp0,
                                           const uint4*& wp1) {
  constexpr int E = MmaFmt<FMT>::E;
  wp0 = w + (size_t)tile * (in_dim / (4 * E)) * 64 + g * 4 + c;
  wp1 = wp0 + 32;
  return 64;
}

// How the one-tile and wide kernels load weight vectors (load_chunk). Weights are read once a step and never again
// before the next step, so GEMV_WLOAD 1 (the default) loads them with ld.global.cs (evict-first: streaming lines go
// first, so x, the residual and the scales keep their L1 / L2 lines), and NVFP4's scale codes the same way. 0:
// ld.global.nc for both (__ldg; kept for A/B on other devices). Three more forms for A/B, 2: ld.global.nc.L1::
// no_allocate, 3: ld.global.cg (L2 only), 4: 2 with an L2 evict_first policy (createpolicy); 1 was best or tied at
// every shape and format (`python3 bench/decode.py --shapes 27b,9b --formats nvfp4,fp8 --rows '' --ttft 0`; figures in
// docs/performance.md). A hint changes no bit. NVFP4's scale codes, also read once a step, load evict-first too
// (load_chunk). FP8's block scales stay on __ldg: a 128-k scale serves two chunks (two warps of the block), and
// evict-first measured slower for them.
#ifndef GEMV_WLOAD
#define GEMV_WLOAD 1
#endif
template <typename T>
__device__ __forceinline__ T ld_weight(const T* p) {  // weight vectors and NVFP4 scale codes
#if GEMV_WLOAD == 1
  return __ldcs(p);
#else
  return __ldg(p);
#endif
}

// Chunk q of one row tile for the lane (g, c): weight vectors v0 (row g) and v1 (row g + 8) and their scales: NVFP4
// one u16 of E4M3 codes a row (the vector's 2 groups of 16; the codes tile-major, gemv.py _tile_scales: tile t's
// chunk q is 128 bytes, 8 a row, so a warp reads 64 contiguous bytes for rows g and 64 for rows g + 8), FP8 the
// 128×128 block scale expanded per 8 rows (tile rows 0-7, then 8-15; rows past the last clamped). Tiles past the
// last re-read it (their rows are not written).
template <int FMT>
__device__ __forceinline__ void load_chunk(const uint4* wp0, const uint4* wp1, int wstep, int q, const void* scale_ptr,
                                           int tile, int g, int c, int in_dim, int scale_cols, int rows8,
                                           uint4& v0, uint4& v1, u32 (&sraw)[2], float (&fs)[2]) {
  v0 = ld_weight(wp0 + (size_t)q * wstep);
  v1 = ld_weight(wp1 + (size_t)q * wstep);
  if constexpr (FMT == 2) {
    const u16* sc = static_cast<const u16*>(scale_ptr) +
                    ((size_t)min(tile, (rows8 - 1) / 2) * (in_dim / 128) + q) * 64 + g * 4 + c;
    sraw[0] = ld_weight(sc);  // used once a step, as the weights: evict-first
    sraw[1] = ld_weight(sc + 32);
  }
  if constexpr (FMT == 1) {
    const float* sc = static_cast<const float*>(scale_ptr);
    const int kb = (q * 64) / 128;
    fs[0] = __ldg(sc + (size_t)min(2 * tile, rows8 - 1) * scale_cols + kb);
    fs[1] = __ldg(sc + (size_t)min(2 * tile + 1, rows8 - 1) * scale_cols + kb);
  }
}

// NVFP4: the two rows' scale codes (E4M3 pairs, group 0 low) -> fp16x2 (s, s): {row g group 0, group 1, row g + 8
// group 0, group 1}, the multipliers make_a applies. Other formats: zeros (unused).
template <int FMT>
__device__ __forceinline__ void scale_pairs(u32 sraw0, u32 sraw1, u32 (&sc)[4]) {
  sc[0] = sc[1] = sc[2] = sc[3] = 0u;
  if constexpr (FMT == 2) {
    const u32 h0 = e4m3x2_to_f16x2(sraw0), h1 = e4m3x2_to_f16x2(sraw1);
    sc[0] = __byte_perm(h0, 0, 0x1010); sc[1] = __byte_perm(h0, 0, 0x3232);
    sc[2] = __byte_perm(h1, 0, 0x1010); sc[3] = __byte_perm(h1, 0, 0x3232);
  }
}

// FP8: a chunk's sums part (one 128-k block scale) times the block scales of rows g (fs0) and g + 8 (fs1), added
// into acc (accumulator elements 0, 1: row g; 2, 3: row g + 8). mma_chunk and gemv_mma_wide share it.
template <int NTB>
__device__ __forceinline__ void scale_chunk(const float (&part)[NTB][4], float fs0, float fs1, float (&acc)[NTB][4]) {
#pragma unroll
  for (int j = 0; j < NTB; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[j][e] = fmaf(part[j][e], (e >> 1) ? fs1 : fs0, acc[j][e]);
}

// One chunk's MMAs for a warp: the lane's weight vectors v0 (row g) and v1 (row g + 8), its scale codes / block
// scales, and the B words bw of its NTB column tiles, accumulated into acc in the fixed order (MMA i = 0..E/4-1).
template <int FMT, int NTB>
__device__ __forceinline__ void mma_chunk(const uint4& v0, const uint4& v1, u32 sraw0, u32 sraw1, float fs0,
                                          float fs1, const u32 (&bw)[NTB][MmaFmt<FMT>::E / 2],
                                          float (&acc)[NTB][4]) {
  constexpr int MMAS = MmaFmt<FMT>::E / 4;
  u32 sc[4];
  scale_pairs<FMT>(sraw0, sraw1, sc);
  float part[NTB][4];  // FP8: the chunk's sums (the first MMA writes them: mma_f16_c0)
#pragma unroll
  for (int i = 0; i < MMAS; ++i) {
    u32 a[4];
    make_a<FMT>(i, v0, v1, sc, a);
#pragma unroll
    for (int j = 0; j < NTB; ++j) {
      if constexpr (FMT == 0) mma_bf16(acc[j], a[0], a[1], a[2], a[3], bw[j][2 * i], bw[j][2 * i + 1]);
      else if constexpr (FMT == 1) {
        if (i == 0) mma_f16_c0(part[j], a[0], a[1], a[2], a[3], bw[j][0], bw[j][1]);
        else mma_f16(part[j], a[0], a[1], a[2], a[3], bw[j][2 * i], bw[j][2 * i + 1]);
      }
      else mma_f16(acc[j], a[0], a[1], a[2], a[3], bw[j][2 * i], bw[j][2 * i + 1]);
    }
  }
  if constexpr (FMT == 1) scale_chunk<NTB>(part, fs0, fs1, acc);
}

// The block's sums of one 16-row tile (index `tile`, rows 16 tile ..) from the warps' partials red [warp][column
// tile][row][col]: per (row, token) the warps in order, then the parts in order (hi + lo (+ lo2)), then the format's
// row scale; then the epilogue: fp32 y, the residual add (MMA_Y_RESNORM; the norm is the caller's), the conv, or
// (MMA_Y_GLU) silu(gate) · up of the tile's 8 gate and 8 up rows. gemv_mma and gemv_mma_wide share it, so a row's
// bits do not depend on the kernel. Holds barriers: every thread of the block calls it.
// What a one-tile NVFP4 block's epilogue thread loaded before its main loop (gemv_mma, EPI_PREFETCH): the row scale and
// (MMA_Y_RESNORM; FP8 too) the residual of its row; valid false: tile_epilogue loads them itself. With EPI_PREFETCH 2
// also the conv epilogue's inputs when the conv has 4 taps (Qwen3.5's): the row's 3 tail values and 4 weights (conv_pre
// true; else conv_silu_shift loads them).
struct EpiPre {
  float rs, rv;
  bool valid;
  float ct[3], cw[4];
  bool conv_pre;
};

template <int FMT, int NTB, int EPI, bool ROWS = false>
__device__ __forceinline__ void tile_epilogue(const float (&red)[MMA_WARPS][NTB][16][9], int tile, int tok0,
                                              GEMV_MMA_PARAMS, EpiPre pre = EpiPre{}) {
  constexpr int P = MmaFmt<FMT>::P, TPT = MmaFmt<FMT>::TPT;
  const int m0 = tile * 16;
  __shared__ float tot[EPI == MMA_Y_GLU ? NTB * TPT : 1][17];
  float s_row = 0.0f;  // MMA_Y_RESNORM (threads 16 t .. 16 t + 15 own token t's rows m0 ..): the updated residual
  for (int idx = threadIdx.x; idx < NTB * TPT * 16; idx += blockDim.x) {
    const int row = idx & 15, tt = idx >> 4, j = tt / TPT, tl = tt % TPT;
    const int t = tok0 + tt, o = m0 + row;
    if (t >= num_rows || o >= out_dim) continue;
    float total = 0.0f;
#pragma unroll
    for (int p = 0; p < P; ++p) {
      float s = red[0][j][row][tl * P + p];
#pragma unroll
      for (int ww = 1; ww < MMA_WARPS; ++ww) s = __fadd_rn(s, red[ww][j][row][tl * P + p]);
      total = p == 0 ? s : __fadd_rn(total, s);
    }
    if constexpr (FMT == 2) total = __fmul_rn(total, pre.valid ? pre.rs : __ldg(row_scale + o));
    if constexpr (EPI == MMA_Y_GLU) tot[tt][row] = total;
    else if constexpr (EPI == MMA_Y_RESNORM) {
      float* r = resid + (ROWS ? (size_t)t * out_dim : 0) + o;
      s_row = __fadd_rn(pre.valid ? pre.rv : *r, total);  // add_rms_norm's sum
      *r = s_row;
    }
    else if constexpr (EPI == MMA_Y_CONV)
      y[o] = o >= conv_channels ? total
             : pre.conv_pre ? conv4_silu_shift(tail, conv_channels, o, pre.ct, pre.cw, total)
                            : conv_silu_shift(tail, conv_w, conv_channels, taps, o, total);
    else y[(size_t)t * out_dim + o] = total;
  }
  if constexpr (EPI == MMA_Y_RESNORM) {  // the tile's s² in the residual norm's order (rows past out_dim: 0)
    static_assert(NTB == 1, "the residual + norm epilogue: one column tile");
    if (threadIdx.x < (ROWS ? TPT * 16 : 32)) {  // whole warps; lanes 0-15 / 16-31 hold one token's tile each
      const float sq = tile_sumsq_lanes(s_row);
      const int t = ROWS ? tok0 + (int)(threadIdx.x >> 4) : 0;
      if (ROWS ? (threadIdx.x & 15) == 0 && t < num_rows : threadIdx.x == 0)
        reinterpret_cast<float*>(counter + RESNORM_SLOT0)[(ROWS ? (size_t)t * gridDim.x : 0) + tile] = sq;
    }
  }
  if constexpr (EPI == MMA_Y_GLU) {  // out_dim = 2F, F % 8 == 0: every tile is 8 gate rows then 8 up rows
    __syncthreads();
    const int width = out_dim / 2;
    for (int idx = threadIdx.x; idx < NTB * TPT * 8; idx += blockDim.x) {
      const int i = idx & 7, tt = idx >> 3, t = tok0 + tt;
      if (t >= num_rows) continue;
      const float v = silu_times(tot[tt][i], tot[tt][8 + i]);
      const int col = tile * 8 + i;
      if (kind) store_split(xs_out, t, col, width, v, kind);
      else y[(size_t)t * width + col] = v;
    }
  }
}

// The residual + norm tail (MMA_Y_RESNORM, T = num_rows rows), after each block's ticket: the last T · k (k = ceil(out
// / 256)) blocks to count norm the rows, block i (ticket n - T k + i, mod n) token i / k, columns 256 (i % k) + tid:
// those before the last wait (thread 0 polls the count with ld.acquire.gpu until all n blocks have counted, then a
// barrier: the ticket's pattern; the blocks that count later are running or will run, as the blocks before them have
// exited: at most T k - 1 blocks wait, and gemv.py launches this kernel only while T k ≤ min(n, 2 · SMs), each SM
// holding ≥ 2 of its blocks), each reads its column, its weight and its token's n tile slots (L2), sums the slots
// (thread t: slots t, t + 256, ... from 0, then block_sum: add_rms_norm's tile order, the same bits in every block and
// for any T), and writes its normed columns (norm_put). One memory round trip after the count, 1 column a thread.
// Spreading the norm over blocks replaces one last block norming the whole row alone (several round trips of serial
// work on one SM, and a register need that held back the main loop). Several rows (v2.10): the small verifies'
// residual adds and norms run here too instead of in add_rms_norm launches (128 a 27B verify).
// RESNORM_EPOCH 1: the count is a 64-bit total over launches, never reset (below). 0: a 32-bit count from zero that
// the norming blocks count themselves in again (counter[1]), the last of them resetting both, which keeps that
// block's exit waiting on one more atomic's round trip (kept for A/B).
#ifndef RESNORM_EPOCH
#define RESNORM_EPOCH 1
#endif
template <bool ROWS>
__device__ __forceinline__ void resnorm_tail(unsigned int* __restrict__ counter, const float* __restrict__ resid,
                                             const float* __restrict__ norm_w, int out_dim, int num_rows, float eps,
                                             int kind, u16* __restrict__ xs_out, float* __restrict__ y,
                                             float* __restrict__ normed_out) {
  __shared__ float nscratch[32];
  const unsigned int n = gridDim.x;
  const unsigned int kc = (unsigned int)(out_dim + NORM_THREADS - 1) / NORM_THREADS;
  const unsigned int k = ROWS ? kc * (unsigned int)num_rows : kc;
#if RESNORM_EPOCH
  // Counter words 0-1: one 64-bit count of the blocks done over every launch on this buffer (gemv.py keeps a buffer
  // per tile count n, so each launch adds exactly n): a block's place in its launch is its ticket mod n, and its launch
  // has counted once the count reaches the next multiple of n. Nothing is reset, so no block waits on a last atomic.
  unsigned long long* count = reinterpret_cast<unsigned long long*>(counter);
  const unsigned long long t64 = ticket_acq_rel(count);
  const unsigned int tk = (unsigned int)(t64 % n);
  const unsigned long long end = t64 - tk + n;
  if (tk < n - k) return;
  if (tk != n - 1) {
    if (threadIdx.x == 0) {
      unsigned long long seen;
      do {
        asm volatile("ld.acquire.gpu.u64 %0, [%1];" : "=l"(seen) : "l"(count) : "memory");
      } while (seen < end);
    }
    __syncthreads();
  }
#else
  const unsigned int tk = ticket_acq_rel(counter);
  if (tk < n - k) return;
  if (tk != n - 1) {
    if (threadIdx.x == 0) {
      unsigned int seen;
      do {
        asm volatile("ld.acquire.gpu.u32 %0, [%1];" : "=r"(seen) : "l"(counter) : "memory");
      } while (seen < n);
    }
    __syncthreads();
  }
#endif
  const unsigned int i = tk - (n - k);
  const int row = ROWS ? (int)(i / kc) : 0, c = (int)(ROWS ? i % kc : i) * NORM_THREADS + (int)threadIdx.x;
  float s = 0.0f, wv = 0.0f, ss = 0.0f;
  if (c < out_dim) {
    s = __ldcg(resid + (size_t)row * out_dim + c);
    wv = __ldg(norm_w + c);
  }
  const float* slots = reinterpret_cast<const float*>(counter + RESNORM_SLOT0) + (ROWS ? (size_t)row * n : 0);
  for (int j = threadIdx.x; j < (int)n; j += NORM_THREADS) ss = __fadd_rn(ss, __ldcg(slots + j));
  const float inv = 1.0f / sqrtf(block_sum(ss, nscratch) / (float)out_dim + eps);
  if (c < out_dim) norm_put(norm_value(s, inv, wv), c, out_dim, row, kind, xs_out, y, normed_out);
#if !RESNORM_EPOCH
  if (threadIdx.x == 0 && atomicAdd(counter + 1, 1u) == k - 1) {
    counter[0] = 0u;
    counter[1] = 0u;
  }
#endif
  trace_mark(3u);  // TANDEM_TRACE: a norming block done
}
// EPI_PREFETCH (NVFP4 one-tile kernels; the FP8 conv and residual + norm kernels): 0 off, 1 gemv_mma loads its
// epilogue's row scale and residual before the main loop (EpiPre), 2 also the conv's tail and weights. Then no memory
// round trip sits between a block's last MMA and its stores. Which kernels take it was decided by A/B timing
// (`python3 bench/decode.py --shapes 27b,9b --formats nvfp4,fp8 --rows '' --ttft 0`, docs/performance.md): NVFP4 all
// of it; FP8 the conv's early loads and, since resnorm_tail brought its residual + norm kernel to 64 registers, the
// early residual load; BF16 none (measured slower).
#ifndef EPI_PREFETCH
#define EPI_PREFETCH 2
#endif

template <int FMT, int NTB, int U, int EPI, bool PF, bool ROWS = false>
__device__ __forceinline__ void gemv_mma(GEMV_MMA_PARAMS) {
  constexpr int E = MmaFmt<FMT>::E, TPT = MmaFmt<FMT>::TPT;
  constexpr int XW = E / 2;  // u32 words of one part's k slice per lane per chunk (E halves)
  __shared__ float red[MMA_WARPS][NTB][16][9];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
  const int tok0 = blockIdx.y * NTB * TPT;
  const int num_chunks = in_dim / (4 * E);
  const int scale_cols = (in_dim + 127) / 128, rows8 = (out_dim + 7) / 8;
  const uint4 *wp0, *wp1;
  const int wstep = weight_ptrs<FMT>(w, blockIdx.x, g, c, in_dim, wp0, wp1);
  const u16* xrow[NTB];
  bool has[NTB];
  x_slots<FMT, NTB>(xs, tok0, g, c, in_dim, num_rows, xrow, has);
  const uint4* xb[NTB];  // the lane's E slots of chunk q: uint4 index q E / 2
#pragma unroll
  for (int j = 0; j < NTB; ++j) xb[j] = reinterpret_cast<const uint4*>(xrow[j]);
  float acc[NTB][4];
#pragma unroll
  for (int j = 0; j < NTB; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[j][e] = 0.0f;

  // One round: U chunks q0, q0 + 8, ... of this warp: weight vectors and their scales.
  auto load = [&](int q0, uint4 (&v0)[U], uint4 (&v1)[U], u32 (&sraw)[U][2], float (&fs)[U][2]) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int q = q0 + MMA_WARPS * u;
      if (q < num_chunks)
        load_chunk<FMT>(wp0, wp1, wstep, q, scale_ptr, blockIdx.x, g, c, in_dim, scale_cols, rows8, v0[u], v1[u],
                        sraw[u], fs[u]);
    }
  };
  auto compute = [&](int q0, const uint4 (&v0)[U], const uint4 (&v1)[U], const u32 (&sraw)[U][2],
                     const float (&fs)[U][2]) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int q = q0 + MMA_WARPS * u;
      if (q >= num_chunks) break;
      u32 bw[NTB][XW];
#pragma unroll
      for (int j = 0; j < NTB; ++j) {
#pragma unroll
        for (int e = 0; e < XW / 4; ++e) {
          const uint4 bv = has[j] ? __ldg(xb[j] + (size_t)q * (E / 2) + e) : make_uint4(0u, 0u, 0u, 0u);
          bw[j][4 * e] = bv.x; bw[j][4 * e + 1] = bv.y; bw[j][4 * e + 2] = bv.z; bw[j][4 * e + 3] = bv.w;
        }
      }
      mma_chunk<FMT, NTB>(v0[u], v1[u], sraw[u][0], sraw[u][1], fs[u][0], fs[u][1], bw, acc);
    }
  };

  uint4 v0[U], v1[U];
  u32 sraw[U][2];
  float fs[U][2];
  // The first round's weights are constants, so they go out before pdl_wait(): under a launch plan they overlap
  // the previous kernel's tail (common.cuh, PDL).
  load(warp, v0, v1, sraw, fs);
  // NVFP4 (and FP8's conv and residual): the epilogue's loads that need nothing computed go out here too
  // (EPI_PREFETCH), so they are not a memory round trip between the block's last MMA and its stores: thread idx < TPT ·
  // 16 is tile_epilogue's (row idx % 16, token idx / 16) of column tile 0. The row scale and conv weights are
  // constants; the residual (MMA_Y_RESNORM, its T rows) and the conv tail (MMA_Y_CONV, decode) are read through L2
  // under PDL rule 2 (common.cuh): the residual's last writer, the embedding or the previous residual + norm GEMV, and
  // the tail's, this projection at the previous token (or a prefill / commit scan, a cache restore), are never the
  // launch right before this one.
  EpiPre pre{};
  if constexpr (EPI_PREFETCH && NTB == 1 && (FMT == 2 || (FMT == 1 && (EPI == MMA_Y_CONV || EPI == MMA_Y_RESNORM)))) {
    const int o = blockIdx.x * 16 + (threadIdx.x & 15);
    if (threadIdx.x < TPT * 16 && tok0 + (int)(threadIdx.x >> 4) < num_rows && o < out_dim) {
      if constexpr (FMT == 2) pre.rs = __ldg(row_scale + o);
      if constexpr (EPI == MMA_Y_RESNORM)
        pre.rv = __ldcg(resid + (ROWS ? (size_t)(tok0 + (int)(threadIdx.x >> 4)) * out_dim : 0) + o);
      pre.valid = true;
      if constexpr (EPI_PREFETCH >= 2 && EPI == MMA_Y_CONV) {
        if (taps == 4 && o < conv_channels) {
#pragma unroll
          for (int j = 0; j < 3; ++j) pre.ct[j] = __ldcg(tail + (size_t)j * conv_channels + o);
#pragma unroll
          for (int j = 0; j < 4; ++j) pre.cw[j] = __ldg(conv_w + (size_t)o * 4 + j);
          pre.conv_pre = true;
        }
      }
    }
  }
  pdl_wait();
  pdl_launch_dependents();
  for (int q0 = warp; q0 < num_chunks; q0 += MMA_WARPS * U) {
    if constexpr (PF) {
      uint4 n0[U], n1[U];
      u32 nraw[U][2];
      float nfs[U][2];
      load(q0 + MMA_WARPS * U, n0, n1, nraw, nfs);
      compute(q0, v0, v1, sraw, fs);
#pragma unroll
      for (int u = 0; u < U; ++u) {
        v0[u] = n0[u]; v1[u] = n1[u];
        sraw[u][0] = nraw[u][0]; sraw[u][1] = nraw[u][1];
        fs[u][0] = nfs[u][0]; fs[u][1] = nfs[u][1];
      }
    } else {
      if (q0 != warp) load(q0, v0, v1, sraw, fs);
      compute(q0, v0, v1, sraw, fs);
    }
  }
  // partial sums -> shared memory: element (row, col) of tile j; col = 2c + (e & 1), row = g + 8 (e >> 1)
#pragma unroll
  for (int j = 0; j < NTB; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) red[warp][j][g + 8 * (e >> 1)][2 * c + (e & 1)] = acc[j][e];
  __syncthreads();
  // TANDEM_TRACE marks (bench/trace_step.py): every warp's main loop done (1), the epilogue's stores issued (2); the
  // residual + norm kernels only (their registers do not change with the marks; the conv kernel's grow past 64 and
  // lose a block an SM)
  if constexpr (EPI == MMA_Y_RESNORM) trace_mark(1u);
  tile_epilogue<FMT, NTB, EPI, ROWS>(red, blockIdx.x, tok0, GEMV_MMA_PASS, pre);
  if constexpr (EPI == MMA_Y_RESNORM) trace_mark(2u);
  // One release-acquire ticket (common.cuh ticket_acq_rel): this block's rows of resid and its slot are visible
  // before it counts itself done, and the norming blocks' reads come after.
  if constexpr (EPI == MMA_Y_RESNORM)
    resnorm_tail<ROWS>(counter, resid, norm_w, out_dim, num_rows, eps, kind, xs_out, y, normed_out);
}

template <int MT, int NTB>
__device__ __forceinline__ void zero_acc(float (&acc)[MT][NTB][4]) {
#pragma unroll
  for (int t = 0; t < MT; ++t)
#pragma unroll
    for (int j = 0; j < NTB; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[t][j][e] = 0.0f;
}

// One chunk of the wide kernels for a warp: MT row tiles' weight vectors (v0: row g, v1: row g + 8), their scale codes
// / block scales, and the B words of NTB column tiles, two k-steps at a time from bload(j, i2) (uint4: column tile j's
// words of MMAs i2 and i2 + 1), accumulated into acc[t][j] in mma_chunk's order for every (tile, column tile), so the
// bits are those of gemv_mma. gemv_mma_wide (B from L2) and gemv_mma_staged (B from shared memory) share it.
template <int FMT, int NTB, int MT, typename BLoad>
__device__ __forceinline__ void wide_chunk(const uint4 (&v0)[MT], const uint4 (&v1)[MT], const u32 (&sraw)[MT][2],
                                           const float (&fs)[MT][2], float (&acc)[MT][NTB][4], BLoad bload) {
  constexpr int MMAS = MmaFmt<FMT>::E / 4;
  u32 sc[MT][4];
#pragma unroll
  for (int t = 0; t < MT; ++t) scale_pairs<FMT>(sraw[t][0], sraw[t][1], sc[t]);
  float part[FMT == 1 ? MT : 1][FMT == 1 ? NTB : 1][4];  // FP8: the chunk's sums (the first MMA writes them)
#pragma unroll
  for (int i2 = 0; i2 < MMAS; i2 += 2) {  // B words of two k-steps (one 16-byte load a column tile)
    u32 b[NTB][4];
#pragma unroll
    for (int j = 0; j < NTB; ++j) {
      const uint4 bv = bload(j, i2);
      b[j][0] = bv.x; b[j][1] = bv.y; b[j][2] = bv.z; b[j][3] = bv.w;
    }
#pragma unroll
    for (int ii = 0; ii < 2; ++ii) {
      const int i = i2 + ii;
#pragma unroll
      for (int t = 0; t < MT; ++t) {
        u32 a[4];
        make_a<FMT>(i, v0[t], v1[t], sc[t], a);
#pragma unroll
        for (int j = 0; j < NTB; ++j) {
          const u32 b0 = b[j][2 * ii], b1 = b[j][2 * ii + 1];
          if constexpr (FMT == 0) mma_bf16(acc[t][j], a[0], a[1], a[2], a[3], b0, b1);
          else if constexpr (FMT == 1) {
            if (i == 0) mma_f16_c0(part[t][j], a[0], a[1], a[2], a[3], b0, b1);
            else mma_f16(part[t][j], a[0], a[1], a[2], a[3], b0, b1);
          }
          else mma_f16(acc[t][j], a[0], a[1], a[2], a[3], b0, b1);
        }
      }
    }
  }
  if constexpr (FMT == 1) {  // as mma_chunk
#pragma unroll
    for (int t = 0; t < MT; ++t) scale_chunk<NTB>(part[t], fs[t][0], fs[t][1], acc[t]);
  }
}

// The wide kernels' end: each of the MT tiles' warp partials through shared memory `red` into tile_epilogue.
// Holds barriers: every thread of the block calls it.
template <int FMT, int NTB, int MT, int EPI>
__device__ __forceinline__ void wide_store(const float (&acc)[MT][NTB][4], float (&red)[MMA_WARPS][NTB][16][9],
                                           int tile0, int tok0, GEMV_MMA_PARAMS) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
#pragma unroll
  for (int t = 0; t < MT; ++t) {
    if (t > 0) __syncthreads();  // the previous tile's sums are consumed
#pragma unroll
    for (int j = 0; j < NTB; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) red[warp][j][g + 8 * (e >> 1)][2 * c + (e & 1)] = acc[t][j][e];
    __syncthreads();
    if ((tile0 + t) * 16 < out_dim) tile_epilogue<FMT, NTB, EPI>(red, tile0 + t, tok0, GEMV_MMA_PASS);
  }
}

// Wide variant for verify rows (v2.4): one warp holds MT 16-row tiles (the block's 16 MT rows) and all NTB column
// tiles of its tokens, and for each MMA k-step loads each column tile's two B words once and feeds its MT tiles
// with them: x comes from L2 MT times less often than in gemv_mma, and with NTB = 8 a 32-token verify reads the
// weights once (gemv_mma's grid.y = 2 reads them twice). The chunk / warp split, each (row, column)'s sequence of
// MMAs and the epilogue (tile_epilogue) are gemv_mma's, so every row has the bits of the decode GEMV.
// Grid (ceil(out / (16 MT)), ceil(T / (NTB · TPT))), block 256. Epilogues: MMA_Y_F32, MMA_Y_GLU.
template <int FMT, int NTB, int MT, int EPI>
__device__ __forceinline__ void gemv_mma_wide(GEMV_MMA_PARAMS) {
  constexpr int E = MmaFmt<FMT>::E, TPT = MmaFmt<FMT>::TPT;
  __shared__ float red[MMA_WARPS][NTB][16][9];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
  const int tile0 = blockIdx.x * MT;
  const int tok0 = blockIdx.y * NTB * TPT;
  const int num_chunks = in_dim / (4 * E), last_tile = (out_dim - 1) / 16;
  const int scale_cols = (in_dim + 127) / 128, rows8 = (out_dim + 7) / 8;
  const uint4* wp0[MT];
  const uint4* wp1[MT];
  int wstep = 0;
#pragma unroll
  for (int t = 0; t < MT; ++t) {  // weights as gemv_mma reads them; tiles past the last one re-read it (unused)
    wstep = weight_ptrs<FMT>(w, min(tile0 + t, last_tile), g, c, in_dim, wp0[t], wp1[t]);
  }
  const u16* xrow[NTB];
  bool has[NTB];
  x_slots<FMT, NTB>(xs, tok0, g, c, in_dim, num_rows, xrow, has);
  const uint2* xb[NTB];  // the lane's E slots of chunk q, MMA i: uint2 index q E + i
#pragma unroll
  for (int j = 0; j < NTB; ++j) xb[j] = reinterpret_cast<const uint2*>(xrow[j]);
  float acc[MT][NTB][4];
  zero_acc(acc);

  uint4 v0[MT], v1[MT];
  u32 sraw[MT][2];
  float fs[MT][2];
  auto load = [&](int q) {
#pragma unroll
    for (int t = 0; t < MT; ++t)
      load_chunk<FMT>(wp0[t], wp1[t], wstep, q, scale_ptr, tile0 + t, g, c, in_dim, scale_cols, rows8,
                      v0[t], v1[t], sraw[t], fs[t]);
  };
  if (warp < num_chunks) load(warp);  // constant weights: before pdl_wait (common.cuh, PDL)
  pdl_wait();
  pdl_launch_dependents();
  for (int q = warp; q < num_chunks; q += MMA_WARPS) {
    if (q != warp) load(q);
    wide_chunk<FMT, NTB, MT>(v0, v1, sraw, fs, acc, [&](int j, int i2) {
      return has[j] ? __ldg(reinterpret_cast<const uint4*>(xb[j] + (size_t)q * E + i2)) : make_uint4(0u, 0u, 0u, 0u);
    });
  }
  wide_store<FMT, NTB, MT, EPI>(acc, red, tile0, tok0, GEMV_MMA_PASS);
}

// Kernel names: gemv_mma_<fmt>_w<MT>n<NTB>[_glu] (cuda/gemv.cu gemv_mma_wide; gemv.py picks them for verify rows).
#define GEMV_WIDE_KERNEL(WS, FMT, NTB, MT, EPI)                                                  \
  extern "C" __global__ void __launch_bounds__(256) gemv_mma_##WS(GEMV_MMA_PARAMS) {           \
    gemv_mma_wide<FMT, NTB, MT, EPI>(GEMV_MMA_PASS);                                           \
  }
#define GEMV_WIDE_FORMAT(FMT, F)                                     \
  GEMV_WIDE_KERNEL(F##_w1n8, FMT, 8, 1, MMA_Y_F32)                   \
  GEMV_WIDE_KERNEL(F##_w1n8_glu, FMT, 8, 1, MMA_Y_GLU)               \
  GEMV_WIDE_KERNEL(F##_w2n2, FMT, 2, 2, MMA_Y_F32)                   \
  GEMV_WIDE_KERNEL(F##_w2n2_glu, FMT, 2, 2, MMA_Y_GLU)               \
  GEMV_WIDE_KERNEL(F##_w2n4, FMT, 4, 2, MMA_Y_F32)                   \
  GEMV_WIDE_KERNEL(F##_w2n4_glu, FMT, 4, 2, MMA_Y_GLU)               \
  GEMV_WIDE_KERNEL(F##_w2n8, FMT, 8, 2, MMA_Y_F32)                   \
  GEMV_WIDE_KERNEL(F##_w2n8_glu, FMT, 8, 2, MMA_Y_GLU)               \
  GEMV_WIDE_KERNEL(F##_w4n2, FMT, 2, 4, MMA_Y_F32)                   \
  GEMV_WIDE_KERNEL(F##_w4n2_glu, FMT, 2, 4, MMA_Y_GLU)               \
  GEMV_WIDE_KERNEL(F##_w4n4, FMT, 4, 4, MMA_Y_F32)                   \
  GEMV_WIDE_KERNEL(F##_w4n4_glu, FMT, 4, 4, MMA_Y_GLU)

GEMV_WIDE_FORMAT(0, bf16)
GEMV_WIDE_FORMAT(1, fp8)
GEMV_WIDE_FORMAT(2, nvfp4)

// ============================================================================================================
// Staged verify kernels (v2.6, gemv_mma_staged): gemv_mma_wide's arithmetic (wide_chunk, wide_store: the same bits),
// with every global read of a chunk (the MT tiles' weight kilobytes, their scales, the NTB column tiles' x words)
// issued S - 1 chunks ahead as cp.async copies into a ring of S stages per warp in dynamic shared memory.
// Why: gemv_mma_wide holds ~240 registers, so one block fits an SM (2 warps a scheduler), and each warp waited on
// its weight loads and then on 4 rounds of x loads per chunk (far below the copy bandwidth at 32 rows). Here the loads of the next S - 1 chunks are in flight while a chunk's MMAs run, and take no registers.
// A warp's ring is its own (warp w still takes chunks w, w + 8, ...), so only __syncwarp orders it.
// Stage layout (bytes; gemv.py staged_smem_bytes mirrors it): weights [MT][1024] as stored (lane (g, c)'s vectors at
// 16 lane and 512 + 16 lane); x [NTB][32 lanes][PL] 16-byte pieces (PL = E / 8 a lane a chunk), piece i2 / 2 of lane
// L at position i2 / 2 ^ ((L / (8 / PL)) % PL), so that 8 lanes' 16-byte reads of one step hit 8 different bank
// groups; NVFP4 scale codes [MT][16 rows][4] u16; FP8 block scales [MT][2] fp32 (padded to 16 bytes).
// Grid (ceil(T / (NTB · TPT)), G ≤ ceil(out / (16 MT))): block (x, y) takes row blocks y, y + G, ... one after the
// other with the ring running on (persistent: the launcher picks G for about one wave), and the token blocks of one
// row block are neighbours, so the weights a second token block reads are still in L2. Block 256, dynamic shared
// memory 8 · S · stage bytes, plus the warp partials `red` (static).
// ============================================================================================================

// (smem_u32, cp_async16, cp_async_small, cp_async_commit, cp_async_wait: common.cuh.)
// 16 bytes of x through the L2-only path (cg) when `p`; else v keeps what it held (the warpgroup kernels' columns past
// the last token: an MMA column only feeds its own outputs, which the epilogue does not store).
__device__ __forceinline__ void ldg_cg_if(uint4& v, const void* ptr, bool p) {
  asm volatile("{\n.reg .pred q;\nsetp.ne.b32 q, %4, 0;\n@q ld.global.cg.v4.u32 {%0, %1, %2, %3}, [%5];\n}\n"
               : "+r"(v.x), "+r"(v.y), "+r"(v.z), "+r"(v.w)
               : "r"((int)p), "l"(ptr));
}

template <int FMT, int NTB, int MT>
struct StageLayout {
  enum {
    PL = MmaFmt<FMT>::E / 8,
    W = MT * 1024,
    X = NTB * 32 * PL * 16,
    SC = FMT == 2 ? MT * 128 : FMT == 1 ? (MT * 8 + 15) / 16 * 16 : 0,
    BYTES = W + X + SC,
  };
};

// One staged chunk for a warp: its MT tiles' weight vectors (w_st: tile t's kilobyte, the lane's 16 bytes at lane and
// 512 + lane) and scales (sc_st: NVFP4 [MT][16][4] u16 codes, FP8 [MT][2] fp32) and the x pieces (x_st: [NTB][32][PL]
// 16-byte pieces, swizzled) from shared memory into wide_chunk.
template <int FMT, int NTB, int MT>
__device__ __forceinline__ void staged_chunk(const unsigned char* w_st, const unsigned char* sc_st,
                                             const unsigned char* x_st, int lane, float (&acc)[MT][NTB][4]) {
  constexpr int PL = MmaFmt<FMT>::E / 8;
  const int swz = (lane / (8 / PL)) % PL;  // this lane's x piece swizzle
  uint4 v0[MT], v1[MT];
  u32 sraw[MT][2];
  float fs[MT][2];
#pragma unroll
  for (int t = 0; t < MT; ++t) {
    v0[t] = *reinterpret_cast<const uint4*>(w_st + t * 1024 + lane * 16);
    v1[t] = *reinterpret_cast<const uint4*>(w_st + t * 1024 + 512 + lane * 16);
    sraw[t][0] = sraw[t][1] = 0u;
    fs[t][0] = fs[t][1] = 0.0f;
    if constexpr (FMT == 2) {
      const u16* sc = reinterpret_cast<const u16*>(sc_st);
      sraw[t][0] = sc[(t * 16 + (lane >> 2)) * 4 + (lane & 3)];
      sraw[t][1] = sc[(t * 16 + (lane >> 2) + 8) * 4 + (lane & 3)];
    }
    if constexpr (FMT == 1) {
      const float* sc = reinterpret_cast<const float*>(sc_st);
      fs[t][0] = sc[2 * t];
      fs[t][1] = sc[2 * t + 1];
    }
  }
  const uint4* xst = reinterpret_cast<const uint4*>(x_st);
  wide_chunk<FMT, NTB, MT>(v0, v1, sraw, fs, acc,
                           [&](int j, int i2) { return xst[(j * 32 + lane) * PL + ((i2 / 2) ^ swz)]; });
}

template <int FMT, int NTB, int MT, int S, int EPI>
__device__ __forceinline__ void gemv_mma_staged(GEMV_MMA_PARAMS) {
  constexpr int E = MmaFmt<FMT>::E, P = MmaFmt<FMT>::P, TPT = MmaFmt<FMT>::TPT;
  using L = StageLayout<FMT, NTB, MT>;
  constexpr int PL = L::PL;
  extern __shared__ __align__(16) unsigned char stage_smem[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  {
    u32 have;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(have));
    if (have < (u32)(MMA_WARPS * S * L::BYTES)) __trap();  // the launcher's size must match StageLayout
  }
  // Row blocks blockIdx.y, blockIdx.y + gridDim.y, ... (the launcher sizes gridDim.y to about one wave): the ring
  // streams their chunks back to back, so the next row block's first copies are in flight during an epilogue.
  __shared__ float red[MMA_WARPS][NTB][16][9];
  const int tok0 = blockIdx.x * NTB * TPT;
  const int num_chunks = in_dim / (4 * E), last_tile = (out_dim - 1) / 16, row_blocks = last_tile / MT + 1;
  const int scale_cols = (in_dim + 127) / 128, rows8 = (out_dim + 7) / 8;
  const int nq = warp < num_chunks ? (num_chunks - 1 - warp) / MMA_WARPS + 1 : 0;  // this warp's chunks a row block
  const int nrb = blockIdx.y < row_blocks ? (row_blocks - 1 - blockIdx.y) / gridDim.y + 1 : 0;
  const int items = nq * nrb;  // the warp's chunk stream: row block major
  unsigned char* ring = stage_smem + (size_t)warp * S * L::BYTES;
  const u32 ring_s = smem_u32(ring);

  // Copies start from per-lane source pointers, set up at each row block and advanced by 8 chunks an issue (the
  // address arithmetic was ~40 % of the loop's instructions when recomputed a copy).
  // Weights: tile t's kilobyte of the chunk (the lane copies 16 bytes at lane and lane + 32).
  // NVFP4 scale codes: the lane copies rows lane, lane + 32, ... (< 16 MT) of the block, 8 bytes (4 u16) a row
  // (tile-major: a tile's 16 rows are 128 contiguous bytes of the chunk).
  // FP8 block scales: lane < 2 MT copies row-of-8 group 2 (tile0 + lane / 2) + lane % 2 at block column q / 2.
  constexpr int SCN = FMT == 2 ? (MT * 16 + 31) / 32 : 1;
  const uint4* wsrc[MT];
  const u16* ssrc[SCN];
  const float* fsrc;
  auto point_w = [&](int rb) {
    const int tile0 = rb * MT;
#pragma unroll
    for (int t = 0; t < MT; ++t) wsrc[t] = w + ((size_t)min(tile0 + t, last_tile) * num_chunks + warp) * 64 + lane;
#pragma unroll
    for (int k = 0; k < SCN; ++k)
      ssrc[k] = static_cast<const u16*>(scale_ptr) +
                ((size_t)min(tile0 + (lane + 32 * k) / 16, last_tile) * num_chunks + warp) * 64 +
                (lane + 32 * k) % 16 * 4;
    fsrc = static_cast<const float*>(scale_ptr) +
           (size_t)min(2 * tile0 + min(lane, 2 * MT - 1), rows8 - 1) * scale_cols + warp / 2;
  };
  // x: copy (j, m) (m < PL) fills units [32 m, 32 m + 32) of column tile j's 32 PL pieces, the lane unit 32 m + lane
  // (512 contiguous bytes a copy, no bank conflicts): lane slot ln = (32 m + lane) / PL, the piece of its slice
  // ip = lane % PL ^ swizzle, i.e. piece p = (ln % 4) PL + ip of row gg = ln / 4 = m (8 / PL) + g0. For PL <= 4 neither
  // p nor the swizzle depends on m, and row gg's xs row is the row of gg = g0 plus (j TPT + m (8 / PL) / P) P rows.
  // Rows past the last token (or past the parts, BF16) are zero-filled from the lane's first row.
  const int g0 = lane / (4 * PL);
  const int xp = ((lane / PL) % 4) * PL + ((lane % PL) ^ ((lane / 8) % PL));
  const u16* xbase =
      xs + ((size_t)min(tok0 + g0 / P, num_rows - 1) * P + g0 % P) * in_dim + (size_t)warp * 4 * E + xp * 8;
  const int xlim = g0 < TPT * P ? num_rows - tok0 - g0 / P : 0;  // copy (j, m) has data iff its token offset < xlim
  const u16* xsrc = xbase;
  int wq = 0, wrb = blockIdx.y, xq = 0;  // the next item's chunk index (of nq) and row block, for weights and for x
  point_w(wrb);
  // Weights and scales of the next item into stage s: constants, so they may go out before pdl_wait.
  auto issue_w = [&](int s) {
    const u32 base = ring_s + s * L::BYTES;
#pragma unroll
    for (int t = 0; t < MT; ++t) {
      cp_async16(base + t * 1024 + lane * 16, wsrc[t], true);
      cp_async16(base + t * 1024 + 512 + lane * 16, wsrc[t] + 32, true);
      wsrc[t] += MMA_WARPS * 64;
    }
    if constexpr (FMT == 2) {
#pragma unroll
      for (int k = 0; k < SCN; ++k) {
        if (lane + 32 * k < MT * 16) cp_async_small<8>(base + L::W + L::X + (lane + 32 * k) * 8, ssrc[k]);
        ssrc[k] += MMA_WARPS * 64;
      }
    }
    if constexpr (FMT == 1) {
      if (lane < 2 * MT) cp_async_small<4>(base + L::W + L::X + lane * 4, fsrc);
      fsrc += MMA_WARPS / 2;
    }
    if (++wq == nq) {
      wq = 0;
      wrb += gridDim.y;
      if (wrb < row_blocks) point_w(wrb);
    }
  };
  // x words of the next item into stage s (the same tokens for every row block).
  auto issue_x = [&](int s) {
    const u32 base = ring_s + s * L::BYTES + L::W + lane * 16;
#pragma unroll
    for (int j = 0; j < NTB; ++j)
#pragma unroll
      for (int m = 0; m < PL; ++m) {
        constexpr int DT = 8 / PL / P;  // tokens from one copy's rows to the next's (P = 2 for PL > 1)
        const bool has = j * TPT + m * DT < xlim;
        const u16* src = has ? xsrc + (size_t)((j * TPT + m * DT) * P) * in_dim : xsrc;
        cp_async16(base + (j * PL + m) * 512, src, has);
      }
    xsrc += MMA_WARPS * 4 * E;
    if (++xq == nq) {
      xq = 0;
      xsrc = xbase;
    }
  };

#pragma unroll
  for (int s = 0; s < S - 1; ++s)
    if (s < items) issue_w(s);
  pdl_wait();
  pdl_launch_dependents();
#pragma unroll
  for (int s = 0; s < S - 1; ++s) {  // one commit group a stage (the first also holds the early weights)
    if (s < items) issue_x(s);
    cp_async_commit();
  }
  int s = 0, item = 0;
  for (int rb = blockIdx.y; rb < row_blocks; rb += gridDim.y) {
    float acc[MT][NTB][4];
    zero_acc(acc);
    for (int k = 0; k < nq; ++k, ++item) {
      const int sn = (s + S - 1) % S;  // stage sn was read in the previous round
      if (item + S - 1 < items) {
        issue_w(sn);
        issue_x(sn);
      }
      cp_async_commit();
      cp_async_wait<S - 1>();  // this item's group is complete
      __syncwarp();
      const unsigned char* st = ring + s * L::BYTES;
      staged_chunk<FMT, NTB, MT>(st, st + L::W + L::X, st + L::W, lane, acc);
      __syncwarp();  // every lane has read stage s before the next round refills it
      s = (s + 1) % S;
    }
    wide_store<FMT, NTB, MT, EPI>(acc, red, rb * MT, tok0, GEMV_MMA_PASS);
    __syncthreads();  // `red` and the epilogue's shared memory are free for the next row block
  }
  cp_async_wait<0>();  // no copy outlives the block (groups past the last item are empty)
}

// Kernel names: gemv_mma_<fmt>_p<MT>n<NTB>s<S>[_glu] (gemv.py STAGED_VARIANTS; WIDE picks them for verify rows).
// Instances whose stages exceed the 227 KB of shared memory a block may have are not made (NVFP4 p2n8s2, p2n4s3).
#define GEMV_STAGED_KERNEL(PS, FMT, NTB, MT, S, EPI)                                           \
  extern "C" __global__ void __launch_bounds__(256) gemv_mma_##PS(GEMV_MMA_PARAMS) {         \
    gemv_mma_staged<FMT, NTB, MT, S, EPI>(GEMV_MMA_PASS);                                    \
  }
#define GEMV_STAGED_PAIR(F, FMT, MT, NTB, S)                                  \
  GEMV_STAGED_KERNEL(F##_p##MT##n##NTB##s##S, FMT, NTB, MT, S, MMA_Y_F32)    \
  GEMV_STAGED_KERNEL(F##_p##MT##n##NTB##s##S##_glu, FMT, NTB, MT, S, MMA_Y_GLU)
GEMV_STAGED_PAIR(bf16, 0, 4, 2, 2)
GEMV_STAGED_PAIR(bf16, 0, 4, 2, 3)
GEMV_STAGED_PAIR(bf16, 0, 2, 4, 2)
GEMV_STAGED_PAIR(bf16, 0, 2, 4, 3)
GEMV_STAGED_PAIR(bf16, 0, 4, 4, 2)
GEMV_STAGED_PAIR(bf16, 0, 4, 4, 3)
GEMV_STAGED_PAIR(bf16, 0, 2, 8, 2)
GEMV_STAGED_PAIR(bf16, 0, 2, 8, 3)
GEMV_STAGED_PAIR(fp8, 1, 4, 1, 3)
GEMV_STAGED_PAIR(fp8, 1, 4, 2, 2)
GEMV_STAGED_PAIR(fp8, 1, 4, 2, 3)
GEMV_STAGED_PAIR(fp8, 1, 2, 4, 2)
GEMV_STAGED_PAIR(fp8, 1, 2, 4, 3)
GEMV_STAGED_PAIR(fp8, 1, 4, 4, 2)
GEMV_STAGED_PAIR(fp8, 1, 4, 4, 3)
GEMV_STAGED_PAIR(fp8, 1, 2, 8, 2)
GEMV_STAGED_PAIR(nvfp4, 2, 4, 1, 2)
GEMV_STAGED_PAIR(nvfp4, 2, 4, 1, 3)
GEMV_STAGED_PAIR(nvfp4, 2, 4, 2, 2)
GEMV_STAGED_PAIR(nvfp4, 2, 4, 2, 3)
GEMV_STAGED_PAIR(nvfp4, 2, 2, 4, 2)
GEMV_STAGED_PAIR(nvfp4, 2, 4, 4, 2)
// NVFP4's 5-8-row verifies (gemv.py WIDE, WIDE_SMALL): fewer row tiles a warp, two blocks an SM. The FP8 instances
// of these shapes and the 3-stage forms were measured slower and are not built (docs/performance.md).
GEMV_STAGED_PAIR(nvfp4, 2, 2, 2, 2)
GEMV_STAGED_PAIR(nvfp4, 2, 1, 2, 2)

// ============================================================================================================
// Class-major verify kernels (v2.7; gemv_mma_wg below is the one built): all 8 warps of a block take the same chunk
// at once, each its own 16-row tile (128 rows a block), so one x stage serves the block and every weight is decoded
// once for all the block's tokens (the staged kernels split K by warp, as the decode GEMV: each warp needs x of its
// own chunks, and 32 tokens take two token blocks that decode every weight twice). The decode bits hold because only
// the order of a block's work changes, not any output's arithmetic: the chunks are visited class-major (class w = the
// chunks w, w + 8, ... that gemv_mma's warp w takes, in that order, each chain starting from zero through the same
// MMAs), and the class sums are folded in class order F = acc_0, F = F + acc_1, ..., F + acc_7 (classes without a
// chunk add zeros), as tile_epilogue adds its warps' partials; then hi + lo, the NVFP4 row scale, and the epilogue
// (fp32 y or silu(gate) · up), as tile_epilogue.
// Class groups (CG = `taps`: 1, 2, 4 or 8): block (x, y) takes row block y / CG and classes [8 (y % CG) / CG,
// 8 (y % CG + 1) / CG), so the small projections (out = 5120: 40 row blocks) still fill the device. With CG > 1 each
// class sum goes to the workspace `tail` [token blocks][row blocks][8 classes][8 warps][NTB][4][32] fp32; the block
// that finishes a row block last (ticket in counter[token block · row blocks + row block], reset by it) folds the 8
// class sums in order from the workspace and runs the epilogue. With CG = 1 the fold lives in shared memory.
// (An mma.sync version, x pieces in shared memory as the staged kernels', was no faster than the staged kernels:
// ~6 instructions an MMA, the tensor pipe 34 % busy; the wgmma version replaces it.)
// ============================================================================================================

// A lane's folded sums F [NTB][4] (element e of column tile j: row g + 8 (e >> 1), token 4 j + c, part e & 1) of
// 16-row tile `tile` -> the outputs, with tile_epilogue's arithmetic (hi + lo, NVFP4 row scale; glu: the tile's
// 8 gate rows then 8 up rows, so the lane holds gate row g and up row g in e = 0-1 and 2-3).
template <int FMT, int NTB, int EPI>
__device__ __forceinline__ void cm_epilogue(const float (&F)[NTB][4], int tile, int tok0, int g, int c,
                                            GEMV_MMA_PARAMS) {
  const int o0 = tile * 16 + g, o1 = o0 + 8;
#pragma unroll
  for (int j = 0; j < NTB; ++j) {
#ifdef TANDEM_X_ONE_PART  // bench/prefill_gemm.py's unconstrained variant: columns 2c, 2c + 1 are two tokens
#pragma unroll
   for (int u = 0; u < 2; ++u) {
    const int t = tok0 + 8 * j + 2 * c + u;
    if (t >= num_rows) continue;
    float tot0 = F[j][u], tot1 = F[j][2 + u];
#else
    const int t = tok0 + 4 * j + c;
    if (t >= num_rows) continue;
    float tot0 = __fadd_rn(F[j][0], F[j][1]), tot1 = __fadd_rn(F[j][2], F[j][3]);
#endif
    if constexpr (EPI == MMA_Y_GLU) {
      if constexpr (FMT == 2) {
        tot0 = __fmul_rn(tot0, __ldg(row_scale + o0));
        tot1 = __fmul_rn(tot1, __ldg(row_scale + o1));
      }
      const float v = silu_times(tot0, tot1);
      const int width = out_dim / 2, col = tile * 8 + g;
      if (kind) store_split(xs_out, t, col, width, v, kind);
      else y[(size_t)t * width + col] = v;
    } else {
      if (o0 < out_dim) {
        if constexpr (FMT == 2) tot0 = __fmul_rn(tot0, __ldg(row_scale + o0));
        y[(size_t)t * out_dim + o0] = tot0;
      }
      if (o1 < out_dim) {
        if constexpr (FMT == 2) tot1 = __fmul_rn(tot1, __ldg(row_scale + o1));
        y[(size_t)t * out_dim + o1] = tot1;
      }
    }
#ifdef TANDEM_X_ONE_PART
   }
#endif
  }
}

// ============================================================================================================
// Warpgroup verify kernels (v2.7, gemv_mma_wg; Hopper sm_90a only): the class-major block, order and fold, with the
// MMAs of a k-step issued as one wgmma.mma_async m64n(8 NTB)k16 per warpgroup (4 warps, 64 rows): A from the
// registers mma.sync would take (make_a, each warp its 16-row tile), B (x) from shared memory by descriptor, the
// accumulators in mma.sync's fragment layout. wgmma and mma.sync give the same bits for the same operands
// (checked on the device: 0 of 4.9 M outputs differ, exponent spreads 0-10), so the decode bits hold.
// Why: the class-major mma.sync kernel spent ~6 instructions an MMA (B fragments from shared memory, one mma.sync a
// column tile) and kept the tensor pipe 34 % busy (Nsight Compute, 27B gate|up at 32 rows); a wgmma does 8 n-tiles
// in one instruction and reads B itself.
// x stage: for each k-step i of the chunk, B [16 k][8 NTB n] as no-swizzle K-major core matrices (8 n × 16 bytes):
// (kb, nb) at kb · 128 NTB + nb · 128 bytes, k-step tiles 2 · 128 NTB + 16 bytes apart (the 16 spread the stores
// over the banks). Column n of the block is xs row (tok0 P + n): token tok0 + n / 2, part n % 2 (the MMA column
// tiles' order); the 16 k of step i are the slots lane c feeds at that step (c E + 4 i + s: k = 2 c + s for s < 2,
// 2 c + 6 + s else). x goes global -> registers -> shared memory (16 bytes a load, four 4-byte stores: the slots of
// one core-matrix row come from the four lanes' slices), one chunk ahead of the stage's weights.
// ============================================================================================================

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define TANDEM_WGMMA 1
#endif

template <int FMT, int NTB>
struct WgLayout {
  enum {
    MMAS = MmaFmt<FMT>::E / 4,
    TS = 2 * NTB * 128 + 16,  // one k-step's B tile, padded
    X = MMAS * TS,
    W = MMA_WARPS * 1024,
    SCW = FMT == 2 ? 128 : 16,
    STAGE = (X + W + MMA_WARPS * SCW + 127) / 128 * 128,
    FOLD = MMA_WARPS * NTB * 4 * 32 * 4,
    PIECES = (8 * NTB) * (MmaFmt<FMT>::E / 2) / 256,  // 16-byte x pieces a thread per chunk
  };
};

template <int NTB>
__device__ __forceinline__ void fence_acc(float (&d)[NTB][4]) {
#pragma unroll
  for (int j = 0; j < NTB; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(d[j][e])::"memory");
}

#ifdef TANDEM_WGMMA
// D [64, 8 NTB] += A [64, 16] (this warp's fragment, mma.sync's layout) · B (descriptor), asynchronous.
template <int NTB>
__device__ __forceinline__ void wgmma_f16(float (&d)[NTB][4], const u32 (&a)[4], unsigned long long desc);
template <>
__device__ __forceinline__ void wgmma_f16<8>(float (&d)[8][4], const u32 (&a)[4], unsigned long long desc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
      "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,"
      "%29,%30,%31}, {%32,%33,%34,%35}, %36, p, 1, 1, 0;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]),
        "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]),
        "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]),
        "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]),
        "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1));
}
template <>
__device__ __forceinline__ void wgmma_f16<4>(float (&d)[4][4], const u32 (&a)[4], unsigned long long desc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k16.f32.f16.f16 "
      "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}, {%16,%17,%18,%19}, %20, p, 1, 1, 0;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]),
        "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]),
        "+f"(d[3][2]), "+f"(d[3][3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1));
}

// One chunk's k-steps on accumulators d: a wgmma per step (A fragments a[i], B tile i of the stage at desc, tiles TS
// bytes apart), then the wait, before the next round refills a stage these MMAs may still read. (Waiting in the next
// round, after its copies, raced with them, and was no faster.)
template <int NTB, int MMAS, int TS>
__device__ __forceinline__ void wgmma_chunk(float (&d)[NTB][4], const u32 (&a)[MMAS][4], unsigned long long desc) {
  fence_acc(d);
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
  for (int i = 0; i < MMAS; ++i) wgmma_f16<NTB>(d, a[i], desc + (unsigned long long)((i * TS) >> 4));
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
  asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
  fence_acc(d);
}
#endif

template <int FMT, int NTB, int S, int EPI>
__device__ __forceinline__ void gemv_mma_wg(GEMV_MMA_PARAMS) {
#ifndef TANDEM_WGMMA
  __trap();  // built for a GPU without wgmma: gemv.py launches these on sm_90 only
#else
  static_assert(FMT != 0, "warpgroup kernels: P = 2 formats (FP8, NVFP4)");
  static_assert(S >= 2, "the x registers run one chunk ahead of the stages");
#ifdef TANDEM_X_ONE_PART  // bench/prefill_gemm.py only, never the engine: x as one fp16 part (wrong bits on purpose)
  constexpr int E = MmaFmt<FMT>::E, P = 1, TPT = 8;
#else
  constexpr int E = MmaFmt<FMT>::E, P = MmaFmt<FMT>::P, TPT = MmaFmt<FMT>::TPT;
#endif
  using L = WgLayout<FMT, NTB>;
  constexpr int MMAS = L::MMAS, PIECES = L::PIECES, PPR = E / 2;  // pieces a row of a chunk
  extern __shared__ __align__(16) unsigned char stage_smem[];
  const int cg_n = taps;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
  {
    u32 have;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(have));
    if (have < (u32)(S * L::STAGE + (cg_n == 1 ? L::FOLD : 0))) __trap();  // the launcher's size must match
  }
  const int tok0 = blockIdx.x * NTB * TPT;
  const int num_chunks = in_dim / (4 * E), last_tile = (out_dim - 1) / 16;
  const int row_blocks = last_tile / MMA_WARPS + 1;
  const int rb = blockIdx.y / cg_n, cg = blockIdx.y % cg_n;
  const int w_begin = MMA_WARPS * cg / cg_n, w_end = MMA_WARPS * (cg + 1) / cg_n;
  const int tile = rb * MMA_WARPS + warp, tile_c = min(tile, last_tile);
  const int scale_cols = (in_dim + 127) / 128, rows8 = (out_dim + 7) / 8;
  const u32 smem_s = smem_u32(stage_smem);
  float* fold = reinterpret_cast<float*>(stage_smem + S * L::STAGE) + warp * NTB * 4 * 32 + lane;

  const uint4* wsrc = w + (size_t)tile_c * num_chunks * 64 + lane;
  const u16* ssrc = static_cast<const u16*>(scale_ptr) + (size_t)tile_c * num_chunks * 64 + (lane & 15) * 4;
  const float* fsrc = static_cast<const float*>(scale_ptr) + (size_t)min(2 * tile_c + (lane & 1), rows8 - 1) *
                                                                 scale_cols;
  // x pieces of this thread: piece u = threadIdx.x + 256 u of the chunk's 8 NTB rows × PPR pieces: row n, piece p
  // (lane slice cc = p / (E / 8), half h = p % (E / 8): k-steps 2 h, 2 h + 1); its source row and its stores. The
  // columns of tokens past num_rows keep stale x (ldg_cg_if): a B column only feeds its own outputs, which are not
  // stored (v2.8; it was a zero fill, 16 moves a chunk: with the predicated loads 34 of FP8's 142 loop instructions).
  const uint4* xsrc[PIECES];
  int xoff[PIECES];
  bool xhas[PIECES];
  const int valid_cols = min(num_rows - tok0, NTB * TPT) * P;
#pragma unroll
  for (int u = 0; u < PIECES; ++u) {
    const int pi = threadIdx.x + 256 * u, n = pi / PPR, p = pi % PPR, cc = p / (E / 8), h = p % (E / 8);
    xhas[u] = n < valid_cols;
    xsrc[u] = reinterpret_cast<const uint4*>(xs + ((size_t)tok0 * P + min(n, valid_cols - 1)) * in_dim) + p;
    xoff[u] = 2 * h * L::TS + (n / 8) * 128 + (n % 8) * 16 + 4 * cc;  // word j: + (j / 2) TS + (j % 2) 128 NTB
  }
  uint4 xr[PIECES];
#pragma unroll
  for (int u = 0; u < PIECES; ++u) xr[u] = make_uint4(0u, 0u, 0u, 0u);  // defined before the first stale use
  auto load_x = [&](int q) {
#pragma unroll
    for (int u = 0; u < PIECES; ++u)
      ldg_cg_if(xr[u], xsrc[u] + (size_t)q * (E / 2), xhas[u]);
  };
  auto store_x = [&](int stage) {
    unsigned char* base = stage_smem + stage * L::STAGE;
#pragma unroll
    for (int u = 0; u < PIECES; ++u) {
      const u32 words[4] = {xr[u].x, xr[u].y, xr[u].z, xr[u].w};
#pragma unroll
      for (int j = 0; j < 4; ++j)
        *reinterpret_cast<u32*>(base + xoff[u] + (j / 2) * L::TS + (j % 2) * 128 * NTB) = words[j];
    }
  };
  auto issue_w = [&](int stage, int q) {
    const u32 base = smem_s + stage * L::STAGE;
    const u32 wb = base + L::X + warp * 1024 + lane * 16;
    cp_async16(wb, wsrc + (size_t)q * 64, true);
    cp_async16(wb + 512, wsrc + (size_t)q * 64 + 32, true);
    const u32 sb = base + L::X + L::W + warp * L::SCW;
    if constexpr (FMT == 2) {
      if (lane < 16) cp_async_small<8>(sb + lane * 8, ssrc + q * 64);
    }
    if constexpr (FMT == 1) {
      if (lane < 2) cp_async_small<4>(sb + lane * 4, fsrc + q / 2);
    }
  };
  // Two class-major cursors over this block's chunks: the weights / x stores (item r + S - 1 in round r) and the x
  // loads one item further. Past the group or the chunks: nothing left.
  int iw = w_begin, iq = w_begin, lw = w_begin, lq = w_begin;
  auto step = [&](int& cw, int& cq) {
    cq += MMA_WARPS;
    if (cq >= num_chunks) { ++cw; cq = cw; }
  };
  auto left = [&](int cw, int cq) { return cw < w_end && cq < num_chunks; };
  pdl_wait();
  pdl_launch_dependents();
#pragma unroll
  for (int s = 0; s < S - 1; ++s) {
    if (left(iw, iq)) {
      load_x(iq);
      store_x(s);
      issue_w(s, iq);
      step(iw, iq);
      step(lw, lq);
    }
    cp_async_commit();
  }
  if (left(lw, lq)) { load_x(lq); step(lw, lq); }
  // descriptor of stage 0's k-step 0 (start >> 4 in bits 0-13, LBO = 128 NTB bytes: kb, SBO = 128: nb)
  const unsigned long long desc0 = (unsigned long long)((smem_s & 0x3FFFF) >> 4) |
                                   ((unsigned long long)((128 * NTB) >> 4) << 16) | ((unsigned long long)(128 >> 4) << 32);
  int s = 0;
  float* ws = tail + ((size_t)(blockIdx.x * row_blocks + rb) * MMA_WARPS * MMA_WARPS + warp) * NTB * 4 * 32 + lane;
  for (int cw = w_begin; cw < w_end; ++cw) {
    float acc[NTB][4];
#pragma unroll
    for (int j = 0; j < NTB; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[j][e] = 0.0f;
    for (int q = cw; q < num_chunks; q += MMA_WARPS) {
      cp_async_wait<S - 2>();
      __syncthreads();  // stage s complete (every thread's stores and copies); stage s - 1 read by every warp
      const int sn = (s + S - 1) % S;
      if (left(iw, iq)) {
        store_x(sn);  // the registers hold item iq's x (the loads' cursor runs one item ahead)
        issue_w(sn, iq);
        step(iw, iq);
      }
      cp_async_commit();
      if (left(lw, lq)) { load_x(lq); step(lw, lq); }
      const unsigned char* st = stage_smem + s * L::STAGE;
      const uint4 v0 = *reinterpret_cast<const uint4*>(st + L::X + warp * 1024 + lane * 16);
      const uint4 v1 = *reinterpret_cast<const uint4*>(st + L::X + warp * 1024 + 512 + lane * 16);
      u32 sraw0 = 0u, sraw1 = 0u;
      float fs0 = 0.0f, fs1 = 0.0f;
      if constexpr (FMT == 2) {
        const u16* sc = reinterpret_cast<const u16*>(st + L::X + L::W + warp * L::SCW);
        sraw0 = sc[g * 4 + c];
        sraw1 = sc[(g + 8) * 4 + c];
      }
      if constexpr (FMT == 1) {
        const float* sc = reinterpret_cast<const float*>(st + L::X + L::W + warp * L::SCW);
        fs0 = sc[0];
        fs1 = sc[1];
      }
      u32 sc4[4];
      scale_pairs<FMT>(sraw0, sraw1, sc4);
      u32 a[MMAS][4];
#pragma unroll
      for (int i = 0; i < MMAS; ++i) make_a<FMT>(i, v0, v1, sc4, a[i]);
      const unsigned long long desc = desc0 + (unsigned long long)((s * L::STAGE) >> 4);
      if constexpr (FMT == 1) {  // the chunk's sums from zero (mma_f16_c0: C = +0), then the block scales
        float part[NTB][4];
#pragma unroll
        for (int j = 0; j < NTB; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) part[j][e] = 0.0f;
        wgmma_chunk<NTB, MMAS, L::TS>(part, a, desc);
        scale_chunk<NTB>(part, fs0, fs1, acc);
      } else {
        wgmma_chunk<NTB, MMAS, L::TS>(acc, a, desc);
      }
      s = (s + 1) % S;
    }
    if (cg_n == 1) {
#pragma unroll
      for (int j = 0; j < NTB; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float* f = fold + (j * 4 + e) * 32;
          *f = cw == 0 ? acc[j][e] : __fadd_rn(*f, acc[j][e]);
        }
    } else {
      float* wc = ws + (size_t)cw * MMA_WARPS * NTB * 4 * 32;
#pragma unroll
      for (int j = 0; j < NTB; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) __stcg(wc + (j * 4 + e) * 32, acc[j][e]);
    }
  }
  cp_async_wait<0>();
  float F[NTB][4];
  if (cg_n == 1) {
#pragma unroll
    for (int j = 0; j < NTB; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) F[j][e] = fold[(j * 4 + e) * 32];
  } else {
    unsigned int* cnt = counter + blockIdx.x * row_blocks + rb;
    if (ticket_acq_rel(cnt) != (unsigned)cg_n - 1) return;  // the class sums of the other blocks are visible
    if (threadIdx.x == 0) *cnt = 0u;
#pragma unroll
    for (int j = 0; j < NTB; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) F[j][e] = __ldcg(ws + (j * 4 + e) * 32);
    for (int cw = 1; cw < MMA_WARPS; ++cw) {
      const float* wc = ws + (size_t)cw * MMA_WARPS * NTB * 4 * 32;
#pragma unroll
      for (int j = 0; j < NTB; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) F[j][e] = __fadd_rn(F[j][e], __ldcg(wc + (j * 4 + e) * 32));
    }
  }
  if (tile * 16 < out_dim) cm_epilogue<FMT, NTB, EPI>(F, tile, tok0, g, c, GEMV_MMA_PASS);
#endif
}

// Kernel names: gemv_mma_<fmt>_wg<NTB>s<S>[_glu] (gemv.py CM_VARIANTS; sm_90 only).
#define GEMV_WG_KERNEL(GS, FMT, NTB, S, EPI)                                                    \
  extern "C" __global__ void __launch_bounds__(256, 2) gemv_mma_##GS(GEMV_MMA_PARAMS) {       \
    gemv_mma_wg<FMT, NTB, S, EPI>(GEMV_MMA_PASS);                                             \
  }
#define GEMV_WG_PAIR(F, FMT, NTB, S)                                 \
  GEMV_WG_KERNEL(F##_wg##NTB##s##S, FMT, NTB, S, MMA_Y_F32)          \
  GEMV_WG_KERNEL(F##_wg##NTB##s##S##_glu, FMT, NTB, S, MMA_Y_GLU)
GEMV_WG_PAIR(fp8, 1, 8, 3)
GEMV_WG_PAIR(fp8, 1, 8, 4)
GEMV_WG_PAIR(fp8, 1, 4, 4)
GEMV_WG_PAIR(nvfp4, 2, 8, 3)
GEMV_WG_PAIR(nvfp4, 2, 8, 4)
GEMV_WG_PAIR(nvfp4, 2, 4, 4)
// TANDEM_X_ONE_PART (off unless defined; bench/prefill_gemm.py compiles a module of its own with it): the warpgroup
// kernels take x as one fp16 operand, a B column a token (P = 1, 8 tokens a column tile) instead of hi + lo, so
// _wg4s3 does the MMAs of 32 tokens that _wg8s3 does with the split: the unconstrained kernel of the same shape that
// prices the decode-bits invariant (docs/performance.md, "What the invariant costs").
#ifdef TANDEM_X_ONE_PART
#define GEMV_WG_BENCH_PAIR(F, FMT, NTB, S) GEMV_WG_PAIR(F, FMT, NTB, S)  // not in gemv.py's CM_VARIANTS
GEMV_WG_BENCH_PAIR(fp8, 1, 4, 3)
GEMV_WG_BENCH_PAIR(nvfp4, 2, 4, 3)
#endif

// x [T, in] fp32 -> xs [T, P, in] in split `kind` (common.cuh store_split: fp16 hi, lo; NVFP4 slot order; or
// bf16 hi, mid, lo).
extern "C" __global__ void __launch_bounds__(256)
gemv_prep(const float* __restrict__ x, u16* __restrict__ xs, int num_rows, int in_dim, int kind) {
  PDL_ENTER
  const size_t n = (size_t)num_rows * in_dim;
  for (size_t idx = blockIdx.x * (size_t)blockDim.x + threadIdx.x; idx < n; idx += (size_t)gridDim.x * blockDim.x)
    store_split(xs, (int)(idx / in_dim), (int)(idx % in_dim), in_dim, x[idx], kind);
}

// Up to 4 column pieces of y [T, W] into C-contiguous dst_k [T, n_k] in one launch (a fused projection's output
// split into the pieces the next kernels take): piece k is columns [c_k, c_k+1) with c_0 = col0 and c_k+1 = end[k]
// (ends of unused pieces ≥ the last used end). Grid-stride over T · (end[npieces-1] - col0) elements.
extern "C" __global__ void __launch_bounds__(256)
gemv_split_cols(const float* __restrict__ y, int rows, int width, int col0, int npieces, int end0, int end1, int end2,
                int end3, float* __restrict__ d0, float* __restrict__ d1, float* __restrict__ d2,
                float* __restrict__ d3) {
  PDL_ENTER
  const int ends[4] = {end0, end1, end2, end3};
  const int span = ends[npieces - 1] - col0;
  const size_t total = (size_t)rows * span;
  for (size_t idx = blockIdx.x * (size_t)blockDim.x + threadIdx.x; idx < total; idx += (size_t)gridDim.x * blockDim.x) {
    const int r = (int)(idx / span), col = col0 + (int)(idx % span);
    const int k = (col >= end0) + (col >= end1) + (col >= end2);
    const int start = k == 0 ? col0 : ends[k - 1], n = ends[k] - start;
    float* dst = k == 0 ? d0 : k == 1 ? d1 : k == 2 ? d2 : d3;
    dst[(size_t)r * n + col - start] = y[(size_t)r * width + col];
  }
}


// Kernel names: gemv_mma_<fmt>_n<NTB> (fp32 y), ..._n<NTB>_glu (silu · mul epilogue), ..._n1_resnorm[_pf] (one row:
// residual add + the next RMSNorm in the last blocks; _pf: register prefetch, gemv.py RESNORM_PF), ..._n1_conv (one
// row: the GDN conv); tuning variants of the
// one-tile
// kernel: _u2, _u4, _u8 (chunks in flight per warp), _pf (registers for the next round). One parameter list.
// (Measured slower and removed: an L2 prefetch window 1-8 rounds ahead, register caps for 5-8 blocks an SM.)
// GEMV_GLU_MINB (0 in the engine: the plain bound; an explicit 1 costs registers): a measuring switch
// (TANDEM_CUDA_DEFINES) giving the one-tile GLU kernels __launch_bounds__(256, GEMV_GLU_MINB), min blocks an SM.
#ifndef GEMV_GLU_MINB
#define GEMV_GLU_MINB 0
#endif
#define GEMV_MINB_MMA_Y_F32 0
#define GEMV_MINB_MMA_Y_GLU GEMV_GLU_MINB
#define GEMV_MINB_MMA_Y_RESNORM 0
#define GEMV_MINB_MMA_Y_CONV 0
#define GEMV_MMA_KERNEL(FS, FMT, NTB, U, EPI, PF, ROWS)                                             \
  extern "C" __global__ void __launch_bounds__(256, GEMV_MINB_##EPI) gemv_mma_##FS(GEMV_MMA_PARAMS) { \
    gemv_mma<FMT, NTB, U, EPI, PF, ROWS>(GEMV_MMA_PASS);                                    \
  }
#define GEMV_MMA_FORMAT(FMT, F)                                                                     \
  GEMV_MMA_KERNEL(F##_n1, FMT, 1, MMA_U, MMA_Y_F32, false, false)                      \
  GEMV_MMA_KERNEL(F##_n2, FMT, 2, MMA_U, MMA_Y_F32, false, false)                      \
  GEMV_MMA_KERNEL(F##_n4, FMT, 4, MMA_U, MMA_Y_F32, false, false)                      \
  GEMV_MMA_KERNEL(F##_n1_glu, FMT, 1, MMA_U, MMA_Y_GLU, false, false)                  \
  GEMV_MMA_KERNEL(F##_n2_glu, FMT, 2, MMA_U, MMA_Y_GLU, false, false)                  \
  GEMV_MMA_KERNEL(F##_n4_glu, FMT, 4, MMA_U, MMA_Y_GLU, false, false)                  \
  GEMV_MMA_KERNEL(F##_n1_resnorm, FMT, 1, MMA_U, MMA_Y_RESNORM, false, false)          \
  GEMV_MMA_KERNEL(F##_n1_resnorm_pf, FMT, 1, MMA_U, MMA_Y_RESNORM, true, false)        \
  GEMV_MMA_KERNEL(F##_n1_resnorm_rows, FMT, 1, MMA_U, MMA_Y_RESNORM, false, true)      \
  GEMV_MMA_KERNEL(F##_n1_resnorm_rows_pf, FMT, 1, MMA_U, MMA_Y_RESNORM, true, true)    \
  GEMV_MMA_KERNEL(F##_n1_conv, FMT, 1, MMA_U, MMA_Y_CONV, false, false)                \
  GEMV_MMA_KERNEL(F##_n1_u2, FMT, 1, 2, MMA_Y_F32, false, false)                                    \
  GEMV_MMA_KERNEL(F##_n1_u4, FMT, 1, 4, MMA_Y_F32, false, false)                                    \
  GEMV_MMA_KERNEL(F##_n1_u8, FMT, 1, 8, MMA_Y_F32, false, false)                                    \
  GEMV_MMA_KERNEL(F##_n1_pf, FMT, 1, MMA_U, MMA_Y_F32, true, false)

GEMV_MMA_FORMAT(0, bf16)
GEMV_MMA_FORMAT(1, fp8)
GEMV_MMA_FORMAT(2, nvfp4)

// ============================================================================================================
// Routed experts (MoE, tandem/backend/cuda/moe.py): gemv_mma over one expert's weights, the expert chosen on the
// device. The weight is every expert's [R, in] stacked into one Linear [X·R, in] (gemv.concat / gemv.glu_pair: each
// expert's 16-row tiles, FP8 scale rows and NVFP4 scale tiles contiguous, R % 16 == 0), so expert e's storage starts
// w_stride uint4 (codes), s_stride elements (FP8 scale rows / NVFP4 scale codes) and e · R row scales in. The
// operand xs and the output hold one row per (token, expert) pair in the route's sorted order (cuda/moe.cu
// moe_route: by expert, then token), so the tokens of one expert are consecutive: route[p] the expert of row p,
// route[n + p] / route[2n + p] the first / one past the last row of that expert. Grid (ceil(R / 16), 1, n), block
// 256: block z = p runs iff p starts a tile of its expert (p - first a multiple of NTB · TPT), over rows p ..
// min(last, p + NTB · TPT) - 1 of xs, through gemv_mma itself (its blockIdx.y is 0: tok0 = 0 on the offset
// pointers), so each expert's weights are read once for up to NTB · TPT of its tokens, and a row's bits are those of
// the one-row kernel whatever rows and experts the launch holds (the same chunk, warp and part order; an MMA
// column's result does not depend on the other columns). out_row: elements of one output row (y fp32: R; the GLU's
// operand xs_out: P' · R / 2). The route is the previous kernels' output: the kernel reads it after pdl_wait (so its
// first weight loads do not overlap the previous kernel, unlike gemv_mma's).
template <int FMT, int NTB, int EPI>
__device__ __forceinline__ void gemv_mma_moe(GEMV_MMA_PARAMS, const int* __restrict__ route, int n,
                                             long long w_stride, long long s_stride, long long out_row) {
  constexpr int P = MmaFmt<FMT>::P, TPT = MmaFmt<FMT>::TPT;
  const int p = blockIdx.z;
  const int e = route[p], first = route[n + p], last = route[2 * n + p];
  if ((p - first) % (NTB * TPT) != 0) return;
  const int rows = min(last - p, NTB * TPT);
  const uint4* we = w + (size_t)e * w_stride;
  const void* se = scale_ptr;
  if constexpr (FMT == 1) se = static_cast<const float*>(scale_ptr) + (size_t)e * s_stride;
  if constexpr (FMT == 2) se = static_cast<const u16*>(scale_ptr) + (size_t)e * s_stride;
  const float* re = FMT == 2 ? row_scale + (size_t)e * out_dim : row_scale;
  const u16* xe = xs + (size_t)p * P * in_dim;
  float* ye = y ? y + (size_t)p * out_row : y;
  u16* xo = xs_out ? xs_out + (size_t)p * out_row : xs_out;
  gemv_mma<FMT, NTB, MMA_U, EPI, false>(we, se, re, xe, ye, out_dim, in_dim, rows, resid, norm_w, normed_out, eps, xo,
                                        kind, counter, tail, conv_w, conv_channels, taps);
}

// Kernel names: gemv_mma_<fmt>_moe_n<NTB>[_glu] (NTB 1: a decode's rows; 4: a verify's, up to 4 · TPT tokens of one
// expert a block; the same bits).
#define GEMV_MOE_KERNEL(MS, FMT, NTB, EPI)                                                                       \
  extern "C" __global__ void __launch_bounds__(256) gemv_mma_##MS(GEMV_MMA_PARAMS, const int* __restrict__ route, \
                                                                  int n, long long w_stride, long long s_stride, \
                                                                  long long out_row) {                           \
    pdl_wait();                                                                                                  \
    gemv_mma_moe<FMT, NTB, EPI>(GEMV_MMA_PASS, route, n, w_stride, s_stride, out_row);                           \
  }
#define GEMV_MOE_FORMAT(FMT, F)                              \
  GEMV_MOE_KERNEL(F##_moe_n1, FMT, 1, MMA_Y_F32)             \
  GEMV_MOE_KERNEL(F##_moe_n4, FMT, 4, MMA_Y_F32)             \
  GEMV_MOE_KERNEL(F##_moe_n1_glu, FMT, 1, MMA_Y_GLU)         \
  GEMV_MOE_KERNEL(F##_moe_n4_glu, FMT, 4, MMA_Y_GLU)

GEMV_MOE_FORMAT(0, bf16)
GEMV_MOE_FORMAT(1, fp8)
GEMV_MOE_FORMAT(2, nvfp4)
