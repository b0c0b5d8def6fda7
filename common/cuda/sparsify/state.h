// The selector's shared state (common/cuda/sparsify.h): the constants of
// its passes, the state in device memory that every kernel reads and
// writes (copied to the host at sync points), and the gate and follow-up
// step a launch carries. Plain C++ (no device code): the kernels
// (common/cuda/sparsify/*.cu) and the host driver (*.cc) include it.
//
// Layout of the passes over u (length n): the grid has W warps
// (W <= kMaxWarps) and warp w owns the contiguous chunk [w*chunk,
// (w+1)*chunk) of u, chunk a multiple of 128, read as float4 per lane. A
// warp compacts the survivors of its chunk in index order with ballots into
// its own region of `regions` (capacity chunk, so nothing can overflow)
// and records their count; one block scans the W counts. The concatenation
// of the regions in warp order is therefore sorted by index, which gives the
// stable (lower index first) order without a device-wide sort.
//
// The fused update (HistogramKernel<true>) partitions u the same way, with
// kUpdateChunks chunks per warp of its one-wave grid, so that the
// candidates it keeps for the next exact selection are index-ordered too.
//
// Candidate arrays (cand_idx/cand_val, length M on the device) use the
// same warp-chunk scheme with 32 entries per step.
//
// The kernels are built with --fmad=false (common/cuda/sparsify/nvcc_flags.txt)
// so that the residual update rounds like the CPU rule (-ffp-contract=off).
#ifndef GTOPK_COMMON_CUDA_SPARSIFY_STATE_H_
#define GTOPK_COMMON_CUDA_SPARSIFY_STATE_H_

#include <cstdint>

#include "common/magnitude_key.h"

namespace gtopk {
namespace cuda {
namespace internal {

using ull = unsigned long long;
using ::gtopk::kNonFiniteKey;

constexpr int kThreads = 256;
constexpr int kWarpsPerBlock = kThreads / 32;
// 1024 blocks of 256 threads: 97 % of one full wave on an H200 (132 SMs x 8).
constexpr int kMaxBlocks = 1024;
constexpr int kMaxWarps = kMaxBlocks * kWarpsPerBlock;  // 8192
// One-block kernels (Init, the Gaussian-k planner, FindBinDecide).
constexpr int kScanThreads = 1024;
constexpr uint64_t kChunkAlign = 128;  // 32 lanes x float4
// Chunks per warp of the histogram pass (HistArgs::chunk): enough that a
// chunk rounded up to kChunkAlign leaves the warps' shares even.
constexpr int kUpdateChunks = 4;
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

// The one-block path for a small u (n <= kTinyMaxN; tiny_kernel.cu).
constexpr uint64_t kTinyMaxN = 4096;
constexpr int kTinyPerThread =
    static_cast<int>((kTinyMaxN + kScanThreads - 1) / kScanThreads);
constexpr uint64_t kTinyMaxSample = kTinyMaxN / 2;  // dgc: runs * 32 < n

// The most keys GaussPlanKernel may have listed for its first compaction to
// read the update's candidates (GaussUpdateCollectKernel counts them per
// key; more is rare: the stop's bin must leave [lo, hi] undecided at
// several reachable thresholds).
constexpr int kMaxUpdateGaussKeys = 8;

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

// SplitMix64, as common/random.h's MixSeed.
GTOPK_HOST_DEVICE inline ull Mix(ull seed, ull stream) {
  ull z = seed + 0x9e3779b97f4a7c15ull * (stream + 1);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// Smallest key whose value is strictly greater than t (CPU gaussiank's
// MinKeyAbove, common/cpu/gaussiank_selector.cc).
GTOPK_HOST_DEVICE inline uint32_t MinKeyAbove(double t) {
  if (t < 0.0) return 0;
  const float tf = static_cast<float>(t);
  if (!(tf <= 3.402823466e38f)) return kNonFiniteKey;  // +Inf (t >= 0)
  const uint32_t key = MagnitudeKey(tf);
  return static_cast<double>(tf) > t ? key : key + 1;
}

// The keys the fine prediction keeps at most: about four times k (the
// margin for drift on a crowded bin), never more than the update's cap.
GTOPK_HOST_DEVICE inline ull FineCap(ull k, ull predict_cap) {
  return 4 * k < predict_cap ? 4 * k : predict_cap;
}

}  // namespace internal
}  // namespace cuda
}  // namespace gtopk

#endif  // GTOPK_COMMON_CUDA_SPARSIFY_STATE_H_
