// Fail fast across shards (issue 13, part 5), on a real in-process cluster:
// a step that fails on one shard fails on every shard within about a round
// trip (the shard tells the leader, the leader tells the others: AbortStep),
// not at the others' step timeout; the workers' retry after Recover is a
// fresh attempt that completes, and every replica equals the servers.
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/codec.h"
#include "common/testing/status_matchers.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "server/local_cluster.h"
#include "server/service.h"
#include "worker/client.h"

namespace gtopk {
namespace {

using ::gtopk::testing::StatusIs;
using ::testing::HasSubstr;
using worker::ClientOptions;
using worker::WorkerClient;

constexpr uint64_t kN = 2003;
// Long, so that waiting for it shows: every failure below must come well
// before it.
constexpr absl::Duration kStepTimeout = absl::Seconds(20);
constexpr absl::Duration kPrompt = absl::Seconds(4);

std::vector<float> Seeded(uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal;
  std::vector<float> v(kN);
  for (float& x : v) x = normal(rng);
  return v;
}

bool BitEqual(absl::Span<const float> a, absl::Span<const float> b) {
  return a.size() == b.size() &&
         std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

std::unique_ptr<WorkerClient> Join(const server::LocalCluster& cluster,
                                   int rank) {
  ClientOptions o;
  o.leader_address = cluster.leader();
  o.requested_rank = rank;
  o.n = kN;
  o.rpc_timeout = absl::Seconds(10);
  auto c = WorkerClient::Connect(o);
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? *std::move(c) : nullptr;
}

// Worker `rank`'s step-0 pushes by hand: a valid one (index `begin` of the
// shard's range, value 0.5) or undecodable bytes.
v1::Push HandPush(const v1::ClusterSpec& spec, uint32_t rank, uint32_t shard,
                  bool valid) {
  v1::Push push;
  push.set_step(0);
  push.set_worker(rank);
  push.set_shard_id(shard);
  if (!valid) {
    push.set_sparse("not an encoded sparse vector");
    return push;
  }
  SparseVector one;
  one.push_back(static_cast<uint32_t>(spec.shards(shard).begin()), 0.5f);
  EXPECT_TRUE(EncodeSparse(one, kN,
                           CodecSpec{*ParseIndexCodec(spec.index_codec()),
                                     *ParseValueCodec(spec.value_codec())},
                           push.mutable_sparse())
                  .ok());
  return push;
}

struct Case {
  server::AggregationMode mode;
  server::SelectionKind selection;
  // The bad push reaches shard 0 before the good worker pushes (no round is
  // open there yet), or after.
  bool bad_first;
};

class FailFastTest : public ::testing::TestWithParam<Case> {};

// Worker 0 (by hand) pushes a valid push to shard 1 and garbage to shard 0;
// worker 1 (the client library) steps normally. Before the fix, shard 1
// waited for its step timeout (its round complete, its commit vote waiting
// for shard 0) and worker 1 got DEADLINE_EXCEEDED after 20 s.
TEST_P(FailFastTest, BadPushOnOneShardFailsTheStepOnEveryShardPromptly) {
  server::ServerConfig config;
  config.num_workers = 2;
  config.optimizer.density = 0.01;
  config.optimizer.lr = 0.1f;
  config.step_timeout = kStepTimeout;
  config.mode = GetParam().mode;
  config.selection = GetParam().selection;
  auto cluster_or = server::LocalCluster::Start(config, 2);
  ASSERT_TRUE(cluster_or.ok()) << cluster_or.status();
  server::LocalCluster& cluster = **cluster_or;
  std::vector<std::unique_ptr<WorkerClient>> clients;
  for (int w = 0; w < 2; ++w) {
    clients.push_back(Join(cluster, w));
    ASSERT_NE(clients.back(), nullptr);
  }
  std::vector<std::vector<float>> params(2);
  {
    std::vector<std::thread> threads;
    for (int w = 0; w < 2; ++w) {
      threads.emplace_back([&, w] {
        params[w] = w == 0 ? Seeded(1) : std::vector<float>(kN, 0.0f);
        GTOPK_EXPECT_OK(
            clients[w]->SynchronizeParameters(absl::MakeSpan(params[w])));
      });
    }
    for (auto& t : threads) t.join();
  }
  const std::vector<float> before = params[0];
  const v1::ClusterSpec spec = clients[0]->cluster();

  // Worker 0's hand-made streams: the good push to shard 1 first.
  std::vector<std::unique_ptr<v1::Aggregator::Stub>> stubs;
  std::vector<std::unique_ptr<grpc::ClientContext>> contexts;
  std::vector<std::unique_ptr<grpc::ClientReaderWriter<v1::Push, v1::Pull>>>
      streams;
  for (int s = 0; s < 2; ++s) {
    stubs.push_back(v1::Aggregator::NewStub(grpc::CreateChannel(
        spec.shards(s).address(), grpc::InsecureChannelCredentials())));
    contexts.push_back(std::make_unique<grpc::ClientContext>());
    streams.push_back(stubs[s]->PushPull(contexts[s].get()));
  }
  ASSERT_TRUE(streams[1]->Write(HandPush(spec, 0, 1, true)));
  absl::SleepFor(absl::Milliseconds(100));
  auto bad = [&] {
    ASSERT_TRUE(streams[0]->Write(HandPush(spec, 0, 0, false)));
  };
  if (GetParam().bad_first) {
    bad();
    absl::SleepFor(absl::Milliseconds(200));
  }
  absl::Status stepped;
  absl::Duration took;
  std::thread step([&] {
    const absl::Time start = absl::Now();
    stepped =
        clients[1]->Step(Seeded(101), absl::MakeSpan(params[1])).status();
    took = absl::Now() - start;
  });
  if (!GetParam().bad_first) {
    absl::SleepFor(absl::Milliseconds(200));
    bad();
  }
  step.join();
  EXPECT_THAT(stepped, StatusIs(absl::StatusCode::kAborted,
                                HasSubstr("failed on shard 0")));
  EXPECT_LT(took, kPrompt) << stepped;
  EXPECT_TRUE(BitEqual(params[1], before));
  // Worker 0's good push on shard 1 was discarded with the failed attempt:
  // its stream ends with the same news.
  const absl::Time read_start = absl::Now();
  v1::Pull pull;
  EXPECT_FALSE(streams[1]->Read(&pull));
  const grpc::Status shard1 = streams[1]->Finish();
  EXPECT_EQ(shard1.error_code(), grpc::StatusCode::ABORTED)
      << shard1.error_message();
  EXPECT_LT(absl::Now() - read_start, kPrompt) << shard1.error_message();
  contexts[0]->TryCancel();
  streams[0]->Finish().IgnoreError();
  {
    auto server = cluster.ServerParams(kN);
    ASSERT_TRUE(server.ok()) << server.status();
    EXPECT_EQ(server->second, 0);
    EXPECT_TRUE(BitEqual(server->first, before));
  }

  // Both recover and retry step 0 through the library: a fresh attempt,
  // which completes; nothing of the failed one is in it.
  std::vector<absl::Status> retry(2);
  std::vector<std::thread> again;
  for (int w = 0; w < 2; ++w) {
    again.emplace_back([&, w] {
      absl::StatusOr<int64_t> next = clients[w]->Recover(
          absl::MakeSpan(params[w]), absl::Now() + absl::Seconds(10));
      retry[w] = next.status();
      if (!next.ok()) return;
      EXPECT_EQ(*next, 0);
      retry[w] =
          clients[w]->Step(Seeded(200 + w), absl::MakeSpan(params[w])).status();
    });
  }
  for (auto& t : again) t.join();
  for (int w = 0; w < 2; ++w) {
    GTOPK_EXPECT_OK(retry[w]) << "worker " << w;
    EXPECT_EQ(clients[w]->next_step(), 1);
  }
  EXPECT_TRUE(BitEqual(params[0], params[1]));
  auto server = cluster.ServerParams(kN);
  ASSERT_TRUE(server.ok()) << server.status();
  EXPECT_EQ(server->second, 1);
  EXPECT_TRUE(BitEqual(server->first, params[0]));
}

INSTANTIATE_TEST_SUITE_P(
    Modes, FailFastTest,
    ::testing::Values(
        Case{server::AggregationMode::kGtopk, server::SelectionKind::kExact,
             false},
        Case{server::AggregationMode::kGtopk, server::SelectionKind::kExact,
             true},
        Case{server::AggregationMode::kGtopk, server::SelectionKind::kQuota,
             false},
        Case{server::AggregationMode::kTopk, server::SelectionKind::kExact,
             true}),
    [](const auto& info) {
      return absl::StrCat(server::AggregationModeName(info.param.mode), "_",
                          server::SelectionKindName(info.param.selection),
                          info.param.bad_first ? "_bad_first" : "_bad_last");
    });

}  // namespace
}  // namespace gtopk
