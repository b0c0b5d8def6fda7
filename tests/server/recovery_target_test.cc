// server/recovery_target.h: the leader's choice of the step a recovery
// continues from, against hand-written shard states for every rule of
// docs/recovery.md (agreement, rollback to the newest common restorable
// step, no common step, a shard without parameters, unreadable shards).
#include "server/recovery_target.h"

#include <cstdint>
#include <initializer_list>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace gtopk {
namespace server {
namespace {

using ::gtopk::testing::StatusIs;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;

using States = std::vector<absl::StatusOr<v1::ShardState>>;

// Shard `shard` with parameters, at `next_step`, retaining checkpoints of
// `checkpoints` (in the order given).
v1::ShardState At(uint32_t shard, int64_t next_step,
                  std::initializer_list<int64_t> checkpoints) {
  v1::ShardState state;
  state.set_shard_id(shard);
  state.set_initialized(true);
  state.set_next_step(next_step);
  for (int64_t c : checkpoints) state.add_checkpoint_steps(c);
  return state;
}

// Shard `shard` restarted without a checkpoint: no parameters.
v1::ShardState Uninitialized(uint32_t shard) {
  v1::ShardState state;
  state.set_shard_id(shard);
  return state;
}

TEST(ChooseRecoveryTargetTest, OneShardContinuesFromItsStep) {
  GTOPK_ASSERT_OK_AND_ASSIGN(const RecoveryPlan plan,
                             ChooseRecoveryTarget(States{At(0, 7, {6})}));
  EXPECT_FALSE(plan.rollback);
  EXPECT_EQ(plan.target_step, 7);
  EXPECT_THAT(plan.previous_steps, ElementsAre(7));
  EXPECT_THAT(plan.shard_states, IsEmpty());
}

// The usual case after a step failure without a crash: nothing to repair,
// whatever checkpoints the shards retain.
TEST(ChooseRecoveryTargetTest, ShardsAtTheSameStepAgreeWithoutRollback) {
  GTOPK_ASSERT_OK_AND_ASSIGN(
      const RecoveryPlan plan,
      ChooseRecoveryTarget(
          States{At(0, 5, {4, 5}), At(1, 5, {}), At(2, 5, {2})}));
  EXPECT_FALSE(plan.rollback);
  EXPECT_EQ(plan.target_step, 5);
  EXPECT_THAT(plan.previous_steps, ElementsAre(5, 5, 5));
  EXPECT_THAT(plan.shard_states, IsEmpty());
}

// A shard restarted from its checkpoint of step 4 while the others went on
// to 6: they go back to their checkpoint of 4.
TEST(ChooseRecoveryTargetTest, OneShardBehindRollsTheOthersBackToIt) {
  GTOPK_ASSERT_OK_AND_ASSIGN(
      const RecoveryPlan plan,
      ChooseRecoveryTarget(
          States{At(0, 6, {4, 6}), At(1, 6, {4, 6}), At(2, 4, {4})}));
  EXPECT_TRUE(plan.rollback);
  EXPECT_EQ(plan.target_step, 4);
  EXPECT_THAT(plan.previous_steps, ElementsAre(6, 6, 4));
  EXPECT_EQ(plan.shard_states,
            "shard 0 at step 6 (checkpoints: 4, 6); shard 1 at step 6 "
            "(checkpoints: 4, 6); shard 2 at step 4 (checkpoints: 4)");
}

// A shard killed after the commit vote of step 4 but before it applied the
// step: the others applied it (next step 5) and the crashed one did not
// (next step 4, its checkpoint). Target: 4, where the one behind is, from
// the others' retained checkpoint.
TEST(ChooseRecoveryTargetTest, ShardsAheadWithAStepTheOtherLacksRollBack) {
  GTOPK_ASSERT_OK_AND_ASSIGN(
      const RecoveryPlan plan,
      ChooseRecoveryTarget(States{At(0, 5, {4, 5}), At(1, 4, {2, 4})}));
  EXPECT_TRUE(plan.rollback);
  EXPECT_EQ(plan.target_step, 4);
  EXPECT_THAT(plan.previous_steps, ElementsAre(5, 4));
}

// One shard ahead of the others, which cannot restore its step: everyone
// goes back to the newest checkpoint they share, older than both current
// steps (not to the shard that is ahead).
TEST(ChooseRecoveryTargetTest, TargetIsTheNewestStepEveryShardCanRestore) {
  GTOPK_ASSERT_OK_AND_ASSIGN(
      const RecoveryPlan plan,
      ChooseRecoveryTarget(States{At(0, 5, {2, 5}), At(1, 4, {2, 3})}));
  EXPECT_TRUE(plan.rollback);
  EXPECT_EQ(plan.target_step, 2);
  EXPECT_THAT(plan.previous_steps, ElementsAre(5, 4));
}

// A shard's current step counts as restorable (it keeps its state), and
// the newest of several common steps wins.
TEST(ChooseRecoveryTargetTest, ABehindShardsCurrentStepIsRestorable) {
  GTOPK_ASSERT_OK_AND_ASSIGN(
      const RecoveryPlan plan,
      ChooseRecoveryTarget(States{At(0, 8, {4, 6, 8}), At(1, 6, {2, 4})}));
  EXPECT_TRUE(plan.rollback);
  EXPECT_EQ(plan.target_step, 6);
}

// Checkpoint lists in any order and with repeats give the same target.
TEST(ChooseRecoveryTargetTest, CheckpointOrderAndRepeatsDoNotMatter) {
  GTOPK_ASSERT_OK_AND_ASSIGN(
      const RecoveryPlan plan,
      ChooseRecoveryTarget(
          States{At(0, 9, {6, 3, 6, 9}), At(1, 7, {7, 3, 6}), At(2, 6, {6})}));
  EXPECT_TRUE(plan.rollback);
  EXPECT_EQ(plan.target_step, 6);
  EXPECT_THAT(plan.previous_steps, ElementsAre(9, 7, 6));
}

// docs/recovery.md, "When a rollback is impossible": the message, verbatim.
TEST(ChooseRecoveryTargetTest,
     NoCommonStepIsFailedPreconditionNamingEveryShard) {
  EXPECT_THAT(
      ChooseRecoveryTarget(States{At(0, 4, {4}), At(1, 2, {2})}),
      StatusIs(absl::StatusCode::kFailedPrecondition,
               "Recover: the shards are at different steps and retain no "
               "common checkpoint to roll back to: shard 0 at step 4 "
               "(checkpoints: 4); shard 1 at step 2 (checkpoints: 2). "
               "Restart every shard from checkpoints of one step (or raise "
               "--checkpoint-keep)"));
}

// Without --checkpoint-dir a shard restores nothing but its current step.
TEST(ChooseRecoveryTargetTest, ShardsWithoutCheckpointsAtDifferentStepsFail) {
  EXPECT_THAT(ChooseRecoveryTarget(States{At(0, 3, {}), At(1, 2, {})}),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("shard 0 at step 3 (checkpoints: none); "
                                 "shard 1 at step 2 (checkpoints: none)")));
}

TEST(ChooseRecoveryTargetTest, AShardWithoutParametersIsFailedPrecondition) {
  EXPECT_THAT(
      ChooseRecoveryTarget(States{At(0, 3, {3}), Uninitialized(1)}),
      StatusIs(absl::StatusCode::kFailedPrecondition,
               "Recover: shard 1 has no parameters (restarted without a "
               "checkpoint?); the cluster cannot continue"));
}

// Even with the shards otherwise agreeing, and before an unreadable shard is
// reported.
TEST(ChooseRecoveryTargetTest, AShardWithoutParametersWinsOverUnreadableOnes) {
  EXPECT_THAT(ChooseRecoveryTarget(States{
                  At(0, 3, {}), absl::UnavailableError("shard 1 (h:1) down"),
                  Uninitialized(2)}),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("shard 2 has no parameters")));
}

// A shard that cannot be read is UNAVAILABLE whatever its own code (the
// worker retries Recover), also when the readable shards agree.
TEST(ChooseRecoveryTargetTest, AnUnreachableShardIsUnavailableNamingIt) {
  EXPECT_THAT(
      ChooseRecoveryTarget(States{
          At(0, 5, {}), At(1, 5, {}),
          absl::DeadlineExceededError(
              "shard 2 (127.0.0.1:9) GetShardState: Deadline Exceeded")}),
      StatusIs(absl::StatusCode::kUnavailable,
               "Recover: cannot read every shard's state: shard 2 "
               "(127.0.0.1:9) GetShardState: Deadline Exceeded"));
}

// The leader's own state (slot 0) keeps its code: e.g. its round did not
// settle before the deadline.
TEST(ChooseRecoveryTargetTest, TheLeadersOwnErrorKeepsItsCode) {
  EXPECT_THAT(ChooseRecoveryTarget(States{
                  absl::DeadlineExceededError("settling"), At(1, 5, {})}),
              StatusIs(absl::StatusCode::kDeadlineExceeded,
                       "Recover: cannot read every shard's state: settling"));
}

// A shard configured differently is not one a retry can reach: its
// FAILED_PRECONDITION wins over every other code, and every error is named.
TEST(ChooseRecoveryTargetTest, AMisconfiguredShardIsFailedPrecondition) {
  EXPECT_THAT(
      ChooseRecoveryTarget(
          States{absl::DeadlineExceededError("shard 0: settling"),
                 absl::UnavailableError("shard 1 (h:1) GetShardState: down"),
                 absl::FailedPreconditionError(
                     "shard 2 (h:2) GetShardState: --lr is 0.5 here but 0.1")}),
      StatusIs(absl::StatusCode::kFailedPrecondition,
               "Recover: cannot read every shard's state: shard 0: "
               "settling; shard 1 (h:1) GetShardState: down; shard 2 (h:2) "
               "GetShardState: --lr is 0.5 here but 0.1"));
}

TEST(ChooseRecoveryTargetTest, NoStatesIsInvalidArgument) {
  EXPECT_THAT(ChooseRecoveryTarget(States{}),
              StatusIs(absl::StatusCode::kInvalidArgument));
}

}  // namespace
}  // namespace server
}  // namespace gtopk
