// The host launchers of the selector's kernels, one group per stage, each
// defined in its stage's .cu file (no relocatable device code: a kernel and
// its launcher share a translation unit). Plain C++: the host driver
// (common/cuda/sparsify/*.cc) calls them. Every launcher enqueues one kernel
// on `stream`; as with <<<>>>, a launch error is read with
// cudaGetLastError() afterwards. Parameters mirror the kernels' (see each
// .cu for what they mean).
#ifndef GTOPK_COMMON_CUDA_SPARSIFY_LAUNCHERS_H_
#define GTOPK_COMMON_CUDA_SPARSIFY_LAUNCHERS_H_

#include <cuda_runtime_api.h>

#include <cstdint>

#include "common/cuda/sparsify/kernel_args.h"
#include "common/cuda/sparsify/state.h"

namespace gtopk {
namespace cuda {
namespace internal {

// init.cu: InitKernel (one block of kScanThreads).
void LaunchInit(cudaStream_t stream, DeviceState* st, const InitArgs& a,
                Gate gate);

// histogram.cu: the first pass over u (HistogramKernel): the fused update
// (update) or the histogram of u alone; `ties`: the variant that counts the
// ties at a predicted key.
void LaunchHistogram(bool update, bool ties, int blocks, cudaStream_t stream,
                     const HistArgs& a);
// Resident blocks per SM of the fused update (its one-wave grid).
cudaError_t UpdateBlocksPerSm(int* per_sm);

// digits.cu: the radix digits after the first: a histogram pass over u
// (HistLevelKernel), over a candidate or sample array (HistArrayKernel), and
// the one-block decision after the fused update's histogram
// (FindBinDecideKernel, one block of kScanThreads).
void LaunchHistLevel(int blocks, cudaStream_t stream, const float* u,
                     uint64_t n, int vectorized, DeviceState* st, ull* hists,
                     int level, Gate gate, Then then);
void LaunchHistArray(int blocks, cudaStream_t stream, const float* data,
                     const ull* d_len, uint64_t len, DeviceState* st,
                     ull* hists, int level, Gate gate, Then then);
void LaunchHistArray(int blocks, cudaStream_t stream, const uint32_t* data,
                     const ull* d_len, uint64_t len, DeviceState* st,
                     ull* hists, int level, Gate gate, Then then);
void LaunchFindBinDecide(cudaStream_t stream, DeviceState* st, const ull* hists,
                         int level, ull compact_cap, Gate gate,
                         const InitArgs& init, const UpdateCandidates& uc);

// collect.cu: the stable compaction of u (CollectKernel, its variant by
// `hist` and `count_keys`) and Gaussian-k's first compaction over the
// update's candidates (GaussUpdateCollectKernel).
void LaunchCollect(CollectHist hist, bool count_keys, int blocks,
                   cudaStream_t stream, const float* u, uint64_t n,
                   uint64_t chunk, int vectorized, DeviceState* st,
                   uint32_t host_key, int use_host_key, uint32_t* regions,
                   uint32_t* counts, uint32_t* equal_counts, ull* hists,
                   Gate gate, const CollectScan& scan);
void LaunchGaussUpdateCollect(int blocks, cudaStream_t stream, const float* u,
                              DeviceState* st, uint32_t* regions,
                              uint32_t* counts, uint64_t chunk, int groups,
                              Gate gate, const CollectScan& scan);

// gather.cu: GatherKernel.
void LaunchGather(int blocks, cudaStream_t stream, float* u,
                  const uint32_t* regions, uint64_t chunk,
                  const uint32_t* counts, const ull* offsets, int num_warps,
                  uint32_t* out_idx, float* out_val, uint32_t* trim_idx,
                  float* trim_val, int zero, DeviceState* st, ull* hists,
                  int next_hist, int route, Gate gate, Then then,
                  const UpdateLayout& upd);

// final.cu: the final stable compaction (CountFinalKernel, then
// WriteFinalKernel on the same grid, or on a compaction's layout).
void LaunchCountFinal(int blocks, cudaStream_t stream, const float* cand_val,
                      const float* u, uint64_t n, DeviceState* st,
                      FinalRule rule, uint32_t* greater, uint32_t* equal,
                      ull* block_greater, ull* block_equal, const ull* hists,
                      Gate gate);
void LaunchWriteFinal(int blocks, cudaStream_t stream, const uint32_t* cand_idx,
                      const float* cand_val, uint64_t n, DeviceState* st,
                      FinalRule rule, const uint32_t* greater,
                      const uint32_t* equal, const ull* block_greater,
                      const ull* block_equal, uint32_t* out_idx, float* out_val,
                      float* u, int zero, Gate gate, uint64_t layout_chunk,
                      const uint32_t* regions);

// sample.cu: the sample of runs of 16 (SampleKernel).
void LaunchSample(int blocks, cudaStream_t stream, const float* u, uint64_t n,
                  uint64_t runs, uint32_t* sample, ull* hist0, DeviceState* st,
                  Gate gate, Then then);

// gauss.cu: the Gaussian-k planner (GaussPlanKernel, one block of
// kScanThreads) and the host continuation's count (CountAtLeastKernel).
void LaunchGaussPlan(cudaStream_t stream, DeviceState* st, const ull* hist0,
                     const double* partials, uint64_t n, double z, ull lo,
                     ull hi, int max_adjustments, ull* at_least_out,
                     int max_keys, const InitArgs& init,
                     const UpdateCandidates& uc, ull compact_cap);
void LaunchCountAtLeast(int blocks, cudaStream_t stream, const float* values,
                        DeviceState* st, uint32_t min_key);

// tiny.cu: the whole selection of a small u in one block (TinySelectKernel).
void LaunchTinySelect(cudaStream_t stream, float* u, uint64_t n,
                      DeviceState* st, const InitArgs& init, const TinyArgs& a,
                      uint32_t* out_idx, float* out_val);

// elementwise.cu: the first non-finite position (FirstNonFiniteKernel, kThreads
// per block) and the sparse updates of dense vectors (256 per block).
void LaunchFirstNonFinite(int blocks, cudaStream_t stream, const float* u,
                          uint64_t n, DeviceState* st);
void LaunchScatter(int blocks, cudaStream_t stream, float* dst, uint64_t n,
                   const uint32_t* idx, const float* val, uint64_t count,
                   int subtract);
void LaunchGlobalMomentum(int blocks, cudaStream_t stream, float* params,
                          float* velocity, const float* update, uint64_t n,
                          float m);

}  // namespace internal
}  // namespace cuda
}  // namespace gtopk

#endif  // GTOPK_COMMON_CUDA_SPARSIFY_LAUNCHERS_H_
