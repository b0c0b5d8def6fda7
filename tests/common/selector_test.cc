#include "common/selector.h"

#include <cmath>
#include <limits>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "common/cpu/selectors.h"
#include "common/topk.h"
#include "gtest/gtest.h"
#include "tests/testing/reference.h"
#include "tests/testing/status_matchers.h"

namespace gtopk {
namespace {

using ::gtopk::testing::AllDistributions;
using ::gtopk::testing::Describe;
using ::gtopk::testing::Distribution;
using ::gtopk::testing::DistributionName;
using ::gtopk::testing::KsFor;
using ::gtopk::testing::MakeInput;
using ::gtopk::testing::ReferenceTopK;
using ::gtopk::testing::StatusIs;
using ::testing::HasSubstr;

// Sizes around block boundaries and on both sides of the sampled path
// (n >= 65536 in ExactTopK).
const std::vector<size_t> kSizes = {1, 2, 3, 17, 1000, 4099, 70001, 300007};

void ExpectSortedUniqueInRange(const SparseVector& v, size_t n,
                               const std::string& what) {
  GTOPK_EXPECT_OK(ValidateSparseVector(v, n)) << what;
}

class SelectorTest
    : public ::testing::TestWithParam<std::tuple<std::string, Distribution>> {};

TEST_P(SelectorTest, MatchesReferenceContract) {
  const auto& [name, dist] = GetParam();
  SelectorOptions options;
  options.seed = 42;
  GTOPK_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Selector> selector,
                             CreateSelector(name, options));
  ASSERT_EQ(selector->name(), name);
  uint64_t seed = 1;
  for (size_t n : kSizes) {
    const std::vector<float> u = MakeInput(dist, n, seed++);
    for (uint64_t k : KsFor(n)) {
      const std::string what = Describe(dist, n, k);
      SparseVector out;
      GTOPK_ASSERT_OK(selector->Select(u, k, /*step=*/k, &out)) << what;
      ExpectSortedUniqueInRange(out, n, what);
      ASSERT_GE(out.size(), selector->MinCount(k)) << what;
      ASSERT_LE(out.size(), selector->MaxCount(k)) << what;
      for (size_t j = 0; j < out.size(); ++j) {
        // Values are the input's, bit for bit (including -0.0).
        ASSERT_EQ(std::signbit(out.values[j]), std::signbit(u[out.indices[j]]));
        ASSERT_EQ(out.values[j], u[out.indices[j]]) << what;
      }
      if (name == "randomk") continue;
      // exact, gaussiank and dgc select by a magnitude threshold (or, when
      // they trim, by exact top-k), so what they return is exactly the
      // reference top-|out| set, tie-break included.
      ASSERT_EQ(out, ReferenceTopK(u, out.size())) << what;
      if (name == "exact") {
        ASSERT_EQ(out.size(), k) << what;
      }
    }
  }
}

TEST_P(SelectorTest, RejectsBadArguments) {
  const auto& [name, dist] = GetParam();
  GTOPK_ASSERT_OK_AND_ASSIGN(auto selector, CreateSelector(name));
  std::vector<float> u = MakeInput(dist, 100, 7);
  SparseVector out;
  EXPECT_THAT(selector->Select(u, 0, 0, &out),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("k must be at least 1")));
  EXPECT_THAT(selector->Select(u, 101, 0, &out),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("k = 101 exceeds the input length n = 100")));
  EXPECT_THAT(selector->Select({}, 1, 0, &out),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("n = 0")));
  EXPECT_TRUE(out.empty());
}

TEST_P(SelectorTest, RejectsNonFiniteInputNamingPosition) {
  const auto& [name, dist] = GetParam();
  GTOPK_ASSERT_OK_AND_ASSIGN(auto selector, CreateSelector(name));
  for (size_t n : {5ul, 1000ul, 70001ul}) {
    for (float bad : {std::numeric_limits<float>::quiet_NaN(),
                      std::numeric_limits<float>::infinity(),
                      -std::numeric_limits<float>::infinity()}) {
      std::vector<float> u = MakeInput(dist, n, 3);
      const size_t pos = n / 2 + 1;
      u[pos] = bad;
      for (uint64_t k : {uint64_t{1}, std::max<uint64_t>(1, n / 100), n}) {
        SparseVector out;
        EXPECT_THAT(selector->Select(u, k, 0, &out),
                    StatusIs(absl::StatusCode::kInvalidArgument,
                             HasSubstr("at position " + std::to_string(pos))))
            << Describe(dist, n, k) << " bad=" << bad;
        EXPECT_TRUE(out.empty());
      }
    }
  }
}

std::string ParamName(
    const ::testing::TestParamInfo<SelectorTest::ParamType>& info) {
  return std::get<0>(info.param) + "_" +
         DistributionName(std::get<1>(info.param));
}

INSTANTIATE_TEST_SUITE_P(
    AllSelectors, SelectorTest,
    ::testing::Combine(::testing::Values("exact", "gaussiank", "dgc",
                                         "randomk"),
                       ::testing::ValuesIn(AllDistributions())),
    ParamName);

TEST(SelectorRegistryTest, UnknownNameAndBadOptionsAreInvalidArgument) {
  EXPECT_THAT(CreateSelector("top1"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("unknown selector \"top1\"; known: dgc, "
                                 "exact, gaussiank, randomk")));
  SelectorOptions options;
  options.dgc_sample_fraction = 0.001;
  EXPECT_THAT(CreateSelector("dgc", options),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("dgc_sample_fraction")));
  options = {};
  options.gaussiank_max_adjustments = 0;
  EXPECT_THAT(CreateSelector("gaussiank", options),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("gaussiank_max_adjustments")));
  SelectorRegistry registry;
  GTOPK_ASSERT_OK(RegisterBuiltinSelectors(&registry));
  EXPECT_THAT(RegisterBuiltinSelectors(&registry),
              StatusIs(absl::StatusCode::kAlreadyExists, HasSubstr("exact")));
}

// Device implementations share the host names: registered only for a known
// selector, listed by DeviceNames, made by CreateDevice with the capacity; a
// name without one says which names have one. (A stand-in factory here; the
// GPU selectors: tests/common/cuda/cuda_selector_registry_test.cc.)
TEST(SelectorRegistryTest, DeviceImplementationsShareTheHostNames) {
  SelectorRegistry registry;
  GTOPK_ASSERT_OK(RegisterBuiltinSelectors(&registry));
  EXPECT_TRUE(registry.DeviceNames().empty());
  EXPECT_THAT(registry.CreateDevice("exact", {}, 10),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("selector \"exact\" has no device "
                                 "implementation; none is registered")));
  uint64_t capacity_seen = 0;
  const DeviceSelectorFactory stand_in =
      [&capacity_seen](
          const SelectorOptions& options,
          uint64_t capacity) -> absl::StatusOr<std::unique_ptr<Selector>> {
    capacity_seen = capacity;
    return std::make_unique<cpu::GaussianKSelector>(options);
  };
  EXPECT_THAT(registry.RegisterDevice("top1", stand_in),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("device selector \"top1\" is not a "
                                 "registered selector; known: dgc, exact, "
                                 "gaussiank, randomk")));
  GTOPK_ASSERT_OK(registry.RegisterDevice("gaussiank", stand_in));
  EXPECT_THAT(
      registry.RegisterDevice("gaussiank", stand_in),
      StatusIs(absl::StatusCode::kAlreadyExists, HasSubstr("gaussiank")));
  EXPECT_EQ(registry.DeviceNames(), std::vector<std::string>{"gaussiank"});
  EXPECT_EQ(registry.Names(),
            (std::vector<std::string>{"dgc", "exact", "gaussiank", "randomk"}));

  GTOPK_ASSERT_OK_AND_ASSIGN(auto selector,
                             registry.CreateDevice("gaussiank", {}, 1234));
  EXPECT_EQ(selector->name(), "gaussiank");
  EXPECT_EQ(capacity_seen, 1234u);
  EXPECT_THAT(registry.CreateDevice("randomk", {}, 10),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("selector \"randomk\" has no device "
                                 "implementation; with one: gaussiank")));
  EXPECT_THAT(registry.CreateDevice("top1", {}, 10),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("unknown selector \"top1\"; known: dgc, "
                                 "exact, gaussiank, randomk")));
  SelectorOptions options;
  options.gaussiank_max_adjustments = 0;
  EXPECT_THAT(registry.CreateDevice("gaussiank", options, 10),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("gaussiank_max_adjustments")));
}

TEST(KFromDensityTest, RoundsAndValidates) {
  EXPECT_EQ(*KFromDensity(0.001, 25557032), 25557u);
  EXPECT_EQ(*KFromDensity(1e-9, 10), 1u);
  EXPECT_EQ(*KFromDensity(1.0, 10), 10u);
  EXPECT_THAT(
      KFromDensity(0.5, (uint64_t{1} << 32) + 1),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("at most 2^32")));
  for (double bad : {0.0, -0.1, 1.5, std::nan("")}) {
    EXPECT_THAT(KFromDensity(bad, 10),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr("density must be in (0, 1]")));
  }
  EXPECT_THAT(KFromDensity(0.5, 0),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("n = 0")));
}

}  // namespace
}  // namespace gtopk
