// The configuration of one gtopk-server shard and the cluster identity
// derived from it: ServerConfig (what main() fills from the flags of
// server/flags.md, or a test directly), ValidateServerConfig, the cluster
// spec the settings make (ClusterSettingsSpec, CanonicalClusterSpec, whose
// fingerprint is the cluster's identity) and the setting-by-setting check of
// a shard's settings against the leader's (CheckSameClusterSettings).
// Pure functions, no gRPC calls; the service that uses them is in
// server/service.h.
#ifndef GTOPK_SERVER_SERVER_CONFIG_H_
#define GTOPK_SERVER_SERVER_CONFIG_H_

#include <prometheus/registry.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "common/codec.h"
#include "common/optimizer.h"
#include "common/transport_security/transport_security.h"
#include "gtopk/v1/gtopk.pb.h"
#include "server/call_limits.h"
#include "server/shard_aggregator.h"

namespace gtopk {
namespace server {

// Room for the non-value fields of a ParamsChunk (varints, tags), in bytes:
// the smallest ServerConfig::download_chunk_bytes, and what DownloadParams
// keeps free in every chunk.
inline constexpr uint64_t kChunkOverheadBytes = 64;

// Everything one gtopk-server process needs; filled from flags in main()
// (server/flags.md documents each flag) or directly by tests.
struct ServerConfig {
  // This shard, 0..num_shards-1; shard 0 is the leader.
  uint32_t shard_id = 0;
  // S >= 1 shards in the cluster.
  uint32_t num_shards = 1;
  // P >= 1 workers (ranks 0..P-1).
  uint32_t num_workers = 1;
  // S host:port addresses in shard order; peers[0] is the leader, which
  // non-leaders dial. The leader puts them into the cluster spec for the
  // workers. The own entry may be empty: the server's bound address is used.
  std::vector<std::string> peers;
  AggregationMode mode = AggregationMode::kGtopk;
  SelectionKind selection = SelectionKind::kThreshold;
  // --selection=layerwise only: MiB of fp32 values per bucket (--bucket-mb,
  // as PyTorch DDP's bucket_cap_mb); ClusterSpec.bucket_size is
  // BucketSizeValues(). Finite and > 0; ignored by the other selections.
  double bucket_mb = 25.0;
  // Workers' local selector, told to them in the cluster spec: a name
  // registered by RegisterBuiltinSelectors (exact, gaussiank, dgc, randomk).
  std::string selector = "exact";
  // Seed of the workers' randomised selectors (cluster spec).
  uint64_t selector_seed = 0;
  // Codecs the workers must push with (gtopk/topk); pulls use index_codec
  // with fp32 values.
  IndexCodec index_codec = IndexCodec::kDeltaVarint;
  ValueCodec value_codec = ValueCodec::kFp32;
  // The optimizer rule shared by workers and servers (validated). With
  // apply == kWorkers it is not used (EffectiveOptimizer: the identity
  // rule, only its density fields count).
  OptimizerOptions optimizer;
  // Who applies the global top-k (--apply): the servers (they own the
  // optimizer and the authoritative parameters) or the workers (gradient
  // aggregation: the shards only sum and select, and keep no optimizer).
  ApplyMode apply = ApplyMode::kServers;
  // The divergence alarm (--checksum-every): every N steps the shards
  // compare the P workers' parameter checksums. -1: auto (100 with
  // apply == kWorkers, 0 otherwise, EffectiveChecksumEvery); 0: never;
  // else in [1, 2^32).
  int64_t checksum_every = -1;
  // Deadline of every wait: a step's pushes, the threshold exchange, the
  // cluster spec (n), initialisation before a download. In (0, 2^32 ms).
  absl::Duration step_timeout = absl::Seconds(30);
  // gRPC send and receive limit of the server and of its channels to the
  // leader, in bytes, in [1024, 2^31 - 1]. A larger message fails with
  // RESOURCE_EXHAUSTED.
  uint64_t max_message_bytes = uint64_t{64} << 20;
  // Largest DownloadParams chunk, in bytes (>= 64; the effective size is
  // also capped by max_message_bytes). The default stays below gRPC's 4 MB
  // default so that clients with default limits can download.
  uint64_t download_chunk_bytes = uint64_t{1} << 20;
  // Directory of this shard's checkpoint (shard-<id>.ckpt); empty: no
  // checkpoints. Must exist.
  std::string checkpoint_dir;
  // Write a checkpoint after every step whose next step is a multiple of
  // this (>= 0); 0: only on graceful shutdown. Needs checkpoint_dir.
  int64_t checkpoint_every = 0;
  // Where the shard registers its metrics (docs/metrics.md, "Server"); null:
  // a private registry nobody scrapes. Shared with the metrics exposer, which
  // also serves ServerMetrics::checkpoint_age() (not held by the registry).
  std::shared_ptr<prometheus::Registry> metrics_registry;
  // How many checkpoints (the newest) this shard retains as
  // shard-<id>.step-<N>.ckpt for crash recovery (docs/recovery.md), >= 1.
  // 2 lets a shard killed before writing its newest checkpoint be caught up
  // with: the others can roll back one checkpoint.
  int checkpoint_keep = 2;
  // Resource bounds (docs/resource-limits.md); 0 = computed from P and S by
  // EffectiveCallLimits. Calls of the Aggregator service in flight on this
  // server, streams included, in [0, 2^20] (--max-concurrent-calls).
  int64_t max_concurrent_calls = 0;
  // Calls in flight from one peer (a rank holding its member token, a shard,
  // else one client host), in [0, 2^20] (--max-calls-per-peer).
  int64_t max_calls_per_peer = 0;
  // HTTP/2 streams one client connection may have open at once
  // (GRPC_ARG_MAX_CONCURRENT_STREAMS), in [0, 2^20]
  // (--max-streams-per-connection).
  int64_t max_streams_per_connection = 0;
  // Transport security (docs/security.md; --tls and the certificate and
  // token flags): the server's credentials, the credentials and token of
  // its channels to the other shards, and who may call what
  // (server/access.h). Null: plaintext, everyone may call everything.
  std::shared_ptr<const TransportSecurity> security;
};

// The most any of the resource bounds above may be set to.
inline constexpr int64_t kMaxCallLimit = int64_t{1} << 20;

// The resource bounds `config` asks for, with 0 replaced by the computed
// defaults (P workers, S shards): max_concurrent_calls 4P + 8S + 64 (every
// worker's step stream, a reconnect overlapping it, its unary calls, and the
// shards' votes, exchanges and recovery calls, with room to spare);
// max_calls_per_peer P + 4S + 16 (every worker on one host calling Join,
// GetClusterSpec or DownloadParams at once, plus the shards' calls).
// Capped at kMaxCallLimit. Pure.
CallLimits EffectiveCallLimits(const ServerConfig& config);
// max_streams_per_connection with 0 replaced by the effective
// max_concurrent_calls (one connection may carry a whole in-process
// cluster's calls).
int64_t EffectiveStreamsPerConnection(const ServerConfig& config);

// checksum_every with -1 (auto) resolved: 100 with --apply=workers, 0 with
// --apply=servers. Pure.
uint32_t EffectiveChecksumEvery(const ServerConfig& config);

// The optimizer rule the cluster runs: config.optimizer with
// --apply=servers; with --apply=workers the identity rule (lr 1, momentum
// 0, momentum mode none, no masking, weight decay 0, no lr warm-up; the
// density, density warm-up and steps per epoch of config.optimizer), as
// IdentityOptimizerSpec (common/cluster_spec/cluster_spec.h). Pure.
OptimizerOptions EffectiveOptimizer(const ServerConfig& config);

// OK, or INVALID_ARGUMENT naming the first bad field (by its gtopk-server
// flag, server/flags.md) and its value.
absl::Status ValidateServerConfig(const ServerConfig& config);

// Values per bucket of --selection=layerwise: floor(bucket_mb * 2^20 / 4),
// at least 1; 0 for the other selections (ClusterSpec.bucket_size). Pure.
uint64_t BucketSizeValues(const ServerConfig& config);

// --bucket-mb as given, for messages: the shortest decimal that reads back
// as config.bucket_mb (0.000004, not 3.9999999999999998e-06). Pure.
std::string BucketMbGiven(const ServerConfig& config);

// The cluster's bucket pieces for n parameters (--selection=layerwise:
// --bucket-mb's buckets cut again at the --num-shards shards' ranges) are
// at most kMaxBucketPieces (common/buckets.h); FAILED_PRECONDITION
// otherwise, naming --bucket-mb as given, the count, the bound and the
// smallest --bucket-mb that fits this n. OK for the other selections.
// Checked where n becomes known (the leader's first Join, a checkpoint's
// n, the leader's n on another shard), before any step. Pure.
absl::Status CheckBucketPieces(const ServerConfig& config, uint64_t n);

// The value of gtopk-server's --density-warmup: "" (none: empty), "dgc"
// (DgcDensityWarmup()) or a comma list of numbers, one density per epoch
// (absl::SimpleAtod each; the range is ValidateServerConfig's business).
// INVALID_ARGUMENT naming the piece that is not a number. Pure.
absl::StatusOr<std::vector<double>> ParseDensityWarmupFlag(
    absl::string_view value);

// The cluster-wide settings of `config` as a cluster spec: every field but
// n, shards (ranges and addresses) and next_step. What the leader tells
// workers, and what every shard must agree on.
v1::ClusterSpec ClusterSettingsSpec(const ServerConfig& config);

// The spec whose ClusterFingerprint (common/cluster_spec/cluster_spec.h) is the
// cluster's identity: ClusterSettingsSpec plus n and the S shard ranges for `n`
// (no addresses, next_step 0), with cluster_fingerprint filled in.
v1::ClusterSpec CanonicalClusterSpec(const ServerConfig& config, uint64_t n);

// Compares this shard's settings (`own`) with the leader's cluster spec:
// workers, num-shards, mode, selection, selector, seed, codecs, the whole
// optimizer (lr, momentum, momentum mode and masking, weight decay, lr
// warm-up, density, density warm-up, steps per epoch), step timeout and
// max message bytes, and n when `own_n` != 0 (restored from a checkpoint).
// OK when all agree; otherwise FAILED_PRECONDITION listing every difference
// by its flag with both values, e.g. "shard 1 is configured differently
// from the leader, shard 0 (host:port): --lr is 0.5 here but 0.1 on the
// leader". Pure; thread-safe.
absl::Status CheckSameClusterSettings(const ServerConfig& own,
                                      const v1::ClusterSpec& leader,
                                      uint64_t own_n);

}  // namespace server
}  // namespace gtopk

#endif  // GTOPK_SERVER_SERVER_CONFIG_H_
