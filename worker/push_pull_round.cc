// WorkerClient::PushPullRound (worker/client.h): one step's pushes written
// to the S shards' PushPull streams and their pulls read, one thread per
// shard, under the step watchdog; a failure on one shard cuts the others
// short. Used by both Step overloads (worker/client_step.cc).
#include <algorithm>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/epoch.h"
#include "common/grpc_edge/grpc_edge.h"
#include "grpcpp/channel.h"
#include "worker/client.h"
#include "worker/client_internal.h"

namespace gtopk {
namespace worker {

// One PushPullRound's state, shared by the shards' threads and the thread
// that waits for them (AwaitShards). Fields marked (mu) are guarded by mu;
// the others are written only by the waiting thread, and read after the
// threads joined. The shards' threads report through Finished, Written and
// LearnedEpoch.
struct WorkerClient::PushPullState {
  PushPullState(size_t num_shards, absl::Duration watchdog_budget)
      : budget(watchdog_budget),
        results(num_shards),
        done(num_shards, false),
        cancelled(num_shards, false),
        timed_out(num_shards, false),
        unreachable(num_shards, false),
        cut_short(num_shards, false) {}

  // The step watchdog: the cluster's step timeout plus
  // ClientOptions::step_watchdog_margin.
  const absl::Duration budget;
  const absl::Time start = absl::Now();
  absl::Mutex mu;
  absl::Time last_written = start;    // (mu) when the last push was written
  std::vector<absl::Status> results;  // (mu) each shard's outcome
  std::vector<bool> done;             // (mu) results[s] is final
  size_t finished = 0;                // (mu) shards done
  size_t failed = 0;                  // (mu) shards done with an error
  uint64_t learned_epoch = 0;         // (mu) from failed streams' trailers
  // Shards whose stream the watchdog has cancelled (mu): a stream reopened
  // for them after that must start cancelled, or opening it
  // (wait-for-ready, no deadline) would block on a dead shard for ever.
  std::vector<bool> cancelled;
  // Shards cancelled at the watchdog deadline.
  std::vector<bool> timed_out;
  // Shards cancelled because their channel could not connect for
  // kShardUnreachableGrace (the process is gone or restarting).
  std::vector<bool> unreachable;
  // Shards cancelled because another shard already failed the step: a step
  // that failed on one shard cannot be committed on any (the commit vote),
  // so waiting for the others would only delay the caller's retry or
  // recovery until their step timeout.
  std::vector<bool> cut_short;

  // Shard s's thread is done with `result`.
  void Finished(size_t s, absl::Status result) {
    absl::MutexLock lock(&mu);
    if (!result.ok()) ++failed;
    results[s] = std::move(result);
    done[s] = true;
    ++finished;
  }
  // A push was written now.
  void Written() {
    absl::MutexLock lock(&mu);
    last_written = std::max(last_written, absl::Now());
  }
  // A failed stream's trailers carried `epoch` (non-zero).
  void LearnedEpoch(uint64_t epoch) {
    absl::MutexLock lock(&mu);
    learned_epoch = std::max(learned_epoch, epoch);
  }
};

namespace {

// After one shard failed a step, how long the others may still report
// their own errors before their streams are cancelled.
constexpr absl::Duration kFailureGrace = absl::Milliseconds(250);

// A shard whose channel has failed to connect (TRANSIENT_FAILURE: refused,
// reset) and not been READY since, for this long while a step waits for
// it, fails the step naming it (UNAVAILABLE) instead of at the step
// watchdog: a shard killed between steps is noticed in about a second
// (issue 42). Checked every kReachabilityPoll.
constexpr absl::Duration kShardUnreachableGrace = absl::Seconds(1);
constexpr absl::Duration kReachabilityPoll = absl::Milliseconds(100);

// AwaitShards' view of the shards' channels during one step: which shard
// has failed to connect (TRANSIENT_FAILURE) and not been READY since, for
// kShardUnreachableGrace. Used by the waiting thread only.
class ReachabilityWatch {
 public:
  explicit ReachabilityWatch(size_t num_shards)
      : down_since_(num_shards, absl::InfiniteFuture()),
        connect_failed_(num_shards, false) {}

  // Looks at shard s's `channel` at `now`: true once it has been failing to
  // connect for the grace.
  bool Unreachable(size_t s, grpc::Channel* channel, absl::Time now) {
    const grpc_connectivity_state state =
        channel->GetState(/*try_to_connect=*/false);
    if (state == GRPC_CHANNEL_READY || state == GRPC_CHANNEL_IDLE) {
      down_since_[s] = absl::InfiniteFuture();
      connect_failed_[s] = false;
      return false;
    }
    if (state != GRPC_CHANNEL_TRANSIENT_FAILURE) return false;  // CONNECTING
    if (!connect_failed_[s]) {
      // First failure seen in this step: try again at once (the channel
      // may be in a reconnect backoff from before the shard came back),
      // and count the grace from now.
      connect_failed_[s] = true;
      down_since_[s] = now;
      grpc::experimental::ChannelResetConnectionBackoff(channel);
      return false;
    }
    return now - down_since_[s] >= kShardUnreachableGrace;
  }

 private:
  // Per shard: when its channel was first seen failing to connect in this
  // step (CONNECTING alone may be a slow network, and is waited for).
  std::vector<absl::Time> down_since_;
  std::vector<bool> connect_failed_;
};

// The attempt epoch a shard sent in a failed stream's trailers
// (common/epoch.h), or 0 when there is none. Epochs start at the leader's
// start time in microseconds: a far-future one is ignored.
uint64_t EpochFromTrailers(const grpc::ClientContext& context) {
  const auto& trailers = context.GetServerTrailingMetadata();
  const auto it = trailers.find(kEpochMetadataKey);
  if (it == trailers.end()) return 0;
  uint64_t epoch = 0;
  if (!absl::SimpleAtoi(absl::string_view(it->second.data(), it->second.size()),
                        &epoch) ||
      !IsPlausibleEpoch(epoch)) {
    return 0;
  }
  return epoch;
}

// The status of a stream that ended without its pull: the server's, or
// UNAVAILABLE when it closed the stream with OK; gRPC's refusal of an
// oversized message ("... message larger than max ...") says which limit
// to raise. Other RESOURCE_EXHAUSTED (a server's call bounds) keep their
// own message, which names their bound.
absl::Status StreamFailure(const grpc::Status& st, int64_t step,
                           uint64_t max_message_bytes) {
  absl::Status result =
      st.ok() ? absl::UnavailableError(absl::StrCat(
                    "stream closed by the server during step ", step))
              : FromGrpcStatus(st);
  if (absl::IsResourceExhausted(result) &&
      absl::StrContains(result.message(), "larger than max")) {
    result = absl::ResourceExhaustedError(absl::StrCat(
        result.message(),
        " (a push or pull exceeds the cluster's max_message_bytes = ",
        max_message_bytes,
        "; raise the servers' --max-message-bytes, or use more shards "
        "or a lower density)"));
  }
  return result;
}

}  // namespace

absl::Status WorkerClient::PushPullRound(int64_t step,
                                         const std::vector<v1::Push>& pushes,
                                         std::vector<v1::Pull>* pulls,
                                         absl::Duration* push_time,
                                         PushGate* gate) {
  const size_t S = shards_.size();
  pulls->assign(S, v1::Pull());
  PushPullState round(S, absl::Milliseconds(cluster_.step_timeout_ms()) +
                             options_.step_watchdog_margin);
  for (auto& c : shards_) {
    if (c->stream == nullptr) {
      SetStreamContext(*c);
      c->broken = false;
    }
  }
  std::vector<std::thread> threads;
  threads.reserve(S);
  for (size_t s = 0; s < S; ++s) {
    threads.emplace_back([&, s] {
      round.Finished(
          s,
          gate != nullptr
              ? PushPartsOnShard(s, step, pushes[s], *gate, &(*pulls)[s], round)
              : PushPullOnShard(s, step, pushes[s], &(*pulls)[s], round));
    });
  }
  // An overlapped step's watchdog counts from its last push's release (the
  // backward pass before it is the caller's time).
  if (gate != nullptr) gate->AwaitSettled();
  AwaitShards(round);
  for (auto& t : threads) t.join();
  *push_time = round.last_written - round.start;
  epoch_ = std::max(epoch_, round.learned_epoch);

  const absl::Status status = RoundStatus(step, round);
  if (status.ok()) return status;
  for (const absl::Status& st : round.results) {
    if (absl::IsFailedPrecondition(st) &&
        absl::StrContains(st.message(), kResultNotKeptMarker)) {
      result_not_kept_step_ = step;  // Recover: do not expect it again
    }
  }
  // The leader's stream stays open when its part of the step succeeded:
  // cancelled now, the rank would have no stream on the leader until the
  // Recover that follows the backoff, and a Join could take it (issue 42).
  // A step retried without a Recover reuses it (a repeated push is a
  // retry).
  CloseStreams(/*keep_leader=*/true);
  return ExplainFingerprintRefusal(status);
}

absl::Status WorkerClient::PushPullOnShard(size_t s, int64_t step,
                                           const v1::Push& push, v1::Pull* pull,
                                           PushPullState& round) {
  const bool written = WriteOnShard(s, push, /*reopen=*/true, round);
  if (written && shards_[s]->stream->Read(pull)) return absl::OkStatus();
  return ShardStreamFailed(s, step, /*drain=*/!written, round);
}

bool WorkerClient::WriteOnShard(size_t s, const v1::Push& push, bool reopen,
                                PushPullState& round) {
  ShardConn& c = *shards_[s];
  if (c.stream == nullptr) c.stream = c.stub->PushPull(c.context.get());
  bool written = c.stream->Write(push);
  if (!written && reopen) {
    // The stream died before this push got through (e.g. the shard
    // restarted since the last step): finish it and push once more on a
    // fresh stream. Safe: a shard takes one push per (step, worker) and
    // treats a repeat as a retry.
    v1::Pull ignored;
    while (c.stream->Read(&ignored)) {
    }
    c.stream->Finish().IgnoreError();
    {
      absl::MutexLock lock(&round.mu);  // the watchdog cancels under mu
      c.stream.reset();
      SetStreamContext(c);
      // Cancelling a context before its call starts cancels the call
      // when it starts (grpc::ClientContext::TryCancel).
      if (round.cancelled[s]) c.context->TryCancel();
    }
    c.stream = c.stub->PushPull(c.context.get());
    written = c.stream->Write(push);
  }
  if (written) round.Written();
  return written;
}

absl::Status WorkerClient::ShardStreamFailed(size_t s, int64_t step, bool drain,
                                             PushPullState& round) {
  ShardConn& c = *shards_[s];
  // Finish needs every incoming message read; after a failed Read there
  // are none left.
  v1::Pull ignored;
  while (drain && c.stream->Read(&ignored)) {
  }
  const grpc::Status st = c.stream->Finish();
  c.broken = true;
  // The shard numbers a failed attempt (common/epoch.h): this worker's
  // next push of the step is a retry of it.
  if (const uint64_t epoch = EpochFromTrailers(*c.context); epoch != 0) {
    round.LearnedEpoch(epoch);
  }
  return StreamFailure(st, step, cluster_.max_message_bytes());
}

void WorkerClient::AwaitShards(PushPullState& round) const {
  const size_t S = shards_.size();
  absl::MutexLock lock(&round.mu);
  // Cancels every shard still out, marking it in `why`.
  auto cancel_unfinished = [&](std::vector<bool>& why) {
    for (size_t s = 0; s < S; ++s) {
      if (!round.done[s]) {
        why[s] = true;
        round.cancelled[s] = true;
        shards_[s]->context->TryCancel();
      }
    }
  };
  auto all_done_or_failed = [&] {
    return round.finished == S || round.failed > 0;
  };
  auto all_done = [&] { return round.finished == S; };
  const absl::Time watchdog = absl::Now() + round.budget;
  ReachabilityWatch reachability(S);
  bool settled = false;
  while (!settled) {
    settled = round.mu.AwaitWithDeadline(
        absl::Condition(&all_done_or_failed),
        std::min(watchdog, absl::Now() + kReachabilityPoll));
    if (settled || absl::Now() >= watchdog) break;
    const absl::Time now = absl::Now();
    bool cancelled_any = false;
    for (size_t s = 0; s < S; ++s) {
      if (round.done[s] || round.cancelled[s]) continue;
      if (reachability.Unreachable(s, shards_[s]->channel.get(), now)) {
        round.unreachable[s] = true;
        round.cancelled[s] = true;
        shards_[s]->context->TryCancel();
        cancelled_any = true;
      }
    }
    if (cancelled_any) {
      // The step fails on those; the others are cut short as below.
      settled = true;
    }
  }
  if (!settled) {
    cancel_unfinished(round.timed_out);
  } else if (round.finished < S &&
             !round.mu.AwaitWithDeadline(
                 absl::Condition(&all_done),
                 std::min(watchdog, absl::Now() + kFailureGrace))) {
    // A short grace first: shards failing at about the same time (e.g.
    // all at the step deadline) still report their own, often more
    // telling, errors.
    cancel_unfinished(round.cut_short);
  }
  round.mu.Await(absl::Condition(&all_done));  // prompt after the cancel
}

absl::Status WorkerClient::RoundStatus(int64_t step,
                                       const PushPullState& round) const {
  const size_t S = shards_.size();
  std::vector<std::string> messages;
  absl::StatusCode code = absl::StatusCode::kOk;
  for (size_t s = 0; s < S; ++s) {
    absl::Status st = round.results[s];
    if (round.unreachable[s]) {
      st = absl::UnavailableError(absl::StrCat(
          "unreachable: no connection for ",
          absl::FormatDuration(kShardUnreachableGrace), " while step ", step,
          " waited for it (the shard process is down or restarting; the "
          "worker recovers once it is back)"));
    } else if (round.timed_out[s]) {
      st = absl::DeadlineExceededError(absl::StrCat(
          "no pull for step ", step, " within ",
          absl::FormatDuration(round.budget), " (step timeout ",
          cluster_.step_timeout_ms(), "ms + margin); ", "stream cancelled"));
    }
    if (st.ok() || round.cut_short[s]) continue;
    // The step's cause, not its echo: ABORTED means "failed elsewhere"
    // (another shard, another worker), so any other code a shard reports
    // (e.g. FAILED_PRECONDITION for an update that would not be finite, on
    // the shard where it happened) is the step's code.
    if (code == absl::StatusCode::kOk ||
        (code == absl::StatusCode::kAborted && !absl::IsAborted(st))) {
      code = st.code();
    }
    messages.push_back(absl::StrCat(ShardName(s), ": ", st.message()));
  }
  if (code == absl::StatusCode::kOk) {
    bool any_cut = false;
    for (size_t s = 0; s < S; ++s) {
      any_cut |= round.cut_short[s] && !round.results[s].ok();
    }
    if (!any_cut) return absl::OkStatus();
    code = absl::StatusCode::kInternal;  // unreachable: a failure cut it
  }
  return absl::Status(code, absl::StrJoin(messages, "; "));
}

}  // namespace worker
}  // namespace gtopk
