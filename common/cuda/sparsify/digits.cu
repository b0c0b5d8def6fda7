// Stage: the radix digits after the first: histogram passes over u
// (HistLevelKernel) and over candidate or sample arrays (HistArrayKernel),
// and the first digit's decision after the fused update's histogram
// (FindBinDecideKernel), each finishing in a one-block step (RunThen).
#include "common/cuda/launch.h"
#include "common/cuda/sparsify/collect_scan.cuh"
#include "common/cuda/sparsify/device_common.cuh"
#include "common/cuda/sparsify/init_block.cuh"
#include "common/cuda/sparsify/launchers.h"

namespace gtopk {
namespace cuda {
namespace internal {
namespace {

// DecideBlock on its own (the digit-0 histogram came from the fused
// update), after InitBlock when init.run; then, at level 0, the update's
// candidates (UpdateCandidates) when they hold the plan's (k = init.need).
__global__ void __launch_bounds__(kScanThreads)
    FindBinDecideKernel(DeviceState* st, const ull* hists, int level,
                        ull compact_cap, Gate gate, InitArgs init,
                        UpdateCandidates uc) {
  if (Closed(gate)) return;  // uniform
  InitBlock(st, init);
  DecideBlock<kScanThreads>(st, hists, level, compact_cap);
  if (level != 0 || uc.warps == 0) return;  // uniform
  __shared__ int kept, kept_ties;
  __shared__ uint32_t kept_from;
  __syncthreads();  // DecideBlock's thread 0 wrote the plan
  if (threadIdx.x == 0) {
    kept = st->error == 0 && st->update_used_n == uc.n &&
           st->update_used_key != 0 && st->update_clobbered == 0;
    kept_ties = kept && st->update_used_ties != 0;
    kept_from = static_cast<uint32_t>(st->update_used_key - 1);
  }
  __syncthreads();
  // The kept keys' offsets (GatherKernel's, the tie write's), and the
  // ties' (uniform branches).
  const ull total = kept ? GroupOffsets(uc.counts, uc.offsets, uc.warps) : 0;
  const ull equal =
      kept_ties ? GroupOffsets(uc.eq_counts, uc.eq_offsets, uc.warps) : 0;
  if (threadIdx.x != 0) return;
  const bool ok = st->error == 0;
  const ull k = init.need;
  // The kept keys (all keys >= kept_from) hold the top k.
  const bool use = kept && total >= k && total <= compact_cap;
  if (kept_ties && !use && total < k && total + equal >= k) {
    // The k-th key is K = kept_from - 1 again: the kept keys (> K) and
    // the first k - total ties, written from u on the update's layout.
    const uint32_t tie_key = kept_from - 1;
    st->update_tie_write = 1;
    st->from_update = 1;
    st->from_u = 1;
    st->compact = 1;
    st->levels_done = 3;
    st->prefix = tie_key;
    st->min_key = tie_key;
    st->count_greater = total;
    st->need = k - total;
    st->num_candidates = total;
    st->num_selected = k;
    // The same key next time.
    st->update_pred_key = ull{kept_from} + 1;
    st->update_pred_ties = 1;
    st->update_pred_n = uc.n;
    return;
  }
  if (use) {
    st->from_update = 1;
    st->num_candidates = total;
    // The remaining digits come from the candidates, however many keys
    // the k-th key's bin holds in u.
    st->compact = 1;
  }
  // The next update's key. Keys at or above the k-th key's bin:
  // count_greater covers the bins above it, bin_count its own.
  const uint32_t bin = st->prefix >> 20;  // the k-th key's digit 0
  const ull at_bin = st->count_greater + st->bin_count;
  if (!PredictUpdateBin(st, ok, bin, at_bin,
                        ok && bin > 0 ? at_bin + hists[bin - 1] : at_bin, uc) &&
      ok) {
    st->predict_fine = 1;
    st->fine_floor = use ? kept_from : 0;
    st->fine_cap = FineCap(init.need, uc.predict_cap);
  }
}

// Histogram of digit `level` over u, keys matching state's prefix, then
// `then` (the plan's DecideBlock at that digit); nothing once the compaction
// was decided (state's compact), no histogram after an error.
__global__ void __launch_bounds__(kThreads)
    HistLevelKernel(const float* __restrict__ u, uint64_t n, int vectorized,
                    DeviceState* st, ull* hists, int level, Gate gate,
                    Then then) {
  if (Closed(gate) || st->compact != 0) return;  // uniform
  const bool skip = st->error != 0;
  __shared__ uint32_t hist[kBins];
  for (int i = threadIdx.x; i < kBins; i += kThreads) hist[i] = 0;
  __syncthreads();
  const uint32_t prefix = st->prefix;
  const uint64_t stride = uint64_t{gridDim.x} * kThreads;
  for (uint64_t g4 = uint64_t{blockIdx.x} * kThreads + threadIdx.x;
       !skip && g4 * 4 < n; g4 += stride) {
    const uint64_t i = g4 * 4;
    float x[4];
    int valid = 4;
    if (vectorized && i + 3 < n) {
      const float4 v = __ldg(reinterpret_cast<const float4*>(u + i));
      x[0] = v.x;
      x[1] = v.y;
      x[2] = v.z;
      x[3] = v.w;
    } else {
      valid = static_cast<int>(n - i < 4 ? n - i : 4);
      for (int j = 0; j < valid; ++j) x[j] = u[i + j];
    }
    for (int j = 0; j < valid; ++j) {
      const uint32_t key = Key(x[j]);
      if (MatchesPrefix(key, prefix, level)) {
        atomicAdd(&hist[Digit(key, level)], 1u);
      }
    }
  }
  __syncthreads();
  ull* out = LevelHist(hists, level);
  for (int i = threadIdx.x; i < kBins; i += kThreads) {
    if (hist[i] != 0) atomicAdd(&out[i], static_cast<ull>(hist[i]));
  }
  RunThen(st, hists, then);
}

// Histogram of digit `level` over data[0, len) (len = *d_len when given),
// keys matching state's prefix, into that digit's histogram in `hists`;
// then `then`. Nothing when the gate is closed or state's levels_done
// says that digit is decided already.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    HistArrayKernel(const T* __restrict__ data, const ull* d_len, uint64_t len,
                    DeviceState* st, ull* hists, int level, Gate gate,
                    Then then) {
  // Nothing once that digit is decided (the exact plan's digit 2, when its
  // compaction pass already counted digit 1).
  if (Closed(gate) || st->levels_done > level) return;  // uniform
  __shared__ uint32_t hist[kBins];
  for (int i = threadIdx.x; i < kBins; i += kThreads) hist[i] = 0;
  __syncthreads();
  const bool skip = st->error != 0;
  const uint64_t length = d_len != nullptr ? *d_len : len;
  const uint32_t prefix = st->prefix;
  if (!skip) {
    for (uint64_t i = uint64_t{blockIdx.x} * kThreads + threadIdx.x; i < length;
         i += uint64_t{gridDim.x} * kThreads) {
      const uint32_t key = Key(data[i]);
      if (MatchesPrefix(key, prefix, level)) {
        atomicAdd(&hist[Digit(key, level)], 1u);
      }
    }
  }
  __syncthreads();
  ull* out = LevelHist(hists, level);
  for (int i = threadIdx.x; i < kBins; i += kThreads) {
    if (hist[i] != 0) atomicAdd(&out[i], static_cast<ull>(hist[i]));
  }
  RunThen(st, hists, then);
}

}  // namespace

// (Launches as GTOPK_LAUNCH(kernel, grid, block, stream)(args), a form
// clang-format does not know.)
// clang-format off
void LaunchHistLevel(int blocks, cudaStream_t stream, const float* u,
                     uint64_t n, int vectorized, DeviceState* st, ull* hists,
                     int level, Gate gate, Then then) {
  GTOPK_LAUNCH(HistLevelKernel, blocks, kThreads, stream)(
      u, n, vectorized, st, hists, level, gate, then);
}

void LaunchHistArray(int blocks, cudaStream_t stream, const float* data,
                     const ull* d_len, uint64_t len, DeviceState* st,
                     ull* hists, int level, Gate gate, Then then) {
  GTOPK_LAUNCH(HistArrayKernel<float>, blocks, kThreads, stream)(
      data, d_len, len, st, hists, level, gate, then);
}

void LaunchHistArray(int blocks, cudaStream_t stream, const uint32_t* data,
                     const ull* d_len, uint64_t len, DeviceState* st,
                     ull* hists, int level, Gate gate, Then then) {
  GTOPK_LAUNCH(HistArrayKernel<uint32_t>, blocks, kThreads, stream)(
      data, d_len, len, st, hists, level, gate, then);
}

void LaunchFindBinDecide(cudaStream_t stream, DeviceState* st,
                         const ull* hists, int level, ull compact_cap,
                         Gate gate, const InitArgs& init,
                         const UpdateCandidates& uc) {
  GTOPK_LAUNCH(FindBinDecideKernel, 1, kScanThreads, stream)(
      st, hists, level, compact_cap, gate, init, uc);
}
// clang-format on

}  // namespace internal
}  // namespace cuda
}  // namespace gtopk
