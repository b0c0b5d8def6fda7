// KernelStatus and RAII buffers of the CUDA kernel core (common/cuda/). This
// layer has no Abseil dependency, so that deploy/device/device_check.sh can
// build it with nvcc alone; common/cuda/cuda_selector.h converts to
// absl::Status.
//
// Every CUDA runtime call is checked with GTOPK_CUDA_CALL_OR_RETURN, which
// returns a KernelStatus carrying file:line, the call, and CUDA's error name
// and string (NCCL's checks.h style: errors are returned, never aborted on).
#ifndef GTOPK_COMMON_CUDA_CUDA_STATUS_H_
#define GTOPK_COMMON_CUDA_CUDA_STATUS_H_

#include <cuda_runtime_api.h>

#include <cstddef>
#include <string>
#include <utility>

namespace gtopk {
namespace cuda {

// The subset of absl::StatusCode the kernels report, with Abseil's numbers
// so the adapter is a cast.
enum class KernelStatusCode : int {
  kOk = 0,
  kInvalidArgument = 3,
  kResourceExhausted = 8,
  kFailedPrecondition = 9,
  kInternal = 13,
};

// An error code and a message; default-constructed is OK.
struct KernelStatus {
  KernelStatusCode code = KernelStatusCode::kOk;
  std::string message;

  bool ok() const { return code == KernelStatusCode::kOk; }
  static KernelStatus Ok() { return KernelStatus(); }
  static KernelStatus Error(KernelStatusCode code, std::string message) {
    KernelStatus s;
    s.code = code;
    s.message = std::move(message);
    return s;
  }
};

// "<file>:<line>: <call>: <cudaErrorName>: <cudaGetErrorString>". Out of
// memory is RESOURCE_EXHAUSTED, everything else INTERNAL. Clears CUDA's
// last-error state.
inline KernelStatus CudaError(cudaError_t error, const char* call,
                              const char* file, int line) {
  // The runtime also records the error as its "last error", which the next
  // launch check (cudaGetLastError) would report again: reset it (a sticky
  // error survives and keeps failing, as it should).
  cudaGetLastError();
  std::string message = std::string(file) + ":" + std::to_string(line) + ": " +
                        call + ": " + cudaGetErrorName(error) + ": " +
                        cudaGetErrorString(error);
  return KernelStatus::Error(error == cudaErrorMemoryAllocation
                                 ? KernelStatusCode::kResourceExhausted
                                 : KernelStatusCode::kInternal,
                             std::move(message));
}

}  // namespace cuda
}  // namespace gtopk

// Evaluates a CUDA runtime call (a cudaError_t); returns a KernelStatus
// from the enclosing function (which must return gtopk::cuda::KernelStatus)
// when it fails. Every *_RETURN_IF_ERROR macro of the project takes a
// status object (absl::Status: GTOPK_RETURN_IF_ERROR, KernelStatus:
// GTOPK_CUDA_RETURN_IF_ERROR); a raw runtime call goes through this one.
#define GTOPK_CUDA_CALL_OR_RETURN(call)                                   \
  do {                                                                    \
    const cudaError_t gtopk_cuda_error_ = (call);                         \
    if (gtopk_cuda_error_ != cudaSuccess) {                               \
      return ::gtopk::cuda::CudaError(gtopk_cuda_error_, #call, __FILE__, \
                                      __LINE__);                          \
    }                                                                     \
  } while (false)

// Propagates a non-OK gtopk::cuda::KernelStatus.
#define GTOPK_CUDA_RETURN_IF_ERROR(expr)                     \
  do {                                                       \
    ::gtopk::cuda::KernelStatus gtopk_cuda_status_ = (expr); \
    if (!gtopk_cuda_status_.ok()) return gtopk_cuda_status_; \
  } while (false)

namespace gtopk {
namespace cuda {

// How a buffer gets and frees its memory: device memory (cudaMalloc) or
// page-locked host memory (cudaMallocHost, the target of async copies).
struct DeviceMemory {
  static cudaError_t Allocate(void** p, size_t bytes) {
    return cudaMalloc(p, bytes);
  }
  static void Free(void* p) { cudaFree(p); }  // cannot fail usefully here
};
struct PinnedMemory {
  static cudaError_t Allocate(void** p, size_t bytes) {
    return cudaMallocHost(p, bytes);
  }
  static void Free(void* p) { cudaFreeHost(p); }
};

// `size()` elements of T (uninitialised) in the memory `Memory` gives,
// freed on destruction. Move-only. Allocation errors are returned by
// Allocate (RESOURCE_EXHAUSTED when out of memory). Not thread-safe.
template <typename T, typename Memory>
class Buffer {
 public:
  Buffer() = default;
  ~Buffer() { Reset(); }
  Buffer(Buffer&& o) noexcept
      : data_(std::exchange(o.data_, nullptr)),
        size_(std::exchange(o.size_, 0)) {}
  Buffer& operator=(Buffer&& o) noexcept {
    if (this != &o) {
      Reset();
      data_ = std::exchange(o.data_, nullptr);
      size_ = std::exchange(o.size_, 0);
    }
    return *this;
  }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  // Frees what was held and allocates `size` elements (none for 0).
  KernelStatus Allocate(size_t size) {
    Reset();
    if (size == 0) return KernelStatus::Ok();
    void* p = nullptr;
    GTOPK_CUDA_CALL_OR_RETURN(Memory::Allocate(&p, size * sizeof(T)));
    data_ = static_cast<T*>(p);
    size_ = size;
    return KernelStatus::Ok();
  }
  void Reset() {
    if (data_ != nullptr) Memory::Free(data_);
    data_ = nullptr;
    size_ = 0;
  }
  T* get() const { return data_; }
  size_t size() const { return size_; }

 private:
  T* data_ = nullptr;
  size_t size_ = 0;
};

template <typename T>
using DeviceBuffer = Buffer<T, DeviceMemory>;
template <typename T>
using PinnedBuffer = Buffer<T, PinnedMemory>;

}  // namespace cuda
}  // namespace gtopk

#endif  // GTOPK_COMMON_CUDA_CUDA_STATUS_H_
