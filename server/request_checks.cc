// The stateless request checks of the shard's stream handlers
// (server/request_checks.h).
#include "server/request_checks.h"

#include <cmath>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/cluster_modes.h"
#include "common/codec.h"

namespace gtopk {
namespace server {

absl::StatusOr<WorkerPush> DecodeWirePush(const v1::Push& push,
                                          const ServerConfig& config,
                                          uint64_t n, RejectReason* reason) {
  const std::string who =
      absl::StrCat("worker ", push.rank(), " step ", push.step(), ": ");
  if (push.shard_id() != config.shard_id) {
    *reason = RejectReason::kWrongShard;
    return absl::InvalidArgumentError(
        absl::StrCat(who, "push for shard ", push.shard_id(),
                     " was sent to shard ", config.shard_id));
  }
  if (push.rank() >= config.num_workers) {
    *reason = RejectReason::kUnknownWorker;
    return absl::InvalidArgumentError(
        absl::StrCat("unknown worker rank ", push.rank(), "; the cluster has ",
                     config.num_workers, " workers"));
  }
  WorkerPush out;
  out.step = push.step();
  out.worker = push.rank();
  out.epoch = push.epoch();
  out.params_checksum = push.params_checksum();
  out.buffers = push.buffers();          // who may send them: ValidatePush
  out.piece_begin = push.piece_begin();  // checked by SubmitPart
  out.piece_end = push.piece_end();
  if (config.mode == AggregationMode::kDense) {
    if (!push.sparse().empty()) {
      *reason = RejectReason::kWrongMode;
      return absl::InvalidArgumentError(
          absl::StrCat(who, "sparse bytes sent in dense mode"));
    }
    out.dense.assign(push.dense().begin(), push.dense().end());
    return out;
  }
  if (push.dense_size() > 0) {
    *reason = RejectReason::kWrongMode;
    return absl::InvalidArgumentError(
        absl::StrCat(who, "dense values sent in ",
                     AggregationModeName(config.mode), " mode"));
  }
  absl::StatusOr<CodecSpec> spec = PeekCodecSpec(push.sparse());
  if (!spec.ok()) {
    *reason = RejectReason::kCorrupt;
    return absl::InvalidArgumentError(
        absl::StrCat(who, "corrupt sparse push: ", spec.status().message()));
  }
  if (spec->index != config.index_codec || spec->value != config.value_codec) {
    *reason = RejectReason::kWrongCodec;
    return absl::InvalidArgumentError(absl::StrCat(
        who, "wrong codec: the push uses ", IndexCodecName(spec->index), "/",
        ValueCodecName(spec->value), ", the cluster uses ",
        IndexCodecName(config.index_codec), "/",
        ValueCodecName(config.value_codec)));
  }
  absl::Status decoded = DecodeSparse(push.sparse(), n, &out.sparse);
  if (!decoded.ok()) {
    *reason = RejectReason::kCorrupt;
    return absl::InvalidArgumentError(
        absl::StrCat(who, "bad sparse push: ", decoded.message()));
  }
  return out;
}

absl::Status CheckInitChunkSender(const v1::ParamsChunk& chunk,
                                  uint32_t shard_id) {
  if (chunk.rank() != 0) {
    return absl::PermissionDeniedError(absl::StrCat(
        "only worker 0 initialises the parameters; got a chunk from worker ",
        chunk.rank()));
  }
  if (chunk.shard_id() != shard_id) {
    return absl::InvalidArgumentError(
        absl::StrCat("parameter chunk for shard ", chunk.shard_id(),
                     " was sent to shard ", shard_id));
  }
  return absl::OkStatus();
}

absl::Status CheckInitChunkRange(const v1::ParamsChunk& chunk,
                                 uint32_t shard_id, uint64_t begin,
                                 uint64_t end, uint64_t next) {
  const uint64_t offset = chunk.offset();
  const uint64_t count = static_cast<uint64_t>(chunk.values_size());
  if (offset != next) {
    return absl::InvalidArgumentError(
        absl::StrCat("parameter chunk at offset ", offset, " ",
                     offset < next ? "overlaps" : "leaves a gap after",
                     " the values received so far: expected offset ", next,
                     " (shard ", shard_id, " owns [", begin, ", ", end, "))"));
  }
  if (count > end - offset) {
    return absl::InvalidArgumentError(
        absl::StrCat("parameter chunk [", offset, ", ", offset + count,
                     ") runs past the end of shard ", shard_id, "'s range [",
                     begin, ", ", end, ")"));
  }
  for (uint64_t j = 0; j < count; ++j) {
    if (!std::isfinite(chunk.values(static_cast<int>(j)))) {
      return absl::InvalidArgumentError(absl::StrCat(
          "initial parameter at index ", offset + j, " is not finite (",
          chunk.values(static_cast<int>(j)), ")"));
    }
  }
  return absl::OkStatus();
}

}  // namespace server
}  // namespace gtopk
