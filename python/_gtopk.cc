// gtopk._gtopk: the Python binding of the worker client library
// (worker/client.h). One implementation of the step: every call here is a
// WorkerClient call; this file only converts buffers, statuses and stats,
// and makes the blocking calls interruptible.
//
// Blocking calls (Connect, SynchronizeParameters, Step, Recover) run on a
// helper thread with the GIL released; the calling thread waits for it in
// 50 ms slices and checks for signals (PyErr_CheckSignals) between them. On
// Ctrl-C (or any signal handler that raises) it cancels the RPCs in flight
// (worker/cancellation.h), joins the helper thread and re-raises: the call
// fails under its usual contract (a step applies nothing), and no thread or
// stream is left behind. Errors become gtopk.errors.Error subclasses
// (python/gtopk/errors.py), keeping the absl::Status code and message.
// API: python/gtopk/__init__.py and docs/python.md.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <pybind11/stl/filesystem.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "common/checksum.h"
#include "common/cluster_spec/cluster_spec.h"
#include "common/host_port.h"
#include "common/metrics/exposer.h"
#include "common/metrics/process_collector.h"
#include "common/transport_security/transport_security.h"
#include "worker/cancellation.h"
#include "worker/client.h"
#include "worker/worker_metrics.h"

namespace py = pybind11;

namespace gtopk {
namespace python {
namespace {

using worker::Cancellation;
using worker::StepStats;
using worker::WorkerClient;

// Raises gtopk.errors.from_status(code, message) (an Error subclass).
[[noreturn]] void Raise(const absl::Status& status) {
  py::object errors = py::module_::import("gtopk.errors");
  py::object error = errors.attr("from_status")(static_cast<int>(status.code()),
                                                std::string(status.message()));
  PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(error.ptr())),
                  error.ptr());
  throw py::error_already_set();
}

template <typename T>
T ValueOrRaise(absl::StatusOr<T> v) {
  if (!v.ok()) Raise(v.status());
  return *std::move(v);
}

void OkOrRaise(const absl::Status& s) {
  if (!s.ok()) Raise(s);
}

// Runs `f` (no Python objects, no GIL) on a helper thread; see the file
// comment. `cancellation` may be null (then a signal waits for `f`).
template <typename F>
auto RunInterruptibly(Cancellation* cancellation, F&& f) -> decltype(f()) {
  using R = decltype(f());
  std::optional<R> result;
  absl::Notification done;
  std::thread helper;
  {
    py::gil_scoped_release release;
    helper = std::thread([&] {
      result.emplace(f());
      done.Notify();
    });
  }
  for (;;) {
    bool finished;
    {
      py::gil_scoped_release release;
      finished = done.WaitForNotificationWithTimeout(absl::Milliseconds(50));
    }
    if (finished) break;
    if (PyErr_CheckSignals() != 0) {
      // The handler raised (KeyboardInterrupt for SIGINT): cancel, wait for
      // the call to unwind, and let the exception propagate.
      if (cancellation != nullptr) cancellation->Cancel();
      {
        py::gil_scoped_release release;
        helper.join();
      }
      if (cancellation != nullptr) cancellation->Reset();
      throw py::error_already_set();
    }
  }
  {
    py::gil_scoped_release release;
    helper.join();
  }
  return std::move(*result);
}

// A C-contiguous float32 buffer (numpy array, tensor.numpy(), array('f'),
// ...) of exactly `n` values; `writable` for parameters. Raises
// InvalidArgument naming `what` otherwise: a converted copy would silently
// lose the update.
struct FloatBuffer {
  py::buffer_info info;
  float* data() const { return static_cast<float*>(info.ptr); }
  uint64_t size() const { return static_cast<uint64_t>(info.size); }
};

FloatBuffer GetFloats(const py::buffer& b, const char* what, bool writable,
                      std::optional<uint64_t> n) {
  py::buffer_info info;
  try {
    info = b.request(writable);
  } catch (const py::error_already_set& e) {
    Raise(absl::InvalidArgumentError(absl::StrCat(
        what, ": not a ", writable ? "writable " : "", "buffer (", e.what(),
        "); pass a float32 numpy array or tensor.numpy()")));
  }
  if (info.itemsize != sizeof(float) ||
      (info.format != "f" && info.format != "<f" && info.format != "=f")) {
    Raise(absl::InvalidArgumentError(
        absl::StrCat(what, ": the buffer holds '", info.format, "' items of ",
                     info.itemsize, " bytes; float32 ('f') is required")));
  }
  py::ssize_t expected = info.itemsize;
  for (int i = info.ndim - 1; i >= 0; --i) {
    if (info.shape[i] != 1 && info.strides[i] != expected) {
      Raise(absl::InvalidArgumentError(absl::StrCat(
          what, ": the buffer is not C-contiguous (make it .contiguous())")));
    }
    expected *= info.shape[i];
  }
  if (n.has_value() && static_cast<uint64_t>(info.size) != *n) {
    Raise(absl::InvalidArgumentError(
        absl::StrCat(what, ": has ", info.size, " values; n = ", *n)));
  }
  return FloatBuffer{std::move(info)};
}

double Seconds(absl::Duration d) { return absl::ToDoubleSeconds(d); }

py::dict StatsDict(const StepStats& s) {
  py::dict d;
  d["step"] = s.step;
  d["k"] = s.k;
  d["sent_pairs"] = s.sent_pairs;
  d["received_pairs"] = s.received_pairs;
  d["bytes_sent"] = s.bytes_sent;
  d["bytes_received"] = s.bytes_received;
  d["accumulate_seconds"] = Seconds(s.accumulate);
  d["select_seconds"] = Seconds(s.select);
  d["encode_seconds"] = Seconds(s.encode);
  d["push_seconds"] = Seconds(s.push);
  d["wait_seconds"] = Seconds(s.wait);
  d["apply_seconds"] = Seconds(s.apply);
  d["server_merge_seconds"] = Seconds(s.server_merge);
  d["server_select_seconds"] = Seconds(s.server_select);
  d["exposed_seconds"] = Seconds(s.exposed);
  d["parts_sent"] = s.parts_sent;
  return d;
}

py::dict ClusterDict(const v1::ClusterSpec& c) {
  const v1::OptimizerSpec& o = c.optimizer();
  py::dict d;
  d["n"] = c.n();
  d["num_workers"] = c.num_workers();
  d["mode"] = ModeFlagValue(c.mode());
  d["selection"] = SelectionFlagValue(c.selection());
  d["selector"] = c.selector();
  d["selector_seed"] = c.selector_seed();
  d["index_codec"] = c.index_codec();
  d["value_codec"] = c.value_codec();
  d["lr"] = o.lr();
  d["momentum"] = o.momentum();
  d["momentum_mode"] = MomentumFlagValue(
      o.momentum_mode() == v1::MOMENTUM_MODE_UNSPECIFIED ? v1::MOMENTUM_MODE_DGC
                                                         : o.momentum_mode());
  d["momentum_factor_masking"] = o.momentum_factor_masking();
  d["weight_decay"] = o.weight_decay();
  d["lr_warmup_steps"] = o.lr_warmup_steps();
  d["density"] = o.density();
  d["density_warmup"] =
      std::vector<double>(o.density_warmup().begin(), o.density_warmup().end());
  d["steps_per_epoch"] = o.steps_per_epoch();
  d["step_timeout_ms"] = c.step_timeout_ms();
  d["max_message_bytes"] = c.max_message_bytes();
  d["next_step"] = c.next_step();
  d["apply"] = ApplyFlagValue(c.apply());
  d["checksum_every"] = c.checksum_every();
  d["bucket_size"] = c.bucket_size();
  d["cluster_fingerprint"] = FingerprintText(c.cluster_fingerprint());
  py::list shards;
  for (const v1::ShardSpec& s : c.shards()) {
    py::dict sd;
    sd["id"] = s.shard_id();
    sd["address"] = s.address();
    sd["begin"] = s.begin();
    sd["end"] = s.end();
    shards.append(std::move(sd));
  }
  d["shards"] = std::move(shards);
  return d;
}

absl::Duration DurationArg(double seconds, const char* what, bool positive) {
  if (!std::isfinite(seconds) || seconds < 0 || (positive && seconds == 0) ||
      seconds > 86400.0 * 365) {
    Raise(absl::InvalidArgumentError(
        absl::StrCat(what, " = ", seconds, " s: must be ",
                     positive ? "> 0" : ">= 0", " and finite")));
  }
  return absl::Seconds(seconds);
}

// One worker: a WorkerClient, its cancellation source and (optionally) its
// metrics endpoint. Thread-safety: one call at a time; a second call from
// another thread while one runs raises FailedPrecondition.
class Client {
 public:
  Client(const std::string& leader, uint64_t n, int rank, double rpc_timeout,
         double step_watchdog_margin, int metrics_port,
         const std::string& metrics_host, const std::string& tls,
         const std::optional<std::filesystem::path>& tls_cert,
         const std::optional<std::filesystem::path>& tls_key,
         const std::optional<std::filesystem::path>& tls_ca,
         const std::optional<std::filesystem::path>& token_file)
      : cancellation_(std::make_shared<Cancellation>()) {
    worker::ClientOptions o;
    // Transport security first (docs/security.md): a bad file is a clear
    // error before anything is bound or dialled; plaintext only when asked.
    {
      if (tls.empty()) {
        Raise(absl::InvalidArgumentError(
            "tls is required: 'mutual' (with tls_cert, tls_key, tls_ca), "
            "'server' (with tls_ca), or 'off' for plaintext on a trusted "
            "network (docs/security.md)"));
      }
      TransportSecurityOptions so;
      absl::StatusOr<TlsMode> mode = ParseTlsMode(tls);
      if (!mode.ok()) {
        Raise(absl::InvalidArgumentError(
            absl::StrCat("tls: ", mode.status().message())));
      }
      so.tls = *mode;
      // None: not given (str or os.PathLike otherwise).
      const auto text = [](const std::optional<std::filesystem::path>& p) {
        return p.has_value() ? p->string() : std::string();
      };
      so.cert_file = text(tls_cert);
      so.key_file = text(tls_key);
      so.ca_file = text(tls_ca);
      so.token_file = text(token_file);
      o.security =
          ValueOrRaise(TransportSecurity::Load(so, SecurityRole::kWorker));
      const std::string warning = o.security->Warning();
      if (!warning.empty()) {
        py::print(absl::StrCat("gtopk: ", warning),
                  py::arg("file") = py::module_::import("sys").attr("stderr"));
      }
    }
    o.leader_address = leader;
    o.n = n;
    o.requested_rank = rank;
    o.rpc_timeout = DurationArg(rpc_timeout, "rpc_timeout", true);
    o.step_watchdog_margin =
        DurationArg(step_watchdog_margin, "step_watchdog_margin", false);
    o.cancellation = cancellation_;
    if (metrics_port < 0 || metrics_port > 65535) {
      Raise(absl::InvalidArgumentError(absl::StrCat(
          "metrics_port must be in [0, 65535] (0: off), got ", metrics_port)));
    }
    // Bound before joining, so that a bad port fails fast (as gtopk-worker).
    if (metrics_port > 0) {
      const std::string address =
          ValueOrRaise(MetricsBindAddress(metrics_host, metrics_port));
      registry_ = std::make_shared<prometheus::Registry>();
      metrics::RegisterBuildInfo(*registry_, "gtopk-python");
      process_metrics_ = std::make_shared<metrics::ProcessCollector>();
      absl::StatusOr<std::unique_ptr<prometheus::Exposer>> started =
          metrics::StartExposer(address);
      if (!started.ok()) {
        Raise(absl::Status(started.status().code(),
                           absl::StrCat("metrics_host=", metrics_host,
                                        " metrics_port=", metrics_port, ": ",
                                        started.status().message())));
      }
      exposer_ = *std::move(started);
      exposer_->RegisterCollectable(registry_);
      exposer_->RegisterCollectable(process_metrics_);
    }
    client_ = ValueOrRaise(RunInterruptibly(
        cancellation_.get(), [&o] { return WorkerClient::Connect(o); }));
    if (registry_ != nullptr) {
      metrics_ = std::make_unique<worker::WorkerMetrics>(
          *registry_, client_->rank(),
          static_cast<uint32_t>(client_->cluster().shards_size()), n);
    }
  }

  ~Client() {
    // Closing streams blocks on gRPC only as long as a cancellation takes.
    py::gil_scoped_release release;
    client_.reset();
  }

  uint32_t rank() { return Get().rank(); }
  uint32_t num_workers() { return Get().cluster().num_workers(); }
  int num_shards() { return Get().cluster().shards_size(); }
  uint64_t n() { return Get().cluster().n(); }
  int64_t next_step() { return Get().next_step(); }
  bool checksum_due() { return Get().checksum_due(); }
  int metrics_port() const {
    return exposer_ ? metrics::BoundPort(*exposer_) : 0;
  }
  py::dict cluster() { return ClusterDict(Get().cluster()); }

  void CheckSettings(std::optional<std::string> mode,
                     std::optional<std::string> selection,
                     std::optional<std::string> selector,
                     std::optional<double> density, std::optional<double> lr,
                     std::optional<double> momentum,
                     std::optional<std::string> momentum_mode,
                     std::optional<double> weight_decay,
                     std::optional<std::string> index_codec,
                     std::optional<std::string> value_codec) {
    ExpectedSettings e;
    e.mode = std::move(mode);
    e.selection = std::move(selection);
    e.selector = std::move(selector);
    e.density = density;
    e.lr = lr;
    e.momentum = momentum;
    e.momentum_mode = std::move(momentum_mode);
    e.weight_decay = weight_decay;
    e.index_codec = std::move(index_codec);
    e.value_codec = std::move(value_codec);
    OkOrRaise(CheckExpectedSettings(e, Get().cluster(), ""));
  }

  int64_t SynchronizeParameters(const py::buffer& params) {
    WorkerClient& c = Get();
    const FloatBuffer p = GetFloats(params, "params", true, c.cluster().n());
    std::unique_lock<std::mutex> lock = Exclusive();
    return ValueOrRaise(RunInterruptibly(cancellation_.get(), [&] {
      return c.SynchronizeParameters(absl::MakeSpan(p.data(), p.size()));
    }));
  }

  py::dict Step(const py::buffer& gradient, const py::buffer& params) {
    WorkerClient& c = Get();
    const uint64_t n = c.cluster().n();
    const FloatBuffer g = GetFloats(gradient, "gradient", false, n);
    const FloatBuffer p = GetFloats(params, "params", true, n);
    std::unique_lock<std::mutex> lock = Exclusive();
    last_ = ValueOrRaise(RunInterruptibly(cancellation_.get(), [&] {
      return c.Step(absl::MakeConstSpan(g.data(), g.size()),
                    absl::MakeSpan(p.data(), p.size()));
    }));
    return StatsDict(*last_);
  }

  // Workers apply: (stats, buffers bytes from rank 0).
  py::tuple AggregateStep(const py::buffer& gradient,
                          const py::buffer& averaged,
                          const std::optional<py::buffer>& params,
                          const py::bytes& buffers, uint64_t state_checksum) {
    WorkerClient& c = Get();
    const uint64_t n = c.cluster().n();
    const FloatBuffer g = GetFloats(gradient, "gradient", false, n);
    const FloatBuffer a = GetFloats(averaged, "averaged", true, n);
    std::optional<FloatBuffer> p;
    if (params.has_value()) p = GetFloats(*params, "params", false, n);
    const std::string in = buffers;
    std::string out;
    std::unique_lock<std::mutex> lock = Exclusive();
    last_ = ValueOrRaise(RunInterruptibly(cancellation_.get(), [&] {
      return c.AggregateStep(absl::MakeConstSpan(g.data(), g.size()),
                             absl::MakeSpan(a.data(), a.size()),
                             p.has_value()
                                 ? absl::MakeConstSpan(p->data(), p->size())
                                 : absl::Span<const float>(),
                             in, &out, state_checksum);
    }));
    return py::make_tuple(StatsDict(*last_), py::bytes(out));
  }

  // Overlapped steps (WorkerClient::BeginOverlappedStep): the buffers are
  // held (their Py_buffer views) until the step is finished or abandoned.
  void BeginOverlappedStep(const py::buffer& gradient,
                           const py::buffer& averaged,
                           const std::optional<py::buffer>& params,
                           const py::bytes& buffers, uint64_t state_checksum) {
    WorkerClient& c = Get();
    const uint64_t n = c.cluster().n();
    std::unique_lock<std::mutex> lock = Exclusive();
    overlap_buffers_.clear();
    overlap_buffers_.push_back(GetFloats(gradient, "gradient", false, n));
    overlap_buffers_.push_back(GetFloats(averaged, "averaged", true, n));
    if (params.has_value()) {
      overlap_buffers_.push_back(GetFloats(*params, "params", false, n));
    }
    const FloatBuffer& g = overlap_buffers_[0];
    const FloatBuffer& a = overlap_buffers_[1];
    const std::string in = buffers;
    absl::Status st;
    {
      py::gil_scoped_release release;
      st = c.BeginOverlappedStep(
          absl::MakeConstSpan(g.data(), g.size()),
          absl::MakeSpan(a.data(), a.size()),
          params.has_value() ? absl::MakeConstSpan(overlap_buffers_[2].data(),
                                                   overlap_buffers_[2].size())
                             : absl::Span<const float>(),
          in, state_checksum);
    }
    if (!st.ok()) {
      overlap_buffers_.clear();
      Raise(st);
    }
  }

  void GradientReady(uint64_t begin, uint64_t end) {
    WorkerClient& c = Get();
    std::unique_lock<std::mutex> lock = Exclusive();
    const absl::Status st = c.GradientReady(begin, end);
    if (!st.ok()) Raise(st);
  }

  py::tuple FinishOverlappedStep() {
    WorkerClient& c = Get();
    std::unique_lock<std::mutex> lock = Exclusive();
    std::string out;
    absl::StatusOr<StepStats> stats = RunInterruptibly(
        cancellation_.get(), [&] { return c.FinishOverlappedStep(&out); });
    {
      py::gil_scoped_release release;
      c.AbandonOverlappedStep();  // a no-op unless interrupted before Finish
    }
    overlap_buffers_.clear();
    last_ = ValueOrRaise(std::move(stats));
    return py::make_tuple(StatsDict(*last_), py::bytes(out));
  }

  void AbandonOverlappedStep() {
    WorkerClient& c = Get();
    std::unique_lock<std::mutex> lock = Exclusive();
    {
      py::gil_scoped_release release;
      c.AbandonOverlappedStep();
    }
    overlap_buffers_.clear();
  }

  bool OverlappedStepOpen() { return Get().overlapped_step_open(); }
  bool ServersTakePushParts() { return Get().servers_take_push_parts(); }

  std::vector<std::pair<uint64_t, uint64_t>> BucketPieces() {
    std::vector<std::pair<uint64_t, uint64_t>> out;
    for (const BucketPiece& p : Get().bucket_pieces()) {
      out.emplace_back(p.begin, p.end);
    }
    return out;
  }

  py::tuple SynchronizeWithState(const py::buffer& params,
                                 const py::bytes& state) {
    WorkerClient& c = Get();
    const FloatBuffer p = GetFloats(params, "params", true, c.cluster().n());
    std::string blob = state;
    std::unique_lock<std::mutex> lock = Exclusive();
    const int64_t step =
        ValueOrRaise(RunInterruptibly(cancellation_.get(), [&] {
          return c.SynchronizeParameters(absl::MakeSpan(p.data(), p.size()),
                                         &blob);
        }));
    return py::make_tuple(step, py::bytes(blob));
  }

  int64_t ResumeAt(int64_t step) {
    WorkerClient& c = Get();
    std::unique_lock<std::mutex> lock = Exclusive();
    return ValueOrRaise(RunInterruptibly(cancellation_.get(),
                                         [&] { return c.ResumeAt(step); }));
  }

  py::dict StepCuda(uintptr_t gradient, uintptr_t params, uint64_t n,
                    uintptr_t stream) {
#if GTOPK_HAVE_CUDA
    WorkerClient& c = Get();
    if (gradient == 0 || params == 0) {
      Raise(absl::InvalidArgumentError(
          "step_cuda: null gradient or params pointer"));
    }
    std::unique_lock<std::mutex> lock = Exclusive();
    last_ = ValueOrRaise(RunInterruptibly(cancellation_.get(), [&] {
      return c.Step(reinterpret_cast<const float*>(gradient),
                    reinterpret_cast<float*>(params), n,
                    reinterpret_cast<cudaStream_t>(stream));
    }));
    return StatsDict(*last_);
#else
    (void)gradient;
    (void)params;
    (void)n;
    (void)stream;
    Raise(absl::UnimplementedError(
        "step_cuda: this gtopk extension was built without CUDA "
        "(gtopk._gtopk.has_cuda is False); rebuild where nvcc is found"));
#endif
  }

  int64_t Recover(const std::optional<py::buffer>& params,
                  std::optional<double> timeout) {
    WorkerClient& c = Get();
    // Workers apply: nothing is downloaded, params may be None.
    std::optional<FloatBuffer> held;
    if (params.has_value()) {
      held = GetFloats(*params, "params", true, c.cluster().n());
    }
    float* data = held.has_value() ? held->data() : nullptr;
    const size_t size = held.has_value() ? held->size() : 0;
    std::optional<absl::Time> deadline;
    if (timeout.has_value()) {
      deadline = absl::Now() + DurationArg(*timeout, "timeout", true);
    }
    std::unique_lock<std::mutex> lock = Exclusive();
    return ValueOrRaise(RunInterruptibly(cancellation_.get(), [&] {
      const absl::Span<float> span = absl::MakeSpan(data, size);
      return deadline ? c.Recover(span, *deadline) : c.Recover(span);
    }));
  }

  py::dict State() {
    WorkerClient& c = Get();
    std::unique_lock<std::mutex> lock = Exclusive();
    worker::WorkerState s = ValueOrRaise(c.ExportState());
    py::dict d;
    d["step"] = s.next_step;
    const auto size = static_cast<py::ssize_t>(s.residual.size());
    d["residual"] = py::array_t<float>(size, s.residual.data());
    d["velocity"] = py::array_t<float>(size, s.velocity.data());
    return d;
  }

  void LoadState(int64_t step, const py::buffer& residual,
                 const py::buffer& velocity) {
    WorkerClient& c = Get();
    const uint64_t n = c.cluster().n();
    const FloatBuffer r = GetFloats(residual, "residual", false, n);
    const FloatBuffer v = GetFloats(velocity, "velocity", false, n);
    worker::WorkerState s;
    s.next_step = step;
    s.residual.assign(r.data(), r.data() + r.size());
    s.velocity.assign(v.data(), v.data() + v.size());
    std::unique_lock<std::mutex> lock = Exclusive();
    OkOrRaise(c.ImportState(s));
  }

  void RecordMetrics(double compute_seconds, double step_seconds, double loss) {
    if (metrics_ == nullptr || !last_.has_value()) return;
    if (!std::isfinite(compute_seconds) || compute_seconds < 0 ||
        !std::isfinite(step_seconds) || step_seconds < 0) {
      Raise(absl::InvalidArgumentError(absl::StrCat(
          "record_metrics: compute_seconds = ", compute_seconds,
          " and step_seconds = ", step_seconds, " must be finite and >= 0")));
    }
    metrics_->RecordStep(*last_, absl::Seconds(compute_seconds),
                         absl::Seconds(step_seconds), loss);
  }

  void RecordTestAccuracy(double accuracy) {
    if (metrics_ == nullptr) return;
    if (!(accuracy >= 0.0 && accuracy <= 1.0)) {
      Raise(absl::InvalidArgumentError(absl::StrCat(
          "record_test_accuracy: ", accuracy, " is not in [0, 1]")));
    }
    metrics_->RecordTestAccuracy(accuracy);
  }

  void Close() {
    std::unique_lock<std::mutex> lock = Exclusive();
    {
      py::gil_scoped_release release;
      client_.reset();  // abandons an open overlapped step first
    }
    overlap_buffers_.clear();
  }

 private:
  WorkerClient& Get() {
    if (client_ == nullptr) {
      Raise(absl::FailedPreconditionError("the Client is closed"));
    }
    return *client_;
  }

  // The call's exclusive use of the client (WorkerClient is not
  // thread-safe): a concurrent call is refused rather than queued.
  std::unique_lock<std::mutex> Exclusive() {
    std::unique_lock<std::mutex> lock(mu_, std::try_to_lock);
    if (!lock.owns_lock()) {
      Raise(absl::FailedPreconditionError(
          "another call on this Client is in progress (use a Client from "
          "one thread at a time)"));
    }
    return lock;
  }

  std::mutex mu_;
  std::shared_ptr<Cancellation> cancellation_;
  std::shared_ptr<prometheus::Registry> registry_;
  std::shared_ptr<metrics::ProcessCollector> process_metrics_;
  std::unique_ptr<prometheus::Exposer> exposer_;
  std::unique_ptr<WorkerClient> client_;
  std::unique_ptr<worker::WorkerMetrics> metrics_;
  std::optional<StepStats> last_;
  // An open overlapped step's gradient, averaged and params buffers.
  std::vector<FloatBuffer> overlap_buffers_;
};

}  // namespace
}  // namespace python
}  // namespace gtopk

PYBIND11_MODULE(_gtopk, m) {
  using gtopk::python::Client;
  m.doc() =
      "gtopk worker client (worker/client.h) for Python: join a gTop-k "
      "cluster, synchronise parameters, run sparse synchronous steps. "
      "Use gtopk.torch.DistributedOptimizer for PyTorch.";
#if GTOPK_HAVE_CUDA
  m.attr("has_cuda") = true;
#else
  m.attr("has_cuda") = false;
#endif
  m.def(
      "checksum",
      [](const py::buffer& b) {
        const gtopk::python::FloatBuffer f =
            gtopk::python::GetFloats(b, "checksum", false, std::nullopt);
        return gtopk::ChecksumText(
            gtopk::Fnv1a64(f.data(), f.size() * sizeof(float)));
      },
      py::arg("values"),
      "FNV-1a 64 of a float32 buffer's bytes as 16 hex digits: the replica "
      "checksum gtopk-worker's summary reports.");
  m.def(
      "params_checksum",
      [](const py::buffer& b) {
        const gtopk::python::FloatBuffer f =
            gtopk::python::GetFloats(b, "params_checksum", false, std::nullopt);
        uint64_t h;
        {
          py::gil_scoped_release release;
          h = gtopk::ParamsChecksum(absl::MakeConstSpan(f.data(), f.size()));
        }
        return h;
      },
      py::arg("values"),
      "The divergence alarm's checksum (common/checksum.h ParamsChecksum) of "
      "a float32 buffer, as an int: one read pass, never 0.");
  py::class_<Client>(m, "Client", R"doc(
One gtopk worker (worker/client.h WorkerClient): joins the cluster through
the leader, keeps the residual (error feedback) and momentum state, and runs
one synchronous gTop-k step per call (Shi et al., ICDCS 2019,
arXiv:1901.04359; momentum correction from DGC, arXiv:1712.01887).

Buffers are C-contiguous float32 buffers of length n (numpy arrays,
tensor.numpy()); params are updated in place. Every blocking call releases
the GIL and is interrupted by Ctrl-C within 50 ms (KeyboardInterrupt; the
RPCs in flight are cancelled, nothing is applied). Errors raise
gtopk.errors.Error subclasses carrying the status code and the servers'
message. Not thread-safe: one call at a time (a concurrent call raises
FailedPrecondition).)doc")
      .def(py::init<const std::string&, uint64_t, int, double, double, int,
                    const std::string&, const std::string&,
                    const std::optional<std::filesystem::path>&,
                    const std::optional<std::filesystem::path>&,
                    const std::optional<std::filesystem::path>&,
                    const std::optional<std::filesystem::path>&>(),
           py::arg("leader"), py::arg("n"), py::arg("rank") = -1,
           py::arg("rpc_timeout") = 30.0, py::arg("step_watchdog_margin") = 2.0,
           py::arg("metrics_port") = 0, py::arg("metrics_host") = "0.0.0.0",
           py::kw_only(), py::arg("tls"), py::arg("tls_cert") = py::none(),
           py::arg("tls_key") = py::none(), py::arg("tls_ca") = py::none(),
           py::arg("token_file") = py::none(),
           "Joins the cluster at `leader` (host:port) with n parameters and "
           "the requested rank (-1: any). Blocks up to rpc_timeout seconds "
           "per RPC. metrics_port > 0 serves the worker metrics "
           "(docs/metrics.md) there. Transport security (docs/security.md), "
           "as gtopk-worker's flags: tls is required, 'mutual' (tls_cert, "
           "tls_key: this worker's PEM certificate, CN gtopk-worker or "
           "gtopk-worker-<rank>, and key; tls_ca: the PEM CA bundle the "
           "shards' certificates chain to), 'server' (tls_ca) or 'off' "
           "(plaintext: a WARNING on stderr); token_file: a file holding "
           "the workers' shared token (never the token itself). The files "
           "are read once, here. Raises InvalidArgument for bad arguments "
           "or security files (unreadable, not PEM, expired, key not "
           "matching, not signed by tls_ca), FailedPrecondition for "
           "another n or a taken rank, DeadlineExceeded/Unavailable when "
           "the leader cannot be reached (also when the TLS handshake is "
           "refused), Unauthenticated/PermissionDenied when the servers "
           "refuse the credentials.")
      .def_property_readonly("rank", &Client::rank)
      .def_property_readonly("num_workers", &Client::num_workers)
      .def_property_readonly("num_shards", &Client::num_shards)
      .def_property_readonly("n", &Client::n)
      .def_property_readonly("next_step", &Client::next_step)
      .def_property_readonly("checksum_due", &Client::checksum_due,
                             "Whether the next step sends a parameter "
                             "checksum (then aggregate_step needs params).")
      .def_property_readonly("metrics_port", &Client::metrics_port)
      .def("cluster", &Client::cluster,
           "The cluster spec from Join as a dict (mode, selector, density, "
           "lr, momentum, momentum_mode, shards, ...).")
      .def("check_settings", &Client::CheckSettings, py::kw_only(),
           py::arg("mode") = py::none(), py::arg("selection") = py::none(),
           py::arg("selector") = py::none(), py::arg("density") = py::none(),
           py::arg("lr") = py::none(), py::arg("momentum") = py::none(),
           py::arg("momentum_mode") = py::none(),
           py::arg("weight_decay") = py::none(),
           py::arg("index_codec") = py::none(),
           py::arg("value_codec") = py::none(),
           "Raises FailedPrecondition naming the first given setting the "
           "servers' cluster spec does not have (gtopk-worker's check).")
      .def("synchronize_parameters", &Client::SynchronizeParameters,
           py::arg("params"),
           "Rank 0 offers params as the initial values; then every rank "
           "downloads the servers' parameters into params. Returns the step "
           "to continue from.")
      .def("step", &Client::Step, py::arg("gradient"), py::arg("params"),
           "One synchronous step with a host gradient (length n, finite, "
           "not scaled by lr); params updated in place. Returns the step's "
           "stats dict (bytes per shard, phase seconds). On error nothing is "
           "applied and the residual keeps the gradient.")
      .def("aggregate_step", &Client::AggregateStep, py::arg("gradient"),
           py::arg("averaged"), py::arg("params") = py::none(),
           py::arg("buffers") = py::bytes(), py::arg("state_checksum") = 0,
           "Workers apply (--apply=workers): one synchronous step that "
           "returns the averaged gradient instead of applying it. gradient: "
           "host float32 length n (read); averaged: length n, may be the "
           "same buffer, set on success to A/P at the global top-k and 0 "
           "elsewhere; params: this replica's parameters, for the "
           "divergence checksum every checksum_every steps; buffers: rank "
           "0's opaque bytes broadcast through shard 0. Returns (stats, "
           "rank 0's buffers of this step). On error nothing is written "
           "and the residual keeps the gradient (retry with zeros).")
      .def("begin_overlapped_step", &Client::BeginOverlappedStep,
           py::arg("gradient"), py::arg("averaged"),
           py::arg("params") = py::none(), py::arg("buffers") = py::bytes(),
           py::arg("state_checksum") = 0,
           "--selection=layerwise, workers apply: opens an overlapped step "
           "(aggregate_step cut in three). The buffers as aggregate_step's, "
           "held by the Client until the step ends; gradient need not be "
           "final yet: fill it range by range and call gradient_ready after "
           "each (e.g. from autograd hooks). Each bucket piece is selected "
           "and each shard's push sent as soon as its values are in.")
      .def("gradient_ready", &Client::GradientReady, py::arg("begin"),
           py::arg("end"),
           "gradient[begin:end] is final (each value reported once per "
           "step). Does not block.")
      .def("finish_overlapped_step", &Client::FinishOverlappedStep,
           "Ends the open step (values never reported are taken as they "
           "are) and waits for its round. Returns (stats, rank 0's "
           "buffers); stats['exposed_seconds'] is the wait here. Errors as "
           "aggregate_step's.")
      .def("abandon_overlapped_step", &Client::AbandonOverlappedStep,
           "Gives up the open step (an error in the backward pass): the "
           "residual is as before it; other workers' step fails and is "
           "retried after recover. No-op without an open step.")
      .def_property_readonly("overlapped_step_open",
                             &Client::OverlappedStepOpen)
      .def_property_readonly(
          "servers_take_push_parts", &Client::ServersTakePushParts,
          "Whether every shard said, when this client connected, that it "
          "takes pushes in parts (rounds per bucket); False: overlapped "
          "steps push each shard's entries whole (docs/overlap.md).")
      .def_property_readonly("bucket_pieces", &Client::BucketPieces,
                             "The layer-wise pieces [(begin, end), ...] in "
                             "index order; empty unless the cluster's "
                             "selection is layerwise.")
      .def("synchronize_with_state", &Client::SynchronizeWithState,
           py::arg("params"), py::arg("state"),
           "Workers apply: synchronize_parameters plus rank 0's opaque "
           "state bytes (buffers, frozen parameters). Returns (step, the "
           "state shard 0 holds).")
      .def("resume_at", &Client::ResumeAt, py::arg("step"),
           "Workers apply: the shards' next step becomes `step` (a run "
           "restarted from the workers' checkpoints of that step).")
      .def("step_cuda", &Client::StepCuda, py::arg("gradient_ptr"),
           py::arg("params_ptr"), py::arg("n"), py::arg("stream"),
           "The step with CUDA device pointers (tensor.data_ptr()) on "
           "`stream` (torch.cuda.current_stream().cuda_stream). Raises "
           "Unimplemented when has_cuda is False.")
      .def("recover", &Client::Recover, py::arg("params"),
           py::arg("timeout") = py::none(),
           "After a failed step: brings the shards to one step (re-"
           "downloading params when needed) and returns the step to "
           "continue from. timeout in seconds (default: rpc_timeout + the "
           "cluster's step timeout).")
      .def("state", &Client::State,
           "{'step', 'residual', 'velocity'}: copies of the worker's state "
           "(float32 arrays of length n) for checkpoints.")
      .def("load_state", &Client::LoadState, py::arg("step"),
           py::arg("residual"), py::arg("velocity"),
           "Restores state() output; step must equal next_step "
           "(FailedPrecondition otherwise).")
      .def("record_metrics", &Client::RecordMetrics, py::arg("compute_seconds"),
           py::arg("step_seconds"), py::arg("loss"),
           "Records the last step in the worker metrics (no-op when "
           "metrics_port was 0).")
      .def("record_test_accuracy", &Client::RecordTestAccuracy,
           py::arg("accuracy"))
      .def("close", &Client::Close,
           "Closes the streams; later calls raise FailedPrecondition.");
}
