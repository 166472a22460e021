// attention_decode.cu: one decode position of a gated full-attention layer after its q / k / v projections
// (spec §5; reference: tandem/backend/cuda/attention_decode.py `reference`, built from numpy_ops.rms_norm,
// rope_tables, apply_rope, attention_decode and sigmoid as Qwen3_5Model.attention_qkv / _attention compose them).
//
// attn_partial  grid (Hkv, C = ceil(S / 64), Z), block 256: chunk c, the 64 key rows at absolute positions
//               [64c, 64c + 64), for G / Z of the G = H / Hkv query heads of KV head j (block z: heads z G / Z
//               onwards; Z divides G; a head's arithmetic is the same for any Z, so are its bits). With has_prep
//               it first does what attn_prep did: warp g RMSNorms + RoPEs the block's query head g at pos = S - 1
//               (every chunk, redundantly: 6 KiB from L2), and the last chunk's blocks also the new k row, the
//               z = 0 block writing k / v rows into the caches at pos. V rows go to dynamic shared memory by
//               cp.async (64 D values of the cache's storage: attention_decode.py partial_smem) and K rows into
//               registers (warp w: rows 8w..8w+7, bf16 kept packed) at kernel start, so the whole chunk is one
//               memory round trip and two blocks fit an SM. Then scores · D^-1/2, chunk max m, l = Σ exp(s - m),
//               acc = Σ_p exp(s_p - m) · v_p in row order (attention_common.cuh).
//               Chunks are fixed by absolute position (DESIGN.md: a tree node must see the blocking a decode
//               at its position sees).
//               With fused (decode in one launch; the arguments counter, gate .. xs serve it and are ignored
//               without it): after writing its partials a block counts itself in counter[j] (common.cuh
//               ticket_acq_rel); the block that counts C - 1 is the last of head j: it zeroes counter[j]
//               (the next launch finds it zeroed), reads the other blocks' partials through L2 (__ldcg)
//               and runs combine_rows for rows jG .. jG + G - 1 together (thread d: channel d of each row, the G
//               chains interleaved; threads ≥ D idle), so it writes out / xs with the bits of attn_combine
//               (row_heads = H). No block waits on another. counter: uint32 [≥ Hkv], zero before the launch;
//               fused launches sharing one run one after another (one stream).
// attn_combine  grid (rows, ceil(D / W)) (rows: H for decode, N·H for tree: num_heads = rows), block W (a multiple
//               of 32; attention_decode.py COMBINE_WIDTH): combine_rows for row blockIdx.x, channels from W blockIdx.y
//               (a channel's arithmetic is the same for any W, so are its bits):
//               M = max_c m_c; w_c = exp(m_c - M) staged in shared 256 chunks at a time; o = Σ_c w_c acc_c /
//               Σ_c w_c l_c, chunks in order (fmaf); then optionally · σ(gate) (the output gate). Shared with
//               attention_tree.cu's tree_partial. kind 0 (SPLIT_NONE) writes o to out [rows, D]; kind 1..3 instead
//               writes the o projection's GEMV operand: store_split(xs, t, col, row_heads · D, o, kind) with t =
//               row / row_heads (the token / node) and col = (row % row_heads) · D + d, the same o, so xs equals
//               gemv_prep of out bit for bit (one launch fewer). row_heads: H (query heads per output row).
// Layout: qg [H, 2D] (q then gate per head) or q [H, D]; k_new / v_new [Hkv, D]; caches [max_len, Hkv, D] fp32 or
// bf16 bits (the _bf16 instances; attention_common.cuh kv_store / kv_load: rows rounded when written, widened when
// read, the new row's scores and weights taken from its stored value); partials: acc [C, rows, D], m / l [C, rows];
// fp32 otherwise; xs [rows / H, P, H·D] u16 (common.cuh
// store_split: P = 2 fp16 hi + lo, in NVFP4 slot order for kind 2, or 3 bf16 hi + mid + lo); counter [≥ Hkv] u32.
// D ≤ 256 and a multiple of 32; G ≤ 8.
// History: v1 split-K by absolute 256-row chunks, separate attn_prep. v2 64-row chunks (16x the blocks),
// prep fused into attn_partial, K / V prefetched into registers, combine with staged chunk weights. v2.1
// attn_combine optionally writes the split GEMV operand xs (kind, xs, row_heads) instead of fp32 out. v2.2 decode
// in one launch: attn_partial's last block per KV head combines its G rows (fused, counter), the combine one
// __device__ function (combine_rows) for both paths, partials read through L2. v2.3 a KV head's query heads split
// over grid.z (short contexts fill more SMs), attn_partial_g<GH> instances for blocks of few heads. v2.4 bf16 KV
// rows (the _bf16 instances); attn_combine's channels split over grid.y (a 32k-row decode's combine had 24
// blocks); V rows by cp.async into shared memory instead of 64 registers a thread (196 -> 128 registers, two
// blocks an SM);
// scores by warp_sum_each (32 a warp at a time; prefill_partial's form, the same bits). v2.5 several slots' decode
// steps in one launch (attn_partial_slots*, attn_combine_slots: the same attn_partial_impl / combine_rows with each
// slot's pointers from a table; attn_partial_impl takes its block coordinates and rotary position as arguments).
#include "common.cuh"
#include "attention_common.cuh"

#define ATTN_MAX_G 8
#define COMBINE_TILE 256                                  // attn_combine: chunks staged at a time
#define FUSED_TILE (ATTN_WARPS * 256 / (2 * ATTN_MAX_G))  // the fused combine's (128): wt and lt of 8 rows in stage

// The combine of output rows h0 .. h0 + nrows - 1 (nrows ≤ MAXR), channels d0 .. d0 + width - 1 (width a multiple
// of 32, ≤ blockDim): attn_combine's whole arithmetic, also run by attn_partial's fused path, so the two give the
// same bits. Called by every thread of the block (it holds barriers): thread t < width computes channel d0 + t of
// every row, threads ≥ width only take part in the barriers. Per row and channel, independent of blockDim, d0,
// width, MAXR, TILE and UNROLL (the rows are interleaved for memory-level parallelism, each row's sequence of
// operations is that of a lone row; M is a max, exact in any order):
//   M = max_c m_c (thread t: chunks t, t + width, ... , then warp_max, then the width / 32 warps' maxima);
//   w_c = expf(m_c - M) and l_c staged in wt / lt, TILE chunks at a time (staging does not change the order);
//   den = Σ_c w_c l_c, num = Σ_c w_c acc_c[d] (fmaf chains, chunks in order); o = num / den; · σ(gate) if has_gate.
// kind 0 writes out[h, d]; kind 1..3 store_split(xs, t, (h - t · row_heads) · D + d, row_heads · D, o, kind),
// t = h / row_heads. Partials are read through L2 (__ldcg): in the fused path other blocks of this launch wrote
// them. Shared memory: scratch [MAXR][32], wt / lt [MAXR][TILE] floats each.
template <int MAXR, int TILE, int UNROLL>
__device__ __forceinline__ void combine_rows(int h0, int nrows, const float* part_acc, const float* part_m,
                                             const float* part_l, const float* __restrict__ gate, int has_gate,
                                             int gate_stride, float* out, int num_heads, int head_dim, int num_chunks,
                                             int row_heads, int kind, u16* xs, float* scratch, float* wt, float* lt,
                                             int d0, int width) {
  const int tid = threadIdx.x, d = d0 + tid;
  const bool active = tid < width;
  float big[MAXR], num[MAXR], den[MAXR];
#pragma unroll
  for (int r = 0; r < MAXR; ++r) big[r] = TANDEM_NEG_INF;
  if (active) {  // whole warps: width is a multiple of 32
    for (int c = tid; c < num_chunks; c += width) {
#pragma unroll
      for (int r = 0; r < MAXR; ++r)
        if (r < nrows) big[r] = fmaxf(big[r], __ldcg(part_m + (size_t)c * num_heads + h0 + r));
    }
#pragma unroll
    for (int r = 0; r < MAXR; ++r) {
      if (r < nrows) {
        const float b = warp_max(big[r]);
        if ((tid & 31) == 0) scratch[r * 32 + (tid >> 5)] = b;
      }
    }
  }
  __syncthreads();
#pragma unroll
  for (int r = 0; r < MAXR; ++r) {
    big[r] = TANDEM_NEG_INF;
    if (r < nrows)
      for (int w = 0; w < (width >> 5); ++w) big[r] = fmaxf(big[r], scratch[r * 32 + w]);  // exact in any order
    num[r] = den[r] = 0.0f;
  }
  for (int c0 = 0; c0 < num_chunks; c0 += TILE) {
    const int nt = min(TILE, num_chunks - c0);
    __syncthreads();  // the previous tile is consumed
    if (active) {
      for (int t = tid; t < nt; t += width) {
#pragma unroll
        for (int r = 0; r < MAXR; ++r) {
          if (r < nrows) {
            wt[r * TILE + t] = expf(__fsub_rn(__ldcg(part_m + (size_t)(c0 + t) * num_heads + h0 + r), big[r]));
            lt[r * TILE + t] = __ldcg(part_l + (size_t)(c0 + t) * num_heads + h0 + r);
          }
        }
      }
    }
    __syncthreads();
    if (active) {
      const float* acc = part_acc + ((size_t)c0 * num_heads + h0) * head_dim + d;
#pragma unroll UNROLL
      for (int t = 0; t < nt; ++t) {
#pragma unroll
        for (int r = 0; r < MAXR; ++r) {
          if (r < nrows) {
            den[r] = fmaf(wt[r * TILE + t], lt[r * TILE + t], den[r]);
            num[r] = fmaf(wt[r * TILE + t], __ldcg(acc + ((size_t)t * num_heads + r) * head_dim), num[r]);
          }
        }
      }
    }
  }
  if (!active) return;  // no barrier follows
#pragma unroll
  for (int r = 0; r < MAXR; ++r) {
    if (r >= nrows) continue;
    const int h = h0 + r;
    float o = __fdiv_rn(num[r], den[r]);
    if (has_gate) {
      const float gz = gate[(size_t)h * gate_stride + d];
      o = __fmul_rn(o, __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-gz))));
    }
    if (kind == SPLIT_NONE) {
      out[(size_t)h * head_dim + d] = o;
    } else {  // the same o, split for the o projection: row t = h / row_heads, column (h % row_heads) · D + d
      const int t = h / row_heads;
      store_split(xs, t, (h - t * row_heads) * head_dim + d, row_heads * head_dim, o, kind);
    }
  }
}

#define ATTN_PARTIAL_PARAMS(KV)                                                                                \
  const float *__restrict__ q_src, int q_stride, int has_prep, const float *__restrict__ k_new,                 \
      const float *__restrict__ v_new, const float *__restrict__ q_norm, const float *__restrict__ k_norm,       \
      const float *__restrict__ inv_freq, int rotary_dim, float eps, KV *keys, KV *values,                      \
      float *__restrict__ part_acc, float *__restrict__ part_m, float *__restrict__ part_l, int num_heads,      \
      int num_kv_heads, int head_dim, int num_rows, float scale, int fused, u32 *__restrict__ counter,          \
      const float *__restrict__ gate, int has_gate, int gate_stride, float *__restrict__ out, int kind,         \
      u16 *__restrict__ xs
#define ATTN_PARTIAL_PASS                                                                                      \
  q_src, q_stride, has_prep, k_new, v_new, q_norm, k_norm, inv_freq, rotary_dim, eps, keys, values, part_acc,    \
      part_m, part_l, num_heads, num_kv_heads, head_dim, num_rows, scale, fused, counter, gate, has_gate,        \
      gate_stride, out, kind, xs

// A warp's 8 prefetched K rows in registers, as stored (this lane's float4s: 16 float4, or 16 uint2 of bf16 bits,
// widened when used: exact), so a bf16 block holds half the registers.
template <typename KV>
struct KRegs {
  float4 k[ATTN_ROWS_PER_WARP][2];
  __device__ __forceinline__ void load(int r, const KV* row, int d4, int lane) { load_row4(row, d4, lane, k[r]); }
  __device__ __forceinline__ void zero(int r) { k[r][0] = k[r][1] = make_float4(0.0f, 0.0f, 0.0f, 0.0f); }
  __device__ __forceinline__ void get(int r, float4 (&out)[2]) const {
    out[0] = k[r][0];
    out[1] = k[r][1];
  }
};
template <>
struct KRegs<kv_bf16> {
  uint2 k[ATTN_ROWS_PER_WARP][2];
  __device__ __forceinline__ void load(int r, const kv_bf16* row, int d4, int lane) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int e = lane + 32 * i;
      k[r][i] = e < d4 ? reinterpret_cast<const uint2*>(row)[e] : make_uint2(0u, 0u);
    }
  }
  __device__ __forceinline__ void zero(int r) { k[r][0] = k[r][1] = make_uint2(0u, 0u); }
  __device__ __forceinline__ void get(int r, float4 (&out)[2]) const {
#pragma unroll
    for (int i = 0; i < 2; ++i)
      out[i] = make_float4(bf16_lo(k[r][i].x), bf16_hi(k[r][i].x), bf16_lo(k[r][i].y), bf16_hi(k[r][i].y));
  }
};

// attn_partial's body for at most GH query heads a block (G / Z ≤ GH): its loops over a block's heads run GH times,
// so a block of one head (the short-context split) runs a GH = 1 kernel, not 8 predicated-off copies.
template <int GH, typename KV>
__device__ __forceinline__ void attn_partial_impl(ATTN_PARTIAL_PARAMS(KV), int j, int c, int zi, int nz,
                                                  int num_chunks, int rot_pos) {
  extern __shared__ __align__(16) float vs_raw[];  // [ATTN_CHUNK][head_dim] of KV: the chunk's V rows
  KV* vs = reinterpret_cast<KV*>(vs_raw);
  __shared__ __align__(16) float qs[GH][256];
  __shared__ __align__(16) float stage[ATTN_WARPS][256];
  __shared__ __align__(16) float knew[256];
  __shared__ float sc[GH][ATTN_CHUNK];
  const int group = num_heads / num_kv_heads;
  const int gh = group / nz, g0 = zi * gh;  // this block's query heads: j G + g0 .. j G + g0 + gh - 1
  const int p0 = c * ATTN_CHUNK;
  const int n = min(ATTN_CHUNK, num_rows - p0);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, d = threadIdx.x;
  const int d4 = head_dim / 4;
  const size_t kv_stride = (size_t)num_kv_heads * head_dim;
  const int pos = num_rows - 1;
  const int p_new = has_prep ? pos - p0 : -1;  // the new row's index in this chunk (the last one), or out of range

  // Prefetch: V rows into vs (cp.async; not row pos, written below) and K (this warp's 8 rows into registers; row
  // pos is stale here, replaced below).
  {
    const int ru = head_dim * (int)sizeof(KV) / 16;  // 16-byte pieces of a row
    for (int i = threadIdx.x; i < n * ru; i += ATTN_THREADS) {
      const int p = i / ru, e = i - p * ru;
      if (p == p_new) continue;
      cp_async16(smem_u32(reinterpret_cast<char*>(vs + p * head_dim) + 16 * e),
                 reinterpret_cast<const char*>(values + (size_t)(p0 + p) * kv_stride + (size_t)j * head_dim) + 16 * e,
                 true);
    }
    cp_async_commit();
  }
  KRegs<KV> kr;
#pragma unroll
  for (int r = 0; r < ATTN_ROWS_PER_WARP; ++r) {
    const int p = warp * ATTN_ROWS_PER_WARP + r;
    if (p < n) {
      kr.load(r, keys + (size_t)(p0 + p) * kv_stride + (size_t)j * head_dim, d4, lane);
    } else {
      kr.zero(r);
    }
  }

  if (has_prep) {
    // every head block of the last chunk preps the new k row for its scores; the first (z = 0) writes the caches
    const bool writer = zi == 0;
    const int tasks = gh + (p_new >= 0 && p_new < ATTN_CHUNK ? 1 : 0);
    for (int t = warp; t < tasks; t += ATTN_WARPS) {
      if (t < gh) {
        norm_rope_head<float>(q_src + (size_t)(j * group + g0 + t) * q_stride, q_norm, inv_freq, head_dim,
                              rotary_dim, rot_pos, eps, stage[warp], qs[t], nullptr);
      } else {  // knew: the stored row's values (kv_round), so this chunk scores what a later step reads
        norm_rope_head<KV>(k_new + (size_t)j * head_dim, k_norm, inv_freq, head_dim, rotary_dim, rot_pos, eps,
                           stage[warp], knew, writer ? keys + (size_t)pos * kv_stride + (size_t)j * head_dim : nullptr);
      }
    }
    if (p_new >= 0 && p_new < ATTN_CHUNK && d < head_dim) {
      const float v = v_new[(size_t)j * head_dim + d];
      if (writer) kv_store(values + (size_t)pos * kv_stride + (size_t)j * head_dim + d, v);
      kv_store(vs + p_new * head_dim + d, v);  // the stored value (no copy was issued for this row)
    }
  } else {
    for (int i = threadIdx.x; i < gh * head_dim; i += blockDim.x)
      qs[i / head_dim][i % head_dim] = q_src[(size_t)(j * group + g0 + i / head_dim) * q_stride + i % head_dim];
  }
  __syncthreads();

  // Scores of this warp's 8 keys for up to 4 query heads at a time (32 scores): 32 lane_dot_regs chains, then
  // warp_sum_each (warp_sum's bits, 31 shuffles for the 32 sums), · D^-1/2: chunk_dot's bits for each (head, key).
  // Lane l ends with head g4 + l / 8, key 8 warp + l % 8. Keys past n hold zeros and are not stored.
#pragma unroll
  for (int g4 = 0; g4 < GH; g4 += 4) {
    if (g4 >= gh) break;
    float v[32];
#pragma unroll
    for (int r = 0; r < ATTN_ROWS_PER_WARP; ++r) {
      const int p = warp * ATTN_ROWS_PER_WARP + r;
      float4 kk[2];
      if (p == p_new) {
        load_row4(knew, d4, lane, kk);
      } else {
        kr.get(r, kk);
      }
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int g = min(g4 + i, GH - 1);
        float4 q4[2];
#pragma unroll
        for (int u = 0; u < 2; ++u)
          q4[u] = lane + 32 * u < d4 ? *reinterpret_cast<const float4*>(qs[g] + 4 * (lane + 32 * u))
                                     : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        v[i * ATTN_ROWS_PER_WARP + r] = lane_dot_regs(kk, q4, d4, lane);
      }
    }
    const float s = warp_sum_each(v, lane);
    const int g = g4 + (lane >> 3), p = warp * ATTN_ROWS_PER_WARP + (lane & 7);
    if (g < gh && p < n) sc[g][p] = __fmul_rn(s, scale);
  }
  __syncthreads();

  if (warp < gh) {
    float m, l;
    chunk_softmax(sc[warp], n, lane, m, l);
    if (lane == 0) {
      part_m[(size_t)c * num_heads + j * group + g0 + warp] = m;
      part_l[(size_t)c * num_heads + j * group + g0 + warp] = l;
    }
  }
  cp_async_wait<0>();
  __syncthreads();  // the weights in sc; every thread's V rows in vs

  if (d < head_dim) {
    float acc[GH];
#pragma unroll
    for (int g = 0; g < GH; ++g) acc[g] = 0.0f;
#pragma unroll
    for (int p = 0; p < ATTN_CHUNK; ++p) {
      if (p < n) {
#pragma unroll
        for (int g = 0; g < GH; ++g)
          if (g < gh) acc[g] = fmaf(sc[g][p], kv_load(vs + p * head_dim + d), acc[g]);
      }
    }
#pragma unroll
    for (int g = 0; g < GH; ++g)
      if (g < gh) part_acc[((size_t)c * num_heads + j * group + g0 + g) * head_dim + d] = acc[g];
  }
  if (!fused) return;  // attn_combine follows

  // Fused combine: the last of KV head j's num_chunks · nz blocks to finish combines its G query heads.
  // common.cuh ticket_acq_rel: this block's partials are visible before it counts itself, and the last block reads
  // the other blocks' partials (through L2 in combine_rows) after.
  if (ticket_acq_rel(counter + j) != (u32)(num_chunks * nz - 1)) return;
  if (threadIdx.x == 0) counter[j] = 0u;  // every block of head j has counted: zero for the next launch
  // Shared memory free since the scores: knew holds scratch [8][32], stage wt [8][128] then lt [8][128].
  combine_rows<ATTN_MAX_G, FUSED_TILE, 8>(j * group, group, part_acc, part_m, part_l, gate, has_gate, gate_stride,
                                          out, num_heads, head_dim, num_chunks, num_heads, kind, xs, knew,
                                          &stage[0][0], &stage[ATTN_WARPS / 2][0], 0, head_dim);
}

// Kernel names: attn_partial (up to ATTN_MAX_G heads a block) and attn_partial_g<GH> (up to GH heads a block; the
// launcher takes the smallest that holds G / Z), each for fp32 KV rows and, suffixed _bf16, for bf16 rows. One
// parameter list.
// Two blocks an SM (128 registers a thread: V rows in shared memory, K rows in registers).
#define ATTN_PARTIAL_KERNEL(SUF, GH, KV, MINB)                                                                 \
  extern "C" __global__ void __launch_bounds__(ATTN_THREADS, MINB) attn_partial##SUF(ATTN_PARTIAL_PARAMS(KV)) { \
    PDL_ENTER                                                                                                  \
    attn_partial_impl<GH, KV>(ATTN_PARTIAL_PASS, blockIdx.x, blockIdx.y, blockIdx.z, gridDim.z, gridDim.y,     \
                              num_rows - 1);                                                                   \
  }
ATTN_PARTIAL_KERNEL(, ATTN_MAX_G, float, 2)
ATTN_PARTIAL_KERNEL(_g1, 1, float, 2)
ATTN_PARTIAL_KERNEL(_g2, 2, float, 2)
ATTN_PARTIAL_KERNEL(_g4, 4, float, 2)
ATTN_PARTIAL_KERNEL(_bf16, ATTN_MAX_G, kv_bf16, 2)
ATTN_PARTIAL_KERNEL(_g1_bf16, 1, kv_bf16, 2)
ATTN_PARTIAL_KERNEL(_g2_bf16, 2, kv_bf16, 2)
ATTN_PARTIAL_KERNEL(_g4_bf16, 4, kv_bf16, 2)

extern "C" __global__ void __launch_bounds__(256)
attn_combine(const float* __restrict__ part_acc, const float* __restrict__ part_m, const float* __restrict__ part_l,
             const float* __restrict__ gate, int has_gate, int gate_stride, float* __restrict__ out, int num_heads,
             int head_dim, int num_chunks, int row_heads, int kind, u16* __restrict__ xs) {
  PDL_ENTER
  __shared__ float scratch[32];
  __shared__ float wt[COMBINE_TILE], lt[COMBINE_TILE];
  const int d0 = blockIdx.y * blockDim.x;  // this block's channels: d0 .. d0 + width - 1
  combine_rows<1, COMBINE_TILE, 16>(blockIdx.x, 1, part_acc, part_m, part_l, gate, has_gate, gate_stride, out,
                                    num_heads, head_dim, num_chunks, row_heads, kind, xs, scratch, wt, lt, d0,
                                    min((int)blockDim.x, head_dim - d0));
}

// ---- several sequences' decode steps in one launch (the joint pass; attention_slots.py) ----
// A slot's row of the per-pass table `slots` [S, SLOT_FIELDS] int32: its position, its rotary position (pos + the
// rope shift of an image prompt's rows), its row in the joint q / k / v / gate / output rows, and the first chunk
// of its partials. kv_table [S, 2] int64: the device addresses of slot s's K and V caches of this layer.
#define SLOT_POS 0
#define SLOT_ROT 1
#define SLOT_ROW 2
#define SLOT_CHUNK0 3
#define SLOT_FIELDS 4
#define ATTN_SLOTS_PARAMS(KV)                                                                                  \
  const long long *__restrict__ kv_table, const int *__restrict__ slots, int nz, const float *__restrict__ q_src, \
      int q_row_stride, int q_stride, const float *__restrict__ k_new, const float *__restrict__ v_new,          \
      int kv_row_stride, const float *__restrict__ q_norm, const float *__restrict__ k_norm,                     \
      const float *__restrict__ inv_freq, int rotary_dim, float eps, float *__restrict__ part_acc,               \
      float *__restrict__ part_m, float *__restrict__ part_l, int num_heads, int num_kv_heads, int head_dim,     \
      float scale, int fused, int fused_max_chunks, u32 *__restrict__ counter, const float *__restrict__ gate,   \
      int has_gate, int gate_stride, float *__restrict__ out, int out_row_stride, int kind,                      \
      u16 *__restrict__ xs, int xs_row_stride

// attn_partial_slots grid (Hkv, max_s C_s, Z · S), block 256: block (j, c, s · Z + z) is attn_partial's block
// (j, c, z) of slot s's decode at its position, through the same attn_partial_impl with slot s's pointers (its
// caches from kv_table, its rows of q / k / v / gate / out / xs, its partials from chunk SLOT_CHUNK0 on, its
// counter entries s · Hkv ..): the bits of that slot's attn_partial launch (grid (Hkv, C_s, Z'): any Z gives the
// same bits). Blocks past a slot's C_s chunks exit. fused: a slot of C_s ≤ fused_max_chunks combines in its last
// block as attn_partial's fused path; the others leave their partials to attn_combine_slots.
template <int GH, typename KV>
__device__ __forceinline__ void attn_partial_slots_impl(ATTN_SLOTS_PARAMS(KV)) {  // after PDL_ENTER
  const int s = blockIdx.z / nz, zi = blockIdx.z - s * nz;
  const int* slot = slots + (size_t)s * SLOT_FIELDS;
  const int pos = slot[SLOT_POS], rot = slot[SLOT_ROT], r = slot[SLOT_ROW], c0 = slot[SLOT_CHUNK0];
  const int chunks = pos / ATTN_CHUNK + 1;
  if ((int)blockIdx.y >= chunks) return;  // the whole block: before any barrier
  KV* keys = reinterpret_cast<KV*>(kv_table[2 * s]);
  KV* values = reinterpret_cast<KV*>(kv_table[2 * s + 1]);
  const size_t hd = (size_t)num_heads * head_dim;
  attn_partial_impl<GH, KV>(q_src + (size_t)r * q_row_stride, q_stride, 1, k_new + (size_t)r * kv_row_stride,
                            v_new + (size_t)r * kv_row_stride, q_norm, k_norm, inv_freq, rotary_dim, eps, keys,
                            values, part_acc + (size_t)c0 * hd, part_m + (size_t)c0 * num_heads,
                            part_l + (size_t)c0 * num_heads, num_heads, num_kv_heads, head_dim, pos + 1, scale,
                            fused && chunks <= fused_max_chunks ? 1 : 0, counter + (size_t)s * num_kv_heads,
                            gate + (size_t)r * q_row_stride, has_gate, gate_stride,
                            kind == SPLIT_NONE ? out + (size_t)r * out_row_stride : out, kind,
                            kind == SPLIT_NONE ? xs : xs + (size_t)r * xs_row_stride, blockIdx.x, blockIdx.y, zi, nz,
                            chunks, rot);
}
#define ATTN_PARTIAL_SLOTS_KERNEL(SUF, GH, KV, MINB)                                                           \
  extern "C" __global__ void __launch_bounds__(ATTN_THREADS, MINB) attn_partial_slots##SUF(                    \
      ATTN_SLOTS_PARAMS(KV)) {                                                                                 \
    PDL_ENTER                                                                                                  \
    attn_partial_slots_impl<GH, KV>(kv_table, slots, nz, q_src, q_row_stride, q_stride, k_new, v_new,         \
                                    kv_row_stride, q_norm, k_norm, inv_freq, rotary_dim, eps, part_acc,        \
                                    part_m, part_l, num_heads, num_kv_heads, head_dim, scale, fused,           \
                                    fused_max_chunks, counter, gate, has_gate, gate_stride, out,              \
                                    out_row_stride, kind, xs, xs_row_stride);                                 \
  }
ATTN_PARTIAL_SLOTS_KERNEL(, ATTN_MAX_G, float, 2)
ATTN_PARTIAL_SLOTS_KERNEL(_g1, 1, float, 2)
ATTN_PARTIAL_SLOTS_KERNEL(_g2, 2, float, 2)
ATTN_PARTIAL_SLOTS_KERNEL(_g4, 4, float, 2)
ATTN_PARTIAL_SLOTS_KERNEL(_bf16, ATTN_MAX_G, kv_bf16, 2)
ATTN_PARTIAL_SLOTS_KERNEL(_g1_bf16, 1, kv_bf16, 2)
ATTN_PARTIAL_SLOTS_KERNEL(_g2_bf16, 2, kv_bf16, 2)
ATTN_PARTIAL_SLOTS_KERNEL(_g4_bf16, 4, kv_bf16, 2)

// attn_combine_slots grid (H, ceil(D / W), S), block W: attn_combine's block (h, y) for slot s = blockIdx.z over its
// C_s chunks of partials (from SLOT_CHUNK0), its gate row and its output row: the bits of that slot's attn_combine.
// A slot attn_partial_slots combined (fused and C_s ≤ fused_max_chunks) exits.
extern "C" __global__ void __launch_bounds__(256)
attn_combine_slots(const int* __restrict__ slots, const float* __restrict__ part_acc,
                   const float* __restrict__ part_m, const float* __restrict__ part_l, const float* __restrict__ gate,
                   int has_gate, int gate_stride, int gate_row_stride, float* __restrict__ out, int out_row_stride,
                   int num_heads, int head_dim, int kind, u16* __restrict__ xs, int xs_row_stride, int fused,
                   int fused_max_chunks) {
  PDL_ENTER
  __shared__ float scratch[32];
  __shared__ float wt[COMBINE_TILE], lt[COMBINE_TILE];
  const int* slot = slots + (size_t)blockIdx.z * SLOT_FIELDS;
  const int chunks = slot[SLOT_POS] / ATTN_CHUNK + 1, r = slot[SLOT_ROW], c0 = slot[SLOT_CHUNK0];
  if (fused && chunks <= fused_max_chunks) return;  // the whole block: before any barrier
  const size_t hd = (size_t)num_heads * head_dim;
  const int d0 = blockIdx.y * blockDim.x;  // this block's channels: d0 .. d0 + width - 1
  combine_rows<1, COMBINE_TILE, 16>(blockIdx.x, 1, part_acc + (size_t)c0 * hd, part_m + (size_t)c0 * num_heads,
                                    part_l + (size_t)c0 * num_heads, gate + (size_t)r * gate_row_stride, has_gate,
                                    gate_stride, kind == SPLIT_NONE ? out + (size_t)r * out_row_stride : out,
                                    num_heads, head_dim, chunks, num_heads, kind,
                                    kind == SPLIT_NONE ? xs : xs + (size_t)r * xs_row_stride, scratch, wt, lt, d0,
                                    min((int)blockDim.x, head_dim - d0));
}
