// WorkerClient::Step on CUDA device memory (built with GTOPK_HAVE_CUDA).
// Kept apart from client.cc so the host path stays free of CUDA; the
// exchange (pushes, pulls, watchdog) is the host Step's Exchange.
//
// Per step, on `stream`:
//   Accumulate: u = residual + lr*(m*v + g + wd*p) into the other buffer of
//     a residual/velocity pair (the old one is kept until the step commits,
//     so a non-finite gradient leaves the state unchanged), with the first
//     radix histogram of |u|;
//   Select on u (reusing that histogram), selected u_i set to +0.0 on the
//     device, pairs to the host; codec rounding and MarkSent's u_i - recv_i
//     on the host, scattered back when lossy;
//   the exchange as on the host; then put-back (sent \ global gets
//     PutBackSum(u_i - recv_i, recv_i), computed on the host from values it
//     already has), momentum factor masking and the parameter update as
//     sparse scatters (or the dense global-momentum kernel).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/cuda/cuda_selector.h"
#include "common/cuda/sparsify.h"
#include "common/status_macros.h"
#include "common/topk.h"
#include "worker/client.h"

namespace gtopk {
namespace worker {

struct WorkerClient::DeviceState {
  std::unique_ptr<cuda::CudaSelector> selector;
  cuda::DeviceBuffer<float> residual[2];
  cuda::DeviceBuffer<float> velocity[2];
  int current = 0;  // residual[current], velocity[current] hold the state
  cuda::DeviceBuffer<float> global_velocity;
  cuda::SparseUpdater updater;
};

namespace {

absl::Status Cuda(const cuda::Status& s) { return cuda::ToAbslStatus(s); }

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

}  // namespace

absl::Status WorkerClient::CopyDeviceStateToHost() {
  if (device_ == nullptr) return absl::OkStatus();
  DeviceState& d = *device_;
  const uint64_t n = cluster_.n();
  GTOPK_RETURN_IF_ERROR(GTOPK_CUDA_ABSL(cudaMemcpy(
      feedback_.mutable_residual().data(), d.residual[d.current].get(),
      n * sizeof(float), cudaMemcpyDeviceToHost)));
  if (rule_.options().momentum_mode == MomentumMode::kDgcCorrection) {
    GTOPK_RETURN_IF_ERROR(GTOPK_CUDA_ABSL(
        cudaMemcpy(velocity_.data(), d.velocity[d.current].get(),
                   n * sizeof(float), cudaMemcpyDeviceToHost)));
  }
  return absl::OkStatus();
}

absl::StatusOr<StepStats> WorkerClient::Step(const float* gradient,
                                             float* params, uint64_t n,
                                             cudaStream_t stream) {
  if (n != cluster_.n() || gradient == nullptr || params == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "Step (device): n = ", n, " (cluster n = ", cluster_.n(),
        "), gradient and params must be non-null device pointers"));
  }
  if (mode_ == Mode::kDense) {
    // Dense mode sends u itself: it has to reach the host.
    std::vector<float> host_grad(n), host_params(n);
    GTOPK_RETURN_IF_ERROR(GTOPK_CUDA_ABSL(
        cudaMemcpyAsync(host_grad.data(), gradient, n * sizeof(float),
                        cudaMemcpyDeviceToHost, stream)));
    GTOPK_RETURN_IF_ERROR(GTOPK_CUDA_ABSL(
        cudaMemcpyAsync(host_params.data(), params, n * sizeof(float),
                        cudaMemcpyDeviceToHost, stream)));
    GTOPK_RETURN_IF_ERROR(GTOPK_CUDA_ABSL(cudaStreamSynchronize(stream)));
    absl::StatusOr<StepStats> stats =
        Step(host_grad, absl::MakeSpan(host_params));
    if (!stats.ok()) return stats;
    GTOPK_RETURN_IF_ERROR(GTOPK_CUDA_ABSL(
        cudaMemcpyAsync(params, host_params.data(), n * sizeof(float),
                        cudaMemcpyHostToDevice, stream)));
    GTOPK_RETURN_IF_ERROR(GTOPK_CUDA_ABSL(cudaStreamSynchronize(stream)));
    return stats;
  }
  const bool dgc_momentum =
      rule_.options().momentum_mode == MomentumMode::kDgcCorrection;
  const bool global_momentum =
      rule_.options().momentum_mode == MomentumMode::kGlobal;
  if (device_ == nullptr) {
    // First device step: move the host state to the device.
    auto d = std::make_shared<DeviceState>();
    SelectorOptions so;
    so.seed = SelectorSeedForRank(cluster_.selector_seed(), rank_);
    absl::StatusOr<std::unique_ptr<cuda::CudaSelector>> sel =
        cuda::CudaSelector::Create(selector_->name(), so, n);
    if (!sel.ok()) {
      return absl::FailedPreconditionError(
          absl::StrCat("Step (device): selector \"", selector_->name(),
                       "\" has no GPU version or the GPU is unusable: ",
                       sel.status().message()));
    }
    d->selector = *std::move(sel);
    for (int b = 0; b < 2; ++b) {
      GTOPK_RETURN_IF_ERROR(Cuda(d->residual[b].Allocate(n)));
      if (dgc_momentum) GTOPK_RETURN_IF_ERROR(Cuda(d->velocity[b].Allocate(n)));
    }
    GTOPK_RETURN_IF_ERROR(GTOPK_CUDA_ABSL(
        cudaMemcpyAsync(d->residual[0].get(), feedback_.residual().data(),
                        n * sizeof(float), cudaMemcpyHostToDevice, stream)));
    if (dgc_momentum) {
      GTOPK_RETURN_IF_ERROR(GTOPK_CUDA_ABSL(
          cudaMemcpyAsync(d->velocity[0].get(), velocity_.data(),
                          n * sizeof(float), cudaMemcpyHostToDevice, stream)));
    }
    if (global_momentum) {
      GTOPK_RETURN_IF_ERROR(Cuda(d->global_velocity.Allocate(n)));
      GTOPK_RETURN_IF_ERROR(GTOPK_CUDA_ABSL(
          cudaMemcpyAsync(d->global_velocity.get(), global_velocity_.data(),
                          n * sizeof(float), cudaMemcpyHostToDevice, stream)));
    }
    GTOPK_RETURN_IF_ERROR(GTOPK_CUDA_ABSL(cudaStreamSynchronize(stream)));
    device_ = std::move(d);
  }
  DeviceState& d = *device_;
  const size_t S = shards_.size();
  const int P = static_cast<int>(cluster_.num_workers());
  const int64_t step = next_step_;
  GTOPK_ASSIGN_OR_RETURN(StepStats stats, BeginStep(n));

  // u into the other buffer pair; committed once the selection succeeded.
  absl::Time t = absl::Now();
  const int cur = d.current, next = 1 - d.current;
  cuda::UpdateParams up;
  up.lr = rule_.LrAt(step);
  up.momentum = rule_.options().momentum;
  up.weight_decay = rule_.options().weight_decay;
  up.momentum_correction = dgc_momentum;
  GTOPK_RETURN_IF_ERROR(Cuda(d.selector->sparsifier()->Accumulate(
      gradient, params, d.velocity[cur].get(), d.velocity[next].get(),
      d.residual[cur].get(), d.residual[next].get(), n, up, stream)));
  stats.accumulate = absl::Now() - t;

  t = absl::Now();
  float* u = d.residual[next].get();
  SparseVector sent;
  absl::Status st =
      d.selector->SelectDevice(u, n, stats.k, static_cast<uint64_t>(step),
                               stream, /*zero_selected=*/true, &sent);
  if (!st.ok()) {
    // Nothing committed: the state is as before this call.
    if (st.code() == absl::StatusCode::kInvalidArgument) {
      return absl::InvalidArgumentError(absl::StrCat(
          "Step (device): the gradient (or residual + lr * gradient) is not "
          "finite: ",
          st.message()));
    }
    return st;
  }
  SparseVector received = sent;
  QuantizeValues(codec_.value, absl::MakeSpan(received.values));
  // MarkSent: residual_i = u_i - recv_i; the device holds +0.0 there, which
  // is that value for a lossless codec.
  std::vector<float> marked(sent.size());
  bool lossy = false;
  for (size_t j = 0; j < sent.size(); ++j) {
    marked[j] = sent.values[j] - received.values[j];
    if (!std::isfinite(marked[j])) {
      // Restore u and commit it (the host Step's contract: u stays).
      GTOPK_RETURN_IF_ERROR(Cuda(d.updater.Set(
          u, n, sent.indices.data(), sent.values.data(), sent.size(), stream)));
      GTOPK_RETURN_IF_ERROR(GTOPK_CUDA_ABSL(cudaStreamSynchronize(stream)));
      d.current = next;
      return absl::InvalidArgumentError(absl::StrCat(
          "MarkSent: u - received overflows at index ", sent.indices[j]));
    }
    lossy |= cpu::MagnitudeKey(marked[j]) != 0;
  }
  if (lossy) {
    GTOPK_RETURN_IF_ERROR(Cuda(d.updater.Set(
        u, n, sent.indices.data(), marked.data(), sent.size(), stream)));
  }
  d.current = next;  // residual = u - recv, velocity updated: committed
  stats.select = absl::Now() - t;
  stats.sent_pairs = sent.size();

  // From here a failure puts every sent value back (residual holds u).
  auto fail = [&](absl::Status status) -> absl::Status {
    std::vector<float> back(sent.size());
    for (size_t j = 0; j < sent.size(); ++j) {
      back[j] = PutBackSum(marked[j], received.values[j]);
    }
    cuda::Status restored = d.updater.Set(u, n, sent.indices.data(),
                                          back.data(), sent.size(), stream);
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
  };

  t = absl::Now();
  std::vector<v1::Push> pushes(S);
  StampPushes(&pushes);  // member token and cluster fingerprint
  for (size_t s = 0; s < S; ++s) {
    const v1::ShardSpec& shard = cluster_.shards(static_cast<int>(s));
    pushes[s].set_step(step);
    pushes[s].set_worker(rank_);
    pushes[s].set_epoch(epoch_);
    pushes[s].set_shard_id(shard.shard_id());
    const auto lo = std::lower_bound(sent.indices.begin(), sent.indices.end(),
                                     shard.begin());
    const auto hi = std::lower_bound(lo, sent.indices.end(), shard.end());
    SparseVector slice;
    slice.indices.assign(lo, hi);
    slice.values.assign(sent.values.begin() + (lo - sent.indices.begin()),
                        sent.values.begin() + (hi - sent.indices.begin()));
    st = EncodeSparse(slice, n, codec_, pushes[s].mutable_sparse());
    if (!st.ok())
      return fail(absl::Status(st.code(),
                               absl::StrCat(ShardName(s), ": ", st.message())));
    stats.bytes_sent[s] = pushes[s].ByteSizeLong();
  }
  stats.encode = absl::Now() - t;

  t = absl::Now();
  std::vector<v1::Pull> pulls;
  st = Exchange(step, pushes, &pulls);
  if (!st.ok()) return fail(st);
  SparseVector global;
  for (size_t s = 0; s < S; ++s) {
    const v1::ShardSpec& shard = cluster_.shards(static_cast<int>(s));
    const v1::Pull& pull = pulls[s];
    stats.bytes_received[s] = pull.ByteSizeLong();
    stats.server_merge =
        std::max(stats.server_merge,
                 absl::Microseconds(static_cast<int64_t>(pull.merge_us())));
    stats.server_select =
        std::max(stats.server_select,
                 absl::Microseconds(static_cast<int64_t>(pull.select_us())));
    absl::Status bad;
    SparseVector part;
    if (pull.step() != step || pull.shard_id() != shard.shard_id()) {
      bad = absl::InternalError(absl::StrCat("pull is for step ", pull.step(),
                                             " shard ", pull.shard_id(),
                                             ", expected step ", step));
    } else if (absl::Status dec = DecodeSparse(pull.sparse(), n, &part);
               !dec.ok()) {
      bad = absl::InternalError(
          absl::StrCat("undecodable pull: ", dec.message()));
    } else if (!part.empty() && (part.indices.front() < shard.begin() ||
                                 part.indices.back() >= shard.end())) {
      bad = absl::InternalError(absl::StrCat(
          "pull has indices outside [", shard.begin(), ", ", shard.end(), ")"));
    }
    if (!bad.ok()) {
      CloseStreams();
      return fail(absl::Status(
          bad.code(), absl::StrCat(ShardName(s), ": ", bad.message())));
    }
    global.indices.insert(global.indices.end(), part.indices.begin(),
                          part.indices.end());
    global.values.insert(global.values.end(), part.values.begin(),
                         part.values.end());
    stats.received_pairs += part.size();
  }
  stats.push_wait = absl::Now() - t;
  stats.push = std::min(last_push_time_, stats.push_wait);
  stats.wait = stats.push_wait - stats.push;

  // Apply: put-back, momentum masking, parameter update (one merge walk of
  // the sorted index lists gives sent \ global and sent ∩ global).
  t = absl::Now();
  std::vector<uint32_t> back_idx, mask_idx;
  std::vector<float> back_val;
  size_t g = 0;
  for (size_t j = 0; j < sent.size(); ++j) {
    const uint32_t i = sent.indices[j];
    while (g < global.size() && global.indices[g] < i) ++g;
    if (g < global.size() && global.indices[g] == i) {
      mask_idx.push_back(i);
    } else {
      back_idx.push_back(i);
      back_val.push_back(PutBackSum(marked[j], received.values[j]));
    }
  }
  if (mode_ == Mode::kGtopk) {
    GTOPK_RETURN_IF_ERROR(Cuda(d.updater.Set(
        u, n, back_idx.data(), back_val.data(), back_idx.size(), stream)));
  }
  if (dgc_momentum && rule_.options().momentum_factor_masking) {
    const std::vector<float> zeros(mask_idx.size(), 0.0f);
    GTOPK_RETURN_IF_ERROR(
        Cuda(d.updater.Set(d.velocity[d.current].get(), n, mask_idx.data(),
                           zeros.data(), mask_idx.size(), stream)));
  }
  const float p = static_cast<float>(P);
  std::vector<float> update(global.size());
  for (size_t j = 0; j < global.size(); ++j) update[j] = global.values[j] / p;
  if (global_momentum) {
    GTOPK_RETURN_IF_ERROR(Cuda(d.updater.GlobalMomentum(
        params, d.global_velocity.get(), n, rule_.options().momentum,
        global.indices.data(), update.data(), global.size(), stream)));
  } else {
    GTOPK_RETURN_IF_ERROR(
        Cuda(d.updater.Subtract(params, n, global.indices.data(), update.data(),
                                global.size(), stream)));
  }
  GTOPK_RETURN_IF_ERROR(GTOPK_CUDA_ABSL(cudaStreamSynchronize(stream)));
  stats.apply = absl::Now() - t;
  ++next_step_;
  return stats;
}

}  // namespace worker
}  // namespace gtopk
