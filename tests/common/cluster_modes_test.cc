// The cluster's modes and their flag spellings (common/cluster_modes.h),
// proto-free: every enumerator's name parses back to it, unknown or
// differently cased names are INVALID_ARGUMENT listing the known ones, and
// "exact" is the old spelling of --selection=threshold. The wire enums'
// conversions are tested with the cluster spec
// (tests/common/cluster_spec/cluster_spec_test.cc, ClusterModesTest).
#include "common/cluster_modes.h"

#include "absl/status/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace gtopk {
namespace {

using ::gtopk::testing::IsOkAndHolds;
using ::gtopk::testing::StatusIs;

TEST(ClusterModeNamesTest, EveryAggregationModeRoundTrips) {
  for (AggregationMode mode : {AggregationMode::kGtopk, AggregationMode::kTopk,
                               AggregationMode::kDense}) {
    EXPECT_THAT(ParseAggregationMode(AggregationModeName(mode)),
                IsOkAndHolds(mode));
  }
  EXPECT_EQ(AggregationModeName(AggregationMode::kGtopk), "gtopk");
  EXPECT_EQ(AggregationModeName(AggregationMode::kTopk), "topk");
  EXPECT_EQ(AggregationModeName(AggregationMode::kDense), "dense");
}

TEST(ClusterModeNamesTest, EverySelectionKindRoundTripsAndExactIsAnAlias) {
  EXPECT_EQ(SelectionKindName(SelectionKind::kThreshold), "threshold");
  EXPECT_EQ(SelectionKindName(SelectionKind::kQuota), "quota");
  EXPECT_EQ(SelectionKindName(SelectionKind::kLayerwise), "layerwise");
  for (SelectionKind kind : {SelectionKind::kThreshold, SelectionKind::kQuota,
                             SelectionKind::kLayerwise}) {
    EXPECT_THAT(ParseSelectionKind(SelectionKindName(kind)),
                IsOkAndHolds(kind));
  }
  EXPECT_THAT(ParseSelectionKind("exact"),
              IsOkAndHolds(SelectionKind::kThreshold));
}

TEST(ClusterModeNamesTest, EveryMomentumModeRoundTrips) {
  EXPECT_EQ(MomentumModeName(MomentumMode::kNone), "none");
  EXPECT_EQ(MomentumModeName(MomentumMode::kDgcCorrection), "dgc");
  EXPECT_EQ(MomentumModeName(MomentumMode::kGlobal), "global");
  for (MomentumMode mode : {MomentumMode::kNone, MomentumMode::kDgcCorrection,
                            MomentumMode::kGlobal}) {
    EXPECT_THAT(ParseMomentumMode(MomentumModeName(mode)), IsOkAndHolds(mode));
  }
}

TEST(ClusterModeNamesTest, EveryApplyModeRoundTrips) {
  EXPECT_EQ(ApplyModeName(ApplyMode::kServers), "servers");
  EXPECT_EQ(ApplyModeName(ApplyMode::kWorkers), "workers");
  EXPECT_THAT(ParseApplyMode("servers"), IsOkAndHolds(ApplyMode::kServers));
  EXPECT_THAT(ParseApplyMode("workers"), IsOkAndHolds(ApplyMode::kWorkers));
}

TEST(ClusterModeNamesTest, UnknownNamesListTheKnownOnes) {
  EXPECT_THAT(ParseApplyMode("worker"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       "unknown apply mode \"worker\"; known: servers, "
                       "workers"));
  // Names are case-sensitive, as the flags are.
  EXPECT_THAT(ParseAggregationMode("GTOPK"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       "unknown mode \"GTOPK\"; known: gtopk, topk, dense"));
  EXPECT_THAT(ParseSelectionKind(""),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       "unknown selection \"\"; known: threshold, quota, "
                       "layerwise"));
  EXPECT_THAT(ParseMomentumMode("dgc "),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       ::testing::HasSubstr("known: none, dgc, global")));
}

}  // namespace
}  // namespace gtopk
