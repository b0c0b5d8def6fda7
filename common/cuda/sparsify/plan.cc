// The selector's host-side planning (plan.h).
#include "common/cuda/sparsify/plan.h"

#include <cmath>

namespace gtopk {
namespace cuda {

namespace internal {

DgcSample PlanDgcSample(uint64_t n, uint64_t k, double fraction) {
  constexpr uint64_t kRunLength = 16;
  const uint64_t wanted =
      static_cast<uint64_t>(std::ceil(fraction * static_cast<double>(n)));
  const uint64_t runs = (wanted + kRunLength - 1) / kRunLength;
  DgcSample ds;
  if (k == n || runs * kRunLength * 2 >= n) return ds;
  ds.runs = runs;
  const uint64_t sample_size = runs * kRunLength;
  ds.sample_k = std::max<uint64_t>(
      1, static_cast<uint64_t>(std::ceil(static_cast<double>(sample_size) *
                                         static_cast<double>(k) /
                                         static_cast<double>(n))));
  return ds;
}

ExactSample PlanExactSample(uint64_t n, uint64_t k, uint64_t min_n) {
  if (n < std::max<uint64_t>(4096, min_n)) return {};
  // About 256 expected sample keys at or above the k-th key, 64Ki keys at
  // least, n/32 at most (the sample's three digit passes stay small).
  const double want = 256.0 * static_cast<double>(n) / static_cast<double>(k);
  const uint64_t size = std::min<uint64_t>(
      n / 32, static_cast<uint64_t>(std::max(65536.0, std::ceil(want))));
  ExactSample plan;
  plan.runs = (size + 15) / 16;
  const uint64_t sample = plan.runs * 16;
  // Expected sample keys >= the k-th key, and a bound 24 sqrt + 8 above:
  // 6 standard deviations even if every run of 16 were one value (the
  // variance of a sum of 16-value clusters), so the bound keeps >= k keys
  // of u unless the sample is far off.
  const double expected =
      std::ceil(static_cast<double>(k) * static_cast<double>(sample) /
                static_cast<double>(n));
  plan.rank = static_cast<uint64_t>(
      expected + std::ceil(24.0 * std::sqrt(expected)) + 8.0);
  // The survivors expected at that rank must stay under half the exact
  // plan's compaction cap (CompactCap, n/8).
  const double survivors = static_cast<double>(plan.rank) *
                           static_cast<double>(n) / static_cast<double>(sample);
  if (plan.rank > sample ||
      survivors > static_cast<double>(std::max<uint64_t>(1, n / 8)) / 2) {
    return {};
  }
  return plan;
}

int HistBlocks(uint64_t n, int max_blocks) {
  uint64_t blocks =
      (n + uint64_t{kThreads} * 16 - 1) / (uint64_t{kThreads} * 16);
  return static_cast<int>(
      std::max<uint64_t>(1, std::min<uint64_t>(blocks, max_blocks)));
}

int CandidateBlocks(uint64_t expected, int max_blocks) {
  uint64_t blocks =
      (expected + uint64_t{kThreads} * 4 - 1) / (uint64_t{kThreads} * 4);
  return static_cast<int>(
      std::max<uint64_t>(1, std::min<uint64_t>(blocks, max_blocks)));
}

HistLayout HistLayoutFor(uint64_t n, int max_blocks, int update_blocks) {
  HistLayout l;
  l.blocks = std::min(HistBlocks(n, max_blocks), update_blocks);
  l.warps = l.blocks * kWarpsPerBlock * kUpdateChunks;
  const uint64_t chunk = (n + l.warps - 1) / l.warps;
  l.chunk = (chunk + kChunkAlign - 1) / kChunkAlign * kChunkAlign;
  return l;
}

CollectLayout CollectLayoutFor(uint64_t n, int max_blocks) {
  uint64_t blocks =
      (n + uint64_t{kThreads} * 16 - 1) / (uint64_t{kThreads} * 16);
  blocks = std::max<uint64_t>(1, std::min<uint64_t>(blocks, max_blocks));
  CollectLayout l;
  l.blocks = static_cast<int>(blocks);
  l.warps = l.blocks * kWarpsPerBlock;
  uint64_t chunk = (n + l.warps - 1) / l.warps;
  l.chunk = (chunk + kChunkAlign - 1) / kChunkAlign * kChunkAlign;
  return l;
}

}  // namespace internal
}  // namespace cuda
}  // namespace gtopk
