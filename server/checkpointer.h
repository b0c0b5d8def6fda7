// Checkpointer: one shard's checkpoint writes, their health, and the
// rewinds of its checkpoint history (server/checkpoint.h holds the file
// format; AggregatorService, server/service.h, owns one). Every write and
// every change of the history goes through its lock, so that the history
// never gains an entry of an abandoned step while a rollback rewinds it.
#ifndef GTOPK_SERVER_CHECKPOINTER_H_
#define GTOPK_SERVER_CHECKPOINTER_H_

#include <cstdint>
#include <functional>
#include <optional>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "server/checkpoint.h"
#include "server/server_config.h"
#include "server/server_metrics.h"
#include "server/shard_aggregator.h"

namespace gtopk {
namespace server {

// Thread-safety: all methods are thread-safe; the writes, the listing and
// the rollback are serialised by one mutex (held across the file system
// calls, so callers must not hold locks a checkpoint write waits for).
class Checkpointer {
 public:
  // `config` and `metrics` must outlive this object. `stamp` writes the
  // cluster's identity (fingerprint, run id) into a snapshot before it is
  // written; called with the lock held.
  Checkpointer(const ServerConfig& config, ServerMetrics* metrics,
               std::function<void(ShardCheckpoint*)> stamp);
  Checkpointer(const Checkpointer&) = delete;
  Checkpointer& operator=(const Checkpointer&) = delete;

  // At start: this shard's current checkpoint in config.checkpoint_dir,
  // nullopt when there is none (NOT_FOUND). FAILED_PRECONDITION when it is
  // of another cluster or run than the shard's own retained ones (nothing
  // is changed then); ReadCheckpoint's other errors.
  absl::StatusOr<std::optional<ShardCheckpoint>> ReadForRestore() const;
  // After the checkpoint of `next_step` was restored: drops the retained
  // entries newer than it (left by a crash during a rollback) and retains
  // it. Errors: DiscardCheckpointsAfter's, RetainCheckpoint's.
  absl::Status Restored(int64_t next_step);

  // AggregatorService::WriteCheckpointNow for `aggregator` (null, or no
  // checkpoint_dir: OK, nothing written). Reports a failure loudly (stderr,
  // metric, health listener).
  absl::Status WriteNow(ShardAggregator* aggregator);
  // AggregatorService::SetCheckpointHealthListener.
  void SetHealthListener(std::function<void(bool ok)> listener);

  // The retained checkpoint steps <= `up_to`, oldest first (none without a
  // checkpoint_dir). Errors: ListCheckpointSteps'.
  absl::StatusOr<std::vector<int64_t>> StepsUpTo(int64_t up_to) const;

  // AggregatorService::LocalRollback's work on `aggregator` (not null):
  // rolls it back to `step` (from the retained checkpoint of `step` unless
  // it is already there or --apply=workers renumbers), then makes the
  // history agree. Returns the step it was at. Precondition: step >= 0.
  // Errors: FAILED_PRECONDITION (no checkpoint of `step`), the file
  // system's and the aggregator's.
  absl::StatusOr<int64_t> RollBack(ShardAggregator* aggregator, int64_t step);

 private:
  const ServerConfig& config_;
  ServerMetrics* const metrics_;
  const std::function<void(ShardCheckpoint*)> stamp_;
  mutable absl::Mutex mu_;  // one checkpoint writer at a time
  // False while the last checkpoint write failed.
  bool ok_ ABSL_GUARDED_BY(mu_) = true;
  std::function<void(bool)> health_ ABSL_GUARDED_BY(mu_);
};

}  // namespace server
}  // namespace gtopk

#endif  // GTOPK_SERVER_CHECKPOINTER_H_
