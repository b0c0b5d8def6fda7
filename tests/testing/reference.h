// Plain, obviously-correct reference implementations and seeded input
// generators shared by the tests. Nothing here is optimised on purpose.
#ifndef GTOPK_TESTS_TESTING_REFERENCE_H_
#define GTOPK_TESTS_TESTING_REFERENCE_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/types/span.h"
#include "common/sparse_vector.h"

namespace gtopk {
namespace testing {

// A SparseVector from literal index and value lists (not validated).
inline SparseVector MakeSparse(std::vector<uint32_t> indices,
                               std::vector<float> values) {
  SparseVector v;
  v.indices = std::move(indices);
  v.values = std::move(values);
  return v;
}

// The bits of a float, for bit-exact comparisons that tell -0.0 from +0.0.
inline uint32_t FloatBits(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  return bits;
}

// FloatBits of every entry: EXPECT_EQ(FloatBits(a), FloatBits(b)) compares
// bit for bit and, unlike BitEqual, shows where the vectors differ.
inline std::vector<uint32_t> FloatBits(absl::Span<const float> v) {
  std::vector<uint32_t> bits(v.size());
  for (size_t i = 0; i < v.size(); ++i) bits[i] = FloatBits(v[i]);
  return bits;
}

// `n` draws of N(0, 1) as floats from std::mt19937_64 seeded with `seed`:
// the seeded gradients and parameters of the integration tests (the same
// values as MakeInput(Distribution::kNormal, n, seed)).
inline std::vector<float> NormalVector(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal;
  std::vector<float> x(n);
  for (float& v : x) v = normal(rng);
  return x;
}

// Whether `a` and `b` hold the same floats bit for bit (so -0.0 differs
// from +0.0): what "replicas are identical" means throughout the tests.
inline bool BitEqual(absl::Span<const float> a, absl::Span<const float> b) {
  return a.size() == b.size() &&
         std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// Top-k by |value| with ties broken by lower index: the first k indices
// under the strict total order (|x| descending, then index ascending), which
// is what a stable sort by |x| descending puts first; found by
// std::nth_element on that order (O(n), not a full sort: the emulator's
// tests call this on 10^6 values). Returned sorted by index with the input's
// values. `x` finite.
inline SparseVector ReferenceTopK(const std::vector<float>& x, size_t k) {
  std::vector<uint32_t> order(x.size());
  std::iota(order.begin(), order.end(), 0u);
  const auto before = [&](uint32_t a, uint32_t b) {
    const float fa = std::fabs(x[a]);
    const float fb = std::fabs(x[b]);
    return fa > fb || (fa == fb && a < b);
  };
  k = std::min(k, order.size());
  if (k < order.size()) {
    std::nth_element(order.begin(), order.begin() + k, order.end(), before);
  }
  order.resize(k);
  std::sort(order.begin(), order.end());
  SparseVector out;
  for (uint32_t i : order) out.push_back(i, x[i]);
  return out;
}

// Named input families, including adversarial ones for threshold selection.
enum class Distribution {
  kNormal,
  kHeavyTailed,  // Student-t with 1.5 degrees of freedom
  kManyZeros,    // 90% exact zeros (and -0.0)
  kAllZeros,
  kAllEqual,
  kFewLevels,  // 5 distinct magnitudes: ties at the k-th value
  kDenormals,  // subnormal magnitudes only
  kAscending,  // sorted ramp: the largest values all at the end
  kSpike,      // small noise plus one block of large values
  // The adversarial inputs of issue 15, on which a radix select's digits
  // decide late or never:
  kNarrowBand,    // |x| uniform in [1.0, 1.0005), random signs: every key
                  // shares its top digit (and most of its second)
  kTies,          // +-1.0, every 1000th entry 2.0: ties at the k-th key
  kLaplaceZeros,  // Laplace(0, 1) with 30% exact zeros (a third of them -0.0)
  kOutliers,      // normal body with a few huge outliers (|x| ~ 1e30)
};

inline std::vector<Distribution> AllDistributions() {
  return {Distribution::kNormal,    Distribution::kHeavyTailed,
          Distribution::kManyZeros, Distribution::kAllZeros,
          Distribution::kAllEqual,  Distribution::kFewLevels,
          Distribution::kDenormals, Distribution::kAscending,
          Distribution::kSpike,     Distribution::kNarrowBand,
          Distribution::kTies,      Distribution::kLaplaceZeros,
          Distribution::kOutliers};
}

inline std::string DistributionName(Distribution d) {
  switch (d) {
    case Distribution::kNormal:
      return "normal";
    case Distribution::kHeavyTailed:
      return "heavy_tailed";
    case Distribution::kManyZeros:
      return "many_zeros";
    case Distribution::kAllZeros:
      return "all_zeros";
    case Distribution::kAllEqual:
      return "all_equal";
    case Distribution::kFewLevels:
      return "few_levels";
    case Distribution::kDenormals:
      return "denormals";
    case Distribution::kAscending:
      return "ascending";
    case Distribution::kSpike:
      return "spike";
    case Distribution::kNarrowBand:
      return "narrow_band";
    case Distribution::kTies:
      return "ties";
    case Distribution::kLaplaceZeros:
      return "laplace_zeros";
    case Distribution::kOutliers:
      return "outliers";
  }
  return "unknown";
}

inline std::vector<float> MakeInput(Distribution d, size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::student_t_distribution<float> student(1.5f);
  std::uniform_int_distribution<int> level(0, 4);
  std::uniform_real_distribution<float> unit(0.0f, 1.0f);
  std::vector<float> x(n);
  for (size_t i = 0; i < n; ++i) {
    switch (d) {
      case Distribution::kNormal:
        x[i] = normal(rng);
        break;
      case Distribution::kHeavyTailed:
        x[i] = student(rng);
        break;
      case Distribution::kManyZeros:
        x[i] = unit(rng) < 0.9f ? (i % 2 ? -0.0f : 0.0f) : normal(rng);
        break;
      case Distribution::kAllZeros:
        x[i] = (i % 3 == 0) ? -0.0f : 0.0f;
        break;
      case Distribution::kAllEqual:
        x[i] = (i % 2) ? -0.5f : 0.5f;
        break;
      case Distribution::kFewLevels:
        x[i] = (unit(rng) < 0.5f ? -1.0f : 1.0f) * (1 + level(rng)) * 0.25f;
        break;
      case Distribution::kDenormals:
        x[i] = normal(rng) * std::numeric_limits<float>::denorm_min() * 1000.0f;
        break;
      case Distribution::kAscending:
        x[i] = static_cast<float>(i) / static_cast<float>(n);
        break;
      case Distribution::kSpike:
        x[i] = normal(rng) * 1e-3f;
        if (i >= n / 3 && i < n / 3 + n / 50 + 1) x[i] = 10.0f + normal(rng);
        break;
      case Distribution::kNarrowBand:
        x[i] = (unit(rng) < 0.5f ? -1.0f : 1.0f) * (1.0f + 0.0005f * unit(rng));
        break;
      case Distribution::kTies:
        x[i] = i % 1000 == 999 ? 2.0f : (unit(rng) < 0.5f ? -1.0f : 1.0f);
        break;
      case Distribution::kLaplaceZeros: {
        const float r = unit(rng);
        if (r < 0.3f) {
          x[i] = r < 0.1f ? -0.0f : 0.0f;
        } else {
          // Laplace(0, 1) by inversion of an exponential with a random sign.
          const float e = -std::log1p(-unit(rng) * 0.999999f);
          x[i] = unit(rng) < 0.5f ? -e : e;
        }
        break;
      }
      case Distribution::kOutliers:
        x[i] = normal(rng);
        if (i % 65537 == 12345) x[i] = 1e30f * (1.0f + unit(rng));
        break;
    }
  }
  return x;
}

// The k a selection test tries for an input of `n` values: 1, 2, n/1000,
// n/100, n/3, n - 1 and n (each at least 1, without repeats), ascending.
inline std::vector<uint64_t> KsFor(size_t n) {
  std::set<uint64_t> ks = {1, n, std::max<uint64_t>(1, n / 1000),
                           std::max<uint64_t>(1, n / 100),
                           std::max<uint64_t>(1, n / 3)};
  if (n > 1) ks.insert(n - 1);
  if (n > 2) ks.insert(2);
  return {ks.begin(), ks.end()};
}

// "normal n=1000 k=10": a selection case, for failure messages.
inline std::string Describe(Distribution d, size_t n, uint64_t k) {
  return DistributionName(d) + " n=" + std::to_string(n) +
         " k=" + std::to_string(k);
}

}  // namespace testing
}  // namespace gtopk

#endif  // GTOPK_TESTS_TESTING_REFERENCE_H_
