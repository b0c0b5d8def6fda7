// GaussianKSelector (common/cpu/gaussiank_selector.cc): the threshold's
// adjustments on heavy tails and two populations, none on normal data, and
// the standard deviation of tiny values. Its count contract on every input
// family is SelectorTest's (tests/common/selector_test.cc). Moved from
// tests/common/selector_test.cc (issue 44: tests mirror sources).
#include <cmath>
#include <cstdint>
#include <vector>

#include "common/cpu/selectors.h"
#include "common/sparse_vector.h"
#include "gtest/gtest.h"
#include "tests/testing/reference.h"
#include "tests/testing/status_matchers.h"

namespace gtopk {
namespace {

using ::gtopk::testing::Distribution;
using ::gtopk::testing::MakeInput;
using ::gtopk::testing::ReferenceTopK;

TEST(GaussianKTest, AdjustsThresholdIntoRangeOnHeavyTails) {
  // Student-t tails put far more than k above the Gaussian threshold, so the
  // x1.5 adjustments must run; the count must still land in range.
  const size_t n = 1 << 20;
  const std::vector<float> u = MakeInput(Distribution::kHeavyTailed, n, 5);
  cpu::GaussianKSelector selector(SelectorOptions{});
  for (uint64_t k : {1049ul, 10486ul}) {
    SparseVector out;
    GTOPK_ASSERT_OK(selector.Select(u, k, 0, &out));
    // Reached by scaling the threshold up, not by the exact fallback.
    EXPECT_GE(selector.last_adjustments(), 1) << "k=" << k;
    EXPECT_FALSE(selector.last_fell_back()) << "k=" << k;
    EXPECT_GE(out.size(), (2 * k + 2) / 3);
    EXPECT_LE(out.size(), 4 * k / 3);
    EXPECT_EQ(out, ReferenceTopK(u, out.size()));
  }
}

// Tiny residuals (denormals, |x| ~ 1e-42): their squares underflow in
// float, so a float-lane sum of squares would give std 0 and the threshold
// the mean. The threshold must be mean + z*std of the values themselves:
// the selection equals the rule computed in long double in plain loops
// (first threshold, no adjustment needed at this density).
TEST(GaussianKTest, TinyValuesKeepTheirStandardDeviation) {
  const size_t n = 4099;
  const std::vector<float> u = MakeInput(Distribution::kDenormals, n, 4116);
  const uint64_t k = 41;
  long double sum = 0.0L;
  for (float x : u) sum += x;
  const long double mean = sum / n;
  long double ss = 0.0L;
  for (float x : u) ss += (x - mean) * (x - mean);
  const long double t =
      mean + cpu::NormalQuantile(1.0 - static_cast<double>(k) / n / 2.0) *
                 std::sqrt(ss / (n - 1));
  SparseVector want;
  for (size_t i = 0; i < n; ++i) {
    if (std::fabs(static_cast<long double>(u[i])) > t) {
      want.indices.push_back(static_cast<uint32_t>(i));
      want.values.push_back(u[i]);
    }
  }
  ASSERT_GE(want.size(), (2 * k + 2) / 3);
  ASSERT_LE(want.size(), 4 * k / 3);
  cpu::GaussianKSelector selector(SelectorOptions{});
  SparseVector out;
  GTOPK_ASSERT_OK(selector.Select(u, k, 0, &out));
  EXPECT_EQ(selector.last_adjustments(), 0);
  EXPECT_EQ(out, want);
}

TEST(GaussianKTest, NormalDataNeedsNoAdjustment) {
  const size_t n = 1 << 20;
  const std::vector<float> u = MakeInput(Distribution::kNormal, n, 6);
  cpu::GaussianKSelector selector(SelectorOptions{});
  SparseVector out;
  GTOPK_ASSERT_OK(selector.Select(u, 1049, 0, &out));
  EXPECT_EQ(selector.last_adjustments(), 0);
  EXPECT_FALSE(selector.last_fell_back());
  // Too few at first (the threshold is far too high for data with a huge
  // mean offset in the tail): halving must bring the count into range.
  std::vector<float> v = MakeInput(Distribution::kNormal, n, 7);
  for (size_t i = 0; i < n; i += 2) v[i] *= 0.01f;  // two populations
  GTOPK_ASSERT_OK(selector.Select(v, 10486, 0, &out));
  EXPECT_GE(out.size(), (2 * 10486u + 2) / 3);
  EXPECT_LE(out.size(), 4 * 10486u / 3);
  EXPECT_EQ(out, ReferenceTopK(v, out.size()));
}

}  // namespace
}  // namespace gtopk
