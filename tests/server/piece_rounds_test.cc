// Layer-wise rounds per (step, bucket piece) on the shard
// (ShardAggregator::SubmitPart / AwaitPieces, server/piece_rounds.h;
// docs/overlap.md "Rounds per bucket"): pushes in parts, in any order, give
// the same bits as a plain reference written here (per piece: the sum over
// the workers in rank order, its top k_p by |value|, ties to the lower
// index); a piece's round runs as soon as its P parts are in; a failure or
// an abandon in the middle of a step applies nothing and its retry
// completes; every bad part is refused and fails the step.
#include <algorithm>
#include <cmath>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/buckets.h"
#include "common/selector.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/shard_aggregator.h"
#include "tests/testing/reference.h"
#include "tests/testing/status_matchers.h"

namespace gtopk {
namespace server {
namespace {

using ::gtopk::testing::BitEqual;
using ::gtopk::testing::OkOrThrow;
using ::gtopk::testing::StatusIs;
using ::testing::HasSubstr;

// n = 1010 in buckets of 250: with two shards ([0, 505), [505, 1010)) the
// bucket [500, 750) straddles the boundary, and its piece [500, 505) and
// the last piece [1000, 1010) are too small for an entry at density 0.02
// (k = 21: round(21 * 5 / 1010) = round(21 * 10 / 1010) = 0).
constexpr uint64_t kN = 1010;
constexpr uint64_t kBucket = 250;
constexpr double kDensity = 0.02;

using Result = absl::StatusOr<std::shared_ptr<const RoundResult>>;

ShardOptions Options(uint32_t workers, uint32_t shards, uint32_t shard_id,
                     ApplyMode apply = ApplyMode::kWorkers) {
  ShardOptions o;
  o.n = kN;
  o.num_shards = shards;
  o.shard_id = shard_id;
  o.num_workers = workers;
  o.selection = SelectionKind::kLayerwise;
  o.bucket_size = kBucket;
  o.apply = apply;
  o.optimizer.lr = apply == ApplyMode::kWorkers ? 1.0f : 0.5f;
  o.optimizer.momentum = 0.0f;
  o.optimizer.momentum_mode = MomentumMode::kNone;
  o.optimizer.momentum_factor_masking = false;
  o.optimizer.density = kDensity;
  o.step_timeout = absl::Seconds(10);
  return o;
}

std::unique_ptr<ShardAggregator> MakeShard(const ShardOptions& o) {
  auto shard = OkOrThrow(ShardAggregator::Create(o, nullptr), "Create");
  std::vector<float> init(shard->end() - shard->begin());
  for (size_t i = 0; i < init.size(); ++i) init[i] = 0.25f * (i % 7);
  OkOrThrow(shard->InitParams(init), "InitParams");
  return shard;
}

uint64_t K() { return OkOrThrow(KFromDensity(kDensity, kN), "KFromDensity"); }

// Worker w's entries at `step` in shard `shard`'s range: per piece, k_p
// distinct random indices (the most a piece takes) among its first k_p + 2,
// so that the workers' indices mostly coincide, with random values of a
// scale per rank (1, 3, 0.1): another summation order than rank order
// gives other bits for about a third of the sums of three.
SparseVector Entries(const ShardAggregator& shard, int step, uint32_t w) {
  std::mt19937 rng(1000 * step + 17 * w + 3 * shard.options().shard_id + 1);
  std::normal_distribution<float> value(0.0f, 1.0f);
  const float scale[] = {1.0f, 3.0f, 0.1f};
  SparseVector out;
  for (const BucketPiece& p : shard.pieces()) {
    const uint64_t kp = PieceK(K(), p.size(), kN);
    std::vector<uint32_t> all(std::min<uint64_t>(p.size(), kp + 2));
    for (uint64_t i = 0; i < all.size(); ++i) {
      all[i] = static_cast<uint32_t>(p.begin + i);
    }
    std::shuffle(all.begin(), all.end(), rng);
    all.resize(kp);
    std::sort(all.begin(), all.end());
    for (uint32_t i : all) out.push_back(i, value(rng) * scale[w % 3]);
  }
  return out;
}

// The plain reference: per piece, the sum over workers in rank order (an
// index's first value, then + the next rank's), its top k_p by |value|,
// ties to the lower index; concatenated in index order.
SparseVector Reference(const ShardAggregator& shard,
                       const std::vector<SparseVector>& pushes) {
  SparseVector out;
  for (const BucketPiece& p : shard.pieces()) {
    std::vector<float> sum(p.size(), 0.0f);
    std::vector<bool> present(p.size(), false);
    for (const SparseVector& v : pushes) {
      for (size_t j = 0; j < v.size(); ++j) {
        if (v.indices[j] < p.begin || v.indices[j] >= p.end) continue;
        const size_t at = v.indices[j] - p.begin;
        sum[at] = present[at] ? sum[at] + v.values[j] : v.values[j];
        present[at] = true;
      }
    }
    std::vector<size_t> order;
    for (size_t i = 0; i < p.size(); ++i) {
      if (present[i]) order.push_back(i);
    }
    std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
      return std::fabs(sum[a]) > std::fabs(sum[b]);
    });
    order.resize(std::min<size_t>(order.size(), PieceK(K(), p.size(), kN)));
    std::sort(order.begin(), order.end());
    for (size_t i : order)
      out.push_back(static_cast<uint32_t>(p.begin + i), sum[i]);
  }
  return out;
}

// Worker w's part of pieces [b, e) of `v`.
WorkerPush Part(const ShardAggregator& shard, int64_t step, uint32_t w,
                const SparseVector& v, size_t b, size_t e, uint64_t epoch = 1) {
  WorkerPush p;
  p.step = step;
  p.worker = w;
  p.epoch = epoch;
  p.piece_begin = static_cast<uint32_t>(b);
  p.piece_end = static_cast<uint32_t>(e);
  const uint64_t lo = shard.pieces()[b].begin, hi = shard.pieces()[e - 1].end;
  for (size_t j = 0; j < v.size(); ++j) {
    if (v.indices[j] >= lo && v.indices[j] < hi) {
      p.sparse.push_back(v.indices[j], v.values[j]);
    }
  }
  return p;
}

WorkerPush Whole(int64_t step, uint32_t w, SparseVector v, uint64_t epoch = 1) {
  WorkerPush p;
  p.step = step;
  p.worker = w;
  p.epoch = epoch;
  p.sparse = std::move(v);
  return p;
}

enum class Order { kForward, kReverse, kShuffled, kMixed };

// The runs of pieces worker w sends, in the order it sends them: forward
// in runs of two, reverse one by one, shuffled one by one; kMixed: rank 0
// sends its whole push in one message, the others shuffled parts.
std::vector<std::pair<size_t, size_t>> Runs(size_t m, Order order, uint32_t w,
                                            int step) {
  std::vector<std::pair<size_t, size_t>> runs;
  if (order == Order::kForward) {
    for (size_t i = 0; i < m; i += 2) runs.push_back({i, std::min(m, i + 2)});
    return runs;
  }
  for (size_t i = 0; i < m; ++i) runs.push_back({i, i + 1});
  if (order == Order::kReverse) {
    std::reverse(runs.begin(), runs.end());
  } else {
    std::mt19937 rng(99 + 7 * w + step);
    std::shuffle(runs.begin(), runs.end(), rng);
  }
  return runs;
}

using Param = std::tuple<int, int, Order>;

class PieceRoundsTest : public ::testing::TestWithParam<Param> {};

// P workers push two steps to S shards in parts (one thread per worker and
// shard, as the client's), each piece once, in the order the parameter
// says; every result is the reference's, bit for bit, and every piece's
// round (AwaitPieces) is its part of the result.
TEST_P(PieceRoundsTest, PartsMatchThePlainReferenceBitForBit) {
  const auto [workers, shards, order] = GetParam();
  const uint32_t P = static_cast<uint32_t>(workers);
  std::vector<std::unique_ptr<ShardAggregator>> shard;
  for (uint32_t s = 0; s < static_cast<uint32_t>(shards); ++s) {
    shard.push_back(MakeShard(Options(P, shards, s)));
  }
  for (int step = 0; step < 2; ++step) {
    for (auto& sh : shard) {
      std::vector<SparseVector> pushes;
      for (uint32_t w = 0; w < P; ++w) pushes.push_back(Entries(*sh, step, w));
      const SparseVector want = Reference(*sh, pushes);
      std::vector<Result> results(P);
      std::vector<ShardAggregator::RoundTicket> tickets(P);
      std::vector<std::thread> threads;
      for (uint32_t w = 0; w < P; ++w) {
        threads.emplace_back([&, w] {
          const absl::Time deadline = absl::Now() + absl::Seconds(10);
          if (order == Order::kMixed && w == 0) {
            results[w] = sh->SubmitPart(Whole(step, w, pushes[w]), deadline,
                                        &tickets[w]);
            return;
          }
          for (const auto& [b, e] : Runs(sh->pieces().size(), order, w, step)) {
            results[w] = sh->SubmitPart(Part(*sh, step, w, pushes[w], b, e),
                                        deadline, &tickets[w]);
            if (!results[w].ok()) return;
          }
        });
      }
      for (auto& t : threads) t.join();
      for (uint32_t w = 0; w < P; ++w) {
        GTOPK_ASSERT_OK(results[w].status());
        ASSERT_NE(*results[w], nullptr) << "worker " << w;
        EXPECT_EQ((*results[w])->selected.indices, want.indices);
        EXPECT_TRUE(BitEqual((*results[w])->selected.values, want.values));
      }
      // The piece rounds, as the piece pulls send them.
      ShardAggregator::PiecesSent sent;
      auto done =
          sh->AwaitPieces(tickets[P - 1], &sent, absl::Now() + absl::Seconds(5),
                          absl::Now() + absl::Seconds(5));
      GTOPK_ASSERT_OK(done.status());
      ASSERT_EQ(done->size(), sh->pieces().size());
      SparseVector joined;
      for (const auto& [i, r] : *done) {
        for (size_t j = 0; j < r->selected.size(); ++j) {
          joined.push_back(r->selected.indices[j], r->selected.values[j]);
        }
      }
      EXPECT_EQ(joined.indices, want.indices);
      EXPECT_TRUE(BitEqual(joined.values, want.values));
      EXPECT_EQ(sh->next_step(), step + 1);
    }
  }
}

std::string ParamName(const ::testing::TestParamInfo<Param>& info) {
  const char* names[] = {"forward", "reverse", "shuffled", "mixed"};
  return absl::StrCat("P", std::get<0>(info.param), "_S",
                      std::get<1>(info.param), "_",
                      names[static_cast<int>(std::get<2>(info.param))]);
}

INSTANTIATE_TEST_SUITE_P(
    All, PieceRoundsTest,
    ::testing::Combine(::testing::Values(1, 2, 3), ::testing::Values(1, 2),
                       ::testing::Values(Order::kForward, Order::kReverse,
                                         Order::kShuffled, Order::kMixed)),
    ParamName);

// A piece's round runs as soon as its P parts are in, while the other
// pieces have not arrived: AwaitPieces hands it out (the piece pull) before
// any worker's push is complete.
TEST(PieceRoundsTimingTest, APieceIsDoneBeforeTheOtherPiecesArrive) {
  auto shard = MakeShard(Options(2, 1, 0));
  const size_t m = shard->pieces().size();
  ASSERT_GE(m, 3u);
  const std::vector<SparseVector> pushes = {Entries(*shard, 0, 0),
                                            Entries(*shard, 0, 1)};
  const SparseVector want = Reference(*shard, pushes);
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  std::vector<ShardAggregator::RoundTicket> tickets(2);
  for (uint32_t w = 0; w < 2; ++w) {
    Result r = shard->SubmitPart(Part(*shard, 0, w, pushes[w], 1, 2), deadline,
                                 &tickets[w]);
    GTOPK_ASSERT_OK(r.status());
    EXPECT_EQ(*r, nullptr);  // more parts to come
  }
  ShardAggregator::PiecesSent sent;
  auto done = shard->AwaitPieces(tickets[0], &sent, deadline,
                                 absl::Now() + absl::Seconds(5));
  GTOPK_ASSERT_OK(done.status());
  ASSERT_EQ(done->size(), 1u);
  EXPECT_EQ((*done)[0].first, 1u);
  const BucketPiece& p = shard->pieces()[1];
  SparseVector want1;
  for (size_t j = 0; j < want.size(); ++j) {
    if (want.indices[j] >= p.begin && want.indices[j] < p.end) {
      want1.push_back(want.indices[j], want.values[j]);
    }
  }
  EXPECT_EQ((*done)[0].second->selected.indices, want1.indices);
  EXPECT_TRUE(BitEqual((*done)[0].second->selected.values, want1.values));
  // Nothing else is done: the next wait returns nothing by its wake time.
  done = shard->AwaitPieces(tickets[0], &sent, deadline,
                            absl::Now() + absl::Milliseconds(20));
  GTOPK_ASSERT_OK(done.status());
  EXPECT_TRUE(done->empty());
  EXPECT_EQ(shard->next_step(), 0);
  // The rest, in reverse; the step completes with the reference's bits.
  std::vector<Result> results(2);
  std::vector<std::thread> threads;
  for (uint32_t w = 0; w < 2; ++w) {
    threads.emplace_back([&, w] {
      for (size_t i = m; i-- > 0;) {
        if (i == 1) continue;
        results[w] = shard->SubmitPart(Part(*shard, 0, w, pushes[w], i, i + 1),
                                       deadline, &tickets[w]);
      }
    });
  }
  for (auto& t : threads) t.join();
  for (const Result& r : results) {
    GTOPK_ASSERT_OK(r.status());
    EXPECT_EQ((*r)->selected.indices, want.indices);
  }
  EXPECT_EQ(shard->next_step(), 1);
}

// Parameters of `shard` (a copy).
std::vector<float> ParamsOf(const ShardAggregator& shard) {
  return OkOrThrow(shard.Params(absl::Now() + absl::Seconds(1)), "Params")
      .first;
}

// Both workers push every piece of step 0 one by one (worker 1 in
// reverse), each from its own thread; their results.
std::vector<Result> RunStep(ShardAggregator& shard,
                            const std::vector<SparseVector>& pushes,
                            std::vector<ShardAggregator::RoundTicket>& tickets,
                            uint64_t epoch) {
  std::vector<Result> results(pushes.size());
  std::vector<std::thread> threads;
  const size_t m = shard.pieces().size();
  for (uint32_t w = 0; w < pushes.size(); ++w) {
    threads.emplace_back([&, w] {
      for (size_t j = 0; j < m; ++j) {
        const size_t i = w == 1 ? m - 1 - j : j;
        results[w] =
            shard.SubmitPart(Part(shard, 0, w, pushes[w], i, i + 1, epoch),
                             absl::Now() + absl::Seconds(10), &tickets[w]);
        if (!results[w].ok()) return;
      }
    });
  }
  for (auto& t : threads) t.join();
  return results;
}

// How a failure test starts: step 0's entries of both workers, a deadline,
// and each worker's part holding piece 0 submitted (its ticket).
struct FirstPiecesIn {
  std::vector<SparseVector> pushes;
  absl::Time deadline;
  std::vector<ShardAggregator::RoundTicket> tickets;
};
void SubmitFirstPieces(ShardAggregator& shard, FirstPiecesIn* in) {
  in->pushes = {Entries(shard, 0, 0), Entries(shard, 0, 1)};
  in->deadline = absl::Now() + absl::Seconds(10);
  in->tickets.assign(2, ShardAggregator::RoundTicket());
  for (uint32_t w = 0; w < 2; ++w) {
    GTOPK_ASSERT_OK(shard
                        .SubmitPart(Part(shard, 0, w, in->pushes[w], 0, 1),
                                    in->deadline, &in->tickets[w])
                        .status());
  }
}

// A failure in the middle of a step's buckets, after a piece's round was
// done (its pull could have gone out): worker 1 sends piece 0 twice. The
// step fails on the shard for both workers (worker 0's next part gets the
// failure), nothing is applied, and the retry (a newer attempt epoch, the
// same tickets, as after Recover) completes with the bits of a shard that
// never saw the failure (servers apply: the parameters too).
TEST(PieceRoundsFailureTest, ABadPartAfterAPieceRoundAppliesNothing) {
  const ShardOptions o = Options(2, 2, 1, ApplyMode::kServers);
  auto shard = MakeShard(o);
  auto clean = MakeShard(o);
  const std::vector<float> before = ParamsOf(*shard);
  FirstPiecesIn in;
  ASSERT_NO_FATAL_FAILURE(SubmitFirstPieces(*shard, &in));
  auto& [pushes, deadline, tickets] = in;
  ShardAggregator::PiecesSent sent;
  auto done = shard->AwaitPieces(tickets[0], &sent, deadline,
                                 absl::Now() + absl::Seconds(5));
  GTOPK_ASSERT_OK(done.status());
  ASSERT_EQ(done->size(), 1u);  // piece 0's round is done
  EXPECT_THAT(shard->SubmitPart(Part(*shard, 0, 1, pushes[1], 0, 1), deadline,
                                &tickets[1]),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("sent twice by worker 1")));
  EXPECT_THAT(shard->SubmitPart(Part(*shard, 0, 0, pushes[0], 1, 2), deadline,
                                &tickets[0]),
              StatusIs(absl::StatusCode::kAborted,
                       HasSubstr("sent twice by worker 1")));
  // The piece pulls' writer hears it too.
  EXPECT_THAT(shard->AwaitPieces(tickets[0], &sent, deadline, deadline),
              StatusIs(absl::StatusCode::kAborted));
  EXPECT_EQ(shard->next_step(), 0);
  EXPECT_TRUE(BitEqual(ParamsOf(*shard), before));

  std::vector<ShardAggregator::RoundTicket> fresh(2);
  const std::vector<Result> retry = RunStep(*shard, pushes, tickets, 2);
  const std::vector<Result> plain = RunStep(*clean, pushes, fresh, 1);
  for (uint32_t w = 0; w < 2; ++w) {
    GTOPK_ASSERT_OK(retry[w].status());
    GTOPK_ASSERT_OK(plain[w].status());
    EXPECT_EQ((*retry[w])->selected.indices, (*plain[w])->selected.indices);
    EXPECT_TRUE(
        BitEqual((*retry[w])->selected.values, (*plain[w])->selected.values));
  }
  EXPECT_EQ(shard->next_step(), 1);
  EXPECT_TRUE(BitEqual(ParamsOf(*shard), ParamsOf(*clean)));
  EXPECT_FALSE(BitEqual(ParamsOf(*shard), before));
}

// A worker gives the step up in the middle of its buckets (Push.abandon):
// the round fails for the other worker, whose parts were in, nothing is
// applied, and the retry completes.
TEST(PieceRoundsFailureTest, AnAbandonMidStepAppliesNothing) {
  auto shard = MakeShard(Options(2, 1, 0, ApplyMode::kServers));
  const std::vector<float> before = ParamsOf(*shard);
  FirstPiecesIn in;
  ASSERT_NO_FATAL_FAILURE(SubmitFirstPieces(*shard, &in));
  auto& [pushes, deadline, tickets] = in;
  GTOPK_ASSERT_OK(shard
                      ->SubmitPart(Part(*shard, 0, 1, pushes[1], 1, 2),
                                   deadline, &tickets[1])
                      .status());
  EXPECT_TRUE(
      shard->AbandonPush(0, 0, 1, absl::CancelledError("worker 0 abandoned")));
  EXPECT_THAT(
      shard->SubmitPart(Part(*shard, 0, 1, pushes[1], 2, 3), deadline,
                        &tickets[1]),
      StatusIs(absl::StatusCode::kAborted, HasSubstr("worker 0 abandoned")));
  EXPECT_EQ(shard->next_step(), 0);
  EXPECT_TRUE(BitEqual(ParamsOf(*shard), before));
  const std::vector<Result> retry = RunStep(*shard, pushes, tickets, 2);
  for (const Result& r : retry) GTOPK_ASSERT_OK(r.status());
  EXPECT_EQ(shard->next_step(), 1);
}

// Both workers' whole pushes of step 0 (`pushes`, attempt `epoch`), each
// from its own thread; their results. `before(w)` runs in worker w's
// thread first.
std::vector<Result> RunWholes(ShardAggregator& shard,
                              const std::vector<SparseVector>& pushes,
                              uint64_t epoch,
                              const std::function<void(uint32_t)>& before) {
  std::vector<Result> results(pushes.size());
  std::vector<std::thread> threads;
  for (uint32_t w = 0; w < pushes.size(); ++w) {
    threads.emplace_back([&, w] {
      before(w);
      results[w] = shard.SubmitPart(Whole(0, w, pushes[w], epoch),
                                    absl::Now() + absl::Seconds(10), nullptr);
    });
  }
  for (auto& t : threads) t.join();
  return results;
}

// Every result ok and bit-identical to a clean shard's round of the same
// whole pushes (attempt 1).
void ExpectAsCleanWholes(const ShardOptions& o,
                         const std::vector<SparseVector>& pushes,
                         const std::vector<Result>& got) {
  auto clean = MakeShard(o);
  const std::vector<Result> want =
      RunWholes(*clean, pushes, 1, [](uint32_t) {});
  for (uint32_t w = 0; w < got.size(); ++w) {
    GTOPK_ASSERT_OK(got[w].status());
    GTOPK_ASSERT_OK(want[w].status());
    EXPECT_EQ((*got[w])->selected.indices, (*want[w])->selected.indices);
    EXPECT_TRUE(
        BitEqual((*got[w])->selected.values, (*want[w])->selected.values));
  }
}

// Waits until `count` pieces of `ticket`'s round are done (what a piece
// pulls' writer sees), or the round failed: that status.
absl::Status AwaitDone(ShardAggregator& shard,
                       const ShardAggregator::RoundTicket& ticket,
                       size_t count) {
  ShardAggregator::PiecesSent sent;
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  size_t done = 0;
  while (done < count) {
    auto d = shard.AwaitPieces(ticket, &sent, deadline,
                               absl::Now() + absl::Milliseconds(20));
    if (!d.ok()) return d.status();
    done += d->size();
    if (absl::Now() > deadline) return absl::DeadlineExceededError("waiting");
  }
  return absl::OkStatus();
}

// Worker 1's parts of pieces [1, m) of step 0 (nothing is done: worker 0
// has none of them), then worker 0's whole push from a thread: once
// pieces [1, m) are done its push is in. Returns that thread.
std::thread Worker0WholeAfterWorker1sLastParts(
    ShardAggregator& shard, const std::vector<SparseVector>& pushes,
    ShardAggregator::RoundTicket* ticket1, Result* r0) {
  const size_t m = shard.pieces().size();
  GTOPK_EXPECT_OK(shard
                      .SubmitPart(Part(shard, 0, 1, pushes[1], 1, m),
                                  absl::Now() + absl::Seconds(10), ticket1)
                      .status());
  std::thread t0([&shard, &pushes, r0] {
    *r0 = shard.SubmitPart(Whole(0, 0, pushes[0]),
                           absl::Now() + absl::Seconds(10), nullptr);
  });
  GTOPK_EXPECT_OK(AwaitDone(shard, *ticket1, m - 1));
  return t0;
}

// A worker's retry is a whole push; a shard that missed the step's failure
// (stalled while the leader numbered it) still holds the failed attempt's
// parts, of the same attempt epoch (issue 45's break-it run: a stalled
// shard then refused the retry as "piece 0 was sent twice" and the run
// died). The whole push replaces the worker's parts when none of its
// pieces started, and the round ends as a clean shard's.
TEST(PieceRoundsRetryTest, AWholeRetryReplacesTheSameAttemptsParts) {
  const ShardOptions o = Options(2, 2, 1);
  auto shard = MakeShard(o);
  const std::vector<SparseVector> pushes = {Entries(*shard, 0, 0),
                                            Entries(*shard, 0, 1)};
  ShardAggregator::RoundTicket ticket0, ticket1;
  GTOPK_ASSERT_OK(shard
                      ->SubmitPart(Part(*shard, 0, 0, pushes[0], 0, 1),
                                   absl::Now() + absl::Seconds(10), &ticket0)
                      .status());
  std::vector<Result> got(2);
  std::thread t0 =
      Worker0WholeAfterWorker1sLastParts(*shard, pushes, &ticket1, &got[0]);
  got[1] = shard->SubmitPart(Part(*shard, 0, 1, pushes[1], 0, 1),
                             absl::Now() + absl::Seconds(10), &ticket1);
  t0.join();
  ExpectAsCleanWholes(o, pushes, got);
  EXPECT_EQ(shard->next_step(), 1);
}

// When some of its pieces' rounds ran already, the round fails for
// everyone (ABORTED: the other worker's next part gets it) and the
// retries complete a fresh round, as a clean shard's.
TEST(PieceRoundsRetryTest, AWholeRetryAfterStartedPiecesOpensAFreshRound) {
  const ShardOptions o = Options(2, 2, 1);
  auto shard = MakeShard(o);
  FirstPiecesIn in;
  ASSERT_NO_FATAL_FAILURE(SubmitFirstPieces(*shard, &in));
  std::vector<Result> got(2);
  std::thread t0([&] {
    got[0] = shard->SubmitPart(Whole(0, 0, in.pushes[0]), in.deadline, nullptr);
  });
  EXPECT_THAT(AwaitDone(*shard, in.tickets[1], shard->pieces().size()),
              StatusIs(absl::StatusCode::kAborted,
                       HasSubstr("retries the step whole")));
  EXPECT_THAT(shard->SubmitPart(Part(*shard, 0, 1, in.pushes[1], 1, 2),
                                in.deadline, &in.tickets[1]),
              StatusIs(absl::StatusCode::kAborted,
                       HasSubstr("retries the step whole")));
  got[1] = shard->SubmitPart(Whole(0, 1, in.pushes[1]), in.deadline, nullptr);
  t0.join();
  ExpectAsCleanWholes(o, in.pushes, got);
  EXPECT_EQ(shard->next_step(), 1);
}

// A leftover part of the failed attempt read after the worker's whole
// retry (same epoch), or a part of an older attempt than the worker's
// parts in the round: refused alone (ABORTED), and the round goes on to
// the result of a shard that never saw it.
TEST(PieceRoundsRetryTest, ALeftoverOfAFailedAttemptIsRefusedAlone) {
  const ShardOptions o = Options(2, 2, 1);
  for (const bool older : {false, true}) {
    SCOPED_TRACE(older ? "older epoch" : "after the whole push");
    auto shard = MakeShard(o);
    const std::vector<SparseVector> pushes = {Entries(*shard, 0, 0),
                                              Entries(*shard, 0, 1)};
    const absl::Time deadline = absl::Now() + absl::Seconds(10);
    if (older) {
      std::vector<ShardAggregator::RoundTicket> tickets(2);
      GTOPK_ASSERT_OK(shard
                          ->SubmitPart(Part(*shard, 0, 0, pushes[0], 0, 1, 4),
                                       deadline, &tickets[0])
                          .status());
      EXPECT_THAT(shard->SubmitPart(Part(*shard, 0, 0, pushes[0], 1, 2, 3),
                                    deadline, nullptr),
                  StatusIs(absl::StatusCode::kAborted,
                           HasSubstr("a leftover of a failed attempt")));
      std::vector<Result> got(2);
      std::thread t1([&] {
        for (size_t i = 0; i < shard->pieces().size(); ++i) {
          got[1] = shard->SubmitPart(Part(*shard, 0, 1, pushes[1], i, i + 1, 4),
                                     deadline, &tickets[1]);
        }
      });
      for (size_t i = 1; i < shard->pieces().size(); ++i) {
        got[0] = shard->SubmitPart(Part(*shard, 0, 0, pushes[0], i, i + 1, 4),
                                   deadline, &tickets[0]);
      }
      t1.join();
      ExpectAsCleanWholes(o, pushes, got);
      continue;
    }
    std::vector<Result> got(2);
    ShardAggregator::RoundTicket ticket1;
    std::thread t0 =
        Worker0WholeAfterWorker1sLastParts(*shard, pushes, &ticket1, &got[0]);
    EXPECT_THAT(shard->SubmitPart(Part(*shard, 0, 0, pushes[0], 1, 2), deadline,
                                  nullptr),
                StatusIs(absl::StatusCode::kAborted,
                         HasSubstr("a leftover of a failed attempt")));
    got[1] = shard->SubmitPart(Part(*shard, 0, 1, pushes[1], 0, 1), deadline,
                               &ticket1);
    t0.join();
    ExpectAsCleanWholes(o, pushes, got);
  }
}

// One bad part (after a good part of the other worker) and what it gets.
struct Refusal {
  std::string name;
  absl::StatusCode code;
  std::string message;
  // Worker 0's parts; the last one is refused.
  std::function<std::vector<WorkerPush>(const ShardAggregator&,
                                        const SparseVector&)>
      parts;
};

class PieceRefusalTest : public ::testing::TestWithParam<int> {};

std::vector<Refusal> Refusals() {
  using V = std::vector<WorkerPush>;
  return {
      {"EmptyRun", absl::StatusCode::kInvalidArgument, "is empty or outside",
       [](const ShardAggregator& s, const SparseVector& v) {
         WorkerPush p = Part(s, 0, 0, v, 1, 2);
         p.piece_begin = 2;
         p.piece_end = 2;
         return V{p};
       }},
      {"BeginWithoutEnd", absl::StatusCode::kInvalidArgument,
       "is empty or outside",
       [](const ShardAggregator& s, const SparseVector& v) {
         WorkerPush p = Part(s, 0, 0, v, 1, 2);
         p.piece_end = 0;
         p.sparse.clear();
         return V{p};
       }},
      {"OutOfRange", absl::StatusCode::kInvalidArgument, "is empty or outside",
       [](const ShardAggregator& s, const SparseVector& v) {
         const size_t m = s.pieces().size();
         WorkerPush p = Part(s, 0, 0, v, m - 1, m);
         p.piece_end = static_cast<uint32_t>(m + 1);
         return V{p};
       }},
      {"Duplicate", absl::StatusCode::kInvalidArgument, "sent twice",
       [](const ShardAggregator& s, const SparseVector& v) {
         return V{Part(s, 0, 0, v, 0, 1), Part(s, 0, 0, v, 0, 1)};
       }},
      {"Overlap", absl::StatusCode::kInvalidArgument, "piece 1 [",
       [](const ShardAggregator& s, const SparseVector& v) {
         return V{Part(s, 0, 0, v, 0, 2), Part(s, 0, 0, v, 1, 3)};
       }},
      {"EntryOutsideItsPieces", absl::StatusCode::kInvalidArgument,
       "outside the part's pieces [0, 1)",
       [](const ShardAggregator& s, const SparseVector& v) {
         WorkerPush p = Part(s, 0, 0, v, 0, 1);
         p.sparse.push_back(static_cast<uint32_t>(s.pieces()[1].begin), 1.0f);
         return V{p};
       }},
      {"ChecksumDiffers", absl::StatusCode::kInvalidArgument, "params_checksum",
       [](const ShardAggregator& s, const SparseVector& v) {
         WorkerPush a = Part(s, 0, 0, v, 0, 1), b = Part(s, 0, 0, v, 1, 2);
         a.params_checksum = 5;
         b.params_checksum = 6;
         return V{a, b};
       }},
      {"BuffersWithoutPiece0", absl::StatusCode::kInvalidArgument,
       "only in the part holding piece 0",
       [](const ShardAggregator& s, const SparseVector& v) {
         WorkerPush p = Part(s, 0, 0, v, 1, 2);
         p.buffers = "bn";
         return V{p};
       }},
      {"TooManyPairsInAPiece", absl::StatusCode::kResourceExhausted,
       "its k at this step allows at most",
       [](const ShardAggregator& s, const SparseVector& v) {
         WorkerPush p = Part(s, 0, 0, v, 0, 1);
         p.sparse.clear();
         for (uint32_t i = 0; i < 40; ++i) p.sparse.push_back(i, 1.0f);
         return V{p};
       }},
  };
}

// Every bad part is refused naming what was wrong, fails the step for the
// other worker (its next part gets ABORTED), and nothing is applied.
TEST_P(PieceRefusalTest, IsRefusedAndFailsTheStep) {
  const Refusal r = Refusals()[GetParam()];
  auto shard = MakeShard(Options(2, 2, 0));
  const std::vector<SparseVector> pushes = {Entries(*shard, 0, 0),
                                            Entries(*shard, 0, 1)};
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  std::vector<ShardAggregator::RoundTicket> tickets(2);
  GTOPK_ASSERT_OK(shard
                      ->SubmitPart(Part(*shard, 0, 1, pushes[1], 0, 1),
                                   deadline, &tickets[1])
                      .status());
  const std::vector<WorkerPush> parts = r.parts(*shard, pushes[0]);
  for (size_t i = 0; i + 1 < parts.size(); ++i) {
    GTOPK_ASSERT_OK(
        shard->SubmitPart(parts[i], deadline, &tickets[0]).status());
  }
  EXPECT_THAT(shard->SubmitPart(parts.back(), deadline, &tickets[0]),
              StatusIs(r.code, HasSubstr(r.message)))
      << r.name;
  EXPECT_THAT(shard->SubmitPart(Part(*shard, 0, 1, pushes[1], 1, 2), deadline,
                                &tickets[1]),
              StatusIs(absl::StatusCode::kAborted, HasSubstr(r.message)))
      << r.name;
  EXPECT_EQ(shard->next_step(), 0);
}

INSTANTIATE_TEST_SUITE_P(All, PieceRefusalTest,
                         ::testing::Range(0,
                                          static_cast<int>(Refusals().size())),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return Refusals()[info.param].name;
                         });

// A part to a cluster that is not layer-wise is refused naming why; whole
// pushes there are served as before.
TEST(PieceRefusalTest2, APartOutsideALayerwiseClusterIsRefused) {
  ShardOptions o = Options(2, 1, 0);
  o.selection = SelectionKind::kThreshold;
  o.bucket_size = 0;
  auto shard = MakeShard(o);
  ASSERT_TRUE(shard->pieces().empty());
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  WorkerPush part = Whole(0, 0, SparseVector());
  part.piece_end = 1;
  ShardAggregator::RoundTicket ticket;
  EXPECT_THAT(shard->SubmitPart(part, deadline, &ticket),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("does not run --selection=layerwise")));
  EXPECT_EQ(shard->next_step(), 0);
  Result a, b;
  std::thread t(
      [&] { a = shard->Submit(Whole(0, 1, SparseVector()), deadline); });
  b = shard->Submit(Whole(0, 0, SparseVector()), deadline);
  t.join();
  GTOPK_ASSERT_OK(a.status());
  GTOPK_ASSERT_OK(b.status());
  EXPECT_EQ(shard->next_step(), 1);
}

// The most pieces a cluster may have (kMaxBucketPieces: n = 2^17 in
// buckets of 2, one shard, P = 2, density 0.5, so k_p = 1), every piece
// its own part from each worker, and the piece pulls' writer reading after
// each piece's round. Each part used to go over every piece of the shard
// (the push bound, MaxPushPairs, asked for every part): 2^17 parts x 2^16
// pieces took 24.6 s on the 2-core development machine (-O1), now 0.16 s
// (timed by bench/piece_count_bench, not here). Each piece's result is the
// larger of its two entries (the plain reference).
TEST(PieceRoundsScaleTest, TheMostPiecesOnePartEachCostLinearTime) {
  ShardOptions o = Options(2, 1, 0);
  o.n = 2 * kMaxBucketPieces;
  o.bucket_size = 2;
  o.optimizer.density = 0.5;
  o.step_timeout = absl::Seconds(300);
  auto shard = MakeShard(o);
  const size_t m = shard->pieces().size();
  ASSERT_EQ(m, kMaxBucketPieces);
  // Worker w's entry of piece i: index 2i + w, value (w + 1) * (i % 7 - 3).
  auto value = [](uint32_t w, size_t i) {
    return static_cast<float>(w + 1) * static_cast<float>(int(i % 7) - 3);
  };
  const absl::Time deadline = absl::Now() + absl::Seconds(300);
  std::vector<Result> results(2);
  std::vector<ShardAggregator::RoundTicket> tickets(2);
  std::vector<std::thread> threads;
  for (uint32_t w = 0; w < 2; ++w) {
    threads.emplace_back([&, w] {
      for (size_t i = 0; i < m; ++i) {
        WorkerPush part;
        part.step = 0;
        part.worker = w;
        part.epoch = 1;
        part.piece_begin = static_cast<uint32_t>(i);
        part.piece_end = static_cast<uint32_t>(i + 1);
        part.sparse.push_back(static_cast<uint32_t>(2 * i + w), value(w, i));
        results[w] = shard->SubmitPart(std::move(part), deadline, &tickets[w]);
        if (!results[w].ok()) return;
      }
    });
  }
  // The piece pulls' writer of worker 0's stream, once its first part is
  // in (its ticket set).
  size_t handed_out = 0;
  absl::Status reader = absl::OkStatus();
  std::thread writer([&] {
    ShardAggregator::PiecesSent sent;
    while (!sent.all(m)) {
      auto done = shard->AwaitPieces(tickets[0], &sent, deadline,
                                     absl::Now() + absl::Milliseconds(1));
      if (absl::IsFailedPrecondition(done.status())) continue;  // no round yet
      if (!done.ok()) {
        reader = done.status();
        return;
      }
      handed_out += done->size();
      if (absl::Now() > deadline) return;
    }
  });
  for (auto& t : threads) t.join();
  writer.join();
  GTOPK_ASSERT_OK(reader);
  EXPECT_EQ(handed_out, m);
  for (uint32_t w = 0; w < 2; ++w) {
    GTOPK_ASSERT_OK(results[w].status());
    ASSERT_NE(*results[w], nullptr);
    const SparseVector& got = (*results[w])->selected;
    ASSERT_EQ(got.size(), m);
    for (size_t i = 0; i < m; ++i) {
      // Ties (i % 7 == 3: both 0) to the lower index, worker 0's.
      const uint32_t wins =
          std::fabs(value(1, i)) > std::fabs(value(0, i)) ? 1 : 0;
      ASSERT_EQ(got.indices[i], 2 * i + wins) << "piece " << i;
      ASSERT_EQ(got.values[i], value(wins, i)) << "piece " << i;
    }
  }
}

}  // namespace
}  // namespace server
}  // namespace gtopk
