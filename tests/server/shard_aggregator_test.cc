// In-process cluster of ShardAggregators (no gRPC): P worker threads push to
// S shards concurrently, step after step, and the result is compared with the
// single-process reference (common/merge.h) bit for bit.
#include "server/shard_aggregator.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/codec.h"
#include "common/error_feedback.h"
#include "common/merge.h"
#include "common/selector.h"
#include "gtest/gtest.h"
#include "server/commit.h"
#include "server/threshold.h"
#include "tests/testing/address_space_cap.h"
#include "tests/testing/reference.h"
#include "tests/testing/status_matchers.h"

namespace gtopk {
namespace server {
namespace {

using ::gtopk::testing::MakeSparse;
using ::gtopk::testing::StatusIs;
using ::testing::AllOf;
using ::testing::HasSubstr;

struct Cluster {
  std::unique_ptr<ThresholdCoordinator> coordinator;
  std::unique_ptr<LocalThresholdExchange> exchange;
  std::vector<std::unique_ptr<ShardAggregator>> shards;
};

Cluster MakeCluster(const ShardOptions& base, uint32_t num_shards) {
  Cluster c;
  c.coordinator = std::make_unique<ThresholdCoordinator>(num_shards);
  c.exchange = std::make_unique<LocalThresholdExchange>(c.coordinator.get());
  for (uint32_t s = 0; s < num_shards; ++s) {
    ShardOptions o = base;
    o.shard_id = s;
    o.num_shards = num_shards;
    auto shard = ShardAggregator::Create(o, c.exchange.get());
    EXPECT_TRUE(shard.ok()) << shard.status();
    c.shards.push_back(*std::move(shard));
  }
  return c;
}

SparseVector Slice(const SparseVector& v, uint64_t begin, uint64_t end) {
  SparseVector out;
  for (size_t j = 0; j < v.size(); ++j) {
    if (v.indices[j] >= begin && v.indices[j] < end) {
      out.push_back(v.indices[j], v.values[j]);
    }
  }
  return out;
}

using ::gtopk::testing::BitEqual;

// mode, selection, workers, shards
using Param = std::tuple<AggregationMode, SelectionKind, int, int>;

class ShardClusterTest : public ::testing::TestWithParam<Param> {};

TEST_P(ShardClusterTest, MatchesSingleProcessReference) {
  const auto [mode, selection, workers, num_shards] = GetParam();
  const uint64_t n = 5003;
  ShardOptions base;
  base.n = n;
  base.num_workers = workers;
  base.mode = mode;
  base.selection = selection;
  base.optimizer.density = 0.02;
  base.step_timeout = absl::Seconds(20);
  Cluster cluster = MakeCluster(base, num_shards);
  auto rule = OptimizerRule::Create(base.optimizer);
  ASSERT_TRUE(rule.ok());

  std::mt19937_64 init_rng(1);
  std::normal_distribution<float> normal;
  std::vector<float> init(n);
  for (float& x : init) x = normal(init_rng);
  for (auto& shard : cluster.shards) {
    auto taken = shard->InitParams(absl::MakeSpan(init).subspan(
        shard->begin(), shard->end() - shard->begin()));
    ASSERT_TRUE(taken.ok() && *taken);
  }
  // Worker replicas, each with its own error feedback and selector.
  std::vector<std::vector<float>> params(workers, init);
  std::vector<std::vector<float>> velocity(workers, std::vector<float>(n));
  std::vector<std::vector<float>> global_v(workers, std::vector<float>(n));
  std::vector<ErrorFeedback> ef;
  for (int w = 0; w < workers; ++w) ef.emplace_back(n);
  auto selector = CreateSelector("exact");
  ASSERT_TRUE(selector.ok());

  for (int step = 0; step < 4; ++step) {
    const uint64_t k = *rule->KAt(step, n);
    std::vector<SparseVector> pushed(workers);
    std::vector<std::vector<float>> dense(workers);
    for (int w = 0; w < workers; ++w) {
      std::mt19937_64 rng(step * 1000 + w);
      std::vector<float> grad(n);
      for (float& g : grad) g = normal(rng);
      // Sparse pushes have empty ranges on purpose for some workers/steps.
      if (w == 1 && step == 2) std::fill(grad.begin(), grad.end(), 0.0f);
      GTOPK_ASSERT_OK(rule->AccumulateLocal(step, grad, params[w],
                                            absl::MakeSpan(velocity[w]),
                                            ef[w].mutable_residual()));
      if (mode == AggregationMode::kDense) {
        dense[w].assign(ef[w].residual().begin(), ef[w].residual().end());
        std::fill(ef[w].mutable_residual().begin(),
                  ef[w].mutable_residual().end(), 0.0f);
      } else {
        SparseVector sent;
        GTOPK_ASSERT_OK((*selector)->Select(ef[w].residual(), k, step, &sent));
        GTOPK_ASSERT_OK(ef[w].MarkSent(sent, sent));
        pushed[w] = sent;
      }
    }
    // Every worker pushes to every shard concurrently (as its S streams do).
    std::vector<std::vector<absl::StatusOr<std::shared_ptr<const RoundResult>>>>
        results(workers);
    std::vector<std::thread> threads;
    for (int w = 0; w < workers; ++w) {
      results[w].resize(num_shards, absl::UnknownError("not run"));
      for (int s = 0; s < num_shards; ++s) {
        threads.emplace_back([&, w, s] {
          ShardAggregator& shard = *cluster.shards[s];
          WorkerPush push;
          push.step = step;
          push.worker = w;
          if (mode == AggregationMode::kDense) {
            push.dense.assign(dense[w].begin() + shard.begin(),
                              dense[w].begin() + shard.end());
          } else {
            push.sparse = Slice(pushed[w], shard.begin(), shard.end());
          }
          results[w][s] =
              shard.Submit(std::move(push), absl::Now() + absl::Seconds(20));
        });
      }
    }
    for (auto& t : threads) t.join();

    // The oracle for this step.
    SparseVector expected;
    std::vector<float> expected_dense;
    if (mode == AggregationMode::kDense) {
      expected_dense = dense[0];
      for (int w = 1; w < workers; ++w) {
        for (uint64_t i = 0; i < n; ++i) expected_dense[i] += dense[w][i];
      }
    } else if (mode == AggregationMode::kTopk) {
      GTOPK_ASSERT_OK(SparseSum(pushed, n, &expected));
    } else if (selection == SelectionKind::kThreshold) {
      GTOPK_ASSERT_OK(ReferenceGtopkStep(pushed, n, k, &expected));
    } else {
      for (auto& shard : cluster.shards) {
        std::vector<SparseVector> slices;
        for (auto& p : pushed)
          slices.push_back(Slice(p, shard->begin(), shard->end()));
        SparseVector sum, top;
        GTOPK_ASSERT_OK(SparseSum(slices, n, &sum));
        const uint64_t range = shard->end() - shard->begin();
        const uint64_t quota = (k * range + n - 1) / n;
        if (quota > 0 && !sum.empty()) {
          GTOPK_ASSERT_OK(SparseTopK(sum, quota, &top));
        }
        for (size_t j = 0; j < top.size(); ++j)
          expected.push_back(top.indices[j], top.values[j]);
      }
    }
    // Every worker got the same result from each shard; their union is the
    // oracle's selection.
    SparseVector got;
    std::vector<float> got_dense;
    for (int s = 0; s < num_shards; ++s) {
      for (int w = 0; w < workers; ++w) {
        ASSERT_TRUE(results[w][s].ok()) << "worker " << w << " shard " << s
                                        << ": " << results[w][s].status();
        ASSERT_EQ(results[w][s]->get(), results[0][s]->get());
      }
      const RoundResult& r = **results[0][s];
      if (mode != AggregationMode::kDense) {
        SparseVector decoded;
        GTOPK_ASSERT_OK(DecodeSparse(r.encoded, n, &decoded));
        ASSERT_EQ(decoded, r.selected);
      } else {
        ASSERT_TRUE(r.encoded.empty());
      }
      for (size_t j = 0; j < r.selected.size(); ++j) {
        got.push_back(r.selected.indices[j], r.selected.values[j]);
      }
      got_dense.insert(got_dense.end(), r.dense_sum.begin(), r.dense_sum.end());
    }
    if (mode == AggregationMode::kDense) {
      ASSERT_TRUE(BitEqual(got_dense, expected_dense)) << "step " << step;
    } else {
      ASSERT_EQ(got, expected) << "step " << step;
    }
    // Workers apply the same update.
    for (int w = 0; w < workers; ++w) {
      if (mode == AggregationMode::kDense) {
        GTOPK_ASSERT_OK(rule->ApplyAggregatedDense(
            got_dense, workers, absl::MakeSpan(params[w]),
            absl::MakeSpan(global_v[w])));
      } else {
        if (mode == AggregationMode::kGtopk) {
          GTOPK_ASSERT_OK(ef[w].PutBack(pushed[w], got));
        }
        GTOPK_ASSERT_OK(
            rule->MaskMomentum(pushed[w], got, absl::MakeSpan(velocity[w])));
        GTOPK_ASSERT_OK(rule->ApplyAggregated(got, 0, workers,
                                              absl::MakeSpan(params[w]),
                                              absl::MakeSpan(global_v[w])));
      }
    }
  }
  // Servers and every replica hold the same bits.
  for (auto& shard : cluster.shards) {
    auto server = shard->Params(absl::Now() + absl::Seconds(1));
    ASSERT_TRUE(server.ok());
    EXPECT_EQ(server->second, 4);
    for (int w = 0; w < workers; ++w) {
      ASSERT_TRUE(BitEqual(server->first,
                           absl::MakeSpan(params[w]).subspan(
                               shard->begin(), shard->end() - shard->begin())))
          << "worker " << w << " shard " << shard->options().shard_id;
    }
  }
}

std::string Name(const ::testing::TestParamInfo<Param>& info) {
  const auto [mode, selection, workers, shards] = info.param;
  return absl::StrCat(AggregationModeName(mode), "_",
                      SelectionKindName(selection), "_P", workers, "_S",
                      shards);
}

INSTANTIATE_TEST_SUITE_P(
    Gtopk, ShardClusterTest,
    ::testing::Combine(::testing::Values(AggregationMode::kGtopk),
                       ::testing::Values(SelectionKind::kThreshold,
                                         SelectionKind::kQuota),
                       ::testing::Values(1, 2, 3, 5, 8),
                       ::testing::Values(1, 2, 3)),
    Name);
INSTANTIATE_TEST_SUITE_P(
    Baselines, ShardClusterTest,
    ::testing::Combine(::testing::Values(AggregationMode::kTopk,
                                         AggregationMode::kDense),
                       ::testing::Values(SelectionKind::kThreshold),
                       ::testing::Values(1, 3, 8), ::testing::Values(1, 3)),
    Name);

// --- Failure handling ------------------------------------------------------

ShardOptions SmallOptions(uint32_t workers) {
  ShardOptions o;
  o.n = 100;
  o.num_workers = workers;
  o.optimizer.density = 0.1;
  o.step_timeout = absl::Seconds(5);
  return o;
}

std::unique_ptr<ShardAggregator> SingleShard(uint32_t workers) {
  auto shard = ::gtopk::testing::OkOrThrow(
      ShardAggregator::Create(SmallOptions(workers), nullptr),
      "ShardAggregator::Create");
  std::vector<float> init(100, 1.0f);
  GTOPK_EXPECT_OK(shard->InitParams(init));
  return shard;
}

WorkerPush Push(int64_t step, uint32_t worker, std::vector<uint32_t> idx) {
  WorkerPush p;
  p.step = step;
  p.worker = worker;
  for (uint32_t i : idx) p.sparse.push_back(i, 0.5f + static_cast<float>(i));
  return p;
}

// The same kind of fault as InitParams' (service_test
// InitParamsOfARangeThatDoesNotFitIsResourceExhausted): a copy of the
// range sized by the cluster's n, here GetState's for a download or a
// checkpoint (up to four downloads at once). Without the memory it is
// RESOURCE_EXHAUSTED, nothing changed, and it succeeds once memory is free.
TEST(ShardAggregatorTest, ACopyOfTheRangeWithoutMemoryIsResourceExhausted) {
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  GTEST_SKIP() << "RLIMIT_AS cannot cap a sanitizer's shadow mappings";
#else
  ShardOptions o = SmallOptions(1);
  o.n = uint64_t{1} << 27;  // 512 MiB of parameters
  auto shard = ShardAggregator::Create(o, nullptr);
  ASSERT_TRUE(shard.ok()) << shard.status();
  {
    std::vector<float> init(o.n, 0.25f);
    GTOPK_ASSERT_OK((*shard)->InitParams(init).status());
  }
  absl::StatusOr<ShardAggregator::State> refused;
  {
    ::gtopk::testing::ScopedAddressSpaceCap cap(uint64_t{128} << 20);
    ASSERT_TRUE(cap.ok());
    refused = (*shard)->GetState(absl::Now() + absl::Seconds(1));
  }
  EXPECT_THAT(refused.status(),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       ::testing::HasSubstr(
                           "cannot copy its 134217728 parameters (536870912 "
                           "bytes) for a download or checkpoint: out of "
                           "memory")));
  const auto state = (*shard)->GetState(absl::Now() + absl::Seconds(1));
  ASSERT_TRUE(state.ok()) << state.status();
  EXPECT_EQ(state->params.size(), o.n);
  EXPECT_EQ(state->params.back(), 0.25f);
#endif
}

TEST(ShardAggregatorTest, BadPushFailsTheStepForEveryoneAndIsNotApplied) {
  auto shard = SingleShard(2);
  const auto before = shard->Params(absl::Now() + absl::Seconds(1))->first;
  absl::StatusOr<std::shared_ptr<const RoundResult>> good;
  std::thread t([&] {
    good = shard->Submit(Push(0, 0, {1, 2}), absl::Now() + absl::Seconds(5));
  });
  absl::SleepFor(absl::Milliseconds(50));
  WorkerPush bad = Push(0, 1, {5, 3});  // unsorted
  EXPECT_THAT(shard->Submit(bad, absl::Now() + absl::Seconds(5)),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("worker 1 step 0: sparse indices not "
                                 "strictly ascending at position 1")));
  t.join();
  EXPECT_THAT(good, StatusIs(absl::StatusCode::kAborted,
                             HasSubstr("step 0 failed on shard 0")));
  EXPECT_EQ(shard->next_step(), 0);
  EXPECT_EQ(shard->Params(absl::Now() + absl::Seconds(1))->first, before);
  // The step can be retried and then completes.
  std::thread t2([&] {
    good = shard->Submit(Push(0, 0, {1, 2}), absl::Now() + absl::Seconds(5));
  });
  auto second =
      shard->Submit(Push(0, 1, {3, 5}), absl::Now() + absl::Seconds(5));
  t2.join();
  GTOPK_EXPECT_OK(second);
  GTOPK_EXPECT_OK(good);
  EXPECT_EQ(shard->next_step(), 1);
}

TEST(ShardAggregatorTest,
     BadPushBeforeOthersArriveIsNotAppliedAndCanBeRetried) {
  auto shard = SingleShard(2);
  EXPECT_THAT(
      shard->Submit(Push(0, 1, {200}), absl::Now() + absl::Seconds(5)),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("out of range")));
  // The other worker's push starts a round that waits for worker 1's retry
  // (or fails at its deadline naming worker 1).
  EXPECT_THAT(
      shard->Submit(Push(0, 0, {1}), absl::Now() + absl::Milliseconds(200)),
      StatusIs(absl::StatusCode::kDeadlineExceeded,
               HasSubstr("waiting for worker(s) 1")));
  EXPECT_EQ(shard->next_step(), 0);
  absl::StatusOr<std::shared_ptr<const RoundResult>> first;
  std::thread t([&] {
    first = shard->Submit(Push(0, 0, {1}), absl::Now() + absl::Seconds(5));
  });
  GTOPK_EXPECT_OK(
      shard->Submit(Push(0, 1, {2}), absl::Now() + absl::Seconds(5)));
  t.join();
  GTOPK_EXPECT_OK(first);
  EXPECT_EQ(shard->next_step(), 1);
}

TEST(ShardAggregatorTest, EveryKindOfBadPushIsRejected) {
  auto shard = SingleShard(2);
  const absl::Time d = absl::Now() + absl::Seconds(5);
  EXPECT_THAT(shard->Submit(Push(0, 7, {1}), d),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("unknown worker rank 7")));
  EXPECT_THAT(
      shard->Submit(Push(0, 0, {2, 2}), d),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("(duplicate)")));
  WorkerPush mismatch = Push(0, 0, {1, 2});
  mismatch.sparse.values.pop_back();
  EXPECT_THAT(shard->Submit(mismatch, d),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("2 indices but 1 values")));
  WorkerPush nan = Push(0, 0, {1});
  nan.sparse.values[0] = NAN;
  EXPECT_THAT(
      shard->Submit(nan, d),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("not finite")));
  WorkerPush dense = Push(0, 0, {});
  dense.dense = {1.0f};
  EXPECT_THAT(shard->Submit(dense, d),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("dense values sent in gtopk mode")));
  EXPECT_THAT(shard->Submit(Push(3, 0, {1}), d),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("step 3 is ahead")));
  EXPECT_THAT(shard->Submit(Push(-5, 0, {1}), d),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("step -5 is negative")));
  EXPECT_EQ(shard->next_step(), 0);
}

// A worker that saw its step fail elsewhere retries it after Recover with
// what its residual holds now, which differs from its first push by design.
// While the round collects, the newest push is the worker's contribution:
// the round equals a fresh round of the retry. (It was refused with
// INVALID_ARGUMENT, which workers do not retry: the run ended.)
TEST(ShardAggregatorTest, SecondPushForTheSameStepReplacesTheFirst) {
  auto shard = SingleShard(2);
  absl::StatusOr<std::shared_ptr<const RoundResult>> first, second;
  std::thread t1([&] {
    first = shard->Submit(Push(0, 0, {1, 2}), absl::Now() + absl::Seconds(5));
  });
  absl::SleepFor(absl::Milliseconds(50));
  std::thread t2([&] {
    second = shard->Submit(Push(0, 0, {3}), absl::Now() + absl::Seconds(5));
  });
  absl::SleepFor(absl::Milliseconds(50));
  GTOPK_EXPECT_OK(
      shard->Submit(Push(0, 1, {4}), absl::Now() + absl::Seconds(5)));
  t1.join();
  t2.join();
  GTOPK_ASSERT_OK(first);
  GTOPK_ASSERT_OK(second);
  // The round used the second push: indices 3 and 4, with their values.
  EXPECT_EQ((*second)->selected.indices, (std::vector<uint32_t>{3, 4}));
  EXPECT_EQ((*second)->selected.values, (std::vector<float>{3.5f, 4.5f}));
  EXPECT_EQ(*first, *second);  // one round, one result
  EXPECT_EQ(shard->next_step(), 1);
}

WorkerPush EpochPush(int64_t step, uint32_t worker, std::vector<uint32_t> idx,
                     uint64_t epoch) {
  WorkerPush p = Push(step, worker, std::move(idx));
  p.epoch = epoch;
  return p;
}

// The retry of step 0 at epoch 6 (after Recover) by workers 0 and 1 of a
// 2-worker shard, with `between` run while worker 0's push waits: one
// round of indices 7 and 8.
void ExpectRetryOfStep0Completes(ShardAggregator& shard,
                                 const std::function<void()>& between) {
  absl::StatusOr<std::shared_ptr<const RoundResult>> retry0;
  std::thread t0([&] {
    retry0 =
        shard.Submit(EpochPush(0, 0, {7}, 6), absl::Now() + absl::Seconds(5));
  });
  absl::SleepFor(absl::Milliseconds(50));
  between();
  absl::StatusOr<std::shared_ptr<const RoundResult>> retry1 =
      shard.Submit(EpochPush(0, 1, {8}, 6), absl::Now() + absl::Seconds(5));
  t0.join();
  GTOPK_ASSERT_OK(retry0);
  GTOPK_ASSERT_OK(retry1);
  EXPECT_EQ((*retry1)->selected.indices, (std::vector<uint32_t>{7, 8}));
}

// `push`'s answer (20 s deadline) when AbortStep(step, reason, epoch)
// comes 50 ms after it; the answer must come long before the deadline.
absl::StatusOr<std::shared_ptr<const RoundResult>> SubmitThenAbort(
    ShardAggregator& shard, WorkerPush push, int64_t step,
    const absl::Status& reason, uint64_t epoch) {
  absl::StatusOr<std::shared_ptr<const RoundResult>> waiting;
  const absl::Time start = absl::Now();
  std::thread t([&] {
    waiting = shard.Submit(std::move(push), absl::Now() + absl::Seconds(20));
  });
  absl::SleepFor(absl::Milliseconds(50));
  shard.AbortStep(step, reason, epoch);
  t.join();
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));  // not the deadline
  return waiting;
}

// Fail fast (AbortStep from the leader): the pending round holding a push
// of the failed attempt fails at once with the reason; the failed attempt's
// late pushes are refused; the retry (pushed with the newer epoch Recover
// returned) forms a fresh round and completes.
TEST(ShardAggregatorTest, AbortStepFailsTheAttemptAndKeepsTheRetry) {
  auto shard = SingleShard(2);
  const absl::Status reason =
      absl::AbortedError("step 0 failed on shard 1: bad push");
  EXPECT_THAT(
      SubmitThenAbort(*shard, EpochPush(0, 0, {1}, 5), 0, reason, 6),
      StatusIs(absl::StatusCode::kAborted, HasSubstr("failed on shard 1")));
  // Worker 1 has not recovered yet: its push of the failed attempt.
  EXPECT_THAT(
      shard->Submit(EpochPush(0, 1, {2}, 5), absl::Now() + absl::Seconds(5)),
      StatusIs(absl::StatusCode::kAborted, HasSubstr("bad push")));
  // The retry, after Recover (epoch 6).
  ExpectRetryOfStep0Completes(*shard, [] {});
  EXPECT_EQ(shard->next_step(), 1);
  // A stale AbortStep of an applied step changes nothing.
  shard->AbortStep(0, reason, 7);
  EXPECT_EQ(shard->next_step(), 1);
}

// A failure that reaches a round still waiting for pushes (AbortStep: the
// leader's news of a failure elsewhere) names whom the round was waiting
// for: the failure elsewhere can be this wait's consequence -- another
// shard's threshold exchange timing out on this shard before this shard's
// own deadline names the missing worker (fault_test's PartialPushTest, one
// run in a loaded make test). The code is the reason's.
TEST(ShardAggregatorTest, AnAbortedRoundNamesTheWorkersItWaitedFor) {
  auto shard = SingleShard(3);
  const absl::Status reason = absl::DeadlineExceededError(
      "step 0 failed on shard 0: threshold exchange step 0 level 0 (shard "
      "0): deadline exceeded waiting for shard 1 (1 of 2 arrived)");
  EXPECT_THAT(SubmitThenAbort(*shard, EpochPush(0, 1, {1}, 5), 0, reason, 6),
              StatusIs(absl::StatusCode::kDeadlineExceeded,
                       AllOf(HasSubstr("waiting for shard 1 (1 of 2"),
                             HasSubstr("; shard 0 was still waiting for "
                                       "worker(s) 0, 2"))));
}

// A worker's abandon (Push.abandon) of an attempt that already failed --
// it arrived after the worker's Recover, as it can when a non-finite
// gradient ends the step while a push is out -- leaves the retry's round
// alone; an abandon of the current attempt fails it.
TEST(ShardAggregatorTest, AStaleAbandonDoesNotFailTheRetry) {
  auto shard = SingleShard(2);
  const absl::Status gone = absl::CancelledError("worker 0 abandoned step 0");
  shard->AbortStep(0, absl::AbortedError("step 0 failed"), 6);
  ExpectRetryOfStep0Completes(*shard, [&] {
    EXPECT_FALSE(shard->AbandonPush(0, 0, 5, gone));  // the failed attempt's
  });
  // Step 1, current attempt: the abandon fails the round.
  absl::StatusOr<std::shared_ptr<const RoundResult>> waiting;
  std::thread t1([&] {
    waiting =
        shard->Submit(EpochPush(1, 1, {2}, 6), absl::Now() + absl::Seconds(20));
  });
  absl::SleepFor(absl::Milliseconds(50));
  EXPECT_TRUE(shard->AbandonPush(1, 0, 6, gone));
  t1.join();
  EXPECT_THAT(waiting, StatusIs(absl::StatusCode::kAborted,
                                HasSubstr("abandoned step 0")));
}

// The step-failed callback (what tells the other shards, fail fast) fires
// for failures that arise on this shard -- a bad push, also when it opens
// no round; the step deadline -- and not for AbortStep (news from the
// leader, which must not echo back).
TEST(ShardAggregatorTest, StepFailedCallbackReportsLocalFailuresOnly) {
  auto shard = SingleShard(2);
  absl::Mutex mu;
  std::vector<std::pair<int64_t, absl::StatusCode>> seen;
  shard->SetStepFailedCallback([&](int64_t step, const absl::Status& why) {
    absl::MutexLock lock(&mu);
    seen.emplace_back(step, why.code());
  });
  WorkerPush bad = Push(0, 0, {200});  // outside the shard's range
  EXPECT_THAT(shard->Submit(bad, absl::Now() + absl::Seconds(1)),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(
      shard->Submit(Push(0, 1, {1}), absl::Now() + absl::Milliseconds(100)),
      StatusIs(absl::StatusCode::kDeadlineExceeded));
  shard->AbortStep(0, absl::AbortedError("elsewhere"), 9);
  absl::MutexLock lock(&mu);
  ASSERT_EQ(seen.size(), 2u);
  EXPECT_EQ(seen[0],
            std::make_pair(int64_t{0}, absl::StatusCode::kInvalidArgument));
  EXPECT_EQ(seen[1],
            std::make_pair(int64_t{0}, absl::StatusCode::kDeadlineExceeded));
}

TEST(ShardAggregatorTest, MissingWorkerTimesOutNamingIt) {
  auto shard = SingleShard(3);
  const absl::Time start = absl::Now();
  std::thread t([&] {
    EXPECT_THAT(
        shard->Submit(Push(0, 0, {1}), absl::Now() + absl::Milliseconds(300)),
        StatusIs(absl::StatusCode::kDeadlineExceeded,
                 HasSubstr("waiting for worker(s) 1, 2")));
  });
  t.join();
  EXPECT_LT(absl::Now() - start, absl::Seconds(3));
  EXPECT_EQ(shard->next_step(), 0);
}

// Graceful shutdown's drain: the round in progress completes and is
// applied; a push that would open the next round fails with the drain's
// reason and opens nothing.
TEST(ShardAggregatorTest,
     DrainLetsTheRoundInProgressCompleteAndRefusesNewOnes) {
  auto shard = SingleShard(2);
  EXPECT_TRUE(shard->AwaitNoRound(absl::Now()));
  absl::StatusOr<std::shared_ptr<const RoundResult>> first;
  std::thread t([&] {
    first = shard->Submit(Push(0, 0, {1, 2}), absl::Now() + absl::Seconds(5));
  });
  absl::SleepFor(absl::Milliseconds(50));
  // A round is open: the drain waits for it.
  EXPECT_FALSE(shard->AwaitNoRound(absl::Now() + absl::Milliseconds(50)));
  shard->BeginDrain(absl::UnavailableError("shard 0 is shutting down"));
  GTOPK_EXPECT_OK(
      shard->Submit(Push(0, 1, {3}), absl::Now() + absl::Seconds(5)));
  t.join();
  GTOPK_EXPECT_OK(first);
  EXPECT_TRUE(shard->AwaitNoRound(absl::Now() + absl::Seconds(1)));
  EXPECT_EQ(shard->next_step(), 1);
  EXPECT_THAT(shard->Submit(Push(1, 0, {1}), absl::Now() + absl::Seconds(5)),
              StatusIs(absl::StatusCode::kUnavailable,
                       HasSubstr("shard 0 is shutting down")));
  EXPECT_TRUE(shard->AwaitNoRound(absl::Now()));
  EXPECT_EQ(shard->next_step(), 1);
  // A retry of the applied step is still answered from the cache.
  GTOPK_EXPECT_OK(shard->Submit(Push(0, 0, {1, 2}), absl::Now()));
}

TEST(ShardAggregatorTest, RetryOfACompletedStepGetsTheSameResult) {
  auto shard = SingleShard(1);
  auto first =
      shard->Submit(Push(0, 0, {4, 9}), absl::Now() + absl::Seconds(5));
  GTOPK_ASSERT_OK(first);
  auto retry = shard->Submit(Push(0, 0, {1}), absl::Now() + absl::Seconds(5));
  GTOPK_ASSERT_OK(retry);
  EXPECT_EQ(first->get(), retry->get());
  EXPECT_EQ(shard->next_step(), 1);
  EXPECT_THAT(shard->Submit(Push(0, 0, {1}), absl::Now()),
              testing::IsOk());  // still the last step: a retry
  GTOPK_ASSERT_OK(
      shard->Submit(Push(1, 0, {1}), absl::Now() + absl::Seconds(5)));
  EXPECT_THAT(shard->Submit(Push(0, 0, {1}), absl::Now()),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("step 0 was already applied")));
}

TEST(ShardAggregatorTest, NoPushBeforeInitialisation) {
  auto shard = ShardAggregator::Create(SmallOptions(1), nullptr);
  ASSERT_TRUE(shard.ok());
  EXPECT_THAT((*shard)->Submit(Push(0, 0, {1}), absl::Now()),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("no parameters yet")));
  EXPECT_THAT((*shard)->Params(absl::Now() + absl::Milliseconds(20)),
              StatusIs(absl::StatusCode::kDeadlineExceeded));
  std::vector<float> wrong(99, 1.0f);
  EXPECT_THAT((*shard)->InitParams(wrong),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("owns 100 parameters")));
}

TEST(ShardAggregatorTest, SnapshotRestoreRoundTrip) {
  auto shard = SingleShard(1);
  GTOPK_ASSERT_OK(
      shard->Submit(Push(0, 0, {4, 9}), absl::Now() + absl::Seconds(5)));
  auto snap = shard->Snapshot();
  GTOPK_ASSERT_OK(snap);
  auto fresh = ShardAggregator::Create(SmallOptions(1), nullptr);
  ASSERT_TRUE(fresh.ok());
  GTOPK_ASSERT_OK((*fresh)->Restore(*snap));
  EXPECT_EQ((*fresh)->next_step(), 1);
  EXPECT_EQ((*fresh)->Params(absl::Now())->first,
            shard->Params(absl::Now())->first);
  ShardCheckpoint other = *snap;
  other.n = 101;
  EXPECT_THAT((*fresh)->Restore(other),
              StatusIs(absl::StatusCode::kFailedPrecondition));
}

TEST(ShardAggregatorTest, RollbackRestoresACheckpointAndAbortsThePendingRound) {
  auto shard = SingleShard(2);
  GTOPK_ASSERT_OK_AND_ASSIGN(ShardCheckpoint at0, shard->Snapshot());
  std::thread t0([&] {
    GTOPK_EXPECT_OK(
        shard->Submit(Push(0, 0, {1, 2}), absl::Now() + absl::Seconds(5)));
  });
  GTOPK_ASSERT_OK(
      shard->Submit(Push(0, 1, {2, 3}), absl::Now() + absl::Seconds(5)));
  t0.join();
  ASSERT_EQ(shard->next_step(), 1);
  absl::StatusOr<std::shared_ptr<const RoundResult>> pending;
  std::thread t1([&] {
    pending = shard->Submit(Push(1, 0, {4}), absl::Now() + absl::Seconds(5));
  });
  absl::SleepFor(absl::Milliseconds(50));
  // Wrong step without a checkpoint, or a checkpoint of another step:
  // refused, nothing changes.
  EXPECT_THAT(shard->Rollback(0, nullptr, absl::AbortedError("x")),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("is at step 1")));
  EXPECT_THAT(shard->Rollback(1, &at0, absl::AbortedError("x")),
              StatusIs(absl::StatusCode::kFailedPrecondition));
  EXPECT_EQ(shard->next_step(), 1);
  GTOPK_ASSERT_OK(shard->Rollback(
      0, &at0, absl::AbortedError("the cluster rolled back to step 0")));
  t1.join();
  EXPECT_THAT(pending, StatusIs(absl::StatusCode::kAborted,
                                HasSubstr("rolled back to step 0")));
  EXPECT_EQ(shard->next_step(), 0);
  EXPECT_EQ(shard->Params(absl::Now())->first, at0.params);
  // The retry cache went with the rollback: step 0 is a fresh round that
  // needs both workers again (a lone push times out naming worker 1).
  EXPECT_THAT(
      shard->Submit(Push(0, 0, {1}), absl::Now() + absl::Milliseconds(100)),
      StatusIs(absl::StatusCode::kDeadlineExceeded,
               HasSubstr("waiting for worker(s) 1")));
}

// A commit voter that holds every vote until released.
class HeldCommit final : public CommitVoter {
 public:
  absl::Status Vote(int64_t, uint32_t, absl::Time deadline, uint64_t) override {
    absl::MutexLock lock(&mu_);
    ++waiting_;
    mu_.AwaitWithDeadline(absl::Condition(&released_), deadline);
    return absl::OkStatus();
  }
  void Release() {
    absl::MutexLock lock(&mu_);
    released_ = true;
  }
  bool Waiting() {
    absl::MutexLock lock(&mu_);
    return waiting_ > 0;
  }

 private:
  absl::Mutex mu_;
  bool released_ ABSL_GUARDED_BY(mu_) = false;
  int waiting_ ABSL_GUARDED_BY(mu_) = 0;
};

TEST(ShardAggregatorTest, RoundComputedAcrossARollbackIsNeverApplied) {
  ShardOptions o = SmallOptions(1);
  o.num_shards = 2;  // shard 0 of 2: votes before applying
  o.selection = SelectionKind::kQuota;
  HeldCommit commit;
  auto created = ShardAggregator::Create(o, nullptr, &commit);
  ASSERT_TRUE(created.ok()) << created.status();
  ShardAggregator& shard = **created;
  GTOPK_ASSERT_OK(shard.InitParams(std::vector<float>(50, 1.0f)));
  absl::StatusOr<std::shared_ptr<const RoundResult>> result;
  std::thread t([&] {
    result = shard.Submit(Push(0, 0, {1, 2}), absl::Now() + absl::Seconds(5));
  });
  while (!commit.Waiting()) absl::SleepFor(absl::Milliseconds(5));
  // Computing: the state is not settled yet.
  EXPECT_THAT(shard.SettledNextStep(absl::Now() + absl::Milliseconds(50)),
              StatusIs(absl::StatusCode::kDeadlineExceeded,
                       HasSubstr("still computing step 0")));
  GTOPK_ASSERT_OK(
      shard.Rollback(0, nullptr, absl::AbortedError("rolled back")));
  EXPECT_THAT(shard.SettledNextStep(absl::Now() + absl::Seconds(1)),
              ::gtopk::testing::IsOk());
  commit.Release();  // the vote succeeds, but the round was abandoned
  t.join();
  EXPECT_THAT(result, StatusIs(absl::StatusCode::kAborted,
                               HasSubstr("abandoned on shard 0")));
  EXPECT_EQ(shard.next_step(), 0);
  EXPECT_EQ(shard.Params(absl::Now())->first, std::vector<float>(50, 1.0f));
}

// --- Updates that would leave the finite range (issue 13, part 3) ----------

// Submits `pushes[w]` for every worker w concurrently to `shard` and returns
// each worker's result.
std::vector<absl::StatusOr<std::shared_ptr<const RoundResult>>> SubmitAll(
    ShardAggregator& shard, std::vector<WorkerPush> pushes,
    absl::Duration timeout = absl::Seconds(5)) {
  std::vector<absl::StatusOr<std::shared_ptr<const RoundResult>>> out(
      pushes.size(), absl::UnknownError("not run"));
  std::vector<std::thread> threads;
  const absl::Time deadline = absl::Now() + timeout;
  for (size_t w = 0; w < pushes.size(); ++w) {
    threads.emplace_back(
        [&, w] { out[w] = shard.Submit(std::move(pushes[w]), deadline); });
  }
  for (auto& t : threads) t.join();
  return out;
}

WorkerPush PushOf(int64_t step, uint32_t worker, SparseVector v) {
  WorkerPush p;
  p.step = step;
  p.worker = worker;
  p.sparse = std::move(v);
  return p;
}

std::unique_ptr<ShardAggregator> FiniteTestShard(
    MomentumMode momentum, std::vector<float> init,
    AggregationMode mode = AggregationMode::kGtopk) {
  ShardOptions o;
  o.n = init.size();
  o.num_workers = 2;
  o.mode = mode;
  o.optimizer.density = 0.1;  // k = 2 of 20
  o.optimizer.momentum_mode = momentum;
  o.step_timeout = absl::Seconds(5);
  auto shard = ::gtopk::testing::OkOrThrow(ShardAggregator::Create(o, nullptr),
                                           "ShardAggregator::Create");
  GTOPK_EXPECT_OK(shard->InitParams(init));
  return shard;
}

// The reproduction: one shard, two workers, n = 20, no momentum;
// params[3] = -3e38 and both workers push {3: 1.5e38}: the update
// 3e38 / 2 = 1.5e38 would make params[3] = -4.5e38 = -inf. Before the fix
// the step returned OK and the shard held -inf.
TEST(ShardFiniteTest, UpdateThatWouldMakeAParameterInfiniteIsRefused) {
  std::vector<float> init(20, 1.0f);
  init[3] = -3e38f;
  auto shard = FiniteTestShard(MomentumMode::kNone, init);
  auto results = SubmitAll(*shard, {PushOf(0, 0, MakeSparse({3}, {1.5e38f})),
                                    PushOf(0, 1, MakeSparse({3}, {1.5e38f}))});
  for (const auto& r : results) {
    EXPECT_THAT(r, StatusIs(absl::StatusCode::kFailedPrecondition,
                            AllOf(HasSubstr("step 0 failed on shard 0"),
                                  HasSubstr("params[3] would become -inf"),
                                  HasSubstr("-3e+38 - 1.5e+38"),
                                  HasSubstr("nothing was applied"))));
  }
  EXPECT_EQ(shard->next_step(), 0);
  auto state = shard->GetState(absl::Now() + absl::Seconds(1));
  GTOPK_ASSERT_OK(state);
  EXPECT_TRUE(BitEqual(state->params, init));
  // Refusing is not a broken shard: a finite step afterwards completes.
  results = SubmitAll(*shard, {PushOf(0, 0, MakeSparse({3}, {-1e38f})),
                               PushOf(0, 1, MakeSparse({5}, {2.0f}))});
  GTOPK_EXPECT_OK(results[0]);
  GTOPK_EXPECT_OK(results[1]);
  EXPECT_EQ(shard->next_step(), 1);
}

// Global momentum: V = 0.9 V + A/P, params -= V. Step 0 (V = 1.5e38,
// params[3] = -1e38 - 1.5e38 = -2.5e38) is finite and applied; step 1 with
// the same pushes makes V = 2.85e38 and params[3] = -5.35e38 = -inf:
// refused, and neither the parameters nor the velocity change.
TEST(ShardFiniteTest, GlobalMomentumUpdateThatWouldOverflowIsRefused) {
  std::vector<float> init(20, 1.0f);
  init[3] = -1e38f;
  auto shard = FiniteTestShard(MomentumMode::kGlobal, init);
  auto pushes = [](int64_t step) {
    return std::vector<WorkerPush>{PushOf(step, 0, MakeSparse({3}, {1.5e38f})),
                                   PushOf(step, 1, MakeSparse({3}, {1.5e38f}))};
  };
  auto results = SubmitAll(*shard, pushes(0));
  GTOPK_ASSERT_OK(results[0]);
  GTOPK_ASSERT_OK(results[1]);
  auto after0 = shard->GetState(absl::Now() + absl::Seconds(1));
  GTOPK_ASSERT_OK(after0);
  EXPECT_EQ(after0->global_velocity[3], 1.5e38f);
  results = SubmitAll(*shard, pushes(1));
  for (const auto& r : results) {
    EXPECT_THAT(r, StatusIs(absl::StatusCode::kFailedPrecondition,
                            AllOf(HasSubstr("step 1 failed on shard 0"),
                                  HasSubstr("params[3] would become -inf"))));
  }
  EXPECT_EQ(shard->next_step(), 1);
  auto after1 = shard->GetState(absl::Now() + absl::Seconds(1));
  GTOPK_ASSERT_OK(after1);
  EXPECT_TRUE(BitEqual(after1->params, after0->params));
  EXPECT_TRUE(BitEqual(after1->global_velocity, after0->global_velocity));
}

// Finite pushes whose sum overflows (1e38 + 3e38 > FLT_MAX): the step cannot
// be applied for anyone, with the same code as an overflowing parameter
// (before the fix: INVALID_ARGUMENT, as if one worker's push were bad).
TEST(ShardFiniteTest, SumOfFinitePushesThatOverflowsIsRefused) {
  std::vector<float> init(20, 1.0f);
  auto shard = FiniteTestShard(MomentumMode::kNone, init);
  auto results = SubmitAll(*shard, {PushOf(0, 0, MakeSparse({7}, {1e38f})),
                                    PushOf(0, 1, MakeSparse({7}, {3e38f}))});
  for (const auto& r : results) {
    EXPECT_THAT(r, StatusIs(absl::StatusCode::kFailedPrecondition,
                            AllOf(HasSubstr("sum of the workers' pushes"),
                                  HasSubstr("index 7"))));
  }
  EXPECT_EQ(shard->next_step(), 0);
  auto dense =
      FiniteTestShard(MomentumMode::kNone, init, AggregationMode::kDense);
  std::vector<WorkerPush> pushes(2);
  for (uint32_t w = 0; w < 2; ++w) {
    pushes[w].worker = w;
    pushes[w].dense.assign(20, 0.0f);
    pushes[w].dense[7] = w == 0 ? 1e38f : 3e38f;
  }
  results = SubmitAll(*dense, pushes);
  for (const auto& r : results) {
    EXPECT_THAT(r, StatusIs(absl::StatusCode::kFailedPrecondition,
                            AllOf(HasSubstr("sum of the workers' pushes"),
                                  HasSubstr("position 7"))));
  }
  EXPECT_EQ(dense->next_step(), 0);
}

// Dense mode: a finite sum whose update overflows a parameter.
TEST(ShardFiniteTest, DenseUpdateThatWouldMakeAParameterInfiniteIsRefused) {
  std::vector<float> init(20, 1.0f);
  init[3] = -3e38f;
  auto shard =
      FiniteTestShard(MomentumMode::kNone, init, AggregationMode::kDense);
  std::vector<WorkerPush> pushes(2);
  for (uint32_t w = 0; w < 2; ++w) {
    pushes[w].worker = w;
    pushes[w].dense.assign(20, 0.5f);
    pushes[w].dense[3] = 1.5e38f;
  }
  auto results = SubmitAll(*shard, pushes);
  for (const auto& r : results) {
    EXPECT_THAT(r, StatusIs(absl::StatusCode::kFailedPrecondition,
                            HasSubstr("params[3] would become -inf")));
  }
  EXPECT_EQ(shard->next_step(), 0);
  EXPECT_TRUE(BitEqual(shard->GetState(absl::Now())->params, init));
}

// S = 2 behind a real commit vote: shard 1's update would overflow, shard
// 0's is fine. Shard 1 must not vote, so shard 0 must not apply the step
// either (its vote fails at the deadline); before the fix both applied and
// shard 1 held -inf.
TEST(ShardFiniteTest, NoShardAppliesAStepAnotherShardFoundNonFinite) {
  for (MomentumMode momentum : {MomentumMode::kNone, MomentumMode::kGlobal}) {
    SCOPED_TRACE(MomentumModeName(momentum));
    CommitCoordinator coordinator(2);
    LocalCommitVoter commit(&coordinator);
    ThresholdCoordinator thresholds(2);
    LocalThresholdExchange exchange(&thresholds);
    std::vector<float> init(20, 1.0f);
    init[13] = -3e38f;
    std::vector<std::unique_ptr<ShardAggregator>> shards;
    for (uint32_t s = 0; s < 2; ++s) {
      ShardOptions o;
      o.shard_id = s;
      o.num_shards = 2;
      o.n = 20;
      o.num_workers = 2;
      o.optimizer.density = 0.1;  // k = 2: indices 3 and 13
      o.optimizer.momentum_mode = momentum;
      o.step_timeout = absl::Seconds(5);
      auto shard = ShardAggregator::Create(o, &exchange, &commit);
      ASSERT_TRUE(shard.ok()) << shard.status();
      GTOPK_ASSERT_OK((*shard)->InitParams(absl::MakeSpan(init).subspan(
          (*shard)->begin(), (*shard)->end() - (*shard)->begin())));
      shards.push_back(*std::move(shard));
    }
    std::vector<std::vector<absl::StatusOr<std::shared_ptr<const RoundResult>>>>
        results(2);
    std::vector<std::thread> threads;
    for (uint32_t s = 0; s < 2; ++s) {
      threads.emplace_back([&, s] {
        const uint32_t index = s == 0 ? 3 : 13;
        results[s] = SubmitAll(*shards[s],
                               {PushOf(0, 0, MakeSparse({index}, {1.5e38f})),
                                PushOf(0, 1, MakeSparse({index}, {1.5e38f}))},
                               absl::Seconds(1));
      });
    }
    for (auto& t : threads) t.join();
    for (const auto& r : results[1]) {
      EXPECT_THAT(r,
                  StatusIs(absl::StatusCode::kFailedPrecondition,
                           AllOf(HasSubstr("step 0 failed on shard 1"),
                                 HasSubstr("params[13] would become -inf"))));
    }
    for (const auto& r : results[0]) EXPECT_FALSE(r.ok());
    for (uint32_t s = 0; s < 2; ++s) {
      EXPECT_EQ(shards[s]->next_step(), 0);
      auto state = shards[s]->GetState(absl::Now());
      GTOPK_ASSERT_OK(state);
      const size_t begin = shards[s]->begin();
      EXPECT_TRUE(BitEqual(
          state->params,
          absl::MakeSpan(init).subspan(begin, shards[s]->end() - begin)));
    }
  }
}

// --- Workers apply, the divergence alarm, buffers (issue 41) ---------------

// The plain reference of one workers-apply round: the sum of the pushes in
// rank order (a map of index -> value) and the k entries of largest |sum|,
// in index order. The inputs have no ties in |sum|.
SparseVector PlainSumTopK(const std::vector<SparseVector>& pushes, uint64_t k) {
  std::map<uint32_t, float> sum;
  for (const SparseVector& p : pushes) {
    for (size_t j = 0; j < p.size(); ++j) {
      auto [it, fresh] = sum.try_emplace(p.indices[j], p.values[j]);
      if (!fresh) it->second += p.values[j];
    }
  }
  std::vector<std::pair<uint32_t, float>> all(sum.begin(), sum.end());
  std::sort(all.begin(), all.end(), [](const auto& a, const auto& b) {
    return std::fabs(a.second) > std::fabs(b.second);
  });
  all.resize(std::min<size_t>(all.size(), k));
  std::sort(all.begin(), all.end());
  SparseVector out;
  for (const auto& [i, v] : all) out.push_back(i, v);
  return out;
}

// A cluster of S shards (threshold exchange, commit vote) in `apply` mode,
// every shard initialised from `init`.
struct VotedCluster {
  std::unique_ptr<ThresholdCoordinator> thresholds;
  std::unique_ptr<LocalThresholdExchange> exchange;
  std::unique_ptr<CommitCoordinator> commits;
  std::unique_ptr<LocalCommitVoter> commit;
  std::vector<std::unique_ptr<ShardAggregator>> shards;
};

VotedCluster MakeVotedCluster(ShardOptions base, uint32_t num_shards,
                              const std::vector<float>& init) {
  VotedCluster c;
  c.thresholds = std::make_unique<ThresholdCoordinator>(num_shards);
  c.exchange = std::make_unique<LocalThresholdExchange>(c.thresholds.get());
  c.commits = std::make_unique<CommitCoordinator>(num_shards);
  c.commit = std::make_unique<LocalCommitVoter>(c.commits.get());
  for (uint32_t s = 0; s < num_shards; ++s) {
    ShardOptions o = base;
    o.shard_id = s;
    o.num_shards = num_shards;
    auto shard = ::gtopk::testing::OkOrThrow(
        ShardAggregator::Create(o, c.exchange.get(), c.commit.get()),
        "ShardAggregator::Create");
    GTOPK_EXPECT_OK(shard->InitParams(std::vector<float>(
        init.begin() + shard->begin(), init.begin() + shard->end())));
    c.shards.push_back(std::move(shard));
  }
  return c;
}

// Every shard runs the round of `pushes[w]` (global indices, sliced per
// shard here; `checksums[w]` on every shard) concurrently; [s][w] results.
std::vector<std::vector<absl::StatusOr<std::shared_ptr<const RoundResult>>>>
RunRound(VotedCluster& c, int64_t step, const std::vector<SparseVector>& pushes,
         const std::vector<uint64_t>& checksums = {}) {
  std::vector<std::vector<absl::StatusOr<std::shared_ptr<const RoundResult>>>>
      out(c.shards.size());
  std::vector<std::thread> threads;
  for (size_t s = 0; s < c.shards.size(); ++s) {
    threads.emplace_back([&, s] {
      std::vector<WorkerPush> mine;
      for (uint32_t w = 0; w < pushes.size(); ++w) {
        WorkerPush p =
            PushOf(step, w,
                   Slice(pushes[w], c.shards[s]->begin(), c.shards[s]->end()));
        if (!checksums.empty()) p.params_checksum = checksums[w];
        mine.push_back(std::move(p));
      }
      out[s] = SubmitAll(*c.shards[s], std::move(mine), absl::Seconds(3));
    });
  }
  for (auto& t : threads) t.join();
  return out;
}

class WorkersApplyTest : public ::testing::TestWithParam<std::tuple<int, int>> {
};

// A completed round changes no parameter, advances the step, and every
// worker's pull is the sum of the global top-k, bit for bit the plain
// reference's.
TEST_P(WorkersApplyTest, RoundLeavesParamsAndPullsTheSumOfTheGlobalTopK) {
  const auto [workers, num_shards] = GetParam();
  const uint64_t n = 97;
  ShardOptions o;
  o.n = n;
  o.num_workers = workers;
  o.apply = ApplyMode::kWorkers;
  o.optimizer.density = 0.1;  // k = 9 (ceil)
  o.step_timeout = absl::Seconds(5);
  std::vector<float> init(n);
  for (uint64_t i = 0; i < n; ++i) init[i] = 0.25f * static_cast<float>(i) - 3;
  VotedCluster c = MakeVotedCluster(o, num_shards, init);
  auto rule = OptimizerRule::Create(o.optimizer);
  ASSERT_TRUE(rule.ok());
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> value(0.5f, 4.0f);
  for (int64_t step = 0; step < 3; ++step) {
    SCOPED_TRACE(step);
    std::vector<SparseVector> pushes(workers);
    for (int w = 0; w < workers; ++w) {
      for (uint32_t i = 0; i < n; ++i) {
        if ((i * 7 + w * 3 + step) % 5 < 2 && pushes[w].size() < 9) {
          pushes[w].push_back(i, (i % 2 ? 1 : -1) * value(rng));
        }
      }
    }
    const SparseVector want = PlainSumTopK(pushes, *rule->KAt(step, n));
    auto results = RunRound(c, step, pushes);
    for (int w = 0; w < workers; ++w) {
      SparseVector got;
      for (int s = 0; s < num_shards; ++s) {
        ASSERT_TRUE(results[s][w].ok()) << results[s][w].status();
        const SparseVector& part = (*results[s][w])->selected;
        for (size_t j = 0; j < part.size(); ++j) {
          got.push_back(part.indices[j], part.values[j]);
        }
      }
      EXPECT_EQ(got.indices, want.indices) << "worker " << w;
      EXPECT_TRUE(BitEqual(got.values, want.values)) << "worker " << w;
    }
    for (auto& shard : c.shards) {
      EXPECT_EQ(shard->next_step(), step + 1);
      auto state = shard->GetState(absl::Now());
      GTOPK_ASSERT_OK(state);
      EXPECT_TRUE(BitEqual(state->params,
                           absl::MakeSpan(init).subspan(
                               shard->begin(), shard->end() - shard->begin())));
    }
  }
}

INSTANTIATE_TEST_SUITE_P(PAndS, WorkersApplyTest,
                         ::testing::Combine(::testing::Values(2, 3),
                                            ::testing::Values(1, 2)));

TEST(WorkersApplyDenseTest, RoundLeavesParamsAndPullsTheDenseSum) {
  std::vector<float> init(20, 1.0f);
  ShardOptions o;
  o.n = 20;
  o.num_workers = 2;
  o.mode = AggregationMode::kDense;
  o.apply = ApplyMode::kWorkers;
  o.step_timeout = absl::Seconds(5);
  auto shard = ShardAggregator::Create(o, nullptr);
  ASSERT_TRUE(shard.ok()) << shard.status();
  GTOPK_ASSERT_OK((*shard)->InitParams(init));
  std::vector<WorkerPush> pushes(2);
  std::vector<float> want(20);
  for (uint32_t w = 0; w < 2; ++w) {
    pushes[w].worker = w;
    for (int i = 0; i < 20; ++i) {
      pushes[w].dense.push_back(0.5f * i - 2.0f * w);
    }
  }
  for (int i = 0; i < 20; ++i)
    want[i] = pushes[0].dense[i] + pushes[1].dense[i];
  auto results = SubmitAll(**shard, pushes);
  for (const auto& r : results) {
    GTOPK_ASSERT_OK(r);
    EXPECT_TRUE(BitEqual((*r)->dense_sum, want));
  }
  EXPECT_EQ((*shard)->next_step(), 1);
  EXPECT_TRUE(BitEqual((*shard)->GetState(absl::Now())->params, init));
}

// The divergence alarm, in both apply modes and on S = 1 and 2: on a
// checksum step (step % 2 == 0) differing checksums fail the step for every
// worker on every shard, naming them by rank, and nothing advances; equal
// ones pass; on other steps they are compared only when a worker sent one.
TEST(ChecksumTest, DifferingChecksumsFailTheStepForEveryWorkerOnEveryShard) {
  for (ApplyMode apply : {ApplyMode::kServers, ApplyMode::kWorkers}) {
    for (uint32_t num_shards : {1u, 2u}) {
      SCOPED_TRACE(absl::StrCat(ApplyModeName(apply), " S=", num_shards));
      ShardOptions o;
      o.n = 40;
      o.num_workers = 4;
      o.apply = apply;
      o.checksum_every = 2;
      o.optimizer.density = 0.1;
      o.optimizer.momentum_mode = MomentumMode::kNone;
      o.step_timeout = absl::Seconds(5);
      const std::vector<float> init(40, 1.0f);
      VotedCluster c = MakeVotedCluster(o, num_shards, init);
      std::vector<SparseVector> pushes(4);
      for (uint32_t w = 0; w < 4; ++w) {
        pushes[w] = MakeSparse({w, 20 + w}, {1.0f + w, -2.0f - w});
      }
      auto results = RunRound(c, 0, pushes, {0xaa, 0xbb, 0xaa, 0});
      for (uint32_t s = 0; s < num_shards; ++s) {
        for (const auto& r : results[s]) {
          EXPECT_THAT(
              r,
              StatusIs(
                  absl::StatusCode::kFailedPrecondition,
                  AllOf(HasSubstr(absl::StrCat("step 0 failed on shard ", s)),
                        HasSubstr("the replicas' parameters differ"),
                        HasSubstr("checksum 0x00000000000000aa on "
                                  "ranks 0, 2; 0x00000000000000bb on "
                                  "rank 1; none from rank 3"),
                        HasSubstr("load_state_dict"))));
        }
        EXPECT_EQ(c.shards[s]->next_step(), 0);
      }
      // All zero (nobody sent one) fails too.
      results = RunRound(c, 0, pushes, {0, 0, 0, 0});
      EXPECT_THAT(results[0][0],
                  StatusIs(absl::StatusCode::kFailedPrecondition,
                           HasSubstr("none from ranks 0, 1, 2, 3")));
      results = RunRound(c, 0, pushes, {7, 7, 7, 7});
      for (uint32_t s = 0; s < num_shards; ++s) {
        for (const auto& r : results[s]) GTOPK_EXPECT_OK(r);
        EXPECT_EQ(c.shards[s]->next_step(), 1);
      }
      // Step 1 is no checksum step: without checksums it passes ...
      results = RunRound(c, 1, pushes, {0, 0, 0, 0});
      for (uint32_t s = 0; s < num_shards; ++s) {
        for (const auto& r : results[s]) GTOPK_EXPECT_OK(r);
        EXPECT_EQ(c.shards[s]->next_step(), 2);
      }
      results = RunRound(c, 2, pushes, {4, 4, 4, 4});
      for (uint32_t s = 0; s < num_shards; ++s) {
        for (const auto& r : results[s]) GTOPK_EXPECT_OK(r);
        EXPECT_EQ(c.shards[s]->next_step(), 3);
      }
      // ... but checksums sent unasked (a worker's first step after a
      // resume or a renumbering rollback) are compared all the same: a
      // rank that sent none, or another value, fails it for everyone.
      results = RunRound(c, 3, pushes, {1, 2, 3, 0});
      for (uint32_t s = 0; s < num_shards; ++s) {
        for (const auto& r : results[s]) {
          EXPECT_THAT(r, StatusIs(absl::StatusCode::kFailedPrecondition,
                                  HasSubstr("none from rank 3")));
        }
      }
      // Unasked checksums that agree pass, also when some ranks sent none
      // (a rank back from a checkpoint of this very step lost nothing).
      results = RunRound(c, 3, pushes, {9, 0, 9, 0});
      for (uint32_t s = 0; s < num_shards; ++s) {
        for (const auto& r : results[s]) GTOPK_EXPECT_OK(r);
        EXPECT_EQ(c.shards[s]->next_step(), 4);
      }
    }
  }
}

std::unique_ptr<ShardAggregator> BufferShard(ApplyMode apply,
                                             uint32_t shard_id) {
  ShardOptions o;
  o.n = 20;
  o.num_workers = 2;
  o.apply = apply;
  o.shard_id = shard_id;
  o.num_shards = 2;
  o.selection = SelectionKind::kQuota;  // no exchange needed
  o.optimizer.density = 0.2;
  o.step_timeout = absl::Seconds(5);
  auto shard = ::gtopk::testing::OkOrThrow(ShardAggregator::Create(o, nullptr),
                                           "ShardAggregator::Create");
  GTOPK_EXPECT_OK(shard->InitParams(std::vector<float>(10, 1.0f)));
  return shard;
}

// Rank 0's buffers come back in every worker's result on shard 0 (and to a
// retried push of that step); buffers from rank 1, to shard 1, or under
// --apply=servers are a bad push: INVALID_ARGUMENT for the sender, the
// round failed (ABORTED) for the other worker, the step not applied.
TEST(BuffersTest, RankZeroBuffersReachEveryPullOfShardZero) {
  auto shard = BufferShard(ApplyMode::kWorkers, 0);
  WorkerPush p0 = PushOf(0, 0, MakeSparse({1}, {1.0f}));
  p0.buffers = std::string("bn\0stats", 8);
  auto results = SubmitAll(*shard, {p0, PushOf(0, 1, MakeSparse({2}, {2.0f}))});
  for (const auto& r : results) {
    GTOPK_ASSERT_OK(r);
    EXPECT_EQ((*r)->buffers, std::string("bn\0stats", 8));
  }
  auto retry = shard->Submit(PushOf(0, 1, MakeSparse({2}, {2.0f})),
                             absl::Now() + absl::Seconds(1));
  GTOPK_ASSERT_OK(retry);
  EXPECT_EQ((*retry)->buffers, std::string("bn\0stats", 8));
  // A step without buffers relays none.
  results = SubmitAll(*shard, {PushOf(1, 0, MakeSparse({1}, {1.0f})),
                               PushOf(1, 1, MakeSparse({2}, {2.0f}))});
  for (const auto& r : results) {
    GTOPK_ASSERT_OK(r);
    EXPECT_TRUE((*r)->buffers.empty());
  }
}

TEST(BuffersTest,
     BuffersFromAnotherRankToAnotherShardOrInServersModeAreRefused) {
  struct Case {
    ApplyMode apply;
    uint32_t shard, sender;
    const char* why;
  };
  for (const Case& c :
       {Case{ApplyMode::kWorkers, 0, 1, "come only from worker 0"},
        Case{ApplyMode::kWorkers, 1, 0, "to shard 1"},
        Case{ApplyMode::kServers, 0, 0, "only with --apply=workers"}}) {
    SCOPED_TRACE(c.why);
    auto shard = BufferShard(c.apply, c.shard);
    const uint32_t index = c.shard == 0 ? 1 : 11;
    std::vector<WorkerPush> pushes = {
        PushOf(0, 0, MakeSparse({index}, {1.0f})),
        PushOf(0, 1, MakeSparse({index + 1}, {2.0f}))};
    pushes[c.sender].buffers = "x";
    auto results = SubmitAll(*shard, pushes, absl::Milliseconds(500));
    EXPECT_THAT(results[c.sender],
                StatusIs(absl::StatusCode::kInvalidArgument,
                         AllOf(HasSubstr("buffers"), HasSubstr(c.why))));
    EXPECT_FALSE(results[1 - c.sender].ok());
    EXPECT_EQ(shard->next_step(), 0);
  }
}

// Workers apply: a rollback renumbers the step without a checkpoint
// (servers apply: only the current step without one).
TEST(WorkersApplyRollbackTest, AnyStepWithoutACheckpoint) {
  auto workers = BufferShard(ApplyMode::kWorkers, 0);
  GTOPK_ASSERT_OK(workers->Rollback(7, nullptr, absl::AbortedError("resume")));
  EXPECT_EQ(workers->next_step(), 7);
  GTOPK_ASSERT_OK(workers->Rollback(3, nullptr, absl::AbortedError("resume")));
  EXPECT_EQ(workers->next_step(), 3);
  EXPECT_THAT(workers->Rollback(-1, nullptr, absl::AbortedError("resume")),
              StatusIs(absl::StatusCode::kInvalidArgument));
  auto results = SubmitAll(*workers, {PushOf(3, 0, MakeSparse({1}, {1.0f})),
                                      PushOf(3, 1, MakeSparse({2}, {2.0f}))});
  for (const auto& r : results) GTOPK_EXPECT_OK(r);
  EXPECT_EQ(workers->next_step(), 4);
  auto servers = BufferShard(ApplyMode::kServers, 0);
  EXPECT_THAT(servers->Rollback(7, nullptr, absl::AbortedError("resume")),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("no checkpoint of step 7")));
  EXPECT_EQ(servers->next_step(), 0);
}

// The state blob is kept with the first initialisation only.
TEST(WorkersApplyStateTest, FirstInitialisationsStateWins) {
  ShardOptions o = SmallOptions(1);
  o.apply = ApplyMode::kWorkers;
  auto shard = ShardAggregator::Create(o, nullptr);
  ASSERT_TRUE(shard.ok());
  std::vector<float> init(100, 1.0f);
  GTOPK_ASSERT_OK_AND_ASSIGN(bool now, (*shard)->InitParams(init, "first"));
  EXPECT_TRUE(now);
  GTOPK_ASSERT_OK_AND_ASSIGN(now, (*shard)->InitParams(init, "second"));
  EXPECT_FALSE(now);
  auto state = (*shard)->GetState(absl::Now());
  GTOPK_ASSERT_OK(state);
  EXPECT_EQ(*state->state, "first");
}

}  // namespace
}  // namespace server
}  // namespace gtopk

namespace gtopk {
namespace server {
namespace {

// --selection=layerwise on one shard: each piece keeps the top PieceK of
// its part of the sum. Shard 1 of n = 1000 owns [500, 1000); buckets of 300
// cut it into [500, 600), [600, 900), [900, 1000); k = 20 gives them 2, 6
// and 2 entries (round(20 * size / 1000)).
TEST(LayerwiseShardTest, EachPieceKeepsItsOwnTopK) {
  ShardOptions o;
  o.n = 1000;
  o.num_shards = 2;
  o.shard_id = 1;
  o.num_workers = 2;
  o.selection = SelectionKind::kLayerwise;
  o.bucket_size = 300;
  o.apply = ApplyMode::kWorkers;
  // Workers apply: the identity rule, u = residual + g.
  o.optimizer.lr = 1.0f;
  o.optimizer.momentum = 0.0f;
  o.optimizer.momentum_mode = MomentumMode::kNone;
  o.optimizer.momentum_factor_masking = false;
  o.optimizer.density = 0.02;
  o.step_timeout = absl::Seconds(5);
  auto shard = ::gtopk::testing::OkOrThrow(ShardAggregator::Create(o, nullptr),
                                           "Create");
  GTOPK_ASSERT_OK(shard->InitParams(std::vector<float>(500, 0.0f)).status());
  // The bound on a push: the sum over the pieces of their k.
  EXPECT_EQ(shard->MaxPushPairs(0), 2u + 6u + 2u);
  // Worker 0 sends 2 + 6 + 2 entries, worker 1 some of the same indices
  // and others; the sum's top per piece by |value|, ties to the lower index.
  SparseVector a, b;
  for (uint32_t i : {510u, 520u}) a.push_back(i, 1.0f);
  for (uint32_t i : {600u, 610u, 620u, 630u, 640u, 650u}) {
    a.push_back(i, static_cast<float>(i - 590));  // 10 .. 60
  }
  for (uint32_t i : {901u, 902u}) a.push_back(i, -1.0f);
  b.push_back(520, 5.0f);
  b.push_back(530, 2.0f);
  for (uint32_t i : {600u, 700u, 710u, 720u, 730u, 740u}) {
    b.push_back(i, i == 600 ? 100.0f : -25.0f);
  }
  b.push_back(950, 3.0f);
  b.push_back(999, -0.5f);
  absl::StatusOr<std::shared_ptr<const RoundResult>> ra, rb;
  std::thread t0([&] {
    ra = shard->Submit(PushOf(0, 0, a), absl::Now() + absl::Seconds(5));
  });
  std::thread t1([&] {
    rb = shard->Submit(PushOf(0, 1, b), absl::Now() + absl::Seconds(5));
  });
  t0.join();
  t1.join();
  GTOPK_ASSERT_OK(ra.status());
  GTOPK_ASSERT_OK(rb.status());
  // Piece [500, 600): sums 510:1, 520:6, 530:2 -> 520, 530.
  // Piece [600, 900): 600:110, 610:20, 620:30, 630:40, 640:50, 650:60,
  // 700..740: -25 each -> 110, 60, 50, 40, 30 and one -25, the tie going
  // to the lowest index (700): 600, 620, 630, 640, 650, 700.
  // Piece [900, 1000): 901:-1, 902:-1, 950:3, 999:-0.5 -> 950, 901.
  const std::vector<uint32_t> want = {520, 530, 600, 620, 630,
                                      640, 650, 700, 901, 950};
  EXPECT_EQ((*ra)->selected.indices, want);
  EXPECT_EQ((*rb)->selected.indices, want);
}

}  // namespace
}  // namespace server
}  // namespace gtopk
