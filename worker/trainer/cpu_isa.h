// --cpu-isa (worker/flags.md): which CPU kernels libtorch and the libraries
// under it may choose. The same seed and configuration give bit-identical
// parameters only when every process runs the same kernels; left to
// themselves, ATen, oneDNN and an optimised BLAS pick kernels by the CPU
// they find (AVX-512 or AVX2, cache sizes), so two machines differ.
#ifndef GTOPK_WORKER_TRAINER_CPU_ISA_H_
#define GTOPK_WORKER_TRAINER_CPU_ISA_H_

#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"

namespace gtopk {
namespace worker {

// The environment --cpu-isa=portable sets, in order: (variable, value).
//   ATEN_CPU_CAPABILITY=avx2   ATen's vectorised kernels (libtorch 1.13
//                              reads it once, at its first kernel dispatch)
//   ONEDNN_MAX_CPU_ISA=AVX2,   oneDNN (convolutions): no AVX-512/AMX
//   DNNL_MAX_CPU_ISA=AVX2      kernels (read at its first primitive)
//   OPENBLAS_CORETYPE=Haswell  OpenBLAS, when it is the libblas.so.3 in use
//                              (read when the library is loaded)
//   MKL_CBWR=AVX2              MKL's conditional numerical reproducibility,
//                              when MKL is the BLAS (read at its start)
const std::vector<std::pair<std::string, std::string>>& PortableCpuPins();

// Applies --cpu-isa=`isa` to this process, before any torch call:
//   "native"    nothing (the libraries choose for this CPU; variables the
//               user set still apply);
//   "portable"  sets PortableCpuPins() (overriding other values). ATen and
//               oneDNN read theirs lazily, so setting them here is in time
//               (no kernel has run yet); OpenBLAS and MKL read theirs when
//               loaded, before main() when the program links them (or
//               LD_PRELOAD names them; gtopk-worker loads libtorch later,
//               worker/trainer/torch_module.h): when one of them is loaded
//               and its variable had another value, the process
//               re-executes itself (/proc/self/exe, same `argv`; started
//               through the dynamic loader, the loader with the program as
//               its first argument) with the new environment, and this call
//               does not return.
// Errors: INVALID_ARGUMENT naming --cpu-isa for another value;
// FAILED_PRECONDITION for "portable" on a CPU without AVX2 and FMA (the
// pinned kernels would not run there; use --cpu-isa=native); INTERNAL when
// the re-exec fails. `note` (may be null) gets a one-line description of
// what was pinned, for the log. Not thread-safe (setenv): call first thing.
absl::Status ApplyCpuIsa(const std::string& isa, char** argv,
                         std::string* note);

}  // namespace worker
}  // namespace gtopk

#endif  // GTOPK_WORKER_TRAINER_CPU_ISA_H_
