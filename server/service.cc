#include "server/service.h"

#include <sys/stat.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <iterator>
#include <random>
#include <thread>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/strings/match.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/notification.h"
#include "common/cluster_spec.h"
#include "common/grpc_edge.h"
#include "common/host_port.h"
#include "common/selector.h"
#include "common/sparse_vector.h"
#include "common/status_macros.h"
#include "grpcpp/client_context.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/health_check_service_interface.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server_builder.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/stub_options.h"
#include "server/checkpoint.h"

namespace gtopk {
namespace server {
namespace {

// How often waits wake up to look for a cancelled call or a shutdown.
constexpr absl::Duration kPollInterval = absl::Milliseconds(50);
// Concurrent DownloadParams snapshots per server (each one shard range).
constexpr int kMaxConcurrentDownloads = 4;
// Room for the non-value fields of a ParamsChunk (varints, tags).
constexpr uint64_t kChunkOverheadBytes = 64;
// Largest S and P (--num-shards, --workers; server/flags.md).
constexpr uint32_t kMaxShards = 1u << 16;
constexpr uint32_t kMaxWorkers = 1u << 16;

int ClampToInt(uint64_t v) {
  return static_cast<int>(
      std::min<uint64_t>(v, static_cast<uint64_t>(INT_MAX)));
}

absl::Time ContextDeadline(const grpc::ServerContext* context) {
  if (context == nullptr) return absl::InfiniteFuture();
  const auto deadline = context->deadline();
  if (deadline == std::chrono::system_clock::time_point::max()) {
    return absl::InfiniteFuture();
  }
  return absl::FromChrono(deadline);
}

v1::Mode ModeToProto(AggregationMode mode) {
  switch (mode) {
    case AggregationMode::kGtopk:
      return v1::MODE_GTOPK;
    case AggregationMode::kTopk:
      return v1::MODE_TOPK;
    case AggregationMode::kDense:
      return v1::MODE_DENSE;
  }
  return v1::MODE_UNSPECIFIED;
}

v1::MomentumMode MomentumToProto(MomentumMode mode) {
  switch (mode) {
    case MomentumMode::kNone:
      return v1::MOMENTUM_MODE_NONE;
    case MomentumMode::kDgcCorrection:
      return v1::MOMENTUM_MODE_DGC;
    case MomentumMode::kGlobal:
      return v1::MOMENTUM_MODE_GLOBAL;
  }
  return v1::MOMENTUM_MODE_UNSPECIFIED;
}

// gRPC metadata of a PushPull call naming its rank and member token
// (decimal), so that the leader counts the rank alive from the call's start.
constexpr char kRankMetadata[] = "gtopk-rank";
constexpr char kTokenMetadata[] = "gtopk-member-token";
// In every fingerprint refusal's message; non-leaders look for it in a
// leader call's status (ExplainLeaderRefusal).
constexpr char kFingerprintMarker[] = "cluster fingerprint";

// A fresh member token: 64 random bits from the OS source, never 0. Not
// model state, so not seeded (runs stay bit-identical without it).
uint64_t NewMemberToken() {
  static std::random_device device;
  uint64_t token = 0;
  while (token == 0) {
    token = (uint64_t{device()} << 32) ^ uint64_t{device()};
  }
  return token;
}

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

}  // namespace

absl::Status ValidateServerConfig(const ServerConfig& c) {
  if (c.num_shards < 1 || c.num_shards > kMaxShards) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--num-shards must be in [1, ", kMaxShards, "], got ", c.num_shards));
  }
  if (c.shard_id >= c.num_shards) {
    return absl::InvalidArgumentError(
        absl::StrCat("--shard-id must be below --num-shards (", c.num_shards,
                     "), got ", c.shard_id));
  }
  if (c.num_workers < 1 || c.num_workers > kMaxWorkers) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--workers must be in [1, ", kMaxWorkers, "], got ", c.num_workers));
  }
  if (c.peers.size() != c.num_shards) {
    return absl::InvalidArgumentError(
        absl::StrCat("--peers must list --num-shards (", c.num_shards,
                     ") addresses in shard order, got ", c.peers.size()));
  }
  for (uint32_t s = 0; s < c.num_shards; ++s) {
    if (s == c.shard_id && c.peers[s].empty()) continue;
    const absl::Status address = ValidateHostPort("peers", c.peers[s], 1);
    if (!address.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat(address.message(), " (entry ", s, ", shard ", s, ")"));
    }
  }
  if (c.selection == SelectionKind::kQuota &&
      c.mode != AggregationMode::kGtopk) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--selection=quota applies to --mode=gtopk only, got --mode=",
        AggregationModeName(c.mode),
        " (omit --selection or use --selection=exact)"));
  }
  SelectorRegistry registry;
  GTOPK_RETURN_IF_ERROR(RegisterBuiltinSelectors(&registry));
  const std::vector<std::string> names = registry.Names();
  if (std::find(names.begin(), names.end(), c.selector) == names.end()) {
    return absl::InvalidArgumentError(absl::StrCat("--selector must be one of ",
                                                   absl::StrJoin(names, ", "),
                                                   "; got '", c.selector, "'"));
  }
  if (IndexCodecName(c.index_codec) == "unknown") {
    return absl::InvalidArgumentError("--index-codec is not a known codec");
  }
  if (ValueCodecName(c.value_codec) == "unknown") {
    return absl::InvalidArgumentError("--value-codec is not a known codec");
  }
  if (c.step_timeout < absl::Milliseconds(1) ||
      c.step_timeout >= absl::Milliseconds(UINT32_MAX)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--step-timeout must be in [1ms, 2^32 ms), got ",
        absl::FormatDuration(c.step_timeout)));
  }
  if (c.max_message_bytes < 1024 ||
      c.max_message_bytes > static_cast<uint64_t>(INT_MAX)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--max-message-bytes must be in [1024, 2^31-1], got ",
                     c.max_message_bytes));
  }
  if (c.download_chunk_bytes < kChunkOverheadBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("download_chunk_bytes must be >= ", kChunkOverheadBytes,
                     ", got ", c.download_chunk_bytes));
  }
  if (c.checkpoint_every < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--checkpoint-every must be >= 0, got ", c.checkpoint_every));
  }
  if (c.checkpoint_keep < 1 || c.checkpoint_keep > 1000) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--checkpoint-keep must be in [1, 1000], got ", c.checkpoint_keep));
  }
  if (c.checkpoint_every > 0 && c.checkpoint_dir.empty()) {
    return absl::InvalidArgumentError(
        "--checkpoint-every > 0 needs --checkpoint-dir");
  }
  // The optimizer, by flag (ValidateOptimizerOptions below is the
  // backstop; its messages name the fields).
  const OptimizerOptions& o = c.optimizer;
  if (!(std::isfinite(o.lr) && o.lr > 0.0f)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--lr must be finite and > 0 (as a 32-bit float), got ", o.lr));
  }
  if (!(o.momentum >= 0.0f && o.momentum < 1.0f)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--momentum must be in [0, 1) (as a 32-bit float), got ", o.momentum));
  }
  if (!(std::isfinite(o.weight_decay) && o.weight_decay >= 0.0f)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--weight-decay must be finite and >= 0, got ", o.weight_decay));
  }
  if (o.lr_warmup_steps < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--lr-warmup-steps must be >= 0, got ", o.lr_warmup_steps));
  }
  if (!(o.density > 0.0 && o.density <= 1.0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--density must be in (0, 1], got ", o.density));
  }
  for (size_t e = 0; e < o.density_warmup.size(); ++e) {
    const double d = o.density_warmup[e];
    if (!(d > 0.0 && d <= 1.0)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--density-warmup: entry ", e,
                       " must be in (0, 1], got ", d));
    }
  }
  if (o.steps_per_epoch < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--steps-per-epoch must be >= 0, got ", o.steps_per_epoch));
  }
  if (!o.density_warmup.empty() && o.steps_per_epoch == 0) {
    return absl::InvalidArgumentError(
        "--density-warmup needs --steps-per-epoch > 0");
  }
  absl::Status s = ValidateOptimizerOptions(c.optimizer);
  if (!s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("optimizer: ", s.message()));
  }
  return absl::OkStatus();
}

v1::ClusterSpec ClusterSettingsSpec(const ServerConfig& config) {
  v1::ClusterSpec spec;
  spec.set_num_workers(config.num_workers);
  spec.set_mode(ModeToProto(config.mode));
  spec.set_selection(config.selection == SelectionKind::kExact
                         ? v1::SELECTION_THRESHOLD
                         : v1::SELECTION_QUOTA);
  spec.set_selector(config.selector);
  spec.set_selector_seed(config.selector_seed);
  spec.set_index_codec(std::string(IndexCodecName(config.index_codec)));
  spec.set_value_codec(std::string(ValueCodecName(config.value_codec)));
  const OptimizerOptions& o = config.optimizer;
  v1::OptimizerSpec* opt = spec.mutable_optimizer();
  opt->set_lr(o.lr);
  opt->set_momentum(o.momentum);
  opt->set_momentum_mode(MomentumToProto(o.momentum_mode));
  opt->set_momentum_factor_masking(o.momentum_factor_masking);
  opt->set_weight_decay(o.weight_decay);
  opt->set_lr_warmup_steps(o.lr_warmup_steps);
  opt->set_density(o.density);
  opt->mutable_density_warmup()->Add(o.density_warmup.begin(),
                                     o.density_warmup.end());
  opt->set_steps_per_epoch(o.steps_per_epoch);
  spec.set_step_timeout_ms(
      static_cast<uint32_t>(absl::ToInt64Milliseconds(config.step_timeout)));
  spec.set_max_message_bytes(config.max_message_bytes);
  return spec;
}

v1::ClusterSpec CanonicalClusterSpec(const ServerConfig& config, uint64_t n) {
  v1::ClusterSpec spec = ClusterSettingsSpec(config);
  spec.set_n(n);
  for (uint32_t s = 0; s < config.num_shards; ++s) {
    v1::ShardSpec* shard = spec.add_shards();
    shard->set_shard_id(s);
    const auto range = ShardRange(n, config.num_shards, s);
    shard->set_begin(range.first);
    shard->set_end(range.second);
  }
  spec.set_cluster_fingerprint(ClusterFingerprint(spec));
  return spec;
}

absl::Status CheckSameClusterSettings(const ServerConfig& own,
                                      const v1::ClusterSpec& leader,
                                      uint64_t own_n) {
  v1::ClusterSpec mine = ClusterSettingsSpec(own);
  // S and the settings here; n is compared below with its origin named,
  // and the ranges follow from n and S.
  if (static_cast<uint32_t>(leader.shards_size()) == own.num_shards) {
    *mine.mutable_shards() = leader.shards();
  } else {
    for (uint32_t s = 0; s < own.num_shards; ++s) {
      mine.add_shards()->set_shard_id(s);
    }
  }
  v1::ClusterSpec theirs = leader;
  theirs.set_n(0);
  std::vector<std::string> differences =
      ClusterSpecDifferences(mine, theirs, "on the leader");
  if (own_n != 0 && leader.n() != 0 && own_n != leader.n()) {
    differences.push_back(absl::StrCat(
        "the parameter count n is ", own_n,
        " here (from this shard's checkpoint) but ", leader.n(),
        " on the leader"));
  }
  if (differences.empty()) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      "shard ", own.shard_id, " is configured differently from the leader, "
      "shard 0 (", own.peers.empty() ? std::string() : own.peers[0], "): ",
      absl::StrJoin(differences, "; "),
      ". Start every shard with the same cluster flags (server/flags.md)"));
}

// ---------------------------------------------------------------------------
// AggregatorService

AggregatorService::AggregatorService(ServerConfig config)
    : config_(std::move(config)),
      metrics_registry_(config_.metrics_registry != nullptr
                            ? config_.metrics_registry
                            : std::make_shared<prometheus::Registry>()),
      metrics_(std::make_unique<ServerMetrics>(*metrics_registry_)) {
  rank_given_.assign(config_.num_workers, false);
  member_token_.assign(config_.num_workers, 0);
  live_streams_.resize(config_.num_workers);
  if (is_leader()) {
    coordinator_ = std::make_unique<ThresholdCoordinator>(config_.num_shards);
    exchange_ = std::make_unique<LocalThresholdExchange>(coordinator_.get());
    commit_coordinator_ =
        std::make_unique<CommitCoordinator>(config_.num_shards);
    commit_ = std::make_unique<LocalCommitExchange>(commit_coordinator_.get());
    peer_stubs_.resize(config_.num_shards);
    for (uint32_t s = 1; s < config_.num_shards; ++s) {
      peer_stubs_[s] = v1::Aggregator::NewStub(
          CreateLimitedChannel(config_.peers[s], config_.max_message_bytes));
    }
  } else {
    leader_channel_ =
        CreateLimitedChannel(config_.peers[0], config_.max_message_bytes);
    leader_stub_ = v1::Aggregator::NewStub(leader_channel_);
    auto exchange = std::make_unique<GrpcThresholdExchange>(leader_channel_,
                                                            config_.peers[0]);
    auto commit =
        std::make_unique<GrpcCommitExchange>(leader_channel_, config_.peers[0]);
    grpc_exchange_ = exchange.get();
    grpc_commit_ = commit.get();
    exchange_ = std::move(exchange);
    commit_ = std::move(commit);
  }
}

AggregatorService::~AggregatorService() = default;

absl::StatusOr<std::unique_ptr<AggregatorService>> AggregatorService::Create(
    ServerConfig config) {
  GTOPK_RETURN_IF_ERROR(ValidateServerConfig(config));
  std::unique_ptr<AggregatorService> service(
      new AggregatorService(std::move(config)));
  const ServerConfig& c = service->config_;
  if (!c.checkpoint_dir.empty()) {
    struct stat st;
    if (stat(c.checkpoint_dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
      return absl::FailedPreconditionError(
          absl::StrCat("--checkpoint-dir=", c.checkpoint_dir,
                       " is not an existing directory"));
    }
    absl::StatusOr<ShardCheckpoint> checkpoint =
        ReadCheckpoint(c.checkpoint_dir, c.shard_id);
    if (checkpoint.ok()) {
      absl::MutexLock lock(&service->mu_);
      GTOPK_RETURN_IF_ERROR(service->CreateAggregatorLocked(checkpoint->n));
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
  return service;
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
  if (status.ok()) status = WriteCheckpoint(config_.checkpoint_dir, *snapshot);
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
  options.optimizer = config_.optimizer;
  options.step_timeout = config_.step_timeout;
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
    absl::Time deadline) {
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(deadline));
  v1::ClusterSpec spec;
  const grpc::Status status =
      leader_stub_->GetClusterSpec(&context, v1::JoinRequest(), &spec);
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
  GTOPK_RETURN_IF_ERROR(CheckLeaderSpec(spec));
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

absl::Status AggregatorService::CheckFingerprint(uint64_t fingerprint,
                                                 const std::string& who,
                                                 absl::Time deadline) {
  const uint64_t own = fingerprint_.load();
  if (own != 0 && fingerprint == own) return absl::OkStatus();
  if (!is_leader()) {
    // Is it this shard that differs from the leader? Then name the flags.
    absl::StatusOr<v1::ClusterSpec> spec = FetchSpecFromLeader(deadline);
    if (spec.ok()) {
      const absl::Status same = CheckLeaderSpec(*spec);
      if (!same.ok()) {
        verified_.store(false);
        return absl::FailedPreconditionError(
            absl::StrCat(who, "refused: ", same.message()));
      }
    }
  }
  if (fingerprint == 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        who, "carries no ", kFingerprintMarker,
        " (ClusterSpec.cluster_fingerprint); this shard's is ",
        FingerprintText(own), ". Update the client"));
  }
  return absl::FailedPreconditionError(absl::StrCat(
      who, "was made for ", kFingerprintMarker, " ",
      FingerprintText(fingerprint), " but shard ", config_.shard_id,
      "'s cluster is ", FingerprintText(own),
      own == 0 ? " (unknown: no parameter count yet)" : "",
      ": the sender joined a cluster with other settings (a shard or the "
      "leader restarted with other flags since, or another cluster); "
      "nothing was applied"));
}

absl::Status AggregatorService::ExplainLeaderRefusal(const absl::Status& status,
                                                     absl::Time deadline) {
  if (is_leader() || !absl::IsFailedPrecondition(status) ||
      !absl::StrContains(status.message(), kFingerprintMarker)) {
    return status;
  }
  verified_.store(false);
  absl::StatusOr<v1::ClusterSpec> spec = FetchSpecFromLeader(deadline);
  if (!spec.ok()) return status;
  const absl::Status same = CheckLeaderSpec(*spec);
  if (same.ok()) return status;
  return absl::FailedPreconditionError(
      absl::StrCat(same.message(), " (", status.message(), ")"));
}

absl::Status AggregatorService::CheckMemberTokenLocked(uint32_t worker,
                                                       uint64_t token) const {
  if (worker >= config_.num_workers) {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown worker rank ", worker, "; the cluster has ",
                     config_.num_workers, " workers"));
  }
  if (token == 0) {
    return absl::PermissionDeniedError(absl::StrCat(
        "rank ", worker, ": no member token (JoinResponse.member_token); only "
        "the worker that joined as rank ", worker, " may act as it"));
  }
  const uint64_t current = member_token_[worker];
  if (current == 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "rank ", worker, " has not joined leader shard 0 (never, or not since "
        "the leader restarted): Join first; a worker that held the rank "
        "re-registers it with Recover"));
  }
  if (token != current) {
    return absl::PermissionDeniedError(absl::StrCat(
        "rank ", worker, " is held by another worker: this member token is "
        "not the rank's current one (a later Join of rank ", worker,
        " replaced it, or it was never granted)"));
  }
  return absl::OkStatus();
}

absl::Status AggregatorService::CheckMemberToken(uint32_t worker,
                                                 uint64_t token,
                                                 absl::Time deadline) {
  {
    absl::MutexLock lock(&mu_);
    if (is_leader() || worker >= config_.num_workers || token == 0) {
      return CheckMemberTokenLocked(worker, token);
    }
    if (member_token_[worker] == token) return absl::OkStatus();
  }
  // A token this shard has not seen for the rank: ask the leader.
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(deadline));
  v1::MemberCheckRequest request;
  request.set_worker(worker);
  request.set_member_token(token);
  request.set_cluster_fingerprint(fingerprint_.load());
  v1::MemberCheckResponse response;
  const grpc::Status status =
      leader_stub_->CheckMember(&context, request, &response);
  if (!status.ok()) {
    const absl::Status st = absl::Status(
        static_cast<absl::StatusCode>(status.error_code()),
        absl::StrCat("leader ", config_.peers[0],
                     " (CheckMember): ", status.error_message()));
    return ExplainLeaderRefusal(st, deadline);
  }
  absl::MutexLock lock(&mu_);
  // The leader confirmed it: it supersedes the rank's earlier token here.
  member_token_[worker] = token;
  return absl::OkStatus();
}

v1::ClusterSpec AggregatorService::BuildSpecLocked() const {
  v1::ClusterSpec spec = ClusterSettingsSpec(config_);
  spec.set_n(n_);
  for (uint32_t s = 0; s < config_.num_shards; ++s) {
    v1::ShardSpec* shard = spec.add_shards();
    shard->set_shard_id(s);
    shard->set_address(s == config_.shard_id && config_.peers[s].empty()
                           ? own_address_
                           : config_.peers[s]);
    const auto range = ShardRange(n_, config_.num_shards, s);
    shard->set_begin(range.first);
    shard->set_end(range.second);
  }
  spec.set_next_step(aggregator_ != nullptr ? aggregator_->next_step() : 0);
  spec.set_cluster_fingerprint(fingerprint_.load());
  return spec;
}

grpc::Status AggregatorService::Join(grpc::ServerContext* /*context*/,
                                     const v1::JoinRequest* request,
                                     v1::JoinResponse* response) {
  if (!is_leader()) {
    return ToGrpcStatus(absl::FailedPreconditionError(
        absl::StrCat("shard ", config_.shard_id, " is not the leader; join ",
                     config_.peers[0])));
  }
  const uint64_t n = request->n();
  if (n < 1 || n > kMaxDenseLength) {
    return ToGrpcStatus(absl::InvalidArgumentError(
        absl::StrCat("n must be in [1, 2^32], got ", n)));
  }
  const int64_t requested = request->requested_rank();
  if (requested < -1 || requested >= int64_t{config_.num_workers}) {
    return ToGrpcStatus(absl::InvalidArgumentError(absl::StrCat(
        "requested_rank ", requested, " is out of range: the cluster has ",
        config_.num_workers, " workers (ranks 0..", config_.num_workers - 1,
        "; -1 for any)")));
  }
  absl::MutexLock lock(&mu_);
  if (shutting_down_ || draining_) {
    return ToGrpcStatus(absl::UnavailableError(
        absl::StrCat("shard ", config_.shard_id, " is shutting down")));
  }
  if (n_ == 0) {
    const absl::Status created = CreateAggregatorLocked(n);
    if (!created.ok()) return ToGrpcStatus(created);
    n_ = n;
  } else if (n != n_) {
    return ToGrpcStatus(absl::FailedPreconditionError(absl::StrCat(
        "the worker has n = ", n, " parameters but the cluster has n = ", n_)));
  }
  uint32_t rank = 0;
  if (requested >= 0) {
    rank = static_cast<uint32_t>(requested);
    // A worker restarting after a crash has no open stream (its connection
    // closed with it); one that still has one is another, live worker.
    for (grpc::ServerContext* stream : live_streams_[rank]) {
      if (!stream->IsCancelled()) {
        return ToGrpcStatus(absl::AlreadyExistsError(absl::StrCat(
            "rank ", rank,
            " is already taken by a live worker (it has an "
            "open PushPull stream on shard ",
            config_.shard_id,
            "); start this worker with another --rank, or stop the other "
            "one first")));
      }
    }
  } else {
    while (rank < config_.num_workers && rank_given_[rank]) ++rank;
    if (rank == config_.num_workers) {
      return ToGrpcStatus(absl::ResourceExhaustedError(
          absl::StrCat("all ", config_.num_workers,
                       " ranks are taken; ask for a rank explicitly to "
                       "re-join")));
    }
  }
  rank_given_[rank] = true;
  // A new token per grant: the rank's earlier holder (gone) is superseded.
  member_token_[rank] = NewMemberToken();
  response->set_member_token(member_token_[rank]);
  response->set_rank(rank);
  response->set_epoch(epoch_.load());
  *response->mutable_cluster() = BuildSpecLocked();
  return grpc::Status::OK;
}

grpc::Status AggregatorService::GetClusterSpec(
    grpc::ServerContext* context, const v1::JoinRequest* /*request*/,
    v1::ClusterSpec* response) {
  const absl::Time deadline = WaitDeadline(context);
  if (!is_leader()) {
    absl::StatusOr<v1::ClusterSpec> spec = FetchSpecFromLeader(deadline);
    if (!spec.ok()) return ToGrpcStatus(spec.status());
    // Workers ask every shard at Connect: a shard started with other
    // settings than the leader refuses here, before any step.
    const absl::Status same = CheckLeaderSpec(*spec);
    if (!same.ok()) return ToGrpcStatus(same);
    *response = *std::move(spec);
    return grpc::Status::OK;
  }
  absl::MutexLock lock(&mu_);
  const absl::Status ready = AwaitClusterLocked(context, deadline);
  if (!ready.ok()) return ToGrpcStatus(ready);
  *response = BuildSpecLocked();
  return grpc::Status::OK;
}

grpc::Status AggregatorService::InitParams(
    grpc::ServerContext* context, grpc::ServerReader<v1::ParamsChunk>* reader,
    v1::InitParamsResponse* response) {
  const uint32_t shard = config_.shard_id;
  ShardAggregator* aggregator = nullptr;
  std::vector<float> values;
  uint64_t begin = 0, end = 0, next = 0;
  bool identity_checked = false;  // rank 0's token and the fingerprint
  v1::ParamsChunk chunk;
  auto get_aggregator = [&]() -> absl::Status {
    GTOPK_ASSIGN_OR_RETURN(aggregator,
                           GetAggregator(context, WaitDeadline(context)));
    begin = aggregator->begin();
    end = aggregator->end();
    next = begin;
    values.reserve(end - begin);
    return absl::OkStatus();
  };
  while (reader->Read(&chunk)) {
    metrics_->received_init_bytes().Increment(
        static_cast<double>(chunk.ByteSizeLong()));
    if (chunk.worker() != 0) {
      return ToGrpcStatus(absl::PermissionDeniedError(absl::StrCat(
          "only worker 0 initialises the parameters; got a chunk from worker ",
          chunk.worker())));
    }
    if (chunk.shard_id() != shard) {
      return ToGrpcStatus(absl::InvalidArgumentError(
          absl::StrCat("parameter chunk for shard ", chunk.shard_id(),
                       " was sent to shard ", shard)));
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
    const uint64_t offset = chunk.offset();
    const uint64_t count = static_cast<uint64_t>(chunk.values_size());
    if (offset != next) {
      return ToGrpcStatus(absl::InvalidArgumentError(
          absl::StrCat("parameter chunk at offset ", offset, " ",
                       offset < next ? "overlaps" : "leaves a gap after",
                       " the values received so far: expected offset ", next,
                       " (shard ", shard, " owns [", begin, ", ", end, "))")));
    }
    if (count > end - offset) {
      return ToGrpcStatus(absl::InvalidArgumentError(
          absl::StrCat("parameter chunk [", offset, ", ", offset + count,
                       ") runs past the end of shard ", shard, "'s range [",
                       begin, ", ", end, ")")));
    }
    for (uint64_t j = 0; j < count; ++j) {
      if (!std::isfinite(chunk.values(static_cast<int>(j)))) {
        return ToGrpcStatus(absl::InvalidArgumentError(absl::StrCat(
            "initial parameter at index ", offset + j, " is not finite (",
            chunk.values(static_cast<int>(j)), ")")));
      }
    }
    values.insert(values.end(), chunk.values().begin(), chunk.values().end());
    next = offset + count;
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
  absl::StatusOr<bool> taken = aggregator->InitParams(values);
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
  {
    absl::MutexLock lock(&download_mu_);
    auto has_slot = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(download_mu_) {
      return active_downloads_ < kMaxConcurrentDownloads;
    };
    while (!download_mu_.AwaitWithDeadline(
        absl::Condition(&has_slot),
        std::min(deadline, absl::Now() + kPollInterval))) {
      if (context->IsCancelled() || absl::Now() >= deadline) {
        return ToGrpcStatus(absl::DeadlineExceededError(absl::StrCat(
            "shard ", config_.shard_id, ": ", kMaxConcurrentDownloads,
            " parameter downloads already in progress")));
      }
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
  const bool with_velocity = !velocity.empty();
  const uint64_t chunk_bytes =
      std::min(config_.download_chunk_bytes, config_.max_message_bytes);
  // 4 bytes per value, 8 with the global velocity alongside.
  const size_t per_chunk = static_cast<size_t>(std::max<uint64_t>(
      1, (chunk_bytes - kChunkOverheadBytes) / (with_velocity ? 8 : 4)));
  const uint64_t begin = (*aggregator)->begin();
  size_t offset = 0;
  do {
    const size_t count = std::min(per_chunk, values.size() - offset);
    v1::ParamsChunk chunk;
    chunk.set_worker(request->worker());
    chunk.set_shard_id(config_.shard_id);
    chunk.set_offset(begin + offset);
    chunk.set_step(params->next_step);
    chunk.mutable_values()->Add(values.begin() + offset,
                                values.begin() + offset + count);
    if (with_velocity) {
      chunk.mutable_global_velocity()->Add(velocity.begin() + offset,
                                           velocity.begin() + offset + count);
    }
    if (!writer->Write(chunk)) {
      return grpc::Status(grpc::StatusCode::CANCELLED,
                          "the worker went away during DownloadParams");
    }
    metrics_->sent_download_bytes().Increment(
        static_cast<double>(chunk.ByteSizeLong()));
    offset += count;
  } while (offset < values.size());
  return grpc::Status::OK;
}

absl::StatusOr<WorkerPush> AggregatorService::DecodePush(const v1::Push& push,
                                                         uint64_t n) const {
  const std::string who =
      absl::StrCat("worker ", push.worker(), " step ", push.step(), ": ");
  if (push.shard_id() != config_.shard_id) {
    metrics_->Rejected(RejectReason::kWrongShard);
    return absl::InvalidArgumentError(
        absl::StrCat(who, "push for shard ", push.shard_id(),
                     " was sent to shard ", config_.shard_id));
  }
  if (push.worker() >= config_.num_workers) {
    metrics_->Rejected(RejectReason::kUnknownWorker);
    return absl::InvalidArgumentError(
        absl::StrCat("unknown worker rank ", push.worker(),
                     "; the cluster has ", config_.num_workers, " workers"));
  }
  WorkerPush out;
  out.step = push.step();
  out.worker = push.worker();
  out.epoch = push.epoch();
  if (config_.mode == AggregationMode::kDense) {
    if (!push.sparse().empty()) {
      metrics_->Rejected(RejectReason::kWrongMode);
      return absl::InvalidArgumentError(
          absl::StrCat(who, "sparse bytes sent in dense mode"));
    }
    out.dense.assign(push.dense().begin(), push.dense().end());
    return out;
  }
  if (push.dense_size() > 0) {
    metrics_->Rejected(RejectReason::kWrongMode);
    return absl::InvalidArgumentError(
        absl::StrCat(who, "dense values sent in ",
                     AggregationModeName(config_.mode), " mode"));
  }
  absl::StatusOr<CodecSpec> spec = PeekCodecSpec(push.sparse());
  if (!spec.ok()) {
    metrics_->Rejected(RejectReason::kCorrupt);
    return absl::InvalidArgumentError(
        absl::StrCat(who, "corrupt sparse push: ", spec.status().message()));
  }
  if (spec->index != config_.index_codec ||
      spec->value != config_.value_codec) {
    metrics_->Rejected(RejectReason::kWrongCodec);
    return absl::InvalidArgumentError(absl::StrCat(
        who, "wrong codec: the push uses ", IndexCodecName(spec->index), "/",
        ValueCodecName(spec->value), ", the cluster uses ",
        IndexCodecName(config_.index_codec), "/",
        ValueCodecName(config_.value_codec)));
  }
  absl::Status decoded = DecodeSparse(push.sparse(), n, &out.sparse);
  if (!decoded.ok()) {
    metrics_->Rejected(RejectReason::kCorrupt);
    return absl::InvalidArgumentError(
        absl::StrCat(who, "bad sparse push: ", decoded.message()));
  }
  return out;
}

grpc::Status AggregatorService::PushPull(
    grpc::ServerContext* context,
    grpc::ServerReaderWriter<v1::Pull, v1::Push>* stream) {
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
    ~Disconnect() {
      if (worker >= 0) {
        absl::MutexLock lock(&self->mu_);
        auto& live = self->live_streams_[worker];
        live.erase(std::find(live.begin(), live.end(), context));
        if (idle) --self->idle_streams_;
      }
      self->metrics_->connected_workers().Decrement();
    }
  } disconnect{this, context};
  auto register_stream = [&](uint32_t worker)
                             ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    stream_worker = worker;
    live_streams_[worker].push_back(context);
    disconnect.worker = worker;
  };
  if (is_leader()) {
    // A worker opens its leader stream right after Join, with its identity
    // in the metadata: the rank is alive (Join: ALREADY_EXISTS) from now,
    // not only from its first push.
    uint64_t rank = 0, token = 0;
    if (MetadataNumber(context, kRankMetadata, &rank) &&
        MetadataNumber(context, kTokenMetadata, &token)) {
      if (rank < config_.num_workers) {
        absl::MutexLock lock(&mu_);
        if (CheckMemberTokenLocked(static_cast<uint32_t>(rank), token).ok()) {
          register_stream(static_cast<uint32_t>(rank));
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
  while (stream->Read(&push)) {
    metrics_->received_push_bytes().Increment(
        static_cast<double>(push.ByteSizeLong()));
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
        DecodePush(push, aggregator->options().n);
    if (!decoded.ok()) {
      // Fail the round for everyone, as a bad push inside Submit would.
      aggregator->RejectPush(push.step(), push.worker(), decoded.status());
      return ToGrpcStatus(decoded.status());
    }
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
      if (absl::IsInvalidArgument(result.status())) {
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
    metrics_->sent_pull_bytes().Increment(static_cast<double>(bytes));
  }
  return grpc::Status::OK;
}

grpc::Status AggregatorService::ExchangeThreshold(
    grpc::ServerContext* context, const v1::ThresholdRequest* request,
    v1::ThresholdResponse* response) {
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

// ---------------------------------------------------------------------------
// Crash recovery (docs/recovery.md)

absl::StatusOr<v1::ShardState> AggregatorService::LocalShardState(
    absl::Time deadline, bool settle) {
  v1::ShardState state;
  state.set_shard_id(config_.shard_id);
  state.set_cluster_fingerprint(fingerprint_.load());
  ShardAggregator* aggregator;
  {
    absl::MutexLock lock(&mu_);
    aggregator = aggregator_.get();
  }
  if (aggregator == nullptr) return state;  // no parameters: not initialised
  absl::StatusOr<int64_t> next =
      aggregator->SettledNextStep(deadline, settle);
  if (absl::IsFailedPrecondition(next.status())) return state;
  GTOPK_RETURN_IF_ERROR(next.status());
  state.set_initialized(true);
  state.set_next_step(*next);
  if (!config_.checkpoint_dir.empty()) {
    absl::MutexLock lock(&checkpoint_mu_);
    GTOPK_ASSIGN_OR_RETURN(
        std::vector<int64_t> steps,
        ListCheckpointSteps(config_.checkpoint_dir, config_.shard_id));
    for (int64_t s : steps) {
      if (s <= *next) state.add_checkpoint_steps(s);
    }
  }
  return state;
}

absl::StatusOr<int64_t> AggregatorService::LocalRollback(int64_t step) {
  const std::string shard = absl::StrCat("shard ", config_.shard_id);
  if (step < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(shard, ": cannot roll back to negative step ", step));
  }
  ShardAggregator* aggregator;
  {
    absl::MutexLock lock(&mu_);
    aggregator = aggregator_.get();
  }
  if (aggregator == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat(shard, " has no parameters to roll back"));
  }
  // Serialised with checkpoint writes: the history must not gain an entry
  // of an abandoned step while it is rewound.
  absl::MutexLock lock(&checkpoint_mu_);
  const int64_t previous = aggregator->next_step();
  const absl::Status reason = absl::AbortedError(
      absl::StrCat("the cluster rolled back to step ", step));
  if (step == previous) {
    GTOPK_RETURN_IF_ERROR(aggregator->Rollback(step, nullptr, reason));
  } else {
    if (config_.checkpoint_dir.empty()) {
      return absl::FailedPreconditionError(
          absl::StrCat(shard, " is at step ", previous,
                       " and keeps no checkpoints (no "
                       "--checkpoint-dir); cannot roll back to step ",
                       step));
    }
    absl::StatusOr<ShardCheckpoint> checkpoint =
        ReadCheckpointAt(config_.checkpoint_dir, config_.shard_id, step);
    if (absl::IsNotFound(checkpoint.status())) {
      return absl::FailedPreconditionError(
          absl::StrCat(shard, " is at step ", previous, ": ",
                       checkpoint.status().message()));
    }
    GTOPK_RETURN_IF_ERROR(checkpoint.status());
    GTOPK_RETURN_IF_ERROR(aggregator->Rollback(step, &*checkpoint, reason));
  }
  if (!config_.checkpoint_dir.empty()) {
    // The memory state is `step` now; make the disk agree (entries of the
    // abandoned steps would otherwise come back after a restart).
    absl::StatusOr<std::vector<int64_t>> steps =
        ListCheckpointSteps(config_.checkpoint_dir, config_.shard_id);
    GTOPK_RETURN_IF_ERROR(steps.status());
    if (std::find(steps->begin(), steps->end(), step) != steps->end()) {
      GTOPK_RETURN_IF_ERROR(
          RewindCheckpoints(config_.checkpoint_dir, config_.shard_id, step));
    } else {
      GTOPK_RETURN_IF_ERROR(DiscardCheckpointsAfter(config_.checkpoint_dir,
                                                    config_.shard_id, step));
    }
  }
  if (step != previous) {
    std::fprintf(stderr,
                 "gtopk-server shard %u: rolled back from step %lld "
                 "to step %lld\n",
                 config_.shard_id, static_cast<long long>(previous),
                 static_cast<long long>(step));
  }
  return previous;
}

// ---------------------------------------------------------------------------
// Fail fast across shards (AbortStep)

namespace {
// Longest an AbortStep message may take (it is advice: a shard that misses
// it still fails its round at its own step deadline).
constexpr absl::Duration kAbortStepTimeout = absl::Seconds(5);
// Longest AbortStep reason kept (it is forwarded into every shard's status).
constexpr size_t kMaxAbortReasonBytes = 1024;
}  // namespace

void AggregatorService::OnLocalStepFailed(int64_t step,
                                          const absl::Status& reason) {
  // Called under the aggregator's lock: only queue the work.
  if (config_.num_shards == 1) return;  // nobody else to tell
  std::string why = BoundedStatusMessage(reason.message());
  if (why.size() > kMaxAbortReasonBytes) why.resize(kMaxAbortReasonBytes);
  if (is_leader()) {
    notifier_.Post([this, step, why] { LeaderAbortStep(step, 0, why); });
    return;
  }
  notifier_.Post([this, step, why] {
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(
        absl::Now() + std::min(config_.step_timeout, kAbortStepTimeout)));
    v1::AbortStepRequest request;
    request.set_step(step);
    request.set_shard_id(config_.shard_id);
    request.set_reason(why);
    v1::AbortStepResponse response;
    const grpc::Status st = leader_stub_->AbortStep(&context, request,
                                                    &response);
    if (!st.ok()) {
      // Best effort: the other shards then fail the step at their deadline.
      std::fprintf(stderr,
                   "gtopk-server shard %u: telling leader %s that step %lld "
                   "failed here: %s\n",
                   config_.shard_id, config_.peers[0].c_str(),
                   static_cast<long long>(step), st.error_message().c_str());
    }
  });
}

void AggregatorService::LeaderAbortStep(int64_t step, uint32_t origin,
                                        const std::string& reason) {
  const uint32_t S = config_.num_shards;
  if (!is_leader() || S == 1) return;
  const absl::Status aborted = absl::AbortedError(absl::StrCat(
      "step ", step, " failed on shard ", origin, ": ", reason,
      " (the worker retries the step after Recover)"));
  // A committed step cannot have failed anywhere: a stale message.
  const uint64_t epoch = ++epoch_;
  if (!commit_coordinator_->Abort(step, aborted, epoch)) return;
  coordinator_->Abort(step, aborted, epoch);
  ShardAggregator* aggregator;
  {
    absl::MutexLock lock(&mu_);
    aggregator = aggregator_.get();
  }
  if (aggregator != nullptr) aggregator->AbortStep(step, aborted, epoch);
  // Every other shard, the origin too (it then refuses the failed attempt's
  // late pushes as well).
  notifier_.Post([this, step, origin, reason, S, epoch] {
    std::vector<std::thread> threads;
    for (uint32_t s = 1; s < S; ++s) {
      threads.emplace_back([this, s, step, origin, epoch, &reason] {
        grpc::ClientContext context;
        context.set_deadline(absl::ToChronoTime(
            absl::Now() + std::min(config_.step_timeout, kAbortStepTimeout)));
        v1::AbortStepRequest request;
        request.set_step(step);
        request.set_shard_id(origin);
        request.set_reason(reason);
        request.set_epoch(epoch);
        v1::AbortStepResponse response;
        // Best effort (a shard that is down has no round to fail).
        peer_stubs_[s]->AbortStep(&context, request, &response).IgnoreError();
      });
    }
    for (auto& t : threads) t.join();
  });
}

grpc::Status AggregatorService::AbortStep(grpc::ServerContext* /*context*/,
                                          const v1::AbortStepRequest* request,
                                          v1::AbortStepResponse* /*response*/) {
  if (request->step() < 0 || request->shard_id() >= config_.num_shards) {
    return ToGrpcStatus(absl::InvalidArgumentError(absl::StrCat(
        "AbortStep: step ", request->step(), " must be >= 0 and shard_id ",
        request->shard_id(), " below --num-shards (", config_.num_shards,
        ")")));
  }
  // A far-future epoch is not a leader's (IsPlausibleEpoch).
  const absl::Time now = absl::Now();
  if (!is_leader() && !IsPlausibleEpoch(request->epoch(), now)) {
    return ToGrpcStatus(absl::InvalidArgumentError(absl::StrCat(
        "AbortStep: epoch ", request->epoch(),
        " is more than a day ahead of this shard's clock (",
        absl::ToUnixMicros(now),
        " us since the Unix epoch)")));
  }
  // The reason travels on to every worker of the step: keep it short.
  const std::string reason = request->reason().size() > kMaxAbortReasonBytes
                                 ? BoundedStatusMessage(request->reason())
                                       .substr(0, kMaxAbortReasonBytes)
                                 : request->reason();
  if (is_leader()) {
    LeaderAbortStep(request->step(), request->shard_id(), reason);
    return grpc::Status::OK;
  }
  ShardAggregator* aggregator;
  {
    absl::MutexLock lock(&mu_);
    aggregator = aggregator_.get();
  }
  if (aggregator != nullptr) {
    aggregator->AbortStep(
        request->step(),
        absl::AbortedError(absl::StrCat(
            "step ", request->step(), " failed on shard ",
            request->shard_id(), ": ", reason,
            " (the worker retries the step after Recover)")),
        request->epoch());
  }
  return grpc::Status::OK;
}

grpc::Status AggregatorService::GetShardState(
    grpc::ServerContext* context, const v1::ShardStateRequest* request,
    v1::ShardState* response) {
  // In slices, so that a cancelled call (the leader went away) ends it.
  const absl::Time deadline = WaitDeadline(context);
  if (request->cluster_fingerprint() != 0 && fingerprint_.load() != 0) {
    const absl::Status same = CheckFingerprint(
        request->cluster_fingerprint(), "GetShardState from the leader ",
        deadline);
    if (!same.ok()) return ToGrpcStatus(same);
  }
  absl::StatusOr<v1::ShardState> state;
  do {
    state = LocalShardState(std::min(deadline, absl::Now() + kPollInterval),
                            !request->without_settling());
  } while (absl::IsDeadlineExceeded(state.status()) && absl::Now() < deadline &&
           !context->IsCancelled());
  if (!state.ok()) return ToGrpcStatus(state.status());
  *response = *std::move(state);
  return grpc::Status::OK;
}

grpc::Status AggregatorService::RollbackShard(
    grpc::ServerContext* context, const v1::RollbackRequest* request,
    v1::RollbackResponse* response) {
  if (request->shard_id() != config_.shard_id) {
    return ToGrpcStatus(absl::InvalidArgumentError(
        absl::StrCat("rollback for shard ", request->shard_id(),
                     " was sent to shard ", config_.shard_id)));
  }
  if (request->cluster_fingerprint() != 0 && fingerprint_.load() != 0) {
    const absl::Status same =
        CheckFingerprint(request->cluster_fingerprint(),
                         "RollbackShard from the leader ", WaitDeadline(context));
    if (!same.ok()) return ToGrpcStatus(same);
  }
  absl::StatusOr<int64_t> previous = LocalRollback(request->step());
  if (!previous.ok()) return ToGrpcStatus(previous.status());
  response->set_previous_next_step(*previous);
  return grpc::Status::OK;
}

namespace {

// "shard 1 (host:port): message", code kept.
absl::Status FromShard(const grpc::Status& status, uint32_t shard,
                       const std::string& address, const char* rpc) {
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                      absl::StrCat("shard ", shard, " (", address, ") ", rpc,
                                   ": ", status.error_message()));
}

std::string DescribeStates(const std::vector<v1::ShardState>& states) {
  std::vector<std::string> parts;
  for (const v1::ShardState& st : states) {
    parts.push_back(absl::StrCat(
        "shard ", st.shard_id(), " at step ", st.next_step(), " (checkpoints: ",
        st.checkpoint_steps().empty()
            ? std::string("none")
            : absl::StrJoin(st.checkpoint_steps(), ", "),
        ")"));
  }
  return absl::StrJoin(parts, "; ");
}

}  // namespace

absl::StatusOr<v1::RecoverResponse> AggregatorService::RecoverCluster(
    absl::Time deadline) {
  if (!is_leader()) {
    return absl::FailedPreconditionError(
        absl::StrCat("shard ", config_.shard_id,
                     " is not the leader; Recover goes to ", config_.peers[0]));
  }
  {
    absl::MutexLock lock(&recover_mu_);
    if (recovering_) {
      // Workers failing together call Recover together: join the running
      // recovery and answer its outcome (e.g. the unreachable shard it
      // names), rather than start another one after it.
      const uint64_t generation = recover_generation_;
      auto finished = [this, generation]()
                          ABSL_EXCLUSIVE_LOCKS_REQUIRED(recover_mu_) {
                            return recover_generation_ != generation;
                          };
      if (!recover_mu_.AwaitWithDeadline(absl::Condition(&finished),
                                         deadline + kLeaderDeadlineSlack)) {
        return absl::DeadlineExceededError(
            "Recover: another recovery is still running on the leader");
      }
      return last_recover_;
    }
    recovering_ = true;
  }
  absl::StatusOr<v1::RecoverResponse> result = RecoverClusterOnce(deadline);
  // The workers push their retry with the epoch of every failure heard of
  // so far (the AbortStep messages were flushed first).
  if (result.ok()) result->set_epoch(epoch_.load());
  absl::MutexLock lock(&recover_mu_);
  last_recover_ = result;
  ++recover_generation_;
  recovering_ = false;
  return result;
}

std::vector<absl::StatusOr<v1::ShardState>> AggregatorService::ReadShardStates(
    absl::Time deadline, bool settle) {
  const uint32_t S = config_.num_shards;
  std::vector<absl::StatusOr<v1::ShardState>> states(
      S, absl::UnknownError("not asked"));
  std::vector<std::thread> threads;
  for (uint32_t s = 0; s < S; ++s) {
    threads.emplace_back([&, s] {
      if (s == 0) {
        states[s] = LocalShardState(deadline, settle);
        return;
      }
      grpc::ClientContext ctx;
      ctx.set_deadline(absl::ToChronoTime(deadline));
      // A shard that is restarting is waited for (up to the deadline).
      ctx.set_wait_for_ready(true);
      v1::ShardState state;
      v1::ShardStateRequest request;
      request.set_cluster_fingerprint(fingerprint_.load());
      request.set_without_settling(!settle);
      const grpc::Status st =
          peer_stubs_[s]->GetShardState(&ctx, request, &state);
      if (!st.ok()) {
        states[s] = FromShard(st, s, config_.peers[s], "GetShardState");
      } else if (state.shard_id() != s) {
        states[s] = absl::FailedPreconditionError(
            absl::StrCat("the server at ", config_.peers[s], " is shard ",
                         state.shard_id(), ", not shard ", s));
      } else {
        states[s] = std::move(state);
      }
    });
  }
  for (auto& t : threads) t.join();
  return states;
}

absl::StatusOr<v1::RecoverResponse> AggregatorService::RecoverClusterOnce(
    absl::Time deadline) {
  // The AbortStep messages of failures so far reach every shard first, so
  // that the workers' retries after this recovery meet no stale round.
  notifier_.Flush(std::min(deadline, absl::Now() + kAbortStepTimeout));
  // First without a fence: when every shard is at the same step (workers
  // that were paused, a step that timed out, a shard restarted from a
  // checkpoint of the current step), there is nothing to repair, and a
  // fence would abort the rounds that workers who recovered earlier are
  // already running (concurrent Recover calls then abort each other's
  // retries). Shards answer at once, also while computing a round: that
  // round may be waiting for the very worker that is recovering (its push
  // to another shard is missing), so waiting for it would only time out --
  // and a fence would abort it, and the next worker's Recover the retry
  // after it. A step being computed is not applied yet, and commits on
  // every shard or on none, so equal next steps are a safe answer.
  {
    const absl::Time quick = std::min(
        deadline, absl::Now() + std::max(config_.step_timeout / 4,
                                         absl::Milliseconds(200)));
    std::vector<absl::StatusOr<v1::ShardState>> states =
        ReadShardStates(quick, /*settle=*/false);
    bool agree = true;
    for (const auto& st : states) {
      agree = agree && st.ok() && st->initialized() &&
              st->next_step() == states[0]->next_step();
    }
    if (agree) {
      v1::RecoverResponse response;
      for (const auto& st : states) response.add_previous_steps(st->next_step());
      response.set_next_step(states[0]->next_step());
      // The workers' next attempt of a failed step may vote again.
      return response;
    }
  }
  // Fence the commit vote and the threshold exchange: no step can be
  // committed while the shards' states are read, and rounds being computed
  // fail quickly instead of waiting for a shard that will not come.
  const absl::Status fence =
      absl::AbortedError("the leader is recovering the cluster");
  commit_coordinator_->Fence(fence);
  coordinator_->Fence(fence);
  struct Unfence {
    AggregatorService* self;
    ~Unfence() {
      self->coordinator_->Unfence();
      self->commit_coordinator_->Unfence();
    }
  } unfence{this};

  const uint32_t S = config_.num_shards;
  // Every shard's state, in parallel (each call bounded by `deadline`).
  std::vector<absl::StatusOr<v1::ShardState>> states =
      ReadShardStates(deadline, /*settle=*/true);
  std::vector<v1::ShardState> known;
  std::vector<std::string> errors;
  for (uint32_t s = 0; s < S; ++s) {
    if (!states[s].ok()) {
      errors.push_back(std::string(states[s].status().message()));
      continue;
    }
    if (!states[s]->initialized()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "Recover: shard ", s,
          " has no parameters (restarted without a checkpoint?); the "
          "cluster cannot continue"));
    }
    known.push_back(*states[s]);
  }
  if (!errors.empty()) {
    // A shard configured differently (FAILED_PRECONDITION naming the
    // flags) is not a shard that a retry can reach: keep its code, so that
    // the workers stop at once with the named flags.
    absl::StatusCode code = states[0].ok() ? absl::StatusCode::kUnavailable
                                           : states[0].status().code();
    for (const auto& st : states) {
      if (absl::IsFailedPrecondition(st.status())) {
        code = absl::StatusCode::kFailedPrecondition;
      }
    }
    return absl::Status(code,
                        absl::StrCat("Recover: cannot read every shard's "
                                     "state: ",
                                     absl::StrJoin(errors, "; ")));
  }
  v1::RecoverResponse response;
  bool agree = true;
  for (const v1::ShardState& st : known) {
    response.add_previous_steps(st.next_step());
    agree &= st.next_step() == known[0].next_step();
  }
  if (agree) {
    response.set_next_step(known[0].next_step());
    return response;
  }
  // The newest step every shard can restore: its current step or a
  // retained checkpoint.
  std::vector<int64_t> common;
  for (size_t i = 0; i < known.size(); ++i) {
    std::vector<int64_t> mine(known[i].checkpoint_steps().begin(),
                              known[i].checkpoint_steps().end());
    mine.push_back(known[i].next_step());
    std::sort(mine.begin(), mine.end());
    mine.erase(std::unique(mine.begin(), mine.end()), mine.end());
    if (i == 0) {
      common = mine;
    } else {
      std::vector<int64_t> both;
      std::set_intersection(common.begin(), common.end(), mine.begin(),
                            mine.end(), std::back_inserter(both));
      common = std::move(both);
    }
  }
  if (common.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "Recover: the shards are at different steps and retain no common "
        "checkpoint to roll back to: ",
        DescribeStates(known),
        ". Restart every shard from checkpoints of one step (or raise "
        "--checkpoint-keep)"));
  }
  const int64_t target = common.back();
  std::fprintf(stderr,
               "gtopk-server leader: shards disagree (%s); rolling back to "
               "step %lld\n",
               DescribeStates(known).c_str(), static_cast<long long>(target));
  // Steps >= target are voted on and exchanged afresh.
  commit_coordinator_->ForgetFrom(target);
  coordinator_->ForgetFrom(target);
  std::vector<absl::Status> rolled(S);
  {
    std::vector<std::thread> threads;
    for (uint32_t s = 0; s < S; ++s) {
      threads.emplace_back([&, s] {
        if (s == 0) {
          rolled[s] = LocalRollback(target).status();
          return;
        }
        grpc::ClientContext ctx;
        ctx.set_deadline(absl::ToChronoTime(deadline));
        ctx.set_wait_for_ready(true);
        v1::RollbackRequest request;
        request.set_shard_id(s);
        request.set_step(target);
        request.set_cluster_fingerprint(fingerprint_.load());
        v1::RollbackResponse reply;
        const grpc::Status st =
            peer_stubs_[s]->RollbackShard(&ctx, request, &reply);
        if (!st.ok())
          rolled[s] = FromShard(st, s, config_.peers[s], "RollbackShard");
      });
    }
    for (auto& t : threads) t.join();
  }
  errors.clear();
  absl::StatusCode code = absl::StatusCode::kOk;
  for (uint32_t s = 0; s < S; ++s) {
    if (rolled[s].ok()) continue;
    if (code == absl::StatusCode::kOk) code = rolled[s].code();
    errors.push_back(std::string(rolled[s].message()));
  }
  if (!errors.empty()) {
    // Shards that did roll back are at `target`, the others where they
    // were: they still disagree, so no step can be committed, and the next
    // Recover completes the rollback.
    return absl::Status(
        code, absl::StrCat("Recover: rollback to step ", target,
                           " incomplete: ", absl::StrJoin(errors, "; ")));
  }
  response.set_next_step(target);
  response.set_rolled_back(true);
  return response;
}

grpc::Status AggregatorService::Recover(grpc::ServerContext* context,
                                        const v1::RecoverRequest* request,
                                        v1::RecoverResponse* response) {
  if (request->worker() >= config_.num_workers) {
    return ToGrpcStatus(absl::InvalidArgumentError(
        absl::StrCat("unknown worker rank ", request->worker(),
                     "; the cluster has ", config_.num_workers, " workers")));
  }
  if (is_leader()) {
    const absl::Status same = CheckFingerprint(
        request->cluster_fingerprint(),
        absl::StrCat("Recover from worker ", request->worker(), " "),
        absl::Now());
    if (!same.ok()) return ToGrpcStatus(same);
    absl::MutexLock lock(&mu_);
    const uint32_t w = request->worker();
    const uint64_t token = request->member_token();
    if (token != 0 && member_token_[w] == 0) {
      // No holder since this leader started (it restarted): the worker
      // that held the rank re-enters with its token, as a Join of the rank
      // would.
      member_token_[w] = token;
      rank_given_[w] = true;
    }
    const absl::Status member = CheckMemberTokenLocked(w, token);
    if (!member.ok()) {
      return ToGrpcStatus(absl::Status(
          member.code(), absl::StrCat("Recover: ", member.message())));
    }
  }
  const absl::Time deadline =
      std::min(absl::Now() + config_.step_timeout,
               ContextDeadline(context) - kLeaderDeadlineSlack);
  absl::StatusOr<v1::RecoverResponse> answer = RecoverCluster(deadline);
  if (!answer.ok()) return ToGrpcStatus(answer.status());
  *response = *std::move(answer);
  return grpc::Status::OK;
}

grpc::Status AggregatorService::CheckMember(
    grpc::ServerContext* /*context*/, const v1::MemberCheckRequest* request,
    v1::MemberCheckResponse* /*response*/) {
  if (!is_leader()) {
    return ToGrpcStatus(absl::FailedPreconditionError(absl::StrCat(
        "shard ", config_.shard_id, " is not the leader; CheckMember goes to ",
        config_.peers[0])));
  }
  const absl::Status same = CheckFingerprint(
      request->cluster_fingerprint(),
      absl::StrCat("CheckMember for rank ", request->worker(), " "),
      absl::Now());
  if (!same.ok()) return ToGrpcStatus(same);
  absl::MutexLock lock(&mu_);
  return ToGrpcStatus(
      CheckMemberTokenLocked(request->worker(), request->member_token()));
}

// ---------------------------------------------------------------------------
// AggregatorServer

absl::StatusOr<std::unique_ptr<AggregatorServer>> AggregatorServer::Start(
    ServerConfig config, const std::string& listen_address) {
  GTOPK_RETURN_IF_ERROR(ValidateHostPort("listen", listen_address, 0));
  std::unique_ptr<AggregatorServer> server(new AggregatorServer());
  GTOPK_ASSIGN_OR_RETURN(server->service_,
                         AggregatorService::Create(std::move(config)));
  const int limit = ClampToInt(server->service_->config().max_message_bytes);
  grpc::EnableDefaultHealthCheckService(true);
  grpc::ServerBuilder builder;
  // No SO_REUSEPORT: a second server on the same address must fail to
  // start instead of silently sharing the port's connections.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.AddListeningPort(listen_address, grpc::InsecureServerCredentials(),
                           &server->port_);
  builder.SetMaxReceiveMessageSize(limit);
  builder.SetMaxSendMessageSize(limit);
  builder.RegisterService(server->service_.get());
  std::vector<std::unique_ptr<
      grpc::experimental::ServerInterceptorFactoryInterface>>
      interceptors;
  interceptors.push_back(server->service_->metrics().MakeInterceptorFactory());
  builder.experimental().SetInterceptorCreators(std::move(interceptors));
  server->server_ = builder.BuildAndStart();
  if (server->server_ == nullptr || server->port_ == 0) {
    server->shut_down_ = true;
    return absl::UnavailableError(
        absl::StrCat("cannot listen on ", listen_address));
  }
  server->address_ = absl::StrCat(
      listen_address.substr(0, listen_address.rfind(':')), ":", server->port_);
  server->service_->SetOwnAddress(server->address_);
  if (grpc::HealthCheckServiceInterface* health =
          server->server_->GetHealthCheckService()) {
    health->SetServingStatus(true);
    // SERVING until a checkpoint write fails, again once one succeeds.
    server->service_->SetCheckpointHealthListener([health](bool ok) {
      health->SetServingStatus(kCheckpointHealthService, ok);
    });
  }
  return server;
}

AggregatorServer::~AggregatorServer() {
  if (!shut_down_) Shutdown(absl::ZeroDuration()).IgnoreError();
}

absl::Status AggregatorServer::Shutdown(absl::Duration grace,
                                        bool write_checkpoint,
                                        absl::Duration drain) {
  if (shut_down_ || server_ == nullptr) return absl::OkStatus();
  shut_down_ = true;
  if (grpc::HealthCheckServiceInterface* health =
          server_->GetHealthCheckService()) {
    health->SetServingStatus(false);
  }
  if (drain > absl::ZeroDuration()) {
    // Still listening: health checks see NOT_SERVING, and the round in
    // progress can complete.
    service_->BeginDrain();
    service_->AwaitDrained(absl::Now() + drain);
  }
  const absl::Time deadline = absl::Now() + grace;
  absl::Notification drained;
  // Handlers blocked in a step wait do not see gRPC's cancellation: at the
  // deadline, fail their waits so that Shutdown can return.
  std::thread closer([this, deadline, &drained] {
    if (!drained.WaitForNotificationWithDeadline(deadline)) {
      service_->BeginShutdown();
    }
  });
  server_->Shutdown(absl::ToChronoTime(deadline));
  drained.Notify();
  closer.join();
  service_->BeginShutdown();
  server_->Wait();
  // The health service goes with the server; the final checkpoint's outcome
  // is the return value (gtopk-server's exit code).
  service_->SetCheckpointHealthListener(nullptr);
  if (!write_checkpoint) return absl::OkStatus();
  return service_->WriteCheckpointNow();
}

// ---------------------------------------------------------------------------
// Health check client

absl::StatusOr<bool> CheckHealth(const std::string& address,
                                 absl::Duration timeout,
                                 const std::string& service) {
  if (service.size() >= 128) {
    return absl::InvalidArgumentError(absl::StrCat(
        "health service name of ", service.size(),
        " bytes; at most 127 are supported"));
  }
  grpc::GenericStub stub(
      grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  // grpc.health.v1.HealthCheckRequest{string service = 1}: no bytes for
  // "", else tag 0x0a, the length (one byte: names are short) and the name.
  std::string request_bytes;
  if (!service.empty()) {
    request_bytes.push_back('\x0a');
    request_bytes.push_back(static_cast<char>(service.size()));
    request_bytes += service;
  }
  grpc::Slice request_slice(request_bytes);
  grpc::ByteBuffer request(&request_slice, 1);
  grpc::ByteBuffer response;
  grpc::Status status;
  absl::Notification done;
  stub.UnaryCall(&context, "/grpc.health.v1.Health/Check", grpc::StubOptions(),
                 &request, &response, [&status, &done](grpc::Status s) {
                   status = std::move(s);
                   done.Notify();
                 });
  done.WaitForNotification();
  if (!status.ok()) {
    return absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                        absl::StrCat("health check of ", address, ": ",
                                     status.error_message()));
  }
  std::vector<grpc::Slice> slices;
  std::string bytes;
  if (response.Valid() && response.Dump(&slices).ok()) {
    for (const grpc::Slice& s : slices) {
      bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
    }
  }
  // HealthCheckResponse{ServingStatus status = 1}: read the varint fields,
  // skip anything else; SERVING is 1, and an absent field means UNKNOWN (0).
  uint64_t serving = 0;
  size_t pos = 0;
  auto read_varint = [&bytes, &pos](uint64_t* v) {
    *v = 0;
    for (int shift = 0; shift < 64 && pos < bytes.size(); shift += 7) {
      const uint8_t b = static_cast<uint8_t>(bytes[pos++]);
      *v |= uint64_t{b & 0x7fu} << shift;
      if ((b & 0x80) == 0) return true;
    }
    return false;
  };
  while (pos < bytes.size()) {
    uint64_t tag = 0, value = 0;
    if (!read_varint(&tag)) break;
    const uint64_t wire_type = tag & 7;
    if (wire_type == 0) {
      if (!read_varint(&value)) break;
      if ((tag >> 3) == 1) serving = value;
    } else if (wire_type == 2) {
      if (!read_varint(&value) || value > bytes.size() - pos) break;
      pos += value;
    } else {
      return absl::InternalError(absl::StrCat("health check of ", address,
                                              ": unexpected wire type ",
                                              wire_type, " in response"));
    }
  }
  return serving == 1;
}

}  // namespace server
}  // namespace gtopk
