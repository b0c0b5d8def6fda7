// A shard restores only its own cluster's checkpoint (issue 42, "a shard
// restores another cluster's checkpoint and the run succeeds";
// server/checkpoint.h, docs/recovery.md). Two runs A and B of S = 2 shards
// on loopback, the same n; B's shard-1 checkpoint copied into A's directory
// and A's shard 1 restarted from it:
//   * B with another --lr: the leader's GetShardState is refused, naming
//     the file and both cluster fingerprints;
//   * B with the same flags (another run): shard 1 starts, but the leader's
//     GetShardState (recovery's read, before any rollback) and every call
//     that needs its parameters are refused FAILED_PRECONDITION naming the
//     file and both run identities; its own checkpoint of run A restores.
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
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
#include "server/checkpoint.h"
#include "server/server_config.h"
#include "tests/testing/status_matchers.h"

namespace gtopk {
namespace server {
namespace {

using ::gtopk::testing::StatusIs;
using ::testing::AllOf;
using ::testing::HasSubstr;

constexpr uint64_t kN = 64;

int FreePort() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a));
  socklen_t len = sizeof(a);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  ::close(fd);
  return ntohs(a.sin_port);
}

std::string TempDir(const char* name) {
  std::string tmpl = ::testing::TempDir() + "gtopk-" + name + "-XXXXXX";
  EXPECT_NE(::mkdtemp(tmpl.data()), nullptr);
  return tmpl;
}

void Deadline(grpc::ClientContext* ctx) {
  ctx->set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
}

// One run: two shards, each with its own checkpoint directory.
struct TestRun {
  std::vector<std::string> peers;
  std::vector<std::string> dirs;
  float lr = 0.1f;
  std::vector<std::unique_ptr<AggregatorServer>> shards;
  uint64_t run_id = 0;

  ServerConfig Config(uint32_t s) const {
    ServerConfig c;
    c.num_workers = 1;
    c.num_shards = 2;
    c.shard_id = s;
    c.peers = peers;
    c.optimizer.lr = lr;
    c.checkpoint_dir = dirs[s];
    c.checkpoint_every = 1;
    c.step_timeout = absl::Seconds(5);
    return c;
  }

  absl::StatusOr<std::unique_ptr<AggregatorServer>> StartShard(uint32_t s) {
    return AggregatorServer::Start(Config(s), peers[s]);
  }

  // Starts both shards, joins one worker and initialises the parameters
  // (each shard writes its checkpoint of step 0).
  void Begin(const char* name) {
    for (int s = 0; s < 2; ++s) {
      peers.push_back(absl::StrCat("127.0.0.1:", FreePort()));
      dirs.push_back(TempDir(name));
    }
    for (uint32_t s = 0; s < 2; ++s) {
      auto shard = StartShard(s);
      ASSERT_TRUE(shard.ok()) << shard.status();
      shards.push_back(*std::move(shard));
    }
    auto leader = v1::Aggregator::NewStub(
        CreateLimitedChannel(peers[0], uint64_t{1} << 20));
    grpc::ClientContext ctx;
    Deadline(&ctx);
    v1::JoinRequest join;
    join.set_requested_rank(0);
    join.set_n(kN);
    v1::JoinResponse joined;
    ASSERT_TRUE(leader->Join(&ctx, join, &joined).ok());
    run_id = joined.cluster().run_id();
    ASSERT_NE(run_id, 0u);
    for (const v1::ShardSpec& shard : joined.cluster().shards()) {
      auto stub = v1::Aggregator::NewStub(
          CreateLimitedChannel(peers[shard.shard_id()], uint64_t{1} << 20));
      grpc::ClientContext c;
      Deadline(&c);
      v1::InitParamsResponse init;
      auto writer = stub->InitParams(&c, &init);
      v1::ParamsChunk chunk;
      chunk.set_shard_id(shard.shard_id());
      chunk.set_offset(shard.begin());
      chunk.set_member_token(joined.member_token());
      chunk.set_cluster_fingerprint(joined.cluster().cluster_fingerprint());
      for (uint64_t i = shard.begin(); i < shard.end(); ++i) {
        chunk.add_values(lr * static_cast<float>(i));
      }
      ASSERT_TRUE(writer->Write(chunk));
      writer->WritesDone();
      GTOPK_ASSERT_OK(FromGrpcStatus(writer->Finish()));
    }
  }
};

void CopyShardOneCheckpoint(const TestRun& from, const TestRun& to) {
  std::filesystem::copy_file(CheckpointPath(from.dirs[1], 1),
                             CheckpointPath(to.dirs[1], 1),
                             std::filesystem::copy_options::overwrite_existing);
}

// Stops `a`'s shard 1 and puts `b`'s shard-1 checkpoint in its directory.
void StopShardOneAndCopyFrom(TestRun& a, const TestRun& b) {
  GTOPK_ASSERT_OK(a.shards[1]->Shutdown(absl::ZeroDuration(), false));
  a.shards[1].reset();
  CopyShardOneCheckpoint(b, a);
}

absl::Status GetShardState(const std::string& address, uint64_t run_id) {
  auto stub =
      v1::Aggregator::NewStub(CreateLimitedChannel(address, uint64_t{1} << 20));
  grpc::ClientContext ctx;
  Deadline(&ctx);
  v1::ShardStateRequest request;
  request.set_without_settling(true);
  request.set_run_id(run_id);
  v1::ShardState state;
  return FromGrpcStatus(stub->GetShardState(&ctx, request, &state));
}

TEST(ForeignCheckpointTest, AnotherClustersSettingsAreRefused) {
  TestRun a, b;
  b.lr = 0.2f;
  ASSERT_NO_FATAL_FAILURE(a.Begin("a"));
  ASSERT_NO_FATAL_FAILURE(b.Begin("b"));
  ASSERT_NO_FATAL_FAILURE(StopShardOneAndCopyFrom(a, b));
  auto restarted = a.StartShard(1);
  ASSERT_TRUE(restarted.ok()) << restarted.status();
  // Its flags are the leader's (a shard restarted with other flags is told
  // which differ, config_check_test); the checkpoint's are not.
  EXPECT_THAT(GetShardState(a.peers[1], a.run_id),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       AllOf(HasSubstr(CheckpointPath(a.dirs[1], 1)),
                             HasSubstr("cluster fingerprint"),
                             HasSubstr("another cluster's checkpoint"))));
  GTOPK_ASSERT_OK((*restarted)->Shutdown(absl::ZeroDuration(), false));
}

TEST(ForeignCheckpointTest, AnotherRunWithTheSameSettingsIsRefused) {
  TestRun a, b;
  ASSERT_NO_FATAL_FAILURE(a.Begin("a"));
  ASSERT_NO_FATAL_FAILURE(b.Begin("b"));
  ASSERT_NE(a.run_id, b.run_id);
  // A's own checkpoint, kept aside to put back at the end.
  GTOPK_ASSERT_OK(ReadCheckpoint(a.dirs[1], 1).status());
  const std::string own = CheckpointPath(a.dirs[1], 1) + ".own";
  std::filesystem::copy_file(CheckpointPath(a.dirs[1], 1), own);
  ASSERT_NO_FATAL_FAILURE(StopShardOneAndCopyFrom(a, b));
  {
    auto restarted = a.StartShard(1);
    ASSERT_TRUE(restarted.ok()) << restarted.status();
    // Recovery's first read: refused before anything is rolled back.
    EXPECT_THAT(GetShardState(a.peers[1], a.run_id),
                StatusIs(absl::StatusCode::kFailedPrecondition,
                         AllOf(HasSubstr(CheckpointPath(a.dirs[1], 1)),
                               HasSubstr("another run's checkpoint"))));
    // A worker's download of its parameters: the shard checks the leader's
    // run identity first.
    auto stub = v1::Aggregator::NewStub(
        CreateLimitedChannel(a.peers[1], uint64_t{1} << 20));
    grpc::ClientContext ctx;
    Deadline(&ctx);
    v1::DownloadParamsRequest request;
    auto reader = stub->DownloadParams(&ctx, request);
    v1::ParamsChunk chunk;
    while (reader->Read(&chunk)) {
    }
    EXPECT_THAT(FromGrpcStatus(reader->Finish()),
                StatusIs(absl::StatusCode::kFailedPrecondition,
                         HasSubstr("another run's checkpoint")));
    GTOPK_ASSERT_OK((*restarted)->Shutdown(absl::ZeroDuration(), false));
  }
  // Its own checkpoint back: restored, and the same run.
  std::filesystem::copy_file(own, CheckpointPath(a.dirs[1], 1),
                             std::filesystem::copy_options::overwrite_existing);
  auto restarted = a.StartShard(1);
  ASSERT_TRUE(restarted.ok()) << restarted.status();
  GTOPK_EXPECT_OK(GetShardState(a.peers[1], a.run_id));
}

TEST(ForeignCheckpointTest,
     ACheckpointPutInPlaceOfTheShardsOwnIsRefusedAtStartDeletingNothing) {
  // The outside tester's data loss: the refused restore used to prune the
  // shard's own retained checkpoints and add the foreign one to them.
  TestRun a, b;
  ASSERT_NO_FATAL_FAILURE(a.Begin("a"));
  ASSERT_NO_FATAL_FAILURE(b.Begin("b"));
  GTOPK_ASSERT_OK(a.shards[1]->Shutdown(absl::ZeroDuration(), false));
  a.shards[1].reset();
  // `cp --remove-destination`: a new file, the retained hard link keeps A's.
  std::filesystem::remove(CheckpointPath(a.dirs[1], 1));
  CopyShardOneCheckpoint(b, a);
  EXPECT_THAT(a.StartShard(1).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       AllOf(HasSubstr(CheckpointPath(a.dirs[1], 1)),
                             HasSubstr(CheckpointHistoryPath(a.dirs[1], 1, 0)),
                             HasSubstr("Nothing was restored or deleted"))));
  GTOPK_ASSERT_OK_AND_ASSIGN(ShardCheckpoint own,
                             ReadCheckpointAt(a.dirs[1], 1, 0));
  EXPECT_EQ(own.run_id, a.run_id);
}

}  // namespace
}  // namespace server
}  // namespace gtopk
