// libFuzzer harness: encode then decode (common/codec.h) of arbitrary sparse
// vectors, with every pair of codecs.
//
// Input: byte 0: index codec (mod 3); byte 1: value codec (mod 3); bytes
// 2..9: n (mod 2^32 + 1); then records of 8 bytes, (uint32 gap, float
// value), turned into a strictly ascending index list (index = previous +
// 1 + gap, the first one is gap itself) while it stays < n. Invariants:
//   - EncodeSparse accepts exactly the vectors ValidateSparseVector accepts
//     (a NaN/Inf value is INVALID_ARGUMENT), and on success
//     DecodeSparse(EncodeSparse(v)) has v's indices and values equal to
//     QuantizeValue(codec, v) bit for bit (lossless for fp32: -0.0 and
//     denormals kept; fp16/bf16 saturate finite values, never Inf);
//   - the message is at most MaxEncodedSize(count, spec) bytes (exactly for
//     raw indices), and PeekCodecSpec names the codecs used;
//   - decoding against a smaller n (the largest index) fails with
//     INVALID_ARGUMENT; against exactly largest + 1 succeeds.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>

#include "common/codec.h"
#include "common/sparse_vector.h"
#include "fuzz/fuzz_check.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace gtopk;
  fuzz::Bytes in(data, size);
  CodecSpec spec;
  spec.index = static_cast<IndexCodec>(in.U8() % 3);
  spec.value = static_cast<ValueCodec>(in.U8() % 3);
  const uint64_t n = in.U64() % (kMaxDenseLength + 1);

  SparseVector v;
  uint64_t next = 0;  // smallest index allowed next
  bool all_finite = true;
  while (in.remaining() >= 8) {
    const uint32_t gap = in.U32();
    const float value = in.F32();
    const uint64_t index = next + gap;
    if (index >= n) break;
    v.push_back(static_cast<uint32_t>(index), value);
    all_finite = all_finite && std::isfinite(value);
    next = index + 1;
  }

  std::string bytes = "stale";
  const absl::Status e = EncodeSparse(v, n, spec, &bytes);
  if (!all_finite) {
    FUZZ_CHECK(absl::IsInvalidArgument(e), "non-finite value encoded: %s",
               e.ToString().c_str());
    FUZZ_CHECK(bytes.empty(), "output left after a failed encode");
    return 0;
  }
  FUZZ_CHECK(e.ok(), "valid vector refused: %s", e.ToString().c_str());
  FUZZ_CHECK(bytes.size() <= MaxEncodedSize(v.size(), spec),
             "%zu bytes > MaxEncodedSize %zu", bytes.size(),
             MaxEncodedSize(v.size(), spec));
  if (spec.index == IndexCodec::kRaw) {
    FUZZ_CHECK(bytes.size() == MaxEncodedSize(v.size(), spec),
               "raw size %zu != MaxEncodedSize %zu", bytes.size(),
               MaxEncodedSize(v.size(), spec));
  }
  const absl::StatusOr<CodecSpec> peek = PeekCodecSpec(bytes);
  FUZZ_CHECK(
      peek.ok() && peek->index == spec.index && peek->value == spec.value,
      "PeekCodecSpec disagrees");

  SparseVector back;
  const absl::Status d = DecodeSparse(bytes, n, &back);
  FUZZ_CHECK(d.ok(), "own message does not decode: %s", d.ToString().c_str());
  FUZZ_CHECK(back.indices == v.indices, "indices differ after round trip");
  FUZZ_CHECK(back.values.size() == v.values.size(), "value count differs");
  for (size_t j = 0; j < v.size(); ++j) {
    const float want = QuantizeValue(spec.value, v.values[j]);
    FUZZ_CHECK(std::isfinite(back.values[j]), "value %zu became %a", j,
               back.values[j]);
    FUZZ_CHECK(fuzz::FloatBits(back.values[j]) == fuzz::FloatBits(want),
               "value %zu: sent %a, want %a, got %a", j, v.values[j], want,
               back.values[j]);
  }
  if (!v.empty()) {
    const uint64_t largest = v.indices.back();
    FUZZ_CHECK(absl::IsInvalidArgument(DecodeSparse(bytes, largest, &back)),
               "index %llu accepted for n = %llu",
               static_cast<unsigned long long>(largest),
               static_cast<unsigned long long>(largest));
    FUZZ_CHECK(DecodeSparse(bytes, largest + 1, &back).ok(),
               "index %llu refused for n = %llu",
               static_cast<unsigned long long>(largest),
               static_cast<unsigned long long>(largest + 1));
  }
  return 0;
}
