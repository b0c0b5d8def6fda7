// GPU selector tests (common/cuda/sparsify.h): Gaussian-k's rule on the device:
// its threshold, its adjustments and their device correction, the host
// continuation, the gated exact fallback. Against the CPU reference
// (tests/testing/reference.h) on fresh seeded inputs; skipped, with the reason,
// without a CUDA device (CTest label `gpu`), and run on the CUDA emulator
// (label `emulator`).
#include "tests/common/cuda/sparsify_test_util.h"

namespace gtopk {
namespace cuda {
namespace sparsify_test {
namespace {

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

// Gaussian-k's mean and std on values with a large common offset
// (2^24 plus integers in [-4, 4], std about 2.6): the one-pass variance
// (sum of squares minus sum times mean) cancelled there, and the one-block
// path selected 333 pairs where the rule gives 217 (a break-it review's
// input). The CPU selector, the one-block path and the multi-kernel path
// must each follow the rule computed in two passes in long double.
TEST_F(GpuTest, GaussianKOnALargeOffsetFollowsTheRule) {
  for (const size_t n :
       {size_t{1023}, size_t{1024}, size_t{1025}, size_t{100003}}) {
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
        std::unique_ptr<Sparsifier> sp;
        ASSERT_TRUE(Sparsifier::Create(
                        n, multi ? NoOneBlock() : SparsifierTuning(), &sp)
                        .ok());
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
          if (!(want ==
                RunPlainGaussianK(u, k, max_adjustments, 1.0L + 1e-5L))) {
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
            GTOPK_ASSERT_OK(selector->SelectDevice(again.buffer.get(), n, k, 1,
                                                   nullptr, true, &got_again));
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
  std::printf(
      "compared %d (unsettled %d): corrected %d (lowered %d, raised "
      "%d), multi-step %d, fell back %d\n",
      compared, unsettled, corrected, lowered, raised, multi_step, fell_back);
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
      {"lower",
       {{40, 3.0f, 3.5f},
        {40, 2.5f, 2.55f},
        {20, 1.6f, 2.0f},
        {50, 1.25f, 1.27f}},
       1},
      {"lower then raise",
       {{40, 3.0f, 3.5f},
        {40, 2.5f, 2.55f},
        {20, 2.2f, 2.4f},
        {50, 1.34f, 1.37f}},
       2},
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
    SetTuningForTesting(host->sparsifier(), GaussianKKeyLimit(0));
    SparseVector host_got;
    GTOPK_ASSERT_OK(host->Select(u, k, 0, &host_got));
    EXPECT_FALSE(host->last_info().fast_path);
    EXPECT_EQ(host->last_info().adjustments, v.adjustments);
    ExpectSameBits(host_got, got);
  }
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

// On a large u (here: any u, through the test hook) gaussiank's gated
// exact fallback starts from a sample too: on the narrow band, where the
// rule ends out of range, the sample's bound holds and the device trims its
// survivors (one pass over u); on ties and all-equal inputs the k-th key
// is the tied bound and a second pass writes the selection; where the
// sample misses, the plan over u follows, from Wait the first time and
// gated on the device after one. Each step equals a fresh selector's and,
// where it fell back, the reference.
TEST_F(GpuTest, GaussianKFallbackStartsFromASampleOnALargeU) {
  const SparsifierTuning tuning = ExactSampleFrom(0);
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
  ExpectPredictedSequence("gaussiank", n, k, steps, tuning,
                          [](SparsifierTuning* t) {
                            t->gaussiank_fallback_from_candidates = false;
                          });
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
    GTOPK_ASSERT_OK_AND_ASSIGN(auto device,
                               CudaSelector::Create("gaussiank", options, c.n));
    GTOPK_ASSERT_OK_AND_ASSIGN(auto host,
                               CudaSelector::Create("gaussiank", options, c.n));
    SetTuningForTesting(host->sparsifier(), GaussianKKeyLimit(0));
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

}  // namespace
}  // namespace sparsify_test
}  // namespace cuda
}  // namespace gtopk
