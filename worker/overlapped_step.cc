// WorkerClient's overlapped steps (worker/client.h BeginOverlappedStep):
// layer-wise selection of each bucket piece on a selection thread as the
// caller reports its gradient, each run of pieces selected together
// released at once as a part of its shard's push (or each shard's whole
// push once its pieces are selected, for servers that do not take parts),
// the round on its own thread (PushPullRound behind a PushGate), and
// Finish/Abandon.
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/buckets.h"
#include "common/checksum.h"
#include "common/codec.h"
#include "common/status_macros.h"
#include "worker/client.h"
#include "worker/client_internal.h"
#include "worker/device_step.h"

namespace gtopk {
namespace worker {

absl::Status WorkerClient::CheckCanOverlap(absl::string_view what,
                                           ApplyMode apply) const {
  if (overlapped_ != nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(
        what, ": step ", next_step_,
        " is open already (FinishOverlappedStep or AbandonOverlappedStep "
        "first)"));
  }
  if (pieces_.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        what,
        ": the cluster's selection is not layerwise (its servers run "
        "--selection=threshold or quota): only layer-wise buckets can be "
        "pushed while the backward pass goes on; call ",
        apply_ == ApplyMode::kWorkers ? "AggregateStep" : "Step",
        ", or restart the servers with --selection=layerwise"));
  }
  if (apply_ == apply) return absl::OkStatus();
  if (apply_ == ApplyMode::kServers) {
    return absl::FailedPreconditionError(absl::StrCat(
        what,
        ": the cluster applies updates on the servers (--apply=servers): "
        "pass the parameters to update, BeginOverlappedStep(gradient, "
        "params) on the host or (gradient, params, n, stream) on the "
        "device"));
  }
  return absl::FailedPreconditionError(absl::StrCat(
      what,
      ": the cluster runs with --apply=workers (gradient aggregation): "
      "overlapped steps take host buffers there, BeginOverlappedStep("
      "gradient, averaged, params), and your optimizer steps on `averaged`"));
}

absl::Status WorkerClient::BeginOverlappedStep(absl::Span<const float> gradient,
                                               absl::Span<float> averaged,
                                               absl::Span<const float> params,
                                               absl::string_view buffers,
                                               uint64_t state_checksum) {
  GTOPK_RETURN_IF_ERROR(
      CheckCanOverlap("BeginOverlappedStep", ApplyMode::kWorkers));
  GTOPK_RETURN_IF_ERROR(CheckAggregateArgs("BeginOverlappedStep", gradient,
                                           averaged, params, buffers));
  GTOPK_ASSIGN_OR_RETURN(StepStats stats, BeginStep(cluster_.n()));
  step_checksum_ = ChecksumFor(stats.step, params);
  if (step_checksum_ != 0 && state_checksum != 0) {
    step_checksum_ = CombineChecksums(step_checksum_, state_checksum);
  }
  step_buffers_.assign(buffers.data(), buffers.size());
  return StartHostOverlappedStep(std::move(stats), gradient, {}, averaged);
}

absl::Status WorkerClient::BeginOverlappedStep(absl::Span<const float> gradient,
                                               absl::Span<float> params) {
  GTOPK_RETURN_IF_ERROR(CheckLengths("BeginOverlappedStep", gradient, params));
  GTOPK_RETURN_IF_ERROR(
      CheckCanOverlap("BeginOverlappedStep", ApplyMode::kServers));
  GTOPK_ASSIGN_OR_RETURN(StepStats stats, BeginStep(cluster_.n()));
  // The parameters before this step's update, as the host Step sends.
  step_checksum_ = ChecksumFor(stats.step, params);
  step_buffers_.clear();
  return StartHostOverlappedStep(std::move(stats), gradient, params, {});
}

absl::Status WorkerClient::StartHostOverlappedStep(
    StepStats stats, absl::Span<const float> gradient, absl::Span<float> params,
    absl::Span<float> averaged) {
  const uint64_t n = cluster_.n();
  received_buffers_.clear();
  if (overlap_backup_.size() != n) overlap_backup_.assign(n, 0.0f);
  if (overlap_gradient_.size() != n) overlap_gradient_.assign(n, 0.0f);
  if (!params.empty() && overlap_velocity_backup_.size() != velocity_.size()) {
    overlap_velocity_backup_.assign(velocity_.size(), 0.0f);
  }
  auto o = std::make_unique<OverlappedStep>(shards_.size(), pieces_.size());
  o->stats = std::move(stats);
  o->gradient = gradient;
  o->params = params;
  o->averaged = averaged;
  const absl::Status st = StartOverlappedStep(std::move(o));
  if (!st.ok()) step_checksum_ = 0;
  return st;
}

absl::Status WorkerClient::BeginOverlappedStep(const float* gradient,
                                               float* params, uint64_t n,
                                               CUstream_st* stream) {
  if (n != cluster_.n() || gradient == nullptr || params == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "BeginOverlappedStep (device): n = ", n, " (cluster n = ", cluster_.n(),
        "), gradient and params must be non-null device "
        "pointers"));
  }
  GTOPK_RETURN_IF_ERROR(
      CheckCanOverlap("BeginOverlappedStep (device)", ApplyMode::kServers));
  GTOPK_ASSIGN_OR_RETURN(StepStats stats,
                         BeginDeviceStep(gradient, params, stream));
  step_buffers_.clear();
  absl::Status st = device_->BeginOverlap(pieces_.size());
  if (st.ok()) {
    auto o = std::make_unique<OverlappedStep>(shards_.size(), pieces_.size());
    o->stats = std::move(stats);
    o->device_gradient = gradient;
    o->device_params = params;
    o->stream = stream;
    st = StartOverlappedStep(std::move(o));
  }
  if (!st.ok()) step_checksum_ = 0;
  return st;
}

absl::Status WorkerClient::StartOverlappedStep(
    std::unique_ptr<OverlappedStep> o) {
  const uint64_t n = cluster_.n();
  o->pushes = NewPushes(o->stats.step);
  std::vector<size_t>& pieces_of = o->num_pieces;
  pieces_of.assign(shards_.size(), 0);
  o->first_piece.assign(shards_.size(), 0);
  for (size_t i = pieces_.size(); i-- > 0;) {
    ++pieces_of[piece_shard_[i]];
    o->first_piece[piece_shard_[i]] = i;
  }
  o->in_parts = servers_take_push_parts();
  o->pieces_left = pieces_of;
  if (!o->in_parts && !whole_pushes_logged_) {
    whole_pushes_logged_ = true;
    std::fprintf(
        stderr,
        "gtopk worker rank %u: %s did not say it takes pushes in parts "
        "(its gtopk-server predates the rounds per bucket, "
        "docs/overlap.md): overlapped steps push each shard's entries "
        "whole once its pieces are selected (selection still overlaps "
        "backward; the same result as without overlap). Upgrade the "
        "servers for a round per bucket during backward.\n",
        rank_, shards_without_parts_.c_str());
  }
  for (size_t s = 0; s < shards_.size(); ++s) {
    // Parts of runs of pieces (docs/overlap.md, "Rounds per bucket"), or
    // the whole push when the servers do not take parts. A shard with an
    // empty range has no pieces: its (empty) whole push may go, counting
    // as its one piece.
    o->gate.Expect(s, std::max<size_t>(pieces_of[s], 1));
    if (pieces_of[s] == 0) {
      v1::Push whole = o->pushes[s];
      GTOPK_RETURN_IF_ERROR(
          EncodeSparse(SparseVector(), n, codec_, whole.mutable_sparse()));
      if (s < o->stats.bytes_sent.size()) {
        o->stats.bytes_sent[s] = whole.ByteSizeLong();
      }
      o->gate.Post(s, std::move(whole), 1);
    }
  }
  for (auto& c : shards_) {
    if (c->stream == nullptr) {
      SetStreamContext(*c);
      c->broken = false;
    }
  }
  OverlappedStep* raw = o.get();
  overlapped_ = std::move(o);
  raw->selection = std::thread([this, raw] { SelectionLoop(*raw); });
  raw->round = std::thread([this, raw] {
    raw->round_status = PushPullRound(raw->stats.step, raw->pushes, &raw->pulls,
                                      &raw->push_time, &raw->gate);
  });
  return absl::OkStatus();
}

absl::Status WorkerClient::GradientReady(uint64_t begin, uint64_t end) {
  OverlappedStep* o = overlapped_.get();
  if (o == nullptr) {
    return absl::FailedPreconditionError(
        "GradientReady: no overlapped step is open (BeginOverlappedStep)");
  }
  const uint64_t n = cluster_.n();
  if (begin >= end || end > n) {
    return absl::InvalidArgumentError(
        absl::StrCat("GradientReady: range [", begin, ", ", end,
                     ") is empty or outside [0, ", n, ")"));
  }
  absl::MutexLock lock(&o->mu);
  // Ranges never overlap: the next one starting at or after `begin` must
  // start at or after `end`, the one before must end at or before `begin`.
  auto next = o->reported.lower_bound(begin);
  if ((next != o->reported.end() && next->first < end) ||
      (next != o->reported.begin() && std::prev(next)->second > begin)) {
    const auto& other = (next != o->reported.end() && next->first < end)
                            ? *next
                            : *std::prev(next);
    return absl::InvalidArgumentError(absl::StrCat(
        "GradientReady: range [", begin, ", ", end,
        ") overlaps the range reported before, [", other.first, ", ",
        other.second, ") (each value is reported once per step)"));
  }
  o->reported.emplace(begin, end);
  o->reported_values += end - begin;
  // The pieces [begin, end) touches: pieces_ is sorted by begin.
  auto first = std::upper_bound(
      pieces_.begin(), pieces_.end(), begin,
      [](uint64_t v, const BucketPiece& p) { return v < p.begin; });
  size_t i = static_cast<size_t>(first - pieces_.begin()) - 1;
  for (; i < pieces_.size() && pieces_[i].begin < end; ++i) {
    const uint64_t lo = std::max(begin, pieces_[i].begin);
    const uint64_t hi = std::min(end, pieces_[i].end);
    o->ready[i] += hi - lo;
    if (o->ready[i] < pieces_[i].size()) continue;
    if (o->on_device()) {
      // The piece's gradient is final where the caller's stream is now.
      if (absl::Status st = device_->MarkReady(i, o->stream); !st.ok()) {
        if (o->select_status.ok()) o->select_status = st;
        o->stop = true;
        o->gate.Abandon();
        return st;
      }
    }
    o->queue.push_back(i);
  }
  return absl::OkStatus();
}

void WorkerClient::SelectionLoop(OverlappedStep& o) {
  std::vector<size_t> batch;
  while (true) {
    {
      absl::MutexLock lock(&o.mu);
      auto work = [&] { return o.stop || !o.queue.empty() || o.closing; };
      o.mu.Await(absl::Condition(&work));
      if (o.stop || o.queue.empty()) return;  // abandoned, or all done
      // Every piece ready now, in index order: a shard's consecutive
      // pieces in the batch go out as one part.
      batch.assign(o.queue.begin(), o.queue.end());
      o.queue.clear();
      o.first_taken = std::min(o.first_taken, absl::Now());
    }
    std::sort(batch.begin(), batch.end());
    const absl::Status st = SelectBatch(o, batch);
    if (!st.ok()) {
      absl::MutexLock lock(&o.mu);
      if (o.select_status.ok()) o.select_status = st;
      o.stop = true;
      o.gate.Abandon();
      return;
    }
  }
}

absl::Status WorkerClient::SelectBatch(OverlappedStep& o,
                                       const std::vector<size_t>& batch) {
  size_t run = 0;  // the first piece of the run being selected
  for (size_t j = 0; j < batch.size(); ++j) {
    {
      absl::MutexLock lock(&o.mu);
      if (o.stop) return absl::OkStatus();  // abandoned: nothing more goes
    }
    const size_t i = batch[j];
    GTOPK_RETURN_IF_ERROR(o.on_device() ? SelectPieceOnDevice(o, i)
                                        : SelectPieceOnHost(o, i));
    // A run ends at the batch's end, before a gap, or at a shard's end;
    // it goes out as soon as its last piece is selected.
    if (j + 1 < batch.size() && batch[j + 1] == i + 1 &&
        piece_shard_[i + 1] == piece_shard_[i]) {
      continue;
    }
    GTOPK_RETURN_IF_ERROR(PostRun(o, batch[run], i + 1));
    run = j + 1;
  }
  return absl::OkStatus();
}

absl::Status WorkerClient::SelectPieceOnDevice(OverlappedStep& o, size_t i) {
  const absl::Time t = absl::Now();
  // The received values and MarkSent come in Finish (DeviceStep::Commit).
  GTOPK_RETURN_IF_ERROR(device_->AccumulateAndSelect(
      i, DeviceStep::PieceRange(pieces_[i], o.stats.k, cluster_.n()),
      o.device_gradient, o.device_params, rule_.LrAt(o.stats.step),
      o.stats.step, &o.sent[i]));
  o.stats.select += absl::Now() - t;
  return absl::OkStatus();
}

absl::Status WorkerClient::SelectPieceOnHost(OverlappedStep& o, size_t i) {
  const BucketPiece& p = pieces_[i];
  absl::Time t = absl::Now();
  absl::Span<float> residual =
      feedback_.mutable_residual().subspan(p.begin, p.size());
  const absl::Span<const float> g = o.gradient.subspan(p.begin, p.size());
  std::memcpy(overlap_gradient_.data() + p.begin, g.data(),
              p.size() * sizeof(float));
  absl::Status st;
  const absl::Span<float> velocity =
      absl::MakeSpan(velocity_).subspan(p.begin, p.size());
  const bool servers_apply = !o.params.empty();
  {
    absl::MutexLock lock(&o.piece_mu);
    std::memcpy(overlap_backup_.data() + p.begin, residual.data(),
                p.size() * sizeof(float));
    if (servers_apply) {
      std::copy(velocity.begin(), velocity.end(),
                overlap_velocity_backup_.begin() + p.begin);
    }
    // On the copy read above: the cluster's rule as the host Step (--apply=
    // servers), or the identity rule (u = residual + g) as AggregateStep;
    // nothing is changed when it fails (a non-finite gradient).
    const absl::Span<const float> read(overlap_gradient_.data() + p.begin,
                                       p.size());
    st = rule_.AccumulateLocal(
        o.stats.step, read,
        servers_apply ? o.params.subspan(p.begin, p.size()) : read, velocity,
        residual);
    if (st.ok()) o.accumulated[i] = true;
  }
  if (!st.ok()) {
    return Prefixed(st, absl::StrCat("piece [", p.begin, ", ", p.end, ")"));
  }
  o.stats.accumulate += absl::Now() - t;

  t = absl::Now();
  SparseVector& sent = o.sent[i];
  GTOPK_RETURN_IF_ERROR(
      SelectPieceOf(feedback_.residual(), p, o.stats.k, o.stats.step, &sent));
  o.received[i] = sent;
  QuantizeValues(codec_.value, absl::MakeSpan(o.received[i].values));
  o.stats.select += absl::Now() - t;
  return absl::OkStatus();
}

absl::Status WorkerClient::PostRun(OverlappedStep& o, size_t first,
                                   size_t end) {
  const size_t s = piece_shard_[first];
  if (!o.in_parts) return PostWholeIfSelected(o, s, end - first);
  // The run's part of its shard's push goes out now (Push.piece_begin/
  // piece_end: the run's place among the shard's pieces), while the
  // other pieces are still being produced; the shard runs each piece's
  // round as soon as every worker's part holding it is in.
  const absl::Time t = absl::Now();
  v1::Push part = o.pushes[s];
  const uint32_t local = static_cast<uint32_t>(first - o.first_piece[s]);
  part.set_piece_begin(local);
  part.set_piece_end(static_cast<uint32_t>(local + (end - first)));
  if (local != 0) part.clear_buffers();  // buffers go with piece 0 only
  SparseVector entries;
  const SparseVector* run = &o.sent[first];
  if (end - first > 1) {
    for (size_t i = first; i < end; ++i) {
      entries.indices.insert(entries.indices.end(), o.sent[i].indices.begin(),
                             o.sent[i].indices.end());
      entries.values.insert(entries.values.end(), o.sent[i].values.begin(),
                            o.sent[i].values.end());
    }
    run = &entries;
  }
  const absl::Status st =
      EncodeSparse(*run, cluster_.n(), codec_, part.mutable_sparse());
  if (!st.ok()) return Prefixed(st, ShardName(s));
  o.stats.bytes_sent[s] += part.ByteSizeLong();
  ++o.stats.parts_sent;
  o.stats.encode += absl::Now() - t;
  // Under mu: once AbandonOverlappedStep has set `stop`, no part is
  // released any more.
  absl::MutexLock lock(&o.mu);
  if (!o.stop) o.gate.Post(s, std::move(part), end - first);
  return absl::OkStatus();
}

absl::Status WorkerClient::PostWholeIfSelected(OverlappedStep& o, size_t s,
                                               size_t selected) {
  o.pieces_left[s] -= selected;
  if (o.pieces_left[s] > 0) return absl::OkStatus();
  // Shard s's pieces are all selected: its whole push, in index order, as
  // the plain layer-wise step sends it (EncodePushes).
  const absl::Time t = absl::Now();
  SparseVector slice;
  for (size_t j = o.first_piece[s]; j < o.first_piece[s] + o.num_pieces[s];
       ++j) {
    slice.indices.insert(slice.indices.end(), o.sent[j].indices.begin(),
                         o.sent[j].indices.end());
    slice.values.insert(slice.values.end(), o.sent[j].values.begin(),
                        o.sent[j].values.end());
  }
  v1::Push whole = o.pushes[s];
  const absl::Status st =
      EncodeSparse(slice, cluster_.n(), codec_, whole.mutable_sparse());
  if (!st.ok()) return Prefixed(st, ShardName(s));
  o.stats.bytes_sent[s] = whole.ByteSizeLong();
  o.stats.encode += absl::Now() - t;
  absl::MutexLock lock(&o.mu);
  if (!o.stop) o.gate.Post(s, std::move(whole), o.num_pieces[s]);
  return absl::OkStatus();
}

void WorkerClient::CloseOverlappedSelection(OverlappedStep& o) {
  // Values never reported (parameters without a gradient this pass) are
  // taken as they are now.
  std::vector<std::pair<uint64_t, uint64_t>> gaps;
  {
    absl::MutexLock lock(&o.mu);
    uint64_t at = 0;
    for (const auto& [b, e] : o.reported) {
      if (b > at) gaps.emplace_back(at, b);
      at = e;
    }
    if (at < cluster_.n()) gaps.emplace_back(at, cluster_.n());
  }
  for (const auto& [b, e] : gaps) GradientReady(b, e).IgnoreError();
  {
    absl::MutexLock lock(&o.mu);
    o.closing = true;
  }
  o.selection.join();
}

absl::Status WorkerClient::CheckGradientUnchanged(
    const OverlappedStep& o) const {
  for (size_t i = 0; i < pieces_.size(); ++i) {
    const BucketPiece& p = pieces_[i];
    if (std::memcmp(o.gradient.data() + p.begin,
                    overlap_gradient_.data() + p.begin,
                    p.size() * sizeof(float)) == 0) {
      continue;
    }
    uint64_t at = p.begin;
    while (at < p.end &&
           std::memcmp(o.gradient.data() + at, overlap_gradient_.data() + at,
                       sizeof(float)) == 0) {
      ++at;
    }
    return absl::FailedPreconditionError(absl::StrCat(
        "step ", o.stats.step, ": the gradient at index ", at,
        " was written after it was reported (GradientReady): an overlapped "
        "step sends each bucket as backward produces it, so a change made "
        "after that would not be what was sent. Change the gradient after "
        "the exchange, or run the whole exchange after backward "
        "(overlap=False). The step was given up: Recover, then repeat it"));
  }
  return absl::OkStatus();
}

absl::StatusOr<StepStats> WorkerClient::FinishOverlappedStep(
    std::string* buffers_out) {
  if (overlapped_ == nullptr) {
    return absl::FailedPreconditionError(
        "FinishOverlappedStep: no overlapped step is open");
  }
  OverlappedStep& o = *overlapped_;
  const absl::Time finish_start = absl::Now();
  CloseOverlappedSelection(o);
  absl::Status selected;
  {
    absl::MutexLock lock(&o.mu);
    selected = o.select_status;
  }
  // The gradient must still be what was read: a write after GradientReady
  // would make this rank's update differ from what it sent.
  // (Not checked on the device: it would need a copy of every piece.)
  if (selected.ok() && !o.on_device()) selected = CheckGradientUnchanged(o);
  if (!selected.ok()) {
    // Pushes not yet written never go; the shards without one are told.
    AbandonOverlappedStep();
    return selected;
  }
  o.round.join();
  StepStats stats = std::move(o.stats);
  SparseVector sent, received;
  for (size_t i = 0; i < pieces_.size(); ++i) {
    sent.indices.insert(sent.indices.end(), o.sent[i].indices.begin(),
                        o.sent[i].indices.end());
    sent.values.insert(sent.values.end(), o.sent[i].values.begin(),
                       o.sent[i].values.end());
    received.indices.insert(received.indices.end(),
                            o.received[i].indices.begin(),
                            o.received[i].indices.end());
    received.values.insert(received.values.end(), o.received[i].values.begin(),
                           o.received[i].values.end());
  }
  stats.sent_pairs = sent.size();
  std::vector<v1::Pull> pulls = std::move(o.pulls);
  const absl::Status round = o.round_status;
  const absl::Time first_taken = o.first_taken;
  const absl::Duration push_time = o.push_time;
  const absl::Span<float> averaged = o.averaged;
  const absl::Span<float> params = o.params;
  float* const device_params = o.device_params;
  CUstream_st* const stream = o.stream;
  const bool on_device = o.on_device();
  overlapped_.reset();
  step_checksum_ = 0;
  step_buffers_.clear();
  GTOPK_RETURN_IF_ERROR(
      on_device ? EndOverlappedDeviceRound(round, std::move(sent), pulls,
                                           device_params, stream, &stats)
                : EndOverlappedRound(round, sent, received, pulls, params,
                                     averaged, &stats));
  stats.exposed = absl::Now() - finish_start;
  stats.push_wait = absl::Now() - std::min(first_taken == absl::InfiniteFuture()
                                               ? finish_start
                                               : first_taken,
                                           absl::Now());
  stats.push = std::min(push_time, stats.push_wait);
  stats.wait = stats.push_wait - stats.push;
  if (buffers_out != nullptr) buffers_out->swap(received_buffers_);
  received_buffers_.clear();
  check_next_step_ = false;
  ++next_step_;
  return stats;
}

absl::Status WorkerClient::EndOverlappedRound(
    const absl::Status& round, const SparseVector& sent,
    const SparseVector& received, const std::vector<v1::Pull>& pulls,
    absl::Span<float> params, absl::Span<float> averaged, StepStats* stats) {
  // The residual holds u everywhere now; the bookkeeping of what was sent,
  // as the host Step's and AggregateStep's, so that failure and success
  // leave the same state.
  GTOPK_RETURN_IF_ERROR(feedback_.MarkSent(sent, received));
  if (!round.ok()) return RestoreSent(received, round);
  absl::StatusOr<SparseVector> global = DecodePulls(stats->step, pulls, stats);
  if (!global.ok()) return RestoreSent(received, global.status());
  return ApplyGlobalOnHost(stats->step, sent, received, *global, pulls, params,
                           averaged, stats);
}

absl::Status WorkerClient::EndOverlappedDeviceRound(
    const absl::Status& round, SparseVector sent,
    const std::vector<v1::Pull>& pulls, float* params, CUstream_st* stream,
    StepStats* stats) {
  // Every piece's u is in the device's spare buffers: committed now, with
  // what was sent marked, so that failure and success leave the state the
  // device Step leaves.
  GTOPK_ASSIGN_OR_RETURN(
      const DeviceStep::Sent s,
      device_->Commit(std::move(sent), codec_.value, stream));
  if (!round.ok()) return device_->PutBackAll(s, round, stream);
  absl::StatusOr<SparseVector> global = DecodePulls(stats->step, pulls, stats);
  if (!global.ok()) return device_->PutBackAll(s, global.status(), stream);
  const absl::Time t = absl::Now();
  GTOPK_RETURN_IF_ERROR(device_->Apply(s, *global,
                                       mode_ == AggregationMode::kGtopk,
                                       cluster_.num_workers(), params, stream));
  stats->apply = absl::Now() - t;
  return absl::OkStatus();
}

void WorkerClient::RestoreFromBackups(const OverlappedStep& o,
                                      absl::Span<float> residual,
                                      absl::Span<float> velocity) const {
  for (size_t i = 0; i < pieces_.size(); ++i) {
    if (!o.accumulated[i]) continue;
    const BucketPiece& p = pieces_[i];
    std::copy(overlap_backup_.begin() + p.begin,
              overlap_backup_.begin() + p.end, residual.begin() + p.begin);
    if (o.params.empty()) continue;
    std::copy(overlap_velocity_backup_.begin() + p.begin,
              overlap_velocity_backup_.begin() + p.end,
              velocity.begin() + p.begin);
  }
}

void WorkerClient::AbandonOverlappedStep() {
  if (overlapped_ == nullptr) return;
  OverlappedStep& o = *overlapped_;
  {
    absl::MutexLock lock(&o.mu);
    o.stop = true;  // no push is released from now on
  }
  // The selection thread ends after its current piece; only then are the
  // pushes it was writing left alone, and the shards without theirs told.
  if (o.selection.joinable()) o.selection.join();
  o.gate.Abandon();
  // Shards whose push went out are waiting for their pull: the round fails
  // on the ones never pushed (CANCELLED), and PushPullRound cuts the others
  // short after its failure grace.
  if (o.round.joinable()) o.round.join();
  // As before the step: the residual (and, --apply=servers, the local
  // velocity) of every accumulated piece (nothing was marked sent yet; that
  // happens in Finish).
  RestoreFromBackups(o, feedback_.mutable_residual(),
                     absl::MakeSpan(velocity_));
  overlapped_.reset();
  step_checksum_ = 0;
  step_buffers_.clear();
  received_buffers_.clear();
}

}  // namespace worker
}  // namespace gtopk
