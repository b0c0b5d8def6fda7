// Checkpointer (server/checkpointer.h): writes, health, restore and
// rollback of one shard's checkpoints.
#include "server/checkpointer.h"

#include <algorithm>
#include <cstdio>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/cluster_spec/cluster_spec.h"
#include "common/status_macros.h"
#include "server/service.h"

namespace gtopk {
namespace server {
namespace {

// A restored checkpoint against the shard's own retained ones: OK, or
// FAILED_PRECONDITION when the current one is of another cluster or run.
absl::Status CheckAgainstHistory(const std::string& dir, uint32_t shard,
                                 const ShardCheckpoint& current) {
  if (current.run_id == 0 && current.cluster_fingerprint == 0) {
    return absl::OkStatus();
  }
  absl::StatusOr<std::vector<int64_t>> steps = ListCheckpointSteps(dir, shard);
  if (!steps.ok() || steps->empty()) return absl::OkStatus();
  // The newest entry of another step than the current one (an entry of the
  // same step may be the very file, a hard link); else that one.
  int64_t step = steps->back();
  for (auto it = steps->rbegin(); it != steps->rend(); ++it) {
    if (*it != current.next_step) {
      step = *it;
      break;
    }
  }
  absl::StatusOr<ShardCheckpoint> retained = ReadCheckpointAt(dir, shard, step);
  if (!retained.ok()) return absl::OkStatus();  // judged when it is used
  const bool other_run = retained->run_id != 0 && current.run_id != 0 &&
                         retained->run_id != current.run_id;
  const bool other_cluster =
      retained->cluster_fingerprint != 0 && current.cluster_fingerprint != 0 &&
      retained->cluster_fingerprint != current.cluster_fingerprint;
  if (!other_run && !other_cluster) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      "shard ", shard, ": checkpoint ", CheckpointPath(dir, shard), " is ",
      other_cluster ? absl::StrCat("of cluster fingerprint ",
                                   FingerprintText(current.cluster_fingerprint))
                    : absl::StrCat("of run ", FingerprintText(current.run_id)),
      " but this shard's retained checkpoint ",
      CheckpointHistoryPath(dir, shard, step), " is ",
      other_cluster
          ? absl::StrCat("of cluster fingerprint ",
                         FingerprintText(retained->cluster_fingerprint))
          : absl::StrCat("of run ", FingerprintText(retained->run_id)),
      ": another cluster's or run's checkpoint was put in place of this "
      "shard's own. Nothing was restored or deleted; put this shard's own "
      "checkpoint back (e.g. copy ",
      CheckpointHistoryPath(dir, shard, steps->back()), " to ",
      CheckpointPath(dir, shard),
      "), or move the directory away to start "
      "the shard empty"));
}

}  // namespace

Checkpointer::Checkpointer(const ServerConfig& config, ServerMetrics* metrics,
                           std::function<void(ShardCheckpoint*)> stamp)
    : config_(config), metrics_(metrics), stamp_(std::move(stamp)) {}

absl::StatusOr<std::optional<ShardCheckpoint>> Checkpointer::ReadForRestore()
    const {
  absl::StatusOr<ShardCheckpoint> checkpoint =
      ReadCheckpoint(config_.checkpoint_dir, config_.shard_id);
  if (absl::IsNotFound(checkpoint.status())) return std::nullopt;
  GTOPK_RETURN_IF_ERROR(checkpoint.status());
  // Before the history is touched (the restore prunes and adds to it): a
  // current checkpoint of another cluster or run than this shard's own
  // retained ones was put in their place. Refused, and nothing is changed,
  // so the shard's own checkpoints survive.
  GTOPK_RETURN_IF_ERROR(CheckAgainstHistory(config_.checkpoint_dir,
                                            config_.shard_id, *checkpoint));
  return std::optional<ShardCheckpoint>(*std::move(checkpoint));
}

absl::Status Checkpointer::Restored(int64_t next_step) {
  absl::MutexLock lock(&mu_);
  // Retained checkpoints newer than the restored one are left over from a
  // crash during a rollback: they belong to abandoned steps. The restored
  // one joins the history (it may predate it).
  GTOPK_RETURN_IF_ERROR(DiscardCheckpointsAfter(config_.checkpoint_dir,
                                                config_.shard_id, next_step));
  return RetainCheckpoint(config_.checkpoint_dir, config_.shard_id, next_step,
                          config_.checkpoint_keep);
}

absl::Status Checkpointer::WriteNow(ShardAggregator* aggregator) {
  if (config_.checkpoint_dir.empty() || aggregator == nullptr) {
    return absl::OkStatus();
  }
  absl::MutexLock lock(&mu_);
  absl::StatusOr<ShardCheckpoint> snapshot = aggregator->Snapshot();
  if (absl::IsFailedPrecondition(snapshot.status())) {
    return absl::OkStatus();  // no parameters yet: nothing to keep
  }
  absl::Status status = snapshot.status();
  // WriteCheckpoint replaces the current checkpoint only by renaming a
  // complete, fsynced temp file over it: on failure the previous one stays
  // what a restart restores, and the history keeps its entries.
  if (status.ok()) {
    stamp_(&*snapshot);
    status = WriteCheckpoint(config_.checkpoint_dir, *snapshot);
  }
  if (status.ok()) {
    metrics_->CheckpointWritten();
    status = RetainCheckpoint(config_.checkpoint_dir, config_.shard_id,
                              snapshot->next_step, config_.checkpoint_keep);
  }
  const bool ok = status.ok();
  if (!ok) {
    metrics_->CheckpointFailed();
    std::fprintf(
        stderr,
        "gtopk-server shard %u: checkpoint of step %lld in %s FAILED (%.0f "
        "failure(s) so far): %s; the previous checkpoint stays the one a "
        "restart restores, and health service \"%s\" is NOT_SERVING until "
        "a checkpoint succeeds\n",
        config_.shard_id,
        snapshot.ok() ? static_cast<long long>(snapshot->next_step) : -1LL,
        config_.checkpoint_dir.c_str(), metrics_->checkpoint_failures(),
        status.ToString().c_str(), kCheckpointHealthService);
  }
  if (ok && !ok_) {
    std::fprintf(stderr,
                 "gtopk-server shard %u: checkpoint of step %lld written; "
                 "checkpoints work again\n",
                 config_.shard_id, static_cast<long long>(snapshot->next_step));
  }
  ok_ = ok;
  if (health_) health_(ok);
  return status;
}

void Checkpointer::SetHealthListener(std::function<void(bool ok)> listener) {
  absl::MutexLock lock(&mu_);
  health_ = std::move(listener);
  if (health_) health_(ok_);
}

absl::StatusOr<std::vector<int64_t>> Checkpointer::StepsUpTo(
    int64_t up_to) const {
  std::vector<int64_t> out;
  if (config_.checkpoint_dir.empty()) return out;
  absl::MutexLock lock(&mu_);
  GTOPK_ASSIGN_OR_RETURN(
      std::vector<int64_t> steps,
      ListCheckpointSteps(config_.checkpoint_dir, config_.shard_id));
  for (int64_t s : steps) {
    if (s <= up_to) out.push_back(s);
  }
  return out;
}

absl::StatusOr<int64_t> Checkpointer::RollBack(ShardAggregator* aggregator,
                                               int64_t step) {
  const std::string shard = absl::StrCat("shard ", config_.shard_id);
  // Serialised with checkpoint writes: the history must not gain an entry
  // of an abandoned step while it is rewound.
  absl::MutexLock lock(&mu_);
  const int64_t previous = aggregator->next_step();
  const absl::Status reason = absl::AbortedError(
      absl::StrCat("the cluster rolled back to step ", step));
  const bool renumber =
      config_.apply == ApplyMode::kWorkers && step != previous;
  if (step == previous || renumber) {
    // Under --apply=workers the shard's parameters are only the initial
    // broadcast: any step is a renumbering, no checkpoint needed.
    GTOPK_RETURN_IF_ERROR(aggregator->Rollback(step, nullptr, reason));
  } else {
    if (config_.checkpoint_dir.empty()) {
      return absl::FailedPreconditionError(
          absl::StrCat(shard, " is at step ", previous,
                       " and keeps no checkpoints (no "
                       "--checkpoint-dir); cannot roll back to step ",
                       step));
    }
    absl::StatusOr<ShardCheckpoint> checkpoint =
        ReadCheckpointAt(config_.checkpoint_dir, config_.shard_id, step);
    if (absl::IsNotFound(checkpoint.status())) {
      return absl::FailedPreconditionError(
          absl::StrCat(shard, " is at step ", previous, ": ",
                       checkpoint.status().message()));
    }
    GTOPK_RETURN_IF_ERROR(checkpoint.status());
    GTOPK_RETURN_IF_ERROR(aggregator->Rollback(step, &*checkpoint, reason));
  }
  if (!config_.checkpoint_dir.empty()) {
    // The memory state is `step` now; make the disk agree (entries of the
    // abandoned steps would otherwise come back after a restart).
    absl::StatusOr<std::vector<int64_t>> steps =
        ListCheckpointSteps(config_.checkpoint_dir, config_.shard_id);
    GTOPK_RETURN_IF_ERROR(steps.status());
    if (std::find(steps->begin(), steps->end(), step) != steps->end()) {
      GTOPK_RETURN_IF_ERROR(
          RewindCheckpoints(config_.checkpoint_dir, config_.shard_id, step));
    } else {
      GTOPK_RETURN_IF_ERROR(DiscardCheckpointsAfter(config_.checkpoint_dir,
                                                    config_.shard_id, step));
      if (renumber) {
        // No entry of the new step: write one, so that a restart comes
        // back at the step the cluster is at (same initial parameters).
        GTOPK_ASSIGN_OR_RETURN(ShardCheckpoint now, aggregator->Snapshot());
        stamp_(&now);
        GTOPK_RETURN_IF_ERROR(WriteCheckpoint(config_.checkpoint_dir, now));
        GTOPK_RETURN_IF_ERROR(RetainCheckpoint(config_.checkpoint_dir,
                                               config_.shard_id, step,
                                               config_.checkpoint_keep));
      }
    }
  }
  if (step != previous) {
    std::fprintf(stderr,
                 "gtopk-server shard %u: rolled back from step %lld "
                 "to step %lld\n",
                 config_.shard_id, static_cast<long long>(previous),
                 static_cast<long long>(step));
  }
  return previous;
}

}  // namespace server
}  // namespace gtopk
