// AggregatorService over real gRPC on loopback: in-process servers
// (AggregatorServer on 127.0.0.1, port 0), raw gtopk.v1 stubs as workers.
#include "server/service.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/codec.h"
#include "common/grpc_edge/grpc_edge.h"
#include "common/merge.h"
#include "common/optimizer.h"
#include "common/sparse_vector.h"
#include "common/status_macros.h"
#include "gmock/gmock.h"
#include "grpcpp/client_context.h"
#include "gtest/gtest.h"
#include "gtopk/v1/gtopk.grpc.pb.h"
#include "server/aggregator_server.h"
#include "server/checkpoint.h"
#include "server/server_config.h"
#include "tests/testing/address_space_cap.h"
#include "tests/testing/local_cluster.h"
#include "tests/testing/reference.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/temp_dir.h"

namespace gtopk {
namespace server {
namespace {

using ::gtopk::testing::FloatBits;
using ::gtopk::testing::StatusIs;
using ::gtopk::testing::TempDir;
using ::testing::AllOf;
using ::testing::HasSubstr;

ServerConfig BaseConfig(uint32_t num_shards, uint32_t num_workers) {
  ServerConfig c;
  c.num_shards = num_shards;
  c.num_workers = num_workers;
  c.peers.assign(num_shards, "");
  c.step_timeout = absl::Seconds(2);
  c.optimizer.density = 0.2;
  c.optimizer.momentum_mode = MomentumMode::kDgcCorrection;
  return c;
}

// S in-process shards on loopback. `config` is used for every shard (its
// shard_id and peers are filled in).
struct Cluster {
  std::vector<std::unique_ptr<AggregatorServer>> servers;
  std::vector<std::unique_ptr<v1::Aggregator::Stub>> stubs;

  v1::Aggregator::Stub* stub(size_t s) { return stubs[s].get(); }
};

// The identities the leader handed out in this test (Join below): per rank
// the member token, and the cluster fingerprint. MakePush and InitParams
// stamp them, as the worker client does, so the tests below exercise the
// same checks a real worker passes.
struct Identities {
  std::map<uint32_t, uint64_t> token;
  uint64_t fingerprint = 0;
};
Identities& Members() {
  static Identities* identities = new Identities();
  return *identities;
}

absl::StatusOr<Cluster> StartCluster(ServerConfig config) {
  Members() = Identities();
  Cluster cluster;
  const uint32_t S = config.num_shards;
  std::vector<std::string> listen(S, "127.0.0.1:0");
  std::vector<std::string> peers(S, "");
  // Shards other than the leader need addresses the leader knows up front.
  GTOPK_ASSIGN_OR_RETURN(std::vector<int> ports,
                         ::gtopk::testing::PickFreePorts(S));
  for (uint32_t s = 1; s < S; ++s) {
    listen[s] = absl::StrCat("127.0.0.1:", ports[s]);
    peers[s] = listen[s];
  }
  for (uint32_t s = 0; s < S; ++s) {
    ServerConfig c = config;
    c.shard_id = s;
    c.peers = peers;
    c.peers[s] = "";  // its own entry: the bound address
    absl::StatusOr<std::unique_ptr<AggregatorServer>> server =
        AggregatorServer::Start(c, listen[s]);
    if (!server.ok()) return server.status();
    if (s == 0) peers[0] = (*server)->address();
    cluster.stubs.push_back(v1::Aggregator::NewStub(
        CreateLimitedChannel((*server)->address(), uint64_t{64} << 20)));
    cluster.servers.push_back(*std::move(server));
  }
  return cluster;
}

absl::StatusOr<v1::JoinResponse> Join(v1::Aggregator::Stub* stub, int rank,
                                      uint64_t n) {
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
  v1::JoinRequest request;
  request.set_requested_rank(rank);
  request.set_n(n);
  v1::JoinResponse response;
  const grpc::Status s = stub->Join(&ctx, request, &response);
  if (!s.ok()) return FromGrpcStatus(s);
  Members().token[response.rank()] = response.member_token();
  Members().fingerprint = response.cluster().cluster_fingerprint();
  return response;
}

// Streams `values` (the range starting at `offset`) in chunks of `chunk`.
absl::StatusOr<bool> InitParams(v1::Aggregator::Stub* stub, uint32_t worker,
                                uint32_t shard, uint64_t offset,
                                const std::vector<float>& values,
                                size_t chunk) {
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
  v1::InitParamsResponse response;
  auto writer = stub->InitParams(&ctx, &response);
  for (size_t i = 0; i < values.size(); i += chunk) {
    v1::ParamsChunk c;
    c.set_rank(worker);
    c.set_member_token(Members().token[worker]);
    c.set_cluster_fingerprint(Members().fingerprint);
    c.set_shard_id(shard);
    c.set_offset(offset + i);
    for (size_t j = i; j < std::min(values.size(), i + chunk); ++j) {
      c.add_values(values[j]);
    }
    if (!writer->Write(c)) break;
  }
  writer->WritesDone();
  const grpc::Status s = writer->Finish();
  if (!s.ok()) return FromGrpcStatus(s);
  return response.initialized_now();
}

struct Downloaded {
  std::vector<float> values;
  std::string state;  // the chunks' ParamsChunk.state, concatenated
  int64_t step = -1;
  int chunks = 0;
  uint64_t offset = 0;
};

absl::StatusOr<Downloaded> Download(v1::Aggregator::Stub* stub,
                                    uint32_t worker = 0,
                                    absl::Duration timeout = absl::Seconds(5)) {
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  v1::DownloadParamsRequest request;
  request.set_rank(worker);
  auto reader = stub->DownloadParams(&ctx, request);
  Downloaded d;
  v1::ParamsChunk c;
  while (reader->Read(&c)) {
    if (d.chunks == 0) d.offset = c.offset();
    if (c.offset() != d.offset + d.values.size()) {
      return absl::InternalError("chunks not contiguous");
    }
    d.values.insert(d.values.end(), c.values().begin(), c.values().end());
    d.state += c.state();
    d.step = c.step();
    ++d.chunks;
  }
  const grpc::Status s = reader->Finish();
  if (!s.ok()) return FromGrpcStatus(s);
  return d;
}

// One push on a fresh stream, then its pull (or the stream's status).
absl::StatusOr<v1::Pull> PushOnce(v1::Aggregator::Stub* stub,
                                  const v1::Push& push) {
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
  auto stream = stub->PushPull(&ctx);
  stream->Write(push);
  v1::Pull pull;
  const bool got = stream->Read(&pull);
  stream->WritesDone();
  const grpc::Status s = stream->Finish();
  if (!s.ok()) return FromGrpcStatus(s);
  if (!got) return absl::InternalError("stream ended without a pull");
  return pull;
}

v1::Push MakePush(int64_t step, uint32_t worker, uint32_t shard,
                  std::string sparse) {
  v1::Push p;
  p.set_step(step);
  p.set_rank(worker);
  p.set_member_token(Members().token[worker]);
  p.set_cluster_fingerprint(Members().fingerprint);
  p.set_shard_id(shard);
  p.set_sparse(std::move(sparse));
  return p;
}

std::string Encode(const SparseVector& v, uint64_t n, CodecSpec spec) {
  std::string out;
  EXPECT_TRUE(EncodeSparse(v, n, spec, &out).ok());
  return out;
}

// A codec-v1 message with raw indices and fp32 values, written by hand so
// that it may break the invariants (unsorted, duplicate, NaN).
std::string RawMessage(const std::vector<uint32_t>& indices,
                       const std::vector<float>& values) {
  std::string out = {1, static_cast<char>(IndexCodec::kRaw),
                     static_cast<char>(ValueCodec::kFp32),
                     static_cast<char>(indices.size())};  // count < 128
  for (uint32_t i : indices) {
    for (int b = 0; b < 4; ++b) out.push_back(static_cast<char>(i >> (8 * b)));
  }
  for (float v : values) {
    const uint32_t bits = FloatBits(v);
    for (int b = 0; b < 4; ++b) {
      out.push_back(static_cast<char>(bits >> (8 * b)));
    }
  }
  return out;
}

// ---------------------------------------------------------------------------

TEST(ServiceTest, HealthIsServingAfterStart) {
  GTOPK_ASSERT_OK_AND_ASSIGN(Cluster cluster, StartCluster(BaseConfig(1, 1)));
  GTOPK_ASSERT_OK_AND_ASSIGN(
      bool serving,
      CheckHealth(cluster.servers[0]->address(), absl::Seconds(5)));
  EXPECT_TRUE(serving);
}

TEST(ServiceTest, JoinAssignsRanksAndChecksN) {
  ServerConfig config = BaseConfig(2, 2);
  GTOPK_ASSERT_OK_AND_ASSIGN(Cluster cluster, StartCluster(config));
  v1::Aggregator::Stub* leader = cluster.stub(0);

  EXPECT_THAT(Join(leader, -1, 0), StatusIs(absl::StatusCode::kInvalidArgument,
                                            HasSubstr("n must")));
  EXPECT_THAT(Join(leader, 2, 10), StatusIs(absl::StatusCode::kInvalidArgument,
                                            HasSubstr("requested_rank 2")));
  EXPECT_THAT(Join(cluster.stub(1), -1, 10),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       AllOf(HasSubstr("not the leader"),
                             HasSubstr(cluster.servers[0]->address()))));

  GTOPK_ASSERT_OK_AND_ASSIGN(v1::JoinResponse first, Join(leader, -1, 10));
  EXPECT_EQ(first.rank(), 0u);
  const v1::ClusterSpec& spec = first.cluster();
  EXPECT_EQ(spec.n(), 10u);
  EXPECT_EQ(spec.num_workers(), 2u);
  ASSERT_EQ(spec.shards_size(), 2);
  EXPECT_EQ(spec.shards(0).address(), cluster.servers[0]->address());
  EXPECT_EQ(spec.shards(1).address(), cluster.servers[1]->address());
  EXPECT_EQ(spec.shards(0).begin(), 0u);
  EXPECT_EQ(spec.shards(0).end(), 5u);
  EXPECT_EQ(spec.shards(1).begin(), 5u);
  EXPECT_EQ(spec.shards(1).end(), 10u);
  EXPECT_EQ(spec.mode(), v1::MODE_GTOPK);
  EXPECT_EQ(spec.selection(), v1::SELECTION_THRESHOLD);
  EXPECT_EQ(spec.index_codec(), "delta-varint");
  EXPECT_EQ(spec.value_codec(), "fp32");
  EXPECT_EQ(spec.step_timeout_ms(), 2000u);
  EXPECT_EQ(spec.next_step(), 0);
  EXPECT_DOUBLE_EQ(spec.optimizer().density(), 0.2);

  GTOPK_ASSERT_OK_AND_ASSIGN(v1::JoinResponse second, Join(leader, -1, 10));
  EXPECT_EQ(second.rank(), 1u);
  EXPECT_THAT(Join(leader, -1, 10),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       HasSubstr("ranks are taken")));
  GTOPK_ASSERT_OK_AND_ASSIGN(v1::JoinResponse rejoin, Join(leader, 1, 10));
  EXPECT_EQ(rejoin.rank(), 1u);
  EXPECT_THAT(Join(leader, 0, 11),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       AllOf(HasSubstr("n = 11"), HasSubstr("n = 10"))));

  // A non-leader forwards GetClusterSpec to the leader.
  grpc::ClientContext ctx;
  v1::ClusterSpec forwarded;
  ASSERT_TRUE(cluster.stub(1)
                  ->GetClusterSpec(&ctx, v1::JoinRequest(), &forwarded)
                  .ok());
  EXPECT_EQ(forwarded.n(), 10u);
}

TEST(ServiceTest, InitAndDownloadAcrossTwoShardsInChunks) {
  ServerConfig config = BaseConfig(2, 2);
  config.download_chunk_bytes = 64 + 3 * 4;  // 3 values per chunk
  GTOPK_ASSERT_OK_AND_ASSIGN(Cluster cluster, StartCluster(config));
  const uint64_t n = 21;
  GTOPK_ASSERT_OK_AND_ASSIGN(v1::JoinResponse join,
                             Join(cluster.stub(0), 0, n));
  std::vector<float> params(n);
  for (uint64_t i = 0; i < n; ++i) params[i] = 0.5f * i - 3.25f;
  for (uint32_t s = 0; s < 2; ++s) {
    const uint64_t begin = join.cluster().shards(s).begin();
    const uint64_t end = join.cluster().shards(s).end();
    std::vector<float> range(params.begin() + begin, params.begin() + end);
    GTOPK_ASSERT_OK_AND_ASSIGN(
        bool now, InitParams(cluster.stub(s), 0, s, begin, range, 4));
    EXPECT_TRUE(now);
    // Idempotent: a second initialisation keeps the first values.
    std::vector<float> other(range.size(), 7.0f);
    GTOPK_ASSERT_OK_AND_ASSIGN(
        bool again, InitParams(cluster.stub(s), 0, s, begin, other, 4));
    EXPECT_FALSE(again);
  }
  std::vector<float> all;
  for (uint32_t s = 0; s < 2; ++s) {
    GTOPK_ASSERT_OK_AND_ASSIGN(Downloaded d, Download(cluster.stub(s), 1));
    EXPECT_GT(d.chunks, 2);
    EXPECT_EQ(d.step, 0);
    EXPECT_EQ(d.offset, join.cluster().shards(s).begin());
    all.insert(all.end(), d.values.begin(), d.values.end());
  }
  EXPECT_EQ(FloatBits(all), FloatBits(params));

  // Chunk faults, each named.
  EXPECT_THAT(InitParams(cluster.stub(1), 0, 0, 10, {1.0f}, 1),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("for shard 0 was sent to shard 1")));
  EXPECT_THAT(InitParams(cluster.stub(0), 0, 0, 1, {1.0f}, 1),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("gap")));
  EXPECT_THAT(InitParams(cluster.stub(0), 0, 0, 0, {1.0f, 2.0f}, 1),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("values missing")));
  EXPECT_THAT(
      InitParams(
          cluster.stub(0), 0, 0, 0,
          std::vector<float>(10, std::numeric_limits<float>::quiet_NaN()), 10),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("not finite")));
}

// A one-shard cluster (`config`) whose rank 0 joined with n parameters
// and initialised them to 1.0.
absl::StatusOr<Cluster> StartInitialised(const ServerConfig& config,
                                         uint64_t n) {
  GTOPK_ASSIGN_OR_RETURN(Cluster cluster, StartCluster(config));
  GTOPK_RETURN_IF_ERROR(Join(cluster.stub(0), 0, n).status());
  GTOPK_ASSIGN_OR_RETURN(bool now,
                         InitParams(cluster.stub(0), 0, 0, 0,
                                    std::vector<float>(n, 1.0f), 1 << 18));
  if (!now) return absl::InternalError("the parameters were already set");
  return cluster;
}

TEST(ServiceTest, ConcurrentDownloadsAreBounded) {
  // Each download snapshots the shard's range; clients that never read must
  // not make the server hold unboundedly many copies.
  ServerConfig config = BaseConfig(1, 1);
  config.step_timeout = absl::Milliseconds(500);
  const uint64_t n = uint64_t{4} << 20;  // 16 MiB: far beyond flow control
  GTOPK_ASSERT_OK_AND_ASSIGN(Cluster cluster, StartInitialised(config, n));
  // Four streams that read one chunk and then no more hold the four
  // download slots (the server takes a slot before it sends; the first
  // chunk proves it has one, where a fixed sleep raced the server on a busy
  // machine)...
  std::vector<std::unique_ptr<grpc::ClientContext>> contexts;
  std::vector<std::unique_ptr<grpc::ClientReader<v1::ParamsChunk>>> readers;
  v1::DownloadParamsRequest request;
  for (int i = 0; i < 4; ++i) {
    contexts.push_back(std::make_unique<grpc::ClientContext>());
    contexts.back()->set_deadline(std::chrono::system_clock::now() +
                                  std::chrono::seconds(60));
    readers.push_back(
        cluster.stub(0)->DownloadParams(contexts.back().get(), request));
    v1::ParamsChunk first;
    ASSERT_TRUE(readers.back()->Read(&first))
        << "download stream " << i << " sent no chunk";
  }
  // ...so a fifth waits for one and gives up at its deadline (shorter than
  // the stall bound that would free a slot), with a reason.
  EXPECT_THAT(Download(cluster.stub(0), 0, absl::Milliseconds(1500)),
              StatusIs(absl::StatusCode::kDeadlineExceeded,
                       HasSubstr("downloads already in progress")));
  for (auto& c : contexts) c->TryCancel();
  for (auto& r : readers) r->Finish().IgnoreError();
  // Once they are gone, downloads work again.
  GTOPK_ASSERT_OK_AND_ASSIGN(Downloaded d, Download(cluster.stub(0), 0));
  EXPECT_EQ(d.values.size(), n);
}

TEST(ServiceTest, StuckDownloadsAreCancelledAndFreeTheirSlots) {
  // Four clients open DownloadParams without a deadline and stop reading:
  // the server's Write blocks on flow control. Without a server-side bound
  // they would hold all four download slots until they went away, and every
  // other download (a worker restart) would fail. The bound here is the
  // stall floor: max(2 s, 250 ms) + 64 KiB / (1 MiB/s) = 2.0625 s.
  ServerConfig config = BaseConfig(1, 1);
  config.step_timeout = absl::Milliseconds(250);
  config.download_chunk_bytes = uint64_t{64} << 10;
  const DownloadLimits limits =
      DownloadParamsLimits(config, config.download_chunk_bytes, 0);
  ASSERT_EQ(limits.stall, kDownloadStallFloor + absl::Milliseconds(62.5));
  const uint64_t n = uint64_t{4} << 20;  // 16 MiB: far beyond flow control
  GTOPK_ASSERT_OK_AND_ASSIGN(Cluster cluster, StartInitialised(config, n));
  std::vector<std::unique_ptr<grpc::ClientContext>> contexts;
  std::vector<std::unique_ptr<grpc::ClientReader<v1::ParamsChunk>>> readers;
  // Whatever happens below, end the stuck calls (without the bound they
  // never end by themselves).
  struct EndCalls {
    std::vector<std::unique_ptr<grpc::ClientContext>>& contexts;
    std::vector<std::unique_ptr<grpc::ClientReader<v1::ParamsChunk>>>& readers;
    ~EndCalls() {
      for (auto& c : contexts) c->TryCancel();
      for (auto& r : readers) r->Finish().IgnoreError();
    }
  } end_calls{contexts, readers};
  v1::DownloadParamsRequest request;
  for (int i = 0; i < 4; ++i) {
    contexts.push_back(std::make_unique<grpc::ClientContext>());  // no deadline
    readers.push_back(
        cluster.stub(0)->DownloadParams(contexts.back().get(), request));
    // The first chunk proves that the server holds a slot for this stream;
    // then nothing more is read.
    v1::ParamsChunk first;
    ASSERT_TRUE(readers.back()->Read(&first))
        << "download stream " << i << " sent no chunk";
  }
  const absl::Time start = absl::Now();
  // The slots are taken: a download whose deadline ends before the stall
  // bound waits in vain.
  EXPECT_THAT(Download(cluster.stub(0), 0, absl::Milliseconds(1500)),
              StatusIs(absl::StatusCode::kDeadlineExceeded,
                       HasSubstr("downloads already in progress")));
  // One download with a worker's deadline (a worker restarting; found by a
  // second break-it run, where the wait for a slot ended before the stall
  // bound and the restarted worker was refused) waits for a slot and gets
  // it once the server has cancelled the stuck streams, soon after the
  // stall bound: one call, no retry.
  const absl::StatusOr<Downloaded> d = Download(cluster.stub(0), 0);
  const absl::Duration took = absl::Now() - start;
  ASSERT_TRUE(d.ok()) << d.status() << " after " << took;
  EXPECT_EQ(d->values.size(), n);
  EXPECT_GE(took, limits.stall - absl::Milliseconds(100));
  // Counted with the other resource bounds, once per cancelled stream. Waited
  // for before the stuck streams are read: the fifth download may have taken
  // the first freed slot before the last stream's stall bound ran out, and
  // reading that stream now would let its server finish it.
  const ServerMetrics& metrics = cluster.servers[0]->service()->metrics();
  // Each stream's bound starts when its own writes stall, which on a
  // loaded machine can be seconds after the others' (a .ci/run beside two
  // other builds counted 2 of 4 after stall + 2 s): a generous deadline,
  // left as soon as all four are counted.
  const absl::Time counted_by =
      absl::Now() + 2 * limits.stall + absl::Seconds(15);
  while (metrics.limit_rejections(LimitBound::kDownloadTime) < 4 &&
         absl::Now() < counted_by) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_EQ(metrics.limit_rejections(LimitBound::kDownloadTime), 4);
  // The stuck clients find their streams cancelled by the server: after the
  // chunks already sent (gRPC's Finish wants them read), CANCELLED.
  for (size_t i = 0; i < readers.size(); ++i) {
    v1::ParamsChunk chunk;
    uint64_t got = 0;
    while (readers[i]->Read(&chunk)) got += chunk.values_size();
    EXPECT_LT(got, n) << "stream " << i;
    EXPECT_EQ(readers[i]->Finish().error_code(), grpc::StatusCode::CANCELLED)
        << "stream " << i;
  }
  readers.clear();
}

TEST(ServiceTest, OneGtopkStepMatchesReference) {
  ServerConfig config = BaseConfig(2, 2);
  GTOPK_ASSERT_OK_AND_ASSIGN(Cluster cluster, StartCluster(config));
  const uint64_t n = 40;
  GTOPK_ASSERT_OK_AND_ASSIGN(v1::JoinResponse join,
                             Join(cluster.stub(0), 0, n));
  ASSERT_TRUE(Join(cluster.stub(0), 1, n).ok());
  std::vector<float> params(n);
  for (uint64_t i = 0; i < n; ++i) params[i] = 0.01f * i - 0.2f;
  std::vector<std::pair<uint64_t, uint64_t>> ranges;
  for (uint32_t s = 0; s < 2; ++s) {
    ranges.emplace_back(join.cluster().shards(s).begin(),
                        join.cluster().shards(s).end());
    std::vector<float> range(params.begin() + ranges[s].first,
                             params.begin() + ranges[s].second);
    ASSERT_TRUE(
        InitParams(cluster.stub(s), 0, s, ranges[s].first, range, 7).ok());
  }

  // Seeded local top-k's that overlap, so the sum has shared indices; 8
  // pairs per shard (k = 8), as many as a shard accepts from one worker
  // (docs/resource-limits.md).
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<SparseVector> pushes(2);
  for (uint32_t w = 0; w < 2; ++w) {
    for (uint32_t i = 0; i < n; ++i) {
      if ((i + w) % 3 != 0 && i % 20 < 12) pushes[w].push_back(i, normal(rng));
    }
  }
  const CodecSpec codec;  // the cluster's: delta-varint + fp32
  std::vector<absl::StatusOr<v1::Pull>> pulls(4, absl::UnknownError(""));
  std::vector<std::thread> threads;
  for (uint32_t w = 0; w < 2; ++w) {
    for (uint32_t s = 0; s < 2; ++s) {
      SparseVector part;
      for (size_t j = 0; j < pushes[w].size(); ++j) {
        const uint32_t i = pushes[w].indices[j];
        if (i >= ranges[s].first && i < ranges[s].second) {
          part.push_back(i, pushes[w].values[j]);
        }
      }
      v1::Push push = MakePush(0, w, s, Encode(part, n, codec));
      threads.emplace_back([&pulls, &cluster, w, s, push] {
        pulls[w * 2 + s] = PushOnce(cluster.stub(s), push);
      });
    }
  }
  for (std::thread& t : threads) t.join();

  SparseVector expected;
  const uint64_t k = 8;  // density 0.2 of 40
  GTOPK_ASSERT_OK(ReferenceGtopkStep(pushes, n, k, &expected));
  for (uint32_t w = 0; w < 2; ++w) {
    SparseVector got;
    for (uint32_t s = 0; s < 2; ++s) {
      ASSERT_TRUE(pulls[w * 2 + s].ok()) << pulls[w * 2 + s].status();
      const v1::Pull& pull = *pulls[w * 2 + s];
      EXPECT_EQ(pull.step(), 0);
      EXPECT_EQ(pull.shard_id(), s);
      SparseVector part;
      GTOPK_ASSERT_OK(DecodeSparse(pull.sparse(), n, &part));
      EXPECT_EQ(pull.selected(), part.size());
      for (size_t j = 0; j < part.size(); ++j) {
        got.push_back(part.indices[j], part.values[j]);
      }
    }
    EXPECT_EQ(got.indices, expected.indices) << "worker " << w;
    EXPECT_EQ(FloatBits(got.values), FloatBits(expected.values))
        << "worker " << w;
  }

  // The servers applied the shared optimizer rule.
  GTOPK_ASSERT_OK_AND_ASSIGN(OptimizerRule rule,
                             OptimizerRule::Create(config.optimizer));
  std::vector<float> want = params;
  GTOPK_ASSERT_OK(rule.ApplyAggregated(expected, 0, 2, absl::MakeSpan(want),
                                       absl::Span<float>()));
  std::vector<float> all;
  for (uint32_t s = 0; s < 2; ++s) {
    GTOPK_ASSERT_OK_AND_ASSIGN(Downloaded d, Download(cluster.stub(s)));
    EXPECT_EQ(d.step, 1);
    all.insert(all.end(), d.values.begin(), d.values.end());
  }
  EXPECT_EQ(FloatBits(all), FloatBits(want));
}

// ---------------------------------------------------------------------------
// Bad input, one test per kind: the right status, and the step not applied.

class BadInputTest : public ::testing::Test {
 protected:
  static constexpr uint64_t kN = 16;

  void Start(AggregationMode mode = AggregationMode::kGtopk) {
    ServerConfig config = BaseConfig(1, 2);
    config.mode = mode;
    config.index_codec = IndexCodec::kRaw;
    config.max_message_bytes = 4096;
    absl::StatusOr<Cluster> cluster = StartCluster(config);
    ASSERT_TRUE(cluster.ok()) << cluster.status();
    cluster_ = *std::move(cluster);
    ASSERT_TRUE(Join(stub(), 0, kN).ok());
    ASSERT_TRUE(Join(stub(), 1, kN).ok());
    for (uint64_t i = 0; i < kN; ++i) params_.push_back(1.0f + i);
    ASSERT_TRUE(InitParams(stub(), 0, 0, 0, params_, 5).ok());
  }

  v1::Aggregator::Stub* stub() { return cluster_.stub(0); }

  // The step was not applied: same parameters (bits) and next step 0.
  void ExpectNotApplied() {
    absl::StatusOr<Downloaded> d = Download(stub());
    ASSERT_TRUE(d.ok()) << d.status();
    EXPECT_EQ(d->step, 0);
    EXPECT_EQ(FloatBits(d->values), FloatBits(params_));
    EXPECT_EQ(cluster_.servers[0]->service()->next_step(), 0);
  }

  std::string Good() { return RawMessage({1, 4}, {0.5f, -2.0f}); }

  Cluster cluster_;
  std::vector<float> params_;
};

TEST_F(BadInputTest, WrongStep) {
  Start();
  EXPECT_THAT(PushOnce(stub(), MakePush(5, 0, 0, Good())),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("step 5 is ahead of shard 0")));
  ExpectNotApplied();
}

TEST_F(BadInputTest, UnknownRank) {
  Start();
  EXPECT_THAT(PushOnce(stub(), MakePush(0, 7, 0, Good())),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("unknown worker rank 7")));
  ExpectNotApplied();
}

TEST_F(BadInputTest, OutOfRangeIndex) {
  Start();
  EXPECT_THAT(PushOnce(stub(), MakePush(0, 0, 0, RawMessage({3, 16}, {1, 1}))),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("index 16 >= n = 16")));
  ExpectNotApplied();
}

TEST_F(BadInputTest, UnsortedIndices) {
  Start();
  EXPECT_THAT(PushOnce(stub(), MakePush(0, 0, 0, RawMessage({5, 3}, {1, 1}))),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("not strictly ascending")));
  ExpectNotApplied();
}

TEST_F(BadInputTest, DuplicateIndex) {
  Start();
  EXPECT_THAT(
      PushOnce(stub(), MakePush(0, 0, 0, RawMessage({3, 3}, {1, 1}))),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("(duplicate)")));
  ExpectNotApplied();
}

TEST_F(BadInputTest, DenseLengthMismatch) {
  Start(AggregationMode::kDense);
  v1::Push push = MakePush(0, 0, 0, "");
  for (int i = 0; i < 5; ++i) push.add_dense(1.0f);
  EXPECT_THAT(PushOnce(stub(), push),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("dense push has 5 values, shard 0 owns 16")));
  ExpectNotApplied();
}

TEST_F(BadInputTest, NaNValue) {
  Start();
  EXPECT_THAT(
      PushOnce(
          stub(),
          MakePush(0, 0, 0,
                   RawMessage({2}, {std::numeric_limits<float>::quiet_NaN()}))),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("NaN")));
  ExpectNotApplied();
}

TEST_F(BadInputTest, WrongCodec) {
  Start();
  SparseVector v;
  v.push_back(2, 1.0f);
  const std::string varint =
      Encode(v, kN, CodecSpec{IndexCodec::kDeltaVarint, ValueCodec::kFp32});
  EXPECT_THAT(
      PushOnce(stub(), MakePush(0, 0, 0, varint)),
      StatusIs(absl::StatusCode::kInvalidArgument,
               HasSubstr("wrong codec: the push uses delta-varint/fp32, "
                         "the cluster uses raw/fp32")));
  ExpectNotApplied();
}

TEST_F(BadInputTest, CorruptBytes) {
  Start();
  std::string truncated = Good();
  truncated.resize(truncated.size() - 3);
  EXPECT_THAT(PushOnce(stub(), MakePush(0, 0, 0, truncated)),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("bad sparse push: invalid sparse message")));
  EXPECT_THAT(PushOnce(stub(), MakePush(0, 0, 0, "\x07\x00")),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("corrupt sparse push")));
  ExpectNotApplied();
}

TEST_F(BadInputTest, WrongShardId) {
  Start();
  EXPECT_THAT(PushOnce(stub(), MakePush(0, 0, 3, Good())),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("push for shard 3 was sent to shard 0")));
  ExpectNotApplied();
}

TEST_F(BadInputTest, OversizedMessage) {
  Start();
  // Over the server's max_message_bytes (4096): gRPC itself refuses it.
  EXPECT_THAT(PushOnce(stub(), MakePush(0, 0, 0, std::string(5000, 'x'))),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       HasSubstr("larger than max")));
  ExpectNotApplied();
}

TEST_F(BadInputTest, InitParamsFromWorkerOne) {
  Start();
  EXPECT_THAT(InitParams(stub(), 1, 0, 0, std::vector<float>(kN, 9.0f), 8),
              StatusIs(absl::StatusCode::kPermissionDenied,
                       HasSubstr("only worker 0")));
  ExpectNotApplied();
}

TEST_F(BadInputTest, BadPushFailsTheStepForTheOtherWorker) {
  Start();
  // Worker 1 pushes a good step 0 and waits; worker 0's bad push fails the
  // round: worker 1 gets ABORTED naming the fault, nothing is applied.
  absl::StatusOr<v1::Pull> other = absl::UnknownError("");
  std::thread t([&] { other = PushOnce(stub(), MakePush(0, 1, 0, Good())); });
  absl::SleepFor(absl::Milliseconds(200));
  EXPECT_THAT(
      PushOnce(stub(), MakePush(0, 0, 0, RawMessage({3, 3}, {1, 1}))),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("duplicate")));
  t.join();
  EXPECT_THAT(other,
              StatusIs(absl::StatusCode::kAborted, HasSubstr("duplicate")));
  ExpectNotApplied();
}

// ---------------------------------------------------------------------------

// Found by a break-it run: the first Join fixes n (up to 2^32), and
// InitParams reserved the shard's whole range from it (16 GiB at n = 2^32,
// S = 1); a server without that memory let std::bad_alloc reach gRPC,
// which answered UNKNOWN "Unexpected error in RPC handling". It is now
// RESOURCE_EXHAUSTED naming the range, and the shard stays up,
// uninitialised. The memory is capped with RLIMIT_AS (2 GiB above what the
// process maps) while the call runs.
TEST(ServiceTest, InitParamsOfARangeThatDoesNotFitIsResourceExhausted) {
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  GTEST_SKIP() << "RLIMIT_AS cannot cap a sanitizer's shadow mappings";
#else
  ServerConfig config = BaseConfig(1, 1);
  absl::StatusOr<Cluster> cluster = StartCluster(config);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  constexpr uint64_t kHugeN = uint64_t{1} << 32;  // the most Join accepts
  ASSERT_TRUE(Join(cluster->stub(0), 0, kHugeN).ok());
  absl::StatusOr<bool> taken;
  {
    ::gtopk::testing::ScopedAddressSpaceCap cap(uint64_t{2} << 30);
    ASSERT_TRUE(cap.ok());
    taken =
        InitParams(cluster->stub(0), 0, 0, 0, std::vector<float>(8, 1.0f), 8);
  }
  EXPECT_THAT(taken, StatusIs(absl::StatusCode::kResourceExhausted,
                              HasSubstr("cannot hold its range [0, "
                                        "4294967296) of 4294967296 "
                                        "parameters (17179869184 bytes)")));
  // Up and uninitialised: a download waits for parameters that never came.
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
  v1::ClusterSpec spec;
  EXPECT_TRUE(
      cluster->stub(0)->GetClusterSpec(&ctx, v1::JoinRequest(), &spec).ok());
  EXPECT_EQ(spec.n(), kHugeN);
  EXPECT_EQ(cluster->servers[0]->service()->next_step(), 0);
#endif
}

TEST(ServiceTest, CancelledWorkerMidStepGivesDeadlineExceededNamingIt) {
  ServerConfig config = BaseConfig(1, 2);
  config.step_timeout = absl::Milliseconds(500);
  GTOPK_ASSERT_OK_AND_ASSIGN(Cluster cluster, StartCluster(config));
  const uint64_t n = 8;
  ASSERT_TRUE(Join(cluster.stub(0), 0, n).ok());
  ASSERT_TRUE(Join(cluster.stub(0), 1, n).ok());
  ASSERT_TRUE(
      InitParams(cluster.stub(0), 0, 0, 0, std::vector<float>(n, 1.0f), 8)
          .ok());
  const std::string push = Encode(SparseVector{{1}, {0.5f}}, n, CodecSpec());
  grpc::ClientContext ctx0, ctx1;
  ctx0.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
  ctx1.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
  auto s0 = cluster.stub(0)->PushPull(&ctx0);
  auto s1 = cluster.stub(0)->PushPull(&ctx1);
  ASSERT_TRUE(s0->Write(MakePush(0, 0, 0, push)));
  ASSERT_TRUE(s1->Write(MakePush(0, 1, 0, push)));
  v1::Pull pull;
  ASSERT_TRUE(s0->Read(&pull));
  ASSERT_TRUE(s1->Read(&pull));
  EXPECT_EQ(pull.step(), 0);

  // Step 1: worker 0 pushes, worker 1's stream is cancelled mid-step.
  const absl::Time start = absl::Now();
  ASSERT_TRUE(s0->Write(MakePush(1, 0, 0, push)));
  absl::SleepFor(absl::Milliseconds(50));
  ctx1.TryCancel();
  EXPECT_FALSE(s0->Read(&pull));
  const grpc::Status status = s0->Finish();
  const absl::Duration took = absl::Now() - start;
  EXPECT_THAT(FromGrpcStatus(status),
              StatusIs(absl::StatusCode::kDeadlineExceeded,
                       HasSubstr("waiting for worker(s) 1")));
  EXPECT_LT(took, absl::Seconds(2));
  EXPECT_EQ(s1->Finish().error_code(), grpc::StatusCode::CANCELLED);
  EXPECT_EQ(cluster.servers[0]->service()->next_step(), 1);
}

// A Join for a rank whose worker has an open PushPull stream is a second
// worker with the same rank: ALREADY_EXISTS naming it (after the grace
// Join gives that stream to end). A stream cancelled in the middle of a
// step (here: its push waits in the round) may be a live worker that cut
// a failed step short and recovers next (issue 42), so the rank stays its
// holder's while the stream ends and for kRankRecoverHold (5 s) after:
// UNAVAILABLE, then free (the holder is taken for gone).
TEST(ServiceTest, JoinOfARankWithALiveStreamIsRejected) {
  ServerConfig config = BaseConfig(1, 2);
  config.step_timeout = absl::Seconds(30);
  GTOPK_ASSERT_OK_AND_ASSIGN(Cluster cluster, StartCluster(config));
  const uint64_t n = 8;
  ASSERT_TRUE(Join(cluster.stub(0), 0, n).ok());
  ASSERT_TRUE(Join(cluster.stub(0), 1, n).ok());
  ASSERT_TRUE(
      InitParams(cluster.stub(0), 0, 0, 0, std::vector<float>(n, 1.0f), 8)
          .ok());
  const std::string push = Encode(SparseVector{{1}, {0.5f}}, n, CodecSpec());
  // Rank 1's worker pushes step 0 and waits for rank 0.
  auto ctx1 = std::make_unique<grpc::ClientContext>();
  ctx1->set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(30)));
  auto s1 = cluster.stub(0)->PushPull(ctx1.get());
  ASSERT_TRUE(s1->Write(MakePush(0, 1, 0, push)));
  absl::SleepFor(absl::Milliseconds(200));
  EXPECT_THAT(Join(cluster.stub(0), 1, n),
              StatusIs(absl::StatusCode::kAlreadyExists,
                       AllOf(HasSubstr("rank 1 is already taken"),
                             HasSubstr("live worker"))));
  GTOPK_EXPECT_OK(Join(cluster.stub(0), 0, n));  // rank 0 has no stream
  // The worker of rank 1 cancels its stream in the middle of step 0.
  ctx1->TryCancel();
  (void)s1->Finish();
  s1.reset();
  ctx1.reset();
  const absl::Time cancelled = absl::Now();
  // Rank 0 pushes: the round ends, and with it rank 1's stream.
  {
    grpc::ClientContext ctx0;
    ctx0.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
    auto s0 = cluster.stub(0)->PushPull(&ctx0);
    ASSERT_TRUE(s0->Write(MakePush(0, 0, 0, push)));
    v1::Pull pull;
    EXPECT_TRUE(s0->Read(&pull));
    ctx0.TryCancel();
    (void)s0->Finish();
  }
  EXPECT_THAT(Join(cluster.stub(0), 1, n),
              StatusIs(absl::StatusCode::kUnavailable,
                       HasSubstr("stays reserved for its holder")));
  absl::StatusOr<v1::JoinResponse> again = absl::UnknownError("not tried");
  while (!again.ok() && absl::Now() - cancelled < absl::Seconds(20)) {
    again = Join(cluster.stub(0), 1, n);
    if (!again.ok()) absl::SleepFor(absl::Milliseconds(200));
  }
  GTOPK_EXPECT_OK(again.status());
  EXPECT_GE(absl::Now() - cancelled, absl::Seconds(4.5))
      << "the rank was free before kRankRecoverHold";
}

TEST(ServiceTest, ShutdownEndsWaitingStepsAndWritesCheckpoint) {
  const TempDir tmp("service_test");
  ASSERT_FALSE(tmp.path().empty());
  const char* dir = tmp.path().c_str();
  ServerConfig config = BaseConfig(1, 2);
  config.step_timeout = absl::Seconds(30);  // far beyond the test's bound
  config.checkpoint_dir = dir;              // checkpoint_every 0: on shutdown
  GTOPK_ASSERT_OK_AND_ASSIGN(Cluster cluster, StartCluster(config));
  const uint64_t n = 8;
  ASSERT_TRUE(Join(cluster.stub(0), 0, n).ok());
  ASSERT_TRUE(
      InitParams(cluster.stub(0), 0, 0, 0, std::vector<float>(n, 2.0f), 8)
          .ok());
  EXPECT_THAT(ReadCheckpoint(dir, 0),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("")));
  // Worker 0 waits in step 0 for worker 1, which never comes.
  absl::StatusOr<v1::Pull> waiting = absl::UnknownError("");
  std::thread t([&] {
    waiting = PushOnce(
        cluster.stub(0),
        MakePush(0, 0, 0, Encode(SparseVector{{1}, {1.0f}}, n, CodecSpec())));
  });
  absl::SleepFor(absl::Milliseconds(100));
  const absl::Time start = absl::Now();
  GTOPK_EXPECT_OK(cluster.servers[0]->Shutdown(absl::Milliseconds(200)));
  t.join();
  EXPECT_LT(absl::Now() - start, absl::Seconds(3));
  // Depending on who is first: our UNAVAILABLE or gRPC's cancellation.
  EXPECT_FALSE(waiting.ok());
  EXPECT_TRUE(absl::IsUnavailable(waiting.status()) ||
              absl::IsCancelled(waiting.status()))
      << waiting.status();
  GTOPK_ASSERT_OK_AND_ASSIGN(ShardCheckpoint c, ReadCheckpoint(dir, 0));
  EXPECT_EQ(c.next_step, 0);
  EXPECT_EQ(c.params, std::vector<float>(n, 2.0f));
}

TEST(ServiceTest, CheckpointRestartServesSameParameters) {
  const TempDir tmp("service_test");
  ASSERT_FALSE(tmp.path().empty());
  const char* dir = tmp.path().c_str();
  ServerConfig config = BaseConfig(1, 1);
  config.checkpoint_dir = dir;
  config.checkpoint_every = 1;
  const uint64_t n = 12;
  Downloaded before;
  {
    GTOPK_ASSERT_OK_AND_ASSIGN(Cluster cluster, StartCluster(config));
    ASSERT_TRUE(Join(cluster.stub(0), 0, n).ok());
    std::vector<float> params(n);
    for (uint64_t i = 0; i < n; ++i) params[i] = 0.3f * i;
    ASSERT_TRUE(InitParams(cluster.stub(0), 0, 0, 0, params, 5).ok());
    SparseVector v;
    v.push_back(2, 1.5f);
    v.push_back(9, -0.25f);
    GTOPK_ASSERT_OK_AND_ASSIGN(
        v1::Pull pull, PushOnce(cluster.stub(0),
                                MakePush(0, 0, 0, Encode(v, n, CodecSpec()))));
    EXPECT_EQ(pull.step(), 0);
    // Written by the every-step checkpoint, before any shutdown.
    GTOPK_ASSERT_OK_AND_ASSIGN(ShardCheckpoint c, ReadCheckpoint(dir, 0));
    EXPECT_EQ(c.next_step, 1);
    GTOPK_ASSERT_OK_AND_ASSIGN(before, Download(cluster.stub(0)));
    EXPECT_EQ(before.step, 1);
    EXPECT_NE(FloatBits(before.values), FloatBits(params));
  }
  GTOPK_ASSERT_OK_AND_ASSIGN(Cluster restarted, StartCluster(config));
  // No Join needed: the checkpoint carries n.
  GTOPK_ASSERT_OK_AND_ASSIGN(Downloaded after, Download(restarted.stub(0)));
  EXPECT_EQ(after.step, 1);
  EXPECT_EQ(FloatBits(after.values), FloatBits(before.values));
  GTOPK_ASSERT_OK_AND_ASSIGN(v1::JoinResponse join,
                             Join(restarted.stub(0), 0, n));
  EXPECT_EQ(join.cluster().next_step(), 1);
  EXPECT_THAT(
      Join(restarted.stub(0), 0, n + 1),
      StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("n = 12")));
}

// ---------------------------------------------------------------------------
// Workers apply (issue 41): the flags, the pulls, the divergence alarm, the
// buffers, the state blob and the resume.

ServerConfig WorkersConfig(uint32_t num_shards, uint32_t num_workers) {
  ServerConfig c = BaseConfig(num_shards, num_workers);
  c.apply = ApplyMode::kWorkers;
  return c;
}

// Joins ranks 0..P-1 (n parameters) and initialises every shard to `init`;
// returns the shards' ranges.
absl::StatusOr<std::vector<std::pair<uint64_t, uint64_t>>> JoinAndInit(
    Cluster& cluster, uint32_t workers, const std::vector<float>& init) {
  std::vector<std::pair<uint64_t, uint64_t>> ranges;
  for (uint32_t w = 0; w < workers; ++w) {
    GTOPK_ASSIGN_OR_RETURN(v1::JoinResponse join,
                           Join(cluster.stub(0), w, init.size()));
    if (w > 0) continue;
    for (int s = 0; s < join.cluster().shards_size(); ++s) {
      ranges.emplace_back(join.cluster().shards(s).begin(),
                          join.cluster().shards(s).end());
    }
  }
  for (uint32_t s = 0; s < ranges.size(); ++s) {
    std::vector<float> range(init.begin() + ranges[s].first,
                             init.begin() + ranges[s].second);
    GTOPK_RETURN_IF_ERROR(
        InitParams(cluster.stub(s), 0, s, ranges[s].first, range, 5).status());
  }
  return ranges;
}

TEST(WorkersApplyServiceTest,
     PullsRelayRankZeroBuffersAndChecksumsAreCompared) {
  ServerConfig config = WorkersConfig(2, 2);
  config.checksum_every = 1;
  GTOPK_ASSERT_OK_AND_ASSIGN(Cluster cluster, StartCluster(config));
  const uint64_t n = 40;
  std::vector<float> init(n);
  for (uint64_t i = 0; i < n; ++i) init[i] = 0.5f * i;
  GTOPK_ASSERT_OK_AND_ASSIGN(auto ranges, JoinAndInit(cluster, 2, init));
  const CodecSpec codec;
  // Pushes of `step`, worker w to shard s: one pair in the shard's range.
  auto round = [&](int64_t step, std::vector<uint64_t> checksums) {
    std::vector<absl::StatusOr<v1::Pull>> pulls(4, absl::UnknownError(""));
    std::vector<std::thread> threads;
    for (uint32_t w = 0; w < 2; ++w) {
      for (uint32_t s = 0; s < 2; ++s) {
        SparseVector part;
        part.push_back(static_cast<uint32_t>(ranges[s].first + w), 1.0f + w);
        v1::Push push = MakePush(step, w, s, Encode(part, n, codec));
        push.set_params_checksum(checksums[w]);
        if (w == 0 && s == 0) push.set_buffers(std::string("bn\0", 3));
        threads.emplace_back([&pulls, &cluster, w, s, push] {
          pulls[w * 2 + s] = PushOnce(cluster.stub(s), push);
        });
      }
    }
    for (auto& t : threads) t.join();
    return pulls;
  };
  auto pulls = round(0, {0x1234, 0x1234});
  for (uint32_t w = 0; w < 2; ++w) {
    for (uint32_t s = 0; s < 2; ++s) {
      const auto& pull = pulls[w * 2 + s];
      ASSERT_TRUE(pull.ok()) << pull.status();
      EXPECT_EQ(pull->buffers(), s == 0 ? std::string("bn\0", 3) : "")
          << "worker " << w << " shard " << s;
      SparseVector got;
      GTOPK_ASSERT_OK(DecodeSparse(pull->sparse(), n, &got));
      EXPECT_EQ(got.size(), 2u);  // the sum, not divided, not applied
    }
  }
  // The shards' parameters are still the initial broadcast.
  for (uint32_t s = 0; s < 2; ++s) {
    GTOPK_ASSERT_OK_AND_ASSIGN(Downloaded d, Download(cluster.stub(s)));
    EXPECT_EQ(d.step, 1);
    EXPECT_EQ(FloatBits(d.values),
              FloatBits(std::vector<float>(init.begin() + ranges[s].first,
                                           init.begin() + ranges[s].second)));
  }
  // Differing checksums: the step fails on both shards for both workers,
  // FAILED_PRECONDITION also where the leader's fail-fast forward came
  // first.
  pulls = round(1, {0x1234, 0x5678});
  for (const auto& pull : pulls) {
    EXPECT_THAT(pull.status(),
                StatusIs(absl::StatusCode::kFailedPrecondition,
                         AllOf(HasSubstr("the replicas' parameters differ"),
                               HasSubstr("0x0000000000001234 on rank 0"),
                               HasSubstr("0x0000000000005678 on rank 1"))));
  }
  for (uint32_t s = 0; s < 2; ++s) {
    EXPECT_EQ(cluster.servers[s]->service()->next_step(), 1);
  }
  // Buffers from rank 1 are a bad push.
  SparseVector one;
  one.push_back(1, 1.0f);
  v1::Push bad = MakePush(1, 1, 0, Encode(one, n, codec));
  bad.set_buffers("x");
  EXPECT_THAT(PushOnce(cluster.stub(0), bad),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("come only from worker 0")));
}

// InitParams with ParamsChunk.state pieces.
absl::StatusOr<bool> InitWithState(v1::Aggregator::Stub* stub, uint32_t shard,
                                   uint64_t offset,
                                   const std::vector<float>& values,
                                   const std::vector<std::string>& pieces) {
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
  v1::InitParamsResponse response;
  auto writer = stub->InitParams(&ctx, &response);
  for (size_t i = 0; i < std::max(values.size(), pieces.size()); ++i) {
    v1::ParamsChunk c;
    c.set_rank(0);
    c.set_member_token(Members().token[0]);
    c.set_cluster_fingerprint(Members().fingerprint);
    c.set_shard_id(shard);
    c.set_offset(offset + std::min(i, values.size()));
    if (i < values.size()) c.add_values(values[i]);
    if (i < pieces.size()) c.set_state(pieces[i]);
    if (!writer->Write(c)) break;
  }
  writer->WritesDone();
  const grpc::Status s = writer->Finish();
  if (!s.ok()) return FromGrpcStatus(s);
  return response.initialized_now();
}

TEST(WorkersApplyServiceTest, StateBlobRoundTripsThroughShardZero) {
  ServerConfig config = WorkersConfig(2, 1);
  config.download_chunk_bytes = 64 + 12;  // 3 values or 12 state bytes
  GTOPK_ASSERT_OK_AND_ASSIGN(Cluster cluster, StartCluster(config));
  const uint64_t n = 10;
  GTOPK_ASSERT_OK_AND_ASSIGN(v1::JoinResponse join,
                             Join(cluster.stub(0), 0, n));
  const uint64_t mid = join.cluster().shards(0).end();
  std::vector<float> init(n);
  for (uint64_t i = 0; i < n; ++i) init[i] = 1.5f * i;
  std::vector<float> first(init.begin(), init.begin() + mid);
  std::vector<float> second(init.begin() + mid, init.end());
  // Not to shard 1.
  EXPECT_THAT(InitWithState(cluster.stub(1), 1, mid, second, {"s"}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("state blob goes only to shard 0")));
  std::string blob;
  for (int i = 0; i < 50; ++i) blob.push_back(static_cast<char>(i * 7));
  blob[3] = '\0';
  std::vector<std::string> pieces = {blob.substr(0, 10),
                                     "",
                                     blob.substr(10, 1),
                                     blob.substr(11, 20),
                                     blob.substr(31),
                                     "",
                                     ""};
  GTOPK_ASSERT_OK_AND_ASSIGN(
      bool now, InitWithState(cluster.stub(0), 0, 0, first, pieces));
  EXPECT_TRUE(now);
  GTOPK_ASSERT_OK(InitWithState(cluster.stub(1), 1, mid, second, {}).status());
  // First initialisation wins, the blob included.
  GTOPK_ASSERT_OK_AND_ASSIGN(
      now, InitWithState(cluster.stub(0), 0, 0, first, {"other"}));
  EXPECT_FALSE(now);
  GTOPK_ASSERT_OK_AND_ASSIGN(Downloaded d0, Download(cluster.stub(0)));
  EXPECT_EQ(d0.state, blob);
  EXPECT_EQ(FloatBits(d0.values), FloatBits(first));
  EXPECT_GE(d0.chunks, 2 + 5);  // values in chunks of 3, 50 bytes in 12s
  GTOPK_ASSERT_OK_AND_ASSIGN(Downloaded d1, Download(cluster.stub(1)));
  EXPECT_TRUE(d1.state.empty());
  EXPECT_EQ(FloatBits(d1.values), FloatBits(second));
}

TEST(WorkersApplyServiceTest, StateBlobInServersModeIsRefused) {
  GTOPK_ASSERT_OK_AND_ASSIGN(Cluster cluster, StartCluster(BaseConfig(1, 1)));
  ASSERT_TRUE(Join(cluster.stub(0), 0, 4).ok());
  EXPECT_THAT(InitWithState(cluster.stub(0), 0, 0, {1, 2, 3, 4}, {"s"}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("--apply=servers")));
}

absl::StatusOr<v1::RecoverResponse> Resume(v1::Aggregator::Stub* stub,
                                           uint32_t worker, int64_t step) {
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
  v1::RecoverRequest request;
  request.set_rank(worker);
  request.set_failed_step(-1);
  request.set_member_token(Members().token[worker]);
  request.set_cluster_fingerprint(Members().fingerprint);
  request.set_resume(true);
  request.set_resume_step(step);
  v1::RecoverResponse response;
  const grpc::Status s = stub->Recover(&ctx, request, &response);
  if (!s.ok()) return FromGrpcStatus(s);
  return response;
}

TEST(WorkersApplyServiceTest, ResumeSetsTheStepOnEveryShard) {
  GTOPK_ASSERT_OK_AND_ASSIGN(Cluster cluster,
                             StartCluster(WorkersConfig(2, 1)));
  const uint64_t n = 20;
  GTOPK_ASSERT_OK_AND_ASSIGN(auto ranges,
                             JoinAndInit(cluster, 1, std::vector<float>(n, 1)));
  GTOPK_ASSERT_OK_AND_ASSIGN(v1::RecoverResponse r,
                             Resume(cluster.stub(0), 0, 5));
  EXPECT_EQ(r.next_step(), 5);
  EXPECT_TRUE(r.rolled_back());
  EXPECT_THAT(r.previous_steps(), ::testing::ElementsAre(0, 0));
  for (uint32_t s = 0; s < 2; ++s) {
    EXPECT_EQ(cluster.servers[s]->service()->next_step(), 5);
  }
  // Idempotent.
  GTOPK_ASSERT_OK_AND_ASSIGN(r, Resume(cluster.stub(0), 0, 5));
  EXPECT_EQ(r.next_step(), 5);
  EXPECT_FALSE(r.rolled_back());
  EXPECT_THAT(Resume(cluster.stub(0), 0, -1),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("resume_step must be >= 0")));
  // Step 5 runs on both shards; then back to step 2.
  const CodecSpec codec;
  std::vector<absl::StatusOr<v1::Pull>> pulls(2, absl::UnknownError(""));
  std::vector<std::thread> threads;
  for (uint32_t s = 0; s < 2; ++s) {
    SparseVector part;
    part.push_back(static_cast<uint32_t>(ranges[s].first), 1.0f);
    v1::Push push = MakePush(5, 0, s, Encode(part, n, codec));
    push.set_epoch(r.epoch());
    threads.emplace_back([&pulls, &cluster, s, push] {
      pulls[s] = PushOnce(cluster.stub(s), push);
    });
  }
  for (auto& t : threads) t.join();
  for (const auto& pull : pulls) {
    ASSERT_TRUE(pull.ok()) << pull.status();
    EXPECT_EQ(pull->step(), 5);
  }
  GTOPK_ASSERT_OK_AND_ASSIGN(r, Resume(cluster.stub(0), 0, 2));
  EXPECT_EQ(r.next_step(), 2);
  EXPECT_TRUE(r.rolled_back());
  EXPECT_THAT(r.previous_steps(), ::testing::ElementsAre(6, 6));
  for (uint32_t s = 0; s < 2; ++s) {
    EXPECT_EQ(cluster.servers[s]->service()->next_step(), 2);
  }
}

TEST(WorkersApplyServiceTest, ResumeIsRefusedInServersMode) {
  GTOPK_ASSERT_OK_AND_ASSIGN(Cluster cluster, StartCluster(BaseConfig(2, 1)));
  GTOPK_ASSERT_OK(JoinAndInit(cluster, 1, std::vector<float>(20, 1)).status());
  EXPECT_THAT(Resume(cluster.stub(0), 0, 5),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("resume is for --apply=workers")));
  for (uint32_t s = 0; s < 2; ++s) {
    EXPECT_EQ(cluster.servers[s]->service()->next_step(), 0);
  }
}

}  // namespace
}  // namespace server
}  // namespace gtopk
