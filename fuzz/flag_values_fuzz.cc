// libFuzzer harness: our own parsers of command-line flag values (the
// Abseil flag parsers themselves are Abseil's): dash-spelled flag names
// (cli/flag_names.h NormalizeFlagNames), host:port addresses
// (common/host_port.h ValidateHostPort, MetricsBindAddress), codec and mode
// names (ParseIndexCodec, ParseValueCodec, ParseAggregationMode,
// ParseSelectionKind, ParseMomentumMode), gtopk-server's --density-warmup
// list (server/server_config.h ParseDensityWarmupFlag) and the server's
// configuration check (ValidateServerConfig) on the values they give.
//
// Input: byte 0 picks the parser; the rest is the flag value (for
// NormalizeFlagNames: arguments separated by NUL bytes). Invariants:
//   - errors are INVALID_ARGUMENT with a message naming the flag;
//   - ValidateHostPort OK <=> an independent reading of the syntax (host
//     non-empty, no ':' in it unless bracketed "[...]" with something
//     inside, a decimal port in [min_port, 65535], leading zeros allowed);
//     MetricsBindAddress's result passes ValidateHostPort;
//   - a parsed name prints back (XName) as a name that parses to the same
//     value;
//   - NormalizeFlagNames keeps the count, argv[0], every value after '=',
//     every positional argument and everything after a bare "--", and
//     leaves no '-' in a flag's name part;
//   - a --density-warmup list parses to one number per comma piece, and a
//     server config that ValidateServerConfig accepts with it yields a
//     cluster spec the workers accept (OptimizerFromSpec, then
//     OptimizerRule::Create: same rule on both sides).
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "cli/flag_names.h"
#include "common/cluster_modes.h"
#include "common/cluster_spec/cluster_spec.h"
#include "common/codec.h"
#include "common/host_port.h"
#include "common/optimizer.h"
#include "fuzz/fuzz_check.h"
#include "server/server_config.h"

namespace {

using namespace gtopk;

void CheckError(const absl::Status& s, const char* what) {
  FUZZ_CHECK(absl::IsInvalidArgument(s), "%s: %s", what, s.ToString().c_str());
  FUZZ_CHECK(!s.message().empty(), "%s: error without a message", what);
}

// The documented syntax of ValidateHostPort, read independently.
bool HostPortSyntax(absl::string_view a, uint32_t min_port) {
  const size_t colon = a.rfind(':');
  if (colon == absl::string_view::npos || colon == 0) return false;
  const absl::string_view host = a.substr(0, colon);
  const absl::string_view port = a.substr(colon + 1);
  if (host[0] == '[') {
    if (host.size() < 3 || host.back() != ']') return false;
  } else if (host.find(':') != absl::string_view::npos) {
    return false;
  }
  if (port.empty()) return false;
  uint64_t value = 0;
  for (char c : port) {
    if (c < '0' || c > '9') return false;
    value = value * 10 + static_cast<uint64_t>(c - '0');
    if (value > 65535) return false;
  }
  return value >= min_port;
}

void HostPort(absl::string_view value, uint32_t min_port) {
  const absl::Status s = ValidateHostPort("listen", value, min_port);
  FUZZ_CHECK(s.ok() == HostPortSyntax(value, min_port),
             "ValidateHostPort('%s', %u) = %s", std::string(value).c_str(),
             min_port, s.ToString().c_str());
  if (!s.ok()) {
    CheckError(s, "ValidateHostPort");
    FUZZ_CHECK(absl::StrContains(s.message(), "--listen"), "flag not named");
  }
  absl::StatusOr<std::string> bind = MetricsBindAddress(value, 9400);
  if (bind.ok()) {
    FUZZ_CHECK(ValidateHostPort("metrics-host", *bind, 0).ok(),
               "MetricsBindAddress gave '%s'", bind->c_str());
  } else {
    CheckError(bind.status(), "MetricsBindAddress");
  }
}

template <typename T, typename Parse, typename Name>
void Names(absl::string_view value, Parse parse, Name name) {
  absl::StatusOr<T> parsed = parse(value);
  if (!parsed.ok()) {
    CheckError(parsed.status(), "parse name");
    return;
  }
  absl::StatusOr<T> again = parse(std::string(name(*parsed)));
  FUZZ_CHECK(again.ok() && *again == *parsed, "'%s' does not print back",
             std::string(value).c_str());
}

void Normalize(absl::string_view value) {
  std::vector<std::string> args = absl::StrSplit(value, '\0');
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  const std::vector<std::string> out =
      cli::NormalizeFlagNames(static_cast<int>(argv.size()), argv.data());
  FUZZ_CHECK(out.size() == args.size(), "argument count changed");
  FUZZ_CHECK(out[0] == args[0], "argv[0] changed");
  bool after_dashes = false;
  for (size_t i = 1; i < args.size(); ++i) {
    const std::string& a = args[i];
    const std::string& b = out[i];
    FUZZ_CHECK(a.size() == b.size(), "argument %zu changed length", i);
    if (after_dashes || a.size() < 3 || a[0] != '-') {
      FUZZ_CHECK(a == b, "argument %zu ('%s') changed", i, a.c_str());
      after_dashes = after_dashes || a == "--";
      continue;
    }
    if (a == "--") {
      after_dashes = true;
      continue;
    }
    const size_t start = a[1] == '-' ? 2 : 1;
    const size_t eq = std::min(a.find('='), a.size());
    FUZZ_CHECK(a.substr(0, start) == b.substr(0, start), "prefix changed");
    FUZZ_CHECK(a.substr(eq) == b.substr(eq), "value of '%s' changed",
               a.c_str());
    for (size_t j = start; j < eq; ++j) {
      FUZZ_CHECK(b[j] != '-', "a dash left in '%s'", b.c_str());
      FUZZ_CHECK(b[j] == a[j] || (a[j] == '-' && b[j] == '_'),
                 "name of '%s' changed otherwise", a.c_str());
    }
  }
}

void DensityWarmup(absl::string_view value, uint8_t knobs) {
  absl::StatusOr<std::vector<double>> w = server::ParseDensityWarmupFlag(value);
  if (!w.ok()) {
    CheckError(w.status(), "ParseDensityWarmupFlag");
    FUZZ_CHECK(absl::StrContains(w.status().message(), "--density-warmup"),
               "flag not named");
    return;
  }
  if (value == "dgc") {
    FUZZ_CHECK(*w == DgcDensityWarmup(), "dgc");
  } else if (value.empty()) {
    FUZZ_CHECK(w->empty(), "empty value gave a list");
  } else {
    const size_t pieces =
        static_cast<size_t>(std::count(value.begin(), value.end(), ',')) + 1;
    FUZZ_CHECK(w->size() == pieces, "%zu numbers from %zu pieces", w->size(),
               pieces);
  }
  server::ServerConfig c;
  c.peers = {""};
  c.optimizer.density_warmup = *w;
  c.optimizer.steps_per_epoch = knobs & 3;
  c.optimizer.density = (knobs & 4) ? 0.01 : 1e-300;
  c.mode = static_cast<AggregationMode>((knobs >> 3) % 3);
  c.optimizer.momentum_mode = static_cast<MomentumMode>((knobs >> 5) % 3);
  const absl::Status valid = server::ValidateServerConfig(c);
  if (!valid.ok()) {
    CheckError(valid, "ValidateServerConfig");
    return;
  }
  const v1::ClusterSpec spec = server::ClusterSettingsSpec(c);
  absl::StatusOr<OptimizerOptions> o = OptimizerFromSpec(spec.optimizer());
  FUZZ_CHECK(o.ok(), "the workers cannot read the servers' optimizer: %s",
             o.status().ToString().c_str());
  absl::StatusOr<OptimizerRule> rule = OptimizerRule::Create(*o);
  FUZZ_CHECK(rule.ok(), "the workers refuse the servers' optimizer: %s",
             rule.status().ToString().c_str());
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  fuzz::Bytes in(data, size);
  const uint8_t which = in.U8();
  const uint8_t knobs = in.U8();
  const absl::string_view value = in.Rest();
  switch (which % 8) {
    case 0:
      HostPort(value, 0);
      break;
    case 1:
      HostPort(value, 1);
      break;
    case 2:
      Names<IndexCodec>(value, ParseIndexCodec, IndexCodecName);
      Names<ValueCodec>(value, ParseValueCodec, ValueCodecName);
      break;
    case 3:
      Names<AggregationMode>(value, ParseAggregationMode, AggregationModeName);
      Names<SelectionKind>(value, ParseSelectionKind, SelectionKindName);
      Names<MomentumMode>(value, ParseMomentumMode, MomentumModeName);
      break;
    case 4:
      Normalize(value);
      break;
    default:
      DensityWarmup(value, knobs);
      break;
  }
  return 0;
}
