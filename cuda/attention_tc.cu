// attention_tc.cu: decode and tree-verify attention of a gated full-attention layer on tensor cores, over bf16 KV
// rows (tandem/backend/cuda/attention_tc.py; its NumPy twin `reference_tc_decode` emulates the arithmetic below).
//
// Units: the key rows of absolute positions [64 u, 64 u + 64) (TC_UNIT, the same as attention_common.cuh's chunks),
// for decode and verify alike. For one unit, the G = H / Hkv query heads of KV head j of one query token (a decode
// position or a tree node) form one MMA tile of 16 rows: row g the bf16 hi part of head g's fp32 query, row 8 + g its
// lo part (bf16 of q - hi), the other rows zero (G ≤ 8). tc_unit computes, per row and unit (n ≤ 64 visible keys):
//   S = A · Kᵀ on mma.sync m16n8k16 (fp32 accumulators, k-steps over D in order: 16 dims a step);
//   score_p = (S[g, p] + S[8 + g, p]) · D^-1/2 (fp32, __fadd_rn / __fmul_rn);
//   m, e_p = expf(score_p - m), l: attention_common.cuh's chunk_softmax on the row's n scores (one warp a row);
//   P = e split likewise (row g bf16(e), row 8 + g bf16(e - bf16(e))), e_p = 0 for p ≥ n;
//   acc = P · V (k-steps over the unit's 64 keys in order), acc[g, d] = O[g, d] + O[8 + g, d].
// and writes (m, l, acc) to the partials in attn_combine's layout [C, rows(, D)], merged by attention_decode.cu's
// attn_combine in unit order. Rows past n are zeros in shared memory (never read from global memory), so NaN
// poison past a sequence's end cannot reach a row. Every MMA element depends on its own A row only, each score on
// one key column only, the softmax on the row alone, so a row's (m, l, acc) for a unit depends on its query, the
// unit's visible keys and values and n, never on the other rows of its tile, the tiles beside it, the warp
// assignment or the grid: a tree node's partials equal a decode's at its position over its path, bit for bit.
//
// attn_tc_decode<D>  grid (Hkv, B), block 256, dynamic shared tc_smem(D, 1) bytes, one block an SM: block (j, b)
//                    takes units [b·per, min(U, b·per + per)) of KV head j, U = ceil(num_rows / 64), each unit's
//                    K and V by cp.async into a 2-stage ring (the next unit lands while one is computed). Before the
//                    loop warps 0..G-1 RMSNorm + RoPE the query heads at pos = num_rows - 1 (norm_rope_head, the prep
//                    of attn_partial / attn_prep_rows); the block holding unit ⌊pos / 64⌋ also preps the new k row
//                    and v row (their stored bf16 bits: kv_store), writes them to cache row pos and puts them in
//                    the unit's tile instead of reading row pos, so the new row enters with the bits a later step
//                    reads from the cache. Then attn_combine (rows H).
// attn_tc_tree<D>    grid (shared_blocks + N · Hkv · tail_units), block 256, dynamic shared tc_smem(D, TC_NODES):
//                    blocks [0, shared_blocks): node group ng (TC_NODES nodes: one tile each), KV head j, a run of
//                    `per` units wholly below P (every node sees all 64 keys), the tiles sharing each unit's K / V
//                    tiles (order: ng fastest, then j, then the run). Blocks after: (node, j, unit c0 + t) for the
//                    units from c0 = ⌊P / 64⌋ on: rows < P from the cache, rows P + d from the node scratch of the
//                    node's ancestor at depth d, n = min(64, P + depth + 1 - 64 u); a node that ends before the unit
//                    writes m = -inf, l = 0, acc = 0 (attn_combine's sums unchanged). q: attn_prep_rows' [N, H, D].
// Layout: caches [max_len, Hkv, D] bf16 bits; node rows [N, Hkv, D] bf16 bits; partials acc [C, R, D], m / l [C, R]
// fp32 (R = H for decode, N·H for verify, row node·H + j·G + g). Shared rows padded to D + 8 bf16 (ldmatrix rows on
// distinct banks). D a multiple of 32, ≤ 256; G ≤ 8; N ≤ 64.
// History: v1.
#include "common.cuh"
#include "attention_common.cuh"
#include "mma.cuh"

#define TC_UNIT 64
#define TC_THREADS 256
#define TC_WARPS 8
#define TC_STAGES 2
#define TC_NODES 4   // tiles (nodes) a shared verify block (attention_tc.py TC_NODES)
#define TC_SC_LD 72  // floats a score row in shared memory (≥ 64; rows on different banks)
#define TC_MAX_NODES 64
#define TC_MAX_DEPTH 64

// Dynamic shared memory (bytes) of a block of NB tiles at head dim D: K and V rings, NB A tiles, NB · 8 score rows.
// attention_tc.py tc_smem must agree.
__host__ __device__ constexpr int tc_smem(int d, int nb) {
  return (2 * TC_STAGES * TC_UNIT * (d + 8) + nb * 16 * (d + 8)) * 2 + nb * 8 * TC_SC_LD * 4;
}

// q [G][D] fp32 (row stride q_stride floats) as one A tile [16][D + 8] bf16: row g = bf16(q_g), row 8 + g =
// bf16(q_g - bf16(q_g)), rows G..7 and 8 + G..15 zero. Round to nearest even (kv_bf16_bits, dtypes.f32_to_bf16).
// Every thread of the block; the caller syncs.
template <int D>
__device__ __forceinline__ void tc_split_q(u16* tile, const float* q, int q_stride, int group) {
  constexpr int LD = D + 8;
  for (int i = threadIdx.x; i < 8 * D; i += blockDim.x) {
    const int g = i / D, d = i - g * D;
    u16 hi = 0, lo = 0;
    if (g < group) {
      const float x = q[(size_t)g * q_stride + d];
      hi = kv_bf16_bits(x);
      lo = kv_bf16_bits(__fsub_rn(x, bf16_lo(hi)));
    }
    tile[g * LD + d] = hi;
    tile[(8 + g) * LD + d] = lo;
  }
}

// One unit for tiles [0, nt) (A tiles at sA, tile t's rows g < group), keys / values at sK / sV [64][D + 8] (rows ≥ n
// zero), n ≥ 1 visible keys. Writes part_m / part_l [unit · rows_total + row] and part_acc [(...) · D + d] for
// row = row_of(t, g). sc: [nt · 8][TC_SC_LD] floats. Every thread of the block (it holds barriers).
template <int D, typename RowOf>
__device__ __forceinline__ void tc_unit(const u16* sK, const u16* sV, const u16* sA, float* sc, int nt, int n,
                                        int group, float scale, RowOf row_of, size_t unit_rows,
                                        float* __restrict__ part_acc, float* __restrict__ part_m,
                                        float* __restrict__ part_l) {
  constexpr int LD = D + 8, KS = D / 16;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, c = lane & 3;
  // S: warp w, keys 8w .. 8w + 7 (one n-tile) of every tile; its K fragments loaded once for all tiles
  {
    u32 kb[KS][2];
#pragma unroll
    for (int ks = 0; ks < KS; ks += 2)
      ldsm_x4(smem_u32(sK + (8 * warp + (lane & 7)) * LD + ks * 16 + (lane >> 3) * 8), kb[ks][0], kb[ks][1],
              kb[ks + 1][0], kb[ks + 1][1]);
    for (int t = 0; t < nt; ++t) {
      float s[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      const u32 a_base = smem_u32(sA + (t * 16 + (lane & 15)) * LD + (lane >> 4) * 8);
#pragma unroll
      for (int ks = 0; ks < KS; ++ks) {
        u32 a0, a1, a2, a3;
        ldsm_x4(a_base + ks * 32, a0, a1, a2, a3);
        mma_bf16(s, a0, a1, a2, a3, kb[ks][0], kb[ks][1]);
      }
      if (g < group) {
        float* row = sc + (t * 8 + g) * TC_SC_LD + 8 * warp + 2 * c;
        row[0] = __fmul_rn(__fadd_rn(s[0], s[2]), scale);
        row[1] = __fmul_rn(__fadd_rn(s[1], s[3]), scale);
      }
    }
  }
  __syncthreads();
  // softmax: a warp a row (chunk_softmax: decode's statistics of n scores); weights past n zeroed
  for (int r = warp; r < nt * group; r += TC_WARPS) {
    const int t = r / group, gg = r - t * group;
    float* row = sc + (t * 8 + gg) * TC_SC_LD;
    float m, l;
    chunk_softmax(row, n, lane, m, l);
    for (int p = n + lane; p < TC_UNIT; p += 32) row[p] = 0.0f;
    if (lane == 0) {
      const size_t o = unit_rows + row_of(t, gg);
      part_m[o] = m;
      part_l[o] = l;
    }
  }
  __syncthreads();
  // P · V: warp w, dims 16 pr .. 16 pr + 15 for pr = w, w + 8, ... (two n-tiles a pair), keys in 4 k-steps in order
  constexpr int PAIRS = D / 16, PW = (PAIRS + TC_WARPS - 1) / TC_WARPS;
  for (int t = 0; t < nt; ++t) {
    float o[PW][2][4];
#pragma unroll
    for (int i = 0; i < PW; ++i)
#pragma unroll
      for (int h = 0; h < 2; ++h) o[i][h][0] = o[i][h][1] = o[i][h][2] = o[i][h][3] = 0.0f;
    const float* prow = sc + (t * 8 + g) * TC_SC_LD;
#pragma unroll
    for (int kk = 0; kk < TC_UNIT / 16; ++kk) {
      float e[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      if (g < group) {
        const float2 e01 = *reinterpret_cast<const float2*>(prow + kk * 16 + 2 * c);
        const float2 e23 = *reinterpret_cast<const float2*>(prow + kk * 16 + 2 * c + 8);
        e[0] = e01.x; e[1] = e01.y; e[2] = e23.x; e[3] = e23.y;
      }
      const u32 h01 = pack_bf16_rn(e[0], e[1]), h23 = pack_bf16_rn(e[2], e[3]);
      const u32 l01 = pack_bf16_rn(__fsub_rn(e[0], bf16_lo(h01)), __fsub_rn(e[1], bf16_hi(h01)));
      const u32 l23 = pack_bf16_rn(__fsub_rn(e[2], bf16_lo(h23)), __fsub_rn(e[3], bf16_hi(h23)));
      const int key = kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
#pragma unroll
      for (int i = 0; i < PW; ++i) {
        const int pr = warp + TC_WARPS * i;
        if (pr < PAIRS) {
          u32 b0, b1, b2, b3;
          ldsm_x4_t(smem_u32(sV + key * LD + pr * 16 + (lane >> 4) * 8), b0, b1, b2, b3);
          mma_bf16(o[i][0], h01, l01, h23, l23, b0, b1);
          mma_bf16(o[i][1], h01, l01, h23, l23, b2, b3);
        }
      }
    }
    if (g < group) {
      float* acc = part_acc + (unit_rows + row_of(t, g)) * D;
#pragma unroll
      for (int i = 0; i < PW; ++i) {
        const int pr = warp + TC_WARPS * i;
        if (pr < PAIRS) {
#pragma unroll
          for (int h = 0; h < 2; ++h)
            *reinterpret_cast<float2*>(acc + pr * 16 + h * 8 + 2 * c) =
                make_float2(__fadd_rn(o[i][h][0], o[i][h][2]), __fadd_rn(o[i][h][1], o[i][h][3]));
        }
      }
    }
  }
}

// One unit's K and V rows into a stage: row p (< 64) from src_k(p) / src_v(p) when p < n (pointers to D bf16 values),
// zeros past n (cp.async of 0 bytes from `fallback`, a valid address it does not read); row `skip` is left untouched
// (decode's new row, put in by the caller). The caller commits.
template <int D, typename Src>
__device__ __forceinline__ void tc_issue(u16* sK, u16* sV, int n, int skip, const kv_bf16* fallback, Src src) {
  constexpr int LD = D + 8, RU = D / 8;  // 16-byte pieces of a row
  for (int i = threadIdx.x; i < TC_UNIT * RU; i += blockDim.x) {
    const int p = i / RU, e = i - p * RU;
    if (p == skip) continue;
    const bool in = p < n;
    const kv_bf16* k = fallback;
    const kv_bf16* v = fallback;
    if (in) src(p, k, v);
    cp_async16(smem_u32(sK + p * LD + 8 * e), reinterpret_cast<const char*>(k) + (in ? 16 * e : 0), in);
    cp_async16(smem_u32(sV + p * LD + 8 * e), reinterpret_cast<const char*>(v) + (in ? 16 * e : 0), in);
  }
}

// Shared-memory carve-up of a block of NB tiles: stage s's K and V tiles, the A tiles, the score rows. Pointers are
// computed from the stage (no array of pointers a run-time index would put on the stack).
template <int D>
struct TcSmem {
  static constexpr int TILE = TC_UNIT * (D + 8);
  u16* base;
  u16* a;
  float* sc;
  __device__ __forceinline__ TcSmem(void* raw, int nb) : base(reinterpret_cast<u16*>(raw)) {
    a = base + 2 * TC_STAGES * TILE;
    sc = reinterpret_cast<float*>(a + nb * 16 * (D + 8));
  }
  __device__ __forceinline__ u16* k(int s) const { return base + 2 * s * TILE; }
  __device__ __forceinline__ u16* v(int s) const { return base + (2 * s + 1) * TILE; }
};

#define TC_DECODE_PARAMS                                                                                       \
  const float *__restrict__ q_src, int q_stride, const float *__restrict__ k_new, const float *__restrict__ v_new, \
      const float *__restrict__ q_norm, const float *__restrict__ k_norm, const float *__restrict__ inv_freq,     \
      int rotary_dim, float eps, kv_bf16 *__restrict__ keys, kv_bf16 *__restrict__ values,                      \
      float *__restrict__ part_acc, float *__restrict__ part_m, float *__restrict__ part_l, int num_heads,      \
      int num_kv_heads, int num_rows, float scale, int per

template <int D>
__device__ __forceinline__ void attn_tc_decode_impl(TC_DECODE_PARAMS) {
  extern __shared__ __align__(16) float tc_raw[];
  __shared__ __align__(16) float stage[TC_WARPS][256];
  __shared__ __align__(16) float qf[8][D];
  __shared__ __align__(16) kv_bf16 knew[D], vnew[D];
  TcSmem<D> sm(tc_raw, 1);
  constexpr int LD = D + 8;
  const int j = blockIdx.x, warp = threadIdx.x >> 5;
  const int group = num_heads / num_kv_heads, pos = num_rows - 1;
  const int units = (num_rows + TC_UNIT - 1) / TC_UNIT;
  const int u_lo = blockIdx.y * per, u_hi = min(units, u_lo + per);
  if (u_lo >= u_hi) return;
  const int u_new = pos / TC_UNIT, p_new = pos - u_new * TC_UNIT;
  const bool has_new = u_new < u_hi;  // this block holds the last unit (u_lo ≤ u_new always)
  const size_t kv_stride = (size_t)num_kv_heads * D;
  auto issue = [&](int i) {
    const int u = u_lo + i;
    if (u < u_hi) {
      const int n = min(TC_UNIT, num_rows - u * TC_UNIT);
      const size_t base = (size_t)u * TC_UNIT * kv_stride + (size_t)j * D;
      tc_issue<D>(sm.k(i % TC_STAGES), sm.v(i % TC_STAGES), n, u == u_new ? p_new : -1, keys,
                  [&](int p, const kv_bf16*& k, const kv_bf16*& v) {
                    k = keys + base + (size_t)p * kv_stride;
                    v = values + base + (size_t)p * kv_stride;
                  });
    }
    cp_async_commit();
  };
  issue(0);
  issue(1);
  // prep: the G query heads (fp32, as attn_partial), and in the last unit's block the new k / v rows as stored
  const int tasks = group + (has_new ? 1 : 0);
  for (int t = warp; t < tasks; t += TC_WARPS) {
    if (t < group) {
      norm_rope_head<float>(q_src + (size_t)(j * group + t) * q_stride, q_norm, inv_freq, D, rotary_dim, pos, eps,
                            stage[warp], qf[t], nullptr);
    } else {
      norm_rope_head<kv_bf16>(k_new + (size_t)j * D, k_norm, inv_freq, D, rotary_dim, pos, eps, stage[warp],
                              nullptr, knew);
    }
  }
  if (has_new)
    for (int d = threadIdx.x; d < D; d += blockDim.x) kv_store(vnew + d, v_new[(size_t)j * D + d]);
  __syncthreads();  // qf, knew, vnew
  tc_split_q<D>(sm.a, &qf[0][0], D, group);
  if (has_new)
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
      keys[(size_t)pos * kv_stride + (size_t)j * D + d] = knew[d];
      values[(size_t)pos * kv_stride + (size_t)j * D + d] = vnew[d];
    }
  auto row_of = [&](int, int g) { return (size_t)(j * group + g); };
  for (int i = 0; u_lo + i < u_hi; ++i) {
    const int u = u_lo + i, s = i % TC_STAGES;
    cp_async_wait<TC_STAGES - 1>();  // this thread's copies of unit i (unit i + 1 may still run)
    if (u == u_new)
      for (int d = threadIdx.x; d < D; d += blockDim.x) {
        sm.k(s)[p_new * LD + d] = knew[d].bits;
        sm.v(s)[p_new * LD + d] = vnew[d].bits;
      }
    __syncthreads();  // every thread's copies; the A tile (first pass)
    tc_unit<D>(sm.k(s), sm.v(s), sm.a, sm.sc, 1, min(TC_UNIT, num_rows - u * TC_UNIT), group, scale, row_of,
               (size_t)u * num_heads, part_acc, part_m, part_l);
    __syncthreads();  // stage s consumed
    issue(i + TC_STAGES);
  }
  cp_async_wait<0>();
}

#define TC_TREE_PARAMS                                                                                         \
  const float *__restrict__ q, const kv_bf16 *__restrict__ k_cache, const kv_bf16 *__restrict__ v_cache,        \
      const kv_bf16 *__restrict__ node_k, const kv_bf16 *__restrict__ node_v, const int *__restrict__ depths,    \
      const int *__restrict__ parent_ids, float *__restrict__ part_acc, float *__restrict__ part_m,             \
      float *__restrict__ part_l, int num_nodes, int num_heads, int num_kv_heads, int start, float scale,       \
      int shared_units, int per, int shared_blocks

template <int D>
__device__ __forceinline__ void attn_tc_tree_impl(TC_TREE_PARAMS) {
  extern __shared__ __align__(16) float tc_raw[];
  __shared__ int anc[TC_MAX_DEPTH];  // anc[dd]: the node's ancestor at depth dd (itself at its depth)
  __shared__ int par[TC_MAX_NODES];
  TcSmem<D> sm(tc_raw, TC_NODES);
  const int group = num_heads / num_kv_heads;
  const size_t kv_stride = (size_t)num_kv_heads * D, rows_total = (size_t)num_nodes * num_heads;
  int b = blockIdx.x;
  if (b < shared_blocks) {  // a node group's run of units below P
    const int groups = (num_nodes + TC_NODES - 1) / TC_NODES;
    const int ng = b % groups, j = (b / groups) % num_kv_heads, run = b / groups / num_kv_heads;
    const int u_lo = run * per, u_hi = min(shared_units, u_lo + per);
    const int node0 = ng * TC_NODES, nt = min(TC_NODES, num_nodes - node0);
    if (u_lo >= u_hi) return;
    auto issue = [&](int i) {
      const int u = u_lo + i;
      if (u < u_hi) {
        const size_t base = (size_t)u * TC_UNIT * kv_stride + (size_t)j * D;
        tc_issue<D>(sm.k(i % TC_STAGES), sm.v(i % TC_STAGES), TC_UNIT, -1, k_cache,
                    [&](int p, const kv_bf16*& k, const kv_bf16*& v) {
                      k = k_cache + base + (size_t)p * kv_stride;
                      v = v_cache + base + (size_t)p * kv_stride;
                    });
      }
      cp_async_commit();
    };
    issue(0);
    issue(1);
    for (int t = 0; t < nt; ++t)
      tc_split_q<D>(sm.a + t * 16 * (D + 8), q + ((size_t)(node0 + t) * num_heads + (size_t)j * group) * D, D,
                    group);
    auto row_of = [&](int t, int g) { return (size_t)(node0 + t) * num_heads + (size_t)j * group + g; };
    for (int i = 0; u_lo + i < u_hi; ++i) {
      const int u = u_lo + i, s = i % TC_STAGES;
      cp_async_wait<TC_STAGES - 1>();
      __syncthreads();
      tc_unit<D>(sm.k(s), sm.v(s), sm.a, sm.sc, nt, TC_UNIT, group, scale, row_of, (size_t)u * rows_total, part_acc,
                 part_m, part_l);
      __syncthreads();
      issue(i + TC_STAGES);
    }
    cp_async_wait<0>();
    return;
  }
  // a node's unit from ⌊P / 64⌋ on: cache rows below P, then its ancestors' rows
  b -= shared_blocks;
  const int node = b % num_nodes, j = (b / num_nodes) % num_kv_heads;
  const int u = shared_units + b / num_nodes / num_kv_heads;
  const int p0 = u * TC_UNIT, depth = depths[node];
  const int n = min(TC_UNIT, start + depth + 1 - p0);  // rows of the unit the node sees; ≤ 0: none
  const size_t o_row = (size_t)u * rows_total + (size_t)node * num_heads + (size_t)j * group;
  if (n <= 0) {  // m = -inf, l = 0, acc = 0 leave attn_combine's sums unchanged
    if ((int)threadIdx.x < group) {
      part_m[o_row + threadIdx.x] = TANDEM_NEG_INF;
      part_l[o_row + threadIdx.x] = 0.0f;
    }
    for (int i = threadIdx.x; i < group * D; i += blockDim.x) part_acc[o_row * D + i] = 0.0f;
    return;
  }
  const int ns = max(0, min(n, start - p0));  // rows from the cache
  if (n > ns) {  // node rows P + dd for dd in [p0 + ns - P, depth]
    if ((int)threadIdx.x < num_nodes) par[threadIdx.x] = parent_ids[threadIdx.x];
    __syncthreads();
    if (threadIdx.x == 0) {
      int m = node;
      for (int dd = depth; dd >= p0 + ns - start; --dd) {
        anc[dd] = m;
        m = par[m];
      }
    }
    __syncthreads();
  }
  const size_t col = (size_t)j * D;
  tc_issue<D>(sm.k(0), sm.v(0), n, -1, k_cache, [&](int p, const kv_bf16*& k, const kv_bf16*& v) {
    if (p < ns) {
      k = k_cache + (size_t)(p0 + p) * kv_stride + col;
      v = v_cache + (size_t)(p0 + p) * kv_stride + col;
    } else {
      const int m = anc[p0 + p - start];
      k = node_k + (size_t)m * kv_stride + col;
      v = node_v + (size_t)m * kv_stride + col;
    }
  });
  cp_async_commit();
  tc_split_q<D>(sm.a, q + ((size_t)node * num_heads + (size_t)j * group) * D, D, group);
  cp_async_wait<0>();
  __syncthreads();
  auto row_of = [&](int, int g) { return (size_t)node * num_heads + (size_t)j * group + g; };
  tc_unit<D>(sm.k(0), sm.v(0), sm.a, sm.sc, 1, n, group, scale, row_of, (size_t)u * rows_total, part_acc, part_m,
             part_l);
}

// Kernel names: attn_tc_decode<D>, attn_tc_tree<D> for D = 32, 64, ..., 256 (bf16 KV rows only).
#define ATTN_TC_KERNELS(D)                                                                                     \
  extern "C" __global__ void __launch_bounds__(TC_THREADS, 1) attn_tc_decode##D(TC_DECODE_PARAMS) {            \
    PDL_ENTER                                                                                                  \
    attn_tc_decode_impl<D>(q_src, q_stride, k_new, v_new, q_norm, k_norm, inv_freq, rotary_dim, eps, keys,      \
                           values, part_acc, part_m, part_l, num_heads, num_kv_heads, num_rows, scale, per);    \
  }                                                                                                            \
  extern "C" __global__ void __launch_bounds__(TC_THREADS, 1) attn_tc_tree##D(TC_TREE_PARAMS) {                \
    PDL_ENTER                                                                                                  \
    attn_tc_tree_impl<D>(q, k_cache, v_cache, node_k, node_v, depths, parent_ids, part_acc, part_m, part_l,     \
                         num_nodes, num_heads, num_kv_heads, start, scale, shared_units, per, shared_blocks);  \
  }
ATTN_TC_KERNELS(32)
ATTN_TC_KERNELS(64)
ATTN_TC_KERNELS(96)
ATTN_TC_KERNELS(128)
ATTN_TC_KERNELS(160)
ATTN_TC_KERNELS(192)
ATTN_TC_KERNELS(224)
ATTN_TC_KERNELS(256)
