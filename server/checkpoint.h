// A shard's checkpoint: the parameters (and, in global momentum mode, the
// global velocity) of one aggregator shard's index range [begin, end) of the
// flat parameter vector of length n, plus the first step not yet applied.
// Written atomically and durably, read back bit-exact or not at all.
//
// File: `<dir>/shard-<shard_id>.ckpt` (e.g. `shard-0.ckpt`). Byte layout, every
// multi-byte field little-endian:
//
// clang-format off
//   offset  size  field
//   0       8     magic "GTOPKCK1" (ASCII, no terminator)
//   8       4     uint32 format version, kCheckpointFormatVersion (2; 1 had
//                        no cluster identity and is refused)
//   12      4     uint32 shard_id         (< num_shards)
//   16      4     uint32 num_shards       (>= 1)
//   20      4     uint32 reserved, 0
//   24      8     uint64 n                (parameters in the whole model)
//   32      8     uint64 begin            (first index of the shard's range)
//   40      8     uint64 end              (one past the last; begin <= end <= n)
//   48      8     int64  next_step        (>= 0)
//   56      8     uint64 params_count     (== end - begin)
//   64      8     uint64 velocity_count   (0 or end - begin)
//   72      8     uint64 cluster_fingerprint (ClusterSpec.cluster_fingerprint
//                        of the cluster that wrote it; 0: unknown)
//   80      8     uint64 run_id           (the cluster's run identity,
//                        ClusterSpec.run_id; 0: unknown)
//   88      4*params_count    params, IEEE binary32, bit-exact
//   ...     4*velocity_count  global_velocity, IEEE binary32, bit-exact
//   ...     4     uint32 CRC-32 (zlib's crc32, polynomial 0xEDB88320) of every
//                 byte before it
// clang-format on
//
// The file size is therefore exactly 92 + 4 * (params_count + velocity_count)
// bytes; anything else is truncation or trailing garbage. Every value is
// finite.
//
// Atomicity: WriteCheckpoint writes `<dir>/shard-<id>.ckpt.tmp-XXXXXX`,
// fsyncs it, renames it over `shard-<id>.ckpt` and fsyncs `dir`, so a reader
// (or a restart after a crash at any point) sees either the old complete file
// or the new complete file. A crash may leave a temp file behind: readers never
// look at temp files, and the next WriteCheckpoint of the same shard removes
// them.
//
// Thread-safety: the functions keep no state. Checkpoints of distinct shards,
// or in distinct directories, may be written and read concurrently (also from
// different processes sharing one directory). Writes of the same shard in the
// same directory must be serialised by the caller (one writer per shard: the
// shard's own server); reading a shard while it is being written is safe and
// yields the old or the new checkpoint.
#ifndef GTOPK_SERVER_CHECKPOINT_H_
#define GTOPK_SERVER_CHECKPOINT_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace gtopk {
namespace server {

// Version written into (and the only version accepted from) the file header.
inline constexpr uint32_t kCheckpointFormatVersion = 2;
// Size in bytes of the fixed header (magic through run_id).
inline constexpr size_t kCheckpointHeaderBytes = 88;
// Size in bytes of the trailing checksum.
inline constexpr size_t kCheckpointTrailerBytes = 4;

// The state of one shard at a step boundary.
struct ShardCheckpoint {
  uint32_t shard_id = 0;    // this shard, 0..num_shards-1
  uint32_t num_shards = 0;  // S, shards in the cluster (>= 1)
  uint64_t n = 0;           // parameters in the whole model
  uint64_t begin = 0;       // the shard owns the flat indices [begin, end)
  uint64_t end = 0;         // begin <= end <= n
  int64_t next_step = 0;    // first step not yet applied (>= 0)
  // The shard's parameters: end - begin values, params[i] is flat index
  // begin + i. All finite.
  std::vector<float> params;
  // Empty, or (global momentum mode) end - begin values, same indexing.
  // All finite.
  std::vector<float> global_velocity;
  // Which cluster wrote it (issue 42): its ClusterSpec.cluster_fingerprint
  // (the settings) and run_id (the run: another run with the same settings
  // has another). A shard restores only its own cluster's checkpoint
  // (AggregatorService::Create, GetAggregator, GetShardState). 0: unknown.
  uint64_t cluster_fingerprint = 0;
  uint64_t run_id = 0;
};

// The path of shard `shard_id`'s checkpoint in `dir`: "<dir>/shard-<id>.ckpt".
std::string CheckpointPath(const std::string& dir, uint32_t shard_id);

// Writes `c` to CheckpointPath(dir, c.shard_id), atomically replacing any
// previous checkpoint of that shard, and makes it durable (file and directory
// fsynced) before returning OK. `dir` must exist; it is not created. Removes
// temp files left in `dir` by earlier failed writes of the same shard (never
// those of other shards). Payloads are streamed in chunks of at most 1 MiB;
// the vectors are not copied.
//
// Errors:
//   INVALID_ARGUMENT  `c` is inconsistent: num_shards == 0, shard_id >=
//                     num_shards, not begin <= end <= n, params.size() !=
//                     end - begin, global_velocity neither empty nor
//                     end - begin long, next_step < 0, or a non-finite value
//                     (the message names the field and the offending index).
//   from errno        the file system failed (absl::ErrnoToStatus: e.g.
//                     NOT_FOUND for a missing dir, PERMISSION_DENIED,
//                     FAILED_PRECONDITION for ENOTDIR, RESOURCE_EXHAUSTED for
//                     ENOSPC); the message names the operation, the path and
//                     strerror. The temp file is removed and the previous
//                     checkpoint is untouched, except when only the final
//                     directory fsync fails: the new file is then in place
//                     but its rename may not survive a power loss.
// Never aborts.
absl::Status WriteCheckpoint(const std::string& dir, const ShardCheckpoint& c);

// Reads and fully verifies CheckpointPath(dir, shard_id). Allocates only after
// the header's counts have been checked against the actual file size, so a
// hostile header cannot trigger a huge allocation.
//
// Errors:
//   NOT_FOUND   there is no checkpoint of this shard in `dir` (temp files
//               left by a crashed writer do not count).
//   DATA_LOSS   the file is not a valid checkpoint; the message names the
//               fault: bad magic, unsupported version, truncated or trailing
//               bytes, inconsistent header (shard id other than `shard_id`,
//               shard_id >= num_shards, not begin <= end <= n, counts that do
//               not match the range, non-zero reserved field, negative
//               next_step), checksum mismatch, or a non-finite value.
//   from errno  the file exists but cannot be opened or read (e.g.
//               PERMISSION_DENIED), or is not a regular file
//               (FAILED_PRECONDITION).
absl::StatusOr<ShardCheckpoint> ReadCheckpoint(const std::string& dir,
                                               uint32_t shard_id);

// Reads and verifies the checkpoint file at `path` (any name) as
// ReadCheckpoint does; NOT_FOUND when there is no such file.
absl::StatusOr<ShardCheckpoint> ReadCheckpointFile(const std::string& path,
                                                   uint32_t shard_id);

// ---------------------------------------------------------------------------
// Checkpoint history, for crash recovery (docs/recovery.md).
//
// Besides `shard-<id>.ckpt` (the newest checkpoint, what a restart restores),
// a shard keeps its last few checkpoints as `shard-<id>.step-<next_step>.ckpt`
// in the same directory: hard links to the same files, so retaining costs no
// extra writes (on a file system without hard links they are copies). Disk
// use: `keep` checkpoint files per shard. After a restart, the leader may roll
// every shard back to a step they all retain (server/service.h, Recover).
// Invariant kept by the server: no entry is newer than the shard's state in
// memory, and after a rollback no entry is newer than the step rolled back to
// (the abandoned steps would otherwise be mistaken for the cluster's new ones).
// Thread-safety as for the functions above: one writer per shard.

// "<dir>/shard-<id>.step-<step>.ckpt".
std::string CheckpointHistoryPath(const std::string& dir, uint32_t shard_id,
                                  int64_t step);

// Records the current checkpoint (CheckpointPath, just written, holding
// `step`) as the history entry of `step` (replacing one of the same step),
// then removes the oldest entries beyond `keep` (>= 1) and fsyncs `dir`.
// Errors: INVALID_ARGUMENT for keep < 1 or step < 0; errno-derived statuses
// (e.g. NOT_FOUND when there is no current checkpoint, or a file system
// without hard links), naming the operation and path.
absl::Status RetainCheckpoint(const std::string& dir, uint32_t shard_id,
                              int64_t step, int keep);

// The steps of the shard's history entries in `dir`, ascending (empty when
// none). Errors: the directory cannot be listed (errno-derived).
absl::StatusOr<std::vector<int64_t>> ListCheckpointSteps(const std::string& dir,
                                                         uint32_t shard_id);

// Reads and verifies the history entry of `step`. Errors: NOT_FOUND when the
// shard retains no such entry; ReadCheckpoint's errors; DATA_LOSS when the
// file holds another step.
absl::StatusOr<ShardCheckpoint> ReadCheckpointAt(const std::string& dir,
                                                 uint32_t shard_id,
                                                 int64_t step);

// Removes the history entries newer than `step` (fsyncs `dir` when any).
// Errors: errno-derived, naming the path.
absl::Status DiscardCheckpointsAfter(const std::string& dir, uint32_t shard_id,
                                     int64_t step);

// After a rollback to `step`: makes its history entry the current checkpoint
// (atomically, durably), then removes the newer entries. Errors: NOT_FOUND
// when no entry of `step` is retained (nothing changed); errno-derived.
absl::Status RewindCheckpoints(const std::string& dir, uint32_t shard_id,
                               int64_t step);

// Checks that a restored checkpoint belongs to this cluster layout: the same
// shard id, number of shards, n and range. Call it after ReadCheckpoint,
// before using the restored state.
//
// Errors:
//   FAILED_PRECONDITION  a field differs; the message names the field and
//                        both values (checkpoint's and expected).
//   INVALID_ARGUMENT     the expected layout itself is inconsistent
//                        (shard_id >= num_shards or not begin <= end <= n),
//                        or `c`'s vectors do not match its own range.
absl::Status ValidateCheckpointFor(const ShardCheckpoint& c, uint32_t shard_id,
                                   uint32_t num_shards, uint64_t n,
                                   uint64_t begin, uint64_t end);

}  // namespace server
}  // namespace gtopk

#endif  // GTOPK_SERVER_CHECKPOINT_H_
