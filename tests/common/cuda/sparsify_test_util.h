// Shared by the GPU selector's tests (tests/common/cuda/sparsify_*_test.cc):
// the fixture that skips without a device, device vectors, the reference
// checks, the inputs and rules the tests build on, and the test hooks
// (common/cuda/sparsify/testing.h) they run under.
#ifndef GTOPK_TESTS_COMMON_CUDA_SPARSIFY_TEST_UTIL_H_
#define GTOPK_TESTS_COMMON_CUDA_SPARSIFY_TEST_UTIL_H_

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
#include "common/cuda/sparsify.h"
#include "common/cuda/sparsify/testing.h"
#include "common/optimizer.h"
#include "common/random.h"
#include "common/selector.h"
#include "common/topk.h"
#include "gtest/gtest.h"
#include "tests/testing/reference.h"
#include "tests/testing/status_matchers.h"

namespace gtopk {
namespace cuda {
namespace sparsify_test {

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
inline void ExpectZeroedExactly(const DeviceVector& d,
                                const std::vector<float>& u,
                                const std::vector<uint32_t>& selected) {
  std::vector<float> expected = u;
  for (uint32_t i : selected) expected[i] = 0.0f;
  const std::vector<float> after = d.ToHost(u.size());
  for (size_t i = 0; i < u.size(); ++i) {
    ASSERT_EQ(FloatBits(after[i]), FloatBits(expected[i])) << "index " << i;
  }
}

inline void ExpectSameBits(const SparseVector& got, const SparseVector& want) {
  ASSERT_EQ(got.indices, want.indices);
  ASSERT_EQ(got.values.size(), want.values.size());
  for (size_t j = 0; j < got.values.size(); ++j) {
    ASSERT_EQ(FloatBits(got.values[j]), FloatBits(want.values[j]))
        << "position " << j << " index " << got.indices[j];
  }
}

// The smallest float strictly above t (t >= 0): the key a device threshold
// t keeps from (MinKeyAbove).
inline float MinFloatAbove(long double t) {
  float f = static_cast<float>(t);
  if (static_cast<long double>(f) <= t) {
    f = std::nextafter(f, std::numeric_limits<float>::infinity());
  }
  return f;
}

// Gaussian-k's first threshold mean + z*std of u (sample std), in long
// double: a reference far beyond the rounding of any device's sums.
inline long double GaussianThresholdOf(const std::vector<float>& u, double z) {
  long double sum = 0.0L;
  for (float x : u) sum += x;
  const long double mean = sum / u.size();
  long double ss = 0.0L;
  for (float x : u) ss += (x - mean) * (x - mean);
  return mean + z * std::sqrt(ss / (u.size() - 1));
}

// Accumulate's parameters for u = residual + lr * gradient: no momentum, no
// weight decay.
inline UpdateParams PlainUpdate(float lr) {
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
inline void StepOnAZeroResidual(CudaSelector* selector, DeviceVector& residual,
                                const std::vector<float>& u, uint64_t k,
                                uint64_t step, cudaStream_t stream,
                                SparseVector* got, SelectInfo* info) {
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
inline void ExactStepOnAZeroResidual(CudaSelector* selector,
                                     DeviceVector& residual,
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
inline void ExpectThresholdSelection(const std::vector<float>& u,
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

// Test names: <input>_n<n>_d<density in units of 1e-4>.
inline std::string CaseName(const ::testing::TestParamInfo<Case>& info) {
  const double d = std::get<2>(info.param);
  return DistributionName(std::get<0>(info.param)) + "_n" +
         std::to_string(std::get<1>(info.param)) + "_d" +
         std::to_string(static_cast<int>(d * 10000));
}

// The input kinds of the CPU selectors' tests, and issue 15's adversarial
// ones.
inline const Distribution kInputKinds[] = {
    Distribution::kNormal,    Distribution::kHeavyTailed,
    Distribution::kManyZeros, Distribution::kAllZeros,
    Distribution::kAllEqual,  Distribution::kFewLevels,
    Distribution::kDenormals, Distribution::kAscending,
    Distribution::kSpike};

inline const Distribution kAdversarialKinds[] = {
    Distribution::kNarrowBand, Distribution::kTies, Distribution::kLaplaceZeros,
    Distribution::kOutliers};

// Test hooks (common/cuda/sparsify/testing.h): exact starts from a sample
// from n = min_n on.
inline SparsifierTuning ExactSampleFrom(uint64_t min_n) {
  SparsifierTuning tuning;
  tuning.exact_sample_min_n = min_n;
  return tuning;
}

// Gaussian-k's device correction lists at most `limit` keys.
inline SparsifierTuning GaussianKKeyLimit(int limit) {
  SparsifierTuning tuning;
  tuning.gaussiank_key_limit = limit;
  return tuning;
}

// The same inputs with exact starting from a sample wherever its plan
// allows (the hook lifts the default minimum of 2^22; the plan itself
// needs n above ~16K, so n = 4099 checks that small inputs keep the plan
// over u, and k small enough for its survivors): the sampled
// bound's survivors trimmed (or accepted) on the device, or the plan over
// u when the bound kept fewer than k or more than n/8: always the
// reference, bit for bit, and the residual zeroed exactly there.
class GpuSampledExactTest : public GpuSelectTest {
 protected:
  const SparsifierTuning tuning_ = ExactSampleFrom(0);
};

// Select through the Sparsifier on a created stream (graphs apply) and Wait:
// the pairs, the info, and the residual left in `d`.
// Select then Wait on a Sparsifier: the first failed call's status, else
// the pairs and the info.
struct Selected {
  KernelStatus status = KernelStatus::Ok();
  SparseVector pairs;
  SelectInfo info;
};

inline Selected TrySelect(Sparsifier* sp, float* u, uint64_t n,
                          const SelectParams& p, cudaStream_t stream) {
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
inline Selected SelectOnStream(Sparsifier* sp, DeviceVector* d, uint64_t n,
                               const SelectParams& p, cudaStream_t stream) {
  Selected out = TrySelect(sp, d->buffer.get(), n, p, stream);
  EXPECT_TRUE(out.status.ok()) << out.status.message;
  return out;
}

// The starts of the sample's runs of 16 for (seed, step) over n entries
// (dgc's, and the exact top-k's sample): MixSeed(MixSeed(seed, step), run)
// * (n - 15) >> 64, run = 0 .. runs-1 (common/random.h's SplitMix64).
inline std::vector<uint64_t> SampleRunStarts(uint64_t seed, uint64_t step,
                                             size_t n, uint64_t runs) {
  std::vector<uint64_t> starts;
  const uint64_t stream_seed = MixSeed(seed, step);
  for (uint64_t r = 0; r < runs; ++r) {
    starts.push_back(static_cast<uint64_t>(
        (static_cast<unsigned __int128>(MixSeed(stream_seed, r)) * (n - 15)) >>
        64));
  }
  return starts;
}

// |x| uniform in [1, 1 + width) with random signs: width 1/8 fills one
// digit-0 bin (an eighth of a binade) evenly; 0.0005 is the narrow band
// (about 4,200 keys shared by all of u).
inline std::vector<float> UniformBand(size_t n, float width, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> unit(0.0f, 1.0f);
  std::vector<float> x(n);
  for (float& v : x) {
    v = (unit(rng) < 0.5f ? -1.0f : 1.0f) * (1.0f + width * unit(rng));
  }
  return x;
}

// The one-block path (SelectInfo::one_block) off (a test hook).
inline SparsifierTuning NoOneBlock() {
  SparsifierTuning tuning;
  tuning.one_block_max_n = 0;
  return tuning;
}

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

inline GaussRule GaussianKInPlainLoops(const std::vector<float>& u, uint64_t k,
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
inline SparseVector DgcInPlainLoops(const std::vector<float>& u, uint64_t k,
                                    uint64_t seed, uint64_t step,
                                    double fraction) {
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
      1, static_cast<uint64_t>(
             std::ceil(static_cast<double>(sample.size()) * k / n)));
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

// Gaussian-k after Accumulate of `first`, `second`, `first`, `second`
// into a zeroed residual on one selector (a created stream, whose second
// round replays graphs, then the legacy one): every step the exact top-k
// (its rule falls back), and on `second`, whose own compaction wrote over
// the update's candidates, a gated plan that did not take them.
inline void ExpectFallbackAfterItsCompactionPlansOverU(
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

// The CPU Gaussian-k rule (arXiv:1911.08772, common/cpu/gaussiank_
// selector.cc) in plain loops: t = mean + z*std of u in long double, scaled
// by `scale`; while the count #{i : |u_i| > t} is outside [ceil(2k/3),
// floor(4k/3)], t *= 0.5 (too few) or 1.5 (too many), at most
// max_adjustments times and while t > 0; then the exact top-k (at once when
// the range holds one count).
struct PlainGaussianK {
  bool fell_back = false;
  int adjustments = 0;
  uint64_t first_count = 0;       // survivors of the first threshold
  std::vector<uint32_t> indices;  // {i : |u_i| > t} when !fell_back
  bool operator==(const PlainGaussianK& o) const {
    return fell_back == o.fell_back && adjustments == o.adjustments &&
           indices == o.indices;
  }
};

inline PlainGaussianK RunPlainGaussianK(const std::vector<float>& u, uint64_t k,
                                        int max_adjustments,
                                        long double scale) {
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
  const double z = cpu::NormalQuantile(1.0 - static_cast<double>(k) /
                                                 static_cast<double>(n) / 2.0);
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

// One step of a selection sequence on one selector: the input and what
// its SelectInfo must say (-1: either).
struct PredictedStep {
  const std::vector<float>* u;
  int fell_back, fast_path;
  bool exact;        // the selection is the exact top-k of u
  int sampled = -1;  // SelectInfo::exact_sampled
};

// Runs `steps` through one selector per stream (a created stream, where
// selections replay as graphs, then the legacy stream, where they are
// enqueued directly), each step at step number i, and checks each against
// a fresh selector's Select at the same step (bits and adjustments), the
// reference where exact, and the zeroed residual.
inline void ExpectPredictedSequence(
    const char* method, size_t n, uint64_t k,
    absl::Span<const PredictedStep> steps,
    const SparsifierTuning& tuning = SparsifierTuning(),
    const std::function<void(SparsifierTuning*)>& setup =
        [](SparsifierTuning*) {}) {
  cudaStream_t created = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&created, cudaStreamNonBlocking),
            cudaSuccess);
  for (cudaStream_t stream : {created, static_cast<cudaStream_t>(nullptr)}) {
    SCOPED_TRACE(stream == nullptr ? "legacy stream" : "created stream");
    // The selector under test with `setup`'s hooks; the fresh ones below
    // with `tuning`'s.
    SparsifierTuning mine = tuning;
    setup(&mine);
    GTOPK_ASSERT_OK_AND_ASSIGN(auto selector,
                               CudaSelector::Create(method, {}, n, mine));
    for (size_t i = 0; i < steps.size(); ++i) {
      SCOPED_TRACE("step " + std::to_string(i));
      const std::vector<float>& u = *steps[i].u;
      DeviceVector d(u);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      SparseVector got;
      GTOPK_ASSERT_OK(
          selector->SelectDevice(d.buffer.get(), n, k, i, stream, true, &got));
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
                                 CudaSelector::Create(method, {}, n, tuning));
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

// Inputs built around the exact top-k's sample at (seed 0, step) for n =
// 100003, k = 1000 (the plan: 196 runs, 3136 keys, the bound at the
// sample's 176th largest key): `base` scaled to |u| < 1 except where
// marked. miss: the first 40 runs' positions hold distinct values above
// 100, so the bound is one of them and fewer than k entries reach it.
// exactly_k: the first 20 runs' positions (at most 320, at least 176 sample
// keys, under the 392 = 1/8 of the sample that would skip the compaction)
// and then positions outside every run, k in all, hold +-7.0: the bound
// is 7.0 and exactly k entries survive.
inline std::vector<float> AroundTheSample(uint64_t step, size_t n, uint64_t k,
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

// dgc's sample hidden from most of u (seed 0, `step`, dgc's default 1 %
// sample: 63 runs at n = 100003): the sampled positions hold small
// distinct magnitudes and every other entry a larger distinct one, so the
// sample's threshold keeps nearly all of u (more than n/8: the exact top-k
// of u by dgc's rule) while the sample shows no ties at it.
inline std::vector<float> HiddenFromDgc(uint64_t step, size_t n) {
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

}  // namespace sparsify_test
}  // namespace cuda
}  // namespace gtopk

#endif  // GTOPK_TESTS_COMMON_CUDA_SPARSIFY_TEST_UTIL_H_
