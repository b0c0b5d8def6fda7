// One aggregator shard's synchronous rounds and parameters, independent of
// gRPC (server/push_pull.cc adapts it to the wire; tests drive it directly).
#ifndef GTOPK_SERVER_SHARD_AGGREGATOR_H_
#define GTOPK_SERVER_SHARD_AGGREGATOR_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "common/buckets.h"
#include "common/cluster_modes.h"  // AggregationMode, SelectionKind, ApplyMode
#include "common/codec.h"
#include "common/epoch.h"
#include "common/optimizer.h"
#include "common/sparse_vector.h"
#include "server/checkpoint.h"
#include "server/commit.h"
#include "server/piece_rounds.h"
#include "server/threshold.h"

namespace gtopk {
namespace server {

// In the message of every divergence-alarm failure (differing parameter
// checksums, ShardAggregator::Submit). The leader's fail-fast forward of
// such a failure keeps FAILED_PRECONDITION (server/recovery.cc): a retry
// cannot succeed, so no worker is told ABORTED ("retry after Recover").
inline constexpr char kDivergedMarker[] = "the replicas' parameters differ";

// Contiguous, near-equal split of [0, n) into S ranges: shard s owns
// [s*n/S, (s+1)*n/S). Precondition: S >= 1.
std::pair<uint64_t, uint64_t> ShardRange(uint64_t n, uint32_t num_shards,
                                         uint32_t shard_id);

struct ShardOptions {
  uint32_t shard_id = 0;     // 0..num_shards-1
  uint32_t num_shards = 1;   // S >= 1
  uint64_t n = 0;            // parameter count, 1..2^32
  uint32_t num_workers = 1;  // P >= 1
  AggregationMode mode = AggregationMode::kGtopk;
  SelectionKind selection = SelectionKind::kThreshold;
  // kLayerwise: values per bucket (ClusterSpec.bucket_size, >= 1); the
  // shard keeps the top PieceK of each of its pieces (common/buckets.h).
  uint64_t bucket_size = 0;
  // Index codec of the pulls (values always go out as fp32, so replicas and
  // servers apply identical bits).
  IndexCodec pull_index_codec = IndexCodec::kDeltaVarint;
  OptimizerOptions optimizer;
  // Who applies the global top-k. kWorkers (gradient aggregation): a
  // completed round leaves the parameters as they are (they are only the
  // initial broadcast), the pull is the same sum as under kServers, shard 0
  // relays rank 0's buffers (WorkerPush::buffers), and Rollback accepts any
  // step without a checkpoint.
  ApplyMode apply = ApplyMode::kServers;
  // The divergence alarm (ClusterSpec.checksum_every): on a step with
  // step % checksum_every == 0 the P pushes' params_checksum must be
  // non-zero and equal, or the step fails for every worker. 0: never.
  uint32_t checksum_every = 0;
  // Longest a round waits for the pushes and the threshold exchange.
  absl::Duration step_timeout = absl::Seconds(30);
  // The most pairs the workers' selector returns for a target k
  // (Selector::MaxCount of the cluster's --selector, e.g. 4k/3 for
  // gaussiank); null: k (exact top-k). Bounds a push (MaxPushPairs).
  std::function<uint64_t(uint64_t k)> max_pairs_for_k;
};

// INVALID_ARGUMENT naming the first bad field, or OK.
absl::Status ValidateShardOptions(const ShardOptions& options);

// One worker's contribution to a round, already decoded.
struct WorkerPush {
  int64_t step = 0;
  uint32_t worker = 0;
  // gtopk/topk: global indices inside the shard's range.
  SparseVector sparse;
  // dense: exactly end - begin values.
  std::vector<float> dense;
  // The attempt epoch the worker last heard (common/epoch.h).
  uint64_t epoch = kNewestEpoch;
  // Push.params_checksum: compared on the steps of the divergence alarm
  // (ShardOptions::checksum_every), where all P must be equal, and on any
  // step where a worker sent one (its first step after a resume or a
  // renumbering rollback), where the ones sent must be equal.
  uint64_t params_checksum = 0;
  // Push.buffers: kWorkers only, rank 0's push to shard 0 only (any other
  // non-empty buffers are a bad push, INVALID_ARGUMENT).
  std::string buffers;
  // kLayerwise: a part of the worker's push (Push.piece_begin/piece_end,
  // docs/overlap.md "Rounds per bucket"): the shard's pieces [piece_begin,
  // piece_end), indices into ShardAggregator::pieces(); `sparse` holds
  // their entries only. piece_end 0: the whole push.
  uint32_t piece_begin = 0;
  uint32_t piece_end = 0;
  bool is_part() const { return piece_end > 0 || piece_begin > 0; }
};

// The outcome of one round, shared by every worker's call.
struct RoundResult {
  int64_t step = 0;
  // gtopk/topk: the selected entries with the SUM over workers (global
  // indices); dense: empty.
  SparseVector selected;
  // dense: the sum over workers of the range; otherwise empty.
  std::vector<float> dense_sum;
  // `selected` encoded once for all workers (pull_index_codec + fp32).
  std::string encoded;
  // Shard 0 under kWorkers: rank 0's buffers of the round (Pull.buffers);
  // otherwise empty.
  std::string buffers;
  // Wall time of the sum of the pushes and of the selection (gtopk threshold:
  // including the threshold exchange).
  absl::Duration merge_time;
  absl::Duration select_time;
  // When the round's first push arrived, and how long the round then waited
  // for its last one (the slowest worker); for the server's metrics.
  absl::Time opened;
  absl::Duration wait_time;
};

// A shard: owns the parameters of [begin, end), runs one synchronous round
// per step (collect all P pushes -> sparse sum -> selection -> apply the
// shared optimizer rule -> the same result to every worker). Under
// ApplyMode::kWorkers nothing is applied: the parameters stay the initial
// broadcast and only the step advances.
//
// Thread-safety: every public method is thread-safe. Submit blocks (up to the
// given deadline) until the round completes or fails; the call that
// completes the round does the merge and the threshold exchange.
//
// Rounds are all-or-nothing: a bad push fails its caller with
// INVALID_ARGUMENT and the round with ABORTED for every worker waiting in it;
// a round that misses its deadline fails for everyone with DEADLINE_EXCEEDED
// naming the missing workers. A failed round changes no parameter and the
// same step can be retried: pushes arriving after a failure form a new round.
// A second push for a (step, worker) in the pending round replaces the
// first while the round still collects (the worker's retry after a failure
// it saw elsewhere: its residual now holds more, so the push differs by
// design); once the round is being computed, or for the last completed
// round, a repeated push is a retry and gets that round's result (its
// content is ignored).
//
// Under kLayerwise every push, whole or in parts (SubmitPart), joins the
// step's per-piece rounds (server/piece_rounds.h): each piece's sum and top
// k_p run as soon as its P parts are in, and the step's result is their
// concatenation, bit-identical to the whole-shard round; the checks, the
// commit vote and the apply stay one per step. There a repeated whole push
// replaces the first only while none of that worker's pieces has started;
// after that it is a retry (the round's result).
class ShardAggregator {
 public:
  // `exchange` is used for gtopk + exact with S > 1 and must outlive the
  // aggregator; it may be null otherwise. INVALID_ARGUMENT for bad options.
  // `commit`, when not null (required for S > 1 in the gRPC service), is
  // asked before every apply whether all shards computed the step (see
  // server/commit.h); a step not committed is failed, not applied.
  static absl::StatusOr<std::unique_ptr<ShardAggregator>> Create(
      const ShardOptions& options, ThresholdExchange* exchange,
      CommitVoter* commit = nullptr);

  const ShardOptions& options() const { return options_; }
  uint64_t begin() const { return begin_; }
  uint64_t end() const { return end_; }

  // Sets the initial parameters of the range (end - begin finite values),
  // once: returns true when they were taken, false when the shard already
  // had parameters (they are kept). INVALID_ARGUMENT for a wrong size or a
  // non-finite value. `state`: rank 0's opaque state blob
  // (ParamsChunk.state; shard 0 under kWorkers only, the service checks
  // that), kept with the parameters under the same first-wins rule. It is
  // not part of checkpoints (ShardCheckpoint holds parameters and step
  // only): a shard restored from a checkpoint serves an empty blob.
  absl::StatusOr<bool> InitParams(absl::Span<const float> values,
                                  std::string state = std::string());

  // Waits until the shard has parameters (or the deadline:
  // DEADLINE_EXCEEDED), then returns a copy and the next step.
  absl::StatusOr<std::pair<std::vector<float>, int64_t>> Params(
      absl::Time deadline) const;

  // Parameters, global velocity (kGlobal momentum only, else empty) and the
  // next step, as one consistent snapshot. Waits like Params().
  struct State {
    std::vector<float> params;
    std::vector<float> global_velocity;
    int64_t next_step = 0;
    // The state blob InitParams took (never null; shared, not copied).
    std::shared_ptr<const std::string> state;
  };
  absl::StatusOr<State> GetState(absl::Time deadline) const;
  // Waits until the shard has parameters, copying nothing: OK, or
  // DEADLINE_EXCEEDED ("has no parameters yet") at the deadline, or the
  // status of Close.
  absl::Status AwaitInitialized(absl::Time deadline) const;

  // The first step not yet applied.
  int64_t next_step() const;

  // Memory per step (docs/resource-limits.md): the most pairs one worker's
  // sparse push of `step` may carry on this shard, min(end - begin,
  // max_pairs_for_k(k)) with k = the optimizer's KAt(step, n) (density and
  // density warm-up); under kLayerwise the sum over the shard's pieces of
  // min(piece size, max_pairs_for_k(PieceK)). So a round holds at most P x
  // MaxPushPairs pairs: one push per worker (a repeated push replaces the
  // first) and only the current step (later steps are refused, never queued).
  // Pure.
  uint64_t MaxPushPairs(int64_t step) const;
  // The RESOURCE_EXHAUSTED status for a push of `pairs` > `most`
  // (MaxPushPairs), naming the bound and the flags it comes from. Pure.
  absl::Status PushPairsExhausted(uint32_t worker, int64_t step, uint64_t pairs,
                                  uint64_t most) const;

  // Contributes `push` to the round of push.step and waits for its result.
  // Errors: INVALID_ARGUMENT (bad push: rank, range, order, lengths,
  // non-finite, mode mismatch), RESOURCE_EXHAUSTED (a sparse push of more
  // than MaxPushPairs(step) pairs; like a bad push it fails the round for
  // every worker, none of it applied), FAILED_PRECONDITION (no parameters yet;
  // a step that is neither the current one nor a retry of the last one; for
  // every worker of the round, a step whose update is not finite -- the sum
  // of the pushes overflows, or a parameter or global velocity entry would
  // become +-Inf -- checked before the commit vote, so that the step is
  // applied on no shard; the message names the index and the values),
  // ABORTED (another worker's push failed the round), DEADLINE_EXCEEDED
  // (missing workers named), or the threshold exchange's error. On a step
  // of the divergence alarm (ShardOptions::checksum_every) whose P
  // params_checksum are not all non-zero and equal: FAILED_PRECONDITION for
  // every worker of the round naming the checksums and their ranks, decided
  // once all P pushes are in and before the threshold exchange and the
  // commit vote (every shard sees the same checksums and fails the step).
  absl::StatusOr<std::shared_ptr<const RoundResult>> Submit(
      WorkerPush push, absl::Time deadline);

  // Layer-wise rounds per piece (docs/overlap.md, "Rounds per bucket";
  // LAGS-SGD, S. Shi et al., ECAI 2020). The round a worker's parts of a
  // step joined, kept by the caller between its parts (one per stream):
  // a later part of the same attempt whose round failed meanwhile gets
  // that failure instead of opening a new round without the earlier parts.
  struct RoundTicket {
    std::shared_ptr<const void> round;  // opaque; null: none yet
    int64_t step = -1;
    uint64_t epoch = 0;
  };
  // This shard's bucket pieces (kLayerwise; empty otherwise), in index
  // order: Push.piece_begin/piece_end index them.
  const std::vector<BucketPiece>& pieces() const { return pieces_; }

  // Contributes `part` (a part of worker part.worker's push of part.step, or
  // the whole push when !part.is_part()) to the step's round. A piece's
  // round (SumAndSelectPiece: the sum over the P workers in rank order and
  // its top k_p) runs on the calling thread as soon as all P workers' parts
  // holding it have arrived. Returns null at once when the worker's push is
  // not complete yet (more parts to come); once it is, waits (up to
  // `deadline`) for the step's round -- every piece's round, then the
  // divergence alarm, the finiteness check, the commit vote and the apply,
  // as Submit -- and returns its result, bit-identical to the whole-shard
  // round of the same pushes. `ticket` (may be null): the caller's record
  // of the round its earlier parts of this step joined (updated).
  // Errors: Submit's, and, each failing the step on every shard (as a bad
  // push): FAILED_PRECONDITION for a part when the cluster is not
  // layer-wise or this shard has no pieces; INVALID_ARGUMENT for a run
  // empty or out of [0, pieces().size()), a piece sent twice in the step,
  // entries outside the run's pieces, a params_checksum or an epoch other
  // than the worker's earlier parts' (older), buffers on a part without
  // piece 0; RESOURCE_EXHAUSTED for a piece of more pairs than its k allows
  // (max_pairs_for_k). A later part of an attempt whose round failed gets
  // that round's status. A part with a newer epoch than the worker's
  // earlier parts in the pending round is its retry: that round fails
  // (ABORTED) and the part opens a fresh one. Thread-safe.
  absl::StatusOr<std::shared_ptr<const RoundResult>> SubmitPart(
      WorkerPush part, absl::Time deadline, RoundTicket* ticket);

  // What one reader of a round's piece rounds (a piece pulls' writer) has
  // been handed so far by AwaitPieces: start with a fresh one per round.
  struct PiecesSent {
    size_t count = 0;  // pieces handed out (the first `count` to finish)
    // Whether every piece of the round was handed out.
    bool all(size_t num_pieces) const { return count >= num_pieces; }
  };
  // The finished piece rounds of `ticket`'s round not handed out to *sent
  // yet, in piece order, counted there now: for the piece pulls sent
  // before the commit vote. Waits (up to `deadline`) until at least one is
  // new, every piece was handed out, or the round failed (its status; at
  // the deadline, with no caller computing it, the round is failed for
  // everyone naming the pieces still waiting: DEADLINE_EXCEEDED), or until
  // `wake` (then possibly empty: the caller may stop; every piece was
  // handed out when sent->all(pieces().size())). Each call costs the
  // pieces it returns, not the round's pieces. Nothing returned may be
  // applied before the round's result. Thread-safe.
  absl::StatusOr<
      std::vector<std::pair<size_t, std::shared_ptr<const PieceResult>>>>
  AwaitPieces(const RoundTicket& ticket, PiecesSent* sent, absl::Time deadline,
              absl::Time wake);

  // Fails the round of `step` (when it is the current, not yet computing
  // round) as a bad push from `worker` would: every other worker gets
  // ABORTED with `reason`. For pushes rejected before Submit (e.g. bytes
  // that do not decode). Thread-safe, does not block.
  void RejectPush(int64_t step, uint32_t worker, const absl::Status& reason);
  // A worker gives up its attempt of `step` pushed with attempt epoch
  // `epoch` (Push.abandon): RejectPush, unless that attempt already failed
  // (an AbortStep of `step` at a newer epoch), so that an abandon arriving
  // late, after the worker's Recover, cannot fail the retry's round.
  // Returns whether the round was failed. Thread-safe, does not block.
  bool AbandonPush(int64_t step, uint32_t worker, uint64_t epoch,
                   const absl::Status& reason);

  // The step of the round open now (some pushes arrived, not computing
  // yet) when `worker`'s push is not among them; nullopt otherwise (no
  // round open, it is being computed, or the worker has pushed). For the
  // service's dead-worker check (a worker whose stream closed fails the
  // round at once instead of at the step deadline). Thread-safe.
  std::optional<int64_t> RoundAwaiting(uint32_t worker) const;

  // Called (without internal locks held) by the thread that completed a
  // round, after the parameters were updated, with the new next step; e.g.
  // to write a checkpoint every N steps. Set before the first Submit.
  void SetStepAppliedCallback(std::function<void(int64_t next_step)> callback);

  // Called when a step fails on this shard for a reason that arose here (a
  // bad push, a push that cannot open a round while draining, the step
  // deadline, a local error while computing, shutdown) -- not when the
  // leader or another shard failed it (ABORTED from the commit vote or the
  // threshold exchange, AbortStep) -- so that the service can tell the
  // other shards at once (fail fast, the AbortStep RPC). Called with an
  // internal lock held: it must not block or call into this aggregator.
  // Set before the first Submit.
  void SetStepFailedCallback(
      std::function<void(int64_t step, const absl::Status& reason)> callback);

  // The leader says `step` failed (AbortStep) at attempt epoch `epoch`
  // (common/epoch.h): a pending round of `step` holding a push older than
  // `epoch` fails with `reason` (ABORTED) and its pushes are discarded; such
  // a round being computed is not voted for or applied (it fails with
  // `reason`); later pushes of `step` older than `epoch` get `reason` at
  // once (they belong to the failed attempt; the workers' retry, pushed
  // with the epoch Recover returned, is not refused). Other steps: no
  // effect. Does not block; thread-safe.
  void AbortStep(int64_t step, const absl::Status& reason, uint64_t epoch);
  // The epoch of `step`'s last AbortStep, 0 when none: a worker whose push
  // was refused or whose round failed learns it (the service sends it as
  // trailing metadata), so that its next push of the step is a retry.
  uint64_t AbortEpoch(int64_t step) const;

  // Stops the shard for good (graceful shutdown): fails the pending round
  // (unless a caller is already computing it; that one finishes within its
  // own deadline) and every later Submit and Params call with `reason`
  // (e.g. UNAVAILABLE "shard 1 is shutting down"), so that no handler stays
  // blocked until its step deadline. Parameters are kept (Snapshot still
  // works). Thread-safe, does not block; later calls are no-ops.
  void Close(const absl::Status& reason);

  // Graceful shutdown's drain: the round in progress (if any) may still
  // complete, but a push that would open a new round fails with `reason`
  // (e.g. UNAVAILABLE "shard 1 is shutting down"). Thread-safe, does not
  // block; irreversible.
  void BeginDrain(const absl::Status& reason);
  // Waits until no round is open (none pending or being computed), up to
  // `deadline`; true when none is. Thread-safe.
  bool AwaitNoRound(absl::Time deadline) const;

  // Crash recovery (docs/recovery.md). Waits (up to `deadline`:
  // DEADLINE_EXCEEDED) until no round is being computed -- a computing round
  // either applies or fails, so the answer does not change under the caller
  // unless new pushes arrive -- and returns the next step.
  // FAILED_PRECONDITION when the shard has no parameters.
  // With `settle` false it answers at once: the next step, even while a
  // round of it is being computed.
  absl::StatusOr<int64_t> SettledNextStep(absl::Time deadline,
                                          bool settle = true) const;

  // Rolls the shard back to `step`: the pending round (also one being
  // computed: its result is discarded, never applied) fails with ABORTED
  // `reason`, the retry cache is dropped, and the state becomes
  // `checkpoint` (which must hold `step`, of this layout), or stays as it
  // is when `checkpoint` is null and `step` is the current next step.
  // Under kWorkers with `checkpoint` null any step >= 0 is accepted: the
  // shard holds no state of its own but the step, which becomes `step`
  // (the workers resume from their own checkpoints).
  // Errors (nothing changed): FAILED_PRECONDITION when `checkpoint` is null
  // and step != next_step(), before initialisation, or for a checkpoint of
  // another layout or step. Thread-safe, does not block on rounds.
  absl::Status Rollback(int64_t step, const ShardCheckpoint* checkpoint,
                        const absl::Status& reason);

  // A consistent copy of the state for a checkpoint (FAILED_PRECONDITION
  // before initialisation).
  absl::StatusOr<ShardCheckpoint> Snapshot() const;
  // Restores parameters and next step from a checkpoint of this layout
  // (FAILED_PRECONDITION when it belongs to another layout).
  absl::Status Restore(const ShardCheckpoint& checkpoint);

 private:
  struct AggregationRound {
    int64_t step = 0;
    absl::Time opened = absl::Now();  // the first push's arrival
    std::vector<bool> arrived;
    std::vector<WorkerPush> pushes;
    uint32_t count = 0;
    bool computing = false;  // a caller is merging/selecting
    // Set by AbortStep while computing: the round must not be voted for.
    absl::Status aborted;
    // While computing: the smallest epoch among its pushes.
    uint64_t epoch = kNewestEpoch;
    // kLayerwise: the per-piece rounds (pushes[w] then holds worker w's
    // metadata -- epoch, checksum, buffers -- and no entries; arrived[w]
    // once all its pieces are in).
    std::unique_ptr<PieceRound> pieces;
    // kLayerwise: when the last worker's push became complete.
    absl::Time completed;
    bool finished = false;
    absl::Status status;  // set when finished
    std::shared_ptr<const RoundResult> result;
    // The ranks whose push is not (completely) in, ascending.
    std::vector<uint32_t> Missing() const {
      std::vector<uint32_t> out;
      for (uint32_t r = 0; r < arrived.size(); ++r) {
        if (!arrived[r]) out.push_back(r);
      }
      return out;
    }
    // `reason`, with "; shard <shard> was still waiting for worker(s)
    // <Missing()>" when some are missing (same code).
    absl::Status WithMissing(uint32_t shard, const absl::Status& reason) const {
      const std::vector<uint32_t> missing = Missing();
      if (missing.empty()) return reason;
      return absl::Status(reason.code(),
                          absl::StrCat(reason.message(), "; shard ", shard,
                                       " was still waiting for worker(s) ",
                                       absl::StrJoin(missing, ", ")));
    }
  };

  ShardAggregator(const ShardOptions& options, OptimizerRule rule,
                  ThresholdExchange* exchange, CommitVoter* commit);

  // Submit's answer: the round's result, or why the push got none.
  using Answer = absl::StatusOr<std::shared_ptr<const RoundResult>>;
  // Submit's parts, in order. JoinRoundLocked: the push's checks (`valid`:
  // ValidatePush's verdict, taken without mu_), then its place in the
  // pending round (opened when none); an answer when the push gets one at
  // once (refused, or the result of a step already applied), else nullopt
  // with the round in *round.
  std::optional<Answer> JoinRoundLocked(
      WorkerPush push, const absl::Status& valid,
      std::shared_ptr<AggregationRound>* round, std::vector<size_t>* ready)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Opens pending_ for `step` (with its PieceRound under kLayerwise), or
  // the drain's refusal.
  std::optional<Answer> OpenRoundLocked(int64_t step)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // kLayerwise (shard_aggregator_pieces.cc): JoinRoundLocked for a push or
  // part once its step is the current one: the worker's pieces stored in
  // the pending round's PieceRound; *ready gets the pieces whose P inputs
  // are now in.
  std::optional<Answer> JoinPiecesLocked(
      WorkerPush push, std::shared_ptr<AggregationRound>* round,
      std::vector<size_t>* ready) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // For a worker whose pushes are in `round` already: ABORTED for a
  // leftover of a failed attempt (an older epoch, or a part after its whole
  // push), refused alone; else nothing.
  std::optional<Answer> RefuseStaleLocked(const WorkerPush& push,
                                          const AggregationRound& round,
                                          const std::string& who) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A whole push of worker w, whose parts or push are in `round` (a
  // retry): `round` to answer from when it is computing or took w's
  // pieces already; `round` with w's pieces dropped when none started;
  // nullptr after failing it (ABORTED) when some did.
  std::shared_ptr<AggregationRound> RetryWholeLocked(
      uint32_t w, std::shared_ptr<AggregationRound> round)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Runs the rounds of `ready` pieces of `round` (each without mu_), and
  // publishes them; a failure (a sum that overflows) fails the step here.
  void RunPiecesLocked(const std::shared_ptr<AggregationRound>& round,
                       const std::vector<size_t>& ready)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // SubmitPart's checks that need no lock: Submit's for a whole push, the
  // run, the entries inside it, the per-piece bound.
  absl::Status ValidatePart(const WorkerPush& part) const;
  // The step's result from its pieces' results (all done), for
  // ComputeAndVote: concatenated in index order and encoded.
  Answer AssemblePieces(AggregationRound& round,
                        std::vector<WorkerPush>& pushes) const;
  // By the caller whose push completed the round: computes it without mu_
  // (ComputeAndVote), then applies it (unless a rollback intervened) or
  // fails it, and runs the step-applied callback without mu_.
  Answer ComputeRoundLocked(const std::shared_ptr<AggregationRound>& round,
                            absl::Time deadline)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The round's computation, without mu_: the divergence alarm, Compute,
  // the finiteness check (kServers), an abort heard meanwhile, and the
  // commit vote. *failed_here: the failure is this shard's own (news to
  // the others), not an ABORTED from the leader.
  Answer ComputeAndVote(AggregationRound& round,
                        std::vector<WorkerPush>& pushes, absl::Time deadline,
                        bool* failed_here) ABSL_LOCKS_EXCLUDED(mu_);
  // The other callers: wait for the round to finish, failing it at
  // `deadline` (naming the workers missing) or when the shard closes.
  Answer AwaitRoundLocked(const std::shared_ptr<AggregationRound>& round,
                          absl::Time deadline)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  absl::Status ValidatePush(const WorkerPush& push) const;
  // The divergence alarm: OK unless `step` is a checksum step and the
  // pushes' params_checksum are not all non-zero and equal; then
  // FAILED_PRECONDITION naming the checksums by rank. Pure.
  absl::Status CheckChecksums(const std::vector<WorkerPush>& pushes,
                              int64_t step) const;
  // Sums and selects the round (called without mu_ held, by the caller that
  // completed it; Submit applies the result). Consumes the pushes' sparse
  // vectors. Returns the result or the failure.
  absl::StatusOr<std::shared_ptr<const RoundResult>> Compute(
      std::vector<WorkerPush>& pushes, int64_t step, absl::Time opened,
      absl::Time deadline, uint64_t epoch);
  // kLayerwise: the top PieceK(k) of each of the shard's pieces of `sum`
  // (sorted by index, inside [begin_, end_)), concatenated in index order
  // into *selected. Pure but for SparseTopK's errors.
  absl::Status SelectPerPiece(const SparseVector& sum, uint64_t k,
                              SparseVector* selected) const;
  // Would applying `result` keep every parameter and global velocity entry
  // finite? OptimizerRule::CheckAggregated(Dense) on the current state
  // (takes mu_ briefly; nothing changes). FAILED_PRECONDITION (via
  // StepNotFinite) naming the index and values when not.
  absl::Status CheckUpdateFinite(const RoundResult& result) const
      ABSL_LOCKS_EXCLUDED(mu_);
  // FAILED_PRECONDITION for a step that cannot be applied because `what`
  // (a sum, a parameter or a velocity) would not be finite.
  absl::Status StepNotFinite(absl::string_view what) const;
  void FailRoundLocked(const std::shared_ptr<AggregationRound>& round,
                       absl::Status status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void FailStepLocked(int64_t step, uint32_t worker, const absl::Status& reason)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // AwaitInitialized with mu_ held (waits on cv_).
  absl::Status AwaitInitializedLocked(absl::Time deadline) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Tells on_step_failed_ (if set) that `step` failed here.
  void NotifyStepFailedLocked(int64_t step, const absl::Status& reason)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const ShardOptions options_;
  const OptimizerRule rule_;
  ThresholdExchange* const exchange_;
  CommitVoter* const commit_;
  const uint64_t begin_, end_;
  // kLayerwise: this shard's pieces (common/buckets.h), in index order.
  std::vector<BucketPiece> pieces_;
  // pieces_ by size: size -> how many. A shard's pieces
  // are full buckets but for its first and last, so at most three sizes:
  // MaxPushPairs, asked for every part, sums over these instead of every
  // piece (it was quadratic in the pieces, one pass per part).
  std::map<uint64_t, uint64_t> piece_sizes_;

  mutable absl::Mutex mu_;
  mutable absl::CondVar cv_;
  bool initialized_ ABSL_GUARDED_BY(mu_) = false;
  int64_t next_step_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<float> params_ ABSL_GUARDED_BY(mu_);
  std::vector<float> global_velocity_ ABSL_GUARDED_BY(mu_);
  // InitParams' state blob (never null).
  std::shared_ptr<const std::string> state_ ABSL_GUARDED_BY(mu_) =
      std::make_shared<const std::string>();
  std::shared_ptr<AggregationRound> pending_ ABSL_GUARDED_BY(mu_);
  std::shared_ptr<AggregationRound> last_
      ABSL_GUARDED_BY(mu_);  // last finished OK
  std::function<void(int64_t)> on_step_applied_ ABSL_GUARDED_BY(mu_);
  std::function<void(int64_t, const absl::Status&)> on_step_failed_
      ABSL_GUARDED_BY(mu_);
  absl::Status closed_ ABSL_GUARDED_BY(mu_);    // not OK after Close
  absl::Status draining_ ABSL_GUARDED_BY(mu_);  // not OK after BeginDrain
  // AbortStep's refusals, by step (only steps >= next_step_ matter): the
  // failure's epoch and reason.
  std::map<int64_t, std::pair<uint64_t, absl::Status>> aborted_
      ABSL_GUARDED_BY(mu_);
  // Incremented by Rollback: a round computed across a rollback is not
  // applied.
  uint64_t rollback_generation_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace server
}  // namespace gtopk

#endif  // GTOPK_SERVER_SHARD_AGGREGATOR_H_
