// Internals of WorkerClient shared by its source files (worker/client.cc:
// joining, streams, parameters and recovery; worker/client_step.cc: one
// step; worker/push_pull_round.cc: the step's pushes and pulls). Not for
// anyone else: include worker/client.h.
#ifndef GTOPK_WORKER_CLIENT_INTERNAL_H_
#define GTOPK_WORKER_CLIENT_INTERNAL_H_

#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "grpcpp/grpcpp.h"
#include "gtopk/v1/gtopk.grpc.pb.h"
#include "worker/cancellation.h"
#include "worker/client.h"

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

// An overlapped step's release of its pushes (worker/overlapped_step.cc):
// each shard's push goes out in parts (Push.piece_begin/piece_end), each a
// run of consecutive bucket pieces the selection thread finished together
// (one piece when they come one by one); a shard without pieces, or any
// shard when the servers do not take parts, gets its whole push as its one
// part. Post queues a part for the shard's stream; Abandon releases every
// waiter (the step ends without its remaining parts). Thread-safe.
class PushGate {
 public:
  explicit PushGate(size_t num_shards)
      : queues_(num_shards),
        expected_(num_shards, 0),
        taken_(num_shards, 0),
        failed_(num_shards, false) {}
  // Shard s's parts hold `pieces` pieces in all (a shard without pieces:
  // 1, its empty whole push). Before the round's threads start.
  void Expect(size_t s, size_t pieces) { expected_[s] = pieces; }
  // Queues `part`, which holds `pieces` of shard s's pieces (>= 1).
  void Post(size_t s, v1::Push part, size_t pieces) {
    absl::MutexLock lock(&mu_);
    queues_[s].push_back({std::move(part), pieces});
    posted_ += pieces;
  }
  void Abandon() {
    absl::MutexLock lock(&mu_);
    abandoned_ = true;
  }
  // Shard s's stream ended (its reader saw it): its writer stops waiting.
  void Fail(size_t s) {
    absl::MutexLock lock(&mu_);
    failed_[s] = true;
  }
  enum class Next { kPart, kDone, kAbandoned, kFailed };
  // Blocks until shard s has a part to write (kPart, *part set), all its
  // pieces were taken (kDone), the step was abandoned (kAbandoned; parts
  // still queued are never written), or its stream ended (kFailed).
  Next Wait(size_t s, v1::Push* part) {
    absl::MutexLock lock(&mu_);
    if (taken_[s] >= expected_[s]) return Next::kDone;
    auto ready = [&] {
      return abandoned_ || failed_[s] || !queues_[s].empty();
    };
    mu_.Await(absl::Condition(&ready));
    if (abandoned_) return Next::kAbandoned;
    if (failed_[s]) return Next::kFailed;
    *part = std::move(queues_[s].front().part);
    taken_[s] += queues_[s].front().pieces;
    queues_[s].pop_front();
    return Next::kPart;
  }
  // Whether any part was released.
  bool any_opened() {
    absl::MutexLock lock(&mu_);
    return posted_ > 0;
  }
  // Blocks until every piece of every shard was posted, or the step was
  // abandoned.
  void AwaitSettled() {
    size_t total = 0;
    for (const size_t e : expected_) total += e;
    absl::MutexLock lock(&mu_);
    auto settled = [&] { return abandoned_ || posted_ == total; };
    mu_.Await(absl::Condition(&settled));
  }

 private:
  struct Queued {
    v1::Push part;
    size_t pieces;
  };
  absl::Mutex mu_;
  std::vector<std::deque<Queued>> queues_;  // (mu_)
  std::vector<size_t> expected_;            // set before the threads start
  std::vector<size_t> taken_;               // (mu_) pieces, per shard
  std::vector<bool> failed_;                // (mu_)
  size_t posted_ = 0;                       // (mu_) pieces, all shards
  bool abandoned_ = false;                  // (mu_)
};

// An open overlapped step (WorkerClient::BeginOverlappedStep). The caller's
// thread reports ranges (GradientReady); the selection thread takes the
// pieces whose values are all in; the round thread runs PushPullRound
// behind `gate`. Fields marked (mu) are guarded by mu; per-piece results
// are written by the selection thread only and read after it was joined;
// pushes[s] (each shard's push without entries: the parts' template) is
// written before the round starts.
struct WorkerClient::OverlappedStep {
  explicit OverlappedStep(size_t num_shards, size_t num_pieces)
      : gate(num_shards),
        pushes(num_shards),
        ready(num_pieces, 0),
        sent(num_pieces),
        received(num_pieces),
        accumulated(num_pieces, false) {}

  StepStats stats;
  absl::Span<const float> gradient;
  // Host steps: `averaged` (--apply=workers) or `params` (--apply=servers,
  // updated by Finish) is the caller's; the other is empty.
  absl::Span<float> averaged;
  absl::Span<float> params;
  // Device steps (BeginOverlappedStep with device pointers): the caller's
  // device buffers and stream; null for a host step.
  const float* device_gradient = nullptr;
  float* device_params = nullptr;
  CUstream_st* stream = nullptr;
  bool on_device() const { return device_gradient != nullptr; }
  absl::Time begun = absl::Now();
  absl::Time first_taken = absl::InfiniteFuture();  // (mu)
  PushGate gate;
  std::vector<v1::Push> pushes;

  absl::Mutex mu;
  std::map<uint64_t, uint64_t> reported;  // (mu) begin -> end
  uint64_t reported_values = 0;           // (mu)
  std::vector<uint64_t> ready;            // (mu) values in, per piece
  std::deque<size_t> queue;               // (mu) pieces to select
  bool closing = false;                   // (mu) Finish: no more pieces
  bool stop = false;                      // (mu) Abandon, or a failure
  absl::Status select_status;             // (mu) the first failure

  // Held by the selection thread while it changes the residual of a piece
  // (ExportState reads a consistent residual under it).
  absl::Mutex piece_mu;
  // Per piece (selection thread): what it sent, as sent and as received
  // (codec round trip), and whether its u is in the residual (and, with
  // `params`, its velocity updated) (piece_mu).
  std::vector<SparseVector> sent, received;
  std::vector<bool> accumulated;
  // Per shard: its first piece's index in pieces_ (Push.piece_begin
  // counts from there) and its number of pieces.
  std::vector<size_t> first_piece;
  std::vector<size_t> num_pieces;
  // Whether the pushes go in parts (every shard takes them,
  // WorkerClient::servers_take_push_parts()) or whole; set before the
  // threads start. Whole: per shard, its pieces not selected yet
  // (selection thread only); the push goes when none is left.
  bool in_parts = true;
  std::vector<size_t> pieces_left;

  std::thread selection, round;
  absl::Status round_status;  // round thread, read after join
  std::vector<v1::Pull> pulls;
  absl::Duration push_time;
};

// Same code, message prefixed with `where`.
inline absl::Status Prefixed(const absl::Status& s, absl::string_view where) {
  return absl::Status(s.code(), absl::StrCat(where, ": ", s.message()));
}

}  // namespace worker
}  // namespace gtopk

#endif  // GTOPK_WORKER_CLIENT_INTERNAL_H_
