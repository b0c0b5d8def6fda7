// The stateless checks of the requests a shard receives on its streams
// (server/service.h): a worker's Push turned into a WorkerPush, and rank 0's
// InitParams chunks. Split out of the handlers so that the fuzz harness
// fuzz/server_requests_fuzz.cc calls the very code the server runs
// (docs/fuzzing.md). The unary handlers are fuzzed as they are.
#ifndef GTOPK_SERVER_REQUEST_CHECKS_H_
#define GTOPK_SERVER_REQUEST_CHECKS_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "gtopk/v1/gtopk.pb.h"
#include "server/server_config.h"
#include "server/server_metrics.h"
#include "server/shard_aggregator.h"

namespace gtopk {
namespace server {

// Turns a wire push for shard `config.shard_id` of a cluster of `n`
// parameters (1 <= n <= 2^32) into a WorkerPush: push.shard_id must be this
// shard, push.rank < P; in dense mode no sparse bytes (the dense values
// are taken as they are: ShardAggregator::Submit checks their count and
// finiteness); in gtopk/topk no dense values, sparse bytes in the cluster's
// codecs (PeekCodecSpec) that DecodeSparse accepts for `n` (sorted, unique,
// every index < n, finite values; the shard's range is checked by Submit).
// Errors, all INVALID_ARGUMENT, naming the worker, the step and the fault;
// `*reason` (not null) is then set to the metric's reject reason. On OK
// `*reason` is untouched. Pure; thread-safe.
absl::StatusOr<WorkerPush> DecodeWirePush(const v1::Push& push,
                                          const ServerConfig& config,
                                          uint64_t n, RejectReason* reason);

// The sender of an InitParams chunk: worker 0 (PERMISSION_DENIED otherwise:
// well-formed but not allowed to initialise) and this shard
// (INVALID_ARGUMENT naming both shards). Pure.
absl::Status CheckInitChunkSender(const v1::ParamsChunk& chunk,
                                  uint32_t shard_id);

// The place and values of an InitParams chunk for shard `shard_id`, which
// owns [begin, end) and has received [begin, next) so far: offset == next
// (INVALID_ARGUMENT "overlaps" / "leaves a gap"), offset + values <= end
// (no overflow: compared as a count against end - offset), every value
// finite. INVALID_ARGUMENT naming the fault. On OK the chunk's values belong
// at [offset, offset + values_size()) inside [begin, end). Precondition:
// begin <= next <= end. Pure.
absl::Status CheckInitChunkRange(const v1::ParamsChunk& chunk,
                                 uint32_t shard_id, uint64_t begin,
                                 uint64_t end, uint64_t next);

}  // namespace server
}  // namespace gtopk

#endif  // GTOPK_SERVER_REQUEST_CHECKS_H_
