// The wire primitives of common/codec.cc: header constants, little-endian
// loads and stores, fp16/bf16 conversions, LEB128 varints and the
// bit-packed gap blocks. Internal to the codec (codec.cc and its tests of
// the wire format); not part of its API. Pure functions, thread-safe.
#ifndef GTOPK_COMMON_CODEC_WIRE_H_
#define GTOPK_COMMON_CODEC_WIRE_H_

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>

#include "absl/base/casts.h"
#include "absl/base/config.h"

namespace gtopk {
namespace codec_wire {

// Fixed part of the header: version, index codec id, value codec id.
constexpr size_t kFixedHeaderBytes = 3;
// A uint32 LEB128 varint takes at most 5 bytes.
constexpr size_t kMaxVarintBytes = 5;
// Gaps per bit-packed block. 128 gaps at any width w fill exactly 16*w
// bytes, so full blocks stay byte aligned.
constexpr size_t kBlockGaps = 128;
constexpr uint64_t kMaxUint32 = std::numeric_limits<uint32_t>::max();

// ---------------------------------------------------------------------------
// Little-endian loads and stores (memcpy on little-endian hosts, byte
// assembly elsewhere), and float <-> bits.

inline uint16_t Load16LE(const uint8_t* p) {
#ifdef ABSL_IS_LITTLE_ENDIAN
  uint16_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
#else
  return static_cast<uint16_t>(p[0] | (p[1] << 8));
#endif
}

inline uint32_t Load32LE(const uint8_t* p) {
#ifdef ABSL_IS_LITTLE_ENDIAN
  uint32_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
#else
  return uint32_t{p[0]} | uint32_t{p[1]} << 8 | uint32_t{p[2]} << 16 |
         uint32_t{p[3]} << 24;
#endif
}

inline uint64_t Load64LE(const uint8_t* p) {
#ifdef ABSL_IS_LITTLE_ENDIAN
  uint64_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
#else
  return uint64_t{Load32LE(p)} | uint64_t{Load32LE(p + 4)} << 32;
#endif
}

inline void Store16LE(uint16_t v, uint8_t* p) {
#ifdef ABSL_IS_LITTLE_ENDIAN
  std::memcpy(p, &v, sizeof(v));
#else
  p[0] = static_cast<uint8_t>(v);
  p[1] = static_cast<uint8_t>(v >> 8);
#endif
}

inline void Store32LE(uint32_t v, uint8_t* p) {
#ifdef ABSL_IS_LITTLE_ENDIAN
  std::memcpy(p, &v, sizeof(v));
#else
  p[0] = static_cast<uint8_t>(v);
  p[1] = static_cast<uint8_t>(v >> 8);
  p[2] = static_cast<uint8_t>(v >> 16);
  p[3] = static_cast<uint8_t>(v >> 24);
#endif
}

inline bool FloatBitsFinite(uint32_t b) {
  return (b & 0x7f800000u) != 0x7f800000u;
}

// ---------------------------------------------------------------------------
// binary16 and bfloat16, by integer operations only (no FPU mode or
// intrinsic dependence: results are identical on every platform).

constexpr uint16_t kFp16MaxFinite = 0x7bff;  // 65504
constexpr uint16_t kBf16MaxFinite = 0x7f7f;  // (2 - 2^-7) * 2^127

// Float bits `x` (finite) -> binary16 bits, round to nearest even,
// saturating at ±65504. Branch-free: all three cases are computed and one is
// selected.
inline uint16_t FloatBitsToFp16(uint32_t x) {
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t a = x & 0x7fffffffu;  // <= 0x7f7fffff: finite
  // Normal half (|x| >= 2^-14): rebias the exponent by 127 - 15 = 112 and
  // drop 13 mantissa bits, adding 0xfff plus the kept LSB so that a tie
  // rounds to even. A mantissa carry correctly bumps the exponent.
  const uint32_t r = a + 0xfffu + ((a >> 13) & 1u);
  const uint32_t normal = (r - 0x38000000u) >> 13;
  // Zero or subnormal half (|x| < 2^-14): round(|x| / 2^-24). With
  // |x| = m * 2^(e-150), implicit bit in m, that is m >> (126 - e): a right
  // shift by s in [14, 24], rounded to nearest even by the remainder. Below
  // 2^-25 (float denormals included) the result must be 0: clamping s to
  // 31 gives h = 0 and rem = m < 2^24 <= half. At exactly 2^-25 the tie goes
  // to the even 0. Clamping e keeps the shifts defined for normal inputs,
  // whose (discarded) result is computed too.
  const uint32_t e = std::min(a >> 23, 112u);
  const uint32_t m = (a & 0x7fffffu) | 0x800000u;
  const uint32_t s = std::min(126u - e, 31u);
  const uint32_t h = m >> s;
  const uint32_t rem = m & ((1u << s) - 1u);
  const uint32_t half = 1u << (s - 1u);
  const uint32_t round_up = static_cast<uint32_t>(rem > half) |
                            (static_cast<uint32_t>(rem == half) & h);
  const uint32_t subnormal = h + round_up;  // may carry to 0x400 = 2^-14
  uint32_t result = a >= 0x38800000u ? normal : subnormal;
  // |x| >= 65504: exactly the largest finite half or beyond it, where
  // rounding would give 65504 or Inf: saturate.
  result = a >= 0x477fe000u ? uint32_t{kFp16MaxFinite} : result;
  return static_cast<uint16_t>(sign | result);
}

inline bool Fp16Finite(uint16_t h) { return (h & 0x7c00u) != 0x7c00u; }

// binary16 bits (finite) -> float bits; exact and branch-free.
inline uint32_t Fp16ToFloatBits(uint16_t h) {
  const uint32_t sign = uint32_t{h & 0x8000u} << 16;
  const uint32_t em = h & 0x7fffu;
  // Normal: rebias the exponent by 127 - 15 = 112.
  const uint32_t normal = (em << 13) + 0x38000000u;
  // Zero or subnormal em * 2^-24 (em < 2^10): an integer-to-float
  // conversion and a power-of-two scaling, both exact whatever the rounding
  // mode, and on normal floats only (unaffected by flush-to-zero modes).
  const uint32_t subnormal = absl::bit_cast<uint32_t>(
      static_cast<float>(static_cast<int32_t>(em)) * 5.9604644775390625e-8f);
  // A mask blend, not `?:`: keeps the loop free of control flow (GCC will
  // not speculate the multiplication into a select under -ftrapping-math)
  // so that it vectorizes.
  const uint32_t is_normal = 0u - static_cast<uint32_t>(em >= 0x0400u);
  return sign | (normal & is_normal) | (subnormal & ~is_normal);
}

// Float bits `x` (finite) -> bfloat16 bits, round to nearest even,
// saturating at the largest finite bf16. Subnormal floats round correctly by
// the same carry (bf16 shares binary32's exponent range).
inline uint16_t FloatBitsToBf16(uint32_t x) {
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t a = x & 0x7fffffffu;
  const uint32_t r = a + 0x7fffu + ((a >> 16) & 1u);  // a <= 0x7f7fffff
  const uint32_t h = r >= 0x7f800000u ? uint32_t{kBf16MaxFinite} : r >> 16;
  return static_cast<uint16_t>(sign | h);
}

inline bool Bf16Finite(uint16_t h) { return (h & 0x7f80u) != 0x7f80u; }

inline uint32_t Bf16ToFloatBits(uint16_t h) { return uint32_t{h} << 16; }

// ---------------------------------------------------------------------------
// LEB128 varints of uint32.

inline size_t VarintSize(uint64_t v) {
  size_t size = 1;
  while (v >= 0x80) {
    v >>= 7;
    ++size;
  }
  return size;
}

inline uint8_t* WriteVarint(uint32_t v, uint8_t* p) {
  while (v >= 0x80) {
    *p++ = static_cast<uint8_t>(v | 0x80);
    v >>= 7;
  }
  *p++ = static_cast<uint8_t>(v);
  return p;
}

enum class VarintResult { kOk, kTruncated, kTooLong, kOverflow };

// Reads a varint at *pp (never at or past `end`) into *v and advances *pp.
// On error *pp is unchanged.
inline VarintResult ReadVarint(const uint8_t** pp, const uint8_t* end,
                               uint32_t* v) {
  const uint8_t* p = *pp;
  if (end - p >= static_cast<ptrdiff_t>(kMaxVarintBytes)) {
    // Fast path: 5 bytes are readable, no per-byte bounds checks.
    uint32_t b = p[0];
    if (b < 0x80) {
      *v = b;
      *pp = p + 1;
      return VarintResult::kOk;
    }
    uint32_t r = b & 0x7f;
    b = p[1];
    r |= (b & 0x7f) << 7;
    if (b < 0x80) {
      *v = r;
      *pp = p + 2;
      return VarintResult::kOk;
    }
    b = p[2];
    r |= (b & 0x7f) << 14;
    if (b < 0x80) {
      *v = r;
      *pp = p + 3;
      return VarintResult::kOk;
    }
    b = p[3];
    r |= (b & 0x7f) << 21;
    if (b < 0x80) {
      *v = r;
      *pp = p + 4;
      return VarintResult::kOk;
    }
    b = p[4];
    if (b >= 0x80) return VarintResult::kTooLong;
    if (b > 0x0f) return VarintResult::kOverflow;
    *v = r | (b << 28);
    *pp = p + 5;
    return VarintResult::kOk;
  }
  uint32_t r = 0;
  for (size_t i = 0; i < kMaxVarintBytes; ++i) {
    if (p + i >= end) return VarintResult::kTruncated;
    const uint32_t b = p[i];
    if (i == kMaxVarintBytes - 1) {
      if (b >= 0x80) return VarintResult::kTooLong;
      if (b > 0x0f) return VarintResult::kOverflow;
    }
    r |= (b & 0x7f) << (7 * i);
    if (b < 0x80) {
      *v = r;
      *pp = p + i + 1;
      return VarintResult::kOk;
    }
  }
  return VarintResult::kTooLong;  // not reached
}

// ---------------------------------------------------------------------------
// Bit packing.

inline uint32_t BitWidth(uint32_t v) {
  uint32_t w = 0;
  while (v != 0) {
    v >>= 1;
    ++w;
  }
  return w;
}

// Packs gaps[0..m) at `w` bits each (1 <= w <= 32), LSB-first; writes
// exactly ceil(m*w/8) bytes and returns the end.
inline uint8_t* PackGaps(const uint32_t* gaps, size_t m, uint32_t w,
                         uint8_t* p) {
  uint64_t buf = 0;
  uint32_t bits = 0;
  for (size_t t = 0; t < m; ++t) {
    buf |= uint64_t{gaps[t]} << bits;
    bits += w;
    if (bits >= 32) {
      Store32LE(static_cast<uint32_t>(buf), p);
      p += 4;
      buf >>= 32;
      bits -= 32;
    }
  }
  while (bits > 0) {
    *p++ = static_cast<uint8_t>(buf);
    buf >>= 8;
    bits = bits > 8 ? bits - 8 : 0;
  }
  return p;
}

// The fast path of the encoder: packs a full block of 128 gaps, each < 2^W,
// into exactly 16*W bytes. It works in groups of 8 gaps (exactly W bytes,
// so every group starts byte aligned); with W a constant the inner loop
// unrolls and every shift and flush position is known at compile time.
template <uint32_t W>
uint8_t* PackFullBlock(const uint32_t* gaps, uint8_t* p) {
  for (size_t group = 0; group < kBlockGaps; group += 8) {
    uint64_t buf = 0;
    uint32_t bits = 0;
    for (size_t t = 0; t < 8; ++t) {
      buf |= uint64_t{gaps[group + t]} << bits;
      bits += W;
      if (bits >= 32) {
        Store32LE(static_cast<uint32_t>(buf), p);
        p += 4;
        buf >>= 32;
        bits -= 32;
      }
    }
    for (; bits > 0; bits -= 8) {  // 8*W bits: a whole number of bytes
      *p++ = static_cast<uint8_t>(buf);
      buf >>= 8;
    }
  }
  return p;
}

using PackBlockFn = uint8_t* (*)(const uint32_t*, uint8_t*);

template <size_t... W>
constexpr std::array<PackBlockFn, sizeof...(W)> MakePackBlockTable(
    std::index_sequence<W...>) {
  return {{&PackFullBlock<static_cast<uint32_t>(W)>...}};
}

// kPackFullBlock[w] for w in [0, 32].
constexpr std::array<PackBlockFn, 33> kPackFullBlock =
    MakePackBlockTable(std::make_index_sequence<33>());

// The fast path of the decoder: unpacks a full block of 128 gaps of
// constant width W from p[0..16*W) and writes their running sum, starting
// from `prev`, to out[0..128) (truncated to uint32: the caller rejects the
// block when the returned sum is out of range). Sets *zero when a gap is 0.
// Precondition: p[0..16*W + 8) is readable (each gap is one unaligned 64-bit
// load; the last one may extend up to 8 bytes past the block).
template <uint32_t W>
uint64_t DecodeFullBlock(const uint8_t* p, uint64_t prev, uint32_t* out,
                         bool* zero) {
  constexpr uint64_t kMask = (uint64_t{1} << W) - 1;
  uint32_t min_gap = std::numeric_limits<uint32_t>::max();
  for (uint32_t t = 0; t < kBlockGaps; ++t) {
    const uint32_t bit = t * W;
    const uint32_t gap =
        static_cast<uint32_t>((Load64LE(p + (bit >> 3)) >> (bit & 7)) & kMask);
    min_gap = std::min(min_gap, gap);
    prev += gap;
    out[t] = static_cast<uint32_t>(prev);
  }
  *zero = min_gap == 0;
  return prev;
}

using DecodeBlockFn = uint64_t (*)(const uint8_t*, uint64_t, uint32_t*, bool*);

template <size_t... W>
constexpr std::array<DecodeBlockFn, sizeof...(W)> MakeDecodeBlockTable(
    std::index_sequence<W...>) {
  return {{&DecodeFullBlock<static_cast<uint32_t>(W)>...}};
}

// kDecodeFullBlock[w] for w in [0, 32].
constexpr std::array<DecodeBlockFn, 33> kDecodeFullBlock =
    MakeDecodeBlockTable(std::make_index_sequence<33>());

// Unpacks m gaps of width w reading exactly ceil(m*w/8) bytes from p.
inline void UnpackGapsSafe(const uint8_t* p, size_t m, uint32_t w,
                           uint32_t* gaps) {
  const uint64_t mask = (uint64_t{1} << w) - 1;
  uint64_t buf = 0;
  uint32_t bits = 0;
  for (size_t t = 0; t < m; ++t) {
    while (bits < w) {
      buf |= uint64_t{*p++} << bits;
      bits += 8;
    }
    gaps[t] = static_cast<uint32_t>(buf & mask);
    buf >>= w;
    bits -= w;
  }
}

}  // namespace codec_wire
}  // namespace gtopk

#endif  // GTOPK_COMMON_CODEC_WIRE_H_
