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

}  // namespace
}  // namespace gtopk
