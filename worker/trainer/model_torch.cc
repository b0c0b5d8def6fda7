// The only translation unit that includes libtorch: the module
// libgtopk_torch_model.so, which gtopk-worker loads on first use
// (worker/trainer/torch_module.h); its one export is
// gtopk_torch_model_api().
#include <torch/torch.h>

#include <cmath>
#include <cstring>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "worker/trainer/model.h"
#include "worker/trainer/torch_module.h"

namespace gtopk {
namespace worker {
namespace {

struct ParamShape {
  std::vector<int64_t> shape;
  int64_t fan_in;  // for the uniform(-1/sqrt(fan_in), 1/sqrt(fan_in)) init
};

int64_t Numel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

// Hooks registered on parameter tensors, removed when it goes out of scope
// (also when backward throws).
class HookGuard {
 public:
  explicit HookGuard(std::vector<torch::Tensor>& params) : params_(params) {}
  HookGuard(const HookGuard&) = delete;
  HookGuard& operator=(const HookGuard&) = delete;
  ~HookGuard() {
    for (const auto& [i, h] : hooks_) params_[i].remove_hook(h);
  }
  template <typename F>
  void Add(size_t i, F&& hook) {
    hooks_.emplace_back(i, params_[i].register_hook(std::forward<F>(hook)));
  }

 private:
  std::vector<torch::Tensor>& params_;
  std::vector<std::pair<size_t, unsigned>> hooks_;
};

class TorchModel final : public Model {
 public:
  enum class Kind { kMlp, kCnn };

  TorchModel(Kind kind, uint64_t seed, bool cuda)
      : kind_(kind),
        device_(cuda ? torch::Device(torch::kCUDA, 0)
                     : torch::Device(torch::kCPU)) {
    std::vector<ParamShape> shapes;
    if (kind == Kind::kMlp) {
      shapes = {{{256, kImagePixels}, kImagePixels},
                {{256}, kImagePixels},
                {{kClasses, 256}, 256},
                {{kClasses}, 256}};
    } else {
      shapes = {{{32, 1, 5, 5}, 25},       {{32}, 25},
                {{64, 32, 5, 5}, 32 * 25}, {{64}, 32 * 25},
                {{256, 1024}, 1024},       {{256}, 1024},
                {{kClasses, 256}, 256},    {{kClasses}, 256}};
    }
    size_t n = 0;
    for (const ParamShape& s : shapes) n += static_cast<size_t>(Numel(s.shape));
    n_ = n;
    flat_.assign(n, 0.0f);
    torch::manual_seed(seed);
    torch::NoGradGuard no_grad;
    size_t offset = 0;
    for (const ParamShape& s : shapes) {
      torch::Tensor t =
          torch::from_blob(flat_.data() + offset, s.shape,
                           torch::TensorOptions().dtype(torch::kFloat32));
      const double bound = 1.0 / std::sqrt(static_cast<double>(s.fan_in));
      t.uniform_(-bound, bound);
      t.requires_grad_(true);
      params_.push_back(t);
      offset += static_cast<size_t>(Numel(s.shape));
    }
    if (cuda) {
      // Device storage, with the device parameters as views into it (the
      // worker client updates it in place through device_params()).
      const auto opts =
          torch::TensorOptions().dtype(torch::kFloat32).device(device_);
      flat_device_ = torch::empty({static_cast<int64_t>(n)}, opts);
      grad_device_ = torch::zeros({static_cast<int64_t>(n)}, opts);
      int64_t at = 0;
      for (torch::Tensor& p : params_) {
        const int64_t count = p.numel();
        torch::Tensor view = flat_device_.narrow(0, at, count).view(p.sizes());
        view.requires_grad_(true);
        p = view;
        at += count;
      }
      UploadFlat();
    }
  }

  bool on_device() const override { return device_.is_cuda(); }

  absl::Status UploadParams() override {
    if (device_.is_cuda()) UploadFlat();
    return absl::OkStatus();
  }

  absl::Status DownloadParams() override {
    if (device_.is_cuda()) {
      torch::NoGradGuard no_grad;
      torch::from_blob(flat_.data(), {static_cast<int64_t>(flat_.size())},
                       torch::kFloat32)
          .copy_(flat_device_.to(torch::kCPU));
    }
    return absl::OkStatus();
  }

  absl::Status ZeroDeviceGradient() override {
    if (device_.is_cuda() && grad_device_.defined()) {
      torch::NoGradGuard no_grad;
      grad_device_.zero_();
    }
    return absl::OkStatus();
  }

  float* device_params() override {
    return device_.is_cuda() ? flat_device_.data_ptr<float>() : nullptr;
  }

  absl::StatusOr<float> ComputeGradientOnDevice(
      absl::Span<const float> images, absl::Span<const int64_t> labels,
      const float** device_grad) override {
    const int64_t batch = static_cast<int64_t>(labels.size());
    if (!device_.is_cuda()) {
      return Model::ComputeGradientOnDevice(images, labels, device_grad);
    }
    if (batch == 0 || images.size() != labels.size() * kImagePixels) {
      return absl::InvalidArgumentError(
          absl::StrCat("ComputeGradientOnDevice: batch of ", labels.size(),
                       " labels, ", images.size(), " pixels"));
    }
    for (torch::Tensor& p : params_) p.mutable_grad() = torch::Tensor();
    torch::Tensor loss = torch::nll_loss(Forward(Input(images, batch)),
                                         Labels(labels.data(), batch));
    loss.backward();
    torch::NoGradGuard no_grad;
    int64_t at = 0;
    for (torch::Tensor& p : params_) {
      const int64_t count = p.numel();
      torch::Tensor slot = grad_device_.narrow(0, at, count);
      if (p.grad().defined()) {
        slot.copy_(p.grad().reshape({count}));
      } else {
        slot.zero_();
      }
      at += count;
    }
    *device_grad = grad_device_.data_ptr<float>();
    return loss.item<float>();  // synchronises: the gradient is complete
  }

  absl::Span<float> params() override { return absl::MakeSpan(flat_); }

  absl::StatusOr<float> ComputeGradient(
      absl::Span<const float> images, absl::Span<const int64_t> labels,
      absl::Span<float> grad, const GradientRangeReady& on_ready) override {
    const int64_t batch = static_cast<int64_t>(labels.size());
    if (batch == 0 || images.size() != labels.size() * kImagePixels ||
        grad.size() != n_) {
      return absl::InvalidArgumentError(
          absl::StrCat("ComputeGradient: batch of ", labels.size(), " labels, ",
                       images.size(), " pixels, gradient of ", grad.size(),
                       " (n = ", n_, ")"));
    }
    for (torch::Tensor& p : params_) p.mutable_grad() = torch::Tensor();
    std::vector<size_t> offsets(params_.size() + 1, 0);
    for (size_t i = 0; i < params_.size(); ++i) {
      offsets[i + 1] = offsets[i] + static_cast<size_t>(params_[i].numel());
    }
    // Per parameter: its gradient in `grad`, then reported.
    std::vector<bool> copied(params_.size(), false);
    auto take = [&](size_t i, const torch::Tensor& g) {
      const size_t count = offsets[i + 1] - offsets[i];
      if (!g.defined()) {
        std::memset(grad.data() + offsets[i], 0, count * sizeof(float));
      } else {
        const torch::Tensor c = g.contiguous().to(torch::kCPU);  // CPU: no-op
        std::memcpy(grad.data() + offsets[i], c.data_ptr<float>(),
                    count * sizeof(float));
      }
      copied[i] = true;
      if (on_ready) on_ready(offsets[i], offsets[i + 1]);
    };
    torch::Tensor loss;
    {
      // With `on_ready`, a hook per parameter takes its gradient as soon as
      // autograd produced it: the value AccumulateGrad then stores as its
      // .grad (every .grad was reset above), so the same bits either way.
      HookGuard hooks(params_);
      if (on_ready) {
        for (size_t i = 0; i < params_.size(); ++i) {
          hooks.Add(i, [&take, i](torch::Tensor g) { take(i, g); });
        }
      }
      loss = torch::nll_loss(Forward(Input(images, batch)),
                             Labels(labels.data(), batch));
      loss.backward();
    }
    for (size_t i = 0; i < params_.size(); ++i) {
      if (!copied[i]) take(i, params_[i].grad());
    }
    return loss.item<float>();
  }

  EvalResult Evaluate(absl::Span<const float> images,
                      absl::Span<const int64_t> labels) override {
    torch::NoGradGuard no_grad;
    constexpr int64_t kChunk = 1000;
    const int64_t total = static_cast<int64_t>(labels.size());
    double loss_sum = 0;
    int64_t correct = 0;
    for (int64_t begin = 0; begin < total; begin += kChunk) {
      const int64_t count = std::min(kChunk, total - begin);
      torch::Tensor x = Input(
          images.subspan(begin * kImagePixels, count * kImagePixels), count);
      torch::Tensor y = Labels(labels.data() + begin, count);
      torch::Tensor logp = Forward(x);
      loss_sum +=
          torch::nll_loss(logp, y, {}, at::Reduction::Sum).item<double>();
      correct += logp.argmax(1).eq(y).sum().item<int64_t>();
    }
    EvalResult r;
    if (total > 0) {
      r.accuracy = static_cast<double>(correct) / static_cast<double>(total);
      r.loss = loss_sum / static_cast<double>(total);
    }
    return r;
  }

 private:
  torch::Tensor Input(absl::Span<const float> images, int64_t batch) {
    torch::Tensor x =
        torch::from_blob(const_cast<float*>(images.data()),
                         {batch, 1, kImageSide, kImageSide}, torch::kFloat32);
    return device_.is_cuda() ? x.to(device_) : x;
  }
  torch::Tensor Labels(const int64_t* labels, int64_t count) {
    torch::Tensor y =
        torch::from_blob(const_cast<int64_t*>(labels), {count}, torch::kInt64);
    return device_.is_cuda() ? y.to(device_) : y;
  }
  // flat_ (host) -> the device parameters.
  void UploadFlat() {
    torch::NoGradGuard no_grad;
    flat_device_.copy_(torch::from_blob(
        flat_.data(), {static_cast<int64_t>(flat_.size())}, torch::kFloat32));
  }

  // Log-probabilities, batch x 10.
  torch::Tensor Forward(torch::Tensor x) {
    const std::vector<torch::Tensor>& p = params_;
    if (kind_ == Kind::kMlp) {
      x = x.reshape({x.size(0), kImagePixels});
      x = torch::relu(torch::linear(x, p[0], p[1]));
      x = torch::linear(x, p[2], p[3]);
    } else {
      x = torch::max_pool2d(torch::relu(torch::conv2d(x, p[0], p[1])), 2);
      x = torch::max_pool2d(torch::relu(torch::conv2d(x, p[2], p[3])), 2);
      x = x.reshape({x.size(0), 1024});
      x = torch::relu(torch::linear(x, p[4], p[5]));
      x = torch::linear(x, p[6], p[7]);
    }
    return torch::log_softmax(x, 1);
  }

  const Kind kind_;
  const torch::Device device_;
  std::vector<float> flat_;
  torch::Tensor flat_device_;          // cuda: the parameters' storage
  torch::Tensor grad_device_;          // cuda: the flat gradient
  std::vector<torch::Tensor> params_;  // views into flat_
};

// MakeTorchDeviceMirror: a host model's parameters and gradient in device
// memory. torch's copies run on the current (legacy default) stream and
// wait for it, as the worker client's device Step expects.
class DeviceMirrorModel final : public Model {
 public:
  explicit DeviceMirrorModel(std::unique_ptr<Model> host)
      : host_(std::move(host)) {
    n_ = host_->n();
    const auto opts = torch::TensorOptions()
                          .dtype(torch::kFloat32)
                          .device(torch::Device(torch::kCUDA, 0));
    flat_device_ = torch::empty({static_cast<int64_t>(n_)}, opts);
    grad_device_ = torch::zeros({static_cast<int64_t>(n_)}, opts);
    (void)UploadParams();
  }

  absl::Span<float> params() override { return host_->params(); }
  absl::StatusOr<float> ComputeGradient(
      absl::Span<const float> images, absl::Span<const int64_t> labels,
      absl::Span<float> grad, const GradientRangeReady& on_ready) override {
    return host_->ComputeGradient(images, labels, grad, on_ready);
  }
  EvalResult Evaluate(absl::Span<const float> images,
                      absl::Span<const int64_t> labels) override {
    return host_->Evaluate(images, labels);
  }
  bool on_device() const override { return true; }
  absl::Status UploadParams() override {
    flat_device_.copy_(HostView(host_->params()));
    return absl::OkStatus();
  }
  absl::Status DownloadParams() override {
    HostView(host_->params()).copy_(flat_device_);
    return absl::OkStatus();
  }
  absl::Status ZeroDeviceGradient() override {
    grad_device_.zero_();
    return absl::OkStatus();
  }
  float* device_params() override { return flat_device_.data_ptr<float>(); }
  absl::StatusOr<const float*> UploadGradient(
      absl::Span<const float> grad) override {
    if (grad.size() != n_) {
      return absl::InvalidArgumentError(absl::StrCat(
          "UploadGradient: gradient of ", grad.size(), " (n = ", n_, ")"));
    }
    grad_device_.copy_(
        HostView(absl::Span<float>(const_cast<float*>(grad.data()), n_)));
    return grad_device_.data_ptr<float>();
  }

 private:
  static torch::Tensor HostView(absl::Span<float> v) {
    return torch::from_blob(v.data(), {static_cast<int64_t>(v.size())},
                            torch::kFloat32);
  }

  std::unique_ptr<Model> host_;
  torch::Tensor flat_device_;
  torch::Tensor grad_device_;
};

absl::StatusOr<std::unique_ptr<Model>> MakeDeviceMirror(
    std::unique_ptr<Model> host) {
  if (!torch::cuda::is_available()) {
    return absl::FailedPreconditionError(
        "--device=cuda: this libtorch has no CUDA or sees no CUDA device");
  }
  return std::unique_ptr<Model>(new DeviceMirrorModel(std::move(host)));
}

absl::StatusOr<std::unique_ptr<Model>> MakeModel(const std::string& name,
                                                 uint64_t seed, int threads,
                                                 bool cuda) {
  if (threads < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--threads must be >= 1, got ", threads));
  }
  torch::set_num_threads(threads);
  if (cuda && !torch::cuda::is_available()) {
    return absl::FailedPreconditionError(
        "--device=cuda: this libtorch has no CUDA or sees no CUDA device");
  }
  if (name == "mlp") {
    return std::unique_ptr<Model>(
        new TorchModel(TorchModel::Kind::kMlp, seed, cuda));
  }
  if (name == "cnn") {
    return std::unique_ptr<Model>(
        new TorchModel(TorchModel::Kind::kCnn, seed, cuda));
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "unknown model \"", name, "\"; expected mlp, cnn or synthetic:N"));
}

bool CudaAvailable() { return torch::cuda::is_available(); }

constexpr TorchModuleApi kApi = {GTOPK_TORCH_MODULE_ABI, &MakeModel,
                                 &MakeDeviceMirror, &CudaAvailable};

}  // namespace
}  // namespace worker
}  // namespace gtopk

extern "C" __attribute__((visibility("default")))
const gtopk::worker::TorchModuleApi*
gtopk_torch_model_api() {
  return &gtopk::worker::kApi;
}
