// WorkerClient against a scripted single-shard gRPC fake (in this file): the
// client's own behaviour — option checks, the step watchdog, error codes and
// shard names, and that a failed step loses nothing. The real servers are
// exercised in tests/integration/.
#include "worker/client.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/codec.h"
#include "common/status_macros.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace gtopk {
namespace worker {
namespace {

using ::gtopk::testing::StatusIs;
using ::testing::AllOf;
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
  // The fake says it takes pushes in parts (ShardSpec.takes_push_parts, in
  // its own entry), whether it does or not.
  std::atomic<bool> advertise_parts{false};
  // This fake's shard id, and every shard's address (one shard: this
  // fake's; two: [0, 50) and [50, 100)). Set before a client connects.
  uint32_t id = 0;
  std::vector<std::string> addresses;
  std::string address;  // addresses[id]
  std::atomic<int> pushes{0};
  std::atomic<int> parts{0};  // pushes with Push.piece_end set
  // The cluster's n and, layer-wise, its bucket size, as Join and
  // GetClusterSpec say (a fake that predates the bound on the pieces).
  std::atomic<uint64_t> n{kN};
  std::atomic<uint64_t> bucket_size{50};

  // The cluster spec as this fake answers it: its own entry's
  // takes_push_parts as advertise_parts says, the others' false.
  v1::ClusterSpec Spec() const {
    v1::ClusterSpec c;
    const uint64_t size = n.load();
    c.set_n(size);
    c.set_num_workers(1);
    for (size_t i = 0; i < addresses.size(); ++i) {
      v1::ShardSpec* s = c.add_shards();
      s->set_shard_id(static_cast<uint32_t>(i));
      s->set_address(addresses[i]);
      s->set_begin(size * i / addresses.size());
      s->set_end(size * (i + 1) / addresses.size());
      s->set_takes_push_parts(i == id && advertise_parts.load());
    }
    c.set_mode(v1::MODE_GTOPK);
    c.set_selection(layerwise.load() ? v1::SELECTION_LAYERWISE
                                     : v1::SELECTION_THRESHOLD);
    if (layerwise.load()) c.set_bucket_size(bucket_size.load());
    c.set_selector("exact");
    c.set_index_codec("delta-varint");
    c.set_value_codec("fp32");
    c.mutable_optimizer()->set_lr(1.0f);
    c.mutable_optimizer()->set_momentum(0.0f);
    c.mutable_optimizer()->set_momentum_mode(v1::MOMENTUM_MODE_NONE);
    c.mutable_optimizer()->set_density(0.1);
    c.set_step_timeout_ms(300);
    c.set_max_message_bytes(4 << 20);
    return c;
  }

  grpc::Status Join(grpc::ServerContext*, const v1::JoinRequest* request,
                    v1::JoinResponse* response) override {
    response->set_rank(0);
    *response->mutable_cluster() = Spec();
    if (request->n() != n.load()) {
      return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, "bad n");
    }
    return grpc::Status::OK;
  }

  grpc::Status GetClusterSpec(grpc::ServerContext*, const v1::JoinRequest*,
                              v1::ClusterSpec* response) override {
    if (spec_failures.load() > 0) {
      --spec_failures;
      return grpc::Status(grpc::StatusCode::UNAVAILABLE,
                          "leader (GetClusterSpec): failed to connect");
    }
    *response = Spec();
    return grpc::Status::OK;
  }
  // The next GetClusterSpec calls that fail (UNAVAILABLE), as a shard's
  // right after its leader restarted.
  std::atomic<int> spec_failures{0};

  // Every Recover answers that the failed step is the next one (nothing
  // to roll back or download).
  grpc::Status Recover(grpc::ServerContext*, const v1::RecoverRequest* request,
                       v1::RecoverResponse* response) override {
    response->set_next_step(request->failed_step());
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
      if (push.piece_end() > 0) ++parts;
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
          pull.set_shard_id(id);
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
    fake_.addresses = {absl::StrCat("127.0.0.1:", port)};
    fake_.address = fake_.addresses[0];
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

// Captures stderr from construction to Take (or destruction, when an
// assertion returned first: gtest's capture must be ended before the next
// one starts).
class StderrCapture {
 public:
  StderrCapture() { ::testing::internal::CaptureStderr(); }
  ~StderrCapture() {
    if (!taken_) ::testing::internal::GetCapturedStderr();
  }
  std::string Take() {
    taken_ = true;
    return ::testing::internal::GetCapturedStderr();
  }

 private:
  bool taken_ = false;
};

// What the overlapped layer-wise step must give here (P = 1, n = 100, two
// pieces of 50 at k = 10: k_p = 5 each; lr 1, no momentum; the shard's
// sum is the worker's own push): each piece's 5 largest |g|, applied as
// params -= g there, 0 elsewhere.
std::vector<float> PlainLayerwiseUpdate(const std::vector<float>& g) {
  std::vector<float> params(kN, 0.0f);
  for (uint64_t i = 0; i < kN; ++i) {
    if ((i >= 45 && i < 50) || i >= 95) params[i] = -g[i];
  }
  return params;
}

// One overlapped host step of `g` on `params`, its gradient reported as a
// backward pass would: the second piece [50, n) first, then [0, 50).
absl::StatusOr<worker::StepStats> OverlappedStepBackToFront(
    WorkerClient& client, const std::vector<float>& g,
    std::vector<float>& params) {
  GTOPK_RETURN_IF_ERROR(client.BeginOverlappedStep(g, absl::MakeSpan(params)));
  GTOPK_RETURN_IF_ERROR(client.GradientReady(50, kN));
  GTOPK_RETURN_IF_ERROR(client.GradientReady(0, 50));
  return client.FinishOverlappedStep();
}

// A leader that predates the bound on the bucket pieces (kMaxBucketPieces,
// common/buckets.h) hands out a layer-wise spec of one-value buckets for a
// model of 200,000 parameters: the worker refuses it at Connect, naming
// --bucket-mb, the count, the bound and the smallest value that fits,
// before any step (whose every piece would be its own round).
TEST_F(ClientFakeTest, TooManyBucketPiecesAreRefusedAtConnect) {
  fake_.layerwise = true;
  fake_.n = 200000;
  fake_.bucket_size = 1;
  ClientOptions o;
  o.leader_address = fake_.address;
  o.n = 200000;
  o.rpc_timeout = absl::Seconds(5);
  EXPECT_THAT(
      WorkerClient::Connect(o).status(),
      StatusIs(absl::StatusCode::kFailedPrecondition,
               AllOf(HasSubstr("leader " + fake_.address),
                     HasSubstr("--bucket-mb 4e-06 (buckets of 1 values) cuts "
                               "the model's n = 200000 parameters into 200000 "
                               "bucket pieces, more than the 65536"),
                     HasSubstr("at least 1.6e-05 (4 values)"))));
  // Buckets of 4 values: 50,000 pieces, taken.
  fake_.bucket_size = 4;
  GTOPK_EXPECT_OK(WorkerClient::Connect(o).status());
}

// A new worker's overlapped step against a server that says it takes
// pushes in parts but predates the rounds per bucket (e.g. a shard
// replaced by an older server after Connect: it takes each part for a
// whole push, and its pull has no Pull.committed): refused, naming the
// cause, and nothing applied (the second line of defence).
TEST_F(ClientFakeTest, AServerThatPredatesPiecePullsIsRefusedNotApplied) {
  fake_.layerwise = true;
  fake_.advertise_parts = true;
  Connect();
  EXPECT_TRUE(client_->servers_take_push_parts());
  std::vector<float> params(kN, 0.0f);
  const std::vector<float> g = Ramp(1.0f);
  EXPECT_THAT(OverlappedStepBackToFront(*client_, g, params).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("predates the rounds per bucket")));
  EXPECT_EQ(params, std::vector<float>(kN, 0.0f));
  EXPECT_EQ(client_->next_step(), 0);
}

// Each Recover asks the shards again whether they take pushes in parts: a
// shard restarted with an older server (it no longer says so) gets whole
// pushes after the Recover, and the overlapped step completes with the
// plain layer-wise result; upgraded again, parts again after the next one.
TEST_F(ClientFakeTest, RecoverAsksAgainWhetherTheServersTakeParts) {
  fake_.layerwise = true;
  fake_.advertise_parts = true;
  Connect();
  EXPECT_TRUE(client_->servers_take_push_parts());
  fake_.advertise_parts = false;  // replaced by an older server
  std::vector<float> params(kN, 0.0f);
  GTOPK_ASSERT_OK(client_->Recover(absl::MakeSpan(params)).status());
  EXPECT_FALSE(client_->servers_take_push_parts());
  const std::vector<float> g = Ramp(1.0f);
  auto stats = OverlappedStepBackToFront(*client_, g, params);
  GTOPK_ASSERT_OK(stats.status());
  EXPECT_EQ(stats->parts_sent, 0u);
  EXPECT_EQ(fake_.parts.load(), 0);
  const std::vector<float> want = PlainLayerwiseUpdate(g);
  EXPECT_EQ(std::memcmp(params.data(), want.data(), kN * sizeof(float)), 0);
  fake_.advertise_parts = true;  // upgraded
  GTOPK_ASSERT_OK(client_->Recover(absl::MakeSpan(params)).status());
  EXPECT_TRUE(client_->servers_take_push_parts());
}

// An answer that fails right after a Recover (break-it run: a shard's
// channel to a leader that had just restarted still failed for about a
// second) is asked again: the worker goes on pushing in parts instead of
// whole for the rest of the run (before: servers_take_push_parts() false
// after this Recover).
TEST_F(ClientFakeTest, AFailedAnswerAboutPartsIsAskedAgain) {
  fake_.layerwise = true;
  fake_.advertise_parts = true;
  Connect();
  ASSERT_TRUE(client_->servers_take_push_parts());
  fake_.spec_failures = 2;
  std::vector<float> params(kN, 0.0f);
  GTOPK_ASSERT_OK(client_->Recover(absl::MakeSpan(params)).status());
  EXPECT_EQ(fake_.spec_failures.load(), 0);
  EXPECT_TRUE(client_->servers_take_push_parts());
}

// A server that does not say it takes pushes in parts (one from before
// the rounds per bucket) gets whole pushes from the overlapped step, which
// then completes: its parameters and residual are the plain layer-wise
// reference's and bit-identical to the plain Step's, over two steps, and
// stderr says so once.
TEST_F(ClientFakeTest, AServerWithoutPartsGetsWholePushesBitIdenticalToStep) {
  fake_.layerwise = true;
  Connect();
  EXPECT_FALSE(client_->servers_take_push_parts());
  std::unique_ptr<WorkerClient> overlapped = std::move(client_);
  Connect();
  std::unique_ptr<WorkerClient> plain = std::move(client_);
  std::vector<float> params(kN, 0.0f), plain_params(kN, 0.0f);
  StderrCapture captured;
  for (int step = 0; step < 2; ++step) {
    const std::vector<float> g = Ramp(step == 0 ? 1.0f : 0.5f);
    const int before = fake_.pushes.load();
    auto stats = OverlappedStepBackToFront(*overlapped, g, params);
    GTOPK_ASSERT_OK(stats.status());
    EXPECT_EQ(stats->parts_sent, 0u);
    EXPECT_EQ(fake_.pushes.load(), before + 1) << "one whole push";
    EXPECT_EQ(fake_.parts.load(), 0);
    if (step == 0) {
      const std::vector<float> want = PlainLayerwiseUpdate(g);
      EXPECT_EQ(std::memcmp(params.data(), want.data(), kN * sizeof(float)), 0);
    }
    GTOPK_ASSERT_OK(plain->Step(g, absl::MakeSpan(plain_params)).status());
    EXPECT_EQ(
        std::memcmp(params.data(), plain_params.data(), kN * sizeof(float)), 0)
        << "step " << step;
    EXPECT_TRUE(std::equal(overlapped->residual().begin(),
                           overlapped->residual().end(),
                           plain->residual().begin()));
  }
  const std::string err = captured.Take();
  EXPECT_THAT(err, HasSubstr("did not say it takes pushes in parts"));
  EXPECT_EQ(err.find("did not say"), err.rfind("did not say")) << err;
  EXPECT_EQ(overlapped->next_step(), 2);
}

// Two shards: a worker sends parts only when every shard says it takes
// them, each in its own answer (the leader in Join, shard 1 in
// GetClusterSpec). When one does not, both get whole pushes, and the
// overlapped step gives the plain layer-wise result.
class ClientTwoFakeShardsTest : public ::testing::TestWithParam<bool> {
 protected:
  void SetUp() override {
    for (int s = 0; s < 2; ++s) {
      grpc::ServerBuilder builder;
      int port = 0;
      builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(),
                               &port);
      builder.RegisterService(&fakes_[s]);
      servers_[s] = builder.BuildAndStart();
      ASSERT_NE(servers_[s], nullptr);
      addresses_.push_back(absl::StrCat("127.0.0.1:", port));
    }
    for (uint32_t s = 0; s < 2; ++s) {
      fakes_[s].id = s;
      fakes_[s].addresses = addresses_;
      fakes_[s].address = addresses_[s];
      fakes_[s].layerwise = true;
    }
  }
  void TearDown() override {
    for (auto& server : servers_) {
      server->Shutdown(std::chrono::system_clock::now() +
                       std::chrono::seconds(1));
    }
  }

  FakeShard fakes_[2];
  std::unique_ptr<grpc::Server> servers_[2];
  std::vector<std::string> addresses_;
};

TEST_P(ClientTwoFakeShardsTest, OneShardWithoutPartsMakesEveryPushWhole) {
  // true: the leader says it takes parts and shard 1 does not; false: the
  // other way round.
  const bool leader_says = GetParam();
  fakes_[0].advertise_parts = leader_says;
  fakes_[1].advertise_parts = !leader_says;
  ClientOptions o;
  o.leader_address = addresses_[0];
  o.n = kN;
  o.rpc_timeout = absl::Seconds(5);
  o.step_watchdog_margin = absl::Milliseconds(200);
  StderrCapture captured;
  auto client = WorkerClient::Connect(o);
  GTOPK_ASSERT_OK(client.status());
  EXPECT_FALSE((*client)->servers_take_push_parts());
  std::vector<float> params(kN, 0.0f);
  const std::vector<float> g = Ramp(1.0f);
  GTOPK_ASSERT_OK((*client)->BeginOverlappedStep(g, absl::MakeSpan(params)));
  GTOPK_ASSERT_OK((*client)->GradientReady(0, kN));
  auto stats = (*client)->FinishOverlappedStep();
  GTOPK_ASSERT_OK(stats.status());
  const std::string err = captured.Take();
  EXPECT_THAT(err, HasSubstr(absl::StrCat("shard ", leader_says ? 1 : 0, " (",
                                          addresses_[leader_says ? 1 : 0],
                                          ") did not say")));
  EXPECT_EQ(stats->parts_sent, 0u);
  for (const FakeShard& f : fakes_) {
    EXPECT_EQ(f.pushes.load(), 1) << "shard " << f.id;
    EXPECT_EQ(f.parts.load(), 0) << "shard " << f.id;
  }
  const std::vector<float> want = PlainLayerwiseUpdate(g);
  EXPECT_EQ(std::memcmp(params.data(), want.data(), kN * sizeof(float)), 0);
}

INSTANTIATE_TEST_SUITE_P(Both, ClientTwoFakeShardsTest, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return info.param ? "LeaderSays" : "Shard1Says";
                         });

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
