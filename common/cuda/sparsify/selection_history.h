// What one selection tells the selector about the next (residuals change
// little from step to step): which gated fallbacks to enqueue, whether an
// exact selection after Accumulate starts from a sample, where the next
// pass counts ties. Written by Wait from the finished selection's outcome,
// read by Select. Plain C++ (no CUDA header): testable without nvcc or the
// emulator.
#ifndef GTOPK_COMMON_CUDA_SPARSIFY_SELECTION_HISTORY_H_
#define GTOPK_COMMON_CUDA_SPARSIFY_SELECTION_HISTORY_H_

#include <cstdint>

#include "common/cuda/sparsify/state.h"

namespace gtopk {
namespace cuda {
namespace internal {

// gaussiank/dgc enqueue the usual case only (no host round trip); when
// the device did not accept the compaction's count, Wait continues there
// (exact: after a sample that missed).
enum class Continuation { kNone, kGaussianK, kDgc, kExact };

// The finished selection, as Wait saw it.
struct SelectionOutcome {
  Continuation continuation = Continuation::kNone;
  uint64_t n = 0;
  bool exact = false;          // method exact
  bool fell_back = false;      // SelectInfo::fell_back
  bool ran_sampled = false;    // an exact top-k from a sample ran
  bool sample_missed = false;  // ... and its plan over u followed
  // gaussiank's host continuation took the exact top-k from its
  // compaction's candidates (CandidateExact: it predicts nothing).
  bool candidate_exact = false;
  bool took_exact = false;  // dgc: the exact top-k of u
  bool used_update_histogram = false;
  bool one_block = false;
  bool candidates_from_update = false;
  int exact_digit_passes = 0;
  bool update_sampled = false;  // exact after Accumulate from a sample
};

struct SelectionHistory {
  // gaussiank: the last selection fell back to the exact top-k, so the next
  // enqueues it too, gated on the device's verdict (SelectGaussianK).
  bool expect_exact = false;
  // dgc: the last selection took the exact top-k from u (more than n/8
  // survived its sampled threshold), so the next enqueues it too, gated.
  bool dgc_expect_exact = false;
  // exact (gaussiank's fallback): the last exact top-k that started from a
  // sample took the plan over u (the bound kept fewer than k or more than
  // n/8 keys), so the next enqueues that too, gated.
  bool exact_expect_from_u = false;
  bool gauss_expect_from_u = false;
  // gaussiank: the last selection of this n (0: none) fell back to the
  // exact plan with the first pass's candidates (the fused update's, or
  // Gaussian-k's own histogram pass's), which predicted the next pass's
  // (state's update_pred_*), or fell back to an exact top-k from a
  // sample; so the next gated fallback of this n runs that plan (no pass
  // over u besides the first while the prediction holds) instead of
  // starting from a sample (GaussFallbackFromUpdate).
  uint64_t gauss_exact_predicted_n = 0;
  // SparsifierTuning::gaussiank_fallback_from_candidates.
  bool gauss_fallback_from_candidates = true;
  // exact after Accumulate: the last such plan over u of this n (0: none)
  // needed more than one pass over u (its digit-0 bin held more than n/8
  // keys, so the update's histogram saved nothing and nothing could be
  // predicted: a narrow band, ties, every value equal). Such a selection
  // starts from a sample instead (one pass over u on any data), and every
  // kRetryPlanAfterUpdate-th one runs the plan again, which finds out
  // whether the data changed (and predicts the update's candidates again).
  uint64_t update_many_pass_n = 0;
  uint64_t update_sampled_count = 0;
  static constexpr uint64_t kRetryPlanAfterUpdate = 8;
  // The n whose next fused update, or Gaussian-k's next own histogram
  // pass, is to count the ties at its predicted key (DeviceState::
  // update_pred_ties, as the last Wait read it; 0: none): Accumulate
  // launches HistogramKernel<true, true> for it, Histogram
  // HistogramKernel<false, true>.
  uint64_t ties_predicted_n = 0;

  // Whether gaussiank's gated exact fallback plans with the first pass's
  // candidates: when the last fallback of this n predicted them.
  // Otherwise, on a large u, it starts from a sample.
  bool GaussFallbackFromUpdate(uint64_t n) const {
    return gauss_fallback_from_candidates && gauss_exact_predicted_n == n;
  }

  // Select: whether an exact selection of n after Accumulate starts from a
  // sample instead of the update's histogram (sample_possible: the
  // multi-kernel path, with a sample plan for n and k). Counts such
  // selections.
  bool SampleAfterUpdate(uint64_t n, bool sample_possible) {
    return update_many_pass_n == n && sample_possible &&
           ++update_sampled_count % kRetryPlanAfterUpdate != 0;
  }

  // Wait: what the finished selection predicts; `last` is the state after
  // it (and after any continuation).
  void Record(const SelectionOutcome& o, const DeviceState& last);
};

}  // namespace internal
}  // namespace cuda
}  // namespace gtopk

#endif  // GTOPK_COMMON_CUDA_SPARSIFY_SELECTION_HISTORY_H_
