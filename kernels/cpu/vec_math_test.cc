// VecExp and VecTanh against the double-precision functions over a dense
// sweep of their ranges (the accuracy vec_math.h states), and their limits.
#include "kernels/cpu/vec_math.h"

#include <cmath>

#include "gtest/gtest.h"

namespace colod::kernels::cpu {
namespace {

TEST(VecMath, ExpIsWithin2UlpOfExpOverItsRange) {
  double worst = 0;
  for (float x = -87.0f; x <= 88.0f; x += 0.00137f) {
    const double want = std::exp(static_cast<double>(x));
    const double ulp = std::nextafter(static_cast<float>(want), INFINITY) - static_cast<float>(want);
    worst = std::max(worst, std::abs(VecExp(x) - want) / ulp);
  }
  EXPECT_LE(worst, 2.0);
  // Clamped past the normal range, never inf or a denormal.
  EXPECT_FLOAT_EQ(VecExp(1000.0f), VecExp(88.0f));
  EXPECT_FLOAT_EQ(VecExp(-1000.0f), VecExp(-87.0f));
  EXPECT_GT(VecExp(-1000.0f), 0.0f);
  EXPECT_EQ(VecExp(0.0f), 1.0f);
}

TEST(VecMath, TanhIsWithin2e7OfTanhAbsolutely) {
  double worst = 0;
  for (float x = -12.0f; x <= 12.0f; x += 0.000271f) {
    worst = std::max(worst, std::abs(VecTanh(x) - std::tanh(static_cast<double>(x))));
  }
  EXPECT_LE(worst, 2e-7);
  for (float x : {10.0f, 20.0f, 100.0f, 1e30f}) {
    EXPECT_EQ(VecTanh(x), 1.0f) << x;
    EXPECT_EQ(VecTanh(-x), -1.0f) << x;
  }
  EXPECT_EQ(VecTanh(0.0f), 0.0f);
}

}  // namespace
}  // namespace colod::kernels::cpu
