// Device helpers every stage of the selector uses (common/cuda/sparsify/
// *.cu): the radix digits of the magnitude key, the gate check, block-wide
// scans and sums, and the last-block handshake. Included by .cu files only.
#ifndef GTOPK_COMMON_CUDA_SPARSIFY_DEVICE_COMMON_CUH_
#define GTOPK_COMMON_CUDA_SPARSIFY_DEVICE_COMMON_CUH_

#include <cstdint>
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include "common/cuda/sparsify/kernel_args.h"
#include "common/cuda/sparsify/state.h"
#include "common/magnitude_key.h"

namespace gtopk {
namespace cuda {
namespace internal {

// Radix digits of the 31-bit key: bits 30..20, 19..9, 8..0.
GTOPK_HOST_DEVICE inline int LevelShift(int level) {
  return level == 0 ? 20 : (level == 1 ? 9 : 0);
}
GTOPK_HOST_DEVICE inline int LevelBits(int level) {
  return level == 2 ? 9 : 11;
}

// |x|'s key (common/magnitude_key.h); a sample's keys are keys already.
__device__ inline uint32_t Key(float x) { return MagnitudeKey(x); }
__device__ inline uint32_t Key(uint32_t key) { return key; }

// Does `key` share the digits above `level` with `prefix`?
__device__ inline bool MatchesPrefix(uint32_t key, uint32_t prefix, int level) {
  const int high = LevelShift(level) + LevelBits(level);
  return high >= 31 || (key >> high) == (prefix >> high);
}
__device__ inline uint32_t Digit(uint32_t key, int level) {
  return (key >> LevelShift(level)) & ((1u << LevelBits(level)) - 1u);
}

__device__ inline bool Closed(Gate g) {
  return g.flag != nullptr && *g.flag != g.value;
}

// The histogram of digit `level` in `hists` (hist0, hist1, hist2 are
// contiguous, kBins apart).
__device__ inline ull* LevelHist(ull* hists, int level) {
  return hists + level * kBins;
}
__device__ inline const ull* LevelHist(const ull* hists, int level) {
  return hists + level * kBins;
}

// A kept index into the output at `pos`, with its value read from u
// (zero: u[idx] = +0.0 after reading); returns the value.
__device__ inline float TakeKept(uint32_t idx, float* u, uint32_t* out_idx,
                                 float* out_val, ull pos, int zero) {
  const float v = u[idx];
  out_idx[pos] = idx;
  out_val[pos] = v;
  if (zero) u[idx] = 0.0f;
  return v;
}

// Exclusive prefix sums of v[0, count) in place, in tiles of kBlock (v
// written by the other blocks of the grid: read through L2); returns the
// total in every thread. One block: a pass's last (LastBlockDone).
template <int kBlock>
__device__ inline ull ScanInPlace(ull* v, int count) {
  using Scan = cub::BlockScan<ull, kBlock, cub::BLOCK_SCAN_WARP_SCANS>;
  __shared__ typename Scan::TempStorage storage;
  ull above = 0;
  for (int base = 0; base < count; base += kBlock) {
    const int i = base + static_cast<int>(threadIdx.x);
    const ull x = i < count ? __ldcg(v + i) : 0;
    ull before, total;
    Scan(storage).ExclusiveSum(x, before, total);
    __syncthreads();  // storage free for the next tile
    if (i < count) v[i] = above + before;
    above += total;
  }
  return above;
}

// The sum of the block's per-warp counts `mine` (every thread passes its
// warp's; lane 0's is used), in every thread.
__device__ inline ull BlockTotal(uint32_t mine) {
  __shared__ uint32_t warp_counts[kWarpsPerBlock];
  __shared__ ull block_total;
  if ((threadIdx.x & 31) == 0) warp_counts[threadIdx.x / 32] = mine;
  __syncthreads();
  if (threadIdx.x == 0) {
    ull t = 0;
    for (int w = 0; w < kWarpsPerBlock; ++w) t += warp_counts[w];
    block_total = t;
  }
  __syncthreads();
  return block_total;
}

// True in every thread of the block that finishes the grid's pass last
// (the count of finished blocks in state's blocks_done, which it resets):
// every other block's atomics and writes are then visible to it (the fence
// before counting; reads through L2, __ldcg). Every thread of the block
// must call it.
__device__ inline bool LastBlockDone(DeviceState* st) {
  __shared__ int last;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    const unsigned int before = atomicAdd(&st->blocks_done, 1u);
    last = before == gridDim.x - 1;
    if (last) st->blocks_done = 0;
  }
  __syncthreads();
  const bool is_last = last != 0;
  if (is_last) __threadfence();
  return is_last;
}

}  // namespace internal
}  // namespace cuda
}  // namespace gtopk

#endif  // GTOPK_COMMON_CUDA_SPARSIFY_DEVICE_COMMON_CUH_
