// Integer arithmetic on sizes that come from input: every shape, element
// count and byte size derived from a file, a request or a config goes
// through the checked helpers here (one place), so that a crafted size is an
// error instead of a wrapped product that passes a size check.
#ifndef COLOD_COMMON_INT_MATH_H_
#define COLOD_COMMON_INT_MATH_H_

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/types/span.h"

namespace colod {

// The integer r >= 1 with r^k == n, or 0 if n is not a perfect k-th power
// (used for the q of 2D/2.5D/3D meshes: tp = q^2, tp/d = q^2, tp = q^3).
inline int IntegerRoot(int n, int k) {
  if (n < 1 || k < 1) return 0;
  for (int r = 1;; ++r) {
    long long p = 1;
    for (int i = 0; i < k; ++i) p *= r;
    if (p == n) return r;
    if (p > n) return 0;
  }
}

// a * b, or nullopt when it overflows int64.
inline std::optional<int64_t> CheckedMul(int64_t a, int64_t b) {
  int64_t r = 0;
  if (__builtin_mul_overflow(a, b, &r)) return std::nullopt;
  return r;
}

// a + b, or nullopt when it overflows int64.
inline std::optional<int64_t> CheckedAdd(int64_t a, int64_t b) {
  int64_t r = 0;
  if (__builtin_add_overflow(a, b, &r)) return std::nullopt;
  return r;
}

// The bytes of a shape of `element_bytes`-byte elements (>= 1): nullopt
// for a negative dim, or when the product of the non-zero dims (times the
// element size) overflows int64. An empty shape like (2^62, 16, 0) is
// refused too: code that flattens leading dims would overflow on it.
inline std::optional<int64_t> CheckedBytes(absl::Span<const int64_t> dims, int64_t element_bytes) {
  if (element_bytes < 1) return std::nullopt;
  int64_t bytes = element_bytes;
  bool empty = false;
  for (int64_t d : dims) {
    if (d < 0) return std::nullopt;
    if (d == 0) {
      empty = true;
      continue;
    }
    const std::optional<int64_t> p = CheckedMul(bytes, d);
    if (!p.has_value()) return std::nullopt;
    bytes = *p;
  }
  return empty ? 0 : bytes;
}

// The number of elements of a shape: the product of `dims` (1 for none),
// refused as CheckedBytes refuses.
inline std::optional<int64_t> CheckedProduct(absl::Span<const int64_t> dims) { return CheckedBytes(dims, 1); }

// A sum of products of sizes, checked: once a product or the sum overflows
// int64 the sum stays overflowed, and Total says so. Not thread-safe.
class CheckedSum {
 public:
  // Adds the product of `factors` (CheckedProduct's rules).
  void Add(std::initializer_list<int64_t> factors) {
    const std::optional<int64_t> p = CheckedProduct(factors);
    const std::optional<int64_t> s = p.has_value() ? CheckedAdd(total_, *p) : std::nullopt;
    if (!s.has_value()) overflow_ = true;
    if (!overflow_) total_ = *s;
  }
  void Add(const CheckedSum& other) {
    overflow_ |= other.overflow_;
    Add({other.total_});
  }
  // The sum; INVALID_ARGUMENT "`what` overflows a 64-bit count" after an overflow.
  absl::StatusOr<int64_t> Total(const std::string& what) const {
    if (overflow_) return absl::InvalidArgumentError(absl::StrCat(what, " overflows a 64-bit count"));
    return total_;
  }

 private:
  int64_t total_ = 0;
  bool overflow_ = false;
};

}  // namespace colod

#endif  // COLOD_COMMON_INT_MATH_H_
