// Layer-wise selection (--selection=layerwise) and overlapped steps
// (WorkerClient::BeginOverlappedStep / GradientReady / FinishOverlappedStep)
// against real servers, compared bit for bit with a plain single-process
// reference written here: per bucket piece, every worker's local top-k of
// u = residual + g, the sum over workers in rank order, its top-k, A/P.
#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <memory>
#include <ostream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/buckets.h"
#include "common/selector.h"
#include "common/status_macros.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/server_config.h"
#include "tests/testing/local_cluster.h"
#include "tests/testing/reference.h"
#include "tests/testing/status_matchers.h"
#include "worker/client.h"

namespace gtopk {
namespace {

using ::gtopk::testing::BitEqual;
using ::gtopk::testing::FloatBits;
using ::gtopk::testing::NormalVector;
using worker::ClientOptions;
using worker::WorkerClient;

// n = 910 in buckets of 300 values; with two shards ([0, 455), [455, 910))
// the bucket [300, 600) straddles the boundary, and the last piece
// [900, 910) is too small for any entry at density 0.02 (k = 18; its
// round(18 * 10 / 910) = 0): a bucket with nothing selected.
constexpr uint64_t kN = 910;
constexpr uint64_t kBucket = 300;
constexpr double kDensity = 0.02;
constexpr int kSteps = 4;

struct Case {
  int workers = 2;
  uint32_t shards = 2;
  bool overlapped = true;
};

void PrintTo(const Case& c, std::ostream* os) {
  *os << "P" << c.workers << "_S" << c.shards
      << (c.overlapped ? "_overlapped" : "_whole");
}

std::string CaseName(const ::testing::TestParamInfo<Case>& info) {
  return absl::StrCat("P", info.param.workers, "_S", info.param.shards,
                      info.param.overlapped ? "_overlapped" : "_whole");
}

server::ServerConfig MakeConfig(int workers) {
  return ::gtopk::testing::LayerwiseConfig(workers, ApplyMode::kWorkers,
                                           kBucket, kDensity);
}

std::vector<float> Gradient(int step, int worker) {
  return NormalVector(kN, 7000 + 31 * step + worker);
}

// Top-k of a sparse vector by |value|, ties by lower index, sorted by index.
SparseVector PlainTopK(const SparseVector& v, uint64_t k) {
  std::vector<size_t> order(v.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return std::fabs(v.values[a]) > std::fabs(v.values[b]);
  });
  order.resize(std::min<size_t>(order.size(), k));
  std::sort(order.begin(), order.end());
  SparseVector out;
  for (size_t i : order) {
    out.indices.push_back(v.indices[i]);
    out.values.push_back(v.values[i]);
  }
  return out;
}

// The reference: every worker's residual, and each step's A/P.
struct Reference {
  std::vector<std::vector<float>> residual;
  std::vector<std::vector<float>> averaged;  // by step
};

Reference Simulate(int workers, const std::vector<uint64_t>& shard_begins) {
  Reference ref;
  ref.residual.assign(workers, std::vector<float>(kN, 0.0f));
  // The pieces, plainly: cut at every multiple of the bucket size and at
  // every shard's first index.
  std::vector<uint64_t> cuts = shard_begins;
  for (uint64_t b = 0; b < kN; b += kBucket) cuts.push_back(b);
  std::sort(cuts.begin(), cuts.end());
  cuts.erase(std::unique(cuts.begin(), cuts.end()), cuts.end());
  struct Piece {
    uint64_t begin, end;
    uint64_t size() const { return end - begin; }
  };
  std::vector<Piece> pieces;
  for (size_t i = 0; i < cuts.size(); ++i) {
    pieces.push_back({cuts[i], i + 1 < cuts.size() ? cuts[i + 1] : kN});
  }
  const uint64_t k =
      ::gtopk::testing::OkOrThrow(KFromDensity(kDensity, kN), "KFromDensity");
  for (int t = 0; t < kSteps; ++t) {
    std::vector<std::vector<float>> u(workers);
    std::vector<std::vector<bool>> sent(workers, std::vector<bool>(kN, false));
    std::vector<float> sum(kN, 0.0f);
    std::vector<bool> present(kN, false);
    for (int w = 0; w < workers; ++w) {
      const std::vector<float> g = Gradient(t, w);
      u[w].resize(kN);
      for (uint64_t i = 0; i < kN; ++i) u[w][i] = ref.residual[w][i] + g[i];
    }
    std::vector<float> avg(kN, 0.0f);
    std::vector<bool> global(kN, false);
    for (const Piece& p : pieces) {
      // round(k * size / n), halves up.
      const uint64_t kp = (2 * k * p.size() + kN) / (2 * kN);
      if (kp == 0) continue;
      for (int w = 0; w < workers; ++w) {  // rank order
        SparseVector dense_piece;
        for (uint64_t i = p.begin; i < p.end; ++i) {
          dense_piece.indices.push_back(static_cast<uint32_t>(i));
          dense_piece.values.push_back(u[w][i]);
        }
        for (uint32_t i : PlainTopK(dense_piece, kp).indices) {
          sent[w][i] = true;
          sum[i] = present[i] ? sum[i] + u[w][i] : u[w][i];
          present[i] = true;
        }
      }
      SparseVector piece_sum;
      for (uint64_t i = p.begin; i < p.end; ++i) {
        if (!present[i]) continue;
        piece_sum.indices.push_back(static_cast<uint32_t>(i));
        piece_sum.values.push_back(sum[i]);
      }
      for (uint32_t i : PlainTopK(piece_sum, kp).indices) {
        global[i] = true;
        avg[i] = sum[i] / static_cast<float>(workers);
      }
    }
    for (int w = 0; w < workers; ++w) {
      for (uint64_t i = 0; i < kN; ++i) {
        ref.residual[w][i] = sent[w][i] && global[i] ? 0.0f : u[w][i];
      }
    }
    ref.averaged.push_back(std::move(avg));
  }
  return ref;
}

std::unique_ptr<WorkerClient> ConnectWorker(const std::string& leader,
                                            int rank) {
  ClientOptions o;
  o.leader_address = leader;
  o.requested_rank = rank;
  o.n = kN;
  o.rpc_timeout = absl::Seconds(20);
  return ::gtopk::testing::OkOrThrow(WorkerClient::Connect(o), "Connect");
}

// `workers` clients, ranks in order, and the shards' first indices.
std::vector<std::unique_ptr<WorkerClient>> ConnectWorkers(
    const std::string& leader, int workers, std::vector<uint64_t>* begins) {
  std::vector<std::unique_ptr<WorkerClient>> clients;
  for (int w = 0; w < workers; ++w) clients.push_back(ConnectWorker(leader, w));
  for (const auto& s : clients[0]->cluster().shards()) {
    begins->push_back(s.begin());
  }
  return clients;
}

// The rest of an overlapped step's backward pass, as an autograd pass
// would run it: the gradient buffer (NaN since before Begin: a value read
// before it is reported fails the step) is filled and reported in chunks
// of 97 values from the end (the backward pass produces the last layers
// first), `stop_after` values at most.
absl::Status ReportInChunks(WorkerClient& client, const std::vector<float>& g,
                            std::vector<float>& buffer, uint64_t stop_after) {
  uint64_t end = kN, reported = 0;
  while (end > 0 && reported < stop_after) {
    const uint64_t begin = end >= 97 ? end - 97 : 0;
    std::copy(g.begin() + begin, g.begin() + end, buffer.begin() + begin);
    GTOPK_RETURN_IF_ERROR(client.GradientReady(begin, end));
    reported += end - begin;
    end = begin;
    absl::SleepFor(absl::Microseconds(200));  // the rest of backward
  }
  return absl::OkStatus();
}

// One overlapped step (--apply=workers) run as ReportInChunks does.
absl::StatusOr<worker::StepStats> OverlappedStep(
    WorkerClient& client, const std::vector<float>& g,
    std::vector<float>& buffer, std::vector<float>& averaged,
    const std::vector<float>& params, uint64_t stop_after = kN) {
  std::fill(buffer.begin(), buffer.end(),
            std::numeric_limits<float>::quiet_NaN());
  GTOPK_RETURN_IF_ERROR(
      client.BeginOverlappedStep(buffer, absl::MakeSpan(averaged), params));
  GTOPK_RETURN_IF_ERROR(ReportInChunks(client, g, buffer, stop_after));
  if (stop_after < kN) {
    // Time for the selection thread to release shard 1's push (its range
    // [455, 910) was reported): the failure then strikes a round that is
    // under way on one shard.
    absl::SleepFor(absl::Milliseconds(500));
    client.AbandonOverlappedStep();
    return absl::CancelledError("abandoned in the backward pass");
  }
  return client.FinishOverlappedStep();
}

// One overlapped host step with --apply=servers: `params` updated.
absl::StatusOr<worker::StepStats> OverlappedServersStep(
    WorkerClient& client, const std::vector<float>& g,
    std::vector<float>& buffer, std::vector<float>& params) {
  std::fill(buffer.begin(), buffer.end(),
            std::numeric_limits<float>::quiet_NaN());
  GTOPK_RETURN_IF_ERROR(
      client.BeginOverlappedStep(buffer, absl::MakeSpan(params)));
  GTOPK_RETURN_IF_ERROR(ReportInChunks(client, g, buffer, kN));
  return client.FinishOverlappedStep();
}

// Every worker on its own thread: SynchronizeParameters of params[w],
// then `step(w, t, params[w], buffer)` for t = 0 .. kSteps-1 (each must
// return step t's stats); the first failure per worker.
std::vector<absl::Status> RunWorkers(
    std::vector<std::unique_ptr<WorkerClient>>& clients,
    std::vector<std::vector<float>>& params,
    const std::function<absl::StatusOr<worker::StepStats>(
        int, int, std::vector<float>&, std::vector<float>&)>& step) {
  std::vector<absl::Status> status(clients.size());
  std::vector<std::thread> threads;
  for (size_t w = 0; w < clients.size(); ++w) {
    threads.emplace_back([&, w] {
      std::vector<float>& p = params[w];
      status[w] = clients[w]->SynchronizeParameters(absl::MakeSpan(p)).status();
      std::vector<float> buffer(kN);
      for (int t = 0; t < kSteps && status[w].ok(); ++t) {
        absl::StatusOr<worker::StepStats> st =
            step(static_cast<int>(w), t, p, buffer);
        status[w] = st.status();
        if (st.ok() && st->step != t) {
          status[w] = absl::InternalError(absl::StrCat("step ", st->step));
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  return status;
}

class OverlapTest : public ::testing::TestWithParam<Case> {};

TEST_P(OverlapTest, MatchesLayerwiseReferenceBitForBit) {
  const Case& c = GetParam();
  auto cluster_or =
      ::gtopk::testing::LocalCluster::Start(MakeConfig(c.workers), c.shards);
  ASSERT_TRUE(cluster_or.ok()) << cluster_or.status();
  ::gtopk::testing::LocalCluster& cluster = **cluster_or;
  std::vector<uint64_t> begins;
  std::vector<std::unique_ptr<WorkerClient>> clients =
      ConnectWorkers(cluster.leader(), c.workers, &begins);
  // The client cuts the same pieces as the reference.
  const std::vector<BucketPiece> expected_pieces =
      ::gtopk::testing::OkOrThrow(CutBucketPieces(kN, kBucket, begins), "cut");
  ASSERT_EQ(clients[0]->bucket_pieces().size(), expected_pieces.size());
  if (c.shards == 2) {
    // [300, 455) and [455, 600): the straddling bucket's two pieces.
    EXPECT_EQ(expected_pieces.size(), 5u);
  }
  const Reference ref = Simulate(c.workers, begins);

  std::vector<std::vector<float>> params(c.workers, NormalVector(kN, 99));
  std::vector<std::vector<std::vector<float>>> averaged(
      c.workers, std::vector<std::vector<float>>(kSteps));
  const std::vector<absl::Status> status = RunWorkers(
      clients, params,
      [&](int w, int t, std::vector<float>& p, std::vector<float>& buffer) {
        const std::vector<float> g = Gradient(t, w);
        averaged[w][t].assign(kN, -1.0f);
        return c.overlapped
                   ? OverlappedStep(*clients[w], g, buffer, averaged[w][t], p)
                   : clients[w]->AggregateStep(
                         g, absl::MakeSpan(averaged[w][t]), p);
      });
  for (int w = 0; w < c.workers; ++w) {
    ASSERT_TRUE(status[w].ok()) << "worker " << w << ": " << status[w];
    for (int t = 0; t < kSteps; ++t) {
      EXPECT_EQ(FloatBits(averaged[w][t]), FloatBits(ref.averaged[t]))
          << "worker " << w << " step " << t;
    }
    EXPECT_EQ(FloatBits(clients[w]->residual()), FloatBits(ref.residual[w]))
        << "worker " << w << " residual";
    EXPECT_EQ(clients[w]->next_step(), kSteps);
  }
  // The last piece selected nothing at any step.
  for (int t = 0; t < kSteps; ++t) {
    for (uint64_t i = 900; i < kN; ++i) {
      EXPECT_EQ(ref.averaged[t][i], 0.0f);
    }
  }
}

std::vector<Case> Cases() {
  std::vector<Case> cases;
  for (int p : {1, 2, 3}) {
    for (uint32_t s : {1u, 2u}) {
      for (bool overlapped : {true, false}) {
        cases.push_back(Case{p, s, overlapped});
      }
    }
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(All, OverlapTest, ::testing::ValuesIn(Cases()),
                         CaseName);

// The real servers say they take pushes in parts (ShardSpec.
// takes_push_parts: the leader in Join, shard 1 in GetClusterSpec), so the
// overlapped step sends parts (StepStats.parts_sent) and they answer with
// piece pulls and the committed pull: the step completes, with the
// reference's result.
TEST(OverlapPartsTest, TheServersSayTheyTakePartsAndGetThem) {
  auto cluster_or = ::gtopk::testing::LocalCluster::Start(MakeConfig(1), 2);
  ASSERT_TRUE(cluster_or.ok()) << cluster_or.status();
  std::vector<uint64_t> begins;
  std::vector<std::unique_ptr<WorkerClient>> clients =
      ConnectWorkers((*cluster_or)->leader(), 1, &begins);
  EXPECT_TRUE(clients[0]->servers_take_push_parts());
  const size_t pieces = clients[0]->bucket_pieces().size();
  ASSERT_EQ(pieces, 5u);
  const Reference ref = Simulate(1, begins);
  std::vector<std::vector<float>> params(1, NormalVector(kN, 99));
  std::vector<std::vector<float>> averaged(kSteps);
  std::vector<uint64_t> parts(kSteps, 0);
  const std::vector<absl::Status> status = RunWorkers(
      clients, params,
      [&](int, int t, std::vector<float>& p,
          std::vector<float>& buffer) -> absl::StatusOr<worker::StepStats> {
        averaged[t].assign(kN, -1.0f);
        absl::StatusOr<worker::StepStats> st =
            OverlappedStep(*clients[0], Gradient(t, 0), buffer, averaged[t], p);
        if (st.ok()) parts[t] = st->parts_sent;
        return st;
      });
  GTOPK_ASSERT_OK(status[0]);
  for (int t = 0; t < kSteps; ++t) {
    EXPECT_GT(parts[t], 0u) << "step " << t;
    EXPECT_LE(parts[t], pieces) << "step " << t;
    EXPECT_EQ(FloatBits(averaged[t]), FloatBits(ref.averaged[t]))
        << "step " << t;
  }
}

// Pieces ready together go as one part per run of a shard's consecutive
// pieces: rank 0 reports its whole gradient in one GradientReady, so its
// selection thread has all 5 pieces at once and sends 2 parts (one per
// shard: [0, 300) + [300, 455), and [455, 600) + [600, 900) + [900, 910)),
// while rank 1 reports in chunks as backward would (up to one part per
// piece). The shards' rounds take the differently cut parts together, and
// every step's result is the reference's, bit for bit.
TEST(OverlapPartsTest, PiecesReadyTogetherGoAsOnePartPerRun) {
  constexpr int kWorkers = 2;
  auto cluster_or =
      ::gtopk::testing::LocalCluster::Start(MakeConfig(kWorkers), 2);
  ASSERT_TRUE(cluster_or.ok()) << cluster_or.status();
  std::vector<uint64_t> begins;
  std::vector<std::unique_ptr<WorkerClient>> clients =
      ConnectWorkers((*cluster_or)->leader(), kWorkers, &begins);
  const size_t pieces = clients[0]->bucket_pieces().size();
  ASSERT_EQ(pieces, 5u);
  const Reference ref = Simulate(kWorkers, begins);
  std::vector<std::vector<float>> params(kWorkers, NormalVector(kN, 99));
  std::vector<std::vector<std::vector<float>>> averaged(
      kWorkers, std::vector<std::vector<float>>(kSteps));
  std::vector<std::vector<uint64_t>> parts(kWorkers,
                                           std::vector<uint64_t>(kSteps, 0));
  const std::vector<absl::Status> status = RunWorkers(
      clients, params,
      [&](int w, int t, std::vector<float>& p,
          std::vector<float>& buffer) -> absl::StatusOr<worker::StepStats> {
        averaged[w][t].assign(kN, -1.0f);
        const std::vector<float> g = Gradient(t, w);
        absl::StatusOr<worker::StepStats> st;
        if (w == 0) {
          buffer = g;
          GTOPK_RETURN_IF_ERROR(clients[0]->BeginOverlappedStep(
              buffer, absl::MakeSpan(averaged[w][t]), p));
          GTOPK_RETURN_IF_ERROR(clients[0]->GradientReady(0, kN));
          st = clients[0]->FinishOverlappedStep();
        } else {
          st = OverlappedStep(*clients[w], g, buffer, averaged[w][t], p);
        }
        if (st.ok()) parts[w][t] = st->parts_sent;
        return st;
      });
  for (int w = 0; w < kWorkers; ++w) {
    ASSERT_TRUE(status[w].ok()) << "worker " << w << ": " << status[w];
    for (int t = 0; t < kSteps; ++t) {
      EXPECT_EQ(FloatBits(averaged[w][t]), FloatBits(ref.averaged[t]))
          << "worker " << w << " step " << t;
      EXPECT_GT(parts[w][t], 0u);
      EXPECT_LE(parts[w][t], pieces);
    }
    EXPECT_EQ(FloatBits(clients[w]->residual()), FloatBits(ref.residual[w]))
        << "worker " << w << " residual";
  }
  EXPECT_EQ(parts[0], std::vector<uint64_t>(kSteps, 2u));
}

// A step given up in the middle of its buckets (an exception in the
// backward pass after shard 1's push went out): nothing is applied
// anywhere, the other worker's step fails, both recover, and the retry
// completes with exactly the results of a run without the failure.
TEST(OverlapFailureTest, AbandonedStepAppliesNothingAndTheRetryCompletes) {
  constexpr int kWorkers = 2;
  auto cluster_or =
      ::gtopk::testing::LocalCluster::Start(MakeConfig(kWorkers), 2);
  ASSERT_TRUE(cluster_or.ok()) << cluster_or.status();
  ::gtopk::testing::LocalCluster& cluster = **cluster_or;
  std::vector<uint64_t> begins;
  std::vector<std::unique_ptr<WorkerClient>> clients =
      ConnectWorkers(cluster.leader(), kWorkers, &begins);
  const Reference ref = Simulate(kWorkers, begins);
  const std::vector<float> params = NormalVector(kN, 99);
  constexpr int kFailingStep = 2;
  std::vector<std::vector<std::vector<float>>> averaged(
      kWorkers, std::vector<std::vector<float>>(kSteps));
  std::vector<absl::Status> status(kWorkers);
  std::vector<absl::Status> failed(kWorkers);
  std::vector<std::thread> threads;
  for (int w = 0; w < kWorkers; ++w) {
    threads.emplace_back([&, w] {
      std::vector<float> p = params;
      absl::StatusOr<int64_t> start =
          clients[w]->SynchronizeParameters(absl::MakeSpan(p));
      if (!start.ok()) {
        status[w] = start.status();
        return;
      }
      std::vector<float> buffer(kN);
      bool retry = false;
      for (int t = 0; t < kSteps;) {
        averaged[w][t].assign(kN, -1.0f);
        // Rank 0 gives up step 2 after shard 1's range ([455, 910)) and
        // a bit more was reported.
        const bool give_up = w == 0 && t == kFailingStep && !retry;
        // After a failed round the residual holds u: the retry sends a zero
        // gradient. After an abandoned step it is as before: the whole
        // gradient again.
        std::vector<float> g = Gradient(t, w);
        if (retry && w != 0) std::fill(g.begin(), g.end(), 0.0f);
        absl::StatusOr<worker::StepStats> st = OverlappedStep(
            *clients[w], g, buffer, averaged[w][t], p, give_up ? 500 : kN);
        if (st.ok()) {
          ++t;
          retry = false;
          continue;
        }
        if (retry || t != kFailingStep) {
          status[w] = st.status();
          return;
        }
        failed[w] = st.status();
        retry = true;
        absl::StatusOr<int64_t> at = clients[w]->Recover({});
        if (!at.ok() || *at != kFailingStep) {
          status[w] =
              at.ok()
                  ? absl::InternalError(absl::StrCat("recovered to step ", *at))
                  : at.status();
          return;
        }
        // The attempt wrote nothing.
        for (float x : averaged[w][t]) {
          if (x != -1.0f) {
            status[w] = absl::InternalError("averaged written by a failure");
            return;
          }
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int w = 0; w < kWorkers; ++w) {
    ASSERT_TRUE(status[w].ok()) << "worker " << w << ": " << status[w];
    EXPECT_FALSE(failed[w].ok()) << "worker " << w << " never failed";
    for (int t = 0; t < kSteps; ++t) {
      EXPECT_EQ(FloatBits(averaged[w][t]), FloatBits(ref.averaged[t]))
          << "worker " << w << " step " << t;
    }
    EXPECT_EQ(FloatBits(clients[w]->residual()), FloatBits(ref.residual[w]))
        << "worker " << w << " residual";
  }
  EXPECT_TRUE(absl::IsCancelled(failed[0])) << failed[0];
}

// A gradient written after it was reported (clipping between backward and
// the step) is refused: what was sent would not be what the caller holds.
// The step is given up (the residual as before it), and a checkpoint taken
// while a step is open holds the residual from before the step.
TEST(OverlapRefusalTest, AGradientWrittenAfterItsReportIsRefused) {
  auto cluster_or = ::gtopk::testing::LocalCluster::Start(MakeConfig(1), 2);
  ASSERT_TRUE(cluster_or.ok()) << cluster_or.status();
  std::unique_ptr<WorkerClient> client =
      ConnectWorker((*cluster_or)->leader(), 0);
  std::vector<float> p = NormalVector(kN, 99);
  GTOPK_ASSERT_OK(client->SynchronizeParameters(absl::MakeSpan(p)).status());
  // One good step, so that the residual is not all zero.
  std::vector<float> g = Gradient(0, 0), avg(kN, 0.0f);
  GTOPK_ASSERT_OK(client->BeginOverlappedStep(g, absl::MakeSpan(avg), p));
  GTOPK_ASSERT_OK(client->FinishOverlappedStep().status());
  const std::vector<float> before(client->residual().begin(),
                                  client->residual().end());

  g = Gradient(1, 0);
  GTOPK_ASSERT_OK(client->BeginOverlappedStep(g, absl::MakeSpan(avg), p));
  GTOPK_ASSERT_OK(client->GradientReady(0, kN));
  // The checkpoint of an open step: the residual from before it, whatever
  // the selection thread has accumulated meanwhile.
  absl::SleepFor(absl::Milliseconds(100));
  {
    absl::StatusOr<worker::WorkerState> state = client->ExportState();
    GTOPK_ASSERT_OK(state.status());
    EXPECT_TRUE(BitEqual(state->residual, before));
    EXPECT_EQ(state->next_step, 1);
  }
  g[123] *= 0.5f;  // "clipping" after the report
  EXPECT_THAT(client->FinishOverlappedStep().status(),
              ::gtopk::testing::StatusIs(
                  absl::StatusCode::kFailedPrecondition,
                  ::testing::HasSubstr("gradient at index 123 was written")));
  EXPECT_FALSE(client->overlapped_step_open());
  EXPECT_TRUE(BitEqual(client->residual(), before));
  EXPECT_EQ(client->next_step(), 1);
}

TEST(OverlapRefusalTest, BadCallsAreRefusedAndChangeNothing) {
  auto cluster_or = ::gtopk::testing::LocalCluster::Start(MakeConfig(1), 2);
  ASSERT_TRUE(cluster_or.ok()) << cluster_or.status();
  std::unique_ptr<WorkerClient> client =
      ConnectWorker((*cluster_or)->leader(), 0);
  std::vector<float> p = NormalVector(kN, 99);
  GTOPK_ASSERT_OK(client->SynchronizeParameters(absl::MakeSpan(p)).status());
  std::vector<float> g(kN, 1.0f), avg(kN, 0.0f);
  EXPECT_THAT(
      client->GradientReady(0, 10),
      ::gtopk::testing::StatusIs(absl::StatusCode::kFailedPrecondition));
  EXPECT_THAT(
      client->FinishOverlappedStep().status(),
      ::gtopk::testing::StatusIs(absl::StatusCode::kFailedPrecondition));
  GTOPK_ASSERT_OK(client->BeginOverlappedStep(g, absl::MakeSpan(avg), p));
  EXPECT_THAT(
      client->BeginOverlappedStep(g, absl::MakeSpan(avg), p),
      ::gtopk::testing::StatusIs(absl::StatusCode::kFailedPrecondition));
  GTOPK_EXPECT_OK(client->GradientReady(100, 200));
  EXPECT_THAT(client->GradientReady(150, 250),
              ::gtopk::testing::StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(client->GradientReady(50, 101),
              ::gtopk::testing::StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(client->GradientReady(5, 5),
              ::gtopk::testing::StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(client->GradientReady(900, kN + 1),
              ::gtopk::testing::StatusIs(absl::StatusCode::kInvalidArgument));
  GTOPK_EXPECT_OK(client->GradientReady(200, 300));  // adjacent is fine
  // A non-finite gradient fails the selection: nothing changed.
  const std::vector<float> before(client->residual().begin(),
                                  client->residual().end());
  g[700] = std::numeric_limits<float>::infinity();
  EXPECT_THAT(client->FinishOverlappedStep().status(),
              ::gtopk::testing::StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_FALSE(client->overlapped_step_open());
  EXPECT_TRUE(BitEqual(client->residual(), before));
  EXPECT_EQ(client->next_step(), 0);
  // Shard 0's push had gone out (its pieces came first): the step failed
  // everywhere, so the retry follows a Recover, as after any failed step.
  GTOPK_ASSERT_OK(client->Recover({}).status());
  g[700] = 1.0f;
  GTOPK_ASSERT_OK(client->BeginOverlappedStep(g, absl::MakeSpan(avg), p));
  auto st = client->FinishOverlappedStep();
  GTOPK_ASSERT_OK(st.status());
  EXPECT_EQ(st->step, 0);
  EXPECT_EQ(client->next_step(), 1);
}

// --apply=servers on the host (BeginOverlappedStep(gradient, params)): the
// same layer-wise rounds, with the servers' update applied to the replica's
// parameters. The rule here is the identity (lr 1, no momentum, no weight
// decay), so u = residual + g as in the reference, and the update of step
// t is params -= A/P at the globally selected indices: the reference's
// averaged[t], subtracted. Both the overlapped step and the plain Step
// must give those parameters (and residuals) bit for bit.
server::ServerConfig ServersApplyConfig(int workers) {
  return ::gtopk::testing::LayerwiseConfig(workers, ApplyMode::kServers,
                                           kBucket, kDensity);
}

class ServersApplyOverlapTest : public ::testing::TestWithParam<Case> {};

TEST_P(ServersApplyOverlapTest, MatchesLayerwiseReferenceBitForBit) {
  const Case& c = GetParam();
  auto cluster_or = ::gtopk::testing::LocalCluster::Start(
      ServersApplyConfig(c.workers), c.shards);
  ASSERT_TRUE(cluster_or.ok()) << cluster_or.status();
  std::vector<uint64_t> begins;
  std::vector<std::unique_ptr<WorkerClient>> clients =
      ConnectWorkers((*cluster_or)->leader(), c.workers, &begins);
  const Reference ref = Simulate(c.workers, begins);
  const std::vector<float> initial = NormalVector(kN, 99);
  std::vector<float> expected = initial;
  for (int t = 0; t < kSteps; ++t) {
    for (uint64_t i = 0; i < kN; ++i) expected[i] -= ref.averaged[t][i];
  }
  ASSERT_FALSE(BitEqual(expected, initial));

  std::vector<std::vector<float>> params(c.workers, initial);
  const std::vector<absl::Status> status = RunWorkers(
      clients, params,
      [&](int w, int t, std::vector<float>& p, std::vector<float>& buffer) {
        const std::vector<float> g = Gradient(t, w);
        return c.overlapped ? OverlappedServersStep(*clients[w], g, buffer, p)
                            : clients[w]->Step(g, absl::MakeSpan(p));
      });
  for (int w = 0; w < c.workers; ++w) {
    ASSERT_TRUE(status[w].ok()) << "worker " << w << ": " << status[w];
    EXPECT_EQ(FloatBits(params[w]), FloatBits(expected)) << "worker " << w;
    EXPECT_EQ(FloatBits(clients[w]->residual()), FloatBits(ref.residual[w]))
        << "worker " << w << " residual";
    EXPECT_EQ(clients[w]->next_step(), kSteps);
  }
  auto servers = (*cluster_or)->ServerParams(kN);
  ASSERT_TRUE(servers.ok()) << servers.status();
  EXPECT_EQ(FloatBits(servers->first), FloatBits(expected));
}

INSTANTIATE_TEST_SUITE_P(All, ServersApplyOverlapTest,
                         ::testing::Values(Case{2, 2, true}, Case{2, 2, false},
                                           Case{3, 1, true}, Case{1, 2, true}),
                         CaseName);

// The cluster's full rule (lr 0.1, DGC momentum correction, weight decay:
// AccumulateLocal reads the parameters and writes the local velocity): the
// overlapped host step gives the plain Step's parameters, residual and
// velocity bit for bit, and a step abandoned after a piece was
// accumulated leaves the residual and the velocity as before it (also in
// a checkpoint taken while it was open).
TEST(ServersApplyOverlapTest, FullRuleMatchesStepAndAbandonRestoresState) {
  server::ServerConfig config = ServersApplyConfig(1);
  config.optimizer = server::ServerConfig().optimizer;
  config.optimizer.density = kDensity;
  config.optimizer.weight_decay = 1e-3f;
  ASSERT_EQ(config.optimizer.momentum_mode, MomentumMode::kDgcCorrection);
  std::vector<std::vector<float>> params;
  std::vector<worker::WorkerState> states;
  for (const bool overlapped : {true, false}) {
    auto cluster_or = ::gtopk::testing::LocalCluster::Start(config, 2);
    ASSERT_TRUE(cluster_or.ok()) << cluster_or.status();
    std::unique_ptr<WorkerClient> client =
        ConnectWorker((*cluster_or)->leader(), 0);
    std::vector<float> p = NormalVector(kN, 99), buffer(kN);
    GTOPK_ASSERT_OK(client->SynchronizeParameters(absl::MakeSpan(p)).status());
    for (int t = 0; t < kSteps; ++t) {
      const std::vector<float> g = Gradient(t, 0);
      if (!overlapped) {
        GTOPK_ASSERT_OK(client->Step(g, absl::MakeSpan(p)).status());
        continue;
      }
      if (t == 2) {
        // The first piece accumulated (shard 0's push waits for its second
        // piece, so nothing reaches the servers), then the step given up.
        absl::StatusOr<worker::WorkerState> before = client->ExportState();
        GTOPK_ASSERT_OK(before.status());
        const std::vector<float> p_before = p;
        GTOPK_ASSERT_OK(client->BeginOverlappedStep(g, absl::MakeSpan(p)));
        GTOPK_ASSERT_OK(client->GradientReady(0, kBucket));
        absl::SleepFor(absl::Milliseconds(200));
        absl::StatusOr<worker::WorkerState> open = client->ExportState();
        GTOPK_ASSERT_OK(open.status());
        client->AbandonOverlappedStep();
        absl::StatusOr<worker::WorkerState> after = client->ExportState();
        GTOPK_ASSERT_OK(after.status());
        for (const auto* s : {&*open, &*after}) {
          EXPECT_EQ(FloatBits(s->residual), FloatBits(before->residual));
          EXPECT_EQ(FloatBits(s->velocity), FloatBits(before->velocity));
          EXPECT_EQ(s->next_step, 2);
        }
        EXPECT_EQ(FloatBits(p), FloatBits(p_before));
        EXPECT_FALSE(BitEqual(before->velocity, std::vector<float>(kN, 0.0f)));
        GTOPK_ASSERT_OK(client->Recover(absl::MakeSpan(p)).status());
      }
      GTOPK_ASSERT_OK(OverlappedServersStep(*client, g, buffer, p).status());
    }
    EXPECT_EQ(client->next_step(), kSteps);
    absl::StatusOr<worker::WorkerState> state = client->ExportState();
    GTOPK_ASSERT_OK(state.status());
    states.push_back(*std::move(state));
    params.push_back(std::move(p));
  }
  EXPECT_EQ(FloatBits(params[0]), FloatBits(params[1]));
  EXPECT_EQ(FloatBits(states[0].residual), FloatBits(states[1].residual));
  EXPECT_EQ(FloatBits(states[0].velocity), FloatBits(states[1].velocity));
}

TEST(ServersApplyOverlapTest, WrongOverloadsAreRefused) {
  auto cluster_or =
      ::gtopk::testing::LocalCluster::Start(ServersApplyConfig(1), 2);
  ASSERT_TRUE(cluster_or.ok()) << cluster_or.status();
  std::unique_ptr<WorkerClient> client =
      ConnectWorker((*cluster_or)->leader(), 0);
  std::vector<float> p = NormalVector(kN, 99), g(kN, 1.0f), avg(kN);
  GTOPK_ASSERT_OK(client->SynchronizeParameters(absl::MakeSpan(p)).status());
  EXPECT_THAT(
      client->BeginOverlappedStep(g, absl::MakeSpan(avg), p),
      ::gtopk::testing::StatusIs(absl::StatusCode::kFailedPrecondition,
                                 ::testing::HasSubstr("--apply=servers")));
  std::vector<float> short_params(kN - 1);
  EXPECT_THAT(client->BeginOverlappedStep(g, absl::MakeSpan(short_params)),
              ::gtopk::testing::StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_FALSE(client->overlapped_step_open());
}

TEST(OverlapRefusalTest, ServersOverloadIsRefusedWhenWorkersApply) {
  auto cluster_or = ::gtopk::testing::LocalCluster::Start(MakeConfig(1), 1);
  ASSERT_TRUE(cluster_or.ok()) << cluster_or.status();
  std::unique_ptr<WorkerClient> client =
      ConnectWorker((*cluster_or)->leader(), 0);
  std::vector<float> p = NormalVector(kN, 99), g(kN, 1.0f);
  GTOPK_ASSERT_OK(client->SynchronizeParameters(absl::MakeSpan(p)).status());
  EXPECT_THAT(
      client->BeginOverlappedStep(g, absl::MakeSpan(p)),
      ::gtopk::testing::StatusIs(absl::StatusCode::kFailedPrecondition,
                                 ::testing::HasSubstr("--apply=workers")));
}

// One value per bucket (the break-it run: --bucket-mb=0.000004
// --density=0.5) on a model of 200,000 parameters cuts 200,000 pieces,
// more than a cluster may have (kMaxBucketPieces, common/buckets.h): the
// leader refuses the first Join, naming --bucket-mb, the count, the bound
// and the smallest value that fits, instead of steps that time out naming
// a worker. The refused Join fixes no n, so a model of 65,536 parameters
// (the bound: 65,536 pieces) joins the same servers and steps, plainly and
// overlapped with every value reported on its own (a part per piece); at
// density 0.5 each one-value piece keeps its value, so the average is
// (g0 + g1) / 2 at every index.
TEST(PieceBoundTest, TheLeaderRefusesTooManyPiecesAtJoinAndTheBoundSteps) {
  constexpr int kWorkers = 2;
  auto cluster_or = ::gtopk::testing::LocalCluster::Start(
      ::gtopk::testing::LayerwiseConfig(kWorkers, ApplyMode::kWorkers, 1, 0.5),
      2);
  ASSERT_TRUE(cluster_or.ok()) << cluster_or.status();
  const std::string leader = (*cluster_or)->leader();
  ClientOptions o;
  o.leader_address = leader;
  o.requested_rank = 0;
  o.n = 200000;
  o.rpc_timeout = absl::Seconds(20);
  EXPECT_THAT(
      WorkerClient::Connect(o).status(),
      ::gtopk::testing::StatusIs(
          absl::StatusCode::kFailedPrecondition,
          ::testing::AllOf(
              ::testing::HasSubstr("Join"),
              ::testing::HasSubstr(
                  "--bucket-mb 3.814697265625e-06 (buckets of 1 values)"),
              ::testing::HasSubstr("200000 bucket pieces, more than the "
                                   "65536"),
              ::testing::HasSubstr("at least 1.6e-05 (4 values)"))));

  const uint64_t n = kMaxBucketPieces;
  std::vector<std::unique_ptr<WorkerClient>> clients;
  for (int w = 0; w < kWorkers; ++w) {
    o.requested_rank = w;
    o.n = n;
    clients.push_back(
        ::gtopk::testing::OkOrThrow(WorkerClient::Connect(o), "Connect"));
  }
  ASSERT_EQ(clients[0]->bucket_pieces().size(), n);
  constexpr int kBoundSteps = 2;
  std::vector<std::vector<std::vector<float>>> g(kWorkers), averaged(kWorkers);
  std::vector<absl::Status> status(kWorkers);
  std::vector<std::thread> threads;
  for (int w = 0; w < kWorkers; ++w) {
    for (int t = 0; t < kBoundSteps; ++t) {
      g[w].push_back(NormalVector(n, 500 + 10 * t + w));
      averaged[w].emplace_back(n, -1.0f);
    }
    threads.emplace_back([&, w] {
      std::vector<float> params(n, 0.0f), buffer(n, 0.0f);
      status[w] =
          clients[w]->SynchronizeParameters(absl::MakeSpan(params)).status();
      if (!status[w].ok()) return;
      status[w] =
          clients[w]
              ->AggregateStep(g[w][0], absl::MakeSpan(averaged[w][0]), params)
              .status();
      if (!status[w].ok()) return;
      status[w] = clients[w]->BeginOverlappedStep(
          buffer, absl::MakeSpan(averaged[w][1]), params);
      for (uint64_t i = n; i-- > 0 && status[w].ok();) {
        buffer[i] = g[w][1][i];
        status[w] = clients[w]->GradientReady(i, i + 1);
      }
      if (!status[w].ok()) {
        clients[w]->AbandonOverlappedStep();
        return;
      }
      status[w] = clients[w]->FinishOverlappedStep().status();
    });
  }
  for (auto& t : threads) t.join();
  for (int w = 0; w < kWorkers; ++w) {
    ASSERT_TRUE(status[w].ok()) << "worker " << w << ": " << status[w];
    for (int t = 0; t < kBoundSteps; ++t) {
      std::vector<float> want(n);
      for (uint64_t i = 0; i < n; ++i) {
        want[i] = (g[0][t][i] + g[1][t][i]) / 2.0f;
      }
      EXPECT_EQ(FloatBits(averaged[w][t]), FloatBits(want))
          << "worker " << w << " step " << t;
    }
  }
}

}  // namespace
}  // namespace gtopk
