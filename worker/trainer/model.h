// The trainer's models behind a torch-free interface, so that only
// model_torch.cc includes libtorch headers (compile time).
//
// Parameters live in ONE flat float buffer of length n (order: the model's
// parameter order, each tensor row-major); the model's tensors are views into
// it, so the worker client updates the model in place.
#ifndef GTOPK_WORKER_TRAINER_MODEL_H_
#define GTOPK_WORKER_TRAINER_MODEL_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace gtopk {
namespace worker {

inline constexpr int kImageSide = 28;
inline constexpr int kImagePixels = kImageSide * kImageSide;
inline constexpr int kClasses = 10;
// Fashion-MNIST training-set statistics of pixels scaled to [0, 1].
inline constexpr float kPixelMean = 0.2860f;
inline constexpr float kPixelStd = 0.3530f;

struct EvalResult {
  double accuracy = 0;  // fraction of correct top-1 predictions
  double loss = 0;      // mean cross-entropy
};

class Model {
 public:
  virtual ~Model() = default;
  // The flat parameter buffer (length n), the tensors' storage.
  virtual absl::Span<float> params() = 0;
  size_t n() const { return n_; }

  // ComputeGradient's report of a finished range: grad[begin, end) holds
  // its final values and is not written again in that call.
  using GradientRangeReady = std::function<void(size_t begin, size_t end)>;

  // Forward and backward on `batch` images (normalised floats, batch x 784)
  // with `labels` (batch entries, 0..9); writes the gradient of the mean
  // cross-entropy into `grad` (length n) and returns that loss.
  // `on_ready` (optional): called with each parameter tensor's range of
  // `grad` as soon as the backward pass has produced that parameter's
  // gradient and it was copied there (autograd hooks: the last layers
  // first), on the thread that runs the backward pass (the caller's, for a
  // CPU model); the parameters that got no gradient are zero-filled and
  // reported after backward. The calls cover [0, n) once each, and all
  // come before ComputeGradient returns; on an error some may be missing.
  virtual absl::StatusOr<float> ComputeGradient(
      absl::Span<const float> images, absl::Span<const int64_t> labels,
      absl::Span<float> grad, const GradientRangeReady& on_ready = nullptr) = 0;
  // Forward only, in chunks; the images are normalised floats (count x 784).
  virtual EvalResult Evaluate(absl::Span<const float> images,
                              absl::Span<const int64_t> labels) = 0;

  // CUDA models (MakeTorchModel with cuda = true; --device=cuda): the
  // parameters the forward pass uses and the flat gradient live in device
  // memory. params() is then a host copy, used to synchronise with the
  // servers; UploadParams copies it to the device parameters.
  virtual bool on_device() const { return false; }
  virtual absl::Status UploadParams() { return absl::OkStatus(); }
  // The device parameters -> params() (e.g. for the final checksum).
  virtual absl::Status DownloadParams() { return absl::OkStatus(); }
  // Sets the device gradient (the buffer ComputeGradientOnDevice hands out)
  // to zeros: a retried step adds no new gradient (its gradient is already in
  // the residual). No-op for CPU models.
  virtual absl::Status ZeroDeviceGradient() { return absl::OkStatus(); }
  // The device parameter buffer (n floats, the model's storage) or null.
  virtual float* device_params() { return nullptr; }
  // ComputeGradient with the gradient left in device memory:
  // *device_grad = n floats, valid until the next call. Only the loss
  // crosses to the host. FAILED_PRECONDITION for a CPU model.
  virtual absl::StatusOr<float> ComputeGradientOnDevice(
      absl::Span<const float> images, absl::Span<const int64_t> labels,
      const float** device_grad);
  // A gradient made on the host (synthetic:N) copied to the device gradient
  // buffer (n floats; returned, valid until the next call). Returns when the
  // copy is complete. FAILED_PRECONDITION for a CPU model; INVALID_ARGUMENT
  // when grad.size() != n.
  virtual absl::StatusOr<const float*> UploadGradient(
      absl::Span<const float> grad);

 protected:
  size_t n_ = 0;
};

// "mlp" (784-256-10, ReLU) or "cnn" (conv 5x5 32 + max-pool 2, conv 5x5 64 +
// max-pool 2, fc 1024-256, fc 256-10, ReLU). Initialised like PyTorch's
// defaults (uniform +-1/sqrt(fan_in)) from torch::manual_seed(seed).
// `threads`: torch intra-op threads (>= 1). `cuda`: parameters, gradient
// and the forward/backward passes on CUDA device 0 (the same initial values:
// they are drawn on the CPU, then copied).
// Errors: INVALID_ARGUMENT for another name; FAILED_PRECONDITION for cuda
// without TorchCudaAvailable().
absl::StatusOr<std::unique_ptr<Model>> MakeTorchModel(const std::string& name,
                                                      uint64_t seed,
                                                      int threads,
                                                      bool cuda = false);

// `synthetic:N` with --device=cuda: `host` (the synthetic model, whose
// params() are the initial values and stay the host copy) with its
// parameters and gradient mirrored in CUDA device 0's memory, so the worker
// client runs its device Step on them; the host makes each step's gradient
// and UploadGradient copies it over (its time counts as compute).
// FAILED_PRECONDITION without TorchCudaAvailable().
absl::StatusOr<std::unique_ptr<Model>> MakeTorchDeviceMirror(
    std::unique_ptr<Model> host);

// Whether this libtorch was built with CUDA and sees a device.
bool TorchCudaAvailable();

inline absl::StatusOr<float> Model::ComputeGradientOnDevice(
    absl::Span<const float>, absl::Span<const int64_t>, const float**) {
  return absl::FailedPreconditionError(
      "ComputeGradientOnDevice: this model is not on a CUDA device");
}

inline absl::StatusOr<const float*> Model::UploadGradient(
    absl::Span<const float>) {
  return absl::FailedPreconditionError(
      "UploadGradient: this model is not on a CUDA device");
}

}  // namespace worker
}  // namespace gtopk

#endif  // GTOPK_WORKER_TRAINER_MODEL_H_
