#include "worker/tensor/device_kernels.h"

#include "absl/strings/str_cat.h"
#include "kernels/cpu/layer_ops.h"
#include "kernels/cpu/tensor_ops.h"

namespace colod {

const DeviceKernels& CpuKernels() {
  static const DeviceKernels k = COLOD_DEVICE_KERNELS(kernels::cpu);
  return k;
}

absl::StatusOr<const DeviceKernels*> KernelsFor(Device device) {
  if (!device.is_cuda()) return &CpuKernels();
  if (const DeviceKernels* k = CudaKernels()) return k;
  return absl::FailedPreconditionError(absl::StrCat(
      device.ToString(), ": this binary was built without CUDA (bazel/cuda.bzl found no toolkit); "
                         "only cpu tensors are available"));
}

}  // namespace colod
