// Membership (server/membership.h) on its own, without a gRPC server: rank
// assignment, member tokens, run-length agreement, step streams and the
// reservations a rank keeps for its holder. A grpc::ServerContext made by
// the test stands for an open stream that is not cancelled (a live worker);
// the cases of a cancelled stream need a real call and are covered through
// the service (tests/integration/membership_integration_test.cc).
#include "server/membership.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "grpcpp/server_context.h"
#include "gtest/gtest.h"
#include "server/member_file.h"
#include "server/service_internal.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/temp_dir.h"

namespace gtopk {
namespace server {
namespace {

using ::gtopk::testing::IsOk;
using ::gtopk::testing::StatusIs;
using ::gtopk::testing::TempDir;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

constexpr uint32_t kLeader = 0;
constexpr absl::Duration kStepTimeout = absl::Seconds(1);

absl::Status FixN() { return absl::OkStatus(); }

// Join with no context (no deadline, never cancelled) and a fix_n that
// succeeds.
absl::StatusOr<Membership::Grant> JoinRank(Membership& m, int64_t requested,
                                           const std::string& run_length = "") {
  return m.Join(requested, run_length, /*context=*/nullptr, FixN);
}

TEST(MembershipJoinTest, AnyRankJoinsGetRanksInOrderWithDistinctTokens) {
  Membership m(kLeader, 3, "", kStepTimeout);
  std::set<uint64_t> tokens;
  for (uint32_t expected = 0; expected < 3; ++expected) {
    absl::StatusOr<Membership::Grant> grant = JoinRank(m, -1);
    ASSERT_THAT(grant, IsOk());
    EXPECT_EQ(grant->rank, expected);
    EXPECT_NE(grant->token, 0u);
    tokens.insert(grant->token);
    EXPECT_THAT(m.CheckToken(grant->rank, grant->token), IsOk());
    EXPECT_TRUE(m.Knows(grant->rank, grant->token));
  }
  EXPECT_EQ(tokens.size(), 3u);
  EXPECT_THAT(JoinRank(m, -1), StatusIs(absl::StatusCode::kResourceExhausted,
                                        HasSubstr("all 3 ranks are taken")));
}

TEST(MembershipJoinTest, ARequestedRankIsGrantedAndSkippedByAnyRankJoins) {
  Membership m(kLeader, 3, "", kStepTimeout);
  absl::StatusOr<Membership::Grant> two = JoinRank(m, 2);
  ASSERT_THAT(two, IsOk());
  EXPECT_EQ(two->rank, 2u);
  absl::StatusOr<Membership::Grant> first = JoinRank(m, -1);
  ASSERT_THAT(first, IsOk());
  EXPECT_EQ(first->rank, 0u);
  absl::StatusOr<Membership::Grant> second = JoinRank(m, -1);
  ASSERT_THAT(second, IsOk());
  EXPECT_EQ(second->rank, 1u);
}

TEST(MembershipJoinTest, ARejoinOfARankSupersedesItsEarlierToken) {
  Membership m(kLeader, 2, "", kStepTimeout);
  absl::StatusOr<Membership::Grant> old_grant = JoinRank(m, 1);
  ASSERT_THAT(old_grant, IsOk());
  // No stream is open for rank 1: its worker restarted, the rank is free.
  absl::StatusOr<Membership::Grant> new_grant = JoinRank(m, 1);
  ASSERT_THAT(new_grant, IsOk());
  EXPECT_EQ(new_grant->rank, 1u);
  EXPECT_NE(new_grant->token, old_grant->token);
  EXPECT_THAT(m.CheckToken(1, new_grant->token), IsOk());
  EXPECT_THAT(m.CheckToken(1, old_grant->token),
              StatusIs(absl::StatusCode::kPermissionDenied,
                       HasSubstr("rank 1 is held by another worker")));
  EXPECT_FALSE(m.Knows(1, old_grant->token));
}

TEST(MembershipJoinTest, FixNsErrorIsReturnedAndNoRankIsGranted) {
  Membership m(kLeader, 2, "", kStepTimeout);
  absl::StatusOr<Membership::Grant> grant = m.Join(
      -1, "", nullptr, [] { return absl::InvalidArgumentError("n differs"); });
  EXPECT_THAT(grant, StatusIs(absl::StatusCode::kInvalidArgument, "n differs"));
  EXPECT_THAT(m.CheckToken(0, 1),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("has not joined")));
  // The rank is still free.
  absl::StatusOr<Membership::Grant> next = JoinRank(m, -1);
  ASSERT_THAT(next, IsOk());
  EXPECT_EQ(next->rank, 0u);
}

TEST(MembershipJoinTest, AClosedMembershipRefusesJoins) {
  Membership m(3, 2, "", kStepTimeout);  // a non-leader closes the same way
  m.Close();
  EXPECT_THAT(JoinRank(m, -1), StatusIs(absl::StatusCode::kUnavailable,
                                        "shard 3 is shutting down"));
  EXPECT_THAT(JoinRank(m, 1), StatusIs(absl::StatusCode::kUnavailable,
                                       "shard 3 is shutting down"));
}

TEST(MembershipJoinTest, RunLengthMustAgreeWhileAnotherRankIsLive) {
  Membership m(kLeader, 2, "", kStepTimeout);
  absl::StatusOr<Membership::Grant> first =
      JoinRank(m, 0, "--epochs=3 --steps=0");
  ASSERT_THAT(first, IsOk());
  grpc::ServerContext context;
  Membership::Stream stream(&m, &context);
  ASSERT_TRUE(stream.RegisterFromMetadata(0, first->token));
  EXPECT_THAT(JoinRank(m, 1, "--epochs=5 --steps=0"),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("--epochs is 5 here but 3 on the workers "
                                 "that joined first")));
  EXPECT_THAT(JoinRank(m, 1, "--epochs=3 --steps=0"), IsOk());
}

TEST(MembershipJoinTest, RunLengthIsSetAfreshWhenNoOtherRankIsHeld) {
  Membership m(kLeader, 2, "", kStepTimeout);
  ASSERT_THAT(JoinRank(m, 0, "--epochs=3"), IsOk());
  // Rank 0 has no open stream and no reservation: the cluster is resumed
  // as a whole with another run length, which the first Join sets.
  ASSERT_THAT(JoinRank(m, 1, "--epochs=5"), IsOk());
  grpc::ServerContext context;
  Membership::Stream stream(&m, &context);
  stream.Pushed(1);  // rank 1 is live now
  EXPECT_THAT(JoinRank(m, 0, "--epochs=3"),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("--epochs is 3 here but 5")));
  // A Join without a run length does not take part in the agreement.
  EXPECT_THAT(JoinRank(m, 0), IsOk());
}

TEST(MembershipJoinTest, ARankWithAnOpenStreamIsTakenByALiveWorker) {
  Membership m(kLeader, 2, "", kStepTimeout);
  absl::StatusOr<Membership::Grant> grant = JoinRank(m, 1);
  ASSERT_THAT(grant, IsOk());
  grpc::ServerContext context;
  Membership::Stream stream(&m, &context);
  ASSERT_TRUE(stream.RegisterFromMetadata(1, grant->token));
  const absl::Time start = absl::Now();
  EXPECT_THAT(JoinRank(m, 1), StatusIs(absl::StatusCode::kAlreadyExists,
                                       HasSubstr("rank 1 is already taken")));
  // It first gave the stream kRankReleaseGrace to end.
  EXPECT_GE(absl::Now() - start,
            internal::kRankReleaseGrace - absl::Milliseconds(100));
  EXPECT_THAT(m.CheckToken(1, grant->token), IsOk());
}

TEST(MembershipJoinTest, AStreamEndedByTheServerReservesTheRankForAWhile) {
  Membership m(kLeader, 2, "", kStepTimeout);
  absl::StatusOr<Membership::Grant> grant = JoinRank(m, 0);
  ASSERT_THAT(grant, IsOk());
  {
    grpc::ServerContext context;
    Membership::Stream stream(&m, &context);
    ASSERT_TRUE(stream.RegisterFromMetadata(0, grant->token));
    // Destroyed without a cancellation: this server ended it (a failed
    // round), so the worker is alive and about to Recover.
  }
  const absl::Time ended = absl::Now();
  EXPECT_THAT(JoinRank(m, 0), StatusIs(absl::StatusCode::kUnavailable,
                                       HasSubstr("reserved for its holder")));
  EXPECT_THAT(m.CheckToken(0, grant->token), IsOk());
  // Past kRankRecoverHold the reservation has expired.
  absl::SleepFor(internal::kRankRecoverHold - (absl::Now() - ended) +
                 absl::Milliseconds(200));
  absl::StatusOr<Membership::Grant> later = JoinRank(m, 0);
  ASSERT_THAT(later, IsOk());
  EXPECT_NE(later->token, grant->token);
}

TEST(MembershipJoinTest, RestoredHoldersKeepTheirRanksReserved) {
  Membership m(kLeader, 3, "", kStepTimeout);
  m.RestoreHolders({111, 0, 333}, "--steps=10");
  EXPECT_THAT(m.CheckToken(0, 111), IsOk());
  EXPECT_THAT(m.CheckToken(2, 333), IsOk());
  // The run length of the restored holders binds a new worker.
  EXPECT_THAT(JoinRank(m, -1, "--steps=20"),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("--steps is 20 here but 10")));
  absl::StatusOr<Membership::Grant> free = JoinRank(m, -1, "--steps=10");
  ASSERT_THAT(free, IsOk());
  EXPECT_EQ(free->rank, 1u);
  // Every other rank is reserved: retry later, not never.
  EXPECT_THAT(JoinRank(m, -1), StatusIs(absl::StatusCode::kUnavailable,
                                        HasSubstr("no rank is free")));
  EXPECT_THAT(JoinRank(m, 2), StatusIs(absl::StatusCode::kUnavailable,
                                       HasSubstr("reserved for its holder")));
}

TEST(MembershipReenterTest, TheHolderReentersWithItsToken) {
  Membership m(kLeader, 2, "", kStepTimeout);
  m.RestoreHolders({111, 222}, "");
  EXPECT_THAT(m.Reenter(0, 111), IsOk());
  EXPECT_THAT(m.Reenter(1, 999),
              StatusIs(absl::StatusCode::kPermissionDenied,
                       HasSubstr("Recover: rank 1 is held by another worker")));
  EXPECT_THAT(m.Reenter(1, 0), StatusIs(absl::StatusCode::kPermissionDenied,
                                        HasSubstr("Recover: rank 1: no member "
                                                  "token")));
}

TEST(MembershipReenterTest, ARankWithoutAKnownHolderTakesTheToken) {
  // A leader restarted without a member file knows no holder.
  Membership m(kLeader, 2, "", kStepTimeout);
  EXPECT_THAT(m.Reenter(1, 4242), IsOk());
  EXPECT_THAT(m.CheckToken(1, 4242), IsOk());
  EXPECT_THAT(m.CheckToken(1, 4243),
              StatusIs(absl::StatusCode::kPermissionDenied));
  // The rank stays reserved for the recovering holder...
  EXPECT_THAT(JoinRank(m, 1), StatusIs(absl::StatusCode::kUnavailable,
                                       HasSubstr("recovering")));
  // ...and is not handed to an any-rank Join either.
  absl::StatusOr<Membership::Grant> other = JoinRank(m, -1);
  ASSERT_THAT(other, IsOk());
  EXPECT_EQ(other->rank, 0u);
}

TEST(MembershipTokenTest, CheckTokenNamesEachRefusal) {
  Membership m(kLeader, 2, "", kStepTimeout);
  EXPECT_THAT(m.CheckToken(2, 5),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       "unknown worker rank 2; the cluster has 2 workers"));
  EXPECT_THAT(m.CheckToken(1, 0),
              StatusIs(absl::StatusCode::kPermissionDenied,
                       HasSubstr("rank 1: no member token")));
  EXPECT_THAT(m.CheckToken(1, 5),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("rank 1 has not joined leader shard 0")));
  EXPECT_FALSE(m.Knows(2, 5));
  EXPECT_FALSE(m.Knows(1, 0));
}

TEST(MembershipTokenTest, TheLeaderDecidesEveryTokenCheckItself) {
  Membership m(kLeader, 2, "", kStepTimeout);
  absl::StatusOr<Membership::Grant> grant = JoinRank(m, 0);
  ASSERT_THAT(grant, IsOk());
  std::optional<absl::Status> known = m.CheckTokenHere(0, grant->token);
  ASSERT_TRUE(known.has_value());
  EXPECT_THAT(*known, IsOk());
  std::optional<absl::Status> unknown = m.CheckTokenHere(1, 7);
  ASSERT_TRUE(unknown.has_value());
  EXPECT_THAT(*unknown, StatusIs(absl::StatusCode::kFailedPrecondition));
}

TEST(MembershipTokenTest, ANonLeaderAsksTheLeaderAboutTokensItHasNotSeen) {
  Membership m(1, 2, "", kStepTimeout);
  EXPECT_FALSE(m.is_leader());
  EXPECT_EQ(m.CheckTokenHere(0, 77), std::nullopt);
  // Malformed requests are decided here.
  std::optional<absl::Status> bad_rank = m.CheckTokenHere(2, 77);
  ASSERT_TRUE(bad_rank.has_value());
  EXPECT_THAT(*bad_rank, StatusIs(absl::StatusCode::kInvalidArgument));
  std::optional<absl::Status> no_token = m.CheckTokenHere(0, 0);
  ASSERT_TRUE(no_token.has_value());
  EXPECT_THAT(*no_token, StatusIs(absl::StatusCode::kPermissionDenied));
  // The leader confirmed 77: cached.
  m.ConfirmToken(0, 77);
  std::optional<absl::Status> cached = m.CheckTokenHere(0, 77);
  ASSERT_TRUE(cached.has_value());
  EXPECT_THAT(*cached, IsOk());
  EXPECT_TRUE(m.Knows(0, 77));
  // A later confirmation supersedes it.
  m.ConfirmToken(0, 78);
  EXPECT_FALSE(m.Knows(0, 77));
  EXPECT_EQ(m.CheckTokenHere(0, 77), std::nullopt);
  EXPECT_TRUE(m.Knows(0, 78));
}

TEST(MembershipStreamTest, RegisterFromMetadataNeedsTheCurrentToken) {
  Membership m(kLeader, 2, "", kStepTimeout);
  absl::StatusOr<Membership::Grant> grant = JoinRank(m, 1);
  ASSERT_THAT(grant, IsOk());
  grpc::ServerContext context;
  Membership::Stream stream(&m, &context);
  EXPECT_EQ(stream.rank(), -1);
  EXPECT_FALSE(stream.RegisterFromMetadata(1, grant->token + 1));
  EXPECT_FALSE(stream.RegisterFromMetadata(0, grant->token));
  EXPECT_EQ(stream.rank(), -1);
  EXPECT_TRUE(stream.RegisterFromMetadata(1, grant->token));
  EXPECT_EQ(stream.rank(), 1);
}

TEST(MembershipStreamTest, OnlyStreamsThatPushedCountForTheDrain) {
  Membership m(kLeader, 3, "", kStepTimeout);
  absl::StatusOr<Membership::Grant> zero = JoinRank(m, 0);
  ASSERT_THAT(zero, IsOk());
  EXPECT_EQ(m.PushingStreams(), 0u);
  grpc::ServerContext c0, c1, c2;
  auto idle = std::make_unique<Membership::Stream>(&m, &c0);
  ASSERT_TRUE(idle->RegisterFromMetadata(0, zero->token));
  EXPECT_EQ(m.PushingStreams(), 0u);  // registered, not pushed yet
  idle->Pushed(0);
  EXPECT_EQ(m.PushingStreams(), 1u);
  idle->Pushed(0);  // a second push changes nothing
  EXPECT_EQ(m.PushingStreams(), 1u);
  {
    // A stream that registers at its first push.
    Membership::Stream pushing(&m, &c1);
    pushing.Pushed(2);
    EXPECT_EQ(pushing.rank(), 2);
    EXPECT_EQ(m.PushingStreams(), 2u);
    // An idle stream does not count, before or after.
    Membership::Stream other_idle(&m, &c2);
    ASSERT_TRUE(other_idle.RegisterFromMetadata(0, zero->token));
    EXPECT_EQ(m.PushingStreams(), 2u);
  }
  EXPECT_EQ(m.PushingStreams(), 1u);
  idle.reset();
  EXPECT_EQ(m.PushingStreams(), 0u);
}

TEST(MembershipStreamTest, AnUnregisteredStreamChangesNothingWhenDestroyed) {
  Membership m(kLeader, 1, "", kStepTimeout);
  {
    grpc::ServerContext context;
    Membership::Stream stream(&m, &context);
  }
  EXPECT_EQ(m.PushingStreams(), 0u);
  EXPECT_THAT(JoinRank(m, 0), IsOk());  // not reserved
}

TEST(MembershipMemberFileTest, EveryGrantIsWrittenBeforeItIsReturned) {
  TempDir dir("membership_file");
  ASSERT_FALSE(dir.path().empty());
  Membership m(kLeader, 3, dir.path(), kStepTimeout);
  absl::StatusOr<Membership::Grant> one = JoinRank(m, 1, "--steps=4");
  ASSERT_THAT(one, IsOk());
  std::string run_length;
  EXPECT_THAT(ReadMemberTokens(dir.path(), 3, &run_length),
              ::gtopk::testing::IsOkAndHolds(
                  ElementsAre(uint64_t{0}, one->token, uint64_t{0})));
  EXPECT_EQ(run_length, "--steps=4");
  absl::StatusOr<Membership::Grant> zero = JoinRank(m, -1, "--steps=4");
  ASSERT_THAT(zero, IsOk());
  EXPECT_THAT(ReadMemberTokens(dir.path(), 3),
              ::gtopk::testing::IsOkAndHolds(
                  ElementsAre(zero->token, one->token, uint64_t{0})));
}

TEST(MembershipMemberFileTest, AGrantThatCannotBeWrittenIsNotGiven) {
  Membership m(kLeader, 2, "/nonexistent/gtopk_membership_test", kStepTimeout);
  EXPECT_THAT(JoinRank(m, 0), StatusIs(absl::StatusCode::kUnavailable,
                                       HasSubstr("rank 0 not granted")));
  EXPECT_THAT(m.CheckToken(0, 1),
              StatusIs(absl::StatusCode::kFailedPrecondition));
  EXPECT_THAT(m.Reenter(1, 55), StatusIs(absl::StatusCode::kUnavailable,
                                         HasSubstr("Recover: the leader "
                                                   "cannot record rank 1")));
  EXPECT_THAT(m.CheckToken(1, 55),
              StatusIs(absl::StatusCode::kFailedPrecondition));
}

TEST(MembershipMemberFileTest, AFailedReentryLeavesTheRankFree) {
  TempDir dir("membership_reenter");
  ASSERT_FALSE(dir.path().empty());
  Membership m(kLeader, 2, dir.path(), kStepTimeout);
  // The member file cannot be written for a moment.
  ASSERT_EQ(rmdir(dir.path().c_str()), 0);
  EXPECT_THAT(m.Reenter(1, 55), StatusIs(absl::StatusCode::kUnavailable));
  ASSERT_EQ(mkdir(dir.path().c_str(), 0700), 0);
  // Rank 1 was not taken by the failed Recover: any-rank Joins get both.
  absl::StatusOr<Membership::Grant> first = JoinRank(m, -1);
  ASSERT_THAT(first, IsOk());
  EXPECT_EQ(first->rank, 0u);
  absl::StatusOr<Membership::Grant> second = JoinRank(m, -1);
  ASSERT_THAT(second, IsOk());
  EXPECT_EQ(second->rank, 1u);
}

TEST(MembershipMemberFileTest, ANonLeaderWritesNoMemberFile) {
  TempDir dir("membership_nonleader");
  ASSERT_FALSE(dir.path().empty());
  Membership m(1, 2, dir.path(), kStepTimeout);
  m.ConfirmToken(0, 9);
  m.KeepOnlyLiveMembers();
  EXPECT_THAT(ReadMemberTokens(dir.path(), 2),
              StatusIs(absl::StatusCode::kNotFound));
}

TEST(MembershipMemberFileTest, KeepOnlyLiveMembersDropsRanksWithoutStreams) {
  TempDir dir("membership_live");
  ASSERT_FALSE(dir.path().empty());
  Membership m(kLeader, 3, dir.path(), kStepTimeout);
  absl::StatusOr<Membership::Grant> zero = JoinRank(m, 0, "--epochs=2");
  absl::StatusOr<Membership::Grant> one = JoinRank(m, 1, "--epochs=2");
  ASSERT_THAT(zero, IsOk());
  ASSERT_THAT(one, IsOk());
  grpc::ServerContext context;
  Membership::Stream stream(&m, &context);
  ASSERT_TRUE(stream.RegisterFromMetadata(1, one->token));
  m.KeepOnlyLiveMembers();
  std::string run_length;
  EXPECT_THAT(ReadMemberTokens(dir.path(), 3, &run_length),
              ::gtopk::testing::IsOkAndHolds(
                  ElementsAre(uint64_t{0}, one->token, uint64_t{0})));
  EXPECT_EQ(run_length, "--epochs=2");
}

}  // namespace
}  // namespace server
}  // namespace gtopk
