#include "common/codec.h"

#include <algorithm>
#include <array>
#include <cstring>
#include <limits>
#include <utility>

#include "absl/base/casts.h"
#include "absl/base/config.h"
#include "absl/strings/str_cat.h"
#include "common/codec_wire.h"
#include "common/status_macros.h"

namespace gtopk {
namespace {

using namespace codec_wire;  // NOLINT: the codec's own wire primitives

// ---------------------------------------------------------------------------
// Encoding.

bool KnownIndexCodec(IndexCodec c) {
  return c == IndexCodec::kRaw || c == IndexCodec::kDeltaVarint ||
         c == IndexCodec::kDeltaBitpack;
}

bool KnownValueCodec(ValueCodec c) {
  return c == ValueCodec::kFp32 || c == ValueCodec::kFp16 ||
         c == ValueCodec::kBf16;
}

size_t ValueBytes(ValueCodec c) { return c == ValueCodec::kFp32 ? 4 : 2; }

size_t CeilDiv(size_t a, size_t b) { return (a + b - 1) / b; }

// The encoders take raw pointers, not vectors: stores through uint8_t* may
// alias anything, so the compiler would otherwise reload a vector's data
// pointer after every byte stored and could not vectorize (and Span's
// hardened operator[] would add a bounds check per element).
uint8_t* EncodeIndices(const uint32_t* idx, size_t count, IndexCodec codec,
                       uint8_t* p) {
  switch (codec) {
    case IndexCodec::kRaw:
#ifdef ABSL_IS_LITTLE_ENDIAN
      if (count > 0) std::memcpy(p, idx, count * sizeof(uint32_t));
      return p + count * sizeof(uint32_t);
#else
      for (size_t j = 0; j < count; ++j, p += 4) Store32LE(idx[j], p);
      return p;
#endif
    case IndexCodec::kDeltaVarint:
      if (count == 0) return p;
      p = WriteVarint(idx[0], p);
      for (size_t j = 1; j < count; ++j)
        p = WriteVarint(idx[j] - idx[j - 1], p);
      return p;
    case IndexCodec::kDeltaBitpack: {
      if (count == 0) return p;
      p = WriteVarint(idx[0], p);
      uint32_t gaps[kBlockGaps];
      for (size_t j = 1; j < count; j += kBlockGaps) {
        const size_t m = std::min(kBlockGaps, count - j);
        uint32_t all = 0;
        for (size_t t = 0; t < m; ++t) {
          gaps[t] = idx[j + t] - idx[j + t - 1];
          all |= gaps[t];
        }
        const uint32_t w = BitWidth(all);  // >= 1: gaps are >= 1
        *p++ = static_cast<uint8_t>(w);
        p = m == kBlockGaps ? kPackFullBlock[w](gaps, p)
                            : PackGaps(gaps, m, w, p);
      }
      return p;
    }
  }
  return p;
}

uint8_t* EncodeValues(const float* values, size_t count, ValueCodec codec,
                      uint8_t* p) {
  switch (codec) {
    case ValueCodec::kFp32:
#ifdef ABSL_IS_LITTLE_ENDIAN
      if (count > 0) std::memcpy(p, values, count * sizeof(float));
      return p + count * sizeof(float);
#else
      for (size_t j = 0; j < count; ++j, p += 4) {
        Store32LE(absl::bit_cast<uint32_t>(values[j]), p);
      }
      return p;
#endif
    case ValueCodec::kFp16:
      for (size_t j = 0; j < count; ++j) {
        Store16LE(FloatBitsToFp16(absl::bit_cast<uint32_t>(values[j])),
                  p + 2 * j);
      }
      return p + 2 * count;
    case ValueCodec::kBf16:
      for (size_t j = 0; j < count; ++j) {
        Store16LE(FloatBitsToBf16(absl::bit_cast<uint32_t>(values[j])),
                  p + 2 * j);
      }
      return p + 2 * count;
  }
  return p;
}

// True when `v` certainly satisfies ValidateSparseVector(v, n): one
// branch-free pass the compiler can vectorize. EncodeSparse falls back to
// ValidateSparseVector (for its precise message) only when this fails.
bool QuickValid(const SparseVector& v, uint64_t n) {
  const size_t count = v.indices.size();
  if (v.values.size() != count) return false;
  if (count == 0) return true;
  const uint32_t* idx = v.indices.data();
  uint32_t not_ascending = 0;
  for (size_t j = 1; j < count; ++j) {
    not_ascending |= static_cast<uint32_t>(idx[j] <= idx[j - 1]);
  }
  uint32_t all_exponents = 0;
  const float* values = v.values.data();
  for (size_t j = 0; j < count; ++j) {
    // Non-zero iff some value has an all-ones exponent (Inf or NaN).
    const uint32_t e = absl::bit_cast<uint32_t>(values[j]) & 0x7f800000u;
    all_exponents |= (e == 0x7f800000u) ? 1u : 0u;
  }
  return not_ascending == 0 && all_exponents == 0 && idx[count - 1] < n;
}

// ---------------------------------------------------------------------------
// Decoding. Every read is bounds-checked against `end` before it happens.

struct Reader {
  const uint8_t* begin;
  const uint8_t* p;
  const uint8_t* end;

  size_t offset() const { return static_cast<size_t>(p - begin); }
  size_t remaining() const { return static_cast<size_t>(end - p); }
};

template <typename... Args>
absl::Status Corrupt(const Args&... args) {
  return absl::InvalidArgumentError(
      absl::StrCat("invalid sparse message: ", args...));
}

absl::Status VarintError(VarintResult r, size_t offset,
                         absl::string_view what) {
  switch (r) {
    case VarintResult::kTruncated:
      return Corrupt("truncated varint (", what, ") at byte offset ", offset);
    case VarintResult::kTooLong:
      return Corrupt("varint (", what, ") at byte offset ", offset,
                     " is longer than 5 bytes");
    case VarintResult::kOverflow:
      return Corrupt("varint (", what, ") at byte offset ", offset,
                     " overflows uint32");
    case VarintResult::kOk:
      break;
  }
  return absl::OkStatus();
}

absl::Status Truncated(const Reader& r, absl::string_view what, uint64_t need) {
  return Corrupt("truncated ", what, " at byte offset ", r.offset(), ": needs ",
                 need, " bytes but only ", r.remaining(), " remain");
}

// The fault of index j = prev + gap (decoded from byte offset `offset`),
// where gap == 0 or the sum is >= n.
absl::Status GapFault(size_t j, uint64_t prev, uint64_t gap, uint64_t n,
                      size_t offset) {
  if (gap == 0) {
    return Corrupt("gap 0 (duplicate index ", prev, ") at entry position ", j,
                   " (byte offset ", offset, ")");
  }
  const uint64_t index = prev + gap;
  if (index > kMaxUint32) {
    return Corrupt("index overflows 2^32-1 at entry position ", j,
                   " (byte offset ", offset, "): ", prev, " + gap ", gap);
  }
  return Corrupt("index ", index, " >= n = ", n, " at entry position ", j,
                 " (byte offset ", offset, ")");
}

absl::Status DecodeRawIndices(Reader& r, size_t count, uint64_t n,
                              uint32_t* idx) {
  const size_t start = r.offset();
  if (r.remaining() / 4 < count) {
    return Truncated(r, "raw index section", uint64_t{count} * 4);
  }
#ifdef ABSL_IS_LITTLE_ENDIAN
  if (count > 0) std::memcpy(idx, r.p, count * sizeof(uint32_t));
#else
  for (size_t j = 0; j < count; ++j) idx[j] = Load32LE(r.p + 4 * j);
#endif
  r.p += count * 4;
  if (count == 0) return absl::OkStatus();
  // Fast check: ascending everywhere and the last (largest) index < n.
  uint32_t not_ascending = 0;
  for (size_t j = 1; j < count; ++j) {
    not_ascending |= static_cast<uint32_t>(idx[j] <= idx[j - 1]);
  }
  if (not_ascending == 0 && idx[count - 1] < n) return absl::OkStatus();
  for (size_t j = 0; j < count; ++j) {
    const size_t offset = start + 4 * j;
    if (idx[j] >= n) {
      return Corrupt("index ", idx[j], " >= n = ", n, " at entry position ", j,
                     " (byte offset ", offset, ")");
    }
    if (j > 0 && idx[j] <= idx[j - 1]) {
      return Corrupt("raw indices not strictly ascending at entry position ", j,
                     " (byte offset ", offset, "): ", idx[j], " after ",
                     idx[j - 1], idx[j] == idx[j - 1] ? " (duplicate)" : "");
    }
  }
  return absl::OkStatus();  // not reached
}

// Reads the first index of a delta section.
absl::Status DecodeFirstIndex(Reader& r, uint64_t n, uint32_t* first) {
  const size_t offset = r.offset();
  const VarintResult vr = ReadVarint(&r.p, r.end, first);
  if (vr != VarintResult::kOk) {
    return VarintError(vr, offset, "index at entry position 0");
  }
  if (*first >= n) {
    return Corrupt("index ", *first, " >= n = ", n,
                   " at entry position 0 (byte offset ", offset, ")");
  }
  return absl::OkStatus();
}

absl::Status DecodeVarintIndices(Reader& r, size_t count, uint64_t n,
                                 uint32_t* idx) {
  if (count == 0) return absl::OkStatus();
  GTOPK_RETURN_IF_ERROR(DecodeFirstIndex(r, n, &idx[0]));
  uint64_t prev = idx[0];
  for (size_t j = 1; j < count; ++j) {
    const uint8_t* at = r.p;
    uint32_t gap;
    const VarintResult vr = ReadVarint(&r.p, r.end, &gap);
    if (vr != VarintResult::kOk) {
      return VarintError(vr, static_cast<size_t>(at - r.begin),
                         absl::StrCat("gap at entry position ", j));
    }
    const uint64_t index = prev + gap;
    if (gap == 0 || index >= n) {
      return GapFault(j, prev, gap, n, static_cast<size_t>(at - r.begin));
    }
    idx[j] = static_cast<uint32_t>(index);
    prev = index;
  }
  return absl::OkStatus();
}

absl::Status DecodeBitpackIndices(Reader& r, size_t count, uint64_t n,
                                  uint32_t* idx) {
  if (count == 0) return absl::OkStatus();
  GTOPK_RETURN_IF_ERROR(DecodeFirstIndex(r, n, &idx[0]));
  uint64_t prev = idx[0];
  uint32_t gaps[kBlockGaps];
  for (size_t j = 1, block = 0; j < count; j += kBlockGaps, ++block) {
    const size_t m = std::min(kBlockGaps, count - j);
    if (r.remaining() < 1) {
      return Corrupt("truncated bit-packed block ", block,
                     ": missing its bit width at byte offset ", r.offset());
    }
    const uint32_t w = *r.p;
    if (w == 0 || w > 32) {
      return Corrupt(
          "bit width ", w, " of bit-packed block ", block, " at byte offset ",
          r.offset(),
          w == 0 ? " (all gaps 0: duplicate indices)" : " is larger than 32");
    }
    ++r.p;
    const size_t data_offset = r.offset();
    const size_t bits = m * w;
    const size_t bytes = CeilDiv(bits, 8);
    if (r.remaining() < bytes) {
      return Truncated(r, absl::StrCat("bit-packed block ", block), bytes);
    }
    // One combined check per block: with every gap >= 1 the running sum
    // is increasing, so the block's last index is its largest.
    bool zero = false;
    uint64_t last;
    if (m == kBlockGaps && r.remaining() >= bytes + 8) {
      last = kDecodeFullBlock[w](r.p, prev, idx + j, &zero);
    } else {
      UnpackGapsSafe(r.p, m, w, gaps);
      if (bits % 8 != 0 && (r.p[bytes - 1] >> (bits % 8)) != 0) {
        return Corrupt("non-zero padding bits in bit-packed block ", block,
                       " at byte offset ", data_offset + bytes - 1);
      }
      last = prev;
      for (size_t t = 0; t < m; ++t) {
        zero |= gaps[t] == 0;
        last += gaps[t];
        idx[j + t] = static_cast<uint32_t>(last);
      }
    }
    if (zero || last >= n) {
      UnpackGapsSafe(r.p, m, w, gaps);
      for (size_t t = 0; t < m; ++t) {
        if (gaps[t] == 0 || prev + gaps[t] >= n) {
          // The gap's first bit is at bit t*w of the block's data.
          return GapFault(j + t, prev, gaps[t], n, data_offset + t * w / 8);
        }
        prev += gaps[t];
      }
    }
    r.p += bytes;
    prev = last;
  }
  return absl::OkStatus();
}

absl::Status NonFiniteValue(ValueCodec codec, size_t j, size_t offset,
                            uint32_t bits) {
  return Corrupt(ValueCodecName(codec), " value at entry position ", j,
                 " (byte offset ", offset, ") decodes to Inf or NaN (bits 0x",
                 absl::Hex(bits), ")");
}

absl::Status DecodeValues(Reader& r, size_t count, ValueCodec codec,
                          float* values) {
  const size_t vb = ValueBytes(codec);
  if (r.remaining() / vb < count) {
    return Truncated(r, absl::StrCat(ValueCodecName(codec), " value section"),
                     uint64_t{count} * vb);
  }
  const uint8_t* p = r.p;
  const size_t start = r.offset();
  r.p += count * vb;
  // Each loop keeps the largest |bits| seen (a branch-free reduction);
  // a value is Inf/NaN iff its |bits| reaches the all-ones exponent.
  switch (codec) {
    case ValueCodec::kFp32: {
      uint32_t max_abs = 0;
      for (size_t j = 0; j < count; ++j) {
        const uint32_t b = Load32LE(p + 4 * j);
        max_abs = std::max(max_abs, b & 0x7fffffffu);
        values[j] = absl::bit_cast<float>(b);
      }
      if (max_abs < 0x7f800000u) return absl::OkStatus();
      for (size_t j = 0; j < count; ++j) {
        const uint32_t b = Load32LE(p + 4 * j);
        if (!FloatBitsFinite(b))
          return NonFiniteValue(codec, j, start + 4 * j, b);
      }
      break;
    }
    case ValueCodec::kFp16: {
      uint32_t max_abs = 0;
      for (size_t j = 0; j < count; ++j) {
        const uint16_t h = Load16LE(p + 2 * j);
        max_abs = std::max<uint32_t>(max_abs, h & 0x7fffu);
        values[j] = absl::bit_cast<float>(Fp16ToFloatBits(h));
      }
      if (max_abs < 0x7c00u) return absl::OkStatus();
      for (size_t j = 0; j < count; ++j) {
        const uint16_t h = Load16LE(p + 2 * j);
        if (!Fp16Finite(h)) return NonFiniteValue(codec, j, start + 2 * j, h);
      }
      break;
    }
    case ValueCodec::kBf16: {
      uint32_t max_abs = 0;
      for (size_t j = 0; j < count; ++j) {
        const uint16_t h = Load16LE(p + 2 * j);
        max_abs = std::max<uint32_t>(max_abs, h & 0x7fffu);
        values[j] = absl::bit_cast<float>(Bf16ToFloatBits(h));
      }
      if (max_abs < 0x7f80u) return absl::OkStatus();
      for (size_t j = 0; j < count; ++j) {
        const uint16_t h = Load16LE(p + 2 * j);
        if (!Bf16Finite(h)) return NonFiniteValue(codec, j, start + 2 * j, h);
      }
      break;
    }
  }
  return absl::OkStatus();
}

// The fewest bytes `count` entries can take after the count varint: used to
// reject an inflated count before allocating for it.
uint64_t MinPayloadBytes(uint64_t count, IndexCodec index, ValueCodec value) {
  uint64_t bytes = count * ValueBytes(value);
  switch (index) {
    case IndexCodec::kRaw:
      bytes += 4 * count;
      break;
    case IndexCodec::kDeltaVarint:
      bytes += count;
      break;
    case IndexCodec::kDeltaBitpack:
      // First index, then one width byte per block (data may be tiny).
      if (count > 0) bytes += 1 + CeilDiv(count - 1, kBlockGaps);
      break;
  }
  return bytes;
}

// Parses the fixed header (version, codec ids) at the start of `bytes`.
absl::StatusOr<CodecSpec> ParseFixedHeader(absl::string_view bytes) {
  const uint8_t* begin = reinterpret_cast<const uint8_t*>(bytes.data());
  Reader r{begin, begin, begin + bytes.size()};
  if (r.remaining() < 1) {
    return Corrupt("truncated header: empty message (byte offset 0)");
  }
  if (r.p[0] != kCodecFormatVersion) {
    return Corrupt("unknown format version ", int{r.p[0]},
                   " at byte offset 0 (expected ", int{kCodecFormatVersion},
                   ")");
  }
  if (r.remaining() < 2) {
    return Corrupt("truncated header: missing index codec id at byte offset 1");
  }
  const auto index_codec = static_cast<IndexCodec>(r.p[1]);
  if (!KnownIndexCodec(index_codec)) {
    return Corrupt("unknown index codec id ", int{r.p[1]}, " at byte offset 1");
  }
  if (r.remaining() < 3) {
    return Corrupt("truncated header: missing value codec id at byte offset 2");
  }
  const auto value_codec = static_cast<ValueCodec>(r.p[2]);
  if (!KnownValueCodec(value_codec)) {
    return Corrupt("unknown value codec id ", int{r.p[2]}, " at byte offset 2");
  }
  return CodecSpec{index_codec, value_codec};
}

absl::Status DecodeImpl(absl::string_view bytes, uint64_t n,
                        SparseVector* out) {
  if (n > kMaxDenseLength) {
    return absl::InvalidArgumentError(
        absl::StrCat("DecodeSparse: dense length n = ", n, " exceeds 2^32"));
  }
  absl::StatusOr<CodecSpec> spec = ParseFixedHeader(bytes);
  if (!spec.ok()) return spec.status();
  const IndexCodec index_codec = spec->index;
  const ValueCodec value_codec = spec->value;
  const uint8_t* begin = reinterpret_cast<const uint8_t*>(bytes.data());
  Reader r{begin, begin, begin + bytes.size()};
  r.p += kFixedHeaderBytes;

  uint32_t count32 = 0;
  const size_t count_offset = r.offset();
  const VarintResult vr = ReadVarint(&r.p, r.end, &count32);
  if (vr != VarintResult::kOk) return VarintError(vr, count_offset, "count");
  const size_t count = count32;
  const uint64_t min_bytes = MinPayloadBytes(count, index_codec, value_codec);
  if (min_bytes > r.remaining()) {
    return Corrupt("count ", count, " at byte offset ", count_offset,
                   " needs at least ", min_bytes, " bytes after byte offset ",
                   r.offset(), " but only ", r.remaining(), " remain");
  }
  if (count > n) {
    return Corrupt("count ", count, " at byte offset ", count_offset,
                   " exceeds the dense length n = ", n);
  }

  // Bounded by the message size (checked above), so safe to allocate.
  out->indices.resize(count);
  out->values.resize(count);
  switch (index_codec) {
    case IndexCodec::kRaw:
      GTOPK_RETURN_IF_ERROR(DecodeRawIndices(r, count, n, out->indices.data()));
      break;
    case IndexCodec::kDeltaVarint:
      GTOPK_RETURN_IF_ERROR(
          DecodeVarintIndices(r, count, n, out->indices.data()));
      break;
    case IndexCodec::kDeltaBitpack:
      GTOPK_RETURN_IF_ERROR(
          DecodeBitpackIndices(r, count, n, out->indices.data()));
      break;
  }
  GTOPK_RETURN_IF_ERROR(
      DecodeValues(r, count, value_codec, out->values.data()));
  if (r.remaining() != 0) {
    return Corrupt(r.remaining(), " trailing bytes at byte offset ", r.offset(),
                   " after the value section");
  }
  return absl::OkStatus();
}

}  // namespace

absl::string_view IndexCodecName(IndexCodec codec) {
  switch (codec) {
    case IndexCodec::kRaw:
      return "raw";
    case IndexCodec::kDeltaVarint:
      return "delta-varint";
    case IndexCodec::kDeltaBitpack:
      return "delta-bitpack";
  }
  return "unknown";
}

absl::string_view ValueCodecName(ValueCodec codec) {
  switch (codec) {
    case ValueCodec::kFp32:
      return "fp32";
    case ValueCodec::kFp16:
      return "fp16";
    case ValueCodec::kBf16:
      return "bf16";
  }
  return "unknown";
}

absl::StatusOr<IndexCodec> ParseIndexCodec(absl::string_view name) {
  for (IndexCodec c : {IndexCodec::kRaw, IndexCodec::kDeltaVarint,
                       IndexCodec::kDeltaBitpack}) {
    if (name == IndexCodecName(c)) return c;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown index codec \"", name,
                   "\"; known: raw, delta-varint, delta-bitpack"));
}

absl::StatusOr<ValueCodec> ParseValueCodec(absl::string_view name) {
  for (ValueCodec c :
       {ValueCodec::kFp32, ValueCodec::kFp16, ValueCodec::kBf16}) {
    if (name == ValueCodecName(c)) return c;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "unknown value codec \"", name, "\"; known: fp32, fp16, bf16"));
}

float QuantizeValue(ValueCodec codec, float x) {
  const uint32_t b = absl::bit_cast<uint32_t>(x);
  if (!FloatBitsFinite(b)) return x;
  switch (codec) {
    case ValueCodec::kFp32:
      return x;
    case ValueCodec::kFp16:
      return absl::bit_cast<float>(Fp16ToFloatBits(FloatBitsToFp16(b)));
    case ValueCodec::kBf16:
      return absl::bit_cast<float>(Bf16ToFloatBits(FloatBitsToBf16(b)));
  }
  return x;
}

void QuantizeValues(ValueCodec codec, absl::Span<float> values) {
  if (codec == ValueCodec::kFp32) return;
  for (float& x : values) x = QuantizeValue(codec, x);
}

size_t MaxEncodedSize(size_t count, CodecSpec spec) {
  size_t size = kFixedHeaderBytes + VarintSize(count);
  switch (spec.index) {
    case IndexCodec::kRaw:
      size += 4 * count;
      break;
    case IndexCodec::kDeltaVarint:
      size += kMaxVarintBytes * count;
      break;
    case IndexCodec::kDeltaBitpack:
      if (count > 0) {
        size +=
            kMaxVarintBytes + CeilDiv(count - 1, kBlockGaps) + 4 * (count - 1);
      }
      break;
  }
  return size + ValueBytes(spec.value) * count;
}

absl::Status EncodeSparse(const SparseVector& v, uint64_t n, CodecSpec spec,
                          std::string* out) {
  out->clear();
  if (n > kMaxDenseLength) {
    return absl::InvalidArgumentError(
        absl::StrCat("EncodeSparse: dense length n = ", n, " exceeds 2^32"));
  }
  if (!KnownIndexCodec(spec.index)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "EncodeSparse: unknown index codec id ", static_cast<int>(spec.index)));
  }
  if (!KnownValueCodec(spec.value)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "EncodeSparse: unknown value codec id ", static_cast<int>(spec.value)));
  }
  if (!QuickValid(v, n)) GTOPK_RETURN_IF_ERROR(ValidateSparseVector(v, n));
  const size_t count = v.size();
  if (count > kMaxUint32) {
    return absl::InvalidArgumentError(absl::StrCat(
        "EncodeSparse: ", count, " entries; at most 2^32-1 fit a message"));
  }
  out->resize(MaxEncodedSize(count, spec));
  uint8_t* const begin = reinterpret_cast<uint8_t*>(&(*out)[0]);
  uint8_t* p = begin;
  *p++ = kCodecFormatVersion;
  *p++ = static_cast<uint8_t>(spec.index);
  *p++ = static_cast<uint8_t>(spec.value);
  p = WriteVarint(static_cast<uint32_t>(count), p);
  p = EncodeIndices(v.indices.data(), count, spec.index, p);
  p = EncodeValues(v.values.data(), count, spec.value, p);
  out->resize(static_cast<size_t>(p - begin));
  return absl::OkStatus();
}

absl::Status DecodeSparse(absl::string_view bytes, uint64_t n,
                          SparseVector* out) {
  absl::Status status = DecodeImpl(bytes, n, out);
  if (!status.ok()) out->clear();
  return status;
}

absl::StatusOr<CodecSpec> PeekCodecSpec(absl::string_view bytes) {
  return ParseFixedHeader(bytes);
}

absl::StatusOr<uint64_t> PeekSparseCount(absl::string_view bytes) {
  absl::StatusOr<CodecSpec> spec = ParseFixedHeader(bytes);
  if (!spec.ok()) return spec.status();
  const uint8_t* begin = reinterpret_cast<const uint8_t*>(bytes.data());
  Reader r{begin, begin + kFixedHeaderBytes, begin + bytes.size()};
  uint32_t count = 0;
  const size_t count_offset = r.offset();
  const VarintResult vr = ReadVarint(&r.p, r.end, &count);
  if (vr != VarintResult::kOk) return VarintError(vr, count_offset, "count");
  return uint64_t{count};
}

}  // namespace gtopk
