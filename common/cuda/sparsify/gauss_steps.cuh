// Gaussian-k's device-side rule: the verdicts the digit-0 histogram allows,
// the listing of the keys a correction may need (ListGaussKeys, the
// planner's) and the replay of the CPU rule on exact counts (GaussResolve,
// in the last block of the first compaction). Included by .cu files only.
#ifndef GTOPK_COMMON_CUDA_SPARSIFY_GAUSS_STEPS_CUH_
#define GTOPK_COMMON_CUDA_SPARSIFY_GAUSS_STEPS_CUH_

#include "common/cuda/sparsify/device_common.cuh"

namespace gtopk {
namespace cuda {
namespace internal {

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
  const ull lower =
      (key & 0xfffffu) == 0 ? upper : AtLeastBin(at_least, bin + 1);
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
// SparsifierTuning::gaussiank_key_limit) are not listed (GaussResolve then
// leaves the rest to the host). One thread; `value` and
// `reached` are kGaussSide^2 scratch entries (shared memory: as local
// arrays they would reserve local memory for every resident thread).
constexpr int kGaussSide = 17;  // adjustments left <= 16
__device__ inline void ListGaussKeys(DeviceState* st, const ull* at_least,
                                     double t, uint32_t first, int remaining,
                                     ull lo, ull hi, int max_keys,
                                     double* value, bool* reached) {
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
__device__ inline void GaussResolve(DeviceState* st, const ull* at_least,
                                    ull lo, ull hi) {
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

}  // namespace internal
}  // namespace cuda
}  // namespace gtopk

#endif  // GTOPK_COMMON_CUDA_SPARSIFY_GAUSS_STEPS_CUH_
