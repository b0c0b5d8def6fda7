// The device half of WorkerClient's device-memory Step (worker/client.h):
// the worker's residual and momentum state in CUDA device memory, and the
// step's phases that touch it (Shi et al., arXiv:1901.04359, with the
// selection near one pass over memory as arXiv:2209.08497 asks; momentum
// correction and masking from DGC, arXiv:1712.01887). The pushes, pulls and
// their decoding are the host Step's (worker/client_step.cc); this class only
// runs what happens on the GPU before and after them.
//
// Per step, on `stream`:
//   Accumulate: u = residual + lr*(m*v + g + wd*p) into the other buffer of
//     a residual/velocity pair (the old one is kept until the step commits,
//     so a non-finite gradient leaves the state unchanged), with the first
//     radix histogram of |u|;
//   Select on u (reusing that histogram; under --selection=layerwise the
//     selector runs on each bucket piece's range with its own k instead,
//     common/buckets.h), selected u_i set to +0.0 on the
//     device, pairs to the host; codec rounding and MarkSent's u_i - recv_i
//     on the host, scattered back when lossy; this commits the step's state;
//   the push/pull round, on the host; then Apply: put-back (sent \ global
//     gets PutBackSum(u_i - recv_i, recv_i), computed on the host from
//     values it already has), momentum factor masking and the parameter
//     update as sparse scatters (or the dense global-momentum kernel); or,
//     when the round failed, PutBackAll.
// An overlapped step (WorkerClient::BeginOverlappedStep with device
// pointers) runs Accumulate and the selection piece by piece on a side
// stream as the caller's backward pass produces the gradient
// (BeginOverlap, MarkReady, AccumulateAndSelect), then Commit in place of
// the end of Select; the rest is the same.
//
// This header needs no CUDA: it is the same in every build, so WorkerClient,
// which holds a DeviceStep, has one layout whatever GTOPK_HAVE_CUDA is. The
// implementation is worker/device_step.cc (built with CUDA or the CUDA
// emulator); in a build without CUDA, worker/device_step_none.cc's Create
// and RunOnHostCopies return FAILED_PRECONDITION, so no DeviceStep exists.
#ifndef GTOPK_WORKER_DEVICE_STEP_H_
#define GTOPK_WORKER_DEVICE_STEP_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "common/buckets.h"
#include "common/codec.h"
#include "common/optimizer.h"
#include "common/sparse_vector.h"

// CUDA's stream handle: cudaStream_t is CUstream_st* in <cuda_runtime_api.h>
// (and in the CUDA emulator's), so a cudaStream_t converts to it and this
// header needs no CUDA.
struct CUstream_st;

namespace gtopk {
namespace worker {

// One worker's device state and the device phases of its steps.
//
// All float pointers are CUDA device pointers of n floats on the current
// device; `stream` orders every call's work, and each call returns after it
// synchronized `stream` (except Accumulate, which leaves its work queued for
// Select). Not thread-safe: one step at a time, as WorkerClient.
//
// Errors: CUDA errors are INTERNAL, or RESOURCE_EXHAUSTED for out-of-memory,
// with the file:line of the failing call (common/cuda/cuda_status.h).
class DeviceStep {
 public:
  // What Select took out of u, on the host; what the rest of the step needs
  // to push, put back and mask. All three have one entry per selected pair.
  struct Sent {
    // The selected pairs (indices ascending, unique, < n; values u_i):
    // what the pushes encode.
    SparseVector sent;
    // `sent` with its values rounded as the value codec will
    // (QuantizeValues): what the servers receive.
    SparseVector received;
    // u_i - received_i: what MarkSent leaves in the residual (the device
    // holds it since Select).
    std::vector<float> marked;
  };

  // Moves a worker's host state to the device (first device Step):
  // allocates the residual/velocity pairs (velocity: DGC momentum only) and
  // the global velocity (MomentumMode::kGlobal only), copies `residual`,
  // `velocity` and `global_velocity` (each length n, host memory) up, and
  // creates the GPU selector `selector` with `selector_seed`. Blocks until
  // the copies are done.
  // Errors: FAILED_PRECONDITION "Step (device): selector "<name>" has no GPU
  // version or the GPU is unusable: ..." (or "... built without CUDA" in a
  // build without it); CUDA errors.
  static absl::StatusOr<std::unique_ptr<DeviceStep>> Create(
      absl::string_view selector, uint64_t selector_seed,
      const OptimizerOptions& optimizer, uint64_t n,
      absl::Span<const float> residual, absl::Span<const float> velocity,
      absl::Span<const float> global_velocity, CUstream_st* stream);

  // Dense mode on device buffers (it sends u itself, so u has to reach the
  // host): copies `gradient` and `params` (device, n floats) to host
  // buffers, runs `host_step` on them, and when it succeeded copies the
  // updated params back. Blocks. Returns host_step's error unchanged
  // (params untouched then), or a CUDA error; FAILED_PRECONDITION in a
  // build without CUDA.
  static absl::Status RunOnHostCopies(
      const float* gradient, float* params, uint64_t n, CUstream_st* stream,
      absl::FunctionRef<absl::Status(absl::Span<const float> gradient,
                                     absl::Span<float> params)>
          host_step);

  virtual ~DeviceStep() = default;

  // u = residual + lr * (...) (sparsify.h's fused update; lr is the step's,
  // OptimizerRule::LrAt) into the spare buffers; nothing is committed, so
  // a failure here or in Select leaves the state as before. Asynchronous.
  virtual absl::Status Accumulate(const float* gradient, const float* params,
                                  float lr, CUstream_st* stream) = 0;

  // One selection of Select: the top `k` of u[begin, begin + size).
  struct Range {
    uint64_t begin = 0;
    uint64_t size = 0;
    uint64_t k = 0;  // 0: nothing selected; the range is only checked finite
  };

  // The local selection of u, the codec rounding and MarkSent; commits
  // u - received as the residual (and the new velocity). Blocks.
  //   ranges  ascending, disjoint, inside [0, n), non-empty: the whole
  //           vector is {{0, n, k}} (the selector then reuses Accumulate's
  //           histogram); layer-wise selection passes one range per bucket
  //           piece with its PieceK. Each range with k > 0 gets the
  //           selector's top k of its values (k pairs or the selector's
  //           count contract; `step` and the selector's seed as for the
  //           whole vector), its indices offset by `begin`, so the pairs
  //           are ascending over all ranges. A range with k = 0 is copied
  //           to the host and checked finite (such a piece holds fewer than
  //           n / (2k) values). Values outside every range are neither
  //           selected nor checked.
  // Errors: INVALID_ARGUMENT "Step (device): the gradient (or residual +
  // lr * gradient) is not finite: ..." (naming the range [b, e) when there
  // are several; nothing committed); INVALID_ARGUMENT "MarkSent: u -
  // received overflows at index i" (u is committed as the residual, as the
  // host Step leaves it); INVALID_ARGUMENT for ranges that break the rules
  // above (nothing committed); the selector's other errors.
  virtual absl::StatusOr<Sent> Select(absl::Span<const Range> ranges,
                                      int64_t step, ValueCodec value_codec,
                                      CUstream_st* stream) = 0;

  // Overlapped device steps (WorkerClient::BeginOverlappedStep with device
  // pointers): each range (bucket piece) is accumulated and selected on a
  // side stream of this DeviceStep's as soon as the caller's stream has
  // produced its gradient, while the caller's stream goes on; Commit then
  // does what the end of Select does. The result is Accumulate + Select's
  // on the same ranges, bit for bit (the update is elementwise).
  //
  // Makes the side stream (non-blocking) and `slots` events, once per
  // size. Call between steps. Errors: CUDA errors.
  virtual absl::Status BeginOverlap(size_t slots) = 0;
  // Records event `slot` (< BeginOverlap's slots) on the caller's `stream`:
  // the range's gradient is final once the work queued there so far has
  // run. Does not block; may run on another thread than AccumulateAndSelect
  // (never for the same slot at once). Errors: CUDA errors.
  virtual absl::Status MarkReady(size_t slot, CUstream_st* stream) = 0;
  // On the side stream, after event `slot`: Accumulate restricted to
  // `range` (gradient and params: the caller's whole device buffers), then
  // Select's selection of that one range, its pairs appended to *sent with
  // global indices. Nothing is committed. Blocks until the pairs are on
  // the host. One call at a time. Errors: Select's.
  virtual absl::Status AccumulateAndSelect(size_t slot, const Range& range,
                                           const float* gradient,
                                           const float* params, float lr,
                                           int64_t step,
                                           SparseVector* sent) = 0;
  // Commits a selection made by AccumulateAndSelect over ranges covering
  // [0, n): `sent` (indices ascending, every range's pairs) gets the codec
  // rounding and MarkSent, as at the end of Select. Blocks. Errors: the
  // MarkSent error of Select.
  virtual absl::StatusOr<Sent> Commit(SparseVector sent, ValueCodec value_codec,
                                      CUstream_st* stream) = 0;

  // A piece's Range: its begin and size, k = PieceK(k, size, n).
  static Range PieceRange(const BucketPiece& piece, uint64_t k, uint64_t n) {
    return Range{piece.begin, piece.size(), PieceK(k, piece.size(), n)};
  }

  // After a failed round: puts every sent value back (residual_i =
  // PutBackSum(u_i - recv_i, recv_i), ErrorFeedback::PutBack's rule) and
  // returns `status`; INTERNAL naming both when restoring fails. Blocks.
  virtual absl::Status PutBackAll(const Sent& sent, const absl::Status& status,
                                  CUstream_st* stream) = 0;

  // Applies the pulled global top-k `global` (indices ascending, < n;
  // values the sum of the P workers' values): with `put_back` (mode gtopk)
  // the sent values not in `global` return to the residual; momentum factor
  // masking (DGC momentum with masking on) zeroes the velocity at sent ∩
  // global; then params -= global / P, or the global-momentum update. The
  // float operations are the CPU rule's (common/optimizer.cc). Blocks.
  virtual absl::Status Apply(const Sent& sent, const SparseVector& global,
                             bool put_back, uint32_t num_workers, float* params,
                             CUstream_st* stream) = 0;

  // Copies the device residual into `residual` and, with DGC momentum, the
  // device velocity into `velocity` (host, length n each; velocity is left
  // alone otherwise). Blocks.
  virtual absl::Status CopyStateToHost(absl::Span<float> residual,
                                       absl::Span<float> velocity) = 0;
};

}  // namespace worker
}  // namespace gtopk

#endif  // GTOPK_WORKER_DEVICE_STEP_H_
