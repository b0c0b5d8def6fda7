// The server wrapper (server/aggregator_server.h) on loopback: Start binds
// a free port and serves grpc.health.v1 SERVING (the main port and a
// plaintext health-only port), CheckHealth's answers for unknown and
// over-long service names, an address in use, and Shutdown: not serving
// afterwards, idempotent, no checkpoint without parameters. The service
// inside is tested in tests/server/service_test.cc.
#include "server/aggregator_server.h"

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/checkpoint.h"
#include "server/server_config.h"
#include "server/service.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/temp_dir.h"

namespace gtopk {
namespace server {
namespace {

using ::gtopk::testing::IsOk;
using ::gtopk::testing::IsOkAndHolds;
using ::gtopk::testing::StatusIs;
using ::gtopk::testing::TempDir;

ServerConfig OneShard() {
  ServerConfig c;
  c.peers = {""};
  c.step_timeout = absl::Seconds(2);
  return c;
}

constexpr absl::Duration kTimeout = absl::Seconds(5);

TEST(AggregatorServerTest, StartsOnAFreePortAndIsServing) {
  absl::StatusOr<std::unique_ptr<AggregatorServer>> server =
      AggregatorServer::Start(OneShard(), "127.0.0.1:0");
  ASSERT_THAT(server, IsOk());
  EXPECT_GT((*server)->port(), 0);
  EXPECT_EQ((*server)->address(),
            "127.0.0.1:" + std::to_string((*server)->port()));
  EXPECT_EQ((*server)->health_port(), 0);
  EXPECT_NE((*server)->service(), nullptr);
  EXPECT_THAT(CheckHealth((*server)->address(), kTimeout), IsOkAndHolds(true));
  // No checkpoint directory: checkpoints cannot fail.
  EXPECT_THAT(
      CheckHealth((*server)->address(), kTimeout, kCheckpointHealthService),
      IsOkAndHolds(true));
}

TEST(AggregatorServerTest, CheckHealthRefusesUnknownAndOverlongServices) {
  absl::StatusOr<std::unique_ptr<AggregatorServer>> server =
      AggregatorServer::Start(OneShard(), "127.0.0.1:0");
  ASSERT_THAT(server, IsOk());
  EXPECT_THAT(CheckHealth((*server)->address(), kTimeout, "no.such.service"),
              StatusIs(absl::StatusCode::kNotFound));
  EXPECT_THAT(
      CheckHealth((*server)->address(), kTimeout, std::string(128, 'x')),
      StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST(AggregatorServerTest, AHealthOnlyPortAnswersLikeTheMainOne) {
  absl::StatusOr<std::unique_ptr<AggregatorServer>> server =
      AggregatorServer::Start(OneShard(), "127.0.0.1:0", "127.0.0.1:0");
  ASSERT_THAT(server, IsOk());
  ASSERT_GT((*server)->health_port(), 0);
  const std::string health =
      "127.0.0.1:" + std::to_string((*server)->health_port());
  EXPECT_THAT(CheckHealth(health, kTimeout), IsOkAndHolds(true));
  ASSERT_THAT((*server)->Shutdown(absl::Milliseconds(100)), IsOk());
  EXPECT_FALSE(CheckHealth(health, absl::Seconds(1)).value_or(false));
}

TEST(AggregatorServerTest, AnAddressInUseIsUnavailable) {
  absl::StatusOr<std::unique_ptr<AggregatorServer>> first =
      AggregatorServer::Start(OneShard(), "127.0.0.1:0");
  ASSERT_THAT(first, IsOk());
  EXPECT_THAT(AggregatorServer::Start(OneShard(), (*first)->address()),
              StatusIs(absl::StatusCode::kUnavailable));
}

TEST(AggregatorServerTest, ShutdownStopsServingAndIsIdempotent) {
  absl::StatusOr<std::unique_ptr<AggregatorServer>> server =
      AggregatorServer::Start(OneShard(), "127.0.0.1:0");
  ASSERT_THAT(server, IsOk());
  const std::string address = (*server)->address();
  ASSERT_THAT((*server)->Shutdown(absl::Milliseconds(100)), IsOk());
  EXPECT_FALSE(CheckHealth(address, absl::Seconds(1)).value_or(false));
  EXPECT_THAT((*server)->Shutdown(absl::Milliseconds(100)), IsOk());
}

TEST(AggregatorServerTest, AShardWithoutParametersShutsDownWithNoCheckpoint) {
  TempDir dir("aggregator_server_test");
  ASSERT_FALSE(dir.path().empty());
  ServerConfig config = OneShard();
  config.checkpoint_dir = dir.path();
  absl::StatusOr<std::unique_ptr<AggregatorServer>> server =
      AggregatorServer::Start(config, "127.0.0.1:0");
  ASSERT_THAT(server, IsOk());
  // Nothing to keep yet: the final checkpoint is skipped, not failed.
  EXPECT_THAT((*server)->Shutdown(absl::Milliseconds(100)), IsOk());
  EXPECT_THAT(ReadCheckpoint(dir.path(), 0),
              StatusIs(absl::StatusCode::kNotFound));
}

}  // namespace
}  // namespace server
}  // namespace gtopk
