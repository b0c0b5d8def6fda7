// gtopk-worker's libtorch half as a shared module loaded on first use.
//
// Only model_torch.cc includes libtorch. It is built as the module
// libgtopk_torch_model.so (worker/CMakeLists.txt), not linked into
// gtopk-worker: loading libtorch (its static initialisers register some
// thousands of operators) costs about 0.4 CPU-seconds per process, which a
// worker that only parses its flags, prints --help or trains synthetic:N
// never needs. MakeTorchModel, MakeTorchDeviceMirror and TorchCudaAvailable
// (model.h) load the module on their first call (dlopen, once per process)
// and call into it; a side effect: OpenBLAS and MKL now read --cpu-isa's
// pins when the module loads, after ApplyCpuIsa set them, so the worker
// never re-executes itself for them.
//
// Where the module is looked for: GTOPK_TORCH_MODULE, when set and not
// empty, is the one path (a relocated install; tests; relative to the
// working directory); else, in order (the first that exists is loaded; one
// that exists and fails to load is an error, not skipped):
//   1. <directory of the running executable>/libgtopk_torch_model.so (the
//      build tree: build/worker/, beside gtopk-worker);
//   2. <directory of the running executable>/../lib/gtopk/
//      libgtopk_torch_model.so (an installed layout: /usr/local/bin and
//      /usr/local/lib/gtopk, as the worker images have it);
//   3. the module's path in the build tree that compiled this file (test
//      programs in build/tests/).
// The running executable: /proc/self/exe with links resolved, and also the
// program the dynamic loader recorded when that differs (a program run as
// /lib64/ld-linux-x86-64.so.2 PROGRAM: 1 and 2 for each, in that order).
//
// Against static Abseil archives (the device bundle) the module is linked
// without Abseil and uses the program's: gtopk-worker and every program
// linking gtopk_trainer export their Abseil symbols (worker/CMakeLists.txt),
// so one Abseil serves both sides, as Debian's shared one does otherwise.
#ifndef GTOPK_WORKER_TRAINER_TORCH_MODULE_H_
#define GTOPK_WORKER_TRAINER_TORCH_MODULE_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "worker/trainer/model.h"

namespace gtopk {
namespace worker {

// The module's file name and the one symbol it exports (extern "C").
inline constexpr char kTorchModuleFile[] = "libgtopk_torch_model.so";
inline constexpr char kTorchModuleEntry[] = "gtopk_torch_model_api";

// What the module's entry returns: a static table, valid for the life of
// the process. `version` is the build's GTOPK_TORCH_MODULE_ABI: the
// version and a hash of model.h and this header, the types that cross the
// boundary (worker/CMakeLists.txt); the loader refuses a module whose
// string differs.
struct TorchModuleApi {
  const char* version;
  absl::StatusOr<std::unique_ptr<Model>> (*make_model)(const std::string& name,
                                                       uint64_t seed,
                                                       int threads, bool cuda);
  absl::StatusOr<std::unique_ptr<Model>> (*make_device_mirror)(
      std::unique_ptr<Model> host);
  bool (*cuda_available)();
};
using TorchModuleEntry = const TorchModuleApi* (*)();

// The candidate paths above, in order (GTOPK_TORCH_MODULE alone when set;
// the executable's directory from /proc/self/exe).
std::vector<std::string> TorchModuleCandidates();

// Loads the module once per process (thread-safe; later calls return the
// first call's result, an error included) and returns its table.
// Errors: FAILED_PRECONDITION naming every path tried when none exists,
// with dlerror() when one exists and does not load (e.g. libtorch is not
// installed: Debian's libtorch1.13), when it lacks kTorchModuleEntry, or
// when its version is not this build's.
absl::StatusOr<const TorchModuleApi*> LoadTorchModule();

// Whether libtorch is in this process yet (the module loaded): a test hook
// for "a worker that never builds a torch model never loads libtorch".
bool TorchModuleLoaded();

}  // namespace worker
}  // namespace gtopk

#endif  // GTOPK_WORKER_TRAINER_TORCH_MODULE_H_
