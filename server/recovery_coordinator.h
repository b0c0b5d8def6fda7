// The leader's bookkeeping of crash recovery and fail fast
// (docs/recovery.md), each with its own lock, owned by AggregatorService
// (server/service.h): RecoveryCoordinator runs one recovery at a time and
// lets concurrent callers of the same kind share it; AbortForwards queues
// at most one forward of a step's failure to the other shards per step.
#ifndef GTOPK_SERVER_RECOVERY_COORDINATOR_H_
#define GTOPK_SERVER_RECOVERY_COORDINATOR_H_

#include <cstdint>
#include <map>
#include <optional>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "gtopk/v1/gtopk.pb.h"

namespace gtopk {
namespace server {

// One recovery at a time (callers wait up to their deadline).
// Thread-safety: thread-safe.
class RecoveryCoordinator {
 public:
  using Recovery = absl::FunctionRef<absl::StatusOr<v1::RecoverResponse>()>;

  // Runs `recovery` of `kind` (-1: a plain recovery, else the step resumed
  // at), or shares one running: callers of the same kind share one run
  // (they wait for it and get its outcome); another kind waits for the
  // running one to finish, then runs its own. Waits end at `wait_until`:
  // DEADLINE_EXCEEDED "Recover: another recovery is still running on the
  // leader". Otherwise `recovery`'s result.
  absl::StatusOr<v1::RecoverResponse> RunOrJoin(int64_t kind,
                                                absl::Time wait_until,
                                                Recovery recovery);

 private:
  absl::Mutex mu_;
  bool recovering_ ABSL_GUARDED_BY(mu_) = false;
  // The running recovery's kind: -1 plain, else the step resumed at.
  int64_t kind_ ABSL_GUARDED_BY(mu_) = -1;
  // Incremented when a recovery finishes; last_ is its outcome, answered
  // to the callers that joined it.
  uint64_t generation_ ABSL_GUARDED_BY(mu_) = 0;
  absl::StatusOr<v1::RecoverResponse> last_ ABSL_GUARDED_BY(mu_) =
      absl::UnknownError("no recovery yet");
};

// The leader's forwards of step failures to the other shards not yet
// sent, one per step (AggregatorService::LeaderAbortStep): a later failure
// of a step whose forward is queued replaces its origin, reason and epoch
// instead of queueing another, so the queue holds at most one task per
// step (and AbortStep accepts steps within kAbortStepWindow of the next
// step only): a flood of AbortStep calls cannot grow it without bound.
// Thread-safety: thread-safe.
class AbortForwards {
 public:
  struct Pending {
    uint32_t origin = 0;
    std::string reason;
    uint64_t epoch = 0;
  };
  // Queues `pending` for `step`, replacing a queued one. True when none was
  // queued (the caller posts the forward), false when one was replaced.
  bool Queue(int64_t step, Pending pending);
  // Takes the queued forward of `step`; nullopt when none.
  std::optional<Pending> Take(int64_t step);

 private:
  absl::Mutex mu_;
  std::map<int64_t, Pending> queued_ ABSL_GUARDED_BY(mu_);
};

}  // namespace server
}  // namespace gtopk

#endif  // GTOPK_SERVER_RECOVERY_COORDINATOR_H_
