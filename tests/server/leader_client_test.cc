// CallUntilAdmitted (server/leader_client.h): a shard's call to another
// shard refused by the callee's admission (RESOURCE_EXHAUSTED) is repeated
// within the deadline, and a refusal to the end becomes UNAVAILABLE, which
// the workers retry (worker/flags.md, --recovery-timeout). Found by a
// break-it run: a --tls=off client claiming shard 1 filled shard 1's
// per-peer bucket on the leader, the real shard 1's ExchangeThreshold was
// refused, and every worker exited on the RESOURCE_EXHAUSTED it passed on.
#include "server/leader_client.h"

#include <string>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "grpcpp/support/status.h"
#include "gtest/gtest.h"

namespace gtopk {
namespace server {
namespace {

const grpc::Status kRefused(grpc::StatusCode::RESOURCE_EXHAUSTED,
                            "ExchangeThreshold refused: 27 calls from peer "
                            "shard 1 are in flight");

TEST(CallUntilAdmittedTest, RepeatsARefusedCallUntilItIsAdmitted) {
  int calls = 0;
  const grpc::Status status = CallUntilAdmitted(
      absl::Now() + absl::Seconds(10), "ExchangeThreshold", [&] {
        ++calls;
        return calls <= 3 ? kRefused : grpc::Status::OK;
      });
  EXPECT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(calls, 4);
}

TEST(CallUntilAdmittedTest, ReturnsAnyOtherStatusAtOnce) {
  for (const grpc::Status& other :
       {grpc::Status::OK,
        grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "bad"),
        grpc::Status(grpc::StatusCode::ABORTED, "step failed"),
        grpc::Status(grpc::StatusCode::UNAVAILABLE, "down")}) {
    int calls = 0;
    const grpc::Status status =
        CallUntilAdmitted(absl::Now() + absl::Seconds(10), "CommitStep", [&] {
          ++calls;
          return other;
        });
    EXPECT_EQ(status.error_code(), other.error_code());
    EXPECT_EQ(status.error_message(), other.error_message());
    EXPECT_EQ(calls, 1);
  }
}

TEST(CallUntilAdmittedTest, ARefusalToTheDeadlineIsUnavailableNamingIt) {
  int calls = 0;
  const absl::Time start = absl::Now();
  const absl::Time deadline = start + absl::Milliseconds(300);
  const grpc::Status status =
      CallUntilAdmitted(deadline, "ExchangeThreshold", [&] {
        ++calls;
        return kRefused;
      });
  const absl::Time end = absl::Now();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_NE(status.error_message().find(
                "ExchangeThreshold refused until the deadline ("),
            std::string::npos)
      << status.error_message();
  EXPECT_NE(status.error_message().find(kRefused.error_message()),
            std::string::npos)
      << status.error_message();
  // Tries 5, 10, 20, 40, 80 ms apart, then 100 ms: a few within 300 ms.
  EXPECT_GE(calls, 4);
  EXPECT_LE(calls, 10);
  // It stopped before the deadline, never sleeping past it.
  EXPECT_LE(end, deadline + absl::Milliseconds(50));
  EXPECT_GE(end, start + absl::Milliseconds(150));
}

}  // namespace
}  // namespace server
}  // namespace gtopk
