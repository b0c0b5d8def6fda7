#include "cli/command_line.h"

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/flags/commandlineflag.h"
#include "absl/flags/internal/parse.h"  // WasPresentOnCommandLine (FlagGiven)
#include "absl/flags/marshalling.h"
#include "absl/flags/parse.h"
#include "absl/flags/reflection.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"
#include "absl/time/time.h"
#include "cli/flag_names.h"

namespace gtopk {
namespace cli {
namespace {

// A flag's name as the documentation spells it: "--recovery-timeout".
std::string Dashed(absl::string_view name) {
  std::string dashed = "--";
  for (const char c : name) dashed.push_back(c == '_' ? '-' : c);
  return dashed;
}

// When `flag` is of type T: true, and in `problem` why `value` does not
// parse as a T ("" when it does). Parses into a copy: sets no flag.
template <typename T>
bool CheckAs(const absl::CommandLineFlag& flag, absl::string_view value,
             const char* expected, std::string* problem) {
  if (!flag.IsOfType<T>()) return false;
  T parsed{};
  std::string error;
  if (!absl::ParseFlag(value, &parsed, &error)) {
    *problem = absl::StrCat("not ", expected,
                            error.empty() ? "" : absl::StrCat(": ", error));
  }
  return true;
}

// Why `value` is not a value of `flag`'s type; "" when it is, or when the
// type is none of those below (Abseil's parser then checks it; every flag
// of gtopk-server and gtopk-worker has one of them).
std::string ValueProblem(const absl::CommandLineFlag& flag,
                         absl::string_view value) {
  std::string problem;
  constexpr char kDuration[] =
      "a duration (a number and a unit: 30s, 500ms, 2m, 1h)";
  (void)(CheckAs<bool>(flag, value, "true or false", &problem) ||
         CheckAs<int32_t>(flag, value, "a 32-bit integer", &problem) ||
         CheckAs<uint32_t>(flag, value, "a 32-bit integer >= 0", &problem) ||
         CheckAs<int64_t>(flag, value, "a 64-bit integer", &problem) ||
         CheckAs<uint64_t>(flag, value, "a 64-bit integer >= 0", &problem) ||
         CheckAs<double>(flag, value, "a number", &problem) ||
         CheckAs<float>(flag, value, "a number", &problem) ||
         CheckAs<std::string>(flag, value, "a string", &problem) ||
         CheckAs<std::vector<std::string>>(flag, value, "a comma list",
                                           &problem) ||
         CheckAs<absl::Duration>(flag, value, kDuration, &problem) ||
         CheckAs<std::optional<absl::Duration>>(
             flag, value, "empty (unset) or a duration (30s, 500ms, 2m, 1h)",
             &problem));
  return problem;
}

// Abseil's usage flags (--help, --helpfull, ...): in Abseil 20220623 they
// are not registered flags but names its parser recognises
// (flags_internal::DeduceUsageFlags): "help" (with "=substring": the flags
// matching it), "helpfull", "helpshort", "helppackage", "helpmatch=s",
// "helpon=s", "version", "only_check_args". Any value after '='; never the
// next argument.
bool IsUsageFlag(absl::string_view name) {
  return name == "help" || name == "helpfull" || name == "helpshort" ||
         name == "helppackage" || name == "helpmatch" || name == "helpon" ||
         name == "version" || name == "only_check_args";
}

// An argument's place and the mistake in it.
struct Problem {
  size_t index;
  std::string message;
};

}  // namespace

bool FlagGiven(const char* name) {
  return absl::flags_internal::WasPresentOnCommandLine(name);
}

absl::Status ParseCommandLine(const Program& program, int argc, char** argv) {
  SetUpFlagsUsage(program.usage, program.main_file);
  std::vector<std::string> args = NormalizeFlagNames(argc, argv);
  if (absl::Status syntax = CheckFlagSyntax(args); !syntax.ok()) {
    return syntax;
  }
  std::vector<char*> arg_pointers;
  for (std::string& a : args) arg_pointers.push_back(a.data());
  return CheckNoPositionalArguments(absl::ParseCommandLine(
      static_cast<int>(arg_pointers.size()), arg_pointers.data()));
}

// As absl::ParseCommandLine (Abseil 20220623, absl/flags/parse.cc) reads
// argv: "-" alone and words not starting with '-' are positional; one or two
// dashes, then the name up to '='; an empty name ("--") ends the flags; a
// name not found is looked up again without a "no" prefix (a negated
// boolean); a flag that is not a boolean takes the next argument as its
// value when it has no '='; a name still not found may be one of Abseil's
// usage flags (IsUsageFlag). Unknown names are errors only at the end, after
// --undefok is known.
absl::Status CheckFlagSyntax(const std::vector<std::string>& args) {
  std::vector<Problem> problems;
  std::vector<std::pair<size_t, std::string>> unknown;  // (index, name)
  std::vector<std::string> undefok;
  bool flags_from_elsewhere = false;  // --flagfile, --fromenv, --tryfromenv
  for (size_t i = 1; i < args.size(); ++i) {
    absl::string_view arg = args[i];
    if (!absl::ConsumePrefix(&arg, "-") || arg.empty()) continue;
    absl::ConsumePrefix(&arg, "-");
    const size_t equals = arg.find('=');
    const absl::string_view name = arg.substr(0, equals);
    if (name.empty()) break;
    const bool has_value = equals != absl::string_view::npos;
    absl::string_view value = has_value ? arg.substr(equals + 1) : "";

    const absl::CommandLineFlag* flag = absl::FindCommandLineFlag(name);
    bool negative = false;
    if (flag == nullptr && absl::StartsWith(name, "no")) {
      flag = absl::FindCommandLineFlag(name.substr(2));
      negative = true;
    }
    if (flag == nullptr) {
      if (!IsUsageFlag(name)) unknown.emplace_back(i, std::string(name));
      continue;
    }
    const std::string dashed = Dashed(flag->Name());
    if (flag->IsOfType<bool>()) {
      if (has_value && value.empty()) {
        problems.push_back(
            {i, absl::StrCat(dashed, "= needs true or false after '=' (",
                             dashed, "=false)")});
        continue;
      }
      if (negative && has_value) {
        problems.push_back(
            {i, absl::StrCat("--no", dashed.substr(2), "=", value,
                             ": the negated form takes no value (", dashed,
                             "=false)")});
        continue;
      }
      if (!has_value) continue;  // --name or --noname
    } else if (negative) {
      problems.push_back(
          {i, absl::StrCat("unknown flag --no", dashed.substr(2), ": ", dashed,
                           " is not a boolean flag (", dashed, "=<value>)")});
      continue;
    } else if (!has_value) {
      if (i + 1 >= args.size()) {
        problems.push_back(
            {i, absl::StrCat(dashed, " needs a value (", dashed, "=<value>)")});
        continue;
      }
      value = args[++i];  // "--name value"
    }
    if (flag->IsRetired()) continue;
    const std::string problem = ValueProblem(*flag, value);
    if (!problem.empty()) {
      problems.push_back({i, absl::StrCat("invalid value '", value, "' for ",
                                          dashed, ": ", problem)});
      continue;
    }
    if (flag->Name() == "undefok") {
      std::string error;
      absl::ParseFlag(value, &undefok, &error);
    } else if (flag->Name() == "flagfile" || flag->Name() == "fromenv" ||
               flag->Name() == "tryfromenv") {
      flags_from_elsewhere = true;
    }
  }
  if (!flags_from_elsewhere) {
    for (const auto& [index, name] : unknown) {
      // As Abseil's CanIgnoreUndefinedFlag: "name" or "noname" in --undefok.
      const auto listed = [&](absl::string_view n) {
        return std::find(undefok.begin(), undefok.end(), n) != undefok.end();
      };
      if (listed(name) ||
          (absl::StartsWith(name, "no") && listed(name.substr(2)))) {
        continue;
      }
      problems.push_back(
          {index, absl::StrCat("unknown flag ", Dashed(name),
                               " (--help lists the flags; a name is spelled "
                               "with dashes or underscores)")});
    }
  }
  if (problems.empty()) return absl::OkStatus();
  const Problem& first = *std::min_element(
      problems.begin(), problems.end(),
      [](const Problem& a, const Problem& b) { return a.index < b.index; });
  return absl::InvalidArgumentError(first.message);
}

}  // namespace cli
}  // namespace gtopk
