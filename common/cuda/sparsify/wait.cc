// Sparsifier::Wait as named steps (sparsifier_impl.h): read the state the
// selection left, take the device's outcome or continue on the host, check
// for errors, report SelectInfo and record what the next selection may
// predict (SelectionHistory).
#include <algorithm>
#include <string>

#include "common/cuda/sparsify/host_util.h"
#include "common/cuda/sparsify/launchers.h"
#include "common/cuda/sparsify/sparsifier_impl.h"

namespace gtopk {
namespace cuda {
namespace internal {

KernelStatus SparsifierImpl::Wait(cudaStream_t stream, SelectedPairs* out) {
  DiscardStaleError();
  if (!pending) {
    return KernelStatus::Error(KernelStatusCode::kFailedPrecondition,
                               "Wait: no pending Select");
  }
  pending = false;
  GTOPK_CUDA_CALL_OR_RETURN(cudaStreamSynchronize(stream));
  DeviceState s = *host_state();
  const Continuation pending_continuation = continuation;
  continuation = Continuation::kNone;
  // dgc with ties at its threshold B, finished on the device: its
  // survivors are the keys > B (kept) and the ties (counted), and by its
  // rule more than k and more than n/8 of them mean the exact top-k of u,
  // which is what the device selected then (the plan over u's state has
  // these fields reset; its branch below reports them).
  const bool dgc_ties = pending_continuation == Continuation::kDgc &&
                        s.error == 0 && s.ties_at_bound != 0;
  const uint64_t dgc_survivors = s.num_candidates + s.tie_count;
  bool ran_sampled = false;  // an exact top-k from a sample ran
  if (tiny_enqueued && s.error == 0) {
    GTOPK_CUDA_RETURN_IF_ERROR(FinishTiny(s));
  }
  if (pending_continuation != Continuation::kNone && s.error == 0) {
    GTOPK_CUDA_RETURN_IF_ERROR(
        FinishContinuation(pending_continuation, &s, &ran_sampled, stream));
  }
  if (dgc_ties) {
    info.candidates = dgc_survivors;
    info.fell_back = dgc_survivors > pending_params.k &&
                     dgc_survivors > CompactCap(pending_n);
  }
  GTOPK_CUDA_RETURN_IF_ERROR(CheckErrors(s, stream));
  FinishInfo(s);
  SelectionOutcome o;
  o.continuation = pending_continuation;
  o.n = pending_n;
  o.exact = pending_params.method == Method::kExact;
  o.fell_back = info.fell_back;
  o.ran_sampled = ran_sampled;
  o.sample_missed = sample_missed;
  o.candidate_exact = gauss_candidate_exact;
  o.took_exact = took_exact;
  o.used_update_histogram = info.used_update_histogram;
  o.one_block = info.one_block;
  o.candidates_from_update = info.candidates_from_update;
  o.exact_digit_passes = info.exact_digit_passes;
  o.update_sampled = pending_update_sampled;
  history.Record(o, *host_state());  // the state after any continuation
  out->indices = reinterpret_cast<const uint32_t*>(host_out.get() + kOutHeader);
  out->values = reinterpret_cast<const float*>(host_out.get() + kOutHeader +
                                               out_stride * sizeof(uint32_t));
  out->count = pending_count;
  out->info = info;
  return KernelStatus::Ok();
}

KernelStatus SparsifierImpl::FinishTiny(const DeviceState& s) {
  // One kernel did it all; the rule's outcome is in the state.
  const Method method = pending_params.method;
  pending_count = s.num_selected;
  check_selected = false;
  info.fast_path = true;
  info.one_block = true;
  if (method == Method::kGaussianK && !info.fell_back) {
    info.fell_back = s.gk_exact != 0;
    info.adjustments = s.gk_exact != 0 ? s.gk_exact_adjustments : s.adjustments;
    if (s.gk_exact == 0) info.candidates = s.num_candidates;
  } else if (method == Method::kDgc && !info.fell_back) {
    info.fell_back = s.gk_exact != 0;
    info.trimmed_on_device = s.trim != 0;
    info.candidates = s.num_candidates;  // the survivors
  }
  const uint64_t lo = MinCount(method, pending_params.k);
  const uint64_t hi =
      std::min<uint64_t>(MaxCount(method, pending_params.k), pending_n);
  const bool exact_count =
      method == Method::kExact || info.fell_back || info.trimmed_on_device;
  if (exact_count ? s.num_selected != pending_params.k
                  : s.num_selected < std::min(lo, hi) || s.num_selected > hi) {
    return KernelStatus::Error(
        KernelStatusCode::kInternal,
        "one-block selection produced " + std::to_string(s.num_selected) +
            " pairs (k = " + std::to_string(pending_params.k) + ")");
  }
  return KernelStatus::Ok();
}

KernelStatus SparsifierImpl::FinishContinuation(
    Continuation pending_continuation, DeviceState* s, bool* ran_sampled,
    cudaStream_t stream) {
  const bool gauss = pending_continuation == Continuation::kGaussianK;
  const bool corrected = gauss && s->gk_mode == kGaussCorrect;
  // An exact top-k from a sample ran: exact's own, or gaussiank's gated
  // fallback after its rule ended out of range (gk_exact).
  const bool sampled = pending_continuation == Continuation::kExact ||
                       (gauss && sampled_enqueued && s->gk_exact != 0);
  if (sampled) {
    *ran_sampled = true;
    return FinishSampled(gauss, s, stream);
  }
  if (s->accepted) {
    // The fast path's gather is the selection.
    pending_count = s->num_candidates;
    info.candidates = s->num_candidates;
    info.fast_path = true;
    info.corrected_on_device = corrected;
    if (gauss) {
      info.adjustments = corrected ? s->gk_adjustments : s->adjustments;
    }
  } else if (exact_enqueued && s->gk_exact != 0) {
    // The gated exact top-k ran on the device: gaussiank's rule ended out
    // of range (on a small u), or more than n/8 survived dgc's sampled
    // threshold.
    pending_count = pending_params.k;
    check_selected = true;
    took_exact = true;
    info.fast_path = true;
    info.fell_back = true;
    if (gauss) {
      info.adjustments = s->gk_exact_adjustments;
    } else {
      info.candidates = s->gk_exact_candidates;  // the survivors
    }
  } else if (pending_continuation == Continuation::kDgc &&
             (s->trim != 0 || s->tie_write != 0)) {
    // More than k survived dgc's sampled threshold: the device took the
    // exact top-k among them; or, with ties at the threshold B, it wrote
    // the keys > B and every tie (at most k survivors) or the first ties
    // up to k.
    pending_count = s->trim != 0 ? pending_params.k : s->num_selected;
    check_selected = true;
    info.fast_path = true;
    info.trimmed_on_device = s->trim != 0;
  } else if (corrected) {
    // GaussResolve found the count in range from exact counts; the
    // compaction at that key disagreeing is a broken invariant.
    return KernelStatus::Error(
        KernelStatusCode::kInternal,
        "gaussiank device correction kept " +
            std::to_string(s->num_candidates) + " entries, outside [" +
            std::to_string(MinCount(Method::kGaussianK, pending_params.k)) +
            ", " +
            std::to_string(MaxCount(Method::kGaussianK, pending_params.k)) +
            "]");
  } else {
    GTOPK_CUDA_RETURN_IF_ERROR(gauss ? ContinueGaussianK(*s, stream)
                                     : ContinueDgc(*s, stream));
    GTOPK_CUDA_CALL_OR_RETURN(cudaStreamSynchronize(stream));
    *s = *host_state();
  }
  return KernelStatus::Ok();
}

KernelStatus SparsifierImpl::FinishSampled(bool gauss, DeviceState* s,
                                           cudaStream_t stream) {
  pending_count = pending_params.k;
  if (gauss) {
    info.fell_back = true;
    info.adjustments = s->gk_exact_adjustments;
  }
  if (s->accepted || s->trim != 0 || s->tie_write != 0) {
    // Exactly k survived its bound (the gather's output), or more
    // (the device trimmed them to their exact top-k), or fewer above a
    // tied bound and the ties made up the rest (written from u).
    info.fast_path = true;
    info.exact_sampled = true;
    info.trimmed_on_device = s->trim != 0;
    info.candidates = s->num_candidates;
    check_selected = s->trim != 0 || s->tie_write != 0;
  } else if (s->exact_from_u != 0 && from_u_enqueued) {
    // The bound failed; the plan over u ran, gated on the device.
    info.fast_path = true;
    info.fell_back = true;
    check_selected = true;
    sample_missed = true;
  } else {
    GTOPK_CUDA_RETURN_IF_ERROR(ContinueExact(stream));
    GTOPK_CUDA_CALL_OR_RETURN(cudaStreamSynchronize(stream));
    *s = *host_state();
  }
  return KernelStatus::Ok();
}

KernelStatus SparsifierImpl::CheckErrors(const DeviceState& s,
                                         cudaStream_t stream) {
  if ((s.error & kErrorNonFinite) != 0) return NonFiniteError(stream);
  if (s.error != 0 || pending_error) {
    return KernelStatus::Error(
        KernelStatusCode::kInternal,
        "selection failed an internal check (error bits " +
            std::to_string(s.error) + ")");
  }
  if (check_selected && s.num_selected != pending_count) {
    return KernelStatus::Error(
        KernelStatusCode::kInternal,
        "selection produced " + std::to_string(s.num_selected) +
            " pairs, expected " + std::to_string(pending_count));
  }
  return KernelStatus::Ok();
}

KernelStatus SparsifierImpl::NonFiniteError(cudaStream_t stream) {
  // Find the first position for the message (rare path, one more pass).
  GTOPK_CUDA_CALL_OR_RETURN(
      cudaMemsetAsync(&st->first_non_finite, 0xff, sizeof(ull), stream));
  LaunchFirstNonFinite(HistBlocks(pending_n), stream, pending_u, pending_n, st);
  GTOPK_CUDA_LAUNCH_CHECK();
  ull pos = 0;
  GTOPK_CUDA_CALL_OR_RETURN(cudaMemcpyAsync(&pos, &st->first_non_finite,
                                            sizeof(ull), cudaMemcpyDeviceToHost,
                                            stream));
  GTOPK_CUDA_CALL_OR_RETURN(cudaStreamSynchronize(stream));
  float value = 0.0f;
  if (pos < pending_n) {
    GTOPK_CUDA_CALL_OR_RETURN(cudaMemcpy(&value, pending_u + pos, sizeof(float),
                                         cudaMemcpyDeviceToHost));
  }
  return KernelStatus::Error(KernelStatusCode::kInvalidArgument,
                             "selector input has a non-finite value (" +
                                 FloatText(value) + ") at position " +
                                 std::to_string(pos));
}

void SparsifierImpl::FinishInfo(const DeviceState& s) {
  info.count = pending_count;
  if (info.candidates == 0) info.candidates = s.num_candidates;
  info.exact_digit_passes = s.u_passes;
  info.exact_final_from_u = s.from_u != 0;
  info.candidates_from_update = s.from_update != 0 || s.gauss_used_update != 0;
}

}  // namespace internal
}  // namespace cuda
}  // namespace gtopk
