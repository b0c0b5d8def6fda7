// One training step of gtopk-worker (TrainSteps, worker/trainer/trainer.cc):
// the gradient and the worker client's step on it, either one after the
// other or, on a layer-wise cluster, overlapped: each parameter's slice of
// the flat gradient goes to the client (WorkerClient::GradientReady) as soon
// as the backward pass produced it, so its selection and push run while
// backward goes on (docs/overlap.md, "The C++ trainer").
#ifndef GTOPK_WORKER_TRAINER_TRAIN_STEP_H_
#define GTOPK_WORKER_TRAINER_TRAIN_STEP_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "worker/client.h"
#include "worker/trainer/model.h"
#include "worker/trainer/trainer.h"
#include "worker/trainer/training_data.h"

namespace gtopk {
namespace worker {
namespace trainer_internal {

// Whether this run's steps overlap the exchange with the backward pass:
// the cluster's selection is layerwise (it has bucket pieces) and the
// gradient is made on the host (a CPU model, or synthetic:N on the CPU),
// unless options.testing_no_overlap.
bool OverlapSteps(const TrainerOptions& options, const WorkerClient& client,
                  const Model& model);

// What one attempt at a step measured, and the client's answer.
struct StepAttempt {
  // The client's step: its stats, or the failure to recover from (the
  // failure contract of WorkerClient::Step / FinishOverlappedStep: nothing
  // applied, the residual holds this gradient, so the retry sends zeros).
  absl::StatusOr<StepStats> stats = absl::UnknownError("not run");
  // Making the gradient (forward and backward; overlapped: from Begin until
  // backward returned).
  absl::Duration compute;
  // The time the trainer waited for the client after the gradient was
  // made (Step, or FinishOverlappedStep): the exposed communication.
  absl::Duration exposed;
  // When the client's step was called (BeginOverlappedStep, for an
  // overlapped step).
  absl::Time step_call;
};

// Step `step` of `epoch`: GradientSource::Compute, then the client's step
// on the result (the device Step for a CUDA model). With `overlap`
// (OverlapSteps) and not `resend_residual`, overlapped instead:
// BeginOverlappedStep(gradients.grad(), params) before the forward pass,
// GradientReady for every range the model reports, FinishOverlappedStep
// after backward; a retried step (resend_residual: a zero gradient, the
// first attempt's is in the residual) runs the plain Step. `params` is the
// model's flat host parameters (updated in place).
// Returns the errors that end the run: the gradient's (Compute's, or a
// GradientReady refused), after AbandonOverlappedStep when a step was open
// (nothing applied, the residual as before it). The step's own outcome is
// attempt->stats.
absl::Status ComputeAndStep(WorkerClient& client, Model& model,
                            GradientSource& gradients, int64_t step,
                            int64_t epoch, bool resend_residual, bool overlap,
                            absl::Span<float> params, StepAttempt* attempt);

}  // namespace trainer_internal
}  // namespace worker
}  // namespace gtopk

#endif  // GTOPK_WORKER_TRAINER_TRAIN_STEP_H_
