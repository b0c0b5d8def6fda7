// Layer-wise rounds per (step, bucket piece) on one shard (--selection=
// layerwise; docs/overlap.md, "Rounds per bucket"). A worker may push its
// entries of a step to a shard in parts, each a contiguous run of the
// shard's pieces (Push.piece_begin/piece_end); a piece's round -- the sum
// over the P workers in rank order and the top k_p of that sum -- runs as
// soon as all P workers' parts holding it have arrived, while the other
// pieces are still coming. This is layer-wise gTop-k (S. Shi et al.,
// "Layer-wise adaptive gradient sparsification for distributed deep
// learning with convergence guarantees" (LAGS-SGD), ECAI 2020) with each
// bucket's round on the wire as its own, as PyTorch DDP all-reduces each
// bucket as backward produces it. The step's commit vote and apply stay one
// per step (ShardAggregator).
#ifndef GTOPK_SERVER_PIECE_ROUNDS_H_
#define GTOPK_SERVER_PIECE_ROUNDS_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "common/buckets.h"
#include "common/sparse_vector.h"

namespace gtopk {
namespace server {

// The top `kp` entries by |value| of one piece's sum (`piece_sum`, sorted by
// index; ties to the lower index), into *top (cleared first; empty when kp
// is 0 or the sum is empty). The one selection of a piece, shared by the
// whole-shard round (ShardAggregator::SelectPerPiece) and the per-piece
// rounds (SumAndSelectPiece), so both give the same bits. Errors:
// SparseTopK's (INVALID_ARGUMENT for a malformed input). Pure, reentrant.
absl::Status SelectPiece(const SparseVector& piece_sum, uint64_t kp,
                         SparseVector* top);

// One piece's round: the sum of `inputs` (P sparse vectors, inputs[w] is
// rank w's entries of the piece, each sorted, inside [0, n)) in rank order
// (SparseSum's contract: the sum of an index does not depend on the other
// indices, so it is bit-identical to the same index of the whole shard's
// sum), then SelectPiece(sum, kp). *selected gets the top kp with the SUM
// over workers, global indices. *merge_time and *select_time get the wall
// time of the two parts. Errors: INVALID_ARGUMENT from SparseSum (a sum
// that overflows to +-Inf, naming the index). Pure but for the clock.
absl::Status SumAndSelectPiece(absl::Span<const SparseVector> inputs,
                               uint64_t n, uint64_t kp, SparseVector* selected,
                               absl::Duration* merge_time,
                               absl::Duration* select_time);

// One finished piece's round (immutable once published).
struct PieceResult {
  SparseVector selected;  // top k_p of the piece's sum, global indices
  absl::Duration merge_time;
  absl::Duration select_time;
};

// The pieces of one step's round on one shard: which worker sent which of
// the shard's M pieces, their entries until the piece's round takes them,
// and each piece's result. Thread-safety: none; ShardAggregator guards it
// with its mutex (the sum and selection run without it, on inputs taken
// out by TakeInputs).
class PieceRound {
 public:
  PieceRound(size_t num_pieces, uint32_t num_workers);

  size_t num_pieces() const { return count_.size(); }
  // Whether worker w sent any part, or all M pieces.
  bool touched(uint32_t w) const { return received_[w] > 0; }
  bool complete(uint32_t w) const { return received_[w] == num_pieces(); }
  // Whether any piece w sent has started its round (its entries are taken).
  bool any_started(uint32_t w) const;

  // Stores worker w's entries of pieces [b, e) (`pieces` is the shard's
  // piece list; `entries` sorted and inside the run's range, checked by the
  // caller). INVALID_ARGUMENT naming the piece when w sent one of them
  // already this round (nothing stored then). On success, appends to
  // *ready the pieces that now hold all P workers' entries.
  absl::Status Add(absl::Span<const BucketPiece> pieces, uint32_t w, size_t b,
                   size_t e, SparseVector entries, std::vector<size_t>* ready);
  // Forgets everything worker w sent (a repeated whole push replacing its
  // first while none of its pieces has started). Precondition:
  // !any_started(w).
  void Drop(uint32_t w);

  // Piece i's P inputs, in rank order, moved out; marks it started.
  // Precondition: all P arrived, not started.
  std::vector<SparseVector> TakeInputs(size_t i);
  // Publishes piece i's result (started before).
  void SetResult(size_t i, std::shared_ptr<const PieceResult> result);
  const std::shared_ptr<const PieceResult>& result(size_t i) const {
    return results_[i];
  }
  // Every piece's result is in.
  bool all_done() const { return done_ == num_pieces(); }
  // The pieces whose result is in, in the order they were published
  // (SetResult): a reader keeps how many it has seen and reads on from
  // there, instead of looking at every piece each time.
  absl::Span<const size_t> finished() const { return finished_; }
  // Pieces that have not all P workers' entries yet (for error messages),
  // at most `most` of them.
  std::vector<size_t> Waiting(size_t most) const;

 private:
  // [piece][worker] entries until the piece starts.
  std::vector<std::vector<SparseVector>> entries_;
  // [worker][piece] arrived.
  std::vector<std::vector<bool>> have_;
  std::vector<size_t> received_;  // per worker: pieces arrived
  std::vector<uint32_t> count_;   // per piece: workers arrived
  std::vector<bool> started_;     // per piece: inputs taken
  std::vector<std::shared_ptr<const PieceResult>> results_;
  std::vector<size_t> finished_;  // pieces with a result, as published
  size_t done_ = 0;
};

}  // namespace server
}  // namespace gtopk

#endif  // GTOPK_SERVER_PIECE_ROUNDS_H_
