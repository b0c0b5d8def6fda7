// AggregatorService (server/service.h): construction and restore, the
// handler preamble (Enter), drain and shutdown, the shard's aggregator,
// and the RPC handlers of training that are short (InitParams,
// ExchangeThreshold, CommitStep). PushPull is in server/push_pull.cc,
// DownloadParams in server/download.cc; membership (Join, GetClusterSpec,
// CheckMember and the checks of cluster identity and rank ownership) in
// server/service_membership.cc over the Membership component
// (server/membership.h); crash recovery and fail fast (GetShardState,
// RollbackShard, Recover, AbortStep) in server/recovery.cc.
#include "server/service.h"

#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <new>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/cluster_spec/cluster_spec.h"
#include "common/grpc_edge/grpc_edge.h"
#include "common/selector.h"
#include "common/status_macros.h"
#include "grpcpp/client_context.h"
#include "proto/request_parsing.h"
#include "server/checkpoint.h"
#include "server/member_file.h"
#include "server/request_checks.h"
#include "server/service_internal.h"

namespace gtopk {
namespace server {

using internal::ContextDeadline;
using internal::kFingerprintMarker;
using internal::kPollInterval;

namespace {

// The most bytes of rank 0's state blob (ParamsChunk.state) InitParams
// takes, in all.
constexpr size_t kMaxInitStateBytes = size_t{1} << 30;

}  // namespace

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
                                              *metrics_registry_)),
      membership_(config_.shard_id, config_.num_workers, config_.checkpoint_dir,
                  config_.step_timeout),
      checkpointer_(config_, metrics_.get(),
                    [this](ShardCheckpoint* c) { StampIdentity(c); }) {
  if (is_leader()) {
    coordinator_ = std::make_unique<ThresholdCoordinator>(config_.num_shards);
    exchange_ = std::make_unique<LocalThresholdExchange>(coordinator_.get());
    commit_coordinator_ =
        std::make_unique<CommitCoordinator>(config_.num_shards);
    commit_ = std::make_unique<LocalCommitVoter>(commit_coordinator_.get());
    peer_stubs_.resize(config_.num_shards);
    for (uint32_t s = 1; s < config_.num_shards; ++s) {
      peer_stubs_[s] = v1::Aggregator::NewStub(CreateLimitedChannel(
          config_.peers[s], config_.max_message_bytes, config_.security));
    }
    watch_thread_ = std::thread([this] { WatchGoneWorkers(); });
  } else {
    leader_channel_ = CreateLimitedChannel(
        config_.peers[0], config_.max_message_bytes, config_.security);
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
  while (true) {
    ShardAggregator* aggregator = nullptr;
    {
      absl::MutexLock lock(&mu_);
      const auto stop = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return watch_stop_;
      };
      if (mu_.AwaitWithTimeout(absl::Condition(&stop), poll)) return;
      if (aggregator_ == nullptr || shutting_down_) continue;
      aggregator = aggregator_.get();
    }
    // Membership's lock, then the aggregator's (never mu_ inside it).
    membership_.FailRoundsOfGoneWorkers(*aggregator, epoch_);
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
                                     std::filesystem::perms::owner_all, made);
      }
    }
    if (stat(c.checkpoint_dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
      return absl::FailedPreconditionError(
          absl::StrCat("--checkpoint-dir=", c.checkpoint_dir,
                       " is not a directory and cannot be created"));
    }
    if (service->is_leader()) {
      // Who held which rank before this leader (re)started: a live worker
      // keeps its rank (Recover with its token), nobody else gets it.
      std::string run_length;
      absl::StatusOr<std::vector<uint64_t>> tokens =
          ReadMemberTokens(c.checkpoint_dir, c.num_workers, &run_length);
      if (tokens.ok()) {
        service->membership_.RestoreHolders(*tokens, run_length);
      } else if (!absl::IsNotFound(tokens.status())) {
        return tokens.status();
      }
    }
    GTOPK_RETURN_IF_ERROR(service->RestoreCheckpoint());
  }
  if (service->is_leader() && service->run_id_.load() == 0) {
    // A new run: its identity, for every shard's checkpoints.
    static std::random_device device;
    uint64_t id = 0;
    while (id == 0) id = (uint64_t{device()} << 32) ^ uint64_t { device() };
    service->run_id_.store(id);
  }
  return service;
}

absl::Status AggregatorService::RestoreCheckpoint() {
  GTOPK_ASSIGN_OR_RETURN(std::optional<ShardCheckpoint> checkpoint,
                         checkpointer_.ReadForRestore());
  if (!checkpoint.has_value()) return absl::OkStatus();
  absl::MutexLock lock(&mu_);
  GTOPK_RETURN_IF_ERROR(CreateAggregatorLocked(checkpoint->n));
  // Only this cluster's checkpoint: the same settings (fingerprint) and the
  // same run, checked against the leader's once it is known (CheckRunId:
  // GetAggregator, GetShardState), after the settings themselves (a shard
  // restarted with other flags is told which).
  run_id_.store(checkpoint->run_id);
  restored_fingerprint_ = checkpoint->cluster_fingerprint;
  restored_checkpoint_ =
      CheckpointPath(config_.checkpoint_dir, config_.shard_id);
  GTOPK_RETURN_IF_ERROR(aggregator_->Restore(*checkpoint));
  n_ = checkpoint->n;
  return checkpointer_.Restored(checkpoint->next_step);
}

void AggregatorService::KeepOnlyLiveMembers() {
  membership_.KeepOnlyLiveMembers();
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

// ---------------------------------------------------------------------------
// The handler preamble

AggregatorService::CallRules AggregatorService::CallRules::Worker(
    const char* method, std::optional<int64_t> rank, bool shard_ok) {
  CallRules rules;
  rules.method = method;
  rules.rank = rank;
  rules.shard_ok = shard_ok;
  return rules;
}

AggregatorService::CallRules AggregatorService::CallRules::Shard(
    const char* method, std::optional<uint32_t> shard) {
  CallRules rules;
  rules.method = method;
  rules.from_shard = true;
  rules.shard = shard;
  return rules;
}

absl::StatusOr<AggregatorService::Call> AggregatorService::Enter(
    const grpc::ServerContext* context, CallRules rules) {
  Call call;
  GTOPK_ASSIGN_OR_RETURN(
      call.admission, AdmitCall(context, rules.method, std::move(rules.peer)));
  if (rules.from_shard) {
    GTOPK_RETURN_IF_ERROR(
        access_->AllowShard(*context, rules.method, rules.shard));
  } else {
    GTOPK_ASSIGN_OR_RETURN(
        call.caller, access_->AllowWorker(*context, rules.method, rules.rank,
                                          rules.shard_ok));
  }
  if (rules.leader_only && !is_leader()) {
    const bool join = absl::string_view(rules.method) == "Join";
    return absl::FailedPreconditionError(
        absl::StrCat("shard ", config_.shard_id, " is not the leader; ",
                     join ? "join " : absl::StrCat(rules.method, " goes to "),
                     config_.peers[0]));
  }
  if (rules.fingerprint.has_value()) {
    GTOPK_RETURN_IF_ERROR(
        CheckFingerprint(*rules.fingerprint, rules.who, absl::Now()));
  }
  return call;
}

std::string AggregatorService::RankPeer(const grpc::ServerContext* context,
                                        uint64_t rank, uint64_t token) const {
  if (membership_.Knows(rank, token)) {
    return CallPeerRank(static_cast<uint32_t>(rank));
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

ShardAggregator* AggregatorService::aggregator() const {
  absl::MutexLock lock(&mu_);
  return aggregator_.get();
}

int64_t AggregatorService::next_step() const {
  ShardAggregator* const aggregator = this->aggregator();
  return aggregator == nullptr ? -1 : aggregator->next_step();
}

absl::Status AggregatorService::WriteCheckpointNow() {
  if (config_.checkpoint_dir.empty()) return absl::OkStatus();
  return checkpointer_.WriteNow(aggregator());
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
  checkpointer_.SetHealthListener(std::move(listener));
}

void AggregatorService::BeginDrain() {
  {
    absl::MutexLock lock(&mu_);
    draining_ = true;
    if (aggregator_ != nullptr) {
      aggregator_->BeginDrain(absl::UnavailableError(
          absl::StrCat("shard ", config_.shard_id, " is shutting down")));
    }
  }
  membership_.Close();  // Joins fail (Membership's lock comes before mu_)
}

bool AggregatorService::AwaitDrained(absl::Time deadline) {
  // Drained: no round open, and every worker's step stream closed (a worker
  // whose push was refused with "shutting down" closes its stream; one
  // between steps is told so at its next push). Streams opened at a
  // worker's Connect that never pushed are not counted: the worker learns
  // of the shutdown at its first push or connection attempt.
  while (true) {
    ShardAggregator* const aggregator = this->aggregator();
    const size_t streams = membership_.PushingStreams();
    const bool no_round =
        aggregator == nullptr || aggregator->AwaitNoRound(std::min(
                                     deadline, absl::Now() + kPollInterval));
    if (no_round && streams == 0) return true;
    if (absl::Now() >= deadline) return false;
    if (no_round) absl::SleepFor(kPollInterval);
  }
}

void AggregatorService::BeginShutdown() {
  {
    absl::MutexLock lock(&mu_);
    if (shutting_down_) return;
    shutting_down_ = true;
    if (aggregator_ != nullptr) {
      aggregator_->Close(absl::UnavailableError(
          absl::StrCat("shard ", config_.shard_id, " is shutting down")));
    }
    cv_.SignalAll();
  }
  membership_.Close();
}

absl::Time AggregatorService::WaitDeadline(
    const grpc::ServerContext* context) const {
  return std::min(absl::Now() + config_.step_timeout, ContextDeadline(context));
}

absl::Status AggregatorService::CreateAggregatorLocked(uint64_t n) {
  // Too many bucket pieces for this n: refused before the first step (the
  // worker's Join, a checkpoint's n), not a step that times out.
  GTOPK_RETURN_IF_ERROR(CheckBucketPieces(config_, n));
  ShardOptions options;
  options.shard_id = config_.shard_id;
  options.num_shards = config_.num_shards;
  options.n = n;
  options.num_workers = config_.num_workers;
  options.mode = config_.mode;
  options.selection = config_.selection;
  options.bucket_size = BucketSizeValues(config_);
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
  if (grpc_exchange_ != nullptr)
    grpc_exchange_->SetClusterFingerprint(fingerprint);
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
absl::Status OutOfMemoryForRange(uint32_t shard, uint64_t begin, uint64_t end) {
  return absl::ResourceExhaustedError(absl::StrCat(
      "shard ", shard, " cannot hold its range [", begin, ", ", end, ") of ",
      end - begin, " parameters (", (end - begin) * sizeof(float),
      " bytes): out of memory; use more shards or a smaller model "
      "(docs/resource-limits.md)"));
}

// InitParams: a piece of rank 0's state blob (ParamsChunk.state) of
// `piece` bytes after `so_far`: only to shard 0 with --apply=workers, at
// most kMaxInitStateBytes in all (INVALID_ARGUMENT otherwise).
absl::Status CheckStatePiece(const ServerConfig& config, size_t piece,
                             size_t so_far) {
  if (piece == 0) return absl::OkStatus();
  if (config.apply != ApplyMode::kWorkers || config.shard_id != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "InitParams: a state blob goes only to shard 0 with "
        "--apply=workers; this is shard ",
        config.shard_id, " with --apply=", ApplyModeName(config.apply)));
  }
  if (piece > kMaxInitStateBytes - so_far) {
    return absl::InvalidArgumentError(
        absl::StrCat("InitParams: the state blob is over ", kMaxInitStateBytes,
                     " bytes (1 GiB) after ", so_far, " + ", piece, " bytes"));
  }
  return absl::OkStatus();
}

}  // namespace

grpc::Status AggregatorService::InitParams(
    grpc::ServerContext* context, grpc::ServerReader<v1::ParamsChunk>* reader,
    v1::InitParamsResponse* response) {
  // Only rank 0 initialises: a certificate restricted to another rank is
  // refused before any chunk is read.
  absl::StatusOr<Call> call =
      Enter(context, CallRules::Worker("InitParams", int64_t{0}));
  if (!call.ok()) return ToGrpcStatus(call.status());
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
    if (const absl::Status piece =
            CheckStatePiece(config_, chunk.state().size(), state.size());
        !piece.ok()) {
      return ToGrpcStatus(piece);
    }
    try {
      values.insert(values.end(), chunk.values().begin(), chunk.values().end());
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
  absl::StatusOr<bool> taken = aggregator->InitParams(values, std::move(state));
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

absl::Status AggregatorService::FixN(uint64_t n) {
  absl::MutexLock lock(&mu_);
  if (n_ == 0) {
    GTOPK_RETURN_IF_ERROR(CreateAggregatorLocked(n));
    n_ = n;
    return absl::OkStatus();
  }
  if (n != n_) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the worker has n = ", n, " parameters but the cluster has n = ", n_));
  }
  return absl::OkStatus();
}

grpc::Status AggregatorService::ExchangeThreshold(
    grpc::ServerContext* context, const v1::ThresholdRequest* request,
    v1::ThresholdResponse* response) {
  absl::StatusOr<Call> call = Enter(
      context, CallRules::Shard("ExchangeThreshold", request->shard_id())
                   .Peer(ShardPeer(context, request->shard_id()))
                   .LeaderOnly()
                   .Fingerprint(request->cluster_fingerprint(),
                                absl::StrCat("ExchangeThreshold from shard ",
                                             request->shard_id(), " for step ",
                                             request->step(), " ")));
  if (!call.ok()) return ToGrpcStatus(call.status());
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
  absl::StatusOr<Call> call = Enter(
      context, CallRules::Shard("CommitStep", request->shard_id())
                   .Peer(ShardPeer(context, request->shard_id()))
                   .LeaderOnly()
                   .Fingerprint(request->cluster_fingerprint(),
                                absl::StrCat("CommitStep from shard ",
                                             request->shard_id(), " for step ",
                                             request->step(), " ")));
  if (!call.ok()) return ToGrpcStatus(call.status());
  const absl::Time deadline =
      std::min(absl::Now() + config_.step_timeout,
               ContextDeadline(context) - kLeaderDeadlineSlack);
  return ToGrpcStatus(commit_coordinator_->Vote(
      request->step(), request->shard_id(), deadline,
      [context] { return context->IsCancelled(); }, request->epoch()));
}

}  // namespace server
}  // namespace gtopk
