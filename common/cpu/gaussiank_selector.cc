#include <cmath>
#include <cstring>
#include <limits>

#include "common/cpu/selectors.h"
#include "common/status_macros.h"

namespace gtopk {
namespace cpu {
namespace {

// Smallest magnitude key whose value is strictly greater than t.
uint32_t MinKeyAbove(double t) {
  if (t < 0.0) return 0;
  const float tf = static_cast<float>(t);  // nearest float
  if (!std::isfinite(tf)) return kNonFiniteKey;
  const uint32_t key = MagnitudeKey(tf);
  // tf is the float nearest to t: no float lies strictly between them.
  return static_cast<double>(tf) > t ? key : key + 1;
}

uint64_t CountAtLeast(absl::Span<const float> values, uint32_t min_key) {
  uint64_t count = 0;
  for (float v : values) count += MagnitudeKey(v) >= min_key;
  return count;
}

}  // namespace

uint64_t GaussianKSelector::MinCount(uint64_t k) const {
  const uint64_t lo = (2 * k + 2) / 3;  // ceil(2k/3)
  const uint64_t hi = 4 * k / 3;        // floor(4k/3)
  return lo <= hi ? lo : k;
}

uint64_t GaussianKSelector::MaxCount(uint64_t k) const {
  const uint64_t lo = (2 * k + 2) / 3;
  const uint64_t hi = 4 * k / 3;
  return lo <= hi ? hi : k;
}

namespace {

// Pass 1 of Select: the mean and the (sample) variance of u.
// INVALID_ARGUMENT when u holds a NaN/Inf (found on the fallback pass).
absl::Status MeanAndVariance(absl::Span<const float> u, double* mean,
                             double* var) {
  const size_t n = u.size();
  // Pass 1: mean and standard deviation. Four 4-float vector lanes per 1 Ki
  // block (GCC/Clang vector extensions: plain SSE2, no reassociation flags
  // needed), blocks accumulated in double. The sums are of d = x - u[0]:
  // the one-pass variance (sum of squares minus sum times mean) cancels
  // when |mean| >> std (2^24 plus small integers lost half of it), and
  // shifted by one of the values it stays well conditioned (the CUDA
  // selectors merge per-thread shifted sums by Chan's formula instead).
  typedef float Float4 __attribute__((vector_size(16)));
  double sum = 0.0, sumsq = 0.0;
  const float* p = u.data();
  const float shift = p[0];
  const Float4 shift4 = {shift, shift, shift, shift};
  constexpr size_t kStatBlock = 1024;
  size_t i = 0;
  for (; i + kStatBlock <= n; i += kStatBlock) {
    Float4 s0 = {}, s1 = {}, s2 = {}, s3 = {}, q0 = {}, q1 = {}, q2 = {},
           q3 = {};
    for (size_t b = 0; b < kStatBlock; b += 16) {
      Float4 a0, a1, a2, a3;
      std::memcpy(&a0, p + i + b, sizeof(a0));
      std::memcpy(&a1, p + i + b + 4, sizeof(a1));
      std::memcpy(&a2, p + i + b + 8, sizeof(a2));
      std::memcpy(&a3, p + i + b + 12, sizeof(a3));
      a0 -= shift4;
      a1 -= shift4;
      a2 -= shift4;
      a3 -= shift4;
      s0 += a0;
      s1 += a1;
      s2 += a2;
      s3 += a3;
      q0 += a0 * a0;
      q1 += a1 * a1;
      q2 += a2 * a2;
      q3 += a3 * a3;
    }
    const Float4 s = (s0 + s1) + (s2 + s3);
    const Float4 q = (q0 + q1) + (q2 + q3);
    sum +=
        (static_cast<double>(s[0]) + s[1]) + (static_cast<double>(s[2]) + s[3]);
    sumsq +=
        (static_cast<double>(q[0]) + q[1]) + (static_cast<double>(q[2]) + q[3]);
  }
  for (; i < n; ++i) {
    const double d = static_cast<double>(p[i]) - shift;
    sum += d;
    sumsq += d * d;
  }
  // Float lanes overflow for |x| > ~1e19 (squares) before double would, and
  // squares of |x| < ~1e-19 fall below float's normal range (denormal
  // inputs square to 0): a non-finite total, or a mean square under 1e-30
  // (|x| ~ 1e-15 on average), is recomputed in double.
  if (!std::isfinite(sum) || !std::isfinite(sumsq) ||
      sumsq < 1e-30 * static_cast<double>(n)) {
    GTOPK_RETURN_IF_ERROR(ValidateFinite(u, "selector input"));
    sum = sumsq = 0.0;
    for (size_t j = 0; j < n; ++j) {
      const double d = static_cast<double>(p[j]) - shift;
      sum += d;
      sumsq += d * d;
    }
  }
  const double mean_d = sum / n;
  *mean = shift + mean_d;
  *var =
      n > 1 ? std::max(0.0, (sumsq - sum * mean_d) / static_cast<double>(n - 1))
            : 0.0;
  return absl::OkStatus();
}

}  // namespace

absl::Status GaussianKSelector::Select(absl::Span<const float> u, uint64_t k,
                                       uint64_t /*step*/, SparseVector* out) {
  out->clear();
  GTOPK_RETURN_IF_ERROR(ValidateSelectArgs(u.size(), k));
  const size_t n = u.size();
  const uint64_t lo = MinCount(k), hi = MaxCount(k);
  last_adjustments_ = 0;
  last_fell_back_ = true;
  if (k == n || lo == hi) return ExactTopK(u, k, &scratch_, out);

  double mean = 0.0, var = 0.0;
  GTOPK_RETURN_IF_ERROR(MeanAndVariance(u, &mean, &var));
  const double density = static_cast<double>(k) / static_cast<double>(n);
  double threshold =
      mean + NormalQuantile(1.0 - density / 2.0) * std::sqrt(var);

  // Survivors of the lowest threshold scanned so far (complete or not).
  Candidates& survivors = scratch_.candidates;
  bool have_survivors = false;
  uint32_t survivors_min_key = 0;
  const size_t cap = 16 * static_cast<size_t>(k) + 4096;

  for (int adjustment = 0;; ++adjustment) {
    const uint32_t min_key = MinKeyAbove(threshold);
    uint64_t count;
    bool exact_count = true;
    if (have_survivors && min_key >= survivors_min_key) {
      count = CountAtLeast(survivors.value_span(), min_key);
    } else {
      have_survivors = CollectAtLeast(u, min_key, cap, &survivors);
      survivors_min_key = min_key;
      if (AnyNonFinite(survivors.value_span())) {
        return ValidateFinite(u, "selector input");
      }
      count = survivors.size;
      exact_count = have_survivors;  // false: more than cap survive
    }
    if (exact_count && count >= lo && count <= hi) {
      last_adjustments_ = adjustment;
      last_fell_back_ = false;
      out->indices.resize(count);
      out->values.resize(count);
      size_t w = 0;
      for (size_t j = 0; j < survivors.size; ++j) {
        const float v = survivors.values.data()[j];
        if (MagnitudeKey(v) >= min_key) {
          out->indices[w] = survivors.positions.data()[j];
          out->values[w] = v;
          ++w;
        }
      }
      return absl::OkStatus();
    }
    if (adjustment == max_adjustments_) {
      last_adjustments_ = adjustment;
      break;
    }
    threshold = count < lo ? threshold * 0.5 : threshold * 1.5;
    // A non-positive threshold admits every non-zero entry; scaling it can
    // neither lower nor raise the count any more.
    if (threshold <= 0.0) {
      last_adjustments_ = adjustment;
      break;
    }
  }
  // Still outside the range: the exact top-k, from the survivors when they
  // are complete and enough, else from u.
  if (have_survivors && survivors.size >= k) {
    FinishTopKFromCandidates(survivors, k, &scratch_.keys, out);
    return absl::OkStatus();
  }
  return ExactTopK(u, k, &scratch_, out);
}

}  // namespace cpu
}  // namespace gtopk
