// Stage: the element-wise kernels: the first non-finite position of u (for
// Wait's message) and the sparse updates of dense vectors (SparseUpdater).
#include "common/cuda/launch.h"
#include "common/cuda/sparsify/device_common.cuh"
#include "common/cuda/sparsify/launchers.h"

namespace gtopk {
namespace cuda {
namespace internal {
namespace {

// state->first_non_finite = the lowest i with a NaN/Inf u[i].
__global__ void FirstNonFiniteKernel(const float* __restrict__ u, uint64_t n,
                                     DeviceState* st) {
  for (uint64_t i = uint64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n;
       i += uint64_t{gridDim.x} * blockDim.x) {
    if (Key(u[i]) >= kNonFiniteKey) atomicMin(&st->first_non_finite, ull{i});
  }
}

// dst[idx[j]] = val[j] (subtract == 0) or dst[idx[j]] - val[j].
__global__ void ScatterKernel(float* dst, uint64_t n,
                              const uint32_t* __restrict__ idx,
                              const float* __restrict__ val, uint64_t count,
                              int subtract) {
  for (uint64_t j = uint64_t{blockIdx.x} * blockDim.x + threadIdx.x; j < count;
       j += uint64_t{gridDim.x} * blockDim.x) {
    const uint32_t i = idx[j];
    if (i >= n) continue;
    if (subtract) {
      const float d = dst[i];
      dst[i] = d - val[j];
    } else {
      dst[i] = val[j];
    }
  }
}

// v = m * velocity + update; velocity = v; params -= v (dense).
__global__ void GlobalMomentumKernel(float* params, float* velocity,
                                     const float* __restrict__ update,
                                     uint64_t n, float m) {
  for (uint64_t i = uint64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n;
       i += uint64_t{gridDim.x} * blockDim.x) {
    const float mv = m * velocity[i];
    const float v = mv + update[i];
    velocity[i] = v;
    const float p = params[i];
    params[i] = p - v;
  }
}

}  // namespace

// (Launches as GTOPK_LAUNCH(kernel, grid, block, stream)(args), a form
// clang-format does not know.)
// clang-format off
void LaunchFirstNonFinite(int blocks, cudaStream_t stream, const float* u,
                          uint64_t n, DeviceState* st) {
  GTOPK_LAUNCH(FirstNonFiniteKernel, blocks, kThreads, stream)(u, n, st);
}

void LaunchScatter(int blocks, cudaStream_t stream, float* dst, uint64_t n,
                   const uint32_t* idx, const float* val, uint64_t count,
                   int subtract) {
  GTOPK_LAUNCH(ScatterKernel, blocks, 256, stream)(dst, n, idx, val, count,
                                                   subtract);
}

void LaunchGlobalMomentum(int blocks, cudaStream_t stream, float* params,
                          float* velocity, const float* update, uint64_t n,
                          float m) {
  GTOPK_LAUNCH(GlobalMomentumKernel, blocks, 256, stream)(params, velocity,
                                                          update, n, m);
}
// clang-format on

}  // namespace internal
}  // namespace cuda
}  // namespace gtopk
