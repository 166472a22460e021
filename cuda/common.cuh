// common.cuh: device helpers shared by the kernels, inlined by the loader (tandem/backend/cuda/loader.py)
// in place of `#include "common.cuh"`, so the source hash that keys the compile cache covers them.
//
// Decoders widen stored weight bits to float32 exactly (the NumPy tables in tandem/dtypes.py are the reference).
// Reductions run in a fixed order that depends only on blockDim, never on the data or on how many rows a launch
// holds (DESIGN.md, "matrix rows").
// History: v1 bf16 / e4m3 / e2m1 decoders, warp and block sums; v2 the GEMV operand split (store_split); v3 the
// RMSNorm and SiLU·mul arithmetic shared by their kernels and the GEMV's epilogues (norm_row, silu_times); v4
// programmatic dependent launch (pdl_wait); v5 norm_row holds a short row in registers (one round trip); v6 the
// release-acquire block ticket (ticket_acq_rel), PDL rule 2 (early reads), the GDN run order (GDN_RUN); v7 split
// kind 4 (one bf16: the prefill GEMMs' operand).

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;

#define TANDEM_NAN __uint_as_float(0x7FC00000u)
#define TANDEM_NEG_INF __uint_as_float(0xFF800000u)

// bfloat16 bits (in the low 16 bits of `bits`) -> float32: the top half of a float32.
__device__ __forceinline__ float bf16_lo(u32 bits) { return __uint_as_float(bits << 16); }
__device__ __forceinline__ float bf16_hi(u32 bits) { return __uint_as_float(bits & 0xFFFF0000u); }

// float8_e4m3fn code -> float32 (spec §9): normals by moving the fields, subnormals m * 2^-9, S.1111.111 = NaN.
__device__ __forceinline__ float e4m3_to_f32(u32 c) {
  u32 em = c & 0x7Fu;
  float v = em >= 8u ? __uint_as_float((em + 960u) << 20) : (float)em * 0.001953125f;
  if (em == 0x7Fu) v = TANDEM_NAN;
  return __uint_as_float(__float_as_uint(v) | ((c & 0x80u) << 24));
}

// E2M1 nibble -> float32 (spec §10.1): bit 3 sign; magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6.
__device__ __forceinline__ float e2m1_to_f32(u32 n) {
  u32 em = n & 7u;
  float v = em >= 2u ? __uint_as_float((em + 252u) << 22) : (float)em * 0.5f;
  return __uint_as_float(__float_as_uint(v) | ((n & 8u) << 28));
}

// Butterfly sum over a full warp: every lane ends with the same bits (fp add is commutative).
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, m);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) v = fmaxf(v, __shfl_xor_sync(0xFFFFFFFFu, v, m));
  return v;
}

// Sum over the block (blockDim a multiple of 32, at most 1024); every thread gets the result.
// scratch: 32 floats of shared memory, reusable right after the call returns in every thread.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
  v = warp_sum(v);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, num_warps = blockDim.x >> 5;
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float t = lane < num_warps ? scratch[lane] : 0.0f;
  return warp_sum(t);
}

// ---- programmatic dependent launch (PDL, sm_90+) --------------------------------------------------------------
// A launch plan (tandem/backend/cuda/plan.py) issues its kernels with CUDA's programmatic stream serialization,
// so a kernel may start while the one before it on the stream is still running. pdl_wait() blocks until every
// earlier kernel of the stream has finished and its writes are visible; pdl_launch_dependents() lets the next
// kernel start. Both are no-ops for an ordinary launch and before sm_90. Rules for every kernel:
// 1. Nothing before pdl_wait() writes global memory, and every kernel waits before it lets the next one start
//    (pdl_wait, then pdl_launch_dependents; PDL_ENTER: both, at the top of a kernel).
// 2. Before pdl_wait() a kernel may read constants (cuda/gemv.cu loads its first weights there) and data whose last
//    writer (kernel or copy) comes before the launch right before this one in the stream, through L2 (__ldcg: L1
//    is not coherent). Why that is safe: this kernel starts only once its predecessor has called
//    pdl_launch_dependents, hence passed its own pdl_wait, so everything before the predecessor has finished and
//    its writes are visible. What the predecessor writes is not readable until pdl_wait (gdn_seq.cu
//    gdn_decode_head reads its recurrent state early, which the kernel before it, the in-projection, never
//    writes, and gdn_seq_scan its entry state, after gdn_seq_prep or another layer's commit; attention_tree.cu
//    tree_partial the KV cache rows, after attn_prep_rows, which writes the node scratch; cuda/gemv.cu's NVFP4
//    one-row GEMVs read the residual and the conv tail early, EPI_PREFETCH).
// ---- step tracer (TANDEM_TRACE, off by default; bench/trace_step.py) ------------------------------------------
// With TANDEM_TRACE defined (TANDEM_CUDA_DEFINES="TANDEM_TRACE" in the environment, loader.nvrtc_options), thread 0 of
// a grid's first and last TRACE_EDGE blocks records %globaltimer around its pdl_wait() (kind 0: t0 before, t1 after)
// and, where a kernel calls trace_mark(kind) (kinds 1-3), that point (t0 = t1). Each record (40 bytes) goes to a fixed
// slot, ((gridid mod TRACE_GRIDS) · 2 TRACE_EDGE + edge block) · 4 + kind, of tandem_trace_buf (the host sets the
// pointer through the module's global): no atomics, one store, so the traced kernels keep their timing within the
// cost of a clock read and a store. %gridid numbers the launches in launch order; the host checks that no two
// launches of a trace share a slot. The records carry the grid's shape, so the host can line them up with a launch
// plan's launches. It changes no arithmetic; a measuring aid, never on in the engine.
#ifdef TANDEM_TRACE
#define TRACE_EDGE 264
#define TRACE_GRIDS 4093
struct TraceRec {
  unsigned long long grid, t0, t1, shape, who;
};
__device__ TraceRec* tandem_trace_buf;
__device__ __forceinline__ unsigned long long trace_now() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ void trace_put(unsigned long long t0, unsigned long long t1, unsigned int kind) {
  const unsigned int nb = gridDim.x * gridDim.y * gridDim.z;
  const unsigned int b = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  if (threadIdx.x + threadIdx.y + threadIdx.z != 0 || tandem_trace_buf == nullptr) return;
  unsigned int eb;
  if (b < TRACE_EDGE) eb = b;
  else if (b + TRACE_EDGE >= nb) eb = TRACE_EDGE + (b + TRACE_EDGE - nb);
  else return;
  unsigned long long grid;
  unsigned int sm;
  asm volatile("mov.u64 %0, %%gridid;" : "=l"(grid));
  asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
  TraceRec r;
  r.grid = grid;
  r.t0 = t0;
  r.t1 = t1;
  r.shape = (unsigned long long)gridDim.x | ((unsigned long long)gridDim.y << 24) |
            ((unsigned long long)(blockDim.x * blockDim.y * blockDim.z) << 40);
  r.who = (unsigned long long)b | ((unsigned long long)sm << 32) | ((unsigned long long)kind << 48);
  tandem_trace_buf[((size_t)(grid % TRACE_GRIDS) * (2 * TRACE_EDGE) + eb) * 4 + (kind & 3u)] = r;
}
__device__ __forceinline__ void trace_mark(unsigned int kind) {
  if (threadIdx.x + threadIdx.y + threadIdx.z != 0) return;  // the clock read in thread 0 only
  const unsigned long long t = trace_now();
  trace_put(t, t, kind);
}
#else
__device__ __forceinline__ void trace_mark(unsigned int) {}
#endif

__device__ __forceinline__ void pdl_wait() {
#ifdef TANDEM_TRACE
  const bool first = threadIdx.x + threadIdx.y + threadIdx.z == 0;
  const unsigned long long t0 = first ? trace_now() : 0ull;
#endif
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
#ifdef TANDEM_TRACE
  if (first) trace_put(t0, trace_now(), 0u);
#endif
}
__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
// A block's ticket: after a barrier, thread 0 adds 1 to *counter with one atom.acq_rel.gpu (release: every
// thread's earlier writes, ordered before it by the barrier, are visible device-wide before the count; acquire: the
// block's later reads see what the blocks counted before it wrote), and every thread gets the old value. The
// pattern of CUTLASS's arrive / wait barrier (a barrier, then one thread's fenced atomic); it replaced a
// __threadfence in every thread on both sides of a relaxed atomicAdd (faster in `python3 bench/ab_decode.py`).
// Holds barriers: every thread of the block calls it.
// T: unsigned int, or unsigned long long for a count that is never reset (cuda/gemv.cu resnorm_tail, RESNORM_EPOCH:
// every launch adds exactly its block count, so a ticket modulo that count is the block's place in its own launch).
template <typename T>
__device__ __forceinline__ T ticket_acq_rel(T* counter) {
  static_assert(sizeof(T) == 4 || sizeof(T) == 8, "a 32- or 64-bit count");
  __shared__ T ticket;
  __syncthreads();
  if (threadIdx.x == 0) {
    if constexpr (sizeof(T) == 4)
      asm volatile("atom.acq_rel.gpu.add.u32 %0, [%1], 1;" : "=r"(ticket) : "l"(counter) : "memory");
    else
      asm volatile("atom.acq_rel.gpu.add.u64 %0, [%1], 1;" : "=l"(ticket) : "l"(counter) : "memory");
  }
  __syncthreads();
  return ticket;
}
#define PDL_ENTER \
  pdl_wait();     \
  pdl_launch_dependents();

// ---- asynchronous copies to shared memory (cp.async, sm_80+; cuda/gemv.cu's rings, attention_tree.cu's tiles) -----
__device__ __forceinline__ u32 smem_u32(const void* p) { return (u32)__cvta_generic_to_shared(p); }
// 16 bytes global -> shared, L2 only; `fill` false writes 16 zero bytes and reads nothing.
__device__ __forceinline__ void cp_async16(u32 dst, const void* src, bool fill) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(fill ? 16 : 0) : "memory");
}
// 4 or 8 bytes global -> shared (cp.async.ca: the only form below 16 bytes).
template <int N>
__device__ __forceinline__ void cp_async_small(u32 dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], %2;\n" ::"r"(dst), "l"(src), "n"(N) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }

// ---- the Gated DeltaNet state column's dot products (gdn_step.cu, gdn_seq.cu): one order for every kernel ------
// Σ_i S[i, col] · x[i] over a column's dk rows: fma chains over runs of GDN_RUN consecutive rows, each from zero,
// then a pairwise tree over the runs in row order (adjacent pairs added level by level, an odd last run carried up):
// ((c0 + c1) + (c2 + c3)) at dk = 128. Independent runs shorten the dependent fma chains of each node visit
// (one chain over all rows was the slower form); gdn_seq.cu's scan lanes hold 2 runs each and add the lanes' sums by an xor shuffle, the same tree.
#define GDN_RUN 32

// The pairwise tree, computed online: push run sums in order; merge the top two while they cover equal row counts;
// at the end fold from the top (total()). The stack holds at most floor(log2 runs) + 1 entries, so up to
// 2^(GDN_TREE_DEPTH + 1) - 1 runs: 8 covers every dk gdn_step.cu can launch (its k and q take 2 dk floats of the
// 48 KB of shared memory: dk <= 6144, 192 runs; 6 held dk < 4096).
#define GDN_TREE_DEPTH 8
struct GdnRunTree {
  float sum[GDN_TREE_DEPTH + 1];
  int size[GDN_TREE_DEPTH + 1];
  int top = 0;
  __device__ __forceinline__ void push(float v) {
    float x = v;
    int n = 1;
    while (top > 0 && size[top - 1] == n) {
      x = __fadd_rn(sum[top - 1], x);
      n *= 2;
      --top;
    }
    sum[top] = x;
    size[top] = n;
    ++top;
  }
  __device__ __forceinline__ float total() const {
    if (top == 0) return 0.0f;
    float x = sum[top - 1];
    for (int i = top - 2; i >= 0; --i) x = __fadd_rn(sum[i], x);
    return x;
  }
};

// ---- the v2 GEMV's B operand (cuda/gemv.cu): x split into parts, written by its producers -----------------
__device__ __forceinline__ u16 f32_to_f16_bits(float v) {
  u16 r;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(v));
  return r;
}

__device__ __forceinline__ float f16_bits_to_f32(u16 h) {
  float r;
  asm("cvt.f32.f16 %0, %1;" : "=f"(r) : "h"(h));
  return r;
}

__device__ __forceinline__ u16 f32_to_bf16_bits(float v) {
  u16 r;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(v));
  return r;
}

// Split kinds: 0 none (plain fp32 output), 1 fp16 hi + lo, 2 the same in NVFP4 slot order, 3 bf16 hi + mid + lo,
// 4 one bf16 (round to nearest even): the prefill GEMMs' operand (cuda/prefill_gemm.cu).
#define SPLIT_NONE 0
#define SPLIT_F16 1
#define SPLIT_F16_PERM 2
#define SPLIT_BF16 3
#define SPLIT_B16 4

// Slot (0..31) that holds element e of a 32-element NVFP4 segment: the inverse of gemv.cu's nvfp4_perm.
__device__ __forceinline__ int nvfp4_slot(int e) {
  const int a = e >> 3, r8 = e & 7, b = (r8 >> 1) & 1, r = r8 - 2 * b;  // r in {0, 1, 4, 5}
  const int s = r == 0 ? 0 : r == 4 ? 1 : r == 1 ? 2 : 3;
  return 4 * (2 * a + b) + s;
}

// Write element j of row t of x (value v) into xs [T, P, in] in split `kind` (1..4).
__device__ __forceinline__ void store_split(u16* __restrict__ xs, int t, int j, int in_dim, float v, int kind) {
  if (kind == SPLIT_B16) {
    xs[(size_t)t * in_dim + j] = f32_to_bf16_bits(v);
  } else if (kind == SPLIT_BF16) {
    const u16 hi = f32_to_bf16_bits(v);
    const float r1 = __fsub_rn(v, bf16_lo(hi));
    const u16 mid = f32_to_bf16_bits(r1);
    u16* row = xs + (size_t)t * 3 * in_dim;
    row[j] = hi;
    row[in_dim + j] = mid;
    row[2 * in_dim + j] = f32_to_bf16_bits(__fsub_rn(r1, bf16_lo(mid)));
  } else {
    const int pos = kind == SPLIT_F16_PERM ? (j & ~31) + nvfp4_slot(j & 31) : j;
    const u16 hi = f32_to_f16_bits(v);
    u16* row = xs + (size_t)t * 2 * in_dim;
    row[pos] = hi;
    row[in_dim + pos] = f32_to_f16_bits(__fsub_rn(v, f16_bits_to_f32(hi)));
  }
}

// ---- arithmetic shared by a kernel and the GEMV that fuses it (cuda/gemv.cu), so both give the same bits -----

// One decode token's causal conv + SiLU of channel c (gdn_seq_prep's conv_silu: products and sums rounded in tap
// order, oldest first, window [tail rows 0..K-2, now]), then the channel's tail column shifts up a row in place
// (only the caller touches column c). taps ≥ 2. Used by gdn_seq.cu gdn_decode_conv (which gdn_step.py launches
// too) and the GEMV's conv epilogue.
__device__ __forceinline__ float conv_silu_shift(float* __restrict__ tail, const float* __restrict__ conv_w,
                                                 int channels, int taps, int c, float now) {
  const float* w = conv_w + (size_t)c * taps;
  float acc = __fmul_rn(tail[c], w[0]);
  for (int j = 1; j < taps; ++j) {
    const float xj = j + 1 < taps ? tail[(size_t)j * channels + c] : now;
    acc = __fadd_rn(acc, __fmul_rn(xj, w[j]));
  }
  for (int i = 0; i + 2 < taps; ++i) tail[(size_t)i * channels + c] = tail[(size_t)(i + 1) * channels + c];
  tail[(size_t)(taps - 2) * channels + c] = now;
  return __fdiv_rn(acc, __fadd_rn(1.0f, expf(-acc)));
}
// conv_silu_shift for 4 taps with the column's tail values t[0..2] and weights w[0..3] already loaded (the GEMV's
// conv epilogue loads them before its main loop): the same arithmetic, so the same bits.
__device__ __forceinline__ float conv4_silu_shift(float* __restrict__ tail, int channels, int c, const float (&t)[3],
                                                  const float (&w)[4], float now) {
  float acc = __fmul_rn(t[0], w[0]);
  acc = __fadd_rn(acc, __fmul_rn(t[1], w[1]));
  acc = __fadd_rn(acc, __fmul_rn(t[2], w[2]));
  acc = __fadd_rn(acc, __fmul_rn(now, w[3]));
  tail[c] = t[1];
  tail[(size_t)channels + c] = t[2];
  tail[(size_t)2 * channels + c] = now;
  return __fdiv_rn(acc, __fadd_rn(1.0f, expf(-acc)));
}
// RMSNorm of one row over NORM_THREADS threads (blockDim must be NORM_THREADS): s = x (+ delta); each thread sums
// s² of columns tid, tid + NORM_THREADS, ... with fmaf, then block_sum; inv = 1 / sqrt(mean(s²) + eps) (norm_row).
#define NORM_THREADS 256
#define NORM_BATCH 8  // columns whose loads a thread issues together (one round trip per 8 columns)
template <bool CG>
__device__ __forceinline__ float norm_load(const float* x, int c) {
  if constexpr (CG) return __ldcg(x + c);
  else return x[c];
}

// Σ s² over this thread's columns tid, tid + NORM_THREADS, ... (fmaf in column order), s = x (+ delta); with
// x_write, s is also stored there (the residual update). Loads go out B (default NORM_BATCH) at a time: the
// arithmetic does not depend on the grouping. CG: L2-coherent loads (a row other blocks of the same launch wrote).
template <bool CG, int B = NORM_BATCH>
__device__ __forceinline__ float norm_sumsq(const float* x, const float* delta, float* x_write, int cols) {
  float ss = 0.0f;
  for (int base = threadIdx.x; base < cols; base += B * NORM_THREADS) {
    float v[B];
#pragma unroll
    for (int i = 0; i < B; ++i) {
      const int c = base + i * NORM_THREADS;
      v[i] = c < cols ? (delta ? __fadd_rn(norm_load<CG>(x, c), delta[c]) : norm_load<CG>(x, c)) : 0.0f;
    }
#pragma unroll
    for (int i = 0; i < B; ++i) {
      const int c = base + i * NORM_THREADS;
      if (c < cols) {
        if (x_write) x_write[c] = v[i];
        ss = fmaf(v[i], v[i], ss);
      }
    }
  }
  return ss;
}

// One normed element: (s · inv) · weight, each product rounded (numpy_ops.rms_norm's order).
__device__ __forceinline__ float norm_value(float s, float inv, float weight) {
  return __fmul_rn(__fmul_rn(s, inv), weight);
}

// One normed value v of column c of row `row`: into the next GEMV's operand xs (split kind > 0, store_split) or fp32
// y (kind 0), and into normed (fp32) if given. norm_store, norm_row and the GEMV's
// residual + norm tail (cuda/gemv.cu resnorm_tail) write through it.
__device__ __forceinline__ void norm_put(float v, int c, int cols, int row, int kind, u16* __restrict__ xs,
                                         float* __restrict__ y, float* __restrict__ normed) {
  if (kind) store_split(xs, row, c, cols, v, kind);
  else y[(size_t)row * cols + c] = v;
  if (normed) normed[(size_t)row * cols + c] = v;
}

// One batch of this thread's columns base + i · NORM_THREADS (i < B, those < cols): norm_value(s[i], inv, w[i])
// through norm_put. norm_store writes its batches through it.
template <int B>
__device__ __forceinline__ void norm_put_batch(int base, const float (&s)[B], const float (&w)[B], float inv,
                                               int cols, int row, int kind, u16* __restrict__ xs,
                                               float* __restrict__ y, float* __restrict__ normed) {
#pragma unroll
  for (int i = 0; i < B; ++i) {
    const int c = base + i * NORM_THREADS;
    if (c < cols) norm_put(norm_value(s[i], inv, w[i]), c, cols, row, kind, xs, y, normed);
  }
}

// Row `row` of the normed output: v = norm_value(s, inv, w) for this thread's columns, into the next GEMV's
// operand xs (split kind > 0, store_split) or fp32 y (kind 0), and also into normed (fp32) if given. Loads
// B (default NORM_BATCH) columns at a time (as norm_sumsq).
template <bool CG, int B = NORM_BATCH>
__device__ __forceinline__ void norm_store(const float* s_row, float inv, const float* __restrict__ weight, int cols,
                                           int row, int kind, u16* __restrict__ xs, float* __restrict__ y,
                                           float* __restrict__ normed) {
  for (int base = threadIdx.x; base < cols; base += B * NORM_THREADS) {
    float s[B], w[B];
#pragma unroll
    for (int i = 0; i < B; ++i) {
      const int c = base + i * NORM_THREADS;
      s[i] = c < cols ? norm_load<CG>(s_row, c) : 0.0f;
      w[i] = c < cols ? weight[c] : 0.0f;
    }
    norm_put_batch<B>(base, s, w, inv, cols, row, kind, xs, y, normed);
  }
}

// A whole row's RMSNorm by one block of NORM_THREADS threads: s = x (+ delta), stored to x_write if given (the
// residual update), inv = 1 / sqrt(mean(s²) + eps), v = norm_value(s, inv, weight) into xs (split kind > 0) or y
// (kind 0) at row `row`, and into normed if given. The arithmetic of norm_sumsq + block_sum + norm_store, so the
// same bits; but a row of at most NORM_THREADS · NORM_REG columns is held in registers: each thread issues all its
// loads of x (and delta) at once, then its weight loads (in flight during the block sum), and nothing is read
// twice, so the row costs about two memory round trips, not the 2-6 of the batched loops (which serve longer
// rows). CG: L2-coherent loads of x (a row other blocks of the same launch wrote). Holds barriers: every thread of
// the block calls it.
// norm_row_batched: the same with the batched loops (norm_sumsq, then norm_store re-reading the row): any length.
#define NORM_REG 20
template <bool CG, int B = NORM_BATCH>
__device__ __forceinline__ void norm_row_batched(const float* x, const float* delta, float* x_write,
                                                 const float* __restrict__ weight, int cols, float eps, float* scratch,
                                                 int row, int kind, u16* __restrict__ xs, float* __restrict__ y,
                                                 float* __restrict__ normed) {
  const float inv = 1.0f / sqrtf(block_sum(norm_sumsq<CG, B>(x, delta, x_write, cols), scratch) / (float)cols + eps);
  norm_store<CG, B>(x_write ? x_write : x, inv, weight, cols, row, kind, xs, y, normed);
}
template <bool CG>
__device__ __forceinline__ void norm_row(const float* x, const float* delta, float* x_write,
                                         const float* __restrict__ weight, int cols, float eps, float* scratch,
                                         int row, int kind, u16* __restrict__ xs, float* __restrict__ y,
                                         float* __restrict__ normed) {
  if (cols > NORM_THREADS * NORM_REG) {
    norm_row_batched<CG>(x, delta, x_write, weight, cols, eps, scratch, row, kind, xs, y, normed);
    return;
  }
  float s[NORM_REG], w[NORM_REG];
#pragma unroll
  for (int i = 0; i < NORM_REG; ++i) {
    const int c = threadIdx.x + i * NORM_THREADS;
    s[i] = c < cols ? (delta ? __fadd_rn(norm_load<CG>(x, c), delta[c]) : norm_load<CG>(x, c)) : 0.0f;
  }
  float ss = 0.0f;
#pragma unroll
  for (int i = 0; i < NORM_REG; ++i) {
    const int c = threadIdx.x + i * NORM_THREADS;
    if (c < cols) {
      if (x_write) x_write[c] = s[i];
      ss = fmaf(s[i], s[i], ss);
    }
  }
#pragma unroll
  for (int i = 0; i < NORM_REG; ++i) {  // the weights' loads overlap the block sum
    const int c = threadIdx.x + i * NORM_THREADS;
    w[i] = c < cols ? weight[c] : 0.0f;
  }
  const float inv = 1.0f / sqrtf(block_sum(ss, scratch) / (float)cols + eps);
#pragma unroll
  for (int i = 0; i < NORM_REG; ++i) {
    const int c = threadIdx.x + i * NORM_THREADS;
    if (c < cols) {
      const float v = norm_value(s[i], inv, w[i]);
      norm_put(v, c, cols, row, kind, xs, y, normed);
    }
  }
}

// ---- the residual stream's RMSNorm: its sum of squares in tile order --------------------------------------
// add_rms_norm (every row of a verify / prefill) and the decode GEMV's residual + norm epilogue (cuda/gemv.cu
// MMA_Y_RESNORM, whose blocks each own a 16-row tile of the output) sum s² in one order, so decode and verify rows
// have the same bits: per 16-column tile j (columns 16 j .. 16 j + 15, missing columns 0) the squares
// q_l = s_l · s_l (rounded) are added as a butterfly, q_l + q_(l+8), then + the partner 4, 2, 1 apart (what four
// __shfl_xor steps over the tile's 16 lanes give); then thread t of NORM_THREADS adds tiles t, t + NORM_THREADS, ...
// in order from 0.0f, and block_sum adds the threads. inv = 1 / sqrt(mean(s²) + eps) as norm_row. (The first
// norm after the embedding keeps norm_row's column-strided order: it is not a GEMV tail.)
#define NORM_TILE 16
// The tile sum of lanes 0..15 (each holding its column's s; 0 for a missing column) of the calling warp: every lane
// 0..15 gets it (lanes 16..31 take part in the shuffles, with any value, and get their own half's sum).
__device__ __forceinline__ float tile_sumsq_lanes(float s) {
  float v = __fmul_rn(s, s);
#pragma unroll
  for (int m = NORM_TILE / 2; m > 0; m >>= 1) v = __fadd_rn(v, __shfl_xor_sync(0xFFFFFFFFu, v, m));
  return v;
}
// The tile sum of one tile held by a quad of lanes (lane c of the quad: columns 4 c .. 4 c + 3 in s[0..3]; 0 for a
// missing column): the butterfly's steps 8 and 4 across the quad (column l ^ 8 is lane c ^ 2, l ^ 4 lane c ^ 1), 2
// and 1 in the lane (tile_sumsq_lanes' bits); every lane of the quad gets it. Every lane of the warp calls it.
__device__ __forceinline__ float quad_tile_sumsq(const float (&s)[4]) {
  float v[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) v[i] = __fmul_rn(s[i], s[i]);
#pragma unroll
  for (int i = 0; i < 4; ++i) v[i] = __fadd_rn(v[i], __shfl_xor_sync(0xFFFFFFFFu, v[i], 2));
#pragma unroll
  for (int i = 0; i < 4; ++i) v[i] = __fadd_rn(v[i], __shfl_xor_sync(0xFFFFFFFFu, v[i], 1));
  return __fadd_rn(__fadd_rn(v[0], v[2]), __fadd_rn(v[1], v[3]));
}
// add_rms_norm's row (block NORM_THREADS): s = x + delta, stored to x in place, then the RMSNorm with the sum of
// squares in the tile order above. Quad q (threads 4 q .. 4 q + 3) takes tiles q, q + 64, ... (a pass of 64 tiles,
// 1024 columns, at a time); its lane c holds columns 4 c .. 4 c + 3 of the tile (one 16-byte load of x and of
// delta: a warp's load is 512 contiguous bytes). The quad's tile sums go to virtual thread j mod NORM_THREADS (tile
// j) in pass order, i.e. in tile order, and shared memory hands virtual thread t's sum to thread t for block_sum.
// The first NORM_TILE_KEEP passes (rows of ≤ 5120 columns) keep s in registers and stage it in shared memory, and
// every load (x, delta, the weights) goes out at once: one memory round trip, as norm_row; the store pass takes
// norm_store's columns (tid, tid + NORM_THREADS, ...: coalesced stores), reading s from the stage (or, past 5120
// columns, back from x). Holds barriers: every thread of the block calls it.
// It costs more than norm_row's strided fmaf chain (`python3 bench/norm.py`), and the two other tile-order forms
// measured (lanes on columns c + 4 i; norm_row's mapping with s² staged in shared memory) cost more still; the
// decode step gains more from the GEMV tail sharing this order (gemv.cu resnorm_tail) than verify and prefill
// lose (figures: docs/performance.md).
#define NORM_TILE_KEEP 5
#define NORM_KEEP_COLS (NORM_TILE_KEEP * NORM_THREADS / 4 * NORM_TILE)  // 5120
__device__ __forceinline__ void norm_row_tiles(float* x, const float* __restrict__ delta,
                                               const float* __restrict__ weight, int cols, float eps, float* scratch,
                                               int row, int kind, u16* __restrict__ xs, float* __restrict__ y,
                                               float* __restrict__ normed) {
  __shared__ float sv[NORM_THREADS];
  __shared__ __align__(16) float stage[NORM_KEEP_COLS];
  const int q = threadIdx.x >> 2, c = threadIdx.x & 3, qn = NORM_THREADS / 4;
  const int tiles = (cols + NORM_TILE - 1) / NORM_TILE, passes = (tiles + qn - 1) / qn;
  const bool vec = (cols & 3) == 0;  // 16-byte aligned groups of 4 columns, each wholly in or past the row
  float s[NORM_TILE_KEEP][4], w[NORM_REG], acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  auto load4 = [&](int col0, float (&v)[4]) {
    if (vec) {
      if (col0 < cols) {
        const float4 a = *reinterpret_cast<const float4*>(x + col0);
        const float4 d = *reinterpret_cast<const float4*>(delta + col0);
        v[0] = __fadd_rn(a.x, d.x); v[1] = __fadd_rn(a.y, d.y); v[2] = __fadd_rn(a.z, d.z); v[3] = __fadd_rn(a.w, d.w);
      } else {
        v[0] = v[1] = v[2] = v[3] = 0.0f;
      }
    } else {
#pragma unroll
      for (int i = 0; i < 4; ++i) v[i] = col0 + i < cols ? __fadd_rn(x[col0 + i], delta[col0 + i]) : 0.0f;
    }
  };
  auto store4 = [&](int col0, const float (&v)[4]) {
    if (vec) {
      if (col0 < cols) *reinterpret_cast<float4*>(x + col0) = make_float4(v[0], v[1], v[2], v[3]);
    } else {
#pragma unroll
      for (int i = 0; i < 4; ++i)
        if (col0 + i < cols) x[col0 + i] = v[i];
    }
  };
#pragma unroll
  for (int p = 0; p < NORM_TILE_KEEP; ++p) {
    if (p < passes) load4((qn * p + q) * NORM_TILE + 4 * c, s[p]);
    else s[p][0] = s[p][1] = s[p][2] = s[p][3] = 0.0f;
  }
#pragma unroll
  for (int k = 0; k < NORM_REG; ++k) {
    const int col = threadIdx.x + k * NORM_THREADS;
    w[k] = col < cols ? weight[col] : 0.0f;
  }
#pragma unroll
  for (int p = 0; p < NORM_TILE_KEEP; ++p) {
    if (p < passes) {  // the same for the whole block (quad_tile_sumsq's shuffles)
      const int col0 = (qn * p + q) * NORM_TILE + 4 * c;
      store4(col0, s[p]);
      *reinterpret_cast<float4*>(stage + col0) = make_float4(s[p][0], s[p][1], s[p][2], s[p][3]);
      const float t = quad_tile_sumsq(s[p]);
      if (qn * p + q < tiles) acc[p & 3] = __fadd_rn(acc[p & 3], t);
    }
  }
  for (int p = NORM_TILE_KEEP; p < passes; ++p) {  // rows of > 5120 columns: not kept, re-read for the store
    const int col0 = (qn * p + q) * NORM_TILE + 4 * c;
    float t4[4];
    load4(col0, t4);
    store4(col0, t4);
    const float t = quad_tile_sumsq(t4);
    if (qn * p + q < tiles)
#pragma unroll
      for (int a = 0; a < 4; ++a)
        if (a == (p & 3)) acc[a] = __fadd_rn(acc[a], t);
  }
  if (c == 0)
#pragma unroll
    for (int a = 0; a < 4; ++a) sv[qn * a + q] = acc[a];
  __syncthreads();  // sv, the stage and (rows > 5120) x are written
  const float inv = 1.0f / sqrtf(block_sum(sv[threadIdx.x], scratch) / (float)cols + eps);
#pragma unroll
  for (int k = 0; k < NORM_REG; ++k) {
    const int col = threadIdx.x + k * NORM_THREADS;
    if (col < cols)
      norm_put(norm_value(col < NORM_KEEP_COLS ? stage[col] : x[col], inv, w[k]), col, cols, row, kind, xs, y, normed);
  }
  for (int col = threadIdx.x + NORM_REG * NORM_THREADS; col < cols; col += NORM_THREADS)
    norm_put(norm_value(x[col], inv, weight[col]), col, cols, row, kind, xs, y, normed);
}

// silu(g) · u = g / (1 + exp(-g)) · u, accurate expf (numpy_ops.silu(gate) * up within 2 ulp).
__device__ __forceinline__ float silu_times(float g, float u) {
  return __fmul_rn(__fdiv_rn(g, __fadd_rn(1.0f, expf(-g))), u);
}
