// The cluster spec's identity and comparison, one place for server and
// worker: the cluster fingerprint carried in every message of a cluster's
// life (proto ClusterSpec.cluster_fingerprint), and the flag-by-flag
// description of how two specs' settings differ.
#ifndef GTOPK_COMMON_CLUSTER_SPEC_H_
#define GTOPK_COMMON_CLUSTER_SPEC_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/cluster_modes.h"
#include "common/optimizer.h"
#include "gtopk/v1/gtopk.pb.h"

namespace gtopk {

// The fingerprint of `spec`'s cluster-wide settings: FNV-1a 64 over a
// canonical text, written field by field in a fixed order (version tag
// "gtopk.cluster.v1"; integers in decimal; floats and doubles as the hex of
// their bit patterns, so values one ulp apart differ; density_warmup with its
// length). Covers n, num_workers, S = shards_size() and every shard's
// (shard_id, begin, end), mode, selection, selector, selector_seed,
// index_codec, value_codec, every OptimizerSpec field, step_timeout_ms and
// max_message_bytes; then apply only when it is not servers and
// checksum_every only when non-zero (so a cluster that uses neither keeps
// the fingerprint it had before they existed, and its checkpoints resume).
// Not covered: the shards' addresses (per-process
// --peers spellings may differ), next_step and cluster_fingerprint itself.
// Deliberately NOT proto SerializeAsString: that is not canonical (map and
// unknown-field order, packed vs unpacked encodings), and this must be
// stable across builds and versions. Never 0 (0 means "absent" on the
// wire). Pure; thread-safe.
uint64_t ClusterFingerprint(const v1::ClusterSpec& spec);

// Every cluster-wide setting in which `here` and `there` differ, each as
// "--<flag> is <here value> here but <there value> <there_name>" (e.g.
// "--lr is 0.5 here but 0.1 on the leader"), in a fixed order: workers,
// num-shards (shards_size()), mode, selection, selector, seed, index-codec,
// value-codec, lr, momentum, momentum-mode, momentum-masking, weight-decay,
// lr-warmup-steps, density, density-warmup, steps-per-epoch, step-timeout,
// max-message-bytes, apply, checksum-every; then n when both are non-zero ("the
// parameter count n is ..."), and shard ranges when S and n agree but a range
// differs. Numbers print as the shortest decimal that reads back exactly. Empty
// when all agree. Pure; thread-safe.
std::vector<std::string> ClusterSpecDifferences(const v1::ClusterSpec& here,
                                                const v1::ClusterSpec& there,
                                                absl::string_view there_name);

// The wire enums <-> the cluster's modes (common/cluster_modes.h). ToProto
// is total. The FromProto functions return INVALID_ARGUMENT ("cluster spec:
// unknown mode 7") for a value outside the enum and for UNSPECIFIED, except
// MomentumModeFromProto, which reads UNSPECIFIED as the documented default,
// DGC momentum correction. Pure; thread-safe.
v1::Mode ToProto(AggregationMode mode);
v1::Selection ToProto(SelectionKind kind);
v1::MomentumMode ToProto(MomentumMode mode);
v1::Apply ToProto(ApplyMode mode);
absl::StatusOr<AggregationMode> AggregationModeFromProto(v1::Mode mode);
absl::StatusOr<SelectionKind> SelectionKindFromProto(v1::Selection selection);
absl::StatusOr<MomentumMode> MomentumModeFromProto(v1::MomentumMode mode);
// UNSPECIFIED reads as kServers (clusters from before the field).
absl::StatusOr<ApplyMode> ApplyModeFromProto(v1::Apply apply);

// The flag spellings of the spec's enums (AggregationModeName etc.):
// "gtopk" | "topk" | "dense"; "threshold" | "quota"; "none" | "dgc" |
// "global"; anything else, UNSPECIFIED included, as "unknown(N)". Pure.
std::string ModeFlagValue(v1::Mode mode);
std::string SelectionFlagValue(v1::Selection selection);
std::string MomentumFlagValue(v1::MomentumMode mode);
std::string ApplyFlagValue(v1::Apply apply);  // UNSPECIFIED: "servers"

// The identity optimizer rule of ApplyMode::kWorkers (proto APPLY_WORKERS):
// lr 1, momentum 0, momentum mode none, no masking, weight decay 0, no lr
// warm-up; the density fields of `spec` are kept. With it the worker's
// AccumulateLocal is u = residual + g exactly (1 * g == g), and the shards
// apply nothing of their own. Pure.
v1::OptimizerSpec IdentityOptimizerSpec(const v1::OptimizerSpec& spec);

// Settings a worker expects of the cluster (gtopk-worker's consistency
// flags, the Python optimizer's arguments); unset fields are not checked.
// Strings in flag spelling (ModeFlagValue etc.).
struct ExpectedSettings {
  std::optional<std::string> mode, selection, selector, index_codec,
      value_codec, momentum_mode;
  std::optional<double> density, lr, momentum, weight_decay;
};

// OK when every set field of `expected` matches `spec` (numbers within a
// relative 1e-6; an unspecified momentum mode is "dgc", the documented
// default; a mode, selection or momentum mode compares by meaning, so the
// alias "exact" matches "threshold"); otherwise FAILED_PRECONDITION for the
// first that differs:
// "<prefix>lr=0.1 but the servers' cluster spec has lr 0.05 (configure the
// servers and workers alike)" (prefix "--" for flags, "" for keyword
// arguments, then named with underscores: "weight_decay=0.1 but ...").
// Pure; thread-safe.
absl::Status CheckExpectedSettings(const ExpectedSettings& expected,
                                   const v1::ClusterSpec& spec,
                                   absl::string_view prefix);

// What a worker relies on in the cluster spec the leader answers to its Join
// (untrusted bytes from the network, checked before any is used): c.n() ==
// `n` (else FAILED_PRECONDITION naming both counts); P = num_workers >= 1
// and `rank` < P; at least one shard; shard s at position s has shard_id s,
// a non-empty address and the range [begin, end) that continues the tiling
// of [0, n) (begin == previous end, begin <= end <= n), the last ending at
// n; step_timeout_ms > 0. Otherwise INVALID_ARGUMENT "cluster spec: ..."
// naming the fault. On OK, every shard's range is inside [0, n), so the
// worker may index its n-length buffers with it. Pure; thread-safe.
absl::Status ValidateWorkerClusterSpec(const v1::ClusterSpec& c, uint64_t n,
                                       uint32_t rank);

// The optimizer settings of a cluster spec as OptimizerOptions (field by
// field; an unspecified momentum mode is DGC, the documented default).
// INVALID_ARGUMENT for a momentum mode outside the enum. The values are not
// validated here: OptimizerRule::Create does that. Pure; thread-safe.
absl::StatusOr<OptimizerOptions> OptimizerFromSpec(const v1::OptimizerSpec& s);

// The fingerprint as printed in messages: "0x" and 16 hex digits.
std::string FingerprintText(uint64_t fingerprint);

}  // namespace gtopk

#endif  // GTOPK_COMMON_CLUSTER_SPEC_H_
