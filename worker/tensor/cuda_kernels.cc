// The CUDA table, in builds with CUDA (the toolkit or the emulation).
#include "kernels/cuda/layer_ops.h"
#include "kernels/cuda/tensor_ops.h"
#include "worker/tensor/device_kernels.h"

namespace colod {

const DeviceKernels* CudaKernels() {
  static const DeviceKernels k = COLOD_DEVICE_KERNELS(kernels::cuda);
  return &k;
}

}  // namespace colod
