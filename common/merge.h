// Sparse merge: the sum of the workers' sparse vectors and its top-k, the
// aggregation at the heart of a gTop-k step (Shi et al., "A Distributed
// Synchronous SGD Algorithm with Global Top-k Sparsification for Low
// Bandwidth Networks", ICDCS 2019, arXiv:1901.04359).
//
// Everything here is a pure function of its arguments, bit for bit: the
// summation order is fixed (see SparseSum), so every server, shard and test
// that sums the same inputs gets the same float bits, which is what keeps the
// replicas bit-identical.
#ifndef GTOPK_COMMON_MERGE_H_
#define GTOPK_COMMON_MERGE_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "common/sparse_vector.h"
#include "common/topk.h"

namespace gtopk {

// Reusable buffers for SparseSum, so that a server summing every step does
// not allocate in steady state. Contents between calls are unspecified. Not
// thread-safe: one instance per thread.
struct MergeScratch {
  // Packed (index << 32 | value bits) pairs of one bucket and the radix
  // sort's second buffer; each grows to the largest bucket.
  std::vector<uint64_t> keys;
  std::vector<uint64_t> keys_alt;
  // Per-input read positions while walking the buckets.
  std::vector<size_t> cursor;
  std::vector<size_t> run_end;
  // The result is built here and then swapped into the caller's output (so
  // the output may alias an input); holds the output's old buffers after.
  SparseVector result;
};

// The sum of P sparse vectors over a dense index space of length n.
//
//   inputs   P >= 0 sparse vectors, inputs[p] is worker rank p's; each must
//            satisfy ValidateSparseVector(inputs[p], n). Not modified; `out`
//            may alias one of them.
//   n        dense length, 0 <= n <= 2^32 (kMaxDenseLength). Only indices
//            are compared with it; nothing of length n is allocated or read.
//   out      replaced by the sum: indices = the union of the supports,
//            strictly ascending; values = the sums. An index whose sum is
//            exactly 0 (e.g. x + -x) stays in the output. P == 0 or all
//            inputs empty gives an empty output.
//   scratch  optional reusable buffers (nullptr: allocate per call).
//
// Summation order (a contract that servers rely on for bit-identical
// results; a shard that sums its sub-range with SparseSum reproduces these
// bits): for every index, the values present there are added in input (rank)
// order, starting from the first present value, with no `0.0f +`:
// ((v_a + v_b) + v_c) + ... for ranks a < b < c < ... holding the index. So
// an index held by one input keeps its value's bits (-0.0 stays -0.0) and
// the result does not depend on which other indices are present.
//
// Errors (out is left empty, nothing else changed):
//   INVALID_ARGUMENT  n > 2^32; an input fails ValidateSparseVector (the
//                     message names the input number and the position, e.g.
//                     "input 3: sparse indices not strictly ascending at
//                     position 7: ..."); a sum overflows to +-Inf (the
//                     message names the index).
//
// Cost: O(T) time and O(T) memory for T = total input pairs, never O(n):
// one validation pass; P == 1 is a copy, P == 2 a branch-free linear merge
// (empty inputs do not count towards P); otherwise the index space is cut
// into about T / 1024 buckets by the top bits of the index and, bucket by
// bucket, the P runs (inputs are sorted) are gathered in rank order into a
// cache-resident buffer, stably LSD-radix-sorted there by the low bits
// (digits <= 9 bits) and combined into the output, so the inputs are read
// once and the output written once. bench/merge_bench compares it with a
// k-way heap merge.
//
// Thread-safety: reentrant; concurrent calls need distinct `out` and
// `scratch`.
absl::Status SparseSum(absl::Span<const SparseVector> inputs, uint64_t n,
                       SparseVector* out, MergeScratch* scratch = nullptr);

// The top-k of a sparse vector by |value|: the k entries of largest
// magnitude, ties broken by lower index, output sorted by index with the
// values copied bit-exactly. If k >= v.size() the output is all of v.
//
//   v        indices strictly ascending, values finite (any n: checked as
//            ValidateSparseVector(v, 2^32)). Not modified; `out` may alias it.
//   k        number of entries to keep, k >= 1.
//   out      replaced by the selection.
//   scratch  optional reusable buffers for cpu::ExactTopK (nullptr: allocate
//            per call).
//
// Magnitudes are compared exactly (cpu::MagnitudeKey), so +0.0 and -0.0 tie
// and the lower index wins. Runs cpu::ExactTopK over v.values; because v is
// sorted by index, a lower position is a lower index, so the tie-break
// carries over. Cost: about one pass over v.values plus O(k).
//
// Errors (out is left empty): INVALID_ARGUMENT when k == 0 or v is invalid
// (unsorted, duplicate, size mismatch, non-finite; the position is named).
//
// Thread-safety: reentrant; concurrent calls need distinct `out`/`scratch`.
absl::Status SparseTopK(const SparseVector& v, uint64_t k, SparseVector* out,
                        cpu::TopKScratch* scratch = nullptr);

// Single-process reference of one whole gTop-k step (Shi et al., ICDCS 2019,
// arXiv:1901.04359): the global top-k, by |sum|
// with ties broken by lower global index, of the sum of all workers' sparse
// pushes, with the summed values (not divided by P). Equivalent to
// SparseSum(pushes, n) followed by SparseTopK(sum, k).
//
// This is the oracle the distributed, sharded servers are tested against
// (exact selection must match it bit for bit). To reproduce its bits, a
// shard owning [begin_s, end_s) must compute its partial sum with SparseSum
// over the workers' pushes restricted to that sub-range (in rank order):
// SparseSum's per-index summation order does not depend on the other
// indices, so the union of the shards' sums equals SparseSum of the whole.
//
//   pushes  P >= 0 sparse vectors (worker rank order), each valid for n.
//   n       dense length, <= 2^32; nothing of length n is allocated.
//   k       global number of entries kept, k >= 1; if the sum has at most k
//           entries it is returned whole.
//   global  replaced by the selection, sorted by index.
//
// Errors (global is left empty): INVALID_ARGUMENT when k == 0, or as
// SparseSum (invalid push naming input and position, n > 2^32, overflow to
// Inf naming the index).
//
// Thread-safety: reentrant; concurrent calls need distinct `global`.
absl::Status ReferenceGtopkStep(absl::Span<const SparseVector> pushes,
                                uint64_t n, uint64_t k, SparseVector* global);

}  // namespace gtopk

#endif  // GTOPK_COMMON_MERGE_H_
