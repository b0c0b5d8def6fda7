// The arguments of the selector's kernels (common/cuda/sparsify/*.cu), as
// the host driver fills them: plain C++, no device code.
#ifndef GTOPK_COMMON_CUDA_SPARSIFY_KERNEL_ARGS_H_
#define GTOPK_COMMON_CUDA_SPARSIFY_KERNEL_ARGS_H_

#include <cstdint>

#include "common/cuda/sparsify/state.h"

namespace gtopk {
namespace cuda {
namespace internal {

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
  const uint32_t* counts;     // [warps]: the update's per-chunk counts
  ull* offsets;               // [warps / kWarpsPerBlock]: group offsets out
  const uint32_t* eq_counts;  // [warps]: with ties, the keys == K
  ull* eq_offsets;            // [warps / kWarpsPerBlock]: theirs
  int warps;  // 0: no update layout (nothing is used or predicted)
  uint64_t n;
  ull predict_cap;  // the most keys a predicted bin may keep
};

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

// The final threshold: T and how many of the keys == T to take.
struct FinalRule {
  int use_host_key;  // T = host_key and take every tie
  uint32_t host_key;
};

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

}  // namespace internal
}  // namespace cuda
}  // namespace gtopk

#endif  // GTOPK_COMMON_CUDA_SPARSIFY_KERNEL_ARGS_H_
