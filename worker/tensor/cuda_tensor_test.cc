// CUDA tensors against their CPU twins. Runs where a GPU is present and skips
// elsewhere; built only where the toolkit is (bazel/cuda.bzl).
#include <cuda_runtime.h>  // COLOD_CUDA_EMULATION under --config=cuda-emu

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <thread>
#include <tuple>
#include <vector>

#ifdef COLOD_CUDA_EMULATION
#include <cuda_emu.h>
#endif

#include "gtest/gtest.h"
#include "kernels/cuda/stream.h"
#include "kernels/device.h"
#include "kernels/types.h"
#include "worker/tensor/autograd.h"
#include "worker/tensor/device_kernels.h"
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

// Tensor::StartRead copies in stream order: the values as they were when
// the read started, whatever is enqueued after it; any dtype, read as f32.
TEST_F(CudaTensor, AStartedReadGivesTheValuesOfItsPlaceInTheStream) {
  auto x = Tensor::FromFloats({2, 3}, {1, 2, 3, 4, 5, 6})->To(gpu_);
  auto later = Tensor::FromFloats({2, 3}, {-1, -1, -1, -1, -1, -1})->To(gpu_);
  ASSERT_TRUE(x.ok() && later.ok());
  absl::StatusOr<PendingRead> read = x->StartRead();
  ASSERT_TRUE(read.ok()) << read.status();
  ASSERT_TRUE(x->CopyFrom(*later).ok());  // enqueued after the read
  absl::StatusOr<std::vector<float>> got = read->Floats();
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, (std::vector<float>{1, 2, 3, 4, 5, 6}));
  EXPECT_EQ(x->ToFloats(), later->ToFloats());
  EXPECT_EQ(read->Floats().status().code(), absl::StatusCode::kFailedPrecondition) << "a second finish";
  // bf16 values, converted on the device; a transposed view, made contiguous.
  auto half = Tensor::FromFloats({2, 3}, {0.5f, -1.25f, 3, 7, 1024, -0.0625f}, DType::kBF16)->To(gpu_);
  ASSERT_TRUE(half.ok());
  auto t = half->Transpose(0, 1);
  ASSERT_TRUE(t.ok());
  absl::StatusOr<PendingRead> hr = t->StartRead();
  ASSERT_TRUE(hr.ok()) << hr.status();
  got = hr->Floats();
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, t->ToFloats());
  // Too large for a read slot: refused, nothing started.
  auto big = Tensor::Zeros(Shape{static_cast<int64_t>(kernels::kMaxStartedRead / sizeof(float)) + 1}, DType::kF32,
                           gpu_);
  ASSERT_TRUE(big.ok());
  EXPECT_EQ(big->StartRead().status().code(), absl::StatusCode::kInvalidArgument);
  // Reads dropped unfinished free their slots: far more than a device holds
  // at once start one after another.
  for (int i = 0; i < 300; ++i) {
    absl::StatusOr<PendingRead> dropped = x->StartRead();
    ASSERT_TRUE(dropped.ok()) << "read " << i << ": " << dropped.status();
  }
  // As many pending as a device holds, then one more is refused, not blocked.
  std::vector<PendingRead> pending;
  absl::Status last;
  for (int i = 0; i < 1000 && last.ok(); ++i) {
    absl::StatusOr<PendingRead> r = x->StartRead();
    if (r.ok()) pending.push_back(*std::move(r));
    last = r.status();
  }
  EXPECT_EQ(last.code(), absl::StatusCode::kResourceExhausted) << last;
  EXPECT_GE(pending.size(), 8u);
  for (PendingRead& r : pending) {
    absl::StatusOr<std::vector<float>> v = r.Floats();
    ASSERT_TRUE(v.ok()) << v.status();
    EXPECT_EQ(*v, later->ToFloats());
  }
}

// The twins' tickets: a finished or dropped ticket names no read, even once
// its slot serves another; a read is finished with the size it started with.
TEST_F(CudaTensor, StartedReadTicketsAreOneUseOnBothTwins) {
  auto x = Tensor::FromFloats({4}, {1, 2, 3, 4})->To(gpu_);
  ASSERT_TRUE(x.ok());
  const Tensor host = Tensor::FromFloats({4}, {1, 2, 3, 4}).value();
  for (const auto& [k, src, index] : {std::tuple{&CpuKernels(), host.raw_data(), 0},
                                      std::tuple{CudaKernels(), static_cast<const void*>(x->raw_data()), gpu_.index}}) {
    ASSERT_NE(k, nullptr);
    float out[4] = {};
    absl::StatusOr<uint64_t> first = k->StartRead(index, src, sizeof out);
    ASSERT_TRUE(first.ok()) << first.status();
    EXPECT_NE(*first, 0u);
    ASSERT_TRUE(k->FinishRead(index, *first, out, sizeof out).ok());
    EXPECT_EQ(out[3], 4.0f);
    EXPECT_EQ(k->FinishRead(index, *first, out, sizeof out).code(), absl::StatusCode::kInvalidArgument);
    absl::StatusOr<uint64_t> second = k->StartRead(index, src, sizeof out);
    ASSERT_TRUE(second.ok()) << second.status();
    EXPECT_NE(*second, *first);
    k->DropRead(index, *first);  // stale: leaves the second alone
    EXPECT_EQ(k->FinishRead(index, *first, out, sizeof out).code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(k->FinishRead(index, *second, out, 8).code(), absl::StatusCode::kInvalidArgument) << "half of it";
    absl::StatusOr<uint64_t> third = k->StartRead(index, src, sizeof out);
    ASSERT_TRUE(third.ok()) << third.status();
    std::fill(out, out + 4, 0.0f);
    ASSERT_TRUE(k->FinishRead(index, *third, out, sizeof out).ok());
    EXPECT_EQ(out[0], 1.0f);
  }
}

#ifdef COLOD_CUDA_EMULATION
// Holds the stream that runs it until *release is set (at most 20 s; it
// says whether it was released in time).
void HoldTheStream(std::atomic<bool>* release, std::atomic<bool>* released_in_time) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (!release->load() && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  released_in_time->store(release->load());
}

// A started read waits for the work enqueued before it, not after: it
// returns while a kernel enqueued after it still holds the stream (which a
// read through pageable memory, ToFloats, would wait for), so a host that
// runs a step ahead reads one step while the next runs.
TEST_F(CudaTensor, AStartedReadWaitsForTheWorkBeforeItNotAfter) {
  auto x = Tensor::FromFloats({4}, {1, 2, 3, 4})->To(gpu_);
  ASSERT_TRUE(x.ok());
  absl::StatusOr<PendingRead> read = x->StartRead();
  ASSERT_TRUE(read.ok()) << read.status();
  absl::StatusOr<cudaStream_t> stream = kernels::cuda::ComputeStream(0);
  ASSERT_TRUE(stream.ok()) << stream.status();
  std::atomic<bool> release{false}, released_in_time{false};
  ASSERT_EQ(colod_cuda_emu::Launch(HoldTheStream, dim3(1), dim3(1), 0, *stream, &release, &released_in_time),
            cudaSuccess);
  absl::StatusOr<std::vector<float>> got = read->Floats();  // before the release
  release.store(true);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, (std::vector<float>{1, 2, 3, 4}));
  ASSERT_TRUE(kernels::CudaSynchronize(0).ok());
  EXPECT_TRUE(released_in_time.load()) << "the read waited for the kernel enqueued after it";
}
#endif

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
