// cub::BlockScan and cub::BlockReduce for the CUDA emulator
// (tests/testing/cuda_emulator/emulator.h): the members common/cuda/ uses, with
// CUB's contracts (CCCL's cub/block/block_scan.cuh, block_reduce.cuh):
// TempStorage lives in __shared__ memory and needs a __syncthreads() before
// it is reused (the emulator keeps the per-thread partials in it, so a
// missing barrier corrupts a result under some thread order); the block
// size must equal the template argument; BlockReduce's result is defined in
// thread 0 only (the other threads get a poison value here).
#ifndef GTOPK_TESTS_TESTING_CUDA_EMULATOR_CUB_H_
#define GTOPK_TESTS_TESTING_CUDA_EMULATOR_CUB_H_

#include <cstring>
#include <limits>
#include <type_traits>

#include "tests/testing/cuda_emulator/emulator.h"

namespace cub {

// CUB's algorithm choices; the emulator computes the same sums for each.
enum BlockScanAlgorithm {
  BLOCK_SCAN_RAKING,
  BLOCK_SCAN_RAKING_MEMOIZE,
  BLOCK_SCAN_WARP_SCANS,
};
enum BlockReduceAlgorithm {
  BLOCK_REDUCE_RAKING_COMMUTATIVE_ONLY,
  BLOCK_REDUCE_RAKING,
  BLOCK_REDUCE_WARP_REDUCTIONS,
};

template <typename T, int BLOCK_DIM_X,
          BlockScanAlgorithm ALGORITHM = BLOCK_SCAN_RAKING, int BLOCK_DIM_Y = 1,
          int BLOCK_DIM_Z = 1, int LEGACY_PTX_ARCH = 0>
class BlockScan {
  static_assert(BLOCK_DIM_Y == 1 && BLOCK_DIM_Z == 1,
                "the emulator runs 1-D blocks");

 public:
  struct TempStorage {
    T partial[BLOCK_DIM_X];
  };

  explicit BlockScan(TempStorage& storage) : storage_(storage) {
    gtopk::cuda_emu::CheckBlockSize("cub::BlockScan", BLOCK_DIM_X);
  }

  // Each member takes the caller's call site (default arguments), which
  // names the barrier the block meets at.
  template <int N>
  void ExclusiveSum(T (&input)[N], T (&output)[N], T& aggregate,
                    const char* file = __builtin_FILE(),
                    int line = __builtin_LINE()) {
    T mine{};
    for (int j = 0; j < N; ++j) mine += input[j];
    T before = Exchange(mine, &aggregate, file, line);
    for (int j = 0; j < N; ++j) {
      const T x = input[j];  // input and output may alias
      output[j] = before;
      before += x;
    }
  }
  template <int N>
  void ExclusiveSum(T (&input)[N], T (&output)[N],
                    const char* file = __builtin_FILE(),
                    int line = __builtin_LINE()) {
    T aggregate;
    ExclusiveSum(input, output, aggregate, file, line);
  }
  void ExclusiveSum(T input, T& output, T& aggregate,
                    const char* file = __builtin_FILE(),
                    int line = __builtin_LINE()) {
    output = Exchange(input, &aggregate, file, line);
  }
  void ExclusiveSum(T input, T& output, const char* file = __builtin_FILE(),
                    int line = __builtin_LINE()) {
    T aggregate;
    ExclusiveSum(input, output, aggregate, file, line);
  }
  void InclusiveSum(T input, T& output, T& aggregate,
                    const char* file = __builtin_FILE(),
                    int line = __builtin_LINE()) {
    output = Exchange(input, &aggregate, file, line) + input;
  }
  void InclusiveSum(T input, T& output, const char* file = __builtin_FILE(),
                    int line = __builtin_LINE()) {
    T aggregate;
    InclusiveSum(input, output, aggregate, file, line);
  }

 private:
  // Deposits this thread's partial, meets the block, and returns the sum of
  // the lower threads' partials (*total: all of them).
  T Exchange(T mine, T* total, const char* file, int line) {
    const unsigned t = gtopk::cuda_emu::ThreadInBlock();
    storage_.partial[t] = mine;
    gtopk::cuda_emu::CollectiveBarrier("cub::BlockScan", file, line);
    T before{}, all{};
    for (int i = 0; i < BLOCK_DIM_X; ++i) {
      if (static_cast<unsigned>(i) < t) before += storage_.partial[i];
      all += storage_.partial[i];
    }
    *total = all;
    return before;
  }

  TempStorage& storage_;
};

template <typename T, int BLOCK_DIM_X,
          BlockReduceAlgorithm ALGORITHM = BLOCK_REDUCE_WARP_REDUCTIONS,
          int BLOCK_DIM_Y = 1, int BLOCK_DIM_Z = 1, int LEGACY_PTX_ARCH = 0>
class BlockReduce {
  static_assert(BLOCK_DIM_Y == 1 && BLOCK_DIM_Z == 1,
                "the emulator runs 1-D blocks");

 public:
  struct TempStorage {
    T partial[BLOCK_DIM_X];
  };

  explicit BlockReduce(TempStorage& storage) : storage_(storage) {
    gtopk::cuda_emu::CheckBlockSize("cub::BlockReduce", BLOCK_DIM_X);
  }

  // The block's sum in thread 0; undefined (a poison value) elsewhere.
  T Sum(T input, const char* file = __builtin_FILE(),
        int line = __builtin_LINE()) {
    const unsigned t = gtopk::cuda_emu::ThreadInBlock();
    storage_.partial[t] = input;
    gtopk::cuda_emu::CollectiveBarrier("cub::BlockReduce", file, line);
    if (t != 0) return Poison();
    T sum{};
    for (int i = 0; i < BLOCK_DIM_X; ++i) sum += storage_.partial[i];
    return sum;
  }

 private:
  static T Poison() {
    if constexpr (std::is_floating_point_v<T>) {
      return std::numeric_limits<T>::quiet_NaN();
    } else {
      T value;
      std::memset(&value, 0xa5, sizeof(value));
      return value;
    }
  }

  TempStorage& storage_;
};

}  // namespace cub

#endif  // GTOPK_TESTS_TESTING_CUDA_EMULATOR_CUB_H_
