// The selector's host-side planning: how many keys a sample takes and at
// which rank its bound lies, the caps on compactions and kept candidates,
// and the grids and partitions of the passes over u. Plain C++ (no CUDA
// header): testable without nvcc or the emulator.
#ifndef GTOPK_COMMON_CUDA_SPARSIFY_PLAN_H_
#define GTOPK_COMMON_CUDA_SPARSIFY_PLAN_H_

#include <algorithm>
#include <cstdint>

#include "common/cuda/sparsify/state.h"

namespace gtopk {
namespace cuda {
namespace internal {

// dgc's sample for (n, k, fraction): `runs` runs of 16 (0: the sample would
// be as large as u, or k == n: the exact top-k, as on the CPU) and the rank
// of its threshold, ceil(k * sample / n).
struct DgcSample {
  uint64_t runs = 0;
  uint64_t sample_k = 0;
};
DgcSample PlanDgcSample(uint64_t n, uint64_t k, double fraction);

// The exact top-k's sample for (n, k): `runs` runs of 16 and the rank of
// its bound; runs = 0: none (n below max(4096, min_n), or k too large a
// share of n for the survivors to stay well under n/8). min_n: the
// smallest n that starts from a sample (SparsifierTuning).
struct ExactSample {
  uint64_t runs = 0;
  uint64_t rank = 0;
};
ExactSample PlanExactSample(uint64_t n, uint64_t k, uint64_t min_n);

// Keys >= the chosen bin that the exact plan compacts at once (n / 8:
// writing, gathering and compacting M candidates costs about 24 M bytes
// of traffic against 4 n for one more pass over u, and the other passes
// it saves).
inline ull CompactCap(uint64_t n) { return std::max<ull>(1, n / 8); }

// The most keys the fused update keeps as candidates for the next
// selection (n/32: its index writes cost at most 1/32 of a read of u).
inline ull PredictCap(uint64_t n) { return std::max<ull>(1, n / 32); }

// Blocks of a histogram pass over u (16 entries per thread, at most
// max_blocks).
int HistBlocks(uint64_t n, int max_blocks);

// Blocks of a pass over about `expected` candidates (4 per thread).
int CandidateBlocks(uint64_t expected, int max_blocks);

// The histogram pass's partition of u (fused or not: the same per-block
// sums): its grid, and kUpdateChunks chunks per warp of it, so that a
// warp's chunks are contiguous (the update's candidates come out in
// index order, one region per chunk) and the warps' shares even.
struct HistLayout {
  int blocks;
  int warps;  // chunks
  uint64_t chunk;
};
HistLayout HistLayoutFor(uint64_t n, int max_blocks, int update_blocks);

// A compaction pass's partition of u: its grid, warps and each warp's
// chunk (a multiple of kChunkAlign).
struct CollectLayout {
  int blocks = 0;
  int warps = 0;
  uint64_t chunk = 0;
};
CollectLayout CollectLayoutFor(uint64_t n, int max_blocks);

}  // namespace internal
}  // namespace cuda
}  // namespace gtopk

#endif  // GTOPK_COMMON_CUDA_SPARSIFY_PLAN_H_
