#include "common/metrics/exposer.h"

#include <arpa/inet.h>
#include <civetweb.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <cstdint>
#include <exception>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace gtopk {
namespace metrics {
namespace {

// civetweb's feature bit for IPv6 (civetweb.h, mg_check_feature).
constexpr unsigned kCivetwebIpv6 = 8;

bool IsIpv6Literal(const std::string& host) {
  in6_addr v6{};
  return inet_pton(AF_INET6, host.c_str(), &v6) == 1;
}

// `host` as a numeric address civetweb's listening_ports accepts ("1.2.3.4"
// or "[::1]"); host names resolved with getaddrinfo (IPv4 only when
// `ipv6` is false). Empty on failure.
std::string NumericHost(const std::string& host, bool ipv6) {
  in_addr v4{};
  if (inet_pton(AF_INET, host.c_str(), &v4) == 1) return host;
  if (IsIpv6Literal(host)) return "[" + host + "]";
  addrinfo hints{};
  hints.ai_family = ipv6 ? AF_UNSPEC : AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (getaddrinfo(host.c_str(), nullptr, &hints, &found) != 0 ||
      found == nullptr) {
    return "";
  }
  char text[INET6_ADDRSTRLEN] = {};
  std::string out;
  if (found->ai_family == AF_INET &&
      inet_ntop(AF_INET,
                &reinterpret_cast<sockaddr_in*>(found->ai_addr)->sin_addr, text,
                sizeof text) != nullptr) {
    out = text;
  } else if (found->ai_family == AF_INET6 &&
             inet_ntop(
                 AF_INET6,
                 &reinterpret_cast<sockaddr_in6*>(found->ai_addr)->sin6_addr,
                 text, sizeof text) != nullptr) {
    out = absl::StrCat("[", text, "]");
  }
  freeaddrinfo(found);
  return out;
}

}  // namespace

absl::StatusOr<std::unique_ptr<prometheus::Exposer>> StartExposer(
    const std::string& bind_address) {
  const size_t colon = bind_address.rfind(':');
  const absl::string_view digits =
      colon == std::string::npos
          ? absl::string_view()
          : absl::string_view(bind_address).substr(colon + 1);
  uint32_t port = 0;
  if (colon == std::string::npos || colon == 0 || digits.empty() ||
      digits.find_first_not_of("0123456789") != absl::string_view::npos ||
      !absl::SimpleAtoi(digits, &port) || port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat(
        "metrics address must be host:port with a port in [0, 65535], got '",
        bind_address, "'"));
  }
  std::string host = bind_address.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  const bool ipv6 = ExposerSupportsIpv6();
  if (!ipv6 && IsIpv6Literal(host)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "metrics address '", bind_address,
        "' is IPv6, but the metrics HTTP server (civetweb, as Debian 12 "
        "builds it) has no IPv6 support: give an IPv4 address (0.0.0.0 for "
        "every interface) or a host name with an IPv4 address"));
  }
  const std::string numeric = NumericHost(host, ipv6);
  if (numeric.empty()) {
    return absl::UnavailableError(
        absl::StrCat("cannot listen on ", bind_address,
                     " for metrics: cannot resolve '", host, "'"));
  }
  // civetweb's options (prometheus-cpp passes them through). Keep-alive off:
  // civetweb then answers every request with "Connection: close", so a
  // scraper that keeps its connection open (Prometheus does; an HA pair is
  // two of them) never holds one of the two threads between scrapes.
  std::vector<std::string> options = {
      "listening_ports",    absl::StrCat(numeric, ":", port),
      "num_threads",        absl::StrCat(kExposerThreads),
      "enable_keep_alive",  "no",
      "request_timeout_ms", absl::StrCat(kExposerRequestTimeoutMs),
  };
  try {
    return std::make_unique<prometheus::Exposer>(std::move(options));
  } catch (const std::exception& e) {
    // CivetServer throws CivetException ("null context when constructing
    // CivetServer. Possible problem binding to port.").
    return absl::UnavailableError(absl::StrCat(
        "cannot listen on ", bind_address,
        " for metrics (port in use, or not an address of this host): ",
        e.what()));
  }
}

bool ExposerSupportsIpv6() { return mg_check_feature(kCivetwebIpv6) != 0; }

int BoundPort(prometheus::Exposer& exposer) {
  const std::vector<int> ports = exposer.GetListeningPorts();
  return ports.empty() ? 0 : ports.front();
}

}  // namespace metrics
}  // namespace gtopk
