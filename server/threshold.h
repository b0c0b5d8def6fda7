// Exact global top-k selection across shards by a distributed radix select.
//
// In gtopk mode with exact selection (docs/design.md), each of the S
// shards owns a contiguous index range [begin_s, end_s) (the ranges tile
// [0, n) in shard order) and holds its sparse sum A_s. The cluster must keep
// exactly what one process would keep from the union of the A_s: the top-k by
// |value|, ties broken by lower global index (ReferenceGtopkStep and
// SparseTopK in common/merge.h are the oracle). This is the global top-k of
// gTop-k (Shi et al., "A Distributed Synchronous SGD Algorithm with Global
// Top-k Sparsification for Low Bandwidth Networks", ICDCS 2019,
// arXiv:1901.04359), computed without sending the shards' entries anywhere.
//
// Instead the shards run a radix select on the 31-bit magnitude keys
// (cpu::MagnitudeKey) with the leader (shard 0), as in the multi-pass radix
// select of AIR top-k (Zhang et al., "Parallel Top-K Algorithms on GPU: A
// Comprehensive Study and New Methods", SC'23), with the per-pass histogram
// summed over shards instead of over thread blocks:
//
//   level 0: every shard sends the histogram of key bits 30..20 over all its
//            entries (2048 buckets); the leader sums them, finds the bucket b0
//            holding the global k-th largest key and how many keys lie above
//            it;
//   level 1: histogram of bits 19..9 (2048 buckets) over the entries whose
//            bits 30..20 equal b0 → bucket b1;
//   level 2: histogram of bits 8..0 (512 buckets) over the entries whose bits
//            30..9 equal (b0, b1) → the exact k-th key, and how many entries
//            equal to it each shard keeps. Ties go to lower global indices,
//            and lower shards hold lower indices, so they are handed out in
//            shard-id order.
//
// So a step costs at most three small round trips (16 KiB up, a few bytes
// down), whatever k and P are. The exchange finishes early when every shard
// can keep everything (keep_all, at most k entries in all) or when the whole
// bucket chosen at level 0 or 1 is needed.
//
// Pieces, leader to shard:
//   CombineThresholdRound  the pure leader-side step of one level;
//   ThresholdCoordinator   the leader's thread-safe rendezvous that collects
//                          the S requests of a (step, level) and answers all;
//   ThresholdExchange      how a shard reaches the coordinator (in-process:
//                          LocalThresholdExchange; gRPC: in the server);
//   DistributedThresholdTopK   the shard-side driver that runs the levels and
//                          selects its part of the global top-k.
#ifndef GTOPK_SERVER_THRESHOLD_H_
#define GTOPK_SERVER_THRESHOLD_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "common/epoch.h"
#include "common/sparse_vector.h"

namespace gtopk {
namespace server {

// Number of radix-select levels: key bits 30..20, 19..9 and 8..0.
inline constexpr uint32_t kThresholdLevels = 3;

// Buckets in a level's histogram: 2048 at levels 0 and 1, 512 at level 2,
// 0 for a level >= kThresholdLevels.
uint32_t ThresholdBucketCount(uint32_t level);

// One shard's message to the leader for one (step, level). Mirrors
// gtopk.v1.ThresholdRequest (proto/gtopk/v1/gtopk.proto); the gRPC layer
// converts field by field.
struct ThresholdRequest {
  int64_t step = 0;       // the training step, >= 0
  uint32_t shard_id = 0;  // the sender, < S
  uint64_t k = 0;      // the global k of this step, >= 1, equal on all shards
  uint32_t level = 0;  // 0, 1 or 2
  // ThresholdBucketCount(level) counts in increasing key order: at level 0
  // of key bits 30..20 over all the shard's entries; at level 1 of bits 19..9
  // over the entries whose bits 30..20 equal the level-0 bucket; at level 2
  // of bits 8..0 over the entries whose bits 30..9 equal the level-0 and
  // level-1 buckets. See KeyHistogram.
  std::vector<uint64_t> histogram;
  // The attempt epoch of the sender's round (common/epoch.h): a request
  // older than the step's last failure (ThresholdCoordinator::Abort) is
  // refused with ABORTED.
  uint64_t epoch = kNewestEpoch;

  friend bool operator==(const ThresholdRequest& a, const ThresholdRequest& b);
};

// The leader's answer to one shard for one (step, level). Mirrors
// gtopk.v1.ThresholdResponse.
//
// When `done` is false, the shard refines: the next level's prefix is
// `bucket` (after level 0) or (prefix << 11) | bucket (after level 1).
// When `done` is true, the shard's part of the global top-k is, in index
// order, every entry with key > kth_key plus its first `ties_to_keep` entries
// with key == kth_key, or every entry when `keep_all`.
struct ThresholdResponse {
  int64_t step = 0;    // echoes the request
  uint32_t level = 0;  // echoes the request
  // The bucket (at this level) holding the global k-th largest key;
  // 0 when keep_all.
  uint32_t bucket = 0;
  // Global number of keys above `bucket`, cumulative over the levels so far
  // (keys whose prefix so far is greater than the chosen one).
  uint64_t greater_total = 0;
  // Valid when done and not keep_all: the selection threshold. After level 2
  // it is the exact global k-th largest key. After an early finish at level 0
  // or 1 (the whole chosen bucket is needed) it is one below the smallest key
  // of that bucket, with ties_to_keep == 0; the selection rule above is the
  // same in both cases.
  uint32_t kth_key = 0;
  // Valid when done: how many of this shard's entries with key == kth_key it
  // keeps (the lowest indices first). Shards fill the ties in shard-id order.
  uint64_t ties_to_keep = 0;
  bool done = false;
  // At most k entries exist in all: every shard keeps all its entries.
  // Implies done; only at level 0.
  bool keep_all = false;

  friend bool operator==(const ThresholdResponse& a,
                         const ThresholdResponse& b);
  friend bool operator!=(const ThresholdResponse& a,
                         const ThresholdResponse& b) {
    return !(a == b);
  }
};

// The histogram a shard sends at `level`, over the magnitude keys
// (cpu::MagnitudeKey) of `values`:
//   level 0: 2048 buckets, key >> 20, over all values (`prefix` ignored);
//   level 1: 2048 buckets, (key >> 9) & 0x7ff, over the values with
//            key >> 20 == prefix (the level-0 bucket);
//   level 2: 512 buckets, key & 0x1ff, over the values with
//            key >> 9 == prefix ((level-0 bucket << 11) | level-1 bucket).
// Returns an empty vector for level >= kThresholdLevels. Non-finite values
// count in level-0 buckets >= 0x7f8 (which the leader rejects). O(values)
// time, reentrant.
std::vector<uint64_t> KeyHistogram(absl::Span<const float> values,
                                   uint32_t level, uint32_t prefix);

// What the levels before a round decided: the leader's state between levels.
struct ThresholdPrefix {
  // Key bits chosen so far: 0 before level 0, b0 before level 1,
  // (b0 << 11) | b1 before level 2.
  uint32_t prefix = 0;
  // Global number of keys above the prefix's key range (0 before level 0).
  uint64_t greater_total = 0;
  // Before levels 1 and 2: shard_counts[s] is how many of shard s's entries
  // match the prefix (its count in the previous level's chosen bucket), and
  // each shard's histogram must hold exactly that many. Empty: not checked
  // (always empty before level 0).
  std::vector<uint64_t> shard_counts;
};

// One combined round: a response per shard (indexed by shard id) and, when
// not done, the state the next level starts from.
struct ThresholdRound {
  std::vector<ThresholdResponse> responses;
  ThresholdPrefix next;
};

// The leader's step for one (step, level): validates the S shards' requests
// and computes every shard's response. A pure function.
//
//   num_shards  S >= 1.
//   before      the state the previous levels left (ThresholdRound::next of
//               the previous level; ThresholdPrefix{} at level 0).
//   requests    exactly S requests, in any order, one per shard id in
//               [0, S), all with the same step, level (<= 2) and k (>= 1),
//               each histogram of ThresholdBucketCount(level) counts, at most
//               2^32 entries per shard, none in the non-finite level-0
//               buckets (>= 0x7f8), and matching before.shard_counts.
//
// Decision: with T the global total, level 0 answers keep_all when T <= k.
// Otherwise, with need = k - before.greater_total, the chosen bucket is the
// highest b whose count, added to the counts above it, reaches need. At
// level 2 that is the exact k-th key, and the need - (counts above b) ties
// are handed to shards in shard-id order. At levels 0 and 1 the round is done
// early when the bucket's count is exactly what is still needed.
//
// Errors: INVALID_ARGUMENT naming the step, level, shard and fault (e.g.
// "step 4 level 0: shard 2: histogram has 100 buckets, expected 2048"), for
// any violated precondition above, including an inconsistent `before`.
// Thread-safety: reentrant. Cost: O(S * buckets).
absl::StatusOr<ThresholdRound> CombineThresholdRound(
    uint32_t num_shards, const ThresholdPrefix& before,
    absl::Span<const ThresholdRequest> requests);

struct ThresholdCoordinatorOptions {
  // How many steps (the newest by step number) the coordinator holds state
  // for, to answer retries of finished rounds. A request for a step older
  // than those held gets FAILED_PRECONDITION; when a new step arrives and
  // the oldest held step is still collecting, that step's waiters get
  // ABORTED. Memory is O(retained_steps * 3 * S) words once rounds finish,
  // plus the histograms (16 KiB per shard) of rounds still collecting.
  // Values < 1 count as 1.
  int retained_steps = 4;
};

// The leader's rendezvous for the threshold exchange: collects the S shards'
// requests for each (step, level), combines them (CombineThresholdRound) and
// answers every shard.
//
// Thread-safety: thread-safe; Submit is meant to be called concurrently, once
// per shard per round (typically from the gRPC handlers and the leader's own
// shard thread).
//
// Usage (leader side; shards reach it through a ThresholdExchange):
//   ThresholdCoordinator coordinator(num_shards);
//   LocalThresholdExchange local(&coordinator);   // for shard 0 itself
//   // gRPC handler: return coordinator.Submit(request, deadline);
class ThresholdCoordinator {
 public:
  // `num_shards` is S; with S == 0 every Submit fails with
  // FAILED_PRECONDITION.
  explicit ThresholdCoordinator(uint32_t num_shards,
                                ThresholdCoordinatorOptions options = {});
  ThresholdCoordinator(const ThresholdCoordinator&) = delete;
  ThresholdCoordinator& operator=(const ThresholdCoordinator&) = delete;
  ~ThresholdCoordinator();

  // Delivers one shard's request and blocks until every shard's request for
  // the same (step, level) has arrived, then returns this shard's response;
  // or until `deadline`, whichever is first. Rounds of a step must run in
  // level order (level L + 1 after level L completed without `done`).
  //
  // Status codes:
  //   DEADLINE_EXCEEDED   `deadline` passed before all S arrived; the message
  //                       names the missing shards. The round fails for every
  //                       shard waiting on it (and for any that comes later).
  //   INVALID_ARGUMENT    this request is malformed (shard_id >= S, step < 0,
  //                       level > 2: only this call fails), or attributable
  //                       to a shard and inconsistent (histogram size, k == 0,
  //                       k differing from other shards' k for the step,
  //                       non-finite counts, counts not matching the previous
  //                       level, a different request for the same (step,
  //                       level, shard) while the round collects): the round
  //                       fails; this call gets INVALID_ARGUMENT naming the
  //                       shard and the fault.
  //   ABORTED             another shard's request failed the round (the
  //                       message names it and the fault), or the step was
  //                       evicted while collecting (see retained_steps).
  //   FAILED_PRECONDITION the step is older than the retained steps, is
  //                       already finished (a level after the one that was
  //                       done), or the previous level has not completed; or
  //                       S == 0.
  // A repeated request for a (step, level, shard) whose round is finished (a
  // retry) gets the same response, or the same error if the round failed; a
  // retry with a different k or histogram gets INVALID_ARGUMENT (only that
  // call; the round stands). A retry while the round collects waits with the
  // original. Never aborts on bad input.
  //
  // `cancelled` (may be empty) is polled every 50 ms while waiting; when it
  // returns true (the shard's RPC was cancelled: it went away), the round
  // fails for everyone (ABORTED naming the shard) and this call gets
  // CANCELLED. While fenced (Fence), every Submit fails with the fence's
  // status.
  absl::StatusOr<ThresholdResponse> Submit(
      const ThresholdRequest& request, absl::Time deadline,
      const std::function<bool()>& cancelled = {}) ABSL_LOCKS_EXCLUDED(mu_);

  // Crash recovery (server/service.h, Recover): while fenced, rounds that
  // are collecting fail with `reason` (ABORTED) and new requests get it at
  // once; Unfence lifts it. ForgetFrom drops the state of every step >=
  // `step` (waiters get ABORTED), so that the steps the cluster rolled back
  // are exchanged afresh instead of answered as retries.
  void Fence(const absl::Status& reason) ABSL_LOCKS_EXCLUDED(mu_);
  void Unfence() ABSL_LOCKS_EXCLUDED(mu_);
  void ForgetFrom(int64_t step) ABSL_LOCKS_EXCLUDED(mu_);

  // Fail fast (AbortStep RPC): `step` failed on some shard, at attempt
  // epoch `epoch`. Its rounds that are collecting fail with `reason`
  // (ABORTED), its state is dropped, and later requests for it with an
  // older epoch get `reason` at once -- a shard still computing the failed
  // attempt must not start an exchange that the retry would then join.
  void Abort(int64_t step, const absl::Status& reason, uint64_t epoch)
      ABSL_LOCKS_EXCLUDED(mu_);

  // How many steps the coordinator currently holds state for
  // (<= max(1, retained_steps)). For tests and metrics.
  size_t NumRetainedSteps() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct ExchangeRound;
  struct StepState;

  // The state of `step`, created if new (evicting the oldest if needed);
  // FAILED_PRECONDITION when the step is too old.
  absl::StatusOr<std::shared_ptr<StepState>> FindOrCreateStepLocked(
      int64_t step) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Fails `round` (and so its step) for everyone: `culprit` (or none, -1) gets
  // `status`, the others `others`.
  void FailRoundLocked(ExchangeRound* round, int64_t culprit,
                       absl::Status status, absl::Status others)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Completes `round` once all S requests are in.
  void CompleteRoundLocked(StepState* state, uint32_t level)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Submit's parts, in order. The state of the request's step: refused
  // while fenced or for a request of an aborted attempt; a level-0 request
  // after a failed attempt (or one that differs from the request that
  // completed level 0) starts the step afresh.
  absl::StatusOr<std::shared_ptr<StepState>> StepForRequestLocked(
      const ThresholdRequest& request) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Opens the idle round of `level` for collecting, or says why it cannot
  // open (an earlier level failed or has not completed; the step is done).
  absl::Status OpenRoundLocked(StepState& state, uint32_t level, uint32_t shard,
                               int64_t step, const std::string& round_name)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Adds `request` to its collecting round (an identical retry waits with
  // the original); a fault of the request fails the round for every shard
  // and is returned. Completes the round with the last request.
  absl::Status AddRequestLocked(StepState& state,
                                const ThresholdRequest& request,
                                const std::string& round_name)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Waits until `round` completes or fails, failing it at `deadline`
  // (naming the shards missing) or when `cancelled` says so; the answer for
  // `shard`.
  absl::StatusOr<ThresholdResponse> AwaitRoundLocked(
      ExchangeRound& round, uint32_t shard, const std::string& round_name,
      absl::Time deadline, const std::function<bool()>& cancelled)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const uint32_t num_shards_;
  const size_t retained_steps_;
  mutable absl::Mutex mu_;
  absl::CondVar changed_;  // signalled when any round completes or fails
  std::map<int64_t, std::shared_ptr<StepState>> steps_ ABSL_GUARDED_BY(mu_);
  // Steps <= this were evicted (valid when has_evicted_).
  bool has_evicted_ ABSL_GUARDED_BY(mu_) = false;
  int64_t evicted_through_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Status fenced_ ABSL_GUARDED_BY(mu_);  // not OK while fenced
  // Abort()ed steps: the reason, and until when requests are refused.
  std::map<int64_t, std::pair<absl::Status, uint64_t>> aborted_
      ABSL_GUARDED_BY(mu_);
};

// How a shard reaches the leader's ThresholdCoordinator.
class ThresholdExchange {
 public:
  virtual ~ThresholdExchange() = default;

  // Sends `request` to the leader and blocks until its response for the
  // round, or an error, comes back, at the latest shortly after `deadline`
  // (DEADLINE_EXCEEDED). Status codes are ThresholdCoordinator::Submit's,
  // plus UNAVAILABLE when the leader cannot be reached. Implementations are
  // thread-safe.
  virtual absl::StatusOr<ThresholdResponse> Exchange(
      const ThresholdRequest& request, absl::Time deadline) = 0;
};

// In-process exchange: calls ThresholdCoordinator::Submit directly. Used by
// the leader's own shard and by tests. Thread-safe.
class LocalThresholdExchange final : public ThresholdExchange {
 public:
  // `coordinator` is not owned and must outlive this object.
  explicit LocalThresholdExchange(ThresholdCoordinator* coordinator)
      : coordinator_(coordinator) {}

  absl::StatusOr<ThresholdResponse> Exchange(const ThresholdRequest& request,
                                             absl::Time deadline) override;

 private:
  ThresholdCoordinator* const coordinator_;
};

// The shard-side driver of the exact global top-k: runs the levels with the
// leader through `exchange` and writes this shard's part of the global
// selection.
//
//   shard_sum  this shard's sparse sum A_s: indices strictly ascending (global
//              indices inside the shard's range), values finite; may be empty
//              (the shard still takes part).
//   k          the global k, >= 1, equal on every shard.
//   step       the step number, >= 0.
//   shard_id   this shard's id s < S; shard ids follow the index ranges.
//   exchange   the way to the leader; not owned.
//   deadline   for the whole exchange (all levels).
//   selected   replaced by the selected entries of shard_sum, in index order,
//              values copied bit for bit. The union of the S shards' outputs
//              equals SparseTopK(union of the A_s, k).
//
// Blocks for up to three round trips with the leader. Reentrant: concurrent
// calls (one per shard, e.g. shards as threads) are fine with distinct
// `selected`.
//
// Errors (`selected` is left empty): INVALID_ARGUMENT for k == 0, step < 0, a
// null pointer or an invalid shard_sum, found before anything is sent (the
// other shards' round then fails at its deadline, naming this shard); the
// exchange's status, with its code kept and the message prefixed by the step,
// level and shard ("threshold exchange step 7 level 1 (shard 2): ...");
// INTERNAL when the leader's response contradicts the request or this shard's
// data (wrong step or level, bucket out of range, more ties than entries).
// `epoch`: the attempt epoch of the shard's round, sent in every request.
absl::Status DistributedThresholdTopK(const SparseVector& shard_sum, uint64_t k,
                                      int64_t step, uint32_t shard_id,
                                      ThresholdExchange* exchange,
                                      absl::Time deadline,
                                      SparseVector* selected,
                                      uint64_t epoch = kNewestEpoch);

}  // namespace server
}  // namespace gtopk

#endif  // GTOPK_SERVER_THRESHOLD_H_
