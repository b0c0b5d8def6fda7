// Admission control for one shard's RPCs (issue 19, "Resource bounds";
// docs/resource-limits.md): how many calls, streams included, may be in
// flight on the server at once, and how many from one peer, so that one
// misbehaving or hostile client cannot take the shard down while the
// legitimate workers keep training.
#ifndef GTOPK_SERVER_CALL_LIMITS_H_
#define GTOPK_SERVER_CALL_LIMITS_H_

#include <cstdint>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"

namespace gtopk {
namespace server {

// The bounds, in calls; resolved from ServerConfig by EffectiveCallLimits
// (server/server_config.h), where 0 means "computed from P and S".
struct CallLimits {
  // Calls of the gtopk.v1.Aggregator service from unidentified peers (client
  // hosts, IsMemberPeer false) in flight on the server, streams included
  // (--max-concurrent-calls). >= 1. The members' calls (a rank with its
  // member token, a shard) are not counted against it: anonymous calls from
  // any number of hosts cannot crowd out a step's streams and votes (issue
  // 42); each member identity has its own --max-calls-per-peer.
  int64_t max_concurrent_calls = 1;
  // Calls in flight from one peer (--max-calls-per-peer). >= 1. A peer is
  // the identity a call proves or claims (see CallPeer* below), else the
  // client host.
  int64_t max_calls_per_peer = 1;
};

// Which bound refused a call, or ended one (label `bound` of
// gtopk_server_limit_rejections_total).
enum class LimitBound {
  kConcurrentCalls,  // "concurrent_calls": --max-concurrent-calls
  kCallsPerPeer,     // "calls_per_peer": --max-calls-per-peer
  kPushPairs,        // "push_pairs": more pairs than k allows (--density)
  kDownloadTime,     // "download_time": a DownloadParams stream cancelled
                     // after its client took no chunk for too long
                     // (DownloadParamsLimits, server/service.h)
  kCount
};
const char* LimitBoundName(LimitBound bound);

// The peer key of an unidentified call from `grpc_peer` (grpc's
// ServerContext::peer(), e.g. "ipv4:127.0.0.1:40512", "ipv6:[::1]:40512"):
// the client host without the port ("ipv4:127.0.0.1"), so that one host's
// many connections count as one peer. Other forms (unix sockets) are kept
// whole. Pure.
std::string CallPeerHost(absl::string_view grpc_peer);
// The peer key of a call that carries rank `rank`'s current member token.
std::string CallPeerRank(uint32_t rank);
// The peer key of a shard's call to the leader (or the leader's to a shard).
std::string CallPeerShard(uint32_t shard);

// Whether `peer` is a member identity (CallPeerRank, CallPeerShard) rather
// than a client host (CallPeerHost). Pure.
bool IsMemberPeer(absl::string_view peer);

// Counts the calls in flight, in all and per peer, and refuses a call over
// either bound with RESOURCE_EXHAUSTED (a member's call: only over its
// peer's bound) (nothing else changes: the refused
// call has not started). The count is released when the Admission returned
// by Admit is destroyed, i.e. when the handler returns.
//
// Thread-safety: thread-safe; Admit and the release take one short mutex.
// Memory: one map entry per peer with calls in flight (at most
// max_concurrent_calls host entries, plus one per rank and shard).
class CallLimiter {
 public:
  // `shard_id` only names the shard in messages. Precondition: both limits
  // >= 1 (ValidateServerConfig).
  CallLimiter(uint32_t shard_id, CallLimits limits);
  CallLimiter(const CallLimiter&) = delete;
  CallLimiter& operator=(const CallLimiter&) = delete;

  // An admitted call; releases its slot when destroyed. Movable.
  class Admission {
   public:
    Admission() = default;
    Admission(Admission&& other) noexcept { *this = std::move(other); }
    Admission& operator=(Admission&& other) noexcept;
    ~Admission();

   private:
    friend class CallLimiter;
    Admission(CallLimiter* limiter, std::string peer)
        : limiter_(limiter), peer_(std::move(peer)) {}
    CallLimiter* limiter_ = nullptr;
    std::string peer_;
  };

  // Admits one call of `method` from `peer`, or RESOURCE_EXHAUSTED naming
  // the bound and its flag, e.g. "shard 0: Join refused: 44 calls from peer
  // ipv4:127.0.0.1 are in flight, the bound --max-calls-per-peer=44 ...".
  // `*bound`, when not null, is set to the bound that refused. Never
  // blocks.
  absl::StatusOr<Admission> Admit(absl::string_view peer,
                                  absl::string_view method,
                                  LimitBound* bound = nullptr);

  const CallLimits& limits() const { return limits_; }
  // Calls in flight in all (members' included), of unidentified peers (what
  // --max-concurrent-calls bounds), and from `peer` (for tests and metrics).
  int64_t in_flight() const;
  int64_t unidentified_in_flight() const;
  int64_t in_flight(absl::string_view peer) const;

 private:
  void Release(const std::string& peer);

  const uint32_t shard_id_;
  const CallLimits limits_;
  mutable absl::Mutex mu_;
  int64_t total_ ABSL_GUARDED_BY(mu_) = 0;    // unidentified peers' calls
  int64_t members_ ABSL_GUARDED_BY(mu_) = 0;  // member identities' calls
  absl::flat_hash_map<std::string, int64_t> per_peer_ ABSL_GUARDED_BY(mu_);
};

}  // namespace server
}  // namespace gtopk

#endif  // GTOPK_SERVER_CALL_LIMITS_H_
