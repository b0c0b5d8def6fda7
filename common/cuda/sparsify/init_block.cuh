// InitKernel's work by one whole block (InitArgs), also run at the start of
// the one-block kernels that follow an Init directly. Included by .cu files
// only.
#ifndef GTOPK_COMMON_CUDA_SPARSIFY_INIT_BLOCK_CUH_
#define GTOPK_COMMON_CUDA_SPARSIFY_INIT_BLOCK_CUH_

#include "common/cuda/sparsify/device_common.cuh"

namespace gtopk {
namespace cuda {
namespace internal {

// InitKernel's work, by one whole block (any size), when a.run: also at the
// start of the one-block kernel that follows Init directly (the planner
// and the first digit's decision after Accumulate's histogram), one launch
// less. The block must have read the gate already.
__device__ inline void InitBlock(DeviceState* st, const InitArgs& a) {
  if (!a.run) return;  // uniform
  __syncthreads();     // every thread has read the gate before thread 0 writes
  ull* hist0 = a.hist0;
  ull* hist1 = a.hist1;
  ull* hist2 = a.hist2;
  ull* trim_hists = a.trim_hists;
  const ull* seed = a.seed;
  const ull need = a.need;
  const int zero_hist0 = a.zero_hist0, keep_sums = a.keep_sums;
  const int keep_candidates = a.keep_candidates, keep_gate = a.keep_gate;
  for (int i = threadIdx.x; i < kBins; i += blockDim.x) {
    if (zero_hist0) hist0[i] = 0;
    hist1[i] = 0;
    if (i < 512) hist2[i] = 0;
  }
  if (trim_hists != nullptr) {
    for (int i = threadIdx.x; i < kHistsSize; i += blockDim.x) {
      trim_hists[i] = 0;
    }
  }
  // What is kept, read (thread 0) before the block zeroes the state.
  int sum_blocks = 0, exact = 0, exact_adjustments = 0, exact_from_u = 0;
  ull candidates = 0, exact_candidates = 0, step_seed = 0;
  ull pred_key = 0, pred_n = 0, used_key = 0, used_n = 0;
  int pred_ties = 0, used_ties = 0, clobbered = 0;
  uint32_t error = 0;
  if (threadIdx.x == 0) {
    pred_key = a.clear_prediction ? 0 : st->update_pred_key;
    pred_ties = a.clear_prediction ? 0 : st->update_pred_ties;
    pred_n = st->update_pred_n;
    used_key = st->update_used_key;
    used_ties = st->update_used_ties;
    used_n = st->update_used_n;
    clobbered = st->update_clobbered;
    sum_blocks = st->sum_blocks;
    candidates = st->num_candidates;
    exact = st->gk_exact;
    exact_adjustments = st->gk_exact_adjustments;
    exact_candidates = st->gk_exact_candidates;
    exact_from_u = st->exact_from_u;
    error = st->error;
    if (seed != nullptr) step_seed = *seed;
  }
  __syncthreads();
  static_assert(sizeof(DeviceState) % sizeof(ull) == 0, "whole words");
  ull* words = reinterpret_cast<ull*>(st);
  for (int i = threadIdx.x; i < static_cast<int>(sizeof(DeviceState) / 8);
       i += blockDim.x) {
    words[i] = 0;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    st->need = need;
    st->first_non_finite = ~0ull;
    st->seed = step_seed;
    st->update_pred_key = pred_key;
    st->update_pred_ties = pred_ties;
    st->update_pred_n = pred_n;
    st->update_used_key = used_key;
    st->update_used_ties = used_ties;
    st->update_used_n = used_n;
    st->update_clobbered = clobbered;
    if (keep_sums) st->sum_blocks = sum_blocks;
    if (keep_candidates) st->num_candidates = candidates;
    if (keep_gate) {  // and an error the gated-on chain found before
      st->gk_exact = exact;
      st->gk_exact_adjustments = exact_adjustments;
      st->gk_exact_candidates = exact_candidates;
      st->exact_from_u = exact_from_u;
      st->error = error;
    }
  }
  __syncthreads();  // the state is written before the block goes on
}

}  // namespace internal
}  // namespace cuda
}  // namespace gtopk

#endif  // GTOPK_COMMON_CUDA_SPARSIFY_INIT_BLOCK_CUH_
