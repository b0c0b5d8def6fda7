#include "server/threshold.h"

#include <algorithm>
#include <optional>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"
#include "common/topk.h"

namespace gtopk {
namespace server {
namespace {

// Key bits below each level's digit: the digit is (key >> shift) & mask.
constexpr uint32_t kLevelShift[kThresholdLevels] = {20, 9, 0};
// Digit widths: 11, 11, 9 bits.
constexpr uint32_t kLevelBits[kThresholdLevels] = {11, 11, 9};
// Level-0 buckets at or above this hold only Inf/NaN keys.
constexpr uint32_t kNonFiniteBucket = cpu::kNonFiniteKey >> 20;
// A shard addresses at most 2^32 indices, so it holds at most that many
// entries; this also keeps the sum over shards far from overflowing.
constexpr uint64_t kMaxShardEntries = kMaxDenseLength;
// How often a wait with a cancellation check looks at it.
constexpr absl::Duration kCancelPoll = absl::Milliseconds(50);

std::string RoundName(int64_t step, uint32_t level) {
  return absl::StrCat("step ", step, " level ", level);
}

// Order-sensitive fingerprint of a histogram, so that a finished round can
// recognise a retry without keeping 16 KiB per shard.
uint64_t Fingerprint(absl::Span<const uint64_t> histogram) {
  uint64_t h = 0x9e3779b97f4a7c15ull ^ histogram.size();
  for (uint64_t x : histogram) {
    uint64_t z = x + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    h ^= z ^ (z >> 31);
  }
  return h;
}

// Checks what can be checked on one request in isolation, given its shard id
// is in range; returns the fault (without the round name) or OK.
absl::Status CheckRequestShape(const ThresholdRequest& r) {
  const uint32_t buckets = ThresholdBucketCount(r.level);
  if (r.histogram.size() != buckets) {
    return absl::InvalidArgumentError(
        absl::StrCat("shard ", r.shard_id, ": histogram has ",
                     r.histogram.size(), " buckets, expected ", buckets));
  }
  if (r.k == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("shard ", r.shard_id, ": k must be >= 1, got 0"));
  }
  uint64_t total = 0;
  for (uint32_t b = 0; b < buckets; ++b) {
    const uint64_t c = r.histogram[b];
    if (r.level == 0 && b >= kNonFiniteBucket && c != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("shard ", r.shard_id, ": histogram counts ", c,
                       " non-finite keys (Inf/NaN) in bucket ", b));
    }
    if (c > kMaxShardEntries - total) {
      return absl::InvalidArgumentError(
          absl::StrCat("shard ", r.shard_id, ": histogram holds more than ",
                       kMaxShardEntries, " entries"));
    }
    total += c;
  }
  return absl::OkStatus();
}

uint64_t HistogramTotal(absl::Span<const uint64_t> histogram) {
  uint64_t total = 0;
  for (uint64_t c : histogram) total += c;
  return total;
}

}  // namespace

uint32_t ThresholdBucketCount(uint32_t level) {
  return level < kThresholdLevels ? uint32_t{1} << kLevelBits[level] : 0;
}

bool operator==(const ThresholdRequest& a, const ThresholdRequest& b) {
  return a.step == b.step && a.shard_id == b.shard_id && a.k == b.k &&
         a.level == b.level && a.histogram == b.histogram;
}

bool operator==(const ThresholdResponse& a, const ThresholdResponse& b) {
  return a.step == b.step && a.level == b.level && a.bucket == b.bucket &&
         a.greater_total == b.greater_total && a.kth_key == b.kth_key &&
         a.ties_to_keep == b.ties_to_keep && a.done == b.done &&
         a.keep_all == b.keep_all;
}

std::vector<uint64_t> KeyHistogram(absl::Span<const float> values,
                                   uint32_t level, uint32_t prefix) {
  std::vector<uint64_t> h(ThresholdBucketCount(level), 0);
  switch (level) {
    case 0:
      for (float x : values) ++h[cpu::MagnitudeKey(x) >> 20];
      break;
    case 1:
      for (float x : values) {
        const uint32_t key = cpu::MagnitudeKey(x);
        if ((key >> 20) == prefix) ++h[(key >> 9) & 0x7ff];
      }
      break;
    case 2:
      for (float x : values) {
        const uint32_t key = cpu::MagnitudeKey(x);
        if ((key >> 9) == prefix) ++h[key & 0x1ff];
      }
      break;
    default:
      break;
  }
  return h;
}

namespace {

// CombineThresholdRound's checks of `requests` against each other and
// `before` (INVALID_ARGUMENT naming the round and the fault); on success
// *by_shard_out holds the requests indexed by shard id.
absl::Status CheckThresholdRound(
    uint32_t num_shards, const ThresholdPrefix& before,
    absl::Span<const ThresholdRequest> requests,
    std::vector<const ThresholdRequest*>* by_shard_out) {
  if (num_shards == 0) {
    return absl::InvalidArgumentError("threshold round needs >= 1 shard");
  }
  if (requests.size() != num_shards) {
    return absl::InvalidArgumentError(
        absl::StrCat("threshold round needs one request per shard: expected ",
                     num_shards, ", got ", requests.size()));
  }
  const int64_t step = requests[0].step;
  const uint32_t level = requests[0].level;
  const uint64_t k = requests[0].k;
  const std::string round = RoundName(step, level);
  auto fault = [&](const std::string& what) {
    return absl::InvalidArgumentError(absl::StrCat(round, ": ", what));
  };
  if (level >= kThresholdLevels) {
    return fault(absl::StrCat("shard ", requests[0].shard_id,
                              ": level must be 0, 1 or 2"));
  }

  // Validate everything first, indexing the requests by shard id.
  std::vector<const ThresholdRequest*>& by_shard = *by_shard_out;
  by_shard.assign(num_shards, nullptr);
  for (const ThresholdRequest& r : requests) {
    if (r.shard_id >= num_shards) {
      return fault(absl::StrCat("shard ", r.shard_id,
                                ": shard id out of range, S = ", num_shards));
    }
    if (by_shard[r.shard_id] != nullptr) {
      return fault(absl::StrCat("shard ", r.shard_id, ": two requests"));
    }
    by_shard[r.shard_id] = &r;
    if (r.step != step || r.level != level) {
      return fault(absl::StrCat("shard ", r.shard_id, ": request for ",
                                RoundName(r.step, r.level), ", expected ",
                                round));
    }
    if (r.k != k) {
      return fault(absl::StrCat("shard ", r.shard_id, ": k = ", r.k,
                                " differs from shard ", requests[0].shard_id,
                                "'s k = ", k));
    }
    absl::Status shape = CheckRequestShape(r);
    if (!shape.ok()) return fault(std::string(shape.message()));
  }
  if (level == 0 && (before.greater_total != 0 || before.prefix != 0 ||
                     !before.shard_counts.empty())) {
    return fault("level 0 must start from an empty prefix state");
  }
  if (level > 0 && before.greater_total >= k) {
    return fault(absl::StrCat("prefix state inconsistent with k = ", k, ": ",
                              before.greater_total, " keys already above"));
  }
  if (level > 0 && (before.prefix >> (31 - kLevelShift[level - 1])) != 0) {
    return fault(absl::StrCat("prefix ", before.prefix, " out of range"));
  }
  if (!before.shard_counts.empty()) {
    if (before.shard_counts.size() != num_shards) {
      return fault(absl::StrCat("prefix state has ", before.shard_counts.size(),
                                " shard counts, expected ", num_shards));
    }
    for (uint32_t s = 0; s < num_shards; ++s) {
      const uint64_t total = HistogramTotal(by_shard[s]->histogram);
      if (total != before.shard_counts[s]) {
        return fault(absl::StrCat("shard ", s, ": histogram holds ", total,
                                  " entries, but its bucket at level ",
                                  level - 1, " held ", before.shard_counts[s]));
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<ThresholdRound> CombineThresholdRound(
    uint32_t num_shards, const ThresholdPrefix& before,
    absl::Span<const ThresholdRequest> requests) {
  std::vector<const ThresholdRequest*> by_shard;
  if (const absl::Status valid =
          CheckThresholdRound(num_shards, before, requests, &by_shard);
      !valid.ok()) {
    return valid;
  }
  const int64_t step = requests[0].step;
  const uint32_t level = requests[0].level;
  const uint64_t k = requests[0].k;
  const std::string round = RoundName(step, level);
  auto fault = [&](const std::string& what) {
    return absl::InvalidArgumentError(absl::StrCat(round, ": ", what));
  };

  // Sum. Each shard holds <= 2^32 entries and S < 2^32: no overflow.
  const uint32_t buckets = ThresholdBucketCount(level);
  std::vector<uint64_t> sum(buckets, 0);
  for (const ThresholdRequest* r : by_shard) {
    for (uint32_t b = 0; b < buckets; ++b) sum[b] += r->histogram[b];
  }
  const uint64_t total = HistogramTotal(sum);

  ThresholdRound out;
  out.responses.resize(num_shards);
  for (uint32_t s = 0; s < num_shards; ++s) {
    out.responses[s].step = step;
    out.responses[s].level = level;
  }
  if (level == 0 && total <= k) {
    for (ThresholdResponse& r : out.responses) {
      r.done = true;
      r.keep_all = true;
    }
    return out;
  }

  const uint64_t need = k - before.greater_total;  // >= 1
  if (total < need) {
    return fault(absl::StrCat("histograms hold ", total,
                              " entries, fewer than the ", need,
                              " still needed"));
  }
  // The highest bucket whose count, with the counts above it, reaches need.
  uint64_t above = 0;
  uint32_t bucket = buckets - 1;
  while (above + sum[bucket] < need) above += sum[bucket--];
  const uint64_t greater_total = before.greater_total + above;
  const uint32_t full_prefix = (before.prefix << kLevelBits[level]) | bucket;
  for (ThresholdResponse& r : out.responses) {
    r.bucket = bucket;
    r.greater_total = greater_total;
  }

  if (level == kThresholdLevels - 1) {
    // The bucket is the exact k-th key; hand its needed ties to shards in
    // shard-id order (lower shards hold lower global indices).
    uint64_t ties_left = need - above;
    for (uint32_t s = 0; s < num_shards; ++s) {
      ThresholdResponse& r = out.responses[s];
      r.kth_key = full_prefix;
      r.ties_to_keep = std::min(ties_left, by_shard[s]->histogram[bucket]);
      ties_left -= r.ties_to_keep;
      r.done = true;
    }
    return out;
  }

  const uint32_t bucket_low_key = full_prefix << kLevelShift[level];
  if (above + sum[bucket] == need && bucket_low_key != 0) {
    // Every key in the bucket is needed, and none below it: finish now with
    // the threshold just below the bucket. (A bucket starting at key 0
    // cannot get here without keep_all; refine then, to stay expressible.)
    for (ThresholdResponse& r : out.responses) {
      r.kth_key = bucket_low_key - 1;
      r.ties_to_keep = 0;
      r.done = true;
    }
    return out;
  }

  out.next.prefix = full_prefix;
  out.next.greater_total = greater_total;
  out.next.shard_counts.resize(num_shards);
  for (uint32_t s = 0; s < num_shards; ++s) {
    out.next.shard_counts[s] = by_shard[s]->histogram[bucket];
  }
  return out;
}

// ---------------------------------------------------------------------------
// ThresholdCoordinator

struct ThresholdCoordinator::ExchangeRound {
  enum class Phase { kIdle, kCollecting, kComplete, kFailed };
  Phase phase = Phase::kIdle;
  // While collecting: the requests so far, by shard id.
  std::vector<std::optional<ThresholdRequest>> requests;
  uint32_t arrived = 0;
  // Once complete: the responses by shard id, and what identifies each
  // shard's request for retries (the histograms are dropped).
  std::vector<ThresholdResponse> responses;
  std::vector<uint64_t> fingerprints;
  std::vector<uint64_t> ks;
  // Once failed: the culprit shard (-1: none) gets `culprit_status`, every
  // other caller `status`.
  int64_t culprit = -1;
  absl::Status culprit_status;
  absl::Status status;

  const absl::Status& FailureFor(uint32_t shard) const {
    return static_cast<int64_t>(shard) == culprit ? culprit_status : status;
  }
};

struct ThresholdCoordinator::StepState {
  int64_t step = 0;
  // The step's k, from its first request (has_k), and who sent it.
  bool has_k = false;
  uint64_t k = 0;
  uint32_t k_from = 0;
  ExchangeRound rounds[kThresholdLevels];
  // The state each level starts from (filled when the previous completes).
  ThresholdPrefix prefix[kThresholdLevels];
  // The level whose round answered done, or -1.
  int done_level = -1;
};

ThresholdCoordinator::ThresholdCoordinator(uint32_t num_shards,
                                           ThresholdCoordinatorOptions options)
    : num_shards_(num_shards),
      retained_steps_(
          static_cast<size_t>(std::max(1, options.retained_steps))) {}

ThresholdCoordinator::~ThresholdCoordinator() = default;

size_t ThresholdCoordinator::NumRetainedSteps() const {
  absl::MutexLock lock(&mu_);
  return steps_.size();
}

absl::StatusOr<std::shared_ptr<ThresholdCoordinator::StepState>>
ThresholdCoordinator::FindOrCreateStepLocked(int64_t step) {
  auto too_old = [&]() {
    return absl::FailedPreconditionError(absl::StrCat(
        "threshold exchange for step ", step,
        " is older than the steps the leader retains (",
        steps_.empty() ? std::string("none")
                       : absl::StrCat("oldest held: ", steps_.begin()->first),
        ", at most ", retained_steps_, ")"));
  };
  if (has_evicted_ && step <= evicted_through_) return too_old();
  auto it = steps_.find(step);
  if (it != steps_.end()) return it->second;
  if (steps_.size() >= retained_steps_ && step < steps_.begin()->first) {
    // It would be evicted at once.
    return too_old();
  }
  auto state = std::make_shared<StepState>();
  state->step = step;
  steps_.emplace(step, state);
  bool woke = false;
  while (steps_.size() > retained_steps_) {
    auto oldest = steps_.begin();
    StepState* old = oldest->second.get();
    for (uint32_t level = 0; level < kThresholdLevels; ++level) {
      ExchangeRound& r = old->rounds[level];
      if (r.phase != ExchangeRound::Phase::kCollecting) continue;
      const absl::Status aborted = absl::AbortedError(
          absl::StrCat(RoundName(old->step, level), ": abandoned, step ", step,
                       " arrived and the leader retains at most ",
                       retained_steps_, " steps"));
      FailRoundLocked(&r, -1, aborted, aborted);
      woke = true;
    }
    has_evicted_ = true;
    evicted_through_ = std::max(evicted_through_, oldest->first);
    steps_.erase(oldest);
  }
  if (woke) changed_.SignalAll();
  return state;
}

void ThresholdCoordinator::FailRoundLocked(ExchangeRound* round,
                                           int64_t culprit, absl::Status status,
                                           absl::Status others) {
  round->phase = ExchangeRound::Phase::kFailed;
  round->culprit = culprit;
  round->culprit_status = std::move(status);
  round->status = std::move(others);
  round->requests.clear();
  round->requests.shrink_to_fit();
  changed_.SignalAll();
}

void ThresholdCoordinator::CompleteRoundLocked(StepState* state,
                                               uint32_t level) {
  ExchangeRound& round = state->rounds[level];
  std::vector<ThresholdRequest> requests;
  requests.reserve(num_shards_);
  for (std::optional<ThresholdRequest>& r : round.requests) {
    requests.push_back(std::move(*r));
  }
  absl::StatusOr<ThresholdRound> combined =
      CombineThresholdRound(num_shards_, state->prefix[level], requests);
  if (!combined.ok()) {
    // Submit checks every fault on arrival, so this should not happen; if
    // it does, the round fails for everyone with the combine's message
    // (which names the shard and the fault).
    FailRoundLocked(&round, -1, combined.status(), combined.status());
    return;
  }
  round.phase = ExchangeRound::Phase::kComplete;
  round.responses = std::move(combined->responses);
  round.fingerprints.resize(num_shards_);
  round.ks.resize(num_shards_);
  for (const ThresholdRequest& r : requests) {
    round.fingerprints[r.shard_id] = Fingerprint(r.histogram);
    round.ks[r.shard_id] = r.k;
  }
  round.requests.clear();
  round.requests.shrink_to_fit();
  if (round.responses[0].done) {
    state->done_level = static_cast<int>(level);
  } else {
    state->prefix[level + 1] = std::move(combined->next);
  }
  changed_.SignalAll();
}

void ThresholdCoordinator::Fence(const absl::Status& reason) {
  absl::MutexLock lock(&mu_);
  fenced_ =
      reason.ok() ? absl::AbortedError("the leader is recovering") : reason;
  for (auto& [step, state] : steps_) {
    for (uint32_t level = 0; level < kThresholdLevels; ++level) {
      ExchangeRound& r = state->rounds[level];
      if (r.phase == ExchangeRound::Phase::kCollecting) {
        FailRoundLocked(&r, -1, fenced_, fenced_);
      }
    }
  }
  changed_.SignalAll();
}

void ThresholdCoordinator::Unfence() {
  absl::MutexLock lock(&mu_);
  fenced_ = absl::OkStatus();
}

void ThresholdCoordinator::ForgetFrom(int64_t step) {
  absl::MutexLock lock(&mu_);
  const absl::Status aborted = absl::AbortedError(absl::StrCat(
      "threshold exchange abandoned: the cluster rolled back to step ", step));
  for (auto it = steps_.lower_bound(step); it != steps_.end();) {
    for (uint32_t level = 0; level < kThresholdLevels; ++level) {
      ExchangeRound& r = it->second->rounds[level];
      if (r.phase == ExchangeRound::Phase::kCollecting) {
        FailRoundLocked(&r, -1, aborted, aborted);
      }
    }
    it = steps_.erase(it);
  }
  if (has_evicted_ && evicted_through_ >= step) {
    has_evicted_ = step > 0;
    evicted_through_ = step - 1;
  }
  changed_.SignalAll();
}

void ThresholdCoordinator::Abort(int64_t step, const absl::Status& reason,
                                 uint64_t epoch) {
  absl::MutexLock lock(&mu_);
  auto it = steps_.find(step);
  if (it != steps_.end()) {
    for (uint32_t level = 0; level < kThresholdLevels; ++level) {
      ExchangeRound& r = it->second->rounds[level];
      if (r.phase == ExchangeRound::Phase::kCollecting) {
        FailRoundLocked(&r, -1, reason, reason);
      }
    }
    steps_.erase(it);
  }
  auto& tomb = aborted_[step];
  if (epoch >= tomb.second) tomb = {reason, epoch};
  while (aborted_.size() > retained_steps_) aborted_.erase(aborted_.begin());
  changed_.SignalAll();
}

namespace {

// ThresholdCoordinator::Submit's checks of a request that cannot be pinned
// on a participant of a round: only this call fails.
absl::Status CheckThresholdRequest(uint32_t num_shards,
                                   const ThresholdRequest& request) {
  const uint32_t shard = request.shard_id;
  const uint32_t level = request.level;
  if (num_shards == 0) {
    return absl::FailedPreconditionError(
        "threshold coordinator configured with 0 shards");
  }
  if (shard >= num_shards) {
    return absl::InvalidArgumentError(
        absl::StrCat("threshold request from shard ", shard,
                     ": shard id out of range, S = ", num_shards));
  }
  if (request.step < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("threshold request from shard ", shard, ": step ",
                     request.step, " is negative"));
  }
  if (level >= kThresholdLevels) {
    return absl::InvalidArgumentError(
        absl::StrCat("threshold request from shard ", shard, " for step ",
                     request.step, ": level ", level, " is not 0, 1 or 2"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<ThresholdResponse> ThresholdCoordinator::Submit(
    const ThresholdRequest& request, absl::Time deadline,
    const std::function<bool()>& cancelled) {
  const uint32_t shard = request.shard_id;
  const uint32_t level = request.level;
  // Faults that cannot be pinned on a participant of a round: only this call
  // fails.
  GTOPK_RETURN_IF_ERROR(CheckThresholdRequest(num_shards_, request));
  const std::string round_name = RoundName(request.step, level);

  absl::MutexLock lock(&mu_);
  GTOPK_ASSIGN_OR_RETURN(std::shared_ptr<StepState> state,
                         StepForRequestLocked(request));
  ExchangeRound& round = state->rounds[level];
  if (round.phase == ExchangeRound::Phase::kIdle) {
    GTOPK_RETURN_IF_ERROR(
        OpenRoundLocked(*state, level, shard, request.step, round_name));
  }
  switch (round.phase) {
    case ExchangeRound::Phase::kFailed:
      return round.FailureFor(shard);
    case ExchangeRound::Phase::kComplete:
      if (round.ks[shard] != request.k ||
          round.fingerprints[shard] != Fingerprint(request.histogram)) {
        return absl::InvalidArgumentError(absl::StrCat(
            round_name, ": shard ", shard,
            ": retry differs from the request that completed the round"));
      }
      return round.responses[shard];
    case ExchangeRound::Phase::kIdle:
    case ExchangeRound::Phase::kCollecting:
      break;
  }
  GTOPK_RETURN_IF_ERROR(AddRequestLocked(*state, request, round_name));
  return AwaitRoundLocked(round, shard, round_name, deadline, cancelled);
}

absl::StatusOr<std::shared_ptr<ThresholdCoordinator::StepState>>
ThresholdCoordinator::StepForRequestLocked(const ThresholdRequest& request) {
  const uint32_t shard = request.shard_id;
  const uint32_t level = request.level;
  if (!fenced_.ok()) return fenced_;
  if (auto dead = aborted_.find(request.step);
      dead != aborted_.end() && request.epoch < dead->second.second) {
    return dead->second.first;  // a request of the failed attempt
  }
  GTOPK_ASSIGN_OR_RETURN(std::shared_ptr<StepState> state,
                         FindOrCreateStepLocked(request.step));
  if (level == 0) {
    // A level-0 request for a step whose exchange failed is a new attempt
    // of that step (the workers retry a failed step on every shard): start
    // it afresh. Waiters of the failed attempt keep their own state. So is
    // one that differs from the request that completed level 0: the step
    // completed its exchange but failed later (e.g. its commit vote was
    // fenced by a recovery), and the retry's pushes differ.
    bool failed = false;
    for (uint32_t l = 0; l < kThresholdLevels; ++l) {
      failed |= state->rounds[l].phase == ExchangeRound::Phase::kFailed;
    }
    const ExchangeRound& first = state->rounds[0];
    if (first.phase == ExchangeRound::Phase::kComplete &&
        (first.ks[shard] != request.k ||
         first.fingerprints[shard] != Fingerprint(request.histogram))) {
      failed = true;
    }
    if (failed) {
      auto fresh = std::make_shared<StepState>();
      fresh->step = request.step;
      steps_[request.step] = fresh;
      state = fresh;
    }
  }
  return state;
}

absl::Status ThresholdCoordinator::OpenRoundLocked(
    StepState& state_ref, uint32_t level, uint32_t shard, int64_t step,
    const std::string& round_name) {
  StepState* const state = &state_ref;
  ExchangeRound& round = state->rounds[level];
  for (uint32_t l = 0; l < kThresholdLevels; ++l) {
    if (state->rounds[l].phase == ExchangeRound::Phase::kFailed) {
      return state->rounds[l].FailureFor(shard);
    }
  }
  if (state->done_level >= 0) {
    return absl::FailedPreconditionError(
        absl::StrCat(round_name, ": shard ", shard, ": step ", step,
                     " already finished at level ", state->done_level));
  }
  if (level > 0 &&
      state->rounds[level - 1].phase != ExchangeRound::Phase::kComplete) {
    return absl::FailedPreconditionError(
        absl::StrCat(round_name, ": shard ", shard, ": level ", level - 1,
                     " of step ", step, " has not completed"));
  }
  round.phase = ExchangeRound::Phase::kCollecting;
  round.requests.assign(num_shards_, std::nullopt);
  round.arrived = 0;
  return absl::OkStatus();
}

absl::Status ThresholdCoordinator::AddRequestLocked(
    StepState& state_ref, const ThresholdRequest& request,
    const std::string& round_name) {
  StepState* const state = &state_ref;
  const uint32_t shard = request.shard_id;
  const uint32_t level = request.level;
  ExchangeRound& round = state->rounds[level];
  // Collecting. Faults attributable to this shard fail the round for all.
  auto fail = [&](const std::string& what) -> absl::Status {
    const std::string message = absl::StrCat(round_name, ": ", what);
    FailRoundLocked(&round, shard, absl::InvalidArgumentError(message),
                    absl::AbortedError(absl::StrCat(
                        "threshold round failed by another shard: ", message)));
    return round.culprit_status;
  };
  if (round.requests[shard].has_value()) {
    if (!(*round.requests[shard] == request)) {
      return fail(
          absl::StrCat("shard ", shard, ": sent two different requests"));
    }
    // An identical retry: wait with the original.
  } else {
    absl::Status shape = CheckRequestShape(request);
    if (!shape.ok()) return fail(std::string(shape.message()));
    if (state->has_k && request.k != state->k) {
      return fail(absl::StrCat("shard ", shard, ": k = ", request.k,
                               " differs from the step's k = ", state->k,
                               " (first sent by shard ", state->k_from, ")"));
    }
    if (!state->prefix[level].shard_counts.empty()) {
      const uint64_t total = HistogramTotal(request.histogram);
      const uint64_t expected = state->prefix[level].shard_counts[shard];
      if (total != expected) {
        return fail(absl::StrCat("shard ", shard, ": histogram holds ", total,
                                 " entries, but its bucket at level ",
                                 level - 1, " held ", expected));
      }
    }
    if (!state->has_k) {
      state->has_k = true;
      state->k = request.k;
      state->k_from = shard;
    }
    round.requests[shard] = request;
    if (++round.arrived == num_shards_) {
      CompleteRoundLocked(state, level);
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<ThresholdResponse> ThresholdCoordinator::AwaitRoundLocked(
    ExchangeRound& round, uint32_t shard, const std::string& round_name,
    absl::Time deadline, const std::function<bool()>& cancelled) {
  while (round.phase == ExchangeRound::Phase::kCollecting) {
    // With a cancellation check, wake up every poll interval to look at it.
    changed_.WaitWithDeadline(
        &mu_,
        cancelled ? std::min(deadline, absl::Now() + kCancelPoll) : deadline);
    if (round.phase == ExchangeRound::Phase::kCollecting && cancelled &&
        cancelled()) {
      FailRoundLocked(
          &round, shard,
          absl::CancelledError(absl::StrCat(round_name, ": shard ", shard,
                                            "'s request was cancelled")),
          absl::AbortedError(
              absl::StrCat(round_name, ": shard ", shard,
                           " went away (its request was cancelled)")));
      break;
    }
    if (round.phase == ExchangeRound::Phase::kCollecting &&
        absl::Now() >= deadline) {
      std::vector<uint32_t> missing;
      for (uint32_t s = 0; s < num_shards_; ++s) {
        if (!round.requests[s].has_value()) missing.push_back(s);
      }
      const absl::Status late = absl::DeadlineExceededError(absl::StrCat(
          round_name, ": deadline exceeded waiting for shard",
          missing.size() == 1 ? " " : "s ", absl::StrJoin(missing, ", "), " (",
          round.arrived, " of ", num_shards_, " arrived)"));
      FailRoundLocked(&round, -1, late, late);
    }
  }
  if (round.phase == ExchangeRound::Phase::kComplete)
    return round.responses[shard];
  return round.FailureFor(shard);
}

absl::StatusOr<ThresholdResponse> LocalThresholdExchange::Exchange(
    const ThresholdRequest& request, absl::Time deadline) {
  return coordinator_->Submit(request, deadline);
}

// ---------------------------------------------------------------------------
// Shard-side driver

absl::Status DistributedThresholdTopK(const SparseVector& shard_sum, uint64_t k,
                                      int64_t step, uint32_t shard_id,
                                      ThresholdExchange* exchange,
                                      absl::Time deadline,
                                      SparseVector* selected, uint64_t epoch) {
  if (selected == nullptr) {
    return absl::InvalidArgumentError(
        "DistributedThresholdTopK: selected is null");
  }
  selected->clear();
  if (exchange == nullptr) {
    return absl::InvalidArgumentError(
        "DistributedThresholdTopK: exchange is null");
  }
  if (k == 0) {
    return absl::InvalidArgumentError(
        "DistributedThresholdTopK: k must be >= 1");
  }
  if (step < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("DistributedThresholdTopK: step ", step, " is negative"));
  }
  GTOPK_RETURN_IF_ERROR(ValidateSparseVector(shard_sum, kMaxDenseLength));

  const absl::Span<const float> values(shard_sum.values);
  uint32_t prefix = 0;
  for (uint32_t level = 0; level < kThresholdLevels; ++level) {
    const std::string where =
        absl::StrCat("threshold exchange step ", step, " level ", level,
                     " (shard ", shard_id, "): ");
    ThresholdRequest request;
    request.step = step;
    request.shard_id = shard_id;
    request.k = k;
    request.level = level;
    request.histogram = KeyHistogram(values, level, prefix);
    request.epoch = epoch;
    absl::StatusOr<ThresholdResponse> response =
        exchange->Exchange(request, deadline);
    if (!response.ok()) {
      return absl::Status(response.status().code(),
                          absl::StrCat(where, response.status().message()));
    }
    const ThresholdResponse& r = *response;
    if (r.step != step || r.level != level) {
      return absl::InternalError(absl::StrCat(where, "leader answered for ",
                                              RoundName(r.step, r.level)));
    }
    if (r.keep_all) {
      *selected = shard_sum;
      return absl::OkStatus();
    }
    if (!r.done) {
      if (level + 1 == kThresholdLevels ||
          r.bucket >= ThresholdBucketCount(level)) {
        return absl::InternalError(
            absl::StrCat(where, "leader's response is not final or its bucket ",
                         r.bucket, " is out of range"));
      }
      prefix = (prefix << kLevelBits[level]) | r.bucket;
      continue;
    }
    // Done: keys above the threshold, then the lowest-index ties.
    uint64_t ties_left = r.ties_to_keep;
    for (size_t j = 0; j < shard_sum.size(); ++j) {
      const uint32_t key = cpu::MagnitudeKey(shard_sum.values[j]);
      if (key > r.kth_key || (key == r.kth_key && ties_left > 0)) {
        if (key == r.kth_key) --ties_left;
        selected->push_back(shard_sum.indices[j], shard_sum.values[j]);
      }
    }
    if (ties_left != 0) {
      selected->clear();
      return absl::InternalError(absl::StrCat(
          where, "leader asked for ", r.ties_to_keep, " entries with key ",
          r.kth_key, ", this shard has only ", r.ties_to_keep - ties_left));
    }
    return absl::OkStatus();
  }
  return absl::InternalError(
      absl::StrCat("threshold exchange step ", step, " (shard ", shard_id,
                   "): not finished after ", kThresholdLevels, " levels"));
}

}  // namespace server
}  // namespace gtopk
