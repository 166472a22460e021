// argmax.cu: ids[t] = argmax_j logits[t, j] on the device, so only token ids cross to the host.
// numpy.argmax semantics: the first maximum; a NaN counts as the maximum (the first NaN wins).
// (value, index) pairs form a total order, so the result is the same for any reduction order.
// Launch: argmax_partial grid (num_blocks, T), block 256 -> partials [T, num_blocks];
//         argmax_final grid T, block 256 -> ids [T] int32.
// top_k_partial / top_k_final: a drafter's k best ids of each row (the same order: larger value first, ties to the
// smaller id, a NaN first) with their logits, and the row's softmax normaliser (max, sum of exp(x - max)), so the
// host reads 2 + 2k words a row instead of the row. Launch: top_k_partial grid (num_blocks, T), block 256 ->
// partials [T, num_blocks, k] (values, ids) and [T, num_blocks, 2] (max, sum); top_k_final grid T, block 256 ->
// out [T, 2 + 2k] int32: max and sum (fp32 bits; the max of the non-NaN values), the k ids, the k values (fp32
// bits). Past V the rest are (-inf, 0x7FFFFFFF). The k best are exact for any reduction order (a total order); the sum's rounding
// depends on the block count only (fixed by V).
// History: v1 two passes; v1.1 top_k (the MTP drafter on the GPU).
#include "common.cuh"

// Whether (a, ia) is preferred to (b, ib).
__device__ __forceinline__ bool better(float a, int ia, float b, int ib) {
  const bool na = a != a, nb = b != b;
  if (na != nb) return na;
  if (!na && a != b) return a > b;
  return ia < ib;
}

__device__ __forceinline__ void block_best(float& v, int& i, float* sv, int* si) {
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) {
    const float ov = __shfl_xor_sync(0xFFFFFFFFu, v, m);
    const int oi = __shfl_xor_sync(0xFFFFFFFFu, i, m);
    if (better(ov, oi, v, i)) { v = ov; i = oi; }
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) { sv[warp] = v; si[warp] = i; }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < (int)(blockDim.x >> 5); ++w)
      if (better(sv[w], si[w], v, i)) { v = sv[w]; i = si[w]; }
  }
}

extern "C" __global__ void __launch_bounds__(256)
argmax_partial(const float* __restrict__ logits, float* __restrict__ part_val, int* __restrict__ part_idx,
               int vocab) {
  PDL_ENTER
  __shared__ float sv[32];
  __shared__ int si[32];
  const float* row = logits + (size_t)blockIdx.y * vocab;
  float v = TANDEM_NEG_INF;
  int i = 0x7FFFFFFF;
  for (int j = blockIdx.x * blockDim.x + threadIdx.x; j < vocab; j += gridDim.x * blockDim.x) {
    const float x = row[j];
    if (better(x, j, v, i)) { v = x; i = j; }
  }
  block_best(v, i, sv, si);
  if (threadIdx.x == 0) {
    part_val[blockIdx.y * gridDim.x + blockIdx.x] = v;
    part_idx[blockIdx.y * gridDim.x + blockIdx.x] = i;
  }
}

extern "C" __global__ void __launch_bounds__(256)
argmax_final(const float* __restrict__ part_val, const int* __restrict__ part_idx, int* __restrict__ ids,
             int num_parts) {
  PDL_ENTER
  __shared__ float sv[32];
  __shared__ int si[32];
  float v = TANDEM_NEG_INF;
  int i = 0x7FFFFFFF;
  for (int j = threadIdx.x; j < num_parts; j += blockDim.x) {
    const float x = part_val[blockIdx.x * num_parts + j];
    const int xi = part_idx[blockIdx.x * num_parts + j];
    if (better(x, xi, v, i)) { v = x; i = xi; }
  }
  block_best(v, i, sv, si);
  if (threadIdx.x == 0) ids[blockIdx.x] = i;
}

#define TOPK_MAX 4

// (v, i) into the lane's sorted list (tv[0] best), keeping the TOPK_MAX best.
__device__ __forceinline__ void topk_insert(float (&tv)[TOPK_MAX], int (&ti)[TOPK_MAX], float v, int i) {
  if (!better(v, i, tv[TOPK_MAX - 1], ti[TOPK_MAX - 1])) return;
#pragma unroll
  for (int s = TOPK_MAX - 1; s > 0; --s) {
    if (better(v, i, tv[s - 1], ti[s - 1])) { tv[s] = tv[s - 1]; ti[s] = ti[s - 1]; }
    else { tv[s] = v; ti[s] = i; return; }
  }
  tv[0] = v; ti[0] = i;
}

// (m, s) += (om, os): running max and sum of exp(x - max); an empty side (sum 0) changes nothing.
__device__ __forceinline__ void lse_merge(float& m, float& s, float om, float os) {
  if (os == 0.0f) return;
  if (s == 0.0f) { m = om; s = os; return; }
  if (om > m) { s = s * expf(m - om) + os; m = om; }
  else s += os * expf(om - m);
}

// The block's k best of the threads' sorted lists (k rounds of block_best; the winner's owner drops its head) into
// ov / oi (thread 0), and the block's (max, sum) into om / os (thread 0).
__device__ __forceinline__ void block_top_k(float (&tv)[TOPK_MAX], int (&ti)[TOPK_MAX], int k, float m, float s,
                                            float* ov, int* oi, float& om, float& os) {
  __shared__ float sv[32];
  __shared__ int si[32];
  __shared__ int win;
  for (int r = 0; r < k; ++r) {
    float v = tv[0];
    int i = ti[0];
    block_best(v, i, sv, si);
    if (threadIdx.x == 0) { ov[r] = v; oi[r] = i; win = i; }
    __syncthreads();
    if (ti[0] == win && ti[0] != 0x7FFFFFFF) {  // ids are unique: only the owner drops its head
#pragma unroll
      for (int j = 0; j < TOPK_MAX - 1; ++j) { tv[j] = tv[j + 1]; ti[j] = ti[j + 1]; }
      tv[TOPK_MAX - 1] = TANDEM_NEG_INF; ti[TOPK_MAX - 1] = 0x7FFFFFFF;
    }
    __syncthreads();
  }
#pragma unroll
  for (int d = 16; d > 0; d >>= 1) {
    const float mm = __shfl_xor_sync(0xFFFFFFFFu, m, d), ss = __shfl_xor_sync(0xFFFFFFFFu, s, d);
    lse_merge(m, s, mm, ss);
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) { sv[warp] = m; si[warp] = __float_as_int(s); }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < (int)(blockDim.x >> 5); ++w) lse_merge(m, s, sv[w], __int_as_float(si[w]));
    om = m; os = s;
  }
}

extern "C" __global__ void __launch_bounds__(256)
top_k_partial(const float* __restrict__ logits, float* __restrict__ part_val, int* __restrict__ part_idx,
              float* __restrict__ part_lse, int vocab, int k) {
  PDL_ENTER
  const float* row = logits + (size_t)blockIdx.y * vocab;
  float tv[TOPK_MAX];
  int ti[TOPK_MAX];
#pragma unroll
  for (int j = 0; j < TOPK_MAX; ++j) { tv[j] = TANDEM_NEG_INF; ti[j] = 0x7FFFFFFF; }
  float m = TANDEM_NEG_INF, s = 0.0f;
  for (int j = blockIdx.x * blockDim.x + threadIdx.x; j < vocab; j += gridDim.x * blockDim.x) {
    const float x = row[j];
    topk_insert(tv, ti, x, j);
    if (x > m) { s = s * expf(m - x) + 1.0f; m = x; }
    else if (x != TANDEM_NEG_INF) s += expf(x - m);  // -inf adds nothing; a NaN makes the sum NaN
  }
  const size_t part = (size_t)blockIdx.y * gridDim.x + blockIdx.x;
  float om, os;
  block_top_k(tv, ti, k, m, s, part_val + part * k, part_idx + part * k, om, os);
  if (threadIdx.x == 0) { part_lse[2 * part] = om; part_lse[2 * part + 1] = os; }
}

extern "C" __global__ void __launch_bounds__(256)
top_k_final(const float* __restrict__ part_val, const int* __restrict__ part_idx, const float* __restrict__ part_lse,
            int* __restrict__ out, int num_parts, int k) {
  PDL_ENTER
  float tv[TOPK_MAX];
  int ti[TOPK_MAX];
#pragma unroll
  for (int j = 0; j < TOPK_MAX; ++j) { tv[j] = TANDEM_NEG_INF; ti[j] = 0x7FFFFFFF; }
  float m = TANDEM_NEG_INF, s = 0.0f;
  for (int p = threadIdx.x; p < num_parts; p += blockDim.x) {  // each part's list is sorted: insert in order
    const size_t part = (size_t)blockIdx.x * num_parts + p;
    for (int j = 0; j < k; ++j) topk_insert(tv, ti, part_val[part * k + j], part_idx[part * k + j]);
    lse_merge(m, s, part_lse[2 * part], part_lse[2 * part + 1]);
  }
  int* o = out + (size_t)blockIdx.x * (2 + 2 * k);
  __shared__ float val[TOPK_MAX];
  __shared__ int idx[TOPK_MAX];
  float om, os;
  block_top_k(tv, ti, k, m, s, val, idx, om, os);
  if (threadIdx.x == 0) {
    o[0] = __float_as_int(om);
    o[1] = __float_as_int(os);
    for (int j = 0; j < k; ++j) { o[2 + j] = idx[j]; o[2 + k + j] = __float_as_int(val[j]); }
  }
}
