#include "worker/trainer/torch_module.h"

#include <dlfcn.h>
#include <limits.h>
#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

#ifndef GTOPK_TORCH_MODULE_BUILD_PATH
#define GTOPK_TORCH_MODULE_BUILD_PATH ""
#endif
#ifndef GTOPK_TORCH_MODULE_ABI
#define GTOPK_TORCH_MODULE_ABI GTOPK_VERSION
#endif

namespace gtopk {
namespace worker {
namespace {

std::atomic<bool> g_loaded{false};

// The directories of the running program, each once: /proc/self/exe's
// (links resolved), then the one the dynamic loader recorded for the main
// program (dladdr on a function of it), which differs when the program runs
// through the loader (/lib64/ld-linux-x86-64.so.2 gtopk-worker ...:
// /proc/self/exe is the loader then).
std::vector<std::string> ProgramDirectories() {
  std::vector<std::string> dirs;
  const auto add = [&dirs](const char* file) {
    char resolved[PATH_MAX];
    if (realpath(file, resolved) == nullptr) return;
    const std::string path(resolved);
    const size_t slash = path.rfind('/');
    if (slash == std::string::npos) return;
    const std::string dir = path.substr(0, slash);
    if (std::find(dirs.begin(), dirs.end(), dir) == dirs.end()) {
      dirs.push_back(dir);
    }
  };
  add("/proc/self/exe");
  Dl_info info;
  if (dladdr(reinterpret_cast<void*>(&TorchModuleCandidates), &info) != 0 &&
      info.dli_fname != nullptr &&
      std::strchr(info.dli_fname, '/') != nullptr) {
    add(info.dli_fname);
  }
  return dirs;
}

// GTOPK_TORCH_MODULE when set and not empty, made absolute (a relative
// path is the working directory's, as a shell reads it), else "".
std::string GivenModule() {
  const char* given = std::getenv("GTOPK_TORCH_MODULE");
  if (given == nullptr || given[0] == '\0') return "";
  if (given[0] == '/') return given;
  char cwd[PATH_MAX];
  if (getcwd(cwd, sizeof(cwd)) == nullptr) return given;
  return absl::StrCat(cwd, "/", given);
}

absl::StatusOr<const TorchModuleApi*> Load() {
  const std::vector<std::string> candidates = TorchModuleCandidates();
  for (const std::string& path : candidates) {
    if (access(path.c_str(), F_OK) != 0) continue;
    void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (handle == nullptr) {
      const char* error = dlerror();
      const std::string why = error != nullptr ? error : "unknown dlopen error";
      // dlerror names the file that failed: the module itself (not a shared
      // library: a directory, an empty or foreign file), or a library it
      // needs, most likely libtorch's.
      const bool dependency = why.rfind(path + ":", 0) != 0;
      return absl::FailedPreconditionError(absl::StrCat(
          "cannot load gtopk's libtorch module ", path, ": ", why,
          dependency ? " (the module needs libtorch: Debian's libtorch1.13, "
                       "or the libtorch this gtopk was built against)"
                     : ""));
    }
    void* entry = dlsym(handle, kTorchModuleEntry);
    if (entry == nullptr) {
      dlclose(handle);
      return absl::FailedPreconditionError(
          absl::StrCat(path, " is not gtopk's libtorch module (no ",
                       kTorchModuleEntry, ")"));
    }
    const TorchModuleApi* api = reinterpret_cast<TorchModuleEntry>(entry)();
    if (api == nullptr || api->version == nullptr ||
        std::strcmp(api->version, GTOPK_TORCH_MODULE_ABI) != 0) {
      const std::string theirs = api == nullptr || api->version == nullptr
                                     ? "(unknown)"
                                     : api->version;
      dlclose(handle);
      return absl::FailedPreconditionError(
          absl::StrCat(path, " is the libtorch module of gtopk ", theirs,
                       "; this gtopk-worker is ", GTOPK_TORCH_MODULE_ABI,
                       ": install the module built with it"));
    }
    g_loaded.store(true);
    return api;
  }
  const std::string given = GivenModule();
  if (!given.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "GTOPK_TORCH_MODULE=", given,
        ": no such file (gtopk's libtorch module, needed by --model=mlp|cnn "
        "and --device=cuda; the variable replaces the search beside "
        "gtopk-worker)"));
  }
  return absl::FailedPreconditionError(absl::StrCat(
      "gtopk's libtorch module (", kTorchModuleFile,
      ", needed by --model=mlp|cnn and --device=cuda) was not found; looked "
      "at: ",
      absl::StrJoin(candidates, ", "),
      ". Install it beside gtopk-worker or in ../lib/gtopk/ from it, or "
      "name it in GTOPK_TORCH_MODULE"));
}

}  // namespace

std::vector<std::string> TorchModuleCandidates() {
  std::vector<std::string> out;
  if (std::string given = GivenModule(); !given.empty()) return {given};
  for (const std::string& dir : ProgramDirectories()) {
    out.push_back(absl::StrCat(dir, "/", kTorchModuleFile));
    out.push_back(absl::StrCat(dir, "/../lib/gtopk/", kTorchModuleFile));
  }
  const std::string build_path = GTOPK_TORCH_MODULE_BUILD_PATH;
  if (!build_path.empty()) out.push_back(build_path);
  return out;
}

absl::StatusOr<const TorchModuleApi*> LoadTorchModule() {
  // Once per process (a function-local static's initialisation is
  // thread-safe); never destroyed, as the module stays loaded.
  static const auto* const result =
      new absl::StatusOr<const TorchModuleApi*>(Load());
  return *result;
}

bool TorchModuleLoaded() { return g_loaded.load(); }

absl::StatusOr<std::unique_ptr<Model>> MakeTorchModel(const std::string& name,
                                                      uint64_t seed,
                                                      int threads, bool cuda) {
  absl::StatusOr<const TorchModuleApi*> api = LoadTorchModule();
  if (!api.ok()) return api.status();
  return (*api)->make_model(name, seed, threads, cuda);
}

absl::StatusOr<std::unique_ptr<Model>> MakeTorchDeviceMirror(
    std::unique_ptr<Model> host) {
  absl::StatusOr<const TorchModuleApi*> api = LoadTorchModule();
  if (!api.ok()) return api.status();
  return (*api)->make_device_mirror(std::move(host));
}

bool TorchCudaAvailable() {
  absl::StatusOr<const TorchModuleApi*> api = LoadTorchModule();
  return api.ok() && (*api)->cuda_available();
}

}  // namespace worker
}  // namespace gtopk
