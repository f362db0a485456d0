// The CUDA half of colod::Tensor: device memory, strided copies with dtype
// conversion, seeded Philox fills, elementwise ops and sums on device
// buffers. Plain C++ interface (no CUDA types), implemented in tensor_ops.cu;
// worker/tensor calls it for tensors on a CUDA device.
//
// Declared in kernels/tensor_ops.inc, as the CPU twin (kernels/cpu/
// tensor_ops.h) is. Every call selects `device` and enqueues its work on the
// device's compute stream (kernels/cuda/stream.h) without waiting for it;
// calls that give the host a value (Sum, Memcpy into host memory) return once
// it is there.
// Errors are FAILED_PRECONDITION for a missing device or driver and INTERNAL
// for a failed launch, each naming the CUDA call and error.
//
// Thread-safe (the CUDA runtime is; each call sets the calling thread's
// current device).
#ifndef COLOD_KERNELS_CUDA_TENSOR_OPS_H_
#define COLOD_KERNELS_CUDA_TENSOR_OPS_H_

#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/types.h"

namespace colod::kernels::cuda {

#include "kernels/tensor_ops.inc"  // NOLINT(build/include): the twins' shared declarations

}  // namespace colod::kernels::cuda

#endif  // COLOD_KERNELS_CUDA_TENSOR_OPS_H_
