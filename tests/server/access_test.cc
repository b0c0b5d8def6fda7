// Who may call what (server/access.h), without a server: AccessControl
// over a grpc::ServerContext whose client metadata the test sets
// (grpc::testing::ServerContextTestSpouse), with no security (everyone is
// let in) and with the workers' and shards' tokens; CheckRank on a caller
// restricted to a rank; gtopk_server_auth_failures_total counting each
// refusal. Roles from client certificates need a TLS handshake: they are
// tested over real sockets in
// tests/common/transport_security/transport_security_test.cc.
#include "server/access.h"

#include <prometheus/registry.h>

#include <fstream>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "common/transport_security/transport_security.h"
#include "gmock/gmock.h"
#include "grpcpp/server_context.h"
#include "grpcpp/test/server_context_test_spouse.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/temp_dir.h"

namespace gtopk {
namespace server {
namespace {

using ::gtopk::testing::IsOk;
using ::gtopk::testing::StatusIs;
using ::gtopk::testing::TempDir;
using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::Not;

constexpr char kWorkerToken[] = "worker-token-0123456789";
constexpr char kShardToken[] = "shard-token-0123456789ab";

// gtopk_server_auth_failures_total{code=`code`} in `registry`.
double AuthFailures(prometheus::Registry& registry, const std::string& code) {
  for (const prometheus::MetricFamily& family : registry.Collect()) {
    if (family.name != "gtopk_server_auth_failures_total") continue;
    for (const prometheus::ClientMetric& metric : family.metric) {
      for (const prometheus::ClientMetric::Label& label : metric.label) {
        if (label.name == "code" && label.value == code) {
          return metric.counter.value;
        }
      }
    }
  }
  ADD_FAILURE() << "no auth failure series with code " << code;
  return -1;
}

// A server context whose call carries `authorization` (none when empty).
class Call {
 public:
  explicit Call(const std::string& authorization = "") {
    if (!authorization.empty()) {
      spouse_.AddClientMetadata(kTokenMetadataKey, authorization);
    }
  }
  const grpc::ServerContext& context() const { return context_; }

 private:
  grpc::ServerContext context_;
  // Holds the metadata strings the context refers to.
  grpc::testing::ServerContextTestSpouse spouse_{&context_};
};

class TokenAccessTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_FALSE(dir_.path().empty());
    TransportSecurityOptions options;
    options.tls = TlsMode::kOff;
    options.token_file = Write("worker.token", kWorkerToken);
    options.shard_token_file = Write("shard.token", kShardToken);
    absl::StatusOr<std::shared_ptr<const TransportSecurity>> security =
        TransportSecurity::Load(options, SecurityRole::kServer);
    ASSERT_THAT(security, IsOk());
    access_ = std::make_unique<AccessControl>(*security, registry_);
  }

  std::string Write(const std::string& name, const std::string& text) {
    const std::string path = dir_.path() + "/" + name;
    std::ofstream(path) << text << "\n";
    return path;
  }

  TempDir dir_{"access_test"};
  prometheus::Registry registry_;
  std::unique_ptr<AccessControl> access_;
};

TEST(AccessTest, WithoutSecurityEveryoneMayCallEverything) {
  prometheus::Registry registry;
  AccessControl access(nullptr, registry);
  Call call;
  absl::StatusOr<Caller> caller = access.Authenticate(call.context());
  ASSERT_THAT(caller, IsOk());
  EXPECT_TRUE(caller->worker);
  EXPECT_TRUE(caller->shard);
  EXPECT_EQ(caller->rank, std::nullopt);
  EXPECT_THAT(access.AllowWorker(call.context(), "PushPull", 3), IsOk());
  EXPECT_THAT(access.AllowShard(call.context(), "CommitStep", 1), IsOk());
  EXPECT_EQ(AuthFailures(registry, "unauthenticated"), 0);
  EXPECT_EQ(AuthFailures(registry, "permission_denied"), 0);
}

TEST_F(TokenAccessTest, ACallWithoutATokenIsUnauthenticated) {
  Call call;
  EXPECT_THAT(
      access_->AllowWorker(call.context(), "Join", std::nullopt),
      StatusIs(absl::StatusCode::kUnauthenticated, HasSubstr("missing token")));
  EXPECT_THAT(access_->AllowShard(call.context(), "CommitStep", std::nullopt),
              StatusIs(absl::StatusCode::kUnauthenticated));
  EXPECT_EQ(AuthFailures(registry_, "unauthenticated"), 2);
}

TEST_F(TokenAccessTest, AWrongTokenIsUnauthenticatedAndNeverEchoed) {
  Call call("Bearer not-the-token-at-all-123");
  const absl::Status status =
      access_->AllowWorker(call.context(), "Join", std::nullopt).status();
  EXPECT_THAT(status, StatusIs(absl::StatusCode::kUnauthenticated,
                               AllOf(HasSubstr("wrong token"),
                                     Not(HasSubstr("not-the-token-at-all")))));
  EXPECT_EQ(AuthFailures(registry_, "unauthenticated"), 1);
}

TEST_F(TokenAccessTest, TheWorkersTokenMayCallWorkerRpcsOnly) {
  Call call(std::string("Bearer ") + kWorkerToken);
  absl::StatusOr<Caller> caller =
      access_->AllowWorker(call.context(), "PushPull", 5);
  ASSERT_THAT(caller, IsOk());
  EXPECT_TRUE(caller->worker);
  EXPECT_FALSE(caller->shard);
  EXPECT_EQ(caller->name, "the workers' token");
  EXPECT_THAT(access_->AllowShard(call.context(), "CommitStep", std::nullopt),
              StatusIs(absl::StatusCode::kPermissionDenied,
                       "CommitStep is a shard-to-shard RPC; the workers' "
                       "token is not a shard"));
  EXPECT_EQ(AuthFailures(registry_, "permission_denied"), 1);
  // The "Bearer " prefix is optional.
  Call bare(kWorkerToken);
  EXPECT_THAT(access_->AllowWorker(bare.context(), "Join", std::nullopt),
              IsOk());
}

TEST_F(TokenAccessTest, TheShardsTokenMayCallShardRpcsAndSharedOnes) {
  Call call(std::string("Bearer ") + kShardToken);
  EXPECT_THAT(access_->AllowShard(call.context(), "CommitStep", 1), IsOk());
  EXPECT_THAT(access_->AllowWorker(call.context(), "PushPull", 0),
              StatusIs(absl::StatusCode::kPermissionDenied,
                       HasSubstr("PushPull is a worker RPC; the shards' "
                                 "token is not a worker")));
  // DownloadParams is open to shards too (shard_ok).
  EXPECT_THAT(access_->AllowWorker(call.context(), "DownloadParams",
                                   std::nullopt, /*shard_ok=*/true),
              IsOk());
}

TEST(AccessTest, CheckRankHoldsACallerToItsCertificatesRank) {
  prometheus::Registry registry;
  AccessControl access(nullptr, registry);
  Caller any;
  any.worker = true;
  any.name = "certificate CN=gtopk-worker";
  EXPECT_THAT(access.CheckRank(any, "PushPull", 7), IsOk());
  Caller two = any;
  two.rank = 2;
  two.name = "certificate CN=gtopk-worker-2";
  EXPECT_THAT(access.CheckRank(two, "PushPull", 2), IsOk());
  EXPECT_THAT(access.CheckRank(two, "PushPull", 3),
              StatusIs(absl::StatusCode::kPermissionDenied,
                       "PushPull as rank 3: certificate CN=gtopk-worker-2 "
                       "may act only as rank 2"));
  EXPECT_EQ(AuthFailures(registry, "permission_denied"), 1);
}

}  // namespace
}  // namespace server
}  // namespace gtopk
