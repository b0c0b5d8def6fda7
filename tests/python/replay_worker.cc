// gtopk_replay_worker: one C++ worker (worker/client.h) stepping through
// gradients read from a file -- the reference the Python package is tested
// and benchmarked against (tests/python/), on the very inputs the Python
// workers use.
//
//   gtopk_replay_worker --leader=HOST:PORT --rank=R --n=N
//       --gradients=FILE --steps=T [--params=FILE] --out=FILE
//       [--timing_json=FILE]
//
// FILE formats: raw little-endian float32. --gradients holds K >= 1 rows of
// n values; step t uses row t mod K. --params (n values) are rank 0's
// initial parameters (default zeros). --out receives the final parameters
// (n values). --timing_json gets {"step_seconds": [...]} (wall time of each
// WorkerClient::Step call). Exit 0, or 1 with the error on stderr.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "worker/client.h"

ABSL_FLAG(std::string, leader, "", "leader host:port");
ABSL_FLAG(int, rank, -1, "rank to join as (-1: any)");
ABSL_FLAG(uint64_t, n, 0, "parameter count");
ABSL_FLAG(std::string, gradients, "", "float32 file of K x n gradients");
ABSL_FLAG(int64_t, steps, 1, "steps to run");
ABSL_FLAG(std::string, params, "", "float32 file of n initial parameters");
ABSL_FLAG(std::string, out, "", "where the final parameters go");
ABSL_FLAG(std::string, timing_json, "", "per-step Step() wall seconds");

namespace {

absl::Status ReadFloats(const std::string& path, std::vector<float>* out) {
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open ", path));
  const std::streamsize bytes = in.tellg();
  if (bytes % sizeof(float) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": ", bytes, " bytes is not whole float32s"));
  }
  out->resize(bytes / sizeof(float));
  in.seekg(0);
  in.read(reinterpret_cast<char*>(out->data()), bytes);
  if (!in) return absl::DataLossError(absl::StrCat("cannot read ", path));
  return absl::OkStatus();
}

absl::Status Run() {
  const uint64_t n = absl::GetFlag(FLAGS_n);
  std::vector<float> gradients;
  if (absl::Status s = ReadFloats(absl::GetFlag(FLAGS_gradients), &gradients);
      !s.ok()) {
    return s;
  }
  if (n == 0 || gradients.empty() || gradients.size() % n != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--gradients holds ", gradients.size(), " values: not K x n = ", n));
  }
  const size_t rows = gradients.size() / n;
  std::vector<float> params(n, 0.0f);
  if (!absl::GetFlag(FLAGS_params).empty()) {
    if (absl::Status s = ReadFloats(absl::GetFlag(FLAGS_params), &params);
        !s.ok()) {
      return s;
    }
    if (params.size() != n) {
      return absl::InvalidArgumentError("--params does not hold n values");
    }
  }
  gtopk::worker::ClientOptions o;
  o.leader_address = absl::GetFlag(FLAGS_leader);
  o.requested_rank = absl::GetFlag(FLAGS_rank);
  o.n = n;
  absl::StatusOr<std::unique_ptr<gtopk::worker::WorkerClient>> client =
      gtopk::worker::WorkerClient::Connect(o);
  if (!client.ok()) return client.status();
  absl::StatusOr<int64_t> start =
      (*client)->SynchronizeParameters(absl::MakeSpan(params));
  if (!start.ok()) return start.status();
  std::vector<double> seconds;
  // Workers apply (--apply=workers): AggregateStep, then plain SGD with lr
  // 0.1 outside the timed call (the user's optimizer's share).
  const bool workers_apply =
      (*client)->cluster().apply() == gtopk::v1::APPLY_WORKERS;
  std::vector<float> averaged(workers_apply ? n : 0);
  for (int64_t t = 0; t < absl::GetFlag(FLAGS_steps); ++t) {
    const absl::Span<const float> g =
        absl::MakeConstSpan(gradients).subspan((t % rows) * n, n);
    const auto begin = std::chrono::steady_clock::now();
    absl::StatusOr<gtopk::worker::StepStats> stats =
        workers_apply
            ? (*client)->AggregateStep(g, absl::MakeSpan(averaged), params)
            : (*client)->Step(g, absl::MakeSpan(params));
    const auto end = std::chrono::steady_clock::now();
    if (workers_apply && stats.ok()) {
      for (size_t i = 0; i < n; ++i) params[i] -= 0.1f * averaged[i];
    }
    if (!stats.ok()) {
      return absl::Status(
          stats.status().code(),
          absl::StrCat("step ", t, ": ", stats.status().message()));
    }
    seconds.push_back(std::chrono::duration<double>(end - begin).count());
  }
  {
    std::ofstream out(absl::GetFlag(FLAGS_out), std::ios::binary);
    out.write(reinterpret_cast<const char*>(params.data()),
              params.size() * sizeof(float));
    if (!out) return absl::PermissionDeniedError("cannot write --out");
  }
  if (!absl::GetFlag(FLAGS_timing_json).empty()) {
    std::ofstream out(absl::GetFlag(FLAGS_timing_json));
    out << "{\"step_seconds\": [";
    for (size_t i = 0; i < seconds.size(); ++i) {
      out << (i ? ", " : "") << absl::StrCat(seconds[i]);
    }
    out << "]}\n";
  }
  return absl::OkStatus();
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const absl::Status s = Run();
  if (!s.ok()) {
    std::fprintf(stderr, "gtopk_replay_worker: %s\n", s.ToString().c_str());
    return 1;
  }
  return 0;
}
