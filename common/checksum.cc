#include "common/checksum.h"

#include <cstring>

namespace gtopk {
namespace {

constexpr uint64_t kMul = 0x9e3779b97f4a7c15ull;  // 2^64 / golden ratio

// SplitMix64's finaliser (Steele, Lea, Flood, OOPSLA 2014).
inline uint64_t Mix(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

inline uint64_t Step(uint64_t h, uint64_t w) {
  h ^= w;
  h *= kMul;
  return h ^ (h >> 29);
}

}  // namespace

uint64_t ParamsChecksum(absl::Span<const float> values) {
  const size_t n = values.size();
  const unsigned char* bytes =
      reinterpret_cast<const unsigned char*>(values.data());
  uint64_t lane[4] = {0x243f6a8885a308d3ull, 0x13198a2e03707344ull,
                      0xa4093822299f31d0ull, 0x082efa98ec4e6c89ull};
  const size_t words = n / 2;  // 64-bit words of two floats
  size_t w = 0;
  for (; w + 4 <= words; w += 4) {
    for (int j = 0; j < 4; ++j) {
      uint64_t x;
      std::memcpy(&x, bytes + 8 * (w + j), 8);
      lane[j] = Step(lane[j], x);
    }
  }
  for (; w < words; ++w) {
    uint64_t x;
    std::memcpy(&x, bytes + 8 * w, 8);
    lane[w % 4] = Step(lane[w % 4], x);
  }
  if (n % 2 != 0) {
    uint32_t x;
    std::memcpy(&x, bytes + 4 * (n - 1), 4);
    lane[0] = Step(lane[0], uint64_t{x} | (uint64_t{1} << 32));
  }
  uint64_t h = Mix(static_cast<uint64_t>(n) ^ kMul);
  for (int j = 0; j < 4; ++j) h = Mix(h ^ lane[j]) + kMul * (j + 1);
  return h == 0 ? 1 : h;
}

uint64_t CombineChecksums(uint64_t a, uint64_t b) {
  const uint64_t h = Mix(Mix(a ^ kMul) ^ b);
  return h == 0 ? 1 : h;
}

}  // namespace gtopk
