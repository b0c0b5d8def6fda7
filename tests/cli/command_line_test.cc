#include "cli/command_line.h"

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"

// Flags of every kind the two mains define.
ABSL_FLAG(std::string, cli_test_name, "", "a string");
ABSL_FLAG(int64_t, cli_test_count, 0, "an integer");
ABSL_FLAG(bool, cli_test_switch, false, "a boolean");
ABSL_FLAG(absl::Duration, cli_test_timeout, absl::Seconds(1), "a duration");
ABSL_FLAG(std::optional<absl::Duration>, cli_test_budget, std::nullopt,
          "an optional duration");

namespace gtopk {
namespace cli {
namespace {

// CheckFlagSyntax of "program" followed by `args`.
absl::Status Check(std::vector<std::string> args) {
  args.insert(args.begin(), "program");
  return CheckFlagSyntax(args);
}

// The INVALID_ARGUMENT message of Check(args), or "OK".
std::string Message(std::vector<std::string> args) {
  const absl::Status status = Check(std::move(args));
  if (status.ok()) return "OK";
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  return std::string(status.message());
}

TEST(CommandLineTest, AcceptsWhatAbseilAccepts) {
  for (const std::vector<std::string>& args :
       std::vector<std::vector<std::string>>{
           {},
           {"--cli_test_name=x", "-cli_test_count=3", "--cli_test_switch"},
           {"--nocli_test_switch", "--cli_test_switch=false"},
           {"--cli_test_name", "-starts-with-a-dash"},  // "--name value"
           {"--cli_test_count", "7", "--cli_test_timeout=500ms"},
           {"--cli_test_budget=", "--cli_test_budget=20s"},
           {"positional", "--cli_test_count=1"},  // left to the next check
           {"--", "--unknown=1"},                 // after "--": not flags
           {"--help"},
           {"--helpfull"},
           {"--help=tls"},
           {"--version"},
           {"--undefok=unknown,other", "--unknown=1", "--noother"},
       }) {
    EXPECT_EQ(Message(args), "OK") << args.size();
  }
}

TEST(CommandLineTest, NamesTheFlagOfEachSyntaxError) {
  EXPECT_EQ(Message({"--cli_test_nme=x"}),
            "unknown flag --cli-test-nme (--help lists the flags; a name is "
            "spelled with dashes or underscores)");
  EXPECT_EQ(Message({"--cli_test_count=abc"}),
            "invalid value 'abc' for --cli-test-count: not a 64-bit integer");
  EXPECT_EQ(Message({"--cli_test_count", "abc"}),
            "invalid value 'abc' for --cli-test-count: not a 64-bit integer");
  EXPECT_EQ(Message({"--cli_test_timeout=3"}),
            "invalid value '3' for --cli-test-timeout: not a duration (a "
            "number and a unit: 30s, 500ms, 2m, 1h)");
  EXPECT_NE(Message({"--cli_test_budget=3"}).find("--cli-test-budget"),
            std::string::npos);
  EXPECT_EQ(Message({"--cli_test_switch=maybe"}),
            "invalid value 'maybe' for --cli-test-switch: not true or false");
  EXPECT_EQ(Message({"--cli_test_switch="}),
            "--cli-test-switch= needs true or false after '=' "
            "(--cli-test-switch=false)");
  EXPECT_EQ(Message({"--nocli_test_switch=true"}),
            "--nocli-test-switch=true: the negated form takes no value "
            "(--cli-test-switch=false)");
  EXPECT_EQ(Message({"--nocli_test_count"}),
            "unknown flag --nocli-test-count: --cli-test-count is not a "
            "boolean flag (--cli-test-count=<value>)");
  EXPECT_EQ(Message({"--cli_test_count"}),
            "--cli-test-count needs a value (--cli-test-count=<value>)");
  EXPECT_EQ(Message({"--nohelp"}),
            "unknown flag --nohelp (--help lists the flags; a name is "
            "spelled with dashes or underscores)");
}

TEST(CommandLineTest, ReportsTheFirstMistakeOnTheCommandLine) {
  EXPECT_EQ(Message({"--unknown", "--cli_test_count=x"}),
            "unknown flag --unknown (--help lists the flags; a name is "
            "spelled with dashes or underscores)");
  EXPECT_EQ(Message({"--cli_test_count=x", "--unknown"}),
            "invalid value 'x' for --cli-test-count: not a 64-bit integer");
}

TEST(CommandLineTest, LeavesUnknownNamesToAbseilWithAFlagfile) {
  // A --flagfile may set --undefok: Abseil's parser decides (exit 1).
  EXPECT_EQ(Message({"--flagfile=/dev/null", "--unknown=1"}), "OK");
  // Values on the command line are still checked.
  EXPECT_NE(Message({"--flagfile=/dev/null", "--cli_test_count=x"}), "OK");
}

TEST(CommandLineTest, SetsNoFlag) {
  ASSERT_TRUE(Check({"--cli_test_name=changed", "--cli_test_count=5",
                     "--cli_test_switch"})
                  .ok());
  EXPECT_EQ(absl::GetFlag(FLAGS_cli_test_name), "");
  EXPECT_EQ(absl::GetFlag(FLAGS_cli_test_count), 0);
  EXPECT_FALSE(absl::GetFlag(FLAGS_cli_test_switch));
}

}  // namespace
}  // namespace cli
}  // namespace gtopk
