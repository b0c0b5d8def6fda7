// The cluster's modes, in one place for the server, the worker client, the
// trainer and the Python binding: what the servers return each step
// (AggregationMode), how gtopk mode agrees on the global top-k across shards
// (SelectionKind) and where momentum lives (MomentumMode), with their flag
// spellings. Proto-free; the conversions to and from the wire enums
// (gtopk.v1.Mode, Selection, MomentumMode) are in
// common/cluster_spec/cluster_spec.h.
#ifndef GTOPK_COMMON_CLUSTER_MODES_H_
#define GTOPK_COMMON_CLUSTER_MODES_H_

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace gtopk {

// What the servers return each step (proto gtopk.v1.Mode; flag --mode).
enum class AggregationMode {
  // The global top-k of the summed sparse pushes (Shi et al., "A Distributed
  // Synchronous SGD Algorithm with Global Top-k Sparsification for Low
  // Bandwidth Networks", ICDCS 2019, arXiv:1901.04359): O(k) per worker.
  kGtopk,
  // The sum of every worker's top-k (Top-k S-SGD): up to P*k pairs back.
  kTopk,
  // The dense sum (no sparsification): the baseline.
  kDense,
};

// How gtopk mode picks the global top-k across shards (proto Selection;
// flag --selection).
enum class SelectionKind {
  // The shards agree on one global threshold through the leader (two small
  // messages per step), so the kept set is exactly the global top-k.
  // Flag spelling "threshold"; "exact" is accepted as its old alias.
  kThreshold,
  // Shard s keeps the top ceil(k * (end_s - begin_s) / n) of its own range:
  // no shard<->leader traffic, not exactly the global top-k.
  kQuota,
  // Layer-wise (common/buckets.h): every bucket piece keeps its own top
  // round(k * n_piece / n), on the workers and on the shard that owns it;
  // no shard<->leader traffic. The mode whose pushes can overlap with the
  // backward pass (docs/overlap.md).
  kLayerwise,
};

// Where momentum lives (proto MomentumMode; flag --momentum-mode).
enum class MomentumMode {
  // No momentum: u = residual + lr * g.
  kNone,
  // DGC momentum correction (Lin et al., ICLR 2018, arXiv:1712.01887, Sec.
  // 3.2): each worker keeps a local velocity v = m*v + g and accumulates
  // u = residual + lr*v, so sparsification does not lose momentum. The
  // default.
  kDgcCorrection,
  // Global momentum after aggregation, as in the authors' gTop-k code (Shi et
  // al., ICDCS 2019): workers accumulate u = residual + lr*g; every replica
  // keeps V = m*V + A/P over the dense vector and applies params -= V.
  kGlobal,
};

// Who applies the global top-k (proto gtopk.v1.Apply; flag --apply;
// docs/apply-modes.md says when to choose which).
enum class ApplyMode {
  // The servers own the optimizer: u = residual + lr*v on the workers, the
  // shards apply params -= A/P (OptimizerRule) to their authoritative copy,
  // every replica applies the same. gtopk-worker and the demo use it.
  kServers,
  // Gradient aggregation, as Horovod, BytePS and the gTop-k authors' code:
  // u = residual + g (error feedback on the gradient, no lr, no momentum);
  // the shards return the average A/P of the global top-k and keep no
  // optimizer; every worker writes it into its gradients and runs its own
  // optimizer (any torch.optim optimizer, schedule, param groups).
  kWorkers,
};

// Flag spellings: "gtopk" | "topk" | "dense"; "threshold" | "quota";
// "none" | "dgc" | "global"; "servers" | "workers". Pure; thread-safe.
absl::string_view AggregationModeName(AggregationMode mode);
absl::string_view SelectionKindName(SelectionKind kind);
absl::string_view MomentumModeName(MomentumMode mode);
absl::string_view ApplyModeName(ApplyMode mode);

// The inverse of the names above ("exact" is also read as kThreshold, its
// old spelling). INVALID_ARGUMENT for an unknown name, the message quoting
// it and listing the known ones. Pure; thread-safe.
absl::StatusOr<AggregationMode> ParseAggregationMode(absl::string_view name);
absl::StatusOr<SelectionKind> ParseSelectionKind(absl::string_view name);
absl::StatusOr<MomentumMode> ParseMomentumMode(absl::string_view name);
absl::StatusOr<ApplyMode> ParseApplyMode(absl::string_view name);

}  // namespace gtopk

#endif  // GTOPK_COMMON_CLUSTER_MODES_H_
