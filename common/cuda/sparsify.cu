// Kernels and host driver of common/cuda/sparsify.h. One translation unit on
// purpose (build time); see the header for the algorithms.
//
// Layout of the passes over u (length n): the grid has W warps
// (W <= kMaxWarps) and warp w owns the contiguous chunk [w*chunk,
// (w+1)*chunk) of u, chunk a multiple of 128, read as float4 per lane. A
// warp compacts the survivors of its chunk in index order with ballots into
// its own region of `regions_` (capacity chunk, so nothing can overflow)
// and records their count; one block scans the W counts. The concatenation
// of the regions in warp order is therefore sorted by index, which gives the
// stable (lower index first) order without a device-wide sort.
//
// The fused update (HistogramKernel<true>) partitions u the same way, with
// kUpdateChunks chunks per warp of its one-wave grid, so that the
// candidates it keeps for the next exact selection are index-ordered too.
//
// Candidate arrays (cand_idx_/cand_val_, length M on the device) use the
// same warp-chunk scheme with 32 entries per step.
//
// Built with --fmad=false (common/CMakeLists.txt, bench/cuda/device_check.sh)
// so that the residual update rounds like the CPU rule (-ffp-contract=off).
#include <algorithm>
#include <atomic>
#include <climits>
#include <cmath>
#include <cstring>
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "common/cuda/launch.h"
#include "common/cuda/sparsify.h"
#include "common/normal_quantile.h"

namespace gtopk {
namespace cuda {
namespace {

using ull = unsigned long long;

constexpr int kThreads = 256;
constexpr int kWarpsPerBlock = kThreads / 32;
// 1024 blocks of 256 threads: 97 % of one full wave on an H200 (132 SMs x 8).
constexpr int kMaxBlocks = 1024;
constexpr int kMaxWarps = kMaxBlocks * kWarpsPerBlock;  // 8192
// One-block kernels (Init, the Gaussian-k planner, FindBinDecide).
constexpr int kScanThreads = 1024;
constexpr uint64_t kChunkAlign = 128;                 // 32 lanes x float4
// Chunks per warp of the histogram pass (HistArgs::chunk): enough that a
// chunk rounded up to kChunkAlign leaves the warps' shares even.
constexpr int kUpdateChunks = 4;
constexpr uint32_t kNonFiniteKey = 0x7f800000u;
constexpr int kBins = 2048;  // largest digit: 11 bits
// The three digits' histograms, contiguous (LevelHist): 2048 + 2048 + 512.
constexpr int kHistsSize = 2 * kBins + 512;
constexpr uint32_t kFullMask = 0xffffffffu;
constexpr uint32_t kErrorNonFinite = 1;
constexpr uint32_t kErrorInternal = 2;
// Gaussian-k's device correction (DeviceState::gk_*): at most this many
// keys counted exactly in the first compaction pass. The rule reaches at
// most 153 keys in 16 adjustments (t * 0.5^a * 1.5^b, a + b <= 16; 14
// besides the first with the default 4), so the listing never overflows
// and the device replays the rule on every input.
constexpr int kMaxGaussKeys = 160;
// gk_mode 0: accepted at the planner's key, or an error or planner fallback.
constexpr int kGaussCorrect = 1;  // one more compaction at state's min_key
constexpr int kGaussHost = 2;     // Wait continues the adjustments
constexpr int kGaussExact = 3;    // they end out of range: the exact top-k

// Radix digits of the 31-bit key: bits 30..20, 19..9, 8..0.
__host__ __device__ inline int LevelShift(int level) {
  return level == 0 ? 20 : (level == 1 ? 9 : 0);
}
__host__ __device__ inline int LevelBits(int level) {
  return level == 2 ? 9 : 11;
}

__device__ inline uint32_t Key(float x) {
  return __float_as_uint(x) & 0x7fffffffu;
}
__device__ inline uint32_t Key(uint32_t key) { return key; }

// Does `key` share the digits above `level` with `prefix`?
__device__ inline bool MatchesPrefix(uint32_t key, uint32_t prefix, int level) {
  const int high = LevelShift(level) + LevelBits(level);
  return high >= 31 || (key >> high) == (prefix >> high);
}
__device__ inline uint32_t Digit(uint32_t key, int level) {
  return (key >> LevelShift(level)) & ((1u << LevelBits(level)) - 1u);
}

// Selection state in device memory, copied to the host at sync points.
struct DeviceState {
  // Radix select: after the three digits, `prefix` is the k-th key T,
  // `count_greater` counts keys > T and `need` is how many keys == T to
  // take (ties, lower index first).
  ull need;
  ull count_greater;
  ull num_candidates;  // entries kept by the last compaction (scan total)
  ull num_selected;    // output count of the final compaction
  ull count_at_least;  // CountAtLeastKernel's result
  ull first_non_finite;
  int sum_blocks;    // blocks of the histogram pass with partial sums
  double threshold;  // gaussiank: threshold where the planner stopped
  uint32_t prefix;
  uint32_t min_key;  // compaction threshold: keep key >= min_key
  uint32_t error;    // kError* bits
  int adjustments;   // gaussiank planner
  int fallback;      // gaussiank planner: go to the exact top-k
  int accepted;      // the compaction's count is in the method's range
  // Exact top-k's plan, decided on the device after each digit (see
  // DecideBlock): `levels_done` digits of the k-th key are known;
  // `bin_count` is how many keys the last chosen bin holds; `compact` = the
  // keys >= min_key are few enough to compact now; `from_u` = all three
  // digits came from passes over u and the final compaction reads u itself
  // (too many keys share the k-th key for a candidate copy to pay).
  ull bin_count;
  int levels_done;
  int u_passes;  // histogram passes over u whose digit FindBinDecide used
  int compact;
  int from_u;
  // Gaussian-k's correction on the device. GaussPlanKernel lists the keys
  // whose exact count the adjustments after its stop may need (those the
  // digit-0 histogram cannot decide), the first compaction pass counts the
  // keys >= each of them inside its digit-0 bin, and GaussResolve (in the
  // last block of that pass, CollectScanBlock) replays the CPU rule from the
  // planner's stop: gk_mode = kGaussCorrect with min_key = the key that
  // lands in range (one more compaction pass follows), kGaussExact (the
  // adjustments end without one: Wait runs the exact top-k), or kGaussHost
  // (the listing overflowed, possible only under a key limit the test
  // hook set: Wait continues the adjustments).
  int gk_num_keys;
  int gk_max_adjustments;
  int gk_mode;
  int gk_adjustments;  // with kGaussCorrect and kGaussExact: the rule's count
  // The rule ended out of range (the planner's fallback, or kGaussExact):
  // 1, with the rule's adjustment count. Kept by InitKernel(keep_gate), so
  // that the exact top-k's chain, gated on gk_exact, survives its own Init.
  int gk_exact;
  int gk_exact_adjustments;
  // dgc: the compaction's count when it set gk_exact (its survivors, which
  // SelectInfo::candidates reports); kept by InitKernel(keep_gate) too.
  ull gk_exact_candidates;
  uint32_t gk_keys[kMaxGaussKeys];
  ull gk_counts[kMaxGaussKeys];  // keys >= gk_keys[r] in its digit-0 bin
  // dgc: more than k (and at most n/8) survived the sampled threshold, so
  // the device takes the exact top-k among them (CollectScanBlock sets it and
  // restarts the radix state on the survivors' histograms, the trim
  // histograms); the trim's kernels are gated on it.
  int trim;
  // The exact top-k from a sample (exact's own, or gaussiank's gated
  // fallback). ties_at_bound: more than 1/8 of the sample is at or above
  // its bound B (min_key), so many keys equal B: the compaction keeps the
  // keys > B instead and counts those == B per warp. tie_write: fewer than
  // k keys exceed B and with the ties they reach k, so the k-th key is B:
  // the final write reads u (from_u) at prefix B with need = k - (keys >
  // B), on the compaction's warp layout. exact_from_u: neither the
  // survivors nor the ties give the top-k (fewer than k reach the bound,
  // or more than n/8 exceed it): the plan over u, gated on it; kept by
  // InitKernel(keep_gate), so that the plan's own Init keeps it.
  int ties_at_bound;
  int tie_write;
  ull tie_count;  // with ties_at_bound: the keys == B
  int exact_from_u;
  // dgc's sample seed for this selection (InitKernel copies it from the
  // pinned host value Select writes, when it runs: a replayed graph gets
  // this step's).
  ull seed;
  // Blocks of the running pass that finished (LastBlockDone); 0 between
  // kernels: its last block resets it, and so does InitKernel.
  unsigned int blocks_done;
  // The exact plan after Accumulate takes its candidates from the fused
  // update's compaction (see UpdateCandidates): no compaction pass over u.
  int from_update;
  // Gaussian-k: the planner's key, and any key it listed, lie at or above
  // the bin from which the first pass (the fused update, or Gaussian-k's
  // own histogram pass) kept its candidates, so its first compaction reads
  // those candidates
  // (GaussUpdateCollectKernel: in place, on the update's layout) instead
  // of u. Cleared by any later compaction over u (CollectScanBlock), after
  // which GatherKernel reads that compaction's layout again.
  int gauss_from_update;
  int gauss_used_update;  // the same, not cleared (SelectInfo reports it)
  // Candidates from the update, kept by InitKernel (they outlive a
  // selection). update_pred_key: 1 + the smallest key that the next fused
  // update (or Gaussian-k's own histogram pass) of an n = update_pred_n
  // residual keeps (0: none), written by the exact plan after Accumulate
  // from the k-th key it found (PredictUpdateBin: a digit-0 bin's first
  // key; FinePredictBlock: a finer key when that bin is crowded), or by
  // the Gaussian-k planner from its stop key (a bin's first key).
  // update_used_key/_n: the same for the last pass that may compact (the
  // fused update, Gaussian-k's own pass), which wrote them (0: it
  // compacted nothing).
  ull update_pred_key;
  ull update_pred_n;
  ull update_used_key;
  ull update_used_n;
  // The exact plan after Accumulate, when the k-th key's digit-0 bin holds
  // too many keys for PredictUpdateBin: predict_fine = 1 has the final
  // compaction's last block (CountFinalKernel) predict a finer key from the
  // digit-1 and digit-2 histograms (FinePredictBlock): the smallest whose
  // keys at or above it are at most fine_cap, and at least fine_floor (the
  // plan's digits came from candidates that hold the keys >= fine_floor
  // only). greater_at[l]: count_greater after digit l was found.
  int predict_fine;
  uint32_t fine_floor;
  ull fine_cap;
  ull greater_at[2];
  // Ties at the k-th key K (so many that no key under K keeps few: every
  // value equal, ties at density 0.01): update_pred_ties = 1 with
  // update_pred_key = K + 2 has the next update keep the keys > K and
  // count those == K per chunk (HistArgs::eq_counts); update_used_ties
  // says the last such pass did (kept by InitKernel, as the keys are).
  // update_tie_write: this selection's k-th key is that K again (fewer
  // than k kept, the ties make up the rest), so one write on the update's
  // layout takes the kept keys and the first ties from u (ExactFromU's
  // WriteFinalKernel on that layout, which runs only then), and the plan's
  // other kernels return at once.
  int update_pred_ties;
  int update_used_ties;
  int update_tie_write;
  // A compaction has written `regions` (or, in place, the update's
  // counts) since the last pass that kept candidates: those are gone,
  // whatever update_used_* say. Set by CollectKernel when it compacts and
  // by GaussUpdateCollectKernel, cleared by the pass that keeps them, kept
  // by InitKernel (as update_used_* are), read wherever the candidates
  // are taken (FindBinDecideKernel, GaussUpdatePlan): Gaussian-k's exact
  // fallback after its own compaction must plan over u, not over what
  // that compaction left.
  int update_clobbered;
};

// The state's slot at the head of the output buffer (Sparsifier::Impl::
// out), padded so that the indices after it start 64-byte aligned.
constexpr uint64_t kOutHeader = (sizeof(DeviceState) + 63) / 64 * 64;

// A kernel runs only while *flag == value (flag null: always): how the
// host enqueues work that the device's state decides on, with no round
// trip (Gaussian-k's corrected compaction, its exact fallback).
struct Gate {
  const int* flag;
  int value;
};
__device__ inline bool Closed(Gate g) {
  return g.flag != nullptr && *g.flag != g.value;
}

// The one-block step that follows a histogram pass, run by the pass's last
// block to finish instead of by a launch of its own (AIR top-k's scheme:
// one launch less per digit, and no gap between the two).
enum ThenOp {
  kThenNone = 0,
  kThenFindBin,   // FindBinBlock on the digit `level`
  kThenDecide,    // DecideBlock at `level` with `cap`
  kThenFindNext,  // FindNextBinBlock
};
struct Then {
  int op;
  int level;
  // kThenDecide: the compaction cap. kThenFindBin: 0, or a limit (the
  // exact top-k's sample, after its last digit): more than `cap` keys at or
  // above the found key set state's ties_at_bound (the bound is a key
  // shared by much of u: the compaction keeps the keys above it and counts
  // its ties).
  ull cap;
};

// Defined with the one-block steps below; `hists` = hist0 (hist0, hist1,
// hist2 are contiguous).
__device__ inline void RunThen(DeviceState* st, const ull* hists,
                               const Then& then);

// SplitMix64, as common/random.h's MixSeed.
__host__ __device__ inline ull Mix(ull seed, ull stream) {
  ull z = seed + 0x9e3779b97f4a7c15ull * (stream + 1);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// Smallest key whose value is strictly greater than t (CPU gaussiank's
// MinKeyAbove, common/cpu/gaussiank_selector.cc).
__host__ __device__ inline uint32_t MinKeyAbove(double t) {
  if (t < 0.0) return 0;
  const float tf = static_cast<float>(t);
  if (!(tf <= 3.402823466e38f)) return kNonFiniteKey;  // +Inf (t >= 0)
  uint32_t key;
#ifdef __CUDA_ARCH__
  key = __float_as_uint(tf) & 0x7fffffffu;
#else
  std::memcpy(&key, &tf, sizeof(key));
  key &= 0x7fffffffu;
#endif
  return static_cast<double>(tf) > t ? key : key + 1;
}

// ---------------------------------------------------------------------------
// Kernels
// ---------------------------------------------------------------------------

// Resets the state (the update_* fields survive, but for the prediction
// under clear_prediction: the fused update's prediction outlives a
// selection); zeroes hist1/hist2, (zero_hist0) hist0 and the
// trim histograms when given (kHistsSize entries); state's seed = *seed
// (pinned host memory) when given. keep_sums
// keeps sum_blocks (Accumulate's per-block partial sums stay valid),
// keep_candidates num_candidates, keep_gate gk_exact, gk_exact_adjustments,
// gk_exact_candidates, exact_from_u and error. Nothing when the gate is closed.
struct InitArgs {
  int run;  // 0: nothing (a one-block kernel that may start with it)
  ull* hist0;
  ull* hist1;
  ull* hist2;
  ull* trim_hists;
  const ull* seed;
  ull need;
  int zero_hist0, keep_sums, keep_candidates, keep_gate;
  // Drops the update's prediction (the next fused update keeps nothing):
  // exact after Accumulate from a sample, which predicts nothing itself.
  int clear_prediction;
};

// InitKernel's work, by one whole block (any size), when a.run: also at the
// start of the one-block kernel that follows Init directly (the planner
// and the first digit's decision after Accumulate's histogram), one launch
// less. The block must have read the gate already.
__device__ void InitBlock(DeviceState* st, const InitArgs& a) {
  if (!a.run) return;  // uniform
  __syncthreads();  // every thread has read the gate before thread 0 writes
  ull* hist0 = a.hist0;
  ull* hist1 = a.hist1;
  ull* hist2 = a.hist2;
  ull* trim_hists = a.trim_hists;
  const ull* seed = a.seed;
  const ull need = a.need;
  const int zero_hist0 = a.zero_hist0, keep_sums = a.keep_sums;
  const int keep_candidates = a.keep_candidates, keep_gate = a.keep_gate;
  for (int i = threadIdx.x; i < kBins; i += blockDim.x) {
    if (zero_hist0) hist0[i] = 0;
    hist1[i] = 0;
    if (i < 512) hist2[i] = 0;
  }
  if (trim_hists != nullptr) {
    for (int i = threadIdx.x; i < kHistsSize; i += blockDim.x) {
      trim_hists[i] = 0;
    }
  }
  // What is kept, read (thread 0) before the block zeroes the state.
  int sum_blocks = 0, exact = 0, exact_adjustments = 0, exact_from_u = 0;
  ull candidates = 0, exact_candidates = 0, step_seed = 0;
  ull pred_key = 0, pred_n = 0, used_key = 0, used_n = 0;
  int pred_ties = 0, used_ties = 0, clobbered = 0;
  uint32_t error = 0;
  if (threadIdx.x == 0) {
    pred_key = a.clear_prediction ? 0 : st->update_pred_key;
    pred_ties = a.clear_prediction ? 0 : st->update_pred_ties;
    pred_n = st->update_pred_n;
    used_key = st->update_used_key;
    used_ties = st->update_used_ties;
    used_n = st->update_used_n;
    clobbered = st->update_clobbered;
    sum_blocks = st->sum_blocks;
    candidates = st->num_candidates;
    exact = st->gk_exact;
    exact_adjustments = st->gk_exact_adjustments;
    exact_candidates = st->gk_exact_candidates;
    exact_from_u = st->exact_from_u;
    error = st->error;
    if (seed != nullptr) step_seed = *seed;
  }
  __syncthreads();
  static_assert(sizeof(DeviceState) % sizeof(ull) == 0, "whole words");
  ull* words = reinterpret_cast<ull*>(st);
  for (int i = threadIdx.x; i < static_cast<int>(sizeof(DeviceState) / 8);
       i += blockDim.x) {
    words[i] = 0;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    st->need = need;
    st->first_non_finite = ~0ull;
    st->seed = step_seed;
    st->update_pred_key = pred_key;
    st->update_pred_ties = pred_ties;
    st->update_pred_n = pred_n;
    st->update_used_key = used_key;
    st->update_used_ties = used_ties;
    st->update_used_n = used_n;
    st->update_clobbered = clobbered;
    if (keep_sums) st->sum_blocks = sum_blocks;
    if (keep_candidates) st->num_candidates = candidates;
    if (keep_gate) {  // and an error the gated-on chain found before
      st->gk_exact = exact;
      st->gk_exact_adjustments = exact_adjustments;
      st->gk_exact_candidates = exact_candidates;
      st->exact_from_u = exact_from_u;
      st->error = error;
    }
  }
  __syncthreads();  // the state is written before the block goes on
}

__global__ void InitKernel(DeviceState* st, InitArgs a, Gate gate) {
  if (Closed(gate)) return;  // uniform
  InitBlock(st, a);
}

// Count, mean and sum of squared deviations (M2) of some values: what
// Gaussian-k's mean and std come from, merged by Chan et al.'s formula
// ("Updating formulae and a pairwise algorithm for computing sample
// variances", 1979) in a fixed order, so that the result is well
// conditioned when |mean| >> std (the one-pass sum of squares minus sum
// times mean cancels there) and the same on every run.
struct Moments {
  double n, mean, m2;
};
__host__ __device__ inline Moments MergeMoments(const Moments& a,
                                                const Moments& b) {
  const double n = a.n + b.n;
  if (n == 0.0) return Moments{0.0, 0.0, 0.0};
  const double delta = b.mean - a.mean;
  return Moments{n, a.mean + delta * (b.n / n),
                 a.m2 + b.m2 + delta * delta * (a.n * b.n / n)};
}

// One thread's values as deviations from its first one (`shift`): the
// sums of d = x - shift and d^2 in double (well conditioned: |d| is about
// the spread, not the offset).
struct ShiftedSums {
  float shift = 0.0f;  // the first value (exact in double)
  uint32_t count = 0;
  double sum = 0.0, sumsq = 0.0;
  __device__ void Add(float x) {
    if (count == 0) shift = x;
    const double d = static_cast<double>(x) - static_cast<double>(shift);
    ++count;
    sum += d;
    sumsq += d * d;
  }
  __device__ Moments Get() const {
    if (count == 0) return Moments{0.0, 0.0, 0.0};
    const double c = static_cast<double>(count);
    const double mean_d = sum / c;
    return Moments{c, static_cast<double>(shift) + mean_d,
                   fmax(0.0, sumsq - sum * mean_d)};
  }
};

// The block's Moments (kBlock threads, a power of two >= 256) by fixed
// rounds of MergeMoments (thread t into slot t % 256, the lower threads
// first), then a fixed tree over the 256 slots; in thread 0.
template <int kBlock>
__device__ Moments BlockMoments(Moments mine) {
  constexpr int kSlots = 256;
  static_assert(kBlock % kSlots == 0, "whole rounds");
  __shared__ double tree_n[kSlots], tree_mean[kSlots], tree_m2[kSlots];
  const int t = static_cast<int>(threadIdx.x);
  const int slot = t % kSlots;
// Not unrolled: unrolled, the fused update needed more than its 48 registers.
#ifdef __CUDACC__
#pragma unroll 1
#endif
  for (int round = 0; round < kBlock / kSlots; ++round) {
    if (t / kSlots == round) {
      const Moments merged =
          round == 0 ? mine
                     : MergeMoments(Moments{tree_n[slot], tree_mean[slot],
                                            tree_m2[slot]},
                                    mine);
      tree_n[slot] = merged.n;
      tree_mean[slot] = merged.mean;
      tree_m2[slot] = merged.m2;
    }
    __syncthreads();
  }
// Not unrolled: unrolled, the fused update needed more than its 48 registers.
#ifdef __CUDACC__
#pragma unroll 1
#endif
  for (int stride = kSlots / 2; stride > 0; stride /= 2) {
    if (t < stride) {
      const Moments merged = MergeMoments(
          Moments{tree_n[t], tree_mean[t], tree_m2[t]},
          Moments{tree_n[t + stride], tree_mean[t + stride],
                  tree_m2[t + stride]});
      tree_n[t] = merged.n;
      tree_mean[t] = merged.mean;
      tree_m2[t] = merged.m2;
    }
    __syncthreads();
  }
  const Moments result{tree_n[0], tree_mean[0], tree_m2[0]};
  __syncthreads();  // the tree is rewritten by the next call
  return result;
}

struct HistArgs {
  const float* grad;
  const float* params;
  const float* velocity_in;
  float* velocity_out;
  const float* residual_in;  // u when not updating
  float* residual_out;
  uint64_t n;
  float lr, momentum, weight_decay;
  int momentum_correction;
  int vectorized;  // every pointer 16-byte aligned
  DeviceState* st;
  ull* hist0;
  double* partials;  // [3 * block]: the block's Moments of u (n, mean, M2)
  Gate gate;         // nothing while closed
  Then then;         // the last block's step after the pass (RunThen);
                     // HistogramKernel<false> only
  // The partition of u (the same with and without the update, so that the
  // per-block sums are too): `layout_warps` chunks of `chunk` entries (a
  // multiple of kChunkAlign), chunk c read by warp c % (grid's warps).
  uint64_t chunk;
  int layout_warps;  // a multiple of kWarpsPerBlock
  // HistogramKernel<true>, and HistogramKernel<false> with keep_candidates
  // (Gaussian-k's own pass): when state's update_pred_n == n, every i with
  // key(u[i]) >= update_pred_key - 1 goes to chunk c's region of
  // `regions` (c * chunk, index order) and counts[c] = how many, for
  // every c < layout_warps (UpdateCandidates); state's update_used_* say
  // whether it did.
  uint32_t* regions;
  uint32_t* counts;
  // With state's update_pred_ties (the key is K + 1): eq_counts[c] = the
  // keys == K in chunk c.
  uint32_t* eq_counts;
  int keep_candidates;
};

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
  const ull pred = keeps && a.st->update_pred_n == a.n
                       ? a.st->update_pred_key
                       : 0;
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
      if (a.vectorized && valid == 4) {
        if (kUpdate) {
          const float4 g = *reinterpret_cast<const float4*>(a.grad + i);
          const float4 p = a.params != nullptr
                               ? *reinterpret_cast<const float4*>(a.params + i)
                               : make_float4(0.f, 0.f, 0.f, 0.f);
          const float4 v =
              a.momentum_correction
                  ? *reinterpret_cast<const float4*>(a.velocity_in + i)
                  : make_float4(0.f, 0.f, 0.f, 0.f);
          const float4 r =
              *reinterpret_cast<const float4*>(a.residual_in + i);
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
          const float4 r =
              *reinterpret_cast<const float4*>(a.residual_in + i);
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
            const float v =
                a.momentum_correction ? a.velocity_in[i + j] : 0.0f;
            u[j] =
                UpdateOne(a.grad[i + j], p, v, a.residual_in[i + j], a, &vo);
            if (a.momentum_correction) a.velocity_out[i + j] = vo;
            a.residual_out[i + j] = u[j];
          } else {
            u[j] = a.residual_in[i + j];
          }
        }
      }
      for (int j = 0; j < valid; ++j) {
        atomicAdd(&hist[Key(u[j]) >> 20], 1u);
        sums.Add(u[j]);
      }
      {
        if (!compact) continue;  // uniform
        uint32_t ballots[4];
        uint32_t any = 0;
        for (int j = 0; j < 4; ++j) {
          ballots[j] = __ballot_sync(kFullMask, j < valid && Key(u[j]) >= min_key);
          any |= ballots[j];
        }
        if (ties) {  // uniform
          uint32_t equal = 0;
          for (int j = 0; j < 4; ++j) {
            equal += __popc(
                __ballot_sync(kFullMask, j < valid && Key(u[j]) == min_key - 1));
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

// What is known of the count of keys >= key, against [lo, hi].
enum GaussVerdict { kTooFew, kTooMany, kInRange, kUndecided };

__device__ inline int CountVerdict(ull count, ull lo, ull hi) {
  return count < lo ? kTooFew : (count > hi ? kTooMany : kInRange);
}

// at_least[b] = keys whose digit 0 is >= b, for b in [0, kBins) (0 above).
__device__ inline ull AtLeastBin(const ull* at_least, uint32_t bin) {
  return bin < static_cast<uint32_t>(kBins) ? at_least[bin] : 0;
}

// The verdict the digit-0 histogram allows for `key`: its count lies
// between the counts at the bounds of its bin.
__device__ inline int HistVerdict(const ull* at_least, uint32_t key, ull lo,
                                  ull hi) {
  const uint32_t bin = key >> 20;
  const ull upper = AtLeastBin(at_least, bin);
  const ull lower = (key & 0xfffffu) == 0 ? upper : AtLeastBin(at_least, bin + 1);
  if (upper < lo) return kTooFew;
  if (lower > hi) return kTooMany;
  if (lower >= lo && upper <= hi) return kInRange;
  return kUndecided;
}

// Gaussian-k after the planner's stop at `first` (threshold t, `remaining`
// adjustments left): lists in state's gk_keys every other key the CPU rule
// can reach from there whose count the histogram leaves undecided, so that
// the compaction at `first` counts them exactly. From a threshold the rule
// moves to t*0.5 or t*1.5; the keys reachable in d more adjustments are
// those of t * 0.5^a * 1.5^b with a + b = d (at most 153 for 16), each
// visited once; a decided verdict follows its one branch, an undecided one
// both. Keys beyond max_keys (kMaxGaussKeys, less only through
// set_gaussiank_key_limit_for_testing) are not listed (GaussResolve then
// leaves the rest to the host). One thread; `value` and
// `reached` are kGaussSide^2 scratch entries (shared memory: as local
// arrays they would reserve local memory for every resident thread).
constexpr int kGaussSide = 17;  // adjustments left <= 16
__device__ void ListGaussKeys(DeviceState* st, const ull* at_least, double t,
                              uint32_t first, int remaining, ull lo, ull hi,
                              int max_keys, double* value, bool* reached) {
  constexpr int kSide = kGaussSide;
  for (int i = 0; i < kSide * kSide; ++i) reached[i] = false;
  reached[0] = true;
  value[0] = t;
  int listed = 0;
  for (int d = 0; d <= remaining; ++d) {
    for (int a = 0; a <= d; ++a) {
      const int node = a * kSide + (d - a);
      if (!reached[node]) continue;
      const double v = value[node];
      if (d > 0 && v <= 0.0) continue;  // the rule stops (exact top-k)
      const uint32_t key = d == 0 ? first : MinKeyAbove(v);
      const int verdict =
          d == 0 ? kUndecided : HistVerdict(at_least, key, lo, hi);
      if (verdict == kInRange) continue;
      if (verdict == kUndecided && key != first) {
        bool known = false;
        for (int r = 0; r < listed; ++r) known |= st->gk_keys[r] == key;
        if (!known && listed < max_keys) st->gk_keys[listed++] = key;
      }
      if (d == remaining) continue;
      if (verdict != kTooMany && !reached[node + kSide]) {
        reached[node + kSide] = true;
        value[node + kSide] = v * 0.5;
      }
      if (verdict != kTooFew && !reached[node + 1]) {
        reached[node + 1] = true;
        value[node + 1] = v * 1.5;
      }
    }
  }
  st->gk_num_keys = listed;
}

// Gaussian-k's correction (thread 0 of the last block of the
// compaction at the planner's key): replays the CPU rule from there, with
// the exact count at that key, the listed keys' exact counts and the
// histogram's verdicts elsewhere. gk_mode = kGaussCorrect and min_key = the
// key whose count is in range; kGaussExact with gk_adjustments when the
// rule ends without one (the exact top-k); kGaussHost when it meets a key
// it has no count for (the listing overflowed); unchanged (0) when the
// first count was accepted or after an error or a planner fallback.
__device__ void GaussResolve(DeviceState* st, const ull* at_least, ull lo,
                             ull hi) {
  if (st->error != 0 || st->fallback != 0 || st->accepted != 0) return;
  st->gk_mode = kGaussHost;
  const uint32_t first = st->min_key;
  const ull first_count = st->num_candidates;
  double t = st->threshold;
  int adjustments = st->adjustments;
  uint32_t key = first;
  for (;;) {
    int verdict;
    if (key == first) {
      verdict = CountVerdict(first_count, lo, hi);
    } else {
      verdict = HistVerdict(at_least, key, lo, hi);
      for (int r = 0; verdict == kUndecided && r < st->gk_num_keys; ++r) {
        if (st->gk_keys[r] == key) {
          verdict = CountVerdict(
              AtLeastBin(at_least, (key >> 20) + 1) + st->gk_counts[r], lo, hi);
        }
      }
    }
    if (verdict == kInRange) {
      st->gk_mode = kGaussCorrect;
      st->min_key = key;
      st->gk_adjustments = adjustments;
      return;
    }
    if (verdict == kUndecided) return;  // not listed: the host continues
    const bool last = adjustments == st->gk_max_adjustments;
    if (!last) t = verdict == kTooFew ? t * 0.5 : t * 1.5;
    if (last || t <= 0.0) {
      st->gk_mode = kGaussExact;
      st->gk_adjustments = adjustments;
      st->gk_exact = 1;
      st->gk_exact_adjustments = adjustments;
      return;
    }
    ++adjustments;
    key = MinKeyAbove(t);
  }
}

// Finds the digit at `level` that holds the need-th largest key among the
// keys matching the prefix, from that level's histogram (one block of
// kBlock threads: a one-block kernel's, or the last block of the pass that
// built the histogram, which reads it through L2). Level 0 also flags
// non-finite keys.
template <int kBlock>
__device__ void FindBinBlock(DeviceState* st, const ull* hist, int level) {
  using Scan = cub::BlockScan<ull, kBlock, cub::BLOCK_SCAN_WARP_SCANS>;
  __shared__ typename Scan::TempStorage storage;
  __shared__ int found;
  __shared__ int non_finite;
  const uint32_t error = st->error;
  const ull need = st->need;
  if (threadIdx.x == 0) {
    found = 0;
    non_finite = 0;
  }
  __syncthreads();
  if (error != 0) return;  // uniform
  const int bins = 1 << LevelBits(level);
  // The bins from the largest digit down, in tiles of one per thread (few
  // registers: in a histogram pass's last block they would count against
  // the whole pass); `above` = keys in the tiles before. The non-finite
  // digits (>= 0x7f8) lie in the first tile.
  ull above = 0;
  for (int base = 0; base < bins; base += kBlock) {
    const int p = base + static_cast<int>(threadIdx.x);  // reversed bin
    const ull v = p < bins ? __ldcg(hist + (bins - 1 - p)) : 0;
    if (level == 0 && p < bins &&
        bins - 1 - p >= static_cast<int>(kNonFiniteKey >> 20) && v != 0) {
      non_finite = 1;
    }
    ull before, total;
    Scan(storage).ExclusiveSum(v, before, total);  // keys in higher bins
    __syncthreads();  // non_finite complete; storage free for the next tile
    if (non_finite) {  // uniform
      if (threadIdx.x == 0) atomicOr(&st->error, kErrorNonFinite);
      return;
    }
    before += above;
    if (p < bins && v != 0 && before < need && need <= before + v) {
      const uint32_t digit = static_cast<uint32_t>(bins - 1 - p);
      const uint32_t prefix = st->prefix | (digit << LevelShift(level));
      st->prefix = prefix;
      st->min_key = prefix;
      st->count_greater += before;
      if (level < 2) st->greater_at[level] = st->count_greater;
      st->need = need - before;
      st->bin_count = v;
      found = 1;
    }
    above += total;
  }
  __syncthreads();
  if (threadIdx.x == 0 && !found) atomicOr(&st->error, kErrorInternal);
}

// The histogram of digit `level` in `hists` (hist0, hist1, hist2 are
// contiguous, kBins apart).
__device__ inline ull* LevelHist(ull* hists, int level) {
  return hists + level * kBins;
}
__device__ inline const ull* LevelHist(const ull* hists, int level) {
  return hists + level * kBins;
}

// FindBinBlock for the next undecided digit (state's levels_done), when one
// is left; then levels_done + 1.
template <int kBlock>
__device__ void FindNextBinBlock(DeviceState* st, const ull* hists) {
  const int level = st->levels_done;  // read by every thread before writes
  __syncthreads();
  if (level >= 3) return;  // uniform
  FindBinBlock<kBlock>(st, LevelHist(hists, level), level);
  __syncthreads();
  if (threadIdx.x == 0) st->levels_done = level + 1;
}

// Exact top-k's plan after the digit `level` from a pass over u: nothing
// once the compaction was decided. Otherwise FindBinBlock, then: the keys
// >= the new min_key (count_greater + bin_count) are at most `compact_cap`:
// compact u at that key next (the remaining digits come from the
// candidates); else, after the last digit, the final compaction reads u
// (from_u); else one more histogram pass over u decides the next digit.
// The number of passes over u therefore depends on how the keys spread
// over the digits, never on how many keys one bin holds.
template <int kBlock>
__device__ void DecideBlock(DeviceState* st, const ull* hists, int level,
                            ull compact_cap) {
  const int skip = st->compact | st->from_u;  // read before writes
  __syncthreads();
  if (skip) return;  // uniform
  FindBinBlock<kBlock>(st, LevelHist(hists, level), level);
  __syncthreads();
  if (threadIdx.x != 0) return;
  st->levels_done = level + 1;
  st->u_passes = level + 1;
  if (st->error != 0) return;
  if (st->count_greater + st->bin_count <= compact_cap) {
    st->compact = 1;
  } else if (level == 2) {
    st->from_u = 1;
  }
}

template <int kBlock>
__device__ ull ScanInPlace(ull* v, int count);

// The fused update's compaction (HistArgs::regions/counts) as the exact
// plan's candidates: when the last fused update of this n kept every key
// >= a key T (state's update_used_*), and those keys number at least k (so
// the k-th key is >= T) and at most the compaction cap, the candidates are
// already in `regions`, index-ordered: the plan skips its compaction pass
// over u (CollectKernel returns at once; GatherKernel reads this layout)
// and takes its remaining digits from them. Their counts are exact for
// every key >= T, and the plan only ever counts at or above the k-th key.
// T for the next update is the first key of the digit-0 bin one below the
// k-th key's (1/8 to 2/8 of a binade under that key: room for the next
// step's drift; a drop of less than about 8 % always stays in), or of the
// k-th key's own bin when the bin below holds too many keys to be worth
// keeping (PredictUpdateBin). When the k-th key's bin itself holds too
// many (a narrow band: most of u shares its high bits), a finer key under
// the k-th, from the plan's digit-1 and digit-2 histograms
// (FinePredictBlock).
struct UpdateCandidates {
  const uint32_t* counts;  // [warps]: the update's per-chunk counts
  ull* offsets;            // [warps / kWarpsPerBlock]: group offsets out
  const uint32_t* eq_counts;  // [warps]: with ties, the keys == K
  ull* eq_offsets;            // [warps / kWarpsPerBlock]: theirs
  int warps;     // 0: no update layout (nothing is used or predicted)
  uint64_t n;
  ull predict_cap;  // the most keys a predicted bin may keep
};

// The bin the next first pass of an n = uc.n residual keeps candidates
// from (state's update_pred_*; thread 0), from a key in digit-0 bin `bin`
// (known: the selection found one): one bin under it when the keys from
// there (at_below) are at most uc.predict_cap, else `bin` itself when the
// keys from it (at_bin) are, else none. Shared by the exact plan (its k-th
// key) and the Gaussian-k planner (its stop key). Returns whether it
// predicted a bin.
__device__ inline bool PredictUpdateBin(DeviceState* st, bool known,
                                        uint32_t bin, ull at_bin,
                                        ull at_below,
                                        const UpdateCandidates& uc) {
  ull pred = 0;
  if (known && at_bin <= uc.predict_cap) {
    const uint32_t from = bin > 0 && at_below <= uc.predict_cap ? bin - 1 : bin;
    pred = (ull{from} << 20) + 1;
  }
  st->update_pred_key = pred;
  st->update_pred_ties = 0;
  st->update_pred_n = uc.n;
  return pred != 0;
}

// The keys the fine prediction keeps at most: about four times k (the
// margin for drift on a crowded bin), never more than the update's cap.
__host__ __device__ inline ull FineCap(ull k, ull predict_cap) {
  return 4 * k < predict_cap ? 4 * k : predict_cap;
}

// The per-chunk counts of the update's layout (`warps` chunks) summed per
// group of kWarpsPerBlock chunks (a compaction block's), then their
// exclusive scan into `offsets`; returns the total (every thread of the
// one block of kScanThreads).
__device__ ull GroupOffsets(const uint32_t* counts, ull* offsets, int warps) {
  const int groups = warps / kWarpsPerBlock;
  for (int g = threadIdx.x; g < groups; g += kScanThreads) {
    ull t = 0;
    for (int w = 0; w < kWarpsPerBlock; ++w) t += counts[g * kWarpsPerBlock + w];
    offsets[g] = t;
  }
  __syncthreads();
  return ScanInPlace<kScanThreads>(offsets, groups);
}

// DecideBlock on its own (the digit-0 histogram came from the fused
// update), after InitBlock when init.run; then, at level 0, the update's
// candidates (UpdateCandidates) when they hold the plan's (k = init.need).
__global__ void __launch_bounds__(kScanThreads)
    FindBinDecideKernel(DeviceState* st, const ull* hists, int level,
                        ull compact_cap, Gate gate, InitArgs init,
                        UpdateCandidates uc) {
  if (Closed(gate)) return;  // uniform
  InitBlock(st, init);
  DecideBlock<kScanThreads>(st, hists, level, compact_cap);
  if (level != 0 || uc.warps == 0) return;  // uniform
  __shared__ int kept, kept_ties;
  __shared__ uint32_t kept_from;
  __syncthreads();  // DecideBlock's thread 0 wrote the plan
  if (threadIdx.x == 0) {
    kept = st->error == 0 && st->update_used_n == uc.n &&
           st->update_used_key != 0 && st->update_clobbered == 0;
    kept_ties = kept && st->update_used_ties != 0;
    kept_from = static_cast<uint32_t>(st->update_used_key - 1);
  }
  __syncthreads();
  // The kept keys' offsets (GatherKernel's, the tie write's), and the
  // ties' (uniform branches).
  const ull total = kept ? GroupOffsets(uc.counts, uc.offsets, uc.warps) : 0;
  const ull equal =
      kept_ties ? GroupOffsets(uc.eq_counts, uc.eq_offsets, uc.warps) : 0;
  if (threadIdx.x != 0) return;
  const bool ok = st->error == 0;
  const ull k = init.need;
  // The kept keys (all keys >= kept_from) hold the top k.
  const bool use = kept && total >= k && total <= compact_cap;
  if (kept_ties && !use && total < k && total + equal >= k) {
    // The k-th key is K = kept_from - 1 again: the kept keys (> K) and
    // the first k - total ties, written from u on the update's layout.
    const uint32_t tie_key = kept_from - 1;
    st->update_tie_write = 1;
    st->from_update = 1;
    st->from_u = 1;
    st->compact = 1;
    st->levels_done = 3;
    st->prefix = tie_key;
    st->min_key = tie_key;
    st->count_greater = total;
    st->need = k - total;
    st->num_candidates = total;
    st->num_selected = k;
    // The same key next time.
    st->update_pred_key = ull{kept_from} + 1;
    st->update_pred_ties = 1;
    st->update_pred_n = uc.n;
    return;
  }
  if (use) {
    st->from_update = 1;
    st->num_candidates = total;
    // The remaining digits come from the candidates, however many keys
    // the k-th key's bin holds in u.
    st->compact = 1;
  }
  // The next update's key. Keys at or above the k-th key's bin:
  // count_greater covers the bins above it, bin_count its own.
  const uint32_t bin = st->prefix >> 20;  // the k-th key's digit 0
  const ull at_bin = st->count_greater + st->bin_count;
  if (!PredictUpdateBin(st, ok, bin, at_bin,
                        ok && bin > 0 ? at_bin + hists[bin - 1] : at_bin,
                        uc) &&
      ok) {
    st->predict_fine = 1;
    st->fine_floor = use ? kept_from : 0;
    st->fine_cap = FineCap(init.need, uc.predict_cap);
  }
}

// True in every thread of the block that finishes the grid's pass last
// (the count of finished blocks in state's blocks_done, which it resets):
// every other block's atomics and writes are then visible to it (the fence
// before counting; reads through L2, __ldcg). Every thread of the block
// must call it.
__device__ inline bool LastBlockDone(DeviceState* st) {
  __shared__ int last;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    const unsigned int before = atomicAdd(&st->blocks_done, 1u);
    last = before == gridDim.x - 1;
    if (last) st->blocks_done = 0;
  }
  __syncthreads();
  const bool is_last = last != 0;
  if (is_last) __threadfence();
  return is_last;
}

// The pass's `then`, in its last block (kThreads threads). Every thread of
// every block that did not return early calls it.
__device__ inline void RunThen(DeviceState* st, const ull* hists,
                               const Then& then) {
  if (then.op == kThenNone) return;  // uniform
  if (!LastBlockDone(st)) return;    // uniform in the block
  if (then.op == kThenFindBin) {
    FindBinBlock<kThreads>(st, LevelHist(hists, then.level), then.level);
    if (then.cap != 0) {  // uniform
      __syncthreads();  // the thread that found the bin wrote the counts
      if (threadIdx.x == 0 && st->error == 0 &&
          st->count_greater + st->bin_count > then.cap) {
        st->ties_at_bound = 1;
      }
    }
  } else if (then.op == kThenDecide) {
    DecideBlock<kThreads>(st, hists, then.level, then.cap);
  } else {
    FindNextBinBlock<kThreads>(st, hists);
  }
}

// Histogram of digit `level` over u, keys matching state's prefix, then
// `then` (the plan's DecideBlock at that digit); nothing once the compaction
// was decided (state's compact), no histogram after an error.
__global__ void __launch_bounds__(kThreads)
    HistLevelKernel(const float* __restrict__ u, uint64_t n, int vectorized,
                    DeviceState* st, ull* hists, int level, Gate gate,
                    Then then) {
  if (Closed(gate) || st->compact != 0) return;  // uniform
  const bool skip = st->error != 0;
  __shared__ uint32_t hist[kBins];
  for (int i = threadIdx.x; i < kBins; i += kThreads) hist[i] = 0;
  __syncthreads();
  const uint32_t prefix = st->prefix;
  const uint64_t stride = uint64_t{gridDim.x} * kThreads;
  for (uint64_t g4 = uint64_t{blockIdx.x} * kThreads + threadIdx.x;
       !skip && g4 * 4 < n; g4 += stride) {
    const uint64_t i = g4 * 4;
    float x[4];
    int valid = 4;
    if (vectorized && i + 3 < n) {
      const float4 v = __ldg(reinterpret_cast<const float4*>(u + i));
      x[0] = v.x;
      x[1] = v.y;
      x[2] = v.z;
      x[3] = v.w;
    } else {
      valid = static_cast<int>(n - i < 4 ? n - i : 4);
      for (int j = 0; j < valid; ++j) x[j] = u[i + j];
    }
    for (int j = 0; j < valid; ++j) {
      const uint32_t key = Key(x[j]);
      if (MatchesPrefix(key, prefix, level)) {
        atomicAdd(&hist[Digit(key, level)], 1u);
      }
    }
  }
  __syncthreads();
  ull* out = LevelHist(hists, level);
  for (int i = threadIdx.x; i < kBins; i += kThreads) {
    if (hist[i] != 0) atomicAdd(&out[i], static_cast<ull>(hist[i]));
  }
  RunThen(st, hists, then);
}

// Exclusive prefix sums of v[0, count) in place, in tiles of kBlock (v
// written by the other blocks of the grid: read through L2); returns the
// total in every thread. One block: a pass's last (LastBlockDone).
template <int kBlock>
__device__ ull ScanInPlace(ull* v, int count) {
  using Scan = cub::BlockScan<ull, kBlock, cub::BLOCK_SCAN_WARP_SCANS>;
  __shared__ typename Scan::TempStorage storage;
  ull above = 0;
  for (int base = 0; base < count; base += kBlock) {
    const int i = base + static_cast<int>(threadIdx.x);
    const ull x = i < count ? __ldcg(v + i) : 0;
    ull before, total;
    Scan(storage).ExclusiveSum(x, before, total);
    __syncthreads();  // storage free for the next tile
    if (i < count) v[i] = above + before;
    above += total;
  }
  return above;
}

// The sum of the block's per-warp counts `mine` (every thread passes its
// warp's; lane 0's is used), in every thread.
__device__ inline ull BlockTotal(uint32_t mine) {
  __shared__ uint32_t warp_counts[kWarpsPerBlock];
  __shared__ ull block_total;
  if ((threadIdx.x & 31) == 0) warp_counts[threadIdx.x / 32] = mine;
  __syncthreads();
  if (threadIdx.x == 0) {
    ull t = 0;
    for (int w = 0; w < kWarpsPerBlock; ++w) t += warp_counts[w];
    block_total = t;
  }
  __syncthreads();
  return block_total;
}

// What follows a compaction pass, in its last block (no launch of its own):
// the exclusive scan of the blocks' kept counts in `block_offsets` (each
// block writes its count at its index; GatherKernel adds the counts of the
// warps before it in its block), the total in state's num_candidates, and
// state's accepted = total in [accept_lo, accept_hi] (and no error or
// planner fallback). Then: at_least given: Gaussian-k's GaussResolve with
// [accept_lo, accept_hi]; exact_above != 0 and a total not accepted and
// above it, or below exact_below: state's gk_exact = 1 (dgc: the exact
// top-k from u), or with sampled_exact its exact_from_u = 1 (the exact
// top-k's sample: the plan over u); trim (dgc and exact's sample;
// the pass counted the survivors' digit 0): a total in (accept_hi,
// exact_above] sets state's trim and restarts the radix state for the
// accept_hi-th largest survivor; find_next or trim: FindNextBinBlock on the
// pass's histograms. With state's ties_at_bound (the pass kept the keys >
// B = min_key and counted those == B: exact's sample, dgc's threshold) also
// the scan of the blocks' tie counts in `block_equal` (total in state's
// tie_count), and the decision from both counts (k = accept_hi): exact:
// exactly k above B accepted, more trimmed (at most n/8), fewer that reach
// k with the ties a tie write, else exact_from_u; dgc (survivors = keys >=
// B): at most k a tie write of all of them, else at least k above B
// trimmed (at most n/8, else gk_exact), else a tie write of the top k. A
// tie write sets state's tie_write, from_u, prefix B, need (the ties to
// take, lower index first) and num_selected.
struct CollectScan {
  ull* block_offsets = nullptr;   // [grid]: the blocks' counts, then offsets
  ull* block_equal = nullptr;     // [grid]: with ties, the same for the ties
  const ull* at_least = nullptr;  // GaussResolve's (the first compaction)
  ull accept_lo = 1;
  ull accept_hi = 0;  // accept nothing
  ull exact_above = 0;
  ull exact_below = 0;
  int sampled_exact = 0;
  int find_next = 0;
  int trim = 0;
};

// The trim: the exact top-k among the kept survivors, a radix select over
// them restarted from the digit-0 histogram the compaction built (state's
// trim gates the kernels that finish it). One thread.
__device__ inline void StartTrim(DeviceState* st, ull k) {
  st->trim = 1;
  st->need = k;
  st->prefix = 0;
  st->count_greater = 0;
  st->levels_done = 0;
}

__device__ void CollectScanBlock(DeviceState* st, const ull* hists,
                                 const CollectScan& s, ull block_total,
                                 bool ties, ull block_equal, int slots = -1) {
  // slots < 0: a compaction over u, one count per block (written here);
  // else GaussUpdateCollectKernel, which wrote `slots` group counts itself.
  const bool over_u = slots < 0;
  if (over_u) slots = static_cast<int>(gridDim.x);
  if (threadIdx.x == 0 && over_u) {
    s.block_offsets[blockIdx.x] = block_total;
    if (ties) s.block_equal[blockIdx.x] = block_equal;
  }
  if (!LastBlockDone(st)) return;  // uniform in the block
  // A compaction over u replaces the update's candidates (same regions).
  if (threadIdx.x == 0 && over_u) st->gauss_from_update = 0;
  const ull total = ScanInPlace<kThreads>(s.block_offsets, slots);
  const ull equal =
      ties ? ScanInPlace<kThreads>(s.block_equal, static_cast<int>(gridDim.x))
           : 0;
  if (threadIdx.x == 0 && ties) {
    // Ties at the sample's bound B (exact's sample, or dgc's threshold):
    // `total` keys > B were kept and `equal` keys == B counted.
    st->num_candidates = total;
    st->tie_count = equal;
    const ull k = s.accept_hi;
    ull write_need = 0, write_count = 0;  // a tie write: > B, then ties
    bool accepted = false, trim = false, from_u = false;
    if (st->error != 0) {
      // nothing: Wait reports it
    } else if (s.sampled_exact) {
      if (total == k) {
        accepted = true;  // exactly the top k
      } else if (total > k) {
        trim = total <= s.exact_above;  // the top k are all > B
        from_u = !trim;
      } else if (total + equal >= k) {  // the k-th key is B
        write_need = k - total;
        write_count = k;
      } else {
        from_u = true;  // the sample missed
      }
    } else if (total == k) {
      accepted = true;  // dgc: exactly its top k are > B
    } else if (total + equal <= k) {
      // dgc: every survivor (key >= B): the keys > B and every tie.
      write_need = equal;
      write_count = total + equal;
    } else if (total >= k) {
      // dgc: the exact top-k among the survivors, all of them > B.
      trim = total <= s.exact_above;
      from_u = !trim;
    } else {  // dgc: the k-th survivor is B
      write_need = k - total;
      write_count = k;
    }
    st->accepted = accepted;
    if (write_count != 0) {
      st->tie_write = 1;
      st->from_u = 1;
      st->prefix = st->min_key;
      st->need = write_need;
      st->num_selected = write_count;
    }
    if (trim) StartTrim(st, k);
    if (from_u && s.sampled_exact) {
      st->exact_from_u = 1;
    } else if (from_u) {
      st->gk_exact = 1;
      st->gk_exact_candidates = total + equal;
    }
  } else if (threadIdx.x == 0) {
    st->num_candidates = total;
    st->accepted = st->error == 0 && st->fallback == 0 &&
                   total >= s.accept_lo && total <= s.accept_hi;
    if (s.at_least != nullptr) {
      GaussResolve(st, s.at_least, s.accept_lo, s.accept_hi);
    }
    // dgc: more than exact_above survive (most of u ties with the sampled
    // threshold); exact's sample: that, or fewer than k (it missed): the
    // exact top-k from u, gated on gk_exact (exact_from_u).
    if (st->error == 0 && !st->accepted &&
        ((s.exact_above != 0 && total > s.exact_above) ||
         total < s.exact_below)) {
      if (s.sampled_exact) {
        st->exact_from_u = 1;
      } else {
        st->gk_exact = 1;
        st->gk_exact_candidates = total;
      }
    }
    // dgc and exact's sample: the exact top-k among the survivors, a radix
    // select over them from the digit-0 histogram this pass built.
    if (s.trim && st->error == 0 && !st->accepted && total > s.accept_hi &&
        (s.exact_above == 0 || total <= s.exact_above)) {
      StartTrim(st, s.accept_hi);
    }
  }
  __syncthreads();
  if (s.find_next || st->trim != 0) FindNextBinBlock<kThreads>(st, hists);
}

// The histogram a compaction pass builds of the keys it keeps, into that
// digit's histogram in `hists`.
enum CollectHist {
  kCollectNoHist = 0,
  // The next undecided digit (state's levels_done, if < 3) of the kept keys
  // matching state's prefix (the exact plan).
  kCollectNextDigit = 1,
  // Digit 0 of every kept key (dgc's trim; 8 registers fewer than the
  // above, which would cost the pass occupancy on every dgc step).
  kCollectDigit0 = 2,
};

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
    for (int i = threadIdx.x; i < kBins / 32; i += kThreads) key_bins[i] = 0;
    for (int i = threadIdx.x; i < kWarpsPerBlock * kMaxGaussKeys;
         i += kThreads) {
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
  uint32_t* my_ties = tie_counts + (kHist == kCollectDigit0 ? threadIdx.x / 32 : 0);
  if (kHist == kCollectDigit0 && lane == 0) *my_ties = 0;
  bool bad = false;
  if (!skip) {
    for (uint64_t base = begin; base < end; base += kChunkAlign) {
      const uint64_t i = base + 4 * lane;
      float x[4] = {0.f, 0.f, 0.f, 0.f};
      bool valid[4];
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
      if (kCountKeys && num_keys > 0) {
        bool listed[4];
        uint32_t any_listed = 0;
        for (int j = 0; j < 4; ++j) {
          const uint32_t bin = Key(x[j]) >> 20;
          listed[j] = valid[j] && ((key_bins[bin / 32] >> (bin % 32)) & 1u);
          any_listed |= __ballot_sync(kFullMask, listed[j]);
        }
        if (any_listed != 0) {
          for (int r = 0; r < num_keys; ++r) {
            const uint32_t listed_key = key_list[r];
            uint32_t c = 0;
            for (int j = 0; j < 4; ++j) {
              const uint32_t key = Key(x[j]);
              c += __popc(__ballot_sync(
                  kFullMask, listed[j] && key >= listed_key &&
                                 (key >> 20) == (listed_key >> 20)));
            }
            if (lane == 0) my_key_counts[r] += c;
          }
        }
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
    for (int r = threadIdx.x; r < num_keys; r += kThreads) {
      ull total = 0;
      for (int w = 0; w < kWarpsPerBlock; ++w) {
        total += key_counts[w * kMaxGaussKeys + r];
      }
      if (total != 0) atomicAdd(&st->gk_counts[r], total);
    }
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
  if (ties) {  // uniform
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

// Where GatherKernel writes.
enum GatherRoute {
  kGatherAlways = 0,      // to out_*
  kGatherIfAccepted = 1,  // to out_* if state's accepted, else nothing
  // dgc: accepted: to out_*, with no histogram and no `then`; trimming
  // (state's trim): to trim_*, not zeroing (the trim's final compaction
  // does), with the histogram and `then`; else nothing.
  kGatherDgc = 2,
};

// The fused update's layout (UpdateCandidates), which GatherKernel reads
// instead of the compaction's when state's from_update or
// gauss_from_update.
struct UpdateLayout {
  uint64_t chunk;
  const uint32_t* counts;
  const ull* offsets;
  int warps;
};

// A kept index into the output at `pos`, with its value read from u
// (zero: u[idx] = +0.0 after reading); returns the value.
__device__ inline float TakeKept(uint32_t idx, float* u, uint32_t* out_idx,
                                 float* out_val, ull pos, int zero) {
  const float v = u[idx];
  out_idx[pos] = idx;
  out_val[pos] = v;
  if (zero) u[idx] = 0.0f;
  return v;
}

// Concatenates the warps' regions (index order) into out_idx/out_val, with
// the values read from u (the fused update's regions in its layout `upd`
// when state's from_update); zero: u[i] = +0.0 after reading. next_hist: the
// histogram of the next undecided digit (state's levels_done, if < 3) over
// the gathered keys matching state's prefix, into that digit's histogram in
// `hists`. Then `then`. Nothing when the exact plan reads u (state's
// from_u). `route` (GatherRoute) says where to, as the state decides.
__global__ void __launch_bounds__(kThreads)
    GatherKernel(float* u, const uint32_t* __restrict__ regions, uint64_t chunk,
                 const uint32_t* __restrict__ counts,
                 const ull* __restrict__ offsets, int num_warps,
                 uint32_t* __restrict__ out_idx, float* __restrict__ out_val,
                 uint32_t* __restrict__ trim_idx, float* __restrict__ trim_val,
                 int zero, DeviceState* st, ull* hists, int next_hist,
                 int route, Gate gate, Then then, UpdateLayout upd) {
  __shared__ uint32_t hist[kBins];
  if (Closed(gate) || st->from_u != 0) return;  // uniform
  if (st->from_update != 0 || st->gauss_from_update != 0) {  // uniform
    chunk = upd.chunk;
    counts = upd.counts;
    offsets = upd.offsets;
    num_warps = upd.warps;
  }
  const bool accepted = st->accepted != 0;
  const bool trimming = route == kGatherDgc && !accepted && st->trim != 0;
  if (route == kGatherDgc && !trimming) then.op = kThenNone;  // uniform
  if (trimming) {
    out_idx = trim_idx;
    out_val = trim_val;
    zero = 0;
  }
  const int hist_level =
      next_hist && (route != kGatherDgc || trimming) && st->levels_done < 3
          ? st->levels_done
          : -1;
  const bool with_hist = hist_level >= 0;
  if (with_hist) {
    for (int i = threadIdx.x; i < kBins; i += kThreads) hist[i] = 0;
  }
  __syncthreads();
  const bool skip = st->error != 0 ||
                    (route != kGatherAlways && !accepted && !trimming);
  const uint32_t prefix = st->prefix;
  const int lane = threadIdx.x & 31;
  const int total_warps = static_cast<int>(gridDim.x) * kWarpsPerBlock;
  if (!skip) {
    for (int w = static_cast<int>(blockIdx.x) * kWarpsPerBlock +
                 static_cast<int>(threadIdx.x) / 32;
         w < num_warps; w += total_warps) {
      const uint32_t c = counts[w];
      // The compaction's block offset plus its warps before this one.
      const int first = w - w % kWarpsPerBlock;
      ull off = offsets[w / kWarpsPerBlock];
      for (int j = first; j < w; ++j) off += counts[j];
      const uint32_t* region = regions + uint64_t(w) * chunk;
      for (uint32_t j = lane; j < c; j += 32) {
        const float v = TakeKept(region[j], u, out_idx, out_val, off + j, zero);
        if (with_hist) {
          const uint32_t key = Key(v);
          if (MatchesPrefix(key, prefix, hist_level)) {
            atomicAdd(&hist[Digit(key, hist_level)], 1u);
          }
        }
      }
    }
  }
  if (with_hist) {
    __syncthreads();
    ull* out = LevelHist(hists, hist_level);
    for (int i = threadIdx.x; i < kBins; i += kThreads) {
      if (hist[i] != 0) atomicAdd(&out[i], static_cast<ull>(hist[i]));
    }
  }
  RunThen(st, hists, then);
}

// Histogram of digit `level` over data[0, len) (len = *d_len when given),
// keys matching state's prefix, into that digit's histogram in `hists`;
// then `then`. Nothing when the gate is closed or state's levels_done
// says that digit is decided already.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    HistArrayKernel(const T* __restrict__ data, const ull* d_len, uint64_t len,
                    DeviceState* st, ull* hists, int level, Gate gate,
                    Then then) {
  // Nothing once that digit is decided (the exact plan's digit 2, when its
  // compaction pass already counted digit 1).
  if (Closed(gate) || st->levels_done > level) return;  // uniform
  __shared__ uint32_t hist[kBins];
  for (int i = threadIdx.x; i < kBins; i += kThreads) hist[i] = 0;
  __syncthreads();
  const bool skip = st->error != 0;
  const uint64_t length = d_len != nullptr ? *d_len : len;
  const uint32_t prefix = st->prefix;
  if (!skip) {
    for (uint64_t i = uint64_t{blockIdx.x} * kThreads + threadIdx.x; i < length;
         i += uint64_t{gridDim.x} * kThreads) {
      const uint32_t key = Key(data[i]);
      if (MatchesPrefix(key, prefix, level)) {
        atomicAdd(&hist[Digit(key, level)], 1u);
      }
    }
  }
  __syncthreads();
  ull* out = LevelHist(hists, level);
  for (int i = threadIdx.x; i < kBins; i += kThreads) {
    if (hist[i] != 0) atomicAdd(&out[i], static_cast<ull>(hist[i]));
  }
  RunThen(st, hists, then);
}

// The final threshold: T and how many of the keys == T to take.
struct FinalRule {
  int use_host_key;  // T = host_key and take every tie
  uint32_t host_key;
};

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
__device__ int LowestBinAtMost(const ull* hist, int bins, ull base,
                               ull limit) {
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
    if (p < bins && above + before + v <= limit) atomicMin(&lowest, bins - 1 - p);
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
  const ull above_bin = st->greater_at[0];  // keys above K's digit-0 bin
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
__global__ void __launch_bounds__(kThreads)
    WriteFinalKernel(const uint32_t* cand_idx, const float* cand_val,
                     uint64_t n, DeviceState* st, FinalRule rule,
                     const uint32_t* __restrict__ greater,
                     const uint32_t* __restrict__ equal,
                     const ull* __restrict__ block_greater,
                     const ull* __restrict__ block_equal,
                     uint32_t* __restrict__ out_idx,
                     float* __restrict__ out_val, float* u, int zero,
                     Gate gate, uint64_t layout_chunk,
                     const uint32_t* __restrict__ regions) {
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

// DGC sample: `runs` runs of 16 consecutive keys at hashed starts in
// [0, n - 16] (hash of state's seed and the run); keys to sample[], digit-0
// histogram to hist0. Nothing when the gate is closed.
__global__ void __launch_bounds__(kThreads)
    SampleKernel(const float* __restrict__ u, uint64_t n, uint64_t runs,
                 uint32_t* __restrict__ sample,
                 ull* hist0, DeviceState* st, Gate gate, Then then) {
  if (Closed(gate)) return;  // uniform
  const ull seed = st->seed;  // this step's: a graph replays the kernel
  __shared__ uint32_t hist[kBins];
  for (int i = threadIdx.x; i < kBins; i += kThreads) hist[i] = 0;
  __syncthreads();
  const uint64_t total = runs * 16;
  for (uint64_t g = uint64_t{blockIdx.x} * kThreads + threadIdx.x; g < total;
       g += uint64_t{gridDim.x} * kThreads) {
    const uint64_t run = g / 16;
    const uint64_t start = __umul64hi(Mix(seed, run), n - 15);
    const uint32_t key = Key(u[start + (g % 16)]);
    sample[g] = key;
    atomicAdd(&hist[key >> 20], 1u);
  }
  __syncthreads();
  for (int i = threadIdx.x; i < kBins; i += kThreads) {
    if (hist[i] != 0) atomicAdd(&hist0[i], static_cast<ull>(hist[i]));
  }
  RunThen(st, hist0, then);
}

// The most keys GaussPlanKernel may have listed for its first compaction to
// read the update's candidates (GaussUpdateCollectKernel counts them per
// key; more is rare: the stop's bin must leave [lo, hi] undecided at
// several reachable thresholds).
constexpr int kMaxUpdateGaussKeys = 8;

// GaussPlanKernel's use of the fused update's candidates at its stop key
// (thread 0; at_least as the planner's).
__device__ void GaussUpdatePlan(DeviceState* st, const ull* at_least,
                                uint32_t key, const UpdateCandidates& uc,
                                ull compact_cap) {
  const uint32_t bin = key >> 20;
  if (st->update_used_n == uc.n && st->update_used_key != 0 &&
      st->update_clobbered == 0) {
    // The pass kept every key >= `from` (a bin's first key when Gaussian-k
    // predicted it; the exact plan's fine key may lie inside a bin), at
    // most at_least[from's bin] keys: the compaction at the stop key, and
    // the counts of each listed key's bin from it up, need them all.
    const uint32_t from = static_cast<uint32_t>(st->update_used_key - 1);
    bool use = key >= from && at_least[from >> 20] <= compact_cap &&
               st->gk_num_keys <= kMaxUpdateGaussKeys;
    for (int r = 0; use && r < st->gk_num_keys; ++r) {
      use = st->gk_keys[r] >= from;
    }
    st->gauss_from_update = use ? 1 : 0;
    st->gauss_used_update = use ? 1 : 0;
  }
  PredictUpdateBin(st, true, bin, at_least[bin],
                   bin > 0 ? at_least[bin - 1] : at_least[bin], uc);
}

// Gaussian-k planner (one block): mean/std from the histogram pass's sums,
// then the CPU selector's adjustment loop as long as the digit-0 histogram
// decides it (the count for a threshold lies between the counts at the
// bounds of its bin). Stops at the first threshold the histogram cannot
// rule out and sets min_key to it; fallback = 1 when the loop ends without.
// At a stop the histogram cannot call in range, it lists the keys the
// correction may need (ListGaussKeys). Writes the histogram's at_least
// counts to at_least_out (kBins entries) for GaussResolve. Starts with
// InitBlock when init.run.
//
// With uc.warps != 0 (the multi-kernel path: after Accumulate, or after
// Gaussian-k's own histogram pass): sets state's gauss_from_update when
// that pass kept candidates for this n (update_used_*) from a key at or
// below the stop key and every listed key, at most compact_cap of
// them and at most kMaxUpdateGaussKeys keys listed (the first compaction
// then reads the candidates: GaussUpdateCollectKernel); and predicts the
// next update's bin from the stop key as the exact plan does from its
// k-th key (UpdateCandidates): one bin under the key's when the keys from
// there are at most uc.predict_cap, else the key's own, else none (also
// none after a fallback).
__global__ void __launch_bounds__(kScanThreads)
    GaussPlanKernel(DeviceState* st, const ull* hist0, const double* partials,
                    uint64_t n, double z, ull lo, ull hi, int max_adjustments,
                    ull* at_least_out, int max_keys, InitArgs init,
                    UpdateCandidates uc, ull compact_cap) {
  static_assert(kMaxBlocks <= kScanThreads, "one partial sum per thread");
  InitBlock(st, init);
  using Scan = cub::BlockScan<ull, kScanThreads, cub::BLOCK_SCAN_WARP_SCANS>;
  __shared__ typename Scan::TempStorage storage;
  __shared__ ull at_least[kBins + 1];  // keys with digit 0 >= b
  __shared__ double list_value[kGaussSide * kGaussSide];
  __shared__ bool list_reached[kGaussSide * kGaussSide];
  __shared__ int non_finite;
  if (threadIdx.x == 0) non_finite = 0;
  __syncthreads();
  ull v[2], before[2];
  for (int j = 0; j < 2; ++j) {
    const int p = 2 * static_cast<int>(threadIdx.x) + j;
    const int bin = kBins - 1 - p;
    v[j] = hist0[bin];
    if (bin >= static_cast<int>(kNonFiniteKey >> 20) && v[j] != 0) {
      non_finite = 1;
    }
  }
  Scan(storage).ExclusiveSum(v, before);
  for (int j = 0; j < 2; ++j) {
    const int p = 2 * static_cast<int>(threadIdx.x) + j;
    at_least[kBins - 1 - p] = before[j] + v[j];
    at_least_out[kBins - 1 - p] = before[j] + v[j];
  }
  if (threadIdx.x == 0) at_least[kBins] = 0;
  // The histogram pass's per-block Moments, merged in a fixed order (valid
  // in thread 0): the same input gives the same threshold on every run.
  const int b = static_cast<int>(threadIdx.x);
  const Moments all = BlockMoments<kScanThreads>(
      b < st->sum_blocks ? Moments{partials[3 * b], partials[3 * b + 1],
                                   partials[3 * b + 2]}
                         : Moments{0.0, 0.0, 0.0});
  if (threadIdx.x != 0) return;
  if (non_finite) {
    st->error |= kErrorNonFinite;
    return;
  }
  const double mean = all.mean;
  const double var = n > 1 ? all.m2 / static_cast<double>(n - 1) : 0.0;
  double t = mean + z * sqrt(var);
  st->gk_max_adjustments = max_adjustments;
  for (int adjustment = 0;; ++adjustment) {
    const uint32_t key = MinKeyAbove(t);
    const int verdict = HistVerdict(at_least, key, lo, hi);
    const bool too_few = verdict == kTooFew;
    const bool too_many = verdict == kTooMany;
    if (!too_few && !too_many) {
      st->min_key = key;
      st->threshold = t;
      st->adjustments = adjustment;
      if (verdict == kUndecided) {
        ListGaussKeys(st, at_least, t, key, max_adjustments - adjustment, lo,
                      hi, max_keys, list_value, list_reached);
      }
      if (uc.warps != 0) GaussUpdatePlan(st, at_least, key, uc, compact_cap);
      return;
    }
    // The rule ends here (the CPU's count: this adjustment).
    st->adjustments = adjustment;
    if (adjustment == max_adjustments) break;
    t = too_few ? t * 0.5 : t * 1.5;
    if (t <= 0.0) break;
  }
  st->fallback = 1;
  st->gk_exact = 1;
  st->gk_exact_adjustments = st->adjustments;
  if (uc.warps != 0) {  // the exact top-k follows, from u: predict nothing
    PredictUpdateBin(st, false, 0, 0, 0, uc);
  }
}

// state->count_at_least += #{i < M : key(values[i]) >= min_key}.
__global__ void __launch_bounds__(kThreads)
    CountAtLeastKernel(const float* __restrict__ values, DeviceState* st,
                       uint32_t min_key) {
  const ull m = st->num_candidates;
  uint32_t c = 0;
  for (uint64_t i = uint64_t{blockIdx.x} * kThreads + threadIdx.x; i < m;
       i += uint64_t{gridDim.x} * kThreads) {
    c += Key(values[i]) >= min_key;
  }
  using Reduce = cub::BlockReduce<uint32_t, kThreads>;
  __shared__ typename Reduce::TempStorage storage;
  const uint32_t total = Reduce(storage).Sum(c);
  if (threadIdx.x == 0 && total != 0) {
    atomicAdd(&st->count_at_least, static_cast<ull>(total));
  }
}

// state->first_non_finite = the lowest i with a NaN/Inf u[i].
__global__ void FirstNonFiniteKernel(const float* __restrict__ u, uint64_t n,
                                     DeviceState* st) {
  for (uint64_t i = uint64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n;
       i += uint64_t{gridDim.x} * blockDim.x) {
    if (Key(u[i]) >= kNonFiniteKey) atomicMin(&st->first_non_finite, ull{i});
  }
}

// dst[idx[j]] = val[j] (subtract == 0) or dst[idx[j]] - val[j].
__global__ void ScatterKernel(float* dst, uint64_t n,
                              const uint32_t* __restrict__ idx,
                              const float* __restrict__ val, uint64_t count,
                              int subtract) {
  for (uint64_t j = uint64_t{blockIdx.x} * blockDim.x + threadIdx.x; j < count;
       j += uint64_t{gridDim.x} * blockDim.x) {
    const uint32_t i = idx[j];
    if (i >= n) continue;
    if (subtract) {
      const float d = dst[i];
      dst[i] = d - val[j];
    } else {
      dst[i] = val[j];
    }
  }
}

// v = m * velocity + update; velocity = v; params -= v (dense).
__global__ void GlobalMomentumKernel(float* params, float* velocity,
                                     const float* __restrict__ update,
                                     uint64_t n, float m) {
  for (uint64_t i = uint64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n;
       i += uint64_t{gridDim.x} * blockDim.x) {
    const float mv = m * velocity[i];
    const float v = mv + update[i];
    velocity[i] = v;
    const float p = params[i];
    params[i] = p - v;
  }
}

// ---------------------------------------------------------------------------
// The one-block path for a small u (n <= kTinyMaxN): the whole selection,
// any method, in one kernel of kScanThreads threads with u's keys in shared
// memory, so that a selection is one launch and one copy instead of a chain
// of eight to eleven (issue 15's small-n target is launch-bound).

constexpr uint64_t kTinyMaxN = 4096;
constexpr int kTinyPerThread =
    static_cast<int>((kTinyMaxN + kScanThreads - 1) / kScanThreads);
constexpr uint64_t kTinyMaxSample = kTinyMaxN / 2;  // dgc: runs * 32 < n

// What TinySelectKernel does (Method's number) and with what.
struct TinyArgs {
  int method;  // static_cast<int>(Method)
  ull k;
  int zero;
  // gaussiank: z, the count range [lo, hi] and the adjustment limit.
  double z;
  ull lo, hi;
  int max_adjustments;
  // dgc: `runs` runs of 16 at hashed starts (seed: *seed, pinned host
  // memory, this step's), the sample_k-th largest sample key as threshold;
  // runs = 0: the exact top-k (the sample would be as large as u).
  const ull* seed;
  ull runs, sample_k;
};

// The rank-th largest of keys[0, m) (1 <= rank <= m) by the three-digit
// radix select, in every thread: *t = that key, *greater = how many keys
// exceed it, *ties = how many keys == t to take (lower index first).
__device__ void TinyKth(const uint32_t* keys, int m, ull rank, uint32_t* t,
                        ull* greater, ull* ties) {
  using Scan = cub::BlockScan<uint32_t, kScanThreads, cub::BLOCK_SCAN_WARP_SCANS>;
  __shared__ typename Scan::TempStorage storage;
  __shared__ uint32_t hist[kBins];
  __shared__ uint32_t found_digit;
  __shared__ uint32_t found_before;
  uint32_t prefix = 0;
  ull need = rank, above = 0;
  for (int level = 0; level < 3; ++level) {
    const int bins = 1 << LevelBits(level);
    for (int i = threadIdx.x; i < kBins; i += kScanThreads) hist[i] = 0;
    __syncthreads();
    for (int i = threadIdx.x; i < m; i += kScanThreads) {
      const uint32_t key = keys[i];
      if (MatchesPrefix(key, prefix, level)) {
        atomicAdd(&hist[Digit(key, level)], 1u);
      }
    }
    __syncthreads();
    // Two bins per thread, from the largest digit down.
    uint32_t v[2], before[2];
    for (int j = 0; j < 2; ++j) {
      const int p = 2 * static_cast<int>(threadIdx.x) + j;
      v[j] = p < bins ? hist[bins - 1 - p] : 0u;
    }
    Scan(storage).ExclusiveSum(v, before);
    for (int j = 0; j < 2; ++j) {
      const int p = 2 * static_cast<int>(threadIdx.x) + j;
      if (p < bins && v[j] != 0 && before[j] < need && need <= before[j] + v[j]) {
        found_digit = static_cast<uint32_t>(bins - 1 - p);
        found_before = before[j];
      }
    }
    __syncthreads();
    prefix |= found_digit << LevelShift(level);
    above += found_before;
    need -= found_before;
    __syncthreads();  // found_* are rewritten by the next digit
  }
  *t = prefix;
  *greater = above;
  *ties = need;
}

// How many of keys[0, m) are >= key, in every thread.
__device__ ull TinyCountAtLeast(const uint32_t* keys, int m, uint32_t key) {
  using Reduce = cub::BlockReduce<uint32_t, kScanThreads>;
  __shared__ typename Reduce::TempStorage storage;
  __shared__ uint32_t total;
  uint32_t c = 0;
  for (int i = threadIdx.x; i < m; i += kScanThreads) c += keys[i] >= key;
  const uint32_t sum = Reduce(storage).Sum(c);
  if (threadIdx.x == 0) total = sum;
  __syncthreads();
  const ull result = total;
  __syncthreads();  // total is rewritten by the next call
  return result;
}

// Writes the entries with key > t, and the first `ties` with key == t,
// in index order to out_idx/out_val (values from u; zero: u[i] = +0.0);
// returns the count, in every thread. Each thread owns a contiguous
// segment of kTinyPerThread entries.
__device__ ull TinyWrite(float* u, const uint32_t* keys, int n, uint32_t t,
                         ull ties, uint32_t* out_idx, float* out_val,
                         int zero) {
  using Scan = cub::BlockScan<uint32_t, kScanThreads, cub::BLOCK_SCAN_WARP_SCANS>;
  __shared__ typename Scan::TempStorage storage;
  const int begin = static_cast<int>(threadIdx.x) * kTinyPerThread;
  const int end = begin + kTinyPerThread < n ? begin + kTinyPerThread : n;
  // Greater in the low 16 bits, equal in the high (n <= 4096 < 2^16).
  uint32_t mine = 0;
  for (int i = begin; i < end; ++i) {
    mine += keys[i] > t ? 1u : (keys[i] == t ? 1u << 16 : 0u);
  }
  uint32_t before, total;
  Scan(storage).ExclusiveSum(mine, before, total);
  ull greater = before & 0xffffu;
  ull tie = before >> 16;
  ull pos = greater + (tie < ties ? tie : ties);
  for (int i = begin; i < end; ++i) {
    const bool take = keys[i] > t || (keys[i] == t && tie++ < ties);
    if (take) {
      out_idx[pos] = static_cast<uint32_t>(i);
      out_val[pos] = u[i];
      if (zero) u[i] = 0.0f;
      ++pos;
    }
  }
  const ull all_ties = total >> 16;
  return (total & 0xffffu) + (all_ties < ties ? all_ties : ties);
}

// The whole selection of u (n <= kTinyMaxN) by one block of kScanThreads
// threads, the same rules as the multi-kernel path: exact's top-k;
// gaussiank's threshold mean + z*std and the CPU rule's adjustments on
// exact counts, the exact top-k when they end out of range (gk_exact,
// adjustments); dgc's sampled threshold B (the same runs as SampleKernel),
// every key >= B when at most k, else the exact top-k (trim when at most
// n/8 survive, gk_exact beyond: the multi-kernel path's names). Leaves
// state's num_selected, num_candidates (gaussiank: the count at its
// threshold; dgc: the survivors), and error (a non-finite u: nothing
// written or zeroed). Starts with InitBlock.
__global__ void __launch_bounds__(kScanThreads)
    TinySelectKernel(float* u, uint64_t n, DeviceState* st, InitArgs init,
                     TinyArgs a, uint32_t* out_idx, float* out_val) {
  InitBlock(st, init);
  __shared__ uint32_t keys[kTinyMaxN];
  __shared__ uint32_t sample[kTinyMaxSample];
  __shared__ int non_finite;
  if (threadIdx.x == 0) non_finite = 0;
  __syncthreads();
  const int m = static_cast<int>(n);
  for (int i = threadIdx.x; i < m; i += kScanThreads) {
    keys[i] = Key(u[i]);
    if (keys[i] >= kNonFiniteKey) non_finite = 1;
  }
  __syncthreads();
  if (non_finite) {  // uniform
    if (threadIdx.x == 0) st->error |= kErrorNonFinite;
    return;
  }
  // The selection: keys > t and the first `ties` keys == t.
  uint32_t t = 0;
  ull greater = 0, ties = 0, candidates = 0;
  bool exact = true;
  if (a.method == static_cast<int>(Method::kGaussianK)) {
    __shared__ double threshold;
    __shared__ int verdict;  // 0: go on, 1: in range, 2: out of range
    ShiftedSums sums;
    for (int i = threadIdx.x; i < m; i += kScanThreads) sums.Add(u[i]);
    const Moments all = BlockMoments<kScanThreads>(sums.Get());
    if (threadIdx.x == 0) {
      const double var = n > 1 ? all.m2 / static_cast<double>(n - 1) : 0.0;
      threshold = all.mean + a.z * sqrt(var);
      verdict = 0;
    }
    __syncthreads();
    for (int adjustment = 0;; ++adjustment) {
      const double th = threshold;
      const uint32_t key = MinKeyAbove(th);
      const ull count = TinyCountAtLeast(keys, m, key);
      if (threadIdx.x == 0) {
        st->adjustments = adjustment;
        if (count >= a.lo && count <= a.hi) {
          verdict = 1;
          st->min_key = key;
          st->threshold = th;
          st->num_candidates = count;
        } else {
          const double next = count < a.lo ? th * 0.5 : th * 1.5;
          if (adjustment == a.max_adjustments || next <= 0.0) {
            verdict = 2;
            st->fallback = 1;
            st->gk_exact = 1;
            st->gk_exact_adjustments = adjustment;
          } else {
            threshold = next;
          }
        }
      }
      __syncthreads();
      const int v = verdict;
      __syncthreads();  // verdict and threshold are read before rewritten
      if (v == 1) {
        t = st->min_key;
        ties = ~0ull;
        exact = false;
      }
      if (v != 0) break;
    }
  } else if (a.method == static_cast<int>(Method::kDgc) && a.runs != 0) {
    // One read of the pinned host value (over the bus), shared.
    __shared__ ull step_seed;
    if (threadIdx.x == 0) step_seed = *a.seed;
    __syncthreads();
    const ull seed = step_seed;
    const uint64_t total = a.runs * 16;
    for (uint64_t g = threadIdx.x; g < total; g += kScanThreads) {
      const uint64_t start = __umul64hi(Mix(seed, g / 16), n - 15);
      sample[g] = keys[start + (g % 16)];
    }
    __syncthreads();
    uint32_t b;
    ull above, unused;
    TinyKth(sample, static_cast<int>(total), a.sample_k, &b, &above, &unused);
    candidates = TinyCountAtLeast(keys, m, b);
    if (candidates <= a.k) {
      t = b;
      ties = ~0ull;
      exact = false;
    }
    if (threadIdx.x == 0) {
      st->min_key = b;
      st->num_candidates = candidates;
      if (exact && candidates <= n / 8) {
        st->trim = 1;
      } else if (exact) {
        st->gk_exact = 1;
        st->gk_exact_candidates = candidates;
      }
    }
  }
  if (exact) TinyKth(keys, m, a.k, &t, &greater, &ties);
  const ull count = TinyWrite(u, keys, m, t, ties, out_idx, out_val, a.zero);
  if (threadIdx.x == 0) {
    st->prefix = t;
    st->num_selected = count;
  }
}

// ---------------------------------------------------------------------------
// Host helpers
// ---------------------------------------------------------------------------

bool Aligned16(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0;
}

std::string FloatText(float x) {
  if (std::isnan(x)) return "nan";
  if (std::isinf(x)) return x > 0 ? "inf" : "-inf";
  return std::to_string(x);
}

#define GTOPK_CUDA_LAUNCH_CHECK() GTOPK_CUDA_RETURN_IF_ERROR(cudaGetLastError())

// Public entry points launch kernels and check them with cudaGetLastError,
// which also returns a (non-sticky) error an unrelated earlier runtime call
// left behind: discard that first, it is not this call's.
void DiscardStaleError() { cudaGetLastError(); }

}  // namespace

const char* MethodName(Method method) {
  switch (method) {
    case Method::kExact:
      return "exact";
    case Method::kGaussianK:
      return "gaussiank";
    case Method::kDgc:
      return "dgc";
  }
  return "unknown";
}

uint64_t MinCount(Method method, uint64_t k) {
  const uint64_t lo = (2 * k + 2) / 3, hi = 4 * k / 3;
  switch (method) {
    case Method::kExact:
      return k;
    case Method::kGaussianK:
      return lo <= hi ? lo : k;
    case Method::kDgc:
      return 1;
  }
  return k;
}

uint64_t MaxCount(Method method, uint64_t k) {
  const uint64_t lo = (2 * k + 2) / 3, hi = 4 * k / 3;
  return method == Method::kGaussianK && lo <= hi ? hi : k;
}

KernelStatus SparseUpdater::Upload(const uint32_t* idx, const float* val,
                                   uint64_t count, cudaStream_t stream) {
  if (idx_.size() < count) {
    // Buffers in flight on `stream` must not be freed under it.
    GTOPK_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
    GTOPK_CUDA_RETURN_IF_NOT_OK(
        idx_.Allocate(std::max<uint64_t>(count, 2 * idx_.size())));
    GTOPK_CUDA_RETURN_IF_NOT_OK(val_.Allocate(idx_.size()));
  }
  GTOPK_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(idx_.get(), idx,
                                             count * sizeof(uint32_t),
                                             cudaMemcpyHostToDevice, stream));
  GTOPK_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(
      val_.get(), val, count * sizeof(float), cudaMemcpyHostToDevice, stream));
  return KernelStatus::Ok();
}

KernelStatus SparseUpdater::Scatter(float* dst, uint64_t n, const uint32_t* idx,
                                    const float* val, uint64_t count,
                                    int subtract, cudaStream_t stream) {
  DiscardStaleError();
  if (count == 0) return KernelStatus::Ok();
  GTOPK_CUDA_RETURN_IF_NOT_OK(Upload(idx, val, count, stream));
  const int blocks =
      static_cast<int>(std::min<uint64_t>((count + 255) / 256, 4096));
  GTOPK_LAUNCH(ScatterKernel, blocks, 256, stream)(dst, n, idx_.get(), val_.get(),
                                            count, subtract);
  GTOPK_CUDA_LAUNCH_CHECK();
  return KernelStatus::Ok();
}

KernelStatus SparseUpdater::Set(float* dst, uint64_t n, const uint32_t* idx,
                                const float* val, uint64_t count,
                                cudaStream_t stream) {
  return Scatter(dst, n, idx, val, count, /*subtract=*/0, stream);
}

KernelStatus SparseUpdater::Subtract(float* dst, uint64_t n,
                                     const uint32_t* idx, const float* val,
                                     uint64_t count, cudaStream_t stream) {
  return Scatter(dst, n, idx, val, count, /*subtract=*/1, stream);
}

KernelStatus SparseUpdater::GlobalMomentum(float* params, float* velocity,
                                           uint64_t n, float momentum,
                                           const uint32_t* idx,
                                           const float* val, uint64_t count,
                                           cudaStream_t stream) {
  DiscardStaleError();
  if (n == 0) return KernelStatus::Ok();
  if (dense_.size() < n) {
    GTOPK_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
    GTOPK_CUDA_RETURN_IF_NOT_OK(dense_.Allocate(n));
  }
  GTOPK_CUDA_RETURN_IF_ERROR(
      cudaMemsetAsync(dense_.get(), 0, n * sizeof(float), stream));  // +0.0
  if (count > 0) {
    GTOPK_CUDA_RETURN_IF_NOT_OK(Upload(idx, val, count, stream));
    const int blocks =
        static_cast<int>(std::min<uint64_t>((count + 255) / 256, 4096));
    GTOPK_LAUNCH(ScatterKernel, blocks, 256, stream)(dense_.get(), n, idx_.get(),
                                              val_.get(), count, 0);
    GTOPK_CUDA_LAUNCH_CHECK();
  }
  const int blocks =
      static_cast<int>(std::min<uint64_t>((n + 1023) / 1024, 8192));
  GTOPK_LAUNCH(GlobalMomentumKernel, blocks, 256, stream)(params, velocity,
                                                   dense_.get(), n, momentum);
  GTOPK_CUDA_LAUNCH_CHECK();
  return KernelStatus::Ok();
}

int DeviceCount() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // clear the error
    return 0;
  }
  return count;
}

struct Sparsifier::Impl {
  uint64_t capacity = 0;
  int max_blocks = 0;  // passes over u: <= kMaxBlocks
  // The fused update's grid: one wave of HistogramKernel<true>, which holds
  // more registers than the other passes (fewer blocks fit per SM).
  int update_blocks = 0;

  DeviceBuffer<unsigned char> meta;  // hist0/1/2, partials, trim histograms
  DeviceState* st = nullptr;  // the head of `out`
  ull* hist0 = nullptr;
  ull* hist1 = nullptr;
  ull* hist2 = nullptr;
  double* partials = nullptr;  // 3 * kMaxBlocks: the histogram pass's Moments
  // dgc's trim: the survivors' three digit histograms (kHistsSize entries),
  // apart from hist0..2, which hold the sample's.
  ull* trim_hists = nullptr;
  DeviceBuffer<uint32_t> regions;
  // The fused update's per-chunk counts of its candidates and their group
  // offsets (UpdateCandidates; kUpdateChunks chunks per warp of its grid).
  DeviceBuffer<uint32_t> counts_u;
  DeviceBuffer<ull> offsets_u;
  // The same for the ties at a predicted key (DeviceState::
  // update_pred_ties): their per-chunk counts and group offsets.
  DeviceBuffer<uint32_t> eq_counts_u;
  DeviceBuffer<ull> eq_offsets_u;
  DeviceBuffer<uint32_t> counts_a, counts_b;
  DeviceBuffer<ull> offsets_a, offsets_b;
  DeviceBuffer<uint32_t> cand_idx;
  DeviceBuffer<float> cand_val;
  // The state, then the selection's indices and values, contiguous, so
  // that one copy brings all three to the host (`host_out`, same layout):
  // [DeviceState, padded to kOutHeader][out_stride indices][values].
  DeviceBuffer<unsigned char> out;
  PinnedBuffer<unsigned char> host_out;
  uint64_t out_stride = 0;  // the selection's output slots (BeginOutput)
  // dgc's per-step sample seed: InitKernel reads it from here when it runs
  // (a replayed graph reads this step's, which Select writes).
  PinnedBuffer<ull> host_seed;

  uint32_t* out_idx() const {
    return reinterpret_cast<uint32_t*>(out.get() + kOutHeader);
  }
  float* out_val() const {
    return reinterpret_cast<float*>(out.get() + kOutHeader +
                                    out_stride * sizeof(uint32_t));
  }
  DeviceState* host_state() const {
    return reinterpret_cast<DeviceState*>(host_out.get());
  }

  // Accumulate's histogram, valid for (hist_u, hist_n) until a Select.
  const float* hist_u = nullptr;
  uint64_t hist_n = 0;

  // What GatherKernel reads when the exact plan, or Gaussian-k's first
  // compaction, takes the fused update's candidates (set by ExactFromU or
  // SelectGaussianK after Accumulate; kept for Wait's continuation, and
  // with a cached graph).
  UpdateLayout update_layout{};

  // Layout of the last compaction over u.
  int collect_blocks = 0;
  int collect_warps = 0;
  uint64_t collect_chunk = 0;

  // Captured selections (set_use_graphs): the graph and the host-side
  // state the capture left, restored on replay.
  struct GraphKey {
    Method method;
    const float* u;
    uint64_t n, k;
    bool zero, reuse;
    int max_adjustments;
    double dgc_sample_fraction;
    bool expect_exact;
    bool expect_from_u;  // exact's, or gaussiank's fallback's, sample missed
    uint64_t exact_sample_min_n;  // SetExactSampleMinNForTesting's
    uint64_t one_block_max_n;     // SetOneBlockMaxNForTesting's
    bool update_sampled;  // exact after Accumulate from a sample
    // gaussiank: its gated exact fallback plans with the first pass's
    // candidates (GaussFallbackFromUpdate), not from a sample.
    bool gauss_fallback_from_update;
    // gaussiank from u: its own histogram pass counts a predicted key's
    // ties (Histogram).
    bool gauss_ties_pass;
    bool operator==(const GraphKey& o) const {
      return update_sampled == o.update_sampled &&
             gauss_fallback_from_update == o.gauss_fallback_from_update &&
             gauss_ties_pass == o.gauss_ties_pass &&
             method == o.method &&
             u == o.u && n == o.n && k == o.k &&
             zero == o.zero && reuse == o.reuse &&
             max_adjustments == o.max_adjustments &&
             dgc_sample_fraction == o.dgc_sample_fraction &&
             expect_exact == o.expect_exact &&
             expect_from_u == o.expect_from_u &&
             exact_sample_min_n == o.exact_sample_min_n &&
             one_block_max_n == o.one_block_max_n;
    }
  };
  struct HostSnapshot {
    SelectInfo info;
    bool check_selected = false;
    int continuation = 0;
    bool exact_enqueued = false;
    bool sampled_enqueued = false;
    bool from_u_enqueued = false;
    bool tiny_enqueued = false;
    uint64_t pending_count = 0;
    uint64_t out_stride = 0;
    int collect_blocks = 0, collect_warps = 0;
    uint64_t collect_chunk = 0;
    UpdateLayout update_layout{};
  };
  struct CachedGraph {
    GraphKey key;
    cudaGraphExec_t exec = nullptr;
    HostSnapshot snapshot;
    uint64_t last_used = 0;
  };
  static constexpr size_t kMaxGraphs = 8;
  bool use_graphs = true;
  int gauss_key_limit = kMaxGaussKeys;  // set_gaussiank_key_limit_for_testing
  // gaussiank: the last selection fell back to the exact top-k, so the next
  // enqueues it too, gated on the device's verdict (SelectGaussianK).
  bool expect_exact = false;
  // dgc: the last selection took the exact top-k from u (more than n/8
  // survived its sampled threshold), so the next enqueues it too, gated.
  bool dgc_expect_exact = false;
  // exact (gaussiank's fallback): the last exact top-k that started from a
  // sample took the plan over u (the bound kept fewer than k or more than
  // n/8 keys), so the next enqueues that too, gated.
  bool exact_expect_from_u = false;
  bool gauss_expect_from_u = false;
  // gaussiank: the last selection of this n (0: none) fell back to the
  // exact plan with the first pass's candidates (the fused update's, or
  // Gaussian-k's own histogram pass's), which predicted the next pass's
  // (state's update_pred_*), or fell back to an exact top-k from a
  // sample; so the next gated fallback of this n runs that plan (no pass
  // over u besides the first while the prediction holds) instead of
  // starting from a sample (GaussFallbackFromUpdate). Set by Wait.
  uint64_t gauss_exact_predicted_n = 0;
  // set_gaussiank_fallback_from_candidates_for_testing's value.
  bool gauss_fallback_from_candidates = true;
  // The pending gaussiank selection's host continuation took the exact
  // top-k from its compaction's candidates (CandidateExact: it predicts
  // nothing).
  bool gauss_candidate_exact = false;
  // Whether gaussiank's gated exact fallback plans with the first pass's
  // candidates: when the last fallback of this n predicted them.
  // Otherwise, on a large u, it starts from a sample.
  bool GaussFallbackFromUpdate(uint64_t n) const {
    return gauss_fallback_from_candidates && gauss_exact_predicted_n == n;
  }
  bool took_exact = false;  // the pending selection's, for the prediction
  // exact after Accumulate: the last such plan over u of this n (0: none)
  // needed more than one pass over u (its digit-0 bin held more than n/8
  // keys, so the update's histogram saved nothing and nothing could be
  // predicted: a narrow band, ties, every value equal). Such a selection
  // starts from a sample instead (one pass over u on any data), and every
  // kRetryPlanAfterUpdate-th one runs the plan again, which finds out
  // whether the data changed (and predicts the update's candidates again).
  uint64_t update_many_pass_n = 0;
  uint64_t update_sampled_count = 0;
  static constexpr uint64_t kRetryPlanAfterUpdate = 8;
  bool pending_update_sampled = false;  // the pending selection is one
  // Its Inits drop the update's prediction (InitArgs::clear_prediction):
  // set by Select for such a selection, cleared by Accumulate.
  bool clear_update_prediction = false;
  // The n whose next fused update, or Gaussian-k's next own histogram
  // pass, is to count the ties at its predicted key (DeviceState::
  // update_pred_ties, as the last Wait read it; 0: none): Accumulate
  // launches HistogramKernel<true, true> for it, Histogram
  // HistogramKernel<false, true>.
  uint64_t ties_predicted_n = 0;
  bool tiny_enqueued = false;  // the pending selection is TinySelectKernel's
  std::vector<CachedGraph> graphs;
  uint64_t graph_clock = 0;

  // The host-side state a selection's enqueue leaves (info, what Wait
  // checks and continues, the compaction layout), saved with its graph and
  // restored when the graph is replayed instead.
  HostSnapshot Snapshot() const {
    HostSnapshot s;
    s.info = info;
    s.check_selected = check_selected;
    s.continuation = static_cast<int>(continuation);
    s.exact_enqueued = exact_enqueued;
    s.sampled_enqueued = sampled_enqueued;
    s.from_u_enqueued = from_u_enqueued;
    s.tiny_enqueued = tiny_enqueued;
    s.pending_count = pending_count;
    s.out_stride = out_stride;
    s.collect_blocks = collect_blocks;
    s.collect_warps = collect_warps;
    s.collect_chunk = collect_chunk;
    s.update_layout = update_layout;
    return s;
  }
  void Restore(const HostSnapshot& s) {
    check_selected = s.check_selected;
    continuation = static_cast<Continuation>(s.continuation);
    exact_enqueued = s.exact_enqueued;
    sampled_enqueued = s.sampled_enqueued;
    from_u_enqueued = s.from_u_enqueued;
    tiny_enqueued = s.tiny_enqueued;
    pending_count = s.pending_count;
    out_stride = s.out_stride;
    collect_blocks = s.collect_blocks;
    collect_warps = s.collect_warps;
    collect_chunk = s.collect_chunk;
    update_layout = s.update_layout;
  }

  void ClearGraphs() {
    for (CachedGraph& g : graphs) cudaGraphExecDestroy(g.exec);
    graphs.clear();
  }
  ~Impl() { ClearGraphs(); }

  // The pending selection.
  bool pending = false;
  float* pending_u = nullptr;
  uint64_t pending_n = 0;
  uint64_t pending_count = 0;
  bool check_selected = false;  // state.num_selected must equal the count
  bool pending_error = false;   // the host state already shows an error
  bool exact_enqueued = false;  // gaussiank: its gated exact fallback too
  // The exact top-k from a sample was enqueued (exact's, or gaussiank's
  // gated fallback), and after it the plan over u gated on exact_from_u.
  bool sampled_enqueued = false;
  bool from_u_enqueued = false;
  bool sample_missed = false;  // the pending selection's, for the prediction
  SelectInfo info;
  // gaussiank/dgc enqueue the usual case only (no host round trip); when
  // the device did not accept the compaction's count, Wait continues here.
  enum class Continuation { kNone, kGaussianK, kDgc, kExact };
  Continuation continuation = Continuation::kNone;
  SelectParams pending_params;

  void CollectLayout(uint64_t n) {
    uint64_t blocks =
        (n + uint64_t{kThreads} * 16 - 1) / (uint64_t{kThreads} * 16);
    blocks = std::max<uint64_t>(1, std::min<uint64_t>(blocks, max_blocks));
    collect_blocks = static_cast<int>(blocks);
    collect_warps = collect_blocks * kWarpsPerBlock;
    uint64_t chunk = (n + collect_warps - 1) / collect_warps;
    collect_chunk = (chunk + kChunkAlign - 1) / kChunkAlign * kChunkAlign;
  }

  int CandidateBlocks(uint64_t expected) const {
    uint64_t blocks =
        (expected + uint64_t{kThreads} * 4 - 1) / (uint64_t{kThreads} * 4);
    return static_cast<int>(
        std::max<uint64_t>(1, std::min<uint64_t>(blocks, max_blocks)));
  }

  // The gate every kernel the helpers below enqueue gets (GatedScope).
  Gate gate{nullptr, 0};

  // Enqueues gated on (*flag == value) while it lives.
  struct GatedScope {
    Impl& m;
    Gate saved;
    GatedScope(Impl& impl, const int* flag, int value)
        : m(impl), saved(impl.gate) {
      m.gate = Gate{flag, value};
    }
    ~GatedScope() { m.gate = saved; }
  };

  // Inside a gated chain the gate itself (the state's gk_exact) survives.
  // dgc: also zeroes the trim histograms and takes the step's seed.
  InitArgs InitFor(ull need, bool zero_hist0, bool keep_sums,
                   bool keep_candidates, bool dgc = false) const {
    InitArgs a;
    a.run = 1;
    a.hist0 = hist0;
    a.hist1 = hist1;
    a.hist2 = hist2;
    a.trim_hists = dgc ? trim_hists : nullptr;
    a.seed = dgc ? host_seed.get() : nullptr;
    a.need = need;
    a.zero_hist0 = zero_hist0;
    a.keep_sums = keep_sums;
    a.keep_candidates = keep_candidates;
    a.keep_gate = gate.flag != nullptr;
    a.clear_prediction = clear_update_prediction ? 1 : 0;
    return a;
  }
  KernelStatus Init(ull need, bool zero_hist0, bool keep_sums,
                    bool keep_candidates, cudaStream_t stream,
                    bool dgc = false) {
    GTOPK_LAUNCH(InitKernel, 1, kScanThreads, stream)(
        st, InitFor(need, zero_hist0, keep_sums, keep_candidates, dgc), gate);
    GTOPK_CUDA_LAUNCH_CHECK();
    return KernelStatus::Ok();
  }

  // keep_candidates: also keeps the candidates of a predicted bin, as the
  // fused update does (Gaussian-k's own pass; HistArgs::keep_candidates).
  KernelStatus Histogram(const float* u, uint64_t n, cudaStream_t stream,
                         Then then = {}, bool keep_candidates = false) {
    HistArgs a{};
    a.residual_in = u;
    if (keep_candidates) {
      a.keep_candidates = 1;
      a.regions = regions.get();
      a.counts = counts_u.get();
      a.eq_counts = eq_counts_u.get();
    }
    a.n = n;
    a.vectorized = Aligned16(u);
    a.st = st;
    a.hist0 = hist0;
    a.partials = partials;
    a.gate = gate;
    a.then = then;
    // The fused update's grid and partition of u into per-block sums, so
    // Gaussian-k's threshold is the same whether or not Select reuses
    // Accumulate's histogram.
    SetHistLayout(n, &a);
    // Where the last selection predicted a key with its ties, the pass
    // counts them too, as the fused update does (a graph key: the choice
    // is captured).
    auto* pass = keep_candidates && ties_predicted_n == n
                     ? &HistogramKernel<false, true>
                     : &HistogramKernel<false, false>;
    GTOPK_LAUNCH(pass, HistLayoutFor(n).blocks, kThreads, stream)(a);
    GTOPK_CUDA_LAUNCH_CHECK();
    return KernelStatus::Ok();
  }

  // The histogram pass's partition of u (fused or not: the same per-block
  // sums): its grid, and kUpdateChunks chunks per warp of it, so that a
  // warp's chunks are contiguous (the update's candidates come out in
  // index order, one region per chunk) and the warps' shares even.
  struct HistLayout {
    int blocks;
    int warps;  // chunks
    uint64_t chunk;
  };
  HistLayout HistLayoutFor(uint64_t n) const {
    HistLayout l;
    l.blocks = std::min(HistBlocks(n), update_blocks);
    l.warps = l.blocks * kWarpsPerBlock * kUpdateChunks;
    const uint64_t chunk = (n + l.warps - 1) / l.warps;
    l.chunk = (chunk + kChunkAlign - 1) / kChunkAlign * kChunkAlign;
    return l;
  }
  void SetHistLayout(uint64_t n, HistArgs* a) const {
    const HistLayout l = HistLayoutFor(n);
    a->chunk = l.chunk;
    a->layout_warps = l.warps;
  }

  int HistBlocks(uint64_t n) const {
    uint64_t blocks =
        (n + uint64_t{kThreads} * 16 - 1) / (uint64_t{kThreads} * 16);
    return static_cast<int>(
        std::max<uint64_t>(1, std::min<uint64_t>(blocks, max_blocks)));
  }

  // How a compaction or scan takes part in Gaussian-k's correction.
  enum class GaussRole {
    kNone,   // not part of it
    kFirst,  // Collect counts the listed keys; its last block resolves
  };

  // Compaction of u at state's min_key (host_key: at `key`), its histogram
  // with_hist (CollectHist: into the trim histograms with scan.trim, else
  // hist0..2), then `scan` in its last block (CollectScanBlock; this fills
  // in block_offsets, and at_least = the planner's counts in hist1 for role
  // kFirst). Sets the layout Gather reads.
  KernelStatus Collect(const float* u, uint64_t n, CollectHist with_hist,
                       bool host_key, uint32_t key, cudaStream_t stream,
                       CollectScan scan = CollectScan(),
                       GaussRole role = GaussRole::kNone) {
    CollectLayout(n);
    const int vec = Aligned16(u);
    const bool first = role == GaussRole::kFirst;
    // A pointer: the instantiations' commas would split the macro argument.
    auto* collect =
        with_hist == kCollectNextDigit ? &CollectKernel<kCollectNextDigit, false>
        : with_hist == kCollectDigit0  ? &CollectKernel<kCollectDigit0, false>
        : first                        ? &CollectKernel<kCollectNoHist, true>
                                       : &CollectKernel<kCollectNoHist, false>;
    scan.block_offsets = offsets_a.get();
    scan.block_equal = offsets_b.get();
    scan.at_least = first ? hist1 : nullptr;
    GTOPK_LAUNCH(collect, collect_blocks, kThreads, stream)(
        u, n, collect_chunk, vec, st, key, host_key, regions.get(),
        counts_a.get(), counts_b.get(), scan.trim ? trim_hists : hist0, gate,
        scan);
    GTOPK_CUDA_LAUNCH_CHECK();
    return KernelStatus::Ok();
  }

  // next_hist: the histogram of the exact plan's next undecided digit.
  // route kGatherDgc: to the output when accepted, else to the candidates
  // when trimming, with the trim histograms (to_output is ignored).
  KernelStatus Gather(float* u, bool to_output, bool zero, bool next_hist,
                      cudaStream_t stream,
                      GatherRoute route = kGatherAlways, Then then = {}) {
    const bool dgc = route == kGatherDgc;
    GTOPK_LAUNCH(GatherKernel, collect_blocks, kThreads, stream)(
        u, regions.get(), collect_chunk, counts_a.get(), offsets_a.get(),
        collect_warps, to_output || dgc ? out_idx() : cand_idx.get(),
        to_output || dgc ? out_val() : cand_val.get(), cand_idx.get(),
        cand_val.get(), zero, st, dgc ? trim_hists : hist0, next_hist ? 1 : 0,
        static_cast<int>(route), gate, then, update_layout);
    GTOPK_CUDA_LAUNCH_CHECK();
    return KernelStatus::Ok();
  }

  // Stable compaction of the candidate arrays (or of u itself, when the
  // exact plan says from_u) by FinalRule into out_*, on `blocks` blocks.
  KernelStatus Final(FinalRule rule, float* u, uint64_t n, bool zero,
                     int blocks, cudaStream_t stream) {
    GTOPK_LAUNCH(CountFinalKernel, blocks, kThreads, stream)(
        cand_val.get(), u, n, st, rule, counts_b.get(), counts_a.get(),
        offsets_a.get(), offsets_b.get(), hist0, gate);
    GTOPK_CUDA_LAUNCH_CHECK();
    GTOPK_LAUNCH(WriteFinalKernel, blocks, kThreads, stream)(
        cand_idx.get(), cand_val.get(), n, st, rule, counts_b.get(),
        counts_a.get(), offsets_a.get(), offsets_b.get(), out_idx(),
        out_val(), u, zero, gate, uint64_t{0}, nullptr);
    GTOPK_CUDA_LAUNCH_CHECK();
    return KernelStatus::Ok();
  }

  // Exact top-k of the candidate arrays (M = state's num_candidates >= k,
  // containing the top-k of u) by a three-digit radix select over them.
  // M is known on the device only: every pass runs on the grid for M = n.
  KernelStatus CandidateExact(float* u, uint64_t n, uint64_t k, bool zero,
                              cudaStream_t stream) {
    GTOPK_CUDA_RETURN_IF_NOT_OK(Init(k, /*zero_hist0=*/true, false,
                                     /*keep_candidates=*/true, stream));
    const int blocks = CandidateBlocks(n);
    for (int level = 0; level < 3; ++level) {
      GTOPK_LAUNCH(HistArrayKernel<float>, blocks, kThreads, stream)(
          cand_val.get(), &st->num_candidates, 0, st, hist0, level, gate,
          Then{kThenFindBin, level, 0});
      GTOPK_CUDA_LAUNCH_CHECK();
    }
    hist_u = nullptr;
    return Final(FinalRule{0, 0}, u, n, zero, blocks, stream);
  }

  // Exact top-k of u; reuse_hist0: hist0 already holds u's digit-0 counts.
  //
  // The plan is decided on the device, digit by digit (DecideBlock, in
  // the last block of each histogram pass), so that the work is bounded on
  // every input: when the keys >= the k-th key's bin are at most
  // compact_cap (normal data: about k plus one bin), u is compacted to them
  // at once and the remaining digits come from the candidates (two passes
  // over u in all);
  // when one bin holds more (a narrow band of magnitudes sharing their high
  // bits, ties at the k-th key), another histogram pass over u decides the
  // next digit instead, and after the last digit the final stable
  // compaction reads u itself (at most five passes over u, never a copy of
  // most of u). The host enqueues the same kernels either way; those of the
  // path not taken return at once.
  KernelStatus ExactFromU(float* u, uint64_t n, uint64_t k, bool zero,
                          bool reuse_hist0, cudaStream_t stream,
                          bool update_candidates = false) {
    const ull cap = CompactCap(n);
    const int vec = Aligned16(u);
    const int blocks = HistBlocks(n);
    // Each digit's decision runs in the last block of the pass that counted
    // it (RunThen), except after the fused update's histogram: then in a
    // one-block kernel that starts with Init's work.
    // After Accumulate, its compaction may hold the candidates already
    // (UpdateCandidates): Collect then returns at once, Gather reads the
    // update's layout and counts digit 1, and one pass over the candidates
    // counts digit 2 (HistArrayKernel returns at once otherwise).
    if (reuse_hist0) {
      const UpdateCandidates uc =
          update_candidates ? UseUpdateCandidates(n) : UpdateCandidates{};
      GTOPK_CUDA_RETURN_IF_NOT_OK(
          Decide(0, cap, stream, InitFor(k, false, true, false), uc));
    } else {
      GTOPK_CUDA_RETURN_IF_NOT_OK(Init(k, true, false, false, stream));
      GTOPK_CUDA_RETURN_IF_NOT_OK(
          Histogram(u, n, stream, Then{kThenDecide, 0, cap}));
    }
    for (int level = 1; level < 3; ++level) {
      GTOPK_LAUNCH(HistLevelKernel, blocks, kThreads, stream)(
          u, n, vec, st, hist0, level, gate,
          Then{kThenDecide, level, cap});
      GTOPK_CUDA_LAUNCH_CHECK();
    }
    CollectScan next;
    next.find_next = 1;
    GTOPK_CUDA_RETURN_IF_NOT_OK(
        Collect(u, n, kCollectNextDigit, false, 0, stream, next));
    GTOPK_CUDA_RETURN_IF_NOT_OK(Gather(u, false, false, true, stream,
                                       kGatherAlways,
                                       Then{kThenFindNext, 0, 0}));
    if (update_candidates) {
      const int blocks = CandidateBlocks(std::min<uint64_t>(4 * k, n / 8 + 1));
      GTOPK_LAUNCH(HistArrayKernel<float>, blocks, kThreads, stream)(
          cand_val.get(), &st->num_candidates, 0, st, hist0, 2, gate,
          Then{kThenFindNext, 0, 0});
      GTOPK_CUDA_LAUNCH_CHECK();
    }
    // The final source holds at most n entries (u itself, or candidates).
    GTOPK_CUDA_RETURN_IF_NOT_OK(
        Final(FinalRule{0, 0}, u, n, zero, CandidateBlocks(n), stream));
    if (update_candidates) {
      // The update kept the keys > K and counted those == K, and the k-th
      // key is K again (FindBinDecideKernel set update_tie_write): one
      // write on the update's layout, instead of the final compaction
      // (which returned at once), reads u only in the chunks up to the
      // last tie it takes, and gathers the kept keys of the others. It
      // returns at once unless FindBinDecideKernel chose it (it checks
      // update_tie_write itself, so that the chain's own gate still holds).
      const HistLayout hl = HistLayoutFor(n);
      GTOPK_LAUNCH(WriteFinalKernel, hl.warps / kWarpsPerBlock, kThreads,
                   stream)(cand_idx.get(), cand_val.get(), n, st,
                           FinalRule{0, 0}, counts_u.get(), eq_counts_u.get(),
                           offsets_u.get(), eq_offsets_u.get(), out_idx(),
                           out_val(), u, zero, gate, hl.chunk, regions.get());
      GTOPK_CUDA_LAUNCH_CHECK();
    }
    return KernelStatus::Ok();
  }

  // Keys >= the chosen bin that the exact plan compacts at once (n / 8:
  // writing, gathering and compacting M candidates costs about 24 M bytes
  // of traffic against 4 n for one more pass over u, and the other passes
  // it saves).
  static ull CompactCap(uint64_t n) { return std::max<ull>(1, n / 8); }

  // The most keys the fused update keeps as candidates for the next
  // selection (n/32: its index writes cost at most 1/32 of a read of u).
  static ull PredictCap(uint64_t n) { return std::max<ull>(1, n / 32); }

  // The candidates the first pass of an n residual keeps (the fused
  // update's, or Gaussian-k's own histogram pass's: HistLayoutFor's
  // chunks): sets update_layout, which GatherKernel reads when a
  // selection takes them, and returns what the deciding kernel needs.
  UpdateCandidates UseUpdateCandidates(uint64_t n) {
    const HistLayout hl = HistLayoutFor(n);
    update_layout =
        UpdateLayout{hl.chunk, counts_u.get(), offsets_u.get(), hl.warps};
    return UpdateCandidates{counts_u.get(),    offsets_u.get(),
                            eq_counts_u.get(), eq_offsets_u.get(),
                            hl.warps,          n,
                            PredictCap(n)};
  }

  KernelStatus Decide(int level, ull cap, cudaStream_t stream,
                      InitArgs init, UpdateCandidates uc = {}) {
    GTOPK_LAUNCH(FindBinDecideKernel, 1, kScanThreads, stream)(
        st, hist0, level, cap, gate, init, uc);
    GTOPK_CUDA_LAUNCH_CHECK();
    return KernelStatus::Ok();
  }

  // Copies the state to the host and waits for it.
  KernelStatus ReadState(cudaStream_t stream, DeviceState* state) {
    GTOPK_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(host_state(), st,
                                               sizeof(DeviceState),
                                               cudaMemcpyDeviceToHost, stream));
    GTOPK_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
    *state = *host_state();
    return KernelStatus::Ok();
  }

  static uint64_t OutBytes(uint64_t pairs) {
    return kOutHeader + pairs * (sizeof(uint32_t) + sizeof(float));
  }

  KernelStatus EnsurePinned(uint64_t count, cudaStream_t stream) {
    if (host_out.size() >= OutBytes(count)) return KernelStatus::Ok();
    GTOPK_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
    ClearGraphs();  // their copies target the buffer being replaced
    const uint64_t pairs = host_out.size() > kOutHeader
                               ? (host_out.size() - kOutHeader) / 8
                               : 0;
    const uint64_t size =
        OutBytes(std::max<uint64_t>(count, 2 * pairs));
    GTOPK_CUDA_RETURN_IF_NOT_OK(host_out.Allocate(size));
    return KernelStatus::Ok();
  }

  // The selection writes at most `slots` pairs: the layout of `out` (and
  // of the copy) for the kernels enqueued from here on.
  void BeginOutput(uint64_t slots) { out_stride = slots; }

  // Enqueues the one copy of the state and the first `count` (<= the
  // slots) output pairs.
  KernelStatus CopyOut(uint64_t count, cudaStream_t stream) {
    if (count > out_stride) {
      return KernelStatus::Error(
          KernelStatusCode::kInternal,
          "CopyOut: " + std::to_string(count) + " pairs exceed the " +
              std::to_string(out_stride) + " output slots");
    }
    const uint64_t bytes =
        kOutHeader + out_stride * sizeof(uint32_t) + count * sizeof(float);
    GTOPK_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(
        host_out.get(), out.get(), bytes, cudaMemcpyDeviceToHost, stream));
    pending_count = count;
    return KernelStatus::Ok();
  }

  // Enqueues the selection (Select's work after validation).
  KernelStatus Enqueue(float* u, uint64_t n, const SelectParams& p, bool reuse,
                       cudaStream_t stream);
  // Enqueue through the graph cache (see Sparsifier::set_use_graphs).
  KernelStatus EnqueueWithGraph(float* u, uint64_t n, const SelectParams& p,
                                bool reuse, cudaStream_t stream);
  KernelStatus SelectGaussianK(float* u, uint64_t n, const SelectParams& p,
                               bool reuse, cudaStream_t stream);
  KernelStatus SelectDgc(float* u, uint64_t n, const SelectParams& p,
                         bool reuse, cudaStream_t stream);
  KernelStatus SelectExact(float* u, uint64_t n, const SelectParams& p,
                           bool reuse, cudaStream_t stream);
  // n <= kTinyMaxN, any method: TinySelectKernel and the copy (sets
  // tiny_enqueued; Wait reads the count and the rule's outcome).
  KernelStatus SelectTiny(float* u, uint64_t n, const SelectParams& p,
                          cudaStream_t stream);
  // The exact top-k of u from the sample `plan` (under the caller's gate):
  // the sample's bound, the compaction at it, the gather (exactly k
  // survivors: the output) and the trim (more: their exact top-k); when
  // from_u_predicted, the plan over u gated on state's exact_from_u (the
  // bound kept fewer than k or more than n/8). Sets sampled_enqueued and
  // from_u_enqueued.
  KernelStatus SampledExact(float* u, uint64_t n, uint64_t k, bool zero,
                            uint64_t runs, uint64_t rank,
                            bool from_u_predicted, cudaStream_t stream);
  // dgc's and the exact top-k's sample: state's min_key = the rank-th
  // largest key of `runs` runs of 16 values of u at hashed starts (this
  // step's seed). Init (need = rank, the trim histograms zeroed), the
  // sample's keys into cand_idx with their digit 0, digits 1 and 2 over
  // them. limit != 0: more than `limit` sample keys at or above that key
  // set state's ties_at_bound (the compaction then keeps the keys above it
  // and counts its ties).
  KernelStatus SampleThreshold(const float* u, uint64_t n, uint64_t runs,
                               uint64_t rank, ull limit, cudaStream_t stream);
  // The trim's last kernels, gated on state's trim (dgc and the exact
  // top-k's sample, after their compaction and gather): digit 2 of the
  // survivors gathered into the candidates, then the final stable
  // compaction into the output. Their grid is sized for `expected`
  // survivors (at most n/8; more only loop longer): a grid for n/8 would
  // be 1024 mostly idle blocks on a large u, three times per selection.
  KernelStatus TrimRest(float* u, uint64_t n, bool zero, uint64_t expected,
                        cudaStream_t stream);
  // Ties at the sample's bound B (exact's, dgc's): the compaction kept the
  // keys > B and counted the keys == B per warp; when the device decided a
  // tie write (state's tie_write), the final write reads u on the
  // compaction's layout: the keys > B, then the first `need` ties in
  // index order. The gather after it then returns at once (from_u).
  KernelStatus TieWrite(float* u, uint64_t n, bool zero,
                        cudaStream_t stream) {
    GatedScope tie(*this, &st->tie_write, 1);
    GTOPK_LAUNCH(WriteFinalKernel, collect_blocks, kThreads, stream)(
        cand_idx.get(), cand_val.get(), n, st,
        FinalRule{0, 0}, counts_a.get(), counts_b.get(), offsets_a.get(),
        offsets_b.get(), out_idx(), out_val(), u, zero, gate, collect_chunk,
        nullptr);
    GTOPK_CUDA_LAUNCH_CHECK();
    return KernelStatus::Ok();
  }
  // The rest of a selection whose count the device did not accept, from the
  // state `s` read after the fast path (u = pending_u, p = pending_params).
  KernelStatus ContinueGaussianK(const DeviceState& s, cudaStream_t stream);
  KernelStatus ContinueDgc(const DeviceState& s, cudaStream_t stream);
  KernelStatus ContinueExact(cudaStream_t stream);
  // After SampleThreshold (dgc's, the exact top-k's): the compaction at
  // the sample's key with the decision `scan` (accept, trim, tie write, or
  // the plan over u), then every follow-up the device may pick, each gated
  // on its verdict: the tie write, the gather (accepted: to the output;
  // trimmed: to the candidates) and the trim's kernels on a grid for
  // `expected` survivors.
  KernelStatus CompactAtSample(float* u, uint64_t n, bool zero,
                               const CollectScan& scan, uint64_t expected,
                               cudaStream_t stream) {
    GTOPK_CUDA_RETURN_IF_NOT_OK(
        Collect(u, n, kCollectDigit0, false, 0, stream, scan));
    GTOPK_CUDA_RETURN_IF_NOT_OK(TieWrite(u, n, zero, stream));
    GTOPK_CUDA_RETURN_IF_NOT_OK(Gather(u, true, zero, /*next_hist=*/true,
                                       stream, kGatherDgc,
                                       Then{kThenFindNext, 0, 0}));
    return TrimRest(u, n, zero, expected, stream);
  }
};

namespace {

// dgc's sample for (n, k, fraction): `runs` runs of 16 (0: the sample would
// be as large as u, or k == n: the exact top-k, as on the CPU) and the rank
// of its threshold, ceil(k * sample / n).
struct DgcSample {
  uint64_t runs = 0;
  uint64_t sample_k = 0;
};
DgcSample PlanDgcSample(uint64_t n, uint64_t k, double fraction) {
  constexpr uint64_t kRunLength = 16;
  const uint64_t wanted =
      static_cast<uint64_t>(std::ceil(fraction * static_cast<double>(n)));
  const uint64_t runs = (wanted + kRunLength - 1) / kRunLength;
  DgcSample ds;
  if (k == n || runs * kRunLength * 2 >= n) return ds;
  ds.runs = runs;
  const uint64_t sample_size = runs * kRunLength;
  ds.sample_k = std::max<uint64_t>(
      1, static_cast<uint64_t>(std::ceil(static_cast<double>(sample_size) *
                                         static_cast<double>(k) /
                                         static_cast<double>(n))));
  return ds;
}

// SetExactSampleMinNForTesting's value.
std::atomic<uint64_t> exact_sample_min_n{uint64_t{1} << 22};
// SetOneBlockMaxNForTesting's value (at most kTinyMaxN).
std::atomic<uint64_t> one_block_max_n{kTinyMaxN};

// The exact top-k's sample for (n, k): `runs` runs of 16 and the rank of
// its bound; runs = 0: none (n below the minimum, or k too large a share
// of n for the survivors to stay well under n/8).
struct ExactSample {
  uint64_t runs = 0;
  uint64_t rank = 0;
};
ExactSample PlanExactSample(uint64_t n, uint64_t k) {
  if (n < std::max<uint64_t>(4096, exact_sample_min_n.load())) return {};
  // About 256 expected sample keys at or above the k-th key, 64Ki keys at
  // least, n/32 at most (the sample's three digit passes stay small).
  const double want =
      256.0 * static_cast<double>(n) / static_cast<double>(k);
  const uint64_t size = std::min<uint64_t>(
      n / 32, static_cast<uint64_t>(std::max(65536.0, std::ceil(want))));
  ExactSample plan;
  plan.runs = (size + 15) / 16;
  const uint64_t sample = plan.runs * 16;
  // Expected sample keys >= the k-th key, and a bound 24 sqrt + 8 above:
  // 6 standard deviations even if every run of 16 were one value (the
  // variance of a sum of 16-value clusters), so the bound keeps >= k keys
  // of u unless the sample is far off.
  const double expected = std::ceil(static_cast<double>(k) *
                                    static_cast<double>(sample) /
                                    static_cast<double>(n));
  plan.rank = static_cast<uint64_t>(
      expected + std::ceil(24.0 * std::sqrt(expected)) + 8.0);
  // The survivors expected at that rank must stay under half the exact
  // plan's compaction cap (CompactCap, n/8).
  const double survivors = static_cast<double>(plan.rank) *
                           static_cast<double>(n) /
                           static_cast<double>(sample);
  if (plan.rank > sample ||
      survivors > static_cast<double>(std::max<uint64_t>(1, n / 8)) / 2) {
    return {};
  }
  return plan;
}

}  // namespace

KernelStatus Sparsifier::Impl::SelectGaussianK(float* u, uint64_t n,
                                               const SelectParams& p,
                                               bool reuse,
                                               cudaStream_t stream) {
  const uint64_t k = p.k;
  const uint64_t lo = MinCount(Method::kGaussianK, k);
  const uint64_t hi = MaxCount(Method::kGaussianK, k);
  const bool zero = p.zero_selected;
  info.fell_back = true;
  if (k == n || lo == hi) {
    BeginOutput(k);
    // Right after Accumulate nothing has written `regions` since: its
    // compaction may hold the candidates.
    GTOPK_CUDA_RETURN_IF_NOT_OK(
        ExactFromU(u, n, k, zero, reuse, stream, /*update_candidates=*/reuse));
    check_selected = true;
    return CopyOut(k, stream);
  }
  // hi = floor(4k/3) can exceed n (density > 3/4): never more than n pairs.
  BeginOutput(std::min<uint64_t>(hi, n));
  const double density = static_cast<double>(k) / static_cast<double>(n);
  const double z = NormalQuantile(1.0 - density / 2.0);
  // After Accumulate's histogram the planner starts with Init's work.
  // The first pass (the fused update's, or Gaussian-k's own histogram
  // pass) kept the keys of a predicted bin and up when the last such
  // selection of this n predicted one: the first compaction may read those
  // candidates instead of u (GaussUpdateCollectKernel; the planner decides,
  // and predicts the next bin).
  InitArgs init{};
  const UpdateCandidates uc = UseUpdateCandidates(n);
  if (reuse) {
    init = InitFor(k, false, true, false);
  } else {
    GTOPK_CUDA_RETURN_IF_NOT_OK(Init(k, true, false, false, stream));
    GTOPK_CUDA_RETURN_IF_NOT_OK(
        Histogram(u, n, stream, Then{}, /*keep_candidates=*/true));
  }
  GTOPK_LAUNCH(GaussPlanKernel, 1, kScanThreads, stream)(
      st, hist0, partials, n, z, lo, hi, p.gaussiank_max_adjustments, hist1,
      gauss_key_limit, init, uc, CompactCap(n));
  GTOPK_CUDA_LAUNCH_CHECK();
  // No host round trip: the compaction at the planned threshold counts the
  // keys the later adjustments may need, and its scan accepts the count
  // when it is in [lo, hi] (the usual case) or else replays the adjustments
  // on the device (GaussResolve). A corrected threshold costs one more
  // compaction pass (skipped otherwise, like everything gated on the
  // device's state). The survivors are then gathered into the output, and
  // all min(hi, n) possible pairs are copied. When the adjustments end
  // without a count in range, Wait finishes with the exact top-k
  // (ContinueGaussianK).
  CollectScan in_range;
  in_range.accept_lo = lo;
  in_range.accept_hi = hi;
  {
    CollectScan from_update = in_range;
    from_update.block_offsets = offsets_u.get();
    from_update.at_least = hist1;
    const int groups = update_layout.warps / kWarpsPerBlock;
    GTOPK_LAUNCH(GaussUpdateCollectKernel, std::min(groups, max_blocks),
                 kThreads, stream)(u, st, regions.get(), counts_u.get(),
                                   update_layout.chunk, groups, gate,
                                   from_update);
    GTOPK_CUDA_LAUNCH_CHECK();
  }
  // Returns at once when the kernel above compacted.
  GTOPK_CUDA_RETURN_IF_NOT_OK(Collect(u, n, kCollectNoHist, false, 0, stream,
                                      in_range, GaussRole::kFirst));
  {
    GatedScope correcting(*this, &st->gk_mode, kGaussCorrect);
    GTOPK_CUDA_RETURN_IF_NOT_OK(
        Collect(u, n, kCollectNoHist, false, 0, stream, in_range));
  }
  GTOPK_CUDA_RETURN_IF_NOT_OK(
      Gather(u, true, zero, false, stream, kGatherIfAccepted));
  // The last gaussiank selection fell back to the exact top-k: residuals
  // change little from step to step, so this one likely does too. Enqueue
  // the exact top-k gated on the rule's end (state's gk_exact), and Wait
  // has nothing left to do when it ran: no host round trip. When the rule
  // lands in range instead, its 8 kernels return at once (8 launches, one
  // step: the prediction follows the outcome). The exact top-k runs from u
  // here, where Wait's continuation may take it from the first compaction's
  // survivors: the same pairs, SelectInfo's candidates and plan differ.
  // When the last fallback of this n predicted the first pass's
  // candidates (GaussFallbackFromUpdate: the fused update's, or this
  // selection's own histogram pass's), that exact top-k is the exact plan
  // with them, as exact's own after Accumulate: no pass over u besides the
  // first while the prediction holds (the narrow band, every value equal,
  // ties and outliers, whose rule ends out of range at every step, cost
  // what normal data costs). Otherwise, on a large u, it starts from a
  // sample (one pass over u, whatever digits the keys share: the narrow
  // band and the outliers that end the rule cost one more pass, not up to
  // three), with the plan over u gated behind it when the last one needed
  // that. The candidates are not taken when the rule's own compaction
  // overwrote them (DeviceState::update_clobbered).
  if (expect_exact) {
    GatedScope falling_back(*this, &st->gk_exact, 1);
    const ExactSample plan = PlanExactSample(n, k);
    if (plan.runs != 0 && !GaussFallbackFromUpdate(n)) {
      GTOPK_CUDA_RETURN_IF_NOT_OK(SampledExact(u, n, k, zero, plan.runs,
                                               plan.rank, gauss_expect_from_u,
                                               stream));
    } else {
      GTOPK_CUDA_RETURN_IF_NOT_OK(ExactFromU(u, n, k, zero, true, stream,
                                             /*update_candidates=*/true));
    }
  }
  exact_enqueued = expect_exact;
  continuation = Continuation::kGaussianK;
  info.fell_back = false;
  return CopyOut(std::min<uint64_t>(hi, n), stream);
}

KernelStatus Sparsifier::Impl::ContinueGaussianK(const DeviceState& state,
                                                 cudaStream_t stream) {
  float* u = pending_u;
  const uint64_t n = pending_n;
  const SelectParams& p = pending_params;
  const uint64_t k = p.k;
  const uint64_t lo = MinCount(Method::kGaussianK, k);
  const uint64_t hi = MaxCount(Method::kGaussianK, k);
  const bool zero = p.zero_selected;
  DeviceState s = state;
  // The device's replay already ended out of range: straight to the exact
  // top-k below.
  const bool replayed = s.gk_mode == kGaussExact;
  bool fallback = s.fallback != 0;
  int adjustments = replayed ? s.gk_adjustments : s.adjustments;
  double t = s.threshold;
  uint32_t key = s.min_key;       // the threshold being tried
  uint32_t cand_key = s.min_key;  // the candidates hold key >= cand_key
  uint64_t cand_count = s.num_candidates;
  uint64_t count = cand_count;  // survivors of `key`
  bool gathered = false;        // candidates in cand_idx/cand_val
  while (!fallback && !replayed) {
    if (count >= lo && count <= hi) {
      BeginOutput(count);
      if (key == cand_key) {
        GTOPK_CUDA_RETURN_IF_NOT_OK(Gather(u, true, zero, false, stream));
        check_selected = false;
      } else {
        GTOPK_CUDA_RETURN_IF_NOT_OK(Final(FinalRule{1, key}, u, n, zero,
                                          CandidateBlocks(cand_count),
                                          stream));
        check_selected = true;
      }
      info.fell_back = false;
      info.adjustments = adjustments;
      info.candidates = cand_count;
      return CopyOut(count, stream);
    }
    if (adjustments == p.gaussiank_max_adjustments) break;
    t = count < lo ? t * 0.5 : t * 1.5;
    if (t <= 0.0) break;
    ++adjustments;
    key = MinKeyAbove(t);
    if (key >= cand_key) {
      // Raising the threshold: count among the candidates.
      if (!gathered) {
        GTOPK_CUDA_RETURN_IF_NOT_OK(
            Gather(u, false, false, false, stream));
        gathered = true;
      }
      GTOPK_CUDA_RETURN_IF_ERROR(
          cudaMemsetAsync(&st->count_at_least, 0, sizeof(ull), stream));
      GTOPK_LAUNCH(CountAtLeastKernel, CandidateBlocks(cand_count), kThreads, stream)(
          cand_val.get(), st, key);
      GTOPK_CUDA_LAUNCH_CHECK();
      GTOPK_CUDA_RETURN_IF_NOT_OK(ReadState(stream, &s));
      count = s.count_at_least;
    } else {
      // Lowering it: one more compaction pass over u.
      GTOPK_CUDA_RETURN_IF_NOT_OK(
          Collect(u, n, kCollectNoHist, true, key, stream));
      GTOPK_CUDA_RETURN_IF_NOT_OK(ReadState(stream, &s));
      if (s.error != 0) {
        pending_error = true;
        BeginOutput(0);
        return CopyOut(0, stream);
      }
      cand_key = key;
      cand_count = s.num_candidates;
      count = cand_count;
      gathered = false;
    }
  }
  // Outside the range after the adjustments: the exact top-k, from the
  // candidates when they hold at least k entries and are few enough to be
  // worth it (CompactCap), else from u.
  info.adjustments = adjustments;
  info.fell_back = true;
  check_selected = true;
  BeginOutput(k);
  if (!fallback && cand_count >= k && cand_count <= CompactCap(n)) {
    if (!gathered) {
      GTOPK_CUDA_RETURN_IF_NOT_OK(Gather(u, false, false, false, stream));
    }
    GTOPK_CUDA_RETURN_IF_NOT_OK(CandidateExact(u, n, k, zero, stream));
    gauss_candidate_exact = true;
  } else {
    // hist0 still describes u (nothing was written to u). The plan takes
    // the first pass's candidates (the fused update's, or Gaussian-k's own
    // histogram pass's) when they hold the top k and no compaction
    // overwrote them, and predicts the next pass's, which the next
    // fallback's gated plan then takes.
    GTOPK_CUDA_RETURN_IF_NOT_OK(ExactFromU(u, n, k, zero, true, stream,
                                           /*update_candidates=*/true));
  }
  return CopyOut(k, stream);
}

KernelStatus Sparsifier::Impl::SelectDgc(float* u, uint64_t n,
                                         const SelectParams& p, bool reuse,
                                         cudaStream_t stream) {
  const uint64_t k = p.k;
  const bool zero = p.zero_selected;
  const DgcSample ds = PlanDgcSample(n, k, p.dgc_sample_fraction);
  BeginOutput(k);
  if (ds.runs == 0) {
    info.fell_back = true;
    // Right after Accumulate nothing has written `regions` since: its
    // compaction may hold the candidates.
    GTOPK_CUDA_RETURN_IF_NOT_OK(
        ExactFromU(u, n, k, zero, reuse, stream, /*update_candidates=*/reuse));
    check_selected = true;
    return CopyOut(k, stream);
  }
  const uint64_t sample_size = ds.runs * 16;
  // More than 1/8 of the sample at or above the threshold B: ties at it
  // (the compaction keeps the keys > B and counts the ties).
  GTOPK_CUDA_RETURN_IF_NOT_OK(
      SampleThreshold(u, n, ds.runs, ds.sample_k,
                      std::max<uint64_t>(1, sample_size / 8), stream));
  // min_key is now the sample's sample_k-th largest key. No host round
  // trip whatever the count: at most k survive (the usual case): the
  // device accepts them and gathers them into the output. More than k (and
  // at most n/8): the compaction has also counted the survivors' digit 0
  // (into the trim histograms), the scan sets the state's trim and finds
  // the k-th survivor's digit 0, the gather copies the survivors to the
  // candidates and counts their digit 1, and the trim's gated kernels
  // finish the exact top-k among them (digit 2 and the final stable
  // compaction; they return at once when nothing is trimmed). All k
  // possible pairs are copied either way.
  CollectScan at_most_k;
  at_most_k.accept_lo = 1;
  at_most_k.accept_hi = k;
  at_most_k.exact_above = CompactCap(n);
  at_most_k.trim = 1;
  // dgc's survivors scatter around k (the sample's estimate).
  GTOPK_CUDA_RETURN_IF_NOT_OK(
      CompactAtSample(u, n, zero, at_most_k, 4 * k, stream));
  // As gaussiank's: the last selection took the exact top-k from u (ties at
  // the sampled threshold), so this one is enqueued too, gated on the
  // device's count (8 kernels that return at once when it is not needed).
  // More than n/8 survivors without it: Wait does it (ContinueDgc).
  if (dgc_expect_exact) {
    GatedScope falling_back(*this, &st->gk_exact, 1);
    GTOPK_CUDA_RETURN_IF_NOT_OK(ExactFromU(u, n, k, zero, false, stream));
  }
  exact_enqueued = dgc_expect_exact;
  continuation = Continuation::kDgc;
  return CopyOut(k, stream);
}

KernelStatus Sparsifier::Impl::SampleThreshold(const float* u, uint64_t n,
                                               uint64_t runs, uint64_t rank,
                                               ull limit,
                                               cudaStream_t stream) {
  const uint64_t sample_size = runs * 16;
  GTOPK_CUDA_RETURN_IF_NOT_OK(Init(rank, true, false, false, stream,
                                   /*dgc=*/true));
  hist_u = nullptr;
  // The sample's keys live in cand_idx until the compaction that follows.
  const int sample_blocks = CandidateBlocks(sample_size);
  GTOPK_LAUNCH(SampleKernel, sample_blocks, kThreads, stream)(
      u, n, runs, cand_idx.get(), hist0, st, gate, Then{kThenFindBin, 0, 0});
  GTOPK_CUDA_LAUNCH_CHECK();
  for (int level = 1; level < 3; ++level) {
    GTOPK_LAUNCH(HistArrayKernel<uint32_t>, sample_blocks, kThreads, stream)(
        cand_idx.get(), nullptr, sample_size, st, hist0, level, gate,
        Then{kThenFindBin, level, level == 2 ? limit : 0});
    GTOPK_CUDA_LAUNCH_CHECK();
  }
  return KernelStatus::Ok();
}

KernelStatus Sparsifier::Impl::TrimRest(float* u, uint64_t n, bool zero,
                                        uint64_t expected,
                                        cudaStream_t stream) {
  GatedScope trimming(*this, &st->trim, 1);
  const int blocks = CandidateBlocks(std::min<uint64_t>(expected, n / 8 + 1));
  GTOPK_LAUNCH(HistArrayKernel<float>, blocks, kThreads, stream)(
      cand_val.get(), &st->num_candidates, 0, st, trim_hists, 2, gate,
      Then{kThenFindBin, 2, 0});
  GTOPK_CUDA_LAUNCH_CHECK();
  return Final(FinalRule{0, 0}, u, n, zero, blocks, stream);
}

// The exact top-k from a sampled lower bound (see sparsify.h): one
// compaction pass over u instead of a histogram pass and a compaction.
KernelStatus Sparsifier::Impl::SelectExact(float* u, uint64_t n,
                                           const SelectParams& p, bool reuse,
                                           cudaStream_t stream) {
  const uint64_t k = p.k;
  const bool zero = p.zero_selected;
  BeginOutput(k);
  // Accumulate's histogram makes the first digit free: the plan over u.
  const ExactSample plan = reuse ? ExactSample() : PlanExactSample(n, k);
  if (plan.runs == 0) {
    // Right after Accumulate nothing has written `regions` since: its
    // compaction may hold the candidates.
    GTOPK_CUDA_RETURN_IF_NOT_OK(
        ExactFromU(u, n, k, zero, reuse, stream, /*update_candidates=*/reuse));
    check_selected = true;
    return CopyOut(k, stream);
  }
  GTOPK_CUDA_RETURN_IF_NOT_OK(SampledExact(u, n, k, zero, plan.runs,
                                           plan.rank, exact_expect_from_u,
                                           stream));
  continuation = Continuation::kExact;
  return CopyOut(k, stream);
}

KernelStatus Sparsifier::Impl::SampledExact(float* u, uint64_t n, uint64_t k,
                                            bool zero, uint64_t runs,
                                            uint64_t rank,
                                            bool from_u_predicted,
                                            cudaStream_t stream) {
  // More than 1/8 of the sample at or above its bound: ties at it
  // (ties_at_bound): the compaction keeps the keys above it instead.
  GTOPK_CUDA_RETURN_IF_NOT_OK(SampleThreshold(
      u, n, runs, rank, std::max<uint64_t>(1, runs * 16 / 8), stream));
  // Exactly k survivors are the selection; k+1 to n/8 are trimmed to the
  // exact top-k among them, which is u's (every key >= the k-th survives);
  // with ties at the bound, fewer than k that reach k with the ties are
  // written from u (tie_write); else fewer than k (the sample missed) or
  // more than n/8: exact_from_u, the plan over u. No host round trip on
  // the first three.
  CollectScan exactly_k;
  exactly_k.accept_lo = k;
  exactly_k.accept_hi = k;
  exactly_k.exact_above = CompactCap(n);
  exactly_k.exact_below = k;
  exactly_k.sampled_exact = 1;
  exactly_k.trim = 1;
  // The survivors expected at the bound's rank, twice over.
  const uint64_t expected = static_cast<uint64_t>(
      2.0 * static_cast<double>(rank) * static_cast<double>(n) /
      static_cast<double>(runs * 16));
  GTOPK_CUDA_RETURN_IF_NOT_OK(
      CompactAtSample(u, n, zero, exactly_k, expected, stream));
  // The last such selection needed the plan over u (ties at the bound,
  // which persist from step to step): enqueue it too, gated.
  if (from_u_predicted) {
    GatedScope falling_back(*this, &st->exact_from_u, 1);
    GTOPK_CUDA_RETURN_IF_NOT_OK(ExactFromU(u, n, k, zero, false, stream));
  }
  sampled_enqueued = true;
  from_u_enqueued = from_u_predicted;
  return KernelStatus::Ok();
}

KernelStatus Sparsifier::Impl::ContinueExact(cudaStream_t stream) {
  const uint64_t k = pending_params.k;
  BeginOutput(k);
  GTOPK_CUDA_RETURN_IF_NOT_OK(ExactFromU(pending_u, pending_n, k,
                                         pending_params.zero_selected, false,
                                         stream));
  sample_missed = true;
  info.fell_back = true;
  check_selected = true;
  return CopyOut(k, stream);
}

KernelStatus Sparsifier::Impl::ContinueDgc(const DeviceState& s,
                                           cudaStream_t stream) {
  float* u = pending_u;
  const uint64_t n = pending_n;
  const uint64_t k = pending_params.k;
  const bool zero = pending_params.zero_selected;
  // The survivors (with ties at the threshold: those above it and the ties).
  info.candidates = s.num_candidates + (s.ties_at_bound != 0 ? s.tie_count : 0);
  // The device accepts 1..k survivors and trims up to n/8; more are most
  // of u (ties at the sample's threshold): the exact top-k from u, whose
  // passes cost less than copying them all.
  if (s.num_candidates <= CompactCap(n) || s.num_candidates <= k) {
    return KernelStatus::Error(
        KernelStatusCode::kInternal,
        "dgc: " + std::to_string(s.num_candidates) +
            " survivors were neither accepted nor trimmed on the device (k = " +
            std::to_string(k) + ")");
  }
  BeginOutput(k);
  GTOPK_CUDA_RETURN_IF_NOT_OK(ExactFromU(u, n, k, zero, false, stream));
  took_exact = true;
  info.fell_back = true;
  check_selected = true;
  return CopyOut(k, stream);
}

KernelStatus Sparsifier::Impl::SelectTiny(float* u, uint64_t n,
                                          const SelectParams& p,
                                          cudaStream_t stream) {
  const uint64_t k = p.k;
  TinyArgs a{};
  a.method = static_cast<int>(p.method);
  a.k = k;
  a.zero = p.zero_selected ? 1 : 0;
  uint64_t slots = k;
  if (p.method == Method::kGaussianK) {
    a.lo = MinCount(Method::kGaussianK, k);
    a.hi = MaxCount(Method::kGaussianK, k);
    if (k == n || a.lo == a.hi) {
      a.method = static_cast<int>(Method::kExact);  // as SelectGaussianK
      info.fell_back = true;
    } else {
      slots = std::min<uint64_t>(a.hi, n);
      const double density = static_cast<double>(k) / static_cast<double>(n);
      a.z = NormalQuantile(1.0 - density / 2.0);
      a.max_adjustments = p.gaussiank_max_adjustments;
    }
  } else if (p.method == Method::kDgc) {
    const DgcSample ds = PlanDgcSample(n, k, p.dgc_sample_fraction);
    if (ds.runs == 0) {
      info.fell_back = true;  // as SelectDgc: the exact top-k
    } else {
      a.seed = host_seed.get();
      a.runs = ds.runs;
      a.sample_k = ds.sample_k;
    }
  }
  BeginOutput(slots);
  GTOPK_LAUNCH(TinySelectKernel, 1, kScanThreads, stream)(
      u, n, st, InitFor(k, false, false, false), a, out_idx(), out_val());
  GTOPK_CUDA_LAUNCH_CHECK();
  hist_u = nullptr;
  tiny_enqueued = true;
  return CopyOut(slots, stream);
}

KernelStatus Sparsifier::Impl::Enqueue(float* u, uint64_t n,
                                       const SelectParams& p, bool reuse,
                                       cudaStream_t stream) {
  // Set again by the paths that read the update's candidates.
  update_layout = UpdateLayout{};
  if (n <= one_block_max_n.load()) return SelectTiny(u, n, p, stream);
  switch (p.method) {
    case Method::kExact:
      return SelectExact(u, n, p, reuse, stream);
    case Method::kGaussianK:
      return SelectGaussianK(u, n, p, reuse, stream);
    case Method::kDgc:
      return SelectDgc(u, n, p, reuse, stream);
  }
  return KernelStatus::Error(KernelStatusCode::kInternal,
                             "Select: unknown method");
}

KernelStatus Sparsifier::Impl::EnqueueWithGraph(float* u, uint64_t n,
                                                const SelectParams& p,
                                                bool reuse,
                                                cudaStream_t stream) {
  const GraphKey key{p.method,       u,
                     n,              p.k,
                     p.zero_selected, reuse,
                     p.gaussiank_max_adjustments, p.dgc_sample_fraction,
                     p.method == Method::kGaussianK ? expect_exact
                     : p.method == Method::kDgc     ? dgc_expect_exact
                                                    : false,
                     p.method == Method::kGaussianK ? gauss_expect_from_u
                     : p.method == Method::kExact   ? exact_expect_from_u
                                                    : false,
                     exact_sample_min_n.load(), one_block_max_n.load(),
                     clear_update_prediction,
                     // (Without a sample both branches enqueue the same.)
                     p.method == Method::kGaussianK && expect_exact &&
                         GaussFallbackFromUpdate(n) &&
                         PlanExactSample(n, p.k).runs != 0,
                     p.method == Method::kGaussianK && !reuse &&
                         ties_predicted_n == n};
  for (CachedGraph& g : graphs) {
    if (!(g.key == key)) continue;
    GTOPK_CUDA_RETURN_IF_ERROR(cudaGraphLaunch(g.exec, stream));
    g.last_used = ++graph_clock;
    // What Select decided for this selection, not the captured one's.
    const bool used_update_histogram = info.used_update_histogram;
    const bool sampled_after_update = info.sampled_after_update;
    info = g.snapshot.info;
    info.used_update_histogram = used_update_histogram;
    info.sampled_after_update = sampled_after_update;
    info.graph_replay = true;
    Restore(g.snapshot);
    return KernelStatus::Ok();
  }
  // Capture what Enqueue would enqueue; on any refusal, graphs go off and
  // the selection is enqueued directly (nothing captured ever ran).
  if (cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal) !=
      cudaSuccess) {
    cudaGetLastError();
    use_graphs = false;
    return Enqueue(u, n, p, reuse, stream);
  }
  const KernelStatus captured = Enqueue(u, n, p, reuse, stream);
  cudaGraph_t graph = nullptr;
  const cudaError_t ended = cudaStreamEndCapture(stream, &graph);
  cudaGraphExec_t exec = nullptr;
  const bool instantiated =
      captured.ok() && ended == cudaSuccess && graph != nullptr &&
      cudaGraphInstantiate(&exec, graph, 0) == cudaSuccess;
  if (graph != nullptr) cudaGraphDestroy(graph);
  if (!instantiated) {
    cudaGetLastError();
    if (exec != nullptr) cudaGraphExecDestroy(exec);
    if (!captured.ok()) return captured;
    use_graphs = false;
    SelectInfo fresh;
    fresh.used_update_histogram = info.used_update_histogram;
    fresh.sampled_after_update = info.sampled_after_update;
    info = fresh;
    check_selected = false;
    continuation = Continuation::kNone;
    return Enqueue(u, n, p, reuse, stream);
  }
  CachedGraph entry;
  entry.key = key;
  entry.exec = exec;
  entry.snapshot = Snapshot();
  entry.last_used = ++graph_clock;
  if (graphs.size() >= kMaxGraphs) {
    auto oldest = std::min_element(
        graphs.begin(), graphs.end(),
        [](const CachedGraph& a, const CachedGraph& b) {
          return a.last_used < b.last_used;
        });
    cudaGraphExecDestroy(oldest->exec);
    graphs.erase(oldest);
  }
  graphs.push_back(entry);
  GTOPK_CUDA_RETURN_IF_ERROR(cudaGraphLaunch(exec, stream));
  return KernelStatus::Ok();
}

Sparsifier::Sparsifier(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

void Sparsifier::set_use_graphs(bool use) {
  impl_->use_graphs = use;
  if (!use) impl_->ClearGraphs();
}
void Sparsifier::set_gaussiank_fallback_from_candidates_for_testing(
    bool use) {
  impl_->gauss_fallback_from_candidates = use;
  impl_->ClearGraphs();
}
void Sparsifier::set_gaussiank_key_limit_for_testing(int limit) {
  impl_->gauss_key_limit = std::max(0, std::min(limit, kMaxGaussKeys));
  impl_->ClearGraphs();  // they captured the old limit
}

Sparsifier::~Sparsifier() = default;

uint64_t Sparsifier::capacity() const { return impl_->capacity; }
const uint32_t* Sparsifier::device_indices() const {
  return impl_->out_idx();
}
const float* Sparsifier::device_values() const { return impl_->out_val(); }

KernelStatus Sparsifier::Create(uint64_t capacity,
                                std::unique_ptr<Sparsifier>* out) {
  if (capacity == 0 || capacity > (uint64_t{1} << 32)) {
    return KernelStatus::Error(
        KernelStatusCode::kInvalidArgument,
        "Sparsifier capacity must be in [1, 2^32], got " +
            std::to_string(capacity));
  }
  auto impl = std::make_unique<Impl>();
  impl->capacity = capacity;
  int device = 0, sms = 0;
  GTOPK_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  GTOPK_CUDA_RETURN_IF_ERROR(
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  impl->max_blocks = std::max(1, std::min(kMaxBlocks, sms * 8));
  int per_sm = 0;
  GTOPK_CUDA_RETURN_IF_ERROR(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
      &per_sm, HistogramKernel<true>, kThreads, 0));
  impl->update_blocks =
      std::max(1, std::min(impl->max_blocks, sms * std::max(1, per_sm)));
  const size_t meta_bytes = kHistsSize * sizeof(ull) +
                            3 * kMaxBlocks * sizeof(double) +
                            kHistsSize * sizeof(ull);
  GTOPK_CUDA_RETURN_IF_NOT_OK(impl->meta.Allocate(meta_bytes));
  GTOPK_CUDA_RETURN_IF_ERROR(cudaMemset(impl->meta.get(), 0, meta_bytes));
  GTOPK_CUDA_RETURN_IF_NOT_OK(impl->out.Allocate(Impl::OutBytes(capacity)));
  // The state (blocks_done must start at 0).
  GTOPK_CUDA_RETURN_IF_ERROR(cudaMemset(impl->out.get(), 0, kOutHeader));
  // cudaMemset is asynchronous on the default stream, which a caller's
  // cudaStreamNonBlocking stream does not wait for: finish it here, or the
  // first InitKernel on that stream could run before it and be zeroed.
  GTOPK_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(nullptr));
  impl->st = reinterpret_cast<DeviceState*>(impl->out.get());
  impl->hist0 = reinterpret_cast<ull*>(impl->meta.get());
  impl->hist1 = impl->hist0 + kBins;
  impl->hist2 = impl->hist1 + kBins;
  impl->partials = reinterpret_cast<double*>(impl->hist2 + 512);
  impl->trim_hists = reinterpret_cast<ull*>(impl->partials + 3 * kMaxBlocks);
  GTOPK_CUDA_RETURN_IF_NOT_OK(
      impl->regions.Allocate(capacity + kChunkAlign * kMaxWarps));
  GTOPK_CUDA_RETURN_IF_NOT_OK(
      impl->counts_u.Allocate(impl->update_blocks * kWarpsPerBlock * kUpdateChunks));
  GTOPK_CUDA_RETURN_IF_NOT_OK(
      impl->offsets_u.Allocate(impl->update_blocks * kUpdateChunks));
  GTOPK_CUDA_RETURN_IF_NOT_OK(impl->eq_counts_u.Allocate(
      impl->update_blocks * kWarpsPerBlock * kUpdateChunks));
  GTOPK_CUDA_RETURN_IF_NOT_OK(
      impl->eq_offsets_u.Allocate(impl->update_blocks * kUpdateChunks));
  GTOPK_CUDA_RETURN_IF_NOT_OK(impl->counts_a.Allocate(kMaxWarps));
  GTOPK_CUDA_RETURN_IF_NOT_OK(impl->counts_b.Allocate(kMaxWarps));
  GTOPK_CUDA_RETURN_IF_NOT_OK(impl->offsets_a.Allocate(kMaxWarps));
  GTOPK_CUDA_RETURN_IF_NOT_OK(impl->offsets_b.Allocate(kMaxWarps));
  GTOPK_CUDA_RETURN_IF_NOT_OK(impl->cand_idx.Allocate(capacity));
  GTOPK_CUDA_RETURN_IF_NOT_OK(impl->cand_val.Allocate(capacity));
  GTOPK_CUDA_RETURN_IF_NOT_OK(impl->host_out.Allocate(kOutHeader));
  GTOPK_CUDA_RETURN_IF_NOT_OK(impl->host_seed.Allocate(1));
  out->reset(new Sparsifier(std::move(impl)));
  return KernelStatus::Ok();
}

KernelStatus Sparsifier::Accumulate(
    const float* grad, const float* params, const float* velocity_in,
    float* velocity_out, const float* residual_in, float* residual_out,
    uint64_t n, const UpdateParams& up, cudaStream_t stream) {
  DiscardStaleError();
  Impl& m = *impl_;
  if (n == 0 || n > m.capacity) {
    return KernelStatus::Error(
        KernelStatusCode::kInvalidArgument,
        "Accumulate: n = " + std::to_string(n) +
            " must be in [1, capacity = " + std::to_string(m.capacity) + "]");
  }
  if (grad == nullptr || residual_in == nullptr || residual_out == nullptr ||
      (up.momentum_correction &&
       (velocity_in == nullptr || velocity_out == nullptr)) ||
      (params == nullptr && up.weight_decay != 0.0f)) {
    return KernelStatus::Error(KernelStatusCode::kInvalidArgument,
                               "Accumulate: a required device pointer is null");
  }
  if (!(up.lr > 0.0f) || !std::isfinite(up.lr) || !(up.momentum >= 0.0f) ||
      !(up.momentum < 1.0f) || !(up.weight_decay >= 0.0f) ||
      !std::isfinite(up.weight_decay)) {
    return KernelStatus::Error(KernelStatusCode::kInvalidArgument,
                               "Accumulate: need lr > 0, momentum in [0, 1), "
                               "weight_decay >= 0, all finite");
  }
  if (m.pending) {
    return KernelStatus::Error(KernelStatusCode::kFailedPrecondition,
                               "Accumulate: Wait for the pending Select first");
  }
  m.clear_update_prediction = false;
  GTOPK_CUDA_RETURN_IF_NOT_OK(m.Init(0, true, false, false, stream));
  HistArgs a{};
  a.grad = grad;
  a.params = params;
  a.velocity_in = velocity_in;
  a.velocity_out = velocity_out;
  a.residual_in = residual_in;
  a.residual_out = residual_out;
  a.n = n;
  a.lr = up.lr;
  a.momentum = up.momentum;
  a.weight_decay = up.weight_decay;
  a.momentum_correction = up.momentum_correction;
  a.vectorized = Aligned16(grad) && Aligned16(residual_in) &&
                 Aligned16(residual_out) &&
                 (params == nullptr || Aligned16(params)) &&
                 (!up.momentum_correction ||
                  (Aligned16(velocity_in) && Aligned16(velocity_out)));
  a.st = m.st;
  a.hist0 = m.hist0;
  a.partials = m.partials;
  m.SetHistLayout(n, &a);
  a.regions = m.regions.get();
  a.counts = m.counts_u.get();
  a.eq_counts = m.eq_counts_u.get();
  // (The variant that counts ties only where the last selection predicted
  // them for this n: Impl::ties_predicted_n.)
  auto* update = m.ties_predicted_n == n ? &HistogramKernel<true, true>
                                         : &HistogramKernel<true, false>;
  GTOPK_LAUNCH(update, m.HistLayoutFor(n).blocks, kThreads, stream)(a);
  GTOPK_CUDA_LAUNCH_CHECK();
  m.hist_u = residual_out;
  m.hist_n = n;
  return KernelStatus::Ok();
}

KernelStatus Sparsifier::Select(float* u, uint64_t n, const SelectParams& p,
                                cudaStream_t stream) {
  DiscardStaleError();
  Impl& m = *impl_;
  if (m.pending) {
    return KernelStatus::Error(KernelStatusCode::kFailedPrecondition,
                               "Select: Wait for the pending Select first");
  }
  if (u == nullptr || n == 0 || n > m.capacity) {
    return KernelStatus::Error(
        KernelStatusCode::kInvalidArgument,
        "Select: n = " + std::to_string(n) + " must be in [1, capacity = " +
            std::to_string(m.capacity) + "] (u non-null)");
  }
  if (p.k == 0 || p.k > n) {
    return KernelStatus::Error(KernelStatusCode::kInvalidArgument,
                               "Select: k = " + std::to_string(p.k) +
                                   " must be in [1, n = " + std::to_string(n) +
                                   "]");
  }
  if (!(p.dgc_sample_fraction >= 0.01 && p.dgc_sample_fraction <= 1.0) ||
      p.gaussiank_max_adjustments < 1 || p.gaussiank_max_adjustments > 16) {
    return KernelStatus::Error(
        KernelStatusCode::kInvalidArgument,
        "Select: dgc_sample_fraction must be in [0.01, 1] "
        "and gaussiank_max_adjustments in [1, 16]");
  }
  bool reuse = m.hist_u == u && m.hist_n == n;
  m.info = SelectInfo();
  m.pending_update_sampled = false;
  if (reuse && p.method == Method::kExact && m.update_many_pass_n == n &&
      n > one_block_max_n.load() && PlanExactSample(n, p.k).runs != 0 &&
      ++m.update_sampled_count % Impl::kRetryPlanAfterUpdate != 0) {
    // (Impl::update_many_pass_n) The update's histogram is not used.
    reuse = false;
    m.pending_update_sampled = true;
    m.info.sampled_after_update = true;
  }
  m.clear_update_prediction = m.pending_update_sampled;
  // (The one-block path for a small u reads u whole, histogram or not.)
  m.info.used_update_histogram =
      reuse && p.method != Method::kDgc && n > one_block_max_n.load();
  m.pending_error = false;
  m.check_selected = false;
  GTOPK_CUDA_RETURN_IF_NOT_OK(m.EnsurePinned(MaxCount(p.method, p.k), stream));
  m.pending = true;  // from here on Wait must be called
  m.pending_u = u;
  m.pending_n = n;
  m.pending_params = p;
  m.continuation = Impl::Continuation::kNone;
  m.exact_enqueued = false;
  m.sampled_enqueued = false;
  m.from_u_enqueued = false;
  m.took_exact = false;
  m.gauss_candidate_exact = false;
  m.tiny_enqueued = false;
  m.sample_missed = false;
  // dgc's sample seed for this step: a replayed graph copies it from here.
  *m.host_seed.get() = Mix(p.seed, p.step);
  const KernelStatus status =
      m.use_graphs && stream != nullptr
          ? m.EnqueueWithGraph(u, n, p, reuse, stream)
          : m.Enqueue(u, n, p, reuse, stream);
  m.hist_u = nullptr;  // u changes (zeroing) or the histogram was reused
  if (!status.ok()) m.pending = false;
  return status;
}

KernelStatus Sparsifier::Wait(cudaStream_t stream, SelectedPairs* out) {
  DiscardStaleError();
  Impl& m = *impl_;
  if (!m.pending) {
    return KernelStatus::Error(KernelStatusCode::kFailedPrecondition,
                               "Wait: no pending Select");
  }
  m.pending = false;
  GTOPK_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
  DeviceState s = *m.host_state();
  const Impl::Continuation continuation = m.continuation;
  m.continuation = Impl::Continuation::kNone;
  // dgc with ties at its threshold B, finished on the device: its
  // survivors are the keys > B (kept) and the ties (counted), and by its
  // rule more than k and more than n/8 of them mean the exact top-k of u,
  // which is what the device selected then (the plan over u's state has
  // these fields reset; its branch below reports them).
  const bool dgc_ties = continuation == Impl::Continuation::kDgc &&
                        s.error == 0 && s.ties_at_bound != 0;
  const uint64_t dgc_survivors = s.num_candidates + s.tie_count;
  bool ran_sampled = false;  // an exact top-k from a sample ran
  if (m.tiny_enqueued && s.error == 0) {
    // One kernel did it all; the rule's outcome is in the state.
    const Method method = m.pending_params.method;
    m.pending_count = s.num_selected;
    m.check_selected = false;
    m.info.fast_path = true;
    m.info.one_block = true;
    if (method == Method::kGaussianK && !m.info.fell_back) {
      m.info.fell_back = s.gk_exact != 0;
      m.info.adjustments =
          s.gk_exact != 0 ? s.gk_exact_adjustments : s.adjustments;
      if (s.gk_exact == 0) m.info.candidates = s.num_candidates;
    } else if (method == Method::kDgc && !m.info.fell_back) {
      m.info.fell_back = s.gk_exact != 0;
      m.info.trimmed_on_device = s.trim != 0;
      m.info.candidates = s.num_candidates;  // the survivors
    }
    const uint64_t lo = MinCount(method, m.pending_params.k);
    const uint64_t hi =
        std::min<uint64_t>(MaxCount(method, m.pending_params.k), m.pending_n);
    const bool exact_count = method == Method::kExact || m.info.fell_back ||
                             m.info.trimmed_on_device;
    if (exact_count ? s.num_selected != m.pending_params.k
                    : s.num_selected < std::min(lo, hi) ||
                          s.num_selected > hi) {
      return KernelStatus::Error(
          KernelStatusCode::kInternal,
          "one-block selection produced " + std::to_string(s.num_selected) +
              " pairs (k = " + std::to_string(m.pending_params.k) + ")");
    }
  }
  if (continuation != Impl::Continuation::kNone && s.error == 0) {
    const bool gauss = continuation == Impl::Continuation::kGaussianK;
    const bool corrected = gauss && s.gk_mode == kGaussCorrect;
    // An exact top-k from a sample ran: exact's own, or gaussiank's gated
    // fallback after its rule ended out of range (gk_exact).
    const bool sampled =
        continuation == Impl::Continuation::kExact ||
        (gauss && m.sampled_enqueued && s.gk_exact != 0);
    if (sampled) {
      ran_sampled = true;
      m.pending_count = m.pending_params.k;
      if (gauss) {
        m.info.fell_back = true;
        m.info.adjustments = s.gk_exact_adjustments;
      }
      if (s.accepted || s.trim != 0 || s.tie_write != 0) {
        // Exactly k survived its bound (the gather's output), or more
        // (the device trimmed them to their exact top-k), or fewer above a
        // tied bound and the ties made up the rest (written from u).
        m.info.fast_path = true;
        m.info.exact_sampled = true;
        m.info.trimmed_on_device = s.trim != 0;
        m.info.candidates = s.num_candidates;
        m.check_selected = s.trim != 0 || s.tie_write != 0;
      } else if (s.exact_from_u != 0 && m.from_u_enqueued) {
        // The bound failed; the plan over u ran, gated on the device.
        m.info.fast_path = true;
        m.info.fell_back = true;
        m.check_selected = true;
        m.sample_missed = true;
      } else {
        GTOPK_CUDA_RETURN_IF_NOT_OK(m.ContinueExact(stream));
        GTOPK_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
        s = *m.host_state();
      }
    } else if (s.accepted) {
      // The fast path's gather is the selection.
      m.pending_count = s.num_candidates;
      m.info.candidates = s.num_candidates;
      m.info.fast_path = true;
      m.info.corrected_on_device = corrected;
      if (gauss) {
        m.info.adjustments = corrected ? s.gk_adjustments : s.adjustments;
      }
    } else if (m.exact_enqueued && s.gk_exact != 0) {
      // The gated exact top-k ran on the device: gaussiank's rule ended out
      // of range (on a small u), or more than n/8 survived dgc's sampled
      // threshold.
      m.pending_count = m.pending_params.k;
      m.check_selected = true;
      m.took_exact = true;
      m.info.fast_path = true;
      m.info.fell_back = true;
      if (gauss) {
        m.info.adjustments = s.gk_exact_adjustments;
      } else {
        m.info.candidates = s.gk_exact_candidates;  // the survivors
      }
    } else if (continuation == Impl::Continuation::kDgc &&
               (s.trim != 0 || s.tie_write != 0)) {
      // More than k survived dgc's sampled threshold: the device took the
      // exact top-k among them; or, with ties at the threshold B, it wrote
      // the keys > B and every tie (at most k survivors) or the first ties
      // up to k.
      m.pending_count = s.trim != 0 ? m.pending_params.k : s.num_selected;
      m.check_selected = true;
      m.info.fast_path = true;
      m.info.trimmed_on_device = s.trim != 0;
    } else if (corrected) {
      // GaussResolve found the count in range from exact counts; the
      // compaction at that key disagreeing is a broken invariant.
      return KernelStatus::Error(
          KernelStatusCode::kInternal,
          "gaussiank device correction kept " +
              std::to_string(s.num_candidates) + " entries, outside [" +
              std::to_string(MinCount(Method::kGaussianK, m.pending_params.k)) +
              ", " +
              std::to_string(MaxCount(Method::kGaussianK, m.pending_params.k)) +
              "]");
    } else {
      GTOPK_CUDA_RETURN_IF_NOT_OK(gauss ? m.ContinueGaussianK(s, stream)
                                        : m.ContinueDgc(s, stream));
      GTOPK_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
      s = *m.host_state();
    }
  }
  if (dgc_ties) {
    m.info.candidates = dgc_survivors;
    m.info.fell_back = dgc_survivors > m.pending_params.k &&
                       dgc_survivors > Impl::CompactCap(m.pending_n);
  }
  if ((s.error & kErrorNonFinite) != 0) {
    // Find the first position for the message (rare path, one more pass).
    GTOPK_CUDA_RETURN_IF_ERROR(
        cudaMemsetAsync(&m.st->first_non_finite, 0xff, sizeof(ull), stream));
    GTOPK_LAUNCH(FirstNonFiniteKernel, m.HistBlocks(m.pending_n), kThreads, stream)(
        m.pending_u, m.pending_n, m.st);
    GTOPK_CUDA_LAUNCH_CHECK();
    ull pos = 0;
    GTOPK_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(&pos, &m.st->first_non_finite,
                                               sizeof(ull),
                                               cudaMemcpyDeviceToHost, stream));
    GTOPK_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
    float value = 0.0f;
    if (pos < m.pending_n) {
      GTOPK_CUDA_RETURN_IF_ERROR(cudaMemcpy(
          &value, m.pending_u + pos, sizeof(float), cudaMemcpyDeviceToHost));
    }
    return KernelStatus::Error(KernelStatusCode::kInvalidArgument,
                               "selector input has a non-finite value (" +
                                   FloatText(value) + ") at position " +
                                   std::to_string(pos));
  }
  if (s.error != 0 || m.pending_error) {
    return KernelStatus::Error(
        KernelStatusCode::kInternal,
        "selection failed an internal check (error bits " +
            std::to_string(s.error) + ")");
  }
  if (m.check_selected && s.num_selected != m.pending_count) {
    return KernelStatus::Error(
        KernelStatusCode::kInternal,
        "selection produced " + std::to_string(s.num_selected) +
            " pairs, expected " + std::to_string(m.pending_count));
  }
  if (continuation == Impl::Continuation::kGaussianK) {
    m.expect_exact = m.info.fell_back;
    // The next gated fallback of this n plans with the first pass's
    // candidates when this fallback ran that plan (gated, or in
    // ContinueGaussianK) and it predicted the next pass's; and after a
    // fallback that started from a sample (which predicts nothing), so
    // that the plan runs again and predicts (at worst every other step
    // when it cannot: the sample in between).
    const DeviceState& last = *m.host_state();
    const bool fell_back = m.info.fell_back;
    const bool planned = fell_back && !ran_sampled &&
                         !m.gauss_candidate_exact &&
                         last.update_pred_n == m.pending_n &&
                         last.update_pred_key != 0;
    m.gauss_exact_predicted_n =
        planned || (fell_back && ran_sampled) ? m.pending_n : 0;
  } else if (continuation == Impl::Continuation::kDgc) {
    m.dgc_expect_exact = m.took_exact;
  }
  if (ran_sampled) {
    (continuation == Impl::Continuation::kExact ? m.exact_expect_from_u
                                                : m.gauss_expect_from_u) =
        m.sample_missed;
  }
  m.info.count = m.pending_count;
  if (m.info.candidates == 0) m.info.candidates = s.num_candidates;
  m.info.exact_digit_passes = s.u_passes;
  m.info.exact_final_from_u = s.from_u != 0;
  m.info.candidates_from_update =
      s.from_update != 0 || s.gauss_used_update != 0;
  {
    const DeviceState& last = *m.host_state();  // after any continuation
    m.ties_predicted_n = last.update_pred_ties != 0 && last.update_pred_key != 0
                             ? last.update_pred_n
                             : 0;
  }
  // exact after Accumulate: whether the next such selection of this n
  // starts from a sample (Impl::update_many_pass_n). A sampled one keeps
  // the verdict; the plan sets it from how many passes over u it needed.
  if (m.pending_params.method == Method::kExact &&
      m.info.used_update_histogram && !m.info.one_block) {
    // (A final compaction from u comes after three digit passes.) When
    // the plan predicted the next update's candidates, and this update
    // kept none it could have used (none, or the prediction missed), the
    // next one tries them instead.
    const bool predicted = s.update_pred_n == m.pending_n &&
                           s.update_pred_key != 0;
    const bool missed = s.update_used_n == m.pending_n &&
                        s.update_used_key != 0 &&
                        !m.info.candidates_from_update;
    const bool many = !m.info.candidates_from_update &&
                      m.info.exact_digit_passes > 1 &&
                      (missed || !predicted);
    m.update_many_pass_n = many ? m.pending_n : 0;
    m.update_sampled_count = 0;
  } else if (m.pending_update_sampled && m.info.fell_back &&
             m.info.exact_digit_passes <= 1) {
    // The sample missed and the plan over u that followed needed one
    // digit pass: the data no longer needs the sample (with the update's
    // histogram that plan is one compaction pass).
    m.update_many_pass_n = 0;
    m.update_sampled_count = 0;
  }
  out->indices = reinterpret_cast<const uint32_t*>(m.host_out.get() + kOutHeader);
  out->values = reinterpret_cast<const float*>(
      m.host_out.get() + kOutHeader + m.out_stride * sizeof(uint32_t));
  out->count = m.pending_count;
  out->info = m.info;
  return KernelStatus::Ok();
}

uint64_t SetExactSampleMinNForTesting(uint64_t min_n) {
  return exact_sample_min_n.exchange(min_n);
}

uint64_t SetOneBlockMaxNForTesting(uint64_t max_n) {
  return one_block_max_n.exchange(std::min<uint64_t>(max_n, kTinyMaxN));
}

}  // namespace cuda
}  // namespace gtopk
