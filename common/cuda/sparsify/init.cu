// Stage: the reset of the selection state (InitKernel).
#include "common/cuda/launch.h"
#include "common/cuda/sparsify/init_block.cuh"
#include "common/cuda/sparsify/launchers.h"

namespace gtopk {
namespace cuda {
namespace internal {
namespace {

__global__ void InitKernel(DeviceState* st, InitArgs a, Gate gate) {
  if (Closed(gate)) return;  // uniform
  InitBlock(st, a);
}

}  // namespace

// (Launches as GTOPK_LAUNCH(kernel, grid, block, stream)(args), a form
// clang-format does not know.)
// clang-format off
void LaunchInit(cudaStream_t stream, DeviceState* st, const InitArgs& a,
                Gate gate) {
  GTOPK_LAUNCH(InitKernel, 1, kScanThreads, stream)(st, a, gate);
}
// clang-format on

}  // namespace internal
}  // namespace cuda
}  // namespace gtopk
