// The standard normal quantile, shared by the CPU Gaussian-k selector
// (common/cpu/) and the CUDA one (common/cuda/sparsify/, which links no
// Abseil): both must compute the same z for the same density, so there is
// one definition. Header-only, no dependencies beyond <cmath>.
#ifndef GTOPK_COMMON_NORMAL_QUANTILE_H_
#define GTOPK_COMMON_NORMAL_QUANTILE_H_

#include <cmath>

namespace gtopk {

// Phi^-1(p) for p in (0, 1): the standard normal quantile, by bisection on
// std::erfc to double precision (deterministic, no tables). Thread-safe.
inline double NormalQuantile(double p) {
  // Phi(x) = erfc(-x / sqrt(2)) / 2 is increasing; bisect on [-40, 40].
  double lo = -40.0, hi = 40.0;
  for (int i = 0; i < 200 && hi - lo > 1e-15 * (1.0 + std::fabs(lo)); ++i) {
    const double mid = 0.5 * (lo + hi);
    if (0.5 * std::erfc(-mid / std::sqrt(2.0)) < p) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  return 0.5 * (lo + hi);
}

}  // namespace gtopk

#endif  // GTOPK_COMMON_NORMAL_QUANTILE_H_
