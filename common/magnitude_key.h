// The magnitude key of a float: its bits without the sign, so that keys
// order like |x| (+0.0 and -0.0 tie; NaN and +-Inf are the keys at or above
// kNonFiniteKey). The one definition shared by the CPU selectors
// (common/topk.h) and the CUDA kernels (common/cuda/sparsify/), which call
// it in device code too.
#ifndef GTOPK_COMMON_MAGNITUDE_KEY_H_
#define GTOPK_COMMON_MAGNITUDE_KEY_H_

#include <cstdint>
#include <cstring>

// A function callable from host and device code (nvcc); plain C++ elsewhere.
#if defined(__CUDACC__)
#define GTOPK_HOST_DEVICE __host__ __device__
#else
#define GTOPK_HOST_DEVICE
#endif

namespace gtopk {

// Keys at or above this are +-Inf or NaN.
inline constexpr uint32_t kNonFiniteKey = 0x7f800000u;

GTOPK_HOST_DEVICE inline uint32_t MagnitudeKey(float x) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(x) & 0x7fffffffu;
#else
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  return bits & 0x7fffffffu;
#endif
}

}  // namespace gtopk

#endif  // GTOPK_COMMON_MAGNITUDE_KEY_H_
