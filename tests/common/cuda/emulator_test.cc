// The CUDA emulator (tests/testing/cuda_emulator/emulator.h) on small kernels
// of its own: what it computes (thread coordinates, block scans and reductions,
// ballots, atomics, grid-stride loops) against plain serial loops, that each
// check it documents fails the process with its message (death tests), the
// errors it returns as the CUDA runtime does, its stream semantics, and that
// a shared-memory race gives an order-dependent result. Correct under every
// GTOPK_CUDA_EMU order (ctest also runs it shuffled).
#include "tests/testing/cuda_emulator/emulator.h"

#include <cuda_runtime_api.h>
#include <stdlib.h>

#include <cstdint>
#include <cstring>
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>
#include <string>
#include <vector>

#include "common/cuda/launch.h"
#include "gtest/gtest.h"

namespace gtopk {
namespace cuda_emu {
namespace {

// ---------------------------------------------------------------------------
// Kernels
// ---------------------------------------------------------------------------

// out[4*i ..] = threadIdx.x, blockIdx.x, blockDim.x, gridDim.x of thread i.
__global__ void CoordsKernel(uint32_t* out) {
  const uint32_t i = blockIdx.x * blockDim.x + threadIdx.x;
  out[4 * i + 0] = threadIdx.x;
  out[4 * i + 1] = blockIdx.x;
  out[4 * i + 2] = blockDim.x;
  out[4 * i + 3] = gridDim.x;
}

constexpr int kScanThreads = 128;
constexpr int kItems = 4;

// Per block: array ExclusiveSum of kItems per thread (with aggregate), then
// the scalar ExclusiveSum of each thread's first item (with aggregate).
__global__ void ScanKernel(const uint32_t* in, uint32_t* array_out,
                           uint32_t* array_total, uint32_t* scalar_out,
                           uint32_t* scalar_total) {
  using Scan = cub::BlockScan<uint32_t, kScanThreads>;
  __shared__ typename Scan::TempStorage storage;
  const uint32_t t = blockIdx.x * kScanThreads + threadIdx.x;
  uint32_t items[kItems], before[kItems], total;
  for (int j = 0; j < kItems; ++j) items[j] = in[t * kItems + j];
  Scan(storage).ExclusiveSum(items, before, total);
  for (int j = 0; j < kItems; ++j) array_out[t * kItems + j] = before[j];
  if (threadIdx.x == 0) array_total[blockIdx.x] = total;
  __syncthreads();
  uint32_t mine;
  Scan(storage).ExclusiveSum(items[0], mine, total);
  scalar_out[t] = mine;
  if (threadIdx.x == 0) scalar_total[blockIdx.x] = total;
}

constexpr int kReduceThreads = 256;

// out[b] = the sum of in over block b (thread 0's result).
__global__ void ReduceKernel(const double* in, double* out) {
  using Reduce = cub::BlockReduce<double, kReduceThreads>;
  __shared__ typename Reduce::TempStorage storage;
  const double sum =
      Reduce(storage).Sum(in[blockIdx.x * kReduceThreads + threadIdx.x]);
  if (threadIdx.x == 0) out[blockIdx.x] = sum;
}

// full[t] = ballot of the whole warp; even[t] = ballot of the even lanes
// (odd lanes: 0, they do not vote).
__global__ void BallotKernel(const int* pred, uint32_t* full, uint32_t* even) {
  const uint32_t t = threadIdx.x;
  full[t] = __ballot_sync(0xffffffffu, pred[t]);
  even[t] = (t % 2 == 0) ? __ballot_sync(0x55555555u, pred[t]) : 0u;
}

// Grid-stride loop over n: out[i] = 2*in[i] + 1, visits[i] += 1, and
// hist[in[i] % 16] / min / max through atomics from every block.
__global__ void GridStrideKernel(const uint32_t* in, uint64_t n, uint32_t* out,
                                 uint32_t* visits, unsigned long long* hist,
                                 uint32_t* min_max) {
  for (uint64_t i = uint64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n;
       i += uint64_t{gridDim.x} * blockDim.x) {
    out[i] = 2 * in[i] + 1;
    atomicAdd(&visits[i], 1u);
    atomicAdd(&hist[in[i] % 16], 1ull);
    atomicMin(&min_max[0], in[i]);
    atomicMax(&min_max[1], in[i]);
  }
}

// Reads the neighbour's shared slot; with `sync` after a barrier (correct),
// without it a race: the value depends on which thread ran first.
__global__ void NeighbourKernel(int* out, int sync) {
  __shared__ int slot[64];
  const int t = static_cast<int>(threadIdx.x);
  slot[t] = -1;
  __syncthreads();
  slot[t] = t;
  if (sync) __syncthreads();
  out[t] = slot[(t + 1) % 64];
}

// out[i] = p[i] for one i (bounds checks: i may be outside p).
__global__ void ReadKernel(const float* p, long long i, float* out) {
  out[0] = p[i];
}
__global__ void WriteKernel(float* p, long long i) { p[i] = 1.0f; }

// The pointer inside a struct, which the launch does not check.
struct Box {
  const float* p;
};
__global__ void ReadBoxKernel(Box box, float* out) { out[0] = box.p[0]; }

__global__ void DivergentSyncKernel() {
  if (threadIdx.x < 16) {
    __syncthreads();
  } else {
    __syncthreads();
  }
}

__global__ void BallotWithExitedLaneKernel(uint32_t* out) {
  if (threadIdx.x == 5) return;
  out[threadIdx.x] = __ballot_sync(0xffffffffu, 1);
}

// Thread 0 waits for a ballot with thread 1, which waits at a barrier.
__global__ void DeadlockKernel(uint32_t* out) {
  if (threadIdx.x == 0) {
    out[0] = __ballot_sync(0x3u, 1);
  } else {
    __syncthreads();
  }
}

__global__ void WrongScanSizeKernel(uint32_t* out) {
  using Scan = cub::BlockScan<uint32_t, 128>;
  __shared__ typename Scan::TempStorage storage;
  uint32_t before;
  Scan(storage).ExclusiveSum(1u, before);
  out[threadIdx.x] = before;
}

// Thread 0 leaves before a block reduction the others enter.
__global__ void CollectiveWithExitedThreadKernel(double* out) {
  using Reduce = cub::BlockReduce<double, 64>;
  __shared__ typename Reduce::TempStorage storage;
  if (threadIdx.x == 0) return;
  const double sum = Reduce(storage).Sum(1.0);
  if (threadIdx.x == 1) out[0] = sum;
}

__global__ void FillKernel(float* p, int n) {
  for (int i = threadIdx.x; i < n; i += blockDim.x) p[i] = i + 1.0f;
}

__global__ void CopyKernel(const float* src, float* dst, int n) {
  for (int i = threadIdx.x; i < n; i += blockDim.x) dst[i] = src[i];
}

// ---------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------

// cudaMalloc'ed copy of `host` (freed by the caller with cudaFree).
template <typename T>
T* ToDevice(const std::vector<T>& host) {
  void* p = nullptr;
  EXPECT_EQ(cudaMalloc(&p, host.size() * sizeof(T)), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(p, host.data(), host.size() * sizeof(T),
                       cudaMemcpyHostToDevice),
            cudaSuccess);
  return static_cast<T*>(p);
}
template <typename T>
T* DeviceArray(size_t n) {
  void* p = nullptr;
  EXPECT_EQ(cudaMalloc(&p, n * sizeof(T)), cudaSuccess);
  return static_cast<T*>(p);
}
template <typename T>
std::vector<T> ToHost(const T* d, size_t n) {
  std::vector<T> host(n);
  EXPECT_EQ(cudaMemcpy(host.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost),
            cudaSuccess);
  return host;
}

// Deterministic pseudo-random values (a 32-bit LCG).
std::vector<uint32_t> Values(size_t n, uint32_t seed, uint32_t modulo) {
  std::vector<uint32_t> v(n);
  uint32_t x = seed;
  for (auto& e : v) {
    x = x * 1664525u + 1013904223u;
    e = (x >> 8) % modulo;
  }
  return v;
}

// ---------------------------------------------------------------------------
// What kernels compute
// ---------------------------------------------------------------------------

TEST(EmulatorTest, ThreadAndBlockCoordinates) {
  const int blocks = 3, threads = 70;
  uint32_t* d = DeviceArray<uint32_t>(4 * blocks * threads);
  GTOPK_LAUNCH(CoordsKernel, blocks, threads, nullptr)(d);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  const std::vector<uint32_t> got = ToHost(d, 4 * blocks * threads);
  for (int b = 0; b < blocks; ++b) {
    for (int t = 0; t < threads; ++t) {
      const int i = b * threads + t;
      EXPECT_EQ(got[4 * i + 0], static_cast<uint32_t>(t)) << i;
      EXPECT_EQ(got[4 * i + 1], static_cast<uint32_t>(b)) << i;
      EXPECT_EQ(got[4 * i + 2], static_cast<uint32_t>(threads)) << i;
      EXPECT_EQ(got[4 * i + 3], static_cast<uint32_t>(blocks)) << i;
    }
  }
  EXPECT_EQ(cudaFree(d), cudaSuccess);
}

TEST(EmulatorTest, BlockScanExclusiveSumMatchesASerialLoop) {
  const int blocks = 2;
  const size_t n = size_t{blocks} * kScanThreads * kItems;
  const std::vector<uint32_t> in = Values(n, 3, 1000);
  uint32_t* d_in = ToDevice(in);
  uint32_t* d_array = DeviceArray<uint32_t>(n);
  uint32_t* d_array_total = DeviceArray<uint32_t>(blocks);
  uint32_t* d_scalar = DeviceArray<uint32_t>(blocks * kScanThreads);
  uint32_t* d_scalar_total = DeviceArray<uint32_t>(blocks);
  GTOPK_LAUNCH(ScanKernel, blocks, kScanThreads, nullptr)
  (d_in, d_array, d_array_total, d_scalar, d_scalar_total);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  const std::vector<uint32_t> array = ToHost(d_array, n);
  const std::vector<uint32_t> array_total = ToHost(d_array_total, blocks);
  const std::vector<uint32_t> scalar = ToHost(d_scalar, blocks * kScanThreads);
  const std::vector<uint32_t> scalar_total = ToHost(d_scalar_total, blocks);
  for (int b = 0; b < blocks; ++b) {
    // Array scan: the block's items in thread-major order.
    uint32_t running = 0;
    for (int i = 0; i < kScanThreads * kItems; ++i) {
      const size_t at = static_cast<size_t>(b) * kScanThreads * kItems + i;
      ASSERT_EQ(array[at], running) << "block " << b << " item " << i;
      running += in[at];
    }
    EXPECT_EQ(array_total[b], running);
    // Scalar scan: each thread's first item.
    running = 0;
    for (int t = 0; t < kScanThreads; ++t) {
      const size_t thread = static_cast<size_t>(b) * kScanThreads + t;
      ASSERT_EQ(scalar[thread], running) << "block " << b << " thread " << t;
      running += in[thread * kItems];
    }
    EXPECT_EQ(scalar_total[b], running);
  }
  for (void* p :
       {static_cast<void*>(d_in), static_cast<void*>(d_array),
        static_cast<void*>(d_array_total), static_cast<void*>(d_scalar),
        static_cast<void*>(d_scalar_total)}) {
    EXPECT_EQ(cudaFree(p), cudaSuccess);
  }
}

TEST(EmulatorTest, BlockReduceSumMatchesASerialLoop) {
  const int blocks = 3;
  const std::vector<uint32_t> ints =
      Values(size_t{blocks} * kReduceThreads, 5, 1 << 20);
  // Integers: every summation order gives the same double.
  std::vector<double> in(ints.begin(), ints.end());
  in[7] = -12345.0;
  double* d_in = ToDevice(in);
  double* d_out = DeviceArray<double>(blocks);
  GTOPK_LAUNCH(ReduceKernel, blocks, kReduceThreads, nullptr)(d_in, d_out);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  const std::vector<double> got = ToHost(d_out, blocks);
  for (int b = 0; b < blocks; ++b) {
    double want = 0.0;
    for (int t = 0; t < kReduceThreads; ++t) want += in[b * kReduceThreads + t];
    EXPECT_EQ(got[b], want) << "block " << b;
  }
  EXPECT_EQ(cudaFree(d_in), cudaSuccess);
  EXPECT_EQ(cudaFree(d_out), cudaSuccess);
}

TEST(EmulatorTest, BallotBitsMatchTheLanesThatVoted) {
  const int threads = 64;  // two warps
  std::vector<int> pred(threads);
  const std::vector<uint32_t> r = Values(threads, 11, 3);
  for (int t = 0; t < threads; ++t) pred[t] = static_cast<int>(r[t]) - 1;
  int* d_pred = ToDevice(pred);
  uint32_t* d_full = DeviceArray<uint32_t>(threads);
  uint32_t* d_even = DeviceArray<uint32_t>(threads);
  GTOPK_LAUNCH(BallotKernel, 1, threads, nullptr)(d_pred, d_full, d_even);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  const std::vector<uint32_t> full = ToHost(d_full, threads);
  const std::vector<uint32_t> even = ToHost(d_even, threads);
  for (int t = 0; t < threads; ++t) {
    const int warp = t / 32;
    uint32_t want_full = 0, want_even = 0;
    for (int lane = 0; lane < 32; ++lane) {
      if (pred[warp * 32 + lane] != 0) {
        want_full |= 1u << lane;
        if (lane % 2 == 0) want_even |= 1u << lane;
      }
    }
    EXPECT_EQ(full[t], want_full) << "thread " << t;
    EXPECT_EQ(even[t], t % 2 == 0 ? want_even : 0u) << "thread " << t;
  }
  EXPECT_EQ(cudaFree(d_pred), cudaSuccess);
  EXPECT_EQ(cudaFree(d_full), cudaSuccess);
  EXPECT_EQ(cudaFree(d_even), cudaSuccess);
}

TEST(EmulatorTest, GridStrideLoopAndAtomicsAcrossBlocks) {
  const uint64_t n = 10007;  // not a multiple of the 5 x 64 grid
  const std::vector<uint32_t> in = Values(n, 17, 100000);
  uint32_t* d_in = ToDevice(in);
  uint32_t* d_out = DeviceArray<uint32_t>(n);
  uint32_t* d_visits = ToDevice(std::vector<uint32_t>(n, 0));
  unsigned long long* d_hist = ToDevice(std::vector<unsigned long long>(16, 0));
  uint32_t* d_min_max = ToDevice(std::vector<uint32_t>{UINT32_MAX, 0});
  GTOPK_LAUNCH(GridStrideKernel, 5, 64, nullptr)
  (d_in, n, d_out, d_visits, d_hist, d_min_max);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  const std::vector<uint32_t> out = ToHost(d_out, n);
  const std::vector<uint32_t> visits = ToHost(d_visits, n);
  const std::vector<unsigned long long> hist = ToHost(d_hist, 16);
  const std::vector<uint32_t> min_max = ToHost(d_min_max, 2);
  std::vector<unsigned long long> want_hist(16, 0);
  uint32_t want_min = UINT32_MAX, want_max = 0;
  for (uint64_t i = 0; i < n; ++i) {
    ASSERT_EQ(out[i], 2 * in[i] + 1) << i;
    ASSERT_EQ(visits[i], 1u) << i;
    ++want_hist[in[i] % 16];
    want_min = std::min(want_min, in[i]);
    want_max = std::max(want_max, in[i]);
  }
  EXPECT_EQ(hist, want_hist);
  EXPECT_EQ(min_max[0], want_min);
  EXPECT_EQ(min_max[1], want_max);
  for (void* p : {static_cast<void*>(d_in), static_cast<void*>(d_out),
                  static_cast<void*>(d_visits), static_cast<void*>(d_hist),
                  static_cast<void*>(d_min_max)}) {
    EXPECT_EQ(cudaFree(p), cudaSuccess);
  }
}

// ---------------------------------------------------------------------------
// Order: a race shows as a different result
// ---------------------------------------------------------------------------

std::vector<int> RunNeighbour(const char* order, int sync) {
  const std::string saved = Order();
  SetOrderForTesting(order);
  int* d = DeviceArray<int>(64);
  GTOPK_LAUNCH(NeighbourKernel, 1, 64, nullptr)(d, sync);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  SetOrderForTesting(saved.c_str());
  std::vector<int> got = ToHost(d, 64);
  EXPECT_EQ(cudaFree(d), cudaSuccess);
  return got;
}

TEST(EmulatorTest, AnUnsynchronisedSharedReadDependsOnTheOrder) {
  // Forward: thread t runs before t + 1 wrote its slot (reads the -1 of the
  // first phase); thread 63 reads slot 0, written. Reverse: the other way.
  std::vector<int> want_forward(64, -1), want_reverse(64);
  want_forward[63] = 0;
  for (int t = 0; t < 63; ++t) want_reverse[t] = t + 1;
  want_reverse[63] = -1;
  const std::vector<int> forward = RunNeighbour("forward", /*sync=*/0);
  const std::vector<int> reverse = RunNeighbour("reverse", /*sync=*/0);
  EXPECT_EQ(forward, want_forward);
  EXPECT_EQ(reverse, want_reverse);
  EXPECT_NE(forward, reverse);
  // With the barrier: the same, correct result in every order.
  std::vector<int> want(64);
  for (int t = 0; t < 64; ++t) want[t] = (t + 1) % 64;
  for (const char* order : {"forward", "reverse", "shuffle"}) {
    EXPECT_EQ(RunNeighbour(order, /*sync=*/1), want) << order;
  }
}

// ---------------------------------------------------------------------------
// Errors returned as the CUDA runtime returns them
// ---------------------------------------------------------------------------

TEST(EmulatorTest, ABlockOf2048ThreadsIsAnInvalidConfiguration) {
  float* d = DeviceArray<float>(4);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const uint64_t before = KernelsRun();
  GTOPK_LAUNCH(FillKernel, 1, 2048, nullptr)(d, 4);
  EXPECT_EQ(cudaPeekAtLastError(), cudaErrorInvalidConfiguration);
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidConfiguration);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);  // read and cleared
  GTOPK_LAUNCH(FillKernel, 0, 32, nullptr)(d, 4);
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidConfiguration);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(KernelsRun(), before);  // neither ran
  EXPECT_EQ(cudaFree(d), cudaSuccess);
}

TEST(EmulatorTest, MemcpyWithAWrongKindOrRangeIsInvalidValue) {
  float* d = DeviceArray<float>(100);
  std::vector<float> host(101, 0.0f);
  // Host-to-device into host memory, device-to-host from host memory.
  EXPECT_EQ(cudaMemcpy(host.data(), host.data() + 50, 4 * sizeof(float),
                       cudaMemcpyHostToDevice),
            cudaErrorInvalidValue);
  EXPECT_EQ(cudaMemcpy(host.data(), host.data() + 50, 4 * sizeof(float),
                       cudaMemcpyDeviceToHost),
            cudaErrorInvalidValue);
  // One element past the allocation.
  EXPECT_EQ(
      cudaMemcpy(host.data(), d, 101 * sizeof(float), cudaMemcpyDeviceToHost),
      cudaErrorInvalidValue);
  EXPECT_EQ(cudaMemcpy(d + 1, host.data(), 100 * sizeof(float),
                       cudaMemcpyHostToDevice),
            cudaErrorInvalidValue);
  EXPECT_EQ(cudaMemcpy(d, host.data(), 4, static_cast<cudaMemcpyKind>(7)),
            cudaErrorInvalidMemcpyDirection);
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidMemcpyDirection);
  // In range: fine.
  EXPECT_EQ(
      cudaMemcpy(host.data(), d, 100 * sizeof(float), cudaMemcpyDeviceToHost),
      cudaSuccess);
  EXPECT_EQ(cudaFree(d), cudaSuccess);
}

TEST(EmulatorTest, FreeOfANonAllocationIsInvalidDevicePointer) {
  float* d = DeviceArray<float>(16);
  int local = 0;
  EXPECT_EQ(cudaFree(d + 1), cudaErrorInvalidDevicePointer);
  EXPECT_EQ(cudaFree(&local), cudaErrorInvalidDevicePointer);
  EXPECT_EQ(cudaFree(d), cudaSuccess);
  EXPECT_EQ(cudaFree(d), cudaErrorInvalidDevicePointer);  // twice
  EXPECT_EQ(cudaFree(nullptr), cudaSuccess);
  cudaGetLastError();
}

TEST(EmulatorTest, FreshDeviceMemoryReadsAsFfBytes) {
  for (size_t bytes : {size_t{1}, size_t{13}, size_t{4096}, size_t{10000}}) {
    void* d = nullptr;
    ASSERT_EQ(cudaMalloc(&d, bytes), cudaSuccess);
    std::vector<unsigned char> host(bytes, 0);
    ASSERT_EQ(cudaMemcpy(host.data(), d, bytes, cudaMemcpyDeviceToHost),
              cudaSuccess);
    for (size_t i = 0; i < bytes; ++i) ASSERT_EQ(host[i], 0xff) << i;
    EXPECT_EQ(cudaFree(d), cudaSuccess);
  }
}

// ---------------------------------------------------------------------------
// Streams and events
// ---------------------------------------------------------------------------

TEST(EmulatorTest, KernelWritesToPinnedMemoryShowAfterStreamSynchronize) {
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  float* pinned = nullptr;
  ASSERT_EQ(
      cudaMallocHost(reinterpret_cast<void**>(&pinned), 8 * sizeof(float)),
      cudaSuccess);
  for (int i = 0; i < 8; ++i) pinned[i] = 0.0f;
  GTOPK_LAUNCH(FillKernel, 1, 32, stream)(pinned, 8);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  for (int i = 0; i < 8; ++i) EXPECT_EQ(pinned[i], 0.0f) << "before " << i;
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  for (int i = 0; i < 8; ++i) EXPECT_EQ(pinned[i], i + 1.0f) << "after " << i;
  EXPECT_EQ(cudaFreeHost(pinned), cudaSuccess);
  EXPECT_EQ(cudaStreamDestroy(stream), cudaSuccess);
}

// Stream capture records work instead of running it; each launch of the
// instantiated graph runs it again, with the arguments of the capture; the
// legacy stream cannot capture and a synchronisation invalidates a capture.
TEST(EmulatorTest, CapturedGraphReplaysItsWorkWithCaptureTimeArguments) {
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking),
            cudaSuccess);
  float* a = DeviceArray<float>(8);
  float* b = DeviceArray<float>(8);
  float* pinned = nullptr;
  ASSERT_EQ(
      cudaMallocHost(reinterpret_cast<void**>(&pinned), 8 * sizeof(float)),
      cudaSuccess);
  for (int i = 0; i < 8; ++i) pinned[i] = -1.0f;
  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal),
            cudaSuccess);
  int n = 8;
  GTOPK_LAUNCH(FillKernel, 1, 32, stream)(a, n);
  GTOPK_LAUNCH(CopyKernel, 1, 32, stream)(a, b, n);
  ASSERT_EQ(cudaMemcpyAsync(pinned, b, 8 * sizeof(float),
                            cudaMemcpyDeviceToHost, stream),
            cudaSuccess);
  n = 3;  // arguments are taken at the call, as for a launch
  cudaGraph_t graph = nullptr;
  ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  for (int i = 0; i < 8; ++i) EXPECT_EQ(pinned[i], -1.0f) << "captured " << i;
  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  ASSERT_EQ(cudaGraphDestroy(graph), cudaSuccess);
  for (int launch = 0; launch < 2; ++launch) {
    for (int i = 0; i < 8; ++i) pinned[i] = -1.0f;
    ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    for (int i = 0; i < 8; ++i) EXPECT_EQ(pinned[i], i + 1.0f) << i;
  }
  EXPECT_EQ(cudaGraphExecDestroy(exec), cudaSuccess);
  // The legacy default stream cannot capture.
  EXPECT_EQ(cudaStreamBeginCapture(nullptr, cudaStreamCaptureModeThreadLocal),
            cudaErrorStreamCaptureUnsupported);
  cudaGetLastError();
  // A synchronisation during capture is refused and invalidates it.
  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal),
            cudaSuccess);
  EXPECT_EQ(cudaStreamSynchronize(stream), cudaErrorStreamCaptureUnsupported);
  EXPECT_EQ(cudaStreamEndCapture(stream, &graph),
            cudaErrorStreamCaptureInvalidated);
  EXPECT_EQ(graph, nullptr);
  cudaGetLastError();
  EXPECT_EQ(cudaFreeHost(pinned), cudaSuccess);
  EXPECT_EQ(cudaFree(a), cudaSuccess);
  EXPECT_EQ(cudaFree(b), cudaSuccess);
  EXPECT_EQ(cudaStreamDestroy(stream), cudaSuccess);
}

TEST(EmulatorTest, AsyncCopyToPageableMemoryIsDoneOnReturn) {
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  float* d = DeviceArray<float>(8);
  GTOPK_LAUNCH(FillKernel, 1, 32, stream)(d, 8);
  std::vector<float> host(8, 0.0f);
  ASSERT_EQ(cudaMemcpyAsync(host.data(), d, 8 * sizeof(float),
                            cudaMemcpyDeviceToHost, stream),
            cudaSuccess);
  for (int i = 0; i < 8; ++i) EXPECT_EQ(host[i], i + 1.0f) << i;
  EXPECT_EQ(cudaFree(d), cudaSuccess);
  EXPECT_EQ(cudaStreamDestroy(stream), cudaSuccess);
}

// Work on the legacy default stream (cudaMemset, a cudaMemcpy from pageable
// memory) is not ordered before a kernel on a cudaStreamNonBlocking stream:
// the emulator runs it only when something waits for it, so the kernel
// reads the memory as it was (0xff bytes). A blocking stream, or a
// synchronisation of the legacy stream first, orders it.
TEST(EmulatorTest, LegacyStreamWorkIsOrderedOnlyBeforeBlockingStreams) {
  for (const unsigned int flags : {cudaStreamNonBlocking, cudaStreamDefault}) {
    for (const bool memset : {true, false}) {
      SCOPED_TRACE(
          ::testing::Message()
          << (flags == cudaStreamNonBlocking ? "non-blocking" : "blocking")
          << (memset ? " cudaMemset" : " cudaMemcpy"));
      cudaStream_t stream;
      ASSERT_EQ(cudaStreamCreateWithFlags(&stream, flags), cudaSuccess);
      float* d = DeviceArray<float>(8);
      float* pinned = nullptr;
      ASSERT_EQ(
          cudaMallocHost(reinterpret_cast<void**>(&pinned), 8 * sizeof(float)),
          cudaSuccess);
      const std::vector<float> twos(8, 2.0f);
      if (memset) {
        ASSERT_EQ(cudaMemset(d, 0, 8 * sizeof(float)), cudaSuccess);
      } else {
        ASSERT_EQ(cudaMemcpy(d, twos.data(), 8 * sizeof(float),
                             cudaMemcpyHostToDevice),
                  cudaSuccess);
      }
      GTOPK_LAUNCH(CopyKernel, 1, 32, stream)(d, pinned, 8);
      ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
      const float want = memset ? 0.0f : 2.0f;
      for (int i = 0; i < 8; ++i) {
        if (flags == cudaStreamNonBlocking) {
          uint32_t bits;
          std::memcpy(&bits, &pinned[i], sizeof(bits));
          EXPECT_EQ(bits, 0xffffffffu) << i;
        } else {
          EXPECT_EQ(pinned[i], want) << i;
        }
      }
      // Waiting for the legacy stream first orders it for any stream.
      ASSERT_EQ(cudaStreamSynchronize(nullptr), cudaSuccess);
      GTOPK_LAUNCH(CopyKernel, 1, 32, stream)(d, pinned, 8);
      ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
      for (int i = 0; i < 8; ++i) EXPECT_EQ(pinned[i], want) << i;
      EXPECT_EQ(cudaFreeHost(pinned), cudaSuccess);
      EXPECT_EQ(cudaFree(d), cudaSuccess);
      EXPECT_EQ(cudaStreamDestroy(stream), cudaSuccess);
    }
  }
}

TEST(EmulatorTest, EventsMeasureANonNegativeElapsedTime) {
  cudaEvent_t start, end;
  ASSERT_EQ(cudaEventCreate(&start), cudaSuccess);
  ASSERT_EQ(cudaEventCreate(&end), cudaSuccess);
  float* d = DeviceArray<float>(1000);
  ASSERT_EQ(cudaEventRecord(start), cudaSuccess);
  GTOPK_LAUNCH(FillKernel, 1, 256, nullptr)(d, 1000);
  ASSERT_EQ(cudaEventRecord(end), cudaSuccess);
  float ms = -1.0f;
  EXPECT_EQ(cudaEventElapsedTime(&ms, start, end), cudaErrorNotReady);
  ASSERT_EQ(cudaEventSynchronize(end), cudaSuccess);
  ASSERT_EQ(cudaEventElapsedTime(&ms, start, end), cudaSuccess);
  EXPECT_GE(ms, 0.0f);
  EXPECT_EQ(cudaFree(d), cudaSuccess);
  EXPECT_EQ(cudaEventDestroy(start), cudaSuccess);
  EXPECT_EQ(cudaEventDestroy(end), cudaSuccess);
}

// A non-blocking stream sees the legacy stream's earlier work only through
// an event it waits for: without the wait the kernel reads the memory as it
// was (0xff bytes, the memset not run yet); with it, the memset's zeros.
TEST(EmulatorTest, StreamWaitEventOrdersAnotherStreamsWork) {
  for (const bool wait : {false, true}) {
    SCOPED_TRACE(wait ? "with cudaStreamWaitEvent" : "without");
    cudaStream_t stream;
    ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking),
              cudaSuccess);
    cudaEvent_t ready;
    ASSERT_EQ(cudaEventCreate(&ready), cudaSuccess);
    float* d = DeviceArray<float>(8);
    float* pinned = nullptr;
    ASSERT_EQ(
        cudaMallocHost(reinterpret_cast<void**>(&pinned), 8 * sizeof(float)),
        cudaSuccess);
    ASSERT_EQ(cudaMemsetAsync(d, 0, 8 * sizeof(float), nullptr), cudaSuccess);
    ASSERT_EQ(cudaEventRecord(ready, nullptr), cudaSuccess);
    if (wait) {
      ASSERT_EQ(cudaStreamWaitEvent(stream, ready, 0), cudaSuccess);
    }
    GTOPK_LAUNCH(CopyKernel, 1, 32, stream)(d, pinned, 8);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    for (int i = 0; i < 8; ++i) {
      uint32_t bits;
      std::memcpy(&bits, &pinned[i], sizeof(bits));
      EXPECT_EQ(bits, wait ? 0u : 0xffffffffu) << i;
    }
    EXPECT_EQ(cudaStreamWaitEvent(stream, ready, 1), cudaErrorInvalidValue);
    cudaGetLastError();
    ASSERT_EQ(cudaStreamSynchronize(nullptr), cudaSuccess);
    EXPECT_EQ(cudaFreeHost(pinned), cudaSuccess);
    EXPECT_EQ(cudaFree(d), cudaSuccess);
    EXPECT_EQ(cudaEventDestroy(ready), cudaSuccess);
    EXPECT_EQ(cudaStreamDestroy(stream), cudaSuccess);
  }
}

// ---------------------------------------------------------------------------
// Each check fails the process with its message
// ---------------------------------------------------------------------------

class EmulatorDeathTest : public ::testing::Test {
 protected:
  void SetUp() override { GTEST_FLAG_SET(death_test_style, "threadsafe"); }
};

TEST_F(EmulatorDeathTest, DivergentSyncthreads) {
  EXPECT_DEATH(
      {
        GTOPK_LAUNCH(DivergentSyncKernel, 1, 32, nullptr)();
        cudaDeviceSynchronize();
      },
      "divergent __syncthreads: this thread waits at .*emulator_test.cc:[0-9]+"
      ".*kernel DivergentSyncKernel");
}

TEST_F(EmulatorDeathTest, BallotNamingAnExitedLane) {
  EXPECT_DEATH(
      {
        uint32_t* d = DeviceArray<uint32_t>(32);
        GTOPK_LAUNCH(BallotWithExitedLaneKernel, 1, 32, nullptr)(d);
        cudaDeviceSynchronize();
      },
      "__ballot_sync mask 0xffffffff names lane 5, which has exited");
}

TEST_F(EmulatorDeathTest, Deadlock) {
  EXPECT_DEATH(
      {
        uint32_t* d = DeviceArray<uint32_t>(2);
        GTOPK_LAUNCH(DeadlockKernel, 1, 2, nullptr)(d);
        cudaDeviceSynchronize();
      },
      "deadlock: no barrier or ballot can complete: thread 0 at a ballot; "
      "thread 1 at .*emulator_test.cc");
}

TEST_F(EmulatorDeathTest, BlockCollectiveWithAnExitedThread) {
  EXPECT_DEATH(
      {
        double* d = DeviceArray<double>(1);
        GTOPK_LAUNCH(CollectiveWithExitedThreadKernel, 1, 64, nullptr)(d);
        cudaDeviceSynchronize();
      },
      "block collective at .*emulator_test.cc:[0-9]+ reached while thread 0 "
      "has exited");
}

TEST_F(EmulatorDeathTest, BlockScanInABlockOfTheWrongSize) {
  EXPECT_DEATH(
      {
        uint32_t* d = DeviceArray<uint32_t>(64);
        GTOPK_LAUNCH(WrongScanSizeKernel, 1, 64, nullptr)(d);
        cudaDeviceSynchronize();
      },
      "BlockScan<\\.\\.\\., 128> used in a block of 64 threads");
}

TEST_F(EmulatorDeathTest, WritePastTheEndOfAnAllocation) {
  EXPECT_DEATH(
      {
        float* d = DeviceArray<float>(100);
        GTOPK_LAUNCH(WriteKernel, 1, 1, nullptr)(d, 101);  // 4 bytes past
        cudaDeviceSynchronize();
      },
      "invalid memory access at 0x[0-9a-f]+ \\(4 bytes past the end of device "
      "allocation #[0-9]+ .*\\) in kernel WriteKernel");
}

TEST_F(EmulatorDeathTest, ReadBeforeTheStartOfAnAllocation) {
  // 4096 bytes: the start is on the guard page in front.
  EXPECT_DEATH(
      {
        float* d = DeviceArray<float>(1024);
        float* out = DeviceArray<float>(1);
        GTOPK_LAUNCH(ReadKernel, 1, 1, nullptr)(d, -1, out);
        cudaDeviceSynchronize();
      },
      "invalid memory access at 0x[0-9a-f]+ \\(4 bytes before device "
      "allocation #[0-9]+ .*\\) in kernel ReadKernel");
}

TEST_F(EmulatorDeathTest, WriteIntoTheSlackBeforeTheStart) {
  // 400 bytes: the start is inside its page; the canary finds the write.
  EXPECT_DEATH(
      {
        float* d = DeviceArray<float>(100);
        GTOPK_LAUNCH(WriteKernel, 1, 1, nullptr)(d, -1);
        cudaDeviceSynchronize();
      },
      "write 4 bytes before the start of device allocation #[0-9]+ .* "
      "\\(found after kernel WriteKernel\\)");
}

TEST_F(EmulatorDeathTest, UseAfterFree) {
  EXPECT_DEATH(
      {
        float* d = DeviceArray<float>(100);
        float* out = DeviceArray<float>(1);
        cudaFree(d);
        GTOPK_LAUNCH(ReadBoxKernel, 1, 1, nullptr)(Box{d}, out);
        cudaDeviceSynchronize();
      },
      "invalid memory access at 0x[0-9a-f]+ \\(0 bytes from the start of "
      "freed device allocation #[0-9]+ .*: use after free\\) in kernel "
      "ReadBoxKernel");
  // Passed directly, the launch itself refuses the freed pointer.
  EXPECT_DEATH(
      {
        float* d = DeviceArray<float>(100);
        float* out = DeviceArray<float>(1);
        cudaFree(d);
        GTOPK_LAUNCH(ReadKernel, 1, 1, nullptr)(d, 0, out);
      },
      "launch of ReadKernel: argument 0 \\(0x[0-9a-f]+\\) is not device or "
      "pinned memory");
}

TEST_F(EmulatorDeathTest, HostVectorAsAKernelArgument) {
  EXPECT_DEATH(
      {
        std::vector<float> host(8, 0.0f);
        GTOPK_LAUNCH(FillKernel, 1, 32, nullptr)(host.data(), 8);
      },
      "launch of FillKernel: argument 0 \\(0x[0-9a-f]+\\) is not device or "
      "pinned memory");
}

TEST_F(EmulatorDeathTest, AllocationsBeyondMemoryBytesFail) {
  // Settings are read once per process: the limit is set in a child (a
  // fresh process, death_test_style threadsafe), which exits 0 when every
  // call returned what CUDA returns.
  EXPECT_EXIT(
      {
        setenv("GTOPK_CUDA_EMU", "memory_bytes=1048576", 1);
        void* a = nullptr;
        void* b = nullptr;
        bool ok = cudaMalloc(&a, 600000) == cudaSuccess;
        ok = ok && cudaMalloc(&b, 600000) == cudaErrorMemoryAllocation;
        ok = ok && b == nullptr;
        ok = ok && cudaGetLastError() == cudaErrorMemoryAllocation;
        ok = ok && cudaFree(a) == cudaSuccess;
        ok = ok && cudaMalloc(&b, 600000) == cudaSuccess;  // room again
        std::exit(ok ? 0 : 1);
      },
      ::testing::ExitedWithCode(0), "");
}

TEST_F(EmulatorDeathTest, BadSetting) {
  EXPECT_DEATH(
      {
        setenv("GTOPK_CUDA_EMU", "order=sideways", 1);
        int sms = 0;
        cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
      },
      "GTOPK_CUDA_EMU: bad setting 'order=sideways'");
  EXPECT_DEATH(
      {
        setenv("GTOPK_CUDA_EMU", "sms=0", 1);
        int sms = 0;
        cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
      },
      "GTOPK_CUDA_EMU: bad setting 'sms=0'");
}

}  // namespace
}  // namespace cuda_emu
}  // namespace gtopk
