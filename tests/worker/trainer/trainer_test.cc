// gtopk-worker's trainer: without a cluster, the end-of-run replica check
// (a rank whose final parameters differ from the servers' fails the run),
// the flag checks that must come before the join and the recovery budget;
// with an in-process cluster, retries bounded by time, not by a count.
#include "worker/trainer/trainer.h"

#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <functional>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/local_cluster.h"
#include "tests/testing/status_matchers.h"
#include "worker/client.h"
#include "worker/trainer/model.h"
#include "worker/trainer/synthetic_model.h"
#include "worker/trainer/torch_module.h"
#include "worker/trainer/training_data.h"

namespace gtopk {
namespace worker {
namespace {

using ::gtopk::testing::StatusIs;
using ::testing::AllOf;
using ::testing::HasSubstr;

TEST(TrainerTest, DifferingFinalChecksumsFailTheRun) {
  const uint64_t mine = Fnv1a64("abc", 3);
  const uint64_t servers = Fnv1a64("abd", 3);
  ASSERT_NE(mine, servers);
  EXPECT_THAT(CheckReplicaChecksums(2, mine, servers, 17),
              StatusIs(absl::StatusCode::kInternal,
                       AllOf(HasSubstr("rank 2's final parameters"),
                             HasSubstr("e71fa2190541574b"),  // FNV-1a("abc")
                             HasSubstr("at step 17"),
                             HasSubstr("differ from the servers'"))));
  GTOPK_EXPECT_OK(CheckReplicaChecksums(2, mine, mine, 17));
}

// Every flag that needs no cluster is checked by ValidateOptions, before
// any connection: the consistency checks (--mode, --selector, codecs,
// --density, --lr, --momentum) and the leader address's syntax.
TEST(TrainerTest, ValidateOptionsNamesTheFlag) {
  struct Case {
    const char* flag;
    std::function<void(TrainerOptions&)> edit;
  };
  const std::vector<Case> cases = {
      {"--server", [](TrainerOptions& o) { o.server = "nonsense"; }},
      {"--server", [](TrainerOptions& o) { o.server = "host:port"; }},
      {"--server", [](TrainerOptions& o) { o.server = "host:0"; }},
      {"--server", [](TrainerOptions& o) { o.server = "host:65536"; }},
      {"--server", [](TrainerOptions& o) { o.server = ":50051"; }},
      {"--rank", [](TrainerOptions& o) { o.rank = -2; }},
      {"--rank", [](TrainerOptions& o) { o.rank = 65536; }},
      {"--mode", [](TrainerOptions& o) { o.mode = "sparse"; }},
      {"--selector", [](TrainerOptions& o) { o.selector = "top"; }},
      {"--index-codec", [](TrainerOptions& o) { o.index_codec = "zip"; }},
      {"--value-codec", [](TrainerOptions& o) { o.value_codec = "fp8"; }},
      {"--density", [](TrainerOptions& o) { o.density = 2.0; }},
      {"--density", [](TrainerOptions& o) { o.density = 0.0; }},
      {"--lr", [](TrainerOptions& o) { o.lr = std::nan(""); }},
      {"--lr", [](TrainerOptions& o) { o.lr = -0.1; }},
      {"--momentum", [](TrainerOptions& o) { o.momentum = 1.0; }},
      {"--momentum", [](TrainerOptions& o) { o.momentum = -0.5; }},
      {"--epochs", [](TrainerOptions& o) { o.epochs = 0; }},
      {"--steps", [](TrainerOptions& o) { o.steps = -1; }},
      {"--train-limit", [](TrainerOptions& o) { o.train_limit = -1; }},
      {"--test-limit", [](TrainerOptions& o) { o.test_limit = -1; }},
      {"--eval-every", [](TrainerOptions& o) { o.eval_every = -1; }},
      {"--compute-ms", [](TrainerOptions& o) { o.compute_ms = -1; }},
      {"--recovery-timeout",
       [](TrainerOptions& o) { o.recovery_timeout = absl::Seconds(-1); }},
      {"--recovery-timeout",
       [](TrainerOptions& o) { o.recovery_timeout = absl::Hours(25); }},
      {"--recovery-timeout",
       [](TrainerOptions& o) {
         o.recovery_timeout = absl::InfiniteDuration();
       }},
      {"--testing-final-check-delay",
       [](TrainerOptions& o) { o.final_check_delay = absl::Seconds(-1); }},
  };
  for (const Case& c : cases) {
    TrainerOptions o;
    o.server = "127.0.0.1:50051";
    o.model = "synthetic:10";
    c.edit(o);
    EXPECT_THAT(ValidateOptions(o),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(c.flag)))
        << c.flag;
  }
  TrainerOptions ok;
  ok.server = "gtopk-shard-0.gtopk-shard:50051";
  ok.model = "synthetic:10";
  ok.mode = "topk";
  ok.selector = "dgc";
  ok.index_codec = "raw";
  ok.value_codec = "bf16";
  ok.density = 1.0;
  ok.lr = 0.5;
  ok.momentum = 0.0;
  GTOPK_EXPECT_OK(ValidateOptions(ok));
  ok.server = "[::1]:50051";
  GTOPK_EXPECT_OK(ValidateOptions(ok));
}

// Trainer::Prepare is the local half of a run: what it refuses is refused
// before any connection (gtopk-worker exits 2 then), and what it accepts
// has not dialled anything yet. Here nothing listens at --server: Train's
// join fails (gtopk-worker exits 1 then), and a second Train is refused.
TEST(TrainerTest, PrepareChecksLocallyAndTrainRunsOnce) {
  TrainerOptions o;
  o.server = "127.0.0.1:1";  // nothing listens there
  o.model = "synthetic:10";
  o.rpc_timeout = absl::Seconds(1);
  o.summary_json = "/nonexistent/dir/worker.json";
  EXPECT_THAT(Trainer::Prepare(o).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("--summary-json")));
  o.summary_json.clear();
  o.model = "mlp";
  o.data_dir = "/nonexistent/fashion";
  EXPECT_THAT(
      Trainer::Prepare(o).status(),
      StatusIs(absl::StatusCode::kNotFound, HasSubstr("/nonexistent/fashion")));
  o.model = "synthetic:10";
  absl::StatusOr<Trainer> trainer = Trainer::Prepare(o);
  ASSERT_TRUE(trainer.ok()) << trainer.status();
  EXPECT_FALSE(trainer->Train().ok());
  EXPECT_THAT(trainer->Train(), StatusIs(absl::StatusCode::kFailedPrecondition,
                                         HasSubstr("called again")));
}

// Whether a library whose file name contains `name` is mapped into this
// process (/proc/self/maps): what the loader did, not what it says.
bool Mapped(const std::string& name) {
  std::ifstream maps("/proc/self/maps");
  std::string line;
  while (std::getline(maps, line)) {
    if (line.find(name) != std::string::npos) return true;
  }
  return false;
}

// libtorch comes in with the first torch model (worker/trainer/
// torch_module.h), not with the program: a synthetic run never maps it;
// MakeTorchModel("mlp") loads the module from this build tree and its
// model has the MLP's parameter count (784*256 + 256 + 256*10 + 10).
// Needs a process of its own (ctest runs each case of this file alone,
// PER_CASE): another case's torch model would have loaded libtorch first.
TEST(TorchModuleTest, LibtorchIsLoadedByTheFirstTorchModelOnly) {
  ASSERT_FALSE(Mapped("libtorch_cpu"));
  EXPECT_FALSE(TorchModuleLoaded());
  TrainerOptions o;
  o.server = "127.0.0.1:1";  // nothing listens there
  o.model = "synthetic:1000";
  o.rpc_timeout = absl::Seconds(1);
  GTOPK_ASSERT_OK(Trainer::Prepare(o).status());
  EXPECT_FALSE(Mapped("libtorch_cpu"));
  EXPECT_FALSE(Mapped(kTorchModuleFile));
  EXPECT_FALSE(TorchModuleLoaded());
  GTOPK_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Model> model,
                             MakeTorchModel("mlp", 1, 1));
  EXPECT_EQ(model->n(), size_t{784 * 256 + 256 + 256 * 10 + 10});
  EXPECT_TRUE(TorchModuleLoaded());
  EXPECT_TRUE(Mapped(kTorchModuleFile));
  EXPECT_TRUE(Mapped("libtorch_cpu"));
  // Errors still come from the module: another name, bad threads.
  EXPECT_THAT(MakeTorchModel("resnet", 1, 1).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("unknown model \"resnet\"")));
  EXPECT_THAT(
      MakeTorchModel("mlp", 1, 0).status(),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--threads")));
}

// The candidates: GTOPK_TORCH_MODULE alone when set (a relative path made
// absolute), else beside the executable, then ../lib/gtopk/, then this
// build tree's module.
TEST(TorchModuleTest, CandidatesFollowTheDocumentedOrder) {
  ASSERT_EQ(unsetenv("GTOPK_TORCH_MODULE"), 0);
  char exe[4096];
  const ssize_t len = readlink("/proc/self/exe", exe, sizeof(exe) - 1);
  ASSERT_GT(len, 0);
  const std::string self(exe, static_cast<size_t>(len));
  const std::string dir = self.substr(0, self.rfind('/'));
  const std::vector<std::string> got = TorchModuleCandidates();
  ASSERT_EQ(got.size(), 3u);
  EXPECT_EQ(got[0], dir + "/libgtopk_torch_model.so");
  EXPECT_EQ(got[1], dir + "/../lib/gtopk/libgtopk_torch_model.so");
  EXPECT_THAT(got[2], ::testing::EndsWith("/worker/libgtopk_torch_model.so"));
  std::ifstream built(got[2]);
  EXPECT_TRUE(built.good()) << got[2];
  ASSERT_EQ(setenv("GTOPK_TORCH_MODULE", "/opt/x/m.so", 1), 0);
  EXPECT_EQ(TorchModuleCandidates(), std::vector<std::string>{"/opt/x/m.so"});
  // Relative: the working directory's.
  ASSERT_EQ(setenv("GTOPK_TORCH_MODULE", "rel/m.so", 1), 0);
  char cwd[4096];
  ASSERT_NE(getcwd(cwd, sizeof(cwd)), nullptr);
  EXPECT_EQ(TorchModuleCandidates(),
            std::vector<std::string>{std::string(cwd) + "/rel/m.so"});
  ASSERT_EQ(setenv("GTOPK_TORCH_MODULE", "", 1), 0);
  EXPECT_EQ(TorchModuleCandidates().size(), 3u);
  ASSERT_EQ(unsetenv("GTOPK_TORCH_MODULE"), 0);
}

TEST(TrainerTest, RecoveryTimeoutDefaultsToFourStepTimeouts) {
  TrainerOptions o;
  EXPECT_EQ(EffectiveRecoveryTimeout(o, absl::Seconds(5)), absl::Seconds(20));
  o.recovery_timeout = absl::ZeroDuration();
  EXPECT_EQ(EffectiveRecoveryTimeout(o, absl::Seconds(5)),
            absl::ZeroDuration());
  o.recovery_timeout = absl::Minutes(3);
  EXPECT_EQ(EffectiveRecoveryTimeout(o, absl::Seconds(5)), absl::Minutes(3));
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

size_t CountOf(const std::string& text, const std::string& what) {
  size_t count = 0;
  for (size_t at = text.find(what); at != std::string::npos;
       at = text.find(what, at + 1)) {
    ++count;
  }
  return count;
}

// Issue 13, part 1: a trainer whose step fails again and again for longer
// than a count of retries allowed (the old --step-retries=3 ended the run
// at the 4th failure in a row, about 2 s here) keeps recovering while its
// time budget lasts, and finishes once the cluster can step again: here
// the other worker (rank 1, a WorkerClient of the test) does not push for
// 5 s, so every attempt of the trainer's step 0 fails with
// DEADLINE_EXCEEDED after the 400 ms step timeout. The final parameters
// equal rank 1's and the servers'. Run with both selections: layer-wise,
// the trainer's steps are overlapped (its failed attempts are
// FinishOverlappedStep's, the retries the plain Step with a zero gradient).
void RetriesAreBoundedByTime(SelectionKind selection) {
  constexpr uint64_t kN = 1000;
  constexpr int kSteps = 4;
  server::ServerConfig config;
  config.num_workers = 2;
  config.selection = selection;
  config.bucket_mb = 300 * 4.0 / (1 << 20);  // layerwise only
  config.optimizer.density = 0.05;
  config.optimizer.momentum = 0.0f;  // a retry's push is the first one's
  config.step_timeout = absl::Milliseconds(400);
  auto cluster_or = ::gtopk::testing::LocalCluster::Start(config, 1);
  ASSERT_TRUE(cluster_or.ok()) << cluster_or.status();
  ::gtopk::testing::LocalCluster& cluster = **cluster_or;

  char dir_template[] = "/tmp/gtopk_trainer_test_XXXXXX";
  ASSERT_NE(mkdtemp(dir_template), nullptr);
  const std::string summary = std::string(dir_template) + "/rank0.json";

  TrainerOptions o;
  o.server = cluster.leader();
  o.rank = 0;
  o.model = "synthetic:" + std::to_string(kN);
  o.steps = kSteps;
  o.rpc_timeout = absl::Seconds(20);
  o.recovery_timeout = absl::Seconds(30);
  o.summary_json = summary;
  ::testing::internal::CaptureStderr();
  absl::Status trainer_status;
  const absl::Time start = absl::Now();
  std::atomic<bool> trainer_done{false};
  std::thread trainer([&] {
    trainer_status = RunTrainer(o);
    trainer_done = true;
  });

  ClientOptions co;
  co.leader_address = cluster.leader();
  co.requested_rank = 1;
  co.n = kN;
  absl::StatusOr<std::unique_ptr<WorkerClient>> client =
      WorkerClient::Connect(co);
  std::vector<float> params(kN, 0.0f);
  absl::Status rank1 = client.status();
  if (rank1.ok()) {
    rank1 = (*client)->SynchronizeParameters(absl::MakeSpan(params)).status();
  }
  // Rank 1 stalls, then steps, retrying each failed step (a zero gradient:
  // the first attempt's is in the residual) until the test's deadline.
  absl::SleepFor(absl::Seconds(5));
  std::mt19937_64 rng(7);
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  const absl::Time deadline = absl::Now() + absl::Seconds(40);
  for (int step = 0; rank1.ok() && step < kSteps; ++step) {
    std::vector<float> grad(kN);
    for (float& g : grad) g = uniform(rng);
    for (;;) {
      absl::StatusOr<StepStats> stats =
          (*client)->Step(grad, absl::MakeSpan(params));
      if (stats.ok()) break;
      // A trainer that gave up leaves rank 1 nobody to step with.
      if (absl::Now() > deadline || trainer_done) {
        rank1 = stats.status();
        break;
      }
      std::fill(grad.begin(), grad.end(), 0.0f);
    }
  }
  trainer.join();
  const absl::Duration took = absl::Now() - start;
  const std::string log = ::testing::internal::GetCapturedStderr();
  GTOPK_ASSERT_OK(rank1);
  GTOPK_EXPECT_OK(trainer_status) << log;
  // More failures in a row than the old count allowed, all of step 0.
  EXPECT_GE(CountOf(log, "rank 0: step 0 failed"), 4u) << log;
  EXPECT_GE(took, absl::Seconds(5));
  EXPECT_NE(log.find("since the first failure"), std::string::npos) << log;

  const std::string json = ReadFile(summary);
  const std::string mine =
      absl::StrFormat("\"param_checksum\": \"%016x\"",
                      Fnv1a64(params.data(), params.size() * sizeof(float)));
  EXPECT_NE(json.find(mine), std::string::npos)
      << "rank 0's parameters differ from rank 1's (" << mine << "):\n"
      << json;
  auto servers = cluster.ServerParams(kN);
  ASSERT_TRUE(servers.ok()) << servers.status();
  EXPECT_EQ(servers->second, kSteps);
  EXPECT_EQ(Fnv1a64(servers->first.data(), kN * sizeof(float)),
            Fnv1a64(params.data(), kN * sizeof(float)));
  std::remove(summary.c_str());
  rmdir(dir_template);
}

TEST(TrainerTest, RetriesAreBoundedByTimeNotByACount) {
  RetriesAreBoundedByTime(SelectionKind::kThreshold);
}

TEST(TrainerTest, OverlappedStepsAreRecoveredAndRetried) {
  RetriesAreBoundedByTime(SelectionKind::kLayerwise);
}

// A --recovery-timeout shorter than one Recover call's time (the step
// timeout + 1 s) still allows one call, as worker/flags.md says: before,
// the first check found the budget already spent and the run ended at the
// first failure with "0 Recover call(s)" (issue 42's break-it run:
// --recovery-timeout=20s with the default 30 s step timeout).
TEST(TrainerTest, ARecoveryBudgetShorterThanACallStillAllowsOneCall) {
  constexpr uint64_t kN = 1000;
  server::ServerConfig config;
  config.num_workers = 2;
  config.optimizer.density = 0.05;
  config.step_timeout = absl::Milliseconds(400);
  auto cluster_or = ::gtopk::testing::LocalCluster::Start(config, 1);
  ASSERT_TRUE(cluster_or.ok()) << cluster_or.status();
  ::gtopk::testing::LocalCluster& cluster = **cluster_or;
  // Rank 1 joins and never steps: every step of rank 0 fails.
  ClientOptions co;
  co.leader_address = cluster.leader();
  co.requested_rank = 1;
  co.n = kN;
  absl::StatusOr<std::unique_ptr<WorkerClient>> rank1 =
      WorkerClient::Connect(co);
  ASSERT_TRUE(rank1.ok()) << rank1.status();
  TrainerOptions o;
  o.server = cluster.leader();
  o.rank = 0;
  o.model = "synthetic:" + std::to_string(kN);
  o.steps = 2;
  o.rpc_timeout = absl::Seconds(20);
  o.recovery_timeout = absl::Milliseconds(500);  // < 400 ms + 1 s
  ::testing::internal::CaptureStderr();
  const absl::Status status = RunTrainer(o);
  const std::string log = ::testing::internal::GetCapturedStderr();
  EXPECT_FALSE(status.ok());
  EXPECT_NE(log.find("recovering"), std::string::npos) << log;
  EXPECT_EQ(status.message().find("0 Recover call(s)"), std::string::npos)
      << status;
}

// FAILED_PRECONDITION from a step means "shards at different steps" once:
// one Recover repairs that. The same code again after a successful Recover
// is a state no retry changes -- here a step whose update would overflow
// the parameters to -inf, refused by the servers every time -- and must end
// the run at once with the servers' message, not after --recovery-timeout
// (60 s here) of identical failures.
TEST(TrainerTest, RepeatedFailedPreconditionEndsTheRunAtOnce) {
  constexpr uint64_t kN = 1000;
  server::ServerConfig config;
  config.num_workers = 2;
  config.optimizer.density = 0.05;
  config.optimizer.lr = 1.0f;
  config.optimizer.momentum = 0.0f;
  config.optimizer.momentum_mode = MomentumMode::kNone;
  config.step_timeout = absl::Seconds(5);
  auto cluster_or = ::gtopk::testing::LocalCluster::Start(config, 1);
  ASSERT_TRUE(cluster_or.ok()) << cluster_or.status();
  ::gtopk::testing::LocalCluster& cluster = **cluster_or;

  // The test's worker is rank 0: parameters near -FLT_MAX, and a gradient
  // that pushes them past it.
  ClientOptions co;
  co.leader_address = cluster.leader();
  co.requested_rank = 0;
  co.n = kN;
  absl::StatusOr<std::unique_ptr<WorkerClient>> client =
      WorkerClient::Connect(co);
  GTOPK_ASSERT_OK(client.status());
  std::vector<float> params(kN, -3.3e38f);
  GTOPK_ASSERT_OK((*client)->SynchronizeParameters(absl::MakeSpan(params)));

  TrainerOptions o;
  o.server = cluster.leader();
  o.rank = 1;
  o.model = "synthetic:" + std::to_string(kN);
  o.steps = 3;
  o.rpc_timeout = absl::Seconds(20);
  o.recovery_timeout = absl::Seconds(60);
  ::testing::internal::CaptureStderr();
  absl::Status trainer_status;
  std::atomic<bool> trainer_done{false};
  const absl::Time start = absl::Now();
  std::thread trainer([&] {
    trainer_status = RunTrainer(o);
    trainer_done = true;
  });
  std::vector<float> grad(kN, 2.0e38f);
  const absl::Time deadline = absl::Now() + absl::Seconds(50);
  absl::Status rank0;  // the last FAILED_PRECONDITION rank 0 saw
  while (!trainer_done && absl::Now() < deadline) {
    const absl::Status st =
        (*client)->Step(grad, absl::MakeSpan(params)).status();
    std::fill(grad.begin(), grad.end(), 0.0f);  // the residual keeps it
    if (st.ok()) {
      rank0 = st;
      break;
    }
    if (absl::IsFailedPrecondition(st)) {
      rank0 = st;
      (void)(*client)->Recover(absl::MakeSpan(params));
    }
  }
  trainer.join();
  const absl::Duration took = absl::Now() - start;
  const std::string log = ::testing::internal::GetCapturedStderr();
  EXPECT_THAT(rank0, StatusIs(absl::StatusCode::kFailedPrecondition,
                              HasSubstr("not finite")));
  EXPECT_THAT(trainer_status,
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       AllOf(HasSubstr("not finite"),
                             HasSubstr("again after a recovery"))))
      << log;
  EXPECT_LT(took, absl::Seconds(30)) << log;  // not the 60 s budget
  // Nothing was applied anywhere.
  auto servers = cluster.ServerParams(kN);
  ASSERT_TRUE(servers.ok()) << servers.status();
  EXPECT_EQ(servers->second, 0);
}

void PutBE32(std::string* out, uint32_t v) {
  for (int shift = 24; shift >= 0; shift -= 8) {
    out->push_back(static_cast<char>((v >> shift) & 0xff));
  }
}

// A Fashion-MNIST-shaped data set of `count` seeded random images and
// labels in `dir`, as the IDX files the trainer reads (plain IDX bytes under
// the .gz names: the reader takes both).
void WriteFakeFashionMnist(const std::string& dir, uint32_t train,
                           uint32_t test) {
  std::mt19937 rng(123);
  auto write = [&](const char* images, const char* labels, uint32_t count) {
    std::string img, lbl;
    PutBE32(&img, 0x803);
    PutBE32(&img, count);
    PutBE32(&img, 28);
    PutBE32(&img, 28);
    for (uint32_t i = 0; i < count * 28 * 28; ++i) {
      img.push_back(static_cast<char>(rng() & 0xff));
    }
    PutBE32(&lbl, 0x801);
    PutBE32(&lbl, count);
    for (uint32_t i = 0; i < count; ++i) {
      lbl.push_back(static_cast<char>(rng() % 10));
    }
    std::ofstream(dir + "/" + images, std::ios::binary) << img;
    std::ofstream(dir + "/" + labels, std::ios::binary) << lbl;
  };
  write("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz", train);
  write("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz", test);
}

// Issue 45: on a layer-wise cluster the trainer overlaps each step's
// exchange with the backward pass (autograd hooks report each parameter's
// gradient to the client as it is produced). The mlp (n = 203530: weights
// [0, 200704), ...) in buckets of 50000 values on two shards (the boundary
// at 101765 cuts the bucket [100000, 150000)), the cluster's full rule
// (lr, DGC momentum correction, weight decay), P = 2: after kSteps steps
// the servers' parameters and each rank's are bit-identical to the same
// run stepped without overlap (the client's Step after backward).
TEST(TrainerTest, OverlappedLayerwiseStepsMatchPlainSteps) {
  constexpr uint64_t kN = 784 * 256 + 256 + 256 * 10 + 10;
  constexpr int kSteps = 6;
  constexpr int kWorkers = 2;
  char dir_template[] = "/tmp/gtopk_trainer_overlap_XXXXXX";
  ASSERT_NE(mkdtemp(dir_template), nullptr);
  const std::string dir = dir_template;
  WriteFakeFashionMnist(dir, 256, 32);

  server::ServerConfig config;
  config.num_workers = kWorkers;
  config.selection = SelectionKind::kLayerwise;
  config.bucket_mb = 50000 * 4.0 / (1 << 20);
  config.optimizer.density = 0.01;
  config.optimizer.weight_decay = 1e-4f;
  config.step_timeout = absl::Seconds(20);
  ASSERT_EQ(config.optimizer.momentum_mode, MomentumMode::kDgcCorrection);

  std::vector<std::vector<float>> server_params;
  std::vector<std::vector<std::string>> checksums;
  for (const bool overlap : {true, false}) {
    auto cluster_or = ::gtopk::testing::LocalCluster::Start(config, 2);
    ASSERT_TRUE(cluster_or.ok()) << cluster_or.status();
    // Prepared one after the other: torch's seeded initialisation uses its
    // global generator, so two models made at once would differ run to run.
    std::vector<TrainerOptions> options(kWorkers);
    std::vector<Trainer> prepared;
    for (int rank = 0; rank < kWorkers; ++rank) {
      TrainerOptions& o = options[rank];
      o.server = (*cluster_or)->leader();
      o.rank = rank;
      o.model = "mlp";
      o.data_dir = dir;
      o.batch_size = 16;
      o.steps = kSteps;
      o.rpc_timeout = absl::Seconds(20);
      o.summary_json = absl::StrFormat("%s/rank%d_%d.json", dir, rank,
                                       static_cast<int>(overlap));
      o.testing_no_overlap = !overlap;
      absl::StatusOr<Trainer> trainer = Trainer::Prepare(o);
      GTOPK_ASSERT_OK(trainer.status());
      prepared.push_back(*std::move(trainer));
    }
    std::vector<absl::Status> status(kWorkers);
    std::vector<std::thread> trainers;
    for (int rank = 0; rank < kWorkers; ++rank) {
      trainers.emplace_back(
          [&, rank] { status[rank] = prepared[rank].Train(); });
    }
    for (auto& t : trainers) t.join();
    checksums.emplace_back();
    for (int rank = 0; rank < kWorkers; ++rank) {
      GTOPK_ASSERT_OK(status[rank])
          << "rank " << rank << " overlap " << overlap;
      const std::string path = absl::StrFormat("%s/rank%d_%d.json", dir, rank,
                                               static_cast<int>(overlap));
      const std::string json = ReadFile(path);
      const size_t at = json.find("\"param_checksum\"");
      ASSERT_NE(at, std::string::npos) << json;
      checksums.back().push_back(json.substr(at, 40));
      EXPECT_NE(json.find("\"exposed_seconds\": ["), std::string::npos);
      std::remove(path.c_str());
    }
    auto servers = (*cluster_or)->ServerParams(kN);
    ASSERT_TRUE(servers.ok()) << servers.status();
    EXPECT_EQ(servers->second, kSteps);
    server_params.push_back(std::move(servers->first));
  }
  for (const char* f :
       {"train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz",
        "t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"}) {
    std::remove((dir + "/" + f).c_str());
  }
  rmdir(dir.c_str());
  EXPECT_EQ(Fnv1a64(server_params[0].data(), kN * sizeof(float)),
            Fnv1a64(server_params[1].data(), kN * sizeof(float)))
      << "the overlapped run's parameters differ from the plain run's";
  EXPECT_EQ(checksums[0], checksums[1]);
  // Each rank's replica equals the servers' (the trainer's final check).
  EXPECT_EQ(checksums[0][0], checksums[0][1]);
}

// synthetic:N with --compute-ms on an overlapped (layer-wise) step: the
// gradient is the same seeded one, reported in kEmulatedBackwardRanges
// ranges that tile [0, n) from the end, range r not before (r + 1) / R of
// --compute-ms, each holding its final values when reported (the emulated
// backward pass of the overlap benchmark, bench/lowbw). Without a callback
// it is one sleep and no reports, as before.
TEST(GradientSourceTest, SyntheticComputeMsEmulatesABackwardPassFromTheEnd) {
  constexpr size_t kN = 1003;
  constexpr int64_t kComputeMs = 60;
  TrainerOptions o;
  o.seed = 11;
  const trainer_internal::Split none;
  SyntheticModel plain_model(kN, o.seed);
  trainer_internal::GradientSource plain(o, plain_model, none, true, 1, 1);
  GTOPK_ASSERT_OK(plain.Compute(3, 0, false));
  const std::vector<float> expected(plain.grad().begin(), plain.grad().end());

  o.compute_ms = kComputeMs;
  SyntheticModel model(kN, o.seed);
  trainer_internal::GradientSource source(o, model, none, true, 1, 1);
  struct Report {
    size_t begin, end;
    absl::Duration at;
    bool final_values;
  };
  std::vector<Report> reports;
  const absl::Time t0 = absl::Now();
  GTOPK_ASSERT_OK(source.Compute(3, 0, false, [&](size_t begin, size_t end) {
    bool same = true;
    for (size_t i = begin; i < end; ++i) {
      same = same && source.grad()[i] == expected[i];
    }
    reports.push_back({begin, end, absl::Now() - t0, same});
  }));
  ASSERT_EQ(reports.size(), trainer_internal::kEmulatedBackwardRanges);
  size_t end = kN;
  for (size_t r = 0; r < reports.size(); ++r) {
    EXPECT_EQ(reports[r].end, end) << "range " << r;
    EXPECT_LT(reports[r].begin, reports[r].end) << "range " << r;
    EXPECT_TRUE(reports[r].final_values) << "range " << r;
    EXPECT_GE(reports[r].at, absl::Milliseconds(kComputeMs) *
                                 static_cast<double>(r + 1) /
                                 static_cast<double>(reports.size()))
        << "range " << r << " came early";
    end = reports[r].begin;
  }
  EXPECT_EQ(end, 0u);
  EXPECT_TRUE(
      std::equal(expected.begin(), expected.end(), source.grad().begin()));

  // No callback (a plain step): one sleep of --compute-ms, the same values.
  const absl::Time t1 = absl::Now();
  GTOPK_ASSERT_OK(source.Compute(3, 0, false));
  EXPECT_GE(absl::Now() - t1, absl::Milliseconds(kComputeMs));
  EXPECT_TRUE(
      std::equal(expected.begin(), expected.end(), source.grad().begin()));
}

}  // namespace
}  // namespace worker
}  // namespace gtopk
