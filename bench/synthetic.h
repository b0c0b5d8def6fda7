// Helpers shared by the in-process cluster benchmarks (aggregation_bench,
// piece_count_bench): a cheap seeded synthetic vector and the median.
#ifndef GTOPK_BENCH_SYNTHETIC_H_
#define GTOPK_BENCH_SYNTHETIC_H_

#include <algorithm>
#include <cstdint>
#include <vector>

namespace gtopk {
namespace bench {

// The median of `v` (0 for an empty one; the mean of the middle two for an
// even count).
inline double Median(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  const size_t m = v.size() / 2;
  return v.size() % 2 ? v[m] : 0.5 * (v[m - 1] + v[m]);
}

// Fills *out with a cheap seeded synthetic update: xorshift64* mapped to
// [-1, 1). The same seed gives the same values.
inline void Synthetic(uint64_t seed, std::vector<float>* out) {
  uint64_t x = seed * 0x9e3779b97f4a7c15ull + 1;
  for (float& v : *out) {
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    const uint64_t r = x * 0x2545f4914f6cdd1dull;
    v = static_cast<float>(static_cast<int64_t>(r >> 40) - (1 << 23)) *
        (1.0f / (1 << 23));
  }
}

}  // namespace bench
}  // namespace gtopk

#endif  // GTOPK_BENCH_SYNTHETIC_H_
