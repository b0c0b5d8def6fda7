// Dash-spelled command-line flags for Abseil. Abseil flag names are C
// identifiers (--shard_id); our documented spelling is --shard-id. Both
// gtopk-server and gtopk-worker pass argv through NormalizeFlagNames before
// absl::ParseCommandLine (cli/command_line.h ParseCommandLine does all of
// this for them).
#ifndef GTOPK_CLI_FLAG_NAMES_H_
#define GTOPK_CLI_FLAG_NAMES_H_

#include <algorithm>
#include <string>
#include <vector>

#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/string_view.h"

namespace gtopk {
namespace cli {

// Returns argv with the name part of every "--name[=value]" / "-name"
// argument (up to a bare "--") rewritten from dashes to underscores; values
// and positional arguments are untouched. argv[0] is kept as is.
inline std::vector<std::string> NormalizeFlagNames(int argc, char** argv) {
  std::vector<std::string> args(argv, argv + argc);
  for (size_t i = 1; i < args.size(); ++i) {
    std::string& a = args[i];
    if (a == "--") break;
    if (a.size() < 3 || a[0] != '-') continue;
    const size_t start = a[1] == '-' ? 2 : 1;
    const size_t end = std::min(a.find('='), a.size());
    for (size_t j = start; j < end; ++j) {
      if (a[j] == '-') a[j] = '_';
    }
  }
  return args;
}

// Every setting of gtopk-server and gtopk-worker is a flag: `remaining`,
// what absl::ParseCommandLine returns (argv[0], then every argument it did
// not take as a flag, including those after a bare "--"), must hold argv[0]
// alone. Otherwise INVALID_ARGUMENT naming the first stray argument: a word
// left over is a setting silently lost, e.g. `--momentum-masking false`,
// which Abseil reads as `--momentum-masking=true` followed by the word
// `false`.
inline absl::Status CheckNoPositionalArguments(
    const std::vector<char*>& remaining) {
  if (remaining.size() <= 1) return absl::OkStatus();
  return absl::InvalidArgumentError(
      std::string("unexpected argument '") + remaining[1] +
      "': every setting is a flag, --name=value (a boolean flag takes its "
      "value after '=': --name=false)");
}

// Makes `--help` list the program's own flags: Abseil's default shows only
// flags defined in a file named after the program, and ours are defined in
// `main_file` (a path suffix of the defining file, e.g. "server/main.cc").
// `usage` is printed first. Call once, before absl::ParseCommandLine; both
// arguments must outlive the program (string literals). Not thread-safe.
inline void SetUpFlagsUsage(const char* usage, const char* main_file) {
  absl::SetProgramUsageMessage(usage);
  absl::FlagsUsageConfig config;
  config.contains_help_flags = [main_file](absl::string_view file) {
    return absl::EndsWith(file, main_file);
  };
  config.contains_helpshort_flags = config.contains_help_flags;
  absl::SetFlagsUsageConfig(config);
}

}  // namespace cli
}  // namespace gtopk

#endif  // GTOPK_CLI_FLAG_NAMES_H_
