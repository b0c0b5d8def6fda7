// The public entry points of common/cuda/sparsify.h: the count contract,
// SparseUpdater, and Sparsifier's Create, Accumulate and Select (Wait's steps
// are in wait.cc, the methods in select_*.cc).
#include <algorithm>
#include <cmath>
#include <memory>
#include <string>
#include <utility>

#include "common/cuda/sparsify.h"
#include "common/cuda/sparsify/host_util.h"
#include "common/cuda/sparsify/launchers.h"
#include "common/cuda/sparsify/sparsifier_impl.h"
#include "common/cuda/sparsify/testing.h"

namespace gtopk {
namespace cuda {

using internal::DeviceState;
using internal::DiscardStaleError;
using internal::kBins;
using internal::kChunkAlign;
using internal::kHistsSize;
using internal::kMaxBlocks;
using internal::kMaxWarps;
using internal::kOutHeader;
using internal::kUpdateChunks;
using internal::kWarpsPerBlock;
using internal::LaunchGlobalMomentum;
using internal::LaunchScatter;
using internal::ull;

struct Sparsifier::Impl : internal::SparsifierImpl {};

const char* MethodName(Method method) {
  switch (method) {
    case Method::kExact:
      return "exact";
    case Method::kGaussianK:
      return "gaussiank";
    case Method::kDgc:
      return "dgc";
  }
  return "unknown";
}

uint64_t MinCount(Method method, uint64_t k) {
  const uint64_t lo = (2 * k + 2) / 3, hi = 4 * k / 3;
  switch (method) {
    case Method::kExact:
      return k;
    case Method::kGaussianK:
      return lo <= hi ? lo : k;
    case Method::kDgc:
      return 1;
  }
  return k;
}

uint64_t MaxCount(Method method, uint64_t k) {
  const uint64_t lo = (2 * k + 2) / 3, hi = 4 * k / 3;
  return method == Method::kGaussianK && lo <= hi ? hi : k;
}

KernelStatus SparseUpdater::Upload(const uint32_t* idx, const float* val,
                                   uint64_t count, cudaStream_t stream) {
  if (idx_.size() < count) {
    // Buffers in flight on `stream` must not be freed under it.
    GTOPK_CUDA_CALL_OR_RETURN(cudaStreamSynchronize(stream));
    GTOPK_CUDA_RETURN_IF_ERROR(
        idx_.Allocate(std::max<uint64_t>(count, 2 * idx_.size())));
    GTOPK_CUDA_RETURN_IF_ERROR(val_.Allocate(idx_.size()));
  }
  GTOPK_CUDA_CALL_OR_RETURN(cudaMemcpyAsync(idx_.get(), idx,
                                            count * sizeof(uint32_t),
                                            cudaMemcpyHostToDevice, stream));
  GTOPK_CUDA_CALL_OR_RETURN(cudaMemcpyAsync(
      val_.get(), val, count * sizeof(float), cudaMemcpyHostToDevice, stream));
  return KernelStatus::Ok();
}

KernelStatus SparseUpdater::Scatter(float* dst, uint64_t n, const uint32_t* idx,
                                    const float* val, uint64_t count,
                                    int subtract, cudaStream_t stream) {
  DiscardStaleError();
  if (count == 0) return KernelStatus::Ok();
  GTOPK_CUDA_RETURN_IF_ERROR(Upload(idx, val, count, stream));
  const int blocks =
      static_cast<int>(std::min<uint64_t>((count + 255) / 256, 4096));
  LaunchScatter(blocks, stream, dst, n, idx_.get(), val_.get(), count,
                subtract);
  GTOPK_CUDA_LAUNCH_CHECK();
  return KernelStatus::Ok();
}

KernelStatus SparseUpdater::Set(float* dst, uint64_t n, const uint32_t* idx,
                                const float* val, uint64_t count,
                                cudaStream_t stream) {
  return Scatter(dst, n, idx, val, count, /*subtract=*/0, stream);
}

KernelStatus SparseUpdater::Subtract(float* dst, uint64_t n,
                                     const uint32_t* idx, const float* val,
                                     uint64_t count, cudaStream_t stream) {
  return Scatter(dst, n, idx, val, count, /*subtract=*/1, stream);
}

KernelStatus SparseUpdater::GlobalMomentum(float* params, float* velocity,
                                           uint64_t n, float momentum,
                                           const uint32_t* idx,
                                           const float* val, uint64_t count,
                                           cudaStream_t stream) {
  DiscardStaleError();
  if (n == 0) return KernelStatus::Ok();
  if (dense_.size() < n) {
    GTOPK_CUDA_CALL_OR_RETURN(cudaStreamSynchronize(stream));
    GTOPK_CUDA_RETURN_IF_ERROR(dense_.Allocate(n));
  }
  GTOPK_CUDA_CALL_OR_RETURN(
      cudaMemsetAsync(dense_.get(), 0, n * sizeof(float), stream));  // +0.0
  if (count > 0) {
    GTOPK_CUDA_RETURN_IF_ERROR(Upload(idx, val, count, stream));
    const int blocks =
        static_cast<int>(std::min<uint64_t>((count + 255) / 256, 4096));
    LaunchScatter(blocks, stream, dense_.get(), n, idx_.get(), val_.get(),
                  count, 0);
    GTOPK_CUDA_LAUNCH_CHECK();
  }
  const int blocks =
      static_cast<int>(std::min<uint64_t>((n + 1023) / 1024, 8192));
  LaunchGlobalMomentum(blocks, stream, params, velocity, dense_.get(), n,
                       momentum);
  GTOPK_CUDA_LAUNCH_CHECK();
  return KernelStatus::Ok();
}

int DeviceCount() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // clear the error
    return 0;
  }
  return count;
}

Sparsifier::Sparsifier(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

void Sparsifier::set_use_graphs(bool use) {
  impl_->use_graphs = use;
  if (!use) impl_->graphs.Clear();
}
void SetTuningForTesting(Sparsifier* sparsifier,
                         const SparsifierTuning& tuning) {
  internal::SparsifierImpl& m = *sparsifier->impl_;
  const SparsifierTuning old = m.tuning;
  m.SetTuning(tuning);
  // The captured graphs hold the old key limit and fallback choice (the
  // other hooks are part of their keys).
  if (m.tuning.gaussiank_key_limit != old.gaussiank_key_limit ||
      m.tuning.gaussiank_fallback_from_candidates !=
          old.gaussiank_fallback_from_candidates) {
    m.graphs.Clear();
  }
}

Sparsifier::~Sparsifier() = default;

uint64_t Sparsifier::capacity() const { return impl_->capacity; }
const uint32_t* Sparsifier::device_indices() const { return impl_->out_idx(); }
const float* Sparsifier::device_values() const { return impl_->out_val(); }

KernelStatus Sparsifier::Create(uint64_t capacity,
                                std::unique_ptr<Sparsifier>* out) {
  return Create(capacity, SparsifierTuning(), out);
}

KernelStatus Sparsifier::Create(uint64_t capacity,
                                const SparsifierTuning& tuning,
                                std::unique_ptr<Sparsifier>* out) {
  if (capacity == 0 || capacity > (uint64_t{1} << 32)) {
    return KernelStatus::Error(
        KernelStatusCode::kInvalidArgument,
        "Sparsifier capacity must be in [1, 2^32], got " +
            std::to_string(capacity));
  }
  auto impl = std::make_unique<Impl>();
  impl->capacity = capacity;
  impl->SetTuning(tuning);
  int device = 0, sms = 0;
  GTOPK_CUDA_CALL_OR_RETURN(cudaGetDevice(&device));
  GTOPK_CUDA_CALL_OR_RETURN(
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  impl->max_blocks = std::max(1, std::min(kMaxBlocks, sms * 8));
  int per_sm = 0;
  GTOPK_CUDA_CALL_OR_RETURN(internal::UpdateBlocksPerSm(&per_sm));
  impl->update_blocks =
      std::max(1, std::min(impl->max_blocks, sms * std::max(1, per_sm)));
  const size_t meta_bytes = kHistsSize * sizeof(ull) +
                            3 * kMaxBlocks * sizeof(double) +
                            kHistsSize * sizeof(ull);
  GTOPK_CUDA_RETURN_IF_ERROR(impl->meta.Allocate(meta_bytes));
  GTOPK_CUDA_CALL_OR_RETURN(cudaMemset(impl->meta.get(), 0, meta_bytes));
  GTOPK_CUDA_RETURN_IF_ERROR(impl->out.Allocate(Impl::OutBytes(capacity)));
  // The state (blocks_done must start at 0).
  GTOPK_CUDA_CALL_OR_RETURN(cudaMemset(impl->out.get(), 0, kOutHeader));
  // cudaMemset is asynchronous on the default stream, which a caller's
  // cudaStreamNonBlocking stream does not wait for: finish it here, or the
  // first InitKernel on that stream could run before it and be zeroed.
  GTOPK_CUDA_CALL_OR_RETURN(cudaStreamSynchronize(nullptr));
  impl->st = reinterpret_cast<DeviceState*>(impl->out.get());
  impl->hist0 = reinterpret_cast<ull*>(impl->meta.get());
  impl->hist1 = impl->hist0 + kBins;
  impl->hist2 = impl->hist1 + kBins;
  impl->partials = reinterpret_cast<double*>(impl->hist2 + 512);
  impl->trim_hists = reinterpret_cast<ull*>(impl->partials + 3 * kMaxBlocks);
  GTOPK_CUDA_RETURN_IF_ERROR(
      impl->regions.Allocate(capacity + kChunkAlign * kMaxWarps));
  GTOPK_CUDA_RETURN_IF_ERROR(impl->counts_u.Allocate(
      impl->update_blocks * kWarpsPerBlock * kUpdateChunks));
  GTOPK_CUDA_RETURN_IF_ERROR(
      impl->offsets_u.Allocate(impl->update_blocks * kUpdateChunks));
  GTOPK_CUDA_RETURN_IF_ERROR(impl->eq_counts_u.Allocate(
      impl->update_blocks * kWarpsPerBlock * kUpdateChunks));
  GTOPK_CUDA_RETURN_IF_ERROR(
      impl->eq_offsets_u.Allocate(impl->update_blocks * kUpdateChunks));
  GTOPK_CUDA_RETURN_IF_ERROR(impl->counts_a.Allocate(kMaxWarps));
  GTOPK_CUDA_RETURN_IF_ERROR(impl->counts_b.Allocate(kMaxWarps));
  GTOPK_CUDA_RETURN_IF_ERROR(impl->offsets_a.Allocate(kMaxWarps));
  GTOPK_CUDA_RETURN_IF_ERROR(impl->offsets_b.Allocate(kMaxWarps));
  GTOPK_CUDA_RETURN_IF_ERROR(impl->cand_idx.Allocate(capacity));
  GTOPK_CUDA_RETURN_IF_ERROR(impl->cand_val.Allocate(capacity));
  GTOPK_CUDA_RETURN_IF_ERROR(impl->host_out.Allocate(kOutHeader));
  GTOPK_CUDA_RETURN_IF_ERROR(impl->host_seed.Allocate(1));
  out->reset(new Sparsifier(std::move(impl)));
  return KernelStatus::Ok();
}

KernelStatus Sparsifier::Accumulate(
    const float* grad, const float* params, const float* velocity_in,
    float* velocity_out, const float* residual_in, float* residual_out,
    uint64_t n, const UpdateParams& up, cudaStream_t stream) {
  return impl_->Accumulate(grad, params, velocity_in, velocity_out, residual_in,
                           residual_out, n, up, stream);
}

KernelStatus Sparsifier::Select(float* u, uint64_t n, const SelectParams& p,
                                cudaStream_t stream) {
  return impl_->Select(u, n, p, stream);
}

KernelStatus Sparsifier::Wait(cudaStream_t stream, SelectedPairs* out) {
  return impl_->Wait(stream, out);
}

namespace internal {

SparsifierImpl::SparsifierImpl()
    : graphs([](cudaGraphExec_t exec) { cudaGraphExecDestroy(exec); }) {}

void SparsifierImpl::SetTuning(const SparsifierTuning& t) {
  tuning = t;
  tuning.one_block_max_n = std::min<uint64_t>(t.one_block_max_n, kTinyMaxN);
  tuning.gaussiank_key_limit =
      std::max(0, std::min(t.gaussiank_key_limit, kMaxGaussKeys));
  history.gauss_fallback_from_candidates = t.gaussiank_fallback_from_candidates;
}

KernelStatus SparsifierImpl::Accumulate(
    const float* grad, const float* params, const float* velocity_in,
    float* velocity_out, const float* residual_in, float* residual_out,
    uint64_t n, const UpdateParams& up, cudaStream_t stream) {
  DiscardStaleError();
  if (n == 0 || n > capacity) {
    return KernelStatus::Error(
        KernelStatusCode::kInvalidArgument,
        "Accumulate: n = " + std::to_string(n) +
            " must be in [1, capacity = " + std::to_string(capacity) + "]");
  }
  if (grad == nullptr || residual_in == nullptr || residual_out == nullptr ||
      (up.momentum_correction &&
       (velocity_in == nullptr || velocity_out == nullptr)) ||
      (params == nullptr && up.weight_decay != 0.0f)) {
    return KernelStatus::Error(KernelStatusCode::kInvalidArgument,
                               "Accumulate: a required device pointer is null");
  }
  if (!(up.lr > 0.0f) || !std::isfinite(up.lr) || !(up.momentum >= 0.0f) ||
      !(up.momentum < 1.0f) || !(up.weight_decay >= 0.0f) ||
      !std::isfinite(up.weight_decay)) {
    return KernelStatus::Error(KernelStatusCode::kInvalidArgument,
                               "Accumulate: need lr > 0, momentum in [0, 1), "
                               "weight_decay >= 0, all finite");
  }
  if (pending) {
    return KernelStatus::Error(KernelStatusCode::kFailedPrecondition,
                               "Accumulate: Wait for the pending Select first");
  }
  clear_update_prediction = false;
  GTOPK_CUDA_RETURN_IF_ERROR(Init(0, true, false, false, stream));
  HistArgs a{};
  a.grad = grad;
  a.params = params;
  a.velocity_in = velocity_in;
  a.velocity_out = velocity_out;
  a.residual_in = residual_in;
  a.residual_out = residual_out;
  a.n = n;
  a.lr = up.lr;
  a.momentum = up.momentum;
  a.weight_decay = up.weight_decay;
  a.momentum_correction = up.momentum_correction;
  a.vectorized = Aligned16(grad) && Aligned16(residual_in) &&
                 Aligned16(residual_out) &&
                 (params == nullptr || Aligned16(params)) &&
                 (!up.momentum_correction ||
                  (Aligned16(velocity_in) && Aligned16(velocity_out)));
  a.st = st;
  a.hist0 = hist0;
  a.partials = partials;
  SetHistLayout(n, &a);
  a.regions = regions.get();
  a.counts = counts_u.get();
  a.eq_counts = eq_counts_u.get();
  // (The variant that counts ties only where the last selection predicted
  // them for this n: SelectionHistory::ties_predicted_n.)
  LaunchHistogram(/*update=*/true, history.ties_predicted_n == n,
                  HistLayoutFor(n).blocks, stream, a);
  GTOPK_CUDA_LAUNCH_CHECK();
  hist_u = residual_out;
  hist_n = n;
  return KernelStatus::Ok();
}

KernelStatus SparsifierImpl::Select(float* u, uint64_t n, const SelectParams& p,
                                    cudaStream_t stream) {
  DiscardStaleError();
  if (pending) {
    return KernelStatus::Error(KernelStatusCode::kFailedPrecondition,
                               "Select: Wait for the pending Select first");
  }
  if (u == nullptr || n == 0 || n > capacity) {
    return KernelStatus::Error(KernelStatusCode::kInvalidArgument,
                               "Select: n = " + std::to_string(n) +
                                   " must be in [1, capacity = " +
                                   std::to_string(capacity) + "] (u non-null)");
  }
  if (p.k == 0 || p.k > n) {
    return KernelStatus::Error(KernelStatusCode::kInvalidArgument,
                               "Select: k = " + std::to_string(p.k) +
                                   " must be in [1, n = " + std::to_string(n) +
                                   "]");
  }
  if (!(p.dgc_sample_fraction >= 0.01 && p.dgc_sample_fraction <= 1.0) ||
      p.gaussiank_max_adjustments < 1 || p.gaussiank_max_adjustments > 16) {
    return KernelStatus::Error(
        KernelStatusCode::kInvalidArgument,
        "Select: dgc_sample_fraction must be in [0.01, 1] "
        "and gaussiank_max_adjustments in [1, 16]");
  }
  bool reuse = hist_u == u && hist_n == n;
  info = SelectInfo();
  pending_update_sampled = false;
  if (reuse && p.method == Method::kExact &&
      history.SampleAfterUpdate(
          n, n > tuning.one_block_max_n && PlanExactSample(n, p.k).runs != 0)) {
    // (SelectionHistory::update_many_pass_n) The update's histogram is not
    // used.
    reuse = false;
    pending_update_sampled = true;
    info.sampled_after_update = true;
  }
  clear_update_prediction = pending_update_sampled;
  // (The one-block path for a small u reads u whole, histogram or not.)
  info.used_update_histogram =
      reuse && p.method != Method::kDgc && n > tuning.one_block_max_n;
  pending_error = false;
  check_selected = false;
  GTOPK_CUDA_RETURN_IF_ERROR(EnsurePinned(MaxCount(p.method, p.k), stream));
  pending = true;  // from here on Wait must be called
  pending_u = u;
  pending_n = n;
  pending_params = p;
  continuation = Continuation::kNone;
  exact_enqueued = false;
  sampled_enqueued = false;
  from_u_enqueued = false;
  took_exact = false;
  gauss_candidate_exact = false;
  tiny_enqueued = false;
  sample_missed = false;
  // dgc's sample seed for this step: a replayed graph copies it from here.
  *host_seed.get() = Mix(p.seed, p.step);
  const KernelStatus status = use_graphs && stream != nullptr
                                  ? EnqueueWithGraph(u, n, p, reuse, stream)
                                  : Enqueue(u, n, p, reuse, stream);
  hist_u = nullptr;  // u changes (zeroing) or the histogram was reused
  if (!status.ok()) pending = false;
  return status;
}

}  // namespace internal
}  // namespace cuda
}  // namespace gtopk
