#include "kernels/philox.h"

#include <cmath>

#include "gtest/gtest.h"

namespace colod::kernels {
namespace {

// Known-answer vectors of Philox4x32-10 from the Random123 distribution
// (kat_vectors): counter, key -> output.
TEST(Philox, MatchesRandom123KnownAnswers) {
  struct Kat {
    Philox4x32 ctr;
    uint32_t k0, k1;
    Philox4x32 out;
  };
  const Kat kats[] = {
      {{{0, 0, 0, 0}}, 0, 0, {{0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8}}},
      {{{0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff}}, 0xffffffff, 0xffffffff,
       {{0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd}}},
      {{{0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344}}, 0xa4093822, 0x299f31d0,
       {{0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1}}},
  };
  for (const Kat& k : kats) {
    Philox4x32 got = Philox4x32_10(k.ctr, k.k0, k.k1);
    for (int i = 0; i < 4; ++i) EXPECT_EQ(got.v[i], k.out.v[i]) << std::hex << k.ctr.v[0] << " word " << i;
  }
}

TEST(Philox, UniformAndNormalStreamsHaveTheRightMoments) {
  const int n = 200000;
  double su = 0, sn = 0, sn2 = 0;
  for (int i = 0; i < n; ++i) {
    const float u = PhiloxUniform(42, i);
    ASSERT_GE(u, 0.0f);
    ASSERT_LT(u, 1.0f);
    su += u;
    const float z = PhiloxNormal(42, i);
    sn += z;
    sn2 += static_cast<double>(z) * z;
  }
  // Standard errors: uniform mean 1/sqrt(12n) ~ 6.5e-4, normal mean 1/sqrt(n) ~ 2.2e-3.
  EXPECT_NEAR(su / n, 0.5, 4e-3);
  EXPECT_NEAR(sn / n, 0.0, 1.2e-2);
  EXPECT_NEAR(sn2 / n, 1.0, 1.5e-2);
  EXPECT_NE(PhiloxNormal(42, 0), PhiloxNormal(43, 0));
  EXPECT_EQ(PhiloxNormal(42, 12345), PhiloxNormal(42, 12345));
}

}  // namespace
}  // namespace colod::kernels
