// A running gtopk-server shard: AggregatorServer, the AggregatorService
// (server/service.h) inside a grpc::Server with raised message limits and
// grpc.health.v1, its graceful shutdown (drain, grace, final checkpoint);
// and CheckHealth, the client of grpc.health.v1 that gtopk-server's
// --health-check and the tests use.
#ifndef GTOPK_SERVER_AGGREGATOR_SERVER_H_
#define GTOPK_SERVER_AGGREGATOR_SERVER_H_

#include <memory>
#include <string>
#include <thread>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "grpcpp/generic/async_generic_service.h"
#include "grpcpp/server.h"
#include "server/server_config.h"
#include "server/service.h"

namespace gtopk {
namespace server {

// A running gtopk-server: the service plus a grpc::Server with the message
// limits raised to max_message_bytes and grpc.health.v1 enabled (SERVING
// once started).
class AggregatorServer {
 public:
  // Listens on `listen_address` (host:port; port 0 picks a free port) with
  // config.security's server credentials (plaintext when null). With a
  // non-empty `health_listen_address`, also serves grpc.health.v1 -- and
  // nothing else -- in plaintext there (--health-listen: probes that cannot
  // present a client certificate; docs/security.md); its statuses follow
  // the main port's.
  // Errors: Create's, UNAVAILABLE when an address cannot be bound.
  static absl::StatusOr<std::unique_ptr<AggregatorServer>> Start(
      ServerConfig config, const std::string& listen_address,
      const std::string& health_listen_address = "");
  ~AggregatorServer();  // Shutdown(0) unless already shut down

  // "host:port" with the port actually bound.
  const std::string& address() const { return address_; }
  int port() const { return port_; }
  // The health-only port (0 without a health listen address).
  int health_port() const { return health_port_; }
  AggregatorService* service() { return service_.get(); }

  // Graceful shutdown: health NOT_SERVING; stop accepting calls and let
  // running ones finish until now + grace; then fail what still waits
  // (AggregatorService::BeginShutdown) and cancel the rest; finally write
  // the checkpoint (after the last applied step). Returns the checkpoint's
  // status. Idempotent. `write_checkpoint` = false skips the checkpoint
  // (tests use it to stand for a crash).
  // With `drain` > 0, first a drain (AggregatorService::BeginDrain): health
  // is NOT_SERVING but the server keeps serving until no round is open on
  // this shard and the workers closed their step streams, or `drain` has
  // passed, whichever is first; pushes for a new step get UNAVAILABLE
  // "shard s is shutting down".
  absl::Status Shutdown(absl::Duration grace, bool write_checkpoint = true,
                        absl::Duration drain = absl::ZeroDuration());

 private:
  AggregatorServer() = default;
  std::unique_ptr<AggregatorService> service_;
  std::unique_ptr<grpc::Server> server_;
  // Answers UNIMPLEMENTED for everything but health on the health port;
  // declared first so that it outlives health_server_.
  std::unique_ptr<grpc::CallbackGenericService> health_fallback_;
  // Plaintext grpc.health.v1 only (--health-listen); null when not asked.
  std::unique_ptr<grpc::Server> health_server_;
  int health_port_ = 0;
  std::string address_;
  int port_ = 0;
  bool shut_down_ = false;
  // Gives freed heap memory back to the system every kTrimInterval
  // (malloc_trim): gRPC 1.51 buffers a request's whole declared length
  // before any limit or handler refuses it, so a flood of big refused
  // messages used to leave gigabytes resident after it ended
  // (docs/resource-limits.md, "Big messages"). Stopped by Shutdown.
  void TrimLoop();
  void StopTrimmer();
  absl::Mutex trim_mu_;
  bool trim_stop_ ABSL_GUARDED_BY(trim_mu_) = false;
  std::thread trimmer_;
};

// How often a running server returns freed heap memory to the system.
inline constexpr absl::Duration kTrimInterval = absl::Seconds(5);

// grpc.health.v1.Health/Check for service "" at `address`: true when the
// server answers SERVING, false for any other serving status. Errors: the
// call's status (e.g. UNAVAILABLE, DEADLINE_EXCEEDED after `timeout`),
// INTERNAL for an unparseable response. Uses a generic stub, so no health
// proto is needed.
// `service` names another health service (e.g. kCheckpointHealthService;
// INVALID_ARGUMENT when 128 bytes or longer); an unknown one is NOT_FOUND.
// `security`: the credentials to present (e.g. mutual TLS on the main
// port); null: plaintext (the --health-listen port, or a plaintext server).
absl::StatusOr<bool> CheckHealth(
    const std::string& address, absl::Duration timeout,
    const std::string& service = "",
    const std::shared_ptr<const TransportSecurity>& security = nullptr);

// Why the shard at `address` is not serving, as far as it says: its answer
// to GetClusterSpec (within 5 s), e.g. FAILED_PRECONDITION "shard 1 is
// configured differently from the leader ...: --lr is 0.2 here but 0.1 on
// the leader"; OK when that call succeeds (no reason given). Blocking.
absl::Status ExplainNotServing(
    const std::string& address,
    const std::shared_ptr<const TransportSecurity>& security = nullptr);

}  // namespace server
}  // namespace gtopk

#endif  // GTOPK_SERVER_AGGREGATOR_SERVER_H_
