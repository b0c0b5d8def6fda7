// Dash-spelled command-line flags for Abseil. Abseil flag names are C
// identifiers (--shard_id); our documented spelling is --shard-id. Both
// gtopk-server and gtopk-worker pass argv through NormalizeFlagNames before
// absl::ParseCommandLine.
#ifndef GTOPK_COMMON_FLAG_NAMES_H_
#define GTOPK_COMMON_FLAG_NAMES_H_

#include <algorithm>
#include <string>
#include <vector>

namespace gtopk {

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

}  // namespace gtopk

#endif  // GTOPK_COMMON_FLAG_NAMES_H_
