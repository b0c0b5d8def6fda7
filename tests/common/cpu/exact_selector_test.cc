// ExactSelector (common/cpu/exact_selector.cc): exact top-k on the edge
// values of the magnitude key, and the fallbacks of its sampled threshold
// (too few or too many survivors). Its count contract on every input family
// is SelectorTest's (tests/common/selector_test.cc). Moved from
// tests/common/selector_test.cc (issue 44: tests mirror sources).
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "common/cpu/selectors.h"
#include "common/sparse_vector.h"
#include "gtest/gtest.h"
#include "tests/testing/reference.h"
#include "tests/testing/status_matchers.h"

namespace gtopk {
namespace {

using ::gtopk::testing::ReferenceTopK;

TEST(ExactTopKTest, HandlesDenormalsNegativeZeroAndExtremes) {
  const float dmin = std::numeric_limits<float>::denorm_min();
  const float fmax = std::numeric_limits<float>::max();
  std::vector<float> u = {-0.0f, 0.0f, dmin, -dmin, 2 * dmin,
                          -fmax, fmax, 1.0f, -1.0f, 0.0f};
  cpu::ExactSelector selector;
  for (uint64_t k = 1; k <= u.size(); ++k) {
    SparseVector out;
    GTOPK_ASSERT_OK(selector.Select(u, k, 0, &out));
    EXPECT_EQ(out, ReferenceTopK(u, k)) << "k=" << k;
  }
}

TEST(ExactTopKTest, FallsBackWhenTooFewSurvive) {
  // Large values exactly at the positions the evenly spaced block sample
  // reads (16-value runs starting at (n-16)*r/1023), small ones elsewhere:
  // the sampled threshold keeps fewer than k, so the radix path must run.
  const size_t n = 65536;
  std::vector<float> u(n);
  std::mt19937_64 rng(3);
  std::uniform_real_distribution<float> small(0.0f, 1.0f);
  for (float& x : u) x = small(rng);
  for (size_t r = 0; r < 1024; ++r) {
    const size_t start = (n - 16) * r / 1023;
    for (size_t j = 0; j < 16; ++j) u[start + j] = 100.0f + small(rng);
  }
  cpu::ExactSelector selector;
  for (uint64_t k : {65ul, 200ul, 5000ul, 20000ul}) {
    SparseVector out;
    GTOPK_ASSERT_OK(selector.Select(u, k, 0, &out));
    EXPECT_EQ(out, ReferenceTopK(u, k)) << "k=" << k;
  }
}

TEST(ExactTopKTest, FallsBackWhenTooManySurvive) {
  // Mostly equal values with spikes every 997th position: the sampled
  // threshold admits nearly everything and the survivor cap trips.
  const size_t n = 1 << 20;
  std::vector<float> u(n, 1.0f);
  for (size_t i = 0; i < n; i += 997) u[i] = 2.0f + static_cast<float>(i);
  cpu::ExactSelector selector;
  for (uint64_t k : {1ul, 100ul, 1000ul, 5000ul}) {
    SparseVector out;
    GTOPK_ASSERT_OK(selector.Select(u, k, 0, &out));
    EXPECT_EQ(out, ReferenceTopK(u, k)) << "k=" << k;
  }
}

}  // namespace
}  // namespace gtopk
