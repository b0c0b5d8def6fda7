#include "worker/cancellation.h"

#include "grpcpp/client_context.h"

namespace gtopk {
namespace worker {

void Cancellation::Cancel() {
  absl::MutexLock lock(&mu_);
  cancelled_ = true;
  // Under mu_: a Scope cannot unregister (and its owner free the context)
  // while it is being cancelled.
  for (grpc::ClientContext* context : contexts_) context->TryCancel();
}

void Cancellation::Reset() {
  absl::MutexLock lock(&mu_);
  cancelled_ = false;
}

bool Cancellation::cancelled() const {
  absl::MutexLock lock(&mu_);
  return cancelled_;
}

bool Cancellation::SleepUnlessCancelled(absl::Duration duration) {
  absl::MutexLock lock(&mu_);
  mu_.AwaitWithTimeout(absl::Condition(&cancelled_), duration);
  return cancelled_;
}

size_t Cancellation::registered() const {
  absl::MutexLock lock(&mu_);
  return contexts_.size();
}

Cancellation::Scope::Scope(Cancellation* cancellation,
                           grpc::ClientContext* context)
    : cancellation_(cancellation), context_(context) {
  if (cancellation_ == nullptr || context_ == nullptr) return;
  absl::MutexLock lock(&cancellation_->mu_);
  cancellation_->contexts_.insert(context_);
  if (cancellation_->cancelled_) context_->TryCancel();
}

Cancellation::Scope::~Scope() {
  if (cancellation_ == nullptr || context_ == nullptr) return;
  absl::MutexLock lock(&cancellation_->mu_);
  cancellation_->contexts_.erase(context_);
}

}  // namespace worker
}  // namespace gtopk
