// What one selection tells the selector about the next (selection_history.h).
#include "common/cuda/sparsify/selection_history.h"

namespace gtopk {
namespace cuda {
namespace internal {

void SelectionHistory::Record(const SelectionOutcome& o,
                              const DeviceState& last) {
  if (o.continuation == Continuation::kGaussianK) {
    expect_exact = o.fell_back;
    // The next gated fallback of this n plans with the first pass's
    // candidates when this fallback ran that plan (gated, or in
    // ContinueGaussianK) and it predicted the next pass's; and after a
    // fallback that started from a sample (which predicts nothing), so
    // that the plan runs again and predicts (at worst every other step
    // when it cannot: the sample in between).
    const bool planned = o.fell_back && !o.ran_sampled && !o.candidate_exact &&
                         last.update_pred_n == o.n && last.update_pred_key != 0;
    gauss_exact_predicted_n =
        planned || (o.fell_back && o.ran_sampled) ? o.n : 0;
  } else if (o.continuation == Continuation::kDgc) {
    dgc_expect_exact = o.took_exact;
  }
  if (o.ran_sampled) {
    (o.continuation == Continuation::kExact ? exact_expect_from_u
                                            : gauss_expect_from_u) =
        o.sample_missed;
  }
  ties_predicted_n = last.update_pred_ties != 0 && last.update_pred_key != 0
                         ? last.update_pred_n
                         : 0;
  // exact after Accumulate: whether the next such selection of this n
  // starts from a sample (update_many_pass_n). A sampled one keeps the
  // verdict; the plan sets it from how many passes over u it needed.
  if (o.exact && o.used_update_histogram && !o.one_block) {
    // (A final compaction from u comes after three digit passes.) When
    // the plan predicted the next update's candidates, and this update
    // kept none it could have used (none, or the prediction missed), the
    // next one tries them instead.
    const bool predicted =
        last.update_pred_n == o.n && last.update_pred_key != 0;
    const bool missed = last.update_used_n == o.n &&
                        last.update_used_key != 0 && !o.candidates_from_update;
    const bool many = !o.candidates_from_update && o.exact_digit_passes > 1 &&
                      (missed || !predicted);
    update_many_pass_n = many ? o.n : 0;
    update_sampled_count = 0;
  } else if (o.update_sampled && o.fell_back && o.exact_digit_passes <= 1) {
    // The sample missed and the plan over u that followed needed one
    // digit pass: the data no longer needs the sample (with the update's
    // histogram that plan is one compaction pass).
    update_many_pass_n = 0;
    update_sampled_count = 0;
  }
}

}  // namespace internal
}  // namespace cuda
}  // namespace gtopk
