// common/buckets.h: the pieces layer-wise selection cuts and their k,
// against plain expectations written out by hand.
#include "common/buckets.h"

#include <cstdint>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace gtopk {
namespace {

using ::gtopk::testing::StatusIs;

std::vector<std::vector<uint64_t>> Ranges(
    const std::vector<BucketPiece>& pieces) {
  std::vector<std::vector<uint64_t>> out;
  for (const BucketPiece& p : pieces) out.push_back({p.begin, p.end, p.bucket});
  return out;
}

TEST(CutBucketPiecesTest, BucketsAreCutAgainAtShardBoundaries) {
  // n = 1000, buckets of 300, shards [0, 500) and [500, 1000): the bucket
  // [300, 600) straddles the boundary and becomes two pieces.
  auto pieces = CutBucketPieces(1000, 300, {0, 500});
  GTOPK_ASSERT_OK(pieces.status());
  EXPECT_EQ(Ranges(*pieces),
            (std::vector<std::vector<uint64_t>>{{0, 300, 0},
                                                {300, 500, 1},
                                                {500, 600, 1},
                                                {600, 900, 2},
                                                {900, 1000, 3}}));
}

TEST(CutBucketPiecesTest, BoundariesThatCoincideAreNotRepeated) {
  auto pieces = CutBucketPieces(10, 5, {0, 5, 10});
  GTOPK_ASSERT_OK(pieces.status());
  EXPECT_EQ(Ranges(*pieces),
            (std::vector<std::vector<uint64_t>>{{0, 5, 0}, {5, 10, 1}}));
}

TEST(CutBucketPiecesTest, SizeZeroIsOneBucketCutAtShards) {
  auto pieces = CutBucketPieces(7, 0, {0, 3, 3, 7});  // an empty shard [3, 3)
  GTOPK_ASSERT_OK(pieces.status());
  EXPECT_EQ(Ranges(*pieces),
            (std::vector<std::vector<uint64_t>>{{0, 3, 0}, {3, 7, 0}}));
}

TEST(CutBucketPiecesTest, BucketLargerThanNIsOnePiece) {
  auto pieces = CutBucketPieces(4, 1000, {0});
  GTOPK_ASSERT_OK(pieces.status());
  EXPECT_EQ(Ranges(*pieces), (std::vector<std::vector<uint64_t>>{{0, 4, 0}}));
}

TEST(CutBucketPiecesTest, BadInputIsRefused) {
  EXPECT_THAT(CutBucketPieces(0, 1, {0}).status(),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(CutBucketPieces(10, 1, {0, 11}).status(),
              StatusIs(absl::StatusCode::kInvalidArgument));
  // 2^25 buckets of one value.
  EXPECT_THAT(CutBucketPieces(uint64_t{1} << 25, 1, {0}).status(),
              StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST(PiecesInTest, SelectsThePiecesOfARange) {
  auto pieces = CutBucketPieces(1000, 300, {0, 500});
  GTOPK_ASSERT_OK(pieces.status());
  EXPECT_EQ(PiecesIn(*pieces, 0, 500), (std::vector<size_t>{0, 1}));
  EXPECT_EQ(PiecesIn(*pieces, 500, 1000), (std::vector<size_t>{2, 3, 4}));
  EXPECT_TRUE(PiecesIn(*pieces, 500, 500).empty());
}

TEST(PieceKTest, RoundsToNearest) {
  // k * size / n exactly: 20 * 300 / 1000 = 6.
  EXPECT_EQ(PieceK(20, 300, 1000), 6u);
  // 18 * 10 / 910 = 0.198 -> 0: a piece too small for any entry.
  EXPECT_EQ(PieceK(18, 10, 910), 0u);
  // 0.5 rounds up: 1 * 500 / 1000.
  EXPECT_EQ(PieceK(1, 500, 1000), 1u);
  // 0.499 rounds down.
  EXPECT_EQ(PieceK(1, 499, 1000), 0u);
  EXPECT_EQ(PieceK(7, 1000, 1000), 7u);
  // No overflow for the largest n: k = n = 2^32.
  const uint64_t n = uint64_t{1} << 32;
  EXPECT_EQ(PieceK(n, n - 1, n), n - 1);
}

}  // namespace
}  // namespace gtopk
