// CPU selection benchmark: exact, gaussiank, dgc and randomk against
// std::nth_element over a copy of |x| (the naive baseline) and a memcpy of the
// same array, all in one run, one thread, n = 25,557,032 (ResNet-50) normal
// fp32 values. Besides Google Benchmark's table it writes a JSON summary
// (default bench/results/cpu_select.json) with the ratios.
//
//   cpu_select_bench [--results_json=PATH] [--n=N] [benchmark flags]
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/strip.h"
#include "bench/results_reporter.h"
#include "benchmark/benchmark.h"
#include "common/selector.h"

namespace gtopk {
namespace {

size_t g_n = 25557032;
const double kDensities[] = {0.001, 0.01};

const std::vector<float>& Input() {
  static const std::vector<float>* input = [] {
    auto* x = new std::vector<float>(g_n);
    std::mt19937_64 rng(20190113);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (float& v : *x) v = normal(rng);
    return x;
  }();
  return *input;
}

uint64_t KFor(double density) { return *KFromDensity(density, g_n); }

void BM_Memcpy(benchmark::State& state) {
  const std::vector<float>& x = Input();
  std::vector<float> dst(x.size(), 1.0f);
  for (auto _ : state) {
    std::memcpy(dst.data(), x.data(), x.size() * sizeof(float));
    benchmark::DoNotOptimize(dst.data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() * x.size() * sizeof(float));
}

// The naive baseline: nth_element over a copy of |x|, then one filter pass.
void BM_NthElement(benchmark::State& state) {
  const std::vector<float>& x = Input();
  const double density = kDensities[state.range(0)];
  const uint64_t k = KFor(density);
  std::vector<float> mags(x.size());
  std::vector<uint32_t> indices;
  std::vector<float> values;
  indices.reserve(k);
  values.reserve(k);
  for (auto _ : state) {
    std::transform(x.begin(), x.end(), mags.begin(),
                   [](float v) { return std::fabs(v); });
    std::nth_element(mags.begin(), mags.begin() + (k - 1), mags.end(),
                     std::greater<float>());
    const float kth = mags[k - 1];
    indices.clear();
    values.clear();
    for (size_t i = 0; i < x.size() && indices.size() < k; ++i) {
      if (std::fabs(x[i]) >= kth) {
        indices.push_back(static_cast<uint32_t>(i));
        values.push_back(x[i]);
      }
    }
    benchmark::DoNotOptimize(indices.data());
  }
  state.counters["k"] = static_cast<double>(k);
}

void BM_Select(benchmark::State& state, const char* name) {
  const std::vector<float>& x = Input();
  const double density = kDensities[state.range(0)];
  const uint64_t k = KFor(density);
  auto selector = CreateSelector(name, SelectorOptions{});
  if (!selector.ok()) {
    state.SkipWithError(std::string(selector.status().message()).c_str());
    return;
  }
  SparseVector out;
  uint64_t step = 0;
  for (auto _ : state) {
    absl::Status s = (*selector)->Select(x, k, step++, &out);
    if (!s.ok()) {
      state.SkipWithError(std::string(s.message()).c_str());
      return;
    }
    benchmark::DoNotOptimize(out.indices.data());
  }
  state.counters["k"] = static_cast<double>(k);
  state.counters["selected"] = static_cast<double>(out.size());
}

void RegisterAll() {
  benchmark::RegisterBenchmark("memcpy", BM_Memcpy)
      ->Unit(benchmark::kMillisecond)
      ->UseRealTime();
  for (int d = 0; d < 2; ++d) {
    benchmark::RegisterBenchmark("nth_element", BM_NthElement)
        ->Arg(d)
        ->Unit(benchmark::kMillisecond)
        ->UseRealTime();
    for (const char* name : {"exact", "gaussiank", "dgc", "randomk"}) {
      benchmark::RegisterBenchmark(name, BM_Select, name)
          ->Arg(d)
          ->Unit(benchmark::kMillisecond)
          ->UseRealTime();
    }
  }
}

std::string Summarize(const bench::CollectingReporter& r,
                      const std::string& command) {
  const double memcpy_ms = r.Seconds("memcpy") * 1e3;
  std::string json = absl::StrCat(
      "{\n  \"command\": \"", command, "\",\n  \"n\": ", g_n,
      ",\n  \"distribution\": \"normal(0,1) fp32, seed 20190113\",",
      "\n  \"threads\": 1,\n  \"memcpy_ms\": ",
      absl::StrFormat("%.3f", memcpy_ms), ",\n  \"densities\": [");
  for (int d = 0; d < 2; ++d) {
    const std::string arg = absl::StrCat("/", d);
    const double nth = r.Seconds("nth_element" + arg) * 1e3;
    const double exact = r.Seconds("exact" + arg) * 1e3;
    const double gauss = r.Seconds("gaussiank" + arg) * 1e3;
    const double dgc = r.Seconds("dgc" + arg) * 1e3;
    const double randomk = r.Seconds("randomk" + arg) * 1e3;
    absl::StrAppend(
        &json, d ? "," : "", "\n    {\"density\": ", kDensities[d],
        ", \"k\": ", KFor(kDensities[d]),
        absl::StrFormat(
            ", \"exact_ms\": %.3f, \"gaussiank_ms\": %.3f, \"dgc_ms\": %.3f, "
            "\"randomk_ms\": %.3f, \"nth_element_ms\": %.3f, "
            "\"memcpy_ms\": %.3f, \"exact_x_memcpy\": %.2f, "
            "\"nth_element_x_exact\": %.2f, \"gaussiank_x_memcpy\": %.2f, "
            "\"dgc_x_memcpy\": %.2f, \"gaussiank_selected\": %.0f, "
            "\"dgc_selected\": %.0f}",
            exact, gauss, dgc, randomk, nth, memcpy_ms, exact / memcpy_ms,
            nth / exact, gauss / memcpy_ms, dgc / memcpy_ms,
            r.Counter("gaussiank" + arg, "selected"),
            r.Counter("dgc" + arg, "selected")));
  }
  absl::StrAppend(&json, "\n  ]\n}\n");
  return json;
}

int ParseFlag(absl::string_view arg) {
  if (!absl::ConsumePrefix(&arg, "--n=")) return 0;
  if (!absl::SimpleAtoi(arg, &g_n) || g_n < 1000) {
    std::fprintf(stderr, "--n must be an integer >= 1000\n");
    return -1;
  }
  return 1;
}

}  // namespace
}  // namespace gtopk

int main(int argc, char** argv) {
  gtopk::bench::BenchProgram program;
  program.default_results = "bench/results/cpu_select.json";
  program.parse_flag = gtopk::ParseFlag;
  program.register_benchmarks = gtopk::RegisterAll;
  program.summarize = gtopk::Summarize;
  return gtopk::bench::BenchMain(argc, argv, program);
}
