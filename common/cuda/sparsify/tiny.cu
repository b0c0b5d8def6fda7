// Stage: the one-block path for a small u (n <= kTinyMaxN): the whole
// selection, any method, in one kernel of kScanThreads threads with u's keys
// in shared memory, so that a selection is one launch and one copy instead
// of a chain of eight to eleven (issue 15's small-n target is launch-bound).
#include <cmath>

#include "common/cuda/launch.h"
#include "common/cuda/sparsify.h"
#include "common/cuda/sparsify/device_common.cuh"
#include "common/cuda/sparsify/init_block.cuh"
#include "common/cuda/sparsify/launchers.h"
#include "common/cuda/sparsify/moments.cuh"

namespace gtopk {
namespace cuda {
namespace internal {
namespace {

// The rank-th largest of keys[0, m) (1 <= rank <= m) by the three-digit
// radix select, in every thread: *t = that key, *greater = how many keys
// exceed it, *ties = how many keys == t to take (lower index first).
__device__ void TinyKth(const uint32_t* keys, int m, ull rank, uint32_t* t,
                        ull* greater, ull* ties) {
  using Scan =
      cub::BlockScan<uint32_t, kScanThreads, cub::BLOCK_SCAN_WARP_SCANS>;
  __shared__ typename Scan::TempStorage storage;
  __shared__ uint32_t hist[kBins];
  __shared__ uint32_t found_digit;
  __shared__ uint32_t found_before;
  uint32_t prefix = 0;
  ull need = rank, above = 0;
  for (int level = 0; level < 3; ++level) {
    const int bins = 1 << LevelBits(level);
    for (int i = threadIdx.x; i < kBins; i += kScanThreads) hist[i] = 0;
    __syncthreads();
    for (int i = threadIdx.x; i < m; i += kScanThreads) {
      const uint32_t key = keys[i];
      if (MatchesPrefix(key, prefix, level)) {
        atomicAdd(&hist[Digit(key, level)], 1u);
      }
    }
    __syncthreads();
    // Two bins per thread, from the largest digit down.
    uint32_t v[2], before[2];
    for (int j = 0; j < 2; ++j) {
      const int p = 2 * static_cast<int>(threadIdx.x) + j;
      v[j] = p < bins ? hist[bins - 1 - p] : 0u;
    }
    Scan(storage).ExclusiveSum(v, before);
    for (int j = 0; j < 2; ++j) {
      const int p = 2 * static_cast<int>(threadIdx.x) + j;
      if (p < bins && v[j] != 0 && before[j] < need &&
          need <= before[j] + v[j]) {
        found_digit = static_cast<uint32_t>(bins - 1 - p);
        found_before = before[j];
      }
    }
    __syncthreads();
    prefix |= found_digit << LevelShift(level);
    above += found_before;
    need -= found_before;
    __syncthreads();  // found_* are rewritten by the next digit
  }
  *t = prefix;
  *greater = above;
  *ties = need;
}

// How many of keys[0, m) are >= key, in every thread.
__device__ ull TinyCountAtLeast(const uint32_t* keys, int m, uint32_t key) {
  using Reduce = cub::BlockReduce<uint32_t, kScanThreads>;
  __shared__ typename Reduce::TempStorage storage;
  __shared__ uint32_t total;
  uint32_t c = 0;
  for (int i = threadIdx.x; i < m; i += kScanThreads) c += keys[i] >= key;
  const uint32_t sum = Reduce(storage).Sum(c);
  if (threadIdx.x == 0) total = sum;
  __syncthreads();
  const ull result = total;
  __syncthreads();  // total is rewritten by the next call
  return result;
}

// Writes the entries with key > t, and the first `ties` with key == t,
// in index order to out_idx/out_val (values from u; zero: u[i] = +0.0);
// returns the count, in every thread. Each thread owns a contiguous
// segment of kTinyPerThread entries.
__device__ ull TinyWrite(float* u, const uint32_t* keys, int n, uint32_t t,
                         ull ties, uint32_t* out_idx, float* out_val,
                         int zero) {
  using Scan =
      cub::BlockScan<uint32_t, kScanThreads, cub::BLOCK_SCAN_WARP_SCANS>;
  __shared__ typename Scan::TempStorage storage;
  const int begin = static_cast<int>(threadIdx.x) * kTinyPerThread;
  const int end = begin + kTinyPerThread < n ? begin + kTinyPerThread : n;
  // Greater in the low 16 bits, equal in the high (n <= 4096 < 2^16).
  uint32_t mine = 0;
  for (int i = begin; i < end; ++i) {
    mine += keys[i] > t ? 1u : (keys[i] == t ? 1u << 16 : 0u);
  }
  uint32_t before, total;
  Scan(storage).ExclusiveSum(mine, before, total);
  ull greater = before & 0xffffu;
  ull tie = before >> 16;
  ull pos = greater + (tie < ties ? tie : ties);
  for (int i = begin; i < end; ++i) {
    const bool take = keys[i] > t || (keys[i] == t && tie++ < ties);
    if (take) {
      out_idx[pos] = static_cast<uint32_t>(i);
      out_val[pos] = u[i];
      if (zero) u[i] = 0.0f;
      ++pos;
    }
  }
  const ull all_ties = total >> 16;
  return (total & 0xffffu) + (all_ties < ties ? all_ties : ties);
}

// The whole selection of u (n <= kTinyMaxN) by one block of kScanThreads
// threads, the same rules as the multi-kernel path: exact's top-k;
// gaussiank's threshold mean + z*std and the CPU rule's adjustments on
// exact counts, the exact top-k when they end out of range (gk_exact,
// adjustments); dgc's sampled threshold B (the same runs as SampleKernel),
// every key >= B when at most k, else the exact top-k (trim when at most
// n/8 survive, gk_exact beyond: the multi-kernel path's names). Leaves
// state's num_selected, num_candidates (gaussiank: the count at its
// threshold; dgc: the survivors), and error (a non-finite u: nothing
// written or zeroed). Starts with InitBlock.
__global__ void __launch_bounds__(kScanThreads)
    TinySelectKernel(float* u, uint64_t n, DeviceState* st, InitArgs init,
                     TinyArgs a, uint32_t* out_idx, float* out_val) {
  InitBlock(st, init);
  __shared__ uint32_t keys[kTinyMaxN];
  __shared__ uint32_t sample[kTinyMaxSample];
  __shared__ int non_finite;
  if (threadIdx.x == 0) non_finite = 0;
  __syncthreads();
  const int m = static_cast<int>(n);
  for (int i = threadIdx.x; i < m; i += kScanThreads) {
    keys[i] = Key(u[i]);
    if (keys[i] >= kNonFiniteKey) non_finite = 1;
  }
  __syncthreads();
  if (non_finite) {  // uniform
    if (threadIdx.x == 0) st->error |= kErrorNonFinite;
    return;
  }
  // The selection: keys > t and the first `ties` keys == t.
  uint32_t t = 0;
  ull greater = 0, ties = 0, candidates = 0;
  bool exact = true;
  if (a.method == static_cast<int>(Method::kGaussianK)) {
    __shared__ double threshold;
    __shared__ int verdict;  // 0: go on, 1: in range, 2: out of range
    ShiftedSums sums;
    for (int i = threadIdx.x; i < m; i += kScanThreads) sums.Add(u[i]);
    const Moments all = BlockMoments<kScanThreads>(sums.Get());
    if (threadIdx.x == 0) {
      const double var = n > 1 ? all.m2 / static_cast<double>(n - 1) : 0.0;
      threshold = all.mean + a.z * sqrt(var);
      verdict = 0;
    }
    __syncthreads();
    for (int adjustment = 0;; ++adjustment) {
      const double th = threshold;
      const uint32_t key = MinKeyAbove(th);
      const ull count = TinyCountAtLeast(keys, m, key);
      if (threadIdx.x == 0) {
        st->adjustments = adjustment;
        if (count >= a.lo && count <= a.hi) {
          verdict = 1;
          st->min_key = key;
          st->threshold = th;
          st->num_candidates = count;
        } else {
          const double next = count < a.lo ? th * 0.5 : th * 1.5;
          if (adjustment == a.max_adjustments || next <= 0.0) {
            verdict = 2;
            st->fallback = 1;
            st->gk_exact = 1;
            st->gk_exact_adjustments = adjustment;
          } else {
            threshold = next;
          }
        }
      }
      __syncthreads();
      const int v = verdict;
      __syncthreads();  // verdict and threshold are read before rewritten
      if (v == 1) {
        t = st->min_key;
        ties = ~0ull;
        exact = false;
      }
      if (v != 0) break;
    }
  } else if (a.method == static_cast<int>(Method::kDgc) && a.runs != 0) {
    // One read of the pinned host value (over the bus), shared.
    __shared__ ull step_seed;
    if (threadIdx.x == 0) step_seed = *a.seed;
    __syncthreads();
    const ull seed = step_seed;
    const uint64_t total = a.runs * 16;
    for (uint64_t g = threadIdx.x; g < total; g += kScanThreads) {
      const uint64_t start = __umul64hi(Mix(seed, g / 16), n - 15);
      sample[g] = keys[start + (g % 16)];
    }
    __syncthreads();
    uint32_t b;
    ull above, unused;
    TinyKth(sample, static_cast<int>(total), a.sample_k, &b, &above, &unused);
    candidates = TinyCountAtLeast(keys, m, b);
    if (candidates <= a.k) {
      t = b;
      ties = ~0ull;
      exact = false;
    }
    if (threadIdx.x == 0) {
      st->min_key = b;
      st->num_candidates = candidates;
      if (exact && candidates <= n / 8) {
        st->trim = 1;
      } else if (exact) {
        st->gk_exact = 1;
        st->gk_exact_candidates = candidates;
      }
    }
  }
  if (exact) TinyKth(keys, m, a.k, &t, &greater, &ties);
  const ull count = TinyWrite(u, keys, m, t, ties, out_idx, out_val, a.zero);
  if (threadIdx.x == 0) {
    st->prefix = t;
    st->num_selected = count;
  }
}

}  // namespace

// (Launches as GTOPK_LAUNCH(kernel, grid, block, stream)(args), a form
// clang-format does not know.)
// clang-format off
void LaunchTinySelect(cudaStream_t stream, float* u, uint64_t n,
                      DeviceState* st, const InitArgs& init, const TinyArgs& a,
                      uint32_t* out_idx, float* out_val) {
  GTOPK_LAUNCH(TinySelectKernel, 1, kScanThreads, stream)(
      u, n, st, init, a, out_idx, out_val);
}
// clang-format on

}  // namespace internal
}  // namespace cuda
}  // namespace gtopk
