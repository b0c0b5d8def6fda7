// The --tls flag of gtopk-server and gtopk-worker (docs/security.md): it has
// no default. Plaintext runs only when the command line says so
// (--tls=off, which still prints a WARNING at start); a process started
// without --tls exits with the message below, as for any invalid flag
// (kExitUsage, 2, in both: cli/exit_codes.h). Used by the two mains only.
#ifndef GTOPK_CLI_TLS_FLAG_H_
#define GTOPK_CLI_TLS_FLAG_H_

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "common/transport_security/transport_security.h"

namespace gtopk {
namespace cli {

inline constexpr char kTlsFlagRequired[] =
    "--tls is required: --tls=mutual (with --tls-cert/--tls-key/--tls-ca), "
    "--tls=server, or --tls=off for plaintext on a trusted network "
    "(docs/security.md)";

// The value of --tls: INVALID_ARGUMENT with kTlsFlagRequired when it is
// empty (not given), "--tls: unknown TLS mode ..." when it names no mode.
inline absl::StatusOr<TlsMode> ParseTlsFlag(absl::string_view value) {
  if (value.empty()) return absl::InvalidArgumentError(kTlsFlagRequired);
  absl::StatusOr<TlsMode> mode = ParseTlsMode(value);
  if (!mode.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--tls: ", mode.status().message()));
  }
  return mode;
}

}  // namespace cli
}  // namespace gtopk

#endif  // GTOPK_CLI_TLS_FLAG_H_
