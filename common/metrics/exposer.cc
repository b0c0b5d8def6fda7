#include "common/metrics/exposer.h"

#include <httplib.h>

#include <chrono>
#include <cstdint>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/metrics/text_serializer.h"

namespace gtopk {
namespace metrics {

Exposer::Exposer() : server_(std::make_unique<httplib::Server>()) {}

absl::StatusOr<std::unique_ptr<Exposer>> Exposer::Start(
    const std::string& bind_address) {
  const size_t colon = bind_address.rfind(':');
  uint32_t port = 0;
  if (colon == std::string::npos || colon == 0 ||
      !absl::SimpleAtoi(absl::string_view(bind_address).substr(colon + 1),
                        &port) ||
      port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat(
        "metrics address must be host:port with a port in [0, 65535], got '",
        bind_address, "'"));
  }
  std::string host = bind_address.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  std::unique_ptr<Exposer> exposer(new Exposer());
  httplib::Server& server = *exposer->server_;
  // Two threads are plenty for a scrape every few seconds.
  server.new_task_queue = [] { return new httplib::ThreadPool(2); };
  // SO_REUSEADDR only: httplib's default also sets SO_REUSEPORT, which would
  // let a second process silently share the port instead of failing.
  server.set_socket_options([](socket_t sock) {
    int yes = 1;
    setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
  });
  server.set_read_timeout(5, 0);
  server.set_write_timeout(5, 0);
  // One request per connection, and at most 2 s for an idle connection's
  // request: with httplib's defaults (100 requests, 5 s keep-alive) every
  // scraper that keeps its connection open (Prometheus does) holds one of
  // the two threads for 5 s after each scrape, so two of them made any
  // other scrape wait 5 s, past a 1 s scrape_timeout.
  server.set_keep_alive_max_count(1);
  server.set_keep_alive_timeout(2);
  Exposer* self = exposer.get();
  server.Get("/metrics",
             [self](const httplib::Request&, httplib::Response& response) {
               response.set_content(self->Scrape(), kTextContentType);
             });
  if (port == 0) {
    const int bound = server.bind_to_any_port(host);
    if (bound <= 0) {
      return absl::UnavailableError(
          absl::StrCat("cannot listen on ", bind_address, " for metrics"));
    }
    exposer->port_ = bound;
  } else {
    if (!server.bind_to_port(host, static_cast<int>(port))) {
      return absl::UnavailableError(absl::StrCat(
          "cannot listen on ", bind_address,
          " for metrics (port in use, or not an address of this host)"));
    }
    exposer->port_ = static_cast<int>(port);
  }
  exposer->thread_ = std::thread([self] { self->server_->listen_after_bind(); });
  // stop() is a no-op until the loop runs: wait for it (bounded), so that
  // the destructor always ends the thread.
  for (int i = 0; i < 5000 && !server.is_running(); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return exposer;
}

Exposer::~Exposer() {
  server_->stop();
  if (thread_.joinable()) thread_.join();
}

void Exposer::RegisterCollectable(
    const std::weak_ptr<Collectable>& collectable) {
  std::lock_guard<std::mutex> lock(mu_);
  collectables_.push_back(collectable);
}

std::string Exposer::Scrape() const {
  std::vector<std::shared_ptr<Collectable>> live;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& weak : collectables_) {
      if (auto c = weak.lock()) live.push_back(std::move(c));
    }
  }
  std::vector<MetricFamily> families;
  for (const auto& c : live) {
    for (MetricFamily& f : c->Collect()) families.push_back(std::move(f));
  }
  return SerializeText(families);
}

}  // namespace metrics
}  // namespace gtopk
