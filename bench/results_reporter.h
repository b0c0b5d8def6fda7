// A Google Benchmark reporter that prints the usual console table and also
// keeps each benchmark's mean real time, so a benchmark program can write a
// small results file with ratios measured side by side in the same run.
#ifndef GTOPK_BENCH_RESULTS_REPORTER_H_
#define GTOPK_BENCH_RESULTS_REPORTER_H_

#include <map>
#include <string>
#include <vector>

#include "benchmark/benchmark.h"

namespace gtopk {
namespace bench {

class CollectingReporter : public benchmark::ConsoleReporter {
 public:
  void ReportRuns(const std::vector<Run>& runs) override {
    for (const Run& run : runs) {
      if (run.run_type != Run::RT_Iteration && run.aggregate_name != "mean") {
        continue;
      }
      // Adjusted times are in the run's unit; the multiplier is units/second.
      const double seconds = run.GetAdjustedRealTime() /
                             benchmark::GetTimeUnitMultiplier(run.time_unit);
      // With repetitions the "mean" aggregate overwrites single runs.
      std::string name = run.run_name.str();
      const std::string suffix = "/real_time";
      if (name.size() > suffix.size() &&
          name.compare(name.size() - suffix.size(), suffix.size(), suffix) ==
              0) {
        name.resize(name.size() - suffix.size());
      }
      seconds_[name] = seconds;
      for (const auto& [counter, value] : run.counters) {
        counters_[name][counter] = value.value;
      }
    }
    ConsoleReporter::ReportRuns(runs);
  }
  // Seconds per iteration of benchmark `name` (0 when it did not run).
  double Seconds(const std::string& name) const {
    auto it = seconds_.find(name);
    return it == seconds_.end() ? 0.0 : it->second;
  }
  double Counter(const std::string& name, const std::string& counter) const {
    auto it = counters_.find(name);
    if (it == counters_.end()) return 0.0;
    auto c = it->second.find(counter);
    return c == it->second.end() ? 0.0 : c->second;
  }

 private:
  std::map<std::string, double> seconds_;
  std::map<std::string, std::map<std::string, double>> counters_;
};

// The command line, quoted enough to paste back into a shell.
inline std::string CommandLine(int argc, char** argv) {
  std::string cmd;
  for (int i = 0; i < argc; ++i) {
    if (i) cmd += ' ';
    cmd += argv[i];
  }
  return cmd;
}

}  // namespace bench
}  // namespace gtopk

#endif  // GTOPK_BENCH_RESULTS_REPORTER_H_
