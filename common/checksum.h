// The replica checksum: how gtopk-worker, the Python package and the
// launcher tell that every replica and the servers hold the same bits.
#ifndef GTOPK_COMMON_CHECKSUM_H_
#define GTOPK_COMMON_CHECKSUM_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/strings/str_format.h"
#include "absl/types/span.h"

namespace gtopk {

// 64-bit FNV-1a (Fowler, Noll, Vo) over `bytes` bytes at `data` (for
// parameters: n floats' bytes in memory order). Pure; thread-safe.
inline uint64_t Fnv1a64(const void* data, size_t bytes) {
  const auto* p = static_cast<const uint8_t*>(data);
  uint64_t h = 0xcbf29ce484222325ull;
  for (size_t i = 0; i < bytes; ++i) {
    h ^= p[i];
    h *= 0x100000001b3ull;
  }
  return h;
}

// A checksum as the summaries print it: 16 lowercase hex digits, no "0x".
inline std::string ChecksumText(uint64_t checksum) {
  return absl::StrFormat("%016x", checksum);
}

// The divergence alarm's checksum (ClusterSpec.checksum_every,
// Push.params_checksum): a 64-bit checksum of the IEEE-754 bit patterns of
// `values` (so -0.0 and 0.0 differ), in order, and of their count. Four
// independent multiply-xorshift lanes over 64-bit words (two floats each),
// finalised with SplitMix64's mixer: about one memory read pass, where the
// byte-serial Fnv1a64 above is several times slower. Integer arithmetic
// only, so equal vectors give the same value on every platform and build,
// and a replica changed behind the optimizer's back almost surely another.
// Not cryptographic: it detects accidents (a missed update, a write outside
// step(), nondeterministic kernels), not an adversary. Never 0 (0 means "no
// checksum" on the wire). Pure; thread-safe.
uint64_t ParamsChecksum(absl::Span<const float> values);

// One checksum of two (e.g. the trainable parameters' and the frozen
// state's): order-dependent, never 0. Pure.
uint64_t CombineChecksums(uint64_t a, uint64_t b);

}  // namespace gtopk

#endif  // GTOPK_COMMON_CHECKSUM_H_
