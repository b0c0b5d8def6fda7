// ServerConfig's validation and the cluster spec made from it
// (server/server_config.h): ValidateServerConfig, ClusterSettingsSpec,
// CanonicalClusterSpec, CheckSameClusterSettings.
#include "server/server_config.h"

#include <algorithm>
#include <charconv>
#include <climits>
#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/buckets.h"
#include "common/cluster_spec/cluster_spec.h"
#include "common/host_port.h"
#include "common/selector.h"
#include "common/status_macros.h"

namespace gtopk {
namespace server {
namespace {

// Largest S and P (--num-shards, --workers; server/flags.md).
constexpr uint32_t kMaxShards = 1u << 16;
constexpr uint32_t kMaxWorkers = 1u << 16;

}  // namespace

CallLimits EffectiveCallLimits(const ServerConfig& c) {
  const int64_t p = c.num_workers, s = c.num_shards;
  CallLimits limits;
  limits.max_concurrent_calls =
      c.max_concurrent_calls > 0
          ? c.max_concurrent_calls
          : std::min<int64_t>(4 * p + 8 * s + 64, kMaxCallLimit);
  limits.max_calls_per_peer =
      c.max_calls_per_peer > 0
          ? c.max_calls_per_peer
          : std::min<int64_t>(p + 4 * s + 16, kMaxCallLimit);
  return limits;
}

int64_t EffectiveStreamsPerConnection(const ServerConfig& c) {
  return c.max_streams_per_connection > 0
             ? c.max_streams_per_connection
             : EffectiveCallLimits(c).max_concurrent_calls;
}

uint32_t EffectiveChecksumEvery(const ServerConfig& c) {
  if (c.checksum_every < 0) return c.apply == ApplyMode::kWorkers ? 100 : 0;
  return static_cast<uint32_t>(c.checksum_every);
}

OptimizerOptions EffectiveOptimizer(const ServerConfig& c) {
  OptimizerOptions o = c.optimizer;
  if (c.apply != ApplyMode::kWorkers) return o;
  o.lr = 1.0f;
  o.momentum = 0.0f;
  o.momentum_mode = MomentumMode::kNone;
  o.momentum_factor_masking = false;
  o.weight_decay = 0.0f;
  o.lr_warmup_steps = 0;
  return o;
}

namespace {

// ValidateServerConfig's groups, each OK or INVALID_ARGUMENT naming the
// flag. The cluster's shape: shards, this shard's id, workers, peers.
absl::Status ValidateTopology(const ServerConfig& c) {
  if (c.num_shards < 1 || c.num_shards > kMaxShards) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--num-shards must be in [1, ", kMaxShards, "], got ", c.num_shards));
  }
  if (c.shard_id >= c.num_shards) {
    return absl::InvalidArgumentError(
        absl::StrCat("--shard-id must be below --num-shards (", c.num_shards,
                     "), got ", c.shard_id));
  }
  if (c.num_workers < 1 || c.num_workers > kMaxWorkers) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--workers must be in [1, ", kMaxWorkers, "], got ", c.num_workers));
  }
  if (c.peers.size() != c.num_shards) {
    return absl::InvalidArgumentError(
        absl::StrCat("--peers must list --num-shards (", c.num_shards,
                     ") addresses in shard order, got ", c.peers.size()));
  }
  for (uint32_t s = 0; s < c.num_shards; ++s) {
    if (s == c.shard_id && c.peers[s].empty()) continue;
    const absl::Status address = ValidateHostPort("peers", c.peers[s], 1);
    if (!address.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat(address.message(), " (entry ", s, ", shard ", s, ")"));
    }
  }
  return absl::OkStatus();
}

// What the workers compute: selection, selector, codecs.
absl::Status ValidateSelection(const ServerConfig& c) {
  if (c.selection == SelectionKind::kQuota &&
      c.mode != AggregationMode::kGtopk) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--selection=quota applies to --mode=gtopk only, got --mode=",
        AggregationModeName(c.mode),
        " (omit --selection or use --selection=threshold)"));
  }
  if (c.selection == SelectionKind::kLayerwise) {
    if (c.mode != AggregationMode::kGtopk) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--selection=layerwise applies to --mode=gtopk only, got --mode=",
          AggregationModeName(c.mode)));
    }
    if (!std::isfinite(c.bucket_mb) || c.bucket_mb <= 0 || c.bucket_mb > 1e6) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--bucket-mb must be a number in (0, 1000000] (MiB of fp32 values "
          "per bucket), got ",
          BucketMbGiven(c)));
    }
    // Every full bucket must keep at least one entry at the lowest density
    // (a density warm-up only raises it): round(values * density) >= 1.
    const double density = c.optimizer.density;
    const uint64_t values = BucketSizeValues(c);
    if (density > 0 && density <= 1 &&
        static_cast<double>(values) * density < 0.5) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--bucket-mb ", c.bucket_mb, " makes buckets of ", values,
          " values, of which --density ", density,
          " keeps none (round(values * density) = 0), so nothing would be "
          "aggregated; use --bucket-mb of at least ",
          std::ceil(0.5 / density) * 4.0 / (1 << 20)));
    }
  }
  SelectorRegistry registry;
  GTOPK_RETURN_IF_ERROR(RegisterBuiltinSelectors(&registry));
  const std::vector<std::string> names = registry.Names();
  if (std::find(names.begin(), names.end(), c.selector) == names.end()) {
    return absl::InvalidArgumentError(absl::StrCat("--selector must be one of ",
                                                   absl::StrJoin(names, ", "),
                                                   "; got '", c.selector, "'"));
  }
  if (IndexCodecName(c.index_codec) == "unknown") {
    return absl::InvalidArgumentError("--index-codec is not a known codec");
  }
  if (ValueCodecName(c.value_codec) == "unknown") {
    return absl::InvalidArgumentError("--value-codec is not a known codec");
  }
  return absl::OkStatus();
}

// Time, message and call bounds, checkpoints, the apply mode and checksums.
absl::Status ValidateLimits(const ServerConfig& c) {
  if (c.step_timeout < absl::Milliseconds(1) ||
      c.step_timeout >= absl::Milliseconds(UINT32_MAX)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--step-timeout must be in [1ms, 2^32 ms), got ",
                     absl::FormatDuration(c.step_timeout)));
  }
  if (c.max_message_bytes < 1024 ||
      c.max_message_bytes > static_cast<uint64_t>(INT_MAX)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--max-message-bytes must be in [1024, 2^31-1], got ",
                     c.max_message_bytes));
  }
  if (c.download_chunk_bytes < kChunkOverheadBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("download_chunk_bytes must be >= ", kChunkOverheadBytes,
                     ", got ", c.download_chunk_bytes));
  }
  if (c.checkpoint_every < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--checkpoint-every must be >= 0, got ", c.checkpoint_every));
  }
  if (ApplyModeName(c.apply) == "unknown") {
    return absl::InvalidArgumentError("--apply must be servers or workers");
  }
  if (c.checksum_every < -1 || c.checksum_every > int64_t{UINT32_MAX}) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--checksum-every must be >= 0 (0: never; omit it for the default, "
        "100 with --apply=workers, 0 with --apply=servers) and below 2^32, "
        "got ",
        c.checksum_every));
  }
  for (const auto& [flag, value] :
       {std::pair<const char*, int64_t>{"--max-concurrent-calls",
                                        c.max_concurrent_calls},
        {"--max-calls-per-peer", c.max_calls_per_peer},
        {"--max-streams-per-connection", c.max_streams_per_connection}}) {
    if (value < 0 || value > kMaxCallLimit) {
      return absl::InvalidArgumentError(absl::StrCat(
          flag, " must be in [0, ", kMaxCallLimit,
          "] (0: computed from --workers and --num-shards), got ", value));
    }
  }
  if (c.checkpoint_keep < 1 || c.checkpoint_keep > 1000) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--checkpoint-keep must be in [1, 1000], got ", c.checkpoint_keep));
  }
  if (c.checkpoint_every > 0 && c.checkpoint_dir.empty()) {
    return absl::InvalidArgumentError(
        "--checkpoint-every > 0 needs --checkpoint-dir");
  }
  return absl::OkStatus();
}

// The optimizer, by flag.
absl::Status ValidateOptimizerFlags(const ServerConfig& c) {
  // The optimizer, by flag (ValidateOptimizerOptions below is the
  // backstop; its messages name the fields).
  const OptimizerOptions& o = c.optimizer;
  if (!(std::isfinite(o.lr) && o.lr > 0.0f)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--lr must be finite and > 0 (as a 32-bit float), got ", o.lr));
  }
  if (!(o.momentum >= 0.0f && o.momentum < 1.0f)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--momentum must be in [0, 1) (as a 32-bit float), got ", o.momentum));
  }
  if (!(std::isfinite(o.weight_decay) && o.weight_decay >= 0.0f)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--weight-decay must be finite and >= 0, got ", o.weight_decay));
  }
  if (o.lr_warmup_steps < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--lr-warmup-steps must be >= 0, got ", o.lr_warmup_steps));
  }
  if (!(o.density > 0.0 && o.density <= 1.0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--density must be in (0, 1], got ", o.density));
  }
  for (size_t e = 0; e < o.density_warmup.size(); ++e) {
    const double d = o.density_warmup[e];
    if (!(d > 0.0 && d <= 1.0)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--density-warmup: entry ", e, " must be in (0, 1], got ", d));
    }
  }
  if (o.steps_per_epoch < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--steps-per-epoch must be >= 0, got ", o.steps_per_epoch));
  }
  if (!o.density_warmup.empty() && o.steps_per_epoch == 0) {
    return absl::InvalidArgumentError(
        "--density-warmup needs --steps-per-epoch > 0");
  }
  absl::Status s = ValidateOptimizerOptions(c.optimizer);
  if (!s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("optimizer: ", s.message()));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidateServerConfig(const ServerConfig& c) {
  GTOPK_RETURN_IF_ERROR(ValidateTopology(c));
  GTOPK_RETURN_IF_ERROR(ValidateSelection(c));
  GTOPK_RETURN_IF_ERROR(ValidateLimits(c));
  return ValidateOptimizerFlags(c);
}

absl::StatusOr<std::vector<double>> ParseDensityWarmupFlag(
    absl::string_view value) {
  if (value == "dgc") return DgcDensityWarmup();
  std::vector<double> warmup;
  if (value.empty()) return warmup;
  for (absl::string_view piece : absl::StrSplit(value, ',')) {
    double d = 0;
    if (!absl::SimpleAtod(piece, &d)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--density-warmup: '", piece,
                       "' is not a number (expected a comma list of "
                       "densities, or 'dgc')"));
    }
    warmup.push_back(d);
  }
  return warmup;
}

uint64_t BucketSizeValues(const ServerConfig& config) {
  if (config.selection != SelectionKind::kLayerwise) return 0;
  const double values = std::floor(config.bucket_mb * (1 << 20) / 4.0);
  return values < 1 ? 1 : static_cast<uint64_t>(values);
}

std::string BucketMbGiven(const ServerConfig& config) {
  // std::to_chars without a format: the shortest text that reads back.
  char text[32];
  const std::to_chars_result r =
      std::to_chars(text, text + sizeof(text), config.bucket_mb);
  return std::string(text, r.ptr);
}

absl::Status CheckBucketPieces(const ServerConfig& config, uint64_t n) {
  if (config.selection != SelectionKind::kLayerwise || n == 0 ||
      config.num_shards == 0) {
    return absl::OkStatus();
  }
  std::vector<uint64_t> begins;
  begins.reserve(config.num_shards);
  for (uint64_t s = 0; s < config.num_shards; ++s) {
    // Shard s's first index (ShardRange, server/shard_aggregator.h).
    begins.push_back(n * s / config.num_shards);
  }
  return CheckBucketPieceCount(n, BucketSizeValues(config), begins,
                               BucketMbGiven(config));
}

v1::ClusterSpec ClusterSettingsSpec(const ServerConfig& config) {
  v1::ClusterSpec spec;
  spec.set_bucket_size(BucketSizeValues(config));
  spec.set_num_workers(config.num_workers);
  spec.set_mode(ToProto(config.mode));
  spec.set_selection(ToProto(config.selection));
  spec.set_selector(config.selector);
  spec.set_selector_seed(config.selector_seed);
  spec.set_index_codec(std::string(IndexCodecName(config.index_codec)));
  spec.set_value_codec(std::string(ValueCodecName(config.value_codec)));
  // With --apply=workers the servers' optimizer flags are not used: the
  // spec carries the identity rule (the workers run their own optimizer).
  const OptimizerOptions o = EffectiveOptimizer(config);
  v1::OptimizerSpec* opt = spec.mutable_optimizer();
  opt->set_lr(o.lr);
  opt->set_momentum(o.momentum);
  opt->set_momentum_mode(ToProto(o.momentum_mode));
  opt->set_momentum_factor_masking(o.momentum_factor_masking);
  opt->set_weight_decay(o.weight_decay);
  opt->set_lr_warmup_steps(o.lr_warmup_steps);
  opt->set_density(o.density);
  opt->mutable_density_warmup()->Add(o.density_warmup.begin(),
                                     o.density_warmup.end());
  opt->set_steps_per_epoch(o.steps_per_epoch);
  spec.set_step_timeout_ms(
      static_cast<uint32_t>(absl::ToInt64Milliseconds(config.step_timeout)));
  spec.set_max_message_bytes(config.max_message_bytes);
  if (config.apply == ApplyMode::kWorkers) {
    *opt = IdentityOptimizerSpec(*opt);  // the same values; the one rule
  }
  spec.set_apply(ToProto(config.apply));
  spec.set_checksum_every(EffectiveChecksumEvery(config));
  return spec;
}

v1::ClusterSpec CanonicalClusterSpec(const ServerConfig& config, uint64_t n) {
  v1::ClusterSpec spec = ClusterSettingsSpec(config);
  spec.set_n(n);
  for (uint32_t s = 0; s < config.num_shards; ++s) {
    v1::ShardSpec* shard = spec.add_shards();
    shard->set_shard_id(s);
    const auto range = ShardRange(n, config.num_shards, s);
    shard->set_begin(range.first);
    shard->set_end(range.second);
  }
  spec.set_cluster_fingerprint(ClusterFingerprint(spec));
  return spec;
}

absl::Status CheckSameClusterSettings(const ServerConfig& own,
                                      const v1::ClusterSpec& leader,
                                      uint64_t own_n) {
  v1::ClusterSpec mine = ClusterSettingsSpec(own);
  // S and the settings here; n is compared below with its origin named,
  // and the ranges follow from n and S.
  if (static_cast<uint32_t>(leader.shards_size()) == own.num_shards) {
    *mine.mutable_shards() = leader.shards();
  } else {
    for (uint32_t s = 0; s < own.num_shards; ++s) {
      mine.add_shards()->set_shard_id(s);
    }
  }
  v1::ClusterSpec theirs = leader;
  theirs.set_n(0);
  std::vector<std::string> differences =
      ClusterSpecDifferences(mine, theirs, "on the leader");
  if (own_n != 0 && leader.n() != 0 && own_n != leader.n()) {
    differences.push_back(
        absl::StrCat("the parameter count n is ", own_n,
                     " here (from this shard's checkpoint) but ", leader.n(),
                     " on the leader"));
  }
  if (differences.empty()) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      "shard ", own.shard_id,
      " is configured differently from the leader, "
      "shard 0 (",
      own.peers.empty() ? std::string() : own.peers[0],
      "): ", absl::StrJoin(differences, "; "),
      ". Start every shard with the same cluster flags (server/flags.md)"));
}

}  // namespace server
}  // namespace gtopk
