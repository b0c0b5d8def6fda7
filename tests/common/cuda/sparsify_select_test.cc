// GPU selector tests (common/cuda/sparsify.h): the selectors on every input
// kind against the reference (the parameterised suites), every k of a small
// input, large grids, the residual zeroing. Against the CPU reference
// (tests/testing/reference.h) on fresh seeded inputs; skipped, with the reason,
// without a CUDA device (CTest label `gpu`), and run on the CUDA emulator
// (label `emulator`).
#include "tests/common/cuda/sparsify_test_util.h"

namespace gtopk {
namespace cuda {
namespace sparsify_test {
namespace {

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

INSTANTIATE_TEST_SUITE_P(
    Inputs, GpuSelectTest,
    ::testing::Combine(::testing::ValuesIn(kInputKinds),
                       // n = 1, odd sizes around the 128-entry warp step and
                       // the block size, and one above a million.
                       ::testing::Values(size_t{1}, size_t{1000}, size_t{4099},
                                         size_t{100003}, size_t{(1 << 20) + 7}),
                       ::testing::Values(0.001, 0.01, 0.3)),
    CaseName);

// The adversarial inputs of issue 15 at the densities of its targets: every
// path of the exact plan (compaction after one, two or three digits, the
// final compaction over u) and the gaussiank/dgc continuations that fall
// back to it.
INSTANTIATE_TEST_SUITE_P(
    Adversarial, GpuSelectTest,
    ::testing::Combine(::testing::ValuesIn(kAdversarialKinds),
                       ::testing::Values(size_t{1}, size_t{4099},
                                         size_t{100003}),
                       ::testing::Values(0.0001, 0.01, 0.3)),
    CaseName);

TEST_P(GpuSampledExactTest, ExactFromASampleEqualsTheReference) {
  const auto [dist, n, density] = GetParam();
  const std::vector<float> u = MakeInput(dist, n, /*seed=*/n * 5 + 2);
  GTOPK_ASSERT_OK_AND_ASSIGN(const uint64_t k, KFromDensity(density, n));
  GTOPK_ASSERT_OK_AND_ASSIGN(auto selector,
                             CudaSelector::Create("exact", {}, n, tuning_));
  for (uint64_t step = 0; step < 2; ++step) {
    SCOPED_TRACE(step);
    DeviceVector d(u);
    SparseVector got;
    GTOPK_ASSERT_OK(selector->SelectDevice(d.buffer.get(), n, k, step, nullptr,
                                           /*zero_selected=*/true, &got));
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
    ::testing::Combine(::testing::ValuesIn(kInputKinds),
                       // 40961: the compaction's warp chunk (a multiple of 128)
                       // differs from the final compaction's (of 32), which the
                       // write after ties at the bound must not mix up.
                       ::testing::Values(size_t{4099}, size_t{40961},
                                         size_t{100003}, size_t{(1 << 20) + 7}),
                       ::testing::Values(0.0001, 0.001, 0.01)),
    CaseName);

INSTANTIATE_TEST_SUITE_P(
    Adversarial, GpuSampledExactTest,
    ::testing::Combine(::testing::ValuesIn(kAdversarialKinds),
                       ::testing::Values(size_t{4099}, size_t{40961},
                                         size_t{100003}),
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
        GTOPK_ASSERT_OK(selector->SelectDevice(d.buffer.get(), n, k, 0, nullptr,
                                               /*zero_selected=*/true, &got));
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

}  // namespace
}  // namespace sparsify_test
}  // namespace cuda
}  // namespace gtopk
