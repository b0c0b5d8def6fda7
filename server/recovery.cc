// AggregatorService's crash recovery and fail fast (docs/recovery.md): a
// shard's own state and rollback (LocalShardState, LocalRollback and their
// RPCs GetShardState, RollbackShard), the leader's Recover (RecoverCluster:
// read every shard's state, choose the target with ChooseRecoveryTarget,
// server/recovery_target.h, roll every shard back to it), and AbortStep, by
// which a step that failed on one shard fails on every shard. The class is
// declared in server/service.h; its RPC handlers for training are in
// server/service.cc, server/push_pull.cc and server/download.cc.
#include <algorithm>
#include <cstdio>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/epoch.h"
#include "common/grpc_edge/grpc_edge.h"
#include "common/status_macros.h"
#include "grpcpp/client_context.h"
#include "server/checkpoint.h"
#include "server/recovery_target.h"
#include "server/service.h"
#include "server/service_internal.h"

namespace gtopk {
namespace server {

using internal::ContextDeadline;
using internal::kPollInterval;

namespace {

// Longest an AbortStep message may take (it is advice: a shard that misses
// it still fails its round at its own step deadline).
constexpr absl::Duration kAbortStepTimeout = absl::Seconds(5);
// Longest AbortStep reason kept (it is forwarded into every shard's status).
constexpr size_t kMaxAbortReasonBytes = 1024;
// How far past or before its next step the leader takes an AbortStep:
// shards run in lockstep with the leader's commits, so a shard's current
// step is at most one or two from it; the rest of the window is slack. A
// failure reported for a step outside it is refused (INVALID_ARGUMENT): no
// shard is there, and each would cost an epoch, a tombstone and a forward.
constexpr int64_t kAbortStepWindow = 16;

// "shard 1 (host:port): message", code kept.
absl::Status FromShard(const grpc::Status& status, uint32_t shard,
                       const std::string& address, const char* rpc) {
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                      absl::StrCat("shard ", shard, " (", address, ") ", rpc,
                                   ": ", status.error_message()));
}

// How a step that failed on shard `origin` for `reason` fails on the
// others (AbortStep): ABORTED, retried after Recover; but a divergence
// alarm (kDivergedMarker) stays FAILED_PRECONDITION, as every shard finds
// it on its own: the same checksums fail any retry.
absl::Status StepFailedOnShard(int64_t step, uint32_t origin,
                               absl::string_view reason) {
  const std::string what =
      absl::StrCat("step ", step, " failed on shard ", origin, ": ", reason);
  if (absl::StrContains(reason, kDivergedMarker)) {
    return absl::FailedPreconditionError(what);
  }
  return absl::AbortedError(
      absl::StrCat(what, " (the worker retries the step after Recover)"));
}

// The answer to Recover for `plan` (the epoch is RecoverCluster's).
v1::RecoverResponse ResponseFor(const RecoveryPlan& plan) {
  v1::RecoverResponse response;
  for (int64_t step : plan.previous_steps) response.add_previous_steps(step);
  response.set_next_step(plan.target_step);
  response.set_rolled_back(plan.rollback);
  return response;
}

}  // namespace

// ---------------------------------------------------------------------------
// Crash recovery (docs/recovery.md)

absl::StatusOr<v1::ShardState> AggregatorService::LocalShardState(
    absl::Time deadline, bool settle) {
  v1::ShardState state;
  state.set_shard_id(config_.shard_id);
  state.set_cluster_fingerprint(fingerprint_.load());
  ShardAggregator* const aggregator = this->aggregator();
  if (aggregator == nullptr) return state;  // no parameters: not initialised
  absl::StatusOr<int64_t> next = aggregator->SettledNextStep(deadline, settle);
  if (absl::IsFailedPrecondition(next.status())) return state;
  GTOPK_RETURN_IF_ERROR(next.status());
  state.set_initialized(true);
  state.set_next_step(*next);
  GTOPK_ASSIGN_OR_RETURN(const std::vector<int64_t> steps,
                         checkpointer_.StepsUpTo(*next));
  for (int64_t s : steps) state.add_checkpoint_steps(s);
  return state;
}

absl::StatusOr<int64_t> AggregatorService::LocalRollback(int64_t step) {
  const std::string shard = absl::StrCat("shard ", config_.shard_id);
  if (step < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(shard, ": cannot roll back to negative step ", step));
  }
  ShardAggregator* const aggregator = this->aggregator();
  if (aggregator == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat(shard, " has no parameters to roll back"));
  }
  // Serialised with checkpoint writes (the Checkpointer's lock).
  return checkpointer_.RollBack(aggregator, step);
}

// ---------------------------------------------------------------------------
// Fail fast across shards (AbortStep)

void AggregatorService::OnLocalStepFailed(int64_t step,
                                          const absl::Status& reason) {
  // Called under the aggregator's lock: only queue the work.
  if (config_.num_shards == 1) return;  // nobody else to tell
  std::string why = BoundedStatusMessage(reason.message());
  if (why.size() > kMaxAbortReasonBytes) why.resize(kMaxAbortReasonBytes);
  if (is_leader()) {
    notifier_.Post([this, step, why] { LeaderAbortStep(step, 0, why); });
    return;
  }
  notifier_.Post([this, step, why] {
    const absl::Time deadline =
        absl::Now() + std::min(config_.step_timeout, kAbortStepTimeout);
    v1::AbortStepRequest request;
    request.set_step(step);
    request.set_shard_id(config_.shard_id);
    request.set_reason(why);
    v1::AbortStepResponse response;
    const grpc::Status st = CallUntilAdmitted(deadline, "AbortStep", [&] {
      grpc::ClientContext context;
      context.set_deadline(absl::ToChronoTime(deadline));
      return leader_stub_->AbortStep(&context, request, &response);
    });
    if (!st.ok()) {
      // Best effort: the other shards then fail the step at their deadline.
      std::fprintf(stderr,
                   "gtopk-server shard %u: telling leader %s that step %lld "
                   "failed here: %s\n",
                   config_.shard_id, config_.peers[0].c_str(),
                   static_cast<long long>(step), st.error_message().c_str());
    }
  });
}

void AggregatorService::LeaderAbortStep(int64_t step, uint32_t origin,
                                        const std::string& reason) {
  const uint32_t S = config_.num_shards;
  if (!is_leader() || S == 1) return;
  const absl::Status aborted = StepFailedOnShard(step, origin, reason);
  // A committed step cannot have failed anywhere: a stale message.
  const uint64_t epoch = ++epoch_;
  if (!commit_coordinator_->Abort(step, aborted, epoch)) return;
  coordinator_->Abort(step, aborted, epoch);
  ShardAggregator* const aggregator = this->aggregator();
  if (aggregator != nullptr) aggregator->AbortStep(step, aborted, epoch);
  // Every other shard, the origin too (it then refuses the failed attempt's
  // late pushes as well). One queued forward per step: a later failure of
  // the same step updates it (the newest epoch is what the shards keep).
  if (!abort_forwards_.Queue(step,
                             AbortForwards::Pending{origin, reason, epoch})) {
    return;
  }
  notifier_.Post([this, step] { ForwardAbort(step); });
}

void AggregatorService::ForwardAbort(int64_t step) {
  std::optional<AbortForwards::Pending> pending = abort_forwards_.Take(step);
  if (!pending.has_value()) return;
  const uint32_t origin = pending->origin;
  const uint64_t epoch = pending->epoch;
  const std::string& reason = pending->reason;
  std::vector<std::thread> threads;
  for (uint32_t s = 1; s < config_.num_shards; ++s) {
    threads.emplace_back([this, s, step, origin, epoch, &reason] {
      grpc::ClientContext context;
      context.set_deadline(absl::ToChronoTime(
          absl::Now() + std::min(config_.step_timeout, kAbortStepTimeout)));
      v1::AbortStepRequest request;
      request.set_step(step);
      request.set_shard_id(origin);
      request.set_reason(reason);
      request.set_epoch(epoch);
      v1::AbortStepResponse response;
      // Best effort (a shard that is down has no round to fail).
      peer_stubs_[s]->AbortStep(&context, request, &response).IgnoreError();
    });
  }
  for (auto& t : threads) t.join();
}

grpc::Status AggregatorService::AbortStep(grpc::ServerContext* context,
                                          const v1::AbortStepRequest* request,
                                          v1::AbortStepResponse* /*response*/) {
  // Shard -> leader: the caller is the shard where the step failed;
  // leader -> shard: the caller is the leader.
  absl::StatusOr<Call> call = Enter(
      context, CallRules::Shard("AbortStep",
                                is_leader() ? request->shard_id() : uint32_t{0})
                   .Peer(ShardPeer(context, request->shard_id())));
  if (!call.ok()) return ToGrpcStatus(call.status());
  if (request->step() < 0 || request->shard_id() >= config_.num_shards) {
    return ToGrpcStatus(absl::InvalidArgumentError(
        absl::StrCat("AbortStep: step ", request->step(),
                     " must be >= 0 and shard_id ", request->shard_id(),
                     " below --num-shards (", config_.num_shards, ")")));
  }
  // A far-future epoch is not a leader's (IsPlausibleEpoch).
  const absl::Time now = absl::Now();
  if (!is_leader() && !IsPlausibleEpoch(request->epoch(), now)) {
    return ToGrpcStatus(absl::InvalidArgumentError(
        absl::StrCat("AbortStep: epoch ", request->epoch(),
                     " is more than a day ahead of this shard's clock (",
                     absl::ToUnixMicros(now), " us since the Unix epoch)")));
  }
  // The reason travels on to every worker of the step: keep it short.
  const std::string reason = request->reason().size() > kMaxAbortReasonBytes
                                 ? BoundedStatusMessage(request->reason())
                                       .substr(0, kMaxAbortReasonBytes)
                                 : request->reason();
  if (is_leader()) {
    // A shard fails the step it is at, at most a step or two past the
    // leader's next one: a step far ahead is no shard's (the break-it
    // run's flood of AbortStep for steps 5,000,000 and up queued a forward
    // and a tombstone for each).
    const int64_t next = std::max<int64_t>(0, next_step());
    if (request->step() > next + kAbortStepWindow) {
      return ToGrpcStatus(absl::InvalidArgumentError(
          absl::StrCat("AbortStep: step ", request->step(), " is more than ",
                       kAbortStepWindow, " steps past the leader's next step ",
                       next, " (a shard fails the step it is at)")));
    }
    // Nor long before it (a second break-it run: 60,000 reports of old
    // steps, each an epoch bump and possibly a forward).
    if (request->step() < next - kAbortStepWindow) {
      return ToGrpcStatus(absl::InvalidArgumentError(absl::StrCat(
          "AbortStep: step ", request->step(), " is more than ",
          kAbortStepWindow, " steps before the leader's next step ", next,
          " (a shard fails the step it is at)")));
    }
    LeaderAbortStep(request->step(), request->shard_id(), reason);
    return grpc::Status::OK;
  }
  ShardAggregator* const aggregator = this->aggregator();
  if (aggregator != nullptr) {
    aggregator->AbortStep(
        request->step(),
        StepFailedOnShard(request->step(), request->shard_id(), reason),
        request->epoch());
  }
  return grpc::Status::OK;
}

grpc::Status AggregatorService::GetShardState(
    grpc::ServerContext* context, const v1::ShardStateRequest* request,
    v1::ShardState* response) {
  absl::StatusOr<Call> call = Enter(
      context,
      CallRules::Shard("GetShardState", uint32_t{0}).Peer(CallPeerShard(0)));
  if (!call.ok()) return ToGrpcStatus(call.status());
  // In slices, so that a cancelled call (the leader went away) ends it.
  const absl::Time deadline = WaitDeadline(context);
  if (request->cluster_fingerprint() != 0 && fingerprint_.load() != 0) {
    const absl::Status same =
        CheckFingerprint(request->cluster_fingerprint(),
                         "GetShardState from the leader ", deadline);
    if (!same.ok()) return ToGrpcStatus(same);
  }
  // A shard restarted from another run's checkpoint must not have the
  // cluster rolled back to it.
  if (const absl::Status run = CheckRunId(request->run_id()); !run.ok()) {
    ReportReadiness(run);
    return ToGrpcStatus(run);
  }
  // The failures this shard has seen reach the leader before its state
  // does (its queued AbortStep calls): the Recover that reads it answers
  // with the epoch of each, so the workers' retry is not taken for the
  // failed attempt when the message lands during it.
  notifier_.Flush(std::min(deadline, absl::Now() + kAbortStepTimeout));
  absl::StatusOr<v1::ShardState> state;
  do {
    state = LocalShardState(std::min(deadline, absl::Now() + kPollInterval),
                            !request->without_settling());
  } while (absl::IsDeadlineExceeded(state.status()) && absl::Now() < deadline &&
           !context->IsCancelled());
  if (!state.ok()) return ToGrpcStatus(state.status());
  *response = *std::move(state);
  return grpc::Status::OK;
}

grpc::Status AggregatorService::RollbackShard(
    grpc::ServerContext* context, const v1::RollbackRequest* request,
    v1::RollbackResponse* response) {
  absl::StatusOr<Call> call = Enter(
      context,
      CallRules::Shard("RollbackShard", uint32_t{0}).Peer(CallPeerShard(0)));
  if (!call.ok()) return ToGrpcStatus(call.status());
  if (request->shard_id() != config_.shard_id) {
    return ToGrpcStatus(absl::InvalidArgumentError(
        absl::StrCat("rollback for shard ", request->shard_id(),
                     " was sent to shard ", config_.shard_id)));
  }
  if (request->cluster_fingerprint() != 0 && fingerprint_.load() != 0) {
    const absl::Status same = CheckFingerprint(request->cluster_fingerprint(),
                                               "RollbackShard from the leader ",
                                               WaitDeadline(context));
    if (!same.ok()) return ToGrpcStatus(same);
  }
  absl::StatusOr<int64_t> previous = LocalRollback(request->step());
  if (!previous.ok()) return ToGrpcStatus(previous.status());
  response->set_previous_next_step(*previous);
  return grpc::Status::OK;
}

AggregatorService::LeaderFence AggregatorService::FenceLeader(
    const absl::Status& reason) {
  commit_coordinator_->Fence(reason);
  coordinator_->Fence(reason);
  return LeaderFence(this);
}

AggregatorService::LeaderFence::~LeaderFence() {
  if (service_ == nullptr) return;
  service_->coordinator_->Unfence();
  service_->commit_coordinator_->Unfence();
}

absl::StatusOr<v1::RecoverResponse> AggregatorService::RecoverCluster(
    absl::Time deadline, std::optional<int64_t> resume_step) {
  if (!is_leader()) {
    return absl::FailedPreconditionError(
        absl::StrCat("shard ", config_.shard_id,
                     " is not the leader; Recover goes to ", config_.peers[0]));
  }
  // The kind of recovery: -1 a plain one, else the step resumed at.
  // Callers of the same kind share one run; another kind waits for the
  // running one to finish, then runs its own.
  const int64_t kind = resume_step.has_value() ? *resume_step : -1;
  return recovery_.RunOrJoin(
      kind, deadline + kLeaderDeadlineSlack,
      [&]() -> absl::StatusOr<v1::RecoverResponse> {
        absl::StatusOr<v1::RecoverResponse> result =
            resume_step.has_value() ? ResumeClusterOnce(*resume_step, deadline)
                                    : RecoverClusterOnce(deadline);
        // The workers push their retry with the epoch of every failure
        // heard of so far (the AbortStep messages were flushed first).
        if (result.ok()) result->set_epoch(epoch_.load());
        return result;
      });
}

std::vector<absl::StatusOr<v1::ShardState>> AggregatorService::ReadShardStates(
    absl::Time deadline, bool settle) {
  const uint32_t S = config_.num_shards;
  std::vector<absl::StatusOr<v1::ShardState>> states(
      S, absl::UnknownError("not asked"));
  std::vector<std::thread> threads;
  for (uint32_t s = 0; s < S; ++s) {
    threads.emplace_back([&, s] {
      if (s == 0) {
        states[s] = LocalShardState(deadline, settle);
        return;
      }
      v1::ShardState state;
      v1::ShardStateRequest request;
      request.set_cluster_fingerprint(fingerprint_.load());
      request.set_without_settling(!settle);
      request.set_run_id(run_id_.load());
      const grpc::Status st = CallUntilAdmitted(deadline, "GetShardState", [&] {
        grpc::ClientContext ctx;
        ctx.set_deadline(absl::ToChronoTime(deadline));
        // A shard that is restarting is waited for (up to the deadline).
        ctx.set_wait_for_ready(true);
        return peer_stubs_[s]->GetShardState(&ctx, request, &state);
      });
      if (!st.ok()) {
        states[s] = FromShard(st, s, config_.peers[s], "GetShardState");
      } else if (state.shard_id() != s) {
        states[s] = absl::FailedPreconditionError(
            absl::StrCat("the server at ", config_.peers[s], " is shard ",
                         state.shard_id(), ", not shard ", s));
      } else {
        states[s] = std::move(state);
      }
    });
  }
  for (auto& t : threads) t.join();
  return states;
}

std::optional<v1::RecoverResponse> AggregatorService::AgreedWithoutFence(
    absl::Time deadline) {
  // When every shard is at the same step (workers that were paused, a step
  // that timed out, a shard restarted from a checkpoint of the current
  // step), there is nothing to repair, and a fence would abort the rounds
  // that workers who recovered earlier are already running (concurrent
  // Recover calls then abort each other's retries). Shards answer at once,
  // also while computing a round: that round may be waiting for the very
  // worker that is recovering (its push to another shard is missing), so
  // waiting for it would only time out -- and a fence would abort it, and
  // the next worker's Recover the retry after it. A step being computed is
  // not applied yet, and commits on every shard or on none, so equal next
  // steps are a safe answer.
  const absl::Time quick =
      std::min(deadline, absl::Now() + std::max(config_.step_timeout / 4,
                                                absl::Milliseconds(200)));
  const absl::StatusOr<RecoveryPlan> plan =
      ChooseRecoveryTarget(ReadShardStates(quick, /*settle=*/false));
  // Anything but agreement (an unreadable shard, one without parameters,
  // different steps) is looked at again behind the fence.
  if (!plan.ok() || plan->rollback) return std::nullopt;
  // The workers' next attempt of a failed step may vote again.
  return ResponseFor(*plan);
}

absl::Status AggregatorService::RollBackShardsTo(int64_t target,
                                                 absl::Time deadline) {
  const uint32_t S = config_.num_shards;
  std::vector<absl::Status> rolled(S);
  {
    std::vector<std::thread> threads;
    for (uint32_t s = 0; s < S; ++s) {
      threads.emplace_back([&, s] {
        if (s == 0) {
          rolled[s] = LocalRollback(target).status();
          return;
        }
        v1::RollbackRequest request;
        request.set_shard_id(s);
        request.set_step(target);
        request.set_cluster_fingerprint(fingerprint_.load());
        v1::RollbackResponse reply;
        const grpc::Status st =
            CallUntilAdmitted(deadline, "RollbackShard", [&] {
              grpc::ClientContext ctx;
              ctx.set_deadline(absl::ToChronoTime(deadline));
              ctx.set_wait_for_ready(true);
              return peer_stubs_[s]->RollbackShard(&ctx, request, &reply);
            });
        if (!st.ok())
          rolled[s] = FromShard(st, s, config_.peers[s], "RollbackShard");
      });
    }
    for (auto& t : threads) t.join();
  }
  std::vector<std::string> errors;
  absl::StatusCode code = absl::StatusCode::kOk;
  for (uint32_t s = 0; s < S; ++s) {
    if (rolled[s].ok()) continue;
    if (code == absl::StatusCode::kOk) code = rolled[s].code();
    errors.push_back(std::string(rolled[s].message()));
  }
  if (errors.empty()) return absl::OkStatus();
  // Shards that did roll back are at `target`, the others where they were:
  // they still disagree, so no step can be committed, and the next Recover
  // completes the rollback.
  return absl::Status(
      code, absl::StrCat("Recover: rollback to step ", target,
                         " incomplete: ", absl::StrJoin(errors, "; ")));
}

absl::StatusOr<v1::RecoverResponse> AggregatorService::RecoverClusterOnce(
    absl::Time deadline) {
  // The AbortStep messages of failures so far reach every shard first, so
  // that the workers' retries after this recovery meet no stale round.
  notifier_.Flush(std::min(deadline, absl::Now() + kAbortStepTimeout));
  if (std::optional<v1::RecoverResponse> agreed =
          AgreedWithoutFence(deadline)) {
    return *std::move(agreed);
  }
  // Fence the commit vote and the threshold exchange: no step can be
  // committed while the shards' states are read, and rounds being computed
  // fail quickly instead of waiting for a shard that will not come.
  const auto unfence =
      FenceLeader(absl::AbortedError("the leader is recovering the cluster"));

  // Every shard's state, in parallel (each call bounded by `deadline`).
  GTOPK_ASSIGN_OR_RETURN(
      const RecoveryPlan plan,
      ChooseRecoveryTarget(ReadShardStates(deadline, /*settle=*/true)));
  if (!plan.rollback) return ResponseFor(plan);
  std::fprintf(stderr,
               "gtopk-server leader: shards disagree (%s); rolling back to "
               "step %lld\n",
               plan.shard_states.c_str(),
               static_cast<long long>(plan.target_step));
  // Steps >= target are voted on and exchanged afresh.
  commit_coordinator_->ForgetFrom(plan.target_step);
  coordinator_->ForgetFrom(plan.target_step);
  GTOPK_RETURN_IF_ERROR(RollBackShardsTo(plan.target_step, deadline));
  return ResponseFor(plan);
}

absl::StatusOr<v1::RecoverResponse> AggregatorService::ResumeClusterOnce(
    int64_t step, absl::Time deadline) {
  notifier_.Flush(std::min(deadline, absl::Now() + kAbortStepTimeout));
  v1::RecoverResponse response;
  response.set_next_step(step);
  auto read = [&](bool settle) -> absl::StatusOr<std::vector<int64_t>> {
    std::vector<int64_t> steps;
    std::vector<std::string> errors;
    absl::StatusCode code = absl::StatusCode::kOk;
    const std::vector<absl::StatusOr<v1::ShardState>> states =
        ReadShardStates(deadline, settle);
    for (uint32_t s = 0; s < states.size(); ++s) {
      absl::Status problem = states[s].status();
      if (problem.ok() && !states[s]->initialized()) {
        problem = absl::FailedPreconditionError(absl::StrCat(
            "shard ", s, " has no parameters (rank 0 initialises them)"));
      }
      if (!problem.ok()) {
        if (code == absl::StatusCode::kOk) code = problem.code();
        errors.push_back(std::string(problem.message()));
        continue;
      }
      steps.push_back(states[s]->next_step());
    }
    if (!errors.empty()) {
      return absl::Status(
          code, absl::StrCat("Recover: cannot resume at step ", step, ": ",
                             absl::StrJoin(errors, "; ")));
    }
    return steps;
  };
  // Every shard already there (a second rank's resume, a retry): nothing
  // to do, and no fence to abort the rounds of the ranks that resumed.
  {
    absl::StatusOr<std::vector<int64_t>> steps = read(/*settle=*/false);
    if (steps.ok() && std::all_of(steps->begin(), steps->end(),
                                  [step](int64_t s) { return s == step; })) {
      for (int64_t s : *steps) response.add_previous_steps(s);
      response.set_rolled_back(false);
      return response;
    }
  }
  const auto unfence = FenceLeader(absl::AbortedError(
      absl::StrCat("the leader is resuming the cluster at step ", step)));
  GTOPK_ASSIGN_OR_RETURN(const std::vector<int64_t> steps,
                         read(/*settle=*/true));
  bool moved = false;
  int64_t lowest = step;
  for (int64_t s : steps) {
    response.add_previous_steps(s);
    moved = moved || s != step;
    lowest = std::min(lowest, s);
  }
  response.set_rolled_back(moved);
  if (!moved) return response;
  std::fprintf(stderr,
               "gtopk-server leader: the workers resume at step %lld; "
               "renumbering every shard's next step\n",
               static_cast<long long>(step));
  // Every step from the lowest involved on is voted on and exchanged
  // afresh.
  commit_coordinator_->ForgetFrom(lowest);
  coordinator_->ForgetFrom(lowest);
  GTOPK_RETURN_IF_ERROR(RollBackShardsTo(step, deadline));
  return response;
}

grpc::Status AggregatorService::Recover(grpc::ServerContext* context,
                                        const v1::RecoverRequest* request,
                                        v1::RecoverResponse* response) {
  absl::StatusOr<Call> call = Enter(
      context,
      CallRules::Worker("Recover", int64_t{request->rank()})
          .Peer(RankPeer(context, request->rank(), request->member_token())));
  if (!call.ok()) return ToGrpcStatus(call.status());
  if (request->rank() >= config_.num_workers) {
    return ToGrpcStatus(absl::InvalidArgumentError(
        absl::StrCat("unknown worker rank ", request->rank(),
                     "; the cluster has ", config_.num_workers, " workers")));
  }
  if (is_leader()) {
    const absl::Status same = CheckFingerprint(
        request->cluster_fingerprint(),
        absl::StrCat("Recover from worker ", request->rank(), " "),
        absl::Now());
    if (!same.ok()) return ToGrpcStatus(same);
    // The holder re-registers its rank (after a leader restart too), which
    // stays reserved for it through the recovery and until it reopens its
    // step stream, whatever a Join asks meanwhile (issue 42).
    const absl::Status member =
        membership_.Reenter(request->rank(), request->member_token());
    if (!member.ok()) return ToGrpcStatus(member);
  }
  // Again when the call ends (it may have waited a step timeout for the
  // shards): the worker's next Recover follows within its backoff.
  struct Rereserve {
    Membership* membership;  // null: not the leader
    uint32_t worker;
    uint64_t token;
    ~Rereserve() {
      if (membership != nullptr) membership->Rereserve(worker, token);
    }
  } rereserve{is_leader() ? &membership_ : nullptr, request->rank(),
              request->member_token()};
  std::optional<int64_t> resume_step;
  if (request->resume()) {
    if (config_.apply != ApplyMode::kWorkers) {
      return ToGrpcStatus(absl::FailedPreconditionError(
          "Recover: resume is for --apply=workers; in servers mode the "
          "servers' checkpoints decide the step (restart them from the "
          "checkpoint of step N)"));
    }
    if (request->resume_step() < 0) {
      return ToGrpcStatus(absl::InvalidArgumentError(absl::StrCat(
          "Recover: resume_step must be >= 0, got ", request->resume_step())));
    }
    resume_step = request->resume_step();
  }
  const absl::Time deadline =
      std::min(absl::Now() + config_.step_timeout,
               ContextDeadline(context) - kLeaderDeadlineSlack);
  absl::StatusOr<v1::RecoverResponse> answer =
      RecoverCluster(deadline, resume_step);
  if (!answer.ok()) return ToGrpcStatus(answer.status());
  *response = *std::move(answer);
  return grpc::Status::OK;
}

}  // namespace server
}  // namespace gtopk
