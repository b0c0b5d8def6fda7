// AggregatorService (server/service.h), membership: who may take part in
// the cluster. The RPCs Join (a rank and its member token), GetClusterSpec
// and CheckMember, and the checks every other handler runs through: the
// cluster fingerprint (CheckFingerprint, ExplainLeaderRefusal), the run
// identity (CheckRunId) and rank ownership (CheckMemberToken). The rank
// table itself is the Membership component (server/membership.h); the
// training handlers are in server/service.cc.
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
#include "common/cluster_spec/cluster_spec.h"
#include "common/grpc_edge/grpc_edge.h"
#include "common/status_macros.h"
#include "server/service.h"
#include "server/service_internal.h"

namespace gtopk {
namespace server {

using internal::kFingerprintMarker;

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
    return absl::FailedPreconditionError(
        absl::StrCat(who, "carries no ", kFingerprintMarker,
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

absl::Status AggregatorService::CheckMemberToken(uint32_t worker,
                                                 uint64_t token,
                                                 absl::Time deadline) {
  if (std::optional<absl::Status> here =
          membership_.CheckTokenHere(worker, token)) {
    return *here;
  }
  // A token this shard has not seen for the rank: ask the leader.
  v1::MemberCheckRequest request;
  request.set_rank(worker);
  request.set_member_token(token);
  request.set_cluster_fingerprint(fingerprint_.load());
  v1::MemberCheckResponse response;
  const grpc::Status status = CallUntilAdmitted(deadline, "CheckMember", [&] {
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(deadline));
    return leader_stub_->CheckMember(&context, request, &response);
  });
  if (!status.ok()) {
    const absl::Status st =
        absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                     absl::StrCat("leader ", config_.peers[0],
                                  " (CheckMember): ", status.error_message()));
    return ExplainLeaderRefusal(st, deadline);
  }
  // The leader confirmed it: it supersedes the rank's earlier token here.
  membership_.ConfirmToken(worker, token);
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
    // This shard speaks for its own program only (the proto's
    // ShardSpec.takes_push_parts).
    shard->set_takes_push_parts(s == config_.shard_id);
  }
  spec.set_next_step(aggregator_ != nullptr ? aggregator_->next_step() : 0);
  spec.set_cluster_fingerprint(fingerprint_.load());
  spec.set_run_id(run_id_.load());
  return spec;
}

grpc::Status AggregatorService::Join(grpc::ServerContext* context,
                                     const v1::JoinRequest* request,
                                     v1::JoinResponse* response) {
  // A certificate that names a rank joins as that rank only (also for "any
  // rank", -1: ask for it explicitly).
  absl::StatusOr<Call> call = Enter(
      context, CallRules::Worker("Join", int64_t{request->requested_rank()})
                   .LeaderOnly());
  if (!call.ok()) return ToGrpcStatus(call.status());
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
  // The rank table decides under its own lock; the cluster's n is fixed
  // (the first Join creates the aggregator) after the run length is agreed
  // and before a rank is chosen.
  absl::StatusOr<Membership::Grant> grant = membership_.Join(
      requested, request->run_length(), context, [this, n] { return FixN(n); });
  if (!grant.ok()) return ToGrpcStatus(grant.status());
  response->set_member_token(grant->token);
  response->set_rank(grant->rank);
  response->set_epoch(epoch_.load());
  absl::MutexLock lock(&mu_);
  *response->mutable_cluster() = BuildSpecLocked();
  return grpc::Status::OK;
}

grpc::Status AggregatorService::GetClusterSpec(grpc::ServerContext* context,
                                               const v1::JoinRequest* request,
                                               v1::ClusterSpec* response) {
  // Workers at Connect, and the other shards (FetchSpecFromLeader).
  absl::StatusOr<Call> call =
      Enter(context, CallRules::Worker("GetClusterSpec", std::nullopt,
                                       /*shard_ok=*/true));
  if (!call.ok()) return ToGrpcStatus(call.status());
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
    // The leader's entry for this shard cannot say what this program
    // takes: this shard says it (ShardSpec.takes_push_parts), and only
    // for itself.
    for (v1::ShardSpec& shard : *response->mutable_shards()) {
      shard.set_takes_push_parts(shard.shard_id() == config_.shard_id);
    }
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
  absl::StatusOr<Call> call =
      Enter(context, CallRules::Shard("CheckMember", std::nullopt)
                         .LeaderOnly()
                         .Fingerprint(request->cluster_fingerprint(),
                                      absl::StrCat("CheckMember for rank ",
                                                   request->rank(), " ")));
  if (!call.ok()) return ToGrpcStatus(call.status());
  return ToGrpcStatus(
      membership_.CheckToken(request->rank(), request->member_token()));
}

absl::Status AggregatorService::CheckRunId(uint64_t leader_run_id) {
  if (is_leader()) return absl::OkStatus();
  const uint64_t fingerprint = fingerprint_.load();
  if (restored_fingerprint_ != 0 && fingerprint != 0 &&
      restored_fingerprint_ != fingerprint) {
    // Called once this shard's settings agree with the leader's: the
    // checkpoint was written with other settings, by another cluster.
    return absl::FailedPreconditionError(absl::StrCat(
        "shard ", config_.shard_id, ": checkpoint ", restored_checkpoint_,
        " was written by a cluster with ", internal::kFingerprintMarker, " ",
        FingerprintText(restored_fingerprint_),
        " but this cluster's (the same settings here and on the leader) is ",
        FingerprintText(fingerprint),
        ": another cluster's checkpoint (other --lr, --momentum, --density, "
        "--selector, ... than this cluster's). Nothing of it was rolled back "
        "into this cluster; put this cluster's own checkpoint there, or move "
        "the file away and restart shard ",
        config_.shard_id, " to start it empty"));
  }
  if (leader_run_id == 0) return absl::OkStatus();
  uint64_t own = run_id_.load();
  if (own == 0) {
    run_id_.compare_exchange_strong(own, leader_run_id);
    return absl::OkStatus();
  }
  if (own == leader_run_id) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      "shard ", config_.shard_id, "'s state is run ", FingerprintText(own),
      restored_checkpoint_.empty() ? std::string()
                                   : absl::StrCat(" (restored from checkpoint ",
                                                  restored_checkpoint_, ")"),
      " but the leader's cluster is run ", FingerprintText(leader_run_id),
      ": another run's checkpoint (same settings, another run). Nothing was "
      "restored into this cluster; put this run's own checkpoint there, or "
      "move the file away and restart shard ",
      config_.shard_id, " to start it empty"));
}

}  // namespace server
}  // namespace gtopk
