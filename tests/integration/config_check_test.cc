// Shards started with different settings (e.g. a rolling update after a
// ConfigMap change): every setting that must agree across the cluster is
// compared with the leader's, and a worker's Connect fails with
// FAILED_PRECONDITION naming the flag, both values and the shards, before
// any step runs. In-process shards on loopback (real gRPC), real
// WorkerClients.
#include <dirent.h>
#include <stdlib.h>
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "common/status_macros.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "gtopk/v1/gtopk.grpc.pb.h"
#include "server/aggregator_server.h"
#include "server/server_config.h"
#include "tests/testing/local_cluster.h"
#include "tests/testing/reference.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/temp_dir.h"
#include "worker/client.h"

namespace gtopk {
namespace {

using ::gtopk::testing::LocalCluster;
using ::gtopk::testing::StatusIs;
using server::AggregatorServer;
using server::ServerConfig;
using ::testing::AllOf;
using ::testing::HasSubstr;

constexpr uint64_t kN = 1000;

ServerConfig Defaults(uint32_t num_shards) {
  ServerConfig c;
  c.num_shards = num_shards;
  c.num_workers = 1;
  c.peers.assign(num_shards, "");
  c.step_timeout = absl::Seconds(5);
  return c;
}

// S shards on loopback; `edit(s, config)` changes shard s's configuration.
class MixedCluster {
 public:
  absl::Status Start(uint32_t num_shards,
                     const std::function<void(uint32_t, ServerConfig&)>& edit) {
    absl::Status last;
    for (int attempt = 0; attempt < 3; ++attempt) {
      servers_.clear();
      GTOPK_ASSIGN_OR_RETURN(std::vector<int> ports,
                             ::gtopk::testing::PickFreePorts(num_shards));
      peers_.clear();
      for (int p : ports) peers_.push_back(absl::StrCat("127.0.0.1:", p));
      last = absl::OkStatus();
      for (uint32_t s = 0; s < num_shards && last.ok(); ++s) {
        ServerConfig c = Defaults(num_shards);
        c.shard_id = s;
        c.peers = peers_;
        edit(s, c);
        auto srv = AggregatorServer::Start(c, peers_[s]);
        if (srv.ok()) {
          servers_.push_back(*std::move(srv));
        } else {
          last = srv.status();
        }
      }
      if (last.ok()) return last;
    }
    return last;
  }
  ~MixedCluster() {
    for (auto& s : servers_) s->Shutdown(absl::Milliseconds(100)).IgnoreError();
  }
  const std::vector<std::string>& peers() const { return peers_; }
  AggregatorServer& shard(size_t s) { return *servers_[s]; }

 private:
  std::vector<std::string> peers_;
  std::vector<std::unique_ptr<AggregatorServer>> servers_;
};

absl::StatusOr<std::unique_ptr<worker::WorkerClient>> ConnectTo(
    const MixedCluster& cluster) {
  worker::ClientOptions o;
  o.leader_address = cluster.peers()[0];
  o.n = kN;
  o.rpc_timeout = absl::Seconds(10);
  return worker::WorkerClient::Connect(o);
}

// The reviewer's repro: shard 0 with the defaults, shard 1 with --lr=0.5
// --momentum-mode=global. Before, workers trained and exited 0 with the
// servers' parameters silently different from theirs.
TEST(ConfigCheckTest, ConnectFailsNamingEveryDifferingFlagAndTheShards) {
  MixedCluster cluster;
  GTOPK_ASSERT_OK(cluster.Start(2, [](uint32_t s, ServerConfig& c) {
    if (s == 1) {
      c.optimizer.lr = 0.5f;
      c.optimizer.momentum_mode = MomentumMode::kGlobal;
    }
  }));
  const auto client = ConnectTo(cluster);
  EXPECT_THAT(
      client.status(),
      StatusIs(absl::StatusCode::kFailedPrecondition,
               AllOf(HasSubstr(absl::StrCat("shard 1 (", cluster.peers()[1],
                                            "): GetClusterSpec")),
                     HasSubstr("shard 1 is configured differently from the "
                               "leader, shard 0 (" +
                               cluster.peers()[0] + ")"),
                     HasSubstr("--lr is 0.5 here but 0.1 on the leader"),
                     HasSubstr("--momentum-mode is global here but dgc on "
                               "the leader"))));
  // Nothing was initialised: the leader is still at step 0 (no step ran).
  EXPECT_EQ(cluster.shard(0).service()->next_step(), 0);
}

// The same cluster with equal settings connects and steps (the check does
// not refuse a consistent cluster, also with 3 shards).
TEST(ConfigCheckTest, EqualSettingsConnect) {
  MixedCluster cluster;
  GTOPK_ASSERT_OK(cluster.Start(3, [](uint32_t, ServerConfig& c) {
    c.optimizer.lr = 0.25f;
    c.optimizer.density_warmup = {0.5, 0.1};
    c.optimizer.steps_per_epoch = 4;
  }));
  GTOPK_ASSERT_OK_AND_ASSIGN(auto client, ConnectTo(cluster));
  std::vector<float> params(kN, 0.5f), grad(kN, 0.0f);
  for (size_t i = 0; i < kN; ++i) grad[i] = static_cast<float>(i % 7) - 3.0f;
  GTOPK_ASSERT_OK(client->SynchronizeParameters(absl::MakeSpan(params)));
  GTOPK_ASSERT_OK(client->Step(grad, absl::MakeSpan(params)));
  // The start-up comparison (issue 42) left the agreeing shards ready.
  for (uint32_t s = 0; s < 3; ++s) {
    GTOPK_ASSERT_OK_AND_ASSIGN(
        const bool serving,
        server::CheckHealth(cluster.peers()[s], absl::Seconds(5)));
    EXPECT_TRUE(serving) << "shard " << s;
  }
}

// A non-leader that creates its aggregator lazily (first DownloadParams)
// refuses a mismatched leader too, so a worker that skipped the Connect
// check cannot train against it either.
TEST(ConfigCheckTest, MismatchedShardRefusesDownloads) {
  MixedCluster cluster;
  GTOPK_ASSERT_OK(cluster.Start(2, [](uint32_t s, ServerConfig& c) {
    if (s == 1) c.optimizer.density = 0.01;
  }));
  // Fix the cluster's n at the leader (a Join), then ask shard 1 directly.
  auto leader = v1::Aggregator::NewStub(grpc::CreateChannel(
      cluster.peers()[0], grpc::InsecureChannelCredentials()));
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
    v1::JoinRequest req;
    req.set_requested_rank(0);
    req.set_n(kN);
    v1::JoinResponse resp;
    ASSERT_TRUE(leader->Join(&ctx, req, &resp).ok());
  }
  auto shard1 = v1::Aggregator::NewStub(grpc::CreateChannel(
      cluster.peers()[1], grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
  v1::DownloadParamsRequest req;
  auto reader = shard1->DownloadParams(&ctx, req);
  v1::ParamsChunk chunk;
  EXPECT_FALSE(reader->Read(&chunk));
  const grpc::Status st = reader->Finish();
  EXPECT_EQ(st.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(st.error_message(),
              HasSubstr("--density is 0.01 here but 0.001 on the leader"));
  // Issue 42: a shard that refuses work is not ready: grpc.health says
  // NOT_SERVING (it said SERVING before), and the reason is in its answer
  // to GetClusterSpec (what gtopk-server --health-check prints).
  GTOPK_ASSERT_OK_AND_ASSIGN(
      const bool shard1_serving,
      server::CheckHealth(cluster.peers()[1], absl::Seconds(5)));
  EXPECT_FALSE(shard1_serving);
  GTOPK_ASSERT_OK_AND_ASSIGN(
      const bool leader_serving,
      server::CheckHealth(cluster.peers()[0], absl::Seconds(5)));
  EXPECT_TRUE(leader_serving);
  EXPECT_THAT(server::ExplainNotServing(cluster.peers()[1]),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("--density is 0.01 here but 0.001")));
}

// Issue 42, "also": readiness said SERVING until a shard first compared its
// flags with the leader's, which waited for a worker's Join (the leader's n).
// Now a shard compares them from its start (GetClusterSpec settings_only):
// NOT_SERVING within seconds, with no worker anywhere, and the reason is
// answered at once (before: DEADLINE_EXCEEDED "no parameter count yet").
TEST(ConfigCheckTest, MismatchedShardIsNotReadyBeforeAnyWorkerJoins) {
  MixedCluster cluster;
  GTOPK_ASSERT_OK(cluster.Start(2, [](uint32_t s, ServerConfig& c) {
    if (s == 1) c.optimizer.density = 0.01;
  }));
  bool shard1_serving = true;
  const absl::Time end = absl::Now() + absl::Seconds(10);
  while (shard1_serving && absl::Now() < end) {
    GTOPK_ASSERT_OK_AND_ASSIGN(
        shard1_serving,
        server::CheckHealth(cluster.peers()[1], absl::Seconds(5)));
    if (shard1_serving) absl::SleepFor(absl::Milliseconds(100));
  }
  EXPECT_FALSE(shard1_serving) << "shard 1 still SERVING after 10 s";
  GTOPK_ASSERT_OK_AND_ASSIGN(
      const bool leader_serving,
      server::CheckHealth(cluster.peers()[0], absl::Seconds(5)));
  EXPECT_TRUE(leader_serving);
  EXPECT_THAT(server::ExplainNotServing(cluster.peers()[1]),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("--density is 0.01 here but 0.001")));
}

// Every setting that must agree is compared, each named by its flag with
// both values (table-driven, against the leader's spec built from the
// defaults).
TEST(ConfigCheckTest, EverySharedSettingIsCompared) {
  ServerConfig leader_config = Defaults(2);
  leader_config.peers = {"leader:1", "shard1:2"};
  v1::ClusterSpec leader = server::ClusterSettingsSpec(leader_config);
  for (uint32_t s = 0; s < 2; ++s) leader.add_shards()->set_shard_id(s);
  leader.set_n(kN);

  struct Case {
    const char* expected;  // a substring of the message
    std::function<void(ServerConfig&)> edit;
  };
  const std::vector<Case> cases = {
      {"--workers is 3 here but 1", [](ServerConfig& c) { c.num_workers = 3; }},
      {"--num-shards is 3 here but 2",
       [](ServerConfig& c) {
         c.num_shards = 3;
         c.peers.push_back("shard2:3");
       }},
      {"--mode is topk here but gtopk",
       [](ServerConfig& c) { c.mode = AggregationMode::kTopk; }},
      {"--selection is quota here but threshold",
       [](ServerConfig& c) { c.selection = SelectionKind::kQuota; }},
      {"--selector is dgc here but exact",
       [](ServerConfig& c) { c.selector = "dgc"; }},
      {"--seed is 7 here but 0", [](ServerConfig& c) { c.selector_seed = 7; }},
      {"--index-codec is raw here but delta-varint",
       [](ServerConfig& c) { c.index_codec = IndexCodec::kRaw; }},
      {"--value-codec is fp16 here but fp32",
       [](ServerConfig& c) { c.value_codec = ValueCodec::kFp16; }},
      {"--lr is 0.5 here but 0.1",
       [](ServerConfig& c) { c.optimizer.lr = 0.5f; }},
      // One float ulp apart: still a difference, and printed as one.
      {"--lr is 0.10000001 here but 0.1",
       [](ServerConfig& c) { c.optimizer.lr = std::nextafter(0.1f, 1.0f); }},
      {"--momentum is 0.5 here but 0.9",
       [](ServerConfig& c) { c.optimizer.momentum = 0.5f; }},
      {"--momentum-mode is none here but dgc",
       [](ServerConfig& c) {
         c.optimizer.momentum_mode = MomentumMode::kNone;
       }},
      {"--momentum-masking is false here but true",
       [](ServerConfig& c) { c.optimizer.momentum_factor_masking = false; }},
      {"--weight-decay is 0.0001 here but 0",
       [](ServerConfig& c) { c.optimizer.weight_decay = 1e-4f; }},
      {"--lr-warmup-steps is 10 here but 0",
       [](ServerConfig& c) { c.optimizer.lr_warmup_steps = 10; }},
      {"--density is 0.01 here but 0.001",
       [](ServerConfig& c) { c.optimizer.density = 0.01; }},
      {"--density-warmup is 0.25,0.0625 here but empty",
       [](ServerConfig& c) {
         c.optimizer.density_warmup = {0.25, 0.0625};
         c.optimizer.steps_per_epoch = 5;
       }},
      {"--steps-per-epoch is 5 here but 0",
       [](ServerConfig& c) { c.optimizer.steps_per_epoch = 5; }},
      {"--step-timeout is 7000ms here but 5000ms",
       [](ServerConfig& c) { c.step_timeout = absl::Seconds(7); }},
      {"--max-message-bytes is 4096 here but 67108864",
       [](ServerConfig& c) { c.max_message_bytes = 4096; }},
  };
  for (const Case& c : cases) {
    ServerConfig own = leader_config;
    own.shard_id = 1;
    c.edit(own);
    EXPECT_THAT(
        server::CheckSameClusterSettings(own, leader, 0),
        StatusIs(absl::StatusCode::kFailedPrecondition,
                 AllOf(HasSubstr(c.expected),
                       HasSubstr("shard 1 is configured differently "
                                 "from the leader, shard 0 (leader:1)"))))
        << c.expected;
  }
  ServerConfig same = leader_config;
  same.shard_id = 1;
  GTOPK_EXPECT_OK(server::CheckSameClusterSettings(same, leader, kN));
  // n restored from this shard's checkpoint against the leader's.
  EXPECT_THAT(server::CheckSameClusterSettings(same, leader, kN + 1),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("n is 1001 here (from this shard's "
                                 "checkpoint) but 1000 on the leader")));
}

// ---------------------------------------------------------------------------
// Configuration drift after a restart (issue 13, part 2): a shard restarted
// with other cluster flags while restoring its checkpoint must not serve
// the running workers. Before, it restored its checkpoint, skipped the
// comparison with the leader and served: the shards diverged (or, with
// --workers=3, the workers waited for a worker 2 and the flag was never
// named).

using ::gtopk::testing::TempDir;

using ::gtopk::testing::BitEqual;

// Two workers on a two-shard cluster with global momentum, checkpointing
// every step (the repro).
class DriftTest : public ::testing::Test {
 protected:
  static constexpr int kWorkers = 2;

  void SetUp() override {
    ASSERT_FALSE(dir_.path().empty());
    ServerConfig c;
    c.num_workers = kWorkers;
    c.optimizer.momentum_mode = MomentumMode::kGlobal;
    c.optimizer.momentum = 0.9f;
    c.optimizer.density = 0.05;
    c.step_timeout = absl::Seconds(3);
    c.checkpoint_dir = dir_.path();
    c.checkpoint_every = 1;
    auto cluster = LocalCluster::Start(c, 2);
    ASSERT_TRUE(cluster.ok()) << cluster.status();
    cluster_ = *std::move(cluster);
    for (int w = 0; w < kWorkers; ++w) {
      worker::ClientOptions o;
      o.leader_address = cluster_->leader();
      o.requested_rank = w;
      o.n = kN;
      o.rpc_timeout = absl::Seconds(10);
      o.step_watchdog_margin = absl::Seconds(1);
      auto client = worker::WorkerClient::Connect(o);
      ASSERT_TRUE(client.ok()) << client.status();
      clients_.push_back(*std::move(client));
      params_.emplace_back(kN, 0.25f);
    }
    for (int w = 0; w < kWorkers; ++w) {
      auto step =
          clients_[w]->SynchronizeParameters(absl::MakeSpan(params_[w]));
      ASSERT_TRUE(step.ok()) << step.status();
    }
  }

  // One step on every worker at once; their statuses.
  std::vector<absl::Status> StepAll(int seed) {
    std::vector<absl::Status> status(kWorkers);
    std::vector<std::thread> threads;
    for (int w = 0; w < kWorkers; ++w) {
      threads.emplace_back([&, w] {
        std::vector<float> grad(kN);
        for (uint64_t i = 0; i < kN; ++i) {
          grad[i] =
              static_cast<float>((i * 7 + w * 13 + seed * 31) % 23) - 11.0f;
        }
        status[w] =
            clients_[w]->Step(grad, absl::MakeSpan(params_[w])).status();
      });
    }
    for (auto& t : threads) t.join();
    return status;
  }

  // A few good steps, then shard `s` restarted (SIGTERM-like: it writes its
  // checkpoint) with `edit` applied to its flags; the next step must fail on
  // every worker with FAILED_PRECONDITION containing `expected`, and
  // nothing may be applied anywhere.
  void ExpectRestartWithRefused(size_t s,
                                const std::function<void(ServerConfig&)>& edit,
                                const std::vector<std::string>& expected) {
    for (int step = 0; step < 3; ++step) {
      for (const absl::Status& st : StepAll(step)) GTOPK_ASSERT_OK(st);
    }
    GTOPK_ASSERT_OK(
        cluster_->RestartShard(s, /*write_checkpoint=*/true, {}, edit));
    // (A misconfigured shard refuses downloads too, so the servers' state
    // is read through next_step; the replicas equal the servers before.)
    ASSERT_EQ(cluster_->shard(s).service()->next_step(), 3);
    const std::vector<std::vector<float>> worker_before = params_;

    const std::vector<absl::Status> status = StepAll(3);
    for (int w = 0; w < kWorkers; ++w) {
      EXPECT_THAT(status[w],
                  StatusIs(absl::StatusCode::kFailedPrecondition, ::testing::_))
          << "worker " << w;
      for (const std::string& e : expected) {
        EXPECT_THAT(std::string(status[w].message()), HasSubstr(e))
            << "worker " << w;
      }
      // Nothing applied on the workers' side.
      EXPECT_EQ(clients_[w]->next_step(), 3) << "worker " << w;
      EXPECT_TRUE(BitEqual(params_[w], worker_before[w])) << "worker " << w;
    }
    // Nor on the servers (no shard applied step 3).
    EXPECT_EQ(cluster_->shard(0).service()->next_step(), 3);
    EXPECT_EQ(cluster_->shard(1).service()->next_step(), 3);
  }

  TempDir dir_{"config_check"};
  std::unique_ptr<LocalCluster> cluster_;
  std::vector<std::unique_ptr<worker::WorkerClient>> clients_;
  std::vector<std::vector<float>> params_;
};

TEST_F(DriftTest, ShardRestartedWithOtherMomentumIsRefusedNamingIt) {
  ExpectRestartWithRefused(1,
                           [](ServerConfig& c) { c.optimizer.momentum = 0.5f; },
                           {"shard 1 is configured differently from the leader",
                            "--momentum is 0.5 here but 0.9 on the leader"});
}

TEST_F(DriftTest, ShardRestartedWithOtherLrIsRefusedNamingIt) {
  ExpectRestartWithRefused(1, [](ServerConfig& c) { c.optimizer.lr = 0.2f; },
                           {"--lr is 0.2 here but 0.1 on the leader"});
}

// Before: the workers waited for a worker 2 that never comes
// (DEADLINE_EXCEEDED), and --workers was never named.
TEST_F(DriftTest, ShardRestartedWithOtherWorkerCountIsRefusedNamingIt) {
  ExpectRestartWithRefused(1, [](ServerConfig& c) { c.num_workers = 3; },
                           {"--workers is 3 here but 2 on the leader"});
}

// The leader restarted with other flags: its own refusal of the workers'
// pushes (another fingerprint) is explained by the workers against the
// leader's new spec, and shard 1 refuses its commit vote's answer.
TEST_F(DriftTest, LeaderRestartedWithOtherLrIsRefusedNamingIt) {
  ExpectRestartWithRefused(
      0, [](ServerConfig& c) { c.optimizer.lr = 0.2f; },
      {"cluster fingerprint", "--lr is 0.1 here but 0.2 on the leader"});
}

// A push made for another cluster configuration (another fingerprint) from
// a worker that does hold its rank is refused alone: the round of the
// legitimate pushes is not failed by it, and completes.
TEST_F(DriftTest, PushWithAnotherFingerprintIsRefusedAlone) {
  for (const absl::Status& st : StepAll(0)) GTOPK_ASSERT_OK(st);
  auto stub = v1::Aggregator::NewStub(grpc::CreateChannel(
      cluster_->peers()[1], grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
  auto stream = stub->PushPull(&ctx);
  v1::Push push;
  push.set_step(1);
  push.set_rank(1);
  push.set_shard_id(1);
  push.set_member_token(clients_[1]->member_token());
  push.set_cluster_fingerprint(clients_[1]->cluster().cluster_fingerprint() ^
                               1);
  ASSERT_TRUE(stream->Write(push));
  v1::Pull pull;
  EXPECT_FALSE(stream->Read(&pull));
  const grpc::Status st = stream->Finish();
  EXPECT_EQ(st.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(st.error_message(), HasSubstr("cluster fingerprint"));
  // The real step 1 of both workers completes.
  for (const absl::Status& s : StepAll(1)) GTOPK_EXPECT_OK(s);
  EXPECT_TRUE(BitEqual(params_[0], params_[1]));
  auto server = cluster_->ServerParams(kN);
  ASSERT_TRUE(server.ok()) << server.status();
  EXPECT_EQ(server->second, 2);
  EXPECT_TRUE(BitEqual(server->first, params_[0]));
}

}  // namespace
}  // namespace gtopk
