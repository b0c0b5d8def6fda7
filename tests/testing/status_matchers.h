// GoogleTest matchers and assertions for absl::Status / absl::StatusOr.
// Debian's Abseil 20220623 ships none, so they are defined once, here.
#ifndef GTOPK_TESTS_TESTING_STATUS_MATCHERS_H_
#define GTOPK_TESTS_TESTING_STATUS_MATCHERS_H_

#include <ostream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace gtopk {
namespace testing {

inline const absl::Status& GetStatus(const absl::Status& status) {
  return status;
}
template <typename T>
const absl::Status& GetStatus(const absl::StatusOr<T>& status_or) {
  return status_or.status();
}

// EXPECT_THAT(status_or_statusor, IsOk());
MATCHER(IsOk, "is OK") {
  const absl::Status& s = ::gtopk::testing::GetStatus(arg);
  if (!s.ok()) *result_listener << "status is " << s;
  return s.ok();
}

// EXPECT_THAT(s, StatusIs(absl::StatusCode::kInvalidArgument,
//                         ::testing::HasSubstr("position 3")));
MATCHER_P2(StatusIs, code, message_matcher,
           std::string("has code ") + absl::StatusCodeToString(code)) {
  const absl::Status& s = ::gtopk::testing::GetStatus(arg);
  *result_listener << "status is " << s;
  return s.code() == code &&
         ::testing::Matches(message_matcher)(std::string(s.message()));
}

// EXPECT_THAT(s, StatusIs(absl::StatusCode::kNotFound));  (any message)
MATCHER_P(StatusIs, code,
          std::string("has code ") + absl::StatusCodeToString(code)) {
  const absl::Status& s = ::gtopk::testing::GetStatus(arg);
  *result_listener << "status is " << s;
  return s.code() == code;
}

// EXPECT_THAT(status_or, IsOkAndHolds(Eq(3)));  the value is matched only
// when the status is OK (never dereferenced otherwise).
MATCHER_P(IsOkAndHolds, value_matcher, "is OK and holds a matching value") {
  if (!arg.ok()) {
    *result_listener << "status is " << arg.status();
    return false;
  }
  return ::testing::ExplainMatchResult(value_matcher, *arg, result_listener);
}

// The value of `status_or`, for a test helper that returns a value and so
// cannot ASSERT. On an error it throws std::runtime_error naming `what` and
// the status: GoogleTest reports that as the running test's failure ("C++
// exception ... thrown in the test body") and goes on with the next test,
// where dereferencing the error would crash the whole binary. Call it on
// the test's own thread.
template <typename T>
T OkOrThrow(absl::StatusOr<T> status_or, std::string_view what) {
  if (!status_or.ok()) {
    throw std::runtime_error(std::string(what) + ": " +
                             status_or.status().ToString());
  }
  return *std::move(status_or);
}

}  // namespace testing
}  // namespace gtopk

#define GTOPK_EXPECT_OK(expr) EXPECT_THAT((expr), ::gtopk::testing::IsOk())
#define GTOPK_ASSERT_OK(expr) ASSERT_THAT((expr), ::gtopk::testing::IsOk())

// GTOPK_ASSERT_OK_AND_ASSIGN(auto x, StatusOrExpr);
#define GTOPK_ASSERT_OK_AND_ASSIGN(lhs, expr) \
  GTOPK_ASSERT_OK_AND_ASSIGN_IMPL_(           \
      GTOPK_TESTING_CONCAT_(gtopk_statusor_, __LINE__), lhs, expr)
#define GTOPK_TESTING_CONCAT_INNER_(a, b) a##b
#define GTOPK_TESTING_CONCAT_(a, b) GTOPK_TESTING_CONCAT_INNER_(a, b)
#define GTOPK_ASSERT_OK_AND_ASSIGN_IMPL_(statusor, lhs, expr) \
  auto statusor = (expr);                                     \
  ASSERT_TRUE(statusor.ok()) << statusor.status();            \
  lhs = *std::move(statusor)

#endif  // GTOPK_TESTS_TESTING_STATUS_MATCHERS_H_
