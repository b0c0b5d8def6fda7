// Per-step metric updates: what one worker step and one shard round cost in
// metric bookkeeping, on the real WorkerMetrics / ServerMetrics classes with
// their handles looked up once at construction (as the trainer, the Python
// client and the shard use them). One thread, no scrape running.
//
//   WorkerStep: WorkerMetrics::RecordStep for S = 2 shards, i.e. 2 S byte
//     counters, the dense-equivalent counter, 7 phase histograms, the step
//     histogram and 3 gauges -- exactly what the trainer calls once per step.
//   ShardStep/P: one round of a shard with P workers as ShardService does it:
//     P pushes counted (received_push_bytes), RoundCompleted once (4
//     histograms, 2 counters, 1 gauge, one absl::Now()), P pulls counted
//     (sent_pull_bytes).
//
// Besides Google Benchmark's table it writes a JSON summary (default
// bench/results/metrics.json) with ns per step and the commit given with
// --commit (the program does not know which source it was built from).
//
//   metrics_bench [--results_json=PATH] [--commit=HASH] [benchmark flags]
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "bench/results_reporter.h"
#include "benchmark/benchmark.h"
#include "server/server_metrics.h"
#include "worker/worker_metrics.h"

namespace gtopk {
namespace {

// The registry of the metrics library measured: the only lines that differ
// between the "before" and "after" runs of bench/results/metrics_*.json.
using MetricsRegistry = prometheus::Registry;
constexpr char kMetricsLibrary[] = "prometheus-cpp 1.0.1 (Debian)";

constexpr uint32_t kShards = 2;
constexpr uint64_t kN = 25557032;  // ResNet-50
const int kWorkerCounts[] = {2, 8};

std::string& Commit() {
  static std::string* commit = new std::string("unknown");
  return *commit;
}

void BM_WorkerStep(benchmark::State& state) {
  MetricsRegistry registry;
  worker::WorkerMetrics metrics(registry, /*rank=*/0, kShards, kN);
  worker::StepStats stats;
  stats.k = kN / 1000;
  stats.bytes_sent = {102345, 98765};
  stats.bytes_received = {104000, 99000};
  stats.accumulate = absl::Microseconds(900);
  stats.select = absl::Milliseconds(8);
  stats.encode = absl::Microseconds(300);
  stats.push = absl::Microseconds(700);
  stats.wait = absl::Milliseconds(12);
  stats.apply = absl::Microseconds(600);
  const absl::Duration compute = absl::Milliseconds(95);
  const absl::Duration step = absl::Milliseconds(118);
  for (auto _ : state) {
    metrics.RecordStep(stats, compute, step, 0.25);
    ++stats.step;
  }
  state.SetItemsProcessed(state.iterations());
}

void BM_ShardStep(benchmark::State& state) {
  const int P = static_cast<int>(state.range(0));
  MetricsRegistry registry;
  server::ServerMetrics metrics(registry);
  server::RoundResult round;
  round.selected.push_back(1, 0.5f);
  round.merge_time = absl::Microseconds(1200);
  round.select_time = absl::Microseconds(400);
  round.wait_time = absl::Milliseconds(3);
  round.opened = absl::Now();
  const double push_bytes = 51234, pull_bytes = 50321;
  for (auto _ : state) {
    for (int w = 0; w < P; ++w) {
      metrics.received_push_bytes().Increment(push_bytes);
    }
    metrics.RoundCompleted(round);
    for (int w = 0; w < P; ++w) {
      metrics.sent_pull_bytes().Increment(pull_bytes);
    }
    ++round.step;
  }
  state.SetItemsProcessed(state.iterations());
}

void RegisterAll() {
  benchmark::RegisterBenchmark("WorkerStep", BM_WorkerStep)
      ->Unit(benchmark::kNanosecond)
      ->UseRealTime();
  for (int P : kWorkerCounts) {
    benchmark::RegisterBenchmark("ShardStep", BM_ShardStep)
        ->Arg(P)
        ->Unit(benchmark::kNanosecond)
        ->UseRealTime();
  }
}

int ParseFlag(absl::string_view arg) {
  if (!absl::ConsumePrefix(&arg, "--commit=")) return 0;
  Commit() = std::string(arg);
  return 1;
}

std::string Summarize(const bench::CollectingReporter& r,
                      const std::string& command) {
  std::string json =
      absl::StrCat("{\n  \"command\": \"", command, "\",\n  \"commit\": \"",
                   Commit(), "\",\n  \"library\": \"", kMetricsLibrary,
                   "\",\n  \"threads\": 1,\n  \"shards\": ", kShards,
                   ",\n  \"worker_step_ns\": ",
                   absl::StrFormat("%.1f", r.Seconds("WorkerStep") * 1e9),
                   ",\n  \"shard_step_ns\": [");
  for (size_t i = 0; i < std::size(kWorkerCounts); ++i) {
    const int P = kWorkerCounts[i];
    absl::StrAppend(
        &json, i ? "," : "",
        absl::StrFormat("\n    {\"P\": %d, \"ns\": %.1f}", P,
                        r.Seconds(absl::StrCat("ShardStep/", P)) * 1e9));
  }
  absl::StrAppend(&json, "\n  ]\n}\n");
  return json;
}

}  // namespace
}  // namespace gtopk

int main(int argc, char** argv) {
  gtopk::bench::BenchProgram program;
  program.default_results = "bench/results/metrics.json";
  program.parse_flag = gtopk::ParseFlag;
  program.register_benchmarks = gtopk::RegisterAll;
  program.summarize = gtopk::Summarize;
  return gtopk::bench::BenchMain(argc, argv, program);
}
