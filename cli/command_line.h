// The command line of gtopk-server and gtopk-worker: one parse for both
// mains, so that both read it the same way and refuse the same mistakes with
// the same exit code (cli/exit_codes.h kExitUsage).
#ifndef GTOPK_CLI_COMMAND_LINE_H_
#define GTOPK_CLI_COMMAND_LINE_H_

#include <string>
#include <vector>

#include "absl/status/status.h"

namespace gtopk {
namespace cli {

// What a main() tells ParseCommandLine about itself. Both strings must
// outlive the program (string literals).
struct Program {
  // Printed first by --help.
  const char* usage;
  // A path suffix of the file that defines the program's flags, e.g.
  // "server/main.cc": --help lists the flags defined there
  // (SetUpFlagsUsage).
  const char* main_file;
};

// Parses argv into the program's Abseil flags: SetUpFlagsUsage,
// NormalizeFlagNames (dashes or underscores), CheckFlagSyntax,
// absl::ParseCommandLine, CheckNoPositionalArguments. Returns
// INVALID_ARGUMENT naming the flag or argument for an unknown flag, a value
// that does not parse as its flag's type, a missing value or a stray
// argument; the caller prints it and exits kExitUsage. --help, --helpfull,
// --version and the other usage flags are Abseil's: they print and exit
// here, as Abseil does (--help and --helpfull exit 1, --version 0). Flags
// read from a --flagfile (or --fromenv/--tryfromenv) are checked by
// Abseil's parser alone, which exits 1 on a syntax error there. Call once,
// first thing in main(). Not thread-safe.
absl::Status ParseCommandLine(const Program& program, int argc, char** argv);

// The syntax check ParseCommandLine runs before Abseil's parser (which
// would print its error and exit 1 itself): every "--name[=value]" (or
// "-name[=value]", and "--name value" for a flag that is not a boolean) of
// `args` (argv after NormalizeFlagNames; args[0] is the program), up to a
// bare "--", must name a registered flag (or "--noname" for a boolean one)
// or one of Abseil's usage flags (--help, --helpfull, --version, ...) and
// carry a value that parses as that flag's type. Mirrors
// absl::ParseCommandLine's reading of argv, including --undefok; arguments
// that are not flags are left to CheckNoPositionalArguments. When argv holds
// --flagfile, --fromenv or --tryfromenv, unknown names are left to Abseil
// (those files or variables may set --undefok). Sets no flag.
absl::Status CheckFlagSyntax(const std::vector<std::string>& args);

// Whether the flag `name` (underscores, as defined) was set by the command
// line, a --flagfile or --fromenv/--tryfromenv, after ParseCommandLine: a
// value equal to the default counts when given. For flags that apply only
// with another setting (gtopk-server's --bucket-mb outside
// --selection=layerwise). Reads Abseil's own record of the parse
// (absl::flags_internal::WasPresentOnCommandLine; Debian 12's Abseil has
// no public way to ask). Thread-safe after the parse.
bool FlagGiven(const char* name);

}  // namespace cli
}  // namespace gtopk

#endif  // GTOPK_CLI_COMMAND_LINE_H_
