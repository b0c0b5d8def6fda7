// The enqueue steps of the selector's host driver (sparsifier_impl.h): each
// puts one stage's kernels on the stream, through the stage's launcher,
// under the current gate.
#include <algorithm>
#include <string>

#include "common/cuda/sparsify/host_util.h"
#include "common/cuda/sparsify/launchers.h"
#include "common/cuda/sparsify/sparsifier_impl.h"

namespace gtopk {
namespace cuda {
namespace internal {

InitArgs SparsifierImpl::InitFor(ull need, bool zero_hist0, bool keep_sums,
                                 bool keep_candidates, bool dgc) const {
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

KernelStatus SparsifierImpl::Init(ull need, bool zero_hist0, bool keep_sums,
                                  bool keep_candidates, cudaStream_t stream,
                                  bool dgc) {
  LaunchInit(stream, st,
             InitFor(need, zero_hist0, keep_sums, keep_candidates, dgc), gate);
  GTOPK_CUDA_LAUNCH_CHECK();
  return KernelStatus::Ok();
}

KernelStatus SparsifierImpl::Histogram(const float* u, uint64_t n,
                                       cudaStream_t stream, Then then,
                                       bool keep_candidates) {
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
  LaunchHistogram(/*update=*/false,
                  keep_candidates && history.ties_predicted_n == n,
                  HistLayoutFor(n).blocks, stream, a);
  GTOPK_CUDA_LAUNCH_CHECK();
  return KernelStatus::Ok();
}

KernelStatus SparsifierImpl::Collect(const float* u, uint64_t n,
                                     CollectHist with_hist, bool host_key,
                                     uint32_t key, cudaStream_t stream,
                                     CollectScan scan, GaussRole role) {
  SetCollectLayout(n);
  const int vec = Aligned16(u);
  const bool first = role == GaussRole::kFirst;
  scan.block_offsets = offsets_a.get();
  scan.block_equal = offsets_b.get();
  scan.at_least = first ? hist1 : nullptr;
  LaunchCollect(with_hist, first, collect.blocks, stream, u, n, collect.chunk,
                vec, st, key, host_key, regions.get(), counts_a.get(),
                counts_b.get(), scan.trim ? trim_hists : hist0, gate, scan);
  GTOPK_CUDA_LAUNCH_CHECK();
  return KernelStatus::Ok();
}

KernelStatus SparsifierImpl::Gather(float* u, bool to_output, bool zero,
                                    bool next_hist, cudaStream_t stream,
                                    GatherRoute route, Then then) {
  const bool dgc = route == kGatherDgc;
  LaunchGather(collect.blocks, stream, u, regions.get(), collect.chunk,
               counts_a.get(), offsets_a.get(), collect.warps,
               to_output || dgc ? out_idx() : cand_idx.get(),
               to_output || dgc ? out_val() : cand_val.get(), cand_idx.get(),
               cand_val.get(), zero, st, dgc ? trim_hists : hist0,
               next_hist ? 1 : 0, static_cast<int>(route), gate, then,
               update_layout);
  GTOPK_CUDA_LAUNCH_CHECK();
  return KernelStatus::Ok();
}

KernelStatus SparsifierImpl::Final(FinalRule rule, float* u, uint64_t n,
                                   bool zero, int blocks, cudaStream_t stream) {
  LaunchCountFinal(blocks, stream, cand_val.get(), u, n, st, rule,
                   counts_b.get(), counts_a.get(), offsets_a.get(),
                   offsets_b.get(), hist0, gate);
  GTOPK_CUDA_LAUNCH_CHECK();
  LaunchWriteFinal(blocks, stream, cand_idx.get(), cand_val.get(), n, st, rule,
                   counts_b.get(), counts_a.get(), offsets_a.get(),
                   offsets_b.get(), out_idx(), out_val(), u, zero, gate,
                   uint64_t{0}, nullptr);
  GTOPK_CUDA_LAUNCH_CHECK();
  return KernelStatus::Ok();
}

KernelStatus SparsifierImpl::CandidateExact(float* u, uint64_t n, uint64_t k,
                                            bool zero, cudaStream_t stream) {
  GTOPK_CUDA_RETURN_IF_ERROR(Init(k, /*zero_hist0=*/true, false,
                                  /*keep_candidates=*/true, stream));
  const int blocks = CandidateBlocks(n);
  for (int level = 0; level < 3; ++level) {
    LaunchHistArray(blocks, stream, cand_val.get(), &st->num_candidates, 0, st,
                    hist0, level, gate, Then{kThenFindBin, level, 0});
    GTOPK_CUDA_LAUNCH_CHECK();
  }
  hist_u = nullptr;
  return Final(FinalRule{0, 0}, u, n, zero, blocks, stream);
}

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
KernelStatus SparsifierImpl::ExactFromU(float* u, uint64_t n, uint64_t k,
                                        bool zero, bool reuse_hist0,
                                        cudaStream_t stream,
                                        bool update_candidates) {
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
    GTOPK_CUDA_RETURN_IF_ERROR(
        Decide(0, cap, stream, InitFor(k, false, true, false), uc));
  } else {
    GTOPK_CUDA_RETURN_IF_ERROR(Init(k, true, false, false, stream));
    GTOPK_CUDA_RETURN_IF_ERROR(
        Histogram(u, n, stream, Then{kThenDecide, 0, cap}));
  }
  for (int level = 1; level < 3; ++level) {
    LaunchHistLevel(blocks, stream, u, n, vec, st, hist0, level, gate,
                    Then{kThenDecide, level, cap});
    GTOPK_CUDA_LAUNCH_CHECK();
  }
  CollectScan next;
  next.find_next = 1;
  GTOPK_CUDA_RETURN_IF_ERROR(
      Collect(u, n, kCollectNextDigit, false, 0, stream, next));
  GTOPK_CUDA_RETURN_IF_ERROR(Gather(u, false, false, true, stream,
                                    kGatherAlways, Then{kThenFindNext, 0, 0}));
  if (update_candidates) {
    const int blocks = CandidateBlocks(std::min<uint64_t>(4 * k, n / 8 + 1));
    LaunchHistArray(blocks, stream, cand_val.get(), &st->num_candidates, 0, st,
                    hist0, 2, gate, Then{kThenFindNext, 0, 0});
    GTOPK_CUDA_LAUNCH_CHECK();
  }
  // The final source holds at most n entries (u itself, or candidates).
  GTOPK_CUDA_RETURN_IF_ERROR(
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
    LaunchWriteFinal(hl.warps / kWarpsPerBlock, stream, cand_idx.get(),
                     cand_val.get(), n, st, FinalRule{0, 0}, counts_u.get(),
                     eq_counts_u.get(), offsets_u.get(), eq_offsets_u.get(),
                     out_idx(), out_val(), u, zero, gate, hl.chunk,
                     regions.get());
    GTOPK_CUDA_LAUNCH_CHECK();
  }
  return KernelStatus::Ok();
}

UpdateCandidates SparsifierImpl::UseUpdateCandidates(uint64_t n) {
  const HistLayout hl = HistLayoutFor(n);
  update_layout =
      UpdateLayout{hl.chunk, counts_u.get(), offsets_u.get(), hl.warps};
  return UpdateCandidates{counts_u.get(),    offsets_u.get(),
                          eq_counts_u.get(), eq_offsets_u.get(),
                          hl.warps,          n,
                          PredictCap(n)};
}

KernelStatus SparsifierImpl::Decide(int level, ull cap, cudaStream_t stream,
                                    InitArgs init, UpdateCandidates uc) {
  LaunchFindBinDecide(stream, st, hist0, level, cap, gate, init, uc);
  GTOPK_CUDA_LAUNCH_CHECK();
  return KernelStatus::Ok();
}

KernelStatus SparsifierImpl::ReadState(cudaStream_t stream,
                                       DeviceState* state) {
  GTOPK_CUDA_CALL_OR_RETURN(cudaMemcpyAsync(
      host_state(), st, sizeof(DeviceState), cudaMemcpyDeviceToHost, stream));
  GTOPK_CUDA_CALL_OR_RETURN(cudaStreamSynchronize(stream));
  *state = *host_state();
  return KernelStatus::Ok();
}

KernelStatus SparsifierImpl::EnsurePinned(uint64_t count, cudaStream_t stream) {
  if (host_out.size() >= OutBytes(count)) return KernelStatus::Ok();
  GTOPK_CUDA_CALL_OR_RETURN(cudaStreamSynchronize(stream));
  graphs.Clear();  // their copies target the buffer being replaced
  const uint64_t pairs =
      host_out.size() > kOutHeader ? (host_out.size() - kOutHeader) / 8 : 0;
  const uint64_t size = OutBytes(std::max<uint64_t>(count, 2 * pairs));
  GTOPK_CUDA_RETURN_IF_ERROR(host_out.Allocate(size));
  return KernelStatus::Ok();
}

KernelStatus SparsifierImpl::CopyOut(uint64_t count, cudaStream_t stream) {
  if (count > out_stride) {
    return KernelStatus::Error(
        KernelStatusCode::kInternal,
        "CopyOut: " + std::to_string(count) + " pairs exceed the " +
            std::to_string(out_stride) + " output slots");
  }
  const uint64_t bytes =
      kOutHeader + out_stride * sizeof(uint32_t) + count * sizeof(float);
  GTOPK_CUDA_CALL_OR_RETURN(cudaMemcpyAsync(host_out.get(), out.get(), bytes,
                                            cudaMemcpyDeviceToHost, stream));
  pending_count = count;
  return KernelStatus::Ok();
}

KernelStatus SparsifierImpl::TieWrite(float* u, uint64_t n, bool zero,
                                      cudaStream_t stream) {
  GatedScope tie(*this, &st->tie_write, 1);
  LaunchWriteFinal(collect.blocks, stream, cand_idx.get(), cand_val.get(), n,
                   st, FinalRule{0, 0}, counts_a.get(), counts_b.get(),
                   offsets_a.get(), offsets_b.get(), out_idx(), out_val(), u,
                   zero, gate, collect.chunk, nullptr);
  GTOPK_CUDA_LAUNCH_CHECK();
  return KernelStatus::Ok();
}

KernelStatus SparsifierImpl::CompactAtSample(float* u, uint64_t n, bool zero,
                                             const CollectScan& scan,
                                             uint64_t expected,
                                             cudaStream_t stream) {
  GTOPK_CUDA_RETURN_IF_ERROR(
      Collect(u, n, kCollectDigit0, false, 0, stream, scan));
  GTOPK_CUDA_RETURN_IF_ERROR(TieWrite(u, n, zero, stream));
  GTOPK_CUDA_RETURN_IF_ERROR(Gather(u, true, zero, /*next_hist=*/true, stream,
                                    kGatherDgc, Then{kThenFindNext, 0, 0}));
  return TrimRest(u, n, zero, expected, stream);
}

KernelStatus SparsifierImpl::SampleThreshold(const float* u, uint64_t n,
                                             uint64_t runs, uint64_t rank,
                                             ull limit, cudaStream_t stream) {
  const uint64_t sample_size = runs * 16;
  GTOPK_CUDA_RETURN_IF_ERROR(Init(rank, true, false, false, stream,
                                  /*dgc=*/true));
  hist_u = nullptr;
  // The sample's keys live in cand_idx until the compaction that follows.
  const int sample_blocks = CandidateBlocks(sample_size);
  LaunchSample(sample_blocks, stream, u, n, runs, cand_idx.get(), hist0, st,
               gate, Then{kThenFindBin, 0, 0});
  GTOPK_CUDA_LAUNCH_CHECK();
  for (int level = 1; level < 3; ++level) {
    LaunchHistArray(sample_blocks, stream,
                    static_cast<const uint32_t*>(cand_idx.get()), nullptr,
                    sample_size, st, hist0, level, gate,
                    Then{kThenFindBin, level, level == 2 ? limit : 0});
    GTOPK_CUDA_LAUNCH_CHECK();
  }
  return KernelStatus::Ok();
}

KernelStatus SparsifierImpl::TrimRest(float* u, uint64_t n, bool zero,
                                      uint64_t expected, cudaStream_t stream) {
  GatedScope trimming(*this, &st->trim, 1);
  const int blocks = CandidateBlocks(std::min<uint64_t>(expected, n / 8 + 1));
  LaunchHistArray(blocks, stream, cand_val.get(), &st->num_candidates, 0, st,
                  trim_hists, 2, gate, Then{kThenFindBin, 2, 0});
  GTOPK_CUDA_LAUNCH_CHECK();
  return Final(FinalRule{0, 0}, u, n, zero, blocks, stream);
}

KernelStatus SparsifierImpl::SampledExact(float* u, uint64_t n, uint64_t k,
                                          bool zero, uint64_t runs,
                                          uint64_t rank, bool from_u_predicted,
                                          cudaStream_t stream) {
  // More than 1/8 of the sample at or above its bound: ties at it
  // (ties_at_bound): the compaction keeps the keys above it instead.
  GTOPK_CUDA_RETURN_IF_ERROR(SampleThreshold(
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
  GTOPK_CUDA_RETURN_IF_ERROR(
      CompactAtSample(u, n, zero, exactly_k, expected, stream));
  // The last such selection needed the plan over u (ties at the bound,
  // which persist from step to step): enqueue it too, gated.
  if (from_u_predicted) {
    GatedScope falling_back(*this, &st->exact_from_u, 1);
    GTOPK_CUDA_RETURN_IF_ERROR(ExactFromU(u, n, k, zero, false, stream));
  }
  sampled_enqueued = true;
  from_u_enqueued = from_u_predicted;
  return KernelStatus::Ok();
}

}  // namespace internal
}  // namespace cuda
}  // namespace gtopk
