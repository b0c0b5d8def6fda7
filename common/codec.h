// Wire codecs for sparse vectors: how a SparseVector (sorted uint32 indices
// plus float values) is turned into bytes on the wire and back.
//
// A message is self-describing (it names its codecs), so a receiver decodes
// whatever a sender chose; the dense length n is not on the wire and is
// supplied by the receiver, which validates every index against it.
//
// Message byte layout (all multi-byte fixed-width fields little-endian):
//
//   offset 0  uint8   format version, kCodecFormatVersion (1)
//   offset 1  uint8   index codec id (IndexCodec)
//   offset 2  uint8   value codec id (ValueCodec)
//   offset 3  varint  count: number of (index, value) pairs, <= 2^32-1
//             ...     index section (IndexCodec below), `count` indices
//             ...     value section (ValueCodec below), `count` values
//   No trailing bytes.
//
// "varint" is unsigned LEB128 of a uint32: 7 bits per byte, least significant
// group first, high bit set on every byte but the last; at most 5 bytes, and
// the 5th byte holds only the top 4 bits (<= 0x0F). Over-long encodings of a
// small value (e.g. 0x80 0x00 for 0) are accepted by the decoder but never
// produced by the encoder.
//
// Index sections (indices are strictly ascending, so every gap is >= 1):
//   kRaw          count x uint32 LE.                            4 B/index
//   kDeltaVarint  varint(index[0]), then varint(index[j] - index[j-1]) for
//                 j = 1..count-1.          1-5 B/index; 1.88 at density 0.001
//   kDeltaBitpack varint(index[0]), then the count-1 gaps in blocks of 128
//                 (the last block may be shorter, m gaps). Each block is
//                   1 byte   bit width w in [1, 32]: the bit length of the
//                            block's largest gap
//                   ceil(m*w/8) bytes: the m gaps, each w bits, packed
//                            LSB-first (gap t occupies bits [t*w, (t+1)*w)
//                            of the block's little-endian bit stream);
//                            unused high bits of the last byte are zero.
//                 Smaller and faster than kDeltaVarint (1.62 B/index at
//                 density 0.001; see bench/codec_bench.cc).
// Value sections:
//   kFp32  count x IEEE binary32 LE, bit-exact (-0.0 and denormals kept).
//   kFp16  count x IEEE binary16 LE (1 sign, 5 exponent, 10 mantissa bits).
//   kBf16  count x bfloat16 LE (the top 16 bits of a binary32).
// fp16/bf16 encoding rounds to nearest, ties to even (subnormal results
// included); finite inputs beyond the target's range saturate to the largest
// finite value of their sign (fp16: ±65504, bf16: ±3.3895314e38) so a finite
// input never becomes Inf. A decoded Inf or NaN is an error.
//
// Thread-safety: every function here is a pure function of its arguments;
// calls with distinct outputs may run concurrently.
#ifndef GTOPK_COMMON_CODEC_H_
#define GTOPK_COMMON_CODEC_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "common/sparse_vector.h"

namespace gtopk {

// The format version written at byte 0 of every message.
inline constexpr uint8_t kCodecFormatVersion = 1;

// How indices are coded; the numeric value is the id on the wire.
enum class IndexCodec : uint8_t {
  kRaw = 0,           // "raw"
  kDeltaVarint = 1,   // "delta-varint"
  kDeltaBitpack = 2,  // "delta-bitpack"
};

// How values are coded; the numeric value is the id on the wire.
enum class ValueCodec : uint8_t {
  kFp32 = 0,  // "fp32": lossless
  kFp16 = 1,  // "fp16": IEEE binary16, lossy, saturating
  kBf16 = 2,  // "bf16": bfloat16, lossy, saturating
};

// The pair of codecs a sender uses. Defaults: lossless, compact indices.
struct CodecSpec {
  IndexCodec index = IndexCodec::kDeltaVarint;
  ValueCodec value = ValueCodec::kFp32;
};

// Names, as used in flags and configs: "raw", "delta-varint",
// "delta-bitpack", "fp32", "fp16", "bf16". An enumerator outside the list
// (e.g. a cast from a bad wire id) is named "unknown".
absl::string_view IndexCodecName(IndexCodec codec);
absl::string_view ValueCodecName(ValueCodec codec);

// Parses a name above (exact, case-sensitive). Errors: INVALID_ARGUMENT
// naming the input and listing the known names.
absl::StatusOr<IndexCodec> ParseIndexCodec(absl::string_view name);
absl::StatusOr<ValueCodec> ParseValueCodec(absl::string_view name);

// What a receiver decodes for `x` sent with `codec`: the lossy round trip
// (identity for kFp32; round-to-nearest-even and saturation for kFp16/kBf16,
// see the file comment). Error feedback uses it to keep the quantization
// error `x - QuantizeValue(codec, x)` in the residual. Non-finite inputs
// (which EncodeSparse rejects) are returned unchanged.
float QuantizeValue(ValueCodec codec, float x);

// Applies QuantizeValue to every element of `values`, in place.
void QuantizeValues(ValueCodec codec, absl::Span<float> values);

// An upper bound, in bytes, on the size of EncodeSparse's output for `count`
// pairs with `spec` (exact for IndexCodec::kRaw). Useful to reserve buffers
// or to check a size limit before encoding.
size_t MaxEncodedSize(size_t count, CodecSpec spec);

// Encodes `v` (a sparse vector over a dense length `n`, 0 <= n <= 2^32) in
// the format above and *replaces* the contents of `*out` with the message
// (its capacity is reused). O(v.size()); `v` is not modified and not
// retained.
//
// Errors (`*out` is left empty):
//   INVALID_ARGUMENT  n > 2^32; `v` breaks a SparseVector invariant
//                     (ValidateSparseVector: sizes differ, indices not
//                     strictly ascending or >= n, a NaN/Inf value), with the
//                     first fault's position; `spec` holds an unknown id.
absl::Status EncodeSparse(const SparseVector& v, uint64_t n, CodecSpec spec,
                          std::string* out);

// Decodes a message produced by EncodeSparse into `*out`, checking it
// against the receiver's dense length `n` (0 <= n <= 2^32). On success *out
// satisfies ValidateSparseVector(*out, n); its values are exactly
// QuantizeValue(spec.value, sent value). `*out`'s capacity is reused.
// O(bytes.size()); allocates at most O(bytes.size()) whatever the message
// claims. Never reads outside `bytes`.
//
// Errors (`*out` is left empty), all INVALID_ARGUMENT with a message naming
// the fault and where (byte offset in `bytes` and/or entry position):
//   n > 2^32; truncated input (at any byte); unknown format version, index
//   codec or value codec id; a varint longer than 5 bytes or overflowing
//   uint32; a count larger than the remaining bytes can hold (checked before
//   allocating); a gap of 0 (duplicate index); raw indices not strictly
//   ascending; an index past 2^32-1 or >= n; a bit width of 0 or > 32;
//   non-zero padding bits in a bit-packed block; a decoded Inf or NaN value;
//   trailing bytes after the value section.
absl::Status DecodeSparse(absl::string_view bytes, uint64_t n,
                          SparseVector* out);

// The codecs named in the header of an encoded message (its first three
// bytes), without decoding the rest: lets a receiver reject a message in the
// wrong codec before decoding it. INVALID_ARGUMENT for an empty or truncated
// header, an unknown format version or an unknown codec id.
absl::StatusOr<CodecSpec> PeekCodecSpec(absl::string_view bytes);

// The pair count an encoded message claims (the header's count varint),
// without decoding or allocating: lets a receiver refuse a message that
// claims more pairs than it accepts before DecodeSparse allocates for them.
// INVALID_ARGUMENT for what PeekCodecSpec refuses and for a truncated,
// over-long or overflowing count varint. The claim is not checked against
// the rest of the bytes (DecodeSparse does that).
absl::StatusOr<uint64_t> PeekSparseCount(absl::string_view bytes);

}  // namespace gtopk

#endif  // GTOPK_COMMON_CODEC_H_
