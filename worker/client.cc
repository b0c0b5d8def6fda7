// WorkerClient (worker/client.h): joining the cluster, the shards' streams,
// parameter synchronisation, the worker's state and recovery. One step is in
// worker/client_step.cc, its pushes and pulls in worker/push_pull_round.cc.
#include "worker/client.h"

#include <algorithm>
#include <climits>
#include <cstring>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "common/cluster_spec/cluster_spec.h"
#include "common/grpc_edge/grpc_edge.h"
#include "common/random.h"
#include "common/status_macros.h"
#include "grpcpp/grpcpp.h"
#include "worker/client_internal.h"
#include "worker/device_step.h"

namespace gtopk {
namespace worker {
namespace {

// gRPC's default message limit; every chunked transfer stays below it.
constexpr uint64_t kDefaultMessageBytes = uint64_t{4} << 20;

uint64_t MessageLimit(const v1::ClusterSpec& c) {
  const uint64_t limit =
      c.max_message_bytes() == 0 ? kDefaultMessageBytes : c.max_message_bytes();
  return std::min<uint64_t>(limit, INT_MAX);
}

// Asks every non-leader shard for the cluster spec (GetClusterSpec), so
// that a shard started with other settings than the leader is found before
// the first step: the shard compares the leader's spec with its own flags
// and refuses with FAILED_PRECONDITION naming each differing flag and both
// values. Waits for shards that are still starting, up to `timeout` in all.
// Each shard's answer also says whether its program takes pushes in parts
// (its own ShardSpec.takes_push_parts): `*without_parts` gets the names of
// those that do not ("shard 1 (host:port)"; the leader's from its Join
// answer, `leader_spec`), empty when every shard does.
template <typename Shards>
absl::Status CheckShardsAgree(const Shards& shards,
                              const v1::ClusterSpec& leader_spec,
                              absl::Duration timeout,
                              Cancellation* cancellation,
                              std::vector<std::string>* without_parts) {
  without_parts->clear();
  if (!leader_spec.shards(0).takes_push_parts()) {
    without_parts->push_back(
        absl::StrCat("shard ", shards[0]->id, " (", shards[0]->address, ")"));
  }
  const absl::Time deadline = absl::Now() + timeout;
  for (size_t s = 1; s < shards.size(); ++s) {
    const std::string where =
        absl::StrCat("shard ", shards[s]->id, " (", shards[s]->address, ")");
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
    // Its own entry, said by itself (the proto's ShardSpec.takes_push_parts).
    if (!spec.shards(static_cast<int>(s)).takes_push_parts()) {
      without_parts->push_back(where);
    }
  }
  return absl::OkStatus();
}

// Each shard's answer again, after Recover (a shard may have restarted
// with another program): the names of the shards that do not take pushes
// in parts, as CheckShardsAgree gives them, or every shard when an answer
// failed (whole pushes are what every server takes). A failed answer is
// asked again for up to kPartsAskFor (break-it run: right after a leader's
// restart, a shard's own channel to it still failed for about a second,
// and every later step of the run pushed whole).
constexpr absl::Duration kPartsAskFor = absl::Seconds(3);
template <typename Shards>
std::string ShardsWithoutPartsOnce(const Shards& shards, absl::Time deadline,
                                   Cancellation* cancellation, bool* known);
template <typename Shards>
std::string ShardsWithoutParts(const Shards& shards, absl::Time deadline,
                               Cancellation* cancellation) {
  const absl::Time until = std::min(deadline, absl::Now() + kPartsAskFor);
  absl::Duration backoff = absl::Milliseconds(100);
  while (true) {
    bool known = false;
    std::string without =
        ShardsWithoutPartsOnce(shards, deadline, cancellation, &known);
    if (known || absl::Now() + backoff >= until) return without;
    if (cancellation == nullptr) {
      absl::SleepFor(backoff);
    } else if (cancellation->SleepUnlessCancelled(backoff)) {
      return without;
    }
    backoff = std::min(2 * backoff, absl::Seconds(1));
  }
}

template <typename Shards>
std::string ShardsWithoutPartsOnce(const Shards& shards, absl::Time deadline,
                                   Cancellation* cancellation, bool* known) {
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(deadline));
  Cancellation::Scope cancel_scope(cancellation, &context);
  v1::ClusterSpec leader;
  absl::Status st = FromGrpcStatus(
      shards[0]->stub->GetClusterSpec(&context, v1::JoinRequest(), &leader));
  if (st.ok() && leader.shards_size() != static_cast<int>(shards.size())) {
    st = absl::FailedPreconditionError(
        absl::StrCat("the leader's spec has ", leader.shards_size(),
                     " shards, not ", shards.size()));
  }
  std::vector<std::string> without;
  if (st.ok()) {
    st = CheckShardsAgree(
        shards, leader, std::max(deadline - absl::Now(), absl::ZeroDuration()),
        cancellation, &without);
  }
  *known = st.ok();
  if (!st.ok()) {
    return absl::StrCat("every shard (not known after Recover: ", st.message(),
                        ")");
  }
  return absl::StrJoin(without, ", ");
}

// One chunk of the DownloadParams stream of shard `shard_id`, which owns
// [begin, end): expected at `offset`
// and, after the first chunk (shard_step >= 0), for the same step.
// Errors: INTERNAL naming the chunk, prefixed with `where`.
absl::Status CheckParamsChunk(const v1::ParamsChunk& chunk, uint32_t shard_id,
                              uint64_t begin, uint64_t end, uint64_t offset,
                              int64_t shard_step, absl::string_view where) {
  if (chunk.shard_id() != shard_id || chunk.offset() != offset ||
      static_cast<uint64_t>(chunk.values_size()) > end - offset ||
      (shard_step >= 0 && chunk.step() != shard_step) || chunk.step() < 0) {
    return absl::InternalError(
        absl::StrCat(where, ": malformed chunk (shard ", chunk.shard_id(),
                     ", offset ", chunk.offset(), ", ", chunk.values_size(),
                     " values, step ", chunk.step(), "); expected offset ",
                     offset, " in [", begin, ", ", end, ")"));
  }
  if (chunk.global_velocity_size() != 0 &&
      chunk.global_velocity_size() != chunk.values_size()) {
    return absl::InternalError(
        absl::StrCat(where, ": chunk at offset ", chunk.offset(), " has ",
                     chunk.values_size(), " values but ",
                     chunk.global_velocity_size(), " global velocity entries"));
  }
  return absl::OkStatus();
}

}  // namespace

uint64_t WorkerClient::SelectorSeedForRank(uint64_t cluster_seed,
                                           uint32_t rank) {
  // A stream id outside the range selectors use for steps.
  return MixSeed(cluster_seed, (uint64_t{1} << 63) | rank);
}

namespace {

// ClientOptions' own checks (INVALID_ARGUMENT naming the field).
absl::Status ValidateClientOptions(const ClientOptions& options) {
  if (options.leader_address.empty()) {
    return absl::InvalidArgumentError("ClientOptions: leader_address is empty");
  }
  if (options.n == 0 || options.n > kMaxDenseLength) {
    return absl::InvalidArgumentError(
        absl::StrCat("ClientOptions: n = ", options.n, " is not in [1, 2^32]"));
  }
  if (options.requested_rank < -1) {
    return absl::InvalidArgumentError(
        absl::StrCat("ClientOptions: requested_rank ", options.requested_rank,
                     " (use -1 for any)"));
  }
  if (options.rpc_timeout <= absl::ZeroDuration() ||
      options.step_watchdog_margin < absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        "ClientOptions: rpc_timeout must be > 0 and step_watchdog_margin >= 0");
  }
  return absl::OkStatus();
}

// Connect's Join on the leader, retried while the leader answers
// UNAVAILABLE ("not now": a rank reserved for its holder after a leader
// restart, a leader shutting down) within options.rpc_timeout. The leader's
// answer, or its status (unprefixed).
absl::StatusOr<v1::JoinResponse> JoinLeader(const ClientOptions& options,
                                            const v1::JoinRequest& request) {
  v1::JoinResponse response;
  auto channel = CreateLimitedChannel(options.leader_address,
                                      kDefaultMessageBytes, options.security);
  auto stub = v1::Aggregator::NewStub(channel);
  const absl::Time join_deadline = absl::Now() + options.rpc_timeout;
  absl::Status s;
  absl::Duration backoff = kReconnectBackoffMin;
  while (true) {
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(join_deadline));
    // A worker may start before the leader: wait for it up to the
    // deadline.
    context.set_wait_for_ready(true);
    Cancellation::Scope cancel_scope(options.cancellation.get(), &context);
    s = FromGrpcStatus(stub->Join(&context, request, &response));
    // The leader says "not now" (a rank reserved for its holder after a
    // leader restart, a leader shutting down): retry within the deadline.
    if (!absl::IsUnavailable(s) || absl::Now() + backoff >= join_deadline) {
      break;
    }
    if (options.cancellation != nullptr
            ? options.cancellation->SleepUnlessCancelled(backoff)
            : (absl::SleepFor(backoff), false)) {
      break;
    }
    backoff = std::min(2 * backoff, kReconnectBackoffMax);
  }
  if (absl::IsDeadlineExceeded(s) &&
      channel->GetState(/*try_to_connect=*/false) != GRPC_CHANNEL_READY) {
    // wait_for_ready retries a refused connection or a failed TLS
    // handshake silently until the deadline: say what it may be.
    s = absl::DeadlineExceededError(absl::StrCat(
        s.message(), " (no connection to the leader within ",
        absl::FormatDuration(options.rpc_timeout),
        ": is it running at this address, and do this worker's TLS "
        "settings match the servers' (--tls off / server / mutual, the CA "
        "bundle)? A TLS mismatch fails every handshake until the "
        "deadline)"));
  }
  if (!s.ok()) return s;
  return response;
}

}  // namespace

absl::StatusOr<std::unique_ptr<WorkerClient>> WorkerClient::Connect(
    const ClientOptions& options) {
  GTOPK_RETURN_IF_ERROR(ValidateClientOptions(options));
  const std::string leader = absl::StrCat("leader ", options.leader_address);
  v1::JoinRequest request;
  request.set_requested_rank(options.requested_rank);
  request.set_n(options.n);
  request.set_run_length(options.run_length);
  absl::StatusOr<v1::JoinResponse> joined = JoinLeader(options, request);
  if (!joined.ok()) {
    return Prefixed(joined.status(), absl::StrCat(leader, ": Join"));
  }
  const v1::JoinResponse& response = *joined;
  const v1::ClusterSpec& cluster = response.cluster();
  const uint32_t rank = response.rank();
  {
    const absl::Status s = ValidateWorkerClusterSpec(cluster, options.n, rank);
    if (!s.ok()) return Prefixed(s, leader);
  }
  if (cluster.selection() == v1::SELECTION_LAYERWISE) {
    // The leader refuses this at Join; a server that predates the bound
    // does not, and every step would then pay for the pieces.
    std::vector<uint64_t> begins;
    for (const v1::ShardSpec& sh : cluster.shards()) {
      begins.push_back(sh.begin());
    }
    const absl::Status s =
        CheckBucketPieceCount(cluster.n(), cluster.bucket_size(), begins);
    if (!s.ok()) return Prefixed(s, leader);
  }
  if (options.requested_rank >= 0 &&
      rank != static_cast<uint32_t>(options.requested_rank)) {
    return absl::InternalError(absl::StrCat(
        leader, ": asked for rank ", options.requested_rank, ", got ", rank));
  }
  const absl::StatusOr<ApplyMode> apply = ApplyModeFromProto(cluster.apply());
  if (!apply.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(leader, ": ", apply.status().message()));
  }
  // Workers apply: error feedback on the raw gradient whatever else the
  // spec's optimizer says (u = residual + 1 * g).
  GTOPK_ASSIGN_OR_RETURN(
      OptimizerOptions optimizer,
      OptimizerFromSpec(*apply == ApplyMode::kWorkers
                            ? IdentityOptimizerSpec(cluster.optimizer())
                            : cluster.optimizer()));
  GTOPK_ASSIGN_OR_RETURN(OptimizerRule rule, OptimizerRule::Create(optimizer));
  SelectorOptions selector_options;
  selector_options.seed = SelectorSeedForRank(cluster.selector_seed(), rank);
  GTOPK_ASSIGN_OR_RETURN(std::unique_ptr<Selector> selector,
                         CreateSelector(cluster.selector(), selector_options));
  CodecSpec codec;
  GTOPK_ASSIGN_OR_RETURN(codec.index, ParseIndexCodec(cluster.index_codec()));
  GTOPK_ASSIGN_OR_RETURN(codec.value, ParseValueCodec(cluster.value_codec()));
  if (!AggregationModeFromProto(cluster.mode()).ok()) {
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
    conn->channel = CreateLimitedChannel(sh.address(), limit, options.security);
    conn->stub = v1::Aggregator::NewStub(conn->channel);
    shards.push_back(std::move(conn));
  }
  std::vector<std::string> without_parts;
  GTOPK_RETURN_IF_ERROR(CheckShardsAgree(shards, cluster, options.rpc_timeout,
                                         options.cancellation.get(),
                                         &without_parts));
  std::unique_ptr<WorkerClient> client(new WorkerClient(
      options, rank, response.member_token(), cluster, std::move(rule),
      std::move(selector), codec, std::move(shards)));
  client->epoch_ = response.epoch();
  client->shards_without_parts_ = absl::StrJoin(without_parts, ", ");
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
      // Connect checked the mode.
      mode_(AggregationModeFromProto(cluster_.mode())
                .value_or(AggregationMode::kDense)),
      apply_(
          ApplyModeFromProto(cluster_.apply()).value_or(ApplyMode::kServers)),
      feedback_(cluster_.n()),
      velocity_(cluster_.n(), 0.0f),
      global_velocity_(cluster_.n(), 0.0f),
      next_step_(cluster_.next_step()) {
  if (cluster_.selection() == v1::SELECTION_LAYERWISE) {
    std::vector<uint64_t> begins;
    for (const auto& c : shards_) begins.push_back(c->begin);
    // Connect checked the spec (bucket_size >= 1, n >= 1).
    absl::StatusOr<std::vector<BucketPiece>> pieces =
        CutBucketPieces(cluster_.n(), cluster_.bucket_size(), begins);
    if (pieces.ok()) pieces_ = *std::move(pieces);
    // Pieces and shards are both in index order: one pass over each (not
    // a walk from shard 0 per piece, pieces x shards).
    size_t s = 0;
    for (const BucketPiece& p : pieces_) {
      while (s + 1 < shards_.size() && shards_[s]->end <= p.begin) ++s;
      piece_shard_.push_back(s);
    }
  }
}

WorkerClient::~WorkerClient() {
  AbandonOverlappedStep();
  CloseStreams();
}

std::string WorkerClient::ShardName(size_t s) const {
  return absl::StrCat("shard ", shards_[s]->id, " (", shards_[s]->address, ")");
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
  if (!shards_[0]
           ->stub->GetClusterSpec(&context, v1::JoinRequest(), &leader)
           .ok()) {
    return status;
  }
  const std::vector<std::string> differences =
      ClusterSpecDifferences(cluster_, leader, "on the leader now");
  if (differences.empty()) return status;
  return absl::FailedPreconditionError(
      absl::StrCat(status.message(),
                   "; the leader's settings differ from those this worker "
                   "joined with (\"here\"): ",
                   absl::StrJoin(differences, "; "),
                   ". Restart the workers (or the leader with the old flags)"));
}

void WorkerClient::CloseStreams(bool keep_leader) {
  for (auto& c : shards_) {
    // A leader stream that still works stays open (the rank stays alive
    // on the leader until this worker's Recover has reached it); a broken
    // one is finished already and is dropped below.
    if (keep_leader && c.get() == shards_.front().get() &&
        c->stream != nullptr && !c->broken) {
      continue;
    }
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
  return SynchronizeParameters(params, nullptr);
}

absl::StatusOr<int64_t> WorkerClient::SynchronizeParameters(
    absl::Span<float> params, std::string* state) {
  const uint64_t n = cluster_.n();
  if (state != nullptr && state->size() > kMaxStateBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "SynchronizeParameters: the state blob has ", state->size(),
        " bytes, more than the 1 GiB the servers keep (the model's buffers "
        "and frozen parameters)"));
  }
  if (params.size() != n) {
    return absl::InvalidArgumentError(
        absl::StrCat("SynchronizeParameters: params has ", params.size(),
                     " values, n = ", n));
  }
  if (rank_ == 0) {
    GTOPK_RETURN_IF_ERROR(ValidateFinite(params, "params"));
    for (size_t s = 0; s < shards_.size(); ++s) {
      GTOPK_RETURN_IF_ERROR(OfferInitialParams(
          s, params, s == 0 && state != nullptr ? *state : std::string()));
    }
  }
  if (state != nullptr) state->clear();

  int64_t step = -1;
  size_t step_shard = 0;
  for (size_t s = 0; s < shards_.size(); ++s) {
    GTOPK_ASSIGN_OR_RETURN(
        const int64_t shard_step,
        DownloadShardParams(s, params, s == 0 ? state : nullptr));
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

absl::Status WorkerClient::OfferInitialParams(size_t s,
                                              absl::Span<const float> params,
                                              absl::string_view state) {
  const uint64_t limit = std::min(MessageLimit(cluster_), kDefaultMessageBytes);
  // Room for the chunk's other fields and framing.
  const uint64_t budget = limit > 2048 ? limit - 1024 : limit / 2;
  const uint64_t chunk_floats = std::max<uint64_t>(1, budget / sizeof(float));

  ShardConn& c = *shards_[s];
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + options_.rpc_timeout));
  Cancellation::Scope cancel_scope(options_.cancellation.get(), &context);
  v1::InitParamsResponse response;
  auto writer = c.stub->InitParams(&context, &response);
  uint64_t offset = c.begin;
  size_t state_offset = 0;
  do {  // at least one chunk, so an empty range still reports back
    const uint64_t len = std::min(chunk_floats, c.end - offset);
    v1::ParamsChunk chunk;
    chunk.set_rank(rank_);
    chunk.set_member_token(member_token_);
    chunk.set_cluster_fingerprint(cluster_.cluster_fingerprint());
    chunk.set_shard_id(c.id);
    chunk.set_offset(offset);
    chunk.mutable_values()->Resize(static_cast<int>(len), 0.0f);
    if (len > 0) {
      std::memcpy(chunk.mutable_values()->mutable_data(),
                  params.data() + offset, len * sizeof(float));
    }
    // The state blob rides on the chunks' spare room: each chunk carries
    // at most `budget` bytes in all, so a chunk full of values carries none
    // and the blob follows in value-less chunks at the range's end.
    const size_t room =
        budget > len * sizeof(float) ? budget - len * sizeof(float) : 0;
    const size_t piece = std::min(room, state.size() - state_offset);
    if (piece > 0) {
      chunk.set_state(std::string(state.substr(state_offset, piece)));
      state_offset += piece;
    }
    if (!writer->Write(chunk)) break;  // Finish() has the reason
    offset += len;
  } while (offset < c.end || state_offset < state.size());
  writer->WritesDone();
  const absl::Status st = FromGrpcStatus(writer->Finish());
  if (!st.ok()) return Prefixed(st, absl::StrCat(ShardName(s), ": InitParams"));
  return absl::OkStatus();
}

absl::StatusOr<int64_t> WorkerClient::DownloadShardParams(
    size_t s, absl::Span<float> params, std::string* state) {
  const ShardConn& c = *shards_[s];
  const std::string where = absl::StrCat(ShardName(s), ": DownloadParams");
  // A read: a call that failed with UNAVAILABLE (sent on a connection that
  // died under it, "Connection reset by peer" or "Socket closed", the
  // first call after the shard was killed and restarted; or the shard down
  // or shutting down) is sent again, waiting for the shard to be ready,
  // with backoff, until the deadline. Every attempt rewrites the whole
  // range, so a partial earlier one leaves nothing behind.
  const absl::Time deadline = absl::Now() + options_.rpc_timeout;
  absl::Duration backoff = kReconnectBackoffMin;
  for (int attempt = 0;; ++attempt) {
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(deadline));
    if (attempt > 0) context.set_wait_for_ready(true);
    Cancellation::Scope cancel_scope(options_.cancellation.get(), &context);
    v1::DownloadParamsRequest request;
    request.set_rank(rank_);
    request.set_cluster_fingerprint(cluster_.cluster_fingerprint());
    auto reader = c.stub->DownloadParams(&context, request);
    v1::ParamsChunk chunk;
    uint64_t offset = c.begin;
    int64_t shard_step = -1;
    absl::Status bad;
    if (state != nullptr) state->clear();
    while (reader->Read(&chunk)) {
      if (!bad.ok()) continue;  // drain before Finish
      bad = CheckParamsChunk(chunk, c.id, c.begin, c.end, offset, shard_step,
                             where);
      if (!bad.ok()) {
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
      if (!chunk.state().empty()) {
        if (state == nullptr) {
          bad = absl::InternalError(absl::StrCat(
              where,
              ": a chunk carries state bytes, which only shard 0 of "
              "a workers-apply cluster sends"));
          context.TryCancel();
        } else if (state->size() + chunk.state().size() > kMaxStateBytes) {
          bad = absl::InternalError(
              absl::StrCat(where, ": the state blob exceeds 1 GiB"));
          context.TryCancel();
        } else {
          state->append(chunk.state());
        }
      }
    }
    const absl::Status st = FromGrpcStatus(reader->Finish());
    GTOPK_RETURN_IF_ERROR(bad);
    if (st.ok()) {
      if (offset != c.end) {
        return absl::InternalError(
            absl::StrCat(where, ": stream ended at index ", offset,
                         ", range ends at ", c.end));
      }
      return shard_step;
    }
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
}

absl::StatusOr<WorkerState> WorkerClient::ExportState() {
  if (device_ != nullptr) {
    GTOPK_RETURN_IF_ERROR(device_->CopyStateToHost(feedback_.mutable_residual(),
                                                   absl::MakeSpan(velocity_)));
  }
  WorkerState state;
  state.next_step = next_step_;
  state.velocity = velocity_;
  if (overlapped_ == nullptr) {
    state.residual.assign(feedback_.residual().begin(),
                          feedback_.residual().end());
    return state;
  }
  // An overlapped step is open: the residual (and velocity) as they were
  // before it (the pieces accumulated so far hold u; their backup holds the
  // residual).
  OverlappedStep& o = *overlapped_;
  absl::MutexLock lock(&o.piece_mu);
  state.residual.assign(feedback_.residual().begin(),
                        feedback_.residual().end());
  state.velocity = velocity_;
  RestoreFromBackups(o, absl::MakeSpan(state.residual),
                     absl::MakeSpan(state.velocity));
  return state;
}

absl::Status WorkerClient::ImportState(const WorkerState& state) {
  const uint64_t n = cluster_.n();
  if (overlapped_ != nullptr) {
    return absl::FailedPreconditionError(
        "ImportState: an overlapped step is open (AbandonOverlappedStep "
        "first)");
  }
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
  return Recover(params, absl::Now() + options_.rpc_timeout +
                             absl::Milliseconds(cluster_.step_timeout_ms()));
}

absl::StatusOr<int64_t> WorkerClient::Recover(absl::Span<float> params,
                                              absl::Time deadline) {
  if (params.size() != cluster_.n() &&
      !(apply_ == ApplyMode::kWorkers && params.empty())) {
    return absl::InvalidArgumentError(absl::StrCat(
        "Recover: params has ", params.size(), " values; n = ", cluster_.n()));
  }
  return RecoverWith(params, deadline, /*resume_step=*/-1);
}

absl::StatusOr<int64_t> WorkerClient::ResumeAt(int64_t step) {
  if (apply_ != ApplyMode::kWorkers) {
    return absl::FailedPreconditionError(
        "ResumeAt: the cluster applies updates on the servers (--apply="
        "servers): there the servers' checkpoints decide the step; restart "
        "them from their checkpoint of the step you resume");
  }
  if (step < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("ResumeAt: step must be >= 0, got ", step));
  }
  return RecoverWith({},
                     absl::Now() + options_.rpc_timeout +
                         absl::Milliseconds(cluster_.step_timeout_ms()),
                     step);
}

absl::StatusOr<int64_t> WorkerClient::RecoverWith(absl::Span<float> params,
                                                  absl::Time deadline,
                                                  int64_t resume_step) {
  // The leader stream stays open until the leader has answered: while it
  // is open the rank is alive on the leader, and once the leader has seen
  // this Recover it keeps the rank reserved for this worker. Closed first,
  // a Join of the rank by another client could take it in between (issue
  // 42's break-it run, during a shard restart).
  CloseStreams(/*keep_leader=*/true);
  v1::RecoverRequest request;
  if (resume_step >= 0) {
    request.set_resume(true);
    request.set_resume_step(resume_step);
  }
  request.set_rank(rank_);
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
      return absl::CancelledError(absl::StrCat(
          ShardName(0), ": Recover: cancelled (after: ", st.message(), ")"));
    }
    backoff = std::min(2 * backoff, kReconnectBackoffMax);
  }
  CloseStreams();
  if (absl::IsDeadlineExceeded(st) && st.message() == "Deadline Exceeded") {
    // gRPC's own deadline: the leader never answered.
    return absl::DeadlineExceededError(
        absl::StrCat(ShardName(0),
                     ": Recover: no answer from the leader before the "
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
  // A shard may have restarted with another program: each says again
  // whether it takes pushes in parts (servers_take_push_parts()).
  const std::string without_parts =
      ShardsWithoutParts(shards_, deadline, options_.cancellation.get());
  if (without_parts != shards_without_parts_) {
    shards_without_parts_ = without_parts;
    whole_pushes_logged_ = false;  // say it again, with the new names
  }
  if (response.next_step() < 0) {
    return absl::InternalError(
        absl::StrCat(where, ": negative step ", response.next_step()));
  }
  if (resume_step >= 0) {
    if (response.next_step() != resume_step) {
      return absl::InternalError(
          absl::StrCat(where, ": asked to resume at step ", resume_step,
                       ", the leader answered step ", response.next_step()));
    }
    OpenLeaderStream();
    next_step_ = resume_step;
    // Every rank must have resumed from a checkpoint of this step: the
    // shards compare the checksums of the first step.
    check_next_step_ = true;
    return next_step_;
  }
  // The leader answered: keep the rank alive on it until the next step's
  // push (a Join of the rank meanwhile gets ALREADY_EXISTS).
  OpenLeaderStream();
  if (response.next_step() == next_step_) return next_step_;
  if (response.next_step() == next_step_ + 1 &&
      result_not_kept_step_ != next_step_) {
    // This worker's step committed but it lost (some of) the result, e.g.
    // a shard stalled past the step watchdog while it answered. Every
    // shard keeps its last committed step's result and answers a repeated
    // push of that step with it (ShardAggregator::Submit): the caller's
    // retry of this step (a zero gradient; the residual holds the failed
    // attempt's u) gets exactly the pulls the other workers applied, and
    // applies them as they did; a retry that failed otherwise (stalled
    // again) is answered again. Once a shard refused the retry because it
    // no longer keeps the result (it restarted: result_not_kept_step_),
    // the parameters are downloaded below (APPLY_SERVERS) or the run is
    // refused (APPLY_WORKERS: nothing to download).
    return next_step_;
  }
  if (apply_ == ApplyMode::kWorkers) {
    // The shards hold only the step: nothing to download.
    if (response.next_step() > next_step_) {
      return absl::FailedPreconditionError(absl::StrCat(
          where, ": the shards are at step ", response.next_step(),
          " but this worker is at step ", next_step_,
          ": it lost the result of a step that committed, which the shards "
          "no longer keep (they keep only the last one's, in memory), and "
          "in workers-apply mode the servers hold no parameters to repair "
          "its replica from. Restart every rank from the checkpoints of one "
          "step (model and optimizer state_dict, loaded on every rank)"));
    }
    next_step_ = response.next_step();  // rolled back: renumbered
    // Every worker must have kept the same state: compare at once.
    check_next_step_ = true;
    return next_step_;
  }
  GTOPK_ASSIGN_OR_RETURN(const int64_t step, SynchronizeParameters(params));
  if (step != response.next_step()) {
    return absl::AbortedError(
        absl::StrCat("Recover: the leader reported step ", response.next_step(),
                     " but the shards served step ", step, "; try again"));
  }
  return step;
}

}  // namespace worker
}  // namespace gtopk
