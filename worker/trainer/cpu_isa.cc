#include "worker/trainer/cpu_isa.h"

#include <dlfcn.h>
#include <limits.h>
#include <stdlib.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"

namespace gtopk {
namespace worker {

const std::vector<std::pair<std::string, std::string>>& PortableCpuPins() {
  static const auto* pins =
      new std::vector<std::pair<std::string, std::string>>{
          {"ATEN_CPU_CAPABILITY", "avx2"},
          {"ONEDNN_MAX_CPU_ISA", "AVX2"},
          {"DNNL_MAX_CPU_ISA", "AVX2"},
          {"OPENBLAS_CORETYPE", "Haswell"},
          {"MKL_CBWR", "AVX2"},
      };
  return *pins;
}

namespace {

// Whether the library that reads `variable` when it is loaded is loaded
// (a symbol only it exports, looked up in the whole process).
bool ReadAtLoadAndLoaded(const std::string& variable) {
  if (variable == "OPENBLAS_CORETYPE") {
    return dlsym(RTLD_DEFAULT, "openblas_get_config") != nullptr;
  }
  if (variable == "MKL_CBWR") {
    return dlsym(RTLD_DEFAULT, "MKL_Get_Version") != nullptr;
  }
  return false;
}

// Runs this program again with the same arguments. /proc/self/exe is the
// dynamic loader when the program was started through it
// (/lib64/ld-linux-x86-64.so.2 gtopk-worker ...; the loader recorded the
// program, found with dladdr, as the main program): the loader then gets
// the program back as its first argument. Returns only on failure.
void ExecAgain(char** argv) {
  char self[PATH_MAX];
  char program[PATH_MAX];
  Dl_info info;
  if (realpath("/proc/self/exe", self) != nullptr &&
      dladdr(reinterpret_cast<void*>(&ApplyCpuIsa), &info) != 0 &&
      info.dli_fname != nullptr && info.dli_fname[0] != '\0' &&
      realpath(info.dli_fname, program) != nullptr &&
      std::strcmp(self, program) != 0) {
    std::vector<char*> args = {self, program};
    for (char** a = argv + 1; *a != nullptr; ++a) args.push_back(*a);
    args.push_back(nullptr);
    execv(self, args.data());
    return;
  }
  execv("/proc/self/exe", argv);
}

}  // namespace

absl::Status ApplyCpuIsa(const std::string& isa, char** argv,
                         std::string* note) {
  if (isa == "native") {
    if (note != nullptr) {
      *note =
          "--cpu-isa=native: libtorch chooses the CPU kernels for this "
          "machine (results may differ on another CPU)";
    }
    return absl::OkStatus();
  }
  if (isa != "portable") {
    return absl::InvalidArgumentError(absl::StrCat(
        "--cpu-isa must be portable or native, got \"", isa, "\""));
  }
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma")) {
    return absl::FailedPreconditionError(
        "--cpu-isa=portable pins libtorch to its AVX2 kernels, and this CPU "
        "has no AVX2/FMA; use --cpu-isa=native (results then depend on the "
        "CPU)");
  }
#else
  return absl::FailedPreconditionError(
      "--cpu-isa=portable pins x86-64 AVX2 kernels; on this architecture "
      "use --cpu-isa=native");
#endif
  bool exec_again = false;
  std::string pinned;
  for (const auto& [variable, value] : PortableCpuPins()) {
    const char* current = std::getenv(variable.c_str());
    if (current == nullptr || value != current) {
      if (ReadAtLoadAndLoaded(variable)) exec_again = true;
      setenv(variable.c_str(), value.c_str(), /*overwrite=*/1);
    }
    absl::StrAppend(&pinned, pinned.empty() ? "" : " ", variable, "=", value);
  }
  if (exec_again) {
    ExecAgain(argv);
    return absl::InternalError(absl::StrCat(
        "--cpu-isa=portable: re-executing /proc/self/exe with the BLAS "
        "pinned failed: ",
        std::strerror(errno)));
  }
  if (note != nullptr) {
    *note = absl::StrCat("--cpu-isa=portable: ", pinned);
  }
  return absl::OkStatus();
}

}  // namespace worker
}  // namespace gtopk
