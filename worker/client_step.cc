// WorkerClient's two Step overloads (worker/client.h) and the phases they
// share: the host Step runs everything on the host; the device Step runs
// the GPU phases through DeviceStep (worker/device_step.h) and the rest
// here. The pushes go out and the pulls come back in PushPullRound
// (worker/push_pull_round.cc).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/checksum.h"
#include "common/codec.h"
#include "common/status_macros.h"
#include "worker/client.h"
#include "worker/client_internal.h"
#include "worker/device_step.h"

namespace gtopk {
namespace worker {

namespace {

// The entries of `v` with index in [begin, end).
SparseVector Slice(const SparseVector& v, uint64_t begin, uint64_t end) {
  const auto lo = std::lower_bound(v.indices.begin(), v.indices.end(), begin);
  const auto hi = std::lower_bound(lo, v.indices.end(), end);
  const size_t a = lo - v.indices.begin();
  const size_t b = hi - v.indices.begin();
  SparseVector out;
  out.indices.assign(v.indices.begin() + a, v.indices.begin() + b);
  out.values.assign(v.values.begin() + a, v.values.begin() + b);
  return out;
}

// Dense mode: the pull of a shard of `len` entries has len finite values.
absl::Status CheckDensePull(const v1::Pull& pull, uint64_t len) {
  if (static_cast<uint64_t>(pull.dense_size()) != len) {
    return absl::InternalError(absl::StrCat(
        "dense pull has ", pull.dense_size(), " values, range has ", len));
  }
  const absl::Status finite = ValidateFinite(pull.dense(), "dense pull");
  if (!finite.ok()) return absl::InternalError(finite.message());
  return absl::OkStatus();
}

// The sparse pull of the shard owning [begin, end) of the n entries.
absl::StatusOr<SparseVector> DecodeSparsePull(const v1::Pull& pull, uint64_t n,
                                              uint64_t begin, uint64_t end) {
  SparseVector part;
  const absl::Status st = DecodeSparse(pull.sparse(), n, &part);
  if (!st.ok()) {
    return absl::InternalError(
        absl::StrCat("undecodable pull: ", st.message()));
  }
  if (!part.empty() &&
      (part.indices.front() < begin || part.indices.back() >= end)) {
    return absl::InternalError(
        absl::StrCat("pull has indices outside [", begin, ", ", end, ")"));
  }
  return part;
}

// The device selection's ranges (DeviceStep::Select): the whole vector
// with k, or under layer-wise selection every piece with its PieceK, as
// SelectLocal selects on the host.
std::vector<DeviceStep::Range> DeviceRanges(
    absl::Span<const BucketPiece> pieces, uint64_t k, uint64_t n) {
  if (pieces.empty()) return {DeviceStep::Range{0, n, k}};
  std::vector<DeviceStep::Range> ranges;
  ranges.reserve(pieces.size());
  for (const BucketPiece& p : pieces) {
    ranges.push_back(DeviceStep::PieceRange(p, k, n));
  }
  return ranges;
}

}  // namespace

absl::StatusOr<StepStats> WorkerClient::BeginStep(uint64_t n) const {
  StepStats stats;
  stats.step = next_step_;
  stats.bytes_sent.assign(shards_.size(), 0);
  stats.bytes_received.assign(shards_.size(), 0);
  GTOPK_ASSIGN_OR_RETURN(stats.k, rule_.KAt(next_step_, n));
  return stats;
}

absl::StatusOr<StepStats> WorkerClient::Step(absl::Span<const float> gradient,
                                             absl::Span<float> params) {
  const uint64_t n = cluster_.n();
  GTOPK_RETURN_IF_ERROR(CheckLengths("Step", gradient, params));
  if (apply_ == ApplyMode::kWorkers) {
    return absl::FailedPreconditionError(
        "Step: the cluster runs with --apply=workers (gradient aggregation): "
        "the workers apply the update with their own optimizer; call "
        "AggregateStep and step your optimizer on the averaged gradient");
  }
  GTOPK_ASSIGN_OR_RETURN(StepStats stats, BeginStep(n));

  const absl::Time t = absl::Now();
  // Nothing changed when this fails (its contract).
  GTOPK_RETURN_IF_ERROR(rule_.AccumulateLocal(stats.step, gradient, params,
                                              absl::MakeSpan(velocity_),
                                              feedback_.mutable_residual()));
  stats.accumulate = absl::Now() - t;

  // The parameters before this step's update: equal on every replica.
  step_checksum_ = ChecksumFor(stats.step, params);
  step_buffers_.clear();
  // From here on the residual holds u; a failure must leave it there.
  const absl::Status st = mode_ == AggregationMode::kDense
                              ? DenseStepOnHost(params, &stats)
                              : SparseStepOnHost(params, &stats);
  step_checksum_ = 0;
  GTOPK_RETURN_IF_ERROR(st);
  ++next_step_;
  return stats;
}

absl::Status WorkerClient::CheckLengths(absl::string_view what,
                                        absl::Span<const float> gradient,
                                        absl::Span<const float> params) const {
  const uint64_t n = cluster_.n();
  if (gradient.size() == n && params.size() == n) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(what, ": gradient has ", gradient.size(),
                   " values and params ", params.size(), "; n = ", n));
}

bool WorkerClient::checksum_due() const {
  const uint32_t every = cluster_.checksum_every();
  return every != 0 && (next_step_ % every == 0 || check_next_step_);
}

uint64_t WorkerClient::ChecksumFor(int64_t step,
                                   absl::Span<const float> params) const {
  const uint32_t every = cluster_.checksum_every();
  if (every == 0 || (step % every != 0 && !check_next_step_)) return 0;
  return ParamsChecksum(params);
}

absl::Status WorkerClient::CheckAggregateArgs(absl::string_view what,
                                              absl::Span<const float> gradient,
                                              absl::Span<float> averaged,
                                              absl::Span<const float> params,
                                              absl::string_view buffers) const {
  const uint64_t n = cluster_.n();
  if (gradient.size() != n || averaged.size() != n ||
      (!params.empty() && params.size() != n)) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, ": gradient has ", gradient.size(), " values, averaged ",
        averaged.size(), " and params ", params.size(), "; n = ", n,
        " (params may be empty except on checksum steps)"));
  }
  if (checksum_due() && params.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, ": step ", next_step_, " sends a checksum (every ",
        cluster_.checksum_every(),
        " steps, and the first after a resume or "
        "rollback; checksum_due()): pass this replica's parameters"));
  }
  if (!buffers.empty() && rank_ != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": rank ", rank_,
                     " passed buffers; only rank 0's "
                     "buffers are broadcast (the others receive them)"));
  }
  const uint64_t limit = cluster_.max_message_bytes() == 0
                             ? uint64_t{4} << 20  // gRPC's default
                             : cluster_.max_message_bytes();
  if (buffers.size() + 4096 > limit) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, ": the buffers are ", buffers.size(),
        " bytes, over the "
        "cluster's message limit less 4 KiB for the push (--max-message-"
        "bytes ",
        limit, ")"));
  }
  return absl::OkStatus();
}

absl::StatusOr<StepStats> WorkerClient::AggregateStep(
    absl::Span<const float> gradient, absl::Span<float> averaged,
    absl::Span<const float> params, absl::string_view buffers,
    std::string* buffers_out, uint64_t state_checksum) {
  const uint64_t n = cluster_.n();
  if (apply_ != ApplyMode::kWorkers) {
    return absl::FailedPreconditionError(
        "AggregateStep: the cluster applies updates on the servers (--apply="
        "servers, their SGD rule); start the servers with --apply=workers to "
        "run your own optimizer on the averaged gradient, or call Step");
  }
  GTOPK_RETURN_IF_ERROR(
      CheckAggregateArgs("AggregateStep", gradient, averaged, params, buffers));
  GTOPK_ASSIGN_OR_RETURN(StepStats stats, BeginStep(n));

  absl::Time t = absl::Now();
  // The identity rule (Connect): u = residual + 1 * gradient, the gradient
  // also standing in for the parameters its weight decay of 0 multiplies.
  GTOPK_RETURN_IF_ERROR(rule_.AccumulateLocal(stats.step, gradient, gradient,
                                              absl::MakeSpan(velocity_),
                                              feedback_.mutable_residual()));
  stats.accumulate = absl::Now() - t;

  t = absl::Now();
  step_checksum_ = ChecksumFor(stats.step, params);
  if (step_checksum_ != 0 && state_checksum != 0) {
    step_checksum_ = CombineChecksums(step_checksum_, state_checksum);
  }
  stats.accumulate += absl::Now() - t;
  step_buffers_.assign(buffers.data(), buffers.size());
  received_buffers_.clear();
  const absl::Status st = mode_ == AggregationMode::kDense
                              ? DenseStepOnHost({}, &stats, averaged)
                              : SparseStepOnHost({}, &stats, averaged);
  step_checksum_ = 0;
  step_buffers_.clear();
  GTOPK_RETURN_IF_ERROR(st);
  if (buffers_out != nullptr) buffers_out->swap(received_buffers_);
  received_buffers_.clear();
  check_next_step_ = false;
  ++next_step_;
  return stats;
}

absl::Status WorkerClient::CheckAveraged(
    int64_t step, const SparseVector& global,
    const std::vector<v1::Pull>& pulls) const {
  const float p = static_cast<float>(cluster_.num_workers());
  auto bad = [&](uint64_t index, float sum) {
    return absl::InternalError(
        absl::StrCat("step ", step, ": the servers' sum at index ", index,
                     " is ", sum, ", whose average over ",
                     cluster_.num_workers(), " workers is not finite"));
  };
  if (mode_ == AggregationMode::kDense) {
    for (size_t s = 0; s < shards_.size(); ++s) {
      for (int i = 0; i < pulls[s].dense_size(); ++i) {
        if (!std::isfinite(pulls[s].dense(i) / p)) {
          return bad(shards_[s]->begin + i, pulls[s].dense(i));
        }
      }
    }
    return absl::OkStatus();
  }
  for (size_t j = 0; j < global.size(); ++j) {
    if (!std::isfinite(global.values[j] / p)) {
      return bad(global.indices[j], global.values[j]);
    }
  }
  return absl::OkStatus();
}

void WorkerClient::StoreAveraged(const SparseVector& global,
                                 const std::vector<v1::Pull>& pulls,
                                 absl::Span<float> averaged) const {
  // One float division per value, A / P, as the servers-apply rule computes
  // its update (OptimizerRule::StoreAggregated): the same bits everywhere.
  const float p = static_cast<float>(cluster_.num_workers());
  if (mode_ == AggregationMode::kDense) {
    for (size_t s = 0; s < shards_.size(); ++s) {
      float* out = averaged.data() + shards_[s]->begin;
      const float* sum = pulls[s].dense().data();
      for (int i = 0; i < pulls[s].dense_size(); ++i) out[i] = sum[i] / p;
    }
    return;
  }
  std::fill(averaged.begin(), averaged.end(), 0.0f);
  for (size_t j = 0; j < global.size(); ++j) {
    averaged[global.indices[j]] = global.values[j] / p;
  }
}

absl::Status WorkerClient::DenseStepOnHost(absl::Span<float> params,
                                           StepStats* stats,
                                           absl::Span<float> averaged) {
  const int64_t step = stats->step;
  const std::vector<v1::Push> pushes = DensePushes(step, stats);
  std::vector<v1::Pull> pulls;
  GTOPK_RETURN_IF_ERROR(
      PushAndDecodePulls(step, pushes, &pulls, stats).status());

  const absl::Time t = absl::Now();
  if (!averaged.empty()) {
    GTOPK_RETURN_IF_ERROR(CheckAveraged(step, SparseVector(), pulls));
    StoreAveraged(SparseVector(), pulls, averaged);
    std::fill(feedback_.mutable_residual().begin(),
              feedback_.mutable_residual().end(), 0.0f);
    stats->apply = absl::Now() - t;
    return absl::OkStatus();
  }
  GTOPK_RETURN_IF_ERROR(
      CheckServersUpdate(step, pulls, SparseVector(), params));
  const int P = static_cast<int>(cluster_.num_workers());
  for (size_t s = 0; s < shards_.size(); ++s) {
    const uint64_t begin = shards_[s]->begin;
    const uint64_t len = shards_[s]->end - begin;
    // Checked above (CheckServersUpdate), nothing changed since.
    rule_.StoreAggregatedDense(
        pulls[s].dense(), P, params.subspan(begin, len),
        absl::MakeSpan(global_velocity_).subspan(begin, len));
  }
  // Everything accumulated was applied.
  std::fill(feedback_.mutable_residual().begin(),
            feedback_.mutable_residual().end(), 0.0f);
  stats->apply = absl::Now() - t;
  return absl::OkStatus();
}

absl::Status WorkerClient::SelectPieceOf(absl::Span<const float> u,
                                         const BucketPiece& p, uint64_t k,
                                         int64_t step, SparseVector* sent) {
  const uint64_t kp = PieceK(k, p.size(), cluster_.n());
  if (kp == 0) return absl::OkStatus();
  SparseVector part;
  GTOPK_RETURN_IF_ERROR(selector_->Select(u.subspan(p.begin, p.size()), kp,
                                          static_cast<uint64_t>(step), &part));
  for (size_t j = 0; j < part.size(); ++j) {
    sent->indices.push_back(static_cast<uint32_t>(part.indices[j] + p.begin));
    sent->values.push_back(part.values[j]);
  }
  return absl::OkStatus();
}

absl::Status WorkerClient::SelectLocal(absl::Span<const float> u, uint64_t k,
                                       int64_t step, SparseVector* sent) {
  if (pieces_.empty()) {
    return selector_->Select(u, k, static_cast<uint64_t>(step), sent);
  }
  sent->clear();
  for (const BucketPiece& p : pieces_) {
    GTOPK_RETURN_IF_ERROR(SelectPieceOf(u, p, k, step, sent));
  }
  return absl::OkStatus();
}

absl::Status WorkerClient::SparseStepOnHost(absl::Span<float> params,
                                            StepStats* stats,
                                            absl::Span<float> averaged) {
  const int64_t step = stats->step;
  absl::Time t = absl::Now();
  SparseVector sent;
  GTOPK_RETURN_IF_ERROR(
      SelectLocal(feedback_.residual(), stats->k, step, &sent));
  SparseVector received = sent;
  QuantizeValues(codec_.value, absl::MakeSpan(received.values));
  GTOPK_RETURN_IF_ERROR(feedback_.MarkSent(sent, received));
  stats->select = absl::Now() - t;
  stats->sent_pairs = sent.size();

  // From here a failure puts every sent entry back (RestoreSent).
  std::vector<v1::Pull> pulls;
  absl::StatusOr<SparseVector> global =
      SparseRoundTrip(step, sent, &pulls, stats);
  if (!global.ok()) return RestoreSent(received, global.status());
  return ApplyGlobalOnHost(step, sent, received, *global, pulls, params,
                           averaged, stats);
}

absl::Status WorkerClient::RestoreSent(const SparseVector& received,
                                       const absl::Status& status) {
  // residual[i] = fl(fl(u - recv) + recv) for every entry sent.
  const absl::Status restored = feedback_.PutBack(received, SparseVector());
  if (!restored.ok()) {
    return absl::InternalError(absl::StrCat(
        status.ToString(),
        "; and restoring the residual failed: ", restored.ToString()));
  }
  return status;
}

absl::Status WorkerClient::ApplyGlobalOnHost(
    int64_t step, const SparseVector& sent, const SparseVector& received,
    const SparseVector& global, const std::vector<v1::Pull>& pulls,
    absl::Span<float> params, absl::Span<float> averaged, StepStats* stats) {
  const absl::Time t = absl::Now();
  if (absl::Status st = averaged.empty()
                            ? CheckServersUpdate(step, pulls, global, params)
                            : CheckAveraged(step, global, pulls);
      !st.ok()) {
    return RestoreSent(received, st);
  }
  if (mode_ == AggregationMode::kGtopk) {
    GTOPK_RETURN_IF_ERROR(feedback_.PutBack(received, global));
  }
  if (!averaged.empty()) {
    // Written last: `averaged` may alias the gradient the caller passed.
    StoreAveraged(global, pulls, averaged);
    stats->apply = absl::Now() - t;
    return absl::OkStatus();
  }
  GTOPK_RETURN_IF_ERROR(
      rule_.MaskMomentum(sent, global, absl::MakeSpan(velocity_)));
  // Checked above (CheckServersUpdate); PutBack and MaskMomentum touch
  // neither params nor the global velocity.
  rule_.StoreAggregated(global, 0, static_cast<int>(cluster_.num_workers()),
                        params, absl::MakeSpan(global_velocity_));
  stats->apply = absl::Now() - t;
  return absl::OkStatus();
}

absl::StatusOr<StepStats> WorkerClient::Step(const float* gradient,
                                             float* params, uint64_t n,
                                             CUstream_st* stream) {
  if (n != cluster_.n() || gradient == nullptr || params == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "Step (device): n = ", n, " (cluster n = ", cluster_.n(),
        "), gradient and params must be non-null device pointers"));
  }
  if (apply_ == ApplyMode::kWorkers) {
    return absl::FailedPreconditionError(
        "Step (device): the cluster runs with --apply=workers (gradient "
        "aggregation): call AggregateStep with host copies of the gradient");
  }
  if (mode_ == AggregationMode::kDense) {
    // Dense mode sends u itself: it has to reach the host.
    absl::StatusOr<StepStats> stats;
    GTOPK_RETURN_IF_ERROR(
        DeviceStep::RunOnHostCopies(gradient, params, n, stream,
                                    [&](absl::Span<const float> host_gradient,
                                        absl::Span<float> host_params) {
                                      stats = Step(host_gradient, host_params);
                                      return stats.status();
                                    }));
    return stats;
  }
  GTOPK_ASSIGN_OR_RETURN(StepStats stats,
                         BeginDeviceStep(gradient, params, stream));
  step_buffers_.clear();
  const absl::Status st = SparseStepOnDevice(gradient, params, stream, &stats);
  step_checksum_ = 0;
  GTOPK_RETURN_IF_ERROR(st);
  ++next_step_;
  return stats;
}

absl::StatusOr<StepStats> WorkerClient::BeginDeviceStep(const float* gradient,
                                                        float* params,
                                                        CUstream_st* stream) {
  const uint64_t n = cluster_.n();
  if (device_ == nullptr) {
    // First device step: move the host state to the device.
    GTOPK_ASSIGN_OR_RETURN(
        device_,
        DeviceStep::Create(selector_->name(),
                           SelectorSeedForRank(cluster_.selector_seed(), rank_),
                           rule_.options(), n, feedback_.residual(), velocity_,
                           global_velocity_, stream));
  }
  GTOPK_ASSIGN_OR_RETURN(StepStats stats, BeginStep(n));
  if (cluster_.checksum_every() != 0 &&
      stats.step % cluster_.checksum_every() == 0) {
    // The divergence alarm's checksum from a host copy, every
    // checksum_every steps only.
    GTOPK_RETURN_IF_ERROR(DeviceStep::RunOnHostCopies(
        gradient, params, n, stream,
        [&](absl::Span<const float>, absl::Span<float> host_params) {
          step_checksum_ = ParamsChecksum(host_params);
          return absl::OkStatus();
        }));
  }
  return stats;
}

absl::Status WorkerClient::SparseStepOnDevice(const float* gradient,
                                              float* params,
                                              CUstream_st* stream,
                                              StepStats* stats) {
  const int64_t step = stats->step;
  absl::Time t = absl::Now();
  // u into the spare device buffers; committed once the selection succeeded.
  GTOPK_RETURN_IF_ERROR(
      device_->Accumulate(gradient, params, rule_.LrAt(step), stream));
  stats->accumulate = absl::Now() - t;

  t = absl::Now();
  GTOPK_ASSIGN_OR_RETURN(
      const DeviceStep::Sent sent,
      device_->Select(DeviceRanges(pieces_, stats->k, cluster_.n()), step,
                      codec_.value, stream));
  stats->select = absl::Now() - t;
  stats->sent_pairs = sent.sent.size();

  // From here a failure puts every sent value back (residual holds u).
  auto fail = [&](const absl::Status& status) {
    return device_->PutBackAll(sent, status, stream);
  };
  std::vector<v1::Pull> pulls;
  absl::StatusOr<SparseVector> global =
      SparseRoundTrip(step, sent.sent, &pulls, stats);
  if (!global.ok()) return fail(global.status());

  t = absl::Now();
  GTOPK_RETURN_IF_ERROR(device_->Apply(sent, *global,
                                       mode_ == AggregationMode::kGtopk,
                                       cluster_.num_workers(), params, stream));
  stats->apply = absl::Now() - t;
  return absl::OkStatus();
}

std::vector<v1::Push> WorkerClient::NewPushes(int64_t step) const {
  std::vector<v1::Push> pushes(shards_.size());
  for (size_t s = 0; s < shards_.size(); ++s) {
    pushes[s].set_step(step);
    pushes[s].set_rank(rank_);
    pushes[s].set_epoch(epoch_);
    pushes[s].set_shard_id(shards_[s]->id);
    pushes[s].set_member_token(member_token_);
    pushes[s].set_cluster_fingerprint(cluster_.cluster_fingerprint());
    pushes[s].set_params_checksum(step_checksum_);
  }
  // Rank 0's buffers go to shard 0 only, which returns them to everyone.
  if (!step_buffers_.empty() && !pushes.empty()) {
    pushes[0].set_buffers(step_buffers_);
  }
  return pushes;
}

absl::StatusOr<std::vector<v1::Push>> WorkerClient::EncodePushes(
    int64_t step, const SparseVector& sent, StepStats* stats) const {
  const absl::Time t = absl::Now();
  std::vector<v1::Push> pushes = NewPushes(step);
  for (size_t s = 0; s < shards_.size(); ++s) {
    const SparseVector slice = Slice(sent, shards_[s]->begin, shards_[s]->end);
    const absl::Status st =
        EncodeSparse(slice, cluster_.n(), codec_, pushes[s].mutable_sparse());
    if (!st.ok()) return Prefixed(st, ShardName(s));
    stats->bytes_sent[s] = pushes[s].ByteSizeLong();
  }
  stats->encode = absl::Now() - t;
  return pushes;
}

std::vector<v1::Push> WorkerClient::DensePushes(int64_t step,
                                                StepStats* stats) const {
  const absl::Time t = absl::Now();
  std::vector<v1::Push> pushes = NewPushes(step);
  const absl::Span<const float> u = feedback_.residual();
  for (size_t s = 0; s < shards_.size(); ++s) {
    const uint64_t len = shards_[s]->end - shards_[s]->begin;
    auto* dense = pushes[s].mutable_dense();
    dense->Resize(static_cast<int>(len), 0.0f);
    if (len > 0) {
      std::memcpy(dense->mutable_data(), u.data() + shards_[s]->begin,
                  len * sizeof(float));
    }
    stats->bytes_sent[s] = pushes[s].ByteSizeLong();
  }
  stats->sent_pairs = cluster_.n();
  stats->encode = absl::Now() - t;
  return pushes;
}

absl::StatusOr<SparseVector> WorkerClient::SparseRoundTrip(
    int64_t step, const SparseVector& sent, std::vector<v1::Pull>* pulls,
    StepStats* stats) {
  GTOPK_ASSIGN_OR_RETURN(const std::vector<v1::Push> pushes,
                         EncodePushes(step, sent, stats));
  return PushAndDecodePulls(step, pushes, pulls, stats);
}

absl::StatusOr<SparseVector> WorkerClient::PushAndDecodePulls(
    int64_t step, const std::vector<v1::Push>& pushes,
    std::vector<v1::Pull>* pulls, StepStats* stats) {
  const absl::Time t = absl::Now();
  absl::Duration push_time;
  GTOPK_RETURN_IF_ERROR(PushPullRound(step, pushes, pulls, &push_time));
  GTOPK_ASSIGN_OR_RETURN(SparseVector global, DecodePulls(step, *pulls, stats));
  stats->push_wait = absl::Now() - t;
  stats->push = std::min(push_time, stats->push_wait);
  stats->wait = stats->push_wait - stats->push;
  return global;
}

absl::StatusOr<SparseVector> WorkerClient::DecodePulls(
    int64_t step, const std::vector<v1::Pull>& pulls, StepStats* stats) {
  SparseVector global;
  for (size_t s = 0; s < shards_.size(); ++s) {
    const ShardConn& c = *shards_[s];
    const v1::Pull& pull = pulls[s];
    stats->bytes_received[s] = pull.ByteSizeLong();
    stats->server_merge =
        std::max(stats->server_merge,
                 absl::Microseconds(static_cast<int64_t>(pull.merge_us())));
    stats->server_select =
        std::max(stats->server_select,
                 absl::Microseconds(static_cast<int64_t>(pull.select_us())));
    absl::Status bad;
    if (s == 0) received_buffers_ = pull.buffers();
    if (pull.step() != step || pull.shard_id() != c.id) {
      bad = absl::InternalError(absl::StrCat("pull is for step ", pull.step(),
                                             " shard ", pull.shard_id(),
                                             ", expected step ", step));
    } else if (mode_ == AggregationMode::kDense) {
      bad = CheckDensePull(pull, c.end - c.begin);
      stats->received_pairs += pull.dense_size();
    } else if (absl::StatusOr<SparseVector> part =
                   DecodeSparsePull(pull, cluster_.n(), c.begin, c.end);
               !part.ok()) {
      bad = part.status();
    } else {
      // Shards are in index order, so the union stays sorted.
      global.indices.insert(global.indices.end(), part->indices.begin(),
                            part->indices.end());
      global.values.insert(global.values.end(), part->values.begin(),
                           part->values.end());
      stats->received_pairs += part->size();
    }
    if (!bad.ok()) {
      CloseStreams();
      return Prefixed(bad, ShardName(s));
    }
  }
  return global;
}

absl::Status WorkerClient::CheckServersUpdate(
    int64_t step, const std::vector<v1::Pull>& pulls,
    const SparseVector& global, absl::Span<const float> params) const {
  // The servers refused any step whose update would not stay finite, and
  // this replica holds their bits, so this check passes unless the replica
  // diverged; it runs before anything changes so that no state is half
  // updated then (the entries sent go back to the residual).
  const int P = static_cast<int>(cluster_.num_workers());
  absl::Status finite;
  if (mode_ == AggregationMode::kDense) {
    for (size_t s = 0; s < shards_.size() && finite.ok(); ++s) {
      const uint64_t begin = shards_[s]->begin;
      const uint64_t len = shards_[s]->end - begin;
      finite = rule_.CheckAggregatedDense(
          pulls[s].dense(), P, begin, params.subspan(begin, len),
          absl::MakeConstSpan(global_velocity_).subspan(begin, len));
    }
  } else {
    finite = rule_.CheckAggregated(global, 0, P, params, global_velocity_);
  }
  if (finite.ok()) return finite;
  return absl::InternalError(
      absl::StrCat("step ", step,
                   ": the servers' update cannot be applied to this "
                   "replica (its parameters differ from the servers'): ",
                   finite.message()));
}

}  // namespace worker
}  // namespace gtopk
