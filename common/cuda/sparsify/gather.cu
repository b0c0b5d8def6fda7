// Stage: the gather of a compaction's (or the fused update's) kept indices
// into the output or the candidate arrays (GatherKernel).
#include "common/cuda/launch.h"
#include "common/cuda/sparsify/device_common.cuh"
#include "common/cuda/sparsify/launchers.h"
#include "common/cuda/sparsify/radix_steps.cuh"

namespace gtopk {
namespace cuda {
namespace internal {
namespace {

// Concatenates the warps' regions (index order) into out_idx/out_val, with
// the values read from u (the fused update's regions in its layout `upd`
// when state's from_update); zero: u[i] = +0.0 after reading. next_hist: the
// histogram of the next undecided digit (state's levels_done, if < 3) over
// the gathered keys matching state's prefix, into that digit's histogram in
// `hists`. Then `then`. Nothing when the exact plan reads u (state's
// from_u). `route` (GatherRoute) says where to, as the state decides.
__global__ void __launch_bounds__(kThreads)
    GatherKernel(float* u, const uint32_t* __restrict__ regions, uint64_t chunk,
                 const uint32_t* __restrict__ counts,
                 const ull* __restrict__ offsets, int num_warps,
                 uint32_t* __restrict__ out_idx, float* __restrict__ out_val,
                 uint32_t* __restrict__ trim_idx, float* __restrict__ trim_val,
                 int zero, DeviceState* st, ull* hists, int next_hist,
                 int route, Gate gate, Then then, UpdateLayout upd) {
  __shared__ uint32_t hist[kBins];
  if (Closed(gate) || st->from_u != 0) return;               // uniform
  if (st->from_update != 0 || st->gauss_from_update != 0) {  // uniform
    chunk = upd.chunk;
    counts = upd.counts;
    offsets = upd.offsets;
    num_warps = upd.warps;
  }
  const bool accepted = st->accepted != 0;
  const bool trimming = route == kGatherDgc && !accepted && st->trim != 0;
  if (route == kGatherDgc && !trimming) then.op = kThenNone;  // uniform
  if (trimming) {
    out_idx = trim_idx;
    out_val = trim_val;
    zero = 0;
  }
  const int hist_level =
      next_hist && (route != kGatherDgc || trimming) && st->levels_done < 3
          ? st->levels_done
          : -1;
  const bool with_hist = hist_level >= 0;
  if (with_hist) {
    for (int i = threadIdx.x; i < kBins; i += kThreads) hist[i] = 0;
  }
  __syncthreads();
  const bool skip =
      st->error != 0 || (route != kGatherAlways && !accepted && !trimming);
  const uint32_t prefix = st->prefix;
  const int lane = threadIdx.x & 31;
  const int total_warps = static_cast<int>(gridDim.x) * kWarpsPerBlock;
  if (!skip) {
    for (int w = static_cast<int>(blockIdx.x) * kWarpsPerBlock +
                 static_cast<int>(threadIdx.x) / 32;
         w < num_warps; w += total_warps) {
      const uint32_t c = counts[w];
      // The compaction's block offset plus its warps before this one.
      const int first = w - w % kWarpsPerBlock;
      ull off = offsets[w / kWarpsPerBlock];
      for (int j = first; j < w; ++j) off += counts[j];
      const uint32_t* region = regions + uint64_t(w) * chunk;
      for (uint32_t j = lane; j < c; j += 32) {
        const float v = TakeKept(region[j], u, out_idx, out_val, off + j, zero);
        if (with_hist) {
          const uint32_t key = Key(v);
          if (MatchesPrefix(key, prefix, hist_level)) {
            atomicAdd(&hist[Digit(key, hist_level)], 1u);
          }
        }
      }
    }
  }
  if (with_hist) {
    __syncthreads();
    ull* out = LevelHist(hists, hist_level);
    for (int i = threadIdx.x; i < kBins; i += kThreads) {
      if (hist[i] != 0) atomicAdd(&out[i], static_cast<ull>(hist[i]));
    }
  }
  RunThen(st, hists, then);
}

}  // namespace

// (Launches as GTOPK_LAUNCH(kernel, grid, block, stream)(args), a form
// clang-format does not know.)
// clang-format off
void LaunchGather(int blocks, cudaStream_t stream, float* u,
                  const uint32_t* regions, uint64_t chunk,
                  const uint32_t* counts, const ull* offsets, int num_warps,
                  uint32_t* out_idx, float* out_val, uint32_t* trim_idx,
                  float* trim_val, int zero, DeviceState* st, ull* hists,
                  int next_hist, int route, Gate gate, Then then,
                  const UpdateLayout& upd) {
  GTOPK_LAUNCH(GatherKernel, blocks, kThreads, stream)(
      u, regions, chunk, counts, offsets, num_warps, out_idx, out_val,
      trim_idx, trim_val, zero, st, hists, next_hist, route, gate, then, upd);
}
// clang-format on

}  // namespace internal
}  // namespace cuda
}  // namespace gtopk
