// Status propagation macros for absl::Status / absl::StatusOr.
#ifndef COLOD_COMMON_STATUS_MACROS_H_
#define COLOD_COMMON_STATUS_MACROS_H_

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define COLOD_STATUS_CONCAT_INNER_(a, b) a##b
#define COLOD_STATUS_CONCAT_(a, b) COLOD_STATUS_CONCAT_INNER_(a, b)

// Returns from the enclosing function if `expr` (an absl::Status) is not OK.
#define RETURN_IF_ERROR(expr)                             \
  do {                                                    \
    ::absl::Status colod_status_ = (expr);                \
    if (!colod_status_.ok()) return colod_status_;        \
  } while (0)

// `ASSIGN_OR_RETURN(auto x, FooOr());` declares x from the StatusOr's value, or
// returns its error from the enclosing function.
#define ASSIGN_OR_RETURN(lhs, expr) \
  COLOD_ASSIGN_OR_RETURN_IMPL_(COLOD_STATUS_CONCAT_(colod_statusor_, __LINE__), lhs, expr)

#define COLOD_ASSIGN_OR_RETURN_IMPL_(statusor, lhs, expr) \
  auto statusor = (expr);                                 \
  if (!statusor.ok()) return std::move(statusor).status(); \
  lhs = std::move(statusor).value()

#endif  // COLOD_COMMON_STATUS_MACROS_H_
