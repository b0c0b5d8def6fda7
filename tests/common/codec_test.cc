#include "common/codec.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <limits>
#include <ostream>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace gtopk {

// Readable test parameter names in failure messages.
void PrintTo(IndexCodec c, std::ostream* os) { *os << IndexCodecName(c); }
void PrintTo(ValueCodec c, std::ostream* os) { *os << ValueCodecName(c); }

namespace {

using ::gtopk::testing::StatusIs;
using ::testing::HasSubstr;

constexpr IndexCodec kIndexCodecs[] = {
    IndexCodec::kRaw, IndexCodec::kDeltaVarint, IndexCodec::kDeltaBitpack};
constexpr ValueCodec kValueCodecs[] = {ValueCodec::kFp32, ValueCodec::kFp16,
                                       ValueCodec::kBf16};
constexpr uint32_t kMaxIndex = 0xffffffffu;

uint32_t Bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, sizeof(b));
  return b;
}

float FromBits(uint32_t b) {
  float f;
  std::memcpy(&f, &b, sizeof(f));
  return f;
}

// ---------------------------------------------------------------------------
// Reference 16-bit formats, by arithmetic on doubles (ldexp) rather than by
// the codec's bit manipulation.

struct Format16 {
  const char* name;
  ValueCodec codec;
  int mantissa_bits;  // 10 for fp16, 7 for bf16
  int exponent_bits;  // 5 for fp16, 8 for bf16
};

void PrintTo(const Format16& f, std::ostream* os) { *os << f.name; }

constexpr Format16 kFp16 = {"fp16", ValueCodec::kFp16, 10, 5};
constexpr Format16 kBf16 = {"bf16", ValueCodec::kBf16, 7, 8};

bool RefFinite(const Format16& f, uint16_t h) {
  const int e = (h >> f.mantissa_bits) & ((1 << f.exponent_bits) - 1);
  return e != (1 << f.exponent_bits) - 1;
}

// The value of a finite pattern h.
double RefValue(const Format16& f, uint16_t h) {
  const int bias = (1 << (f.exponent_bits - 1)) - 1;
  const int m = h & ((1 << f.mantissa_bits) - 1);
  const int e = (h >> f.mantissa_bits) & ((1 << f.exponent_bits) - 1);
  const double magnitude = e == 0 ? std::ldexp(m, 1 - bias - f.mantissa_bits)
                                  : std::ldexp((1 << f.mantissa_bits) + m,
                                               e - bias - f.mantissa_bits);
  return (h & 0x8000) ? -magnitude : magnitude;
}

// The positive finite values of the format, ascending, indexed by pattern
// (positive patterns are ordered like their values).
std::vector<double> PositiveFiniteValues(const Format16& f) {
  std::vector<double> v;
  for (uint32_t h = 0; h < 0x8000 && RefFinite(f, static_cast<uint16_t>(h));
       ++h) {
    v.push_back(RefValue(f, static_cast<uint16_t>(h)));
  }
  return v;
}

// Nearest representable value to finite x, ties to the even pattern;
// beyond the largest finite value: saturate to it (sign kept).
float RefQuantize(const std::vector<double>& positive, float x) {
  const double a = std::fabs(static_cast<double>(x));
  double r;
  if (a >= positive.back()) {
    r = positive.back();
  } else {
    const size_t hi = static_cast<size_t>(
        std::lower_bound(positive.begin(), positive.end(), a) -
        positive.begin());
    if (positive[hi] == a) {
      r = a;
    } else {
      const size_t lo = hi - 1;
      const double mid = (positive[lo] + positive[hi]) / 2;  // exact
      if (a < mid) {
        r = positive[lo];
      } else if (a > mid) {
        r = positive[hi];
      } else {
        r = positive[lo % 2 == 0 ? lo : hi];
      }
    }
  }
  return static_cast<float>(std::signbit(x) ? -r : r);
}

// ---------------------------------------------------------------------------
// Hand-made message builders.

void AppendVarint(uint64_t v, std::string* s) {
  while (v >= 0x80) {
    s->push_back(static_cast<char>((v & 0x7f) | 0x80));
    v >>= 7;
  }
  s->push_back(static_cast<char>(v));
}

void Append16(uint16_t v, std::string* s) {
  s->push_back(static_cast<char>(v & 0xff));
  s->push_back(static_cast<char>(v >> 8));
}

void Append32(uint32_t v, std::string* s) {
  for (int i = 0; i < 4; ++i) s->push_back(static_cast<char>(v >> (8 * i)));
}

std::string Header(int index_codec, int value_codec, uint64_t count) {
  std::string s = {1, static_cast<char>(index_codec),
                   static_cast<char>(value_codec)};
  AppendVarint(count, &s);
  return s;
}

std::string Bytes(std::initializer_list<int> bytes) {
  std::string s;
  for (int b : bytes) s.push_back(static_cast<char>(b));
  return s;
}

// Decodes from an exactly sized heap copy, so that ASan/valgrind flag any
// read past the end of the message.
absl::Status DecodeCopy(const std::string& bytes, size_t len, uint64_t n,
                        SparseVector* out) {
  std::vector<char> copy(bytes.begin(), bytes.begin() + len);
  return DecodeSparse(absl::string_view(copy.data(), copy.size()), n, out);
}

SparseVector Junk() {
  SparseVector v;
  v.push_back(1, 2.0f);
  return v;
}

// ---------------------------------------------------------------------------
// Random inputs.

std::vector<uint32_t> RandomSubset(size_t k, uint64_t n, std::mt19937_64& rng) {
  std::uniform_int_distribution<uint64_t> pick(0, n - 1);
  std::vector<uint32_t> idx;
  while (idx.size() < k) {
    while (idx.size() < k) idx.push_back(static_cast<uint32_t>(pick(rng)));
    std::sort(idx.begin(), idx.end());
    idx.erase(std::unique(idx.begin(), idx.end()), idx.end());
  }
  return idx;
}

// Normal values with ~10% specials: signed zeros, denormals, range limits.
std::vector<float> RandomValues(size_t k, std::mt19937_64& rng) {
  static const float kSpecials[] = {
      0.0f,     -0.0f,    std::numeric_limits<float>::denorm_min(),
      -1e-40f,  FLT_MIN,  FLT_MIN / 3,
      FLT_MAX,  -FLT_MAX, 1e6f,
      -65504.f, 65520.f,  65519.f,
      6e-8f,    -3e-8f,   1.0f + 1.0f / 2048,
      1e30f,    -1e-30f};
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<size_t> special(0, std::size(kSpecials) - 1);
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  std::vector<float> v(k);
  for (float& x : v)
    x = unit(rng) < 0.1 ? kSpecials[special(rng)] : normal(rng);
  return v;
}

// ---------------------------------------------------------------------------
// Names.

TEST(CodecNamesTest, RoundTrip) {
  for (IndexCodec c : kIndexCodecs) {
    GTOPK_ASSERT_OK_AND_ASSIGN(IndexCodec parsed,
                               ParseIndexCodec(IndexCodecName(c)));
    EXPECT_EQ(parsed, c);
  }
  for (ValueCodec c : kValueCodecs) {
    GTOPK_ASSERT_OK_AND_ASSIGN(ValueCodec parsed,
                               ParseValueCodec(ValueCodecName(c)));
    EXPECT_EQ(parsed, c);
  }
  EXPECT_EQ(IndexCodecName(IndexCodec::kDeltaBitpack), "delta-bitpack");
  EXPECT_EQ(ValueCodecName(ValueCodec::kBf16), "bf16");
  EXPECT_EQ(IndexCodecName(static_cast<IndexCodec>(9)), "unknown");
  CodecSpec spec;
  EXPECT_EQ(spec.index, IndexCodec::kDeltaVarint);
  EXPECT_EQ(spec.value, ValueCodec::kFp32);
}

TEST(CodecNamesTest, UnknownNamesListTheKnownOnes) {
  EXPECT_THAT(ParseIndexCodec("varint"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("\"varint\"; known: raw, delta-varint, "
                                 "delta-bitpack")));
  EXPECT_THAT(ParseValueCodec("FP16"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("known: fp32, fp16, bf16")));
}

// ---------------------------------------------------------------------------
// fp16 / bf16 against the references.

class Format16Test : public ::testing::TestWithParam<Format16> {};

// Every finite pattern decodes to its reference value; every Inf/NaN
// pattern is rejected.
TEST_P(Format16Test, DecodesEveryPatternExhaustively) {
  const Format16& f = GetParam();
  std::vector<uint16_t> finite;
  for (uint32_t h = 0; h < 65536; ++h) {
    if (RefFinite(f, static_cast<uint16_t>(h))) {
      finite.push_back(static_cast<uint16_t>(h));
      continue;
    }
    std::string bad = Header(0, static_cast<int>(f.codec), 1);
    Append32(0, &bad);
    Append16(static_cast<uint16_t>(h), &bad);
    SparseVector out;
    ASSERT_THAT(DecodeSparse(bad, 1, &out),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr("decodes to Inf or NaN")))
        << f.name << " pattern " << h;
    ASSERT_TRUE(out.empty());
  }
  std::string msg = Header(0, static_cast<int>(f.codec), finite.size());
  for (size_t j = 0; j < finite.size(); ++j) {
    Append32(static_cast<uint32_t>(j), &msg);
  }
  for (uint16_t h : finite) Append16(h, &msg);
  SparseVector out;
  GTOPK_ASSERT_OK(DecodeSparse(msg, finite.size(), &out));
  ASSERT_EQ(out.size(), finite.size());
  for (size_t j = 0; j < finite.size(); ++j) {
    const double want = RefValue(f, finite[j]);
    ASSERT_EQ(static_cast<double>(out.values[j]), want)
        << f.name << " pattern " << finite[j];
    ASSERT_EQ(std::signbit(out.values[j]), (finite[j] & 0x8000) != 0);
    // Every representable value is a fixed point of quantization.
    ASSERT_EQ(Bits(QuantizeValue(f.codec, out.values[j])), Bits(out.values[j]));
  }
}

// QuantizeValue returns the nearest representable value, ties to even,
// saturating: checked at every midpoint between neighbours (the ties), on
// both sides of it, and over a strided sweep of all float bit patterns.
TEST_P(Format16Test, QuantizeIsRoundToNearestEvenSaturating) {
  const Format16& f = GetParam();
  const std::vector<double> positive = PositiveFiniteValues(f);
  std::vector<float> probes;
  for (size_t i = 0; i + 1 < positive.size(); ++i) {
    const float mid = static_cast<float>((positive[i] + positive[i + 1]) / 2);
    ASSERT_EQ(static_cast<double>(mid), (positive[i] + positive[i + 1]) / 2);
    probes.push_back(mid);
    probes.push_back(std::nextafter(mid, 0.0f));
    probes.push_back(std::nextafter(mid, INFINITY));
  }
  // Beyond the largest finite value: the tie with the next power of two,
  // above it, and the float extremes.
  const double top = positive.back();
  const double next = std::ldexp(1.0, std::ilogb(top) + 1);
  probes.push_back(static_cast<float>((top + next) / 2));
  probes.push_back(std::nextafter(static_cast<float>(top), INFINITY));
  probes.push_back(FLT_MAX);
  for (uint64_t b = 0; b < (uint64_t{1} << 32); b += 4099) {
    const float x = FromBits(static_cast<uint32_t>(b));
    if (std::isfinite(x)) probes.push_back(x);
  }
  const size_t positive_probes = probes.size();
  for (size_t i = 0; i < positive_probes; ++i) probes.push_back(-probes[i]);
  for (float x : probes) {
    const float want = RefQuantize(positive, x);
    const float got = QuantizeValue(f.codec, x);
    ASSERT_EQ(Bits(got), Bits(want))
        << f.name << " x=" << x << " (bits 0x" << std::hex << Bits(x)
        << "): got " << got << ", want " << want;
  }
  std::vector<float> span = probes;
  QuantizeValues(f.codec, absl::MakeSpan(span));
  for (size_t i = 0; i < probes.size(); ++i) {
    ASSERT_EQ(Bits(span[i]), Bits(QuantizeValue(f.codec, probes[i])));
  }
}

INSTANTIATE_TEST_SUITE_P(Formats, Format16Test, ::testing::Values(kFp16, kBf16),
                         [](const ::testing::TestParamInfo<Format16>& info) {
                           return std::string(info.param.name);
                         });

TEST(QuantizeTest, Saturates) {
  EXPECT_EQ(QuantizeValue(ValueCodec::kFp16, 1e6f), 65504.0f);
  EXPECT_EQ(QuantizeValue(ValueCodec::kFp16, -1e6f), -65504.0f);
  EXPECT_EQ(QuantizeValue(ValueCodec::kFp16, 65520.0f), 65504.0f);
  EXPECT_EQ(QuantizeValue(ValueCodec::kFp16, FLT_MAX), 65504.0f);
  const float bf16_max = FromBits(0x7f7f0000u);
  EXPECT_EQ(bf16_max, std::ldexp(255.0f / 128, 127));
  EXPECT_EQ(QuantizeValue(ValueCodec::kBf16, FLT_MAX), bf16_max);
  EXPECT_EQ(QuantizeValue(ValueCodec::kBf16, -FLT_MAX), -bf16_max);
  EXPECT_EQ(QuantizeValue(ValueCodec::kFp32, FLT_MAX), FLT_MAX);
}

TEST(QuantizeTest, Fp16Denormals) {
  const float unit = std::ldexp(1.0f, -24);  // smallest fp16 subnormal
  EXPECT_EQ(QuantizeValue(ValueCodec::kFp16, unit), unit);
  EXPECT_EQ(QuantizeValue(ValueCodec::kFp16, 1.5f * unit), 2 * unit);  // tie
  EXPECT_EQ(QuantizeValue(ValueCodec::kFp16, 2.5f * unit), 2 * unit);  // tie
  EXPECT_EQ(QuantizeValue(ValueCodec::kFp16, 3.5f * unit), 4 * unit);  // tie
  EXPECT_EQ(QuantizeValue(ValueCodec::kFp16, 1023 * unit), 1023 * unit);
  EXPECT_EQ(QuantizeValue(ValueCodec::kFp16, 1023.5f * unit), 1024 * unit);
  EXPECT_EQ(QuantizeValue(ValueCodec::kFp16, -700.25f * unit), -700 * unit);
  EXPECT_EQ(QuantizeValue(ValueCodec::kFp16, 0.5f * unit), 0.0f);  // tie to 0
  EXPECT_EQ(QuantizeValue(ValueCodec::kFp16, std::nextafter(0.5f * unit, 1.0f)),
            unit);
  const float minus_tiny = QuantizeValue(ValueCodec::kFp16, -1e-10f);
  EXPECT_EQ(minus_tiny, 0.0f);
  EXPECT_TRUE(std::signbit(minus_tiny));
  // Float denormals: zero in fp16, kept by bf16 when representable.
  EXPECT_EQ(QuantizeValue(ValueCodec::kFp16, FLT_MIN / 4), 0.0f);
  EXPECT_EQ(QuantizeValue(ValueCodec::kBf16, FLT_MIN / 4), FLT_MIN / 4);
  EXPECT_EQ(QuantizeValue(ValueCodec::kBf16,
                          std::numeric_limits<float>::denorm_min()),
            0.0f);
  EXPECT_EQ(QuantizeValue(ValueCodec::kFp32,
                          std::numeric_limits<float>::denorm_min()),
            std::numeric_limits<float>::denorm_min());
}

TEST(QuantizeTest, NonFiniteInputsPassThrough) {
  for (ValueCodec c : kValueCodecs) {
    EXPECT_TRUE(std::isnan(QuantizeValue(c, NAN)));
    EXPECT_EQ(QuantizeValue(c, INFINITY), INFINITY);
    EXPECT_EQ(QuantizeValue(c, -INFINITY), -INFINITY);
  }
}

// ---------------------------------------------------------------------------
// Byte layout.

TEST(CodecLayoutTest, DeltaVarintFp32) {
  SparseVector v;
  v.indices = {1, 3, 300};
  v.values = {1.0f, -2.0f, 0.5f};
  std::string msg;
  GTOPK_ASSERT_OK(EncodeSparse(
      v, 1000, {IndexCodec::kDeltaVarint, ValueCodec::kFp32}, &msg));
  EXPECT_EQ(msg, Bytes({1,    1,    0,    3,        // header, count
                        0x01, 0x02, 0xa9, 0x02,     // 1, +2, +297
                        0x00, 0x00, 0x80, 0x3f,     // 1.0f
                        0x00, 0x00, 0x00, 0xc0,     // -2.0f
                        0x00, 0x00, 0x00, 0x3f}));  // 0.5f
}

TEST(CodecLayoutTest, DeltaBitpackBf16) {
  SparseVector v;
  v.indices = {5, 6, 8, 15};
  v.values = {1.0f, -2.0f, 0.5f, 3.0f};
  std::string msg;
  GTOPK_ASSERT_OK(EncodeSparse(
      v, 16, {IndexCodec::kDeltaBitpack, ValueCodec::kBf16}, &msg));
  // Gaps 1, 2, 7 at width 3, LSB-first: 1 | 2 << 3 | 7 << 6 = 0x1d1.
  EXPECT_EQ(msg, Bytes({1, 2, 2, 4, 5, 3, 0xd1, 0x01, 0x80, 0x3f, 0x00, 0xc0,
                        0x00, 0x3f, 0x40, 0x40}));
}

TEST(CodecLayoutTest, RawFp16) {
  SparseVector v;
  v.indices = {0, 7};
  v.values = {1.0f, -0.0f};
  std::string msg = "previous contents are replaced";
  const CodecSpec spec{IndexCodec::kRaw, ValueCodec::kFp16};
  GTOPK_ASSERT_OK(EncodeSparse(v, 8, spec, &msg));
  EXPECT_EQ(
      msg, Bytes({1, 0, 1, 2, 0, 0, 0, 0, 7, 0, 0, 0, 0x00, 0x3c, 0x00, 0x80}));
  EXPECT_EQ(msg.size(), MaxEncodedSize(2, spec));
}

TEST(CodecLayoutTest, Empty) {
  std::string msg;
  GTOPK_ASSERT_OK(EncodeSparse(SparseVector{}, 0, CodecSpec{}, &msg));
  EXPECT_EQ(msg, Bytes({1, 1, 0, 0}));
  SparseVector out = Junk();
  GTOPK_ASSERT_OK(DecodeSparse(msg, 0, &out));
  EXPECT_TRUE(out.empty());
}

// ---------------------------------------------------------------------------
// Round trips over every codec combination.

using Combo = std::tuple<IndexCodec, ValueCodec>;

class CodecComboTest : public ::testing::TestWithParam<Combo> {
 protected:
  CodecSpec spec() const {
    return {std::get<0>(GetParam()), std::get<1>(GetParam())};
  }

  void ExpectRoundTrip(const SparseVector& v, uint64_t n,
                       const std::string& what) {
    SCOPED_TRACE(what);
    std::string msg;
    GTOPK_ASSERT_OK(EncodeSparse(v, n, spec(), &msg));
    EXPECT_LE(msg.size(), MaxEncodedSize(v.size(), spec()));
    if (spec().index == IndexCodec::kRaw) {
      EXPECT_EQ(msg.size(), MaxEncodedSize(v.size(), spec()));
    }
    SparseVector out = Junk();
    GTOPK_ASSERT_OK(DecodeCopy(msg, msg.size(), n, &out));
    ASSERT_EQ(out.indices, v.indices);
    ASSERT_EQ(out.values.size(), v.values.size());
    for (size_t j = 0; j < v.size(); ++j) {
      const float want = QuantizeValue(spec().value, v.values[j]);
      ASSERT_EQ(Bits(out.values[j]), Bits(want)) << "position " << j;
      if (spec().value == ValueCodec::kFp32) {
        ASSERT_EQ(Bits(out.values[j]), Bits(v.values[j])) << "position " << j;
      }
    }
    GTOPK_EXPECT_OK(ValidateSparseVector(out, n));
    if (!v.empty()) {
      // The same bytes against a dense length that excludes the last index.
      EXPECT_THAT(
          DecodeCopy(msg, msg.size(), v.indices.back(), &out),
          StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("n = ")));
      EXPECT_TRUE(out.empty());
    }
  }

  // A valid message of a few blocks with small and large gaps.
  std::string SampleMessage(uint64_t* n) {
    std::mt19937_64 rng(7);
    SparseVector v;
    v.indices = RandomSubset(300, 1000000, rng);
    v.indices.push_back(3000000000u);
    v.values = RandomValues(v.indices.size(), rng);
    *n = kMaxDenseLength;
    std::string msg;
    EXPECT_THAT(EncodeSparse(v, *n, spec(), &msg), testing::IsOk());
    return msg;
  }
};

TEST_P(CodecComboTest, RoundTripsSeededInputs) {
  const std::vector<size_t> sizes = {0, 1, 2, 127, 128, 129, 1000, 100003};
  uint64_t seed = 1;
  for (size_t k : sizes) {
    std::mt19937_64 rng(seed++);
    const std::vector<float> values = RandomValues(k, rng);
    SparseVector v;
    v.values = values;

    // Uniform random subset of the whole uint32 range.
    v.indices = RandomSubset(k, kMaxDenseLength, rng);
    ExpectRoundTrip(v, kMaxDenseLength, absl::StrCat("uniform k=", k));

    // Density 0.001-ish in a smaller space.
    v.indices = RandomSubset(k, std::max<uint64_t>(1, 1000 * k), rng);
    ExpectRoundTrip(v, 1000 * k + 1, absl::StrCat("sparse k=", k));

    // Consecutive indices (every gap 1), n == last index + 1.
    const uint32_t start = static_cast<uint32_t>(rng() % 1000);
    for (size_t j = 0; j < k; ++j)
      v.indices[j] = start + static_cast<uint32_t>(j);
    ExpectRoundTrip(v, start + k, absl::StrCat("consecutive k=", k));

    // Both ends of the index space: 0 and 2^32-1 with huge gaps between.
    if (k >= 1) {
      for (size_t j = 0; j < k; ++j) {
        v.indices[j] =
            k == 1 ? kMaxIndex
                   : static_cast<uint32_t>(uint64_t{kMaxIndex} * j / (k - 1));
      }
      ExpectRoundTrip(v, kMaxDenseLength, absl::StrCat("extremes k=", k));
    }
  }
}

// Every bit width 1..32, in full blocks (fast path) and a partial block.
TEST_P(CodecComboTest, RoundTripsEveryBitWidth) {
  std::mt19937_64 rng(99);
  for (uint32_t w = 1; w <= 32; ++w) {
    const size_t k = 1 + 2 * 128 + 37;
    const uint64_t cap =
        std::min<uint64_t>((uint64_t{1} << w) - 1, kMaxDenseLength / (8 * k));
    std::uniform_int_distribution<uint64_t> gap(1, cap);
    // Every block holds one gap of exactly 2^(w-1) to force width w (only
    // the first block for w >= 31, or the indices would pass 2^32-1).
    auto forced = [&](size_t j) {
      return j % 128 == 7 && (w <= 30 || j < 128);
    };
    SparseVector v;
    v.values = RandomValues(k, rng);
    uint64_t index = rng() % 100;
    for (size_t j = 0; j < k; ++j) {
      const uint64_t g = forced(j) ? (uint64_t{1} << (w - 1)) : gap(rng);
      if (j > 0) index += g;
      v.indices.push_back(static_cast<uint32_t>(index));
    }
    ASSERT_LT(index, kMaxDenseLength);
    ExpectRoundTrip(v, kMaxDenseLength, absl::StrCat("width ", w));
  }
}

TEST_P(CodecComboTest, EveryTruncationIsRejected) {
  uint64_t n;
  const std::string msg = SampleMessage(&n);
  std::string empty;
  GTOPK_ASSERT_OK(EncodeSparse(SparseVector{}, n, spec(), &empty));
  const std::string* const messages[] = {&msg, &empty};
  for (const std::string* m : messages) {
    for (size_t len = 0; len < m->size(); ++len) {
      SparseVector out = Junk();
      ASSERT_THAT(DecodeCopy(*m, len, n, &out),
                  StatusIs(absl::StatusCode::kInvalidArgument,
                           HasSubstr("invalid sparse message")))
          << "prefix of " << len << " of " << m->size() << " bytes";
      ASSERT_TRUE(out.empty());
    }
  }
  SparseVector out;
  GTOPK_EXPECT_OK(DecodeCopy(msg, msg.size(), n, &out));
}

TEST_P(CodecComboTest, RandomCorruptionIsRejectedOrValid) {
  uint64_t n;
  const std::string msg = SampleMessage(&n);
  std::mt19937_64 rng(12345);
  std::uniform_int_distribution<size_t> where(0, msg.size() - 1);
  std::uniform_int_distribution<int> flips(1, 4);
  std::uniform_int_distribution<int> mask(1, 255);
  int rejected = 0;
  for (int trial = 0; trial < 3000; ++trial) {
    std::string bad = msg;
    for (int f = flips(rng); f > 0; --f) {
      // Mostly the header and index section, where structure lives.
      const size_t at = trial % 2 ? where(rng) : where(rng) % 64;
      bad[at] = static_cast<char>(bad[at] ^ mask(rng));
    }
    // Sometimes also cut or extend.
    if (trial % 7 == 0) bad.resize(where(rng));
    if (trial % 11 == 0) bad.push_back('\x01');
    SparseVector out = Junk();
    const absl::Status status = DecodeCopy(bad, bad.size(), n, &out);
    if (status.ok()) {
      GTOPK_ASSERT_OK(ValidateSparseVector(out, n)) << "trial " << trial;
    } else {
      ASSERT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
      ASSERT_TRUE(out.empty());
      ++rejected;
    }
  }
  EXPECT_GT(rejected, 100);
}

// Random payloads behind a valid header: exercises every decoder path
// (including full bit-packed blocks) on arbitrary bytes.
TEST_P(CodecComboTest, RandomPayloadsAreRejectedOrValid) {
  std::mt19937_64 rng(777);
  std::uniform_int_distribution<int> byte(0, 255);
  int ok = 0;
  for (int trial = 0; trial < 3000; ++trial) {
    const uint64_t count = rng() % 400;
    std::string m = Header(static_cast<int>(spec().index),
                           static_cast<int>(spec().value), count);
    const size_t payload = rng() % 2000;
    // Small bytes make plausible varints, gaps and bit widths.
    const int cap = trial % 3 == 0 ? 255 : trial % 3 == 1 ? 33 : 3;
    for (size_t i = 0; i < payload; ++i) {
      m.push_back(static_cast<char>(byte(rng) % (cap + 1)));
    }
    const uint64_t n = trial % 2 ? kMaxDenseLength : 1 + rng() % 100000;
    SparseVector out = Junk();
    const absl::Status status = DecodeCopy(m, m.size(), n, &out);
    if (status.ok()) {
      GTOPK_ASSERT_OK(ValidateSparseVector(out, n)) << "trial " << trial;
      ASSERT_EQ(out.size(), count);
      ++ok;
    } else {
      ASSERT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
      ASSERT_TRUE(out.empty());
    }
  }
  RecordProperty("accepted", ok);
}

INSTANTIATE_TEST_SUITE_P(AllCombos, CodecComboTest,
                         ::testing::Combine(::testing::ValuesIn(kIndexCodecs),
                                            ::testing::ValuesIn(kValueCodecs)),
                         [](const ::testing::TestParamInfo<Combo>& info) {
                           std::string name = absl::StrCat(
                               IndexCodecName(std::get<0>(info.param)), "_",
                               ValueCodecName(std::get<1>(info.param)));
                           std::replace(name.begin(), name.end(), '-', '_');
                           return name;
                         });

// ---------------------------------------------------------------------------
// Encoding errors.

TEST(EncodeSparseTest, RejectsInvalidInputAndLeavesOutputEmpty) {
  SparseVector v;
  v.indices = {1, 2};
  v.values = {1.0f, NAN};
  std::string msg = "junk";
  EXPECT_THAT(EncodeSparse(v, 10, CodecSpec{}, &msg),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("not finite at position 1")));
  EXPECT_TRUE(msg.empty());
  v.values = {1.0f, INFINITY};
  EXPECT_THAT(
      EncodeSparse(v, 10, {IndexCodec::kRaw, ValueCodec::kFp16}, &msg),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("not finite")));
  v.values = {1.0f, 2.0f};
  v.indices = {2, 1};
  EXPECT_THAT(EncodeSparse(v, 10, CodecSpec{}, &msg),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("not strictly ascending")));
  v.indices = {1, 10};
  EXPECT_THAT(EncodeSparse(v, 10, CodecSpec{}, &msg),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("out of range at position 1")));
  v.indices = {1, 2};
  EXPECT_THAT(
      EncodeSparse(v, kMaxDenseLength + 1, CodecSpec{}, &msg),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("exceeds 2^32")));
  EXPECT_THAT(EncodeSparse(v, 10, {static_cast<IndexCodec>(3)}, &msg),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("unknown index codec id 3")));
  EXPECT_THAT(
      EncodeSparse(v, 10, {IndexCodec::kRaw, static_cast<ValueCodec>(7)}, &msg),
      StatusIs(absl::StatusCode::kInvalidArgument,
               HasSubstr("unknown value codec id 7")));
  EXPECT_TRUE(msg.empty());
}

// ---------------------------------------------------------------------------
// Hand-made bad messages, one per fault.

struct BadMessage {
  const char* what;
  std::string bytes;
  uint64_t n;
  const char* message;  // expected substring
};

std::vector<BadMessage> BadMessages() {
  std::vector<BadMessage> cases;
  auto add = [&](const char* what, std::string bytes, uint64_t n,
                 const char* message) {
    cases.push_back({what, std::move(bytes), n, message});
  };
  const uint64_t big = kMaxDenseLength;

  add("empty", "", big, "truncated header: empty message");
  add("header cut", Bytes({1, 1}), big,
      "missing value codec id at byte "
      "offset 2");
  add("version", Bytes({2, 1, 0, 0}), big,
      "unknown format version 2 at byte offset 0");
  add("index codec", Bytes({1, 3, 0, 0}), big,
      "unknown index codec id 3 at byte offset 1");
  add("value codec", Bytes({1, 1, 9, 0}), big,
      "unknown value codec id 9 at byte offset 2");
  add("count cut", Bytes({1, 1, 0, 0x80}), big,
      "truncated varint (count) at byte offset 3");
  add("count > 5 bytes", Bytes({1, 1, 0, 0x80, 0x80, 0x80, 0x80, 0x80, 0x01}),
      big, "varint (count) at byte offset 3 is longer than 5 bytes");
  add("count overflow", Bytes({1, 1, 0, 0xff, 0xff, 0xff, 0xff, 0x1f}), big,
      "varint (count) at byte offset 3 overflows uint32");
  // 10 bytes claiming 2^31 entries.
  add("count too large", Header(1, 1, uint64_t{1} << 31) + Bytes({0, 0}), big,
      "count 2147483648 at byte offset 3 needs at least");
  {
    std::string m = Header(1, 0, 5);
    m += std::string(5 + 20, '\x01');
    add("count > n", m, 3,
        "count 5 at byte offset 3 exceeds the dense "
        "length n = 3");
  }
  {
    std::string m = Header(1, 0, 2) + Bytes({5, 0});
    Append32(0, &m);
    Append32(0, &m);
    add("varint gap 0", m, big,
        "gap 0 (duplicate index 5) at entry position 1 (byte offset 5)");
  }
  {
    std::string m = Header(1, 0, 2) + Bytes({7, 0xff, 0xff, 0xff, 0xff, 0x7f});
    Append32(0, &m);
    Append32(0, &m);
    add("varint gap overflows uint32", m, big,
        "varint (gap at entry position 1) at byte offset 5 overflows uint32");
  }
  {
    std::string m =
        Header(1, 0, 2) + Bytes({7, 0x80, 0x80, 0x80, 0x80, 0x80, 0x01});
    Append32(0, &m);
    Append32(0, &m);
    add("varint gap > 5 bytes", m, big,
        "varint (gap at entry position 1) at byte offset 5 is longer than 5");
  }
  {
    std::string m = Header(1, 0, 2) + Bytes({0xff, 0xff, 0xff, 0xff, 0x0f, 1});
    Append32(0, &m);
    Append32(0, &m);
    add("varint index past 2^32-1", m, big,
        "index overflows 2^32-1 at entry position 1 (byte offset 9)");
  }
  {
    std::string m = Header(1, 1, 2) + Bytes({3, 7});
    Append16(0, &m);
    Append16(0, &m);
    add("varint index >= n", m, 10,
        "index 10 >= n = 10 at entry position 1 (byte offset 5)");
    add("varint first index >= n", m, 3,
        "index 3 >= n = 3 at entry position 0 (byte offset 4)");
  }
  {
    std::string m = Header(0, 0, 2);
    Append32(5, &m);
    Append32(3, &m);
    Append32(0, &m);
    Append32(0, &m);
    add("raw decreasing", m, big,
        "raw indices not strictly ascending at entry position 1 (byte offset "
        "8): 3 after 5");
  }
  {
    std::string m = Header(0, 0, 2);
    Append32(5, &m);
    Append32(5, &m);
    Append32(0, &m);
    Append32(0, &m);
    add("raw duplicate", m, big, "5 after 5 (duplicate)");
    add("raw index >= n", m, 5,
        "index 5 >= n = 5 at entry position 0 (byte offset 4)");
  }
  {
    // Indices 2^28, 2^28 + 1, then 4 of the 8 value bytes.
    std::string m = Header(1, 0, 2) + Bytes({0x80, 0x80, 0x80, 0x80, 0x01, 1});
    Append32(0, &m);
    add("value section cut", m, big,
        "truncated fp32 value section at byte offset 10: needs 8 bytes but "
        "only 4 remain");
  }
  {
    std::string m = Header(2, 1, 3) + Bytes({0, 33, 0, 0, 0, 0, 0, 0, 0, 0});
    Append16(0, &m);
    add("bit width > 32", m, big,
        "bit width 33 of bit-packed block 0 at byte offset 5 is larger than "
        "32");
  }
  {
    std::string m = Header(2, 1, 3) + Bytes({0, 0});
    m += std::string(6, '\0');
    add("bit width 0", m, big, "bit width 0 of bit-packed block 0");
  }
  {
    // Gaps 1, 0 at width 2: 0b0001.
    std::string m = Header(2, 1, 3) + Bytes({0, 2, 0x01});
    m += std::string(6, '\0');
    add("bitpack gap 0", m, big,
        "gap 0 (duplicate index 1) at entry position 2 (byte offset 6)");
  }
  {
    // First 2^32-2, then gaps 1, 1 at width 1: 0b11.
    std::string m =
        Header(2, 1, 3) + Bytes({0xfe, 0xff, 0xff, 0xff, 0x0f, 1, 0x03});
    m += std::string(6, '\0');
    add("bitpack index past 2^32-1", m, big,
        "index overflows 2^32-1 at entry position 2 (byte offset 10)");
    add("bitpack index >= n", m, 0xfffffffe,
        "index 4294967294 >= n = 4294967294 at entry position 0");
  }
  {
    // One gap of 1 at width 1, but padding bit 1 set: 0b11.
    std::string m = Header(2, 1, 2) + Bytes({0, 1, 0x03});
    m += std::string(4, '\0');
    add("bitpack padding", m, big,
        "non-zero padding bits in bit-packed block 0 at byte offset 6");
  }
  {
    // Width 32 needs 8 bytes for 2 gaps; only 6 follow.
    std::string m = Header(2, 1, 3) + Bytes({0, 32});
    m += std::string(6, '\x01');
    add("bitpack data cut", m, big,
        "truncated bit-packed block 0 at byte offset 6: needs 8 bytes but only "
        "6 remain");
  }
  struct NonFinite {
    int codec;
    uint32_t bits;
    const char* message;
  };
  for (const NonFinite& nf :
       {NonFinite{1, 0x7c00,
                  "fp16 value at entry position 1 (byte offset 8) "
                  "decodes to Inf or NaN (bits 0x7c00)"},
        NonFinite{1, 0xfc00, "(bits 0xfc00)"},
        NonFinite{1, 0x7e01, "(bits 0x7e01)"},
        NonFinite{2, 0x7f80,
                  "bf16 value at entry position 1 (byte offset 8) "
                  "decodes to Inf or NaN (bits 0x7f80)"},
        NonFinite{2, 0xffc0, "(bits 0xffc0)"},
        NonFinite{0, 0x7fc00000,
                  "fp32 value at entry position 1 (byte offset "
                  "10) decodes to Inf or NaN (bits 0x7fc00000)"},
        NonFinite{0, 0xff800000, "(bits 0xff800000)"}}) {
    std::string m = Header(1, nf.codec, 2) + Bytes({0, 1});
    if (nf.codec == 0) {
      Append32(0, &m);
      Append32(nf.bits, &m);
    } else {
      Append16(0, &m);
      Append16(static_cast<uint16_t>(nf.bits), &m);
    }
    add("non-finite value", m, big, nf.message);
  }
  {
    std::string m = Header(1, 1, 1) + Bytes({3, 0, 0x3c, 0});
    add("trailing bytes", m, big,
        "1 trailing bytes at byte offset 7 after the value section");
  }
  add("n > 2^32", Bytes({1, 1, 0, 0}), kMaxDenseLength + 1,
      "n = 4294967297 exceeds 2^32");
  return cases;
}

TEST(DecodeSparseTest, NamesEachFaultAndWhere) {
  for (const BadMessage& c : BadMessages()) {
    SparseVector out = Junk();
    EXPECT_THAT(
        DecodeCopy(c.bytes, c.bytes.size(), c.n, &out),
        StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(c.message)))
        << c.what;
    EXPECT_TRUE(out.empty()) << c.what;
  }
}

TEST(DecodeSparseTest, InflatedCountIsRejectedBeforeAllocating) {
  const std::string m = Header(1, 1, uint64_t{1} << 31) + Bytes({0, 0});
  ASSERT_EQ(m.size(), 10u);
  SparseVector out;
  ASSERT_EQ(out.indices.capacity(), 0u);
  EXPECT_THAT(DecodeSparse(m, kMaxDenseLength, &out),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("count 2147483648")));
  EXPECT_EQ(out.indices.capacity(), 0u);
  EXPECT_EQ(out.values.capacity(), 0u);
}

// The benchmark's shape: n = 25,557,032 at density 0.001.
TEST(CodecSizeTest, BytesPerPairAtDensityOneInAThousand) {
  const uint64_t n = 25557032;
  const size_t k = 25557;
  std::mt19937_64 rng(2024);
  SparseVector v;
  v.indices = RandomSubset(k, n, rng);
  v.values = RandomValues(k, rng);
  auto bytes_per_pair = [&](IndexCodec index, ValueCodec value) {
    std::string msg;
    EXPECT_THAT(EncodeSparse(v, n, {index, value}, &msg), testing::IsOk());
    return static_cast<double>(msg.size()) / static_cast<double>(k);
  };
  const double varint =
      bytes_per_pair(IndexCodec::kDeltaVarint, ValueCodec::kBf16);
  const double bitpack =
      bytes_per_pair(IndexCodec::kDeltaBitpack, ValueCodec::kBf16);
  EXPECT_LE(varint, 4.0);
  EXPECT_LT(bitpack, varint);
  EXPECT_NEAR(bytes_per_pair(IndexCodec::kRaw, ValueCodec::kFp32), 8.0, 1e-3);
}

}  // namespace
}  // namespace gtopk

namespace gtopk {
namespace {

TEST(PeekCodecSpecTest, ReadsTheHeaderOnly) {
  SparseVector v;
  v.push_back(3, 1.5f);
  std::string bytes;
  ASSERT_TRUE(
      EncodeSparse(v, 10,
                   CodecSpec{IndexCodec::kDeltaBitpack, ValueCodec::kBf16},
                   &bytes)
          .ok());
  absl::StatusOr<CodecSpec> spec = PeekCodecSpec(bytes.substr(0, 3));
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->index, IndexCodec::kDeltaBitpack);
  EXPECT_EQ(spec->value, ValueCodec::kBf16);
  EXPECT_EQ(PeekCodecSpec("").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(PeekCodecSpec(std::string("\x01\x07\x00", 3)).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(PeekCodecSpec(std::string("\x02\x00\x00", 3)).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(PeekCodecSpec(std::string("\x01\x00\x09", 3)).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace gtopk
