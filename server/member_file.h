// The leader's member tokens on disk (issue 42, "rank takeover after a leader
// restart"; docs/security.md, docs/recovery.md).
//
// Join hands each rank's holder a random member token, and every push,
// Recover and InitParams must carry it. The leader (shard 0) writes its token
// table to `<checkpoint-dir>/members-shard-0.state` at every change, so that a
// leader restarted from its checkpoint still knows who holds which rank: a
// live worker re-registers with its token (Recover), and any other client is
// refused the rank (Join: UNAVAILABLE until the holder's reclaim window
// ends; Recover with another token: PERMISSION_DENIED).
//
// File (text, one record per line, written atomically: temp file, fsync,
// rename, directory fsync; mode 0600, the tokens are credentials):
//
//   gtopk-members 1
//   workers <P>
//   run_length <text>     optional: the cluster's JoinRequest.run_length
//   <rank> <token>        one line per rank with a holder, ranks ascending
//   fnv1a64 <16 hex>      common/checksum.h's Fnv1a64 of every byte before
//
// Thread-safety: the functions keep no state; one writer per directory (the
// leader), serialised by the caller.
#ifndef GTOPK_SERVER_MEMBER_FILE_H_
#define GTOPK_SERVER_MEMBER_FILE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace gtopk {
namespace server {

// "<dir>/members-shard-0.state".
std::string MemberFilePath(const std::string& dir);

// Writes `tokens` (one per rank, 0 = no holder) atomically and durably.
// Errors: errno-derived statuses naming the operation and path (the previous
// file, if any, is untouched).
// `run_length`: the run length the cluster's workers stated ("" for none;
// no newline), kept so that a restarted leader still refuses another.
absl::Status WriteMemberTokens(const std::string& dir,
                               const std::vector<uint64_t>& tokens,
                               const std::string& run_length = "");

// Reads the table back: `num_workers` tokens, 0 for ranks without a holder.
// Errors: NOT_FOUND (no file); DATA_LOSS naming the fault (bad header,
// checksum mismatch, a rank out of range or repeated, a malformed line);
// FAILED_PRECONDITION when the file was written for another number of
// workers (the message names both); errno-derived for read failures.
// `run_length`, when not null, receives the stored run length ("" none).
absl::StatusOr<std::vector<uint64_t>> ReadMemberTokens(
    const std::string& dir, uint32_t num_workers,
    std::string* run_length = nullptr);

}  // namespace server
}  // namespace gtopk

#endif  // GTOPK_SERVER_MEMBER_FILE_H_
