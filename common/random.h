// Seeded, portable randomness. std::mt19937_64's output sequence is fixed by
// the C++ standard, but std::uniform_*_distribution are not, so the mapping to
// ranges is done here to keep results bit-identical across standard libraries.
#ifndef GTOPK_COMMON_RANDOM_H_
#define GTOPK_COMMON_RANDOM_H_

#include <cstdint>
#include <random>

namespace gtopk {

// SplitMix64 finaliser: a bijective mix used to derive per-(seed, stream)
// seeds, so that streams for neighbouring steps are uncorrelated.
inline uint64_t MixSeed(uint64_t seed, uint64_t stream) {
  uint64_t z = seed + 0x9e3779b97f4a7c15ull * (stream + 1);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// Uniform integer in [0, bound), bound >= 1, by rejection (no modulo bias).
inline uint64_t UniformBelow(std::mt19937_64& rng, uint64_t bound) {
  const uint64_t limit = ~uint64_t{0} - (~uint64_t{0} % bound);
  uint64_t x;
  do {
    x = rng();
  } while (x >= limit);
  return x % bound;
}

// Uniform float in [0, 1) with 24 random bits.
inline float UniformFloat(std::mt19937_64& rng) {
  return static_cast<float>(rng() >> 40) * (1.0f / 16777216.0f);
}

}  // namespace gtopk

#endif  // GTOPK_COMMON_RANDOM_H_
