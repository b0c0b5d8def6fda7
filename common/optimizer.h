// The optimizer rule shared by workers and servers. Every replica and the
// servers' copy of the parameters apply the same float operations in the same
// order through these functions, so they stay bit-identical.
#ifndef GTOPK_COMMON_OPTIMIZER_H_
#define GTOPK_COMMON_OPTIMIZER_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "common/cluster_modes.h"  // MomentumMode
#include "common/sparse_vector.h"

namespace gtopk {

// DGC's density warm-up (arXiv:1712.01887, Sec. 3.4): densities for the
// first four epochs, 0.25 -> 0.0625 -> 0.015625 -> 0.004, then the target.
std::vector<double> DgcDensityWarmup();

struct OptimizerOptions {
  // Base learning rate (dimensionless step size), finite and > 0.
  float lr = 0.1f;
  // Momentum coefficient m in [0, 1); ignored by MomentumMode::kNone.
  float momentum = 0.9f;
  MomentumMode momentum_mode = MomentumMode::kDgcCorrection;
  // DGC momentum factor masking: clear the local velocity of the entries
  // whose accumulated value was applied this step (sent and globally
  // selected). Only with kDgcCorrection.
  bool momentum_factor_masking = true;
  // L2 weight decay coefficient >= 0, added to the gradient as wd * param.
  float weight_decay = 0.0f;
  // Linear learning-rate warm-up (Goyal et al., 2017): lr * (step+1)/W for
  // the first W steps; 0 disables it.
  int64_t lr_warmup_steps = 0;
  // Target density k/n in (0, 1] after warm-up.
  double density = 0.001;
  // Density for each warm-up epoch (each in (0, 1]); epoch e < size() uses
  // max(density_warmup[e], density). Empty: no density warm-up.
  std::vector<double> density_warmup;
  // Steps per epoch, > 0 when density_warmup is not empty.
  int64_t steps_per_epoch = 0;
};

// INVALID_ARGUMENT naming the first bad field, or OK.
absl::Status ValidateOptimizerOptions(const OptimizerOptions& options);

// The per-step arithmetic of gTop-k S-SGD with error feedback
// (docs/design.md). Immutable after Create: safe to share across threads; the
// spans passed in are caller-owned and must not be shared during a call.
class OptimizerRule {
 public:
  // INVALID_ARGUMENT when the options are invalid.
  static absl::StatusOr<OptimizerRule> Create(const OptimizerOptions& options);

  const OptimizerOptions& options() const { return options_; }

  // Learning rate at `step` (>= 0), with warm-up.
  float LrAt(int64_t step) const;
  // Density at `step` (>= 0), with density warm-up.
  double DensityAt(int64_t step) const;
  // k at `step` for n parameters: KFromDensity(DensityAt(step), n).
  absl::StatusOr<uint64_t> KAt(int64_t step, uint64_t n) const;

  // Worker side, before selection. All spans have length n.
  //   g' = grad + weight_decay * params
  //   kDgcCorrection: velocity = m * velocity + g';  residual += lr * velocity
  //   kNone, kGlobal: residual += lr * g'   (velocity untouched, may be empty)
  // After this, `residual` is u, what the selector picks from.
  // INVALID_ARGUMENT on a length mismatch, a negative step, a non-finite
  // gradient or (with weight decay) non-finite parameters, position named;
  // also when any value this call would store (the velocity, or the
  // residual u) would overflow to +-Inf, e.g. a gradient so large that
  // |u| > FLT_MAX: the message names the position and the values. Nothing is
  // modified on any error (a check pass computes the same values first).
  absl::Status AccumulateLocal(int64_t step, absl::Span<const float> grad,
                               absl::Span<const float> params,
                               absl::Span<float> velocity,
                               absl::Span<float> residual) const;

  // Worker side, after the global selection: DGC momentum factor masking,
  // velocity[i] = 0 for every i in both `sent` and `global` (sorted index
  // lists, O(|sent| + |global|)). No-op unless kDgcCorrection with masking.
  // INVALID_ARGUMENT if either vector is invalid for n = velocity.size().
  absl::Status MaskMomentum(const SparseVector& sent,
                            const SparseVector& global,
                            absl::Span<float> velocity) const;

  // Every replica and every server: applies the aggregated update to the
  // parameter range [offset, offset + params.size()).
  //   aggregated  the sum over the P workers of the globally selected
  //               entries (global indices, all inside the range);
  //   kDgcCorrection, kNone: params[i - offset] -= aggregated_i / P
  //   kGlobal: for every i in the range, V = m*V + (aggregated_i / P, or 0);
  //            params -= V   (global_velocity has params.size() entries).
  // INVALID_ARGUMENT for num_workers < 1, an invalid `aggregated`, an index
  // outside the range or a global_velocity of the wrong size;
  // FAILED_PRECONDITION when the update would make a parameter or a velocity
  // entry non-finite (CheckAggregated's message); nothing is modified then.
  absl::Status ApplyAggregated(const SparseVector& aggregated, uint64_t offset,
                               int num_workers, absl::Span<float> params,
                               absl::Span<float> global_velocity) const;

  // Would ApplyAggregated with these arguments leave every parameter (and,
  // kGlobal, every global velocity entry) finite? Computes exactly the
  // values ApplyAggregated would store -- the same float operations in the
  // same order -- and stores nothing, so a caller may check, then decide
  // (e.g. a shard's cross-shard commit vote), then apply, and the verdict
  // holds for the apply bit for bit. Errors: ApplyAggregated's
  // INVALID_ARGUMENTs; FAILED_PRECONDITION naming the first offending flat
  // index (offset + position) with the old value, the update and the
  // non-finite result, e.g. "params[3] would become -inf: -3e+38 - 1.5e+38
  // (aggregated 3e+38 / 2 workers)". Cost: O(|aggregated|) without global
  // momentum, one pass over the range with it.
  absl::Status CheckAggregated(const SparseVector& aggregated, uint64_t offset,
                               int num_workers, absl::Span<const float> params,
                               absl::Span<const float> global_velocity) const;

  // Dense S-SGD variant of ApplyAggregated: `sum` holds the sum over the P
  // workers for every parameter of the range (sum.size() == params.size()).
  // Same arithmetic as ApplyAggregated with every index selected.
  // INVALID_ARGUMENT for num_workers < 1, mismatched sizes or a non-finite
  // sum (position named); FAILED_PRECONDITION as CheckAggregatedDense;
  // nothing is modified then.
  absl::Status ApplyAggregatedDense(absl::Span<const float> sum,
                                    int num_workers, absl::Span<float> params,
                                    absl::Span<float> global_velocity) const;

  // CheckAggregated for ApplyAggregatedDense (offset: the flat index of
  // params[0], used in messages only). Same errors as ApplyAggregatedDense,
  // nothing stored. Cost: one pass over the range.
  absl::Status CheckAggregatedDense(
      absl::Span<const float> sum, int num_workers, uint64_t offset,
      absl::Span<const float> params,
      absl::Span<const float> global_velocity) const;

  // The stores of ApplyAggregated / ApplyAggregatedDense without their
  // check, for a caller that must check before something else (a shard
  // before its commit vote, a worker before its residual bookkeeping) and
  // so would otherwise pass over the range twice. Precondition: the
  // matching Check returned OK for the same arguments, and params and
  // global_velocity have not changed since; then the result is bit for bit
  // ApplyAggregated's. Otherwise non-finite values may be stored. No errors
  // are detected; nothing is validated.
  void StoreAggregated(const SparseVector& aggregated, uint64_t offset,
                       int num_workers, absl::Span<float> params,
                       absl::Span<float> global_velocity) const;
  void StoreAggregatedDense(absl::Span<const float> sum, int num_workers,
                            absl::Span<float> params,
                            absl::Span<float> global_velocity) const;

 private:
  explicit OptimizerRule(OptimizerOptions options)
      : options_(std::move(options)) {}
  OptimizerOptions options_;
};

}  // namespace gtopk

#endif  // GTOPK_COMMON_OPTIMIZER_H_
