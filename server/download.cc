// AggregatorService::DownloadParams (server/service.h) and its bounds: the
// download slots (server/download.h), DownloadParamsLimits, and the write
// watchdog that cancels a download whose client stopped reading.
#include "server/download.h"

#include <algorithm>
#include <cstdio>
#include <optional>
#include <string>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/grpc_edge/grpc_edge.h"
#include "server/service.h"
#include "server/service_internal.h"

namespace gtopk {
namespace server {

using internal::AwaitPolled;
using internal::ContextDeadline;
using internal::kPollInterval;

namespace {

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

// Writes one download's chunks under its WriteWatchdog: each chunk names
// the worker, the shard, its offset in the shard's range and the step.
class ChunkWriter {
 public:
  ChunkWriter(grpc::ServerContext* context,
              grpc::ServerWriter<v1::ParamsChunk>* writer,
              ServerMetrics* metrics, uint32_t shard, uint32_t worker,
              uint64_t begin, uint64_t range_size, int64_t step,
              const DownloadLimits& limits)
      : writer_(writer),
        metrics_(metrics),
        shard_(shard),
        worker_(worker),
        begin_(begin),
        range_size_(range_size),
        step_(step),
        peer_(context->peer()),  // "unknown" once cancelled
        watchdog_(context, limits.stall, absl::Now() + limits.total) {}

  // A chunk at `offset` (values from there, none past the range's end),
  // its fields set by `fill`; the download's status when it cannot go.
  template <typename Fill>
  std::optional<grpc::Status> Send(size_t offset, Fill fill) {
    v1::ParamsChunk chunk;
    chunk.set_rank(worker_);
    chunk.set_shard_id(shard_);
    chunk.set_offset(begin_ + offset);
    chunk.set_step(step_);
    fill(chunk);
    watchdog_.WriteStarted();
    const bool written = writer_->Write(chunk);
    watchdog_.WriteEnded();
    if (!written) {
      const std::string reason = watchdog_.Stop();
      if (!reason.empty()) return CancelledByLimit(reason, offset);
      return grpc::Status(grpc::StatusCode::CANCELLED,
                          "the worker went away during DownloadParams");
    }
    metrics_->sent_download_bytes().Increment(
        static_cast<double>(chunk.ByteSizeLong()));
    return std::nullopt;
  }

  // After the last chunk: the watchdog may have cancelled the call as the
  // last Write completed: then the client sees CANCELLED, and so must the
  // handler's status.
  grpc::Status Finish(size_t offset) {
    if (const std::string reason = watchdog_.Stop(); !reason.empty()) {
      return CancelledByLimit(reason, offset);
    }
    return grpc::Status::OK;
  }

 private:
  grpc::Status CancelledByLimit(const std::string& reason, size_t at) {
    metrics_->LimitRejected(LimitBound::kDownloadTime);
    const std::string what = absl::StrCat(
        "DownloadParams for worker ", worker_, " from ", peer_,
        " cancelled at index ", begin_ + at, " of [", begin_, ", ",
        begin_ + range_size_, "): ", reason,
        ", the bound on a download's slot (docs/resource-limits.md)");
    std::fprintf(stderr, "gtopk-server shard %u: %s\n", shard_, what.c_str());
    return grpc::Status(grpc::StatusCode::CANCELLED,
                        absl::StrCat("shard ", shard_, ": ", what));
  }

  grpc::ServerWriter<v1::ParamsChunk>* const writer_;
  ServerMetrics* const metrics_;
  const uint32_t shard_;
  const uint32_t worker_;
  const uint64_t begin_;
  const uint64_t range_size_;
  const int64_t step_;
  const std::string peer_;
  WriteWatchdog watchdog_;
};

// Waits in short slices, so that a cancelled call or a shutdown ends it,
// until the shard has parameters (rank 0's InitParams), copying nothing:
// AwaitInitialized's status, or CANCELLED "DownloadParams cancelled".
absl::Status AwaitInitialParams(const ShardAggregator& aggregator,
                                absl::Time deadline,
                                const grpc::ServerContext* context) {
  while (true) {
    const absl::Status ready = aggregator.AwaitInitialized(
        std::min(deadline, absl::Now() + kPollInterval));
    if (ready.ok() || !absl::IsDeadlineExceeded(ready) ||
        absl::Now() >= deadline) {
      return ready;
    }
    if (context->IsCancelled()) {
      return absl::CancelledError("DownloadParams cancelled");
    }
  }
}

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

DownloadSlots::Slot::~Slot() {
  if (slots_ == nullptr) return;
  absl::MutexLock lock(&slots_->mu_);
  --slots_->active_;
}

std::optional<DownloadSlots::Slot> DownloadSlots::Acquire(
    absl::Time deadline, const grpc::ServerContext* context) {
  absl::MutexLock lock(&mu_);
  auto has_slot = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return active_ < kMaxConcurrentDownloads;
  };
  if (!AwaitPolled(mu_, absl::Condition(&has_slot), deadline, context)) {
    return std::nullopt;
  }
  ++active_;
  return Slot(this);
}

grpc::Status AggregatorService::DownloadParams(
    grpc::ServerContext* context, const v1::DownloadParamsRequest* request,
    grpc::ServerWriter<v1::ParamsChunk>* writer) {
  // The parameters are the model: workers (any rank) and shards only.
  absl::StatusOr<Call> call =
      Enter(context, CallRules::Worker("DownloadParams", std::nullopt,
                                       /*shard_ok=*/true));
  if (!call.ok()) return ToGrpcStatus(call.status());
  if (request->rank() >= config_.num_workers) {
    return ToGrpcStatus(absl::InvalidArgumentError(
        absl::StrCat("unknown worker rank ", request->rank(),
                     "; the cluster has ", config_.num_workers, " workers")));
  }
  const absl::Time deadline = WaitDeadline(context);
  absl::StatusOr<ShardAggregator*> aggregator =
      GetAggregator(context, deadline);
  if (!aggregator.ok()) return ToGrpcStatus(aggregator.status());
  if (request->cluster_fingerprint() != 0) {
    const absl::Status same = CheckFingerprint(
        request->cluster_fingerprint(),
        absl::StrCat("DownloadParams from worker ", request->rank(), " "),
        deadline);
    if (!same.ok()) return ToGrpcStatus(same);
  }
  // Rank 0's initial parameters are waited for up to the caller's deadline
  // (its rpc_timeout, less a slack so that this refusal, which says why,
  // arrives before the transport's anonymous DEADLINE_EXCEEDED), not only a
  // step timeout: ranks are started seconds or minutes apart (a scheduler,
  // rank 0 loading its data), and with --step-timeout=2s a rank started 2 s
  // before rank 0 failed its start-up (break-it run, 2026-12-08). Waited
  // for before a download slot is taken, so that waiting ranks hold none.
  if (const absl::Status ready = AwaitInitialParams(
          **aggregator, ContextDeadline(context) - kLeaderDeadlineSlack,
          context);
      !ready.ok()) {
    return ToGrpcStatus(ready);
  }
  const uint64_t chunk_bytes =
      std::min(config_.download_chunk_bytes, config_.max_message_bytes);
  // A slot is waited for longer than a stalled download may hold one
  // (DownloadParamsLimits' stall bound, + 1 s), within the client's
  // deadline: a worker restarting while stuck streams hold every slot gets
  // one once the server has cancelled them.
  const absl::Duration slot_wait = std::max(
      config_.step_timeout,
      DownloadParamsLimits(config_, chunk_bytes, 0).stall + absl::Seconds(1));
  // The client's deadline less a slack, so that this refusal, which says
  // why, arrives before the transport's anonymous DEADLINE_EXCEEDED.
  const std::optional<DownloadSlots::Slot> slot = downloads_.Acquire(
      std::min(absl::Now() + slot_wait,
               ContextDeadline(context) - kLeaderDeadlineSlack),
      context);
  if (!slot.has_value()) {
    return ToGrpcStatus(absl::DeadlineExceededError(
        absl::StrCat("shard ", config_.shard_id, ": ", kMaxConcurrentDownloads,
                     " parameter downloads already in progress")));
  }
  // Initialised above: no wait.
  absl::StatusOr<ShardAggregator::State> params =
      (*aggregator)->GetState(deadline);
  if (!params.ok()) return ToGrpcStatus(params.status());
  return SendParams(context, request->rank(), **aggregator, *params,
                    chunk_bytes, writer);
}

grpc::Status AggregatorService::SendParams(
    grpc::ServerContext* context, uint32_t worker,
    const ShardAggregator& aggregator, const ShardAggregator::State& params,
    uint64_t chunk_bytes, grpc::ServerWriter<v1::ParamsChunk>* writer) {
  const std::vector<float>& values = params.params;
  const std::vector<float>& velocity = params.global_velocity;
  // Shard 0 under --apply=workers: rank 0's state blob, in pieces after
  // the values (chunks without values at the end of the range).
  const std::string& state = *params.state;
  const bool with_velocity = !velocity.empty();
  // 4 bytes per value, 8 with the global velocity alongside.
  const size_t per_chunk = static_cast<size_t>(std::max<uint64_t>(
      1, (chunk_bytes - kChunkOverheadBytes) / (with_velocity ? 8 : 4)));
  // A client that stops reading blocks Write on flow control; the
  // watchdog cancels the stream after DownloadParamsLimits, so that the
  // slot is released (when the handler returns).
  const DownloadLimits limits = DownloadParamsLimits(
      config_, chunk_bytes,
      values.size() * (with_velocity ? uint64_t{8} : uint64_t{4}) +
          state.size());
  ChunkWriter out(context, writer, metrics_.get(), config_.shard_id, worker,
                  aggregator.begin(), values.size(), params.next_step, limits);
  size_t offset = 0;
  do {
    const size_t count = std::min(per_chunk, values.size() - offset);
    if (std::optional<grpc::Status> failed =
            out.Send(offset, [&](v1::ParamsChunk& c) {
              c.mutable_values()->Add(values.begin() + offset,
                                      values.begin() + offset + count);
              if (with_velocity) {
                c.mutable_global_velocity()->Add(
                    velocity.begin() + offset,
                    velocity.begin() + offset + count);
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
    if (std::optional<grpc::Status> failed =
            out.Send(offset, [&](v1::ParamsChunk& c) {
              c.set_state(state.substr(at, per_piece));
            })) {
      return *failed;
    }
  }
  return out.Finish(offset);
}

}  // namespace server
}  // namespace gtopk
