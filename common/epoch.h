// Attempt epochs (fail fast, docs/recovery.md "Failed steps"): the leader
// numbers every step failure it hears of (AbortStep) with a new, larger
// epoch. Workers push with the epoch they last heard (Join, Recover), shards
// vote and exchange thresholds with the smallest epoch among their round's
// pushes, and anything of a step older than the step's last failure is
// refused with ABORTED: an old attempt can neither join nor complete a
// retry. Epochs start at the leader's start time in microseconds since the
// Unix epoch, so a restarted leader's epochs are larger than its
// predecessor's (clocks permitting).
#ifndef GTOPK_COMMON_EPOCH_H_
#define GTOPK_COMMON_EPOCH_H_

#include <cstdint>

#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace gtopk {

// "Newer than any failure": what in-process callers that do not take part
// in fail-fast (tests, tools) pass; never refused.
inline constexpr uint64_t kNewestEpoch = ~uint64_t{0};

// Trailing metadata of a PushPull stream that failed a step: the decimal
// epoch of the step's last failure on that shard, when it has one. A worker
// pushes its next attempt with it (the client library does).
inline constexpr char kEpochMetadataKey[] = "gtopk-epoch";

// In the message of a shard's FAILED_PRECONDITION refusing a push of a
// step it applied and whose result it no longer keeps (it keeps only its
// last committed step's, in memory: not across a restart or a rollback).
// A worker whose retry of a lost step got it stops expecting the kept
// result at its next Recover (worker/client.cc; docs/recovery.md); a retry
// that failed otherwise (a stall, a timeout) is answered again.
inline constexpr char kResultNotKeptMarker[] =
    "no longer keeps that step's result";

// Whether `epoch` can be a leader's: epochs start at its start time in
// microseconds and grow by one per failure, so one more than a day ahead of
// `now` is not (it would make every later push "newer than any failure"
// for good). Shards refuse such an AbortStep; workers ignore such a
// trailer.
inline bool IsPlausibleEpoch(uint64_t epoch, absl::Time now = absl::Now()) {
  const uint64_t now_us = static_cast<uint64_t>(absl::ToUnixMicros(now));
  return epoch <= now_us + uint64_t{86400} * 1000 * 1000;
}

}  // namespace gtopk

#endif  // GTOPK_COMMON_EPOCH_H_
