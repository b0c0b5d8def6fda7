// The trainer's data and per-step work (worker/trainer/training_data.h).
#include "worker/trainer/training_data.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <numeric>
#include <random>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/random.h"
#include "common/status_macros.h"
#include "worker/trainer/idx_reader.h"

namespace gtopk {
namespace worker {
namespace trainer_internal {

void PrintLine(const std::string& line) {
  std::fputs(line.c_str(), stdout);
  std::fputc('\n', stdout);
  std::fflush(stdout);
}

absl::StatusOr<Split> LoadSplit(const std::string& images,
                                const std::string& labels, int64_t limit) {
  GTOPK_ASSIGN_OR_RETURN(IdxDataset d, ReadIdxDataset(images, labels));
  size_t count = d.labels.labels.size();
  if (limit > 0) count = std::min(count, static_cast<size_t>(limit));
  Split s;
  s.pixels.assign(d.images.pixels.begin(),
                  d.images.pixels.begin() + count * kImagePixels);
  s.labels.assign(d.labels.labels.begin(), d.labels.labels.begin() + count);
  return s;
}

std::vector<uint32_t> EpochPermutation(size_t count, uint64_t seed,
                                       int64_t epoch) {
  std::vector<uint32_t> perm(count);
  std::iota(perm.begin(), perm.end(), 0u);
  std::mt19937_64 rng(
      MixSeed(seed, 0x5f0000ull + static_cast<uint64_t>(epoch)));
  for (size_t i = count; i > 1; --i) {
    const size_t j = UniformBelow(rng, i);
    std::swap(perm[i - 1], perm[j]);
  }
  return perm;
}

absl::StatusOr<Data> LoadData(const TrainerOptions& o, bool synthetic) {
  Data data;
  if (synthetic) return data;
  const FashionMnistFiles files = FashionMnistPaths(o.data_dir);
  GTOPK_ASSIGN_OR_RETURN(
      data.train,
      LoadSplit(files.train_images, files.train_labels, o.train_limit));
  GTOPK_ASSIGN_OR_RETURN(
      data.test, LoadSplit(files.test_images, files.test_labels, o.test_limit));
  return data;
}

Evaluator::Evaluator(Model& model, const Split& test, bool enabled,
                     WorkerMetrics* metrics)
    : model_(model), test_(test), enabled_(enabled), metrics_(metrics) {
  if (!enabled_) return;
  test_images_.resize(test.pixels.size());
  for (size_t i = 0; i < test.pixels.size(); ++i) {
    test_images_[i] = Normalise(test.pixels[i]);
  }
}

void Evaluator::Evaluate(int64_t done) {
  if (!enabled_ || done == last_eval_) return;
  last_eval_ = done;
  const EvalResult r = model_.Evaluate(test_images_, test_.labels);
  test_accuracy_ = r.accuracy;
  if (metrics_ != nullptr) metrics_->RecordTestAccuracy(r.accuracy);
  PrintLine(absl::StrFormat("eval step %d test_accuracy %.4f test_loss %.4f",
                            done, r.accuracy, r.loss));
}

absl::Status GradientSource::Compute(
    int64_t step, int64_t epoch, bool resend_residual,
    const Model::GradientRangeReady& on_ready) {
  if (resend_residual) {
    std::fill(grad_.begin(), grad_.end(), 0.0f);
    GTOPK_RETURN_IF_ERROR(model_.ZeroDeviceGradient());
  } else if (synthetic_) {
    synthetic_gradient_->Fill(rank_, step, absl::MakeSpan(grad_));
    if (on_ready && o_.compute_ms > 0) {
      EmulateBackward(on_ready);
    } else {
      if (o_.compute_ms > 0) {
        std::this_thread::sleep_for(std::chrono::milliseconds(o_.compute_ms));
      }
      if (on_ready) on_ready(0, grad_.size());
    }
  } else {
    FillBatch(step, epoch);
    if (model_.on_device()) {
      GTOPK_ASSIGN_OR_RETURN(
          loss_, model_.ComputeGradientOnDevice(batch_images_, batch_labels_,
                                                &device_grad_));
    } else {
      GTOPK_ASSIGN_OR_RETURN(
          loss_, model_.ComputeGradient(batch_images_, batch_labels_,
                                        absl::MakeSpan(grad_), on_ready));
    }
    if (!std::isfinite(loss_)) {
      return absl::InternalError(
          absl::StrCat("loss is ", loss_, " at step ", step,
                       " (diverged; lower the servers' --lr)"));
    }
  }
  if (synthetic_ && model_.on_device()) {
    GTOPK_ASSIGN_OR_RETURN(device_grad_, model_.UploadGradient(grad_));
  }
  return absl::OkStatus();
}

void GradientSource::EmulateBackward(
    const Model::GradientRangeReady& on_ready) {
  // Range r of kEmulatedBackwardRanges, counted from the end, is reported
  // at t0 + (r + 1) / kEmulatedBackwardRanges x --compute-ms (absolute
  // times: the sleeps' overshoot does not add up).
  const size_t n = grad_.size();
  const size_t ranges = std::min<size_t>(kEmulatedBackwardRanges, n);
  const absl::Time t0 = absl::Now();
  const absl::Duration compute = absl::Milliseconds(o_.compute_ms);
  size_t end = n;
  for (size_t r = 0; r < ranges; ++r) {
    const size_t begin = n - n * (r + 1) / ranges;
    absl::SleepFor(t0 +
                   compute * static_cast<double>(r + 1) /
                       static_cast<double>(ranges) -
                   absl::Now());
    if (begin < end) on_ready(begin, end);
    end = begin;
  }
}

void GradientSource::FillBatch(int64_t step, int64_t epoch) {
  if (epoch != perm_epoch_) {
    perm_ = EpochPermutation(train_.size(), o_.seed, epoch);
    perm_epoch_ = epoch;
  }
  const size_t per_rank = static_cast<size_t>(steps_per_epoch_) * o_.batch_size;
  const size_t base =
      rank_ * per_rank +
      static_cast<size_t>(step % steps_per_epoch_) * o_.batch_size;
  for (int64_t b = 0; b < o_.batch_size; ++b) {
    const uint32_t idx = perm_[base + b];
    const uint8_t* src = train_.pixels.data() + size_t{idx} * kImagePixels;
    float* dst = batch_images_.data() + b * kImagePixels;
    for (int i = 0; i < kImagePixels; ++i) dst[i] = Normalise(src[i]);
    batch_labels_[b] = train_.labels[idx];
  }
}

}  // namespace trainer_internal
}  // namespace worker
}  // namespace gtopk
