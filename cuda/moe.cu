// moe.cu: the sparse MoE MLP's routing and combining kernels (spec/qwen3_5.md §7; reference
// tandem/models/qwen3_5_moe/moe.py route / SparseMoE, tandem/backend/cuda/moe.py reference_*). The experts' GEMVs are
// gemv.cu's gemv_mma_<fmt>_moe_* over the rows these kernels lay out.
// moe_route    one block of 256 threads (8 warps), T ≤ 64 rows, X ≤ ROUTE_MAX_EXPERTS experts, T · k ≤ ROUTE_MAX_ROWS.
//              Per token (a warp): p = softmax(logits row) (max, expf, a fixed-order warp sum, one division), the k
//              most probable experts one at a time (ties to the lower index, as a stable sort of -p; NaN entries
//              last, lowest index first), their p, divided by their sum in NumPy's pairwise order when `renorm`.
//              Then the n = T · k (token, expert) pairs sorted by (expert, token), written as int32 route [5n]:
//              [0, n) the expert of sorted row p, [n, 2n) the first and [2n, 3n) one past the last row of that expert,
//              [3n, 4n) the token of row p, [4n, 5n) per token t its k rows in ascending expert order (t k + r);
//              weights [n] fp32: the weight of row route[4n + t k + r]. With `gate` (the shared expert stacked with
//              the routed ones as expert X): each token has k + 1 rows, the last expert X with weight
//              σ(gate[t · gate_stride]) = 1 / (1 + exp(-g)) (k counts them: n = T (k + 1)).
// moe_gather   grid (ceil(in / 256), n), block 256: xs row p = the split operand (common.cuh store_split, `kind`)
//              of x row route[3n + p] (x [T, in] fp32): the experts' GEMV operand in sorted order.
// moe_combine  grid (ceil(D / 256), T), block 256: out[t] = Σ_r w_r · y[row_r] over the token's rows in ascending
//              expert order (each product rounded, added from 0: the reference's index_add order), then
//              + σ(gate[t · gate_stride]) · shared[t] (σ(g) = 1 / (1 + exp(-g))); shared NULL: the shared expert
//              is the last of the rows (stacked, its weight σ(g)), the same arithmetic. y [n, D], shared / out [T, D].
// Each token's arithmetic reads only its own row, so its bits do not depend on T or on the other tokens.
// History: v1; v1.1 the shared expert stacked with the routed ones (one GEMV launch pair for both).
#include "common.cuh"

#define ROUTE_WARPS 8
#define ROUTE_MAX_EXPERTS 1024
#define ROUTE_MAX_ROWS 1024

// NumPy's pairwise float32 sum of a[0..n-1] for n < 128 (numpy/core/src/umath/loops_utils.h pairwise_sum).
__device__ __forceinline__ float numpy_sum(const float* a, int n) {
  if (n < 8) {
    float res = 0.0f;
    for (int i = 0; i < n; ++i) res = __fadd_rn(res, a[i]);
    return res;
  }
  float r[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) r[j] = a[j];
  int i = 8;
  for (; i < n - n % 8; i += 8)
#pragma unroll
    for (int j = 0; j < 8; ++j) r[j] = __fadd_rn(r[j], a[i + j]);
  float res = __fadd_rn(__fadd_rn(__fadd_rn(r[0], r[1]), __fadd_rn(r[2], r[3])),
                        __fadd_rn(__fadd_rn(r[4], r[5]), __fadd_rn(r[6], r[7])));
  for (; i < n; ++i) res = __fadd_rn(res, a[i]);
  return res;
}

extern "C" __global__ void __launch_bounds__(256)
moe_route(const float* __restrict__ logits, int stride, int num_rows, int experts, int k, int renorm,
          const float* __restrict__ gate, int gate_stride, int* __restrict__ route, float* __restrict__ weights) {
  PDL_ENTER
  __shared__ float prob[ROUTE_WARPS][ROUTE_MAX_EXPERTS];
  __shared__ int sel[ROUTE_MAX_ROWS];
  __shared__ float wsel[ROUTE_MAX_ROWS];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  float* pr = prob[warp];
  const int kk = k + (gate != nullptr);
  for (int t = warp; t < num_rows; t += ROUTE_WARPS) {
    const float* lg = logits + (size_t)t * stride;
    float m = TANDEM_NEG_INF;
    for (int i = lane; i < experts; i += 32) m = fmaxf(m, lg[i]);
    m = warp_max(m);
    float s = 0.0f;
    for (int i = lane; i < experts; i += 32) {
      const float e = expf(__fsub_rn(lg[i], m));
      pr[i] = e;
      s = __fadd_rn(s, e);
    }
    s = warp_sum(s);
    for (int i = lane; i < experts; i += 32) pr[i] = __fdiv_rn(pr[i], s);
    __syncwarp();
    for (int j = 0; j < k; ++j) {
      float bp = -1.0f;
      int bi = 0x7FFFFFFF, ni = 0x7FFFFFFF;  // best (p, index); the lowest NaN index (chosen when no p is left)
      for (int i = lane; i < experts; i += 32) {
        const float v = pr[i];
        if (v > bp) { bp = v; bi = i; }
        if (v != v && ni == 0x7FFFFFFF) ni = i;
      }
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) {
        const float op = __shfl_xor_sync(0xFFFFFFFFu, bp, off);
        const int oi = __shfl_xor_sync(0xFFFFFFFFu, bi, off);
        ni = min(ni, __shfl_xor_sync(0xFFFFFFFFu, ni, off));
        if (op > bp || (op == bp && oi < bi)) { bp = op; bi = oi; }
      }
      if (bi == 0x7FFFFFFF) { bi = ni; bp = TANDEM_NAN; }
      if (bi == 0x7FFFFFFF) bi = 0;  // unreachable: k ≤ experts
      __syncwarp();
      if (lane == 0) {
        sel[t * kk + j] = bi;
        wsel[t * kk + j] = bp;
        pr[bi] = -2.0f;  // chosen: below every probability
      }
      __syncwarp();
    }
    if (renorm && lane == 0) {
      const float total = numpy_sum(wsel + t * kk, k);
      for (int j = 0; j < k; ++j) wsel[t * kk + j] = __fdiv_rn(wsel[t * kk + j], total);
    }
    if (gate != nullptr && lane == 0) {  // the shared expert: expert `experts`, weight σ(gate)
      sel[t * kk + k] = experts;
      wsel[t * kk + k] = __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-gate[(size_t)t * gate_stride])));
    }
    __syncwarp();
  }
  __syncthreads();
  k = kk;  // rows a token: its k experts (and the shared one)
  const int n = num_rows * k;
  for (int a = threadIdx.x; a < n; a += blockDim.x) {
    const int e = sel[a], t = a / k;
    int less = 0, count = 0, before = 0;
    for (int b = 0; b < n; ++b) {
      const int eb = sel[b];
      less += eb < e;
      if (eb == e) {
        ++count;
        before += b / k < t;
      }
    }
    int rank = 0;
    for (int j = 0; j < k; ++j) rank += sel[t * k + j] < e;
    const int pos = less + before;
    route[pos] = e;
    route[n + pos] = less;
    route[2 * n + pos] = less + count;
    route[3 * n + pos] = t;
    route[4 * n + t * k + rank] = pos;
    weights[t * k + rank] = wsel[a];
  }
}

extern "C" __global__ void __launch_bounds__(256)
moe_gather(const float* __restrict__ x, const int* __restrict__ route, int n, int in_dim, u16* __restrict__ xs,
           int kind) {
  PDL_ENTER
  const int p = blockIdx.y, j = blockIdx.x * blockDim.x + threadIdx.x;
  if (j >= in_dim) return;
  const int t = route[3 * n + p];
  store_split(xs, p, j, in_dim, x[(size_t)t * in_dim + j], kind);
}

extern "C" __global__ void __launch_bounds__(256)
moe_combine(const float* __restrict__ y, const int* __restrict__ route, const float* __restrict__ weights, int n,
            int k, int width, const float* __restrict__ shared, const float* __restrict__ gate, int gate_stride,
            float* __restrict__ out) {
  PDL_ENTER
  const int t = blockIdx.y, c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= width) return;
  float acc = 0.0f;
  for (int r = 0; r < k; ++r) {
    const int row = route[4 * n + t * k + r];
    acc = __fadd_rn(acc, __fmul_rn(y[(size_t)row * width + c], weights[t * k + r]));
  }
  if (shared != nullptr) {
    const float sig = __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-gate[(size_t)t * gate_stride])));
    acc = __fadd_rn(acc, __fmul_rn(sig, shared[(size_t)t * width + c]));
  }
  out[(size_t)t * width + c] = acc;
}
