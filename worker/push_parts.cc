// WorkerClient::PushPartsOnShard (worker/client.h): an overlapped step's
// push to one shard in parts, one per bucket piece as the selection thread
// finishes it, and the shard's answers: a piece pull per finished run of
// pieces during the step, then the committed pull (docs/overlap.md,
// "Rounds per bucket"; proto Push.piece_end, Pull.committed).
#include <algorithm>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/codec.h"
#include "common/status_macros.h"
#include "worker/client.h"
#include "worker/client_internal.h"

namespace gtopk {
namespace worker {

namespace {

// The reader of one shard's answers during an overlapped step: the piece
// pulls as they come (while the parts are still being written), then the
// last pull. Its thread is the stream's only reader (gRPC allows one Read
// beside one Write); its fields are read after it was joined.
struct PieceReader {
  std::thread thread;
  std::vector<v1::Pull> pieces;
  v1::Pull last;
  bool got_last = false;

  void Start(grpc::ClientReaderWriter<v1::Push, v1::Pull>* stream,
             PushGate* gate, size_t s) {
    thread = std::thread([this, stream, gate, s] {
      v1::Pull pull;
      while (stream->Read(&pull)) {
        if (pull.piece_end() > 0) {
          pieces.push_back(std::move(pull));
          pull.Clear();
          continue;
        }
        last = std::move(pull);
        got_last = true;
        return;
      }
      gate->Fail(s);  // the stream ended: its writer stops waiting
    });
  }
  void Join() {
    if (thread.joinable()) thread.join();
  }
};

}  // namespace

absl::Status WorkerClient::PushPartsOnShard(size_t s, int64_t step,
                                            const v1::Push& whole,
                                            PushGate& gate, v1::Pull* pull,
                                            PushPullState& round) {
  ShardConn& c = *shards_[s];
  PieceReader reader;
  bool any = false;     // a part of this step went to this shard
  bool parted = false;  // ... with Push.piece_end set (a push in parts)
  v1::Push part;
  while (true) {
    const PushGate::Next next = gate.Wait(s, &part);
    if (next == PushGate::Next::kDone || next == PushGate::Next::kFailed) {
      break;
    }
    if (next == PushGate::Next::kAbandoned) {
      // When parts of this attempt went out anywhere, tell this shard the
      // step is given up, so that it fails everywhere (Push.abandon).
      v1::Push abandon = whole;
      abandon.clear_sparse();
      abandon.set_abandon(true);
      if (any) {
        WriteOnShard(s, abandon, /*reopen=*/false, round);
        reader.Join();  // the shard ends the stream (CANCELLED)
        ShardStreamFailed(s, step, /*drain=*/false, round).IgnoreError();
      } else if (gate.any_opened()) {
        v1::Pull ignored;
        PushPullOnShard(s, step, abandon, &ignored, round).IgnoreError();
      }
      return absl::CancelledError(
          absl::StrCat("step ", step,
                       " was abandoned before its push to this shard was "
                       "complete"));
    }
    // Only the first part may go once more on a fresh stream: a later one
    // would reach a stream that never saw the earlier parts.
    if (!WriteOnShard(s, part, /*reopen=*/!any, round)) {
      reader.Join();
      return ShardStreamFailed(s, step, /*drain=*/!any, round);
    }
    if (!any) reader.Start(c.stream.get(), &gate, s);
    any = true;
    parted = parted || part.piece_end() > 0;
  }
  reader.Join();
  if (!reader.got_last) return ShardStreamFailed(s, step, false, round);
  // A server that takes parts ends their answer with Pull.committed. One
  // that predates rounds per bucket (the field is unknown to it) takes each
  // part for a whole push and answers without it: refused here, before
  // anything is applied, instead of applying a round of the first parts.
  if (parted && !reader.last.committed()) {
    return absl::FailedPreconditionError(absl::StrCat(
        ShardName(s), " answered step ", step,
        "'s push in parts (Push.piece_end) with a pull that is not "
        "Pull.committed: its gtopk-server predates the rounds per bucket "
        "(docs/overlap.md); upgrade the servers, or step without overlap"));
  }
  // The committed pull of a push in parts (its entries came in the piece
  // pulls), or the one pull of a whole push (a shard without pieces).
  if (!reader.pieces.empty() || reader.last.committed()) {
    GTOPK_RETURN_IF_ERROR(MergePiecePulls(s, reader.pieces, &reader.last));
  }
  *pull = std::move(reader.last);
  return absl::OkStatus();
}

absl::Status WorkerClient::MergePiecePulls(size_t s,
                                           std::vector<v1::Pull>& pieces,
                                           v1::Pull* final) const {
  // This shard's pieces: [first, first + m) of pieces_.
  size_t first = pieces_.size(), m = 0;
  for (size_t i = 0; i < pieces_.size(); ++i) {
    if (piece_shard_[i] != s) continue;
    first = std::min(first, i);
    ++m;
  }
  std::sort(pieces.begin(), pieces.end(),
            [](const v1::Pull& a, const v1::Pull& b) {
              return a.piece_begin() < b.piece_begin();
            });
  SparseVector all, part;
  uint32_t next = 0;  // the first piece not yet merged
  CodecSpec spec{IndexCodec::kDeltaVarint, ValueCodec::kFp32};
  for (const v1::Pull& p : pieces) {
    if (p.piece_begin() != next || p.piece_end() <= p.piece_begin() ||
        p.piece_end() > m || p.step() != final->step()) {
      return absl::InternalError(absl::StrCat(
          "piece pull of step ", p.step(), " for pieces [", p.piece_begin(),
          ", ", p.piece_end(), ") where piece ", next, " of ", m,
          " was expected (step ", final->step(), ")"));
    }
    const uint64_t lo = pieces_[first + p.piece_begin()].begin;
    const uint64_t hi = pieces_[first + p.piece_end() - 1].end;
    if (absl::StatusOr<CodecSpec> used = PeekCodecSpec(p.sparse()); used.ok()) {
      spec = *used;
    }
    const absl::Status st = DecodeSparse(p.sparse(), cluster_.n(), &part);
    if (!st.ok() || (!part.empty() && (part.indices.front() < lo ||
                                       part.indices.back() >= hi))) {
      return absl::InternalError(absl::StrCat(
          "piece pull for pieces [", p.piece_begin(), ", ", p.piece_end(),
          ") is undecodable or has indices outside [", lo, ", ", hi, ")",
          st.ok() ? "" : ": ", st.message()));
    }
    all.indices.insert(all.indices.end(), part.indices.begin(),
                       part.indices.end());
    all.values.insert(all.values.end(), part.values.begin(), part.values.end());
    next = p.piece_end();
  }
  if (next != m && !(pieces.empty() && !final->sparse().empty())) {
    return absl::InternalError(absl::StrCat(
        "the committed pull of step ", final->step(),
        " came after the piece pulls of ", next, " of its ", m, " pieces"));
  }
  if (pieces.empty()) return absl::OkStatus();  // the whole result in final
  const absl::Status st =
      EncodeSparse(all, cluster_.n(), spec, final->mutable_sparse());
  return st;
}

}  // namespace worker
}  // namespace gtopk
