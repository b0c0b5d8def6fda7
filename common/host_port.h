// Syntax check of the host:port addresses given in flags (gtopk-server
// --listen, --peers, --health-check; gtopk-worker --server), so that a typo
// fails at start with the flag named instead of a connection that waits out
// its deadline.
#ifndef GTOPK_COMMON_HOST_PORT_H_
#define GTOPK_COMMON_HOST_PORT_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace gtopk {

// OK when `address` is "host:port": a non-empty host (a name, an IPv4
// address, or an IPv6 address in brackets, "[::1]") and a decimal port in
// [min_port, 65535] (min_port 0 where 0 means "pick a free port", as for a
// listen address; 1 for an address to dial). Only the syntax is checked, not
// whether the host resolves. Otherwise INVALID_ARGUMENT
// "--<flag> must be host:port with a port in [min_port, 65535], got '...'".
inline absl::Status ValidateHostPort(absl::string_view flag,
                                     absl::string_view address,
                                     uint32_t min_port) {
  const size_t colon = address.rfind(':');
  absl::string_view host =
      colon == absl::string_view::npos ? address : address.substr(0, colon);
  bool ok = colon != absl::string_view::npos && !host.empty();
  if (ok && host.front() == '[') {
    ok = host.size() > 2 && host.back() == ']';
  } else if (ok) {
    ok = host.find(':') == absl::string_view::npos;  // IPv6 needs brackets
  }
  uint32_t port = 0;
  const absl::string_view digits =
      ok ? address.substr(colon + 1) : absl::string_view();
  ok = ok && !digits.empty() &&
       digits.find_first_not_of("0123456789") == absl::string_view::npos &&
       absl::SimpleAtoi(digits, &port) && port >= min_port && port <= 65535;
  if (ok) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("--", flag, " must be host:port with a port in [", min_port,
                   ", 65535], got '", address, "'"));
}

// The "host:port" a metrics exposer binds for --metrics-host and `port`:
// an IPv6 address is bracketed ("::" -> "[::]:9400"). INVALID_ARGUMENT
// naming --metrics-host when the host is empty or malformed.
inline absl::StatusOr<std::string> MetricsBindAddress(absl::string_view host,
                                                      int port) {
  std::string address(host);
  if (!host.empty() && host.front() != '[' &&
      host.find(':') != absl::string_view::npos) {
    address = absl::StrCat("[", host, "]");
  }
  absl::StrAppend(&address, ":", port);
  if (!ValidateHostPort("metrics-host", address, 0).ok()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--metrics-host must be a host name or an IPv4/IPv6 address "
        "(e.g. 0.0.0.0, 127.0.0.1, ::), got '",
        host, "'"));
  }
  return address;
}

}  // namespace gtopk

#endif  // GTOPK_COMMON_HOST_PORT_H_
