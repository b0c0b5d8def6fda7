#include "server/piece_rounds.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/merge.h"
#include "common/status_macros.h"

namespace gtopk {
namespace server {

absl::Status SelectPiece(const SparseVector& piece_sum, uint64_t kp,
                         SparseVector* top) {
  top->clear();
  if (kp == 0 || piece_sum.empty()) return absl::OkStatus();
  return SparseTopK(piece_sum, kp, top);
}

absl::Status SumAndSelectPiece(absl::Span<const SparseVector> inputs,
                               uint64_t n, uint64_t kp, SparseVector* selected,
                               absl::Duration* merge_time,
                               absl::Duration* select_time) {
  const absl::Time start = absl::Now();
  SparseVector sum;
  GTOPK_RETURN_IF_ERROR(SparseSum(inputs, n, &sum));
  const absl::Time merged = absl::Now();
  *merge_time = merged - start;
  GTOPK_RETURN_IF_ERROR(SelectPiece(sum, kp, selected));
  *select_time = absl::Now() - merged;
  return absl::OkStatus();
}

PieceRound::PieceRound(size_t num_pieces, uint32_t num_workers)
    : entries_(num_pieces, std::vector<SparseVector>(num_workers)),
      have_(num_workers, std::vector<bool>(num_pieces, false)),
      received_(num_workers, 0),
      count_(num_pieces, 0),
      started_(num_pieces, false),
      results_(num_pieces) {}

bool PieceRound::any_started(uint32_t w) const {
  for (size_t i = 0; i < num_pieces(); ++i) {
    if (have_[w][i] && started_[i]) return true;
  }
  return false;
}

absl::Status PieceRound::Add(absl::Span<const BucketPiece> pieces, uint32_t w,
                             size_t b, size_t e, SparseVector entries,
                             std::vector<size_t>* ready) {
  for (size_t i = b; i < e; ++i) {
    if (have_[w][i]) {
      return absl::InvalidArgumentError(
          absl::StrCat("piece ", i, " [", pieces[i].begin, ", ", pieces[i].end,
                       ") was sent twice by worker ", w,
                       " in this step (each piece exactly once per step)"));
    }
  }
  size_t j = 0;  // entries' first index not yet placed
  for (size_t i = b; i < e; ++i) {
    SparseVector& slot = entries_[i][w];
    slot.clear();
    size_t to = j;
    while (to < entries.size() && entries.indices[to] < pieces[i].end) ++to;
    if (b + 1 == e) {
      slot = std::move(entries);  // the common case: one piece, no copy
    } else {
      slot.indices.assign(entries.indices.begin() + j,
                          entries.indices.begin() + to);
      slot.values.assign(entries.values.begin() + j,
                         entries.values.begin() + to);
    }
    j = to;
    have_[w][i] = true;
    ++received_[w];
    if (++count_[i] == have_.size()) ready->push_back(i);
  }
  return absl::OkStatus();
}

void PieceRound::Drop(uint32_t w) {
  for (size_t i = 0; i < num_pieces(); ++i) {
    if (!have_[w][i]) continue;
    have_[w][i] = false;
    entries_[i][w].clear();
    --count_[i];
  }
  received_[w] = 0;
}

std::vector<SparseVector> PieceRound::TakeInputs(size_t i) {
  started_[i] = true;
  return std::move(entries_[i]);
}

void PieceRound::SetResult(size_t i, std::shared_ptr<const PieceResult> r) {
  if (results_[i] == nullptr) {
    ++done_;
    finished_.push_back(i);
  }
  results_[i] = std::move(r);
}

std::vector<size_t> PieceRound::Waiting(size_t most) const {
  std::vector<size_t> out;
  for (size_t i = 0; i < num_pieces() && out.size() < most; ++i) {
    if (count_[i] < have_.size()) out.push_back(i);
  }
  return out;
}

}  // namespace server
}  // namespace gtopk
