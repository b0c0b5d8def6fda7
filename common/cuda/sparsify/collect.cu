// Stage: the stable compaction of u at a key (CollectKernel), and
// Gaussian-k's first compaction over the fused update's candidates instead
// (GaussUpdateCollectKernel); both finish with CollectScanBlock.
#include "common/cuda/launch.h"
#include "common/cuda/sparsify/collect_scan.cuh"
#include "common/cuda/sparsify/device_common.cuh"
#include "common/cuda/sparsify/launchers.h"

namespace gtopk {
namespace cuda {
namespace internal {
namespace {

// CollectKernel's Gaussian-k key counts (kCountKeys): the listed keys into
// key_list, a bitmap of their digit-0 bins into key_bins, and the per-warp
// counts zeroed (every thread of the block).
__device__ __forceinline__ void SetUpKeyCounts(const DeviceState* st,
                                               int num_keys, uint32_t* key_list,
                                               uint32_t* key_bins,
                                               uint32_t* key_counts) {
  for (int i = threadIdx.x; i < kBins / 32; i += kThreads) key_bins[i] = 0;
  for (int i = threadIdx.x; i < kWarpsPerBlock * kMaxGaussKeys; i += kThreads) {
    key_counts[i] = 0;
  }
  __syncthreads();
  for (int r = threadIdx.x; r < num_keys; r += kThreads) {
    const uint32_t key = st->gk_keys[r];
    key_list[r] = key;
    atomicOr(&key_bins[(key >> 20) / 32], 1u << ((key >> 20) % 32));
  }
  __syncthreads();
}

// A lane's four values of u at i (valid: inside the warp's chunk, which
// ends at `end`), as one float4 when aligned and whole.
__device__ __forceinline__ void Load4(const float* __restrict__ u, uint64_t i,
                                      uint64_t end, int vectorized, float x[4],
                                      bool valid[4]) {
  if (vectorized && i + 3 < end) {
    const float4 v = __ldg(reinterpret_cast<const float4*>(u + i));
    x[0] = v.x;
    x[1] = v.y;
    x[2] = v.z;
    x[3] = v.w;
    valid[0] = valid[1] = valid[2] = valid[3] = true;
  } else {
    for (int j = 0; j < 4; ++j) {
      valid[j] = i + j < end;
      if (valid[j]) x[j] = u[i + j];
    }
  }
}

// The warp's keys >= each listed key inside that key's digit-0 bin, added
// to its counts by lane 0 (every lane of the warp).
__device__ __forceinline__ void CountListedKeys(
    const float x[4], const bool valid[4], const uint32_t* key_bins,
    const uint32_t* key_list, int num_keys, int lane, uint32_t* my_key_counts) {
  bool listed[4];
  uint32_t any_listed = 0;
  for (int j = 0; j < 4; ++j) {
    const uint32_t bin = Key(x[j]) >> 20;
    listed[j] = valid[j] && ((key_bins[bin / 32] >> (bin % 32)) & 1u);
    any_listed |= __ballot_sync(kFullMask, listed[j]);
  }
  if (any_listed == 0) return;
  for (int r = 0; r < num_keys; ++r) {
    const uint32_t listed_key = key_list[r];
    uint32_t c = 0;
    for (int j = 0; j < 4; ++j) {
      const uint32_t key = Key(x[j]);
      c += __popc(__ballot_sync(
          kFullMask,
          listed[j] && key >= listed_key && (key >> 20) == (listed_key >> 20)));
    }
    if (lane == 0) my_key_counts[r] += c;
  }
}

// The block's per-warp key counts into state's gk_counts.
__device__ __forceinline__ void AddKeyCounts(DeviceState* st,
                                             const uint32_t* key_counts,
                                             int num_keys) {
  for (int r = threadIdx.x; r < num_keys; r += kThreads) {
    ull total = 0;
    for (int w = 0; w < kWarpsPerBlock; ++w) {
      total += key_counts[w * kMaxGaussKeys + r];
    }
    if (total != 0) atomicAdd(&st->gk_counts[r], total);
  }
}

// Warp-chunked stable compaction of u: every i with key(u[i]) >= min_key
// (state's min_key, or `host_key` when use_host_key) goes to the warp's
// region; counts[w] = how many. kHist: the histogram it builds
// (CollectHist). kCountKeys: also adds to state's gk_counts[r] the keys >=
// gk_keys[r] in that key's digit-0 bin (kept or not; Gaussian-k's
// correction). kCollectDigit0 with state's ties_at_bound (exact's sample or
// dgc's threshold B = min_key is a key much of u shares): keeps the
// keys > B and counts those == B per warp into equal_counts. Then `scan`
// (CollectScanBlock). Nothing when the exact plan reads u in its final pass
// (state's from_u), or when the gate is closed.
template <int kHist, bool kCountKeys>
__global__ void __launch_bounds__(kThreads)
    CollectKernel(const float* __restrict__ u, uint64_t n, uint64_t chunk,
                  int vectorized, DeviceState* st, uint32_t host_key,
                  int use_host_key, uint32_t* __restrict__ regions,
                  uint32_t* __restrict__ counts,
                  uint32_t* __restrict__ equal_counts, ull* hists, Gate gate,
                  CollectScan scan) {
  if (Closed(gate)) return;  // uniform
  __shared__ uint32_t hist[kHist ? kBins : 1];
  if (kHist) {
    for (int i = threadIdx.x; i < kBins; i += kThreads) hist[i] = 0;
    __syncthreads();
  }
  // uniform; counts are not read then
  if (st->from_u != 0 || st->from_update != 0) return;
  // Gaussian-k's first compaction reads the update's candidates instead
  // (GaussUpdateCollectKernel).
  if (kCountKeys && st->gauss_from_update != 0) return;  // uniform
  // kCountKeys: the listed keys, a bitmap of their digit-0 bins, and
  // per-warp counts (written by each warp's lane 0 only).
  __shared__ uint32_t key_list[kCountKeys ? kMaxGaussKeys : 1];
  __shared__ uint32_t key_bins[kCountKeys ? kBins / 32 : 1];
  __shared__ uint32_t
      key_counts[kCountKeys ? kWarpsPerBlock * kMaxGaussKeys : 1];
  const int num_keys = kCountKeys ? st->gk_num_keys : 0;
  if (kCountKeys) {
    SetUpKeyCounts(st, num_keys, key_list, key_bins, key_counts);
  }
  uint32_t* my_key_counts =
      key_counts + (kCountKeys ? (threadIdx.x / 32) * kMaxGaussKeys : 0);
  const int level = kHist == kCollectNextDigit ? st->levels_done
                    : kHist == kCollectDigit0  ? 0
                                               : 3;
  const bool skip = st->error != 0 || st->fallback != 0;
  // The update's candidates, if any, are overwritten from here on.
  if (!skip && blockIdx.x == 0 && threadIdx.x == 0) st->update_clobbered = 1;
  // With ties the bound B is min_key - 1 (registers: the pass must stay at
  // 32 for full occupancy).
  const bool ties = kHist == kCollectDigit0 && st->ties_at_bound != 0;
  const uint32_t min_key =
      (use_host_key ? host_key : st->min_key) + (ties ? 1u : 0u);
  const uint32_t prefix = st->prefix;
  const int lane = threadIdx.x & 31;
  const uint32_t lanes_below = (1u << lane) - 1u;
  const uint64_t warp =
      uint64_t{blockIdx.x} * kWarpsPerBlock + threadIdx.x / 32;
  const uint64_t begin = warp * chunk;
  const uint64_t end = begin + chunk < n ? begin + chunk : n;
  uint32_t* out = regions + begin;
  uint32_t count = 0;
  // With ties: each warp's count of keys == B, kept by its lane 0 in shared
  // memory (a register live across the loop made the pass spill).
  __shared__ uint32_t tie_counts[kHist == kCollectDigit0 ? kWarpsPerBlock : 1];
  uint32_t* my_ties =
      tie_counts + (kHist == kCollectDigit0 ? threadIdx.x / 32 : 0);
  if (kHist == kCollectDigit0 && lane == 0) *my_ties = 0;
  bool bad = false;
  if (!skip) {
    for (uint64_t base = begin; base < end; base += kChunkAlign) {
      const uint64_t i = base + 4 * lane;
      float x[4] = {0.f, 0.f, 0.f, 0.f};
      bool valid[4];
      Load4(u, i, end, vectorized, x, valid);
      if (kCountKeys && num_keys > 0) {
        CountListedKeys(x, valid, key_bins, key_list, num_keys, lane,
                        my_key_counts);
      }
      bool keep[4];
      uint32_t ballots[4];
      uint32_t any = 0;
      for (int j = 0; j < 4; ++j) {
        keep[j] = valid[j] && Key(x[j]) >= min_key;
        ballots[j] = __ballot_sync(kFullMask, keep[j]);
        any |= ballots[j];
      }
      if (ties) {  // uniform
        uint32_t equal = 0;
        for (int j = 0; j < 4; ++j) {
          equal += __popc(
              __ballot_sync(kFullMask, valid[j] && Key(x[j]) + 1u == min_key));
        }
        if (lane == 0) *my_ties += equal;
      }
      if (any == 0) continue;  // the common case: nothing kept here
      uint32_t pos = count;
      for (int j = 0; j < 4; ++j) pos += __popc(ballots[j] & lanes_below);
      for (int j = 0; j < 4; ++j) {
        if (!keep[j]) continue;
        const uint32_t key = Key(x[j]);
        out[pos++] = static_cast<uint32_t>(i + j);
        if (key >= kNonFiniteKey) bad = true;
        if (kHist != kCollectNoHist && level < 3 &&
            (kHist == kCollectDigit0 || MatchesPrefix(key, prefix, level))) {
          atomicAdd(&hist[Digit(key, level)], 1u);
        }
      }
      for (int j = 0; j < 4; ++j) count += __popc(ballots[j]);
    }
  }
  if (bad) atomicOr(&st->error, kErrorNonFinite);
  if (lane == 0) {
    counts[warp] = count;
    if (ties) equal_counts[warp] = *my_ties;
  }
  if (kCountKeys && num_keys > 0) {
    __syncthreads();
    AddKeyCounts(st, key_counts, num_keys);
  }
  if (kHist != kCollectNoHist && level < 3) {
    __syncthreads();
    ull* out = LevelHist(hists, level);
    for (int i = threadIdx.x; i < kBins; i += kThreads) {
      if (hist[i] != 0) atomicAdd(&out[i], static_cast<ull>(hist[i]));
    }
  }
  const ull block_total = BlockTotal(count);
  ull block_equal = 0;
  if (ties) {         // uniform
    __syncthreads();  // BlockTotal's shared counts are reused
    block_equal = BlockTotal(*my_ties);
  }
  CollectScanBlock(st, hists, scan, block_total, ties, block_equal);
}

// Gaussian-k's first compaction when the planner set state's
// gauss_from_update (its key and every key it listed lie in bins the
// first pass, the fused update or Gaussian-k's own, kept whole): the same
// work as CollectKernel<
// kCollectNoHist, true> at state's min_key, but over the update's
// candidates instead of u. Chunk c's region of `regions` (c * chunk: the
// indices of u the update kept, counts[c] of them, index order) is
// compacted in place by one warp (each kept index moves to a position at
// or before its own, so the order stays), counts[c] becomes the kept
// count, and block_offsets[g] the total of group g (kWarpsPerBlock chunks,
// as a compaction block's); the keys >= gk_keys[r] inside that key's
// digit-0 bin are added to state's gk_counts[r] (the update kept those
// bins whole, so the counts are u's). Then `scan` in the last block
// (CollectScanBlock over the `groups` counts; GaussResolve). The update's
// candidates are gone afterwards: a correction, or the host's
// continuation, compacts u again. Nothing when the flag is clear or the
// gate closed. Grid: any; each block takes groups blockIdx.x, + gridDim.x,
// ... (the update's own paper: AIR top-k's filter fused into the previous
// pass, Zhang et al., SC '23).
__global__ void __launch_bounds__(kThreads)
    GaussUpdateCollectKernel(const float* __restrict__ u, DeviceState* st,
                             uint32_t* __restrict__ regions,
                             uint32_t* __restrict__ counts, uint64_t chunk,
                             int groups, Gate gate, CollectScan scan) {
  if (Closed(gate) || st->gauss_from_update == 0) return;  // uniform
  __shared__ uint32_t key_list[kMaxGaussKeys];
  __shared__ uint32_t key_counts[kMaxGaussKeys];
  // The update's regions and counts are compacted in place: an exact
  // fallback after this may not take them (update_clobbered).
  if (blockIdx.x == 0 && threadIdx.x == 0) st->update_clobbered = 1;
  const int num_keys = st->gk_num_keys;
  for (int r = threadIdx.x; r < num_keys; r += kThreads) {
    key_list[r] = st->gk_keys[r];
    key_counts[r] = 0;
  }
  __syncthreads();
  const bool skip = st->error != 0 || st->fallback != 0;
  const uint32_t min_key = st->min_key;
  const int lane = threadIdx.x & 31;
  const uint32_t lanes_below = (1u << lane) - 1u;
  bool bad = false;
  for (int g = blockIdx.x; g < groups; g += gridDim.x) {  // uniform
    const uint64_t c = uint64_t(g) * kWarpsPerBlock + threadIdx.x / 32;
    uint32_t* region = regions + c * chunk;
    const uint32_t m = skip ? 0 : counts[c];
    uint32_t count = 0;
    for (uint32_t base = 0; base < m; base += 32) {  // uniform in the warp
      const uint32_t j = base + lane;
      const bool valid = j < m;
      uint32_t idx = 0, key = 0;
      if (valid) {
        idx = region[j];
        key = Key(u[idx]);
      }
      for (int r = 0; valid && r < num_keys; ++r) {
        const uint32_t listed = key_list[r];
        if ((key >> 20) == (listed >> 20) && key >= listed) {
          atomicAdd(&key_counts[r], 1u);
        }
      }
      const bool keep = valid && key >= min_key;
      // Every lane has read its index: the writes (at or before j) follow.
      const uint32_t ballot = __ballot_sync(kFullMask, keep);
      if (keep) {
        region[count + __popc(ballot & lanes_below)] = idx;
        if (key >= kNonFiniteKey) bad = true;
      }
      count += __popc(ballot);
    }
    if (lane == 0) counts[c] = count;
    const ull total = BlockTotal(count);
    if (threadIdx.x == 0) scan.block_offsets[g] = total;
    __syncthreads();  // BlockTotal's shared memory, reused
  }
  if (bad) atomicOr(&st->error, kErrorNonFinite);
  __syncthreads();
  for (int r = threadIdx.x; r < num_keys; r += kThreads) {
    if (key_counts[r] != 0) {
      atomicAdd(&st->gk_counts[r], static_cast<ull>(key_counts[r]));
    }
  }
  CollectScanBlock(st, nullptr, scan, 0, false, 0, groups);
}

}  // namespace

// (Launches as GTOPK_LAUNCH(kernel, grid, block, stream)(args), a form
// clang-format does not know.)
// clang-format off
void LaunchCollect(CollectHist hist, bool count_keys, int blocks,
                   cudaStream_t stream, const float* u, uint64_t n,
                   uint64_t chunk, int vectorized, DeviceState* st,
                   uint32_t host_key, int use_host_key, uint32_t* regions,
                   uint32_t* counts, uint32_t* equal_counts, ull* hists,
                   Gate gate, const CollectScan& scan) {
  // A pointer: the instantiations' commas would split the macro argument.
  auto* collect =
      hist == kCollectNextDigit ? &CollectKernel<kCollectNextDigit, false>
      : hist == kCollectDigit0  ? &CollectKernel<kCollectDigit0, false>
      : count_keys              ? &CollectKernel<kCollectNoHist, true>
                                : &CollectKernel<kCollectNoHist, false>;
  GTOPK_LAUNCH(collect, blocks, kThreads, stream)(
      u, n, chunk, vectorized, st, host_key, use_host_key, regions, counts,
      equal_counts, hists, gate, scan);
}

void LaunchGaussUpdateCollect(int blocks, cudaStream_t stream, const float* u,
                              DeviceState* st, uint32_t* regions,
                              uint32_t* counts, uint64_t chunk, int groups,
                              Gate gate, const CollectScan& scan) {
  GTOPK_LAUNCH(GaussUpdateCollectKernel, blocks, kThreads, stream)(
      u, st, regions, counts, chunk, groups, gate, scan);
}
// clang-format on

}  // namespace internal
}  // namespace cuda
}  // namespace gtopk
