// Membership (server/membership.h): the rank table, member tokens, step
// streams and reservations of one shard.
#include "server/membership.h"

#include <algorithm>
#include <cstdio>
#include <random>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "common/grpc_edge/grpc_edge.h"
#include "server/member_file.h"
#include "server/service_internal.h"

namespace gtopk {
namespace server {

using internal::AwaitPolled;
using internal::ContextDeadline;
using internal::kRankReleaseGrace;

namespace {

// A fresh member token: 64 random bits from the OS source, never 0. Not
// model state, so not seeded (runs stay bit-identical without it).
uint64_t NewMemberToken() {
  static std::random_device device;
  uint64_t token = 0;
  while (token == 0) {
    token = (static_cast<uint64_t>(device()) << 32) ^
            static_cast<uint64_t>(device());
  }
  return token;
}

// "--epochs is 3 here but 5 on the workers that joined first; ..." for the
// "--flag=value" words of `here` and `cluster` that differ (or the whole
// texts when they are not of that form).
std::string RunLengthDifferences(const std::string& here,
                                 const std::string& cluster) {
  auto parse = [](const std::string& text) {
    std::vector<std::pair<std::string, std::string>> out;
    for (absl::string_view word :
         absl::StrSplit(text, ' ', absl::SkipEmpty())) {
      const size_t eq = word.find('=');
      if (eq == absl::string_view::npos) continue;
      out.emplace_back(std::string(word.substr(0, eq)),
                       std::string(word.substr(eq + 1)));
    }
    return out;
  };
  const auto a = parse(here), b = parse(cluster);
  std::vector<std::string> diffs;
  for (const auto& [flag, value] : a) {
    for (const auto& [other_flag, other_value] : b) {
      if (flag == other_flag && value != other_value) {
        diffs.push_back(absl::StrCat(flag, " is ", value, " here but ",
                                     other_value,
                                     " on the workers that joined first"));
      }
    }
  }
  if (diffs.empty()) return "the settings differ";
  return absl::StrJoin(diffs, "; ");
}

}  // namespace

Membership::Membership(uint32_t shard_id, uint32_t num_workers,
                       std::string member_dir, absl::Duration step_timeout)
    : shard_id_(shard_id),
      num_workers_(num_workers),
      member_dir_(std::move(member_dir)),
      step_timeout_(step_timeout) {
  rank_given_.assign(num_workers_, false);
  member_token_.assign(num_workers_, 0);
  rank_reserved_until_.assign(num_workers_, absl::InfinitePast());
  gone_since_.assign(num_workers_, absl::InfiniteFuture());
  gone_failed_.assign(num_workers_, {-1, 0});
  live_streams_.resize(num_workers_);
}

void Membership::RestoreHolders(const std::vector<uint64_t>& tokens,
                                const std::string& run_length) {
  absl::MutexLock lock(&mu_);
  run_length_ = run_length;  // workers must still agree
  const absl::Time until =
      absl::Now() + internal::RankReclaimWindow(step_timeout_);
  for (uint32_t r = 0; r < num_workers_; ++r) {
    if (tokens[r] == 0) continue;
    // Not given yet: the holder takes it back with its token (Recover), or
    // anyone once the reservation ends.
    member_token_[r] = tokens[r];
    rank_reserved_until_[r] = until;
  }
}

void Membership::Close() {
  absl::MutexLock lock(&mu_);
  closed_ = true;
}

// ---------------------------------------------------------------------------
// Member tokens

absl::Status Membership::CheckToken(uint32_t worker, uint64_t token) const {
  absl::MutexLock lock(&mu_);
  return CheckTokenLocked(worker, token);
}

absl::Status Membership::CheckTokenLocked(uint32_t worker,
                                          uint64_t token) const {
  if (worker >= num_workers_) {
    return absl::InvalidArgumentError(absl::StrCat("unknown worker rank ",
                                                   worker, "; the cluster has ",
                                                   num_workers_, " workers"));
  }
  if (token == 0) {
    return absl::PermissionDeniedError(
        absl::StrCat("rank ", worker,
                     ": no member token (JoinResponse.member_token); only "
                     "the worker that joined as rank ",
                     worker, " may act as it"));
  }
  const uint64_t current = member_token_[worker];
  if (current == 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "rank ", worker,
        " has not joined leader shard 0 (never, or not since "
        "the leader restarted): Join first; a worker that held the rank "
        "re-registers it with Recover"));
  }
  if (token != current) {
    return absl::PermissionDeniedError(
        absl::StrCat("rank ", worker,
                     " is held by another worker: this member token is "
                     "not the rank's current one (a later Join of rank ",
                     worker, " replaced it, or it was never granted)"));
  }
  return absl::OkStatus();
}

std::optional<absl::Status> Membership::CheckTokenHere(uint32_t worker,
                                                       uint64_t token) const {
  absl::MutexLock lock(&mu_);
  if (is_leader() || worker >= num_workers_ || token == 0) {
    return CheckTokenLocked(worker, token);
  }
  if (member_token_[worker] == token) return absl::OkStatus();
  return std::nullopt;
}

void Membership::ConfirmToken(uint32_t worker, uint64_t token) {
  absl::MutexLock lock(&mu_);
  member_token_[worker] = token;
}

bool Membership::Knows(uint64_t rank, uint64_t token) const {
  if (rank >= num_workers_ || token == 0) return false;
  absl::MutexLock lock(&mu_);
  return member_token_[rank] == token;
}

absl::Status Membership::PersistLocked() {
  if (!is_leader() || member_dir_.empty()) return absl::OkStatus();
  return WriteMemberTokens(member_dir_, member_token_, run_length_);
}

// ---------------------------------------------------------------------------
// Join and Recover

bool Membership::RankLiveLocked(uint32_t r) const {
  // A worker restarting after a crash has no open stream (its connection
  // closed with it); one that still has one is another, live worker.
  for (grpc::ServerContext* stream : live_streams_[r]) {
    if (!stream->IsCancelled()) return true;
  }
  return false;
}

absl::StatusOr<Membership::Grant> Membership::Join(
    int64_t requested, const std::string& run_length,
    const grpc::ServerContext* context,
    absl::FunctionRef<absl::Status()> fix_n) {
  absl::MutexLock lock(&mu_);
  if (requested >= 0) {
    AwaitRankReleasedLocked(static_cast<uint32_t>(requested), context);
  }
  if (closed_) {
    return absl::UnavailableError(
        absl::StrCat("shard ", shard_id_, " is shutting down"));
  }
  if (!run_length.empty()) {
    const absl::Status agreed = AgreeRunLengthLocked(requested, run_length);
    if (!agreed.ok()) return agreed;
  }
  if (const absl::Status n = fix_n(); !n.ok()) return n;
  uint32_t rank = 0;
  if (requested >= 0) {
    rank = static_cast<uint32_t>(requested);
    const absl::Status free = CheckRequestedRankLocked(rank);
    if (!free.ok()) return free;
  } else {
    absl::StatusOr<uint32_t> free = FreeRankLocked();
    if (!free.ok()) return free.status();
    rank = *free;
  }
  absl::StatusOr<uint64_t> token = GrantLocked(rank);
  if (!token.ok()) return token.status();
  return Grant{rank, *token};
}

void Membership::AwaitRankReleasedLocked(uint32_t r,
                                         const grpc::ServerContext* context) {
  // The requested rank's streams get a short grace to end (a worker that
  // closed them a moment ago and joins again, whose cancellation this
  // server has not finished yet), within the call's deadline; a live
  // worker's stay open, and the rank is refused later. Ended means
  // unregistered, not only cancelled: a stream's end decides whether the
  // rank stays reserved for its holder (~Stream), and a cancelled stream
  // still in its round has not decided yet.
  auto released = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return closed_ || live_streams_[r].empty();
  };
  AwaitPolled(
      mu_, absl::Condition(&released),
      std::min(absl::Now() + kRankReleaseGrace, ContextDeadline(context)),
      context);
}

absl::Status Membership::AgreeRunLengthLocked(int64_t requested,
                                              const std::string& run_length) {
  // The run length binds the workers of one run: while another rank's
  // worker is connected, or reserved after a leader restart. With every
  // other rank free (a cluster resumed as a whole, e.g. with more --steps),
  // the first Join sets it afresh.
  bool others = false;
  for (uint32_t r = 0; r < num_workers_ && !others; ++r) {
    if (int64_t{r} == requested) continue;
    others = RankLiveLocked(r) || absl::Now() < rank_reserved_until_[r];
  }
  if (run_length_.empty() || !others) {
    run_length_ = run_length;
    return absl::OkStatus();
  }
  if (run_length == run_length_) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      "this worker's run length differs from the cluster's: ",
      RunLengthDifferences(run_length, run_length_), " (here: \"",
      BoundedStatusMessage(run_length), "\"; the workers that joined first: \"",
      run_length_,
      "\"); every worker must train the same schedule, or it stops "
      "early while the others wait for it. Start it with the same "
      "flags"));
}

absl::Status Membership::CheckRequestedRankLocked(uint32_t rank) const {
  if (!RankLiveLocked(rank) && !live_streams_[rank].empty()) {
    // Cancelled but still finishing its round (a worker that cut a failed
    // step short, or one that died mid-step): whether the rank stays its
    // holder's is decided when the stream ends.
    return absl::UnavailableError(absl::StrCat(
        "rank ", rank, "'s step stream on leader shard ", shard_id_,
        " was cancelled in the middle of a step and is still ending; "
        "its holder keeps the rank if it recovers; retry in a few "
        "seconds"));
  }
  if (!RankLiveLocked(rank) && absl::Now() < rank_reserved_until_[rank]) {
    // The rank's holder is alive and recovering (its step failed, or the
    // leader restarted and its member file names the holder): only it may
    // have the rank (Recover with its token) until the window ends.
    return absl::UnavailableError(absl::StrCat(
        "rank ", rank,
        " is held by a worker that is recovering (or that "
        "held it when leader shard ",
        shard_id_, " restarted); it stays reserved for its holder for another ",
        absl::FormatDuration(absl::Trunc(
            rank_reserved_until_[rank] - absl::Now(), absl::Seconds(1))),
        " (until it re-registers with its member token); retry later, or "
        "start this worker with another --rank"));
  }
  if (RankLiveLocked(rank)) {
    return absl::AlreadyExistsError(absl::StrCat(
        "rank ", rank,
        " is already taken by a live worker (it has an "
        "open PushPull stream on shard ",
        shard_id_,
        "); start this worker with another --rank, or stop the other "
        "one first"));
  }
  return absl::OkStatus();
}

absl::StatusOr<uint32_t> Membership::FreeRankLocked() const {
  // Free: never given since this leader started, and not reserved for the
  // holder its member file names (after a restart).
  const auto reserved = [&](uint32_t r) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return absl::Now() < rank_reserved_until_[r] && !RankLiveLocked(r);
  };
  uint32_t rank = 0;
  while (rank < num_workers_ && (rank_given_[rank] || reserved(rank))) {
    ++rank;
  }
  if (rank < num_workers_) return rank;
  // Ranks reserved for their holders after a leader restart free up when
  // their window ends: retry then (UNAVAILABLE), not never.
  absl::Time soonest = absl::InfiniteFuture();
  for (uint32_t r = 0; r < num_workers_; ++r) {
    if (!rank_given_[r] && reserved(r)) {
      soonest = std::min(soonest, rank_reserved_until_[r]);
    }
  }
  if (soonest != absl::InfiniteFuture()) {
    return absl::UnavailableError(absl::StrCat(
        "no rank is free: the ranks held when leader shard ", shard_id_,
        " restarted stay reserved for their holders ",
        "(the first for another ",
        absl::FormatDuration(
            absl::Trunc(soonest - absl::Now(), absl::Seconds(1))),
        ", until they re-register with their member tokens); retry "
        "later"));
  }
  return absl::ResourceExhaustedError(
      absl::StrCat("all ", num_workers_,
                   " ranks are taken; ask for a rank explicitly to "
                   "re-join"));
}

absl::StatusOr<uint64_t> Membership::GrantLocked(uint32_t rank) {
  // A new token per grant: the rank's earlier holder (gone) is superseded.
  const uint64_t previous = member_token_[rank];
  member_token_[rank] = NewMemberToken();
  // Durable before it is handed out: a leader restarted from its checkpoint
  // directory still knows the holder (server/member_file.h).
  if (const absl::Status saved = PersistLocked(); !saved.ok()) {
    member_token_[rank] = previous;
    return absl::UnavailableError(
        absl::StrCat("rank ", rank,
                     " not granted: the leader cannot record its member "
                     "token: ",
                     saved.message()));
  }
  rank_given_[rank] = true;
  rank_reserved_until_[rank] = absl::InfinitePast();
  return member_token_[rank];
}

absl::Status Membership::Reenter(uint32_t w, uint64_t token) {
  absl::MutexLock lock(&mu_);
  if (token != 0 && member_token_[w] == 0) {
    // No holder known (a leader without --checkpoint-dir restarted, so it
    // has no member file): the worker that held the rank re-enters with its
    // token, as a Join of the rank would.
    const bool given = rank_given_[w];
    member_token_[w] = token;
    rank_given_[w] = true;
    if (const absl::Status saved = PersistLocked(); !saved.ok()) {
      // Nothing changed: the rank stays free for a Join.
      member_token_[w] = 0;
      rank_given_[w] = given;
      return absl::UnavailableError(
          absl::StrCat("Recover: the leader cannot record rank ", w,
                       "'s member token: ", saved.message()));
    }
  }
  const absl::Status member = CheckTokenLocked(w, token);
  if (!member.ok()) {
    return absl::Status(member.code(),
                        absl::StrCat("Recover: ", member.message()));
  }
  // The holder is alive and recovering (after a leader restart: it
  // re-registers): the rank stays reserved for it through the recovery and
  // until it reopens its step stream, whatever a Join asks meanwhile
  // (issue 42).
  rank_given_[w] = true;
  rank_reserved_until_[w] =
      std::max(rank_reserved_until_[w],
               absl::Now() + internal::RankReclaimWindow(step_timeout_));
  return absl::OkStatus();
}

void Membership::Rereserve(uint32_t worker, uint64_t token) {
  absl::MutexLock lock(&mu_);
  if (member_token_[worker] != token) return;  // superseded
  rank_reserved_until_[worker] =
      std::max(rank_reserved_until_[worker],
               absl::Now() + internal::RankReclaimWindow(step_timeout_));
}

// ---------------------------------------------------------------------------
// Step streams

void Membership::Stream::RegisterLocked(uint32_t worker) {
  worker_ = worker;
  membership_->live_streams_[worker].push_back(context_);
  membership_->gone_since_[worker] = absl::InfiniteFuture();
}

bool Membership::Stream::RegisterFromMetadata(uint32_t rank, uint64_t token) {
  Membership& m = *membership_;
  absl::MutexLock lock(&membership_->mu_);
  if (!m.CheckTokenLocked(rank, token).ok()) return false;
  RegisterLocked(rank);
  // The holder is back: its live stream now keeps the rank.
  m.rank_reserved_until_[rank] = absl::InfinitePast();
  m.rank_given_[rank] = true;
  // Until its first push it does not hold up a drain.
  ++m.idle_streams_;
  idle_ = true;
  return true;
}

void Membership::Stream::Pushed(uint32_t worker) {
  if (worker_ >= 0 && !idle_) return;
  absl::MutexLock lock(&membership_->mu_);
  if (worker_ < 0) RegisterLocked(worker);
  if (idle_) {
    --membership_->idle_streams_;
    idle_ = false;
  }
}

Membership::Stream::~Stream() {
  if (worker_ < 0) return;
  Membership& m = *membership_;
  absl::MutexLock lock(&m.mu_);
  auto& live = m.live_streams_[worker_];
  live.erase(std::find(live.begin(), live.end(), context_));
  if (idle_) --m.idle_streams_;
  const bool cancelled = context_->IsCancelled();
  // Cancelled, not closed: the worker died or lost its connection, or it
  // cut a failed step short (another shard failed first).
  if (m.is_leader() && live.empty() && cancelled) {
    m.gone_since_[worker_] = absl::Now();
  }
  if (m.is_leader() && live.empty() && (!cancelled || in_round_)) {
    // Ended by this server (a failed round, a refused push), or cancelled
    // in the middle of a step (the worker cuts its leader stream short when
    // another shard failed): the worker is alive and about to Recover;
    // nobody else may take its rank meanwhile. A worker that died mid-step
    // costs its restart this much: its Join is UNAVAILABLE until then, and
    // Connect retries it. A stream cancelled between steps (the worker
    // ended, or died idle) reserves nothing.
    m.rank_reserved_until_[worker_] =
        std::max(m.rank_reserved_until_[worker_],
                 absl::Now() + internal::kRankRecoverHold);
  }
}

size_t Membership::PushingStreams() const {
  absl::MutexLock lock(&mu_);
  size_t streams = 0;
  for (const auto& live : live_streams_) streams += live.size();
  // Streams opened at a worker's Connect that never pushed: the worker
  // learns of the shutdown at its first push or connection attempt.
  return streams - static_cast<size_t>(idle_streams_);
}

void Membership::FailRoundsOfGoneWorkers(ShardAggregator& aggregator,
                                         const std::atomic<uint64_t>& epoch) {
  absl::MutexLock lock(&mu_);
  const absl::Time now = absl::Now();
  for (uint32_t r = 0; r < num_workers_; ++r) {
    if (now - gone_since_[r] < internal::kWorkerGoneGrace) continue;
    const std::optional<int64_t> step = aggregator.RoundAwaiting(r);
    if (!step.has_value()) continue;
    const std::pair<int64_t, uint64_t> attempt{*step, epoch.load()};
    if (gone_failed_[r] == attempt) continue;
    gone_failed_[r] = attempt;
    const absl::Status reason = absl::UnavailableError(absl::StrCat(
        "worker ", r, " is gone: its step stream to leader shard ", shard_id_,
        " closed ",
        absl::FormatDuration(
            absl::Trunc(now - gone_since_[r], absl::Milliseconds(100))),
        " ago (the process died or lost its connection) and it has not "
        "come back; step ",
        *step, " cannot complete without it (restart it: it re-joins as rank ",
        r, ")"));
    std::fprintf(stderr, "gtopk-server leader: %s\n",
                 std::string(reason.message()).c_str());
    // RejectPush takes only the aggregator's own lock.
    aggregator.RejectPush(*step, r, reason);
  }
}

void Membership::KeepOnlyLiveMembers() {
  if (!is_leader() || member_dir_.empty()) return;
  absl::MutexLock lock(&mu_);
  // Workers that stopped just before this shutdown may have closed their
  // streams a moment ago without this server having seen it yet: give the
  // streams up to kWorkerGoneGrace to end (a worker that stays connected,
  // a rolling restart, keeps its stream open through it).
  const auto none_open = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    for (const auto& streams : live_streams_) {
      for (grpc::ServerContext* stream : streams) {
        if (!stream->IsCancelled()) return false;
      }
    }
    return true;
  };
  AwaitPolled(mu_, absl::Condition(&none_open),
              absl::Now() + internal::kWorkerGoneGrace, nullptr);
  std::vector<uint64_t> live(num_workers_, 0);
  for (uint32_t r = 0; r < num_workers_; ++r) {
    for (grpc::ServerContext* stream : live_streams_[r]) {
      if (!stream->IsCancelled()) live[r] = member_token_[r];
    }
  }
  const absl::Status saved = WriteMemberTokens(member_dir_, live, run_length_);
  if (!saved.ok()) {
    std::fprintf(stderr, "gtopk-server leader: member file at shutdown: %s\n",
                 saved.ToString().c_str());
  }
}

}  // namespace server
}  // namespace gtopk
