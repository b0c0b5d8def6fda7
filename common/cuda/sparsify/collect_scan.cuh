// What follows a compaction pass in its last block (CollectScanBlock: the
// scan of the kept counts, the accept / trim / tie-write / fallback
// decision) and the predictions of the next fused update's candidates
// (PredictUpdateBin, GroupOffsets). Included by .cu files only.
#ifndef GTOPK_COMMON_CUDA_SPARSIFY_COLLECT_SCAN_CUH_
#define GTOPK_COMMON_CUDA_SPARSIFY_COLLECT_SCAN_CUH_

#include "common/cuda/sparsify/device_common.cuh"
#include "common/cuda/sparsify/gauss_steps.cuh"
#include "common/cuda/sparsify/radix_steps.cuh"

namespace gtopk {
namespace cuda {
namespace internal {

// The bin the next first pass of an n = uc.n residual keeps candidates
// from (state's update_pred_*; thread 0), from a key in digit-0 bin `bin`
// (known: the selection found one): one bin under it when the keys from
// there (at_below) are at most uc.predict_cap, else `bin` itself when the
// keys from it (at_bin) are, else none. Shared by the exact plan (its k-th
// key) and the Gaussian-k planner (its stop key). Returns whether it
// predicted a bin.
__device__ inline bool PredictUpdateBin(DeviceState* st, bool known,
                                        uint32_t bin, ull at_bin, ull at_below,
                                        const UpdateCandidates& uc) {
  ull pred = 0;
  if (known && at_bin <= uc.predict_cap) {
    const uint32_t from = bin > 0 && at_below <= uc.predict_cap ? bin - 1 : bin;
    pred = (ull{from} << 20) + 1;
  }
  st->update_pred_key = pred;
  st->update_pred_ties = 0;
  st->update_pred_n = uc.n;
  return pred != 0;
}

// The per-chunk counts of the update's layout (`warps` chunks) summed per
// group of kWarpsPerBlock chunks (a compaction block's), then their
// exclusive scan into `offsets`; returns the total (every thread of the
// one block of kScanThreads).
__device__ inline ull GroupOffsets(const uint32_t* counts, ull* offsets,
                                   int warps) {
  const int groups = warps / kWarpsPerBlock;
  for (int g = threadIdx.x; g < groups; g += kScanThreads) {
    ull t = 0;
    for (int w = 0; w < kWarpsPerBlock; ++w)
      t += counts[g * kWarpsPerBlock + w];
    offsets[g] = t;
  }
  __syncthreads();
  return ScanInPlace<kScanThreads>(offsets, groups);
}

// The trim: the exact top-k among the kept survivors, a radix select over
// them restarted from the digit-0 histogram the compaction built (state's
// trim gates the kernels that finish it). One thread.
__device__ inline void StartTrim(DeviceState* st, ull k) {
  st->trim = 1;
  st->need = k;
  st->prefix = 0;
  st->count_greater = 0;
  st->levels_done = 0;
}

__device__ inline void CollectScanBlock(DeviceState* st, const ull* hists,
                                        const CollectScan& s, ull block_total,
                                        bool ties, ull block_equal,
                                        int slots = -1) {
  // slots < 0: a compaction over u, one count per block (written here);
  // else GaussUpdateCollectKernel, which wrote `slots` group counts itself.
  const bool over_u = slots < 0;
  if (over_u) slots = static_cast<int>(gridDim.x);
  if (threadIdx.x == 0 && over_u) {
    s.block_offsets[blockIdx.x] = block_total;
    if (ties) s.block_equal[blockIdx.x] = block_equal;
  }
  if (!LastBlockDone(st)) return;  // uniform in the block
  // A compaction over u replaces the update's candidates (same regions).
  if (threadIdx.x == 0 && over_u) st->gauss_from_update = 0;
  const ull total = ScanInPlace<kThreads>(s.block_offsets, slots);
  const ull equal =
      ties ? ScanInPlace<kThreads>(s.block_equal, static_cast<int>(gridDim.x))
           : 0;
  if (threadIdx.x == 0 && ties) {
    // Ties at the sample's bound B (exact's sample, or dgc's threshold):
    // `total` keys > B were kept and `equal` keys == B counted.
    st->num_candidates = total;
    st->tie_count = equal;
    const ull k = s.accept_hi;
    ull write_need = 0, write_count = 0;  // a tie write: > B, then ties
    bool accepted = false, trim = false, from_u = false;
    if (st->error != 0) {
      // nothing: Wait reports it
    } else if (s.sampled_exact) {
      if (total == k) {
        accepted = true;  // exactly the top k
      } else if (total > k) {
        trim = total <= s.exact_above;  // the top k are all > B
        from_u = !trim;
      } else if (total + equal >= k) {  // the k-th key is B
        write_need = k - total;
        write_count = k;
      } else {
        from_u = true;  // the sample missed
      }
    } else if (total == k) {
      accepted = true;  // dgc: exactly its top k are > B
    } else if (total + equal <= k) {
      // dgc: every survivor (key >= B): the keys > B and every tie.
      write_need = equal;
      write_count = total + equal;
    } else if (total >= k) {
      // dgc: the exact top-k among the survivors, all of them > B.
      trim = total <= s.exact_above;
      from_u = !trim;
    } else {  // dgc: the k-th survivor is B
      write_need = k - total;
      write_count = k;
    }
    st->accepted = accepted;
    if (write_count != 0) {
      st->tie_write = 1;
      st->from_u = 1;
      st->prefix = st->min_key;
      st->need = write_need;
      st->num_selected = write_count;
    }
    if (trim) StartTrim(st, k);
    if (from_u && s.sampled_exact) {
      st->exact_from_u = 1;
    } else if (from_u) {
      st->gk_exact = 1;
      st->gk_exact_candidates = total + equal;
    }
  } else if (threadIdx.x == 0) {
    st->num_candidates = total;
    st->accepted = st->error == 0 && st->fallback == 0 &&
                   total >= s.accept_lo && total <= s.accept_hi;
    if (s.at_least != nullptr) {
      GaussResolve(st, s.at_least, s.accept_lo, s.accept_hi);
    }
    // dgc: more than exact_above survive (most of u ties with the sampled
    // threshold); exact's sample: that, or fewer than k (it missed): the
    // exact top-k from u, gated on gk_exact (exact_from_u).
    if (st->error == 0 && !st->accepted &&
        ((s.exact_above != 0 && total > s.exact_above) ||
         total < s.exact_below)) {
      if (s.sampled_exact) {
        st->exact_from_u = 1;
      } else {
        st->gk_exact = 1;
        st->gk_exact_candidates = total;
      }
    }
    // dgc and exact's sample: the exact top-k among the survivors, a radix
    // select over them from the digit-0 histogram this pass built.
    if (s.trim && st->error == 0 && !st->accepted && total > s.accept_hi &&
        (s.exact_above == 0 || total <= s.exact_above)) {
      StartTrim(st, s.accept_hi);
    }
  }
  __syncthreads();
  if (s.find_next || st->trim != 0) FindNextBinBlock<kThreads>(st, hists);
}

}  // namespace internal
}  // namespace cuda
}  // namespace gtopk

#endif  // GTOPK_COMMON_CUDA_SPARSIFY_COLLECT_SCAN_CUH_
