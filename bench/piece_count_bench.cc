// Step time against the number of bucket pieces (--selection=layerwise,
// docs/overlap.md "How many pieces"): an in-process cluster on loopback
// (S real gRPC AggregatorServers, P WorkerClient threads, --apply=servers),
// n parameters cut into buckets of ceil(n / pieces) values, each piece its
// own gTop-k round. Per piece count it times the plain host Step and the
// overlapped step (Begin, GradientReady in --chunks equal ranges from the
// end, Finish), the median over the measured steps (after one warm-up
// step) of the slowest worker's step, and prints one line per (pieces,
// kind); backward_s is the overlapped step's Begin to last GradientReady.
// Piece counts over the cluster's bound (kMaxBucketPieces) are refused at
// Join and print FAILED with the refusal.
//
//   piece_count_bench [--n=200000] [--pieces=100,1000,10000,50000,200000]
//                     [--workers=2] [--shards=2] [--density=0.5]
//                     [--steps=3] [--kinds=step,overlapped] [--chunks=64]
//                     [--chunk_sleep_us=0] [--step_timeout_s=60]
//
// The figures in docs/overlap.md ("How many pieces"):
//   piece_count_bench --pieces=100,1000,10000,50000,100000,200000 --steps=3
//   piece_count_bench --n=2000000 --density=0.1
//       --pieces=100,10000,65536,200000,400000 --steps=2
//   piece_count_bench --pieces=200000 --kinds=overlapped --steps=2
//       --chunks=10000 --chunk_sleep_us=50
// (each on one line, with --step_timeout_s=120 --connect_timeout_s=120;
// the rows over the bound with kMaxBucketPieces raised in a scratch
// build).
#include <algorithm>
#include <cstdio>
#include <limits>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "bench/synthetic.h"
#include "tests/testing/local_cluster.h"
#include "worker/client.h"

ABSL_FLAG(uint64_t, n, 200000, "parameters");
ABSL_FLAG(std::string, pieces, "100,1000,10000,50000,200000",
          "bucket counts to run (bucket size ceil(n / pieces) values)");
ABSL_FLAG(int, workers, 2, "P, worker threads");
ABSL_FLAG(int, shards, 2, "S, in-process servers");
ABSL_FLAG(double, density, 0.5, "k / n");
ABSL_FLAG(int, steps, 3, "measured steps per case (after one warm-up step)");
ABSL_FLAG(std::string, kinds, "step,overlapped",
          "step (plain host Step) and/or overlapped");
ABSL_FLAG(int, step_timeout_s, 60, "the servers' --step-timeout");
ABSL_FLAG(int, connect_timeout_s, 60, "the workers' rpc timeout");
ABSL_FLAG(uint64_t, chunks, 64,
          "overlapped: GradientReady calls per step (equal ranges from the "
          "end, as backward produces the last layers first)");
ABSL_FLAG(int, chunk_sleep_us, 0,
          "overlapped: sleep after each GradientReady (the rest of backward)");

namespace gtopk {
namespace {

using ::gtopk::bench::Median;
using ::gtopk::bench::Synthetic;

absl::StatusOr<worker::StepStats> Overlapped(worker::WorkerClient& c,
                                             const std::vector<float>& g,
                                             std::vector<float>& buffer,
                                             std::vector<float>& params,
                                             double* backward_s) {
  const absl::Time start = absl::Now();
  const uint64_t n = g.size();
  std::fill(buffer.begin(), buffer.end(), 0.0f);
  absl::Status st = c.BeginOverlappedStep(buffer, absl::MakeSpan(params));
  if (!st.ok()) return st;
  const int sleep_us = absl::GetFlag(FLAGS_chunk_sleep_us);
  const uint64_t chunk = std::max<uint64_t>(1, n / absl::GetFlag(FLAGS_chunks));
  for (uint64_t end = n; end > 0;) {
    const uint64_t begin = end >= chunk ? end - chunk : 0;
    std::copy(g.begin() + begin, g.begin() + end, buffer.begin() + begin);
    st = c.GradientReady(begin, end);
    if (!st.ok()) {
      c.AbandonOverlappedStep();
      return st;
    }
    end = begin;
    if (sleep_us > 0) absl::SleepFor(absl::Microseconds(sleep_us));
  }
  *backward_s = absl::ToDoubleSeconds(absl::Now() - start);
  return c.FinishOverlappedStep();
}

// One case: a fresh cluster, P workers, 1 + steps steps; the median step
// wall time in seconds (the slowest worker's per step), or an error.
// *backward_out: overlapped, the median time from Begin to the last
// GradientReady (the emulated backward pass), the slowest worker's.
absl::StatusOr<double> RunCase(uint64_t n, uint64_t bucket, bool overlapped,
                               size_t* pieces_out, double* backward_out) {
  const int workers = absl::GetFlag(FLAGS_workers);
  server::ServerConfig config = testing::LayerwiseConfig(
      workers, ApplyMode::kServers, bucket, absl::GetFlag(FLAGS_density));
  config.step_timeout = absl::Seconds(absl::GetFlag(FLAGS_step_timeout_s));
  auto cluster = testing::LocalCluster::Start(
      config, static_cast<uint32_t>(absl::GetFlag(FLAGS_shards)));
  if (!cluster.ok()) return cluster.status();
  std::vector<std::unique_ptr<worker::WorkerClient>> clients;
  for (int w = 0; w < workers; ++w) {
    worker::ClientOptions o;
    o.leader_address = (*cluster)->leader();
    o.requested_rank = w;
    o.n = n;
    o.rpc_timeout = absl::Seconds(absl::GetFlag(FLAGS_connect_timeout_s));
    auto c = worker::WorkerClient::Connect(o);
    if (!c.ok()) return c.status();
    clients.push_back(*std::move(c));
  }
  *pieces_out = clients[0]->bucket_pieces().size();
  const int steps = 1 + absl::GetFlag(FLAGS_steps);
  std::vector<std::vector<double>> times(workers), backward(workers);
  std::vector<absl::Status> status(workers);
  std::vector<std::thread> threads;
  for (int w = 0; w < workers; ++w) {
    threads.emplace_back([&, w] {
      std::vector<float> params(n, 0.0f), g(n), buffer(n);
      if (w == 0) Synthetic(1, &params);
      status[w] =
          clients[w]->SynchronizeParameters(absl::MakeSpan(params)).status();
      for (int t = 0; t < steps && status[w].ok(); ++t) {
        Synthetic(100 + 7 * t + w, &g);
        const absl::Time start = absl::Now();
        double b = 0;
        absl::StatusOr<worker::StepStats> st =
            overlapped ? Overlapped(*clients[w], g, buffer, params, &b)
                       : clients[w]->Step(g, absl::MakeSpan(params));
        status[w] = st.status();
        times[w].push_back(absl::ToDoubleSeconds(absl::Now() - start));
        backward[w].push_back(b);
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int w = 0; w < workers; ++w) {
    if (!status[w].ok()) {
      return absl::Status(status[w].code(), absl::StrCat("worker ", w, ": ",
                                                         status[w].message()));
    }
  }
  std::vector<double> per_step, per_backward;
  for (int t = 1; t < steps; ++t) {
    double slowest = 0, slowest_backward = 0;
    for (int w = 0; w < workers; ++w) {
      slowest = std::max(slowest, times[w][t]);
      slowest_backward = std::max(slowest_backward, backward[w][t]);
    }
    per_step.push_back(slowest);
    per_backward.push_back(slowest_backward);
  }
  *backward_out = Median(per_backward);
  return Median(per_step);
}

}  // namespace
}  // namespace gtopk

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const uint64_t n = absl::GetFlag(FLAGS_n);
  std::printf("n=%llu P=%d S=%d density=%g\n",
              static_cast<unsigned long long>(n), absl::GetFlag(FLAGS_workers),
              absl::GetFlag(FLAGS_shards), absl::GetFlag(FLAGS_density));
  std::printf("%10s %10s %10s %12s %12s %12s\n", "buckets", "bucket", "pieces",
              "kind", "step_s", "backward_s");
  std::fflush(stdout);
  for (const absl::string_view p :
       absl::StrSplit(absl::GetFlag(FLAGS_pieces), ',')) {
    uint64_t buckets = 0;
    if (!absl::SimpleAtoi(p, &buckets) || buckets == 0) continue;
    const uint64_t bucket = (n + buckets - 1) / buckets;
    for (const absl::string_view kind :
         absl::StrSplit(absl::GetFlag(FLAGS_kinds), ',')) {
      size_t pieces = 0;
      double backward = 0;
      const absl::Time start = absl::Now();
      absl::StatusOr<double> t =
          gtopk::RunCase(n, bucket, kind == "overlapped", &pieces, &backward);
      if (t.ok()) {
        std::printf("%10llu %10llu %10zu %12s %12.4f %12.4f  (case %.1f s)\n",
                    static_cast<unsigned long long>(buckets),
                    static_cast<unsigned long long>(bucket), pieces,
                    std::string(kind).c_str(), *t, backward,
                    absl::ToDoubleSeconds(absl::Now() - start));
      } else {
        std::printf("%10llu %10llu %10zu %12s  FAILED after %.1f s: %s\n",
                    static_cast<unsigned long long>(buckets),
                    static_cast<unsigned long long>(bucket), pieces,
                    std::string(kind).c_str(),
                    absl::ToDoubleSeconds(absl::Now() - start),
                    std::string(t.status().message()).substr(0, 300).c_str());
      }
      std::fflush(stdout);
    }
  }
  return 0;
}
