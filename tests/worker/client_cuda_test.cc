// The worker client's device-memory Step against its host Step: a cluster
// where one worker runs on the GPU must end with parameters bit-identical to
// the same cluster with every worker on the host (same gradients), and the
// device replica must equal the host replica and the servers after every
// run (for gaussiank/dgc, which select other sets on the GPU: the replicas
// and servers must still agree). Built twice: against CUDA (CTest label
// `gpu`; skips without a device) and against the CUDA emulator
// (worker_client_cuda_emu_test, every build).
#include <cuda_runtime_api.h>

#include <cstring>
#include <memory>
#include <ostream>
#include <random>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/codec.h"
#include "common/cuda/sparsify.h"
#include "common/optimizer.h"
#include "gtest/gtest.h"
#include "server/service.h"
#include "server/shard_aggregator.h"
#include "tests/testing/local_cluster.h"
#include "tests/testing/reference.h"
#include "tests/testing/status_matchers.h"
#include "worker/client.h"

namespace gtopk {
namespace {
using worker::ClientOptions;
using worker::WorkerClient;

constexpr uint64_t kN = 20011;
constexpr int kWorkers = 2;
constexpr int kSteps = 5;

struct Case {
  std::string selector;
  MomentumMode momentum;
  AggregationMode mode;
  ValueCodec value_codec;
};

// selector_momentum_mode_codec: the test name, and what gtest prints for
// the parameter (its default is the struct's bytes, pointers included,
// which gave CTest a different test name on every build).
std::string CaseName(const Case& c) {
  return absl::StrCat(c.selector, "_", MomentumModeName(c.momentum), "_",
                      AggregationModeName(c.mode), "_",
                      ValueCodecName(c.value_codec));
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

// Runs kSteps on a fresh 2-shard cluster; worker w uses the device Step
// when on_device[w]. Returns every worker's final parameters and the
// servers'.
std::vector<std::vector<float>> RunCluster(const Case& c,
                                           std::vector<bool> on_device) {
  server::ServerConfig s;
  s.num_workers = kWorkers;
  s.mode = c.mode;
  s.selector = c.selector;
  s.selector_seed = 42;
  s.value_codec = c.value_codec;
  s.optimizer.lr = 0.1f;
  s.optimizer.momentum = 0.9f;
  s.optimizer.momentum_mode = c.momentum;
  s.optimizer.density = 0.01;
  s.optimizer.weight_decay = 1e-3f;
  s.step_timeout = absl::Seconds(20);
  auto cluster_or = ::gtopk::testing::LocalCluster::Start(s, 2);
  EXPECT_TRUE(cluster_or.ok()) << cluster_or.status();
  if (!cluster_or.ok()) return {};
  ::gtopk::testing::LocalCluster& cluster = **cluster_or;
  std::vector<std::vector<float>> params(kWorkers);
  std::vector<absl::Status> status(kWorkers);
  std::vector<std::thread> threads;
  for (int w = 0; w < kWorkers; ++w) {
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
      for (int step = 0; step < kSteps && status[w].ok(); ++step) {
        const std::vector<float> g = Gradient(step, w);
        if (on_device[w]) {
          if (!cuda_ok(cudaMemcpy(d_grad.get(), g.data(), kN * sizeof(float),
                                  cudaMemcpyHostToDevice),
                       "gradient to device")) {
            break;
          }
          status[w] = (*client)
                          ->Step(d_grad.get(), d_params.get(), kN, nullptr)
                          .status();
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
  for (int w = 0; w < kWorkers; ++w) {
    EXPECT_TRUE(status[w].ok()) << "worker " << w << ": " << status[w];
  }
  auto server_params = cluster.ServerParams(kN);
  EXPECT_TRUE(server_params.ok()) << server_params.status();
  if (server_params.ok()) params.push_back(server_params->first);
  return params;
}

using ::gtopk::testing::BitEqual;

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
// and the servers must still hold the same parameters after each run.
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
                           ValueCodec::kBf16}),
    [](const ::testing::TestParamInfo<Case>& info) {
      return CaseName(info.param);
    });

}  // namespace
}  // namespace gtopk
