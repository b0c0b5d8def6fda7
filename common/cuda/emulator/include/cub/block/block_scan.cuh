// The CUDA emulator's stand-in for CUB's <cub/block/block_scan.cuh>.
#include "common/cuda/emulator/cub.h"
