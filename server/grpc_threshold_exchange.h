// The gRPC edge of the aggregator shard: status conversion, channels with
// explicit message-size limits, and the ThresholdExchange that reaches the
// leader's ThresholdCoordinator over gRPC (server/threshold.h).
#ifndef GTOPK_SERVER_GRPC_THRESHOLD_EXCHANGE_H_
#define GTOPK_SERVER_GRPC_THRESHOLD_EXCHANGE_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "gtopk/v1/gtopk.grpc.pb.h"
#include "gtopk/v1/gtopk.pb.h"
#include "grpcpp/channel.h"
#include "grpcpp/support/status.h"
#include "server/commit.h"
#include "server/threshold.h"

namespace gtopk {
namespace server {

// Longest status message sent over the wire, in bytes. gRPC carries the
// message in the trailers, and a client refuses trailers over its metadata
// limit (8 KiB by default) with RESOURCE_EXHAUSTED -- which a worker does
// not retry -- so a long message (a step timeout naming thousands of
// missing workers, a forwarded AbortStep reason) must not reach the wire
// whole.
inline constexpr size_t kMaxStatusMessageBytes = 2048;

// `message` when it fits kMaxStatusMessageBytes; otherwise its head and
// tail with the number of bytes elided between them (at most
// kMaxStatusMessageBytes in all).
std::string BoundedStatusMessage(absl::string_view message);

// absl::Status -> grpc::Status, the one conversion at the server's edge: the
// same code (the numeric values of both enums agree) and the same message,
// bounded by kMaxStatusMessageBytes (BoundedStatusMessage).
grpc::Status ToGrpcStatus(const absl::Status& status);
// grpc::Status -> absl::Status, same code and message (for calls to peers).
absl::Status FromGrpcStatus(const grpc::Status& status);

// An insecure channel to `address` (host:port) whose send and receive limits
// are raised (or lowered) explicitly to `max_message_bytes` (clamped to
// INT_MAX), so messages above gRPC's 4 MB default pass when configured.
// The channel connects lazily, on the first call, and reconnects after a
// failure every 100 ms growing to at most 1 s (not gRPC's 1 s to 120 s).
std::shared_ptr<grpc::Channel> CreateLimitedChannel(const std::string& address,
                                                    uint64_t max_message_bytes);

// Field-by-field conversions between server/threshold.h and gtopk.v1.
v1::ThresholdRequest ToProto(const ThresholdRequest& request);
ThresholdRequest FromProto(const v1::ThresholdRequest& request);
v1::ThresholdResponse ToProto(const ThresholdResponse& response);
ThresholdResponse FromProto(const v1::ThresholdResponse& response);

// How long past the caller's deadline the gRPC deadline of an
// ExchangeThreshold call lies: the leader stops waiting at the caller's
// deadline (it receives deadline + slack and subtracts the slack), so its own
// DEADLINE_EXCEEDED, which names the missing shards, arrives before the
// transport's anonymous one.
inline constexpr absl::Duration kLeaderDeadlineSlack = absl::Milliseconds(250);

// A ThresholdExchange for shards 1..S-1: one unary ExchangeThreshold call to
// the leader per (step, level), with a gRPC deadline of
// `deadline + kLeaderDeadlineSlack`.
//
// Errors keep the leader's code (ThresholdCoordinator::Submit's codes, or
// UNAVAILABLE when the leader cannot be reached, DEADLINE_EXCEEDED when the
// call timed out) and prefix the message with the leader's address:
// "leader 10.0.0.1:50051 (ExchangeThreshold): ...".
//
// Thread-safety: Exchange may be called concurrently.
class GrpcThresholdExchange final : public ThresholdExchange {
 public:
  // `channel` leads to the leader at `leader_address` (used in messages).
  GrpcThresholdExchange(std::shared_ptr<grpc::Channel> channel,
                        std::string leader_address);

  absl::StatusOr<ThresholdResponse> Exchange(const ThresholdRequest& request,
                                             absl::Time deadline) override;

  // The cluster fingerprint every request carries (ThresholdRequest.
  // cluster_fingerprint); set once the shard knows n. Thread-safe.
  void SetClusterFingerprint(uint64_t fingerprint) {
    fingerprint_.store(fingerprint);
  }

 private:
  const std::string leader_address_;
  const std::unique_ptr<v1::Aggregator::Stub> stub_;
  std::atomic<uint64_t> fingerprint_{0};
};

// A CommitExchange over gRPC to the leader's CommitStep. Thread-safe.
class GrpcCommitExchange final : public CommitExchange {
 public:
  GrpcCommitExchange(std::shared_ptr<grpc::Channel> channel,
                     std::string leader_address);
  absl::Status Vote(int64_t step, uint32_t shard, absl::Time deadline,
                    uint64_t epoch) override;

  // The cluster fingerprint every vote carries (CommitRequest.
  // cluster_fingerprint); set once the shard knows n. Thread-safe.
  void SetClusterFingerprint(uint64_t fingerprint) {
    fingerprint_.store(fingerprint);
  }

 private:
  const std::string leader_address_;
  const std::unique_ptr<v1::Aggregator::Stub> stub_;
  std::atomic<uint64_t> fingerprint_{0};
};

}  // namespace server
}  // namespace gtopk

#endif  // GTOPK_SERVER_GRPC_THRESHOLD_EXCHANGE_H_
