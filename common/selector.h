// Local selection of the entries a worker sends: the Selector interface and
// its registry. Implementations live in common/cpu/ (and common/cuda/).
#ifndef GTOPK_COMMON_SELECTOR_H_
#define GTOPK_COMMON_SELECTOR_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "common/sparse_vector.h"

namespace gtopk {

// Settings shared by all selectors; each one reads the fields it needs.
struct SelectorOptions {
  // Seed of the randomized selectors (dgc, randomk). The stream used for a
  // call is derived from (seed, step), so a call is a pure function of its
  // arguments and a restarted worker reproduces the same selection.
  uint64_t seed = 0;
  // dgc: fraction of the input sampled to estimate the threshold, in
  // [0.01, 1] (DGC samples 0.1%-1%; we require at least 1%).
  double dgc_sample_fraction = 0.01;
  // gaussiank: the most threshold adjustments (each may cost one pass over
  // the input) before falling back to exact top-k; in [1, 16].
  int gaussiank_max_adjustments = 4;
};

// Returns INVALID_ARGUMENT naming the bad field, or OK.
absl::Status ValidateSelectorOptions(const SelectorOptions& options);

// Picks about k entries of a dense vector `u` by magnitude.
//
// Select(u, k, step, out):
//   u     dense input of length n, 1 <= n <= 2^32, host memory, not modified;
//         every value must be finite.
//   k     target count, 1 <= k <= n.
//   step  the training step; only randomized selectors use it (see
//         SelectorOptions::seed).
//   out   replaced by the selection: indices strictly ascending, values
//         copied bit-exactly from u (-0.0 stays -0.0). How many entries is
//         each selector's contract (see its class comment); MinCount(k)
//         and MaxCount(k) state it as the range [MinCount(k), MaxCount(k)].
// Errors (out is left empty): INVALID_ARGUMENT when k == 0, k > n, n == 0,
// n > 2^32, or u holds a NaN/Inf (the message names the first position).
//
// Thread-safety: an instance keeps scratch buffers between calls; use one
// instance per thread. Distinct instances are independent.
class Selector {
 public:
  virtual ~Selector() = default;

  // Registry name: "exact", "gaussiank", "dgc" or "randomk".
  virtual absl::string_view name() const = 0;

  virtual absl::Status Select(absl::Span<const float> u, uint64_t k,
                              uint64_t step, SparseVector* out) = 0;

  // Smallest and largest count Select may return for a valid k.
  virtual uint64_t MinCount(uint64_t k) const = 0;
  virtual uint64_t MaxCount(uint64_t k) const = 0;
};

// Checks Select's common preconditions on (n, k); INVALID_ARGUMENT or OK.
absl::Status ValidateSelectArgs(uint64_t n, uint64_t k);

// k for a density in (0, 1]: max(1, round(density * n)). INVALID_ARGUMENT
// when density is not in (0, 1] (or NaN) or n == 0.
absl::StatusOr<uint64_t> KFromDensity(double density, uint64_t n);

// Builds a selector from SelectorOptions; validates them.
using SelectorFactory = std::function<absl::StatusOr<std::unique_ptr<Selector>>(
    const SelectorOptions&)>;

// Name -> factory table. Filled explicitly (RegisterBuiltinSelectors), never
// by static initializers, so a static library cannot silently drop entries.
// Not thread-safe for Register; Create is safe concurrently once filled.
class SelectorRegistry {
 public:
  // ALREADY_EXISTS if `name` is taken; INVALID_ARGUMENT if it is empty.
  absl::Status Register(std::string name, SelectorFactory factory);

  // INVALID_ARGUMENT for an unknown name (the message lists the known ones)
  // or invalid options.
  absl::StatusOr<std::unique_ptr<Selector>> Create(
      absl::string_view name, const SelectorOptions& options) const;

  // Registered names, sorted.
  std::vector<std::string> Names() const;

 private:
  std::map<std::string, SelectorFactory, std::less<>> factories_;
};

// Registers exact, gaussiank, dgc and randomk (CPU implementations).
absl::Status RegisterBuiltinSelectors(SelectorRegistry* registry);

// Convenience: a registry with the built-in selectors, then Create().
absl::StatusOr<std::unique_ptr<Selector>> CreateSelector(
    absl::string_view name, const SelectorOptions& options = {});

}  // namespace gtopk

#endif  // GTOPK_COMMON_SELECTOR_H_
