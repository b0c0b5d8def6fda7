// Small host helpers of the selector's driver (common/cuda/sparsify/*.cc).
#ifndef GTOPK_COMMON_CUDA_SPARSIFY_HOST_UTIL_H_
#define GTOPK_COMMON_CUDA_SPARSIFY_HOST_UTIL_H_

#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdint>
#include <string>

#include "common/cuda/cuda_status.h"

#define GTOPK_CUDA_LAUNCH_CHECK() GTOPK_CUDA_CALL_OR_RETURN(cudaGetLastError())

namespace gtopk {
namespace cuda {
namespace internal {

inline bool Aligned16(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0;
}

inline std::string FloatText(float x) {
  if (std::isnan(x)) return "nan";
  if (std::isinf(x)) return x > 0 ? "inf" : "-inf";
  return std::to_string(x);
}

// Public entry points launch kernels and check them with cudaGetLastError,
// which also returns a (non-sticky) error an unrelated earlier runtime call
// left behind: discard that first, it is not this call's.
inline void DiscardStaleError() { cudaGetLastError(); }

}  // namespace internal
}  // namespace cuda
}  // namespace gtopk

#endif  // GTOPK_COMMON_CUDA_SPARSIFY_HOST_UTIL_H_
