// The CUDA emulator's stand-in for CUB's <cub/block/block_scan.cuh>.
#include "tests/testing/cuda_emulator/cub.h"
