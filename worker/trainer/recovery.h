// The trainer's time-bounded recovery of a failed step (RunTrainer,
// worker/trainer/trainer.cc): after a step or parameter download fails,
// WorkerClient::Recover with backoff until --recovery-timeout is spent
// (worker/flags.md, docs/recovery.md).
#ifndef GTOPK_WORKER_TRAINER_RECOVERY_H_
#define GTOPK_WORKER_TRAINER_RECOVERY_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "worker/client.h"
#include "worker/trainer/model.h"

namespace gtopk {
namespace worker {

// The time-bounded recovery of a failed step (or parameter download):
// after the first failure, Recover is called (with backoff) and the caller
// retries, until the budget from that first failure is spent. Counts no
// attempts: concurrent workers that make each other's retries fail cannot
// use it up faster than the clock. Not thread-safe (one per trainer).
class Recovery {
 public:
  // `budget`: EffectiveRecoveryTimeout; `step_timeout`: the servers'.
  Recovery(WorkerClient& client, Model& model, absl::Span<float> params,
           uint32_t rank, absl::Duration budget, absl::Duration step_timeout)
      : client_(client),
        model_(model),
        params_(params),
        rank_(rank),
        budget_(budget),
        recover_call_time_(step_timeout + absl::Seconds(1)) {}

  // The last attempt succeeded: the next failure starts a new budget.
  void Succeeded() {
    failing_ = false;
    precondition_recovered_ = false;
  }

  // After `failure` of `what` ("step 12", "the final parameter check"):
  // calls Recover until it answers, within the budget, and returns the step
  // to continue from (params re-downloaded when the shards were rolled
  // back, as Recover does). Retryable: ABORTED, DEADLINE_EXCEEDED,
  // UNAVAILABLE, CANCELLED, and FAILED_PRECONDITION from `failure` (shards
  // at different steps, which Recover repairs) but not from Recover itself
  // (no common step). Returns the error that ends the run: `failure` (or
  // Recover's) with its code, prefixed with `what`, when it is not
  // retryable or no Recover call fits in the budget any more (the message
  // then says how long the worker tried).
  absl::StatusOr<int64_t> AfterFailure(absl::Status failure,
                                       const std::string& what);

 private:
  WorkerClient& client_;
  Model& model_;
  absl::Span<float> params_;
  const uint32_t rank_;
  const absl::Duration budget_;
  const absl::Duration recover_call_time_;
  bool failing_ = false;
  // A FAILED_PRECONDITION step failure was followed by a successful Recover
  // (since the last successful step).
  bool precondition_recovered_ = false;
  absl::Time first_failure_;
  int recover_calls_ = 0;
};

}  // namespace worker
}  // namespace gtopk

#endif  // GTOPK_WORKER_TRAINER_RECOVERY_H_
