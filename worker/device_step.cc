// DeviceStep on CUDA (or the CUDA emulator, tests/testing/): built with
// GTOPK_HAVE_CUDA, in place of worker/device_step_none.cc. The phases and
// their order are in worker/device_step.h.
#include "worker/device_step.h"

#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/cuda/cuda_selector.h"
#include "common/cuda/sparsify.h"
#include "common/selector.h"
#include "common/status_macros.h"
#include "common/topk.h"

namespace gtopk {
namespace worker {
namespace {

absl::Status Cuda(const cuda::KernelStatus& s) { return cuda::ToAbslStatus(s); }

absl::Status CudaCall(cudaError_t e, const char* call, const char* file,
                      int line) {
  if (e == cudaSuccess) return absl::OkStatus();
  return cuda::ToAbslStatus(cuda::CudaError(e, call, file, line));
}
#define GTOPK_CUDA_ABSL(call) CudaCall((call), #call, __FILE__, __LINE__)

// residual + received where a zero residual gives received's bits
// (ErrorFeedback::PutBack's rule).
float PutBackSum(float residual, float received) {
  return cpu::MagnitudeKey(residual) == 0 ? received : residual + received;
}

// Sent entries split by the pulled global top-k (one merge walk of the two
// sorted index lists): sent \ global with the value to put back, and
// sent ∩ global, whose velocity momentum factor masking zeroes.
struct SentSplit {
  std::vector<uint32_t> back_idx;
  std::vector<float> back_val;
  std::vector<uint32_t> mask_idx;
};

SentSplit SplitSent(const DeviceStep::Sent& s, const SparseVector& global) {
  SentSplit out;
  size_t g = 0;
  for (size_t j = 0; j < s.sent.size(); ++j) {
    const uint32_t i = s.sent.indices[j];
    while (g < global.size() && global.indices[g] < i) ++g;
    if (g < global.size() && global.indices[g] == i) {
      out.mask_idx.push_back(i);
    } else {
      out.back_idx.push_back(i);
      out.back_val.push_back(PutBackSum(s.marked[j], s.received.values[j]));
    }
  }
  return out;
}

class CudaDeviceStep final : public DeviceStep {
 public:
  ~CudaDeviceStep() override {
    // Best effort: a failure here has no one to report to.
    for (cudaEvent_t e : ready_) cudaEventDestroy(e);
    if (side_ != nullptr) cudaStreamDestroy(side_);
  }
  CudaDeviceStep(const OptimizerOptions& optimizer, uint64_t n)
      : n_(n),
        momentum_(optimizer.momentum),
        weight_decay_(optimizer.weight_decay),
        dgc_momentum_(optimizer.momentum_mode == MomentumMode::kDgcCorrection),
        global_momentum_(optimizer.momentum_mode == MomentumMode::kGlobal),
        masking_(optimizer.momentum_factor_masking) {}

  // Create's allocations and uploads.
  absl::Status Init(std::unique_ptr<cuda::CudaSelector> selector,
                    absl::Span<const float> residual,
                    absl::Span<const float> velocity,
                    absl::Span<const float> global_velocity,
                    cudaStream_t stream);

  absl::Status Accumulate(const float* gradient, const float* params, float lr,
                          cudaStream_t stream) override;
  absl::StatusOr<Sent> Select(absl::Span<const Range> ranges, int64_t step,
                              ValueCodec value_codec,
                              cudaStream_t stream) override;
  absl::Status BeginOverlap(size_t slots) override;
  absl::Status MarkReady(size_t slot, cudaStream_t stream) override;
  absl::Status AccumulateAndSelect(size_t slot, const Range& range,
                                   const float* gradient, const float* params,
                                   float lr, int64_t step,
                                   SparseVector* sent) override;
  absl::StatusOr<Sent> Commit(SparseVector sent, ValueCodec value_codec,
                              cudaStream_t stream) override;
  absl::Status PutBackAll(const Sent& sent, const absl::Status& status,
                          cudaStream_t stream) override;
  absl::Status Apply(const Sent& sent, const SparseVector& global,
                     bool put_back, uint32_t num_workers, float* params,
                     cudaStream_t stream) override;
  absl::Status CopyStateToHost(absl::Span<float> residual,
                               absl::Span<float> velocity) override;

 private:
  // Select's parts on the spare buffer u (nothing committed): the ranges
  // with k = 0 read back and checked finite; the selector on each range with
  // k > 0, its pairs appended to `sent` with global indices.
  absl::Status CheckFiniteOnHost(const float* u, absl::Span<const Range> ranges,
                                 bool several, cudaStream_t stream);
  // Accumulate on [begin, begin + size) of every buffer.
  absl::Status AccumulateOn(const float* gradient, const float* params,
                            float lr, uint64_t begin, uint64_t size,
                            cudaStream_t stream);
  absl::Status SelectRange(float* u, const Range& r, int64_t step, bool several,
                           cudaStream_t stream, SparseVector* sent);
  // MarkSent on the host values of `sent` (u_i - recv_i), written to u on
  // the device when the codec is lossy; then commits the spare buffers.
  absl::Status MarkSent(Sent& sent, cudaStream_t stream);
  // The residual (u, once Select committed it).
  float* u() { return residual_[current_].get(); }

  const uint64_t n_;
  const float momentum_;
  const float weight_decay_;
  const bool dgc_momentum_;
  const bool global_momentum_;
  const bool masking_;
  std::unique_ptr<cuda::CudaSelector> selector_;
  cuda::DeviceBuffer<float> residual_[2];
  cuda::DeviceBuffer<float> velocity_[2];  // DGC momentum only
  int current_ = 0;  // residual_[current_], velocity_[current_] hold the state
  cuda::DeviceBuffer<float> global_velocity_;  // kGlobal momentum only
  cuda::SparseUpdater updater_;
  // Overlapped steps (BeginOverlap): the side stream and one event a slot.
  cudaStream_t side_ = nullptr;
  std::vector<cudaEvent_t> ready_;
};

absl::Status CudaDeviceStep::Init(std::unique_ptr<cuda::CudaSelector> selector,
                                  absl::Span<const float> residual,
                                  absl::Span<const float> velocity,
                                  absl::Span<const float> global_velocity,
                                  cudaStream_t stream) {
  const uint64_t n = n_;
  selector_ = std::move(selector);
  for (int b = 0; b < 2; ++b) {
    GTOPK_RETURN_IF_ERROR(Cuda(residual_[b].Allocate(n)));
    if (dgc_momentum_) GTOPK_RETURN_IF_ERROR(Cuda(velocity_[b].Allocate(n)));
  }
  GTOPK_RETURN_IF_ERROR(GTOPK_CUDA_ABSL(
      cudaMemcpyAsync(residual_[0].get(), residual.data(), n * sizeof(float),
                      cudaMemcpyHostToDevice, stream)));
  if (dgc_momentum_) {
    GTOPK_RETURN_IF_ERROR(GTOPK_CUDA_ABSL(
        cudaMemcpyAsync(velocity_[0].get(), velocity.data(), n * sizeof(float),
                        cudaMemcpyHostToDevice, stream)));
  }
  if (global_momentum_) {
    GTOPK_RETURN_IF_ERROR(Cuda(global_velocity_.Allocate(n)));
    GTOPK_RETURN_IF_ERROR(GTOPK_CUDA_ABSL(
        cudaMemcpyAsync(global_velocity_.get(), global_velocity.data(),
                        n * sizeof(float), cudaMemcpyHostToDevice, stream)));
  }
  return GTOPK_CUDA_ABSL(cudaStreamSynchronize(stream));
}

absl::Status CudaDeviceStep::Accumulate(const float* gradient,
                                        const float* params, float lr,
                                        cudaStream_t stream) {
  return AccumulateOn(gradient, params, lr, 0, n_, stream);
}

absl::Status CudaDeviceStep::AccumulateOn(const float* gradient,
                                          const float* params, float lr,
                                          uint64_t begin, uint64_t size,
                                          cudaStream_t stream) {
  const int cur = current_, next = 1 - current_;
  cuda::UpdateParams up;
  up.lr = lr;
  up.momentum = momentum_;
  up.weight_decay = weight_decay_;
  up.momentum_correction = dgc_momentum_;
  // The range of a buffer (velocity: DGC momentum only, null otherwise).
  auto at = [begin](auto* p) { return p == nullptr ? nullptr : p + begin; };
  return Cuda(selector_->sparsifier()->Accumulate(
      gradient + begin, at(params), at(velocity_[cur].get()),
      at(velocity_[next].get()), residual_[cur].get() + begin,
      residual_[next].get() + begin, size, up, stream));
}

// The "not finite" error of Select, naming the range when there are several.
absl::Status NotFinite(const DeviceStep::Range& r, bool several,
                       absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(
      "Step (device): the gradient (or residual + lr * gradient) is not "
      "finite",
      several ? absl::StrCat(" in [", r.begin, ", ", r.begin + r.size, ")")
              : "",
      ": ", what));
}

absl::Status CheckRanges(absl::Span<const DeviceStep::Range> ranges,
                         uint64_t n) {
  uint64_t end = 0;
  for (const DeviceStep::Range& r : ranges) {
    if (r.size == 0 || r.begin < end || r.begin > n || r.size > n - r.begin ||
        r.k > r.size) {
      return absl::InvalidArgumentError(
          absl::StrCat("Step (device): selection range [", r.begin, ", ",
                       r.begin + r.size, ") with k = ", r.k,
                       " is empty, overlaps the previous one (ending at ", end,
                       "), ends past n = ", n, " or has k over its size"));
    }
    end = r.begin + r.size;
  }
  return absl::OkStatus();
}

absl::StatusOr<DeviceStep::Sent> CudaDeviceStep::Select(
    absl::Span<const Range> ranges, int64_t step, ValueCodec value_codec,
    cudaStream_t stream) {
  GTOPK_RETURN_IF_ERROR(CheckRanges(ranges, n_));
  // u is in the spare buffer until MarkSent commits it: a failure below
  // (some ranges already zeroed there) leaves the state as before this call.
  float* u = residual_[1 - current_].get();
  GTOPK_RETURN_IF_ERROR(
      CheckFiniteOnHost(u, ranges, ranges.size() > 1, stream));
  SparseVector sent;
  for (const Range& r : ranges) {
    if (r.k == 0) continue;
    GTOPK_RETURN_IF_ERROR(
        SelectRange(u, r, step, ranges.size() > 1, stream, &sent));
  }
  return Commit(std::move(sent), value_codec, stream);
}

absl::StatusOr<DeviceStep::Sent> CudaDeviceStep::Commit(SparseVector sent,
                                                        ValueCodec value_codec,
                                                        cudaStream_t stream) {
  Sent s;
  s.sent = std::move(sent);
  s.received = s.sent;
  QuantizeValues(value_codec, absl::MakeSpan(s.received.values));
  GTOPK_RETURN_IF_ERROR(MarkSent(s, stream));
  return s;
}

absl::Status CudaDeviceStep::BeginOverlap(size_t slots) {
  if (side_ == nullptr) {
    GTOPK_RETURN_IF_ERROR(GTOPK_CUDA_ABSL(
        cudaStreamCreateWithFlags(&side_, cudaStreamNonBlocking)));
  }
  while (ready_.size() < slots) {
    cudaEvent_t e = nullptr;
    GTOPK_RETURN_IF_ERROR(GTOPK_CUDA_ABSL(cudaEventCreate(&e)));
    ready_.push_back(e);
  }
  return absl::OkStatus();
}

absl::Status CudaDeviceStep::MarkReady(size_t slot, cudaStream_t stream) {
  return GTOPK_CUDA_ABSL(cudaEventRecord(ready_[slot], stream));
}

absl::Status CudaDeviceStep::AccumulateAndSelect(
    size_t slot, const Range& range, const float* gradient, const float* params,
    float lr, int64_t step, SparseVector* sent) {
  GTOPK_RETURN_IF_ERROR(CheckRanges({range}, n_));
  GTOPK_RETURN_IF_ERROR(
      GTOPK_CUDA_ABSL(cudaStreamWaitEvent(side_, ready_[slot], 0)));
  GTOPK_RETURN_IF_ERROR(
      AccumulateOn(gradient, params, lr, range.begin, range.size, side_));
  float* u = residual_[1 - current_].get();
  if (range.k == 0) {
    return CheckFiniteOnHost(u, {range}, /*several=*/true, side_);
  }
  return SelectRange(u, range, step, /*several=*/true, side_, sent);
}

absl::Status CudaDeviceStep::CheckFiniteOnHost(const float* u,
                                               absl::Span<const Range> ranges,
                                               bool several,
                                               cudaStream_t stream) {
  std::vector<std::vector<float>> host;
  for (const Range& r : ranges) {
    if (r.k != 0) continue;
    host.emplace_back(r.size);
    GTOPK_RETURN_IF_ERROR(GTOPK_CUDA_ABSL(
        cudaMemcpyAsync(host.back().data(), u + r.begin, r.size * sizeof(float),
                        cudaMemcpyDeviceToHost, stream)));
  }
  if (host.empty()) return absl::OkStatus();
  GTOPK_RETURN_IF_ERROR(GTOPK_CUDA_ABSL(cudaStreamSynchronize(stream)));
  size_t h = 0;
  for (const Range& r : ranges) {
    if (r.k != 0) continue;
    const std::vector<float>& values = host[h++];
    for (size_t i = 0; i < values.size(); ++i) {
      if (!std::isfinite(values[i])) {
        return NotFinite(
            r, several,
            absl::StrCat("a non-finite value (", values[i], ") at position ",
                         r.begin + i, " of a range that selects nothing"));
      }
    }
  }
  return absl::OkStatus();
}

absl::Status CudaDeviceStep::SelectRange(float* u, const Range& r, int64_t step,
                                         bool several, cudaStream_t stream,
                                         SparseVector* sent) {
  SparseVector part;
  const absl::Status st = selector_->SelectDevice(
      u + r.begin, r.size, r.k, static_cast<uint64_t>(step), stream,
      /*zero_selected=*/true, &part);
  if (st.code() == absl::StatusCode::kInvalidArgument) {
    return NotFinite(
        r, several,
        several ? absl::StrCat(st.message(), " (positions from ", r.begin, ")")
                : std::string(st.message()));
  }
  GTOPK_RETURN_IF_ERROR(st);
  if (sent->empty() && r.begin == 0) {
    *sent = std::move(part);
    return absl::OkStatus();
  }
  for (size_t j = 0; j < part.size(); ++j) {
    sent->indices.push_back(static_cast<uint32_t>(part.indices[j] + r.begin));
    sent->values.push_back(part.values[j]);
  }
  return absl::OkStatus();
}

absl::Status CudaDeviceStep::MarkSent(Sent& s, cudaStream_t stream) {
  const int next = 1 - current_;
  float* u = residual_[next].get();
  // MarkSent: residual_i = u_i - recv_i; the device holds +0.0 there, which
  // is that value for a lossless codec.
  s.marked.resize(s.sent.size());
  bool lossy = false;
  for (size_t j = 0; j < s.sent.size(); ++j) {
    s.marked[j] = s.sent.values[j] - s.received.values[j];
    if (!std::isfinite(s.marked[j])) {
      // Restore u and commit it (the host Step's contract: u stays).
      GTOPK_RETURN_IF_ERROR(
          Cuda(updater_.Set(u, n_, s.sent.indices.data(), s.sent.values.data(),
                            s.sent.size(), stream)));
      GTOPK_RETURN_IF_ERROR(GTOPK_CUDA_ABSL(cudaStreamSynchronize(stream)));
      current_ = next;
      return absl::InvalidArgumentError(absl::StrCat(
          "MarkSent: u - received overflows at index ", s.sent.indices[j]));
    }
    lossy |= cpu::MagnitudeKey(s.marked[j]) != 0;
  }
  if (lossy) {
    GTOPK_RETURN_IF_ERROR(Cuda(updater_.Set(
        u, n_, s.sent.indices.data(), s.marked.data(), s.sent.size(), stream)));
  }
  current_ = next;  // residual = u - recv, velocity updated: committed
  return absl::OkStatus();
}

absl::Status CudaDeviceStep::PutBackAll(const Sent& s,
                                        const absl::Status& status,
                                        cudaStream_t stream) {
  std::vector<float> back(s.sent.size());
  for (size_t j = 0; j < s.sent.size(); ++j) {
    back[j] = PutBackSum(s.marked[j], s.received.values[j]);
  }
  cuda::KernelStatus restored = updater_.Set(
      u(), n_, s.sent.indices.data(), back.data(), s.sent.size(), stream);
  if (restored.ok()) {
    const cudaError_t e = cudaStreamSynchronize(stream);
    if (e != cudaSuccess)
      restored = cuda::CudaError(e, "sync", __FILE__, __LINE__);
  }
  if (!restored.ok()) {
    return absl::InternalError(absl::StrCat(status.ToString(),
                                            "; and restoring the residual "
                                            "failed: ",
                                            restored.message));
  }
  return status;
}

absl::Status CudaDeviceStep::Apply(const Sent& s, const SparseVector& global,
                                   bool put_back, uint32_t num_workers,
                                   float* params, cudaStream_t stream) {
  const SentSplit split = SplitSent(s, global);
  if (put_back) {
    GTOPK_RETURN_IF_ERROR(
        Cuda(updater_.Set(u(), n_, split.back_idx.data(), split.back_val.data(),
                          split.back_idx.size(), stream)));
  }
  if (dgc_momentum_ && masking_) {
    const std::vector<float> zeros(split.mask_idx.size(), 0.0f);
    GTOPK_RETURN_IF_ERROR(
        Cuda(updater_.Set(velocity_[current_].get(), n_, split.mask_idx.data(),
                          zeros.data(), split.mask_idx.size(), stream)));
  }
  const float p = static_cast<float>(num_workers);
  std::vector<float> update(global.size());
  for (size_t j = 0; j < global.size(); ++j) update[j] = global.values[j] / p;
  if (global_momentum_) {
    GTOPK_RETURN_IF_ERROR(Cuda(updater_.GlobalMomentum(
        params, global_velocity_.get(), n_, momentum_, global.indices.data(),
        update.data(), global.size(), stream)));
  } else {
    GTOPK_RETURN_IF_ERROR(
        Cuda(updater_.Subtract(params, n_, global.indices.data(), update.data(),
                               global.size(), stream)));
  }
  return GTOPK_CUDA_ABSL(cudaStreamSynchronize(stream));
}

absl::Status CudaDeviceStep::CopyStateToHost(absl::Span<float> residual,
                                             absl::Span<float> velocity) {
  GTOPK_RETURN_IF_ERROR(
      GTOPK_CUDA_ABSL(cudaMemcpy(residual.data(), residual_[current_].get(),
                                 n_ * sizeof(float), cudaMemcpyDeviceToHost)));
  if (dgc_momentum_) {
    GTOPK_RETURN_IF_ERROR(GTOPK_CUDA_ABSL(
        cudaMemcpy(velocity.data(), velocity_[current_].get(),
                   n_ * sizeof(float), cudaMemcpyDeviceToHost)));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<DeviceStep>> DeviceStep::Create(
    absl::string_view selector, uint64_t selector_seed,
    const OptimizerOptions& optimizer, uint64_t n,
    absl::Span<const float> residual, absl::Span<const float> velocity,
    absl::Span<const float> global_velocity, cudaStream_t stream) {
  SelectorOptions so;
  so.seed = selector_seed;
  // The selector by name from the same registry as the host Step's
  // (common/selector.h), with the GPU versions registered.
  SelectorRegistry registry;
  GTOPK_RETURN_IF_ERROR(RegisterBuiltinSelectors(&registry));
  GTOPK_RETURN_IF_ERROR(cuda::RegisterCudaSelectors(&registry));
  absl::StatusOr<std::unique_ptr<cuda::CudaSelector>> sel =
      cuda::CreateCudaSelector(registry, selector, so, n);
  if (!sel.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat("Step (device): selector \"", selector,
                     "\" has no GPU version or the GPU is unusable: ",
                     sel.status().message()));
  }
  auto d = std::make_unique<CudaDeviceStep>(optimizer, n);
  GTOPK_RETURN_IF_ERROR(
      d->Init(*std::move(sel), residual, velocity, global_velocity, stream));
  return d;
}

absl::Status DeviceStep::RunOnHostCopies(
    const float* gradient, float* params, uint64_t n, cudaStream_t stream,
    absl::FunctionRef<absl::Status(absl::Span<const float>, absl::Span<float>)>
        host_step) {
  std::vector<float> host_grad(n), host_params(n);
  GTOPK_RETURN_IF_ERROR(GTOPK_CUDA_ABSL(
      cudaMemcpyAsync(host_grad.data(), gradient, n * sizeof(float),
                      cudaMemcpyDeviceToHost, stream)));
  GTOPK_RETURN_IF_ERROR(GTOPK_CUDA_ABSL(
      cudaMemcpyAsync(host_params.data(), params, n * sizeof(float),
                      cudaMemcpyDeviceToHost, stream)));
  GTOPK_RETURN_IF_ERROR(GTOPK_CUDA_ABSL(cudaStreamSynchronize(stream)));
  GTOPK_RETURN_IF_ERROR(host_step(host_grad, absl::MakeSpan(host_params)));
  GTOPK_RETURN_IF_ERROR(GTOPK_CUDA_ABSL(
      cudaMemcpyAsync(params, host_params.data(), n * sizeof(float),
                      cudaMemcpyHostToDevice, stream)));
  return GTOPK_CUDA_ABSL(cudaStreamSynchronize(stream));
}

}  // namespace worker
}  // namespace gtopk
