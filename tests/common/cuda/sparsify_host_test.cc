// The GPU selector's host-side parts that are plain C++ (common/cuda/
// sparsify/plan.h, graph_cache.h, selection_history.h), built without nvcc,
// the CUDA runtime or the emulator.
#include <cstdint>
#include <vector>

#include "common/cuda/sparsify/graph_cache.h"
#include "common/cuda/sparsify/plan.h"
#include "common/cuda/sparsify/selection_history.h"
#include "gtest/gtest.h"

namespace gtopk {
namespace cuda {
namespace internal {
namespace {

TEST(SparsifyPlanTest, DgcSampleIsRunsOf16AndItsRank) {
  // k == n, or a sample as large as half of u: none (the exact top-k).
  EXPECT_EQ(PlanDgcSample(1000, 1000, 0.01).runs, 0u);
  EXPECT_EQ(PlanDgcSample(100, 1, 1.0).runs, 0u);
  // 1 % of 100003: 1001 values, 63 runs of 16; rank ceil(1008 k / n).
  const DgcSample ds = PlanDgcSample(100003, 1000, 0.01);
  EXPECT_EQ(ds.runs, 63u);
  EXPECT_EQ(ds.sample_k, 11u);
}

TEST(SparsifyPlanTest, ExactSampleOnlyFromItsMinimumAndWithRoom) {
  EXPECT_EQ(PlanExactSample(uint64_t{1} << 21, 100, uint64_t{1} << 22).runs,
            0u);
  EXPECT_EQ(PlanExactSample(4095, 1, 0).runs, 0u);  // below 4096 never
  const uint64_t n = uint64_t{1} << 22;
  const ExactSample plan = PlanExactSample(n, 1000, uint64_t{1} << 22);
  ASSERT_NE(plan.runs, 0u);
  EXPECT_LE(plan.runs * 16, n / 32 + 15);
  // The bound's rank lies above the expected count of sample keys >= the
  // k-th key, and its survivors stay under half of CompactCap.
  const double expected = 1000.0 * plan.runs * 16 / n;
  EXPECT_GT(static_cast<double>(plan.rank), expected);
  EXPECT_LE(static_cast<double>(plan.rank) * n / (plan.runs * 16),
            CompactCap(n) / 2.0);
  // k too large a share of n: none.
  EXPECT_EQ(PlanExactSample(n, n / 4, 0).runs, 0u);
}

TEST(SparsifyPlanTest, CapsAndLayoutsCoverU) {
  EXPECT_EQ(CompactCap(0), 1u);
  EXPECT_EQ(CompactCap(800), 100u);
  EXPECT_EQ(PredictCap(10), 1u);
  EXPECT_EQ(PredictCap(3200), 100u);
  for (const uint64_t n :
       {uint64_t{1}, uint64_t{4097}, uint64_t{100003}, uint64_t{25557032}}) {
    SCOPED_TRACE(n);
    const HistLayout h = HistLayoutFor(n, kMaxBlocks, 660);
    EXPECT_GE(h.blocks, 1);
    EXPECT_LE(h.blocks, 660);
    EXPECT_EQ(h.warps, h.blocks * kWarpsPerBlock * kUpdateChunks);
    EXPECT_EQ(h.chunk % kChunkAlign, 0u);
    EXPECT_GE(h.chunk * h.warps, n);
    const CollectLayout c = CollectLayoutFor(n, kMaxBlocks);
    EXPECT_LE(c.blocks, kMaxBlocks);
    EXPECT_EQ(c.warps, c.blocks * kWarpsPerBlock);
    EXPECT_EQ(c.chunk % kChunkAlign, 0u);
    EXPECT_GE(c.chunk * c.warps, n);
    EXPECT_GE(HistBlocks(n, kMaxBlocks), 1);
    EXPECT_LE(CandidateBlocks(n, kMaxBlocks), kMaxBlocks);
  }
}

std::vector<int>* destroyed = nullptr;
void Destroy(int exec) { destroyed->push_back(exec); }

GraphKey KeyFor(uint64_t n) {
  GraphKey key{};
  key.n = n;
  key.k = 1;
  return key;
}

TEST(SparsifyGraphCacheTest, KeepsEightAndDropsTheLeastRecentlyUsed) {
  std::vector<int> gone;
  destroyed = &gone;
  {
    GraphCache<int, int> cache(&Destroy);
    for (int i = 0; i < 8; ++i) cache.Insert(KeyFor(i), 100 + i, i);
    EXPECT_EQ(cache.size(), 8u);
    auto* first = cache.Find(KeyFor(0));
    ASSERT_NE(first, nullptr);
    EXPECT_EQ(first->exec, 100);
    EXPECT_EQ(first->snapshot, 0);
    cache.Touch(first);  // 1 is now the least recently used
    EXPECT_EQ(cache.Find(KeyFor(99)), nullptr);
    cache.Insert(KeyFor(8), 108, 8);
    EXPECT_EQ(cache.size(), 8u);
    EXPECT_EQ(gone, std::vector<int>{101});
    EXPECT_EQ(cache.Find(KeyFor(1)), nullptr);
    EXPECT_NE(cache.Find(KeyFor(0)), nullptr);
    cache.Clear();
    EXPECT_EQ(cache.size(), 0u);
    EXPECT_EQ(gone.size(), 9u);
  }
  EXPECT_EQ(gone.size(), 9u);  // nothing left to drop at destruction
  destroyed = nullptr;
}

TEST(SparsifySelectionHistoryTest, ExactAfterUpdateSamplesUntilEveryEighth) {
  SelectionHistory h;
  EXPECT_FALSE(h.SampleAfterUpdate(1000, true));  // no verdict yet
  SelectionOutcome o;
  o.n = 1000;
  o.exact = true;
  o.used_update_histogram = true;
  o.exact_digit_passes = 2;  // the plan needed two passes, predicted none
  h.Record(o, DeviceState{});
  EXPECT_EQ(h.update_many_pass_n, 1000u);
  EXPECT_FALSE(h.SampleAfterUpdate(999, true));    // another n
  EXPECT_FALSE(h.SampleAfterUpdate(1000, false));  // no sample possible
  int sampled = 0;
  for (int i = 0; i < 8; ++i) sampled += h.SampleAfterUpdate(1000, true);
  EXPECT_EQ(sampled, 7);  // every 8th runs the plan again
}

TEST(SparsifySelectionHistoryTest, RecordsTheFallbacksAndTies) {
  SelectionHistory h;
  SelectionOutcome o;
  o.continuation = Continuation::kGaussianK;
  o.n = 5000;
  o.fell_back = true;
  DeviceState last{};
  last.update_pred_n = 5000;
  last.update_pred_key = 7;
  last.update_pred_ties = 1;
  h.Record(o, last);
  EXPECT_TRUE(h.expect_exact);
  EXPECT_EQ(h.gauss_exact_predicted_n, 5000u);
  EXPECT_TRUE(h.GaussFallbackFromUpdate(5000));
  EXPECT_EQ(h.ties_predicted_n, 5000u);
  h.gauss_fallback_from_candidates = false;
  EXPECT_FALSE(h.GaussFallbackFromUpdate(5000));
  o.continuation = Continuation::kDgc;
  o.took_exact = true;
  h.Record(o, DeviceState{});
  EXPECT_TRUE(h.dgc_expect_exact);
  EXPECT_EQ(h.ties_predicted_n, 0u);
  o.continuation = Continuation::kExact;
  o.ran_sampled = true;
  o.sample_missed = true;
  h.Record(o, DeviceState{});
  EXPECT_TRUE(h.exact_expect_from_u);
  EXPECT_FALSE(h.gauss_expect_from_u);
}

}  // namespace
}  // namespace internal
}  // namespace cuda
}  // namespace gtopk
