// GPU selectors against the CPU reference (tests/testing/reference.h) on
// fresh seeded inputs. Skips, with the reason, when no CUDA device is
// present (CTest label `gpu`).
#include "common/cuda/sparsify.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/types/span.h"
#include "common/cpu/selectors.h"
#include "common/cuda/cuda_selector.h"
#include "common/optimizer.h"
#include "common/random.h"
#include "common/selector.h"
#include "common/topk.h"
#include "gtest/gtest.h"
#include "tests/testing/reference.h"
#include "tests/testing/status_matchers.h"

namespace gtopk {
namespace cuda {
namespace {

using ::gtopk::testing::Distribution;
using ::gtopk::testing::DistributionName;
using ::gtopk::testing::FloatBits;
using ::gtopk::testing::MakeInput;
using ::gtopk::testing::ReferenceTopK;
using ::gtopk::testing::StatusIs;
using ::testing::HasSubstr;

class GpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  }
};

// A device copy of a host vector, freed at scope exit.
struct DeviceVector {
  DeviceBuffer<float> buffer;
  explicit DeviceVector(const std::vector<float>& host) {
    EXPECT_TRUE(buffer.Allocate(std::max<size_t>(host.size(), 1)).ok());
    EXPECT_EQ(cudaMemcpy(buffer.get(), host.data(), host.size() * sizeof(float),
                         cudaMemcpyHostToDevice),
              cudaSuccess);
  }
  std::vector<float> ToHost(size_t n) const {
    std::vector<float> host(n);
    EXPECT_EQ(cudaMemcpy(host.data(), buffer.get(), n * sizeof(float),
                         cudaMemcpyDeviceToHost),
              cudaSuccess);
    return host;
  }
};

// The device residual `d` after a selection over `u` that zeroed
// `selected`: +0.0 there, every other entry bit-identical to u.
void ExpectZeroedExactly(const DeviceVector& d, const std::vector<float>& u,
                         const std::vector<uint32_t>& selected) {
  std::vector<float> expected = u;
  for (uint32_t i : selected) expected[i] = 0.0f;
  const std::vector<float> after = d.ToHost(u.size());
  for (size_t i = 0; i < u.size(); ++i) {
    ASSERT_EQ(FloatBits(after[i]), FloatBits(expected[i])) << "index " << i;
  }
}

void ExpectSameBits(const SparseVector& got, const SparseVector& want) {
  ASSERT_EQ(got.indices, want.indices);
  ASSERT_EQ(got.values.size(), want.values.size());
  for (size_t j = 0; j < got.values.size(); ++j) {
    ASSERT_EQ(FloatBits(got.values[j]), FloatBits(want.values[j]))
        << "position " << j << " index " << got.indices[j];
  }
}

// The smallest float strictly above t (t >= 0): the key a device threshold
// t keeps from (MinKeyAbove).
float MinFloatAbove(long double t) {
  float f = static_cast<float>(t);
  if (static_cast<long double>(f) <= t) {
    f = std::nextafter(f, std::numeric_limits<float>::infinity());
  }
  return f;
}

// Gaussian-k's first threshold mean + z*std of u (sample std), in long
// double: a reference far beyond the rounding of any device's sums.
long double GaussianThresholdOf(const std::vector<float>& u, double z) {
  long double sum = 0.0L;
  for (float x : u) sum += x;
  const long double mean = sum / u.size();
  long double ss = 0.0L;
  for (float x : u) ss += (x - mean) * (x - mean);
  return mean + z * std::sqrt(ss / (u.size() - 1));
}

// Accumulate's parameters for u = residual + lr * gradient: no momentum, no
// weight decay.
UpdateParams PlainUpdate(float lr) {
  UpdateParams up;
  up.lr = lr;
  up.momentum = 0.0f;
  up.weight_decay = 0.0f;
  up.momentum_correction = false;
  return up;
}

// One selection (the selector's method) after Accumulate of `u` into
// `residual`, zeroed first (lr 1: the residual becomes u exactly), on
// `stream`, at `step`: its pairs and info, the zeroing checked exactly.
void StepOnAZeroResidual(CudaSelector* selector, DeviceVector& residual,
                         const std::vector<float>& u, uint64_t k,
                         uint64_t step, cudaStream_t stream, SparseVector* got,
                         SelectInfo* info) {
  const size_t n = u.size();
  const std::vector<float> zeros(n, 0.0f);
  DeviceVector grad(u);
  ASSERT_EQ(cudaMemcpy(residual.buffer.get(), zeros.data(), n * sizeof(float),
                       cudaMemcpyHostToDevice),
            cudaSuccess);
  // (A non-blocking stream does not wait for the legacy stream's copies.)
  ASSERT_EQ(cudaStreamSynchronize(nullptr), cudaSuccess);
  GTOPK_ASSERT_OK(ToAbslStatus(selector->sparsifier()->Accumulate(
      grad.buffer.get(), nullptr, nullptr, nullptr, residual.buffer.get(),
      residual.buffer.get(), n, PlainUpdate(1.0f), stream)));
  GTOPK_ASSERT_OK(selector->SelectDevice(residual.buffer.get(), n, k, step,
                                         stream, true, got));
  *info = selector->last_info();
  ExpectZeroedExactly(residual, u, got->indices);
}

// StepOnAZeroResidual for a selection that must be the exact top-k (exact,
// or a Gaussian-k selection whose rule ends out of range, which must say
// so), checked bit for bit against ReferenceTopK.
void ExactStepOnAZeroResidual(CudaSelector* selector, DeviceVector& residual,
                              const std::vector<float>& u, uint64_t k,
                              uint64_t step, cudaStream_t stream,
                              SelectInfo* info) {
  SparseVector got;
  ASSERT_NO_FATAL_FAILURE(
      StepOnAZeroResidual(selector, residual, u, k, step, stream, &got, info));
  ExpectSameBits(got, ReferenceTopK(u, k));
  if (selector->name() != "exact") {
    EXPECT_TRUE(info->fell_back);
  }
}

// Valid sparse output of u whose selected magnitudes are all >= every
// unselected one (what a threshold selection yields).
void ExpectThresholdSelection(const std::vector<float>& u,
                              const SparseVector& got) {
  ASSERT_TRUE(ValidateSparseVector(got, u.size()).ok());
  std::vector<bool> chosen(u.size(), false);
  uint32_t min_chosen = UINT32_MAX, max_other = 0;
  for (size_t j = 0; j < got.size(); ++j) {
    ASSERT_EQ(FloatBits(got.values[j]), FloatBits(u[got.indices[j]]));
    chosen[got.indices[j]] = true;
    min_chosen = std::min(min_chosen, cpu::MagnitudeKey(got.values[j]));
  }
  for (size_t i = 0; i < u.size(); ++i) {
    if (!chosen[i]) max_other = std::max(max_other, cpu::MagnitudeKey(u[i]));
  }
  if (!got.empty() && got.size() < u.size()) {
    EXPECT_GE(min_chosen, max_other);
  }
}

using Case = std::tuple<Distribution, size_t, double>;

class GpuSelectTest : public GpuTest,
                      public ::testing::WithParamInterface<Case> {};

TEST_P(GpuSelectTest, ExactEqualsReferenceAndZeroesTheResidual) {
  const auto [dist, n, density] = GetParam();
  const std::vector<float> u = MakeInput(dist, n, /*seed=*/n * 7 + 1);
  GTOPK_ASSERT_OK_AND_ASSIGN(const uint64_t k, KFromDensity(density, n));
  GTOPK_ASSERT_OK_AND_ASSIGN(auto selector,
                             CudaSelector::Create("exact", {}, n));
  DeviceVector d(u);
  SparseVector got;
  GTOPK_ASSERT_OK(selector->SelectDevice(d.buffer.get(), n, k, 0, nullptr,
                                         /*zero_selected=*/true, &got));
  const SparseVector want = ReferenceTopK(u, k);
  ExpectSameBits(got, want);
  // The selected residual entries are +0.0, the others untouched.
  ExpectZeroedExactly(d, u, want.indices);
}

TEST_P(GpuSelectTest, GaussianKAndDgcKeepTheirCountContracts) {
  const auto [dist, n, density] = GetParam();
  const std::vector<float> u = MakeInput(dist, n, /*seed=*/n * 11 + 3);
  GTOPK_ASSERT_OK_AND_ASSIGN(const uint64_t k, KFromDensity(density, n));
  for (const char* name : {"gaussiank", "dgc"}) {
    SCOPED_TRACE(name);
    SelectorOptions options;
    options.seed = 42;
    GTOPK_ASSERT_OK_AND_ASSIGN(auto selector,
                               CudaSelector::Create(name, options, n));
    for (uint64_t step = 0; step < 3; ++step) {
      SparseVector got;
      GTOPK_ASSERT_OK(selector->Select(u, k, step, &got));
      EXPECT_GE(got.size(), selector->MinCount(k));
      EXPECT_LE(got.size(), selector->MaxCount(k));
      ExpectThresholdSelection(u, got);
      if (selector->last_info().fell_back) {
        // The exact fallback is the exact top-k.
        ExpectSameBits(got, ReferenceTopK(u, k));
      }
    }
  }
}

// Test names: <input>_n<n>_d<density in units of 1e-4>.
std::string CaseName(const ::testing::TestParamInfo<Case>& info) {
  const double d = std::get<2>(info.param);
  return DistributionName(std::get<0>(info.param)) + "_n" +
         std::to_string(std::get<1>(info.param)) + "_d" +
         std::to_string(static_cast<int>(d * 10000));
}

// The input kinds of the CPU selectors' tests, and issue 15's adversarial
// ones.
const Distribution kInputKinds[] = {
    Distribution::kNormal,    Distribution::kHeavyTailed,
    Distribution::kManyZeros, Distribution::kAllZeros,
    Distribution::kAllEqual,  Distribution::kFewLevels,
    Distribution::kDenormals, Distribution::kAscending,
    Distribution::kSpike};
const Distribution kAdversarialKinds[] = {
    Distribution::kNarrowBand, Distribution::kTies, Distribution::kLaplaceZeros,
    Distribution::kOutliers};

INSTANTIATE_TEST_SUITE_P(
    Inputs, GpuSelectTest,
    ::testing::Combine(
        ::testing::ValuesIn(kInputKinds),
        // n = 1, odd sizes around the 128-entry warp step and the block
        // size, and one above a million.
        ::testing::Values(size_t{1}, size_t{1000}, size_t{4099}, size_t{100003},
                          size_t{(1 << 20) + 7}),
        ::testing::Values(0.001, 0.01, 0.3)),
    CaseName);

// The adversarial inputs of issue 15 at the densities of its targets: every
// path of the exact plan (compaction after one, two or three digits, the
// final compaction over u) and the gaussiank/dgc continuations that fall
// back to it.
INSTANTIATE_TEST_SUITE_P(
    Adversarial, GpuSelectTest,
    ::testing::Combine(
        ::testing::ValuesIn(kAdversarialKinds),
        ::testing::Values(size_t{1}, size_t{4099}, size_t{100003}),
        ::testing::Values(0.0001, 0.01, 0.3)),
    CaseName);

// Sets the smallest n at which exact starts from a sample (a test hook,
// process-wide) while it lives.
class ExactSampleFrom {
 public:
  explicit ExactSampleFrom(uint64_t min_n)
      : saved_(SetExactSampleMinNForTesting(min_n)) {}
  ~ExactSampleFrom() { SetExactSampleMinNForTesting(saved_); }
  ExactSampleFrom(const ExactSampleFrom&) = delete;
  ExactSampleFrom& operator=(const ExactSampleFrom&) = delete;

 private:
  uint64_t saved_;
};

// The same inputs with exact starting from a sample wherever its plan
// allows (the hook lifts the default minimum of 2^22; the plan itself
// needs n above ~16K, so n = 4099 checks that small inputs keep the plan
// over u, and k small enough for its survivors): the sampled
// bound's survivors trimmed (or accepted) on the device, or the plan over
// u when the bound kept fewer than k or more than n/8: always the
// reference, bit for bit, and the residual zeroed exactly there.
class GpuSampledExactTest : public GpuSelectTest {
 protected:
  ExactSampleFrom sample_from_{0};
};

TEST_P(GpuSampledExactTest, ExactFromASampleEqualsTheReference) {
  const auto [dist, n, density] = GetParam();
  const std::vector<float> u = MakeInput(dist, n, /*seed=*/n * 5 + 2);
  GTOPK_ASSERT_OK_AND_ASSIGN(const uint64_t k, KFromDensity(density, n));
  GTOPK_ASSERT_OK_AND_ASSIGN(auto selector,
                             CudaSelector::Create("exact", {}, n));
  for (uint64_t step = 0; step < 2; ++step) {
    SCOPED_TRACE(step);
    DeviceVector d(u);
    SparseVector got;
    GTOPK_ASSERT_OK(selector->SelectDevice(d.buffer.get(), n, k, step,
                                           nullptr, /*zero_selected=*/true,
                                           &got));
    const SparseVector want = ReferenceTopK(u, k);
    ExpectSameBits(got, want);
    ExpectZeroedExactly(d, u, want.indices);
    const SelectInfo info = selector->last_info();
    if (info.exact_sampled) {
      EXPECT_FALSE(info.fell_back);
      EXPECT_TRUE(info.fast_path);
      EXPECT_EQ(info.exact_digit_passes, 0);
      if (info.exact_final_from_u) {
        // Ties at the bound: fewer than k above it, the ties written.
        EXPECT_LT(info.candidates, k);
        EXPECT_FALSE(info.trimmed_on_device);
      } else {
        // The survivors of the bound: at least k, at most n/8.
        EXPECT_GE(info.candidates, k);
        EXPECT_LE(info.candidates, std::max<uint64_t>(1, n / 8));
        EXPECT_EQ(info.trimmed_on_device, info.candidates > k);
      }
    } else {
      EXPECT_GE(info.exact_digit_passes, 1);
    }
    // Normal data at a small density: the sample's bound always holds.
    if (dist == Distribution::kNormal && n >= 100000 && density <= 0.01) {
      EXPECT_TRUE(info.exact_sampled);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Inputs, GpuSampledExactTest,
    ::testing::Combine(
        ::testing::ValuesIn(kInputKinds),
        // 40961: the compaction's warp chunk (a multiple of 128) differs
        // from the final compaction's (of 32), which the write after ties
        // at the bound must not mix up.
        ::testing::Values(size_t{4099}, size_t{40961}, size_t{100003},
                          size_t{(1 << 20) + 7}),
        ::testing::Values(0.0001, 0.001, 0.01)),
    CaseName);

INSTANTIATE_TEST_SUITE_P(
    Adversarial, GpuSampledExactTest,
    ::testing::Combine(
        ::testing::ValuesIn(kAdversarialKinds),
        ::testing::Values(size_t{4099}, size_t{40961}, size_t{100003}),
        ::testing::Values(0.0001, 0.001, 0.002, 0.01)),
    CaseName);

// The exact plan follows the data, and each path equals the reference: on
// normal data one histogram pass over u decides the top digit and the rest
// runs on candidates; on a narrow band (every key shares its top digit) more
// passes over u decide the lower digits before any copy; with ties at the
// k-th key (more than n/8 keys equal to it) the final compaction reads u.
TEST_F(GpuTest, ExactPlanFollowsTheDataAndEveryPathIsExact) {
  const size_t n = 100003;
  struct Expect {
    Distribution dist;
    double density;
    int min_passes, max_passes;
    bool from_u;
  };
  const Expect cases[] = {
      {Distribution::kNormal, 0.001, 1, 1, false},
      {Distribution::kNarrowBand, 0.001, 2, 3, false},
      {Distribution::kTies, 0.01, 3, 3, true},
      {Distribution::kAllEqual, 0.001, 3, 3, true},
  };
  for (const Expect& c : cases) {
    SCOPED_TRACE(DistributionName(c.dist));
    const std::vector<float> u = MakeInput(c.dist, n, 77);
    GTOPK_ASSERT_OK_AND_ASSIGN(const uint64_t k, KFromDensity(c.density, n));
    GTOPK_ASSERT_OK_AND_ASSIGN(auto selector,
                               CudaSelector::Create("exact", {}, n));
    DeviceVector d(u);
    SparseVector got;
    GTOPK_ASSERT_OK(selector->SelectDevice(d.buffer.get(), n, k, 0, nullptr,
                                           /*zero_selected=*/true, &got));
    const SparseVector want = ReferenceTopK(u, k);
    ExpectSameBits(got, want);
    ExpectZeroedExactly(d, u, want.indices);
    EXPECT_GE(selector->last_info().exact_digit_passes, c.min_passes);
    EXPECT_LE(selector->last_info().exact_digit_passes, c.max_passes);
    EXPECT_EQ(selector->last_info().exact_final_from_u, c.from_u);
  }
}

// Select through the Sparsifier on a created stream (graphs apply) and Wait:
// the pairs, the info, and the residual left in `d`.
// Select then Wait on a Sparsifier: the first failed call's status, else
// the pairs and the info.
struct Selected {
  KernelStatus status = KernelStatus::Ok();
  SparseVector pairs;
  SelectInfo info;
};
Selected TrySelect(Sparsifier* sp, float* u, uint64_t n, const SelectParams& p,
                   cudaStream_t stream) {
  Selected out;
  out.status = sp->Select(u, n, p, stream);
  if (!out.status.ok()) return out;
  SelectedPairs sel;
  out.status = sp->Wait(stream, &sel);
  if (!out.status.ok()) return out;
  for (uint64_t j = 0; j < sel.count; ++j) {
    out.pairs.push_back(sel.indices[j], sel.values[j]);
  }
  out.info = sel.info;
  return out;
}
// TrySelect of a device vector, which must succeed.
Selected SelectOnStream(Sparsifier* sp, DeviceVector* d, uint64_t n,
                        const SelectParams& p, cudaStream_t stream) {
  Selected out = TrySelect(sp, d->buffer.get(), n, p, stream);
  EXPECT_TRUE(out.status.ok()) << out.status.message;
  return out;
}

// The starts of the sample's runs of 16 for (seed, step) over n entries
// (dgc's, and the exact top-k's sample): MixSeed(MixSeed(seed, step), run)
// * (n - 15) >> 64, run = 0 .. runs-1 (common/random.h's SplitMix64).
std::vector<uint64_t> SampleRunStarts(uint64_t seed, uint64_t step, size_t n,
                                      uint64_t runs) {
  std::vector<uint64_t> starts;
  const uint64_t stream_seed = MixSeed(seed, step);
  for (uint64_t r = 0; r < runs; ++r) {
    starts.push_back(static_cast<uint64_t>(
        (static_cast<unsigned __int128>(MixSeed(stream_seed, r)) * (n - 15)) >>
        64));
  }
  return starts;
}

// dgc's sample against a plain recomputation: the runs of 16 at
// MixSeed(MixSeed(seed, step), run) * (n - 15) >> 64 (common/random.h's
// SplitMix64), the sample's ceil(k * sample / n)-th largest magnitude as
// threshold, and the survivors (|u| >= it) counted over u. The device must
// keep exactly that many, step after step, on a created stream (a replayed
// graph must read each step's seed when it runs) and the legacy stream,
// with two seeds; accepted survivors are the selection itself.
TEST_F(GpuTest, DgcSamplesTheRunsOfItsSeedAndStep) {
  const size_t n = 100003;
  const uint64_t k = 1000;
  const double fraction = 0.01;
  const std::vector<float> u = MakeInput(Distribution::kNormal, n, 81);
  auto key = [](float x) { return FloatBits(x) & 0x7fffffffu; };
  const uint64_t runs = (static_cast<uint64_t>(std::ceil(fraction * n)) + 15) / 16;
  const uint64_t sample_k = static_cast<uint64_t>(
      std::ceil(static_cast<double>(runs * 16) * k / static_cast<double>(n)));
  cudaStream_t created = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&created, cudaStreamNonBlocking),
            cudaSuccess);
  std::set<uint64_t> distinct;
  for (cudaStream_t stream : {created, static_cast<cudaStream_t>(nullptr)}) {
    SCOPED_TRACE(stream == nullptr ? "legacy stream" : "created stream");
    std::unique_ptr<Sparsifier> sp;
    ASSERT_TRUE(Sparsifier::Create(n, &sp).ok());
    DeviceVector d(u);
    for (uint64_t seed : {uint64_t{3}, uint64_t{1234567}}) {
      for (uint64_t step = 0; step < 5; ++step) {
        SCOPED_TRACE("seed " + std::to_string(seed) + " step " +
                     std::to_string(step));
        std::vector<uint32_t> sample;
        for (uint64_t start : SampleRunStarts(seed, step, n, runs)) {
          for (uint64_t j = 0; j < 16; ++j) sample.push_back(key(u[start + j]));
        }
        std::sort(sample.begin(), sample.end(), std::greater<uint32_t>());
        const uint32_t threshold = sample[sample_k - 1];
        uint64_t survivors = 0;
        for (float x : u) survivors += key(x) >= threshold;
        SelectParams p;
        p.method = Method::kDgc;
        p.k = k;
        p.seed = seed;
        p.step = step;
        p.dgc_sample_fraction = fraction;
        p.zero_selected = false;  // u stays the same for every step
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        const Selected got = SelectOnStream(sp.get(), &d, n, p, stream);
        EXPECT_EQ(got.info.candidates, survivors);
        if (survivors <= k) {
          ASSERT_EQ(got.pairs.size(), survivors);
          for (size_t j = 0; j < got.pairs.size(); ++j) {
            EXPECT_GE(key(got.pairs.values[j]), threshold);
          }
        }
        distinct.insert(survivors);
      }
    }
  }
  ASSERT_EQ(cudaStreamDestroy(created), cudaSuccess);
  EXPECT_GT(distinct.size(), 3u) << "the steps all sampled alike";
}

// CUDA graphs: the first Select of a (method, u, n, k, ...) captures, the
// next ones replay, and every replay selects what a direct enqueue selects
// (exact: the reference, bit for bit; gaussiank and dgc: the same pairs as
// a Sparsifier with graphs off), on inputs whose plans differ (the plan is
// decided on the device, so one graph serves every input). Each Select is
// a new step: dgc's replayed graph samples that step's runs. A new k or a
// regrown pinned buffer gets a new capture, never a stale graph (the
// emulator fails on a copy into freed pinned memory).
TEST_F(GpuTest, GraphReplaysSelectLikeDirectEnqueue) {
  const size_t n = 100003;
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking),
            cudaSuccess);
  std::unique_ptr<Sparsifier> graphed, direct;
  ASSERT_TRUE(Sparsifier::Create(n, &graphed).ok());
  ASSERT_TRUE(Sparsifier::Create(n, &direct).ok());
  direct->set_use_graphs(false);
  const Distribution inputs[] = {Distribution::kNormal,
                                 Distribution::kNarrowBand, Distribution::kTies,
                                 Distribution::kNormal};
  for (Method method : {Method::kExact, Method::kGaussianK, Method::kDgc}) {
    SCOPED_TRACE(MethodName(method));
    for (uint64_t k : {uint64_t{100}, uint64_t{1000}, uint64_t{100}}) {
      SCOPED_TRACE(k);
      SelectParams p;
      p.method = method;
      p.k = k;
      p.zero_selected = true;
      // One device buffer per (method, k) run: the graph is keyed on it.
      DeviceVector d(std::vector<float>(n, 0.0f));
      int replays = 0;
      for (size_t i = 0; i < std::size(inputs); ++i) {
        SCOPED_TRACE(DistributionName(inputs[i]));
        const std::vector<float> u = MakeInput(inputs[i], n, 300 + i);
        ASSERT_EQ(cudaMemcpy(d.buffer.get(), u.data(), n * sizeof(float),
                             cudaMemcpyHostToDevice),
                  cudaSuccess);
        // The copy ran on the legacy default stream, which the non-blocking
        // `stream` does not wait for.
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        p.step = i;
        p.seed = 11;
        const Selected got = SelectOnStream(graphed.get(), &d, n, p, stream);
        replays += got.info.graph_replay ? 1 : 0;
        if (i == 0) {
          EXPECT_FALSE(got.info.graph_replay);
        }
        DeviceVector d2(u);
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        const Selected want = SelectOnStream(direct.get(), &d2, n, p, stream);
        EXPECT_FALSE(want.info.graph_replay);
        ExpectSameBits(got.pairs, want.pairs);
        EXPECT_EQ(got.info.fast_path, want.info.fast_path);
        EXPECT_EQ(got.info.corrected_on_device,
                  want.info.corrected_on_device);
        EXPECT_EQ(got.info.adjustments, want.info.adjustments);
        EXPECT_EQ(got.info.exact_digit_passes, want.info.exact_digit_passes);
        ASSERT_NO_FATAL_FAILURE(ExpectZeroedExactly(d, u, got.pairs.indices));
        if (method == Method::kExact) {
          ExpectSameBits(got.pairs, ReferenceTopK(u, k));
        }
      }
      // Every Select after the first of this (u, k) replayed, except after
      // the pinned buffers grew (k = 1000 after 100: a new capture),
      // gaussiank's and dgc's second capture once they expect the exact
      // top-k from u (after narrow_band or ties), and gaussiank's third
      // once its own histogram pass counts the ties its last fallback
      // predicted (after ties at k = 1000, density 0.01).
      EXPECT_GE(replays, static_cast<int>(std::size(inputs)) -
                             (method == Method::kExact       ? 1
                              : method == Method::kGaussianK ? 3
                                                             : 2));
    }
  }
  // The legacy default stream cannot capture: a direct enqueue, correct.
  const std::vector<float> u = MakeInput(Distribution::kNormal, n, 9);
  DeviceVector d(u);
  SelectParams p;
  p.k = 77;
  p.zero_selected = true;
  const Selected legacy = SelectOnStream(graphed.get(), &d, n, p, nullptr);
  EXPECT_FALSE(legacy.info.graph_replay);
  ExpectSameBits(legacy.pairs, ReferenceTopK(u, 77));
  ASSERT_EQ(cudaStreamDestroy(stream), cudaSuccess);
}

// Large grids: on an H200-sized grid (132 SMs: up to 1024 blocks) the last
// block of each compaction pass scans the blocks' counts in tiles of 256
// (the carry between tiles matters): n just under 512 blocks of 4096
// entries gives 2 tiles for the compaction of u, n above 1024 blocks gives
// 4, and the final compaction's grid (n / 1024 blocks, at most 1024) 4.
// Densities up to 0.3 move the k-th key (and dgc's survivors, trimmed to
// the exact top-k when more than k).
TEST_F(GpuTest, LargeGridsMatchTheReference) {
  const std::vector<std::pair<size_t, std::vector<double>>> cases = {
      {size_t{2} * 1024 * 1024 - 4099, {0.001, 0.05, 0.1, 0.3}},
      {size_t{4} * 1024 * 1024 + 4099, {0.001}}};
  for (const auto& [n, densities] : cases) {
    const std::vector<float> u = MakeInput(Distribution::kNormal, n, n);
    for (const double density : densities) {
      SCOPED_TRACE(::testing::Message() << "n " << n << " density " << density);
      GTOPK_ASSERT_OK_AND_ASSIGN(const uint64_t k, KFromDensity(density, n));
      const SparseVector want = ReferenceTopK(u, k);
      for (const char* name : {"exact", "gaussiank", "dgc"}) {
        SCOPED_TRACE(name);
        GTOPK_ASSERT_OK_AND_ASSIGN(auto selector,
                                   CudaSelector::Create(name, {}, n));
        SparseVector got;
        GTOPK_ASSERT_OK(selector->Select(u, k, 0, &got));
        if (std::string(name) == "exact" || selector->last_info().fell_back ||
            selector->last_info().trimmed_on_device) {
          ExpectSameBits(got, want);
        } else {
          EXPECT_GE(got.size(), selector->MinCount(k));
          EXPECT_LE(got.size(), selector->MaxCount(k));
          ExpectThresholdSelection(u, got);
        }
      }
    }
  }
}

// gaussiank finishes on the device when the compaction's count is in
// range, and on the host otherwise; dgc always on the device here (at most
// k survivors accepted, more trimmed there); all give valid selections. On
// normal data Gaussian-k's first threshold fits; on the spike no
// adjustment lands in range and the exact fallback runs from Wait; DGC's
// sampled threshold leaves at most k survivors on some steps and more (but
// fewer than n/8) on others, and those are trimmed to the exact top-k.
TEST_F(GpuTest, FastPathAndHostContinuationBothSelectCorrectly) {
  const size_t n = 100003;
  const uint64_t k = 1000;
  const std::vector<float> normal = MakeInput(Distribution::kNormal, n, 21);
  const std::vector<float> spike = MakeInput(Distribution::kSpike, n, 22);
  SelectorOptions options;
  options.seed = 5;
  int fast = 0, slow = 0, accepted = 0, trimmed = 0;
  for (const char* name : {"gaussiank", "dgc"}) {
    SCOPED_TRACE(name);
    const bool dgc = std::string(name) == "dgc";
    GTOPK_ASSERT_OK_AND_ASSIGN(auto selector,
                               CudaSelector::Create(name, options, n));
    for (const std::vector<float>* u : {&normal, &spike}) {
      for (uint64_t step = 0; step < 8; ++step) {
        DeviceVector d(*u);
        SparseVector got;
        GTOPK_ASSERT_OK(selector->SelectDevice(d.buffer.get(), n, k, step,
                                               nullptr, true, &got));
        EXPECT_GE(got.size(), selector->MinCount(k));
        EXPECT_LE(got.size(), selector->MaxCount(k));
        ExpectThresholdSelection(*u, got);
        ASSERT_NO_FATAL_FAILURE(ExpectZeroedExactly(d, *u, got.indices));
        const SelectInfo info = selector->last_info();
        if (!dgc) {
          (info.fast_path ? fast : slow)++;
          if (u == &normal) {
            EXPECT_TRUE(info.fast_path) << "step " << step;
          }
          EXPECT_FALSE(info.trimmed_on_device);
          continue;
        }
        EXPECT_TRUE(info.fast_path) << "dgc continued on the host, step "
                                    << step;
        EXPECT_EQ(info.trimmed_on_device, info.candidates > k);
        if (info.trimmed_on_device) {
          ++trimmed;
          EXPECT_LE(info.candidates, n / 8);
          ExpectSameBits(got, ReferenceTopK(*u, k));
        } else {
          ++accepted;
          EXPECT_EQ(got.size(), info.candidates);
        }
      }
    }
  }
  EXPECT_GT(fast, 0) << "gaussiank never finished on the device";
  EXPECT_GT(slow, 0) << "gaussiank never continued on the host";
  EXPECT_GT(accepted, 0) << "dgc never accepted its survivors";
  EXPECT_GT(trimmed, 0) << "dgc never trimmed on the device";
}

// dgc's trim on the device against the reference: whenever more than k
// (and at most n/8) entries survive the sampled threshold, the selection
// is the exact top-k of u (lower index first among ties at the k-th key),
// bit for bit, the selected residual entries are zeroed and nothing else;
// on inputs with ties at the k-th key (few levels), a narrow band, and
// grids from one warp up, on a created stream (graphs replayed with a new
// step's sample) and the legacy stream.
TEST_F(GpuTest, DgcTrimsToTheExactTopKOnTheDevice) {
  struct Case {
    Distribution dist;
    size_t n;
    uint64_t k;
  };
  const Case cases[] = {
      {Distribution::kNormal, 100003, 1000},
      {Distribution::kNormal, 4099, 4},
      {Distribution::kHeavyTailed, 100003, 100},
      {Distribution::kFewLevels, 100003, 1000},
      {Distribution::kNarrowBand, 100003, 100},
      {Distribution::kLaplaceZeros, 70001, 700},
      {Distribution::kDenormals, 20011, 20},
  };
  cudaStream_t created = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&created, cudaStreamNonBlocking),
            cudaSuccess);
  int trimmed = 0, tied = 0;
  for (const Case& c : cases) {
    SCOPED_TRACE(DistributionName(c.dist) + " n=" + std::to_string(c.n) +
                 " k=" + std::to_string(c.k));
    const std::vector<float> u = MakeInput(c.dist, c.n, c.n + 71);
    const SparseVector want = ReferenceTopK(u, c.k);
    // Ties at the k-th key: the tie-break decides which of them are taken.
    uint32_t kth_key = ~0u;
    for (float v : want.values) {
      kth_key = std::min(kth_key, FloatBits(v) & 0x7fffffffu);
    }
    size_t at_kth = 0;
    for (float v : u) at_kth += (FloatBits(v) & 0x7fffffffu) == kth_key;
    for (cudaStream_t stream : {created, static_cast<cudaStream_t>(nullptr)}) {
      SCOPED_TRACE(stream == nullptr ? "legacy stream" : "created stream");
      SelectorOptions options;
      options.seed = 9;
      GTOPK_ASSERT_OK_AND_ASSIGN(auto selector,
                                 CudaSelector::Create("dgc", options, c.n));
      for (uint64_t step = 0; step < 6; ++step) {
        SCOPED_TRACE("step " + std::to_string(step));
        DeviceVector d(u);
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        SparseVector got;
        GTOPK_ASSERT_OK(selector->SelectDevice(d.buffer.get(), c.n, c.k, step,
                                               stream, true, &got));
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        const SelectInfo info = selector->last_info();
        ASSERT_NO_FATAL_FAILURE(ExpectZeroedExactly(d, u, got.indices));
        if (info.candidates <= c.k || info.candidates > c.n / 8) {
          EXPECT_FALSE(info.trimmed_on_device);
          continue;
        }
        EXPECT_TRUE(info.trimmed_on_device);
        EXPECT_TRUE(info.fast_path);
        ExpectSameBits(got, want);
        ++trimmed;
        tied += at_kth > 1;
      }
    }
  }
  ASSERT_EQ(cudaStreamDestroy(created), cudaSuccess);
  EXPECT_GT(trimmed, 20) << "too few trims to test them";
  EXPECT_GT(tied, 0) << "no trim with ties at the k-th key";
}

// zero_selected with the threshold selectors: the selected entries of the
// residual become +0.0 and nothing else changes, whichever path (threshold
// survivors gathered directly, or an exact pass over them) made the selection.
TEST_F(GpuTest, GaussianKAndDgcZeroExactlyTheSelectedResidualEntries) {
  const size_t n = 100003;
  for (const char* name : {"gaussiank", "dgc"}) {
    for (Distribution dist : {Distribution::kNormal, Distribution::kHeavyTailed,
                              Distribution::kFewLevels}) {
      for (double density : {0.001, 0.01}) {
        SCOPED_TRACE(std::string(name) + " " + DistributionName(dist) + " " +
                     std::to_string(density));
        const std::vector<float> u = MakeInput(dist, n, /*seed=*/n + 5);
        GTOPK_ASSERT_OK_AND_ASSIGN(const uint64_t k, KFromDensity(density, n));
        SelectorOptions options;
        options.seed = 3;
        GTOPK_ASSERT_OK_AND_ASSIGN(auto selector,
                                   CudaSelector::Create(name, options, n));
        DeviceVector d(u);
        SparseVector got;
        GTOPK_ASSERT_OK(selector->SelectDevice(d.buffer.get(), n, k, 0,
                                               nullptr, /*zero_selected=*/true,
                                               &got));
        ASSERT_FALSE(got.empty());
        ExpectThresholdSelection(u, got);
        ASSERT_NO_FATAL_FAILURE(ExpectZeroedExactly(d, u, got.indices));
      }
    }
  }
}

TEST_F(GpuTest, ExactForEveryKOfASmallInput) {
  const size_t n = 257;
  const std::vector<float> u = MakeInput(Distribution::kFewLevels, n, 5);
  GTOPK_ASSERT_OK_AND_ASSIGN(auto selector,
                             CudaSelector::Create("exact", {}, n));
  for (uint64_t k = 1; k <= n; ++k) {
    SparseVector got;
    GTOPK_ASSERT_OK(selector->Select(u, k, 0, &got));
    ExpectSameBits(got, ReferenceTopK(u, k));
  }
}

// Magnitudes that differ only in the last radix digit (bits 8..0), each of
// its 512 values four times, so the level-2 histogram decides every k; one
// selector for all k, so a histogram bin left over from the previous
// selection changes the result (device memory is only zeroed at creation).
// gaussiank and dgc at every k of a small input, up to k = n: their count
// contracts and threshold property hold on every path, including densities
// above 3/4 where Gaussian-k's upper count bound floor(4k/3) exceeds n.
TEST_F(GpuTest, GaussianKAndDgcForEveryKOfASmallInput) {
  const size_t n = 257;
  const std::vector<float> u = MakeInput(Distribution::kNormal, n, 6);
  for (const char* name : {"gaussiank", "dgc"}) {
    SCOPED_TRACE(name);
    GTOPK_ASSERT_OK_AND_ASSIGN(auto selector,
                               CudaSelector::Create(name, {}, n));
    for (uint64_t k = 1; k <= n; ++k) {
      SCOPED_TRACE(::testing::Message() << "k " << k);
      SparseVector got;
      GTOPK_ASSERT_OK(selector->Select(u, k, k, &got));
      EXPECT_GE(got.size(), selector->MinCount(k));
      EXPECT_LE(got.size(), std::min<uint64_t>(selector->MaxCount(k), n));
      ExpectThresholdSelection(u, got);
      if (selector->last_info().fell_back) {
        ExpectSameBits(got, ReferenceTopK(u, k));
      }
    }
  }
}

// A failed runtime call elsewhere leaves an error in CUDA's last-error state;
// the selector's launch checks must not report it as their own.
TEST_F(GpuTest, AnUnrelatedFailedCudaCallDoesNotFailTheNextSelection) {
  const size_t n = 4099;
  const std::vector<float> u = MakeInput(Distribution::kNormal, n, 8);
  GTOPK_ASSERT_OK_AND_ASSIGN(auto selector,
                             CudaSelector::Create("exact", {}, n));
  void* p = nullptr;
  ASSERT_NE(cudaMalloc(&p, size_t{1} << 50), cudaSuccess);  // 1 PiB
  SparseVector got;
  GTOPK_ASSERT_OK(selector->Select(u, 41, 0, &got));
  ExpectSameBits(got, ReferenceTopK(u, 41));
}

// Same input, same selection, every run: Gaussian-k's mean and std come
// from per-block partial sums added in a fixed order (not double atomics,
// whose order follows block timing on a GPU).
TEST_F(GpuTest, GaussianKIsDeterministicAcrossRuns) {
  const size_t n = (1 << 20) + 7;
  const std::vector<float> u = MakeInput(Distribution::kHeavyTailed, n, 31);
  SparseVector first;
  for (int run = 0; run < 3; ++run) {
    GTOPK_ASSERT_OK_AND_ASSIGN(auto selector,
                               CudaSelector::Create("gaussiank", {}, n));
    SparseVector got;
    GTOPK_ASSERT_OK(selector->Select(u, 1049, 0, &got));
    if (run == 0) {
      first = got;
    } else {
      ExpectSameBits(got, first);
    }
  }
  // The same u made by the fused update (residual 0 + 1 * gradient) and
  // selected from its histogram: the same sums, hence the same selection.
  GTOPK_ASSERT_OK_AND_ASSIGN(auto selector,
                             CudaSelector::Create("gaussiank", {}, n));
  DeviceVector grad(u), residual(std::vector<float>(n, 0.0f));
  const UpdateParams up = PlainUpdate(1.0f);
  GTOPK_ASSERT_OK(ToAbslStatus(selector->sparsifier()->Accumulate(
      grad.buffer.get(), nullptr, nullptr, nullptr, residual.buffer.get(),
      residual.buffer.get(), n, up, nullptr)));
  SparseVector fused;
  GTOPK_ASSERT_OK(selector->SelectDevice(residual.buffer.get(), n, 1049, 0,
                                         nullptr, false, &fused));
  EXPECT_TRUE(selector->last_info().used_update_histogram);
  EXPECT_EQ(fused.indices, first.indices);
  ASSERT_EQ(fused.values.size(), first.values.size());
  for (size_t j = 0; j < fused.values.size(); ++j) {
    EXPECT_EQ(fused.values[j], first.values[j]) << j;  // -0.0 becomes +0.0
  }
}

TEST_F(GpuTest, RepeatedSelectionsOnOneSelectorResetEveryHistogramBin) {
  const size_t n = 4 * 512;
  std::vector<float> u(n);
  for (size_t i = 0; i < n; ++i) {
    const uint32_t bits = FloatBits(1.0f) | static_cast<uint32_t>(i * 37 % 512);
    std::memcpy(&u[i], &bits, sizeof(bits));
    if (i % 2 == 1) u[i] = -u[i];
  }
  GTOPK_ASSERT_OK_AND_ASSIGN(auto selector,
                             CudaSelector::Create("exact", {}, n));
  for (uint64_t k : {1, 4, 5, 10, 100, 1000, 2047, 3, 9}) {
    SCOPED_TRACE(k);
    SparseVector got;
    GTOPK_ASSERT_OK(selector->Select(u, k, 0, &got));
    ExpectSameBits(got, ReferenceTopK(u, k));
  }
}

TEST_F(GpuTest, FusedUpdateMatchesTheCpuRuleBitForBitAndFeedsSelection) {
  const size_t n = 300007;
  OptimizerOptions o;
  o.lr = 0.05f;
  o.momentum = 0.9f;
  o.weight_decay = 1e-4f;
  GTOPK_ASSERT_OK_AND_ASSIGN(const OptimizerRule rule,
                             OptimizerRule::Create(o));
  const std::vector<float> grad = MakeInput(Distribution::kHeavyTailed, n, 1);
  const std::vector<float> params = MakeInput(Distribution::kNormal, n, 2);
  std::vector<float> velocity = MakeInput(Distribution::kNormal, n, 3);
  std::vector<float> residual = MakeInput(Distribution::kManyZeros, n, 4);
  DeviceVector d_grad(grad), d_params(params), d_velocity(velocity),
      d_residual(residual);
  GTOPK_ASSERT_OK(rule.AccumulateLocal(
      0, grad, params, absl::MakeSpan(velocity), absl::MakeSpan(residual)));
  GTOPK_ASSERT_OK_AND_ASSIGN(auto selector,
                             CudaSelector::Create("exact", {}, n));
  UpdateParams up;
  up.lr = rule.LrAt(0);
  up.momentum = o.momentum;
  up.weight_decay = o.weight_decay;
  up.momentum_correction = true;
  GTOPK_ASSERT_OK(ToAbslStatus(selector->sparsifier()->Accumulate(
      d_grad.buffer.get(), d_params.buffer.get(), d_velocity.buffer.get(),
      d_velocity.buffer.get(), d_residual.buffer.get(), d_residual.buffer.get(),
      n, up, nullptr)));
  const std::vector<float> gpu_velocity = d_velocity.ToHost(n);
  const std::vector<float> gpu_residual = d_residual.ToHost(n);
  for (size_t i = 0; i < n; ++i) {
    ASSERT_EQ(FloatBits(gpu_velocity[i]), FloatBits(velocity[i])) << i;
    ASSERT_EQ(FloatBits(gpu_residual[i]), FloatBits(residual[i])) << i;
  }
  const uint64_t k = 300;
  SparseVector got;
  GTOPK_ASSERT_OK(selector->SelectDevice(d_residual.buffer.get(), n, k, 0,
                                         nullptr, true, &got));
  EXPECT_TRUE(selector->last_info().used_update_histogram);
  ExpectSameBits(got, ReferenceTopK(residual, k));
}

// The exact top-k after Accumulate takes its candidates from the fused
// update's own compaction, at a digit-0 bin predicted from the previous
// such selection of the same n (SelectInfo::candidates_from_update): no
// pass over u at all. The reference is the update and the top-k in plain
// loops: u = r + lr * g (no momentum, so each float op is the CPU rule's),
// ReferenceTopK, the selected entries zeroed; bit for bit, every step.
// Steps where the prediction cannot hold (u scaled down 4x: the k-th key
// falls two binades under the predicted bin; another n in between, whose
// selection predicts for its own n; ties and all-equal inputs, whose k-th
// bin holds more than n/32 keys) must take the compaction pass and still
// be right.
TEST_F(GpuTest, ExactAfterUpdateTakesTheUpdatesCandidates) {
  struct Step {
    float scale;   // residual and gradient scaled by it in this step
    bool other_n;  // an exact selection after Accumulate on another n first
    int expect;    // candidates_from_update: 1, 0, or -1 (either)
  };
  const std::vector<Step> steps = {
      {1.0f, false, 0},  // no prediction yet
      {1.0f, false, 1},        {1.0f, false, 1},
      {1.0f / 16, false, 0},   // the k-th key falls 4 binades under the bin
      {1.0f, false, -1},       // predicted far below: most of u kept
      {1.0f, false, 1},        {1.0f, true, 0},  // predicted for the other n
      {1.0f, false, 1},
  };
  const UpdateParams up = PlainUpdate(0.5f);
  for (const size_t n : {size_t{4099}, size_t{100003}, size_t{300007}}) {
    for (const double density : {0.001, 0.01}) {
      for (const Distribution dist :
           {Distribution::kNormal, Distribution::kHeavyTailed,
            Distribution::kLaplaceZeros, Distribution::kTies,
            Distribution::kAllEqual}) {
        SCOPED_TRACE(DistributionName(dist) + " n=" + std::to_string(n) +
                     " density=" + std::to_string(density));
        GTOPK_ASSERT_OK_AND_ASSIGN(const uint64_t k,
                                   KFromDensity(density, n));
        const size_t other = n + 1001;  // above the one-block bound too
        GTOPK_ASSERT_OK_AND_ASSIGN(auto selector,
                                   CudaSelector::Create("exact", {}, other));
        Sparsifier* sp = selector->sparsifier();
        std::vector<float> residual(n, 0.0f);
        DeviceVector d_residual(residual);
        const std::vector<float> other_grad =
            MakeInput(Distribution::kNormal, other, 5);
        for (size_t t = 0; t < steps.size(); ++t) {
          SCOPED_TRACE("step " + std::to_string(t));
          if (steps[t].other_n) {
            DeviceVector g(other_grad), r(std::vector<float>(other, 0.0f));
            GTOPK_ASSERT_OK(ToAbslStatus(sp->Accumulate(
                g.buffer.get(), nullptr, nullptr, nullptr, r.buffer.get(),
                r.buffer.get(), other, up, nullptr)));
            SparseVector other_got;
            GTOPK_ASSERT_OK(selector->SelectDevice(
                r.buffer.get(), other, std::max<uint64_t>(1, k / 2), 0,
                nullptr, true, &other_got));
            ASSERT_TRUE(selector->last_info().used_update_histogram);
          }
          std::vector<float> grad = MakeInput(dist, n, 100 * t + n);
          if (steps[t].scale != 1.0f) {
            for (float& r : residual) r *= steps[t].scale;
            for (float& g : grad) g *= steps[t].scale;
            ASSERT_EQ(cudaMemcpy(d_residual.buffer.get(), residual.data(),
                                 n * sizeof(float), cudaMemcpyHostToDevice),
                      cudaSuccess);
          }
          DeviceVector d_grad(grad);
          GTOPK_ASSERT_OK(ToAbslStatus(sp->Accumulate(
              d_grad.buffer.get(), nullptr, nullptr, nullptr,
              d_residual.buffer.get(), d_residual.buffer.get(), n, up,
              nullptr)));
          for (size_t i = 0; i < n; ++i) {
            const float step = up.lr * grad[i];
            residual[i] = residual[i] + step;
          }
          SparseVector got;
          GTOPK_ASSERT_OK(selector->SelectDevice(d_residual.buffer.get(), n, k,
                                                 t, nullptr, true, &got));
          const SelectInfo& info = selector->last_info();
          EXPECT_TRUE(info.used_update_histogram);
          const SparseVector want = ReferenceTopK(residual, k);
          ExpectSameBits(got, want);
          ExpectZeroedExactly(d_residual, residual, want.indices);
          for (uint32_t i : want.indices) residual[i] = 0.0f;
          if (dist == Distribution::kAllEqual) {
            // Every |u| in one or two bins: nothing is ever predicted.
            EXPECT_FALSE(info.candidates_from_update);
          } else if (dist != Distribution::kTies && k >= 40 &&
                     steps[t].expect >= 0) {
            // (The k-th of a handful of heavy-tailed keys can move more
            // than the bin's margin between steps, and ties may or may not
            // leave the k-th bin small: either way is right.)
            EXPECT_EQ(info.candidates_from_update, steps[t].expect == 1);
          }
          if (info.candidates_from_update) {
            EXPECT_GE(info.candidates, k);
            EXPECT_LE(info.candidates, n / 8);
          }
        }
      }
    }
  }
}

// Exact after Accumulate on inputs whose plan needs more than one pass over
// u (the k-th key's digit-0 bin holds more than n/8 keys: the narrow band,
// every value equal, ties at density 0.01), and whose magnitudes grow by
// 2 % a step, so that the key the plan predicts for the next update
// (finer than a bin, or the k-th key with its ties) always misses: after
// the first miss the next such step starts from a sample instead (one
// pass), and every 8th runs the plan again (whose prediction the step
// after it tries); when the input turns normal, the next plan finds one
// pass enough and the step after it takes the update's candidates. Each step is
// Accumulate of a fresh input into a zero residual, then Select with
// zeroing, checked bit for bit against ReferenceTopK and the zeroing
// exactly; on a created stream (graph replay) and the legacy stream. (The
// sampled path's minimum n is lowered to 1 by the test hook.)
TEST_F(GpuTest, ExactAfterUpdateOnAManyPassInputStartsFromASample) {
  const ExactSampleFrom sample_from(1);
  const size_t n = 100003;
  struct Sequence {
    Distribution first;  // steps 0..9
    Distribution then;   // steps 10..23
    double density;
    bool many_pass;  // `first` needs more than one pass over u
  };
  const Sequence sequences[] = {
      {Distribution::kNarrowBand, Distribution::kNormal, 0.001, true},
      {Distribution::kAllEqual, Distribution::kNormal, 0.01, true},
      {Distribution::kTies, Distribution::kNormal, 0.01, true},
      {Distribution::kNormal, Distribution::kNormal, 0.001, false},
  };
  cudaStream_t created = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&created, cudaStreamNonBlocking),
            cudaSuccess);
  int replayed = 0;
  for (const Sequence& q : sequences) {
    for (cudaStream_t stream : {created, static_cast<cudaStream_t>(nullptr)}) {
      SCOPED_TRACE(DistributionName(q.first) + " then " +
                   DistributionName(q.then) +
                   " density=" + std::to_string(q.density) +
                   (stream == nullptr ? " legacy stream" : " created stream"));
      GTOPK_ASSERT_OK_AND_ASSIGN(const uint64_t k, KFromDensity(q.density, n));
      GTOPK_ASSERT_OK_AND_ASSIGN(auto selector,
                                 CudaSelector::Create("exact", {}, n));
      const std::vector<float> zeros(n, 0.0f);
      DeviceVector residual(zeros);
      int sampled_first = 0, back_on_plan = -1, first_from_update = -1;
      for (int t = 0; t < 24; ++t) {
        SCOPED_TRACE("step " + std::to_string(t));
        SelectInfo info;
        std::vector<float> u =
            MakeInput(t < 10 ? q.first : q.then, n, 31 * t + 7);
        if (t < 10 && q.many_pass) {
          for (float& x : u) x *= 1.0f + 0.02f * static_cast<float>(t);
        }
        ExactStepOnAZeroResidual(selector.get(), residual, u, k, t, stream,
                                 &info);
        replayed += info.graph_replay;
        // A sampled step skipped the update's histogram; a plan used it.
        EXPECT_EQ(info.sampled_after_update, !info.used_update_histogram);
        if (info.sampled_after_update) {
          EXPECT_TRUE(info.exact_sampled);
          EXPECT_GT(t, 0);
          if (t < 10) ++sampled_first;
          // Never after a plan that needed one pass.
          EXPECT_LT(back_on_plan, 0);
        } else {
          if (t >= 10 && back_on_plan < 0) back_on_plan = t;
          if (t < 10 && q.many_pass) {
            EXPECT_TRUE(info.exact_digit_passes > 1 || info.exact_final_from_u)
                << info.exact_digit_passes;
          }
          if (info.candidates_from_update && first_from_update < 0) {
            first_from_update = t;
          }
        }
      }
      if (q.many_pass) {
        // Step 1 tries step 0's prediction (and misses); steps 2..8 are
        // sampled; step 9 retries the plan.
        EXPECT_EQ(sampled_first, 7);
        // Back on the plan at a retry within 8 steps of the change, and on
        // the update's candidates from the step after it.
        EXPECT_GE(back_on_plan, 10);
        EXPECT_LE(back_on_plan, 18);
        EXPECT_GE(first_from_update, 10);
        EXPECT_LE(first_from_update, 19);
      } else {
        EXPECT_EQ(sampled_first, 0);
        EXPECT_EQ(first_from_update, 1);
      }
    }
  }
  EXPECT_EQ(cudaStreamDestroy(created), cudaSuccess);
  EXPECT_GT(replayed, 0);
}

// |x| uniform in [1, 1 + width) with random signs: width 1/8 fills one
// digit-0 bin (an eighth of a binade) evenly; 0.0005 is the narrow band
// (about 4,200 keys shared by all of u).
std::vector<float> UniformBand(size_t n, float width, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> unit(0.0f, 1.0f);
  std::vector<float> x(n);
  for (float& v : x) {
    v = (unit(rng) < 0.5f ? -1.0f : 1.0f) * (1.0f + width * unit(rng));
  }
  return x;
}

// Exact after Accumulate on an input whose k-th key's digit-0 bin holds
// more than n/32 keys: no bin can be predicted, so the plan, which needs
// several passes over u, predicts a finer key under the k-th one from its
// digit-1 and digit-2 histograms: a digit-1 bin's first key on one bin
// filled evenly, a single key on the narrow band (also under a few larger
// keys, which the counts include). The next steps' updates
// keep the keys at or above it, and each plan takes them: one digit pass
// (the update's), no pass over u, at least k candidates and at most
// min(4k, n/32) on the u the key came from (at least half of that: the
// key is the lowest within the limit), and a new key from them (at or
// above the one they were kept from: their counts are exact from there
// only). Where more than that many keys equal the k-th key K itself
// (every value equal; ties at density 0.01), the prediction is K with its
// ties: the update keeps the keys > K and counts those == K, and the next
// step, whose k-th key is K again, writes the kept keys and the first
// ties on the update's layout (candidates_from_update with
// exact_final_from_u; fewer than k candidates). A drop of 1 % moves the
// k-th key under the prediction: that step runs the plan over u, and the
// next ones start from a sample. Then ties whose keys above K become more
// than k: the update's keys > K are the candidates of an ordinary plan.
// Every step is Accumulate of a fresh input into a zero residual, then
// Select with zeroing, checked bit for bit against ReferenceTopK and the
// zeroing exactly; on a created stream (graph replay) and the legacy
// stream.
TEST_F(GpuTest, ExactAfterUpdateOnACrowdedBinPredictsAFinerKey) {
  const ExactSampleFrom sample_from(1);
  cudaStream_t created = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&created, cudaStreamNonBlocking),
            cudaSuccess);
  struct Input {
    std::string name;
    std::function<std::vector<float>(size_t, uint64_t)> make;
    bool ties;  // K is predicted with its ties
  };
  const std::vector<Input> inputs = {
      {"even bin",
       [](size_t n, uint64_t seed) { return UniformBand(n, 0.125f, seed); },
       false},
      {"narrow band",
       [](size_t n, uint64_t seed) { return UniformBand(n, 0.0005f, seed); },
       false},
      // Fewer than k keys in higher digit-0 bins: the prediction counts
      // them too.
      {"narrow band under larger keys",
       [](size_t n, uint64_t seed) {
         std::vector<float> u = UniformBand(n, 0.0005f, seed);
         for (size_t i = 1999; i < n; i += 2000) {
           u[i] = (i % 3 ? 3.0f : -3.0f) + static_cast<float>(i) * 1e-6f;
         }
         return u;
       },
       false},
      {"all equal",
       [](size_t n, uint64_t seed) {
         return MakeInput(Distribution::kAllEqual, n, seed);
       },
       true},
      {"ties",
       [](size_t n, uint64_t seed) {
         return MakeInput(Distribution::kTies, n, seed);
       },
       true},
  };
  int replayed = 0;
  for (const size_t n : {size_t{100003}, size_t{300007}}) {
    for (const double density : {0.001, 0.01}) {
      for (const Input& input : inputs) {
        // (At 0.001 the ties' k-th key is 2.0, whose bin is predicted.)
        if (input.name == "ties" && density < 0.01) continue;
        for (cudaStream_t stream :
             {created, static_cast<cudaStream_t>(nullptr)}) {
          SCOPED_TRACE(input.name + " n=" + std::to_string(n) + " density=" +
                       std::to_string(density) +
                       (stream == nullptr ? " legacy" : " created"));
          GTOPK_ASSERT_OK_AND_ASSIGN(const uint64_t k,
                                     KFromDensity(density, n));
          const uint64_t fine_cap = std::min<uint64_t>(4 * k, n / 32);
          GTOPK_ASSERT_OK_AND_ASSIGN(auto selector,
                                     CudaSelector::Create("exact", {}, n));
          DeviceVector residual(std::vector<float>(n, 0.0f));
          for (uint64_t t = 0; t < 7; ++t) {
            SCOPED_TRACE("step " + std::to_string(t));
            // Steps 0 and 1, 2 and 3 select the same u (its prediction
            // keeps at most fine_cap of it), 4 to 6 fresh ones.
            std::vector<float> u = input.make(n, 17 * (t / 2) + n);
            if (t == 4) {
              for (float& x : u) x *= 0.99f;
            }
            SelectInfo info;
            ExactStepOnAZeroResidual(selector.get(), residual, u, k, t,
                                     stream, &info);
            replayed += info.graph_replay;
            if (t >= 1 && t <= 3) {
              EXPECT_TRUE(info.candidates_from_update);
              EXPECT_FALSE(info.sampled_after_update);
              EXPECT_EQ(info.exact_digit_passes, 1);
              EXPECT_EQ(info.exact_final_from_u, input.ties);
              if (input.ties) {
                EXPECT_LT(info.candidates, k);  // the keys > K
              } else {
                EXPECT_GE(info.candidates, k);
                EXPECT_LE(info.candidates, t == 2 ? n / 8 : fine_cap);
                // The lowest such key, to a digit-1 bin or a key: no bin
                // here holds half of fine_cap.
                if (t != 2) {
                  EXPECT_GE(info.candidates, fine_cap / 2);
                }
              }
            } else if (t == 0 || t == 4) {
              // No prediction yet; the drop's miss.
              EXPECT_FALSE(info.candidates_from_update);
              EXPECT_FALSE(info.sampled_after_update);
              EXPECT_GT(info.exact_digit_passes, 1);
            } else {
              EXPECT_TRUE(info.sampled_after_update);
            }
          }
        }
      }
    }
  }
  // Ties at 1.0 with a 2.0 at every 1000th entry, then at every 50th
  // (2,000 keys above K = 1.0, more than k): the update kept them, and the
  // plan takes them as its candidates (no tie write); the step after it
  // has a bin predicted again (2.0's bin holds at most n/32 keys).
  {
    const size_t n = 100003;
    const uint64_t k = 1000;
    GTOPK_ASSERT_OK_AND_ASSIGN(auto selector,
                               CudaSelector::Create("exact", {}, n));
    DeviceVector residual(std::vector<float>(n, 0.0f));
    for (uint64_t t = 0; t < 4; ++t) {
      SCOPED_TRACE("ties, then more above them; step " + std::to_string(t));
      std::vector<float> u = MakeInput(Distribution::kTies, n, 40 + t);
      uint64_t above = 0;
      if (t >= 2) {
        for (size_t i = 0; i < n; ++i) {
          if (i % 50 == 49) u[i] = 2.0f;
        }
      }
      for (float x : u) above += std::fabs(x) > 1.0f;
      SelectInfo info;
      ExactStepOnAZeroResidual(selector.get(), residual, u, k, t, created,
                               &info);
      EXPECT_EQ(info.candidates_from_update, t > 0);
      if (t > 0) {
        EXPECT_EQ(info.exact_final_from_u, t == 1);  // the tie write
      }
      if (t == 2) {
        EXPECT_EQ(info.candidates, above);
      } else if (t == 3) {
        EXPECT_GE(info.candidates, above);
      }
    }
  }
  EXPECT_EQ(cudaStreamDestroy(created), cudaSuccess);
  EXPECT_GT(replayed, 0);
}

// Gaussian-k after Accumulate on the same n as exact selections whose k-th
// key sat in a crowded digit-0 bin ([2.0, 2.25) holds 1/12 of u): the
// update kept the keys from a fine key T inside that bin (about 2.24), and
// Gaussian-k's stop key lies in the same bin under T (its first threshold,
// about 2.1, in range), so its first compaction must read u: the keys in
// [2.1, T) were not kept. The same selection, bit for bit, as Gaussian-k
// on a plain copy of u, and the zeroing exact.
TEST_F(GpuTest, GaussianKAfterAFineExactPredictionCompactsUUnderItsKey) {
  const size_t n = 100003;
  std::mt19937_64 rng(11);
  std::uniform_real_distribution<float> unit(0.0f, 1.0f);
  std::vector<float> u(n);
  for (size_t i = 0; i < n; ++i) {
    const float sign = unit(rng) < 0.5f ? -1.0f : 1.0f;
    u[i] = sign * (i % 12 == 5 ? 2.0f + 0.25f * unit(rng) : 1.5f * unit(rng));
  }
  // Gaussian-k's k for a first threshold of about 2.1: the two-sided
  // normal tail beyond 2.1 / std, times n.
  long double sum = 0.0L, ss = 0.0L;
  for (float x : u) sum += x;
  const long double mean = sum / n;
  for (float x : u) ss += (x - mean) * (x - mean);
  const double std_dev = static_cast<double>(std::sqrt(ss / (n - 1)));
  const uint64_t kg = static_cast<uint64_t>(
      std::llround(std::erfc(2.1 / std_dev / std::sqrt(2.0)) * n));
  SelectorOptions options;
  GTOPK_ASSERT_OK_AND_ASSIGN(auto plain,
                             CudaSelector::Create("gaussiank", options, n));
  SparseVector want;
  GTOPK_ASSERT_OK(plain->Select(u, kg, 2, &want));
  // The scenario: stopped at the first threshold, in range, in the bin.
  ASSERT_EQ(plain->last_info().adjustments, 0);
  ASSERT_FALSE(plain->last_info().fell_back);
  ASSERT_GT(want.size(), 1000u);
  for (float x : want.values) ASSERT_GE(std::fabs(x), 2.0f);

  GTOPK_ASSERT_OK_AND_ASSIGN(auto selector,
                             CudaSelector::Create("gaussiank", options, n));
  Sparsifier* sp = selector->sparsifier();
  DeviceVector residual(std::vector<float>(n, 0.0f));
  DeviceVector grad(u);
  const auto accumulate = [&] {
    const std::vector<float> zeros(n, 0.0f);
    ASSERT_EQ(cudaMemcpy(residual.buffer.get(), zeros.data(),
                         n * sizeof(float), cudaMemcpyHostToDevice),
              cudaSuccess);
    GTOPK_ASSERT_OK(ToAbslStatus(sp->Accumulate(
        grad.buffer.get(), nullptr, nullptr, nullptr, residual.buffer.get(),
        residual.buffer.get(), n, PlainUpdate(1.0f), nullptr)));
  };
  // Two exact selections (k = 100): the first predicts T, the second
  // takes the candidates from it and predicts it again.
  for (int step = 0; step < 2; ++step) {
    SCOPED_TRACE("exact step " + std::to_string(step));
    accumulate();
    SelectParams p;
    p.method = Method::kExact;
    p.k = 100;
    GTOPK_ASSERT_OK(ToAbslStatus(sp->Select(residual.buffer.get(), n, p,
                                            nullptr)));
    SelectedPairs sel;
    GTOPK_ASSERT_OK(ToAbslStatus(sp->Wait(nullptr, &sel)));
    const SparseVector exact = ReferenceTopK(u, 100);
    ASSERT_EQ(sel.count, 100u);
    EXPECT_EQ(std::vector<uint32_t>(sel.indices, sel.indices + sel.count),
              exact.indices);
    EXPECT_EQ(sel.info.candidates_from_update, step == 1);
  }
  accumulate();
  SparseVector got;
  GTOPK_ASSERT_OK(selector->SelectDevice(residual.buffer.get(), n, kg, 2,
                                         nullptr, true, &got));
  EXPECT_FALSE(selector->last_info().candidates_from_update);
  EXPECT_EQ(selector->last_info().adjustments, 0);
  ExpectSameBits(got, want);
  ExpectZeroedExactly(residual, u, want.indices);
}

// Gaussian-k after Accumulate, when its previous selection after Accumulate
// predicted a bin, compacts the update's candidates instead of u: the same
// selection, bit for bit, as Gaussian-k on a plain copy of the same u on
// another Sparsifier (whose per-block sums, and so its threshold, are the
// same), with the same adjustments, correction and fallback, and the
// zeroing exact. Each input runs as: Accumulate u into a zero residual and
// select (predicts), then again (may take the candidates), on a selector
// whose device corrects and on one whose correction continues on the host
// (no keys listed: the test hook). Then a drifting sequence on one
// selector: u scaled down 16x (the key falls under the bin), the step after
// it, and a Gaussian-k selection of another n in between. Every path is
// asserted taken: candidates with the count in range, with a correction on
// the device after them, with the host's continuation after them, and not
// taken where the key fell under the bin.
TEST_F(GpuTest, GaussianKAfterUpdateTakesTheUpdatesCandidates) {
  const UpdateParams up = PlainUpdate(1.0f);
  SelectorOptions options;
  options.gaussiank_max_adjustments = 16;
  // One Gaussian-k selection of residual + lr * grad: fused, after
  // Accumulate of `grad` into `residual` (device); else the sum is
  // written to `residual` from the host and selected from u in device
  // memory (Gaussian-k's own histogram pass keeps the candidates). The
  // host residual follows the update.
  bool fused = true;
  const auto after_update =
      [&](CudaSelector* selector, DeviceVector& residual,
          std::vector<float>& host_residual, const std::vector<float>& grad,
          uint64_t k, uint64_t step, cudaStream_t stream, SparseVector* got) {
        const size_t n = grad.size();
        for (size_t i = 0; i < n; ++i) {
          host_residual[i] = host_residual[i] + up.lr * grad[i];
        }
        DeviceVector d_grad(grad);
        if (!fused) {
          ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
          ASSERT_EQ(cudaMemcpy(residual.buffer.get(), host_residual.data(),
                               n * sizeof(float), cudaMemcpyHostToDevice),
                    cudaSuccess);
        }
        // The copies ran on the legacy stream, which a non-blocking stream
        // does not wait for.
        ASSERT_EQ(cudaStreamSynchronize(nullptr), cudaSuccess);
        if (fused) {
          GTOPK_ASSERT_OK(ToAbslStatus(selector->sparsifier()->Accumulate(
              d_grad.buffer.get(), nullptr, nullptr, nullptr,
              residual.buffer.get(), residual.buffer.get(), n, up, stream)));
        }
        GTOPK_ASSERT_OK(selector->SelectDevice(residual.buffer.get(), n, k,
                                               step, stream, true, got));
        EXPECT_EQ(selector->last_info().used_update_histogram, fused);
      };
  // The same selection on a plain copy of u, on a fresh selector.
  const auto expect_as_plain = [&](const std::vector<float>& u, uint64_t k,
                                   uint64_t step, const SparseVector& got,
                                   const SelectInfo& info) {
    GTOPK_ASSERT_OK_AND_ASSIGN(
        auto plain, CudaSelector::Create("gaussiank", options, u.size()));
    SparseVector want;
    GTOPK_ASSERT_OK(plain->Select(u, k, step, &want));
    ExpectSameBits(got, want);
    EXPECT_EQ(info.adjustments, plain->last_info().adjustments);
    EXPECT_EQ(info.fell_back, plain->last_info().fell_back);
    if (info.fell_back) {
      ExpectSameBits(got, ReferenceTopK(u, k));
    } else {
      ExpectThresholdSelection(u, got);
      EXPECT_GE(got.size(), plain->MinCount(k));
      EXPECT_LE(got.size(), plain->MaxCount(k));
    }
  };
  struct Case {
    std::string name;
    std::vector<float> u;
    uint64_t k;
  };
  std::vector<Case> cases;
  for (const Distribution dist :
       {Distribution::kNormal, Distribution::kHeavyTailed,
        Distribution::kLaplaceZeros, Distribution::kManyZeros,
        Distribution::kFewLevels, Distribution::kSpike,
        Distribution::kNarrowBand, Distribution::kTies, Distribution::kOutliers,
        Distribution::kAllEqual}) {
    for (const size_t n : {size_t{4099}, size_t{100003}}) {
      for (const double density : {0.001, 0.01, 0.3}) {
        GTOPK_ASSERT_OK_AND_ASSIGN(const uint64_t k, KFromDensity(density, n));
        cases.push_back({DistributionName(dist) + " n=" + std::to_string(n) +
                             " density=" + std::to_string(density),
                         MakeInput(dist, n, n + 17), k});
      }
    }
  }
  // Raised corrections (n = 10000, k = 100, range [67, 133]; the rest of u
  // is +-1.0, mean about 0, so t0 = mean + z*std is about 2.85, in the
  // digit-0 bin [2.75, 3.0), and t1 = 1.5*t0 about 4.27, in [4.0, 4.5)).
  // Both leave t0 undecided by the histogram (at most 130 keys above its
  // bin, 170 or 200 with it) with 149 or 168 keys >= t0: too many.
  //  * "raise, decided": t1's bin holds 100 keys, all above t1: the
  //    histogram decides t1 in range, nothing is listed.
  //  * "raise, listed": t1's bin holds 100 keys above t1 and 30 below: t1
  //    is listed and counted by the first compaction (100, in range); with
  //    no keys listed (the test hook) the host continues among the
  //    candidates.
  // Every key the rule reaches lies at or above t0's bin minus one, the
  // bin the update keeps from after a first selection at t0.
  const auto build = [](std::initializer_list<std::array<float, 3>> groups) {
    std::vector<float> big;
    for (const auto& g : groups) {
      const int count = static_cast<int>(g[0]);
      for (int j = 0; j < count; ++j) {
        big.push_back(g[1] + (g[2] - g[1]) * static_cast<float>(j) / count);
      }
    }
    std::vector<float> u(10000, 1.0f);
    const size_t stride = u.size() / big.size();
    for (size_t b = 0; b < big.size(); ++b) u[b * stride + 7] = big[b];
    for (size_t i = 1; i < u.size(); i += 2) u[i] = -u[i];
    return u;
  };
  cases.push_back(
      {"raise, decided",
       build({{100, 4.5f, 4.6f}, {60, 2.8f, 2.95f}, {10, 2.76f, 2.77f}}), 100});
  // t0 decided in range by the histogram (its bin is empty, 100 keys
  // above it): nothing listed, so at u/16 only the bin check keeps the
  // candidates out.
  cases.push_back({"in range, decided", build({{100, 4.5f, 4.6f}}), 100});
  // GaussianKLoweredThresholdIsCorrectedOnTheDevice's "lower then raise":
  // t0 ~ 2.64 leaves 40 (too few); t1 = t0/2 is listed, 8 bins under the
  // kept ones, and 50 keys of its bin lie above it (150: too many), so the
  // first compaction must read u to count them.
  cases.push_back({"lower then raise, listed under the bins",
                   build({{40, 3.0f, 3.5f},
                          {40, 2.5f, 2.55f},
                          {20, 2.2f, 2.4f},
                          {50, 1.34f, 1.37f}}),
                   100});
  cases.push_back({"raise, listed",
                   build({{100, 4.3f, 4.45f},
                          {30, 4.0f, 4.2f},
                          {60, 2.8f, 2.95f},
                          {10, 2.76f, 2.77f}}),
                   100});
  // Ties at t0's key: 60 keys in [4.5, 4.6), two entries at each of the
  // seven floats around the smallest float above t0 (about 2.70), the rest
  // +-1.0: 68 keys reach that float (in range), 66 exceed it (too few), and
  // the histogram leaves t0 undecided (60 keys above its bin, 74 with it).
  // A compaction that missed the ties at its key would correct instead.
  {
    const double z = cpu::NormalQuantile(1.0 - 100.0 / 10000 / 2.0);
    const auto min_float_above = MinFloatAbove;
    const auto threshold = [&](const std::vector<float>& u) {
      return GaussianThresholdOf(u, z);
    };
    float tie = 2.7f;
    std::vector<float> u;
    long double t0 = 0.0L;
    for (int iteration = 0; iteration < 4; ++iteration) {
      u = build({{60, 4.5f, 4.6f}});
      int j = 0;
      for (int d = -3; d <= 3; ++d) {
        float f = tie;
        for (int step = 0; step < std::abs(d); ++step) {
          f = std::nextafter(f, d < 0 ? 0.0f : 10.0f);
        }
        for (int copy = 0; copy < 2; ++copy, ++j) {
          u[2 + 700 * j] = j % 2 == 0 ? f : -f;  // never a big value's slot
        }
      }
      t0 = threshold(u);
      const float next = min_float_above(t0);
      if (next == tie) break;
      tie = next;
    }
    ASSERT_EQ(min_float_above(t0), tie) << "the ties did not settle";
    ASSERT_EQ(min_float_above(t0 * (1.0L - 1e-9L)),
              min_float_above(t0 * (1.0L + 1e-9L)));
    uint64_t at_least = 0, above = 0;
    for (float x : u) {
      const long double a = std::fabs(x);
      ASSERT_GT(std::fabs(a - t0), 1e-9L * t0);
      at_least += std::fabs(x) >= tie;
      above += std::fabs(x) > tie;
    }
    ASSERT_EQ(at_least, 68u);
    ASSERT_EQ(above, 66u);
    ASSERT_GE(t0, 2.5L);
    ASSERT_LT(tie, 2.75f);
    cases.push_back({"ties at t0's key", u, 100});
  }
  // On a created stream: each selector captures a graph at repeat 0 and
  // replays it at repeats 1 and 2 (same buffer, n and k).
  cudaStream_t created = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&created, cudaStreamNonBlocking),
            cudaSuccess);
  for (const bool fused_mode : {true, false}) {
    fused = fused_mode;
    SCOPED_TRACE(fused ? "after Accumulate" : "from u in device memory");
    int in_range = 0, corrected = 0, host_continued = 0, from_update = 0;
    int replayed = 0, fallback_from_update = 0;
    for (const Case& c : cases) {
      SCOPED_TRACE(c.name);
      const uint64_t k = c.k;
      const size_t n = c.u.size();
      const size_t other = n + 1001;
      const std::vector<float> other_u =
          MakeInput(Distribution::kNormal, other, 5);
      std::vector<float> scaled = c.u;
      for (float& x : scaled) x *= 1.0f / 16;
      for (const bool host : {false, true}) {
        SCOPED_TRACE(host ? "host continuation" : "device correction");
        GTOPK_ASSERT_OK_AND_ASSIGN(
            auto selector, CudaSelector::Create("gaussiank", options, other));
        if (host)
          selector->sparsifier()->set_gaussiank_key_limit_for_testing(0);
        const std::vector<float> zeros(n, 0.0f);
        DeviceVector residual(zeros);
        // 0: u into a zero residual (predicts); 1: the same, after an exact
        // selection of another n in between (which predicts nothing, and
        // leaves the host's layout that of another selection); 2: u/16 (the
        // stop key lies 4 binades under the bins the update kept: never).
        for (int repeat = 0; repeat < 3; ++repeat) {
          SCOPED_TRACE(repeat);
          if (repeat == 1) {
            DeviceVector d_other(other_u);
            SelectParams p;
            p.method = Method::kExact;
            p.k = k;
            Sparsifier* sp = selector->sparsifier();
            ASSERT_TRUE(
                sp->Select(d_other.buffer.get(), other, p, nullptr).ok());
            SelectedPairs sel;
            ASSERT_TRUE(sp->Wait(nullptr, &sel).ok());
            ASSERT_EQ(sel.count, k);
          }
          std::vector<float> host_residual = zeros;
          ASSERT_EQ(cudaStreamSynchronize(created), cudaSuccess);
          ASSERT_EQ(cudaMemcpy(residual.buffer.get(), zeros.data(),
                               n * sizeof(float), cudaMemcpyHostToDevice),
                    cudaSuccess);
          SparseVector got;
          after_update(selector.get(), residual, host_residual,
                       repeat == 2 ? scaled : c.u, k, repeat, created, &got);
          const SelectInfo info = selector->last_info();
          expect_as_plain(host_residual, k, repeat, got, info);
          ExpectZeroedExactly(residual, host_residual, got.indices);
          replayed += info.graph_replay;
          if (repeat != 1) {
            EXPECT_FALSE(info.candidates_from_update)
                << (repeat == 0 ? "no prediction yet" : "the key fell under");
          }
          if (!info.candidates_from_update) continue;
          if (info.fell_back) {
            // The rule ended out of range and its exact top-k took the
            // first pass's candidates (expect_as_plain checked it against
            // the reference).
            ++fallback_from_update;
            continue;
          }
          ++from_update;
          if (info.corrected_on_device) {
            ++corrected;
          } else if (!info.fast_path) {
            ++host_continued;
          } else {
            ++in_range;
          }
        }
      }
    }
    std::printf(
        "from the update's candidates %d: in range %d, corrected %d, "
        "host continued %d; fallbacks from them %d; replayed %d\n",
        from_update, in_range, corrected, host_continued,
        fallback_from_update, replayed);
    EXPECT_GT(in_range, 0);
    EXPECT_GT(corrected, 0);
    EXPECT_GT(host_continued, 0);
    EXPECT_GT(fallback_from_update, 0);
    EXPECT_GT(replayed, 0);
  }

  // Drift on one selector.
  struct Step {
    float scale;   // residual and gradient scaled by it in this step
    bool other_n;  // a Gaussian-k selection after Accumulate on another n
    int expect;    // candidates_from_update: 1, 0, or -1 (either)
  };
  const std::vector<Step> steps = {
      {1.0f, false, 0},
      {1.0f, false, 1},
      {1.0f, false, 1},
      {1.0f / 16, false, 0},  // the key falls 4 binades under the bin
      {1.0f, false, -1},
      {1.0f, false, 1},
      {1.0f, true, 0},  // predicted for the other n
      {1.0f, false, 1},
  };
  // On the created stream (the selections replay as graphs) and the
  // legacy stream.
  int flag_steps = 0, flag_checked = 0, replayed = 0;
  for (const bool fused_mode : {true, false}) {
    fused = fused_mode;
    for (const size_t n : {size_t{100003}, size_t{300007}}) {
      for (const double density : {0.001, 0.01}) {
        for (cudaStream_t stream :
             {created, static_cast<cudaStream_t>(nullptr)}) {
          SCOPED_TRACE(
              "drift n=" + std::to_string(n) +
              " density=" + std::to_string(density) +
              (stream == nullptr ? " legacy stream" : " created stream") +
              (fused ? ", after Accumulate" : ", from u in device memory"));
          GTOPK_ASSERT_OK_AND_ASSIGN(const uint64_t k,
                                     KFromDensity(density, n));
          const size_t other = n + 1001;
          GTOPK_ASSERT_OK_AND_ASSIGN(
              auto selector, CudaSelector::Create("gaussiank", options, other));
          std::vector<float> host_residual(n, 0.0f);
          DeviceVector residual(host_residual);
          for (size_t t = 0; t < steps.size(); ++t) {
            SCOPED_TRACE("step " + std::to_string(t));
            if (steps[t].other_n) {
              std::vector<float> other_residual(other, 0.0f);
              DeviceVector r(other_residual);
              SparseVector other_got;
              after_update(selector.get(), r, other_residual,
                           MakeInput(Distribution::kNormal, other, 5), k, t,
                           stream, &other_got);
            }
            std::vector<float> grad =
                MakeInput(Distribution::kNormal, n, 100 * t + n);
            if (steps[t].scale != 1.0f) {
              for (float& r : host_residual) r *= steps[t].scale;
              for (float& g : grad) g *= steps[t].scale;
              ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
              ASSERT_EQ(cudaMemcpy(residual.buffer.get(), host_residual.data(),
                                   n * sizeof(float), cudaMemcpyHostToDevice),
                        cudaSuccess);
            }
            SparseVector got;
            after_update(selector.get(), residual, host_residual, grad, k, t,
                         stream, &got);
            const SelectInfo info = selector->last_info();
            replayed += info.graph_replay;
            expect_as_plain(host_residual, k, t, got, info);
            ExpectZeroedExactly(residual, host_residual, got.indices);
            for (uint32_t i : got.indices) host_residual[i] = 0.0f;
            // (A step whose rule ends out of range runs the exact top-k from
            // u, as the plain selection does: the residual's holes where
            // entries were sent can take it there.)
            if (steps[t].expect >= 0) {
              ++flag_steps;
              if (!info.fell_back) {
                ++flag_checked;
                EXPECT_EQ(info.candidates_from_update, steps[t].expect == 1);
              }
            }
          }
        }
      }
    }
  }
  EXPECT_EQ(cudaStreamDestroy(created), cudaSuccess);
  EXPECT_GE(flag_checked * 10, flag_steps * 9)
      << flag_checked << " of " << flag_steps << " steps checked";
  EXPECT_GT(replayed, 0) << "no selection replayed a graph";
}

// The update's candidates belong to the selection right after it: after
// exact selections after Accumulate (which predict a bin, so every later
// Accumulate of this n compacts), Gaussian-k selections whose rule ends out
// of range (outliers inflate the std) run the exact top-k from their own
// histogram, on a plain buffer and after Accumulate (where Gaussian-k's own
// compaction has overwritten the update's regions). Each must equal
// ReferenceTopK. (The fault this guards against, the fallback taking the
// update's candidates, was found by the device check's outliers input,
// which cuda_device_check_emu_test runs; this sequence did not reproduce
// it on the emulator, so it is a regression check of the paths, not of
// that fault.)
TEST_F(GpuTest, GaussianKFallbackIgnoresTheUpdatesCandidates) {
  const size_t n = 100003;
  GTOPK_ASSERT_OK_AND_ASSIGN(auto exact, CudaSelector::Create("exact", {}, n));
  Sparsifier* sp = exact->sparsifier();
  const UpdateParams up = PlainUpdate(1.0f);
  const std::vector<float> u = MakeInput(Distribution::kOutliers, n, 3);
  int fell_back = 0;
  for (const uint64_t k : {10, 100, 1000, 100, 10}) {
    SCOPED_TRACE(k);
    for (int run = 0; run < 4; ++run) {
      // 0: exact on a plain buffer; 1: exact after Accumulate; 2:
      // Gaussian-k on a plain buffer; 3: Gaussian-k after Accumulate.
      SCOPED_TRACE(run);
      DeviceVector grad(u), residual(std::vector<float>(n, 0.0f));
      const bool plain = run % 2 == 0;
      DeviceVector& selected = plain ? grad : residual;
      if (!plain) {
        GTOPK_ASSERT_OK(ToAbslStatus(
            sp->Accumulate(grad.buffer.get(), nullptr, nullptr, nullptr,
                           residual.buffer.get(), residual.buffer.get(), n,
                           up, nullptr)));
      }
      SelectParams p;
      p.method = run < 2 ? Method::kExact : Method::kGaussianK;
      p.k = k;
      p.zero_selected = true;
      ASSERT_TRUE(sp->Select(selected.buffer.get(), n, p, nullptr).ok());
      SelectedPairs sel;
      const KernelStatus waited = sp->Wait(nullptr, &sel);
      ASSERT_TRUE(waited.ok()) << waited.message;
      SparseVector got;
      got.indices.assign(sel.indices, sel.indices + sel.count);
      got.values.assign(sel.values, sel.values + sel.count);
      if (run < 2 || sel.info.fell_back) {
        fell_back += run >= 2;
        ExpectSameBits(got, ReferenceTopK(u, k));
      } else {
        ExpectThresholdSelection(u, got);
      }
      ExpectZeroedExactly(selected, u, got.indices);
    }
  }
  EXPECT_GE(fell_back, 4) << "the input no longer makes Gaussian-k fall back";
}

// Switches the one-block path (SelectInfo::one_block) off for a scope.
class NoOneBlock {
 public:
  NoOneBlock() : saved_(SetOneBlockMaxNForTesting(0)) {}
  ~NoOneBlock() { SetOneBlockMaxNForTesting(saved_); }

 private:
  uint64_t saved_;
};

// The CPU Gaussian-k rule in plain loops with long double sums: the
// selection (|u| > t at the first t in [lo, hi]) or nullopt when the rule
// ends out of range (the exact top-k follows); `clear` is false when some
// |u| lies within 1e-9 (relative) of a threshold tried, where the device's
// double sums may round either way.
struct GaussRule {
  std::optional<std::vector<uint32_t>> selected;
  int adjustments = 0;
  bool clear = true;
};
GaussRule GaussianKInPlainLoops(const std::vector<float>& u, uint64_t k,
                                int max_adjustments) {
  const size_t n = u.size();
  const uint64_t lo = (2 * k + 2) / 3, hi = 4 * k / 3;
  const double z = cpu::NormalQuantile(1.0 - static_cast<double>(k) / n / 2.0);
  // Two passes: the mean, then the squared deviations from it.
  long double sum = 0.0L;
  for (float x : u) sum += x;
  const long double mean = sum / n;
  long double ss = 0.0L;
  for (float x : u) ss += (x - mean) * (x - mean);
  const long double var = n > 1 ? ss / (n - 1) : 0.0L;
  long double t = mean + z * std::sqrt(var);
  GaussRule rule;
  for (int a = 0;; ++a) {
    std::vector<uint32_t> above;
    for (size_t i = 0; i < n; ++i) {
      const long double m = std::fabs(static_cast<long double>(u[i]));
      if (std::fabs(m - t) <= 1e-9L * std::fabs(t)) rule.clear = false;
      if (m > t) above.push_back(static_cast<uint32_t>(i));
    }
    rule.adjustments = a;
    if (above.size() >= lo && above.size() <= hi) {
      rule.selected = above;
      return rule;
    }
    if (a == max_adjustments) return rule;
    t = above.size() < lo ? t * 0.5L : t * 1.5L;
    if (t <= 0.0L) return rule;
  }
}

// dgc's rule in plain loops: the sample's threshold B (see
// DgcSamplesTheRunsOfItsSeedAndStep), every |u| >= B when at most k, else
// the exact top-k; the exact top-k too when the sample would be half of u.
SparseVector DgcInPlainLoops(const std::vector<float>& u, uint64_t k,
                             uint64_t seed, uint64_t step, double fraction) {
  const size_t n = u.size();
  auto key = [](float x) { return FloatBits(x) & 0x7fffffffu; };
  const uint64_t runs =
      (static_cast<uint64_t>(std::ceil(fraction * n)) + 15) / 16;
  if (k == n || runs * 32 >= n) return ReferenceTopK(u, k);
  std::vector<uint32_t> sample;
  for (uint64_t start : SampleRunStarts(seed, step, n, runs)) {
    for (int j = 0; j < 16; ++j) sample.push_back(key(u[start + j]));
  }
  const uint64_t sample_k = std::max<uint64_t>(
      1, static_cast<uint64_t>(std::ceil(static_cast<double>(sample.size()) *
                                         k / n)));
  std::sort(sample.begin(), sample.end(), std::greater<uint32_t>());
  const uint32_t b = sample[sample_k - 1];
  SparseVector survivors;
  for (size_t i = 0; i < n; ++i) {
    if (key(u[i]) >= b) {
      survivors.indices.push_back(static_cast<uint32_t>(i));
      survivors.values.push_back(u[i]);
    }
  }
  return survivors.size() <= k ? survivors : ReferenceTopK(u, k);
}

// Gaussian-k on inputs whose rule ends out of range at every step (a
// narrow band, every value equal, ties at density 0.01, outliers that
// inflate the std), after Accumulate and from u in device memory: the first
// fallback's exact plan (Wait's continuation) predicts the next first
// pass's candidates (the fused update's, or Gaussian-k's own histogram
// pass's, which counts the ties too when ties were predicted), and each
// later fallback, gated on the device, takes them as exact's own selection
// after Accumulate does: no pass over u besides the first, although the
// exact top-k would start from a sample at this n (the hook), as it did
// before. Four fresh inputs of each kind in turn on one selector, on a
// created stream (graphs) and the legacy one; every step equals
// ReferenceTopK and zeroes exactly the selected entries.
TEST_F(GpuTest, GaussianKFallbackTakesTheFirstPassCandidates) {
  const ExactSampleFrom sample_from(0);
  const size_t n = 100003;
  const uint64_t k = 1000;  // density 0.01
  cudaStream_t created = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&created, cudaStreamNonBlocking),
            cudaSuccess);
  const Distribution kinds[] = {Distribution::kNarrowBand,
                                Distribution::kAllEqual, Distribution::kTies,
                                Distribution::kOutliers};
  for (const bool fused : {true, false}) {
    SCOPED_TRACE(fused ? "after Accumulate" : "from u in device memory");
    int replayed = 0, final_from_u = 0;
    for (cudaStream_t stream : {created, static_cast<cudaStream_t>(nullptr)}) {
      SCOPED_TRACE(stream == nullptr ? "legacy stream" : "created stream");
      GTOPK_ASSERT_OK_AND_ASSIGN(auto selector,
                                 CudaSelector::Create("gaussiank", {}, n));
      DeviceVector residual(std::vector<float>(n, 0.0f));
      uint64_t step = 0;
      for (const Distribution kind : kinds) {
        for (int t = 0; t < 4; ++t, ++step) {
          SCOPED_TRACE(std::string(DistributionName(kind)) + " step " +
                       std::to_string(t));
          const std::vector<float> u = MakeInput(kind, n, 70 + step);
          ASSERT_FALSE(GaussianKInPlainLoops(u, k, 4).selected.has_value())
              << "the rule no longer ends out of range on this input";
          SelectInfo info;
          if (fused) {
            ASSERT_NO_FATAL_FAILURE(ExactStepOnAZeroResidual(
                selector.get(), residual, u, k, step, stream, &info));
          } else {
            // One buffer for every step (graphs are keyed on it).
            ASSERT_EQ(cudaMemcpy(residual.buffer.get(), u.data(),
                                 n * sizeof(float), cudaMemcpyHostToDevice),
                      cudaSuccess);
            ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
            SparseVector got;
            GTOPK_ASSERT_OK(selector->SelectDevice(residual.buffer.get(), n,
                                                   k, step, stream, true,
                                                   &got));
            info = selector->last_info();
            ExpectSameBits(got, ReferenceTopK(u, k));
            ASSERT_NO_FATAL_FAILURE(
                ExpectZeroedExactly(residual, u, got.indices));
            EXPECT_TRUE(info.fell_back);
          }
          EXPECT_EQ(info.used_update_histogram, fused);
          // Only the very first fallback is finished by Wait.
          EXPECT_EQ(info.fast_path, step > 0);
          EXPECT_FALSE(info.exact_sampled);
          // From the second input of a kind on, the prediction holds (the
          // first may follow another kind's).
          if (t > 0) {
            EXPECT_TRUE(info.candidates_from_update);
            EXPECT_EQ(info.exact_digit_passes, 1);
          }
          replayed += info.graph_replay;
          final_from_u += t > 0 && info.exact_final_from_u;  // a tie write
        }
      }
    }
    EXPECT_GT(replayed, 0) << "no selection replayed a graph";
    EXPECT_GT(final_from_u, 0) << "no tie write (every value equal, ties)";
  }
  EXPECT_EQ(cudaStreamDestroy(created), cudaSuccess);
}

// Gaussian-k after Accumulate of `first`, `second`, `first`, `second`
// into a zeroed residual on one selector (a created stream, whose second
// round replays graphs, then the legacy one): every step the exact top-k
// (its rule falls back), and on `second`, whose own compaction wrote over
// the update's candidates, a gated plan that did not take them.
void ExpectFallbackAfterItsCompactionPlansOverU(
    const std::vector<float>& first, const std::vector<float>& second,
    uint64_t k, const SelectorOptions& options) {
  const size_t n = first.size();
  for (const bool graphs : {true, false}) {
    SCOPED_TRACE(graphs ? "created stream" : "legacy stream");
    cudaStream_t stream = nullptr;
    if (graphs) {
      ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking),
                cudaSuccess);
    }
    GTOPK_ASSERT_OK_AND_ASSIGN(auto selector,
                               CudaSelector::Create("gaussiank", options, n));
    DeviceVector residual(std::vector<float>(n, 0.0f));
    for (uint64_t step = 0; step < 4; ++step) {
      SCOPED_TRACE("step " + std::to_string(step));
      SelectInfo info;
      ASSERT_NO_FATAL_FAILURE(ExactStepOnAZeroResidual(
          selector.get(), residual, step % 2 == 0 ? first : second, k, step,
          stream, &info));
      if (step % 2 == 1) {
        EXPECT_TRUE(info.fast_path);
        EXPECT_FALSE(info.candidates_from_update);
      }
    }
    if (graphs) {
      ASSERT_EQ(cudaStreamDestroy(stream), cudaSuccess);
    }
  }
}

// The exact fallback after Gaussian-k's own compaction over u does not take
// the update's candidates: that compaction wrote its survivors over them
// (the same regions; DeviceState::update_clobbered). Step 0, a narrow band
// at 2.9, falls back and predicts a key F in [2.9, 2.9015) for the next
// update; step 1 is N(0, 1) with 3031 entries at +-2.95: the update keeps
// the keys >= F (about 3,400: at least k, at most n/8, so the plan would
// take them), while the rule's first threshold (about 2.86, under F, its
// digit-0 bin undecided) compacts u and its adjustments end out of range,
// so the gated exact top-k runs. It must plan over u (it equals
// ReferenceTopK: the ties at 2.95 in index order), not over the
// compaction's leftovers in the update's layout.
TEST_F(GpuTest, GaussianKFallbackAfterItsOwnCompactionPlansOverU) {
  const size_t n = 100003;
  const uint64_t k = 1000;
  const uint64_t lo = (2 * k + 2) / 3, hi = 4 * k / 3;
  std::vector<float> band = MakeInput(Distribution::kNarrowBand, n, 81);
  for (float& x : band) x *= 2.9f;
  std::vector<float> planted = MakeInput(Distribution::kNormal, n, 82);
  for (size_t i = 5; i < n; i += 33) planted[i] = i % 2 ? 2.95f : -2.95f;
  // The construction's premises, on the host.
  const double z = cpu::NormalQuantile(1.0 - static_cast<double>(k) / n / 2.0);
  const long double t0 = GaussianThresholdOf(planted, z);
  const auto at_least = [&](float m) {
    uint64_t c = 0;
    for (float x : planted) c += std::fabs(x) >= m;
    return c;
  };
  float band_max = 0.0f;
  for (float x : band) band_max = std::max(band_max, std::fabs(x));
  ASSERT_LT(t0, 2.9L);                     // under every key F can be
  ASSERT_GE(t0, 2.75L);                    // in the bin [2.75, 3.0)
  ASSERT_GT(at_least(2.75f), hi);          // whose count the histogram
  ASSERT_LT(at_least(3.0f), lo);           // leaves undecided
  ASSERT_GE(at_least(band_max), k);        // the update keeps >= k
  ASSERT_LE(at_least(2.9f), n / 8);        // and <= n/8
  ASSERT_FALSE(GaussianKInPlainLoops(band, k, 4).selected.has_value());
  ASSERT_FALSE(GaussianKInPlainLoops(planted, k, 4).selected.has_value());
  ExpectFallbackAfterItsCompactionPlansOverU(band, planted, k, {});
}

// The same after Gaussian-k's in-place compaction of the update's
// candidates (GaussUpdateCollectKernel), with ties predicted: density 0.01
// (n = 100003, k = 1000), the rule with one adjustment. Step 0: +-0.9
// everywhere, 5,000 entries at +-1.0 and 50 at 2.0: the rule falls back,
// and the exact top-k's k-th key K = 1.0 has more ties than the fine
// prediction may keep, so the next update keeps the keys > K and counts
// those == K. Step 1: the same ties, 1,000 entries at 1.5, 400 at -2.27
// and 300 at 2.45: the update keeps the 1,700 keys > K (in K's digit-0
// bin's at-least count of about 6,500, under n/8), the rule's first
// threshold (about 2.36, between 2.27 and 2.45 in one digit-0 bin) reads
// those candidates and compacts them in place to the 300 keys above it,
// then ends out of range (1,700 above its half). The gated exact top-k
// (the 300, the 400 and the first 300 at 1.5) must plan over u: the
// compacted candidates (300 < k) and the update's tie count would
// otherwise take the update's tie write, K's ties instead of the 1.5s.
TEST_F(GpuTest, GaussianKFallbackAfterItsInPlaceCompactionPlansOverU) {
  const size_t n = 100003;
  const uint64_t k = 1000;
  const auto build = [&](bool second) {
    std::vector<float> u = MakeInput(Distribution::kNormal, n, 83);
    for (float& x : u) x = x < 0.0f ? -0.9f : 0.9f;
    int ties = 0, a = 0, b = 0, c = 0, top = 0;
    for (size_t i = 3; i < n && ties < 5000; i += 20, ++ties) {
      u[i] = i % 2 ? -1.0f : 1.0f;
    }
    for (size_t i = 0; i < n; ++i) {
      if (!second && i % 2000 == 7 && top < 50) {
        u[i] = 2.0f;
        ++top;
      } else if (second && i % 50 == 11 && a < 1000) {
        u[i] = 1.5f;
        ++a;
      }
    }
    for (size_t i = 13; second && i < n && b < 400; i += 250, ++b) {
      u[i] = -2.27f;
    }
    for (size_t i = 17; second && i < n && c < 300; i += 333, ++c) {
      u[i] = 2.45f;
    }
    return u;
  };
  const std::vector<float> first = build(false), second = build(true);
  // The construction's premises, on the host.
  const double z = cpu::NormalQuantile(1.0 - static_cast<double>(k) / n / 2.0);
  const long double t0 = GaussianThresholdOf(second, z);
  ASSERT_GT(t0, 2.27L);
  ASSERT_LT(t0, 2.45L);
  uint64_t above = 0, equal = 0;
  for (float x : second) {
    above += std::fabs(x) > 1.0f;
    equal += std::fabs(x) == 1.0f;
  }
  ASSERT_GE(above, k);
  ASSERT_GT(equal, std::min<uint64_t>(4 * k, n / 32));  // ties predicted
  ASSERT_LE(above + equal, n / 8);  // K's bin: the planner takes them
  ASSERT_FALSE(GaussianKInPlainLoops(first, k, 1).selected.has_value());
  ASSERT_FALSE(GaussianKInPlainLoops(second, k, 1).selected.has_value());
  SelectorOptions options;
  options.gaussiank_max_adjustments = 1;
  ExpectFallbackAfterItsCompactionPlansOverU(first, second, k, options);
}

// Seeded random sequences on one Sparsifier, the mix a training job's
// tensors make, so that every prediction one selection leaves for the next
// (candidates, ties, samples, fallbacks, graphs) meets the others:
// gaussiank and exact, after Accumulate (the residual carried over or
// zeroed first) and on plain buffers, two n interleaved, eight input kinds,
// fresh or the previous input scaled (x0.5 to x2) and drifted, k from 1 to
// n, zeroing on and off, 1 to 16 adjustments, a created stream (graphs)
// and the legacy one, exact's sample and Gaussian-k's key limit toggled, a
// non-finite entry now and then. Seed 2 favours the crowded inputs, fused
// Gaussian-k and repeated parameters (the predictions' steady states).
// Every step against its reference: the exact top-k (exact, or Gaussian-k
// where its rule fell back, as a fresh Sparsifier says) equals
// ReferenceTopK; Gaussian-k in range equals a fresh Sparsifier's selection
// of a plain copy (bits, adjustments); the residual is zeroed exactly (or
// untouched); a non-finite u is INVALID_ARGUMENT naming its first position,
// with u untouched. (A break-it review's harness, 2026-12-06.)
TEST_F(GpuTest, MixedSelectionSequencesOnOneSparsifierMatchTheirReferences) {
  const size_t ns[2] = {100003, 300007};
  const Distribution kinds[] = {
      Distribution::kNormal,   Distribution::kNarrowBand,
      Distribution::kAllEqual, Distribution::kTies,
      Distribution::kOutliers, Distribution::kLaplaceZeros,
      Distribution::kFewLevels, Distribution::kManyZeros};
  const uint64_t saved_sample = SetExactSampleMinNForTesting(0);
  SetExactSampleMinNForTesting(saved_sample);
  cudaStream_t created = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&created, cudaStreamNonBlocking),
            cudaSuccess);
  int fell_back_from_update = 0, replayed = 0, non_finite = 0;
  for (const uint64_t seed : {1, 2}) {
    const bool focus = seed == 2;
    std::mt19937_64 rng(seed);
    const auto pick = [&](uint64_t m) { return rng() % m; };
    const auto chance = [&](double p) {
      return std::uniform_real_distribution<double>(0, 1)(rng) < p;
    };
    std::unique_ptr<Sparsifier> sp;
    ASSERT_TRUE(Sparsifier::Create(ns[1], &sp).ok());
    DeviceVector res0(std::vector<float>(ns[0], 0.0f));
    DeviceVector res1(std::vector<float>(ns[1], 0.0f));
    DeviceVector plain0(std::vector<float>(ns[0], 0.0f));
    DeviceVector plain1(std::vector<float>(ns[1], 0.0f));
    DeviceVector* residual[2] = {&res0, &res1};
    DeviceVector* plain[2] = {&plain0, &plain1};
    std::vector<float> prev[2];
    SelectParams last[2];
    bool sample_on = false;
    int key_limit = 160;
    int which = 0;
    for (uint64_t step = 0; step < 60; ++step) {
      if (chance(focus ? 0.1 : 0.25)) which = 1 - which;
      const size_t n = ns[which];
      if (chance(0.1)) {
        sample_on = !sample_on;
        SetExactSampleMinNForTesting(sample_on ? 0 : saved_sample);
      }
      if (chance(focus ? 0.04 : 0.08)) {
        key_limit = key_limit == 0 ? 160 : 0;
        sp->set_gaussiank_key_limit_for_testing(key_limit);
      }
      SelectParams p;
      p.method =
          chance(focus ? 0.85 : 0.7) ? Method::kGaussianK : Method::kExact;
      const uint64_t ks[] = {1,         7,         n / 100, n / 1000, n / 8 - 1,
                             n / 8 + 1, n / 8,     n,       1000,     3000};
      p.k = ks[pick(10)];
      if (chance(0.5)) p.k = chance(0.5) ? n / 100 : 1000;
      p.zero_selected = chance(0.8);
      p.gaussiank_max_adjustments =
          chance(0.5) ? 4 : 1 + static_cast<int>(pick(16));
      if (focus && last[which].k != 0 && chance(0.75)) {
        p.k = last[which].k;
        p.zero_selected = last[which].zero_selected;
        p.gaussiank_max_adjustments = last[which].gaussiank_max_adjustments;
      }
      last[which] = p;
      p.step = step;
      cudaStream_t stream = chance(focus ? 0.8 : 0.6) ? created : nullptr;
      const bool fused = chance(focus ? 0.9 : 0.75);
      // The input (the gradient when fused).
      std::vector<float> in;
      std::string what;
      if (prev[which].empty() || pick(10) < 4) {
        const Distribution kind =
            focus && chance(0.7) ? kinds[1 + pick(4)] : kinds[pick(8)];
        in = MakeInput(kind, n, seed * 1000 + step);
        what = DistributionName(kind);
        if (chance(0.3)) {
          const float scale = chance(0.5) ? 2.9f : 0.01f;
          for (float& x : in) x *= scale;
          what += " scaled";
        }
      } else {
        const float scales[] = {0.9f, 0.5f, 2.0f, 1.0f, 0.97f, 1.03f};
        const float scale = scales[pick(6)];
        in = prev[which];
        for (float& x : in) x *= scale;
        what = "previous x" + std::to_string(scale);
        if (chance(0.3)) {
          const std::vector<float> noise =
              MakeInput(Distribution::kNormal, n, seed * 7777 + step);
          for (size_t i = 0; i < n; i += 7) in[i] += 0.05f * noise[i];
          what += " drifted";
        }
      }
      prev[which] = in;
      if (chance(0.03)) {
        const uint64_t at = pick(n);
        in[at] = chance(0.5) ? std::numeric_limits<float>::quiet_NaN()
                             : -std::numeric_limits<float>::infinity();
        prev[which].clear();
        what += " non-finite at " + std::to_string(at);
      }
      const bool zero_first = chance(0.5);
      SCOPED_TRACE("seed " + std::to_string(seed) + " step " +
                   std::to_string(step) + " n " + std::to_string(n) + " k " +
                   std::to_string(p.k) + " " + MethodName(p.method) +
                   (fused ? zero_first ? " after Accumulate of a zero residual"
                                       : " after Accumulate"
                          : " plain") +
                   " " + what + (stream ? " created" : " legacy") +
                   (p.zero_selected ? " zeroing" : "") + " adjustments " +
                   std::to_string(p.gaussiank_max_adjustments) +
                   (sample_on ? " sample" : "") +
                   (key_limit == 0 ? " key limit 0" : ""));
      std::vector<float> u;
      DeviceVector* target = fused ? residual[which] : plain[which];
      if (fused) {
        if (zero_first) {
          const std::vector<float> zeros(n, 0.0f);
          ASSERT_EQ(cudaMemcpy(target->buffer.get(), zeros.data(),
                               n * sizeof(float), cudaMemcpyHostToDevice),
                    cudaSuccess);
        }
        DeviceVector grad(in);
        // (A non-blocking stream does not wait for the legacy stream.)
        ASSERT_EQ(cudaStreamSynchronize(nullptr), cudaSuccess);
        ASSERT_TRUE(sp->Accumulate(grad.buffer.get(), nullptr, nullptr,
                                   nullptr, target->buffer.get(),
                                   target->buffer.get(), n, PlainUpdate(1.0f),
                                   stream)
                        .ok());
        ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
        u = target->ToHost(n);
      } else {
        ASSERT_EQ(cudaMemcpy(target->buffer.get(), in.data(),
                             n * sizeof(float), cudaMemcpyHostToDevice),
                  cudaSuccess);
        ASSERT_EQ(cudaStreamSynchronize(nullptr), cudaSuccess);
        u = in;
      }
      const auto bad = std::find_if(u.begin(), u.end(),
                                    [](float x) { return !std::isfinite(x); });
      const Selected sel =
          TrySelect(sp.get(), target->buffer.get(), n, p, stream);
      ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
      if (bad != u.end()) {
        ++non_finite;
        EXPECT_EQ(sel.status.code, KernelStatusCode::kInvalidArgument);
        EXPECT_THAT(sel.status.message,
                    HasSubstr("at position " +
                              std::to_string(bad - u.begin())));
        ASSERT_NO_FATAL_FAILURE(ExpectZeroedExactly(*target, u, {}));
        if (fused) {  // the next steps start from a finite residual
          const std::vector<float> zeros(n, 0.0f);
          ASSERT_EQ(cudaMemcpy(target->buffer.get(), zeros.data(),
                               n * sizeof(float), cudaMemcpyHostToDevice),
                    cudaSuccess);
        }
        continue;
      }
      ASSERT_TRUE(sel.status.ok()) << sel.status.message;
      replayed += sel.info.graph_replay;
      if (p.method == Method::kExact) {
        ExpectSameBits(sel.pairs, ReferenceTopK(u, p.k));
      } else {
        std::unique_ptr<Sparsifier> fresh;
        ASSERT_TRUE(Sparsifier::Create(n, &fresh).ok());
        DeviceVector copy(u);
        const Selected want =
            TrySelect(fresh.get(), copy.buffer.get(), n, p, nullptr);
        ASSERT_TRUE(want.status.ok()) << want.status.message;
        EXPECT_EQ(sel.info.fell_back, want.info.fell_back);
        EXPECT_EQ(sel.info.adjustments, want.info.adjustments);
        if (sel.info.fell_back) {
          fell_back_from_update += sel.info.candidates_from_update;
          ExpectSameBits(sel.pairs, ReferenceTopK(u, p.k));
        } else {
          ExpectSameBits(sel.pairs, want.pairs);
        }
      }
      ASSERT_NO_FATAL_FAILURE(ExpectZeroedExactly(
          *target, u,
          p.zero_selected ? sel.pairs.indices : std::vector<uint32_t>{}));
      if (HasFailure()) break;
    }
    SetExactSampleMinNForTesting(saved_sample);
  }
  EXPECT_EQ(cudaStreamDestroy(created), cudaSuccess);
  // The paths the sequences are for were reached.
  EXPECT_GT(fell_back_from_update, 0);
  EXPECT_GT(replayed, 0);
  EXPECT_GT(non_finite, 0);
}

// The one-block path (n <= 4096: one kernel, u's keys in shared memory)
// against the rules in plain loops and against the multi-kernel path on the
// same input (the test hook switches it off): exact equals ReferenceTopK,
// dgc its rule recomputed from the seed and step, Gaussian-k the CPU rule
// in long double wherever no |u| is within rounding of a threshold (else
// its count contract, and the exact top-k when it falls back); both paths
// give the same pairs for exact and dgc, zero exactly the selected entries,
// and report the rule's outcome alike. Every input kind, n from 1 to the
// bound, densities up to 1, on a created stream (graphs: the second step
// replays) and the legacy one.
TEST_F(GpuTest, OneBlockPathFollowsTheRulesAndTheMultiKernelPath) {
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking),
            cudaSuccess);
  int checked = 0, gauss_cases = 0, gauss_clear = 0;
  for (const size_t n : {size_t{1}, size_t{2}, size_t{17}, size_t{33},
                         size_t{64}, size_t{1000}, size_t{2049},
                         size_t{4096}}) {
    std::unique_ptr<Sparsifier> tiny_sp, multi_sp;
    ASSERT_TRUE(Sparsifier::Create(n, &tiny_sp).ok());
    ASSERT_TRUE(Sparsifier::Create(n, &multi_sp).ok());
    for (const Distribution dist : ::gtopk::testing::AllDistributions()) {
      for (const double density : {0.001, 0.01, 0.1, 0.3, 1.0}) {
        const uint64_t k = std::max<uint64_t>(
            1, static_cast<uint64_t>(std::llround(density * n)));
        const std::vector<float> u = MakeInput(dist, n, n * 31 + k);
        for (const Method method :
             {Method::kExact, Method::kGaussianK, Method::kDgc}) {
          for (uint64_t step = 0; step < 2; ++step) {
            SCOPED_TRACE(DistributionName(dist) + " n=" + std::to_string(n) +
                         " k=" + std::to_string(k) + " " + MethodName(method) +
                         " step " + std::to_string(step));
            SelectParams p;
            p.method = method;
            p.k = k;
            p.step = step;
            p.seed = 7;
            p.zero_selected = true;
            SparseVector got[2];
            SelectInfo info[2];
            for (int multi = 0; multi < 2; ++multi) {
              std::optional<NoOneBlock> off;
              if (multi) off.emplace();
              Sparsifier* sp = multi ? multi_sp.get() : tiny_sp.get();
              cudaStream_t s = step == 0 ? stream : nullptr;
              DeviceVector d(u);
              // (The copy ran on the legacy stream, which a non-blocking
              // one does not wait for.)
              ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
              ASSERT_TRUE(sp->Select(d.buffer.get(), n, p, s).ok());
              SelectedPairs sel;
              const KernelStatus waited = sp->Wait(s, &sel);
              ASSERT_TRUE(waited.ok()) << waited.message;
              got[multi].indices.assign(sel.indices, sel.indices + sel.count);
              got[multi].values.assign(sel.values, sel.values + sel.count);
              info[multi] = sel.info;
              EXPECT_EQ(sel.info.one_block, multi == 0);
              ExpectZeroedExactly(d, u, got[multi].indices);
            }
            EXPECT_TRUE(info[0].fast_path);
            EXPECT_EQ(info[0].fell_back, info[1].fell_back);
            if (method == Method::kExact) {
              ExpectSameBits(got[0], ReferenceTopK(u, k));
              ExpectSameBits(got[1], got[0]);
            } else if (method == Method::kDgc) {
              ExpectSameBits(got[0], DgcInPlainLoops(u, k, 7, step, 0.01));
              ExpectSameBits(got[1], got[0]);
              // (The multi-kernel path also calls a trim of the keys
              // above a tied threshold one when more than n/8 survive.)
              EXPECT_EQ(info[0].trimmed_on_device,
                        !info[0].fell_back && info[0].candidates > k);
            } else {
              ++gauss_cases;
              const GaussRule rule = GaussianKInPlainLoops(u, k, 4);
              const uint64_t lo = MinCount(Method::kGaussianK, k);
              const uint64_t hi = MaxCount(Method::kGaussianK, k);
              if (lo == hi || k == n || info[0].fell_back) {
                ExpectSameBits(got[0], ReferenceTopK(u, k));
              } else {
                EXPECT_GE(got[0].size(), lo);
                EXPECT_LE(got[0].size(), hi);
                ExpectThresholdSelection(u, got[0]);
              }
              if (rule.clear && lo != hi && k != n) {
                ++gauss_clear;
                ASSERT_EQ(info[0].fell_back, !rule.selected.has_value());
                EXPECT_EQ(info[0].adjustments, rule.adjustments);
                if (rule.selected) {
                  EXPECT_EQ(got[0].indices, *rule.selected);
                }
                ExpectSameBits(got[1], got[0]);
                EXPECT_EQ(info[1].adjustments, info[0].adjustments);
              }
            }
            ++checked;
          }
        }
      }
    }
  }
  EXPECT_EQ(cudaStreamDestroy(stream), cudaSuccess);
  EXPECT_EQ(checked, 8 * 13 * 5 * 3 * 2);
  // Every case whose rule the long double sums decide (not k <= 2, where
  // the range is one count, and not ties within rounding of a threshold).
  EXPECT_GT(gauss_clear, gauss_cases / 4);
}

// Gaussian-k's mean and std on values with a large common offset
// (2^24 plus integers in [-4, 4], std about 2.6): the one-pass variance
// (sum of squares minus sum times mean) cancelled there, and the one-block
// path selected 333 pairs where the rule gives 217 (a break-it review's
// input). The CPU selector, the one-block path and the multi-kernel path
// must each follow the rule computed in two passes in long double.
TEST_F(GpuTest, GaussianKOnALargeOffsetFollowsTheRule) {
  for (const size_t n : {size_t{1023}, size_t{1024}, size_t{1025},
                         size_t{100003}}) {
    std::mt19937_64 rng(1026102 + n);
    std::vector<float> u(n);
    for (float& x : u) {
      rng();
      x = 16777216.0f + static_cast<float>(rng() % 9) - 4.0f;
    }
    for (const uint64_t k : {uint64_t{297}, uint64_t{965}}) {
      if (k >= n) continue;
      SCOPED_TRACE("n=" + std::to_string(n) + " k=" + std::to_string(k));
      const GaussRule rule = GaussianKInPlainLoops(u, k, 6);
      ASSERT_TRUE(rule.clear);
      std::vector<uint32_t> want;
      if (rule.selected) {
        want = *rule.selected;
      } else {
        want = ReferenceTopK(u, k).indices;
      }
      SelectorOptions options;
      options.gaussiank_max_adjustments = 6;
      cpu::GaussianKSelector cpu_selector(options);
      SparseVector cpu_got;
      GTOPK_ASSERT_OK(cpu_selector.Select(u, k, 0, &cpu_got));
      EXPECT_EQ(cpu_got.indices, want) << "CPU";
      for (int multi = 0; multi < 2; ++multi) {
        std::optional<NoOneBlock> off;
        if (multi) off.emplace();
        std::unique_ptr<Sparsifier> sp;
        ASSERT_TRUE(Sparsifier::Create(n, &sp).ok());
        DeviceVector d(u);
        SelectParams p;
        p.method = Method::kGaussianK;
        p.k = k;
        p.gaussiank_max_adjustments = 6;
        ASSERT_TRUE(sp->Select(d.buffer.get(), n, p, nullptr).ok());
        SelectedPairs sel;
        const KernelStatus waited = sp->Wait(nullptr, &sel);
        ASSERT_TRUE(waited.ok()) << waited.message;
        const std::vector<uint32_t> got(sel.indices, sel.indices + sel.count);
        EXPECT_EQ(got, want) << (multi ? "multi-kernel" : "one block");
        EXPECT_EQ(sel.info.adjustments, rule.adjustments);
      }
    }
  }
}

// The one-block path's faults: a non-finite u is INVALID_ARGUMENT naming
// the first position, with u untouched; zero_selected false leaves u as it
// was; after Accumulate the selection reads u (the update's histogram is
// not used, and SelectInfo says so).
TEST_F(GpuTest, OneBlockPathReportsNonFiniteAndKeepsU) {
  const size_t n = 1000;
  std::vector<float> u = MakeInput(Distribution::kNormal, n, 3);
  std::unique_ptr<Sparsifier> sp;
  ASSERT_TRUE(Sparsifier::Create(n, &sp).ok());
  // A NaN before an Inf, then a -Inf alone.
  for (const int bad : {321, 700}) {
    u[321] = bad == 321 ? std::numeric_limits<float>::quiet_NaN() : 0.5f;
    u[700] = -std::numeric_limits<float>::infinity();
    for (const Method method :
         {Method::kExact, Method::kGaussianK, Method::kDgc}) {
      SCOPED_TRACE(std::string(MethodName(method)) + " " +
                   std::to_string(bad));
      DeviceVector d(u);
      SelectParams p;
      p.method = method;
      p.k = 10;
      ASSERT_TRUE(sp->Select(d.buffer.get(), n, p, nullptr).ok());
      SelectedPairs sel;
      const KernelStatus waited = sp->Wait(nullptr, &sel);
      EXPECT_EQ(waited.code, KernelStatusCode::kInvalidArgument);
      EXPECT_THAT(waited.message,
                  HasSubstr("position " + std::to_string(bad)));
      const std::vector<float> after = d.ToHost(n);
      for (size_t i = 0; i < n; ++i) {
        ASSERT_EQ(FloatBits(after[i]), FloatBits(u[i])) << i;
      }
    }
  }
  u[321] = 0.5f;
  u[700] = -2.0f;
  DeviceVector grad(u), residual(std::vector<float>(n, 0.0f));
  UpdateParams up;
  up.lr = 1.0f;
  up.momentum = 0.0f;
  up.momentum_correction = false;
  ASSERT_TRUE(sp->Accumulate(grad.buffer.get(), nullptr, nullptr, nullptr,
                             residual.buffer.get(), residual.buffer.get(), n,
                             up, nullptr)
                  .ok());
  SelectParams p;
  p.k = 10;
  p.zero_selected = false;
  ASSERT_TRUE(sp->Select(residual.buffer.get(), n, p, nullptr).ok());
  SelectedPairs sel;
  ASSERT_TRUE(sp->Wait(nullptr, &sel).ok());
  EXPECT_TRUE(sel.info.one_block);
  EXPECT_FALSE(sel.info.used_update_histogram);
  SparseVector got;
  got.indices.assign(sel.indices, sel.indices + sel.count);
  got.values.assign(sel.values, sel.values + sel.count);
  ExpectSameBits(got, ReferenceTopK(u, 10));
  ExpectZeroedExactly(residual, u, {});
}

// Gaussian-k's threshold is mean + z*std of u (arXiv:1911.08772): on normal
// data, where no adjustment is needed, the selection is exactly the |u_i|
// above the threshold computed here in long double. The count contract alone
// would not notice wrong sums (the planner adjusts a bad threshold into
// range), so this checks the mean and variance the kernels reduce.
TEST_F(GpuTest, GaussianKThresholdIsMeanPlusZTimesStd) {
  const size_t n = 100003;
  const uint64_t k = 1000;
  const std::vector<float> u = MakeInput(Distribution::kNormal, n, 21);
  long double sum = 0.0L;
  for (float x : u) sum += x;
  const long double mean = sum / n;
  long double ss = 0.0L;
  for (float x : u) ss += (x - mean) * (x - mean);
  const long double sd = std::sqrt(ss / (n - 1));
  const double z = cpu::NormalQuantile(1.0 - static_cast<double>(k) / n / 2.0);
  const double t = static_cast<double>(mean + z * sd);
  std::vector<uint32_t> want;
  for (size_t i = 0; i < n; ++i) {
    // No value so close to t that rounding of the sums could decide it.
    ASSERT_GT(std::fabs(std::fabs(static_cast<double>(u[i])) - t), 1e-6 * t)
        << i;
    if (std::fabs(u[i]) > t) want.push_back(static_cast<uint32_t>(i));
  }
  GTOPK_ASSERT_OK_AND_ASSIGN(auto selector,
                             CudaSelector::Create("gaussiank", {}, n));
  SparseVector got;
  GTOPK_ASSERT_OK(selector->Select(u, k, 0, &got));
  ASSERT_FALSE(selector->last_info().fell_back);
  ASSERT_EQ(selector->last_info().adjustments, 0);
  EXPECT_EQ(got.indices, want);
}

// Gaussian-k raising its threshold on the device (GaussResolve): the first
// threshold t0 = mean + z*std leaves more than MaxCount(k) survivors, but
// they lie in t0's digit-0 histogram bin, so the planner cannot rule t0 out
// and the first count is refused; t1 = 1.5*t0, whose bin the histogram
// cannot decide either, was counted exactly in the same pass, and the
// device compacts once more at t1's key. Entries sit exactly at the
// smallest float above t1 (and at its neighbours, so whichever float the
// device's t1 picks holds some), so a count that missed those ties (key >
// instead of >=) would disagree with the compaction at t1 (an INTERNAL
// error) or move the threshold. The
// reference is the CPU rule in plain loops, with t0 in long double:
// #{|u| > t0} > MaxCount, #{|u| > t1} in range, selection {i : |u_i| > t1}.
TEST_F(GpuTest, GaussianKRaisedThresholdCountsTiesAtItsKey) {
  const size_t n = 10000;
  const uint64_t k = 100;
  const uint64_t lo = 67, hi = 133;  // ceil(2k/3), floor(4k/3)
  const double z = cpu::NormalQuantile(1.0 - static_cast<double>(k) / n / 2.0);
  const auto min_float_above = MinFloatAbove;
  const auto threshold = [&](const std::vector<float>& u) {
    return GaussianThresholdOf(u, z);
  };
  // 80 entries in [4.5, 5.3), above t1 (~3.88); 100 in [2.70, 2.74), above
  // t0 (~2.59) in its digit-0 bin [2.5, 2.75); two entries at each of the
  // seven floats around the smallest float above t1 (which lies 2.5e-8 of
  // t1 above it, the float below 3.6e-8 under it: far beyond the rounding
  // of any device's sums); the rest spread over [-1.49, 1.49]. Groups
  // interleaved over the index range, signs mixed.
  const auto build = [&](float tie) {
    std::vector<float> u(n);
    std::vector<float> big;
    for (int j = 0; j < 80; ++j) big.push_back(4.5f + 0.01f * j);
    for (int j = 0; j < 100; ++j) big.push_back(2.70f + 0.0004f * j);
    for (int d = -3; d <= 3; ++d) {
      float f = tie;
      for (int s = 0; s < std::abs(d); ++s) {
        f = std::nextafter(f, d < 0 ? 0.0f : 10.0f);
      }
      big.push_back(f);
      big.push_back(f);
    }
    const size_t stride = n / big.size();
    size_t b = 0, bulk = 0;
    for (size_t i = 0; i < n; ++i) {
      float x;
      if (i % stride == 7 && b < big.size()) {
        x = big[b++];
      } else {
        x = 1.49f * (static_cast<float>(bulk % 4096) + 0.5f) / 4096.0f;
        ++bulk;
      }
      u[i] = (i * 7 + i / 3) % 2 == 0 ? x : -x;
    }
    return u;
  };
  // The ties depend on t1, which depends (weakly) on the ties: iterate.
  float tie = 3.9f;
  std::vector<float> u;
  long double t0 = 0.0L;
  for (int iteration = 0; iteration < 4; ++iteration) {
    u = build(tie);
    t0 = threshold(u);
    const float next = min_float_above(1.5L * t0);
    if (next == tie) break;
    tie = next;
  }
  const long double t1 = 1.5L * t0;
  ASSERT_EQ(min_float_above(t1), tie) << "the ties did not settle";
  // Decided beyond the rounding of any device's sums: no |u_i| near t0, and
  // t1 not near a float (both within 1e-9 relative pick the same float).
  ASSERT_EQ(min_float_above(t1 * (1.0L - 1e-9L)),
            min_float_above(t1 * (1.0L + 1e-9L)));
  uint64_t count0 = 0, count1 = 0, ties = 0, at_bin_top = 0;
  std::vector<uint32_t> want;
  for (size_t i = 0; i < n; ++i) {
    const long double a = std::fabs(u[i]);
    ASSERT_GT(std::fabs(a - t0), 1e-9L * t0) << i;
    count0 += a > t0;
    at_bin_top += a >= 2.75L;
    ties += std::fabs(u[i]) == tie;
    if (a > t1) {
      ++count1;
      want.push_back(static_cast<uint32_t>(i));
    }
  }
  ASSERT_GE(t0, 2.5L);  // t0 in the digit-0 bin [2.5, 2.75) ...
  ASSERT_LT(t0, 2.70L);
  ASSERT_LE(at_bin_top, hi);  // ... whose bounds the planner cannot decide
  ASSERT_GT(count0, hi);      // too many survivors: raise to t1
  ASSERT_GE(count1, lo);
  ASSERT_LE(count1, hi);
  ASSERT_EQ(ties, 2u);
  ASSERT_GE(count1 - ties, lo);  // without the ties still in range
  GTOPK_ASSERT_OK_AND_ASSIGN(auto selector,
                             CudaSelector::Create("gaussiank", {}, n));
  ASSERT_EQ(selector->MinCount(k), lo);
  ASSERT_EQ(selector->MaxCount(k), hi);
  DeviceVector d(u);
  SparseVector got;
  GTOPK_ASSERT_OK(selector->SelectDevice(d.buffer.get(), n, k, 0, nullptr,
                                         /*zero_selected=*/true, &got));
  // Corrected on the device: one more compaction at t1's key, no host
  // round trip.
  EXPECT_TRUE(selector->last_info().fast_path);
  EXPECT_TRUE(selector->last_info().corrected_on_device);
  EXPECT_FALSE(selector->last_info().fell_back);
  EXPECT_EQ(selector->last_info().adjustments, 1);
  EXPECT_EQ(selector->last_info().candidates, count1);
  ASSERT_EQ(got.indices, want);
  for (size_t j = 0; j < got.size(); ++j) {
    ASSERT_EQ(FloatBits(got.values[j]), FloatBits(u[want[j]])) << j;
  }
  ExpectZeroedExactly(d, u, want);
}

// The CPU Gaussian-k rule (arXiv:1911.08772, common/cpu/gaussiank_
// selector.cc) in plain loops: t = mean + z*std of u in long double, scaled
// by `scale`; while the count #{i : |u_i| > t} is outside [ceil(2k/3),
// floor(4k/3)], t *= 0.5 (too few) or 1.5 (too many), at most
// max_adjustments times and while t > 0; then the exact top-k (at once when
// the range holds one count).
struct PlainGaussianK {
  bool fell_back = false;
  int adjustments = 0;
  uint64_t first_count = 0;     // survivors of the first threshold
  std::vector<uint32_t> indices;  // {i : |u_i| > t} when !fell_back
  bool operator==(const PlainGaussianK& o) const {
    return fell_back == o.fell_back && adjustments == o.adjustments &&
           indices == o.indices;
  }
};

PlainGaussianK RunPlainGaussianK(const std::vector<float>& u, uint64_t k,
                                 int max_adjustments, long double scale) {
  PlainGaussianK out;
  const size_t n = u.size();
  const uint64_t lo = (2 * k + 2) / 3, hi = 4 * k / 3;
  if (k == n || lo >= hi) {  // no range to adjust into: the exact top-k
    out.fell_back = true;
    return out;
  }
  long double sum = 0.0L;
  for (float x : u) sum += x;
  const long double mean = sum / n;
  long double ss = 0.0L;
  for (float x : u) ss += (x - mean) * (x - mean);
  const double z = cpu::NormalQuantile(
      1.0 - static_cast<double>(k) / static_cast<double>(n) / 2.0);
  double t = static_cast<double>(
      (mean + z * std::sqrt(n > 1 ? ss / (n - 1) : 0.0L)) * scale);
  const auto count_above = [&](double threshold) {
    uint64_t c = 0;
    for (float x : u) c += static_cast<double>(std::fabs(x)) > threshold;
    return c;
  };
  out.first_count = count_above(t);
  for (int adjustment = 0;; ++adjustment) {
    const uint64_t count = count_above(t);
    if (count >= lo && count <= hi) {
      out.adjustments = adjustment;
      for (size_t i = 0; i < n; ++i) {
        if (static_cast<double>(std::fabs(u[i])) > t) {
          out.indices.push_back(static_cast<uint32_t>(i));
        }
      }
      return out;
    }
    out.adjustments = adjustment;  // where the rule stops, if it does here
    if (adjustment == max_adjustments) break;
    t = count < lo ? t * 0.5 : t * 1.5;
    if (t <= 0.0) break;
  }
  out.fell_back = true;
  return out;
}

// Gaussian-k on the device against the plain rule and the CPU selector, on
// every input kind, several densities and adjustment budgets: the same
// pairs bit for bit, the same adjustment count (where the rule stopped,
// when it falls back), the exact top-k where it falls back. When the first
// compaction's count is out of range the device corrects the threshold
// itself (one more pass, no host round trip: fast_path and
// corrected_on_device). Cases whose first threshold sits
// within 1e-5 of deciding differently are not compared (the device's double
// sums and the CPU's float lanes, off by up to ~1e-6, round unlike long
// double: dense inputs such as `ascending` at n = 100003 change their
// count within 1e-5); they must be at most 1 in 20.
TEST_F(GpuTest, GaussianKFollowsTheCpuRuleOnEveryInput) {
  int compared = 0, unsettled = 0, corrected = 0, lowered = 0, raised = 0,
      multi_step = 0, fell_back = 0;
  for (Distribution dist :
       {Distribution::kNormal, Distribution::kHeavyTailed,
        Distribution::kManyZeros, Distribution::kAllZeros,
        Distribution::kAllEqual, Distribution::kFewLevels,
        Distribution::kDenormals, Distribution::kAscending,
        Distribution::kSpike, Distribution::kNarrowBand, Distribution::kTies,
        Distribution::kLaplaceZeros, Distribution::kOutliers}) {
    for (size_t n : {size_t{4099}, size_t{100003}}) {
      const std::vector<float> u = MakeInput(dist, n, /*seed=*/n + 17);
      // 0.8: floor(4k/3) above n.
      for (double density : {0.0001, 0.001, 0.01, 0.3, 0.8}) {
        GTOPK_ASSERT_OK_AND_ASSIGN(const uint64_t k, KFromDensity(density, n));
        for (int max_adjustments : {1, 4, 16}) {
          SCOPED_TRACE(DistributionName(dist) + " n=" + std::to_string(n) +
                       " density=" + std::to_string(density) +
                       " max_adjustments=" + std::to_string(max_adjustments));
          const PlainGaussianK want =
              RunPlainGaussianK(u, k, max_adjustments, 1.0L - 1e-5L);
          if (!(want == RunPlainGaussianK(u, k, max_adjustments,
                                          1.0L + 1e-5L))) {
            std::printf("unsettled: %s n=%zu density=%g max_adjustments=%d\n",
                        DistributionName(dist).c_str(), n, density,
                        max_adjustments);
            ++unsettled;
            continue;
          }
          SelectorOptions options;
          options.gaussiank_max_adjustments = max_adjustments;
          GTOPK_ASSERT_OK_AND_ASSIGN(
              auto selector, CudaSelector::Create("gaussiank", options, n));
          GTOPK_ASSERT_OK_AND_ASSIGN(auto cpu_selector,
                                     CreateSelector("gaussiank", options));
          DeviceVector d(u);
          SparseVector got, cpu_got;
          GTOPK_ASSERT_OK(selector->SelectDevice(d.buffer.get(), n, k, 0,
                                                 nullptr, true, &got));
          GTOPK_ASSERT_OK(cpu_selector->Select(u, k, 0, &cpu_got));
          const SelectInfo& info = selector->last_info();
          ++compared;
          ExpectSameBits(got, cpu_got);
          ASSERT_NO_FATAL_FAILURE(ExpectZeroedExactly(d, u, got.indices));
          const auto* cpu_gaussiank =
              dynamic_cast<const cpu::GaussianKSelector*>(cpu_selector.get());
          ASSERT_NE(cpu_gaussiank, nullptr);
          EXPECT_EQ(cpu_gaussiank->last_adjustments(), want.adjustments);
          EXPECT_EQ(info.adjustments, want.adjustments);
          if (want.fell_back) {
            ++fell_back;
            EXPECT_TRUE(info.fell_back);
            EXPECT_TRUE(cpu_gaussiank->last_fell_back());
            ExpectSameBits(got, ReferenceTopK(u, k));
            // Again on the same selector: having fallen back, it enqueues
            // the exact top-k gated on the device's verdict, which runs
            // with no host round trip (the k == n and single-count ranges
            // take the exact path directly, always without one). Also on
            // denormals with 16 adjustments, where every threshold shares
            // digit-0 bin 0 (all undecided) and the rule can reach 153 keys:
            // all are listed and counted, none is left to the host.
            DeviceVector again(u);
            SparseVector got_again;
            GTOPK_ASSERT_OK(selector->SelectDevice(
                again.buffer.get(), n, k, 1, nullptr, true, &got_again));
            ExpectSameBits(got_again, got);
            ASSERT_NO_FATAL_FAILURE(
                ExpectZeroedExactly(again, u, got_again.indices));
            EXPECT_TRUE(selector->last_info().fell_back);
            EXPECT_EQ(selector->last_info().adjustments, want.adjustments);
            const uint64_t lo = selector->MinCount(k);
            if (k != n && lo != selector->MaxCount(k)) {
              EXPECT_TRUE(selector->last_info().fast_path)
                  << "a host round trip";
            }
            continue;
          }
          EXPECT_FALSE(info.fell_back);
          EXPECT_EQ(got.indices, want.indices);
          EXPECT_TRUE(info.fast_path) << "a host round trip";
          multi_step += want.adjustments >= 2;
          if (info.corrected_on_device) {
            ++corrected;
            EXPECT_GE(info.adjustments, 1);
            (want.indices.size() > want.first_count ? lowered : raised)++;
          }
        }
      }
    }
  }
  EXPECT_LE(unsettled * 20, compared) << "too few cases compared";
  // Every path was taken: corrections lowering and raising the threshold,
  // chains of adjustments, and the exact fallback.
  EXPECT_GT(lowered, 0);
  EXPECT_GT(raised, 0);
  EXPECT_GT(multi_step, 0);
  EXPECT_GT(fell_back, 0);
  std::printf("compared %d (unsettled %d): corrected %d (lowered %d, raised "
              "%d), multi-step %d, fell back %d\n",
              compared, unsettled, corrected, lowered, raised, multi_step,
              fell_back);
}

// Gaussian-k lowering its threshold on the device, built so that the
// correction needs the exact counts of the first compaction pass
// (n = 10000, k = 100, range [67, 133]; t0 = mean + z*std ~ 2.64, in the
// digit-0 bin [2.5, 2.75), t1 = t0/2 ~ 1.32 in [1.25, 1.375)):
//  * lower: 40 entries above t0 and 40 in t0's bin below it, so the
//    histogram cannot decide t0 and its count, 40, is too few; t1's bin
//    holds 50 entries below t1, so the histogram cannot decide t1 either
//    (between 100 and 150): its count, 100, comes from the listed key.
//  * lower, then raise: the 50 sit above t1 (count 150, too many), and
//    t2 = 1.5*t1 ~ 1.99 leaves 100 (the histogram decides that one).
// The rest is +-1.0. Against the rule in plain loops: the same selection
// and adjustments, fast_path and corrected_on_device, one more compaction
// (candidates = the count); with no keys listed (the test hook) the host
// continues and selects the same.
TEST_F(GpuTest, GaussianKLoweredThresholdIsCorrectedOnTheDevice) {
  const size_t n = 10000;
  const uint64_t k = 100;
  struct Group {
    int count;
    float lo, hi;
  };
  const auto build = [&](const std::vector<Group>& groups) {
    std::vector<float> big;
    for (const Group& g : groups) {
      for (int j = 0; j < g.count; ++j) {
        big.push_back(g.lo + (g.hi - g.lo) * static_cast<float>(j) / g.count);
      }
    }
    std::vector<float> u(n, 1.0f);
    const size_t stride = n / big.size();
    for (size_t b = 0; b < big.size(); ++b) u[b * stride + 7] = big[b];
    for (size_t i = 1; i < n; i += 2) u[i] = -u[i];  // mean ~ 0
    return u;
  };
  struct Variant {
    const char* name;
    std::vector<Group> groups;
    int adjustments;
  };
  const Variant variants[] = {
      {"lower", {{40, 3.0f, 3.5f}, {40, 2.5f, 2.55f}, {20, 1.6f, 2.0f},
                 {50, 1.25f, 1.27f}}, 1},
      {"lower then raise", {{40, 3.0f, 3.5f}, {40, 2.5f, 2.55f},
                            {20, 2.2f, 2.4f}, {50, 1.34f, 1.37f}}, 2},
  };
  for (const Variant& v : variants) {
    SCOPED_TRACE(v.name);
    const std::vector<float> u = build(v.groups);
    const PlainGaussianK want = RunPlainGaussianK(u, k, 4, 1.0L);
    ASSERT_TRUE(want == RunPlainGaussianK(u, k, 4, 1.0L - 1e-6L));
    ASSERT_TRUE(want == RunPlainGaussianK(u, k, 4, 1.0L + 1e-6L));
    ASSERT_FALSE(want.fell_back);
    ASSERT_EQ(want.first_count, 40u);  // too few at t0
    ASSERT_EQ(want.adjustments, v.adjustments);
    ASSERT_EQ(want.indices.size(), 100u);
    GTOPK_ASSERT_OK_AND_ASSIGN(auto selector,
                               CudaSelector::Create("gaussiank", {}, n));
    DeviceVector d(u);
    SparseVector got;
    GTOPK_ASSERT_OK(selector->SelectDevice(d.buffer.get(), n, k, 0, nullptr,
                                           /*zero_selected=*/true, &got));
    const SelectInfo& info = selector->last_info();
    EXPECT_TRUE(info.fast_path);
    EXPECT_TRUE(info.corrected_on_device);
    EXPECT_FALSE(info.fell_back);
    EXPECT_EQ(info.adjustments, v.adjustments);
    EXPECT_EQ(info.candidates, want.indices.size());
    ASSERT_EQ(got.indices, want.indices);
    for (size_t j = 0; j < got.size(); ++j) {
      ASSERT_EQ(FloatBits(got.values[j]), FloatBits(u[want.indices[j]])) << j;
    }
    ExpectZeroedExactly(d, u, want.indices);
    GTOPK_ASSERT_OK_AND_ASSIGN(auto host,
                               CudaSelector::Create("gaussiank", {}, n));
    host->sparsifier()->set_gaussiank_key_limit_for_testing(0);
    SparseVector host_got;
    GTOPK_ASSERT_OK(host->Select(u, k, 0, &host_got));
    EXPECT_FALSE(host->last_info().fast_path);
    EXPECT_EQ(host->last_info().adjustments, v.adjustments);
    ExpectSameBits(host_got, got);
  }
}

// One step of a selection sequence on one selector: the input and what
// its SelectInfo must say (-1: either).
struct PredictedStep {
  const std::vector<float>* u;
  int fell_back, fast_path;
  bool exact;  // the selection is the exact top-k of u
  int sampled = -1;  // SelectInfo::exact_sampled
};

// Runs `steps` through one selector per stream (a created stream, where
// selections replay as graphs, then the legacy stream, where they are
// enqueued directly), each step at step number i, and checks each against
// a fresh selector's Select at the same step (bits and adjustments), the
// reference where exact, and the zeroed residual.
void ExpectPredictedSequence(
    const char* method, size_t n, uint64_t k,
    absl::Span<const PredictedStep> steps,
    const std::function<void(Sparsifier*)>& setup = [](Sparsifier*) {}) {
  cudaStream_t created = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&created, cudaStreamNonBlocking),
            cudaSuccess);
  for (cudaStream_t stream : {created, static_cast<cudaStream_t>(nullptr)}) {
    SCOPED_TRACE(stream == nullptr ? "legacy stream" : "created stream");
    GTOPK_ASSERT_OK_AND_ASSIGN(auto selector,
                               CudaSelector::Create(method, {}, n));
    setup(selector->sparsifier());
    for (size_t i = 0; i < steps.size(); ++i) {
      SCOPED_TRACE("step " + std::to_string(i));
      const std::vector<float>& u = *steps[i].u;
      DeviceVector d(u);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      SparseVector got;
      GTOPK_ASSERT_OK(selector->SelectDevice(d.buffer.get(), n, k, i, stream,
                                             true, &got));
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      const SelectInfo info = selector->last_info();
      if (steps[i].fell_back >= 0) {
        EXPECT_EQ(info.fell_back, steps[i].fell_back == 1);
      }
      if (steps[i].fast_path >= 0) {
        EXPECT_EQ(info.fast_path, steps[i].fast_path == 1);
      }
      if (steps[i].sampled >= 0) {
        EXPECT_EQ(info.exact_sampled, steps[i].sampled == 1);
      }
      GTOPK_ASSERT_OK_AND_ASSIGN(auto fresh,
                                 CudaSelector::Create(method, {}, n));
      SparseVector want;
      GTOPK_ASSERT_OK(fresh->Select(u, k, i, &want));
      ExpectSameBits(got, want);
      EXPECT_EQ(info.adjustments, fresh->last_info().adjustments);
      EXPECT_EQ(info.fell_back, fresh->last_info().fell_back);
      // dgc reports its survivors whichever path took the exact top-k
      // (gaussiank's candidates follow the path: see SelectGaussianK).
      if (std::string(method) == "dgc") {
        EXPECT_EQ(info.candidates, fresh->last_info().candidates);
      }
      if (steps[i].exact) ExpectSameBits(got, ReferenceTopK(u, k));
      ASSERT_NO_FATAL_FAILURE(ExpectZeroedExactly(d, u, got.indices));
    }
  }
  ASSERT_EQ(cudaStreamDestroy(created), cudaSuccess);
}

// The exact fallback follows the last selection: a Sparsifier whose last
// gaussiank selection fell back enqueues the exact top-k gated on the
// device's verdict, so a fallback after a fallback needs no host round trip;
// an input that lands in range after one is still selected by the rule (the
// gated chain does nothing), and the prediction follows.
TEST_F(GpuTest, GaussianKExactFallbackRunsOnTheDeviceAfterAFallback) {
  const size_t n = 100003;
  const uint64_t k = 1000;  // ties: 100 entries of 2.0, then n of 1.0
  const std::vector<float> ties = MakeInput(Distribution::kTies, n, 51);
  const std::vector<float> normal = MakeInput(Distribution::kNormal, n, 52);
  const std::vector<float> band = MakeInput(Distribution::kNarrowBand, n, 53);
  const PredictedStep steps[] = {
      {&ties, 1, 0, true},     // first fallback: Wait runs the exact top-k
      {&ties, 1, 1, true},     // predicted: on the device
      {&band, 1, 1, true},     // a fallback on another input: device
      {&normal, 0, 1, false},  // in range: the rule, gated chain idle
      {&ties, 1, 0, true},     // not predicted: Wait again
      {&ties, 1, 1, true},
  };
  ExpectPredictedSequence("gaussiank", n, k, steps);
}

// Inputs built around the exact top-k's sample at (seed 0, step) for n =
// 100003, k = 1000 (the plan: 196 runs, 3136 keys, the bound at the
// sample's 176th largest key): `base` scaled to |u| < 1 except where
// marked. miss: the first 40 runs' positions hold distinct values above
// 100, so the bound is one of them and fewer than k entries reach it.
// exactly_k: the first 20 runs' positions (at most 320, at least 176 sample
// keys, under the 392 = 1/8 of the sample that would skip the compaction)
// and then positions outside every run, k in all, hold +-7.0: the bound
// is 7.0 and exactly k entries survive.
std::vector<float> AroundTheSample(uint64_t step, size_t n, uint64_t k,
                                   bool exactly_k) {
  std::vector<float> u = MakeInput(Distribution::kNormal, n, 900 + step);
  for (float& x : u) x = std::max(-0.9f, std::min(0.9f, x * 0.1f));
  std::set<uint64_t> marked;
  float big = 100.0f;
  for (uint64_t start : SampleRunStarts(0, step, n, exactly_k ? 20 : 40)) {
    for (uint64_t j = 0; j < 16; ++j) {
      if (!marked.insert(start + j).second) continue;
      u[start + j] = exactly_k ? (marked.size() % 2 ? 7.0f : -7.0f) : big;
      big += 1.0f;
    }
  }
  if (exactly_k) {
    std::vector<bool> sampled(n, false);
    for (uint64_t start : SampleRunStarts(0, step, n, 196)) {
      for (uint64_t j = 0; j < 16; ++j) sampled[start + j] = true;
    }
    for (uint64_t i = 0; i < n && marked.size() < k; i += 7) {
      if (!sampled[i] && marked.insert(i).second) {
        u[i] = marked.size() % 2 ? 7.0f : -7.0f;
      }
    }
    EXPECT_EQ(marked.size(), k);
  } else {
    EXPECT_LT(marked.size(), k);
  }
  return u;
}

// A sampled step after the update whose sample misses (AroundTheSample:
// fewer than k keys reach its bound) falls back to the plan over u, which
// needs one digit pass there: the next exact selection after Accumulate
// uses the update's histogram again instead of sampling for 7 more steps
// (a break-it review's finding). Every step equals ReferenceTopK.
TEST_F(GpuTest, ExactAfterUpdateSampleMissEndsTheSampledStreak) {
  const ExactSampleFrom sample_from(1);
  const size_t n = 100003;
  const uint64_t k = 1000;
  GTOPK_ASSERT_OK_AND_ASSIGN(auto selector,
                             CudaSelector::Create("exact", {}, n));
  const std::vector<float> zeros(n, 0.0f);
  DeviceVector residual(zeros);
  std::vector<float> grown = MakeInput(Distribution::kAllEqual, n, 5);
  for (float& x : grown) x *= 1.25f;
  const std::vector<std::vector<float>> inputs = {
      // 3 digit passes (predicts the key with its ties)
      MakeInput(Distribution::kAllEqual, n, 5),
      grown,                            // which misses: 3 passes
      AroundTheSample(2, n, k, false),  // sampled, and it misses
      AroundTheSample(3, n, k, false),  // the plan with the histogram
  };
  for (uint64_t t = 0; t < inputs.size(); ++t) {
    SCOPED_TRACE("step " + std::to_string(t));
    SelectInfo info;
    ExactStepOnAZeroResidual(selector.get(), residual, inputs[t], k, t,
                             nullptr, &info);
    EXPECT_EQ(info.sampled_after_update, t == 2);
    EXPECT_EQ(info.used_update_histogram, t != 2);
    if (t < 2) {
      EXPECT_GT(info.exact_digit_passes, 1);
    }
    if (t == 2) {
      EXPECT_TRUE(info.fell_back);
      EXPECT_EQ(info.exact_digit_passes, 1);
    }
  }
}

// Exact from a sample, step after step: on normal data the bound's
// survivors are trimmed on the device; on ties and all-equal inputs (the
// bound is the tied key: the sample itself shows more than 1/8 at or above
// it) the compaction keeps the keys above it and counts its ties, and the
// k-th key is the bound: a second pass over u writes the selection; a
// sample that missed (fewer than k survive) takes the plan over u, in Wait
// the first time and gated on the device after one (no round trip);
// exactly k survivors are accepted as they are.
TEST_F(GpuTest, ExactFromASampleFollowsItsPrediction) {
  ExactSampleFrom sample_from(0);
  const size_t n = 100003;
  const uint64_t k = 1000;
  const std::vector<float> normal = MakeInput(Distribution::kNormal, n, 71);
  const std::vector<float> ties = MakeInput(Distribution::kTies, n, 72);
  const std::vector<float> equal = MakeInput(Distribution::kAllEqual, n, 73);
  const std::vector<float> miss2 = AroundTheSample(2, n, k, false);
  const std::vector<float> miss3 = AroundTheSample(3, n, k, false);
  const std::vector<float> miss5 = AroundTheSample(5, n, k, false);
  const std::vector<float> exactly6 = AroundTheSample(6, n, k, true);
  const PredictedStep steps[] = {
      {&normal, 0, 1, true, 1},    // 0: trimmed on the device
      {&ties, 0, 1, true, 1},      // 1: ties at the bound: written from u
      {&miss2, 1, 0, true, 0},     // 2: the sample missed: Wait's plan
      {&miss3, 1, 1, true, 0},     // 3: predicted: on the device
      {&normal, 0, 1, true, 1},    // 4: trimmed; the gated plan idle
      {&miss5, 1, 0, true, 0},     // 5: not predicted: Wait
      {&exactly6, 0, 1, true, 1},  // 6: exactly k survive: accepted
      {&equal, 0, 1, true, 1},     // 7: every value equal: written from u
  };
  ExpectPredictedSequence("exact", n, k, steps);
  // What each step's SelectInfo says, on a fresh selector (legacy stream).
  struct Expect {
    const std::vector<float>* u;
    uint64_t step;
    bool sampled, trimmed, from_u;
  };
  const Expect expects[] = {{&normal, 0, true, true, false},
                            {&ties, 1, true, false, true},
                            {&miss3, 3, false, false, false},
                            {&exactly6, 6, true, false, false},
                            {&equal, 7, true, false, true}};
  for (const Expect& e : expects) {
    SCOPED_TRACE("step " + std::to_string(e.step));
    GTOPK_ASSERT_OK_AND_ASSIGN(auto selector,
                               CudaSelector::Create("exact", {}, n));
    SparseVector got;
    GTOPK_ASSERT_OK(selector->Select(*e.u, k, e.step, &got));
    ExpectSameBits(got, ReferenceTopK(*e.u, k));
    const SelectInfo info = selector->last_info();
    EXPECT_EQ(info.exact_sampled, e.sampled);
    EXPECT_EQ(info.trimmed_on_device, e.trimmed);
    EXPECT_EQ(info.fell_back, !e.sampled);
    if (e.sampled) {
      EXPECT_EQ(info.exact_final_from_u, e.from_u);
      // Survivors: more than k trimmed, exactly k accepted, fewer above a
      // tied bound.
      if (e.trimmed) {
        EXPECT_GT(info.candidates, k);
      } else if (e.from_u) {
        EXPECT_LT(info.candidates, k);
      } else {
        EXPECT_EQ(info.candidates, k);
      }
    }
  }
}

// On a large u (here: any u, through the test hook) gaussiank's gated
// exact fallback starts from a sample too: on the narrow band, where the
// rule ends out of range, the sample's bound holds and the device trims its
// survivors (one pass over u); on ties and all-equal inputs the k-th key
// is the tied bound and a second pass writes the selection; where the
// sample misses, the plan over u follows, from Wait the first time and
// gated on the device after one. Each step equals a fresh selector's and,
// where it fell back, the reference.
TEST_F(GpuTest, GaussianKFallbackStartsFromASampleOnALargeU) {
  ExactSampleFrom sample_from(0);
  const size_t n = 100003;
  const uint64_t k = 1000;
  const std::vector<float> ties = MakeInput(Distribution::kTies, n, 54);
  const std::vector<float> normal = MakeInput(Distribution::kNormal, n, 55);
  const std::vector<float> band = MakeInput(Distribution::kNarrowBand, n, 56);
  const std::vector<float> equal = MakeInput(Distribution::kAllEqual, n, 57);
  const std::vector<float> miss4 = AroundTheSample(4, n, k, false);
  const std::vector<float> miss5 = AroundTheSample(5, n, k, false);
  const PredictedStep steps[] = {
      {&band, 1, 0, true, 0},     // not predicted: Wait's exact top-k
      {&band, 1, 1, true, 1},     // predicted: from a sample, trimmed
      {&ties, 1, 1, true, 1},     // ties at the bound: written from u
      {&equal, 1, 1, true, 1},    // likewise
      {&miss4, 1, 0, true, 0},    // the sample missed: Wait's plan over u
      {&miss5, 1, 1, true, 0},    // predicted: the plan over u, gated
      {&normal, 0, 1, false, 0},  // in range: the rule, gated chains idle
      {&ties, 1, 0, true, 0},     // not predicted: Wait again
  };
  // (With the first pass's candidates, the gated fallbacks after a
  // predicting one would plan with them: GaussianKFallbackTakesThe
  // FirstPassCandidates.)
  ExpectPredictedSequence("gaussiank", n, k, steps, [](Sparsifier* sp) {
    sp->set_gaussiank_fallback_from_candidates_for_testing(false);
  });
}

// dgc's sample hidden from most of u (seed 0, `step`, dgc's default 1 %
// sample: 63 runs at n = 100003): the sampled positions hold small
// distinct magnitudes and every other entry a larger distinct one, so the
// sample's threshold keeps nearly all of u (more than n/8: the exact top-k
// of u by dgc's rule) while the sample shows no ties at it.
std::vector<float> HiddenFromDgc(uint64_t step, size_t n) {
  std::vector<float> u(n);
  for (size_t i = 0; i < n; ++i) u[i] = 1.0f + 1e-6f * static_cast<float>(i);
  float small = 0.1f;
  for (uint64_t start : SampleRunStarts(0, step, n, 63)) {
    for (uint64_t j = 0; j < 16; ++j) {
      u[start + j] = (start + j) % 2 ? small : -small;
      small += 1e-6f;
    }
  }
  return u;
}

// dgc likewise: when more than n/8 entries survive its sampled threshold
// and the sample did not show it (a sample that missed the rest of u) it
// takes the exact top-k from u; after such a step the next enqueues it
// too, gated on the device's count, with no host round trip. With ties at
// the threshold (ties, every value equal) the device selects by the rule
// itself (the keys above the threshold, then the ties in index order).
TEST_F(GpuTest, DgcExactFromURunsOnTheDeviceAfterOne) {
  const size_t n = 100003;
  const uint64_t k = 1000;
  const std::vector<float> ties = MakeInput(Distribution::kTies, n, 61);
  const std::vector<float> equal = MakeInput(Distribution::kAllEqual, n, 62);
  const std::vector<float> normal = MakeInput(Distribution::kNormal, n, 63);
  const std::vector<float> hidden0 = HiddenFromDgc(0, n);
  const std::vector<float> hidden1 = HiddenFromDgc(1, n);
  const std::vector<float> hidden4 = HiddenFromDgc(4, n);
  const std::vector<float> hidden5 = HiddenFromDgc(5, n);
  const PredictedStep steps[] = {
      {&hidden0, 1, 0, true},  // Wait takes the exact top-k from u
      {&hidden1, 1, 1, true},  // predicted: on the device
      {&ties, 1, 1, true},     // ties at the threshold: on the device
      {&normal, 0, 1, false},  // accepted or trimmed; gated chain idle
      {&hidden4, 1, 0, true},  // not predicted: Wait again
      {&hidden5, 1, 1, true},
      {&equal, 1, 1, true},    // every value equal: on the device
  };
  ExpectPredictedSequence("dgc", n, k, steps);
}

// dgc against its rule recomputed in plain loops (the sample's runs, its
// ceil(k * sample / n)-th largest key as threshold T, the survivors key >=
// T: at most k of them are the selection, in index order; more, the exact
// top-k of u), on inputs with ties at T: few levels, ties, every value
// equal, zeros, two levels, and levels whose survivors are just under k =
// 30000, at densities where the survivors are fewer and more than k, steps
// 0..5.
TEST_F(GpuTest, DgcWithTiesAtItsThresholdFollowsItsRule) {
  const size_t n = 100003;
  auto key = [](float x) { return FloatBits(x) & 0x7fffffffu; };
  // 20 % at 2.0 and 20 % at -1.0; 10 % at 2.0 and 19.5 % at 1.0 (just
  // under k = 30000 at or above 1.0); the rest small and distinct.
  std::vector<float> two_levels = MakeInput(Distribution::kNormal, n, 64);
  std::vector<float> near_k = two_levels;
  for (size_t i = 0; i < n; ++i) {
    const float small = 0.01f * two_levels[i];
    two_levels[i] = i % 5 == 0 ? 2.0f : (i % 5 == 1 ? -1.0f : small);
    near_k[i] = i % 1000 < 100 ? 2.0f : (i % 1000 < 295 ? 1.0f : small);
  }
  const std::vector<std::pair<const char*, std::vector<float>>> inputs = {
      {"few_levels", MakeInput(Distribution::kFewLevels, n, 65)},
      {"ties", MakeInput(Distribution::kTies, n, 66)},
      {"all_equal", MakeInput(Distribution::kAllEqual, n, 67)},
      {"all_zeros", MakeInput(Distribution::kAllZeros, n, 68)},
      {"two_levels", two_levels},
      {"near_k", near_k}};
  int at_most_k = 0, more_than_k = 0;
  for (const auto& [name, u] : inputs) {
    for (uint64_t k : {uint64_t{1000}, uint64_t{30000}, uint64_t{45000}}) {
      SCOPED_TRACE(::testing::Message() << name << " k " << k);
      GTOPK_ASSERT_OK_AND_ASSIGN(auto selector,
                                 CudaSelector::Create("dgc", {}, n));
      const uint64_t runs = (static_cast<uint64_t>(std::ceil(0.01 * n)) + 15) / 16;
      const uint64_t sample_k = static_cast<uint64_t>(std::ceil(
          static_cast<double>(runs * 16) * k / static_cast<double>(n)));
      for (uint64_t step = 0; step < 6; ++step) {
        SCOPED_TRACE(step);
        std::vector<uint32_t> sample;
        for (uint64_t start : SampleRunStarts(0, step, n, runs)) {
          for (uint64_t j = 0; j < 16; ++j) sample.push_back(key(u[start + j]));
        }
        std::sort(sample.begin(), sample.end(), std::greater<uint32_t>());
        const uint32_t threshold = sample[sample_k - 1];
        SparseVector want;
        for (size_t i = 0; i < n; ++i) {
          if (key(u[i]) >= threshold) want.push_back(i, u[i]);
        }
        const uint64_t survivors = want.size();
        if (survivors > k) want = ReferenceTopK(u, k);
        (survivors > k ? more_than_k : at_most_k) += 1;
        SparseVector got;
        GTOPK_ASSERT_OK(selector->Select(u, k, step, &got));
        ExpectSameBits(got, want);
        EXPECT_EQ(selector->last_info().candidates, survivors);
        EXPECT_EQ(selector->last_info().fell_back,
                  survivors > k && survivors > n / 8);
      }
    }
  }
  EXPECT_GE(at_most_k, 4) << "more than k survived nearly always";
  EXPECT_GE(more_than_k, 10);
}

// With no keys listed for the device correction (a test hook), a
// correction that needs an exact count besides the first continues on the
// host, which gives the same selections as the device does. The inputs are
// those GaussianKFollowsTheCpuRuleOnEveryInput finds corrected (same seeds),
// plus every input kind at the densities of issue 15.
TEST_F(GpuTest, GaussianKHostContinuationEqualsTheDeviceCorrection) {
  struct Case {
    Distribution dist;
    size_t n;
    double density;
  };
  std::vector<Case> cases = {
      {Distribution::kManyZeros, 4099, 0.001},
      {Distribution::kManyZeros, 4099, 0.01},
      {Distribution::kSpike, 4099, 0.3},
  };
  for (Distribution dist :
       {Distribution::kNormal, Distribution::kFewLevels,
        Distribution::kNarrowBand, Distribution::kTies,
        Distribution::kLaplaceZeros, Distribution::kOutliers,
        Distribution::kHeavyTailed}) {
    for (double density : {0.001, 0.01}) cases.push_back({dist, 4099, density});
  }
  int corrected = 0, host_continued = 0;
  for (const Case& c : cases) {
    SCOPED_TRACE(DistributionName(c.dist) + " n=" + std::to_string(c.n) +
                 " density=" + std::to_string(c.density));
    const std::vector<float> u = MakeInput(c.dist, c.n, /*seed=*/c.n + 17);
    GTOPK_ASSERT_OK_AND_ASSIGN(const uint64_t k, KFromDensity(c.density, c.n));
    SelectorOptions options;
    options.gaussiank_max_adjustments = 16;
    GTOPK_ASSERT_OK_AND_ASSIGN(
        auto device, CudaSelector::Create("gaussiank", options, c.n));
    GTOPK_ASSERT_OK_AND_ASSIGN(auto host,
                               CudaSelector::Create("gaussiank", options, c.n));
    host->sparsifier()->set_gaussiank_key_limit_for_testing(0);
    SparseVector want, got;
    GTOPK_ASSERT_OK(device->Select(u, k, 0, &want));
    GTOPK_ASSERT_OK(host->Select(u, k, 0, &got));
    ExpectSameBits(got, want);
    EXPECT_EQ(host->last_info().adjustments, device->last_info().adjustments);
    EXPECT_EQ(host->last_info().fell_back, device->last_info().fell_back);
    corrected += device->last_info().corrected_on_device;
    host_continued +=
        !host->last_info().fast_path && !host->last_info().fell_back;
  }
  EXPECT_GT(corrected, 0) << "the device never corrected";
  EXPECT_GT(host_continued, 0) << "the host continuation never ran";
}

// SparseUpdater against plain loops, bit for bit: Set, Subtract, then global
// momentum (v = m*velocity + update; velocity = v; params -= v, with update
// +0.0 off the index list).
TEST_F(GpuTest, SparseUpdaterMatchesPlainLoops) {
  const size_t n = 70001;
  std::vector<float> params = MakeInput(Distribution::kNormal, n, 31);
  std::vector<float> velocity = MakeInput(Distribution::kNormal, n, 32);
  const std::vector<float> source = MakeInput(Distribution::kHeavyTailed, n, 33);
  std::vector<uint32_t> idx;
  std::vector<float> val, sub;
  for (uint32_t i = 3; i < n; i += 7) idx.push_back(i);
  idx.push_back(static_cast<uint32_t>(n - 1));
  for (uint32_t i : idx) {
    val.push_back(source[i]);
    sub.push_back(source[i] * 0.25f + 1.0f);
  }
  DeviceVector d_params(params), d_velocity(velocity);
  auto expect_equal = [](const std::vector<float>& got,
                         const std::vector<float>& want, const char* what) {
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < got.size(); ++i) {
      ASSERT_EQ(FloatBits(got[i]), FloatBits(want[i])) << what << " " << i;
    }
  };
  SparseUpdater updater;
  GTOPK_ASSERT_OK(ToAbslStatus(updater.Set(d_params.buffer.get(), n,
                                           idx.data(), val.data(), idx.size(),
                                           nullptr)));
  for (size_t j = 0; j < idx.size(); ++j) params[idx[j]] = val[j];
  expect_equal(d_params.ToHost(n), params, "set");
  GTOPK_ASSERT_OK(ToAbslStatus(updater.Subtract(d_params.buffer.get(), n,
                                                idx.data(), sub.data(),
                                                idx.size(), nullptr)));
  for (size_t j = 0; j < idx.size(); ++j) {
    params[idx[j]] = params[idx[j]] - sub[j];
  }
  expect_equal(d_params.ToHost(n), params, "subtract");
  const float m = 0.9f;
  GTOPK_ASSERT_OK(ToAbslStatus(updater.GlobalMomentum(
      d_params.buffer.get(), d_velocity.buffer.get(), n, m, idx.data(),
      sub.data(), idx.size(), nullptr)));
  std::vector<float> update(n, 0.0f);
  for (size_t j = 0; j < idx.size(); ++j) update[idx[j]] = sub[j];
  for (size_t i = 0; i < n; ++i) {
    const float mv = m * velocity[i];
    const float v = mv + update[i];
    velocity[i] = v;
    params[i] = params[i] - v;
  }
  expect_equal(d_velocity.ToHost(n), velocity, "velocity");
  expect_equal(d_params.ToHost(n), params, "params");
}

TEST_F(GpuTest, NonFiniteInputIsInvalidArgumentAndChangesNothing) {
  const size_t n = 5000;
  for (const char* name : {"exact", "gaussiank", "dgc"}) {
    SCOPED_TRACE(name);
    std::vector<float> u = MakeInput(Distribution::kNormal, n, 9);
    u[1234] = std::numeric_limits<float>::quiet_NaN();
    u[4000] = std::numeric_limits<float>::infinity();
    GTOPK_ASSERT_OK_AND_ASSIGN(auto selector,
                               CudaSelector::Create(name, {}, n));
    DeviceVector d(u);
    SparseVector got;
    EXPECT_THAT(
        selector->SelectDevice(d.buffer.get(), n, 50, 0, nullptr, true, &got),
        StatusIs(absl::StatusCode::kInvalidArgument,
                 HasSubstr("non-finite value (nan) at position 1234")));
    EXPECT_TRUE(got.empty());
    ASSERT_NO_FATAL_FAILURE(ExpectZeroedExactly(d, u, {}));
  }
}

TEST_F(GpuTest, BadArgumentsAreRejected) {
  GTOPK_ASSERT_OK_AND_ASSIGN(auto selector,
                             CudaSelector::Create("exact", {}, 10));
  SparseVector got;
  const std::vector<float> u(10, 1.0f);
  EXPECT_THAT(selector->Select(u, 0, 0, &got),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(selector->Select(u, 11, 0, &got),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(CudaSelector::Create("randomk", {}, 10).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("no CUDA selector")));
  // The capacity grows with n.
  const std::vector<float> big = MakeInput(Distribution::kNormal, 5000, 1);
  GTOPK_ASSERT_OK(selector->Select(big, 7, 0, &got));
  ExpectSameBits(got, ReferenceTopK(big, 7));
}

}  // namespace
}  // namespace cuda
}  // namespace gtopk
