#include "common/merge.h"

#include <algorithm>
#include <array>
#include <cstring>
#include <utility>

#include "absl/base/casts.h"
#include "absl/strings/str_cat.h"

namespace gtopk {
namespace {

// A pair packed as (index << 32 | value bits): one 8-byte move per pair per
// radix pass, and the index is the high word.
inline uint64_t Pack(uint32_t index, float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  return (uint64_t{index} << 32) | bits;
}
inline uint32_t PackedIndex(uint64_t packed) {
  return static_cast<uint32_t>(packed >> 32);
}
inline float PackedValue(uint64_t packed) {
  const uint32_t bits = static_cast<uint32_t>(packed);
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
}
inline uint32_t NonFinite(float value) {
  return cpu::MagnitudeKey(value) >= cpu::kNonFiniteKey;
}

// Number of significant bits: 0 for 0, 32 for 0xffffffff.
inline int BitWidth(uint64_t x) {
  int bits = 0;
  while (bits < 64 && (x >> bits) != 0) ++bits;
  return bits;
}

absl::Status ValidateInputs(absl::Span<const SparseVector> inputs, uint64_t n) {
  if (n > kMaxDenseLength) {
    return absl::InvalidArgumentError(
        absl::StrCat("dense length n = ", n, " exceeds 2^32"));
  }
  for (size_t p = 0; p < inputs.size(); ++p) {
    absl::Status status = ValidateSparseVector(inputs[p], n);
    if (!status.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("input ", p, ": ", status.message()));
    }
  }
  return absl::OkStatus();
}

// Called when a combined value may be non-finite: finds the first one in
// `result` and names its index. All inputs are finite, so a non-finite sum
// can only be an overflow to +-Inf (Inf + finite stays Inf, never NaN).
absl::Status FindOverflow(const SparseVector& result) {
  for (size_t j = 0; j < result.size(); ++j) {
    if (NonFinite(result.values[j])) {
      return absl::InvalidArgumentError(
          absl::StrCat("sparse sum overflows to ", result.values[j],
                       " at index ", result.indices[j]));
    }
  }
  return absl::OkStatus();
}

// Linear merge of two non-empty inputs, rank(a) < rank(b): a shared index
// gets a + b. Branch-free (selects instead of an unpredictable branch per
// pair). Returns true when some sum may be non-finite.
bool MergeTwo(const SparseVector& a, const SparseVector& b,
              SparseVector* result) {
  const size_t na = a.size();
  const size_t nb = b.size();
  result->indices.resize(na + nb);
  result->values.resize(na + nb);
  const uint32_t* ai = a.indices.data();
  const uint32_t* bi = b.indices.data();
  const float* av = a.values.data();
  const float* bv = b.values.data();
  uint32_t* oi = result->indices.data();
  float* ov = result->values.data();
  uint32_t bad = 0;
  size_t i = 0, j = 0, m = 0;
  while (i < na && j < nb) {
    const uint32_t x = ai[i];
    const uint32_t y = bi[j];
    const uint32_t take_a = x <= y;
    const uint32_t take_b = y <= x;
    const float sum = av[i] + bv[j];  // used only when x == y
    const uint32_t both = take_a & take_b;
    const uint32_t value_bits =
        both ? absl::bit_cast<uint32_t>(sum)
             : (take_a ? absl::bit_cast<uint32_t>(av[i])
                       : absl::bit_cast<uint32_t>(bv[j]));
    bad |= both & NonFinite(sum);
    oi[m] = take_a ? x : y;
    ov[m] = absl::bit_cast<float>(value_bits);
    i += take_a;
    j += take_b;
    ++m;
  }
  const size_t tail_a = na - i;
  std::memcpy(oi + m, ai + i, tail_a * sizeof(uint32_t));
  std::memcpy(ov + m, av + i, tail_a * sizeof(float));
  m += tail_a;
  const size_t tail_b = nb - j;
  std::memcpy(oi + m, bi + j, tail_b * sizeof(uint32_t));
  std::memcpy(ov + m, bv + j, tail_b * sizeof(float));
  m += tail_b;
  result->indices.resize(m);
  result->values.resize(m);
  return bad != 0;
}

// Sums runs of equal indices of `sorted` (ascending by index, rank order
// within an index) into oi/ov, starting from the first value of each run.
// Returns how many entries were written; sets *bad when some sum may be
// non-finite.
size_t CombineRuns(const uint64_t* sorted, size_t len, uint32_t* oi, float* ov,
                   uint32_t* bad) {
  size_t m = 0;
  size_t j = 0;
  uint32_t nonfinite = 0;
  while (j < len) {
    const uint32_t index = PackedIndex(sorted[j]);
    float sum = PackedValue(sorted[j]);
    ++j;
    while (j < len && PackedIndex(sorted[j]) == index) {
      sum += PackedValue(sorted[j]);
      ++j;
    }
    nonfinite |= NonFinite(sum);
    oi[m] = index;
    ov[m] = sum;
    ++m;
  }
  *bad |= nonfinite;
  return m;
}

// Stable insertion sort of packed pairs by index, for tiny buckets.
void InsertionSortByIndex(uint64_t* a, size_t len) {
  for (size_t i = 1; i < len; ++i) {
    const uint64_t x = a[i];
    const uint32_t key = PackedIndex(x);
    size_t j = i;
    while (j > 0 && PackedIndex(a[j - 1]) > key) {
      a[j] = a[j - 1];
      --j;
    }
    a[j] = x;
  }
}

// Stable LSD radix sort of one cache-resident bucket by the low `low` bits
// of the index (low <= 32: at most 4 passes of <= 9 bits, so the counters
// stay small next to a bucket of ~1 Ki pairs). `tmp` has room for len pairs.
// Returns where the sorted pairs are (a or tmp).
//
// Each pass scatters the two halves of the bucket with separate cursors
// (the first half's cursor for a digit starts where the whole bucket's does,
// the second half's after the first half's count), which keeps the pass
// stable and gives the CPU two independent read-increment-write chains
// instead of one: on random digits that halves the time of a pass.
constexpr int kLocalDigitBits = 9;

const uint64_t* SortBucket(uint64_t* a, uint64_t* tmp, size_t len, int low) {
  const int passes = (low + kLocalDigitBits - 1) / kLocalDigitBits;
  const int width = (low + passes - 1) / passes;
  const uint32_t mask = (uint32_t{1} << width) - 1;
  const size_t digits = size_t{1} << width;
  const size_t half = len / 2;
  std::array<size_t, size_t{1} << kLocalDigitBits> first;
  std::array<size_t, size_t{1} << kLocalDigitBits> second;
  uint64_t* src = a;
  uint64_t* dst = tmp;
  for (int d = 0; d < passes; ++d) {
    const int shift = 32 + d * width;
    std::fill(first.begin(), first.begin() + digits, 0);
    std::fill(second.begin(), second.begin() + digits, 0);
    for (size_t j = 0; j < half; ++j) ++first[(src[j] >> shift) & mask];
    for (size_t j = half; j < len; ++j) ++second[(src[j] >> shift) & mask];
    size_t running = 0;
    for (size_t b = 0; b < digits; ++b) {
      const size_t in_first = first[b];
      const size_t in_second = second[b];
      first[b] = running;
      second[b] = running + in_first;
      running += in_first + in_second;
    }
    for (size_t i = 0; i < half; ++i) {
      const uint64_t x = src[i];
      const uint64_t y = src[half + i];
      dst[first[(x >> shift) & mask]++] = x;
      dst[second[(y >> shift) & mask]++] = y;
    }
    if (len % 2 != 0) {
      const uint64_t y = src[len - 1];
      dst[second[(y >> shift) & mask]++] = y;
    }
    std::swap(src, dst);
  }
  return src;
}

// SparseSum's path for three or more non-empty inputs. The index space up
// to the largest index present is cut into 2^top buckets by the top bits of
// the index, with top chosen so that a bucket holds about
// max(2^kBucketPairsLog2, P) pairs on average (so the bucket loop, P run
// checks per bucket, is O(total), never O(n)). Inputs are sorted, so an input's
// pairs in one bucket are one contiguous run; bucket by bucket, the P runs
// are gathered in rank order into a small buffer, sorted there by the low
// bits of the index (stable LSD radix, so the values of an index stay in
// rank order) and combined straight into the result. The inputs are read
// once and the result written once; everything else stays in L1/L2, where a
// radix sort of the whole concatenation would scatter it through L3 on every
// pass. Returns true when some sum may be non-finite.
constexpr int kBucketPairsLog2 = 10;
constexpr size_t kInsertionSortMax = 32;

bool SumByBuckets(absl::Span<const SparseVector> inputs, size_t total,
                  uint32_t max_index, MergeScratch* scratch,
                  SparseVector* result) {
  const int bits = BitWidth(max_index);
  // Also at most ~2 * total / P buckets, so that the P run checks per
  // bucket stay O(total) for any number of inputs.
  const size_t pairs_per_bucket =
      std::max<size_t>(size_t{1} << kBucketPairsLog2, inputs.size());
  const int top = std::min(bits, BitWidth(total / pairs_per_bucket));
  const int low = bits - top;  // 0..32
  uint32_t first_index = max_index;
  for (const SparseVector& in : inputs) {
    if (!in.empty()) first_index = std::min(first_index, in.indices[0]);
  }

  std::vector<size_t>& cursor = scratch->cursor;
  std::vector<size_t>& run_end = scratch->run_end;
  cursor.assign(inputs.size(), 0);
  run_end.assign(inputs.size(), 0);
  result->indices.resize(total);
  result->values.resize(total);
  uint32_t* oi = result->indices.data();
  float* ov = result->values.data();
  uint32_t bad = 0;
  size_t m = 0;
  const uint64_t last_bucket = uint64_t{max_index} >> low;
  for (uint64_t b = uint64_t{first_index} >> low; b <= last_bucket; ++b) {
    size_t len = 0;
    for (size_t p = 0; p < inputs.size(); ++p) {
      const uint32_t* idx = inputs[p].indices.data();
      const size_t size = inputs[p].size();
      size_t e = cursor[p];
      while (e < size && (uint64_t{idx[e]} >> low) == b) ++e;
      run_end[p] = e;
      len += e - cursor[p];
    }
    if (len == 0) continue;
    if (scratch->keys.size() < len) {
      scratch->keys.resize(len);
      scratch->keys_alt.resize(len);
    }
    uint64_t* buf = scratch->keys.data();
    size_t o = 0;
    for (size_t p = 0; p < inputs.size(); ++p) {
      const uint32_t* idx = inputs[p].indices.data();
      const float* val = inputs[p].values.data();
      for (size_t j = cursor[p], e = run_end[p]; j < e; ++j) {
        buf[o++] = Pack(idx[j], val[j]);
      }
      cursor[p] = run_end[p];
    }
    const uint64_t* sorted = buf;
    if (low > 0 && len > 1) {
      if (len <= kInsertionSortMax) {
        InsertionSortByIndex(buf, len);
      } else {
        sorted = SortBucket(buf, scratch->keys_alt.data(), len, low);
      }
    }
    m += CombineRuns(sorted, len, oi + m, ov + m, &bad);
  }
  result->indices.resize(m);
  result->values.resize(m);
  return bad != 0;
}

}  // namespace

absl::Status SparseSum(absl::Span<const SparseVector> inputs, uint64_t n,
                       SparseVector* out, MergeScratch* scratch) {
  if (absl::Status status = ValidateInputs(inputs, n); !status.ok()) {
    out->clear();
    return status;
  }

  size_t total = 0;
  size_t non_empty = 0;
  const SparseVector* first = nullptr;
  const SparseVector* second = nullptr;
  uint32_t max_index = 0;
  for (const SparseVector& in : inputs) {
    if (in.empty()) continue;
    total += in.size();
    max_index = std::max(max_index, in.indices.back());
    if (non_empty == 0) first = &in;
    if (non_empty == 1) second = &in;
    ++non_empty;
  }
  if (non_empty == 0) {
    out->clear();
    return absl::OkStatus();
  }
  if (non_empty == 1) {
    // A lone value is its own sum, bits included.
    if (first != out) *out = *first;
    return absl::OkStatus();
  }

  MergeScratch local;
  if (scratch == nullptr) scratch = &local;
  SparseVector* result = &scratch->result;
  bool maybe_overflow;
  if (non_empty == 2) {
    maybe_overflow = MergeTwo(*first, *second, result);
  } else {
    maybe_overflow = SumByBuckets(inputs, total, max_index, scratch, result);
  }
  if (maybe_overflow) {
    absl::Status status = FindOverflow(*result);
    if (!status.ok()) {
      out->clear();
      return status;
    }
  }
  // Inputs are no longer read, so `out` may have been one of them.
  std::swap(*out, *result);
  return absl::OkStatus();
}

absl::Status SparseTopK(const SparseVector& v, uint64_t k, SparseVector* out,
                        cpu::TopKScratch* scratch) {
  if (k == 0) {
    out->clear();
    return absl::InvalidArgumentError("SparseTopK: k must be >= 1");
  }
  if (absl::Status status = ValidateSparseVector(v, kMaxDenseLength);
      !status.ok()) {
    out->clear();
    return status;
  }
  if (k >= v.size()) {
    if (out != &v) *out = v;
    return absl::OkStatus();
  }
  cpu::TopKScratch local_scratch;
  if (scratch == nullptr) scratch = &local_scratch;
  SparseVector aliased;
  SparseVector* selected = (out == &v) ? &aliased : out;
  if (absl::Status status = cpu::ExactTopK(v.values, k, scratch, selected);
      !status.ok()) {
    out->clear();
    return status;
  }
  // Positions into v.values -> indices; ascending positions map to
  // ascending indices because v is sorted.
  for (uint32_t& position : selected->indices) position = v.indices[position];
  if (selected != out) std::swap(*out, *selected);
  return absl::OkStatus();
}

absl::Status ReferenceGtopkStep(absl::Span<const SparseVector> pushes,
                                uint64_t n, uint64_t k, SparseVector* global) {
  if (k == 0) {
    global->clear();
    return absl::InvalidArgumentError("ReferenceGtopkStep: k must be >= 1");
  }
  SparseVector sum;
  if (absl::Status status = SparseSum(pushes, n, &sum); !status.ok()) {
    global->clear();
    return status;
  }
  return SparseTopK(sum, k, global);
}

}  // namespace gtopk
