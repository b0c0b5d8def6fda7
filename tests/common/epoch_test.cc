// Attempt epochs (common/epoch.h): a leader's epoch is plausible up to a
// day ahead of now in microseconds, kNewestEpoch never is, and the trailer
// key is the one the workers read.
#include "common/epoch.h"

#include <cstdint>

#include "absl/time/time.h"
#include "gtest/gtest.h"

namespace gtopk {
namespace {

TEST(EpochTest, PlausibleUpToADayAheadOfNow) {
  const absl::Time now = absl::FromUnixSeconds(1'800'000'000);
  const uint64_t now_us = uint64_t{1'800'000'000} * 1'000'000;
  const uint64_t day_us = uint64_t{86400} * 1'000'000;
  EXPECT_TRUE(IsPlausibleEpoch(0, now));
  EXPECT_TRUE(IsPlausibleEpoch(now_us, now));
  EXPECT_TRUE(IsPlausibleEpoch(now_us + day_us, now));
  EXPECT_FALSE(IsPlausibleEpoch(now_us + day_us + 1, now));
  EXPECT_FALSE(IsPlausibleEpoch(kNewestEpoch, now));
}

TEST(EpochTest, ALeaderStartedNowHasPlausibleEpochs) {
  const uint64_t start_us =
      static_cast<uint64_t>(absl::ToUnixMicros(absl::Now()));
  // A thousand failures later, still plausible.
  EXPECT_TRUE(IsPlausibleEpoch(start_us + 1000));
  EXPECT_FALSE(IsPlausibleEpoch(kNewestEpoch));
}

TEST(EpochTest, TheNewestEpochIsTheLargestValue) {
  EXPECT_EQ(kNewestEpoch, ~uint64_t{0});
  EXPECT_STREQ(kEpochMetadataKey, "gtopk-epoch");
}

}  // namespace
}  // namespace gtopk
