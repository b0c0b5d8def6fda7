// The one-block steps of the radix select (FindBinBlock, FindNextBinBlock,
// DecideBlock) and RunThen, which runs one of them in the last block of the
// pass that built its histogram. Included by .cu files only.
#ifndef GTOPK_COMMON_CUDA_SPARSIFY_RADIX_STEPS_CUH_
#define GTOPK_COMMON_CUDA_SPARSIFY_RADIX_STEPS_CUH_

#include "common/cuda/sparsify/device_common.cuh"

namespace gtopk {
namespace cuda {
namespace internal {

// Finds the digit at `level` that holds the need-th largest key among the
// keys matching the prefix, from that level's histogram (one block of
// kBlock threads: a one-block kernel's, or the last block of the pass that
// built the histogram, which reads it through L2). Level 0 also flags
// non-finite keys.
template <int kBlock>
__device__ inline void FindBinBlock(DeviceState* st, const ull* hist,
                                    int level) {
  using Scan = cub::BlockScan<ull, kBlock, cub::BLOCK_SCAN_WARP_SCANS>;
  __shared__ typename Scan::TempStorage storage;
  __shared__ int found;
  __shared__ int non_finite;
  const uint32_t error = st->error;
  const ull need = st->need;
  if (threadIdx.x == 0) {
    found = 0;
    non_finite = 0;
  }
  __syncthreads();
  if (error != 0) return;  // uniform
  const int bins = 1 << LevelBits(level);
  // The bins from the largest digit down, in tiles of one per thread (few
  // registers: in a histogram pass's last block they would count against
  // the whole pass); `above` = keys in the tiles before. The non-finite
  // digits (>= 0x7f8) lie in the first tile.
  ull above = 0;
  for (int base = 0; base < bins; base += kBlock) {
    const int p = base + static_cast<int>(threadIdx.x);  // reversed bin
    const ull v = p < bins ? __ldcg(hist + (bins - 1 - p)) : 0;
    if (level == 0 && p < bins &&
        bins - 1 - p >= static_cast<int>(kNonFiniteKey >> 20) && v != 0) {
      non_finite = 1;
    }
    ull before, total;
    Scan(storage).ExclusiveSum(v, before, total);  // keys in higher bins
    __syncthreads();   // non_finite complete; storage free for the next tile
    if (non_finite) {  // uniform
      if (threadIdx.x == 0) atomicOr(&st->error, kErrorNonFinite);
      return;
    }
    before += above;
    if (p < bins && v != 0 && before < need && need <= before + v) {
      const uint32_t digit = static_cast<uint32_t>(bins - 1 - p);
      const uint32_t prefix = st->prefix | (digit << LevelShift(level));
      st->prefix = prefix;
      st->min_key = prefix;
      st->count_greater += before;
      if (level < 2) st->greater_at[level] = st->count_greater;
      st->need = need - before;
      st->bin_count = v;
      found = 1;
    }
    above += total;
  }
  __syncthreads();
  if (threadIdx.x == 0 && !found) atomicOr(&st->error, kErrorInternal);
}

// FindBinBlock for the next undecided digit (state's levels_done), when one
// is left; then levels_done + 1.
template <int kBlock>
__device__ inline void FindNextBinBlock(DeviceState* st, const ull* hists) {
  const int level = st->levels_done;  // read by every thread before writes
  __syncthreads();
  if (level >= 3) return;  // uniform
  FindBinBlock<kBlock>(st, LevelHist(hists, level), level);
  __syncthreads();
  if (threadIdx.x == 0) st->levels_done = level + 1;
}

// Exact top-k's plan after the digit `level` from a pass over u: nothing
// once the compaction was decided. Otherwise FindBinBlock, then: the keys
// >= the new min_key (count_greater + bin_count) are at most `compact_cap`:
// compact u at that key next (the remaining digits come from the
// candidates); else, after the last digit, the final compaction reads u
// (from_u); else one more histogram pass over u decides the next digit.
// The number of passes over u therefore depends on how the keys spread
// over the digits, never on how many keys one bin holds.
template <int kBlock>
__device__ inline void DecideBlock(DeviceState* st, const ull* hists, int level,
                                   ull compact_cap) {
  const int skip = st->compact | st->from_u;  // read before writes
  __syncthreads();
  if (skip) return;  // uniform
  FindBinBlock<kBlock>(st, LevelHist(hists, level), level);
  __syncthreads();
  if (threadIdx.x != 0) return;
  st->levels_done = level + 1;
  st->u_passes = level + 1;
  if (st->error != 0) return;
  if (st->count_greater + st->bin_count <= compact_cap) {
    st->compact = 1;
  } else if (level == 2) {
    st->from_u = 1;
  }
}

// The pass's `then`, in its last block (kThreads threads). Every thread of
// every block that did not return early calls it.
__device__ inline void RunThen(DeviceState* st, const ull* hists,
                               const Then& then) {
  if (then.op == kThenNone) return;  // uniform
  if (!LastBlockDone(st)) return;    // uniform in the block
  if (then.op == kThenFindBin) {
    FindBinBlock<kThreads>(st, LevelHist(hists, then.level), then.level);
    if (then.cap != 0) {  // uniform
      __syncthreads();    // the thread that found the bin wrote the counts
      if (threadIdx.x == 0 && st->error == 0 &&
          st->count_greater + st->bin_count > then.cap) {
        st->ties_at_bound = 1;
      }
    }
  } else if (then.op == kThenDecide) {
    DecideBlock<kThreads>(st, hists, then.level, then.cap);
  } else {
    FindNextBinBlock<kThreads>(st, hists);
  }
}

}  // namespace internal
}  // namespace cuda
}  // namespace gtopk

#endif  // GTOPK_COMMON_CUDA_SPARSIFY_RADIX_STEPS_CUH_
