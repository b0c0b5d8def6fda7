// HTTP GET /metrics for a process (prometheus-cpp's Exposer), served by
// cpp-httplib (Debian: libcpp-httplib-dev) on its own threads: scrapes never
// run on, or wait for, gRPC threads; they read the metrics' atomics and take
// only the short per-family locks described in common/metrics/metrics.h.
#ifndef GTOPK_COMMON_METRICS_EXPOSER_H_
#define GTOPK_COMMON_METRICS_EXPOSER_H_

#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "common/metrics/metrics.h"

namespace httplib {
class Server;
}

namespace gtopk {
namespace metrics {

class Exposer {
 public:
  // Listens on `bind_address` = "host:port" (port 0 picks a free port; e.g.
  // "0.0.0.0:9400") and serves GET /metrics (text format 0.0.4) from two
  // threads of its own; one request per connection (Connection: close), so
  // scrapers that keep connections open cannot hold those threads; an idle
  // connection holds one for at most 2 s. Errors: INVALID_ARGUMENT for an
  // address that is not host:port with a port in [0, 65535]; UNAVAILABLE when
  // it cannot bind.
  static absl::StatusOr<std::unique_ptr<Exposer>> Start(
      const std::string& bind_address);
  // Stops listening and joins the server thread (in-flight scrapes finish).
  ~Exposer();

  // Adds `collectable` to what GET /metrics serializes (in registration
  // order). Held weakly: a collectable that was destroyed is skipped.
  void RegisterCollectable(const std::weak_ptr<Collectable>& collectable);

  // The bound port (the chosen one when 0 was asked for).
  std::vector<int> GetListeningPorts() const { return {port_}; }
  int port() const { return port_; }

  // What GET /metrics returns now.
  std::string Scrape() const;

 private:
  Exposer();
  std::unique_ptr<httplib::Server> server_;
  std::thread thread_;
  int port_ = 0;
  mutable std::mutex mu_;
  std::vector<std::weak_ptr<Collectable>> collectables_;
};

}  // namespace metrics
}  // namespace gtopk

#endif  // GTOPK_COMMON_METRICS_EXPOSER_H_
