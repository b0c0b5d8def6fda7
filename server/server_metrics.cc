#include "server/server_metrics.h"

#include <cmath>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "grpcpp/support/interceptor.h"
#include "prometheus/client_metric.h"
#include "prometheus/metric_family.h"

namespace gtopk {
namespace server {
namespace {

using metrics::DurationBuckets;
using prometheus::BuildCounter;
using prometheus::BuildGauge;
using prometheus::BuildHistogram;

const char* const kStatusCodeNames[17] = {"OK",
                                          "CANCELLED",
                                          "UNKNOWN",
                                          "INVALID_ARGUMENT",
                                          "DEADLINE_EXCEEDED",
                                          "NOT_FOUND",
                                          "ALREADY_EXISTS",
                                          "PERMISSION_DENIED",
                                          "RESOURCE_EXHAUSTED",
                                          "FAILED_PRECONDITION",
                                          "ABORTED",
                                          "OUT_OF_RANGE",
                                          "UNIMPLEMENTED",
                                          "INTERNAL",
                                          "UNAVAILABLE",
                                          "DATA_LOSS",
                                          "UNAUTHENTICATED"};

class ErrorInterceptor final : public grpc::experimental::Interceptor {
 public:
  explicit ErrorInterceptor(ServerMetrics* metrics) : metrics_(metrics) {}
  void Intercept(
      grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(
            grpc::experimental::InterceptionHookPoints::PRE_SEND_STATUS)) {
      const grpc::Status status = methods->GetSendStatus();
      if (!status.ok()) metrics_->RpcFinished(status.error_code());
    }
    methods->Proceed();
  }

 private:
  ServerMetrics* const metrics_;
};

class ErrorInterceptorFactory final
    : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  explicit ErrorInterceptorFactory(ServerMetrics* metrics)
      : metrics_(metrics) {}
  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo* /*info*/) override {
    return new ErrorInterceptor(metrics_);
  }

 private:
  ServerMetrics* const metrics_;
};

}  // namespace

const char* RejectReasonName(RejectReason reason) {
  switch (reason) {
    case RejectReason::kWrongShard:
      return "wrong_shard";
    case RejectReason::kUnknownWorker:
      return "unknown_worker";
    case RejectReason::kWrongMode:
      return "wrong_mode";
    case RejectReason::kWrongCodec:
      return "wrong_codec";
    case RejectReason::kCorrupt:
      return "corrupt";
    case RejectReason::kInvalid:
      return "invalid";
    case RejectReason::kWrongStep:
      return "wrong_step";
    case RejectReason::kMixedStream:
      return "mixed_stream";
    case RejectReason::kWrongCluster:
      return "wrong_cluster";
    case RejectReason::kNotMember:
      return "not_member";
    case RejectReason::kCount:
      break;
  }
  return "unknown";
}

// gtopk_server_checkpoint_age_seconds, computed at scrape time; absent until
// the first checkpoint.
class ServerMetrics::CheckpointAge final : public prometheus::Collectable {
 public:
  void Written() {
    last_.store(absl::ToDoubleSeconds(absl::Now() - absl::UnixEpoch()),
                std::memory_order_relaxed);
  }
  std::vector<prometheus::MetricFamily> Collect() const override {
    const double last = last_.load(std::memory_order_relaxed);
    if (std::isnan(last)) return {};
    prometheus::MetricFamily f;
    f.name = "gtopk_server_checkpoint_age_seconds";
    f.help = "Seconds since this shard last wrote its checkpoint successfully.";
    f.type = prometheus::MetricType::Gauge;
    prometheus::ClientMetric m;
    m.gauge.value =
        absl::ToDoubleSeconds(absl::Now() - absl::UnixEpoch()) - last;
    f.metric.push_back(m);
    return {f};
  }

 private:
  std::atomic<double> last_{std::numeric_limits<double>::quiet_NaN()};
};

// The per-round families: durations, selected pairs, rounds, and the
// parts and piece pulls of the rounds per bucket.
void ServerMetrics::RegisterRoundMetrics(prometheus::Registry& registry) {
  round_duration_ =
      &BuildHistogram()
           .Name("gtopk_server_round_duration_seconds")
           .Help(
               "One round on this shard: from the first push of a step to "
               "its result (merge, selection, commit and apply included).")
           .Register(registry)
           .Add({}, DurationBuckets());
  slowest_wait_ = &BuildHistogram()
                       .Name("gtopk_server_slowest_worker_wait_seconds")
                       .Help(
                           "Per round, from the first push to the last: the "
                           "wait for the slowest worker.")
                       .Register(registry)
                       .Add({}, DurationBuckets());
  merge_duration_ = &BuildHistogram()
                         .Name("gtopk_server_merge_duration_seconds")
                         .Help("Per round, the sum of the P pushes.")
                         .Register(registry)
                         .Add({}, DurationBuckets());
  threshold_duration_ =
      &BuildHistogram()
           .Name("gtopk_server_threshold_duration_seconds")
           .Help(
               "Per round, the selection of the global top-k (gtopk threshold: "
               "with the threshold exchange with the leader).")
           .Register(registry)
           .Add({}, DurationBuckets());
  selected_pairs_ = &BuildCounter()
                         .Name("gtopk_server_selected_pairs_total")
                         .Help(
                             "Index/value pairs selected per round, summed "
                             "over rounds.")
                         .Register(registry)
                         .Add({});
  rounds_ = &BuildCounter()
                 .Name("gtopk_server_rounds_total")
                 .Help("Rounds completed by this shard.")
                 .Register(registry)
                 .Add({});
  push_parts_ = &BuildCounter()
                     .Name("gtopk_server_push_parts_total")
                     .Help(
                         "Parts of pushes sent in parts (layer-wise overlap: "
                         "a worker's ready pieces, sent during backward) "
                         "taken into a step's piece rounds.")
                     .Register(registry)
                     .Add({});
  piece_pulls_ = &BuildCounter()
                      .Name("gtopk_server_piece_pulls_total")
                      .Help(
                          "Piece pulls sent: the selection of consecutive "
                          "pieces whose rounds are done, sent before the "
                          "step commits.")
                      .Register(registry)
                      .Add({});
}

ServerMetrics::ServerMetrics(prometheus::Registry& registry) {
  auto& received = BuildCounter()
                       .Name("gtopk_server_received_bytes_total")
                       .Help(
                           "Serialized request message bytes received, by "
                           "gRPC method.")
                       .Register(registry);
  received_push_ = &received.Add({{"method", "PushPull"}});
  received_init_ = &received.Add({{"method", "InitParams"}});
  auto& sent = BuildCounter()
                   .Name("gtopk_server_sent_bytes_total")
                   .Help(
                       "Serialized response message bytes sent, by gRPC "
                       "method.")
                   .Register(registry);
  sent_pull_ = &sent.Add({{"method", "PushPull"}});
  sent_download_ = &sent.Add({{"method", "DownloadParams"}});
  RegisterRoundMetrics(registry);
  step_ = &BuildGauge()
               .Name("gtopk_server_step")
               .Help("The next step this shard will apply.")
               .Register(registry)
               .Add({});
  connected_workers_ = &BuildGauge()
                            .Name("gtopk_server_connected_workers")
                            .Help("Open PushPull streams (connected workers).")
                            .Register(registry)
                            .Add({});
  auto& rejected = BuildCounter()
                       .Name("gtopk_server_rejected_messages_total")
                       .Help("Pushes rejected, by reason.")
                       .Register(registry);
  for (size_t r = 0; r < rejected_.size(); ++r) {
    rejected_[r] = &rejected.Add(
        {{"reason", RejectReasonName(static_cast<RejectReason>(r))}});
  }
  auto& limits =
      BuildCounter()
          .Name("gtopk_server_limit_rejections_total")
          .Help(
              "Calls and pushes refused with RESOURCE_EXHAUSTED by a "
              "resource bound, by bound (docs/resource-limits.md).")
          .Register(registry);
  for (size_t b = 0; b < limit_rejections_.size(); ++b) {
    limit_rejections_[b] =
        &limits.Add({{"bound", LimitBoundName(static_cast<LimitBound>(b))}});
  }
  auto& errors =
      BuildCounter()
          .Name("gtopk_server_rpc_errors_total")
          .Help("RPCs that ended with a non-OK gRPC status, by code.")
          .Register(registry);
  for (size_t c = 1; c < rpc_errors_.size(); ++c) {
    rpc_errors_[c] = &errors.Add({{"code", kStatusCodeNames[c]}});
  }
  checkpoint_failures_ =
      &BuildCounter()
           .Name("gtopk_server_checkpoint_failures_total")
           .Help(
               "Checkpoint writes of this shard that failed (periodic, "
               "initial or final); the previous checkpoint stays the one "
               "a restart restores.")
           .Register(registry)
           .Add({});
  checkpoint_age_ = std::make_shared<CheckpointAge>();
}

ServerMetrics::~ServerMetrics() = default;

void ServerMetrics::Rejected(RejectReason reason) {
  const size_t r = static_cast<size_t>(reason);
  if (r < rejected_.size()) rejected_[r]->Increment();
}

void ServerMetrics::LimitRejected(LimitBound bound) {
  const size_t b = static_cast<size_t>(bound);
  if (b < limit_rejections_.size()) limit_rejections_[b]->Increment();
}

double ServerMetrics::limit_rejections(LimitBound bound) const {
  const size_t b = static_cast<size_t>(bound);
  return b < limit_rejections_.size() ? limit_rejections_[b]->Value() : 0;
}

void ServerMetrics::RpcFinished(grpc::StatusCode code) {
  const int c = static_cast<int>(code);
  if (c > 0 && c < static_cast<int>(rpc_errors_.size())) {
    rpc_errors_[c]->Increment();
  }
}

void ServerMetrics::RoundCompleted(const RoundResult& r) {
  int64_t previous = last_round_step_.load(std::memory_order_relaxed);
  do {
    if (r.step <= previous) return;  // another caller of this round was first
  } while (!last_round_step_.compare_exchange_weak(previous, r.step,
                                                   std::memory_order_relaxed));
  round_duration_->Observe(absl::ToDoubleSeconds(absl::Now() - r.opened));
  slowest_wait_->Observe(absl::ToDoubleSeconds(r.wait_time));
  merge_duration_->Observe(absl::ToDoubleSeconds(r.merge_time));
  threshold_duration_->Observe(absl::ToDoubleSeconds(r.select_time));
  selected_pairs_->Increment(static_cast<double>(
      r.dense_sum.empty() ? r.selected.size() : r.dense_sum.size()));
  rounds_->Increment();
  step_->Set(static_cast<double>(r.step + 1));
}

void ServerMetrics::CheckpointWritten() { checkpoint_age_->Written(); }

std::shared_ptr<prometheus::Collectable> ServerMetrics::checkpoint_age() const {
  return checkpoint_age_;
}

void ServerMetrics::CheckpointFailed() { checkpoint_failures_->Increment(); }

double ServerMetrics::checkpoint_failures() const {
  return checkpoint_failures_->Value();
}

std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>
ServerMetrics::MakeInterceptorFactory() {
  return std::make_unique<ErrorInterceptorFactory>(this);
}

}  // namespace server
}  // namespace gtopk
