#include "common/error_feedback.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "common/random.h"
#include "common/topk.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/reference.h"
#include "tests/testing/status_matchers.h"

namespace gtopk {
namespace {

using ::gtopk::testing::FloatBits;
using ::gtopk::testing::MakeSparse;
using ::gtopk::testing::StatusIs;
using ::testing::HasSubstr;

constexpr float kMax = std::numeric_limits<float>::max();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

std::vector<uint32_t> BitsOf(absl::Span<const float> x) {
  std::vector<uint32_t> bits(x.size());
  for (size_t i = 0; i < x.size(); ++i) bits[i] = FloatBits(x[i]);
  return bits;
}

float FromBits(uint32_t b) {
  float x;
  std::memcpy(&x, &b, sizeof(x));
  return x;
}

// Half the spacing between |x| and the next float up: a bound on the
// rounding error of any correctly rounded operation whose result is x.
double HalfUlp(float x) {
  const float a = std::fabs(x);
  return 0.5 * (static_cast<double>(
                    std::nextafter(a, std::numeric_limits<float>::infinity())) -
                a);
}

// Round to bfloat16 (nearest, ties to even) and back; finite inputs far
// from FLT_MAX only.
float RoundBf16(float x) {
  const uint32_t b = FloatBits(x);
  const uint32_t rounded = (b + 0x7fffu + ((b >> 16) & 1u)) & 0xffff0000u;
  return FromBits(rounded);
}

// Round to IEEE half precision (nearest even) and back, by scaling to the
// half grid: spacing 2^(e-10) for normal halves, 2^-24 for subnormal ones.
// |x| < 65504 assumed.
float RoundFp16(float x) {
  if (x == 0.0f) return x;
  int e;
  std::frexp(x, &e);  // |x| in [2^(e-1), 2^e)
  const int exponent = std::max(e - 1, -14);
  const double spacing = std::ldexp(1.0, exponent - 10);
  return static_cast<float>(std::nearbyint(x / spacing) * spacing);
}

enum class Codec { kFp32, kBf16, kFp16, kNoisy };

std::string CodecName(Codec c) {
  switch (c) {
    case Codec::kFp32:
      return "fp32";
    case Codec::kBf16:
      return "bf16";
    case Codec::kFp16:
      return "fp16";
    case Codec::kNoisy:
      return "noisy";
  }
  return "?";
}

// What the receivers decode for `sent` under codec `c`. kNoisy: a relative
// error up to 2^-6 (a coarse lossy codec), exactly 0 for 1 in 16 entries (a
// codec flushing small values).
SparseVector Received(const SparseVector& sent, Codec c, std::mt19937_64& rng) {
  SparseVector r = sent;
  for (float& v : r.values) {
    switch (c) {
      case Codec::kFp32:
        break;
      case Codec::kBf16:
        v = RoundBf16(v);
        break;
      case Codec::kFp16:
        v = RoundFp16(v);
        break;
      case Codec::kNoisy:
        v = (rng() % 16 == 0)
                ? 0.0f
                : v * (1.0f + (UniformFloat(rng) - 0.5f) * (1.0f / 32));
        break;
    }
  }
  return r;
}

// A gradient-like update: mostly normal with magnitudes over a few decades,
// some exact zeros of both signs.
std::vector<float> RandomUpdate(size_t n, std::mt19937_64& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> u(n);
  for (float& v : u) {
    const float r = UniformFloat(rng);
    if (r < 0.02f) {
      v = -0.0f;
    } else if (r < 0.04f) {
      v = 0.0f;
    } else {
      v = normal(rng) *
          std::ldexp(1.0f, static_cast<int>(UniformBelow(rng, 12)) - 6);
    }
  }
  return u;
}

// A global selection that contains about half of `sent` and as many other
// indices.
SparseVector RandomGlobal(const SparseVector& sent, size_t n,
                          std::mt19937_64& rng) {
  std::vector<bool> in_global(n, false);
  for (uint32_t i : sent.indices) in_global[i] = (rng() & 1) != 0;
  for (size_t extra = 0; extra < sent.size(); ++extra) {
    in_global[UniformBelow(rng, n)] = true;
  }
  SparseVector global;
  for (size_t i = 0; i < n; ++i) {
    if (in_global[i]) global.push_back(static_cast<uint32_t>(i), 123.0f);
  }
  return global;
}

// -------------------------------------------------------------------------
// The put-back invariant.

class ErrorFeedbackPropertyTest
    : public ::testing::TestWithParam<std::tuple<size_t, double, Codec>> {};

TEST_P(ErrorFeedbackPropertyTest, NothingIsLost) {
  const auto [n, density, codec] = GetParam();
  const uint64_t k = std::max<uint64_t>(1, static_cast<uint64_t>(density * n));
  std::mt19937_64 rng(n * 31 + k * 7 + static_cast<int>(codec));
  ErrorFeedback feedback(n);
  cpu::TopKScratch scratch;
  for (int step = 0; step < 5; ++step) {
    const std::vector<float> update = RandomUpdate(n, rng);
    const std::vector<float> before(feedback.residual().begin(),
                                    feedback.residual().end());
    GTOPK_ASSERT_OK(feedback.Accumulate(update));
    const std::vector<float> u(feedback.residual().begin(),
                               feedback.residual().end());
    for (size_t i = 0; i < n; ++i) {
      ASSERT_EQ(FloatBits(u[i]), FloatBits(before[i] + update[i])) << i;
    }

    SparseVector sent;
    GTOPK_ASSERT_OK(cpu::ExactTopK(u, k, &scratch, &sent));
    const SparseVector received = Received(sent, codec, rng);
    GTOPK_ASSERT_OK(feedback.MarkSent(sent, received));
    // residual = u - received on sent entries: the correctly rounded
    // difference (computed exactly in double, rounded once).
    for (size_t j = 0; j < sent.size(); ++j) {
      const uint32_t i = sent.indices[j];
      const float expected = static_cast<float>(
          static_cast<double>(u[i]) - static_cast<double>(received.values[j]));
      ASSERT_EQ(FloatBits(feedback.residual()[i]), FloatBits(expected)) << i;
      if (codec == Codec::kFp32) {
        ASSERT_EQ(FloatBits(feedback.residual()[i]), 0u) << i;
      }
    }

    const SparseVector global = RandomGlobal(sent, n, rng);
    GTOPK_ASSERT_OK(feedback.PutBack(received, global));

    std::vector<int> sent_pos(n, -1);
    for (size_t j = 0; j < sent.size(); ++j) sent_pos[sent.indices[j]] = j;
    std::vector<bool> in_global(n, false);
    for (uint32_t i : global.indices) in_global[i] = true;
    const absl::Span<const float> r = feedback.residual();
    for (size_t i = 0; i < n; ++i) {
      if (sent_pos[i] < 0) {
        // Never sent: untouched.
        ASSERT_EQ(FloatBits(r[i]), FloatBits(u[i])) << "unsent " << i;
        continue;
      }
      const float recv = received.values[sent_pos[i]];
      const double exact_u = u[i];
      if (in_global[i]) {
        // Applied: the residual keeps only the codec's error, and
        // residual + received == u up to the rounding of one subtraction
        // (r is fl(u - recv)); exactly +0.0 when lossless.
        ASSERT_LE(std::fabs(static_cast<double>(r[i]) + recv - exact_u),
                  HalfUlp(r[i]))
            << "applied " << i;
        if (codec == Codec::kFp32) {
          ASSERT_EQ(FloatBits(r[i]), 0u) << i;
        }
      } else {
        // Put back: r == fl(fl(u - recv) + recv), within a rounding of u;
        // bit for bit u when lossless (-0.0 included).
        ASSERT_LE(std::fabs(static_cast<double>(r[i]) - exact_u),
                  HalfUlp(r[i]) + HalfUlp(r[i] - recv))
            << "put back " << i;
        if (codec == Codec::kFp32) {
          ASSERT_EQ(FloatBits(r[i]), FloatBits(u[i])) << "put back " << i;
        }
      }
      // These codecs decode within a factor 2 of the value (or to 0), so by
      // Sterbenz's lemma u - recv is exact and nothing is rounded at all.
      ASSERT_EQ(static_cast<double>(r[i]) + (in_global[i] ? recv : 0.0f),
                exact_u)
          << i;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    All, ErrorFeedbackPropertyTest,
    ::testing::Combine(::testing::Values<size_t>(1, 17, 1000, 100003),
                       ::testing::Values(0.001, 0.1, 1.0),
                       ::testing::Values(Codec::kFp32, Codec::kBf16,
                                         Codec::kFp16, Codec::kNoisy)),
    [](const auto& info) {
      return "n" + std::to_string(std::get<0>(info.param)) + "_density" +
             std::to_string(static_cast<int>(std::get<1>(info.param) * 1000)) +
             "permille_" + CodecName(std::get<2>(info.param));
    });

TEST(ErrorFeedbackTest, LosslessConservesEveryUpdateOverManySteps) {
  // Small-integer updates keep every float operation exact, so over many
  // steps: sum of updates == residual + sum of applied values, exactly.
  const size_t n = 500;
  const uint64_t k = 20;
  std::mt19937_64 rng(3);
  ErrorFeedback feedback(n);
  cpu::TopKScratch scratch;
  std::vector<double> total(n, 0.0), applied(n, 0.0);
  for (int step = 0; step < 50; ++step) {
    std::vector<float> update(n);
    for (size_t i = 0; i < n; ++i) {
      update[i] =
          static_cast<float>(static_cast<int>(UniformBelow(rng, 21)) - 10);
      total[i] += update[i];
    }
    GTOPK_ASSERT_OK(feedback.Accumulate(update));
    SparseVector sent;
    GTOPK_ASSERT_OK(cpu::ExactTopK(feedback.residual(), k, &scratch, &sent));
    GTOPK_ASSERT_OK(feedback.MarkSent(sent, sent));
    const SparseVector global = RandomGlobal(sent, n, rng);
    size_t g = 0;
    for (size_t j = 0; j < sent.size(); ++j) {
      while (g < global.size() && global.indices[g] < sent.indices[j]) ++g;
      if (g < global.size() && global.indices[g] == sent.indices[j]) {
        applied[sent.indices[j]] += sent.values[j];
      }
    }
    GTOPK_ASSERT_OK(feedback.PutBack(sent, global));
  }
  for (size_t i = 0; i < n; ++i) {
    EXPECT_EQ(total[i], feedback.residual()[i] + applied[i]) << i;
  }
}

TEST(ErrorFeedbackTest, NegativeZeroSurvivesAPutBack) {
  ErrorFeedback feedback(4);
  feedback.mutable_residual()[1] = -0.0f;
  feedback.mutable_residual()[2] = 2.0f;
  const SparseVector sent = MakeSparse({1, 2}, {-0.0f, 2.0f});
  GTOPK_ASSERT_OK(feedback.MarkSent(sent, sent));
  GTOPK_ASSERT_OK(feedback.PutBack(sent, SparseVector{}));
  EXPECT_EQ(FloatBits(feedback.residual()[1]), FloatBits(-0.0f));
  EXPECT_EQ(feedback.residual()[2], 2.0f);
}

TEST(ErrorFeedbackTest, PutBackIgnoresGlobalValuesAndExtraIndices) {
  ErrorFeedback feedback(10);
  GTOPK_ASSERT_OK(
      feedback.Accumulate(std::vector<float>{0, 1, 2, 3, 4, 5, 6, 7, 8, 9}));
  const SparseVector sent = MakeSparse({2, 5, 9}, {2, 5, 9});
  GTOPK_ASSERT_OK(feedback.MarkSent(sent, sent));
  // Global values are not read: NaN is fine there.
  GTOPK_ASSERT_OK(
      feedback.PutBack(sent, MakeSparse({0, 5, 7}, {kNaN, kNaN, kNaN})));
  EXPECT_EQ(std::vector<float>(feedback.residual().begin(),
                               feedback.residual().end()),
            (std::vector<float>{0, 1, 2, 3, 4, 0, 6, 7, 8, 9}));
}

// -------------------------------------------------------------------------
// Errors leave everything unchanged.

class ErrorFeedbackErrorTest : public ::testing::Test {
 protected:
  void SetUp() override {
    GTOPK_ASSERT_OK(feedback_.Accumulate(
        std::vector<float>{0.5f, -1.0f, 2.0f, 0.0f, 3.0f, kMax, -4.0f, 1.0f}));
    snapshot_ = BitsOf(feedback_.residual());
  }
  void ExpectUnchanged() { EXPECT_EQ(BitsOf(feedback_.residual()), snapshot_); }
  ErrorFeedback feedback_{8};
  std::vector<uint32_t> snapshot_;
};

TEST_F(ErrorFeedbackErrorTest, CreateRejectsTooLargeN) {
  EXPECT_THAT(ErrorFeedback::Create(kMaxDenseLength + 1),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("2^32")));
  GTOPK_ASSERT_OK_AND_ASSIGN(ErrorFeedback empty, ErrorFeedback::Create(0));
  EXPECT_EQ(empty.n(), 0u);
  GTOPK_EXPECT_OK(empty.Accumulate({}));
  EXPECT_EQ(feedback_.n(), 8u);
}

TEST_F(ErrorFeedbackErrorTest, AccumulateRejectsBadUpdates) {
  EXPECT_THAT(
      feedback_.Accumulate(std::vector<float>(7, 1.0f)),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("length 7")));
  std::vector<float> update(8, 1.0f);
  update[6] = kNaN;
  EXPECT_THAT(feedback_.Accumulate(update),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("non-finite value (nan) at position 6")));
  update[6] = -kInf;
  EXPECT_THAT(
      feedback_.Accumulate(update),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("position 6")));
  update[6] = 1.0f;
  update[5] = kMax;  // residual[5] == max: overflow
  EXPECT_THAT(feedback_.Accumulate(update),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("overflows at position 5")));
  ExpectUnchanged();
  // A non-finite residual (written through mutable_residual) is a state
  // problem, not the update's.
  feedback_.mutable_residual()[3] = kInf;
  EXPECT_THAT(
      feedback_.Accumulate(std::vector<float>(8, 0.0f)),
      StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("position 3")));
}

TEST_F(ErrorFeedbackErrorTest, MarkSentRejectsMismatches) {
  const SparseVector sent = MakeSparse({1, 4}, {-1.0f, 3.0f});
  struct Case {
    SparseVector sent, received;
    absl::StatusCode code;
    std::string message;
  };
  const std::vector<Case> cases = {
      {MakeSparse({4, 1}, {3.0f, -1.0f}), MakeSparse({4, 1}, {3.0f, -1.0f}),
       absl::StatusCode::kInvalidArgument, "sent: sparse indices not strictly"},
      {sent, MakeSparse({1, 8}, {-1.0f, 3.0f}),
       absl::StatusCode::kInvalidArgument,
       "sent_as_received: sparse index out of range at position 1"},
      {sent, MakeSparse({1, 4}, {-1.0f, kNaN}),
       absl::StatusCode::kInvalidArgument,
       "sent_as_received: sparse value not finite at position 1"},
      {sent, MakeSparse({1}, {-1.0f}), absl::StatusCode::kInvalidArgument,
       "2 entries but sent_as_received 1"},
      {sent, MakeSparse({1, 5}, {-1.0f, 3.0f}),
       absl::StatusCode::kInvalidArgument, "indices differ at position 1"},
      {MakeSparse({1, 4}, {-1.0f, 3.5f}), MakeSparse({1, 4}, {-1.0f, 3.5f}),
       absl::StatusCode::kFailedPrecondition, "position 1 (index 4)"},
      {MakeSparse({3}, {-0.0f}), MakeSparse({3}, {-0.0f}),
       absl::StatusCode::kFailedPrecondition, "index 3"},  // bits differ
      {MakeSparse({5}, {kMax}), MakeSparse({5}, {-kMax}),
       absl::StatusCode::kInvalidArgument, "overflows at position 0"},
  };
  for (const Case& c : cases) {
    EXPECT_THAT(feedback_.MarkSent(c.sent, c.received),
                StatusIs(c.code, HasSubstr(c.message)))
        << c.message;
    ExpectUnchanged();
  }
  // Nothing is pending after failed MarkSent calls.
  EXPECT_THAT(feedback_.PutBack(sent, SparseVector{}),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("no pending MarkSent")));
}

TEST_F(ErrorFeedbackErrorTest, PutBackNeedsItsMarkSentExactlyOnce) {
  EXPECT_THAT(feedback_.PutBack(SparseVector{}, SparseVector{}),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("no pending MarkSent")));
  const SparseVector sent = MakeSparse({1, 4}, {-1.0f, 3.0f});
  const SparseVector received = MakeSparse({1, 4}, {-1.0f, 2.75f});
  GTOPK_ASSERT_OK(feedback_.MarkSent(sent, received));
  snapshot_ = BitsOf(feedback_.residual());
  EXPECT_EQ(feedback_.residual()[4], 0.25f);

  struct Case {
    SparseVector received, global;
    absl::StatusCode code;
    std::string message;
  };
  const std::vector<Case> cases = {
      {sent, SparseVector{}, absl::StatusCode::kFailedPrecondition,
       "differs from the one given to the last MarkSent"},
      {MakeSparse({1, 4}, {-1.0f, kInf}), SparseVector{},
       absl::StatusCode::kInvalidArgument, "not finite at position 1"},
      {received, MakeSparse({3, 2}, {0, 0}), absl::StatusCode::kInvalidArgument,
       "global: sparse indices not strictly ascending at position 1"},
      {received, MakeSparse({2, 2}, {0, 0}), absl::StatusCode::kInvalidArgument,
       "global: sparse indices not strictly ascending at position 1"},
      {received, MakeSparse({2, 8}, {0, 0}), absl::StatusCode::kInvalidArgument,
       "global: sparse index out of range at position 1"},
      {received, MakeSparse({2, 3}, {0}), absl::StatusCode::kInvalidArgument,
       "global: sparse vector has 2 indices but 1 values"},
  };
  for (const Case& c : cases) {
    EXPECT_THAT(feedback_.PutBack(c.received, c.global),
                StatusIs(c.code, HasSubstr(c.message)))
        << c.message;
    ExpectUnchanged();
  }
  // Still pending: the right call succeeds once, then no more.
  GTOPK_ASSERT_OK(feedback_.PutBack(received, MakeSparse({1}, {0})));
  EXPECT_EQ(feedback_.residual()[4], 3.0f);
  EXPECT_EQ(FloatBits(feedback_.residual()[1]), 0u);
  snapshot_ = BitsOf(feedback_.residual());
  EXPECT_THAT(feedback_.PutBack(received, MakeSparse({1}, {0})),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("no pending MarkSent")));
  ExpectUnchanged();
}

TEST_F(ErrorFeedbackErrorTest, PutBackRejectsANonFiniteSum) {
  const SparseVector sent = MakeSparse({5}, {kMax});
  const SparseVector received = MakeSparse({5}, {kMax * 0.5f});
  GTOPK_ASSERT_OK(feedback_.MarkSent(sent, received));  // residual: max/2
  feedback_.mutable_residual()[5] = kMax;  // changed behind our back
  snapshot_ = BitsOf(feedback_.residual());
  EXPECT_THAT(
      feedback_.PutBack(received, SparseVector{}),
      StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("index 5")));
  ExpectUnchanged();
}

TEST_F(ErrorFeedbackErrorTest, ResetZeroesAndForgetsThePendingMarkSent) {
  const SparseVector sent = MakeSparse({1}, {-1.0f});
  GTOPK_ASSERT_OK(feedback_.MarkSent(sent, sent));
  feedback_.Reset();
  EXPECT_EQ(BitsOf(feedback_.residual()), std::vector<uint32_t>(8, 0u));
  EXPECT_THAT(feedback_.PutBack(sent, SparseVector{}),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("no pending MarkSent")));
}

}  // namespace
}  // namespace gtopk
