// The CUDA device check (issue 5), built by bench/cuda/device_check.sh with
// nvcc alone (no Abseil, gRPC or GoogleTest on the GPU machine).
//
// For every n and density it
//  1. checks the GPU selectors against a plain CPU reference on normal
//     inputs: `exact` must equal the reference top-k bit for bit (same
//     indices, same value bits, ties to the lower index) and zero exactly the
//     selected residual entries; gaussiank/dgc must keep their count
//     contracts ([ceil(2k/3), floor(4k/3)] or k; [1, k]), return valid
//     (index-ascending, value-exact) pairs that form a threshold set
//     (every selected |u| >= every unselected |u|) and zero exactly those;
//     the fused update must equal the CPU rule's arithmetic and its
//     histogram-reusing selection the reference on the updated u;
//  2. unless --check-only, times each selector with CUDA events (median of
//     --iters after --warmup), a device-to-device copy of the same bytes
//     (one read = half of it) and, from --torch-json, torch.topk(g.abs(), k);
//  3. writes --json and prints a table.
// Exit status: 0 all correct, 1 a correctness failure, 2 usage, 3 no device.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "common/cuda/cuda_status.h"
#include "common/cuda/sparsify.h"

namespace {

using gtopk::cuda::DeviceBuffer;
using gtopk::cuda::Method;
using gtopk::cuda::Selection;
using gtopk::cuda::SelectParams;
using gtopk::cuda::Sparsifier;
using gtopk::cuda::Status;
using gtopk::cuda::UpdateParams;

struct Options {
  std::vector<uint64_t> sizes = {1, 1000, 25557032, 138357544};
  std::vector<double> densities = {0.0001, 0.001, 0.01};
  int iters = 30;
  int warmup = 5;
  std::string json = "cuda_select.json";
  std::string torch_json;  // optional torch.topk/copy timings
  std::string command;
  uint64_t seed = 1;
  bool no_device_ok = false;  // --allow-no-device: exit 0 without a GPU
  bool check_only = false;    // --check-only: correctness, no timing rows
};

bool ParseList(const std::string& text, std::vector<double>* out) {
  out->clear();
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ',')) {
    char* end = nullptr;
    const double v = std::strtod(item.c_str(), &end);
    if (item.empty() || *end != '\0') return false;
    out->push_back(v);
  }
  return !out->empty();
}

void Usage() {
  std::fprintf(stderr,
               "usage: device_check [--sizes=N,N,...] [--densities=D,...] "
               "[--iters=I>=20] [--warmup=W] [--json=PATH] "
               "[--torch-json=PATH] [--seed=S] [--allow-no-device] "
               "[--check-only]\n");
}

bool ParseArgs(int argc, char** argv, Options* o) {
  for (int i = 0; i < argc; ++i) {
    if (i > 0) o->command += " ";
    o->command += argv[i];
  }
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const size_t eq = a.find('=');
    const std::string key = a.substr(0, eq);
    const std::string value = eq == std::string::npos ? "" : a.substr(eq + 1);
    std::vector<double> list;
    if (key == "--sizes" && ParseList(value, &list)) {
      o->sizes.clear();
      for (double v : list) {
        if (!(v >= 1 && v <= 4294967296.0) || v != std::floor(v)) return false;
        o->sizes.push_back(static_cast<uint64_t>(v));
      }
    } else if (key == "--densities" && ParseList(value, &list)) {
      for (double v : list) {
        if (!(v > 0 && v <= 1)) return false;
      }
      o->densities = list;
    } else if (key == "--iters" && !value.empty()) {
      o->iters = std::atoi(value.c_str());
      if (o->iters < 20 || o->iters > 10000) return false;
    } else if (key == "--warmup" && !value.empty()) {
      o->warmup = std::atoi(value.c_str());
      if (o->warmup < 1 || o->warmup > 1000) return false;
    } else if (key == "--json" && !value.empty()) {
      o->json = value;
    } else if (key == "--torch-json") {
      o->torch_json = value;
    } else if (key == "--seed" && !value.empty()) {
      o->seed = std::strtoull(value.c_str(), nullptr, 10);
    } else if (key == "--allow-no-device" && value.empty()) {
      o->no_device_ok = true;
    } else if (key == "--check-only" && value.empty()) {
      o->check_only = true;
    } else {
      std::fprintf(stderr, "device_check: bad argument '%s'\n", a.c_str());
      return false;
    }
  }
  return true;
}

std::string JsonEscape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof(buf), "\\u%04x", c);
      out += buf;
    } else {
      out += c;
    }
  }
  return out;
}

std::string Num(double v) {
  if (!std::isfinite(v)) return "null";
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.6g", v);
  return buf;
}

// torch timings: {"available": bool, "version": str, "note": str,
// "rows": [{"n":..,"density":..,"k":..,"topk_us":..,"copy_us":..}]}.
// A tiny reader for exactly what bench/cuda/torch_topk.py writes.
struct TorchTimings {
  bool available = false;
  std::string version, note, raw;
  std::map<std::pair<uint64_t, long long>, double> topk_us;  // (n, density*1e6)
  std::map<uint64_t, double> copy_us;
};

long long DensityKey(double d) { return std::llround(d * 1e6); }

bool FindNumber(const std::string& obj, const std::string& field, double* v) {
  const size_t p = obj.find("\"" + field + "\"");
  if (p == std::string::npos) return false;
  const size_t colon = obj.find(':', p);
  if (colon == std::string::npos) return false;
  char* end = nullptr;
  *v = std::strtod(obj.c_str() + colon + 1, &end);
  return end != obj.c_str() + colon + 1;
}

std::string FindString(const std::string& obj, const std::string& field) {
  const size_t p = obj.find("\"" + field + "\"");
  if (p == std::string::npos) return "";
  const size_t q1 = obj.find('"', obj.find(':', p) + 1);
  if (q1 == std::string::npos) return "";
  const size_t q2 = obj.find('"', q1 + 1);
  return q2 == std::string::npos ? "" : obj.substr(q1 + 1, q2 - q1 - 1);
}

TorchTimings ReadTorch(const std::string& path) {
  TorchTimings t;
  if (path.empty()) {
    t.note = "no --torch-json given";
    return t;
  }
  std::ifstream in(path);
  if (!in) {
    t.note = "torch timings file missing: " + path;
    return t;
  }
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string text = ss.str();
  t.available = text.find("\"available\": true") != std::string::npos;
  t.version = FindString(text, "version");
  t.note = FindString(text, "note");
  size_t pos = text.find("\"rows\"");
  while (pos != std::string::npos) {
    const size_t open = text.find('{', pos);
    if (open == std::string::npos) break;
    const size_t close = text.find('}', open);
    if (close == std::string::npos) break;
    const std::string obj = text.substr(open, close - open + 1);
    double n = 0, d = 0, topk = 0, copy = 0;
    if (FindNumber(obj, "n", &n) && FindNumber(obj, "density", &d)) {
      if (FindNumber(obj, "topk_us", &topk)) {
        t.topk_us[{static_cast<uint64_t>(n), DensityKey(d)}] = topk;
      }
      if (FindNumber(obj, "copy_us", &copy)) {
        t.copy_us[static_cast<uint64_t>(n)] = copy;
      }
    }
    pos = close + 1;
  }
  return t;
}

// ---------------------------------------------------------------------------

// A failed CUDA call or selector status: recorded as a failure of the
// (n, density, method) being run, so a fault still leaves a JSON behind.
struct Fatal : std::runtime_error {
  using std::runtime_error::runtime_error;
};

#define CHECK_CUDA(call)                                                   \
  do {                                                                     \
    const cudaError_t e_ = (call);                                         \
    if (e_ != cudaSuccess) {                                               \
      throw Fatal(std::string(__FILE__) + ":" + std::to_string(__LINE__) + \
                  ": " + #call + ": " + cudaGetErrorString(e_));           \
    }                                                                      \
  } while (0)

#define CHECK_OK(expr)                                                     \
  do {                                                                     \
    const Status s_ = (expr);                                              \
    if (!s_.ok()) {                                                        \
      throw Fatal(std::string(__FILE__) + ":" + std::to_string(__LINE__) + \
                  ": " + #expr + ": " + s_.message);                       \
    }                                                                      \
  } while (0)

inline uint32_t KeyOf(float x) {
  uint32_t b;
  std::memcpy(&b, &x, 4);
  return b & 0x7fffffffu;
}
inline uint32_t BitsOf(float x) {
  uint32_t b;
  std::memcpy(&b, &x, 4);
  return b;
}

// Seeded normal floats, generated in parallel chunks (deterministic for a
// seed whatever the thread count).
std::vector<float> NormalInput(uint64_t n, uint64_t seed) {
  std::vector<float> x(n);
  const uint64_t chunk = uint64_t{1} << 20;
  const uint64_t chunks = (n + chunk - 1) / chunk;
  const unsigned threads =
      std::max(1u, std::min(16u, std::thread::hardware_concurrency()));
  std::vector<std::thread> pool;
  for (unsigned t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      for (uint64_t c = t; c < chunks; c += threads) {
        uint64_t s = seed * 0x9e3779b97f4a7c15ull + c + 1;
        auto next = [&s] {  // SplitMix64
          uint64_t z = (s += 0x9e3779b97f4a7c15ull);
          z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
          z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
          return z ^ (z >> 31);
        };
        const uint64_t end = std::min(n, (c + 1) * chunk);
        for (uint64_t i = c * chunk; i < end; i += 2) {
          const double u1 = ((next() >> 11) + 1.0) * (1.0 / 9007199254740993.0);
          const double u2 = (next() >> 11) * (1.0 / 9007199254740992.0);
          const double r = std::sqrt(-2.0 * std::log(u1));
          x[i] = static_cast<float>(r * std::cos(6.283185307179586 * u2));
          if (i + 1 < end) {
            x[i + 1] = static_cast<float>(r * std::sin(6.283185307179586 * u2));
          }
        }
      }
    });
  }
  for (auto& th : pool) th.join();
  return x;
}

// The reference: the k-th largest key T by nth_element, then in index order
// every key > T and the first (k - #{key > T}) keys == T.
void ReferenceTopK(const std::vector<float>& u, uint64_t k,
                   std::vector<uint32_t>* idx) {
  std::vector<uint32_t> keys(u.size());
  for (size_t i = 0; i < u.size(); ++i) keys[i] = KeyOf(u[i]);
  std::nth_element(keys.begin(), keys.begin() + (k - 1), keys.end(),
                   std::greater<uint32_t>());
  const uint32_t t = keys[k - 1];
  uint64_t greater = 0;
  for (float v : u) greater += KeyOf(v) > t;
  uint64_t ties = k - greater;
  idx->clear();
  idx->reserve(k);
  for (size_t i = 0; i < u.size(); ++i) {
    const uint32_t key = KeyOf(u[i]);
    if (key > t || (key == t && ties > 0)) {
      if (key == t) --ties;
      idx->push_back(static_cast<uint32_t>(i));
    }
  }
}

struct Row {
  uint64_t n;
  double density;
  uint64_t k;
  std::string method;
  double us;
  double min_us;
  uint64_t count;
  // Host wall time from Select to Wait's return (median; NAN when not
  // measured): includes what Wait finishes and the synchronisation.
  double wall_us = NAN;
  // gaussiank/dgc: share of the timed selections that took the fast path
  // (no host round trip); NAN for the others.
  double fast_path = NAN;
};

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? NAN : v[v.size() / 2];
}

// Checks one selection; returns "" or what failed.
std::string CheckSelection(const std::string& method,
                           const std::vector<float>& u,
                           const std::vector<float>& after, uint64_t k,
                           const Selection& sel,
                           const std::vector<uint32_t>& reference) {
  const uint64_t n = u.size();
  const Method m = method == "exact"       ? Method::kExact
                   : method == "gaussiank" ? Method::kGaussianK
                                           : Method::kDgc;
  std::ostringstream err;
  if (sel.count < gtopk::cuda::MinCount(m, k) ||
      sel.count > gtopk::cuda::MaxCount(m, k)) {
    err << "count " << sel.count << " outside [" << gtopk::cuda::MinCount(m, k)
        << ", " << gtopk::cuda::MaxCount(m, k) << "]";
    return err.str();
  }
  std::vector<char> chosen(n, 0);
  uint32_t min_chosen = 0xffffffffu;
  for (uint64_t j = 0; j < sel.count; ++j) {
    const uint32_t i = sel.indices[j];
    if (i >= n || (j > 0 && i <= sel.indices[j - 1])) {
      err << "indices not ascending/in range at position " << j;
      return err.str();
    }
    if (BitsOf(sel.values[j]) != BitsOf(u[i])) {
      err << "value at index " << i << " differs from u";
      return err.str();
    }
    chosen[i] = 1;
    min_chosen = std::min(min_chosen, KeyOf(u[i]));
  }
  uint32_t max_other = 0;
  for (uint64_t i = 0; i < n; ++i) {
    const uint32_t want = chosen[i] ? 0u : BitsOf(u[i]);
    if (BitsOf(after[i]) != want) {
      err << "residual at index " << i << " is not "
          << (chosen[i] ? "+0.0 (selected)" : "unchanged");
      return err.str();
    }
    if (!chosen[i]) max_other = std::max(max_other, KeyOf(u[i]));
  }
  if (sel.count < n && min_chosen < max_other) {
    err << "not a threshold set: selected key " << min_chosen
        << " < unselected key " << max_other;
    return err.str();
  }
  if (m == Method::kExact) {
    if (reference.size() != sel.count) return "reference size differs";
    for (uint64_t j = 0; j < sel.count; ++j) {
      if (reference[j] != sel.indices[j]) {
        err << "differs from the reference at position " << j << ": "
            << sel.indices[j] << " vs " << reference[j];
        return err.str();
      }
    }
  }
  return "";
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  if (!ParseArgs(argc, argv, &o)) {
    Usage();
    return 2;
  }
  const TorchTimings torch = ReadTorch(o.torch_json);
  int devices = 0;
  const cudaError_t dev_err = cudaGetDeviceCount(&devices);
  std::string gpu = "none";
  if (dev_err == cudaSuccess && devices > 0) {
    cudaDeviceProp prop;
    if (cudaGetDeviceProperties(&prop, 0) == cudaSuccess) gpu = prop.name;
  }
  std::vector<Row> rows;
  std::vector<std::string> failures;
  std::map<uint64_t, double> copy_us;
  int checks = 0;

  if (devices > 0) {
    try {
      cudaStream_t stream;
      CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
      cudaEvent_t start, stop;
      CHECK_CUDA(cudaEventCreate(&start));
      CHECK_CUDA(cudaEventCreate(&stop));
      const uint64_t max_n = *std::max_element(o.sizes.begin(), o.sizes.end());
      std::unique_ptr<Sparsifier> sp;
      CHECK_OK(Sparsifier::Create(max_n, &sp));
      DeviceBuffer<float> d_pristine, d_u, d_velocity, d_residual;
      CHECK_OK(d_pristine.Allocate(max_n));
      CHECK_OK(d_u.Allocate(max_n));
      CHECK_OK(d_velocity.Allocate(max_n));
      CHECK_OK(d_residual.Allocate(max_n));

      // CUDA events around body() (the device work it enqueues); with
      // `wall`, also the host time from body() to the end of after(), the
      // stream drained first so that before()'s work is not counted.
      auto time_us = [&](const std::function<void()>& before,
                         const std::function<void()>& body,
                         const std::function<void()>& after,
                         std::vector<double>* samples,
                         std::vector<double>* wall = nullptr) {
        for (int it = 0; it < o.warmup + o.iters; ++it) {
          before();
          if (wall != nullptr) CHECK_CUDA(cudaStreamSynchronize(stream));
          const auto w0 = std::chrono::steady_clock::now();
          CHECK_CUDA(cudaEventRecord(start, stream));
          body();
          CHECK_CUDA(cudaEventRecord(stop, stream));
          after();
          const auto w1 = std::chrono::steady_clock::now();
          CHECK_CUDA(cudaEventSynchronize(stop));
          float ms = 0;
          CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
          if (it >= o.warmup) {
            samples->push_back(ms * 1000.0);
            if (wall != nullptr) {
              wall->push_back(
                  std::chrono::duration<double, std::micro>(w1 - w0).count());
            }
          }
        }
      };

      for (uint64_t n : o.sizes) {
        try {
          const auto t0 = std::chrono::steady_clock::now();
          const std::vector<float> u = NormalInput(n, o.seed + n);
          // On `stream`, not with cudaMemcpy: that runs on the legacy default
          // stream, which a cudaStreamNonBlocking stream does not wait for,
          // and a pageable host-to-device cudaMemcpy may return before its
          // last DMA lands (CUDA's "API synchronization behavior"), so the
          // copies from d_pristine below could read a stale tail.
          CHECK_CUDA(cudaMemcpyAsync(d_pristine.get(), u.data(),
                                     n * sizeof(float), cudaMemcpyHostToDevice,
                                     stream));
          CHECK_CUDA(cudaStreamSynchronize(stream));
          // The copy baseline: n floats device to device (read + write).
          if (!o.check_only) {
            std::vector<double> s;
            time_us([] {},
                    [&] {
                      CHECK_CUDA(cudaMemcpyAsync(
                          d_u.get(), d_pristine.get(), n * sizeof(float),
                          cudaMemcpyDeviceToDevice, stream));
                    },
                    [] {}, &s);
            copy_us[n] = Median(s);
          }
          // The update's result with zero residual/velocity: u' = 0 + lr*(0*0 +
          // (g
          // + 0)).
          const float lr = 0.5f;
          std::vector<float> updated(n);
          for (uint64_t i = 0; i < n; ++i) {
            const float g = u[i] + 0.0f;
            const float mv = 0.9f * 0.0f;
            const float v = mv + g;
            const float lv = lr * v;
            updated[i] = 0.0f + lv;
          }
          std::vector<float> after(n);
          for (double density : o.densities) {
            uint64_t k = static_cast<uint64_t>(std::llround(density * n));
            k = std::max<uint64_t>(1, std::min<uint64_t>(k, n));
            std::vector<uint32_t> reference, reference_updated;
            ReferenceTopK(u, k, &reference);
            ReferenceTopK(updated, k, &reference_updated);
            for (const char* method : {"exact", "gaussiank", "dgc"}) {
              std::fprintf(stderr, "device_check: n=%llu density=%g %s\n",
                           static_cast<unsigned long long>(n), density, method);
              try {
                SelectParams p;
                p.method = std::string(method) == "exact" ? Method::kExact
                           : std::string(method) == "gaussiank"
                               ? Method::kGaussianK
                               : Method::kDgc;
                p.k = k;
                p.seed = o.seed;
                p.zero_selected = true;
                // Correctness on a fresh copy.
                Selection sel;
                CHECK_CUDA(cudaMemcpyAsync(d_u.get(), d_pristine.get(),
                                           n * sizeof(float),
                                           cudaMemcpyDeviceToDevice, stream));
                CHECK_OK(sp->Select(d_u.get(), n, p, stream));
                const Status waited = sp->Wait(stream, &sel);
                ++checks;
                std::string bad;
                if (!waited.ok()) {
                  bad = waited.message;
                } else {
                  CHECK_CUDA(cudaMemcpy(after.data(), d_u.get(),
                                        n * sizeof(float),
                                        cudaMemcpyDeviceToHost));
                  bad = CheckSelection(method, u, after, k, sel, reference);
                }
                if (!bad.empty()) {
                  failures.push_back(std::string(method) +
                                     " n=" + std::to_string(n) +
                                     " density=" + Num(density) + ": " + bad);
                }
                // Timing: from u in device memory to the pairs in pinned host
                // memory (includes the first histogram pass).
                // gaussiank/dgc: `us` covers their fast path; what Wait
                // finishes otherwise is only in wall_us (fast_path says how
                // often that was needed).
                std::vector<double> s, wall;
                uint64_t count = 0;
                int fast = 0, timed = 0;
                const bool has_fast_path = p.method != Method::kExact;
                auto wait_selection = [&] {
                  Selection t;
                  CHECK_OK(sp->Wait(stream, &t));
                  count = t.count;
                  fast += t.info.fast_path ? 1 : 0;
                  ++timed;
                };
                if (!o.check_only) {
                  time_us(
                      [&] {
                        CHECK_CUDA(cudaMemcpyAsync(
                            d_u.get(), d_pristine.get(), n * sizeof(float),
                            cudaMemcpyDeviceToDevice, stream));
                      },
                      [&] {
                        // A new step each time, as in training (dgc's
                        // sample, hence its path, depends on it).
                        ++p.step;
                        CHECK_OK(sp->Select(d_u.get(), n, p, stream));
                      },
                      wait_selection, &s, &wall);
                  Row row{n, density, k, method, Median(s),
                          *std::min_element(s.begin(), s.end()), count};
                  row.wall_us = Median(wall);
                  if (has_fast_path) row.fast_path = double(fast) / timed;
                  rows.push_back(row);
                }

                if (p.method == Method::kDgc)
                  continue;  // dgc needs no histogram
                // After the fused update: the histogram comes with it.
                UpdateParams up;
                up.lr = lr;
                up.momentum = 0.9f;
                up.momentum_correction = true;
                auto reset = [&] {
                  CHECK_CUDA(cudaMemsetAsync(d_velocity.get(), 0,
                                             n * sizeof(float), stream));
                  CHECK_CUDA(cudaMemsetAsync(d_residual.get(), 0,
                                             n * sizeof(float), stream));
                };
                auto update = [&] {
                  CHECK_OK(sp->Accumulate(d_pristine.get(), nullptr,
                                          d_velocity.get(), d_velocity.get(),
                                          d_residual.get(), d_residual.get(), n,
                                          up, stream));
                };
                reset();
                update();
                CHECK_OK(sp->Select(d_residual.get(), n, p, stream));
                const Status w2 = sp->Wait(stream, &sel);
                ++checks;
                bad.clear();
                if (!w2.ok()) {
                  bad = w2.message;
                } else if (!sel.info.used_update_histogram) {
                  bad = "the update's histogram was not reused";
                } else {
                  CHECK_CUDA(cudaMemcpy(after.data(), d_residual.get(),
                                        n * sizeof(float),
                                        cudaMemcpyDeviceToHost));
                  bad = CheckSelection(method, updated, after, k, sel,
                                       reference_updated);
                }
                if (!bad.empty()) {
                  failures.push_back(std::string(method) +
                                     "+update n=" + std::to_string(n) +
                                     " density=" + Num(density) + ": " + bad);
                }
                if (o.check_only) continue;
                s.clear();
                wall.clear();
                fast = timed = 0;
                time_us(
                    [&] {
                      reset();
                      update();
                    },
                    [&] {
                      ++p.step;
                      CHECK_OK(sp->Select(d_residual.get(), n, p, stream));
                    },
                    wait_selection, &s, &wall);
                Row row{n,         density,
                        k,         std::string(method) + "_after_update",
                        Median(s), *std::min_element(s.begin(), s.end()),
                        count};
                row.wall_us = Median(wall);
                if (has_fast_path) row.fast_path = double(fast) / timed;
                rows.push_back(row);
                if (p.method == Method::kExact) {
                  s.clear();
                  time_us(
                      [&] { reset(); }, [&] { update(); },
                      [&] {
                        // Consume the histogram so the next Accumulate is
                        // clean.
                        CHECK_OK(sp->Select(d_residual.get(), n, p, stream));
                        Selection t;
                        CHECK_OK(sp->Wait(stream, &t));
                      },
                      &s);
                  rows.push_back({n, density, k, "fused_update", Median(s),
                                  *std::min_element(s.begin(), s.end()), 0});
                }
              } catch (const Fatal& e) {
                failures.push_back(
                    std::string(method) + " n=" + std::to_string(n) +
                    " density=" + Num(density) + ": " + e.what());
                std::fprintf(stderr, "device_check: FAILED %s\n", e.what());
                Selection ignored;
                sp->Wait(stream,
                         &ignored);  // clear a pending selection, if any
              }
            }
          }
          const double secs = std::chrono::duration<double>(
                                  std::chrono::steady_clock::now() - t0)
                                  .count();
          std::fprintf(stderr, "device_check: n=%llu done in %.1f s\n",
                       static_cast<unsigned long long>(n), secs);
        } catch (const Fatal& e) {
          failures.push_back("n=" + std::to_string(n) + ": " + e.what());
          std::fprintf(stderr, "device_check: FAILED %s\n", e.what());
        }
      }
      cudaStreamDestroy(stream);
    } catch (const Fatal& e) {
      failures.push_back(std::string("set-up: ") + e.what());
      std::fprintf(stderr, "device_check: FAILED %s\n", e.what());
    }
  } else {
    std::fprintf(
        stderr,
        "device_check: no CUDA device (%s); writing a JSON without "
        "measurements\n",
        dev_err == cudaSuccess ? "0 devices" : cudaGetErrorString(dev_err));
    cudaGetLastError();
  }

  // Table and JSON.
  std::ostringstream js;
  js << "{\n  \"command\": \"" << JsonEscape(o.command) << "\",\n"
     << "  \"gpu\": \"" << JsonEscape(gpu) << "\",\n"
     << "  \"device_present\": " << (devices > 0 ? "true" : "false") << ",\n"
     << "  \"iters\": " << o.iters << ",\n  \"warmup\": " << o.warmup << ",\n"
     << "  \"input\": \"normal(0,1) fp32, seeded\",\n"
     << "  \"timing\": \"CUDA events, median; selectors: u in device memory "
        "to (index, value) pairs in pinned host memory, residual zeroed; "
        "*_after_update: selection only, histogram from the fused update; "
        "one_read_us = d2d copy of n floats / 2\",\n"
     << "  \"torch\": {\"available\": " << (torch.available ? "true" : "false")
     << ", \"version\": \"" << JsonEscape(torch.version) << "\", \"note\": \""
     << JsonEscape(torch.note) << "\"},\n"
     << "  \"correctness\": {\"checks\": " << checks
     << ", \"failed\": " << failures.size() << ", \"failures\": [";
  for (size_t i = 0; i < failures.size(); ++i) {
    js << (i ? ", " : "") << "\"" << JsonEscape(failures[i]) << "\"";
  }
  js << "]},\n  \"rows\": [";
  std::printf("%12s %9s %24s %10s %10s %5s %12s %12s\n", "n", "density",
              "method", "us", "wall us", "fast", "x one-read", "x torch.topk");
  bool first = true;
  auto emit = [&](uint64_t n, double density, uint64_t k,
                  const std::string& method, double us, double min_us,
                  uint64_t count, double wall_us = NAN,
                  double fast_path = NAN) {
    const double one_read = copy_us.count(n) ? copy_us[n] / 2.0 : NAN;
    const auto it = torch.topk_us.find({n, DensityKey(density)});
    const double torch_us = it == torch.topk_us.end() ? NAN : it->second;
    js << (first ? "" : ",") << "\n    {\"n\": " << n
       << ", \"density\": " << Num(density) << ", \"k\": " << k
       << ", \"method\": \"" << method << "\", \"us\": " << Num(us)
       << ", \"min_us\": " << Num(min_us) << ", \"count\": " << count
       << ", \"wall_us\": " << Num(wall_us)
       << ", \"fast_path_fraction\": " << Num(fast_path)
       << ", \"one_read_us\": " << Num(one_read)
       << ", \"x_one_read\": " << Num(us / one_read)
       << ", \"torch_topk_us\": " << Num(torch_us)
       << ", \"x_torch_topk\": " << Num(us / torch_us) << "}";
    first = false;
    std::printf("%12llu %9g %24s %10.1f %10s %5s %12s %12s\n",
                static_cast<unsigned long long>(n), density, method.c_str(), us,
                std::isfinite(wall_us) ? Num(wall_us).c_str() : "-",
                std::isfinite(fast_path) ? Num(fast_path).c_str() : "-",
                std::isfinite(one_read) ? Num(us / one_read).c_str() : "-",
                std::isfinite(torch_us) ? Num(us / torch_us).c_str() : "-");
  };
  for (const Row& r : rows)
    emit(r.n, r.density, r.k, r.method, r.us, r.min_us, r.count, r.wall_us,
         r.fast_path);
  for (const auto& entry : torch.topk_us) {
    const uint64_t n = entry.first.first;
    const double density = entry.first.second / 1e6;
    uint64_t k = std::max<uint64_t>(1, std::llround(density * n));
    emit(n, density, k, "torch.topk(abs)", entry.second, NAN, k);
  }
  for (const auto& entry : copy_us) {
    emit(entry.first, 0, 0, "d2d_copy", entry.second, NAN, 0);
  }
  js << "\n  ]\n}\n";
  std::ofstream out(o.json);
  out << js.str();
  out.close();
  if (!out) {
    std::fprintf(stderr, "device_check: cannot write %s\n", o.json.c_str());
    return 2;
  }
  std::printf("wrote %s\n", o.json.c_str());
  if (!torch.available) {
    std::printf("torch.topk: not measured (%s)\n", torch.note.c_str());
  }
  if (devices == 0) return o.no_device_ok ? 0 : 3;
  std::printf("correctness: %d checks, %zu failed\n", checks, failures.size());
  for (const std::string& f : failures) std::printf("  FAIL %s\n", f.c_str());
  return failures.empty() ? 0 : 1;
}
