// The CUDA device check (issues 5 and 15), built by
// deploy/device/device_check.sh with nvcc alone (no Abseil, gRPC or GoogleTest
// on the GPU machine).
//
// For every input kind (--inputs; outermost loop), n and density it
//  1. checks the GPU selectors against a plain CPU reference: `exact` must
//     equal the reference top-k bit for bit (same indices, same value bits,
//     ties to the lower index) and zero exactly the selected residual
//     entries; gaussiank/dgc must keep their count contracts
//     ([ceil(2k/3), floor(4k/3)] or k; [1, k]), return valid
//     (index-ascending, value-exact) pairs that form a threshold set
//     (every selected |u| >= every unselected |u|) and zero exactly those;
//     the fused update must equal the CPU rule's arithmetic and its
//     histogram-reusing selection the reference on the updated u;
//  2. unless --check-only, times each selector with CUDA events (median of
//     --iters after --warmup), a device-to-device copy of the same bytes
//     (one read = half of it) and, from --torch-json, torch.topk(g.abs(), k);
//  3. prints one table per input and writes --json, each row with its time
//     relative to the normal input's (x_normal);
//  4. reports issue 15's targets (met / missed / not measured) from the rows
//     and the checks: stdout, and the JSON's "targets".
// --budget-s: no new (input, n) block starts once it would likely end past
// that many seconds; what is left is listed as skipped (a device lease is
// short, and a JSON with most rows beats none).
// Arguments: device_check_args.h (every number parsed whole and
// range-checked; --validate-only checks them and --json, then exits).
// Exit status: 0 all correct, 1 a correctness failure, 2 a bad argument or
// an unwritable --json (found before anything runs), 3 no device
// (missed targets and skipped blocks do not change it).
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
#include <tuple>
#include <vector>

#include "common/cuda/cuda_status.h"
#include "common/cuda/launch.h"
#include "common/cuda/sparsify.h"
#include "common/cuda/sparsify/testing.h"
#include "deploy/device/device_check_args.h"
#include "deploy/device/device_check_inputs.h"

namespace {

using gtopk::cuda::DeviceBuffer;
using gtopk::cuda::KernelStatus;
using gtopk::cuda::Method;
using gtopk::cuda::SelectedPairs;
using gtopk::cuda::SelectParams;
using gtopk::cuda::Sparsifier;
using gtopk::cuda::UpdateParams;
using gtopk::device_check::ForChunks;
using gtopk::device_check::InputNames;
using gtopk::device_check::KeyOf;

using gtopk::device_check::Options;

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
// A tiny reader for exactly what deploy/device/torch_topk.py writes.
struct TorchTimings {
  bool available = false;
  std::string version, note, raw;
  std::map<std::pair<uint64_t, long long>, double> topk_us;  // (n, density*1e6)
  std::map<uint64_t, double> copy_us;
};

long long DensityKey(double d) { return std::llround(d * 1e6); }

// k for a density: max(1, round(density * n)), at most n.
uint64_t KOf(double density, uint64_t n) {
  const uint64_t k = static_cast<uint64_t>(std::llround(density * n));
  return std::max<uint64_t>(1, std::min<uint64_t>(k, n));
}

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
    const KernelStatus s_ = (expr);                                        \
    if (!s_.ok()) {                                                        \
      throw Fatal(std::string(__FILE__) + ":" + std::to_string(__LINE__) + \
                  ": " + #expr + ": " + s_.message);                       \
    }                                                                      \
  } while (0)

inline uint32_t BitsOf(float x) {
  uint32_t b;
  std::memcpy(&b, &x, 4);
  return b;
}

struct Row {
  std::string input;  // InputNames(); "" for the baselines (torch, d2d)
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
  // gaussiank: share of the timed selections whose first count was out of
  // range and that the device corrected (SelectInfo::corrected_on_device;
  // one more compaction pass); NAN for the others.
  double corrected = NAN;
  // dgc: share of the timed selections whose survivors (more than k) the
  // device trimmed to the exact top-k (SelectInfo::trimmed_on_device);
  // NAN for the others.
  double trimmed = NAN;
  // exact rows: share of the timed selections that started from a sample
  // (SelectInfo::exact_sampled: one compaction pass over u); NAN for the
  // others.
  double sampled = NAN;
  // exact and gaussiank rows: share of the timed selections whose
  // candidates came from the first pass's compaction
  // (SelectInfo::candidates_from_update: no compaction pass over u on the
  // usual step; exact after the update only, gaussiank also from its own
  // histogram pass); NAN for dgc.
  double from_update = NAN;
  // Every selection row: share of the timed selections that ran as one
  // kernel of one block (SelectInfo::one_block: n <= 4096).
  double one_block = NAN;
  // exact rows: SelectInfo's plan of the last timed selection (the digit
  // passes over u, whether the final compaction read u); -1 for the others.
  int digit_passes = -1;
  int final_from_u = -1;
};

// What this row is compared on (x_normal, the targets): the host wall time
// where measured (selections), else the CUDA-event time (fused_update).
double Figure(const Row& r) {
  return std::isfinite(r.wall_us) ? r.wall_us : r.us;
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? NAN : v[v.size() / 2];
}

// Checks one selection; returns "" or what failed.
std::string CheckSelection(const std::string& method,
                           const std::vector<float>& u,
                           const std::vector<float>& after, uint64_t k,
                           const SelectedPairs& sel,
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
  // The residual and the unselected maximum, in parallel chunks; the first
  // bad index over all chunks is the one reported.
  const uint64_t chunks =
      (n + gtopk::device_check::kChunk - 1) / gtopk::device_check::kChunk;
  std::vector<uint64_t> first_bad(chunks, n);
  std::vector<uint32_t> chunk_max(chunks, 0);
  ForChunks(n, [&](uint64_t c, uint64_t b, uint64_t e) {
    uint32_t mx = 0;
    for (uint64_t i = b; i < e; ++i) {
      const uint32_t want = chosen[i] ? 0u : BitsOf(u[i]);
      if (BitsOf(after[i]) != want) {
        first_bad[c] = i;
        return;
      }
      if (!chosen[i]) mx = std::max(mx, KeyOf(u[i]));
    }
    chunk_max[c] = mx;
  });
  uint32_t max_other = 0;
  for (uint64_t c = 0; c < chunks; ++c) {
    if (first_bad[c] != n) {
      const uint64_t i = first_bad[c];
      err << "residual at index " << i << " is not "
          << (chosen[i] ? "+0.0 (selected)" : "unchanged");
      return err.str();
    }
    max_other = std::max(max_other, chunk_max[c]);
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

// Gaussian-k's count contract per input, from the correctness checks.
struct GaussianKChecks {
  int checks = 0;
  int count_failures = 0;  // count outside [ceil(2k/3), floor(4k/3)]
  int other_failures = 0;  // another check failed, or the run faulted
};

// One of issue 15's targets: met = 1, missed = 0, not measured = -1.
struct Target {
  std::string name;
  double figure_us = NAN;
  double limit_us = NAN;
  int met = -1;
  std::string detail;
  // The wall targets: the wall-time floor at their n and density
  // (WallFloor::total); NAN for the others or when not measured.
  double floor_us = NAN;
  std::string figure_text, limit_text;  // printed; default: the numbers
};

// A selection's wall-time floor at (n, density): what no selection of u in
// device memory to k pairs in pinned host memory can beat, measured in the
// same run. `read` (every float of u must be read once), `copy` (the k
// pairs must cross to the host), `host` (the fixed host cost outside the
// device's work: the normal input's exact row's wall_us - us at this n and
// density, the same Select and Wait as every selector's). NAN parts:
// not measured (no timing, or no normal exact row).
struct WallFloor {
  double read = NAN, copy = NAN, host = NAN;
  double total() const { return read + copy + host; }
};
using WallFloors = std::map<std::pair<uint64_t, long long>, WallFloor>;

bool SameDensity(double a, double b) { return DensityKey(a) == DensityKey(b); }

const Row* FindRow(const std::vector<Row>& rows, const std::string& input,
                   uint64_t n, double density, const std::string& method) {
  for (const Row& r : rows) {
    if (r.input == input && r.n == n && SameDensity(r.density, density) &&
        r.method == method) {
      return &r;
    }
  }
  return nullptr;
}

std::string Where(const Row& r) {
  std::ostringstream w;
  w << r.input << " n=" << r.n << " density=" << Num(r.density) << " "
    << r.method;
  return w.str();
}

// The sizes issue 15's targets name.
constexpr uint64_t kMidN = 25557032, kLargeN = 138357544;

// (a) n = 25,557,032, density 0.001, normal input: each method's time (CUDA
// events, or host wall time for gaussiank/dgc) within its limit.
void AddMidSizeTargets(const std::vector<Row>& rows, const WallFloors& floors,
                       std::vector<Target>* out) {
  struct {
    const char* method;
    double limit;
    bool wall;
  } const mid[] = {{"exact", 60, false},
                   {"exact_after_update", 40, false},
                   {"gaussiank", 35, true},
                   {"dgc", 35, true}};
  for (const auto& m : mid) {
    Target t;
    t.name =
        std::string(m.method) + (m.wall ? "_wall" : "") + "_n25557032_d0.001";
    t.limit_us = m.limit;
    const Row* r = FindRow(rows, "normal", kMidN, 0.001, m.method);
    t.detail = std::string("normal input, ") +
               (m.wall ? "host wall time to the pairs in pinned memory"
                       : "CUDA events");
    if (r != nullptr) {
      t.figure_us = m.wall ? r->wall_us : r->us;
      if (std::isfinite(t.figure_us)) t.met = t.figure_us <= t.limit_us;
    }
    // What the hardware leaves: the floor no selection beats (WallFloor).
    const auto floor = floors.find({kMidN, DensityKey(0.001)});
    if (m.wall && floor != floors.end() &&
        std::isfinite(floor->second.total())) {
      const WallFloor& f = floor->second;
      t.floor_us = f.total();
      t.detail += "; floor " + Num(f.total()) + " us = read pass " +
                  Num(f.read) + " + pairs copy " + Num(f.copy) + " + host " +
                  Num(f.host);
    }
    out->push_back(t);
  }
}

// (b) any input: every method within 2x its normal-input figure at the
// same n and density, densities 1e-4, 1e-3, 1e-2.
Target AnyInputTarget(const std::vector<Row>& rows, const std::string& input) {
  Target t;
  t.name = "any_input_" + input;
  double worst = -1;
  for (const Row& r : rows) {
    if (r.input != input ||
        !(SameDensity(r.density, 1e-4) || SameDensity(r.density, 1e-3) ||
          SameDensity(r.density, 1e-2))) {
      continue;
    }
    const Row* base = FindRow(rows, "normal", r.n, r.density, r.method);
    if (base == nullptr || !(Figure(*base) > 0)) continue;
    const double ratio = Figure(r) / Figure(*base);
    if (ratio > worst) {
      worst = ratio;
      t.figure_us = Figure(r);
      t.limit_us = 2 * Figure(*base);
      t.detail = "worst x_normal " + Num(ratio) + " at " + Where(r);
    }
  }
  if (worst >= 0) {
    t.met = worst <= 2.0;
  } else {
    t.detail = "no row of this input with a normal-input row to compare";
  }
  return t;
}

// (c) n <= 1,000,000: every method, every input, <= 15 us.
Target SmallNTarget(const std::vector<Row>& rows) {
  Target t;
  t.name = "small_n_le_1000000";
  t.limit_us = 15;
  for (const Row& r : rows) {
    if (r.n > 1000000) continue;
    if (!std::isfinite(t.figure_us) || Figure(r) > t.figure_us) {
      t.figure_us = Figure(r);
      t.detail = "worst row: " + Where(r) + " (wall where measured)";
    }
  }
  if (std::isfinite(t.figure_us)) {
    t.met = t.figure_us <= t.limit_us;
  } else {
    t.detail = "no row with n <= 1,000,000";
  }
  return t;
}

// (d) n = 138,357,544, density 0.001: exact <= 2.5 one reads.
Target ExactVsReadTarget(const std::vector<Row>& rows,
                         const std::map<uint64_t, double>& copy_us) {
  Target t;
  t.name = "exact_n138357544_d0.001_vs_read";
  const Row* r = FindRow(rows, "normal", kLargeN, 0.001, "exact");
  const auto copy = copy_us.find(kLargeN);
  t.detail = "normal input, CUDA events; limit 2.5 x one read (d2d copy / 2)";
  if (r != nullptr && copy != copy_us.end()) {
    t.figure_us = r->us;
    t.limit_us = 2.5 * copy->second / 2;
    t.met = t.figure_us <= t.limit_us;
  }
  return t;
}

// (e) Gaussian-k's count contract on every input.
Target GaussianKCountTarget(
    const std::vector<std::string>& inputs,
    const std::map<std::string, GaussianKChecks>& gauss) {
  Target t;
  t.name = "gaussiank_count_contract";
  int checks = 0, failed = 0;
  std::string per_input;
  for (const std::string& input : inputs) {
    const auto it = gauss.find(input);
    if (it == gauss.end()) continue;
    const GaussianKChecks& g = it->second;
    checks += g.checks;
    failed += g.count_failures + g.other_failures;
    per_input += (per_input.empty() ? "" : ", ") + input + " " +
                 std::to_string(g.count_failures) + "+" +
                 std::to_string(g.other_failures) + " of " +
                 std::to_string(g.checks);
  }
  if (checks > 0) t.met = failed == 0;
  t.figure_text = std::to_string(failed) + " of " + std::to_string(checks) +
                  " checks failed";
  t.limit_text = "0";
  t.detail =
      "count outside [ceil(2k/3), floor(4k/3)] + other failures, "
      "per input: " +
      (per_input.empty() ? "none run" : per_input);
  return t;
}

// The targets of issue 15 (H200), in the order (a) to (e): see
// deploy/device/README.md.
std::vector<Target> ComputeTargets(
    const std::vector<Row>& rows, const std::map<uint64_t, double>& copy_us,
    const WallFloors& floors, const std::vector<std::string>& inputs,
    const std::map<std::string, GaussianKChecks>& gauss) {
  std::vector<Target> out;
  AddMidSizeTargets(rows, floors, &out);
  for (const std::string& input : inputs) {
    if (input != "normal") out.push_back(AnyInputTarget(rows, input));
  }
  out.push_back(SmallNTarget(rows));
  out.push_back(ExactVsReadTarget(rows, copy_us));
  out.push_back(GaussianKCountTarget(inputs, gauss));
  return out;
}

const char* TargetStatus(const Target& t) {
  return t.met < 0 ? "not measured" : t.met ? "met" : "missed";
}

// ---------------------------------------------------------------------------
// The checks and timings on the device.

// The floor of any pass over u (the read_pass baseline), and what the
// histogram pass (HistogramKernel in common/cuda/sparsify/histogram.cu) adds to
// a read, part by part (the read_pass_moments and read_pass_hist baselines,
// issue 15: that pass took 1.3 reads on the 2026-11-30 H200 on every
// input, the narrow band's single bin included). kWork = kReadOnly: each of
// the n floats read once (float4 where u is 16-byte aligned, as the
// selectors' passes read it) and nothing else; kReadMoments: plus the
// pass's sums of u per element (ShiftedSums::Add: the float's conversion
// to double, two double adds and a multiply); kReadHistogram: plus its
// shared-memory histogram of the key's top 11 bits (one shared atomic per
// element, the nonzero bins added to `hist` (kHistBins) at the end). Only
// a key or sum equal to `never` (the caller passes one no float has)
// stores to `sink`: the work stays. Grid-stride over any grid; blocks of
// kReadThreads.
enum ReadWork { kReadOnly, kReadMoments, kReadHistogram };
constexpr int kReadThreads = 256;
constexpr int kHistBins = 2048;

__device__ inline uint32_t AbsKey(float x) {
  return __float_as_uint(x) & 0x7fffffffu;
}

template <int kWork>
__global__ void ReadPassKernel(const float* u, uint64_t n, int vectorized,
                               uint32_t never, float* sink,
                               unsigned long long* hist) {
  __shared__ uint32_t bins[kWork == kReadHistogram ? kHistBins : 1];
  if (kWork == kReadHistogram) {
    for (int i = threadIdx.x; i < kHistBins; i += kReadThreads) bins[i] = 0;
    __syncthreads();
  }
  uint32_t acc = 0;
  float shift = 0.0f;
  bool first_value = true;
  double sum = 0.0, sumsq = 0.0;
  auto visit = [&](float x) {
    const uint32_t key = AbsKey(x);
    acc = key > acc ? key : acc;
    if (kWork == kReadMoments) {
      if (first_value) shift = x;
      first_value = false;
      const double d = static_cast<double>(x) - static_cast<double>(shift);
      sum += d;
      sumsq += d * d;
    }
    if (kWork == kReadHistogram) atomicAdd(&bins[key >> 20], 1u);
  };
  const uint64_t stride = uint64_t{gridDim.x} * blockDim.x;
  const uint64_t first = uint64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  const uint64_t n4 = vectorized ? n / 4 : 0;
  const float4* u4 = reinterpret_cast<const float4*>(u);
  for (uint64_t i = first; i < n4; i += stride) {
    const float4 v = u4[i];
    visit(v.x);
    visit(v.y);
    visit(v.z);
    visit(v.w);
  }
  for (uint64_t i = 4 * n4 + first; i < n; i += stride) visit(u[i]);
  if (acc == never || (kWork == kReadMoments && sum + sumsq == never)) {
    sink[0] = 1.0f;
  }
  if (kWork == kReadHistogram) {
    __syncthreads();
    for (int i = threadIdx.x; i < kHistBins; i += kReadThreads) {
      if (bins[i] != 0)
        atomicAdd(&hist[i], static_cast<unsigned long long>(bins[i]));
    }
  }
}

// What the run found: the tables, the JSON, the targets and the exit status
// are made of it.
struct Results {
  std::vector<Row> rows;
  std::vector<std::string> failures;
  std::vector<std::string> skipped;    // (input, n) blocks --budget-s left out
  std::map<uint64_t, double> copy_us;  // d2d copy of n floats, per n
  // The parts of a selection's wall-time floor (WallFloor): one pass
  // reading n floats and nothing else (ReadPassKernel<kReadOnly>), per n;
  // the copy of k (index, value) pairs (8k bytes) from device to pinned
  // host memory, per (n, density*1e6).
  std::map<uint64_t, double> read_us;
  // The same read with the histogram pass's sums, and with its histogram
  // (ReadPassKernel<kReadMoments>, <kReadHistogram>), per n.
  std::map<uint64_t, double> read_moments_us, read_hist_us;
  std::map<std::pair<uint64_t, long long>, double> pairs_copy_us;
  std::map<std::string, GaussianKChecks> gauss;  // per input
  int checks = 0;
};

// Every (n, density) with a read pass and a pairs copy measured: its
// WallFloor, host from the normal input's exact row (NAN without one).
WallFloors ComputeWallFloors(const Results& results) {
  WallFloors floors;
  for (const auto& [key, copy] : results.pairs_copy_us) {
    const auto read = results.read_us.find(key.first);
    if (read == results.read_us.end()) continue;
    WallFloor f;
    f.read = read->second;
    f.copy = copy;
    const Row* exact =
        FindRow(results.rows, "normal", key.first, key.second / 1e6, "exact");
    if (exact != nullptr) f.host = exact->wall_us - exact->us;
    floors[key] = f;
  }
  return floors;
}

// The learning rate of the fused update's check (its u' = lr * g).
constexpr float kUpdateLr = 0.5f;

// One (input, n) block: the input on the host (and in d_pristine), its
// value after the fused update, and per density k and the references.
struct Block {
  std::string input;
  uint64_t n = 0;
  std::vector<float> u;
  std::vector<float> updated;
  std::vector<uint64_t> ks;  // per --densities entry
  std::vector<std::vector<uint32_t>> references, references_updated;
};

// One method on one density of a block.
struct MethodCase {
  const Block& block;
  const char* method;  // "exact", "gaussiank" or "dgc"
  double density;
  uint64_t k;
  const std::vector<uint32_t>& reference;
  const std::vector<uint32_t>& reference_updated;
  GaussianKChecks& gk;  // the block's input's

  bool is_gaussiank() const { return std::string(method) == "gaussiank"; }

  // "narrow_band exact+update n=1000 density=0.01: ".
  std::string Name(const char* suffix) const {
    return block.input + " " + method + suffix +
           " n=" + std::to_string(block.n) + " density=" + Num(density) + ": ";
  }

  // Counts a Gaussian-k check (`bad`: "" or what failed) for its target.
  void Record(const std::string& bad) const {
    if (is_gaussiank()) {
      ++gk.checks;
      if (!bad.empty()) {
        ++(bad.rfind("count ", 0) == 0 ? gk.count_failures : gk.other_failures);
      }
    }
  }
};

// The checker on device 0: one stream, one Sparsifier and four buffers of
// the largest n, reused by every block. The constructor throws Fatal when
// the set-up fails.
class DeviceChecker {
 public:
  DeviceChecker(const Options& o,
                std::chrono::steady_clock::time_point run_start,
                Results* results)
      : o_(o), run_start_(run_start), results_(*results) {
    CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    CHECK_CUDA(cudaEventCreate(&start));
    CHECK_CUDA(cudaEventCreate(&stop));
    const uint64_t max_n = *std::max_element(o.sizes.begin(), o.sizes.end());
    gtopk::cuda::SparsifierTuning tuning;
    if (o.exact_sample_min_n >= 0) {
      tuning.exact_sample_min_n = static_cast<uint64_t>(o.exact_sample_min_n);
    }
    CHECK_OK(Sparsifier::Create(max_n, tuning, &sp));
    CHECK_OK(d_pristine.Allocate(max_n));
    CHECK_OK(d_u.Allocate(max_n));
    CHECK_OK(d_velocity.Allocate(max_n));
    CHECK_OK(d_residual.Allocate(max_n));
    // The pairs_copy baseline's k pairs (2k floats) at the largest k.
    uint64_t max_k = 1;
    for (uint64_t n : o.sizes) {
      for (double density : o.densities)
        max_k = std::max(max_k, KOf(density, n));
    }
    CHECK_OK(d_pairs.Allocate(2 * max_k));
    CHECK_OK(h_pairs.Allocate(2 * max_k));
    CHECK_OK(d_sink.Allocate(1));
    CHECK_OK(d_read_hist.Allocate(kHistBins));
  }

  // Every input (outermost) and size, each (input, n) block started only
  // when it would likely end within --budget-s; then the stream is
  // destroyed.
  void Run() {
    for (const std::string& input : o_.inputs) {
      results_.gauss[input];  // the input's Gaussian-k entry, even if skipped
      for (uint64_t n : o_.sizes) {
        const double used = ElapsedS();
        if (o_.budget_s > 0 && used + block_s_[n] > o_.budget_s) {
          results_.skipped.push_back(input + " n=" + std::to_string(n));
          std::fprintf(stderr,
                       "device_check: %s n=%llu skipped (%.0f s used, "
                       "about %.0f s more needed, --budget-s=%g)\n",
                       input.c_str(), static_cast<unsigned long long>(n), used,
                       block_s_[n], o_.budget_s);
          continue;
        }
        RunBlock(input, n);
      }
    }
    cudaStreamDestroy(stream);
  }

 private:
  double ElapsedS() const {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() -
                                         run_start_)
        .count();
  }

  // CUDA events around body() (the device work it enqueues); with
  // `wall`, also the host time from body() to the end of after(), the
  // stream drained first so that before()'s work is not counted.
  void TimeUs(const std::function<void()>& before,
              const std::function<void()>& body,
              const std::function<void()>& after, std::vector<double>* samples,
              std::vector<double>* wall = nullptr) {
    for (int it = 0; it < o_.warmup + o_.iters; ++it) {
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
      if (it >= o_.warmup) {
        samples->push_back(ms * 1000.0);
        if (wall != nullptr) {
          wall->push_back(
              std::chrono::duration<double, std::micro>(w1 - w0).count());
        }
      }
    }
  }

  // Checks and times every density and method on one input and n; a fault
  // outside a method is recorded as the block's failure.
  void RunBlock(const std::string& input, uint64_t n) {
    try {
      const auto t0 = std::chrono::steady_clock::now();
      const Block block = PrepareBlock(input, n);
      GaussianKChecks& gk = results_.gauss[input];
      for (size_t di = 0; di < o_.densities.size(); ++di) {
        for (const char* method : {"exact", "gaussiank", "dgc"}) {
          RunMethod({block, method, o_.densities[di], block.ks[di],
                     block.references[di], block.references_updated[di], gk});
        }
      }
      const double secs =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0)
              .count();
      block_s_[n] = std::max(block_s_[n], secs);
      std::fprintf(stderr, "device_check: %s n=%llu done in %.1f s\n",
                   input.c_str(), static_cast<unsigned long long>(n), secs);
    } catch (const Fatal& e) {
      results_.failures.push_back(input + " n=" + std::to_string(n) + ": " +
                                  e.what());
      std::fprintf(stderr, "device_check: FAILED %s\n", e.what());
    }
  }

  // The block's input to d_pristine, the copy baseline of its n (once per
  // n), the update's result and the CPU references for every density.
  Block PrepareBlock(const std::string& input, uint64_t n) {
    Block b;
    b.input = input;
    b.n = n;
    b.u = gtopk::device_check::MakeCheckInput(input, n, o_.seed + n);
    const std::vector<float>& u = b.u;
    // On `stream`, not with cudaMemcpy: that runs on the legacy
    // default stream, which a cudaStreamNonBlocking stream does not
    // wait for, and a pageable host-to-device cudaMemcpy may return
    // before its last DMA lands (CUDA's "API synchronization
    // behavior"), so the copies from d_pristine below could read a
    // stale tail.
    CHECK_CUDA(cudaMemcpyAsync(d_pristine.get(), u.data(), n * sizeof(float),
                               cudaMemcpyHostToDevice, stream));
    CHECK_CUDA(cudaStreamSynchronize(stream));
    // The copy baseline: n floats device to device (read + write),
    // once per n (it does not depend on the values).
    if (!o_.check_only && results_.copy_us.count(n) == 0) {
      std::vector<double> s;
      TimeUs([] {},
             [&] {
               CHECK_CUDA(cudaMemcpyAsync(d_u.get(), d_pristine.get(),
                                          n * sizeof(float),
                                          cudaMemcpyDeviceToDevice, stream));
             },
             [] {}, &s);
      results_.copy_us[n] = Median(s);
    }
    // The wall-time floor's parts (WallFloor): one pass that only
    // reads u, once per n; the copy of k pairs to pinned memory, once per
    // (n, density).
    if (!o_.check_only && results_.read_us.count(n) == 0) {
      const int blocks = static_cast<int>(std::min<uint64_t>(
          4096, (n + 4 * kReadThreads - 1) / (4 * kReadThreads)));
      const int vec =
          reinterpret_cast<uintptr_t>(d_pristine.get()) % 16 == 0 ? 1 : 0;
      auto time_pass = [&](auto kernel) {
        std::vector<double> s;
        TimeUs([] {},
               [&] {
                 GTOPK_LAUNCH(kernel, blocks, kReadThreads, stream)
                 (d_pristine.get(), n, vec, 0xffffffffu, d_sink.get(),
                  d_read_hist.get());
                 CHECK_CUDA(cudaGetLastError());
               },
               [] {}, &s);
        return Median(s);
      };
      results_.read_us[n] = time_pass(&ReadPassKernel<kReadOnly>);
      results_.read_moments_us[n] = time_pass(&ReadPassKernel<kReadMoments>);
      results_.read_hist_us[n] = time_pass(&ReadPassKernel<kReadHistogram>);
    }
    for (double density : o_.densities) {
      const std::pair<uint64_t, long long> key{n, DensityKey(density)};
      if (o_.check_only || results_.pairs_copy_us.count(key) != 0) continue;
      const uint64_t k = KOf(density, n);
      std::vector<double> s;
      TimeUs([] {},
             [&] {
               CHECK_CUDA(cudaMemcpyAsync(h_pairs.get(), d_pairs.get(),
                                          2 * k * sizeof(float),
                                          cudaMemcpyDeviceToHost, stream));
             },
             [] {}, &s);
      results_.pairs_copy_us[key] = Median(s);
    }
    // The update's result with zero residual/velocity:
    // u' = 0 + lr * (0 * 0 + (g + 0)).
    const float lr = kUpdateLr;
    b.updated.resize(n);
    std::vector<float>& updated = b.updated;
    ForChunks(n, [&](uint64_t, uint64_t begin, uint64_t end) {
      for (uint64_t i = begin; i < end; ++i) {
        const float g = u[i] + 0.0f;
        const float mv = 0.9f * 0.0f;
        const float v = mv + g;
        const float lv = lr * v;
        updated[i] = 0.0f + lv;
      }
    });
    for (double density : o_.densities) b.ks.push_back(KOf(density, n));
    gtopk::device_check::ReferenceTopKs(u, b.ks, &b.references);
    gtopk::device_check::ReferenceTopKs(updated, b.ks, &b.references_updated);
    after.resize(n);
    return b;
  }

  // One method at one density: the correctness check on a fresh copy and,
  // unless --check-only, its timing; then (exact, gaussiank) the same after
  // the fused update, whose histogram the selection reuses, and (exact) the
  // fused update's own time. A fault is recorded as this case's failure.
  void RunMethod(const MethodCase& c) {
    std::fprintf(stderr, "device_check: %s n=%llu density=%g %s\n",
                 c.block.input.c_str(),
                 static_cast<unsigned long long>(c.block.n), c.density,
                 c.method);
    try {
      SelectParams p;
      p.method = std::string(c.method) == "exact" ? Method::kExact
                 : c.is_gaussiank()               ? Method::kGaussianK
                                                  : Method::kDgc;
      p.k = c.k;
      p.seed = o_.seed;
      p.zero_selected = true;
      CheckFreshSelection(c, p);
      if (!o_.check_only) TimeFreshSelection(c, p);
      if (p.method == Method::kDgc) return;  // dgc needs no histogram
      CheckSelectionAfterUpdate(c, p);
      if (o_.check_only) return;
      TimeSelectionAfterUpdate(c, p);
      if (p.method == Method::kExact) TimeFusedUpdate(c, p);
    } catch (const Fatal& e) {
      if (c.is_gaussiank()) ++c.gk.other_failures;
      results_.failures.push_back(c.Name("") + e.what());
      std::fprintf(stderr, "device_check: FAILED %s\n", e.what());
      SelectedPairs ignored;
      sp->Wait(stream, &ignored);  // clear a pending selection, if any
    }
  }

  // Correctness on a fresh copy of the input.
  void CheckFreshSelection(const MethodCase& c, const SelectParams& p) {
    const uint64_t n = c.block.n;
    SelectedPairs sel;
    CHECK_CUDA(cudaMemcpyAsync(d_u.get(), d_pristine.get(), n * sizeof(float),
                               cudaMemcpyDeviceToDevice, stream));
    CHECK_OK(sp->Select(d_u.get(), n, p, stream));
    const KernelStatus waited = sp->Wait(stream, &sel);
    ++results_.checks;
    std::string bad;
    if (!waited.ok()) {
      bad = waited.message;
    } else {
      CHECK_CUDA(cudaMemcpy(after.data(), d_u.get(), n * sizeof(float),
                            cudaMemcpyDeviceToHost));
      bad = CheckSelection(c.method, c.block.u, after, c.k, sel, c.reference);
    }
    c.Record(bad);
    if (!bad.empty()) results_.failures.push_back(c.Name("") + bad);
  }

  // Times one selection per iteration: prepare() (not timed), then
  // select() enqueues it and Wait returns the pairs. The row `name`:
  // CUDA-event and host wall times, the fast-path share (gaussiank, dgc)
  // and the last selection's plan (exact).
  Row TimeSelection(const MethodCase& c, const SelectParams& p,
                    const std::string& name,
                    const std::function<void()>& prepare,
                    const std::function<void()>& select) {
    std::vector<double> s, wall;
    uint64_t count = 0;
    int fast = 0, corrected = 0, trimmed = 0, sampled = 0, from_update = 0,
        one_block = 0, timed = 0;
    gtopk::cuda::SelectInfo last_info;
    auto wait_selection = [&] {
      SelectedPairs t;
      CHECK_OK(sp->Wait(stream, &t));
      count = t.count;
      fast += t.info.fast_path ? 1 : 0;
      corrected += t.info.corrected_on_device ? 1 : 0;
      trimmed += t.info.trimmed_on_device ? 1 : 0;
      sampled += t.info.exact_sampled ? 1 : 0;
      from_update += t.info.candidates_from_update ? 1 : 0;
      one_block += t.info.one_block ? 1 : 0;
      last_info = t.info;
      ++timed;
    };
    TimeUs(prepare, select, wait_selection, &s, &wall);
    Row row{c.block.input,
            c.block.n,
            c.density,
            c.k,
            name,
            Median(s),
            *std::min_element(s.begin(), s.end()),
            count};
    row.wall_us = Median(wall);
    row.one_block = double(one_block) / timed;
    if (p.method != Method::kExact) row.fast_path = double(fast) / timed;
    if (p.method == Method::kGaussianK) {
      row.corrected = double(corrected) / timed;
      row.from_update = double(from_update) / timed;
    }
    if (p.method == Method::kDgc) row.trimmed = double(trimmed) / timed;
    if (p.method == Method::kExact) {
      row.sampled = double(sampled) / timed;
      row.from_update = double(from_update) / timed;
      row.digit_passes = last_info.exact_digit_passes;
      row.final_from_u = last_info.exact_final_from_u ? 1 : 0;
    }
    return row;
  }

  // From u in device memory to the pairs in pinned host memory (includes
  // the first histogram pass). gaussiank/dgc: `us` covers their fast path;
  // what Wait finishes otherwise is only in wall_us (fast_path says how
  // often that was needed).
  void TimeFreshSelection(const MethodCase& c, SelectParams& p) {
    const uint64_t n = c.block.n;
    results_.rows.push_back(TimeSelection(
        c, p, c.method,
        [&] {
          CHECK_CUDA(cudaMemcpyAsync(d_u.get(), d_pristine.get(),
                                     n * sizeof(float),
                                     cudaMemcpyDeviceToDevice, stream));
        },
        [&] {
          // A new step each time, as in training (dgc's sample, hence its
          // path, depends on it).
          ++p.step;
          CHECK_OK(sp->Select(d_u.get(), n, p, stream));
        }));
  }

  // Zero velocity and residual: the fused update's starting state.
  void ResetUpdateState(uint64_t n) {
    CHECK_CUDA(cudaMemsetAsync(d_velocity.get(), 0, n * sizeof(float), stream));
    CHECK_CUDA(cudaMemsetAsync(d_residual.get(), 0, n * sizeof(float), stream));
  }

  // The fused update of the input into the residual (momentum 0.9 with
  // correction, lr kUpdateLr); it leaves the histogram for the selection.
  void EnqueueUpdate(uint64_t n) {
    UpdateParams up;
    up.lr = kUpdateLr;
    up.momentum = 0.9f;
    up.momentum_correction = true;
    CHECK_OK(sp->Accumulate(d_pristine.get(), nullptr, d_velocity.get(),
                            d_velocity.get(), d_residual.get(),
                            d_residual.get(), n, up, stream));
  }

  // Correctness after the fused update: the selection must reuse the
  // update's histogram and equal the reference on the updated u.
  void CheckSelectionAfterUpdate(const MethodCase& c, const SelectParams& p) {
    const uint64_t n = c.block.n;
    ResetUpdateState(n);
    EnqueueUpdate(n);
    CHECK_OK(sp->Select(d_residual.get(), n, p, stream));
    SelectedPairs sel;
    const KernelStatus w2 = sp->Wait(stream, &sel);
    ++results_.checks;
    std::string bad;
    if (!w2.ok()) {
      bad = w2.message;
    } else if (!sel.info.used_update_histogram && !sel.info.one_block &&
               !sel.info.sampled_after_update) {
      // (n <= 4096 runs as one block, which reads u whole; exact after a
      // plan that needed several passes over u starts from a sample.)
      bad = "the update's histogram was not reused";
    } else {
      CHECK_CUDA(cudaMemcpy(after.data(), d_residual.get(), n * sizeof(float),
                            cudaMemcpyDeviceToHost));
      bad = CheckSelection(c.method, c.block.updated, after, c.k, sel,
                           c.reference_updated);
    }
    c.Record(bad);
    if (!bad.empty()) results_.failures.push_back(c.Name("+update") + bad);
  }

  // The selection alone, its histogram from the fused update (the
  // `<method>_after_update` row).
  void TimeSelectionAfterUpdate(const MethodCase& c, SelectParams& p) {
    const uint64_t n = c.block.n;
    results_.rows.push_back(TimeSelection(
        c, p, std::string(c.method) + "_after_update",
        [&] {
          ResetUpdateState(n);
          EnqueueUpdate(n);
        },
        [&] {
          ++p.step;
          CHECK_OK(sp->Select(d_residual.get(), n, p, stream));
        }));
  }

  // The fused update's own CUDA-event time (the `fused_update` row).
  void TimeFusedUpdate(const MethodCase& c, const SelectParams& p) {
    const uint64_t n = c.block.n;
    std::vector<double> s;
    TimeUs([&] { ResetUpdateState(n); }, [&] { EnqueueUpdate(n); },
           [&] {
             // Consume the histogram so the next Accumulate is clean.
             CHECK_OK(sp->Select(d_residual.get(), n, p, stream));
             SelectedPairs t;
             CHECK_OK(sp->Wait(stream, &t));
           },
           &s);
    results_.rows.push_back({c.block.input, n, c.density, c.k, "fused_update",
                             Median(s), *std::min_element(s.begin(), s.end()),
                             0});
  }

  const Options& o_;
  const std::chrono::steady_clock::time_point run_start_;
  Results& results_;
  // The device state, named without the trailing underscore on purpose:
  // CHECK_CUDA and CHECK_OK quote the checked expression in the failures
  // (stderr and the JSON), and these are the names those messages have
  // always shown.
  cudaStream_t stream;
  cudaEvent_t start, stop;
  std::unique_ptr<Sparsifier> sp;
  DeviceBuffer<float> d_pristine, d_u, d_velocity, d_residual;
  // The floor's baselines: k pairs on the device and in pinned memory, and
  // the read pass's sink.
  DeviceBuffer<float> d_pairs, d_sink;
  gtopk::cuda::PinnedBuffer<float> h_pairs;
  DeviceBuffer<unsigned long long> d_read_hist;  // read_pass_hist's bins
  std::vector<float> after;  // a selection's residual, copied back
  // The longest (input, n) block so far per n: the estimate of the next
  // one's time, for --budget-s.
  std::map<uint64_t, double> block_s_;
};

// Runs every check and timing on device 0 into *results; a set-up fault is
// recorded as a failure.
void RunOnDevice(const Options& o,
                 std::chrono::steady_clock::time_point run_start,
                 Results* results) {
  try {
    DeviceChecker checker(o, run_start, results);
    checker.Run();
  } catch (const Fatal& e) {
    results->failures.push_back(std::string("set-up: ") + e.what());
    std::fprintf(stderr, "device_check: FAILED %s\n", e.what());
  }
}

// ---------------------------------------------------------------------------
// The tables and the JSON.

// The normal input's figure per (n, density, method): x_normal's base.
using NormalFigures =
    std::map<std::tuple<uint64_t, long long, std::string>, double>;

NormalFigures NormalInputFigures(const std::vector<Row>& rows) {
  NormalFigures normal_figure;
  for (const Row& r : rows) {
    if (r.input == "normal") {
      normal_figure[std::make_tuple(r.n, DensityKey(r.density), r.method)] =
          Figure(r);
    }
  }
  return normal_figure;
}

// What a row is compared with.
struct Ratios {
  double one_read;  // one read of n floats (d2d copy / 2), us; NAN: none
  double torch_us;  // torch.topk at (n, density), us; NAN: none
  double x_normal;  // Figure(r) / the normal input's; NAN: none
};

Ratios RatiosOf(const Row& r, const std::map<uint64_t, double>& copy_us,
                const TorchTimings& torch, const NormalFigures& normal) {
  Ratios x;
  const auto copy = copy_us.find(r.n);
  x.one_read = copy != copy_us.end() ? copy->second / 2.0 : NAN;
  const auto it = torch.topk_us.find({r.n, DensityKey(r.density)});
  x.torch_us = it == torch.topk_us.end() ? NAN : it->second;
  x.x_normal = NAN;
  if (!r.input.empty()) {
    const auto base =
        normal.find(std::make_tuple(r.n, DensityKey(r.density), r.method));
    if (base != normal.end()) x.x_normal = Figure(r) / base->second;
  }
  return x;
}

// One table: its title and rows, in output order.
struct Table {
  std::string title;
  std::vector<Row> rows;
};

// One table per input that has rows (in --inputs order), then the baselines
// (torch.topk, the d2d copy) when there are any.
std::vector<Table> OutputTables(const Options& o, const Results& results,
                                const TorchTimings& torch,
                                const WallFloors& floors) {
  std::vector<Table> tables;
  for (const std::string& input : o.inputs) {
    Table t;
    t.title =
        "input " + input + ": " + gtopk::device_check::InputDefinition(input);
    for (const Row& r : results.rows) {
      if (r.input == input) t.rows.push_back(r);
    }
    if (!t.rows.empty()) tables.push_back(std::move(t));
  }
  Table baselines;
  baselines.title =
      "baselines (torch.topk on torch.randn; d2d copy; read pass; k pairs "
      "to pinned memory; wall floor = read pass + pairs copy + exact's "
      "wall - us)";
  for (const auto& entry : torch.topk_us) {
    const uint64_t n = entry.first.first;
    const double density = entry.first.second / 1e6;
    const uint64_t k = KOf(density, n);
    baselines.rows.push_back(
        {"", n, density, k, "torch.topk(abs)", entry.second, NAN, k});
  }
  for (const auto& entry : results.copy_us) {
    baselines.rows.push_back(
        {"", entry.first, 0, 0, "d2d_copy", entry.second, NAN, 0});
  }
  for (const auto& [method, us] :
       {std::make_pair("read_pass", &results.read_us),
        std::make_pair("read_pass_moments", &results.read_moments_us),
        std::make_pair("read_pass_hist", &results.read_hist_us)}) {
    for (const auto& entry : *us) {
      baselines.rows.push_back(
          {"", entry.first, 0, 0, method, entry.second, NAN, 0});
    }
  }
  for (const auto& [key, f] : floors) {
    const double density = key.second / 1e6;
    const uint64_t k = KOf(density, key.first);
    baselines.rows.push_back(
        {"", key.first, density, k, "pairs_copy", f.copy, NAN, k});
    if (std::isfinite(f.host)) {
      baselines.rows.push_back(
          {"", key.first, density, k, "wall_floor", f.total(), NAN, k});
    }
  }
  if (!baselines.rows.empty()) tables.push_back(std::move(baselines));
  return tables;
}

void PrintTable(const Table& table, const Results& results,
                const TorchTimings& torch, const NormalFigures& normal) {
  std::printf("\n== %s\n%12s %9s %24s %10s %10s %5s %10s %10s %9s %5s\n",
              table.title.c_str(), "n", "density", "method", "us", "wall us",
              "fast", "x one-read", "x torch", "x normal", "plan");
  for (const Row& r : table.rows) {
    const Ratios x = RatiosOf(r, results.copy_us, torch, normal);
    std::string plan = "-";
    if (std::isfinite(r.one_block) && r.one_block > 0) {
      plan = "b" + Num(r.one_block);  // share run as one block
    } else if (std::isfinite(r.sampled) && r.sampled > 0) {
      plan = "s" + Num(r.sampled);  // share started from a sample
    } else if (std::isfinite(r.from_update) && r.from_update > 0) {
      plan = "p" + Num(r.from_update);  // share from the update's candidates
    } else if (r.digit_passes >= 0) {
      plan = std::to_string(r.digit_passes) + (r.final_from_u ? ",u" : "");
    } else if (std::isfinite(r.corrected)) {
      plan = "c" + Num(r.corrected);  // share corrected on the device
    } else if (std::isfinite(r.trimmed)) {
      plan = "t" + Num(r.trimmed);  // share trimmed on the device
    }
    std::printf(
        "%12llu %9g %24s %10.1f %10s %5s %10s %10s %9s %5s\n",
        static_cast<unsigned long long>(r.n), r.density, r.method.c_str(), r.us,
        std::isfinite(r.wall_us) ? Num(r.wall_us).c_str() : "-",
        std::isfinite(r.fast_path) ? Num(r.fast_path).c_str() : "-",
        std::isfinite(x.one_read) ? Num(r.us / x.one_read).c_str() : "-",
        std::isfinite(x.torch_us) ? Num(r.us / x.torch_us).c_str() : "-",
        std::isfinite(x.x_normal) ? Num(x.x_normal).c_str() : "-",
        plan.c_str());
  }
}

std::string JsonRow(const Row& r, const Ratios& x) {
  std::ostringstream js;
  js << "{\"input\": " << (r.input.empty() ? "null" : "\"" + r.input + "\"")
     << ", \"n\": " << r.n << ", \"density\": " << Num(r.density)
     << ", \"k\": " << r.k << ", \"method\": \"" << r.method
     << "\", \"us\": " << Num(r.us) << ", \"min_us\": " << Num(r.min_us)
     << ", \"count\": " << r.count << ", \"wall_us\": " << Num(r.wall_us)
     << ", \"fast_path_fraction\": " << Num(r.fast_path)
     << ", \"corrected_fraction\": " << Num(r.corrected)
     << ", \"trimmed_fraction\": " << Num(r.trimmed)
     << ", \"sampled_fraction\": " << Num(r.sampled)
     << ", \"from_update_fraction\": " << Num(r.from_update)
     << ", \"one_block_fraction\": " << Num(r.one_block)
     << ", \"one_read_us\": " << Num(x.one_read)
     << ", \"x_one_read\": " << Num(r.us / x.one_read)
     << ", \"torch_topk_us\": " << Num(x.torch_us)
     << ", \"x_torch_topk\": " << Num(r.us / x.torch_us)
     << ", \"x_normal\": " << Num(x.x_normal) << ", \"digit_passes\": "
     << (r.digit_passes < 0 ? "null" : std::to_string(r.digit_passes))
     << ", \"final_from_u\": "
     << (r.final_from_u < 0 ? "null"
         : r.final_from_u   ? "true"
                            : "false")
     << "}";
  return js.str();
}

// The --json document (deploy/device/README.md): the run's settings, the
// correctness summary, every table's rows in order, and the targets.
std::string JsonReport(const Options& o, const std::string& gpu,
                       bool device_present, const TorchTimings& torch,
                       const Results& results, const std::vector<Table>& tables,
                       const NormalFigures& normal,
                       const std::vector<Target>& targets) {
  std::ostringstream js;
  js << "{\n  \"command\": \"" << JsonEscape(o.command) << "\",\n"
     << "  \"gpu\": \"" << JsonEscape(gpu) << "\",\n"
     << "  \"device_present\": " << (device_present ? "true" : "false") << ",\n"
     << "  \"iters\": " << o.iters << ",\n  \"warmup\": " << o.warmup << ",\n"
     << "  \"inputs\": [";
  for (size_t i = 0; i < o.inputs.size(); ++i) {
    js << (i ? ", " : "") << "{\"name\": \"" << o.inputs[i]
       << "\", \"definition\": \""
       << JsonEscape(gtopk::device_check::InputDefinition(o.inputs[i]))
       << "\"}";
  }
  js << "],\n  \"seed\": " << o.seed << ",\n"
     << "  \"timing\": \"CUDA events, median; selectors: u in device memory "
        "to (index, value) pairs in pinned host memory, residual zeroed; "
        "*_after_update: selection only, histogram from the fused update; "
        "one_read_us = d2d copy of n floats / 2; x_normal = (wall_us, else "
        "us) / the same on the normal input; read_pass: a kernel reading n "
        "floats (read_pass_moments: with the histogram pass's double sums; "
        "read_pass_hist: with its shared-memory histogram); pairs_copy: k "
        "pairs (8k bytes) to pinned memory; "
        "wall_floor = read_pass + pairs_copy + the normal exact row's "
        "wall_us - us\",\n"
     << "  \"torch\": {\"available\": " << (torch.available ? "true" : "false")
     << ", \"version\": \"" << JsonEscape(torch.version) << "\", \"note\": \""
     << JsonEscape(torch.note) << "\"},\n"
     << "  \"correctness\": {\"checks\": " << results.checks
     << ", \"failed\": " << results.failures.size() << ", \"failures\": [";
  for (size_t i = 0; i < results.failures.size(); ++i) {
    js << (i ? ", " : "") << "\"" << JsonEscape(results.failures[i]) << "\"";
  }
  js << "]},\n  \"budget_s\": " << Num(o.budget_s) << ",\n  \"skipped\": [";
  for (size_t i = 0; i < results.skipped.size(); ++i) {
    js << (i ? ", " : "") << "\"" << JsonEscape(results.skipped[i]) << "\"";
  }
  js << "],\n  \"rows\": [";
  bool first = true;
  for (const Table& table : tables) {
    for (const Row& r : table.rows) {
      js << (first ? "" : ",") << "\n    "
         << JsonRow(r, RatiosOf(r, results.copy_us, torch, normal));
      first = false;
    }
  }
  js << "\n  ],\n  \"targets\": [";
  for (size_t i = 0; i < targets.size(); ++i) {
    const Target& t = targets[i];
    js << (i ? "," : "") << "\n    {\"name\": \"" << t.name
       << "\", \"figure_us\": " << Num(t.figure_us)
       << ", \"limit_us\": " << Num(t.limit_us)
       << ", \"floor_us\": " << Num(t.floor_us) << ", \"met\": "
       << (t.met < 0 ? "null"
           : t.met   ? "true"
                     : "false")
       << ", \"detail\": \"" << JsonEscape(t.detail) << "\"}";
  }
  js << "\n  ]\n}\n";
  return js.str();
}

// The verdict on stdout: blocks not run, correctness, and every target.
void PrintVerdict(const Options& o, const Results& results,
                  const std::vector<Target>& targets) {
  for (const std::string& sk : results.skipped) {
    std::printf("NOT RUN (--budget-s=%g): %s\n", o.budget_s, sk.c_str());
  }
  std::printf("correctness: %d checks, %zu failed\n", results.checks,
              results.failures.size());
  for (const std::string& f : results.failures) {
    std::printf("  FAIL %s\n", f.c_str());
  }
  for (const Target& t : targets) {
    const std::string figure = !t.figure_text.empty() ? t.figure_text
                               : std::isfinite(t.figure_us)
                                   ? Num(t.figure_us) + " us"
                                   : "-";
    const std::string limit = !t.limit_text.empty() ? t.limit_text
                              : std::isfinite(t.limit_us)
                                  ? Num(t.limit_us) + " us"
                                  : "-";
    std::printf("target %s: %s (%s vs %s); %s\n", t.name.c_str(),
                TargetStatus(t), figure.c_str(), limit.c_str(),
                t.detail.c_str());
  }
}

}  // namespace

int main(int argc, char** argv) {
  // Bad arguments and an unwritable --json end the run here (exit 2, the
  // reason on stderr), before any check: see device_check_args.h.
  Options o;
  if (const int rc = gtopk::device_check::ValidateArgs(argc, argv, &o)) {
    return rc;
  }
  if (o.validate_only) return 0;
  const TorchTimings torch = ReadTorch(o.torch_json);
  int devices = 0;
  const cudaError_t dev_err = cudaGetDeviceCount(&devices);
  std::string gpu = "none";
  if (dev_err == cudaSuccess && devices > 0) {
    cudaDeviceProp prop;
    if (cudaGetDeviceProperties(&prop, 0) == cudaSuccess) gpu = prop.name;
  }

  Results results;
  const auto run_start = std::chrono::steady_clock::now();
  if (devices > 0) {
    RunOnDevice(o, run_start, &results);
  } else {
    std::fprintf(
        stderr,
        "device_check: no CUDA device (%s); writing a JSON without "
        "measurements\n",
        dev_err == cudaSuccess ? "0 devices" : cudaGetErrorString(dev_err));
    cudaGetLastError();
  }

  const NormalFigures normal = NormalInputFigures(results.rows);
  const WallFloors floors = ComputeWallFloors(results);
  const std::vector<Target> targets =
      devices > 0 ? ComputeTargets(results.rows, results.copy_us, floors,
                                   o.inputs, results.gauss)
                  : std::vector<Target>{};
  const std::vector<Table> tables = OutputTables(o, results, torch, floors);
  for (const Table& table : tables) {
    PrintTable(table, results, torch, normal);
  }
  std::ofstream out(o.json);
  out << JsonReport(o, gpu, devices > 0, torch, results, tables, normal,
                    targets);
  out.close();
  if (!out) {
    std::fprintf(stderr, "device_check: cannot write %s\n", o.json.c_str());
    return 2;
  }
  std::printf("\nwrote %s\n", o.json.c_str());
  if (!torch.available) {
    std::printf("torch.topk: not measured (%s)\n", torch.note.c_str());
  }
  if (devices == 0) return o.no_device_ok ? 0 : 3;
  PrintVerdict(o, results, targets);
  return results.failures.empty() ? 0 : 1;
}
