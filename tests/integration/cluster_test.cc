// In-process cluster on loopback: S real AggregatorServers (gRPC) and P
// WorkerClient threads, step by step against a single-process simulation of
// the same steps (the sequence of tests/common/gtopk_step_test.cc with the
// selection of common/merge.h). Every worker's parameters and residual, and
// the servers' parameters, must equal the simulation bit for bit.
#include <cstring>
#include <memory>
#include <ostream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/codec.h"
#include "common/error_feedback.h"
#include "common/merge.h"
#include "common/optimizer.h"
#include "common/selector.h"
#include "gtest/gtest.h"
#include "server/server_config.h"
#include "tests/testing/local_cluster.h"
#include "tests/testing/reference.h"
#include "tests/testing/status_matchers.h"
#include "worker/client.h"

namespace gtopk {
namespace {
using ::gtopk::testing::LocalCluster;
using worker::ClientOptions;
using worker::StepStats;
using worker::WorkerClient;

struct Case {
  std::string name;
  int workers = 2;
  uint32_t shards = 2;
  AggregationMode mode = AggregationMode::kGtopk;
  SelectionKind selection = SelectionKind::kThreshold;
  IndexCodec index_codec = IndexCodec::kRaw;
  ValueCodec value_codec = ValueCodec::kFp32;
  MomentumMode momentum = MomentumMode::kDgcCorrection;
  std::string selector = "exact";
  uint64_t n = 3001;
  double density = 0.01;
  int steps = 4;
  // Gradients are zero on the last shard's range (it receives nothing).
  bool starve_last_shard = false;
  // Every worker's gradient is zero at this step (-1: none).
  int zero_step = -1;
};

void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

constexpr uint64_t kSeed = 42;

std::vector<float> Gradient(const Case& c, int step, int worker,
                            uint64_t last_begin) {
  std::vector<float> g(c.n, 0.0f);
  if (step == c.zero_step) return g;
  std::mt19937_64 rng(kSeed * 1000003 + step * 101 + worker);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (float& x : g) x = normal(rng);
  if (c.starve_last_shard) {
    std::fill(g.begin() + last_begin, g.end(), 0.0f);
  }
  return g;
}

std::vector<float> InitialParams(const Case& c) {
  std::mt19937_64 rng(kSeed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> p(c.n);
  for (float& x : p) x = normal(rng);
  return p;
}

server::ServerConfig MakeConfig(const Case& c) {
  server::ServerConfig s;
  s.num_workers = c.workers;
  s.mode = c.mode;
  s.selection = c.selection;
  s.selector = c.selector;
  s.selector_seed = kSeed;
  s.index_codec = c.index_codec;
  s.value_codec = c.value_codec;
  s.optimizer.lr = 0.1f;
  s.optimizer.momentum = 0.9f;
  s.optimizer.momentum_mode = c.momentum;
  s.optimizer.density = c.density;
  s.optimizer.weight_decay = 0.0f;
  s.step_timeout = absl::Seconds(20);
  return s;
}

using ::gtopk::testing::BitEqual;

// The single-process simulation: every worker's state and the global
// selection, step by step.
struct Oracle {
  std::vector<std::vector<float>> params, velocity, global_v;
  std::vector<ErrorFeedback> ef;
  std::vector<std::unique_ptr<Selector>> selectors;
  std::vector<uint64_t> selected;  // |G| per step (dense: n)
};

Oracle Simulate(const Case& c, const std::vector<uint64_t>& bounds) {
  server::ServerConfig cfg = MakeConfig(c);
  const OptimizerRule rule = ::gtopk::testing::OkOrThrow(
      OptimizerRule::Create(cfg.optimizer), "OptimizerRule::Create");
  const CodecSpec codec{c.index_codec, c.value_codec};
  const uint64_t n = c.n;
  const int P = c.workers;
  Oracle o;
  o.params.assign(P, InitialParams(c));
  o.velocity.assign(P, std::vector<float>(n, 0.0f));
  o.global_v.assign(P, std::vector<float>(n, 0.0f));
  for (int w = 0; w < P; ++w) {
    o.ef.emplace_back(n);
    SelectorOptions so;
    so.seed = WorkerClient::SelectorSeedForRank(kSeed, w);
    auto s = CreateSelector(c.selector, so);
    EXPECT_TRUE(s.ok());
    o.selectors.push_back(*std::move(s));
  }
  for (int step = 0; step < c.steps; ++step) {
    const uint64_t k = *rule.KAt(step, n);
    std::vector<SparseVector> sent(P), received(P);
    std::vector<std::vector<float>> dense(P);
    for (int w = 0; w < P; ++w) {
      const std::vector<float> g =
          Gradient(c, step, w, bounds[bounds.size() - 2]);
      EXPECT_THAT(rule.AccumulateLocal(step, g, o.params[w],
                                       absl::MakeSpan(o.velocity[w]),
                                       o.ef[w].mutable_residual()),
                  testing::IsOk());
      if (c.mode == AggregationMode::kDense) {
        dense[w].assign(o.ef[w].residual().begin(), o.ef[w].residual().end());
        std::fill(o.ef[w].mutable_residual().begin(),
                  o.ef[w].mutable_residual().end(), 0.0f);
        continue;
      }
      EXPECT_THAT(o.selectors[w]->Select(o.ef[w].residual(), k, step, &sent[w]),
                  testing::IsOk());
      std::string wire;
      EXPECT_THAT(EncodeSparse(sent[w], n, codec, &wire), testing::IsOk());
      EXPECT_THAT(DecodeSparse(wire, n, &received[w]), testing::IsOk());
      EXPECT_THAT(o.ef[w].MarkSent(sent[w], received[w]), testing::IsOk());
    }
    if (c.mode == AggregationMode::kDense) {
      std::vector<float> sum = dense[0];
      for (int w = 1; w < P; ++w) {
        for (uint64_t i = 0; i < n; ++i) sum[i] += dense[w][i];
      }
      for (int w = 0; w < P; ++w) {
        EXPECT_THAT(
            rule.ApplyAggregatedDense(sum, P, absl::MakeSpan(o.params[w]),
                                      absl::MakeSpan(o.global_v[w])),
            testing::IsOk());
      }
      o.selected.push_back(n);
      continue;
    }
    SparseVector global;
    if (c.mode == AggregationMode::kTopk) {
      EXPECT_THAT(SparseSum(received, n, &global), testing::IsOk());
    } else if (c.selection == SelectionKind::kThreshold) {
      EXPECT_THAT(ReferenceGtopkStep(received, n, k, &global), testing::IsOk());
    } else {
      for (size_t s = 0; s + 1 < bounds.size(); ++s) {
        std::vector<SparseVector> slices(P);
        for (int w = 0; w < P; ++w) {
          for (size_t j = 0; j < received[w].size(); ++j) {
            const uint32_t i = received[w].indices[j];
            if (i >= bounds[s] && i < bounds[s + 1]) {
              slices[w].push_back(i, received[w].values[j]);
            }
          }
        }
        SparseVector sum, top;
        EXPECT_THAT(SparseSum(slices, n, &sum), testing::IsOk());
        const uint64_t range = bounds[s + 1] - bounds[s];
        const uint64_t quota = (k * range + n - 1) / n;
        if (quota > 0 && !sum.empty()) {
          EXPECT_THAT(SparseTopK(sum, quota, &top), testing::IsOk());
        }
        for (size_t j = 0; j < top.size(); ++j) {
          global.push_back(top.indices[j], top.values[j]);
        }
      }
    }
    o.selected.push_back(global.size());
    for (int w = 0; w < P; ++w) {
      if (c.mode == AggregationMode::kGtopk) {
        EXPECT_THAT(o.ef[w].PutBack(received[w], global), testing::IsOk());
      }
      EXPECT_THAT(
          rule.MaskMomentum(sent[w], global, absl::MakeSpan(o.velocity[w])),
          testing::IsOk());
      EXPECT_THAT(
          rule.ApplyAggregated(global, 0, P, absl::MakeSpan(o.params[w]),
                               absl::MakeSpan(o.global_v[w])),
          testing::IsOk());
    }
  }
  return o;
}

class ClusterTest : public ::testing::TestWithParam<Case> {};

TEST_P(ClusterTest, MatchesSingleProcessSimulation) {
  const Case& c = GetParam();
  auto cluster_or =
      ::gtopk::testing::LocalCluster::Start(MakeConfig(c), c.shards);
  ASSERT_TRUE(cluster_or.ok()) << cluster_or.status();
  ::gtopk::testing::LocalCluster& cluster = **cluster_or;

  std::vector<std::unique_ptr<WorkerClient>> clients(c.workers);
  for (int w = 0; w < c.workers; ++w) {
    ClientOptions o;
    o.leader_address = cluster.leader();
    o.requested_rank = w;
    o.n = c.n;
    o.rpc_timeout = absl::Seconds(20);
    auto client = WorkerClient::Connect(o);
    ASSERT_TRUE(client.ok()) << client.status();
    ASSERT_EQ((*client)->rank(), static_cast<uint32_t>(w));
    clients[w] = *std::move(client);
  }
  std::vector<uint64_t> bounds;
  for (const auto& s : clients[0]->cluster().shards())
    bounds.push_back(s.begin());
  bounds.push_back(c.n);

  std::vector<std::vector<float>> params(c.workers);
  std::vector<absl::Status> status(c.workers);
  std::vector<std::vector<StepStats>> stats(c.workers);
  std::vector<std::thread> threads;
  for (int w = 0; w < c.workers; ++w) {
    threads.emplace_back([&, w] {
      // Rank 0 offers the initial values; the others start from zeros and
      // must receive them by download.
      params[w] = w == 0 ? InitialParams(c) : std::vector<float>(c.n, 0.0f);
      auto step = clients[w]->SynchronizeParameters(absl::MakeSpan(params[w]));
      if (!step.ok()) {
        status[w] = step.status();
        return;
      }
      if (*step != 0) {
        status[w] = absl::InternalError(absl::StrCat("start step ", *step));
        return;
      }
      for (int s = 0; s < c.steps; ++s) {
        const std::vector<float> g =
            Gradient(c, s, w, bounds[bounds.size() - 2]);
        auto st = clients[w]->Step(g, absl::MakeSpan(params[w]));
        if (!st.ok()) {
          status[w] = st.status();
          return;
        }
        stats[w].push_back(*st);
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int w = 0; w < c.workers; ++w) {
    ASSERT_TRUE(status[w].ok()) << "worker " << w << ": " << status[w];
  }

  const Oracle oracle = Simulate(c, bounds);
  for (int w = 0; w < c.workers; ++w) {
    ASSERT_EQ(stats[w].size(), static_cast<size_t>(c.steps));
    for (int s = 0; s < c.steps; ++s) {
      EXPECT_EQ(stats[w][s].step, s);
      EXPECT_EQ(stats[w][s].received_pairs, oracle.selected[s])
          << "worker " << w << " step " << s;
    }
    if (c.starve_last_shard) {
      const uint64_t last = bounds[bounds.size() - 2];
      const std::vector<float> init = InitialParams(c);
      EXPECT_TRUE(BitEqual(absl::MakeSpan(params[w]).subspan(last),
                           absl::MakeSpan(init).subspan(last)))
          << "the starved shard's range changed";
    }
    EXPECT_TRUE(BitEqual(params[w], oracle.params[w]))
        << "worker " << w << " parameters differ from the simulation";
    EXPECT_TRUE(BitEqual(clients[w]->residual(), oracle.ef[w].residual()))
        << "worker " << w << " residual differs from the simulation";
    EXPECT_EQ(clients[w]->next_step(), c.steps);
  }
  auto server = cluster.ServerParams(c.n);
  ASSERT_TRUE(server.ok()) << server.status();
  EXPECT_EQ(server->second, c.steps);
  EXPECT_TRUE(BitEqual(server->first, oracle.params[0]))
      << "servers' parameters differ from the simulation";
}

std::vector<Case> Cases() {
  struct Codec {
    IndexCodec index;
    ValueCodec value;
    const char* name;
  };
  const Codec codecs[] = {
      {IndexCodec::kRaw, ValueCodec::kFp32, "raw_fp32"},
      {IndexCodec::kRaw, ValueCodec::kFp16, "raw_fp16"},
      {IndexCodec::kRaw, ValueCodec::kBf16, "raw_bf16"},
      {IndexCodec::kDeltaVarint, ValueCodec::kFp32, "varint_fp32"},
      {IndexCodec::kDeltaVarint, ValueCodec::kFp16, "varint_fp16"},
      {IndexCodec::kDeltaVarint, ValueCodec::kBf16, "varint_bf16"},
      {IndexCodec::kDeltaBitpack, ValueCodec::kFp32, "bitpack_fp32"},
      {IndexCodec::kDeltaBitpack, ValueCodec::kFp16, "bitpack_fp16"},
      {IndexCodec::kDeltaBitpack, ValueCodec::kBf16, "bitpack_bf16"},
  };
  const MomentumMode momenta[] = {MomentumMode::kDgcCorrection,
                                  MomentumMode::kNone, MomentumMode::kGlobal};
  std::vector<Case> cases;
  int rotation = 0;
  // The special cases below rotate through the codec pairs and momentum
  // modes; the grid covers every codec pair.
  auto add = [&](Case c, const std::string& prefix) {
    const Codec& codec = codecs[rotation % 9];
    c.index_codec = codec.index;
    c.value_codec = codec.value;
    c.momentum = momenta[rotation % 3];
    ++rotation;
    c.name = absl::StrCat(prefix, "_P", c.workers, "_S", c.shards, "_",
                          codec.name, "_", MomentumModeName(c.momentum));
    cases.push_back(c);
  };
  // The full product P x S x mode x index codec x value codec (540 cases,
  // ~50 ms each on loopback). Dense pushes carry no indices and fp32
  // values whatever the codecs, so its 9 codec pairs check that the codec
  // settings do not disturb it. Momentum modes rotate (each (P, S, mode)
  // sees all three across its codec pairs).
  struct ModeCase {
    AggregationMode mode;
    SelectionKind selection;
    const char* name;
  };
  const ModeCase modes[] = {
      {AggregationMode::kGtopk, SelectionKind::kThreshold, "gtopk_exact"},
      {AggregationMode::kGtopk, SelectionKind::kQuota, "gtopk_quota"},
      {AggregationMode::kTopk, SelectionKind::kThreshold, "topk"},
      {AggregationMode::kDense, SelectionKind::kThreshold, "dense"},
  };
  for (const ModeCase& m : modes) {
    for (int p : {1, 2, 3, 5, 8}) {
      for (uint32_t s : {1u, 2u, 3u}) {
        for (int codec = 0; codec < 9; ++codec) {
          Case c;
          c.workers = p;
          c.shards = s;
          c.mode = m.mode;
          c.selection = m.selection;
          rotation = codec;
          add(c, m.name);
        }
      }
    }
  }
  // k >= the number of distinct candidates: density 1 (k = n).
  {
    Case c;
    c.workers = 3;
    c.shards = 2;
    c.n = 257;
    c.density = 1.0;
    add(c, "density1");
  }
  // A tiny model: n smaller than S*P*k, shards of one or two entries.
  for (SelectionKind sel : {SelectionKind::kThreshold, SelectionKind::kQuota}) {
    Case c;
    c.workers = 5;
    c.shards = 3;
    c.n = 5;
    c.density = 0.4;
    c.selection = sel;
    add(c, sel == SelectionKind::kThreshold ? "tiny_exact" : "tiny_quota");
  }
  // Zero gradients everywhere at one step (pushes of zeros; with no momentum
  // and fresh residuals at step 0, all-zero values).
  {
    Case c;
    c.workers = 3;
    c.shards = 3;
    c.zero_step = 0;
    c.steps = 3;
    add(c, "zero_grad");
  }
  // The last shard's range receives nothing (its pushes are empty).
  for (SelectionKind sel : {SelectionKind::kThreshold, SelectionKind::kQuota}) {
    Case c;
    c.workers = 3;
    c.shards = 3;
    c.starve_last_shard = true;
    c.selection = sel;
    add(c,
        sel == SelectionKind::kThreshold ? "starved_exact" : "starved_quota");
  }
  // Randomized selectors: the per-rank seeds must match the simulation.
  for (const char* sel : {"randomk", "dgc", "gaussiank"}) {
    Case c;
    c.workers = 3;
    c.shards = 2;
    c.selector = sel;
    add(c, sel);
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Cluster, ClusterTest, ::testing::ValuesIn(Cases()),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           return info.param.name;
                         });

}  // namespace
}  // namespace gtopk
