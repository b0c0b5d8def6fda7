// AggregatorService (server/service.h): construction, checkpoints, drain and
// shutdown, the shard's aggregator, and the RPC handlers of training
// (InitParams, DownloadParams, PushPull, ExchangeThreshold, CommitStep).
// Membership (Join, GetClusterSpec, CheckMember and the checks of cluster
// identity and rank ownership) is in server/membership.cc; crash recovery
// and fail fast (GetShardState, RollbackShard, Recover, AbortStep) in
// server/recovery.cc.
#include "server/service.h"

#include <sys/stat.h>

#include <cerrno>
#include <filesystem>
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <new>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/cluster_spec.h"
#include "common/grpc_edge.h"
#include "common/selector.h"
#include "common/sparse_vector.h"
#include "common/status_macros.h"
#include "grpcpp/client_context.h"
#include "proto/request_parsing.h"
#include "server/checkpoint.h"
#include "server/member_file.h"
#include "server/request_checks.h"
#include "server/service_internal.h"

namespace gtopk {
namespace server {

using internal::AwaitPolled;
using internal::ContextDeadline;
using internal::kFingerprintMarker;
using internal::kPollInterval;

namespace {
// A restored checkpoint against the shard's own retained ones (defined
// below, with CheckRunId).
absl::Status CheckAgainstHistory(const std::string& dir, uint32_t shard,
                                 const ShardCheckpoint& current);
}  // namespace

namespace {

// Concurrent DownloadParams snapshots per server (each one shard range).
constexpr int kMaxConcurrentDownloads = 4;

// The most bytes of rank 0's state blob (ParamsChunk.state) InitParams
// takes, in all.
constexpr size_t kMaxInitStateBytes = size_t{1} << 30;

// gRPC metadata of a PushPull call naming its rank and member token
// (decimal), so that the leader counts the rank alive from the call's start.
constexpr char kRankMetadata[] = "gtopk-rank";
constexpr char kTokenMetadata[] = "gtopk-member-token";

// The metadata value `key` of `context` parsed as an unsigned decimal;
// false when absent or malformed.
bool MetadataNumber(const grpc::ServerContext* context, const char* key,
                    uint64_t* out) {
  const auto& metadata = context->client_metadata();
  const auto it = metadata.find(key);
  if (it == metadata.end()) return false;
  return absl::SimpleAtoi(
      absl::string_view(it->second.data(), it->second.size()), out);
}

// Cancels a server stream (ServerContext::TryCancel, from its own thread)
// when one Write waits longer than `stall` for the client, or when the
// stream is still writing at `end`. A Write blocked on gRPC flow control
// returns only when the client reads, goes away, or the call is cancelled;
// this is the deadline of that wait. Construct it where the writes start;
// Stop() (or the destructor) joins its thread, so `context` must outlive
// it. Thread-safe; at most one per download slot (4 threads).
class WriteWatchdog {
 public:
  WriteWatchdog(grpc::ServerContext* context, absl::Duration stall,
                absl::Time end)
      : context_(context), stall_(stall), end_(end) {
    thread_ = std::thread([this] { Run(); });
  }
  ~WriteWatchdog() { Stop(); }
  WriteWatchdog(const WriteWatchdog&) = delete;
  WriteWatchdog& operator=(const WriteWatchdog&) = delete;

  // Call around every Write: the stall bound counts from WriteStarted.
  void WriteStarted() {
    absl::MutexLock lock(&mu_);
    write_due_ = absl::Now() + stall_;
  }
  void WriteEnded() {
    absl::MutexLock lock(&mu_);
    write_due_ = absl::InfiniteFuture();
  }

  // Stops watching and joins the thread (blocks at most for a TryCancel
  // under way); idempotent. Returns why the stream was cancelled, empty
  // when it was not: after Stop() nothing cancels it any more, so a handler
  // that gets "" may return OK, and one that gets a reason must return
  // CANCELLED (TryCancel's contract).
  std::string Stop() {
    {
      absl::MutexLock lock(&mu_);
      done_ = true;
    }
    if (thread_.joinable()) thread_.join();
    absl::MutexLock lock(&mu_);
    return reason_;
  }

 private:
  void Run() {
    {
      absl::MutexLock lock(&mu_);
      while (!done_) {
        const absl::Time seen = write_due_;
        auto changed = [this, seen]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
          return done_ || write_due_ != seen;
        };
        if (mu_.AwaitWithDeadline(absl::Condition(&changed),
                                  std::min(end_, seen))) {
          continue;  // done, or another Write started or ended
        }
        const absl::Time now = absl::Now();
        if (now >= seen) {
          reason_ = absl::StrCat("the client took no chunk for ",
                                 absl::FormatDuration(stall_));
        } else if (now >= end_) {
          reason_ = absl::StrCat("the download ran past its bound of ",
                                 absl::FormatDuration(end_ - start_));
        } else {
          continue;  // woke early
        }
        break;
      }
      if (reason_.empty()) return;
    }
    context_->TryCancel();  // unblocks the Write; the handler returns
  }

  grpc::ServerContext* const context_;
  const absl::Duration stall_;
  const absl::Time start_ = absl::Now();
  const absl::Time end_;
  mutable absl::Mutex mu_;
  absl::Time write_due_ ABSL_GUARDED_BY(mu_) = absl::InfiniteFuture();
  bool done_ ABSL_GUARDED_BY(mu_) = false;
  std::string reason_ ABSL_GUARDED_BY(mu_);
  std::thread thread_;
};

}  // namespace

DownloadLimits DownloadParamsLimits(const ServerConfig& config,
                                    uint64_t chunk_bytes, uint64_t bytes) {
  auto transfer = [](uint64_t b) {
    return absl::Seconds(static_cast<double>(b) /
                         static_cast<double>(kMinDownloadBytesPerSecond));
  };
  DownloadLimits limits;
  limits.stall = std::max(kDownloadStallFloor, config.step_timeout) +
                 transfer(chunk_bytes);
  limits.total = limits.stall + transfer(bytes);
  return limits;
}

// ---------------------------------------------------------------------------
// AggregatorService

AggregatorService::AggregatorService(ServerConfig config)
    : config_(std::move(config)),
      metrics_registry_(config_.metrics_registry != nullptr
                            ? config_.metrics_registry
                            : std::make_shared<prometheus::Registry>()),
      metrics_(std::make_unique<ServerMetrics>(*metrics_registry_)),
      limiter_(config_.shard_id, EffectiveCallLimits(config_)),
      access_(std::make_unique<AccessControl>(config_.security,
                                              *metrics_registry_)) {
  rank_given_.assign(config_.num_workers, false);
  member_token_.assign(config_.num_workers, 0);
  rank_reserved_until_.assign(config_.num_workers, absl::InfinitePast());
  gone_since_.assign(config_.num_workers, absl::InfiniteFuture());
  gone_failed_.assign(config_.num_workers, {-1, 0});
  live_streams_.resize(config_.num_workers);
  if (is_leader()) {
    coordinator_ = std::make_unique<ThresholdCoordinator>(config_.num_shards);
    exchange_ = std::make_unique<LocalThresholdExchange>(coordinator_.get());
    commit_coordinator_ =
        std::make_unique<CommitCoordinator>(config_.num_shards);
    commit_ = std::make_unique<LocalCommitVoter>(commit_coordinator_.get());
    peer_stubs_.resize(config_.num_shards);
    for (uint32_t s = 1; s < config_.num_shards; ++s) {
      peer_stubs_[s] = v1::Aggregator::NewStub(
          CreateLimitedChannel(config_.peers[s], config_.max_message_bytes,
                               config_.security));
    }
    watch_thread_ = std::thread([this] { WatchGoneWorkers(); });
  } else {
    leader_channel_ =
        CreateLimitedChannel(config_.peers[0], config_.max_message_bytes,
                             config_.security);
    leader_stub_ = v1::Aggregator::NewStub(leader_channel_);
    auto exchange = std::make_unique<GrpcThresholdExchange>(leader_channel_,
                                                            config_.peers[0]);
    auto commit =
        std::make_unique<GrpcCommitVoter>(leader_channel_, config_.peers[0]);
    grpc_exchange_ = exchange.get();
    grpc_commit_ = commit.get();
    exchange_ = std::move(exchange);
    commit_ = std::move(commit);
    watch_thread_ = std::thread([this] { WatchLeaderSettings(); });
  }
}

AggregatorService::~AggregatorService() {
  if (watch_thread_.joinable()) {
    {
      absl::MutexLock lock(&mu_);
      watch_stop_ = true;
    }
    watch_thread_.join();
  }
}

void AggregatorService::WatchGoneWorkers() {
  const absl::Duration poll = absl::Milliseconds(200);
  absl::MutexLock lock(&mu_);
  while (true) {
    const auto stop = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return watch_stop_;
    };
    if (mu_.AwaitWithTimeout(absl::Condition(&stop), poll)) return;
    if (aggregator_ == nullptr || shutting_down_) continue;
    const absl::Time now = absl::Now();
    for (uint32_t r = 0; r < config_.num_workers; ++r) {
      if (now - gone_since_[r] < internal::kWorkerGoneGrace) continue;
      const std::optional<int64_t> step = aggregator_->RoundAwaiting(r);
      if (!step.has_value()) continue;
      const std::pair<int64_t, uint64_t> attempt{*step, epoch_.load()};
      if (gone_failed_[r] == attempt) continue;
      gone_failed_[r] = attempt;
      const absl::Status reason = absl::UnavailableError(absl::StrCat(
          "worker ", r, " is gone: its step stream to leader shard ",
          config_.shard_id, " closed ",
          absl::FormatDuration(absl::Trunc(now - gone_since_[r],
                                           absl::Milliseconds(100))),
          " ago (the process died or lost its connection) and it has not "
          "come back; step ", *step,
          " cannot complete without it (restart it: it re-joins as rank ", r,
          ")"));
      std::fprintf(stderr, "gtopk-server leader: %s\n",
                   std::string(reason.message()).c_str());
      // RejectPush takes only the aggregator's own lock.
      aggregator_->RejectPush(*step, r, reason);
    }
  }
}

void AggregatorService::WatchLeaderSettings() {
  absl::Duration wait = absl::Seconds(1);
  for (;;) {
    {
      absl::MutexLock lock(&mu_);
      const auto stop = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return watch_stop_ || shutting_down_;
      };
      if (mu_.AwaitWithTimeout(absl::Condition(&stop), wait)) return;
    }
    absl::StatusOr<v1::ClusterSpec> spec = FetchSpecFromLeader(
        absl::Now() + absl::Seconds(2), /*settings_only=*/true);
    if (!spec.ok()) continue;  // the leader is not up yet: ask again
    if (CheckLeaderSpec(*spec).ok()) return;
    wait = absl::Seconds(5);
  }
}

absl::StatusOr<std::unique_ptr<AggregatorService>> AggregatorService::Create(
    ServerConfig config) {
  GTOPK_RETURN_IF_ERROR(ValidateServerConfig(config));
  std::unique_ptr<AggregatorService> service(
      new AggregatorService(std::move(config)));
  const ServerConfig& c = service->config_;
  if (!c.checkpoint_dir.empty()) {
    struct stat st;
    if (stat(c.checkpoint_dir.c_str(), &st) != 0 && errno == ENOENT) {
      // A new run's directory: made, as `mkdir -p` would (a user-facing
      // manual step otherwise; the member file in it holds credentials,
      // so it is private to this user).
      std::error_code made;
      std::filesystem::create_directories(c.checkpoint_dir, made);
      if (!made) {
        std::filesystem::permissions(c.checkpoint_dir,
                                     std::filesystem::perms::owner_all,
                                     made);
      }
    }
    if (stat(c.checkpoint_dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
      return absl::FailedPreconditionError(absl::StrCat(
          "--checkpoint-dir=", c.checkpoint_dir,
          " is not a directory and cannot be created"));
    }
    if (service->is_leader()) {
      // Who held which rank before this leader (re)started: a live worker
      // keeps its rank (Recover with its token), nobody else gets it.
      std::string run_length;
      absl::StatusOr<std::vector<uint64_t>> tokens =
          ReadMemberTokens(c.checkpoint_dir, c.num_workers, &run_length);
      if (tokens.ok()) {
        absl::MutexLock lock(&service->mu_);
        service->run_length_ = run_length;  // workers must still agree
        const absl::Time until =
            absl::Now() + internal::RankReclaimWindow(c.step_timeout);
        for (uint32_t r = 0; r < c.num_workers; ++r) {
          if ((*tokens)[r] == 0) continue;
          // Not given yet: the holder takes it back with its token
          // (Recover), or anyone once the reservation ends.
          service->member_token_[r] = (*tokens)[r];
          service->rank_reserved_until_[r] = until;
        }
      } else if (!absl::IsNotFound(tokens.status())) {
        return tokens.status();
      }
    }
    absl::StatusOr<ShardCheckpoint> checkpoint =
        ReadCheckpoint(c.checkpoint_dir, c.shard_id);
    if (checkpoint.ok()) {
      // Before the history is touched (the restore below prunes and adds
      // to it): a current checkpoint of another cluster or run than this
      // shard's own retained ones was put in their place. Refused, and
      // nothing is changed, so the shard's own checkpoints survive.
      GTOPK_RETURN_IF_ERROR(
          CheckAgainstHistory(c.checkpoint_dir, c.shard_id, *checkpoint));
      absl::MutexLock lock(&service->mu_);
      GTOPK_RETURN_IF_ERROR(service->CreateAggregatorLocked(checkpoint->n));
      // Only this cluster's checkpoint: the same settings (fingerprint) and
      // the same run, checked against the leader's once it is known
      // (CheckRunId: GetAggregator, GetShardState), after the settings
      // themselves (a shard restarted with other flags is told which).
      service->run_id_.store(checkpoint->run_id);
      service->restored_fingerprint_ = checkpoint->cluster_fingerprint;
      service->restored_checkpoint_ =
          CheckpointPath(c.checkpoint_dir, c.shard_id);
      GTOPK_RETURN_IF_ERROR(service->aggregator_->Restore(*checkpoint));
      service->n_ = checkpoint->n;
      // Retained checkpoints newer than the restored one are left over from
      // a crash during a rollback: they belong to abandoned steps. The
      // restored one joins the history (it may predate it).
      GTOPK_RETURN_IF_ERROR(DiscardCheckpointsAfter(
          c.checkpoint_dir, c.shard_id, checkpoint->next_step));
      GTOPK_RETURN_IF_ERROR(RetainCheckpoint(c.checkpoint_dir, c.shard_id,
                                             checkpoint->next_step,
                                             c.checkpoint_keep));
    } else if (!absl::IsNotFound(checkpoint.status())) {
      return checkpoint.status();
    }
  }
  if (service->is_leader() && service->run_id_.load() == 0) {
    // A new run: its identity, for every shard's checkpoints.
    static std::random_device device;
    uint64_t id = 0;
    while (id == 0) id = (uint64_t{device()} << 32) ^ uint64_t{device()};
    service->run_id_.store(id);
  }
  return service;
}

namespace {
absl::Status CheckAgainstHistory(const std::string& dir, uint32_t shard,
                                 const ShardCheckpoint& current) {
  if (current.run_id == 0 && current.cluster_fingerprint == 0) {
    return absl::OkStatus();
  }
  absl::StatusOr<std::vector<int64_t>> steps = ListCheckpointSteps(dir, shard);
  if (!steps.ok() || steps->empty()) return absl::OkStatus();
  // The newest entry of another step than the current one (an entry of the
  // same step may be the very file, a hard link); else that one.
  int64_t step = steps->back();
  for (auto it = steps->rbegin(); it != steps->rend(); ++it) {
    if (*it != current.next_step) {
      step = *it;
      break;
    }
  }
  absl::StatusOr<ShardCheckpoint> retained = ReadCheckpointAt(dir, shard, step);
  if (!retained.ok()) return absl::OkStatus();  // judged when it is used
  const bool other_run = retained->run_id != 0 && current.run_id != 0 &&
                         retained->run_id != current.run_id;
  const bool other_cluster =
      retained->cluster_fingerprint != 0 && current.cluster_fingerprint != 0 &&
      retained->cluster_fingerprint != current.cluster_fingerprint;
  if (!other_run && !other_cluster) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      "shard ", shard, ": checkpoint ", CheckpointPath(dir, shard), " is ",
      other_cluster
          ? absl::StrCat("of cluster fingerprint ",
                         FingerprintText(current.cluster_fingerprint))
          : absl::StrCat("of run ", FingerprintText(current.run_id)),
      " but this shard's retained checkpoint ",
      CheckpointHistoryPath(dir, shard, step), " is ",
      other_cluster
          ? absl::StrCat("of cluster fingerprint ",
                         FingerprintText(retained->cluster_fingerprint))
          : absl::StrCat("of run ", FingerprintText(retained->run_id)),
      ": another cluster's or run's checkpoint was put in place of this "
      "shard's own. Nothing was restored or deleted; put this shard's own "
      "checkpoint back (e.g. copy ",
      CheckpointHistoryPath(dir, shard, steps->back()), " to ",
      CheckpointPath(dir, shard), "), or move the directory away to start "
      "the shard empty"));
}
}  // namespace

absl::Status AggregatorService::CheckRunId(uint64_t leader_run_id) {
  if (is_leader()) return absl::OkStatus();
  const uint64_t fingerprint = fingerprint_.load();
  if (restored_fingerprint_ != 0 && fingerprint != 0 &&
      restored_fingerprint_ != fingerprint) {
    // Called once this shard's settings agree with the leader's: the
    // checkpoint was written with other settings, by another cluster.
    return absl::FailedPreconditionError(absl::StrCat(
        "shard ", config_.shard_id, ": checkpoint ", restored_checkpoint_,
        " was written by a cluster with ", internal::kFingerprintMarker, " ",
        FingerprintText(restored_fingerprint_),
        " but this cluster's (the same settings here and on the leader) is ",
        FingerprintText(fingerprint),
        ": another cluster's checkpoint (other --lr, --momentum, --density, "
        "--selector, ... than this cluster's). Nothing of it was rolled back "
        "into this cluster; put this cluster's own checkpoint there, or move "
        "the file away and restart shard ",
        config_.shard_id, " to start it empty"));
  }
  if (leader_run_id == 0) return absl::OkStatus();
  uint64_t own = run_id_.load();
  if (own == 0) {
    run_id_.compare_exchange_strong(own, leader_run_id);
    return absl::OkStatus();
  }
  if (own == leader_run_id) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      "shard ", config_.shard_id, "'s state is run ", FingerprintText(own),
      restored_checkpoint_.empty()
          ? std::string()
          : absl::StrCat(" (restored from checkpoint ", restored_checkpoint_,
                         ")"),
      " but the leader's cluster is run ", FingerprintText(leader_run_id),
      ": another run's checkpoint (same settings, another run). Nothing was "
      "restored into this cluster; put this run's own checkpoint there, or "
      "move the file away and restart shard ", config_.shard_id,
      " to start it empty"));
}

void AggregatorService::KeepOnlyLiveMembers() {
  if (!is_leader() || config_.checkpoint_dir.empty()) return;
  absl::MutexLock lock(&mu_);
  // Workers that stopped just before this shutdown may have closed their
  // streams a moment ago without this server having seen it yet: give the
  // streams up to kWorkerGoneGrace to end (a worker that stays connected,
  // a rolling restart, keeps its stream open through it).
  const auto none_open = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    for (const auto& streams : live_streams_) {
      for (grpc::ServerContext* stream : streams) {
        if (!stream->IsCancelled()) return false;
      }
    }
    return true;
  };
  AwaitPolled(mu_, absl::Condition(&none_open),
              absl::Now() + internal::kWorkerGoneGrace, nullptr);
  std::vector<uint64_t> live(config_.num_workers, 0);
  for (uint32_t r = 0; r < config_.num_workers; ++r) {
    for (grpc::ServerContext* stream : live_streams_[r]) {
      if (!stream->IsCancelled()) live[r] = member_token_[r];
    }
  }
  const absl::Status saved =
      WriteMemberTokens(config_.checkpoint_dir, live, run_length_);
  if (!saved.ok()) {
    std::fprintf(stderr, "gtopk-server leader: member file at shutdown: %s\n",
                 saved.ToString().c_str());
  }
}

absl::Status AggregatorService::PersistMemberTokensLocked() {
  if (!is_leader() || config_.checkpoint_dir.empty()) return absl::OkStatus();
  return WriteMemberTokens(config_.checkpoint_dir, member_token_,
                           run_length_);
}

absl::StatusOr<CallLimiter::Admission> AggregatorService::AdmitCall(
    const grpc::ServerContext* context, absl::string_view method,
    std::string peer) {
  if (peer.empty()) peer = CallPeerHost(context->peer());
  LimitBound bound = LimitBound::kConcurrentCalls;
  absl::StatusOr<CallLimiter::Admission> admission =
      limiter_.Admit(peer, method, &bound);
  if (!admission.ok()) metrics_->LimitRejected(bound);
  return admission;
}

std::string AggregatorService::RankPeer(const grpc::ServerContext* context,
                                        uint64_t rank, uint64_t token) const {
  if (rank < config_.num_workers && token != 0) {
    absl::MutexLock lock(&mu_);
    if (member_token_[rank] == token) {
      return CallPeerRank(static_cast<uint32_t>(rank));
    }
  }
  return CallPeerHost(context->peer());
}

std::string AggregatorService::ShardPeer(const grpc::ServerContext* context,
                                         uint64_t shard) const {
  if (shard < config_.num_shards) {
    return CallPeerShard(static_cast<uint32_t>(shard));
  }
  return CallPeerHost(context->peer());
}

void AggregatorService::SetOwnAddress(const std::string& address) {
  absl::MutexLock lock(&mu_);
  own_address_ = address;
}

int64_t AggregatorService::next_step() const {
  ShardAggregator* aggregator;
  {
    absl::MutexLock lock(&mu_);
    aggregator = aggregator_.get();
  }
  return aggregator == nullptr ? -1 : aggregator->next_step();
}

absl::Status AggregatorService::WriteCheckpointNow() {
  if (config_.checkpoint_dir.empty()) return absl::OkStatus();
  ShardAggregator* aggregator;
  {
    absl::MutexLock lock(&mu_);
    aggregator = aggregator_.get();
  }
  if (aggregator == nullptr) return absl::OkStatus();
  absl::MutexLock lock(&checkpoint_mu_);
  absl::StatusOr<ShardCheckpoint> snapshot = aggregator->Snapshot();
  if (absl::IsFailedPrecondition(snapshot.status())) {
    return absl::OkStatus();  // no parameters yet: nothing to keep
  }
  absl::Status status = snapshot.status();
  // WriteCheckpoint replaces the current checkpoint only by renaming a
  // complete, fsynced temp file over it: on failure the previous one stays
  // what a restart restores, and the history keeps its entries.
  if (status.ok()) {
    StampIdentity(&*snapshot);
    status = WriteCheckpoint(config_.checkpoint_dir, *snapshot);
  }
  if (status.ok()) {
    metrics_->CheckpointWritten();
    status = RetainCheckpoint(config_.checkpoint_dir, config_.shard_id,
                              snapshot->next_step, config_.checkpoint_keep);
  }
  const bool ok = status.ok();
  if (!ok) {
    metrics_->CheckpointFailed();
    std::fprintf(
        stderr,
        "gtopk-server shard %u: checkpoint of step %lld in %s FAILED (%.0f "
        "failure(s) so far): %s; the previous checkpoint stays the one a "
        "restart restores, and health service \"%s\" is NOT_SERVING until "
        "a checkpoint succeeds\n",
        config_.shard_id,
        snapshot.ok() ? static_cast<long long>(snapshot->next_step) : -1LL,
        config_.checkpoint_dir.c_str(), metrics_->checkpoint_failures(),
        status.ToString().c_str(), kCheckpointHealthService);
  }
  if (ok && !checkpoint_ok_) {
    std::fprintf(stderr,
                 "gtopk-server shard %u: checkpoint of step %lld written; "
                 "checkpoints work again\n",
                 config_.shard_id, static_cast<long long>(snapshot->next_step));
  }
  checkpoint_ok_ = ok;
  if (checkpoint_health_) checkpoint_health_(ok);
  return status;
}

void AggregatorService::ReportReadiness(const absl::Status& status) {
  absl::MutexLock lock(&readiness_mu_);
  if (status.ok() == readiness_.ok()) return;
  readiness_ = status;
  if (readiness_listener_) readiness_listener_(readiness_);
}

void AggregatorService::SetReadinessListener(
    std::function<void(const absl::Status&)> listener) {
  absl::MutexLock lock(&readiness_mu_);
  readiness_listener_ = std::move(listener);
  if (readiness_listener_) readiness_listener_(readiness_);
}

void AggregatorService::SetCheckpointHealthListener(
    std::function<void(bool ok)> listener) {
  absl::MutexLock lock(&checkpoint_mu_);
  checkpoint_health_ = std::move(listener);
  if (checkpoint_health_) checkpoint_health_(checkpoint_ok_);
}

void AggregatorService::BeginDrain() {
  absl::MutexLock lock(&mu_);
  draining_ = true;
  if (aggregator_ != nullptr) {
    aggregator_->BeginDrain(absl::UnavailableError(
        absl::StrCat("shard ", config_.shard_id, " is shutting down")));
  }
}

bool AggregatorService::AwaitDrained(absl::Time deadline) {
  // Drained: no round open, and every worker's step stream closed (a worker
  // whose push was refused with "shutting down" closes its stream; one
  // between steps is told so at its next push).
  while (true) {
    ShardAggregator* aggregator;
    size_t streams = 0;
    {
      absl::MutexLock lock(&mu_);
      aggregator = aggregator_.get();
      for (const auto& live : live_streams_) streams += live.size();
      // Streams opened at a worker's Connect that never pushed: the worker
      // learns of the shutdown at its first push or connection attempt.
      streams -= static_cast<size_t>(idle_streams_);
    }
    const bool no_round =
        aggregator == nullptr || aggregator->AwaitNoRound(std::min(
                                     deadline, absl::Now() + kPollInterval));
    if (no_round && streams == 0) return true;
    if (absl::Now() >= deadline) return false;
    if (no_round) absl::SleepFor(kPollInterval);
  }
}

void AggregatorService::BeginShutdown() {
  absl::MutexLock lock(&mu_);
  if (shutting_down_) return;
  shutting_down_ = true;
  if (aggregator_ != nullptr) {
    aggregator_->Close(absl::UnavailableError(
        absl::StrCat("shard ", config_.shard_id, " is shutting down")));
  }
  cv_.SignalAll();
}

absl::Time AggregatorService::WaitDeadline(
    const grpc::ServerContext* context) const {
  return std::min(absl::Now() + config_.step_timeout, ContextDeadline(context));
}

absl::Status AggregatorService::CreateAggregatorLocked(uint64_t n) {
  ShardOptions options;
  options.shard_id = config_.shard_id;
  options.num_shards = config_.num_shards;
  options.n = n;
  options.num_workers = config_.num_workers;
  options.mode = config_.mode;
  options.selection = config_.selection;
  options.pull_index_codec = config_.index_codec;
  options.optimizer = EffectiveOptimizer(config_);
  options.apply = config_.apply;
  options.checksum_every = EffectiveChecksumEvery(config_);
  options.step_timeout = config_.step_timeout;
  {
    // The bound on a push's pairs follows the workers' selector (e.g.
    // gaussiank returns up to 4k/3). MaxCount is pure arithmetic.
    GTOPK_ASSIGN_OR_RETURN(std::unique_ptr<Selector> selector,
                           CreateSelector(config_.selector));
    std::shared_ptr<const Selector> shared = std::move(selector);
    options.max_pairs_for_k = [shared](uint64_t k) {
      return shared->MaxCount(k);
    };
  }
  GTOPK_ASSIGN_OR_RETURN(
      std::unique_ptr<ShardAggregator> aggregator,
      ShardAggregator::Create(options, exchange_.get(), commit_.get()));
  const uint64_t fingerprint =
      CanonicalClusterSpec(config_, n).cluster_fingerprint();
  fingerprint_.store(fingerprint);
  if (grpc_exchange_ != nullptr) grpc_exchange_->SetClusterFingerprint(fingerprint);
  if (grpc_commit_ != nullptr) grpc_commit_->SetClusterFingerprint(fingerprint);
  aggregator->SetStepFailedCallback(
      [this](int64_t step, const absl::Status& reason) {
        OnLocalStepFailed(step, reason);
      });
  if (config_.checkpoint_every > 0) {
    const int64_t every = config_.checkpoint_every;
    aggregator->SetStepAppliedCallback([this, every](int64_t next_step) {
      if (next_step % every != 0) return;
      // The step stands; only its durability is late. WriteCheckpointNow
      // reports a failure loudly (log, metric, health).
      WriteCheckpointNow().IgnoreError();
    });
  }
  if (draining_) {
    aggregator->BeginDrain(absl::UnavailableError(
        absl::StrCat("shard ", config_.shard_id, " is shutting down")));
  }
  aggregator_ = std::move(aggregator);
  cv_.SignalAll();
  return absl::OkStatus();
}

absl::Status AggregatorService::AwaitClusterLocked(grpc::ServerContext* context,
                                                   absl::Time deadline) {
  while (aggregator_ == nullptr) {
    if (shutting_down_) {
      return absl::UnavailableError(
          absl::StrCat("shard ", config_.shard_id, " is shutting down"));
    }
    if (context != nullptr && context->IsCancelled()) {
      return absl::CancelledError("the call was cancelled");
    }
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat(
          "the cluster has no parameter count yet: no worker has joined "
          "leader shard 0 within ",
          absl::FormatDuration(config_.step_timeout)));
    }
    cv_.WaitWithDeadline(&mu_, std::min(deadline, absl::Now() + kPollInterval));
  }
  return absl::OkStatus();
}

absl::StatusOr<v1::ClusterSpec> AggregatorService::FetchSpecFromLeader(
    absl::Time deadline, bool settings_only) {
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(deadline));
  v1::ClusterSpec spec;
  v1::JoinRequest request;
  request.set_settings_only(settings_only);
  const grpc::Status status =
      leader_stub_->GetClusterSpec(&context, request, &spec);
  if (!status.ok()) {
    return absl::Status(
        static_cast<absl::StatusCode>(status.error_code()),
        absl::StrCat("leader ", config_.peers[0],
                     " (GetClusterSpec): ", status.error_message()));
  }
  return spec;
}

absl::Status AggregatorService::CheckLeaderSpec(const v1::ClusterSpec& spec) {
  uint64_t n;
  {
    absl::MutexLock lock(&mu_);
    n = n_;
  }
  absl::Status same = CheckSameClusterSettings(config_, spec, n);
  if (same.ok()) same = CheckRunId(spec.run_id());
  ReportReadiness(same);
  if (!same.ok() && !mismatch_logged_.exchange(true)) {
    // Once: the operator reads it in this shard's log; every caller gets
    // the status.
    std::fprintf(stderr, "gtopk-server shard %u: %s\n", config_.shard_id,
                 std::string(same.message()).c_str());
  }
  return same;
}

absl::StatusOr<ShardAggregator*> AggregatorService::GetAggregator(
    grpc::ServerContext* context, absl::Time deadline) {
  {
    absl::MutexLock lock(&mu_);
    // A non-leader serves only once its settings agree with the leader's,
    // also when it restored a checkpoint (a restart with other flags).
    if (aggregator_ != nullptr && (is_leader() || verified_.load())) {
      return aggregator_.get();
    }
    if (shutting_down_) {
      return absl::UnavailableError(
          absl::StrCat("shard ", config_.shard_id, " is shutting down"));
    }
    if (is_leader()) {
      GTOPK_RETURN_IF_ERROR(AwaitClusterLocked(context, deadline));
      return aggregator_.get();
    }
  }
  absl::MutexLock create(&create_mu_);
  {
    absl::MutexLock lock(&mu_);
    if (aggregator_ != nullptr && verified_.load()) return aggregator_.get();
  }
  GTOPK_ASSIGN_OR_RETURN(v1::ClusterSpec spec, FetchSpecFromLeader(deadline));
  GTOPK_RETURN_IF_ERROR(CheckLeaderSpec(spec));  // and the run identity
  absl::MutexLock lock(&mu_);
  if (shutting_down_) {
    return absl::UnavailableError(
        absl::StrCat("shard ", config_.shard_id, " is shutting down"));
  }
  if (aggregator_ == nullptr) {
    GTOPK_RETURN_IF_ERROR(CreateAggregatorLocked(spec.n()));
    n_ = spec.n();
  }
  // Belt and braces: CheckLeaderSpec compares every setting by name; the
  // fingerprints must then agree too.
  if (spec.cluster_fingerprint() != 0 &&
      spec.cluster_fingerprint() != fingerprint_.load()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "shard ", config_.shard_id, "'s ", kFingerprintMarker, " ",
        FingerprintText(fingerprint_.load()), " differs from the leader's ",
        FingerprintText(spec.cluster_fingerprint()),
        " although every compared setting agrees"));
  }
  verified_.store(true);
  return aggregator_.get();
}

namespace {

// RESOURCE_EXHAUSTED for a shard range of parameters that does not fit in
// this server's memory (the range follows the cluster's n).
absl::Status OutOfMemoryForRange(uint32_t shard, uint64_t begin,
                                 uint64_t end) {
  return absl::ResourceExhaustedError(absl::StrCat(
      "shard ", shard, " cannot hold its range [", begin, ", ", end, ") of ",
      end - begin, " parameters (", (end - begin) * sizeof(float),
      " bytes): out of memory; use more shards or a smaller model "
      "(docs/resource-limits.md)"));
}

}  // namespace

grpc::Status AggregatorService::InitParams(
    grpc::ServerContext* context, grpc::ServerReader<v1::ParamsChunk>* reader,
    v1::InitParamsResponse* response) {
  GTOPK_ADMIT_CALL(admission, AdmitCall(context, "InitParams"));
  {
    // Only rank 0 initialises: a certificate restricted to another rank is
    // refused before any chunk is read.
    absl::StatusOr<Caller> allowed =
        access_->AllowWorker(*context, "InitParams", int64_t{0});
    if (!allowed.ok()) return ToGrpcStatus(allowed.status());
  }
  const uint32_t shard = config_.shard_id;
  ShardAggregator* aggregator = nullptr;
  std::vector<float> values;
  // ParamsChunk.state pieces, concatenated (shard 0, --apply=workers).
  std::string state;
  uint64_t begin = 0, end = 0, next = 0;
  bool identity_checked = false;  // rank 0's token and the fingerprint
  v1::ParamsChunk chunk;
  auto get_aggregator = [&]() -> absl::Status {
    GTOPK_ASSIGN_OR_RETURN(aggregator,
                           GetAggregator(context, WaitDeadline(context)));
    begin = aggregator->begin();
    end = aggregator->end();
    next = begin;
    // The range follows the n of the first Join (up to 2^32 / S floats):
    // a server without that much memory refuses, it does not abort.
    try {
      values.reserve(end - begin);
    } catch (const std::bad_alloc&) {
      return OutOfMemoryForRange(shard, begin, end);
    }
    return absl::OkStatus();
  };
  proto::TakeRequestParseFailure();  // none yet: forget an earlier call's
  while (reader->Read(&chunk)) {
    metrics_->received_init_bytes().Increment(
        static_cast<double>(chunk.ByteSizeLong()));
    if (const absl::Status sender = CheckInitChunkSender(chunk, shard);
        !sender.ok()) {
      return ToGrpcStatus(sender);
    }
    if (aggregator == nullptr) {
      const absl::Status s = get_aggregator();
      if (!s.ok()) return ToGrpcStatus(s);
    }
    if (!identity_checked) {
      // Only rank 0's holder initialises; from the cluster it joined.
      const absl::Time deadline = WaitDeadline(context);
      if (chunk.cluster_fingerprint() != 0) {
        const absl::Status same = CheckFingerprint(
            chunk.cluster_fingerprint(), "InitParams from worker 0 ", deadline);
        if (!same.ok()) return ToGrpcStatus(same);
      }
      const absl::Status member =
          CheckMemberToken(0, chunk.member_token(), deadline);
      if (!member.ok()) return ToGrpcStatus(member);
      identity_checked = true;
    }
    if (const absl::Status range =
            CheckInitChunkRange(chunk, shard, begin, end, next);
        !range.ok()) {
      return ToGrpcStatus(range);
    }
    if (!chunk.state().empty()) {
      if (config_.apply != ApplyMode::kWorkers || shard != 0) {
        return ToGrpcStatus(absl::InvalidArgumentError(absl::StrCat(
            "InitParams: a state blob goes only to shard 0 with "
            "--apply=workers; this is shard ",
            shard, " with --apply=", ApplyModeName(config_.apply))));
      }
      if (chunk.state().size() > kMaxInitStateBytes - state.size()) {
        return ToGrpcStatus(absl::InvalidArgumentError(absl::StrCat(
            "InitParams: the state blob is over ", kMaxInitStateBytes,
            " bytes (1 GiB) after ", state.size(), " + ",
            chunk.state().size(), " bytes")));
      }
    }
    try {
      values.insert(values.end(), chunk.values().begin(),
                    chunk.values().end());
      state.append(chunk.state());
    } catch (const std::bad_alloc&) {
      return ToGrpcStatus(OutOfMemoryForRange(shard, begin, end));
    }
    next += static_cast<uint64_t>(chunk.values_size());
  }
  if (grpc::Status unparsed = proto::TakeRequestParseFailure();
      !unparsed.ok()) {
    return unparsed;  // a chunk that does not parse, not the end of them
  }
  if (context->IsCancelled()) {
    return grpc::Status(grpc::StatusCode::CANCELLED, "InitParams cancelled");
  }
  if (aggregator == nullptr) {
    const absl::Status s = get_aggregator();
    if (!s.ok()) return ToGrpcStatus(s);
  }
  if (!identity_checked) {
    return ToGrpcStatus(absl::PermissionDeniedError(
        "InitParams without chunks carries no member token; only rank 0's "
        "holder initialises the parameters"));
  }
  if (next != end) {
    return ToGrpcStatus(absl::InvalidArgumentError(absl::StrCat(
        "parameter chunks cover [", begin, ", ", next, ") but shard ", shard,
        " owns [", begin, ", ", end, "): ", end - next, " values missing")));
  }
  absl::StatusOr<bool> taken =
      aggregator->InitParams(values, std::move(state));
  if (!taken.ok()) return ToGrpcStatus(taken.status());
  if (*taken && config_.checkpoint_every > 0) {
    // The initial state (next step 0) is a checkpoint like any step's: a
    // shard restarted before its first periodic checkpoint (or one whose
    // later writes failed) restores it instead of coming back without
    // parameters. A failure is reported like every checkpoint failure
    // (metric, log, health); the parameters are taken either way.
    WriteCheckpointNow().IgnoreError();
  }
  response->set_initialized_now(*taken);
  return grpc::Status::OK;
}

grpc::Status AggregatorService::DownloadParams(
    grpc::ServerContext* context, const v1::DownloadParamsRequest* request,
    grpc::ServerWriter<v1::ParamsChunk>* writer) {
  GTOPK_ADMIT_CALL(admission, AdmitCall(context, "DownloadParams"));
  {
    // The parameters are the model: workers (any rank) and shards only.
    absl::StatusOr<Caller> allowed = access_->AllowWorker(
        *context, "DownloadParams", std::nullopt, /*shard_ok=*/true);
    if (!allowed.ok()) return ToGrpcStatus(allowed.status());
  }
  if (request->worker() >= config_.num_workers) {
    return ToGrpcStatus(absl::InvalidArgumentError(
        absl::StrCat("unknown worker rank ", request->worker(),
                     "; the cluster has ", config_.num_workers, " workers")));
  }
  const absl::Time deadline = WaitDeadline(context);
  absl::StatusOr<ShardAggregator*> aggregator =
      GetAggregator(context, deadline);
  if (!aggregator.ok()) return ToGrpcStatus(aggregator.status());
  if (request->cluster_fingerprint() != 0) {
    const absl::Status same = CheckFingerprint(
        request->cluster_fingerprint(),
        absl::StrCat("DownloadParams from worker ", request->worker(), " "),
        deadline);
    if (!same.ok()) return ToGrpcStatus(same);
  }
  const uint64_t chunk_bytes =
      std::min(config_.download_chunk_bytes, config_.max_message_bytes);
  {
    // A slot is waited for longer than a stalled download may hold one
    // (DownloadParamsLimits' stall bound, + 1 s), within the client's
    // deadline: a worker restarting while stuck streams hold every slot
    // gets one once the server has cancelled them.
    const absl::Duration slot_wait =
        std::max(config_.step_timeout,
                 DownloadParamsLimits(config_, chunk_bytes, 0).stall +
                     absl::Seconds(1));
    // The client's deadline less a slack, so that this refusal, which says
    // why, arrives before the transport's anonymous DEADLINE_EXCEEDED.
    const absl::Time slot_deadline =
        std::min(absl::Now() + slot_wait,
                 ContextDeadline(context) - kLeaderDeadlineSlack);
    absl::MutexLock lock(&download_mu_);
    auto has_slot = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(download_mu_) {
      return active_downloads_ < kMaxConcurrentDownloads;
    };
    if (!AwaitPolled(download_mu_, absl::Condition(&has_slot), slot_deadline,
                     context)) {
      return ToGrpcStatus(absl::DeadlineExceededError(absl::StrCat(
          "shard ", config_.shard_id, ": ", kMaxConcurrentDownloads,
          " parameter downloads already in progress")));
    }
    ++active_downloads_;
  }
  struct Release {
    AggregatorService* self;
    ~Release() {
      absl::MutexLock lock(&self->download_mu_);
      --self->active_downloads_;
    }
  } release{this};
  // Wait in short slices so that a cancelled call or a shutdown ends it.
  absl::StatusOr<ShardAggregator::State> params;
  while (true) {
    params = (*aggregator)
                 ->GetState(std::min(deadline, absl::Now() + kPollInterval));
    if (params.ok() || !absl::IsDeadlineExceeded(params.status()) ||
        absl::Now() >= deadline) {
      break;
    }
    if (context->IsCancelled()) {
      return grpc::Status(grpc::StatusCode::CANCELLED,
                          "DownloadParams cancelled");
    }
  }
  if (!params.ok()) return ToGrpcStatus(params.status());
  const std::vector<float>& values = params->params;
  const std::vector<float>& velocity = params->global_velocity;
  // Shard 0 under --apply=workers: rank 0's state blob, in pieces after
  // the values (chunks without values at the end of the range).
  const std::string& state = *params->state;
  const bool with_velocity = !velocity.empty();
  // 4 bytes per value, 8 with the global velocity alongside.
  const size_t per_chunk = static_cast<size_t>(std::max<uint64_t>(
      1, (chunk_bytes - kChunkOverheadBytes) / (with_velocity ? 8 : 4)));
  const uint64_t begin = (*aggregator)->begin();
  // A client that stops reading blocks Write below on flow control; the
  // watchdog cancels the stream after DownloadParamsLimits, so that the
  // slot is released (by `release`, once, when this handler returns).
  const DownloadLimits limits = DownloadParamsLimits(
      config_, chunk_bytes,
      values.size() * (with_velocity ? uint64_t{8} : uint64_t{4}) +
          state.size());
  const std::string peer = context->peer();  // "unknown" once cancelled
  WriteWatchdog watchdog(context, limits.stall, absl::Now() + limits.total);
  auto cancelled_by_limit = [&](const std::string& reason, size_t at) {
    metrics_->LimitRejected(LimitBound::kDownloadTime);
    const std::string what = absl::StrCat(
        "DownloadParams for worker ", request->worker(), " from ", peer,
        " cancelled at index ", begin + at, " of [", begin, ", ",
        begin + values.size(), "): ", reason,
        ", the bound on a download's slot (docs/resource-limits.md)");
    std::fprintf(stderr, "gtopk-server shard %u: %s\n", config_.shard_id,
                 what.c_str());
    return grpc::Status(grpc::StatusCode::CANCELLED,
                        absl::StrCat("shard ", config_.shard_id, ": ", what));
  };
  size_t offset = 0;
  // A chunk at `offset` (values from there, none past the range's end),
  // its fields set by `fill`; the download's status when it cannot go.
  auto send = [&](auto fill) -> std::optional<grpc::Status> {
    v1::ParamsChunk chunk;
    chunk.set_worker(request->worker());
    chunk.set_shard_id(config_.shard_id);
    chunk.set_offset(begin + offset);
    chunk.set_step(params->next_step);
    fill(chunk);
    watchdog.WriteStarted();
    const bool written = writer->Write(chunk);
    watchdog.WriteEnded();
    if (!written) {
      const std::string reason = watchdog.Stop();
      if (!reason.empty()) return cancelled_by_limit(reason, offset);
      return grpc::Status(grpc::StatusCode::CANCELLED,
                          "the worker went away during DownloadParams");
    }
    metrics_->sent_download_bytes().Increment(
        static_cast<double>(chunk.ByteSizeLong()));
    return std::nullopt;
  };
  do {
    const size_t count = std::min(per_chunk, values.size() - offset);
    if (std::optional<grpc::Status> failed = send([&](v1::ParamsChunk& c) {
          c.mutable_values()->Add(values.begin() + offset,
                                  values.begin() + offset + count);
          if (with_velocity) {
            c.mutable_global_velocity()->Add(
                velocity.begin() + offset, velocity.begin() + offset + count);
          }
        })) {
      return *failed;
    }
    offset += count;
  } while (offset < values.size());
  // The state blob, in pieces of at most chunk_bytes less the overhead
  // (so at most 1 MiB with the default --download-chunk-bytes), each in a
  // chunk without values at the end of the range; the client concatenates
  // the pieces of all chunks in order.
  const size_t per_piece = static_cast<size_t>(
      std::max<uint64_t>(1, chunk_bytes - kChunkOverheadBytes));
  for (size_t at = 0; at < state.size(); at += per_piece) {
    if (std::optional<grpc::Status> failed = send([&](v1::ParamsChunk& c) {
          c.set_state(state.substr(at, per_piece));
        })) {
      return *failed;
    }
  }
  // The watchdog may have cancelled the call as the last Write completed:
  // then the client sees CANCELLED, and so must the handler's status.
  if (const std::string reason = watchdog.Stop(); !reason.empty()) {
    return cancelled_by_limit(reason, offset);
  }
  return grpc::Status::OK;
}

absl::StatusOr<WorkerPush> AggregatorService::DecodePush(
    const v1::Push& push, const ShardAggregator& aggregator) const {
  // Memory per step: refuse a push claiming more pairs than k allows before
  // decoding allocates for them.
  if (config_.mode != AggregationMode::kDense &&
      push.shard_id() == config_.shard_id) {
    absl::StatusOr<uint64_t> claimed = PeekSparseCount(push.sparse());
    const uint64_t most = aggregator.MaxPushPairs(push.step());
    if (claimed.ok() && *claimed > most) {
      metrics_->LimitRejected(LimitBound::kPushPairs);
      return aggregator.PushPairsExhausted(push.worker(), push.step(),
                                           *claimed, most);
    }
  }
  RejectReason reason = RejectReason::kInvalid;
  absl::StatusOr<WorkerPush> decoded =
      DecodeWirePush(push, config_, aggregator.options().n, &reason);
  if (!decoded.ok()) metrics_->Rejected(reason);
  return decoded;
}

grpc::Status AggregatorService::PushPull(
    grpc::ServerContext* context,
    grpc::ServerReaderWriter<v1::Pull, v1::Push>* stream) {
  // A worker's stream names its rank and member token in the metadata: it
  // counts against the rank's own bound, not its host's.
  uint64_t meta_rank = 0, meta_token = 0;
  const bool has_identity = MetadataNumber(context, kRankMetadata, &meta_rank) &&
                            MetadataNumber(context, kTokenMetadata, &meta_token);
  GTOPK_ADMIT_CALL(admission,
                   AdmitCall(context, "PushPull",
                             has_identity
                                 ? RankPeer(context, meta_rank, meta_token)
                                 : std::string()));
  absl::StatusOr<Caller> caller =
      access_->AllowWorker(*context, "PushPull", std::nullopt);
  if (!caller.ok()) return ToGrpcStatus(caller.status());
  ShardAggregator* aggregator = nullptr;
  // The rank this stream acts for: set by a verified identity (the call's
  // metadata on the leader, else the first accepted push); one per stream.
  int64_t stream_worker = -1;
  v1::Push push;
  metrics_->connected_workers().Increment();
  struct Disconnect {
    AggregatorService* self;
    grpc::ServerContext* context;
    int64_t worker = -1;  // registered in live_streams_
    bool idle = false;    // counted in idle_streams_ (no push yet)
    // A push of this stream is in a round whose pull it has not had yet.
    bool in_round = false;
    ~Disconnect() {
      if (worker >= 0) {
        absl::MutexLock lock(&self->mu_);
        auto& live = self->live_streams_[worker];
        live.erase(std::find(live.begin(), live.end(), context));
        if (idle) --self->idle_streams_;
        const bool cancelled = context->IsCancelled();
        // Cancelled, not closed: the worker died or lost its connection,
        // or it cut a failed step short (another shard failed first).
        if (self->is_leader() && live.empty() && cancelled) {
          self->gone_since_[worker] = absl::Now();
        }
        if (self->is_leader() && live.empty() && (!cancelled || in_round)) {
          // Ended by this server (a failed round, a refused push), or
          // cancelled in the middle of a step (the worker cuts its leader
          // stream short when another shard failed): the worker is alive
          // and about to Recover; nobody else may take its rank meanwhile.
          // A worker that died mid-step costs its restart this much: its
          // Join is UNAVAILABLE until then, and Connect retries it. A
          // stream cancelled between steps (the worker ended, or died
          // idle) reserves nothing.
          self->rank_reserved_until_[worker] =
              std::max(self->rank_reserved_until_[worker],
                       absl::Now() + internal::kRankRecoverHold);
        }
      }
      self->metrics_->connected_workers().Decrement();
    }
  } disconnect{this, context};
  auto register_stream = [&](uint32_t worker)
                             ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    stream_worker = worker;
    live_streams_[worker].push_back(context);
    gone_since_[worker] = absl::InfiniteFuture();
    disconnect.worker = worker;
  };
  if (is_leader()) {
    // A worker opens its leader stream right after Join, with its identity
    // in the metadata: the rank is alive (Join: ALREADY_EXISTS) from now,
    // not only from its first push.
    uint64_t rank = 0, token = 0;
    if (MetadataNumber(context, kRankMetadata, &rank) &&
        MetadataNumber(context, kTokenMetadata, &token)) {
      if (rank < config_.num_workers &&
          access_->CheckRank(*caller, "PushPull", static_cast<int64_t>(rank))
              .ok()) {
        absl::MutexLock lock(&mu_);
        if (CheckMemberTokenLocked(static_cast<uint32_t>(rank), token).ok()) {
          register_stream(static_cast<uint32_t>(rank));
          // The holder is back: its live stream now keeps the rank.
          rank_reserved_until_[rank] = absl::InfinitePast();
          rank_given_[rank] = true;
          // Until its first push it does not hold up a drain.
          ++idle_streams_;
          disconnect.idle = true;
        }
      }
      // Tells the worker (WorkerClient waits for it at Connect) that the
      // rank is registered: a Join after this sees it alive.
      stream->SendInitialMetadata();
    }
  }
  proto::TakeRequestParseFailure();  // none yet: forget an earlier call's
  while (stream->Read(&push)) {
    metrics_->received_push_bytes().Increment(
        static_cast<double>(push.ByteSizeLong()));
    {
      // A certificate that names a rank pushes as that rank only; refused
      // alone, like a push without its member token.
      const absl::Status same =
          access_->CheckRank(*caller, "PushPull", push.worker());
      if (!same.ok()) return ToGrpcStatus(same);
    }
    if (stream_worker >= 0 && push.worker() != stream_worker &&
        aggregator != nullptr) {
      const absl::Status mixed = absl::InvalidArgumentError(
          absl::StrCat("push from worker ", push.worker(),
                       " on the PushPull stream of "
                       "worker ",
                       stream_worker, " (one stream per worker and shard)"));
      metrics_->Rejected(RejectReason::kMixedStream);
      aggregator->RejectPush(push.step(), static_cast<uint32_t>(stream_worker),
                             mixed);
      return ToGrpcStatus(mixed);
    }
    if (push.worker() >= config_.num_workers) {
      // Not a member of the round: refused alone.
      metrics_->Rejected(RejectReason::kUnknownWorker);
      return ToGrpcStatus(absl::InvalidArgumentError(
          absl::StrCat("unknown worker rank ", push.worker(),
                       "; the cluster has ", config_.num_workers, " workers")));
    }
    if (aggregator == nullptr || (!is_leader() && !verified_.load())) {
      absl::StatusOr<ShardAggregator*> a =
          GetAggregator(context, WaitDeadline(context));
      if (!a.ok()) return ToGrpcStatus(a.status());
      aggregator = *a;
    }
    {
      // Identity before anything is decoded: a push from another cluster's
      // configuration or from a worker that does not hold the rank is
      // refused alone; it neither joins nor fails the round.
      const std::string who =
          absl::StrCat("worker ", push.worker(), " step ", push.step(), ": ");
      const absl::Time deadline = WaitDeadline(context);
      absl::Status identity =
          CheckFingerprint(push.cluster_fingerprint(), who, deadline);
      if (!identity.ok()) {
        metrics_->Rejected(RejectReason::kWrongCluster);
      } else {
        identity = CheckMemberToken(push.worker(), push.member_token(),
                                    deadline);
        if (!identity.ok()) {
          metrics_->Rejected(RejectReason::kNotMember);
          if (!absl::StartsWith(identity.message(), "leader ")) {
            identity = absl::Status(identity.code(),
                                    absl::StrCat(who, identity.message()));
          }
        }
      }
      if (!identity.ok()) return ToGrpcStatus(identity);
      if (stream_worker < 0 || disconnect.idle) {
        absl::MutexLock lock(&mu_);
        if (stream_worker < 0) register_stream(push.worker());
        if (disconnect.idle) {
          --idle_streams_;
          disconnect.idle = false;
        }
      }
    }
    absl::StatusOr<WorkerPush> decoded =
        DecodePush(push, *aggregator);
    if (!decoded.ok()) {
      // Fail the round for everyone, as a bad push inside Submit would.
      aggregator->RejectPush(push.step(), push.worker(), decoded.status());
      return ToGrpcStatus(decoded.status());
    }
    disconnect.in_round = true;
    absl::StatusOr<std::shared_ptr<const RoundResult>> result =
        aggregator->Submit(*std::move(decoded),
                           absl::Now() + config_.step_timeout);
    if (!result.ok()) {
      // The failed attempt's epoch, when the leader numbered it: the
      // worker's next push of the step is then a retry, not a leftover.
      if (const uint64_t epoch = aggregator->AbortEpoch(push.step());
          epoch > 0) {
        context->AddTrailingMetadata(kEpochMetadataKey, absl::StrCat(epoch));
      }
      // Submit's own rejections of this push (not a round failed by others).
      if (absl::IsResourceExhausted(result.status())) {
        metrics_->LimitRejected(LimitBound::kPushPairs);
      } else if (absl::IsInvalidArgument(result.status())) {
        metrics_->Rejected(RejectReason::kInvalid);
      } else if (absl::IsFailedPrecondition(result.status()) &&
                 absl::StrContains(result.status().message(), "step ")) {
        metrics_->Rejected(RejectReason::kWrongStep);
      }
      // The leader refused this shard's fingerprint (a vote or the
      // threshold exchange): name the flags that differ.
      return ToGrpcStatus(
          ExplainLeaderRefusal(result.status(), WaitDeadline(context)));
    }
    const RoundResult& r = **result;
    metrics_->RoundCompleted(r);
    v1::Pull pull;
    pull.set_step(r.step);
    pull.set_merge_us(
        static_cast<uint64_t>(absl::ToInt64Microseconds(r.merge_time)));
    pull.set_select_us(
        static_cast<uint64_t>(absl::ToInt64Microseconds(r.select_time)));
    pull.set_shard_id(config_.shard_id);
    pull.set_buffers(r.buffers);  // shard 0, --apply=workers; else empty
    if (config_.mode == AggregationMode::kDense) {
      pull.mutable_dense()->Add(r.dense_sum.begin(), r.dense_sum.end());
      pull.set_selected(r.dense_sum.size());
    } else {
      pull.set_sparse(r.encoded);
      pull.set_selected(r.selected.size());
    }
    const size_t bytes = pull.ByteSizeLong();
    if (bytes > config_.max_message_bytes) {
      return ToGrpcStatus(absl::ResourceExhaustedError(absl::StrCat(
          "pull of step ", r.step, " from shard ", config_.shard_id, " is ",
          bytes, " bytes, over max_message_bytes ",
          config_.max_message_bytes)));
    }
    if (!stream->Write(pull)) {
      return grpc::Status(
          grpc::StatusCode::CANCELLED,
          absl::StrCat("worker ", push.worker(),
                       " went away before its pull of step ", r.step));
    }
    disconnect.in_round = false;
    metrics_->sent_pull_bytes().Increment(static_cast<double>(bytes));
  }
  // Read() is false at the client's end of the stream, and for a push that
  // does not parse: that one is INVALID_ARGUMENT, not an orderly end.
  return proto::TakeRequestParseFailure();
}

grpc::Status AggregatorService::ExchangeThreshold(
    grpc::ServerContext* context, const v1::ThresholdRequest* request,
    v1::ThresholdResponse* response) {
  GTOPK_ADMIT_CALL(admission,
                   AdmitCall(context, "ExchangeThreshold",
                             ShardPeer(context, request->shard_id())));
  {
    const absl::Status allowed = access_->AllowShard(
        *context, "ExchangeThreshold", request->shard_id());
    if (!allowed.ok()) return ToGrpcStatus(allowed);
  }
  if (!is_leader()) {
    return ToGrpcStatus(absl::FailedPreconditionError(absl::StrCat(
        "shard ", config_.shard_id,
        " is not the leader; ExchangeThreshold goes to ", config_.peers[0])));
  }
  {
    const absl::Status same = CheckFingerprint(
        request->cluster_fingerprint(),
        absl::StrCat("ExchangeThreshold from shard ", request->shard_id(),
                     " for step ", request->step(), " "),
        absl::Now());
    if (!same.ok()) return ToGrpcStatus(same);
  }
  const absl::Time deadline =
      std::min(absl::Now() + config_.step_timeout,
               ContextDeadline(context) - kLeaderDeadlineSlack);
  absl::StatusOr<ThresholdResponse> answer =
      coordinator_->Submit(FromProto(*request), deadline,
                           [context] { return context->IsCancelled(); });
  if (!answer.ok()) return ToGrpcStatus(answer.status());
  *response = ToProto(*answer);
  return grpc::Status::OK;
}

grpc::Status AggregatorService::CommitStep(grpc::ServerContext* context,
                                           const v1::CommitRequest* request,
                                           v1::CommitResponse* /*response*/) {
  GTOPK_ADMIT_CALL(admission, AdmitCall(context, "CommitStep",
                                        ShardPeer(context, request->shard_id())));
  {
    const absl::Status allowed =
        access_->AllowShard(*context, "CommitStep", request->shard_id());
    if (!allowed.ok()) return ToGrpcStatus(allowed);
  }
  if (!is_leader()) {
    return ToGrpcStatus(absl::FailedPreconditionError(absl::StrCat(
        "shard ", config_.shard_id, " is not the leader; CommitStep goes to ",
        config_.peers[0])));
  }
  {
    const absl::Status same = CheckFingerprint(
        request->cluster_fingerprint(),
        absl::StrCat("CommitStep from shard ", request->shard_id(),
                     " for step ", request->step(), " "),
        absl::Now());
    if (!same.ok()) return ToGrpcStatus(same);
  }
  const absl::Time deadline =
      std::min(absl::Now() + config_.step_timeout,
               ContextDeadline(context) - kLeaderDeadlineSlack);
  return ToGrpcStatus(
      commit_coordinator_->Vote(request->step(), request->shard_id(), deadline,
                                [context] { return context->IsCancelled(); },
                                request->epoch()));
}

}  // namespace server
}  // namespace gtopk
