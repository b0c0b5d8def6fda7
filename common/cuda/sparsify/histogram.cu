// Stage: the first pass over u (HistogramKernel): the digit-0 histogram and
// the sums of u, with the fused residual update (Sparsifier::Accumulate) or
// without it, and the candidates it keeps for the next selection.
#include "common/cuda/launch.h"
#include "common/cuda/sparsify/device_common.cuh"
#include "common/cuda/sparsify/launchers.h"
#include "common/cuda/sparsify/moments.cuh"
#include "common/cuda/sparsify/radix_steps.cuh"

namespace gtopk {
namespace cuda {
namespace internal {
namespace {

// One element of the update: the CPU rule's operations in its order.
__device__ inline float UpdateOne(float g, float p, float v, float r,
                                  const HistArgs& a, float* v_out) {
  const float wdp = a.weight_decay * p;
  g = g + wdp;
  float step = g;
  if (a.momentum_correction) {
    const float mv = a.momentum * v;
    step = mv + g;
    *v_out = step;
  }
  const float lv = a.lr * step;
  return r + lv;
}

// The pass's four values at i (valid of them: fewer at the chunk's end)
// into u: read from u, or with kUpdate computed by the CPU rule from the
// gradient, velocity and residual and written back (u = residual_out).
template <bool kUpdate>
__device__ __forceinline__ void LoadOrUpdate4(const HistArgs& a, uint64_t i,
                                              int valid, float u[4]) {
  if (a.vectorized && valid == 4) {
    if (kUpdate) {
      const float4 g = *reinterpret_cast<const float4*>(a.grad + i);
      const float4 p = a.params != nullptr
                           ? *reinterpret_cast<const float4*>(a.params + i)
                           : make_float4(0.f, 0.f, 0.f, 0.f);
      const float4 v = a.momentum_correction
                           ? *reinterpret_cast<const float4*>(a.velocity_in + i)
                           : make_float4(0.f, 0.f, 0.f, 0.f);
      const float4 r = *reinterpret_cast<const float4*>(a.residual_in + i);
      float4 vo;
      u[0] = UpdateOne(g.x, p.x, v.x, r.x, a, &vo.x);
      u[1] = UpdateOne(g.y, p.y, v.y, r.y, a, &vo.y);
      u[2] = UpdateOne(g.z, p.z, v.z, r.z, a, &vo.z);
      u[3] = UpdateOne(g.w, p.w, v.w, r.w, a, &vo.w);
      if (a.momentum_correction) {
        *reinterpret_cast<float4*>(a.velocity_out + i) = vo;
      }
      *reinterpret_cast<float4*>(a.residual_out + i) =
          make_float4(u[0], u[1], u[2], u[3]);
    } else {
      const float4 r = *reinterpret_cast<const float4*>(a.residual_in + i);
      u[0] = r.x;
      u[1] = r.y;
      u[2] = r.z;
      u[3] = r.w;
    }
  } else {
    for (int j = 0; j < valid; ++j) {
      if (kUpdate) {
        float vo = 0.0f;
        const float p = a.params != nullptr ? a.params[i + j] : 0.0f;
        const float v = a.momentum_correction ? a.velocity_in[i + j] : 0.0f;
        u[j] = UpdateOne(a.grad[i + j], p, v, a.residual_in[i + j], a, &vo);
        if (a.momentum_correction) a.velocity_out[i + j] = vo;
        a.residual_out[i + j] = u[j];
      } else {
        u[j] = a.residual_in[i + j];
      }
    }
  }
}

// The first radix histogram (digit 0 of |u|) and the sums of u; with
// kUpdate it first computes u = residual + lr*v and writes it. Both keep
// candidates for the selection after them (HistArgs::regions) when the
// state predicts a bin for this n (without kUpdate only when
// keep_candidates: Gaussian-k's own pass).
// Both hold at most 48 registers (5 blocks per SM; 64 unbounded with the
// compaction, and 40 spills): one wave of the fused update is the grid.
//
// kTies: the fused update that may count the ties at a predicted key
// (state's update_pred_ties; Accumulate launches it when the last
// selection's state predicted them): the count costs registers (a few
// bytes spill), so the usual pass is compiled without it, and counts none
// (update_used_ties = 0) whatever the state predicts.
template <bool kUpdate, bool kTies = false>
__global__ void __launch_bounds__(kThreads, 5) HistogramKernel(HistArgs a) {
  if (Closed(a.gate)) return;  // uniform
  __shared__ uint32_t hist[kBins];
  // With ties: each warp's count of the keys == K in its chunk, kept by
  // its lane 0 (in shared memory: a register more would spill).
  __shared__ uint32_t warp_equal[kWarpsPerBlock];
  for (int i = threadIdx.x; i < kBins; i += kThreads) hist[i] = 0;
  const bool keeps = kUpdate || a.keep_candidates != 0;
  // Read by every thread before block 0 writes what it used.
  const ull pred =
      keeps && a.st->update_pred_n == a.n ? a.st->update_pred_key : 0;
  const bool ties = kTies && pred != 0 && a.st->update_pred_ties != 0;
  __syncthreads();
  if (keeps && blockIdx.x == 0 && threadIdx.x == 0) {
    a.st->update_used_key = pred;
    a.st->update_used_ties = ties ? 1 : 0;
    a.st->update_used_n = a.n;
    a.st->update_clobbered = 0;
  }
  const bool compact = keeps && pred != 0;
  const uint32_t min_key = compact ? static_cast<uint32_t>(pred - 1) : 0;
  const int lane = threadIdx.x & 31;
  const uint32_t lanes_below = (1u << lane) - 1u;
  // Double sums (squares of |u| > ~1e19 would overflow float), shifted.
  ShiftedSums sums;
  const uint64_t warps = uint64_t{gridDim.x} * kWarpsPerBlock;
  for (uint64_t c = uint64_t{blockIdx.x} * kWarpsPerBlock + threadIdx.x / 32;
       c < static_cast<uint64_t>(a.layout_warps); c += warps) {
    const uint64_t begin = c * a.chunk;
    const uint64_t end = begin + a.chunk < a.n ? begin + a.chunk : a.n;
    uint32_t count = 0;
    if (lane == 0) warp_equal[threadIdx.x / 32] = 0;
    for (uint64_t base = begin; base < end; base += kChunkAlign) {
      const uint64_t i = base + 4 * lane;
      float u[4] = {0.f, 0.f, 0.f, 0.f};
      int valid = i < end ? static_cast<int>(end - i < 4 ? end - i : 4) : 0;
      LoadOrUpdate4<kUpdate>(a, i, valid, u);
      for (int j = 0; j < valid; ++j) {
        atomicAdd(&hist[Key(u[j]) >> 20], 1u);
        sums.Add(u[j]);
      }
      {
        if (!compact) continue;  // uniform
        uint32_t ballots[4];
        uint32_t any = 0;
        for (int j = 0; j < 4; ++j) {
          ballots[j] =
              __ballot_sync(kFullMask, j < valid && Key(u[j]) >= min_key);
          any |= ballots[j];
        }
        if (ties) {  // uniform
          uint32_t equal = 0;
          for (int j = 0; j < 4; ++j) {
            equal += __popc(__ballot_sync(
                kFullMask, j < valid && Key(u[j]) == min_key - 1));
          }
          if (lane == 0) warp_equal[threadIdx.x / 32] += equal;
        }
        if (any != 0) {
          uint32_t pos = count;
          for (int j = 0; j < 4; ++j) pos += __popc(ballots[j] & lanes_below);
          for (int j = 0; j < 4; ++j) {
            if ((ballots[j] >> lane) & 1u) {
              a.regions[begin + pos++] = static_cast<uint32_t>(i + j);
            }
          }
          for (int j = 0; j < 4; ++j) count += __popc(ballots[j]);
        }
      }
    }
    if (compact && lane == 0) {
      a.counts[c] = count;
      if (ties) a.eq_counts[c] = warp_equal[threadIdx.x / 32];
    }
  }
  const Moments block = BlockMoments<kThreads>(sums.Get());
  // Per-block partials, merged in a fixed order by GaussPlanKernel: double
  // atomics would make Gaussian-k's threshold depend on block timing.
  if (threadIdx.x == 0) {
    a.partials[3 * blockIdx.x] = block.n;
    a.partials[3 * blockIdx.x + 1] = block.mean;
    a.partials[3 * blockIdx.x + 2] = block.m2;
    if (blockIdx.x == 0) a.st->sum_blocks = static_cast<int>(gridDim.x);
  }
  __syncthreads();
  for (int i = threadIdx.x; i < kBins; i += kThreads) {
    if (hist[i] != 0) atomicAdd(&a.hist0[i], static_cast<ull>(hist[i]));
  }
  // Not in the fused update: its registers set its occupancy (one wave).
  if (!kUpdate) RunThen(a.st, a.hist0, a.then);
}

}  // namespace

// (Launches as GTOPK_LAUNCH(kernel, grid, block, stream)(args), a form
// clang-format does not know.)
// clang-format off
void LaunchHistogram(bool update, bool ties, int blocks, cudaStream_t stream,
                     const HistArgs& a) {
  if (update) {
    // (The variant that counts ties only where the last selection predicted
    // them for this n.)
    auto* update = ties ? &HistogramKernel<true, true>
                        : &HistogramKernel<true, false>;
    GTOPK_LAUNCH(update, blocks, kThreads, stream)(a);
  } else {
    auto* pass = ties ? &HistogramKernel<false, true>
                      : &HistogramKernel<false, false>;
    GTOPK_LAUNCH(pass, blocks, kThreads, stream)(a);
  }
}

cudaError_t UpdateBlocksPerSm(int* per_sm) {
  return cudaOccupancyMaxActiveBlocksPerMultiprocessor(
      per_sm, HistogramKernel<true>, kThreads, 0);
}
// clang-format on

}  // namespace internal
}  // namespace cuda
}  // namespace gtopk
