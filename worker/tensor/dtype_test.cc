#include "worker/tensor/dtype.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "gtest/gtest.h"

namespace colod {
namespace {

TEST(DType, NamesAndSizes) {
  EXPECT_EQ(SizeOf(DType::kBF16), 2u);
  EXPECT_EQ(SizeOf(DType::kI64), 8u);
  EXPECT_EQ(*ParseDType("f16"), DType::kF16);
  EXPECT_EQ(ParseDType("f8").status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(DType, F16KnownEncodings) {
  // Published binary16 encodings.
  EXPECT_EQ(FloatToF16(1.0f), 0x3c00);
  EXPECT_EQ(FloatToF16(-2.0f), 0xc000);
  EXPECT_EQ(FloatToF16(65504.0f), 0x7bff);                // largest normal
  EXPECT_EQ(FloatToF16(std::ldexp(1.0f, -14)), 0x0400);   // smallest normal
  EXPECT_EQ(FloatToF16(std::ldexp(1.0f, -24)), 0x0001);   // smallest subnormal
  EXPECT_EQ(FloatToF16(0.333333343f), 0x3555);
  EXPECT_EQ(FloatToF16(1e6f), 0x7c00);                    // inf
  EXPECT_EQ(FloatToF16(1.0f + std::ldexp(1.0f, -11)), 0x3c00);  // tie rounds to even
  EXPECT_EQ(FloatToF16(1.0f + 3 * std::ldexp(1.0f, -11)), 0x3c02);
  EXPECT_EQ(F16ToFloat(0x3555), 0.333251953125f);
  EXPECT_EQ(F16ToFloat(0x0001), std::ldexp(1.0f, -24));
  EXPECT_TRUE(std::isnan(F16ToFloat(FloatToF16(std::numeric_limits<float>::quiet_NaN()))));
}

TEST(DType, F16RoundTripsEveryFiniteValue) {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    if ((h & 0x7c00) == 0x7c00) continue;  // inf/NaN
    EXPECT_EQ(FloatToF16(F16ToFloat(static_cast<uint16_t>(h))), h) << h;
  }
}

TEST(DType, BF16RoundsToNearestEven) {
  EXPECT_EQ(FloatToBF16(1.0f), 0x3f80);
  EXPECT_EQ(BF16ToFloat(0x3f80), 1.0f);
  EXPECT_EQ(FloatToBF16(1.0f + std::ldexp(1.0f, -8)), 0x3f80);      // tie to even
  EXPECT_EQ(FloatToBF16(1.0f + 3 * std::ldexp(1.0f, -8)), 0x3f82);  // tie to even (up)
  for (uint32_t h = 0; h < 0x10000; ++h) {
    if ((h & 0x7f80) == 0x7f80) continue;
    EXPECT_EQ(FloatToBF16(BF16ToFloat(static_cast<uint16_t>(h))), h);
  }
}

// FirstNonFinite agrees with std::isfinite on every bf16 and f16 value and
// on f32 values across the whole range of bit patterns, and names the first
// such element of an array; integers have none.
TEST(DType, FirstNonFiniteAgreesWithIsfinite) {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const uint16_t bits = static_cast<uint16_t>(h);
    EXPECT_EQ(FirstNonFinite(DType::kBF16, &bits, 1), std::isfinite(BF16ToFloat(bits)) ? -1 : 0) << h;
    EXPECT_EQ(FirstNonFinite(DType::kF16, &bits, 1), std::isfinite(F16ToFloat(bits)) ? -1 : 0) << h;
  }
  for (uint64_t b = 0; b <= 0xffffffffull; b += 65521) {  // a prime stride: every exponent, many mantissas
    const uint32_t bits = static_cast<uint32_t>(b);
    float f;
    std::memcpy(&f, &bits, sizeof(f));
    EXPECT_EQ(FirstNonFinite(DType::kF32, &bits, 1), std::isfinite(f) ? -1 : 0) << bits;
  }
  const float lim = std::numeric_limits<float>::max();
  std::vector<float> v = {0.0f,
                          -0.0f,
                          lim,
                          -lim,
                          std::numeric_limits<float>::denorm_min(),
                          1.0f,
                          std::numeric_limits<float>::quiet_NaN(),
                          2.0f,
                          -std::numeric_limits<float>::infinity()};
  EXPECT_EQ(FirstNonFinite(DType::kF32, v.data(), static_cast<int64_t>(v.size())), 6);
  EXPECT_EQ(FirstNonFinite(DType::kF32, v.data(), 6), -1);
  v[6] = 3.0f;
  EXPECT_EQ(FirstNonFinite(DType::kF32, v.data(), static_cast<int64_t>(v.size())), 8);
  const int64_t ints[] = {-1, 0x7ff0000000000000, 0x7f800000};
  EXPECT_EQ(FirstNonFinite(DType::kI64, ints, 3), -1);
  EXPECT_EQ(FirstNonFinite(DType::kI32, ints, 6), -1);
}

}  // namespace
}  // namespace colod
