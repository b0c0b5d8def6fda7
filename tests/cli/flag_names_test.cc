#include "cli/flag_names.h"

#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace gtopk {
namespace cli {
namespace {

TEST(FlagNamesTest, RewritesNamesNotValues) {
  std::vector<std::string> in = {
      "gtopk-server", "--shard-id=1", "--peers=a-b:1,c-d:2", "-num-shards", "3",
      "--",           "--not-a-flag"};
  std::vector<char*> argv;
  for (std::string& s : in) argv.push_back(s.data());
  const std::vector<std::string> out =
      NormalizeFlagNames(static_cast<int>(argv.size()), argv.data());
  EXPECT_EQ(out, (std::vector<std::string>{"gtopk-server", "--shard_id=1",
                                           "--peers=a-b:1,c-d:2", "-num_shards",
                                           "3", "--", "--not-a-flag"}));
}

TEST(FlagNamesTest, OnlyTheProgramNameMayRemainAfterTheFlags) {
  std::string program = "gtopk-server", stray = "false", other = "x";
  EXPECT_TRUE(CheckNoPositionalArguments({}).ok());
  EXPECT_TRUE(CheckNoPositionalArguments({program.data()}).ok());
  const absl::Status status =
      CheckNoPositionalArguments({program.data(), stray.data(), other.data()});
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("unexpected argument 'false'"),
            std::string::npos)
      << status;
}

}  // namespace
}  // namespace cli
}  // namespace gtopk
