// DownloadSlots (server/download.h) on its own: at most
// kMaxConcurrentDownloads slots are held at once, a wait for one ends at
// its deadline, and a slot is released when its holder (or the holder it
// was moved to) is destroyed. DownloadParams itself, which holds a slot per
// call, is tested through the service (tests/server/service_test.cc,
// tests/server/resource_limits_test.cc).
#include "server/download.h"

#include <optional>
#include <thread>
#include <utility>
#include <vector>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"

namespace gtopk {
namespace server {
namespace {

using Slot = DownloadSlots::Slot;

absl::Time Soon() { return absl::Now() + absl::Milliseconds(100); }

TEST(DownloadSlotsTest, AtMostTheBoundAreHeldAtOnce) {
  DownloadSlots slots;
  std::vector<Slot> held;
  for (int i = 0; i < kMaxConcurrentDownloads; ++i) {
    std::optional<Slot> slot = slots.Acquire(Soon(), nullptr);
    ASSERT_TRUE(slot.has_value()) << "slot " << i;
    held.push_back(*std::move(slot));
  }
  const absl::Time start = absl::Now();
  EXPECT_FALSE(
      slots.Acquire(start + absl::Milliseconds(150), nullptr).has_value());
  // It waited until its deadline.
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(140));
  EXPECT_EQ(held.size(), static_cast<size_t>(kMaxConcurrentDownloads));
}

TEST(DownloadSlotsTest, ADestroyedSlotIsFreeAgain) {
  DownloadSlots slots;
  std::vector<Slot> held;
  for (int i = 0; i < kMaxConcurrentDownloads; ++i) {
    std::optional<Slot> slot = slots.Acquire(Soon(), nullptr);
    ASSERT_TRUE(slot.has_value());
    held.push_back(*std::move(slot));
  }
  held.pop_back();
  EXPECT_TRUE(slots.Acquire(Soon(), nullptr).has_value());
  // The temporary slot above was released at the end of its statement.
  EXPECT_TRUE(slots.Acquire(Soon(), nullptr).has_value());
  held.clear();
  std::vector<Slot> again;
  for (int i = 0; i < kMaxConcurrentDownloads; ++i) {
    std::optional<Slot> slot = slots.Acquire(Soon(), nullptr);
    ASSERT_TRUE(slot.has_value());
    again.push_back(*std::move(slot));
  }
  EXPECT_FALSE(slots.Acquire(Soon(), nullptr).has_value());
}

TEST(DownloadSlotsTest, AMovedSlotIsReleasedOnceByItsLastHolder) {
  DownloadSlots slots;
  std::vector<Slot> held;
  for (int i = 0; i + 1 < kMaxConcurrentDownloads; ++i) {
    std::optional<Slot> slot = slots.Acquire(Soon(), nullptr);
    ASSERT_TRUE(slot.has_value());
    held.push_back(*std::move(slot));
  }
  std::optional<Slot> last = slots.Acquire(Soon(), nullptr);
  ASSERT_TRUE(last.has_value());
  {
    Slot moved(*std::move(last));
    last.reset();  // the moved-from slot releases nothing
    EXPECT_FALSE(slots.Acquire(Soon(), nullptr).has_value());
  }
  // `moved` released it: exactly one is free.
  std::optional<Slot> one = slots.Acquire(Soon(), nullptr);
  EXPECT_TRUE(one.has_value());
  EXPECT_FALSE(slots.Acquire(Soon(), nullptr).has_value());
}

TEST(DownloadSlotsTest, AWaiterGetsTheSlotWhenOneIsReleased) {
  DownloadSlots slots;
  std::vector<Slot> held;
  for (int i = 0; i < kMaxConcurrentDownloads; ++i) {
    std::optional<Slot> slot = slots.Acquire(Soon(), nullptr);
    ASSERT_TRUE(slot.has_value());
    held.push_back(*std::move(slot));
  }
  absl::Notification started;
  bool got = false;
  std::thread waiter([&] {
    started.Notify();
    std::optional<Slot> slot =
        slots.Acquire(absl::Now() + absl::Seconds(30), nullptr);
    got = slot.has_value();
  });
  started.WaitForNotification();
  absl::SleepFor(absl::Milliseconds(100));
  const absl::Time released = absl::Now();
  held.pop_back();
  waiter.join();
  EXPECT_TRUE(got);
  // Woken by the release, not by its 30 s deadline.
  EXPECT_LT(absl::Now() - released, absl::Seconds(5));
}

TEST(DownloadSlotsTest, APastDeadlineGetsAFreeSlot) {
  // A free slot is taken without waiting, even at a deadline already past.
  DownloadSlots slots;
  EXPECT_TRUE(slots.Acquire(absl::InfinitePast(), nullptr).has_value());
}

}  // namespace
}  // namespace server
}  // namespace gtopk
