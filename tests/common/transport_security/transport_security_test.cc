// Transport security (docs/security.md) over real gRPC on loopback:
// in-process AggregatorServers on 127.0.0.1 (port 0) with mutual TLS or
// tokens, certificates made at test time by deploy/tls/make-certs.sh and the
// openssl CLI (a second CA, an expired and a role-less certificate), raw
// gtopk.v1 stubs and WorkerClients as callers.
#include "common/transport_security/transport_security.h"

#include <prometheus/registry.h>

#include <cstdlib>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/grpc_edge/grpc_edge.h"
#include "gmock/gmock.h"
#include "grpcpp/client_context.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "gtest/gtest.h"
#include "gtopk/v1/gtopk.grpc.pb.h"
#include "server/aggregator_server.h"
#include "server/server_config.h"
#include "tests/testing/local_cluster.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/temp_dir.h"
#include "worker/client.h"

#ifndef GTOPK_SOURCE_DIR
#error "GTOPK_SOURCE_DIR must name the repository root"
#endif

namespace gtopk {
namespace server {
namespace {

using ::gtopk::testing::StatusIs;
using ::testing::HasSubstr;

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

// Every certificate the tests use, made once: `ca/` by make-certs.sh (2
// shards, 2 ranks), `other/` by make-certs.sh too (another CA), plus in
// `ca/`: expired.{crt,key} (CN gtopk-worker, valid in 2020 only) and
// stranger.{crt,key} (CN someone: no role).
class Certs {
 public:
  static const Certs& Get() {
    static const Certs* certs = new Certs();
    return *certs;
  }
  std::string Path(const std::string& name) const {
    return absl::StrCat(dir_.path(), "/ca/", name);
  }
  std::string Other(const std::string& name) const {
    return absl::StrCat(dir_.path(), "/other/", name);
  }
  bool ok() const { return ok_; }

 private:
  Certs() {
    const std::string d = dir_.path();
    const std::string script =
        absl::StrCat(GTOPK_SOURCE_DIR, "/deploy/tls/make-certs.sh");
    const std::string extra = absl::StrCat(d, "/extra.sh");
    std::ofstream(extra) << R"(set -e
c=$1
cd "$c"
openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes \
  -keyout stranger.key -out stranger.csr -subj /CN=someone 2>/dev/null
openssl x509 -req -in stranger.csr -CA ca.crt -CAkey ca.key \
  -CAcreateserial -days 2 -out stranger.crt 2>/dev/null
openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes \
  -keyout expired.key -out expired.csr -subj /CN=gtopk-worker 2>/dev/null
mkdir -p db && : > db/index.txt && echo 01 > db/serial
cat > db/ca.cnf <<EOF
[ca]
default_ca = c
[c]
database = $c/db/index.txt
new_certs_dir = $c/db
serial = $c/db/serial
default_md = sha256
policy = p
[p]
commonName = supplied
EOF
openssl ca -batch -config db/ca.cnf -cert ca.crt -keyfile ca.key \
  -in expired.csr -out expired.crt -notext \
  -startdate 20200101000000Z -enddate 20200102000000Z 2>/dev/null
)";
    const std::string cmd = absl::StrCat(
        "sh ", script, " ", d, "/ca 2 2 >/dev/null && sh ", script, " ", d,
        "/other 0 0 >/dev/null && sh ", extra, " ", d, "/ca");
    ok_ = std::system(cmd.c_str()) == 0;
    // The object lives until exit (Get leaks it); TempDir removes files
    // only, so remove the tree at exit.
    static std::string* tree = new std::string(d);
    std::atexit([] { std::system(absl::StrCat("rm -rf ", *tree).c_str()); });
  }
  gtopk::testing::TempDir dir_{"transport_security_certs"};
  bool ok_ = false;
};

TransportSecurityOptions Mutual(const std::string& cert,
                                const std::string& key) {
  const Certs& c = Certs::Get();
  TransportSecurityOptions o;
  o.tls = TlsMode::kMutual;
  o.cert_file = c.Path(cert);
  o.key_file = c.Path(key);
  o.ca_file = c.Path("ca.crt");
  return o;
}

std::shared_ptr<const TransportSecurity> LoadOrDie(
    const TransportSecurityOptions& o, SecurityRole role) {
  absl::StatusOr<std::shared_ptr<const TransportSecurity>> s =
      TransportSecurity::Load(o, role);
  EXPECT_TRUE(s.ok()) << s.status();
  return s.ok() ? *s : nullptr;
}

ServerConfig BaseConfig(uint32_t num_shards, uint32_t num_workers) {
  ServerConfig c;
  c.num_shards = num_shards;
  c.num_workers = num_workers;
  c.peers.assign(num_shards, "");
  c.step_timeout = absl::Seconds(3);
  c.optimizer.density = 0.5;
  return c;
}

// A channel presenting `cert`/`key` (names in the CA dir; empty: none) and
// trusting `ca`.
std::shared_ptr<grpc::Channel> SslChannel(const std::string& address,
                                          const std::string& cert,
                                          const std::string& key,
                                          const std::string& ca) {
  grpc::SslCredentialsOptions ssl;
  ssl.pem_root_certs = ReadFile(ca);
  if (!cert.empty()) {
    ssl.pem_cert_chain = ReadFile(cert);
    ssl.pem_private_key = ReadFile(key);
  }
  return grpc::CreateChannel(address, grpc::SslCredentials(ssl));
}

std::unique_ptr<grpc::ClientContext> Context(
    absl::Duration timeout = absl::Seconds(5)) {
  auto c = std::make_unique<grpc::ClientContext>();
  c->set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  return c;
}

absl::StatusOr<v1::JoinResponse> Join(grpc::Channel& channel, int rank,
                                      uint64_t n = 8) {
  auto stub = v1::Aggregator::NewStub(
      std::shared_ptr<grpc::Channel>(&channel, [](grpc::Channel*) {}));
  v1::JoinRequest request;
  request.set_requested_rank(rank);
  request.set_n(n);
  v1::JoinResponse response;
  auto context = Context();
  const grpc::Status s = stub->Join(context.get(), request, &response);
  if (!s.ok()) return FromGrpcStatus(s);
  return response;
}

// gtopk_server_auth_failures_total{code=...} in `registry`.
double AuthFailures(prometheus::Registry& registry, const std::string& code) {
  for (const auto& family : registry.Collect()) {
    if (family.name != "gtopk_server_auth_failures_total") continue;
    for (const auto& metric : family.metric) {
      for (const auto& label : metric.label) {
        if (label.name == "code" && label.value == code) {
          return metric.counter.value;
        }
      }
    }
  }
  return -1;
}

class TransportSecurityTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(Certs::Get().ok()) << "openssl could not make the certificates";
  }

  // One mTLS shard (shard-0's certificate) with its own registry.
  void StartMutual(uint32_t workers = 2) {
    ServerConfig c = BaseConfig(1, workers);
    c.security =
        LoadOrDie(Mutual("shard-0.crt", "shard-0.key"), SecurityRole::kServer);
    c.metrics_registry = registry_;
    auto s =
        AggregatorServer::Start(std::move(c), "127.0.0.1:0", "127.0.0.1:0");
    ASSERT_TRUE(s.ok()) << s.status();
    server_ = *std::move(s);
  }

  std::shared_ptr<grpc::Channel> As(const std::string& who) {
    const Certs& c = Certs::Get();
    return SslChannel(server_->address(), c.Path(who + ".crt"),
                      c.Path(who + ".key"), c.Path("ca.crt"));
  }

  std::shared_ptr<prometheus::Registry> registry_ =
      std::make_shared<prometheus::Registry>();
  std::unique_ptr<AggregatorServer> server_;
};

TEST_F(TransportSecurityTest, MutualTlsWorkerCertificateJoins) {
  StartMutual();
  auto joined = Join(*As("worker-1"), 1);
  ASSERT_TRUE(joined.ok()) << joined.status();
  EXPECT_EQ(joined->rank(), 1u);
  auto any = Join(*As("worker"), -1);
  ASSERT_TRUE(any.ok()) << any.status();
  EXPECT_EQ(any->rank(), 0u);
  EXPECT_EQ(AuthFailures(*registry_, "unauthenticated"), 0);
  EXPECT_EQ(AuthFailures(*registry_, "permission_denied"), 0);
}

TEST_F(TransportSecurityTest, HandshakeRejectsMissingForeignAndExpiredCerts) {
  StartMutual();
  const Certs& c = Certs::Get();
  struct Case {
    const char* what;
    std::string cert, key;
  } cases[] = {
      {"no client certificate", "", ""},
      {"certificate of another CA", c.Other("worker.crt"),
       c.Other("worker.key")},
      {"expired certificate", c.Path("expired.crt"), c.Path("expired.key")},
  };
  for (const Case& k : cases) {
    SCOPED_TRACE(k.what);
    const absl::Time start = absl::Now();
    auto joined = Join(
        *SslChannel(server_->address(), k.cert, k.key, c.Path("ca.crt")), 0);
    EXPECT_THAT(joined.status(), StatusIs(absl::StatusCode::kUnavailable));
    // Refused by the handshake, well before the 5 s deadline.
    EXPECT_LT(absl::Now() - start, absl::Seconds(4));
  }
  // Nothing reached the service: rank 0 is still free.
  auto joined = Join(*As("worker"), -1);
  ASSERT_TRUE(joined.ok()) << joined.status();
  EXPECT_EQ(joined->rank(), 0u);
}

TEST_F(TransportSecurityTest, CertificateWithoutRoleIsDenied) {
  StartMutual();
  auto joined = Join(*As("stranger"), 0);
  EXPECT_THAT(joined.status(),
              StatusIs(absl::StatusCode::kPermissionDenied,
                       HasSubstr("CN=someone names no gtopk role")));
  EXPECT_EQ(AuthFailures(*registry_, "permission_denied"), 1);
}

TEST_F(TransportSecurityTest, RankCertificateJoinsOnlyAsItsRank) {
  StartMutual();
  auto joined = Join(*As("worker-1"), 0);
  EXPECT_THAT(joined.status(), StatusIs(absl::StatusCode::kPermissionDenied,
                                        HasSubstr("may act only as rank 1")));
  // Rank 0 was not given out by the refused Join.
  auto any = Join(*As("worker"), -1);
  ASSERT_TRUE(any.ok()) << any.status();
  EXPECT_EQ(any->rank(), 0u);
}

TEST_F(TransportSecurityTest, PushAsAnotherRankIsRefusedAndNothingApplied) {
  StartMutual();
  auto rank0 = Join(*As("worker-0"), 0);
  ASSERT_TRUE(rank0.ok()) << rank0.status();
  auto rank1 = Join(*As("worker-1"), 1);
  ASSERT_TRUE(rank1.ok()) << rank1.status();
  // worker-1 holds rank 0's member token (stolen) and pushes as rank 0.
  auto stub = v1::Aggregator::NewStub(As("worker-1"));
  auto context = Context();
  auto stream = stub->PushPull(context.get());
  v1::Push push;
  push.set_step(0);
  push.set_rank(0);
  push.set_shard_id(0);
  push.set_member_token(rank0->member_token());
  push.set_cluster_fingerprint(rank0->cluster().cluster_fingerprint());
  push.set_epoch(rank0->epoch());
  stream->Write(push);
  stream->WritesDone();
  v1::Pull pull;
  EXPECT_FALSE(stream->Read(&pull));
  EXPECT_THAT(FromGrpcStatus(stream->Finish()),
              StatusIs(absl::StatusCode::kPermissionDenied,
                       HasSubstr("PushPull as rank 0: certificate "
                                 "CN=gtopk-worker-1 may act only as rank 1")));
  EXPECT_EQ(AuthFailures(*registry_, "permission_denied"), 1);
  // Nothing applied: the shard is still before step 0 with no parameters.
  EXPECT_LE(server_->service()->next_step(), 0);
}

TEST_F(TransportSecurityTest, WorkerCannotCallShardRpcs) {
  StartMutual();
  auto stub = v1::Aggregator::NewStub(As("worker"));
  {
    auto c = Context();
    v1::ThresholdRequest r;
    v1::ThresholdResponse a;
    EXPECT_THAT(FromGrpcStatus(stub->ExchangeThreshold(c.get(), r, &a)),
                StatusIs(absl::StatusCode::kPermissionDenied,
                         HasSubstr("ExchangeThreshold is a shard-to-shard "
                                   "RPC; certificate CN=gtopk-worker is not "
                                   "a shard")));
  }
  {
    auto c = Context();
    v1::CommitRequest r;
    v1::CommitResponse a;
    EXPECT_THAT(FromGrpcStatus(stub->CommitStep(c.get(), r, &a)),
                StatusIs(absl::StatusCode::kPermissionDenied));
  }
  {
    auto c = Context();
    v1::MemberCheckRequest r;
    v1::MemberCheckResponse a;
    EXPECT_THAT(FromGrpcStatus(stub->CheckMember(c.get(), r, &a)),
                StatusIs(absl::StatusCode::kPermissionDenied));
  }
  {
    auto c = Context();
    v1::AbortStepRequest r;
    v1::AbortStepResponse a;
    EXPECT_THAT(FromGrpcStatus(stub->AbortStep(c.get(), r, &a)),
                StatusIs(absl::StatusCode::kPermissionDenied));
  }
  {
    auto c = Context();
    v1::RollbackRequest r;
    v1::RollbackResponse a;
    EXPECT_THAT(FromGrpcStatus(stub->RollbackShard(c.get(), r, &a)),
                StatusIs(absl::StatusCode::kPermissionDenied));
  }
  EXPECT_EQ(AuthFailures(*registry_, "permission_denied"), 5);
  // A shard certificate passes the check (and then meets the leader's
  // own checks: here an unknown step's abort is recorded).
  auto shard = v1::Aggregator::NewStub(As("shard-1"));
  auto c = Context();
  v1::AbortStepRequest r;
  r.set_shard_id(1);
  v1::AbortStepResponse a;
  // S = 1 here: shard_id 1 is out of range, so INVALID_ARGUMENT (past
  // the access check), not PERMISSION_DENIED.
  EXPECT_THAT(FromGrpcStatus(shard->AbortStep(c.get(), r, &a)),
              StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST_F(TransportSecurityTest, PlaintextClientAgainstTlsServerFailsFast) {
  StartMutual();
  const absl::Time start = absl::Now();
  auto joined = Join(*grpc::CreateChannel(server_->address(),
                                          grpc::InsecureChannelCredentials()),
                     0);
  EXPECT_THAT(joined.status(), StatusIs(absl::StatusCode::kUnavailable));
  EXPECT_LT(absl::Now() - start, absl::Seconds(4));
}

TEST_F(TransportSecurityTest, TlsClientAgainstPlaintextServerFailsFast) {
  auto s = AggregatorServer::Start(BaseConfig(1, 1), "127.0.0.1:0");
  ASSERT_TRUE(s.ok()) << s.status();
  server_ = *std::move(s);
  const absl::Time start = absl::Now();
  auto joined = Join(*As("worker"), 0);
  EXPECT_THAT(joined.status(), StatusIs(absl::StatusCode::kUnavailable));
  EXPECT_LT(absl::Now() - start, absl::Seconds(4));
}

TEST_F(TransportSecurityTest, HealthPortIsPlaintextAndServesHealthOnly) {
  StartMutual();
  const std::string health = absl::StrCat("127.0.0.1:", server_->health_port());
  absl::StatusOr<bool> plain = CheckHealth(health, absl::Seconds(5));
  ASSERT_TRUE(plain.ok()) << plain.status();
  EXPECT_TRUE(*plain);
  // The main port needs a certificate for the health check too...
  EXPECT_FALSE(CheckHealth(server_->address(), absl::Seconds(2)).ok());
  absl::StatusOr<bool> mutual = CheckHealth(
      server_->address(), absl::Seconds(5), "",
      LoadOrDie(Mutual("shard-0.crt", "shard-0.key"), SecurityRole::kServer));
  ASSERT_TRUE(mutual.ok()) << mutual.status();
  EXPECT_TRUE(*mutual);
  // ...and the health port has no Aggregator service.
  auto joined =
      Join(*grpc::CreateChannel(health, grpc::InsecureChannelCredentials()), 0);
  EXPECT_THAT(joined.status(), StatusIs(absl::StatusCode::kUnimplemented));
}

// Token authentication, TLS server-side only (the client checks the
// server's certificate; the token proves the client).
class TokenTest : public TransportSecurityTest {
 protected:
  void SetUp() override {
    TransportSecurityTest::SetUp();
    const Certs& c = Certs::Get();
    ServerConfig config = BaseConfig(1, 2);
    TransportSecurityOptions o;
    o.tls = TlsMode::kServer;
    o.cert_file = c.Path("shard-0.crt");
    o.key_file = c.Path("shard-0.key");
    o.ca_file = c.Path("ca.crt");
    o.token_file = c.Path("token");
    o.shard_token_file = c.Path("shard-token");
    config.security = LoadOrDie(o, SecurityRole::kServer);
    config.metrics_registry = registry_;
    auto s = AggregatorServer::Start(std::move(config), "127.0.0.1:0");
    ASSERT_TRUE(s.ok()) << s.status();
    server_ = *std::move(s);
    wrong_token_ = absl::StrCat(dir_.path(), "/wrong");
    std::ofstream(wrong_token_) << "0123456789abcdef0123456789abcdef\n";
  }

  // A worker-side channel with `token_file` (empty: no token).
  std::shared_ptr<grpc::Channel> WithToken(const std::string& token_file) {
    TransportSecurityOptions o;
    o.tls = TlsMode::kServer;
    o.ca_file = Certs::Get().Path("ca.crt");
    o.token_file = token_file;
    return CreateSecureChannel(server_->address(), grpc::ChannelArguments(),
                               LoadOrDie(o, SecurityRole::kWorker));
  }

  gtopk::testing::TempDir dir_{"transport_security_token"};
  std::string wrong_token_;
};

TEST_F(TokenTest, RightTokenJoins) {
  auto joined = Join(*WithToken(Certs::Get().Path("token")), -1);
  ASSERT_TRUE(joined.ok()) << joined.status();
  EXPECT_EQ(joined->rank(), 0u);
  EXPECT_EQ(AuthFailures(*registry_, "unauthenticated"), 0);
}

TEST_F(TokenTest, MissingOrWrongTokenIsUnauthenticatedCountedNothingApplied) {
  EXPECT_THAT(
      Join(*WithToken(""), -1).status(),
      StatusIs(absl::StatusCode::kUnauthenticated, HasSubstr("missing token")));
  EXPECT_THAT(
      Join(*WithToken(wrong_token_), -1).status(),
      StatusIs(absl::StatusCode::kUnauthenticated, HasSubstr("wrong token")));
  EXPECT_EQ(AuthFailures(*registry_, "unauthenticated"), 2);
  // The refused Joins took no rank: the next one gets rank 0.
  auto joined = Join(*WithToken(Certs::Get().Path("token")), -1);
  ASSERT_TRUE(joined.ok()) << joined.status();
  EXPECT_EQ(joined->rank(), 0u);
}

TEST_F(TokenTest, WorkerTokenCannotCallShardRpcs) {
  auto stub = v1::Aggregator::NewStub(WithToken(Certs::Get().Path("token")));
  auto c = Context();
  v1::CommitRequest r;
  v1::CommitResponse a;
  EXPECT_THAT(FromGrpcStatus(stub->CommitStep(c.get(), r, &a)),
              StatusIs(absl::StatusCode::kPermissionDenied,
                       HasSubstr("the workers' token is not a shard")));
}

TEST(TransportSecurityLoadTest, BadFilesAreClearErrors) {
  ASSERT_TRUE(Certs::Get().ok());
  const Certs& c = Certs::Get();
  TransportSecurityOptions o = Mutual("shard-0.crt", "shard-1.key");
  EXPECT_THAT(TransportSecurity::Load(o, SecurityRole::kServer).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("does not match the certificate")));
  o = Mutual("shard-0.crt", "shard-0.key");
  o.cert_file = "/nonexistent/cert.pem";
  EXPECT_THAT(TransportSecurity::Load(o, SecurityRole::kServer).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("--tls-cert=/nonexistent/cert.pem: cannot "
                                 "be read")));
  o = Mutual("expired.crt", "expired.key");
  EXPECT_THAT(
      TransportSecurity::Load(o, SecurityRole::kWorker).status(),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("has expired")));
  o = Mutual("worker.crt", "worker.key");
  o.cert_file = c.Other("worker.crt");
  o.key_file = c.Other("worker.key");
  EXPECT_THAT(TransportSecurity::Load(o, SecurityRole::kWorker).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("does not verify against --tls-ca")));
  o = Mutual("worker.crt", "worker.key");
  o.tls = TlsMode::kOff;
  EXPECT_THAT(TransportSecurity::Load(o, SecurityRole::kWorker).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("--tls-cert is set but --tls=off")));
  TransportSecurityOptions t;
  t.token_file = c.Path("token");
  EXPECT_THAT(TransportSecurity::Load(t, SecurityRole::kServer).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("needs --shard-token-file")));
  t.shard_token_file = c.Path("token");
  EXPECT_THAT(TransportSecurity::Load(t, SecurityRole::kServer).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("hold the same token")));
  EXPECT_FALSE(ConstantTimeEquals("abc", "abd"));
  EXPECT_FALSE(ConstantTimeEquals("abc", "abcd"));
  EXPECT_TRUE(ConstantTimeEquals("abc", "abc"));
}

// Two shards and two workers with mutual TLS on every hop (worker -> shard,
// shard -> leader): a few real steps complete and the replicas agree.
TEST_F(TransportSecurityTest, TwoShardClusterTrainsOverMutualTls) {
  constexpr uint32_t kShards = 2, kWorkers = 2;
  constexpr uint64_t kN = 64;
  std::vector<std::unique_ptr<AggregatorServer>> shards;
  // Shard 1's address must be known to the leader up front.
  auto ports = ::gtopk::testing::PickFreePorts(1);
  ASSERT_TRUE(ports.ok()) << ports.status();
  std::vector<std::string> peers = {"",
                                    absl::StrCat("127.0.0.1:", (*ports)[0])};
  for (uint32_t s = 0; s < kShards; ++s) {
    ServerConfig c = BaseConfig(kShards, kWorkers);
    c.shard_id = s;
    c.peers = peers;
    c.peers[s] = "";
    c.security = LoadOrDie(Mutual(absl::StrCat("shard-", s, ".crt"),
                                  absl::StrCat("shard-", s, ".key")),
                           SecurityRole::kServer);
    auto server = AggregatorServer::Start(std::move(c),
                                          s == 0 ? "127.0.0.1:0" : peers[s]);
    ASSERT_TRUE(server.ok()) << server.status();
    if (s == 0) peers[0] = (*server)->address();
    shards.push_back(*std::move(server));
  }
  std::vector<std::vector<float>> params(kWorkers, std::vector<float>(kN));
  std::vector<absl::Status> results(kWorkers);
  std::vector<std::thread> threads;
  for (uint32_t w = 0; w < kWorkers; ++w) {
    threads.emplace_back([&, w] {
      worker::ClientOptions o;
      o.leader_address = peers[0];
      o.requested_rank = static_cast<int>(w);
      o.n = kN;
      o.rpc_timeout = absl::Seconds(10);
      o.security = LoadOrDie(Mutual(absl::StrCat("worker-", w, ".crt"),
                                    absl::StrCat("worker-", w, ".key")),
                             SecurityRole::kWorker);
      auto client = worker::WorkerClient::Connect(o);
      if (!client.ok()) {
        results[w] = client.status();
        return;
      }
      for (uint64_t i = 0; i < kN; ++i) params[w][i] = 0.01f * i;
      auto next = (*client)->SynchronizeParameters(absl::MakeSpan(params[w]));
      if (!next.ok()) {
        results[w] = next.status();
        return;
      }
      std::vector<float> gradient(kN);
      for (int step = 0; step < 3; ++step) {
        for (uint64_t i = 0; i < kN; ++i) {
          gradient[i] = static_cast<float>((i * (w + 3) + step) % 7) - 3.0f;
        }
        auto stats = (*client)->Step(gradient, absl::MakeSpan(params[w]));
        if (!stats.ok()) {
          results[w] = stats.status();
          return;
        }
      }
    });
  }
  for (std::thread& t : threads) t.join();
  for (uint32_t w = 0; w < kWorkers; ++w) {
    EXPECT_TRUE(results[w].ok()) << "worker " << w << ": " << results[w];
  }
  EXPECT_EQ(params[0], params[1]);
  EXPECT_EQ(shards[0]->service()->next_step(), 3);
  EXPECT_EQ(shards[1]->service()->next_step(), 3);
}

}  // namespace
}  // namespace server
}  // namespace gtopk
