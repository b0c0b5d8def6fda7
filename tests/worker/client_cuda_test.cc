// The worker client's device-memory Step against its host Step: a cluster
// where one worker runs on the GPU must end with parameters bit-identical to
// the same cluster with every worker on the host (same gradients), and the
// device replica must equal the host replica and the servers after every
// run (for gaussiank/dgc, which select other sets on the GPU: the replicas
// and servers must still agree). Built twice: against CUDA (CTest label
// `gpu`; skips without a device) and against the CUDA emulator
// (worker_client_cuda_emu_test, every build).
//
// Layer-wise selection (--selection=layerwise) on the device: each bucket
// piece's top PieceK of u selected on the GPU must give the host
// layer-wise Step's parameters bit for bit (P 1 and 2, S 1 and 2, a bucket
// straddling the shard boundary, a piece with k_p = 0), a first step must
// be the plain per-piece top-k computed here, and a non-finite gradient in
// a piece (one that selects, one that selects nothing) must change nothing.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <ostream>
#include <random>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/codec.h"
#include "common/cuda/sparsify.h"
#include "common/optimizer.h"
#include "common/selector.h"
#include "common/status_macros.h"
#include "gtest/gtest.h"
#include "server/service.h"
#include "server/shard_aggregator.h"
#include "tests/testing/local_cluster.h"
#include "tests/testing/reference.h"
#include "tests/testing/status_matchers.h"
#include "worker/client.h"

namespace gtopk {
namespace {
using ::gtopk::testing::BitEqual;
using worker::ClientOptions;
using worker::WorkerClient;

constexpr uint64_t kN = 20011;
constexpr int kWorkers = 2;
constexpr int kSteps = 5;
// Layer-wise cases: buckets of 4000 values. With two shards ([0, 10005),
// [10005, 20011)) the bucket [8000, 12000) straddles the boundary; the last
// piece [20000, 20011) keeps round(200 * 11 / 20011) = 0 entries.
constexpr uint64_t kBucket = 4000;
constexpr int kPoisonStep = 2;
// Where the poisoned gradients of a layer-wise case put a non-finite value:
// a NaN in the straddling bucket's second piece (k_p = 20), an infinity in
// the last piece (k_p = 0).
constexpr uint64_t kPoisonIndices[] = {10007, 20005};

struct Case {
  std::string selector;
  MomentumMode momentum;
  AggregationMode mode;
  ValueCodec value_codec;
  SelectionKind selection = SelectionKind::kThreshold;
  int workers = kWorkers;
  uint32_t shards = 2;
  int steps = kSteps;
  float weight_decay = 1e-3f;
  // Layer-wise only: at kPoisonStep each device worker first tries steps
  // whose gradient has a non-finite value at one of kPoisonIndices; each
  // must fail INVALID_ARGUMENT and leave its state and params unchanged.
  bool poison = false;
  // Device workers step through the overlapped API (BeginOverlappedStep
  // with device pointers, GradientReady, FinishOverlappedStep).
  bool overlapped = false;
};

// selector_momentum_mode_codec: the test name, and what gtest prints for
// the parameter (its default is the struct's bytes, pointers included,
// which gave CTest a different test name on every build).
std::string CaseName(const Case& c) {
  std::string name = absl::StrCat(c.selector, "_", MomentumModeName(c.momentum),
                                  "_", AggregationModeName(c.mode), "_",
                                  ValueCodecName(c.value_codec));
  if (c.selection == SelectionKind::kLayerwise) {
    absl::StrAppend(&name, "_layerwise_P", c.workers, "_S", c.shards,
                    c.poison ? "_poison" : "",
                    c.overlapped ? "_overlapped" : "");
  }
  return name;
}
void PrintTo(const Case& c, std::ostream* os) { *os << CaseName(c); }

std::vector<float> Gradient(int step, int worker) {
  std::mt19937_64 rng(1000 * step + worker);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> g(kN);
  for (float& x : g) x = normal(rng);
  return g;
}

std::vector<float> InitialParams() {
  std::mt19937_64 rng(7);
  std::uniform_real_distribution<float> u(-0.1f, 0.1f);
  std::vector<float> p(kN);
  for (float& x : p) x = u(rng);
  return p;
}

absl::Status CudaStatus(cudaError_t e, absl::string_view what) {
  if (e == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorString(e)));
}

// One device step of `g`: the device Step, or (overlapped) an overlapped
// device step as a backward pass on the caller's stream would run it: the
// gradient buffer starts as NaN (a piece selected before its values were
// written fails), each chunk of 997 values from the end is copied
// asynchronously on the stream and then reported.
// With `report` < kN the overlapped step is given up
// (AbandonOverlappedStep) once `report` values are reported, as an
// exception in the backward pass would, and the result is CANCELLED.
absl::Status DeviceStep(WorkerClient& client, bool overlapped,
                        const std::vector<float>& g, float* d_grad,
                        float* d_params, uint64_t report = kN) {
  if (!overlapped) {
    GTOPK_RETURN_IF_ERROR(
        CudaStatus(cudaMemcpy(d_grad, g.data(), kN * sizeof(float),
                              cudaMemcpyHostToDevice),
                   "gradient to device"));
    return client.Step(d_grad, d_params, kN, nullptr).status();
  }
  const std::vector<float> nan(kN, std::numeric_limits<float>::quiet_NaN());
  GTOPK_RETURN_IF_ERROR(
      CudaStatus(cudaMemcpy(d_grad, nan.data(), kN * sizeof(float),
                            cudaMemcpyHostToDevice),
                 "NaN to device"));
  GTOPK_RETURN_IF_ERROR(
      client.BeginOverlappedStep(d_grad, d_params, kN, nullptr));
  for (uint64_t end = kN; end > 0 && kN - end < report;) {
    const uint64_t begin = end >= 997 ? end - 997 : 0;
    GTOPK_RETURN_IF_ERROR(
        CudaStatus(cudaMemcpyAsync(d_grad + begin, g.data() + begin,
                                   (end - begin) * sizeof(float),
                                   cudaMemcpyHostToDevice, nullptr),
                   "gradient chunk to device"));
    GTOPK_RETURN_IF_ERROR(client.GradientReady(begin, end));
    end = begin;
  }
  if (report < kN) {
    // Time for the selection thread to release shard 1's push.
    absl::SleepFor(absl::Milliseconds(300));
    client.AbandonOverlappedStep();
    return absl::CancelledError("abandoned in the backward pass");
  }
  return client.FinishOverlappedStep().status();
}

// A poisoned case's attempts on a device worker before its real step
// kPoisonStep: the gradient `g` with a NaN or an infinity at each of
// kPoisonIndices must fail INVALID_ARGUMENT and leave the client's state
// (step, residual, velocity) and the device params exactly as they were;
// overlapped, so must a step given up in the middle of its backward pass
// (each attempt followed by Recover, as the step failed on the shards).
// OK when they do, else what went wrong.
absl::Status TryPoisonedSteps(WorkerClient& client, bool overlapped,
                              const std::vector<float>& g, float* d_grad,
                              float* d_params) {
  auto before = client.ExportState();
  if (!before.ok()) return before.status();
  std::vector<float> params_before(kN), params_after(kN);
  GTOPK_RETURN_IF_ERROR(
      CudaStatus(cudaMemcpy(params_before.data(), d_params, kN * sizeof(float),
                            cudaMemcpyDeviceToHost),
                 "params to host"));
  // Whether the state and the device params are as before.
  auto unchanged = [&](absl::string_view attempt) -> absl::Status {
    auto after = client.ExportState();
    if (!after.ok()) return after.status();
    GTOPK_RETURN_IF_ERROR(
        CudaStatus(cudaMemcpy(params_after.data(), d_params, kN * sizeof(float),
                              cudaMemcpyDeviceToHost),
                   "params to host"));
    if (after->next_step != before->next_step ||
        !BitEqual(after->residual, before->residual) ||
        !BitEqual(after->velocity, before->velocity) ||
        !BitEqual(params_after, params_before)) {
      return absl::InternalError(
          absl::StrCat(attempt, " changed the worker's state or params"));
    }
    if (overlapped) {
      // Some pushes went out: the step was failed on every shard.
      std::vector<float> unused(kN);
      GTOPK_RETURN_IF_ERROR(client.Recover(absl::MakeSpan(unused)).status());
    }
    return absl::OkStatus();
  };
  if (overlapped) {
    // Given up once shard 1's range [10005, 20011) is reported.
    const absl::Status st =
        DeviceStep(client, overlapped, g, d_grad, d_params, kN - kN / 2);
    if (st.code() != absl::StatusCode::kCancelled) {
      return absl::InternalError(absl::StrCat(
          "abandoned step: expected CANCELLED, got ", st.ToString()));
    }
    GTOPK_RETURN_IF_ERROR(unchanged("the abandoned step"));
  }
  for (const uint64_t bad : kPoisonIndices) {
    std::vector<float> poisoned = g;
    poisoned[bad] = bad == kPoisonIndices[0]
                        ? std::numeric_limits<float>::quiet_NaN()
                        : std::numeric_limits<float>::infinity();
    const absl::Status st =
        DeviceStep(client, overlapped, poisoned, d_grad, d_params);
    if (st.code() != absl::StatusCode::kInvalidArgument ||
        !absl::StrContains(st.message(), "not finite")) {
      return absl::InternalError(
          absl::StrCat("non-finite gradient at ", bad,
                       ": expected INVALID_ARGUMENT, got ", st.ToString()));
    }
    GTOPK_RETURN_IF_ERROR(unchanged(
        absl::StrCat("the failed step with a non-finite gradient at ", bad)));
  }
  return absl::OkStatus();
}

// Runs c.steps on a fresh cluster of c.shards shards and c.workers workers;
// worker w uses the device Step when on_device[w]. Returns every worker's
// final parameters and the servers'.
std::vector<std::vector<float>> RunCluster(const Case& c,
                                           std::vector<bool> on_device) {
  const int workers = c.workers;
  server::ServerConfig s;
  s.num_workers = workers;
  s.selection = c.selection;
  s.bucket_mb = kBucket * 4.0 / (1 << 20);
  s.mode = c.mode;
  s.selector = c.selector;
  s.selector_seed = 42;
  s.value_codec = c.value_codec;
  s.optimizer.lr = 0.1f;
  s.optimizer.momentum = 0.9f;
  s.optimizer.momentum_mode = c.momentum;
  s.optimizer.density = 0.01;
  s.optimizer.weight_decay = c.weight_decay;
  s.step_timeout = absl::Seconds(20);
  auto cluster_or = ::gtopk::testing::LocalCluster::Start(s, c.shards);
  EXPECT_TRUE(cluster_or.ok()) << cluster_or.status();
  if (!cluster_or.ok()) return {};
  ::gtopk::testing::LocalCluster& cluster = **cluster_or;
  std::vector<std::vector<float>> params(workers);
  std::vector<absl::Status> status(workers);
  std::vector<std::thread> threads;
  for (int w = 0; w < workers; ++w) {
    threads.emplace_back([&, w] {
      ClientOptions o;
      o.leader_address = cluster.leader();
      o.requested_rank = w;
      o.n = kN;
      auto client = WorkerClient::Connect(o);
      if (!client.ok()) {
        status[w] = client.status();
        return;
      }
      params[w] = w == 0 ? InitialParams() : std::vector<float>(kN, 0.0f);
      auto start = (*client)->SynchronizeParameters(absl::MakeSpan(params[w]));
      if (!start.ok()) {
        status[w] = start.status();
        return;
      }
      // Device buffers as cuda::DeviceBuffer (freed on every path); a
      // failed CUDA call is this worker's error.
      cuda::DeviceBuffer<float> d_grad, d_params;
      auto cuda_ok = [&](cudaError_t e, const char* what) {
        if (e != cudaSuccess && status[w].ok()) {
          status[w] = absl::InternalError(
              absl::StrCat(what, ": ", cudaGetErrorString(e)));
        }
        return status[w].ok();
      };
      if (on_device[w]) {
        const cuda::KernelStatus a = d_grad.Allocate(kN);
        const cuda::KernelStatus b = d_params.Allocate(kN);
        if (!a.ok() || !b.ok()) {
          status[w] = absl::InternalError(a.ok() ? b.message : a.message);
          return;
        }
        if (!cuda_ok(cudaMemcpy(d_params.get(), params[w].data(),
                                kN * sizeof(float), cudaMemcpyHostToDevice),
                     "params to device")) {
          return;
        }
      }
      for (int step = 0; step < c.steps && status[w].ok(); ++step) {
        const std::vector<float> g = Gradient(step, w);
        if (on_device[w] && c.poison && step == kPoisonStep) {
          status[w] = TryPoisonedSteps(**client, c.overlapped, g, d_grad.get(),
                                       d_params.get());
          if (!status[w].ok()) break;
        }
        if (on_device[w]) {
          status[w] = DeviceStep(**client, c.overlapped, g, d_grad.get(),
                                 d_params.get());
        } else {
          status[w] = (*client)->Step(g, absl::MakeSpan(params[w])).status();
        }
      }
      if (on_device[w] && status[w].ok()) {
        cuda_ok(cudaMemcpy(params[w].data(), d_params.get(), kN * sizeof(float),
                           cudaMemcpyDeviceToHost),
                "params to host");
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int w = 0; w < workers; ++w) {
    EXPECT_TRUE(status[w].ok()) << "worker " << w << ": " << status[w];
  }
  auto server_params = cluster.ServerParams(kN);
  EXPECT_TRUE(server_params.ok()) << server_params.status();
  if (server_params.ok()) params.push_back(server_params->first);
  return params;
}

class ClientCudaTest : public ::testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  }
};

TEST_P(ClientCudaTest, DeviceWorkerMatchesHostWorkersBitForBit) {
  const std::vector<std::vector<float>> host =
      RunCluster(GetParam(), {false, false});
  const std::vector<std::vector<float>> mixed =
      RunCluster(GetParam(), {false, true});
  ASSERT_EQ(host.size(), kWorkers + 1u);
  ASSERT_EQ(mixed.size(), kWorkers + 1u);
  for (int r = 0; r <= kWorkers; ++r) {
    EXPECT_TRUE(BitEqual(mixed[r], host[r]))
        << (r == kWorkers ? std::string("servers")
                          : absl::StrCat("replica ", r))
        << " differs when worker 1 runs on the device";
    EXPECT_TRUE(BitEqual(mixed[r], mixed[0])) << "replica " << r;
  }
}

INSTANTIATE_TEST_SUITE_P(
    Modes, ClientCudaTest,
    ::testing::Values(Case{"exact", MomentumMode::kDgcCorrection,
                           AggregationMode::kGtopk, ValueCodec::kFp32},
                      Case{"exact", MomentumMode::kGlobal,
                           AggregationMode::kGtopk, ValueCodec::kBf16},
                      Case{"exact", MomentumMode::kNone, AggregationMode::kTopk,
                           ValueCodec::kFp16},
                      Case{"exact", MomentumMode::kDgcCorrection,
                           AggregationMode::kDense, ValueCodec::kFp32}),
    [](const ::testing::TestParamInfo<Case>& info) {
      return CaseName(info.param);
    });

// gaussiank and dgc select other (in-contract) sets on the GPU than on the
// CPU, so the mixed cluster cannot equal the all-host one; every replica
// and the servers must still hold the same parameters after each run (also
// under layer-wise selection, each piece selected on its own).
class ClientCudaApproxTest : public ClientCudaTest {};

TEST_P(ClientCudaApproxTest, DeviceWorkerKeepsReplicasIdentical) {
  const std::vector<std::vector<float>> mixed =
      RunCluster(GetParam(), {false, true});
  ASSERT_EQ(mixed.size(), kWorkers + 1u);
  for (int r = 1; r <= kWorkers; ++r) {
    EXPECT_TRUE(BitEqual(mixed[r], mixed[0]))
        << (r == kWorkers ? std::string("servers")
                          : absl::StrCat("replica ", r))
        << " differs from replica 0";
  }
  EXPECT_FALSE(BitEqual(mixed[0], InitialParams())) << "nothing was applied";
}

INSTANTIATE_TEST_SUITE_P(
    Modes, ClientCudaApproxTest,
    ::testing::Values(Case{"gaussiank", MomentumMode::kDgcCorrection,
                           AggregationMode::kGtopk, ValueCodec::kFp32},
                      Case{"dgc", MomentumMode::kGlobal, AggregationMode::kTopk,
                           ValueCodec::kBf16},
                      Case{"gaussiank", MomentumMode::kDgcCorrection,
                           AggregationMode::kGtopk, ValueCodec::kFp32,
                           SelectionKind::kLayerwise},
                      Case{"dgc", MomentumMode::kNone, AggregationMode::kGtopk,
                           ValueCodec::kFp16, SelectionKind::kLayerwise}),
    [](const ::testing::TestParamInfo<Case>& info) {
      return CaseName(info.param);
    });

// Layer-wise selection: the device Step selects each bucket piece's top
// PieceK on the GPU; the replicas and servers must end bit-identical to the
// same cluster with every worker on the host, whether one worker or all of
// them step on the device.
class ClientCudaLayerwiseTest : public ClientCudaTest {};

TEST_P(ClientCudaLayerwiseTest, DeviceWorkersMatchHostLayerwiseStepBitForBit) {
  const Case& c = GetParam();
  const size_t replicas = static_cast<size_t>(c.workers);
  const std::vector<std::vector<float>> host =
      RunCluster(c, std::vector<bool>(replicas, false));
  ASSERT_EQ(host.size(), replicas + 1);
  EXPECT_FALSE(BitEqual(host[0], InitialParams())) << "nothing was applied";
  std::vector<std::vector<bool>> layouts = {std::vector<bool>(replicas, true)};
  if (replicas > 1) {
    layouts.push_back(std::vector<bool>(replicas, false));
    layouts.back().back() = true;  // one device worker among host workers
  }
  for (const std::vector<bool>& on_device : layouts) {
    const std::vector<std::vector<float>> run = RunCluster(c, on_device);
    ASSERT_EQ(run.size(), replicas + 1);
    for (size_t r = 0; r <= replicas; ++r) {
      EXPECT_TRUE(BitEqual(run[r], host[r]))
          << (r == replicas ? std::string("servers")
                            : absl::StrCat("replica ", r))
          << " differs with "
          << std::count(on_device.begin(), on_device.end(), true)
          << " device worker(s)";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Modes, ClientCudaLayerwiseTest,
    ::testing::Values(
        Case{"exact", MomentumMode::kDgcCorrection, AggregationMode::kGtopk,
             ValueCodec::kFp32, SelectionKind::kLayerwise, 1, 1},
        Case{"exact", MomentumMode::kDgcCorrection, AggregationMode::kGtopk,
             ValueCodec::kFp32, SelectionKind::kLayerwise, 1, 2},
        Case{"exact", MomentumMode::kDgcCorrection, AggregationMode::kGtopk,
             ValueCodec::kBf16, SelectionKind::kLayerwise, 2, 1},
        Case{"exact", MomentumMode::kGlobal, AggregationMode::kGtopk,
             ValueCodec::kFp16, SelectionKind::kLayerwise, 2, 2},
        Case{"exact", MomentumMode::kDgcCorrection, AggregationMode::kGtopk,
             ValueCodec::kFp32, SelectionKind::kLayerwise, 2, 2, kSteps, 1e-3f,
             /*poison=*/true},
        Case{"exact", MomentumMode::kNone, AggregationMode::kGtopk,
             ValueCodec::kFp32, SelectionKind::kLayerwise, 1, 2, kSteps, 1e-3f,
             /*poison=*/true},
        // Overlapped device steps: the same parameters as the whole step.
        Case{"exact", MomentumMode::kDgcCorrection, AggregationMode::kGtopk,
             ValueCodec::kFp32, SelectionKind::kLayerwise, 1, 1, kSteps, 1e-3f,
             false, /*overlapped=*/true},
        Case{"exact", MomentumMode::kGlobal, AggregationMode::kGtopk,
             ValueCodec::kBf16, SelectionKind::kLayerwise, 2, 2, kSteps, 1e-3f,
             false, /*overlapped=*/true},
        Case{"exact", MomentumMode::kDgcCorrection, AggregationMode::kGtopk,
             ValueCodec::kFp16, SelectionKind::kLayerwise, 1, 2, kSteps, 1e-3f,
             /*poison=*/true, /*overlapped=*/true}),
    [](const ::testing::TestParamInfo<Case>& info) {
      return CaseName(info.param);
    });

// Independent of the host Step: one device worker's first layer-wise step
// (P = 1, no momentum, no weight decay, zero residual) applies exactly
// u = lr * g at the plain top round(k * n_p / n) of |u| of every piece
// (ties to the lower index), cut here at every multiple of the bucket size
// and at the shard boundary.
TEST_F(ClientCudaTest, LayerwiseFirstStepIsThePlainPerPieceTopK) {
  Case c{"exact",
         MomentumMode::kNone,
         AggregationMode::kGtopk,
         ValueCodec::kFp32,
         SelectionKind::kLayerwise,
         1,
         2};
  c.steps = 1;
  c.weight_decay = 0.0f;
  const std::vector<std::vector<float>> run = RunCluster(c, {true});
  ASSERT_EQ(run.size(), 2u);

  std::vector<uint64_t> cuts = {kN / 2};  // shard 1's first index
  for (uint64_t b = 0; b < kN; b += kBucket) cuts.push_back(b);
  std::sort(cuts.begin(), cuts.end());
  cuts.push_back(kN);
  const uint64_t k = *KFromDensity(0.01, kN);
  const std::vector<float> g = Gradient(0, 0);
  std::vector<float> expected = InitialParams();
  uint64_t kept = 0;
  for (size_t p = 0; p + 1 < cuts.size(); ++p) {
    const uint64_t begin = cuts[p], size = cuts[p + 1] - cuts[p];
    const uint64_t kp = (2 * k * size + kN) / (2 * kN);  // halves up
    std::vector<uint64_t> order(size);
    for (uint64_t i = 0; i < size; ++i) order[i] = begin + i;
    std::stable_sort(order.begin(), order.end(), [&](uint64_t a, uint64_t b) {
      return std::fabs(0.1f * g[a]) > std::fabs(0.1f * g[b]);
    });
    for (uint64_t j = 0; j < kp; ++j) {
      expected[order[j]] -= 0.1f * g[order[j]];
    }
    kept += kp;
  }
  EXPECT_EQ(cuts.size(), 8u) << "7 pieces: [8000, 12000) is cut at 10005";
  EXPECT_EQ(kept, k);
  EXPECT_TRUE(BitEqual(run[0], expected)) << "device replica";
  EXPECT_TRUE(BitEqual(run[1], expected)) << "servers";
}

}  // namespace
}  // namespace gtopk
