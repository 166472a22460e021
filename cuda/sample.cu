// sample.cu: the token of each logits row as tandem/sampling.py's choose_token picks it (no penalties, no masks):
// x = logits / T (float32 division, skipped when the launcher says T is 1), top-k, top-p, min-p as in
// process_logits, then argmax over unmasked finite x of float32(x + gumbel(seed, position, id)), lowest id on
// ties. Greedy rows go to argmax.cu instead (the launcher routes them).
//
// sample_rows  grid R, block 1024 (one row per block; every pass reads the row from global memory):
//   top-k (k < V): radix select (4 × 8 bits, integer histograms) of the k-th largest value in the order of
//     np.partition (NaN largest); keep the non-NaN values above it and, of those equal to it, the lowest ids, at
//     most k in all (sampling._top_ids).
//   top-p (p < 1): total = Σ exp(x − max) over the kept values (float64); bisection over the 32-bit order key for
//     the largest value v with mass(x ≥ v) / total ≥ p; of the ties at v, the fewest lowest ids that reach p.
//   min-p (m > 0): drop exp(float64(x) − max) < m, skipped when the max is not finite (a NaN or +inf present).
//   Gumbel noise: splitmix64 on 64-bit integers, bit for bit gumbel_noise_at's u; g = float32(−log(−log u)) in
//   float64 (equal to NumPy's unless a log lands on a float32 rounding boundary).
// Sums run in a fixed order (a strided loop per thread, then a fixed tree), so a row's result is deterministic.
// Rounding differences from the CPU (float64 exp / sum order in top-p and min-p) move a cut only when a
// cumulative sum or ratio lies within a few ulps of p or m. No candidate left: id -1 (choose_token raises).
// Layout: logits [R, V] float32 contiguous; positions [R] int64, or null for positions pos0 + r (no upload);
// ids [R] int32; noise [R] float32 (the winner's noise, NaN when none).
// History: v1 one block per row, global passes; v2 pos0 (the engine's decode rows pass their position by value).
#include "common.cuh"

typedef unsigned long long u64;

#define S_THREADS 1024
#define S_GOLDEN 0x9E3779B97F4A7C15ull
#define S_MIX1 0xBF58476D1CE4E5B9ull
#define S_MIX2 0x94D049BB133111EBull
#define S_NAN_KEY 0xFFFFFFFFu
#define S_NO_ID 0x7FFFFFFF
#define S_CAP 8192  // keys the top-p bisection holds in shared memory once its range is that small (32 KB)

__device__ __forceinline__ u64 fmix64(u64 z) {
  z = (z ^ (z >> 30)) * S_MIX1;
  z = (z ^ (z >> 27)) * S_MIX2;
  return z ^ (z >> 31);
}

__device__ __forceinline__ float gumbel(u64 stream, int id) {
  const u64 bits = fmix64(stream + (u64)(id + 1) * S_GOLDEN);
  const double u = ((double)(bits >> 40) + 0.5) * 5.9604644775390625e-08;  // 2^-24
  return (float)(-log(-log(u)));
}

// Order-preserving key of a float (np.partition's order): -0 == +0, every NaN above +inf.
__device__ __forceinline__ u32 okey(float x) {
  if (x != x) return S_NAN_KEY;
  u32 u = __float_as_uint(x == 0.0f ? 0.0f : x);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// The float of an order key (okey's inverse for every non-NaN key; -0 comes back as +0).
__device__ __forceinline__ float key_value(u32 k) {
  return __uint_as_float((k & 0x80000000u) ? (k & 0x7FFFFFFFu) : ~k);
}

__device__ __forceinline__ float xval(const float* row, int i, int divide, float temperature) {
  const float v = row[i];
  return divide ? __fdiv_rn(v, temperature) : v;
}

// Block-wide reduction (blockDim = S_THREADS = 32 warps) under `op`: a butterfly within each warp, then one over
// the 32 warp results; every thread gets the result. red: 32 slots of shared memory.
template <typename T, typename Op>
__device__ __forceinline__ T block_reduce(T v, T* red, Op op) {
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) v = op(v, __shfl_xor_sync(0xFFFFFFFFu, v, m));
  __syncthreads();
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
  __syncthreads();
  v = red[threadIdx.x & 31];
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) v = op(v, __shfl_xor_sync(0xFFFFFFFFu, v, m));
  return v;
}

__device__ __forceinline__ double block_sum_f64(double v, double* red) {
  return block_reduce(v, red, [](double a, double b) { return a + b; });
}

__device__ __forceinline__ u32 block_sum_u32(u32 v, u32* red) {
  return block_reduce(v, red, [](u32 a, u32 b) { return a + b; });
}

__device__ __forceinline__ u32 block_max_u32(u32 v, u32* red) {
  return block_reduce(v, red, [](u32 a, u32 b) { return max(a, b); });
}

// The id of the r-th (0-based) index in [0, V) where pred holds, in id order; S_NO_ID if fewer hold.
template <typename Pred>
__device__ int rth_id(int vocab, u32 r, Pred pred, u32* cnt, int* found) {
  const int seg = (vocab + S_THREADS - 1) / S_THREADS;
  const int lo = min(vocab, (int)threadIdx.x * seg), hi = min(vocab, lo + seg);
  u32 c = 0;
  for (int i = lo; i < hi; ++i) c += pred(i) ? 1u : 0u;
  __syncthreads();
  cnt[threadIdx.x] = c;
  if (threadIdx.x == 0) *found = S_NO_ID;
  __syncthreads();
  if (threadIdx.x == 0) {  // exclusive scan, 1024 adds
    u32 run = 0;
    for (int t = 0; t < S_THREADS; ++t) { const u32 x = cnt[t]; cnt[t] = run; run += x; }
  }
  __syncthreads();
  const u32 before = cnt[threadIdx.x];
  if (r >= before && r < before + c) {
    u32 seen = before;
    for (int i = lo; i < hi; ++i) {
      if (pred(i)) {
        if (seen == r) { *found = i; break; }
        ++seen;
      }
    }
  }
  __syncthreads();
  return *found;
}

// The kept keys in [lo, hi] into ck, thread by thread (thread t's ids t, t + S_THREADS, ... in order, at the
// exclusive scan of the threads' counts): a fixed order, so sums over ck are deterministic. Returns their count
// (the caller knows it is at most S_CAP). cnt: S_THREADS slots of shared memory. Holds barriers.
template <typename Kept>
__device__ int compact_keys(const float* row, int vocab, int divide, float temperature, Kept kept, u32 lo, u32 hi,
                            u32* ck, u32* cnt) {
  u32 c = 0u;
  for (int i = threadIdx.x; i < vocab; i += S_THREADS) {
    const u32 key = okey(xval(row, i, divide, temperature));
    c += (kept(i, key) && key >= lo && key <= hi) ? 1u : 0u;
  }
  __syncthreads();
  cnt[threadIdx.x] = c;
  __syncthreads();
  for (int d = 1; d < S_THREADS; d *= 2) {  // inclusive scan (Hillis-Steele), integers: exact
    const u32 v = threadIdx.x >= (u32)d ? cnt[threadIdx.x - d] : 0u;
    __syncthreads();
    cnt[threadIdx.x] += v;
    __syncthreads();
  }
  u32 at = cnt[threadIdx.x] - c;
  const int n = (int)cnt[S_THREADS - 1];
  for (int i = threadIdx.x; i < vocab && c > 0u; i += S_THREADS) {
    const u32 key = okey(xval(row, i, divide, temperature));
    if (kept(i, key) && key >= lo && key <= hi) { ck[at++] = key; --c; }
  }
  __syncthreads();
  return n;
}

extern "C" __global__ void __launch_bounds__(S_THREADS)
sample_rows(const float* __restrict__ logits, int vocab, int divide, float temperature, int top_k, double top_p,
            double min_p, u64 seed, const long long* __restrict__ positions, long long pos0, int* __restrict__ ids,
            float* __restrict__ noise) {
  PDL_ENTER
  __shared__ u32 hist[256];
  __shared__ u32 cnt[S_THREADS];
  __shared__ u32 red[32];
  __shared__ double redd[32];
  __shared__ int found;
  __shared__ u32 sel;
  __shared__ u32 ck[S_CAP];
  const float* row = logits + (size_t)blockIdx.x * vocab;
  const int tid = threadIdx.x;

  // kept(i) = !NaN && (key > kth || (key == kth && i <= kcut)), then top-p narrows it to (vkey, vcut).
  u32 kth = 0u;
  int kcut = S_NO_ID;
  bool none = false;
  if (top_k < vocab) {
    u32 prefix = 0u, mask = 0u, remaining = (u32)top_k;
    for (int shift = 24; shift >= 0; shift -= 8) {
      for (int b = tid; b < 256; b += S_THREADS) hist[b] = 0u;
      __syncthreads();
      for (int i = tid; i < vocab; i += S_THREADS) {
        const u32 key = okey(xval(row, i, divide, temperature));
        if ((key & mask) == prefix) atomicAdd(&hist[(key >> shift) & 255u], 1u);
      }
      __syncthreads();
      if (tid == 0) {
        u32 above = 0u;
        int b = 255;
        for (; b > 0 && above + hist[b] < remaining; --b) above += hist[b];
        sel = (u32)b | (above << 8);
      }
      __syncthreads();
      const u32 s = sel;
      remaining -= s >> 8;
      prefix |= (s & 255u) << shift;
      mask |= 255u << shift;
      __syncthreads();
    }
    kth = prefix;
    if (kth == S_NAN_KEY) {
      none = true;
    } else {
      u32 gt = 0u, eq = 0u;
      for (int i = tid; i < vocab; i += S_THREADS) {
        const u32 key = okey(xval(row, i, divide, temperature));
        gt += (key > kth && key != S_NAN_KEY) ? 1u : 0u;
        eq += key == kth ? 1u : 0u;
      }
      gt = block_sum_u32(gt, red);
      eq = block_sum_u32(eq, red);
      const u32 take = min(eq, (u32)top_k - gt);
      if (take < eq)
        kcut = rth_id(vocab, take - 1u, [&](int i) { return okey(xval(row, i, divide, temperature)) == kth; },
                      cnt, &found);
    }
  }
  auto kept = [&](int i, u32 key) {
    return !none && key != S_NAN_KEY && (key > kth || (key == kth && i <= kcut));
  };

  u32 vkey = 0u;
  int vcut = S_NO_ID;
  if (!none && top_p < 1.0) {
    u32 mk = 0u, nk = 0u;
    for (int i = tid; i < vocab; i += S_THREADS) {
      const u32 key = okey(xval(row, i, divide, temperature));
      if (kept(i, key)) { mk = max(mk, key); ++nk; }
    }
    nk = block_sum_u32(nk, red);
    mk = block_max_u32(mk, red);
    if (nk == 0u) {
      none = true;
    } else {
      const double top = (double)key_value(mk);
      // Σ exp(x - top) and the count over kept x with lo_key ≤ key ≤ hi_key: from the row, or from the compacted
      // keys ck[0, nc) once the bisection's range holds at most S_CAP of them.
      int nc = -1;
      auto range_mass = [&](u32 lo_key, u32 hi_key, u32& count) {
        double sum = 0.0;
        u32 c = 0u;
        if (nc < 0) {
          for (int i = tid; i < vocab; i += S_THREADS) {
            const float x = xval(row, i, divide, temperature);
            const u32 key = okey(x);
            if (kept(i, key) && key >= lo_key && key <= hi_key) { sum += exp((double)x - top); ++c; }
          }
        } else {
          for (int j = tid; j < nc; j += S_THREADS) {
            const u32 key = ck[j];
            if (key >= lo_key && key <= hi_key) { sum += exp((double)key_value(key) - top); ++c; }
          }
        }
        count = block_sum_u32(c, red);
        return block_sum_f64(sum, redd);
      };
      u32 n_in;
      const double total = range_mass(0u, S_NAN_KEY - 1u, n_in);
      // Bisection for the largest key v with mass(key ≥ v) / total ≥ p over [lo, hi]; `above` = the mass of the
      // kept keys > hi, so each pass sums exp only over [mid, hi] (the old kernel summed all keys ≥ mid: ~32
      // passes of V float64 exps, 5 ms a 248k-token row on the H200).
      u32 lo = kth, hi = mk;
      double above = 0.0;
      while (lo < hi) {
        if (nc < 0 && n_in <= S_CAP) nc = compact_keys(row, vocab, divide, temperature, kept, lo, hi, ck, cnt);
        const u32 mid = lo + (hi - lo + 1u) / 2u;
        u32 n_up;
        const double upper = range_mass(mid, hi, n_up);
        if ((above + upper) / total >= top_p) {
          lo = mid;
          n_in = n_up;
        } else {
          hi = mid - 1u;
          above += upper;
          n_in -= n_up;
        }
      }
      vkey = lo;  // `above`: the mass of the kept keys > vkey; n_in: the kept keys equal to it
      const double qv = exp((double)key_value(vkey) - top);
      const u32 ties = n_in;
      u32 need = 1u;
      while (need < ties && (above + (double)need * qv) / total < top_p) ++need;
      if (need < ties)
        vcut = rth_id(vocab, need - 1u, [&](int i) {
          const u32 key = okey(xval(row, i, divide, temperature));
          return kept(i, key) && key == vkey;
        }, cnt, &found);
    }
  }
  auto kept_p = [&](int i, u32 key) { return kept(i, key) && (key > vkey || (key == vkey && i <= vcut)); };

  // min-p's max: over the masked row when top-k / top-p masked it, else over x itself (NaN / +inf: skip).
  bool use_min_p = min_p > 0.0;
  double top = 0.0;
  if (use_min_p) {
    const bool masked = top_k < vocab || top_p < 1.0;
    u32 mk = 0u;
    for (int i = tid; i < vocab; i += S_THREADS) {
      const u32 key = okey(xval(row, i, divide, temperature));
      if (!masked || kept_p(i, key)) mk = max(mk, key);
    }
    mk = block_max_u32(mk, red);
    const float mx = __uint_as_float((mk & 0x80000000u) ? (mk & 0x7FFFFFFFu) : ~mk);
    use_min_p = mk != S_NAN_KEY && mk != 0u && isfinite(mx);
    top = (double)mx;
  }

  const long long position = positions != nullptr ? positions[blockIdx.x] : pos0 + (long long)blockIdx.x;
  const u64 stream = fmix64((u64)seed ^ fmix64((u64)position + S_GOLDEN));
  // The largest finite candidate x_max is itself a candidate (min-p keeps its max), and a Gumbel value lies in
  // [-2.86, 17.33] (u in [2^-25, 1 - 2^-25]): x + g < x_max - 2.86 for every x below x_max - 20.2, so those ids
  // cannot win and their noise (two float64 logs) is never computed. The bound has a margin for float32 rounding.
  u32 fk = 0u;
  if (!none) {
    for (int i = tid; i < vocab; i += S_THREADS) {
      const float x = xval(row, i, divide, temperature);
      const u32 key = okey(x);
      if (isfinite(x) && kept_p(i, key)) fk = max(fk, key);
    }
    fk = block_max_u32(fk, red);
  }
  const float floor_x = fk != 0u ? key_value(fk) - (21.0f + 1e-5f * fabsf(key_value(fk))) : TANDEM_NEG_INF;
  float best = TANDEM_NEG_INF;
  int best_id = S_NO_ID;
  for (int i = tid; i < vocab; i += S_THREADS) {
    const float x = xval(row, i, divide, temperature);
    const u32 key = okey(x);
    if (none || !isfinite(x) || x < floor_x || !kept_p(i, key)) continue;
    if (use_min_p && exp((double)x - top) < min_p) continue;
    const float s = __fadd_rn(x, gumbel(stream, i));
    if (s > best || (s == best && i < best_id)) { best = s; best_id = i; }
  }
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) {
    const float os = __shfl_xor_sync(0xFFFFFFFFu, best, m);
    const int oi = __shfl_xor_sync(0xFFFFFFFFu, best_id, m);
    if (os > best || (os == best && oi < best_id)) { best = os; best_id = oi; }
  }
  __syncthreads();
  if ((tid & 31) == 0) { cnt[tid >> 5] = __float_as_uint(best); red[tid >> 5] = (u32)best_id; }
  __syncthreads();
  if (tid == 0) {
    for (int w = 1; w < S_THREADS / 32; ++w) {
      const float os = __uint_as_float(cnt[w]);
      const int oi = (int)red[w];
      if (os > best || (os == best && oi < best_id)) { best = os; best_id = oi; }
    }
    const bool ok = best_id != S_NO_ID;
    ids[blockIdx.x] = ok ? best_id : -1;
    noise[blockIdx.x] = ok ? gumbel(stream, best_id) : TANDEM_NAN;
  }
}
