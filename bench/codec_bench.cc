// Wire codec benchmark: EncodeSparse and DecodeSparse for every index x value
// codec combination on a gTop-k sized message: n = 25,557,032 (ResNet-50),
// density 0.001 (k = 25,557), indices a seeded uniform random k-subset
// (sorted), values normal(0, 1) fp32. One thread.
//
// Throughput (bytes/s) is over the *decoded* size, 8 bytes per (uint32
// index, float value) pair, so combinations compare directly; the counter
// `bytes_per_pair` is the encoded message size / k. After Google Benchmark's
// table it prints a summary: bytes per pair, encode and decode speed, and the
// delta-bitpack / delta-varint speed ratios measured in this run.
//
//   codec_bench [benchmark flags]
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "bench/results_reporter.h"
#include "benchmark/benchmark.h"
#include "common/codec.h"
#include "common/sparse_vector.h"

namespace gtopk {
namespace {

constexpr uint64_t kN = 25557032;
constexpr size_t kK = 25557;  // density 0.001
constexpr uint64_t kSeed = 20190113;

constexpr IndexCodec kIndexCodecs[] = {
    IndexCodec::kRaw, IndexCodec::kDeltaVarint, IndexCodec::kDeltaBitpack};
constexpr ValueCodec kValueCodecs[] = {ValueCodec::kFp32, ValueCodec::kFp16,
                                       ValueCodec::kBf16};

const SparseVector& Input() {
  static const SparseVector* input = [] {
    auto* v = new SparseVector;
    std::mt19937_64 rng(kSeed);
    // Floyd's algorithm: a uniform k-subset of [0, n) without replacement.
    std::vector<bool> taken(kN, false);
    for (uint64_t j = kN - kK; j < kN; ++j) {
      const uint64_t t = std::uniform_int_distribution<uint64_t>(0, j)(rng);
      taken[taken[t] ? j : t] = true;
    }
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (uint64_t i = 0; i < kN; ++i) {
      if (taken[i]) v->push_back(static_cast<uint32_t>(i), normal(rng));
    }
    return v;
  }();
  return *input;
}

std::string Name(const char* op, CodecSpec spec) {
  return absl::StrCat(op, "/", IndexCodecName(spec.index), "/",
                      ValueCodecName(spec.value));
}

void BM_Encode(benchmark::State& state, CodecSpec spec) {
  const SparseVector& v = Input();
  std::string msg;
  for (auto _ : state) {
    const absl::Status status = EncodeSparse(v, kN, spec, &msg);
    if (!status.ok()) {
      state.SkipWithError(status.ToString().c_str());
      return;
    }
    benchmark::DoNotOptimize(msg.data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) *
                          static_cast<int64_t>(v.size() * 8));
  state.counters["bytes_per_pair"] =
      static_cast<double>(msg.size()) / static_cast<double>(v.size());
}

void BM_Decode(benchmark::State& state, CodecSpec spec) {
  const SparseVector& v = Input();
  std::string msg;
  if (const absl::Status s = EncodeSparse(v, kN, spec, &msg); !s.ok()) {
    state.SkipWithError(s.ToString().c_str());
    return;
  }
  SparseVector out;
  for (auto _ : state) {
    const absl::Status status = DecodeSparse(msg, kN, &out);
    if (!status.ok()) {
      state.SkipWithError(status.ToString().c_str());
      return;
    }
    benchmark::DoNotOptimize(out.indices.data());
    benchmark::DoNotOptimize(out.values.data());
    benchmark::ClobberMemory();
  }
  if (out.indices != v.indices) {
    state.SkipWithError("decoded indices differ from the input");
    return;
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) *
                          static_cast<int64_t>(v.size() * 8));
  state.counters["bytes_per_pair"] =
      static_cast<double>(msg.size()) / static_cast<double>(v.size());
}

void RegisterAll() {
  for (IndexCodec index : kIndexCodecs) {
    for (ValueCodec value : kValueCodecs) {
      const CodecSpec spec{index, value};
      benchmark::RegisterBenchmark(Name("encode", spec).c_str(), BM_Encode,
                                   spec)
          ->Unit(benchmark::kMicrosecond)
          ->UseRealTime();
      benchmark::RegisterBenchmark(Name("decode", spec).c_str(), BM_Decode,
                                   spec)
          ->Unit(benchmark::kMicrosecond)
          ->UseRealTime();
    }
  }
}

// Prints the table and returns the JSON summary (bytes per pair and GB/s over
// the 8 decoded bytes per pair, per codec combination).
std::string Summarize(const bench::CollectingReporter& r,
                      const std::string& command) {
  std::printf(
      "\nn = %llu, k = %zu (density 0.001), seed %llu; GB/s over 8 decoded "
      "bytes per pair\n",
      static_cast<unsigned long long>(kN), kK,
      static_cast<unsigned long long>(kSeed));
  std::printf("%-14s %-5s %14s %12s %12s\n", "index", "value", "bytes/pair",
              "encode GB/s", "decode GB/s");
  const double decoded_bytes = 8.0 * static_cast<double>(Input().size());
  auto rate = [&](const std::string& name) {
    const double s = r.Seconds(name);
    return s > 0 ? decoded_bytes / s / 1e9 : 0.0;
  };
  std::string json = absl::StrCat(
      "{\n  \"command\": \"", command, "\",\n  \"n\": ", kN, ",\n  \"k\": ", kK,
      ",\n  \"density\": 0.001,\n  \"inputs\": \"uniform random k-subset, "
      "normal(0,1) fp32, seed ",
      kSeed,
      "\",\n  \"threads\": 1,\n  \"gb_per_s_over\": \"8 decoded bytes per "
      "pair\",\n  \"codecs\": [");
  bool first = true;
  for (IndexCodec index : kIndexCodecs) {
    for (ValueCodec value : kValueCodecs) {
      const CodecSpec spec{index, value};
      const double bpp = r.Counter(Name("encode", spec), "bytes_per_pair");
      const double enc = rate(Name("encode", spec));
      const double dec = rate(Name("decode", spec));
      std::printf("%-14s %-5s %14.3f %12.2f %12.2f\n",
                  std::string(IndexCodecName(index)).c_str(),
                  std::string(ValueCodecName(value)).c_str(), bpp, enc, dec);
      absl::StrAppend(
          &json, first ? "" : ",",
          absl::StrFormat("\n    {\"index\": \"%s\", \"value\": \"%s\", "
                          "\"bytes_per_pair\": %.3f, \"encode_gb_per_s\": "
                          "%.2f, \"decode_gb_per_s\": %.2f}",
                          IndexCodecName(index), ValueCodecName(value), bpp,
                          enc, dec));
      first = false;
    }
  }
  absl::StrAppend(&json, "\n  ]\n}\n");
  return json;
}

}  // namespace
}  // namespace gtopk

int main(int argc, char** argv) {
  gtopk::bench::BenchProgram program;
  program.default_results = "bench/results/codec.json";
  program.register_benchmarks = [] {
    gtopk::Input();  // build the input before the first timing
    gtopk::RegisterAll();
  };
  program.summarize = gtopk::Summarize;
  return gtopk::bench::BenchMain(argc, argv, program);
}
