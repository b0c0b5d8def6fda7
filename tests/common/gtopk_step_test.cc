// Whole gTop-k steps in one process: P workers with error feedback, a local
// selector and a wire codec; the single-process reference selection; S
// shards that sum their own index ranges and apply the shared optimizer rule.
// Checks that replicas and the shards' copy stay bit-identical, that shard
// partial sums reproduce the reference's bits, that nothing is lost (every
// value accumulated into a residual is either still there or was applied),
// and that a rerun with the same seed gives the same bits.
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "common/codec.h"
#include "common/error_feedback.h"
#include "common/merge.h"
#include "common/optimizer.h"
#include "common/selector.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace gtopk {
namespace {

struct RunResult {
  std::vector<std::vector<float>> worker_params;
  std::vector<float> server_params;
  double max_conservation_error = 0.0;  // relative to the magnitude involved
};

using Param = std::tuple<int, std::string, ValueCodec, MomentumMode>;

RunResult RunSteps(const Param& param, uint64_t seed) {
  const auto& [workers, selector_name, value_codec, mode] = param;
  const uint64_t n = 10007;
  const std::vector<uint64_t> bounds = {0, 3000, 3001, n};  // 3 shards
  const int steps = 12;
  OptimizerOptions o;
  o.lr = 0.1f;
  o.momentum = 0.9f;
  o.momentum_mode = mode;
  o.density = 0.01;
  o.density_warmup = {0.1};
  o.steps_per_epoch = 4;
  const OptimizerRule rule = ::gtopk::testing::OkOrThrow(
      OptimizerRule::Create(o), "OptimizerRule::Create");
  const CodecSpec codec{IndexCodec::kDeltaVarint, value_codec};

  std::mt19937_64 init_rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> init(n);
  for (float& x : init) x = normal(init_rng);

  RunResult r;
  r.worker_params.assign(workers, init);
  r.server_params = init;
  std::vector<std::vector<float>> velocity(workers, std::vector<float>(n));
  std::vector<std::vector<float>> global_v(workers, std::vector<float>(n));
  std::vector<float> server_v(n, 0.0f);
  std::vector<ErrorFeedback> ef;
  std::vector<std::unique_ptr<Selector>> selectors;
  SelectorOptions so;
  so.seed = seed;
  for (int w = 0; w < workers; ++w) {
    ef.emplace_back(n);
    auto s = CreateSelector(selector_name, so);
    EXPECT_TRUE(s.ok());
    selectors.push_back(*std::move(s));
  }
  // Conservation ledger, in double: accumulated = residual + applied.
  std::vector<double> accumulated(n, 0.0), applied(n, 0.0), scale(n, 0.0);

  for (int step = 0; step < steps; ++step) {
    const uint64_t k = ::gtopk::testing::OkOrThrow(rule.KAt(step, n), "KAt");
    std::vector<SparseVector> sent(workers), received(workers);
    for (int w = 0; w < workers; ++w) {
      std::mt19937_64 rng(seed * 1000003 + step * 101 + w);
      std::vector<float> grad(n);
      for (float& g : grad) g = normal(rng);
      std::vector<float> before(ef[w].residual().begin(),
                                ef[w].residual().end());
      EXPECT_THAT(rule.AccumulateLocal(step, grad, r.worker_params[w],
                                       absl::MakeSpan(velocity[w]),
                                       ef[w].mutable_residual()),
                  testing::IsOk());
      for (uint64_t i = 0; i < n; ++i) {
        const double d = static_cast<double>(ef[w].residual()[i]) - before[i];
        accumulated[i] += d;
        scale[i] += std::fabs(d);
      }
      EXPECT_THAT(selectors[w]->Select(ef[w].residual(), k, step, &sent[w]),
                  testing::IsOk());
      std::string wire;
      EXPECT_THAT(EncodeSparse(sent[w], n, codec, &wire), testing::IsOk());
      EXPECT_THAT(DecodeSparse(wire, n, &received[w]), testing::IsOk());
      EXPECT_THAT(ef[w].MarkSent(sent[w], received[w]), testing::IsOk());
    }
    SparseVector global;
    EXPECT_THAT(ReferenceGtopkStep(received, n, k, &global), testing::IsOk());
    EXPECT_LE(global.size(), k);

    // Shards: partial sums over their own ranges reproduce the reference's
    // bits; each applies its part of the global selection.
    for (size_t s = 0; s + 1 < bounds.size(); ++s) {
      std::vector<SparseVector> slices(workers);
      for (int w = 0; w < workers; ++w) {
        for (size_t j = 0; j < received[w].size(); ++j) {
          const uint32_t i = received[w].indices[j];
          if (i >= bounds[s] && i < bounds[s + 1]) {
            slices[w].push_back(i, received[w].values[j]);
          }
        }
      }
      SparseVector partial;
      EXPECT_THAT(SparseSum(slices, n, &partial), testing::IsOk());
      SparseVector mine;
      size_t p = 0;
      for (size_t j = 0; j < global.size(); ++j) {
        const uint32_t i = global.indices[j];
        if (i < bounds[s] || i >= bounds[s + 1]) continue;
        while (p < partial.size() && partial.indices[p] < i) ++p;
        EXPECT_TRUE(p < partial.size() && partial.indices[p] == i);
        if (p < partial.size()) {
          EXPECT_EQ(std::memcmp(&partial.values[p], &global.values[j], 4), 0)
              << "index " << i;
        }
        mine.push_back(i, global.values[j]);
      }
      const size_t len = bounds[s + 1] - bounds[s];
      EXPECT_THAT(rule.ApplyAggregated(
                      mine, bounds[s], workers,
                      absl::MakeSpan(r.server_params).subspan(bounds[s], len),
                      absl::MakeSpan(server_v).subspan(bounds[s], len)),
                  testing::IsOk());
    }
    for (size_t j = 0; j < global.size(); ++j) {
      applied[global.indices[j]] += global.values[j];
    }
    for (int w = 0; w < workers; ++w) {
      EXPECT_THAT(ef[w].PutBack(received[w], global), testing::IsOk());
      EXPECT_THAT(
          rule.MaskMomentum(sent[w], global, absl::MakeSpan(velocity[w])),
          testing::IsOk());
      EXPECT_THAT(rule.ApplyAggregated(global, 0, workers,
                                       absl::MakeSpan(r.worker_params[w]),
                                       absl::MakeSpan(global_v[w])),
                  testing::IsOk());
    }
  }
  for (uint64_t i = 0; i < n; ++i) {
    double residual_sum = 0.0;
    for (int w = 0; w < workers; ++w) residual_sum += ef[w].residual()[i];
    const double err = std::fabs(accumulated[i] - residual_sum - applied[i]);
    r.max_conservation_error =
        std::max(r.max_conservation_error, err / (scale[i] + 1e-30));
  }
  return r;
}

class GtopkStepTest : public ::testing::TestWithParam<Param> {};

TEST_P(GtopkStepTest, ReplicasAgreeNothingIsLostAndRunsRepeat) {
  const RunResult a = RunSteps(GetParam(), 7);
  const int workers = std::get<0>(GetParam());
  for (int w = 0; w < workers; ++w) {
    ASSERT_EQ(std::memcmp(a.worker_params[w].data(), a.server_params.data(),
                          a.server_params.size() * sizeof(float)),
              0)
        << "worker " << w << " differs from the shards' parameters";
  }
  // Float rounding of the residual updates only: a few ulps of the
  // magnitudes involved.
  EXPECT_LT(a.max_conservation_error, 1e-5);
  const RunResult b = RunSteps(GetParam(), 7);
  EXPECT_EQ(std::memcmp(a.server_params.data(), b.server_params.data(),
                        a.server_params.size() * sizeof(float)),
            0)
      << "same seed, different parameters";
  const RunResult c = RunSteps(GetParam(), 8);
  EXPECT_NE(std::memcmp(a.server_params.data(), c.server_params.data(),
                        a.server_params.size() * sizeof(float)),
            0);
}

std::string Name(const ::testing::TestParamInfo<Param>& info) {
  return "P" + std::to_string(std::get<0>(info.param)) + "_" +
         std::get<1>(info.param) + "_" +
         std::string(ValueCodecName(std::get<2>(info.param))) + "_" +
         std::string(MomentumModeName(std::get<3>(info.param)));
}

INSTANTIATE_TEST_SUITE_P(
    Steps, GtopkStepTest,
    ::testing::Combine(
        ::testing::Values(1, 4, 8),
        ::testing::Values("exact", "gaussiank", "dgc", "randomk"),
        ::testing::Values(ValueCodec::kFp32, ValueCodec::kBf16),
        ::testing::Values(MomentumMode::kNone, MomentumMode::kDgcCorrection,
                          MomentumMode::kGlobal)),
    Name);

}  // namespace
}  // namespace gtopk
