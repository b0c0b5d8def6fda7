// Stage: the reset of the selection state (InitKernel).
#include "common/cuda/launch.h"
#include "common/cuda/sparsify/launchers.h"
#include "common/cuda/sparsify/init_block.cuh"

namespace gtopk {
namespace cuda {
namespace internal {
namespace {

__global__ void InitKernel(DeviceState* st, InitArgs a, Gate gate) {
  if (Closed(gate)) return;  // uniform
  InitBlock(st, a);
}

}  // namespace

void LaunchInit(cudaStream_t stream, DeviceState* st, const InitArgs& a,
                Gate gate) {
  GTOPK_LAUNCH(InitKernel, 1, kScanThreads, stream)(st, a, gate);
}

}  // namespace internal
}  // namespace cuda
}  // namespace gtopk
