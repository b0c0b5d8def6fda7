// GTOPK_LAUNCH(kernel, grid, block, stream)(args...): a kernel launch,
// `kernel<<<grid, block, 0, stream>>>(args...)` under nvcc and the same
// launch through the CPU emulator (tests/testing/cuda_emulator/emulator.h) when
// that is the <cuda_runtime_api.h> in use. As with <<<>>>, errors are read
// with cudaGetLastError() afterwards.
#ifndef GTOPK_COMMON_CUDA_LAUNCH_H_
#define GTOPK_COMMON_CUDA_LAUNCH_H_

#include <cuda_runtime_api.h>

#if defined(GTOPK_CUDA_EMULATOR)
#define GTOPK_LAUNCH(kernel, grid, block, stream) \
  ::gtopk::cuda_emu::MakeLauncher(#kernel, kernel, grid, block, stream)
#else
#define GTOPK_LAUNCH(kernel, grid, block, stream) \
  kernel<<<grid, block, 0, stream>>>
#endif

#endif  // GTOPK_COMMON_CUDA_LAUNCH_H_
