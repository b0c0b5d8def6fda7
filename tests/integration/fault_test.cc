// Faults on a real in-process cluster: a worker that disconnects in the
// middle of a step (pushed to one shard of two, then gone) makes the others
// fail within the step deadline with an error naming it, without applying
// anything; a slow worker within the deadline does not fail the step.
#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/codec.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "server/server_config.h"
#include "tests/testing/joined_workers.h"
#include "tests/testing/local_cluster.h"
#include "tests/testing/reference.h"
#include "tests/testing/status_matchers.h"
#include "worker/client.h"

namespace gtopk {
namespace {

using ::gtopk::testing::LocalCluster;
using ::gtopk::testing::StatusIs;
using ::testing::AllOf;
using ::testing::HasSubstr;
using worker::ClientOptions;
using worker::WorkerClient;

constexpr uint64_t kN = 2003;

server::ServerConfig Config(int workers, absl::Duration step_timeout) {
  server::ServerConfig c;
  c.num_workers = workers;
  c.optimizer.density = 0.01;
  c.optimizer.lr = 0.1f;
  c.step_timeout = step_timeout;
  return c;
}

std::unique_ptr<WorkerClient> Join(
    const ::gtopk::testing::LocalCluster& cluster, int rank) {
  ClientOptions o;
  o.leader_address = cluster.leader();
  o.requested_rank = rank;
  o.n = kN;
  o.rpc_timeout = absl::Seconds(10);
  o.step_watchdog_margin = absl::Milliseconds(500);
  auto c = WorkerClient::Connect(o);
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? *std::move(c) : nullptr;
}

std::vector<float> Seeded(uint64_t seed) {
  return ::gtopk::testing::NormalVector(kN, seed);
}

using ::gtopk::testing::BitEqual;

// (mode, selection): exact selection couples the shards through the
// threshold exchange; quota and topk rely on the commit vote alone.
class PartialPushTest : public ::testing::TestWithParam<
                            std::pair<AggregationMode, SelectionKind>> {};

TEST_P(PartialPushTest, WorkerDisconnectingMidStepFailsTheOthersNamingIt) {
  server::ServerConfig config = Config(3, absl::Seconds(1));
  config.mode = GetParam().first;
  config.selection = GetParam().second;
  auto cluster_or = ::gtopk::testing::LocalCluster::Start(config, 2);
  ASSERT_TRUE(cluster_or.ok()) << cluster_or.status();
  ::gtopk::testing::LocalCluster& cluster = **cluster_or;
  GTOPK_ASSERT_OK_AND_ASSIGN(
      ::gtopk::testing::JoinedWorkers joined,
      ::gtopk::testing::JoinAndSynchronize(cluster, 3, Seeded(1)));
  auto& clients = joined.clients;
  auto& params = joined.params;
  const std::vector<float> before = params[0];

  // Workers 0 and 1 step normally.
  std::vector<absl::Status> status(2);
  std::vector<absl::Duration> took(2);
  std::vector<std::thread> threads;
  for (int w = 0; w < 2; ++w) {
    threads.emplace_back([&, w] {
      const absl::Time start = absl::Now();
      status[w] =
          clients[w]->Step(Seeded(100 + w), absl::MakeSpan(params[w])).status();
      took[w] = absl::Now() - start;
    });
  }
  // Worker 2 pushes to shard 0 only, then disconnects.
  {
    const v1::ClusterSpec spec = clients[2]->cluster();
    auto stub = v1::Aggregator::NewStub(grpc::CreateChannel(
        spec.shards(0).address(), grpc::InsecureChannelCredentials()));
    grpc::ClientContext ctx;
    auto stream = stub->PushPull(&ctx);
    v1::Push push;
    push.set_step(0);
    push.set_rank(2);
    push.set_shard_id(0);
    // As worker 2's client would (its identity), so the push is accepted.
    push.set_member_token(clients[2]->member_token());
    push.set_cluster_fingerprint(spec.cluster_fingerprint());
    SparseVector one;
    one.push_back(static_cast<uint32_t>(spec.shards(0).begin()), 0.5f);
    GTOPK_ASSERT_OK(
        EncodeSparse(one, kN,
                     CodecSpec{*ParseIndexCodec(spec.index_codec()),
                               *ParseValueCodec(spec.value_codec())},
                     push.mutable_sparse()));
    EXPECT_TRUE(stream->Write(push));
    absl::SleepFor(absl::Milliseconds(100));
    ctx.TryCancel();
    stream->Finish().IgnoreError();
    clients[2].reset();
  }
  for (auto& t : threads) t.join();

  for (int w = 0; w < 2; ++w) {
    EXPECT_THAT(status[w],
                StatusIs(absl::StatusCode::kDeadlineExceeded,
                         AllOf(HasSubstr("shard 1"), HasSubstr("worker(s) 2"))))
        << "worker " << w;
    // Within the step deadline (1 s) plus the client's margin and slack.
    EXPECT_LT(took[w], absl::Milliseconds(2500)) << "worker " << w;
    EXPECT_TRUE(BitEqual(params[w], before)) << "worker " << w;
    EXPECT_EQ(clients[w]->next_step(), 0);
  }
  // No shard applied the step (worker 2's push completed shard 0's round,
  // but shard 1's never completed, so shard 0 must not apply either).
  {
    auto server = cluster.ServerParams(kN);
    ASSERT_TRUE(server.ok()) << server.status();
    EXPECT_EQ(server->second, 0) << "a shard moved past the failed step";
    EXPECT_TRUE(BitEqual(server->first, before))
        << "the failed step was applied on some shard";
  }
  // Worker 2 comes back; all three retry step 0 (a failed step can simply
  // be run again) and get past it: the failed threshold exchange of the
  // first attempt must not block the retry.
  clients[2] = Join(cluster, 2);
  ASSERT_NE(clients[2], nullptr);
  params[2].assign(kN, 0.0f);
  GTOPK_ASSERT_OK(clients[2]->SynchronizeParameters(absl::MakeSpan(params[2])));
  std::vector<absl::Status> retry(3);
  std::vector<std::thread> again;
  for (int w = 0; w < 3; ++w) {
    again.emplace_back([&, w] {
      // A worker may first hear of the failure once more on a shard it had
      // not heard from; allow a few attempts.
      for (int attempt = 0; attempt < 4; ++attempt) {
        retry[w] = clients[w]
                       ->Step(Seeded(200 + w), absl::MakeSpan(params[w]))
                       .status();
        if (retry[w].ok()) break;
      }
    });
  }
  for (auto& t : again) t.join();
  for (int w = 0; w < 3; ++w) {
    GTOPK_EXPECT_OK(retry[w]) << "worker " << w << " cannot get past step 0";
    EXPECT_EQ(clients[w]->next_step(), 1);
  }
  EXPECT_TRUE(BitEqual(params[0], params[1]));
  EXPECT_TRUE(BitEqual(params[0], params[2]));
  auto server = cluster.ServerParams(kN);
  ASSERT_TRUE(server.ok()) << server.status();
  EXPECT_TRUE(BitEqual(server->first, params[0]));
}

INSTANTIATE_TEST_SUITE_P(
    Modes, PartialPushTest,
    ::testing::Values(
        std::make_pair(AggregationMode::kGtopk, SelectionKind::kThreshold),
        std::make_pair(AggregationMode::kGtopk, SelectionKind::kQuota),
        std::make_pair(AggregationMode::kTopk, SelectionKind::kThreshold)),
    [](const auto& info) {
      return absl::StrCat(AggregationModeName(info.param.first), "_",
                          SelectionKindName(info.param.second));
    });

TEST(FaultTest, SlowWorkerWithinTheDeadlineCompletesTheStep) {
  auto cluster_or =
      ::gtopk::testing::LocalCluster::Start(Config(2, absl::Seconds(2)), 2);
  ASSERT_TRUE(cluster_or.ok()) << cluster_or.status();
  ::gtopk::testing::LocalCluster& cluster = **cluster_or;
  std::vector<std::unique_ptr<WorkerClient>> clients;
  for (int w = 0; w < 2; ++w) {
    clients.push_back(Join(cluster, w));
    ASSERT_NE(clients.back(), nullptr);
  }
  std::vector<std::vector<float>> params(2);
  std::vector<absl::Status> status(2);
  std::vector<std::thread> threads;
  for (int w = 0; w < 2; ++w) {
    threads.emplace_back([&, w] {
      params[w] = w == 0 ? Seeded(1) : std::vector<float>(kN, 0.0f);
      auto sync = clients[w]->SynchronizeParameters(absl::MakeSpan(params[w]));
      if (!sync.ok()) {
        status[w] = sync.status();
        return;
      }
      for (int step = 0; step < 2 && status[w].ok(); ++step) {
        if (w == 1) absl::SleepFor(absl::Milliseconds(300));
        status[w] =
            clients[w]
                ->Step(Seeded(1000 * step + w), absl::MakeSpan(params[w]))
                .status();
      }
    });
  }
  for (auto& t : threads) t.join();
  GTOPK_ASSERT_OK(status[0]);
  GTOPK_ASSERT_OK(status[1]);
  EXPECT_TRUE(BitEqual(params[0], params[1]));
  auto server = cluster.ServerParams(kN);
  ASSERT_TRUE(server.ok()) << server.status();
  EXPECT_EQ(server->second, 2);
  EXPECT_TRUE(BitEqual(server->first, params[0]));
}

TEST(FaultTest, RestartedWorkerRejoinsBitIdenticalWithGlobalMomentum) {
  // With global momentum every replica keeps V; a restarted worker must get
  // the servers' V with the parameters, or it would drift from the others.
  server::ServerConfig config = Config(2, absl::Seconds(10));
  config.optimizer.momentum_mode = MomentumMode::kGlobal;
  config.optimizer.momentum = 0.9f;
  auto cluster_or = ::gtopk::testing::LocalCluster::Start(config, 2);
  ASSERT_TRUE(cluster_or.ok()) << cluster_or.status();
  ::gtopk::testing::LocalCluster& cluster = **cluster_or;
  std::vector<std::unique_ptr<WorkerClient>> clients(2);
  std::vector<std::vector<float>> params(2);
  auto steps = [&](int from, int to) {
    std::vector<std::thread> threads;
    for (int w = 0; w < 2; ++w) {
      threads.emplace_back([&, w] {
        for (int step = from; step < to; ++step) {
          auto s = clients[w]->Step(Seeded(1000 * step + w),
                                    absl::MakeSpan(params[w]));
          EXPECT_TRUE(s.ok()) << "worker " << w << ": " << s.status();
        }
      });
    }
    for (auto& t : threads) t.join();
  };
  {
    std::vector<std::thread> threads;
    for (int w = 0; w < 2; ++w) {
      threads.emplace_back([&, w] {
        clients[w] = Join(cluster, w);
        ASSERT_NE(clients[w], nullptr);
        params[w] = Seeded(5);
        ASSERT_TRUE(
            clients[w]->SynchronizeParameters(absl::MakeSpan(params[w])).ok());
      });
    }
    for (auto& t : threads) t.join();
  }
  steps(0, 3);
  // Worker 1 "restarts": a new client for rank 1 with a fresh buffer.
  clients[1].reset();
  clients[1] = Join(cluster, 1);
  ASSERT_NE(clients[1], nullptr);
  params[1].assign(kN, 0.0f);
  auto next = clients[1]->SynchronizeParameters(absl::MakeSpan(params[1]));
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_EQ(*next, 3);
  EXPECT_TRUE(BitEqual(params[0], params[1]));
  steps(3, 6);
  EXPECT_TRUE(BitEqual(params[0], params[1]))
      << "the restarted replica drifted from the others";
  auto server = cluster.ServerParams(kN);
  ASSERT_TRUE(server.ok()) << server.status();
  EXPECT_TRUE(BitEqual(server->first, params[0]));
  EXPECT_EQ(server->second, 6);
}

// --- A step whose update would not stay finite (issue 13, part 3) ---------

// (momentum mode, S). n = 20, P = 2, lr = 1, k = 2, momentum none: rank 0
// initialises params[bad] = -3e38 and both workers' gradients are 1.5e38
// there (and 1 at another index, on the other shard when S = 2): the update
// 3e38 / 2 would make params[bad] -inf at step 0. Global momentum: params[bad]
// = -1e38, step 0 (V = 1.5e38, params -2.5e38) applies, step 1 (V = 2.85e38)
// would make params[bad] -inf. The bad index is on the last shard, so with
// S = 2 the leader's shard computes a finite update and must still not apply
// it. Before the fix the step returned OK and every replica held -inf.
class NonFiniteStepTest
    : public ::testing::TestWithParam<std::tuple<MomentumMode, int>> {};

TEST_P(NonFiniteStepTest, IsRefusedOnEveryShardAndEveryWorker) {
  const auto [momentum, num_shards] = GetParam();
  constexpr uint64_t n = 20;
  const uint32_t bad = num_shards == 1 ? 3 : 13;
  const uint32_t other = num_shards == 1 ? 7 : 4;
  const bool global = momentum == MomentumMode::kGlobal;
  server::ServerConfig config = Config(2, absl::Seconds(1));
  config.optimizer.lr = 1.0f;
  config.optimizer.density = 0.1;  // k = 2
  config.optimizer.momentum_mode = momentum;
  auto cluster_or = LocalCluster::Start(config, num_shards);
  ASSERT_TRUE(cluster_or.ok()) << cluster_or.status();
  LocalCluster& cluster = **cluster_or;
  std::vector<std::unique_ptr<WorkerClient>> clients;
  for (int w = 0; w < 2; ++w) {
    ClientOptions o;
    o.leader_address = cluster.leader();
    o.requested_rank = w;
    o.n = n;
    o.rpc_timeout = absl::Seconds(10);
    o.step_watchdog_margin = absl::Milliseconds(500);
    auto c = WorkerClient::Connect(o);
    ASSERT_TRUE(c.ok()) << c.status();
    clients.push_back(*std::move(c));
  }
  std::vector<float> init(n, 0.5f);
  init[bad] = global ? -1e38f : -3e38f;
  const int refused_step = global ? 1 : 0;
  std::vector<std::vector<float>> params(2);
  std::vector<absl::Status> status(2);
  std::vector<std::vector<float>> before(2);
  std::vector<std::thread> threads;
  for (int w = 0; w < 2; ++w) {
    threads.emplace_back([&, w] {
      params[w] = w == 0 ? init : std::vector<float>(n, 0.0f);
      auto sync = clients[w]->SynchronizeParameters(absl::MakeSpan(params[w]));
      if (!sync.ok()) {
        status[w] = sync.status();
        return;
      }
      std::vector<float> grad(n, 0.0f);
      grad[bad] = 1.5e38f;
      grad[other] = 1.0f;
      for (int step = 0; step <= refused_step && status[w].ok(); ++step) {
        before[w] = params[w];
        status[w] = clients[w]->Step(grad, absl::MakeSpan(params[w])).status();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int w = 0; w < 2; ++w) {
    SCOPED_TRACE(w);
    EXPECT_THAT(status[w],
                StatusIs(absl::StatusCode::kFailedPrecondition,
                         AllOf(HasSubstr(absl::StrCat("step ", refused_step,
                                                      " failed on shard ",
                                                      num_shards - 1)),
                               HasSubstr(absl::StrCat(
                                   "params[", bad, "] would become -inf")))));
    EXPECT_TRUE(BitEqual(params[w], before[w]));  // nothing applied
    EXPECT_EQ(clients[w]->next_step(), refused_step);
  }
  // The other shard's vote waits up to the step timeout; give it that long
  // to (wrongly) apply before reading the servers' state.
  absl::SleepFor(absl::Milliseconds(1500));
  auto server = cluster.ServerParams(n);
  ASSERT_TRUE(server.ok()) << server.status();
  EXPECT_EQ(server->second, refused_step);
  EXPECT_TRUE(BitEqual(server->first, before[0]));
  for (float x : server->first) EXPECT_TRUE(std::isfinite(x));
}

INSTANTIATE_TEST_SUITE_P(
    Issue13, NonFiniteStepTest,
    ::testing::Combine(::testing::Values(MomentumMode::kNone,
                                         MomentumMode::kGlobal),
                       ::testing::Values(1, 2)),
    [](const ::testing::TestParamInfo<std::tuple<MomentumMode, int>>& info) {
      return absl::StrCat(MomentumModeName(std::get<0>(info.param)), "_S",
                          std::get<1>(info.param));
    });

}  // namespace
}  // namespace gtopk
