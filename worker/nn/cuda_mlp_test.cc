// An MLP (an up projection with bias and tanh GELU, then a down projection)
// on a CUDA device, in CI the CUDA emulation's: the up projection's bias and
// GELU are its GEMM's cuBLASLt epilogue, and GELU's backward is the down
// projection's input-gradient GEMM's (the up projection's node offers it,
// the down projection's takes it), so the MLP's backward launches no kernel
// of colod's; its gradients equal the CPU's, whose twin takes the same
// offer.
#include <cuda_runtime.h>  // COLOD_CUDA_EMULATION under --config=cuda-emu

#include <cmath>
#include <string>
#include <vector>

#ifdef COLOD_CUDA_EMULATION
#include <cuda_emu.h>
#endif

#include "gtest/gtest.h"
#include "kernels/device.h"
#include "worker/nn/functional.h"

namespace colod::nn {
namespace {

// The MLP's gradients of x, w1, b1, w2 and b2 for `dout`, on `dev`; the
// kernel launches of its backward in `launches` (the emulation's count).
std::vector<Tensor> MlpGrads(Device dev, DType t, uint64_t* launches) {
  auto at = [&](const Shape& shape, uint64_t seed) {
    return *(*Tensor::RandomNormal(shape, seed)->ToDType(t)).To(dev);
  };
  Variable x(at({2, 6, 32}, 91), true), w1(at({64, 32}, 92), true), b1(at({64}, 93), true);
  Variable w2(at({32, 64}, 94), true), b2(at({32}, 95), true);
  const Tensor dout = at({2, 6, 32}, 96);
  Variable h = *Linear(x, w1, b1, Epilogue::kGeluTanh);
  EXPECT_EQ(h.op_name(), "linear_bias_gelu");
  Variable y = *Linear(h, w2, b2);
  *launches = 0;
#ifdef COLOD_CUDA_EMULATION
  const uint64_t before = colod_cuda_emu::GetCounters().kernel_launches;
#endif
  EXPECT_TRUE(Backward(y, dout).ok());
#ifdef COLOD_CUDA_EMULATION
  *launches = colod_cuda_emu::GetCounters().kernel_launches - before;
#endif
  std::vector<Tensor> grads;
  for (const Variable* v : {&x, &w1, &b1, &w2, &b2}) grads.push_back(*v->grad()->ToDType(DType::kF32));
  return grads;
}

TEST(CudaMlp, GelusBackwardIsTheDownProjectionsEpilogue) {
  if (kernels::CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  for (DType t : {DType::kF32, DType::kBF16}) {
    SCOPED_TRACE(DTypeName(t));
    uint64_t cpu_launches = 0, launches = 0;
    const std::vector<Tensor> want = MlpGrads(Device::Cpu(), t, &cpu_launches);
    const std::vector<Tensor> got = MlpGrads(Device::Cuda(0), t, &launches);
#ifdef COLOD_CUDA_EMULATION
    EXPECT_EQ(launches, 0u) << "GELU's backward and the bias sums in cuBLASLt's epilogues";
#endif
    const char* names[] = {"dx", "dw1", "db1", "dw2", "db2"};
    const double tol = t == DType::kF32 ? 1e-4 : 2e-2;
    for (size_t i = 0; i < want.size(); ++i) {
      const std::vector<float> g = (*got[i].To(Device::Cpu())).ToFloats(), w = want[i].ToFloats();
      ASSERT_EQ(g.size(), w.size()) << names[i];
      double largest = 0;
      for (float v : w) largest = std::max(largest, double{std::fabs(v)});
      for (size_t j = 0; j < w.size(); ++j) {
        ASSERT_NEAR(g[j], w[j], tol * (std::fabs(w[j]) + 0.1 * largest)) << names[i] << " at " << j;
      }
    }
  }
}

}  // namespace
}  // namespace colod::nn
