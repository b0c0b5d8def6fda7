// Sparse vector: the unit that workers push and servers return.
#ifndef GTOPK_COMMON_SPARSE_VECTOR_H_
#define GTOPK_COMMON_SPARSE_VECTOR_H_

#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"

namespace gtopk {

// A sparse vector over a dense index space of length `n` (not stored here):
// `indices` are strictly ascending uint32 positions in [0, n) and `values[j]`
// is the float at `indices[j]`. Invariants (checked by ValidateSparseVector):
//   indices.size() == values.size();
//   indices strictly ascending (sorted and unique);
//   every index < n;
//   every value finite (no NaN, no +-Inf).
// A value type with no internal synchronization: concurrent const access is
// safe, mutation needs external locking.
struct SparseVector {
  std::vector<uint32_t> indices;
  std::vector<float> values;

  size_t size() const { return indices.size(); }
  bool empty() const { return indices.empty(); }
  void clear() {
    indices.clear();
    values.clear();
  }
  void reserve(size_t capacity) {
    indices.reserve(capacity);
    values.reserve(capacity);
  }
  void push_back(uint32_t index, float value) {
    indices.push_back(index);
    values.push_back(value);
  }
  friend bool operator==(const SparseVector& a, const SparseVector& b);
  friend bool operator!=(const SparseVector& a, const SparseVector& b) {
    return !(a == b);
  }
};

// Largest dense length a SparseVector can address (indices are uint32).
inline constexpr uint64_t kMaxDenseLength = uint64_t{1} << 32;

// Checks every invariant above for a dense length `n` and returns OK or
// INVALID_ARGUMENT naming the first fault and its position, e.g.
// "indices not strictly ascending at position 7: 12 after 12". O(size).
absl::Status ValidateSparseVector(const SparseVector& v, uint64_t n);

// Same checks on separate spans (for decoded or borrowed buffers).
absl::Status ValidateSparse(absl::Span<const uint32_t> indices,
                            absl::Span<const float> values, uint64_t n);

// Returns INVALID_ARGUMENT naming the first non-finite value and its position,
// or OK. `what` names the buffer in the message (e.g. "gradient").
absl::Status ValidateFinite(absl::Span<const float> values, const char* what);

// Expands `v` into a dense vector of length n (zeros elsewhere). Test and
// debugging helper; precondition: ValidateSparseVector(v, n).ok().
std::vector<float> ToDense(const SparseVector& v, uint64_t n);

}  // namespace gtopk

#endif  // GTOPK_COMMON_SPARSE_VECTOR_H_
