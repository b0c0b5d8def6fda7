// DeviceStep in a build without CUDA (GTOPK_HAVE_CUDA off), in place of
// worker/device_step.cc: no DeviceStep can be made, so WorkerClient's device
// Step fails with FAILED_PRECONDITION and its layout stays the same.
#include "worker/device_step.h"

namespace gtopk {
namespace worker {
namespace {

absl::Status BuiltWithoutCuda() {
  return absl::FailedPreconditionError(
      "Step (device): this gtopk was built without CUDA (GTOPK_CUDA off or "
      "nvcc not found); use the host Step");
}

}  // namespace

absl::StatusOr<std::unique_ptr<DeviceStep>> DeviceStep::Create(
    absl::string_view, uint64_t, const OptimizerOptions&, uint64_t,
    absl::Span<const float>, absl::Span<const float>, absl::Span<const float>,
    CUstream_st*) {
  return BuiltWithoutCuda();
}

absl::Status DeviceStep::RunOnHostCopies(
    const float*, float*, uint64_t, CUstream_st*,
    absl::FunctionRef<absl::Status(absl::Span<const float>,
                                   absl::Span<float>)>) {
  return BuiltWithoutCuda();
}

}  // namespace worker
}  // namespace gtopk
