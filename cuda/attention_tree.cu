// attention_tree.cu: gated full attention for many new rows at once: tree verify (N draft nodes, each at position
// P + depth over the cache prefix [0, P) and its own path) and prefill (T tokens, causal). Spec §5; references in
// tandem/backend/cuda/attention_tree.py (`reference_tree`, `reference_prefill`, numpy_ops compositions).
//
// attn_prep_rows  grid (ceil((H + Hkv) / 8), T), block 256: warp w RMSNorms + RoPEs head 8·blockIdx.x + w of row
//                 t with attention_common.cuh's norm_rope_head (the function attention_decode.cu's attn_partial
//                 preps with) at pos = pos0 + (depths ? depths[t] : t); q to q_out [T, H, D], k / v rows to
//                 k_dst / v_dst row dst_row0 + t (tree: the node scratch; prefill: the cache rows start + t).
// tree_partial    grid (N, Hkv, C), block 256, dynamic shared 64·D floats: attn_partial for node blockIdx.x's G query
//                 rows of KV head j over absolute 64-row chunk c = C - 1 - blockIdx.z. Rows < P come from the cache
//                 (read before pdl_wait: V by cp.async into shared memory, K into registers, warp w rows
//                 8w..8w+7); rows P + d from the node scratch of the node's ancestor at depth d (one walk of a
//                 shared copy of parent_ids), V and K the same way, so every row arrives in one round trip.
//                 Scores, softmax and the weighted V sum go through attention_common.cuh's chunk_dot /
//                 chunk_softmax and the same in-order fmaf chain as attn_partial, so with attn_combine a node's
//                 output has the bits of a decode at its position over its path. A chunk a node does not reach
//                 gets m = -inf, l = 0, acc = 0, which leaves attn_combine's sums unchanged.
// prefill_partial grid (ceil(T / tile_tokens), Hkv, splits), block 512, dynamic shared (2 · 64 D + 72 D + 72 · 72)
//                 floats, one block an SM: decode's partials (attn_partial's arithmetic, 64-row chunks) for the
//                 tile's query rows (tokens × G heads of KV head j) over the block's run of chunks, each chunk's
//                 K / V rows loaded once for all of them (kernel comment below); with attn_combine a prefill row
//                 has the bits of a decode at its position. The prefill the engine runs.
// prefill_attn    grid (ceil(T / 32), H, C), block 256, dynamic shared (32 D + 2 · 32 (D + 4) + 32 · 32)
//                 floats: flash attention on fp32 cores, split over the keys: block (tile, h, c) takes 32 query
//                 rows of head h (4 per warp) over the keys of absolute chunk c, [256 c, 256 c + 256), in key
//                 tiles of 32 rows (one per lane; K and V tiles by cp.async into two buffers, each landing during
//                 the other's arithmetic) with an online softmax, and writes the chunk's partials (m, l, acc) in
//                 attn_combine's layout; a row that sees no key of the chunk writes m = -inf, l = 0, acc = 0.
//                 attention_decode.cu's attn_combine then merges a row's chunks in order, · σ(gate) (y or the
//                 split operand xs). The chunks are absolute, so a row's bits depend on its position only, not on T
//                 or on where its piece starts (a restored cache continues as a fresh prefill).
// attn_commit_rows grid (L, 2), block 256: block (i, kv) copies node row path[i] of node_k (kv 0) / node_v (kv 1)
//                 to cache row start + i: the commit of an accepted path, in one launch (16-byte copies; the rows are
//                 Hkv · D floats, a multiple of 4, 16-byte aligned: the launcher checks). Its own launch so that a
//                 launch plan can replay a commit with the start set per call (attention_tree.py CommitStep).
// The tree's output is attention_decode.cu's attn_combine over rows N·H (row_heads H; it writes y or xs too).
// Layout: qg [T, H, 2D] (q then gate per head); k / v rows [*, Hkv, D]; fp32 throughout, except xs [T, P, H·D]
// u16 (common.cuh store_split: P = 2 fp16 hi + lo, in NVFP4 slot order for kind 2, or 3 bf16 hi + mid + lo).
// D ≤ 256, a multiple of 32; G = H / Hkv ≤ 8; N ≤ 64 (depth < 64).
// History: v1 tree split-K on decode's absolute 256-row chunks; fp32 flash prefill. v2 64-row chunks with K / V
// prefetch and the arithmetic shared with decode through attention_common.cuh; warp-per-head prep. v2.1
// prefill_attn optionally writes the split GEMV operand xs (kind, xs) instead of fp32 y. v2.2 tree_partial reads a
// node row's K once for the node's G query rows. v2.3 prefill_attn split over absolute 256-key chunks, merged by
// attn_combine: one block a head (24 blocks at 27B) walked every key alone; a 27B 4096-token prefill spent ~60 % of
// its time there (TTFT 4.57 -> 2.52 s, `python3 bench/decode.py --ttft 4096`). v2.4 K / V tiles double-buffered by
// cp.async (27B 4096-token prefill 2.09-2.21 -> 2.06-2.15 s, 9B 16384 tokens 4.01-4.08 -> 3.96 s). v3 tree_partial
// one node a block, its rows' K and V fetched in one round trip (cache rows before pdl_wait), node-row chunks
// launched first. v3.1 attn_commit_rows (the commit's row copies had been CuPy gathers: four host-side array
// operations a layer). v4 prefill_partial: prefill with decode's bits (prefill_attn kept as the unconstrained
// baseline, attention_tree.py exact=False).
#include "common.cuh"
#include "attention_common.cuh"

#define TREE_QMAX 8  // most query rows a KV head (attention_tree.py MAX_GROUP)
#define TREE_MAX_DEPTH 64
#define TREE_MAX_NODES 64  // attention_tree.py MAX_NODES: tree_partial's shared copy of parent_ids
#define PF_BK 32
#define PF_MAX_ND 8
#define PF_RM 4  // prefill_attn: query rows a warp (8 RM a block; 128 registers at 2 blocks an SM, no spill)
#define PF_BQ (8 * PF_RM)
#define PF_KC 256  // prefill_attn: keys of one split-K chunk (attention_tree.py PF_KC)

template <typename KV>
__device__ __forceinline__ void attn_prep_rows_impl(
    const float* __restrict__ qg, const float* __restrict__ k_new, const float* __restrict__ v_new,
    const float* __restrict__ q_norm, const float* __restrict__ k_norm, const float* __restrict__ inv_freq,
    const int* __restrict__ depths, int has_depths, float* __restrict__ q_out, KV* __restrict__ k_dst,
    KV* __restrict__ v_dst, int num_heads, int num_kv_heads, int head_dim, int rotary_dim, int pos0, int dst_row0,
    float eps) {
  __shared__ float stage[ATTN_WARPS][256];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int hb = blockIdx.x * ATTN_WARPS + warp, t = blockIdx.y;
  if (hb >= num_heads + num_kv_heads) return;
  const int pos = pos0 + (has_depths ? depths[t] : t);
  if (hb < num_heads) {
    norm_rope_head<float>(qg + ((size_t)t * num_heads + hb) * 2 * head_dim, q_norm, inv_freq, head_dim, rotary_dim,
                          pos, eps, stage[warp], q_out + ((size_t)t * num_heads + hb) * head_dim, nullptr);
    return;
  }
  const int j = hb - num_heads;
  const size_t row = ((size_t)(dst_row0 + t) * num_kv_heads + j) * head_dim;
  const size_t src = ((size_t)t * num_kv_heads + j) * head_dim;
  norm_rope_head<KV>(k_new + src, k_norm, inv_freq, head_dim, rotary_dim, pos, eps, stage[warp], nullptr,
                     k_dst + row);
  for (int d = lane; d < head_dim; d += 32) kv_store(v_dst + row + d, v_new[src + d]);
}
#define ATTN_PREP_ROWS_KERNEL(SUF, KV)                                                                         \
  extern "C" __global__ void __launch_bounds__(ATTN_THREADS) attn_prep_rows##SUF(                              \
      const float* __restrict__ qg, const float* __restrict__ k_new, const float* __restrict__ v_new,          \
      const float* __restrict__ q_norm, const float* __restrict__ k_norm, const float* __restrict__ inv_freq,  \
      const int* __restrict__ depths, int has_depths, float* __restrict__ q_out, KV* __restrict__ k_dst,       \
      KV* __restrict__ v_dst, int num_heads, int num_kv_heads, int head_dim, int rotary_dim, int pos0,         \
      int dst_row0, float eps) {                                                                               \
    PDL_ENTER                                                                                                  \
    attn_prep_rows_impl<KV>(qg, k_new, v_new, q_norm, k_norm, inv_freq, depths, has_depths, q_out, k_dst, v_dst, \
                            num_heads, num_kv_heads, head_dim, rotary_dim, pos0, dst_row0, eps);               \
  }
ATTN_PREP_ROWS_KERNEL(, float)
ATTN_PREP_ROWS_KERNEL(_bf16, kv_bf16)

// v3: one node a block (its G ≤ TREE_QMAX query rows), the chunk's V rows in shared memory (cp.async), K rows in
// registers (warp w: rows 8w .. 8w + 7), cache rows fetched before pdl_wait, node rows after one ancestor walk
// over a shared copy of parent_ids, so every row arrives in one round trip; the chunks that hold node rows are
// launched first (c = C - 1 - blockIdx.z). Before (v2, up to 8 query rows of several nodes a block): each node
// row's K and V were dependent L2 loads in loops the compiler did not pipeline.
#define TREE_PARTIAL_PARAMS(KV)                                                                                \
  const float *__restrict__ q, const KV *__restrict__ k_cache, const KV *__restrict__ v_cache,                  \
      const KV *__restrict__ node_k, const KV *__restrict__ node_v, const int *__restrict__ depths,              \
      const int *__restrict__ parent_ids, float *__restrict__ part_acc, float *__restrict__ part_m,             \
      float *__restrict__ part_l, int num_nodes, int num_heads, int num_kv_heads, int head_dim, int start,      \
      float scale, int chunk0
template <typename KV>
__device__ __forceinline__ void tree_partial_impl(TREE_PARTIAL_PARAMS(KV)) {
  extern __shared__ __align__(16) float vs_raw[];  // [ATTN_CHUNK][head_dim] of KV: the chunk's V rows
  KV* vs = reinterpret_cast<KV*>(vs_raw);
  __shared__ __align__(16) float qs[TREE_QMAX][256];
  __shared__ float sc[TREE_QMAX][ATTN_CHUNK];
  __shared__ int anc[TREE_MAX_DEPTH];  // anc[dd]: the node's ancestor at depth dd (itself at its depth)
  __shared__ int par[TREE_MAX_NODES];
  const int node = blockIdx.x, j = blockIdx.y, c = chunk0 + gridDim.z - 1 - blockIdx.z;
  const int group = num_heads / num_kv_heads;
  const int p0 = c * ATTN_CHUNK;
  const int ns = max(0, min(ATTN_CHUNK, start - p0));  // rows of this chunk that come from the cache
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, d = threadIdx.x;
  const int d4 = head_dim / 4;
  const int ru = head_dim * (int)sizeof(KV) / 16;  // 16-byte pieces of a row
  const size_t kv_stride = (size_t)num_kv_heads * head_dim;

  // Cache rows, before pdl_wait (common.cuh rule 2: in a tree verify the launch before tree_partial is
  // attn_prep_rows, which writes the node scratch, never the cache), through L2: V by cp.async into vs, K into
  // registers.
  for (int i = threadIdx.x; i < ns * ru; i += ATTN_THREADS) {
    const int p = i / ru, e = i - p * ru;
    cp_async16(smem_u32(reinterpret_cast<char*>(vs + p * head_dim) + 16 * e),
               reinterpret_cast<const char*>(v_cache + (size_t)(p0 + p) * kv_stride + (size_t)j * head_dim) + 16 * e,
               true);
  }
  float4 kk[ATTN_ROWS_PER_WARP][2];
#pragma unroll
  for (int r = 0; r < ATTN_ROWS_PER_WARP; ++r) {
    const int p = warp * ATTN_ROWS_PER_WARP + r;
    if (p < ns) {
      load_row4<true>(k_cache + (size_t)(p0 + p) * kv_stride + (size_t)j * head_dim, d4, lane, kk[r]);
    } else {
      kk[r][0] = kk[r][1] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
  }
  PDL_ENTER

  const int depth = depths[node];
  const int nr = min(ATTN_CHUNK, start + depth + 1 - p0);  // rows of the chunk the node sees; ≤ 0: none
  const size_t o_row = (size_t)c * num_nodes * num_heads + (size_t)node * num_heads + (size_t)j * group;
  if (nr <= 0) {  // the node ends before chunk c: m = -inf, l = 0, acc = 0 leave attn_combine's sums unchanged
    if ((int)threadIdx.x < group) {
      part_m[o_row + threadIdx.x] = TANDEM_NEG_INF;
      part_l[o_row + threadIdx.x] = 0.0f;
    }
    for (int i = threadIdx.x; i < group * head_dim; i += ATTN_THREADS) part_acc[o_row * head_dim + i] = 0.0f;
    return;
  }
  // The G query rows, every load in flight at once (≤ 8 a thread).
  {
    float qv[TREE_QMAX];
    const float* qsrc = q + ((size_t)node * num_heads + (size_t)j * group) * head_dim;
#pragma unroll
    for (int u = 0; u < TREE_QMAX; ++u) {
      const int i = threadIdx.x + u * ATTN_THREADS;
      qv[u] = i < group * head_dim ? qsrc[i] : 0.0f;
    }
#pragma unroll
    for (int u = 0; u < TREE_QMAX; ++u) {
      const int i = threadIdx.x + u * ATTN_THREADS;
      if (i < group * head_dim) qs[i / head_dim][i % head_dim] = qv[u];
    }
  }
  if (nr > ns) {  // node rows P + dd, dd in [dd0, dd0 + nr - ns): the ancestors at those depths
    const int dd0 = p0 + ns - start;
    if ((int)threadIdx.x < num_nodes) par[threadIdx.x] = parent_ids[threadIdx.x];
    __syncthreads();
    if (threadIdx.x == 0) {
      int m = node;
      for (int dd = depth; dd >= dd0; --dd) {
        anc[dd] = m;
        m = par[m];
      }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < (nr - ns) * ru; i += ATTN_THREADS) {
      const int pr = i / ru, e = i - pr * ru;
      const int m = anc[dd0 + pr];
      cp_async16(smem_u32(reinterpret_cast<char*>(vs + (ns + pr) * head_dim) + 16 * e),
                 reinterpret_cast<const char*>(node_v + (size_t)m * kv_stride + (size_t)j * head_dim) + 16 * e, true);
    }
#pragma unroll
    for (int r = 0; r < ATTN_ROWS_PER_WARP; ++r) {
      const int p = warp * ATTN_ROWS_PER_WARP + r;
      if (p >= ns && p < nr)
        load_row4(node_k + (size_t)anc[p0 + p - start] * kv_stride + (size_t)j * head_dim, d4, lane, kk[r]);
    }
  }
  cp_async_commit();
  __syncthreads();  // qs

  // Scores: this warp's rows against every query row of the node.
#pragma unroll
  for (int r = 0; r < ATTN_ROWS_PER_WARP; ++r) {
    const int p = warp * ATTN_ROWS_PER_WARP + r;
    if (p >= nr) continue;
#pragma unroll
    for (int qi = 0; qi < TREE_QMAX; ++qi) {
      if (qi < group) {
        const float s = chunk_dot(kk[r], qs[qi], d4, lane, scale);
        if (lane == 0) sc[qi][p] = s;
      }
    }
  }
  __syncthreads();
  for (int qi = warp; qi < group; qi += ATTN_WARPS) {
    float m, l;
    chunk_softmax(sc[qi], nr, lane, m, l);
    if (lane == 0) {
      part_m[o_row + qi] = m;
      part_l[o_row + qi] = l;
    }
  }
  cp_async_wait<0>();
  __syncthreads();  // the softmax weights and every thread's V rows

  if (d >= head_dim) return;
  float acc[TREE_QMAX];
#pragma unroll
  for (int qi = 0; qi < TREE_QMAX; ++qi) acc[qi] = 0.0f;
#pragma unroll 8
  for (int p = 0; p < nr; ++p) {  // cache rows, then node rows, in order
    const float v = kv_load(vs + p * head_dim + d);
#pragma unroll
    for (int qi = 0; qi < TREE_QMAX; ++qi)
      if (qi < group) acc[qi] = fmaf(sc[qi][p], v, acc[qi]);
  }
#pragma unroll
  for (int qi = 0; qi < TREE_QMAX; ++qi)
    if (qi < group) part_acc[(o_row + qi) * head_dim + d] = acc[qi];
}
#define TREE_PARTIAL_KERNEL(SUF, KV)                                                                           \
  extern "C" __global__ void __launch_bounds__(ATTN_THREADS, 2) tree_partial##SUF(TREE_PARTIAL_PARAMS(KV)) {   \
    tree_partial_impl<KV>(q, k_cache, v_cache, node_k, node_v, depths, parent_ids, part_acc, part_m, part_l,    \
                          num_nodes, num_heads, num_kv_heads, head_dim, start, scale, chunk0);                \
  }
TREE_PARTIAL_KERNEL(, float)
TREE_PARTIAL_KERNEL(_bf16, kv_bf16)

#define PREFILL_ATTN_PARAMS(KV)                                                                                \
  const float *__restrict__ q, const KV *__restrict__ k_cache, const KV *__restrict__ v_cache,                  \
      float *__restrict__ part_acc, float *__restrict__ part_m, float *__restrict__ part_l, int num_tokens,    \
      int num_heads, int num_kv_heads, int head_dim, int start, float scale
// Rows [row0, row0 + nrows) of a [*, stride] fp32 matrix at src, columns [0, dim), into shared memory dst [nrows][ks]
// (rows at or past row_lim: zeros), by every thread of the block: 16-byte loads, PF_LOAD_BATCH of them in flight a
// thread before their stores (one memory round trip a batch; a load-store loop waited on each load in turn). The
// query rows of prefill_attn.
#define PF_LOAD_BATCH 8
__device__ __forceinline__ void load_rows_smem(float* dst, int ks, const float* __restrict__ src, size_t stride,
                                               int row0, int nrows, int row_lim, int dim) {
  const int per_row = dim >> 2, n4 = nrows * per_row;
  for (int b = 0; b < n4; b += PF_LOAD_BATCH * (int)blockDim.x) {
    float4 v[PF_LOAD_BATCH];
#pragma unroll
    for (int u = 0; u < PF_LOAD_BATCH; ++u) {
      const int i = b + u * (int)blockDim.x + (int)threadIdx.x, r = i / per_row, e = 4 * (i - r * per_row);
      v[u] = (i < n4 && row0 + r < row_lim)
                 ? __ldg(reinterpret_cast<const float4*>(src + (size_t)(row0 + r) * stride + e))
                 : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
#pragma unroll
    for (int u = 0; u < PF_LOAD_BATCH; ++u) {
      const int i = b + u * (int)blockDim.x + (int)threadIdx.x, r = i / per_row, e = 4 * (i - r * per_row);
      if (i < n4) {
        float* d = dst + r * ks + e;
        d[0] = v[u].x; d[1] = v[u].y; d[2] = v[u].z; d[3] = v[u].w;
      }
    }
  }
}

// K and V tiles in two buffers (rows D + 4 floats: 16-byte aligned, and a quarter-warp's 16-byte K reads at
// lane · (D + 4) + e hit 8 different 4-bank groups) filled by cp.async, each overlapping the other's arithmetic: V of
// tile i lands during tile i's scores, K of tile i + 1 during tile i's weighted sum (a form that loaded each tile and
// then used it, same bits, measured slower: docs/performance.md).
template <typename KV>
__device__ __forceinline__ void prefill_attn_impl(PREFILL_ATTN_PARAMS(KV)) {
  extern __shared__ float4 smem4[];
  // K / V tile rows: ks stored values (D + 4 floats or D + 8 bf16: 16-byte aligned rows) in regions of D + 4 floats
  const int dim = head_dim, ks = head_dim + 16 / (int)sizeof(KV), nd = head_dim / 32;
  float* sq = reinterpret_cast<float*>(smem4);  // [BQ][D]
  KV* sk = reinterpret_cast<KV*>(sq + PF_BQ * dim);                 // [BK][ks]: K of one key tile
  KV* sv = reinterpret_cast<KV*>(sq + PF_BQ * dim + PF_BK * (dim + 4));  // [BK][ks]: V of one key tile
  float* sp = sq + PF_BQ * dim + 2 * PF_BK * (dim + 4);             // [BQ][BK]: probabilities of the tile
  const int tile = blockIdx.x, h = blockIdx.y, chunk = blockIdx.z;
  const int j = h / (num_heads / num_kv_heads);
  const int t0 = tile * PF_BQ;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const size_t kv_stride = (size_t)num_kv_heads * head_dim, rows = (size_t)num_tokens * num_heads;
  const int key_end = min(start + num_tokens, start + t0 + PF_BQ);  // the block's last query sees key_end - 1
  const int k_lo = chunk * PF_KC, k_hi = min(key_end, k_lo + PF_KC);
  const KV* kbase = k_cache + (size_t)j * dim;
  const KV* vbase = v_cache + (size_t)j * dim;
  // One asynchronous copy group of a tile's rows [r0, r0 + BK) into dst (rows at or past k_hi: zeros).
  auto issue = [&](KV* dst, const KV* src, int r0) {
    const int per_row = dim * (int)sizeof(KV) / 16, n4 = PF_BK * per_row;
    for (int i = threadIdx.x; i < n4; i += blockDim.x) {
      const int r = i / per_row, e = 16 * (i - r * per_row), kr = r0 + r;
      const bool in = kr < k_hi;
      cp_async16(smem_u32(reinterpret_cast<char*>(dst + r * ks) + e),
                 reinterpret_cast<const char*>(src + (size_t)(in ? kr : k_lo) * kv_stride) + e, in);
    }
    cp_async_commit();
  };
  float mrun[PF_RM], lrun[PF_RM], acc[PF_RM][PF_MAX_ND];
#pragma unroll
  for (int m = 0; m < PF_RM; ++m) {
    mrun[m] = TANDEM_NEG_INF;
    lrun[m] = 0.0f;
#pragma unroll
    for (int i = 0; i < PF_MAX_ND; ++i) acc[m][i] = 0.0f;
  }
  if (k_lo < k_hi) {
    issue(sk, kbase, k_lo);
    load_rows_smem(sq, dim, q + (size_t)h * dim, (size_t)num_heads * dim, t0, PF_BQ, num_tokens, dim);
  }
  for (int k0 = k_lo; k0 < k_hi; k0 += PF_BK) {
    cp_async_wait<0>();  // this thread's copies of tile k0's K
    __syncthreads();  // every thread's K copies, sq; the previous tile's V is no longer read
    issue(sv, vbase, k0);
    float s[PF_RM];
#pragma unroll
    for (int m = 0; m < PF_RM; ++m) s[m] = 0.0f;
    const KV* krow = sk + lane * ks;
    for (int e = 0; e < dim; e += 4) {
      const float4 kk = load_kv4(krow + e);
      const float k0v = kk.x, k1v = kk.y, k2v = kk.z, k3v = kk.w;
#pragma unroll
      for (int m = 0; m < PF_RM; ++m) {
        const float4 qq = *reinterpret_cast<const float4*>(sq + (warp + 8 * m) * dim + e);
        s[m] = fmaf(qq.x, k0v, s[m]);
        s[m] = fmaf(qq.y, k1v, s[m]);
        s[m] = fmaf(qq.z, k2v, s[m]);
        s[m] = fmaf(qq.w, k3v, s[m]);
      }
    }
    const int kr = k0 + lane;
#pragma unroll
    for (int m = 0; m < PF_RM; ++m) {
      const int r = warp + 8 * m;
      const float score = (kr < k_hi && kr <= start + t0 + r) ? __fmul_rn(s[m], scale) : TANDEM_NEG_INF;
      const float mnew = fmaxf(mrun[m], warp_max(score));
      float p = 0.0f, alpha = 1.0f;  // a row that sees no key of the chunk yet keeps m = -inf, l = 0, acc = 0
      if (mnew != TANDEM_NEG_INF) {  // warp-uniform
        alpha = expf(__fsub_rn(mrun[m], mnew));
        p = expf(__fsub_rn(score, mnew));
      }
      lrun[m] = fmaf(lrun[m], alpha, warp_sum(p));
#pragma unroll
      for (int i = 0; i < PF_MAX_ND; ++i) acc[m][i] = __fmul_rn(acc[m][i], alpha);
      sp[r * PF_BK + lane] = p;
      mrun[m] = mnew;
    }
    __syncthreads();  // every warp is done with K; sp is written
    if (k0 + PF_BK < k_hi) {
      issue(sk, kbase, k0 + PF_BK);
      cp_async_wait<1>();  // V of this tile (the K copies may still run)
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    for (int k = 0; k < PF_BK; ++k) {
      float vk[PF_MAX_ND];
#pragma unroll
      for (int i = 0; i < PF_MAX_ND; ++i) vk[i] = i < nd ? kv_load(sv + k * ks + lane + 32 * i) : 0.0f;
#pragma unroll
      for (int m = 0; m < PF_RM; ++m) {
        const float pk = sp[(warp + 8 * m) * PF_BK + k];
#pragma unroll
        for (int i = 0; i < PF_MAX_ND; ++i) acc[m][i] = fmaf(pk, vk[i], acc[m][i]);
      }
    }
  }
  // The chunk's partials of row (t, h): attn_combine's layout [C, T·H] (m, l) and [C, T·H, D] (acc).
#pragma unroll
  for (int m = 0; m < PF_RM; ++m) {
    const int t = t0 + warp + 8 * m;
    if (t >= num_tokens) continue;
    const size_t row = (size_t)chunk * rows + (size_t)t * num_heads + h;
    if (lane == 0) {
      part_m[row] = mrun[m];
      part_l[row] = lrun[m];
    }
#pragma unroll
    for (int i = 0; i < PF_MAX_ND; ++i)
      if (i < nd) part_acc[row * dim + lane + 32 * i] = acc[m][i];
  }
}

#define PREFILL_ATTN_KERNEL(SUF, KV)                                                                           \
  extern "C" __global__ void __launch_bounds__(256, 2) prefill_attn##SUF(PREFILL_ATTN_PARAMS(KV)) {            \
    PDL_ENTER                                                                                                  \
    prefill_attn_impl<KV>(q, k_cache, v_cache, part_acc, part_m, part_l, num_tokens, num_heads, num_kv_heads,   \
                          head_dim, start, scale);                                                             \
  }
PREFILL_ATTN_KERNEL(, float)
PREFILL_ATTN_KERNEL(_bf16, kv_bf16)

// prefill_partial: attn_partial's arithmetic (attention_common.cuh, the same absolute 64-row chunks) for the query
// rows of `tile_tokens` tokens × G heads of KV head j (row r: token t0 + r / G, head j G + r % G; ≤ PX_ROWS rows),
// over the chunks [z · chunks_per_split, ..) of block z, one after another. Per chunk: the K rows land in ks, warp w
// copies rows KPW w .. KPW w + KPW - 1 into registers and the next chunk's K is issued into ks; scores of RPG query
// rows × the warp's KPW keys at a time (32 scores): 32 lane_dot_regs chains, then warp_sum_each (warp_sum's bits),
// · D^-1/2; chunk_softmax per row over the n = min(64, pos + 1 - 64 c) keys the row sees; V (landed in vs
// meanwhile): acc = fmaf chain over p = 0 .. n - 1 of e_p · v_p, thread (channel quad, row group). A chunk no row of
// the tile reaches, and a row's chunk past its position, get m = -inf, l = 0, acc = 0 (attn_combine's sums
// unchanged), so attn_combine over all C chunks gives every row the bits of attention_decode_step at its position.
// Shared (dynamic): ks, vs [64][D], qs [PX_ROWS][D], sc [PX_ROWS][PX_SCS] floats. NW warps a block, one block an SM.
#define PX_ROWS 72  // query rows a block (attention_grid.py PX_ROWS)
#define PX_SCS 72   // sc's floats a row (≥ 64, a multiple of 4)
#define PX_WARPS 16  // attention_grid.py PX_WARPS
template <int NW, typename KV>
__device__ __forceinline__ void prefill_partial_impl(
    const float* __restrict__ q, const KV* __restrict__ k_cache, const KV* __restrict__ v_cache,
    float* __restrict__ part_acc, float* __restrict__ part_m, float* __restrict__ part_l, int num_tokens,
    int num_heads, int num_kv_heads, int head_dim, int start, float scale, int tile_tokens, int chunks_per_split,
    int num_chunks) {
  constexpr int THREADS = NW * 32, KPW = ATTN_CHUNK / NW, RPG = 32 / KPW;  // keys a warp, rows a score group
  constexpr int RPT = (PX_ROWS + THREADS / 64 - 1) / (THREADS / 64);      // V-sum rows a thread (at D = 256)
  extern __shared__ float4 smem4[];
  const int dim = head_dim, d4 = head_dim / 4;
  float* kf = reinterpret_cast<float*>(smem4);
  KV* ks = reinterpret_cast<KV*>(kf);                     // [64][D] stored values (in a region of 64 D floats)
  KV* vs = reinterpret_cast<KV*>(kf + ATTN_CHUNK * dim);  // [64][D]
  float* qs = kf + 2 * ATTN_CHUNK * dim;                  // [PX_ROWS][D]
  float* sc = qs + PX_ROWS * dim;                // [PX_ROWS][PX_SCS]
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, tid = threadIdx.x;
  const int group = num_heads / num_kv_heads, j = blockIdx.y;
  const int t0 = blockIdx.x * tile_tokens, nt = min(tile_tokens, num_tokens - t0);
  const int nrows = nt * group;
  const size_t kv_stride = (size_t)num_kv_heads * dim, rows_total = (size_t)num_tokens * num_heads;
  const int key_end = start + t0 + nt;  // the tile's last row sees keys [0, key_end)
  const int c_lo = blockIdx.z * chunks_per_split, c_hi = min(num_chunks, c_lo + chunks_per_split);
  const int c_reach = min(c_hi, (key_end + ATTN_CHUNK - 1) / ATTN_CHUNK);
  const KV* kbase = k_cache + (size_t)j * dim;
  const KV* vbase = v_cache + (size_t)j * dim;
  const int ru = dim * (int)sizeof(KV) / 16;  // 16-byte pieces of a row
  // partial row of tile row r in chunk c (attn_combine's layout: [C, T·H] rows)
  auto prow = [&](int c, int r) -> size_t {
    return (size_t)c * rows_total + (size_t)(t0 + r / group) * num_heads + (size_t)j * group + r % group;
  };
  // One copy group: chunk c's rows [64 c, key_end) into dst (rows past: zeros); c ≥ c_reach: an empty group.
  auto issue = [&](KV* dst, const KV* base, int c) {
    if (c < c_reach) {
      const int p0 = c * ATTN_CHUNK, nk = min(ATTN_CHUNK, key_end - p0);
      for (int i = tid; i < ATTN_CHUNK * ru; i += THREADS) {
        const int p = i / ru, e = i - p * ru;
        const bool in = p < nk;
        cp_async16(smem_u32(reinterpret_cast<char*>(dst + p * dim) + 16 * e),
                   reinterpret_cast<const char*>(base + (size_t)(in ? p0 + p : p0) * kv_stride) + 16 * e, in);
      }
    }
    cp_async_commit();
  };
  if (c_lo < c_reach) {
    issue(ks, kbase, c_lo);
    issue(vs, vbase, c_lo);
    load_rows_smem(qs, group * dim, q + (size_t)j * group * dim, (size_t)num_heads * dim, t0, nt, num_tokens,
                   group * dim);
  }
  const int nq = d4, nrg = THREADS / nq, cq = tid % nq, rg = tid / nq;  // the V sum's thread layout
  for (int c = c_lo; c < c_reach; ++c) {
    const int p0 = c * ATTN_CHUNK;
    cp_async_wait<1>();  // this thread's K copies of chunk c (V of chunk c may still run)
    __syncthreads();     // every thread's; qs
    float4 kk[KPW][2];
#pragma unroll
    for (int r = 0; r < KPW; ++r) load_row4(ks + (warp * KPW + r) * dim, d4, lane, kk[r]);
    __syncthreads();  // ks read by every warp
    issue(ks, kbase, c + 1);
    for (int r0 = 0; r0 < nrows; r0 += RPG) {
      float v[32];
#pragma unroll
      for (int i = 0; i < RPG; ++i) {
        float4 q4[2];
#pragma unroll
        for (int u = 0; u < 2; ++u)
          q4[u] = lane + 32 * u < d4 ? *reinterpret_cast<const float4*>(qs + (r0 + i) * dim + 4 * (lane + 32 * u))
                                     : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
        for (int r = 0; r < KPW; ++r) v[i * KPW + r] = lane_dot_regs(kk[r], q4, d4, lane);
      }
      const float s = warp_sum_each(v, lane);  // score of row r0 + lane / KPW, key KPW warp + lane % KPW
      const int row = r0 + lane / KPW;
      if (row < nrows) sc[row * PX_SCS + warp * KPW + lane % KPW] = __fmul_rn(s, scale);
    }
    __syncthreads();  // sc
    for (int r = warp; r < nrows; r += NW) {
      float m, l;
      chunk_softmax(sc + r * PX_SCS, min(ATTN_CHUNK, start + t0 + r / group + 1 - p0), lane, m, l);
      if (lane == 0) {
        part_m[prow(c, r)] = m;
        part_l[prow(c, r)] = l;
      }
    }
    cp_async_wait<1>();  // this thread's V copies of chunk c (K of chunk c + 1 may still run)
    __syncthreads();     // every thread's; the weights e_p in sc
    if (rg < nrg) {
      float4 acc[RPT];
#pragma unroll
      for (int i = 0; i < RPT; ++i) acc[i] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      const KV* vcol = vs + 4 * cq;
      if (start + t0 + 1 - p0 >= ATTN_CHUNK) {  // the first row sees the whole chunk, so every row does
        for (int p = 0; p < ATTN_CHUNK; p += 4) {
          float4 vv[4];
#pragma unroll
          for (int u = 0; u < 4; ++u) vv[u] = load_kv4(vcol + (p + u) * dim);
#pragma unroll
          for (int i = 0; i < RPT; ++i) {
            const int r = rg + nrg * i;
            if (r < nrows) {
              const float4 e4 = *reinterpret_cast<const float4*>(sc + r * PX_SCS + p);
              const float ew[4] = {e4.x, e4.y, e4.z, e4.w};
#pragma unroll
              for (int u = 0; u < 4; ++u) {
                acc[i].x = fmaf(ew[u], vv[u].x, acc[i].x);
                acc[i].y = fmaf(ew[u], vv[u].y, acc[i].y);
                acc[i].z = fmaf(ew[u], vv[u].z, acc[i].z);
                acc[i].w = fmaf(ew[u], vv[u].w, acc[i].w);
              }
            }
          }
        }
      } else {  // the diagonal chunk: row r sums its n_r keys
        const int n_all = min(ATTN_CHUNK, key_end - p0);
        for (int p = 0; p < n_all; ++p) {
          const float4 vv = load_kv4(vcol + p * dim);
#pragma unroll
          for (int i = 0; i < RPT; ++i) {
            const int r = rg + nrg * i;
            if (r < nrows && p < start + t0 + r / group + 1 - p0) {
              const float e = sc[r * PX_SCS + p];
              acc[i].x = fmaf(e, vv.x, acc[i].x);
              acc[i].y = fmaf(e, vv.y, acc[i].y);
              acc[i].z = fmaf(e, vv.z, acc[i].z);
              acc[i].w = fmaf(e, vv.w, acc[i].w);
            }
          }
        }
      }
#pragma unroll
      for (int i = 0; i < RPT; ++i) {
        const int r = rg + nrg * i;
        if (r < nrows) *reinterpret_cast<float4*>(part_acc + prow(c, r) * dim + 4 * cq) = acc[i];
      }
    }
    __syncthreads();  // vs and sc consumed
    issue(vs, vbase, c + 1);
  }
  // Chunks of this block that no row of the tile reaches: empty partials.
  for (int c = max(c_lo, c_reach); c < c_hi; ++c) {
    for (int r = tid; r < nrows; r += THREADS) {
      part_m[prow(c, r)] = TANDEM_NEG_INF;
      part_l[prow(c, r)] = 0.0f;
    }
    for (int i = tid; i < nrows * d4; i += THREADS) {
      const int r = i / d4, e = i - r * d4;
      *reinterpret_cast<float4*>(part_acc + prow(c, r) * dim + 4 * e) = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
  }
}

// 16 warps (PX_WARPS): 4 keys a warp, score groups of 8 rows, 128 registers. 8 warps (8 keys a warp, 162 registers)
// gave the same bits, slower (bench/results/cuda_prefill_attention_27b_h200.json).
#define PREFILL_PARTIAL_KERNEL(SUF, KV)                                                                        \
  extern "C" __global__ void __launch_bounds__(PX_WARPS * 32, 1) prefill_partial##SUF(                         \
      const float* __restrict__ q, const KV* __restrict__ k_cache, const KV* __restrict__ v_cache,             \
      float* __restrict__ part_acc, float* __restrict__ part_m, float* __restrict__ part_l, int num_tokens,   \
      int num_heads, int num_kv_heads, int head_dim, int start, float scale, int tile_tokens,                  \
      int chunks_per_split, int num_chunks) {                                                                  \
    PDL_ENTER                                                                                                  \
    prefill_partial_impl<PX_WARPS, KV>(q, k_cache, v_cache, part_acc, part_m, part_l, num_tokens, num_heads,    \
                                       num_kv_heads, head_dim, start, scale, tile_tokens, chunks_per_split,    \
                                       num_chunks);                                                            \
  }
PREFILL_PARTIAL_KERNEL(, float)
PREFILL_PARTIAL_KERNEL(_bf16, kv_bf16)

// Rows of row_elems stored values (KV), copied as 16-byte pieces (row_elems · sizeof(KV) a multiple of 16).
#define ATTN_COMMIT_ROWS_KERNEL(SUF, KV)                                                                       \
  extern "C" __global__ void __launch_bounds__(256) attn_commit_rows##SUF(                                     \
      KV* __restrict__ k_cache, KV* __restrict__ v_cache, const KV* __restrict__ node_k,                       \
      const KV* __restrict__ node_v, const int* __restrict__ path, int start, int row_elems) {                 \
    PDL_ENTER                                                                                                  \
    const int i = blockIdx.x, row4 = row_elems * (int)sizeof(KV) / 16;                                         \
    const float4* src = reinterpret_cast<const float4*>(blockIdx.y ? node_v : node_k) + (size_t)path[i] * row4; \
    float4* dst = reinterpret_cast<float4*>(blockIdx.y ? v_cache : k_cache) + (size_t)(start + i) * row4;      \
    for (int e = threadIdx.x; e < row4; e += blockDim.x) dst[e] = src[e];                                      \
  }
ATTN_COMMIT_ROWS_KERNEL(, float)
ATTN_COMMIT_ROWS_KERNEL(_bf16, kv_bf16)
