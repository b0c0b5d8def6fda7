// A CPU emulation of the part of the CUDA runtime and execution model that
// common/cuda/ uses, so that the kernels run, and are tested against the CPU
// reference, on machines without a GPU (CI). Test tooling: nothing in a
// production binary links it.
//
// How it runs a kernel: every thread of a block is a fiber (Boost.Context);
// a thread runs until its next __syncthreads(), __ballot_sync() or block
// collective (cub::BlockScan/BlockReduce), then the next thread runs (the
// suspending thread switches to it directly, and a thread that exits hands
// its fiber to the next one not yet started: one switch per suspension). A
// barrier opens when every thread of the block that has not exited reached
// it (from the same source line), a ballot when every lane of its mask did.
// Blocks run one after another. That is the CUDA model with the scheduling
// freedom used one way; GTOPK_CUDA_EMU_ORDER=reverse|shuffle changes the
// order of threads between sync points and of blocks, so an unsynchronised
// shared-memory access or an inter-block order dependency shows up as a
// different result between runs.
//
// What it checks (each fails the process with a message naming the kernel,
// block and thread): divergent __syncthreads (threads waiting at different
// lines), a ballot whose mask names a lane that exited, a deadlock, a
// BlockScan/BlockReduce used with another block size than its template
// argument or reached while a thread of the block has exited (each
// collective call site is its own barrier), a read or write past the end of a
// cudaMalloc/cudaMallocHost allocation (a guard page right behind the
// 16-byte-rounded end; the SIGSEGV handler names the allocation), a read or
// write before its start that leaves the allocation's page-rounding slack (a
// guard page; the start is on it when the size is a multiple of 4096 bytes), a
// write into that slack (a canary, checked after every kernel and at free; a
// read there is not caught), use after cudaFree (freed ranges stay inaccessible
// for the next 256 frees; the message says "use after free"), a kernel pointer
// argument that is not device or pinned memory (top-level pointer arguments
// only: pointers inside a struct argument are not checked), launch
// configurations CUDA rejects (cudaErrorInvalidConfiguration, as the real
// runtime reports it). Device memory starts as 0xff bytes (NaN floats), so
// reading what nothing wrote is visible. Work on streams runs as late as
// CUDA allows: when the host waits for it, and then only what that wait
// depends on (program order in a stream; the legacy default stream against
// blocking streams; nothing between a cudaStreamNonBlocking stream and the
// others). So reading pinned results before cudaStreamSynchronize reads
// stale data, and a kernel on a non-blocking stream runs before an earlier
// cudaMemset or pageable cudaMemcpy on the default stream, as either can on
// a GPU. Copies behave as CUDA's "API synchronization behavior" documents
// (from pageable memory: staged before the call returns, DMA pending; to
// pageable memory: done on return; cudaMemset: asynchronous).
//
// Settings: GTOPK_CUDA_EMU="key=value ..." with order = forward (default) |
// reverse | shuffle, seed (shuffle seed, default 1), sms (multiprocessor
// count reported, default 132 as an H200; it sets the selectors' grid
// sizes), memory_bytes (device memory, default 4 GiB; cudaMalloc beyond it
// returns cudaErrorMemoryAllocation), blocks_per_sm (what
// cudaOccupancyMaxActiveBlocksPerMultiprocessor answers; default 2048
// threads' worth). A bad setting aborts with a message.
//
// Thread-safety: every runtime call takes one process-wide lock; kernels run
// on the host thread that synchronises, one at a time (one device).
// Not emulated: warp-synchronous code without __*_sync intrinsics, memory
// ordering between blocks of one launch, shared memory's undefined contents
// at block start (__shared__ variables are function statics here), timing.
#ifndef GTOPK_TESTS_TESTING_CUDA_EMULATOR_EMULATOR_H_
#define GTOPK_TESTS_TESTING_CUDA_EMULATOR_EMULATOR_H_

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <tuple>
#include <type_traits>
#include <utility>

#define GTOPK_CUDA_EMULATOR 1

// ---------------------------------------------------------------------------
// Qualifiers and built-in types
// ---------------------------------------------------------------------------
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static

struct uint3 {
  unsigned int x, y, z;
};
struct dim3 {
  unsigned int x, y, z;
  constexpr dim3(unsigned int vx = 1, unsigned int vy = 1, unsigned int vz = 1)
      : x(vx), y(vy), z(vz) {}
};
struct alignas(16) float4 {
  float x, y, z, w;
};
inline float4 make_float4(float x, float y, float z, float w) {
  return float4{x, y, z, w};
}

// The executing thread's coordinates (set by the scheduler before it resumes
// a thread).
extern uint3 threadIdx;
extern uint3 blockIdx;
extern dim3 blockDim;
extern dim3 gridDim;

// ---------------------------------------------------------------------------
// Runtime API types and functions (the subset used; CUDA's numbers)
// ---------------------------------------------------------------------------
enum cudaError_t {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorMemoryAllocation = 2,
  cudaErrorInvalidConfiguration = 9,
  cudaErrorInvalidDevicePointer = 17,
  cudaErrorInvalidMemcpyDirection = 21,
  cudaErrorNoDevice = 100,
  cudaErrorInvalidDevice = 101,
  cudaErrorInvalidResourceHandle = 400,
  cudaErrorNotReady = 600,
  cudaErrorStreamCaptureUnsupported = 900,
  cudaErrorStreamCaptureInvalidated = 901,
  cudaErrorLaunchFailure = 719,
};
using cudaError = cudaError_t;

enum cudaMemcpyKind {
  cudaMemcpyHostToHost = 0,
  cudaMemcpyHostToDevice = 1,
  cudaMemcpyDeviceToHost = 2,
  cudaMemcpyDeviceToDevice = 3,
  cudaMemcpyDefault = 4,
};

enum cudaDeviceAttr {
  cudaDevAttrMaxThreadsPerBlock = 1,
  cudaDevAttrMultiProcessorCount = 16,
};

constexpr unsigned int cudaStreamDefault = 0x0;
constexpr unsigned int cudaStreamNonBlocking = 0x1;

struct CUstream_st;
using cudaStream_t = CUstream_st*;
struct CUevent_st;
using cudaEvent_t = CUevent_st*;

struct cudaDeviceProp {
  char name[256];
  size_t totalGlobalMem;
  int multiProcessorCount;
  int maxThreadsPerBlock;
  int warpSize;
  int major;
  int minor;
};

cudaError_t cudaGetDeviceCount(int* count);
cudaError_t cudaGetDevice(int* device);
cudaError_t cudaSetDevice(int device);
cudaError_t cudaGetDeviceProperties(cudaDeviceProp* prop, int device);
cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device);
cudaError_t cudaDeviceSynchronize();
cudaError_t cudaGetLastError();
cudaError_t cudaPeekAtLastError();
const char* cudaGetErrorName(cudaError_t error);
const char* cudaGetErrorString(cudaError_t error);

cudaError_t cudaMalloc(void** ptr, size_t bytes);
cudaError_t cudaFree(void* ptr);
cudaError_t cudaMallocHost(void** ptr, size_t bytes);
cudaError_t cudaFreeHost(void* ptr);
cudaError_t cudaMemcpy(void* dst, const void* src, size_t bytes,
                       cudaMemcpyKind kind);
cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes,
                            cudaMemcpyKind kind, cudaStream_t stream = nullptr);
cudaError_t cudaMemset(void* ptr, int value, size_t bytes);
cudaError_t cudaMemsetAsync(void* ptr, int value, size_t bytes,
                            cudaStream_t stream = nullptr);

cudaError_t cudaStreamCreate(cudaStream_t* stream);
cudaError_t cudaStreamCreateWithFlags(cudaStream_t* stream, unsigned int flags);
cudaError_t cudaStreamDestroy(cudaStream_t stream);
cudaError_t cudaStreamSynchronize(cudaStream_t stream);

// CUDA graphs by stream capture (the subset used): between
// cudaStreamBeginCapture and cudaStreamEndCapture, work enqueued on the
// stream (kernels, async copies and memsets) is recorded instead of queued,
// with its arguments as they were at the call; cudaGraphLaunch enqueues the
// recorded work again, in order, on any stream. As on a GPU, capture on the
// legacy default stream is refused (cudaErrorStreamCaptureUnsupported), and
// a synchronising call on the capturing stream (cudaStreamSynchronize, a
// copy that must finish before it returns) fails with
// cudaErrorStreamCaptureUnsupported and invalidates the capture
// (cudaStreamEndCapture then returns cudaErrorStreamCaptureInvalidated).
enum cudaStreamCaptureMode {
  cudaStreamCaptureModeGlobal = 0,
  cudaStreamCaptureModeThreadLocal = 1,
  cudaStreamCaptureModeRelaxed = 2,
};
struct CUgraph_st;
using cudaGraph_t = CUgraph_st*;
struct CUgraphExec_st;
using cudaGraphExec_t = CUgraphExec_st*;
cudaError_t cudaStreamBeginCapture(cudaStream_t stream,
                                   cudaStreamCaptureMode mode);
cudaError_t cudaStreamEndCapture(cudaStream_t stream, cudaGraph_t* graph);
cudaError_t cudaGraphInstantiate(cudaGraphExec_t* exec, cudaGraph_t graph,
                                 unsigned long long flags = 0);
cudaError_t cudaGraphLaunch(cudaGraphExec_t exec, cudaStream_t stream);
cudaError_t cudaGraphDestroy(cudaGraph_t graph);
cudaError_t cudaGraphExecDestroy(cudaGraphExec_t exec);

// Blocks of `block_size` threads resident per multiprocessor: 2048 threads'
// worth (an H100/H200 SM), at most 32 blocks; registers are not modelled.
// (GTOPK_CUDA_EMU's blocks_per_sm overrides it, e.g. 5 for a kernel that
// holds 47 registers on an H200).
int __gtopk_emu_blocks_per_sm(int block_size);
template <typename Kernel>
cudaError_t cudaOccupancyMaxActiveBlocksPerMultiprocessor(
    int* blocks, Kernel, int block_size, size_t dynamic_shared_bytes) {
  if (blocks == nullptr || block_size <= 0 || block_size > 1024 ||
      dynamic_shared_bytes != 0) {
    return cudaErrorInvalidValue;
  }
  *blocks = __gtopk_emu_blocks_per_sm(block_size);
  return cudaSuccess;
}

cudaError_t cudaEventCreate(cudaEvent_t* event);
cudaError_t cudaEventDestroy(cudaEvent_t event);
cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream = nullptr);
cudaError_t cudaEventSynchronize(cudaEvent_t event);
// Work enqueued on `stream` after this call runs after the event's latest
// record (the work before it on its stream, with what that depends on);
// nothing to wait for when the event was never recorded. flags must be 0.
cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event,
                                unsigned int flags = 0);
cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t start, cudaEvent_t end);

// ---------------------------------------------------------------------------
// Device intrinsics
// ---------------------------------------------------------------------------
inline unsigned int __float_as_uint(float x) {
  unsigned int u;
  std::memcpy(&u, &x, sizeof(u));
  return u;
}
inline float __uint_as_float(unsigned int u) {
  float x;
  std::memcpy(&x, &u, sizeof(x));
  return x;
}
// Without -mpopcnt (x86-64's baseline), __builtin_popcount is a call into
// libgcc (__popcountdi2): 2 % of an emulated selection, whose kernels count
// a ballot per warp iteration. The same count, inline.
inline int __popc(unsigned int x) {
#if defined(__POPCNT__) || !defined(__x86_64__)
  return __builtin_popcount(x);
#else
  x = x - ((x >> 1) & 0x55555555u);
  x = (x & 0x33333333u) + ((x >> 2) & 0x33333333u);
  x = (x + (x >> 4)) & 0x0f0f0f0fu;
  return static_cast<int>((x * 0x01010101u) >> 24);
#endif
}
inline int __popcll(unsigned long long x) {
  return __popc(static_cast<unsigned int>(x)) +
         __popc(static_cast<unsigned int>(x >> 32));
}
inline unsigned long long __umul64hi(unsigned long long a,
                                     unsigned long long b) {
  return static_cast<unsigned long long>(
      (static_cast<unsigned __int128>(a) * b) >> 64);
}
template <typename T>
inline T __ldg(const T* p) {
  return *p;
}
template <typename T>
inline T __ldcg(const T* p) {
  return *p;
}
// Blocks run one after another and threads never at the same time, so every
// write is visible to the threads that run after it: a fence has nothing
// to order.
inline void __threadfence() {}

unsigned int __ballot_sync(unsigned int mask, int predicate);
// __syncthreads() with the calling line, so divergent barriers are caught.
void __gtopk_emu_syncthreads(const char* file, int line);
#define __syncthreads() __gtopk_emu_syncthreads(__FILE__, __LINE__)

// Atomics: threads of the emulator never run at the same time, so these are
// plain read-modify-writes returning the old value, as CUDA's do. The value
// converts to the address's type, as with CUDA's overloads.
namespace gtopk {
namespace cuda_emu {
template <typename T>
struct Identity {
  using type = T;
};
}  // namespace cuda_emu
}  // namespace gtopk
#define GTOPK_EMU_VALUE(T) typename ::gtopk::cuda_emu::Identity<T>::type
template <typename T>
inline T atomicAdd(T* address, GTOPK_EMU_VALUE(T) value) {
  const T old = *address;
  *address = old + value;
  return old;
}
template <typename T>
inline T atomicOr(T* address, GTOPK_EMU_VALUE(T) value) {
  const T old = *address;
  *address = old | value;
  return old;
}
template <typename T>
inline T atomicAnd(T* address, GTOPK_EMU_VALUE(T) value) {
  const T old = *address;
  *address = old & value;
  return old;
}
template <typename T>
inline T atomicMin(T* address, GTOPK_EMU_VALUE(T) value) {
  const T old = *address;
  *address = value < old ? value : old;
  return old;
}
template <typename T>
inline T atomicMax(T* address, GTOPK_EMU_VALUE(T) value) {
  const T old = *address;
  *address = value > old ? value : old;
  return old;
}

namespace gtopk {
namespace cuda_emu {

// Fails the process with `message` and where the emulator was (kernel,
// block, thread); used for what would be undefined behaviour or a hang on a
// GPU.
[[noreturn]] void Fail(const char* format, ...)
    __attribute__((format(printf, 1, 2)));

// Block collectives (cub emulation): thread t deposits `bytes` at
// storage + t*bytes, all threads meet, each reads what it needs. The caller
// keeps CUB's rule: a __syncthreads() before the storage is reused.
void CheckBlockSize(const char* what, int template_threads);
void BlockBarrier(const char* file, int line);
// A cub collective's barrier, identified by the caller's call site (so two
// different collectives reached divergently do not meet); fails when a
// thread of the block has exited.
void CollectiveBarrier(const char* what, const char* file, int line);
// The calling thread's index in its block (Fail outside a kernel).
unsigned ThreadInBlock();

// Whether `p` (non-null) lies in device or pinned memory the emulator
// allocated.
bool IsDeviceAccessible(const void* p);

// Queues a grid on `stream`: `block_body` runs once per thread of every block.
cudaError_t LaunchGrid(const char* name, dim3 grid, dim3 block,
                       cudaStream_t stream, std::function<void()> body);

template <typename T>
void CheckPointerArg(const char* name, int index, const T& value) {
  if constexpr (std::is_pointer_v<T>) {
    if (value != nullptr && !IsDeviceAccessible(value)) {
      Fail("launch of %s: argument %d (%p) is not device or pinned memory",
           name, index, static_cast<const void*>(value));
    }
  }
}

// Kernel<<<grid, block, 0, stream>>>(args...) as Launcher(...)(args...).
template <typename... P>
class Launcher {
 public:
  Launcher(const char* name, void (*kernel)(P...), dim3 grid, dim3 block,
           cudaStream_t stream)
      : name_(name),
        kernel_(kernel),
        grid_(grid),
        block_(block),
        stream_(stream) {}

  template <typename... A>
  void operator()(A&&... args) const {
    static_assert(sizeof...(A) == sizeof...(P), "wrong kernel argument count");
    // Arguments are copied at launch, as CUDA does.
    std::tuple<std::decay_t<P>...> params(std::forward<A>(args)...);
    std::apply(
        [this](const auto&... p) {
          int index = 0;
          (CheckPointerArg(name_, index++, p), ...);
        },
        params);
    void (*kernel)(P...) = kernel_;
    LaunchGrid(name_, grid_, block_, stream_,
               [kernel, params]() { std::apply(kernel, params); });
  }

 private:
  const char* name_;
  void (*kernel_)(P...);
  dim3 grid_, block_;
  cudaStream_t stream_;
};

template <typename... P>
Launcher<P...> MakeLauncher(const char* name, void (*kernel)(P...), dim3 grid,
                            dim3 block, cudaStream_t stream) {
  return Launcher<P...>(name, kernel, grid, block, stream);
}

// Test hooks: the number of kernel launches run so far (all streams), and
// the scheduling order in force ("forward", "reverse" or "shuffle").
uint64_t KernelsRun();
const char* Order();
// Test-only: replaces the order of GTOPK_CUDA_EMU for the launches that run
// from now on ("forward", "reverse" or "shuffle"; anything else fails), so
// one test process can run a kernel under two orders. Not for production
// code or the selector tests, which take the order from the environment.
void SetOrderForTesting(const char* order);

}  // namespace cuda_emu
}  // namespace gtopk

#endif  // GTOPK_TESTS_TESTING_CUDA_EMULATOR_EMULATOR_H_
