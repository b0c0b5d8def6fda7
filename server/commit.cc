#include "server/commit.h"

#include <algorithm>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace gtopk {
namespace server {
namespace {
constexpr absl::Duration kCancelPollInterval = absl::Milliseconds(50);
}  // namespace

CommitCoordinator::CommitCoordinator(uint32_t num_shards, int retained_steps)
    : num_shards_(num_shards),
      retained_steps_(static_cast<size_t>(std::max(1, retained_steps))) {}

void CommitCoordinator::Fence(const absl::Status& reason) {
  absl::MutexLock lock(&mu_);
  fenced_ =
      reason.ok() ? absl::AbortedError("the leader is recovering") : reason;
  for (auto it = steps_.begin(); it != steps_.end();) {
    if (!it->second->committed && it->second->aborted.ok()) {
      it->second->aborted = fenced_;
      it = steps_.erase(it);
    } else {
      ++it;
    }
  }
  changed_.SignalAll();
}

void CommitCoordinator::Unfence() {
  absl::MutexLock lock(&mu_);
  fenced_ = absl::OkStatus();
}

void CommitCoordinator::ForgetFrom(int64_t step) {
  absl::MutexLock lock(&mu_);
  for (auto it = steps_.lower_bound(step); it != steps_.end();) {
    if (!it->second->committed && it->second->aborted.ok()) {
      it->second->aborted = absl::AbortedError(absl::StrCat(
          "step ", it->first,
          " not committed: the cluster rolled back to step ", step));
    }
    it = steps_.erase(it);
  }
  changed_.SignalAll();
}

bool CommitCoordinator::Abort(int64_t step, const absl::Status& reason,
                              uint64_t epoch) {
  absl::MutexLock lock(&mu_);
  auto it = steps_.find(step);
  if (it != steps_.end()) {
    if (it->second->committed) return false;
    if (it->second->aborted.ok()) it->second->aborted = reason;
    steps_.erase(it);
  }
  Tombstone& tomb = aborted_[step];
  if (epoch >= tomb.epoch) tomb = Tombstone{reason, epoch};
  // Bounded: only the newest few steps matter (older ones are not voted on).
  while (aborted_.size() > retained_steps_) aborted_.erase(aborted_.begin());
  changed_.SignalAll();
  return true;
}

absl::Status CommitCoordinator::Vote(int64_t step, uint32_t shard,
                                     absl::Time deadline,
                                     const std::function<bool()>& cancelled,
                                     uint64_t epoch) {
  if (shard >= num_shards_ || step < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("commit vote from shard ", shard, " for step ", step,
                     ": shard must be < ", num_shards_, " and step >= 0"));
  }
  absl::MutexLock lock(&mu_);
  if (!fenced_.ok()) {
    // A repeated vote for a step committed before the fence is still OK.
    auto it = steps_.find(step);
    if (it != steps_.end() && it->second->committed) return absl::OkStatus();
    return fenced_;
  }
  if (auto dead = aborted_.find(step);
      dead != aborted_.end() && epoch < dead->second.epoch) {
    return dead->second.reason;  // a vote of the failed attempt
  }
  if (steps_.size() >= retained_steps_ && step < steps_.begin()->first) {
    return absl::FailedPreconditionError(
        absl::StrCat("commit vote for step ", step, " from shard ", shard,
                     " is older than the steps the leader retains"));
  }
  std::shared_ptr<Attempt> attempt = steps_[step];
  if (attempt == nullptr) {
    attempt = std::make_shared<Attempt>();
    attempt->voted.assign(num_shards_, false);
    steps_[step] = attempt;
  }
  // Waiters hold their attempt by shared_ptr, so eviction is safe.
  while (steps_.size() > retained_steps_) steps_.erase(steps_.begin());
  if (attempt->committed) return absl::OkStatus();
  if (!attempt->voted[shard]) {
    attempt->voted[shard] = true;
    if (++attempt->count == num_shards_) {
      attempt->committed = true;
      changed_.SignalAll();
      return absl::OkStatus();
    }
  }
  while (!attempt->committed && attempt->aborted.ok()) {
    // With a cancellation check, wake up every poll interval to look at it.
    const absl::Time wake =
        cancelled ? std::min(deadline, absl::Now() + kCancelPollInterval)
                  : deadline;
    changed_.WaitWithDeadline(&mu_, wake);
    if (attempt->committed || !attempt->aborted.ok()) break;
    if (cancelled && cancelled()) {
      attempt->aborted = absl::AbortedError(absl::StrCat(
          "step ", step, " not committed: the commit vote of shard ", shard,
          " was cancelled (the shard went away)"));
      auto it = steps_.find(step);
      if (it != steps_.end() && it->second == attempt) steps_.erase(it);
      changed_.SignalAll();
      return absl::CancelledError(absl::StrCat(
          "commit vote of shard ", shard, " for step ", step, " cancelled"));
    }
    if (absl::Now() >= deadline) {
      std::vector<uint32_t> missing;
      for (uint32_t s = 0; s < num_shards_; ++s) {
        if (!attempt->voted[s]) missing.push_back(s);
      }
      const std::string who = absl::StrJoin(missing, ", ");
      attempt->aborted = absl::AbortedError(
          absl::StrCat("step ", step, " not committed: shard(s) ", who,
                       " did not complete it in time"));
      auto it = steps_.find(step);
      if (it != steps_.end() && it->second == attempt) steps_.erase(it);
      changed_.SignalAll();
      return absl::DeadlineExceededError(
          absl::StrCat("step ", step, " not committed: waiting for shard(s) ",
                       who, " to complete it"));
    }
  }
  if (attempt->committed) return absl::OkStatus();
  return attempt->aborted;
}

}  // namespace server
}  // namespace gtopk
