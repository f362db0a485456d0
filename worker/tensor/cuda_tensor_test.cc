// CUDA tensors against their CPU twins. Runs where a GPU is present and skips
// elsewhere; built only where the toolkit is (bazel/cuda.bzl).
#include <cmath>
#include <cstring>

#include "gtest/gtest.h"
#include "kernels/device.h"
#include "worker/tensor/autograd.h"
#include "worker/tensor/tensor.h"

namespace colod {
namespace {

class CudaTensor : public ::testing::Test {
 protected:
  void SetUp() override {
    if (kernels::CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  }
  const Device gpu_ = Device::Cuda(0);
};

uint32_t Bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}

TEST_F(CudaTensor, SeededUniformIsBitwiseTheSameOnBothDevices) {
  for (DType t : {DType::kF32, DType::kBF16, DType::kF16}) {
    const Shape shape = {1031, 1017};  // not a multiple of any block size
    auto cpu = Tensor::RandomUniform(shape, 42, t);
    auto gpu = Tensor::RandomUniform(shape, 42, t, gpu_);
    ASSERT_TRUE(cpu.ok() && gpu.ok()) << gpu.status();
    EXPECT_EQ(gpu->device(), gpu_);
    EXPECT_EQ(gpu->ToBytes(), cpu->ToBytes()) << DTypeName(t);
  }
}

TEST_F(CudaTensor, SeededNormalMatchesTheHostToTheLastBit) {
  // Box-Muller in double rounded once to float: the device's double log/cos
  // may differ from glibc's by an ulp of a double, which changes the float
  // only at a rounding tie; allow one float ulp and expect almost all exact.
  const Shape shape = {1 << 20};
  std::vector<float> cpu = Tensor::RandomNormal(shape, 7)->ToFloats();
  std::vector<float> gpu = Tensor::RandomNormal(shape, 7, DType::kF32, gpu_)->ToFloats();
  ASSERT_EQ(cpu.size(), gpu.size());
  int64_t exact = 0;
  for (size_t i = 0; i < cpu.size(); ++i) {
    const int64_t d = static_cast<int64_t>(Bits(cpu[i])) - static_cast<int64_t>(Bits(gpu[i]));
    ASSERT_LE(std::llabs(d), 1) << "element " << i << ": " << cpu[i] << " vs " << gpu[i];
    exact += d == 0;
  }
  EXPECT_GE(exact, static_cast<int64_t>(cpu.size()) - 16);
}

TEST_F(CudaTensor, ViewsCopiesAndConversionsMatchTheHost) {
  const Tensor host = *Tensor::RandomNormal({6, 10, 7}, 3);
  auto dev = host.To(gpu_);
  ASSERT_TRUE(dev.ok()) << dev.status();
  // A strided view made contiguous on the device.
  const Tensor hv = *host.Transpose(0, 2)->Narrow(1, 3, 5);
  const Tensor dv = *dev->Transpose(0, 2)->Narrow(1, 3, 5);
  EXPECT_FALSE(dv.is_contiguous());
  EXPECT_EQ(dv.Contiguous().ToFloats(), hv.ToFloats());
  EXPECT_EQ(dv.Contiguous().device(), gpu_);
  for (DType t : {DType::kF32, DType::kBF16, DType::kF16, DType::kI32, DType::kI64}) {
    Tensor scaled = *Scale(host, 100.0f);
    auto want = scaled.Transpose(1, 2)->ToDType(t);
    auto got = scaled.To(gpu_)->Transpose(1, 2)->ToDType(t);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(got->device(), gpu_);
    EXPECT_EQ(got->ToBytes(), want->ToBytes()) << DTypeName(t);
  }
  // Contiguous conversions (the vectorized kernels), from aligned and
  // unaligned starts and of lengths that are not a multiple of 4.
  for (int64_t start : {0, 1, 3}) {
    for (int64_t n : {1, 5, 403}) {
      const Tensor part = *Scale(*host.Reshape({420}), 3.0f)->Narrow(0, start, n);
      for (DType t : {DType::kBF16, DType::kF16}) {
        const Tensor down = *part.To(gpu_)->ToDType(t);
        EXPECT_EQ(down.ToBytes(), part.ToDType(t)->ToBytes()) << DTypeName(t) << " " << start << "+" << n;
        const Tensor dh = *part.ToDType(t);
        const Tensor up = *dh.To(gpu_)->Narrow(0, 0, n)->ToDType(DType::kF32);
        EXPECT_EQ(up.ToBytes(), dh.ToDType(DType::kF32)->ToBytes()) << DTypeName(t) << " " << start << "+" << n;
        if (n > 2) {  // from an odd offset inside a device buffer
          const Tensor inner = *dh.To(gpu_)->Narrow(0, 1, n - 1)->ToDType(DType::kF32);
          EXPECT_EQ(inner.ToBytes(), dh.Narrow(0, 1, n - 1)->ToDType(DType::kF32)->ToBytes()) << DTypeName(t);
        }
      }
    }
  }
  // Writing through a view on the device writes into the parent.
  Tensor target = *Tensor::Zeros({6, 10, 7}, DType::kF32, gpu_);
  Tensor slot = *target.Narrow(1, 2, 4);
  ASSERT_TRUE(slot.CopyFrom(*host.Narrow(1, 0, 4)).ok());  // host -> device view
  Tensor want = *Tensor::Zeros({6, 10, 7}, DType::kF32);
  ASSERT_TRUE(want.Narrow(1, 2, 4)->CopyFrom(*host.Narrow(1, 0, 4)).ok());
  EXPECT_EQ(target.ToFloats(), want.ToFloats());
  // Cat on the device.
  auto cat = Tensor::Cat({*dev, *dev->Narrow(0, 1, 2)}, 0);
  ASSERT_TRUE(cat.ok()) << cat.status();
  EXPECT_EQ(cat->ToFloats(), Tensor::Cat({host, *host.Narrow(0, 1, 2)}, 0)->ToFloats());
}

// Host-to-device copies go through the pinned staging ring (kernels'
// Upload): the host buffer may be rewritten as soon as To returns, also
// when the uploads come round the ring many times faster than the device
// runs them, and large ones take the pageable path.
TEST_F(CudaTensor, UploadsMayReuseTheHostBufferAtOnce) {
  std::vector<Tensor> on_device;
  Tensor host = *Tensor::Zeros({1000}, DType::kF32);
  for (int i = 0; i < 40; ++i) {
    ASSERT_TRUE(host.CopyFrom(*Scale(*Tensor::RandomNormal({1000}, 60 + i), 1.0f)).ok());
    on_device.push_back(*host.To(gpu_));
    ASSERT_TRUE(host.CopyFrom(*Tensor::Zeros({1000}, DType::kF32)).ok());  // rewritten at once
  }
  for (int i = 0; i < 40; ++i) {
    EXPECT_EQ(on_device[i].ToFloats(), Tensor::RandomNormal({1000}, 60 + i)->ToFloats()) << i;
  }
  const Tensor big = *Tensor::RandomNormal({(2 << 20) / 4 + 3}, 99);  // over the staged size
  EXPECT_EQ(big.To(gpu_)->ToFloats(), big.ToFloats());
}

TEST_F(CudaTensor, ElementwiseOpsAndSumsMatchTheHost) {
  for (DType t : {DType::kF32, DType::kBF16, DType::kF16}) {
    const Tensor a = *Tensor::RandomNormal({333, 77}, 1, t), b = *Tensor::RandomNormal({333, 77}, 2, t);
    const Tensor da = *a.To(gpu_), db = *b.To(gpu_);
    EXPECT_EQ(Add(da, db)->ToBytes(), Add(a, b)->ToBytes()) << DTypeName(t);
    EXPECT_EQ(Sub(da, db)->ToBytes(), Sub(a, b)->ToBytes()) << DTypeName(t);
    EXPECT_EQ(Mul(da, db)->ToBytes(), Mul(a, b)->ToBytes()) << DTypeName(t);
    EXPECT_EQ(Scale(da, -0.37f)->ToBytes(), Scale(a, -0.37f)->ToBytes()) << DTypeName(t);
    EXPECT_NEAR(SumAll(da), SumAll(a), 1e-9 * 333 * 77);
    Tensor host_acc = *Tensor::Zeros({1}, DType::kF32), dev_acc = *Tensor::Zeros({1}, DType::kF32, gpu_);
    for (int rep = 0; rep < 2; ++rep) {  // accumulates, stream ordered, read once
      ASSERT_TRUE(AddSumOfSquares({a}, host_acc).ok());
      ASSERT_TRUE(AddSumOfSquares({da}, dev_acc).ok());
    }
    EXPECT_NEAR(dev_acc.ToFloats()[0], host_acc.ToFloats()[0], 1e-6 * host_acc.ToFloats()[0]) << DTypeName(t);
    EXPECT_EQ(AddSumOfSquares({da}, host_acc).code(), absl::StatusCode::kInvalidArgument);  // devices differ
    // 40 parts (two launches of partials, one final sum), an empty one too.
    std::vector<Tensor> parts, dparts;
    double want = 0;
    for (int i = 0; i < 40; ++i) {
      const Tensor part = *Tensor::RandomNormal({i == 7 ? 0 : 1 + 131 * i}, 50 + i, t);
      for (float x : part.ToFloats()) want += static_cast<double>(x) * x;
      parts.push_back(part);
      dparts.push_back(*part.To(gpu_));
    }
    Tensor list_acc = *Tensor::Zeros({1}, DType::kF32, gpu_);
    ASSERT_TRUE(AddSumOfSquares(dparts, list_acc).ok());
    EXPECT_NEAR(list_acc.ToFloats()[0], want, 1e-6 * want) << DTypeName(t);
    const Tensor dsum = *SumToTensor(da);
    EXPECT_EQ(dsum.device(), gpu_);
    EXPECT_NEAR(dsum.ToFloats()[0], SumAll(a), 1e-5 * 333 * 77) << DTypeName(t);
    const Tensor spread = *BroadcastScalar(dsum, {3, 4}, t);
    EXPECT_EQ(spread.device(), gpu_);
    EXPECT_EQ(spread.ToFloats(), std::vector<float>(12, BroadcastScalar(*dsum.To(Device::Cpu()), {1}, t)->ToFloats()[0]));
  }
  const Tensor i = *Tensor::FromInt64s({4}, {1LL << 40, -3, 7, 9});
  EXPECT_EQ(Mul(*i.To(gpu_), *i.To(gpu_))->ToInt64s(), Mul(i, i)->ToInt64s());
  auto mixed = Add(*Tensor::Zeros({2}, DType::kF32), *Tensor::Zeros({2}, DType::kF32, gpu_));
  EXPECT_EQ(mixed.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(mixed.status().message().find("cuda:0"), absl::string_view::npos) << mixed.status();
}

TEST_F(CudaTensor, AutogradRunsOnTheDevice) {
  const Tensor x = *Tensor::RandomNormal({5, 9}, 4), w = *Tensor::RandomNormal({5, 9}, 5);
  Variable vx(*x.To(gpu_), true);
  Variable loss = *Sum(*Mul(vx, Variable(*w.To(gpu_))));
  ASSERT_TRUE(Backward(loss).ok());
  ASSERT_TRUE(vx.grad().has_value());
  EXPECT_EQ(vx.grad()->device(), gpu_);
  EXPECT_EQ(vx.grad()->ToFloats(), w.ToFloats());  // d/dx sum(x*w) = w
}

}  // namespace
}  // namespace colod
