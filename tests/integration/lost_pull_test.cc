// A worker that lost the result of a step that committed (its pull from a
// shard arrived after the worker's step watchdog had fired: a shard stalled
// while it answered, break-it run of 2026-12-07) recovers it from the
// shards, with --apply=workers, where the servers hold no parameters to
// download: Recover says the shards are one step ahead, the worker retries
// the step (a zero gradient: the residual holds the failed attempt's u, so
// the push is the same) and the shards answer the retry with the step's
// kept result. The run stays bit-identical to the same run without the
// held pull (an independent run on a second cluster), for the plain and
// the overlapped exchange, threshold and layer-wise selection, and the
// topk and dense modes. With --apply=servers Recover used to download the
// parameters and keep the residual and momentum, so the run went on but
// was no longer bit-identical; now the retry gets the kept result there
// too (the parameters equal the servers' and the undisturbed run's). Before the
// fix Recover refused with FAILED_PRECONDITION ("lost the result of a step
// that committed") and the run ended.
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/cluster_modes.h"
#include "common/status_macros.h"
#include "gtest/gtest.h"
#include "server/server_config.h"
#include "tests/testing/joined_workers.h"
#include "tests/testing/local_cluster.h"
#include "tests/testing/pausable_proxy.h"
#include "tests/testing/reference.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/temp_dir.h"
#include "worker/client.h"

namespace gtopk {
namespace {

using ::gtopk::testing::BitEqual;
using ::gtopk::testing::StatusIs;
using ::testing::HasSubstr;
using worker::WorkerClient;

constexpr uint64_t kN = 2003;
constexpr int kWorkers = 2;
constexpr int kSteps = 3;
// The step whose pulls from shard 1 are held past the watchdog.
constexpr int kLostStep = 1;

struct Case {
  ApplyMode apply;
  AggregationMode mode;
  SelectionKind selection;
  bool overlapped;  // the lost step runs overlapped (layer-wise only)
  const char* name;
  // The first retry's pulls from shard 1 are held past the watchdog too
  // (the shard stalled again): the next Recover still answers the worker's
  // own step, and the second retry gets the kept result (break-it run:
  // with --apply=servers it downloaded instead, and the run differed).
  bool retry_lost_too = false;
};

server::ServerConfig Config(const Case& c) {
  server::ServerConfig s;
  if (c.selection == SelectionKind::kLayerwise) {
    // Buckets of 500 values: one straddles the shards' boundary (1001).
    s = ::gtopk::testing::LayerwiseConfig(kWorkers, c.apply, 500, 0.02);
  } else {
    s.num_workers = kWorkers;
    s.mode = c.mode;
    s.selection = c.selection;
    s.apply = c.apply;
    s.optimizer.density = 0.02;
    if (c.apply == ApplyMode::kServers) {
      // As LayerwiseConfig: plain SGD. With DGC momentum no retry is
      // bit-identical (its zero gradient still advances the local
      // velocity; docs/recovery.md), a lost pull's or any other.
      s.optimizer.lr = 1.0f;
      s.optimizer.momentum = 0.0f;
      s.optimizer.momentum_mode = MomentumMode::kNone;
    }
  }
  // The watchdog: the step timeout + the clients' 500 ms margin.
  s.step_timeout = absl::Seconds(2);
  return s;
}

std::vector<float> Gradient(int step, int worker) {
  return ::gtopk::testing::NormalVector(kN, 1000 + 10 * step + worker);
}

// One step of a worker's: the plain AggregateStep (workers apply: the
// average into `averaged`) or Step (servers apply: `params` updated), or
// the same overlapped (the gradient reported in chunks from the end, as
// backward produces it).
absl::Status StepOf(ApplyMode apply, WorkerClient& client,
                    const std::vector<float>& g, std::vector<float>& averaged,
                    std::vector<float>& params, bool overlapped) {
  const bool workers = apply == ApplyMode::kWorkers;
  if (!overlapped) {
    return workers ? client.AggregateStep(g, absl::MakeSpan(averaged), params)
                         .status()
                   : client.Step(g, absl::MakeSpan(params)).status();
  }
  std::vector<float> buffer(kN, 0.0f);
  GTOPK_RETURN_IF_ERROR(
      workers
          ? client.BeginOverlappedStep(buffer, absl::MakeSpan(averaged), params)
          : client.BeginOverlappedStep(buffer, absl::MakeSpan(params)));
  for (uint64_t end = kN; end > 0;) {
    const uint64_t begin = end >= 300 ? end - 300 : 0;
    std::copy(g.begin() + begin, g.begin() + end, buffer.begin() + begin);
    GTOPK_RETURN_IF_ERROR(client.GradientReady(begin, end));
    end = begin;
  }
  return client.FinishOverlappedStep().status();
}

// Every worker's step `step` at once (gradient Gradient(step, w), or zeros
// for a retry); the statuses by worker.
std::vector<absl::Status> StepAll(
    ApplyMode apply, std::vector<std::unique_ptr<WorkerClient>>& clients,
    std::vector<std::vector<float>>& params,
    std::vector<std::vector<float>>& averaged, int step, bool zero,
    bool overlapped) {
  std::vector<absl::Status> out(clients.size());
  std::vector<std::thread> threads;
  for (size_t w = 0; w < clients.size(); ++w) {
    threads.emplace_back([&, w] {
      const std::vector<float> g = zero ? std::vector<float>(kN, 0.0f)
                                        : Gradient(step, static_cast<int>(w));
      out[w] =
          StepOf(apply, *clients[w], g, averaged[w], params[w], overlapped);
    });
  }
  for (auto& t : threads) t.join();
  return out;
}

// A 2-shard cluster whose shard 1 is reached through `proxy` (the leader
// advertises the proxy's address to the workers), with kWorkers joined
// and synchronised on `initial`. Members in destruction order: the
// clients first, then the cluster, then the proxy.
struct ProxiedCluster {
  std::unique_ptr<::gtopk::testing::PausableProxy> proxy;
  std::unique_ptr<::gtopk::testing::LocalCluster> cluster;
  ::gtopk::testing::JoinedWorkers joined;
};
absl::StatusOr<ProxiedCluster> StartWithShard1Proxied(
    const server::ServerConfig& config, const std::vector<float>& initial) {
  ProxiedCluster c;
  GTOPK_ASSIGN_OR_RETURN(c.proxy, ::gtopk::testing::PausableProxy::Start());
  ::gtopk::testing::PausableProxy* proxy = c.proxy.get();
  GTOPK_ASSIGN_OR_RETURN(c.cluster,
                         ::gtopk::testing::LocalCluster::Start(
                             config, 2, [proxy](server::ServerConfig& s) {
                               s.peers[1] = proxy->address();
                             }));
  const std::string shard1 = c.cluster->peers()[1];
  proxy->set_target(std::stoi(shard1.substr(shard1.rfind(':') + 1)));
  GTOPK_ASSIGN_OR_RETURN(c.joined, ::gtopk::testing::JoinAndSynchronize(
                                       *c.cluster, kWorkers, initial));
  if (c.joined.clients[0]->cluster().shards(1).address() != proxy->address()) {
    return absl::InternalError("shard 1 is not advertised at the proxy");
  }
  return c;
}

class LostPullTest : public ::testing::TestWithParam<Case> {};

TEST_P(LostPullTest, TheRetryGetsTheCommittedResultBitIdentical) {
  const Case c = GetParam();
  const std::vector<float> initial = ::gtopk::testing::NormalVector(kN, 7);

  // The reference: the same steps on a cluster of its own, nothing held.
  // What each step leaves, compared: the average (workers apply) or the
  // parameters (servers apply).
  const bool workers = c.apply == ApplyMode::kWorkers;
  auto outcome = [&](const std::vector<float>& averaged,
                     const std::vector<float>& params) {
    return workers ? averaged : params;
  };
  std::vector<std::vector<float>> expected(kSteps);
  {
    GTOPK_ASSERT_OK_AND_ASSIGN(
        std::unique_ptr<::gtopk::testing::LocalCluster> cluster,
        ::gtopk::testing::LocalCluster::Start(Config(c), 2));
    GTOPK_ASSERT_OK_AND_ASSIGN(
        ::gtopk::testing::JoinedWorkers joined,
        ::gtopk::testing::JoinAndSynchronize(*cluster, kWorkers, initial));
    std::vector<std::vector<float>> averaged(kWorkers,
                                             std::vector<float>(kN, 0.0f));
    for (int t = 0; t < kSteps; ++t) {
      for (const absl::Status& st :
           StepAll(c.apply, joined.clients, joined.params, averaged, t, false,
                   c.overlapped && t == kLostStep)) {
        GTOPK_ASSERT_OK(st) << "reference step " << t;
      }
      expected[t] = outcome(averaged[0], joined.params[0]);
      ASSERT_TRUE(
          BitEqual(expected[t], outcome(averaged[1], joined.params[1])));
    }
  }

  // Shard 1's answers are held during step kLostStep.
  GTOPK_ASSERT_OK_AND_ASSIGN(ProxiedCluster run,
                             StartWithShard1Proxied(Config(c), initial));
  auto& proxy = run.proxy;
  auto& cluster = run.cluster;
  auto& clients = run.joined.clients;
  auto& params = run.joined.params;
  std::vector<std::vector<float>> averaged(kWorkers,
                                           std::vector<float>(kN, 0.0f));
  for (int t = 0; t < kSteps; ++t) {
    const bool overlapped = c.overlapped && t == kLostStep;
    if (t != kLostStep) {
      for (const absl::Status& st :
           StepAll(c.apply, clients, params, averaged, t, false, overlapped)) {
        GTOPK_ASSERT_OK(st) << "step " << t;
      }
    } else {
      proxy->PauseReplies();
      std::vector<absl::Status> lost =
          StepAll(c.apply, clients, params, averaged, t, false, overlapped);
      proxy->ResumeReplies();
      for (int w = 0; w < kWorkers; ++w) {
        ASSERT_FALSE(lost[w].ok())
            << "worker " << w << " got shard 1's held pull";
        EXPECT_EQ(clients[w]->next_step(), t);
      }
      // The step committed on both shards (its pulls were sent): the
      // shards are a step ahead of both workers, which recover it.
      for (int w = 0; w < kWorkers; ++w) {
        const std::vector<float> before = params[w];
        absl::StatusOr<int64_t> next = clients[w]->Recover(
            absl::MakeSpan(params[w]), absl::Now() + absl::Seconds(20));
        GTOPK_ASSERT_OK(next.status()) << "worker " << w;
        EXPECT_EQ(*next, t) << "worker " << w;
        EXPECT_TRUE(BitEqual(params[w], before))
            << "worker " << w << ": Recover changed the parameters";
      }
      std::fill(averaged.begin(), averaged.end(),
                std::vector<float>(kN, -1.0f));
      if (c.retry_lost_too) {
        proxy->PauseReplies();
        std::vector<absl::Status> again = StepAll(
            c.apply, clients, params, averaged, t, /*zero=*/true, false);
        proxy->ResumeReplies();
        for (int w = 0; w < kWorkers; ++w) {
          ASSERT_FALSE(again[w].ok()) << "worker " << w;
          const std::vector<float> before = params[w];
          absl::StatusOr<int64_t> next = clients[w]->Recover(
              absl::MakeSpan(params[w]), absl::Now() + absl::Seconds(20));
          GTOPK_ASSERT_OK(next.status()) << "worker " << w;
          EXPECT_EQ(*next, t) << "worker " << w << ": downloaded";
          EXPECT_TRUE(BitEqual(params[w], before)) << "worker " << w;
        }
      }
      for (const absl::Status& st : StepAll(c.apply, clients, params, averaged,
                                            t, /*zero=*/true, false)) {
        GTOPK_ASSERT_OK(st) << "the retry of step " << t;
      }
    }
    for (int w = 0; w < kWorkers; ++w) {
      EXPECT_EQ(clients[w]->next_step(), t + 1);
      EXPECT_TRUE(BitEqual(outcome(averaged[w], params[w]), expected[t]))
          << "worker " << w << ", step " << t
          << ": differs from the run without the held pull";
    }
  }
  if (!workers) {
    auto servers = cluster->ServerParams(kN);
    ASSERT_TRUE(servers.ok()) << servers.status();
    EXPECT_EQ(servers->second, kSteps);
    EXPECT_TRUE(BitEqual(servers->first, params[0]));
  }
}

INSTANTIATE_TEST_SUITE_P(
    Modes, LostPullTest,
    ::testing::Values(
        Case{ApplyMode::kWorkers, AggregationMode::kGtopk,
             SelectionKind::kThreshold, false, "workers_threshold"},
        Case{ApplyMode::kWorkers, AggregationMode::kGtopk,
             SelectionKind::kLayerwise, false, "workers_layerwise"},
        Case{ApplyMode::kWorkers, AggregationMode::kGtopk,
             SelectionKind::kLayerwise, true, "workers_layerwise_overlapped"},
        Case{ApplyMode::kWorkers, AggregationMode::kTopk,
             SelectionKind::kThreshold, false, "workers_topk"},
        Case{ApplyMode::kWorkers, AggregationMode::kDense,
             SelectionKind::kThreshold, false, "workers_dense"},
        Case{ApplyMode::kServers, AggregationMode::kGtopk,
             SelectionKind::kThreshold, false, "servers_threshold"},
        Case{ApplyMode::kServers, AggregationMode::kGtopk,
             SelectionKind::kLayerwise, true, "servers_layerwise_overlapped"},
        Case{ApplyMode::kServers, AggregationMode::kDense,
             SelectionKind::kThreshold, false, "servers_dense"},
        Case{ApplyMode::kServers, AggregationMode::kGtopk,
             SelectionKind::kThreshold, false, "servers_retry_lost_too", true},
        Case{ApplyMode::kWorkers, AggregationMode::kGtopk,
             SelectionKind::kLayerwise, false, "workers_retry_lost_too", true}),
    [](const ::testing::TestParamInfo<Case>& info) {
      return std::string(info.param.name);
    });

// The kept result is in memory only: shard 1 restarted (from its
// checkpoint of the next step) after the held step no longer has it. The
// retry then fails on that shard with FAILED_PRECONDITION naming what was
// missed; under --apply=servers the next Recover downloads the parameters
// instead (the run goes on, equal to the servers), under --apply=workers
// it cannot be repaired and the next Recover refuses, saying what to do.
class LostPullFallbackTest : public ::testing::TestWithParam<ApplyMode> {};

TEST_P(LostPullFallbackTest, ARestartedShardNoLongerHasTheKeptResult) {
  const ApplyMode apply = GetParam();
  const bool workers = apply == ApplyMode::kWorkers;
  ::gtopk::testing::TempDir dir("lost_pull");
  ASSERT_FALSE(dir.path().empty());
  server::ServerConfig config =
      Config(Case{apply, AggregationMode::kGtopk, SelectionKind::kThreshold,
                  false, "fallback"});
  config.checkpoint_dir = dir.path();
  config.checkpoint_every = 1;
  GTOPK_ASSERT_OK_AND_ASSIGN(
      ProxiedCluster run,
      StartWithShard1Proxied(config, ::gtopk::testing::NormalVector(kN, 7)));
  auto& proxy = run.proxy;
  auto& cluster = run.cluster;
  auto& clients = run.joined.clients;
  auto& params = run.joined.params;
  std::vector<std::vector<float>> averaged(kWorkers,
                                           std::vector<float>(kN, 0.0f));
  for (const absl::Status& st :
       StepAll(apply, clients, params, averaged, 0, false, false)) {
    GTOPK_ASSERT_OK(st) << "step 0";
  }
  proxy->PauseReplies();
  for (const absl::Status& st :
       StepAll(apply, clients, params, averaged, 1, false, false)) {
    ASSERT_FALSE(st.ok()) << "a worker got shard 1's held pull";
  }
  proxy->ResumeReplies();
  GTOPK_ASSERT_OK(cluster->RestartShard(1, /*write_checkpoint=*/true));

  for (int w = 0; w < kWorkers; ++w) {
    absl::StatusOr<int64_t> next = clients[w]->Recover(
        absl::MakeSpan(params[w]), absl::Now() + absl::Seconds(20));
    GTOPK_ASSERT_OK(next.status()) << "worker " << w;
    EXPECT_EQ(*next, 1) << "worker " << w << ": the kept result first";
  }
  for (const absl::Status& st :
       StepAll(apply, clients, params, averaged, 1, /*zero=*/true, false)) {
    EXPECT_THAT(st, StatusIs(absl::StatusCode::kFailedPrecondition,
                             HasSubstr("missed that step's update")));
  }
  for (int w = 0; w < kWorkers; ++w) {
    absl::StatusOr<int64_t> next = clients[w]->Recover(
        absl::MakeSpan(params[w]), absl::Now() + absl::Seconds(20));
    if (workers) {
      // Nothing to download: refused, saying what to do.
      EXPECT_THAT(next.status(),
                  StatusIs(absl::StatusCode::kFailedPrecondition,
                           HasSubstr("Restart every rank from the "
                                     "checkpoints of one step")));
      continue;
    }
    GTOPK_ASSERT_OK(next.status()) << "worker " << w;
    EXPECT_EQ(*next, 2) << "worker " << w << ": downloaded";
  }
  if (workers) return;
  for (const absl::Status& st :
       StepAll(apply, clients, params, averaged, 2, false, false)) {
    GTOPK_ASSERT_OK(st) << "step 2";
  }
  auto servers = cluster->ServerParams(kN);
  ASSERT_TRUE(servers.ok()) << servers.status();
  EXPECT_EQ(servers->second, 3);
  for (int w = 0; w < kWorkers; ++w) {
    EXPECT_TRUE(BitEqual(servers->first, params[w])) << "worker " << w;
  }
}

INSTANTIATE_TEST_SUITE_P(Apply, LostPullFallbackTest,
                         ::testing::Values(ApplyMode::kServers,
                                           ApplyMode::kWorkers),
                         [](const ::testing::TestParamInfo<ApplyMode>& info) {
                           return info.param == ApplyMode::kWorkers
                                      ? std::string("workers")
                                      : std::string("servers");
                         });

}  // namespace
}  // namespace gtopk
