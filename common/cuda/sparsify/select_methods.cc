// exact and dgc on the device, and the one-block path for a small u
// (sparsifier_impl.h).
#include <algorithm>
#include <cmath>
#include <string>

#include "common/cuda/sparsify/host_util.h"
#include "common/cuda/sparsify/launchers.h"
#include "common/cuda/sparsify/sparsifier_impl.h"
#include "common/normal_quantile.h"

namespace gtopk {
namespace cuda {
namespace internal {

KernelStatus SparsifierImpl::SelectDgc(float* u, uint64_t n,
                                       const SelectParams& p, bool reuse,
                                       cudaStream_t stream) {
  const uint64_t k = p.k;
  const bool zero = p.zero_selected;
  const DgcSample ds = PlanDgcSample(n, k, p.dgc_sample_fraction);
  BeginOutput(k);
  if (ds.runs == 0) {
    info.fell_back = true;
    // Right after Accumulate nothing has written `regions` since: its
    // compaction may hold the candidates.
    GTOPK_CUDA_RETURN_IF_ERROR(
        ExactFromU(u, n, k, zero, reuse, stream, /*update_candidates=*/reuse));
    check_selected = true;
    return CopyOut(k, stream);
  }
  const uint64_t sample_size = ds.runs * 16;
  // More than 1/8 of the sample at or above the threshold B: ties at it
  // (the compaction keeps the keys > B and counts the ties).
  GTOPK_CUDA_RETURN_IF_ERROR(
      SampleThreshold(u, n, ds.runs, ds.sample_k,
                      std::max<uint64_t>(1, sample_size / 8), stream));
  // min_key is now the sample's sample_k-th largest key. No host round
  // trip whatever the count: at most k survive (the usual case): the
  // device accepts them and gathers them into the output. More than k (and
  // at most n/8): the compaction has also counted the survivors' digit 0
  // (into the trim histograms), the scan sets the state's trim and finds
  // the k-th survivor's digit 0, the gather copies the survivors to the
  // candidates and counts their digit 1, and the trim's gated kernels
  // finish the exact top-k among them (digit 2 and the final stable
  // compaction; they return at once when nothing is trimmed). All k
  // possible pairs are copied either way.
  CollectScan at_most_k;
  at_most_k.accept_lo = 1;
  at_most_k.accept_hi = k;
  at_most_k.exact_above = CompactCap(n);
  at_most_k.trim = 1;
  // dgc's survivors scatter around k (the sample's estimate).
  GTOPK_CUDA_RETURN_IF_ERROR(
      CompactAtSample(u, n, zero, at_most_k, 4 * k, stream));
  // As gaussiank's: the last selection took the exact top-k from u (ties at
  // the sampled threshold), so this one is enqueued too, gated on the
  // device's count (8 kernels that return at once when it is not needed).
  // More than n/8 survivors without it: Wait does it (ContinueDgc).
  if (history.dgc_expect_exact) {
    GatedScope falling_back(*this, &st->gk_exact, 1);
    GTOPK_CUDA_RETURN_IF_ERROR(ExactFromU(u, n, k, zero, false, stream));
  }
  exact_enqueued = history.dgc_expect_exact;
  continuation = Continuation::kDgc;
  return CopyOut(k, stream);
}

// The exact top-k from a sampled lower bound (see sparsify.h): one
// compaction pass over u instead of a histogram pass and a compaction.
KernelStatus SparsifierImpl::SelectExact(float* u, uint64_t n,
                                         const SelectParams& p, bool reuse,
                                         cudaStream_t stream) {
  const uint64_t k = p.k;
  const bool zero = p.zero_selected;
  BeginOutput(k);
  // Accumulate's histogram makes the first digit free: the plan over u.
  const ExactSample plan = reuse ? ExactSample() : PlanExactSample(n, k);
  if (plan.runs == 0) {
    // Right after Accumulate nothing has written `regions` since: its
    // compaction may hold the candidates.
    GTOPK_CUDA_RETURN_IF_ERROR(
        ExactFromU(u, n, k, zero, reuse, stream, /*update_candidates=*/reuse));
    check_selected = true;
    return CopyOut(k, stream);
  }
  GTOPK_CUDA_RETURN_IF_ERROR(SampledExact(u, n, k, zero, plan.runs, plan.rank,
                                          history.exact_expect_from_u, stream));
  continuation = Continuation::kExact;
  return CopyOut(k, stream);
}

KernelStatus SparsifierImpl::ContinueExact(cudaStream_t stream) {
  const uint64_t k = pending_params.k;
  BeginOutput(k);
  GTOPK_CUDA_RETURN_IF_ERROR(ExactFromU(
      pending_u, pending_n, k, pending_params.zero_selected, false, stream));
  sample_missed = true;
  info.fell_back = true;
  check_selected = true;
  return CopyOut(k, stream);
}

KernelStatus SparsifierImpl::ContinueDgc(const DeviceState& s,
                                         cudaStream_t stream) {
  float* u = pending_u;
  const uint64_t n = pending_n;
  const uint64_t k = pending_params.k;
  const bool zero = pending_params.zero_selected;
  // The survivors (with ties at the threshold: those above it and the ties).
  info.candidates = s.num_candidates + (s.ties_at_bound != 0 ? s.tie_count : 0);
  // The device accepts 1..k survivors and trims up to n/8; more are most
  // of u (ties at the sample's threshold): the exact top-k from u, whose
  // passes cost less than copying them all.
  if (s.num_candidates <= CompactCap(n) || s.num_candidates <= k) {
    return KernelStatus::Error(
        KernelStatusCode::kInternal,
        "dgc: " + std::to_string(s.num_candidates) +
            " survivors were neither accepted nor trimmed on the device (k = " +
            std::to_string(k) + ")");
  }
  BeginOutput(k);
  GTOPK_CUDA_RETURN_IF_ERROR(ExactFromU(u, n, k, zero, false, stream));
  took_exact = true;
  info.fell_back = true;
  check_selected = true;
  return CopyOut(k, stream);
}

KernelStatus SparsifierImpl::SelectTiny(float* u, uint64_t n,
                                        const SelectParams& p,
                                        cudaStream_t stream) {
  const uint64_t k = p.k;
  TinyArgs a{};
  a.method = static_cast<int>(p.method);
  a.k = k;
  a.zero = p.zero_selected ? 1 : 0;
  uint64_t slots = k;
  if (p.method == Method::kGaussianK) {
    a.lo = MinCount(Method::kGaussianK, k);
    a.hi = MaxCount(Method::kGaussianK, k);
    if (k == n || a.lo == a.hi) {
      a.method = static_cast<int>(Method::kExact);  // as SelectGaussianK
      info.fell_back = true;
    } else {
      slots = std::min<uint64_t>(a.hi, n);
      const double density = static_cast<double>(k) / static_cast<double>(n);
      a.z = NormalQuantile(1.0 - density / 2.0);
      a.max_adjustments = p.gaussiank_max_adjustments;
    }
  } else if (p.method == Method::kDgc) {
    const DgcSample ds = PlanDgcSample(n, k, p.dgc_sample_fraction);
    if (ds.runs == 0) {
      info.fell_back = true;  // as SelectDgc: the exact top-k
    } else {
      a.seed = host_seed.get();
      a.runs = ds.runs;
      a.sample_k = ds.sample_k;
    }
  }
  BeginOutput(slots);
  LaunchTinySelect(stream, u, n, st, InitFor(k, false, false, false), a,
                   out_idx(), out_val());
  GTOPK_CUDA_LAUNCH_CHECK();
  hist_u = nullptr;
  tiny_enqueued = true;
  return CopyOut(slots, stream);
}

}  // namespace internal
}  // namespace cuda
}  // namespace gtopk
