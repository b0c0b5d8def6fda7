// common/cuda/sparsify.cu compiled by the host compiler against the CUDA
// emulator (the emulator's include directory provides <cuda_runtime_api.h>
// and <cub/...>), for the tests that run the kernels without a GPU.
// The .cu's anonymous-namespace types in Sparsifier::Impl are fine in its
// own translation unit; GCC only warns because it is included here.
#pragma GCC diagnostic ignored "-Wsubobject-linkage"
#include "common/cuda/sparsify.cu"  // NOLINT(build/include)
