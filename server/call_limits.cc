#include "server/call_limits.h"

#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace gtopk {
namespace server {

const char* LimitBoundName(LimitBound bound) {
  switch (bound) {
    case LimitBound::kConcurrentCalls:
      return "concurrent_calls";
    case LimitBound::kCallsPerPeer:
      return "calls_per_peer";
    case LimitBound::kPushPairs:
      return "push_pairs";
    case LimitBound::kDownloadTime:
      return "download_time";
    case LimitBound::kCount:
      break;
  }
  return "unknown";
}

std::string CallPeerHost(absl::string_view grpc_peer) {
  // "ipv4:1.2.3.4:port" and "ipv6:[::1]:port": drop ":port".
  if (absl::StartsWith(grpc_peer, "ipv4:") ||
      absl::StartsWith(grpc_peer, "ipv6:")) {
    const size_t colon = grpc_peer.rfind(':');
    if (colon != absl::string_view::npos && colon > 5) {
      return std::string(grpc_peer.substr(0, colon));
    }
  }
  return std::string(grpc_peer);
}

std::string CallPeerRank(uint32_t rank) { return absl::StrCat("rank ", rank); }

std::string CallPeerShard(uint32_t shard) {
  return absl::StrCat("shard ", shard);
}

CallLimiter::CallLimiter(uint32_t shard_id, CallLimits limits)
    : shard_id_(shard_id), limits_(limits) {}

CallLimiter::Admission& CallLimiter::Admission::operator=(
    Admission&& other) noexcept {
  if (this != &other) {
    if (limiter_ != nullptr) limiter_->Release(peer_);
    limiter_ = std::exchange(other.limiter_, nullptr);
    peer_ = std::move(other.peer_);
  }
  return *this;
}

CallLimiter::Admission::~Admission() {
  if (limiter_ != nullptr) limiter_->Release(peer_);
}

bool IsMemberPeer(absl::string_view peer) {
  return absl::StartsWith(peer, "rank ") || absl::StartsWith(peer, "shard ");
}

absl::StatusOr<CallLimiter::Admission> CallLimiter::Admit(
    absl::string_view peer, absl::string_view method, LimitBound* bound) {
  absl::MutexLock lock(&mu_);
  const bool member = IsMemberPeer(peer);
  if (!member && total_ >= limits_.max_concurrent_calls) {
    if (bound != nullptr) *bound = LimitBound::kConcurrentCalls;
    return absl::ResourceExhaustedError(absl::StrCat(
        "shard ", shard_id_, ": ", method, " from ", peer, " refused: ", total_,
        " calls of unidentified peers are in flight on this server, "
        "the bound "
        "--max-concurrent-calls=",
        limits_.max_concurrent_calls,
        " (docs/resource-limits.md); retry later"));
  }
  auto it = per_peer_.find(peer);
  if (it != per_peer_.end() && it->second >= limits_.max_calls_per_peer) {
    if (bound != nullptr) *bound = LimitBound::kCallsPerPeer;
    return absl::ResourceExhaustedError(absl::StrCat(
        "shard ", shard_id_, ": ", method, " refused: ", it->second,
        " calls from peer ", peer,
        " are in flight, the bound "
        "--max-calls-per-peer=",
        limits_.max_calls_per_peer, " (docs/resource-limits.md); retry later"));
  }
  if (it == per_peer_.end()) it = per_peer_.emplace(std::string(peer), 0).first;
  ++it->second;
  (member ? members_ : total_) += 1;
  return Admission(this, std::string(peer));
}

void CallLimiter::Release(const std::string& peer) {
  absl::MutexLock lock(&mu_);
  (IsMemberPeer(peer) ? members_ : total_) -= 1;
  auto it = per_peer_.find(peer);
  if (it != per_peer_.end() && --it->second <= 0) per_peer_.erase(it);
}

int64_t CallLimiter::in_flight() const {
  absl::MutexLock lock(&mu_);
  return total_ + members_;
}

int64_t CallLimiter::unidentified_in_flight() const {
  absl::MutexLock lock(&mu_);
  return total_;
}

int64_t CallLimiter::in_flight(absl::string_view peer) const {
  absl::MutexLock lock(&mu_);
  const auto it = per_peer_.find(peer);
  return it == per_peer_.end() ? 0 : it->second;
}

}  // namespace server
}  // namespace gtopk
