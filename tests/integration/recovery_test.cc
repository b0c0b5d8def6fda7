// Crash recovery on a real in-process cluster (docs/recovery.md): a shard
// killed and restarted from an older checkpoint comes back BEHIND the
// others; the workers' next step fails, they call Recover, the leader rolls
// every shard back to the newest step they all retain, and the run goes on.
// Checked against a single-process reference that replays exactly what the
// cluster did: every worker attempt (the failed one included: its residual
// and momentum effects stay) and the parameters through exactly the
// committed steps, restored to the saved state of the step rolled back to.
// Also: no common checkpoint -> a clear FAILED_PRECONDITION within the
// deadline and nothing changed; leader waits end when the calling shard's
// RPC is cancelled.
#include <dirent.h>
#include <stdlib.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/codec.h"
#include "common/error_feedback.h"
#include "common/merge.h"
#include "common/optimizer.h"
#include "common/selector.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "server/aggregator_server.h"
#include "server/checkpoint.h"
#include "server/server_config.h"
#include "server/service.h"
#include "tests/testing/local_cluster.h"
#include "tests/testing/reference.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/temp_dir.h"
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
constexpr uint64_t kSeed = 17;
const CodecSpec kCodec{IndexCodec::kDeltaVarint, ValueCodec::kFp16};

std::vector<float> Normal(uint64_t seed) {
  return ::gtopk::testing::NormalVector(kN, seed);
}

std::vector<float> Gradient(int64_t step, int worker) {
  return Normal(1000003 * static_cast<uint64_t>(step) + 7 * worker + 1);
}

using ::gtopk::testing::BitEqual;

using ::gtopk::testing::TempDir;

bool CopyFile(const std::string& from, const std::string& to) {
  std::ifstream in(from, std::ios::binary);
  std::ofstream out(to, std::ios::binary | std::ios::trunc);
  out << in.rdbuf();
  return in.good() && out.good();
}

struct Case {
  std::string name;
  AggregationMode mode = AggregationMode::kGtopk;
  MomentumMode momentum = MomentumMode::kDgcCorrection;
  int workers = 3;
  uint32_t shards = 2;
  uint32_t restart_shard = 1;  // the shard that crashes and comes back behind
};

void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

server::ServerConfig MakeConfig(const Case& c, const std::string& dir) {
  server::ServerConfig s;
  s.num_workers = c.workers;
  s.mode = c.mode;
  s.selection = SelectionKind::kThreshold;
  s.selector_seed = kSeed;
  s.index_codec = kCodec.index;
  s.value_codec = kCodec.value;
  s.optimizer.lr = 0.1f;
  s.optimizer.momentum = 0.9f;
  s.optimizer.momentum_mode = c.momentum;
  s.optimizer.density = 0.01;
  s.step_timeout = absl::Seconds(5);
  s.checkpoint_dir = dir;
  s.checkpoint_every = 3;
  s.checkpoint_keep = 2;
  return s;
}

// The single-process reference: P workers' error feedback and momentum
// through every attempt, one parameter vector (every replica's) through the
// committed steps, and the parameters (with the global velocity) saved at
// every step boundary so that RollBack can restore them. Plain and
// sequential; the selection is ReferenceGtopkStep / SparseSum.
class Reference {
 public:
  Reference(const Case& c, std::vector<float> initial)
      : c_(c),
        rule_(*OptimizerRule::Create(MakeConfig(c, "").optimizer)),
        params_(std::move(initial)),
        global_v_(kN, 0.0f) {
    for (int w = 0; w < c.workers; ++w) {
      ef_.emplace_back(kN);
      velocity_.emplace_back(kN, 0.0f);
      SelectorOptions so;
      so.seed = WorkerClient::SelectorSeedForRank(kSeed, w);
      selectors_.push_back(*CreateSelector("exact", so));
    }
    saved_[0] = {params_, global_v_};
  }

  // Every worker's successful attempt of `step`, and its update.
  void Committed(int64_t step) {
    const int P = c_.workers;
    std::vector<SparseVector> sent(P), received(P);
    std::vector<float> dense_sum;
    for (int w = 0; w < P; ++w) Prepare(step, w, &sent[w], &received[w]);
    if (c_.mode == AggregationMode::kDense) {
      for (int w = 0; w < P; ++w) {
        const absl::Span<const float> u = ef_[w].residual();
        if (w == 0) {
          dense_sum.assign(u.begin(), u.end());
        } else {
          for (uint64_t i = 0; i < kN; ++i) dense_sum[i] += u[i];
        }
      }
      for (int w = 0; w < P; ++w) {
        std::fill(ef_[w].mutable_residual().begin(),
                  ef_[w].mutable_residual().end(), 0.0f);
      }
      GTOPK_EXPECT_OK(rule_.ApplyAggregatedDense(
          dense_sum, P, absl::MakeSpan(params_), absl::MakeSpan(global_v_)));
    } else {
      SparseVector global;
      if (c_.mode == AggregationMode::kTopk) {
        GTOPK_EXPECT_OK(SparseSum(received, kN, &global));
      } else {
        GTOPK_EXPECT_OK(
            ReferenceGtopkStep(received, kN, *rule_.KAt(step, kN), &global));
      }
      for (int w = 0; w < P; ++w) {
        if (c_.mode == AggregationMode::kGtopk) {
          GTOPK_EXPECT_OK(ef_[w].PutBack(received[w], global));
        }
        GTOPK_EXPECT_OK(
            rule_.MaskMomentum(sent[w], global, absl::MakeSpan(velocity_[w])));
      }
      GTOPK_EXPECT_OK(rule_.ApplyAggregated(
          global, 0, P, absl::MakeSpan(params_), absl::MakeSpan(global_v_)));
    }
    saved_[step + 1] = {params_, global_v_};
  }

  // Every worker's failed attempt of `step`: accumulated and marked sent,
  // then everything sent put back (WorkerClient::Step's contract).
  void Failed(int64_t step) {
    for (int w = 0; w < c_.workers; ++w) {
      SparseVector sent, received;
      Prepare(step, w, &sent, &received);
      if (c_.mode != AggregationMode::kDense) {
        GTOPK_EXPECT_OK(ef_[w].PutBack(received, SparseVector()));
      }
    }
  }

  // The servers' state before `step` (what the workers download).
  void RollBack(int64_t step) {
    ASSERT_TRUE(saved_.count(step)) << "no saved state of step " << step;
    params_ = saved_[step].first;
    global_v_ = saved_[step].second;
  }

  const std::vector<float>& params() const { return params_; }
  absl::Span<const float> residual(int w) const { return ef_[w].residual(); }

 private:
  void Prepare(int64_t step, int w, SparseVector* sent,
               SparseVector* received) {
    GTOPK_EXPECT_OK(rule_.AccumulateLocal(step, Gradient(step, w), params_,
                                          absl::MakeSpan(velocity_[w]),
                                          ef_[w].mutable_residual()));
    if (c_.mode == AggregationMode::kDense) return;
    GTOPK_EXPECT_OK(selectors_[w]->Select(ef_[w].residual(),
                                          *rule_.KAt(step, kN), step, sent));
    std::string wire;
    GTOPK_EXPECT_OK(EncodeSparse(*sent, kN, kCodec, &wire));
    GTOPK_EXPECT_OK(DecodeSparse(wire, kN, received));
    GTOPK_EXPECT_OK(ef_[w].MarkSent(*sent, *received));
  }

  const Case c_;
  const OptimizerRule rule_;
  std::vector<float> params_, global_v_;
  std::vector<ErrorFeedback> ef_;
  std::vector<std::vector<float>> velocity_;
  std::vector<std::unique_ptr<Selector>> selectors_;
  std::map<int64_t, std::pair<std::vector<float>, std::vector<float>>> saved_;
};

// One worker attempt: the step and whether it was applied.
struct Attempt {
  int64_t step;
  bool ok;
  bool operator==(const Attempt& o) const {
    return step == o.step && ok == o.ok;
  }
};
std::ostream& operator<<(std::ostream& os, const Attempt& a) {
  return os << a.step << (a.ok ? "ok" : "failed");
}

// P workers as threads, each stepping until `until` the way the trainer
// does: a failed step is followed by Recover, and the worker continues from
// the step Recover returns (at most 3 failures in a row).
class Workers {
 public:
  Workers(LocalCluster* cluster, int count) : params_(count), log_(count) {
    for (int w = 0; w < count; ++w) {
      ClientOptions o;
      o.leader_address = cluster->leader();
      o.requested_rank = w;
      o.n = kN;
      o.rpc_timeout = absl::Seconds(10);
      o.step_watchdog_margin = absl::Milliseconds(500);
      auto client = WorkerClient::Connect(o);
      EXPECT_TRUE(client.ok()) << client.status();
      clients_.push_back(client.ok() ? *std::move(client) : nullptr);
    }
  }

  // Rank 0 offers `initial`; everyone downloads.
  void Synchronize(const std::vector<float>& initial) {
    Parallel([&](int w) -> absl::Status {
      params_[w] = w == 0 ? initial : std::vector<float>(kN, 0.0f);
      return clients_[w]
          ->SynchronizeParameters(absl::MakeSpan(params_[w]))
          .status();
    });
  }

  void RunUntil(int64_t until) {
    Parallel([&](int w) -> absl::Status {
      WorkerClient& c = *clients_[w];
      int failures = 0;
      while (c.next_step() < until) {
        const int64_t step = c.next_step();
        auto stats = c.Step(Gradient(step, w), absl::MakeSpan(params_[w]));
        log_[w].push_back({step, stats.ok()});
        if (stats.ok()) {
          failures = 0;
          continue;
        }
        if (++failures > 3) return stats.status();
        auto resumed = c.Recover(absl::MakeSpan(params_[w]));
        if (!resumed.ok()) return resumed.status();
      }
      return absl::OkStatus();
    });
  }

  WorkerClient& client(int w) { return *clients_[w]; }
  std::vector<float>& params(int w) { return params_[w]; }
  std::vector<Attempt> TakeLog(int w) { return std::exchange(log_[w], {}); }

 private:
  void Parallel(const std::function<absl::Status(int)>& body) {
    std::vector<absl::Status> status(clients_.size());
    std::vector<std::thread> threads;
    for (size_t w = 0; w < clients_.size(); ++w) {
      threads.emplace_back([&, w] { status[w] = body(static_cast<int>(w)); });
    }
    for (auto& t : threads) t.join();
    for (size_t w = 0; w < clients_.size(); ++w) {
      GTOPK_EXPECT_OK(status[w]) << "worker " << w;
    }
  }

  std::vector<std::unique_ptr<WorkerClient>> clients_;
  std::vector<std::vector<float>> params_;
  std::vector<std::vector<Attempt>> log_;
};

class BehindShardTest : public ::testing::TestWithParam<Case> {};

TEST_P(BehindShardTest, ClusterRollsBackToTheCommonCheckpointAndContinues) {
  const Case& c = GetParam();
  TempDir dir("recovery_test");
  ASSERT_FALSE(dir.path().empty());
  auto cluster_or = LocalCluster::Start(MakeConfig(c, dir.path()), c.shards);
  ASSERT_TRUE(cluster_or.ok()) << cluster_or.status();
  LocalCluster& cluster = **cluster_or;
  Workers workers(&cluster, c.workers);
  const std::vector<float> initial = Normal(kSeed);
  workers.Synchronize(initial);

  // Steps 0..4: every shard checkpoints after step 2 (next step 3).
  workers.RunUntil(5);
  for (int w = 0; w < c.workers; ++w) {
    std::vector<Attempt> expected;
    for (int64_t s = 0; s < 5; ++s) expected.push_back({s, true});
    EXPECT_EQ(workers.TakeLog(w), expected) << "worker " << w;
  }

  // The shard crashes (no final checkpoint) and restores step 3: behind.
  GTOPK_ASSERT_OK(cluster.RestartShard(c.restart_shard,
                                       /*write_checkpoint=*/false));
  for (uint32_t s = 0; s < c.shards; ++s) {
    EXPECT_EQ(cluster.shard(s).service()->next_step(),
              s == c.restart_shard ? 3 : 5)
        << "shard " << s;
  }

  // Step 5 fails once for every worker; Recover rolls the cluster back to
  // step 3 and everyone continues from there to step 8.
  const absl::Time start = absl::Now();
  workers.RunUntil(8);
  // Far below the 5 s step timeout: the failure cuts the step short and the
  // leader's fence stops the other shards' rounds.
  EXPECT_LT(absl::Now() - start, absl::Seconds(4));
  const std::vector<Attempt> expected = {{5, false}, {3, true}, {4, true},
                                         {5, true},  {6, true}, {7, true}};
  for (int w = 0; w < c.workers; ++w) {
    EXPECT_EQ(workers.TakeLog(w), expected) << "worker " << w;
  }

  Reference ref(c, initial);
  for (int64_t s = 0; s < 5; ++s) ref.Committed(s);
  ref.Failed(5);
  ref.RollBack(3);
  for (int64_t s = 3; s < 8; ++s) ref.Committed(s);

  for (int w = 0; w < c.workers; ++w) {
    EXPECT_EQ(workers.client(w).next_step(), 8);
    EXPECT_TRUE(BitEqual(workers.params(w), workers.params(0)))
        << "worker " << w << " differs from worker 0";
    EXPECT_TRUE(BitEqual(workers.params(w), ref.params()))
        << "worker " << w << " differs from the reference";
    EXPECT_TRUE(BitEqual(workers.client(w).residual(), ref.residual(w)))
        << "worker " << w << "'s residual differs from the reference";
  }
  auto server = cluster.ServerParams(kN);
  ASSERT_TRUE(server.ok()) << server.status();
  EXPECT_EQ(server->second, 8) << "shards disagree on the step";
  EXPECT_TRUE(BitEqual(server->first, ref.params()))
      << "the servers' parameters differ from the reference";

  // No shard retains a checkpoint of the abandoned steps: after the rollback
  // every retained step is one of the new timeline (<= 8, and step 6, the
  // new checkpoint, is there).
  for (uint32_t s = 0; s < c.shards; ++s) {
    auto steps = server::ListCheckpointSteps(dir.path(), s);
    ASSERT_TRUE(steps.ok()) << steps.status();
    EXPECT_EQ(*steps, (std::vector<int64_t>{3, 6})) << "shard " << s;
    auto at6 = server::ReadCheckpointAt(dir.path(), s, 6);
    ASSERT_TRUE(at6.ok()) << at6.status();
  }
}

INSTANTIATE_TEST_SUITE_P(
    Modes, BehindShardTest,
    ::testing::Values(Case{"gtopk_dgc_S2_follower_behind",
                           AggregationMode::kGtopk,
                           MomentumMode::kDgcCorrection, 3, 2, 1},
                      Case{"gtopk_global_S3_leader_behind",
                           AggregationMode::kGtopk, MomentumMode::kGlobal, 2, 3,
                           0},
                      Case{"topk_none_S2", AggregationMode::kTopk,
                           MomentumMode::kNone, 2, 2, 1},
                      Case{"dense_dgc_S2", AggregationMode::kDense,
                           MomentumMode::kDgcCorrection, 2, 2, 1}),
    [](const auto& info) { return info.param.name; });

TEST(RecoveryTest, NoCommonCheckpointFailsClearlyAndChangesNothing) {
  TempDir dir("recovery_test");
  ASSERT_FALSE(dir.path().empty());
  Case c;
  c.workers = 2;
  server::ServerConfig config = MakeConfig(c, dir.path());
  config.checkpoint_every = 2;
  config.checkpoint_keep = 1;
  auto cluster_or = LocalCluster::Start(config, 2);
  ASSERT_TRUE(cluster_or.ok()) << cluster_or.status();
  LocalCluster& cluster = **cluster_or;
  Workers workers(&cluster, 2);
  workers.Synchronize(Normal(kSeed));
  workers.RunUntil(2);
  // Shard 1's checkpoint of step 2, as if its later writes had failed.
  const std::string saved = dir.path() + "/saved-shard-1";
  ASSERT_TRUE(CopyFile(server::CheckpointPath(dir.path(), 1), saved));
  workers.RunUntil(4);
  GTOPK_ASSERT_OK(cluster.RestartShard(1, false, [&] {
    ASSERT_EQ(std::rename(saved.c_str(),
                          server::CheckpointPath(dir.path(), 1).c_str()),
              0);
  }));
  ASSERT_EQ(cluster.shard(1).service()->next_step(), 2);
  ASSERT_EQ(cluster.shard(0).service()->next_step(), 4);
  const std::vector<float> before = workers.params(0);

  for (int w = 0; w < 2; ++w) {
    WorkerClient& client = workers.client(w);
    auto step = client.Step(Gradient(4, w), absl::MakeSpan(workers.params(w)));
    EXPECT_THAT(step.status(), StatusIs(absl::StatusCode::kFailedPrecondition,
                                        HasSubstr("ahead of shard 1")));
    const absl::Time start = absl::Now();
    auto resumed = client.Recover(absl::MakeSpan(workers.params(w)));
    EXPECT_LT(absl::Now() - start, absl::Seconds(5)) << "within the deadline";
    EXPECT_THAT(resumed.status(),
                StatusIs(absl::StatusCode::kFailedPrecondition,
                         AllOf(HasSubstr("shard 0 at step 4 (checkpoints: 4)"),
                               HasSubstr("shard 1 at step 2 (checkpoints: 2)"),
                               HasSubstr("no common checkpoint"))));
    EXPECT_TRUE(BitEqual(workers.params(w), before)) << "worker " << w;
    EXPECT_EQ(client.next_step(), 4);
  }
  // Nothing was rolled back or half-applied.
  EXPECT_EQ(cluster.shard(0).service()->next_step(), 4);
  EXPECT_EQ(cluster.shard(1).service()->next_step(), 2);
  auto server = cluster.ServerParams(kN);
  ASSERT_TRUE(server.ok()) << server.status();
  const uint64_t mid = server::ShardRange(kN, 2, 1).first;
  EXPECT_TRUE(BitEqual(absl::MakeSpan(server->first).subspan(0, mid),
                       absl::MakeSpan(before).subspan(0, mid)))
      << "shard 0 changed";
  EXPECT_EQ(*server::ListCheckpointSteps(dir.path(), 0),
            std::vector<int64_t>{4});
}

// Issue 13, part 3: checkpoints that cannot be written. The directory is
// replaced by a regular file right after the parameters were initialised
// (a cause that works for root too), for the steps 0..2 with
// --checkpoint-every=1: every write fails, counted
// (gtopk_server_checkpoint_failures_total) and shown by the health service
// "gtopk.checkpoint" (NOT_SERVING) while the server stays SERVING. Shard 1
// then crashes and restarts with the directory back: it restores the last
// good checkpoint -- the initial state, step 0 -- and the cluster rolls back
// to it and continues. Before the fix no checkpoint of the initial state
// existed, so the restarted shard came back without parameters and Recover
// could only fail ("restarted without a checkpoint").
TEST(RecoveryTest, FailedCheckpointsAreLoudAndTheLastGoodOneIsRestorable) {
  TempDir dir("recovery_test");
  ASSERT_FALSE(dir.path().empty());
  Case c;
  c.workers = 2;
  server::ServerConfig config = MakeConfig(c, dir.path());
  config.checkpoint_every = 1;
  auto cluster_or = LocalCluster::Start(config, 2);
  ASSERT_TRUE(cluster_or.ok()) << cluster_or.status();
  LocalCluster& cluster = **cluster_or;
  Workers workers(&cluster, 2);
  const std::vector<float> initial = Normal(kSeed);
  workers.Synchronize(initial);
  for (uint32_t s = 0; s < 2; ++s) {
    auto at0 = server::ReadCheckpoint(dir.path(), s);
    ASSERT_TRUE(at0.ok()) << "no checkpoint of the initial state: "
                          << at0.status();
    EXPECT_EQ(at0->next_step, 0);
  }
  const std::string aside = dir.path() + ".aside";
  ASSERT_EQ(std::rename(dir.path().c_str(), aside.c_str()), 0);
  {
    std::ofstream file(dir.path());
    file << "not a directory\n";
  }
  workers.RunUntil(3);  // the steps stand; their checkpoints fail
  for (uint32_t s = 0; s < 2; ++s) {
    SCOPED_TRACE(absl::StrCat("shard ", s));
    EXPECT_EQ(cluster.shard(s).service()->metrics().checkpoint_failures(), 3);
    auto checkpoints = server::CheckHealth(cluster.peers()[s], absl::Seconds(2),
                                           server::kCheckpointHealthService);
    ASSERT_TRUE(checkpoints.ok()) << checkpoints.status();
    EXPECT_FALSE(*checkpoints);
    EXPECT_TRUE(server::CheckHealth(cluster.peers()[s], absl::Seconds(2))
                    .value_or(false));
  }
  GTOPK_ASSERT_OK(cluster.RestartShard(1, /*write_checkpoint=*/false, [&] {
    ASSERT_EQ(std::remove(dir.path().c_str()), 0);
    ASSERT_EQ(std::rename(aside.c_str(), dir.path().c_str()), 0);
  }));
  ASSERT_EQ(cluster.shard(1).service()->next_step(), 0)
      << "shard 1 did not restore its last good checkpoint";
  // The cluster rolls back to step 0 (both shards retain it) and goes on;
  // the first successful write makes shard 0's checkpoints healthy again.
  workers.RunUntil(4);
  EXPECT_TRUE(server::CheckHealth(cluster.peers()[0], absl::Seconds(2),
                                  server::kCheckpointHealthService)
                  .value_or(false));
  EXPECT_TRUE(BitEqual(workers.params(0), workers.params(1)));
  auto server = cluster.ServerParams(kN);
  ASSERT_TRUE(server.ok()) << server.status();
  EXPECT_EQ(server->second, 4);
  EXPECT_TRUE(BitEqual(server->first, workers.params(0)));
}

TEST(RecoveryTest, RecoverWhenShardsAgreeChangesNothing) {
  TempDir dir("recovery_test");
  Case c;
  c.workers = 2;
  auto cluster_or = LocalCluster::Start(MakeConfig(c, dir.path()), 2);
  ASSERT_TRUE(cluster_or.ok()) << cluster_or.status();
  LocalCluster& cluster = **cluster_or;
  Workers workers(&cluster, 2);
  workers.Synchronize(Normal(kSeed));
  workers.RunUntil(4);
  const std::vector<float> before = workers.params(1);
  auto resumed = workers.client(1).Recover(absl::MakeSpan(workers.params(1)));
  ASSERT_TRUE(resumed.ok()) << resumed.status();
  EXPECT_EQ(*resumed, 4);
  EXPECT_TRUE(BitEqual(workers.params(1), before));
  // Non-leaders refuse Recover, naming the leader.
  auto stub = v1::Aggregator::NewStub(grpc::CreateChannel(
      cluster.peers()[1], grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
  v1::RecoverResponse response;
  const grpc::Status st = stub->Recover(&ctx, v1::RecoverRequest(), &response);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(st.error_message(), HasSubstr(cluster.leader()));
  // The run continues normally.
  workers.RunUntil(6);
  EXPECT_TRUE(BitEqual(workers.params(0), workers.params(1)));
}

// Workers failing together call Recover together: callers arriving while a
// recovery runs join it and get its outcome -- here the error naming the
// shard that is down -- instead of "another recovery is still running".
TEST(RecoveryTest, ConcurrentRecoverCallsShareTheOutcomeNamingTheDeadShard) {
  TempDir dir("recovery_test");
  Case c;
  c.workers = 2;
  auto cluster_or = LocalCluster::Start(MakeConfig(c, dir.path()), 2);
  ASSERT_TRUE(cluster_or.ok()) << cluster_or.status();
  LocalCluster& cluster = **cluster_or;
  Workers workers(&cluster, 2);
  workers.Synchronize(Normal(kSeed));
  workers.RunUntil(2);
  GTOPK_ASSERT_OK(cluster.shard(1).Shutdown(absl::ZeroDuration(), false));
  server::AggregatorService* leader = cluster.shard(0).service();
  const absl::Time deadline = absl::Now() + absl::Seconds(1);
  std::vector<absl::StatusOr<v1::RecoverResponse>> results(
      3, absl::UnknownError("not run"));
  std::vector<std::thread> threads;
  for (int i = 0; i < 3; ++i) {
    threads.emplace_back([&, i] {
      absl::SleepFor(absl::Milliseconds(100 * i));
      results[i] = leader->RecoverCluster(deadline);
    });
  }
  for (auto& t : threads) t.join();
  for (int i = 0; i < 3; ++i) {
    EXPECT_FALSE(results[i].ok()) << "caller " << i;
    EXPECT_THAT(results[i].status().message(),
                AllOf(HasSubstr("shard 1 ("), HasSubstr("GetShardState"),
                      Not(HasSubstr("another recovery"))))
        << "caller " << i;
  }
}

TEST(RecoveryTest, ShardStateAndRollbackValidateTheirInput) {
  TempDir dir("recovery_test");
  Case c;
  c.workers = 1;
  auto cluster_or = LocalCluster::Start(MakeConfig(c, dir.path()), 2);
  ASSERT_TRUE(cluster_or.ok()) << cluster_or.status();
  LocalCluster& cluster = **cluster_or;
  Workers workers(&cluster, 1);
  workers.Synchronize(Normal(kSeed));
  workers.RunUntil(4);  // checkpoint after step 2 (next step 3)
  auto stub = v1::Aggregator::NewStub(grpc::CreateChannel(
      cluster.peers()[1], grpc::InsecureChannelCredentials()));
  auto call = [&](auto method, const auto& request, auto* response) {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
    return (stub.get()->*method)(&ctx, request, response);
  };
  v1::ShardState state;
  ASSERT_TRUE(call(&v1::Aggregator::Stub::GetShardState,
                   v1::ShardStateRequest(), &state)
                  .ok());
  EXPECT_EQ(state.shard_id(), 1u);
  EXPECT_TRUE(state.initialized());
  EXPECT_EQ(state.next_step(), 4);
  // The initial state (step 0) is a checkpoint too (written when the
  // parameters were initialised).
  EXPECT_EQ(std::vector<int64_t>(state.checkpoint_steps().begin(),
                                 state.checkpoint_steps().end()),
            (std::vector<int64_t>{0, 3}));
  v1::RollbackRequest request;
  v1::RollbackResponse response;
  request.set_shard_id(0);  // the wrong shard
  request.set_step(3);
  grpc::Status st =
      call(&v1::Aggregator::Stub::RollbackShard, request, &response);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(st.error_message(), HasSubstr("sent to shard 1"));
  request.set_shard_id(1);
  request.set_step(-1);
  st = call(&v1::Aggregator::Stub::RollbackShard, request, &response);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  request.set_step(2);  // not retained
  st = call(&v1::Aggregator::Stub::RollbackShard, request, &response);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(st.error_message(),
              AllOf(HasSubstr("at step 4"), HasSubstr("step 2")));
  EXPECT_EQ(cluster.shard(1).service()->next_step(), 4) << "changed anyway";
  // Recover rejects an unknown rank.
  auto leader = v1::Aggregator::NewStub(grpc::CreateChannel(
      cluster.leader(), grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  v1::RecoverRequest bad;
  bad.set_rank(7);
  v1::RecoverResponse answer;
  EXPECT_EQ(leader->Recover(&ctx, bad, &answer).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
}

// Joins one worker (any rank, n = 64) and returns the cluster fingerprint
// the leader handed out (0 on failure).
uint64_t JoinedFingerprint(v1::Aggregator::Stub& leader) {
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
  v1::JoinRequest request;
  request.set_requested_rank(-1);
  request.set_n(64);
  v1::JoinResponse response;
  if (!leader.Join(&ctx, request, &response).ok()) return 0;
  return response.cluster().cluster_fingerprint();
}

// Leader waits end when the waiting shard's RPC is cancelled: the others
// waiting in the same round hear of it at once, not at the step timeout.
TEST(LeaderWaitTest, CancelledCommitVoteEndsTheRoundForEveryShard) {
  Case c;
  server::ServerConfig config = MakeConfig(c, "");
  config.checkpoint_dir.clear();
  config.checkpoint_every = 0;
  config.step_timeout = absl::Seconds(30);
  auto cluster_or = LocalCluster::Start(config, 3);
  ASSERT_TRUE(cluster_or.ok()) << cluster_or.status();
  auto stub = v1::Aggregator::NewStub(grpc::CreateChannel(
      (*cluster_or)->leader(), grpc::InsecureChannelCredentials()));
  // A Join fixes n, so the leader has a cluster fingerprint; the shards'
  // calls below carry it, as a shard's own calls do.
  const uint64_t fingerprint = JoinedFingerprint(*stub);
  ASSERT_NE(fingerprint, 0u);
  grpc::ClientContext cancelled_ctx, other_ctx;
  for (auto* ctx : {&cancelled_ctx, &other_ctx}) {
    ctx->set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(60)));
  }
  grpc::Status other_status;
  absl::Duration other_took;
  std::thread other([&] {
    v1::CommitRequest request;
    request.set_step(0);
    request.set_shard_id(2);
    request.set_cluster_fingerprint(fingerprint);
    v1::CommitResponse response;
    const absl::Time start = absl::Now();
    other_status = stub->CommitStep(&other_ctx, request, &response);
    other_took = absl::Now() - start;
  });
  std::thread cancelled([&] {
    v1::CommitRequest request;
    request.set_step(0);
    request.set_shard_id(1);
    request.set_cluster_fingerprint(fingerprint);
    v1::CommitResponse response;
    stub->CommitStep(&cancelled_ctx, request, &response).IgnoreError();
  });
  absl::SleepFor(absl::Milliseconds(300));
  cancelled_ctx.TryCancel();
  cancelled.join();
  other.join();
  EXPECT_EQ(other_status.error_code(), grpc::StatusCode::ABORTED);
  EXPECT_THAT(other_status.error_message(),
              AllOf(HasSubstr("shard 1"), HasSubstr("cancelled")));
  EXPECT_LT(other_took, absl::Seconds(3)) << "waited for the step timeout";
}

TEST(LeaderWaitTest, CancelledThresholdRequestEndsTheRoundForEveryShard) {
  Case c;
  server::ServerConfig config = MakeConfig(c, "");
  config.checkpoint_dir.clear();
  config.checkpoint_every = 0;
  config.step_timeout = absl::Seconds(30);
  auto cluster_or = LocalCluster::Start(config, 3);
  ASSERT_TRUE(cluster_or.ok()) << cluster_or.status();
  auto stub = v1::Aggregator::NewStub(grpc::CreateChannel(
      (*cluster_or)->leader(), grpc::InsecureChannelCredentials()));
  // A Join fixes n, so the leader has a cluster fingerprint; the shards'
  // calls below carry it, as a shard's own calls do.
  const uint64_t fingerprint = JoinedFingerprint(*stub);
  ASSERT_NE(fingerprint, 0u);
  auto request_for = [fingerprint](uint32_t shard) {
    v1::ThresholdRequest r;
    r.set_cluster_fingerprint(fingerprint);
    r.set_step(0);
    r.set_shard_id(shard);
    r.set_k(1);
    r.set_level(0);
    for (int b = 0; b < 2048; ++b) r.add_histogram(b == 5 ? 1 : 0);
    return r;
  };
  grpc::ClientContext cancelled_ctx, other_ctx;
  for (auto* ctx : {&cancelled_ctx, &other_ctx}) {
    ctx->set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(60)));
  }
  grpc::Status other_status;
  absl::Duration other_took;
  std::thread other([&] {
    v1::ThresholdResponse response;
    const absl::Time start = absl::Now();
    other_status =
        stub->ExchangeThreshold(&other_ctx, request_for(2), &response);
    other_took = absl::Now() - start;
  });
  std::thread cancelled([&] {
    v1::ThresholdResponse response;
    stub->ExchangeThreshold(&cancelled_ctx, request_for(1), &response)
        .IgnoreError();
  });
  absl::SleepFor(absl::Milliseconds(300));
  cancelled_ctx.TryCancel();
  cancelled.join();
  other.join();
  EXPECT_EQ(other_status.error_code(), grpc::StatusCode::ABORTED);
  EXPECT_THAT(other_status.error_message(),
              AllOf(HasSubstr("shard 1"), HasSubstr("cancelled")));
  EXPECT_LT(other_took, absl::Seconds(3)) << "waited for the step timeout";
}

}  // namespace
}  // namespace gtopk
