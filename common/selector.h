// Local selection of the entries a worker sends: the Selector interface and
// its registry. Implementations live in common/cpu/ (and, on the GPU,
// common/cuda/).
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

// Builds a device selector: the same selector with its selection on a device
// (a GPU), scratch allocated for inputs of up to `capacity` entries (it grows
// when a larger input comes). What it takes beyond Selector (device memory,
// a stream) is its implementation's interface, e.g. cuda::CudaSelector
// (common/cuda/cuda_selector.h).
using DeviceSelectorFactory =
    std::function<absl::StatusOr<std::unique_ptr<Selector>>(
        const SelectorOptions&, uint64_t capacity)>;

// Name -> factory table: every selector by name, and for those that have one,
// its device implementation under the same name (so that `--selector` has
// one list of names whether a step runs on the host or on a GPU). Filled
// explicitly (RegisterBuiltinSelectors; the device implementations by their
// library, e.g. cuda::RegisterCudaSelectors), never by static initializers,
// so a static library cannot silently drop entries. Not thread-safe for
// Register/RegisterDevice; Create/CreateDevice are safe concurrently once
// filled.
class SelectorRegistry {
 public:
  // ALREADY_EXISTS if `name` is taken; INVALID_ARGUMENT if it is empty.
  absl::Status Register(std::string name, SelectorFactory factory);

  // The device implementation of the registered selector `name` (same name,
  // same count contract). INVALID_ARGUMENT if `name` is not registered
  // (Register it first: a device selector is a version of a known one);
  // ALREADY_EXISTS if it has a device implementation already.
  absl::Status RegisterDevice(std::string name, DeviceSelectorFactory factory);

  // INVALID_ARGUMENT for an unknown name (the message lists the known ones)
  // or invalid options.
  absl::StatusOr<std::unique_ptr<Selector>> Create(
      absl::string_view name, const SelectorOptions& options) const;

  // The device implementation of `name`. INVALID_ARGUMENT for an unknown
  // name (as Create), for a known one without a device implementation (the
  // message lists those with one, or says there are none) or invalid
  // options; the factory's errors (e.g. no usable device) as they are.
  absl::StatusOr<std::unique_ptr<Selector>> CreateDevice(
      absl::string_view name, const SelectorOptions& options,
      uint64_t capacity) const;

  // Registered names, sorted.
  std::vector<std::string> Names() const;

  // The names with a device implementation, sorted (a subset of Names();
  // empty when no device library registered any).
  std::vector<std::string> DeviceNames() const;

 private:
  std::map<std::string, SelectorFactory, std::less<>> factories_;
  std::map<std::string, DeviceSelectorFactory, std::less<>> device_factories_;
};

// Registers exact, gaussiank, dgc and randomk (CPU implementations). The GPU
// implementations of exact, gaussiank and dgc are registered by
// cuda::RegisterCudaSelectors (common/cuda/cuda_selector.h, in builds with
// CUDA), called where a device selector is made (worker/device_step.cc):
// common/ does not include common/cuda/.
absl::Status RegisterBuiltinSelectors(SelectorRegistry* registry);

// Convenience: a registry with the built-in selectors, then Create().
absl::StatusOr<std::unique_ptr<Selector>> CreateSelector(
    absl::string_view name, const SelectorOptions& options = {});

}  // namespace gtopk

#endif  // GTOPK_COMMON_SELECTOR_H_
