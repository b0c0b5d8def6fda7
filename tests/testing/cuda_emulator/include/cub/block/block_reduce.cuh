// The CUDA emulator's stand-in for CUB's <cub/block/block_reduce.cuh>.
#include "tests/testing/cuda_emulator/cub.h"
