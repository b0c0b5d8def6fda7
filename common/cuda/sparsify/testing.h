// Test hooks of the GPU selector (common/cuda/sparsify.h): what a test may
// change about how a Sparsifier plans, so that each path stays checkable at
// the sizes the tests (and the emulator) can afford. Production code leaves
// it at its defaults (Sparsifier::Create without one).
#ifndef GTOPK_COMMON_CUDA_SPARSIFY_TESTING_H_
#define GTOPK_COMMON_CUDA_SPARSIFY_TESTING_H_

#include <cstdint>

namespace gtopk {
namespace cuda {

struct SparsifierTuning {
  // The smallest n for which exact (without Accumulate's histogram) starts
  // from a sample instead of a histogram pass (default 2^22; below it the
  // sample's launches cost more than the pass they save). The sample's own
  // plan needs n above about 16K (a sample of at most n/32 keys whose bound
  // keeps at most n/16 survivors), so smaller n keep the histogram plan
  // even at 0.
  uint64_t exact_sample_min_n = uint64_t{1} << 22;
  // The largest n that runs as one block (SelectInfo::one_block; default
  // and at most 4096, its shared-memory bound; 0: never), so that the
  // multi-kernel path can be checked at small n too.
  uint64_t one_block_max_n = 4096;
  // List at most this many keys (clamped to [0, 160]) for Gaussian-k's
  // device correction, so that a correction needing more is left to Wait's
  // host continuation (0: every correction that needs an exact count
  // besides the first is).
  int gaussiank_key_limit = 160;
  // false keeps Gaussian-k's gated exact fallback on its sample (a large u)
  // even when the last fallback predicted the first pass's candidates, so
  // that the sampled path stays checkable.
  bool gaussiank_fallback_from_candidates = true;
};

class Sparsifier;

// Replaces the hooks of a live Sparsifier (call between a Wait and the next
// Select; drops its captured graphs when the key limit or the fallback
// choice changes, which they were enqueued under), for tests that change
// them from one selection to the next.
void SetTuningForTesting(Sparsifier* sparsifier,
                         const SparsifierTuning& tuning);

}  // namespace cuda
}  // namespace gtopk

#endif  // GTOPK_COMMON_CUDA_SPARSIFY_TESTING_H_
