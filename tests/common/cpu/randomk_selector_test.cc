// RandomKSelector (common/cpu/randomk_selector.cc): deterministic per seed
// and step, and uniform over the indices. Its count contract on every input
// family is SelectorTest's (tests/common/selector_test.cc). Moved from
// tests/common/selector_test.cc (issue 44: tests mirror sources).
#include <cmath>
#include <cstdint>
#include <vector>

#include "common/cpu/selectors.h"
#include "common/sparse_vector.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace gtopk {
namespace {

TEST(RandomKTest, DeterministicPerSeedAndStepAndUniform) {
  const size_t n = 50;
  std::vector<float> u(n);
  for (size_t i = 0; i < n; ++i) u[i] = static_cast<float>(i);
  SelectorOptions options;
  options.seed = 77;
  cpu::RandomKSelector a(options), b(options);
  SparseVector oa, ob;
  GTOPK_ASSERT_OK(a.Select(u, 5, 1, &oa));
  GTOPK_ASSERT_OK(b.Select(u, 5, 1, &ob));
  EXPECT_EQ(oa, ob);
  GTOPK_ASSERT_OK(b.Select(u, 5, 2, &ob));
  EXPECT_NE(oa, ob);

  // Frequencies over 20000 seeded draws of 5 (Floyd) and 20 (selection
  // sampling) of 50: each index expected trials*k/n times; allow 6 sigma.
  for (uint64_t k : {5ul, 20ul}) {
    std::vector<int> hits(n, 0);
    const int trials = 20000;
    for (int t = 0; t < trials; ++t) {
      GTOPK_ASSERT_OK(a.Select(u, k, t, &oa));
      ASSERT_EQ(oa.size(), k);
      for (uint32_t i : oa.indices) ++hits[i];
    }
    const double p = static_cast<double>(k) / n;
    const double mean = trials * p, sigma = std::sqrt(trials * p * (1 - p));
    for (size_t i = 0; i < n; ++i) {
      EXPECT_NEAR(hits[i], mean, 6 * sigma) << "index " << i << " k=" << k;
    }
  }
}

}  // namespace
}  // namespace gtopk
