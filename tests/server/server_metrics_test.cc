// The server's metrics against independent counts: the workers' own
// StepStats (bytes, pairs, steps), rejections provoked on purpose, and the
// exposition of a real in-process cluster. WorkerMetrics on its own is
// tested in tests/worker/worker_metrics_test.cc.
#include <limits>
#include <map>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/metrics/metrics.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "gtopk/v1/gtopk.grpc.pb.h"
#include "prometheus/text_serializer.h"
#include "server/server_config.h"
#include "tests/testing/exposition.h"
#include "tests/testing/local_cluster.h"
#include "worker/client.h"
#include "worker/worker_metrics.h"

namespace gtopk {
namespace {

using ::gtopk::testing::ParseSeries;
using ::gtopk::testing::Serialize;
using ::gtopk::testing::SeriesValue;

TEST(ServerMetricsTest, CountsMatchTheWorkersOwnStats) {
  constexpr uint64_t kN = 2000;
  constexpr int kWorkers = 2, kSteps = 6;
  auto registry = std::make_shared<prometheus::Registry>();
  server::ServerConfig config;
  config.num_workers = kWorkers;
  config.optimizer.density = 0.01;
  config.step_timeout = absl::Seconds(20);
  config.metrics_registry = registry;
  auto cluster_or = ::gtopk::testing::LocalCluster::Start(config, 1);
  ASSERT_TRUE(cluster_or.ok()) << cluster_or.status();
  ::gtopk::testing::LocalCluster& cluster = **cluster_or;

  std::vector<std::unique_ptr<worker::WorkerClient>> clients(kWorkers);
  for (int w = 0; w < kWorkers; ++w) {
    worker::ClientOptions o;
    o.leader_address = cluster.leader();
    o.requested_rank = w;
    o.n = kN;
    o.rpc_timeout = absl::Seconds(20);
    auto client = worker::WorkerClient::Connect(o);
    ASSERT_TRUE(client.ok()) << client.status();
    clients[w] = *std::move(client);
  }
  std::vector<std::vector<worker::StepStats>> stats(kWorkers);
  std::vector<absl::Status> status(kWorkers);
  std::vector<std::thread> threads;
  for (int w = 0; w < kWorkers; ++w) {
    threads.emplace_back([&, w] {
      std::vector<float> params(kN, 0.5f);
      auto start = clients[w]->SynchronizeParameters(absl::MakeSpan(params));
      if (!start.ok()) {
        status[w] = start.status();
        return;
      }
      std::mt19937 rng(w);
      std::normal_distribution<float> normal;
      std::vector<float> grad(kN);
      for (int s = 0; s < kSteps; ++s) {
        for (float& g : grad) g = normal(rng);
        auto st = clients[w]->Step(grad, absl::MakeSpan(params));
        if (!st.ok()) {
          status[w] = st.status();
          return;
        }
        stats[w].push_back(*st);
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int w = 0; w < kWorkers; ++w) ASSERT_TRUE(status[w].ok()) << status[w];

  // A push for another shard: rejected as wrong_shard, INVALID_ARGUMENT.
  {
    auto stub = v1::Aggregator::NewStub(grpc::CreateChannel(
        cluster.leader(), grpc::InsecureChannelCredentials()));
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
    auto stream = stub->PushPull(&ctx);
    v1::Push push;
    push.set_step(kSteps);
    push.set_rank(0);
    push.set_shard_id(7);
    // Worker 0's identity: a member's malformed push, not a stranger's.
    push.set_member_token(clients[0]->member_token());
    push.set_cluster_fingerprint(clients[0]->cluster().cluster_fingerprint());
    ASSERT_TRUE(stream->Write(push));
    stream->WritesDone();
    v1::Pull pull;
    EXPECT_FALSE(stream->Read(&pull));
    EXPECT_EQ(stream->Finish().error_code(),
              grpc::StatusCode::INVALID_ARGUMENT);
  }

  double sent = 0, received = 0, selected = 0;
  for (int w = 0; w < kWorkers; ++w) {
    for (const worker::StepStats& s : stats[w]) {
      for (uint64_t b : s.bytes_sent) sent += static_cast<double>(b);
      for (uint64_t b : s.bytes_received) received += static_cast<double>(b);
    }
  }
  for (const worker::StepStats& s : stats[0]) selected += s.received_pairs;

  // A shard counts a pull's bytes once stream->Write returned, which can be
  // after the worker already has it: wait (bounded) for the last counts.
  const absl::Time settle = absl::Now() + absl::Seconds(10);
  while (absl::Now() < settle &&
         ParseSeries(Serialize(
             *registry))["gtopk_server_sent_bytes_total{method=\"PushPull\"}"] <
             received) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  const auto samples = ParseSeries(Serialize(*registry));
  // The push bytes of the rejected message are counted as received too.
  v1::Push rejected;
  rejected.set_step(kSteps);
  rejected.set_shard_id(7);
  rejected.set_member_token(clients[0]->member_token());
  rejected.set_cluster_fingerprint(clients[0]->cluster().cluster_fingerprint());
  EXPECT_EQ(
      SeriesValue(samples,
                  "gtopk_server_received_bytes_total{method=\"PushPull\"}"),
      sent + static_cast<double>(rejected.ByteSizeLong()));
  EXPECT_EQ(SeriesValue(samples,
                        "gtopk_server_sent_bytes_total{method=\"PushPull\"}"),
            received);
  EXPECT_GT(
      SeriesValue(samples,
                  "gtopk_server_received_bytes_total{method=\"InitParams\"}"),
      4.0 * kN);
  EXPECT_GT(
      SeriesValue(samples,
                  "gtopk_server_sent_bytes_total{method=\"DownloadParams\"}"),
      4.0 * kN);
  EXPECT_EQ(SeriesValue(samples, "gtopk_server_rounds_total"), kSteps);
  EXPECT_EQ(SeriesValue(samples, "gtopk_server_step"), kSteps);
  EXPECT_EQ(SeriesValue(samples, "gtopk_server_selected_pairs_total"),
            selected);
  EXPECT_EQ(SeriesValue(samples, "gtopk_server_round_duration_seconds_count"),
            kSteps);
  EXPECT_EQ(
      SeriesValue(samples, "gtopk_server_slowest_worker_wait_seconds_count"),
      kSteps);
  EXPECT_EQ(SeriesValue(samples, "gtopk_server_merge_duration_seconds_count"),
            kSteps);
  EXPECT_EQ(
      SeriesValue(samples, "gtopk_server_threshold_duration_seconds_count"),
      kSteps);
  EXPECT_EQ(
      SeriesValue(samples,
                  "gtopk_server_round_duration_seconds_bucket{le=\"+Inf\"}"),
      kSteps);
  EXPECT_EQ(SeriesValue(
                samples,
                "gtopk_server_rejected_messages_total{reason=\"wrong_shard\"}"),
            1);
  EXPECT_EQ(
      SeriesValue(samples,
                  "gtopk_server_rejected_messages_total{reason=\"invalid\"}"),
      0);
  EXPECT_EQ(
      SeriesValue(samples,
                  "gtopk_server_rpc_errors_total{code=\"INVALID_ARGUMENT\"}"),
      1);
  EXPECT_EQ(samples.count("gtopk_server_rpc_errors_total{code=\"DATA_LOSS\"}"),
            1u);
  // None written: the scrape-time collectable has nothing to say.
  EXPECT_EQ(samples.count("gtopk_server_checkpoint_age_seconds"), 0u);
  EXPECT_TRUE(cluster.shard(0)
                  .service()
                  ->metrics()
                  .checkpoint_age()
                  ->Collect()
                  .empty());
  // Present from the start (no checkpoint dir: never fails).
  EXPECT_EQ(samples.count("gtopk_server_checkpoint_failures_total"), 1u);
  EXPECT_EQ(SeriesValue(samples, "gtopk_server_checkpoint_failures_total"), 0);
  // The two workers' streams are still open.
  EXPECT_EQ(SeriesValue(samples, "gtopk_server_connected_workers"), kWorkers);
  clients.clear();
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (absl::Now() < deadline &&
         ParseSeries(Serialize(*registry))["gtopk_server_connected_workers"] !=
             0) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  EXPECT_EQ(ParseSeries(Serialize(*registry))["gtopk_server_connected_workers"],
            0);
}

// gtopk_server_checkpoint_age_seconds: absent until a checkpoint is written,
// then the seconds since, growing between scrapes; served beside the
// registry (a prometheus::Registry holds only its own families).
TEST(ServerMetricsTest, CheckpointAgeCountsFromTheLastWrite) {
  prometheus::Registry registry;
  server::ServerMetrics m(registry);
  EXPECT_EQ(Serialize(*m.checkpoint_age()), "");
  EXPECT_EQ(ParseSeries(Serialize(registry))
                .count("gtopk_server_checkpoint_age_seconds"),
            0u);
  m.CheckpointWritten();
  const std::string text = Serialize(*m.checkpoint_age());
  EXPECT_NE(text.find("# TYPE gtopk_server_checkpoint_age_seconds gauge\n"),
            std::string::npos)
      << text;
  const double first = ParseSeries(text)["gtopk_server_checkpoint_age_seconds"];
  EXPECT_GE(first, 0);
  EXPECT_LT(first, 5);
  absl::SleepFor(absl::Milliseconds(50));
  EXPECT_GE(ParseSeries(Serialize(
                *m.checkpoint_age()))["gtopk_server_checkpoint_age_seconds"],
            first + 0.04);
}

}  // namespace
}  // namespace gtopk
