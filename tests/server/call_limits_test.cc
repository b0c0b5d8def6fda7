// Admission control (server/call_limits.h): CallLimiter's bounds on the
// calls in flight, in all and per peer, their release, the members' calls
// outside the server bound, and the peer keys. Moved from
// tests/server/resource_limits_test.cc (issue 44: tests mirror sources).
#include "server/call_limits.h"

#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace gtopk {
namespace server {
namespace {

using ::gtopk::testing::StatusIs;
using ::testing::AllOf;
using ::testing::HasSubstr;

TEST(CallLimiterTest, RefusesOverTheServerBoundAndReleases) {
  CallLimiter limiter(3, CallLimits{/*max_concurrent_calls=*/2,
                                    /*max_calls_per_peer=*/10});
  auto a = limiter.Admit("peer a", "Join");
  auto b = limiter.Admit("peer b", "Join");
  GTOPK_ASSERT_OK(a.status());
  GTOPK_ASSERT_OK(b.status());
  LimitBound bound = LimitBound::kCount;
  auto c = limiter.Admit("peer c", "PushPull", &bound);
  EXPECT_THAT(c.status(),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       AllOf(HasSubstr("shard 3"), HasSubstr("PushPull"),
                             HasSubstr("--max-concurrent-calls=2"))));
  EXPECT_EQ(bound, LimitBound::kConcurrentCalls);
  EXPECT_EQ(limiter.in_flight(), 2);
  // A refused call took nothing; a finished one gives its slot back.
  *a = CallLimiter::Admission();
  EXPECT_EQ(limiter.in_flight(), 1);
  EXPECT_EQ(limiter.in_flight("peer a"), 0);
  GTOPK_EXPECT_OK(limiter.Admit("peer c", "PushPull").status());
}

TEST(CallLimiterTest, MembersAreNotCrowdedOutByHostsFromManyAddresses) {
  // Issue 42: five hosts, each under its own bound, fill the server bound
  // with idle streams; the step's calls of the members (a rank's stream, a
  // shard's vote) are still admitted, each within its own peer bound.
  CallLimiter limiter(0, CallLimits{/*max_concurrent_calls=*/10,
                                    /*max_calls_per_peer=*/3});
  std::vector<CallLimiter::Admission> held;
  int refused = 0;
  for (int host = 0; host < 5; ++host) {
    for (int i = 0; i < 3; ++i) {
      auto a =
          limiter.Admit(absl::StrCat("ipv4:127.0.0.", 10 + host), "PushPull");
      if (a.ok()) {
        held.push_back(*std::move(a));
      } else {
        EXPECT_THAT(a.status(), StatusIs(absl::StatusCode::kResourceExhausted,
                                         HasSubstr("--max-concurrent-calls")));
        ++refused;
      }
    }
  }
  EXPECT_EQ(held.size(), 10u);
  EXPECT_EQ(refused, 5);
  EXPECT_EQ(limiter.unidentified_in_flight(), 10);
  for (const std::string& member :
       {CallPeerRank(0), CallPeerRank(1), CallPeerShard(1)}) {
    for (int i = 0; i < 3; ++i) {
      auto a = limiter.Admit(member, "ExchangeThreshold");
      GTOPK_ASSERT_OK(a.status()) << member;
      held.push_back(*std::move(a));
    }
    // Each member identity keeps its own bound.
    EXPECT_THAT(limiter.Admit(member, "CommitStep").status(),
                StatusIs(absl::StatusCode::kResourceExhausted,
                         HasSubstr("--max-calls-per-peer=3")));
  }
  EXPECT_EQ(limiter.in_flight(), 19);
  EXPECT_EQ(limiter.unidentified_in_flight(), 10);
  // A host is still refused: the members' calls took no host slot back.
  EXPECT_FALSE(limiter.Admit("ipv4:127.0.0.99", "Join").ok());
  held.clear();
  EXPECT_EQ(limiter.in_flight(), 0);
  EXPECT_EQ(limiter.unidentified_in_flight(), 0);
}

TEST(CallLimiterTest, RefusesOverThePeerBoundOnlyForThatPeer) {
  CallLimiter limiter(0, CallLimits{/*max_concurrent_calls=*/100,
                                    /*max_calls_per_peer=*/2});
  std::vector<CallLimiter::Admission> held;
  for (int i = 0; i < 2; ++i) {
    auto a = limiter.Admit("ipv4:10.0.0.9", "PushPull");
    GTOPK_ASSERT_OK(a.status());
    held.push_back(*std::move(a));
  }
  LimitBound bound = LimitBound::kCount;
  EXPECT_THAT(limiter.Admit("ipv4:10.0.0.9", "Join", &bound).status(),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       AllOf(HasSubstr("peer ipv4:10.0.0.9"),
                             HasSubstr("--max-calls-per-peer=2"))));
  EXPECT_EQ(bound, LimitBound::kCallsPerPeer);
  // Other peers are not affected.
  GTOPK_EXPECT_OK(limiter.Admit(CallPeerRank(0), "PushPull").status());
  GTOPK_EXPECT_OK(limiter.Admit("ipv4:10.0.0.10", "Join").status());
  // Moving an admission keeps one slot.
  CallLimiter::Admission moved = std::move(held[0]);
  EXPECT_EQ(limiter.in_flight("ipv4:10.0.0.9"), 2);
  held.clear();
  EXPECT_EQ(limiter.in_flight("ipv4:10.0.0.9"), 1);
}

TEST(CallLimiterTest, PeerKeys) {
  EXPECT_EQ(CallPeerHost("ipv4:127.0.0.1:40512"), "ipv4:127.0.0.1");
  EXPECT_EQ(CallPeerHost("ipv6:[::1]:40512"), "ipv6:[::1]");
  EXPECT_EQ(CallPeerHost("ipv6:%5B::1%5D:40512"), "ipv6:%5B::1%5D");
  EXPECT_EQ(CallPeerHost("unix:/tmp/sock"), "unix:/tmp/sock");
  EXPECT_EQ(CallPeerHost(""), "");
  EXPECT_EQ(CallPeerRank(7), "rank 7");
  EXPECT_EQ(CallPeerShard(1), "shard 1");
}

TEST(CallLimiterTest, MemberPeersAreRanksAndShardsOnly) {
  EXPECT_TRUE(IsMemberPeer(CallPeerRank(0)));
  EXPECT_TRUE(IsMemberPeer(CallPeerRank(4095)));
  EXPECT_TRUE(IsMemberPeer(CallPeerShard(3)));
  EXPECT_FALSE(IsMemberPeer(CallPeerHost("ipv4:10.0.0.1:5000")));
  EXPECT_FALSE(IsMemberPeer(CallPeerHost("unix:/tmp/sock")));
  EXPECT_FALSE(IsMemberPeer(""));
}

TEST(CallLimiterTest, BoundNamesAreTheMetricLabels) {
  EXPECT_STREQ(LimitBoundName(LimitBound::kConcurrentCalls),
               "concurrent_calls");
  EXPECT_STREQ(LimitBoundName(LimitBound::kCallsPerPeer), "calls_per_peer");
  EXPECT_STREQ(LimitBoundName(LimitBound::kPushPairs), "push_pairs");
  EXPECT_STREQ(LimitBoundName(LimitBound::kDownloadTime), "download_time");
}

TEST(CallLimiterTest, AMovedAdmissionReleasesOnce) {
  CallLimiter limiter(0, CallLimits{/*max_concurrent_calls=*/1,
                                    /*max_calls_per_peer=*/1});
  absl::StatusOr<CallLimiter::Admission> a = limiter.Admit("host", "Join");
  GTOPK_ASSERT_OK(a.status());
  {
    CallLimiter::Admission moved = std::move(*a);
    EXPECT_EQ(limiter.in_flight(), 1);
    EXPECT_EQ(limiter.unidentified_in_flight(), 1);
  }
  EXPECT_EQ(limiter.in_flight(), 0);
  *a = CallLimiter::Admission();  // the moved-from one releases nothing
  EXPECT_EQ(limiter.in_flight(), 0);
  GTOPK_EXPECT_OK(limiter.Admit("host", "Join").status());
}

}  // namespace
}  // namespace server
}  // namespace gtopk
