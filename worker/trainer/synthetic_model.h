// The trainer's `--model=synthetic:N` (worker/flags.md): no data, a seeded
// random gradient of N floats per step, for benchmarks and device runs that
// measure the exchange rather than a model.
#ifndef GTOPK_WORKER_TRAINER_SYNTHETIC_MODEL_H_
#define GTOPK_WORKER_TRAINER_SYNTHETIC_MODEL_H_

#include <cstddef>
#include <cstdint>
#include <random>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/random.h"
#include "worker/trainer/model.h"

namespace gtopk {
namespace worker {

// `synthetic:N`: no data; a seeded random gradient of N floats per step.
class SyntheticModel final : public Model {
 public:
  SyntheticModel(size_t n, uint64_t seed) {
    n_ = n;
    flat_.resize(n);
    std::mt19937_64 rng(MixSeed(seed, 0x5e7));
    for (float& v : flat_) v = (UniformFloat(rng) - 0.5f) * 0.2f;
  }
  absl::Span<float> params() override { return absl::MakeSpan(flat_); }
  absl::StatusOr<float> ComputeGradient(absl::Span<const float>,
                                        absl::Span<const int64_t>,
                                        absl::Span<float>) override {
    return absl::UnimplementedError("synthetic model has no data");
  }
  EvalResult Evaluate(absl::Span<const float>,
                      absl::Span<const int64_t>) override {
    return {};
  }
  // Uniform in [-1, 1) with 24 random bits, seeded per (seed, rank, step):
  // a counter-based SplitMix64 stream, two values per 64-bit word. A
  // vectorisable pass over n (an mt19937_64 per value cost 5x more), so
  // that --compute-ms, not this, is the emulated compute.
  static void RandomGradient(uint64_t seed, uint32_t rank, int64_t step,
                             absl::Span<float> grad) {
    const uint64_t base =
        MixSeed(MixSeed(seed, rank), static_cast<uint64_t>(step));
    constexpr float kScale = 2.0f / 16777216.0f;  // 2^-23: 24 bits -> [0, 2)
    const size_t n = grad.size();
    for (size_t i = 0; i + 1 < n; i += 2) {
      const uint64_t z = MixSeed(base, i / 2);
      grad[i] = static_cast<float>(z >> 40) * kScale - 1.0f;
      grad[i + 1] = static_cast<float>((z >> 8) & 0xffffff) * kScale - 1.0f;
    }
    if (n % 2 == 1) {
      grad[n - 1] =
          static_cast<float>(MixSeed(base, n / 2) >> 40) * kScale - 1.0f;
    }
  }

 private:
  std::vector<float> flat_;
};

}  // namespace worker
}  // namespace gtopk

#endif  // GTOPK_WORKER_TRAINER_SYNTHETIC_MODEL_H_
