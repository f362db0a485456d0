#include "worker/tensor/tensor.h"

#include <numeric>

#include "gtest/gtest.h"
#include "kernels/device.h"
#include "kernels/philox.h"

namespace colod {
namespace {

Tensor Iota(const Shape& shape, DType dtype = DType::kF32) {
  std::vector<float> v(NumElements(shape));
  std::iota(v.begin(), v.end(), 1.0f);
  return *Tensor::FromFloats(shape, v, dtype);
}

TEST(Tensor, LayoutOfANewTensor) {
  Tensor t = Iota({2, 3, 4});
  EXPECT_EQ(t.numel(), 24);
  EXPECT_EQ(t.nbytes(), 96);
  EXPECT_EQ(t.strides(), (std::vector<int64_t>{12, 4, 1}));
  EXPECT_TRUE(t.is_contiguous());
  EXPECT_EQ(*t.Size(-1), 4);
  EXPECT_EQ(t.Size(3).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Tensor::Empty({2, -1}, DType::kF32).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Tensor::FromFloats({2, 2}, {1, 2, 3}).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(Tensor, NarrowIsAViewThatWritesThrough) {
  Tensor t = Iota({4, 5});
  Tensor col = *t.Narrow(1, 2, 2);  // columns 2..3
  EXPECT_FALSE(col.is_contiguous());
  EXPECT_TRUE(col.SharesStorageWith(t));
  // Element (r, c) of t is 1 + 5r + c.
  EXPECT_EQ(col.ToFloats(), (std::vector<float>{3, 4, 8, 9, 13, 14, 18, 19}));
  ASSERT_TRUE(col.CopyFrom(*Tensor::FromFloats({4, 2}, {0, 0, 0, 0, 0, 0, 0, 0})).ok());
  EXPECT_EQ(t.ToFloats()[2], 0.0f);
  EXPECT_EQ(t.ToFloats()[1], 2.0f);
  EXPECT_EQ(t.Narrow(1, 4, 2).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(Tensor, SelectDropsTheDimensionAndWritesThrough) {
  Tensor t = Iota({2, 3, 4});  // element (a, b, c) is 1 + 12a + 4b + c
  Tensor mid = *t.Select(1, 2);
  EXPECT_EQ(mid.shape(), (Shape{2, 4}));
  EXPECT_FALSE(mid.is_contiguous());
  EXPECT_TRUE(mid.SharesStorageWith(t));
  EXPECT_EQ(mid.ToFloats(), (std::vector<float>{9, 10, 11, 12, 21, 22, 23, 24}));
  EXPECT_EQ(t.Select(-1, 3)->ToFloats(), (std::vector<float>{4, 8, 12, 16, 20, 24}));
  EXPECT_TRUE(t.Select(0, 1)->is_contiguous());
  ASSERT_TRUE(mid.CopyFrom(*Tensor::Zeros({2, 4}, DType::kF32)).ok());
  EXPECT_EQ(t.ToFloats()[8], 0.0f);
  EXPECT_EQ(t.ToFloats()[7], 8.0f);
  EXPECT_EQ(t.Select(1, 3).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(t.Select(1, -1).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(t.Select(3, 0).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(Tensor, ChunkAndCatAreInverse) {
  Tensor t = Iota({6, 10});
  for (int64_t d : {0, 1}) {
    std::vector<Tensor> parts;
    for (int i = 0; i < 2; ++i) parts.push_back(*t.Chunk(d, 2, i));
    Tensor back = *Tensor::Cat(parts, d);
    EXPECT_EQ(back.shape(), t.shape());
    EXPECT_EQ(back.ToFloats(), t.ToFloats());
  }
  auto bad = t.Chunk(1, 3, 0);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("dim 1 of size 10"), absl::string_view::npos) << bad.status();
  EXPECT_NE(bad.status().message().find("3 equal parts"), absl::string_view::npos);
}

TEST(Tensor, TransposeThenContiguousMatchesIndexArithmetic) {
  Tensor t = Iota({3, 4, 5});
  Tensor tt = t.Transpose(0, 2)->Contiguous();  // shape [5, 4, 3]
  ASSERT_EQ(tt.shape(), (Shape{5, 4, 3}));
  std::vector<float> v = tt.ToFloats();
  for (int a = 0; a < 5; ++a)
    for (int b = 0; b < 4; ++b)
      for (int c = 0; c < 3; ++c) ASSERT_EQ(v[(a * 4 + b) * 3 + c], 1 + c * 20 + b * 5 + a);
  Tensor r = *t.Transpose(0, 1)->Reshape({12, 5});
  EXPECT_EQ(r.ToFloats()[5], 21.0f);  // row 1 of the transposed [4,3,5] is t[1,0,:]
  EXPECT_EQ(t.Reshape({7}).status().code(), absl::StatusCode::kInvalidArgument);
}

// ContiguousAs copies only when it must: the same storage for a contiguous
// tensor of the dtype, one copy for a view or another dtype.
TEST(Tensor, ContiguousAsCopiesOnlyWhenItMust) {
  const Tensor t = *Tensor::RandomNormal({3, 4}, 1);
  const Tensor same = *t.ContiguousAs(DType::kF32);
  EXPECT_EQ(same.raw_data(), t.raw_data());
  const Tensor view = *t.Transpose(0, 1);
  const Tensor copied = *view.ContiguousAs(DType::kF32);
  EXPECT_TRUE(copied.is_contiguous());
  EXPECT_NE(copied.raw_data(), t.raw_data());
  EXPECT_EQ(copied.ToFloats(), view.ToFloats());
  const Tensor half = *view.ContiguousAs(DType::kBF16);
  EXPECT_EQ(half.dtype(), DType::kBF16);
  EXPECT_EQ(half.ToBytes(), view.ToDType(DType::kBF16)->ToBytes());
}

TEST(Tensor, DTypesConvertAndRoundOnce) {
  Tensor t = *Tensor::FromFloats({3}, {1.0f, 1.0f + 1.0f / 256, 65504.0f});
  EXPECT_EQ(t.ToDType(DType::kBF16)->ToFloats(), (std::vector<float>{1.0f, 1.0f, 65536.0f}));
  EXPECT_EQ(t.ToDType(DType::kF16)->ToFloats(), (std::vector<float>{1.0f, 1.00390625f, 65504.0f}));
  Tensor ids = *Tensor::FromInt64s({2}, {int64_t{1} << 40, -7});
  EXPECT_EQ(ids.ToInt64s(), (std::vector<int64_t>{int64_t{1} << 40, -7}));
  EXPECT_EQ(ids.ToDType(DType::kI32)->ToInt64s()[1], -7);
  Tensor raw = *Tensor::FromBytes({2}, DType::kI32, t.Narrow(0, 0, 2)->ToBytes());
  EXPECT_EQ(raw.ToBytes(), t.Narrow(0, 0, 2)->ToBytes());
  EXPECT_EQ(Tensor::FromBytes({3}, DType::kI32, "abc").status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(Tensor, SeededInitIsThePhiloxStreamInRowMajorOrder) {
  Tensor g = *Tensor::RandomNormal({2, 3, 1}, 0);
  std::vector<float> v = g.ToFloats();
  for (int i = 0; i < 6; ++i) EXPECT_EQ(v[i], kernels::PhiloxNormal(0, i));
  // A shard of the global tensor is the matching slice of the same stream.
  Tensor shard = *g.Chunk(1, 3, 2);
  EXPECT_EQ(shard.ToFloats(), (std::vector<float>{v[2], v[5]}));
  EXPECT_EQ(Tensor::RandomNormal({2}, 0)->ToFloats(), Tensor::RandomNormal({2}, 0)->ToFloats());
  EXPECT_NE(Tensor::RandomNormal({2}, 0)->ToFloats(), Tensor::RandomNormal({2}, 1)->ToFloats());
  Tensor u = *Tensor::RandomUniform({1000}, 9, DType::kBF16);
  for (float x : u.ToFloats()) ASSERT_TRUE(x >= 0.0f && x <= 1.0f);
  EXPECT_FALSE(Tensor::RandomNormal({2}, 0, DType::kI64).ok());
}

TEST(Tensor, ElementwiseOpsAgainstScalarLoops) {
  Tensor a = *Tensor::RandomNormal({7, 9}, 1);
  Tensor b = *Tensor::RandomNormal({7, 9}, 2);
  std::vector<float> x = a.ToFloats(), y = b.ToFloats();
  std::vector<float> sum = Add(a, b)->ToFloats(), diff = Sub(a, b)->ToFloats(), prod = Mul(a, b)->ToFloats();
  double total = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    EXPECT_EQ(sum[i], x[i] + y[i]);
    EXPECT_EQ(diff[i], x[i] - y[i]);
    EXPECT_EQ(prod[i], x[i] * y[i]);
    total += x[i];
  }
  EXPECT_DOUBLE_EQ(SumAll(a), total);
  Tensor acc = a.Clone();
  ASSERT_TRUE(AddInPlace(acc, b).ok());
  EXPECT_EQ(acc.ToFloats(), sum);
  EXPECT_EQ(a.ToFloats(), x);  // the clone did not alias
  EXPECT_EQ(Scale(a, 2.0f)->ToFloats()[3], 2.0f * x[3]);
  auto mismatch = Add(a, *Tensor::Zeros({9, 7}, DType::kF32));
  EXPECT_EQ(mismatch.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(mismatch.status().message().find("[7, 9]"), absl::string_view::npos);
  Tensor i = *Tensor::FromInt64s({3}, {1, 2, 3});
  EXPECT_EQ(Mul(i, i)->ToInt64s(), (std::vector<int64_t>{1, 4, 9}));
}

TEST(Tensor, SumsOfSquaresAccumulateIntoOneF32) {
  // 1^2 + ... + n^2 = n(n+1)(2n+1)/6, over a strided view too.
  Tensor acc = *Tensor::Zeros({1}, DType::kF32);
  Tensor a = Iota({4, 5});  // 1 .. 20
  ASSERT_TRUE(AddSumOfSquares({a}, acc).ok());
  EXPECT_EQ(acc.ToFloats()[0], 20.0f * 21 * 41 / 6);
  ASSERT_TRUE(AddSumOfSquares({*a.Narrow(1, 4, 1)}, acc).ok());  // 5, 10, 15, 20
  EXPECT_EQ(acc.ToFloats()[0], 20.0f * 21 * 41 / 6 + 25 + 100 + 225 + 400);
  Tensor wrong = *Tensor::Zeros({2}, DType::kF32);
  EXPECT_EQ(AddSumOfSquares({a}, wrong).code(), absl::StatusCode::kInvalidArgument);
  Tensor ints = *Tensor::FromInt64s({2}, {1, 2});
  EXPECT_EQ(AddSumOfSquares({ints}, acc).code(), absl::StatusCode::kInvalidArgument);
  // A list is one sum: 1..20 and 1..3 (and an empty part) squared.
  Tensor list_acc = *Tensor::Zeros({1}, DType::kF32);
  ASSERT_TRUE(AddSumOfSquares({a, Iota({3}), *Tensor::Zeros({0}, DType::kF32)}, list_acc).ok());
  EXPECT_EQ(list_acc.ToFloats()[0], 20.0f * 21 * 41 / 6 + 14);
  ASSERT_TRUE(AddSumOfSquares({}, list_acc).ok());
  EXPECT_EQ(list_acc.ToFloats()[0], 20.0f * 21 * 41 / 6 + 14);
}

TEST(Tensor, SumToTensorAndBroadcastScalarStayOnTheDevice) {
  const Tensor a = Iota({4, 5});  // 1 .. 20
  Tensor sum = *SumToTensor(a);
  EXPECT_EQ(sum.shape(), Shape{});
  EXPECT_EQ(sum.ToFloats()[0], 210.0f);
  EXPECT_EQ(SumToTensor(*a.Narrow(1, 4, 1))->ToFloats()[0], 5.0f + 10 + 15 + 20);
  const Tensor b = *BroadcastScalar(sum, {2, 3}, DType::kBF16);
  EXPECT_EQ(b.dtype(), DType::kBF16);
  EXPECT_EQ(b.ToFloats(), std::vector<float>(6, 210.0f));
  EXPECT_EQ(BroadcastScalar(a, {2}, DType::kF32).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(SumToTensor(*Tensor::FromInt64s({1}, {3})).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(Tensor, ASizeOneSliceOfAContiguousTensorIsContiguousAndWritesThrough) {
  Tensor t = Iota({3, 4, 5});
  Tensor slice = *t.Narrow(0, 1, 1)->Narrow(1, 2, 1);  // [1, 1, 5] with the parent's strides
  EXPECT_TRUE(slice.is_contiguous());
  Tensor flat = *slice.Reshape({5});
  EXPECT_TRUE(flat.SharesStorageWith(t));
  ASSERT_TRUE(flat.CopyFrom(*Tensor::FromFloats({5}, {0, 0, 0, 0, 0})).ok());
  EXPECT_EQ(SumAll(*t.Narrow(0, 1, 1)->Narrow(1, 2, 1)), 0.0);
  EXPECT_FALSE(t.Narrow(2, 0, 2)->is_contiguous());
}

TEST(Tensor, HostStorageIsAlignedAndZerosAreZero) {
  for (int64_t n : {1, 3, 17, 1000}) {
    Tensor t = *Tensor::Zeros({n}, DType::kF32);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(t.raw_data()) % 64, 0u);
    EXPECT_EQ(SumAll(t), 0.0);
    EXPECT_EQ(t.device(), Device::Cpu());
  }
}

TEST(Tensor, CudaTensorsWithoutAUsableDeviceAreAClearError) {
  if (kernels::CudaDeviceCount() > 0) GTEST_SKIP() << "a CUDA device is present; cuda_tensor_test covers it";
  auto t = Tensor::Zeros({4}, DType::kF32, Device::Cuda(0));
  EXPECT_EQ(t.status().code(), absl::StatusCode::kFailedPrecondition) << t.status();
  EXPECT_NE(t.status().message().find(kernels::BuiltWithCuda() ? "cuda" : "built without CUDA"),
            absl::string_view::npos)
      << t.status();
  EXPECT_EQ(Tensor::RandomNormal({4}, 1, DType::kF32, Device::Cuda(0)).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(Tensor::FromFloats({1}, {1.0f})->To(Device::Cuda(0)).status().code(),
            absl::StatusCode::kFailedPrecondition);
}

// Shapes come from requests: a size whose bytes overflow int64, a rank past
// the kernels' layouts, or a negative dim is INVALID_ARGUMENT, never a crash
// or a wrapped-around allocation.
TEST(Tensor, HostileShapesAreInvalidArguments) {
  const int64_t big = int64_t{1} << 40;
  // A zero dim does not excuse the others (code that flattens leading dims
  // would overflow on them), whichever side of it they are.
  for (const Shape& shape :
       {Shape{big, big}, Shape{big, 1 << 22, 0}, Shape{0, big, big}, Shape(17, 1), Shape{4, -1}}) {
    for (auto made : {Tensor::Empty(shape, DType::kF32), Tensor::Zeros(shape, DType::kBF16)}) {
      EXPECT_EQ(made.status().code(), absl::StatusCode::kInvalidArgument) << ShapeToString(shape);
    }
  }
  // A zero dim beside large ones holds no bytes, and 16 dims are allowed.
  EXPECT_TRUE(Tensor::Empty({0, big, 1 << 10}, DType::kF32).ok());
  // Shapes are checked in the widest dtype: an empty i32 tensor whose i64
  // bytes overflow would abort its conversion (found by npy_fuzz).
  const Shape wide{4001, 1, 400, 1001001, 1, 1001, 201, 0, 6};
  EXPECT_EQ(Tensor::Empty(wide, DType::kI32).status().code(), absl::StatusCode::kInvalidArgument);
  auto deep = Tensor::Zeros(Shape(16, 1), DType::kF32);
  ASSERT_TRUE(deep.ok()) << deep.status();
  EXPECT_EQ(deep->ToFloats(), std::vector<float>{0.0f});
  EXPECT_EQ(Tensor::FromFloats({2, 2}, {1, 2, 3}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Tensor::FromFloats({3}, {1, 2, 3})->Reshape(Shape(17, 1)).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(Device, ParsesAndPrints) {
  EXPECT_EQ(ParseDevice("cpu")->ToString(), "cpu");
  EXPECT_EQ(*ParseDevice("cuda"), Device::Cuda(0));
  EXPECT_EQ(ParseDevice("cuda:3")->ToString(), "cuda:3");
  for (const char* bad : {"gpu", "cuda:", "cuda:-1", "cuda:x"}) {
    auto d = ParseDevice(bad);
    EXPECT_EQ(d.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(d.status().message().find(bad), absl::string_view::npos) << d.status();
  }
}

}  // namespace
}  // namespace colod
