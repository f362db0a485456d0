#include "worker/tensor/dtype.h"

#include <cmath>
#include <limits>

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

}  // namespace
}  // namespace colod
