#include "common/cuda/cuda_selector.h"

#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"

namespace gtopk {
namespace cuda {

absl::Status ToAbslStatus(const KernelStatus& status) {
  if (status.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(status.code),
                      status.message);
}

namespace {

// Every GPU selector; its name is MethodName's.
constexpr Method kMethods[] = {Method::kExact, Method::kGaussianK,
                               Method::kDgc};

}  // namespace

absl::StatusOr<Method> ParseMethod(absl::string_view name) {
  for (const Method method : kMethods) {
    if (name == MethodName(method)) return method;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "no CUDA selector \"", name, "\"; known: ",
      absl::StrJoin(kMethods, ", ", [](std::string* out, Method method) {
        out->append(MethodName(method));
      })));
}

absl::Status RegisterCudaSelectors(SelectorRegistry* registry) {
  for (const Method method : kMethods) {
    GTOPK_RETURN_IF_ERROR(registry->RegisterDevice(
        MethodName(method),
        [method](const SelectorOptions& options, uint64_t capacity)
            -> absl::StatusOr<std::unique_ptr<Selector>> {
          return CudaSelector::Create(MethodName(method), options, capacity);
        }));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<CudaSelector>> CreateCudaSelector(
    const SelectorRegistry& registry, absl::string_view name,
    const SelectorOptions& options, uint64_t capacity) {
  GTOPK_ASSIGN_OR_RETURN(std::unique_ptr<Selector> selector,
                         registry.CreateDevice(name, options, capacity));
  if (dynamic_cast<CudaSelector*>(selector.get()) == nullptr) {
    return absl::InternalError(
        absl::StrCat("device selector \"", name, "\" is not a CUDA selector"));
  }
  return std::unique_ptr<CudaSelector>(
      static_cast<CudaSelector*>(selector.release()));
}

absl::StatusOr<std::unique_ptr<CudaSelector>> CudaSelector::Create(
    absl::string_view name, const SelectorOptions& options, uint64_t capacity) {
  return Create(name, options, capacity, SparsifierTuning());
}

absl::StatusOr<std::unique_ptr<CudaSelector>> CudaSelector::Create(
    absl::string_view name, const SelectorOptions& options, uint64_t capacity,
    const SparsifierTuning& tuning) {
  GTOPK_ASSIGN_OR_RETURN(const Method method, ParseMethod(name));
  GTOPK_RETURN_IF_ERROR(ValidateSelectorOptions(options));
  std::unique_ptr<Sparsifier> sparsifier;
  GTOPK_RETURN_IF_ERROR(ToAbslStatus(Sparsifier::Create(
      std::max<uint64_t>(capacity, 1), tuning, &sparsifier)));
  return std::unique_ptr<CudaSelector>(
      new CudaSelector(method, options, tuning, std::move(sparsifier)));
}

absl::Status CudaSelector::EnsureCapacity(uint64_t n) {
  if (n <= sparsifier_->capacity()) return absl::OkStatus();
  sparsifier_.reset();  // free the old scratch first
  return ToAbslStatus(Sparsifier::Create(n, tuning_, &sparsifier_));
}

absl::Status CudaSelector::Select(absl::Span<const float> u, uint64_t k,
                                  uint64_t step, SparseVector* out) {
  out->clear();
  GTOPK_RETURN_IF_ERROR(ValidateSelectArgs(u.size(), k));
  if (staging_.size() < u.size()) {
    GTOPK_RETURN_IF_ERROR(ToAbslStatus(staging_.Allocate(u.size())));
  }
  const cudaError_t copied =
      cudaMemcpy(staging_.get(), u.data(), u.size() * sizeof(float),
                 cudaMemcpyHostToDevice);
  if (copied != cudaSuccess) {
    return ToAbslStatus(
        CudaError(copied, "cudaMemcpy(staging, u)", __FILE__, __LINE__));
  }
  return SelectDevice(staging_.get(), u.size(), k, step, /*stream=*/nullptr,
                      /*zero_selected=*/false, out);
}

absl::Status CudaSelector::SelectDevice(float* u, uint64_t n, uint64_t k,
                                        uint64_t step, cudaStream_t stream,
                                        bool zero_selected, SparseVector* out) {
  out->clear();
  GTOPK_RETURN_IF_ERROR(ValidateSelectArgs(n, k));
  GTOPK_RETURN_IF_ERROR(EnsureCapacity(n));
  SelectParams p;
  p.method = method_;
  p.k = k;
  p.step = step;
  p.seed = options_.seed;
  p.dgc_sample_fraction = options_.dgc_sample_fraction;
  p.gaussiank_max_adjustments = options_.gaussiank_max_adjustments;
  p.zero_selected = zero_selected;
  GTOPK_RETURN_IF_ERROR(ToAbslStatus(sparsifier_->Select(u, n, p, stream)));
  SelectedPairs selection;
  GTOPK_RETURN_IF_ERROR(ToAbslStatus(sparsifier_->Wait(stream, &selection)));
  out->indices.assign(selection.indices, selection.indices + selection.count);
  out->values.assign(selection.values, selection.values + selection.count);
  last_info_ = selection.info;
  return absl::OkStatus();
}

}  // namespace cuda
}  // namespace gtopk
