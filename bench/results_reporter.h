// A Google Benchmark reporter that prints the usual console table and also
// keeps each benchmark's mean real time, so a benchmark program can write a
// small results file with ratios measured side by side in the same run.
#ifndef GTOPK_BENCH_RESULTS_REPORTER_H_
#define GTOPK_BENCH_RESULTS_REPORTER_H_

#include <cstdio>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"
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
  // How many benchmarks reported a measurement.
  size_t measured() const { return seconds_.size(); }
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

// What differs between our benchmark programs; BenchMain does the rest.
struct BenchProgram {
  // Where the JSON summary goes unless --results_json=PATH is given.
  std::string default_results;
  // Optional: a program-specific flag ("--n=..."). Returns 1 when `arg` was
  // consumed, 0 when it is not this program's, -1 (after printing why) when
  // its value is bad.
  std::function<int(absl::string_view arg)> parse_flag;
  // Registers the benchmarks (after flags are parsed).
  std::function<void()> register_benchmarks;
  // The JSON document for the results file, given the measurements and the
  // command line that produced them.
  std::function<std::string(const CollectingReporter&, const std::string&)>
      summarize;
};

// main() of every benchmark program: parses --results_json and the
// program's flags, hands the rest to Google Benchmark, runs, writes the
// summary. The committed default results file is only written by a run
// that measured every benchmark: a run that measured none (a listing, a
// filter that matched nothing) writes nothing, and one with
// --benchmark_filter or --benchmark_list_tests writes only to an explicit
// --results_json (a partial summary would show zeros for the rest).
// Returns the process exit code (2 for bad flags, 1 when the results file
// cannot be written).
inline int BenchMain(int argc, char** argv, const BenchProgram& program) {
  const std::string command = CommandLine(argc, argv);
  std::string results = program.default_results;
  bool explicit_results = false, partial = false;
  std::vector<char*> rest;
  for (int i = 0; i < argc; ++i) {
    absl::string_view arg(argv[i]);
    if (absl::ConsumePrefix(&arg, "--results_json=")) {
      results = std::string(arg);
      explicit_results = true;
      continue;
    }
    if (absl::StartsWith(arg, "--benchmark_filter") ||
        absl::StartsWith(arg, "--benchmark_list_tests")) {
      partial = true;
    }
    const int consumed =
        i > 0 && program.parse_flag ? program.parse_flag(argv[i]) : 0;
    if (consumed < 0) return 2;
    if (consumed == 0) rest.push_back(argv[i]);
  }
  int rest_argc = static_cast<int>(rest.size());
  benchmark::Initialize(&rest_argc, rest.data());
  if (benchmark::ReportUnrecognizedArguments(rest_argc, rest.data())) return 2;
  program.register_benchmarks();
  CollectingReporter reporter;
  benchmark::RunSpecifiedBenchmarks(&reporter);
  benchmark::Shutdown();
  if (reporter.measured() == 0 || (partial && !explicit_results)) {
    std::printf("\n%s left as it was: %s\n", results.c_str(),
                reporter.measured() == 0
                    ? "nothing was measured"
                    : "a filtered run (give --results_json=PATH to keep "
                      "its summary)");
    return 0;
  }
  const std::string json = program.summarize(reporter, command);
  FILE* f = std::fopen(results.c_str(), "w");
  if (f == nullptr) {
    std::fprintf(stderr, "cannot write %s\n", results.c_str());
    return 1;
  }
  std::fputs(json.c_str(), f);
  std::fclose(f);
  std::printf("\nwrote %s\n%s", results.c_str(), json.c_str());
  return 0;
}

}  // namespace bench
}  // namespace gtopk

#endif  // GTOPK_BENCH_RESULTS_REPORTER_H_
