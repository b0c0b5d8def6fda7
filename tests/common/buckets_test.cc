// common/buckets.h: the pieces layer-wise selection cuts and their k,
// against plain expectations written out by hand.
#include "common/buckets.h"

#include <cmath>
#include <cstdint>
#include <set>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace gtopk {
namespace {

using ::gtopk::testing::StatusIs;
using ::testing::AllOf;
using ::testing::HasSubstr;

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

// The plain reference: the distinct cut points of [0, n) (every multiple
// of the bucket size below n, every shard begin below n), counted.
uint64_t PlainPieceCount(uint64_t n, uint64_t bucket,
                         const std::vector<uint64_t>& begins) {
  std::set<uint64_t> cuts;
  for (uint64_t b = 0; b < n; b += bucket) cuts.insert(b);
  for (const uint64_t s : begins) {
    if (s < n) cuts.insert(s);
  }
  return cuts.size();
}

// The shards' first indices as gtopk-server places them: s * n / S.
std::vector<uint64_t> ShardBegins(uint64_t n, uint64_t shards) {
  std::vector<uint64_t> begins;
  for (uint64_t s = 0; s < shards; ++s) begins.push_back(n * s / shards);
  return begins;
}

TEST(CountBucketPiecesTest, CountsWhatTheCutMakes) {
  for (uint64_t n : {1u, 2u, 7u, 97u, 1000u, 4096u}) {
    for (uint64_t shards : {1u, 2u, 3u, 7u, 200u}) {
      const std::vector<uint64_t> begins = ShardBegins(n, shards);
      for (uint64_t bucket : {1u, 2u, 3u, 10u, 64u, 333u, 5000u}) {
        const uint64_t want = PlainPieceCount(n, bucket, begins);
        EXPECT_EQ(CountBucketPieces(n, bucket, begins), want)
            << "n " << n << " shards " << shards << " bucket " << bucket;
        auto cut = CutBucketPieces(n, bucket, begins);
        GTOPK_ASSERT_OK(cut.status());
        EXPECT_EQ(cut->size(), want);
      }
    }
  }
  EXPECT_EQ(CountBucketPieces(0, 1, {0}), 0u);
  // Bucket size 0: one bucket, cut at the shards.
  EXPECT_EQ(CountBucketPieces(10, 0, {0, 3, 3, 10}), 2u);
  // Far more than CutBucketPieces would cut, counted without cutting.
  EXPECT_EQ(CountBucketPieces(uint64_t{1} << 32, 1, {0}), uint64_t{1} << 32);
}

TEST(SmallestBucketSizeForTest, IsTheSmallestFromWhichEverySizeFits) {
  for (uint64_t n : {1u, 5u, 64u, 100u, 257u}) {
    for (uint64_t shards : {1u, 2u, 3u, 5u}) {
      const std::vector<uint64_t> begins = ShardBegins(n, shards);
      for (uint64_t most : {1u, 2u, 3u, 5u, 8u, 13u, 40u, 300u}) {
        // By brute force: from n down, while the size fits.
        uint64_t want = n;
        while (want > 1 && PlainPieceCount(n, want - 1, begins) <= most) {
          --want;
        }
        EXPECT_EQ(SmallestBucketSizeFor(n, begins, most), want)
            << "n " << n << " shards " << shards << " most " << most;
      }
    }
  }
  // The case: n = 200,000 on two shards, at most 2^16 pieces.
  EXPECT_EQ(SmallestBucketSizeFor(200000, {0, 100000}, kMaxBucketPieces), 4u);
  EXPECT_EQ(PlainPieceCount(200000, 4, {0, 100000}), 50000u);
  EXPECT_GT(PlainPieceCount(200000, 3, {0, 100000}), kMaxBucketPieces);
}

TEST(BucketMbTextTest, ReadsBackAsTheSameBucketSize) {
  EXPECT_EQ(BucketMbText(1), "4e-06");
  EXPECT_EQ(BucketMbText(4), "1.6e-05");
  EXPECT_EQ(BucketMbText(262144), "1");
  EXPECT_EQ(BucketMbText(6553600), "25");
  for (uint64_t values : {1u, 2u, 3u, 4u, 5u, 7u, 99u, 1000u, 65537u, 262143u,
                          262145u, 4294967295u}) {
    const std::string text = BucketMbText(values);
    const double mib = std::stod(text);
    // As gtopk-server reads --bucket-mb (BucketSizeValues).
    EXPECT_EQ(std::floor(mib * (1 << 20) / 4.0), static_cast<double>(values))
        << values << " -> " << text;
  }
}

TEST(CheckBucketPieceCountTest, RefusesMoreThanTheBoundNamingTheFix) {
  // At the bound: accepted.
  GTOPK_EXPECT_OK(CheckBucketPieceCount(kMaxBucketPieces, 1, {0}));
  GTOPK_EXPECT_OK(CheckBucketPieceCount(200000, 4, {0, 100000}));
  // Not layer-wise (bucket size 0): nothing to check.
  GTOPK_EXPECT_OK(CheckBucketPieceCount(uint64_t{1} << 32, 0, {0}));
  EXPECT_THAT(CheckBucketPieceCount(kMaxBucketPieces + 1, 1, {0}),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("into 65537 bucket pieces, more than the "
                                 "65536")));
  // The break-it run's case: one value per bucket, n = 200,000, two shards.
  EXPECT_THAT(
      CheckBucketPieceCount(200000, 1, {0, 100000}, "0.000004"),
      StatusIs(absl::StatusCode::kFailedPrecondition,
               AllOf(HasSubstr("--bucket-mb 0.000004 (buckets of 1 values) "
                               "cuts the model's n = 200000 parameters into "
                               "200000 bucket pieces, more than the 65536"),
                     HasSubstr("use --bucket-mb of at least 1.6e-05 (4 "
                               "values) for this n"))));
  // Without the flag's text: the bucket size's MiB.
  EXPECT_THAT(CheckBucketPieceCount(200000, 3, {0, 100000}),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("--bucket-mb 1.2e-05 (buckets of 3 values) "
                                 "cuts the model's n = 200000 parameters into "
                                 "66668 bucket pieces")));
}

}  // namespace
}  // namespace gtopk
