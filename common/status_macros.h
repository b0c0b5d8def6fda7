// Status propagation macros. Debian's Abseil (20220623) ships neither
// RETURN_IF_ERROR nor ASSIGN_OR_RETURN, so they are defined once, here.
#ifndef GTOPK_COMMON_STATUS_MACROS_H_
#define GTOPK_COMMON_STATUS_MACROS_H_

#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

// Evaluates `expr` (an absl::Status); returns it from the enclosing function
// when it is not OK.
#define GTOPK_RETURN_IF_ERROR(expr)                \
  do {                                             \
    ::absl::Status gtopk_status_ = (expr);         \
    if (!gtopk_status_.ok()) return gtopk_status_; \
  } while (false)

#define GTOPK_STATUS_CONCAT_INNER_(a, b) a##b
#define GTOPK_STATUS_CONCAT_(a, b) GTOPK_STATUS_CONCAT_INNER_(a, b)

// `GTOPK_ASSIGN_OR_RETURN(lhs, expr)`: evaluates `expr` (an absl::StatusOr<T>);
// on error returns its status, otherwise move-assigns the value to `lhs`
// (which may be a declaration, e.g. `auto x`).
#define GTOPK_ASSIGN_OR_RETURN(lhs, expr) \
  GTOPK_ASSIGN_OR_RETURN_IMPL_(           \
      GTOPK_STATUS_CONCAT_(gtopk_statusor_, __LINE__), lhs, expr)
#define GTOPK_ASSIGN_OR_RETURN_IMPL_(statusor, lhs, expr)  \
  auto statusor = (expr);                                  \
  if (!statusor.ok()) return std::move(statusor).status(); \
  lhs = *std::move(statusor)

#endif  // GTOPK_COMMON_STATUS_MACROS_H_
