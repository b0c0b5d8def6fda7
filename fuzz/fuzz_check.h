// Shared by the libFuzzer harnesses of fuzz/ (docs/fuzzing.md): an invariant
// check that aborts with a message, so that libFuzzer records the input as a
// crash, and small readers of the fuzzer's bytes. Test tooling, not an API.
#ifndef GTOPK_FUZZ_FUZZ_CHECK_H_
#define GTOPK_FUZZ_FUZZ_CHECK_H_

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

// Aborts (a libFuzzer crash) when `cond` is false, printing where and why.
#define FUZZ_CHECK(cond, ...)                                           \
  do {                                                                  \
    if (!(cond)) {                                                      \
      std::fprintf(stderr, "%s:%d: invariant violated: %s\n", __FILE__, \
                   __LINE__, #cond);                                    \
      std::fprintf(stderr, "  " __VA_ARGS__);                           \
      std::fprintf(stderr, "\n");                                       \
      std::abort();                                                     \
    }                                                                   \
  } while (0)

namespace gtopk {
namespace fuzz {

// The status codes remote or user input may produce: any other (INTERNAL,
// UNKNOWN, ...) on a parser's error path is a bug.
inline bool IsInputError(const absl::Status& s) {
  return absl::IsInvalidArgument(s) || absl::IsFailedPrecondition(s) ||
         absl::IsDataLoss(s) || absl::IsOutOfRange(s) ||
         absl::IsPermissionDenied(s) || absl::IsNotFound(s) ||
         absl::IsResourceExhausted(s) || absl::IsAlreadyExists(s) ||
         absl::IsUnauthenticated(s);
}

// Consumes the fuzzer's bytes front to back; reads past the end give zeros.
class Bytes {
 public:
  Bytes(const uint8_t* data, size_t size) : data_(data), size_(size) {}
  uint8_t U8() { return pos_ < size_ ? data_[pos_++] : 0; }
  uint32_t U32() {
    uint32_t v = 0;
    for (int i = 0; i < 4; ++i) v |= uint32_t{U8()} << (8 * i);
    return v;
  }
  uint64_t U64() { return uint64_t{U32()} | (uint64_t{U32()} << 32); }
  float F32() {
    const uint32_t bits = U32();
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
  }
  // The bytes not consumed yet.
  absl::string_view Rest() const {
    return absl::string_view(reinterpret_cast<const char*>(data_) + pos_,
                             size_ - pos_);
  }
  size_t remaining() const { return size_ - pos_; }

 private:
  const uint8_t* data_;
  size_t size_;
  size_t pos_ = 0;
};

inline uint32_t FloatBits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, sizeof b);
  return b;
}

}  // namespace fuzz
}  // namespace gtopk

#endif  // GTOPK_FUZZ_FUZZ_CHECK_H_
