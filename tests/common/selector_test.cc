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
using ::gtopk::testing::Distribution;
using ::gtopk::testing::DistributionName;
using ::gtopk::testing::MakeInput;
using ::gtopk::testing::ReferenceTopK;
using ::gtopk::testing::StatusIs;
using ::testing::HasSubstr;

// Sizes around block boundaries and on both sides of the sampled path
// (n >= 65536 in ExactTopK).
const std::vector<size_t> kSizes = {1, 2, 3, 17, 1000, 4099, 70001, 300007};

std::vector<uint64_t> KsFor(size_t n) {
  std::set<uint64_t> ks = {1, n, std::max<uint64_t>(1, n / 1000),
                           std::max<uint64_t>(1, n / 100),
                           std::max<uint64_t>(1, n / 3)};
  if (n > 1) ks.insert(n - 1);
  if (n > 2) ks.insert(2);
  return {ks.begin(), ks.end()};
}

std::string Describe(Distribution d, size_t n, uint64_t k) {
  return DistributionName(d) + " n=" + std::to_string(n) +
         " k=" + std::to_string(k);
}

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

TEST(GaussianKTest, NormalQuantile) {
  EXPECT_NEAR(cpu::NormalQuantile(0.5), 0.0, 1e-12);
  EXPECT_NEAR(cpu::NormalQuantile(0.975), 1.959963984540054, 1e-9);
  EXPECT_NEAR(cpu::NormalQuantile(1 - 0.0005), 3.290526731491926, 1e-9);
  EXPECT_NEAR(cpu::NormalQuantile(0.025), -1.959963984540054, 1e-9);
}

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
