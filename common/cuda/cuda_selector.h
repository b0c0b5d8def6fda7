// Adapters from the Abseil-free CUDA core (common/cuda/sparsify.h) to the
// project's interfaces: absl::Status, and a Selector (common/selector.h)
// whose selection runs on the GPU. Built only when GTOPK_HAVE_CUDA.
#ifndef GTOPK_COMMON_CUDA_CUDA_SELECTOR_H_
#define GTOPK_COMMON_CUDA_CUDA_SELECTOR_H_

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "common/cuda/cuda_status.h"
#include "common/cuda/sparsify.h"
#include "common/cuda/sparsify/testing.h"
#include "common/selector.h"
#include "common/sparse_vector.h"

namespace gtopk {
namespace cuda {

// The same code and message as an absl::Status.
absl::Status ToAbslStatus(const KernelStatus& status);

// "exact", "gaussiank" or "dgc" -> Method; INVALID_ARGUMENT otherwise
// (randomk has no GPU version: it reads k entries and needs no selection).
absl::StatusOr<Method> ParseMethod(absl::string_view name);

class CudaSelector;

// Registers the GPU versions of exact, gaussiank and dgc (every Method, under
// MethodName) as the device implementations of the registry's selectors of
// those names (SelectorRegistry::RegisterDevice: call RegisterBuiltinSelectors
// first); each factory makes a CudaSelector. The one place the GPU selectors
// enter a registry, called where a device selector is made
// (worker/device_step.cc), since common/selector.cc does not include
// common/cuda/. Errors: RegisterDevice's.
absl::Status RegisterCudaSelectors(SelectorRegistry* registry);

// registry.CreateDevice(name, options, capacity) as the CudaSelector that
// RegisterCudaSelectors' factories make, for its device-memory interface
// (SelectDevice, sparsifier()). Errors: CreateDevice's; INTERNAL if the
// registry's device selector `name` is not a CudaSelector.
absl::StatusOr<std::unique_ptr<CudaSelector>> CreateCudaSelector(
    const SelectorRegistry& registry, absl::string_view name,
    const SelectorOptions& options, uint64_t capacity);

// A GPU selector behind gtopk::Selector, with the CPU selector's count
// contract (Min/MaxCount) and, for "exact", its exact output.
//
// Select(host span) stages u to the device first (for tests and drop-in
// use); SelectDevice works on device memory and moves only the selected
// pairs to the host. Not thread-safe (one instance per thread and stream);
// keeps its device scratch (common/cuda/sparsify.h) between calls and grows
// it when n exceeds the capacity.
class CudaSelector final : public Selector {
 public:
  // INVALID_ARGUMENT for an unknown name or invalid options; a CUDA error
  // (INTERNAL, RESOURCE_EXHAUSTED) when no device is usable.
  // `capacity`: the largest n expected (scratch is allocated for it).
  static absl::StatusOr<std::unique_ptr<CudaSelector>> Create(
      absl::string_view name, const SelectorOptions& options,
      uint64_t capacity);
  // The same with the core's test hooks (common/cuda/sparsify/testing.h),
  // kept when the scratch grows.
  static absl::StatusOr<std::unique_ptr<CudaSelector>> Create(
      absl::string_view name, const SelectorOptions& options, uint64_t capacity,
      const SparsifierTuning& tuning);

  absl::string_view name() const override { return MethodName(method_); }
  absl::Status Select(absl::Span<const float> u, uint64_t k, uint64_t step,
                      SparseVector* out) override;
  uint64_t MinCount(uint64_t k) const override {
    return cuda::MinCount(method_, k);
  }
  uint64_t MaxCount(uint64_t k) const override {
    return cuda::MaxCount(method_, k);
  }

  // Selects from device memory u (length n) on `stream` and blocks until
  // the pairs are in `out` (Selector::Select's contract otherwise).
  // zero_selected: u[i] = +0.0 on the device for each selected i, as
  // ErrorFeedback::MarkSent does for a lossless codec. Errors as Select's;
  // on error u is unchanged and out is empty.
  absl::Status SelectDevice(float* u, uint64_t n, uint64_t k, uint64_t step,
                            cudaStream_t stream, bool zero_selected,
                            SparseVector* out);

  // What the last successful selection did.
  const SelectInfo& last_info() const { return last_info_; }

  // The core, e.g. for the fused Accumulate before SelectDevice.
  Sparsifier* sparsifier() { return sparsifier_.get(); }

 private:
  CudaSelector(Method method, const SelectorOptions& options,
               const SparsifierTuning& tuning,
               std::unique_ptr<Sparsifier> sparsifier)
      : method_(method),
        options_(options),
        tuning_(tuning),
        sparsifier_(std::move(sparsifier)) {}
  absl::Status EnsureCapacity(uint64_t n);

  Method method_;
  SelectorOptions options_;
  SparsifierTuning tuning_;
  std::unique_ptr<Sparsifier> sparsifier_;
  DeviceBuffer<float> staging_;  // Select(host span)'s copy of u
  SelectInfo last_info_;
};

}  // namespace cuda
}  // namespace gtopk

#endif  // GTOPK_COMMON_CUDA_CUDA_SELECTOR_H_
