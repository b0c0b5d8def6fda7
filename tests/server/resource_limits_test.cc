// Resource bounds (issue 19, docs/resource-limits.md): the bound on a push's
// pairs (memory per step) in ShardAggregator, and the limits over real gRPC on
// loopback (AggregatorServer on 127.0.0.1, port 0), where a refused call
// gets RESOURCE_EXHAUSTED naming the bound's flag while admitted callers
// keep being served. The call limiter on its own is tested in
// tests/server/call_limits_test.cc, the flags' validation and defaults in
// tests/server/server_config_test.cc.
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/codec.h"
#include "common/grpc_edge/grpc_edge.h"
#include "gmock/gmock.h"
#include "grpcpp/client_context.h"
#include "gtest/gtest.h"
#include "gtopk/v1/gtopk.grpc.pb.h"
#include "server/aggregator_server.h"
#include "server/call_limits.h"
#include "server/server_config.h"
#include "server/shard_aggregator.h"
#include "tests/testing/status_matchers.h"

namespace gtopk {
namespace server {
namespace {

using ::gtopk::testing::StatusIs;
using ::testing::AllOf;
using ::testing::HasSubstr;

// ---------------------------------------------------------------------------
// Memory per step: a push's pairs (ShardAggregator, no gRPC)

std::unique_ptr<ShardAggregator> OneShard(uint32_t workers, uint64_t n,
                                          double density) {
  ShardOptions o;
  o.n = n;
  o.num_workers = workers;
  o.optimizer.density = density;
  o.optimizer.momentum_mode = MomentumMode::kNone;
  o.step_timeout = absl::Seconds(5);
  auto shard = ::gtopk::testing::OkOrThrow(ShardAggregator::Create(o, nullptr),
                                           "ShardAggregator::Create");
  EXPECT_THAT(shard->InitParams(std::vector<float>(n, 1.0f)),
              ::gtopk::testing::IsOkAndHolds(true));
  return shard;
}

SparseVector FirstEntries(uint64_t count, float value) {
  SparseVector v;
  for (uint64_t i = 0; i < count; ++i) {
    v.push_back(static_cast<uint32_t>(i), value);
  }
  return v;
}

WorkerPush SparsePush(int64_t step, uint32_t worker, SparseVector v) {
  WorkerPush p;
  p.step = step;
  p.worker = worker;
  p.sparse = std::move(v);
  return p;
}

TEST(PushPairsBoundTest, MaxPushPairsIsKCappedByTheRange) {
  // n = 1000, density 0.01: k = 10 (exact top-k: at most k pairs).
  auto shard = OneShard(1, 1000, 0.01);
  EXPECT_EQ(shard->MaxPushPairs(0), 10u);
  // Density 1: k = n, capped by the range (one shard: n).
  auto dense_k = OneShard(1, 50, 1.0);
  EXPECT_EQ(dense_k->MaxPushPairs(3), 50u);
}

TEST(PushPairsBoundTest, FollowsTheSelectorAndTheDensityWarmup) {
  ShardOptions o;
  o.n = 1000;
  o.num_workers = 1;
  o.optimizer.density = 0.01;
  o.optimizer.density_warmup = {0.1};
  o.optimizer.steps_per_epoch = 5;
  o.max_pairs_for_k = [](uint64_t k) { return 4 * k / 3; };  // gaussiank
  auto shard = ShardAggregator::Create(o, nullptr);
  GTOPK_ASSERT_OK(shard.status());
  EXPECT_EQ((*shard)->MaxPushPairs(0), 4u * 100 / 3);  // warm-up epoch
  EXPECT_EQ((*shard)->MaxPushPairs(5), 4u * 10 / 3);
}

TEST(PushPairsBoundTest, OversizedPushIsRefusedAndNothingIsApplied) {
  // P = 2, k = 10. Worker 1 claims 11 pairs: RESOURCE_EXHAUSTED naming the
  // bound; worker 0's push of the same round fails with it (ABORTED), no
  // parameter changes, and the step is retried and applied normally.
  const uint64_t n = 1000;
  auto shard = OneShard(2, n, 0.01);
  absl::StatusOr<std::shared_ptr<const RoundResult>> first;
  std::thread w0([&] {
    first = shard->Submit(SparsePush(0, 0, FirstEntries(10, 0.5f)),
                          absl::Now() + absl::Seconds(5));
  });
  // Let worker 0's push open the round before worker 1's arrives.
  while (shard->AwaitNoRound(absl::Now()))
    absl::SleepFor(absl::Milliseconds(5));
  auto big = shard->Submit(SparsePush(0, 1, FirstEntries(11, 0.5f)),
                           absl::Now() + absl::Seconds(5));
  w0.join();
  EXPECT_THAT(
      big.status(),
      StatusIs(absl::StatusCode::kResourceExhausted,
               AllOf(HasSubstr("worker 1 step 0"), HasSubstr("11 pairs"),
                     HasSubstr("at most 10"), HasSubstr("--density"))));
  EXPECT_THAT(first.status(), StatusIs(absl::StatusCode::kAborted));
  EXPECT_EQ(shard->next_step(), 0);
  auto params = shard->Params(absl::Now() + absl::Seconds(1));
  GTOPK_ASSERT_OK(params.status());
  for (float x : params->first) ASSERT_EQ(x, 1.0f);

  // The retry with legitimate pushes completes.
  std::thread r0([&] {
    first = shard->Submit(SparsePush(0, 0, FirstEntries(10, 0.5f)),
                          absl::Now() + absl::Seconds(5));
  });
  auto second = shard->Submit(SparsePush(0, 1, FirstEntries(10, 0.5f)),
                              absl::Now() + absl::Seconds(5));
  r0.join();
  GTOPK_ASSERT_OK(first.status());
  GTOPK_ASSERT_OK(second.status());
  EXPECT_EQ(shard->next_step(), 1);
}

TEST(PushPairsBoundTest, PushesForLaterStepsAreNotQueued) {
  // Pending pushes per step: only the current step collects; a push for a
  // later step is refused at once (held nowhere), and a repeated push of the
  // current step replaces the first (one slot per worker).
  auto shard = OneShard(2, 1000, 0.01);
  for (int64_t step : {1, 2, 1000000}) {
    EXPECT_THAT(shard
                    ->Submit(SparsePush(step, 0, FirstEntries(10, 0.5f)),
                             absl::Now() + absl::Seconds(1))
                    .status(),
                StatusIs(absl::StatusCode::kFailedPrecondition,
                         HasSubstr("is ahead of shard 0")));
  }
  EXPECT_TRUE(shard->AwaitNoRound(absl::Now()));
}

TEST(PeekSparseCountTest, ReadsTheClaimedCountWithoutDecoding) {
  SparseVector v = FirstEntries(300, 1.0f);
  std::string bytes;
  GTOPK_ASSERT_OK(EncodeSparse(v, 1000, CodecSpec{}, &bytes));
  auto count = PeekSparseCount(bytes);
  GTOPK_ASSERT_OK(count.status());
  EXPECT_EQ(*count, 300u);
  // A header claiming 2^32-1 pairs with no payload: the claim is read, not
  // allocated for.
  std::string claim = bytes.substr(0, 3) + std::string("\xff\xff\xff\xff\x0f");
  count = PeekSparseCount(claim);
  GTOPK_ASSERT_OK(count.status());
  EXPECT_EQ(*count, 0xffffffffu);
  EXPECT_THAT(PeekSparseCount(bytes.substr(0, 3)),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(PeekSparseCount(""),
              StatusIs(absl::StatusCode::kInvalidArgument));
}

// ---------------------------------------------------------------------------
// Over real gRPC

struct OneServer {
  std::unique_ptr<AggregatorServer> server;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<v1::Aggregator::Stub> stub;
};

OneServer Start(ServerConfig config) {
  OneServer s;
  config.peers = {""};
  s.server = ::gtopk::testing::OkOrThrow(
      AggregatorServer::Start(config, "127.0.0.1:0"), "the server's start");
  s.channel = CreateLimitedChannel(s.server->address(), uint64_t{64} << 20);
  s.stub = v1::Aggregator::NewStub(s.channel);
  return s;
}

// An open PushPull stream that never pushes (what a flooding client holds).
struct IdleStream {
  grpc::ClientContext context;
  std::unique_ptr<grpc::ClientReaderWriter<v1::Push, v1::Pull>> stream;
};

std::unique_ptr<IdleStream> OpenIdle(v1::Aggregator::Stub* stub) {
  auto s = std::make_unique<IdleStream>();
  s->context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(30)));
  s->stream = stub->PushPull(&s->context);
  return s;
}

// The status an idle stream ended with (it must have ended, or have been
// cancelled).
absl::Status Outcome(IdleStream& s) {
  s.stream->WritesDone();
  return FromGrpcStatus(s.stream->Finish());
}

bool WaitInFlight(AggregatorServer& server, int64_t want) {
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (absl::Now() < deadline) {
    if (server.service()->call_limiter().in_flight() == want) return true;
    absl::SleepFor(absl::Milliseconds(10));
  }
  return false;
}

absl::StatusOr<v1::JoinResponse> Join(v1::Aggregator::Stub* stub, int rank) {
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
  v1::JoinRequest request;
  request.set_requested_rank(rank);
  request.set_n(100);
  v1::JoinResponse response;
  const grpc::Status s = stub->Join(&ctx, request, &response);
  if (!s.ok()) return FromGrpcStatus(s);
  return response;
}

TEST(ResourceLimitsGrpcTest, ServerBoundRefusesStreamsAndCallsThenRecovers) {
  ServerConfig config;
  config.num_workers = 2;
  config.max_concurrent_calls = 3;
  // Otherwise the connection's stream limit (the same 3 by default) would
  // make the fourth stream wait in the client instead of reaching the bound.
  config.max_streams_per_connection = 100;
  OneServer s = Start(config);
  std::vector<std::unique_ptr<IdleStream>> idle;
  for (int i = 0; i < 3; ++i) idle.push_back(OpenIdle(s.stub.get()));
  ASSERT_TRUE(WaitInFlight(*s.server, 3));
  // The fourth stream and a Join are refused at once, naming the flag.
  auto fourth = OpenIdle(s.stub.get());
  EXPECT_THAT(Outcome(*fourth),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       HasSubstr("--max-concurrent-calls=3")));
  EXPECT_THAT(Join(s.stub.get(), -1).status(),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       HasSubstr("--max-concurrent-calls=3")));
  EXPECT_EQ(s.server->service()->metrics().limit_rejections(
                LimitBound::kConcurrentCalls),
            2);
  // Once one stream ends, calls are served again.
  idle[0]->context.TryCancel();
  (void)Outcome(*idle[0]);
  ASSERT_TRUE(WaitInFlight(*s.server, 2));
  GTOPK_EXPECT_OK(Join(s.stub.get(), -1).status());
  for (size_t i = 1; i < idle.size(); ++i) {
    idle[i]->context.TryCancel();
    (void)Outcome(*idle[i]);
  }
}

TEST(ResourceLimitsGrpcTest, PeerBoundLeavesAWorkerWithItsTokenServed) {
  ServerConfig config;
  config.num_workers = 2;
  config.max_concurrent_calls = 100;
  config.max_calls_per_peer = 2;
  OneServer s = Start(config);
  GTOPK_ASSERT_OK_AND_ASSIGN(v1::JoinResponse joined, Join(s.stub.get(), 0));
  std::vector<std::unique_ptr<IdleStream>> idle;
  for (int i = 0; i < 2; ++i) idle.push_back(OpenIdle(s.stub.get()));
  ASSERT_TRUE(WaitInFlight(*s.server, 2));
  // A third anonymous call from this host is refused ...
  auto third = OpenIdle(s.stub.get());
  EXPECT_THAT(Outcome(*third),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       AllOf(HasSubstr("peer ipv4:127.0.0.1"),
                             HasSubstr("--max-calls-per-peer=2"))));
  EXPECT_THAT(Join(s.stub.get(), 1).status(),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       HasSubstr("--max-calls-per-peer=2")));
  EXPECT_EQ(s.server->service()->metrics().limit_rejections(
                LimitBound::kCallsPerPeer),
            2);
  // ... while rank 0's stream, carrying its member token, counts against the
  // rank (a peer of its own) and is admitted: the leader answers its
  // initial metadata once it registered the rank.
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
  ctx.AddMetadata("gtopk-rank", "0");
  ctx.AddMetadata("gtopk-member-token", absl::StrCat(joined.member_token()));
  auto worker = s.stub->PushPull(&ctx);
  worker->WaitForInitialMetadata();
  ASSERT_TRUE(WaitInFlight(*s.server, 3));
  EXPECT_EQ(s.server->service()->call_limiter().in_flight(CallPeerRank(0)), 1);
  // A stream claiming rank 1 with a made-up token counts as its host.
  grpc::ClientContext fake_ctx;
  fake_ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
  fake_ctx.AddMetadata("gtopk-rank", "1");
  fake_ctx.AddMetadata("gtopk-member-token", "12345");
  auto fake = s.stub->PushPull(&fake_ctx);
  fake->WritesDone();
  EXPECT_THAT(FromGrpcStatus(fake->Finish()),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       HasSubstr("--max-calls-per-peer=2")));
  ctx.TryCancel();
  worker->WritesDone();
  (void)worker->Finish();
  for (auto& i : idle) {
    i->context.TryCancel();
    (void)Outcome(*i);
  }
}

}  // namespace
}  // namespace server
}  // namespace gtopk
