// A single background thread running queued tasks in order: the service's
// fire-and-forget messages (AbortStep to the leader and from the leader to
// the shards) leave the thread that failed a round without blocking it.
#ifndef GTOPK_SERVER_TASK_QUEUE_H_
#define GTOPK_SERVER_TASK_QUEUE_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <thread>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace gtopk {
namespace server {

// Thread-safe. Tasks must bound their own running time (e.g. RPC
// deadlines): the destructor drops tasks not yet started and waits for the
// running one.
class TaskQueue {
 public:
  TaskQueue() : thread_([this] { Run(); }) {}
  ~TaskQueue() {
    {
      absl::MutexLock lock(&mu_);
      stopping_ = true;
      tasks_.clear();
    }
    thread_.join();
  }
  TaskQueue(const TaskQueue&) = delete;
  TaskQueue& operator=(const TaskQueue&) = delete;

  // Queues `task`; does not block. Ignored once the destructor started.
  void Post(std::function<void()> task) {
    absl::MutexLock lock(&mu_);
    if (stopping_) return;
    tasks_.push_back(std::move(task));
  }

  // Waits until every task posted before the call has run, or `deadline`;
  // true when they have.
  bool Flush(absl::Time deadline) {
    absl::MutexLock lock(&mu_);
    const uint64_t target = posted_total();
    auto done = [this, target]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return finished_ >= target || stopping_;
    };
    return mu_.AwaitWithDeadline(absl::Condition(&done), deadline);
  }

 private:
  uint64_t posted_total() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return finished_ + (running_ ? 1 : 0) + tasks_.size();
  }

  void Run() {
    while (true) {
      std::function<void()> task;
      {
        absl::MutexLock lock(&mu_);
        auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
          return stopping_ || !tasks_.empty();
        };
        mu_.Await(absl::Condition(&ready));
        if (stopping_) return;
        task = std::move(tasks_.front());
        tasks_.pop_front();
        running_ = true;
      }
      task();
      absl::MutexLock lock(&mu_);
      running_ = false;
      ++finished_;
    }
  }

  absl::Mutex mu_;
  std::deque<std::function<void()>> tasks_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  bool running_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t finished_ ABSL_GUARDED_BY(mu_) = 0;
  std::thread thread_;  // last: starts after the members above exist
};

}  // namespace server
}  // namespace gtopk

#endif  // GTOPK_SERVER_TASK_QUEUE_H_
