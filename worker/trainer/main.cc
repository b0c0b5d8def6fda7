// gtopk-worker: one training replica of a gTop-k cluster (worker/flags.md).
// Flags are read here only and copied into TrainerOptions.
//
// stdout (rank 0 only; parsed by deploy/local): one line per step
//   step <s>/<total> epoch <e> loss <x.xxxx> samples/s <n> sent_bytes <b>
//   step_ms <t>
// one line per evaluation
//   eval step <s> test_accuracy <0.xxxx> test_loss <x.xxxx>
// and at the end
//   done steps <s> test_accuracy <a> final_loss <l> wall_seconds <w>
// Errors go to stderr. Exit codes (cli/exit_codes.h, worker/flags.md): 0
// when the run finished; 2 (kExitUsage) for an invalid command line or a
// startup that failed before the join (StartUp: BuildOptions, the metrics
// port, Trainer::Prepare); 1 (kExitFailure) when the run itself failed
// (Trainer::Train).
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "cli/command_line.h"
#include "cli/exit_codes.h"
#include "cli/tls_flag.h"
#include "common/host_port.h"
#include "common/metrics/exposer.h"
#include "common/metrics/process_collector.h"
#include "common/transport_security/transport_security.h"
#include "worker/trainer/cpu_isa.h"
#include "worker/trainer/idx_reader.h"
#include "worker/trainer/trainer.h"

ABSL_FLAG(std::string, server, "", "leader (shard 0) host:port; required");
ABSL_FLAG(int, rank, -1,
          "rank to take; -1: $JOB_COMPLETION_INDEX if set, else any free rank");
ABSL_FLAG(std::string, model, "cnn", "mlp | cnn | synthetic:N");
ABSL_FLAG(int64_t, batch_size, 32, "samples per step per worker");
ABSL_FLAG(int64_t, epochs, 1, "epochs to train");
ABSL_FLAG(int64_t, steps, 0,
          "0: epochs * steps_per_epoch; > 0: at most this many steps");
ABSL_FLAG(std::string, data_dir, gtopk::worker::kDefaultFashionMnistDir,
          "directory with the Fashion-MNIST IDX files");
ABSL_FLAG(int64_t, train_limit, 0, "use the first N training samples (0: all)");
ABSL_FLAG(int64_t, test_limit, 0, "use the first N test samples (0: all)");
ABSL_FLAG(int64_t, eval_every, 0,
          "also evaluate every N steps (0: after each epoch and at the end)");
ABSL_FLAG(uint64_t, seed, 1, "seed of initialisation and shuffles");
ABSL_FLAG(int, threads, 1, "torch intra-op threads");
ABSL_FLAG(std::string, cpu_isa, "portable",
          "portable: pin libtorch's CPU kernels (AVX2) so that results are "
          "bit-identical on any x86-64 CPU with AVX2; native: let libtorch "
          "choose for this CPU");
ABSL_FLAG(int64_t, compute_ms, 0,
          "synthetic only: sleep this many ms per step to emulate compute "
          "(layer-wise cluster: an emulated backward pass reporting the "
          "gradient in 100 ranges from the end over that time)");
ABSL_FLAG(std::string, summary_json, "", "write this rank's summary here");
ABSL_FLAG(std::string, device, "cpu", "cpu | cuda");
ABSL_FLAG(int64_t, metrics_port, 0,
          "serve Prometheus GET /metrics on <metrics-host>:<port> (0: off)");
ABSL_FLAG(std::string, metrics_host, "0.0.0.0",
          "address the metrics port binds (0.0.0.0: all; 127.0.0.1: "
          "loopback only)");
ABSL_FLAG(int64_t, rpc_timeout_s, 60,
          "deadline of Join and parameter download RPCs, seconds");
ABSL_FLAG(std::optional<absl::Duration>, recovery_timeout, std::nullopt,
          "how long a failed step is recovered and retried, from its first "
          "failure (0: exit on the first failure; unset: 4 x the servers' "
          "--step-timeout)");
ABSL_FLAG(absl::Duration, testing_final_check_delay, absl::ZeroDuration(),
          "testing only: sleep this long after the last step, before the "
          "final parameter check");
// Consistency checks against the servers' cluster spec (empty: no check).
// Transport security (docs/security.md).
ABSL_FLAG(std::string, tls, "",
          "required, no default: off | server | mutual: plaintext on a "
          "trusted network only (a WARNING at start), TLS, or mutual TLS to "
          "the shards");
ABSL_FLAG(std::string, tls_cert, "",
          "PEM certificate (chain) of this worker; CN gtopk-worker or "
          "gtopk-worker-<rank>");
ABSL_FLAG(std::string, tls_key, "", "PEM private key of --tls-cert");
ABSL_FLAG(std::string, tls_ca, "",
          "PEM CA bundle that the shards' certificates chain to");
ABSL_FLAG(std::string, token_file, "",
          "file holding the workers' shared token (never the token itself)");
ABSL_FLAG(std::string, mode, "", "check: gtopk | topk | dense");
ABSL_FLAG(std::string, selector, "",
          "check: exact | gaussiank | dgc | randomk");
ABSL_FLAG(std::string, density, "", "check: density k/n");
ABSL_FLAG(std::string, lr, "", "check: base learning rate");
ABSL_FLAG(std::string, momentum, "", "check: momentum coefficient");
ABSL_FLAG(std::string, index_codec, "", "check: index codec");
ABSL_FLAG(std::string, value_codec, "", "check: value codec");

namespace {

std::optional<std::string> OptionalString(const std::string& v) {
  if (v.empty()) return std::nullopt;
  return v;
}

absl::Status OptionalDouble(const char* flag, const std::string& v,
                            std::optional<double>* out) {
  if (v.empty()) return absl::OkStatus();
  double d = 0;
  if (!absl::SimpleAtod(v, &d)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--", flag, "=", v, " is not a number"));
  }
  *out = d;
  return absl::OkStatus();
}

// The flags read into TrainerOptions and checked: everything that needs
// neither the cluster nor a port (ValidateOptions, the TLS files loaded).
// Binds and dials nothing.
absl::StatusOr<gtopk::worker::TrainerOptions> BuildOptions() {
  gtopk::worker::TrainerOptions o;
  o.server = absl::GetFlag(FLAGS_server);
  o.rank = absl::GetFlag(FLAGS_rank);
  if (o.rank == -1) {
    if (const char* env = std::getenv("JOB_COMPLETION_INDEX");
        env != nullptr && *env != '\0') {
      if (!absl::SimpleAtoi(env, &o.rank) || o.rank < 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            "JOB_COMPLETION_INDEX=\"", env, "\" is not a rank >= 0"));
      }
    }
  }
  o.model = absl::GetFlag(FLAGS_model);
  o.batch_size = absl::GetFlag(FLAGS_batch_size);
  o.epochs = absl::GetFlag(FLAGS_epochs);
  o.steps = absl::GetFlag(FLAGS_steps);
  o.data_dir = absl::GetFlag(FLAGS_data_dir);
  o.train_limit = absl::GetFlag(FLAGS_train_limit);
  o.test_limit = absl::GetFlag(FLAGS_test_limit);
  o.eval_every = absl::GetFlag(FLAGS_eval_every);
  o.seed = absl::GetFlag(FLAGS_seed);
  o.threads = absl::GetFlag(FLAGS_threads);
  o.cpu_isa = absl::GetFlag(FLAGS_cpu_isa);
  o.compute_ms = absl::GetFlag(FLAGS_compute_ms);
  o.summary_json = absl::GetFlag(FLAGS_summary_json);
  o.device = absl::GetFlag(FLAGS_device);
  const int64_t rpc_timeout_s = absl::GetFlag(FLAGS_rpc_timeout_s);
  if (rpc_timeout_s < 1 || rpc_timeout_s > 86400) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--rpc-timeout-s must be in [1, 86400], got ", rpc_timeout_s));
  }
  o.rpc_timeout = absl::Seconds(rpc_timeout_s);
  o.recovery_timeout = absl::GetFlag(FLAGS_recovery_timeout);
  o.final_check_delay = absl::GetFlag(FLAGS_testing_final_check_delay);
  o.mode = OptionalString(absl::GetFlag(FLAGS_mode));
  o.selector = OptionalString(absl::GetFlag(FLAGS_selector));
  o.index_codec = OptionalString(absl::GetFlag(FLAGS_index_codec));
  o.value_codec = OptionalString(absl::GetFlag(FLAGS_value_codec));
  if (absl::Status s =
          OptionalDouble("density", absl::GetFlag(FLAGS_density), &o.density);
      !s.ok()) {
    return s;
  }
  if (absl::Status s = OptionalDouble("lr", absl::GetFlag(FLAGS_lr), &o.lr);
      !s.ok()) {
    return s;
  }
  if (absl::Status s = OptionalDouble("momentum", absl::GetFlag(FLAGS_momentum),
                                      &o.momentum);
      !s.ok()) {
    return s;
  }
  {
    gtopk::TransportSecurityOptions so;
    absl::StatusOr<gtopk::TlsMode> tls =
        gtopk::cli::ParseTlsFlag(absl::GetFlag(FLAGS_tls));
    if (!tls.ok()) return tls.status();
    so.tls = *tls;
    so.cert_file = absl::GetFlag(FLAGS_tls_cert);
    so.key_file = absl::GetFlag(FLAGS_tls_key);
    so.ca_file = absl::GetFlag(FLAGS_tls_ca);
    so.token_file = absl::GetFlag(FLAGS_token_file);
    absl::StatusOr<std::shared_ptr<const gtopk::TransportSecurity>> security =
        gtopk::TransportSecurity::Load(so, gtopk::SecurityRole::kWorker);
    if (!security.ok()) return security.status();
    o.security = *std::move(security);
    const std::string warning = o.security->Warning();
    if (!warning.empty()) {
      std::fprintf(stderr, "gtopk-worker: %s\n", warning.c_str());
    }
  }
  // Every flag that needs no cluster, before anything is bound or dialled.
  if (absl::Status s = gtopk::worker::ValidateOptions(o); !s.ok()) return s;
  const int64_t metrics_port = absl::GetFlag(FLAGS_metrics_port);
  if (metrics_port < 0 || metrics_port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--metrics-port must be in [0, 65535] (0: off), got ", metrics_port));
  }
  const absl::StatusOr<std::string> metrics_address = gtopk::MetricsBindAddress(
      absl::GetFlag(FLAGS_metrics_host), static_cast<int>(metrics_port));
  if (!metrics_address.ok()) return metrics_address.status();
  return o;
}

// The worker before its join: the trainer prepared and the metrics port
// serving.
struct Worker {
  std::shared_ptr<gtopk::metrics::ProcessCollector> process_metrics;
  std::unique_ptr<prometheus::Exposer> exposer;
  std::optional<gtopk::worker::Trainer> trainer;
};

// --metrics-port > 0: binds it (before the join, so a port that cannot be
// bound fails fast) and serves `o`'s new registry there.
absl::Status StartMetrics(gtopk::worker::TrainerOptions& o, Worker& worker) {
  const int64_t metrics_port = absl::GetFlag(FLAGS_metrics_port);
  if (metrics_port == 0) return absl::OkStatus();
  const std::string metrics_host = absl::GetFlag(FLAGS_metrics_host);
  o.metrics_registry = std::make_shared<prometheus::Registry>();
  gtopk::metrics::RegisterBuildInfo(*o.metrics_registry, "gtopk-worker");
  worker.process_metrics = std::make_shared<gtopk::metrics::ProcessCollector>();
  absl::StatusOr<std::unique_ptr<prometheus::Exposer>> started =
      gtopk::metrics::StartExposer(*gtopk::MetricsBindAddress(
          metrics_host, static_cast<int>(metrics_port)));
  if (!started.ok()) {
    return absl::Status(started.status().code(),
                        absl::StrCat("--metrics-host=", metrics_host,
                                     " --metrics-port=", metrics_port, ": ",
                                     started.status().message()));
  }
  worker.exposer = *std::move(started);
  worker.exposer->RegisterCollectable(o.metrics_registry);
  worker.exposer->RegisterCollectable(worker.process_metrics);
  std::printf("metrics on %s\n",
              gtopk::MetricsBindAddress(
                  metrics_host, gtopk::metrics::BoundPort(*worker.exposer))
                  ->c_str());
  std::fflush(stdout);
  return absl::OkStatus();
}

// Everything before the join, in order: --cpu-isa applied (before anything
// touches torch: the pins are read at first use; may re-execute the
// process), the options built, the metrics port bound, the trainer prepared
// (model and data). An error here is a startup failure (kExitUsage).
absl::StatusOr<Worker> StartUp(char** argv) {
  std::string cpu_note;
  if (absl::Status s = gtopk::worker::ApplyCpuIsa(absl::GetFlag(FLAGS_cpu_isa),
                                                  argv, &cpu_note);
      !s.ok()) {
    return s;
  }
  std::fprintf(stderr, "gtopk-worker: %s\n", cpu_note.c_str());
  absl::StatusOr<gtopk::worker::TrainerOptions> options = BuildOptions();
  if (!options.ok()) return options.status();
  Worker worker;
  if (absl::Status s = StartMetrics(*options, worker); !s.ok()) return s;
  absl::StatusOr<gtopk::worker::Trainer> trainer =
      gtopk::worker::Trainer::Prepare(*options);
  if (!trainer.ok()) return trainer.status();
  worker.trainer.emplace(*std::move(trainer));
  return worker;
}

}  // namespace

int main(int argc, char** argv) {
  using gtopk::cli::kExitFailure;
  using gtopk::cli::kExitOk;
  using gtopk::cli::kExitUsage;
  const absl::Status parsed = gtopk::cli::ParseCommandLine(
      {"One data-parallel worker training with gTop-k sparsification.\n"
       "Flags are spelled with dashes or underscores; every flag is "
       "documented in worker/flags.md.",
       "worker/trainer/main.cc"},
      argc, argv);
  if (!parsed.ok()) {
    std::fprintf(stderr, "gtopk-worker: %s\n", parsed.ToString().c_str());
    return kExitUsage;
  }
  absl::StatusOr<Worker> worker = StartUp(argv);
  if (!worker.ok()) {
    std::fprintf(stderr, "gtopk-worker: %s\n",
                 worker.status().ToString().c_str());
    return kExitUsage;
  }
  const absl::Status trained = worker->trainer->Train();
  if (!trained.ok()) {
    std::fprintf(stderr, "gtopk-worker: %s\n", trained.ToString().c_str());
    return kExitFailure;
  }
  return kExitOk;
}
