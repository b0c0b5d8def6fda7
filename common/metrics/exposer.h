// Starting prometheus-cpp's HTTP exposer (GET /metrics, served by civetweb
// on threads of its own: scrapes never run on, or wait for, gRPC threads)
// with gtopk's settings and errors as absl::Status: prometheus::Exposer's
// constructor throws when it cannot listen, and an exception must not
// escape a gtopk process's start-up (or the Python binding) as a crash.
#ifndef GTOPK_COMMON_METRICS_EXPOSER_H_
#define GTOPK_COMMON_METRICS_EXPOSER_H_

#include <prometheus/exposer.h>

#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace gtopk {
namespace metrics {

// Threads serving /metrics. A scrape every few seconds needs one; the others
// are there so that connections that send nothing (a port scan, a slow or
// hostile client) cannot queue a scrape behind them for long: civetweb
// hands accepted connections to its threads in order, each idle one holds a
// thread for kExposerRequestTimeoutMs, so N idle connections delay a
// scrape by about N / kExposerThreads * kExposerRequestTimeoutMs (20 idle
// connections: ~1.3 s, inside a Kubernetes probe's 5 s and Prometheus's
// 10 s scrape timeout; with 2 threads and 2 s it was 20 s).
inline constexpr int kExposerThreads = 8;
// How long a connection may take to send its request, and each network
// read or write may take, before it is closed.
inline constexpr int kExposerRequestTimeoutMs = 500;

// Listens on `bind_address` = "host:port" ("0.0.0.0:9400", "[::]:9400",
// "localhost:9400": a host name is resolved once, to its first address (its
// first IPv4 address when the HTTP server has no IPv6, see
// ExposerSupportsIpv6); port 0 picks a free port, see BoundPort) and serves GET
// /metrics in the text format 0.0.4 from kExposerThreads threads of civetweb.
// Every response closes its connection (no keep-alive), and a connection that
// sends no request within kExposerRequestTimeoutMs is closed, so scrapers that
// keep connections open, or idle ones, cannot hold the threads and starve other
// scrapers. Register what to serve with RegisterCollectable (held weakly:
// the caller keeps the shared_ptr; a destroyed one is skipped). Besides
// those, /metrics always carries prometheus-cpp's own exposer_* families
// (docs/metrics.md).
//
// Errors (nothing is thrown): INVALID_ARGUMENT for an address that is not
// host:port with a port in [0, 65535], or an IPv6 address when the HTTP
// server has no IPv6 (saying so); UNAVAILABLE naming the address when
// the host cannot be resolved or the port cannot be bound (in use, or not an
// address of this host). Thread-safe. The returned exposer stops listening
// and joins its threads when destroyed.
absl::StatusOr<std::unique_ptr<prometheus::Exposer>> StartExposer(
    const std::string& bind_address);

// The port `exposer` listens on (the chosen one when 0 was asked for).
int BoundPort(prometheus::Exposer& exposer);

// Whether the HTTP server under prometheus-cpp's exposer (civetweb) was
// built with IPv6. Debian 12's civetweb 1.15 is not: an IPv6 metrics
// address is then refused with INVALID_ARGUMENT (gRPC ports are unaffected).
bool ExposerSupportsIpv6();

}  // namespace metrics
}  // namespace gtopk

#endif  // GTOPK_COMMON_METRICS_EXPOSER_H_
