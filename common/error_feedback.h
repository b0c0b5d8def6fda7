// Error feedback (residual accumulation) for one worker: whatever a worker
// accumulated but did not get applied stays in a dense residual and is added
// to the next steps' updates, so sparsification delays values but never
// drops them (Aji & Heafield, "Sparse Communication for Distributed Gradient
// Descent", EMNLP 2017; Lin et al., "Deep Gradient Compression",
// arXiv:1712.01887). With gTop-k (Shi et al., ICDCS 2019, arXiv:1901.04359)
// a worker's sent entries that miss the global top-k are put back as well.
//
// One step, as the worker drives it:
//   feedback.Accumulate(lr * v);                       // u = residual + lr*v
//   selector.Select(feedback.residual(), k, step, &sent);
//   received = codec round trip of sent;               // == sent for fp32
//   feedback.MarkSent(sent, received);                 // residual = u - recv
//   ... push `received`, pull the global selection `global` ...
//   feedback.PutBack(received, global);                // sent \ global back
//
// Nothing is lost (tested), after MarkSent + PutBack, with u the residual
// after Accumulate and recv_i the decoded value of a sent entry:
//   i never sent:             residual[i] == u_i, bit for bit;
//   i sent, not in global:    residual[i] == fl(fl(u_i - recv_i) + recv_i):
//                             u_i bit for bit (-0.0 included) for a lossless
//                             codec, and exactly u_i in value whenever recv_i
//                             is within a factor 2 of u_i or 0 (Sterbenz);
//   i in sent ∩ global:       residual[i] == fl(u_i - recv_i), the codec's
//                             error (+0.0 for a lossless codec), so
//                             residual[i] + recv_i == u_i up to the rounding
//                             of that one subtraction.
#ifndef GTOPK_COMMON_ERROR_FEEDBACK_H_
#define GTOPK_COMMON_ERROR_FEEDBACK_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/sparse_vector.h"

namespace gtopk {

// A worker's dense residual of length n (float, host memory), zero at start.
//
// Not thread-safe: one instance per worker, used from one thread at a time
// (or with external locking). Every method validates its arguments completely
// before changing anything: on error the residual is unchanged.
class ErrorFeedback {
 public:
  // A zero residual of length n. INVALID_ARGUMENT when n > 2^32
  // (kMaxDenseLength); n == 0 is allowed (an empty model).
  static absl::StatusOr<ErrorFeedback> Create(uint64_t n);

  // Same as Create(n) for a trusted n. Precondition: n <= 2^32.
  explicit ErrorFeedback(uint64_t n);

  ErrorFeedback(ErrorFeedback&&) = default;
  ErrorFeedback& operator=(ErrorFeedback&&) = default;
  ErrorFeedback(const ErrorFeedback&) = delete;
  ErrorFeedback& operator=(const ErrorFeedback&) = delete;

  // residual += update, element-wise (one float addition each).
  //   update  length n, every value finite; not retained.
  // Errors (residual unchanged; the first offending position is named):
  //   INVALID_ARGUMENT     update.size() != n; a non-finite update value; or
  //                        a sum that would overflow to +-Inf.
  //   FAILED_PRECONDITION  the residual itself holds a non-finite value
  //                        (written through mutable_residual()).
  // Cost: two passes over n floats (check, then add).
  absl::Status Accumulate(absl::Span<const float> update);

  // Records that the entries `sent` were selected from the current residual
  // u and that the receivers will decode them as `sent_as_received` (rounded
  // by a lossy codec such as fp16/bf16; equal to `sent` for fp32). For each
  // sent index i: residual[i] = u_i - received_i, i.e. exactly +0.0 when
  // lossless and the quantization error otherwise. Also remembers
  // `sent_as_received` for the PutBack of this step.
  //   sent              selected entries, values bit-equal to residual().
  //   sent_as_received  the same indices with the decoded values.
  // Errors (nothing changed):
  //   INVALID_ARGUMENT     either vector fails ValidateSparseVector(., n);
  //                        their indices differ (count or position named);
  //                        or u_i - received_i overflows to +-Inf.
  //   FAILED_PRECONDITION  a sent value is not bitwise the current residual
  //                        at its index (the selection was not made from
  //                        the current state; position and index named).
  // Cost: O(|sent|).
  absl::Status MarkSent(const SparseVector& sent,
                        const SparseVector& sent_as_received);

  // gTop-k put-back: every entry the worker sent that is NOT in the global
  // selection returns to the residual, residual[i] += received_i (for a
  // residual of exactly +-0, as after a lossless MarkSent, the result is
  // received_i bit for bit, so -0.0 survives). Entries in both stay sent.
  //   sent_as_received  must equal (bitwise) the `sent_as_received` of the
  //                     last MarkSent that no PutBack has consumed yet.
  //   global            the global selection; only its indices are used
  //                     (strictly ascending, < n; values are not read).
  // A successful PutBack consumes the MarkSent: a second one fails, so a
  // put-back can never be applied twice. Modes without put-back (topk,
  // dense) simply never call it; the next MarkSent replaces the pending one.
  // Errors (nothing changed):
  //   INVALID_ARGUMENT     sent_as_received fails ValidateSparseVector(., n);
  //                        global's indices are unsorted, duplicated, out of
  //                        range or global.values has another size.
  //   FAILED_PRECONDITION  no pending MarkSent, or sent_as_received differs
  //                        from it; or a put-back sum would be non-finite
  //                        (the residual was changed since MarkSent).
  // Cost: O(|sent| + |global|), a merge walk of the two index lists.
  absl::Status PutBack(const SparseVector& sent_as_received,
                       const SparseVector& global);

  // Zeroes the residual and forgets any pending MarkSent.
  void Reset();

  // The dense length n.
  uint64_t n() const { return residual_.size(); }

  // The residual, length n: after Accumulate, the accumulated vector u the
  // selector picks from. Valid until the object is destroyed or moved.
  absl::Span<const float> residual() const { return residual_; }
  // Mutable access (e.g. for a momentum-correction or device copy). Writing
  // non-finite values makes later calls fail; editing entries between
  // MarkSent and PutBack changes what PutBack adds to.
  absl::Span<float> mutable_residual() { return absl::MakeSpan(residual_); }

 private:
  std::vector<float> residual_;
  // sent_as_received of the last MarkSent, until PutBack consumes it.
  SparseVector pending_;
  bool has_pending_ = false;
};

}  // namespace gtopk

#endif  // GTOPK_COMMON_ERROR_FEEDBACK_H_
