// sample.cu: the token of each logits row as tandem/sampling.py's choose_token picks it (no penalties, no masks):
// x = logits / T (float32 division, skipped when the launcher says T is 1), top-k, top-p, min-p as in
// process_logits, then argmax over unmasked finite x of float32(x + gumbel(seed, position, id)), lowest id on
// ties. Greedy rows go to argmax.cu instead (the launcher routes them).
//
// sample_rows  grid (S_CLUSTER, R), block 1024: one row per team of S_CLUSTER blocks (a thread-block cluster of 8 on
//   sm_90+, exchanging reductions through distributed shared memory; one block before); every pass reads the row:
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
// History: v1 one block per row, global passes; v2 pos0 (the engine's decode rows pass their position by value), the
// top-p bisection over [mid, hi] with its keys in shared memory once few, Gumbel noise only where an id can win;
// v3 a cluster of 8 blocks a row (figures: docs/performance.md).
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

// ---- the team: the S_CLUSTER blocks of one row (a thread-block cluster on sm_90+, one block before) ----------
// Team thread gt = rank · S_THREADS + tid takes ids gt, gt + S_TEAM, ...; a team reduction is the block's tree
// (warp butterflies, then the 32 warp results), then the ranks' results in rank order read through distributed
// shared memory: a fixed order, so every sum is deterministic and every rank gets the same value.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define S_CLUSTER 8
#else
#define S_CLUSTER 1
#endif
#define S_TEAM (S_CLUSTER * S_THREADS)
#if S_CLUSTER > 1
#define S_CLUSTER_DIMS __cluster_dims__(S_CLUSTER, 1, 1)
#else
#define S_CLUSTER_DIMS
#endif

__device__ __forceinline__ u32 team_rank() {
#if S_CLUSTER > 1
  u32 r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
#else
  return 0u;
#endif
}

// Every thread of every block of the cluster: their shared-memory writes before it are visible to the others after.
__device__ __forceinline__ void team_sync() {
#if S_CLUSTER > 1
  asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
#else
  __syncthreads();
#endif
}

// The 64-bit word at shared address p of block `rank` of the cluster.
__device__ __forceinline__ u64 team_load(const u64* p, u32 rank) {
#if S_CLUSTER > 1
  u32 a = (u32)__cvta_generic_to_shared(p), r;
  u64 v;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(rank));
  asm volatile("ld.shared::cluster.u64 %0, [%1];" : "=l"(v) : "r"(r) : "memory");
  return v;
#else
  return *p;
#endif
}

// Shared state of a block's team reductions: 32 warp slots, and two rank slots used alternately (a block writes
// slot k % 2 for reduction k; every rank has read reduction k's slots before it passes reduction k + 1's barrier).
struct Team {
  u64* warp;  // [32]
  u64* slot;  // [2]
  int k;
};

template <typename T> __device__ __forceinline__ u64 to_bits(T v);
template <> __device__ __forceinline__ u64 to_bits(double v) { return (u64)__double_as_longlong(v); }
template <> __device__ __forceinline__ u64 to_bits(u32 v) { return (u64)v; }
template <> __device__ __forceinline__ u64 to_bits(u64 v) { return v; }
template <typename T> __device__ __forceinline__ T from_bits(u64 b);
template <> __device__ __forceinline__ double from_bits(u64 b) { return __longlong_as_double((long long)b); }
template <> __device__ __forceinline__ u32 from_bits(u64 b) { return (u32)b; }
template <> __device__ __forceinline__ u64 from_bits(u64 b) { return b; }

template <typename T, typename Op>
__device__ __forceinline__ T team_reduce(T v, Team& t, Op op) {
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) v = op(v, __shfl_xor_sync(0xFFFFFFFFu, v, m));
  __syncthreads();
  if ((threadIdx.x & 31) == 0) t.warp[threadIdx.x >> 5] = to_bits(v);
  __syncthreads();
  v = from_bits<T>(t.warp[threadIdx.x & 31]);
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) v = op(v, __shfl_xor_sync(0xFFFFFFFFu, v, m));
#if S_CLUSTER > 1
  u64* slot = t.slot + (t.k++ & 1);
  if (threadIdx.x == 0) *slot = to_bits(v);
  team_sync();
  v = from_bits<T>(team_load(slot, 0));
  for (u32 r = 1; r < S_CLUSTER; ++r) v = op(v, from_bits<T>(team_load(slot, r)));
#endif
  return v;
}

__device__ __forceinline__ double team_sum_f64(double v, Team& t) {
  return team_reduce(v, t, [](double a, double b) { return a + b; });
}
__device__ __forceinline__ u32 team_sum_u32(u32 v, Team& t) {
  return team_reduce(v, t, [](u32 a, u32 b) { return a + b; });
}
__device__ __forceinline__ u32 team_max_u32(u32 v, Team& t) {
  return team_reduce(v, t, [](u32 a, u32 b) { return max(a, b); });
}
__device__ __forceinline__ u32 team_min_u32(u32 v, Team& t) {
  return team_reduce(v, t, [](u32 a, u32 b) { return min(a, b); });
}

// Exclusive scan of one u32 a thread over the block (Hillis-Steele in cnt, integers: exact); returns the thread's
// offset and sets total. cnt: S_THREADS slots of shared memory. Holds barriers.
__device__ __forceinline__ u32 block_scan(u32 c, u32* cnt, u32& total) {
  __syncthreads();
  cnt[threadIdx.x] = c;
  __syncthreads();
  for (int d = 1; d < S_THREADS; d *= 2) {
    const u32 v = threadIdx.x >= (u32)d ? cnt[threadIdx.x - d] : 0u;
    __syncthreads();
    cnt[threadIdx.x] += v;
    __syncthreads();
  }
  total = cnt[S_THREADS - 1];
  const u32 at = cnt[threadIdx.x] - c;
  __syncthreads();
  return at;
}

// The id of the r-th (0-based) index in [0, V) where pred holds, in id order; S_NO_ID if fewer hold. Team thread
// gt scans the contiguous ids [gt · seg, (gt + 1) · seg).
template <typename Pred>
__device__ int rth_id(int vocab, u32 r, Pred pred, u32* cnt, Team& t) {
  const u32 rank = team_rank();
  const int seg = (vocab + S_TEAM - 1) / S_TEAM;
  const int lo = min(vocab, (int)(rank * S_THREADS + threadIdx.x) * seg), hi = min(vocab, lo + seg);
  u32 c = 0;
  for (int i = lo; i < hi; ++i) c += pred(i) ? 1u : 0u;
  u32 block_total;
  u32 before = block_scan(c, cnt, block_total);
#if S_CLUSTER > 1
  // the ranks' totals: every rank writes its own, then adds those of the ranks before it
  u64* slot = t.slot + (t.k++ & 1);
  if (threadIdx.x == 0) *slot = (u64)block_total;
  team_sync();
  for (u32 q = 0; q < rank; ++q) before += (u32)team_load(slot, q);
#endif
  u32 found = S_NO_ID;
  if (r >= before && r < before + c) {
    u32 seen = before;
    for (int i = lo; i < hi; ++i) {
      if (pred(i)) {
        if (seen == r) { found = (u32)i; break; }
        ++seen;
      }
    }
  }
  return (int)team_min_u32(found, t);
}

// This block's kept keys in [lo, hi] into ck, thread by thread (its team ids in order, at the exclusive scan of the
// threads' counts): a fixed order, so sums over ck are deterministic. Returns their count (the caller knows the
// team's is at most S_CAP). cnt: S_THREADS slots of shared memory. Holds barriers.
template <typename Kept>
__device__ int compact_keys(const float* row, int vocab, int divide, float temperature, Kept kept, u32 lo, u32 hi,
                            u32* ck, u32* cnt) {
  const int first = (int)(team_rank() * S_THREADS + threadIdx.x);
  u32 c = 0u;
  for (int i = first; i < vocab; i += S_TEAM) {
    const u32 key = okey(xval(row, i, divide, temperature));
    c += (kept(i, key) && key >= lo && key <= hi) ? 1u : 0u;
  }
  u32 n;
  u32 at = block_scan(c, cnt, n);
  for (int i = first; i < vocab && c > 0u; i += S_TEAM) {
    const u32 key = okey(xval(row, i, divide, temperature));
    if (kept(i, key) && key >= lo && key <= hi) { ck[at++] = key; --c; }
  }
  __syncthreads();
  return (int)n;
}

// Launch: grid (S_CLUSTER, R), cluster (S_CLUSTER, 1, 1) on sm_90+ (sample.py CLUSTER); block S_THREADS.
extern "C" __global__ void __launch_bounds__(S_THREADS) S_CLUSTER_DIMS
sample_rows(const float* __restrict__ logits, int vocab, int divide, float temperature, int top_k, double top_p,
            double min_p, u64 seed, const long long* __restrict__ positions, long long pos0, int* __restrict__ ids,
            float* __restrict__ noise) {
  PDL_ENTER
  __shared__ u32 hist[256];
  __shared__ u32 hsum[256];
  __shared__ u32 cnt[S_THREADS];
  __shared__ u64 warp_slots[32];
  __shared__ u64 rank_slots[2];
  __shared__ u32 sel;
  __shared__ u32 ck[S_CAP];
  Team team{warp_slots, rank_slots, 0};
  const int rowi = blockIdx.y;
  const float* row = logits + (size_t)rowi * vocab;
  const u32 rank = team_rank();
  const int first = (int)(rank * S_THREADS + threadIdx.x);  // this thread's ids: first, first + S_TEAM, ...
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
      for (int i = first; i < vocab; i += S_TEAM) {
        const u32 key = okey(xval(row, i, divide, temperature));
        if ((key & mask) == prefix) atomicAdd(&hist[(key >> shift) & 255u], 1u);
      }
      __syncthreads();
#if S_CLUSTER > 1
      team_sync();  // every rank's histogram is complete
      for (int b = tid; b < 256; b += S_THREADS) {  // integer counts: any order is exact
        u32 sum = 0u;
        for (u32 q = 0; q < S_CLUSTER; ++q) {
          u32 a = (u32)__cvta_generic_to_shared(&hist[b]), r, v;
          asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(q));
          asm volatile("ld.shared::cluster.u32 %0, [%1];" : "=r"(v) : "r"(r) : "memory");
          sum += v;
        }
        hsum[b] = sum;
      }
      team_sync();  // every rank has read every histogram before any clears its own
#else
      for (int b = tid; b < 256; b += S_THREADS) hsum[b] = hist[b];
      __syncthreads();
#endif
      if (tid == 0) {
        u32 above = 0u;
        int b = 255;
        for (; b > 0 && above + hsum[b] < remaining; --b) above += hsum[b];
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
      for (int i = first; i < vocab; i += S_TEAM) {
        const u32 key = okey(xval(row, i, divide, temperature));
        gt += (key > kth && key != S_NAN_KEY) ? 1u : 0u;
        eq += key == kth ? 1u : 0u;
      }
      gt = team_sum_u32(gt, team);
      eq = team_sum_u32(eq, team);
      const u32 take = min(eq, (u32)top_k - gt);
      if (take < eq)
        kcut = rth_id(vocab, take - 1u, [&](int i) { return okey(xval(row, i, divide, temperature)) == kth; },
                      cnt, team);
    }
  }
  auto kept = [&](int i, u32 key) {
    return !none && key != S_NAN_KEY && (key > kth || (key == kth && i <= kcut));
  };

  u32 vkey = 0u;
  int vcut = S_NO_ID;
  if (!none && top_p < 1.0) {
    u32 mk = 0u, nk = 0u;
    for (int i = first; i < vocab; i += S_TEAM) {
      const u32 key = okey(xval(row, i, divide, temperature));
      if (kept(i, key)) { mk = max(mk, key); ++nk; }
    }
    nk = team_sum_u32(nk, team);
    mk = team_max_u32(mk, team);
    if (nk == 0u) {
      none = true;
    } else {
      const double top = (double)key_value(mk);
      // Σ exp(x - top) and the count over kept x with lo_key ≤ key ≤ hi_key: from the row, or from the compacted
      // keys ck[0, nc) (this block's) once the bisection's range holds at most S_CAP of them in the team.
      int nc = -1;
      auto range_mass = [&](u32 lo_key, u32 hi_key, u32& count) {
        double sum = 0.0;
        u32 c = 0u;
        if (nc < 0) {
          for (int i = first; i < vocab; i += S_TEAM) {
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
        count = team_sum_u32(c, team);
        return team_sum_f64(sum, team);
      };
      u32 n_in;
      const double total = range_mass(0u, S_NAN_KEY - 1u, n_in);
      // Bisection for the largest key v with mass(key ≥ v) / total ≥ p over [lo, hi]; `above` = the mass of the
      // kept keys > hi, so each pass sums exp only over [mid, hi] (the v1 kernel summed all keys ≥ mid: ~32
      // passes of V float64 exps).
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
        }, cnt, team);
    }
  }
  auto kept_p = [&](int i, u32 key) { return kept(i, key) && (key > vkey || (key == vkey && i <= vcut)); };

  // min-p's max: over the masked row when top-k / top-p masked it, else over x itself (NaN / +inf: skip).
  bool use_min_p = min_p > 0.0;
  double top = 0.0;
  if (use_min_p) {
    const bool masked = top_k < vocab || top_p < 1.0;
    u32 mk = 0u;
    for (int i = first; i < vocab; i += S_TEAM) {
      const u32 key = okey(xval(row, i, divide, temperature));
      if (!masked || kept_p(i, key)) mk = max(mk, key);
    }
    mk = team_max_u32(mk, team);
    const float mx = key_value(mk);
    use_min_p = mk != S_NAN_KEY && mk != 0u && isfinite(mx);
    top = (double)mx;
  }

  const long long position = positions != nullptr ? positions[rowi] : pos0 + (long long)rowi;
  const u64 stream = fmix64((u64)seed ^ fmix64((u64)position + S_GOLDEN));
  // The largest finite candidate x_max is itself a candidate (min-p keeps its max), and a Gumbel value lies in
  // [-2.86, 17.33] (u in [2^-25, 1 - 2^-25]): x + g < x_max - 2.86 for every x below x_max - 20.2, so those ids
  // cannot win and their noise (two float64 logs) is never computed. The bound has a margin for float32 rounding.
  u32 fk = 0u;
  if (!none) {
    for (int i = first; i < vocab; i += S_TEAM) {
      const float x = xval(row, i, divide, temperature);
      const u32 key = okey(x);
      if (isfinite(x) && kept_p(i, key)) fk = max(fk, key);
    }
    fk = team_max_u32(fk, team);
  }
  const float floor_x = fk != 0u ? key_value(fk) - (21.0f + 1e-5f * fabsf(key_value(fk))) : TANDEM_NEG_INF;
  // The winner: the largest (score, -id) pair, a total order, so any reduction order gives the same one. Scores
  // are compared through an order key (okey: -inf lowest; no NaN reaches here) packed above the id's complement.
  u64 best = 0ull;  // 0: none
  for (int i = first; i < vocab; i += S_TEAM) {
    const float x = xval(row, i, divide, temperature);
    const u32 key = okey(x);
    if (none || !isfinite(x) || x < floor_x || !kept_p(i, key)) continue;
    if (use_min_p && exp((double)x - top) < min_p) continue;
    const u64 cand = ((u64)okey(__fadd_rn(x, gumbel(stream, i))) << 32) | (u64)(0x7FFFFFFFu - (u32)i);
    best = max(best, cand);
  }
  best = team_reduce(best, team, [](u64 a, u64 b) { return max(a, b); });
  if (rank == 0 && tid == 0) {
    const bool ok = best != 0ull;
    const int id = ok ? (int)(0x7FFFFFFFu - (u32)(best & 0xFFFFFFFFull)) : -1;
    ids[rowi] = id;
    noise[rowi] = ok ? gumbel(stream, id) : TANDEM_NAN;
  }
  team_sync();  // no block leaves while another may still read its shared memory
}

// apply_penalties  grid ceil(V / 256), block 256: the penalties of tandem/sampling.py PenaltyState.apply, in place
// on logits [V] (float32 arithmetic in its order: repetition r over prompt ∪ output tokens, x / r where x > 0 else
// x · r; frequency f, x − f · count; presence p, x − p · [count > 0]), counts [V] int32 the output counts and
// prompt [V] u8 the prompt mask; the same bits but for subnormal results, which come out as zero here (measured on
// the H200: the module's float arithmetic flushes them). prev (not null): the id chosen last (the sampler's
// device slot), counted first:
// its thread adds 1 to counts[prev] and uses the new count (no other thread reads that entry), so the engine's
// device loop needs no host update; a -1 or out-of-range prev counts nothing.
extern "C" __global__ void __launch_bounds__(256)
apply_penalties(float* __restrict__ logits, int* __restrict__ counts, const unsigned char* __restrict__ prompt,
                const int* __restrict__ prev, float rep, float freq, float pres, int vocab) {
  PDL_ENTER
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= vocab) return;
  int c = counts[i];
  if (prev != nullptr && *prev == i) counts[i] = ++c;
  float x = logits[i];
  const bool seen = c > 0;
  if (rep != 1.0f && (seen || prompt[i] != 0)) x = x > 0.0f ? __fdiv_rn(x, rep) : __fmul_rn(x, rep);
  if (freq != 0.0f) x = __fsub_rn(x, __fmul_rn(freq, (float)c));
  if (pres != 0.0f) x = __fsub_rn(x, __fmul_rn(pres, seen ? 1.0f : 0.0f));  // p · 0 keeps p's sign, as NumPy's
  logits[i] = x;
}
