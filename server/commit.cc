#include "server/commit.h"

#include <algorithm>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace gtopk {
namespace server {

CommitCoordinator::CommitCoordinator(uint32_t num_shards, int retained_steps)
    : num_shards_(num_shards),
      retained_steps_(static_cast<size_t>(std::max(1, retained_steps))) {}

absl::Status CommitCoordinator::Vote(int64_t step, uint32_t shard,
                                     absl::Time deadline) {
  if (shard >= num_shards_ || step < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("commit vote from shard ", shard, " for step ", step,
                     ": shard must be < ", num_shards_, " and step >= 0"));
  }
  absl::MutexLock lock(&mu_);
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
    if (changed_.WaitWithDeadline(&mu_, deadline) && !attempt->committed &&
        attempt->aborted.ok()) {
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
