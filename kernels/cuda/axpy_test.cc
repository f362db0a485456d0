#include "kernels/cuda/axpy.h"

#include <cuda_runtime_api.h>

#include <cmath>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/device.h"

namespace colod::kernels::cuda {
namespace {

TEST(CudaAxpy, MatchesTheHostComputation) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  const int64_t n = (1 << 20) + 17;  // not a multiple of the block size
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> dist(0.5f, 2.0f);
  std::vector<float> x(n), y(n);
  for (auto& v : x) v = dist(rng);
  for (auto& v : y) v = -dist(rng);
  const float a = 1.25f;
  float *dx = nullptr, *dy = nullptr;
  ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&dx), n * sizeof(float)), cudaSuccess);
  ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&dy), n * sizeof(float)), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(dx, x.data(), n * sizeof(float), cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(dy, y.data(), n * sizeof(float), cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_TRUE(Axpy(a, dx, dy, n).ok());
  std::vector<float> got(n);
  ASSERT_EQ(cudaMemcpy(got.data(), dy, n * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
  cudaFree(dx);
  cudaFree(dy);
  for (int64_t i = 0; i < n; ++i) {
    ASSERT_FLOAT_EQ(got[i], std::fma(a, x[i], y[i])) << "at " << i;
  }
}

TEST(CudaDevice, NcclLibraryMatchesItsHeader) {
  // Needs no GPU: the linked libnccl.so.2 must be the release nccl.h describes.
  auto v = NcclVersion();
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_GE(*v, 20000);
}

TEST(CudaDevice, DescribesEveryVisibleDevice) {
  const int n = CudaDeviceCount();
  if (n == 0) GTEST_SKIP() << "no CUDA device";
  for (int i = 0; i < n; ++i) {
    auto info = GetCudaDeviceInfo(i);
    ASSERT_TRUE(info.ok()) << info.status();
    EXPECT_FALSE(info->name.empty());
    EXPECT_GT(info->memory_bytes, int64_t{1} << 30);
    EXPECT_GE(info->compute_major, 7);
  }
  EXPECT_EQ(GetCudaDeviceInfo(n).status().code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace colod::kernels::cuda
