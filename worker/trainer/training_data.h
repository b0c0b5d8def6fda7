// The trainer's data and per-step work (worker/trainer/trainer.cc): the
// Fashion-MNIST splits, the epoch's permutation, rank 0's evaluation
// (Evaluator) and each step's gradient (GradientSource). Internal to the
// trainer library: include worker/trainer/trainer.h.
#ifndef GTOPK_WORKER_TRAINER_TRAINING_DATA_H_
#define GTOPK_WORKER_TRAINER_TRAINING_DATA_H_

#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "worker/trainer/model.h"
#include "worker/trainer/synthetic_model.h"
#include "worker/trainer/trainer.h"
#include "worker/worker_metrics.h"

namespace gtopk {
namespace worker {
namespace trainer_internal {

// One progress line on stdout, flushed.
void PrintLine(const std::string& line);

// A data split as uint8 pixels plus int64 labels, after --*-limit.
struct Split {
  std::vector<uint8_t> pixels;
  std::vector<int64_t> labels;
  size_t size() const { return labels.size(); }
};

// The split of the IDX files `images` and `labels`, the first `limit`
// examples (all for limit <= 0). Errors: ReadIdxDataset's.
absl::StatusOr<Split> LoadSplit(const std::string& images,
                                const std::string& labels, int64_t limit);

inline float Normalise(uint8_t v) {
  return (static_cast<float>(v) * (1.0f / 255.0f) - kPixelMean) / kPixelStd;
}

// The training set's permutation for `epoch`, identical on every rank.
std::vector<uint32_t> EpochPermutation(size_t count, uint64_t seed,
                                       int64_t epoch);

// Fashion-MNIST's training and test splits after --train-limit and
// --test-limit (both empty for synthetic:N, which has no data).
struct Data {
  Split train, test;
};

// Loads Fashion-MNIST from o.data_dir (nothing for synthetic:N).
absl::StatusOr<Data> LoadData(const TrainerOptions& o, bool synthetic);

// Rank 0's evaluation on the test set (normalised once), at most once per
// step count; a no-op on other ranks and for synthetic:N.
class Evaluator {
 public:
  Evaluator(Model& model, const Split& test, bool enabled,
            WorkerMetrics* metrics);

  // Evaluates the parameters after `done` steps, unless they were
  // evaluated at that count already; prints the "eval" line.
  void Evaluate(int64_t done);

  // Steps are re-run: evaluate the re-run's final parameters too.
  void ForgetLastEvaluation() { last_eval_ = -1; }

  // The last evaluation's accuracy; NaN before the first.
  double test_accuracy() const { return test_accuracy_; }

 private:
  Model& model_;
  const Split& test_;
  const bool enabled_;
  WorkerMetrics* const metrics_;
  std::vector<float> test_images_;
  double test_accuracy_ = std::nan("");
  int64_t last_eval_ = -1;
};

// Ranges of synthetic:N's emulated backward pass (GradientSource::Compute).
inline constexpr size_t kEmulatedBackwardRanges = 100;

// Each step's gradient: this rank's batch of the epoch's permutation
// through the model, synthetic:N's seeded random one, or zeros for a
// retried step. Keeps the last batch's loss (a retried or synthetic step
// computes none).
class GradientSource {
 public:
  GradientSource(const TrainerOptions& o, Model& model, const Split& train,
                 bool synthetic, uint32_t rank, int64_t steps_per_epoch)
      : o_(o),
        model_(model),
        train_(train),
        synthetic_(synthetic),
        rank_(rank),
        steps_per_epoch_(steps_per_epoch),
        // The host gradient: every CPU model's, and synthetic:N's on the
        // device too (made on the host, then uploaded).
        grad_(model.on_device() && !synthetic ? 0 : model.n(), 0.0f),
        synthetic_gradient_(
            synthetic ? std::make_unique<SyntheticGradient>(model.n(), o.seed)
                      : nullptr),
        batch_images_(static_cast<size_t>(o.batch_size) * kImagePixels),
        batch_labels_(static_cast<size_t>(o.batch_size)) {}

  // Makes the gradient of `step` (in `epoch`); `resend_residual`: the step
  // is retried, its gradient is already in the residual (Step's contract),
  // so the retry adds none. INTERNAL when the loss is not finite.
  // `on_ready` (host gradients only): told each range of grad() as it is
  // final (Model::ComputeGradient's reports). synthetic:N's gradient is one
  // range [0, n), once made, or, with --compute-ms, an emulated backward
  // pass: kEmulatedBackwardRanges equal ranges from the end, one after each
  // 1/kEmulatedBackwardRanges of --compute-ms (gradient produced at an even
  // rate, last layers first, the CPU left free as by a GPU's backward).
  absl::Status Compute(int64_t step, int64_t epoch, bool resend_residual,
                       const Model::GradientRangeReady& on_ready = nullptr);

  // The host gradient (empty for a CUDA torch model).
  absl::Span<const float> grad() const { return grad_; }
  // --device=cuda: the model's device gradient; null before the first step.
  const float* device_grad() const { return device_grad_; }
  // The last computed batch's loss (0 before the first, and synthetic:N's).
  float loss() const { return loss_; }

 private:
  // This rank's `step` batch, normalised: a contiguous slice of the
  // epoch's permutation, one per rank.
  void FillBatch(int64_t step, int64_t epoch);
  // synthetic:N with --compute-ms on an overlapped step: grad_ (already
  // filled) reported to `on_ready` range by range over --compute-ms.
  void EmulateBackward(const Model::GradientRangeReady& on_ready);

  const TrainerOptions& o_;
  Model& model_;
  const Split& train_;
  const bool synthetic_;
  const uint32_t rank_;
  const int64_t steps_per_epoch_;
  std::vector<float> grad_;
  // synthetic:N's generator (its pool is made once); null otherwise.
  std::unique_ptr<SyntheticGradient> synthetic_gradient_;
  const float* device_grad_ = nullptr;
  std::vector<float> batch_images_;
  std::vector<int64_t> batch_labels_;
  std::vector<uint32_t> perm_;
  int64_t perm_epoch_ = -1;
  float loss_ = 0;
};

}  // namespace trainer_internal
}  // namespace worker
}  // namespace gtopk

#endif  // GTOPK_WORKER_TRAINER_TRAINING_DATA_H_
