// gtopk-worker's trainer without a cluster: the end-of-run replica check
// (a rank whose final parameters differ from the servers' fails the run)
// and the flag checks that must come before the join.
#include "worker/trainer/trainer.h"

#include <cmath>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "common/testing/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace gtopk {
namespace worker {
namespace {

using ::gtopk::testing::StatusIs;
using ::testing::AllOf;
using ::testing::HasSubstr;

TEST(TrainerTest, DifferingFinalChecksumsFailTheRun) {
  const uint64_t mine = Fnv1a64("abc", 3);
  const uint64_t servers = Fnv1a64("abd", 3);
  ASSERT_NE(mine, servers);
  EXPECT_THAT(CheckReplicaChecksums(2, mine, servers, 17),
              StatusIs(absl::StatusCode::kInternal,
                       AllOf(HasSubstr("rank 2's final parameters"),
                             HasSubstr("e71fa2190541574b"),  // FNV-1a("abc")
                             HasSubstr("at step 17"),
                             HasSubstr("differ from the servers'"))));
  GTOPK_EXPECT_OK(CheckReplicaChecksums(2, mine, mine, 17));
}

// Every flag that needs no cluster is checked by ValidateOptions, before
// any connection: the consistency checks (--mode, --selector, codecs,
// --density, --lr, --momentum) and the leader address's syntax.
TEST(TrainerTest, ValidateOptionsNamesTheFlag) {
  struct Case {
    const char* flag;
    std::function<void(TrainerOptions&)> edit;
  };
  const std::vector<Case> cases = {
      {"--server", [](TrainerOptions& o) { o.server = "nonsense"; }},
      {"--server", [](TrainerOptions& o) { o.server = "host:port"; }},
      {"--server", [](TrainerOptions& o) { o.server = "host:0"; }},
      {"--server", [](TrainerOptions& o) { o.server = "host:65536"; }},
      {"--server", [](TrainerOptions& o) { o.server = ":50051"; }},
      {"--rank", [](TrainerOptions& o) { o.rank = -2; }},
      {"--rank", [](TrainerOptions& o) { o.rank = 65536; }},
      {"--mode", [](TrainerOptions& o) { o.mode = "sparse"; }},
      {"--selector", [](TrainerOptions& o) { o.selector = "top"; }},
      {"--index-codec", [](TrainerOptions& o) { o.index_codec = "zip"; }},
      {"--value-codec", [](TrainerOptions& o) { o.value_codec = "fp8"; }},
      {"--density", [](TrainerOptions& o) { o.density = 2.0; }},
      {"--density", [](TrainerOptions& o) { o.density = 0.0; }},
      {"--lr", [](TrainerOptions& o) { o.lr = std::nan(""); }},
      {"--lr", [](TrainerOptions& o) { o.lr = -0.1; }},
      {"--momentum", [](TrainerOptions& o) { o.momentum = 1.0; }},
      {"--momentum", [](TrainerOptions& o) { o.momentum = -0.5; }},
      {"--epochs", [](TrainerOptions& o) { o.epochs = 0; }},
      {"--steps", [](TrainerOptions& o) { o.steps = -1; }},
      {"--train-limit", [](TrainerOptions& o) { o.train_limit = -1; }},
      {"--test-limit", [](TrainerOptions& o) { o.test_limit = -1; }},
      {"--eval-every", [](TrainerOptions& o) { o.eval_every = -1; }},
      {"--compute-ms", [](TrainerOptions& o) { o.compute_ms = -1; }},
  };
  for (const Case& c : cases) {
    TrainerOptions o;
    o.server = "127.0.0.1:50051";
    o.model = "synthetic:10";
    c.edit(o);
    EXPECT_THAT(ValidateOptions(o),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(c.flag)))
        << c.flag;
  }
  TrainerOptions ok;
  ok.server = "gtopk-shard-0.gtopk-shard:50051";
  ok.model = "synthetic:10";
  ok.mode = "topk";
  ok.selector = "dgc";
  ok.index_codec = "raw";
  ok.value_codec = "bf16";
  ok.density = 1.0;
  ok.lr = 0.5;
  ok.momentum = 0.0;
  GTOPK_EXPECT_OK(ValidateOptions(ok));
  ok.server = "[::1]:50051";
  GTOPK_EXPECT_OK(ValidateOptions(ok));
}

}  // namespace
}  // namespace worker
}  // namespace gtopk
