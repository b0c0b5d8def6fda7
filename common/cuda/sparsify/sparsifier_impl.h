// Sparsifier's implementation (common/cuda/sparsify.h): the device scratch,
// the pending selection, and the host driver that enqueues each method's
// chain of kernels (through the launchers of common/cuda/sparsify/
// launchers.h) and finishes it in Wait. Host C++; the enqueue steps are in
// enqueue.cc, the methods in select_*.cc, Wait's steps in wait.cc.
#ifndef GTOPK_COMMON_CUDA_SPARSIFY_SPARSIFIER_IMPL_H_
#define GTOPK_COMMON_CUDA_SPARSIFY_SPARSIFIER_IMPL_H_

#include <cuda_runtime_api.h>

#include <cstdint>

#include "common/cuda/cuda_status.h"
#include "common/cuda/sparsify.h"
#include "common/cuda/sparsify/graph_cache.h"
#include "common/cuda/sparsify/kernel_args.h"
#include "common/cuda/sparsify/plan.h"
#include "common/cuda/sparsify/selection_history.h"
#include "common/cuda/sparsify/state.h"
#include "common/cuda/sparsify/testing.h"

namespace gtopk {
namespace cuda {
namespace internal {

// The host-side state a selection's enqueue leaves (info, what Wait
// checks and continues, the compaction layout), saved with its graph and
// restored when the graph is replayed instead.
struct HostSnapshot {
  SelectInfo info;
  bool check_selected = false;
  Continuation continuation = Continuation::kNone;
  bool exact_enqueued = false;
  bool sampled_enqueued = false;
  bool from_u_enqueued = false;
  bool tiny_enqueued = false;
  uint64_t pending_count = 0;
  uint64_t out_stride = 0;
  CollectLayout collect;
  UpdateLayout update_layout{};
};

struct SparsifierImpl {
  SparsifierImpl();

  uint64_t capacity = 0;
  int max_blocks = 0;  // passes over u: <= kMaxBlocks
  // The fused update's grid: one wave of HistogramKernel<true>, which holds
  // more registers than the other passes (fewer blocks fit per SM).
  int update_blocks = 0;
  // The test hooks (common/cuda/sparsify/testing.h), set at Create
  // (SetTuning: one_block_max_n and gaussiank_key_limit clamped).
  SparsifierTuning tuning;
  void SetTuning(const SparsifierTuning& t);

  DeviceBuffer<unsigned char> meta;  // hist0/1/2, partials, trim histograms
  DeviceState* st = nullptr;         // the head of `out`
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
  CollectLayout collect;

  // Captured selections (set_use_graphs): the graph and the host-side
  // state the capture left, restored on replay.
  bool use_graphs = true;
  GraphCache<cudaGraphExec_t, HostSnapshot> graphs;
  // What one selection tells the next.
  SelectionHistory history;
  // Its Inits drop the update's prediction (InitArgs::clear_prediction):
  // set by Select for an exact selection after Accumulate that starts from
  // a sample (history.SampleAfterUpdate), cleared by Accumulate.
  bool clear_update_prediction = false;

  HostSnapshot Snapshot() const;
  void Restore(const HostSnapshot& s);

  // The pending selection.
  bool pending = false;
  float* pending_u = nullptr;
  uint64_t pending_n = 0;
  uint64_t pending_count = 0;
  SelectParams pending_params;
  bool check_selected = false;  // state.num_selected must equal the count
  bool pending_error = false;   // the host state already shows an error
  bool exact_enqueued = false;  // gaussiank: its gated exact fallback too
  // The exact top-k from a sample was enqueued (exact's, or gaussiank's
  // gated fallback), and after it the plan over u gated on exact_from_u.
  bool sampled_enqueued = false;
  bool from_u_enqueued = false;
  bool tiny_enqueued = false;  // the pending selection is TinySelectKernel's
  bool pending_update_sampled = false;  // exact after Accumulate, sampled
  // For the history: the pending selection's sample missed; it took the
  // exact top-k (dgc); gaussiank's host continuation took it from its
  // compaction's candidates (CandidateExact: it predicts nothing).
  bool sample_missed = false;
  bool took_exact = false;
  bool gauss_candidate_exact = false;
  SelectInfo info;
  Continuation continuation = Continuation::kNone;

  // The public entry points (Sparsifier's, after nothing).
  KernelStatus Accumulate(const float* grad, const float* params,
                          const float* velocity_in, float* velocity_out,
                          const float* residual_in, float* residual_out,
                          uint64_t n, const UpdateParams& up,
                          cudaStream_t stream);
  KernelStatus Select(float* u, uint64_t n, const SelectParams& p,
                      cudaStream_t stream);
  KernelStatus Wait(cudaStream_t stream, SelectedPairs* out);

  // Layouts and grids for this selector's max_blocks and update_blocks.
  void SetCollectLayout(uint64_t n) {
    collect = CollectLayoutFor(n, max_blocks);
  }
  int CandidateBlocks(uint64_t expected) const {
    return internal::CandidateBlocks(expected, max_blocks);
  }
  int HistBlocks(uint64_t n) const {
    return internal::HistBlocks(n, max_blocks);
  }
  HistLayout HistLayoutFor(uint64_t n) const {
    return internal::HistLayoutFor(n, max_blocks, update_blocks);
  }
  void SetHistLayout(uint64_t n, HistArgs* a) const {
    const HistLayout l = HistLayoutFor(n);
    a->chunk = l.chunk;
    a->layout_warps = l.warps;
  }
  // Gaussian-k's device correction lists at most this many keys.
  int GaussKeyLimit() const { return tuning.gaussiank_key_limit; }
  ExactSample PlanExactSample(uint64_t n, uint64_t k) const {
    return internal::PlanExactSample(n, k, tuning.exact_sample_min_n);
  }

  // The gate every kernel the helpers below enqueue gets (GatedScope).
  Gate gate{nullptr, 0};

  // Enqueues gated on (*flag == value) while it lives.
  struct GatedScope {
    SparsifierImpl& m;
    Gate saved;
    GatedScope(SparsifierImpl& impl, const int* flag, int value)
        : m(impl), saved(impl.gate) {
      m.gate = Gate{flag, value};
    }
    ~GatedScope() { m.gate = saved; }
  };

  // --- Enqueue steps (enqueue.cc) ---

  // Inside a gated chain the gate itself (the state's gk_exact) survives.
  // dgc: also zeroes the trim histograms and takes the step's seed.
  InitArgs InitFor(ull need, bool zero_hist0, bool keep_sums,
                   bool keep_candidates, bool dgc = false) const;
  KernelStatus Init(ull need, bool zero_hist0, bool keep_sums,
                    bool keep_candidates, cudaStream_t stream,
                    bool dgc = false);
  // keep_candidates: also keeps the candidates of a predicted bin, as the
  // fused update does (Gaussian-k's own pass; HistArgs::keep_candidates).
  KernelStatus Histogram(const float* u, uint64_t n, cudaStream_t stream,
                         Then then = {}, bool keep_candidates = false);
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
                       GaussRole role = GaussRole::kNone);
  // next_hist: the histogram of the exact plan's next undecided digit.
  // route kGatherDgc: to the output when accepted, else to the candidates
  // when trimming, with the trim histograms (to_output is ignored).
  KernelStatus Gather(float* u, bool to_output, bool zero, bool next_hist,
                      cudaStream_t stream, GatherRoute route = kGatherAlways,
                      Then then = {});
  // Stable compaction of the candidate arrays (or of u itself, when the
  // exact plan says from_u) by FinalRule into out_*, on `blocks` blocks.
  KernelStatus Final(FinalRule rule, float* u, uint64_t n, bool zero,
                     int blocks, cudaStream_t stream);
  // Exact top-k of the candidate arrays (M = state's num_candidates >= k,
  // containing the top-k of u) by a three-digit radix select over them.
  // M is known on the device only: every pass runs on the grid for M = n.
  KernelStatus CandidateExact(float* u, uint64_t n, uint64_t k, bool zero,
                              cudaStream_t stream);
  // Exact top-k of u; reuse_hist0: hist0 already holds u's digit-0 counts
  // (enqueue.cc says how the plan is decided on the device).
  KernelStatus ExactFromU(float* u, uint64_t n, uint64_t k, bool zero,
                          bool reuse_hist0, cudaStream_t stream,
                          bool update_candidates = false);
  // The candidates the first pass of an n residual keeps (the fused
  // update's, or Gaussian-k's own histogram pass's: HistLayoutFor's
  // chunks): sets update_layout, which GatherKernel reads when a
  // selection takes them, and returns what the deciding kernel needs.
  UpdateCandidates UseUpdateCandidates(uint64_t n);
  KernelStatus Decide(int level, ull cap, cudaStream_t stream, InitArgs init,
                      UpdateCandidates uc = {});
  // Copies the state to the host and waits for it.
  KernelStatus ReadState(cudaStream_t stream, DeviceState* state);
  static uint64_t OutBytes(uint64_t pairs) {
    return kOutHeader + pairs * (sizeof(uint32_t) + sizeof(float));
  }
  KernelStatus EnsurePinned(uint64_t count, cudaStream_t stream);
  // The selection writes at most `slots` pairs: the layout of `out` (and
  // of the copy) for the kernels enqueued from here on.
  void BeginOutput(uint64_t slots) { out_stride = slots; }
  // Enqueues the one copy of the state and the first `count` (<= the
  // slots) output pairs.
  KernelStatus CopyOut(uint64_t count, cudaStream_t stream);
  // The exact top-k of u from the sample `plan` (under the caller's gate):
  // the sample's bound, the compaction at it, the gather (exactly k
  // survivors: the output) and the trim (more: their exact top-k); when
  // from_u_predicted, the plan over u gated on state's exact_from_u (the
  // bound kept fewer than k or more than n/8). Sets sampled_enqueued and
  // from_u_enqueued.
  KernelStatus SampledExact(float* u, uint64_t n, uint64_t k, bool zero,
                            uint64_t runs, uint64_t rank, bool from_u_predicted,
                            cudaStream_t stream);
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
  KernelStatus TieWrite(float* u, uint64_t n, bool zero, cudaStream_t stream);
  // After SampleThreshold (dgc's, the exact top-k's): the compaction at
  // the sample's key with the decision `scan` (accept, trim, tie write, or
  // the plan over u), then every follow-up the device may pick, each gated
  // on its verdict: the tie write, the gather (accepted: to the output;
  // trimmed: to the candidates) and the trim's kernels on a grid for
  // `expected` survivors.
  KernelStatus CompactAtSample(float* u, uint64_t n, bool zero,
                               const CollectScan& scan, uint64_t expected,
                               cudaStream_t stream);

  // --- The methods (select_*.cc) ---

  // Enqueues the selection (Select's work after validation).
  KernelStatus Enqueue(float* u, uint64_t n, const SelectParams& p, bool reuse,
                       cudaStream_t stream);
  // Enqueue through the graph cache (see Sparsifier::set_use_graphs).
  KernelStatus EnqueueWithGraph(float* u, uint64_t n, const SelectParams& p,
                                bool reuse, cudaStream_t stream);
  GraphKey GraphKeyFor(const float* u, uint64_t n, const SelectParams& p,
                       bool reuse) const;
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
  // The rest of a selection whose count the device did not accept, from the
  // state `s` read after the fast path (u = pending_u, p = pending_params).
  KernelStatus ContinueGaussianK(const DeviceState& s, cudaStream_t stream);
  KernelStatus ContinueDgc(const DeviceState& s, cudaStream_t stream);
  KernelStatus ContinueExact(cudaStream_t stream);

  // --- Wait's steps (wait.cc) ---

  // The one-block path's outcome from the state.
  KernelStatus FinishTiny(const DeviceState& s);
  // The fast path's outcome, or the host continuation (which updates s).
  KernelStatus FinishContinuation(Continuation continuation, DeviceState* s,
                                  bool* ran_sampled, cudaStream_t stream);
  // An exact top-k from a sample ran (exact's, or gaussiank's gated
  // fallback): its outcome, or the plan over u after it (updates s).
  KernelStatus FinishSampled(bool gauss, DeviceState* s, cudaStream_t stream);
  // The error a failed selection reports (INVALID_ARGUMENT for a non-finite
  // u, with its first position), or OK.
  KernelStatus CheckErrors(const DeviceState& s, cudaStream_t stream);
  // The first non-finite position of the pending u, for the message.
  KernelStatus NonFiniteError(cudaStream_t stream);
  // The selection's SelectInfo from the state and what Wait did.
  void FinishInfo(const DeviceState& s);
};

}  // namespace internal
}  // namespace cuda
}  // namespace gtopk

#endif  // GTOPK_COMMON_CUDA_SPARSIFY_SPARSIFIER_IMPL_H_
