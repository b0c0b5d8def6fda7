// synthetic:N's gradient (worker/trainer/synthetic_gradient.h): a pure function
// of (seed, rank, step), each block a pool slice times a sign and a scale,
// and a top-k that moves from step to step (issue 20).
#include "worker/trainer/synthetic_gradient.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <set>
#include <vector>

#include "gtest/gtest.h"

namespace gtopk {
namespace worker {
namespace {

std::vector<float> Make(const SyntheticGradient& g, size_t n, uint32_t rank,
                        int64_t step) {
  std::vector<float> out(n);
  g.Fill(rank, step, absl::MakeSpan(out));
  return out;
}

// Indices of the k largest |v|.
std::set<size_t> TopK(const std::vector<float>& v, size_t k) {
  std::vector<size_t> idx(v.size());
  std::iota(idx.begin(), idx.end(), 0);
  std::partial_sort(
      idx.begin(), idx.begin() + k, idx.end(),
      [&](size_t a, size_t b) { return std::fabs(v[a]) > std::fabs(v[b]); });
  return {idx.begin(), idx.begin() + k};
}

TEST(SyntheticGradientTest, SameArgumentsSameBitsAcrossGenerators) {
  constexpr size_t kN = 10007;  // not a multiple of the block
  SyntheticGradient a(kN, 42), b(kN, 42);
  EXPECT_EQ(Make(a, kN, 3, 5), Make(b, kN, 3, 5));
  EXPECT_NE(Make(a, kN, 3, 5), Make(a, kN, 3, 6));  // step
  EXPECT_NE(Make(a, kN, 3, 5), Make(a, kN, 4, 5));  // rank
  SyntheticGradient c(kN, 43);
  EXPECT_NE(Make(a, kN, 3, 5), Make(c, kN, 3, 5));  // seed
}

// Values look like a gradient: centred, spread like the ~N(0, 1) pool
// times a factor of magnitude in [0.5, 1.5), bounded, blocks not copies.
TEST(SyntheticGradientTest, ValuesLookLikeAGradient) {
  constexpr size_t kN = 5 * SyntheticGradient::kBlock;
  SyntheticGradient g(kN, 7);
  const std::vector<float> v = Make(g, kN, 0, 0);
  // The pool is ~N(0, 1) and a factor's magnitude is in [0.5, 1.5): the
  // values' standard deviation lies between 0.5 and 1.5.
  double sq = 0;
  for (float x : v) sq += double{x} * x;
  const double sd = std::sqrt(sq / kN);
  EXPECT_GT(sd, 0.5);
  EXPECT_LT(sd, 1.5);
  // Irwin-Hall of four 16-bit uniforms, scaled to unit variance: |x| <=
  // sqrt(12).
  for (float x : v) ASSERT_LE(std::fabs(x), 3.4642 * 1.5);
  // Consecutive blocks are not copies of one another.
  EXPECT_FALSE(std::equal(v.begin(), v.begin() + SyntheticGradient::kBlock,
                          v.begin() + SyntheticGradient::kBlock));
}

// The top-k set must change from step to step (otherwise error feedback
// and the global selection see one fixed pattern) and be spread over the
// vector, not one block.
TEST(SyntheticGradientTest, TopKMovesFromStepToStep) {
  constexpr size_t kN = 200000, kK = 200;  // density 0.001
  SyntheticGradient g(kN, 1);
  const std::set<size_t> s0 = TopK(Make(g, kN, 0, 0), kK);
  const std::set<size_t> s1 = TopK(Make(g, kN, 0, 1), kK);
  std::vector<size_t> both;
  std::set_intersection(s0.begin(), s0.end(), s1.begin(), s1.end(),
                        std::back_inserter(both));
  EXPECT_LT(both.size(), kK / 4) << "top-k barely moved";
  std::set<size_t> blocks;
  for (size_t i : s0) blocks.insert(i / SyntheticGradient::kBlock);
  EXPECT_GE(blocks.size(), 10u) << "top-k sits in a few blocks";
}

TEST(SyntheticGradientTest, TinyAndEmptyVectors) {
  SyntheticGradient g(3, 1);
  std::vector<float> v = Make(g, 3, 0, 0);
  EXPECT_TRUE(v[0] != 0.0f || v[1] != 0.0f || v[2] != 0.0f);
  std::vector<float> empty;
  g.Fill(0, 0, absl::MakeSpan(empty));  // no access
}

}  // namespace
}  // namespace worker
}  // namespace gtopk
