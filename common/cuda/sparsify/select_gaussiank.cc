// Gaussian-k on the device (sparsifier_impl.h): the threshold mean + z*std,
// the CPU rule's adjustments decided on the device where it can, and the
// host continuation where it cannot.
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

KernelStatus SparsifierImpl::SelectGaussianK(float* u, uint64_t n,
                                             const SelectParams& p, bool reuse,
                                             cudaStream_t stream) {
  const uint64_t k = p.k;
  const uint64_t lo = MinCount(Method::kGaussianK, k);
  const uint64_t hi = MaxCount(Method::kGaussianK, k);
  const bool zero = p.zero_selected;
  info.fell_back = true;
  if (k == n || lo == hi) {
    BeginOutput(k);
    // Right after Accumulate nothing has written `regions` since: its
    // compaction may hold the candidates.
    GTOPK_CUDA_RETURN_IF_ERROR(
        ExactFromU(u, n, k, zero, reuse, stream, /*update_candidates=*/reuse));
    check_selected = true;
    return CopyOut(k, stream);
  }
  // hi = floor(4k/3) can exceed n (density > 3/4): never more than n pairs.
  BeginOutput(std::min<uint64_t>(hi, n));
  const double density = static_cast<double>(k) / static_cast<double>(n);
  const double z = NormalQuantile(1.0 - density / 2.0);
  // After Accumulate's histogram the planner starts with Init's work.
  // The first pass (the fused update's, or Gaussian-k's own histogram
  // pass) kept the keys of a predicted bin and up when the last such
  // selection of this n predicted one: the first compaction may read those
  // candidates instead of u (GaussUpdateCollectKernel; the planner decides,
  // and predicts the next bin).
  InitArgs init{};
  const UpdateCandidates uc = UseUpdateCandidates(n);
  if (reuse) {
    init = InitFor(k, false, true, false);
  } else {
    GTOPK_CUDA_RETURN_IF_ERROR(Init(k, true, false, false, stream));
    GTOPK_CUDA_RETURN_IF_ERROR(
        Histogram(u, n, stream, Then{}, /*keep_candidates=*/true));
  }
  LaunchGaussPlan(stream, st, hist0, partials, n, z, lo, hi,
                  p.gaussiank_max_adjustments, hist1, GaussKeyLimit(), init, uc,
                  CompactCap(n));
  GTOPK_CUDA_LAUNCH_CHECK();
  // No host round trip: the compaction at the planned threshold counts the
  // keys the later adjustments may need, and its scan accepts the count
  // when it is in [lo, hi] (the usual case) or else replays the adjustments
  // on the device (GaussResolve). A corrected threshold costs one more
  // compaction pass (skipped otherwise, like everything gated on the
  // device's state). The survivors are then gathered into the output, and
  // all min(hi, n) possible pairs are copied. When the adjustments end
  // without a count in range, Wait finishes with the exact top-k
  // (ContinueGaussianK).
  CollectScan in_range;
  in_range.accept_lo = lo;
  in_range.accept_hi = hi;
  {
    CollectScan from_update = in_range;
    from_update.block_offsets = offsets_u.get();
    from_update.at_least = hist1;
    const int groups = update_layout.warps / kWarpsPerBlock;
    LaunchGaussUpdateCollect(std::min(groups, max_blocks), stream, u, st,
                             regions.get(), counts_u.get(), update_layout.chunk,
                             groups, gate, from_update);
    GTOPK_CUDA_LAUNCH_CHECK();
  }
  // Returns at once when the kernel above compacted.
  GTOPK_CUDA_RETURN_IF_ERROR(Collect(u, n, kCollectNoHist, false, 0, stream,
                                     in_range, GaussRole::kFirst));
  {
    GatedScope correcting(*this, &st->gk_mode, kGaussCorrect);
    GTOPK_CUDA_RETURN_IF_ERROR(
        Collect(u, n, kCollectNoHist, false, 0, stream, in_range));
  }
  GTOPK_CUDA_RETURN_IF_ERROR(
      Gather(u, true, zero, false, stream, kGatherIfAccepted));
  // The last gaussiank selection fell back to the exact top-k: residuals
  // change little from step to step, so this one likely does too. Enqueue
  // the exact top-k gated on the rule's end (state's gk_exact), and Wait
  // has nothing left to do when it ran: no host round trip. When the rule
  // lands in range instead, its 8 kernels return at once (8 launches, one
  // step: the prediction follows the outcome). The exact top-k runs from u
  // here, where Wait's continuation may take it from the first compaction's
  // survivors: the same pairs, SelectInfo's candidates and plan differ.
  // When the last fallback of this n predicted the first pass's
  // candidates (GaussFallbackFromUpdate: the fused update's, or this
  // selection's own histogram pass's), that exact top-k is the exact plan
  // with them, as exact's own after Accumulate: no pass over u besides the
  // first while the prediction holds (the narrow band, every value equal,
  // ties and outliers, whose rule ends out of range at every step, cost
  // what normal data costs). Otherwise, on a large u, it starts from a
  // sample (one pass over u, whatever digits the keys share: the narrow
  // band and the outliers that end the rule cost one more pass, not up to
  // three), with the plan over u gated behind it when the last one needed
  // that. The candidates are not taken when the rule's own compaction
  // overwrote them (DeviceState::update_clobbered).
  if (history.expect_exact) {
    GatedScope falling_back(*this, &st->gk_exact, 1);
    const ExactSample plan = PlanExactSample(n, k);
    if (plan.runs != 0 && !history.GaussFallbackFromUpdate(n)) {
      GTOPK_CUDA_RETURN_IF_ERROR(
          SampledExact(u, n, k, zero, plan.runs, plan.rank,
                       history.gauss_expect_from_u, stream));
    } else {
      GTOPK_CUDA_RETURN_IF_ERROR(ExactFromU(u, n, k, zero, true, stream,
                                            /*update_candidates=*/true));
    }
  }
  exact_enqueued = history.expect_exact;
  continuation = Continuation::kGaussianK;
  info.fell_back = false;
  return CopyOut(std::min<uint64_t>(hi, n), stream);
}

KernelStatus SparsifierImpl::ContinueGaussianK(const DeviceState& state,
                                               cudaStream_t stream) {
  float* u = pending_u;
  const uint64_t n = pending_n;
  const SelectParams& p = pending_params;
  const uint64_t k = p.k;
  const uint64_t lo = MinCount(Method::kGaussianK, k);
  const uint64_t hi = MaxCount(Method::kGaussianK, k);
  const bool zero = p.zero_selected;
  DeviceState s = state;
  // The device's replay already ended out of range: straight to the exact
  // top-k below.
  const bool replayed = s.gk_mode == kGaussExact;
  bool fallback = s.fallback != 0;
  int adjustments = replayed ? s.gk_adjustments : s.adjustments;
  double t = s.threshold;
  uint32_t key = s.min_key;       // the threshold being tried
  uint32_t cand_key = s.min_key;  // the candidates hold key >= cand_key
  uint64_t cand_count = s.num_candidates;
  uint64_t count = cand_count;  // survivors of `key`
  bool gathered = false;        // candidates in cand_idx/cand_val
  while (!fallback && !replayed) {
    if (count >= lo && count <= hi) {
      BeginOutput(count);
      if (key == cand_key) {
        GTOPK_CUDA_RETURN_IF_ERROR(Gather(u, true, zero, false, stream));
        check_selected = false;
      } else {
        GTOPK_CUDA_RETURN_IF_ERROR(Final(FinalRule{1, key}, u, n, zero,
                                         CandidateBlocks(cand_count), stream));
        check_selected = true;
      }
      info.fell_back = false;
      info.adjustments = adjustments;
      info.candidates = cand_count;
      return CopyOut(count, stream);
    }
    if (adjustments == p.gaussiank_max_adjustments) break;
    t = count < lo ? t * 0.5 : t * 1.5;
    if (t <= 0.0) break;
    ++adjustments;
    key = MinKeyAbove(t);
    if (key >= cand_key) {
      // Raising the threshold: count among the candidates.
      if (!gathered) {
        GTOPK_CUDA_RETURN_IF_ERROR(Gather(u, false, false, false, stream));
        gathered = true;
      }
      GTOPK_CUDA_CALL_OR_RETURN(
          cudaMemsetAsync(&st->count_at_least, 0, sizeof(ull), stream));
      LaunchCountAtLeast(CandidateBlocks(cand_count), stream, cand_val.get(),
                         st, key);
      GTOPK_CUDA_LAUNCH_CHECK();
      GTOPK_CUDA_RETURN_IF_ERROR(ReadState(stream, &s));
      count = s.count_at_least;
    } else {
      // Lowering it: one more compaction pass over u.
      GTOPK_CUDA_RETURN_IF_ERROR(
          Collect(u, n, kCollectNoHist, true, key, stream));
      GTOPK_CUDA_RETURN_IF_ERROR(ReadState(stream, &s));
      if (s.error != 0) {
        pending_error = true;
        BeginOutput(0);
        return CopyOut(0, stream);
      }
      cand_key = key;
      cand_count = s.num_candidates;
      count = cand_count;
      gathered = false;
    }
  }
  // Outside the range after the adjustments: the exact top-k, from the
  // candidates when they hold at least k entries and are few enough to be
  // worth it (CompactCap), else from u.
  info.adjustments = adjustments;
  info.fell_back = true;
  check_selected = true;
  BeginOutput(k);
  if (!fallback && cand_count >= k && cand_count <= CompactCap(n)) {
    if (!gathered) {
      GTOPK_CUDA_RETURN_IF_ERROR(Gather(u, false, false, false, stream));
    }
    GTOPK_CUDA_RETURN_IF_ERROR(CandidateExact(u, n, k, zero, stream));
    gauss_candidate_exact = true;
  } else {
    // hist0 still describes u (nothing was written to u). The plan takes
    // the first pass's candidates (the fused update's, or Gaussian-k's own
    // histogram pass's) when they hold the top k and no compaction
    // overwrote them, and predicts the next pass's, which the next
    // fallback's gated plan then takes.
    GTOPK_CUDA_RETURN_IF_ERROR(ExactFromU(u, n, k, zero, true, stream,
                                          /*update_candidates=*/true));
  }
  return CopyOut(k, stream);
}

}  // namespace internal
}  // namespace cuda
}  // namespace gtopk
