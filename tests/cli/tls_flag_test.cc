// The --tls flag of both binaries (cli/tls_flag.h): no default, every mode
// by name, an unknown one named with the flag.
#include "cli/tls_flag.h"

#include "absl/status/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace gtopk {
namespace cli {
namespace {

using ::gtopk::testing::IsOkAndHolds;
using ::gtopk::testing::StatusIs;
using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::StartsWith;

TEST(TlsFlagTest, NotGivenIsRequiredNamingEveryChoice) {
  EXPECT_THAT(ParseTlsFlag(""),
              StatusIs(absl::StatusCode::kInvalidArgument, kTlsFlagRequired));
  EXPECT_THAT(kTlsFlagRequired, HasSubstr("--tls=mutual"));
  EXPECT_THAT(kTlsFlagRequired, HasSubstr("--tls=server"));
  EXPECT_THAT(kTlsFlagRequired, HasSubstr("--tls=off"));
}

TEST(TlsFlagTest, EveryModeByItsName) {
  for (TlsMode mode : {TlsMode::kOff, TlsMode::kServer, TlsMode::kMutual}) {
    EXPECT_THAT(ParseTlsFlag(TlsModeName(mode)), IsOkAndHolds(mode));
  }
  EXPECT_THAT(ParseTlsFlag("off"), IsOkAndHolds(TlsMode::kOff));
  EXPECT_THAT(ParseTlsFlag("server"), IsOkAndHolds(TlsMode::kServer));
  EXPECT_THAT(ParseTlsFlag("mutual"), IsOkAndHolds(TlsMode::kMutual));
}

TEST(TlsFlagTest, AnUnknownModeIsNamedWithTheFlag) {
  EXPECT_THAT(ParseTlsFlag("on"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(StartsWith("--tls: "), HasSubstr("on"))));
  EXPECT_THAT(
      ParseTlsFlag("Mutual"),
      StatusIs(absl::StatusCode::kInvalidArgument, StartsWith("--tls: ")));
}

}  // namespace
}  // namespace cli
}  // namespace gtopk
