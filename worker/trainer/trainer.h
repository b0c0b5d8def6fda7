// The gtopk-worker training loop (worker/flags.md): joins the cluster,
// synchronises the parameters, trains `mlp` / `cnn` on Fashion-MNIST or runs
// `synthetic:N` updates, steps through the worker client, evaluates on rank 0
// and prints the progress lines the local launcher parses.
// Torch-free: the models are behind worker/trainer/model.h.
#ifndef GTOPK_WORKER_TRAINER_TRAINER_H_
#define GTOPK_WORKER_TRAINER_TRAINER_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/checksum.h"  // Fnv1a64: the replica checksums
#include "common/metrics/metrics.h"
#include "common/transport_security/transport_security.h"

namespace gtopk {
namespace worker {

// One field per flag (worker/flags.md); main.cc copies the flags in.
struct TrainerOptions {
  std::string server;         // leader host:port
  int rank = -1;              // -1: any free rank
  std::string model = "cnn";  // mlp | cnn | synthetic:N
  int64_t batch_size = 32;
  int64_t epochs = 1;
  int64_t steps = 0;  // 0: epochs * steps_per_epoch; > 0: caps the run
  std::string data_dir;
  int64_t train_limit = 0;  // 0: all
  int64_t test_limit = 0;   // 0: all
  int64_t eval_every = 0;   // 0: only after each epoch and at the end
  uint64_t seed = 1;
  int threads = 1;
  // --cpu-isa, applied by main() before the trainer runs (cpu_isa.h);
  // recorded in the summary.
  std::string cpu_isa = "portable";
  int64_t compute_ms = 0;  // synthetic only
  std::string summary_json;
  std::string device = "cpu";
  absl::Duration rpc_timeout = absl::Seconds(60);
  // Where the worker registers its metrics (docs/metrics.md, "Worker"),
  // shared with main()'s exposer (--metrics-port); null: no metrics.
  std::shared_ptr<prometheus::Registry> metrics_registry;
  // How long a worker keeps recovering (WorkerClient::Recover) and
  // retrying a step that failed, from the step's first failure; reset by
  // every successful step. Also bounds recovering the final parameter check
  // and the initial parameter download. nullopt: 4 x the servers' step
  // timeout; zero: the first failure ends the run; otherwise in [0, 24 h],
  // and when > 0 at least one step timeout + 1 s (the time one Recover call
  // may take).
  std::optional<absl::Duration> recovery_timeout;
  // Testing only (--testing-final-check-delay): sleep this long after the
  // last step, before the final parameter check, so that a test can
  // restart a shard at that point; in [0, 1 h].
  absl::Duration final_check_delay = absl::ZeroDuration();
  // Testing only (no flag): on a layer-wise cluster, step without overlap
  // (the client's Step after backward, as for the other selections), so a
  // test can compare the overlapped run with it.
  bool testing_no_overlap = false;

  // Consistency checks against the servers' cluster spec (unset: no check).
  std::optional<std::string> mode, selector, index_codec, value_codec;
  // Transport security (--tls, --tls-cert/key/ca, --token-file; loaded and
  // checked by main()). Null: plaintext.
  std::shared_ptr<const TransportSecurity> security;
  std::optional<double> density, lr, momentum;
};

// Checks the options that need no cluster (INVALID_ARGUMENT naming the flag).
absl::Status ValidateOptions(const TrainerOptions& options);

// The recovery time budget in force: options.recovery_timeout, or 4 x
// `step_timeout` (the servers' --step-timeout) when unset; a budget > 0 is
// at least one step timeout + 1 s.
absl::Duration EffectiveRecoveryTimeout(const TrainerOptions& options,
                                        absl::Duration step_timeout);

// A training run in its two halves, so that gtopk-worker's exit code says
// which one failed (cli/exit_codes.h, worker/flags.md "Exit codes"):
//   Prepare  the local half, nothing dialled: every option checked
//            (ValidateOptions), the --summary-json file writable, the model
//            made and the data read. Its errors are startup failures
//            (kExitUsage, 2).
//   Train    the cluster half: join, download the initial parameters,
//            train and evaluate, check the final parameters against the
//            servers', write the summary. Its errors end a run that started
//            (kExitFailure, 1).
// Errors name their cause (the flag, file, shard or step).
class Trainer {
 public:
  static absl::StatusOr<Trainer> Prepare(const TrainerOptions& options);

  Trainer(Trainer&&) noexcept;
  Trainer& operator=(Trainer&&) noexcept;
  ~Trainer();

  // Runs the training; once (FAILED_PRECONDITION when called again).
  absl::Status Train();

 private:
  struct Local;
  explicit Trainer(std::unique_ptr<Local> local);
  std::unique_ptr<Local> local_;
};

// Trainer::Prepare, then Train (the tests' one call).
absl::Status RunTrainer(const TrainerOptions& options);

// The end-of-run replica check: OK when this rank's final parameters
// (`param_checksum`) equal the servers' (`server_checksum`, downloaded at
// `server_step`); otherwise INTERNAL naming the rank, both checksums and
// the step (Trainer::Train returns it after writing the summary, so the
// worker exits 1 and the launcher fails the run).
absl::Status CheckReplicaChecksums(uint32_t rank, uint64_t param_checksum,
                                   uint64_t server_checksum,
                                   int64_t server_step);

}  // namespace worker
}  // namespace gtopk

#endif  // GTOPK_WORKER_TRAINER_TRAINER_H_
