#include "common/optimizer.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/selector.h"
#include "common/status_macros.h"

namespace gtopk {
namespace {

// Branch-free: true for +-Inf and NaN.
inline bool NonFinite(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  return (bits & 0x7f800000u) == 0x7f800000u;
}

// The error of a step whose update cannot be applied: FAILED_PRECONDITION
// (the update and the arguments are well-formed; the state plus this update
// would leave the finite range).
absl::Status NotFinite(absl::string_view what, uint64_t index, float result,
                       absl::string_view how) {
  return absl::FailedPreconditionError(
      absl::StrCat(what, "[", index, "] would become ", result, ": ", how));
}

}  // namespace

std::vector<double> DgcDensityWarmup() {
  return {0.25, 0.0625, 0.015625, 0.004};
}

absl::Status ValidateOptimizerOptions(const OptimizerOptions& o) {
  if (!(std::isfinite(o.lr) && o.lr > 0.0f)) {
    return absl::InvalidArgumentError(
        absl::StrCat("lr must be finite and > 0, got ", o.lr));
  }
  if (!(o.momentum >= 0.0f && o.momentum < 1.0f)) {
    return absl::InvalidArgumentError(
        absl::StrCat("momentum must be in [0, 1), got ", o.momentum));
  }
  if (!(std::isfinite(o.weight_decay) && o.weight_decay >= 0.0f)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "weight_decay must be finite and >= 0, got ", o.weight_decay));
  }
  if (o.lr_warmup_steps < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("lr_warmup_steps must be >= 0, got ", o.lr_warmup_steps));
  }
  if (!(o.density > 0.0 && o.density <= 1.0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("density must be in (0, 1], got ", o.density));
  }
  for (size_t e = 0; e < o.density_warmup.size(); ++e) {
    const double d = o.density_warmup[e];
    if (!(d > 0.0 && d <= 1.0)) {
      return absl::InvalidArgumentError(
          absl::StrCat("density_warmup[", e, "] must be in (0, 1], got ", d));
    }
  }
  if (!o.density_warmup.empty() && o.steps_per_epoch <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("steps_per_epoch must be > 0 with a density warm-up, "
                     "got ",
                     o.steps_per_epoch));
  }
  return absl::OkStatus();
}

absl::StatusOr<OptimizerRule> OptimizerRule::Create(
    const OptimizerOptions& options) {
  GTOPK_RETURN_IF_ERROR(ValidateOptimizerOptions(options));
  return OptimizerRule(options);
}

float OptimizerRule::LrAt(int64_t step) const {
  const int64_t w = options_.lr_warmup_steps;
  if (w <= 0 || step >= w) return options_.lr;
  return options_.lr * (static_cast<float>(std::max<int64_t>(step, 0) + 1) /
                        static_cast<float>(w));
}

double OptimizerRule::DensityAt(int64_t step) const {
  if (options_.density_warmup.empty()) return options_.density;
  const int64_t epoch = std::max<int64_t>(step, 0) / options_.steps_per_epoch;
  if (epoch >= static_cast<int64_t>(options_.density_warmup.size())) {
    return options_.density;
  }
  return std::max(options_.density_warmup[epoch], options_.density);
}

absl::StatusOr<uint64_t> OptimizerRule::KAt(int64_t step, uint64_t n) const {
  return KFromDensity(DensityAt(step), n);
}

absl::Status OptimizerRule::AccumulateLocal(int64_t step,
                                            absl::Span<const float> grad,
                                            absl::Span<const float> params,
                                            absl::Span<float> velocity,
                                            absl::Span<float> residual) const {
  const size_t n = grad.size();
  if (step < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("step must be >= 0, got ", step));
  }
  if (params.size() != n || residual.size() != n) {
    return absl::InvalidArgumentError(
        absl::StrCat("length mismatch: gradient ", n, ", parameters ",
                     params.size(), ", residual ", residual.size()));
  }
  const bool dgc = options_.momentum_mode == MomentumMode::kDgcCorrection;
  if (dgc && velocity.size() != n) {
    return absl::InvalidArgumentError(absl::StrCat(
        "velocity has ", velocity.size(), " entries, expected ", n));
  }
  // The identity rule (workers apply: lr 1 at every step, no momentum, no
  // weight decay): u = residual + g, exactly what the general passes below
  // compute (1 * g == g, g + 0 * p == g for finite p), in two passes
  // instead of three: a non-finite gradient or residual shows in
  // residual + g, so the gradient's own check runs only on that failure
  // (same errors, same messages).
  if (!dgc && options_.lr == 1.0f && options_.weight_decay == 0.0f &&
      options_.lr_warmup_steps == 0) {
    bool bad = false;
    for (size_t i = 0; i < n; ++i) bad |= NonFinite(residual[i] + grad[i]);
    if (!bad) {
      for (size_t i = 0; i < n; ++i) residual[i] += grad[i];
      return absl::OkStatus();
    }
  }
  GTOPK_RETURN_IF_ERROR(ValidateFinite(grad, "gradient"));
  if (options_.weight_decay != 0.0f) {
    GTOPK_RETURN_IF_ERROR(ValidateFinite(params, "parameters"));
  }
  const float lr = LrAt(step);
  const float wd = options_.weight_decay;
  const float m = options_.momentum;
  // Check pass: the values the update pass below would store, computed the
  // same way (so the verdict is exact), nothing stored. A non-finite
  // velocity or residual already there, or an overflow, shows as a
  // non-finite result. Branch-free so that it vectorises.
  bool bad = false;
  if (dgc) {
    for (size_t i = 0; i < n; ++i) {
      const float g = grad[i] + wd * params[i];
      const float v = m * velocity[i] + g;
      bad |= NonFinite(v) | NonFinite(residual[i] + lr * v);
    }
  } else {
    for (size_t i = 0; i < n; ++i) {
      const float g = grad[i] + wd * params[i];
      bad |= NonFinite(residual[i] + lr * g);
    }
  }
  if (bad) {
    for (size_t i = 0; i < n; ++i) {
      if (NonFinite(residual[i]) || (dgc && NonFinite(velocity[i]))) {
        return absl::FailedPreconditionError(absl::StrCat(
            "AccumulateLocal: the ",
            NonFinite(residual[i]) ? "residual" : "velocity",
            " holds a non-finite value at position ", i, " (",
            NonFinite(residual[i]) ? residual[i] : velocity[i], ")"));
      }
      const float g = grad[i] + wd * params[i];
      const std::string gradient =
          wd != 0.0f ? absl::StrCat("gradient ", grad[i], " + weight decay ",
                                    wd, " * parameter ", params[i])
                     : absl::StrCat("gradient ", grad[i]);
      if (dgc) {
        const float v = m * velocity[i] + g;
        if (NonFinite(v)) {
          return absl::InvalidArgumentError(absl::StrCat(
              "AccumulateLocal: the velocity at position ", i,
              " would overflow to ", v, ": momentum ", m, " * velocity ",
              velocity[i], " + ", gradient,
              "; nothing was changed (the gradient is too large: lower "
              "--lr or clip the gradients)"));
        }
        const float r = residual[i] + lr * v;
        if (NonFinite(r)) {
          return absl::InvalidArgumentError(
              absl::StrCat("AccumulateLocal: the residual at position ", i,
                           " would overflow to ", r, ": residual ", residual[i],
                           " + lr ", lr, " * velocity ", v,
                           "; nothing was changed (the gradient is "
                           "too large: lower --lr or clip the gradients)"));
        }
      } else {
        const float r = residual[i] + lr * g;
        if (NonFinite(r)) {
          return absl::InvalidArgumentError(
              absl::StrCat("AccumulateLocal: the residual at position ", i,
                           " would overflow to ", r, ": residual ", residual[i],
                           " + lr ", lr, " * (", gradient,
                           "); nothing was changed (the gradient is "
                           "too large: lower --lr or clip the gradients)"));
        }
      }
    }
  }
  // Separate statements, and the build passes -ffp-contract=off (top-level
  // CMakeLists.txt): no compiler may fuse these into FMAs, whose different
  // rounding would make replicas built with other flags diverge.
  if (dgc) {
    for (size_t i = 0; i < n; ++i) {
      const float g = grad[i] + wd * params[i];
      const float v = m * velocity[i] + g;
      velocity[i] = v;
      residual[i] += lr * v;
    }
  } else {
    for (size_t i = 0; i < n; ++i) {
      const float g = grad[i] + wd * params[i];
      residual[i] += lr * g;
    }
  }
  return absl::OkStatus();
}

absl::Status OptimizerRule::MaskMomentum(const SparseVector& sent,
                                         const SparseVector& global,
                                         absl::Span<float> velocity) const {
  const uint64_t n = velocity.size();
  if (options_.momentum_mode != MomentumMode::kDgcCorrection ||
      !options_.momentum_factor_masking) {
    return absl::OkStatus();
  }
  GTOPK_RETURN_IF_ERROR(ValidateSparseVector(sent, n));
  GTOPK_RETURN_IF_ERROR(ValidateSparseVector(global, n));
  size_t a = 0, b = 0;
  while (a < sent.size() && b < global.size()) {
    const uint32_t x = sent.indices[a], y = global.indices[b];
    if (x == y) {
      velocity[x] = 0.0f;
      ++a;
      ++b;
    } else if (x < y) {
      ++a;
    } else {
      ++b;
    }
  }
  return absl::OkStatus();
}

namespace {

absl::Status ValidateAggregated(const SparseVector& aggregated, uint64_t offset,
                                int num_workers, size_t params_size,
                                size_t velocity_size, bool global) {
  if (num_workers < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_workers must be >= 1, got ", num_workers));
  }
  const uint64_t end = offset + params_size;
  GTOPK_RETURN_IF_ERROR(ValidateSparseVector(aggregated, kMaxDenseLength));
  if (!aggregated.empty() && (aggregated.indices.front() < offset ||
                              aggregated.indices.back() >= end)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "aggregated indices [", aggregated.indices.front(), ", ",
        aggregated.indices.back(), "] fall outside the parameter range [",
        offset, ", ", end, ")"));
  }
  if (global && velocity_size != params_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("global velocity has ", velocity_size,
                     " entries, expected ", params_size));
  }
  return absl::OkStatus();
}

absl::Status ValidateAggregatedDense(absl::Span<const float> sum,
                                     int num_workers, size_t params_size,
                                     size_t velocity_size, bool global) {
  if (num_workers < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_workers must be >= 1, got ", num_workers));
  }
  if (sum.size() != params_size) {
    return absl::InvalidArgumentError(absl::StrCat(
        "dense sum has ", sum.size(), " entries, parameters ", params_size));
  }
  if (global && velocity_size != params_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("global velocity has ", velocity_size,
                     " entries, expected ", params_size));
  }
  return ValidateFinite(sum, "dense sum");
}

// The message for position i of a global-momentum update that is not
// finite: v = m * V + update, params -= v.
absl::Status GlobalNotFinite(uint64_t index, float m, float velocity,
                             float update, float param,
                             absl::string_view update_how) {
  const float v = m * velocity + update;
  if (NonFinite(v)) {
    return NotFinite("global velocity", index, v,
                     absl::StrCat("momentum ", m, " * velocity ", velocity,
                                  " + update ", update, update_how));
  }
  return NotFinite(
      "params", index, param - v,
      absl::StrCat(param, " - velocity ", v, " (momentum ", m, " * velocity ",
                   velocity, " + update ", update, update_how, ")"));
}

}  // namespace

absl::Status OptimizerRule::CheckAggregated(
    const SparseVector& aggregated, uint64_t offset, int num_workers,
    absl::Span<const float> params,
    absl::Span<const float> global_velocity) const {
  const bool global = options_.momentum_mode == MomentumMode::kGlobal;
  GTOPK_RETURN_IF_ERROR(ValidateAggregated(aggregated, offset, num_workers,
                                           params.size(),
                                           global_velocity.size(), global));
  const float p = static_cast<float>(num_workers);
  auto how = [&](size_t j) {
    return absl::StrCat(" (aggregated ", aggregated.values[j], " / ",
                        num_workers, " workers)");
  };
  if (!global) {
    for (size_t j = 0; j < aggregated.size(); ++j) {
      const float update = aggregated.values[j] / p;
      const float param = params[aggregated.indices[j] - offset];
      const float result = param - update;
      if (NonFinite(result)) {
        return NotFinite("params", aggregated.indices[j], result,
                         absl::StrCat(param, " - ", update, how(j)));
      }
    }
    return absl::OkStatus();
  }
  const float m = options_.momentum;
  // Same loop as ApplyAggregated's, branch-free, nothing stored.
  bool bad = false;
  size_t j = 0;
  for (size_t i = 0; i < params.size(); ++i) {
    float update = 0.0f;
    if (j < aggregated.size() && aggregated.indices[j] - offset == i) {
      update = aggregated.values[j] / p;
      ++j;
    }
    const float v = m * global_velocity[i] + update;
    bad |= NonFinite(v) | NonFinite(params[i] - v);
  }
  if (!bad) return absl::OkStatus();
  j = 0;
  for (size_t i = 0; i < params.size(); ++i) {
    float update = 0.0f;
    std::string update_how;
    if (j < aggregated.size() && aggregated.indices[j] - offset == i) {
      update = aggregated.values[j] / p;
      update_how = how(j);
      ++j;
    }
    const float v = m * global_velocity[i] + update;
    if (NonFinite(v) || NonFinite(params[i] - v)) {
      return GlobalNotFinite(offset + i, m, global_velocity[i], update,
                             params[i], update_how);
    }
  }
  return absl::InternalError("CheckAggregated: inconsistent passes");
}

absl::Status OptimizerRule::ApplyAggregated(
    const SparseVector& aggregated, uint64_t offset, int num_workers,
    absl::Span<float> params, absl::Span<float> global_velocity) const {
  // Validates the arguments and that every stored value stays finite.
  GTOPK_RETURN_IF_ERROR(CheckAggregated(aggregated, offset, num_workers, params,
                                        global_velocity));
  StoreAggregated(aggregated, offset, num_workers, params, global_velocity);
  return absl::OkStatus();
}

void OptimizerRule::StoreAggregated(const SparseVector& aggregated,
                                    uint64_t offset, int num_workers,
                                    absl::Span<float> params,
                                    absl::Span<float> global_velocity) const {
  const bool global = options_.momentum_mode == MomentumMode::kGlobal;
  const float p = static_cast<float>(num_workers);
  if (!global) {
    for (size_t j = 0; j < aggregated.size(); ++j) {
      const float update = aggregated.values[j] / p;
      params[aggregated.indices[j] - offset] -= update;
    }
    return;
  }
  const float m = options_.momentum;
  size_t j = 0;
  for (size_t i = 0; i < params.size(); ++i) {
    float update = 0.0f;
    if (j < aggregated.size() && aggregated.indices[j] - offset == i) {
      update = aggregated.values[j] / p;
      ++j;
    }
    const float v = m * global_velocity[i] + update;
    global_velocity[i] = v;
    params[i] -= v;
  }
}

absl::Status OptimizerRule::CheckAggregatedDense(
    absl::Span<const float> sum, int num_workers, uint64_t offset,
    absl::Span<const float> params,
    absl::Span<const float> global_velocity) const {
  const bool global = options_.momentum_mode == MomentumMode::kGlobal;
  GTOPK_RETURN_IF_ERROR(ValidateAggregatedDense(
      sum, num_workers, params.size(), global_velocity.size(), global));
  const float p = static_cast<float>(num_workers);
  const float m = options_.momentum;
  bool bad = false;
  if (!global) {
    for (size_t i = 0; i < params.size(); ++i) {
      const float update = sum[i] / p;
      bad |= NonFinite(params[i] - update);
    }
  } else {
    for (size_t i = 0; i < params.size(); ++i) {
      const float update = sum[i] / p;
      const float v = m * global_velocity[i] + update;
      bad |= NonFinite(v) | NonFinite(params[i] - v);
    }
  }
  if (!bad) return absl::OkStatus();
  for (size_t i = 0; i < params.size(); ++i) {
    const float update = sum[i] / p;
    const std::string how =
        absl::StrCat(" (sum ", sum[i], " / ", num_workers, " workers)");
    if (!global) {
      if (NonFinite(params[i] - update)) {
        return NotFinite("params", offset + i, params[i] - update,
                         absl::StrCat(params[i], " - ", update, how));
      }
      continue;
    }
    const float v = m * global_velocity[i] + update;
    if (NonFinite(v) || NonFinite(params[i] - v)) {
      return GlobalNotFinite(offset + i, m, global_velocity[i], update,
                             params[i], how);
    }
  }
  return absl::InternalError("CheckAggregatedDense: inconsistent passes");
}

absl::Status OptimizerRule::ApplyAggregatedDense(
    absl::Span<const float> sum, int num_workers, absl::Span<float> params,
    absl::Span<float> global_velocity) const {
  GTOPK_RETURN_IF_ERROR(CheckAggregatedDense(sum, num_workers, /*offset=*/0,
                                             params, global_velocity));
  StoreAggregatedDense(sum, num_workers, params, global_velocity);
  return absl::OkStatus();
}

void OptimizerRule::StoreAggregatedDense(
    absl::Span<const float> sum, int num_workers, absl::Span<float> params,
    absl::Span<float> global_velocity) const {
  const bool global = options_.momentum_mode == MomentumMode::kGlobal;
  const float p = static_cast<float>(num_workers);
  if (!global) {
    for (size_t i = 0; i < params.size(); ++i) {
      const float update = sum[i] / p;
      params[i] -= update;
    }
    return;
  }
  const float m = options_.momentum;
  for (size_t i = 0; i < params.size(); ++i) {
    const float update = sum[i] / p;
    const float v = m * global_velocity[i] + update;
    global_velocity[i] = v;
    params[i] -= v;
  }
}

}  // namespace gtopk
