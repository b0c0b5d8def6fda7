// Layer-wise pushes in parts on the wire (docs/overlap.md, "Rounds per
// bucket"; proto Push.piece_begin/piece_end, Pull.committed), with raw
// PushPull streams against real servers: each part is answered by its piece
// pull before the worker's next part; a bad part after piece pulls went
// out fails the step on every shard and applies nothing, and the retry
// after Recover ends bit-identical to a cluster that never saw the failure.
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/buckets.h"
#include "common/codec.h"
#include "common/selector.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "prometheus/registry.h"
#include "server/server_config.h"
#include "tests/testing/exposition.h"
#include "tests/testing/local_cluster.h"
#include "tests/testing/reference.h"
#include "tests/testing/status_matchers.h"
#include "worker/client.h"

namespace gtopk {
namespace {

using ::gtopk::testing::BitEqual;
using ::gtopk::testing::OkOrThrow;

// n = 910 in buckets of 300 (as overlap_test): one shard: pieces [0, 300),
// [300, 600), [600, 900), [900, 910) with k_p 6, 6, 6, 0 at density 0.02;
// two shards ([0, 455), [455, 910)): [0, 300), [300, 455) | [455, 600),
// [600, 900), [900, 910).
constexpr uint64_t kN = 910;
constexpr uint64_t kBucket = 300;
constexpr double kDensity = 0.02;
const CodecSpec kCodec{IndexCodec::kDeltaVarint, ValueCodec::kFp32};

server::ServerConfig Config(int workers, ApplyMode apply) {
  return ::gtopk::testing::LayerwiseConfig(workers, apply, kBucket, kDensity);
}

std::chrono::system_clock::time_point Soon() {
  return absl::ToChronoTime(absl::Now() + absl::Seconds(15));
}

// A worker speaking the protocol itself: its rank, token and epoch, a stub
// per shard, and one open PushPull stream per shard.
struct RawWorker {
  std::vector<std::unique_ptr<v1::Aggregator::Stub>> stubs;
  v1::JoinResponse joined;
  uint64_t epoch = 0;
  uint64_t checksum = 0x5eed;  // Push.params_checksum of every push
  std::vector<std::unique_ptr<grpc::ClientContext>> contexts;
  std::vector<std::unique_ptr<grpc::ClientReaderWriter<v1::Push, v1::Pull>>>
      streams;

  static RawWorker Join(const std::vector<std::string>& peers, int rank) {
    RawWorker w;
    for (const std::string& peer : peers) {
      w.stubs.push_back(v1::Aggregator::NewStub(
          grpc::CreateChannel(peer, grpc::InsecureChannelCredentials())));
    }
    grpc::ClientContext ctx;
    ctx.set_deadline(Soon());
    v1::JoinRequest join;
    join.set_requested_rank(rank);
    join.set_n(kN);
    const grpc::Status st = w.stubs[0]->Join(&ctx, join, &w.joined);
    if (!st.ok()) throw std::runtime_error("Join: " + st.error_message());
    w.epoch = w.joined.epoch();
    return w;
  }
  const v1::ClusterSpec& spec() const { return joined.cluster(); }

  // Rank 0: every shard's initial parameters, 0.5 + (i % 5) / 8.
  void InitParams() {
    for (const v1::ShardSpec& shard : spec().shards()) {
      grpc::ClientContext ctx;
      ctx.set_deadline(Soon());
      v1::InitParamsResponse response;
      auto init = stubs[shard.shard_id()]->InitParams(&ctx, &response);
      v1::ParamsChunk chunk;
      chunk.set_rank(0);
      chunk.set_shard_id(shard.shard_id());
      chunk.set_offset(shard.begin());
      for (uint64_t i = shard.begin(); i < shard.end(); ++i) {
        chunk.add_values(0.5f + static_cast<float>(i % 5) / 8.0f);
      }
      chunk.set_member_token(joined.member_token());
      chunk.set_cluster_fingerprint(spec().cluster_fingerprint());
      init->Write(chunk);
      init->WritesDone();
      const grpc::Status st = init->Finish();
      if (!st.ok()) throw std::runtime_error("Init: " + st.error_message());
    }
  }

  // Opens a fresh stream to every shard.
  void Open() {
    streams.clear();
    contexts.clear();
    for (auto& stub : stubs) {
      contexts.push_back(std::make_unique<grpc::ClientContext>());
      contexts.back()->set_deadline(Soon());
      streams.push_back(stub->PushPull(contexts.back().get()));
    }
  }

  // This worker's push of `step` to `shard`: pieces [b, e) of the shard's
  // pieces (b == e == 0: the whole push); per piece its first k_p indices,
  // values from the rank and the index.
  v1::Push Push(int64_t step, uint32_t shard, uint32_t b, uint32_t e) const {
    const v1::ShardSpec& s = spec().shards(static_cast<int>(shard));
    std::vector<BucketPiece> pieces;
    const std::vector<BucketPiece> all = OkOrThrow(
        CutBucketPieces(kN, spec().bucket_size(), ShardBegins()), "Cut");
    for (const size_t i : PiecesIn(all, s.begin(), s.end())) {
      pieces.push_back(all[i]);
    }
    v1::Push push;
    push.set_step(step);
    push.set_rank(joined.rank());
    push.set_shard_id(shard);
    push.set_member_token(joined.member_token());
    push.set_cluster_fingerprint(spec().cluster_fingerprint());
    push.set_epoch(epoch);
    push.set_params_checksum(checksum);
    push.set_piece_begin(b);
    push.set_piece_end(e);
    const uint32_t first = b;
    const uint32_t last = e == 0 ? static_cast<uint32_t>(pieces.size()) : e;
    const uint64_t k = OkOrThrow(KFromDensity(kDensity, kN), "K");
    SparseVector v;
    for (uint32_t i = first; i < last; ++i) {
      for (uint64_t j = 0; j < PieceK(k, pieces[i].size(), kN); ++j) {
        const uint64_t at = pieces[i].begin + 3 * j + joined.rank();
        v.push_back(static_cast<uint32_t>(at),
                    0.01f * static_cast<float>((at % 11) + joined.rank()));
      }
    }
    EXPECT_TRUE(EncodeSparse(v, kN, kCodec, push.mutable_sparse()).ok());
    return push;
  }
  std::vector<uint64_t> ShardBegins() const {
    std::vector<uint64_t> begins;
    for (const auto& s : spec().shards()) begins.push_back(s.begin());
    return begins;
  }

  // Reads shard s's stream to its end; the status it ended with.
  grpc::Status Drain(uint32_t s) {
    v1::Pull ignored;
    while (streams[s]->Read(&ignored)) {
    }
    return streams[s]->Finish();
  }

  // After a failed step: Recover on the leader, the new attempt epoch.
  void Recover(int64_t failed_step) {
    grpc::ClientContext ctx;
    ctx.set_deadline(Soon());
    v1::RecoverRequest request;
    request.set_rank(joined.rank());
    request.set_failed_step(failed_step);
    request.set_member_token(joined.member_token());
    request.set_cluster_fingerprint(spec().cluster_fingerprint());
    v1::RecoverResponse response;
    const grpc::Status st = stubs[0]->Recover(&ctx, request, &response);
    if (!st.ok()) throw std::runtime_error("Recover: " + st.error_message());
    epoch = response.epoch();
  }
};

// Reads piece pulls from `stream` until `count` pieces came back, each
// once, in runs in any order; false when the stream ended first.
bool ReadAnyPieces(grpc::ClientReaderWriter<v1::Push, v1::Pull>& stream,
                   uint32_t count) {
  std::vector<bool> got(count, false);
  v1::Pull pull;
  for (uint32_t n = 0; n < count;) {
    if (!stream.Read(&pull) || pull.committed() || pull.piece_end() > count ||
        pull.piece_end() <= pull.piece_begin()) {
      return false;
    }
    for (uint32_t i = pull.piece_begin(); i < pull.piece_end(); ++i, ++n) {
      if (got[i]) return false;
      got[i] = true;
    }
  }
  return true;
}

// Reads piece pulls from `stream` until pieces [b, e) all came back (each
// once, in runs); false when the stream ended first.
bool ReadPieces(grpc::ClientReaderWriter<v1::Push, v1::Pull>& stream,
                uint32_t b, uint32_t e) {
  v1::Pull pull;
  for (uint32_t i = b; i < e;) {
    if (!stream.Read(&pull)) return false;
    EXPECT_FALSE(pull.committed());
    EXPECT_EQ(pull.piece_begin(), i);
    if (pull.piece_end() <= pull.piece_begin()) return false;
    i = pull.piece_end();
  }
  return true;
}

// Each shard says, in its own entry of the spec it answers with, that it
// takes pushes in parts (ShardSpec.takes_push_parts), and only for itself:
// the leader in Join and GetClusterSpec, shard 1 in the GetClusterSpec it
// forwards from the leader. The settings and fingerprint are unchanged by
// it (shard 1's answer is otherwise the leader's).
TEST(PieceWireTest, EachShardSaysItTakesPartsForItselfOnly) {
  auto cluster = OkOrThrow(
      ::gtopk::testing::LocalCluster::Start(Config(1, ApplyMode::kWorkers), 2),
      "Start");
  RawWorker w = RawWorker::Join(cluster->peers(), 0);
  ASSERT_EQ(w.spec().shards_size(), 2);
  EXPECT_TRUE(w.spec().shards(0).takes_push_parts());
  EXPECT_FALSE(w.spec().shards(1).takes_push_parts());
  for (uint32_t s = 0; s < 2; ++s) {
    grpc::ClientContext ctx;
    ctx.set_deadline(Soon());
    v1::ClusterSpec spec;
    const grpc::Status st =
        w.stubs[s]->GetClusterSpec(&ctx, v1::JoinRequest(), &spec);
    ASSERT_TRUE(st.ok()) << st.error_message();
    ASSERT_EQ(spec.shards_size(), 2);
    for (uint32_t t = 0; t < 2; ++t) {
      EXPECT_EQ(spec.shards(static_cast<int>(t)).takes_push_parts(), t == s)
          << "shard " << s << "'s answer, entry " << t;
    }
    EXPECT_EQ(spec.cluster_fingerprint(), w.spec().cluster_fingerprint());
  }
}

// P = 1, S = 1: each part is answered by its piece pull before the next
// part is written (the last pieces first, as backward produces them),
// every piece once, then the committed pull (no entries, the step's count
// selected); a whole push on the same stream is answered as before parts
// existed; a piece sent twice ends the stream with INVALID_ARGUMENT.
TEST(PieceWireTest, EachPiecePullComesBeforeTheNextPart) {
  server::ServerConfig config = Config(1, ApplyMode::kWorkers);
  auto registry = std::make_shared<prometheus::Registry>();
  config.metrics_registry = registry;
  auto cluster =
      OkOrThrow(::gtopk::testing::LocalCluster::Start(config, 1), "Start");
  // The shard's counters of parts and piece pulls (docs/metrics.md), read
  // after a committed pull: every part was taken and every piece pull
  // written before it.
  const auto counters = [&] {
    const auto samples =
        ::gtopk::testing::ParseSeries(::gtopk::testing::Serialize(*registry));
    return std::make_pair(
        ::gtopk::testing::SeriesValue(samples, "gtopk_server_push_parts_total"),
        ::gtopk::testing::SeriesValue(samples,
                                      "gtopk_server_piece_pulls_total"));
  };
  EXPECT_EQ(counters(), std::make_pair(0.0, 0.0));
  double piece_pulls = 0;
  RawWorker w = RawWorker::Join(cluster->peers(), 0);
  w.InitParams();
  w.Open();
  auto& stream = *w.streams[0];
  uint64_t selected = 0;
  for (const auto& [b, e] :
       std::vector<std::pair<uint32_t, uint32_t>>{{3, 4}, {1, 3}, {0, 1}}) {
    ASSERT_TRUE(stream.Write(w.Push(0, 0, b, e)));
    v1::Pull pull;
    for (uint32_t i = b; i < e;) {
      ASSERT_TRUE(stream.Read(&pull))
          << "no piece pull for [" << b << ", " << e
          << "): " << stream.Finish().error_message();
      EXPECT_FALSE(pull.committed());
      EXPECT_EQ(pull.piece_begin(), i);
      ASSERT_GT(pull.piece_end(), pull.piece_begin());
      SparseVector back;
      ASSERT_TRUE(DecodeSparse(pull.sparse(), kN, &back).ok());
      EXPECT_EQ(back.size(), pull.selected());
      selected += back.size();
      i = pull.piece_end();
      ++piece_pulls;
    }
  }
  v1::Pull pull;
  ASSERT_TRUE(stream.Read(&pull));
  EXPECT_TRUE(pull.committed());
  EXPECT_EQ(pull.piece_end(), 0u);
  EXPECT_TRUE(pull.sparse().empty());
  EXPECT_EQ(pull.selected(), selected);
  EXPECT_EQ(selected, 18u);
  EXPECT_EQ(counters(), std::make_pair(3.0, piece_pulls));
  // Step 1 as a whole push: one pull, as before parts existed.
  ASSERT_TRUE(stream.Write(w.Push(1, 0, 0, 0)));
  ASSERT_TRUE(stream.Read(&pull));
  EXPECT_FALSE(pull.committed());
  EXPECT_EQ(pull.step(), 1);
  EXPECT_EQ(pull.selected(), 18u);
  EXPECT_EQ(counters(), std::make_pair(3.0, piece_pulls));
  // Step 2: a piece twice.
  ASSERT_TRUE(stream.Write(w.Push(2, 0, 0, 2)));
  ASSERT_TRUE(ReadPieces(stream, 0, 2));
  ASSERT_TRUE(stream.Write(w.Push(2, 0, 1, 2)));
  const grpc::Status st = w.Drain(0);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(st.error_message(), ::testing::HasSubstr("sent twice"));
}

// P = 2, S = 2, the servers apply: both workers' parts of shard 1 and of
// shard 0's piece 0 are in and answered by their piece pulls, then worker 1
// sends shard 0's piece 0 again. The step fails on both shards (every
// stream ends with an error; shard 1 had computed its round and was in the
// commit vote), nothing is applied anywhere, and the retry after Recover
// (whole pushes) leaves the parameters bit-identical to a cluster that
// never saw the failure.
TEST(PieceWireTest, ABadPartAfterPiecePullsAppliesNothingOnAnyShard) {
  const server::ServerConfig config = Config(2, ApplyMode::kServers);
  auto cluster =
      OkOrThrow(::gtopk::testing::LocalCluster::Start(config, 2), "Start");
  auto clean =
      OkOrThrow(::gtopk::testing::LocalCluster::Start(config, 2), "Start");
  std::vector<RawWorker> w, c;
  for (int r = 0; r < 2; ++r) {
    w.push_back(RawWorker::Join(cluster->peers(), r));
    c.push_back(RawWorker::Join(clean->peers(), r));
  }
  w[0].InitParams();
  c[0].InitParams();
  const auto before = OkOrThrow(cluster->ServerParams(kN), "ServerParams");
  for (RawWorker& x : w) x.Open();
  for (RawWorker& x : w) {  // shard 1: pieces 0, 1, 2, last first
    for (uint32_t i = 3; i-- > 0;) {
      ASSERT_TRUE(x.streams[1]->Write(x.Push(0, 1, i, i + 1)));
    }
  }
  for (RawWorker& x : w) {
    ASSERT_TRUE(x.streams[0]->Write(x.Push(0, 0, 0, 1)));
  }
  for (RawWorker& x : w) {
    // Every piece of shard 1 and shard 0's piece 0 came back; not
    // committed (shard 0's piece 1 is missing).
    std::vector<bool> got(3, false);
    v1::Pull pull;
    for (int n = 0; n < 3;) {
      ASSERT_TRUE(x.streams[1]->Read(&pull));
      ASSERT_FALSE(pull.committed());
      for (uint32_t i = pull.piece_begin(); i < pull.piece_end(); ++i, ++n) {
        EXPECT_FALSE(got[i]);
        got[i] = true;
      }
    }
    ASSERT_TRUE(ReadPieces(*x.streams[0], 0, 1));
  }
  ASSERT_TRUE(w[1].streams[0]->Write(w[1].Push(0, 0, 0, 1)));
  const grpc::Status bad = w[1].Drain(0);
  EXPECT_EQ(bad.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
      << bad.error_message();
  // Worker 0's next part of shard 0 belongs to the failed attempt.
  w[0].streams[0]->Write(w[0].Push(0, 0, 1, 2));
  EXPECT_FALSE(w[0].Drain(0).ok());
  EXPECT_FALSE(w[0].Drain(1).ok());
  EXPECT_FALSE(w[1].Drain(1).ok());
  const auto failed = OkOrThrow(cluster->ServerParams(kN), "ServerParams");
  EXPECT_EQ(failed.second, 0);
  EXPECT_TRUE(BitEqual(failed.first, before.first));

  // The retry after Recover, and the same step on the clean cluster.
  for (RawWorker& x : w) x.Recover(0);
  for (std::vector<RawWorker>* group : {&w, &c}) {
    for (RawWorker& x : *group) {
      x.Open();
      for (uint32_t s = 0; s < 2; ++s) {
        ASSERT_TRUE(x.streams[s]->Write(x.Push(0, s, 0, 0)));
      }
    }
    for (RawWorker& x : *group) {
      for (uint32_t s = 0; s < 2; ++s) {
        v1::Pull pull;
        ASSERT_TRUE(x.streams[s]->Read(&pull)) << x.Drain(s).error_message();
        EXPECT_EQ(pull.step(), 0);
      }
    }
  }
  const auto retried = OkOrThrow(cluster->ServerParams(kN), "ServerParams");
  const auto plain = OkOrThrow(clean->ServerParams(kN), "ServerParams");
  EXPECT_EQ(retried.second, 1);
  EXPECT_EQ(plain.second, 1);
  EXPECT_TRUE(BitEqual(retried.first, plain.first));
  EXPECT_FALSE(BitEqual(retried.first, before.first));
}

// A WorkerClient's overlapped step (rank 0, --apply=workers, P = 2, S = 2)
// fails after piece pulls came back to it: rank 1 (a raw stream) sends its
// parts of shard 1 and of shard 0's piece 0, reads their piece pulls
// (which needed rank 0's parts), then sends shard 0's piece 0 again. Rank
// 0's FinishOverlappedStep fails and writes nothing (the piece pulls are
// discarded); both recover; the retry (rank 0: AggregateStep with a zero
// gradient, its residual holding u; rank 1: whole pushes) gives rank 0
// the average and residual, bit for bit, of a cluster without the failure.
TEST(PieceWireTest, AClientsStepFailsAfterPiecePullsAndItsRetryMatches) {
  server::ServerConfig config = Config(2, ApplyMode::kWorkers);
  config.checksum_every = 0;  // rank 1 sends no parameters' checksum
  struct Run {
    absl::Status failed;
    std::vector<float> averaged, residual, untouched;
  };
  auto run = [&](bool fail) {
    auto cluster =
        OkOrThrow(::gtopk::testing::LocalCluster::Start(config, 2), "Start");
    worker::ClientOptions o;
    o.leader_address = cluster->leader();
    o.requested_rank = 0;
    o.n = kN;
    o.rpc_timeout = absl::Seconds(20);
    auto client = OkOrThrow(worker::WorkerClient::Connect(o), "Connect");
    std::vector<float> params(kN, 0.25f), averaged(kN, -1.0f);
    OkOrThrow(client->SynchronizeParameters(absl::MakeSpan(params)), "Sync");
    RawWorker w1 = RawWorker::Join(cluster->peers(), 1);
    w1.checksum = 0;
    std::thread raw([&] {
      w1.Open();
      if (fail) {
        for (uint32_t i = 3; i-- > 0;) {
          w1.streams[1]->Write(w1.Push(0, 1, i, i + 1));
        }
        w1.streams[0]->Write(w1.Push(0, 0, 0, 1));
        EXPECT_TRUE(ReadAnyPieces(*w1.streams[1], 3));
        EXPECT_TRUE(ReadPieces(*w1.streams[0], 0, 1));
        w1.streams[0]->Write(w1.Push(0, 0, 0, 1));
        for (uint32_t s = 0; s < 2; ++s) EXPECT_FALSE(w1.Drain(s).ok());
        w1.Recover(0);
        w1.Open();
      }
      for (uint32_t s = 0; s < 2; ++s) {
        EXPECT_TRUE(w1.streams[s]->Write(w1.Push(0, s, 0, 0)));
      }
      v1::Pull pull;
      for (uint32_t s = 0; s < 2; ++s) EXPECT_TRUE(w1.streams[s]->Read(&pull));
    });
    Run r;
    std::vector<float> g = ::gtopk::testing::NormalVector(kN, 45);
    r.failed = client->BeginOverlappedStep(g, absl::MakeSpan(averaged), params);
    const std::vector<BucketPiece>& pieces = client->bucket_pieces();
    for (size_t i = pieces.size(); i-- > 0 && r.failed.ok();) {
      r.failed = client->GradientReady(pieces[i].begin, pieces[i].end);
    }
    if (r.failed.ok()) r.failed = client->FinishOverlappedStep().status();
    r.untouched = averaged;
    if (fail) {
      std::vector<float> none;
      EXPECT_TRUE(client->Recover(absl::MakeSpan(none)).ok());
      std::fill(g.begin(), g.end(), 0.0f);
      EXPECT_TRUE(
          client->AggregateStep(g, absl::MakeSpan(averaged), params).ok());
    }
    raw.join();
    r.averaged = averaged;
    r.residual.assign(client->residual().begin(), client->residual().end());
    return r;
  };
  const Run failing = run(true);
  const Run clean = run(false);
  GTOPK_EXPECT_OK(clean.failed);
  EXPECT_FALSE(failing.failed.ok());
  EXPECT_TRUE(BitEqual(failing.untouched, std::vector<float>(kN, -1.0f)));
  EXPECT_TRUE(BitEqual(failing.averaged, clean.averaged));
  EXPECT_TRUE(BitEqual(failing.residual, clean.residual));
  EXPECT_FALSE(BitEqual(clean.averaged, std::vector<float>(kN, -1.0f)));
}

}  // namespace
}  // namespace gtopk
