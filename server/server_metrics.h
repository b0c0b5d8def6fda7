// The metrics one gtopk-server exports (docs/metrics.md, "Server"), created
// up front in a metrics::Registry so that the gRPC handlers only touch
// lock-free counters, gauges and histograms.
#ifndef GTOPK_SERVER_SERVER_METRICS_H_
#define GTOPK_SERVER_SERVER_METRICS_H_

#include <array>
#include <atomic>
#include <cstdint>
#include <memory>

#include "absl/time/time.h"
#include "common/metrics/metrics.h"
#include "grpcpp/support/server_interceptor.h"
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

// Thread-safety: every method is thread-safe and lock-free, except the
// constructor (which registers the families).
class ServerMetrics {
 public:
  // Registers every server family in `registry` (which must outlive this
  // object) and creates every known label set with value 0.
  explicit ServerMetrics(metrics::Registry& registry);
  ~ServerMetrics();

  metrics::Counter& received_push_bytes() { return *received_push_; }
  metrics::Counter& received_init_bytes() { return *received_init_; }
  metrics::Counter& sent_pull_bytes() { return *sent_pull_; }
  metrics::Counter& sent_download_bytes() { return *sent_download_; }
  metrics::Gauge& connected_workers() { return *connected_workers_; }

  void Rejected(RejectReason reason);
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

  // A gRPC interceptor factory that calls RpcFinished for every call of the
  // server (add it with ServerBuilder::experimental().SetInterceptorCreators).
  std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>
  MakeInterceptorFactory();

 private:
  class CheckpointAge;

  metrics::Counter* received_push_;
  metrics::Counter* received_init_;
  metrics::Counter* sent_pull_;
  metrics::Counter* sent_download_;
  metrics::Histogram* round_duration_;
  metrics::Histogram* slowest_wait_;
  metrics::Histogram* merge_duration_;
  metrics::Histogram* threshold_duration_;
  metrics::Counter* selected_pairs_;
  metrics::Counter* rounds_;
  metrics::Gauge* step_;
  metrics::Gauge* connected_workers_;
  std::array<metrics::Counter*, static_cast<size_t>(RejectReason::kCount)>
      rejected_;
  // Indexed by grpc::StatusCode (1..16).
  std::array<metrics::Counter*, 17> rpc_errors_{};
  metrics::Counter* checkpoint_failures_;
  std::shared_ptr<CheckpointAge> checkpoint_age_;
  std::atomic<int64_t> last_round_step_{-1};
};

}  // namespace server
}  // namespace gtopk

#endif  // GTOPK_SERVER_SERVER_METRICS_H_
