// RecoveryCoordinator and AbortForwards (server/recovery_coordinator.h) on
// their own: one recovery at a time, callers of the same kind sharing a
// running one, another kind waiting for it, waits ending at their
// deadline; one queued forward per step, a later failure replacing it.
#include "server/recovery_coordinator.h"

#include <atomic>
#include <optional>
#include <thread>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace gtopk {
namespace server {
namespace {

using ::gtopk::testing::IsOk;
using ::gtopk::testing::StatusIs;
using ::testing::HasSubstr;

// How long a test lets a started thread reach its wait inside RunOrJoin.
constexpr absl::Duration kSettle = absl::Milliseconds(300);

v1::RecoverResponse Resumed(int64_t next_step) {
  v1::RecoverResponse response;
  response.set_next_step(next_step);
  return response;
}

absl::Time Far() { return absl::Now() + absl::Seconds(60); }

TEST(RecoveryCoordinatorTest, ACallerAloneRunsItsRecoveryAndGetsItsResult) {
  RecoveryCoordinator coordinator;
  int runs = 0;
  absl::StatusOr<v1::RecoverResponse> result =
      coordinator.RunOrJoin(-1, Far(), [&] {
        ++runs;
        return absl::StatusOr<v1::RecoverResponse>(Resumed(7));
      });
  ASSERT_THAT(result, IsOk());
  EXPECT_EQ(result->next_step(), 7);
  EXPECT_EQ(runs, 1);
  // A later caller of the same kind runs its own recovery (the earlier
  // outcome is not answered again), and its error comes back as it is.
  absl::StatusOr<v1::RecoverResponse> failed =
      coordinator.RunOrJoin(-1, Far(), [&] {
        ++runs;
        return absl::StatusOr<v1::RecoverResponse>(
            absl::UnavailableError("shard 2 unreachable"));
      });
  EXPECT_THAT(failed,
              StatusIs(absl::StatusCode::kUnavailable, "shard 2 unreachable"));
  EXPECT_EQ(runs, 2);
}

TEST(RecoveryCoordinatorTest, CallersOfTheSameKindShareOneRun) {
  RecoveryCoordinator coordinator;
  std::atomic<int> runs{0};
  absl::Notification running, release;
  absl::StatusOr<v1::RecoverResponse> first_result, second_result;
  std::thread first([&] {
    first_result = coordinator.RunOrJoin(4, Far(), [&] {
      ++runs;
      running.Notify();
      release.WaitForNotification();
      return absl::StatusOr<v1::RecoverResponse>(Resumed(4));
    });
  });
  running.WaitForNotification();
  std::thread second([&] {
    second_result = coordinator.RunOrJoin(4, Far(), [&] {
      ++runs;
      return absl::StatusOr<v1::RecoverResponse>(Resumed(99));
    });
  });
  absl::SleepFor(kSettle);
  release.Notify();
  first.join();
  second.join();
  EXPECT_EQ(runs.load(), 1);
  ASSERT_THAT(first_result, IsOk());
  ASSERT_THAT(second_result, IsOk());
  EXPECT_EQ(first_result->next_step(), 4);
  EXPECT_EQ(second_result->next_step(), 4);  // the shared run's outcome
}

TEST(RecoveryCoordinatorTest, AnotherKindWaitsForTheRunningOneThenRunsItsOwn) {
  RecoveryCoordinator coordinator;
  absl::Notification running, release;
  std::atomic<bool> first_done{false};
  std::atomic<bool> second_ran_before_first_ended{false};
  absl::StatusOr<v1::RecoverResponse> first_result, second_result;
  std::thread first([&] {
    first_result = coordinator.RunOrJoin(-1, Far(), [&] {
      running.Notify();
      release.WaitForNotification();
      first_done = true;
      return absl::StatusOr<v1::RecoverResponse>(Resumed(3));
    });
  });
  running.WaitForNotification();
  std::thread second([&] {
    second_result = coordinator.RunOrJoin(8, Far(), [&] {
      if (!first_done) second_ran_before_first_ended = true;
      return absl::StatusOr<v1::RecoverResponse>(Resumed(8));
    });
  });
  absl::SleepFor(kSettle);
  release.Notify();
  first.join();
  second.join();
  EXPECT_FALSE(second_ran_before_first_ended.load());
  ASSERT_THAT(first_result, IsOk());
  ASSERT_THAT(second_result, IsOk());
  EXPECT_EQ(first_result->next_step(), 3);
  EXPECT_EQ(second_result->next_step(), 8);  // its own run
}

TEST(RecoveryCoordinatorTest, WaitsForARunningRecoveryEndAtTheirDeadline) {
  RecoveryCoordinator coordinator;
  absl::Notification running, release;
  std::thread first([&] {
    (void)coordinator.RunOrJoin(1, Far(), [&] {
      running.Notify();
      release.WaitForNotification();
      return absl::StatusOr<v1::RecoverResponse>(Resumed(1));
    });
  });
  running.WaitForNotification();
  int runs = 0;
  auto never = [&] {
    ++runs;
    return absl::StatusOr<v1::RecoverResponse>(Resumed(0));
  };
  const absl::Time start = absl::Now();
  EXPECT_THAT(coordinator.RunOrJoin(1, start + absl::Milliseconds(100), never),
              StatusIs(absl::StatusCode::kDeadlineExceeded,
                       HasSubstr("another recovery is still running")));
  EXPECT_THAT(
      coordinator.RunOrJoin(2, absl::Now() + absl::Milliseconds(100), never),
      StatusIs(absl::StatusCode::kDeadlineExceeded,
               HasSubstr("another recovery is still running")));
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(190));
  EXPECT_EQ(runs, 0);
  release.Notify();
  first.join();
  // Idle again: the next caller runs at once.
  EXPECT_THAT(coordinator.RunOrJoin(2, absl::Now(), never), IsOk());
  EXPECT_EQ(runs, 1);
}

TEST(AbortForwardsTest, OneForwardPerStepTheLatestFailureWins) {
  AbortForwards forwards;
  EXPECT_TRUE(forwards.Queue(5, {1, "shard 1 failed", 10}));
  EXPECT_FALSE(forwards.Queue(5, {2, "shard 2 failed", 11}));
  EXPECT_TRUE(forwards.Queue(6, {3, "shard 3 failed", 12}));
  std::optional<AbortForwards::Pending> five = forwards.Take(5);
  ASSERT_TRUE(five.has_value());
  EXPECT_EQ(five->origin, 2u);
  EXPECT_EQ(five->reason, "shard 2 failed");
  EXPECT_EQ(five->epoch, 11u);
  EXPECT_FALSE(forwards.Take(5).has_value());  // taken once
  std::optional<AbortForwards::Pending> six = forwards.Take(6);
  ASSERT_TRUE(six.has_value());
  EXPECT_EQ(six->origin, 3u);
  // After a Take, the step's next failure is queued afresh.
  EXPECT_TRUE(forwards.Queue(5, {4, "again", 13}));
}

TEST(AbortForwardsTest, TakeOfAStepNeverQueuedIsNothing) {
  AbortForwards forwards;
  EXPECT_FALSE(forwards.Take(0).has_value());
  EXPECT_TRUE(forwards.Queue(0, {}));
  EXPECT_FALSE(forwards.Take(1).has_value());
  EXPECT_TRUE(forwards.Take(0).has_value());
}

}  // namespace
}  // namespace server
}  // namespace gtopk
