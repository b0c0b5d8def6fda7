// Enqueueing a selection, directly or through the cache of captured CUDA
// graphs (Sparsifier::set_use_graphs; graph_cache.h).
#include <string>

#include "common/cuda/sparsify/sparsifier_impl.h"

namespace gtopk {
namespace cuda {
namespace internal {

HostSnapshot SparsifierImpl::Snapshot() const {
  HostSnapshot s;
  s.info = info;
  s.check_selected = check_selected;
  s.continuation = continuation;
  s.exact_enqueued = exact_enqueued;
  s.sampled_enqueued = sampled_enqueued;
  s.from_u_enqueued = from_u_enqueued;
  s.tiny_enqueued = tiny_enqueued;
  s.pending_count = pending_count;
  s.out_stride = out_stride;
  s.collect = collect;
  s.update_layout = update_layout;
  return s;
}

void SparsifierImpl::Restore(const HostSnapshot& s) {
  check_selected = s.check_selected;
  continuation = s.continuation;
  exact_enqueued = s.exact_enqueued;
  sampled_enqueued = s.sampled_enqueued;
  from_u_enqueued = s.from_u_enqueued;
  tiny_enqueued = s.tiny_enqueued;
  pending_count = s.pending_count;
  out_stride = s.out_stride;
  collect = s.collect;
  update_layout = s.update_layout;
}

KernelStatus SparsifierImpl::Enqueue(float* u, uint64_t n,
                                     const SelectParams& p, bool reuse,
                                     cudaStream_t stream) {
  // Set again by the paths that read the update's candidates.
  update_layout = UpdateLayout{};
  if (n <= tuning.one_block_max_n) return SelectTiny(u, n, p, stream);
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

GraphKey SparsifierImpl::GraphKeyFor(const float* u, uint64_t n,
                                     const SelectParams& p, bool reuse) const {
  const SelectionHistory& h = history;
  return GraphKey{
      static_cast<int>(p.method), u, n, p.k, p.zero_selected, reuse,
      p.gaussiank_max_adjustments, p.dgc_sample_fraction,
      p.method == Method::kGaussianK ? h.expect_exact
      : p.method == Method::kDgc     ? h.dgc_expect_exact
                                     : false,
      p.method == Method::kGaussianK ? h.gauss_expect_from_u
      : p.method == Method::kExact   ? h.exact_expect_from_u
                                     : false,
      tuning.exact_sample_min_n, tuning.one_block_max_n,
      clear_update_prediction,
      // (Without a sample both branches enqueue the same.)
      p.method == Method::kGaussianK && h.expect_exact &&
          h.GaussFallbackFromUpdate(n) && PlanExactSample(n, p.k).runs != 0,
      p.method == Method::kGaussianK && !reuse && h.ties_predicted_n == n};
}

KernelStatus SparsifierImpl::EnqueueWithGraph(float* u, uint64_t n,
                                              const SelectParams& p, bool reuse,
                                              cudaStream_t stream) {
  const GraphKey key = GraphKeyFor(u, n, p, reuse);
  if (auto* g = graphs.Find(key)) {
    GTOPK_CUDA_CALL_OR_RETURN(cudaGraphLaunch(g->exec, stream));
    graphs.Touch(g);
    // What Select decided for this selection, not the captured one's.
    const bool used_update_histogram = info.used_update_histogram;
    const bool sampled_after_update = info.sampled_after_update;
    info = g->snapshot.info;
    info.used_update_histogram = used_update_histogram;
    info.sampled_after_update = sampled_after_update;
    info.graph_replay = true;
    Restore(g->snapshot);
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
  graphs.Insert(key, exec, Snapshot());
  GTOPK_CUDA_CALL_OR_RETURN(cudaGraphLaunch(exec, stream));
  return KernelStatus::Ok();
}

}  // namespace internal
}  // namespace cuda
}  // namespace gtopk
