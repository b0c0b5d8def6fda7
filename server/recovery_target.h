// The leader's choice of a recovery target (docs/recovery.md, "The
// protocol", steps 5 and 6, and "When a rollback is impossible"): from every
// shard's state, the step the cluster continues from, whether the shards must
// be rolled back to it, or why recovery is impossible. A pure function, apart
// from the gRPC calls that read the states and roll the shards back
// (AggregatorService::RecoverClusterOnce, server/recovery.cc).
#ifndef GTOPK_SERVER_RECOVERY_TARGET_H_
#define GTOPK_SERVER_RECOVERY_TARGET_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "gtopk/v1/gtopk.pb.h"

namespace gtopk {
namespace server {

// What the leader's recovery does next.
struct RecoveryPlan {
  // Every shard's next step before the recovery, by shard
  // (RecoverResponse.previous_steps).
  std::vector<int64_t> previous_steps;
  // The step the cluster continues from (RecoverResponse.next_step): the
  // shards' common next step when they agree, else the newest step every
  // shard can restore.
  int64_t target_step = 0;
  // True when the shards disagree: every shard is to be rolled back to
  // target_step (RollbackShard). False: nothing to change.
  bool rollback = false;
  // Every shard's next step and retained checkpoints, e.g. "shard 0 at step
  // 4 (checkpoints: 2, 4); shard 1 at step 2 (checkpoints: 2)", for the
  // leader's log line about a rollback; empty when the shards agree.
  std::string shard_states;
};

// Chooses where the cluster continues after a failure.
//
// `states`: slot s is shard s's answer to GetShardState (S >= 1 slots), or
// the error of reading it, whose message names the shard. A shard's
// restorable steps are its next_step and its checkpoint_steps (any order,
// duplicates allowed).
//
// Returns, when every shard was read and has parameters:
//   - all shards at the same next step t: {target_step = t, rollback =
//     false};
//   - otherwise the newest step every shard can restore, t:
//     {target_step = t, rollback = true}.
// previous_steps is every shard's next step in both cases.
//
// Errors, checked shard by shard in that order, so that a shard without
// parameters is reported even when another could not be read:
//   INVALID_ARGUMENT     `states` is empty (a programming error: S >= 1).
//   FAILED_PRECONDITION  a shard that was read has no parameters
//                        (initialized = false): "Recover: shard s has no
//                        parameters (restarted without a checkpoint?); the
//                        cluster cannot continue".
//   a read error         "Recover: cannot read every shard's state: " and
//                        every error's message, joined by "; ". Code:
//                        FAILED_PRECONDITION when any error is (a shard
//                        configured differently: no retry reaches it);
//                        else shard 0's own code when shard 0 (the
//                        leader itself) failed; else UNAVAILABLE.
//   FAILED_PRECONDITION  the shards disagree and share no restorable step:
//                        "Recover: the shards are at different steps and
//                        retain no common checkpoint to roll back to: "
//                        followed by shard_states' description and advice.
//
// Pure; thread-safe.
absl::StatusOr<RecoveryPlan> ChooseRecoveryTarget(
    const std::vector<absl::StatusOr<v1::ShardState>>& states);

}  // namespace server
}  // namespace gtopk

#endif  // GTOPK_SERVER_RECOVERY_TARGET_H_
