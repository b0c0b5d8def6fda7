#include "worker/trainer/torch_module.h"

#include <dlfcn.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

#ifndef GTOPK_TORCH_MODULE_BUILD_PATH
#define GTOPK_TORCH_MODULE_BUILD_PATH ""
#endif

namespace gtopk {
namespace worker {
namespace {

std::atomic<bool> g_loaded{false};

std::string ExecutableDirectory() {
  std::string path(4096, '\0');
  const ssize_t len = readlink("/proc/self/exe", path.data(), path.size() - 1);
  if (len <= 0) return "";
  path.resize(static_cast<size_t>(len));
  const size_t slash = path.rfind('/');
  return slash == std::string::npos ? "" : path.substr(0, slash);
}

absl::StatusOr<const TorchModuleApi*> Load() {
  const std::vector<std::string> candidates = TorchModuleCandidates();
  for (const std::string& path : candidates) {
    if (access(path.c_str(), F_OK) != 0) continue;
    void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (handle == nullptr) {
      const char* why = dlerror();
      return absl::FailedPreconditionError(absl::StrCat(
          "cannot load gtopk's libtorch module ", path, ": ",
          why != nullptr ? why : "unknown dlopen error",
          " (--model=mlp|cnn and --device=cuda need libtorch: Debian's "
          "libtorch1.13, or the libtorch this gtopk was built against)"));
    }
    void* entry = dlsym(handle, kTorchModuleEntry);
    if (entry == nullptr) {
      return absl::FailedPreconditionError(
          absl::StrCat(path, " is not gtopk's libtorch module (no ",
                       kTorchModuleEntry, ")"));
    }
    const TorchModuleApi* api = reinterpret_cast<TorchModuleEntry>(entry)();
    if (api == nullptr || api->version == nullptr ||
        std::strcmp(api->version, GTOPK_VERSION) != 0) {
      return absl::FailedPreconditionError(
          absl::StrCat(path, " is gtopk ",
                       api == nullptr || api->version == nullptr ? "(unknown)"
                                                                 : api->version,
                       "'s libtorch module; this gtopk-worker is ",
                       GTOPK_VERSION, ": install the module built with it"));
    }
    g_loaded.store(true);
    return api;
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
  const char* given = std::getenv("GTOPK_TORCH_MODULE");
  if (given != nullptr && given[0] != '\0') return {given};
  const std::string dir = ExecutableDirectory();
  if (!dir.empty()) {
    out.push_back(absl::StrCat(dir, "/", kTorchModuleFile));
    out.push_back(absl::StrCat(dir, "/../lib/gtopk/", kTorchModuleFile));
  }
  const std::string build_path = GTOPK_TORCH_MODULE_BUILD_PATH;
  if (!build_path.empty()) out.push_back(build_path);
  return out;
}

absl::StatusOr<const TorchModuleApi*> LoadTorchModule() {
  static std::once_flag once;
  static absl::StatusOr<const TorchModuleApi*>* result = nullptr;
  std::call_once(
      once, [] { result = new absl::StatusOr<const TorchModuleApi*>(Load()); });
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
