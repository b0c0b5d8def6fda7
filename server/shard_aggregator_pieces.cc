// ShardAggregator's layer-wise rounds per piece (server/shard_aggregator.h
// SubmitPart, AwaitPieces; server/piece_rounds.h; docs/overlap.md, "Rounds
// per bucket"): a worker's push in parts, each piece's round as soon as its
// P inputs are in, the step's result assembled from the pieces.
#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"
#include "server/shard_aggregator.h"

namespace gtopk {
namespace server {

absl::Status ShardAggregator::SelectPerPiece(const SparseVector& sum,
                                             uint64_t k,
                                             SparseVector* selected) const {
  selected->clear();
  size_t j = 0;  // sum's first entry not yet placed in a piece
  SparseVector slice, top;
  for (const BucketPiece& p : pieces_) {
    slice.clear();
    while (j < sum.size() && sum.indices[j] < p.end) {
      slice.indices.push_back(sum.indices[j]);
      slice.values.push_back(sum.values[j]);
      ++j;
    }
    GTOPK_RETURN_IF_ERROR(
        SelectPiece(slice, PieceK(k, p.size(), options_.n), &top));
    selected->indices.insert(selected->indices.end(), top.indices.begin(),
                             top.indices.end());
    selected->values.insert(selected->values.end(), top.values.begin(),
                            top.values.end());
  }
  return absl::OkStatus();
}

absl::Status ShardAggregator::ValidatePart(const WorkerPush& part) const {
  const std::string who =
      absl::StrCat("worker ", part.worker, " step ", part.step, " to shard ",
                   options_.shard_id, ": ");
  if (!part.is_part()) return ValidatePush(part);
  if (pieces_.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat(who, "a push in parts (pieces [", part.piece_begin, ", ",
                     part.piece_end,
                     ")) needs a layer-wise cluster with pieces on this "
                     "shard; this one ",
                     options_.selection == SelectionKind::kLayerwise
                         ? "owns an empty range"
                         : "does not run --selection=layerwise",
                     " (send the whole push in one message)"));
  }
  const size_t m = pieces_.size();
  WorkerPush whole_checks;  // Submit's checks but the bound and the range
  whole_checks.worker = part.worker;
  whole_checks.step = part.step;
  whole_checks.buffers = part.buffers;
  whole_checks.dense = part.dense;
  GTOPK_RETURN_IF_ERROR(ValidatePush(whole_checks));
  if (part.piece_begin >= part.piece_end || part.piece_end > m) {
    return absl::InvalidArgumentError(absl::StrCat(
        who, "part of pieces [", part.piece_begin, ", ", part.piece_end,
        ") is empty or outside the shard's ", m, " pieces [0, ", m, ")"));
  }
  if (!part.buffers.empty() && part.piece_begin != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        who, "buffers (", part.buffers.size(),
        " bytes) go only in the part holding piece 0; this part holds "
        "pieces [",
        part.piece_begin, ", ", part.piece_end, ")"));
  }
  absl::Status s = ValidateSparseVector(part.sparse, options_.n);
  if (!s.ok())
    return absl::InvalidArgumentError(who + std::string(s.message()));
  const uint64_t lo = pieces_[part.piece_begin].begin;
  const uint64_t hi = pieces_[part.piece_end - 1].end;
  if (!part.sparse.empty() &&
      (part.sparse.indices.front() < lo || part.sparse.indices.back() >= hi)) {
    const uint32_t bad = part.sparse.indices.front() < lo
                             ? part.sparse.indices.front()
                             : part.sparse.indices.back();
    return absl::InvalidArgumentError(absl::StrCat(
        who, "index ", bad, " is outside the part's pieces [", part.piece_begin,
        ", ", part.piece_end, "), values [", lo, ", ", hi, ")"));
  }
  absl::StatusOr<uint64_t> k =
      rule_.KAt(std::max<int64_t>(part.step, 0), options_.n);
  const uint64_t target = k.ok() ? *k : options_.n;
  size_t j = 0;
  for (size_t i = part.piece_begin; i < part.piece_end; ++i) {
    const BucketPiece& p = pieces_[i];
    size_t count = 0;
    while (j < part.sparse.size() && part.sparse.indices[j] < p.end) {
      ++count;
      ++j;
    }
    const uint64_t kp = PieceK(target, p.size(), options_.n);
    const uint64_t most = std::min<uint64_t>(
        p.size(),
        std::max(options_.max_pairs_for_k ? options_.max_pairs_for_k(kp) : kp,
                 kp));
    if (count > most) {
      return absl::ResourceExhaustedError(
          absl::StrCat(who, "piece ", i, " [", p.begin, ", ", p.end, ") has ",
                       count, " pairs; its k at this step allows at most ",
                       most, " (docs/resource-limits.md)"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<const RoundResult>> ShardAggregator::SubmitPart(
    WorkerPush part, absl::Time deadline, RoundTicket* ticket) {
  if (pieces_.empty() && !part.is_part()) {
    return Submit(std::move(part), deadline);
  }
  const uint32_t w = part.worker;
  const int64_t step = part.step;
  const uint64_t epoch = part.epoch;
  const absl::Status valid = ValidatePart(part);
  absl::MutexLock lock(&mu_);
  if (ticket != nullptr && ticket->round != nullptr && ticket->step == step &&
      epoch <= ticket->epoch) {
    // A later part of the attempt whose earlier parts joined that round:
    // when it failed meanwhile, so does this part (a fresh round would
    // lack the earlier parts).
    const auto* earlier =
        static_cast<const AggregationRound*>(ticket->round.get());
    if (earlier->finished && !earlier->status.ok()) return earlier->status;
  }
  std::shared_ptr<AggregationRound> round;
  std::vector<size_t> ready;
  if (std::optional<Answer> answer =
          JoinRoundLocked(std::move(part), valid, &round, &ready)) {
    return *std::move(answer);
  }
  if (ticket != nullptr) *ticket = RoundTicket{round, step, epoch};
  RunPiecesLocked(round, ready);
  if (round->finished) {
    if (!round->status.ok()) return round->status;
    return round->result;
  }
  if (!round->pieces->complete(w)) {
    return std::shared_ptr<const RoundResult>();  // more parts to come
  }
  if (round->pieces->all_done() && round->count == options_.num_workers &&
      !round->computing) {
    return ComputeRoundLocked(round, deadline);
  }
  return AwaitRoundLocked(round, deadline);
}

std::optional<ShardAggregator::Answer> ShardAggregator::JoinPiecesLocked(
    WorkerPush push, std::shared_ptr<AggregationRound>* out,
    std::vector<size_t>* ready) {
  const uint32_t w = push.worker;
  if (pending_ != nullptr && !pending_->computing &&
      pending_->pieces->touched(w) && push.epoch > pending_->pushes[w].epoch) {
    // The worker's retry of a failed attempt (it recovered since): the
    // round holding its older parts cannot complete any more.
    FailRoundLocked(pending_,
                    absl::AbortedError(absl::StrCat(
                        "step ", push.step, " on shard ", options_.shard_id,
                        ": worker ", w, " retries the step (attempt epoch ",
                        push.epoch, "); its earlier attempt failed")));
  }
  if (pending_ == nullptr) {
    if (std::optional<Answer> refused = OpenRoundLocked(push.step)) {
      return refused;
    }
  }
  std::shared_ptr<AggregationRound> round = pending_;
  const std::string who = absl::StrCat("worker ", w, " step ", push.step, ": ");
  if (round->pieces->touched(w)) {
    if (round->computing) {
      // Every push is complete and the round's pushes are taken: a whole
      // retry waits for its result; a part is a leftover, refused alone.
      if (!push.is_part()) {
        *out = std::move(round);
        return std::nullopt;
      }
      return absl::AbortedError(absl::StrCat(
          who,
          "a part after the worker's push was complete (a leftover of "
          "a failed attempt): refused, the step goes on without it"));
    }
    if (std::optional<Answer> stale = RefuseStaleLocked(push, *round, who)) {
      return stale;
    }
    if (!push.is_part()) {
      round = RetryWholeLocked(w, std::move(round));
      if (round == nullptr) {
        if (std::optional<Answer> refused = OpenRoundLocked(push.step)) {
          return refused;
        }
        round = pending_;
      } else if (round->pieces->complete(w)) {
        *out = std::move(round);  // a retry: the same round's result
        return std::nullopt;
      }
    }
  }
  PieceRound& pieces = *round->pieces;
  if (round->computing) {
    const absl::Status late = absl::InvalidArgumentError(
        absl::StrCat(who, "a part after the worker's push was complete"));
    FailStepLocked(push.step, w, late);
    return late;
  }
  const bool first = !pieces.touched(w);
  if (!first && push.params_checksum != round->pushes[w].params_checksum) {
    const absl::Status differs = absl::InvalidArgumentError(
        absl::StrCat(who, "a part with params_checksum ", push.params_checksum,
                     " after parts with ", round->pushes[w].params_checksum,
                     " (every part of a step carries the same one)"));
    FailStepLocked(push.step, w, differs);
    return differs;
  }
  const size_t b = push.is_part() ? push.piece_begin : 0;
  const size_t e = push.is_part() ? push.piece_end : pieces.num_pieces();
  const absl::Status added =
      pieces.Add(pieces_, w, b, e, std::move(push.sparse), ready);
  if (!added.ok()) {
    const absl::Status bad =
        absl::InvalidArgumentError(absl::StrCat(who, added.message()));
    FailStepLocked(push.step, w, bad);
    return bad;
  }
  if (first) {
    round->pushes[w] = std::move(push);  // the metadata; entries moved out
  } else if (!push.buffers.empty()) {
    round->pushes[w].buffers = std::move(push.buffers);
  }
  if (pieces.complete(w)) {
    round->arrived[w] = true;
    ++round->count;
    round->completed = absl::Now();
  }
  *out = std::move(round);
  return std::nullopt;
}

std::optional<ShardAggregator::Answer> ShardAggregator::RefuseStaleLocked(
    const WorkerPush& push, const AggregationRound& round,
    const std::string& who) const {
  const WorkerPush& in = round.pushes[push.worker];
  // A push of an earlier attempt than the worker's pushes in the round
  // (the leader numbers every failure; a worker's epoch never goes down),
  // or a part after the worker's whole push of the same attempt (a worker
  // pushes whole only to retry a step): a leftover of the failed attempt,
  // e.g. read after a stalled shard resumed. Refused alone: the round of
  // the retry goes on.
  if (push.epoch < in.epoch || (push.is_part() && !in.is_part())) {
    return absl::AbortedError(absl::StrCat(
        who, "a leftover of a failed attempt (",
        push.is_part() ? "a part" : "a whole push", " of epoch ", push.epoch,
        ") after the worker's ", in.is_part() ? "parts" : "whole push",
        " of epoch ", in.epoch, ": refused, the step goes on without it"));
  }
  return std::nullopt;
}

std::shared_ptr<ShardAggregator::AggregationRound>
ShardAggregator::RetryWholeLocked(uint32_t w,
                                  std::shared_ptr<AggregationRound> round) {
  PieceRound& pieces = *round->pieces;
  if (round->computing || (pieces.complete(w) && pieces.any_started(w))) {
    return round;  // the same round's result (complete(w) holds)
  }
  if (pieces.any_started(w)) {
    // Piece rounds already took some of its earlier parts: the round
    // cannot take the retry instead, so it fails for everyone (ABORTED, as
    // for a newer epoch) and the retry opens a fresh one.
    FailRoundLocked(round, absl::AbortedError(absl::StrCat(
                               "step ", round->step, " on shard ",
                               options_.shard_id, ": worker ", w,
                               " retries the step whole; its earlier "
                               "parts' piece rounds ran already")));
    return nullptr;
  }
  // The worker pushes the whole step again before any of its pieces
  // started (a retry, also after parts of the same attempt epoch: a shard
  // that missed the step's failure): its newest push is its contribution
  // (as Submit).
  if (pieces.complete(w)) {
    round->arrived[w] = false;
    --round->count;
  }
  pieces.Drop(w);
  return round;
}

void ShardAggregator::RunPiecesLocked(
    const std::shared_ptr<AggregationRound>& round,
    const std::vector<size_t>& ready) {
  if (ready.empty()) return;
  absl::StatusOr<uint64_t> k = rule_.KAt(round->step, options_.n);
  const uint64_t target = k.ok() ? *k : options_.n;
  for (const size_t i : ready) {
    if (round->finished) return;
    std::vector<SparseVector> inputs = round->pieces->TakeInputs(i);
    const BucketPiece& p = pieces_[i];
    auto result = std::make_shared<PieceResult>();
    mu_.Unlock();
    const absl::Status st = SumAndSelectPiece(
        inputs, options_.n, PieceK(target, p.size(), options_.n),
        &result->selected, &result->merge_time, &result->select_time);
    mu_.Lock();
    if (round->finished) return;  // failed meanwhile (or rolled back)
    if (!st.ok()) {
      const absl::Status bad = StepNotFinite(
          absl::StrCat("the sum of the workers' pushes (", st.message(), ")"));
      NotifyStepFailedLocked(round->step, bad);
      FailRoundLocked(
          round,
          absl::Status(bad.code(),
                       absl::StrCat("step ", round->step, " failed on shard ",
                                    options_.shard_id, ": ", bad.message())));
      return;
    }
    round->pieces->SetResult(i, std::move(result));
    cv_.SignalAll();
  }
}

ShardAggregator::Answer ShardAggregator::AssemblePieces(
    AggregationRound& round, std::vector<WorkerPush>& pushes) const {
  auto result = std::make_shared<RoundResult>();
  result->step = round.step;
  if (options_.apply == ApplyMode::kWorkers && options_.shard_id == 0) {
    result->buffers = std::move(pushes[0].buffers);
  }
  result->opened = round.opened;
  // How long the round waited for its slowest worker's last part.
  result->wait_time = round.completed - round.opened;
  for (size_t i = 0; i < round.pieces->num_pieces(); ++i) {
    const PieceResult& r = *round.pieces->result(i);
    result->selected.indices.insert(result->selected.indices.end(),
                                    r.selected.indices.begin(),
                                    r.selected.indices.end());
    result->selected.values.insert(result->selected.values.end(),
                                   r.selected.values.begin(),
                                   r.selected.values.end());
    result->merge_time += r.merge_time;
    result->select_time += r.select_time;
  }
  GTOPK_RETURN_IF_ERROR(
      EncodeSparse(result->selected, options_.n,
                   CodecSpec{options_.pull_index_codec, ValueCodec::kFp32},
                   &result->encoded));
  return result;
}

absl::StatusOr<
    std::vector<std::pair<size_t, std::shared_ptr<const PieceResult>>>>
ShardAggregator::AwaitPieces(const RoundTicket& ticket, PiecesSent* sent,
                             absl::Time deadline, absl::Time wake) {
  std::vector<std::pair<size_t, std::shared_ptr<const PieceResult>>> out;
  if (ticket.round == nullptr) {
    return absl::FailedPreconditionError("AwaitPieces: no round");
  }
  // The ticket keeps the round alive; its fields are guarded by mu_.
  auto* round = const_cast<AggregationRound*>(
      static_cast<const AggregationRound*>(ticket.round.get()));
  absl::MutexLock lock(&mu_);
  while (true) {
    if (round->finished && !round->status.ok()) return round->status;
    // Once computing (or finished), every piece is done and kept. The
    // pieces finished since the last call, from the round's log (one pass
    // over every piece per call was quadratic in the pieces: a call per
    // finished run).
    const absl::Span<const size_t> finished = round->pieces->finished();
    for (; sent->count < finished.size(); ++sent->count) {
      const size_t i = finished[sent->count];
      out.emplace_back(i, round->pieces->result(i));
    }
    if (!out.empty()) {
      std::sort(out.begin(), out.end(),
                [](const auto& a, const auto& b) { return a.first < b.first; });
      return out;
    }
    if (sent->all(round->pieces->num_pieces()) || absl::Now() >= wake) {
      return out;
    }
    cv_.WaitWithDeadline(&mu_, std::min(deadline, wake));
    if (absl::Now() >= deadline && !round->finished && !round->computing) {
      std::vector<size_t> waiting = round->pieces->Waiting(8);
      const absl::Status late = absl::DeadlineExceededError(absl::StrCat(
          "step ", round->step, " timed out on shard ", options_.shard_id,
          " waiting for the parts of piece(s) ", absl::StrJoin(waiting, ", ")));
      NotifyStepFailedLocked(round->step, late);
      FailRoundLocked(std::shared_ptr<AggregationRound>(ticket.round, round),
                      late);
    }
  }
}

}  // namespace server
}  // namespace gtopk
