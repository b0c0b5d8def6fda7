// Status and RAII buffers of the CUDA kernel core (common/cuda/). This layer
// has no Abseil dependency, so that bench/cuda/device_check.sh can build it
// with nvcc alone; common/cuda/cuda_selector.h converts to absl::Status.
//
// Every CUDA runtime call is checked with GTOPK_CUDA_RETURN_IF_ERROR, which
// returns a Status carrying file:line, the call, and CUDA's error name and
// string (NCCL's checks.h style: errors are returned, never aborted on).
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
enum class StatusCode : int {
  kOk = 0,
  kInvalidArgument = 3,
  kResourceExhausted = 8,
  kFailedPrecondition = 9,
  kInternal = 13,
};

// An error code and a message; default-constructed is OK.
struct Status {
  StatusCode code = StatusCode::kOk;
  std::string message;

  bool ok() const { return code == StatusCode::kOk; }
  static Status Ok() { return Status(); }
  static Status Error(StatusCode code, std::string message) {
    Status s;
    s.code = code;
    s.message = std::move(message);
    return s;
  }
};

// "<file>:<line>: <call>: <cudaErrorName>: <cudaGetErrorString>". Out of
// memory is RESOURCE_EXHAUSTED, everything else INTERNAL.
inline Status CudaError(cudaError_t error, const char* call, const char* file,
                        int line) {
  std::string message = std::string(file) + ":" + std::to_string(line) + ": " +
                        call + ": " + cudaGetErrorName(error) + ": " +
                        cudaGetErrorString(error);
  return Status::Error(error == cudaErrorMemoryAllocation
                           ? StatusCode::kResourceExhausted
                           : StatusCode::kInternal,
                       std::move(message));
}

}  // namespace cuda
}  // namespace gtopk

// Evaluates a CUDA runtime call; returns a Status from the enclosing function
// (which must return gtopk::cuda::Status) when it fails.
#define GTOPK_CUDA_RETURN_IF_ERROR(call)                                  \
  do {                                                                    \
    const cudaError_t gtopk_cuda_error_ = (call);                         \
    if (gtopk_cuda_error_ != cudaSuccess) {                               \
      return ::gtopk::cuda::CudaError(gtopk_cuda_error_, #call, __FILE__, \
                                      __LINE__);                          \
    }                                                                     \
  } while (false)

// Propagates a non-OK gtopk::cuda::Status.
#define GTOPK_CUDA_RETURN_IF_NOT_OK(expr)                    \
  do {                                                       \
    ::gtopk::cuda::Status gtopk_cuda_status_ = (expr);       \
    if (!gtopk_cuda_status_.ok()) return gtopk_cuda_status_; \
  } while (false)

namespace gtopk {
namespace cuda {

// Device memory for `size()` elements of T (uninitialised), freed on
// destruction. Move-only. Allocation errors are returned by Allocate.
template <typename T>
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  ~DeviceBuffer() { Reset(); }
  DeviceBuffer(DeviceBuffer&& o) noexcept
      : data_(std::exchange(o.data_, nullptr)),
        size_(std::exchange(o.size_, 0)) {}
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    if (this != &o) {
      Reset();
      data_ = std::exchange(o.data_, nullptr);
      size_ = std::exchange(o.size_, 0);
    }
    return *this;
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  // Frees what was held and allocates `size` elements (none for 0).
  Status Allocate(size_t size) {
    Reset();
    if (size == 0) return Status::Ok();
    void* p = nullptr;
    GTOPK_CUDA_RETURN_IF_ERROR(cudaMalloc(&p, size * sizeof(T)));
    data_ = static_cast<T*>(p);
    size_ = size;
    return Status::Ok();
  }
  void Reset() {
    if (data_ != nullptr) cudaFree(data_);  // cannot fail usefully here
    data_ = nullptr;
    size_ = 0;
  }
  T* get() const { return data_; }
  size_t size() const { return size_; }

 private:
  T* data_ = nullptr;
  size_t size_ = 0;
};

// Page-locked host memory for `size()` elements of T, the target of async
// device-to-host copies. Move-only.
template <typename T>
class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  ~PinnedBuffer() { Reset(); }
  PinnedBuffer(PinnedBuffer&& o) noexcept
      : data_(std::exchange(o.data_, nullptr)),
        size_(std::exchange(o.size_, 0)) {}
  PinnedBuffer& operator=(PinnedBuffer&& o) noexcept {
    if (this != &o) {
      Reset();
      data_ = std::exchange(o.data_, nullptr);
      size_ = std::exchange(o.size_, 0);
    }
    return *this;
  }
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;

  Status Allocate(size_t size) {
    Reset();
    if (size == 0) return Status::Ok();
    void* p = nullptr;
    GTOPK_CUDA_RETURN_IF_ERROR(cudaMallocHost(&p, size * sizeof(T)));
    data_ = static_cast<T*>(p);
    size_ = size;
    return Status::Ok();
  }
  void Reset() {
    if (data_ != nullptr) cudaFreeHost(data_);
    data_ = nullptr;
    size_ = 0;
  }
  T* get() const { return data_; }
  size_t size() const { return size_; }

 private:
  T* data_ = nullptr;
  size_t size_ = 0;
};

}  // namespace cuda
}  // namespace gtopk

#endif  // GTOPK_COMMON_CUDA_CUDA_STATUS_H_
