// libFuzzer harness: the cluster-spec checks
// (common/cluster_spec/cluster_spec.h and the server's
// CheckSameClusterSettings), fed a ClusterSpec as it arrives from the network:
// the leader's JoinResponse.cluster at a worker, the leader's GetClusterSpec
// answer at a non-leader shard.
//
// Input: bytes 0..3: the worker's rank; bytes 4..5: L; the next L bytes: a
// serialized ClusterSpec A ("here"); the rest: a ClusterSpec B ("there").
// Invariants checked:
//   - ValidateWorkerClusterSpec(A, A.n(), rank) is OK or INVALID_ARGUMENT /
//     FAILED_PRECONDITION; on OK the shards really tile [0, n) in id order
//     (checked here independently) and rank < P;
//   - on OK, what the worker builds next from the spec (OptimizerFromSpec
//     -> OptimizerRule::Create, CreateSelector, the codec and mode names)
//     either succeeds or fails with INVALID_ARGUMENT, never aborts; a codec
//     name that parses prints back as itself;
//   - ClusterFingerprint is never 0, is deterministic, and ignores the
//     shards' addresses, next_step and cluster_fingerprint;
//   - ClusterSpecDifferences(A, A) is empty; when ClusterSpecDifferences(A,
//     B) is not empty, the fingerprints differ (the fingerprint covers every
//     setting a difference can name);
//   - a worker that expects exactly A's settings (CheckExpectedSettings)
//     matches A when A's optimizer is valid;
//   - CheckSameClusterSettings(a valid shard config, A) is OK or
//     FAILED_PRECONDITION, and OK only when the config's settings spec shows
//     no difference with A.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>

#include "common/cluster_spec/cluster_spec.h"
#include "common/codec.h"
#include "common/optimizer.h"
#include "common/selector.h"
#include "fuzz/fuzz_check.h"
#include "google/protobuf/stubs/logging.h"
#include "gtopk/v1/gtopk.pb.h"
#include "server/server_config.h"

namespace {

using gtopk::fuzz::IsInputError;

void CheckWorkerAcceptance(const gtopk::v1::ClusterSpec& a, uint32_t rank) {
  using namespace gtopk;
  const absl::Status s = ValidateWorkerClusterSpec(a, a.n(), rank);
  if (!s.ok()) {
    FUZZ_CHECK(absl::IsInvalidArgument(s) || absl::IsFailedPrecondition(s),
               "ValidateWorkerClusterSpec: %s", s.ToString().c_str());
    FUZZ_CHECK(!s.message().empty(), "error without a message");
    return;
  }
  FUZZ_CHECK(a.num_workers() >= 1 && rank < a.num_workers(),
             "rank %u accepted with P = %u", rank, a.num_workers());
  FUZZ_CHECK(a.shards_size() >= 1, "no shards accepted");
  uint64_t covered = 0;
  for (int s = 0; s < a.shards_size(); ++s) {
    const v1::ShardSpec& sh = a.shards(s);
    FUZZ_CHECK(sh.shard_id() == static_cast<uint32_t>(s), "shard id order");
    FUZZ_CHECK(
        sh.begin() == covered && sh.begin() <= sh.end() && sh.end() <= a.n(),
        "shard %d range [%llu, %llu) of n = %llu accepted", s,
        static_cast<unsigned long long>(sh.begin()),
        static_cast<unsigned long long>(sh.end()),
        static_cast<unsigned long long>(a.n()));
    covered = sh.end();
  }
  FUZZ_CHECK(covered == a.n(), "ranges cover %llu of %llu",
             static_cast<unsigned long long>(covered),
             static_cast<unsigned long long>(a.n()));
  FUZZ_CHECK(a.step_timeout_ms() > 0, "step_timeout_ms 0 accepted");

  absl::StatusOr<OptimizerOptions> o = OptimizerFromSpec(a.optimizer());
  if (o.ok()) {
    absl::StatusOr<OptimizerRule> rule = OptimizerRule::Create(*o);
    FUZZ_CHECK(rule.ok() || IsInputError(rule.status()),
               "OptimizerRule::Create: %s", rule.status().ToString().c_str());
  } else {
    FUZZ_CHECK(absl::IsInvalidArgument(o.status()), "OptimizerFromSpec: %s",
               o.status().ToString().c_str());
  }
  SelectorOptions selector_options;
  selector_options.seed = a.selector_seed();
  auto selector = CreateSelector(a.selector(), selector_options);
  FUZZ_CHECK(selector.ok() || absl::IsInvalidArgument(selector.status()),
             "CreateSelector: %s", selector.status().ToString().c_str());
  if (auto index = ParseIndexCodec(a.index_codec()); index.ok()) {
    FUZZ_CHECK(IndexCodecName(*index) == a.index_codec(), "index codec name");
  } else {
    FUZZ_CHECK(absl::IsInvalidArgument(index.status()), "ParseIndexCodec");
  }
  if (auto value = ParseValueCodec(a.value_codec()); value.ok()) {
    FUZZ_CHECK(ValueCodecName(*value) == a.value_codec(), "value codec name");
  } else {
    FUZZ_CHECK(absl::IsInvalidArgument(value.status()), "ParseValueCodec");
  }
  auto mode = AggregationModeFromProto(a.mode());
  FUZZ_CHECK(mode.ok() || absl::IsInvalidArgument(mode.status()),
             "AggregationModeFromProto");
  if (mode.ok()) FUZZ_CHECK(ToProto(*mode) == a.mode(), "mode round trip");
}

void CheckFingerprint(const gtopk::v1::ClusterSpec& a) {
  using namespace gtopk;
  const uint64_t fp = ClusterFingerprint(a);
  FUZZ_CHECK(fp != 0, "fingerprint 0");
  v1::ClusterSpec other = a;
  other.set_next_step(a.next_step() + 1);
  other.set_cluster_fingerprint(~a.cluster_fingerprint());
  for (v1::ShardSpec& sh : *other.mutable_shards()) {
    sh.set_address(sh.address() + "x");
  }
  FUZZ_CHECK(ClusterFingerprint(other) == fp,
             "fingerprint depends on addresses, next_step or itself");
  FUZZ_CHECK(ClusterSpecDifferences(a, a, "there").empty(),
             "a spec differs from itself: %s",
             ClusterSpecDifferences(a, a, "there")[0].c_str());
}

void CheckExpected(const gtopk::v1::ClusterSpec& a) {
  using namespace gtopk;
  absl::StatusOr<OptimizerOptions> o = OptimizerFromSpec(a.optimizer());
  if (!o.ok() || !OptimizerRule::Create(*o).ok()) return;
  ExpectedSettings e;
  e.mode = ModeFlagValue(a.mode());
  e.selection = SelectionFlagValue(a.selection());
  // As a worker spells it: UNSPECIFIED means DGC (the documented default),
  // which a worker writes "dgc", not "unknown(0)".
  e.momentum_mode = std::string(MomentumModeName(o->momentum_mode));
  e.selector = a.selector();
  e.index_codec = a.index_codec();
  e.value_codec = a.value_codec();
  e.density = a.optimizer().density();
  e.lr = a.optimizer().lr();
  e.momentum = a.optimizer().momentum();
  e.weight_decay = a.optimizer().weight_decay();
  const absl::Status s = CheckExpectedSettings(e, a, "--");
  FUZZ_CHECK(s.ok(),
             "a worker expecting the spec's own settings is refused: %s",
             s.ToString().c_str());
}

void CheckAgainstShardConfig(const gtopk::v1::ClusterSpec& a) {
  using namespace gtopk;
  server::ServerConfig config;
  config.shard_id = 1;
  config.num_shards = 2;
  config.num_workers = 4;
  config.peers = {"127.0.0.1:1", ""};
  const absl::Status s = server::CheckSameClusterSettings(config, a, a.n());
  if (!s.ok()) {
    FUZZ_CHECK(absl::IsFailedPrecondition(s), "CheckSameClusterSettings: %s",
               s.ToString().c_str());
    return;
  }
  const std::vector<std::string> d = ClusterSpecDifferences(
      server::ClusterSettingsSpec(config), a, "on the leader");
  // ClusterSettingsSpec has no shards and n 0: only the settings compare.
  for (const std::string& line : d) {
    FUZZ_CHECK(line.rfind("--num-shards", 0) == 0 ||
                   line.find("range") != std::string::npos,
               "settings accepted but they differ: %s", line.c_str());
  }
}

}  // namespace

// Protobuf logs every string field with invalid UTF-8 it parses: silence it
// (the parse still fails or succeeds as it would in the server).
extern "C" int LLVMFuzzerInitialize(int* /*argc*/, char*** /*argv*/) {
  google::protobuf::SetLogHandler(nullptr);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace gtopk;
  fuzz::Bytes in(data, size);
  const uint32_t rank = in.U32();
  const size_t len = in.U8() | (size_t{in.U8()} << 8);
  absl::string_view rest = in.Rest();
  const absl::string_view a_bytes = rest.substr(0, len);
  const absl::string_view b_bytes =
      len < rest.size() ? rest.substr(len) : absl::string_view();
  v1::ClusterSpec a, b;
  if (!a.ParseFromArray(a_bytes.data(), static_cast<int>(a_bytes.size()))) {
    return 0;  // gRPC refuses what protobuf cannot parse
  }
  CheckWorkerAcceptance(a, rank);
  CheckFingerprint(a);
  CheckExpected(a);
  CheckAgainstShardConfig(a);
  if (b.ParseFromArray(b_bytes.data(), static_cast<int>(b_bytes.size()))) {
    if (!ClusterSpecDifferences(a, b, "there").empty()) {
      FUZZ_CHECK(ClusterFingerprint(a) != ClusterFingerprint(b),
                 "specs differ (%s) but share a fingerprint",
                 ClusterSpecDifferences(a, b, "there")[0].c_str());
    }
  }
  return 0;
}
