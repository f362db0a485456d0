// The checked helpers against 128-bit arithmetic (the independent reference)
// on edge cases and random factors around the int64 limit.
#include "common/int_math.h"

#include <limits>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace colod {
namespace {

constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
constexpr int64_t kMin = std::numeric_limits<int64_t>::min();

std::optional<int64_t> Reference(const std::vector<int64_t>& dims, int64_t element_bytes) {
  __int128 nonzero = element_bytes;
  bool empty = false;
  for (int64_t d : dims) {
    if (d < 0) return std::nullopt;
    if (d == 0) {
      empty = true;
      continue;
    }
    nonzero *= d;
    if (nonzero > kMax) return std::nullopt;
  }
  return empty ? 0 : static_cast<int64_t>(nonzero);
}

TEST(IntMath, MulAndAddAtTheLimits) {
  EXPECT_EQ(CheckedMul(kMax, 1), kMax);
  EXPECT_EQ(CheckedMul(kMax, 2), std::nullopt);
  EXPECT_EQ(CheckedMul(int64_t{1} << 31, int64_t{1} << 31), int64_t{1} << 62);
  EXPECT_EQ(CheckedMul(int64_t{1} << 32, int64_t{1} << 31), std::nullopt);
  EXPECT_EQ(CheckedMul(kMin, -1), std::nullopt);
  EXPECT_EQ(CheckedAdd(kMax, 0), kMax);
  EXPECT_EQ(CheckedAdd(kMax, 1), std::nullopt);
  EXPECT_EQ(CheckedAdd(kMin, -1), std::nullopt);
}

TEST(IntMath, TheIssuesShapes) {
  // (2^62, 16) wraps to 0 elements in plain int64 arithmetic.
  EXPECT_EQ(CheckedProduct({int64_t{1} << 62, 16}), std::nullopt);
  EXPECT_EQ(CheckedBytes({int64_t{1} << 62, 16}, 8), std::nullopt);
  EXPECT_EQ(CheckedProduct({int64_t{4611686018427387904}, 16}), std::nullopt);
  // 2^60 elements fit, and so do their 4-byte bytes; 8-byte ones do not.
  EXPECT_EQ(CheckedProduct({int64_t{1} << 58, 4}), int64_t{1} << 60);
  EXPECT_EQ(CheckedBytes({int64_t{1} << 58, 4}, 8), std::nullopt);
  EXPECT_EQ(CheckedBytes({int64_t{1} << 58, 4}, 4), int64_t{1} << 62);
  EXPECT_EQ(CheckedBytes({int64_t{1} << 58, 4}, 2), int64_t{1} << 61);
  // Empty shapes are empty unless their other dims overflow.
  EXPECT_EQ(CheckedProduct({}), 1);
  EXPECT_EQ(CheckedProduct({7, 0, 3}), 0);
  EXPECT_EQ(CheckedProduct({int64_t{1} << 62, 16, 0}), std::nullopt);
  EXPECT_EQ(CheckedProduct({3, -1}), std::nullopt);
  EXPECT_EQ(CheckedBytes({2, 3}, 0), std::nullopt);
}

TEST(IntMath, RandomShapesAgreeWithInt128) {
  std::mt19937_64 rng(17);
  for (int i = 0; i < 200000; ++i) {
    std::vector<int64_t> dims(rng() % 6);
    for (int64_t& d : dims) {
      const int bits = static_cast<int>(rng() % 40);
      d = static_cast<int64_t>(rng() & ((uint64_t{1} << bits) - 1));
      if (rng() % 50 == 0) d = -d - 1;
    }
    const int64_t es = static_cast<int64_t>(1 + rng() % 8);
    const std::optional<int64_t> want_n = Reference(dims, 1), want_b = Reference(dims, es);
    ASSERT_EQ(CheckedProduct(dims), want_n) << i;
    ASSERT_EQ(CheckedBytes(dims, es), want_b) << i;
  }
}

}  // namespace
}  // namespace colod
