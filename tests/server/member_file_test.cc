// The leader's member tokens survive its restart (issue 42, "rank takeover
// after a leader restart"; server/member_file.h, docs/security.md): the
// file round-trips and refuses damage, and over real gRPC a leader restarted
// from its checkpoint directory refuses a third client's Join of a live
// worker's rank and its Recover with another token, in either order, while
// the holder re-registers with its own token.
#include "server/member_file.h"

#include <sys/stat.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/grpc_edge/grpc_edge.h"
#include "gmock/gmock.h"
#include "grpcpp/client_context.h"
#include "gtest/gtest.h"
#include "gtopk/v1/gtopk.grpc.pb.h"
#include "server/aggregator_server.h"
#include "server/server_config.h"
#include "tests/testing/status_matchers.h"

namespace gtopk {
namespace server {
namespace {

using ::gtopk::testing::StatusIs;
using ::testing::HasSubstr;

std::string TempDir() {
  std::string tmpl = ::testing::TempDir() + "gtopk-members-XXXXXX";
  char* made = ::mkdtemp(tmpl.data());
  EXPECT_NE(made, nullptr);
  return tmpl;
}

TEST(MemberFileTest, RoundTripsAndRefusesDamage) {
  const std::string dir = TempDir();
  EXPECT_THAT(ReadMemberTokens(dir, 3).status(),
              StatusIs(absl::StatusCode::kNotFound));
  const std::vector<uint64_t> tokens = {0, 0xFFFFFFFFFFFFFFFFull, 42};
  const std::string run_length = "--epochs=5 --steps=0 --batch-size=64";
  GTOPK_ASSERT_OK(WriteMemberTokens(dir, tokens, run_length));
  std::string run_length_back;
  GTOPK_ASSERT_OK_AND_ASSIGN(std::vector<uint64_t> back,
                             ReadMemberTokens(dir, 3, &run_length_back));
  EXPECT_EQ(back, tokens);
  // The run length survives a leader restart too (issue 42: a worker with
  // another --steps was accepted by a restarted leader).
  EXPECT_EQ(run_length_back, run_length);
  struct stat st;
  ASSERT_EQ(::stat(MemberFilePath(dir).c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);  // the tokens are credentials
  EXPECT_THAT(ReadMemberTokens(dir, 4).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("--workers=3")));
  // One changed digit: the checksum no longer matches.
  std::string text;
  {
    std::ifstream in(MemberFilePath(dir));
    text.assign(std::istreambuf_iterator<char>(in), {});
  }
  text[text.find("42")] = '7';
  {
    std::ofstream out(MemberFilePath(dir), std::ios::trunc);
    out << text;
  }
  EXPECT_THAT(ReadMemberTokens(dir, 3).status(),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("checksum")));
}

TEST(MemberFileTest, AMissingCheckpointDirectoryIsCreated) {
  // A PyTorch user's first run failed with "--checkpoint-dir=... is not an
  // existing directory": a manual mkdir. The leader makes it (0700: its
  // member file holds credentials) and writes its member file there.
  const std::string dir = TempDir() + "/new/run-1";
  ServerConfig config;
  config.num_workers = 1;
  config.peers = {""};
  config.checkpoint_dir = dir;
  auto server = AggregatorServer::Start(config, "127.0.0.1:0");
  ASSERT_TRUE(server.ok()) << server.status();
  struct stat st;
  ASSERT_EQ(::stat(dir.c_str(), &st), 0);
  EXPECT_TRUE(S_ISDIR(st.st_mode));
  EXPECT_EQ(st.st_mode & 0777, 0700u);
  // A path that is a file is still refused, naming it.
  const std::string file = dir + "/plain-file";
  { std::ofstream(file) << "x"; }
  config.checkpoint_dir = file;
  EXPECT_THAT(AggregatorServer::Start(config, "127.0.0.1:0").status(),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("is not a directory")));
}

constexpr uint64_t kN = 100;

struct Leader {
  std::unique_ptr<AggregatorServer> server;
  std::unique_ptr<v1::Aggregator::Stub> stub;
};

Leader StartLeader(const std::string& dir) {
  ServerConfig config;
  config.num_workers = 2;
  config.peers = {""};
  config.checkpoint_dir = dir;
  config.checkpoint_every = 1;
  Leader l;
  l.server = ::gtopk::testing::OkOrThrow(
      AggregatorServer::Start(config, "127.0.0.1:0"), "the leader's start");
  l.stub = v1::Aggregator::NewStub(
      CreateLimitedChannel(l.server->address(), uint64_t{1} << 20));
  return l;
}

void Deadline(grpc::ClientContext* ctx) {
  ctx->set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
}

absl::StatusOr<v1::JoinResponse> Join(v1::Aggregator::Stub* stub, int rank) {
  grpc::ClientContext ctx;
  Deadline(&ctx);
  v1::JoinRequest request;
  request.set_requested_rank(rank);
  request.set_n(kN);
  v1::JoinResponse response;
  const grpc::Status s = stub->Join(&ctx, request, &response);
  if (!s.ok()) return FromGrpcStatus(s);
  return response;
}

absl::Status Recover(v1::Aggregator::Stub* stub, uint32_t rank, uint64_t token,
                     uint64_t fingerprint) {
  grpc::ClientContext ctx;
  Deadline(&ctx);
  ctx.AddMetadata("gtopk-rank", absl::StrCat(rank));
  ctx.AddMetadata("gtopk-member-token", absl::StrCat(token));
  v1::RecoverRequest request;
  request.set_rank(rank);
  request.set_member_token(token);
  request.set_cluster_fingerprint(fingerprint);
  v1::RecoverResponse response;
  return FromGrpcStatus(stub->Recover(&ctx, request, &response));
}

struct Holders {
  uint64_t token0 = 0, token1 = 0, fingerprint = 0;
};

// Rank 0 and rank 1 join and rank 0 initialises the parameters (the leader
// writes its checkpoint); rank 1's worker keeps its step stream open on
// the leader while `restart` stops the leader.
Holders RunUntilTheLeaderStops(const std::string& dir,
                               const std::function<void(Leader&)>& restart) {
  Holders h;
  Leader leader = StartLeader(dir);
  auto j0 = Join(leader.stub.get(), 0);
  auto j1 = Join(leader.stub.get(), 1);
  EXPECT_TRUE(j0.ok() && j1.ok());
  if (!j0.ok() || !j1.ok()) return h;
  h.token0 = j0->member_token();
  h.token1 = j1->member_token();
  h.fingerprint = j1->cluster().cluster_fingerprint();
  {
    grpc::ClientContext ctx;
    Deadline(&ctx);
    v1::InitParamsResponse init;
    auto writer = leader.stub->InitParams(&ctx, &init);
    v1::ParamsChunk chunk;
    chunk.set_offset(0);
    chunk.set_member_token(h.token0);
    chunk.set_cluster_fingerprint(h.fingerprint);
    for (uint64_t i = 0; i < kN; ++i) chunk.add_values(0.25f * i);
    EXPECT_TRUE(writer->Write(chunk));
    writer->WritesDone();
    EXPECT_TRUE(writer->Finish().ok());
  }
  // Rank 1's live worker: its step stream, registered with its identity.
  grpc::ClientContext ctx;
  Deadline(&ctx);
  ctx.AddMetadata("gtopk-rank", "1");
  ctx.AddMetadata("gtopk-member-token", absl::StrCat(h.token1));
  auto stream = leader.stub->PushPull(&ctx);
  stream->WaitForInitialMetadata();
  restart(leader);
  ctx.TryCancel();
  return h;
}

void ExpectRankOneKeptForItsHolder(Leader& leader, const Holders& h) {
  // A third client with a worker's credentials asks for rank 1 ...
  EXPECT_THAT(Join(leader.stub.get(), 1).status(),
              StatusIs(absl::StatusCode::kUnavailable,
                       HasSubstr("reserved for its holder")));
  // ... or claims it with a made-up token.
  EXPECT_THAT(Recover(leader.stub.get(), 1, 12345, h.fingerprint),
              StatusIs(absl::StatusCode::kPermissionDenied,
                       HasSubstr("held by another worker")));
  // The live worker re-registers with its own token, and keeps the rank.
  GTOPK_EXPECT_OK(Recover(leader.stub.get(), 1, h.token1, h.fingerprint));
  EXPECT_THAT(Join(leader.stub.get(), 1).status(),
              StatusIs(absl::StatusCode::kUnavailable));
  EXPECT_THAT(Recover(leader.stub.get(), 1, 999, h.fingerprint),
              StatusIs(absl::StatusCode::kPermissionDenied));
}

TEST(MemberFileTest, LeaderKilledAndRestartedKeepsTheWorkersRanks) {
  const std::string dir = TempDir();
  const std::string saved = dir + "/at-the-crash";
  const Holders h = RunUntilTheLeaderStops(dir, [&](Leader& leader) {
    // kill -9: the member file stays as the last Join wrote it (the
    // graceful shutdown below would rewrite it).
    std::filesystem::copy_file(MemberFilePath(dir), saved);
    GTOPK_EXPECT_OK(leader.server->Shutdown(absl::ZeroDuration()));
    std::filesystem::copy_file(
        saved, MemberFilePath(dir),
        std::filesystem::copy_options::overwrite_existing);
  });
  Leader leader = StartLeader(dir);
  ExpectRankOneKeptForItsHolder(leader, h);
  // Rank 0 is reserved too (its worker may be alive): no rank is free.
  EXPECT_THAT(Join(leader.stub.get(), 0).status(),
              StatusIs(absl::StatusCode::kUnavailable));
  EXPECT_THAT(Join(leader.stub.get(), -1).status(),
              StatusIs(absl::StatusCode::kUnavailable,
                       HasSubstr("reserved for their holders")));
}

TEST(MemberFileTest, GracefulLeaderRestartKeepsOnlyConnectedWorkersRanks) {
  const std::string dir = TempDir();
  const Holders h = RunUntilTheLeaderStops(dir, [](Leader& leader) {
    GTOPK_EXPECT_OK(leader.server->Shutdown(absl::ZeroDuration()));
  });
  Leader leader = StartLeader(dir);
  ExpectRankOneKeptForItsHolder(leader, h);
  // Rank 0's worker was not connected when the leader stopped: a fresh
  // worker (a cluster restarted as a whole) gets the rank at once.
  GTOPK_EXPECT_OK(Join(leader.stub.get(), 0).status());
}

}  // namespace
}  // namespace server
}  // namespace gtopk
