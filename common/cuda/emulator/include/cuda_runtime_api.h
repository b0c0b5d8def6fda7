// The CUDA emulator's stand-in for <cuda_runtime_api.h> (common/cuda/emulator/emulator.h).
#include "common/cuda/emulator/emulator.h"
