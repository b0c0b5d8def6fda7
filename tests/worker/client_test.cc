// WorkerClient against a scripted single-shard gRPC fake (in this file): the
// client's own behaviour — option checks, the step watchdog, error codes and
// shard names, and that a failed step loses nothing. The real servers are
// exercised in tests/integration/.
#include "worker/client.h"

#include <atomic>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/codec.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace gtopk {
namespace worker {
namespace {

using ::gtopk::testing::StatusIs;
using ::testing::HasSubstr;

constexpr uint64_t kN = 100;

// One shard, P = 1, n = 100, density 0.1, lr 1, no momentum, fp32: the
// pull a real shard would send is the worker's own push (the sum over one
// worker, whose k entries are the global top-k).
class FakeShard final : public v1::Aggregator::Service {
 public:
  enum class Behaviour {
    kEcho,
    kStall,
    kAbort,
    kWrongStep,
    kTooLarge,  // gRPC's own refusal of an oversized message
    kRefused,   // RESOURCE_EXHAUSTED for another reason (a server bound)
  };

  std::atomic<Behaviour> behaviour{Behaviour::kEcho};
  // Join describes a layer-wise cluster (buckets of 50 values: two pieces),
  // which the fake serves as a server from before the rounds per bucket
  // did: every Push a whole push, answered by one Pull without
  // Pull.committed.
  std::atomic<bool> layerwise{false};
  std::string address;
  std::atomic<int> pushes{0};

  grpc::Status Join(grpc::ServerContext*, const v1::JoinRequest* request,
                    v1::JoinResponse* response) override {
    response->set_rank(0);
    v1::ClusterSpec* c = response->mutable_cluster();
    c->set_n(kN);
    c->set_num_workers(1);
    v1::ShardSpec* s = c->add_shards();
    s->set_shard_id(0);
    s->set_address(address);
    s->set_begin(0);
    s->set_end(kN);
    c->set_mode(v1::MODE_GTOPK);
    c->set_selection(layerwise.load() ? v1::SELECTION_LAYERWISE
                                      : v1::SELECTION_THRESHOLD);
    if (layerwise.load()) c->set_bucket_size(50);
    c->set_selector("exact");
    c->set_index_codec("delta-varint");
    c->set_value_codec("fp32");
    c->mutable_optimizer()->set_lr(1.0f);
    c->mutable_optimizer()->set_momentum(0.0f);
    c->mutable_optimizer()->set_momentum_mode(v1::MOMENTUM_MODE_NONE);
    c->mutable_optimizer()->set_density(0.1);
    c->set_step_timeout_ms(300);
    c->set_max_message_bytes(4 << 20);
    if (request->n() != kN) {
      return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, "bad n");
    }
    return grpc::Status::OK;
  }

  grpc::Status PushPull(
      grpc::ServerContext* context,
      grpc::ServerReaderWriter<v1::Pull, v1::Push>* stream) override {
    // As the real leader does for a worker's identified stream: the client
    // waits for it at Connect.
    stream->SendInitialMetadata();
    v1::Push push;
    while (stream->Read(&push)) {
      ++pushes;
      switch (behaviour.load()) {
        case Behaviour::kStall:
          while (!context->IsCancelled()) {
            absl::SleepFor(absl::Milliseconds(5));
          }
          return grpc::Status(grpc::StatusCode::CANCELLED, "cancelled");
        case Behaviour::kAbort:
          return grpc::Status(grpc::StatusCode::ABORTED,
                              absl::StrCat("step ", push.step(),
                                           " failed on shard 0: worker 7"));
        case Behaviour::kTooLarge:
          return grpc::Status(
              grpc::StatusCode::RESOURCE_EXHAUSTED,
              "Received message larger than max (5000000 vs. 4194304)");
        case Behaviour::kRefused:
          return grpc::Status(
              grpc::StatusCode::RESOURCE_EXHAUSTED,
              "step 0 failed on shard 1: leader (ExchangeThreshold): "
              "ExchangeThreshold refused: 2 calls from peer shard 1 are in "
              "flight, the bound --max-calls-per-peer=2; retry later");
        case Behaviour::kWrongStep:
        case Behaviour::kEcho: {
          v1::Pull pull;
          pull.set_step(behaviour.load() == Behaviour::kWrongStep
                            ? push.step() + 1
                            : push.step());
          pull.set_shard_id(0);
          pull.set_sparse(push.sparse());
          stream->Write(pull);
          break;
        }
      }
    }
    return grpc::Status::OK;
  }
};

class ClientFakeTest : public ::testing::Test {
 protected:
  void SetUp() override {
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(),
                             &port);
    builder.RegisterService(&fake_);
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    fake_.address = absl::StrCat("127.0.0.1:", port);
  }
  void TearDown() override {
    client_.reset();
    server_->Shutdown(std::chrono::system_clock::now() +
                      std::chrono::seconds(1));
  }

  void Connect() {
    ClientOptions o;
    o.leader_address = fake_.address;
    o.n = kN;
    o.rpc_timeout = absl::Seconds(5);
    o.step_watchdog_margin = absl::Milliseconds(200);
    auto c = WorkerClient::Connect(o);
    ASSERT_TRUE(c.ok()) << c.status();
    client_ = *std::move(c);
  }

  FakeShard fake_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<WorkerClient> client_;
};

std::vector<float> Ramp(float scale) {
  std::vector<float> g(kN);
  for (uint64_t i = 0; i < kN; ++i) g[i] = scale * static_cast<float>(i + 1);
  return g;
}

TEST(ClientOptionsTest, BadOptionsAreRejected) {
  ClientOptions o;
  o.n = 10;
  EXPECT_THAT(WorkerClient::Connect(o).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("leader_address")));
  o.leader_address = "127.0.0.1:1";
  o.n = 0;
  EXPECT_THAT(WorkerClient::Connect(o).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("n = 0")));
  o.n = 10;
  o.requested_rank = -2;
  EXPECT_THAT(WorkerClient::Connect(o).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("requested_rank")));
}

TEST(ClientOptionsTest, UnreachableLeaderFailsWithinTheTimeoutNamingIt) {
  ClientOptions o;
  o.leader_address = "127.0.0.1:1";  // nothing listens on port 1
  o.n = 10;
  o.rpc_timeout = absl::Milliseconds(300);
  const absl::Time start = absl::Now();
  auto c = WorkerClient::Connect(o);
  EXPECT_LT(absl::Now() - start, absl::Seconds(3));
  ASSERT_FALSE(c.ok());
  EXPECT_THAT(c.status(), StatusIs(absl::StatusCode::kDeadlineExceeded,
                                   HasSubstr("leader 127.0.0.1:1")));
}

TEST(ClientOptionsTest, SelectorSeedsDifferByRankAndRepeat) {
  EXPECT_EQ(WorkerClient::SelectorSeedForRank(5, 0),
            WorkerClient::SelectorSeedForRank(5, 0));
  EXPECT_NE(WorkerClient::SelectorSeedForRank(5, 0),
            WorkerClient::SelectorSeedForRank(5, 1));
  EXPECT_NE(WorkerClient::SelectorSeedForRank(5, 0),
            WorkerClient::SelectorSeedForRank(6, 0));
}

TEST_F(ClientFakeTest, WrongParameterCountIsRejectedByJoin) {
  ClientOptions o;
  o.leader_address = fake_.address;
  o.n = kN + 1;
  EXPECT_THAT(WorkerClient::Connect(o).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("Join: bad n")));
}

TEST_F(ClientFakeTest, EchoStepAppliesTheTopK) {
  Connect();
  EXPECT_EQ(client_->rank(), 0u);
  EXPECT_EQ(client_->cluster().n(), kN);
  std::vector<float> params(kN, 0.0f);
  const std::vector<float> g = Ramp(1.0f);
  auto stats = client_->Step(g, absl::MakeSpan(params));
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_EQ(stats->step, 0);
  EXPECT_EQ(stats->k, 10u);
  EXPECT_EQ(stats->sent_pairs, 10u);
  EXPECT_EQ(stats->received_pairs, 10u);
  ASSERT_EQ(stats->bytes_sent.size(), 1u);
  EXPECT_GT(stats->bytes_sent[0], 0u);
  for (uint64_t i = 0; i < kN; ++i) {
    EXPECT_EQ(params[i], i >= 90 ? -g[i] : 0.0f) << i;
  }
  EXPECT_EQ(client_->next_step(), 1);
}

// A new worker's overlapped step against a server that predates the rounds
// per bucket (it takes each part for a whole push, and its pull has no
// Pull.committed): refused, naming the cause, and nothing applied.
TEST_F(ClientFakeTest, AServerThatPredatesPiecePullsIsRefusedNotApplied) {
  fake_.layerwise = true;
  Connect();
  std::vector<float> params(kN, 0.0f);
  const std::vector<float> g = Ramp(1.0f);
  GTOPK_ASSERT_OK(client_->BeginOverlappedStep(g, absl::MakeSpan(params)));
  GTOPK_ASSERT_OK(client_->GradientReady(50, kN));
  GTOPK_ASSERT_OK(client_->GradientReady(0, 50));
  EXPECT_THAT(client_->FinishOverlappedStep().status(),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("predates the rounds per bucket")));
  EXPECT_EQ(params, std::vector<float>(kN, 0.0f));
  EXPECT_EQ(client_->next_step(), 0);
}

TEST_F(ClientFakeTest, StalledShardIsCancelledNamedAndNothingIsLost) {
  Connect();
  std::vector<float> params(kN, 0.0f);
  fake_.behaviour = FakeShard::Behaviour::kStall;
  const absl::Time start = absl::Now();
  auto stats = client_->Step(Ramp(1.0f), absl::MakeSpan(params));
  const absl::Duration took = absl::Now() - start;
  EXPECT_THAT(stats.status(),
              StatusIs(absl::StatusCode::kDeadlineExceeded,
                       HasSubstr(absl::StrCat("shard 0 (", fake_.address,
                                              "): no pull for step 0"))));
  EXPECT_GE(took, absl::Milliseconds(450));
  EXPECT_LT(took, absl::Seconds(3));
  EXPECT_EQ(params, std::vector<float>(kN, 0.0f));
  EXPECT_EQ(client_->next_step(), 0);

  // The retry reopens the stream; the first gradient is still in the
  // residual, so u = 1*ramp + 2*ramp = 3*ramp (exact in float).
  fake_.behaviour = FakeShard::Behaviour::kEcho;
  stats = client_->Step(Ramp(2.0f), absl::MakeSpan(params));
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_EQ(stats->step, 0);
  const std::vector<float> u = Ramp(3.0f);
  for (uint64_t i = 0; i < kN; ++i) {
    EXPECT_EQ(params[i], i >= 90 ? -u[i] : 0.0f) << i;
  }
}

TEST_F(ClientFakeTest, ServerStatusKeepsItsCodeAndNamesTheShard) {
  Connect();
  std::vector<float> params(kN, 0.0f);
  fake_.behaviour = FakeShard::Behaviour::kAbort;
  auto stats = client_->Step(Ramp(1.0f), absl::MakeSpan(params));
  EXPECT_THAT(stats.status(),
              StatusIs(absl::StatusCode::kAborted,
                       HasSubstr(absl::StrCat("shard 0 (", fake_.address,
                                              "): step 0 failed on shard 0"))));
  EXPECT_EQ(params, std::vector<float>(kN, 0.0f));
  fake_.behaviour = FakeShard::Behaviour::kEcho;
  GTOPK_ASSERT_OK(
      client_->Step(std::vector<float>(kN, 0.0f), absl::MakeSpan(params)));
  const std::vector<float> u = Ramp(1.0f);
  for (uint64_t i = 0; i < kN; ++i) {
    EXPECT_EQ(params[i], i >= 90 ? -u[i] : 0.0f) << i;
  }
}

// RESOURCE_EXHAUSTED from a step says which limit to raise only when it is
// gRPC's message-size refusal; any other (a server's call bounds, found
// by a break-it run: "ExchangeThreshold refused: 2 calls from peer shard
// 1 ...") keeps its own message without that advice.
TEST_F(ClientFakeTest, OnlyAMessageSizeRefusalNamesMaxMessageBytes) {
  Connect();
  std::vector<float> params(kN, 0.0f);
  fake_.behaviour = FakeShard::Behaviour::kTooLarge;
  EXPECT_THAT(client_->Step(Ramp(1.0f), absl::MakeSpan(params)).status(),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       HasSubstr("exceeds the cluster's max_message_bytes")));
  fake_.behaviour = FakeShard::Behaviour::kRefused;
  const absl::Status refused =
      client_->Step(Ramp(1.0f), absl::MakeSpan(params)).status();
  EXPECT_THAT(refused, StatusIs(absl::StatusCode::kResourceExhausted,
                                HasSubstr("--max-calls-per-peer=2")));
  EXPECT_THAT(refused.message(),
              ::testing::Not(HasSubstr("max_message_bytes")));
  EXPECT_EQ(params, std::vector<float>(kN, 0.0f));
}

TEST_F(ClientFakeTest, MalformedPullIsInternalAndNotApplied) {
  Connect();
  std::vector<float> params(kN, 0.0f);
  fake_.behaviour = FakeShard::Behaviour::kWrongStep;
  EXPECT_THAT(
      client_->Step(Ramp(1.0f), absl::MakeSpan(params)).status(),
      StatusIs(absl::StatusCode::kInternal, HasSubstr("pull is for step 1")));
  EXPECT_EQ(params, std::vector<float>(kN, 0.0f));
  EXPECT_EQ(client_->next_step(), 0);
}

TEST_F(ClientFakeTest, WrongLengthsAreRejectedBeforeAnything) {
  Connect();
  std::vector<float> params(kN, 0.0f);
  std::vector<float> short_grad(kN - 1, 1.0f);
  EXPECT_THAT(client_->Step(short_grad, absl::MakeSpan(params)).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("gradient has 99 values")));
  std::vector<float> nan_grad(kN, 0.0f);
  nan_grad[3] = NAN;
  EXPECT_THAT(
      client_->Step(nan_grad, absl::MakeSpan(params)).status(),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("gradient")));
  EXPECT_EQ(fake_.pushes.load(), 0);
}

// The device Step is declared in every build (WorkerClient's layout does
// not depend on GTOPK_HAVE_CUDA); without CUDA it checks its arguments,
// then answers FAILED_PRECONDITION and changes nothing. (With CUDA it runs:
// tests/worker/client_cuda_test.cc.)
#if !GTOPK_HAVE_CUDA
TEST_F(ClientFakeTest, DeviceStepWithoutCudaIsFailedPrecondition) {
  Connect();
  std::vector<float> params(kN, 0.0f);
  const std::vector<float> g = Ramp(1.0f);
  EXPECT_THAT(client_->Step(g.data(), params.data(), kN - 1, nullptr).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("Step (device): n = 99")));
  // Host pointers: nothing may read them in a build without CUDA.
  EXPECT_THAT(client_->Step(g.data(), params.data(), kN, nullptr).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("built without CUDA")));
  EXPECT_EQ(params, std::vector<float>(kN, 0.0f));
  EXPECT_EQ(client_->next_step(), 0);
  EXPECT_EQ(fake_.pushes.load(), 0);
  // The host Step still works, from the untouched state.
  GTOPK_ASSERT_OK(client_->Step(g, absl::MakeSpan(params)));
  EXPECT_EQ(client_->next_step(), 1);
}
#endif

// ExportState/ImportState: a client restored from another's state after
// the same steps continues exactly as the original does (same pushes, same
// parameters), because residual and step are the whole worker state here
// (no momentum).
TEST_F(ClientFakeTest, ImportedStateContinuesBitIdentically) {
  Connect();
  std::vector<float> params(kN, 0.0f);
  ASSERT_TRUE(client_->Step(Ramp(1.0f), absl::MakeSpan(params)).ok());
  GTOPK_ASSERT_OK_AND_ASSIGN(WorkerState saved, client_->ExportState());
  EXPECT_EQ(saved.next_step, 1);
  ASSERT_EQ(saved.residual.size(), kN);
  // The residual keeps what was not sent: the 90 smallest entries.
  EXPECT_EQ(saved.residual[0], 1.0f);
  EXPECT_EQ(saved.residual[95], 0.0f);
  std::vector<float> params_b = params;
  ASSERT_TRUE(client_->Step(Ramp(0.5f), absl::MakeSpan(params)).ok());

  // A second client (the fake serves any number), moved to step 1 by a
  // step of its own, then given the saved state.
  std::unique_ptr<WorkerClient> original = std::move(client_);
  Connect();
  std::vector<float> scratch(kN, 0.0f);
  ASSERT_TRUE(client_->Step(Ramp(3.0f), absl::MakeSpan(scratch)).ok());
  GTOPK_ASSERT_OK(client_->ImportState(saved));
  ASSERT_TRUE(client_->Step(Ramp(0.5f), absl::MakeSpan(params_b)).ok());
  EXPECT_EQ(std::memcmp(params.data(), params_b.data(), kN * sizeof(float)), 0);
  GTOPK_ASSERT_OK_AND_ASSIGN(WorkerState a, original->ExportState());
  GTOPK_ASSERT_OK_AND_ASSIGN(WorkerState b, client_->ExportState());
  EXPECT_EQ(a.residual, b.residual);
  EXPECT_EQ(a.next_step, b.next_step);
}

TEST_F(ClientFakeTest, ImportStateRejectsBadStateAndChangesNothing) {
  Connect();
  GTOPK_ASSERT_OK_AND_ASSIGN(WorkerState good, client_->ExportState());
  WorkerState bad = good;
  bad.residual.pop_back();
  EXPECT_THAT(client_->ImportState(bad),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("residual has 99 values")));
  bad = good;
  bad.velocity[7] = INFINITY;
  EXPECT_THAT(
      client_->ImportState(bad),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("velocity")));
  bad = good;
  bad.residual[0] = 5.0f;
  bad.next_step = 4;
  EXPECT_THAT(client_->ImportState(bad),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("servers are at step 0 but the state is "
                                 "from step 4")));
  GTOPK_ASSERT_OK_AND_ASSIGN(WorkerState after, client_->ExportState());
  EXPECT_EQ(after.residual, good.residual);  // nothing changed
}

}  // namespace
}  // namespace worker
}  // namespace gtopk
