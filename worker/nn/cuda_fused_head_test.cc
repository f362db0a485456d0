// The fused LM head and loss (VocabParallelLinearCrossEntropy, and
// VocabParallelLinearCrossEntropySum with the gradients taken in forward) on
// CUDA devices over NCCL (in CI the CUDA emulation's): equal to the unfused head
// (x W^T by a linear) and VocabParallelCrossEntropy on the same devices and
// dtypes, in the loss and the gradients of hidden and the weight, at tp = 1
// and 2; and its peak device memory against the unfused path's, which holds
// the logits of every row and their gradient.
#include <cuda_runtime.h>  // COLOD_CUDA_EMULATION under --config=cuda-emu

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/device.h"
#include "worker/colo/tensor_collectives.h"
#include "worker/colo/testing.h"
#include "worker/nn/functional.h"
#include "worker/nn/vocab_cross_entropy.h"

namespace colod::nn {
namespace {

using ::colod::testing::RunCudaMesh;
using ::colod::testing::TpDpMesh;

struct Grads {
  Tensor loss, dhidden, dweight;
};

// One rank's loss and gradients, fused (chunks of `chunk` rows) or not
// (chunk 0), of hidden [n, H] and the weight [V_pad, H] sharded over tp;
// hidden's gradient summed over tp in both. With `sum`, the fused head that
// returns the losses' sum, whose gradient is dloss's first element.
Grads RunHead(ProcessGroup& pg, Device dev, DType t, const Tensor& hidden, const Tensor& weight, const Tensor& labels,
              const Tensor& dloss, int64_t vocab, int64_t chunk, bool sum = false) {
  const int p = *pg.AxisSize("tp");
  const DistSpec spec = DistSpec().Set("tp", Placement::Shard({0}, {p}));
  auto w = ColoTensor::FromGlobal(*weight.ToDType(t)->To(dev), spec, &pg, /*requires_grad=*/true);
  EXPECT_TRUE(w.ok()) << w.status();
  Variable x(*hidden.ToDType(t)->To(dev), true);
  absl::StatusOr<Variable> loss;
  if (chunk > 0 && sum) {
    loss = VocabParallelLinearCrossEntropySum(x, *w, labels, vocab, chunk);
  } else if (chunk > 0) {
    loss = VocabParallelLinearCrossEntropy(x, *w, labels, vocab, chunk);
  } else {
    const DistSpec by_vocab = DistSpec().Set("tp", Placement::Shard({1}, {p}));
    auto logits = ColoTensor::FromLocal(*Linear(x, w->variable(), std::nullopt), by_vocab, &pg);
    EXPECT_TRUE(logits.ok()) << logits.status();
    loss = VocabParallelCrossEntropy(*logits, labels, vocab);
  }
  EXPECT_TRUE(loss.ok()) << loss.status();
  if (!loss.ok()) return {};
  const Tensor seed = sum ? *dloss.Narrow(0, 0, 1)->Reshape({}) : dloss;
  EXPECT_TRUE(Backward(*loss, *seed.To(dev)).ok());
  Tensor dx = *x.grad();
  if (chunk == 0 && p > 1) {  // the unfused head's input gradient is this shard's share
    EXPECT_TRUE(AllReduceInPlace(dx, ReduceOp::kSum, **pg.Comm("tp"), pg.timeout()).ok());
  }
  return {*loss->value().To(Device::Cpu()), *dx.To(Device::Cpu()), *w->variable().grad()->To(Device::Cpu())};
}

void ExpectClose(const Tensor& got, const Tensor& want, double tol, const std::string& what) {
  const std::vector<float> a = got.ToFloats(), b = want.ToFloats();
  ASSERT_EQ(a.size(), b.size()) << what;
  float largest = 0;
  for (float x : b) largest = std::max(largest, std::fabs(x));
  for (size_t i = 0; i < a.size(); ++i) {
    ASSERT_NEAR(a[i], b[i], tol * (std::fabs(b[i]) + 0.1 * largest)) << what << " at " << i;
  }
}

// f32 within f32 rounding; bf16 within its rounding of the outputs and of
// the chunks' shares of the weight's gradient (summed in f32).
TEST(CudaFusedHead, EqualsTheUnfusedHeadAndLossAtTp1And2) {
  for (int p : {1, 2}) {
    if (kernels::CudaDeviceCount() < p) GTEST_SKIP() << "needs " << p << " CUDA devices";
    for (DType t : {DType::kF32, DType::kBF16}) {
      SCOPED_TRACE(absl::StrCat("tp ", p, " ", DTypeName(t)));
      const int64_t n = 37, h = 32, v = 100, vp = 128;
      const Tensor hidden = *Tensor::RandomNormal({n, h}, 1), weight = *Tensor::RandomNormal({vp, h}, 2);
      std::vector<int64_t> lab(n);
      for (int64_t i = 0; i < n; ++i) lab[i] = i % 5 == 3 ? -100 : (i * 37) % v;
      const Tensor labels = *Tensor::FromInt64s({n}, lab), dloss = *Tensor::RandomNormal({n}, 3);
      RunCudaMesh(TpDpMesh(p), [&](int rank, ProcessGroup& pg) {
        const Device dev = Device::Cuda(rank);
        const Grads want = RunHead(pg, dev, t, hidden, weight, labels, dloss, v, 0);
        const Grads got = RunHead(pg, dev, t, hidden, weight, labels, dloss, v, 8);  // 5 chunks, the last of 5 rows
        const double tol = t == DType::kF32 ? 1e-5 : 4.0 / 128;
        ExpectClose(got.loss, want.loss, t == DType::kF32 ? 1e-5 : 1e-5, "loss");  // f32 losses of the same logits
        ExpectClose(got.dhidden, want.dhidden, tol, "hidden gradient");
        ExpectClose(got.dweight, want.dweight, tol, "weight gradient");
        // The gradients taken in forward, against the unfused head with the
        // sum's gradient (-0.7) at every row.
        const Tensor uniform = *BroadcastScalar(*Tensor::FromFloats({}, {-0.7f}), {n}, DType::kF32);
        const Grads want_sum = RunHead(pg, dev, t, hidden, weight, labels, uniform, v, 0);
        const Grads summed = RunHead(pg, dev, t, hidden, weight, labels, uniform, v, 8, /*sum=*/true);
        ASSERT_EQ(summed.loss.numel(), 1);
        ExpectClose(summed.loss, *Tensor::FromFloats({1}, {static_cast<float>(SumAll(want_sum.loss))}), 1e-5,
                    "summed loss");
        ExpectClose(summed.dhidden, want_sum.dhidden, tol, "hidden gradient, taken in forward");
        ExpectClose(summed.dweight, want_sum.dweight, tol, "weight gradient, taken in forward");
      });
    }
  }
}

// The point of it: the unfused path holds f32 logits (and the head's output
// in its dtype) and their gradient for every row; the fused one for 64 rows
// at a time. 1024 rows of a 4096-word vocabulary (16 MiB of f32 logits): the
// fused path's peak pool use above what was in use before is under a
// quarter of the unfused path's.
TEST(CudaFusedHead, PeakDeviceMemoryIsAChunkNotTheBatch) {
  if (kernels::CudaDeviceCount() < 1) GTEST_SKIP() << "no CUDA device";
  const int64_t n = 1024, h = 64, v = 4096;
  const Tensor hidden = *Tensor::RandomNormal({n, h}, 4), weight = *Tensor::RandomNormal({v, h}, 5);
  std::vector<int64_t> lab(n);
  for (int64_t i = 0; i < n; ++i) lab[i] = (i * 131) % v;
  const Tensor labels = *Tensor::FromInt64s({n}, lab), dloss = *Tensor::RandomNormal({n}, 6);
  RunCudaMesh(TpDpMesh(1), [&](int, ProcessGroup& pg) {
    const Device dev = Device::Cuda(0);
    int64_t peak[3] = {0, 0, 0};  // unfused, fused, fused with the gradients taken in forward
    for (int fused = 0; fused < 3; ++fused) {
      ASSERT_TRUE(kernels::CudaSynchronize(0).ok());
      const int64_t before = kernels::GetCudaPoolBytes(0)->used;
      ASSERT_TRUE(kernels::ResetCudaPoolPeak(0).ok());
      const Grads g =
          RunHead(pg, dev, DType::kF32, hidden, weight, labels, dloss, v, fused ? 64 : 0, /*sum=*/fused == 2);
      ASSERT_TRUE(kernels::CudaSynchronize(0).ok());
      peak[fused] = kernels::GetCudaPoolBytes(0)->used_high - before;
      ASSERT_EQ(g.loss.numel(), fused == 2 ? 1 : n);
    }
    std::printf("peak device memory above the start: unfused %.1f MiB, fused (64 rows a chunk) %.1f MiB, the "
                "gradients taken in forward %.1f MiB\n",
                peak[0] / 1048576.0, peak[1] / 1048576.0, peak[2] / 1048576.0);
    EXPECT_GE(peak[0], n * v * 4) << "the unfused path holds the f32 logits";
    EXPECT_LT(peak[1] * 4, peak[0]);
    // Taken in forward, the gradients' f32 sums (hidden's [n, H], the
    // weight's [V, H]: 1.25 MiB here) wait for the backward beside a chunk's
    // logits and their gradient.
    EXPECT_LT(peak[2] * 4, peak[0]);
    EXPECT_LE(peak[2], peak[1] + (n + v) * h * 4);
  });
}

}  // namespace
}  // namespace colod::nn
