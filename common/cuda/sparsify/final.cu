// Stage: the final stable compaction at the k-th key (CountFinalKernel,
// then WriteFinalKernel), with the exact plan's fine prediction of the next
// update's candidates in the count's last block (FinePredictBlock).
#include "common/cuda/launch.h"
#include "common/cuda/sparsify/device_common.cuh"
#include "common/cuda/sparsify/launchers.h"

namespace gtopk {
namespace cuda {
namespace internal {
namespace {

__device__ inline void FinalThreshold(const DeviceState* st, FinalRule rule,
                                      uint32_t* t, ull* ties) {
  if (rule.use_host_key) {
    *t = rule.host_key;
    *ties = ~0ull;
  } else {
    *t = st->prefix;
    *ties = st->need;
  }
}

// Warp chunk of the candidate array for this launch.
__device__ inline void CandidateChunk(ull m, uint64_t* begin, uint64_t* end) {
  const ull warps = ull{gridDim.x} * kWarpsPerBlock;
  ull chunk = (m + warps - 1) / warps;
  chunk = (chunk + 31) / 32 * 32;
  const ull warp = ull{blockIdx.x} * kWarpsPerBlock + threadIdx.x / 32;
  *begin = warp * chunk < m ? warp * chunk : m;
  *end = *begin + chunk < m ? *begin + chunk : m;
}

// The final compaction's source: u itself (index i) when the exact plan
// reads u (state's from_u), else the candidate arrays.
struct FinalSource {
  const float* values;
  const uint32_t* indices;  // null: the index is the position
  ull length;
};
__device__ inline FinalSource GetFinalSource(const DeviceState* st,
                                             const float* u, uint64_t n,
                                             const float* cand_val,
                                             const uint32_t* cand_idx) {
  if (st->from_u != 0) return FinalSource{u, nullptr, n};
  return FinalSource{cand_val, cand_idx, st->num_candidates};
}

// The smallest digit d in [0, bins) with base + (keys in hist's bins >= d)
// <= limit, or bins when there is none (one block of kBlock threads; the
// histogram read through L2; the result in every thread).
template <int kBlock>
__device__ int LowestBinAtMost(const ull* hist, int bins, ull base, ull limit) {
  using Scan = cub::BlockScan<ull, kBlock, cub::BLOCK_SCAN_WARP_SCANS>;
  __shared__ typename Scan::TempStorage storage;
  __shared__ int lowest;
  if (threadIdx.x == 0) lowest = bins;
  __syncthreads();
  ull above = base;  // base plus the keys in the tiles before
  for (int first = 0; first < bins; first += kBlock) {
    const int p = first + static_cast<int>(threadIdx.x);  // reversed bin
    const ull v = p < bins ? __ldcg(hist + (bins - 1 - p)) : 0;
    ull before, total;
    Scan(storage).ExclusiveSum(v, before, total);
    __syncthreads();  // storage free for the next tile
    if (p < bins && above + before + v <= limit)
      atomicMin(&lowest, bins - 1 - p);
    above += total;
  }
  __syncthreads();
  const int result = lowest;
  __syncthreads();  // `lowest` is rewritten by the next call
  return result;
}

// The exact plan's fine prediction (state's predict_fine; see
// UpdateCandidates), once the k-th key K = state's prefix is known, from
// the digit-1 histogram of K's digit-0 bin and the digit-2 histogram of its
// digit-1 bin (hists = hist0; exact for every key >= state's fine_floor):
// the first key T of the lowest digit-1 bin, else of the lowest digit-2
// bin (a single key), whose keys at or above it number at most state's
// fine_cap, raised to fine_floor and at most K; when even K's own keys
// exceed fine_cap but the keys above K do not, K with its ties counted
// (update_pred_ties); else none. Thread 0 writes update_pred_* for n.
template <int kBlock>
__device__ void FinePredictBlock(DeviceState* st, const ull* hists,
                                 uint64_t n) {
  const uint32_t kth = st->prefix;
  const uint32_t floor = st->fine_floor;
  const ull cap = st->fine_cap;
  const ull above_bin = st->greater_at[0];   // keys above K's digit-0 bin
  const ull above_bin1 = st->greater_at[1];  // above K's digit-1 bin
  const int d1 = static_cast<int>(Digit(kth, 1));
  const int d2 = static_cast<int>(Digit(kth, 2));
  uint32_t key = ~0u;
  const int low1 = LowestBinAtMost<kBlock>(LevelHist(hists, 1),
                                           1 << LevelBits(1), above_bin, cap);
  if (low1 <= d1) {
    key = (kth & 0xfff00000u) | (static_cast<uint32_t>(low1) << 9);
  } else {
    const int low2 = LowestBinAtMost<kBlock>(
        LevelHist(hists, 2), 1 << LevelBits(2), above_bin1, cap);
    if (low2 <= d2) key = (kth & ~0x1ffu) | static_cast<uint32_t>(low2);
  }
  if (threadIdx.x != 0) return;
  if (key != ~0u) {
    if (key < floor) key = floor;
    st->update_pred_key = ull{key} + 1;  // (<= K: floor <= K)
  } else if (st->count_greater <= cap) {
    // More than cap keys equal K itself: keep the keys > K, count the ties.
    st->update_pred_key = ull{kth} + 2;
    st->update_pred_ties = 1;
  }
  st->update_pred_n = n;
}

// Per warp chunk of the final source: keys > T and keys == T; then, in
// the last block, the exclusive scans of the blocks' totals of each
// (block_greater, block_equal: each block writes its totals at its index,
// WriteFinalKernel adds the warps before it in its block) and
// state->num_selected = the output count.
__global__ void __launch_bounds__(kThreads)
    CountFinalKernel(const float* cand_val, const float* u, uint64_t n,
                     DeviceState* st, FinalRule rule, uint32_t* greater,
                     uint32_t* equal, ull* block_greater, ull* block_equal,
                     const ull* hists, Gate gate) {
  // (The update's tie write replaces the plan's final compaction.)
  if (Closed(gate) || st->update_tie_write != 0) return;  // uniform
  const int lane = threadIdx.x & 31;
  const uint64_t warp =
      uint64_t{blockIdx.x} * kWarpsPerBlock + threadIdx.x / 32;
  uint32_t gt = 0, eq = 0;
  uint32_t t;
  ull ties;
  FinalThreshold(st, rule, &t, &ties);
  const bool ok = st->error == 0;
  if (ok) {
    const FinalSource src = GetFinalSource(st, u, n, cand_val, nullptr);
    uint64_t begin, end;
    CandidateChunk(src.length, &begin, &end);
    for (uint64_t base = begin; base < end; base += 32) {
      const uint64_t i = base + lane;
      const bool valid = i < end;
      const uint32_t key = valid ? Key(src.values[i]) : 0;
      gt += __popc(__ballot_sync(kFullMask, valid && key > t));
      eq += __popc(__ballot_sync(kFullMask, valid && key == t));
    }
  }
  if (lane == 0) {
    greater[warp] = gt;
    equal[warp] = eq;
  }
  const ull block_gt = BlockTotal(gt);
  __syncthreads();  // BlockTotal's shared counts are reused
  const ull block_eq = BlockTotal(eq);
  if (threadIdx.x == 0) {
    block_greater[blockIdx.x] = block_gt;
    block_equal[blockIdx.x] = block_eq;
  }
  if (!LastBlockDone(st)) return;  // uniform in the block
  const int blocks = static_cast<int>(gridDim.x);
  const ull g_total = ScanInPlace<kThreads>(block_greater, blocks);
  const ull e_total = ScanInPlace<kThreads>(block_equal, blocks);
  if (threadIdx.x == 0) {
    st->num_selected = ok ? g_total + (e_total < ties ? e_total : ties) : 0;
  }
  // The exact plan after Accumulate on a crowded bin: the next update's key.
  if (ok && !rule.use_host_key && st->predict_fine != 0) {  // uniform
    FinePredictBlock<kThreads>(st, hists, n);
  }
}

// Writes the selected candidates (key > T, or key == T among the first
// `ties` of them in index order) at their offsets; zero: u[i] = +0.0.
// greater/equal, block_greater/block_equal: CountFinalKernel's (same grid),
// or with layout_chunk != 0 a CollectKernel's with ties over u (its grid,
// warp w reading [w * layout_chunk, (w + 1) * layout_chunk)).
__global__ void __launch_bounds__(kThreads) WriteFinalKernel(
    const uint32_t* cand_idx, const float* cand_val, uint64_t n,
    DeviceState* st, FinalRule rule, const uint32_t* __restrict__ greater,
    const uint32_t* __restrict__ equal, const ull* __restrict__ block_greater,
    const ull* __restrict__ block_equal, uint32_t* __restrict__ out_idx,
    float* __restrict__ out_val, float* u, int zero, Gate gate,
    uint64_t layout_chunk, const uint32_t* __restrict__ regions) {
  if (Closed(gate) || st->error != 0) return;  // uniform
  // The plan's final compaction, replaced by the update's tie write; that
  // write (regions given) runs only when the plan chose it, under whatever
  // gate the chain has (gaussiank's fallback: gk_exact).
  if ((regions == nullptr) == (st->update_tie_write != 0)) return;  // uniform
  const int lane = threadIdx.x & 31;
  const uint32_t lanes_below = (1u << lane) - 1u;
  const uint64_t warp =
      uint64_t{blockIdx.x} * kWarpsPerBlock + threadIdx.x / 32;
  uint32_t t;
  ull ties;
  FinalThreshold(st, rule, &t, &ties);
  const FinalSource src = GetFinalSource(st, u, n, cand_val, cand_idx);
  uint64_t begin, end;
  if (layout_chunk != 0) {  // the compaction's warp chunks over u
    begin = warp * layout_chunk < src.length ? warp * layout_chunk : src.length;
    end = begin + layout_chunk < src.length ? begin + layout_chunk : src.length;
  } else {
    CandidateChunk(src.length, &begin, &end);
  }
  // Keys > T and == T before this warp's chunk: its block's, plus its
  // block's warps before it; the first `ties` ties are taken.
  ull greater_before = block_greater[blockIdx.x];
  ull tie = block_equal[blockIdx.x];
  for (uint64_t w = warp - threadIdx.x / 32; w < warp; ++w) {
    greater_before += greater[w];
    tie += equal[w];
  }
  ull out = greater_before + (tie < ties ? tie : ties);
  if (regions != nullptr && tie >= ties) {  // uniform in the warp
    // No tie left to take: the chunk's keys > T are the update's kept
    // ones (its region), without reading the chunk of u.
    const uint32_t kept = greater[warp];
    const uint32_t* region = regions + warp * layout_chunk;
    for (uint32_t j = lane; j < kept; j += 32) {
      TakeKept(region[j], u, out_idx, out_val, out + j, zero);
    }
    return;
  }
  for (uint64_t base = begin; base < end; base += 32) {
    const uint64_t i = base + lane;
    const bool valid = i < end;
    const float v = valid ? src.values[i] : 0.0f;
    const uint32_t key = Key(v);
    const bool is_tie = valid && key == t;
    const uint32_t tie_ballot = __ballot_sync(kFullMask, is_tie);
    const ull rank = tie + __popc(tie_ballot & lanes_below);
    const bool take = valid && (key > t || (is_tie && rank < ties));
    const uint32_t take_ballot = __ballot_sync(kFullMask, take);
    if (take) {
      const ull pos = out + __popc(take_ballot & lanes_below);
      const uint32_t idx =
          src.indices != nullptr ? src.indices[i] : static_cast<uint32_t>(i);
      out_idx[pos] = idx;
      out_val[pos] = v;
      if (zero) u[idx] = 0.0f;
    }
    out += __popc(take_ballot);
    tie += __popc(tie_ballot);
  }
}

}  // namespace

// (Launches as GTOPK_LAUNCH(kernel, grid, block, stream)(args), a form
// clang-format does not know.)
// clang-format off
void LaunchCountFinal(int blocks, cudaStream_t stream, const float* cand_val,
                      const float* u, uint64_t n, DeviceState* st,
                      FinalRule rule, uint32_t* greater, uint32_t* equal,
                      ull* block_greater, ull* block_equal, const ull* hists,
                      Gate gate) {
  GTOPK_LAUNCH(CountFinalKernel, blocks, kThreads, stream)(
      cand_val, u, n, st, rule, greater, equal, block_greater, block_equal,
      hists, gate);
}

void LaunchWriteFinal(int blocks, cudaStream_t stream,
                      const uint32_t* cand_idx, const float* cand_val,
                      uint64_t n, DeviceState* st, FinalRule rule,
                      const uint32_t* greater, const uint32_t* equal,
                      const ull* block_greater, const ull* block_equal,
                      uint32_t* out_idx, float* out_val, float* u, int zero,
                      Gate gate, uint64_t layout_chunk,
                      const uint32_t* regions) {
  GTOPK_LAUNCH(WriteFinalKernel, blocks, kThreads, stream)(
      cand_idx, cand_val, n, st, rule, greater, equal, block_greater,
      block_equal, out_idx, out_val, u, zero, gate, layout_chunk, regions);
}
// clang-format on

}  // namespace internal
}  // namespace cuda
}  // namespace gtopk
