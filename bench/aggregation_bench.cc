// End-to-end aggregation benchmark: an in-process cluster on loopback (S real
// gRPC AggregatorServers, P WorkerClient threads), synthetic updates of n
// parameters at a given density, for the gtopk, topk and dense modes. Per step
// it splits the time into accumulate / select / encode / network+wait
// (push_wait) / server merge / server select (with the threshold exchange) /
// apply, measures the server's merge throughput and the bytes on the wire per
// worker per step against dense (4n bytes). Writes a JSON summary (default
// bench/results/aggregation.json).
//
//   aggregation_bench [--n=25557032] [--workers=8] [--shards=2]
//                     [--density=0.001] [--steps=5] [--modes=gtopk,topk,dense]
//                     [--results_json=PATH]
//
// All workers and servers share this machine's cores, so with P workers on
// fewer cores the worker-side phases include waiting for a core; the
// per-phase medians still show where a step's time goes.
#include <algorithm>
#include <cstdio>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "bench/synthetic.h"
#include "tests/testing/local_cluster.h"
#include "worker/client.h"

ABSL_FLAG(uint64_t, n, 25557032, "parameters (ResNet-50: 25,557,032)");
ABSL_FLAG(int, workers, 8, "P, worker threads");
ABSL_FLAG(int, shards, 2, "S, in-process servers");
ABSL_FLAG(double, density, 0.001, "k / n");
ABSL_FLAG(int, steps, 5, "measured steps per mode (after one warm-up step)");
ABSL_FLAG(std::string, modes, "gtopk,topk,dense", "modes to run, in order");
ABSL_FLAG(std::string, results_json, "bench/results/aggregation.json",
          "where the JSON summary goes");

namespace gtopk {
namespace {

using ::gtopk::bench::Median;
using ::gtopk::bench::Synthetic;

std::string CommandLine(int argc, char** argv) {
  std::vector<std::string> args(argv, argv + argc);
  return absl::StrJoin(args, " ");
}

double Ms(absl::Duration d) { return absl::ToDoubleMilliseconds(d); }

struct ModeResult {
  std::string mode;
  std::string json;
  std::string error;
};

ModeResult RunMode(const std::string& mode_name) {
  ModeResult result;
  result.mode = mode_name;
  const uint64_t n = absl::GetFlag(FLAGS_n);
  const int workers = absl::GetFlag(FLAGS_workers);
  const int shards = absl::GetFlag(FLAGS_shards);
  const int steps = absl::GetFlag(FLAGS_steps);
  server::ServerConfig config;
  auto mode = ParseAggregationMode(mode_name);
  if (!mode.ok()) {
    result.error = std::string(mode.status().message());
    return result;
  }
  config.mode = *mode;
  config.num_workers = workers;
  config.optimizer.density = absl::GetFlag(FLAGS_density);
  config.optimizer.momentum_mode = MomentumMode::kDgcCorrection;
  config.step_timeout = absl::Seconds(300);
  config.max_message_bytes = uint64_t{1} << 30;
  auto cluster = ::gtopk::testing::LocalCluster::Start(config, shards);
  if (!cluster.ok()) {
    result.error = std::string(cluster.status().message());
    return result;
  }
  std::vector<std::vector<worker::StepStats>> stats(workers);
  std::vector<std::vector<double>> step_ms(workers);
  std::vector<absl::Status> status(workers);
  std::vector<std::thread> threads;
  for (int w = 0; w < workers; ++w) {
    threads.emplace_back([&, w] {
      worker::ClientOptions o;
      o.leader_address = (*cluster)->leader();
      o.requested_rank = w;
      o.n = n;
      o.rpc_timeout = absl::Seconds(300);
      auto client = worker::WorkerClient::Connect(o);
      if (!client.ok()) {
        status[w] = client.status();
        return;
      }
      std::vector<float> params(n), grad(n);
      Synthetic(1, &params);
      auto next = (*client)->SynchronizeParameters(absl::MakeSpan(params));
      if (!next.ok()) {
        status[w] = next.status();
        return;
      }
      for (int step = 0; step <= steps; ++step) {
        Synthetic(1000 + 37 * step + w, &grad);
        const absl::Time start = absl::Now();
        auto s = (*client)->Step(grad, absl::MakeSpan(params));
        if (!s.ok()) {
          status[w] = s.status();
          return;
        }
        if (step == 0) continue;  // warm-up
        step_ms[w].push_back(Ms(absl::Now() - start));
        stats[w].push_back(*s);
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int w = 0; w < workers; ++w) {
    if (!status[w].ok()) {
      result.error = absl::StrCat("worker ", w, ": ", status[w].ToString());
      return result;
    }
  }
  std::vector<double> all_step, accumulate, select, encode, push_wait, merge,
      threshold, apply, sent, received, pairs_sent;
  for (int w = 0; w < workers; ++w) {
    for (size_t i = 0; i < stats[w].size(); ++i) {
      const worker::StepStats& s = stats[w][i];
      all_step.push_back(step_ms[w][i]);
      accumulate.push_back(Ms(s.accumulate));
      select.push_back(Ms(s.select));
      encode.push_back(Ms(s.encode));
      push_wait.push_back(Ms(s.push_wait));
      merge.push_back(Ms(s.server_merge));
      threshold.push_back(Ms(s.server_select));
      apply.push_back(Ms(s.apply));
      uint64_t bs = 0, br = 0;
      for (uint64_t b : s.bytes_sent) bs += b;
      for (uint64_t b : s.bytes_received) br += b;
      sent.push_back(static_cast<double>(bs));
      received.push_back(static_cast<double>(br));
      pairs_sent.push_back(static_cast<double>(s.sent_pairs));
    }
  }
  const double dense_bytes = 4.0 * static_cast<double>(n);
  // The server merges P pushes per shard; per shard ~ P * pairs / S.
  const double merge_ms = Median(merge);
  const double pairs_per_shard = Median(pairs_sent) * workers / shards;
  result.json = absl::StrFormat(
      "{\"mode\": \"%s\", \"step_ms_p50\": %.2f, \"accumulate_ms\": %.2f, "
      "\"select_ms\": %.2f, \"encode_ms\": %.2f, \"network_wait_ms\": %.2f, "
      "\"server_merge_ms\": %.2f, \"server_select_ms\": %.2f, "
      "\"apply_ms\": %.2f, \"server_merge_pairs_per_s\": %.0f, "
      "\"sent_bytes_per_worker_per_step\": %.0f, "
      "\"received_bytes_per_worker_per_step\": %.0f, "
      "\"dense_bytes_per_worker_per_step\": %.0f, "
      "\"sent_x_dense\": %.5f, \"received_x_dense\": %.5f}",
      mode_name, Median(all_step), Median(accumulate), Median(select),
      Median(encode), Median(push_wait), merge_ms, Median(threshold),
      Median(apply),
      merge_ms > 0 && mode_name != "dense" ? pairs_per_shard / (merge_ms / 1e3)
                                           : 0.0,
      Median(sent), Median(received), dense_bytes, Median(sent) / dense_bytes,
      Median(received) / dense_bytes);
  std::printf("%s\n", result.json.c_str());
  std::fflush(stdout);
  return result;
}

}  // namespace
}  // namespace gtopk

int main(int argc, char** argv) {
  const std::string command = gtopk::CommandLine(argc, argv);
  absl::ParseCommandLine(argc, argv);
  if (absl::GetFlag(FLAGS_workers) < 1 || absl::GetFlag(FLAGS_shards) < 1 ||
      absl::GetFlag(FLAGS_steps) < 1 || absl::GetFlag(FLAGS_n) < 1 ||
      !(absl::GetFlag(FLAGS_density) > 0 &&
        absl::GetFlag(FLAGS_density) <= 1)) {
    std::fprintf(stderr,
                 "need --workers, --shards, --steps, --n >= 1 and --density in "
                 "(0, 1]\n");
    return 2;
  }
  std::vector<std::string> parts;
  int rc = 0;
  const std::vector<std::string> modes =
      absl::StrSplit(absl::GetFlag(FLAGS_modes), ',', absl::SkipEmpty());
  for (const std::string& mode : modes) {
    gtopk::ModeResult r = gtopk::RunMode(mode);
    if (!r.error.empty()) {
      std::fprintf(stderr, "mode %s failed: %s\n", mode.c_str(),
                   r.error.c_str());
      rc = 1;
      continue;
    }
    parts.push_back(r.json);
  }
  const std::string json = absl::StrCat(
      "{\n  \"command\": \"", command, "\",\n  \"n\": ", absl::GetFlag(FLAGS_n),
      ",\n  \"workers\": ", absl::GetFlag(FLAGS_workers),
      ",\n  \"shards\": ", absl::GetFlag(FLAGS_shards),
      ",\n  \"density\": ", absl::GetFlag(FLAGS_density),
      ",\n  \"measured_steps\": ", absl::GetFlag(FLAGS_steps),
      ",\n  \"selection\": \"exact\",\n  \"codecs\": \"delta-varint + fp32\","
      "\n  \"network\": \"loopback, in-process gRPC, all on one 2-core "
      "machine\",\n  \"modes\": [\n    ",
      absl::StrJoin(parts, ",\n    "), "\n  ]\n}\n");
  FILE* f = std::fopen(absl::GetFlag(FLAGS_results_json).c_str(), "w");
  if (f == nullptr) {
    std::fprintf(stderr, "cannot write %s\n",
                 absl::GetFlag(FLAGS_results_json).c_str());
    return 1;
  }
  std::fputs(json.c_str(), f);
  std::fclose(f);
  std::printf("wrote %s\n%s", absl::GetFlag(FLAGS_results_json).c_str(),
              json.c_str());
  return rc;
}
