// The trainer's `--model=synthetic:N` (worker/flags.md): no data, a seeded
// gradient of N floats per step, for benchmarks and device runs that
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
#include "worker/trainer/synthetic_gradient.h"

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
                                        absl::Span<float>,
                                        const GradientRangeReady&) override {
    return absl::UnimplementedError("synthetic model has no data");
  }
  EvalResult Evaluate(absl::Span<const float>,
                      absl::Span<const int64_t>) override {
    return {};
  }

 private:
  std::vector<float> flat_;
};

}  // namespace worker
}  // namespace gtopk

#endif  // GTOPK_WORKER_TRAINER_SYNTHETIC_MODEL_H_
