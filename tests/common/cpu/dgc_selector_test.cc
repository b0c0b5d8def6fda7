// DgcSelector (common/cpu/dgc_selector.cc): exact with a full sample,
// deterministic per seed and step, an unbiased count from a 1 % sample. Its
// count contract on every input family is SelectorTest's
// (tests/common/selector_test.cc). Moved from tests/common/selector_test.cc
// (issue 44: tests mirror sources).
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

TEST(DgcTest, FullSampleIsExactAndSeedsAreDeterministic) {
  const size_t n = 200003;
  const std::vector<float> u = MakeInput(Distribution::kNormal, n, 9);
  SelectorOptions full;
  full.dgc_sample_fraction = 1.0;
  cpu::DgcSelector exact_dgc(full);
  SparseVector out;
  GTOPK_ASSERT_OK(exact_dgc.Select(u, 200, 0, &out));
  EXPECT_EQ(out, ReferenceTopK(u, 200));

  SelectorOptions options;
  options.seed = 3;
  cpu::DgcSelector a(options), b(options);
  SparseVector oa, ob;
  GTOPK_ASSERT_OK(a.Select(u, 200, 17, &oa));
  GTOPK_ASSERT_OK(b.Select(u, 200, 17, &ob));
  EXPECT_EQ(oa, ob);
  // On normal data a 1% sample estimates the threshold without bias: over
  // many steps the mean count is close to k (trimmed at k above).
  double total = 0;
  const int steps = 60;
  for (int step = 0; step < steps; ++step) {
    GTOPK_ASSERT_OK(a.Select(u, 2000, step, &oa));
    ASSERT_EQ(oa, ReferenceTopK(u, oa.size()));
    total += static_cast<double>(oa.size());
  }
  EXPECT_GT(total / steps, 0.9 * 2000);
}

}  // namespace
}  // namespace gtopk
