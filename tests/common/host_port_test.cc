// The host:port syntax check of the address flags and the metrics bind
// address (common/host_port.h): names, IPv4 and bracketed IPv6 hosts, the
// port range per use, and the messages naming the flag.
#include "common/host_port.h"

#include "absl/status/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace gtopk {
namespace {

using ::gtopk::testing::IsOk;
using ::gtopk::testing::IsOkAndHolds;
using ::gtopk::testing::StatusIs;

TEST(HostPortTest, AcceptsNamesIpv4AndBracketedIpv6) {
  for (const char* address :
       {"localhost:7000", "127.0.0.1:1", "shard-1.example.com:65535",
        "[::1]:7000", "[fe80::1%eth0]:80", "0.0.0.0:9400"}) {
    EXPECT_THAT(ValidateHostPort("peers", address, 1), IsOk()) << address;
  }
}

TEST(HostPortTest, PortZeroOnlyWhereItMeansPickAFreePort) {
  EXPECT_THAT(ValidateHostPort("listen", "0.0.0.0:0", 0), IsOk());
  EXPECT_THAT(ValidateHostPort("server", "host:0", 1),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       "--server must be host:port with a port in [1, "
                       "65535], got 'host:0'"));
}

TEST(HostPortTest, RefusesMalformedAddressesNamingTheFlag) {
  for (const char* address :
       {"", "host", "host:", ":7000", "host:65536", "host:-1", "host:7a",
        "host: 7000", "::1:7000", "[::1:7000", "[]:7000", "host:+80",
        "host:99999999999999999999"}) {
    EXPECT_THAT(ValidateHostPort("peers", address, 1),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         ::testing::StartsWith("--peers must be host:port")))
        << "'" << address << "'";
  }
}

TEST(HostPortTest, MetricsBindAddressBracketsIpv6) {
  EXPECT_THAT(MetricsBindAddress("0.0.0.0", 9400),
              IsOkAndHolds(std::string("0.0.0.0:9400")));
  EXPECT_THAT(MetricsBindAddress("::", 9400),
              IsOkAndHolds(std::string("[::]:9400")));
  EXPECT_THAT(MetricsBindAddress("::1", 0),
              IsOkAndHolds(std::string("[::1]:0")));
  EXPECT_THAT(MetricsBindAddress("[::1]", 80),
              IsOkAndHolds(std::string("[::1]:80")));
  EXPECT_THAT(MetricsBindAddress("metrics.local", 9401),
              IsOkAndHolds(std::string("metrics.local:9401")));
}

TEST(HostPortTest, MetricsBindAddressRefusesABadHostNamingTheFlag) {
  for (const char* host : {"", "[::1", "[]"}) {
    EXPECT_THAT(MetricsBindAddress(host, 9400),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         ::testing::HasSubstr("--metrics-host must be a host "
                                              "name or an IPv4/IPv6 address")))
        << "'" << host << "'";
  }
  EXPECT_THAT(MetricsBindAddress("host", 70000),
              StatusIs(absl::StatusCode::kInvalidArgument));
}

}  // namespace
}  // namespace gtopk
