// GPU selector tests (common/cuda/sparsify.h): exact after the fused update
// (the update's candidates, its predictions, the sampled streak) and exact from
// a sample. Against the CPU reference (tests/testing/reference.h) on fresh
// seeded inputs; skipped, with the reason, without a CUDA device (CTest label
// `gpu`), and run on the CUDA emulator (label `emulator`).
#include "tests/common/cuda/sparsify_test_util.h"

namespace gtopk {
namespace cuda {
namespace sparsify_test {
namespace {

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
      {1.0f, false, 1},      {1.0f, false, 1},
      {1.0f / 16, false, 0},  // the k-th key falls 4 binades under the bin
      {1.0f, false, -1},      // predicted far below: most of u kept
      {1.0f, false, 1},      {1.0f, true, 0},  // predicted for the other n
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
        GTOPK_ASSERT_OK_AND_ASSIGN(const uint64_t k, KFromDensity(density, n));
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
                r.buffer.get(), other, std::max<uint64_t>(1, k / 2), 0, nullptr,
                true, &other_got));
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
          GTOPK_ASSERT_OK(ToAbslStatus(
              sp->Accumulate(d_grad.buffer.get(), nullptr, nullptr, nullptr,
                             d_residual.buffer.get(), d_residual.buffer.get(),
                             n, up, nullptr)));
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
  const SparsifierTuning tuning = ExactSampleFrom(1);
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
                                 CudaSelector::Create("exact", {}, n, tuning));
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
  const SparsifierTuning tuning = ExactSampleFrom(1);
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
          SCOPED_TRACE(input.name + " n=" + std::to_string(n) +
                       " density=" + std::to_string(density) +
                       (stream == nullptr ? " legacy" : " created"));
          GTOPK_ASSERT_OK_AND_ASSIGN(const uint64_t k,
                                     KFromDensity(density, n));
          const uint64_t fine_cap = std::min<uint64_t>(4 * k, n / 32);
          GTOPK_ASSERT_OK_AND_ASSIGN(
              auto selector, CudaSelector::Create("exact", {}, n, tuning));
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
            ExactStepOnAZeroResidual(selector.get(), residual, u, k, t, stream,
                                     &info);
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
                               CudaSelector::Create("exact", {}, n, tuning));
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

// A sampled step after the update whose sample misses (AroundTheSample:
// fewer than k keys reach its bound) falls back to the plan over u, which
// needs one digit pass there: the next exact selection after Accumulate
// uses the update's histogram again instead of sampling for 7 more steps
// (a break-it review's finding). Every step equals ReferenceTopK.
TEST_F(GpuTest, ExactAfterUpdateSampleMissEndsTheSampledStreak) {
  const SparsifierTuning tuning = ExactSampleFrom(1);
  const size_t n = 100003;
  const uint64_t k = 1000;
  GTOPK_ASSERT_OK_AND_ASSIGN(auto selector,
                             CudaSelector::Create("exact", {}, n, tuning));
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
    ExactStepOnAZeroResidual(selector.get(), residual, inputs[t], k, t, nullptr,
                             &info);
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
  const SparsifierTuning tuning = ExactSampleFrom(0);
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
  ExpectPredictedSequence("exact", n, k, steps, tuning);
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
                               CudaSelector::Create("exact", {}, n, tuning));
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

}  // namespace
}  // namespace sparsify_test
}  // namespace cuda
}  // namespace gtopk
