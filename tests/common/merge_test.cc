#include "common/merge.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <map>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "common/random.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/reference.h"
#include "tests/testing/status_matchers.h"

namespace gtopk {
namespace {

using ::gtopk::testing::FloatBits;
using ::gtopk::testing::MakeSparse;
using ::gtopk::testing::ReferenceTopK;
using ::gtopk::testing::StatusIs;
using ::testing::AllOf;
using ::testing::HasSubstr;

constexpr float kMax = std::numeric_limits<float>::max();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

// Obviously-correct reference: a dense accumulator plus "present" flags,
// summed in rank order starting from the first present value.
SparseVector DenseReferenceSum(const std::vector<SparseVector>& inputs,
                               uint64_t n) {
  std::vector<float> acc(n, 0.0f);
  std::vector<bool> present(n, false);
  for (const SparseVector& in : inputs) {
    for (size_t j = 0; j < in.size(); ++j) {
      const uint32_t i = in.indices[j];
      if (present[i]) {
        acc[i] = acc[i] + in.values[j];
      } else {
        acc[i] = in.values[j];
        present[i] = true;
      }
    }
  }
  SparseVector out;
  for (uint64_t i = 0; i < n; ++i) {
    if (present[i]) out.push_back(static_cast<uint32_t>(i), acc[i]);
  }
  return out;
}

// The same with a std::map, for dense lengths too large to allocate.
SparseVector MapReferenceSum(const std::vector<SparseVector>& inputs) {
  std::map<uint32_t, float> acc;
  for (const SparseVector& in : inputs) {
    for (size_t j = 0; j < in.size(); ++j) {
      auto [it, inserted] = acc.emplace(in.indices[j], in.values[j]);
      if (!inserted) it->second = it->second + in.values[j];
    }
  }
  SparseVector out;
  for (const auto& [i, v] : acc) out.push_back(i, v);
  return out;
}

// Top-k of a sparse vector through the sort-based ReferenceTopK on its
// compact values (positions are in index order, so ties go to lower index).
SparseVector ReferenceSparseTopK(const SparseVector& v, uint64_t k) {
  SparseVector by_position = ReferenceTopK(v.values, k);
  SparseVector out;
  for (size_t j = 0; j < by_position.size(); ++j) {
    out.push_back(v.indices[by_position.indices[j]], by_position.values[j]);
  }
  return out;
}

// Values that stress the summation: exact zeros of both signs, +-1 (exact
// cancellations and ties), subnormals and a wide range of magnitudes.
float RandomValue(std::mt19937_64& rng) {
  const float r = UniformFloat(rng);
  const float sign = (rng() & 1) ? -1.0f : 1.0f;
  if (r < 0.05f) return -0.0f;
  if (r < 0.10f) return 0.0f;
  if (r < 0.25f) return sign;
  if (r < 0.30f) {
    return sign * std::numeric_limits<float>::denorm_min() *
           static_cast<float>(1 + UniformBelow(rng, 1000));
  }
  const int exponent = static_cast<int>(UniformBelow(rng, 41)) - 20;
  return sign * std::ldexp(0.5f + UniformFloat(rng), exponent);
}

// P sparse vectors over [0, n) with about density * n entries each. Odd
// ranks draw mostly from a shared pool (heavy overlap), even ranks
// uniformly, so supports overlap at every density.
std::vector<SparseVector> RandomInputs(size_t P, double density, uint64_t n,
                                       uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<bool> pool(n);
  for (uint64_t i = 0; i < n; ++i) {
    pool[i] = UniformFloat(rng) < std::min(1.0, 2 * density);
  }
  std::vector<SparseVector> inputs(P);
  for (size_t p = 0; p < P; ++p) {
    for (uint64_t i = 0; i < n; ++i) {
      const bool take = (p % 2 == 1 && density < 1.0)
                            ? pool[i] && UniformFloat(rng) < 0.5f
                            : UniformFloat(rng) < density;
      if (take) {
        inputs[p].push_back(static_cast<uint32_t>(i), RandomValue(rng));
      }
    }
  }
  return inputs;
}

// Restriction of v to [begin, end).
SparseVector Restrict(const SparseVector& v, uint32_t begin, uint64_t end) {
  SparseVector out;
  for (size_t j = 0; j < v.size(); ++j) {
    if (v.indices[j] >= begin && v.indices[j] < end) {
      out.push_back(v.indices[j], v.values[j]);
    }
  }
  return out;
}

std::vector<uint64_t> KsFor(size_t size) {
  return {1, std::max<size_t>(1, size / 3), std::max<size_t>(1, size),
          size + 1};
}

// -------------------------------------------------------------------------
// Random inputs against the references.

class SparseSumRandomTest
    : public ::testing::TestWithParam<std::tuple<size_t, double, uint64_t>> {};

TEST_P(SparseSumRandomTest, MatchesReferencesBitForBit) {
  const auto [P, density, n] = GetParam();
  const uint64_t seed = 1000003 * P + static_cast<uint64_t>(density * 1e6) + n;
  const std::vector<SparseVector> inputs = RandomInputs(P, density, n, seed);
  const SparseVector expected = DenseReferenceSum(inputs, n);

  SparseVector sum = MakeSparse({7}, {1.0f});  // stale content must be replaced
  GTOPK_ASSERT_OK(SparseSum(inputs, n, &sum));
  EXPECT_TRUE(sum == expected) << "sum differs from the dense reference";
  GTOPK_EXPECT_OK(ValidateSparseVector(sum, n));

  // A reused scratch gives the same bits, also after an unrelated call.
  MergeScratch scratch;
  SparseVector again;
  GTOPK_ASSERT_OK(
      SparseSum(RandomInputs(3, 0.5, 50, seed + 1), 50, &again, &scratch));
  GTOPK_ASSERT_OK(SparseSum(inputs, n, &again, &scratch));
  EXPECT_TRUE(again == expected);

  // Sharded servers: the sum over each sub-range, concatenated, is the same.
  for (uint64_t shards : {2u, 3u}) {
    SparseVector concatenated;
    for (uint64_t s = 0; s < shards; ++s) {
      const uint64_t begin = n * s / shards;
      const uint64_t end = n * (s + 1) / shards;
      std::vector<SparseVector> part;
      for (const SparseVector& in : inputs) {
        part.push_back(Restrict(in, static_cast<uint32_t>(begin), end));
      }
      SparseVector shard_sum;
      GTOPK_ASSERT_OK(SparseSum(part, n, &shard_sum, &scratch));
      concatenated.indices.insert(concatenated.indices.end(),
                                  shard_sum.indices.begin(),
                                  shard_sum.indices.end());
      concatenated.values.insert(concatenated.values.end(),
                                 shard_sum.values.begin(),
                                 shard_sum.values.end());
    }
    EXPECT_TRUE(concatenated == expected) << shards << " shards";
  }

  for (uint64_t k : KsFor(expected.size())) {
    const SparseVector expected_top = ReferenceSparseTopK(expected, k);
    SparseVector top;
    GTOPK_ASSERT_OK(SparseTopK(sum, k, &top));
    EXPECT_TRUE(top == expected_top) << "SparseTopK k=" << k;
    SparseVector global;
    GTOPK_ASSERT_OK(ReferenceGtopkStep(inputs, n, k, &global));
    EXPECT_TRUE(global == expected_top) << "ReferenceGtopkStep k=" << k;
  }
}

INSTANTIATE_TEST_SUITE_P(
    All, SparseSumRandomTest,
    ::testing::Combine(::testing::Values<size_t>(1, 2, 3, 8, 32),
                       ::testing::Values(0.001, 0.01, 0.3, 1.0),
                       ::testing::Values<uint64_t>(1, 17, 1000, 100003)),
    [](const auto& info) {
      return "P" + std::to_string(std::get<0>(info.param)) + "_density" +
             std::to_string(static_cast<int>(std::get<1>(info.param) * 1000)) +
             "permille_n" + std::to_string(std::get<2>(info.param));
    });

// -------------------------------------------------------------------------
// Adversarial cases.

TEST(SparseSumTest, NoInputsGiveAnEmptySum) {
  SparseVector out = MakeSparse({1}, {2.0f});
  GTOPK_ASSERT_OK(SparseSum({}, 10, &out));
  EXPECT_TRUE(out.empty());
  out = MakeSparse({1}, {2.0f});
  GTOPK_ASSERT_OK(SparseSum({}, 0, &out));
  EXPECT_TRUE(out.empty());
}

TEST(SparseSumTest, EmptyInputsGiveAnEmptySum) {
  for (size_t P : {1, 2, 3, 8}) {
    std::vector<SparseVector> inputs(P);
    SparseVector out = MakeSparse({1}, {2.0f});
    GTOPK_ASSERT_OK(SparseSum(inputs, 10, &out));
    EXPECT_TRUE(out.empty()) << P;
  }
}

TEST(SparseSumTest, EmptyInputsKeepRankOrderOfTheOthers) {
  // 1e8 + 1 rounds back to 1e8 in float, so the order is visible:
  // (1e8 + 1) + -1e8 == 0 but (1e8 + -1e8) + 1 == 1.
  auto inputs_for = [](size_t empties, float a, float b, float c) {
    std::vector<SparseVector> inputs;
    inputs.push_back(MakeSparse({5}, {a}));
    for (size_t e = 0; e < empties; ++e) inputs.emplace_back();
    inputs.push_back(MakeSparse({5}, {b}));
    inputs.emplace_back();
    inputs.push_back(MakeSparse({5}, {c}));
    return inputs;
  };
  for (size_t empties : {0, 1, 3}) {
    SparseVector out;
    GTOPK_ASSERT_OK(
        SparseSum(inputs_for(empties, 1e8f, 1.0f, -1e8f), 10, &out));
    EXPECT_TRUE(out == MakeSparse({5}, {0.0f})) << empties;
    // Another rank order, other bits.
    GTOPK_ASSERT_OK(
        SparseSum(inputs_for(empties, 1e8f, -1e8f, 1.0f), 10, &out));
    EXPECT_TRUE(out == MakeSparse({5}, {1.0f})) << empties;
  }
}

TEST(SparseSumTest, SummationIsInRankOrderForEveryPathAndIndexWidth) {
  // Index i in every input, with values such that only the left-to-right
  // rank order gives 4; index 0 in some inputs too, so that the radix sort
  // has digits to sort on (and for n == 1 every digit is trivial).
  for (uint64_t n :
       {uint64_t{1}, uint64_t{17}, uint64_t{1} << 20, kMaxDenseLength}) {
    const uint32_t i = static_cast<uint32_t>(n - 1);
    const float seq[] = {1e8f, 1.0f, -1e8f, 1.0f, 3.0f};
    std::vector<SparseVector> inputs;
    for (int p = 0; p < 5; ++p) {
      SparseVector in;
      if (i > 0 && p % 2 == 0) in.push_back(0, 0.25f);
      in.push_back(i, seq[p]);
      inputs.push_back(in);
    }
    SparseVector out;
    GTOPK_ASSERT_OK(SparseSum(inputs, n, &out));
    EXPECT_TRUE(out == MapReferenceSum(inputs)) << n;
    EXPECT_EQ(out.values.back(), 4.0f) << n;
    EXPECT_EQ(out.indices.back(), i) << n;
  }
}

TEST(SparseSumTest, AllInputsIdentical) {
  const SparseVector one = RandomInputs(1, 0.3, 1000, 11)[0];
  for (size_t P : {2, 3, 8, 32}) {
    std::vector<SparseVector> inputs(P, one);
    SparseVector out;
    GTOPK_ASSERT_OK(SparseSum(inputs, 1000, &out));
    EXPECT_TRUE(out == DenseReferenceSum(inputs, 1000)) << P;
    EXPECT_EQ(out.indices, one.indices);
  }
}

TEST(SparseSumTest, DisjointSupportsAreConcatenatedAndSorted) {
  for (size_t P : {2, 3, 8}) {
    std::vector<SparseVector> inputs(P);
    for (uint32_t i = 0; i < 200; ++i) {
      inputs[i % P].push_back(i, static_cast<float>(i) - 100.5f);
    }
    SparseVector out;
    GTOPK_ASSERT_OK(SparseSum(inputs, 200, &out));
    ASSERT_EQ(out.size(), 200u);
    for (uint32_t i = 0; i < 200; ++i) {
      EXPECT_EQ(out.indices[i], i);
      EXPECT_EQ(out.values[i], static_cast<float>(i) - 100.5f);
    }
  }
}

TEST(SparseSumTest, ExactCancellationStaysInTheOutput) {
  SparseVector out;
  GTOPK_ASSERT_OK(SparseSum(
      {MakeSparse({0, 3}, {1.5f, 2.0f}), MakeSparse({3}, {-2.0f})}, 4, &out));
  EXPECT_TRUE(out == MakeSparse({0, 3}, {1.5f, 0.0f}));
  GTOPK_ASSERT_OK(SparseSum({MakeSparse({3}, {2.0f}), MakeSparse({1}, {1.0f}),
                             MakeSparse({3}, {-2.0f})},
                            4, &out));
  EXPECT_TRUE(out == MakeSparse({1, 3}, {1.0f, 0.0f}));
  EXPECT_EQ(FloatBits(out.values[1]), 0u);  // +0.0
}

TEST(SparseSumTest, NegativeZeroSurvives) {
  SparseVector out;
  // Held by one input only, on every path.
  GTOPK_ASSERT_OK(SparseSum({MakeSparse({2}, {-0.0f})}, 4, &out));
  EXPECT_EQ(FloatBits(out.values[0]), FloatBits(-0.0f));
  GTOPK_ASSERT_OK(
      SparseSum({MakeSparse({2}, {-0.0f}), MakeSparse({1}, {1.0f})}, 4, &out));
  EXPECT_TRUE(out == MakeSparse({1, 2}, {1.0f, -0.0f}));
  GTOPK_ASSERT_OK(SparseSum({MakeSparse({1}, {1.0f}), MakeSparse({3}, {2.0f}),
                             MakeSparse({2}, {-0.0f})},
                            4, &out));
  EXPECT_TRUE(out == MakeSparse({1, 2, 3}, {1.0f, -0.0f, 2.0f}));
  // -0 + -0 == -0, -0 + +0 == +0.
  GTOPK_ASSERT_OK(
      SparseSum({MakeSparse({0, 1}, {-0.0f, -0.0f}),
                 MakeSparse({0, 1}, {-0.0f, 0.0f}), MakeSparse({}, {})},
                4, &out));
  EXPECT_TRUE(out == MakeSparse({0, 1}, {-0.0f, 0.0f}));
  GTOPK_ASSERT_OK(
      SparseSum({MakeSparse({0, 1}, {-0.0f, -0.0f}),
                 MakeSparse({0, 1}, {-0.0f, 0.0f}), MakeSparse({2}, {1.0f})},
                4, &out));
  EXPECT_TRUE(out == MakeSparse({0, 1, 2}, {-0.0f, 0.0f, 1.0f}));
}

TEST(SparseSumTest, FirstAndLastIndex) {
  for (size_t P : {2, 3}) {
    std::vector<SparseVector> inputs(P, MakeSparse({0, 99}, {1.0f, -2.0f}));
    SparseVector out;
    GTOPK_ASSERT_OK(SparseSum(inputs, 100, &out));
    EXPECT_TRUE(out == DenseReferenceSum(inputs, 100));
    EXPECT_EQ(out.indices, (std::vector<uint32_t>{0, 99}));
  }
}

TEST(SparseSumTest, FullUint32IndexSpaceWithoutAllocatingN) {
  const uint32_t last = 0xffffffffu;
  std::mt19937_64 rng(99);
  for (size_t P : {1, 2, 3, 8}) {
    std::vector<SparseVector> inputs(P);
    for (size_t p = 0; p < P; ++p) {
      std::vector<uint32_t> idx = {0,        1u << 11, 1u << 22,
                                   1u << 31, last - 1, last};
      for (int r = 0; r < 50; ++r) {
        idx.push_back(static_cast<uint32_t>(rng()));
      }
      std::sort(idx.begin(), idx.end());
      idx.erase(std::unique(idx.begin(), idx.end()), idx.end());
      for (uint32_t i : idx) {
        if (UniformFloat(rng) < 0.7f) inputs[p].push_back(i, RandomValue(rng));
      }
    }
    inputs[0].push_back(last, 1.0f);  // possibly duplicate: dedupe below
    if (inputs[0].size() >= 2 &&
        inputs[0].indices[inputs[0].size() - 2] == last) {
      inputs[0].indices.pop_back();
      inputs[0].values.pop_back();
    }
    const SparseVector expected = MapReferenceSum(inputs);
    SparseVector out;
    GTOPK_ASSERT_OK(SparseSum(inputs, kMaxDenseLength, &out));
    EXPECT_TRUE(out == expected) << P;
    EXPECT_EQ(out.indices.back(), last);
    SparseVector global;
    GTOPK_ASSERT_OK(ReferenceGtopkStep(inputs, kMaxDenseLength, 5, &global));
    EXPECT_TRUE(global == ReferenceSparseTopK(expected, 5)) << P;
  }
}

// Sparse supports over the whole uint32 range: few buckets, each sorted by
// up to 27 low bits (3-4 radix passes), and one skewed case where nearly
// every pair lands in the same bucket.
TEST(SparseSumTest, WideAndSkewedIndexRangesUseEveryRadixPass) {
  std::mt19937_64 rng(1234);
  for (size_t P : {3, 5}) {
    for (bool skewed : {false, true}) {
      std::vector<uint32_t> shared;
      for (int r = 0; r < 2000; ++r) {
        shared.push_back(skewed ? static_cast<uint32_t>(UniformBelow(rng, 5000))
                                : static_cast<uint32_t>(rng()));
      }
      std::vector<SparseVector> inputs(P);
      for (size_t p = 0; p < P; ++p) {
        std::vector<uint32_t> idx;
        for (uint32_t i : shared) {
          if (rng() % 2) idx.push_back(i);
        }
        for (int r = 0; r < 3000; ++r) {
          idx.push_back(skewed ? static_cast<uint32_t>(UniformBelow(rng, 5000))
                               : static_cast<uint32_t>(rng()));
        }
        if (skewed && p == 0) idx.push_back(0xffffffffu);
        std::sort(idx.begin(), idx.end());
        idx.erase(std::unique(idx.begin(), idx.end()), idx.end());
        for (uint32_t i : idx) inputs[p].push_back(i, RandomValue(rng));
      }
      const SparseVector expected = MapReferenceSum(inputs);
      MergeScratch scratch;
      SparseVector out;
      GTOPK_ASSERT_OK(SparseSum(inputs, kMaxDenseLength, &out, &scratch));
      EXPECT_TRUE(out == expected) << "P=" << P << " skewed=" << skewed;
      GTOPK_ASSERT_OK(SparseSum(inputs, kMaxDenseLength, &out, &scratch));
      EXPECT_TRUE(out == expected) << "scratch reuse";
    }
  }
}

TEST(SparseSumTest, ManyMoreInputsThanPairsPerBucket) {
  std::mt19937_64 rng(77);
  std::vector<SparseVector> inputs(1500);
  for (SparseVector& in : inputs) {
    uint32_t i = static_cast<uint32_t>(UniformBelow(rng, 10));
    for (int r = 0; r < 3; ++r) {
      in.push_back(i, RandomValue(rng));
      i += 1 + static_cast<uint32_t>(UniformBelow(rng, 300));
    }
  }
  SparseVector out;
  GTOPK_ASSERT_OK(SparseSum(inputs, 1000, &out));
  EXPECT_TRUE(out == DenseReferenceSum(inputs, 1000));
}

TEST(SparseSumTest, OutputMayAliasAnInput) {
  for (size_t P : {1, 2, 3}) {
    std::vector<SparseVector> inputs;
    for (size_t p = 0; p < P; ++p) {
      inputs.push_back(MakeSparse({1, static_cast<uint32_t>(2 + p)},
                                  {1.0f, static_cast<float>(p)}));
    }
    const SparseVector expected = DenseReferenceSum(inputs, 10);
    GTOPK_ASSERT_OK(SparseSum(inputs, 10, &inputs[P - 1]));
    EXPECT_TRUE(inputs[P - 1] == expected) << P;
  }
}

TEST(SparseSumTest, RejectsDenseLengthAbove2To32) {
  SparseVector out = MakeSparse({1}, {1.0f});
  EXPECT_THAT(SparseSum({MakeSparse({1}, {1.0f})}, kMaxDenseLength + 1, &out),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("2^32")));
  EXPECT_TRUE(out.empty());
}

struct BadInputCase {
  std::string name;
  SparseVector bad;
  std::string message;  // expected substring after "input <p>: "
};

std::vector<BadInputCase> BadInputCases() {
  return {
      {"unsorted", MakeSparse({1, 5, 4}, {1, 2, 3}),
       "not strictly ascending at position 2"},
      {"duplicate", MakeSparse({1, 5, 5}, {1, 2, 3}), "(duplicate)"},
      {"out_of_range", MakeSparse({1, 10}, {1, 2}),
       "out of range at position 1"},
      {"nan", MakeSparse({1, 2, 3}, {1, kNaN, 3}), "not finite at position 1"},
      {"inf", MakeSparse({1, 2}, {1, -kInf}), "not finite at position 1"},
      {"size_mismatch", MakeSparse({1, 2}, {1}), "2 indices but 1 values"},
  };
}

TEST(SparseSumTest, InvalidInputsNameTheInputAndPosition) {
  const SparseVector good = MakeSparse({0, 1, 9}, {1, 2, 3});
  for (const BadInputCase& c : BadInputCases()) {
    for (size_t P : {1, 2, 3, 8}) {
      for (size_t bad_rank : {size_t{0}, P - 1}) {
        std::vector<SparseVector> inputs(P, good);
        inputs[bad_rank] = c.bad;
        SparseVector out = MakeSparse({4}, {4.0f});
        EXPECT_THAT(SparseSum(inputs, 10, &out),
                    StatusIs(absl::StatusCode::kInvalidArgument,
                             AllOf(HasSubstr("input " +
                                             std::to_string(bad_rank) + ": "),
                                   HasSubstr(c.message))))
            << c.name << " P=" << P;
        EXPECT_TRUE(out.empty()) << c.name;
        SparseVector global = MakeSparse({4}, {4.0f});
        EXPECT_THAT(
            ReferenceGtopkStep(inputs, 10, 2, &global),
            StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(c.message)));
        EXPECT_TRUE(global.empty());
      }
    }
  }
}

TEST(SparseSumTest, RejectsOverflowToInfNamingTheIndex) {
  for (size_t P : {2, 3, 8}) {
    for (float sign : {1.0f, -1.0f}) {
      std::vector<SparseVector> inputs(P,
                                       MakeSparse({0, 7}, {1.0f, sign * kMax}));
      SparseVector out = MakeSparse({4}, {4.0f});
      EXPECT_THAT(SparseSum(inputs, 10, &out),
                  StatusIs(absl::StatusCode::kInvalidArgument,
                           AllOf(HasSubstr("overflow"), HasSubstr("index 7"))))
          << P;
      EXPECT_TRUE(out.empty());
    }
  }
  // Overflow in rank order is an overflow even when a later value would have
  // brought the exact sum back: (max + max) + -max == Inf.
  SparseVector out;
  EXPECT_THAT(
      SparseSum({MakeSparse({3}, {kMax}), MakeSparse({3}, {kMax}),
                 MakeSparse({3}, {-kMax})},
                10, &out),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("index 3")));
  // max + -max is fine.
  GTOPK_ASSERT_OK(
      SparseSum({MakeSparse({3}, {kMax}), MakeSparse({3}, {-kMax})}, 10, &out));
  EXPECT_TRUE(out == MakeSparse({3}, {0.0f}));
}

// -------------------------------------------------------------------------
// SparseTopK and ReferenceGtopkStep.

TEST(SparseTopKTest, TiesAtTheKthMagnitudeGoToTheLowerIndex) {
  const SparseVector v =
      MakeSparse({2, 5, 9, 11, 40}, {-1.0f, 0.5f, 1.0f, -1.0f, 2.0f});
  SparseVector out;
  GTOPK_ASSERT_OK(SparseTopK(v, 1, &out));
  EXPECT_TRUE(out == MakeSparse({40}, {2.0f}));
  GTOPK_ASSERT_OK(SparseTopK(v, 2, &out));
  EXPECT_TRUE(out == MakeSparse({2, 40}, {-1.0f, 2.0f}));
  GTOPK_ASSERT_OK(SparseTopK(v, 3, &out));
  EXPECT_TRUE(out == MakeSparse({2, 9, 40}, {-1.0f, 1.0f, 2.0f}));
  GTOPK_ASSERT_OK(SparseTopK(v, 4, &out));
  EXPECT_TRUE(out == MakeSparse({2, 9, 11, 40}, {-1.0f, 1.0f, -1.0f, 2.0f}));
  // +0.0 and -0.0 tie too.
  GTOPK_ASSERT_OK(
      SparseTopK(MakeSparse({1, 3, 8}, {0.0f, -0.0f, 0.0f}), 2, &out));
  EXPECT_TRUE(out == MakeSparse({1, 3}, {0.0f, -0.0f}));
}

TEST(SparseTopKTest, KAtLeastSizeReturnsEverything) {
  const SparseVector v = MakeSparse({2, 5, 9}, {-1.0f, -0.0f, 3.0f});
  for (uint64_t k : {3, 4, 1000}) {
    SparseVector out = MakeSparse({1}, {1.0f});
    GTOPK_ASSERT_OK(SparseTopK(v, k, &out));
    EXPECT_TRUE(out == v) << k;
  }
  SparseVector out = MakeSparse({1}, {1.0f});
  GTOPK_ASSERT_OK(SparseTopK(SparseVector{}, 5, &out));
  EXPECT_TRUE(out.empty());
}

TEST(SparseTopKTest, LargeInputUsesTheSampledPathCorrectly) {
  // More than 64 Ki entries takes ExactTopK's sampled path.
  std::mt19937_64 rng(5);
  SparseVector v;
  uint32_t index = 0;
  for (int j = 0; j < 200000; ++j) {
    index += 1 + static_cast<uint32_t>(UniformBelow(rng, 100));
    v.push_back(index, RandomValue(rng));
  }
  for (uint64_t k : {1, 25, 2000, 199999}) {
    SparseVector out;
    GTOPK_ASSERT_OK(SparseTopK(v, k, &out));
    EXPECT_TRUE(out == ReferenceSparseTopK(v, k)) << k;
  }
}

TEST(SparseTopKTest, OutputMayAliasTheInput) {
  SparseVector v = MakeSparse({2, 5, 9, 11}, {-1.0f, 0.5f, 3.0f, -2.0f});
  GTOPK_ASSERT_OK(SparseTopK(v, 2, &v));
  EXPECT_TRUE(v == MakeSparse({9, 11}, {3.0f, -2.0f}));
  GTOPK_ASSERT_OK(SparseTopK(v, 5, &v));
  EXPECT_TRUE(v == MakeSparse({9, 11}, {3.0f, -2.0f}));
}

TEST(SparseTopKTest, RejectsKZeroAndInvalidVectors) {
  SparseVector out = MakeSparse({1}, {1.0f});
  EXPECT_THAT(SparseTopK(MakeSparse({1}, {1.0f}), 0, &out),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("k")));
  EXPECT_TRUE(out.empty());
  for (const BadInputCase& c : BadInputCases()) {
    if (c.name == "out_of_range") continue;  // any uint32 index is in range
    out = MakeSparse({1}, {1.0f});
    EXPECT_THAT(
        SparseTopK(c.bad, 1, &out),
        StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(c.message)))
        << c.name;
    EXPECT_TRUE(out.empty());
  }
}

TEST(ReferenceGtopkStepTest, KZeroAndEmpty) {
  SparseVector global = MakeSparse({1}, {1.0f});
  EXPECT_THAT(ReferenceGtopkStep({MakeSparse({1}, {1.0f})}, 10, 0, &global),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("k")));
  EXPECT_TRUE(global.empty());
  global = MakeSparse({1}, {1.0f});
  GTOPK_ASSERT_OK(ReferenceGtopkStep({}, 10, 3, &global));
  EXPECT_TRUE(global.empty());
}

TEST(ReferenceGtopkStepTest, SelectsBySummedMagnitudeWithTies) {
  // Sums: 0 -> 3, 1 -> -3, 4 -> 0 (cancelled), 6 -> 3, 9 -> 1.
  const std::vector<SparseVector> pushes = {
      MakeSparse({0, 1, 4}, {1.0f, -1.0f, 2.0f}),
      MakeSparse({0, 4, 6, 9}, {2.0f, -2.0f, 1.0f, 1.0f}),
      MakeSparse({1, 6}, {-2.0f, 2.0f}),
  };
  SparseVector global;
  GTOPK_ASSERT_OK(ReferenceGtopkStep(pushes, 10, 2, &global));
  EXPECT_TRUE(global == MakeSparse({0, 1}, {3.0f, -3.0f}));  // 6 loses the tie
  GTOPK_ASSERT_OK(ReferenceGtopkStep(pushes, 10, 3, &global));
  EXPECT_TRUE(global == MakeSparse({0, 1, 6}, {3.0f, -3.0f, 3.0f}));
  GTOPK_ASSERT_OK(ReferenceGtopkStep(pushes, 10, 5, &global));
  EXPECT_TRUE(global ==
              MakeSparse({0, 1, 4, 6, 9}, {3.0f, -3.0f, 0.0f, 3.0f, 1.0f}));
}

}  // namespace
}  // namespace gtopk
