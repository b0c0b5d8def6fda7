// A worker's metrics (worker/worker_metrics.h): one recorded step's bytes,
// density, loss, step, rank and phase histograms in the exposition, and the
// test accuracy once evaluated. Moved from tests/server/server_metrics_test.cc
// (issue 44: tests mirror sources).
#include "worker/worker_metrics.h"

#include <prometheus/registry.h>

#include <map>
#include <string>

#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "tests/testing/exposition.h"

namespace gtopk {
namespace {

using ::gtopk::testing::ParseSeries;
using ::gtopk::testing::Serialize;
using ::gtopk::testing::SeriesValue;

TEST(WorkerMetricsTest, RecordsAStepAsGiven) {
  prometheus::Registry registry;
  worker::WorkerMetrics m(registry, /*rank=*/3, /*num_shards=*/2, /*n=*/1000);
  worker::StepStats s;
  s.step = 41;
  s.k = 10;
  s.bytes_sent = {100, 50};
  s.bytes_received = {80, 40};
  s.accumulate = absl::Milliseconds(1);
  s.select = absl::Milliseconds(2);
  s.encode = absl::Microseconds(500);
  s.push = absl::Milliseconds(3);
  s.wait = absl::Milliseconds(40);
  s.apply = absl::Milliseconds(1);
  m.RecordStep(s, absl::Milliseconds(20), absl::Milliseconds(70), 0.75);
  m.RecordStep(s, absl::Milliseconds(20), absl::Milliseconds(70), 0.5);
  auto samples = ParseSeries(Serialize(registry));
  EXPECT_EQ(SeriesValue(samples, "gtopk_worker_sent_bytes_total{shard=\"0\"}"),
            200);
  EXPECT_EQ(SeriesValue(samples, "gtopk_worker_sent_bytes_total{shard=\"1\"}"),
            100);
  EXPECT_EQ(
      SeriesValue(samples, "gtopk_worker_received_bytes_total{shard=\"1\"}"),
      80);
  EXPECT_EQ(SeriesValue(samples, "gtopk_worker_dense_equivalent_bytes_total"),
            8000);
  EXPECT_EQ(SeriesValue(samples, "gtopk_worker_density"), 0.01);
  EXPECT_EQ(SeriesValue(samples, "gtopk_worker_loss"), 0.5);
  EXPECT_EQ(SeriesValue(samples, "gtopk_worker_step"), 42);
  EXPECT_EQ(SeriesValue(samples, "gtopk_worker_rank"), 3);
  EXPECT_EQ(SeriesValue(samples, "gtopk_worker_step_duration_seconds_count"),
            2);
  EXPECT_EQ(
      SeriesValue(samples,
                  "gtopk_worker_step_duration_seconds_bucket{le=\"0.05\"}"),
      0);
  EXPECT_EQ(
      SeriesValue(samples,
                  "gtopk_worker_step_duration_seconds_bucket{le=\"0.1\"}"),
      2);
  EXPECT_EQ(
      SeriesValue(samples,
                  "gtopk_worker_phase_duration_seconds_sum{phase=\"wait\"}"),
      0.08);
  EXPECT_EQ(
      SeriesValue(samples,
                  "gtopk_worker_phase_duration_seconds_sum{phase=\"compute\"}"),
      0.04);
  EXPECT_EQ(SeriesValue(
                samples,
                "gtopk_worker_phase_duration_seconds_bucket{phase=\"push\",le="
                "\"0.0025\"}"),
            0);
  EXPECT_EQ(SeriesValue(
                samples,
                "gtopk_worker_phase_duration_seconds_bucket{phase=\"push\",le="
                "\"0.005\"}"),
            2);
  // Without overlap the whole client step is exposed: 1 + 2 + 0.5 + (3 +
  // 40) + 1 ms per step.
  EXPECT_EQ(
      SeriesValue(samples, "gtopk_worker_exposed_communication_seconds_count"),
      2);
  EXPECT_DOUBLE_EQ(
      SeriesValue(samples, "gtopk_worker_exposed_communication_seconds_sum"),
      2 * 0.0475);
  EXPECT_EQ(samples.count("gtopk_worker_test_accuracy"), 0u);  // not evaluated
  m.RecordTestAccuracy(0.875);
  samples = ParseSeries(Serialize(registry));
  EXPECT_EQ(SeriesValue(samples, "gtopk_worker_test_accuracy"), 0.875);
}

// An overlapped step (FinishOverlappedStep sets stats.exposed): only what
// the backward pass did not hide is exposed, although its selection thread
// and round took longer (push_wait).
TEST(WorkerMetricsTest, AnOverlappedStepExposesOnlyWhatBackwardDidNotHide) {
  prometheus::Registry registry;
  worker::WorkerMetrics m(registry, /*rank=*/0, /*num_shards=*/1, /*n=*/100);
  worker::StepStats s;
  s.bytes_sent = {10};
  s.bytes_received = {10};
  s.select = absl::Milliseconds(30);
  s.push_wait = absl::Milliseconds(90);
  s.apply = absl::Milliseconds(1);
  s.exposed = absl::Milliseconds(4);
  m.RecordStep(s, absl::Milliseconds(100), absl::Milliseconds(104), 0.0);
  const auto samples = ParseSeries(Serialize(registry));
  EXPECT_DOUBLE_EQ(
      SeriesValue(samples, "gtopk_worker_exposed_communication_seconds_sum"),
      0.004);
  EXPECT_EQ(SeriesValue(samples,
                        "gtopk_worker_exposed_communication_seconds_bucket{le="
                        "\"0.005\"}"),
            1);
  EXPECT_EQ(SeriesValue(samples,
                        "gtopk_worker_exposed_communication_seconds_bucket{le="
                        "\"0.0025\"}"),
            0);
}

}  // namespace
}  // namespace gtopk
