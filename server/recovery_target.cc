// ChooseRecoveryTarget (server/recovery_target.h): the leader's choice of the
// step a recovery continues from.
#include "server/recovery_target.h"

#include <algorithm>
#include <iterator>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace gtopk {
namespace server {
namespace {

std::string DescribeStates(const std::vector<v1::ShardState>& states) {
  std::vector<std::string> parts;
  for (const v1::ShardState& st : states) {
    parts.push_back(absl::StrCat(
        "shard ", st.shard_id(), " at step ", st.next_step(), " (checkpoints: ",
        st.checkpoint_steps().empty()
            ? std::string("none")
            : absl::StrJoin(st.checkpoint_steps(), ", "),
        ")"));
  }
  return absl::StrJoin(parts, "; ");
}

// The states of every shard, or why the recovery cannot use them (see
// ChooseRecoveryTarget's errors).
absl::StatusOr<std::vector<v1::ShardState>> ReadableStates(
    const std::vector<absl::StatusOr<v1::ShardState>>& states) {
  std::vector<v1::ShardState> known;
  std::vector<std::string> errors;
  for (size_t s = 0; s < states.size(); ++s) {
    if (!states[s].ok()) {
      errors.push_back(std::string(states[s].status().message()));
      continue;
    }
    if (!states[s]->initialized()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "Recover: shard ", s,
          " has no parameters (restarted without a checkpoint?); the "
          "cluster cannot continue"));
    }
    known.push_back(*states[s]);
  }
  if (!errors.empty()) {
    // A shard configured differently (FAILED_PRECONDITION naming the
    // flags) is not a shard that a retry can reach: keep its code, so that
    // the workers stop at once with the named flags.
    absl::StatusCode code = states[0].ok() ? absl::StatusCode::kUnavailable
                                           : states[0].status().code();
    for (const auto& st : states) {
      if (absl::IsFailedPrecondition(st.status())) {
        code = absl::StatusCode::kFailedPrecondition;
      }
    }
    return absl::Status(code, absl::StrCat("Recover: cannot read every shard's "
                                           "state: ",
                                           absl::StrJoin(errors, "; ")));
  }
  return known;
}

// The steps every shard can restore (its next step or a retained
// checkpoint), ascending; empty when there is none.
std::vector<int64_t> CommonRestorableSteps(
    const std::vector<v1::ShardState>& known) {
  std::vector<int64_t> common;
  for (size_t i = 0; i < known.size(); ++i) {
    std::vector<int64_t> mine(known[i].checkpoint_steps().begin(),
                              known[i].checkpoint_steps().end());
    mine.push_back(known[i].next_step());
    std::sort(mine.begin(), mine.end());
    mine.erase(std::unique(mine.begin(), mine.end()), mine.end());
    if (i == 0) {
      common = mine;
    } else {
      std::vector<int64_t> both;
      std::set_intersection(common.begin(), common.end(), mine.begin(),
                            mine.end(), std::back_inserter(both));
      common = std::move(both);
    }
  }
  return common;
}

}  // namespace

absl::StatusOr<RecoveryPlan> ChooseRecoveryTarget(
    const std::vector<absl::StatusOr<v1::ShardState>>& states) {
  if (states.empty()) {
    return absl::InvalidArgumentError(
        "ChooseRecoveryTarget: no shard states (a cluster has S >= 1 shards)");
  }
  absl::StatusOr<std::vector<v1::ShardState>> known = ReadableStates(states);
  if (!known.ok()) return known.status();
  RecoveryPlan plan;
  bool agree = true;
  for (const v1::ShardState& st : *known) {
    plan.previous_steps.push_back(st.next_step());
    agree &= st.next_step() == (*known)[0].next_step();
  }
  if (agree) {
    plan.target_step = (*known)[0].next_step();
    return plan;
  }
  plan.shard_states = DescribeStates(*known);
  const std::vector<int64_t> common = CommonRestorableSteps(*known);
  if (common.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "Recover: the shards are at different steps and retain no common "
        "checkpoint to roll back to: ",
        plan.shard_states,
        ". Restart every shard from checkpoints of one step (or raise "
        "--checkpoint-keep)"));
  }
  plan.target_step = common.back();
  plan.rollback = true;
  return plan;
}

}  // namespace server
}  // namespace gtopk
