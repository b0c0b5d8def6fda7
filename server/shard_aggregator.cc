#include "server/shard_aggregator.h"

#include <algorithm>
#include <cmath>
#include <new>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/merge.h"
#include "common/status_macros.h"

namespace gtopk {
namespace server {

std::pair<uint64_t, uint64_t> ShardRange(uint64_t n, uint32_t num_shards,
                                         uint32_t shard_id) {
  // n <= 2^32 and S < 2^32, so the products fit in 64 bits.
  return {n * shard_id / num_shards, n * (shard_id + uint64_t{1}) / num_shards};
}

absl::Status ValidateShardOptions(const ShardOptions& o) {
  if (o.num_shards < 1) {
    return absl::InvalidArgumentError("num_shards must be >= 1");
  }
  if (o.shard_id >= o.num_shards) {
    return absl::InvalidArgumentError(absl::StrCat(
        "shard_id ", o.shard_id, " must be < num_shards ", o.num_shards));
  }
  if (o.n < 1 || o.n > kMaxDenseLength) {
    return absl::InvalidArgumentError(
        absl::StrCat("n must be in [1, 2^32], got ", o.n));
  }
  if (o.num_workers < 1) return absl::InvalidArgumentError("num_workers < 1");
  if (o.selection == SelectionKind::kLayerwise &&
      (o.mode != AggregationMode::kGtopk || o.bucket_size == 0)) {
    return absl::InvalidArgumentError(
        "layer-wise selection needs mode gtopk and a bucket size >= 1");
  }
  if (o.step_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat("step_timeout must be > 0, got ",
                     absl::FormatDuration(o.step_timeout)));
  }
  return ValidateOptimizerOptions(o.optimizer);
}

absl::StatusOr<std::unique_ptr<ShardAggregator>> ShardAggregator::Create(
    const ShardOptions& options, ThresholdExchange* exchange,
    CommitVoter* commit) {
  GTOPK_RETURN_IF_ERROR(ValidateShardOptions(options));
  if (options.mode == AggregationMode::kGtopk &&
      options.selection == SelectionKind::kThreshold &&
      options.num_shards > 1 && exchange == nullptr) {
    return absl::InvalidArgumentError(
        "gtopk + exact with more than one shard needs a threshold exchange");
  }
  GTOPK_ASSIGN_OR_RETURN(OptimizerRule rule,
                         OptimizerRule::Create(options.optimizer));
  return std::unique_ptr<ShardAggregator>(
      new ShardAggregator(options, std::move(rule), exchange, commit));
}

ShardAggregator::ShardAggregator(const ShardOptions& options,
                                 OptimizerRule rule,
                                 ThresholdExchange* exchange,
                                 CommitVoter* commit)
    : options_(options),
      rule_(std::move(rule)),
      exchange_(exchange),
      commit_(commit),
      begin_(ShardRange(options.n, options.num_shards, options.shard_id).first),
      end_(ShardRange(options.n, options.num_shards, options.shard_id).second) {
  if (options.selection == SelectionKind::kLayerwise) {
    // Validated by Create: n >= 1, bucket_size >= 1; the cut cannot fail
    // but for more than 2^24 buckets, which then count as one.
    absl::StatusOr<std::vector<BucketPiece>> all =
        CutBucketPieces(options.n, options.bucket_size, {begin_, end_});
    if (all.ok()) {
      for (const size_t i : PiecesIn(*all, begin_, end_)) {
        pieces_.push_back((*all)[i]);
      }
    } else if (begin_ < end_) {
      pieces_.push_back(BucketPiece{begin_, end_, 0});
    }
    for (const BucketPiece& p : pieces_) ++piece_sizes_[p.size()];
  }
}

absl::StatusOr<bool> ShardAggregator::InitParams(absl::Span<const float> values,
                                                 std::string state) {
  if (values.size() != end_ - begin_) {
    return absl::InvalidArgumentError(absl::StrCat(
        "shard ", options_.shard_id, " owns ", end_ - begin_, " parameters [",
        begin_, ", ", end_, "), got ", values.size()));
  }
  GTOPK_RETURN_IF_ERROR(ValidateFinite(values, "initial parameters"));
  std::shared_ptr<const std::string> blob;
  try {
    blob = std::make_shared<const std::string>(std::move(state));
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError(
        absl::StrCat("shard ", options_.shard_id,
                     " cannot hold the state blob: out of "
                     "memory"));
  }
  absl::MutexLock lock(&mu_);
  if (initialized_) return false;
  try {
    params_.assign(values.begin(), values.end());
    if (options_.optimizer.momentum_mode == MomentumMode::kGlobal) {
      global_velocity_.assign(values.size(), 0.0f);
    }
  } catch (const std::bad_alloc&) {
    // Nothing half-taken: the shard stays uninitialised.
    std::vector<float>().swap(params_);
    std::vector<float>().swap(global_velocity_);
    return absl::ResourceExhaustedError(absl::StrCat(
        "shard ", options_.shard_id, " cannot hold its ", values.size(),
        " parameters [", begin_, ", ", end_, ") (",
        values.size() * sizeof(float), " bytes each for the parameters",
        options_.optimizer.momentum_mode == MomentumMode::kGlobal
            ? " and the global velocity"
            : "",
        "): out of memory"));
  }
  state_ = std::move(blob);
  initialized_ = true;
  cv_.SignalAll();
  return true;
}

absl::Status ShardAggregator::AwaitInitializedLocked(
    absl::Time deadline) const {
  while (!initialized_) {
    if (!closed_.ok()) return closed_;
    if (cv_.WaitWithDeadline(&mu_, deadline) && !initialized_) {
      return absl::DeadlineExceededError(
          absl::StrCat("shard ", options_.shard_id,
                       " has no parameters yet (worker 0 initialises them)"));
    }
  }
  return absl::OkStatus();
}

absl::Status ShardAggregator::AwaitInitialized(absl::Time deadline) const {
  absl::MutexLock lock(&mu_);
  return AwaitInitializedLocked(deadline);
}

absl::StatusOr<ShardAggregator::State> ShardAggregator::GetState(
    absl::Time deadline) const {
  absl::MutexLock lock(&mu_);
  GTOPK_RETURN_IF_ERROR(AwaitInitializedLocked(deadline));
  State state;
  try {
    state.params = params_;
    state.global_velocity = global_velocity_;
  } catch (const std::bad_alloc&) {
    // A download's or checkpoint's copy of the range: refused, retryable
    // once memory is free again; nothing changed.
    return absl::ResourceExhaustedError(absl::StrCat(
        "shard ", options_.shard_id, " cannot copy its ", params_.size(),
        " parameters (", params_.size() * sizeof(float),
        " bytes) for a download or checkpoint: out of memory; retry later"));
  }
  state.next_step = next_step_;
  state.state = state_;
  return state;
}

absl::StatusOr<std::pair<std::vector<float>, int64_t>> ShardAggregator::Params(
    absl::Time deadline) const {
  GTOPK_ASSIGN_OR_RETURN(State state, GetState(deadline));
  return std::make_pair(std::move(state.params), state.next_step);
}

void ShardAggregator::SetStepAppliedCallback(
    std::function<void(int64_t)> callback) {
  absl::MutexLock lock(&mu_);
  on_step_applied_ = std::move(callback);
}

int64_t ShardAggregator::next_step() const {
  absl::MutexLock lock(&mu_);
  return next_step_;
}

uint64_t ShardAggregator::MaxPushPairs(int64_t step) const {
  absl::StatusOr<uint64_t> k =
      rule_.KAt(std::max<int64_t>(step, 0), options_.n);
  // KAt fails only for options Create already validated; be generous.
  const uint64_t target = k.ok() ? *k : options_.n;
  if (options_.selection == SelectionKind::kLayerwise &&
      options_.mode == AggregationMode::kGtopk) {
    uint64_t total = 0;
    for (const auto& [size, count] : piece_sizes_) {
      const uint64_t kp = PieceK(target, size, options_.n);
      const uint64_t most =
          options_.max_pairs_for_k ? options_.max_pairs_for_k(kp) : kp;
      total += count * std::min<uint64_t>(size, std::max(most, kp));
    }
    return total;
  }
  const uint64_t most =
      options_.max_pairs_for_k ? options_.max_pairs_for_k(target) : target;
  return std::min<uint64_t>(end_ - begin_, std::max(most, target));
}

absl::Status ShardAggregator::PushPairsExhausted(uint32_t worker, int64_t step,
                                                 uint64_t pairs,
                                                 uint64_t most) const {
  return absl::ResourceExhaustedError(absl::StrCat(
      "worker ", worker, " step ", step, ": push of ", pairs,
      " pairs refused: shard ", options_.shard_id, " accepts at most ", most,
      " pairs per worker and step (the bound on memory per step: k at this "
      "step from --density/--density-warmup and --selector's most per k, "
      "within the shard's range of ",
      end_ - begin_, "; docs/resource-limits.md)"));
}

absl::Status ShardAggregator::ValidatePush(const WorkerPush& push) const {
  if (push.worker >= options_.num_workers) {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown worker rank ", push.worker, "; the cluster has ",
                     options_.num_workers, " workers"));
  }
  const std::string who =
      absl::StrCat("worker ", push.worker, " step ", push.step, ": ");
  if (!push.buffers.empty()) {
    if (options_.apply != ApplyMode::kWorkers) {
      return absl::InvalidArgumentError(absl::StrCat(
          who, "buffers (", push.buffers.size(),
          " bytes) are relayed only with --apply=workers; this cluster "
          "runs --apply=servers"));
    }
    if (push.worker != 0 || options_.shard_id != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          who, "buffers (", push.buffers.size(),
          " bytes) come only from worker 0 and go only to shard 0; this "
          "push is from worker ",
          push.worker, " to shard ", options_.shard_id));
    }
  }
  if (options_.mode == AggregationMode::kDense) {
    if (!push.sparse.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat(who, "sparse entries sent in dense mode"));
    }
    if (push.dense.size() != end_ - begin_) {
      return absl::InvalidArgumentError(absl::StrCat(
          who, "dense push has ", push.dense.size(), " values, shard ",
          options_.shard_id, " owns ", end_ - begin_));
    }
    absl::Status s = ValidateFinite(push.dense, "dense push");
    if (!s.ok())
      return absl::InvalidArgumentError(who + std::string(s.message()));
    return absl::OkStatus();
  }
  if (!push.dense.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(who, "dense values sent in ",
                     AggregationModeName(options_.mode), " mode"));
  }
  if (const uint64_t most = MaxPushPairs(push.step);
      push.sparse.size() > most) {
    return PushPairsExhausted(push.worker, push.step, push.sparse.size(), most);
  }
  absl::Status s = ValidateSparseVector(push.sparse, options_.n);
  if (!s.ok())
    return absl::InvalidArgumentError(who + std::string(s.message()));
  if (!push.sparse.empty() && (push.sparse.indices.front() < begin_ ||
                               push.sparse.indices.back() >= end_)) {
    const uint32_t bad = push.sparse.indices.front() < begin_
                             ? push.sparse.indices.front()
                             : push.sparse.indices.back();
    return absl::InvalidArgumentError(
        absl::StrCat(who, "index ", bad, " is outside shard ",
                     options_.shard_id, "'s range [", begin_, ", ", end_, ")"));
  }
  return absl::OkStatus();
}

void ShardAggregator::FailRoundLocked(
    const std::shared_ptr<AggregationRound>& round, absl::Status status) {
  round->finished = true;
  round->status = std::move(status);
  if (pending_ == round) pending_.reset();
  cv_.SignalAll();
}

void ShardAggregator::FailStepLocked(int64_t step, uint32_t /*worker*/,
                                     const absl::Status& reason) {
  // A bad push for the current step fails the round for every worker waiting
  // in it. Workers that arrive later start a new round of the same step (a
  // retry), which completes once every worker, the culprit included, has
  // pushed again, or fails at its deadline naming who is missing. (Telling
  // late arrivals of an old failure instead made retries after a partial
  // push -- a worker that died after pushing to some shards -- fail again
  // and again on alternating shards.)
  if (step != next_step_) return;
  // The other shards fail their rounds of the step too (fail fast), even
  // when no round is open here yet: the culprit's step cannot complete.
  NotifyStepFailedLocked(step, reason);
  if (pending_ == nullptr || pending_->computing) return;
  FailRoundLocked(pending_, absl::AbortedError(absl::StrCat(
                                "step ", step, " failed on shard ",
                                options_.shard_id, ": ", reason.message())));
}

void ShardAggregator::NotifyStepFailedLocked(int64_t step,
                                             const absl::Status& reason) {
  if (on_step_failed_) on_step_failed_(step, reason);
}

void ShardAggregator::SetStepFailedCallback(
    std::function<void(int64_t, const absl::Status&)> callback) {
  absl::MutexLock lock(&mu_);
  on_step_failed_ = std::move(callback);
}

uint64_t ShardAggregator::AbortEpoch(int64_t step) const {
  absl::MutexLock lock(&mu_);
  auto it = aborted_.find(step);
  return it == aborted_.end() ? 0 : it->second.first;
}

void ShardAggregator::AbortStep(int64_t step, const absl::Status& reason,
                                uint64_t epoch) {
  absl::MutexLock lock(&mu_);
  if (step < next_step_) return;  // applied: the message is stale
  auto& tomb = aborted_[step];
  if (epoch >= tomb.first) tomb = {epoch, reason};
  while (aborted_.size() > 4) aborted_.erase(aborted_.begin());
  if (pending_ == nullptr || pending_->step != step) return;
  if (pending_->computing) {
    if (pending_->epoch < epoch && pending_->aborted.ok()) {
      pending_->aborted = reason;
    }
    return;
  }
  for (uint32_t w = 0; w < options_.num_workers; ++w) {
    const bool in = pending_->arrived[w] || (pending_->pieces != nullptr &&
                                             pending_->pieces->touched(w));
    if (in && pending_->pushes[w].epoch < epoch) {
      // The failure may follow from this round's own wait (a shard whose
      // threshold exchange gave up on this one first): name whom it awaits.
      FailRoundLocked(pending_,
                      pending_->WithMissing(options_.shard_id, reason));
      return;
    }
  }
}

void ShardAggregator::RejectPush(int64_t step, uint32_t worker,
                                 const absl::Status& reason) {
  absl::MutexLock lock(&mu_);
  FailStepLocked(step, worker, reason);
}

bool ShardAggregator::AbandonPush(int64_t step, uint32_t worker, uint64_t epoch,
                                  const absl::Status& reason) {
  absl::MutexLock lock(&mu_);
  auto dead = aborted_.find(step);  // that attempt failed already?
  const bool current = dead == aborted_.end() || epoch >= dead->second.first;
  if (current) FailStepLocked(step, worker, reason);
  return current;
}

std::optional<int64_t> ShardAggregator::RoundAwaiting(uint32_t worker) const {
  absl::MutexLock lock(&mu_);
  if (pending_ == nullptr || pending_->computing ||
      worker >= pending_->arrived.size() || pending_->arrived[worker]) {
    return std::nullopt;
  }
  return pending_->step;
}

absl::StatusOr<std::shared_ptr<const RoundResult>> ShardAggregator::Submit(
    WorkerPush push, absl::Time deadline) {
  // Layer-wise: every push (whole or in parts) joins the per-piece rounds.
  if (!pieces_.empty() || push.is_part()) {
    return SubmitPart(std::move(push), deadline, nullptr);
  }
  const absl::Status valid = ValidatePush(push);
  absl::MutexLock lock(&mu_);
  std::shared_ptr<AggregationRound> round;
  if (std::optional<Answer> answer =
          JoinRoundLocked(std::move(push), valid, &round, nullptr)) {
    return *std::move(answer);
  }
  if (round->count == options_.num_workers && !round->computing) {
    return ComputeRoundLocked(round, deadline);
  }
  return AwaitRoundLocked(round, deadline);
}

std::optional<ShardAggregator::Answer> ShardAggregator::JoinRoundLocked(
    WorkerPush push, const absl::Status& valid,
    std::shared_ptr<AggregationRound>* out, std::vector<size_t>* ready) {
  const uint32_t w = push.worker;
  if (!closed_.ok()) return closed_;
  if (!initialized_) {
    return absl::FailedPreconditionError(absl::StrCat(
        "shard ", options_.shard_id,
        " has no parameters yet; worker 0 must initialise them first"));
  }
  if (!valid.ok()) {
    FailStepLocked(push.step, w, valid);
    return valid;
  }
  if (push.step < 0) {
    // A bad push like any other: the worker's round of the current step
    // cannot complete, so it fails for everyone, on every shard.
    const absl::Status negative = absl::InvalidArgumentError(
        absl::StrCat("worker ", w, ": step ", push.step, " is negative"));
    FailStepLocked(next_step_, w, negative);
    return negative;
  }
  if (push.step < next_step_) {
    if (last_ != nullptr && last_->step == push.step && !push.is_part()) {
      return last_->result;
    }
    // A worker that lost a committed step's result (its Recover said the
    // shards are one step ahead) gets it again only from last_, which a
    // restart or a rollback drops; kResultNotKeptMarker tells its client.
    return absl::FailedPreconditionError(absl::StrCat(
        "step ", push.step, " was already applied; shard ", options_.shard_id,
        " is at step ", next_step_, " and ", kResultNotKeptMarker,
        " (it keeps its last committed step's only, not across a restart "
        "or a rollback): this worker missed that step's update"));
  }
  if (push.step > next_step_) {
    return absl::FailedPreconditionError(
        absl::StrCat("step ", push.step, " is ahead of shard ",
                     options_.shard_id, ", which is at step ", next_step_));
  }
  if (auto dead = aborted_.find(push.step);
      dead != aborted_.end() && push.epoch < dead->second.first) {
    // A push of the attempt that failed (the worker has not recovered
    // since): it must not join, or complete, the retry's round.
    return dead->second.second;
  }
  if (!pieces_.empty()) return JoinPiecesLocked(std::move(push), out, ready);
  if (pending_ == nullptr) {
    if (std::optional<Answer> refused = OpenRoundLocked(push.step)) {
      return refused;
    }
  }
  std::shared_ptr<AggregationRound> round = pending_;
  if (!round->arrived[w]) {
    round->arrived[w] = true;
    round->pushes[w] = std::move(push);
    ++round->count;
  } else if (!round->computing) {
    // The worker pushes the step again: it saw the step fail elsewhere and
    // retries, with what its residual holds now (more than before: a
    // failed attempt puts everything back). The newest push is its
    // contribution, so the round equals a fresh round of the retry.
    round->pushes[w] = std::move(push);
  }  // else: being computed; a retry waits for the same round
  *out = std::move(round);
  return std::nullopt;
}

std::optional<ShardAggregator::Answer> ShardAggregator::OpenRoundLocked(
    int64_t step) {
  if (!draining_.ok()) {
    // This shard will not run the step: the others need not wait for it.
    NotifyStepFailedLocked(step, draining_);
    return draining_;
  }
  pending_ = std::make_shared<AggregationRound>();
  pending_->step = step;
  pending_->arrived.assign(options_.num_workers, false);
  pending_->pushes.resize(options_.num_workers);
  if (!pieces_.empty()) {
    pending_->pieces =
        std::make_unique<PieceRound>(pieces_.size(), options_.num_workers);
  }
  return std::nullopt;
}

ShardAggregator::Answer ShardAggregator::ComputeRoundLocked(
    const std::shared_ptr<AggregationRound>& round, absl::Time deadline) {
  round->computing = true;
  const uint64_t generation = rollback_generation_;
  for (const WorkerPush& p : round->pushes) {
    round->epoch = std::min(round->epoch, p.epoch);
  }
  std::vector<WorkerPush> pushes = std::move(round->pushes);
  mu_.Unlock();
  bool failed_here = false;
  Answer result = ComputeAndVote(*round, pushes, deadline, &failed_here);
  mu_.Lock();
  if (generation != rollback_generation_) {
    // Rolled back while computing: Rollback failed the round already; the
    // result belongs to an abandoned step and must not be applied.
    return round->status;
  }
  absl::Status status = result.status();
  if (status.ok() && options_.apply == ApplyMode::kServers) {
    // CheckUpdateFinite passed on this state before the vote; only a
    // rollback changes params_ meanwhile, and that returned above.
    const RoundResult& r = **result;
    if (options_.mode == AggregationMode::kDense) {
      rule_.StoreAggregatedDense(
          r.dense_sum, static_cast<int>(options_.num_workers),
          absl::MakeSpan(params_), absl::MakeSpan(global_velocity_));
    } else {
      rule_.StoreAggregated(
          r.selected, begin_, static_cast<int>(options_.num_workers),
          absl::MakeSpan(params_), absl::MakeSpan(global_velocity_));
    }
  }
  if (!status.ok()) {
    if (failed_here) NotifyStepFailedLocked(round->step, status);
    FailRoundLocked(
        round,
        absl::Status(status.code(),
                     absl::StrCat("step ", round->step, " failed on shard ",
                                  options_.shard_id, ": ", status.message())));
    return round->status;
  }
  round->result = *std::move(result);
  round->status = absl::OkStatus();
  round->finished = true;
  ++next_step_;
  last_ = round;
  pending_.reset();
  cv_.SignalAll();
  if (on_step_applied_) {
    const int64_t applied_next = next_step_;
    auto callback = on_step_applied_;
    mu_.Unlock();
    callback(applied_next);
    mu_.Lock();
  }
  return round->result;
}

ShardAggregator::Answer ShardAggregator::ComputeAndVote(
    AggregationRound& round, std::vector<WorkerPush>& pushes,
    absl::Time deadline, bool* failed_here) {
  // The divergence alarm first: nothing is exchanged, voted or applied for
  // a step whose replicas differ. Every shard sees the same checksums (a
  // worker sends one value to all), so every shard fails the step with the
  // same verdict.
  const absl::Status diverged = CheckChecksums(pushes, round.step);
  Answer result =
      !diverged.ok() ? Answer(diverged)
      : round.pieces != nullptr
          ? AssemblePieces(round, pushes)
          : Compute(pushes, round.step, round.opened, deadline, round.epoch);
  // A failure of this shard's own computation is news to the others; an
  // ABORTED one came from the leader (the exchange was fenced or failed by
  // another shard).
  *failed_here = !result.ok() && !absl::IsAborted(result.status());
  if (result.ok() && options_.apply == ApplyMode::kServers) {
    // (Under kWorkers the shard applies nothing; Compute refused a sum that
    // is not finite.)
    // Before the vote: a shard whose update would not stay finite does not
    // vote, so no shard applies the step (the apply then stores exactly the
    // values checked here), and it tells the others.
    const absl::Status finite = CheckUpdateFinite(**result);
    if (!finite.ok()) {
      result = finite;
      *failed_here = true;
    }
  }
  if (result.ok()) {
    absl::MutexLock check(&mu_);
    // The leader said the step failed elsewhere (AbortStep) while this
    // shard computed it: do not vote for it.
    if (!round.aborted.ok()) result = round.aborted;
  }
  if (result.ok() && commit_ != nullptr && options_.num_shards > 1) {
    // Apply only once every shard has computed this step.
    absl::Status vote =
        commit_->Vote(round.step, options_.shard_id, deadline, round.epoch);
    if (!vote.ok()) result = vote;
  }
  return result;
}

ShardAggregator::Answer ShardAggregator::AwaitRoundLocked(
    const std::shared_ptr<AggregationRound>& round, absl::Time deadline) {
  while (!round->finished) {
    if (!closed_.ok() && !round->computing) {
      NotifyStepFailedLocked(round->step, closed_);
      FailRoundLocked(round, closed_);
      break;
    }
    const bool timed_out = cv_.WaitWithDeadline(&mu_, deadline);
    if (round->finished) break;
    if (timed_out && !round->computing) {
      const absl::Status late = absl::DeadlineExceededError(absl::StrCat(
          "step ", round->step, " timed out on shard ", options_.shard_id,
          " waiting for worker(s) ", absl::StrJoin(round->Missing(), ", ")));
      NotifyStepFailedLocked(round->step, late);
      FailRoundLocked(round, late);
    }
    // While a round is computing, its computing caller is bounded by its own
    // deadline; keep waiting for it.
  }
  if (!round->status.ok()) return round->status;
  return round->result;
}

absl::Status ShardAggregator::CheckUpdateFinite(const RoundResult& r) const {
  absl::Status status;
  {
    absl::MutexLock lock(&mu_);
    status = options_.mode == AggregationMode::kDense
                 ? rule_.CheckAggregatedDense(
                       r.dense_sum, static_cast<int>(options_.num_workers),
                       begin_, params_, global_velocity_)
                 : rule_.CheckAggregated(r.selected, begin_,
                                         static_cast<int>(options_.num_workers),
                                         params_, global_velocity_);
  }
  if (status.ok() || !absl::IsFailedPrecondition(status)) return status;
  return StepNotFinite(status.message());
}

absl::Status ShardAggregator::StepNotFinite(absl::string_view what) const {
  return absl::FailedPreconditionError(absl::StrCat(
      "the update is not finite: ", what,
      "; the step is refused on every shard, nothing was applied (",
      options_.apply == ApplyMode::kWorkers ? "clip the gradients"
                                            : "lower --lr, or clip the "
                                              "gradients",
      ")"));
}

absl::Status ShardAggregator::CheckChecksums(
    const std::vector<WorkerPush>& pushes, int64_t step) const {
  // Compared on the scheduled steps, and on any step where a worker sent
  // one unasked: its first step after a resume or a rollback that
  // renumbered the steps (worker/client.h), where a rank that resumed from
  // another step's checkpoint, or kept later state, must not pass.
  const bool scheduled = options_.checksum_every != 0 && step >= 0 &&
                         step % options_.checksum_every == 0;
  const bool asked =
      std::any_of(pushes.begin(), pushes.end(),
                  [](const WorkerPush& p) { return p.params_checksum != 0; });
  if (pushes.empty() || !(scheduled || asked)) return absl::OkStatus();
  // Scheduled: every worker must have sent the same checksum. Asked: the
  // ones sent must agree (a rank that resumed from a checkpoint of the very
  // step the others are in lost nothing; the others need not send).
  uint64_t first = 0;
  bool same = true;
  for (const WorkerPush& p : pushes) {
    if (p.params_checksum == 0) {
      same = same && !scheduled;
      continue;
    }
    if (first == 0) first = p.params_checksum;
    same = same && p.params_checksum == first;
  }
  if (same) return absl::OkStatus();
  // Group the ranks by checksum, in the order of each group's first rank;
  // the ranks that sent none last.
  std::vector<std::pair<uint64_t, std::vector<uint32_t>>> groups;
  std::vector<uint32_t> none;
  for (uint32_t w = 0; w < pushes.size(); ++w) {
    const uint64_t c = pushes[w].params_checksum;
    if (c == 0) {
      none.push_back(w);
      continue;
    }
    auto it = std::find_if(groups.begin(), groups.end(),
                           [c](const auto& g) { return g.first == c; });
    if (it == groups.end()) {
      groups.push_back({c, {w}});
    } else {
      it->second.push_back(w);
    }
  }
  std::vector<std::string> parts;
  for (const auto& [checksum, ranks] : groups) {
    parts.push_back(absl::StrCat(
        parts.empty() ? "checksum " : "", absl::StrFormat("0x%016x", checksum),
        " on rank", ranks.size() > 1 ? "s " : " ", absl::StrJoin(ranks, ", ")));
  }
  if (!none.empty()) {
    parts.push_back(absl::StrCat("none from rank", none.size() > 1 ? "s " : " ",
                                 absl::StrJoin(none, ", ")));
  }
  return absl::FailedPreconditionError(absl::StrCat(
      kDivergedMarker, " at step ", step, ": ", absl::StrJoin(parts, "; "),
      ". A replica was changed outside step() (e.g. model.load_state_dict "
      "after constructing the optimizer) or lost an update; restart every "
      "rank from the checkpoints of one step (checksums are compared every ",
      options_.checksum_every,
      " steps, --checksum-every, and at the first "
      "step after a resume or a rollback)"));
}

absl::StatusOr<std::shared_ptr<const RoundResult>> ShardAggregator::Compute(
    std::vector<WorkerPush>& pushes, int64_t step, absl::Time opened,
    absl::Time deadline, uint64_t epoch) {
  auto result = std::make_shared<RoundResult>();
  result->step = step;
  if (options_.apply == ApplyMode::kWorkers && options_.shard_id == 0) {
    // Rank 0's buffers go back in every pull of the step (ValidatePush
    // refused them from any other rank or to any other shard).
    result->buffers = std::move(pushes[0].buffers);
  }
  const absl::Time merge_start = absl::Now();
  result->opened = opened;
  result->wait_time = merge_start - opened;
  if (options_.mode == AggregationMode::kDense) {
    // Rank order, starting from worker 0's values (as SparseSum does).
    result->dense_sum = pushes[0].dense;
    for (size_t w = 1; w < pushes.size(); ++w) {
      for (size_t i = 0; i < result->dense_sum.size(); ++i) {
        result->dense_sum[i] += pushes[w].dense[i];
      }
    }
    // The pushes are finite (ValidatePush); their sum may still overflow.
    if (absl::Status s = ValidateFinite(result->dense_sum, "dense sum");
        !s.ok()) {
      return StepNotFinite(absl::StrCat(
          "the sum of the workers' pushes overflows: ", s.message()));
    }
    result->merge_time = absl::Now() - merge_start;
    return result;
  }
  std::vector<SparseVector> inputs;
  inputs.reserve(pushes.size());
  // The pushes are consumed: move, not copy, P sparse vectors per step.
  for (WorkerPush& p : pushes) inputs.push_back(std::move(p.sparse));
  SparseVector sum;
  // The pushes were validated (ValidatePush), so the only error left is a
  // sum of finite values that overflows.
  if (absl::Status s = SparseSum(inputs, options_.n, &sum); !s.ok()) {
    return StepNotFinite(
        absl::StrCat("the sum of the workers' pushes (", s.message(), ")"));
  }
  const absl::Time select_start = absl::Now();
  result->merge_time = select_start - merge_start;
  GTOPK_ASSIGN_OR_RETURN(const uint64_t k, rule_.KAt(step, options_.n));
  if (options_.mode == AggregationMode::kTopk) {
    result->selected = std::move(sum);
  } else if (options_.selection == SelectionKind::kLayerwise) {
    GTOPK_RETURN_IF_ERROR(SelectPerPiece(sum, k, &result->selected));
  } else if (options_.selection == SelectionKind::kQuota) {
    const uint64_t range = end_ - begin_;
    const uint64_t quota = (k * range + options_.n - 1) / options_.n;
    if (quota > 0 && !sum.empty()) {
      GTOPK_RETURN_IF_ERROR(SparseTopK(sum, quota, &result->selected));
    }
  } else if (options_.num_shards == 1) {
    if (!sum.empty()) {
      GTOPK_RETURN_IF_ERROR(SparseTopK(sum, k, &result->selected));
    }
  } else {
    GTOPK_RETURN_IF_ERROR(
        DistributedThresholdTopK(sum, k, step, options_.shard_id, exchange_,
                                 deadline, &result->selected, epoch));
  }
  result->select_time = absl::Now() - select_start;
  GTOPK_RETURN_IF_ERROR(
      EncodeSparse(result->selected, options_.n,
                   CodecSpec{options_.pull_index_codec, ValueCodec::kFp32},
                   &result->encoded));
  return result;
}

void ShardAggregator::Close(const absl::Status& reason) {
  absl::MutexLock lock(&mu_);
  if (!closed_.ok()) return;
  closed_ = reason.ok() ? absl::UnavailableError(absl::StrCat(
                              "shard ", options_.shard_id, " is closed"))
                        : reason;
  if (pending_ != nullptr && !pending_->computing) {
    FailRoundLocked(pending_, closed_);
  }
  cv_.SignalAll();
}

void ShardAggregator::BeginDrain(const absl::Status& reason) {
  absl::MutexLock lock(&mu_);
  if (!draining_.ok()) return;
  draining_ = reason.ok() ? absl::UnavailableError(absl::StrCat(
                                "shard ", options_.shard_id, " is draining"))
                          : reason;
}

bool ShardAggregator::AwaitNoRound(absl::Time deadline) const {
  absl::MutexLock lock(&mu_);
  while (pending_ != nullptr) {
    if (cv_.WaitWithDeadline(&mu_, deadline)) return pending_ == nullptr;
  }
  return true;
}

absl::StatusOr<int64_t> ShardAggregator::SettledNextStep(absl::Time deadline,
                                                         bool settle) const {
  absl::MutexLock lock(&mu_);
  if (!initialized_) {
    return absl::FailedPreconditionError(
        absl::StrCat("shard ", options_.shard_id, " has no parameters"));
  }
  while (settle && pending_ != nullptr && pending_->computing) {
    if (cv_.WaitWithDeadline(&mu_, deadline) && pending_ != nullptr &&
        pending_->computing) {
      return absl::DeadlineExceededError(
          absl::StrCat("shard ", options_.shard_id, " is still computing step ",
                       pending_->step));
    }
  }
  return next_step_;
}

absl::Status ShardAggregator::Rollback(int64_t step,
                                       const ShardCheckpoint* checkpoint,
                                       const absl::Status& reason) {
  if (checkpoint != nullptr) {
    GTOPK_RETURN_IF_ERROR(ValidateCheckpointFor(*checkpoint, options_.shard_id,
                                                options_.num_shards, options_.n,
                                                begin_, end_));
    const bool global =
        options_.optimizer.momentum_mode == MomentumMode::kGlobal;
    if (checkpoint->next_step != step ||
        (global &&
         checkpoint->global_velocity.size() != checkpoint->params.size())) {
      return absl::FailedPreconditionError(
          absl::StrCat("shard ", options_.shard_id, ": checkpoint of step ",
                       checkpoint->next_step, " cannot restore step ", step,
                       global ? " (or it lacks the global velocity)" : ""));
    }
  }
  const bool renumber =
      checkpoint == nullptr && options_.apply == ApplyMode::kWorkers;
  if (step < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("shard ", options_.shard_id,
                     ": cannot roll back to negative step ", step));
  }
  absl::MutexLock lock(&mu_);
  if (!initialized_) {
    return absl::FailedPreconditionError(absl::StrCat(
        "shard ", options_.shard_id, " has no parameters to roll back"));
  }
  if (checkpoint == nullptr && step != next_step_ && !renumber) {
    return absl::FailedPreconditionError(
        absl::StrCat("shard ", options_.shard_id, " is at step ", next_step_,
                     " and has no checkpoint of step ", step));
  }
  if (pending_ != nullptr) {
    FailRoundLocked(pending_,
                    absl::AbortedError(absl::StrCat(
                        "step ", pending_->step, " abandoned on shard ",
                        options_.shard_id, ": ", reason.message())));
  }
  last_.reset();
  ++rollback_generation_;
  if (checkpoint != nullptr) {
    params_ = checkpoint->params;
    global_velocity_ = options_.optimizer.momentum_mode == MomentumMode::kGlobal
                           ? checkpoint->global_velocity
                           : std::vector<float>();
    next_step_ = checkpoint->next_step;
  } else if (renumber) {
    // Workers apply: the shard's only state of its own is the step.
    next_step_ = step;
  }
  cv_.SignalAll();
  return absl::OkStatus();
}

absl::StatusOr<ShardCheckpoint> ShardAggregator::Snapshot() const {
  absl::MutexLock lock(&mu_);
  if (!initialized_) {
    return absl::FailedPreconditionError(absl::StrCat(
        "shard ", options_.shard_id, " has no parameters to checkpoint"));
  }
  ShardCheckpoint c;
  c.shard_id = options_.shard_id;
  c.num_shards = options_.num_shards;
  c.n = options_.n;
  c.begin = begin_;
  c.end = end_;
  c.next_step = next_step_;
  c.params = params_;
  c.global_velocity = global_velocity_;
  return c;
}

absl::Status ShardAggregator::Restore(const ShardCheckpoint& c) {
  GTOPK_RETURN_IF_ERROR(ValidateCheckpointFor(
      c, options_.shard_id, options_.num_shards, options_.n, begin_, end_));
  const bool global = options_.optimizer.momentum_mode == MomentumMode::kGlobal;
  if (global && c.global_velocity.size() != c.params.size()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "checkpoint of shard ", c.shard_id,
        " has no global velocity but the cluster uses global momentum"));
  }
  absl::MutexLock lock(&mu_);
  params_ = c.params;
  global_velocity_ = global ? c.global_velocity : std::vector<float>();
  next_step_ = c.next_step;
  initialized_ = true;
  pending_.reset();
  last_.reset();
  cv_.SignalAll();
  return absl::OkStatus();
}

}  // namespace server
}  // namespace gtopk
