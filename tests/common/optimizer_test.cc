#include "common/optimizer.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "tests/testing/reference.h"
#include "tests/testing/status_matchers.h"

namespace gtopk {
namespace {

using ::gtopk::testing::StatusIs;
using ::testing::HasSubstr;

std::vector<float> Random(size_t n, uint64_t seed, float scale = 1.0f) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, scale);
  std::vector<float> x(n);
  for (float& v : x) v = normal(rng);
  return x;
}

using ::gtopk::testing::BitEqual;

OptimizerRule MakeRule(const OptimizerOptions& o) {
  auto rule = OptimizerRule::Create(o);
  EXPECT_TRUE(rule.ok()) << rule.status();
  return *std::move(rule);
}

TEST(OptimizerTest, AccumulateLocalMatchesTheFormulas) {
  const size_t n = 1001;
  const auto grad = Random(n, 1), params = Random(n, 2);
  for (MomentumMode mode : {MomentumMode::kNone, MomentumMode::kDgcCorrection,
                            MomentumMode::kGlobal}) {
    OptimizerOptions o;
    o.lr = 0.05f;
    o.momentum = 0.9f;
    o.weight_decay = 1e-4f;
    o.momentum_mode = mode;
    OptimizerRule rule = MakeRule(o);
    std::vector<float> velocity = Random(n, 3), residual = Random(n, 4);
    std::vector<float> ref_v = velocity, ref_r = residual;
    // Reference: the documented formula, one operation at a time.
    for (size_t i = 0; i < n; ++i) {
      float g = o.weight_decay * params[i];
      g = grad[i] + g;
      if (mode == MomentumMode::kDgcCorrection) {
        float mv = o.momentum * ref_v[i];
        ref_v[i] = mv + g;
        float step = o.lr * ref_v[i];
        ref_r[i] = ref_r[i] + step;
      } else {
        float step = o.lr * g;
        ref_r[i] = ref_r[i] + step;
      }
    }
    GTOPK_ASSERT_OK(rule.AccumulateLocal(
        100, grad, params, absl::MakeSpan(velocity), absl::MakeSpan(residual)));
    EXPECT_TRUE(BitEqual(velocity, ref_v)) << MomentumModeName(mode);
    EXPECT_TRUE(BitEqual(residual, ref_r)) << MomentumModeName(mode);
  }
}

// Workers apply's identity rule (lr 1, no momentum, no weight decay) takes
// a two-pass path: u = residual + g exactly, and its failures are the
// general path's (the gradient's position first, then the overflow), with
// nothing changed.
TEST(OptimizerTest, IdentityRuleAddsTheGradientAndFailsAsTheGeneralPath) {
  const size_t n = 1001;
  OptimizerOptions o;
  o.lr = 1.0f;
  o.momentum = 0.0f;
  o.momentum_mode = MomentumMode::kNone;
  o.weight_decay = 0.0f;
  OptimizerRule rule = MakeRule(o);
  std::vector<float> grad = Random(n, 5), residual = Random(n, 6);
  std::vector<float> ref = residual;
  for (size_t i = 0; i < n; ++i) ref[i] = ref[i] + grad[i];
  // The parameters are not read: pass the gradient, as AggregateStep does.
  GTOPK_ASSERT_OK(
      rule.AccumulateLocal(7, grad, grad, {}, absl::MakeSpan(residual)));
  EXPECT_TRUE(BitEqual(residual, ref));

  const std::vector<float> r0 = residual;
  grad[400] = INFINITY;
  EXPECT_THAT(rule.AccumulateLocal(8, grad, grad, {}, absl::MakeSpan(residual)),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("gradient has a non-finite value (inf) at "
                                 "position 400")));
  EXPECT_TRUE(BitEqual(residual, r0));
  grad[400] = 0.0f;
  residual[9] = 3e38f;
  grad[9] = 3e38f;
  const std::vector<float> r1 = residual;
  EXPECT_THAT(rule.AccumulateLocal(8, grad, grad, {}, absl::MakeSpan(residual)),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("residual at position 9 would overflow")));
  EXPECT_TRUE(BitEqual(residual, r1));
}

TEST(OptimizerTest, AccumulateLocalRejectsBadInputWithoutChanges) {
  OptimizerRule rule = MakeRule({});
  std::vector<float> grad = Random(10, 1), params = Random(10, 2);
  std::vector<float> velocity(10, 1.0f), residual(10, 2.0f);
  const auto v0 = velocity, r0 = residual;
  grad[7] = NAN;
  EXPECT_THAT(rule.AccumulateLocal(0, grad, params, absl::MakeSpan(velocity),
                                   absl::MakeSpan(residual)),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("gradient has a non-finite value (nan) at "
                                 "position 7")));
  grad[7] = 0;
  EXPECT_THAT(
      rule.AccumulateLocal(0, grad, absl::MakeSpan(params).subspan(1),
                           absl::MakeSpan(velocity), absl::MakeSpan(residual)),
      StatusIs(absl::StatusCode::kInvalidArgument,
               HasSubstr("length mismatch")));
  EXPECT_THAT(rule.AccumulateLocal(-1, grad, params, absl::MakeSpan(velocity),
                                   absl::MakeSpan(residual)),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("step must be >= 0")));
  EXPECT_THAT(
      rule.AccumulateLocal(0, grad, params, {}, absl::MakeSpan(residual)),
      StatusIs(absl::StatusCode::kInvalidArgument,
               HasSubstr("velocity has 0 entries")));
  EXPECT_TRUE(BitEqual(velocity, v0));
  EXPECT_TRUE(BitEqual(residual, r0));
}

TEST(OptimizerTest, ShardedApplicationIsBitIdenticalToWhole) {
  // The servers apply the update per shard range; workers to the whole
  // vector. Both must give the same bits, for every momentum mode.
  const size_t n = 5003;
  const int workers = 7;
  for (MomentumMode mode : {MomentumMode::kNone, MomentumMode::kDgcCorrection,
                            MomentumMode::kGlobal}) {
    OptimizerOptions o;
    o.momentum_mode = mode;
    OptimizerRule rule = MakeRule(o);
    std::vector<float> whole = Random(n, 9), whole_v(n, 0.0f);
    std::vector<float> sharded = whole, sharded_v(n, 0.0f);
    const std::vector<uint64_t> bounds = {0, 1, 2000, 2001, 4999, n};
    for (int step = 0; step < 3; ++step) {
      SparseVector agg;
      std::mt19937_64 rng(step);
      for (uint32_t i = 0; i < n; ++i) {
        if (rng() % 10 == 0)
          agg.push_back(i, static_cast<float>(rng() % 1000) * 0.37f - 100);
      }
      GTOPK_ASSERT_OK(rule.ApplyAggregated(
          agg, 0, workers, absl::MakeSpan(whole), absl::MakeSpan(whole_v)));
      for (size_t s = 0; s + 1 < bounds.size(); ++s) {
        SparseVector part;
        for (size_t j = 0; j < agg.size(); ++j) {
          if (agg.indices[j] >= bounds[s] && agg.indices[j] < bounds[s + 1]) {
            part.push_back(agg.indices[j], agg.values[j]);
          }
        }
        const size_t len = bounds[s + 1] - bounds[s];
        GTOPK_ASSERT_OK(rule.ApplyAggregated(
            part, bounds[s], workers,
            absl::MakeSpan(sharded).subspan(bounds[s], len),
            absl::MakeSpan(sharded_v).subspan(bounds[s], len)));
      }
    }
    EXPECT_TRUE(BitEqual(whole, sharded)) << MomentumModeName(mode);
    EXPECT_TRUE(BitEqual(whole_v, sharded_v)) << MomentumModeName(mode);
  }
}

TEST(OptimizerTest, DenseApplicationEqualsSparseWithEveryIndex) {
  const size_t n = 777;
  const std::vector<float> sum = Random(n, 21, 3.0f);
  SparseVector all;
  for (uint32_t i = 0; i < n; ++i) all.push_back(i, sum[i]);
  for (MomentumMode mode : {MomentumMode::kNone, MomentumMode::kDgcCorrection,
                            MomentumMode::kGlobal}) {
    OptimizerOptions o;
    o.momentum_mode = mode;
    OptimizerRule rule = MakeRule(o);
    std::vector<float> a = Random(n, 22), av(n, 0.5f);
    std::vector<float> b = a, bv = av;
    GTOPK_ASSERT_OK(
        rule.ApplyAggregated(all, 0, 3, absl::MakeSpan(a), absl::MakeSpan(av)));
    GTOPK_ASSERT_OK(rule.ApplyAggregatedDense(sum, 3, absl::MakeSpan(b),
                                              absl::MakeSpan(bv)));
    EXPECT_TRUE(BitEqual(a, b)) << MomentumModeName(mode);
    EXPECT_TRUE(BitEqual(av, bv)) << MomentumModeName(mode);
  }
  OptimizerRule rule = MakeRule({});
  std::vector<float> p(n, 1.0f), bad = sum;
  bad[5] = NAN;
  EXPECT_THAT(
      rule.ApplyAggregatedDense(bad, 3, absl::MakeSpan(p), {}),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("position 5")));
  EXPECT_THAT(rule.ApplyAggregatedDense(absl::MakeSpan(sum).subspan(1), 3,
                                        absl::MakeSpan(p), {}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("dense sum has 776 entries")));
  EXPECT_EQ(p, std::vector<float>(n, 1.0f));
}

TEST(OptimizerTest, ApplyAggregatedMatchesReference) {
  const size_t n = 100;
  SparseVector agg;
  agg.push_back(3, 4.0f);
  agg.push_back(50, -1.5f);
  agg.push_back(99, 0.25f);
  std::vector<float> params = Random(n, 5);
  // kDgcCorrection / kNone: params[i] -= A_i / P on the selected entries only.
  {
    OptimizerRule rule = MakeRule({});
    std::vector<float> p = params;
    GTOPK_ASSERT_OK(rule.ApplyAggregated(agg, 0, 4, absl::MakeSpan(p), {}));
    std::vector<float> ref = params;
    ref[3] -= 1.0f;
    ref[50] -= -0.375f;
    ref[99] -= 0.0625f;
    EXPECT_TRUE(BitEqual(p, ref));
  }
  // kGlobal: V = m V + A/P everywhere, params -= V.
  {
    OptimizerOptions o;
    o.momentum_mode = MomentumMode::kGlobal;
    o.momentum = 0.5f;
    OptimizerRule rule = MakeRule(o);
    std::vector<float> p = params, v(n, 2.0f);
    GTOPK_ASSERT_OK(
        rule.ApplyAggregated(agg, 0, 4, absl::MakeSpan(p), absl::MakeSpan(v)));
    for (size_t i = 0; i < n; ++i) {
      float a = i == 3 ? 1.0f : i == 50 ? -0.375f : i == 99 ? 0.0625f : 0.0f;
      const float expect_v = 1.0f + a;
      EXPECT_EQ(v[i], expect_v) << i;
      EXPECT_EQ(p[i], params[i] - expect_v) << i;
    }
  }
}

TEST(OptimizerTest, ApplyAggregatedRejectsBadInputWithoutChanges) {
  OptimizerRule rule = MakeRule({});
  std::vector<float> params(10, 1.0f);
  SparseVector agg;
  agg.push_back(15, 1.0f);
  EXPECT_THAT(rule.ApplyAggregated(agg, 5, 2, absl::MakeSpan(params), {}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("outside the parameter range [5, 15)")));
  agg.indices[0] = 4;
  EXPECT_THAT(rule.ApplyAggregated(agg, 5, 2, absl::MakeSpan(params), {}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("outside the parameter range")));
  agg.indices[0] = 6;
  EXPECT_THAT(
      rule.ApplyAggregated(agg, 5, 0, absl::MakeSpan(params), {}),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("num_workers")));
  agg.values[0] = INFINITY;
  EXPECT_THAT(
      rule.ApplyAggregated(agg, 5, 2, absl::MakeSpan(params), {}),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("not finite")));
  EXPECT_EQ(params, std::vector<float>(10, 1.0f));
}

TEST(OptimizerTest, MomentumFactorMaskingClearsSentAndSelected) {
  OptimizerRule rule = MakeRule({});
  std::vector<float> v(10, 1.0f);
  SparseVector sent, global;
  for (uint32_t i : {1u, 3u, 5u, 7u}) sent.push_back(i, 1.0f);
  for (uint32_t i : {0u, 3u, 7u, 9u}) global.push_back(i, 1.0f);
  GTOPK_ASSERT_OK(rule.MaskMomentum(sent, global, absl::MakeSpan(v)));
  std::vector<float> expect(10, 1.0f);
  expect[3] = expect[7] = 0.0f;
  EXPECT_EQ(v, expect);
  OptimizerOptions o;
  o.momentum_factor_masking = false;
  std::vector<float> w(10, 1.0f);
  GTOPK_ASSERT_OK(MakeRule(o).MaskMomentum(sent, global, absl::MakeSpan(w)));
  EXPECT_EQ(w, std::vector<float>(10, 1.0f));
  sent.indices[1] = 0;  // unsorted
  EXPECT_THAT(rule.MaskMomentum(sent, global, absl::MakeSpan(v)),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("not strictly ascending")));
}

TEST(OptimizerTest, SchedulesFollowWarmups) {
  OptimizerOptions o;
  o.lr = 0.4f;
  o.lr_warmup_steps = 4;
  o.density = 0.001;
  o.density_warmup = DgcDensityWarmup();
  o.steps_per_epoch = 10;
  OptimizerRule rule = MakeRule(o);
  EXPECT_EQ(rule.LrAt(0), 0.4f * (1.0f / 4.0f));
  EXPECT_EQ(rule.LrAt(3), 0.4f);
  EXPECT_EQ(rule.LrAt(1000), 0.4f);
  EXPECT_EQ(rule.DensityAt(0), 0.25);
  EXPECT_EQ(rule.DensityAt(9), 0.25);
  EXPECT_EQ(rule.DensityAt(10), 0.0625);
  EXPECT_EQ(rule.DensityAt(25), 0.015625);
  EXPECT_EQ(rule.DensityAt(39), 0.004);
  EXPECT_EQ(rule.DensityAt(40), 0.001);
  EXPECT_EQ(*rule.KAt(40, 25557032), 25557u);
  EXPECT_EQ(*rule.KAt(0, 1000), 250u);
  // A warm-up density below the target never lowers it.
  o.density = 0.1;
  EXPECT_EQ(MakeRule(o).DensityAt(35), 0.1);
}

TEST(OptimizerTest, OptionsAreValidated) {
  auto bad = [](auto mutate, const char* what) {
    OptimizerOptions o;
    mutate(o);
    EXPECT_THAT(OptimizerRule::Create(o),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(what)));
  };
  bad([](OptimizerOptions& o) { o.lr = 0; }, "lr must be");
  bad([](OptimizerOptions& o) { o.lr = NAN; }, "lr must be");
  bad([](OptimizerOptions& o) { o.momentum = 1.0f; }, "momentum must be");
  bad([](OptimizerOptions& o) { o.weight_decay = -1; }, "weight_decay");
  bad([](OptimizerOptions& o) { o.lr_warmup_steps = -1; }, "lr_warmup_steps");
  bad([](OptimizerOptions& o) { o.density = 0; }, "density must be");
  bad(
      [](OptimizerOptions& o) {
        o.density_warmup = {0.5, 2.0};
      },
      "density_warmup[1]");
  bad([](OptimizerOptions& o) { o.density_warmup = {0.5}; }, "steps_per_epoch");
  EXPECT_THAT(ParseMomentumMode("nesterov"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("known: none, dgc, global")));
  EXPECT_EQ(*ParseMomentumMode("global"), MomentumMode::kGlobal);
}

// --- Results that would leave the finite range (issue 13, part 3) ---------

constexpr float kHuge = 3e38f;

TEST(OptimizerFiniteTest, AccumulateLocalOverflowChangesNothing) {
  // Each case: a finite gradient (and finite state) whose accumulation would
  // overflow the residual or the DGC velocity. Before the fix the residual
  // (and velocity) became +-Inf and only the next selector noticed.
  struct Case {
    MomentumMode mode;
    float lr, momentum, weight_decay;
    float grad, param, velocity, residual;
    const char* expect;
  };
  const Case cases[] = {
      {MomentumMode::kNone, 1.0f, 0.9f, 0.0f, kHuge, 1.0f, 0.0f, kHuge,
       "residual at position 2 would overflow to inf"},
      {MomentumMode::kGlobal, 1.0f, 0.9f, 0.0f, -kHuge, 1.0f, 0.0f, -kHuge,
       "residual at position 2 would overflow to -inf"},
      {MomentumMode::kDgcCorrection, 1.0f, 0.9f, 0.0f, kHuge, 1.0f, kHuge, 0.0f,
       "velocity at position 2 would overflow to inf"},
      {MomentumMode::kDgcCorrection, 1.0f, 0.0f, 0.0f, kHuge, 1.0f, 0.0f, kHuge,
       "residual at position 2 would overflow to inf"},
      // lr * v overflows although v is finite.
      {MomentumMode::kNone, 10.0f, 0.9f, 0.0f, kHuge, 1.0f, 0.0f, 0.0f,
       "residual at position 2 would overflow"},
      // The weight-decay term overflows the gradient.
      {MomentumMode::kNone, 0.1f, 0.9f, 10.0f, 1.0f, kHuge, 0.0f, 0.0f,
       "weight decay 10 * parameter 3e+38"},
  };
  for (const Case& c : cases) {
    OptimizerOptions o;
    o.lr = c.lr;
    o.momentum = c.momentum;
    o.momentum_mode = c.mode;
    o.weight_decay = c.weight_decay;
    const OptimizerRule rule = MakeRule(o);
    std::vector<float> grad(5, 1.0f), params(5, 0.5f), velocity(5, 0.25f),
        residual(5, 0.125f);
    grad[2] = c.grad;
    params[2] = c.param;
    velocity[2] = c.velocity;
    residual[2] = c.residual;
    const auto velocity0 = velocity, residual0 = residual;
    EXPECT_THAT(
        rule.AccumulateLocal(0, grad, params, absl::MakeSpan(velocity),
                             absl::MakeSpan(residual)),
        StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(c.expect)))
        << MomentumModeName(c.mode);
    EXPECT_TRUE(BitEqual(velocity, velocity0));
    EXPECT_TRUE(BitEqual(residual, residual0));
  }
  // A non-finite residual already there is the state's fault.
  const OptimizerRule rule = MakeRule(OptimizerOptions{});
  std::vector<float> grad(3, 1.0f), params(3, 1.0f), velocity(3, 0.0f),
      residual(3, 0.0f);
  residual[1] = std::numeric_limits<float>::infinity();
  EXPECT_THAT(rule.AccumulateLocal(0, grad, params, absl::MakeSpan(velocity),
                                   absl::MakeSpan(residual)),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("residual holds a non-finite value at "
                                 "position 1")));
  EXPECT_EQ(velocity, std::vector<float>(3, 0.0f));
}

TEST(OptimizerFiniteTest, ApplyAggregatedOverflowIsRefusedAndChangesNothing) {
  for (MomentumMode mode : {MomentumMode::kNone, MomentumMode::kDgcCorrection,
                            MomentumMode::kGlobal}) {
    SCOPED_TRACE(MomentumModeName(mode));
    OptimizerOptions o;
    o.momentum_mode = mode;
    const OptimizerRule rule = MakeRule(o);
    const bool global = mode == MomentumMode::kGlobal;
    // Range [10, 15); index 13 at position 3.
    std::vector<float> params(5, 1.0f), velocity(global ? 5 : 0, 0.0f);
    params[3] = -kHuge;
    const auto params0 = params, velocity0 = velocity;
    SparseVector agg;
    agg.push_back(11, 1.0f);
    agg.push_back(13, 0.6e38f);  // / P = 2: -3e38 - 0.3e38 is finite
    GTOPK_EXPECT_OK(rule.CheckAggregated(agg, 10, 2, params, velocity));
    agg.values[1] = 3.2e38f;  // / 2 = 1.6e38: -3e38 - 1.6e38 = -inf
    const auto expect = StatusIs(absl::StatusCode::kFailedPrecondition,
                                 HasSubstr("params[13] would become -inf"));
    EXPECT_THAT(rule.CheckAggregated(agg, 10, 2, params, velocity), expect);
    EXPECT_THAT(rule.ApplyAggregated(agg, 10, 2, absl::MakeSpan(params),
                                     absl::MakeSpan(velocity)),
                expect);
    EXPECT_TRUE(BitEqual(params, params0));
    EXPECT_TRUE(BitEqual(velocity, velocity0));
    // Dense: the same sum at every position of the range.
    std::vector<float> sum(5, 0.0f);
    sum[1] = 1.0f;
    sum[3] = 3.2e38f;
    EXPECT_THAT(rule.CheckAggregatedDense(sum, 2, 10, params, velocity),
                expect);
    EXPECT_THAT(rule.ApplyAggregatedDense(sum, 2, absl::MakeSpan(params),
                                          absl::MakeSpan(velocity)),
                StatusIs(absl::StatusCode::kFailedPrecondition,
                         HasSubstr("params[3] would become -inf")));
    EXPECT_TRUE(BitEqual(params, params0));
    EXPECT_TRUE(BitEqual(velocity, velocity0));
  }
}

TEST(OptimizerFiniteTest, GlobalVelocityOverflowIsRefused) {
  // One worker: V = 0.9 * 3e38 + 1e38 = 3.7e38 = inf although params (here
  // +3e38) minus a finite V would have stayed finite, and the update itself
  // is finite. Applies to entries outside the selection too (V decays
  // everywhere), so a check over the selection alone would miss it.
  OptimizerOptions o;
  o.momentum_mode = MomentumMode::kGlobal;
  o.momentum = 0.9f;
  const OptimizerRule rule = MakeRule(o);
  std::vector<float> params(4, 0.0f), velocity(4, 0.0f);
  velocity[2] = kHuge;
  params[2] = kHuge;
  SparseVector agg;
  agg.push_back(2, 1e38f);
  EXPECT_THAT(
      rule.CheckAggregated(agg, 0, 1, params, velocity),
      StatusIs(absl::StatusCode::kFailedPrecondition,
               HasSubstr("global velocity[2] would become inf: momentum 0.9 "
                         "* velocity 3e+38 + update 1e+38")));
  // Outside the selection: params[1] = -3e38 with V = 1e38 decaying to
  // 0.9e38: params[1] - V = -3.9e38 = -inf.
  velocity[2] = 0.0f;
  params[1] = -kHuge;
  velocity[1] = 1e38f;
  const auto params0 = params, velocity0 = velocity;
  EXPECT_THAT(rule.ApplyAggregated(agg, 0, 1, absl::MakeSpan(params),
                                   absl::MakeSpan(velocity)),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("params[1] would become -inf")));
  EXPECT_TRUE(BitEqual(params, params0));
  EXPECT_TRUE(BitEqual(velocity, velocity0));
}

TEST(OptimizerFiniteTest, CheckThenApplyIsBitIdenticalToApplyForFiniteSteps) {
  // The check does not change results: many random finite steps give the
  // same bits as the formulas (ApplyAggregatedMatchesReference covers the
  // formulas; here: check OK whenever the result is finite).
  for (MomentumMode mode : {MomentumMode::kNone, MomentumMode::kGlobal}) {
    OptimizerOptions o;
    o.momentum_mode = mode;
    const OptimizerRule rule = MakeRule(o);
    auto params = Random(300, 7, 1e37f);
    std::vector<float> velocity(300, 0.0f);
    for (int step = 0; step < 20; ++step) {
      const auto dense = Random(300, 100 + step, 1e37f);
      SparseVector agg;
      for (uint32_t i = 0; i < 300; i += 7) agg.push_back(i, dense[i]);
      const auto p0 = params, v0 = velocity;
      const absl::Status check =
          rule.CheckAggregated(agg, 0, 3, params, velocity);
      const absl::Status apply = rule.ApplyAggregated(
          agg, 0, 3, absl::MakeSpan(params), absl::MakeSpan(velocity));
      EXPECT_EQ(check, apply);
      bool finite = true;
      for (float x : params) finite &= std::isfinite(x);
      for (float x : velocity) finite &= std::isfinite(x);
      EXPECT_TRUE(finite);
      if (!apply.ok()) {
        EXPECT_TRUE(BitEqual(params, p0));
        EXPECT_TRUE(BitEqual(velocity, v0));
        break;
      }
    }
  }
}

}  // namespace
}  // namespace gtopk
