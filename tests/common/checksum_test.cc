// common/checksum.h: ParamsChecksum and CombineChecksums against plain
// properties and a plain reimplementation written here from the header's
// description (four multiply-xorshift lanes over 64-bit words, SplitMix64's
// finaliser), so that a change of the function -- which would make workers
// of two versions disagree -- is caught.
#include "common/checksum.h"

#include <cstdint>
#include <cstring>
#include <set>
#include <vector>

#include "gtest/gtest.h"

namespace gtopk {
namespace {

uint64_t Mix(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// Word by word, lane = word index mod 4: the same as the header's function
// by construction of its lanes, written without its unrolling.
uint64_t Reference(const std::vector<float>& v) {
  constexpr uint64_t kMul = 0x9e3779b97f4a7c15ull;
  uint64_t lane[4] = {0x243f6a8885a308d3ull, 0x13198a2e03707344ull,
                      0xa4093822299f31d0ull, 0x082efa98ec4e6c89ull};
  auto step = [&](uint64_t h, uint64_t w) {
    h ^= w;
    h *= kMul;
    return h ^ (h >> 29);
  };
  for (size_t w = 0; w < v.size() / 2; ++w) {
    uint64_t x;
    std::memcpy(&x, v.data() + 2 * w, 8);
    lane[w % 4] = step(lane[w % 4], x);
  }
  if (v.size() % 2 != 0) {
    uint32_t x;
    std::memcpy(&x, &v.back(), 4);
    lane[0] = step(lane[0], uint64_t{x} | (uint64_t{1} << 32));
  }
  uint64_t h = Mix(static_cast<uint64_t>(v.size()) ^ kMul);
  for (int j = 0; j < 4; ++j) h = Mix(h ^ lane[j]) + kMul * (j + 1);
  return h == 0 ? 1 : h;
}

std::vector<float> Ramp(size_t n) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = 0.25f * static_cast<float>(i) - 3.0f;
  return v;
}

TEST(ParamsChecksumTest, EqualsTheReferenceForEveryLengthUpTo41) {
  for (size_t n = 0; n <= 41; ++n) {
    const std::vector<float> v = Ramp(n);
    EXPECT_EQ(ParamsChecksum(v), Reference(v)) << "n = " << n;
  }
}

TEST(ParamsChecksumTest, EveryBitPositionAndLengthCounts) {
  const std::vector<float> base = Ramp(13);
  std::set<uint64_t> seen = {ParamsChecksum(base)};
  for (size_t i = 0; i < base.size(); ++i) {
    std::vector<float> v = base;
    uint32_t bits;
    std::memcpy(&bits, &v[i], 4);
    bits ^= 1u;  // one ulp
    std::memcpy(&v[i], &bits, 4);
    EXPECT_TRUE(seen.insert(ParamsChecksum(v)).second) << "position " << i;
  }
  // -0.0 and 0.0 are different bits; a trailing zero changes the length.
  EXPECT_NE(ParamsChecksum(std::vector<float>{0.0f}),
            ParamsChecksum(std::vector<float>{-0.0f}));
  EXPECT_NE(ParamsChecksum(std::vector<float>{1.0f}),
            ParamsChecksum(std::vector<float>{1.0f, 0.0f}));
  // Swapping two entries changes it (order matters).
  std::vector<float> swapped = base;
  std::swap(swapped[2], swapped[9]);
  EXPECT_NE(ParamsChecksum(swapped), ParamsChecksum(base));
  EXPECT_NE(ParamsChecksum({}), 0u);
}

TEST(CombineChecksumsTest, OrderMattersAndNeverZero) {
  EXPECT_NE(CombineChecksums(1, 2), CombineChecksums(2, 1));
  EXPECT_NE(CombineChecksums(1, 2), CombineChecksums(1, 3));
  EXPECT_EQ(CombineChecksums(5, 7), CombineChecksums(5, 7));
  for (uint64_t a = 0; a < 64; ++a) EXPECT_NE(CombineChecksums(a, a), 0u);
}

}  // namespace
}  // namespace gtopk
