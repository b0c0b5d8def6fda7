#include "worker/trainer/trainer.h"

#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <fstream>
#include <memory>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "common/checksum.h"
#include "common/cluster_spec/cluster_spec.h"
#include "common/codec.h"
#include "common/host_port.h"
#include "common/selector.h"
#include "common/status_macros.h"
#include "worker/client.h"
#include "worker/trainer/idx_reader.h"
#include "worker/trainer/model.h"
#include "worker/trainer/recovery.h"
#include "worker/trainer/synthetic_model.h"
#include "worker/trainer/torch_module.h"
#include "worker/trainer/train_step.h"
#include "worker/trainer/training_data.h"
#include "worker/worker_metrics.h"

namespace gtopk {
namespace worker {
namespace {

using trainer_internal::ComputeAndStep;
using trainer_internal::Data;
using trainer_internal::Evaluator;
using trainer_internal::GradientSource;
using trainer_internal::LoadData;
using trainer_internal::OverlapSteps;
using trainer_internal::PrintLine;
using trainer_internal::StepAttempt;

// The default recovery time budget (--recovery-timeout), in the servers'
// step timeouts: a failed step's peers notice within one, the leader's
// Recover waits up to one for a restarting shard, and two are left for
// retried steps that fail again (e.g. while every worker rejoins after all
// of them were paused). worker/flags.md, docs/recovery.md.
constexpr int kDefaultRecoverySteps = 4;

using Clock = std::chrono::steady_clock;

double SecondsSince(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// Parses "synthetic:N" (1 <= N <= 2^32); nullopt when `model` is not
// synthetic.
absl::StatusOr<uint64_t> SyntheticSize(const std::string& model) {
  constexpr char kPrefix[] = "synthetic:";
  if (!absl::StartsWith(model, kPrefix)) return uint64_t{0};
  uint64_t n = 0;
  if (!absl::SimpleAtoi(model.substr(sizeof(kPrefix) - 1), &n) || n < 1 ||
      n > (uint64_t{1} << 32)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--model=", model, ": synthetic:N needs 1 <= N <= 2^32"));
  }
  return n;
}

// The optional consistency flags against the cluster spec (the check the
// Python optimizer makes too: common/cluster_spec/cluster_spec.h).
absl::Status CheckCluster(const TrainerOptions& o, const v1::ClusterSpec& c) {
  ExpectedSettings e;
  e.mode = o.mode;
  e.selector = o.selector;
  e.index_codec = o.index_codec;
  e.value_codec = o.value_codec;
  e.density = o.density;
  e.lr = o.lr;
  e.momentum = o.momentum;
  if (c.apply() == v1::APPLY_WORKERS) {
    // gtopk-worker trains with the servers' optimizer only.
    return absl::FailedPreconditionError(
        "the servers run with --apply=workers (gradient aggregation: each "
        "worker runs its own optimizer); gtopk-worker trains with the "
        "servers' SGD only (--apply=servers). Restart the servers with "
        "--apply=servers, or train with the Python package "
        "(gtopk.torch.DistributedOptimizer(optimizer, ...); "
        "docs/apply-modes.md)");
  }
  return CheckExpectedSettings(e, c, "--");
}

// The consistency flags' own syntax and ranges (before the join: a typo
// must not wait for the cluster to be reported).
absl::Status ValidateConsistencyFlags(const TrainerOptions& o) {
  if (o.mode && *o.mode != "gtopk" && *o.mode != "topk" && *o.mode != "dense") {
    return absl::InvalidArgumentError(absl::StrCat(
        "--mode must be gtopk, topk or dense, got \"", *o.mode, "\""));
  }
  if (o.selector) {
    SelectorRegistry registry;
    GTOPK_RETURN_IF_ERROR(RegisterBuiltinSelectors(&registry));
    const std::vector<std::string> names = registry.Names();
    if (std::find(names.begin(), names.end(), *o.selector) == names.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--selector must be one of ", absl::StrJoin(names, ", "),
                       "; got \"", *o.selector, "\""));
    }
  }
  if (o.index_codec) {
    if (absl::Status s = ParseIndexCodec(*o.index_codec).status(); !s.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--index-codec: ", s.message()));
    }
  }
  if (o.value_codec) {
    if (absl::Status s = ParseValueCodec(*o.value_codec).status(); !s.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--value-codec: ", s.message()));
    }
  }
  if (o.density && !(*o.density > 0.0 && *o.density <= 1.0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--density must be in (0, 1], got ", *o.density));
  }
  if (o.lr && !(std::isfinite(*o.lr) && *o.lr > 0.0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--lr must be finite and > 0, got ", *o.lr));
  }
  if (o.momentum && !(*o.momentum >= 0.0 && *o.momentum < 1.0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--momentum must be in [0, 1), got ", *o.momentum));
  }
  return absl::OkStatus();
}

std::string Hex64(uint64_t v) { return ChecksumText(v); }

std::string JsonNumber(double v) {
  if (!std::isfinite(v)) return "null";
  return absl::StrFormat("%.10g", v);
}

std::string JsonString(const std::string& s) {
  std::string out = "\"";
  for (char ch : s) {
    if (ch == '"' || ch == '\\') {
      out += '\\';
      out += ch;
    } else if (static_cast<unsigned char>(ch) < 0x20) {
      out += absl::StrFormat("\\u%04x", ch);
    } else {
      out += ch;
    }
  }
  return out + "\"";
}

// --- The steps of a training run, in the order Trainer::Prepare and
// Trainer::Train take them. ---

// --summary-json is written through <path>.tmp at the end of the run: fail
// now, not after the whole run, when that file cannot be written.
absl::Status CheckSummaryWritable(const std::string& summary_json) {
  if (summary_json.empty()) return absl::OkStatus();
  const std::string tmp = summary_json + ".tmp";
  std::FILE* f = std::fopen(tmp.c_str(), "a");
  if (f == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("--summary-json=", summary_json, ": cannot write ", tmp,
                     ": ", std::strerror(errno)));
  }
  std::fclose(f);
  std::remove(tmp.c_str());
  return absl::OkStatus();
}

// The model of --model (`synthetic_n` > 0: synthetic:N) on --device.
absl::StatusOr<std::unique_ptr<Model>> MakeModel(const TrainerOptions& o,
                                                 uint64_t synthetic_n) {
  if (synthetic_n == 0) {
    return MakeTorchModel(o.model, o.seed, o.threads, o.device == "cuda");
  }
  std::unique_ptr<Model> model =
      std::make_unique<SyntheticModel>(synthetic_n, o.seed);
  if (o.device == "cuda") {
    // The host makes the gradient, the device Step uses it (see
    // MakeTorchDeviceMirror): the worker's GPU path on a model of any n.
    return MakeTorchDeviceMirror(std::move(model));
  }
  return model;
}

// This worker's place in the cluster, from the join.
struct Membership {
  std::unique_ptr<WorkerClient> client;
  uint32_t rank = 0;
  uint32_t workers = 0;      // P
  bool leader_rank = false;  // rank 0: evaluates and prints the progress
  std::unique_ptr<WorkerMetrics> metrics;  // null without a registry
};

// Joins the cluster at --server as a worker of `n` parameters, checks the
// consistency flags against its spec, and registers the worker's metrics.
absl::StatusOr<Membership> JoinCluster(const TrainerOptions& o, size_t n) {
  ClientOptions co;
  co.leader_address = o.server;
  co.requested_rank = o.rank;
  co.n = n;
  // Every worker must train the same schedule: the leader compares these.
  co.run_length = absl::StrCat("--epochs=", o.epochs, " --steps=", o.steps,
                               " --batch-size=", o.batch_size,
                               " --train-limit=", o.train_limit);
  co.rpc_timeout = o.rpc_timeout;
  co.security = o.security;
  Membership m;
  GTOPK_ASSIGN_OR_RETURN(m.client, WorkerClient::Connect(co));
  const v1::ClusterSpec& cluster = m.client->cluster();
  GTOPK_RETURN_IF_ERROR(CheckCluster(o, cluster));
  m.rank = m.client->rank();
  m.workers = cluster.num_workers();
  if (o.metrics_registry != nullptr) {
    m.metrics = std::make_unique<WorkerMetrics>(
        *o.metrics_registry, m.rank,
        static_cast<uint32_t>(cluster.shards_size()), n);
  }
  m.leader_rank = m.rank == 0;
  return m;
}

// How long the run is, in steps.
struct RunLength {
  int64_t steps_per_epoch = 0;
  int64_t total_steps = 0;
};

// The epoch length (this rank's share of the training set in batches, or
// for synthetic:N the servers' epoch) and the run's length (--epochs,
// capped by --steps); warns on rank 0 when the servers' density warm-up
// counts in epochs of another length.
absl::StatusOr<RunLength> PlanRunLength(const TrainerOptions& o,
                                        const v1::ClusterSpec& cluster,
                                        bool synthetic, size_t train_size,
                                        uint32_t workers, bool leader_rank) {
  RunLength length;
  if (synthetic) {
    // No data, so no data epoch: the servers' epoch length when they set one
    // (their --density-warmup counts in it), else 100. --steps is the run
    // length; it used to be the epoch length too, which made a warm-up
    // epoch span the whole run and disagree with the servers.
    length.steps_per_epoch = cluster.optimizer().steps_per_epoch() > 0
                                 ? cluster.optimizer().steps_per_epoch()
                                 : 100;
  } else {
    length.steps_per_epoch =
        static_cast<int64_t>(train_size) / workers / o.batch_size;
    if (length.steps_per_epoch < 1) {
      return absl::FailedPreconditionError(absl::StrCat(
          "training set of ", train_size, " samples is too small for ", workers,
          " workers x --batch-size=", o.batch_size));
    }
  }
  length.total_steps = o.epochs * length.steps_per_epoch;
  if (o.steps > 0) {
    length.total_steps =
        synthetic ? o.steps : std::min(length.total_steps, o.steps);
  }
  if (!cluster.optimizer().density_warmup().empty() &&
      cluster.optimizer().steps_per_epoch() != length.steps_per_epoch &&
      leader_rank) {
    std::fprintf(stderr,
                 "warning: the servers' --steps-per-epoch=%lld differs from "
                 "this worker's %lld steps per epoch; density warm-up epochs "
                 "will not match data epochs\n",
                 static_cast<long long>(cluster.optimizer().steps_per_epoch()),
                 static_cast<long long>(length.steps_per_epoch));
  }
  return length;
}

// The servers' parameters into `params` (and, --device=cuda, the device
// model); returns the step they are at, where this run starts. The shards
// may be at different steps (one restarted behind while no worker was
// stepping), or one may be restarting: recover, then download. Other
// errors end the run as they are (e.g. DEADLINE_EXCEEDED: the download
// already waited --rpc-timeout-s for rank 0 to initialise).
absl::StatusOr<int64_t> DownloadInitialParameters(WorkerClient& client,
                                                  Recovery& recovery,
                                                  Model& model,
                                                  absl::Span<float> params) {
  int64_t start_step = -1;
  for (;;) {
    absl::StatusOr<int64_t> synced = client.SynchronizeParameters(params);
    if (synced.ok()) {
      start_step = *synced;
      break;
    }
    if (!absl::IsFailedPrecondition(synced.status()) &&
        !absl::IsUnavailable(synced.status())) {
      return synced.status();
    }
    GTOPK_RETURN_IF_ERROR(
        recovery.AfterFailure(synced.status(), "the initial parameter download")
            .status());
  }
  recovery.Succeeded();
  // --device=cuda: the servers' parameters to the device model.
  GTOPK_RETURN_IF_ERROR(model.UploadParams());
  return start_step;
}

uint64_t SumBytes(const std::vector<uint64_t>& per_shard) {
  uint64_t total = 0;
  for (uint64_t b : per_shard) total += b;
  return total;
}

// CPU time (user + system) of this process's threads so far, seconds.
double ProcessCpuSeconds() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + ts.tv_nsec * 1e-9;
}

// This process's CPU time so far from getrusage: {user, system} seconds.
std::pair<double, double> ProcessUserSystemSeconds() {
  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  auto sec = [](const timeval& t) { return t.tv_sec + t.tv_usec * 1e-6; };
  return {sec(ru.ru_utime), sec(ru.ru_stime)};
}

// What every successful step measured, for --summary-json.
struct StepLog {
  std::vector<double> step_seconds;
  // Per-step phase times for --summary-json "per_step" (bench/lowbw/).
  std::vector<double> compute_seconds, local_seconds, communication_seconds;
  // The wait for the client after the gradient was made (StepAttempt).
  std::vector<double> exposed_seconds;
  // StepStats' phases, for the GPU worker's step profile
  // (deploy/device/e2e_device.sh).
  std::vector<double> accumulate_seconds, select_seconds, encode_seconds,
      push_seconds, wait_seconds, apply_seconds;
  // Wall-clock (Unix seconds) when this rank's pushes went out and its last
  // pull was decoded: across ranks (one clock on one machine), the last
  // pusher's pull_end - push_start is the step's communication without the
  // wait for slower workers (bench/lowbw/).
  std::vector<double> push_start_unix, pull_end_unix;
  // This process's CPU time (user + system, all threads) during the step,
  // beside its wall time: on a shared machine, cpu < step shows contention
  // or waiting (issue 20).
  std::vector<double> cpu_seconds;
  std::vector<float> losses;
  double sent_total = 0, received_total = 0;

  // One step: `seconds` in all, `a` its attempt's times.
  void Record(const StepStats& stats, double seconds, const StepAttempt& a,
              double cpu, float loss) {
    const absl::Time step_call = a.step_call;
    step_seconds.push_back(seconds);
    cpu_seconds.push_back(cpu);
    compute_seconds.push_back(absl::ToDoubleSeconds(a.compute));
    exposed_seconds.push_back(absl::ToDoubleSeconds(a.exposed));
    local_seconds.push_back(absl::ToDoubleSeconds(
        stats.accumulate + stats.select + stats.encode + stats.apply));
    communication_seconds.push_back(absl::ToDoubleSeconds(stats.push_wait));
    accumulate_seconds.push_back(absl::ToDoubleSeconds(stats.accumulate));
    select_seconds.push_back(absl::ToDoubleSeconds(stats.select));
    encode_seconds.push_back(absl::ToDoubleSeconds(stats.encode));
    push_seconds.push_back(absl::ToDoubleSeconds(stats.push));
    wait_seconds.push_back(absl::ToDoubleSeconds(stats.wait));
    apply_seconds.push_back(absl::ToDoubleSeconds(stats.apply));
    const absl::Time push_start =
        step_call + stats.accumulate + stats.select + stats.encode;
    push_start_unix.push_back(absl::ToUnixMicros(push_start) * 1e-6);
    pull_end_unix.push_back(absl::ToUnixMicros(push_start + stats.push_wait) *
                            1e-6);
    losses.push_back(loss);
    sent_total += static_cast<double>(SumBytes(stats.bytes_sent));
    received_total += static_cast<double>(SumBytes(stats.bytes_received));
  }

  // The mean loss of this rank's last 20 steps; NaN for none.
  double FinalLoss() const {
    if (losses.empty()) return std::nan("");
    const size_t m = std::min<size_t>(20, losses.size());
    return std::accumulate(losses.end() - m, losses.end(), 0.0) / m;
  }

  // The median step time; NaN for none.
  double StepSecondsP50() const {
    if (step_seconds.empty()) return std::nan("");
    std::vector<double> sorted = step_seconds;
    std::sort(sorted.begin(), sorted.end());
    return sorted[sorted.size() / 2];
  }
};

// What the steps of a run share once the worker has joined.
struct Run {
  const TrainerOptions& o;
  Model& model;
  absl::Span<float> params;  // the model's flat parameters (host)
  WorkerClient& client;
  WorkerMetrics* metrics;  // null: no metrics
  uint32_t rank;
  uint32_t workers;
  bool leader_rank;
  bool synthetic;
  RunLength length;

  const v1::ClusterSpec& cluster() const { return client.cluster(); }
};

// Runs steps [first_step, total_steps): the gradient, the client's Step
// (a failed one recovered and retried, or continued from the step the
// servers were brought to), the progress line and the evaluations.
absl::Status TrainSteps(const Run& run, int64_t first_step, Recovery& recovery,
                        GradientSource& gradients, Evaluator& evaluator,
                        StepLog& log) {
  const TrainerOptions& o = run.o;
  const int64_t steps_per_epoch = run.length.steps_per_epoch;
  const int64_t total_steps = run.length.total_steps;
  // Retrying the step that failed: its gradient is already in the residual
  // (Step's contract), so the retry adds none.
  bool resend_residual = false;
  // Layer-wise clusters: the exchange overlapped with backward (train_step.h).
  const bool overlap = OverlapSteps(o, run.client, run.model);
  for (int64_t step = first_step; step < total_steps; ++step) {
    const Clock::time_point t0 = Clock::now();
    const double cpu0 = ProcessCpuSeconds();
    const int64_t epoch = step / steps_per_epoch;
    StepAttempt attempt;
    GTOPK_RETURN_IF_ERROR(ComputeAndStep(run.client, run.model, gradients, step,
                                         epoch, resend_residual, overlap,
                                         run.params, &attempt));
    const absl::StatusOr<StepStats>& stats = attempt.stats;
    if (!stats.ok()) {
      GTOPK_ASSIGN_OR_RETURN(
          const int64_t resumed,
          recovery.AfterFailure(stats.status(), absl::StrCat("step ", step)));
      if (resumed != step) {
        std::fprintf(stderr, "rank %u: continuing from step %lld\n", run.rank,
                     static_cast<long long>(resumed));
      }
      resend_residual = resumed == step;
      step = resumed - 1;  // the loop's ++step
      continue;
    }
    recovery.Succeeded();
    resend_residual = false;
    const double seconds = SecondsSince(t0);
    const float loss = gradients.loss();
    if (run.metrics != nullptr) {
      run.metrics->RecordStep(*stats, attempt.compute, absl::Seconds(seconds),
                              loss);
    }
    log.Record(*stats, seconds, attempt, ProcessCpuSeconds() - cpu0, loss);
    const int64_t done = step + 1;
    if (run.leader_rank) {
      const double samples_per_second =
          seconds > 0
              ? static_cast<double>(run.workers) * o.batch_size / seconds
              : 0.0;
      PrintLine(absl::StrFormat(
          "step %d/%d epoch %d loss %.4f samples/s %.0f sent_bytes %d "
          "step_ms %.1f",
          done, total_steps, epoch + 1, loss, samples_per_second,
          SumBytes(stats->bytes_sent), seconds * 1e3));
    }
    if (done % steps_per_epoch == 0 ||
        (o.eval_every > 0 && done % o.eval_every == 0)) {
      evaluator.Evaluate(done);
    }
  }
  return absl::OkStatus();
}

// The end-of-run comparison with the servers' parameters.
struct FinalCheck {
  // >= 0: the servers are at this older step (a recovery rolled them back
  // after this worker's last step; params hold theirs): train from there.
  int64_t resume = -1;
  // Otherwise: this rank's and the servers' parameter checksums, and the
  // step the servers' were downloaded at.
  uint64_t param_checksum = 0;
  uint64_t server_checksum = 0;
  int64_t server_step = -1;
};

// The final check: the servers' parameters after the last step (a download
// into scratch), waited for and recovered like a step. When a recovery
// rolled the shards back after this worker's last step, their parameters
// are older than this run's: the result says where to resume instead of
// comparing.
absl::StatusOr<FinalCheck> CheckFinalParameters(const Run& run,
                                                Recovery& recovery) {
  const absl::Span<float> params = run.params;
  const size_t n = run.model.n();
  const int64_t total_steps = run.length.total_steps;
  FinalCheck check;
  GTOPK_RETURN_IF_ERROR(run.model.DownloadParams());  // --device=cuda
  check.param_checksum = Fnv1a64(params.data(), n * sizeof(float));
  std::vector<float> scratch(params.begin(), params.end());
  for (;;) {
    std::copy(params.begin(), params.end(), scratch.begin());
    absl::StatusOr<int64_t> synced =
        run.client.SynchronizeParameters(absl::MakeSpan(scratch));
    if (synced.ok() && *synced < total_steps) {
      // Every shard agrees on an older step: its parameters are the ones
      // to continue from.
      std::copy(scratch.begin(), scratch.end(), params.begin());
      GTOPK_RETURN_IF_ERROR(run.model.UploadParams());
      check.resume = *synced;
      return check;
    }
    if (synced.ok()) {
      check.server_step = *synced;
      break;
    }
    GTOPK_ASSIGN_OR_RETURN(
        const int64_t next,
        recovery.AfterFailure(synced.status(), "the final parameter check"));
    if (next < total_steps) {
      check.resume = next;  // Recover re-downloaded the parameters
      return check;
    }
    // The servers are (still, or again) at the end: check once more.
  }
  recovery.Succeeded();
  check.server_checksum = Fnv1a64(scratch.data(), n * sizeof(float));
  return check;
}

// The run's outcome, for the "done" line and --summary-json.
struct Outcome {
  int64_t start_step = -1;
  double test_accuracy = std::nan("");
  double final_loss = std::nan("");  // mean of the last 20 steps' losses
  double wall_seconds = 0;
  FinalCheck check;
};

std::string JsonSeries(const std::vector<double>& v) {
  std::string a = "[";
  for (size_t i = 0; i < v.size(); ++i) {
    absl::StrAppend(&a, i ? ", " : "", JsonNumber(v[i]));
  }
  return a + "]";
}

// Microsecond resolution (JsonNumber's 10 digits are whole seconds here).
std::string JsonUnixSeries(const std::vector<double>& v) {
  std::string a = "[";
  for (size_t i = 0; i < v.size(); ++i) {
    absl::StrAppend(&a, i ? ", " : "", absl::StrFormat("%.6f", v[i]));
  }
  return a + "]";
}

// --summary-json's document (worker/flags.md).
std::string SummaryJson(const Run& run, const Outcome& r, const StepLog& log) {
  const TrainerOptions& o = run.o;
  const v1::ClusterSpec& cluster = run.cluster();
  const size_t n = run.model.n();
  const size_t steps_run = log.step_seconds.size();
  const double per = steps_run > 0 ? 1.0 / steps_run : std::nan("");
  std::string j = "{\n";
  auto field = [&j](const char* key, const std::string& value, bool last) {
    absl::StrAppend(&j, "  \"", key, "\": ", value, last ? "\n" : ",\n");
  };
  field("rank", absl::StrCat(run.rank), false);
  field("model", JsonString(o.model), false);
  field("n", absl::StrCat(n), false);
  field("mode", JsonString(ModeFlagValue(cluster.mode())), false);
  field("selector", JsonString(cluster.selector()), false);
  field("density", JsonNumber(cluster.optimizer().density()), false);
  field("workers", absl::StrCat(run.workers), false);
  field("shards", absl::StrCat(cluster.shards_size()), false);
  field("epochs",
        JsonNumber(static_cast<double>(run.length.total_steps) /
                   run.length.steps_per_epoch),
        false);
  field("steps", absl::StrCat(run.length.total_steps), false);
  field("start_step", absl::StrCat(r.start_step), false);
  field("steps_per_epoch", absl::StrCat(run.length.steps_per_epoch), false);
  field("batch_size", absl::StrCat(o.batch_size), false);
  field("threads", absl::StrCat(o.threads), false);
  field("cpu_isa", JsonString(o.cpu_isa), false);
  field("final_loss", JsonNumber(r.final_loss), false);
  field("test_accuracy",
        run.leader_rank ? JsonNumber(r.test_accuracy) : std::string("null"),
        false);
  field("wall_seconds", JsonNumber(r.wall_seconds), false);
  const auto [cpu_user, cpu_system] = ProcessUserSystemSeconds();
  field("cpu_user_seconds", JsonNumber(cpu_user), false);
  field("cpu_system_seconds", JsonNumber(cpu_system), false);
  field("step_seconds_p50", JsonNumber(log.StepSecondsP50()), false);
  field("sent_bytes_per_step", JsonNumber(log.sent_total * per), false);
  field("received_bytes_per_step", JsonNumber(log.received_total * per), false);
  field("dense_bytes_per_step", absl::StrCat(uint64_t{4} * n), false);
  field("param_checksum", JsonString(Hex64(r.check.param_checksum)), false);
  field("server_checksum", JsonString(Hex64(r.check.server_checksum)), false);
  field("per_step",
        absl::StrCat(
            "{\"step_seconds\": ", JsonSeries(log.step_seconds),
            ", \"compute_seconds\": ", JsonSeries(log.compute_seconds),
            ", \"exposed_seconds\": ", JsonSeries(log.exposed_seconds),
            ", \"local_seconds\": ", JsonSeries(log.local_seconds),
            ", \"cpu_seconds\": ", JsonSeries(log.cpu_seconds),
            ", \"communication_seconds\": ",
            JsonSeries(log.communication_seconds),
            ", \"accumulate_seconds\": ", JsonSeries(log.accumulate_seconds),
            ", \"select_seconds\": ", JsonSeries(log.select_seconds),
            ", \"encode_seconds\": ", JsonSeries(log.encode_seconds),
            ", \"push_seconds\": ", JsonSeries(log.push_seconds),
            ", \"wait_seconds\": ", JsonSeries(log.wait_seconds),
            ", \"apply_seconds\": ", JsonSeries(log.apply_seconds),
            ", \"push_start_unix\": ", JsonUnixSeries(log.push_start_unix),
            ", \"pull_end_unix\": ", JsonUnixSeries(log.pull_end_unix), "}"),
        true);
  j += "}\n";
  return j;
}

// Writes `text` to --summary-json through <path>.tmp and a rename, so a
// reader never sees half a summary.
absl::Status WriteSummary(const std::string& summary_json,
                          const std::string& text) {
  const std::string tmp = summary_json + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out << text;
    out.flush();
    if (!out) {
      return absl::PermissionDeniedError(
          absl::StrCat("--summary-json: cannot write ", tmp));
    }
  }
  if (std::rename(tmp.c_str(), summary_json.c_str()) != 0) {
    return absl::PermissionDeniedError(
        absl::StrCat("--summary-json: cannot rename ", tmp, " to ",
                     summary_json, ": ", std::strerror(errno)));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Duration EffectiveRecoveryTimeout(const TrainerOptions& o,
                                        absl::Duration step_timeout) {
  if (o.recovery_timeout.has_value()) return *o.recovery_timeout;
  return kDefaultRecoverySteps * step_timeout;
}

absl::Status CheckReplicaChecksums(uint32_t rank, uint64_t param_checksum,
                                   uint64_t server_checksum,
                                   int64_t server_step) {
  if (param_checksum == server_checksum) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(
      "rank ", rank, "'s final parameters (checksum ", Hex64(param_checksum),
      ") differ from the servers' (checksum ", Hex64(server_checksum),
      ", at step ", server_step,
      "): the replicas diverged; the run's result is not the servers' "
      "model (were the shards started with different settings?)"));
}

absl::Status ValidateOptions(const TrainerOptions& o) {
  if (o.server.empty()) {
    return absl::InvalidArgumentError(
        "--server (leader host:port) is required");
  }
  GTOPK_RETURN_IF_ERROR(ValidateHostPort("server", o.server, 1));
  if (o.rank < -1 || o.rank > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("--rank must be in [-1, 65535] (-1: any), got ", o.rank));
  }
  if (o.batch_size < 1 || o.batch_size > 65536) {
    return absl::InvalidArgumentError(
        absl::StrCat("--batch-size must be in [1, 65536], got ", o.batch_size));
  }
  if (o.epochs < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--epochs must be >= 1, got ", o.epochs));
  }
  if (o.epochs > 1000000) {
    return absl::InvalidArgumentError(
        absl::StrCat("--epochs must be at most 1000000, got ", o.epochs));
  }
  for (const auto& [flag, value] :
       {std::pair<const char*, int64_t>{"steps", o.steps},
        {"train-limit", o.train_limit},
        {"test-limit", o.test_limit},
        {"eval-every", o.eval_every},
        {"compute-ms", o.compute_ms}}) {
    if (value < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("--", flag, " must be >= 0, got ", value));
    }
  }
  GTOPK_RETURN_IF_ERROR(ValidateConsistencyFlags(o));
  if (o.recovery_timeout.has_value() &&
      (*o.recovery_timeout < absl::ZeroDuration() ||
       *o.recovery_timeout > absl::Hours(24))) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--recovery-timeout must be in [0, 24h] (0: exit on the first failed "
        "step; unset: 4 x the servers' --step-timeout), got ",
        absl::FormatDuration(*o.recovery_timeout)));
  }
  if (o.final_check_delay < absl::ZeroDuration() ||
      o.final_check_delay > absl::Hours(1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--testing-final-check-delay must be in [0, 1h], got ",
                     absl::FormatDuration(o.final_check_delay)));
  }
  if (o.threads < 1 || o.threads > 1024) {
    return absl::InvalidArgumentError(
        absl::StrCat("--threads must be in [1, 1024], got ", o.threads));
  }
  if (o.device == "cuda") {
#if GTOPK_HAVE_CUDA
    // libtorch is loaded here, not at the start (torch_module.h): a module
    // that is missing or does not load says so itself.
    GTOPK_ASSIGN_OR_RETURN(const TorchModuleApi* torch, LoadTorchModule());
    if (!torch->cuda_available()) {
      return absl::FailedPreconditionError(
          "--device=cuda: this build has no CUDA libtorch (Debian's "
          "libtorch-dev is CPU-only; build against PyTorch's, see "
          "worker/flags.md) or it sees no CUDA device; use --device=cpu");
    }
#else
    return absl::FailedPreconditionError(
        "--device=cuda: this build has no CUDA libtorch (Debian's libtorch-dev "
        "is CPU-only) and no CUDA kernels (nvcc was not found); use "
        "--device=cpu");
#endif
  }
  if (o.device != "cpu" && o.device != "cuda") {
    return absl::InvalidArgumentError(
        absl::StrCat("--device must be cpu or cuda, got \"", o.device, "\""));
  }
  GTOPK_ASSIGN_OR_RETURN(uint64_t synthetic_n, SyntheticSize(o.model));
  if (synthetic_n == 0 && o.model != "mlp" && o.model != "cnn") {
    return absl::InvalidArgumentError(absl::StrCat(
        "--model must be mlp, cnn or synthetic:N, got \"", o.model, "\""));
  }
  if (o.compute_ms > 0 && synthetic_n == 0) {
    return absl::InvalidArgumentError(
        "--compute-ms applies to --model=synthetic:N only");
  }
  return absl::OkStatus();
}

// What Trainer::Prepare made: the local half of a run.
struct Trainer::Local {
  TrainerOptions options;
  bool synthetic = false;
  std::unique_ptr<Model> model;
  Data data;
};

Trainer::Trainer(std::unique_ptr<Local> local) : local_(std::move(local)) {}
Trainer::Trainer(Trainer&&) noexcept = default;
Trainer& Trainer::operator=(Trainer&&) noexcept = default;
Trainer::~Trainer() = default;

absl::StatusOr<Trainer> Trainer::Prepare(const TrainerOptions& o) {
  GTOPK_RETURN_IF_ERROR(ValidateOptions(o));
  GTOPK_RETURN_IF_ERROR(CheckSummaryWritable(o.summary_json));
  GTOPK_ASSIGN_OR_RETURN(const uint64_t synthetic_n, SyntheticSize(o.model));
  auto local = std::make_unique<Local>();
  local->options = o;
  local->synthetic = synthetic_n > 0;
  // Model first (n), then the data, so local errors come before the join.
  GTOPK_ASSIGN_OR_RETURN(local->model, MakeModel(o, synthetic_n));
  GTOPK_ASSIGN_OR_RETURN(local->data, LoadData(o, local->synthetic));
  return Trainer(std::move(local));
}

absl::Status RunTrainer(const TrainerOptions& o) {
  GTOPK_ASSIGN_OR_RETURN(Trainer trainer, Trainer::Prepare(o));
  return trainer.Train();
}

absl::Status Trainer::Train() {
  if (local_ == nullptr || local_->model == nullptr) {
    return absl::FailedPreconditionError(
        "Trainer::Train: called again, or on a moved-from Trainer");
  }
  const TrainerOptions& o = local_->options;
  const bool synthetic = local_->synthetic;
  const std::unique_ptr<Model> model = std::move(local_->model);
  const Data& data = local_->data;
  GTOPK_ASSIGN_OR_RETURN(Membership member, JoinCluster(o, model->n()));
  const v1::ClusterSpec& cluster = member.client->cluster();
  GTOPK_ASSIGN_OR_RETURN(const RunLength length,
                         PlanRunLength(o, cluster, synthetic, data.train.size(),
                                       member.workers, member.leader_rank));
  const Run run{o,
                *model,
                model->params(),
                *member.client,
                member.metrics.get(),
                member.rank,
                member.workers,
                member.leader_rank,
                synthetic,
                length};

  // Failed steps and parameter downloads are recovered through
  // WorkerClient::Recover (docs/recovery.md) within --recovery-timeout of
  // their first failure: the leader brings the shards to one step (rolling
  // them back when a restarted shard is behind) and this worker continues
  // from there.
  const absl::Duration step_timeout =
      absl::Milliseconds(cluster.step_timeout_ms());
  Recovery recovery(run.client, run.model, run.params, run.rank,
                    EffectiveRecoveryTimeout(o, step_timeout), step_timeout);
  Outcome outcome;
  GTOPK_ASSIGN_OR_RETURN(
      outcome.start_step,
      DownloadInitialParameters(run.client, recovery, run.model, run.params));
  const Clock::time_point t_start = Clock::now();

  Evaluator evaluator(run.model, data.test, run.leader_rank && !synthetic,
                      run.metrics);
  GradientSource gradients(o, run.model, data.train, synthetic, run.rank,
                           length.steps_per_epoch);
  StepLog log;
  // Training, then the final check against the servers; back to training
  // when the servers were rolled back after this worker's last step.
  int64_t step = outcome.start_step;
  for (;;) {
    GTOPK_RETURN_IF_ERROR(
        TrainSteps(run, step, recovery, gradients, evaluator, log));
    evaluator.Evaluate(length.total_steps);
    outcome.wall_seconds = SecondsSince(t_start);
    if (o.final_check_delay > absl::ZeroDuration()) {
      absl::SleepFor(o.final_check_delay);  // --testing-final-check-delay
    }
    GTOPK_ASSIGN_OR_RETURN(outcome.check, CheckFinalParameters(run, recovery));
    if (outcome.check.resume < 0) break;
    std::fprintf(stderr,
                 "rank %u: the servers were rolled back to step %lld after "
                 "this worker's last step; continuing from step %lld\n",
                 run.rank, static_cast<long long>(outcome.check.resume),
                 static_cast<long long>(outcome.check.resume));
    step = outcome.check.resume;
    evaluator.ForgetLastEvaluation();  // evaluate the re-run's final params
  }

  outcome.test_accuracy = evaluator.test_accuracy();
  outcome.final_loss = synthetic ? std::nan("") : log.FinalLoss();
  // Checked after the summary is written (so it can be inspected).
  const absl::Status replicas_agree = CheckReplicaChecksums(
      run.rank, outcome.check.param_checksum, outcome.check.server_checksum,
      outcome.check.server_step);
  if (run.leader_rank) {
    PrintLine(absl::StrFormat(
        "done steps %d test_accuracy %.4f final_loss %.4f wall_seconds %.1f",
        length.total_steps, outcome.test_accuracy, outcome.final_loss,
        outcome.wall_seconds));
  }
  if (!o.summary_json.empty()) {
    GTOPK_RETURN_IF_ERROR(
        WriteSummary(o.summary_json, SummaryJson(run, outcome, log)));
  }
  return replicas_agree;
}

}  // namespace worker
}  // namespace gtopk
