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
#include "absl/time/time.h"
#include "common/metrics/metrics.h"

namespace gtopk {
namespace worker {

// One field per flag (worker/flags.md); main.cc copies the flags in.
struct TrainerOptions {
  std::string server;     // leader host:port
  int rank = -1;          // -1: any free rank
  std::string model = "cnn";  // mlp | cnn | synthetic:N
  int64_t batch_size = 32;
  int64_t epochs = 1;
  int64_t steps = 0;      // 0: epochs * steps_per_epoch; > 0: caps the run
  std::string data_dir;
  int64_t train_limit = 0;  // 0: all
  int64_t test_limit = 0;   // 0: all
  int64_t eval_every = 0;   // 0: only after each epoch and at the end
  uint64_t seed = 1;
  int threads = 1;
  int64_t compute_ms = 0;   // synthetic only
  std::string summary_json;
  std::string device = "cpu";
  absl::Duration rpc_timeout = absl::Seconds(60);
  // Where the worker registers its metrics (docs/metrics.md, "Worker"),
  // shared with main()'s exposer (--metrics-port); null: no metrics.
  std::shared_ptr<metrics::Registry> metrics_registry;
  // Failed steps in a row that are recovered (WorkerClient::Recover) and
  // retried before giving up, in [0, 100]; reset by every successful step.
  // Each failed step's Recover calls are retried for 3 step timeouts.
  int step_retries = 3;

  // Consistency checks against the servers' cluster spec (unset: no check).
  std::optional<std::string> mode, selector, index_codec, value_codec;
  std::optional<double> density, lr, momentum;
};

// Checks the options that need no cluster (INVALID_ARGUMENT naming the flag).
absl::Status ValidateOptions(const TrainerOptions& options);

// Runs the whole training. Errors name their cause (the flag, file, shard or
// step); the caller prints them and exits 1.
absl::Status RunTrainer(const TrainerOptions& options);

// The end-of-run replica check: OK when this rank's final parameters
// (`param_checksum`) equal the servers' (`server_checksum`, downloaded at
// `server_step`); otherwise INTERNAL naming the rank, both checksums and
// the step (RunTrainer returns it after writing the summary, so the worker
// exits 1 and the launcher fails the run).
absl::Status CheckReplicaChecksums(uint32_t rank, uint64_t param_checksum,
                                   uint64_t server_checksum,
                                   int64_t server_step);

// 64-bit FNV-1a over the bytes of `data` (the replica checksums).
uint64_t Fnv1a64(const void* data, size_t bytes);

}  // namespace worker
}  // namespace gtopk

#endif  // GTOPK_WORKER_TRAINER_TRAINER_H_
