#include "worker/worker_metrics.h"

#include <algorithm>
#include <string>

namespace gtopk {
namespace worker {

using prometheus::BuildCounter;
using prometheus::BuildGauge;
using prometheus::BuildHistogram;

WorkerMetrics::WorkerMetrics(prometheus::Registry& registry, uint32_t rank,
                             uint32_t num_shards, uint64_t n)
    : n_(n) {
  auto& sent = BuildCounter()
                   .Name("gtopk_worker_sent_bytes_total")
                   .Help("Serialized Push message bytes sent, per shard.")
                   .Register(registry);
  auto& received = BuildCounter()
                       .Name("gtopk_worker_received_bytes_total")
                       .Help(
                           "Serialized Pull message bytes received, per "
                           "shard.")
                       .Register(registry);
  for (uint32_t s = 0; s < num_shards; ++s) {
    sent_.push_back(&sent.Add({{"shard", std::to_string(s)}}));
    received_.push_back(&received.Add({{"shard", std::to_string(s)}}));
  }
  dense_equivalent_ =
      &BuildCounter()
           .Name("gtopk_worker_dense_equivalent_bytes_total")
           .Help(
               "Bytes a dense fp32 push of all n parameters would have "
               "sent (4 n per step).")
           .Register(registry)
           .Add({});
  step_duration_ = &BuildHistogram()
                        .Name("gtopk_worker_step_duration_seconds")
                        .Help(
                            "One whole step: gradient computation and the "
                            "client step.")
                        .Register(registry)
                        .Add({}, metrics::DurationBuckets());
  auto& phases = BuildHistogram()
                     .Name("gtopk_worker_phase_duration_seconds")
                     .Help(
                         "Time per step in each phase: compute, "
                         "accumulate, select, encode, push, wait, apply.")
                     .Register(registry);
  const char* names[kNumPhases] = {"compute", "accumulate", "select", "encode",
                                   "push",    "wait",       "apply"};
  for (int p = 0; p < kNumPhases; ++p) {
    phases_[p] = &phases.Add({{"phase", names[p]}}, metrics::DurationBuckets());
  }
  exposed_ = &BuildHistogram()
                  .Name("gtopk_worker_exposed_communication_seconds")
                  .Help(
                      "Per step, the selection and communication not hidden "
                      "behind the backward pass: after backward, until the "
                      "update is applied (the whole client step without "
                      "overlap).")
                  .Register(registry)
                  .Add({}, metrics::DurationBuckets());
  density_ = &BuildGauge()
                  .Name("gtopk_worker_density")
                  .Help("k/n of the last step.")
                  .Register(registry)
                  .Add({});
  loss_ = &BuildGauge()
               .Name("gtopk_worker_loss")
               .Help("Training loss of the last step's batch.")
               .Register(registry)
               .Add({});
  test_accuracy_ = &BuildGauge()
                        .Name("gtopk_worker_test_accuracy")
                        .Help(
                            "Test accuracy of the last evaluation, in [0, "
                            "1] (rank 0 only).")
                        .Register(registry);
  step_ = &BuildGauge()
               .Name("gtopk_worker_step")
               .Help("Steps applied so far (the next step's number).")
               .Register(registry)
               .Add({});
  BuildGauge()
      .Name("gtopk_worker_rank")
      .Help("This worker's rank.")
      .Register(registry)
      .Add({})
      .Set(rank);
}

void WorkerMetrics::RecordStep(const StepStats& stats, absl::Duration compute,
                               absl::Duration step, double loss) {
  for (size_t s = 0; s < sent_.size() && s < stats.bytes_sent.size(); ++s) {
    sent_[s]->Increment(static_cast<double>(stats.bytes_sent[s]));
  }
  for (size_t s = 0; s < received_.size() && s < stats.bytes_received.size();
       ++s) {
    received_[s]->Increment(static_cast<double>(stats.bytes_received[s]));
  }
  dense_equivalent_->Increment(4.0 * static_cast<double>(n_));
  const absl::Duration durations[kNumPhases] = {
      compute,    stats.accumulate, stats.select, stats.encode,
      stats.push, stats.wait,       stats.apply};
  for (int p = 0; p < kNumPhases; ++p) {
    phases_[p]->Observe(absl::ToDoubleSeconds(durations[p]));
  }
  step_duration_->Observe(absl::ToDoubleSeconds(step));
  const absl::Duration exposed =
      stats.exposed > absl::ZeroDuration()
          ? stats.exposed
          : stats.accumulate + stats.select + stats.encode +
                std::max(stats.push_wait, stats.push + stats.wait) +
                stats.apply;
  exposed_->Observe(absl::ToDoubleSeconds(exposed));
  density_->Set(
      n_ == 0 ? 0.0 : static_cast<double>(stats.k) / static_cast<double>(n_));
  loss_->Set(loss);
  step_->Set(static_cast<double>(stats.step + 1));
}

void WorkerMetrics::RecordTestAccuracy(double accuracy) {
  // Created on the first evaluation: only evaluating ranks have the series.
  test_accuracy_->Add({}).Set(accuracy);
}

}  // namespace worker
}  // namespace gtopk
