// Shards started with different settings (e.g. a rolling update after a
// ConfigMap change): every setting that must agree across the cluster is
// compared with the leader's, and a worker's Connect fails with
// FAILED_PRECONDITION naming the flag, both values and the shards, before
// any step runs. In-process shards on loopback (real gRPC), real
// WorkerClients.
#include <cmath>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "common/status_macros.h"
#include "common/testing/status_matchers.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "gtopk/v1/gtopk.grpc.pb.h"
#include "server/local_cluster.h"
#include "server/service.h"
#include "worker/client.h"

namespace gtopk {
namespace {

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
                             server::PickFreePorts(num_shards));
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
       [](ServerConfig& c) { c.mode = server::AggregationMode::kTopk; }},
      {"--selection is quota here but exact",
       [](ServerConfig& c) { c.selection = server::SelectionKind::kQuota; }},
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

}  // namespace
}  // namespace gtopk
