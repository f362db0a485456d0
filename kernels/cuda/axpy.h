// y <- a*x + y on a CUDA device: the first nvcc-compiled kernel, which proves
// the CUDA toolchain end to end; the kernel library proper grows around it.
#ifndef COLOD_KERNELS_CUDA_AXPY_H_
#define COLOD_KERNELS_CUDA_AXPY_H_

#include <cstdint>

#include "absl/status/status.h"

namespace colod::kernels::cuda {

// x and y are device pointers of n floats. Synchronous on the default stream.
absl::Status Axpy(float a, const float* x, float* y, int64_t n);

}  // namespace colod::kernels::cuda

#endif  // COLOD_KERNELS_CUDA_AXPY_H_
