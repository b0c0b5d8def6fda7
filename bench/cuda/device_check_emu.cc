// bench/cuda/device_check.cu compiled by the host compiler against the CUDA
// emulator (tests/testing/cuda_emulator/), linked with the emulated kernels
// (gtopk_cuda_core_emu): the device check's correctness checks, JSON and
// table run for real without a GPU (its timings then measure the emulator,
// not a GPU). cuda_device_check_emu_test runs it on small sizes.
#include "bench/cuda/device_check.cu"  // NOLINT(build/include)
