// Who may call what on a shard (docs/security.md): AccessControl
// authenticates the caller of every gtopk.v1.Aggregator RPC -- by its client
// certificate under mutual TLS, by its token (call metadata
// "authorization: Bearer <token>") when token files are configured -- and
// authorises it: workers act only as the rank their certificate names (when
// it names one), only shards call the shard RPCs. grpc.health.v1 is not an
// Aggregator RPC and is never checked here.
#ifndef GTOPK_SERVER_ACCESS_H_
#define GTOPK_SERVER_ACCESS_H_

#include <prometheus/counter.h>
#include <prometheus/registry.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/transport_security/transport_security.h"
#include "grpcpp/server_context.h"

namespace gtopk {
namespace server {

// An authenticated caller.
struct Caller {
  bool shard = false;   // may call the shard RPCs
  bool worker = false;  // may call the worker RPCs
  // The rank a worker certificate (CN gtopk-worker-<r>) restricts it to.
  std::optional<uint32_t> rank;
  // The shard a shard certificate (CN gtopk-shard-<s>) names.
  std::optional<uint32_t> shard_id;
  // For messages: "certificate CN=...", "the workers' token", "anyone".
  std::string name;
};

// Thread-safety: immutable after construction except the counters
// (lock-free); every method may be called from any handler thread.
class AccessControl {
 public:
  // `security` may be null (plaintext, no tokens): everyone is let in, as
  // before security existed. Registers gtopk_server_auth_failures_total in
  // `registry` (which must outlive this object).
  AccessControl(std::shared_ptr<const TransportSecurity> security,
                prometheus::Registry& registry);

  // The caller of `context`: with mutual TLS its certificate's CN must name
  // a role (kShardCnPrefix<s>, kWorkerCn, kWorkerCn-<r>), else
  // PERMISSION_DENIED; with tokens the call must carry the workers' or the
  // shards' token, else UNAUTHENTICATED (missing or wrong, the token never
  // in the message). Under both, the token must be the one of the
  // certificate's role. Counted in gtopk_server_auth_failures_total.
  absl::StatusOr<Caller> Authenticate(const grpc::ServerContext& context) const;

  // A worker RPC `rpc` acting for `rank` (nullopt: none named, e.g.
  // DownloadParams). Authenticate's errors; PERMISSION_DENIED for a caller
  // that is not a worker (and, when `shard_ok`, not a shard either), or a
  // worker certificate restricted to another rank. On success the caller
  // (PushPull checks each push's rank with CheckRank).
  absl::StatusOr<Caller> AllowWorker(const grpc::ServerContext& context,
                                     const char* rpc,
                                     std::optional<int64_t> rank,
                                     bool shard_ok = false) const;
  // PERMISSION_DENIED when `caller` is restricted to a rank other than
  // `rank` (counted). OK otherwise.
  absl::Status CheckRank(const Caller& caller, const char* rpc,
                         int64_t rank) const;

  // A shard RPC: Authenticate's errors; PERMISSION_DENIED for a caller that
  // is not a shard, or whose certificate names a shard other than
  // `shard_id` (when given).
  absl::Status AllowShard(const grpc::ServerContext& context, const char* rpc,
                          std::optional<uint32_t> shard_id) const;

 private:
  absl::Status Denied(std::string message) const;
  std::shared_ptr<const TransportSecurity> security_;
  prometheus::Counter* unauthenticated_;
  prometheus::Counter* permission_denied_;
};

}  // namespace server
}  // namespace gtopk

#endif  // GTOPK_SERVER_ACCESS_H_
