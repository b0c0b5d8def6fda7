#include "worker/client.h"

#include <algorithm>
#include <climits>
#include <cstring>
#include <thread>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "common/cluster_spec.h"
#include "common/epoch.h"
#include "common/grpc_edge.h"
#include "common/random.h"
#include "common/status_macros.h"
#include "grpcpp/grpcpp.h"
#include "worker/device_step.h"

namespace gtopk {
namespace worker {

// One shard: its channel and, between steps, its open PushPull stream.
struct WorkerClient::ShardConn {
  uint32_t id = 0;
  std::string address;
  uint64_t begin = 0;
  uint64_t end = 0;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<v1::Aggregator::Stub> stub;
  // Open stream (both null when closed). The context outlives the stream.
  std::unique_ptr<grpc::ClientContext> context;
  // The context's registration with ClientOptions::cancellation; declared
  // after it so that it ends first.
  std::unique_ptr<Cancellation::Scope> cancel_scope;
  std::unique_ptr<grpc::ClientReaderWriter<v1::Push, v1::Pull>> stream;
  // Set by the step thread when the stream ended (it must be reopened).
  bool broken = false;
};

namespace {

// After one shard failed a step, how long the others may still report
// their own errors before their streams are cancelled.
constexpr absl::Duration kFailureGrace = absl::Milliseconds(250);

// gRPC's default message limit; every chunked transfer stays below it.
constexpr uint64_t kDefaultMessageBytes = uint64_t{4} << 20;

// Same code, message prefixed with `where`.
absl::Status Prefixed(const absl::Status& s, absl::string_view where) {
  return absl::Status(s.code(), absl::StrCat(where, ": ", s.message()));
}

absl::StatusOr<OptimizerOptions> OptimizerFromSpec(const v1::OptimizerSpec& s) {
  OptimizerOptions o;
  o.lr = s.lr();
  o.momentum = s.momentum();
  switch (s.momentum_mode()) {
    case v1::MOMENTUM_MODE_NONE:
      o.momentum_mode = MomentumMode::kNone;
      break;
    case v1::MOMENTUM_MODE_UNSPECIFIED:  // the documented default
    case v1::MOMENTUM_MODE_DGC:
      o.momentum_mode = MomentumMode::kDgcCorrection;
      break;
    case v1::MOMENTUM_MODE_GLOBAL:
      o.momentum_mode = MomentumMode::kGlobal;
      break;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("cluster spec: unknown momentum mode ",
                       static_cast<int>(s.momentum_mode())));
  }
  o.momentum_factor_masking = s.momentum_factor_masking();
  o.weight_decay = s.weight_decay();
  o.lr_warmup_steps = s.lr_warmup_steps();
  o.density = s.density();
  o.density_warmup.assign(s.density_warmup().begin(),
                          s.density_warmup().end());
  o.steps_per_epoch = s.steps_per_epoch();
  return o;
}

// Checks what the client relies on: n, rank, shards tiling [0, n) in id
// order, a step timeout.
absl::Status ValidateCluster(const v1::ClusterSpec& c, uint64_t n,
                             uint32_t rank) {
  if (c.n() != n) {
    return absl::FailedPreconditionError(absl::StrCat(
        "cluster spec: cluster has n = ", c.n(), ", this worker has ", n));
  }
  if (c.num_workers() < 1 || rank >= c.num_workers()) {
    return absl::InvalidArgumentError(
        absl::StrCat("cluster spec: rank ", rank, " not below P = ",
                     c.num_workers()));
  }
  if (c.shards_size() < 1) {
    return absl::InvalidArgumentError("cluster spec: no shards");
  }
  uint64_t expected_begin = 0;
  for (int s = 0; s < c.shards_size(); ++s) {
    const v1::ShardSpec& sh = c.shards(s);
    if (sh.shard_id() != static_cast<uint32_t>(s) || sh.address().empty() ||
        sh.begin() != expected_begin || sh.end() < sh.begin() ||
        sh.end() > n) {
      return absl::InvalidArgumentError(absl::StrCat(
          "cluster spec: shard at position ", s, " (id ", sh.shard_id(),
          ", address \"", sh.address(), "\", range [", sh.begin(), ", ",
          sh.end(), ")) does not continue the tiling of [0, ", n,
          ") at ", expected_begin));
    }
    expected_begin = sh.end();
  }
  if (expected_begin != n) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cluster spec: shard ranges end at ", expected_begin, ", not n = ", n));
  }
  if (c.step_timeout_ms() == 0) {
    return absl::InvalidArgumentError("cluster spec: step_timeout_ms is 0");
  }
  return absl::OkStatus();
}

uint64_t MessageLimit(const v1::ClusterSpec& c) {
  const uint64_t limit =
      c.max_message_bytes() == 0 ? kDefaultMessageBytes : c.max_message_bytes();
  return std::min<uint64_t>(limit, INT_MAX);
}

// The entries of `v` with index in [begin, end).
SparseVector Slice(const SparseVector& v, uint64_t begin, uint64_t end) {
  const auto lo = std::lower_bound(v.indices.begin(), v.indices.end(), begin);
  const auto hi = std::lower_bound(lo, v.indices.end(), end);
  const size_t a = lo - v.indices.begin();
  const size_t b = hi - v.indices.begin();
  SparseVector out;
  out.indices.assign(v.indices.begin() + a, v.indices.begin() + b);
  out.values.assign(v.values.begin() + a, v.values.begin() + b);
  return out;
}

// Asks every non-leader shard for the cluster spec (GetClusterSpec), so
// that a shard started with other settings than the leader is found before
// the first step: the shard compares the leader's spec with its own flags
// and refuses with FAILED_PRECONDITION naming each differing flag and both
// values. Waits for shards that are still starting, up to `timeout` in all.
template <typename Shards>
absl::Status CheckShardsAgree(const Shards& shards,
                              const v1::ClusterSpec& leader_spec,
                              absl::Duration timeout,
                              Cancellation* cancellation) {
  const absl::Time deadline = absl::Now() + timeout;
  for (size_t s = 1; s < shards.size(); ++s) {
    const std::string where = absl::StrCat("shard ", shards[s]->id, " (",
                                           shards[s]->address, ")");
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(deadline));
    context.set_wait_for_ready(true);
    Cancellation::Scope cancel_scope(cancellation, &context);
    v1::ClusterSpec spec;
    const absl::Status st = FromGrpcStatus(
        shards[s]->stub->GetClusterSpec(&context, v1::JoinRequest(), &spec));
    if (!st.ok()) return Prefixed(st, absl::StrCat(where, ": GetClusterSpec"));
    // The shard forwards the leader's spec: the same cluster.
    if (spec.n() != leader_spec.n() ||
        spec.shards_size() != leader_spec.shards_size()) {
      return absl::FailedPreconditionError(absl::StrCat(
          where, ": its leader's cluster has n = ", spec.n(), " and ",
          spec.shards_size(), " shards, the leader this worker joined has n = ",
          leader_spec.n(), " and ", leader_spec.shards_size(),
          " (is the shard's --peers right?)"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

uint64_t WorkerClient::SelectorSeedForRank(uint64_t cluster_seed,
                                           uint32_t rank) {
  // A stream id outside the range selectors use for steps.
  return MixSeed(cluster_seed, (uint64_t{1} << 63) | rank);
}

absl::StatusOr<std::unique_ptr<WorkerClient>> WorkerClient::Connect(
    const ClientOptions& options) {
  if (options.leader_address.empty()) {
    return absl::InvalidArgumentError("ClientOptions: leader_address is empty");
  }
  if (options.n == 0 || options.n > kMaxDenseLength) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ClientOptions: n = ", options.n, " is not in [1, 2^32]"));
  }
  if (options.requested_rank < -1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ClientOptions: requested_rank ", options.requested_rank,
        " (use -1 for any)"));
  }
  if (options.rpc_timeout <= absl::ZeroDuration() ||
      options.step_watchdog_margin < absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        "ClientOptions: rpc_timeout must be > 0 and step_watchdog_margin >= 0");
  }

  const std::string leader = absl::StrCat("leader ", options.leader_address);
  v1::JoinRequest request;
  request.set_requested_rank(options.requested_rank);
  request.set_n(options.n);
  v1::JoinResponse response;
  {
    auto channel =
        CreateLimitedChannel(options.leader_address, kDefaultMessageBytes);
    auto stub = v1::Aggregator::NewStub(channel);
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + options.rpc_timeout));
    // A worker may start before the leader: wait for it up to the deadline.
    context.set_wait_for_ready(true);
    Cancellation::Scope cancel_scope(options.cancellation.get(), &context);
    const absl::Status s =
        FromGrpcStatus(stub->Join(&context, request, &response));
    if (!s.ok()) return Prefixed(s, absl::StrCat(leader, ": Join"));
  }
  const v1::ClusterSpec& cluster = response.cluster();
  const uint32_t rank = response.rank();
  {
    const absl::Status s = ValidateCluster(cluster, options.n, rank);
    if (!s.ok()) return Prefixed(s, leader);
  }
  if (options.requested_rank >= 0 &&
      rank != static_cast<uint32_t>(options.requested_rank)) {
    return absl::InternalError(absl::StrCat(leader, ": asked for rank ",
                                            options.requested_rank, ", got ",
                                            rank));
  }
  GTOPK_ASSIGN_OR_RETURN(OptimizerOptions optimizer,
                         OptimizerFromSpec(cluster.optimizer()));
  GTOPK_ASSIGN_OR_RETURN(OptimizerRule rule, OptimizerRule::Create(optimizer));
  SelectorOptions selector_options;
  selector_options.seed =
      SelectorSeedForRank(cluster.selector_seed(), rank);
  GTOPK_ASSIGN_OR_RETURN(std::unique_ptr<Selector> selector,
                         CreateSelector(cluster.selector(), selector_options));
  CodecSpec codec;
  GTOPK_ASSIGN_OR_RETURN(codec.index, ParseIndexCodec(cluster.index_codec()));
  GTOPK_ASSIGN_OR_RETURN(codec.value, ParseValueCodec(cluster.value_codec()));
  if (cluster.mode() != v1::MODE_GTOPK && cluster.mode() != v1::MODE_TOPK &&
      cluster.mode() != v1::MODE_DENSE) {
    return absl::InvalidArgumentError(
        absl::StrCat(leader, ": cluster spec has no valid mode (",
                     static_cast<int>(cluster.mode()), ")"));
  }

  const uint64_t limit = MessageLimit(cluster);
  std::vector<std::unique_ptr<ShardConn>> shards;
  for (const v1::ShardSpec& sh : cluster.shards()) {
    auto conn = std::make_unique<ShardConn>();
    conn->id = sh.shard_id();
    conn->address = sh.address();
    conn->begin = sh.begin();
    conn->end = sh.end();
    conn->channel = CreateLimitedChannel(sh.address(), limit);
    conn->stub = v1::Aggregator::NewStub(conn->channel);
    shards.push_back(std::move(conn));
  }
  GTOPK_RETURN_IF_ERROR(CheckShardsAgree(shards, cluster, options.rpc_timeout,
                                         options.cancellation.get()));
  std::unique_ptr<WorkerClient> client(new WorkerClient(
      options, rank, response.member_token(), cluster, std::move(rule),
      std::move(selector), codec, std::move(shards)));
  client->epoch_ = response.epoch();
  client->OpenLeaderStream();
  return client;
}

WorkerClient::WorkerClient(const ClientOptions& options, uint32_t rank,
                           uint64_t member_token, v1::ClusterSpec cluster,
                           OptimizerRule rule,
                           std::unique_ptr<Selector> selector, CodecSpec codec,
                           std::vector<std::unique_ptr<ShardConn>> shards)
    : options_(options),
      rank_(rank),
      member_token_(member_token),
      cluster_(std::move(cluster)),
      rule_(std::move(rule)),
      selector_(std::move(selector)),
      codec_(codec),
      shards_(std::move(shards)),
      mode_(cluster_.mode() == v1::MODE_GTOPK  ? Mode::kGtopk
            : cluster_.mode() == v1::MODE_TOPK ? Mode::kTopk
                                               : Mode::kDense),
      feedback_(cluster_.n()),
      velocity_(cluster_.n(), 0.0f),
      global_velocity_(cluster_.n(), 0.0f),
      next_step_(cluster_.next_step()) {}

WorkerClient::~WorkerClient() { CloseStreams(); }

std::string WorkerClient::ShardName(size_t s) const {
  return absl::StrCat("shard ", shards_[s]->id, " (", shards_[s]->address,
                      ")");
}

std::unique_ptr<grpc::ClientContext> WorkerClient::NewStreamContext() const {
  auto context = std::make_unique<grpc::ClientContext>();
  // Wait (bounded by the step watchdog) for a reconnecting channel instead
  // of failing at once, e.g. while a shard restarts.
  context->set_wait_for_ready(true);
  context->AddMetadata("gtopk-rank", absl::StrCat(rank_));
  context->AddMetadata("gtopk-member-token", absl::StrCat(member_token_));
  return context;
}

void WorkerClient::SetStreamContext(ShardConn& c) const {
  c.cancel_scope.reset();
  c.context = NewStreamContext();
  c.cancel_scope = std::make_unique<Cancellation::Scope>(
      options_.cancellation.get(), c.context.get());
}

void WorkerClient::ClearStreamContext(ShardConn& c) {
  c.cancel_scope.reset();
  c.context.reset();
}

void WorkerClient::OpenLeaderStream() {
  ShardConn& c = *shards_[0];
  if (c.stream != nullptr) return;
  SetStreamContext(c);
  c.broken = false;
  // Opening the stream sends the call's metadata; the first push follows at
  // the first Step. The leader answers with its initial metadata once it
  // has registered the rank, so that a Join after Connect returns sees the
  // rank alive. Both on the waiter thread, bounded: opening a
  // wait-for-ready stream to a leader that just went down blocks until the
  // call is cancelled, so a leader that does not answer in rpc_timeout gets
  // the stream cancelled, and Step opens a fresh one.
  absl::Notification registered;
  std::thread waiter([&c, &registered] {
    c.stream = c.stub->PushPull(c.context.get());
    c.stream->WaitForInitialMetadata();
    registered.Notify();
  });
  if (!registered.WaitForNotificationWithTimeout(options_.rpc_timeout)) {
    c.context->TryCancel();
  }
  waiter.join();
}

absl::Status WorkerClient::ExplainFingerprintRefusal(
    const absl::Status& status) {
  if (!absl::IsFailedPrecondition(status) ||
      !absl::StrContains(status.message(), "cluster fingerprint")) {
    return status;
  }
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + options_.rpc_timeout));
  Cancellation::Scope cancel_scope(options_.cancellation.get(), &context);
  v1::ClusterSpec leader;
  if (!shards_[0]->stub->GetClusterSpec(&context, v1::JoinRequest(), &leader)
           .ok()) {
    return status;
  }
  const std::vector<std::string> differences =
      ClusterSpecDifferences(cluster_, leader, "on the leader now");
  if (differences.empty()) return status;
  return absl::FailedPreconditionError(absl::StrCat(
      status.message(), "; the leader's settings differ from those this worker "
      "joined with (\"here\"): ", absl::StrJoin(differences, "; "),
      ". Restart the workers (or the leader with the old flags)"));
}

void WorkerClient::CloseStreams() {
  for (auto& c : shards_) {
    if (c->stream != nullptr && !c->broken) {  // broken: already finished
      c->context->TryCancel();
      c->stream->Finish().IgnoreError();
    }
    c->stream.reset();
    ClearStreamContext(*c);
    c->broken = false;
  }
}

absl::StatusOr<int64_t> WorkerClient::SynchronizeParameters(
    absl::Span<float> params) {
  const uint64_t n = cluster_.n();
  if (params.size() != n) {
    return absl::InvalidArgumentError(absl::StrCat(
        "SynchronizeParameters: params has ", params.size(), " values, n = ",
        n));
  }
  const uint64_t limit = std::min(MessageLimit(cluster_), kDefaultMessageBytes);
  // Room for the chunk's other fields and framing.
  const uint64_t budget = limit > 2048 ? limit - 1024 : limit / 2;
  const uint64_t chunk_floats = std::max<uint64_t>(1, budget / sizeof(float));

  if (rank_ == 0) {
    GTOPK_RETURN_IF_ERROR(ValidateFinite(params, "params"));
    for (size_t s = 0; s < shards_.size(); ++s) {
      ShardConn& c = *shards_[s];
      grpc::ClientContext context;
      context.set_deadline(
          absl::ToChronoTime(absl::Now() + options_.rpc_timeout));
      Cancellation::Scope cancel_scope(options_.cancellation.get(), &context);
      v1::InitParamsResponse response;
      auto writer = c.stub->InitParams(&context, &response);
      uint64_t offset = c.begin;
      do {  // at least one chunk, so an empty range still reports back
        const uint64_t len = std::min(chunk_floats, c.end - offset);
        v1::ParamsChunk chunk;
        chunk.set_worker(rank_);
        chunk.set_member_token(member_token_);
        chunk.set_cluster_fingerprint(cluster_.cluster_fingerprint());
        chunk.set_shard_id(c.id);
        chunk.set_offset(offset);
        chunk.mutable_values()->Resize(static_cast<int>(len), 0.0f);
        if (len > 0) {
          std::memcpy(chunk.mutable_values()->mutable_data(),
                      params.data() + offset, len * sizeof(float));
        }
        if (!writer->Write(chunk)) break;  // Finish() has the reason
        offset += len;
      } while (offset < c.end);
      writer->WritesDone();
      const absl::Status st = FromGrpcStatus(writer->Finish());
      if (!st.ok()) return Prefixed(st, absl::StrCat(ShardName(s), ": InitParams"));
    }
  }

  int64_t step = -1;
  size_t step_shard = 0;
  for (size_t s = 0; s < shards_.size(); ++s) {
    ShardConn& c = *shards_[s];
    const std::string where = absl::StrCat(ShardName(s), ": DownloadParams");
    // A read: a call that failed with UNAVAILABLE (sent on a connection that
    // died under it, "Connection reset by peer" or "Socket closed", the
    // first call after the shard was killed and restarted; or the shard down
    // or shutting down) is sent again, waiting for the shard to be ready,
    // with backoff, until the deadline. Every attempt rewrites the whole
    // range, so a partial earlier one leaves nothing behind.
    const absl::Time deadline = absl::Now() + options_.rpc_timeout;
    absl::Duration backoff = kReconnectBackoffMin;
    uint64_t offset = c.begin;
    int64_t shard_step = -1;
    for (int attempt = 0;; ++attempt) {
      grpc::ClientContext context;
      context.set_deadline(absl::ToChronoTime(deadline));
      if (attempt > 0) context.set_wait_for_ready(true);
      Cancellation::Scope cancel_scope(options_.cancellation.get(), &context);
      v1::DownloadParamsRequest request;
      request.set_worker(rank_);
      request.set_cluster_fingerprint(cluster_.cluster_fingerprint());
      auto reader = c.stub->DownloadParams(&context, request);
      v1::ParamsChunk chunk;
      offset = c.begin;
      shard_step = -1;
      absl::Status bad;
      while (reader->Read(&chunk)) {
        if (!bad.ok()) continue;  // drain before Finish
        if (chunk.shard_id() != c.id || chunk.offset() != offset ||
            static_cast<uint64_t>(chunk.values_size()) > c.end - offset ||
            (shard_step >= 0 && chunk.step() != shard_step) ||
            chunk.step() < 0) {
          bad = absl::InternalError(absl::StrCat(
              where, ": malformed chunk (shard ", chunk.shard_id(), ", offset ",
              chunk.offset(), ", ", chunk.values_size(), " values, step ",
              chunk.step(), "); expected offset ", offset, " in [", c.begin,
              ", ", c.end, ")"));
          context.TryCancel();
          continue;
        }
        if (chunk.global_velocity_size() != 0 &&
            chunk.global_velocity_size() != chunk.values_size()) {
          bad = absl::InternalError(absl::StrCat(
              where, ": chunk at offset ", chunk.offset(), " has ",
              chunk.values_size(), " values but ", chunk.global_velocity_size(),
              " global velocity entries"));
          context.TryCancel();
          continue;
        }
        shard_step = chunk.step();
        if (chunk.values_size() > 0) {
          std::memcpy(params.data() + offset, chunk.values().data(),
                      chunk.values_size() * sizeof(float));
        }
        // Global momentum: continue with the servers' V, so a joining or
        // restarted replica applies the same updates as everyone else.
        if (chunk.global_velocity_size() > 0) {
          std::memcpy(global_velocity_.data() + offset,
                      chunk.global_velocity().data(),
                      chunk.global_velocity_size() * sizeof(float));
        }
        offset += chunk.values_size();
      }
      const absl::Status st = FromGrpcStatus(reader->Finish());
      GTOPK_RETURN_IF_ERROR(bad);
      if (st.ok()) break;
      if (!absl::IsUnavailable(st) || absl::Now() + backoff >= deadline) {
        return Prefixed(st, where);
      }
      if (options_.cancellation != nullptr
              ? options_.cancellation->SleepUnlessCancelled(backoff)
              : (absl::SleepFor(backoff), false)) {
        return absl::CancelledError(
            absl::StrCat(where, ": cancelled (after: ", st.message(), ")"));
      }
      backoff = std::min(2 * backoff, kReconnectBackoffMax);
    }
    if (offset != c.end) {
      return absl::InternalError(absl::StrCat(where, ": stream ended at index ",
                                              offset, ", range ends at ",
                                              c.end));
    }
    if (shard_step < 0) continue;  // an empty range may send no chunk
    if (step >= 0 && shard_step != step) {
      return absl::FailedPreconditionError(absl::StrCat(
          "SynchronizeParameters: ", ShardName(step_shard), " is at step ",
          step, " but ", ShardName(s), " is at step ", shard_step));
    }
    step = shard_step;
    step_shard = s;
  }
  if (step < 0) {
    return absl::InternalError(
        "SynchronizeParameters: no shard reported its step");
  }
  next_step_ = step;
  return step;
}

absl::StatusOr<WorkerState> WorkerClient::ExportState() {
  if (device_ != nullptr) {
    GTOPK_RETURN_IF_ERROR(device_->CopyStateToHost(feedback_.mutable_residual(),
                                                   absl::MakeSpan(velocity_)));
  }
  WorkerState state;
  state.next_step = next_step_;
  state.residual.assign(feedback_.residual().begin(),
                        feedback_.residual().end());
  state.velocity = velocity_;
  return state;
}

absl::Status WorkerClient::ImportState(const WorkerState& state) {
  const uint64_t n = cluster_.n();
  if (state.residual.size() != n || state.velocity.size() != n) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ImportState: residual has ", state.residual.size(),
        " values and velocity ", state.velocity.size(), "; n = ", n));
  }
  GTOPK_RETURN_IF_ERROR(
      ValidateFinite(state.residual, "ImportState: residual"));
  GTOPK_RETURN_IF_ERROR(
      ValidateFinite(state.velocity, "ImportState: velocity"));
  if (state.next_step != next_step_) {
    return absl::FailedPreconditionError(absl::StrCat(
        "ImportState: the servers are at step ", next_step_,
        " but the state is from step ", state.next_step,
        " (restore the servers' checkpoint of the same step, or start the "
        "worker state afresh)"));
  }
  std::copy(state.residual.begin(), state.residual.end(),
            feedback_.mutable_residual().begin());
  velocity_ = state.velocity;
  // The next device Step uploads the imported state.
  device_.reset();
  return absl::OkStatus();
}

absl::StatusOr<int64_t> WorkerClient::Recover(absl::Span<float> params) {
  return Recover(params,
                 absl::Now() + options_.rpc_timeout +
                     absl::Milliseconds(cluster_.step_timeout_ms()));
}

absl::StatusOr<int64_t> WorkerClient::Recover(absl::Span<float> params,
                                              absl::Time deadline) {
  if (params.size() != cluster_.n()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "Recover: params has ", params.size(), " values; n = ", cluster_.n()));
  }
  CloseStreams();
  v1::RecoverRequest request;
  request.set_worker(rank_);
  request.set_failed_step(next_step_);
  request.set_member_token(member_token_);
  request.set_cluster_fingerprint(cluster_.cluster_fingerprint());
  v1::RecoverResponse response;
  absl::Status st;
  // A leader that is down or restarting is waited for (up to the deadline)
  // instead of failing at once with UNAVAILABLE: wait-for-ready covers a
  // channel known to be down, and the retries below a call sent on a
  // connection that died under it ("Socket closed", the first call after
  // the leader was killed) or a leader shutting down.
  absl::Duration backoff = kReconnectBackoffMin;
  for (;;) {
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(deadline));
    context.set_wait_for_ready(true);
    Cancellation::Scope cancel_scope(options_.cancellation.get(), &context);
    response.Clear();
    st =
        FromGrpcStatus(shards_[0]->stub->Recover(&context, request, &response));
    // The leader's own UNAVAILABLE answers (about other shards) start with
    // "Recover:" and go back to the caller, whose retry budget decides.
    if (!absl::IsUnavailable(st) ||
        absl::StartsWith(st.message(), "Recover:") ||
        absl::Now() + backoff >= deadline) {
      break;
    }
    if (options_.cancellation != nullptr
            ? options_.cancellation->SleepUnlessCancelled(backoff)
            : (absl::SleepFor(backoff), false)) {
      return absl::CancelledError(
          absl::StrCat(ShardName(0), ": Recover: cancelled (after: ",
                       st.message(), ")"));
    }
    backoff = std::min(2 * backoff, kReconnectBackoffMax);
  }
  if (absl::IsDeadlineExceeded(st) && st.message() == "Deadline Exceeded") {
    // gRPC's own deadline: the leader never answered.
    return absl::DeadlineExceededError(absl::StrCat(
        ShardName(0), ": Recover: no answer from the leader before the "
        "deadline (it is down, restarting or unreachable)"));
  }
  if (!st.ok()) {
    // The leader's own messages already start with "Recover:".
    return ExplainFingerprintRefusal(
        Prefixed(st, absl::StartsWith(st.message(), "Recover:")
                         ? ShardName(0)
                         : absl::StrCat(ShardName(0), ": Recover")));
  }
  const std::string where = absl::StrCat(ShardName(0), ": Recover");
  epoch_ = std::max(epoch_, response.epoch());
  if (response.next_step() < 0) {
    return absl::InternalError(
        absl::StrCat(where, ": negative step ", response.next_step()));
  }
  // The leader answered: keep the rank alive on it until the next step's
  // push (a Join of the rank meanwhile gets ALREADY_EXISTS).
  OpenLeaderStream();
  if (response.next_step() == next_step_) return next_step_;
  GTOPK_ASSIGN_OR_RETURN(const int64_t step, SynchronizeParameters(params));
  if (step != response.next_step()) {
    return absl::AbortedError(
        absl::StrCat("Recover: the leader reported step ", response.next_step(),
                     " but the shards served step ", step, "; try again"));
  }
  return step;
}

// --- One step --------------------------------------------------------------

namespace {

// Dense mode: the pull of a shard of `len` entries has len finite values.
absl::Status CheckDensePull(const v1::Pull& pull, uint64_t len) {
  if (static_cast<uint64_t>(pull.dense_size()) != len) {
    return absl::InternalError(absl::StrCat(
        "dense pull has ", pull.dense_size(), " values, range has ", len));
  }
  const absl::Status finite = ValidateFinite(pull.dense(), "dense pull");
  if (!finite.ok()) return absl::InternalError(finite.message());
  return absl::OkStatus();
}

// The sparse pull of the shard owning [begin, end) of the n entries.
absl::StatusOr<SparseVector> DecodeSparsePull(const v1::Pull& pull, uint64_t n,
                                              uint64_t begin, uint64_t end) {
  SparseVector part;
  const absl::Status st = DecodeSparse(pull.sparse(), n, &part);
  if (!st.ok()) {
    return absl::InternalError(
        absl::StrCat("undecodable pull: ", st.message()));
  }
  if (!part.empty() &&
      (part.indices.front() < begin || part.indices.back() >= end)) {
    return absl::InternalError(
        absl::StrCat("pull has indices outside [", begin, ", ", end, ")"));
  }
  return part;
}

}  // namespace

absl::StatusOr<StepStats> WorkerClient::BeginStep(uint64_t n) const {
  StepStats stats;
  stats.step = next_step_;
  stats.bytes_sent.assign(shards_.size(), 0);
  stats.bytes_received.assign(shards_.size(), 0);
  GTOPK_ASSIGN_OR_RETURN(stats.k, rule_.KAt(next_step_, n));
  return stats;
}

absl::StatusOr<StepStats> WorkerClient::Step(absl::Span<const float> gradient,
                                             absl::Span<float> params) {
  const uint64_t n = cluster_.n();
  if (gradient.size() != n || params.size() != n) {
    return absl::InvalidArgumentError(absl::StrCat(
        "Step: gradient has ", gradient.size(), " values and params ",
        params.size(), "; n = ", n));
  }
  GTOPK_ASSIGN_OR_RETURN(StepStats stats, BeginStep(n));

  const absl::Time t = absl::Now();
  // Nothing changed when this fails (its contract).
  GTOPK_RETURN_IF_ERROR(rule_.AccumulateLocal(stats.step, gradient, params,
                                              absl::MakeSpan(velocity_),
                                              feedback_.mutable_residual()));
  stats.accumulate = absl::Now() - t;

  // From here on the residual holds u; a failure must leave it there.
  GTOPK_RETURN_IF_ERROR(mode_ == Mode::kDense
                            ? DenseStepOnHost(params, &stats)
                            : SparseStepOnHost(params, &stats));
  ++next_step_;
  return stats;
}

absl::Status WorkerClient::DenseStepOnHost(absl::Span<float> params,
                                           StepStats* stats) {
  const int64_t step = stats->step;
  const std::vector<v1::Push> pushes = DensePushes(step, stats);
  std::vector<v1::Pull> pulls;
  GTOPK_RETURN_IF_ERROR(
      PushAndDecodePulls(step, pushes, &pulls, stats).status());

  const absl::Time t = absl::Now();
  GTOPK_RETURN_IF_ERROR(
      CheckServersUpdate(step, pulls, SparseVector(), params));
  const int P = static_cast<int>(cluster_.num_workers());
  for (size_t s = 0; s < shards_.size(); ++s) {
    const uint64_t begin = shards_[s]->begin;
    const uint64_t len = shards_[s]->end - begin;
    // Checked above (CheckServersUpdate), nothing changed since.
    rule_.StoreAggregatedDense(
        pulls[s].dense(), P, params.subspan(begin, len),
        absl::MakeSpan(global_velocity_).subspan(begin, len));
  }
  // Everything accumulated was applied.
  std::fill(feedback_.mutable_residual().begin(),
            feedback_.mutable_residual().end(), 0.0f);
  stats->apply = absl::Now() - t;
  return absl::OkStatus();
}

absl::Status WorkerClient::SparseStepOnHost(absl::Span<float> params,
                                            StepStats* stats) {
  const int64_t step = stats->step;
  absl::Time t = absl::Now();
  SparseVector sent;
  GTOPK_RETURN_IF_ERROR(selector_->Select(feedback_.residual(), stats->k,
                                          static_cast<uint64_t>(step), &sent));
  SparseVector received = sent;
  QuantizeValues(codec_.value, absl::MakeSpan(received.values));
  GTOPK_RETURN_IF_ERROR(feedback_.MarkSent(sent, received));
  stats->select = absl::Now() - t;
  stats->sent_pairs = sent.size();

  // From here a failure puts every sent entry back:
  // residual[i] = fl(fl(u - recv) + recv).
  auto fail = [&](const absl::Status& status) -> absl::Status {
    const absl::Status restored = feedback_.PutBack(received, SparseVector());
    if (!restored.ok()) {
      return absl::InternalError(absl::StrCat(
          status.ToString(),
          "; and restoring the residual failed: ", restored.ToString()));
    }
    return status;
  };
  absl::StatusOr<std::vector<v1::Push>> pushes =
      EncodePushes(step, sent, stats);
  if (!pushes.ok()) return fail(pushes.status());
  std::vector<v1::Pull> pulls;
  absl::StatusOr<SparseVector> global =
      PushAndDecodePulls(step, *pushes, &pulls, stats);
  if (!global.ok()) return fail(global.status());

  t = absl::Now();
  if (absl::Status st = CheckServersUpdate(step, pulls, *global, params);
      !st.ok()) {
    return fail(st);
  }
  if (mode_ == Mode::kGtopk) {
    GTOPK_RETURN_IF_ERROR(feedback_.PutBack(received, *global));
  }
  GTOPK_RETURN_IF_ERROR(
      rule_.MaskMomentum(sent, *global, absl::MakeSpan(velocity_)));
  // Checked above (CheckServersUpdate); PutBack and MaskMomentum touch
  // neither params nor the global velocity.
  rule_.StoreAggregated(*global, 0, static_cast<int>(cluster_.num_workers()),
                        params, absl::MakeSpan(global_velocity_));
  stats->apply = absl::Now() - t;
  return absl::OkStatus();
}

absl::StatusOr<StepStats> WorkerClient::Step(const float* gradient,
                                             float* params, uint64_t n,
                                             CUstream_st* stream) {
  if (n != cluster_.n() || gradient == nullptr || params == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "Step (device): n = ", n, " (cluster n = ", cluster_.n(),
        "), gradient and params must be non-null device pointers"));
  }
  if (mode_ == Mode::kDense) {
    // Dense mode sends u itself: it has to reach the host.
    absl::StatusOr<StepStats> stats;
    GTOPK_RETURN_IF_ERROR(
        DeviceStep::RunOnHostCopies(gradient, params, n, stream,
                                    [&](absl::Span<const float> host_gradient,
                                        absl::Span<float> host_params) {
                                      stats = Step(host_gradient, host_params);
                                      return stats.status();
                                    }));
    return stats;
  }
  if (device_ == nullptr) {
    // First device step: move the host state to the device.
    GTOPK_ASSIGN_OR_RETURN(
        device_,
        DeviceStep::Create(selector_->name(),
                           SelectorSeedForRank(cluster_.selector_seed(), rank_),
                           rule_.options(), n, feedback_.residual(), velocity_,
                           global_velocity_, stream));
  }
  GTOPK_ASSIGN_OR_RETURN(StepStats stats, BeginStep(n));
  GTOPK_RETURN_IF_ERROR(SparseStepOnDevice(gradient, params, stream, &stats));
  ++next_step_;
  return stats;
}

absl::Status WorkerClient::SparseStepOnDevice(const float* gradient,
                                              float* params,
                                              CUstream_st* stream,
                                              StepStats* stats) {
  const int64_t step = stats->step;
  absl::Time t = absl::Now();
  // u into the spare device buffers; committed once the selection succeeded.
  GTOPK_RETURN_IF_ERROR(
      device_->Accumulate(gradient, params, rule_.LrAt(step), stream));
  stats->accumulate = absl::Now() - t;

  t = absl::Now();
  GTOPK_ASSIGN_OR_RETURN(const DeviceStep::Sent sent,
                         device_->Select(stats->k, step, codec_.value, stream));
  stats->select = absl::Now() - t;
  stats->sent_pairs = sent.sent.size();

  // From here a failure puts every sent value back (residual holds u).
  auto fail = [&](const absl::Status& status) {
    return device_->PutBackAll(sent, status, stream);
  };
  absl::StatusOr<std::vector<v1::Push>> pushes =
      EncodePushes(step, sent.sent, stats);
  if (!pushes.ok()) return fail(pushes.status());
  std::vector<v1::Pull> pulls;
  absl::StatusOr<SparseVector> global =
      PushAndDecodePulls(step, *pushes, &pulls, stats);
  if (!global.ok()) return fail(global.status());

  t = absl::Now();
  GTOPK_RETURN_IF_ERROR(device_->Apply(sent, *global, mode_ == Mode::kGtopk,
                                       cluster_.num_workers(), params, stream));
  stats->apply = absl::Now() - t;
  return absl::OkStatus();
}

std::vector<v1::Push> WorkerClient::NewPushes(int64_t step) const {
  std::vector<v1::Push> pushes(shards_.size());
  for (size_t s = 0; s < shards_.size(); ++s) {
    pushes[s].set_step(step);
    pushes[s].set_worker(rank_);
    pushes[s].set_epoch(epoch_);
    pushes[s].set_shard_id(shards_[s]->id);
    pushes[s].set_member_token(member_token_);
    pushes[s].set_cluster_fingerprint(cluster_.cluster_fingerprint());
  }
  return pushes;
}

absl::StatusOr<std::vector<v1::Push>> WorkerClient::EncodePushes(
    int64_t step, const SparseVector& sent, StepStats* stats) const {
  const absl::Time t = absl::Now();
  std::vector<v1::Push> pushes = NewPushes(step);
  for (size_t s = 0; s < shards_.size(); ++s) {
    const SparseVector slice = Slice(sent, shards_[s]->begin, shards_[s]->end);
    const absl::Status st =
        EncodeSparse(slice, cluster_.n(), codec_, pushes[s].mutable_sparse());
    if (!st.ok()) return Prefixed(st, ShardName(s));
    stats->bytes_sent[s] = pushes[s].ByteSizeLong();
  }
  stats->encode = absl::Now() - t;
  return pushes;
}

std::vector<v1::Push> WorkerClient::DensePushes(int64_t step,
                                                StepStats* stats) const {
  const absl::Time t = absl::Now();
  std::vector<v1::Push> pushes = NewPushes(step);
  const absl::Span<const float> u = feedback_.residual();
  for (size_t s = 0; s < shards_.size(); ++s) {
    const uint64_t len = shards_[s]->end - shards_[s]->begin;
    auto* dense = pushes[s].mutable_dense();
    dense->Resize(static_cast<int>(len), 0.0f);
    if (len > 0) {
      std::memcpy(dense->mutable_data(), u.data() + shards_[s]->begin,
                  len * sizeof(float));
    }
    stats->bytes_sent[s] = pushes[s].ByteSizeLong();
  }
  stats->sent_pairs = cluster_.n();
  stats->encode = absl::Now() - t;
  return pushes;
}

absl::StatusOr<SparseVector> WorkerClient::PushAndDecodePulls(
    int64_t step, const std::vector<v1::Push>& pushes,
    std::vector<v1::Pull>* pulls, StepStats* stats) {
  const absl::Time t = absl::Now();
  absl::Duration push_time;
  GTOPK_RETURN_IF_ERROR(PushPullRound(step, pushes, pulls, &push_time));
  GTOPK_ASSIGN_OR_RETURN(SparseVector global, DecodePulls(step, *pulls, stats));
  stats->push_wait = absl::Now() - t;
  stats->push = std::min(push_time, stats->push_wait);
  stats->wait = stats->push_wait - stats->push;
  return global;
}

absl::StatusOr<SparseVector> WorkerClient::DecodePulls(
    int64_t step, const std::vector<v1::Pull>& pulls, StepStats* stats) {
  SparseVector global;
  for (size_t s = 0; s < shards_.size(); ++s) {
    const ShardConn& c = *shards_[s];
    const v1::Pull& pull = pulls[s];
    stats->bytes_received[s] = pull.ByteSizeLong();
    stats->server_merge =
        std::max(stats->server_merge,
                 absl::Microseconds(static_cast<int64_t>(pull.merge_us())));
    stats->server_select =
        std::max(stats->server_select,
                 absl::Microseconds(static_cast<int64_t>(pull.select_us())));
    absl::Status bad;
    if (pull.step() != step || pull.shard_id() != c.id) {
      bad = absl::InternalError(absl::StrCat(
          "pull is for step ", pull.step(), " shard ", pull.shard_id(),
          ", expected step ", step));
    } else if (mode_ == Mode::kDense) {
      bad = CheckDensePull(pull, c.end - c.begin);
      stats->received_pairs += pull.dense_size();
    } else if (absl::StatusOr<SparseVector> part =
                   DecodeSparsePull(pull, cluster_.n(), c.begin, c.end);
               !part.ok()) {
      bad = part.status();
    } else {
      // Shards are in index order, so the union stays sorted.
      global.indices.insert(global.indices.end(), part->indices.begin(),
                            part->indices.end());
      global.values.insert(global.values.end(), part->values.begin(),
                           part->values.end());
      stats->received_pairs += part->size();
    }
    if (!bad.ok()) {
      CloseStreams();
      return Prefixed(bad, ShardName(s));
    }
  }
  return global;
}

absl::Status WorkerClient::CheckServersUpdate(
    int64_t step, const std::vector<v1::Pull>& pulls,
    const SparseVector& global, absl::Span<const float> params) const {
  // The servers refused any step whose update would not stay finite, and
  // this replica holds their bits, so this check passes unless the replica
  // diverged; it runs before anything changes so that no state is half
  // updated then (the entries sent go back to the residual).
  const int P = static_cast<int>(cluster_.num_workers());
  absl::Status finite;
  if (mode_ == Mode::kDense) {
    for (size_t s = 0; s < shards_.size() && finite.ok(); ++s) {
      const uint64_t begin = shards_[s]->begin;
      const uint64_t len = shards_[s]->end - begin;
      finite = rule_.CheckAggregatedDense(
          pulls[s].dense(), P, begin, params.subspan(begin, len),
          absl::MakeConstSpan(global_velocity_).subspan(begin, len));
    }
  } else {
    finite = rule_.CheckAggregated(global, 0, P, params, global_velocity_);
  }
  if (finite.ok()) return finite;
  return absl::InternalError(
      absl::StrCat("step ", step,
                   ": the servers' update cannot be applied to this "
                   "replica (its parameters differ from the servers'): ",
                   finite.message()));
}

// --- The push/pull round ---------------------------------------------------

// One PushPullRound's state, shared by the shards' threads and the thread
// that waits for them. Fields marked (mu) are guarded by mu; the others are
// written only by the waiting thread, and read after the threads joined.
struct WorkerClient::Round {
  Round(size_t num_shards, absl::Duration watchdog_budget)
      : budget(watchdog_budget),
        results(num_shards),
        done(num_shards, false),
        cancelled(num_shards, false),
        timed_out(num_shards, false),
        cut_short(num_shards, false) {}

  // The step watchdog: the cluster's step timeout plus
  // ClientOptions::step_watchdog_margin.
  const absl::Duration budget;
  const absl::Time start = absl::Now();
  absl::Mutex mu;
  absl::Time last_written = start;    // (mu) when the last push was written
  std::vector<absl::Status> results;  // (mu) each shard's outcome
  std::vector<bool> done;             // (mu) results[s] is final
  size_t finished = 0;                // (mu) shards done
  size_t failed = 0;                  // (mu) shards done with an error
  uint64_t learned_epoch = 0;         // (mu) from failed streams' trailers
  // Shards whose stream the watchdog has cancelled (mu): a stream reopened
  // for them after that must start cancelled, or opening it
  // (wait-for-ready, no deadline) would block on a dead shard for ever.
  std::vector<bool> cancelled;
  // Shards cancelled at the watchdog deadline.
  std::vector<bool> timed_out;
  // Shards cancelled because another shard already failed the step: a step
  // that failed on one shard cannot be committed on any (the commit vote),
  // so waiting for the others would only delay the caller's retry or
  // recovery until their step timeout.
  std::vector<bool> cut_short;
};

namespace {

// The attempt epoch a shard sent in a failed stream's trailers
// (common/epoch.h), or 0 when there is none. Epochs start at the leader's
// start time in microseconds: a far-future one is ignored.
uint64_t EpochFromTrailers(const grpc::ClientContext& context) {
  const auto& trailers = context.GetServerTrailingMetadata();
  const auto it = trailers.find(kEpochMetadataKey);
  if (it == trailers.end()) return 0;
  uint64_t epoch = 0;
  if (!absl::SimpleAtoi(absl::string_view(it->second.data(), it->second.size()),
                        &epoch) ||
      !IsPlausibleEpoch(epoch)) {
    return 0;
  }
  return epoch;
}

// The status of a stream that ended without its pull: the server's, or
// UNAVAILABLE when it closed the stream with OK; RESOURCE_EXHAUSTED says
// which limit to raise.
absl::Status StreamFailure(const grpc::Status& st, int64_t step,
                           uint64_t max_message_bytes) {
  absl::Status result =
      st.ok() ? absl::UnavailableError(absl::StrCat(
                    "stream closed by the server during step ", step))
              : FromGrpcStatus(st);
  if (absl::IsResourceExhausted(result)) {
    result = absl::ResourceExhaustedError(absl::StrCat(
        result.message(),
        " (a push or pull exceeds the cluster's max_message_bytes = ",
        max_message_bytes,
        "; raise the servers' --max-message-bytes, or use more shards "
        "or a lower density)"));
  }
  return result;
}

}  // namespace

absl::Status WorkerClient::PushPullRound(int64_t step,
                                         const std::vector<v1::Push>& pushes,
                                         std::vector<v1::Pull>* pulls,
                                         absl::Duration* push_time) {
  const size_t S = shards_.size();
  pulls->assign(S, v1::Pull());
  Round round(S, absl::Milliseconds(cluster_.step_timeout_ms()) +
                     options_.step_watchdog_margin);
  for (auto& c : shards_) {
    if (c->stream == nullptr) {
      SetStreamContext(*c);
      c->broken = false;
    }
  }
  std::vector<std::thread> threads;
  threads.reserve(S);
  for (size_t s = 0; s < S; ++s) {
    threads.emplace_back([&, s] {
      absl::Status result =
          PushPullOnShard(s, step, pushes[s], &(*pulls)[s], round);
      absl::MutexLock lock(&round.mu);
      if (!result.ok()) ++round.failed;
      round.results[s] = std::move(result);
      round.done[s] = true;
      ++round.finished;
    });
  }
  AwaitShards(round);
  for (auto& t : threads) t.join();
  *push_time = round.last_written - round.start;
  epoch_ = std::max(epoch_, round.learned_epoch);

  const absl::Status status = RoundStatus(step, round);
  if (status.ok()) return status;
  CloseStreams();
  return ExplainFingerprintRefusal(status);
}

absl::Status WorkerClient::PushPullOnShard(size_t s, int64_t step,
                                           const v1::Push& push, v1::Pull* pull,
                                           Round& round) {
  ShardConn& c = *shards_[s];
  if (c.stream == nullptr) c.stream = c.stub->PushPull(c.context.get());
  bool written = c.stream->Write(push);
  if (!written) {
    // The stream died before this push got through (e.g. the shard
    // restarted since the last step): finish it and push once more on a
    // fresh stream. Safe: a shard takes one push per (step, worker) and
    // treats a repeat as a retry.
    v1::Pull ignored;
    while (c.stream->Read(&ignored)) {
    }
    c.stream->Finish().IgnoreError();
    {
      absl::MutexLock lock(&round.mu);  // the watchdog cancels under mu
      c.stream.reset();
      SetStreamContext(c);
      // Cancelling a context before its call starts cancels the call
      // when it starts (grpc::ClientContext::TryCancel).
      if (round.cancelled[s]) c.context->TryCancel();
    }
    c.stream = c.stub->PushPull(c.context.get());
    written = c.stream->Write(push);
  }
  if (written) {
    absl::MutexLock lock(&round.mu);
    round.last_written = std::max(round.last_written, absl::Now());
  }
  if (written && c.stream->Read(pull)) return absl::OkStatus();

  // Finish needs every incoming message read; after a failed Read there
  // are none left.
  v1::Pull ignored;
  while (!written && c.stream->Read(&ignored)) {
  }
  const grpc::Status st = c.stream->Finish();
  c.broken = true;
  // The shard numbers a failed attempt (common/epoch.h): this worker's
  // next push of the step is a retry of it.
  if (const uint64_t epoch = EpochFromTrailers(*c.context); epoch != 0) {
    absl::MutexLock lock(&round.mu);
    round.learned_epoch = std::max(round.learned_epoch, epoch);
  }
  return StreamFailure(st, step, cluster_.max_message_bytes());
}

void WorkerClient::AwaitShards(Round& round) const {
  const size_t S = shards_.size();
  absl::MutexLock lock(&round.mu);
  // Cancels every shard still out, marking it in `why`.
  auto cancel_unfinished = [&](std::vector<bool>& why) {
    for (size_t s = 0; s < S; ++s) {
      if (!round.done[s]) {
        why[s] = true;
        round.cancelled[s] = true;
        shards_[s]->context->TryCancel();
      }
    }
  };
  auto all_done_or_failed = [&] {
    return round.finished == S || round.failed > 0;
  };
  auto all_done = [&] { return round.finished == S; };
  const absl::Time watchdog = absl::Now() + round.budget;
  if (!round.mu.AwaitWithDeadline(absl::Condition(&all_done_or_failed),
                                  watchdog)) {
    cancel_unfinished(round.timed_out);
  } else if (round.finished < S &&
             !round.mu.AwaitWithDeadline(
                 absl::Condition(&all_done),
                 std::min(watchdog, absl::Now() + kFailureGrace))) {
    // A short grace first: shards failing at about the same time (e.g.
    // all at the step deadline) still report their own, often more
    // telling, errors.
    cancel_unfinished(round.cut_short);
  }
  round.mu.Await(absl::Condition(&all_done));  // prompt after the cancel
}

absl::Status WorkerClient::RoundStatus(int64_t step, const Round& round) const {
  const size_t S = shards_.size();
  std::vector<std::string> messages;
  absl::StatusCode code = absl::StatusCode::kOk;
  for (size_t s = 0; s < S; ++s) {
    absl::Status st = round.results[s];
    if (round.timed_out[s]) {
      st = absl::DeadlineExceededError(absl::StrCat(
          "no pull for step ", step, " within ",
          absl::FormatDuration(round.budget), " (step timeout ",
          cluster_.step_timeout_ms(), "ms + margin); ", "stream cancelled"));
    }
    if (st.ok() || round.cut_short[s]) continue;
    // The step's cause, not its echo: ABORTED means "failed elsewhere"
    // (another shard, another worker), so any other code a shard reports
    // (e.g. FAILED_PRECONDITION for an update that would not be finite, on
    // the shard where it happened) is the step's code.
    if (code == absl::StatusCode::kOk ||
        (code == absl::StatusCode::kAborted && !absl::IsAborted(st))) {
      code = st.code();
    }
    messages.push_back(absl::StrCat(ShardName(s), ": ", st.message()));
  }
  if (code == absl::StatusCode::kOk) {
    bool any_cut = false;
    for (size_t s = 0; s < S; ++s) {
      any_cut |= round.cut_short[s] && !round.results[s].ok();
    }
    if (!any_cut) return absl::OkStatus();
    code = absl::StatusCode::kInternal;  // unreachable: a failure cut it
  }
  return absl::Status(code, absl::StrJoin(messages, "; "));
}

}  // namespace worker
}  // namespace gtopk
