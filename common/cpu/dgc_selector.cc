#include <algorithm>
#include <cmath>
#include <functional>
#include <random>

#include "common/cpu/selectors.h"
#include "common/random.h"
#include "common/status_macros.h"

namespace gtopk {
namespace cpu {

absl::Status DgcSelector::Select(absl::Span<const float> u, uint64_t k,
                                 uint64_t step, SparseVector* out) {
  out->clear();
  GTOPK_RETURN_IF_ERROR(ValidateSelectArgs(u.size(), k));
  const size_t n = u.size();
  constexpr size_t kRunLength = 16;
  const size_t wanted =
      static_cast<size_t>(std::ceil(sample_fraction_ * static_cast<double>(n)));
  const size_t runs = (wanted + kRunLength - 1) / kRunLength;
  // A sample as large as the input gives the exact threshold: that is the
  // exact top-k, computed directly.
  if (k == n || runs * kRunLength * 2 >= n) {
    return ExactTopK(u, k, &scratch_, out);
  }

  std::mt19937_64 rng(MixSeed(seed_, step));
  std::vector<uint32_t>& sample = scratch_.keys;
  sample.resize(runs * kRunLength);
  uint32_t* dst = sample.data();
  for (size_t r = 0; r < runs; ++r) {
    const size_t start = UniformBelow(rng, n - kRunLength + 1);
    for (size_t j = 0; j < kRunLength; ++j) {
      *dst++ = MagnitudeKey(u[start + j]);
    }
  }
  const size_t sample_k = std::max<size_t>(
      1, static_cast<size_t>(std::ceil(static_cast<double>(sample.size()) *
                                       static_cast<double>(k) /
                                       static_cast<double>(n))));
  std::nth_element(sample.begin(), sample.begin() + (sample_k - 1),
                   sample.end(), std::greater<uint32_t>());
  const uint32_t threshold = sample[sample_k - 1];

  // Far more survivors than k means the sample misjudged the tail; trimming
  // them to k is then the exact top-k, which ExactTopK does in fewer passes.
  Candidates& survivors = scratch_.candidates;
  const size_t cap = 8 * static_cast<size_t>(k) + 4096;
  const bool complete = CollectAtLeast(u, threshold, cap, &survivors);
  // The threshold is a sampled key, so the largest key always survives and
  // any NaN/Inf shows up among the survivors.
  if (AnyNonFinite(survivors.value_span())) {
    return ValidateFinite(u, "selector input");
  }
  if (!complete) return ExactTopK(u, k, &scratch_, out);
  if (survivors.size > k) {
    FinishTopKFromCandidates(survivors, k, &scratch_.keys, out);
    return absl::OkStatus();
  }
  out->indices.assign(survivors.positions.data(),
                      survivors.positions.data() + survivors.size);
  out->values.assign(survivors.values.data(),
                     survivors.values.data() + survivors.size);
  return absl::OkStatus();
}

}  // namespace cpu
}  // namespace gtopk
