// Stage: the sample of runs of 16 values at hashed starts, for dgc's
// threshold and the exact top-k's sampled bound (SampleKernel).
#include "common/cuda/launch.h"
#include "common/cuda/sparsify/device_common.cuh"
#include "common/cuda/sparsify/launchers.h"
#include "common/cuda/sparsify/radix_steps.cuh"

namespace gtopk {
namespace cuda {
namespace internal {
namespace {

// DGC sample: `runs` runs of 16 consecutive keys at hashed starts in
// [0, n - 16] (hash of state's seed and the run); keys to sample[], digit-0
// histogram to hist0. Nothing when the gate is closed.
__global__ void __launch_bounds__(kThreads)
    SampleKernel(const float* __restrict__ u, uint64_t n, uint64_t runs,
                 uint32_t* __restrict__ sample, ull* hist0, DeviceState* st,
                 Gate gate, Then then) {
  if (Closed(gate)) return;   // uniform
  const ull seed = st->seed;  // this step's: a graph replays the kernel
  __shared__ uint32_t hist[kBins];
  for (int i = threadIdx.x; i < kBins; i += kThreads) hist[i] = 0;
  __syncthreads();
  const uint64_t total = runs * 16;
  for (uint64_t g = uint64_t{blockIdx.x} * kThreads + threadIdx.x; g < total;
       g += uint64_t{gridDim.x} * kThreads) {
    const uint64_t run = g / 16;
    const uint64_t start = __umul64hi(Mix(seed, run), n - 15);
    const uint32_t key = Key(u[start + (g % 16)]);
    sample[g] = key;
    atomicAdd(&hist[key >> 20], 1u);
  }
  __syncthreads();
  for (int i = threadIdx.x; i < kBins; i += kThreads) {
    if (hist[i] != 0) atomicAdd(&hist0[i], static_cast<ull>(hist[i]));
  }
  RunThen(st, hist0, then);
}

}  // namespace

// (Launches as GTOPK_LAUNCH(kernel, grid, block, stream)(args), a form
// clang-format does not know.)
// clang-format off
void LaunchSample(int blocks, cudaStream_t stream, const float* u, uint64_t n,
                  uint64_t runs, uint32_t* sample, ull* hist0,
                  DeviceState* st, Gate gate, Then then) {
  GTOPK_LAUNCH(SampleKernel, blocks, kThreads, stream)(
      u, n, runs, sample, hist0, st, gate, then);
}
// clang-format on

}  // namespace internal
}  // namespace cuda
}  // namespace gtopk
