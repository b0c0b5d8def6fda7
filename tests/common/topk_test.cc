// The exact top-k building blocks (common/topk.h): the radix select of the
// k-th magnitude key and the compaction against a full sort, on every input
// family. Moved from tests/common/selector_test.cc (issue 44: tests mirror
// sources); ExactSelector, built on them, is tested in
// tests/common/cpu/exact_selector_test.cc.
#include "common/topk.h"

#include <cstdint>
#include <vector>

#include "common/sparse_vector.h"
#include "gtest/gtest.h"
#include "tests/testing/reference.h"

namespace gtopk {
namespace {

using ::gtopk::testing::AllDistributions;
using ::gtopk::testing::Describe;
using ::gtopk::testing::Distribution;
using ::gtopk::testing::KsFor;
using ::gtopk::testing::MakeInput;
using ::gtopk::testing::ReferenceTopK;

TEST(ExactTopKTest, RadixSelectMatchesSortOnEveryDistribution) {
  for (Distribution d : AllDistributions()) {
    for (size_t n : {1ul, 33ul, 4099ul, 100003ul}) {
      const std::vector<float> u = MakeInput(d, n, 11);
      for (uint64_t k : KsFor(n)) {
        uint32_t kth_key = 0;
        uint64_t greater = 0;
        ASSERT_TRUE(cpu::RadixSelectKey(u, k, &kth_key, &greater));
        SparseVector out;
        cpu::CompactTopK(u, kth_key, greater, k, &out);
        ASSERT_EQ(out, ReferenceTopK(u, k)) << Describe(d, n, k);
      }
    }
  }
}

// ExactTopK below 257 values selects over every key (nth_element) instead
// of the radix select (a fixed cost per call that layer-wise selection
// paid once per small bucket piece): the same set, tie-break and order as
// a full sort, on both sides of the switch and for every k.
TEST(ExactTopKTest, SmallInputsMatchSortOnEveryDistribution) {
  cpu::TopKScratch scratch;
  for (Distribution d : AllDistributions()) {
    for (size_t n : {1ul, 2ul, 3ul, 10ul, 64ul, 255ul, 256ul, 257ul, 300ul}) {
      const std::vector<float> u = MakeInput(d, n, 23);
      for (uint64_t k = 1; k <= n; k += (n > 64 ? 7 : 1)) {
        SparseVector out;
        ASSERT_TRUE(cpu::ExactTopK(u, k, &scratch, &out).ok())
            << Describe(d, n, k);
        ASSERT_EQ(out, ReferenceTopK(u, k)) << Describe(d, n, k);
      }
    }
  }
}

}  // namespace
}  // namespace gtopk
