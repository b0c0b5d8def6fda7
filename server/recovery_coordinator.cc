// RecoveryCoordinator and AbortForwards (server/recovery_coordinator.h).
#include "server/recovery_coordinator.h"

#include <utility>

namespace gtopk {
namespace server {

absl::StatusOr<v1::RecoverResponse> RecoveryCoordinator::RunOrJoin(
    int64_t kind, absl::Time wait_until, Recovery recovery) {
  {
    absl::MutexLock lock(&mu_);
    auto other_kind_running = [this, kind]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(
                                  mu_) { return recovering_ && kind_ != kind; };
    auto idle_or_same = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return !other_kind_running();
    };
    if (other_kind_running() &&
        !mu_.AwaitWithDeadline(absl::Condition(&idle_or_same), wait_until)) {
      return absl::DeadlineExceededError(
          "Recover: another recovery is still running on the leader");
    }
    if (recovering_) {
      // Workers failing together call Recover together: join the running
      // recovery and answer its outcome (e.g. the unreachable shard it
      // names), rather than start another one after it.
      const uint64_t generation = generation_;
      auto finished = [this, generation]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return generation_ != generation;
      };
      if (!mu_.AwaitWithDeadline(absl::Condition(&finished), wait_until)) {
        return absl::DeadlineExceededError(
            "Recover: another recovery is still running on the leader");
      }
      return last_;
    }
    recovering_ = true;
    kind_ = kind;
  }
  absl::StatusOr<v1::RecoverResponse> result = recovery();
  absl::MutexLock lock(&mu_);
  last_ = result;
  ++generation_;
  recovering_ = false;
  return result;
}

bool AbortForwards::Queue(int64_t step, Pending pending) {
  absl::MutexLock lock(&mu_);
  auto [queued, fresh] = queued_.try_emplace(step);
  queued->second = std::move(pending);
  return fresh;
}

std::optional<AbortForwards::Pending> AbortForwards::Take(int64_t step) {
  absl::MutexLock lock(&mu_);
  auto it = queued_.find(step);
  if (it == queued_.end()) return std::nullopt;
  Pending pending = std::move(it->second);
  queued_.erase(it);
  return pending;
}

}  // namespace server
}  // namespace gtopk
