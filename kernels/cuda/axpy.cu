#include "kernels/cuda/axpy.h"

#include <cuda_runtime.h>

#include <string>

namespace colod::kernels::cuda {
namespace {

__global__ void AxpyKernel(float a, const float* __restrict__ x, float* __restrict__ y, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    y[i] = fmaf(a, x[i], y[i]);
  }
}

}  // namespace

absl::Status Axpy(float a, const float* x, float* y, int64_t n) {
  if (n < 0) return absl::InvalidArgumentError("n must be >= 0");
  if (n == 0) return absl::OkStatus();
  const int threads = 256;
  const int64_t blocks = (n + threads - 1) / threads;
  AxpyKernel<<<static_cast<unsigned>(blocks < 65535 ? blocks : 65535), threads>>>(a, x, y, n);
  cudaError_t err = cudaGetLastError();
  if (err == cudaSuccess) err = cudaDeviceSynchronize();
  if (err != cudaSuccess) {
    return absl::InternalError(std::string("Axpy: ") + cudaGetErrorString(err));
  }
  return absl::OkStatus();
}

}  // namespace colod::kernels::cuda
