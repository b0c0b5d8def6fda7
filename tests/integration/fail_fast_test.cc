// Fail fast across shards (issue 13, part 5), on a real in-process cluster:
// a step that fails on one shard fails on every shard within about a round
// trip (the shard tells the leader, the leader tells the others: AbortStep),
// not at the others' step timeout; the workers' retry after Recover is a
// fresh attempt that completes, and every replica equals the servers.
#include <atomic>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/codec.h"
#include "common/epoch.h"
#include "common/status_macros.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "server/server_config.h"
#include "tests/testing/joined_workers.h"
#include "tests/testing/local_cluster.h"
#include "tests/testing/pausable_proxy.h"
#include "tests/testing/reference.h"
#include "tests/testing/status_matchers.h"
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
  return ::gtopk::testing::NormalVector(kN, seed);
}

// A running cluster of `shards` shards whose config.num_workers workers
// joined and hold the same initial parameters (Seeded(1)). `cluster` is
// declared first: the clients, which use it, go first.
struct JoinedCluster {
  std::unique_ptr<::gtopk::testing::LocalCluster> cluster;
  ::gtopk::testing::JoinedWorkers joined;
};
absl::StatusOr<JoinedCluster> StartJoined(const server::ServerConfig& config,
                                          int shards) {
  JoinedCluster c;
  GTOPK_ASSIGN_OR_RETURN(c.cluster,
                         ::gtopk::testing::LocalCluster::Start(config, shards));
  GTOPK_ASSIGN_OR_RETURN(
      c.joined,
      ::gtopk::testing::JoinAndSynchronize(
          *c.cluster, static_cast<int>(config.num_workers), Seeded(1)));
  return c;
}

// The settings of these tests' clusters: `workers` workers, density 0.01,
// step timeout `step_timeout`.
server::ServerConfig TestConfig(uint32_t workers, absl::Duration step_timeout) {
  server::ServerConfig config;
  config.num_workers = workers;
  config.optimizer.density = 0.01;
  config.step_timeout = step_timeout;
  return config;
}

using ::gtopk::testing::BitEqual;

std::unique_ptr<WorkerClient> Join(
    const ::gtopk::testing::LocalCluster& cluster, int rank) {
  ClientOptions o;
  o.leader_address = cluster.leader();
  o.requested_rank = rank;
  o.n = kN;
  o.rpc_timeout = absl::Seconds(10);
  auto c = WorkerClient::Connect(o);
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? *std::move(c) : nullptr;
}

enum class Bad { kGarbage, kNegativeStep };

// Worker `rank`'s step-0 pushes by hand: a valid one (index `begin` of the
// shard's range, value 0.5), or a bad one of kind `bad`: undecodable bytes,
// or a valid vector for step -1.
v1::Push HandPush(const v1::ClusterSpec& spec, uint64_t member_token,
                  uint32_t rank, uint32_t shard, bool valid,
                  Bad bad = Bad::kGarbage) {
  v1::Push push;
  push.set_step(0);
  push.set_rank(rank);
  push.set_shard_id(shard);
  // The joined worker's identity: a push without it is refused alone.
  push.set_member_token(member_token);
  push.set_cluster_fingerprint(spec.cluster_fingerprint());
  if (!valid && bad == Bad::kGarbage) {
    push.set_sparse("not an encoded sparse vector");
    return push;
  }
  if (!valid) push.set_step(-1);
  SparseVector one;
  one.push_back(static_cast<uint32_t>(spec.shards(shard).begin()), 0.5f);
  EXPECT_TRUE(EncodeSparse(one, kN,
                           CodecSpec{*ParseIndexCodec(spec.index_codec()),
                                     *ParseValueCodec(spec.value_codec())},
                           push.mutable_sparse())
                  .ok());
  return push;
}

// Both workers Recover (back to step 0) and retry step 0 with gradients
// Seeded(seed + w): the retry completes, the replicas equal each other and
// the servers, which are at step 1.
void ExpectRecoverAndRetryOfStepZeroComplete(
    std::vector<std::unique_ptr<WorkerClient>>& clients,
    std::vector<std::vector<float>>& params,
    ::gtopk::testing::LocalCluster& cluster, uint64_t seed) {
  std::vector<absl::Status> retry(2);
  std::vector<std::thread> again;
  for (int w = 0; w < 2; ++w) {
    again.emplace_back([&, w] {
      absl::StatusOr<int64_t> next = clients[w]->Recover(
          absl::MakeSpan(params[w]), absl::Now() + absl::Seconds(15));
      retry[w] = next.status();
      if (!next.ok()) return;
      EXPECT_EQ(*next, 0);
      retry[w] = clients[w]
                     ->Step(Seeded(seed + w), absl::MakeSpan(params[w]))
                     .status();
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

struct Case {
  AggregationMode mode;
  SelectionKind selection;
  // The bad push reaches shard 0 before the good worker pushes (no round is
  // open there yet), or after.
  bool bad_first;
  Bad bad = Bad::kGarbage;
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
  GTOPK_ASSERT_OK_AND_ASSIGN(JoinedCluster started, StartJoined(config, 2));
  ::gtopk::testing::LocalCluster& cluster = *started.cluster;
  ::gtopk::testing::JoinedWorkers& joined = started.joined;
  auto& clients = joined.clients;
  auto& params = joined.params;
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
  const uint64_t token0 = clients[0]->member_token();
  ASSERT_TRUE(streams[1]->Write(HandPush(spec, token0, 0, 1, true)));
  absl::SleepFor(absl::Milliseconds(100));
  auto bad = [&] {
    ASSERT_TRUE(
        streams[0]->Write(HandPush(spec, token0, 0, 0, false, GetParam().bad)));
  };
  if (GetParam().bad_first) {
    bad();
    absl::SleepFor(absl::Milliseconds(200));
  }
  absl::Status stepped;
  absl::Duration took;
  std::thread step([&] {
    const absl::Time start = absl::Now();
    stepped = clients[1]->Step(Seeded(101), absl::MakeSpan(params[1])).status();
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
  ExpectRecoverAndRetryOfStepZeroComplete(clients, params, cluster, 200);
}

// A failure one shard saw reaches the leader before that shard's state
// does: the Recover that reads the state answers with the failure's epoch,
// so the workers' retry is a fresh attempt. (Before the fix a shard
// answered GetShardState while its AbortStep to the leader was still
// queued; when that landed after the Recover, during the retry, it failed
// the retry as the failed attempt: ABORTED "failed on shard 1", seen once
// in CI on an overlapped step abandoned under load.) Shard 1's calls to
// the leader go through a proxy, held while the step fails there.
TEST(FailFastRecoverTest, AShardsStateComesAfterItsNewsOfAFailure) {
  GTOPK_ASSERT_OK_AND_ASSIGN(
      std::unique_ptr<::gtopk::testing::PausableProxy> proxy,
      ::gtopk::testing::PausableProxy::Start());
  auto started = ::gtopk::testing::LocalCluster::Start(
      TestConfig(2, kStepTimeout), 2, [&](server::ServerConfig& c) {
        if (c.shard_id == 1) c.peers[0] = proxy->address();
      });
  ASSERT_TRUE(started.ok()) << started.status();
  ::gtopk::testing::LocalCluster& cluster = **started;
  const std::string& leader = cluster.leader();
  proxy->set_target(std::stoi(leader.substr(leader.rfind(':') + 1)));
  GTOPK_ASSERT_OK_AND_ASSIGN(
      ::gtopk::testing::JoinedWorkers joined,
      ::gtopk::testing::JoinAndSynchronize(cluster, 2, Seeded(1)));
  auto& clients = joined.clients;
  auto& params = joined.params;
  const v1::ClusterSpec spec = clients[0]->cluster();
  auto stub = v1::Aggregator::NewStub(grpc::CreateChannel(
      spec.shards(1).address(), grpc::InsecureChannelCredentials()));

  // Worker 0's undecodable push fails step 0 on shard 1, whose news to
  // the leader (AbortStep) is held.
  proxy->Pause();
  {
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
    auto stream = stub->PushPull(&context);
    ASSERT_TRUE(
        stream->Write(HandPush(spec, clients[0]->member_token(), 0, 1, false)));
    v1::Pull pull;
    EXPECT_FALSE(stream->Read(&pull));
    EXPECT_EQ(stream->Finish().error_code(),
              grpc::StatusCode::INVALID_ARGUMENT);
  }
  // Shard 1's state, as the leader's Recover reads it: not before the
  // AbortStep has gone.
  std::atomic<bool> answered{false};
  grpc::Status state_status;
  v1::ShardState state;
  std::thread read([&] {
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
    v1::ShardStateRequest request;
    request.set_cluster_fingerprint(spec.cluster_fingerprint());
    state_status = stub->GetShardState(&context, request, &state);
    answered.store(true);
  });
  absl::SleepFor(absl::Milliseconds(500));
  EXPECT_FALSE(answered.load())
      << "shard 1 answered GetShardState while its AbortStep was held";
  proxy->Resume();
  read.join();
  EXPECT_TRUE(state_status.ok()) << state_status.error_message();
  EXPECT_EQ(state.next_step(), 0);

  // Both recover and retry step 0: a fresh attempt, which completes.
  ExpectRecoverAndRetryOfStepZeroComplete(clients, params, cluster, 300);
}

// A status travels in gRPC's trailers, which a client refuses over its
// metadata limit (8 KiB) with RESOURCE_EXHAUSTED -- not retried, so every
// worker ended. Found with a step timeout naming 1999 missing workers, and
// with a 100 KB AbortStep reason; both must reach the worker as their own
// (retryable) code with a bounded message.
TEST(LongStatusTest, StepTimeoutNamingThousandsOfWorkersStaysRetryable) {
  const server::ServerConfig config = TestConfig(2000, absl::Seconds(1));
  auto cluster = ::gtopk::testing::LocalCluster::Start(config, 1);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  std::unique_ptr<WorkerClient> client = Join(**cluster, 0);
  ASSERT_NE(client, nullptr);
  std::vector<float> params = Seeded(1);
  GTOPK_ASSERT_OK(client->SynchronizeParameters(absl::MakeSpan(params)));
  const absl::Status step =
      client->Step(Seeded(2), absl::MakeSpan(params)).status();
  EXPECT_THAT(step, StatusIs(absl::StatusCode::kDeadlineExceeded,
                             HasSubstr("waiting for worker(s) 1, 2, 3")));
  EXPECT_LT(step.message().size(), 4096u);
}

// One AbortStep call to `stub` (5 s deadline).
grpc::Status SendAbortStep(v1::Aggregator::Stub* stub, int64_t step,
                           uint32_t shard, uint64_t epoch = 0,
                           const std::string& reason = "") {
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
  v1::AbortStepRequest request;
  request.set_step(step);
  request.set_shard_id(shard);
  request.set_epoch(epoch);
  request.set_reason(reason);
  v1::AbortStepResponse response;
  return stub->AbortStep(&ctx, request, &response);
}

TEST(LongStatusTest, HugeAbortStepReasonReachesWorkersBounded) {
  const server::ServerConfig config = TestConfig(2, kStepTimeout);
  GTOPK_ASSERT_OK_AND_ASSIGN(JoinedCluster started, StartJoined(config, 2));
  ::gtopk::testing::LocalCluster& cluster = *started.cluster;
  ::gtopk::testing::JoinedWorkers& joined = started.joined;
  auto& clients = joined.clients;
  auto& params = joined.params;
  absl::Status stepped;
  absl::Duration took;
  std::thread step([&] {  // worker 0 never pushes: the step waits
    const absl::Time start = absl::Now();
    stepped = clients[1]->Step(Seeded(101), absl::MakeSpan(params[1])).status();
    took = absl::Now() - start;
  });
  absl::SleepFor(absl::Milliseconds(300));
  auto leader = v1::Aggregator::NewStub(grpc::CreateChannel(
      cluster.leader(), grpc::InsecureChannelCredentials()));
  EXPECT_TRUE(
      SendAbortStep(leader.get(), 0, 1, 0, std::string(100000, 'R')).ok());
  step.join();
  EXPECT_THAT(stepped, StatusIs(absl::StatusCode::kAborted,
                                HasSubstr("failed on shard 1: RRRR")));
  EXPECT_LT(stepped.message().size(), 8192u);
  EXPECT_LT(took, kPrompt);
}

// An AbortStep epoch far in the future (found: 2^64 - 1 sent to a shard)
// would make every later push "newer than any failure" and switch the
// failed-attempt checks off for the rest of the run: shards refuse it.
// A two-shard cluster of one worker that never joins, and a client of each
// shard.
class AbortStepInputTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto cluster = ::gtopk::testing::LocalCluster::Start(
        TestConfig(1, absl::Seconds(5)), 2);
    ASSERT_TRUE(cluster.ok()) << cluster.status();
    cluster_ = *std::move(cluster);
    leader_ = v1::Aggregator::NewStub(grpc::CreateChannel(
        cluster_->leader(), grpc::InsecureChannelCredentials()));
    shard1_ = v1::Aggregator::NewStub(grpc::CreateChannel(
        cluster_->peers()[1], grpc::InsecureChannelCredentials()));
  }

  std::unique_ptr<::gtopk::testing::LocalCluster> cluster_;
  std::unique_ptr<v1::Aggregator::Stub> leader_, shard1_;
};

TEST_F(AbortStepInputTest, FarFutureEpochIsRefusedByAShard) {
  for (const uint64_t epoch :
       {~uint64_t{0}, static_cast<uint64_t>(
                          absl::ToUnixMicros(absl::Now() + absl::Hours(48)))}) {
    const grpc::Status st = SendAbortStep(shard1_.get(), 0, 0, epoch);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << epoch;
    EXPECT_NE(st.error_message().find("more than a day ahead"),
              std::string::npos)
        << st.error_message();
  }
  EXPECT_TRUE(IsPlausibleEpoch(
      static_cast<uint64_t>(absl::ToUnixMicros(absl::Now())) + 1000));
}

// Found by a break-it run: 400,000 AbortStep calls for steps 5,000,000 and
// up (claiming shard 1, --tls=off) each left the leader a tombstone and a
// queued forward to every shard: 257 MB never released, minutes of
// forwarding, Recover failing meanwhile. The leader refuses a step far
// past its next one, and forwards a step's failure once however often it
// is reported (the same step, a later report, updates the queued forward).
TEST_F(AbortStepInputTest, AStepFarPastTheLeadersIsRefused) {
  for (const int64_t step :
       {int64_t{17}, int64_t{5000000}, std::numeric_limits<int64_t>::max()}) {
    const grpc::Status st = SendAbortStep(leader_.get(), step, 1, 0, "hostile");
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << step;
    EXPECT_NE(st.error_message().find(
                  "steps past the leader's next step 0 (a shard fails the "
                  "step it is at)"),
              std::string::npos)
        << st.error_message();
  }
  // Within the window (the leader's next step is 0): taken, as before, and
  // as often as it is sent.
  for (int i = 0; i < 50; ++i) {
    EXPECT_TRUE(SendAbortStep(leader_.get(), 16, 1).ok());
  }
}

// The same window below the leader's next step (a second break-it run sent
// 60,000 reports of old steps): after 20 steps, step 3 is refused and
// step 19 (committed: nothing to abort) is answered OK as before.
TEST(AbortStepWindowTest, AStepLongBeforeTheLeadersIsRefused) {
  GTOPK_ASSERT_OK_AND_ASSIGN(JoinedCluster started,
                             StartJoined(TestConfig(1, absl::Seconds(5)), 2));
  auto& client = started.joined.clients[0];
  auto& params = started.joined.params[0];
  for (int step = 0; step < 20; ++step) {
    GTOPK_ASSERT_OK(
        client->Step(Seeded(300 + step), absl::MakeSpan(params)).status());
  }
  auto leader = v1::Aggregator::NewStub(grpc::CreateChannel(
      started.cluster->leader(), grpc::InsecureChannelCredentials()));
  const grpc::Status old = SendAbortStep(leader.get(), 3, 1);
  EXPECT_EQ(old.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(old.error_message().find(
                "step 3 is more than 16 steps before the leader's next step "
                "20"),
            std::string::npos)
      << old.error_message();
  EXPECT_TRUE(SendAbortStep(leader.get(), 19, 1).ok());
  // Training goes on.
  GTOPK_EXPECT_OK(client->Step(Seeded(400), absl::MakeSpan(params)).status());
}

// Found by a break-it run: on a --tls=off cluster any client can claim to
// be shard 1, and its calls to the leader filled shard 1's bucket of
// --max-calls-per-peer; the real shard 1's calls were refused with
// RESOURCE_EXHAUSTED, which reached the workers, which do not retry it:
// every worker exited. Here two CommitStep votes claiming shard 1 for a
// step nobody reaches wait at the leader (they are admitted and held) and
// fill that bucket (bound 2) while both workers step. The shard repeats its
// refused calls within the deadline (CallUntilAdmitted): the step is
// delayed until the holders' deadline, not failed.
TEST(ShardCallAdmissionTest, RefusedShardCallsDelayTheStepInsteadOfEndingIt) {
  server::ServerConfig config = TestConfig(2, absl::Seconds(10));
  config.max_calls_per_peer = 2;
  GTOPK_ASSERT_OK_AND_ASSIGN(JoinedCluster started, StartJoined(config, 2));
  ::gtopk::testing::LocalCluster& cluster = *started.cluster;
  ::gtopk::testing::JoinedWorkers& joined = started.joined;
  auto leader = v1::Aggregator::NewStub(grpc::CreateChannel(
      cluster.leader(), grpc::InsecureChannelCredentials()));
  v1::ClusterSpec spec;
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
    ASSERT_TRUE(leader->GetClusterSpec(&ctx, v1::JoinRequest(), &spec).ok());
  }
  constexpr absl::Duration kHold = absl::Milliseconds(1500);
  std::vector<grpc::Status> held(2);
  std::vector<std::thread> holders;
  for (int i = 0; i < 2; ++i) {
    holders.emplace_back([&, i] {
      grpc::ClientContext ctx;
      ctx.set_deadline(absl::ToChronoTime(absl::Now() + kHold));
      v1::CommitRequest request;
      request.set_step(1000 + i);
      request.set_shard_id(1);
      request.set_cluster_fingerprint(spec.cluster_fingerprint());
      v1::CommitResponse response;
      held[i] = leader->CommitStep(&ctx, request, &response);
    });
  }
  absl::SleepFor(absl::Milliseconds(300));  // both admitted and waiting
  auto& clients = joined.clients;
  auto& params = joined.params;
  std::vector<absl::Status> stepped(2);
  std::vector<std::thread> steps;
  const absl::Time start = absl::Now();
  for (int w = 0; w < 2; ++w) {
    steps.emplace_back([&, w] {
      stepped[w] =
          clients[w]->Step(Seeded(200 + w), absl::MakeSpan(params[w])).status();
    });
  }
  for (auto& t : steps) t.join();
  const absl::Duration took = absl::Now() - start;
  for (auto& t : holders) t.join();
  // The holders were admitted and held to their deadline: the bucket was
  // full while the step ran.
  for (const grpc::Status& h : held) {
    EXPECT_EQ(h.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED)
        << h.error_message();
  }
  for (int w = 0; w < 2; ++w) GTOPK_EXPECT_OK(stepped[w]) << "worker " << w;
  EXPECT_EQ(params[0], params[1]);
  // Delayed until the holders let go, well within the step timeout.
  EXPECT_GE(took, absl::Milliseconds(500));
  EXPECT_LT(took, config.step_timeout);
}

INSTANTIATE_TEST_SUITE_P(
    Modes, FailFastTest,
    ::testing::Values(
        Case{AggregationMode::kGtopk, SelectionKind::kThreshold, false},
        Case{AggregationMode::kGtopk, SelectionKind::kThreshold, true},
        Case{AggregationMode::kGtopk, SelectionKind::kQuota, false},
        Case{AggregationMode::kTopk, SelectionKind::kThreshold, true},
        // A push for a negative step (it returned before failing the round:
        // the others waited for their step timeout).
        Case{AggregationMode::kGtopk, SelectionKind::kThreshold, false,
             Bad::kNegativeStep},
        Case{AggregationMode::kGtopk, SelectionKind::kQuota, true,
             Bad::kNegativeStep}),
    [](const auto& info) {
      return absl::StrCat(
          AggregationModeName(info.param.mode), "_",
          SelectionKindName(info.param.selection),
          info.param.bad_first ? "_bad_first" : "_bad_last",
          info.param.bad == Bad::kNegativeStep ? "_negative_step" : "");
    });

}  // namespace
}  // namespace gtopk
