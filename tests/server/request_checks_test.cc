// The stateless request checks the shard's stream handlers run
// (server/request_checks.h), the --density-warmup parser
// (server/server_config.h) and the worker's checks of the leader's cluster
// spec (common/cluster_spec/cluster_spec.h): what fuzz/ feeds with arbitrary
// bytes, here on hand-made cases with the expected answer written out.
#include "server/request_checks.h"

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "common/cluster_spec/cluster_spec.h"
#include "common/codec.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/server_config.h"
#include "tests/testing/status_matchers.h"

namespace gtopk {
namespace server {
namespace {

using ::gtopk::testing::StatusIs;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

ServerConfig Config() {
  ServerConfig c;
  c.shard_id = 1;
  c.num_shards = 2;
  c.num_workers = 3;
  c.peers = {"a:1", "b:2"};
  return c;
}

v1::Push SparsePush(const SparseVector& v, uint64_t n, CodecSpec spec) {
  v1::Push push;
  push.set_step(4);
  push.set_rank(2);
  push.set_shard_id(1);
  std::string bytes;
  EXPECT_TRUE(EncodeSparse(v, n, spec, &bytes).ok());
  push.set_sparse(bytes);
  return push;
}

TEST(DecodeWirePushTest, AcceptsThePushAWorkerSends) {
  SparseVector v;
  v.push_back(5, 1.5f);
  v.push_back(9, -2.0f);
  RejectReason reason = RejectReason::kCount;
  GTOPK_ASSERT_OK_AND_ASSIGN(
      WorkerPush push,
      DecodeWirePush(SparsePush(v, 10, CodecSpec()), Config(), 10, &reason));
  EXPECT_EQ(push.step, 4);
  EXPECT_EQ(push.worker, 2u);
  EXPECT_THAT(push.sparse.indices, ElementsAre(5u, 9u));
  EXPECT_THAT(push.sparse.values, ElementsAre(1.5f, -2.0f));
  EXPECT_EQ(reason, RejectReason::kCount);  // untouched on OK
}

TEST(DecodeWirePushTest, NamesEachFaultWithItsRejectReason) {
  SparseVector v;
  v.push_back(9, 1.0f);
  struct Case {
    v1::Push push;
    RejectReason reason;
    const char* message;
  };
  std::vector<Case> cases;
  v1::Push other_shard = SparsePush(v, 10, CodecSpec());
  other_shard.set_shard_id(0);
  cases.push_back({other_shard, RejectReason::kWrongShard,
                   "push for shard 0 was sent to shard 1"});
  v1::Push unknown = SparsePush(v, 10, CodecSpec());
  unknown.set_rank(3);
  cases.push_back({unknown, RejectReason::kUnknownWorker,
                   "unknown worker rank 3; the cluster has 3 workers"});
  v1::Push dense = SparsePush(v, 10, CodecSpec());
  dense.add_dense(1.0f);
  cases.push_back({dense, RejectReason::kWrongMode, "dense values sent in"});
  cases.push_back({SparsePush(v, 10, {IndexCodec::kRaw, ValueCodec::kFp32}),
                   RejectReason::kWrongCodec,
                   "wrong codec: the push uses raw/fp32"});
  v1::Push truncated = SparsePush(v, 10, CodecSpec());
  truncated.mutable_sparse()->pop_back();
  cases.push_back({truncated, RejectReason::kCorrupt, "bad sparse push"});
  // Index 9 against a cluster of n = 9: out of range.
  for (const Case& c : cases) {
    RejectReason reason = RejectReason::kCount;
    EXPECT_THAT(
        DecodeWirePush(c.push, Config(), 10, &reason).status(),
        StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(c.message)));
    EXPECT_EQ(reason, c.reason) << c.message;
  }
  RejectReason reason = RejectReason::kCount;
  EXPECT_THAT(
      DecodeWirePush(SparsePush(v, 10, CodecSpec()), Config(), 9, &reason)
          .status(),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(">= n")));
  EXPECT_EQ(reason, RejectReason::kCorrupt);
}

TEST(DecodeWirePushTest, DenseModeTakesTheValuesAndRefusesSparseBytes) {
  ServerConfig c = Config();
  c.mode = AggregationMode::kDense;
  v1::Push push;
  push.set_rank(1);
  push.set_shard_id(1);
  push.add_dense(0.5f);
  push.add_dense(std::numeric_limits<float>::infinity());  // Submit's business
  RejectReason reason = RejectReason::kCount;
  GTOPK_ASSERT_OK_AND_ASSIGN(WorkerPush w,
                             DecodeWirePush(push, c, 10, &reason));
  EXPECT_EQ(w.dense.size(), 2u);
  push.set_sparse("x");
  EXPECT_THAT(DecodeWirePush(push, c, 10, &reason).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("sparse bytes sent in dense mode")));
  EXPECT_EQ(reason, RejectReason::kWrongMode);
}

TEST(InitChunkTest, SenderMustBeWorkerZeroForThisShard) {
  v1::ParamsChunk chunk;
  chunk.set_shard_id(1);
  GTOPK_EXPECT_OK(CheckInitChunkSender(chunk, 1));
  chunk.set_rank(2);
  EXPECT_THAT(
      CheckInitChunkSender(chunk, 1),
      StatusIs(absl::StatusCode::kPermissionDenied, HasSubstr("worker 2")));
  chunk.set_rank(0);
  EXPECT_THAT(CheckInitChunkSender(chunk, 0),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("chunk for shard 1 was sent to shard 0")));
}

TEST(InitChunkTest, ChunksMustTileTheRangeWithFiniteValues) {
  // Shard 1 owns [10, 20) and has [10, 14).
  v1::ParamsChunk chunk;
  chunk.set_offset(14);
  for (int i = 0; i < 6; ++i) chunk.add_values(1.0f);
  GTOPK_EXPECT_OK(CheckInitChunkRange(chunk, 1, 10, 20, 14));
  chunk.add_values(1.0f);  // [14, 21): past the end
  EXPECT_THAT(
      CheckInitChunkRange(chunk, 1, 10, 20, 14),
      StatusIs(absl::StatusCode::kInvalidArgument,
               HasSubstr("runs past the end of shard 1's range [10, 20)")));
  chunk.clear_values();
  chunk.set_offset(13);
  EXPECT_THAT(
      CheckInitChunkRange(chunk, 1, 10, 20, 14),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("overlaps")));
  chunk.set_offset(std::numeric_limits<uint64_t>::max());
  EXPECT_THAT(
      CheckInitChunkRange(chunk, 1, 10, 20, 14),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("leaves a gap")));
  chunk.set_offset(14);
  chunk.add_values(2.0f);
  chunk.add_values(std::nanf(""));
  EXPECT_THAT(
      CheckInitChunkRange(chunk, 1, 10, 20, 14),
      StatusIs(absl::StatusCode::kInvalidArgument,
               HasSubstr("initial parameter at index 15 is not finite")));
}

TEST(DensityWarmupFlagTest, ParsesListsDgcAndNothing) {
  GTOPK_ASSERT_OK_AND_ASSIGN(auto list, ParseDensityWarmupFlag("0.25,0.0625"));
  EXPECT_THAT(list, ElementsAre(0.25, 0.0625));
  GTOPK_ASSERT_OK_AND_ASSIGN(auto none, ParseDensityWarmupFlag(""));
  EXPECT_TRUE(none.empty());
  GTOPK_ASSERT_OK_AND_ASSIGN(auto dgc, ParseDensityWarmupFlag("dgc"));
  EXPECT_EQ(dgc, DgcDensityWarmup());
  EXPECT_THAT(ParseDensityWarmupFlag("0.5,,0.1").status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("--density-warmup: '' is not a number")));
  EXPECT_THAT(ParseDensityWarmupFlag("0.5,abc").status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("'abc'")));
}

v1::ClusterSpec TwoShards(uint64_t n) {
  v1::ClusterSpec c;
  c.set_n(n);
  c.set_num_workers(2);
  c.set_step_timeout_ms(1000);
  for (uint32_t s = 0; s < 2; ++s) {
    v1::ShardSpec* sh = c.add_shards();
    sh->set_shard_id(s);
    sh->set_address(s == 0 ? "a:1" : "b:2");
    sh->set_begin(s == 0 ? 0 : n / 2);
    sh->set_end(s == 0 ? n / 2 : n);
  }
  return c;
}

TEST(WorkerClusterSpecTest, AcceptsATilingAndRefusesEachFault) {
  GTOPK_EXPECT_OK(ValidateWorkerClusterSpec(TwoShards(10), 10, 1));
  EXPECT_THAT(ValidateWorkerClusterSpec(TwoShards(10), 11, 1),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("cluster has n = 10, this worker has 11")));
  EXPECT_THAT(ValidateWorkerClusterSpec(TwoShards(10), 10, 2),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("rank 2 not below P = 2")));
  v1::ClusterSpec gap = TwoShards(10);
  gap.mutable_shards(1)->set_begin(6);
  EXPECT_THAT(
      ValidateWorkerClusterSpec(gap, 10, 0),
      StatusIs(absl::StatusCode::kInvalidArgument,
               HasSubstr("does not continue the tiling of [0, 10) at 5")));
  v1::ClusterSpec past = TwoShards(10);
  past.mutable_shards(1)->set_end(11);
  EXPECT_THAT(
      ValidateWorkerClusterSpec(past, 10, 0),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("tiling")));
  v1::ClusterSpec short_tiling = TwoShards(10);
  short_tiling.mutable_shards(1)->set_end(9);
  EXPECT_THAT(ValidateWorkerClusterSpec(short_tiling, 10, 0),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("shard ranges end at 9, not n = 10")));
  v1::ClusterSpec no_timeout = TwoShards(10);
  no_timeout.set_step_timeout_ms(0);
  EXPECT_THAT(ValidateWorkerClusterSpec(no_timeout, 10, 0),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("step_timeout_ms is 0")));
}

TEST(WorkerClusterSpecTest, OptimizerFromSpecReadsEveryField) {
  v1::OptimizerSpec s;
  s.set_lr(0.5f);
  s.set_momentum(0.9f);
  s.set_momentum_mode(v1::MOMENTUM_MODE_UNSPECIFIED);
  s.set_weight_decay(0.25f);
  s.set_lr_warmup_steps(7);
  s.set_density(0.01);
  s.add_density_warmup(0.5);
  s.set_steps_per_epoch(3);
  GTOPK_ASSERT_OK_AND_ASSIGN(OptimizerOptions o, OptimizerFromSpec(s));
  EXPECT_EQ(o.lr, 0.5f);
  EXPECT_EQ(o.momentum, 0.9f);
  EXPECT_EQ(o.momentum_mode,
            MomentumMode::kDgcCorrection);  // the documented default
  EXPECT_EQ(o.weight_decay, 0.25f);
  EXPECT_EQ(o.lr_warmup_steps, 7);
  EXPECT_EQ(o.density, 0.01);
  EXPECT_THAT(o.density_warmup, ElementsAre(0.5));
  EXPECT_EQ(o.steps_per_epoch, 3);
  s.set_momentum_mode(static_cast<v1::MomentumMode>(77));
  EXPECT_THAT(OptimizerFromSpec(s).status(),
              StatusIs(absl::StatusCode::kInvalidArgument));
}

}  // namespace
}  // namespace server
}  // namespace gtopk
