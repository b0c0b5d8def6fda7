#include "common/grpc_edge/grpc_edge.h"

#include <climits>
#include <cstdint>
#include <map>
#include <string>

#include "absl/status/status.h"
#include "gtest/gtest.h"

namespace gtopk {
namespace {

// Every canonical code, by name on both sides: the conversion relies on the
// two enums' numeric values agreeing.
struct CodePair {
  absl::StatusCode absl_code;
  grpc::StatusCode grpc_code;
};
constexpr CodePair kCodes[] = {
    {absl::StatusCode::kCancelled, grpc::StatusCode::CANCELLED},
    {absl::StatusCode::kUnknown, grpc::StatusCode::UNKNOWN},
    {absl::StatusCode::kInvalidArgument, grpc::StatusCode::INVALID_ARGUMENT},
    {absl::StatusCode::kDeadlineExceeded, grpc::StatusCode::DEADLINE_EXCEEDED},
    {absl::StatusCode::kNotFound, grpc::StatusCode::NOT_FOUND},
    {absl::StatusCode::kAlreadyExists, grpc::StatusCode::ALREADY_EXISTS},
    {absl::StatusCode::kPermissionDenied, grpc::StatusCode::PERMISSION_DENIED},
    {absl::StatusCode::kResourceExhausted,
     grpc::StatusCode::RESOURCE_EXHAUSTED},
    {absl::StatusCode::kFailedPrecondition,
     grpc::StatusCode::FAILED_PRECONDITION},
    {absl::StatusCode::kAborted, grpc::StatusCode::ABORTED},
    {absl::StatusCode::kOutOfRange, grpc::StatusCode::OUT_OF_RANGE},
    {absl::StatusCode::kUnimplemented, grpc::StatusCode::UNIMPLEMENTED},
    {absl::StatusCode::kInternal, grpc::StatusCode::INTERNAL},
    {absl::StatusCode::kUnavailable, grpc::StatusCode::UNAVAILABLE},
    {absl::StatusCode::kDataLoss, grpc::StatusCode::DATA_LOSS},
    {absl::StatusCode::kUnauthenticated, grpc::StatusCode::UNAUTHENTICATED},
};

TEST(GrpcEdgeTest, EveryCodeAndMessageRoundTrips) {
  for (const CodePair& c : kCodes) {
    const absl::Status in(c.absl_code, "shard 1 (h:1): why");
    const grpc::Status wire = ToGrpcStatus(in);
    EXPECT_EQ(wire.error_code(), c.grpc_code) << in;
    EXPECT_EQ(wire.error_message(), "shard 1 (h:1): why");
    EXPECT_EQ(FromGrpcStatus(wire), in);
    // And from the wire side first.
    const grpc::Status peer(c.grpc_code, "from a peer");
    EXPECT_EQ(FromGrpcStatus(peer), absl::Status(c.absl_code, "from a peer"));
  }
}

TEST(GrpcEdgeTest, OkIsOkBothWays) {
  EXPECT_TRUE(ToGrpcStatus(absl::OkStatus()).ok());
  EXPECT_TRUE(FromGrpcStatus(grpc::Status::OK).ok());
  EXPECT_EQ(FromGrpcStatus(grpc::Status::OK), absl::OkStatus());
}

TEST(GrpcEdgeTest, LongMessagesAreBoundedOnTheWayOutOnly) {
  const std::string head(3000, 'h');
  const std::string tail(3000, 't');
  const std::string message = head + tail;
  const grpc::Status wire = ToGrpcStatus(absl::AbortedError(message));
  EXPECT_EQ(wire.error_code(), grpc::StatusCode::ABORTED);
  EXPECT_LE(wire.error_message().size(), kMaxStatusMessageBytes);
  EXPECT_EQ(wire.error_message(), BoundedStatusMessage(message));
  EXPECT_EQ(wire.error_message().substr(0, 100), std::string(100, 'h'));
  EXPECT_EQ(wire.error_message().substr(wire.error_message().size() - 256),
            std::string(256, 't'));
  EXPECT_NE(wire.error_message().find(" bytes elided] ... "),
            std::string::npos);
  // A message that fits is unchanged; a peer's message is taken whole.
  const std::string fits(kMaxStatusMessageBytes, 'x');
  EXPECT_EQ(BoundedStatusMessage(fits), fits);
  EXPECT_EQ(FromGrpcStatus(grpc::Status(grpc::StatusCode::INTERNAL, message))
                .message(),
            message);
}

// The arguments read back, without the user agent gRPC adds to every
// ChannelArguments.
std::map<std::string, int> IntArgs(const grpc::ChannelArguments& args) {
  std::map<std::string, int> out;
  const grpc_channel_args c = args.c_channel_args();
  for (size_t i = 0; i < c.num_args; ++i) {
    if (std::string(c.args[i].key) == GRPC_ARG_PRIMARY_USER_AGENT_STRING) {
      continue;
    }
    EXPECT_EQ(c.args[i].type, GRPC_ARG_INTEGER) << c.args[i].key;
    out[c.args[i].key] = c.args[i].value.integer;
  }
  return out;
}

TEST(GrpcEdgeTest, ChannelArgumentsAreTheLimitsAndTheBackoff) {
  const std::map<std::string, int> expected = {
      {GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH, 64 << 20},
      {GRPC_ARG_MAX_SEND_MESSAGE_LENGTH, 64 << 20},
      {GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100},
      {GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 100},
      {GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000},
  };
  EXPECT_EQ(IntArgs(LimitedChannelArguments(uint64_t{64} << 20)), expected);
}

TEST(GrpcEdgeTest, ChannelLimitsClampToInt) {
  for (const uint64_t bytes : {uint64_t{INT_MAX}, uint64_t{INT_MAX} + 1,
                               uint64_t{1} << 40, UINT64_MAX}) {
    const std::map<std::string, int> args =
        IntArgs(LimitedChannelArguments(bytes));
    EXPECT_EQ(args.at(GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH), INT_MAX) << bytes;
    EXPECT_EQ(args.at(GRPC_ARG_MAX_SEND_MESSAGE_LENGTH), INT_MAX) << bytes;
  }
  const std::map<std::string, int> small =
      IntArgs(LimitedChannelArguments(4096));
  EXPECT_EQ(small.at(GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH), 4096);
  EXPECT_EQ(small.at(GRPC_ARG_MAX_SEND_MESSAGE_LENGTH), 4096);
}

TEST(GrpcEdgeTest, ChannelConnectsLazily) {
  // Nothing listens on port 1; the channel is made anyway and stays idle
  // until the first call.
  const auto channel = CreateLimitedChannel("127.0.0.1:1", 4 << 20);
  ASSERT_NE(channel, nullptr);
  EXPECT_EQ(channel->GetState(/*try_to_connect=*/false), GRPC_CHANNEL_IDLE);
}

}  // namespace
}  // namespace gtopk
