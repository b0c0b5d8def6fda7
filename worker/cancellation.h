// Cancelling a worker's blocking calls from another thread: what lets the
// Python binding turn Ctrl-C into a prompt KeyboardInterrupt (python/) and
// any caller put an outer bound on WorkerClient's blocking methods.
#ifndef GTOPK_WORKER_CANCELLATION_H_
#define GTOPK_WORKER_CANCELLATION_H_

#include <cstddef>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_set.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace grpc {
class ClientContext;
}  // namespace grpc

namespace gtopk {
namespace worker {

// A cancellation source for gRPC calls. Every RPC a WorkerClient makes
// registers its grpc::ClientContext here for the call's life (a Scope);
// Cancel() cancels every registered call (grpc::ClientContext::TryCancel)
// and every call registered afterwards, until Reset(). A cancelled call
// ends with CANCELLED, and the WorkerClient method that made it returns
// that status under its usual failure contract (a Step applies nothing and
// keeps the residual).
//
// Thread-safety: every method is thread-safe; Cancel may be called from any
// thread (it does not wait for the calls to end). The contexts are owned by
// their callers, which keep them alive while registered.
class Cancellation {
 public:
  Cancellation() = default;
  Cancellation(const Cancellation&) = delete;
  Cancellation& operator=(const Cancellation&) = delete;

  // Cancels every registered call and every call registered before the
  // next Reset().
  void Cancel() ABSL_LOCKS_EXCLUDED(mu_);
  // Ends a Cancel(): later calls run normally. Calls already cancelled stay
  // cancelled.
  void Reset() ABSL_LOCKS_EXCLUDED(mu_);
  bool cancelled() const ABSL_LOCKS_EXCLUDED(mu_);
  // Sleeps `duration`, or less when Cancel() comes first; returns whether
  // the source is cancelled (a retry loop's cancellable backoff).
  bool SleepUnlessCancelled(absl::Duration duration) ABSL_LOCKS_EXCLUDED(mu_);
  // Calls registered now (for tests).
  size_t registered() const ABSL_LOCKS_EXCLUDED(mu_);

  // Registers `context` for its scope's life (the context must outlive the
  // scope); `cancellation` may be null (then the scope does nothing). When
  // the source is cancelled already, the context is cancelled at once.
  class Scope {
   public:
    Scope(Cancellation* cancellation, grpc::ClientContext* context);
    ~Scope();
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;

   private:
    Cancellation* const cancellation_;
    grpc::ClientContext* const context_;
  };

 private:
  mutable absl::Mutex mu_;
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  absl::flat_hash_set<grpc::ClientContext*> contexts_ ABSL_GUARDED_BY(mu_);
};

}  // namespace worker
}  // namespace gtopk

#endif  // GTOPK_WORKER_CANCELLATION_H_
