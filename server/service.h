// The aggregator shard as a gRPC service (gtopk.v1.Aggregator): adapts
// ShardAggregator (server/shard_aggregator.h) to the wire, plus the leader's
// rendezvous (Join, cluster spec), threshold coordinator and commit vote,
// checkpointing, and crash recovery. Its configuration is ServerConfig
// (server/server_config.h); the grpc::Server around it, used by
// gtopk-server's main() and by tests, is AggregatorServer
// (server/aggregator_server.h). The handlers are implemented in
// server/service.cc (construction, the handler preamble Enter, InitParams,
// the leader's votes), server/push_pull.cc, server/download.cc,
// server/service_membership.cc (membership and identity checks) and
// server/recovery.cc (recovery and fail fast). Its components, each with
// its own state and lock: Membership (server/membership.h: ranks, member
// tokens, step streams, reservations, the member file), Checkpointer
// (server/checkpointer.h), DownloadSlots (server/download.h),
// RecoveryCoordinator and AbortForwards (server/recovery_coordinator.h).
//
// Status codes follow docs/errors.md; every handler converts its
// absl::Status with ToGrpcStatus (common/grpc_edge/grpc_edge.h), so the
// code and message a worker sees are the ones produced here or in the core.
#ifndef GTOPK_SERVER_SERVICE_H_
#define GTOPK_SERVER_SERVICE_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/codec.h"
#include "common/metrics/metrics.h"
#include "common/optimizer.h"
#include "gtopk/v1/gtopk.grpc.pb.h"
#include "gtopk/v1/gtopk.pb.h"
#include "server/access.h"
#include "server/call_limits.h"
#include "server/checkpointer.h"
#include "server/commit.h"
#include "server/download.h"
#include "server/leader_client.h"
#include "server/membership.h"
#include "server/recovery_coordinator.h"
#include "server/server_config.h"
#include "server/server_metrics.h"
#include "server/shard_aggregator.h"
#include "server/task_queue.h"
#include "server/threshold.h"

namespace gtopk {
namespace server {

// The grpc.health.v1 service name (besides "", the whole server) that
// reports this shard's checkpoints: SERVING while the last checkpoint write
// succeeded (or none was attempted), NOT_SERVING after a failed one. The
// server stays SERVING for "": a shard whose checkpoints fail still holds
// the cluster's only copy of its parameters in memory, and a liveness or
// readiness probe that restarted it would lose them (server/flags.md).
inline constexpr char kCheckpointHealthService[] = "gtopk.checkpoint";

// DownloadParams' bounds on how long one download may hold one of the
// server's 4 download slots (docs/resource-limits.md, "Parameter
// downloads"): a client that keeps its stream open without reading blocks
// the server's Write on gRPC flow control, and without these bounds holds
// its slot -- and its copy of the shard's range -- until it goes away.
// Past either bound the server cancels the stream (the client sees
// CANCELLED) and counts it in
// gtopk_server_limit_rejections_total{bound="download_time"}.
//
// The assumption behind them: a legitimate client takes every chunk within
// the stall floor or the step timeout, whichever is longer, and reads at
// least kMinDownloadBytesPerSecond (1 MiB/s, 8 Mbit/s) over the whole
// stream. A shard range of 2^32 floats with the global velocity (32 GiB)
// thus gets about 9 hours; a client that takes nothing is cut off after one
// stall bound (31 s with the defaults). A download waiting for a slot waits
// max(step timeout, stall bound + 1 s), within its own deadline, so that
// a worker restarting while stuck streams hold every slot gets one (a
// second break-it run restarted a worker during a stall: with a stall bound
// of 2 x step timeout, longer than that wait, it was refused and the run
// ended).
inline constexpr absl::Duration kDownloadStallFloor = absl::Seconds(2);
inline constexpr uint64_t kMinDownloadBytesPerSecond = uint64_t{1} << 20;

struct DownloadLimits {
  // How long one chunk's Write may wait for the client to take it.
  absl::Duration stall;
  // How long sending all the chunks may take, from the first Write.
  absl::Duration total;
};

// The bounds of a download of `bytes` bytes sent in chunks of at most
// `chunk_bytes` bytes under `config`:
//   stall = max(kDownloadStallFloor, step_timeout)
//           + chunk_bytes / kMinDownloadBytesPerSecond,
//   total = stall + bytes / kMinDownloadBytesPerSecond.
// Durations, never negative. Pure; thread-safe; never blocks or fails.
DownloadLimits DownloadParamsLimits(const ServerConfig& config,
                                    uint64_t chunk_bytes, uint64_t bytes);

// The gtopk.v1.Aggregator service of one shard (synchronous gRPC API: each
// call, and each PushPull stream, runs on its own gRPC thread).
//
// Per-RPC behaviour (all waits end at now + step_timeout at the latest, and
// earlier when the call is cancelled):
//   Join            leader only (others: FAILED_PRECONDITION "shard s is not
//                   the leader; join <leader address>"). n in [1, 2^32]
//                   (INVALID_ARGUMENT); the first Join fixes the cluster's n
//                   unless a checkpoint did; another n -> FAILED_PRECONDITION
//                   naming both counts. requested_rank: -1 = the lowest rank
//                   not yet given out (none left: RESOURCE_EXHAUSTED),
//                   0..P-1 = that rank (a re-join after the rank's worker
//                   went away is allowed; while it has an open, uncancelled
//                   PushPull stream here: ALREADY_EXISTS naming the rank),
//                   >= P or < -1 = INVALID_ARGUMENT. During a drain:
//                   UNAVAILABLE "shard s is shutting down".
//   GetClusterSpec  leader: waits until n is known (DEADLINE_EXCEEDED
//                   otherwise); non-leaders forward to the leader (errors
//                   name it) and answer FAILED_PRECONDITION when the
//                   leader's settings differ from their own
//                   (CheckSameClusterSettings). The request's fields are
//                   ignored.
//   InitParams      chunks must come from worker 0 (PERMISSION_DENIED
//                   otherwise: the caller is well-formed but not allowed to
//                   initialise), be for this shard, contiguous from begin,
//                   inside the range, finite, and cover it exactly
//                   (INVALID_ARGUMENT naming the fault). Idempotent.
//                   ParamsChunk.state pieces (rank 0's state blob) only
//                   to shard 0 under --apply=workers, at most 1 GiB in
//                   all (INVALID_ARGUMENT otherwise); kept with the
//                   parameters, first initialisation wins, not
//                   checkpointed.
//   DownloadParams  worker < P; waits until initialised, then streams chunks
//                   of at most download_chunk_bytes, each with step = next
//                   step. An empty range yields one empty chunk. The state
//                   blob InitParams took (shard 0, --apply=workers) follows
//                   in chunks without values (offset = end of the range),
//                   pieces of at most download_chunk_bytes - 64 bytes. At most
//                   4 at once (the others wait, bounded by their deadline and
//                   max(step timeout, the stall bound + 1 s): DEADLINE_EXCEEDED
//                   "4 parameter downloads already in progress"); a stream that
//                   runs past DownloadParamsLimits (its client stopped reading)
//                   is cancelled (CANCELLED), releasing its slot.
//   PushPull        per Push: first who sends it -- worker < P
//                   (INVALID_ARGUMENT), the cluster fingerprint
//                   (FAILED_PRECONDITION), the rank's member token
//                   (PERMISSION_DENIED / FAILED_PRECONDITION, see below);
//                   such a push is refused alone and ends only its stream.
//                   Then shard_id checked, codecs must be the cluster's,
//                   bytes must decode (all INVALID_ARGUMENT, and the step
//                   fails for every worker); then ShardAggregator::Submit. The
//                   stream ends with the first error (the step's status:
//                   INVALID_ARGUMENT, ABORTED, DEADLINE_EXCEEDED naming missing
//                   workers, FAILED_PRECONDITION for a wrong step, ...). A Pull
//                   larger than max_message_bytes: RESOURCE_EXHAUSTED.
//   ExchangeThreshold, CommitStep  leader only (FAILED_PRECONDITION
//                   otherwise); the wait ends early, failing the round for
//                   every shard, when the calling shard's RPC is cancelled.
//   GetShardState, RollbackShard, Recover  crash recovery, see the proto
//                   and docs/recovery.md; Recover is leader only, and
//                   fences only when the shards disagree. Recover with
//                   resume (--apply=workers only, else FAILED_PRECONDITION;
//                   resume_step >= 0, else INVALID_ARGUMENT) sets every
//                   shard's next step to resume_step.
//   PushPull under --apply=workers: nothing is applied; shard 0 puts rank
//                   0's Push.buffers of the step into every Pull. On a
//                   checksum step (ClusterSpec.checksum_every) differing
//                   params_checksum fail the step (FAILED_PRECONDITION,
//                   every worker, every shard).
//   AbortStep       fail fast (docs/recovery.md, "Failed steps"): a shard
//                   whose round failed for a reason of its own tells the
//                   leader, which numbers the failure (attempt epoch,
//                   common/epoch.h), aborts the step's vote and exchange and
//                   tells every shard; pushes, votes and threshold requests
//                   of the failed attempt (older epochs) are refused with
//                   its ABORTED status. A PushPull stream that failed a step
//                   carries the epoch as trailing metadata "gtopk-epoch".
//   CheckMember     leader only: is a token rank r's current member token.
//
// Resource bounds (docs/resource-limits.md): every RPC above is first
// admitted against --max-concurrent-calls and --max-calls-per-peer
// (AdmitCall; the peer is the rank whose member token a PushPull or Recover
// carries, the shard a vote or exchange names, else the client host); over
// either: RESOURCE_EXHAUSTED naming the flag, before anything is read or
// applied. A push whose header claims more pairs than
// ShardAggregator::MaxPushPairs (k from the density, the selector's most
// per k) is RESOURCE_EXHAUSTED before it is decoded, and fails the step for
// every worker like any bad push.
//
// Cluster identity (docs/errors.md): the shard's cluster fingerprint is
// ClusterFingerprint(CanonicalClusterSpec(config, n)), known once n is.
// Every Push, CommitStep/ExchangeThreshold vote, recovery call and CheckMember
// carries the sender's; another one is FAILED_PRECONDITION before anything
// is applied, and a refused push neither joins nor fails the round. Where
// the shard can, the message names every differing flag with both values
// (CheckSameClusterSettings against the leader's spec).
//
// Rank ownership: Join hands out a random member token per grant; every push
// (and InitParams, Recover) must carry rank's current token. The leader
// checks its own table; the other shards cache one token per rank and ask
// the leader (CheckMember) when a push carries another, so a re-join's new
// token supersedes the old one on a shard at the new holder's first push
// there (and the old token is refused by the leader at once). Missing or
// another holder's token: PERMISSION_DENIED; a rank with no holder:
// FAILED_PRECONDITION. A PushPull call whose metadata carries gtopk-rank and
// gtopk-member-token (valid on the leader) makes the rank alive for Join's
// ALREADY_EXISTS check from the call's start, before its first push.
//
// A non-leader verifies its settings against the leader's spec before it
// serves InitParams, DownloadParams or PushPull: lazily creating its
// ShardAggregator (asking the leader for n), and also when it restored a
// checkpoint, and again after the leader refused its fingerprint; a spec
// whose settings differ fails that call with CheckSameClusterSettings'
// status.
//
// Thread-safety: all methods are thread-safe. Lock order: Membership's
// before mu_ (Join creates the aggregator with it held), both before the
// aggregator's own.

class AggregatorService final : public v1::Aggregator::Service {
 public:
  // Validates `config`; with a checkpoint_dir, restores this shard's
  // checkpoint when there is one (its n fixes the leader's n). Errors:
  // INVALID_ARGUMENT (config), ReadCheckpoint's errors other than NOT_FOUND,
  // FAILED_PRECONDITION for a checkpoint of another layout.
  static absl::StatusOr<std::unique_ptr<AggregatorService>> Create(
      ServerConfig config);
  ~AggregatorService() override;

  const ServerConfig& config() const { return config_; }
  bool is_leader() const { return config_.shard_id == 0; }

  // The address put into the cluster spec for this shard when its peers
  // entry is empty (AggregatorServer sets it to the bound address).
  void SetOwnAddress(const std::string& address);

  // This shard's metrics (thread-safe, lock-free updates).
  ServerMetrics& metrics() { return *metrics_; }

  // Admission control (server/call_limits.h, docs/resource-limits.md):
  // every handler holds one Admission for its whole call. `peer`: the
  // caller's identity as CallPeerRank/CallPeerShard name it; empty: the
  // client host (CallPeerHost of context->peer()). Over a bound:
  // RESOURCE_EXHAUSTED naming the bound and its flag, counted in
  // gtopk_server_limit_rejections_total. Never blocks. Thread-safe.
  absl::StatusOr<CallLimiter::Admission> AdmitCall(
      const grpc::ServerContext* context, absl::string_view method,
      std::string peer = "");
  const CallLimiter& call_limiter() const { return limiter_; }

  // The first step this shard has not applied; -1 while it has no
  // aggregator (n unknown yet).
  int64_t next_step() const;

  // Writes this shard's checkpoint now. OK without a checkpoint_dir or
  // before the shard has parameters (nothing to write); otherwise
  // WriteCheckpoint's (then RetainCheckpoint's) status. Serialised with the
  // periodic writes. A failure leaves the previous checkpoint in place (what
  // a restart restores) and is reported loudly: one line on stderr, the
  // metric gtopk_server_checkpoint_failures_total, and the health listener
  // (grpc.health service kCheckpointHealthService NOT_SERVING) until a
  // later write succeeds.
  absl::Status WriteCheckpointNow();

  // Called with the outcome of every checkpoint write (true: written), and
  // once at once with the current state (true before any write); null
  // detaches. AggregatorServer points it at grpc.health's
  // kCheckpointHealthService. Called with the checkpoint lock held: it
  // must not call back into this service.
  void SetCheckpointHealthListener(std::function<void(bool ok)> listener);

  // Readiness (issue 42): called with the outcome of every comparison of
  // this shard's settings and run identity with the leader's (OK: they
  // agree; FAILED_PRECONDITION naming what differs: this shard refuses
  // work), only when it changes, and once at once with the current state
  // (OK before any comparison); null detaches. AggregatorServer points it
  // at grpc.health's overall status (""), so that a shard started with
  // other flags than the leader's is NOT_SERVING; the reason is in this
  // shard's log and in the answer of its GetClusterSpec. Must not call back
  // into this service.
  void SetReadinessListener(std::function<void(const absl::Status&)> listener);

  // Graceful shutdown (AggregatorServer::Shutdown, before the streams are
  // cancelled), leader with --checkpoint-dir: rewrites the member file
  // keeping only the ranks whose worker has a live step stream now, so that
  // after the restart only live workers' ranks are reserved for them, and a
  // cluster restarted as a whole (its workers gone first) is joined at once.
  // Best effort: a failed write is logged.
  void KeepOnlyLiveMembers();

  // Graceful shutdown's drain (before BeginShutdown): the round in progress
  // may complete; pushes that would open a new round, and Joins, fail with
  // UNAVAILABLE "shard s is shutting down". Does not block.
  void BeginDrain();
  // Waits until no round is open on this shard and no worker's PushPull
  // stream that has pushed is open (polled every 50 ms), up to `deadline`;
  // true when so. (A stream a worker opened at Connect and never pushed on
  // is not waited for.)
  // Thread-safe.
  bool AwaitDrained(absl::Time deadline);

  // Graceful shutdown: pending and later steps, downloads and waits fail
  // with UNAVAILABLE "shard s is shutting down", so that no handler stays
  // blocked. Irreversible. Does not block.
  void BeginShutdown();

  grpc::Status Join(grpc::ServerContext* context,
                    const v1::JoinRequest* request,
                    v1::JoinResponse* response) override;
  grpc::Status GetClusterSpec(grpc::ServerContext* context,
                              const v1::JoinRequest* request,
                              v1::ClusterSpec* response) override;
  grpc::Status InitParams(grpc::ServerContext* context,
                          grpc::ServerReader<v1::ParamsChunk>* reader,
                          v1::InitParamsResponse* response) override;
  grpc::Status DownloadParams(
      grpc::ServerContext* context, const v1::DownloadParamsRequest* request,
      grpc::ServerWriter<v1::ParamsChunk>* writer) override;
  grpc::Status PushPull(
      grpc::ServerContext* context,
      grpc::ServerReaderWriter<v1::Pull, v1::Push>* stream) override;
  grpc::Status CommitStep(grpc::ServerContext* context,
                          const v1::CommitRequest* request,
                          v1::CommitResponse* response) override;
  grpc::Status ExchangeThreshold(grpc::ServerContext* context,
                                 const v1::ThresholdRequest* request,
                                 v1::ThresholdResponse* response) override;
  grpc::Status GetShardState(grpc::ServerContext* context,
                             const v1::ShardStateRequest* request,
                             v1::ShardState* response) override;
  grpc::Status RollbackShard(grpc::ServerContext* context,
                             const v1::RollbackRequest* request,
                             v1::RollbackResponse* response) override;
  grpc::Status Recover(grpc::ServerContext* context,
                       const v1::RecoverRequest* request,
                       v1::RecoverResponse* response) override;
  grpc::Status AbortStep(grpc::ServerContext* context,
                         const v1::AbortStepRequest* request,
                         v1::AbortStepResponse* response) override;
  grpc::Status CheckMember(grpc::ServerContext* context,
                           const v1::MemberCheckRequest* request,
                           v1::MemberCheckResponse* response) override;

  // This shard's cluster fingerprint; 0 while n is not known.
  uint64_t cluster_fingerprint() const { return fingerprint_.load(); }

  // The leader's recovery (what Recover does), callable in-process. Errors
  // as for the Recover RPC. Leader only (FAILED_PRECONDITION otherwise).
  // Serialised: a call made while a recovery of the same kind is running
  // waits for it (up to `deadline` plus kLeaderDeadlineSlack) and returns
  // its outcome; one of another kind waits for it, then runs.
  // `resume_step` (--apply=workers, RecoverRequest.resume): instead of
  // choosing a target from the shards' checkpoints, make every shard's next
  // step *resume_step (ResumeClusterOnce). The Recover RPC refuses it under
  // --apply=servers (FAILED_PRECONDITION) and for a negative step
  // (INVALID_ARGUMENT); this function takes it as given.
  absl::StatusOr<v1::RecoverResponse> RecoverCluster(
      absl::Time deadline, std::optional<int64_t> resume_step = std::nullopt);
  // This shard's side of GetShardState / RollbackShard.
  // `settle`: wait (up to `deadline`) until no round is being computed;
  // otherwise answer at once (GetShardState's without_settling).
  absl::StatusOr<v1::ShardState> LocalShardState(absl::Time deadline,
                                                 bool settle = true);
  absl::StatusOr<int64_t> LocalRollback(int64_t step);
  // Fail fast, the leader's side of AbortStep: `step` failed on shard
  // `origin` for `reason`. Aborts the step's commit vote and threshold
  // exchange and tells every other shard (asynchronously). Leader only.
  void LeaderAbortStep(int64_t step, uint32_t origin,
                       const std::string& reason);

 private:
  // One recovery (RecoverCluster holds the recovering_ flag around it):
  // flush AbortStep, AgreedWithoutFence, else fence, ChooseRecoveryTarget
  // (server/recovery_target.h) and RollBackShardsTo.
  absl::StatusOr<v1::RecoverResponse> RecoverClusterOnce(absl::Time deadline);
  // A resume (--apply=workers): flush AbortStep; when every shard is
  // already at `step`, answer at once (rolled_back false); else fence,
  // forget the commit and threshold state from the lowest step involved,
  // renumber every shard (RollBackShardsTo: ShardAggregator::Rollback
  // accepts any step under kWorkers) and answer `step`, rolled_back true.
  // A shard without parameters or unreachable fails it, naming the shard.
  absl::StatusOr<v1::RecoverResponse> ResumeClusterOnce(int64_t step,
                                                        absl::Time deadline);
  // Reads every shard's state without a fence and without waiting for
  // rounds being computed (up to a quarter step timeout, at least 200 ms,
  // within `deadline`); the answer to Recover when every shard has
  // parameters and all are at the same step, nullopt otherwise.
  std::optional<v1::RecoverResponse> AgreedWithoutFence(absl::Time deadline);
  // Fences the leader's commit vote and threshold exchange with `reason`
  // (waiting and new calls fail with it) until the returned object is
  // destroyed: a recovery or a resume reads and moves the shards meanwhile.
  class LeaderFence {
   public:
    explicit LeaderFence(AggregatorService* service) : service_(service) {}
    LeaderFence(LeaderFence&& other) noexcept : service_(other.service_) {
      other.service_ = nullptr;
    }
    LeaderFence(const LeaderFence&) = delete;
    LeaderFence& operator=(const LeaderFence&) = delete;
    ~LeaderFence();

   private:
    AggregatorService* service_;
  };
  LeaderFence FenceLeader(const absl::Status& reason);
  // Rolls every shard back to `target` (LocalRollback here, RollbackShard on
  // the others, in parallel, each bounded by `deadline`). OK, or the first
  // failure's code with every failure's message, naming the shards.
  absl::Status RollBackShardsTo(int64_t target, absl::Time deadline);
  explicit AggregatorService(ServerConfig config);

  // --- The handler preamble

  // What a handler checks before its own work (Enter), in this order:
  // admission (AdmitCall with `peer`), authorization (AccessControl:
  // AllowWorker for the worker RPCs, AllowShard for the shard RPCs), that
  // this shard is the leader (when leader_only), and the sender's cluster
  // fingerprint (when set; CheckFingerprint with deadline now: only leader
  // RPCs check it here, and the leader never asks anyone).
  struct CallRules {
    // AllowWorker(`rank`, `shard_ok`).
    static CallRules Worker(const char* method,
                            std::optional<int64_t> rank = std::nullopt,
                            bool shard_ok = false);
    // AllowShard(`shard`).
    static CallRules Shard(const char* method, std::optional<uint32_t> shard);
    CallRules& Peer(std::string p) {
      peer = std::move(p);
      return *this;
    }
    // Non-leaders: FAILED_PRECONDITION "shard s is not the leader; <method>
    // goes to <leader address>" ("join <leader address>" for Join).
    CallRules& LeaderOnly() {
      leader_only = true;
      return *this;
    }
    CallRules& Fingerprint(uint64_t f, std::string sender) {
      fingerprint = f;
      who = std::move(sender);
      return *this;
    }

    const char* method = "";
    std::string peer;  // AdmitCall's peer ("": the client host)
    bool from_shard = false;
    std::optional<int64_t> rank;
    bool shard_ok = false;
    std::optional<uint32_t> shard;
    bool leader_only = false;
    std::optional<uint64_t> fingerprint;
    std::string who;  // CheckFingerprint's prefix
  };
  // An entered call: its admission (held until the handler returns) and,
  // for a worker RPC, the authenticated caller.
  struct Call {
    CallLimiter::Admission admission;
    Caller caller;
  };
  // The preamble of every handler: OK with the Call, or the first refusal's
  // status (RESOURCE_EXHAUSTED, UNAUTHENTICATED / PERMISSION_DENIED,
  // FAILED_PRECONDITION), to return as it is.
  absl::StatusOr<Call> Enter(const grpc::ServerContext* context,
                             CallRules rules);

  // --- The shard's aggregator and the cluster

  // The deadline of a wait that starts now: now + step_timeout, or the
  // call's own deadline when earlier.
  absl::Time WaitDeadline(const grpc::ServerContext* context) const;
  // This shard's aggregator, creating it if needed (see the class comment).
  absl::StatusOr<ShardAggregator*> GetAggregator(grpc::ServerContext* context,
                                                 absl::Time deadline);
  // The aggregator if there is one (null before n is known). Never blocks
  // for long.
  ShardAggregator* aggregator() const;
  // Creates the aggregator for `n` (and wires its checkpoint callback).
  absl::Status CreateAggregatorLocked(uint64_t n)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Join: the cluster's n is `n` from now on (the first Join creates the
  // aggregator), else FAILED_PRECONDITION naming both counts.
  absl::Status FixN(uint64_t n);
  // Waits (polling for cancellation) until n is known; the leader only.
  absl::Status AwaitClusterLocked(grpc::ServerContext* context,
                                  absl::Time deadline)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  v1::ClusterSpec BuildSpecLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Non-leaders: the cluster spec from the leader.
  absl::StatusOr<v1::ClusterSpec> FetchSpecFromLeader(
      absl::Time deadline, bool settings_only = false);
  // Non-leaders: CheckSameClusterSettings against the leader's `spec`; the
  // first mismatch is also printed on stderr.
  absl::Status CheckLeaderSpec(const v1::ClusterSpec& spec);
  // Create's restore from this shard's checkpoint, when there is one.
  absl::Status RestoreCheckpoint();

  // --- Fail fast and recovery (server/recovery.cc)

  // The aggregator's step-failed callback: tells the leader (or, on the
  // leader, the other shards) without blocking the caller.
  void OnLocalStepFailed(int64_t step, const absl::Status& reason);
  // LeaderAbortStep's forward of the queued failure of `step` to shards
  // 1..S-1 (a notifier_ task).
  void ForwardAbort(int64_t step);
  // Reads every shard's state (GetShardState), each call bounded by
  // `deadline`; slot s is shard s's state or the error naming it.
  // `settle` as for LocalShardState.
  std::vector<absl::StatusOr<v1::ShardState>> ReadShardStates(
      absl::Time deadline, bool settle);

  // --- Identity (server/service_membership.cc)

  // OK when `fingerprint` is this shard's. Otherwise FAILED_PRECONDITION
  // prefixed with `who`: naming the differing flags when this non-leader's
  // settings differ from the leader's, else saying the sender's cluster
  // has other settings (both fingerprints).
  absl::Status CheckFingerprint(uint64_t fingerprint, const std::string& who,
                                absl::Time deadline);
  // Non-leaders: after the leader refused this shard's fingerprint (a
  // FAILED_PRECONDITION naming "cluster fingerprint" from a leader call),
  // re-verify against the leader's spec; returns the named mismatch, or
  // `status` unchanged.
  absl::Status ExplainLeaderRefusal(const absl::Status& status,
                                    absl::Time deadline);
  // Whether `token` is rank `worker`'s current member token (leader: its
  // table; others: the cache, else CheckMember on the leader). OK, or
  // PERMISSION_DENIED / FAILED_PRECONDITION / the leader's transport error,
  // naming the rank.
  absl::Status CheckMemberToken(uint32_t worker, uint64_t token,
                                absl::Time deadline);
  // The peer key of a call that names rank `rank` with `token`: the rank
  // when `token` is its current member token as this shard knows it (its
  // table or cache; no remote call), else the client host.
  std::string RankPeer(const grpc::ServerContext* context, uint64_t rank,
                       uint64_t token) const;
  // The peer key of a call from shard `shard` (as its request says): the
  // shard when it is one of the cluster's, else the client host.
  std::string ShardPeer(const grpc::ServerContext* context,
                        uint64_t shard) const;
  // Non-leaders, once their settings agree with the leader's: a restored
  // checkpoint must be this cluster's -- its fingerprint this shard's, its
  // run identity `leader_run_id` (when non-zero) -- else
  // FAILED_PRECONDITION naming the file and what differs; an unknown run
  // identity adopts the leader's.
  absl::Status CheckRunId(uint64_t leader_run_id);
  // Stamps a snapshot with this cluster's identity before it is written.
  void StampIdentity(ShardCheckpoint* c) const {
    c->cluster_fingerprint = fingerprint_.load();
    c->run_id = run_id_.load();
  }

  // --- Training (server/push_pull.cc)

  // One PushPull call's state and named steps.
  class PushPullCall;
  // Turns a wire push into a WorkerPush (codec and shard checks, decoding;
  // RESOURCE_EXHAUSTED before decoding a push that claims more pairs than
  // aggregator.MaxPushPairs allows).
  absl::StatusOr<WorkerPush> DecodePush(
      const v1::Push& push, const ShardAggregator& aggregator) const;
  // DownloadParams' chunks of `params` (the values, the global velocity
  // alongside, then the state blob) to `worker` under DownloadParamsLimits.
  grpc::Status SendParams(grpc::ServerContext* context, uint32_t worker,
                          const ShardAggregator& aggregator,
                          const ShardAggregator::State& params,
                          uint64_t chunk_bytes,
                          grpc::ServerWriter<v1::ParamsChunk>* writer);

  // --- Watch threads and readiness

  // The leader's watch thread: every 200 ms, Membership's
  // FailRoundsOfGoneWorkers.
  void WatchGoneWorkers();
  // Non-leaders, from the start: compares this shard's settings with the
  // leader's (GetClusterSpec settings_only) every second until the leader
  // answers and they agree, then stops (every push and vote compares again
  // later); while they differ, every 5 s. Readiness follows each answer, so
  // a shard with other flags is NOT_SERVING before any worker joins.
  void WatchLeaderSettings();
  // Readiness: the last comparison with the leader, and who is told.
  void ReportReadiness(const absl::Status& status);

  const ServerConfig config_;
  std::shared_ptr<prometheus::Registry> metrics_registry_;
  std::unique_ptr<ServerMetrics> metrics_;
  // Calls in flight, in all and per peer (EffectiveCallLimits(config_)).
  CallLimiter limiter_;
  // Authentication and authorization of every handler (server/access.h).
  std::unique_ptr<AccessControl> access_;
  // Ranks, member tokens, step streams, reservations, the member file
  // (server/membership.h; its lock comes before mu_).
  Membership membership_;
  // Checkpoint writes, their health and the history's rewinds.
  Checkpointer checkpointer_;
  // DownloadParams' slots (server/download.h).
  DownloadSlots downloads_;
  // Shard 0 only: the per-step threshold rendezvous and the leader's own way
  // to it.
  std::unique_ptr<ThresholdCoordinator> coordinator_;
  std::unique_ptr<CommitCoordinator> commit_coordinator_;  // leader only
  std::unique_ptr<CommitVoter> commit_;
  // Shards 1..S-1: the channel to the leader (cluster spec, threshold).
  std::shared_ptr<grpc::Channel> leader_channel_;
  std::unique_ptr<v1::Aggregator::Stub> leader_stub_;
  // The exchange the aggregator uses (local on shard 0, gRPC elsewhere).
  std::unique_ptr<ThresholdExchange> exchange_;

  // Serialises non-leaders' lazy creation (one call to the leader at a time).
  absl::Mutex create_mu_ ABSL_ACQUIRED_BEFORE(mu_);
  // The shard's aggregator and what it was made from, the drain and the
  // shutdown, and the watch thread's stop.
  mutable absl::Mutex mu_;
  absl::CondVar cv_;  // signalled when the aggregator appears or on shutdown
  std::string own_address_ ABSL_GUARDED_BY(mu_);
  uint64_t n_ ABSL_GUARDED_BY(mu_) = 0;  // 0: not known yet
  // ClusterFingerprint of this shard's settings with its n; 0 until n is
  // known (set with the aggregator, never changed after).
  std::atomic<uint64_t> fingerprint_{0};
  // The run identity (ClusterSpec.run_id): the leader's own (restored from
  // its checkpoint, or drawn at start); elsewhere the restored checkpoint's
  // until the leader's is known, then the leader's. 0: unknown.
  std::atomic<uint64_t> run_id_{0};
  // Non-leaders: the checkpoint this shard restored at start ("" for none),
  // named when its run identity is not the leader's.
  std::string restored_checkpoint_;
  // Its ShardCheckpoint::cluster_fingerprint (0: none restored, or unknown).
  uint64_t restored_fingerprint_ = 0;
  // Non-leaders: the leader's spec was compared with this shard's settings
  // and agreed; cleared when the leader refuses this shard's fingerprint.
  std::atomic<bool> verified_{false};
  // Non-leaders: the gRPC exchanges to the leader (owned by exchange_ and
  // commit_), told the fingerprint once it is known.
  GrpcThresholdExchange* grpc_exchange_ = nullptr;
  GrpcCommitVoter* grpc_commit_ = nullptr;
  bool watch_stop_ ABSL_GUARDED_BY(mu_) = false;
  // The leader's WatchGoneWorkers, or a non-leader's WatchLeaderSettings.
  std::thread watch_thread_;
  bool shutting_down_ ABSL_GUARDED_BY(mu_) = false;
  std::atomic<bool> mismatch_logged_{false};  // CheckLeaderSpec's one line
  bool draining_ ABSL_GUARDED_BY(mu_) = false;
  // Created once, never replaced: the pointer may be used without mu_.
  std::unique_ptr<ShardAggregator> aggregator_ ABSL_GUARDED_BY(mu_);

  // The leader's stubs to every shard (index 0 unused), for Recover.
  std::vector<std::unique_ptr<v1::Aggregator::Stub>> peer_stubs_;
  // One Recover at a time (server/recovery_coordinator.h).
  RecoveryCoordinator recovery_;
  // The leader's queued forwards of step failures, one per step.
  AbortForwards abort_forwards_;

  absl::Mutex readiness_mu_;
  absl::Status readiness_ ABSL_GUARDED_BY(readiness_mu_);
  std::function<void(const absl::Status&)> readiness_listener_
      ABSL_GUARDED_BY(readiness_mu_);

  // The leader's attempt epoch (common/epoch.h): incremented by every step
  // failure it hears of; starts at its start time in microseconds.
  std::atomic<uint64_t> epoch_{
      static_cast<uint64_t>(absl::ToUnixMicros(absl::Now()))};

  // Fire-and-forget AbortStep messages. Last: destroyed first, before the
  // stubs and the aggregator its tasks use.
  TaskQueue notifier_;
};

}  // namespace server
}  // namespace gtopk

#endif  // GTOPK_SERVER_SERVICE_H_
