#include "worker/trainer/train_step.h"

#include "absl/time/clock.h"
#include "common/status_macros.h"

namespace gtopk {
namespace worker {
namespace trainer_internal {
namespace {

// One client step after the gradient was made: on device memory for a CUDA
// model (the dense gradient never crosses to the host), else on host
// memory. torch runs on the legacy default stream, so that is the stream
// the client orders its work after.
absl::StatusOr<StepStats> StepOnce(WorkerClient& client, Model& model,
                                   absl::Span<const float> grad,
                                   const float* device_grad,
                                   absl::Span<float> params) {
#if GTOPK_HAVE_CUDA
  if (model.on_device()) {
    return client.Step(device_grad, model.device_params(), model.n(),
                       /*stream=*/nullptr);
  }
#else
  (void)model;
  (void)device_grad;
#endif
  return client.Step(grad, params);
}

}  // namespace

bool OverlapSteps(const TrainerOptions& options, const WorkerClient& client,
                  const Model& model) {
  return !options.testing_no_overlap && !client.bucket_pieces().empty() &&
         !model.on_device();
}

absl::Status ComputeAndStep(WorkerClient& client, Model& model,
                            GradientSource& gradients, int64_t step,
                            int64_t epoch, bool resend_residual, bool overlap,
                            absl::Span<float> params, StepAttempt* attempt) {
  const absl::Time t0 = absl::Now();
  if (!overlap || resend_residual) {
    GTOPK_RETURN_IF_ERROR(gradients.Compute(step, epoch, resend_residual));
    attempt->step_call = absl::Now();
    attempt->compute = attempt->step_call - t0;
    attempt->stats = StepOnce(client, model, gradients.grad(),
                              gradients.device_grad(), params);
    attempt->exposed = absl::Now() - attempt->step_call;
    return absl::OkStatus();
  }
  attempt->step_call = t0;
  if (absl::Status begun = client.BeginOverlappedStep(gradients.grad(), params);
      !begun.ok()) {
    attempt->stats = begun;  // nothing started: recovered like a step
    return absl::OkStatus();
  }
  absl::Status reported;  // the first GradientReady refused
  const absl::Status computed = gradients.Compute(
      step, epoch, /*resend_residual=*/false, [&](size_t begin, size_t end) {
        if (reported.ok()) {
          reported = client.GradientReady(begin, end);
        }
      });
  const absl::Time t_compute = absl::Now();
  attempt->compute = t_compute - t0;
  if (!computed.ok() || !reported.ok()) {
    client.AbandonOverlappedStep();
    return computed.ok() ? reported : computed;
  }
  attempt->stats = client.FinishOverlappedStep();
  attempt->exposed = absl::Now() - t_compute;
  return absl::OkStatus();
}

}  // namespace trainer_internal
}  // namespace worker
}  // namespace gtopk
