// The shard's configuration (server/server_config.h): ValidateServerConfig
// naming the bad flag, the computed defaults (call limits, checksum
// cadence, the optimizer under --apply=workers), --density-warmup's
// parser, the cluster spec and fingerprint the settings make, and the
// setting-by-setting comparison with the leader's spec. Pure functions, no
// server. ServiceConfigTest moved here from tests/server/service_test.cc,
// ResourceLimitConfigTest from tests/server/resource_limits_test.cc (issue
// 44: tests mirror sources).
#include "server/server_config.h"

#include <cstdint>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "common/optimizer.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace gtopk {
namespace server {
namespace {

using ::gtopk::testing::IsOk;
using ::gtopk::testing::IsOkAndHolds;
using ::gtopk::testing::StatusIs;
using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::Not;

ServerConfig BaseConfig(uint32_t num_shards, uint32_t num_workers) {
  ServerConfig c;
  c.num_shards = num_shards;
  c.num_workers = num_workers;
  c.peers.assign(num_shards, "");
  c.step_timeout = absl::Seconds(2);
  c.optimizer.density = 0.2;
  c.optimizer.momentum_mode = MomentumMode::kDgcCorrection;
  return c;
}

TEST(ServiceConfigTest, RejectsBadFieldsByName) {
  ServerConfig c = BaseConfig(2, 2);
  c.peers = {"", "not-an-address"};
  EXPECT_THAT(ValidateServerConfig(c),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("--peers"), HasSubstr("entry 1"),
                             HasSubstr("not-an-address"))));
  c = BaseConfig(2, 2);
  c.peers = {""};
  EXPECT_THAT(ValidateServerConfig(c),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("peers")));
  c = BaseConfig(1, 1);
  c.selector = "bogus";
  EXPECT_THAT(
      ValidateServerConfig(c),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("selector")));
  c = BaseConfig(1, 1);
  c.checkpoint_every = 3;
  EXPECT_THAT(ValidateServerConfig(c),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("--checkpoint-dir")));
  c = BaseConfig(1, 1);
  c.step_timeout = absl::ZeroDuration();
  EXPECT_THAT(ValidateServerConfig(c),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("--step-timeout")));
  // Quota selection is a gtopk mode setting: with topk or dense it was
  // silently ignored.
  for (AggregationMode mode :
       {AggregationMode::kTopk, AggregationMode::kDense}) {
    c = BaseConfig(1, 1);
    c.mode = mode;
    c.selection = SelectionKind::kQuota;
    EXPECT_THAT(ValidateServerConfig(c),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr("--selection=quota applies to "
                                   "--mode=gtopk only")));
  }
  c = BaseConfig(1, 1);
  c.optimizer.steps_per_epoch = -1;
  EXPECT_THAT(ValidateServerConfig(c),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("--steps-per-epoch must be >= 0, got -1")));
  c = BaseConfig(1, 1);
  c.optimizer.lr = std::numeric_limits<float>::infinity();
  EXPECT_THAT(ValidateServerConfig(c),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--lr")));
}

TEST(ServiceConfigTest, ApplyAndChecksumEvery) {
  ServerConfig c = BaseConfig(1, 1);
  c.checksum_every = -2;
  EXPECT_THAT(ValidateServerConfig(c),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("--checksum-every must be >= 0")));
  c.checksum_every = int64_t{1} << 32;
  EXPECT_THAT(ValidateServerConfig(c),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("--checksum-every")));
  c = BaseConfig(1, 1);
  c.optimizer.lr = 0.5f;
  // Servers apply (the default): checksums off, the servers' optimizer.
  v1::ClusterSpec spec = ClusterSettingsSpec(c);
  EXPECT_EQ(spec.apply(), v1::APPLY_SERVERS);
  EXPECT_EQ(spec.checksum_every(), 0u);
  EXPECT_EQ(spec.optimizer().lr(), 0.5f);
  // Workers apply: checksums every 100 steps, the identity rule with the
  // density kept, whatever the optimizer flags say.
  c.apply = ApplyMode::kWorkers;
  c.optimizer.momentum_mode = MomentumMode::kGlobal;
  c.optimizer.weight_decay = 0.01f;
  spec = ClusterSettingsSpec(c);
  EXPECT_EQ(spec.apply(), v1::APPLY_WORKERS);
  EXPECT_EQ(spec.checksum_every(), 100u);
  EXPECT_EQ(spec.optimizer().lr(), 1.0f);
  EXPECT_EQ(spec.optimizer().momentum(), 0.0f);
  EXPECT_EQ(spec.optimizer().momentum_mode(), v1::MOMENTUM_MODE_NONE);
  EXPECT_FALSE(spec.optimizer().momentum_factor_masking());
  EXPECT_EQ(spec.optimizer().weight_decay(), 0.0f);
  EXPECT_EQ(spec.optimizer().density(), c.optimizer.density);
  c.checksum_every = 0;
  EXPECT_EQ(ClusterSettingsSpec(c).checksum_every(), 0u);
  c.checksum_every = 7;
  EXPECT_EQ(ClusterSettingsSpec(c).checksum_every(), 7u);
  // The fingerprint tells the modes apart.
  ServerConfig servers = BaseConfig(1, 1);
  ServerConfig workers = servers;
  workers.apply = ApplyMode::kWorkers;
  EXPECT_NE(CanonicalClusterSpec(servers, 10).cluster_fingerprint(),
            CanonicalClusterSpec(workers, 10).cluster_fingerprint());
}

TEST(ResourceLimitConfigTest, DefaultsScaleWithTheCluster) {
  ServerConfig c;
  c.num_workers = 2;
  c.num_shards = 2;
  c.peers = {"", "127.0.0.1:1"};
  const CallLimits limits = EffectiveCallLimits(c);
  EXPECT_EQ(limits.max_concurrent_calls, 4 * 2 + 8 * 2 + 64);
  EXPECT_EQ(limits.max_calls_per_peer, 2 + 4 * 2 + 16);
  EXPECT_EQ(EffectiveStreamsPerConnection(c), limits.max_concurrent_calls);
  c.max_concurrent_calls = 7;
  c.max_calls_per_peer = 5;
  c.max_streams_per_connection = 3;
  EXPECT_EQ(EffectiveCallLimits(c).max_concurrent_calls, 7);
  EXPECT_EQ(EffectiveCallLimits(c).max_calls_per_peer, 5);
  EXPECT_EQ(EffectiveStreamsPerConnection(c), 3);
  c.num_workers = 65536;
  c.num_shards = 65536;
  c.max_concurrent_calls = 0;
  // The largest cluster the flags allow stays below the cap.
  EXPECT_EQ(EffectiveCallLimits(c).max_concurrent_calls, 12 * 65536 + 64);
  EXPECT_LE(EffectiveCallLimits(c).max_concurrent_calls, kMaxCallLimit);
}

TEST(ResourceLimitConfigTest, RejectsOutOfRangeByFlagName) {
  for (const auto& [field, flag] :
       std::vector<std::pair<int64_t ServerConfig::*, std::string>>{
           {&ServerConfig::max_concurrent_calls, "--max-concurrent-calls"},
           {&ServerConfig::max_calls_per_peer, "--max-calls-per-peer"},
           {&ServerConfig::max_streams_per_connection,
            "--max-streams-per-connection"}}) {
    for (int64_t bad : {int64_t{-1}, kMaxCallLimit + 1}) {
      ServerConfig c;
      c.peers = {""};
      c.*field = bad;
      EXPECT_THAT(
          ValidateServerConfig(c),
          StatusIs(absl::StatusCode::kInvalidArgument,
                   AllOf(HasSubstr(flag), HasSubstr(absl::StrCat(bad)))));
    }
    ServerConfig ok;
    ok.peers = {""};
    ok.*field = kMaxCallLimit;
    GTOPK_EXPECT_OK(ValidateServerConfig(ok));
  }
}

TEST(ServerConfigTest, TheDefaultsAreValid) {
  ServerConfig c;
  c.peers = {""};
  EXPECT_THAT(ValidateServerConfig(c), IsOk());
  ServerConfig three = BaseConfig(3, 4);
  three.peers = {"", "shard1:7001", "[::1]:7002"};
  EXPECT_THAT(ValidateServerConfig(three), IsOk());
}

TEST(ServerConfigTest, RejectsTheClusterShapeByFlag) {
  ServerConfig c = BaseConfig(2, 2);
  c.shard_id = 2;
  EXPECT_THAT(ValidateServerConfig(c),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("--shard-id must be below --num-shards")));
  c = BaseConfig(1, 1);
  c.num_workers = 0;
  EXPECT_THAT(ValidateServerConfig(c),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("--workers must be in [1, ")));
  c = BaseConfig(1, 1);
  c.num_shards = 0;
  c.peers.clear();
  EXPECT_THAT(ValidateServerConfig(c),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("--num-shards must be in [1, ")));
  c = BaseConfig(1, 1);
  c.max_message_bytes = 1023;
  EXPECT_THAT(ValidateServerConfig(c),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("--max-message-bytes must be in [1024")));
  c = BaseConfig(1, 1);
  c.checkpoint_keep = 0;
  EXPECT_THAT(ValidateServerConfig(c),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("--checkpoint-keep must be in [1, 1000]")));
}

TEST(ServerConfigTest, RejectsTheOptimizerByFlag) {
  ServerConfig c = BaseConfig(1, 1);
  c.optimizer.momentum = 1.0f;
  EXPECT_THAT(ValidateServerConfig(c),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("--momentum must be in [0, 1)")));
  c = BaseConfig(1, 1);
  c.optimizer.density = 0.0;
  EXPECT_THAT(ValidateServerConfig(c),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("--density must be in (0, 1], got 0")));
  c = BaseConfig(1, 1);
  c.optimizer.density_warmup = {0.5, 1.5};
  c.optimizer.steps_per_epoch = 10;
  EXPECT_THAT(ValidateServerConfig(c),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("--density-warmup: entry 1 must be in "
                                 "(0, 1], got 1.5")));
  c.optimizer.density_warmup = {0.5};
  c.optimizer.steps_per_epoch = 0;
  EXPECT_THAT(ValidateServerConfig(c),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       "--density-warmup needs --steps-per-epoch > 0"));
  c.optimizer.steps_per_epoch = 10;
  EXPECT_THAT(ValidateServerConfig(c), IsOk());
}

TEST(ServerConfigTest, ParsesTheDensityWarmupFlag) {
  EXPECT_THAT(ParseDensityWarmupFlag(""), IsOkAndHolds(IsEmpty()));
  EXPECT_THAT(ParseDensityWarmupFlag("dgc"), IsOkAndHolds(DgcDensityWarmup()));
  EXPECT_THAT(ParseDensityWarmupFlag("0.25,0.5,1"),
              IsOkAndHolds(ElementsAre(0.25, 0.5, 1.0)));
  // Any number parses; the range is ValidateServerConfig's business.
  EXPECT_THAT(ParseDensityWarmupFlag("7"), IsOkAndHolds(ElementsAre(7.0)));
  EXPECT_THAT(ParseDensityWarmupFlag("0.25,x"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("--density-warmup: 'x' is not a number")));
  EXPECT_THAT(ParseDensityWarmupFlag("0.25,,0.5"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("'' is not a number")));
}

TEST(ServerConfigTest, ChecksumEveryDefaultsByWhoApplies) {
  ServerConfig c = BaseConfig(1, 1);
  EXPECT_EQ(EffectiveChecksumEvery(c), 0u);
  c.apply = ApplyMode::kWorkers;
  EXPECT_EQ(EffectiveChecksumEvery(c), 100u);
  c.checksum_every = 0;
  EXPECT_EQ(EffectiveChecksumEvery(c), 0u);
  c.apply = ApplyMode::kServers;
  c.checksum_every = 9;
  EXPECT_EQ(EffectiveChecksumEvery(c), 9u);
}

TEST(ServerConfigTest, EffectiveOptimizerIsTheIdentityRuleUnderApplyWorkers) {
  ServerConfig c = BaseConfig(1, 1);
  c.optimizer.lr = 0.3f;
  c.optimizer.momentum = 0.9f;
  c.optimizer.weight_decay = 0.01f;
  c.optimizer.lr_warmup_steps = 5;
  c.optimizer.steps_per_epoch = 10;
  c.optimizer.density_warmup = {0.5};
  const OptimizerOptions servers = EffectiveOptimizer(c);
  EXPECT_EQ(servers.lr, 0.3f);
  EXPECT_EQ(servers.momentum, 0.9f);
  EXPECT_EQ(servers.weight_decay, 0.01f);
  c.apply = ApplyMode::kWorkers;
  const OptimizerOptions workers = EffectiveOptimizer(c);
  EXPECT_EQ(workers.lr, 1.0f);
  EXPECT_EQ(workers.momentum, 0.0f);
  EXPECT_EQ(workers.momentum_mode, MomentumMode::kNone);
  EXPECT_FALSE(workers.momentum_factor_masking);
  EXPECT_EQ(workers.weight_decay, 0.0f);
  EXPECT_EQ(workers.lr_warmup_steps, 0);
  // The density schedule is the cluster's either way.
  EXPECT_EQ(workers.density, 0.2);
  EXPECT_THAT(workers.density_warmup, ElementsAre(0.5));
  EXPECT_EQ(workers.steps_per_epoch, 10);
}

TEST(ServerConfigTest, TheCanonicalSpecHasTheRangesAndAFingerprintOfN) {
  const ServerConfig c = BaseConfig(3, 2);
  const v1::ClusterSpec spec = CanonicalClusterSpec(c, 10);
  EXPECT_EQ(spec.n(), 10u);
  ASSERT_EQ(spec.shards_size(), 3);
  // ShardRange: [s*n/S, (s+1)*n/S).
  EXPECT_EQ(spec.shards(0).begin(), 0u);
  EXPECT_EQ(spec.shards(0).end(), 3u);
  EXPECT_EQ(spec.shards(1).begin(), 3u);
  EXPECT_EQ(spec.shards(1).end(), 6u);
  EXPECT_EQ(spec.shards(2).begin(), 6u);
  EXPECT_EQ(spec.shards(2).end(), 10u);
  EXPECT_NE(spec.cluster_fingerprint(), 0u);
  EXPECT_EQ(CanonicalClusterSpec(c, 10).cluster_fingerprint(),
            spec.cluster_fingerprint());
  EXPECT_NE(CanonicalClusterSpec(c, 11).cluster_fingerprint(),
            spec.cluster_fingerprint());
  ServerConfig other = c;
  other.optimizer.lr = 0.5f;
  EXPECT_NE(CanonicalClusterSpec(other, 10).cluster_fingerprint(),
            spec.cluster_fingerprint());
  // The settings spec has no n and no shards.
  const v1::ClusterSpec settings = ClusterSettingsSpec(c);
  EXPECT_EQ(settings.n(), 0u);
  EXPECT_EQ(settings.shards_size(), 0);
}

TEST(ServerConfigTest, CheckSameClusterSettingsNamesEveryDifference) {
  ServerConfig leader = BaseConfig(2, 2);
  leader.peers = {"leader:1", ""};
  const v1::ClusterSpec spec = CanonicalClusterSpec(leader, 100);
  ServerConfig own = leader;
  own.shard_id = 1;
  EXPECT_THAT(CheckSameClusterSettings(own, spec, 0), IsOk());
  EXPECT_THAT(CheckSameClusterSettings(own, spec, 100), IsOk());
  own.optimizer.lr = 0.5f;
  own.num_workers = 3;
  const absl::Status differs = CheckSameClusterSettings(own, spec, 0);
  EXPECT_THAT(
      differs,
      StatusIs(absl::StatusCode::kFailedPrecondition,
               AllOf(HasSubstr("shard 1 is configured differently from the "
                               "leader, shard 0 (leader:1)"),
                     HasSubstr("--lr is 0.5 here but 0.1 on the leader"),
                     HasSubstr("--workers"))));
  // n is compared only when this shard has one (from its checkpoint).
  own = leader;
  own.shard_id = 1;
  EXPECT_THAT(CheckSameClusterSettings(own, spec, 99),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("the parameter count n is 99 here (from "
                                 "this shard's checkpoint) but 100")));
  EXPECT_THAT(CheckSameClusterSettings(own, spec, 99), Not(IsOk()));
}

// --bucket-mb that cuts the model into more pieces than a cluster may have
// (common/buckets.h kMaxBucketPieces) is refused once n is known, naming
// the flag as given, the count, the bound and the smallest value that fits
// (the break-it run's --bucket-mb=0.000004 --density=0.5 on a model of
// 200,000 parameters: every step timed out instead).
TEST(ServerConfigTest, CheckBucketPiecesRefusesTooManyPiecesForThisN) {
  ServerConfig c = BaseConfig(2, 2);
  c.peers = {"", "shard1:7001"};
  c.selection = SelectionKind::kLayerwise;
  c.bucket_mb = 0.000004;
  c.optimizer.density = 0.5;
  GTOPK_EXPECT_OK(ValidateServerConfig(c));  // n is not known yet
  EXPECT_EQ(BucketMbGiven(c), "4e-06");
  EXPECT_THAT(
      CheckBucketPieces(c, 200000),
      StatusIs(absl::StatusCode::kFailedPrecondition,
               AllOf(HasSubstr("--bucket-mb 4e-06 (buckets of 1 values)"),
                     HasSubstr("n = 200000 parameters into 200000 bucket "
                               "pieces, more than the 65536"),
                     HasSubstr("--bucket-mb of at least 1.6e-05 (4 values)"))));
  // The value it names fits.
  c.bucket_mb = 1.6e-05;
  GTOPK_EXPECT_OK(CheckBucketPieces(c, 200000));
  // A smaller model fits in the same buckets: 65536 pieces, the bound.
  c.bucket_mb = 0.000004;
  GTOPK_EXPECT_OK(CheckBucketPieces(c, 65536));
  // Three shards cut [0, 65536) at 21845 and 43690, inside buckets of 4:
  // 16384 + 2 pieces.
  c.num_shards = 3;
  c.bucket_mb = 1.6e-05;
  GTOPK_EXPECT_OK(CheckBucketPieces(c, 65536));
  // Not layer-wise: no buckets.
  c.selection = SelectionKind::kThreshold;
  c.bucket_mb = 0.000004;
  GTOPK_EXPECT_OK(CheckBucketPieces(c, 200000));
}

}  // namespace
}  // namespace server
}  // namespace gtopk
