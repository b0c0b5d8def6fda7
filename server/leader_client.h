// The shard's gRPC clients of the leader: the ThresholdExchange that reaches
// the leader's ThresholdCoordinator over gRPC (server/threshold.h) and the
// CommitVoter that reaches its CommitStep (server/commit.h). Status
// conversion and channels are common/grpc_edge/grpc_edge.h.
#ifndef GTOPK_SERVER_LEADER_CLIENT_H_
#define GTOPK_SERVER_LEADER_CLIENT_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "grpcpp/channel.h"
#include "grpcpp/support/status.h"
#include "gtopk/v1/gtopk.grpc.pb.h"
#include "gtopk/v1/gtopk.pb.h"
#include "server/commit.h"
#include "server/threshold.h"

namespace gtopk {
namespace server {

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

// One call from this shard to another (the leader's ExchangeThreshold,
// CommitStep, CheckMember, AbortStep; a peer's GetShardState,
// RollbackShard), repeated while the callee's admission refuses it:
// `call` makes one attempt (with its own grpc::ClientContext) and returns
// its status. RESOURCE_EXHAUSTED is what a server answers before any of a
// call's work (its --max-concurrent-calls / --max-calls-per-peer
// admission, docs/resource-limits.md; gRPC's message-size check), so the
// attempt is repeated after 5 ms, doubling to 100 ms, while the next try
// starts before `deadline`. A flood that crowds this shard's calls out
// (another client claiming this shard's identity on a --tls=off cluster)
// then delays the step instead of ending it with a code the workers do not
// retry. Returns the first status that is not RESOURCE_EXHAUSTED; a refusal
// that lasts to the deadline becomes UNAVAILABLE ("... refused until the
// deadline (N tries): <the callee's message>"), which the workers retry
// after Recover. `rpc` names the call in that message. Blocks up to the
// deadline (plus the last attempt's own gRPC deadline); thread-safe when
// `call` is.
grpc::Status CallUntilAdmitted(absl::Time deadline, const char* rpc,
                               const std::function<grpc::Status()>& call);

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

// A CommitVoter over gRPC to the leader's CommitStep. Thread-safe.
class GrpcCommitVoter final : public CommitVoter {
 public:
  GrpcCommitVoter(std::shared_ptr<grpc::Channel> channel,
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

#endif  // GTOPK_SERVER_LEADER_CLIENT_H_
