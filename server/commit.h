// Cross-shard commit of a step: no shard applies step t until every shard
// has computed its part of step t. Without it, a step that fails on one shard
// (a push that only that shard rejects, a worker that died after pushing to
// some shards, a shard that died) could be applied on the others, and the
// shards would then hold parameters of different steps.
#ifndef GTOPK_SERVER_COMMIT_H_
#define GTOPK_SERVER_COMMIT_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/epoch.h"

namespace gtopk {
namespace server {

// The leader's side: collects "ready to apply step t" votes from the S
// shards. Thread-safe; Vote blocks.
class CommitCoordinator {
 public:
  // `num_shards` is S >= 1; `retained_steps` decided steps are remembered
  // so that a repeated vote (a retry) gets the same answer.
  explicit CommitCoordinator(uint32_t num_shards, int retained_steps = 8);

  // Shard `shard` is ready to apply `step`. Returns OK once all S shards
  // have voted for the step (then every shard applies it), also for a vote
  // on a step already committed. Errors (the step must not be applied):
  //   INVALID_ARGUMENT   shard >= S or step < 0 (only this call);
  //   DEADLINE_EXCEEDED  `deadline` passed before every shard voted; the
  //                      message names the shards that did not. The
  //                      attempt is discarded, so that the workers' retry of
  //                      the step starts a fresh vote; other shards waiting
  //                      on it get ABORTED.
  //   FAILED_PRECONDITION the step is older than the retained ones.
  //   CANCELLED          `cancelled` returned true while waiting (the
  //                      voter's RPC was cancelled: the shard went away);
  //                      the attempt is discarded as for a deadline, other
  //                      shards waiting on it get ABORTED naming the shard.
  //   ABORTED            the leader is recovering (Fence) or rolled back
  //                      past the step (ForgetFrom).
  //   ABORTED            also: the step failed on some shard (Abort) and
  //                      `epoch` (the smallest attempt epoch of the
  //                      voter's round, common/epoch.h) is older than that
  //                      failure: the vote belongs to the failed attempt.
  // `cancelled` (may be empty) is polled every 50 ms while waiting.
  absl::Status Vote(int64_t step, uint32_t shard, absl::Time deadline,
                    const std::function<bool()>& cancelled = {},
                    uint64_t epoch = kNewestEpoch);

  // Crash recovery (server/service.h, Recover). While fenced, every vote
  // fails with `reason` (ABORTED) and no step is committed; votes waiting
  // now fail at once. Steps committed before the fence stay committed.
  void Fence(const absl::Status& reason);
  void Unfence();
  // Forgets every step >= `step` (committed or not; waiters get ABORTED),
  // so that the steps the cluster rolled back are voted on afresh.
  void ForgetFrom(int64_t step);

  // Fail fast (AbortStep RPC): the step failed on some shard; `epoch` is
  // the failure's attempt epoch. Voters waiting now get `reason` (ABORTED),
  // and later votes for `step` with an older epoch get it at once -- a
  // shard still computing the failed attempt must not open a new one that
  // the workers' retry would then join. No effect on a committed step
  // (returns false); true otherwise.
  bool Abort(int64_t step, const absl::Status& reason, uint64_t epoch);

 private:
  struct Attempt {
    std::vector<bool> voted;
    uint32_t count = 0;
    bool committed = false;
    absl::Status aborted;  // non-OK once discarded
  };
  const uint32_t num_shards_;
  const size_t retained_steps_;
  absl::Mutex mu_;
  absl::CondVar changed_;
  std::map<int64_t, std::shared_ptr<Attempt>> steps_ ABSL_GUARDED_BY(mu_);
  absl::Status fenced_ ABSL_GUARDED_BY(mu_);  // not OK while fenced
  // Abort()ed steps: the reason, and the epoch votes must reach.
  struct Tombstone {
    absl::Status reason;
    uint64_t epoch = 0;
  };
  std::map<int64_t, Tombstone> aborted_ ABSL_GUARDED_BY(mu_);
};

// How a shard reaches the leader's CommitCoordinator.
class CommitVoter {
 public:
  virtual ~CommitVoter() = default;
  // Same contract as CommitCoordinator::Vote (plus transport errors).
  virtual absl::Status Vote(int64_t step, uint32_t shard, absl::Time deadline,
                            uint64_t epoch) = 0;
};

// In-process voter (the leader itself, tests).
class LocalCommitVoter final : public CommitVoter {
 public:
  explicit LocalCommitVoter(CommitCoordinator* coordinator)
      : coordinator_(coordinator) {}
  absl::Status Vote(int64_t step, uint32_t shard, absl::Time deadline,
                    uint64_t epoch) override {
    return coordinator_->Vote(step, shard, deadline, {}, epoch);
  }

 private:
  CommitCoordinator* const coordinator_;
};

}  // namespace server
}  // namespace gtopk

#endif  // GTOPK_SERVER_COMMIT_H_
