// Tests of the distributed exact top-k (server/threshold.h): shards as
// threads against one ThresholdCoordinator, checked bit for bit against the
// single-process oracle (ReferenceGtopkStep / SparseTopK); the leader's
// combine step; and the coordinator's failure handling (deadlines, retries,
// inconsistent or old requests, bounded memory).
#include "server/threshold.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/merge.h"
#include "common/random.h"
#include "common/topk.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/reference.h"
#include "tests/testing/status_matchers.h"

namespace gtopk {
namespace server {
namespace {

using ::gtopk::testing::FloatBits;
using ::gtopk::testing::MakeSparse;
using ::gtopk::testing::StatusIs;
using ::testing::AllOf;
using ::testing::HasSubstr;

float FromKey(uint32_t key, bool negative) {
  const uint32_t bits = key | (negative ? 0x80000000u : 0u);
  float x;
  std::memcpy(&x, &bits, sizeof(x));
  return x;
}

// Bit-exact equality with a readable failure message.
void ExpectSameBits(const SparseVector& got, const SparseVector& want,
                    const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t j = 0; j < got.size(); ++j) {
    ASSERT_EQ(got.indices[j], want.indices[j]) << what << " position " << j;
    ASSERT_EQ(FloatBits(got.values[j]), FloatBits(want.values[j]))
        << what << " position " << j << " index " << got.indices[j];
  }
}

// A plain oracle for the oracle: full sort by (key desc, index asc).
SparseVector NaiveTopK(const SparseVector& v, uint64_t k) {
  std::vector<size_t> order(v.size());
  for (size_t j = 0; j < order.size(); ++j) order[j] = j;
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    const uint32_t ka = cpu::MagnitudeKey(v.values[a]);
    const uint32_t kb = cpu::MagnitudeKey(v.values[b]);
    return ka != kb ? ka > kb : v.indices[a] < v.indices[b];
  });
  if (order.size() > k) order.resize(k);
  std::sort(order.begin(), order.end());
  SparseVector out;
  for (size_t j : order) out.push_back(v.indices[j], v.values[j]);
  return out;
}

// Records the highest level each call reached, around a real exchange.
class CountingExchange final : public ThresholdExchange {
 public:
  explicit CountingExchange(ThresholdExchange* inner) : inner_(inner) {}
  absl::StatusOr<ThresholdResponse> Exchange(const ThresholdRequest& request,
                                             absl::Time deadline) override {
    {
      absl::MutexLock lock(&mu_);
      max_level_ = std::max(max_level_, static_cast<int>(request.level));
    }
    return inner_->Exchange(request, deadline);
  }
  int max_level() {
    absl::MutexLock lock(&mu_);
    return max_level_;
  }
  void Reset() {
    absl::MutexLock lock(&mu_);
    max_level_ = -1;
  }

 private:
  ThresholdExchange* const inner_;
  absl::Mutex mu_;
  int max_level_ ABSL_GUARDED_BY(mu_) = -1;
};

// Runs DistributedThresholdTopK on every shard, one thread per shard, and
// returns the concatenation of the selections (shard order = index order).
SparseVector RunShards(const std::vector<SparseVector>& shards, uint64_t k,
                       int64_t step, ThresholdExchange* exchange) {
  const size_t num_shards = shards.size();
  std::vector<SparseVector> selected(num_shards);
  std::vector<absl::Status> status(num_shards);
  std::vector<std::thread> threads;
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  for (size_t s = 0; s < num_shards; ++s) {
    threads.emplace_back([&, s] {
      status[s] =
          DistributedThresholdTopK(shards[s], k, step, static_cast<uint32_t>(s),
                                   exchange, deadline, &selected[s]);
    });
  }
  for (std::thread& t : threads) t.join();
  SparseVector all;
  for (size_t s = 0; s < num_shards; ++s) {
    EXPECT_THAT(status[s], ::gtopk::testing::IsOk()) << "shard " << s;
    for (size_t j = 0; j < selected[s].size(); ++j) {
      all.push_back(selected[s].indices[j], selected[s].values[j]);
    }
  }
  return all;
}

// Restricts `v` to [begin, end).
SparseVector Restrict(const SparseVector& v, uint64_t begin, uint64_t end) {
  SparseVector out;
  for (size_t j = 0; j < v.size(); ++j) {
    if (v.indices[j] >= begin && v.indices[j] < end) {
      out.push_back(v.indices[j], v.values[j]);
    }
  }
  return out;
}

// Shard boundaries 0 = b[0] <= ... <= b[S] = n.
using Bounds = std::vector<uint64_t>;

std::vector<Bounds> Layouts(uint32_t num_shards, uint64_t n,
                            std::mt19937_64& rng) {
  std::vector<Bounds> layouts;
  Bounds even(num_shards + 1);
  for (uint32_t s = 0; s <= num_shards; ++s) even[s] = n * s / num_shards;
  layouts.push_back(even);
  Bounds random(num_shards + 1, 0);
  random[num_shards] = n;
  for (uint32_t s = 1; s < num_shards; ++s)
    random[s] = UniformBelow(rng, n + 1);
  std::sort(random.begin(), random.end());
  layouts.push_back(random);
  if (num_shards > 1) {
    // Everything in the last shard, then everything in the first, and a
    // middle shard holding all while its neighbours are empty.
    layouts.push_back(Bounds(num_shards, 0));
    layouts.back().push_back(n);
    Bounds first(num_shards + 1, n);
    first[0] = 0;
    layouts.push_back(first);
    Bounds middle(num_shards + 1, 0);
    for (uint32_t s = num_shards / 2 + 1; s <= num_shards; ++s) middle[s] = n;
    layouts.push_back(middle);
  }
  return layouts;
}

enum class Family {
  kNormal,
  kAllEqual,    // one magnitude, random signs: every selection is ties
  kFewLevels,   // 4 magnitudes
  kZeros,       // mostly +0.0 and -0.0
  kAllZeros,    // only +0.0 and -0.0
  kDenormals,   // subnormals: level-0 bucket 0
  kOneBucket0,  // all keys share bits 30..20
  kOneBucket1,  // all keys share bits 30..9: decided at level 2
  kTwoGroups,   // big and small values in different level-0 buckets
  kNearMax,     // close to FLT_MAX
};

constexpr Family kFamilies[] = {Family::kNormal,     Family::kAllEqual,
                                Family::kFewLevels,  Family::kZeros,
                                Family::kAllZeros,   Family::kDenormals,
                                Family::kOneBucket0, Family::kOneBucket1,
                                Family::kTwoGroups,  Family::kNearMax};

float Draw(Family f, std::mt19937_64& rng) {
  const bool neg = rng() & 1;
  std::normal_distribution<float> normal(0.0f, 1.0f);
  switch (f) {
    case Family::kNormal:
      return normal(rng);
    case Family::kAllEqual:
      return neg ? -0.75f : 0.75f;
    case Family::kFewLevels:
      return FromKey(cpu::MagnitudeKey(0.25f * (1 + UniformBelow(rng, 4))),
                     neg);
    case Family::kZeros:
      return UniformBelow(rng, 10) < 8 ? FromKey(0, neg) : normal(rng);
    case Family::kAllZeros:
      return FromKey(0, neg);
    case Family::kDenormals:
      return FromKey(static_cast<uint32_t>(UniformBelow(rng, 0x800000)), neg);
    case Family::kOneBucket0:
      return FromKey(
          (0x3f8u << 20) | static_cast<uint32_t>(UniformBelow(rng, 1u << 20)),
          neg);
    case Family::kOneBucket1:
      return FromKey((0x3f8u << 20) | (0x123u << 9) |
                         static_cast<uint32_t>(UniformBelow(rng, 8)),
                     neg);
    case Family::kTwoGroups:
      return UniformBelow(rng, 3) == 0
                 ? (neg ? -8.0f : 8.0f) * (1.0f + UniformFloat(rng) * 0.1f)
                 : normal(rng) * 1e-3f;
    case Family::kNearMax:
      return FromKey(0x7f7fffffu - static_cast<uint32_t>(UniformBelow(rng, 5)),
                     neg);
  }
  return 0.0f;
}

// A random sparse vector over [0, n) with about `density` of the indices.
SparseVector RandomSparse(Family f, uint64_t n, double density,
                          std::mt19937_64& rng) {
  SparseVector v;
  for (uint64_t i = 0; i < n; ++i) {
    if (UniformFloat(rng) < density) {
      v.push_back(static_cast<uint32_t>(i), Draw(f, rng));
    }
  }
  return v;
}

std::vector<uint64_t> KsFor(uint64_t total, std::mt19937_64& rng) {
  std::vector<uint64_t> ks = {1,
                              2,
                              3,
                              7,
                              total / 3 + 1,
                              total + 1,
                              2 * total + 5,
                              1 + UniformBelow(rng, total + 2)};
  if (total >= 1) {
    ks.push_back(total);
    ks.push_back(total > 1 ? total - 1 : 1);
  }
  std::sort(ks.begin(), ks.end());
  ks.erase(std::unique(ks.begin(), ks.end()), ks.end());
  return ks;
}

class ThresholdOracleTest : public ::testing::TestWithParam<uint32_t> {};

// Direct random sparse vectors per family, cut into shard ranges.
TEST_P(ThresholdOracleTest, MatchesSparseTopKOnAdversarialInputs) {
  const uint32_t num_shards = GetParam();
  std::mt19937_64 rng(MixSeed(20240601, num_shards));
  ThresholdCoordinator coordinator(num_shards);
  LocalThresholdExchange local(&coordinator);
  CountingExchange counting(&local);
  int64_t step = 0;
  int early_level0 = 0;
  const uint64_t n = 600;
  for (Family family : kFamilies) {
    for (double density : {0.0, 0.02, 0.4}) {
      // Empty inputs once are enough.
      if (density == 0.0 && family != Family::kNormal) continue;
      const SparseVector global = RandomSparse(family, n, density, rng);
      std::vector<uint64_t> ks = KsFor(global.size(), rng);
      if (family == Family::kTwoGroups) {
        // Exactly the big group: the exchange may finish at level 0.
        uint64_t big = 0;
        for (float x : global.values) big += std::fabs(x) >= 4.0f;
        if (big > 0) ks.push_back(big);
      }
      for (const Bounds& bounds : Layouts(num_shards, n, rng)) {
        std::vector<SparseVector> shards(num_shards);
        for (uint32_t s = 0; s < num_shards; ++s) {
          shards[s] = Restrict(global, bounds[s], bounds[s + 1]);
        }
        for (uint64_t k : ks) {
          SCOPED_TRACE(absl::StrCat("family ", static_cast<int>(family),
                                    " density ", density, " k ", k, " of ",
                                    global.size(), " step ", step));
          SparseVector want;
          GTOPK_ASSERT_OK(SparseTopK(global, k, &want));
          ExpectSameBits(want, NaiveTopK(global, k), "oracle vs naive");
          counting.Reset();
          const SparseVector got = RunShards(shards, k, step++, &counting);
          ExpectSameBits(got, want, "distributed vs SparseTopK");
          if (family == Family::kTwoGroups && counting.max_level() == 0 &&
              k < global.size()) {
            ++early_level0;
          }
        }
      }
    }
  }
  // The bucket-exact case did finish early somewhere (so that path is
  // tested, not just allowed).
  EXPECT_GT(early_level0, 0);
  EXPECT_LE(coordinator.NumRetainedSteps(), 4u);
}

// The server's real data path: P workers' pushes, summed per shard range with
// SparseSum, against ReferenceGtopkStep.
TEST_P(ThresholdOracleTest, MatchesReferenceGtopkStepOnWorkerPushes) {
  const uint32_t num_shards = GetParam();
  std::mt19937_64 rng(MixSeed(77, num_shards));
  ThresholdCoordinator coordinator(num_shards);
  LocalThresholdExchange local(&coordinator);
  int64_t step = 1000;
  const uint64_t n = 3000;
  for (int workers : {1, 3, 5}) {
    for (Family family : {Family::kNormal, Family::kFewLevels, Family::kZeros,
                          Family::kAllEqual}) {
      std::vector<SparseVector> pushes(workers);
      for (SparseVector& p : pushes) p = RandomSparse(family, n, 0.03, rng);
      SparseVector sum;
      GTOPK_ASSERT_OK(SparseSum(pushes, n, &sum));
      for (const Bounds& bounds : Layouts(num_shards, n, rng)) {
        std::vector<SparseVector> shards(num_shards);
        for (uint32_t s = 0; s < num_shards; ++s) {
          std::vector<SparseVector> part(workers);
          for (int w = 0; w < workers; ++w) {
            part[w] = Restrict(pushes[w], bounds[s], bounds[s + 1]);
          }
          GTOPK_ASSERT_OK(SparseSum(part, n, &shards[s]));
        }
        for (uint64_t k : KsFor(sum.size(), rng)) {
          SCOPED_TRACE(absl::StrCat("P ", workers, " family ",
                                    static_cast<int>(family), " k ", k));
          SparseVector want;
          GTOPK_ASSERT_OK(ReferenceGtopkStep(pushes, n, k, &want));
          ExpectSameBits(RunShards(shards, k, step++, &local), want,
                         "distributed vs ReferenceGtopkStep");
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Shards, ThresholdOracleTest,
                         ::testing::Values(1u, 2u, 3u, 5u),
                         [](const ::testing::TestParamInfo<uint32_t>& info) {
                           return absl::StrCat("S", info.param);
                         });

// Ties at the k-th key straddling every shard boundary: lower shards win.
TEST(ThresholdTest, TiesAcrossShardBoundariesGoToLowerIndices) {
  const uint32_t num_shards = 3;
  ThresholdCoordinator coordinator(num_shards);
  LocalThresholdExchange local(&coordinator);
  // Indices 0..29, all |x| == 1 except one larger value in shard 2.
  SparseVector global;
  for (uint32_t i = 0; i < 30; ++i) {
    global.push_back(i, i == 25 ? 2.0f : (i % 2 ? -1.0f : 1.0f));
  }
  const Bounds bounds = {0, 10, 20, 30};
  std::vector<SparseVector> shards(num_shards);
  for (uint32_t s = 0; s < num_shards; ++s) {
    shards[s] = Restrict(global, bounds[s], bounds[s + 1]);
  }
  for (uint64_t k = 1; k <= 31; ++k) {
    SparseVector want;
    GTOPK_ASSERT_OK(SparseTopK(global, k, &want));
    ExpectSameBits(RunShards(shards, k, static_cast<int64_t>(k), &local), want,
                   absl::StrCat("k ", k));
  }
}

TEST(ThresholdTest, KeyHistogramBuckets) {
  const float above_one = 1.0f + 1.0f / 1024;  // key 0x3f802000
  const std::vector<float> values = {0.0f,
                                     -0.0f,
                                     1.0f,
                                     -1.0f,
                                     above_one,
                                     1.5f,
                                     std::numeric_limits<float>::denorm_min(),
                                     std::numeric_limits<float>::quiet_NaN()};
  const std::vector<uint64_t> h0 = KeyHistogram(values, 0, 0);
  ASSERT_EQ(h0.size(), 2048u);
  EXPECT_EQ(h0[0], 3u);      // +-0 and the denormal
  EXPECT_EQ(h0[0x3f8], 3u);  // +-1.0 and above_one
  EXPECT_EQ(h0[0x3fc], 1u);  // 1.5 = 0x3fc00000
  EXPECT_EQ(h0[0x7fc], 1u);  // the quiet NaN
  const std::vector<uint64_t> h1 = KeyHistogram(values, 1, 0x3f8);
  ASSERT_EQ(h1.size(), 2048u);
  EXPECT_EQ(h1[0], 2u);   // +-1.0: bits 19..9 zero
  EXPECT_EQ(h1[16], 1u);  // above_one: 0x2000 >> 9
  uint64_t total = 0;
  for (uint64_t c : h1) total += c;
  EXPECT_EQ(total, 3u);
  const std::vector<uint64_t> h2 = KeyHistogram(values, 2, 0);
  ASSERT_EQ(h2.size(), 512u);
  EXPECT_EQ(h2[0], 2u);  // +0.0 and -0.0 tie
  EXPECT_EQ(h2[1], 1u);  // denorm_min
  EXPECT_TRUE(KeyHistogram(values, 3, 0).empty());
}

// --- CombineThresholdRound --------------------------------------------------

ThresholdRequest Req(int64_t step, uint32_t shard, uint64_t k, uint32_t level,
                     std::vector<std::pair<uint32_t, uint64_t>> counts) {
  ThresholdRequest r;
  r.step = step;
  r.shard_id = shard;
  r.k = k;
  r.level = level;
  r.histogram.assign(ThresholdBucketCount(level), 0);
  for (const auto& [bucket, count] : counts) r.histogram[bucket] = count;
  return r;
}

TEST(CombineThresholdRoundTest, TiesAreHandedOutInShardOrder) {
  ThresholdPrefix before;
  before.prefix = (0x3f8u << 11) | 5;
  before.greater_total = 10;
  before.shard_counts = {2, 3, 5};
  // need = 15 - 10 = 5: one key above bucket 9, then 4 of the 9 ties.
  const std::vector<ThresholdRequest> requests = {
      Req(3, 2, 15, 2, {{9, 4}, {12, 1}}), Req(3, 0, 15, 2, {{9, 2}}),
      Req(3, 1, 15, 2, {{9, 3}})};
  GTOPK_ASSERT_OK_AND_ASSIGN(ThresholdRound round,
                             CombineThresholdRound(3, before, requests));
  ASSERT_EQ(round.responses.size(), 3u);
  const uint64_t ties[] = {2, 2, 0};
  for (uint32_t s = 0; s < 3; ++s) {
    const ThresholdResponse& r = round.responses[s];
    EXPECT_TRUE(r.done);
    EXPECT_FALSE(r.keep_all);
    EXPECT_EQ(r.step, 3);
    EXPECT_EQ(r.level, 2u);
    EXPECT_EQ(r.bucket, 9u);
    EXPECT_EQ(r.greater_total, 11u);
    EXPECT_EQ(r.kth_key, (before.prefix << 9) | 9);
    EXPECT_EQ(r.ties_to_keep, ties[s]) << "shard " << s;
  }
}

TEST(CombineThresholdRoundTest, KeepAllAndEarlyFinishAndRefine) {
  // 5 entries in all, k = 5: keep_all.
  GTOPK_ASSERT_OK_AND_ASSIGN(
      ThresholdRound all,
      CombineThresholdRound(
          2, {}, {Req(0, 0, 5, 0, {{7, 2}}), Req(0, 1, 5, 0, {{900, 3}})}));
  EXPECT_TRUE(all.responses[1].keep_all);
  EXPECT_TRUE(all.responses[1].done);
  // k = 3: bucket 900 is exactly what is needed.
  GTOPK_ASSERT_OK_AND_ASSIGN(
      ThresholdRound early,
      CombineThresholdRound(
          2, {}, {Req(0, 0, 3, 0, {{7, 2}}), Req(0, 1, 3, 0, {{900, 3}})}));
  EXPECT_TRUE(early.responses[0].done);
  EXPECT_FALSE(early.responses[0].keep_all);
  EXPECT_EQ(early.responses[0].kth_key, (900u << 20) - 1);
  EXPECT_EQ(early.responses[0].ties_to_keep, 0u);
  // k = 4: refine inside bucket 7 with 1 key above and 2 entries in shard 0.
  GTOPK_ASSERT_OK_AND_ASSIGN(
      ThresholdRound refine,
      CombineThresholdRound(
          2, {}, {Req(0, 0, 4, 0, {{7, 2}}), Req(0, 1, 4, 0, {{900, 3}})}));
  EXPECT_FALSE(refine.responses[0].done);
  EXPECT_EQ(refine.responses[0].bucket, 7u);
  EXPECT_EQ(refine.responses[0].greater_total, 3u);
  EXPECT_EQ(refine.next.prefix, 7u);
  EXPECT_EQ(refine.next.greater_total, 3u);
  EXPECT_EQ(refine.next.shard_counts, (std::vector<uint64_t>{2, 0}));
}

TEST(CombineThresholdRoundTest, RejectsBadRounds) {
  EXPECT_THAT(CombineThresholdRound(2, {}, {Req(0, 0, 1, 0, {})}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("expected 2, got 1")));
  EXPECT_THAT(
      CombineThresholdRound(2, {}, {Req(0, 1, 1, 0, {}), Req(0, 1, 1, 0, {})}),
      StatusIs(absl::StatusCode::kInvalidArgument,
               HasSubstr("shard 1: two requests")));
  EXPECT_THAT(
      CombineThresholdRound(2, {}, {Req(0, 0, 1, 0, {}), Req(1, 1, 1, 0, {})}),
      StatusIs(absl::StatusCode::kInvalidArgument,
               HasSubstr("shard 1: request for step 1 level 0")));
  ThresholdRequest short_histogram = Req(0, 1, 1, 0, {});
  short_histogram.histogram.resize(100);
  EXPECT_THAT(
      CombineThresholdRound(2, {}, {Req(0, 0, 1, 0, {}), short_histogram}),
      StatusIs(absl::StatusCode::kInvalidArgument,
               HasSubstr("shard 1: histogram has 100 buckets")));
  ThresholdPrefix before;
  before.prefix = 7;
  before.greater_total = 1;
  before.shard_counts = {2, 0};
  EXPECT_THAT(CombineThresholdRound(
                  2, before, {Req(0, 0, 4, 1, {{3, 1}}), Req(0, 1, 4, 1, {})}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("shard 0: histogram holds 1 entries")));
  // Absurd counts are rejected, not summed into an overflow.
  EXPECT_THAT(
      CombineThresholdRound(
          1, {}, {Req(0, 0, 1, 0, {{1, ~uint64_t{0}}, {2, ~uint64_t{0}}})}),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("more than")));
}

// --- ThresholdCoordinator ---------------------------------------------------

absl::Time Soon() { return absl::Now() + absl::Milliseconds(200); }
absl::Time Later() { return absl::Now() + absl::Seconds(30); }

// Waits (bounded) until the coordinator holds `steps` steps: a request that
// creates a step is recorded in the same critical section.
void AwaitSteps(const ThresholdCoordinator& c, size_t steps) {
  const absl::Time end = absl::Now() + absl::Seconds(10);
  while (c.NumRetainedSteps() < steps && absl::Now() < end) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  ASSERT_GE(c.NumRetainedSteps(), steps);
}

TEST(ThresholdCoordinatorTest, DeadlineNamesTheMissingShard) {
  ThresholdCoordinator coordinator(3);
  const absl::Time start = absl::Now();
  absl::StatusOr<ThresholdResponse> r0, r1;
  std::thread t0([&] {
    r0 = coordinator.Submit(Req(0, 0, 5, 0, {{1, 9}}), Soon());
  });
  std::thread t1([&] {
    r1 = coordinator.Submit(Req(0, 1, 5, 0, {{1, 9}}), Later());
  });
  t0.join();
  t1.join();
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));  // t1 did not wait 30 s
  for (const auto* r : {&r0, &r1}) {
    EXPECT_THAT(*r, StatusIs(absl::StatusCode::kDeadlineExceeded,
                             AllOf(HasSubstr("step 0 level 0"),
                                   HasSubstr("waiting for shard 2 "),
                                   HasSubstr("2 of 3 arrived"))));
  }
  // A late level-0 request starts a new attempt of the failed step (the
  // workers retry a failed step on every shard): it waits for the others.
  EXPECT_THAT(coordinator.Submit(Req(0, 2, 5, 0, {{1, 9}}), Soon()),
              StatusIs(absl::StatusCode::kDeadlineExceeded,
                       HasSubstr("waiting for shards 0, 1 (1 of 3 arrived)")));
  // A full retry of the step by all three shards succeeds.
  {
    absl::StatusOr<ThresholdResponse> a, b, c;
    std::thread ta([&] {
      a = coordinator.Submit(Req(0, 0, 5, 0, {{1, 9}}), Later());
    });
    std::thread tb([&] {
      b = coordinator.Submit(Req(0, 1, 5, 0, {{1, 9}}), Later());
    });
    c = coordinator.Submit(Req(0, 2, 5, 0, {{1, 9}}), Later());
    ta.join();
    tb.join();
    EXPECT_THAT(a, ::gtopk::testing::IsOk());
    EXPECT_THAT(b, ::gtopk::testing::IsOk());
    EXPECT_THAT(c, ::gtopk::testing::IsOk());
  }
  // Two missing shards are both named; a past deadline does not block.
  EXPECT_THAT(
      coordinator.Submit(Req(1, 0, 5, 0, {}), absl::Now() - absl::Seconds(1)),
      StatusIs(absl::StatusCode::kDeadlineExceeded,
               HasSubstr("waiting for shards 1, 2 (1 of 3 arrived)")));
}

TEST(ThresholdCoordinatorTest, DriverReportsDeadlineAndLeavesOutputEmpty) {
  ThresholdCoordinator coordinator(2);
  LocalThresholdExchange local(&coordinator);
  SparseVector selected = MakeSparse({1}, {1.0f});
  const absl::Status s = DistributedThresholdTopK(
      MakeSparse({3, 4}, {1.0f, 2.0f}), 1, 9, 0, &local, Soon(), &selected);
  EXPECT_THAT(s, StatusIs(absl::StatusCode::kDeadlineExceeded,
                          AllOf(HasSubstr("step 9 level 0 (shard 0)"),
                                HasSubstr("waiting for shard 1"))));
  EXPECT_TRUE(selected.empty());
}

TEST(ThresholdCoordinatorTest, RetriesAreIdempotent) {
  ThresholdCoordinator coordinator(2);
  const ThresholdRequest a = Req(4, 0, 3, 0, {{5, 2}, {6, 2}});
  const ThresholdRequest b = Req(4, 1, 3, 0, {{5, 1}});
  // Shard 0 twice while collecting (e.g. an RPC retried after a client-side
  // timeout), then shard 1.
  absl::StatusOr<ThresholdResponse> r0, r0_again;
  std::thread t0([&] { r0 = coordinator.Submit(a, Later()); });
  std::thread t1([&] { r0_again = coordinator.Submit(a, Later()); });
  AwaitSteps(coordinator, 1);
  GTOPK_ASSERT_OK_AND_ASSIGN(ThresholdResponse r1,
                             coordinator.Submit(b, Later()));
  t0.join();
  t1.join();
  GTOPK_ASSERT_OK(r0);
  GTOPK_ASSERT_OK(r0_again);
  EXPECT_EQ(*r0, *r0_again);
  EXPECT_FALSE(r1.done);
  EXPECT_EQ(r1.bucket, 5u);
  EXPECT_EQ(r1.greater_total, 2u);
  // After completion: the same answer, without waiting.
  GTOPK_ASSERT_OK_AND_ASSIGN(ThresholdResponse again,
                             coordinator.Submit(a, absl::Now()));
  EXPECT_EQ(again, *r0);
  // (A level-0 request with other content is a new attempt of the step:
  // LevelZeroRequestThatDiffersStartsANewAttempt.)
}

// The step's exchange completed, but the step failed later (its commit vote
// was fenced by a recovery, or timed out): the workers' retry pushes differ,
// so the shards' level-0 requests differ from the completed ones. They are
// a new attempt of the step, exchanged afresh -- not a bad retry (which
// failed the retry with INVALID_ARGUMENT, and the workers gave up).
TEST(ThresholdCoordinatorTest, LevelZeroRequestThatDiffersStartsANewAttempt) {
  ThresholdCoordinator coordinator(1);
  GTOPK_ASSERT_OK_AND_ASSIGN(
      ThresholdResponse first,
      coordinator.Submit(Req(3, 0, 1, 0, {{9, 1}, {7, 1}}), Later()));
  EXPECT_EQ(first.bucket, 9u);
  GTOPK_ASSERT_OK_AND_ASSIGN(
      ThresholdResponse second,
      coordinator.Submit(Req(3, 0, 1, 0, {{5, 1}, {3, 1}}), Later()));
  EXPECT_EQ(second.bucket, 5u);  // the new attempt's answer, not the old
  // An identical request is still a retry of the (new) completed round.
  GTOPK_ASSERT_OK_AND_ASSIGN(
      ThresholdResponse again,
      coordinator.Submit(Req(3, 0, 1, 0, {{5, 1}, {3, 1}}), absl::Now()));
  EXPECT_EQ(again, second);
}

// Fail fast (AbortStep): once the leader aborted a step at an epoch, the
// failed attempt's requests (older epochs) are refused at once, waiters get
// the reason, and the retry (epoch >= the failure's) is exchanged afresh.
TEST(ThresholdCoordinatorTest, AbortRefusesTheFailedAttemptOnly) {
  ThresholdCoordinator coordinator(2);
  ThresholdRequest old0 = Req(5, 0, 1, 0, {{9, 1}});
  old0.epoch = 10;
  absl::StatusOr<ThresholdResponse> waiting;
  std::thread t([&] { waiting = coordinator.Submit(old0, Later()); });
  AwaitSteps(coordinator, 1);
  coordinator.Abort(5, absl::AbortedError("step 5 failed on shard 1: bad"), 11);
  t.join();
  EXPECT_THAT(waiting, StatusIs(absl::StatusCode::kAborted,
                                HasSubstr("failed on shard 1")));
  ThresholdRequest late1 = Req(5, 1, 1, 0, {{9, 1}});
  late1.epoch = 10;  // shard 1 still computing the failed attempt
  EXPECT_THAT(coordinator.Submit(late1, Later()),
              StatusIs(absl::StatusCode::kAborted));
  ThresholdRequest retry0 = Req(5, 0, 1, 0, {{4, 1}});
  ThresholdRequest retry1 = Req(5, 1, 1, 0, {{3, 1}});
  retry0.epoch = retry1.epoch = 11;
  absl::StatusOr<ThresholdResponse> r0;
  std::thread t0([&] { r0 = coordinator.Submit(retry0, Later()); });
  GTOPK_ASSERT_OK_AND_ASSIGN(ThresholdResponse r1,
                             coordinator.Submit(retry1, Later()));
  t0.join();
  GTOPK_ASSERT_OK(r0);
  EXPECT_EQ(r1.bucket, 4u);
}

TEST(ThresholdCoordinatorTest, WrongHistogramSizeFailsTheRoundForEveryone) {
  ThresholdCoordinator coordinator(2);
  const absl::Time start = absl::Now();
  absl::StatusOr<ThresholdResponse> r0;
  std::thread t0([&] {
    r0 = coordinator.Submit(Req(0, 0, 3, 0, {{5, 4}}), Later());
  });
  // Shard 0 is waiting in the round before the bad request arrives (a shard
  // arriving after a failed attempt would start a new one instead).
  AwaitSteps(coordinator, 1);
  ThresholdRequest bad = Req(0, 1, 3, 0, {});
  bad.histogram.resize(512);
  EXPECT_THAT(coordinator.Submit(bad, Later()),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("step 0 level 0"),
                             HasSubstr("shard 1: histogram has 512 buckets, "
                                       "expected 2048"))));
  t0.join();
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  // Shard 0 waited in the failed round: ABORTED naming shard 1's fault.
  EXPECT_THAT(r0, StatusIs(absl::StatusCode::kAborted,
                           HasSubstr("shard 1: histogram has 512 buckets")));
  // A retry of the failed step is a new attempt; it and the next step work.
  {
    absl::StatusOr<ThresholdResponse> a;
    std::thread ta([&] {
      a = coordinator.Submit(Req(0, 0, 3, 0, {{5, 4}}), Later());
    });
    EXPECT_THAT(coordinator.Submit(Req(0, 1, 3, 0, {{5, 1}}), Later()),
                ::gtopk::testing::IsOk());
    ta.join();
    EXPECT_THAT(a, ::gtopk::testing::IsOk());
  }
  std::thread t1([&] {
    r0 = coordinator.Submit(Req(1, 0, 3, 0, {{5, 4}}), Later());
  });
  EXPECT_THAT(coordinator.Submit(Req(1, 1, 3, 0, {{5, 1}}), Later()),
              ::gtopk::testing::IsOk());
  t1.join();
  EXPECT_THAT(r0, ::gtopk::testing::IsOk());
}

TEST(ThresholdCoordinatorTest, InconsistentKFailsTheRound) {
  ThresholdCoordinator coordinator(2);
  // Concurrent level 0: whichever arrives second is blamed, the other
  // aborted.
  absl::StatusOr<ThresholdResponse> r0, r1;
  std::thread t0([&] {
    r0 = coordinator.Submit(Req(0, 0, 5, 0, {{5, 4}}), Later());
  });
  std::thread t1([&] {
    r1 = coordinator.Submit(Req(0, 1, 6, 0, {{5, 4}}), Later());
  });
  t0.join();
  t1.join();
  const bool blame1 = r1.status().code() == absl::StatusCode::kInvalidArgument;
  const auto& culprit = blame1 ? r1 : r0;
  const auto& other = blame1 ? r0 : r1;
  EXPECT_THAT(culprit, StatusIs(absl::StatusCode::kInvalidArgument,
                                HasSubstr("differs from the step's k")));
  EXPECT_THAT(other, StatusIs(absl::StatusCode::kAborted,
                              HasSubstr("differs from the step's k")));

  // Deterministic: the step's k is fixed by level 0; at level 1 shard 1
  // changes it.
  std::thread t2([&] {
    r0 = coordinator.Submit(Req(1, 0, 5, 0, {{5, 4}}), Later());
  });
  GTOPK_ASSERT_OK(coordinator.Submit(Req(1, 1, 5, 0, {{5, 4}}), Later()));
  t2.join();
  GTOPK_ASSERT_OK(r0);
  ASSERT_FALSE(r0->done);
  EXPECT_THAT(coordinator.Submit(Req(1, 1, 6, 1, {{0, 4}}), Later()),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("step 1 level 1"),
                             HasSubstr("shard 1: k = 6 differs from the step's "
                                       "k = 5"))));
  EXPECT_THAT(
      coordinator.Submit(Req(1, 0, 5, 1, {{0, 4}}), Later()),
      StatusIs(absl::StatusCode::kAborted, HasSubstr("shard 1: k = 6")));
  // Level 2 of the failed step fails too.
  EXPECT_THAT(coordinator.Submit(Req(1, 0, 5, 2, {}), Later()),
              ::testing::Not(::gtopk::testing::IsOk()));
}

TEST(ThresholdCoordinatorTest, RejectsMalformedRequests) {
  ThresholdCoordinator coordinator(2);
  EXPECT_THAT(coordinator.Submit(Req(0, 2, 5, 0, {}), Later()),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("shard 2: shard id out of range, S = 2")));
  EXPECT_THAT(
      coordinator.Submit(Req(-1, 0, 5, 0, {}), Later()),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("negative")));
  ThresholdRequest level3 = Req(0, 0, 5, 0, {});
  level3.level = 3;
  EXPECT_THAT(
      coordinator.Submit(level3, Later()),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("level 3")));
  // None of these touched step 0: it still completes.
  std::thread t0([&] {
    EXPECT_THAT(coordinator.Submit(Req(0, 0, 5, 0, {{1, 1}}), Later()),
                ::gtopk::testing::IsOk());
  });
  EXPECT_THAT(coordinator.Submit(Req(0, 1, 5, 0, {{1, 1}}), Later()),
              ::gtopk::testing::IsOk());
  t0.join();

  ThresholdCoordinator single(1);
  EXPECT_THAT(single.Submit(Req(0, 0, 0, 0, {}), Later()),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("k must be >= 1")));
  EXPECT_THAT(
      single.Submit(Req(1, 0, 1, 0, {{0x7f8, 1}}), Later()),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("non-finite")));
  // Level 1 before level 0 completed.
  EXPECT_THAT(single.Submit(Req(2, 0, 1, 1, {}), Later()),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("level 0 of step 2 has not completed")));
  // Counts that contradict the previous level.
  GTOPK_ASSERT_OK_AND_ASSIGN(
      ThresholdResponse r,
      single.Submit(Req(3, 0, 7, 0, {{100, 10}, {200, 5}}), Later()));
  ASSERT_FALSE(r.done);
  EXPECT_EQ(r.bucket, 100u);
  EXPECT_THAT(single.Submit(Req(3, 0, 7, 1, {{4, 9}}), Later()),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("holds 9 entries, but its bucket at level 0 "
                                 "held 10")));

  ThresholdCoordinator none(0);
  EXPECT_THAT(none.Submit(Req(0, 0, 1, 0, {}), Later()),
              StatusIs(absl::StatusCode::kFailedPrecondition, ::testing::_));
}

TEST(ThresholdCoordinatorTest, OldStepsAndBoundedMemory) {
  ThresholdCoordinatorOptions options;
  options.retained_steps = 3;
  ThresholdCoordinator coordinator(1, options);
  ThresholdResponse last;
  for (int64_t step = 0; step < 2000; ++step) {
    // 2 entries, k = 2: keep_all at level 0.
    GTOPK_ASSERT_OK_AND_ASSIGN(
        last, coordinator.Submit(Req(step, 0, 2, 0, {{9, 2}}), Later()));
    ASSERT_TRUE(last.keep_all);
    ASSERT_LE(coordinator.NumRetainedSteps(), 3u);
  }
  EXPECT_THAT(coordinator.Submit(Req(5, 0, 2, 0, {{9, 2}}), Later()),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("step 5 is older than the steps")));
  // A retained, finished step: a retry is answered, a later level is not.
  EXPECT_THAT(coordinator.Submit(Req(1998, 0, 2, 0, {{9, 2}}), Later()),
              ::gtopk::testing::IsOk());
  EXPECT_THAT(coordinator.Submit(Req(1999, 0, 2, 1, {}), Later()),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("already finished at level 0")));
}

TEST(ThresholdCoordinatorTest, EvictedStepAbortsItsWaiters) {
  ThresholdCoordinatorOptions options;
  options.retained_steps = 2;
  ThresholdCoordinator coordinator(2, options);
  const absl::Time start = absl::Now();
  absl::StatusOr<ThresholdResponse> r0;
  std::thread t0([&] {
    r0 = coordinator.Submit(Req(0, 0, 1, 0, {{1, 1}}), Later());
  });
  AwaitSteps(coordinator, 1);
  // Shard 1 moved on (its step 0 failed elsewhere, say) to steps 1 and 2.
  EXPECT_THAT(coordinator.Submit(Req(1, 1, 1, 0, {}), absl::Now()),
              StatusIs(absl::StatusCode::kDeadlineExceeded, ::testing::_));
  EXPECT_THAT(coordinator.Submit(Req(2, 1, 1, 0, {}), absl::Now()),
              StatusIs(absl::StatusCode::kDeadlineExceeded, ::testing::_));
  t0.join();
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  EXPECT_THAT(r0, StatusIs(absl::StatusCode::kAborted,
                           HasSubstr("step 0 level 0: abandoned")));
  EXPECT_LE(coordinator.NumRetainedSteps(), 2u);
}

TEST(ThresholdCoordinatorTest, FenceAbortsWaitersAndRefusesUntilLifted) {
  ThresholdCoordinator coordinator(2);
  absl::StatusOr<ThresholdResponse> r0;
  std::thread t0([&] {
    r0 = coordinator.Submit(Req(0, 0, 1, 0, {{1, 1}}), Later());
  });
  AwaitSteps(coordinator, 1);
  coordinator.Fence(absl::AbortedError("the leader is recovering"));
  t0.join();
  EXPECT_THAT(r0, StatusIs(absl::StatusCode::kAborted,
                           HasSubstr("the leader is recovering")));
  EXPECT_THAT(coordinator.Submit(Req(0, 1, 1, 0, {{1, 1}}), Later()),
              StatusIs(absl::StatusCode::kAborted,
                       HasSubstr("the leader is recovering")));
  coordinator.Unfence();
  // The step starts afresh and completes.
  std::thread t1([&] {
    r0 = coordinator.Submit(Req(0, 0, 1, 0, {{1, 1}}), Later());
  });
  GTOPK_EXPECT_OK(coordinator.Submit(Req(0, 1, 1, 0, {{1, 1}}), Later()));
  t1.join();
  GTOPK_EXPECT_OK(r0);
}

TEST(ThresholdCoordinatorTest, ForgottenStepsAreExchangedAfresh) {
  ThresholdCoordinator coordinator(1);
  // Step 3 finished; when the cluster rolls back to step 2, step 3 is new.
  GTOPK_ASSERT_OK(coordinator.Submit(Req(3, 0, 2, 0, {{9, 2}}), Later()));
  coordinator.ForgetFrom(2);
  GTOPK_EXPECT_OK(coordinator.Submit(Req(3, 0, 2, 0, {{7, 2}}), Later()));
}

TEST(ThresholdCoordinatorTest, CancelledRequestFailsTheRoundForEveryShard) {
  ThresholdCoordinator coordinator(3);
  std::atomic<bool> gone{false};
  absl::StatusOr<ThresholdResponse> r0, r1;
  const absl::Time start = absl::Now();
  std::thread t0([&] {
    r0 = coordinator.Submit(Req(0, 0, 1, 0, {{1, 1}}), Later());
  });
  std::thread t1([&] {
    r1 = coordinator.Submit(Req(0, 1, 1, 0, {{1, 1}}), Later(),
                            [&gone] { return gone.load(); });
  });
  AwaitSteps(coordinator, 1);
  absl::SleepFor(absl::Milliseconds(100));
  gone = true;
  t0.join();
  t1.join();
  EXPECT_LT(absl::Now() - start, absl::Seconds(2));
  EXPECT_THAT(r1, StatusIs(absl::StatusCode::kCancelled));
  EXPECT_THAT(
      r0, StatusIs(absl::StatusCode::kAborted, HasSubstr("shard 1 went away")));
}

// --- Driver error handling --------------------------------------------------

// Answers from a script instead of a coordinator.
class ScriptedExchange final : public ThresholdExchange {
 public:
  explicit ScriptedExchange(
      std::function<absl::StatusOr<ThresholdResponse>(const ThresholdRequest&)>
          answer)
      : answer_(std::move(answer)) {}
  absl::StatusOr<ThresholdResponse> Exchange(const ThresholdRequest& request,
                                             absl::Time) override {
    return answer_(request);
  }

 private:
  std::function<absl::StatusOr<ThresholdResponse>(const ThresholdRequest&)>
      answer_;
};

TEST(DistributedThresholdTopKTest, ErrorsLeaveTheOutputEmpty) {
  const SparseVector sum = MakeSparse({10, 11, 12}, {1.0f, -3.0f, 2.0f});
  auto refine = [](const ThresholdRequest& r) {
    ThresholdResponse out;
    out.step = r.step;
    out.level = r.level;
    out.bucket = 0x3f8;
    return out;
  };
  SparseVector selected;
  auto reset = [&] { selected = MakeSparse({1}, {1.0f}); };

  reset();
  ScriptedExchange down(
      [&](const ThresholdRequest& r) -> absl::StatusOr<ThresholdResponse> {
        if (r.level == 1) return absl::UnavailableError("leader unreachable");
        return refine(r);
      });
  EXPECT_THAT(DistributedThresholdTopK(sum, 2, 7, 2, &down, Later(), &selected),
              StatusIs(absl::StatusCode::kUnavailable,
                       AllOf(HasSubstr("step 7 level 1 (shard 2)"),
                             HasSubstr("leader unreachable"))));
  EXPECT_TRUE(selected.empty());

  reset();
  ScriptedExchange wrong_step([&](const ThresholdRequest& r) {
    ThresholdResponse out = refine(r);
    out.step = r.step + 1;
    return absl::StatusOr<ThresholdResponse>(out);
  });
  EXPECT_THAT(
      DistributedThresholdTopK(sum, 2, 7, 2, &wrong_step, Later(), &selected),
      StatusIs(absl::StatusCode::kInternal, HasSubstr("answered for step 8")));
  EXPECT_TRUE(selected.empty());

  reset();
  ScriptedExchange never_done([&](const ThresholdRequest& r) {
    return absl::StatusOr<ThresholdResponse>(refine(r));
  });
  EXPECT_THAT(
      DistributedThresholdTopK(sum, 2, 7, 2, &never_done, Later(), &selected),
      StatusIs(absl::StatusCode::kInternal, HasSubstr("level 2")));
  EXPECT_TRUE(selected.empty());

  reset();
  ScriptedExchange too_many_ties([&](const ThresholdRequest& r) {
    ThresholdResponse out = refine(r);
    out.done = true;
    out.kth_key = cpu::MagnitudeKey(1.0f);
    out.ties_to_keep = 2;  // only one entry has |x| == 1
    return absl::StatusOr<ThresholdResponse>(out);
  });
  EXPECT_THAT(DistributedThresholdTopK(sum, 2, 7, 2, &too_many_ties, Later(),
                                       &selected),
              StatusIs(absl::StatusCode::kInternal, HasSubstr("has only 1")));
  EXPECT_TRUE(selected.empty());

  reset();
  EXPECT_THAT(
      DistributedThresholdTopK(sum, 0, 7, 2, &never_done, Later(), &selected),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("k must be")));
  EXPECT_TRUE(selected.empty());
  reset();
  EXPECT_THAT(
      DistributedThresholdTopK(MakeSparse({5, 4}, {1.0f, 1.0f}), 1, 7, 2,
                               &never_done, Later(), &selected),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("ascending")));
  EXPECT_TRUE(selected.empty());
  reset();
  EXPECT_THAT(
      DistributedThresholdTopK(sum, 1, 7, 2, nullptr, Later(), &selected),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("exchange")));
  EXPECT_TRUE(selected.empty());
}

}  // namespace
}  // namespace server
}  // namespace gtopk
