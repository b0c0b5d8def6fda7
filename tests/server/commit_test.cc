// server/commit.h: the leader's cross-shard commit vote, against its
// documented contract (every error code of Vote, Fence/Unfence, ForgetFrom,
// Abort).
#include "server/commit.h"

#include <atomic>
#include <thread>

#include "absl/status/status.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace gtopk {
namespace server {
namespace {

using ::gtopk::testing::StatusIs;
using ::testing::HasSubstr;

absl::Time Later() { return absl::Now() + absl::Seconds(30); }

// A step commits once all S shards voted; every voter gets OK, and a vote
// repeated on the committed step (a retry) gets OK at once.
TEST(CommitCoordinatorTest, AllShardsVotingCommitsAndARepeatedVoteIsOk) {
  CommitCoordinator commit(3);
  absl::Status v0, v1;
  std::thread a([&] { v0 = commit.Vote(7, 0, Later()); });
  std::thread b([&] { v1 = commit.Vote(7, 1, Later()); });
  GTOPK_EXPECT_OK(commit.Vote(7, 2, Later()));
  a.join();
  b.join();
  GTOPK_EXPECT_OK(v0);
  GTOPK_EXPECT_OK(v1);
  const absl::Time start = absl::Now();
  GTOPK_EXPECT_OK(commit.Vote(7, 1, absl::Now() + absl::Milliseconds(50)));
  EXPECT_LT(absl::Now() - start, absl::Milliseconds(50));
  // One shard of one: no waiting.
  CommitCoordinator alone(1);
  GTOPK_EXPECT_OK(alone.Vote(0, 0, absl::Now() + absl::Milliseconds(50)));
}

TEST(CommitCoordinatorTest, BadVotesAreInvalidArgument) {
  CommitCoordinator commit(2);
  EXPECT_THAT(commit.Vote(0, 2, Later()),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(commit.Vote(-1, 0, Later()),
              StatusIs(absl::StatusCode::kInvalidArgument));
}

// A deadline names the shards that did not vote and discards the attempt:
// the retry of the step is a fresh vote.
TEST(CommitCoordinatorTest, DeadlineNamesTheMissingShardsAndStartsAfresh) {
  CommitCoordinator commit(3);
  EXPECT_THAT(commit.Vote(5, 1, absl::Now() + absl::Milliseconds(50)),
              StatusIs(absl::StatusCode::kDeadlineExceeded,
                       HasSubstr("shard(s) 0, 2")));
  absl::Status v0, v1;
  std::thread a([&] { v0 = commit.Vote(5, 0, Later()); });
  std::thread b([&] { v1 = commit.Vote(5, 1, Later()); });
  GTOPK_EXPECT_OK(commit.Vote(5, 2, Later()));
  a.join();
  b.join();
  GTOPK_EXPECT_OK(v0);
  GTOPK_EXPECT_OK(v1);
}

// Only `retained_steps` decided steps are remembered: a vote on an older
// one cannot be answered the same way and is FAILED_PRECONDITION.
TEST(CommitCoordinatorTest, AVoteOlderThanTheRetainedStepsIsRefused) {
  CommitCoordinator commit(1, /*retained_steps=*/2);
  for (int64_t step = 0; step < 6; ++step) {
    GTOPK_ASSERT_OK(commit.Vote(step, 0, Later()));
  }
  EXPECT_THAT(commit.Vote(0, 0, Later()),
              StatusIs(absl::StatusCode::kFailedPrecondition));
  GTOPK_EXPECT_OK(commit.Vote(5, 0, Later()));  // retained: same answer
}

// Fail fast (AbortStep): an aborted step ends the waiting votes at once with
// the reason; a late vote of the failed attempt (older epoch: a shard that
// was still computing it) is refused instead of opening an attempt that the
// retry would join; the retry's votes (the failure's epoch) commit; a
// committed step cannot be aborted.
TEST(CommitCoordinatorTest, AbortEndsTheAttemptAndRefusesItsLateVotes) {
  CommitCoordinator commit(3);
  const absl::Status reason =
      absl::AbortedError("step 4 failed on shard 2: bad push");
  absl::Status waiting;
  const absl::Time start = absl::Now();
  std::thread t0([&] { waiting = commit.Vote(4, 0, Later(), {}, 10); });
  absl::SleepFor(absl::Milliseconds(100));
  EXPECT_TRUE(commit.Abort(4, reason, 11));
  t0.join();
  EXPECT_LT(absl::Now() - start, absl::Seconds(2));
  EXPECT_THAT(waiting, StatusIs(absl::StatusCode::kAborted,
                                HasSubstr("failed on shard 2")));
  EXPECT_THAT(commit.Vote(4, 1, Later(), {}, 10),
              StatusIs(absl::StatusCode::kAborted, HasSubstr("bad push")));
  absl::Status v0, v1;
  std::thread a([&] { v0 = commit.Vote(4, 0, Later(), {}, 11); });
  std::thread b([&] { v1 = commit.Vote(4, 1, Later(), {}, 12); });
  GTOPK_EXPECT_OK(commit.Vote(4, 2, Later(), {}, 11));
  a.join();
  b.join();
  GTOPK_EXPECT_OK(v0);
  GTOPK_EXPECT_OK(v1);
  EXPECT_FALSE(commit.Abort(4, reason, 13));  // committed: a stale message
  GTOPK_EXPECT_OK(commit.Vote(4, 1, Later(), {}, 12));
}

TEST(CommitCoordinatorTest, CancelledVoteFenceAndForget) {
  // A cancelled vote ends the other shards' wait at once (shard 2 of 3
  // never votes).
  CommitCoordinator three(3);
  std::atomic<bool> gone{false};
  absl::Status other, cancelled;
  std::thread t0([&] { other = three.Vote(0, 0, Later()); });
  std::thread t1([&] {
    cancelled = three.Vote(0, 1, Later(), [&gone] { return gone.load(); });
  });
  absl::SleepFor(absl::Milliseconds(100));
  const absl::Time start = absl::Now();
  gone = true;
  t0.join();
  t1.join();
  EXPECT_LT(absl::Now() - start, absl::Seconds(1));
  EXPECT_THAT(cancelled, StatusIs(absl::StatusCode::kCancelled));
  EXPECT_THAT(other, StatusIs(absl::StatusCode::kAborted,
                              HasSubstr("vote of shard 1 was cancelled")));
  // Fenced: waiting and new votes fail; steps committed before stay so.
  CommitCoordinator commit(2);
  std::thread t2([&] { other = commit.Vote(1, 0, Later()); });
  GTOPK_ASSERT_OK(commit.Vote(1, 1, Later()));
  t2.join();
  GTOPK_ASSERT_OK(other);
  std::thread t3([&] { other = commit.Vote(2, 0, Later()); });
  absl::SleepFor(absl::Milliseconds(50));
  commit.Fence(absl::AbortedError("recovering"));
  t3.join();
  EXPECT_THAT(other,
              StatusIs(absl::StatusCode::kAborted, HasSubstr("recovering")));
  EXPECT_THAT(commit.Vote(2, 1, Later()),
              StatusIs(absl::StatusCode::kAborted, HasSubstr("recovering")));
  GTOPK_EXPECT_OK(commit.Vote(1, 0, Later()));  // committed before the fence
  commit.Unfence();
  // Forgetting step 1 makes it a new vote: one shard alone times out.
  commit.ForgetFrom(1);
  EXPECT_THAT(
      commit.Vote(1, 0, absl::Now() + absl::Milliseconds(50)),
      StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstr("shard(s) 1")));
}

}  // namespace
}  // namespace server
}  // namespace gtopk
