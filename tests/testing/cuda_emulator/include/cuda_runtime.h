// The CUDA emulator's stand-in for <cuda_runtime.h>
// (tests/testing/cuda_emulator/emulator.h).
#include "tests/testing/cuda_emulator/emulator.h"
