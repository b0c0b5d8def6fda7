// synthetic:N's per-step gradient (worker/flags.md `--model`), apart from
// the trainer's Model so that benchmarks can use it alone.
#ifndef GTOPK_WORKER_TRAINER_SYNTHETIC_GRADIENT_H_
#define GTOPK_WORKER_TRAINER_SYNTHETIC_GRADIENT_H_

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/types/span.h"
#include "common/random.h"

namespace gtopk {
namespace worker {

// synthetic:N's gradient, cheap enough that a benchmark's `local` time is
// the worker's selection and encoding, not a random-number generator
// (issue 20: the per-step SplitMix64 stream this replaces cost 31 ms per
// step at n = 25,557,032; this costs one write pass over n).
//
// A pool of kPoolSize + kBlock approximately normal values (Irwin-Hall: the
// sum of four 16-bit uniforms, centred; integer arithmetic, so bit-identical
// on every machine) is made once from the seed. Step `step` of rank `rank`
// cuts the gradient into blocks of kBlock floats; block b is a contiguous
// slice of the pool starting at an offset, times a sign and a scale in
// [0.5, 1.5), all three from one SplitMix64 hash of (seed, rank, step, b).
// So every step's values, and hence its top-k (which lies in the blocks
// whose scale and slice are largest that step), differ from the last, while
// the cost per element is one load, one multiply and one store.
//
// Deterministic: a pure function of (seed, rank, step, n). Thread-compatible
// (Fill is const).
class SyntheticGradient {
 public:
  static constexpr size_t kBlock = 1024;        // floats per perturbed block
  static constexpr size_t kPoolSize = 1 << 20;  // 4 MiB: stays in cache

  SyntheticGradient(size_t n, uint64_t seed)
      : seed_(seed), pool_(std::min(n, kPoolSize) + kBlock) {
    const uint64_t base = MixSeed(seed, 0x9001);
    constexpr float kScale = 1.0f / 65536.0f / 1.1547005f;  // / (4/sqrt(12))
    for (size_t i = 0; i < pool_.size(); ++i) {
      const uint64_t z = MixSeed(base, i);
      const int64_t sum =
          static_cast<int64_t>((z & 0xffff) + ((z >> 16) & 0xffff) +
                               ((z >> 32) & 0xffff) + (z >> 48)) -
          2 * 65535;  // centred: in [-131070, 131070], variance 4/12 x 2^32
      pool_[i] = static_cast<float>(sum) * kScale;  // ~ N(0, 1)
    }
  }

  // Writes step `step`'s gradient of rank `rank` into `grad`
  // (grad.size() = n; any n works, the pool is sized at construction for
  // n's up to its own size and reused beyond).
  void Fill(uint32_t rank, int64_t step, absl::Span<float> grad) const {
    const uint64_t base =
        MixSeed(MixSeed(seed_, rank), static_cast<uint64_t>(step));
    const size_t n = grad.size();
    const size_t slices = pool_.size() - kBlock + 1;  // start offsets
    float* out = grad.data();
    for (size_t b = 0, i = 0; i < n; ++b, i += kBlock) {
      const uint64_t h = MixSeed(base, b);
      const size_t len = std::min(kBlock, n - i);
      const float* src = pool_.data() + (h >> 32) % slices;
      // Scale in [0.5, 1.5) from 23 bits; the sign from bit 0.
      const float magnitude =
          0.5f + static_cast<float>((h >> 1) & 0x7fffff) * (1.0f / 8388608.0f);
      const float scale = (h & 1) ? -magnitude : magnitude;
      for (size_t j = 0; j < len; ++j) out[i + j] = src[j] * scale;
    }
  }

 private:
  uint64_t seed_;
  std::vector<float> pool_;
};

}  // namespace worker
}  // namespace gtopk

#endif  // GTOPK_WORKER_TRAINER_SYNTHETIC_GRADIENT_H_
