// The CPU twins of the tensor kernels on raw buffers, against values worked
// out by hand: strided copies with conversion, fills from the Philox streams,
// elementwise ops and sums.
#include "kernels/cpu/tensor_ops.h"

#include <cstdint>
#include <cstring>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/layer_ops.h"
#include "kernels/half.h"
#include "kernels/philox.h"

namespace colod::kernels::cpu {
namespace {

Layout Make(std::vector<int64_t> shape, std::vector<int64_t> strides) {
  Layout l;
  l.ndim = static_cast<int>(shape.size());
  for (int d = 0; d < l.ndim; ++d) {
    l.shape[d] = shape[d];
    l.strides[d] = strides[d];
  }
  return l;
}

TEST(Layouts, CoalescingKeepsTheWalkWithFewerDims) {
  // Contiguous [2, 3, 4] on both sides: one dim of 24 at stride 1.
  Layout a = Make({2, 3, 4}, {12, 4, 1}), b = Make({2, 3, 4}, {12, 4, 1});
  CoalesceLayouts(&a, &b);
  EXPECT_EQ(a.ndim, 1);
  EXPECT_EQ(a.shape[0], 24);
  EXPECT_EQ(a.strides[0], 1);
  EXPECT_EQ(b.strides[0], 1);
  // A narrowed middle dim ([2, 3 of 5, 4]) merges the inner two only where
  // both sides allow: the source rows are 20 apart, so dims 0 and 1 stay.
  a = Make({2, 3, 4}, {20, 4, 1});
  b = Make({2, 3, 4}, {12, 4, 1});
  CoalesceLayouts(&a, &b);
  ASSERT_EQ(a.ndim, 2);
  EXPECT_EQ(a.shape[0], 2);
  EXPECT_EQ(a.shape[1], 12);
  EXPECT_EQ(a.strides[0], 20);
  EXPECT_EQ(b.strides[0], 12);
  // A transpose ([3, 2] read from [2, 3]) keeps two dims; size-1 dims go.
  a = Make({1, 3, 1, 2}, {7, 1, 9, 3});
  b = Make({1, 3, 1, 2}, {6, 2, 2, 1});
  CoalesceLayouts(&a, &b);
  ASSERT_EQ(a.ndim, 2);
  EXPECT_EQ(a.strides[0], 1);
  EXPECT_EQ(a.strides[1], 3);
  EXPECT_EQ(b.strides[0], 2);
  // One element.
  a = Make({1, 1}, {5, 5});
  b = Make({1, 1}, {1, 1});
  CoalesceLayouts(&a, &b);
  EXPECT_EQ(a.ndim, 1);
  EXPECT_EQ(a.shape[0], 1);
}

TEST(CpuTensorOps, StridedCopyTransposesAndConverts) {
  // src is [2, 3] row-major; read it transposed as [3, 2] into a contiguous
  // bf16 buffer: dst[i][j] = src[j][i].
  const std::vector<float> src = {1.5f, -2.0f, 3.25f, 4.0f, 5.5f, -6.75f};
  std::vector<uint16_t> dst(6);
  ASSERT_TRUE(StridedCopy(0, src.data(), Make({3, 2}, {1, 3}), ElemType::kF32, dst.data(), Make({3, 2}, {2, 1}),
                          ElemType::kBF16)
                  .ok());
  const std::vector<float> want = {1.5f, 4.0f, -2.0f, 5.5f, 3.25f, -6.75f};  // exact in bf16
  for (int i = 0; i < 6; ++i) EXPECT_EQ(BF16ToFloat(dst[i]), want[i]) << i;
}

TEST(CpuTensorOps, StridedCopyIntToIntIsExactAndFloatToIntTruncates) {
  const std::vector<int64_t> big = {int64_t{1} << 40, -3};
  std::vector<int64_t> back(2);
  const Layout flat = Make({2}, {1});
  ASSERT_TRUE(StridedCopy(0, big.data(), flat, ElemType::kI64, back.data(), flat, ElemType::kI64).ok());
  EXPECT_EQ(back, big);
  const std::vector<float> f = {2.9f, -2.9f};
  std::vector<int32_t> i(2);
  ASSERT_TRUE(StridedCopy(0, f.data(), flat, ElemType::kF32, i.data(), flat, ElemType::kI32).ok());
  EXPECT_EQ(i, (std::vector<int32_t>{2, -2}));
}

TEST(CpuTensorOps, StridedCopyWalksEveryDimOfANarrowedView) {
  // A [2, 2, 3] view narrowed out of a [2, 4, 3] buffer (rows 1 and 2 of dim 1).
  std::vector<float> src(24);
  for (int i = 0; i < 24; ++i) src[i] = static_cast<float>(i);
  std::vector<float> dst(12);
  ASSERT_TRUE(StridedCopy(0, src.data() + 3, Make({2, 2, 3}, {12, 3, 1}), ElemType::kF32, dst.data(),
                          Make({2, 2, 3}, {6, 3, 1}), ElemType::kF32)
                  .ok());
  EXPECT_EQ(dst, (std::vector<float>{3, 4, 5, 6, 7, 8, 15, 16, 17, 18, 19, 20}));
  EXPECT_FALSE(StridedCopy(0, src.data(), Make({2}, {1}), ElemType::kF32, dst.data(), Make({3}, {1}),
                           ElemType::kF32)
                   .ok());
}

TEST(CpuTensorOps, FillBinaryScaleAndSum) {
  std::vector<float> u(5);
  ASSERT_TRUE(FillRandom(0, u.data(), ElemType::kF32, 5, 7, /*normal=*/false).ok());
  for (int i = 0; i < 5; ++i) EXPECT_EQ(u[i], PhiloxUniform(7, i));
  const std::vector<int32_t> a = {1, 2, 3}, b = {10, 20, 30};
  std::vector<int32_t> c(3);
  ASSERT_TRUE(Binary(0, BinaryOp::kSub, ElemType::kI32, a.data(), b.data(), c.data(), 3).ok());
  EXPECT_EQ(c, (std::vector<int32_t>{-9, -18, -27}));
  const std::vector<uint16_t> h = {FloatToF16(1.5f), FloatToF16(-2.0f)};
  std::vector<uint16_t> hs(2);
  ASSERT_TRUE(Scale(0, ElemType::kF16, h.data(), 3.0f, hs.data(), 2).ok());
  EXPECT_EQ(F16ToFloat(hs[0]), 4.5f);
  EXPECT_EQ(F16ToFloat(hs[1]), -6.0f);
  EXPECT_FALSE(Scale(0, ElemType::kI32, a.data(), 2.0f, c.data(), 3).ok());
  // i64 sums are exact in double up to 2^53, where a float round trip is not.
  const std::vector<int64_t> big = {(int64_t{1} << 40) + 1, 2};
  EXPECT_EQ(*Sum(0, ElemType::kI64, big.data(), 2), static_cast<double>((int64_t{1} << 40) + 3));
}

TEST(CpuLayerOps, HalfGemmWidensAndRoundsOnce) {
  // [1, 2] @ [2, 1] in f16: 1.5 * 2 + 0.25 * 4 = 4 exactly.
  const std::vector<uint16_t> a = {FloatToF16(1.5f), FloatToF16(0.25f)}, b = {FloatToF16(2.0f), FloatToF16(4.0f)};
  std::vector<uint16_t> c(1);
  ASSERT_TRUE(Gemm(0, ElemType::kF16, false, false, 1, 1, 2, a.data(), b.data(), c.data()).ok());
  EXPECT_EQ(F16ToFloat(c[0]), 4.0f);
  EXPECT_FALSE(Gemm(0, ElemType::kI32, false, false, 1, 1, 2, a.data(), b.data(), c.data()).ok());
}

}  // namespace
}  // namespace colod::kernels::cpu
