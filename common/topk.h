// Exact top-k by magnitude on the CPU, and the threshold/compaction building
// blocks the other CPU selectors share.
//
// Magnitudes are compared through their "key": the float's bits with the sign
// cleared. For non-negative IEEE-754 floats the bit pattern orders like the
// value, so |a| < |b| iff key(a) < key(b); keys >= 0x7f800000 are Inf/NaN.
// Working on keys makes every comparison exact and the tie-break
// (lower index wins) well defined, also for -0.0, denormals and equal values.
#ifndef GTOPK_COMMON_TOPK_H_
#define GTOPK_COMMON_TOPK_H_

#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "common/magnitude_key.h"
#include "common/sparse_vector.h"

namespace gtopk {
namespace cpu {

// |x|'s key and the non-finite bound (common/magnitude_key.h, shared with
// the CUDA kernels).
using ::gtopk::kNonFiniteKey;
using ::gtopk::MagnitudeKey;

// A growable array of trivially copyable T that, unlike std::vector, does not
// value-initialise on growth: the hot loops write every slot they later read.
template <typename T>
class PodBuffer {
 public:
  T* data() { return data_.get(); }
  const T* data() const { return data_.get(); }
  size_t capacity() const { return capacity_; }
  // Ensures room for `capacity` elements; contents are not preserved.
  void Reserve(size_t capacity) {
    if (capacity <= capacity_) return;
    data_.reset(new T[capacity]);
    capacity_ = capacity;
  }

 private:
  std::unique_ptr<T[]> data_;
  size_t capacity_ = 0;
};

// Survivors of a threshold pass: positions into the input (ascending) and the
// values found there.
struct Candidates {
  PodBuffer<uint32_t> positions;
  PodBuffer<float> values;
  size_t size = 0;
  absl::Span<const uint32_t> position_span() const {
    return {positions.data(), size};
  }
  absl::Span<const float> value_span() const { return {values.data(), size}; }
};

// Reusable buffers so that steady-state selection does not allocate.
struct TopKScratch {
  Candidates candidates;
  std::vector<uint32_t> keys;  // magnitude keys (sample or candidates)
};

// The exact top-k of `u` by |value|: the k entries with the largest
// magnitudes, ties broken by lower index, output sorted by index with the
// values copied bit-exactly. Preconditions are Selector::Select's; errors are
// INVALID_ARGUMENT for bad (n, k) or a non-finite value (first position named).
//
// Algorithm (one pass over memory in the common case):
//  1. estimate a magnitude threshold from an evenly spaced block sample
//     (16 Ki values in cache-line runs), aiming for ~1.3k-2.5k survivors;
//  2. one vectorised pass collects the positions whose key >= threshold;
//  3. the exact k-th key among the survivors (nth_element on ~2k keys) and a
//     walk in index order finish the selection with the exact tie-break.
// When the estimate fails (fewer than k survivors, or far too many: skewed
// or highly repetitive data) it falls back to an exact radix select on the
// key bits (11/11/9-bit histograms) and one compaction pass. Either way the
// result equals a full sort's. Inf/NaN are caught for free: the largest key
// always survives step 2.
absl::Status ExactTopK(absl::Span<const float> u, uint64_t k,
                       TopKScratch* scratch, SparseVector* out);

// Replaces `out` by every position j (ascending) with
// MagnitudeKey(u[j]) >= min_key, and its value. Stops early and returns false
// once more than `cap` survive (out is then incomplete). Branch-free inside
// 64-element blocks that hold a survivor; blocks without one cost a compare.
bool CollectAtLeast(absl::Span<const float> u, uint32_t min_key, size_t cap,
                    Candidates* out);

// True when any of `values` is NaN or +-Inf.
bool AnyNonFinite(absl::Span<const float> values);

// Given `candidates` (ascending positions into some input, with their values)
// that contain the true top-k of that input, writes the exact top-k (same
// contract as ExactTopK) to `out`. Precondition: candidates.size >= k >= 1.
// Uses scratch->keys.
void FinishTopKFromCandidates(const Candidates& candidates, uint64_t k,
                              std::vector<uint32_t>* keys, SparseVector* out);

// Exact radix select over all of u: the key T of the k-th largest magnitude
// and how many keys are strictly greater. Precondition: 1 <= k <= u.size().
// Returns false (without a result) when a key is non-finite.
bool RadixSelectKey(absl::Span<const float> u, uint64_t k, uint32_t* kth_key,
                    uint64_t* count_greater);

// Writes to `out`, in index order, every entry with key > kth_key plus the
// first (k - count_greater) entries with key == kth_key.
void CompactTopK(absl::Span<const float> u, uint32_t kth_key,
                 uint64_t count_greater, uint64_t k, SparseVector* out);

}  // namespace cpu
}  // namespace gtopk

#endif  // GTOPK_COMMON_TOPK_H_
