// Sparse merge benchmark: SparseSum (the server's per-step sum of the P
// workers' pushes) against a k-way std::priority_queue heap merge written
// here as the baseline, plus SparseTopK of the P = 32 sum, all in one run, one
// thread. Each worker pushes k = 25,557 uniformly random distinct indices of
// n = 25,557,032 (ResNet-50, density 0.001) with normal fp32 values. Besides
// Google Benchmark's table it writes a JSON summary (default
// bench/results/merge.json) with throughputs in pairs/s and the ratios.
//
//   merge_bench [--results_json=PATH] [benchmark flags]
#include <algorithm>
#include <cstdio>
#include <functional>
#include <map>
#include <queue>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/strip.h"
#include "bench/results_reporter.h"
#include "benchmark/benchmark.h"
#include "common/merge.h"
#include "common/random.h"

namespace gtopk {
namespace {

constexpr uint64_t kN = 25557032;
constexpr uint64_t kK = 25557;  // per worker, and the global k
const int kWorkerCounts[] = {2, 8, 32};

// Worker p's push: kK distinct uniform indices, sorted, normal values.
const std::vector<SparseVector>& Pushes(int P) {
  static std::map<int, std::vector<SparseVector>>* cache =
      new std::map<int, std::vector<SparseVector>>();
  auto it = cache->find(P);
  if (it != cache->end()) return it->second;
  std::vector<SparseVector> pushes(P);
  for (int p = 0; p < P; ++p) {
    std::mt19937_64 rng(MixSeed(20190113, p));
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<uint32_t> idx;
    while (idx.size() < kK) {
      while (idx.size() < kK) {
        idx.push_back(static_cast<uint32_t>(UniformBelow(rng, kN)));
      }
      std::sort(idx.begin(), idx.end());
      idx.erase(std::unique(idx.begin(), idx.end()), idx.end());
    }
    for (uint32_t i : idx) pushes[p].push_back(i, normal(rng));
  }
  return cache->emplace(P, std::move(pushes)).first->second;
}

size_t TotalPairs(const std::vector<SparseVector>& pushes) {
  size_t total = 0;
  for (const SparseVector& v : pushes) total += v.size();
  return total;
}

// Baseline: k-way merge with a binary min-heap of (index, rank), so equal
// indices pop in rank order and the sums have SparseSum's bits.
void HeapMerge(const std::vector<SparseVector>& inputs, SparseVector* out) {
  using Entry = uint64_t;  // index << 8 | rank (P <= 256)
  std::priority_queue<Entry, std::vector<Entry>, std::greater<Entry>> heap;
  std::vector<size_t> pos(inputs.size(), 0);
  for (size_t p = 0; p < inputs.size(); ++p) {
    if (!inputs[p].empty()) heap.push(uint64_t{inputs[p].indices[0]} << 8 | p);
  }
  out->clear();
  while (!heap.empty()) {
    const Entry top = heap.top();
    heap.pop();
    const uint32_t index = static_cast<uint32_t>(top >> 8);
    const size_t p = top & 0xff;
    const float value = inputs[p].values[pos[p]];
    if (++pos[p] < inputs[p].size()) {
      heap.push(uint64_t{inputs[p].indices[pos[p]]} << 8 | p);
    }
    if (!out->empty() && out->indices.back() == index) {
      out->values.back() += value;
    } else {
      out->push_back(index, value);
    }
  }
}

void BM_SparseSum(benchmark::State& state) {
  const std::vector<SparseVector>& pushes = Pushes(state.range(0));
  MergeScratch scratch;
  SparseVector out;
  for (auto _ : state) {
    absl::Status s = SparseSum(pushes, kN, &out, &scratch);
    if (!s.ok()) {
      state.SkipWithError(std::string(s.message()).c_str());
      return;
    }
    benchmark::DoNotOptimize(out.values.data());
  }
  state.SetItemsProcessed(state.iterations() * TotalPairs(pushes));
  state.counters["sum_nnz"] = static_cast<double>(out.size());
}

void BM_HeapMerge(benchmark::State& state) {
  const std::vector<SparseVector>& pushes = Pushes(state.range(0));
  SparseVector out;
  out.reserve(TotalPairs(pushes));
  for (auto _ : state) {
    HeapMerge(pushes, &out);
    benchmark::DoNotOptimize(out.values.data());
  }
  // The baseline must compute the same thing, bit for bit.
  SparseVector expected;
  if (!SparseSum(pushes, kN, &expected).ok() || !(expected == out)) {
    state.SkipWithError("heap merge differs from SparseSum");
    return;
  }
  state.SetItemsProcessed(state.iterations() * TotalPairs(pushes));
}

void BM_SparseTopK(benchmark::State& state) {
  SparseVector sum;
  if (!SparseSum(Pushes(32), kN, &sum).ok()) {
    state.SkipWithError("SparseSum failed");
    return;
  }
  cpu::TopKScratch scratch;
  SparseVector out;
  for (auto _ : state) {
    absl::Status s = SparseTopK(sum, kK, &out, &scratch);
    if (!s.ok()) {
      state.SkipWithError(std::string(s.message()).c_str());
      return;
    }
    benchmark::DoNotOptimize(out.values.data());
  }
  state.SetItemsProcessed(state.iterations() * sum.size());
  state.counters["sum_nnz"] = static_cast<double>(sum.size());
}

void RegisterAll() {
  for (int P : kWorkerCounts) {
    benchmark::RegisterBenchmark("SparseSum", BM_SparseSum)
        ->Arg(P)
        ->Unit(benchmark::kMicrosecond)
        ->UseRealTime();
    benchmark::RegisterBenchmark("HeapMerge", BM_HeapMerge)
        ->Arg(P)
        ->Unit(benchmark::kMicrosecond)
        ->UseRealTime();
  }
  benchmark::RegisterBenchmark("SparseTopK", BM_SparseTopK)
      ->Arg(32)
      ->Unit(benchmark::kMicrosecond)
      ->UseRealTime();
}

std::string Summarize(const bench::CollectingReporter& r,
                      const std::string& command) {
  std::string json = absl::StrCat(
      "{\n  \"command\": \"", command, "\",\n  \"n\": ", kN,
      ",\n  \"k_per_worker\": ", kK,
      ",\n  \"inputs\": \"uniform random distinct indices, normal(0,1) fp32, "
      "seed MixSeed(20190113, rank)\",\n  \"threads\": 1,\n  \"sum\": [");
  for (size_t w = 0; w < std::size(kWorkerCounts); ++w) {
    const int P = kWorkerCounts[w];
    const std::string arg = absl::StrCat("/", P);
    const double sum_s = r.Seconds("SparseSum" + arg);
    const double heap_s = r.Seconds("HeapMerge" + arg);
    const double pairs = static_cast<double>(P) * kK;
    absl::StrAppend(
        &json, w ? "," : "",
        absl::StrFormat(
            "\n    {\"P\": %d, \"pairs\": %.0f, \"sparse_sum_us\": %.1f, "
            "\"heap_merge_us\": %.1f, \"sparse_sum_mpairs_per_s\": %.1f, "
            "\"heap_merge_mpairs_per_s\": %.1f, \"heap_x_sparse_sum\": %.2f}",
            P, pairs, sum_s * 1e6, heap_s * 1e6, pairs / sum_s / 1e6,
            pairs / heap_s / 1e6, heap_s / sum_s));
  }
  absl::StrAppend(
      &json,
      absl::StrFormat(
          "\n  ],\n  \"sparse_topk_P32\": {\"sum_nnz\": %.0f, \"k\": %d, "
          "\"us\": %.1f, \"sparse_sum_P32_us\": %.1f}\n}\n",
          r.Counter("SparseTopK/32", "sum_nnz"), static_cast<int>(kK),
          r.Seconds("SparseTopK/32") * 1e6, r.Seconds("SparseSum/32") * 1e6));
  return json;
}

}  // namespace
}  // namespace gtopk

int main(int argc, char** argv) {
  gtopk::bench::BenchProgram program;
  program.default_results = "bench/results/merge.json";
  program.register_benchmarks = gtopk::RegisterAll;
  program.summarize = gtopk::Summarize;
  return gtopk::bench::BenchMain(argc, argv, program);
}
