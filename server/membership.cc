// AggregatorService (server/service.h), membership: who may take part in
// the cluster. The RPCs Join (a rank and its member token), GetClusterSpec
// and CheckMember, and the checks every other handler runs through: the
// cluster fingerprint (CheckFingerprint, ExplainLeaderRefusal) and rank
// ownership (CheckMemberToken). The training handlers are in
// server/service.cc.
#include <algorithm>
#include <cstdint>
#include <random>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/cluster_spec.h"
#include "common/grpc_edge.h"
#include "common/status_macros.h"
#include "server/service.h"
#include "server/service_internal.h"

namespace gtopk {
namespace server {

using internal::AwaitPolled;
using internal::ContextDeadline;
using internal::kFingerprintMarker;
using internal::kRankReleaseGrace;

namespace {

// A fresh member token: 64 random bits from the OS source, never 0. Not
// model state, so not seeded (runs stay bit-identical without it).
uint64_t NewMemberToken() {
  static std::random_device device;
  uint64_t token = 0;
  while (token == 0) {
    token = (uint64_t{device()} << 32) ^ uint64_t{device()};
  }
  return token;
}

// "--epochs is 3 here but 5 on the workers that joined first; ..." for the
// "--flag=value" words of `here` and `cluster` that differ (or the whole
// texts when they are not of that form).
std::string RunLengthDifferences(const std::string& here,
                                 const std::string& cluster) {
  auto parse = [](const std::string& text) {
    std::vector<std::pair<std::string, std::string>> out;
    for (absl::string_view word : absl::StrSplit(text, ' ', absl::SkipEmpty())) {
      const size_t eq = word.find('=');
      if (eq == absl::string_view::npos) continue;
      out.emplace_back(std::string(word.substr(0, eq)),
                       std::string(word.substr(eq + 1)));
    }
    return out;
  };
  const auto a = parse(here), b = parse(cluster);
  std::vector<std::string> diffs;
  for (const auto& [flag, value] : a) {
    for (const auto& [other_flag, other_value] : b) {
      if (flag == other_flag && value != other_value) {
        diffs.push_back(absl::StrCat(flag, " is ", value, " here but ",
                                     other_value,
                                     " on the workers that joined first"));
      }
    }
  }
  if (diffs.empty()) return "the settings differ";
  return absl::StrJoin(diffs, "; ");
}

}  // namespace

absl::Status AggregatorService::CheckFingerprint(uint64_t fingerprint,
                                                 const std::string& who,
                                                 absl::Time deadline) {
  const uint64_t own = fingerprint_.load();
  if (own != 0 && fingerprint == own) return absl::OkStatus();
  if (!is_leader()) {
    // Is it this shard that differs from the leader? Then name the flags.
    absl::StatusOr<v1::ClusterSpec> spec = FetchSpecFromLeader(deadline);
    if (spec.ok()) {
      const absl::Status same = CheckLeaderSpec(*spec);
      if (!same.ok()) {
        verified_.store(false);
        return absl::FailedPreconditionError(
            absl::StrCat(who, "refused: ", same.message()));
      }
    }
  }
  if (fingerprint == 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        who, "carries no ", kFingerprintMarker,
        " (ClusterSpec.cluster_fingerprint); this shard's is ",
        FingerprintText(own), ". Update the client"));
  }
  return absl::FailedPreconditionError(absl::StrCat(
      who, "was made for ", kFingerprintMarker, " ",
      FingerprintText(fingerprint), " but shard ", config_.shard_id,
      "'s cluster is ", FingerprintText(own),
      own == 0 ? " (unknown: no parameter count yet)" : "",
      ": the sender joined a cluster with other settings (a shard or the "
      "leader restarted with other flags since, or another cluster); "
      "nothing was applied"));
}

absl::Status AggregatorService::ExplainLeaderRefusal(const absl::Status& status,
                                                     absl::Time deadline) {
  if (is_leader() || !absl::IsFailedPrecondition(status) ||
      !absl::StrContains(status.message(), kFingerprintMarker)) {
    return status;
  }
  verified_.store(false);
  absl::StatusOr<v1::ClusterSpec> spec = FetchSpecFromLeader(deadline);
  if (!spec.ok()) return status;
  const absl::Status same = CheckLeaderSpec(*spec);
  if (same.ok()) return status;
  return absl::FailedPreconditionError(
      absl::StrCat(same.message(), " (", status.message(), ")"));
}

absl::Status AggregatorService::CheckMemberTokenLocked(uint32_t worker,
                                                       uint64_t token) const {
  if (worker >= config_.num_workers) {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown worker rank ", worker, "; the cluster has ",
                     config_.num_workers, " workers"));
  }
  if (token == 0) {
    return absl::PermissionDeniedError(absl::StrCat(
        "rank ", worker, ": no member token (JoinResponse.member_token); only "
        "the worker that joined as rank ", worker, " may act as it"));
  }
  const uint64_t current = member_token_[worker];
  if (current == 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "rank ", worker, " has not joined leader shard 0 (never, or not since "
        "the leader restarted): Join first; a worker that held the rank "
        "re-registers it with Recover"));
  }
  if (token != current) {
    return absl::PermissionDeniedError(absl::StrCat(
        "rank ", worker, " is held by another worker: this member token is "
        "not the rank's current one (a later Join of rank ", worker,
        " replaced it, or it was never granted)"));
  }
  return absl::OkStatus();
}

absl::Status AggregatorService::CheckMemberToken(uint32_t worker,
                                                 uint64_t token,
                                                 absl::Time deadline) {
  {
    absl::MutexLock lock(&mu_);
    if (is_leader() || worker >= config_.num_workers || token == 0) {
      return CheckMemberTokenLocked(worker, token);
    }
    if (member_token_[worker] == token) return absl::OkStatus();
  }
  // A token this shard has not seen for the rank: ask the leader.
  v1::MemberCheckRequest request;
  request.set_worker(worker);
  request.set_member_token(token);
  request.set_cluster_fingerprint(fingerprint_.load());
  v1::MemberCheckResponse response;
  const grpc::Status status = CallUntilAdmitted(deadline, "CheckMember", [&] {
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(deadline));
    return leader_stub_->CheckMember(&context, request, &response);
  });
  if (!status.ok()) {
    const absl::Status st = absl::Status(
        static_cast<absl::StatusCode>(status.error_code()),
        absl::StrCat("leader ", config_.peers[0],
                     " (CheckMember): ", status.error_message()));
    return ExplainLeaderRefusal(st, deadline);
  }
  absl::MutexLock lock(&mu_);
  // The leader confirmed it: it supersedes the rank's earlier token here.
  member_token_[worker] = token;
  return absl::OkStatus();
}

v1::ClusterSpec AggregatorService::BuildSpecLocked() const {
  v1::ClusterSpec spec = ClusterSettingsSpec(config_);
  spec.set_n(n_);
  for (uint32_t s = 0; s < config_.num_shards; ++s) {
    v1::ShardSpec* shard = spec.add_shards();
    shard->set_shard_id(s);
    shard->set_address(s == config_.shard_id && config_.peers[s].empty()
                           ? own_address_
                           : config_.peers[s]);
    const auto range = ShardRange(n_, config_.num_shards, s);
    shard->set_begin(range.first);
    shard->set_end(range.second);
  }
  spec.set_next_step(aggregator_ != nullptr ? aggregator_->next_step() : 0);
  spec.set_cluster_fingerprint(fingerprint_.load());
  spec.set_run_id(run_id_.load());
  return spec;
}

grpc::Status AggregatorService::Join(grpc::ServerContext* context,
                                     const v1::JoinRequest* request,
                                     v1::JoinResponse* response) {
  GTOPK_ADMIT_CALL(admission, AdmitCall(context, "Join"));
  {
    // A certificate that names a rank joins as that rank only (also for
    // "any rank", -1: ask for it explicitly).
    absl::StatusOr<Caller> allowed = access_->AllowWorker(
        *context, "Join", int64_t{request->requested_rank()});
    if (!allowed.ok()) return ToGrpcStatus(allowed.status());
  }
  if (!is_leader()) {
    return ToGrpcStatus(absl::FailedPreconditionError(
        absl::StrCat("shard ", config_.shard_id, " is not the leader; join ",
                     config_.peers[0])));
  }
  const uint64_t n = request->n();
  if (n < 1 || n > kMaxDenseLength) {
    return ToGrpcStatus(absl::InvalidArgumentError(
        absl::StrCat("n must be in [1, 2^32], got ", n)));
  }
  const int64_t requested = request->requested_rank();
  if (requested < -1 || requested >= int64_t{config_.num_workers}) {
    return ToGrpcStatus(absl::InvalidArgumentError(absl::StrCat(
        "requested_rank ", requested, " is out of range: the cluster has ",
        config_.num_workers, " workers (ranks 0..", config_.num_workers - 1,
        "; -1 for any)")));
  }
  absl::MutexLock lock(&mu_);
  // A worker restarting after a crash has no open stream (its connection
  // closed with it); one that still has one is another, live worker.
  const auto rank_live = [this](uint32_t r)
                             ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    for (grpc::ServerContext* stream : live_streams_[r]) {
      if (!stream->IsCancelled()) return true;
    }
    return false;
  };
  if (requested >= 0) {
    // The requested rank's streams get a short grace to end (a worker
    // that closed them a moment ago and joins again, whose cancellation
    // this server has not finished yet), within the call's deadline; a
    // live worker's stay open, and the rank is refused below. Ended means
    // unregistered, not only cancelled: a stream's end decides whether
    // the rank stays reserved for its holder (PushPull's Disconnect), and
    // a cancelled stream still in its round has not decided yet.
    const uint32_t r = static_cast<uint32_t>(requested);
    auto released = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return shutting_down_ || draining_ || live_streams_[r].empty();
    };
    AwaitPolled(mu_, absl::Condition(&released),
                std::min(absl::Now() + kRankReleaseGrace,
                         ContextDeadline(context)),
                context);
  }
  if (shutting_down_ || draining_) {
    return ToGrpcStatus(absl::UnavailableError(
        absl::StrCat("shard ", config_.shard_id, " is shutting down")));
  }
  if (!request->run_length().empty()) {
    // The run length binds the workers of one run: while another rank's
    // worker is connected, or reserved after a leader restart. With every
    // other rank free (a cluster resumed as a whole, e.g. with more
    // --steps), the first Join sets it afresh.
    bool others = false;
    for (uint32_t r = 0; r < config_.num_workers && !others; ++r) {
      if (int64_t{r} == requested) continue;
      others = rank_live(r) || absl::Now() < rank_reserved_until_[r];
    }
    if (run_length_.empty() || !others) {
      run_length_ = request->run_length();
    } else if (request->run_length() != run_length_) {
      return ToGrpcStatus(absl::FailedPreconditionError(absl::StrCat(
          "this worker's run length differs from the cluster's: ",
          RunLengthDifferences(request->run_length(), run_length_),
          " (here: \"", BoundedStatusMessage(request->run_length()),
          "\"; the workers that joined first: \"", run_length_,
          "\"); every worker must train the same schedule, or it stops "
          "early while the others wait for it. Start it with the same "
          "flags")));
    }
  }
  if (n_ == 0) {
    const absl::Status created = CreateAggregatorLocked(n);
    if (!created.ok()) return ToGrpcStatus(created);
    n_ = n;
  } else if (n != n_) {
    return ToGrpcStatus(absl::FailedPreconditionError(absl::StrCat(
        "the worker has n = ", n, " parameters but the cluster has n = ", n_)));
  }
  uint32_t rank = 0;
  if (requested >= 0) {
    rank = static_cast<uint32_t>(requested);
    if (!rank_live(rank) && !live_streams_[rank].empty()) {
      // Cancelled but still finishing its round (a worker that cut a
      // failed step short, or one that died mid-step): whether the rank
      // stays its holder's is decided when the stream ends.
      return ToGrpcStatus(absl::UnavailableError(absl::StrCat(
          "rank ", rank, "'s step stream on leader shard ", config_.shard_id,
          " was cancelled in the middle of a step and is still ending; "
          "its holder keeps the rank if it recovers; retry in a few "
          "seconds")));
    }
    if (!rank_live(rank) && absl::Now() < rank_reserved_until_[rank]) {
      // The rank's holder is alive and recovering (its step failed, or
      // the leader restarted and its member file names the holder): only
      // it may have the rank (Recover with its token) until the window
      // ends.
      return ToGrpcStatus(absl::UnavailableError(absl::StrCat(
          "rank ", rank, " is held by a worker that is recovering (or that "
          "held it when leader shard ", config_.shard_id,
          " restarted); it stays reserved for its holder for another ",
          absl::FormatDuration(absl::Trunc(
              rank_reserved_until_[rank] - absl::Now(), absl::Seconds(1))),
          " (until it re-registers with its member token); retry later, or "
          "start this worker with another --rank")));
    }
    if (rank_live(rank)) {
      return ToGrpcStatus(absl::AlreadyExistsError(absl::StrCat(
          "rank ", rank,
          " is already taken by a live worker (it has an "
          "open PushPull stream on shard ",
          config_.shard_id,
          "); start this worker with another --rank, or stop the other "
          "one first")));
    }
  } else {
    // Free: never given since this leader started, and not reserved for
    // the holder its member file names (after a restart).
    const auto reserved = [&](uint32_t r) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return absl::Now() < rank_reserved_until_[r] && !rank_live(r);
    };
    while (rank < config_.num_workers &&
           (rank_given_[rank] || reserved(rank))) {
      ++rank;
    }
    if (rank == config_.num_workers) {
      // Ranks reserved for their holders after a leader restart free up
      // when their window ends: retry then (UNAVAILABLE), not never.
      absl::Time soonest = absl::InfiniteFuture();
      for (uint32_t r = 0; r < config_.num_workers; ++r) {
        if (!rank_given_[r] && reserved(r)) {
          soonest = std::min(soonest, rank_reserved_until_[r]);
        }
      }
      if (soonest != absl::InfiniteFuture()) {
        return ToGrpcStatus(absl::UnavailableError(absl::StrCat(
            "no rank is free: the ranks held when leader shard ",
            config_.shard_id, " restarted stay reserved for their holders ",
            "(the first for another ",
            absl::FormatDuration(
                absl::Trunc(soonest - absl::Now(), absl::Seconds(1))),
            ", until they re-register with their member tokens); retry "
            "later")));
      }
      return ToGrpcStatus(absl::ResourceExhaustedError(
          absl::StrCat("all ", config_.num_workers,
                       " ranks are taken; ask for a rank explicitly to "
                       "re-join")));
    }
  }
  // A new token per grant: the rank's earlier holder (gone) is superseded.
  const uint64_t previous = member_token_[rank];
  member_token_[rank] = NewMemberToken();
  // Durable before it is handed out: a leader restarted from its checkpoint
  // directory still knows the holder (server/member_file.h).
  if (const absl::Status saved = PersistMemberTokensLocked(); !saved.ok()) {
    member_token_[rank] = previous;
    return ToGrpcStatus(absl::UnavailableError(absl::StrCat(
        "rank ", rank, " not granted: the leader cannot record its member "
        "token: ", saved.message())));
  }
  rank_given_[rank] = true;
  rank_reserved_until_[rank] = absl::InfinitePast();
  response->set_member_token(member_token_[rank]);
  response->set_rank(rank);
  response->set_epoch(epoch_.load());
  *response->mutable_cluster() = BuildSpecLocked();
  return grpc::Status::OK;
}

grpc::Status AggregatorService::GetClusterSpec(
    grpc::ServerContext* context, const v1::JoinRequest* request,
    v1::ClusterSpec* response) {
  GTOPK_ADMIT_CALL(admission, AdmitCall(context, "GetClusterSpec"));
  {
    // Workers at Connect, and the other shards (FetchSpecFromLeader).
    absl::StatusOr<Caller> allowed = access_->AllowWorker(
        *context, "GetClusterSpec", std::nullopt, /*shard_ok=*/true);
    if (!allowed.ok()) return ToGrpcStatus(allowed.status());
  }
  const absl::Time deadline = WaitDeadline(context);
  if (!is_leader()) {
    absl::StatusOr<v1::ClusterSpec> spec =
        FetchSpecFromLeader(deadline, request->settings_only());
    if (!spec.ok()) return ToGrpcStatus(spec.status());
    // Workers ask every shard at Connect: a shard started with other
    // settings than the leader refuses here, before any step.
    const absl::Status same = CheckLeaderSpec(*spec);
    if (!same.ok()) return ToGrpcStatus(same);
    *response = *std::move(spec);
    return grpc::Status::OK;
  }
  absl::MutexLock lock(&mu_);
  if (request->settings_only()) {
    // The settings at once, n or not (a shard's start-up comparison).
    *response = BuildSpecLocked();
    return grpc::Status::OK;
  }
  const absl::Status ready = AwaitClusterLocked(context, deadline);
  if (!ready.ok()) return ToGrpcStatus(ready);
  *response = BuildSpecLocked();
  return grpc::Status::OK;
}


grpc::Status AggregatorService::CheckMember(
    grpc::ServerContext* context, const v1::MemberCheckRequest* request,
    v1::MemberCheckResponse* /*response*/) {
  GTOPK_ADMIT_CALL(admission, AdmitCall(context, "CheckMember"));
  {
    const absl::Status allowed =
        access_->AllowShard(*context, "CheckMember", std::nullopt);
    if (!allowed.ok()) return ToGrpcStatus(allowed);
  }
  if (!is_leader()) {
    return ToGrpcStatus(absl::FailedPreconditionError(absl::StrCat(
        "shard ", config_.shard_id, " is not the leader; CheckMember goes to ",
        config_.peers[0])));
  }
  const absl::Status same = CheckFingerprint(
      request->cluster_fingerprint(),
      absl::StrCat("CheckMember for rank ", request->worker(), " "),
      absl::Now());
  if (!same.ok()) return ToGrpcStatus(same);
  absl::MutexLock lock(&mu_);
  return ToGrpcStatus(
      CheckMemberTokenLocked(request->worker(), request->member_token()));
}

}  // namespace server
}  // namespace gtopk
