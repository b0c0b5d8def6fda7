// GPU sparsification core: the fused residual update and the exact,
// Gaussian-k and DGC selectors on device memory. Host-only header without
// Abseil (see cuda_status.h); common/cuda/cuda_selector.h adapts it to the
// Selector interface of common/selector.h.
//
// How the selectors work on the device (the algorithms, the passes over u
// each needs on which data, what SelectInfo reports) is in
// docs/gpu-selection.md; the sources are in common/cuda/sparsify/.
//
// Output: (index, value) pairs sorted by index, values copied bit-exactly,
// only those pairs copied to the host, into pinned buffers, asynchronously on
// the caller's stream; optionally the selected residual entries are set to
// +0.0 on the device (what ErrorFeedback::MarkSent does for a lossless codec).
#ifndef GTOPK_COMMON_CUDA_SPARSIFY_H_
#define GTOPK_COMMON_CUDA_SPARSIFY_H_

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>

#include "common/cuda/cuda_status.h"

namespace gtopk {
namespace cuda {

enum class Method { kExact, kGaussianK, kDgc };

struct SparsifierTuning;  // common/cuda/sparsify/testing.h

// "exact", "gaussiank", "dgc".
const char* MethodName(Method method);

// The worker-side update of common/optimizer.h (OptimizerRule::
// AccumulateLocal), same float operations in the same order (the .cu is
// built with --fmad=false):
//   g = grad + weight_decay * params
//   momentum_correction: v = momentum * velocity + g;  residual += lr * v
//   otherwise:           residual += lr * g
struct UpdateParams {
  float lr = 0.1f;                  // this step's learning rate, > 0
  float momentum = 0.9f;            // in [0, 1); used with momentum_correction
  float weight_decay = 0.0f;        // >= 0
  bool momentum_correction = true;  // DGC momentum correction
};

struct SelectParams {
  Method method = Method::kExact;
  uint64_t k = 1;                     // target count, 1 <= k <= n
  uint64_t step = 0;                  // training step (dgc's sample stream)
  uint64_t seed = 0;                  // dgc's seed
  double dgc_sample_fraction = 0.01;  // in [0.01, 1]
  int gaussiank_max_adjustments = 4;  // in [1, 16]
  // Set u[i] = +0.0 on the device for every selected i.
  bool zero_selected = true;
};

// Smallest and largest count each method returns for k (the CPU selectors'
// contracts: exact k; gaussiank [ceil(2k/3), floor(4k/3)], k when that range
// is empty; dgc [1, k]).
uint64_t MinCount(Method method, uint64_t k);
uint64_t MaxCount(Method method, uint64_t k);

// What the last selection did (valid after Wait).
struct SelectInfo {
  uint64_t count = 0;  // pairs selected
  // Entries kept by the compaction pass over u (dgc: its survivors, also
  // when it then took the exact top-k from u).
  uint64_t candidates = 0;
  int adjustments = 0;  // gaussiank threshold adjustments
  // gaussiank: the rule ended out of range and took the exact top-k; dgc:
  // the exact top-k of u (more than n/8 survivors, or a sample as large as
  // the input), not the trim among the survivors (trimmed_on_device);
  // exact: the sampled bound kept fewer than k or more than n/8 keys and
  // the plan over u ran instead (exact_digit_passes says how).
  bool fell_back = false;
  bool used_update_histogram =
      false;  // the first histogram came from Accumulate
  // exact (and gaussiank's exact fallback, with fell_back): the selection
  // is the exact top-k among the keys >= a sampled lower bound (one
  // compaction pass over u and no histogram pass; the candidates are
  // those survivors), accepted when exactly k survived, else trimmed on
  // the device (trimmed_on_device); or, when much of u ties at the bound,
  // the keys above it (candidates, fewer than k) and the first ties in
  // index order, written by a second pass over u (exact_final_from_u).
  bool exact_sampled = false;
  // gaussiank/dgc, and exact when it started from a sample: the selection
  // ran without a host round trip: the device accepted the compaction's
  // count (in [MinCount, MaxCount]), corrected it (gaussiank), or ran the
  // gated exact top-k (gaussiank after a selection that fell back, dgc and
  // exact after one that took it from u), or trimmed it (dgc, exact);
  // otherwise Wait finished it (more passes, host synchronisations).
  bool fast_path = false;
  // gaussiank: the first threshold's count was out of range and the device
  // adjusted it (adjustments says how often) and compacted once more at the
  // adjusted threshold, still without a host round trip (fast_path).
  bool corrected_on_device = false;
  // dgc (exact_sampled: exact): more than k (at most n/8) survived the
  // sampled threshold and the device trimmed them to the exact top-k among
  // them (fast_path).
  bool trimmed_on_device = false;
  // The exact top-k's plan over u (exact, and the exact fallback of
  // gaussiank/dgc when it ran from u; 0/false otherwise): the histogram
  // passes over u that decided a digit of the k-th key (1 to 3; 1 on
  // normal data, more when the keys near the k-th share their high bits),
  // and whether the final compaction read u itself (most of u ties with or
  // shares the k-th key's digits) instead of a candidate copy.
  int exact_digit_passes = 0;
  bool exact_final_from_u = false;
  // exact after Accumulate (used_update_histogram): the candidates came
  // from the fused update's own compaction, which kept the keys from a key
  // predicted by the previous such selection (same n): the start of the
  // digit-0 bin below its k-th key (1/8 to 2/8 of a binade under it), or
  // that key's own bin when the bin below would have made more than n/32
  // keys, or, when that bin alone held more than n/32 keys, a finer key
  // under the k-th that kept at most min(4k, n/32); so no pass over u ran
  // at all. Or, with exact_final_from_u, the previous k-th key K with its
  // ties (more than min(4k, n/32) keys equal K): the update kept the keys
  // > K (`candidates`, fewer than k) and counted the ties, K was the k-th
  // key again, and one write read u up to the last tie it took. False on
  // the first step, on a step whose k-th key fell under that key or whose
  // kept keys exceed n/8, after a selection with more than min(4k, n/32)
  // keys above its k-th key (nothing is predicted then), and when the
  // selection ran as one block.
  // gaussiank (after Accumulate, or from its own histogram pass): its
  // first compaction read the same kind of candidates instead of u (the
  // bin predicted from the previous selection's stop key, same n; its stop
  // key and every key listed for the correction lie in kept bins); a
  // correction may still compact u. When the rule fell back (fell_back),
  // whether its exact top-k took them as exact's after Accumulate does
  // (predicted by the last fallback's plan; not when the rule's own
  // compaction wrote over them).
  bool candidates_from_update = false;
  // exact after Accumulate: the last such selection of this n needed more
  // than one pass over u for its plan (its k-th key's digit-0 bin held more
  // than n/8 keys) and either predicted nothing (more than min(4k, n/32)
  // keys above its k-th key) or had not used the candidates it had
  // predicted (they missed the k-th key), so this one started from a
  // sample instead (exact_sampled, or fell_back when the
  // sample missed and the plan over u followed; used_update_histogram
  // false): one pass over u on any data. Every 8th such selection runs the
  // plan again, to notice when the data changed; so does the next one
  // after a miss whose plan needed one digit pass.
  bool sampled_after_update = false;
  // n <= 4096: the whole selection ran as one kernel of one block (u's keys
  // in shared memory; the same rules, on exact counts), one launch and one
  // copy (fast_path; a histogram from Accumulate is not used).
  bool one_block = false;
  // Select enqueued a replay of the CUDA graph it captured for the same
  // (method, u, n, k, zeroing, histogram reuse) earlier: one launch
  // instead of a dozen (see Sparsifier::set_use_graphs).
  bool graph_replay = false;
};

// The selected pairs in pinned host memory, sorted by index; valid until the
// next Select on the same Sparsifier.
struct SelectedPairs {
  const uint32_t* indices = nullptr;
  const float* values = nullptr;
  uint64_t count = 0;
  SelectInfo info;
};

// Owns the device scratch of one selector (20 bytes per entry of capacity
// plus about 1 MiB) and the pinned output buffers.
//
// Errors: CUDA failures are INTERNAL with file:line and CUDA's error name
// (RESOURCE_EXHAUSTED for out of memory). A non-sticky error an unrelated
// earlier runtime call left in CUDA's last-error state is discarded on entry
// to Accumulate/Select/Wait (it is not theirs); a sticky one (a device
// fault) fails every call, as it does CUDA's. After an INTERNAL error the
// residual may hold a partial update (the worker keeps its previous
// residual until a step succeeds).
//
// Thread-safety: none; one instance per stream/thread. Calls are ordered:
// [Accumulate] -> Select -> Wait -> [Accumulate] -> Select -> Wait ...
// All pointers are device pointers on the current device unless named host.
class Sparsifier {
 public:
  // Allocates scratch for inputs of up to `capacity` entries
  // (1 <= capacity <= 2^32). INVALID_ARGUMENT for a bad capacity,
  // RESOURCE_EXHAUSTED when device memory runs out, INTERNAL for other CUDA
  // errors (no device, ...).
  static KernelStatus Create(uint64_t capacity,
                             std::unique_ptr<Sparsifier>* out);
  // The same with test hooks (common/cuda/sparsify/testing.h), fixed for
  // the Sparsifier's life (SetTuningForTesting replaces them).
  static KernelStatus Create(uint64_t capacity, const SparsifierTuning& tuning,
                             std::unique_ptr<Sparsifier>* out);

  ~Sparsifier();
  Sparsifier(const Sparsifier&) = delete;
  Sparsifier& operator=(const Sparsifier&) = delete;

  uint64_t capacity() const;

  // Fused residual update (see UpdateParams) that also builds the first
  // radix histogram and the sums of u = residual_out, so that a following
  // Select(residual_out, n, ...) starts without reading u again.
  //   grad, params: length n (params may be null when weight_decay == 0:
  //   then g = grad + 0.0f); velocity_in/out: length n, used with
  //   momentum_correction (may alias each other); residual_in/out: length n
  //   (may alias). Non-aliased outputs let a caller commit atomically (keep
  //   the inputs on error).
  // After an exact Select that reused the previous update's histogram on
  // the same n, the update also keeps, in index order, the entries whose
  // |u| lies at or above a key that selection predicted under its k-th key
  // (the start of the digit-0 bin below it, 1/8 to 2/8 of a binade under;
  // a finer key when that bin is crowded; at most n/32 of them when it was
  // predicted): the exact Select after it then needs no pass over u when
  // at least k and at most n/8 are kept (SelectInfo::candidates_from_update;
  // with a bin's margin a drop of the k-th magnitude by less than about
  // 8 % per step always is). When that selection predicted its k-th key K
  // with its ties, the update keeps the keys > K and counts those == K per
  // chunk (a variant of the kernel that spills a few bytes, launched only
  // then). Its cost: the index writes, and a register-heavier kernel (48
  // registers instead of 40: 5 blocks per SM instead of 6).
  // Asynchronous on `stream`. A non-finite u (from a non-finite gradient or
  // an overflow) is reported by the next Select's Wait. INVALID_ARGUMENT for
  // n == 0, n > capacity or bad params; INTERNAL for a CUDA error.
  KernelStatus Accumulate(const float* grad, const float* params,
                          const float* velocity_in, float* velocity_out,
                          const float* residual_in, float* residual_out,
                          uint64_t n, const UpdateParams& params_update,
                          cudaStream_t stream);

  // Enqueues the selection of about k entries of u (length n) on `stream`
  // and the asynchronous copy of the selected pairs to pinned host memory.
  // Never blocks the host: exact and the fast paths of gaussiank/dgc are
  // enqueued whole (those copy all min(MaxCount, n) possible pairs, since their
  // count is data-dependent); their other paths run in Wait. Call Wait
  // before reading the result or calling Select again.
  // Reuses Accumulate's histogram when u == its residual_out and n matches
  // and no Select ran since (u must not have been modified in between).
  // INVALID_ARGUMENT for n == 0, n > capacity, k == 0, k > n or bad params
  // (nothing enqueued); INTERNAL for a CUDA error.
  KernelStatus Select(float* u, uint64_t n, const SelectParams& params,
                      cudaStream_t stream);

  // CUDA graphs (on by default): Select on a stream other than the legacy
  // default one captures what it enqueues into a graph the first time it
  // sees a (method, u, n, k, zero_selected, histogram reuse,
  // gaussiank_max_adjustments, dgc_sample_fraction) and replays that graph
  // after (SelectInfo::graph_replay): the selection is a chain of a dozen
  // small kernels whose launch gaps dominate on small tensors. dgc's
  // per-step sample seed reaches the graph through a pinned host value
  // that the graph copies to the device when it runs. Up to 8 graphs are
  // kept (least recently used dropped); growing the pinned output buffers
  // drops them all. A capture the runtime refuses turns graphs off for
  // this Sparsifier and the selection is enqueued directly. Not
  // thread-safe; call between a Wait and the next Select.
  void set_use_graphs(bool use);

  // Waits for the last Select (synchronizes `stream`) and returns its pairs;
  // finishes a gaussiank/dgc selection the device did not accept (more
  // work on `stream`, more synchronizations).
  // INVALID_ARGUMENT when u held a NaN/Inf ("selector input has a
  // non-finite value (<v>) at position <i>", the first position; nothing was
  // zeroed then); FAILED_PRECONDITION without a pending Select; INTERNAL
  // for a CUDA error or a broken internal invariant.
  KernelStatus Wait(cudaStream_t stream, SelectedPairs* out);

  // Device copies of the last selection's indices/values (count =
  // SelectedPairs::count), valid until the next Select; for device-side
  // consumers such as the worker's residual and momentum updates.
  const uint32_t* device_indices() const;
  const float* device_values() const;

 private:
  friend void SetTuningForTesting(Sparsifier* sparsifier,
                                  const SparsifierTuning& tuning);
  struct Impl;
  explicit Sparsifier(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// Sparse updates of dense device vectors, for the worker's device step
// (worker/device_step.cc): the (index, value) lists come from host memory
// (the selection and the pulled global top-k are on the host anyway; only
// they cross), the dense vectors never leave the device. Indices must be
// unique and < n (the caller validates them; the kernels skip others).
// Float operations are the CPU rule's (common/optimizer.cc), one each, so
// device and host replicas stay bit-identical. Asynchronous on `stream`;
// host arrays may be reused when a call returns. Not thread-safe.
class SparseUpdater {
 public:
  // dst[idx[j]] = val[j].
  KernelStatus Set(float* dst, uint64_t n, const uint32_t* idx,
                   const float* val, uint64_t count, cudaStream_t stream);
  // dst[idx[j]] = dst[idx[j]] - val[j].
  KernelStatus Subtract(float* dst, uint64_t n, const uint32_t* idx,
                        const float* val, uint64_t count, cudaStream_t stream);
  // Global momentum (MomentumMode::kGlobal) over all n entries, with
  // update_i = val[j] at i = idx[j] and +0.0 elsewhere:
  //   v = momentum * velocity[i] + update_i;  velocity[i] = v;  params[i] -= v
  KernelStatus GlobalMomentum(float* params, float* velocity, uint64_t n,
                              float momentum, const uint32_t* idx,
                              const float* val, uint64_t count,
                              cudaStream_t stream);

 private:
  KernelStatus Upload(const uint32_t* idx, const float* val, uint64_t count,
                      cudaStream_t stream);
  // Set (subtract = 0) or Subtract (1): upload, then one scatter kernel.
  KernelStatus Scatter(float* dst, uint64_t n, const uint32_t* idx,
                       const float* val, uint64_t count, int subtract,
                       cudaStream_t stream);
  DeviceBuffer<uint32_t> idx_;
  DeviceBuffer<float> val_;
  DeviceBuffer<float> dense_;  // GlobalMomentum's update vector
};

// Number of CUDA devices (0 when the driver or a device is missing; never
// an error), for tests and tools that skip without a GPU.
int DeviceCount();

}  // namespace cuda
}  // namespace gtopk

#endif  // GTOPK_COMMON_CUDA_SPARSIFY_H_
