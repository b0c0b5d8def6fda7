// The device check's inputs and the host work around them (issue 15): six
// seeded input kinds, generated in parallel chunks, and the parallel loops the
// reference and the checks use, so that a 138M-entry check costs a few
// seconds of host time rather than twenty (the H200 run of 2026-11-30 spent
// 17.5 s of host time per input at n = 138,357,544).
//
// Header-only and free of Abseil, so that deploy/device/device_check.sh builds
// it with nvcc alone; included by device_check.cu only.
#ifndef GTOPK_BENCH_CUDA_DEVICE_CHECK_INPUTS_H_
#define GTOPK_BENCH_CUDA_DEVICE_CHECK_INPUTS_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <vector>

namespace gtopk {
namespace device_check {

// Entries per chunk: a chunk is the unit of parallel work and of seeding.
constexpr uint64_t kChunk = uint64_t{1} << 20;

// Runs body(chunk_index, begin, end) for every kChunk-sized chunk of
// [0, n), on up to 16 threads. Each chunk's work depends only on its index,
// so results are the same whatever the thread count.
inline void ForChunks(
    uint64_t n, const std::function<void(uint64_t, uint64_t, uint64_t)>& body) {
  const uint64_t chunks = (n + kChunk - 1) / kChunk;
  const unsigned threads = static_cast<unsigned>(std::min<uint64_t>(
      chunks,
      std::max(1u, std::min(16u, std::thread::hardware_concurrency()))));
  if (threads <= 1) {
    for (uint64_t c = 0; c < chunks; ++c) {
      body(c, c * kChunk, std::min(n, (c + 1) * kChunk));
    }
    return;
  }
  std::vector<std::thread> pool;
  for (unsigned t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      for (uint64_t c = t; c < chunks; c += threads) {
        body(c, c * kChunk, std::min(n, (c + 1) * kChunk));
      }
    });
  }
  for (auto& th : pool) th.join();
}

// SplitMix64 seeded per (seed, chunk): the stream of one chunk.
class ChunkRandom {
 public:
  ChunkRandom(uint64_t seed, uint64_t chunk)
      : s_(seed * 0x9e3779b97f4a7c15ull + chunk + 1) {}
  uint64_t Next() {
    uint64_t z = (s_ += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  // Uniform in [0, 1) with 24 random bits: exactly representable as a
  // float, as the reference's std::uniform_real_distribution<float> is.
  float UnitFloat() { return static_cast<float>(Next() >> 40) * 0x1p-24f; }
  float Sign() { return (Next() >> 63) ? -1.0f : 1.0f; }

 private:
  uint64_t s_;
};

// The input kinds, named as in tests/testing/reference.h (Distribution) and
// with the same definitions; --inputs takes these names.
inline const std::vector<std::string>& InputNames() {
  static const std::vector<std::string> names = {"normal",    "narrow_band",
                                                 "ties",      "laplace_zeros",
                                                 "all_equal", "outliers"};
  return names;
}

inline bool IsInputName(const std::string& name) {
  const auto& all = InputNames();
  return std::find(all.begin(), all.end(), name) != all.end();
}

// One line per kind, for the JSON and --help.
inline std::string InputDefinition(const std::string& name) {
  if (name == "normal") return "normal(0, 1) fp32";
  if (name == "narrow_band") {
    return "|u| uniform in [1.0, 1.0005), random signs";
  }
  if (name == "ties") {
    return "+-1.0 (random sign), every entry with i % 1000 == 999 is 2.0";
  }
  if (name == "laplace_zeros") {
    return "30% exact zeros (a third of them -0.0), else Laplace(0, 1)";
  }
  if (name == "all_equal") return "every value 0.5 with a random sign";
  if (name == "outliers") {
    return "the normal input with every entry i % 65537 == 12345 set to "
           "1e30 * (1 + U[0, 1))";
  }
  return "unknown";
}

// Seeded normal floats by Box-Muller, in parallel chunks (deterministic for
// a seed whatever the thread count).
inline std::vector<float> NormalInput(uint64_t n, uint64_t seed) {
  std::vector<float> x(n);
  ForChunks(n, [&](uint64_t c, uint64_t begin, uint64_t end) {
    ChunkRandom rng(seed, c);
    for (uint64_t i = begin; i < end; i += 2) {
      const double u1 = ((rng.Next() >> 11) + 1.0) * (1.0 / 9007199254740993.0);
      const double u2 = (rng.Next() >> 11) * (1.0 / 9007199254740992.0);
      const double r = std::sqrt(-2.0 * std::log(u1));
      x[i] = static_cast<float>(r * std::cos(6.283185307179586 * u2));
      if (i + 1 < end) {
        x[i + 1] = static_cast<float>(r * std::sin(6.283185307179586 * u2));
      }
    }
  });
  return x;
}

// The input `name` of length n (InputNames(); IsInputName(name) must hold).
// `normal` is the checker's historical input (same values for a seed as
// before issue 15); `outliers` is the same normal body; the others draw
// from their own per-chunk streams.
inline std::vector<float> MakeCheckInput(const std::string& name, uint64_t n,
                                         uint64_t seed) {
  if (name == "normal") return NormalInput(n, seed);
  if (name == "outliers") {
    std::vector<float> x = NormalInput(n, seed);
    // 1e30 * (1 + U): U from a per-index stream, so the same whatever the
    // chunking.
    for (uint64_t i = 12345; i < n; i += 65537) {
      ChunkRandom rng(seed ^ 0x6f75746c69657273ull, i);
      x[i] = 1e30f * (1.0f + rng.UnitFloat());
    }
    return x;
  }
  // Each kind its own stream: the seed mixed with the kind's position in
  // InputNames() (fixed, unlike std::hash).
  const auto& names = InputNames();
  const int kind = static_cast<int>(
      std::find(names.begin(), names.end(), name) - names.begin());
  const uint64_t stream = seed ^ (0x51ed270b27ull * (kind + 1));
  std::vector<float> x(n);
  ForChunks(n, [&](uint64_t c, uint64_t begin, uint64_t end) {
    ChunkRandom rng(stream, c);
    for (uint64_t i = begin; i < end; ++i) {
      switch (kind) {
        case 1:  // narrow_band
          x[i] = rng.Sign() * (1.0f + 0.0005f * rng.UnitFloat());
          break;
        case 2: {  // ties
          const float s = rng.Sign();
          x[i] = i % 1000 == 999 ? 2.0f : s;
          break;
        }
        case 3: {  // laplace_zeros
          const float r = rng.UnitFloat();
          if (r < 0.3f) {
            x[i] = r < 0.1f ? -0.0f : 0.0f;
          } else {
            // Laplace(0, 1): an exponential by inversion, random sign.
            const float e = -std::log1p(-rng.UnitFloat() * 0.999999f);
            x[i] = rng.Sign() * e;
          }
          break;
        }
        default:  // all_equal
          x[i] = rng.Sign() * 0.5f;
          break;
      }
    }
  });
  return x;
}

inline uint32_t KeyOf(float x) {
  uint32_t b;
  std::memcpy(&b, &x, 4);
  return b & 0x7fffffffu;
}

// The reference top-k for several k at once, independent of the GPU
// algorithm: the largest k's threshold by nth_element over the magnitude
// keys, the top max(k) keys sorted, so the k-th largest key T of every k is
// read off; then, in index order, every key > T and the first
// (k - #{key > T}) keys == T (ties to the lower index). The index walk runs
// in parallel chunks: counts per chunk, then each chunk's share of the ties
// and its output offset by prefix sums, then the fill.
// ks[j] in [1, u.size()]; (*out)[j] is the reference for ks[j], ascending.
inline void ReferenceTopKs(const std::vector<float>& u,
                           const std::vector<uint64_t>& ks,
                           std::vector<std::vector<uint32_t>>* out) {
  const uint64_t n = u.size();
  out->assign(ks.size(), {});
  if (ks.empty()) return;
  const uint64_t kmax = *std::max_element(ks.begin(), ks.end());
  std::vector<uint32_t> keys(n);
  ForChunks(n, [&](uint64_t, uint64_t b, uint64_t e) {
    for (uint64_t i = b; i < e; ++i) keys[i] = KeyOf(u[i]);
  });
  std::nth_element(keys.begin(), keys.begin() + (kmax - 1), keys.end(),
                   std::greater<uint32_t>());
  std::sort(keys.begin(), keys.begin() + kmax, std::greater<uint32_t>());
  const uint64_t chunks = (n + kChunk - 1) / kChunk;
  for (size_t j = 0; j < ks.size(); ++j) {
    const uint64_t k = ks[j];
    const uint32_t t = keys[k - 1];
    std::vector<uint64_t> greater(chunks), equal(chunks);
    ForChunks(n, [&](uint64_t c, uint64_t b, uint64_t e) {
      uint64_t g = 0, q = 0;
      for (uint64_t i = b; i < e; ++i) {
        const uint32_t key = KeyOf(u[i]);
        g += key > t;
        q += key == t;
      }
      greater[c] = g;
      equal[c] = q;
    });
    uint64_t total_greater = 0;
    for (uint64_t g : greater) total_greater += g;
    // Ties left to take before chunk c, and chunk c's output offset.
    std::vector<uint64_t> ties_quota(chunks), offset(chunks);
    uint64_t ties_left = k - total_greater, at = 0;
    for (uint64_t c = 0; c < chunks; ++c) {
      ties_quota[c] = std::min(ties_left, equal[c]);
      ties_left -= ties_quota[c];
      offset[c] = at;
      at += greater[c] + ties_quota[c];
    }
    std::vector<uint32_t>& idx = (*out)[j];
    idx.assign(at, 0);
    ForChunks(n, [&](uint64_t c, uint64_t b, uint64_t e) {
      uint64_t o = offset[c], ties = ties_quota[c];
      for (uint64_t i = b; i < e; ++i) {
        const uint32_t key = KeyOf(u[i]);
        if (key > t || (key == t && ties > 0)) {
          if (key == t) --ties;
          idx[o++] = static_cast<uint32_t>(i);
        }
      }
    });
  }
}

}  // namespace device_check
}  // namespace gtopk

#endif  // GTOPK_BENCH_CUDA_DEVICE_CHECK_INPUTS_H_
