// Count, mean and M2 of values, merged in a fixed order: what Gaussian-k's
// threshold comes from (the histogram pass's per-block sums, the planner's
// merge, the one-block path). Included by .cu files only.
#ifndef GTOPK_COMMON_CUDA_SPARSIFY_MOMENTS_CUH_
#define GTOPK_COMMON_CUDA_SPARSIFY_MOMENTS_CUH_

#include <cmath>

#include "common/cuda/sparsify/device_common.cuh"

namespace gtopk {
namespace cuda {
namespace internal {

// Count, mean and sum of squared deviations (M2) of some values: what
// Gaussian-k's mean and std come from, merged by Chan et al.'s formula
// ("Updating formulae and a pairwise algorithm for computing sample
// variances", 1979) in a fixed order, so that the result is well
// conditioned when |mean| >> std (the one-pass sum of squares minus sum
// times mean cancels there) and the same on every run.
struct Moments {
  double n, mean, m2;
};
__host__ __device__ inline Moments MergeMoments(const Moments& a,
                                                const Moments& b) {
  const double n = a.n + b.n;
  if (n == 0.0) return Moments{0.0, 0.0, 0.0};
  const double delta = b.mean - a.mean;
  return Moments{n, a.mean + delta * (b.n / n),
                 a.m2 + b.m2 + delta * delta * (a.n * b.n / n)};
}

// One thread's values as deviations from its first one (`shift`): the
// sums of d = x - shift and d^2 in double (well conditioned: |d| is about
// the spread, not the offset).
struct ShiftedSums {
  float shift = 0.0f;  // the first value (exact in double)
  uint32_t count = 0;
  double sum = 0.0, sumsq = 0.0;
  __device__ void Add(float x) {
    if (count == 0) shift = x;
    const double d = static_cast<double>(x) - static_cast<double>(shift);
    ++count;
    sum += d;
    sumsq += d * d;
  }
  __device__ Moments Get() const {
    if (count == 0) return Moments{0.0, 0.0, 0.0};
    const double c = static_cast<double>(count);
    const double mean_d = sum / c;
    return Moments{c, static_cast<double>(shift) + mean_d,
                   fmax(0.0, sumsq - sum * mean_d)};
  }
};

// The block's Moments (kBlock threads, a power of two >= 256) by fixed
// rounds of MergeMoments (thread t into slot t % 256, the lower threads
// first), then a fixed tree over the 256 slots; in thread 0.
template <int kBlock>
__device__ inline Moments BlockMoments(Moments mine) {
  constexpr int kSlots = 256;
  static_assert(kBlock % kSlots == 0, "whole rounds");
  __shared__ double tree_n[kSlots], tree_mean[kSlots], tree_m2[kSlots];
  const int t = static_cast<int>(threadIdx.x);
  const int slot = t % kSlots;
// Not unrolled: unrolled, the fused update needed more than its 48 registers.
#ifdef __CUDACC__
#pragma unroll 1
#endif
  for (int round = 0; round < kBlock / kSlots; ++round) {
    if (t / kSlots == round) {
      const Moments merged =
          round == 0 ? mine
                     : MergeMoments(Moments{tree_n[slot], tree_mean[slot],
                                            tree_m2[slot]},
                                    mine);
      tree_n[slot] = merged.n;
      tree_mean[slot] = merged.mean;
      tree_m2[slot] = merged.m2;
    }
    __syncthreads();
  }
// Not unrolled: unrolled, the fused update needed more than its 48 registers.
#ifdef __CUDACC__
#pragma unroll 1
#endif
  for (int stride = kSlots / 2; stride > 0; stride /= 2) {
    if (t < stride) {
      const Moments merged =
          MergeMoments(Moments{tree_n[t], tree_mean[t], tree_m2[t]},
                       Moments{tree_n[t + stride], tree_mean[t + stride],
                               tree_m2[t + stride]});
      tree_n[t] = merged.n;
      tree_mean[t] = merged.mean;
      tree_m2[t] = merged.m2;
    }
    __syncthreads();
  }
  const Moments result{tree_n[0], tree_mean[0], tree_m2[0]};
  __syncthreads();  // the tree is rewritten by the next call
  return result;
}

}  // namespace internal
}  // namespace cuda
}  // namespace gtopk

#endif  // GTOPK_COMMON_CUDA_SPARSIFY_MOMENTS_CUH_
