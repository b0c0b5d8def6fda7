// The device check's command line (deploy/device/device_check.cu): its options,
// their strict parsing and the up-front check that --json can be written.
//
// Header-only, host C++ only (no CUDA, no Abseil), so that
// deploy/device/device_check.sh can compile it alone with the host compiler
// (device_check_args.cc, about a second) and refuse bad flags before the
// minute-long nvcc build; the checker parses with the same code.
#ifndef GTOPK_BENCH_CUDA_DEVICE_CHECK_ARGS_H_
#define GTOPK_BENCH_CUDA_DEVICE_CHECK_ARGS_H_

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "deploy/device/device_check_inputs.h"

namespace gtopk {
namespace device_check {

struct Options {
  std::vector<uint64_t> sizes = {1, 1000, 1000003, 25557032, 138357544};
  std::vector<double> densities = {0.0001, 0.001, 0.01};
  std::vector<std::string> inputs = InputNames();  // outermost loop, in order
  int iters = 30;
  int warmup = 5;
  std::string json = "cuda_select.json";
  std::string torch_json;  // optional torch.topk/copy timings
  std::string command;
  uint64_t seed = 1;
  bool no_device_ok = false;   // --allow-no-device: exit 0 without a GPU
  bool check_only = false;     // --check-only: correctness, no timing rows
  bool validate_only = false;  // --validate-only: parse, check --json, exit
  double budget_s = 0;         // --budget-s: no new block past it; 0 = none
  // --exact-sample-min-n: the smallest n at which exact starts from a
  // sample (SparsifierTuning::exact_sample_min_n); -1 = the selector's default.
  int64_t exact_sample_min_n = -1;
};

// Limits of the numeric flags (inclusive).
constexpr uint64_t kMaxSize = uint64_t{1} << 32;
// At least 20 timed iterations on a GPU, for medians worth reading. The
// emulator's build (cuda_device_check_emu, GTOPK_DEVICE_CHECK_EMULATED)
// times the CPU, which means nothing: 3 suffice for what each timed
// iteration checks (correctness, the update's candidates taken), and keep
// its test's CPU time down.
#ifdef GTOPK_DEVICE_CHECK_EMULATED
constexpr uint64_t kMinIters = 3;
#else
constexpr uint64_t kMinIters = 20;
#endif
constexpr uint64_t kMaxIters = 10000;
constexpr uint64_t kMinWarmup = 1, kMaxWarmup = 1000;

// A whole decimal number in [lo, hi]: digits only (no sign, space, exponent
// or fraction), every character consumed, no overflow. Else false and *why.
inline bool ParseUint(const std::string& s, uint64_t lo, uint64_t hi,
                      uint64_t* out, std::string* why) {
  if (s.empty()) {
    *why = "empty, want a whole number";
    return false;
  }
  uint64_t v = 0;
  for (char c : s) {
    if (c < '0' || c > '9') {
      *why = "'" + s + "' is not a whole number (digits only)";
      return false;
    }
    const uint64_t d = static_cast<uint64_t>(c - '0');
    if (v > (UINT64_MAX - d) / 10) {
      *why = "'" + s + "' is out of range (at most " + std::to_string(hi) + ")";
      return false;
    }
    v = v * 10 + d;
  }
  if (v < lo || v > hi) {
    *why = "'" + s + "' is out of range [" + std::to_string(lo) + ", " +
           std::to_string(hi) + "]";
    return false;
  }
  *out = v;
  return true;
}

// A finite decimal number, every character consumed (strtod, but no leading
// space, sign-less hex, "nan" or "inf"). Range checks are the caller's.
inline bool ParseFinite(const std::string& s, double* out, std::string* why) {
  if (s.empty()) {
    *why = "empty, want a number";
    return false;
  }
  const char first = s[0];
  if (!(first == '-' || first == '+' || first == '.' ||
        (first >= '0' && first <= '9')) ||
      s.find_first_of("xX") != std::string::npos) {
    *why = "'" + s + "' is not a decimal number";
    return false;
  }
  errno = 0;
  char* end = nullptr;
  const double v = std::strtod(s.c_str(), &end);
  if (end != s.c_str() + s.size()) {
    *why = "'" + s + "' is not a number";
    return false;
  }
  if (!std::isfinite(v) || errno == ERANGE) {
    *why = "'" + s + "' is out of range";
    return false;
  }
  *out = v;
  return true;
}

// The comma-separated items of a list flag; an empty list or item is an error.
inline bool SplitList(const std::string& s, std::vector<std::string>* items,
                      std::string* why) {
  items->clear();
  size_t start = 0;
  while (true) {
    const size_t comma = s.find(',', start);
    items->push_back(s.substr(
        start, comma == std::string::npos ? std::string::npos : comma - start));
    if (items->back().empty()) {
      *why = s.empty() ? "empty list" : "empty item in '" + s + "'";
      return false;
    }
    if (comma == std::string::npos) return true;
    start = comma + 1;
  }
}

// Parses argv into *o. On a bad argument returns false with *error naming
// it and why ("bad argument '--seed=x': 'x' is not a whole number ...").
inline bool ParseArgs(int argc, char** argv, Options* o, std::string* error) {
  o->command.clear();
  for (int i = 0; i < argc; ++i) {
    if (i > 0) o->command += " ";
    o->command += argv[i];
  }
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const size_t eq = a.find('=');
    const bool has_value = eq != std::string::npos;
    const std::string key = a.substr(0, eq);
    const std::string value = has_value ? a.substr(eq + 1) : "";
    std::string why;
    std::vector<std::string> items;
    uint64_t u = 0;
    double d = 0;
    bool ok = true;
    if (key == "--sizes") {
      ok = SplitList(value, &items, &why);
      std::vector<uint64_t> sizes;
      for (size_t j = 0; ok && j < items.size(); ++j) {
        ok = ParseUint(items[j], 1, kMaxSize, &u, &why);
        sizes.push_back(u);
      }
      if (ok) o->sizes = sizes;
    } else if (key == "--densities") {
      ok = SplitList(value, &items, &why);
      std::vector<double> densities;
      for (size_t j = 0; ok && j < items.size(); ++j) {
        ok = ParseFinite(items[j], &d, &why);
        if (ok && !(d > 0 && d <= 1)) {
          why = "'" + items[j] + "' is outside (0, 1]";
          ok = false;
        }
        densities.push_back(d);
      }
      if (ok) o->densities = densities;
    } else if (key == "--iters") {
      ok = ParseUint(value, kMinIters, kMaxIters, &u, &why);
      if (ok) o->iters = static_cast<int>(u);
    } else if (key == "--warmup") {
      ok = ParseUint(value, kMinWarmup, kMaxWarmup, &u, &why);
      if (ok) o->warmup = static_cast<int>(u);
    } else if (key == "--seed") {
      ok = ParseUint(value, 0, UINT64_MAX, &u, &why);
      if (ok) o->seed = u;
    } else if (key == "--budget-s") {
      ok = ParseFinite(value, &d, &why);
      if (ok && !(d >= 0)) {
        why = "'" + value + "' is negative (0: no budget)";
        ok = false;
      }
      if (ok) o->budget_s = d;
    } else if (key == "--exact-sample-min-n") {
      ok = ParseUint(value, 0, kMaxSize, &u, &why);
      if (ok) o->exact_sample_min_n = static_cast<int64_t>(u);
    } else if (key == "--json") {
      ok = !value.empty();
      if (!ok) why = "empty path";
      o->json = value;
    } else if (key == "--torch-json") {
      o->torch_json = value;  // empty: no torch timings
    } else if (key == "--inputs") {
      ok = SplitList(value, &items, &why);
      std::vector<std::string> inputs;
      for (size_t j = 0; ok && j < items.size(); ++j) {
        if (!IsInputName(items[j])) {
          why = "unknown input '" + items[j] + "'";
          ok = false;
        } else if (std::find(inputs.begin(), inputs.end(), items[j]) !=
                   inputs.end()) {
          why = "input '" + items[j] + "' repeated";
          ok = false;
        }
        inputs.push_back(items[j]);
      }
      if (ok) o->inputs = inputs;
    } else if (key == "--allow-no-device" || key == "--check-only" ||
               key == "--validate-only") {
      ok = !has_value;
      if (!ok) why = "takes no value";
      if (key == "--allow-no-device") o->no_device_ok = true;
      if (key == "--check-only") o->check_only = true;
      if (key == "--validate-only") o->validate_only = true;
    } else {
      ok = false;
      why = "unknown flag";
    }
    if (!ok) {
      *error = "bad argument '" + a + "': " + why;
      return false;
    }
  }
  return true;
}

// Whether `path` can be written, without leaving a file behind: an existing
// file must be writable (and not a directory), else its directory must
// exist and be writable. Else false and *error says why.
inline bool CheckWritable(const std::string& path, std::string* error) {
  const bool exists = access(path.c_str(), F_OK) == 0;
  FILE* f = std::fopen(path.c_str(), "a");  // creates, never truncates
  if (f == nullptr) {
    *error = "cannot write '" + path + "': " + std::strerror(errno);
    return false;
  }
  std::fclose(f);
  if (!exists) std::remove(path.c_str());
  return true;
}

inline void Usage() {
  std::fprintf(stderr,
               "usage: device_check [--sizes=N,N,...] [--densities=D,...] "
               "[--iters=I] [--warmup=W] [--json=PATH] "
               "[--torch-json=PATH] [--seed=S] [--allow-no-device] "
               "[--check-only] [--inputs=NAME,...] [--budget-s=S] "
               "[--validate-only] [--exact-sample-min-n=N]\n"
               "  N whole, 1..%llu (--exact-sample-min-n: 0..%llu, the "
               "smallest n at which exact starts from a sample); D in (0, 1]; "
               "I %llu..%llu; W %llu..%llu; "
               "S (seed) whole, 0..2^64-1; --budget-s seconds >= 0 (0: none);\n"
               "  --validate-only: check the arguments and that --json can "
               "be written, run nothing (exit 0 or 2)\n"
               "inputs (default all, in this order):",
               static_cast<unsigned long long>(kMaxSize),
               static_cast<unsigned long long>(kMaxSize),
               static_cast<unsigned long long>(kMinIters),
               static_cast<unsigned long long>(kMaxIters),
               static_cast<unsigned long long>(kMinWarmup),
               static_cast<unsigned long long>(kMaxWarmup));
  for (const std::string& name : InputNames()) {
    std::fprintf(stderr, "\n  %-14s %s", name.c_str(),
                 InputDefinition(name).c_str());
  }
  std::fprintf(stderr, "\n");
}

// ParseArgs, then CheckWritable(--json): 0 when both pass, else 2 with the
// reason (and, for a bad argument, the usage) on stderr.
inline int ValidateArgs(int argc, char** argv, Options* o) {
  std::string error;
  if (!ParseArgs(argc, argv, o, &error)) {
    std::fprintf(stderr, "device_check: %s\n", error.c_str());
    Usage();
    return 2;
  }
  if (!CheckWritable(o->json, &error)) {
    std::fprintf(stderr, "device_check: --json: %s\n", error.c_str());
    return 2;
  }
  return 0;
}

}  // namespace device_check
}  // namespace gtopk

#endif  // GTOPK_BENCH_CUDA_DEVICE_CHECK_ARGS_H_
