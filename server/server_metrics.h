// The metrics one gtopk-server exports (docs/metrics.md, "Server"), created
// up front in a prometheus::Registry so that the gRPC handlers only touch
// handles looked up once: lock-free counters and gauges, histograms with an
// uncontended per-histogram mutex (common/metrics/metrics.h).
#ifndef GTOPK_SERVER_SERVER_METRICS_H_
#define GTOPK_SERVER_SERVER_METRICS_H_

#include <array>
#include <atomic>
#include <cstdint>
#include <memory>

#include "absl/time/time.h"
#include "common/metrics/metrics.h"
#include "grpcpp/support/server_interceptor.h"
#include "server/call_limits.h"
#include "server/shard_aggregator.h"

namespace gtopk {
namespace server {

// Why a push was rejected (label `reason` of
// gtopk_server_rejected_messages_total).
enum class RejectReason {
  kWrongShard,     // "wrong_shard": push for another shard
  kUnknownWorker,  // "unknown_worker": rank >= P
  kWrongMode,      // "wrong_mode": dense bytes in a sparse mode or vice versa
  kWrongCodec,     // "wrong_codec": not the cluster's codecs
  kCorrupt,        // "corrupt": sparse bytes that do not decode
  kInvalid,        // "invalid": rejected by ShardAggregator::Submit
  kWrongStep,      // "wrong_step": neither the current step nor a retry
  kMixedStream,    // "mixed_stream": another rank on a worker's stream
  kWrongCluster,   // "wrong_cluster": another cluster fingerprint
  kNotMember,      // "not_member": no or another holder's member token
  kCount
};
const char* RejectReasonName(RejectReason reason);

// Thread-safety: every method is thread-safe; none takes a lock shared with
// other series or with a scrape beyond the histograms' own (RoundCompleted,
// once per round), except the constructor (which registers the families).
class ServerMetrics {
 public:
  // Registers every server family in `registry` (which must outlive this
  // object) and creates every known label set with value 0. Throws
  // std::invalid_argument (prometheus-cpp) only if `registry` already holds
  // one of these names with another type: a programmer error.
  explicit ServerMetrics(prometheus::Registry& registry);
  ~ServerMetrics();

  prometheus::Counter& received_push_bytes() { return *received_push_; }
  prometheus::Counter& received_init_bytes() { return *received_init_; }
  prometheus::Counter& sent_pull_bytes() { return *sent_pull_; }
  prometheus::Counter& sent_download_bytes() { return *sent_download_; }
  prometheus::Gauge& connected_workers() { return *connected_workers_; }
  // gtopk_server_push_parts_total and gtopk_server_piece_pulls_total
  // (rounds per bucket, docs/overlap.md).
  prometheus::Counter& push_parts() { return *push_parts_; }
  prometheus::Counter& piece_pulls() { return *piece_pulls_; }

  void Rejected(RejectReason reason);
  // A call or push refused by a resource bound
  // (gtopk_server_limit_rejections_total{bound}, docs/resource-limits.md).
  void LimitRejected(LimitBound bound);
  // The count so far for `bound` (for tests and logs).
  double limit_rejections(LimitBound bound) const;
  // Counts a finished RPC whose status is not OK.
  void RpcFinished(grpc::StatusCode code);
  // Records a completed round once (the first of its P callers to get here;
  // later calls for the same or an older step do nothing).
  void RoundCompleted(const RoundResult& result);
  // The shard wrote its checkpoint now (gtopk_server_checkpoint_age_seconds
  // counts from here).
  void CheckpointWritten();
  // A checkpoint write failed (gtopk_server_checkpoint_failures_total).
  void CheckpointFailed();
  // The failures counted so far (for tests and logs).
  double checkpoint_failures() const;

  // gtopk_server_checkpoint_age_seconds, computed at scrape time (absent
  // until the first checkpoint): prometheus::Registry holds only its own
  // families, so whoever serves the registry registers this collectable
  // beside it (prometheus::Exposer::RegisterCollectable holds it weakly; it
  // lives as long as this object).
  std::shared_ptr<prometheus::Collectable> checkpoint_age() const;

  // A gRPC interceptor factory that calls RpcFinished for every call of the
  // server (add it with ServerBuilder::experimental().SetInterceptorCreators).
  std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>
  MakeInterceptorFactory();

 private:
  class CheckpointAge;

  // Part of the constructor (round_duration_ .. piece_pulls_).
  void RegisterRoundMetrics(prometheus::Registry& registry);

  prometheus::Counter* received_push_;
  prometheus::Counter* received_init_;
  prometheus::Counter* sent_pull_;
  prometheus::Counter* sent_download_;
  prometheus::Histogram* round_duration_;
  prometheus::Histogram* slowest_wait_;
  prometheus::Histogram* merge_duration_;
  prometheus::Histogram* threshold_duration_;
  prometheus::Counter* selected_pairs_;
  prometheus::Counter* rounds_;
  prometheus::Counter* push_parts_;
  prometheus::Counter* piece_pulls_;
  prometheus::Gauge* step_;
  prometheus::Gauge* connected_workers_;
  std::array<prometheus::Counter*, static_cast<size_t>(RejectReason::kCount)>
      rejected_;
  std::array<prometheus::Counter*, static_cast<size_t>(LimitBound::kCount)>
      limit_rejections_;
  // Indexed by grpc::StatusCode (1..16).
  std::array<prometheus::Counter*, 17> rpc_errors_{};
  prometheus::Counter* checkpoint_failures_;
  std::shared_ptr<CheckpointAge> checkpoint_age_;
  std::atomic<int64_t> last_round_step_{-1};
};

}  // namespace server
}  // namespace gtopk

#endif  // GTOPK_SERVER_SERVER_METRICS_H_
