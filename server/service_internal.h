// Helpers shared by the .cc files of AggregatorService (server/service.cc,
// server/push_pull.cc, server/download.cc, server/service_membership.cc,
// server/recovery.cc) and its components (server/membership.cc). Not an
// API: nothing outside server/ includes it.
#ifndef GTOPK_SERVER_SERVICE_INTERNAL_H_
#define GTOPK_SERVER_SERVICE_INTERNAL_H_

#include <algorithm>
#include <chrono>

#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "grpcpp/server_context.h"

namespace gtopk {
namespace server {
namespace internal {

// In every fingerprint refusal's message; non-leaders look for it in a
// leader call's status (ExplainLeaderRefusal).
inline constexpr char kFingerprintMarker[] = "cluster fingerprint";

// How often waits wake up to look for a cancelled call or a shutdown.
inline constexpr absl::Duration kPollInterval = absl::Milliseconds(50);

// How long Join waits for the open streams of a requested rank to end
// before calling the rank taken by a live worker: a worker that closed its
// streams and joins again at once (a restart) is noticed asynchronously,
// when its cancellation reaches this server.
inline constexpr absl::Duration kRankReleaseGrace = absl::Seconds(2);

// How long a worker's rank may be without a step stream on the leader
// (after its stream was cancelled: the process died or its connection
// broke) before a round waiting for its push fails, naming it: long enough
// for a live worker to reopen its streams (Recover), short against the
// step timeout (issue 42).
inline constexpr absl::Duration kWorkerGoneGrace = absl::Seconds(1);

// How long a rank whose step stream ended in the middle of a step stays
// reserved for its holder: this leader ended it with an error (a failed
// round), or the worker cancelled it while its push was in a round (it cut
// the step short when another shard failed). The worker is alive and
// recovers: its Recover follows after its backoff (at most 1.6 s) and
// extends the reservation to RankReclaimWindow. Without it, a Join of the
// rank in that gap took a live worker's rank (issue 42's break-it run: a
// shard restart with the any-rank certificate). A worker whose leader part
// of a failed step succeeded keeps its leader stream open until its
// Recover (WorkerClient), so its rank stays live throughout.
inline constexpr absl::Duration kRankRecoverHold = absl::Seconds(5);

// After a leader restart, how long a rank whose holder the leader's member
// file names stays reserved for that holder (server/member_file.h): until
// the worker re-registers with its token (Recover, or its step stream), a
// Join of the rank is refused UNAVAILABLE; past this window the holder is
// taken for gone and a Join may take the rank. A live worker is back within
// about its recovery backoff (1.6 s) plus one step's compute; the window is
// the step timeout, at least 10 s. (Shorter than a worker's default
// --rpc-timeout of 60 s, so that fresh workers of a cluster that crashed
// as a whole get their ranks by retrying Join.)
inline absl::Duration RankReclaimWindow(absl::Duration step_timeout) {
  return std::max(absl::Seconds(10), step_timeout);
}

// The deadline of `context`'s call; InfiniteFuture for none (or no context).
inline absl::Time ContextDeadline(const grpc::ServerContext* context) {
  if (context == nullptr) return absl::InfiniteFuture();
  const auto deadline = context->deadline();
  if (deadline == std::chrono::system_clock::time_point::max()) {
    return absl::InfiniteFuture();
  }
  return absl::FromChrono(deadline);
}

// Waits, with `mu` held, until `cond` holds, `deadline` passes or the call
// is cancelled, waking every kPollInterval to look at the call (and at a
// condition that changes without a release of `mu`, such as a stream's
// cancellation). Returns whether `cond` holds.
inline bool AwaitPolled(absl::Mutex& mu, const absl::Condition& cond,
                        absl::Time deadline, const grpc::ServerContext* context)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
  while (!mu.AwaitWithDeadline(
      cond, std::min(deadline, absl::Now() + kPollInterval))) {
    if ((context != nullptr && context->IsCancelled()) ||
        absl::Now() >= deadline) {
      return false;
    }
  }
  return true;
}

}  // namespace internal
}  // namespace server
}  // namespace gtopk

#endif  // GTOPK_SERVER_SERVICE_INTERNAL_H_
