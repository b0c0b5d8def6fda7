// AggregatorService::PushPull (server/service.h): a worker's step stream to
// one shard, in named steps (PushPullCall): the stream's registration for
// its rank, and per push the sender's checks, its identity, its round
// (decode, Submit) and the pull.
#include <algorithm>
#include <atomic>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/codec.h"
#include "common/grpc_edge/grpc_edge.h"
#include "common/sparse_vector.h"
#include "proto/request_parsing.h"
#include "server/request_checks.h"
#include "server/service.h"

namespace gtopk {
namespace server {
namespace {

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

// The rank and member token a call's metadata names, when it names both.
std::optional<std::pair<uint64_t, uint64_t>> MetadataIdentity(
    const grpc::ServerContext* context) {
  uint64_t rank = 0, token = 0;
  if (MetadataNumber(context, kRankMetadata, &rank) &&
      MetadataNumber(context, kTokenMetadata, &token)) {
    return std::make_pair(rank, token);
  }
  return std::nullopt;
}

// gtopk_server_connected_workers counts the open PushPull streams.
class ConnectedWorker {
 public:
  explicit ConnectedWorker(ServerMetrics* metrics) : metrics_(metrics) {
    metrics_->connected_workers().Increment();
  }
  ~ConnectedWorker() { metrics_->connected_workers().Decrement(); }
  ConnectedWorker(const ConnectedWorker&) = delete;
  ConnectedWorker& operator=(const ConnectedWorker&) = delete;

 private:
  ServerMetrics* const metrics_;
};

}  // namespace

// One PushPull call. Its pushes are served in order, each by Serve; the
// first non-OK status ends the stream. Used by the call's handler thread;
// during a layer-wise step pushed in parts, a writer thread of the call
// (the only other user of stream_, which allows one Write beside the
// handler's Read) sends the piece pulls while the handler reads the next
// parts; the handler joins it before its own Write.
class AggregatorService::PushPullCall {
 public:
  PushPullCall(AggregatorService* service, grpc::ServerContext* context,
               grpc::ServerReaderWriter<v1::Pull, v1::Push>* stream,
               Caller caller)
      : s_(*service),
        context_(context),
        stream_(stream),
        caller_(std::move(caller)),
        connected_(service->metrics_.get()),
        registration_(&service->membership_, context) {}
  ~PushPullCall() { StopWriter(); }
  PushPullCall(const PushPullCall&) = delete;
  PushPullCall& operator=(const PushPullCall&) = delete;

  // Leader: a worker opens its leader stream right after Join, with its
  // identity in the metadata: the rank is alive (Join: ALREADY_EXISTS) from
  // now, not only from its first push.
  void RegisterFromMetadata() {
    const std::optional<std::pair<uint64_t, uint64_t>> identity =
        MetadataIdentity(context_);
    if (!identity.has_value()) return;
    const auto [rank, token] = *identity;
    if (rank < s_.config_.num_workers &&
        s_.access_->CheckRank(caller_, "PushPull", static_cast<int64_t>(rank))
            .ok()) {
      registration_.RegisterFromMetadata(static_cast<uint32_t>(rank), token);
    }
    // Tells the worker (WorkerClient waits for it at Connect) that the rank
    // is registered: a Join after this sees it alive.
    stream_->SendInitialMetadata();
  }

  // One push: OK when the stream goes on (its pull was written), else the
  // status that ends it.
  grpc::Status Serve(const v1::Push& push) {
    s_.metrics_->received_push_bytes().Increment(
        static_cast<double>(push.ByteSizeLong()));
    if (grpc::Status sender = CheckSender(push); !sender.ok()) return sender;
    if (aggregator_ == nullptr || (!s_.is_leader() && !s_.verified_.load())) {
      absl::StatusOr<ShardAggregator*> a =
          s_.GetAggregator(context_, s_.WaitDeadline(context_));
      if (!a.ok()) return ToGrpcStatus(a.status());
      aggregator_ = *a;
    }
    if (const absl::Status identity = VerifyIdentity(push); !identity.ok()) {
      return ToGrpcStatus(identity);
    }
    registration_.Pushed(push.rank());
    if (push.abandon()) {
      // The worker gave up the step after pushing to other shards: fail it
      // everywhere (fail fast, a new epoch), so that no shard applies a
      // push of the abandoned attempt.
      const absl::Status abandoned = absl::CancelledError(absl::StrCat(
          "worker ", push.rank(), " abandoned step ", push.step(),
          " before all its pushes were sent (an error in its backward "
          "pass); retry after Recover"));
      // An abandon of an attempt that already failed (it arrived after the
      // worker's Recover) changes nothing: the retry's round goes on.
      aggregator_->AbandonPush(push.step(), push.rank(), push.epoch(),
                               abandoned);
      return ToGrpcStatus(abandoned);
    }
    if (push.piece_end() > 0 || push.piece_begin() > 0) return ServePart(push);
    // A whole push: no piece pull may be written beside its pull (a writer
    // left from a failed attempt in parts ends now).
    StopWriter();
    absl::StatusOr<WorkerPush> decoded = DecodeOrReject(push);
    if (!decoded.ok()) return ToGrpcStatus(decoded.status());
    registration_.set_in_round(true);
    absl::StatusOr<std::shared_ptr<const RoundResult>> result =
        aggregator_->Submit(*std::move(decoded),
                            absl::Now() + s_.config_.step_timeout);
    if (!result.ok()) return RoundFailed(push, result.status());
    if (grpc::Status sent = SendPull(push, **result); !sent.ok()) return sent;
    registration_.set_in_round(false);
    return grpc::Status::OK;
  }

 private:
  // A part of a layer-wise push (Push.piece_end; docs/overlap.md "Rounds
  // per bucket"): joins the step's piece rounds; OK at once while the
  // worker's push is not complete, else the committed pull.
  // The push decoded; one that does not decode fails the round for
  // everyone, as a bad push inside Submit would.
  absl::StatusOr<WorkerPush> DecodeOrReject(const v1::Push& push) {
    absl::StatusOr<WorkerPush> decoded = s_.DecodePush(push, *aggregator_);
    if (!decoded.ok()) {
      aggregator_->RejectPush(push.step(), push.rank(), decoded.status());
    }
    return decoded;
  }

  grpc::Status ServePart(const v1::Push& push) {
    absl::StatusOr<WorkerPush> decoded = DecodeOrReject(push);
    if (!decoded.ok()) return ToGrpcStatus(decoded.status());
    registration_.set_in_round(true);
    absl::StatusOr<std::shared_ptr<const RoundResult>> result =
        aggregator_->SubmitPart(*std::move(decoded),
                                absl::Now() + s_.config_.step_timeout,
                                &ticket_);
    if (!result.ok()) {
      StopWriter();
      return RoundFailed(push, result.status());
    }
    s_.metrics_->push_parts().Increment();
    // The piece pulls of this round go out as its pieces finish.
    if (writer_round_ != ticket_.round) {
      StopWriter();
      writer_round_ = ticket_.round;
      writer_ =
          std::thread([this, ticket = ticket_] { WritePiecePulls(ticket); });
    }
    if (*result == nullptr) return grpc::Status::OK;  // more parts to come
    // Committed: every piece is done, so the writer ends once it has sent
    // them all; then the committed pull.
    if (writer_.joinable()) writer_.join();
    writer_round_.reset();
    if (writer_lost_.load()) {
      return grpc::Status(grpc::StatusCode::CANCELLED,
                          absl::StrCat("worker ", push.rank(),
                                       " went away before its piece pulls of "
                                       "step ",
                                       push.step()));
    }
    if (grpc::Status sent = SendPull(push, **result, /*committed=*/true);
        !sent.ok()) {
      return sent;
    }
    registration_.set_in_round(false);
    return grpc::Status::OK;
  }

  // The writer thread: every piece of `ticket`'s round, a Pull per run of
  // consecutive pieces that finished together (Pull.piece_begin/piece_end),
  // until all are sent, the round fails, the worker goes away or the
  // handler stops it (writer_stop_).
  void WritePiecePulls(const ShardAggregator::RoundTicket& ticket) {
    writer_lost_ = false;
    ShardAggregator::PiecesSent sent;
    while (!writer_stop_.load()) {
      // No deadline of its own: the round's deadlines are its complete
      // pushes' (Submit's), counted from each worker's last part, as a
      // whole push's, so that the backward pass after the first bucket
      // does not count against the step timeout.
      absl::StatusOr<
          std::vector<std::pair<size_t, std::shared_ptr<const PieceResult>>>>
          done = aggregator_->AwaitPieces(ticket, &sent, absl::InfiniteFuture(),
                                          absl::Now() + absl::Milliseconds(50));
      if (!done.ok()) return;  // the round failed: the handler reports it
      for (size_t a = 0; a < done->size();) {
        size_t b = a + 1;  // [a, b): a run of consecutive pieces
        while (b < done->size() &&
               (*done)[b].first == (*done)[b - 1].first + 1) {
          ++b;
        }
        if (!WritePiecePull(ticket.step, *done, a, b)) {
          writer_lost_ = true;
          return;
        }
        a = b;
      }
      if (sent.all(aggregator_->pieces().size())) return;
    }
  }

  // One piece pull: the pieces done[a, b) (consecutive), their selections
  // concatenated and encoded as a whole pull is. False when the worker
  // went away.
  bool WritePiecePull(
      int64_t step,
      const std::vector<std::pair<size_t, std::shared_ptr<const PieceResult>>>&
          done,
      size_t a, size_t b) {
    SparseVector selected;
    v1::Pull pull;
    absl::Duration merge, select;
    for (size_t i = a; i < b; ++i) {
      const PieceResult& r = *done[i].second;
      selected.indices.insert(selected.indices.end(),
                              r.selected.indices.begin(),
                              r.selected.indices.end());
      selected.values.insert(selected.values.end(), r.selected.values.begin(),
                             r.selected.values.end());
      merge += r.merge_time;
      select += r.select_time;
    }
    if (!EncodeSparse(selected, aggregator_->options().n,
                      CodecSpec{aggregator_->options().pull_index_codec,
                                ValueCodec::kFp32},
                      pull.mutable_sparse())
             .ok()) {
      return false;  // cannot happen: the pieces' indices are valid
    }
    pull.set_step(step);
    pull.set_shard_id(s_.config_.shard_id);
    pull.set_piece_begin(static_cast<uint32_t>(done[a].first));
    pull.set_piece_end(static_cast<uint32_t>(done[b - 1].first + 1));
    pull.set_selected(selected.size());
    pull.set_merge_us(static_cast<uint64_t>(absl::ToInt64Microseconds(merge)));
    pull.set_select_us(
        static_cast<uint64_t>(absl::ToInt64Microseconds(select)));
    if (!stream_->Write(pull)) return false;
    s_.metrics_->sent_pull_bytes().Increment(
        static_cast<double>(pull.ByteSizeLong()));
    s_.metrics_->piece_pulls().Increment();
    return true;
  }

  // Stops and joins the writer thread, if any.
  void StopWriter() {
    writer_stop_ = true;
    if (writer_.joinable()) writer_.join();
    writer_stop_ = false;
    writer_round_.reset();
  }

  // Who sends the push, before anything else: refused alone (the round
  // goes on), except a push on another rank's stream, which fails it.
  grpc::Status CheckSender(const v1::Push& push) {
    {
      // A certificate that names a rank pushes as that rank only; refused
      // alone, like a push without its member token.
      const absl::Status same =
          s_.access_->CheckRank(caller_, "PushPull", push.rank());
      if (!same.ok()) return ToGrpcStatus(same);
    }
    const int64_t stream_worker = registration_.rank();
    if (stream_worker >= 0 && push.rank() != stream_worker &&
        aggregator_ != nullptr) {
      const absl::Status mixed = absl::InvalidArgumentError(
          absl::StrCat("push from worker ", push.rank(),
                       " on the PushPull stream of "
                       "worker ",
                       stream_worker, " (one stream per worker and shard)"));
      s_.metrics_->Rejected(RejectReason::kMixedStream);
      aggregator_->RejectPush(push.step(), static_cast<uint32_t>(stream_worker),
                              mixed);
      return ToGrpcStatus(mixed);
    }
    if (push.rank() >= s_.config_.num_workers) {
      // Not a member of the round: refused alone.
      s_.metrics_->Rejected(RejectReason::kUnknownWorker);
      return ToGrpcStatus(absl::InvalidArgumentError(absl::StrCat(
          "unknown worker rank ", push.rank(), "; the cluster has ",
          s_.config_.num_workers, " workers")));
    }
    return grpc::Status::OK;
  }

  // Identity before anything is decoded: a push from another cluster's
  // configuration or from a worker that does not hold the rank is refused
  // alone; it neither joins nor fails the round.
  absl::Status VerifyIdentity(const v1::Push& push) {
    const std::string who =
        absl::StrCat("worker ", push.rank(), " step ", push.step(), ": ");
    const absl::Time deadline = s_.WaitDeadline(context_);
    absl::Status identity =
        s_.CheckFingerprint(push.cluster_fingerprint(), who, deadline);
    if (!identity.ok()) {
      s_.metrics_->Rejected(RejectReason::kWrongCluster);
      return identity;
    }
    identity = s_.CheckMemberToken(push.rank(), push.member_token(), deadline);
    if (!identity.ok()) {
      s_.metrics_->Rejected(RejectReason::kNotMember);
      if (!absl::StartsWith(identity.message(), "leader ")) {
        identity = absl::Status(identity.code(),
                                absl::StrCat(who, identity.message()));
      }
    }
    return identity;
  }

  // Submit failed: the status that ends the stream.
  grpc::Status RoundFailed(const v1::Push& push, const absl::Status& status) {
    // The failed attempt's epoch, when the leader numbered it: the worker's
    // next push of the step is then a retry, not a leftover.
    if (const uint64_t epoch = aggregator_->AbortEpoch(push.step());
        epoch > 0) {
      context_->AddTrailingMetadata(kEpochMetadataKey, absl::StrCat(epoch));
    }
    // Submit's own rejections of this push (not a round failed by others).
    if (absl::IsResourceExhausted(status)) {
      s_.metrics_->LimitRejected(LimitBound::kPushPairs);
    } else if (absl::IsInvalidArgument(status)) {
      s_.metrics_->Rejected(RejectReason::kInvalid);
    } else if (absl::IsFailedPrecondition(status) &&
               absl::StrContains(status.message(), "step ")) {
      s_.metrics_->Rejected(RejectReason::kWrongStep);
    }
    // The leader refused this shard's fingerprint (a vote or the threshold
    // exchange): name the flags that differ.
    return ToGrpcStatus(
        s_.ExplainLeaderRefusal(status, s_.WaitDeadline(context_)));
  }

  // The round's pull for the pushing worker.
  // `committed`: the last pull of a push in parts (Pull.committed).
  grpc::Status SendPull(const v1::Push& push, const RoundResult& r,
                        bool committed = false) {
    const ServerConfig& config = s_.config_;
    s_.metrics_->RoundCompleted(r);
    v1::Pull pull;
    pull.set_step(r.step);
    pull.set_merge_us(
        static_cast<uint64_t>(absl::ToInt64Microseconds(r.merge_time)));
    pull.set_select_us(
        static_cast<uint64_t>(absl::ToInt64Microseconds(r.select_time)));
    pull.set_shard_id(config.shard_id);
    pull.set_buffers(r.buffers);  // shard 0, --apply=workers; else empty
    pull.set_committed(committed);
    if (committed) {
      // A push in parts got its entries in the piece pulls.
      pull.set_selected(r.selected.size());
    } else if (config.mode == AggregationMode::kDense) {
      pull.mutable_dense()->Add(r.dense_sum.begin(), r.dense_sum.end());
      pull.set_selected(r.dense_sum.size());
    } else {
      pull.set_sparse(r.encoded);
      pull.set_selected(r.selected.size());
    }
    const size_t bytes = pull.ByteSizeLong();
    if (bytes > config.max_message_bytes) {
      return ToGrpcStatus(absl::ResourceExhaustedError(absl::StrCat(
          "pull of step ", r.step, " from shard ", config.shard_id, " is ",
          bytes, " bytes, over max_message_bytes ", config.max_message_bytes)));
    }
    if (!stream_->Write(pull)) {
      return grpc::Status(
          grpc::StatusCode::CANCELLED,
          absl::StrCat("worker ", push.rank(),
                       " went away before its pull of step ", r.step));
    }
    s_.metrics_->sent_pull_bytes().Increment(static_cast<double>(bytes));
    return grpc::Status::OK;
  }

  AggregatorService& s_;
  grpc::ServerContext* const context_;
  grpc::ServerReaderWriter<v1::Pull, v1::Push>* const stream_;
  const Caller caller_;
  ShardAggregator* aggregator_ = nullptr;
  // The round this stream's parts of the current step joined.
  ShardAggregator::RoundTicket ticket_;
  // The piece pulls' writer (WritePiecePulls) and the round it serves.
  std::thread writer_;
  std::shared_ptr<const void> writer_round_;
  std::atomic<bool> writer_stop_{false};
  std::atomic<bool> writer_lost_{false};  // a Write failed
  // Destroyed in reverse: the stream unregisters, then stops counting.
  ConnectedWorker connected_;
  // The rank this stream acts for: set by a verified identity (the call's
  // metadata on the leader, else the first accepted push); one per stream.
  Membership::Stream registration_;
};

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
      return aggregator.PushPairsExhausted(push.rank(), push.step(), *claimed,
                                           most);
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
  const std::optional<std::pair<uint64_t, uint64_t>> identity =
      MetadataIdentity(context);
  absl::StatusOr<Call> call =
      Enter(context,
            CallRules::Worker("PushPull")
                .Peer(identity.has_value()
                          ? RankPeer(context, identity->first, identity->second)
                          : std::string()));
  if (!call.ok()) return ToGrpcStatus(call.status());
  PushPullCall pushes(this, context, stream, call->caller);
  if (is_leader()) pushes.RegisterFromMetadata();
  proto::TakeRequestParseFailure();  // none yet: forget an earlier call's
  v1::Push push;
  while (stream->Read(&push)) {
    if (grpc::Status served = pushes.Serve(push); !served.ok()) return served;
  }
  // Read() is false at the client's end of the stream, and for a push that
  // does not parse: that one is INVALID_ARGUMENT, not an orderly end.
  return proto::TakeRequestParseFailure();
}

}  // namespace server
}  // namespace gtopk
