// libFuzzer harness: every request message a shard receives, as the server
// receives it: bytes -> the request type's SerializationTraits (what gRPC
// does; bytes it cannot parse are refused before any handler) -> the server's
// own code.
//
//   - Bytes that do not parse as the request type are refused by the
//     request types' SerializationTraits with INVALID_ARGUMENT naming the
//     type (proto/request_parsing.h), as gRPC does before any handler.
//   - The unary RPCs (Join, GetClusterSpec, CommitStep, ExchangeThreshold,
//     GetShardState, RollbackShard, Recover, AbortStep, CheckMember) go to
//     the real handlers of a real AggregatorService (server/service.h): the
//     leader of a one-shard cluster, created afresh for every input, called
//     in-process with a default grpc::ServerContext (no deadline: every wait
//     ends at now + step_timeout, 20 ms here).
//   - The streamed messages go through the checks their handlers run on
//     each message (server/request_checks.h): a Push through DecodeWirePush,
//     then ShardAggregator::Submit on a real one-worker shard (so a push
//     that passes completes a round: merge, selection, optimizer, encode);
//     InitParams chunks through CheckInitChunkSender/CheckInitChunkRange,
//     the accepted values going to ShardAggregator::InitParams when they
//     cover the range.
//
// Input: byte 0 picks the cluster's settings (mode, selection, index and
// value codec, n; kLengths); then records (type byte, 2-byte length L, L
// bytes of one serialized message), applied in order to the same shard, so
// sequences (Join, then a push, then a rollback ...) are explored. A
// member_token or cluster_fingerprint field equal to 1 is replaced by the
// right one (the last Join's token, the shard's fingerprint), so the fuzzer
// gets past the identity checks the way a real member does.
//
// Invariants: no handler aborts or reports a sanitizer fault; every error is
// a code remote input may get (not INTERNAL/UNKNOWN) with a message; a
// successful Join names a rank < P and a non-zero token, and its cluster
// spec passes the worker's own checks (ValidateWorkerClusterSpec) and
// carries its true ClusterFingerprint; a push DecodeWirePush accepts has
// sorted, unique indices < n; a round that completes selects sorted indices
// inside the shard's range, its encoded pull decodes to exactly them, and
// the parameters stay finite; accepted init chunks never pass the range end.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/cluster_modes.h"
#include "common/cluster_spec/cluster_spec.h"
#include "common/codec.h"
#include "fuzz/fuzz_check.h"
#include "google/protobuf/stubs/logging.h"
#include "grpcpp/server_context.h"
#include "grpcpp/support/byte_buffer.h"
#include "gtopk/v1/gtopk.pb.h"
#include "proto/request_parsing.h"
#include "server/request_checks.h"
#include "server/server_config.h"
#include "server/service.h"
#include "server/shard_aggregator.h"

namespace {

using namespace gtopk;
using namespace gtopk::server;

constexpr uint64_t kLengths[] = {1, 7, 100, 1000};

enum Record : uint8_t {
  kJoin,
  kGetClusterSpec,
  kCommitStep,
  kExchangeThreshold,
  kGetShardState,
  kRollbackShard,
  kRecover,
  kAbortStep,
  kCheckMember,
  kPush,
  kInitChunk,
  kRecordCount
};

// A status a client may get for bad or badly timed input; never INTERNAL,
// UNKNOWN or an empty error message.
void CheckRemoteStatus(const grpc::Status& s, const char* rpc) {
  if (s.ok()) return;
  const grpc::StatusCode c = s.error_code();
  FUZZ_CHECK(c != grpc::StatusCode::INTERNAL &&
                 c != grpc::StatusCode::UNKNOWN &&
                 c != grpc::StatusCode::UNIMPLEMENTED,
             "%s answered code %d: %s", rpc, static_cast<int>(c),
             s.error_message().c_str());
  FUZZ_CHECK(!s.error_message().empty(), "%s: error %d without a message", rpc,
             static_cast<int>(c));
}

void CheckRemoteStatus(const absl::Status& s, const char* what) {
  if (s.ok()) return;
  FUZZ_CHECK(
      !absl::IsInternal(s) && !absl::IsUnknown(s) && !absl::IsUnimplemented(s),
      "%s: %s", what, s.ToString().c_str());
  FUZZ_CHECK(!s.message().empty(), "%s: error without a message", what);
}

// Parses `bytes` the way the server's gRPC does, through the request
// type's SerializationTraits (proto/request_parsing.h): bytes that do not
// parse must be refused INVALID_ARGUMENT with a message naming the type, and
// never reach a handler.
template <typename Message>
bool Parse(absl::string_view bytes, Message* m) {
  grpc::Slice slice(bytes.data(), bytes.size());
  grpc::ByteBuffer buffer(&slice, 1);
  const grpc::Status status =
      grpc::SerializationTraits<Message>::Deserialize(&buffer, m);
  if (status.ok()) return true;
  FUZZ_CHECK(status.error_code() == grpc::StatusCode::INVALID_ARGUMENT &&
                 absl::StrContains(status.error_message(), m->GetTypeName()),
             "unparseable %s: code %d, message \"%s\"",
             m->GetTypeName().c_str(), static_cast<int>(status.error_code()),
             status.error_message().c_str());
  return false;
}

struct Harness {
  ServerConfig config;
  uint64_t n = 1;
  std::unique_ptr<AggregatorService> service;
  // The streamed side: a one-worker shard of the same settings.
  std::unique_ptr<ShardAggregator> aggregator;
  uint64_t token = 0;      // the last successful Join's member token
  uint32_t rank = 0;       // and its rank
  bool joined = false;     // n is known on the leader
  uint64_t init_next = 0;  // InitParams: the values received so far end here
  std::vector<float> init_values;

  uint64_t Token(uint64_t field) const { return field == 1 ? token : field; }
  uint64_t Fingerprint(uint64_t field) const {
    return field == 1 ? service->cluster_fingerprint() : field;
  }

  void Join(absl::string_view bytes) {
    v1::JoinRequest req;
    if (!Parse(bytes, &req)) return;
    grpc::ServerContext context;
    v1::JoinResponse resp;
    const grpc::Status s = service->Join(&context, &req, &resp);
    CheckRemoteStatus(s, "Join");
    if (!s.ok()) return;
    FUZZ_CHECK(resp.rank() < config.num_workers, "Join gave rank %u",
               resp.rank());
    FUZZ_CHECK(resp.member_token() != 0, "Join gave token 0");
    const absl::Status valid =
        ValidateWorkerClusterSpec(resp.cluster(), req.n(), resp.rank());
    FUZZ_CHECK(valid.ok(), "the leader's own spec fails the worker: %s",
               valid.ToString().c_str());
    FUZZ_CHECK(resp.cluster().cluster_fingerprint() ==
                       ClusterFingerprint(resp.cluster()) &&
                   resp.cluster().cluster_fingerprint() ==
                       service->cluster_fingerprint(),
               "Join's spec carries another fingerprint");
    token = resp.member_token();
    rank = resp.rank();
    joined = true;
  }

  void GetClusterSpec(absl::string_view bytes) {
    v1::JoinRequest req;
    if (!Parse(bytes, &req) || !joined) return;  // else: waits step_timeout
    grpc::ServerContext context;
    v1::ClusterSpec resp;
    const grpc::Status s = service->GetClusterSpec(&context, &req, &resp);
    CheckRemoteStatus(s, "GetClusterSpec");
    if (s.ok()) {
      FUZZ_CHECK(resp.cluster_fingerprint() == ClusterFingerprint(resp),
                 "GetClusterSpec's fingerprint");
    }
  }

  void CommitStep(absl::string_view bytes) {
    v1::CommitRequest req;
    if (!Parse(bytes, &req)) return;
    req.set_cluster_fingerprint(Fingerprint(req.cluster_fingerprint()));
    grpc::ServerContext context;
    v1::CommitResponse resp;
    CheckRemoteStatus(service->CommitStep(&context, &req, &resp), "CommitStep");
  }

  void ExchangeThreshold(absl::string_view bytes) {
    v1::ThresholdRequest req;
    if (!Parse(bytes, &req)) return;
    req.set_cluster_fingerprint(Fingerprint(req.cluster_fingerprint()));
    grpc::ServerContext context;
    v1::ThresholdResponse resp;
    const grpc::Status s = service->ExchangeThreshold(&context, &req, &resp);
    CheckRemoteStatus(s, "ExchangeThreshold");
    if (s.ok()) {
      FUZZ_CHECK(resp.step() == req.step() && resp.level() == req.level(),
                 "ExchangeThreshold answered another round");
    }
  }

  void GetShardState(absl::string_view bytes) {
    v1::ShardStateRequest req;
    if (!Parse(bytes, &req)) return;
    req.set_cluster_fingerprint(Fingerprint(req.cluster_fingerprint()));
    grpc::ServerContext context;
    v1::ShardState resp;
    CheckRemoteStatus(service->GetShardState(&context, &req, &resp),
                      "GetShardState");
  }

  void RollbackShard(absl::string_view bytes) {
    v1::RollbackRequest req;
    if (!Parse(bytes, &req)) return;
    req.set_cluster_fingerprint(Fingerprint(req.cluster_fingerprint()));
    grpc::ServerContext context;
    v1::RollbackResponse resp;
    CheckRemoteStatus(service->RollbackShard(&context, &req, &resp),
                      "RollbackShard");
  }

  void Recover(absl::string_view bytes) {
    v1::RecoverRequest req;
    if (!Parse(bytes, &req)) return;
    req.set_cluster_fingerprint(Fingerprint(req.cluster_fingerprint()));
    req.set_member_token(Token(req.member_token()));
    grpc::ServerContext context;
    v1::RecoverResponse resp;
    CheckRemoteStatus(service->Recover(&context, &req, &resp), "Recover");
  }

  void AbortStep(absl::string_view bytes) {
    v1::AbortStepRequest req;
    if (!Parse(bytes, &req)) return;
    grpc::ServerContext context;
    v1::AbortStepResponse resp;
    CheckRemoteStatus(service->AbortStep(&context, &req, &resp), "AbortStep");
  }

  void CheckMember(absl::string_view bytes) {
    v1::MemberCheckRequest req;
    if (!Parse(bytes, &req)) return;
    req.set_cluster_fingerprint(Fingerprint(req.cluster_fingerprint()));
    req.set_member_token(Token(req.member_token()));
    grpc::ServerContext context;
    v1::MemberCheckResponse resp;
    CheckRemoteStatus(service->CheckMember(&context, &req, &resp),
                      "CheckMember");
  }

  void Push(absl::string_view bytes) {
    v1::Push push;
    if (!Parse(bytes, &push)) return;
    RejectReason reason = RejectReason::kCount;
    absl::StatusOr<WorkerPush> decoded =
        DecodeWirePush(push, config, n, &reason);
    if (!decoded.ok()) {
      FUZZ_CHECK(absl::IsInvalidArgument(decoded.status()),
                 "DecodeWirePush: %s", decoded.status().ToString().c_str());
      FUZZ_CHECK(reason != RejectReason::kCount, "no reject reason");
      aggregator->RejectPush(push.step(), push.rank(), decoded.status());
      return;
    }
    FUZZ_CHECK(ValidateSparseVector(decoded->sparse, n).ok(),
               "DecodeWirePush accepted an invalid sparse vector");
    FUZZ_CHECK(decoded->worker < config.num_workers, "worker %u accepted",
               decoded->worker);
    const int64_t step = decoded->step;
    auto result =
        aggregator->Submit(*std::move(decoded), absl::Now() + absl::Seconds(5));
    if (!result.ok()) {
      CheckRemoteStatus(result.status(), "Submit");
      FUZZ_CHECK(!absl::IsDeadlineExceeded(result.status()),
                 "a one-worker round timed out: %s",
                 result.status().ToString().c_str());
      return;
    }
    const RoundResult& r = **result;
    FUZZ_CHECK(r.step == step, "round of step %lld answered step %lld",
               static_cast<long long>(step), static_cast<long long>(r.step));
    for (size_t j = 0; j < r.selected.size(); ++j) {
      const uint32_t i = r.selected.indices[j];
      FUZZ_CHECK(i >= aggregator->begin() && i < aggregator->end(),
                 "selected index %u outside the shard", i);
      FUZZ_CHECK(j == 0 || r.selected.indices[j - 1] < i, "selection unsorted");
      FUZZ_CHECK(std::isfinite(r.selected.values[j]), "selected value %a",
                 r.selected.values[j]);
    }
    if (config.mode != AggregationMode::kDense) {
      SparseVector pulled;
      const absl::Status d = DecodeSparse(r.encoded, n, &pulled);
      FUZZ_CHECK(d.ok(), "the pull does not decode: %s", d.ToString().c_str());
      FUZZ_CHECK(pulled.indices == r.selected.indices, "pull indices differ");
    }
    auto state = aggregator->GetState(absl::Now() + absl::Seconds(1));
    FUZZ_CHECK(state.ok(), "GetState after a round");
    for (float p : state->params) {
      FUZZ_CHECK(std::isfinite(p), "a round made a parameter %a", p);
    }
  }

  void InitChunk(absl::string_view bytes) {
    v1::ParamsChunk chunk;
    if (!Parse(bytes, &chunk)) return;
    const absl::Status sender = CheckInitChunkSender(chunk, config.shard_id);
    if (!sender.ok()) {
      FUZZ_CHECK(
          absl::IsPermissionDenied(sender) || absl::IsInvalidArgument(sender),
          "CheckInitChunkSender: %s", sender.ToString().c_str());
      return;
    }
    const uint64_t begin = aggregator->begin(), end = aggregator->end();
    const absl::Status range =
        CheckInitChunkRange(chunk, config.shard_id, begin, end, init_next);
    if (!range.ok()) {
      FUZZ_CHECK(absl::IsInvalidArgument(range), "CheckInitChunkRange: %s",
                 range.ToString().c_str());
      return;
    }
    const uint64_t count = static_cast<uint64_t>(chunk.values_size());
    FUZZ_CHECK(chunk.offset() == init_next && count <= end - init_next,
               "chunk [%llu, +%llu) accepted past %llu",
               static_cast<unsigned long long>(chunk.offset()),
               static_cast<unsigned long long>(count),
               static_cast<unsigned long long>(end));
    init_values.insert(init_values.end(), chunk.values().begin(),
                       chunk.values().end());
    init_next += count;
    if (init_next == end) {
      auto taken = aggregator->InitParams(init_values);
      FUZZ_CHECK(taken.ok(), "checked chunks refused by InitParams: %s",
                 taken.status().ToString().c_str());
      init_next = begin;
      init_values.clear();
    }
  }
};

}  // namespace

// Protobuf logs every string field with invalid UTF-8 it parses: silence it
// (the parse still fails or succeeds as it would in the server).
extern "C" int LLVMFuzzerInitialize(int* /*argc*/, char*** /*argv*/) {
  google::protobuf::SetLogHandler(nullptr);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  fuzz::Bytes in(data, size);
  Harness h;
  const uint8_t settings = in.U8();
  const uint8_t more = in.U8();
  h.config.shard_id = 0;
  h.config.num_shards = 1;
  h.config.num_workers = 1;
  h.config.peers = {""};
  h.config.mode = static_cast<AggregationMode>(settings % 3);
  // Quota selection exists for gtopk only.
  h.config.selection =
      (settings / 3) % 2 == 1 && h.config.mode == AggregationMode::kGtopk
          ? SelectionKind::kQuota
          : SelectionKind::kThreshold;
  h.config.index_codec = static_cast<IndexCodec>((settings / 6) % 3);
  h.config.value_codec = static_cast<ValueCodec>((settings / 18) % 3);
  h.config.step_timeout = absl::Milliseconds(20);
  h.n = kLengths[more % 4];
  auto service = AggregatorService::Create(h.config);
  FUZZ_CHECK(service.ok(), "config: %s", service.status().ToString().c_str());
  h.service = *std::move(service);
  h.service->SetOwnAddress("127.0.0.1:1");

  ShardOptions options;
  options.n = h.n;
  options.num_workers = h.config.num_workers;
  options.mode = h.config.mode;
  options.selection = h.config.selection;
  options.pull_index_codec = h.config.index_codec;
  options.optimizer = h.config.optimizer;
  options.step_timeout = absl::Seconds(5);
  auto aggregator = ShardAggregator::Create(options, nullptr);
  FUZZ_CHECK(aggregator.ok(), "shard: %s",
             aggregator.status().ToString().c_str());
  h.aggregator = *std::move(aggregator);
  // Parameters 0.5, 1.5, ... unless the input initialises them itself.
  if (more & 4) {
    std::vector<float> init(h.aggregator->end() - h.aggregator->begin());
    for (size_t i = 0; i < init.size(); ++i) init[i] = 0.5f + i;
    FUZZ_CHECK(h.aggregator->InitParams(init).ok(), "InitParams");
  }

  for (int records = 0; in.remaining() > 0 && records < 16; ++records) {
    const uint8_t type = in.U8() % kRecordCount;
    const size_t len = in.U8() | (size_t{in.U8()} << 8);
    const absl::string_view rest = in.Rest();
    const absl::string_view bytes = rest.substr(0, len);
    for (size_t i = 0; i < bytes.size(); ++i) in.U8();
    switch (type) {
      case kJoin:
        h.Join(bytes);
        break;
      case kGetClusterSpec:
        h.GetClusterSpec(bytes);
        break;
      case kCommitStep:
        h.CommitStep(bytes);
        break;
      case kExchangeThreshold:
        h.ExchangeThreshold(bytes);
        break;
      case kGetShardState:
        h.GetShardState(bytes);
        break;
      case kRollbackShard:
        h.RollbackShard(bytes);
        break;
      case kRecover:
        h.Recover(bytes);
        break;
      case kAbortStep:
        h.AbortStep(bytes);
        break;
      case kCheckMember:
        h.CheckMember(bytes);
        break;
      case kPush:
        h.Push(bytes);
        break;
      case kInitChunk:
        h.InitChunk(bytes);
        break;
    }
  }
  h.service->BeginShutdown();
  return 0;
}
