// A fast checksum of a float vector's bits, for the divergence alarm
// (ClusterSpec.checksum_every, Push.params_checksum): every replica of a
// gtopk run holds bit-identical parameters, so equal vectors must give equal
// checksums on every worker and every build, and a replica changed behind
// the optimizer's back almost surely gives another.
#ifndef GTOPK_COMMON_CHECKSUM_H_
#define GTOPK_COMMON_CHECKSUM_H_

#include <cstdint>

#include "absl/types/span.h"

namespace gtopk {

// A 64-bit checksum of the IEEE-754 bit patterns of `values` (so -0.0 and
// 0.0, or two NaN payloads, differ), in order, and of their count. Four
// independent multiply-xorshift lanes over 64-bit words (two floats each),
// combined at the end with the count: about one memory read pass, the same
// value on every platform and build (integer arithmetic only). Not
// cryptographic: it detects accidents (a missed update, a write outside
// step(), nondeterministic kernels), not an adversary. Never 0 (0 means
// "no checksum" on the wire). Pure; thread-safe.
uint64_t ParamsChecksum(absl::Span<const float> values);

}  // namespace gtopk

#endif  // GTOPK_COMMON_CHECKSUM_H_
