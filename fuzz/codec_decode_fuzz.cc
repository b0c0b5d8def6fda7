// libFuzzer harness: the sparse codecs' decoder (common/codec.h DecodeSparse,
// PeekCodecSpec), as a shard decodes a Push's bytes and a worker a Pull's.
//
// Input: byte 0 picks the receiver's dense length n (kLengths below); the
// rest is the message. Invariants checked:
//   - a failure is INVALID_ARGUMENT and leaves the output empty;
//   - a success satisfies ValidateSparseVector(out, n) (sorted, unique,
//     every index < n, every value finite), PeekCodecSpec agrees, and every
//     value is representable in the message's value codec
//     (QuantizeValue(codec, v) == v bit for bit);
//   - re-encoding the decoded vector with the same codecs gives a message
//     that decodes to the same vector, bit for bit, and is no longer than
//     the input (the encoder never writes over-long varints);
//   - the decoder never allocates more than O(input) (ASan's malloc limit,
//     -malloc_limit_mb, and the documented bound: count <= bytes).
#include <cstddef>
#include <cstdint>
#include <string>

#include "common/codec.h"
#include "common/sparse_vector.h"
#include "fuzz/fuzz_check.h"

namespace {

constexpr uint64_t kLengths[] = {
    0, 1, 2, 100, 1000, 65536, 1u << 20, 0xFFFFFFFFu, uint64_t{1} << 32};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace gtopk;
  fuzz::Bytes in(data, size);
  const uint64_t n = kLengths[in.U8() % (sizeof kLengths / sizeof *kLengths)];
  const absl::string_view message = in.Rest();

  SparseVector out;
  out.push_back(7, 1.0f);  // must be cleared on failure too
  const absl::Status s = DecodeSparse(message, n, &out);
  if (!s.ok()) {
    FUZZ_CHECK(absl::IsInvalidArgument(s), "decode error code: %s",
               s.ToString().c_str());
    FUZZ_CHECK(out.indices.empty() && out.values.empty(),
               "output not empty after a failed decode");
    return 0;
  }
  FUZZ_CHECK(ValidateSparseVector(out, n).ok(), "decoded vector invalid: %s",
             ValidateSparseVector(out, n).ToString().c_str());
  FUZZ_CHECK(out.size() <= message.size(), "%zu pairs from %zu bytes",
             out.size(), message.size());
  const absl::StatusOr<CodecSpec> spec = PeekCodecSpec(message);
  FUZZ_CHECK(spec.ok(), "decoded but PeekCodecSpec fails: %s",
             spec.status().ToString().c_str());
  for (float v : out.values) {
    FUZZ_CHECK(
        fuzz::FloatBits(QuantizeValue(spec->value, v)) == fuzz::FloatBits(v),
        "decoded value %a not representable in %s", v,
        std::string(ValueCodecName(spec->value)).c_str());
  }
  std::string again;
  const absl::Status e = EncodeSparse(out, n, *spec, &again);
  FUZZ_CHECK(e.ok(), "re-encode failed: %s", e.ToString().c_str());
  FUZZ_CHECK(again.size() <= message.size(), "re-encode grew %zu -> %zu",
             message.size(), again.size());
  FUZZ_CHECK(again.size() <= MaxEncodedSize(out.size(), *spec),
             "MaxEncodedSize(%zu) = %zu < %zu", out.size(),
             MaxEncodedSize(out.size(), *spec), again.size());
  SparseVector back;
  const absl::Status d = DecodeSparse(again, n, &back);
  FUZZ_CHECK(d.ok(), "re-encoded message does not decode: %s",
             d.ToString().c_str());
  FUZZ_CHECK(back.indices == out.indices, "indices differ after round trip");
  FUZZ_CHECK(back.values.size() == out.values.size(), "value count differs");
  for (size_t j = 0; j < out.values.size(); ++j) {
    FUZZ_CHECK(
        fuzz::FloatBits(back.values[j]) == fuzz::FloatBits(out.values[j]),
        "value %zu differs after round trip", j);
  }
  return 0;
}
