#include <algorithm>
#include <random>

#include "absl/container/flat_hash_set.h"
#include "common/cpu/selectors.h"
#include "common/random.h"
#include "common/status_macros.h"

namespace gtopk {
namespace cpu {

absl::Status RandomKSelector::Select(absl::Span<const float> u, uint64_t k,
                                     uint64_t step, SparseVector* out) {
  out->clear();
  GTOPK_RETURN_IF_ERROR(ValidateSelectArgs(u.size(), k));
  GTOPK_RETURN_IF_ERROR(ValidateFinite(u, "selector input"));
  const uint64_t n = u.size();
  std::mt19937_64 rng(MixSeed(seed_, step));
  picked_.clear();
  picked_.reserve(k);
  if (k * 8 >= n) {
    // Selection sampling (Knuth, TAOCP 3.4.2, Algorithm S): one pass, output
    // already in index order.
    uint64_t needed = k;
    for (uint64_t i = 0; i < n && needed > 0; ++i) {
      if (UniformBelow(rng, n - i) < needed) {
        picked_.push_back(static_cast<uint32_t>(i));
        --needed;
      }
    }
  } else {
    // Floyd's algorithm: k distinct values from [0, n) in O(k) draws.
    absl::flat_hash_set<uint32_t> seen;
    seen.reserve(k);
    for (uint64_t j = n - k; j < n; ++j) {
      const uint32_t t = static_cast<uint32_t>(UniformBelow(rng, j + 1));
      const uint32_t pick =
          seen.insert(t).second ? t : static_cast<uint32_t>(j);
      if (pick != t) seen.insert(pick);
      picked_.push_back(pick);
    }
    std::sort(picked_.begin(), picked_.end());
  }
  out->reserve(k);
  for (uint32_t i : picked_) out->push_back(i, u[i]);
  return absl::OkStatus();
}

}  // namespace cpu
}  // namespace gtopk
