// Membership: who holds which rank on one shard (AggregatorService,
// server/service.h, owns one). On the leader: the rank table -- member
// tokens granted by Join, ranks reserved for their holders, the run length
// the workers agreed on, the member file that survives a leader restart
// (server/member_file.h) -- and when a rank's worker is gone. On every
// shard: the member tokens the leader confirmed (a cache), and each rank's
// open PushPull streams (a Join for a rank with a live stream is a second
// worker with the same rank, not a restart; a drain waits for the streams
// that pushed).
#ifndef GTOPK_SERVER_MEMBERSHIP_H_
#define GTOPK_SERVER_MEMBERSHIP_H_

#include <atomic>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "grpcpp/server_context.h"
#include "server/shard_aggregator.h"

namespace gtopk {
namespace server {

// Thread-safety: all methods are thread-safe (one mutex). Lock order: this
// class's mutex before AggregatorService's and before the aggregator's
// (Join's `fix_n` and FailRoundsOfGoneWorkers call into them with it held);
// nothing calls into this class with either of those held.
class Membership {
 public:
  // `member_dir`: the leader's --checkpoint-dir, where the member file is
  // kept ("" for none). `step_timeout` sizes the reservations
  // (internal::RankReclaimWindow).
  Membership(uint32_t shard_id, uint32_t num_workers, std::string member_dir,
             absl::Duration step_timeout);
  Membership(const Membership&) = delete;
  Membership& operator=(const Membership&) = delete;

  bool is_leader() const { return shard_id_ == 0; }

  // Leader at start: the holders the member file names (`tokens`, one per
  // rank, 0 for none) keep their ranks reserved for RankReclaimWindow; the
  // workers must still agree with `run_length`.
  void RestoreHolders(const std::vector<uint64_t>& tokens,
                      const std::string& run_length);

  // Graceful shutdown's drain and the shutdown: Join is UNAVAILABLE "shard
  // s is shutting down" from now on. Irreversible.
  void Close();

  // --- Member tokens

  // Whether `token` is rank `worker`'s current member token in this
  // shard's table (leader) or cache (others). OK, or INVALID_ARGUMENT
  // (rank >= P), PERMISSION_DENIED (no token, another holder's),
  // FAILED_PRECONDITION (no holder), naming the rank.
  absl::Status CheckToken(uint32_t worker, uint64_t token) const;
  // AggregatorService::CheckMemberToken's local part: CheckToken's status
  // where this shard decides (the leader; a malformed request; a non-leader
  // whose cache holds `token`), nullopt where a non-leader asks the leader.
  std::optional<absl::Status> CheckTokenHere(uint32_t worker,
                                             uint64_t token) const;
  // Non-leaders: the leader confirmed `token` for `worker`; it supersedes
  // the rank's earlier token here. Precondition: worker < P.
  void ConfirmToken(uint32_t worker, uint64_t token);
  // Whether `token` (non-zero) is rank `rank`'s token as this shard knows
  // it (no remote call): the peer key of the call (CallPeerRank).
  bool Knows(uint64_t rank, uint64_t token) const;

  // --- Join and Recover (leader)

  struct Grant {
    uint32_t rank = 0;
    uint64_t token = 0;  // the new member token
  };
  // The rank table's side of the Join RPC (its contract in service.h) for
  // `requested` (-1: any; else a rank in [0, P)) with the worker's
  // `run_length`: waits up to kRankReleaseGrace (within `context`'s
  // deadline) for the requested rank's streams to unregister, agrees the
  // run length, calls `fix_n` (the cluster's n; its error is returned),
  // chooses the rank and grants it a new token, written to the member
  // file before it is returned. Errors: UNAVAILABLE (closed; the rank's
  // cancelled stream still ending; reserved for its holder; member file
  // not written), ALREADY_EXISTS (live), FAILED_PRECONDITION (run length),
  // RESOURCE_EXHAUSTED (no rank free), `fix_n`'s.
  absl::StatusOr<Grant> Join(int64_t requested, const std::string& run_length,
                             const grpc::ServerContext* context,
                             absl::FunctionRef<absl::Status()> fix_n);
  // Recover from rank `worker`'s holder with `token`: a rank without a
  // known holder (a leader restarted without a member file) takes `token`;
  // the token must then be the rank's; the rank stays reserved for the
  // holder for RankReclaimWindow. Errors: CheckToken's, UNAVAILABLE (member
  // file not written), prefixed "Recover: ". Precondition: worker < P.
  absl::Status Reenter(uint32_t worker, uint64_t token);
  // When a Recover call ends (it may have waited a step timeout for the
  // shards): the reservation is extended again, unless the rank's token is
  // no longer `token` (superseded).
  void Rereserve(uint32_t worker, uint64_t token);

  // --- Step streams

  // One PushPull stream on this shard, registered for a rank once its
  // identity is verified; unregistered when destroyed (see ~Stream).
  // Used by one handler thread.
  class Stream {
   public:
    Stream(Membership* membership, grpc::ServerContext* context)
        : membership_(membership), context_(context) {}
    Stream(const Stream&) = delete;
    Stream& operator=(const Stream&) = delete;
    // Unregisters the stream. On the leader, when it was the rank's last:
    // a cancelled stream marks the worker gone (FailRoundsOfGoneWorkers);
    // one ended by this server, or cancelled while its push was in a round,
    // reserves the rank for kRankRecoverHold.
    ~Stream();

    // The rank this stream acts for; -1 until registered.
    int64_t rank() const { return worker_; }
    // Leader: the call's metadata names `rank` (< P) with `token`: when it
    // is the rank's current token, registers the stream (the rank is alive
    // for Join from now on, and no longer reserved) as idle until its first
    // push. Returns whether it registered.
    bool RegisterFromMetadata(uint32_t rank, uint64_t token);
    // A push of `worker` passed its identity checks: registers the stream
    // for it when not yet registered, and ends its idleness.
    void Pushed(uint32_t worker);
    // Whether a push of this stream is in a round whose pull it has not had.
    void set_in_round(bool in_round) { in_round_ = in_round; }

   private:
    void RegisterLocked(uint32_t worker)
        ABSL_EXCLUSIVE_LOCKS_REQUIRED(membership_->mu_);

    Membership* const membership_;
    grpc::ServerContext* const context_;
    int64_t worker_ = -1;  // registered in live_streams_
    bool idle_ = false;    // counted in idle_streams_ (no push yet)
    bool in_round_ = false;
  };

  // Open step streams that have pushed (AwaitDrained waits for them).
  size_t PushingStreams() const;

  // Leader, every poll of its watch thread: fails the round `aggregator`
  // still waits on for a worker gone longer than kWorkerGoneGrace (its
  // push is rejected UNAVAILABLE naming it), once per step and `epoch`.
  void FailRoundsOfGoneWorkers(ShardAggregator& aggregator,
                               const std::atomic<uint64_t>& epoch);

  // AggregatorService::KeepOnlyLiveMembers (leader with a member file).
  void KeepOnlyLiveMembers();

 private:
  absl::Status CheckTokenLocked(uint32_t worker, uint64_t token) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool RankLiveLocked(uint32_t r) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Join's parts, in order.
  void AwaitRankReleasedLocked(uint32_t r, const grpc::ServerContext* context)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status AgreeRunLengthLocked(int64_t requested,
                                    const std::string& run_length)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status CheckRequestedRankLocked(uint32_t rank) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<uint32_t> FreeRankLocked() const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<uint64_t> GrantLocked(uint32_t rank)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Leader with a member_dir: writes member_token_ to the member file
  // (server/member_file.h). Errors: WriteMemberTokens'.
  absl::Status PersistLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const uint32_t shard_id_;
  const uint32_t num_workers_;
  const std::string member_dir_;
  const absl::Duration step_timeout_;

  mutable absl::Mutex mu_;
  // Drain or shutdown begun: Join refuses.
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<bool> rank_given_ ABSL_GUARDED_BY(mu_);
  // Leader: the run length the first worker stating one joined with
  // (JoinRequest.run_length); "" until then.
  std::string run_length_ ABSL_GUARDED_BY(mu_);
  // Per rank, the member token: on the leader the current grant (0: none
  // since this process started), elsewhere the last token the leader
  // confirmed (0: none yet).
  std::vector<uint64_t> member_token_ ABSL_GUARDED_BY(mu_);
  // Leader, per rank: until when the rank stays reserved for its holder
  // while it has no open step stream (InfinitePast: not reserved; cleared
  // when the holder's step stream registers): the holder the member file
  // named at this process's start (RankReclaimWindow), a holder whose
  // stream this server ended with an error (kRankRecoverHold: its Recover
  // follows), and a holder in Recover (RankReclaimWindow from its call's
  // start and end). A Join of a reserved rank is UNAVAILABLE (issue 42).
  std::vector<absl::Time> rank_reserved_until_ ABSL_GUARDED_BY(mu_);
  // Per rank, the contexts of its open PushPull streams on this shard: a
  // Join for a rank with a stream that is not cancelled is a second worker
  // with the same rank (ALREADY_EXISTS), not a restart.
  std::vector<std::vector<grpc::ServerContext*>> live_streams_
      ABSL_GUARDED_BY(mu_);
  // How many of live_streams_ were registered from their call's metadata
  // and have not pushed yet (AwaitDrained does not wait for them).
  int idle_streams_ ABSL_GUARDED_BY(mu_) = 0;
  // Leader, per rank: since when its worker is gone -- its last step
  // stream here was cancelled (the process died, or its connection broke)
  // and no other is open; InfiniteFuture while it is not. Cleared by a new
  // stream of the rank. The watchdog (FailRoundsOfGoneWorkers) fails a
  // round still waiting for a gone worker's push kWorkerGoneGrace later,
  // instead of at the step deadline (issue 42), once per step and attempt
  // epoch (gone_failed_).
  std::vector<absl::Time> gone_since_ ABSL_GUARDED_BY(mu_);
  std::vector<std::pair<int64_t, uint64_t>> gone_failed_ ABSL_GUARDED_BY(mu_);
};

}  // namespace server
}  // namespace gtopk

#endif  // GTOPK_SERVER_MEMBERSHIP_H_
