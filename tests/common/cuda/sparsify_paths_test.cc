// GPU selector tests (common/cuda/sparsify.h): the paths a selection takes:
// graph replay and direct enqueue, the fast path and the host continuation,
// mixed sequences on one Sparsifier, the one-block path. Against the CPU
// reference (tests/testing/reference.h) on fresh seeded inputs; skipped, with
// the reason, without a CUDA device (CTest label `gpu`), and run on the CUDA
// emulator (label `emulator`).
#include "tests/common/cuda/sparsify_test_util.h"

namespace gtopk {
namespace cuda {
namespace sparsify_test {
namespace {

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
        EXPECT_EQ(got.info.corrected_on_device, want.info.corrected_on_device);
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
        EXPECT_TRUE(info.fast_path)
            << "dgc continued on the host, step " << step;
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
      Distribution::kNormal,    Distribution::kNarrowBand,
      Distribution::kAllEqual,  Distribution::kTies,
      Distribution::kOutliers,  Distribution::kLaplaceZeros,
      Distribution::kFewLevels, Distribution::kManyZeros};
  const uint64_t saved_sample = SparsifierTuning().exact_sample_min_n;
  // The hooks a step runs under (sample_on, key_limit below).
  const auto hooks = [&](bool sample_on, int key_limit) {
    SparsifierTuning tuning = ExactSampleFrom(sample_on ? 0 : saved_sample);
    tuning.gaussiank_key_limit = key_limit;
    return tuning;
  };
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
      bool retune = false;
      if (chance(0.1)) {
        sample_on = !sample_on;
        retune = true;
      }
      if (chance(focus ? 0.04 : 0.08)) {
        key_limit = key_limit == 0 ? 160 : 0;
        retune = true;
      }
      if (retune) SetTuningForTesting(sp.get(), hooks(sample_on, key_limit));
      SelectParams p;
      p.method =
          chance(focus ? 0.85 : 0.7) ? Method::kGaussianK : Method::kExact;
      const uint64_t ks[] = {1,         7,     n / 100, n / 1000, n / 8 - 1,
                             n / 8 + 1, n / 8, n,       1000,     3000};
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
        ASSERT_TRUE(sp->Accumulate(grad.buffer.get(), nullptr, nullptr, nullptr,
                                   target->buffer.get(), target->buffer.get(),
                                   n, PlainUpdate(1.0f), stream)
                        .ok());
        ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
        u = target->ToHost(n);
      } else {
        ASSERT_EQ(cudaMemcpy(target->buffer.get(), in.data(), n * sizeof(float),
                             cudaMemcpyHostToDevice),
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
        EXPECT_THAT(
            sel.status.message,
            HasSubstr("at position " + std::to_string(bad - u.begin())));
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
        // (Its own key limit is the default, as a fresh one's.)
        ASSERT_TRUE(Sparsifier::Create(n, hooks(sample_on, 160), &fresh).ok());
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
  for (const size_t n :
       {size_t{1}, size_t{2}, size_t{17}, size_t{33}, size_t{64}, size_t{1000},
        size_t{2049}, size_t{4096}}) {
    std::unique_ptr<Sparsifier> tiny_sp, multi_sp;
    ASSERT_TRUE(Sparsifier::Create(n, &tiny_sp).ok());
    ASSERT_TRUE(Sparsifier::Create(n, NoOneBlock(), &multi_sp).ok());
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
      SCOPED_TRACE(std::string(MethodName(method)) + " " + std::to_string(bad));
      DeviceVector d(u);
      SelectParams p;
      p.method = method;
      p.k = 10;
      ASSERT_TRUE(sp->Select(d.buffer.get(), n, p, nullptr).ok());
      SelectedPairs sel;
      const KernelStatus waited = sp->Wait(nullptr, &sel);
      EXPECT_EQ(waited.code, KernelStatusCode::kInvalidArgument);
      EXPECT_THAT(waited.message, HasSubstr("position " + std::to_string(bad)));
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

}  // namespace
}  // namespace sparsify_test
}  // namespace cuda
}  // namespace gtopk
