// Seeded, portable randomness (common/random.h): MixSeed is SplitMix64's
// finaliser (reference values computed here from its definition),
// UniformBelow stays below its bound and is unbiased, UniformFloat lies in
// [0, 1) on a 2^-24 grid; all of it a fixed function of the seed.
#include "common/random.h"

#include <cmath>
#include <cstdint>
#include <random>
#include <set>
#include <vector>

#include "gtest/gtest.h"

namespace gtopk {
namespace {

// SplitMix64 (Steele, Lea, Flood 2014) written out from its definition:
// the state advances by the golden gamma, then the finaliser mixes it.
uint64_t SplitMix64Output(uint64_t state) {
  uint64_t z = state;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

TEST(RandomTest, MixSeedIsSplitMix64OfTheSeedsStream) {
  // The first SplitMix64 output from state 0 is a published reference
  // value.
  EXPECT_EQ(MixSeed(0, 0), 0xe220a8397b1dcdafull);
  for (uint64_t seed : {uint64_t{0}, uint64_t{1}, uint64_t{42}, ~uint64_t{0}}) {
    for (uint64_t stream : {uint64_t{0}, uint64_t{1}, uint64_t{1000}}) {
      EXPECT_EQ(MixSeed(seed, stream),
                SplitMix64Output(seed + 0x9e3779b97f4a7c15ull * (stream + 1)))
          << seed << " " << stream;
    }
  }
}

TEST(RandomTest, MixSeedSeparatesNeighbouringStreamsAndSeeds) {
  std::set<uint64_t> seen;
  for (uint64_t seed = 0; seed < 32; ++seed) {
    for (uint64_t stream = 0; stream < 32; ++stream) {
      seen.insert(MixSeed(seed, stream));
    }
  }
  EXPECT_EQ(seen.size(), 32u * 32u);
}

TEST(RandomTest, UniformBelowStaysBelowItsBoundAndIsUnbiased) {
  std::mt19937_64 rng(7);
  EXPECT_EQ(UniformBelow(rng, 1), 0u);
  const uint64_t bound = 6;
  const int trials = 60000;
  std::vector<int> hits(bound, 0);
  for (int t = 0; t < trials; ++t) {
    const uint64_t x = UniformBelow(rng, bound);
    ASSERT_LT(x, bound);
    ++hits[x];
  }
  const double mean = static_cast<double>(trials) / bound;
  const double sigma = std::sqrt(trials * (1.0 / bound) * (1 - 1.0 / bound));
  for (uint64_t i = 0; i < bound; ++i) {
    EXPECT_NEAR(hits[i], mean, 6 * sigma) << i;
  }
  // A bound just above 2^63: plain modulo would give the low half twice
  // the weight; rejection keeps each half near 1/2.
  const uint64_t big = (uint64_t{1} << 63) + 1;
  int low = 0;
  for (int t = 0; t < 4000; ++t) low += UniformBelow(rng, big) < big / 2;
  EXPECT_NEAR(low, 2000, 6 * std::sqrt(1000.0));
}

TEST(RandomTest, UniformFloatIsInTheUnitIntervalOnA24BitGrid) {
  std::mt19937_64 rng(11);
  double sum = 0;
  for (int t = 0; t < 20000; ++t) {
    const float x = UniformFloat(rng);
    ASSERT_GE(x, 0.0f);
    ASSERT_LT(x, 1.0f);
    const float scaled = x * 16777216.0f;
    ASSERT_EQ(scaled, std::floor(scaled));
    sum += x;
  }
  EXPECT_NEAR(sum / 20000, 0.5, 0.01);
}

TEST(RandomTest, TheSameSeedGivesTheSameDraws) {
  std::mt19937_64 a(MixSeed(3, 9)), b(MixSeed(3, 9)), c(MixSeed(3, 10));
  bool differs = false;
  for (int t = 0; t < 100; ++t) {
    const uint64_t x = UniformBelow(a, 1000);
    EXPECT_EQ(x, UniformBelow(b, 1000));
    differs |= x != UniformBelow(c, 1000);
  }
  EXPECT_TRUE(differs);
}

}  // namespace
}  // namespace gtopk
