// The metrics one gtopk worker exports (docs/metrics.md, "Worker"), created
// up front in a prometheus::Registry so that recording a step only touches
// handles looked up once (no Family::Add, no registry lock per step).
#ifndef GTOPK_WORKER_WORKER_METRICS_H_
#define GTOPK_WORKER_WORKER_METRICS_H_

#include <cstdint>
#include <vector>

#include "absl/time/time.h"
#include "common/metrics/metrics.h"
#include "worker/client.h"

namespace gtopk {
namespace worker {

// Thread-safety: every method is thread-safe. RecordStep updates counters and
// gauges lock-free and takes each histogram's own mutex once (uncontended:
// one trainer thread records steps); RecordTestAccuracy takes the family's
// mutex (once per evaluation).
class WorkerMetrics {
 public:
  // Registers the worker families in `registry` (which must outlive this
  // object) for a cluster of `num_shards` shards and n = `n` parameters;
  // creates every shard and phase series with value 0. Throws
  // std::invalid_argument (prometheus-cpp) only if `registry` already holds
  // one of these names with another type: a programmer error.
  WorkerMetrics(prometheus::Registry& registry, uint32_t rank,
                uint32_t num_shards, uint64_t n);

  // Records one applied step: bytes per shard (stats.bytes_sent/received,
  // indexed by shard id), the dense-equivalent bytes (4 n), the phases
  // (`compute` given here, the others from `stats`), the whole step, the
  // density k/n, the loss of the step's batch, the step counter, and the
  // exposed communication: stats.exposed for an overlapped step
  // (FinishOverlappedStep: what backward did not hide), else the whole
  // client step (accumulate + select + encode + push_wait + apply; without
  // overlap nothing is hidden).
  void RecordStep(const StepStats& stats, absl::Duration compute,
                  absl::Duration step, double loss);
  // Records a test-set evaluation (accuracy in [0, 1]).
  void RecordTestAccuracy(double accuracy);

 private:
  enum Phase {
    kCompute,
    kAccumulate,
    kSelect,
    kEncode,
    kPush,
    kWait,
    kApply,
    kNumPhases
  };
  const uint64_t n_;
  std::vector<prometheus::Counter*> sent_;
  std::vector<prometheus::Counter*> received_;
  prometheus::Counter* dense_equivalent_;
  prometheus::Histogram* step_duration_;
  prometheus::Histogram* phases_[kNumPhases];
  prometheus::Histogram* exposed_;
  prometheus::Gauge* density_;
  prometheus::Gauge* loss_;
  prometheus::Family<prometheus::Gauge>* test_accuracy_;
  prometheus::Gauge* step_;
};

}  // namespace worker
}  // namespace gtopk

#endif  // GTOPK_WORKER_WORKER_METRICS_H_
