#include "common/topk.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <functional>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "common/selector.h"
#include "common/status_macros.h"

namespace gtopk {
namespace cpu {
namespace {

// Block sample used to estimate the threshold: kSampleRuns runs of kRunLength
// consecutive values (one cache line each), evenly spaced over the input.
constexpr size_t kRunLength = 16;
constexpr size_t kSampleRuns = 1024;
constexpr size_t kSampleSize = kRunLength * kSampleRuns;
// Below this length the radix select is as cheap as sampling.
constexpr size_t kMinSampledLength = 4 * kSampleSize;
// Below this length an nth_element over every key is cheaper than the
// radix select, whose three histograms (2048, 2048 and 512 buckets) cost
// about 3 us a call whatever the length: layer-wise selection
// (common/buckets.h) selects once per bucket piece, and a model cut into
// many small pieces paid that per piece (docs/overlap.md, "How many
// pieces").
constexpr size_t kMaxSmallLength = 256;

// Fills `keys` with the magnitude keys of the evenly spaced block sample.
void SampleKeys(absl::Span<const float> u, std::vector<uint32_t>* keys) {
  keys->resize(kSampleSize);
  const uint64_t span = u.size() - kRunLength;
  uint32_t* dst = keys->data();
  for (size_t r = 0; r < kSampleRuns; ++r) {
    const size_t start = static_cast<size_t>(span * r / (kSampleRuns - 1));
    for (size_t j = 0; j < kRunLength; ++j) {
      *dst++ = MagnitudeKey(u[start + j]);
    }
  }
}

// Finds the bucket holding the `rank`-th largest (1-based) of a histogram
// whose buckets are ordered by increasing key. Returns the bucket and adds to
// *greater the number of entries in buckets above it.
template <size_t N>
size_t FindBucket(const std::array<uint64_t, N>& hist, uint64_t rank,
                  uint64_t* greater) {
  uint64_t above = 0;
  for (size_t b = N; b-- > 0;) {
    if (above + hist[b] >= rank) {
      *greater += above;
      return b;
    }
    above += hist[b];
  }
  return 0;  // unreachable when rank <= total
}

}  // namespace

bool AnyNonFinite(absl::Span<const float> values) {
  for (float v : values) {
    if (MagnitudeKey(v) >= kNonFiniteKey) return true;
  }
  return false;
}

bool CollectAtLeast(absl::Span<const float> u, uint32_t min_key, size_t cap,
                    Candidates* out) {
  const size_t n = u.size();
  const float* p = u.data();
  out->size = 0;
  if (min_key > 0x7fffffffu) return true;  // no key can reach it
  constexpr size_t kBlock = 64;
  // Room for a whole block past the cap: the branch-free loop writes first
  // and counts after.
  const size_t room = std::min(cap, n) + kBlock;
  out->positions.Reserve(room);
  out->values.Reserve(room);
  uint32_t* pos = out->positions.data();
  float* val = out->values.data();
  // Keys fit in 31 bits, so a signed compare is exact.
  const int32_t threshold = static_cast<int32_t>(min_key);
  size_t count = 0;
  size_t i = 0;
#if defined(__SSE2__)
  // A 64-bit survivor mask per block from 16 four-wide compares, then one
  // visit per set bit: cost ~ reading the block plus a few cycles a survivor.
  const __m128i abs_mask = _mm_set1_epi32(0x7fffffff);
  const __m128i below =
      _mm_set1_epi32(threshold - 1);  // key >= t <=> key > t-1
  for (; i + kBlock <= n; i += kBlock) {
    uint64_t mask = 0;
    for (size_t j = 0; j < kBlock; j += 4) {
      __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + i + j));
      v = _mm_cmpgt_epi32(_mm_and_si128(v, abs_mask), below);
      mask |= static_cast<uint64_t>(_mm_movemask_ps(_mm_castsi128_ps(v))) << j;
    }
    while (mask != 0) {
      const size_t j = static_cast<size_t>(__builtin_ctzll(mask));
      mask &= mask - 1;
      pos[count] = static_cast<uint32_t>(i + j);
      val[count] = p[i + j];
      ++count;
    }
    if (count > cap) {
      out->size = count;
      return false;
    }
  }
#else
  for (; i + kBlock <= n; i += kBlock) {
    int any = 0;
    for (size_t j = 0; j < kBlock; ++j) {
      any |= static_cast<int32_t>(MagnitudeKey(p[i + j])) >= threshold;
    }
    if (any) {
      // Branch-free: write every slot, advance only past survivors.
      for (size_t j = 0; j < kBlock; ++j) {
        const float x = p[i + j];
        pos[count] = static_cast<uint32_t>(i + j);
        val[count] = x;
        count += static_cast<int32_t>(MagnitudeKey(x)) >= threshold;
      }
      if (count > cap) {
        out->size = count;
        return false;
      }
    }
  }
#endif
  for (; i < n; ++i) {
    const float x = p[i];
    pos[count] = static_cast<uint32_t>(i);
    val[count] = x;
    count += static_cast<int32_t>(MagnitudeKey(x)) >= threshold;
  }
  out->size = count;
  return count <= cap;
}

void FinishTopKFromCandidates(const Candidates& candidates, uint64_t k,
                              std::vector<uint32_t>* keys_buffer,
                              SparseVector* out) {
  std::vector<uint32_t>& keys = *keys_buffer;
  const size_t c = candidates.size;
  const float* values = candidates.values.data();
  const uint32_t* positions = candidates.positions.data();
  keys.resize(c);
  for (size_t j = 0; j < c; ++j) keys[j] = MagnitudeKey(values[j]);
  std::nth_element(keys.begin(), keys.begin() + (k - 1), keys.end(),
                   std::greater<uint32_t>());
  const uint32_t kth_key = keys[k - 1];
  uint64_t greater = 0;
  for (size_t j = 0; j < k; ++j) greater += keys[j] > kth_key;
  uint64_t equal_left = k - greater;
  out->indices.resize(k);
  out->values.resize(k);
  uint32_t* out_idx = out->indices.data();
  float* out_val = out->values.data();
  size_t w = 0;
  for (size_t j = 0; j < c && w < k; ++j) {
    const uint32_t key = MagnitudeKey(values[j]);
    if (key > kth_key || (key == kth_key && equal_left > 0)) {
      if (key == kth_key) --equal_left;
      out_idx[w] = positions[j];
      out_val[w] = values[j];
      ++w;
    }
  }
}

bool RadixSelectKey(absl::Span<const float> u, uint64_t k, uint32_t* kth_key,
                    uint64_t* count_greater) {
  const size_t n = u.size();
  const float* p = u.data();
  uint64_t greater = 0;

  // Level 1: bits 30..20 (sign excluded): exponent and 3 mantissa bits.
  std::array<uint64_t, 2048> h1{};
  {
    // Two interleaved sub-histograms halve store-forwarding stalls on runs of
    // equal buckets.
    std::array<uint32_t, 2048> a{}, b{};
    size_t i = 0;
    // Flush before 32-bit counters could overflow.
    while (i < n) {
      const size_t end = std::min(n, i + (size_t{1} << 31));
      for (; i + 1 < end; i += 2) {
        ++a[MagnitudeKey(p[i]) >> 20];
        ++b[MagnitudeKey(p[i + 1]) >> 20];
      }
      if (i < end) ++a[MagnitudeKey(p[i++]) >> 20];
      for (size_t j = 0; j < 2048; ++j) {
        h1[j] += uint64_t{a[j]} + b[j];
        a[j] = b[j] = 0;
      }
    }
  }
  for (size_t bucket = kNonFiniteKey >> 20; bucket < 2048; ++bucket) {
    if (h1[bucket] != 0) return false;
  }
  const uint32_t b1 = static_cast<uint32_t>(FindBucket(h1, k, &greater));

  // Level 2: bits 19..9 among keys whose bits 30..20 equal b1.
  std::array<uint64_t, 2048> h2{};
  for (size_t i = 0; i < n; ++i) {
    const uint32_t key = MagnitudeKey(p[i]);
    if ((key >> 20) == b1) ++h2[(key >> 9) & 0x7ff];
  }
  const uint32_t b2 =
      static_cast<uint32_t>(FindBucket(h2, k - greater, &greater));
  const uint32_t prefix = (b1 << 11) | b2;

  // Level 3: bits 8..0 among keys whose bits 30..9 equal the prefix.
  std::array<uint64_t, 512> h3{};
  for (size_t i = 0; i < n; ++i) {
    const uint32_t key = MagnitudeKey(p[i]);
    if ((key >> 9) == prefix) ++h3[key & 0x1ff];
  }
  const uint32_t b3 =
      static_cast<uint32_t>(FindBucket(h3, k - greater, &greater));
  *kth_key = (prefix << 9) | b3;
  *count_greater = greater;
  return true;
}

void CompactTopK(absl::Span<const float> u, uint32_t kth_key,
                 uint64_t count_greater, uint64_t k, SparseVector* out) {
  out->clear();
  out->reserve(k);
  uint64_t equal_left = k - count_greater;
  const float* p = u.data();
  const size_t n = u.size();
  const int32_t threshold = static_cast<int32_t>(kth_key);
  constexpr size_t kBlock = 64;
  auto visit = [&](size_t i) {
    const uint32_t key = MagnitudeKey(p[i]);
    if (key > kth_key || (key == kth_key && equal_left > 0)) {
      if (key == kth_key) --equal_left;
      out->push_back(static_cast<uint32_t>(i), p[i]);
    }
  };
  size_t i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    int any = 0;
    for (size_t j = 0; j < kBlock; ++j) {
      any |= static_cast<int32_t>(MagnitudeKey(p[i + j])) >= threshold;
    }
    if (any) {
      for (size_t j = 0; j < kBlock; ++j) visit(i + j);
    }
  }
  for (; i < n; ++i) visit(i);
}

absl::Status ExactTopK(absl::Span<const float> u, uint64_t k,
                       TopKScratch* scratch, SparseVector* out) {
  out->clear();
  GTOPK_RETURN_IF_ERROR(ValidateSelectArgs(u.size(), k));
  const size_t n = u.size();
  if (k == n) {
    GTOPK_RETURN_IF_ERROR(ValidateFinite(u, "selector input"));
    out->indices.resize(n);
    for (size_t i = 0; i < n; ++i) out->indices[i] = static_cast<uint32_t>(i);
    out->values.assign(u.begin(), u.end());
    return absl::OkStatus();
  }

  if (n >= kMinSampledLength) {
    // Sample rank aiming at ~1.1x k survivors plus 4 standard deviations of
    // the sample count, so that fewer than k survive only rarely.
    const double expected = static_cast<double>(kSampleSize) *
                            static_cast<double>(k) / static_cast<double>(n);
    const double rank =
        std::ceil(1.1 * expected + 4.0 * std::sqrt(expected) + 8.0);
    if (rank < kSampleSize / 4.0) {
      std::vector<uint32_t>& sample = scratch->keys;
      SampleKeys(u, &sample);
      const size_t r = static_cast<size_t>(rank);
      std::nth_element(sample.begin(), sample.begin() + (r - 1), sample.end(),
                       std::greater<uint32_t>());
      const uint32_t threshold = sample[r - 1];
      // Survivors expected: rank * n / kSampleSize; allow 4x that.
      const size_t cap =
          static_cast<size_t>(4.0 * rank * n / kSampleSize) + 1024;
      Candidates& candidates = scratch->candidates;
      const bool complete = CollectAtLeast(u, threshold, cap, &candidates);
      // The largest key always survives, so a non-finite value shows here.
      if (AnyNonFinite(candidates.value_span())) {
        return ValidateFinite(u, "selector input");
      }
      if (complete && candidates.size >= k) {
        FinishTopKFromCandidates(candidates, k, &scratch->keys, out);
        return absl::OkStatus();
      }
      // Too few or too many survivors: take the exact path below.
    }
  }

  uint32_t kth_key = 0;
  uint64_t greater = 0;
  if (n <= kMaxSmallLength) {
    if (AnyNonFinite(u)) return ValidateFinite(u, "selector input");
    std::vector<uint32_t>& keys = scratch->keys;
    keys.resize(n);
    for (size_t i = 0; i < n; ++i) keys[i] = MagnitudeKey(u[i]);
    std::nth_element(keys.begin(), keys.begin() + (k - 1), keys.end(),
                     std::greater<uint32_t>());
    kth_key = keys[k - 1];
    for (size_t j = 0; j < k; ++j) greater += keys[j] > kth_key;
    CompactTopK(u, kth_key, greater, k, out);
    return absl::OkStatus();
  }
  if (!RadixSelectKey(u, k, &kth_key, &greater)) {
    return ValidateFinite(u, "selector input");
  }
  CompactTopK(u, kth_key, greater, k, out);
  return absl::OkStatus();
}

}  // namespace cpu
}  // namespace gtopk
