// CPU selectors: one class per algorithm behind gtopk::Selector. Create them
// by name through SelectorRegistry (common/selector.h); the classes are
// public for tests and for wrapping.
#ifndef GTOPK_COMMON_CPU_SELECTORS_H_
#define GTOPK_COMMON_CPU_SELECTORS_H_

#include <cstdint>
#include <vector>

#include "common/normal_quantile.h"
#include "common/selector.h"
#include "common/topk.h"

namespace gtopk {
namespace cpu {

// "exact": the true top-k by |value|, ties broken by lower index; returns
// exactly k entries sorted by index. About one pass over memory (see
// ExactTopK). Top-k sparsification as used by gTop-k S-SGD (Shi et al.,
// ICDCS 2019, arXiv:1901.04359).
class ExactSelector final : public Selector {
 public:
  absl::string_view name() const override { return "exact"; }
  absl::Status Select(absl::Span<const float> u, uint64_t k, uint64_t step,
                      SparseVector* out) override;
  uint64_t MinCount(uint64_t k) const override { return k; }
  uint64_t MaxCount(uint64_t k) const override { return k; }

 private:
  TopKScratch scratch_;
};

// "gaussiank": Gaussian-k (Shi et al., "Understanding Top-k Sparsification in
// Distributed Deep Learning", arXiv:1911.08772). Treats u as normal with the
// sample mean and (unbiased) standard deviation of u and selects |u_i| > t,
// t = mean + z*std, z = Phi^-1(1 - density/2). As in the authors' code, when
// the count falls outside [ceil(2k/3), floor(4k/3)] the threshold is halved
// (too few) or multiplied by 1.5 (too many), at most
// SelectorOptions::gaussiank_max_adjustments times; raising the threshold
// reuses the survivors of the last pass, only lowering it rescans u. If the
// count is still outside the range afterwards, the exact top-k is returned,
// so the count contract [ceil(2k/3), floor(4k/3)] always holds (k itself for
// k < 2, where the range may be empty).
class GaussianKSelector final : public Selector {
 public:
  explicit GaussianKSelector(const SelectorOptions& options)
      : max_adjustments_(options.gaussiank_max_adjustments) {}
  absl::string_view name() const override { return "gaussiank"; }
  absl::Status Select(absl::Span<const float> u, uint64_t k, uint64_t step,
                      SparseVector* out) override;
  uint64_t MinCount(uint64_t k) const override;
  uint64_t MaxCount(uint64_t k) const override;

  // What the last successful Select did: how many scaled thresholds it
  // tried after the first (at most max_adjustments; where it stopped when
  // it fell back), and whether it ended with the exact top-k fallback.
  int last_adjustments() const { return last_adjustments_; }
  bool last_fell_back() const { return last_fell_back_; }

 private:
  int max_adjustments_;
  int last_adjustments_ = 0;
  bool last_fell_back_ = false;
  TopKScratch scratch_;
};

// "dgc": the sampled threshold of Deep Gradient Compression (Lin et al.,
// ICLR 2018, arXiv:1712.01887). Samples SelectorOptions::dgc_sample_fraction
// of u (>= 1%) as random runs of 16 consecutive values (cache-line sized;
// seeded from (seed, step)), takes the ceil(k * sample/n)-th largest sampled
// magnitude as the threshold, keeps |u_i| >= threshold and, when more than k
// pass, trims them to exactly the top k. Returns between 1 and k entries.
// With a sample fraction that covers u the result is the exact top-k.
class DgcSelector final : public Selector {
 public:
  explicit DgcSelector(const SelectorOptions& options)
      : seed_(options.seed), sample_fraction_(options.dgc_sample_fraction) {}
  absl::string_view name() const override { return "dgc"; }
  absl::Status Select(absl::Span<const float> u, uint64_t k, uint64_t step,
                      SparseVector* out) override;
  uint64_t MinCount(uint64_t) const override { return 1; }
  uint64_t MaxCount(uint64_t k) const override { return k; }

 private:
  uint64_t seed_;
  double sample_fraction_;
  TopKScratch scratch_;
};

// "randomk": k distinct indices drawn uniformly at random, seeded from
// (seed, step); the usual baseline (e.g. Stich et al., NeurIPS 2018). Returns
// exactly k entries sorted by index.
class RandomKSelector final : public Selector {
 public:
  explicit RandomKSelector(const SelectorOptions& options)
      : seed_(options.seed) {}
  absl::string_view name() const override { return "randomk"; }
  absl::Status Select(absl::Span<const float> u, uint64_t k, uint64_t step,
                      SparseVector* out) override;
  uint64_t MinCount(uint64_t k) const override { return k; }
  uint64_t MaxCount(uint64_t k) const override { return k; }

 private:
  uint64_t seed_;
  std::vector<uint32_t> picked_;
};

// Phi^-1(p) (common/normal_quantile.h).
using ::gtopk::NormalQuantile;

}  // namespace cpu
}  // namespace gtopk

#endif  // GTOPK_COMMON_CPU_SELECTORS_H_
