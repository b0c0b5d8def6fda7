// GPU selector tests (common/cuda/sparsify.h): Gaussian-k with the first pass's
// candidates (after Accumulate, or its own histogram pass) and its exact
// fallback over them. Against the CPU reference (tests/testing/reference.h) on
// fresh seeded inputs; skipped, with the reason, without a CUDA device (CTest
// label `gpu`), and run on the CUDA emulator (label `emulator`).
#include "tests/common/cuda/sparsify_test_util.h"

namespace gtopk {
namespace cuda {
namespace sparsify_test {
namespace {

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
    ASSERT_EQ(cudaMemcpy(residual.buffer.get(), zeros.data(), n * sizeof(float),
                         cudaMemcpyHostToDevice),
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
    GTOPK_ASSERT_OK(
        ToAbslStatus(sp->Select(residual.buffer.get(), n, p, nullptr)));
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
        if (host) {
          SetTuningForTesting(selector->sparsifier(), GaussianKKeyLimit(0));
        }
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
        from_update, in_range, corrected, host_continued, fallback_from_update,
        replayed);
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
        GTOPK_ASSERT_OK(ToAbslStatus(sp->Accumulate(
            grad.buffer.get(), nullptr, nullptr, nullptr, residual.buffer.get(),
            residual.buffer.get(), n, up, nullptr)));
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
  const SparsifierTuning tuning = ExactSampleFrom(0);
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
      GTOPK_ASSERT_OK_AND_ASSIGN(
          auto selector, CudaSelector::Create("gaussiank", {}, n, tuning));
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
            GTOPK_ASSERT_OK(selector->SelectDevice(residual.buffer.get(), n, k,
                                                   step, stream, true, &got));
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
  ASSERT_LT(t0, 2.9L);               // under every key F can be
  ASSERT_GE(t0, 2.75L);              // in the bin [2.75, 3.0)
  ASSERT_GT(at_least(2.75f), hi);    // whose count the histogram
  ASSERT_LT(at_least(3.0f), lo);     // leaves undecided
  ASSERT_GE(at_least(band_max), k);  // the update keeps >= k
  ASSERT_LE(at_least(2.9f), n / 8);  // and <= n/8
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

}  // namespace
}  // namespace sparsify_test
}  // namespace cuda
}  // namespace gtopk
