#include "worker/trainer/recovery.h"

#include <algorithm>
#include <cstdio>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "common/status_macros.h"

namespace gtopk {
namespace worker {
namespace {

std::string Seconds(absl::Duration d) {
  return absl::StrFormat("%.1f s", absl::ToDoubleSeconds(d));
}

}  // namespace

absl::StatusOr<int64_t> Recovery::AfterFailure(absl::Status failure,
                                               const std::string& what) {
  const absl::Time now = absl::Now();
  if (!failing_) {
    failing_ = true;
    first_failure_ = now;
    recover_calls_ = 0;
  }
  // A budget > 0 always leaves room for one Recover call.
  const absl::Time deadline =
      first_failure_ + (budget_ > absl::ZeroDuration()
                            ? std::max(budget_, recover_call_time_)
                            : absl::ZeroDuration());
  bool from_recover = false;
  const bool step_precondition =
      failure.code() == absl::StatusCode::kFailedPrecondition;
  for (;;) {
    const absl::StatusCode code = failure.code();
    // FAILED_PRECONDITION from a step means shards at different steps
    // once: one Recover brings them together. The same code again after
    // that is a state no retry changes (a step whose update would not be
    // finite, a configuration that differs): end the run with it now
    // rather than at the end of the budget.
    const bool precondition_again =
        code == absl::StatusCode::kFailedPrecondition && !from_recover &&
        precondition_recovered_;
    const bool retryable = code == absl::StatusCode::kAborted ||
                           code == absl::StatusCode::kDeadlineExceeded ||
                           code == absl::StatusCode::kUnavailable ||
                           code == absl::StatusCode::kCancelled ||
                           (code == absl::StatusCode::kFailedPrecondition &&
                            !from_recover && !precondition_again);
    const absl::Duration elapsed = absl::Now() - first_failure_;
    // No Recover call unless it can get the leader's full answer (the
    // leader waits up to one step timeout for the shards).
    // A budget > 0 always allows the first call, even one shorter than a
    // call's time (issue 42's break-it run: --recovery-timeout=20s with the
    // default 30 s step timeout ended every worker at its first failure,
    // with 0 Recover calls).
    const bool out_of_time =
        budget_ <= absl::ZeroDuration() ||
        (recover_calls_ > 0 && deadline - absl::Now() < recover_call_time_);
    if (!retryable || out_of_time) {
      std::string why;
      if (retryable && budget_ <= absl::ZeroDuration()) {
        why = " (--recovery-timeout=0: no recovery)";
      } else if (retryable) {
        why = absl::StrCat(" (no recovery within --recovery-timeout=",
                           absl::FormatDuration(budget_), ": ",
                           Seconds(elapsed), " since the first failure, ",
                           recover_calls_, " Recover call(s))");
      } else if (precondition_again) {
        why = absl::StrCat(" (again after a recovery: not a step mismatch; ",
                           Seconds(elapsed), " since the first failure)");
      } else if (recover_calls_ > 0) {
        why = absl::StrCat(" (after ", Seconds(elapsed), " and ",
                           recover_calls_, " Recover call(s))");
      }
      return absl::Status(
          code,
          absl::StrCat(what, ": ", from_recover ? "recovery failed: " : "",
                       failure.message(), why));
    }
    std::fprintf(stderr,
                 "rank %u: %s failed: %s; recovering (%s since the first "
                 "failure, %s left, Recover call %d)\n",
                 rank_, what.c_str(), failure.ToString().c_str(),
                 Seconds(elapsed).c_str(),
                 Seconds(deadline - absl::Now()).c_str(), recover_calls_ + 1);
    // Backoff 100 ms doubling to 1.6 s, leaving a Recover call its time.
    absl::SleepFor(
        std::min(absl::Milliseconds(100 << std::min(recover_calls_, 4)),
                 std::max(absl::ZeroDuration(),
                          deadline - recover_call_time_ - absl::Now())));
    ++recover_calls_;
    // --device=cuda: the device parameters are the current ones; Recover
    // works on the host copy (and may re-download it), then back.
    GTOPK_RETURN_IF_ERROR(model_.DownloadParams());
    absl::StatusOr<int64_t> next = client_.Recover(
        params_, std::max(deadline, absl::Now() + recover_call_time_));
    if (next.ok()) {
      GTOPK_RETURN_IF_ERROR(model_.UploadParams());
      if (step_precondition) precondition_recovered_ = true;
      return *next;
    }
    failure = next.status();
    from_recover = true;
  }
}

}  // namespace worker
}  // namespace gtopk
