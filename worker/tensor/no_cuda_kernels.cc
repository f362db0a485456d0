// Builds without CUDA have no CUDA table: CUDA tensors are FAILED_PRECONDITION.
#include "worker/tensor/device_kernels.h"

namespace colod {

const DeviceKernels* CudaKernels() { return nullptr; }

}  // namespace colod
