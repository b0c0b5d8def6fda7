// GPU selector tests (common/cuda/sparsify.h): dgc: its sample, the trim on the
// device, the exact top-k from u, ties at its threshold. Against the CPU
// reference (tests/testing/reference.h) on fresh seeded inputs; skipped, with
// the reason, without a CUDA device (CTest label `gpu`), and run on the CUDA
// emulator (label `emulator`).
#include "tests/common/cuda/sparsify_test_util.h"

namespace gtopk {
namespace cuda {
namespace sparsify_test {
namespace {

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
  const uint64_t runs =
      (static_cast<uint64_t>(std::ceil(fraction * n)) + 15) / 16;
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
      {&equal, 1, 1, true},  // every value equal: on the device
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
      const uint64_t runs =
          (static_cast<uint64_t>(std::ceil(0.01 * n)) + 15) / 16;
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

}  // namespace
}  // namespace sparsify_test
}  // namespace cuda
}  // namespace gtopk
