// Stage: Gaussian-k's planner (GaussPlanKernel: the threshold from the
// first pass's sums and the CPU rule's adjustments the histogram decides)
// and the count its host continuation reads (CountAtLeastKernel).
#include "common/cuda/launch.h"
#include "common/cuda/sparsify/collect_scan.cuh"
#include "common/cuda/sparsify/device_common.cuh"
#include "common/cuda/sparsify/gauss_steps.cuh"
#include "common/cuda/sparsify/init_block.cuh"
#include "common/cuda/sparsify/launchers.h"
#include "common/cuda/sparsify/moments.cuh"

namespace gtopk {
namespace cuda {
namespace internal {
namespace {

// GaussPlanKernel's use of the fused update's candidates at its stop key
// (thread 0; at_least as the planner's).
__device__ void GaussUpdatePlan(DeviceState* st, const ull* at_least,
                                uint32_t key, const UpdateCandidates& uc,
                                ull compact_cap) {
  const uint32_t bin = key >> 20;
  if (st->update_used_n == uc.n && st->update_used_key != 0 &&
      st->update_clobbered == 0) {
    // The pass kept every key >= `from` (a bin's first key when Gaussian-k
    // predicted it; the exact plan's fine key may lie inside a bin), at
    // most at_least[from's bin] keys: the compaction at the stop key, and
    // the counts of each listed key's bin from it up, need them all.
    const uint32_t from = static_cast<uint32_t>(st->update_used_key - 1);
    bool use = key >= from && at_least[from >> 20] <= compact_cap &&
               st->gk_num_keys <= kMaxUpdateGaussKeys;
    for (int r = 0; use && r < st->gk_num_keys; ++r) {
      use = st->gk_keys[r] >= from;
    }
    st->gauss_from_update = use ? 1 : 0;
    st->gauss_used_update = use ? 1 : 0;
  }
  PredictUpdateBin(st, true, bin, at_least[bin],
                   bin > 0 ? at_least[bin - 1] : at_least[bin], uc);
}

// Gaussian-k planner (one block): mean/std from the histogram pass's sums,
// then the CPU selector's adjustment loop as long as the digit-0 histogram
// decides it (the count for a threshold lies between the counts at the
// bounds of its bin). Stops at the first threshold the histogram cannot
// rule out and sets min_key to it; fallback = 1 when the loop ends without.
// At a stop the histogram cannot call in range, it lists the keys the
// correction may need (ListGaussKeys). Writes the histogram's at_least
// counts to at_least_out (kBins entries) for GaussResolve. Starts with
// InitBlock when init.run.
//
// With uc.warps != 0 (the multi-kernel path: after Accumulate, or after
// Gaussian-k's own histogram pass): sets state's gauss_from_update when
// that pass kept candidates for this n (update_used_*) from a key at or
// below the stop key and every listed key, at most compact_cap of
// them and at most kMaxUpdateGaussKeys keys listed (the first compaction
// then reads the candidates: GaussUpdateCollectKernel); and predicts the
// next update's bin from the stop key as the exact plan does from its
// k-th key (UpdateCandidates): one bin under the key's when the keys from
// there are at most uc.predict_cap, else the key's own, else none (also
// none after a fallback).
__global__ void __launch_bounds__(kScanThreads)
    GaussPlanKernel(DeviceState* st, const ull* hist0, const double* partials,
                    uint64_t n, double z, ull lo, ull hi, int max_adjustments,
                    ull* at_least_out, int max_keys, InitArgs init,
                    UpdateCandidates uc, ull compact_cap) {
  static_assert(kMaxBlocks <= kScanThreads, "one partial sum per thread");
  InitBlock(st, init);
  using Scan = cub::BlockScan<ull, kScanThreads, cub::BLOCK_SCAN_WARP_SCANS>;
  __shared__ typename Scan::TempStorage storage;
  __shared__ ull at_least[kBins + 1];  // keys with digit 0 >= b
  __shared__ double list_value[kGaussSide * kGaussSide];
  __shared__ bool list_reached[kGaussSide * kGaussSide];
  __shared__ int non_finite;
  if (threadIdx.x == 0) non_finite = 0;
  __syncthreads();
  ull v[2], before[2];
  for (int j = 0; j < 2; ++j) {
    const int p = 2 * static_cast<int>(threadIdx.x) + j;
    const int bin = kBins - 1 - p;
    v[j] = hist0[bin];
    if (bin >= static_cast<int>(kNonFiniteKey >> 20) && v[j] != 0) {
      non_finite = 1;
    }
  }
  Scan(storage).ExclusiveSum(v, before);
  for (int j = 0; j < 2; ++j) {
    const int p = 2 * static_cast<int>(threadIdx.x) + j;
    at_least[kBins - 1 - p] = before[j] + v[j];
    at_least_out[kBins - 1 - p] = before[j] + v[j];
  }
  if (threadIdx.x == 0) at_least[kBins] = 0;
  // The histogram pass's per-block Moments, merged in a fixed order (valid
  // in thread 0): the same input gives the same threshold on every run.
  const int b = static_cast<int>(threadIdx.x);
  const Moments all = BlockMoments<kScanThreads>(
      b < st->sum_blocks
          ? Moments{partials[3 * b], partials[3 * b + 1], partials[3 * b + 2]}
          : Moments{0.0, 0.0, 0.0});
  if (threadIdx.x != 0) return;
  if (non_finite) {
    st->error |= kErrorNonFinite;
    return;
  }
  const double mean = all.mean;
  const double var = n > 1 ? all.m2 / static_cast<double>(n - 1) : 0.0;
  double t = mean + z * sqrt(var);
  st->gk_max_adjustments = max_adjustments;
  for (int adjustment = 0;; ++adjustment) {
    const uint32_t key = MinKeyAbove(t);
    const int verdict = HistVerdict(at_least, key, lo, hi);
    const bool too_few = verdict == kTooFew;
    const bool too_many = verdict == kTooMany;
    if (!too_few && !too_many) {
      st->min_key = key;
      st->threshold = t;
      st->adjustments = adjustment;
      if (verdict == kUndecided) {
        ListGaussKeys(st, at_least, t, key, max_adjustments - adjustment, lo,
                      hi, max_keys, list_value, list_reached);
      }
      if (uc.warps != 0) GaussUpdatePlan(st, at_least, key, uc, compact_cap);
      return;
    }
    // The rule ends here (the CPU's count: this adjustment).
    st->adjustments = adjustment;
    if (adjustment == max_adjustments) break;
    t = too_few ? t * 0.5 : t * 1.5;
    if (t <= 0.0) break;
  }
  st->fallback = 1;
  st->gk_exact = 1;
  st->gk_exact_adjustments = st->adjustments;
  if (uc.warps != 0) {  // the exact top-k follows, from u: predict nothing
    PredictUpdateBin(st, false, 0, 0, 0, uc);
  }
}

// state->count_at_least += #{i < M : key(values[i]) >= min_key}.
__global__ void __launch_bounds__(kThreads)
    CountAtLeastKernel(const float* __restrict__ values, DeviceState* st,
                       uint32_t min_key) {
  const ull m = st->num_candidates;
  uint32_t c = 0;
  for (uint64_t i = uint64_t{blockIdx.x} * kThreads + threadIdx.x; i < m;
       i += uint64_t{gridDim.x} * kThreads) {
    c += Key(values[i]) >= min_key;
  }
  using Reduce = cub::BlockReduce<uint32_t, kThreads>;
  __shared__ typename Reduce::TempStorage storage;
  const uint32_t total = Reduce(storage).Sum(c);
  if (threadIdx.x == 0 && total != 0) {
    atomicAdd(&st->count_at_least, static_cast<ull>(total));
  }
}

}  // namespace

// (Launches as GTOPK_LAUNCH(kernel, grid, block, stream)(args), a form
// clang-format does not know.)
// clang-format off
void LaunchGaussPlan(cudaStream_t stream, DeviceState* st, const ull* hist0,
                     const double* partials, uint64_t n, double z, ull lo,
                     ull hi, int max_adjustments, ull* at_least_out,
                     int max_keys, const InitArgs& init,
                     const UpdateCandidates& uc, ull compact_cap) {
  GTOPK_LAUNCH(GaussPlanKernel, 1, kScanThreads, stream)(
      st, hist0, partials, n, z, lo, hi, max_adjustments, at_least_out,
      max_keys, init, uc, compact_cap);
}

void LaunchCountAtLeast(int blocks, cudaStream_t stream, const float* values,
                        DeviceState* st, uint32_t min_key) {
  GTOPK_LAUNCH(CountAtLeastKernel, blocks, kThreads, stream)(values, st,
                                                             min_key);
}
// clang-format on

}  // namespace internal
}  // namespace cuda
}  // namespace gtopk
